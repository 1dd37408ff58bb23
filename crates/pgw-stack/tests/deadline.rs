//! The caller's deadline bounds the whole call: attempts, waits and the fallback chain.

mod support;

use std::time::Duration;

use pgw_core::openai::ChatRequest;
use pgw_sim::{PoolConfig, SimPool};
use pgw_stack::retry::{CallDeadline, Reason};
use pgw_stack::{ChatCall, GatewayConfig, GatewayError, MemorySink, SecretKey, SourceConfig};
use tokio::time::Instant;
use tower::ServiceExt;

/// The reason of a gateway error's last retry error.
fn last_reason(err: &(dyn std::error::Error + Send + Sync + 'static)) -> Option<Reason> {
    err.downcast_ref::<GatewayError>()
        .expect("a gateway error")
        .last_retry_error()
        .map(pgw_stack::retry::RetryError::reason)
}

/// One black hole (`hole`, a 180 s attempt timeout) behind a gateway that `cfg` sets up.
async fn one_black_hole(cfg: impl FnOnce(&mut GatewayConfig)) -> (SimPool, pgw_stack::Gateway, MemorySink) {
    let hole = pgw_sim::SourceConfig {
        black_hole_rate: 1.0.into(),
        ..pgw_sim::SourceConfig::healthy("hole")
    };
    let pool = SimPool::new(PoolConfig::of(vec![hole]), 3).unwrap();
    let mut c = GatewayConfig::default();
    let mut s = SourceConfig::new("hole", "http://sim.invalid/hole/v1", SecretKey::new("sk-x"));
    s.total_timeout_s = Some(180.0);
    c.sources.push(s);
    cfg(&mut c);
    let sink = MemorySink::default();
    let gw = support::sim_gateway(&pool, c, &sink).await;
    (pool, gw, sink)
}

/// One source, `slow`, streaming every answer whole (its `max_tokens`) after `ttft_s`
/// at `tokens_per_second`, behind a gateway (cache off) that `cfg` sets up.
async fn slow_stream(
    ttft_s: f64,
    tokens_per_second: f64,
    cfg: impl FnOnce(&mut GatewayConfig, &mut SourceConfig),
) -> (SimPool, pgw_stack::Gateway) {
    let mut slow = pgw_sim::SourceConfig {
        ttft_s: pgw_sim::LogNormal::constant(ttft_s).into(),
        tokens_per_second: pgw_sim::LogNormal::constant(tokens_per_second).into(),
        ..pgw_sim::SourceConfig::healthy("slow")
    };
    slow.completion.min_fraction = 1.0;
    slow.completion.max_fraction = 1.0;
    let pool = SimPool::new(PoolConfig::of(vec![slow]), 11).unwrap();
    let mut c = GatewayConfig::default();
    c.cache.enabled = false;
    let mut s = SourceConfig::new("slow", "http://sim.invalid/slow/v1", SecretKey::new("sk-x"));
    cfg(&mut c, &mut s);
    c.sources.push(s);
    let gw = support::sim_gateway(&pool, c, &MemorySink::default()).await;
    (pool, gw)
}

#[tokio::test(start_paused = true)]
async fn a_call_deadline_cuts_a_black_hole_and_releases_everything() {
    let (pool, gw, sink) = one_black_hole(|c| c.cache.enabled = false).await;

    let t0 = Instant::now();
    let mut call = ChatCall::new(ChatRequest::user("m", "hello"));
    call.extensions_mut()
        .insert(CallDeadline(t0 + Duration::from_secs(5)));
    let err = gw.clone().oneshot(call).await.unwrap_err();
    assert_eq!(
        t0.elapsed(),
        Duration::from_secs(5),
        "cut at the deadline, not the 180 s attempt timeout"
    );
    assert!(
        matches!(last_reason(&*err), Some(Reason::DeadlineExceeded)),
        "{err}"
    );
    assert_eq!(gw.sources()[0].aimd.inflight(), 0);
    assert_eq!(
        pool.stats().sources["hole"].in_flight,
        0,
        "upstream request dropped"
    );
    // One attempt, recorded as cut by the caller's deadline.
    assert_eq!(sink.records().len(), 1);
    assert_eq!(sink.records()[0].outcome, "cancelled");
}

/// Every call has a deadline (DESIGN section 7): without one of its own or in the
/// config, a call to a source that never answers (an hour-long attempt timeout)
/// ends at the default, 600 s, the OpenAI SDKs' own request timeout.
#[tokio::test(start_paused = true)]
async fn a_call_has_a_deadline_by_default() {
    let (_pool, gw, _sink) = one_black_hole(|c| {
        c.cache.enabled = false;
        c.sources[0].total_timeout_s = Some(3600.0);
    })
    .await;
    let t0 = Instant::now();
    let err = gw.chat(ChatRequest::user("m", "hello")).await.unwrap_err();
    assert_eq!(t0.elapsed(), pgw_stack::DEFAULT_MAX_CALL_DURATION);
    assert_eq!(t0.elapsed(), Duration::from_secs(600));
    assert!(
        matches!(last_reason(&*err), Some(Reason::DeadlineExceeded)),
        "{err}"
    );
}

/// One black hole and the cache on: the first call leads, hanging for the 180 s attempt
/// timeout. An identical call that arrives meanwhile follows it only while something in
/// the process answers: a minute without a success and it goes on alone, where the
/// silent source refuses it at once (an all-dead pool fails fast, R3/H7); and a
/// follower's wait ends at its deadline.
#[tokio::test(start_paused = true)]
async fn a_follower_does_not_wait_out_a_leader_on_a_dead_pool_nor_past_its_deadline() {
    let (pool, gw, _sink) = one_black_hole(|c| c.cache.when = pgw_stack::config::CacheWhen::Always).await;

    let t0 = Instant::now();
    let leader = tokio::spawn({
        let gw = gw.clone();
        async move { gw.chat(ChatRequest::user("m", "same")).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        pool.stats().sources["hole"].in_flight,
        1,
        "the leader hangs upstream"
    );

    // A follower with a deadline: its wait ends there.
    let mut call = ChatCall::new(ChatRequest::user("m", "same"));
    call.extensions_mut()
        .insert(CallDeadline(Instant::now() + Duration::from_secs(5)));
    let err = gw.clone().oneshot(call).await.unwrap_err();
    assert_eq!(t0.elapsed(), Duration::from_secs(6), "{err}");
    assert!(
        matches!(last_reason(&*err), Some(Reason::DeadlineExceeded)),
        "{err}"
    );

    // A follower without one: a minute after the process's last success (its start),
    // it stops following and fails fast on the silent source.
    let err = gw.chat(ChatRequest::user("m", "same")).await.unwrap_err();
    assert_eq!(t0.elapsed(), Duration::from_secs(60), "{err}");
    assert!(
        matches!(last_reason(&*err), Some(Reason::AllCircuitsOpen { .. })),
        "{err}"
    );
    assert_eq!(
        pool.stats().sources["hole"].received,
        1,
        "the followers never went upstream"
    );
    // A call arriving now does not follow at all, and fails at once.
    let t1 = Instant::now();
    assert!(gw.chat(ChatRequest::user("m", "same")).await.is_err());
    assert_eq!(t1.elapsed(), Duration::ZERO);
    assert!(!leader.is_finished(), "the leader still hangs");
    leader.abort();
}

/// A simulated source answering at once (errors in 0.1 s, first token in 0.5 s).
fn quick(name: &str) -> pgw_sim::SourceConfig {
    pgw_sim::SourceConfig {
        ttft_s: pgw_sim::LogNormal::constant(0.5).into(),
        error_latency_s: pgw_sim::LogNormal::constant(0.1).into(),
        ..pgw_sim::SourceConfig::healthy(name)
    }
}

/// A gateway over `sources` (simulated, each `(sim config, group, max_concurrency,
/// rpm)`), cache off, round robin, no account limits unless `accounts` has them.
async fn gateway_over(
    sources: Vec<(pgw_sim::SourceConfig, &str, Option<i64>, Option<i64>)>,
    accounts: Vec<pgw_sim::AccountConfig>,
) -> (SimPool, pgw_stack::Gateway, MemorySink) {
    gateway_over_with(sources, accounts, |_| {}).await
}

/// [`gateway_over`], with `tweak` applied to the config last.
async fn gateway_over_with(
    sources: Vec<(pgw_sim::SourceConfig, &str, Option<i64>, Option<i64>)>,
    accounts: Vec<pgw_sim::AccountConfig>,
    tweak: impl FnOnce(&mut GatewayConfig),
) -> (SimPool, pgw_stack::Gateway, MemorySink) {
    let mut cfg = GatewayConfig::default();
    cfg.cache.enabled = false;
    cfg.balance.policy = Some("round_robin".into());
    let mut sims = Vec::new();
    for (sim, group, max_concurrency, rpm) in sources {
        let name = sim.name.clone();
        let mut s = SourceConfig::new(
            name.as_str(),
            format!("http://sim.invalid/{name}/v1"),
            SecretKey::new("sk-x"),
        )
        .group(group);
        s.total_timeout_s = Some(180.0);
        s.max_concurrency = max_concurrency;
        s.rpm = rpm;
        cfg.sources.push(s);
        sims.push(sim);
    }
    let pool = SimPool::new(
        PoolConfig {
            sources: sims,
            accounts,
            bad_prompt_rate: 0.0,
            ..PoolConfig::default()
        },
        7,
    )
    .unwrap();
    tweak(&mut cfg);
    let sink = MemorySink::default();
    let gw = support::sim_gateway(&pool, cfg, &sink).await;
    (pool, gw, sink)
}

/// One call with a deadline `after` from now: its error's last retry reason and how
/// long it took.
async fn call_with_deadline(gw: &pgw_stack::Gateway, after: Duration) -> (Option<Reason>, Duration, String) {
    let t0 = Instant::now();
    let mut call = ChatCall::new(ChatRequest::user("m", "with a deadline"));
    call.extensions_mut().insert(CallDeadline(t0 + after));
    let err = gw.clone().oneshot(call).await.unwrap_err();
    let reason = err
        .downcast_ref::<GatewayError>()
        .and_then(GatewayError::last_retry_error)
        .map(pgw_stack::retry::RetryError::reason);
    (reason, t0.elapsed(), err.to_string())
}

/// A call on a source at its concurrency limit (AIMD paced: the balancer's H7 wait for a
/// slot) ends at its deadline, not at the balancer's 30 s `max_wait`, and the call holding
/// the slot is untouched.
#[tokio::test(start_paused = true)]
async fn a_call_deadline_bounds_the_balancers_wait_for_a_paced_source() {
    let slow = pgw_sim::SourceConfig {
        ttft_s: pgw_sim::LogNormal::constant(20.0).into(),
        ..quick("busy")
    };
    let (_pool, gw, _sink) = gateway_over(vec![(slow, "g", Some(1), None)], vec![]).await;
    let holder = tokio::spawn({
        let gw = gw.clone();
        async move { gw.chat(ChatRequest::user("m", "holds the only slot")).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(gw.sources()[0].aimd.inflight(), 1, "the slot is taken");

    let (reason, took, err) = call_with_deadline(&gw, Duration::from_secs(3)).await;
    assert_eq!(reason, Some(Reason::DeadlineExceeded), "{err}");
    assert_eq!(took, Duration::from_secs(3), "{err}");
    assert_eq!(gw.sources()[0].aimd.inflight(), 1, "the holder still runs");
    assert!(holder.await.unwrap().is_ok(), "the holder is answered");
}

/// A call on a source whose minute quota is spent (the limiter's wait, answered as
/// `QuotaExceeded` for the next minute) fails at once: the wait is longer than its
/// deadline allows, so it does not sleep until the deadline either.
#[tokio::test(start_paused = true)]
async fn a_call_deadline_shorter_than_the_quota_wait_fails_at_once() {
    let (pool, gw, _sink) = gateway_over(vec![(quick("rpm1"), "g", None, Some(1))], vec![]).await;
    gw.chat(ChatRequest::user("m", "spends the minute"))
        .await
        .unwrap();
    let (reason, took, err) = call_with_deadline(&gw, Duration::from_secs(3)).await;
    assert!(
        matches!(reason, Some(Reason::WaitTooLong { limit, .. }) if limit == Duration::from_secs(3)),
        "{err}"
    );
    assert_eq!(took, Duration::ZERO, "{err}");
    assert_eq!(pool.stats().sources["rpm1"].received, 1, "never sent upstream");
}

/// A 429 whose `Retry-After` (10 s) is longer than the call may still wait (3 s): the
/// source is held, and with no other source the call fails at once (R3), saying what
/// it would have waited for, instead of sleeping until its deadline. (The balancer,
/// which waits for the hold, reads the deadline from the call's history.)
#[tokio::test(start_paused = true)]
async fn a_retry_after_longer_than_the_deadline_ends_the_call_at_once() {
    let storm = pgw_sim::AccountConfig {
        rate_limit: pgw_sim::RateLimitCurve::always().into(),
        retry_after: pgw_sim::RetryAfterConfig {
            rate: 1.0,
            min_s: 10,
            max_s: 10,
        }
        .into(),
        name: "acct".into(),
        ..pgw_sim::AccountConfig::default()
    };
    let (pool, gw, sink) = gateway_over(
        vec![(quick("s").in_account("acct"), "g", None, None)],
        vec![storm],
    )
    .await;
    let (reason, took, err) = call_with_deadline(&gw, Duration::from_secs(3)).await;
    let records = sink.records();
    assert_eq!(records.len(), 1, "one attempt, then held: {records:?}");
    assert_eq!(records[0].outcome, "rate_limited");
    let attempt = Duration::from_secs_f64(records[0].latency_ms / 1000.0);
    // Ended when the 429 came back (paused clock: exactly), not at the 3 s deadline.
    assert_eq!(took, attempt, "{err}");
    assert!(took < Duration::from_secs(1), "{took:?}: {err}");
    let Some(Reason::WaitTooLong { wait, limit }) = reason else {
        panic!("not a wait too long: {err}");
    };
    assert_eq!(wait, Duration::from_secs(10), "the Retry-After: {err}");
    assert_eq!(limit, Duration::from_secs(3) - took, "what was left: {err}");
    assert!(
        err.contains("hold"),
        "names the hold it would have waited for: {err}"
    );
    assert_eq!(pool.stats().sources["s"].received, 1);
    let held = gw.sources()[0].limiter.held().await.unwrap();
    assert!(held.source.hold_ends_in.is_some(), "the source is held: {held:?}");
}

/// A breaker-open source next to a paced one: the balancer waits for the earliest
/// wake-up (H7) instead of failing fast, and that wait ends at the call's deadline.
#[tokio::test(start_paused = true)]
async fn a_call_deadline_bounds_the_wait_behind_an_open_breaker() {
    let dead = pgw_sim::SourceConfig {
        revoked: true.into(),
        ..quick("dead")
    };
    let slow = pgw_sim::SourceConfig {
        ttft_s: pgw_sim::LogNormal::constant(20.0).into(),
        ..quick("busy")
    };
    let (_pool, gw, _sink) =
        gateway_over(vec![(dead, "g", None, None), (slow, "g", Some(1), None)], vec![]).await;
    // The first call opens `dead` (401) and ends up holding `busy`'s only slot.
    let holder = tokio::spawn({
        let gw = gw.clone();
        async move { gw.chat(ChatRequest::user("m", "holds the only slot")).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(gw.sources()[1].aimd.inflight(), 1, "busy's slot is taken");
    let dead_view = gw.sources()[0].breaker.view().await.unwrap();
    assert_ne!(
        dead_view.state,
        tower_breaker_window::BreakerState::Closed,
        "dead's breaker is open"
    );

    let (reason, took, err) = call_with_deadline(&gw, Duration::from_secs(3)).await;
    assert_eq!(reason, Some(Reason::DeadlineExceeded), "{err}");
    assert_eq!(took, Duration::from_secs(3), "{err}");
    assert!(holder.await.unwrap().is_ok());
}

/// The deadline runs across the fallback chain, from the call's start: the primary
/// group fails fast (its only source is revoked), and the backup's black hole is cut
/// at the call's deadline, not at a fresh one for the backup group.
#[tokio::test(start_paused = true)]
async fn the_deadline_spans_the_fallback_chain() {
    let dead = pgw_sim::SourceConfig {
        revoked: true.into(),
        ..quick("dead")
    };
    let hole = pgw_sim::SourceConfig {
        black_hole_rate: 1.0.into(),
        ..quick("hole")
    };
    let (pool, gw, _sink) = gateway_over(
        vec![(dead, "primary", None, None), (hole, "backup", None, None)],
        vec![],
    )
    .await;
    assert_eq!(gw.groups(), ["primary", "backup"]);
    let t0 = Instant::now();
    let mut call = ChatCall::new(ChatRequest::user("m", "down the chain"));
    call.extensions_mut()
        .insert(CallDeadline(t0 + Duration::from_secs(5)));
    let err = gw.clone().oneshot(call).await.unwrap_err();
    assert_eq!(t0.elapsed(), Duration::from_secs(5), "{err}");
    let gerr = err.downcast_ref::<GatewayError>().expect("a gateway error");
    let groups: Vec<_> = gerr.failures().iter().map(|(g, _)| g.as_str()).collect();
    assert_eq!(groups, ["primary", "backup"], "{err}");
    assert_eq!(
        gerr.last_retry_error().map(pgw_stack::retry::RetryError::reason),
        Some(Reason::DeadlineExceeded),
        "{err}"
    );
    let stats = pool.stats();
    assert_eq!(stats.sources["dead"].received, 1);
    assert_eq!(stats.sources["hole"].received, 1);
    assert_eq!(
        stats.sources["hole"].in_flight, 0,
        "the backup's attempt was dropped"
    );
}

/// `retry.max_call_duration_s` is one deadline for the whole call, like a
/// `CallDeadline`: a primary group that fails slowly (a 500 after 4 s, one attempt)
/// leaves the backup's black hole what is left of the 5 s, not 5 s of its own.
#[tokio::test(start_paused = true)]
async fn the_configured_call_duration_spans_the_fallback_chain() {
    let slow_failure = pgw_sim::SourceConfig {
        server_error_rate: 1.0.into(),
        error_latency_s: pgw_sim::LogNormal::constant(4.0).into(),
        ..quick("slow")
    };
    let hole = pgw_sim::SourceConfig {
        black_hole_rate: 1.0.into(),
        ..quick("hole")
    };
    let (pool, gw, _sink) = gateway_over_with(
        vec![
            (slow_failure, "primary", None, None),
            (hole, "backup", None, None),
        ],
        vec![],
        |c| {
            c.retry.max_call_duration_s = Some(5.0);
            c.retry.max_attempts = Some(1);
        },
    )
    .await;
    let t0 = Instant::now();
    let err = gw
        .clone()
        .oneshot(ChatCall::new(ChatRequest::user("m", "down the chain")))
        .await
        .unwrap_err();
    assert_eq!(t0.elapsed(), Duration::from_secs(5), "{err}");
    assert_eq!(last_reason(&*err), Some(Reason::DeadlineExceeded), "{err}");
    let stats = pool.stats();
    assert_eq!(stats.sources["slow"].received, 1);
    assert_eq!(stats.sources["hole"].received, 1);
    assert_eq!(stats.sources["hole"].in_flight, 0);
}

/// `retry.max_call_duration_s` bounds a committed stream too (its docs say so): the
/// relay read the caller's copy of the call, which had no deadline, so a slow stream
/// (2 tokens/s, 60 tokens) ran to its end at 33.5 s past a 10 s bound, holding its
/// AIMD slot and lease. It ends with the deadline error at 10 s now.
#[tokio::test(start_paused = true)]
async fn the_configured_call_duration_bounds_a_committed_stream() {
    use futures_util::StreamExt;
    let (pool, gw) = slow_stream(2.0, 2.0, |c, s| {
        c.retry.max_call_duration_s = Some(10.0);
        s.inter_token_timeout_s = Some(5.0);
        s.total_timeout_s = Some(300.0);
    })
    .await;
    let t0 = Instant::now();
    let mut req = ChatRequest::user("m", "tell me a story");
    req.max_tokens = Some(60);
    let mut stream = gw.chat_stream(req).await.unwrap();
    let mut err = None;
    while let Some(item) = stream.next().await {
        if let Err(e) = item {
            err = Some(e);
            break;
        }
    }
    assert_eq!(t0.elapsed(), Duration::from_secs(10));
    let err = err.expect("the stream ended with the deadline's error");
    assert!(err.to_string().contains("deadline"), "{err}");
    drop(stream);
    tokio::task::yield_now().await;
    assert_eq!(
        pool.stats().sources["slow"].in_flight,
        0,
        "the upstream request was dropped"
    );
}

/// The default deadline (none configured, none of the call's own) bounds the wait for
/// an answer, not a stream in progress: the OpenAI SDKs' own timeout, which it
/// follows, is per read. A stream of 750 s (150 tokens at 0.2 a second) ends whole.
#[tokio::test(start_paused = true)]
async fn the_default_deadline_does_not_cut_a_committed_stream() {
    use futures_util::StreamExt;
    let (_pool, gw) = slow_stream(1.0, 0.2, |_, s| {
        s.inter_token_timeout_s = Some(30.0);
        s.total_timeout_s = Some(3600.0);
    })
    .await;
    let t0 = Instant::now();
    let mut req = ChatRequest::user("m", "tell me a long story");
    req.max_tokens = Some(150);
    let mut stream = gw.chat_stream(req).await.unwrap();
    let mut finish = None;
    while let Some(item) = stream.next().await {
        let chunk = item.expect("no error: the default deadline does not cut the stream");
        if let Some(f) = chunk.choices.first().and_then(|c| c.finish_reason.clone()) {
            finish = Some(f);
        }
    }
    assert_eq!(finish.as_deref(), Some("stop"));
    assert!(
        t0.elapsed() > pgw_stack::DEFAULT_MAX_CALL_DURATION,
        "{:?}",
        t0.elapsed()
    );
}
