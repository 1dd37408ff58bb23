//! Round trips the gateway does not make on the Redis backend: a call refused by what
//! a source's limiter already knows asks neither the breaker nor the limiter. On a
//! private `redis-server` (its command counts are the test's alone) and tokio's real
//! clock (Redis answers on its own); the simulator answers within milliseconds.

mod support;

use std::time::Duration;

use pgw_core::openai::ChatRequest;
use pgw_sim::{PoolConfig, SimPool, SourceConfig as SimSource};
use pgw_stack::ratelimit::HoldScope;
use pgw_stack::{BackendKind, GatewayConfig, MemorySink, SecretKey, SourceConfig};
use pgw_test_support::PrivateRedis;

/// A source held (by this process) is refused before its breaker: the calls that find
/// it held make no round trip at all, even with the breaker's closed view off (every
/// breaker admission would otherwise be one).
#[tokio::test]
async fn a_held_source_is_refused_before_its_breaker_without_a_round_trip() {
    let server = PrivateRedis::start();
    let pool = SimPool::new(PoolConfig::of(vec![SimSource::quick("a")]), 7).unwrap();
    let mut cfg = GatewayConfig {
        backend: BackendKind::Redis,
        redis_url: Some(server.url()),
        key_prefix: Some(pgw_test_support::unique_prefix("known")),
        ..GatewayConfig::default()
    };
    cfg.cache.enabled = false;
    cfg.breaker.closed_view_s = Some(0.0);
    // A call that finds the source held fails at once (the hold outlasts any wait).
    cfg.balance.max_wait_s = Some(0.2);
    cfg.retry.stall_window_s = Some(0.2);
    let mut s = SourceConfig::new(
        "a",
        "http://sim.invalid/a/v1",
        SecretKey::new("sk-known-0123456789"),
    );
    s.rpm = Some(1000);
    cfg.sources.push(s);
    let sink = MemorySink::new();
    let gw = support::sim_gateway(&pool, cfg, &sink).await;
    gw.chat(ChatRequest::user("m", "before")).await.unwrap();
    gw.sources()[0]
        .limiter
        .hold(HoldScope::Source, Duration::from_secs(600))
        .await
        .unwrap();
    let before = server.command_calls("evalsha");
    for i in 0..3 {
        let err = gw
            .chat(ChatRequest::user("m", format!("held {i}")))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("hold"), "{err}");
    }
    assert_eq!(
        server.command_calls("evalsha") - before,
        0,
        "no breaker or limiter round trip"
    );
    assert_eq!(pool.stats().sources.values().map(|s| s.received).sum::<u64>(), 1);
}
