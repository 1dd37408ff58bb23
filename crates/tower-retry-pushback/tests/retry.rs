//! The retry loop's behaviour, under tokio's paused clock.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pgw_core::{BoxError, CallHistory, CarriesHistory, CircuitOpen, Outcome, Paced, QuotaExceeded, SourceId};
use support::{Ans, FailingHold, Req, Router, StuckHold, TestClassifier, TestHold, Upstream, classify};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};
use tower_retry_pushback::{
    CallDeadline, HistoryMode, HttpResend, Reason, Retry, RetryConfig, RetryError, RetryLayer, RetryStats,
};

fn layer(config: RetryConfig) -> RetryLayer<TestClassifier> {
    RetryLayer::new(config)
        .unwrap()
        .classifier(TestClassifier)
        .rng_seed(42)
}

async fn call<S>(svc: &mut S, req: Req) -> Result<Ans, BoxError>
where
    S: Service<Req, Response = Ans, Error = BoxError>,
{
    svc.ready().await?.call(req).await
}

fn retry_error(err: &BoxError) -> &RetryError {
    err.downcast_ref::<RetryError>()
        .unwrap_or_else(|| panic!("not a RetryError: {err}"))
}

fn outcomes(err: &RetryError) -> Vec<Outcome> {
    err.attempts().iter().map(|a| a.outcome).collect()
}

fn rl(secs: u64) -> Result<Ans, BoxError> {
    Ok(Ans::RateLimited(Some(Duration::from_secs(secs))))
}

// ---------------------------------------------------------------- R1, R2

#[tokio::test(start_paused = true)]
async fn ten_429s_then_success_with_the_default_budget() {
    for seed in 0..20 {
        let mut script: Vec<Result<Ans, BoxError>> = (0..10).map(|_| Ok(Ans::RateLimited(None))).collect();
        script.push(Ok(Ans::Ok));
        let upstream = Upstream::with(script);
        // Ten backoffs draw up to 111.5 s: past the default pushback bound (R3, tested
        // on its own below), which is lifted here to see the attempt budget alone.
        let mut svc = layer(RetryConfig {
            max_pushback_wait: Duration::from_secs(120),
            ..RetryConfig::default()
        })
        .rng_seed(seed)
        .layer(upstream.clone());
        let history = CallHistory::new();
        let req = Req {
            id: 1,
            history: Some(history.clone()),
        };
        assert_eq!(call(&mut svc, req).await.unwrap(), Ans::Ok, "seed {seed}");
        assert_eq!(upstream.sent_count(), 11);
        // The layer recorded every attempt into the caller's history.
        assert_eq!(history.len(), 11);
        assert_eq!(history.last().unwrap().outcome, Outcome::Success);
    }
}

#[tokio::test(start_paused = true)]
async fn three_transient_failures_exhaust_the_budget() {
    let upstream = Upstream::always(Ans::Transient);
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    let err = retry_error(&err);
    assert_eq!(err.reason(), Reason::BudgetExhausted);
    assert_eq!(outcomes(err), vec![Outcome::Transient; 3]);
    assert_eq!(upstream.sent_count(), 3);
    assert!(
        err.to_string()
            .contains("attempt budget exhausted after 3 attempts"),
        "{err}"
    );
}

#[tokio::test(start_paused = true)]
async fn source_dead_spends_the_budget_and_retries_at_once() {
    // Under a balancer (the attempts name their source): the next one goes elsewhere.
    let upstream = Upstream::with(vec![Ok(Ans::Dead), Ok(Ans::Dead), Ok(Ans::Dead)]).named("s1");
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    let start = Instant::now();
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    assert_eq!(retry_error(&err).reason(), Reason::BudgetExhausted);
    assert_eq!(upstream.sent_count(), 3);
    assert_eq!(Instant::now(), start, "no backoff after SourceDead");

    // Alone, the next attempt goes to the same upstream: backoffs of at least the
    // floor (half the base) between them.
    let alone = Upstream::with(vec![Ok(Ans::Dead), Ok(Ans::Dead), Ok(Ans::Dead)]);
    let mut svc = layer(RetryConfig::default()).layer(alone.clone());
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    assert_eq!(retry_error(&err).reason(), Reason::BudgetExhausted);
    let floor = RetryConfig::default().base_backoff / 2;
    let gaps: Vec<_> = alone.sent_times().windows(2).map(|w| w[1] - w[0]).collect();
    assert!(gaps.len() == 2 && gaps.iter().all(|g| *g >= floor), "{gaps:?}");
}

#[tokio::test(start_paused = true)]
async fn a_400_is_attempted_once() {
    let upstream = Upstream::always(Ans::Rejected);
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    let err = retry_error(&err);
    assert_eq!(err.reason(), Reason::Rejected);
    assert_eq!(outcomes(err), vec![Outcome::Rejected]);
    assert_eq!(upstream.sent_count(), 1);
}

/// The retry layer over `upstream`, with every error from it classified `Rejected`
/// (as a 400 is).
fn rejecting_errors(upstream: &Upstream) -> impl Service<Req, Response = Ans, Error = BoxError> + use<> {
    let classify_400 = |r: &Result<Ans, BoxError>| match r {
        Err(_) => Outcome::Rejected,
        other => classify(other),
    };
    RetryLayer::default()
        .classifier(classify_400)
        .rng_seed(1)
        .layer(upstream.clone())
}

fn too_long() -> BoxError {
    let body = br#"{"error":{"message":"maximum context length is 8192 tokens","param":"messages","code":"context_length_exceeded"}}"#;
    let provider = pgw_core::ProviderError::parse(body).unwrap();
    Box::new(
        pgw_core::UpstreamStatus::new(http::StatusCode::BAD_REQUEST, None, "too long")
            .with_provider(provider),
    )
}

#[tokio::test(start_paused = true)]
async fn a_request_too_large_for_one_source_moves_on_at_once() {
    // context_length_exceeded is Rejected (the source is fine), but another source may
    // take the request: one attempt spent, no backoff, the next one answers.
    let upstream = Upstream::with(vec![Err(too_long()), Ok(Ans::Ok)]).named("s1");
    let mut svc = rejecting_errors(&upstream);
    let started = tokio::time::Instant::now();
    assert!(matches!(call(&mut svc, Req::new(1)).await, Ok(Ans::Ok)));
    assert_eq!(upstream.sent_count(), 2);
    assert_eq!(
        started.elapsed(),
        std::time::Duration::ZERO,
        "no backoff before moving on"
    );

    // Too large everywhere: the budget ends it, with the provider's answer kept.
    let upstream = Upstream::with((0..5).map(|_| Err(too_long())).collect()).named("s1");
    let mut svc = rejecting_errors(&upstream);
    let err = call(&mut svc, Req::new(2)).await.unwrap_err();
    let err = retry_error(&err);
    assert_eq!(err.reason(), Reason::Rejected);
    assert_eq!(upstream.sent_count(), 3, "the attempt budget bounds it");
    assert!(pgw_core::exceeds_source(err.last_error().unwrap()));
}

#[tokio::test(start_paused = true)]
async fn a_400_error_is_kept_as_the_last_error() {
    let upstream = Upstream::with(vec![
        Ok(Ans::Transient),
        Err("bad request: prompt too long".into()),
    ]);
    let mut svc = rejecting_errors(&upstream);
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    let err = retry_error(&err);
    assert_eq!(err.reason(), Reason::Rejected);
    assert_eq!(outcomes(err), vec![Outcome::Transient, Outcome::Rejected]);
    assert_eq!(
        err.last_error().unwrap().to_string(),
        "bad request: prompt too long"
    );
}

#[tokio::test(start_paused = true)]
async fn invalid_is_reasked_exactly_max_reasks_times() {
    for max_reasks in [0, 2, 4] {
        let upstream = Upstream::always(Ans::Invalid);
        let mut svc = layer(RetryConfig {
            max_reasks,
            ..RetryConfig::default()
        })
        .layer(upstream.clone());
        let err = call(&mut svc, Req::new(1)).await.unwrap_err();
        let err = retry_error(&err);
        assert_eq!(err.reason(), Reason::ReasksExhausted);
        assert_eq!(upstream.sent_count(), 1 + max_reasks as usize);
        assert_eq!(outcomes(err), vec![Outcome::Invalid; 1 + max_reasks as usize]);
    }
}

#[tokio::test(start_paused = true)]
async fn reasks_do_not_spend_the_attempt_budget() {
    let upstream = Upstream::with(vec![
        Ok(Ans::Invalid),
        Ok(Ans::Transient),
        Ok(Ans::Invalid),
        Ok(Ans::Transient),
        Ok(Ans::Ok),
    ]);
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    assert_eq!(upstream.sent_count(), 5);
}

// ---------------------------------------------------------------- R3, standalone

#[tokio::test(start_paused = true)]
async fn retry_after_seconds_is_honoured_without_a_hold_hook() {
    let upstream = Upstream::with(vec![rl(7)]);
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    let t = upstream.sent_times();
    assert_eq!(t.len(), 2);
    assert!(t[1] - t[0] >= Duration::from_secs(7), "{:?}", t[1] - t[0]);
}

#[tokio::test(start_paused = true)]
async fn retry_after_http_date_is_honoured() {
    // 07:28:00 GMT against a wall clock of 07:27:50: ten seconds.
    let upstream = Upstream::with(vec![Ok(Ans::RateLimitedHeader("Wed, 21 Oct 2015 07:28:00 GMT"))]);
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    let t = upstream.sent_times();
    assert!(t[1] - t[0] >= Duration::from_secs(10), "{:?}", t[1] - t[0]);
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_beyond_the_stall_window_fails_at_once() {
    let upstream = Upstream::always(Ans::RateLimited(Some(Duration::from_secs(200))));
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    let start = Instant::now();
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    assert_eq!(Instant::now(), start, "must not sleep");
    assert_eq!(
        retry_error(&err).reason(),
        Reason::WaitTooLong {
            wait: Duration::from_secs(200),
            limit: Duration::from_secs(120)
        }
    );
    assert_eq!(upstream.sent_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_max_call_duration_too_large_for_the_clock_is_no_deadline_not_a_panic() {
    let upstream = Upstream::with(vec![rl(7)]);
    let mut svc = layer(RetryConfig {
        max_call_duration: Some(Duration::MAX),
        ..RetryConfig::default()
    })
    .layer(upstream.clone());
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    assert_eq!(upstream.sent_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_beyond_the_deadline_fails_at_once() {
    let upstream = Upstream::always(Ans::RateLimited(Some(Duration::from_secs(30))));
    let mut svc = layer(RetryConfig {
        max_call_duration: Some(Duration::from_secs(20)),
        ..RetryConfig::default()
    })
    .layer(upstream.clone());
    let start = Instant::now();
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    assert_eq!(Instant::now(), start);
    assert_eq!(
        retry_error(&err).reason(),
        Reason::WaitTooLong {
            wait: Duration::from_secs(30),
            limit: Duration::from_secs(20)
        }
    );
}

// ---------------------------------------------------------------- R3, with holds

#[tokio::test(start_paused = true)]
async fn pushback_moves_to_the_other_source_at_once_and_holds_the_first() {
    let holds = TestHold::default();
    let s1 = Upstream::with(vec![rl(30)]);
    let router = Router::new(
        vec![("s1", s1.clone()), ("s2", Upstream::always(Ans::Ok))],
        holds.clone(),
    );
    let mut svc = layer(RetryConfig::default())
        .hold(Arc::new(holds.clone()))
        .layer(router.clone());
    let start = Instant::now();
    let history = CallHistory::new();
    let req = Req {
        id: 1,
        history: Some(history.clone()),
    };
    assert_eq!(call(&mut svc, req).await.unwrap(), Ans::Ok);
    assert_eq!(Instant::now(), start, "the second attempt went out at once");
    assert_eq!(router.times_of("s2"), vec![start]);
    assert_eq!(
        *holds.calls.lock().unwrap(),
        vec![(SourceId::from("s1"), Duration::from_secs(30))]
    );
    let sources: Vec<_> = history
        .attempts()
        .into_iter()
        .map(|a| a.source.unwrap())
        .collect();
    assert_eq!(sources, vec![SourceId::from("s1"), SourceId::from("s2")]);

    // More calls within the hold go to s2; s1 gets nothing for 30 s.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(call(&mut svc, Req::new(2)).await.unwrap(), Ans::Ok);
    }
    // At 30 s the hold has expired: the router prefers s1 again.
    assert_eq!(
        router.times_of("s1"),
        vec![start, start + Duration::from_secs(30)]
    );
    assert_eq!(router.times_of("s2").len(), 6);
}

/// A pushback that is a 5xx (the provider overloaded: a 503 with `Retry-After`) is
/// held through `hold_after_overload`, a 429 through `hold`: the holds' refusals can
/// tell the two apart (`QuotaExceeded::is_after_overload`).
#[tokio::test(start_paused = true)]
async fn an_overloaded_pushback_is_held_as_one() {
    /// The test classifier for answers, pgw-core's for the upstream's errors (a 503 or
    /// 429 with `Retry-After` is pushback).
    #[derive(Clone, Copy)]
    struct StatusAware;
    impl pgw_core::Classify<Ans, BoxError> for StatusAware {
        fn classify(&self, r: &Result<Ans, BoxError>) -> Outcome {
            match r {
                Err(e) => pgw_core::classify_error(&**e),
                Ok(_) => support::classify(r),
            }
        }
    }
    let pushback = |status: http::StatusCode| -> Result<Ans, BoxError> {
        Err(Box::new(pgw_core::UpstreamStatus::new(
            status,
            Some(Duration::from_secs(30)),
            "busy",
        )))
    };
    let holds = TestHold::default();
    let s1 = Upstream::with(vec![pushback(http::StatusCode::SERVICE_UNAVAILABLE)]);
    let s2 = Upstream::with(vec![pushback(http::StatusCode::TOO_MANY_REQUESTS)]);
    let router = Router::new(
        vec![("s1", s1), ("s2", s2), ("s3", Upstream::always(Ans::Ok))],
        holds.clone(),
    );
    let mut svc = RetryLayer::new(RetryConfig::default())
        .unwrap()
        .classifier(StatusAware)
        .rng_seed(42)
        .hold(Arc::new(holds.clone()))
        .layer(router);
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    let held: Vec<_> = holds
        .calls
        .lock()
        .unwrap()
        .iter()
        .map(|(s, _)| s.clone())
        .collect();
    assert_eq!(held, vec![SourceId::from("s1"), SourceId::from("s2")]);
    assert_eq!(*holds.overloaded.lock().unwrap(), vec![SourceId::from("s1")]);
}

/// R3: a Retry-After longer than the call may wait still moves the call on at once to
/// another source (only a call that would have to sleep through it fails).
#[tokio::test(start_paused = true)]
async fn a_retry_after_beyond_the_stall_window_moves_on_to_another_source() {
    let holds = TestHold::default();
    let router = Router::new(
        vec![
            ("s1", Upstream::with(vec![rl(500)])),
            ("s2", Upstream::always(Ans::Ok)),
        ],
        holds.clone(),
    );
    let mut svc = layer(RetryConfig::default())
        .hold(Arc::new(holds.clone()))
        .layer(router.clone());
    let start = Instant::now();
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    assert_eq!(Instant::now(), start);
    assert_eq!(router.times_of("s2"), vec![start]);
    assert_eq!(
        *holds.calls.lock().unwrap(),
        vec![(SourceId::from("s1"), Duration::from_secs(500))]
    );
}

#[tokio::test(start_paused = true)]
async fn one_source_with_a_hold_waits_out_the_retry_after() {
    let holds = TestHold::default();
    let s1 = Upstream::with(vec![rl(7)]);
    let router = Router::new(vec![("s1", s1.clone())], holds.clone());
    let mut svc = layer(RetryConfig::default())
        .hold(Arc::new(holds.clone()))
        .layer(router.clone());
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    let t = router.times_of("s1");
    assert_eq!(t.len(), 2);
    assert_eq!(
        t[1] - t[0],
        Duration::from_secs(7),
        "sent as soon as the hold ended"
    );
}

#[tokio::test(start_paused = true)]
async fn one_source_with_a_hold_beyond_the_stall_window_fails_at_once() {
    let holds = TestHold::default();
    let router = Router::new(vec![("s1", Upstream::with(vec![rl(500)]))], holds.clone());
    let mut svc = layer(RetryConfig::default())
        .hold(Arc::new(holds.clone()))
        .layer(router.clone());
    let start = Instant::now();
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    assert_eq!(Instant::now(), start);
    let err = retry_error(&err);
    assert_eq!(
        err.reason(),
        Reason::WaitTooLong {
            wait: Duration::from_secs(500),
            limit: Duration::from_secs(120)
        }
    );
    assert!(err.last_error().unwrap().is::<QuotaExceeded>());
    assert_eq!(router.times_of("s1").len(), 1);
}

// ---------------------------------------------------------------- R3, the pushback bound

/// An upstream answering 429 without `Retry-After` to every attempt, no hold hook: the
/// layer sleeps a backoff after each (no attempt budget spent), and ends the call when
/// the next backoff would take its pushback past `max_pushback_wait` (60 s by
/// default), with the clear reason, instead of going on until the stall guard.
#[tokio::test(start_paused = true)]
async fn persistent_429s_without_retry_after_end_the_call_at_the_pushback_bound() {
    let limit = tower_retry_pushback::DEFAULT_MAX_PUSHBACK_WAIT;
    assert_eq!(limit, Duration::from_secs(60));
    for seed in 0..20 {
        let upstream = Upstream::always(Ans::RateLimited(None));
        let mut svc = layer(RetryConfig::default())
            .rng_seed(seed)
            .layer(upstream.clone());
        let start = Instant::now();
        let err = call(&mut svc, Req::new(1)).await.unwrap_err();
        let took = start.elapsed();
        let err = retry_error(&err);
        let Reason::PushbackExhausted {
            waited,
            wait,
            limit: l,
        } = err.reason()
        else {
            panic!("seed {seed}: {err}");
        };
        assert_eq!(l, limit);
        // Every instant of the call was a backoff slept after a 429 (the upstream
        // answers at once): the time is the pushback (the timer rounds each sleep up
        // to its millisecond), within one backoff (<= 20 s) under the bound, and the
        // backoff not slept would have passed it.
        let sent = upstream.sent_count();
        let rounding = Duration::from_millis(sent as u64);
        assert!(
            took >= waited && took - waited <= rounding,
            "seed {seed}: {took:?}"
        );
        assert!(waited <= limit && waited + wait > limit, "seed {seed}: {err}");
        assert!(waited > limit - Duration::from_secs(20), "seed {seed}: {err}");
        // The backoffs of the first six 429s add up to at most 31.5 s, of seven 51.5 s:
        // at least seven were slept, so at least eight attempts, all 429s.
        assert!(sent >= 8, "seed {seed}: {sent} attempts");
        assert_eq!(err.attempts().len(), sent);
        assert!(err.attempts().iter().all(|a| a.outcome.is_rate_limited()));
        assert!(err.to_string().contains("pushback wait exhausted"), "{err}");
        assert!(err.to_string().contains("Retry-After or backoff"), "{err}");
        assert_eq!(svc.stats(), RetryStats::default());
    }
}

/// With `Retry-After: 10` on every 429 the waits are exact: five or six 429s (50 s,
/// 60 s of pushback) still end in an answer; a seventh 429 would need 70 s, so the
/// call ends after the sixth wait, at 60 s, before sleeping it.
#[tokio::test(start_paused = true)]
async fn the_pushback_bound_counts_the_retry_after_waits_and_no_more() {
    for (n429, answered) in [(5, true), (6, true), (7, false)] {
        let upstream = Upstream::with((0..n429).map(|_| rl(10)).collect());
        let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
        let start = Instant::now();
        let result = call(&mut svc, Req::new(1)).await;
        assert_eq!(result.is_ok(), answered, "{n429} 429s: {result:?}");
        if answered {
            assert_eq!(start.elapsed(), Duration::from_secs(10 * n429), "{n429}");
            assert_eq!(upstream.sent_count(), n429 as usize + 1);
        } else {
            let err = result.unwrap_err();
            assert_eq!(
                retry_error(&err).reason(),
                Reason::PushbackExhausted {
                    waited: Duration::from_secs(60),
                    wait: Duration::from_secs(10),
                    limit: Duration::from_secs(60),
                }
            );
            assert_eq!(start.elapsed(), Duration::from_secs(60));
            assert_eq!(upstream.sent_count(), 7);
        }
    }
    // The bound is configurable: 25 s lets two 10 s waits through, not a third.
    let upstream = Upstream::always(Ans::RateLimited(Some(Duration::from_secs(10))));
    let mut svc = layer(RetryConfig {
        max_pushback_wait: Duration::from_secs(25),
        ..RetryConfig::default()
    })
    .layer(upstream.clone());
    let start = Instant::now();
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    assert!(matches!(
        retry_error(&err).reason(),
        Reason::PushbackExhausted { waited, .. } if waited == Duration::from_secs(20)
    ));
    assert_eq!(start.elapsed(), Duration::from_secs(20));
    assert_eq!(upstream.sent_count(), 3);
}

/// Waits that are not pushback do not count: a call that waited minutes for quota
/// windows and pacing, with one 429 among them, is still answered.
#[tokio::test(start_paused = true)]
async fn quota_and_pacing_waits_do_not_count_as_pushback() {
    let quota =
        || -> Result<Ans, BoxError> { Err(QuotaExceeded::new("rpm", Duration::from_secs(50)).into()) };
    let upstream = Upstream::with(vec![
        quota(),
        rl(10),
        quota(),
        Err(Paced::new().into()),
        quota(),
        rl(10),
    ]);
    let mut svc = layer(RetryConfig {
        max_pushback_wait: Duration::from_secs(25),
        // (Nothing else in the test process succeeds: keep the stall guard out of it.)
        stall_window: Duration::from_secs(600),
        ..RetryConfig::default()
    })
    .layer(upstream.clone());
    let start = Instant::now();
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    assert!(
        start.elapsed() > Duration::from_secs(170),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(upstream.sent_count(), 7);
}

/// With holds (the gateway's way), a 429's wait is counted from its answer; a call
/// that goes on at once from one held source to another (both 429, as two sources of
/// one account) waits for both holds together, so they count once. Two sources
/// answering 429 with `Retry-After: 20` (never shorter than the backoff) to
/// everything: each round of two 429s adds 20 s; at 60 s the next 429 ends the call,
/// its source still held.
#[tokio::test(start_paused = true)]
async fn held_429s_count_their_overlapping_waits_once() {
    let holds = TestHold::default();
    let always = || Upstream::always(Ans::RateLimited(Some(Duration::from_secs(20))));
    let router = Router::new(vec![("s1", always()), ("s2", always())], holds.clone());
    let mut svc = layer(RetryConfig::default())
        .hold(Arc::new(holds.clone()))
        .layer(router.clone());
    let start = Instant::now();
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    let err = retry_error(&err);
    assert_eq!(
        err.reason(),
        Reason::PushbackExhausted {
            waited: Duration::from_secs(60),
            wait: Duration::from_secs(20),
            limit: Duration::from_secs(60),
        },
        "{err}"
    );
    assert_eq!(start.elapsed(), Duration::from_secs(60));
    // Three rounds of two (0 s, 20 s, 40 s), then s1 at 60 s.
    let secs = |s: &str| -> Vec<u64> {
        router
            .times_of(s)
            .iter()
            .map(|t| (*t - start).as_secs())
            .collect()
    };
    assert_eq!(secs("s1"), vec![0, 20, 40, 60]);
    assert_eq!(secs("s2"), vec![0, 20, 40]);
    assert_eq!(holds.calls.lock().unwrap().len(), 7, "the last 429 still held s1");
    assert_eq!(err.attempts().len(), 7);
}

// ---------------------------------------------------------------- not admitted

#[tokio::test(start_paused = true)]
async fn all_circuits_open_fails_fast_without_an_attempt() {
    let upstream = Upstream::from_fn(|_| Err(CircuitOpen::new(Duration::from_secs(42)).into()));
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    let err = retry_error(&err);
    assert_eq!(
        err.reason(),
        Reason::AllCircuitsOpen {
            retry_after: Duration::from_secs(42)
        }
    );
    assert!(err.attempts().is_empty(), "not admitted is not an attempt");
    assert_eq!(upstream.sent_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_gates_own_backend_failure_is_waited_out_not_spent() {
    // The limiter's Redis did not answer twice (it failed closed), then came back: a
    // gate's failure, not an outcome of the source, so even a budget of one attempt
    // is not spent, and the call asks again after a second each time.
    let down = || -> Result<Ans, BoxError> {
        Err(pgw_core::BackendUnavailable::new("redis", "admit", "connection refused").into())
    };
    let upstream = Upstream::with(vec![down(), down(), Ok(Ans::Ok)]);
    let mut svc = layer(RetryConfig {
        max_attempts: 1,
        ..RetryConfig::default()
    })
    .layer(upstream.clone());
    let history = CallHistory::new();
    let req = Req {
        id: 1,
        history: Some(history.clone()),
    };
    assert_eq!(call(&mut svc, req).await.unwrap(), Ans::Ok);
    let t = upstream.sent_times();
    assert_eq!(t.len(), 3);
    assert!(t[1] - t[0] >= pgw_core::UNAVAILABLE_RETRY_AFTER);
    assert!(t[2] - t[1] >= pgw_core::UNAVAILABLE_RETRY_AFTER);
    assert_eq!(history.len(), 1, "only the real attempt is recorded");
}

#[tokio::test(start_paused = true)]
async fn a_request_no_gate_can_ever_admit_fails_at_once_without_an_attempt() {
    let upstream = Upstream::from_fn(|_| Err(Box::new(pgw_core::NeverAdmitted) as BoxError));
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    let start = Instant::now();
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    assert_eq!(Instant::now(), start, "no wait: waiting cannot cure it");
    let err = retry_error(&err);
    assert_eq!(err.reason(), Reason::Rejected);
    assert!(err.attempts().is_empty(), "not admitted is not an attempt");
    assert_eq!(upstream.sent_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn quota_and_pacing_are_waited_out_without_spending_the_budget() {
    let upstream = Upstream::with(vec![
        Err(QuotaExceeded::new("rpm", Duration::from_secs(5)).into()),
        Err(Paced::new().into()),
        Ok(Ans::Transient),
        Err(QuotaExceeded::new("rpm", Duration::ZERO).into()),
        Ok(Ans::Transient),
        Ok(Ans::Ok),
    ]);
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    let history = CallHistory::new();
    let req = Req {
        id: 1,
        history: Some(history.clone()),
    };
    assert_eq!(call(&mut svc, req).await.unwrap(), Ans::Ok);
    let t = upstream.sent_times();
    assert!(t[1] - t[0] >= Duration::from_secs(5));
    // A zero retry_after still waits a little: no spinning.
    assert!(t[4] - t[3] >= Duration::from_millis(10));
    assert_eq!(history.len(), 3, "only real attempts are recorded");
}

/// Calls woken by one quota end re-ask oldest first (`pgw_core::fair`), whatever order
/// they went to sleep in; a call waiting alone re-asks at the end itself.
#[tokio::test(start_paused = true)]
async fn calls_woken_by_one_end_re_ask_oldest_first() {
    let t0 = Instant::now();
    let (early, end) = (t0 + Duration::from_secs(30), t0 + Duration::from_secs(70));
    // Call 1 (from t0) is refused until 30 s, then until 70 s; call 2 (from 20 s) until
    // 70 s. So call 2 goes to sleep for the end at 70 s first, call 1 ten seconds later.
    let upstream = Upstream::from_fn(move |req| {
        let now = Instant::now();
        let until = if req.id == 1 && now < early { early } else { end };
        if now < until {
            Err(QuotaExceeded::new("rpm", until - now).into())
        } else {
            Ok(Ans::Ok)
        }
    });
    let svc = layer(RetryConfig::default()).layer(upstream.clone());
    let young = {
        let mut svc = svc.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(20)).await;
            call(&mut svc, Req::new(2)).await
        })
    };
    assert_eq!(call(&mut svc.clone(), Req::new(1)).await.unwrap(), Ans::Ok);
    assert_eq!(young.await.unwrap().unwrap(), Ans::Ok);
    let sent = upstream.sent.lock().unwrap().clone();
    let asked = |id: u32| -> Vec<Duration> { sent.iter().filter(|s| s.0 == id).map(|s| s.1 - t0).collect() };
    let (old, new) = (asked(1), asked(2));
    // Alone while it slept for the first end: woken at it exactly.
    assert_eq!(old[..2], [Duration::ZERO, Duration::from_secs(30)]);
    assert_eq!(new[0], Duration::from_secs(20));
    // Both slept for the end at 70 s beside another: after it, within the span, the
    // call waiting since t0 before the one waiting since 20 s.
    let (o, n) = (old[2], new[1]);
    let last = Duration::from_secs(70) + pgw_core::fair::ORDER_SPAN;
    assert!(Duration::from_secs(70) < o && o < n && n <= last, "{o:?} {n:?}");
}

/// The oldest-first offset never takes a wait past the call's deadline: a call whose
/// quota ends just before its deadline re-asks at the end, beside another waiting call
/// (the offset would have woken it after the deadline), and is answered.
#[tokio::test(start_paused = true)]
async fn the_oldest_first_offset_stops_short_of_the_deadline() {
    let t0 = Instant::now();
    let end = t0 + Duration::from_millis(9_900);
    let upstream = Upstream::from_fn(move |req| {
        let now = Instant::now();
        if req.id == 2 {
            // Keeps a call sleeping beside call 1 (until its own deadline ends it).
            return Err(QuotaExceeded::new("rpm", Duration::from_secs(5)).into());
        }
        if now < end {
            Err(QuotaExceeded::new("rpm", end - now).into())
        } else {
            Ok(Ans::Ok)
        }
    });
    let config = RetryConfig {
        max_call_duration: Some(Duration::from_secs(10)),
        ..RetryConfig::default()
    };
    let svc = layer(config).layer(upstream.clone());
    let other = {
        let mut svc = svc.clone();
        tokio::spawn(async move { call(&mut svc, Req::new(2)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(call(&mut svc.clone(), Req::new(1)).await.unwrap(), Ans::Ok);
    let asked: Vec<Duration> = upstream
        .sent
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.0 == 1)
        .map(|s| s.1 - t0)
        .collect();
    assert_eq!(asked, [Duration::from_millis(100), Duration::from_millis(9_900)]);
    assert!(other.await.unwrap().is_err(), "call 2 ends at its deadline");
}

/// A quota wait too long for the clock to add (`Duration::MAX`, with a stall window
/// as long) is slept, not re-asked at once.
#[tokio::test(start_paused = true)]
async fn an_endless_quota_wait_is_slept_not_spun() {
    let asks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let upstream = Upstream::from_fn({
        let asks = Arc::clone(&asks);
        move |_| {
            let n = asks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            assert!(n < 3, "re-asked at once: {n} questions");
            Err(QuotaExceeded::new("rpm", Duration::MAX).into())
        }
    });
    let config = RetryConfig {
        stall_window: Duration::MAX,
        ..RetryConfig::default()
    };
    let mut svc = layer(config).layer(upstream);
    let waited = tokio::time::timeout(Duration::from_secs(3600), call(&mut svc, Req::new(1))).await;
    assert!(waited.is_err(), "still asleep an hour later: {waited:?}");
    assert_eq!(asks.load(std::sync::atomic::Ordering::SeqCst), 1);
}

// ---------------------------------------------------------------- R4

/// A 60 s stall window. These calls wait through 429s: the pushback bound (R3) is
/// lifted so that the stall guard is what ends them.
fn stall_config() -> RetryConfig {
    RetryConfig {
        stall_window: Duration::from_secs(60),
        max_pushback_wait: Duration::from_secs(3600),
        ..RetryConfig::default()
    }
}

#[tokio::test(start_paused = true)]
async fn stalls_when_nothing_in_the_process_succeeds() {
    let upstream = Upstream::always(Ans::RateLimited(Some(Duration::from_secs(10))));
    let mut svc = layer(stall_config()).layer(upstream.clone());
    let start = Instant::now();
    let err = call(&mut svc, Req::new(0)).await.unwrap_err();
    let elapsed = Instant::now() - start;
    let Reason::Stalled { waited } = retry_error(&err).reason() else {
        panic!("{err}")
    };
    assert!(waited > Duration::from_secs(60), "{waited:?}");
    // Fails at the first check past the window (the longest single wait is 20 s).
    assert!(elapsed <= Duration::from_secs(80), "{elapsed:?}");
    assert!(upstream.sent_count() >= 4);
    assert_eq!(svc.stats(), RetryStats::default());
}

/// R4 is a double condition: a process that has been quiet for many windows does not
/// stall a call that has only just started waiting.
#[tokio::test(start_paused = true)]
async fn a_quiet_process_does_not_stall_a_call_that_just_started_waiting() {
    let upstream = Upstream::with(vec![rl(10), rl(10)]);
    let mut svc = layer(stall_config()).layer(upstream.clone());
    tokio::time::sleep(Duration::from_secs(300)).await;
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    assert_eq!(upstream.sent_count(), 3);
    assert_eq!(svc.stats(), RetryStats::default());
}

#[tokio::test(start_paused = true)]
async fn keeps_waiting_while_other_calls_succeed() {
    // Request 0 is always pushed back; the others succeed.
    let upstream = Upstream::from_fn(|req| {
        Ok(if req.id == 0 {
            Ans::RateLimited(Some(Duration::from_secs(10)))
        } else {
            Ans::Ok
        })
    });
    let svc = layer(stall_config()).layer(upstream.clone());
    let start = Instant::now();
    let others = {
        let mut svc = svc.clone();
        tokio::spawn(async move {
            while Instant::now() - start < Duration::from_secs(300) {
                tokio::time::sleep(Duration::from_secs(5)).await;
                assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
            }
        })
    };
    let err = call(&mut svc.clone(), Req::new(0)).await.unwrap_err();
    let ended = Instant::now() - start;
    others.await.unwrap();
    assert!(
        matches!(retry_error(&err).reason(), Reason::Stalled { .. }),
        "{err}"
    );
    // Progress went on until 300 s: the stuck call kept waiting; it stalled once the
    // process had been idle for a whole window.
    assert!(ended > Duration::from_secs(360), "{ended:?}");
    assert!(ended <= Duration::from_secs(380), "{ended:?}");
}

// ---------------------------------------------------------------- R5, R6

/// A layer whose retry budget is its reserve alone: ten retries (no ratio of the
/// requests), backoffs of at least 500 ms.
fn budget_of_ten() -> RetryLayer<TestClassifier> {
    let budget = tower_retry_pushback::RetryBudgetConfig {
        ratio: 0.0,
        min_retries_per_sec: 1,
        ..tower_retry_pushback::RetryBudgetConfig::default()
    };
    layer(RetryConfig {
        base_backoff: Duration::from_secs(1),
        retry_budget: Some(budget),
        ..RetryConfig::default()
    })
}

/// A retry dispatched and then cut by the call's deadline stays spent in the retry
/// budget, through the cut and the drop that follows, whether the service below
/// numbered it (sent), not yet (waiting for an admission), or numbers nothing. (A
/// refund of the unsent one was tried: the history's counts cannot tell the cases
/// apart on every path, and the drop after the cut refunded sent ones.)
#[tokio::test(start_paused = true)]
async fn a_dispatched_retry_cut_by_the_deadline_stays_spent() {
    // (the service numbers its attempts, the retry was sent, retries left counted)
    for (numbers, retry_sent, spent) in [(true, false, 1), (true, true, 1), (false, false, 1)] {
        let n = Arc::new(AtomicUsize::new(0));
        let layer = layer(RetryConfig {
            base_backoff: Duration::from_secs(1),
            max_call_duration: Some(Duration::from_secs(5)),
            retry_budget: Some(tower_retry_pushback::RetryBudgetConfig {
                ratio: 0.0,
                min_retries_per_sec: 1,
                ..tower_retry_pushback::RetryBudgetConfig::default()
            }),
            ..RetryConfig::default()
        });
        let budget = layer.retry_budget().unwrap().clone();
        let mut svc = layer.layer(tower::service_fn(move |req: Req| {
            let first = n.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if numbers && (first || retry_sent) {
                    let _ = pgw_core::Recording::next_attempt::<Req>(req.call_history());
                }
                if first {
                    return Ok(Ans::Transient);
                }
                // The retry hangs: waiting for an admission below, or sent and silent.
                std::future::pending::<Result<Ans, BoxError>>().await
            }
        }));
        let err = call(&mut svc, Req::new(1)).await.unwrap_err();
        assert_eq!(retry_error(&err).reason(), Reason::DeadlineExceeded);
        drop(svc);
        let case = format!("numbers {numbers}, retry sent {retry_sent}");
        assert_eq!(budget.counts(Instant::now()).1, spent, "{case}");
    }
}

/// Twenty calls' one failed attempt each, then a call failing once and answering.
fn twenty_failures_then_a_retry() -> Upstream {
    let mut answers: Vec<Result<Ans, BoxError>> = (0..21).map(|_| Ok(Ans::Transient)).collect();
    answers.push(Ok(Ans::Ok));
    Upstream::with(answers)
}

/// A retry the call cannot wait for (its backoff is past the call's deadline) ends
/// the call before the retry budget is drawn on: twenty such calls leave the budget's
/// reserve whole for a call that can retry. Before, each drew one and the next call
/// was refused its retry (`RetryBudgetExhausted`).
#[tokio::test(start_paused = true)]
async fn a_retry_the_call_cannot_wait_for_spends_no_budget() {
    /// Requests with an id below 100 must end within 100 ms of their start.
    #[derive(Clone, Copy)]
    struct Deadlines;
    impl tower_retry_pushback::Resend<Req> for Deadlines {
        fn resend(&self, req: &Req) -> Option<Req> {
            Some(req.clone())
        }
        fn deadline(&self, req: &Req) -> Option<Instant> {
            (req.id < 100).then(|| Instant::now() + Duration::from_millis(100))
        }
    }
    let mut svc = budget_of_ten()
        .resend(Deadlines)
        .layer(twenty_failures_then_a_retry());
    for i in 0..20 {
        let err = call(&mut svc, Req::new(i)).await.unwrap_err();
        assert!(
            matches!(retry_error(&err).reason(), Reason::WaitTooLong { .. }),
            "{err}"
        );
    }
    assert_eq!(call(&mut svc, Req::new(100)).await.unwrap(), Ans::Ok);
}

/// A retry drawn from the budget and never sent goes back to it: twenty callers that
/// give up during the backoff after a failed attempt (their futures dropped) leave
/// the budget's reserve whole for a call that can retry. Before, each kept its
/// withdrawal and the next call was refused its retry (`RetryBudgetExhausted`).
#[tokio::test(start_paused = true)]
async fn a_retry_never_sent_goes_back_to_the_budget() {
    let upstream = twenty_failures_then_a_retry();
    let mut svc = budget_of_ten().layer(upstream.clone());
    for i in 0..20 {
        let fut = svc.ready().await.unwrap().call(Req::new(i));
        // The caller gives up 100 ms in: the first attempt failed, the retry waits
        // out its backoff (at least 500 ms).
        let given_up = tokio::time::timeout(Duration::from_millis(100), fut).await;
        assert!(given_up.is_err(), "call {i} ended before its caller gave up");
    }
    assert_eq!(upstream.sent_times().len(), 20, "one attempt per abandoned call");
    assert_eq!(call(&mut svc, Req::new(100)).await.unwrap(), Ans::Ok);
}

/// A retry a gate below refused (no source admitted it) was no attempt: its budget
/// withdrawal waits for the next dispatch, and goes back if the call ends first.
/// Ten concurrent callers (the whole reserve) whose retry is refused and who give up
/// during the wait that follows leave the reserve whole. Before, the refused dispatches
/// spent it and the next call was refused its retry.
#[tokio::test(start_paused = true)]
async fn a_retry_refused_below_spends_no_budget() {
    // Ten first attempts fail; their ten retries are refused below (a quota,
    // 10 s); then a call failing once and answering.
    let mut answers: Vec<Result<Ans, BoxError>> = (0..10).map(|_| Ok(Ans::Transient)).collect();
    for _ in 0..10 {
        answers.push(Err(Box::new(QuotaExceeded::new("rpm", Duration::from_secs(10)))));
    }
    answers.push(Ok(Ans::Transient));
    answers.push(Ok(Ans::Ok));
    let upstream = Upstream::with(answers);
    let svc = budget_of_ten().layer(upstream.clone());
    // The retries go out within 1 s (backoff 0.5-1 s) and are refused; the callers
    // give up during the wait that follows.
    let calls = (0..10).map(|i| {
        let svc = svc.clone();
        async move {
            let fut = svc.oneshot(Req::new(i));
            tokio::time::timeout(Duration::from_millis(1500), fut).await
        }
    });
    for (i, given_up) in futures_util::future::join_all(calls)
        .await
        .into_iter()
        .enumerate()
    {
        assert!(given_up.is_err(), "call {i} ended before its caller gave up");
    }
    assert_eq!(
        upstream.sent_times().len(),
        20,
        "two dispatches per abandoned call"
    );
    let mut svc = svc;
    assert_eq!(call(&mut svc, Req::new(100)).await.unwrap(), Ans::Ok);
}

#[tokio::test(start_paused = true)]
async fn retry_budget_caps_retries_under_total_failure() {
    use tower_retry_pushback::RetryBudgetConfig;
    let upstream = Upstream::always(Ans::Dead).named("s1");
    let mut svc = layer(RetryConfig {
        max_attempts: 10,
        retry_budget: Some(RetryBudgetConfig::default()),
        ..RetryConfig::default()
    })
    .layer(upstream.clone());
    let start = Instant::now();
    let mut calls_per_window = [0u64; 3];
    let mut budget_refusals = 0;
    for i in 0..3000u64 {
        let window = usize::try_from((Instant::now() - start).as_secs() / 10).unwrap();
        calls_per_window[window] += 1;
        let err = call(&mut svc, Req::new(1)).await.unwrap_err();
        match retry_error(&err).reason() {
            Reason::RetryBudgetExhausted => budget_refusals += 1,
            Reason::BudgetExhausted => {}
            other => panic!("call {i}: {other}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut sent_per_window = [0u64; 3];
    for t in upstream.sent_times() {
        let window = usize::try_from((t - start).as_secs() / 10).unwrap();
        sent_per_window[window] += 1;
    }
    let mut total_retries = 0;
    for w in 0..3 {
        let retries = sent_per_window[w] - calls_per_window[w];
        total_retries += retries;
        // ratio 10% of requests + 10 retries/s over 10 s.
        let bound = calls_per_window[w] / 10 + 100;
        assert!(retries <= bound, "window {w}: {retries} retries > {bound}");
    }
    // Without the budget every call would retry 9 times (27,000 retries).
    assert!(
        total_retries >= 400,
        "the budget should allow retries: {total_retries}"
    );
    assert!(budget_refusals > 2000, "{budget_refusals}");
}

#[tokio::test(start_paused = true)]
async fn adaptive_throttling_drops_attempts_locally() {
    use tower_retry_pushback::ThrottleConfig;
    let upstream = Upstream::always(Ans::Transient);
    let layer = layer(RetryConfig {
        max_attempts: 1,
        throttle: Some(ThrottleConfig::default()),
        ..RetryConfig::default()
    });
    let mut svc = layer.layer(upstream.clone());
    let mut throttled = 0;
    for _ in 0..1000 {
        let err = call(&mut svc, Req::new(1)).await.unwrap_err();
        if retry_error(&err).reason() == Reason::Throttled {
            throttled += 1;
        }
    }
    let now = Instant::now();
    let throttle = layer.throttle().unwrap();
    assert_eq!(throttle.counts(now), (1000, 0));
    // With no accepts the probability tends to 1: most attempts are dropped locally.
    assert_eq!(upstream.sent_count(), 1000 - throttled);
    assert!(throttled > 900, "{throttled}");
    assert!(throttle.drop_probability(now) > 0.99);
}

/// A call the throttle refuses leaves nothing reserved below: the verdict is drawn
/// before the inner service is asked to be ready, so a concurrency permit its
/// readiness would have taken stays free for everyone else (before, it was held by
/// the refused call's service until its next call).
#[tokio::test(start_paused = true)]
async fn a_throttled_call_holds_no_permit_of_the_service_below() {
    use futures_util::FutureExt;
    use tower::limit::ConcurrencyLimit;
    use tower_retry_pushback::ThrottleConfig;
    let upstream = Upstream::always(Ans::Transient);
    let layer = layer(RetryConfig {
        max_attempts: 1,
        throttle: Some(ThrottleConfig::default()),
        ..RetryConfig::default()
    });
    let limited = ConcurrencyLimit::new(upstream.clone(), 1);
    // Another handle on the same single permit.
    let mut other = limited.clone();
    let mut svc = layer.layer(limited);
    let mut throttled = false;
    for _ in 0..1000 {
        let err = call(&mut svc, Req::new(1)).await.unwrap_err();
        if retry_error(&err).reason() == Reason::Throttled {
            throttled = true;
            break;
        }
    }
    assert!(throttled, "with every attempt failing the throttle refuses one");
    assert!(
        other.ready().now_or_never().is_some(),
        "the permit is free after the throttled call"
    );
}

// ---------------------------------------------------------------- R7 and deadlines

#[tokio::test(start_paused = true)]
async fn dropping_mid_backoff_stops_everything() {
    let upstream = Upstream::always(Ans::RateLimited(Some(Duration::from_secs(10))));
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    let mut fut = Box::pin(svc.ready().await.unwrap().call(Req::new(1)));
    assert!(
        tokio::time::timeout(Duration::from_secs(1), &mut fut)
            .await
            .is_err()
    );
    assert_eq!(
        svc.stats(),
        RetryStats {
            retrying: 1,
            waiting: 1
        }
    );
    assert_eq!(upstream.sent_count(), 1);
    drop(fut);
    assert_eq!(svc.stats(), RetryStats::default());
    tokio::time::sleep(Duration::from_secs(100)).await;
    assert_eq!(upstream.sent_count(), 1, "nothing sent after the drop");
    assert_eq!(upstream.inflight.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn dropping_mid_attempt_stops_everything() {
    let upstream = Upstream::always(Ans::Transient).delayed(Duration::from_secs(10));
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    let mut fut = Box::pin(svc.ready().await.unwrap().call(Req::new(1)));
    assert!(
        tokio::time::timeout(Duration::from_secs(15), &mut fut)
            .await
            .is_err()
    );
    // The second attempt is in flight.
    assert_eq!(upstream.sent_count(), 2);
    assert_eq!(upstream.inflight.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(
        svc.stats(),
        RetryStats {
            retrying: 1,
            waiting: 0
        }
    );
    drop(fut);
    assert_eq!(upstream.inflight.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert_eq!(svc.stats(), RetryStats::default());
    tokio::time::sleep(Duration::from_secs(100)).await;
    assert_eq!(upstream.sent_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn dropping_mid_hold_stops_everything() {
    let s1 = Upstream::always(Ans::RateLimited(Some(Duration::from_secs(3))));
    let router = Router::new(vec![("s1", s1.clone())], TestHold::default());
    let mut svc = layer(RetryConfig::default())
        .hold(Arc::new(StuckHold))
        .layer(router.clone());
    let mut fut = Box::pin(svc.ready().await.unwrap().call(Req::new(1)));
    assert!(
        tokio::time::timeout(Duration::from_secs(1), &mut fut)
            .await
            .is_err()
    );
    assert_eq!(
        svc.stats(),
        RetryStats {
            retrying: 1,
            waiting: 1
        }
    );
    drop(fut);
    assert_eq!(svc.stats(), RetryStats::default());
    tokio::time::sleep(Duration::from_secs(100)).await;
    assert_eq!(s1.sent_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_deadline_cuts_the_attempt_in_flight() {
    let upstream = Upstream::always(Ans::Ok).delayed(Duration::from_secs(60));
    let mut svc = layer(RetryConfig {
        max_call_duration: Some(Duration::from_secs(5)),
        ..RetryConfig::default()
    })
    .layer(upstream.clone());
    let start = Instant::now();
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    assert_eq!(Instant::now() - start, Duration::from_secs(5));
    assert_eq!(retry_error(&err).reason(), Reason::DeadlineExceeded);
    assert_eq!(upstream.inflight.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert_eq!(svc.stats(), RetryStats::default());
}

/// An attempt sent (numbered by the service below) and cut by the deadline is in the
/// verdict's attempts, timed out: a server refunds a caller only for calls that asked
/// no provider. One still waiting for an admission below (never numbered) is not.
#[tokio::test(start_paused = true)]
async fn an_attempt_cut_by_the_deadline_is_in_the_verdict_when_it_was_sent() {
    for sent in [true, false] {
        let mut svc = layer(RetryConfig {
            max_call_duration: Some(Duration::from_secs(5)),
            ..RetryConfig::default()
        })
        .layer(tower::service_fn(move |req: Req| async move {
            let history = req.call_history();
            if sent {
                let _ = pgw_core::Recording::next_attempt::<Req>(history);
            } else if let Some(h) = history {
                // A probe sent with a copy of the request (a silent source's), while
                // the call itself waits for an admission: numbered, not the call's.
                let _ = h.next_probe();
            }
            std::future::pending::<Result<Ans, BoxError>>().await
        }));
        let err = call(&mut svc, Req::new(1)).await.unwrap_err();
        let verdict = retry_error(&err);
        assert_eq!(verdict.reason(), Reason::DeadlineExceeded);
        if sent {
            assert_eq!(verdict.attempts().len(), 1, "the attempt cut in flight");
            assert!(verdict.attempts()[0].timed_out);
        } else {
            assert!(verdict.attempts().is_empty(), "nothing was sent");
        }
    }
}

/// The call's deadline is set on its history, on every attempt, so a balancer below
/// (which waits for an admission) knows how long the call may wait: the config's
/// `max_call_duration` on a history the layer creates, the sooner of it and the
/// request's own on a history the caller passed, nothing without a deadline.
#[tokio::test(start_paused = true)]
async fn the_deadline_reaches_the_service_below_in_the_history() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let upstream = {
        let seen = seen.clone();
        Upstream::from_fn(move |req: &Req| {
            let deadline = req.history.as_ref().and_then(CallHistory::deadline);
            let mut seen = seen.lock().unwrap();
            seen.push(deadline);
            if seen.len() % 2 == 1 {
                Ok(Ans::Transient)
            } else {
                Ok(Ans::Ok)
            }
        })
    };
    let t0 = Instant::now();
    let due = t0 + Duration::from_secs(5);
    let mut svc = layer(RetryConfig {
        max_call_duration: Some(Duration::from_secs(5)),
        ..RetryConfig::default()
    })
    .layer(upstream.clone());
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    assert_eq!(*seen.lock().unwrap(), vec![Some(due); 2], "both attempts");

    seen.lock().unwrap().clear();
    let history = CallHistory::new();
    history.set_deadline(t0 + Duration::from_secs(2));
    let req = Req {
        id: 2,
        history: Some(history.clone()),
    };
    assert_eq!(call(&mut svc, req).await.unwrap(), Ans::Ok);
    assert_eq!(
        *seen.lock().unwrap(),
        vec![Some(t0 + Duration::from_secs(2)); 2],
        "the caller's sooner deadline stays"
    );

    // A history made at the first retry carries it from then on.
    seen.lock().unwrap().clear();
    let mut svc = layer(RetryConfig {
        max_call_duration: Some(Duration::from_secs(5)),
        ..RetryConfig::default()
    })
    .history_mode(HistoryMode::FromFirstRetry)
    .layer(upstream.clone());
    let due = Instant::now() + Duration::from_secs(5);
    assert_eq!(call(&mut svc, Req::new(3)).await.unwrap(), Ans::Ok);
    assert_eq!(*seen.lock().unwrap(), vec![None, Some(due)]);

    seen.lock().unwrap().clear();
    let mut svc = layer(RetryConfig::default()).layer(upstream);
    assert_eq!(call(&mut svc, Req::new(4)).await.unwrap(), Ans::Ok);
    assert_eq!(*seen.lock().unwrap(), vec![None; 2], "no deadline, none set");
}

#[tokio::test(start_paused = true)]
async fn a_request_deadline_is_read_from_http_extensions() {
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let inner = {
        let sent = sent.clone();
        tower::service_fn(move |req: http::Request<&'static str>| {
            sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            assert!(req.extensions().get::<CallHistory>().is_some());
            async { Ok::<_, BoxError>(http::Response::builder().status(429).body(()).unwrap()) }
        })
    };
    let mut svc = RetryLayer::default()
        .classifier(pgw_core::HttpClassifier)
        .resend(HttpResend)
        .rng_seed(3)
        .layer(inner);
    let mut req = http::Request::new("hi");
    req.extensions_mut()
        .insert(CallDeadline(Instant::now() + Duration::from_secs(30)));
    let start = Instant::now();
    let err = svc.ready().await.unwrap().call(req).await.unwrap_err();
    let err = retry_error(&err);
    // 429s without Retry-After back off until the next wait would pass the deadline.
    match err.reason() {
        Reason::WaitTooLong { limit, .. } => assert!(limit <= Duration::from_secs(30)),
        Reason::DeadlineExceeded => {}
        other => panic!("{other}"),
    }
    assert!(Instant::now() - start <= Duration::from_secs(30));
    assert!(sent.load(std::sync::atomic::Ordering::SeqCst) >= 3);
    assert!(err.attempts().iter().all(|a| a.outcome.is_rate_limited()));
}

/// Alone, a request too large for the one upstream is final: sending it again would
/// meet the same limit.
#[tokio::test(start_paused = true)]
async fn alone_a_request_too_large_is_final() {
    let upstream = Upstream::with(vec![Err(too_long()), Ok(Ans::Ok)]);
    let mut svc = rejecting_errors(&upstream);
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    assert_eq!(retry_error(&err).reason(), Reason::Rejected);
    assert_eq!(upstream.sent_count(), 1);
}

/// A request that cannot be re-sent ends at its failure: nothing is slept (not even a
/// 30 s `Retry-After`) or spent from the budget for an attempt that cannot happen.
#[tokio::test(start_paused = true)]
async fn a_request_that_cannot_be_resent_ends_without_waiting() {
    let upstream = Upstream::always(Ans::RateLimited(Some(Duration::from_secs(30))));
    let mut svc = layer(RetryConfig::default())
        .resend(|_: &Req| None)
        .layer(upstream.clone());
    let start = Instant::now();
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    assert_eq!(retry_error(&err).reason(), Reason::NotResendable);
    assert_eq!(Instant::now(), start, "no wait");
    assert_eq!(upstream.sent_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_request_that_cannot_be_resent_ends_after_one_attempt() {
    let upstream = Upstream::always(Ans::Transient);
    let mut svc = layer(RetryConfig::default())
        .resend(|_: &Req| None)
        .layer(upstream.clone());
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    assert_eq!(retry_error(&err).reason(), Reason::NotResendable);
    assert_eq!(upstream.sent_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn bad_config_is_a_clear_error() {
    let err = Retry::new(
        Upstream::always(Ans::Ok),
        RetryConfig {
            max_attempts: 0,
            ..RetryConfig::default()
        },
    )
    .unwrap_err();
    assert_eq!(err.field(), "max_attempts");
}

/// The tower-test mock: readiness is asked before each retry, and the request the
/// retry sends is the same one.
#[tokio::test(start_paused = true)]
async fn readiness_is_asked_again_before_a_retry() {
    let (mock, mut handle) = tower_test::mock::pair::<Req, Ans>();
    let svc = layer(RetryConfig::default()).layer(mock);
    handle.allow(1);
    let fut = tokio::spawn({
        let mut svc = svc.clone();
        async move { svc.ready().await.unwrap().call(Req::new(9)).await }
    });
    let (req, send) = handle.next_request().await.unwrap();
    assert_eq!(req.id, 9);
    send.send_error(pgw_core::UpstreamStatus::new(
        http::StatusCode::SERVICE_UNAVAILABLE,
        None,
        "busy",
    ));
    // Not ready: the retry waits for readiness, even after the backoff.
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(!fut.is_finished());
    handle.allow(1);
    let (req, send) = handle.next_request().await.unwrap();
    assert_eq!(req.id, 9);
    assert!(req.history.as_ref().is_some_and(|h| h.len() == 1));
    send.send_response(Ans::Ok);
    assert_eq!(fut.await.unwrap().unwrap(), Ans::Ok);
    assert_eq!(svc.stats(), RetryStats::default());
}

#[tokio::test(start_paused = true)]
async fn history_from_the_first_retry_records_the_first_attempt_without_source() {
    let holds = TestHold::default();
    let s1 = Upstream::with(vec![rl(5), Ok(Ans::Transient)]);
    let router = Router::new(vec![("s1", s1.clone())], holds.clone());
    let mut svc = layer(RetryConfig {
        max_attempts: 1,
        ..RetryConfig::default()
    })
    .hold(Arc::new(holds.clone()))
    .history_mode(HistoryMode::FromFirstRetry)
    .layer(router.clone());
    let start = Instant::now();
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    let err = retry_error(&err);
    assert_eq!(err.reason(), Reason::BudgetExhausted);
    let sources: Vec<_> = err.attempts().iter().map(|a| a.source.clone()).collect();
    assert_eq!(sources, vec![None, Some(SourceId::from("s1"))]);
    // The first attempt's source was unknown: the layer slept instead of holding.
    assert!(holds.calls.lock().unwrap().is_empty());
    assert!(Instant::now() - start >= Duration::from_secs(5));
}

#[tokio::test(start_paused = true)]
async fn the_history_reaches_the_service_below_on_every_attempt() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let upstream = {
        let seen = seen.clone();
        Upstream::from_fn(move |req| {
            let h = req.history.as_ref().expect("every attempt carries the history");
            seen.lock().unwrap().push(h.len());
            Ok(if h.len() < 2 { Ans::Transient } else { Ans::Ok })
        })
    };
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    // The layer recorded the attempts the upstream did not, in the same history.
    assert_eq!(*seen.lock().unwrap(), vec![0, 1, 2]);
}

/// The history each request of an upstream carried, with its length when sent.
type Seen = Arc<std::sync::Mutex<Vec<(Option<usize>, Option<CallHistory>)>>>;

/// An upstream answering `answers` in order, then `Ok`, that keeps what each request
/// carried.
fn watched(answers: Vec<Result<Ans, BoxError>>) -> (Upstream, Seen) {
    let seen: Seen = Arc::default();
    let mut queue: std::collections::VecDeque<_> = answers.into();
    let upstream = {
        let seen = seen.clone();
        Upstream::from_fn(move |req: &Req| {
            let len = req.history.as_ref().map(CallHistory::len);
            seen.lock().unwrap().push((len, req.history.clone()));
            queue.pop_front().unwrap_or(Ok(Ans::Ok))
        })
    };
    (upstream, seen)
}

fn lens(seen: &Seen) -> Vec<Option<usize>> {
    seen.lock().unwrap().iter().map(|(len, _)| *len).collect()
}

/// `OnDemand`: the first attempt goes without a history; a balancer below that records
/// through the recording keeps the source of a failed first attempt (held, like
/// `EveryAttempt`), and the next attempts carry the history.
#[tokio::test(start_paused = true)]
async fn on_demand_makes_the_history_at_the_first_failure_with_its_source() {
    let holds = TestHold::default();
    let (s1, seen1) = watched(vec![rl(30)]);
    let (s2, seen2) = watched(vec![]);
    let router = Router::new(vec![("s1", s1), ("s2", s2)], holds.clone());
    let mut svc = layer(RetryConfig::default())
        .hold(Arc::new(holds.clone()))
        .history_mode(HistoryMode::OnDemand)
        .layer(router.clone());
    let start = Instant::now();
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    assert_eq!(router.times_of("s2"), vec![start], "moved on at once");
    assert_eq!(
        *holds.calls.lock().unwrap(),
        vec![(SourceId::from("s1"), Duration::from_secs(30))],
        "the first attempt's source is known: held"
    );
    assert_eq!(lens(&seen1), vec![None], "the first attempt carries none");
    assert_eq!(lens(&seen2), vec![Some(1)], "the second carries the history");
    let sources: Vec<_> = seen2.lock().unwrap()[0]
        .1
        .as_ref()
        .unwrap()
        .attempts()
        .into_iter()
        .map(|a| a.source)
        .collect();
    assert_eq!(
        sources,
        vec![Some(SourceId::from("s1")), Some(SourceId::from("s2"))]
    );

    // Every attempt failing: the error lists each attempt with its source.
    let (s3, _) = watched(vec![Ok(Ans::Transient), Ok(Ans::Transient), Ok(Ans::Transient)]);
    let mut svc = layer(RetryConfig::default())
        .history_mode(HistoryMode::OnDemand)
        .layer(Router::new(vec![("s3", s3)], TestHold::default()));
    let err = call(&mut svc, Req::new(2)).await.unwrap_err();
    let sources: Vec<_> = retry_error(&err)
        .attempts()
        .iter()
        .map(|a| a.source.clone())
        .collect();
    assert_eq!(sources, vec![Some(SourceId::from("s3")); 3]);
}

/// `OnDemand` over a service that records nothing: the layer records the attempts
/// itself, as with the other modes; a call that succeeds at once never has a history,
/// and one with a deadline has it from the first attempt (the service below reads the
/// deadline there).
#[tokio::test(start_paused = true)]
async fn on_demand_over_a_service_that_records_nothing() {
    let (upstream, seen) = watched(vec![Ok(Ans::Transient), Ok(Ans::Transient)]);
    let mut svc = layer(RetryConfig::default())
        .history_mode(HistoryMode::OnDemand)
        .layer(upstream);
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    assert_eq!(lens(&seen), vec![None, Some(1), Some(2)]);

    let (ok, seen) = watched(vec![]);
    let mut svc = layer(RetryConfig::default())
        .history_mode(HistoryMode::OnDemand)
        .layer(ok);
    assert_eq!(call(&mut svc, Req::new(2)).await.unwrap(), Ans::Ok);
    assert_eq!(lens(&seen), vec![None]);

    let (upstream, seen) = watched(vec![Ok(Ans::Transient)]);
    let mut svc = layer(RetryConfig {
        max_call_duration: Some(Duration::from_secs(5)),
        ..RetryConfig::default()
    })
    .history_mode(HistoryMode::OnDemand)
    .layer(upstream);
    let due = Instant::now() + Duration::from_secs(5);
    assert_eq!(call(&mut svc, Req::new(3)).await.unwrap(), Ans::Ok);
    let deadlines: Vec<_> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|(_, h)| h.as_ref().and_then(CallHistory::deadline))
        .collect();
    assert_eq!(deadlines, vec![Some(due); 2]);
}

#[tokio::test(start_paused = true)]
async fn a_failed_hold_falls_back_to_sleeping_through_the_pushback() {
    let s1 = Upstream::with(vec![rl(9)]);
    let router = Router::new(vec![("s1", s1.clone())], TestHold::default());
    let mut svc = layer(RetryConfig::default())
        .hold(Arc::new(FailingHold))
        .layer(router.clone());
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    let t = router.times_of("s1");
    assert_eq!(t.len(), 2);
    assert!(t[1] - t[0] >= Duration::from_secs(9), "{:?}", t[1] - t[0]);
}

/// A hook that enforces nothing (`NoHold`) is no hook: the layer sleeps through the
/// 429's `Retry-After` itself. Taken for a hold, it sent the next attempt at once to
/// the source nothing held, back to back for as long as the call could wait.
#[tokio::test(start_paused = true)]
async fn a_hold_that_enforces_nothing_is_slept_through() {
    let s1 = Upstream::with(vec![rl(9), Ok(Ans::Ok)]);
    let router = Router::new(vec![("s1", s1.clone())], TestHold::default());
    let mut svc = layer(RetryConfig::default())
        .hold(Arc::new(pgw_core::NoHold))
        .layer(router.clone());
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    let t = router.times_of("s1");
    assert_eq!(t.len(), 2);
    assert!(t[1] - t[0] >= Duration::from_secs(9), "{:?}", t[1] - t[0]);
}

/// A failed hold is slept through by the same bound as a sleep without a hook: a 429
/// asking for 100 s, past `max_pushback_wait` (60 s by default), ends the call with
/// `PushbackExhausted` after the one attempt, as it does without a hook (it slept the
/// 100 s and sent a second attempt).
#[tokio::test(start_paused = true)]
async fn a_failed_hold_does_not_sleep_past_the_pushback_bound() {
    for hook in [true, false] {
        let s1 = Upstream::with(vec![rl(100)]);
        let router = Router::new(vec![("s1", s1.clone())], TestHold::default());
        let layer = layer(RetryConfig::default());
        let layer = if hook {
            layer.hold(Arc::new(FailingHold))
        } else {
            layer
        };
        let mut svc = layer.layer(router.clone());
        let start = tokio::time::Instant::now();
        let err = call(&mut svc, Req::new(1)).await.unwrap_err();
        assert!(
            matches!(retry_error(&err).reason(), Reason::PushbackExhausted { .. }),
            "hook {hook}: {err}"
        );
        assert_eq!(router.times_of("s1").len(), 1, "hook {hook}");
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "hook {hook}: {:?}",
            start.elapsed()
        );
    }
}

/// With a working hold, a 429 whose wait passes the pushback bound ends the call at
/// once too: the call goes on, finds its only source held (`QuotaExceeded` from below)
/// and that wait is the pushback's, bounded like it. Before, it was slept as a quota
/// wait: 100 s past a 60 s bound, then a second attempt.
#[tokio::test(start_paused = true)]
async fn a_held_source_does_not_take_the_call_past_the_pushback_bound() {
    let holds = TestHold::default();
    let s1 = Upstream::with(vec![rl(100), Ok(Ans::Ok)]);
    let router = Router::new(vec![("s1", s1.clone())], holds.clone());
    let mut svc = layer(RetryConfig::default())
        .hold(Arc::new(holds.clone()))
        .layer(router.clone());
    let start = tokio::time::Instant::now();
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    assert!(
        matches!(retry_error(&err).reason(), Reason::PushbackExhausted { .. }),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
    assert_eq!(router.times_of("s1").len(), 1, "one attempt");
    // Within the bound, the held wait is slept as before.
    let s2 = Upstream::with(vec![rl(30), Ok(Ans::Ok)]);
    let router = Router::new(vec![("s2", s2.clone())], holds.clone());
    let mut svc = layer(RetryConfig::default())
        .hold(Arc::new(holds.clone()))
        .layer(router.clone());
    assert_eq!(call(&mut svc, Req::new(2)).await.unwrap(), Ans::Ok);
    assert_eq!(router.times_of("s2").len(), 2);
}

/// A service whose readiness fails before a retry ends the call with a `RetryError`
/// like every other failure (reason `ServiceFailed`, the attempts so far, the
/// service's error as its source); it ended with the raw error, the attempts lost.
#[tokio::test(start_paused = true)]
async fn a_readiness_error_before_a_retry_is_a_retry_error() {
    #[derive(Clone)]
    struct BreaksAfterOne(Upstream, Arc<std::sync::atomic::AtomicU32>);
    impl Service<Req> for BreaksAfterOne {
        type Response = Ans;
        type Error = BoxError;
        type Future = <Upstream as Service<Req>>::Future;
        fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), BoxError>> {
            if self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= 1 {
                return std::task::Poll::Ready(Err("the pool is gone".into()));
            }
            self.0.poll_ready(cx)
        }
        fn call(&mut self, req: Req) -> Self::Future {
            self.0.call(req)
        }
    }
    let upstream = Upstream::always(Ans::Transient);
    let mut svc = layer(RetryConfig::default()).layer(BreaksAfterOne(upstream.clone(), Arc::default()));
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    let retry = retry_error(&err);
    assert_eq!(retry.reason(), Reason::ServiceFailed);
    assert_eq!(retry.attempts().len(), 1);
    assert!(
        std::error::Error::source(retry).is_some_and(|s| s.to_string().contains("the pool is gone")),
        "{retry:?}"
    );
}

// ---------------------------------------------------------------- backoff floor, deadline

/// The backoff floor (half the base, 250 ms by default): whatever the jitter draws, two
/// attempts of one call to one source are never back to back, after a transient
/// failure (a backoff slept) and after a 429 without `Retry-After` (the source held for
/// the backoff).
#[tokio::test(start_paused = true)]
async fn no_two_attempts_to_one_source_go_back_to_back() {
    let floor = Duration::from_millis(250);
    for seed in 0..40 {
        let upstream = Upstream::always(Ans::Transient);
        let mut svc = layer(RetryConfig {
            max_attempts: 6,
            ..RetryConfig::default()
        })
        .rng_seed(seed)
        .layer(upstream.clone());
        let err = call(&mut svc, Req::new(1)).await.unwrap_err();
        assert_eq!(retry_error(&err).reason(), Reason::BudgetExhausted);
        let t = upstream.sent_times();
        assert_eq!(t.len(), 6);
        assert!(
            t.windows(2).all(|w| w[1] - w[0] >= floor),
            "seed {seed}: transient gaps {:?}",
            t.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>()
        );

        let holds = TestHold::default();
        let s1 = Upstream::with((0..5).map(|_| Ok(Ans::RateLimited(None))).collect());
        let router = Router::new(vec![("s1", s1)], holds.clone());
        let mut svc = layer(RetryConfig::default())
            .rng_seed(seed)
            .hold(Arc::new(holds.clone()))
            .layer(router.clone());
        assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
        let t = router.times_of("s1");
        assert_eq!(t.len(), 6);
        assert!(
            t.windows(2).all(|w| w[1] - w[0] >= floor),
            "seed {seed}: 429 gaps {:?}",
            t.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>()
        );
        assert!(
            holds.calls.lock().unwrap().iter().all(|(_, d)| *d >= floor),
            "seed {seed}: every hold at least the floor"
        );
    }
}

/// A timed-out attempt is followed by the next one at once: the source already had the
/// whole timeout, and the balancer sends the next attempt elsewhere (R1). Any other
/// transient failure of the same length is followed by a backoff of at least the floor.
#[tokio::test(start_paused = true)]
async fn a_timed_out_attempt_is_retried_without_a_backoff() {
    let took = Duration::from_secs(10);
    let timed_out = || -> Result<Ans, BoxError> { Err(Box::new(pgw_core::TimedOut)) };
    let upstream = Upstream::with(vec![timed_out(), timed_out()])
        .delayed(took)
        .named("s1");
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    let gaps: Vec<_> = upstream.sent_times().windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(gaps, vec![took, took], "each retry starts when the timeout ends");

    let reset = || -> Result<Ans, BoxError> {
        Err(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )))
    };
    let upstream = Upstream::with(vec![reset(), reset()]).delayed(took);
    let mut svc = layer(RetryConfig::default()).layer(upstream.clone());
    assert_eq!(call(&mut svc, Req::new(1)).await.unwrap(), Ans::Ok);
    let gaps: Vec<_> = upstream.sent_times().windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(gaps.len(), 2);
    assert!(
        gaps.iter().all(|g| *g >= took + Duration::from_millis(250)),
        "other transient failures back off: {gaps:?}"
    );
}

/// Every wait of the loop honours the call's deadline: a backoff after a transient
/// failure, a `Retry-After` slept, a hold the service below then answers as over quota,
/// a gate's `Paced`, `QuotaExceeded` and `Unavailable`. Each asks for more than the
/// 0.5 s left (the backoff floor is 2 s here, a backend down is asked again in 1 s), so the call fails at once with the wait
/// it would have needed, instead of sleeping toward or past the deadline.
#[tokio::test(start_paused = true)]
async fn every_wait_of_the_loop_fails_at_once_when_longer_than_the_deadline_allows() {
    let config = RetryConfig {
        base_backoff: Duration::from_secs(4),
        max_backoff: Duration::from_secs(8),
        max_call_duration: Some(Duration::from_millis(500)),
        ..RetryConfig::default()
    };
    let refusal = |e: BoxError| Upstream::with(vec![Err(e)]);
    let cases: Vec<(&str, Upstream)> = vec![
        ("transient backoff", Upstream::always(Ans::Transient)),
        ("retry-after", Upstream::with(vec![rl(5)])),
        ("paced", refusal(Box::new(Paced::new()))),
        (
            "quota",
            refusal(Box::new(QuotaExceeded::new("rpm", Duration::from_secs(5)))),
        ),
        (
            "unavailable",
            refusal(Box::new(pgw_core::BackendUnavailable::new(
                "redis", "admit", "down",
            ))),
        ),
    ];
    for (name, upstream) in cases {
        let mut svc = layer(config.clone()).layer(upstream.clone());
        let start = Instant::now();
        let err = call(&mut svc, Req::new(1)).await.unwrap_err();
        assert_eq!(Instant::now(), start, "{name}: at once");
        assert!(
            matches!(retry_error(&err).reason(), Reason::WaitTooLong { wait, limit }
                if limit == Duration::from_millis(500) && wait > limit),
            "{name}: {err}"
        );
        assert_eq!(upstream.sent_count(), 1, "{name}");
    }

    // A hold: the source is held 5 s, the service below answers over quota for it.
    let holds = TestHold::default();
    let router = Router::new(vec![("s1", Upstream::with(vec![rl(5)]))], holds.clone());
    let mut svc = layer(config).hold(Arc::new(holds.clone())).layer(router.clone());
    let start = Instant::now();
    let err = call(&mut svc, Req::new(1)).await.unwrap_err();
    assert_eq!(Instant::now(), start, "hold: at once");
    assert!(
        matches!(retry_error(&err).reason(), Reason::WaitTooLong { limit, .. } if limit == Duration::from_millis(500)),
        "hold: {err}"
    );
    assert_eq!(holds.calls.lock().unwrap().len(), 1, "the source was held");
    assert_eq!(router.times_of("s1").len(), 1);
}

// ---------------------------------------------------------------- the service of each attempt

/// A service that counts its clones and records, for each call, the tag of the instance
/// that took it and whether `poll_ready` had made that instance ready.
#[derive(Debug)]
struct Tracked {
    upstream: Upstream,
    tag: u32,
    ready: bool,
    clones: Arc<std::sync::atomic::AtomicUsize>,
    calls: Arc<std::sync::Mutex<Vec<(u32, bool)>>>,
}

impl Tracked {
    fn new(upstream: Upstream) -> Self {
        Self {
            upstream,
            tag: 0,
            ready: false,
            clones: Arc::default(),
            calls: Arc::default(),
        }
    }

    fn clones(&self) -> usize {
        self.clones.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Clone for Tracked {
    fn clone(&self) -> Self {
        self.clones.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self {
            upstream: self.upstream.clone(),
            tag: self.tag,
            // A clone is not ready (tower-service, "Be careful when cloning inner
            // services").
            ready: false,
            clones: Arc::clone(&self.clones),
            calls: Arc::clone(&self.calls),
        }
    }
}

impl Service<Req> for Tracked {
    type Response = Ans;
    type Error = BoxError;
    type Future = <Upstream as Service<Req>>::Future;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), BoxError>> {
        let polled = self.upstream.poll_ready(cx);
        if polled.is_ready() {
            self.ready = true;
        }
        polled
    }

    fn call(&mut self, req: Req) -> Self::Future {
        self.calls
            .lock()
            .unwrap()
            .push((self.tag, std::mem::take(&mut self.ready)));
        self.upstream.call(req)
    }
}

#[tokio::test(start_paused = true)]
async fn a_call_answered_at_once_clones_no_service() {
    let svc = Tracked::new(Upstream::always(Ans::Ok));
    let mut retry = layer(RetryConfig::default()).layer(svc);
    let after_wrapping = retry.get_ref().clones();
    for id in 0..5 {
        assert!(matches!(call(&mut retry, Req::new(id)).await, Ok(Ans::Ok)));
    }
    assert_eq!(retry.get_ref().clones(), after_wrapping, "no clone per call");
    let calls = retry.get_ref().calls.lock().unwrap().clone();
    assert_eq!(calls, vec![(0, true); 5], "each call on the instance made ready");
}

#[tokio::test(start_paused = true)]
async fn later_attempts_go_to_one_clone_made_ready_before_each() {
    let upstream = Upstream::with(vec![Ok(Ans::Transient), Ok(Ans::Transient)]);
    let svc = Tracked::new(upstream);
    let mut retry = layer(RetryConfig::default()).layer(svc);
    let after_wrapping = retry.get_ref().clones();
    assert!(matches!(call(&mut retry, Req::new(1)).await, Ok(Ans::Ok)));
    assert_eq!(
        retry.get_ref().clones(),
        after_wrapping + 1,
        "one clone for the call's retries"
    );
    let calls = retry.get_ref().calls.lock().unwrap().clone();
    assert_eq!(calls, vec![(0, true); 3], "every attempt on a ready instance");
}

#[tokio::test(start_paused = true)]
async fn a_change_through_get_mut_reaches_later_attempts() {
    let upstream = Upstream::with(vec![Ok(Ans::Transient)]);
    let mut retry = layer(RetryConfig::default()).layer(Tracked::new(upstream));
    retry.get_mut().tag = 7;
    assert!(matches!(call(&mut retry, Req::new(1)).await, Ok(Ans::Ok)));
    let calls = retry.get_ref().calls.lock().unwrap().clone();
    assert_eq!(
        calls,
        vec![(7, true), (7, true)],
        "the retry went to the changed service"
    );
}

/// A service kept as a template and cloned for each call (as a gateway does) never
/// calls itself: a change made through its `get_mut` reaches the prototype when it is
/// cloned, once, and the clones' calls clone nothing more.
#[tokio::test(start_paused = true)]
async fn a_change_to_a_template_reaches_its_clones_once() {
    let upstream = Upstream::with(vec![Ok(Ans::Transient)]);
    let mut template = layer(RetryConfig::default()).layer(Tracked::new(upstream));
    template.get_mut().tag = 7;
    let before = template.get_ref().clones();
    for id in 0..5 {
        let mut svc = template.clone();
        assert!(matches!(call(&mut svc, Req::new(id)).await, Ok(Ans::Ok)));
    }
    // Five clones of the inner service with the five `Retry` clones, one for the
    // prototype, one for the first call's retry.
    assert_eq!(template.get_ref().clones(), before + 5 + 1 + 1);
    let calls = template.get_ref().calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 6, "five calls, one retried");
    assert!(calls.iter().all(|&(tag, ready)| tag == 7 && ready), "{calls:?}");
}
