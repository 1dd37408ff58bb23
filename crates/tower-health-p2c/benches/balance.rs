//! Per-call cost of the balancer against tower's `p2c::Balance` (PendingRequests) over
//! the same 5 always-ready endpoints, in one run (DESIGN.md section 6).
//!
//! `cargo bench -p tower-health-p2c --bench balance`

use std::convert::Infallible;
use std::future::{Ready, ready};

use futures_util::FutureExt;
use pgw_core::{CallHistory, CarriesHistory};
use tower::balance::p2c::Balance;
use tower::discover::ServiceList;
use tower::load::{CompleteOnResponse, PendingRequests};
use tower::{Service, service_fn};
use tower_health_p2c::{BalanceConfig, HealthP2c, Policy, Sources};

fn main() {
    divan::main();
}

#[derive(Clone, Default)]
struct Req(Option<CallHistory>);

impl CarriesHistory for Req {
    fn call_history(&self) -> Option<&CallHistory> {
        self.0.as_ref()
    }
    fn set_call_history(&mut self, h: CallHistory) {
        self.0 = Some(h);
    }
}

fn endpoint()
-> impl Service<Req, Response = u32, Error = Infallible, Future = Ready<Result<u32, Infallible>>> + Clone {
    service_fn(|_: Req| ready(Ok::<_, Infallible>(1)))
}

fn drive<S: Service<Req>>(svc: &mut S) -> bool
where
    S::Error: std::fmt::Debug,
{
    svc.ready_now();
    svc.call(Req::default()).now_or_never().is_some_and(|r| r.is_ok())
}

trait ReadyNow {
    fn ready_now(&mut self);
}

impl<S: Service<Req>> ReadyNow for S
where
    S::Error: std::fmt::Debug,
{
    fn ready_now(&mut self) {
        let waker = futures_util::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(self.poll_ready(&mut cx).is_ready());
    }
}

/// A balancer over 5 always-ready endpoints with `config`.
fn balancer(
    config: BalanceConfig,
) -> HealthP2c<
    impl Service<Req, Response = u32, Error = Infallible, Future = Ready<Result<u32, Infallible>>> + Clone,
> {
    let sources = Sources::new();
    for i in 0..5 {
        sources.insert(format!("s{i}").into(), endpoint());
    }
    HealthP2c::new(sources, config).unwrap().with_seed(1)
}

#[divan::bench(args = [Policy::HealthAware, Policy::RoundRobin, Policy::LeastInflight], sample_count = 500, sample_size = 64)]
fn health_p2c(b: divan::Bencher<'_, '_>, policy: Policy) {
    let mut lb = balancer(BalanceConfig {
        policy,
        ..BalanceConfig::default()
    });
    b.bench_local(|| drive(&mut lb));
}

/// `health_aware` comparing every source (`CHOICES_ALL`, as pgw-stack's gateway runs
/// it) instead of two drawn at random.
#[divan::bench(sample_count = 500, sample_size = 64)]
fn health_p2c_best_of_all(b: divan::Bencher<'_, '_>) {
    let mut lb = balancer(BalanceConfig {
        choices: tower_health_p2c::CHOICES_ALL,
        ..BalanceConfig::default()
    });
    b.bench_local(|| drive(&mut lb));
}

#[divan::bench(sample_count = 500, sample_size = 64)]
fn tower_p2c_pending_requests(b: divan::Bencher<'_, '_>) {
    let endpoints: Vec<_> = (0..5)
        .map(|_| PendingRequests::new(endpoint(), CompleteOnResponse::default()))
        .collect();
    let mut lb = Balance::new(ServiceList::new(endpoints));
    b.bench_local(|| drive(&mut lb));
}

/// The call carries a fresh in-call history with one earlier failure (the full-order
/// path of a retry); building the history is outside the timing.
#[divan::bench(sample_count = 500, sample_size = 64)]
fn health_p2c_with_history(b: divan::Bencher<'_, '_>) {
    let mut lb = balancer(BalanceConfig::default());
    b.with_inputs(|| {
        let history = CallHistory::new();
        history.record(Some("s0".into()), pgw_core::Outcome::Transient);
        Req(Some(history))
    })
    .bench_local_values(|req| {
        lb.ready_now();
        lb.call(req).now_or_never().is_some()
    });
}
