//! Shared by the integration tests: one environment per backend, so one set of cases
//! runs on memory (paused clock) and on Redis (real server, small durations).
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::time::Duration;

use pgw_core::redis_conn::{RedisConn, RedisTarget};
use pgw_core::{BreakerVerdict, Outcome, SourceId};
use tower_breaker_window::{
    Admission, Backend, BreakerConfig, BreakerConfigBuilder, BreakerView, Gate, MemoryBackend, RedisBackend,
    Ticket,
};

/// A backend plus how time behaves on it.
pub trait Env {
    type B: Backend;
    fn backend(&self) -> &Self::B;
    /// The time unit of the cases: 1 s on the paused clock, a few hundred ms on Redis.
    fn unit(&self) -> Duration;
    /// How far a measured duration may fall short of the expected one (0 on memory).
    fn slack(&self) -> Duration;
    /// Added to sleeps that must cross a deadline (0 on memory: boundaries are exact).
    fn margin(&self) -> Duration;

    fn gate(&self, source: &str, config: &BreakerConfig) -> <Self::B as Backend>::Gate {
        self.backend().gate(&SourceId::from(source), config)
    }

    fn units(&self, n: u32) -> Duration {
        self.unit() * n
    }

    /// Sleeps `d` plus the margin.
    async fn pass(&self, d: Duration) {
        tokio::time::sleep(d + self.margin()).await;
    }

    fn assert_near(&self, actual: Duration, expected: Duration, what: &str) {
        assert!(
            actual <= expected && actual + self.slack() >= expected,
            "{what}: {actual:?} not within {:?} below {expected:?}",
            self.slack()
        );
    }
}

pub struct MemEnv(MemoryBackend);

impl MemEnv {
    pub fn new() -> Self {
        Self(MemoryBackend::new())
    }
}

impl Env for MemEnv {
    type B = MemoryBackend;
    fn backend(&self) -> &MemoryBackend {
        &self.0
    }
    fn unit(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn slack(&self) -> Duration {
        Duration::ZERO
    }
    fn margin(&self) -> Duration {
        Duration::ZERO
    }
}

pub struct RedisEnv {
    pub backend: RedisBackend,
    pub target: RedisTarget,
    pub prefix: String,
}

pub const REDIS_UNIT: Duration = Duration::from_millis(300);

impl RedisEnv {
    pub async fn standalone(test: &str) -> Self {
        let url = pgw_test_support::redis_url().expect("REDIS_URL");
        Self::on(RedisTarget::Standalone(url), test).await
    }

    pub async fn cluster(test: &str) -> Self {
        let nodes = pgw_test_support::redis_cluster_nodes().expect("REDIS_CLUSTER_NODES");
        Self::on(RedisTarget::Cluster(nodes), test).await
    }

    pub async fn on(target: RedisTarget, test: &str) -> Self {
        let conn = RedisConn::connect(&target)
            .await
            .expect("connect to the test redis");
        let prefix = pgw_test_support::unique_prefix(test);
        Self {
            // Every outcome sent as it is recorded: the cases read the state after each
            // one (deferred successes have tests of their own in redis_ops.rs).
            backend: RedisBackend::new(conn)
                .with_prefix(prefix.clone())
                .with_deferred_successes(false),
            target,
            prefix,
        }
    }

    /// A second, independent connection on the same state: another process.
    pub async fn other_process(&self) -> RedisBackend {
        let conn = RedisConn::connect(&self.target).await.expect("second connection");
        RedisBackend::new(conn)
            .with_prefix(self.prefix.clone())
            .with_deferred_successes(false)
    }
}

impl Env for RedisEnv {
    type B = RedisBackend;
    fn backend(&self) -> &RedisBackend {
        &self.backend
    }
    fn unit(&self) -> Duration {
        REDIS_UNIT
    }
    fn slack(&self) -> Duration {
        REDIS_UNIT / 2
    }
    fn margin(&self) -> Duration {
        REDIS_UNIT / 6
    }
}

/// A builder with a threshold and cooldown set, for the cases to adjust.
pub fn cfg(env: &impl Env, threshold: u32) -> BreakerConfigBuilder {
    BreakerConfig::builder()
        .fail_threshold(threshold)
        .cooldown(env.unit())
}

pub async fn admit<G: Gate>(g: &G) -> Ticket {
    match g.admit().await.expect("backend answers") {
        Admission::Admitted(t) => t,
        r @ Admission::Refused { .. } => panic!("expected an admission, got {r:?}"),
    }
}

pub async fn refused<G: Gate>(g: &G) -> Duration {
    match g.admit().await.expect("backend answers") {
        Admission::Refused { retry_after } => retry_after,
        Admission::Admitted(t) => panic!("expected a refusal, got {t:?}"),
    }
}

/// One closed-state call with `outcome`, admitted and recorded.
pub async fn call<G: Gate>(g: &G, outcome: Outcome) {
    let t = admit(g).await;
    assert!(!t.is_probe(), "a closed-state call must not be a probe");
    g.record(t, outcome.breaker_verdict()).await;
}

pub async fn calls<G: Gate>(g: &G, outcome: Outcome, n: u32) {
    for _ in 0..n {
        call(g, outcome).await;
    }
}

pub async fn view<G: Gate>(g: &G) -> BreakerView {
    g.view().await.expect("view")
}

/// The view without its time-dependent part, for before/after comparisons.
pub async fn still<G: Gate>(g: &G) -> BreakerView {
    let mut v = view(g).await;
    v.retry_after = Duration::ZERO;
    v
}

pub const S: Outcome = Outcome::Success;
pub const F: Outcome = Outcome::Transient;
pub const RL: Outcome = Outcome::RateLimited { retry_after: None };

pub fn verdict(o: Outcome) -> BreakerVerdict {
    o.breaker_verdict()
}
