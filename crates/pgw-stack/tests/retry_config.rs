//! The retry budget and adaptive throttling, turned on from `GatewayConfig` and seen
//! through the gateway against the simulator on tokio's paused clock.

mod support;

use pgw_core::BoxError;
use pgw_core::openai::ChatRequest;
use pgw_sim::{PoolConfig, SimPool};
use pgw_stack::retry::Reason;
use pgw_stack::{Gateway, GatewayConfig, GatewayError, MemorySink, SecretKey, SourceConfig};
use tokio::time::Instant;

/// A pool of one source that answers every request with a 5xx.
fn failing_pool() -> SimPool {
    let broken = pgw_sim::SourceConfig {
        server_error_rate: 1.0.into(),
        error_latency_s: pgw_sim::LogNormal::constant(0.1).into(),
        ..pgw_sim::SourceConfig::healthy("down")
    };
    let config = PoolConfig::of(vec![broken]);
    SimPool::new(config, 3).unwrap()
}

async fn gateway(pool: &SimPool, toml: &str) -> Gateway {
    let text = format!(
        "{toml}\n[cache]\nenabled = false\n[breaker]\nfail_threshold = 1000\nmin_calls = 1000000\n[[sources]]\nname = \"down\"\nbase_url = \"http://sim.invalid/v1\"\nkey = \"sk-x\"\n"
    );
    let cfg = GatewayConfig::from_toml_str(&text).unwrap();
    support::sim_gateway(pool, cfg, &pgw_stack::MemorySink::default()).await
}

fn reason(err: &BoxError) -> Reason {
    err.downcast_ref::<GatewayError>()
        .and_then(GatewayError::last_retry_error)
        .map(pgw_stack::retry::RetryError::reason)
        .expect("a retry verdict")
}

fn received(pool: &SimPool) -> u64 {
    pool.stats().sources["down"].received
}

#[tokio::test(start_paused = true)]
async fn a_retry_budget_from_config_stops_the_retries() {
    // Without a budget, each call spends its three attempts.
    let pool = failing_pool();
    let gw = gateway(&pool, "[retry]\nmax_attempts = 3").await;
    for i in 0..4 {
        let e = gw
            .chat(ChatRequest::user("m", format!("q{i}")))
            .await
            .unwrap_err();
        assert_eq!(reason(&e), Reason::BudgetExhausted);
    }
    assert_eq!(received(&pool), 12);

    // A budget of no retries at all: one attempt per call.
    let pool = failing_pool();
    let gw = gateway(
        &pool,
        "[retry]\nmax_attempts = 3\n[retry.budget]\nratio = 0.0\nmin_retries_per_sec = 0",
    )
    .await;
    for i in 0..4 {
        let e = gw
            .chat(ChatRequest::user("m", format!("q{i}")))
            .await
            .unwrap_err();
        assert_eq!(reason(&e), Reason::RetryBudgetExhausted);
    }
    assert_eq!(received(&pool), 4);
}

#[tokio::test(start_paused = true)]
async fn adaptive_throttling_from_config_rejects_locally() {
    let calls = 60;
    let run = |toml: &'static str| async move {
        let pool = failing_pool();
        let gw = gateway(&pool, toml).await;
        let mut throttled = 0;
        for i in 0..calls {
            let e = gw
                .chat(ChatRequest::user("m", format!("q{i}")))
                .await
                .unwrap_err();
            if reason(&e) == Reason::Throttled {
                throttled += 1;
            }
        }
        (received(&pool), throttled)
    };
    let (sent, throttled) = run("[retry]\nmax_attempts = 1").await;
    assert_eq!((sent, throttled), (calls, 0));
    let (sent, throttled) = run("[retry]\nmax_attempts = 1\n[retry.throttle]\nk = 1.0\nwindow_s = 600").await;
    assert!(throttled > calls / 2, "{throttled} of {calls} throttled");
    assert_eq!(sent + throttled, calls, "a throttled call reaches no source");
}

#[test]
fn budget_and_throttle_errors_name_the_field() {
    let base = "[[sources]]\nname = \"s\"\nbase_url = \"http://127.0.0.1:9/v1\"\nkey = \"sk-x\"\n";
    for (extra, field) in [
        ("[retry.budget]\nratio = 1.5", "retry.budget.ratio"),
        ("[retry.budget]\nttl_s = -1", "retry.budget.ttl_s"),
        ("[retry.budget]\nttl_s = 0.5", "retry.budget.ttl_s"),
        ("[retry.throttle]\nk = 0.5", "retry.throttle.k"),
        ("[retry.throttle]\nwindow_s = 1e9", "retry.throttle.window_s"),
        ("[retry.throttle]\nkk = 2", "retry.throttle.kk"),
    ] {
        let err = config_error_of(&format!("{base}{extra}"));
        assert_eq!(err.field(), field, "{extra}: {err}");
    }
}

/// `retry.max_pushback_wait_s` bounds a group's wait on persistent 429s (every
/// answer a 429 without Retry-After, the source held for each backoff): after about
/// 10 s of them the call ends with `pushback_exhausted`. With a fallback group, the
/// call does not wait at all (R3): held after its first 429, the primary refuses it
/// and the backup answers at once.
#[tokio::test(start_paused = true)]
async fn the_pushback_bound_from_config_ends_persistent_429s_and_a_fallback_takes_them_at_once() {
    let storm = pgw_sim::AccountConfig {
        name: "acct".into(),
        rate_limit: pgw_sim::RateLimitCurve::always().into(),
        retry_after: pgw_sim::RetryAfterConfig {
            rate: 0.0,
            ..pgw_sim::RetryAfterConfig::default()
        }
        .into(),
        ..pgw_sim::AccountConfig::default()
    };
    let pool = SimPool::new(
        PoolConfig {
            accounts: vec![storm],
            ..PoolConfig::of(vec![
                pgw_sim::SourceConfig::quick("p").in_account("acct"),
                pgw_sim::SourceConfig::quick("b"),
            ])
        },
        3,
    )
    .unwrap();
    let config = |groups: &[(&str, &str)]| {
        let mut cfg = GatewayConfig::default();
        cfg.cache.enabled = false;
        cfg.retry.max_pushback_wait_s = Some(10.0);
        for (name, group) in groups {
            let s = SourceConfig::new(
                *name,
                format!("http://sim.invalid/{name}/v1"),
                SecretKey::new("sk-x"),
            );
            cfg.sources.push(s.group(*group));
        }
        cfg
    };

    // The primary alone: the bound ends the call.
    let sink = MemorySink::default();
    let gw = support::sim_gateway(&pool, config(&[("p", "primary")]), &sink).await;
    let t0 = Instant::now();
    let err = gw.chat(ChatRequest::user("m", "pushed back")).await.unwrap_err();
    let took = t0.elapsed();
    assert!(matches!(reason(&err), Reason::PushbackExhausted { .. }), "{err}");
    let records = sink.records();
    assert!(records.len() >= 4, "{records:?}");
    assert!(records.iter().all(|r| r.outcome == "rate_limited"), "{records:?}");
    // About the bound: at least 10 s of backoffs, at most one more backoff (20 s).
    assert!(took >= std::time::Duration::from_secs(10), "{took:?}");
    assert!(took <= std::time::Duration::from_secs(31), "{took:?}");

    // With a backup: one 429, and the backup answers without a wait.
    let sink = MemorySink::default();
    let gw = support::sim_gateway(&pool, config(&[("p", "primary"), ("b", "backup")]), &sink).await;
    let t0 = Instant::now();
    let answer = gw
        .chat(ChatRequest::user("m", "pushed back again"))
        .await
        .unwrap();
    assert_eq!(answer.group, "backup");
    let records = sink.records();
    let primary: Vec<_> = records.iter().filter(|r| r.group == "primary").collect();
    assert_eq!(primary.len(), 1, "{primary:?}");
    assert_eq!(primary[0].outcome, "rate_limited");
    let backup = records.iter().find(|r| r.group == "backup").unwrap();
    let answer_time = std::time::Duration::from_secs_f64(backup.latency_ms / 1000.0);
    assert!(
        t0.elapsed() <= answer_time + std::time::Duration::from_secs(2),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(pool.stats().sources["b"].received, 1);
}

#[test]
fn a_bad_pushback_bound_names_its_field() {
    let base = "[[sources]]\nname = \"s\"\nbase_url = \"http://127.0.0.1:9/v1\"\nkey = \"sk-x\"\n";
    for value in ["0", "-1"] {
        let err = config_error_of(&format!("{base}[retry]\nmax_pushback_wait_s = {value}"));
        assert_eq!(err.field(), "retry.max_pushback_wait_s", "{value}: {err}");
    }
}

/// The configuration error of `text`: from parsing, or else from building the gateway
/// (caught when the layers are configured: the crates' own ranges).
fn config_error_of(text: &str) -> pgw_stack::ConfigError {
    match GatewayConfig::from_toml_str(text) {
        Err(e) => e,
        Ok(cfg) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let err = rt.block_on(Gateway::from_config(cfg)).unwrap_err();
            err.downcast::<pgw_stack::ConfigError>().map(|e| *e).unwrap()
        }
    }
}
