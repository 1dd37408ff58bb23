//! A source back from an outage gets its traffic back when its breaker's probe says
//! so, through the whole gateway against the simulator on tokio's paused clock: the
//! probe goes out off the balancer's path, so its success must reach the balancer's
//! health of the source, or the source stays avoided for the failures that opened the
//! breaker.

mod support;

use std::time::Duration;

use pgw_core::openai::ChatRequest;
use pgw_sim::schedule::Phase;
use pgw_sim::{LogNormal, PoolConfig, Schedule, SimPool};
use pgw_stack::breaker::BreakerState;
use pgw_stack::core::SourceId;
use pgw_stack::{ChatCall, Gateway, GatewayConfig, MemorySink, SecretKey, SourceConfig, SourceHandles};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower::ServiceExt;

/// The breaker's cooldown, s.
const COOLDOWN_S: f64 = 10.0;
/// When the flapping source stops failing, s: long after its breaker's first open period.
const HEALS_AT_S: f64 = 60.0;
/// How long the steady source takes to answer, s: a call sent there is seen waiting.
const STEADY_S: f64 = 20.0;
/// The balancer's longest wait for a busy source before it tries one it avoids, s.
const MAX_WAIT_S: f64 = 5.0;

fn ask(text: &str) -> ChatRequest {
    let mut r = ChatRequest::user("m", text);
    r.max_tokens = Some(50);
    r
}

/// `flaky` answers 503 until [`HEALS_AT_S`], then answers in under a second; `steady`
/// answers everything after [`STEADY_S`], one call at a time.
async fn gateway() -> (SimPool, Gateway, MemorySink) {
    let flaky = pgw_sim::SourceConfig {
        server_error_rate: Schedule::Phases {
            phases: vec![
                Phase {
                    from_s: 0.0,
                    value: 1.0,
                },
                Phase {
                    from_s: HEALS_AT_S,
                    value: 0.0,
                },
            ],
        },
        ..pgw_sim::SourceConfig::quick("flaky")
    };
    let steady = pgw_sim::SourceConfig {
        ttft_s: LogNormal::constant(STEADY_S).into(),
        ..pgw_sim::SourceConfig::quick("steady")
    };
    let pool = SimPool::new(PoolConfig::of(vec![flaky, steady]), 5).unwrap();
    let mut cfg = GatewayConfig::default();
    cfg.cache.enabled = false;
    cfg.balance.seed = Some(1);
    cfg.balance.max_wait_s = Some(MAX_WAIT_S);
    cfg.breaker.cooldown_s = Some(COOLDOWN_S);
    for name in ["flaky", "steady"] {
        let mut s = SourceConfig::new(
            name,
            format!("http://sim.invalid/{name}/v1"),
            SecretKey::new("sk-x"),
        );
        if name == "steady" {
            s.max_concurrency = Some(1);
        }
        cfg.sources.push(s);
    }
    let sink = MemorySink::default();
    let gw = support::sim_gateway(&pool, cfg, &sink).await;
    (pool, gw, sink)
}

fn handles<'a>(gw: &'a Gateway, route: &str) -> &'a SourceHandles {
    gw.sources().iter().find(|h| h.route.as_str() == route).unwrap()
}

async fn flaky_state(gw: &Gateway) -> BreakerState {
    handles(gw, "flaky").breaker.view().await.unwrap().state
}

/// `n` calls at once, left running.
fn spawn_calls(gw: &Gateway, name: &str, n: usize) -> Vec<JoinHandle<()>> {
    (0..n)
        .map(|i| {
            let call = gw.clone().oneshot(ChatCall::new(ask(&format!("{name} {i}"))));
            tokio::spawn(async move {
                drop(call.await);
            })
        })
        .collect()
}

/// The outage opens `flaky`'s breaker and leaves its health low; once it heals, the
/// half-open probe (a copy of a caller's call, sent off its path) succeeds and closes
/// the breaker, and the balancer hears of it: `flaky` is healthy again, and a call
/// arriving while `steady` is busy goes to `flaky` at once. Before, the probe's success
/// reached only the breaker: `flaky` kept the health the outage left, under half of
/// busy `steady`'s, so the call waited for `steady` until the balancer's `max_wait`.
#[tokio::test(start_paused = true)]
async fn a_successful_probe_gives_the_recovered_source_its_traffic_back() {
    let (_pool, gw, _sink) = gateway().await;

    // The outage: a burst of calls, one on `steady`, the rest on `flaky`'s 503s.
    let outage = spawn_calls(&gw, "outage", 12);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(flaky_state(&gw).await, BreakerState::Open);
    let poor = gw.health("flaky").unwrap();
    assert!(poor < 0.5, "the outage left flaky at {poor}");
    outage.iter().for_each(JoinHandle::abort);

    // Healed: calls that find `steady` busy try `flaky` after `max_wait`; the first to
    // ask it is refused while its copy goes out as the probe, which closes the breaker.
    tokio::time::sleep(Duration::from_secs_f64(HEALS_AT_S)).await;
    let mut callers = Vec::new();
    for i in 0.. {
        assert!(i < 60, "flaky's breaker never closed");
        if flaky_state(&gw).await == BreakerState::Closed {
            break;
        }
        callers.extend(spawn_calls(&gw, &format!("probe {i}"), 1));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(
        gw.health("flaky"),
        Some(1.0),
        "the probe's success did not reach the balancer"
    );

    // `steady` still busy with those callers: the next call is answered by `flaky` at
    // once, not after `max_wait`.
    assert_eq!(handles(&gw, "steady").aimd.inflight(), 1);
    let t0 = Instant::now();
    let answer = gw
        .clone()
        .oneshot(ChatCall::new(ask("after recovery")))
        .await
        .unwrap();
    let took = t0.elapsed();
    assert_eq!(answer.source.as_ref().map(SourceId::as_str), Some("flaky"));
    assert!(took < Duration::from_millis(1500), "waited {took:?}");
    callers.iter().for_each(JoinHandle::abort);
}

/// A phased `f64` schedule: `(from_s, value)` pairs.
fn phases(p: &[(f64, f64)]) -> Schedule<f64> {
    Schedule::Phases {
        phases: p.iter().map(|&(from_s, value)| Phase { from_s, value }).collect(),
    }
}

/// A half-open probe that a black hole swallows is given up once the balancer would
/// cut such an attempt (its `silent_after`, 60 s, here longer than 4 x the source's
/// latency), without a verdict, so the next call probes again and a source that healed
/// meanwhile is back. Before, the probe held the breaker's lease for its whole attempt
/// timeout (180 s): the source stayed out more than two minutes after it healed.
#[tokio::test(start_paused = true)]
async fn a_probe_a_black_hole_swallowed_is_given_up() {
    // Answers until 5 s (its latency measured), 503s until 20 s (the breaker opens),
    // swallows requests until 40 s (a probe goes in), answers after.
    let hole = pgw_sim::SourceConfig {
        server_error_rate: phases(&[(0.0, 0.0), (5.0, 1.0), (20.0, 0.0)]),
        black_hole_rate: phases(&[(0.0, 0.0), (20.0, 1.0), (40.0, 0.0)]),
        ..pgw_sim::SourceConfig::quick("hole")
    };
    let pool = SimPool::new(PoolConfig::of(vec![hole]), 5).unwrap();
    let mut cfg = GatewayConfig::default();
    cfg.cache.enabled = false;
    cfg.breaker.cooldown_s = Some(COOLDOWN_S);
    cfg.sources.push(SourceConfig::new(
        "hole",
        "http://sim.invalid/hole/v1",
        SecretKey::new("sk-x"),
    ));
    let gw = support::sim_gateway(&pool, cfg, &MemorySink::default()).await;
    let state = || async { gw.sources()[0].breaker.view().await.unwrap() };

    gw.clone().oneshot(ChatCall::new(ask("measured"))).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    // A call a second: 503s open the breaker, probes go out after each open period,
    // one into the hole (from 20 s) and, once given up, one that finds it healed.
    let start = Instant::now();
    let mut closed_at = None;
    for i in 0..150 {
        let _ = gw.clone().oneshot(ChatCall::new(ask(&format!("call {i}")))).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        if i > 20 && state().await.state == BreakerState::Closed {
            closed_at = Some(start.elapsed());
            break;
        }
    }
    // Healed at 40 s; the probe that went in at 20-30 s is given up at 80-90 s.
    let closed_at = closed_at.expect("the breaker never closed");
    assert!(
        closed_at < Duration::from_secs(95),
        "closed {closed_at:?} after the first 503"
    );
}
