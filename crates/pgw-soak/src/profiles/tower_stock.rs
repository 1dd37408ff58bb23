//! `tower-stock`: what a user assembles from tower alone, given the same timeouts,
//! watchdogs and quotas as every profile.
//!
//! Per worker (tower's state is process-local):
//! `Retry(TpsBudget) -> Buffer -> balance::p2c(PendingRequests | PeakEwma)` over the
//! sources, each `RateLimit(rpm) -> ConcurrencyLimit -> upstream client`.
//!
//! - Quotas are process-local in tower, so each worker gets its share
//!   (`rpm / workers`, `max_concurrency / workers`, at least 1): what a careful user of
//!   several processes does. tower has no TPM limiter: TPM is not enforced (the
//!   scoreboard still judges it).
//! - tower has no breaker: the balancer only sees load (pending requests or latency),
//!   so fast failures (401) look attractive.
//! - The retry policy retries every failure but 400 (and invalid structured answers),
//!   up to the same 3 attempts, within a `TpsBudget`, with exponential backoff; a
//!   429 consumes an attempt like any error.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use pgw_client::{ChatAnswer, ChatCall};
use pgw_core::{BoxError, Outcome, classify_error};
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};
use tower::balance::p2c::Balance;
use tower::buffer::Buffer;
use tower::discover::ServiceList;
use tower::limit::{ConcurrencyLimit, RateLimit, rate::Rate};
use tower::load::{CompleteOnResponse, PeakEwma, PendingRequests};
use tower::retry::budget::{Budget, TpsBudget};
use tower::retry::{Policy, Retry};
use tower::{Service, ServiceExt};

use super::{Built, Env, Inflight, Recorded, chat_call};
use crate::driver::{Client, Delivered, SoakCall};
use crate::scenario::{QUOTA_WINDOW, TowerLoad};
use crate::telemetry::Accounting;

/// A seeded RNG for the balancer (tower's p2c takes any `tower::util::rng::Rng`), so
/// a run is deterministic.
struct SeededRng(SmallRng);

impl tower::util::rng::Rng for SeededRng {
    fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
}

/// Whether the call asks for structured output (P3: `response_format: json_*`).
fn wants_json(call: &ChatCall) -> bool {
    call.request()
        .extra
        .get("response_format")
        .and_then(|f| f.get("type"))
        .and_then(|t| t.as_str())
        .is_some_and(|t| t.starts_with("json"))
}

/// tower's retry `Policy` with a shared `TpsBudget`: a fresh clone per call holds the
/// call's remaining attempts.
#[derive(Clone)]
struct StockPolicy {
    budget: Arc<TpsBudget>,
    left: u32,
    tries: u32,
    backoff: Duration,
}

impl Policy<ChatCall, ChatAnswer, BoxError> for StockPolicy {
    type Future = tokio::time::Sleep;

    fn retry(
        &mut self,
        req: &mut ChatCall,
        result: &mut Result<ChatAnswer, BoxError>,
    ) -> Option<Self::Future> {
        let failed = match result {
            Ok(a) => {
                a.response.is_empty_completion()
                    || (wants_json(req) && !pgw_sim::p6::is_valid_structured(a.content()))
            }
            Err(e) => {
                if classify_error(&**e) == Outcome::Rejected {
                    return None;
                }
                true
            }
        };
        if !failed {
            self.budget.deposit();
            return None;
        }
        if self.left <= 1 || !self.budget.withdraw() {
            return None;
        }
        self.left -= 1;
        self.tries += 1;
        Some(tokio::time::sleep(
            self.backoff * 2u32.saturating_pow(self.tries - 1),
        ))
    }

    fn clone_request(&mut self, req: &ChatCall) -> Option<ChatCall> {
        Some(req.clone())
    }
}

struct StockClient<S>(S);

impl<S> Client for StockClient<S>
where
    S: Service<ChatCall, Response = ChatAnswer, Error = BoxError> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
{
    fn call(&self, call: SoakCall) -> BoxFuture<'static, Result<Delivered, BoxError>> {
        let svc = self.0.clone();
        let chat = chat_call(&call);
        Box::pin(async move { svc.oneshot(chat).await.map(|a| a.response.into()) })
    }
}

/// Builds the tower-stock profile: one independent stack per worker.
///
/// # Errors
/// Unknown source or bad client settings.
pub fn build(env: &Env) -> Result<Built, BoxError> {
    let sc = &env.scenario;
    let names = env.sources();
    let inflight = Inflight::new(&names);
    let workers = u64::from(sc.workers.max(1));
    let ts = &sc.tower_stock;
    let budget = |_: u32| {
        Arc::new(TpsBudget::new(
            Duration::from_secs(ts.budget_ttl_s),
            ts.budget_min_per_sec,
            ts.budget_retry_percent,
        ))
    };
    let mut clients: Vec<Arc<dyn Client>> = Vec::new();
    for w in 0..sc.workers {
        let mut endpoints = Vec::new();
        for name in &names {
            let q = sc.client.quota(name);
            let rpm = q.rpm.map_or(u64::MAX, |r| (r / workers).max(1));
            let conc = ((u64::from(q.max_concurrency) / workers).max(1)) as usize;
            let svc = Recorded::new(
                env.upstream.client(sc, name)?,
                name,
                w,
                env.recorder.clone(),
                inflight.clone(),
            );
            let svc = RateLimit::new(ConcurrencyLimit::new(svc, conc), Rate::new(rpm, QUOTA_WINDOW));
            endpoints.push(svc);
        }
        let rng = SeededRng(SmallRng::seed_from_u64(sc.seed ^ (0x70_3E5 + u64::from(w))));
        let policy = StockPolicy {
            budget: budget(w),
            left: sc.client.max_attempts,
            tries: 0,
            backoff: Duration::from_secs_f64(ts.backoff_s),
        };
        let bound = sc.concurrency as usize;
        let client: Arc<dyn Client> = match ts.load {
            TowerLoad::PendingRequests => {
                let list = ServiceList::new(
                    endpoints
                        .into_iter()
                        .map(|s| PendingRequests::new(s, CompleteOnResponse::default()))
                        .collect::<Vec<_>>(),
                );
                let balance = Balance::from_rng(list, rng);
                Arc::new(StockClient(Retry::new(policy, Buffer::new(balance, bound))))
            }
            TowerLoad::PeakEwma => {
                let list = ServiceList::new(
                    endpoints
                        .into_iter()
                        .map(|s| {
                            PeakEwma::new(s, Duration::from_secs(1), 10e9, CompleteOnResponse::default())
                        })
                        .collect::<Vec<_>>(),
                );
                let balance = Balance::from_rng(list, rng);
                Arc::new(StockClient(Retry::new(policy, Buffer::new(balance, bound))))
            }
        };
        clients.push(client);
    }
    Ok(Built {
        clients,
        accounting: Box::new(move || {
            Box::pin(std::future::ready({
                let mut acc = Accounting::default();
                inflight.report(&mut acc);
                acc
            }))
        }),
    })
}
