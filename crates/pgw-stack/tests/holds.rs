//! A 429 holds what the provider said was limited: the source alone for a key's own
//! limit, every source of the account only when the provider names the account.

mod support;

use pgw_core::openai::ChatRequest;
use pgw_sim::{AccountConfig, PoolConfig, RateLimitCurve, SimPool};
use pgw_stack::{Gateway, GatewayConfig, MemorySink, SecretKey, SourceConfig};

const KEY: &str = "sk-shared-0123456789";

fn fast(name: &str) -> pgw_sim::SourceConfig {
    pgw_sim::SourceConfig {
        api_key: Some(KEY.into()),
        ttft_s: pgw_sim::LogNormal::constant(0.5).into(),
        error_latency_s: pgw_sim::LogNormal::constant(0.1).into(),
        ..pgw_sim::SourceConfig::healthy(name).in_account("acct")
    }
}

async fn gateway(pool: &SimPool) -> Gateway {
    let mut cfg = GatewayConfig::default();
    cfg.cache.enabled = false;
    cfg.balance.policy = Some("round_robin".into());
    cfg.accounts
        .insert("acct".into(), pgw_stack::config::AccountConfig::default());
    for name in pool.sources() {
        let mut s = SourceConfig::new(
            name.as_str(),
            format!("http://sim.invalid/{name}/v1"),
            SecretKey::new(KEY),
        );
        s.account = Some("acct".into());
        cfg.sources.push(s);
    }
    support::sim_gateway(pool, cfg, &MemorySink::default()).await
}

async fn holds(gw: &Gateway) -> Vec<(String, bool, bool)> {
    let mut out = Vec::new();
    for h in gw.sources() {
        let held = h.limiter.held().await.unwrap();
        out.push((
            h.source.to_string(),
            held.source.hold_ends_in.is_some(),
            held.account.as_ref().is_some_and(|a| a.hold_ends_in.is_some()),
        ));
    }
    out
}

#[tokio::test(start_paused = true)]
async fn a_sources_own_limit_holds_that_source_only() {
    // `a` lets one request a minute through; its 429 says "on source a".
    let gated = pgw_sim::SourceConfig {
        rpm_gate: Some(1).into(),
        ..fast("a")
    };
    let pool = SimPool::new(
        PoolConfig {
            sources: vec![gated, fast("b")],
            bad_prompt_rate: 0.0,
            accounts: vec![AccountConfig {
                name: "acct".into(),
                ..AccountConfig::default()
            }],
            ..PoolConfig::default()
        },
        5,
    )
    .unwrap();
    let gw = gateway(&pool).await;
    for _ in 0..3 {
        gw.chat(ChatRequest::user("m", "hi")).await.unwrap();
    }
    assert!(pool.stats().sources["a"].answered.get(&429).copied().unwrap_or(0) >= 1);
    let h = holds(&gw).await;
    assert!(
        h.contains(&("a".into(), true, false)),
        "a held, its account not: {h:?}"
    );
    assert!(h.contains(&("b".into(), false, false)), "b untouched: {h:?}");
}

#[tokio::test(start_paused = true)]
async fn an_account_limit_holds_every_source_of_the_account() {
    // Every request is 429 "for account acct" with a Retry-After.
    let storm = AccountConfig {
        rate_limit: RateLimitCurve::always().into(),
        retry_after: pgw_sim::RetryAfterConfig {
            rate: 1.0,
            min_s: 5,
            max_s: 5,
        }
        .into(),
        name: "acct".into(),
        ..AccountConfig::default()
    };
    let pool = SimPool::new(
        PoolConfig {
            sources: vec![fast("a"), fast("b")],
            bad_prompt_rate: 0.0,
            accounts: vec![storm],
            ..PoolConfig::default()
        },
        5,
    )
    .unwrap();
    let gw = gateway(&pool).await;
    let call = tokio::spawn({
        let gw = gw.clone();
        async move { gw.chat(ChatRequest::user("m", "hi")).await }
    });
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let h = holds(&gw).await;
    assert!(
        h.iter().all(|(_, _, account)| *account),
        "the account is held: {h:?}"
    );
    call.abort();
}

/// A 429 without `Retry-After` (OpenAI's way: the wait only in its message and its
/// `x-ratelimit-*` headers) holds its source for the wait the provider named, not for
/// a guessed backoff of half a second.
#[tokio::test(start_paused = true)]
async fn a_429_without_retry_after_holds_for_the_wait_its_message_names() {
    // `a` takes one request a minute and answers the second 429 "Please try again in
    // 5X.XXXs." with no Retry-After.
    let limited = pgw_sim::SourceConfig {
        limits: pgw_sim::HardLimits {
            rpm: Some(1),
            ..pgw_sim::HardLimits::default()
        }
        .into(),
        limit_retry_after: false,
        ..pgw_sim::SourceConfig {
            account: None,
            ..fast("a")
        }
    };
    let mut b = fast("b");
    b.account = None;
    let pool = SimPool::new(
        PoolConfig {
            sources: vec![limited, b],
            bad_prompt_rate: 0.0,
            ..PoolConfig::default()
        },
        5,
    )
    .unwrap();
    let mut cfg = GatewayConfig::default();
    cfg.cache.enabled = false;
    cfg.balance.policy = Some("round_robin".into());
    for name in pool.sources() {
        cfg.sources.push(SourceConfig::new(
            name.as_str(),
            format!("http://sim.invalid/{name}/v1"),
            SecretKey::new(KEY),
        ));
    }
    let sink = MemorySink::default();
    let gw = support::sim_gateway(&pool, cfg, &sink).await;
    let start = tokio::time::Instant::now();
    for _ in 0..3 {
        gw.chat(ChatRequest::user("m", "hi")).await.unwrap();
    }
    let stats = pool.stats();
    assert_eq!(
        stats.sources["a"].answered.get(&429).copied(),
        Some(1),
        "{stats:?}"
    );
    let a = gw.sources().iter().find(|h| h.source.as_str() == "a").unwrap();
    let held = a.limiter.held().await.unwrap().source.hold_ends_in;
    // The bucket refills its one request a minute after the first was taken (at the
    // start): the hold ends then, to the millisecond the message names.
    let ends = held.map(|d| (start.elapsed() + d).as_secs_f64());
    assert!(
        ends.is_some_and(|s| (59.9..=60.01).contains(&s)),
        "held until the named end, a minute after the start: {ends:?} s"
    );
    // The refusal's record says what its headers said: nothing left.
    let refused: Vec<_> = sink
        .records()
        .into_iter()
        .filter(|r| r.outcome == "rate_limited")
        .map(|r| r.provider_remaining_requests)
        .collect();
    assert_eq!(refused, [Some(0)]);
}
