//! A pool that cannot answer fails fast, and no call waits longer than one attempt
//! timeout to fail, through the whole gateway against the simulator on tokio's paused
//! clock: the breaker's half-open probe is sent off the caller's path, and the time a
//! call spent on refusals is taken from its next attempt's timeout.

mod support;

use std::time::Duration;

use pgw_core::openai::ChatRequest;
use pgw_sim::schedule::Phase;
use pgw_sim::{LogNormal, PoolConfig, Schedule, SimPool};
use pgw_stack::retry::Reason;
use pgw_stack::{
    AttemptTelemetry, ChatCall, GatewayConfig, GatewayError, MemorySink, SecretKey, SourceConfig,
};
use tokio::time::Instant;
use tower::ServiceExt;

/// How long the simulated revoked key takes to answer its 401, s: long enough that a
/// caller waiting for it is seen waiting.
const REFUSAL_S: f64 = 2.0;
/// The breaker's cooldown, s.
const COOLDOWN_S: f64 = 10.0;

fn ask(text: &str) -> ChatRequest {
    let mut r = ChatRequest::user("m", text);
    r.max_tokens = Some(50);
    r
}

/// The reason of a gateway error's last retry error.
fn last_reason(err: &(dyn std::error::Error + Send + Sync + 'static)) -> Option<Reason> {
    err.downcast_ref::<GatewayError>()
        .expect("a gateway error")
        .last_retry_error()
        .map(pgw_stack::retry::RetryError::reason)
}

/// Call `id`'s attempts in order, and each one's source and outcome.
fn attempts_of(sink: &MemorySink, id: u64) -> (Vec<AttemptTelemetry>, Vec<(Option<String>, &'static str)>) {
    let mut attempts: Vec<_> = sink.records().into_iter().filter(|r| r.call_id == id).collect();
    attempts.sort_by_key(|r| r.attempt);
    let order = attempts
        .iter()
        .map(|r| (r.source.as_ref().map(|s| s.as_str().to_owned()), r.outcome))
        .collect();
    (attempts, order)
}

/// A revoked key (401 after [`REFUSAL_S`]) named `name`; `revoked` says when.
fn revoked(name: &str, revoked: Schedule<bool>) -> pgw_sim::SourceConfig {
    pgw_sim::SourceConfig {
        revoked,
        error_latency_s: LogNormal::constant(REFUSAL_S).into(),
        ..pgw_sim::SourceConfig::quick(name)
    }
}

async fn gateway(
    sources: Vec<pgw_sim::SourceConfig>,
    total_timeout_s: f64,
    seed: u64,
) -> (SimPool, pgw_stack::Gateway, MemorySink) {
    let names: Vec<String> = sources.iter().map(|s| s.name.clone()).collect();
    let pool = SimPool::new(PoolConfig::of(sources), 5).unwrap();
    let mut cfg = GatewayConfig::default();
    cfg.cache.enabled = false;
    cfg.balance.seed = Some(seed);
    cfg.breaker.cooldown_s = Some(COOLDOWN_S);
    // One attempt per source: the bound under test is refusals then silence, not a
    // second attempt on the only silent source.
    cfg.retry.max_attempts = Some(2);
    for name in names {
        let mut s = SourceConfig::new(
            name.as_str(),
            format!("http://sim.invalid/{name}/v1"),
            SecretKey::new("sk-x"),
        );
        s.total_timeout_s = Some(total_timeout_s);
        cfg.sources.push(s);
    }
    let sink = MemorySink::default();
    let gw = support::sim_gateway(&pool, cfg, &sink).await;
    (pool, gw, sink)
}

/// The first call after a revoked key's cooldown is refused at once with
/// `CircuitOpen` (its `retry_after` set): the half-open probe goes out on its own,
/// numbered in that call, and the caller never waits for its 401. Once the key is
/// restored, the next probe closes the breaker and the call after it is answered
/// there: recovery is not lost.
#[tokio::test(start_paused = true)]
async fn the_half_open_probe_never_holds_the_caller() {
    let schedule = Schedule::Phases {
        phases: vec![
            Phase {
                from_s: 0.0,
                value: true,
            },
            Phase {
                from_s: 30.0,
                value: false,
            },
        ],
    };
    let (_pool, gw, sink) = gateway(vec![revoked("key", schedule)], 60.0, 1).await;

    // The 401 opens the breaker.
    let err = gw.clone().oneshot(ChatCall::new(ask("first"))).await.unwrap_err();
    let first = sink.records();
    assert_eq!(first.len(), 1, "{err}");
    assert_eq!(first[0].outcome, "source_dead");

    // Past the cooldown: this call is admitted as the probe.
    tokio::time::sleep(Duration::from_secs_f64(COOLDOWN_S + 1.0)).await;
    let call = ChatCall::new(ask("second"));
    let id = call.id().0;
    let t0 = Instant::now();
    let err = gw.clone().oneshot(call).await.unwrap_err();
    assert_eq!(
        t0.elapsed(),
        Duration::ZERO,
        "the caller waited for the probe: {err}"
    );
    match last_reason(&*err) {
        Some(Reason::AllCircuitsOpen { retry_after }) => assert!(retry_after > Duration::ZERO),
        other => panic!("expected all circuits open, got {other:?}: {err}"),
    }
    // The probe answers on its own, recorded under the caller's call id, and reopens
    // the breaker.
    tokio::time::sleep(Duration::from_secs_f64(REFUSAL_S + 0.5)).await;
    let probes: Vec<_> = sink.records().into_iter().filter(|r| r.call_id == id).collect();
    assert_eq!(probes.len(), 1, "{probes:?}");
    assert_eq!(probes[0].outcome, "source_dead");
    assert!(!gw.sources()[0].breaker.view().await.unwrap().probe_in_flight);

    // The key is restored at 30 s; the probe after the next open period closes the
    // breaker (its caller still goes on without it), and the call after is answered.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let mut answered = None;
    for i in 0..5 {
        if let Ok(answer) = gw
            .clone()
            .oneshot(ChatCall::new(ask(&format!("after {i}"))))
            .await
        {
            answered = Some(answer);
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(answered.is_some(), "the restored key never got its traffic back");
}

/// A call refused by a revoked key and then sent to a black hole fails one attempt
/// timeout after its first attempt started, not one timeout plus the refusal: the
/// 401's 2 s are taken from the black hole's 10 s.
#[tokio::test(start_paused = true)]
async fn refusals_count_against_the_next_attempts_timeout() {
    const TIMEOUT_S: f64 = 10.0;
    let hole = pgw_sim::SourceConfig {
        black_hole_rate: 1.0.into(),
        ..pgw_sim::SourceConfig::quick("hole")
    };
    // Seed 2 sends the first attempt to `key` (asserted below; the two sources tie
    // before any answer, and the seed decides).
    let (_pool, gw, sink) = gateway(vec![revoked("key", true.into()), hole], TIMEOUT_S, 2).await;

    let call = ChatCall::new(ask("refused, then silence"));
    let id = call.id().0;
    let t0 = Instant::now();
    let err = gw.clone().oneshot(call).await.unwrap_err();
    let took = t0.elapsed();
    let (attempts, order) = attempts_of(&sink, id);
    assert_eq!(
        order,
        [
            (Some("key".to_owned()), "source_dead"),
            (Some("hole".to_owned()), "transient")
        ],
        "{err}"
    );
    assert_eq!(
        took,
        Duration::from_secs_f64(TIMEOUT_S),
        "one attempt timeout in all: {err}"
    );
    assert!((attempts[1].latency_ms - (TIMEOUT_S - REFUSAL_S) * 1000.0).abs() < 1.0);
}

/// Refusals never leave the next source less than half its own timeout: a 401 after
/// 8 s, then a healthy source with a 10 s timeout answering in 4 s. The 8 s were taken
/// from its 10 s, so it was cut at 2 s and charged a failure (past 10 s of refusals,
/// at once).
#[tokio::test(start_paused = true)]
async fn a_slow_refusal_never_cuts_the_next_source_at_once() {
    const TIMEOUT_S: f64 = 10.0;
    let slow_refusal = pgw_sim::SourceConfig {
        error_latency_s: LogNormal::constant(8.0).into(),
        ..revoked("key", true.into())
    };
    let good = pgw_sim::SourceConfig {
        ttft_s: LogNormal::constant(4.0).into(),
        ..pgw_sim::SourceConfig::quick("good")
    };
    // Seed 2 sends the first attempt to `key` (asserted below; the two sources tie
    // before any answer, and the seed decides).
    let (_pool, gw, sink) = gateway(vec![slow_refusal, good], TIMEOUT_S, 2).await;
    let call = ChatCall::new(ask("refused slowly, then answered"));
    let id = call.id().0;
    let answer = gw.clone().oneshot(call).await;
    let (_, order) = attempts_of(&sink, id);
    assert_eq!(
        order,
        [
            (Some("key".to_owned()), "source_dead"),
            (Some("good".to_owned()), "success")
        ],
    );
    assert!(answer.is_ok(), "{:?}", answer.err().map(|e| e.to_string()));
}
