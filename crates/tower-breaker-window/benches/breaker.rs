//! Admission + record per call on the memory backend, against tower-resilience's
//! circuit breaker (0.13) in the same run, on an always-ready inner service, one task.
//!
//! `cargo bench -p tower-breaker-window --bench breaker`

use std::future::{Ready, ready};
use std::pin::pin;
use std::task::{Context, Poll};
use std::time::Duration;

use divan::{Bencher, black_box};
use futures_util::task::noop_waker_ref;
use pgw_core::BoxError;
use tower::{Layer, Service, service_fn};
use tower_breaker_window::{BreakerConfig, BreakerLayer};
use tower_resilience::circuitbreaker::CircuitBreakerLayer;

fn main() {
    divan::main();
}

fn inner()
-> impl Service<u64, Response = u64, Error = BoxError, Future = Ready<Result<u64, BoxError>>> + Clone {
    service_fn(|x: u64| ready(Ok::<_, BoxError>(x)))
}

fn failing()
-> impl Service<u64, Response = u64, Error = BoxError, Future = Ready<Result<u64, BoxError>>> + Clone {
    service_fn(|_: u64| ready(Err::<u64, BoxError>("down".into())))
}

/// `poll_ready` + `call` + one poll of the response future; every service here answers
/// at once, so nothing is ever pending.
fn drive<S: Service<u64>>(svc: &mut S, x: u64) -> Result<S::Response, S::Error> {
    let mut cx = Context::from_waker(noop_waker_ref());
    match svc.poll_ready(&mut cx) {
        Poll::Ready(Ok(())) => {}
        Poll::Ready(Err(e)) => return Err(e),
        Poll::Pending => panic!("not ready"),
    }
    let mut fut = pin!(svc.call(x));
    match fut.as_mut().poll(&mut cx) {
        Poll::Ready(r) => r,
        Poll::Pending => panic!("pending"),
    }
}

fn config() -> BreakerConfig {
    BreakerConfig::builder()
        .fail_threshold(5)
        .cooldown(Duration::from_secs(3600))
        .build()
        .unwrap()
}

mod closed {
    use super::*;

    /// The inner service alone: the floor.
    #[divan::bench]
    fn bare(b: Bencher<'_, '_>) {
        let mut svc = inner();
        b.bench_local(|| drive(&mut svc, black_box(1)).unwrap());
    }

    /// This crate, memory backend: admission + record of a success.
    #[divan::bench]
    fn pgw_breaker_window(b: Bencher<'_, '_>) {
        let mut svc = BreakerLayer::memory("s", &config()).layer(inner());
        b.bench_local(|| drive(&mut svc, black_box(1)).unwrap());
    }

    /// tower-resilience 0.13's circuit breaker, default (count-based) configuration.
    #[divan::bench]
    fn tower_resilience(b: Bencher<'_, '_>) {
        let layer = CircuitBreakerLayer::builder().build().unwrap();
        let mut svc = layer.layer(inner());
        b.bench_local(|| drive(&mut svc, black_box(1)).unwrap());
    }
}

mod open {
    use super::*;

    /// This crate: an open breaker refusing with `CircuitOpen`.
    #[divan::bench]
    fn pgw_breaker_window(b: Bencher<'_, '_>) {
        let mut svc = BreakerLayer::memory("s", &config()).layer(failing());
        for _ in 0..5 {
            let _ = drive(&mut svc, 1);
        }
        b.bench_local(|| drive(&mut svc, black_box(1)).unwrap_err());
    }

    /// tower-resilience 0.13, forced open.
    #[divan::bench]
    fn tower_resilience(b: Bencher<'_, '_>) {
        let layer = CircuitBreakerLayer::builder()
            .wait_duration_in_open(Duration::from_secs(3600))
            .build()
            .unwrap();
        let mut svc = layer.layer(failing());
        futures_util::FutureExt::now_or_never(svc.force_open()).unwrap();
        b.bench_local(|| drive(&mut svc, black_box(1)).unwrap_err());
    }
}

/// One read of the clock, for reference (the breaker reads it once per call).
#[divan::bench]
fn tokio_instant_now() -> tokio::time::Instant {
    tokio::time::Instant::now()
}
