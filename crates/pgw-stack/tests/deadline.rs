//! The caller's deadline bounds the whole call: attempts, waits and the fallback chain.

mod support;

use std::time::Duration;

use pgw_core::openai::ChatRequest;
use pgw_sim::{PoolConfig, SimPool};
use pgw_stack::retry::{CallDeadline, Reason};
use pgw_stack::{ChatCall, GatewayConfig, GatewayError, MemorySink, SecretKey, SourceConfig};
use tokio::time::Instant;
use tower::ServiceExt;

#[tokio::test(start_paused = true)]
async fn a_call_deadline_cuts_a_black_hole_and_releases_everything() {
    let hole = pgw_sim::SourceConfig {
        black_hole_rate: 1.0.into(),
        ..pgw_sim::SourceConfig::healthy("hole")
    };
    let pool = SimPool::new(
        PoolConfig {
            sources: vec![hole],
            bad_prompt_rate: 0.0,
            ..PoolConfig::default()
        },
        3,
    )
    .unwrap();
    let mut cfg = GatewayConfig::default();
    cfg.cache.enabled = false;
    let mut s = SourceConfig::new("hole", "http://sim.invalid/hole/v1", SecretKey::new("sk-x"));
    s.total_timeout_s = Some(180.0);
    cfg.sources.push(s);
    let sink = MemorySink::default();
    let gw = support::sim_gateway(&pool, cfg, &sink).await;

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
    let gerr = err.downcast_ref::<GatewayError>().expect("a gateway error");
    assert!(
        matches!(
            gerr.last_retry_error().map(pgw_stack::retry::RetryError::reason),
            Some(Reason::DeadlineExceeded)
        ),
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

/// One black hole and the cache on: the first call leads, hanging for the 180 s attempt
/// timeout. An identical call that arrives meanwhile follows it only while something in
/// the process answers: a minute without a success and it goes on alone, where the
/// silent source refuses it at once (an all-dead pool fails fast, R3/H7); and a
/// follower's wait ends at its deadline.
#[tokio::test(start_paused = true)]
async fn a_follower_does_not_wait_out_a_leader_on_a_dead_pool_nor_past_its_deadline() {
    let hole = pgw_sim::SourceConfig {
        black_hole_rate: 1.0.into(),
        ..pgw_sim::SourceConfig::healthy("hole")
    };
    let pool = SimPool::new(
        PoolConfig {
            sources: vec![hole],
            bad_prompt_rate: 0.0,
            ..PoolConfig::default()
        },
        3,
    )
    .unwrap();
    let mut cfg = GatewayConfig::default();
    cfg.cache.when = pgw_stack::config::CacheWhen::Always;
    let mut s = SourceConfig::new("hole", "http://sim.invalid/hole/v1", SecretKey::new("sk-x"));
    s.total_timeout_s = Some(180.0);
    cfg.sources.push(s);
    let sink = MemorySink::default();
    let gw = support::sim_gateway(&pool, cfg, &sink).await;

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
    let gerr = err.downcast_ref::<GatewayError>().expect("a gateway error");
    assert!(
        matches!(
            gerr.last_retry_error().map(pgw_stack::retry::RetryError::reason),
            Some(Reason::DeadlineExceeded)
        ),
        "{err}"
    );

    // A follower without one: a minute after the process's last success (its start),
    // it stops following and fails fast on the silent source.
    let err = gw.chat(ChatRequest::user("m", "same")).await.unwrap_err();
    assert_eq!(t0.elapsed(), Duration::from_secs(60), "{err}");
    let gerr = err.downcast_ref::<GatewayError>().expect("a gateway error");
    assert!(
        matches!(
            gerr.last_retry_error().map(pgw_stack::retry::RetryError::reason),
            Some(Reason::AllCircuitsOpen { .. })
        ),
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
