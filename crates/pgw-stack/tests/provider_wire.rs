//! The providers' language, through the gateway, against the
//! simulator's wire behaviours on tokio's paused clock: what each provider answer
//! does to the breakers, the attempts and the caller.

mod support;

use pgw_core::openai::{ChatRequest, FINISH_CONTENT_FILTER};
use pgw_core::{Outcome, UpstreamStatus, classify_error};
use pgw_sim::{PoolConfig, SimPool};
use pgw_stack::breaker::BreakerState;
use pgw_stack::{Gateway, GatewayConfig, MemorySink, SecretKey, SourceConfig};

const KEY: &str = "sk-virtual-0123456789";

fn pool(sources: Vec<pgw_sim::SourceConfig>) -> SimPool {
    let config = PoolConfig::of(sources);
    SimPool::new(config, 7).unwrap()
}

/// A source serving only `gpt-4o`, healthy otherwise, answering within a second or
/// two (so no breaker cooldown runs out between the calls of a test).
fn serving(name: &str) -> pgw_sim::SourceConfig {
    pgw_sim::SourceConfig {
        models: Some(vec!["gpt-4o".into()]),
        ..pgw_sim::SourceConfig::quick(name)
    }
}

async fn gateway(pool: &SimPool, sink: &MemorySink) -> Gateway {
    let mut cfg = GatewayConfig::default();
    // Every call below is its own evidence: no answer may come from the cache.
    cfg.cache.enabled = false;
    cfg.balance.policy = Some("round_robin".into());
    for name in pool.sources() {
        let mut s = SourceConfig::new(
            name.as_str(),
            format!("http://sim.invalid/{name}/v1"),
            SecretKey::new(KEY),
        );
        s.total_timeout_s = Some(60.0);
        cfg.sources.push(s);
    }
    support::sim_gateway(pool, cfg, sink).await
}

async fn states(gw: &Gateway) -> Vec<(String, BreakerState)> {
    let mut out = Vec::new();
    for h in gw.sources() {
        out.push((h.source.to_string(), h.breaker.view().await.unwrap().state));
    }
    out
}

fn all_closed(states: &[(String, BreakerState)]) -> bool {
    states.iter().all(|(_, s)| *s == BreakerState::Closed)
}

fn received(pool: &SimPool) -> u64 {
    pool.stats().sources.values().map(|s| s.received).sum()
}

#[tokio::test(start_paused = true)]
async fn a_wrong_model_is_rejected_at_once_and_opens_no_breaker() {
    let pool = pool(vec![serving("a"), serving("b"), serving("c")]);
    let sink = MemorySink::new();
    let gw = gateway(&pool, &sink).await;
    // Before, one such call force-opened up to `max_attempts` healthy sources.
    for i in 0..6 {
        let err = gw
            .chat(ChatRequest::user("gpt-4o-mimi", format!("typo {i}")))
            .await
            .unwrap_err();
        assert_eq!(classify_error(&*err), Outcome::Rejected, "{err}");
        let upstream = UpstreamStatus::find(&*err).expect("the provider's answer");
        assert_eq!(upstream.status(), 404);
        assert_eq!(upstream.code(), Some("model_not_found"));
        assert!(upstream.message().contains("gpt-4o-mimi"), "{upstream}");
    }
    assert_eq!(
        received(&pool),
        6,
        "one attempt per call: a rejected request fails fast"
    );
    let stats = pool.stats();
    assert_eq!(stats.sources.values().map(|s| s.model_not_found).sum::<u64>(), 6);
    let states = states(&gw).await;
    assert!(all_closed(&states), "{states:?}");
    for h in gw.sources() {
        assert_eq!(
            gw.health(h.source.as_str()),
            Some(1.0),
            "a rejected request feeds no health sample"
        );
    }
    // And the pool still serves the model it has.
    let ok = gw.chat(ChatRequest::user("gpt-4o", "hello")).await.unwrap();
    assert!(!ok.content().is_empty());
    let records = sink.records();
    let outcomes: Vec<_> = records.iter().map(|r| r.outcome).collect();
    assert_eq!(&outcomes[..6], ["rejected"; 6]);
    // The records carry what the provider said, whatever the outcome made of it.
    for r in &records[..6] {
        assert_eq!(
            (r.status, r.code.as_deref()),
            (Some(404), Some("model_not_found"))
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_content_filtered_prompt_is_one_attempt_and_its_answer_reaches_the_caller() {
    let filtering = |name: &str| pgw_sim::SourceConfig {
        content_filter_rate: 1.0.into(),
        ..serving(name)
    };
    let pool = pool(vec![filtering("a"), filtering("b"), filtering("c")]);
    let sink = MemorySink::new();
    let gw = gateway(&pool, &sink).await;
    // Before, each was an empty completion retried on every source, and two opened
    // the breakers for all traffic.
    for i in 0..4_u64 {
        let mut req = ChatRequest::user("gpt-4o", format!("filtered {i}"));
        req.stream = i % 2 == 1;
        let a = gw.chat(req).await.unwrap();
        let choice = &a.answer.response.choices[0];
        assert_eq!(choice.finish_reason.as_deref(), Some(FINISH_CONTENT_FILTER));
        assert!(choice.message.content.is_null(), "content stays null");
        assert!(a.answer.response.is_declined());
        assert_eq!(
            received(&pool),
            i + 1,
            "call {i}: one attempt: {:?}",
            sink.records()
        );
    }
    assert_eq!(
        pool.stats()
            .sources
            .values()
            .map(|s| s.content_filtered)
            .sum::<u64>(),
        4
    );
    let states = states(&gw).await;
    assert!(all_closed(&states), "{states:?}");
}

#[tokio::test(start_paused = true)]
async fn a_refusal_is_an_answer_streamed_or_not() {
    let refusing = pgw_sim::SourceConfig {
        refusal_rate: 1.0.into(),
        ..serving("a")
    };
    let pool = pool(vec![refusing, serving("b")]);
    let gw = gateway(&pool, &MemorySink::new()).await;
    for stream in [false, true] {
        let mut req = ChatRequest::user("gpt-4o", "please refuse");
        req.stream = stream;
        // Round robin: one call lands on each source; the refusing one answers too.
        for _ in 0..2 {
            let a = gw.chat(req.clone()).await.unwrap();
            if a.source.as_ref().unwrap().as_str() == "a" {
                let m = &a.answer.response.choices[0].message;
                assert_eq!(m.refusal(), Some("I'm sorry, but I can't help with that."));
                assert!(m.content.is_null());
            }
        }
    }
    assert_eq!(pool.stats().sources["a"].refusals, 2);
    assert_eq!(received(&pool), 4, "no retries");
    assert!(all_closed(&states(&gw).await));
}

#[tokio::test(start_paused = true)]
async fn billing_force_opens_that_source_and_overload_is_transient() {
    let broke = pgw_sim::SourceConfig {
        insufficient_quota_rate: 1.0.into(),
        ..serving("broke")
    };
    let busy = pgw_sim::SourceConfig {
        overloaded_rate: 1.0.into(),
        ..serving("busy")
    };
    let pool = pool(vec![broke, busy, serving("good")]);
    let sink = MemorySink::new();
    let gw = gateway(&pool, &sink).await;
    let a = gw.chat(ChatRequest::user("gpt-4o", "q0")).await.unwrap();
    assert_eq!(a.source.as_ref().unwrap().as_str(), "good");
    let states: std::collections::BTreeMap<_, _> = states(&gw).await.into_iter().collect();
    assert_eq!(
        states["broke"],
        BreakerState::Open,
        "insufficient_quota is SourceDead"
    );
    assert_eq!(
        states["busy"],
        BreakerState::Closed,
        "one 529 is a transient failure"
    );
    assert_eq!(states["good"], BreakerState::Closed);
    for i in 1..3 {
        let a = gw
            .chat(ChatRequest::user("gpt-4o", format!("q{i}")))
            .await
            .unwrap();
        assert_eq!(a.source.as_ref().unwrap().as_str(), "good");
    }
    assert_eq!(
        pool.stats().sources["broke"].insufficient_quota,
        1,
        "once, then not admitted"
    );
    assert!(pool.stats().sources["busy"].overloaded >= 2);
    let outcome_of = |source: &str| {
        sink.records()
            .iter()
            .find(|r| r.source.as_ref().unwrap().as_str() == source)
            .map(|r| r.outcome)
    };
    assert_eq!(outcome_of("broke"), Some("source_dead"));
    assert_eq!(outcome_of("busy"), Some("transient"));
}

/// The handles of the source named `name`.
fn handles<'a>(gw: &'a Gateway, name: &str) -> &'a pgw_stack::SourceHandles {
    gw.sources()
        .iter()
        .find(|h| h.source.as_str() == name)
        .expect("a source of the pool")
}

/// An account out of credit is held for `breaker.quota_hold_s` (default: the breaker's
/// `max_cooldown_s`, 300 s), not for a breaker cooldown (30 s): no attempt reaches it
/// meanwhile though its breaker turned half-open long before, while the other sources
/// serve every call; then one probe asks again and, the account paid up, it serves.
#[tokio::test(start_paused = true)]
async fn insufficient_quota_holds_the_source_long_then_probes_it_once() {
    use pgw_sim::schedule::{Phase, Schedule};
    use std::time::Duration;
    use tokio::time::Instant;

    // Out of credit for the first 200 s, paid up from then on.
    let broke = pgw_sim::SourceConfig {
        insufficient_quota_rate: Schedule::Phases {
            phases: vec![
                Phase {
                    from_s: 0.0,
                    value: 1.0,
                },
                Phase {
                    from_s: 200.0,
                    value: 0.0,
                },
            ],
        },
        ..serving("broke")
    };
    let pool = pool(vec![broke, serving("a"), serving("b")]);
    let sink = MemorySink::new();
    let gw = gateway(&pool, &sink).await;
    let reached = |pool: &SimPool| pool.stats().sources["broke"].received;
    let t0 = Instant::now();
    let hold = Duration::from_secs(300);
    let mut i = 0;
    let call = async |i: &mut u32| {
        *i += 1;
        let a = gw
            .chat(ChatRequest::user("gpt-4o", format!("q{i}")))
            .await
            .unwrap();
        a.source.unwrap().to_string()
    };
    // Round robin offers every source its turn: a call every 5 s for the hold.
    while t0.elapsed() + Duration::from_secs(5) < hold {
        // Paid up from 200 s: only the hold keeps it out after that.
        assert_ne!(call(&mut i).await, "broke", "call {i}");
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    assert_eq!(pool.stats().sources["broke"].insufficient_quota, 1);
    assert_eq!(
        reached(&pool),
        1,
        "held: no attempt reached it after its answer ({:?} in)",
        t0.elapsed()
    );
    let broke = handles(&gw, "broke");
    assert_eq!(
        broke.breaker.view().await.unwrap().state,
        BreakerState::HalfOpen,
        "the breaker alone would have let a probe through after its cooldown"
    );
    let held = broke.limiter.held().await.unwrap();
    assert!(
        held.source
            .hold_ends_in
            .is_some_and(|d| d <= Duration::from_secs(10)),
        "{held:?}"
    );
    let outcomes: Vec<_> = sink
        .records()
        .iter()
        .filter(|r| r.source.as_ref().unwrap().as_str() == "broke")
        .map(|r| r.outcome)
        .collect();
    assert_eq!(outcomes, ["source_dead"]);
    let (a, b) = (
        pool.stats().sources["a"].received,
        pool.stats().sources["b"].received,
    );
    assert_eq!(a + b, u64::from(i), "the others served every call");

    // The hold is over: the next turn of the source is one probe, sent off its
    // caller's path (the caller is served by another source); it succeeds (the
    // account paid up at 200 s) and the source serves again.
    tokio::time::sleep_until(t0 + hold + Duration::from_secs(1)).await;
    let mut served = 0;
    for _ in 0..6 {
        if call(&mut i).await == "broke" {
            served += 1;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    assert_eq!(
        reached(&pool),
        1 + 1 + served,
        "the probe, then every call it served"
    );
    assert!(served >= 1, "probed again after the hold");
    assert_eq!(
        broke.breaker.view().await.unwrap().state,
        BreakerState::Closed,
        "the probe closed it"
    );
}

/// What a provider's `x-ratelimit-remaining-*` headers say is left reaches the
/// attempt's record (and the `pgw_provider_remaining` gauge with it); a provider
/// without them leaves the fields empty.
#[tokio::test(start_paused = true)]
async fn the_providers_remaining_limits_reach_the_attempt_records() {
    let limited = pgw_sim::SourceConfig {
        limits: pgw_sim::HardLimits {
            rpm: Some(10),
            tpm: Some(100_000),
            ..pgw_sim::HardLimits::default()
        }
        .into(),
        ..serving("a")
    };
    let pool = pool(vec![limited, serving("b")]);
    let sink = MemorySink::new();
    let gw = gateway(&pool, &sink).await;
    // Sent together: no time passes between the two calls on `a` for its bucket to
    // refill.
    let calls = (0..4).map(|_| gw.chat(ChatRequest::user("gpt-4o", "hi")));
    for answer in futures_util::future::join_all(calls).await {
        answer.unwrap();
    }
    let records = sink.records();
    let on = |s: &str| -> Vec<_> {
        records
            .iter()
            .filter(|r| r.source.as_ref().is_some_and(|id| id.as_str() == s))
            .map(|r| (r.provider_remaining_requests, r.provider_remaining_tokens))
            .collect()
    };
    // Round robin: two calls each. A full bucket of 10 loses one request per call.
    let mut a = on("a");
    a.sort_unstable();
    assert_eq!(a.len(), 2, "{records:?}");
    assert_eq!((a[0].0, a[1].0), (Some(8), Some(9)), "{a:?}");
    let (t0, t1) = (a[0].1.unwrap(), a[1].1.unwrap());
    assert!(t1 < 100_000 && t0 < t1, "tokens spent: {a:?}");
    assert_eq!(on("b"), vec![(None, None); 2], "no headers, no figures");
}
