//! Our own failures are never outcomes of a source:
//! - a Redis that refuses the limiter's round trips while the breakers' still land. On
//!   a private `redis-server` (the test changes its ACL) and tokio's real clock: Redis
//!   answers on its own clock, and a paused tokio clock would run out the gateway's
//!   Redis response timeouts while the server is still answering. Nothing there sleeps;
//!   the simulator answers within milliseconds.
//! - the process out of file descriptors for its upstream connects: the memory backend,
//!   on tokio's paused clock.

mod support;

use pgw_core::openai::ChatRequest;
use pgw_core::{BackendUnavailable, NotAdmitted};
use pgw_sim::{LogNormal, PoolConfig, SimPool};
use pgw_stack::breaker::BreakerState;
use pgw_stack::{BackendKind, Gateway, GatewayConfig, MemorySink, SecretKey, SourceConfig};
use pgw_test_support::PrivateRedis;

const KEY: &str = "sk-virtual-0123456789";

fn quick(name: &str) -> pgw_sim::SourceConfig {
    pgw_sim::SourceConfig {
        ttft_s: LogNormal::constant(0.005).into(),
        tokens_per_second: LogNormal::constant(5000.0).into(),
        error_latency_s: LogNormal::constant(0.005).into(),
        ..pgw_sim::SourceConfig::healthy(name)
    }
}

/// Runs `redis-cli -p PORT ARGS...` and checks it said `OK`.
fn redis_cli(server: &PrivateRedis, args: &[&str]) {
    let cli = std::env::var_os("PGW_REDIS_CLI").unwrap_or_else(|| "redis-cli".into());
    let out = std::process::Command::new(cli)
        .args(["-p", &server.port().to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "OK",
        "{args:?}: {out:?}"
    );
}

/// Every source's breaker closed with no failure counted, and its health untouched.
async fn nothing_counted_against_a_source(gw: &Gateway) {
    for h in gw.sources() {
        let view = h.breaker.view().await.unwrap();
        assert_eq!(view.state, BreakerState::Closed, "{}: {view:?}", h.source);
        assert_eq!(view.failures, 0, "{}: no failure recorded", h.source);
        assert_eq!(
            gw.health(h.source.as_str()),
            Some(1.0),
            "{}: no health sample",
            h.source
        );
    }
}

/// The one partial outage in which a misread own failure would open a breaker: the
/// limiter's keys refused (an ACL: the same `BackendUnavailable` as a timeout or a
/// lost connection), the breakers' still served, so every failure recorded against a
/// source would land. In a whole outage the breakers' records are lost with the rest.
#[tokio::test]
async fn a_redis_outage_of_the_limiter_opens_no_breaker_and_feeds_no_health() {
    let server = PrivateRedis::start();
    let pool = SimPool::new(PoolConfig::of(vec![quick("a"), quick("b")]), 7).unwrap();
    let prefix = pgw_test_support::unique_prefix("limiter_outage");
    let mut cfg = GatewayConfig {
        backend: BackendKind::Redis,
        redis_url: Some(server.url()),
        key_prefix: Some(prefix.clone()),
        ..GatewayConfig::default()
    };
    cfg.cache.enabled = false;
    cfg.balance.policy = Some("round_robin".into());
    // A call that finds every source not admitted gives up at once instead of asking
    // again after a second (the balancer and the retry loop alike): the test makes
    // many of them.
    cfg.balance.max_wait_s = Some(0.5);
    cfg.retry.stall_window_s = Some(0.5);
    for name in pool.sources() {
        let mut s = SourceConfig::new(
            name.as_str(),
            format!("http://sim.invalid/{name}/v1"),
            SecretKey::new(KEY),
        );
        s.total_timeout_s = Some(5.0);
        // A quota to enforce: every admission is a round trip to Redis.
        s.rpm = Some(1000);
        s.max_concurrency = Some(4);
        cfg.sources.push(s);
    }
    let sink = MemorySink::new();
    let gw: Gateway = support::sim_gateway(&pool, cfg, &sink).await;
    gw.chat(ChatRequest::user("m", "before")).await.unwrap();
    let received = || -> u64 { pool.stats().sources.values().map(|s| s.received).sum() };
    assert_eq!(received(), 1);
    let threshold = 5; // the breaker's default consecutive threshold

    redis_cli(
        &server,
        &[
            "ACL",
            "SETUSER",
            "default",
            "resetkeys",
            &format!("~{prefix}:brk*"),
        ],
    );
    let calls = 4 * threshold;
    for i in 0..calls {
        let err = gw
            .chat(ChatRequest::user("m", format!("during {i}")))
            .await
            .unwrap_err();
        let own = NotAdmitted::of(&*err) == Some(NotAdmitted::Unavailable)
            || std::iter::successors(Some(&*err as &(dyn std::error::Error + 'static)), |e| e.source())
                .any(<dyn std::error::Error>::is::<BackendUnavailable>);
        assert!(own, "call {i}: {err}");
    }
    assert_eq!(received(), 1, "no attempt left the process");
    assert_eq!(
        sink.records().len(),
        1,
        "no attempt record: nothing was attempted"
    );
    nothing_counted_against_a_source(&gw).await;
    for h in gw.sources() {
        assert!(
            h.limiter.stats().unavailable > 0,
            "{}: the limiter was asked",
            h.source
        );
    }

    redis_cli(&server, &["ACL", "SETUSER", "default", "allkeys"]);
    for i in 0..2 {
        gw.chat(ChatRequest::user("m", format!("after {i}")))
            .await
            .unwrap();
    }
    assert_eq!(received(), 3, "both sources serve at once after the outage");
}

/// An error as hyper-util's client gives it: a message over its cause.
#[derive(Debug)]
struct Wrapped(&'static str, Box<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for Wrapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Wrapped {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.1)
    }
}

/// The process out of file descriptors (`EMFILE` on its upstream connects, as a flood
/// of client connections leaves it) is its own failure: no breaker opens, no health
/// falls, no quota is charged, the call ends at once on its first attempt (every other
/// source would fail alike), and the sources serve as soon as descriptors are back.
#[cfg(unix)]
#[tokio::test(start_paused = true)]
async fn running_out_of_file_descriptors_opens_no_breaker_and_ends_the_call_at_once() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use bytes::Bytes;
    use pgw_core::BoxError;
    use pgw_stack::client::box_transport;
    use tower_retry_pushback::{Reason, RetryError};

    const EMFILE: i32 = 24; // "Too many open files" on Linux, the BSDs and macOS

    let pool = SimPool::new(PoolConfig::of(vec![quick("a"), quick("b")]), 7).unwrap();
    let mut cfg = GatewayConfig::default();
    cfg.cache.enabled = false;
    for name in pool.sources() {
        let mut s = SourceConfig::new(
            name.as_str(),
            format!("http://sim.invalid/{name}/v1"),
            SecretKey::new(KEY),
        );
        // Far fewer than the calls below: an attempt that never left the process
        // gives its request back to the quota (charged, the calls would wait for it).
        s.rpm = Some(5);
        cfg.sources.push(s);
    }
    let exhausted = Arc::new(AtomicBool::new(true));
    let sink = MemorySink::new();
    let out = exhausted.clone();
    let gw = support::sim_gateway_with(&pool, cfg, &sink, move |sim| {
        let out = out.clone();
        box_transport(tower::service_fn(move |req: http::Request<Bytes>| {
            let (mut sim, out) = (sim.clone(), out.clone());
            async move {
                if out.load(Ordering::SeqCst) {
                    let io = std::io::Error::from_raw_os_error(EMFILE);
                    let connect = Wrapped("tcp open error", Box::new(io));
                    return Err(Box::new(Wrapped("client error (Connect)", Box::new(connect))) as BoxError);
                }
                tower::Service::call(&mut sim, req).await
            }
        }))
    })
    .await;

    let calls = 20; // four times the breaker's consecutive threshold
    for i in 0..calls {
        let started = tokio::time::Instant::now();
        let err = gw
            .chat(ChatRequest::user("m", format!("during {i}")))
            .await
            .unwrap_err();
        let reason = std::iter::successors(Some(&*err as &(dyn std::error::Error + 'static)), |e| e.source())
            .find_map(|e| e.downcast_ref::<RetryError>())
            .map(RetryError::reason);
        assert_eq!(reason, Some(Reason::LocalExhaustion), "call {i}: {err}");
        assert_eq!(started.elapsed(), std::time::Duration::ZERO, "call {i} waited");
    }
    let records = sink.records();
    assert_eq!(records.len(), calls, "one attempt per call");
    assert!(
        records.iter().all(|r| r.outcome == "local_exhaustion"),
        "{:?}",
        records.iter().map(|r| r.outcome).collect::<Vec<_>>()
    );
    nothing_counted_against_a_source(&gw).await;

    exhausted.store(false, Ordering::SeqCst);
    let back = tokio::time::Instant::now();
    for i in 0..2 {
        gw.chat(ChatRequest::user("m", format!("after {i}")))
            .await
            .unwrap();
    }
    // Their answers' own time (the simulator's), not a wait for a quota's window.
    assert!(
        back.elapsed() < std::time::Duration::from_secs(1),
        "no quota left charged: {:?}",
        back.elapsed()
    );
    let received: u64 = pool.stats().sources.values().map(|s| s.received).sum();
    assert_eq!(received, 2, "the sources serve at once once descriptors are back");
}
