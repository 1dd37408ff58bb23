//! `pgw`: `pgw-stack`'s `Gateway` with its defaults, over the simulator.
//!
//! Given exactly what every profile gets (timeouts, watchdogs, quotas, attempts per
//! call) and the accounts the keys belong to (so a 429 holds the account);
//! everything else is `pgw-stack`'s default. The balancer's seed is set so the run is
//! deterministic.
//!
//! In virtual time the memory backend is one process's: both workers call one
//! `Gateway` (shared breaker, limiter and cache state, as Redis would share them; the
//! process-local health and AIMD state is then shared too).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use pgw_core::BoxError;
use pgw_core::sync::lock;
use pgw_stack::config::{GatewayConfig, SourceConfig};
use pgw_stack::ratelimit::ScopeHeld;
use pgw_stack::{AttemptTelemetry, Gateway, JsonValidator, SecretKey, TelemetrySink, Validator};
use tower::ServiceExt;

use pgw_stack::config::{BackendKind, DEFAULT_COOLDOWN_S};

use super::{Built, Env, chat_call};
use crate::driver::{Client, Delivered, SoakCall};
use crate::scenario::Scenario;
use crate::telemetry::{Accounting, AttemptRow, Recorder, is_request_error};

/// Worker and token estimate of the calls in flight, for the telemetry rows.
type CallMeta = Arc<Mutex<HashMap<u64, (u32, u64)>>>;

/// Where the limiter's admission instants come from.
#[derive(Clone, Copy, Debug)]
enum AdmissionClock {
    /// The memory backend: seconds since its creation (the run's start).
    Memory,
    /// The Redis backend: Unix seconds of the server's `TIME`; rows get milliseconds
    /// since `origin_ms` (a multiple of `window_ms`, so windows stay aligned).
    Redis { origin_ms: u64, window_ms: u64 },
}

/// Turns the gateway's telemetry into the scoreboard's rows.
struct Sink {
    recorder: Recorder,
    meta: CallMeta,
    clock: AdmissionClock,
}

impl Sink {
    /// The admission instant of `r` in the rows' milliseconds.
    fn admitted_ms(&self, r: &AttemptTelemetry) -> u64 {
        // Rounded to the microsecond first so a window boundary never falls into the
        // previous window by a float's last bit.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let ms = |s: f64| ((s * 1e6).round() as u64) / 1000;
        match (self.clock, r.admitted_at_s) {
            (_, None) => self.recorder.clock().now_ms(),
            (AdmissionClock::Memory, Some(s)) => ms(s),
            (AdmissionClock::Redis { origin_ms, window_ms }, Some(s)) => {
                let mut at = ms(s);
                // The limiter's own window id is authoritative: keep the instant in it.
                if let Some(w) = r.admission_window {
                    let lo = w.saturating_mul(window_ms);
                    at = at.clamp(lo, lo.saturating_add(window_ms.saturating_sub(1)));
                }
                at.saturating_sub(origin_ms)
            }
        }
    }
}

impl TelemetrySink for Sink {
    fn record(&self, r: &AttemptTelemetry) {
        let (worker, estimate) = lock(&self.meta).get(&r.call_id).copied().unwrap_or((0, 0));
        let admitted_ms = self.admitted_ms(r);
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
            request_error: is_request_error(r.status, r.code.as_deref()),
        });
    }
}

struct PgwClient {
    gateway: Gateway,
    worker: u32,
    meta: CallMeta,
}

impl Client for PgwClient {
    fn call(&self, call: SoakCall) -> BoxFuture<'static, Result<Delivered, BoxError>> {
        let mut chat = chat_call(&call);
        if call.structured {
            chat.extensions_mut().insert(Validator::new(JsonValidator::<
                serde_json::Map<String, serde_json::Value>,
            >::new()));
        }
        lock(&self.meta).insert(call.id, (self.worker, chat.estimate_tokens()));
        let gateway = self.gateway.clone();
        let meta = Arc::clone(&self.meta);
        Box::pin(async move {
            // A streamed call is passed through: the caller's first chunk is the
            // upstream's (a structured one is buffered: validated whole).
            let result = if chat.is_stream() {
                relay(gateway.stream_call(chat).await).await
            } else {
                gateway.oneshot(chat).await.map(|a| a.answer.response.into())
            };
            lock(&meta).remove(&call.id);
            result
        })
    }
}

/// A passed-through stream as the caller consumes it: when its first chunk arrived, and
/// its chunks folded into the answer; a cut is the call's failure.
async fn relay(stream: Result<pgw_stack::ChatStream, BoxError>) -> Result<Delivered, BoxError> {
    use futures_util::StreamExt;
    let mut stream = stream?;
    let mut acc = pgw_core::openai::ChunkAccumulator::default();
    let mut first_chunk = None;
    while let Some(chunk) = stream.next().await {
        first_chunk.get_or_insert_with(tokio::time::Instant::now);
        acc.push(&chunk?);
    }
    Ok(Delivered {
        response: acc.finish(),
        first_chunk,
    })
}

fn i64_of(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The gateway configuration: the scenario's sources, keys, accounts, timeouts and
/// quotas; everything else default.
#[must_use]
pub fn gateway_config(env: &Env) -> GatewayConfig {
    let sc = &env.scenario;
    config_for(sc, |name| env.upstream.settings(sc, name).base_url)
}

fn config_for(sc: &Scenario, base_url: impl Fn(&str) -> String) -> GatewayConfig {
    let c = &sc.client;
    let mut cfg = GatewayConfig::default();
    for s in &sc.pool.sources {
        // A simulated source without a key accepts any; the gateway requires one.
        let key = SecretKey::new(s.api_key.clone().unwrap_or_else(|| "sk-sim-any".into()));
        let mut src = SourceConfig::new(s.name.as_str(), base_url(&s.name), key);
        let q = c.quota(&s.name);
        src.rpm = q.rpm.map(i64_of);
        src.tpm = q.tpm.map(i64_of);
        src.max_concurrency = Some(i64::from(q.max_concurrency));
        src.account.clone_from(&s.account);
        src.connect_timeout_s = Some(c.connect_s);
        src.first_token_timeout_s = Some(c.first_token_s);
        src.inter_token_timeout_s = Some(c.inter_token_s);
        src.total_timeout_s = Some(c.total_s);
        cfg.sources.push(src);
    }
    cfg.retry.max_attempts = Some(c.max_attempts);
    cfg.balance.seed = Some(sc.seed);
    cfg.balance.choices = sc.pgw.balance_choices;
    // The same cache as the naive and oracle profiles (the seeds' design: every
    // repeated prompt is a hit), not the gateway's deterministic-only default: the
    // soak's prompts carry no temperature, and the profiles must be compared on one
    // workload.
    cfg.cache.when = pgw_stack::config::CacheWhen::Always;
    // And the same lifetime: the naive and oracle caches keep an answer for the whole
    // run, so pgw's does too. With the gateway's 10-minute default the comparison
    // measured the TTL, not the routing: a slower run lost more repeats to expiry
    // (P6: 1340 hits against the oracle's 3435). The fallback TTL stays the default:
    // not serving a fallback group's answer past the primary's recovery is pgw's own
    // behaviour, and it pays for it here.
    cfg.cache.ttl_s = Some(SOAK_CACHE_TTL_S);
    cfg
}

/// The pgw profile's cache lifetime, s: longer than any scenario (a week), as the
/// naive and oracle caches, which never expire.
pub const SOAK_CACHE_TTL_S: f64 = 7.0 * 86_400.0;

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
            clock: AdmissionClock::Memory,
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
    Ok(Built {
        clients,
        accounting: books(gateway),
    })
}

/// What one worker process of the real-time Redis mode needs to build its gateway.
#[derive(Clone, Debug)]
pub struct RedisWorker {
    /// The shared Redis (`redis://...` or `redis+cluster://...`).
    pub redis_url: String,
    /// Prefix of every Redis key of the run (unique per run).
    pub key_prefix: String,
    /// The simulator's address (a source's base URL is `http://ADDR/{source}/v1`).
    pub sim_addr: std::net::SocketAddr,
    /// Every scenario duration times this.
    pub time_scale: f64,
    /// The rate window, ms (one scenario minute, scaled).
    pub window_ms: u64,
    /// Origin of the rows' admission instants, Unix ms (a multiple of `window_ms`).
    pub origin_ms: u64,
    /// This worker's index.
    pub index: u32,
}

/// The gateway configuration of a real-time worker: [`gateway_config`]'s sources,
/// keys, accounts and quotas over HTTP on loopback, the Redis backend, and every
/// duration (the scenario's timeouts, and the pgw defaults that are durations: rate
/// window, breaker cooldowns, windows and closed view, backoffs, stall window,
/// pushback wait, balancer wait, slow-call detection and probe interval, cache TTL)
/// times the time scale. The lease TTL stays
/// unscaled: it is a safety net for a crashed process, not a scenario duration.
#[must_use]
pub fn redis_gateway_config(sc: &Scenario, w: &RedisWorker) -> GatewayConfig {
    let s = w.time_scale;
    let mut cfg = config_for(sc, |name| format!("http://{}/{name}/v1", w.sim_addr));
    let c = &sc.client;
    for src in &mut cfg.sources {
        src.connect_timeout_s = Some(c.connect_s * s);
        src.first_token_timeout_s = Some(c.first_token_s * s);
        src.inter_token_timeout_s = Some(c.inter_token_s * s);
        src.total_timeout_s = Some(c.total_s * s);
    }
    cfg.backend = BackendKind::Redis;
    cfg.redis_url = Some(w.redis_url.clone());
    cfg.key_prefix = Some(w.key_prefix.clone());
    #[allow(clippy::cast_precision_loss)]
    let window_s = w.window_ms as f64 / 1000.0;
    cfg.ratelimit.window_s = Some(window_s);
    cfg.breaker.cooldown_s = Some(DEFAULT_COOLDOWN_S * s);
    cfg.breaker.window_s = Some(60.0 * s);
    cfg.breaker.max_cooldown_s = Some(300.0 * s);
    cfg.breaker.probe_ttl_s = Some(60.0 * s);
    cfg.breaker.closed_view_s = Some(pgw_stack::breaker::DEFAULT_CLOSED_VIEW.as_secs_f64() * s);
    cfg.retry.base_backoff_s = Some(0.5 * s);
    cfg.retry.max_backoff_s = Some(20.0 * s);
    cfg.retry.stall_window_s = Some(120.0 * s);
    cfg.retry.max_pushback_wait_s = Some(pgw_stack::retry::DEFAULT_MAX_PUSHBACK_WAIT.as_secs_f64() * s);
    cfg.balance.max_wait_s = Some(30.0 * s);
    cfg.balance.silent_after_s = Some(pgw_stack::balance::DEFAULT_SILENT_AFTER.as_secs_f64() * s);
    cfg.balance.probe_every_s = Some(pgw_stack::balance::DEFAULT_PROBE_EVERY.as_secs_f64() * s);
    cfg.cache.ttl_s = Some(SOAK_CACHE_TTL_S * s);
    cfg
}

/// Builds one real-time worker's client: a `Gateway` on the shared Redis, calling the
/// simulator over HTTP (`pgw-stack`'s default transport).
///
/// # Errors
/// The gateway's configuration error (an unreachable Redis names `redis_url`).
pub async fn build_redis(sc: &Scenario, w: &RedisWorker, recorder: &Recorder) -> Result<Built, BoxError> {
    let meta: CallMeta = Arc::default();
    let gateway = Gateway::builder(redis_gateway_config(sc, w))
        .sink(Arc::new(Sink {
            recorder: recorder.clone(),
            meta: Arc::clone(&meta),
            clock: AdmissionClock::Redis {
                origin_ms: w.origin_ms,
                window_ms: w.window_ms,
            },
        }))
        .build()
        .await?;
    let client = Arc::new(PgwClient {
        gateway: gateway.clone(),
        worker: w.index,
        meta,
    }) as Arc<dyn Client>;
    Ok(Built {
        clients: vec![client],
        accounting: books(gateway),
    })
}

type Books = Box<dyn Fn() -> BoxFuture<'static, Accounting> + Send + Sync>;

/// Slack on a lease's expiry when waiting for it: the read's round trip and the gap
/// between the Redis server's clock and tokio's.
const EXPIRY_SLACK: Duration = Duration::from_millis(100);

/// Reads the gateway's books.
///
/// Judged (`counters`): AIMD in flight and probes in flight per source, and the
/// concurrency leases still held per scope (`source:NAME`, `account:NAME`), read in
/// the backend itself with `RateLimiter::held`, minus nothing. Shown only
/// (`expired_by_ttl`): what this process failed to settle and left to its TTL by
/// design (`RateLimiter::stats`: settle and renew failures, leases lost, admissions
/// failed closed whose lease may have been written), and the leases seen to expire
/// while waiting.
///
/// Waiting: only when a backend operation failed, the held leases are read again once
/// the last of them could have expired by its TTL (`leases_expire_in`, at most the
/// lease TTL, 30 s by default). Not a short lease TTL in the Redis mode: that would
/// change what is measured (renewal every TTL/3, running calls losing their lease in a
/// 5 s outage). Not a wait on every run: with no failure, a lease still held after the
/// settle time (5 s, scaled, shorter than the TTL) was left behind and must show at
/// the first read. In the Redis mode each worker decides on its own failures; a worker
/// that saw none reads at once and would count another worker's unexpired leases: a
/// false failure, never a hidden leak (an outage fails every worker's admissions).
fn books(gateway: Gateway) -> Books {
    Box::new(move || {
        let gateway = gateway.clone();
        Box::pin(async move {
            let mut acc = Accounting::default();
            let mut failed = false;
            for h in gateway.sources() {
                let s = &h.source;
                let st = h.limiter.stats();
                failed |= st.settle_failures + st.renew_failures + st.unavailable > 0;
                for (name, n) in [
                    ("lease settle failures", st.settle_failures),
                    ("lease renew failures", st.renew_failures),
                    ("leases lost", st.leases_lost),
                    ("admissions failed closed", st.unavailable),
                ] {
                    acc.expired_by_ttl.insert(format!("{name} {s}"), n);
                }
            }
            let mut held = read_held(&gateway).await;
            if failed {
                let wait = held
                    .values()
                    .filter_map(|h| h.as_ref().and_then(|h| h.leases_expire_in))
                    .max();
                if let Some(wait) = wait {
                    tokio::time::sleep(wait + EXPIRY_SLACK).await;
                    let after = read_held(&gateway).await;
                    for (scope, first) in &held {
                        let was = first.as_ref().map_or(0, |h| h.leases);
                        let now = after
                            .get(scope)
                            .and_then(Option::as_ref)
                            .map_or(was, |h| h.leases);
                        acc.expired_by_ttl
                            .insert(format!("leases expired by TTL {scope}"), was.saturating_sub(now));
                    }
                    held = after;
                }
            }
            for (scope, h) in held {
                match h {
                    Some(h) => acc.counters.insert(format!("leases held {scope}"), h.leases),
                    // An unreadable backend cannot prove nothing was left.
                    None => acc.counters.insert(format!("limiter unreadable {scope}"), 1),
                };
            }
            for h in gateway.sources() {
                let s = &h.source;
                acc.counters
                    .insert(format!("aimd inflight {s}"), h.aimd.inflight() as u64);
                let probe = match h.breaker.view().await {
                    Ok(v) => u64::from(v.probe_in_flight),
                    // An unreadable breaker cannot prove its books are clean.
                    Err(_) => 1,
                };
                acc.counters.insert(format!("probe in flight {s}"), probe);
            }
            acc
        })
    })
}

/// What every scope of the gateway's limiters holds in the backend, by scope (an
/// account shared by several sources is read once per source; the last read wins);
/// `None` under `source:NAME` when that limiter's backend could not be read.
async fn read_held(gateway: &Gateway) -> BTreeMap<String, Option<ScopeHeld>> {
    let mut by_scope = BTreeMap::new();
    for h in gateway.sources() {
        match h.limiter.held().await {
            Ok(held) => {
                for scope in held.scopes() {
                    by_scope.insert(scope.scope.clone(), Some(scope.clone()));
                }
            }
            Err(_) => {
                by_scope.insert(format!("source:{}", h.source), None);
            }
        }
    }
    by_scope
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The books judge the leases the backend holds, whoever should have released
    /// them; the limiter's failure counters are only shown.
    #[tokio::test(start_paused = true)]
    async fn books_count_leases_held_in_the_backend() {
        let mut cfg = GatewayConfig::default();
        let mut src = SourceConfig::new("s1", "http://127.0.0.1:9/v1", SecretKey::new("k"));
        src.max_concurrency = Some(2);
        src.account = Some("a1".into());
        cfg.sources.push(src);
        let gateway = Gateway::builder(cfg).build().await.unwrap();
        let read = books(gateway.clone());
        let acc = read().await;
        assert_eq!(acc.counters.get("leases held source:s1"), Some(&0), "{acc:?}");
        assert_eq!(acc.counters.get("leases held account:a1"), Some(&0), "{acc:?}");
        assert_eq!(acc.expired_by_ttl.get("lease settle failures s1"), Some(&0));

        let limiter = &gateway.sources()[0].limiter;
        limiter.acquire(0).await.unwrap().forget(); // never released, nothing failed
        let acc = read().await;
        assert_eq!(acc.counters.get("leases held source:s1"), Some(&1), "{acc:?}");
        // The account has no concurrency limit here: its scope holds no leases.
        assert_eq!(acc.counters.get("leases held account:a1"), Some(&0), "{acc:?}");
        assert!(
            !acc.expired_by_ttl
                .keys()
                .any(|k| k.starts_with("leases expired by TTL"))
        );
    }

    /// After a backend failure the books wait out the leases' TTL: a lease held when
    /// a failure happened (here a permit forgotten after an admission that failed
    /// closed: Redis paused past the response timeout) is seen held, then seen to
    /// expire, and is not judged as left behind. The failed admission itself ran when
    /// the pause ended, and its late answer was undone: it holds nothing.
    #[tokio::test]
    async fn books_wait_out_the_ttl_after_a_failure() {
        let server = pgw_test_support::PrivateRedis::start();
        let mut cfg = GatewayConfig::default();
        let mut src = SourceConfig::new("s1", "http://127.0.0.1:9/v1", SecretKey::new("k"));
        src.max_concurrency = Some(2);
        cfg.sources.push(src);
        cfg.backend = BackendKind::Redis;
        cfg.redis_url = Some(server.url());
        cfg.key_prefix = Some(pgw_test_support::unique_prefix("books_wait"));
        cfg.ratelimit.lease_ttl_s = Some(1.0);
        let gateway = Gateway::builder(cfg).build().await.unwrap();
        let read = books(gateway.clone());
        let limiter = gateway.sources()[0].limiter.clone();
        // Loads the scripts, so the paused admission below is one EVALSHA that runs.
        limiter.acquire(0).await.unwrap().finish(None).await.unwrap();
        assert_eq!(read().await.counters.get("leases held source:s1"), Some(&0));

        let cli = std::env::var_os("PGW_REDIS_CLI").unwrap_or_else(|| "redis-cli".into());
        let paused = std::process::Command::new(cli)
            .args(["-p", &server.port().to_string(), "client", "pause", "1200", "all"])
            .output()
            .expect("redis-cli");
        assert!(paused.status.success(), "{paused:?}");
        limiter.acquire(0).await.unwrap_err();
        assert_eq!(limiter.stats().unavailable, 1);
        tokio::time::sleep(Duration::from_millis(1000)).await; // the pause is over
        let mut undone = false;
        for _ in 0..100 {
            if limiter.held().await.unwrap().source.leases == 0 {
                undone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(undone, "the admission answered after the pause was undone");
        limiter.acquire(0).await.unwrap().forget(); // held, never released
        assert_eq!(limiter.held().await.unwrap().source.leases, 1);

        let started = tokio::time::Instant::now();
        let acc = read().await;
        assert_eq!(acc.counters.get("leases held source:s1"), Some(&0), "{acc:?}");
        assert_eq!(
            acc.expired_by_ttl.get("leases expired by TTL source:s1"),
            Some(&1),
            "{acc:?}"
        );
        assert_eq!(acc.expired_by_ttl.get("admissions failed closed s1"), Some(&1));
        assert!(
            started.elapsed() <= Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }
}
