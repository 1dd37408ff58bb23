//! A timeout moves the call on (R1), through the whole gateway, against the simulator
//! on tokio's paused clock: after an attempt is cut by a timeout, the call's next
//! attempt goes to another admitted source, not to the silent one again.

mod support;

use std::time::Duration;

use futures_util::StreamExt;
use pgw_core::openai::ChatRequest;
use pgw_sim::schedule::Phase;
use pgw_sim::{LogNormal, PoolConfig, Schedule, SimPool};
use pgw_stack::{ChatCall, GatewayConfig, MemorySink, SecretKey, SourceConfig};
use tokio::time::Instant;
use tower::ServiceExt;

/// The scenario second at which `slow` stops answering in time and `ok` recovers.
const TURN_S: f64 = 30.0;
/// The attempt timeout that cuts `slow`: the total timeout of a call answered whole,
/// the first-token timeout of a streamed one, s.
const TIMEOUT_S: f64 = 5.0;

/// A short request (its answer takes a fraction of a second), streamed or not.
fn ask(text: &str, stream: bool) -> ChatRequest {
    let mut r = ChatRequest::user("m", text);
    r.max_tokens = Some(50);
    r.stream = stream;
    r
}

/// `before` until [`TURN_S`], `after` from then on.
fn turns<T>(before: T, after: T) -> Schedule<T> {
    Schedule::Phases {
        phases: vec![
            Phase {
                from_s: 0.0,
                value: before,
            },
            Phase {
                from_s: TURN_S,
                value: after,
            },
        ],
    }
}

/// Two sources, `slow` and `ok`. Until [`TURN_S`], `slow` answers at once and `ok`
/// fails every call (5xx); the warm-up calls of that phase leave `ok`'s health below
/// what one timeout leaves of `slow`'s, so health and load alone would send a call's
/// second attempt back to `slow`. From [`TURN_S`] on, `slow` is what `silent` makes of
/// it and `ok` is healthy.
///
/// The warm-up calls have the test call's shape (`stream`): the balancer keeps the
/// health of streamed calls apart.
async fn gateway(
    silent: impl FnOnce(pgw_sim::SourceConfig) -> pgw_sim::SourceConfig,
    stream: bool,
) -> (SimPool, pgw_stack::Gateway, MemorySink) {
    let slow = silent(pgw_sim::SourceConfig::quick("slow"));
    let ok = pgw_sim::SourceConfig {
        server_error_rate: turns(1.0, 0.0),
        ..pgw_sim::SourceConfig::quick("ok")
    };
    let pool = SimPool::new(PoolConfig::of(vec![slow, ok]), 5).unwrap();
    let mut cfg = GatewayConfig::default();
    cfg.cache.enabled = false;
    cfg.balance.seed = Some(3);
    for name in ["slow", "ok"] {
        let mut s = SourceConfig::new(
            name,
            format!("http://sim.invalid/{name}/v1"),
            SecretKey::new("sk-x"),
        );
        s.first_token_timeout_s = Some(TIMEOUT_S);
        s.total_timeout_s = Some(if stream { 120.0 } else { TIMEOUT_S });
        cfg.sources.push(s);
    }
    let sink = MemorySink::default();
    let gw = support::sim_gateway(&pool, cfg, &sink).await;
    // The health of the call's shape.
    let health = |name: &str| {
        if stream {
            gw.stream_health(name).unwrap()
        } else {
            gw.health(name).unwrap()
        }
    };

    // Warm-up: concurrent calls until `ok` has failed a few times (each call then
    // succeeds on `slow`).
    let mut batch = 0;
    while health("ok") >= 0.75 {
        batch += 1;
        assert!(batch <= 10, "the warm-up never reached ok");
        let calls: Vec<_> = (0..4)
            .map(|i| {
                let gw = gw.clone();
                tokio::spawn(async move {
                    let call = ChatCall::new(ask(&format!("warm {batch}.{i}"), stream));
                    gw.oneshot(call).await
                })
            })
            .collect();
        for c in calls {
            assert!(c.await.unwrap().is_ok(), "warm-up calls succeed on slow");
        }
    }
    let (slow_h, ok_h) = (health("slow"), health("ok"));
    // One timeout leaves slow at 0.8 x its health: ok must be below that (health alone
    // would pick slow again) and credible against it (at least half of it: H5).
    assert!(
        ok_h < 0.8 * slow_h && ok_h >= 0.5 * 0.8 * slow_h,
        "warm-up: slow {slow_h}, ok {ok_h}"
    );
    let turn = Duration::from_secs_f64(TURN_S);
    let now = Duration::from_secs_f64(pool.scenario_time_s());
    assert!(now < turn, "the warm-up ran past the turn: {now:?}");
    tokio::time::sleep(turn - now).await;
    (pool, gw, sink)
}

/// One call after the turn: its first attempt goes to `slow` (the healthiest), is cut
/// by the timeout, and its second goes to `ok` at once (after the backoff), so the
/// call is answered after one timeout plus `ok`'s latency (a streamed call: its time
/// to first token), not after two or three timeouts.
async fn one_timeout_then_elsewhere(
    silent: impl FnOnce(pgw_sim::SourceConfig) -> pgw_sim::SourceConfig,
    stream: bool,
) {
    let (pool, gw, sink) = gateway(silent, stream).await;
    let t0 = Instant::now();
    let (call_id, source, took) = if stream {
        let mut s = gw.chat_stream(ask("after the turn", true)).await.unwrap();
        // Committed (its first chunk in hand): the caller sees the answer from now on.
        let took = t0.elapsed();
        let (call_id, source) = (s.call_id(), s.source().cloned());
        // Its attempt's record is written when the stream ends.
        while let Some(chunk) = s.next().await {
            chunk.unwrap();
        }
        (call_id, source, took)
    } else {
        let a = gw.chat(ask("after the turn", false)).await.unwrap();
        (a.call_id, a.source, t0.elapsed())
    };
    // The call's own attempts: not a probe of `ok` sent off its path while `ok` was
    // left alone since the warm-up (it answers, and is healthy again).
    let records: Vec<_> = sink
        .records()
        .into_iter()
        .filter(|r| r.call_id == call_id && !r.probe)
        .collect();
    // (A probe is numbered among the call's attempts: the second may be the third.)
    let attempts: Vec<_> = records
        .iter()
        .map(|r| (r.source.as_ref().unwrap().as_str(), r.outcome))
        .collect();
    assert_eq!(
        attempts,
        [("slow", "transient"), ("ok", "success")],
        "{records:#?}"
    );
    assert_eq!(records[0].attempt, 1, "{records:#?}");
    let cut = records[0].error.as_deref().unwrap();
    let watchdog = if stream { "first_token" } else { "total" };
    assert!(cut.contains(watchdog), "cut by the {watchdog} timeout: {cut}");
    assert_eq!(source.unwrap().as_str(), "ok");

    // One timeout, the first backoff (at most the 0.5 s base), then ok's own latency.
    let timeout = Duration::from_secs_f64(TIMEOUT_S);
    let ok_ms = if stream {
        records[1].ttft_ms.unwrap()
    } else {
        records[1].latency_ms
    };
    let ok_latency = Duration::from_secs_f64(ok_ms / 1000.0);
    assert!(took >= timeout, "{took:?}");
    assert!(
        took <= timeout + Duration::from_millis(500) + ok_latency + Duration::from_millis(10),
        "{took:?}: timeout {timeout:?} + backoff + ok {ok_latency:?}"
    );
    assert_eq!(
        pool.stats().sources["slow"].in_flight,
        0,
        "the cut attempt was dropped"
    );
}

#[tokio::test(start_paused = true)]
async fn after_a_black_hole_timeout_the_next_attempt_goes_to_the_healthy_source() {
    let hole = |s| pgw_sim::SourceConfig {
        black_hole_rate: turns(0.0, 1.0),
        ..s
    };
    one_timeout_then_elsewhere(hole, false).await;
}

#[tokio::test(start_paused = true)]
async fn after_a_late_first_token_the_next_attempt_goes_to_the_healthy_source() {
    let late = |s| pgw_sim::SourceConfig {
        ttft_s: turns(LogNormal::constant(0.5), LogNormal::constant(4.0 * TIMEOUT_S)),
        ..s
    };
    one_timeout_then_elsewhere(late, true).await;
}
