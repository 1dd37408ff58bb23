//! Waiting without herds ([`Mode::Wait`], memory backend, paused clock): a waiting
//! admission is woken when a slot it can use frees up, first come first served per
//! scope, one waiter per freed slot; a place given up (dropped, out of time) costs the
//! others nothing. Wake-ups are counted as admission tries (`stats().admitted` and
//! `stats().refused`): a waiter woken in vain would be one more refusal.
//!
//! The clock never moves unless a test sleeps: `settle()` only yields.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use pgw_core::{BoxError, QuotaExceeded};
use tower::{Service, ServiceExt, service_fn};
use tower_layer::Layer;
use tower_ratelimit_redis::{
    Admission, LimiterStats, MemoryBackend, Mode, NoTokens, Quota, RateLimitConfig, RateLimitLayer,
    RateLimiter,
};

fn waiting(quota: Quota, max_wait: Option<Duration>) -> RateLimiter {
    RateLimiter::new(
        RateLimitConfig::new("s1", quota)
            .window(Duration::from_secs(1))
            .mode(Mode::Wait { max_wait }),
        MemoryBackend::new(),
    )
    .unwrap()
}

/// Lets every ready task run, without letting the paused clock advance.
async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

fn tries(s: LimiterStats) -> (u64, u64) {
    (s.admitted, s.refused)
}

/// Five waiters for one slot: each freed slot (a release) wakes exactly one of them,
/// in the order they came, and none is ever woken in vain.
#[tokio::test(start_paused = true)]
async fn one_freed_slot_wakes_exactly_one_waiter_in_order() {
    let l = waiting(Quota::unlimited().concurrency(1), None);
    let order = Arc::new(Mutex::new(Vec::new()));
    let seen = order.clone();
    // Each call runs until the test lets it finish (one permit per call).
    let finish = Arc::new(tokio::sync::Semaphore::new(0));
    let gate = finish.clone();
    let svc = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .on_admission(move |id: &usize, _: &Admission| seen.lock().unwrap().push(*id))
        .layer(service_fn(move |id: usize| {
            let gate = gate.clone();
            async move {
                gate.acquire().await.unwrap().forget();
                Ok::<_, BoxError>(id)
            }
        }));
    let held = l.acquire(0).await.unwrap();
    let calls: Vec<_> = (0..5).map(|id| tokio::spawn(svc.clone().oneshot(id))).collect();
    settle().await;
    // The first is refused and queues; the others queue behind it without trying
    // (first come first served: a newcomer never takes a slot a waiter waits for).
    assert_eq!(tries(l.stats()), (1, 1));

    drop(held);
    settle().await;
    assert_eq!(tries(l.stats()), (2, 1), "one slot freed: one waiter tried");
    assert_eq!(*order.lock().unwrap(), [0]);
    for n in 1..5_usize {
        finish.add_permits(1); // the running call ends and releases its slot
        settle().await;
        assert_eq!(
            tries(l.stats()),
            (2 + n as u64, 1),
            "exactly one more waiter woken"
        );
        assert_eq!(*order.lock().unwrap(), (0..=n).collect::<Vec<_>>());
    }
    finish.add_permits(1);
    for (id, call) in calls.into_iter().enumerate() {
        assert_eq!(call.await.unwrap().unwrap(), id);
    }
    assert_eq!(l.held().await.unwrap().leases(), 0, "every lease released");
}

/// RPM 2 and five waiters: each time two admissions leave the span (their sub-window,
/// one window and one sub-window after it began), two waiters are admitted (the first
/// in line wakes on its timer and hands on to the next while room is left), in order,
/// not a moment early, with no waiter tried in vain.
#[tokio::test(start_paused = true)]
async fn a_window_roll_admits_one_waiter_per_freed_request() {
    let l = waiting(Quota::unlimited().requests(2), None);
    let windows = Arc::new(Mutex::new(Vec::new()));
    let seen = windows.clone();
    let svc = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .on_admission(move |id: &usize, a: &Admission| seen.lock().unwrap().push((*id, a.window())))
        .layer(service_fn(|id: usize| async move { Ok::<_, BoxError>(id) }));
    l.acquire(0).await.unwrap().finish(None).await.unwrap();
    l.acquire(0).await.unwrap().finish(None).await.unwrap();
    let calls: Vec<_> = (0..5).map(|id| tokio::spawn(svc.clone().oneshot(id))).collect();
    let t0 = tokio::time::Instant::now();
    settle().await;
    assert_eq!(tries(l.stats()), (2, 1));
    let mut before = 2;
    for (w, admitted, at_ms) in [(1, 4, 1010), (2, 6, 2020), (3, 7, 3030)] {
        let at = t0 + Duration::from_millis(at_ms);
        tokio::time::sleep_until(at - Duration::from_millis(1)).await;
        settle().await;
        assert_eq!(tries(l.stats()), (before, 1), "not yet, window {w}");
        tokio::time::sleep_until(at).await;
        settle().await;
        assert_eq!(tries(l.stats()), (admitted, 1), "window {w}");
        before = admitted;
    }
    for call in calls {
        call.await.unwrap().unwrap();
    }
    assert_eq!(*windows.lock().unwrap(), [(0, 1), (1, 1), (2, 2), (3, 2), (4, 3)]);
}

fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    Pin::new(f).poll(&mut Context::from_waker(Waker::noop()))
}

/// Giving up a place costs the others nothing: a waiter woken for a freed slot and
/// dropped before it tried hands the wake-up on; a waiter dropped while queued leaves
/// the queue (a newcomer is then admitted at once); a waiter out of `max_wait` fails
/// with the refusal it waited for. No lease is left behind.
#[tokio::test(start_paused = true)]
async fn a_place_given_up_passes_its_wake_up_on() {
    let l = waiting(Quota::unlimited().concurrency(1), None);
    let mut svc = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|id: usize| async move { Ok::<_, BoxError>(id) }));
    let held = l.acquire(0).await.unwrap();
    let mut first = Box::pin(svc.ready().await.unwrap().call(0));
    let mut second = Box::pin(svc.ready().await.unwrap().call(1));
    assert!(poll_once(&mut first).is_pending());
    assert!(poll_once(&mut second).is_pending());
    assert_eq!(tries(l.stats()), (1, 1), "the second queued behind the first");
    drop(held); // wakes `first` ...
    drop(first); // ... which gives up before trying: the wake-up is `second`'s
    let Poll::Ready(out) = poll_once(&mut second) else {
        panic!("the wake-up was lost");
    };
    assert_eq!(out.unwrap(), 1);
    assert_eq!(tries(l.stats()), (2, 1));

    // Two slots free at once, two waiters woken; one gives up before trying, behind
    // the first in line: its wake-up goes on to the third, which need not wait for
    // the first to move.
    let l2 = RateLimiter::new(
        RateLimitConfig::new("s2", Quota::unlimited().concurrency(2)).mode(Mode::Wait { max_wait: None }),
        MemoryBackend::new(),
    )
    .unwrap();
    let mut svc2 = RateLimitLayer::new(l2.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|id: usize| async move { Ok::<_, BoxError>(id) }));
    let (h1, h2) = (l2.acquire(0).await.unwrap(), l2.acquire(0).await.unwrap());
    let mut a = Box::pin(svc2.ready().await.unwrap().call(0));
    let mut b = Box::pin(svc2.ready().await.unwrap().call(1));
    let mut c = Box::pin(svc2.ready().await.unwrap().call(2));
    for f in [&mut a, &mut b, &mut c] {
        assert!(poll_once(f).is_pending());
    }
    drop((h1, h2)); // wakes `a` and `b`
    drop(b);
    assert!(
        matches!(poll_once(&mut c), Poll::Ready(Ok(2))),
        "b's wake-up went to c"
    );
    assert!(matches!(poll_once(&mut a), Poll::Ready(Ok(0))));
    assert_eq!(tries(l2.stats()), (4, 1));
    assert_eq!(l2.held().await.unwrap().leases(), 0);

    // Dropped while queued: the queue is empty again.
    let held = l.acquire(0).await.unwrap();
    let mut third = Box::pin(svc.ready().await.unwrap().call(2));
    assert!(poll_once(&mut third).is_pending());
    drop(third);
    drop(held);
    let mut fourth = Box::pin(svc.ready().await.unwrap().call(3));
    assert!(
        matches!(poll_once(&mut fourth), Poll::Ready(Ok(3))),
        "admitted at once"
    );
    assert_eq!(l.held().await.unwrap().leases(), 0);

    // Out of time while queued.
    let l = waiting(
        Quota::unlimited().concurrency(1),
        Some(Duration::from_millis(100)),
    );
    let mut svc = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|id: usize| async move { Ok::<_, BoxError>(id) }));
    let held = l.acquire(0).await.unwrap();
    let t0 = tokio::time::Instant::now();
    let err = svc.ready().await.unwrap().call(0).await.unwrap_err();
    assert_eq!(tokio::time::Instant::now() - t0, Duration::from_millis(100));
    assert_eq!(
        err.downcast_ref::<QuotaExceeded>().unwrap().dimension(),
        "concurrency"
    );
    drop(held);
    assert_eq!(svc.ready().await.unwrap().call(1).await.unwrap(), 1);
    assert_eq!(l.held().await.unwrap().leases(), 0);
}

/// A concurrency refusal's `retry_after` is a hint (the slot hint), not when the slot
/// frees: a `max_wait` shorter than the hint still waits for a release, up to
/// `max_wait`. Before, such a call failed at once, its slot freeing 100 ms later.
#[tokio::test(start_paused = true)]
async fn max_wait_below_the_slot_hint_waits_for_a_release() {
    let l = RateLimiter::new(
        RateLimitConfig::new("s1", Quota::unlimited().concurrency(1))
            .slot_retry_after(Duration::from_secs(1))
            .mode(Mode::Wait {
                max_wait: Some(Duration::from_millis(200)),
            }),
        MemoryBackend::new(),
    )
    .unwrap();
    let svc = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|id: usize| async move { Ok::<_, BoxError>(id) }));

    let held = l.acquire(0).await.unwrap();
    let start = tokio::time::Instant::now();
    let call = tokio::spawn(svc.clone().oneshot(1));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!call.is_finished(), "waiting for the slot, not failed at once");
    drop(held);
    assert_eq!(call.await.unwrap().unwrap(), 1);
    assert_eq!(
        start.elapsed(),
        Duration::from_millis(100),
        "admitted at the release"
    );

    // No release: out of time at `max_wait`, not before.
    let held = l.acquire(0).await.unwrap();
    let start = tokio::time::Instant::now();
    let err = svc.clone().oneshot(2).await.unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_millis(200));
    let q = err.downcast_ref::<QuotaExceeded>().expect("quota exceeded");
    assert_eq!(q.dimension(), "concurrency");
    drop(held);
    assert_eq!(l.held().await.unwrap().leases(), 0);
}

/// In the poll a balancer dispatches in, `pgw_core::clock` answers the dispatch's
/// instant. A hold that ended between that instant and the wait's own clock reading
/// refused the admission at the first and was over at the second: the waiter asked
/// again at once, was refused again at the dispatch's instant, and so on for ever in
/// the same poll. The admission after a wait now reads the clock the wait read.
///
/// The poll runs on a thread of its own, so a regression fails here (after 30 s of
/// real time, a bound only: the poll answers at once) instead of hanging the suite.
#[test]
fn an_admission_after_a_wait_reads_the_clock_the_wait_read() {
    let (done, answer) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        let l = waiting(Quota::unlimited().requests(100), None);
        let stats = l.clone();
        let answered = rt.block_on(async move {
            l.hold(
                tower_ratelimit_redis::HoldScope::Source,
                Duration::from_millis(10),
            )
            .await
            .unwrap();
            let dispatched = tokio::time::Instant::now();
            tokio::time::sleep(Duration::from_millis(20)).await;
            let mut svc = RateLimitLayer::new(l)
                .token_estimate(NoTokens)
                .usage(NoTokens)
                .layer(service_fn(|()| async { Ok::<_, BoxError>("ok") }));
            let mut cx = Context::from_waker(Waker::noop());
            let _scope = pgw_core::clock::Dispatched::enter(dispatched);
            assert!(svc.poll_ready(&mut cx).is_ready());
            let mut call = Box::pin(svc.call(()));
            format!("{:?}", call.as_mut().poll(&mut cx))
        });
        let _ = done.send((answered, tries(stats.stats())));
    });
    let (answered, tried) = answer
        .recv_timeout(Duration::from_secs(30))
        .expect("the poll never returned");
    assert_eq!(answered, r#"Ready(Ok("ok"))"#);
    assert_eq!(
        tried,
        (1, 1),
        "refused at the dispatch's instant, admitted at the wait's"
    );
}
