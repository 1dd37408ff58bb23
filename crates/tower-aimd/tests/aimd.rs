//! Behaviour of the AIMD layer: modes, leaks on every path (A4), the not-admitted
//! contract, and a seeded account-level 429 model (A2).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use pgw_core::{BoxError, CircuitOpen, Outcome, Paced, SourceId};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tower::{Service, ServiceExt, service_fn};
use tower_aimd::{Aimd, AimdConfig, AimdLayer, Mode};
use tower_layer::Layer;
use tower_test::{assert_request_eq, mock};

fn one_slot() -> AimdConfig {
    AimdConfig {
        initial_limit: 1.0,
        ..AimdConfig::default()
    }
}

#[tokio::test(start_paused = true)]
async fn wait_mode_is_pending_until_a_slot_frees() {
    let layer = AimdLayer::new(one_slot()).unwrap();
    let h = layer.handle();
    let (mut a, mut handle) = mock::spawn_layer::<&str, &str, _>(layer.clone());
    let (mut b, _handle_b) = mock::spawn_layer::<&str, &str, _>(layer);

    assert!(a.poll_ready().is_ready());
    let fut = a.call("one");
    assert_eq!(h.inflight(), 1);
    assert!(b.poll_ready().is_pending(), "limit 1 reached: wait");
    assert!(!b.is_woken());

    assert_request_eq!(handle, "one").send_response("ok");
    assert_eq!(fut.await.unwrap(), "ok");
    assert!(b.is_woken(), "the release woke the waiter");
    assert!(b.poll_ready().is_ready());
    assert_eq!(h.inflight(), 1, "b holds the slot it reserved");
    drop(b);
    assert_eq!(h.inflight(), 0, "dropping a service releases its reserved slot");
}

#[tokio::test(start_paused = true)]
async fn shed_mode_answers_paced_with_the_source_and_fires_the_signal() {
    let signal = Arc::new(tokio::sync::Notify::new());
    let layer = one_slot_shedding(&signal);
    let h = layer.handle();
    let (mut a, mut handle) = mock::spawn_layer::<&str, &str, _>(layer.clone());
    let mut b = layer.layer(service_fn(|_: &str| async { Ok::<_, BoxError>("never") }));

    assert!(a.poll_ready().is_ready());
    let fut = a.call("one");
    let mut woken = Box::pin(Arc::clone(&signal).notified_owned());
    woken.as_mut().enable();

    assert!(matches!(b.ready().now_or_never(), Some(Ok(_))), "always ready");
    let err = b.call("two").await.unwrap_err();
    let paced = err.downcast_ref::<Paced>().expect("paced");
    assert_eq!(paced.source().map(SourceId::as_str), Some("s1"));
    assert_eq!(h.inflight(), 1, "a refusal takes nothing");

    assert_request_eq!(handle, "one").send_response("ok");
    fut.await.unwrap();
    tokio::time::timeout(Duration::from_secs(1), woken)
        .await
        .expect("release signal fired");
    assert_eq!(h.inflight(), 0);
}

/// A slot taken in `poll_ready` and given back because the service below refused (a
/// gate that knows its quota is full) wakes nobody for refusals counted before it
/// was taken: they are a real release's to answer. Before, each such give-back took
/// an old refusal and woke a balancer round, which met the same refusal below and
/// gave its slot back again: one round after another while old refusals were counted.
/// A refusal counted while the slot was held is still answered.
#[tokio::test(start_paused = true)]
async fn a_slot_given_back_unused_wakes_only_for_refusals_while_it_was_held() {
    let signal = Arc::new(tokio::sync::Notify::new());
    let layer = with_two_old_refusals(&signal).await;
    let h = layer.handle();
    let ok = || service_fn(|_: &str| async { Ok::<_, BoxError>("ok") });
    // A gate below that refuses in `poll_ready`: the slot goes back, nobody is woken.
    let mut c = layer.layer(Refusing(Arc::new(|| {})));
    assert!(matches!(c.ready().now_or_never(), Some(Err(_))));
    assert_eq!(h.inflight(), 0);
    assert!(
        Arc::clone(&signal).notified_owned().now_or_never().is_none(),
        "an old refusal woke a round"
    );
    // Someone refused while the slot was held (shed by another service of the layer,
    // from inside the gate's `poll_ready`): the give-back answers it.
    let other = layer.clone();
    let mut d = layer.layer(Refusing(Arc::new(move || {
        let mut b = other.layer(ok());
        assert!(
            matches!(b.ready().now_or_never(), Some(Ok(_))),
            "shed: ready to answer Paced"
        );
    })));
    assert!(matches!(d.ready().now_or_never(), Some(Err(_))));
    assert!(
        Arc::clone(&signal).notified_owned().now_or_never().is_some(),
        "a refusal while the slot was held is woken"
    );
}

/// The same when the gate below refuses in its response future (a gate that asks its
/// backend, such as the rate limiter): a slot given back for a not-admitted answer
/// wakes nobody for refusals counted before it was taken. Released as an attempt's,
/// it answered one, and the balancer round it woke met the same refusal: in the P6
/// soak, ten times the wake-ups and rounds (1.69 million) once nothing else took them.
#[tokio::test(start_paused = true)]
async fn a_slot_refused_below_in_its_future_wakes_only_for_refusals_while_it_was_held() {
    let signal = Arc::new(tokio::sync::Notify::new());
    let layer = with_two_old_refusals(&signal).await;
    let h = layer.handle();
    let limit = h.limit();
    // Two old refusals are left. A gate below that is ready but refuses the call.
    let refusing = || {
        service_fn(|_: &str| async {
            Err::<&str, BoxError>(Box::new(pgw_core::QuotaExceeded::new(
                "rpm",
                Duration::from_secs(5),
            )))
        })
    };
    let mut c = layer.layer(refusing());
    let err = c.ready().await.unwrap().call("refused below").await.unwrap_err();
    assert!(err.downcast_ref::<pgw_core::QuotaExceeded>().is_some(), "{err}");
    assert_eq!(h.inflight(), 0);
    assert!(
        Arc::clone(&signal).notified_owned().now_or_never().is_none(),
        "an old refusal woke a round"
    );
    // The limit is where it was: a refusal below is not an attempt.
    assert_eq!(h.limit(), limit);
}

/// A Wait-mode service dropped while it waits for a slot withdraws its refusal: the
/// next release wakes nobody for a call that is gone. Before, the refusal stayed
/// counted, and the release woke a waiter for it (here, with none left, it left the
/// signal a permit: the next waiter to come would have been woken for nothing).
#[tokio::test(start_paused = true)]
async fn a_waiter_dropped_while_waiting_withdraws_its_refusal() {
    let signal = Arc::new(tokio::sync::Notify::new());
    let layer = one_slot_waiting(&signal);
    let h = layer.handle();
    let ok = || service_fn(|_: &str| async { Ok::<_, BoxError>("ok") });
    let mut a = layer.layer(ok());
    assert!(matches!(a.ready().now_or_never(), Some(Ok(_))));
    let mut b = layer.layer(ok());
    assert!(b.ready().now_or_never().is_none(), "limit 1 reached: b waits");
    drop(b);
    assert_eq!(a.call("one").await.unwrap(), "ok");
    assert_eq!(h.inflight(), 0);
    assert!(
        Arc::clone(&signal).notified_owned().now_or_never().is_none(),
        "the release woke someone for the dropped waiter"
    );
    // Dropped after its wake-up came and before it read it: the wake-up is not left
    // to the signal as a permit (nobody else waits). A fresh limit of 1 (the success
    // above grew this one).
    let layer = one_slot_waiting(&signal);
    let h = layer.handle();
    let mut c = layer.layer(ok());
    assert!(matches!(c.ready().now_or_never(), Some(Ok(_))));
    let mut d = layer.layer(ok());
    assert!(d.ready().now_or_never().is_none(), "d waits");
    assert_eq!(c.call("two").await.unwrap(), "ok");
    drop(d);
    assert_eq!(h.inflight(), 0);
    assert!(
        Arc::clone(&signal).notified_owned().now_or_never().is_none(),
        "the dropped waiter's wake-up was left for nobody"
    );
    // With another waiter behind it, the wake-up goes on to that one. A fresh limit
    // of 1 again; the slot is freed by a drop, not a success, so it stays 1.
    let layer = one_slot_waiting(&signal);
    let h = layer.handle();
    let mut c = layer.layer(ok());
    assert!(matches!(c.ready().now_or_never(), Some(Ok(_))));
    let (mut d, _hd) = mock::spawn_layer::<&str, &str, _>(layer.clone());
    let (mut e, _he) = mock::spawn_layer::<&str, &str, _>(layer.clone());
    assert!(d.poll_ready().is_pending());
    assert!(e.poll_ready().is_pending());
    drop(c);
    assert!(d.is_woken(), "the first waiter was woken");
    assert!(!e.is_woken());
    drop(d);
    assert!(e.is_woken(), "its wake-up went on to the next waiter");
    assert!(e.poll_ready().is_ready());
    assert_eq!(h.inflight(), 1);
}

/// One slot in wait mode, releases signalled on `signal`.
fn one_slot_waiting(signal: &Arc<tokio::sync::Notify>) -> AimdLayer {
    AimdLayer::new(one_slot())
        .unwrap()
        .with_release_signal(Arc::clone(signal))
}

/// A one-slot shedding layer with two refusals counted and unanswered: a service of
/// it held the only slot while three sheds counted three refusals, and its release
/// answered one (the signal's permit, taken here).
async fn with_two_old_refusals(signal: &Arc<tokio::sync::Notify>) -> AimdLayer {
    let layer = one_slot_shedding(signal);
    let ok = || service_fn(|_: &str| async { Ok::<_, BoxError>("ok") });
    let mut a = layer.layer(ok());
    assert!(matches!(a.ready().now_or_never(), Some(Ok(_))));
    for _ in 0..3 {
        let mut b = layer.layer(ok());
        let _ = b.ready().await.unwrap().call("shed").await.unwrap_err();
    }
    assert_eq!(a.call("one").await.unwrap(), "ok");
    assert!(Arc::clone(signal).notified_owned().now_or_never().is_some());
    layer
}

/// One slot in shed mode, source `s1`, releases signalled on `signal`.
fn one_slot_shedding(signal: &Arc<tokio::sync::Notify>) -> AimdLayer {
    one_slot_waiting(signal)
        .with_source(SourceId::from("s1"))
        .shedding()
}

/// A service that refuses every `poll_ready` (`Paced`), after running its hook.
#[derive(Clone)]
struct Refusing(Arc<dyn Fn() + Send + Sync>);

impl Service<&'static str> for Refusing {
    type Response = &'static str;
    type Error = BoxError;
    type Future = std::future::Ready<Result<&'static str, BoxError>>;

    fn poll_ready(&mut self, _cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), BoxError>> {
        (self.0)();
        std::task::Poll::Ready(Err(Box::new(Paced::new())))
    }

    fn call(&mut self, _req: &'static str) -> Self::Future {
        std::future::ready(Err("not ready".into()))
    }
}

/// A source under two balancers (one route in two model groups): a freed slot wakes a
/// waiter of each, set before or after `with_source` (which starts a fresh limiter).
#[tokio::test(start_paused = true)]
async fn a_release_wakes_one_waiter_of_each_release_signal() {
    let first = Arc::new(tokio::sync::Notify::new());
    let second = Arc::new(tokio::sync::Notify::new());
    let layer = AimdLayer::new(one_slot())
        .unwrap()
        .with_release_signal(Arc::clone(&first))
        .also_release_signal(Arc::clone(&second))
        .also_release_signal(Arc::clone(&first))
        .with_source(SourceId::from("s1"))
        .shedding();
    let (mut a, mut handle) = mock::spawn_layer::<&str, &str, _>(layer.clone());
    let b = layer.layer(service_fn(|_: &str| async { Ok::<_, BoxError>("never") }));

    assert!(a.poll_ready().is_ready());
    let fut = a.call("one");
    let mut woken: Vec<_> = [&first, &second]
        .iter()
        .map(|s| Box::pin(Arc::clone(s).notified_owned()))
        .collect();
    for w in &mut woken {
        w.as_mut().enable();
    }
    // A third waiter on the first signal: one wake-up per signal, not a herd.
    let mut third = Box::pin(Arc::clone(&first).notified_owned());
    third.as_mut().enable();
    b.oneshot("two").await.expect_err("paced: the one slot is taken");

    assert_request_eq!(handle, "one").send_response("ok");
    fut.await.unwrap();
    for (i, w) in woken.into_iter().enumerate() {
        tokio::time::timeout(Duration::from_secs(1), w)
            .await
            .unwrap_or_else(|_| panic!("signal {i} fired"));
    }
    assert!(
        tokio::time::timeout(Duration::from_secs(1), third).await.is_err(),
        "one waiter per signal per freed slot"
    );
}

/// A4: inflight back to zero after success, error, panic in the inner future and drop.
#[tokio::test(start_paused = true)]
async fn inflight_returns_to_zero_on_every_path() {
    for mode in [Mode::Wait, Mode::Shed] {
        let layer = AimdLayer::default().with_mode(mode);
        let h = layer.handle();
        let svc = layer.layer(service_fn(|kind: &'static str| async move {
            match kind {
                "ok" => Ok("ok"),
                "err" => Err::<&str, BoxError>("boom".into()),
                "panic" => panic!("inner future panicked"),
                _ => std::future::pending().await,
            }
        }));

        svc.clone().oneshot("ok").await.unwrap();
        assert_eq!(h.inflight(), 0, "{mode:?} success");
        svc.clone().oneshot("err").await.unwrap_err();
        assert_eq!(h.inflight(), 0, "{mode:?} error");

        let join = tokio::spawn(svc.clone().oneshot("panic")).await;
        assert!(join.unwrap_err().is_panic());
        assert_eq!(h.inflight(), 0, "{mode:?} panic");

        let mut s = svc.clone();
        let fut = s.ready().await.unwrap().call("hang");
        assert_eq!(h.inflight(), 1);
        let join = tokio::spawn(fut);
        tokio::time::sleep(Duration::from_millis(10)).await;
        join.abort();
        assert!(join.await.unwrap_err().is_cancelled());
        assert_eq!(h.inflight(), 0, "{mode:?} drop");
    }
}

#[tokio::test(start_paused = true)]
async fn not_admitted_from_below_changes_nothing_but_errors_pass_unchanged() {
    let classify = |r: &Result<(), BoxError>| match r {
        Ok(()) => Outcome::Success,
        Err(_) => Outcome::RateLimited { retry_after: None },
    };
    // Every 429 episode cuts (A2's letter), so one 429 shows.
    let strict = AimdConfig {
        tolerated_pushback: 0.0,
        ..AimdConfig::default()
    };
    let layer = AimdLayer::new(strict).unwrap().with_classifier(classify);
    let h = layer.handle();
    let svc = layer.layer(service_fn(|open: bool| async move {
        if open {
            Err::<(), BoxError>(Box::new(CircuitOpen::new(Duration::from_secs(3))))
        } else {
            Err("429".into())
        }
    }));
    let err = svc.clone().oneshot(true).await.unwrap_err();
    assert_eq!(
        err.downcast_ref::<CircuitOpen>().unwrap().retry_after(),
        Duration::from_secs(3)
    );
    assert!((h.limit() - 8.0).abs() < 1e-12, "not admitted: limit unchanged");
    svc.clone().oneshot(false).await.unwrap_err();
    assert!((h.limit() - 4.0).abs() < 1e-12, "a real 429 halves it");
    assert_eq!(h.inflight(), 0);
}

#[test]
fn bad_config_is_an_error_naming_the_field() {
    let err = AimdLayer::new(AimdConfig {
        decrease_factor: 0.0,
        ..AimdConfig::default()
    })
    .unwrap_err();
    assert_eq!(err.field(), "decrease_factor");
    let err = Aimd::new(
        (),
        &AimdConfig {
            max_concurrency: Some(0),
            ..AimdConfig::default()
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("max_concurrency"), "{err}");
}

/// The account-level 429 model: the probability of a 429 grows with the account's
/// concurrency. Returns (attempts, 429s).
#[derive(Clone)]
struct Account {
    inflight: Arc<AtomicUsize>,
    rng: Arc<Mutex<SmallRng>>,
}

impl Account {
    fn new(seed: u64) -> Self {
        Self {
            inflight: Arc::default(),
            rng: Arc::new(Mutex::new(SmallRng::seed_from_u64(seed))),
        }
    }

    /// One attempt: 429 with probability `clamp((inflight - 4) / 8, 0, 0.95)`.
    async fn call(self) -> Result<(), BoxError> {
        let n = self.inflight.fetch_add(1, Ordering::SeqCst) + 1;
        #[allow(clippy::cast_precision_loss)]
        let p = ((n as f64 - 4.0) / 8.0).clamp(0.0, 0.95);
        let limited = self.rng.lock().unwrap().random_bool(p);
        let latency = if limited { 50 } else { 1000 };
        tokio::time::sleep(Duration::from_millis(latency)).await;
        self.inflight.fetch_sub(1, Ordering::SeqCst);
        if limited { Err("429".into()) } else { Ok(()) }
    }
}

/// 32 callers, 40 calls each, every call retried until it succeeds (a 429 costs one
/// attempt). Returns (attempts, 429s).
async fn run(paced: bool) -> (usize, usize, f64) {
    let account = Account::new(42);
    let classify = |r: &Result<(), BoxError>| match r {
        Ok(()) => Outcome::Success,
        Err(_) => Outcome::RateLimited { retry_after: None },
    };
    let layer = AimdLayer::new(AimdConfig {
        caller_concurrency: Some(32),
        ..AimdConfig::default()
    })
    .unwrap()
    .with_classifier(classify);
    let h = layer.handle();
    let inner = {
        let account = account.clone();
        service_fn(move |()| account.clone().call())
    };
    let attempts = Arc::new(AtomicUsize::new(0));
    let limited = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (attempts, limited) = (Arc::clone(&attempts), Arc::clone(&limited));
        let mut svc: tower::util::BoxCloneService<(), (), BoxError> = if paced {
            tower::util::BoxCloneService::new(layer.layer(inner.clone()))
        } else {
            tower::util::BoxCloneService::new(inner.clone())
        };
        tasks.push(tokio::spawn(async move {
            for _ in 0..40 {
                loop {
                    attempts.fetch_add(1, Ordering::Relaxed);
                    if svc.ready().await.unwrap().call(()).await.is_ok() {
                        break;
                    }
                    limited.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(h.inflight(), 0);
    (
        attempts.load(Ordering::Relaxed),
        limited.load(Ordering::Relaxed),
        h.limit(),
    )
}

#[tokio::test(start_paused = true)]
async fn aimd_keeps_the_429_share_under_the_tolerated_share_far_below_the_unpaced_run() {
    let (a0, l0, _) = run(false).await;
    let (a1, l1, limit) = run(true).await;
    #[allow(clippy::cast_precision_loss)]
    let (s0, s1) = (l0 as f64 / a0 as f64, l1 as f64 / a1 as f64);
    println!(
        "unpaced: {l0} 429s / {a0} attempts = {:.1}%; aimd: {l1} / {a1} = {:.1}% (final limit {limit:.2})",
        s0 * 100.0,
        s1 * 100.0
    );
    assert!(s0 > 0.5, "the model punishes 32 in flight: {s0}");
    // The limit holds pushback under the share it tolerates (0.5 by default), a fraction
    // of the unpaced run's.
    assert!(s1 < tower_aimd::DEFAULT_TOLERATED_PUSHBACK, "aimd {s1}");
    assert!(s1 < s0 / 2.0, "aimd {s1} vs unpaced {s0}");
}

/// A2 through the layer: four requests sent in one congestion episode all come back
/// 429, and the limit is cut once (8 -> 4), not once per 429 (8 -> 4 -> 2 -> 1); a
/// request sent after the cut belongs to the next episode, and its 429 cuts again.
#[tokio::test(start_paused = true)]
async fn the_429s_of_one_episode_cut_the_limit_once() {
    let classify = |r: &Result<(), BoxError>| match r {
        Ok(()) => Outcome::Success,
        Err(_) => Outcome::RateLimited { retry_after: None },
    };
    let strict = AimdConfig {
        initial_limit: 8.0,
        tolerated_pushback: 0.0,
        ..AimdConfig::default()
    };
    let layer = AimdLayer::new(strict)
        .unwrap()
        .with_classifier(classify)
        .shedding();
    let h = layer.handle();
    let svc = layer.layer(service_fn(|after: u64| async move {
        tokio::time::sleep(Duration::from_millis(after)).await;
        Err::<(), BoxError>("429".into())
    }));
    // Sent together, answered 429 one after the other.
    let calls: Vec<_> = (1..=4)
        .map(|i| tokio::spawn(svc.clone().oneshot(i * 100)))
        .collect();
    tokio::task::yield_now().await;
    assert_eq!(h.inflight(), 4);
    for c in calls {
        assert!(c.await.unwrap().is_err());
    }
    assert!(
        (h.limit() - 4.0).abs() < 1e-9,
        "one cut for the episode: {}",
        h.limit()
    );
    // Sent after the cut: a new episode.
    assert!(svc.clone().oneshot(1).await.is_err());
    assert!(
        (h.limit() - 2.0).abs() < 1e-9,
        "the next episode cuts: {}",
        h.limit()
    );
}

/// Waiting without herds, in `Mode::Wait`: four services wait for the only slot; each
/// release wakes exactly one of them, the one that waited longest, and the others stay
/// asleep (a wake-up that finds no slot would be a wasted round).
#[tokio::test(start_paused = true)]
async fn one_release_wakes_one_waiter_first_come_first_served() {
    // A ceiling of one: the successes do not grow the limit.
    let layer = AimdLayer::new(AimdConfig {
        max_concurrency: Some(1),
        ..one_slot()
    })
    .unwrap();
    let (mut holder, mut handle) = mock::spawn_layer::<&str, &str, _>(layer.clone());
    assert!(holder.poll_ready().is_ready());
    let mut running = holder.call("first");
    let mut waiters: Vec<_> = (0..4)
        .map(|_| mock::spawn_layer::<&str, &str, _>(layer.clone()))
        .collect();
    for (w, _) in &mut waiters {
        assert!(w.poll_ready().is_pending());
    }
    for next in 0..4 {
        assert_request_eq!(handle, "first").send_response("ok");
        assert_eq!(running.await.unwrap(), "ok");
        let woken: Vec<usize> = (0..4).filter(|&i| waiters[i].0.is_woken()).collect();
        assert_eq!(woken, [next], "one slot freed: only waiter {next} is woken");
        let (w, h) = &mut waiters[next];
        assert!(w.poll_ready().is_ready());
        running = w.call("first");
        handle = std::mem::replace(h, mock::pair().1);
        for (later, _) in &mut waiters[next + 1..] {
            assert!(later.poll_ready().is_pending(), "still waiting after {next}");
        }
    }
    assert_request_eq!(handle, "first").send_response("ok");
    assert_eq!(running.await.unwrap(), "ok");
}

/// A service whose `poll_ready` is counted, and refused while `refuse` is set (a gate
/// below AIMD: a breaker's admission).
#[derive(Clone)]
struct CountedReady {
    polled: Arc<AtomicUsize>,
    refuse: Arc<std::sync::atomic::AtomicBool>,
}

impl Service<&'static str> for CountedReady {
    type Response = &'static str;
    type Error = BoxError;
    type Future = std::future::Pending<Result<&'static str, BoxError>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), BoxError>> {
        self.polled.fetch_add(1, Ordering::SeqCst);
        if self.refuse.load(Ordering::SeqCst) {
            return std::task::Poll::Ready(Err(Box::new(CircuitOpen::new(Duration::from_secs(1)))));
        }
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: &'static str) -> Self::Future {
        std::future::pending()
    }
}

/// Shed mode asks the cheapest gate first: over the limit, the gates below are not
/// asked (no breaker admission, no Redis round trip, for a call answered `Paced`);
/// and a slot taken by `poll_ready` goes back when a gate below refuses.
#[tokio::test(start_paused = true)]
async fn shed_mode_asks_nothing_below_when_over_the_limit() {
    let layer = AimdLayer::new(one_slot()).unwrap().shedding();
    let h = layer.handle();
    let polled = Arc::new(AtomicUsize::new(0));
    let refuse = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let inner = CountedReady {
        polled: Arc::clone(&polled),
        refuse: Arc::clone(&refuse),
    };
    let mut a = layer.layer(inner.clone());
    let held = a.ready().await.unwrap().call("one");
    assert_eq!((h.inflight(), polled.load(Ordering::SeqCst)), (1, 1));

    let mut b = layer.layer(inner.clone());
    let err = b.ready().await.unwrap().call("two").await.unwrap_err();
    assert!(err.is::<Paced>(), "{err}");
    assert_eq!(polled.load(Ordering::SeqCst), 1, "the gate below was not asked");

    drop(held);
    assert_eq!(h.inflight(), 0);
    refuse.store(true, Ordering::SeqCst);
    let mut c = layer.layer(inner);
    let Err(err) = c.ready().await.map(|_| ()) else {
        panic!("the gate below refused");
    };
    assert!(err.is::<CircuitOpen>(), "{err}");
    assert_eq!(polled.load(Ordering::SeqCst), 2, "asked once a slot was free");
    assert_eq!(h.inflight(), 0, "the refused call's slot went back");
}
