//! Per-call cost of the whole in-memory path (retry + health-aware balancer over 5
//! sources, each AIMD -> breaker -> rate limiter) against tower's RL + CL + Retry +
//! p2c(PendingRequests) over the same 5 always-ready endpoints, in one run
//! (DESIGN.md section 6: target <= 1.3x).
//!
//! Also in the run, to say where the time goes: the balancer alone over 5 bare
//! endpoints against tower's `p2c::Balance` alone, and the retry layer over that bare
//! balancer (the retry layer's cost, the call's history included, is the difference).
//!
//! The retry layer is configured as the gateway configures it
//! (`HistoryMode::OnDemand`: the call's history is made when an attempt fails).
//!
//! tower's `p2c::Balance` is not `Clone` and `Retry` needs a `Clone` inner service, so
//! the tower stack shares its balancer through an uncontended `Arc<Mutex<_>>` (a few
//! ns) rather than a `Buffer` (hundreds of ns), to keep the comparison fair to tower.
//!
//! `cargo bench -p pgw-stack --bench stack`

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::FutureExt;
use pgw_core::BoxError;
use pgw_core::openai::ChatRequest;
use pgw_stack::ChatCall;
use pgw_stack::aimd::{AimdConfig, AimdLayer};
use pgw_stack::balance::{BalanceConfig, HealthP2c, Sources};
use pgw_stack::breaker::{BreakerConfig, BreakerLayer};
use pgw_stack::ratelimit::{MemoryBackend, NoTokens, Quota, RateLimitConfig, RateLimitLayer, RateLimiter};
use pgw_stack::retry::{HistoryMode, RetryConfig, RetryLayer};
use tower::balance::p2c::Balance;
use tower::discover::ServiceList;
use tower::load::{CompleteOnResponse, PendingRequests};
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceBuilder, service_fn};

fn main() {
    divan::main();
}

fn endpoint()
-> impl Service<ChatCall, Response = u32, Error = Infallible, Future = Ready<Result<u32, Infallible>>>
+ Clone
+ Send
+ Sync
+ 'static {
    service_fn(|_: ChatCall| ready(Ok::<_, Infallible>(1)))
}

fn drive<S: Service<ChatCall>>(svc: &mut S, call: &ChatCall) -> bool {
    let waker = futures_util::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    assert!(svc.poll_ready(&mut cx).is_ready());
    svc.call(call.clone()).now_or_never().is_some_and(|r| r.is_ok())
}

type Src = BoxCloneSyncService<ChatCall, u32, BoxError>;

fn pgw_stack() -> impl Service<ChatCall, Response = u32, Error = BoxError> {
    let backend = MemoryBackend::new();
    let sources: Sources<Src> = Sources::new();
    for i in 0..5 {
        let name = format!("s{i}");
        let limiter = RateLimiter::new(
            RateLimitConfig::new(name.as_str(), Quota::unlimited().requests(1 << 40)),
            backend.clone(),
        )
        .unwrap();
        let rl = RateLimitLayer::new(limiter)
            .token_estimate(NoTokens)
            .usage(NoTokens);
        let breaker = BreakerLayer::memory(
            name.as_str(),
            &BreakerConfig::builder()
                .fail_threshold(5)
                .cooldown(Duration::from_secs(30))
                .build()
                .unwrap(),
        );
        let aimd = AimdLayer::new(AimdConfig::default())
            .unwrap()
            .with_source(name.as_str().into())
            .with_release_signal(sources.wake_signal())
            .shedding();
        let svc = aimd.layer(breaker.layer(rl.layer(tower::ServiceExt::map_err(endpoint(), BoxError::from))));
        sources.insert(name.as_str().into(), BoxCloneSyncService::new(svc));
    }
    let lb = HealthP2c::new(sources, gateway_balance()).unwrap().with_seed(1);
    RetryLayer::new(RetryConfig::default())
        .unwrap()
        .history_mode(HistoryMode::OnDemand)
        .layer(lb)
}

fn pgw_stack_unboxed() -> impl Service<ChatCall, Response = u32, Error = BoxError> {
    let backend = MemoryBackend::new();
    let sources = Sources::new();
    for i in 0..5 {
        let name = format!("s{i}");
        let limiter = RateLimiter::new(
            RateLimitConfig::new(name.as_str(), Quota::unlimited().requests(1 << 40)),
            backend.clone(),
        )
        .unwrap();
        let rl = RateLimitLayer::new(limiter)
            .token_estimate(NoTokens)
            .usage(NoTokens);
        let breaker = BreakerLayer::memory(
            name.as_str(),
            &BreakerConfig::builder()
                .fail_threshold(5)
                .cooldown(Duration::from_secs(30))
                .build()
                .unwrap(),
        );
        let aimd = AimdLayer::new(AimdConfig::default())
            .unwrap()
            .with_source(name.as_str().into())
            .with_release_signal(sources.wake_signal())
            .shedding();
        let svc = aimd.layer(breaker.layer(rl.layer(tower::ServiceExt::map_err(endpoint(), BoxError::from))));
        sources.insert(name.as_str().into(), svc);
    }
    let lb = HealthP2c::new(sources, gateway_balance()).unwrap().with_seed(1);
    RetryLayer::new(RetryConfig::default())
        .unwrap()
        .history_mode(HistoryMode::OnDemand)
        .layer(lb)
}

#[derive(Clone)]
struct Attempts(usize);

impl<E> tower::retry::Policy<ChatCall, u32, E> for Attempts {
    type Future = Ready<()>;
    fn retry(&mut self, _req: &mut ChatCall, result: &mut Result<u32, E>) -> Option<Self::Future> {
        match result {
            Err(_) if self.0 > 0 => {
                self.0 -= 1;
                Some(ready(()))
            }
            _ => None,
        }
    }
    fn clone_request(&mut self, req: &ChatCall) -> Option<ChatCall> {
        Some(req.clone())
    }
}

struct Shared<S>(Arc<Mutex<S>>);

impl<S> Clone for Shared<S> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<S: Service<ChatCall>> Service<ChatCall> for Shared<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.lock().unwrap().poll_ready(cx)
    }
    fn call(&mut self, req: ChatCall) -> S::Future {
        self.0.lock().unwrap().call(req)
    }
}

fn tower_stack() -> impl Service<ChatCall, Response = u32, Error = BoxError> {
    let endpoints: Vec<_> = (0..5)
        .map(|_| PendingRequests::new(endpoint(), CompleteOnResponse::default()))
        .collect();
    let lb = Shared(Arc::new(Mutex::new(Balance::new(ServiceList::new(endpoints)))));
    ServiceBuilder::new()
        .rate_limit(u64::MAX / 4, Duration::from_secs(60))
        .concurrency_limit(1_000_000)
        .retry(Attempts(3))
        .service(lb)
}

fn call() -> ChatCall {
    ChatCall::new(ChatRequest::user("m", "hello"))
}

#[divan::bench(sample_count = 500, sample_size = 200)]
fn pgw_in_memory_path(b: divan::Bencher<'_, '_>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _g = rt.enter();
    let mut svc = pgw_stack();
    let c = call();
    b.bench_local(|| drive(&mut svc, &c));
}

#[divan::bench(sample_count = 500, sample_size = 200)]
fn tower_rl_cl_retry_p2c(b: divan::Bencher<'_, '_>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _g = rt.enter();
    let mut svc = tower_stack();
    let c = call();
    b.bench_local(|| drive(&mut svc, &c));
}

#[divan::bench(sample_count = 500, sample_size = 200)]
fn pgw_in_memory_path_unboxed(b: divan::Bencher<'_, '_>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _g = rt.enter();
    let mut svc = pgw_stack_unboxed();
    let c = call();
    b.bench_local(|| drive(&mut svc, &c));
}

/// The balancer's settings as the gateway runs it: every source compared for an
/// attempt's first candidate (`GATEWAY_CHOICES`), where tower-health-p2c alone draws two.
fn gateway_balance() -> BalanceConfig {
    BalanceConfig {
        choices: pgw_stack::GATEWAY_CHOICES,
        ..BalanceConfig::default()
    }
}

/// The balancer alone over 5 bare always-ready endpoints (no gates, no retry): its
/// fixed cost, next to tower's `p2c::Balance` alone (same `Shared` wrapper).
fn pgw_balancer_only() -> impl Service<ChatCall, Response = u32, Error = BoxError> + Clone {
    let sources = Sources::new();
    for i in 0..5 {
        sources.insert(format!("s{i}").as_str().into(), endpoint());
    }
    HealthP2c::new(sources, gateway_balance()).unwrap().with_seed(1)
}

/// The retry layer over the bare balancer: the retry layer's cost is the difference.
fn pgw_retry_balancer() -> impl Service<ChatCall, Response = u32, Error = BoxError> {
    RetryLayer::new(RetryConfig::default())
        .unwrap()
        .history_mode(HistoryMode::OnDemand)
        .layer(pgw_balancer_only())
}

fn tower_p2c_only() -> impl Service<ChatCall, Response = u32, Error = BoxError> {
    let endpoints: Vec<_> = (0..5)
        .map(|_| PendingRequests::new(endpoint(), CompleteOnResponse::default()))
        .collect();
    let lb = Shared(Arc::new(Mutex::new(Balance::new(ServiceList::new(endpoints)))));
    tower::ServiceExt::map_err(lb, BoxError::from)
}

#[divan::bench(sample_count = 500, sample_size = 200)]
fn pgw_balancer_alone(b: divan::Bencher<'_, '_>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _g = rt.enter();
    let mut svc = pgw_balancer_only();
    let c = call();
    b.bench_local(|| drive(&mut svc, &c));
}

#[divan::bench(sample_count = 500, sample_size = 200)]
fn pgw_retry_balancer_alone(b: divan::Bencher<'_, '_>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _g = rt.enter();
    let mut svc = pgw_retry_balancer();
    let c = call();
    b.bench_local(|| drive(&mut svc, &c));
}

#[divan::bench(sample_count = 500, sample_size = 200)]
fn tower_p2c_alone(b: divan::Bencher<'_, '_>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _g = rt.enter();
    let mut svc = tower_p2c_only();
    let c = call();
    b.bench_local(|| drive(&mut svc, &c));
}
