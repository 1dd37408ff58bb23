//! Per-call cost of `Aimd` against tower's `ConcurrencyLimit` over the same
//! always-ready service, in one run (DESIGN.md section 6).
//!
//! `cargo bench -p tower-aimd --bench aimd`

use std::convert::Infallible;
use std::future::ready;
use std::task::Context;

use futures_util::FutureExt;
use tower::limit::ConcurrencyLimit;
use tower::{Service, service_fn};
use tower_aimd::{AimdConfig, AimdLayer};
use tower_layer::Layer;

fn main() {
    divan::main();
}

fn drive<S: Service<u32>>(svc: &mut S) -> bool {
    let waker = futures_util::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    assert!(svc.poll_ready(&mut cx).is_ready());
    svc.call(1).now_or_never().is_some_and(|r| r.is_ok())
}

fn inner()
-> impl Service<u32, Response = u32, Error = Infallible, Future = std::future::Ready<Result<u32, Infallible>>>
+ Clone {
    service_fn(|x: u32| ready(Ok::<_, Infallible>(x)))
}

fn config() -> AimdConfig {
    AimdConfig {
        max_concurrency: Some(64),
        ..AimdConfig::default()
    }
}

/// Waiting mode (like `ConcurrencyLimit`): slot taken in `poll_ready`.
#[divan::bench(sample_count = 500, sample_size = 256)]
fn aimd_wait(b: divan::Bencher<'_, '_>) {
    let mut svc = AimdLayer::new(config()).unwrap().layer(inner());
    b.bench_local(|| drive(&mut svc));
}

/// Shedding mode (under a balancer): slot taken in `call`.
#[divan::bench(sample_count = 500, sample_size = 256)]
fn aimd_shed(b: divan::Bencher<'_, '_>) {
    let mut svc = AimdLayer::new(config()).unwrap().shedding().layer(inner());
    b.bench_local(|| drive(&mut svc));
}

#[divan::bench(sample_count = 500, sample_size = 256)]
fn tower_concurrency_limit(b: divan::Bencher<'_, '_>) {
    let mut svc = ConcurrencyLimit::new(inner(), 64);
    b.bench_local(|| drive(&mut svc));
}
