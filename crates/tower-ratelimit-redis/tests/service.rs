//! The layer around a service: shedding, waiting, token hooks, not-admitted errors from
//! below, and nothing leaking on any path (memory backend, paused clock, unless noted).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgw_core::openai::{ChatRequest, ChatResponse, Usage};
use pgw_core::{BoxError, Paced, QuotaExceeded};
use tower::{Service, ServiceExt, service_fn};
use tower_layer::Layer;
use tower_ratelimit_redis::{
    Admission, MemoryBackend, Mode, NoTokens, Quota, RateLimitConfig, RateLimitLayer, RateLimiter,
    RequestTooLarge,
};

fn limiter(quota: Quota) -> RateLimiter {
    RateLimiter::new(
        RateLimitConfig::new("s1", quota).window(Duration::from_secs(1)),
        MemoryBackend::new(),
    )
    .unwrap()
}

fn chat(prompt_bytes: usize, max_tokens: u64) -> ChatRequest {
    let mut r = ChatRequest::user("m", "x".repeat(prompt_bytes));
    r.max_tokens = Some(max_tokens);
    r
}

fn answer(total: u64) -> ChatResponse {
    ChatResponse {
        usage: Some(Usage::new(0, total, total)),
        ..ChatResponse::default()
    }
}

#[tokio::test(start_paused = true)]
async fn sheds_with_quota_exceeded_and_stays_ready() {
    let l = limiter(Quota::unlimited().requests(1));
    let mut svc = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|_: ()| async { Ok::<_, BoxError>("ok") }));
    assert_eq!(svc.ready().await.unwrap().call(()).await.unwrap(), "ok");
    let err = svc.ready().await.unwrap().call(()).await.unwrap_err();
    let q = err.downcast_ref::<QuotaExceeded>().unwrap();
    // The first admission's sub-window (10 ms of a 1 s window) leaves the span one
    // window and one sub-window after it began.
    assert_eq!(
        (q.dimension(), q.retry_after()),
        ("rpm", Duration::from_millis(1010))
    );
    assert_eq!(l.stats().refused, 1);
}

/// A refused call leaves nothing reserved below: a concurrency permit the inner
/// service's readiness took is free at once (before, the refusing service held it
/// until its next call).
#[tokio::test(start_paused = true)]
async fn a_refused_call_holds_no_permit_of_the_service_below() {
    use futures_util::FutureExt;
    let l = limiter(Quota::unlimited().requests(1));
    let limited =
        tower::limit::ConcurrencyLimit::new(service_fn(|_: ()| async { Ok::<_, BoxError>("ok") }), 1);
    let mut other = limited.clone();
    let mut svc = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(limited);
    assert_eq!(svc.ready().await.unwrap().call(()).await.unwrap(), "ok");
    let err = svc.ready().await.unwrap().call(()).await.unwrap_err();
    assert!(err.is::<QuotaExceeded>(), "{err}");
    assert!(
        other.ready().now_or_never().is_some(),
        "the permit is free after the refused call"
    );
}

/// Default chat hooks: reserve prompt/3 + max_tokens, reconcile to reported usage.
#[tokio::test(start_paused = true)]
async fn chat_estimate_reserved_and_reconciled() {
    let l = limiter(Quota::unlimited().tokens(200));
    let seen = Arc::new(Mutex::new(Vec::<Admission>::new()));
    let seen2 = seen.clone();
    let mut svc = RateLimitLayer::new(l.clone())
        .on_admission(move |_: &ChatRequest, a: &Admission| seen2.lock().unwrap().push(a.clone()))
        .layer(service_fn(|_: ChatRequest| async {
            Ok::<_, BoxError>(answer(40))
        }));
    svc.ready().await.unwrap().call(chat(300, 50)).await.unwrap();
    assert_eq!(seen.lock().unwrap()[0].tokens(), 150);
    // 40 used: exactly 160 left in this window.
    let p = l.acquire(160).await.unwrap();
    assert!(l.acquire(1).await.is_err());
    drop(p);
    // Larger than the whole quota: refused at once, no admission recorded.
    let err = svc.ready().await.unwrap().call(chat(3, 200)).await.unwrap_err();
    assert!(err.is::<RequestTooLarge>(), "{err}");
    // Not admitted here, and waiting would not help: never an outcome of the source.
    assert_eq!(
        pgw_core::NotAdmitted::of(&*err),
        Some(pgw_core::NotAdmitted::Never)
    );
    assert_eq!(seen.lock().unwrap().len(), 1);
}

/// Waiting mode waits until the first admission leaves the span (one window and one
/// sub-window); an oversize request still fails at once.
#[tokio::test(start_paused = true)]
async fn waiting_mode_waits_but_never_for_the_impossible() {
    let l = RateLimiter::new(
        RateLimitConfig::new("s1", Quota::unlimited().requests(1).tokens(100))
            .window(Duration::from_secs(1))
            .mode(Mode::Wait { max_wait: None }),
        MemoryBackend::new(),
    )
    .unwrap();
    let mut svc = RateLimitLayer::new(l.clone())
        .token_estimate(|r: &u64| *r)
        .usage(NoTokens)
        .layer(service_fn(|_: u64| async {
            Ok::<_, BoxError>(tokio::time::Instant::now())
        }));
    let t0 = tokio::time::Instant::now();
    svc.ready().await.unwrap().call(10).await.unwrap();
    let second = svc.ready().await.unwrap().call(10).await.unwrap();
    assert_eq!(second - t0, Duration::from_millis(1010));
    let err = svc.ready().await.unwrap().call(101).await.unwrap_err();
    assert!(err.is::<RequestTooLarge>());
    assert_eq!(tokio::time::Instant::now() - t0, Duration::from_millis(1010));

    // max_wait shorter than the wait: refused at once instead of sleeping past it.
    let l = RateLimiter::new(
        RateLimitConfig::new("s2", Quota::unlimited().requests(1)).mode(Mode::Wait {
            max_wait: Some(Duration::from_millis(10)),
        }),
        MemoryBackend::new(),
    )
    .unwrap();
    let mut svc = RateLimitLayer::new(l)
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|_: ()| async { Ok::<_, BoxError>(()) }));
    svc.ready().await.unwrap().call(()).await.unwrap();
    let t1 = tokio::time::Instant::now();
    let err = svc.ready().await.unwrap().call(()).await.unwrap_err();
    assert!(err.is::<QuotaExceeded>());
    assert_eq!(tokio::time::Instant::now(), t1);
}

/// A not-admitted error from below is not an attempt: request, tokens and lease are
/// given back. Any other error keeps the reservation but releases the lease.
#[tokio::test(start_paused = true)]
async fn not_admitted_below_refunds_everything() {
    let l = limiter(Quota::unlimited().requests(1).tokens(10).concurrency(1));
    let mut paced = RateLimitLayer::new(l.clone())
        .token_estimate(|_: &()| 10)
        .usage(NoTokens)
        .layer(service_fn(|_: ()| async {
            Err::<(), BoxError>(Box::new(Paced::new()))
        }));
    for _ in 0..5 {
        let err = paced.ready().await.unwrap().call(()).await.unwrap_err();
        assert!(err.is::<Paced>(), "passed up unchanged: {err}");
    }
    // All five refunded: the one request and 10 tokens of this window are still free.
    let p = l.acquire(10).await.unwrap();
    drop(p);
    assert!(l.acquire(0).await.is_err());

    let l = limiter(Quota::unlimited().requests(2).concurrency(1));
    let mut failing = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|_: ()| async {
            Err::<(), BoxError>("connection reset".into())
        }));
    failing.ready().await.unwrap().call(()).await.unwrap_err();
    // Lease released (concurrency 1 admits again), but the request counted.
    let p = l.acquire(0).await.unwrap();
    drop(p);
    assert_eq!(
        l.acquire(0)
            .await
            .unwrap_err()
            .downcast_ref::<QuotaExceeded>()
            .unwrap()
            .dimension(),
        "rpm"
    );
}

/// Dropping the future mid-call, or a panic inside the inner future, releases the lease.
#[tokio::test(start_paused = true)]
async fn drop_and_panic_release_the_lease() {
    let l = limiter(Quota::unlimited().concurrency(1));
    let (mock, mut handle) = tower_test::mock::pair::<(), ()>();
    let mut svc = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(mock);
    handle.allow(1);
    let fut = svc.ready().await.unwrap().call(());
    let _req = handle.next_request().await.unwrap();
    assert!(l.acquire(0).await.is_err(), "the call holds the only slot");
    drop(fut);
    l.acquire(0).await.expect("dropping the future released the slot");

    let mut panicking = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|_: ()| async {
            if true {
                panic!("inner service panicked");
            }
            Ok::<(), BoxError>(())
        }));
    let fut = panicking.ready().await.unwrap().call(());
    let joined = tokio::spawn(fut).await;
    assert!(joined.unwrap_err().is_panic());
    l.acquire(0).await.expect("a panic released the slot");
}

/// A call longer than the lease TTL keeps its slot (renewed), and frees it at the end.
#[tokio::test(start_paused = true)]
async fn long_call_renews_its_lease() {
    let ttl = Duration::from_millis(300);
    let l = RateLimiter::new(
        RateLimitConfig::new("s1", Quota::unlimited().concurrency(1)).lease_ttl(ttl),
        MemoryBackend::new(),
    )
    .unwrap();
    let mut svc = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|_: ()| async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            Ok::<_, BoxError>(())
        }));
    let call = tokio::spawn(svc.ready().await.unwrap().call(()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let err = l.acquire(0).await.unwrap_err();
    assert_eq!(
        err.downcast_ref::<QuotaExceeded>().unwrap().dimension(),
        "concurrency"
    );
    call.await.unwrap().unwrap();
    l.acquire(0).await.unwrap();
    assert_eq!(l.stats().leases_lost, 0);
}

/// With Redis, the answer does not wait for the settle's round trip, but the settle's
/// command is on the connection before the answer is returned: the caller's next
/// admission (on the same connection) sees the reconciliation and the released lease.
#[tokio::test]
async fn redis_service_settles_without_delaying_the_answer() {
    let h = common::Harness::redis(common::standalone(), "svc").await;
    let l = h.limiter(h.config("s1", Quota::unlimited().tokens(200).concurrency(1)));
    let mut svc = RateLimitLayer::new(l.clone()).layer(service_fn(|_: ChatRequest| async {
        Ok::<_, BoxError>(answer(40))
    }));
    h.align(Duration::from_secs(1)).await;
    svc.ready().await.unwrap().call(chat(300, 50)).await.unwrap();
    let p = l.acquire(160).await.expect("40 used, lease released");
    assert!(l.acquire(1).await.is_err());
    p.finish(None).await.unwrap();
}

/// A `max_wait` too large for the clock is no deadline, not a panic.
#[tokio::test(start_paused = true)]
async fn huge_max_wait_waits_without_panicking() {
    let l = RateLimiter::new(
        RateLimitConfig::new("s1", Quota::unlimited().requests(1))
            .window(Duration::from_secs(1))
            .mode(Mode::Wait {
                max_wait: Some(Duration::MAX),
            }),
        MemoryBackend::new(),
    )
    .unwrap();
    let mut svc = RateLimitLayer::new(l)
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|_: ()| async {
            Ok::<_, BoxError>(tokio::time::Instant::now())
        }));
    let t0 = tokio::time::Instant::now();
    svc.ready().await.unwrap().call(()).await.unwrap();
    let second = svc.ready().await.unwrap().call(()).await.unwrap();
    assert_eq!(second - t0, Duration::from_millis(1010));
}
