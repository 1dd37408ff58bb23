//! The layer over a real service: shedding, waiting, the response future's lease on
//! every path (success, error, drop, panic), inner not-admitted errors, concurrency.

mod common;

use std::future::pending;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::*;
use futures_util::FutureExt;
use pgw_core::{BoxError, CircuitOpen, Outcome, QuotaExceeded};
use tokio::time::Instant;
use tower::{Service, ServiceExt, service_fn};
use tower_breaker_window::{
    Admission, Backend, BreakerConfig, BreakerLayer, BreakerState, Gate, MemoryBackend, MemoryGate,
};
use tower_layer::Layer;

/// What the test service does with a request.
#[derive(Clone, Copy, Debug)]
enum Act {
    Ok,
    Fail,
    Hang,
    Quota,
    Panic,
}

async fn act(a: Act) -> Result<&'static str, BoxError> {
    match a {
        Act::Ok => Ok("ok"),
        Act::Fail => Err("connection reset".into()),
        Act::Hang => pending().await,
        Act::Quota => Err(Box::new(QuotaExceeded::new("rpm", Duration::from_secs(7)))),
        Act::Panic => panic!("inner service panicked"),
    }
}

fn is_open(e: &BoxError) -> bool {
    e.is::<CircuitOpen>()
}

/// The seed's disease 1 through the layer: a source answering one call in ten is
/// isolated at its 10th call; the 11th never reaches it.
#[tokio::test(start_paused = true)]
async fn ten_percent_source_is_isolated_at_min_calls() {
    let config = BreakerConfig::builder()
        .fail_threshold(100)
        .cooldown(Duration::from_secs(30))
        .build()
        .unwrap();
    let layer = BreakerLayer::memory("s5", &config);
    let handle = layer.handle();
    let seen = Arc::new(AtomicU32::new(0));
    let inner = {
        let seen = seen.clone();
        service_fn(move |()| {
            let n = seen.fetch_add(1, Ordering::SeqCst);
            act(if n.is_multiple_of(10) { Act::Ok } else { Act::Fail })
        })
    };
    let mut svc = layer.layer(inner);
    for _ in 0..10 {
        let err = svc.ready().await.unwrap().call(()).await;
        assert!(err.is_ok() || !is_open(&err.unwrap_err()));
    }
    let err = svc.ready().await.unwrap().call(()).await.unwrap_err();
    let open = err.downcast_ref::<CircuitOpen>().expect("circuit open");
    assert_eq!(open.retry_after(), Duration::from_secs(30));
    assert_eq!(open.source().map(pgw_core::SourceId::as_str), Some("s5"));
    assert_eq!(
        seen.load(Ordering::SeqCst),
        10,
        "the refused call never reached the source"
    );
    let v = handle.view().await.unwrap();
    assert_eq!(
        (v.state, v.window_calls, v.window_failures, v.streak),
        (BreakerState::Open, 10, 9, 0),
        "transient failures open without growing the streak"
    );
}

/// Opens `layer`'s breaker (threshold 1) and waits out the cooldown.
async fn open_then_half_open<G: Gate>(env: &impl Env, layer: &BreakerLayer<G>) {
    let mut svc = layer.layer(service_fn(act));
    assert!(svc.ready().await.unwrap().call(Act::Fail).await.is_err());
    assert_eq!(layer.handle().view().await.unwrap().state, BreakerState::Open);
    env.pass(env.unit()).await;
}

/// Waits until the (possibly spawned) release of a probe has landed.
async fn until_no_probe<G: Gate>(env: &impl Env, layer: &BreakerLayer<G>) {
    for _ in 0..100 {
        if !layer.handle().view().await.unwrap().probe_in_flight {
            return;
        }
        tokio::time::sleep(env.unit() / 30).await;
    }
    panic!("the probe lease was never released");
}

async fn drop_in_half_open_releases_the_probe(env: impl Env) {
    let config = cfg(&env, 1).probe_ttl(env.units(1000)).build().unwrap();
    let layer = BreakerLayer::new(env.backend(), "s", &config);
    open_then_half_open(&env, &layer).await;
    let mut svc = layer.layer(service_fn(act));
    let mut probe = Box::pin(svc.ready().await.unwrap().call(Act::Hang));
    assert!((&mut probe).now_or_never().is_none());
    assert!(layer.handle().view().await.unwrap().probe_in_flight);
    let mut other = svc.clone();
    let err = other.ready().await.unwrap().call(Act::Ok).await.unwrap_err();
    assert!(is_open(&err), "one probe at a time: {err}");

    drop(probe);
    until_no_probe(&env, &layer).await;
    // A second caller probes at once, long before the lease's TTL.
    assert_eq!(other.ready().await.unwrap().call(Act::Ok).await.unwrap(), "ok");
    assert_eq!(layer.handle().view().await.unwrap().state, BreakerState::Closed);
}

#[tokio::test(start_paused = true)]
async fn memory_drop_in_half_open_releases_the_probe() {
    drop_in_half_open_releases_the_probe(MemEnv::new()).await;
}

#[tokio::test]
async fn redis_drop_in_half_open_releases_the_probe() {
    drop_in_half_open_releases_the_probe(RedisEnv::standalone("drop").await).await;
}

#[tokio::test]
async fn redis_cluster_drop_in_half_open_releases_the_probe() {
    drop_in_half_open_releases_the_probe(RedisEnv::cluster("drop").await).await;
}

/// An admission taken in `poll_ready` and never spent is released with the service.
#[tokio::test(start_paused = true)]
async fn service_dropped_after_poll_ready_releases_the_probe() {
    let env = MemEnv::new();
    let layer = BreakerLayer::new(env.backend(), "s", &cfg(&env, 1).build().unwrap());
    open_then_half_open(&env, &layer).await;
    let mut svc = layer.layer(service_fn(act));
    svc.ready().await.unwrap();
    assert!(layer.handle().view().await.unwrap().probe_in_flight);
    let mut clone = svc.clone(); // a clone starts unadmitted: it must not steal the probe
    let err = clone.ready().await.unwrap().call(Act::Ok).await.unwrap_err();
    assert!(is_open(&err));
    drop(svc);
    assert!(!layer.handle().view().await.unwrap().probe_in_flight);
    assert_eq!(clone.ready().await.unwrap().call(Act::Ok).await.unwrap(), "ok");
}

/// An inner service that fails `poll_ready` takes no call: the probe admitted for it
/// is given back at once, even while the caller keeps the service.
#[tokio::test(start_paused = true)]
async fn a_failed_inner_poll_ready_releases_the_probe() {
    let env = MemEnv::new();
    let layer = BreakerLayer::new(env.backend(), "s", &cfg(&env, 1).build().unwrap());
    open_then_half_open(&env, &layer).await;
    let mut svc = layer.layer(FailsReadyOnce {
        inner: service_fn(act),
        failed: false,
    });
    let err = svc
        .ready()
        .await
        .err()
        .expect("the inner service failed poll_ready");
    assert_eq!(err.to_string(), "worker gone");
    assert!(
        !layer.handle().view().await.unwrap().probe_in_flight,
        "the probe is released while the service is kept"
    );
    let mut other = layer.layer(service_fn(act));
    assert_eq!(other.ready().await.unwrap().call(Act::Ok).await.unwrap(), "ok");
    assert_eq!(layer.handle().view().await.unwrap().state, BreakerState::Closed);
    drop(svc);
}

/// A service whose first `poll_ready` fails (a `Buffer` whose worker died).
struct FailsReadyOnce<S> {
    inner: S,
    failed: bool,
}

impl<S: Service<Act, Error = BoxError>> Service<Act> for FailsReadyOnce<S> {
    type Response = S::Response;
    type Error = BoxError;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), BoxError>> {
        if !self.failed {
            self.failed = true;
            return std::task::Poll::Ready(Err("worker gone".into()));
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Act) -> Self::Future {
        self.inner.call(req)
    }
}

/// A panic in the probe's inner future unwinds through the response future, which
/// releases the lease.
#[tokio::test(start_paused = true)]
async fn panic_in_probe_releases_the_lease() {
    let env = MemEnv::new();
    let layer = BreakerLayer::new(env.backend(), "s", &cfg(&env, 1).build().unwrap());
    open_then_half_open(&env, &layer).await;
    let mut svc = layer.layer(service_fn(act));
    let fut = svc.ready().await.unwrap().call(Act::Panic);
    let joined = tokio::spawn(fut).await;
    assert!(joined.unwrap_err().is_panic());
    let v = layer.handle().view().await.unwrap();
    assert!(!v.probe_in_flight);
    assert_eq!(v.state, BreakerState::HalfOpen);
    assert_eq!(svc.ready().await.unwrap().call(Act::Ok).await.unwrap(), "ok");
}

/// A not-admitted error from a gate below is not an attempt: in closed state nothing
/// is counted; as a probe it releases the lease (B3); the error passes up unchanged.
#[tokio::test(start_paused = true)]
async fn inner_not_admitted_is_not_an_outcome() {
    let env = MemEnv::new();
    let layer = BreakerLayer::new(env.backend(), "s", &cfg(&env, 1).build().unwrap());
    let mut svc = layer.layer(service_fn(act));
    for _ in 0..5 {
        let err = svc.ready().await.unwrap().call(Act::Quota).await.unwrap_err();
        assert_eq!(
            err.downcast_ref::<QuotaExceeded>()
                .map(QuotaExceeded::retry_after),
            Some(Duration::from_secs(7))
        );
    }
    let v = layer.handle().view().await.unwrap();
    assert_eq!(
        (v.state, v.window_calls, v.failures),
        (BreakerState::Closed, 0, 0)
    );

    assert!(svc.ready().await.unwrap().call(Act::Fail).await.is_err());
    tokio::time::sleep(env.unit()).await;
    let err = svc.ready().await.unwrap().call(Act::Quota).await.unwrap_err();
    assert!(err.is::<QuotaExceeded>());
    let v = layer.handle().view().await.unwrap();
    assert!(!v.probe_in_flight);
    assert_eq!(v.streak, 0, "a probe without a verdict is not a failed probe");
    assert_eq!(svc.ready().await.unwrap().call(Act::Ok).await.unwrap(), "ok");
}

/// The classifier decides: `SourceDead` forces the breaker open at once, 429s are
/// ignored.
#[tokio::test(start_paused = true)]
async fn classifier_drives_the_verdict() {
    let env = MemEnv::new();
    let classify = |r: &Result<u16, BoxError>| match r {
        Ok(200) => Outcome::Success,
        Ok(429) => Outcome::RateLimited { retry_after: None },
        Ok(401) => Outcome::SourceDead,
        _ => Outcome::Transient,
    };
    let layer =
        BreakerLayer::new(env.backend(), "s2", &cfg(&env, 5).build().unwrap()).with_classifier(classify);
    let handle = layer.handle();
    let mut svc = layer.layer(service_fn(|code: u16| async move { Ok::<_, BoxError>(code) }));
    for _ in 0..30 {
        assert_eq!(svc.ready().await.unwrap().call(429).await.unwrap(), 429);
    }
    assert_eq!(handle.view().await.unwrap().state, BreakerState::Closed);
    assert_eq!(svc.ready().await.unwrap().call(401).await.unwrap(), 401);
    let v = handle.view().await.unwrap();
    assert_eq!((v.state, v.streak), (BreakerState::Open, 1));
}

/// Waiting mode: `poll_ready` stays pending until `open_until`, woken by its timer.
#[tokio::test(start_paused = true)]
async fn waiting_mode_is_ready_at_open_until() {
    let env = MemEnv::new();
    let layer = BreakerLayer::new(env.backend(), "s", &cfg(&env, 1).build().unwrap()).waiting();
    let mut svc = layer.layer(service_fn(act));
    assert!(svc.ready().await.unwrap().call(Act::Fail).await.is_err());
    let opened = Instant::now();
    let early = tokio::time::timeout(env.unit() - Duration::from_millis(1), svc.ready()).await;
    assert!(early.is_err(), "ready before open_until");
    svc.ready().await.unwrap();
    assert_eq!(opened.elapsed(), env.unit(), "woken exactly at open_until");
    assert_eq!(svc.call(Act::Ok).await.unwrap(), "ok");
    assert_eq!(layer.handle().view().await.unwrap().state, BreakerState::Closed);
}

/// Waiting mode: a caller refused while a probe is out is woken when the probe ends
/// and closes the breaker, not at its `retry_after` (here the cooldown, 30 s, away).
#[tokio::test(start_paused = true)]
async fn waiting_callers_are_woken_when_the_probe_closes_the_breaker() {
    let env = MemEnv::new();
    let config = BreakerConfig::builder()
        .fail_threshold(1)
        .cooldown(Duration::from_secs(30))
        .build()
        .unwrap();
    let layer = BreakerLayer::new(env.backend(), "s", &config).waiting();
    let svc = layer.layer(service_fn(|(fail, took): (bool, Duration)| async move {
        tokio::time::sleep(took).await;
        if fail {
            Err::<&'static str, BoxError>("connection reset".into())
        } else {
            Ok("ok")
        }
    }));
    let mut first = svc.clone();
    assert!(
        first
            .ready()
            .await
            .unwrap()
            .call((true, Duration::ZERO))
            .await
            .is_err()
    );
    tokio::time::sleep(Duration::from_secs(30)).await;
    // Half-open: the probe takes 200 ms and succeeds.
    let mut prober = svc.clone();
    prober.ready().await.unwrap();
    let probe = tokio::spawn(prober.call((false, Duration::from_millis(200))));
    let mut waiter = svc.clone();
    let asked = Instant::now();
    waiter.ready().await.unwrap();
    assert_eq!(
        asked.elapsed(),
        Duration::from_millis(200),
        "woken by the probe's end"
    );
    assert_eq!(probe.await.unwrap().unwrap(), "ok");
    assert_eq!(waiter.call((false, Duration::ZERO)).await.unwrap(), "ok");
}

/// A probe that ends while a waiting caller's admission is being asked (on another
/// thread, in production) still wakes that caller: the gate's signal is armed before
/// the question. Here a gate ends the probe inside the refused admission; before, the
/// caller armed the signal after the refusal and slept out the probe's lease (30 s).
#[tokio::test(start_paused = true)]
async fn a_probe_ending_during_the_admission_still_wakes_the_waiter() {
    #[derive(Clone)]
    struct EndsProbe {
        inner: MemoryGate,
        probe: Arc<std::sync::Mutex<Option<tower_breaker_window::Ticket>>>,
    }
    impl Gate for EndsProbe {
        type Admit = std::future::Ready<Result<Admission, BoxError>>;
        type Record = <MemoryGate as Gate>::Record;
        fn admit(&self) -> Self::Admit {
            let answer = self.inner.admit().now_or_never().expect("memory answers at once");
            if let Some(ticket) = self.probe.lock().unwrap().take() {
                // The probe succeeds between the question and the caller's wait.
                let recorded = self
                    .inner
                    .record(ticket, pgw_core::BreakerVerdict::Success)
                    .now_or_never();
                assert!(recorded.is_some(), "memory records at once");
            }
            std::future::ready(answer)
        }
        fn record(
            &self,
            ticket: tower_breaker_window::Ticket,
            verdict: pgw_core::BreakerVerdict,
        ) -> Self::Record {
            self.inner.record(ticket, verdict)
        }
        fn view(
            &self,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<tower_breaker_window::BreakerView, BoxError>> + Send>,
        > {
            self.inner.view()
        }
        fn record_errors(&self) -> u64 {
            self.inner.record_errors()
        }
        fn changes(&self) -> Option<Arc<tokio::sync::Notify>> {
            self.inner.changes()
        }
    }
    let config = BreakerConfig::builder()
        .fail_threshold(1)
        .cooldown(Duration::from_secs(30))
        .build()
        .unwrap();
    let inner = MemoryBackend::new().gate(&"s".into(), &config);
    let Admission::Admitted(t) = inner.admit().await.unwrap() else {
        panic!("closed at first");
    };
    inner.record(t, pgw_core::BreakerVerdict::ForceOpen).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    let Admission::Admitted(probe) = inner.admit().await.unwrap() else {
        panic!("half-open: the probe");
    };
    assert!(probe.is_probe());
    let gate = EndsProbe {
        inner,
        probe: Arc::new(std::sync::Mutex::new(Some(probe))),
    };
    let mut svc = tower_breaker_window::Breaker::new(
        service_fn(|()| async { Ok::<_, BoxError>("ok") }),
        gate,
        "s".into(),
        pgw_core::OkIsSuccess,
        tower_breaker_window::Mode::Wait,
    );
    let asked = Instant::now();
    svc.ready().await.unwrap();
    assert_eq!(asked.elapsed(), Duration::ZERO, "woken by the probe's end");
    assert_eq!(svc.call(()).await.unwrap(), "ok");
}

/// Many threads admitting at once in half-open: exactly one probe.
#[test]
fn memory_concurrent_half_open_admits_one_probe() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let gate = rt.block_on(async {
        let env = MemEnv::new();
        let gate = MemoryBackend::new().gate(&"s".into(), &cfg(&env, 1).build().unwrap());
        call(&gate, F).await;
        tokio::time::advance(env.unit()).await;
        gate
    });
    let barrier = std::sync::Barrier::new(16);
    let probes = AtomicU32::new(0);
    let admitted = AtomicU32::new(0);
    std::thread::scope(|s| {
        for _ in 0..16 {
            s.spawn(|| {
                let _clock = rt.handle().enter(); // the paused clock of the runtime
                barrier.wait();
                for _ in 0..100 {
                    if let Admission::Admitted(t) = gate.admit_now() {
                        admitted.fetch_add(1, Ordering::SeqCst);
                        if t.is_probe() {
                            probes.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
            });
        }
    });
    assert_eq!(probes.load(Ordering::SeqCst), 1);
    assert_eq!(admitted.load(Ordering::SeqCst), 1);
}

/// The future the layer returns is `Send` when the inner one is (usable in spawn).
#[test]
fn response_future_is_send() {
    fn send<T: Send>(_: &T) {}
    let config = BreakerConfig::builder()
        .fail_threshold(1)
        .cooldown(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut svc = BreakerLayer::memory("s", &config).layer(service_fn(act));
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(svc.poll_ready(&mut cx).is_ready());
    let fut = svc.call(Act::Ok);
    send(&fut);
}

/// `admitted_probe` tells the half-open probe from any other admission, and the probe's
/// response future records its verdict wherever it is polled: sent on a task of its own
/// while its caller moves on, it closes the breaker.
#[tokio::test(start_paused = true)]
async fn a_probe_sent_off_the_callers_path_still_decides() {
    let env = MemEnv::new();
    let config = cfg(&env, 1).build().unwrap();
    let layer = BreakerLayer::new(env.backend(), "s", &config);
    let mut svc = layer.layer(service_fn(act));
    svc.ready().await.unwrap();
    assert!(!svc.admitted_probe(), "a closed breaker's admission is no probe");
    assert!(svc.call(Act::Ok).await.is_ok());

    open_then_half_open(&env, &layer).await;
    svc.ready().await.unwrap();
    assert!(svc.admitted_probe());
    let probe = svc.call(Act::Ok);
    assert!(!svc.admitted_probe(), "spent by call");
    // Another caller is refused while it is out.
    let mut other = svc.clone();
    other.ready().await.unwrap();
    assert!(!other.admitted_probe());
    let refused = other.call(Act::Ok).await.unwrap_err();
    assert!(is_open(&refused));
    // What the probe's own caller tells itself is what the others hear.
    assert_eq!(
        refused.downcast_ref::<CircuitOpen>().unwrap().retry_after(),
        config.probe_out_retry_after()
    );

    tokio::spawn(probe).await.unwrap().unwrap();
    assert_eq!(layer.handle().view().await.unwrap().state, BreakerState::Closed);
}
