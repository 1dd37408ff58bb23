//! `pgw`: `pgw-stack`'s `Gateway` with its defaults, over the simulator.
//!
//! Given exactly what every profile gets (timeouts, watchdogs, quotas, attempts per
//! call) and the accounts the keys belong to (so a 429 holds the account, R3/L9);
//! everything else is `pgw-stack`'s default. The balancer's seed is set so the run is
//! deterministic.
//!
//! In virtual time the memory backend is one process's: both workers call one
//! `Gateway` (shared breaker, limiter and cache state, as Redis would share them; the
//! process-local health and AIMD state is then shared too).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use futures_util::future::BoxFuture;
use pgw_core::BoxError;
use pgw_core::openai::ChatResponse;
use pgw_stack::config::{GatewayConfig, SourceConfig};
use pgw_stack::{AttemptTelemetry, Gateway, JsonValidator, SecretKey, TelemetrySink, Validator};
use tower::ServiceExt;

use super::{Built, Env, chat_call};
use crate::driver::{Client, SoakCall};
use crate::telemetry::{Accounting, AttemptRow, Recorder};

/// Worker and token estimate of the calls in flight, for the telemetry rows.
type CallMeta = Arc<Mutex<HashMap<u64, (u32, u64)>>>;

/// Turns the gateway's telemetry (S6) into the scoreboard's rows.
struct Sink {
    recorder: Recorder,
    meta: CallMeta,
}

impl TelemetrySink for Sink {
    fn record(&self, r: &AttemptTelemetry) {
        let (worker, estimate) = self
            .meta
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&r.call_id)
            .copied()
            .unwrap_or((0, 0));
        // Seconds since the limiter's epoch (the memory backend's creation, which is
        // the run's start): rounded to the microsecond first so a window boundary
        // never falls into the previous window by a float's last bit.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let admitted_ms = r.admitted_at_s.map_or_else(
            || self.recorder.clock().now_ms(),
            |s| ((s * 1e6).round() as u64) / 1000,
        );
        let tokens = match (r.prompt_tokens, r.completion_tokens) {
            (Some(p), Some(c)) => p + c,
            _ => estimate,
        };
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let ms = |f: f64| f.max(0.0).round() as u64;
        self.recorder.attempt(AttemptRow {
            call_id: r.call_id.to_string(),
            attempt: r.attempt,
            worker,
            source: r
                .source
                .as_ref()
                .map_or_else(|| "none".into(), ToString::to_string),
            admitted_ms,
            latency_ms: ms(r.latency_ms),
            ttft_ms: r.ttft_ms.map(ms),
            tokens,
            outcome: r.outcome.to_owned(),
            cache_hit: r.cache_hit,
        });
    }
}

struct PgwClient {
    gateway: Gateway,
    worker: u32,
    meta: CallMeta,
}

impl Client for PgwClient {
    fn call(&self, call: SoakCall) -> BoxFuture<'static, Result<ChatResponse, BoxError>> {
        let mut chat = chat_call(&call);
        if call.structured {
            chat.extensions_mut().insert(Validator::new(JsonValidator::<
                serde_json::Map<String, serde_json::Value>,
            >::new()));
        }
        self.meta
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(call.id, (self.worker, chat.estimate_tokens()));
        let gateway = self.gateway.clone();
        let meta = Arc::clone(&self.meta);
        Box::pin(async move {
            let result = gateway.oneshot(chat).await;
            meta.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&call.id);
            result.map(|a| a.answer.response)
        })
    }
}

fn i64_of(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The gateway configuration: the scenario's sources, keys, accounts, timeouts and
/// quotas; everything else default.
#[must_use]
pub fn gateway_config(env: &Env) -> GatewayConfig {
    let sc = &env.scenario;
    let c = &sc.client;
    let mut cfg = GatewayConfig::default();
    for s in &sc.pool.sources {
        let key = SecretKey::new(s.api_key.clone().unwrap_or_default());
        let mut src = SourceConfig::new(s.name.as_str(), env.upstream.settings(sc, &s.name).base_url, key);
        if let Some(q) = c.quota(&s.name) {
            src.rpm = q.rpm.map(i64_of);
            src.tpm = q.tpm.map(i64_of);
            src.max_concurrency = Some(i64::from(q.max_concurrency));
        }
        src.account.clone_from(&s.account);
        src.connect_timeout_s = Some(c.connect_s);
        src.first_token_timeout_s = Some(c.first_token_s);
        src.inter_token_timeout_s = Some(c.inter_token_s);
        src.total_timeout_s = Some(c.total_s);
        cfg.sources.push(src);
    }
    cfg.retry.max_attempts = Some(c.max_attempts);
    cfg.balance.seed = Some(sc.seed);
    cfg
}

/// Builds the pgw profile: one `Gateway` over the simulator, shared by the workers.
///
/// # Errors
/// The gateway's configuration error.
pub async fn build(env: &Env) -> Result<Built, BoxError> {
    let meta: CallMeta = Arc::default();
    let upstream = env.upstream.clone();
    let gateway = Gateway::builder(gateway_config(env))
        .transport(move |s: &SourceConfig| upstream.transport(&s.name))
        .sink(Arc::new(Sink {
            recorder: env.recorder.clone(),
            meta: Arc::clone(&meta),
        }))
        .build()
        .await?;
    let clients = (0..env.scenario.workers)
        .map(|worker| {
            Arc::new(PgwClient {
                gateway: gateway.clone(),
                worker,
                meta: Arc::clone(&meta),
            }) as Arc<dyn Client>
        })
        .collect();
    let books = gateway.clone();
    Ok(Built {
        clients,
        accounting: Box::new(move || {
            let books = books.clone();
            Box::pin(async move {
                let mut acc = Accounting::default();
                for h in books.sources() {
                    let s = &h.source;
                    acc.counters
                        .insert(format!("aimd inflight {s}"), h.aimd.inflight() as u64);
                    let st = h.limiter.stats();
                    acc.counters
                        .insert(format!("lease settle failures {s}"), st.settle_failures);
                    acc.counters.insert(format!("leases lost {s}"), st.leases_lost);
                    let probe = match h.breaker.view().await {
                        Ok(v) => u64::from(v.probe_in_flight),
                        // An unreadable breaker cannot prove its books are clean.
                        Err(_) => 1,
                    };
                    acc.counters.insert(format!("probe in flight {s}"), probe);
                }
                acc
            })
        }),
    })
}
