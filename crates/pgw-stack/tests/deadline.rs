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
