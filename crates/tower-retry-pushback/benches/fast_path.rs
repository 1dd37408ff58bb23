//! The no-retry fast path (one attempt that succeeds, an always-ready inner service,
//! one task) against `tower::retry::Retry` with a trivial policy, in the same run.
//!
//! Run with `cargo bench -p tower-retry-pushback --bench fast_path`.

use std::future::{Ready, ready};
use std::sync::Arc;
use std::task::{Context, Poll};

use divan::Bencher;
use futures_util::FutureExt;
use futures_util::task::noop_waker_ref;
use pgw_core::{BoxError, CallHistory, CarriesHistory};
use tower::retry::Policy;
use tower::retry::budget::{Budget, TpsBudget};
use tower::{Layer, Service};
use tower_retry_pushback::{HistoryMode, RetryBudgetConfig, RetryConfig, RetryLayer};

fn main() {
    divan::main();
}

/// A small request, cheap to clone, with room for the call's history.
#[derive(Clone, Debug)]
struct Req {
    n: u64,
    history: Option<CallHistory>,
}

impl CarriesHistory for Req {
    fn call_history(&self) -> Option<&CallHistory> {
        self.history.as_ref()
    }
    fn set_call_history(&mut self, history: CallHistory) {
        self.history = Some(history);
    }
}

/// Always ready, answers at once.
#[derive(Clone, Copy, Debug)]
struct Echo;

impl Service<Req> for Echo {
    type Response = u64;
    type Error = BoxError;
    type Future = Ready<Result<u64, BoxError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Req) -> Self::Future {
        ready(Ok(req.n))
    }
}

/// tower's retry with the most trivial policy that can still retry: clone the
/// request, never retry.
#[derive(Clone, Copy, Debug)]
struct NoRetry;

impl Policy<Req, u64, BoxError> for NoRetry {
    type Future = Ready<()>;

    fn retry(&mut self, _: &mut Req, _: &mut Result<u64, BoxError>) -> Option<Self::Future> {
        None
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        Some(req.clone())
    }
}

fn one_call<S: Service<Req, Response = u64>>(svc: &mut S, n: u64) -> u64
where
    S::Error: std::fmt::Debug,
{
    let mut cx = Context::from_waker(noop_waker_ref());
    assert!(svc.poll_ready(&mut cx).is_ready());
    let fut = svc.call(Req { n, history: None });
    fut.now_or_never().unwrap().unwrap()
}

/// tower's retry with a `TpsBudget` (deposit per request, withdraw per retry): the
/// counterpart of `pgw_retry_with_budget`.
#[derive(Clone, Debug)]
struct TpsPolicy(Arc<TpsBudget>);

impl Policy<Req, u64, BoxError> for TpsPolicy {
    type Future = Ready<()>;

    fn retry(&mut self, _: &mut Req, result: &mut Result<u64, BoxError>) -> Option<Self::Future> {
        match result {
            Ok(_) => {
                self.0.deposit();
                None
            }
            Err(_) => self.0.withdraw().then(|| ready(())),
        }
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        Some(req.clone())
    }
}

#[divan::bench]
fn tower_retry_tps_budget(b: Bencher<'_, '_>) {
    let policy = TpsPolicy(Arc::new(TpsBudget::default()));
    let mut svc = tower::retry::RetryLayer::new(policy).layer(Echo);
    b.bench_local(|| one_call(&mut svc, divan::black_box(1)));
}

#[divan::bench]
fn tower_retry_trivial_policy(b: Bencher<'_, '_>) {
    let mut svc = tower::retry::RetryLayer::new(NoRetry).layer(Echo);
    b.bench_local(|| one_call(&mut svc, divan::black_box(1)));
}

#[divan::bench]
fn pgw_retry_default(b: Bencher<'_, '_>) {
    let mut svc = RetryLayer::default().layer(Echo);
    b.bench_local(|| one_call(&mut svc, divan::black_box(1)));
}

/// History attached from the first retry on: nothing allocated on the fast path.
#[divan::bench]
fn pgw_retry_history_from_first_retry(b: Bencher<'_, '_>) {
    let mut svc = RetryLayer::default()
        .history_mode(HistoryMode::FromFirstRetry)
        .layer(Echo);
    b.bench_local(|| one_call(&mut svc, divan::black_box(1)));
}

/// The caller attached a history already (made outside the timed part).
#[divan::bench]
fn pgw_retry_caller_history(b: Bencher<'_, '_>) {
    let mut svc = RetryLayer::default().layer(Echo);
    let mut cx = Context::from_waker(noop_waker_ref());
    b.with_inputs(|| Req {
        n: 1,
        history: Some(CallHistory::new()),
    })
    .bench_local_values(|req| {
        assert!(svc.poll_ready(&mut cx).is_ready());
        svc.call(req).now_or_never().unwrap().unwrap()
    });
}

#[divan::bench]
fn pgw_retry_with_budget(b: Bencher<'_, '_>) {
    let layer = RetryLayer::new(RetryConfig {
        retry_budget: Some(RetryBudgetConfig::default()),
        ..RetryConfig::default()
    })
    .unwrap();
    let mut svc = layer.layer(Echo);
    b.bench_local(|| one_call(&mut svc, divan::black_box(1)));
}
