//! Shared test helpers: backends, alignment to window starts.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use pgw_core::redis_conn::{RedisConn, RedisTarget};
use tower_ratelimit_redis::{Backend, MemoryBackend, Quota, RateLimitConfig, RateLimiter, RedisBackend};

/// One backend under test.
pub struct Harness {
    pub backend: Backend,
    pub prefix: String,
    /// Memory under a paused clock: timings are exact.
    pub exact: bool,
    /// Redis: the connection, for a backend of another process.
    pub conn: Option<RedisConn>,
}

impl Harness {
    pub fn memory() -> Self {
        Self {
            backend: MemoryBackend::new().into(),
            prefix: "mem".into(),
            exact: true,
            conn: None,
        }
    }

    pub async fn redis(target: RedisTarget, name: &str) -> Self {
        let conn = RedisConn::connect(&target).await.expect("connect to test redis");
        Self {
            backend: RedisBackend::new(conn.clone()).into(),
            prefix: pgw_test_support::unique_prefix(name),
            exact: false,
            conn: Some(conn),
        }
    }

    pub fn config(&self, source: &str, quota: Quota) -> RateLimitConfig {
        RateLimitConfig::new(source, quota)
            .key_prefix(self.prefix.clone())
            .window(Duration::from_secs(1))
    }

    /// On Redis, a limiter as another process has it: same keys, a backend of its own
    /// (no shared cache of holds, no remembered refusals). `None` on memory.
    pub fn other_process(&self, config: RateLimitConfig) -> Option<RateLimiter> {
        let conn = self.conn.clone()?;
        Some(RateLimiter::new(config.key_prefix(self.prefix.clone()), RedisBackend::new(conn)).unwrap())
    }

    pub fn limiter(&self, config: RateLimitConfig) -> RateLimiter {
        RateLimiter::new(config.key_prefix(self.prefix.clone()), self.backend.clone()).unwrap()
    }

    /// Waits until just after the start of the next window of `window` on the
    /// backend's clock, so a test's steps fall in one window.
    pub async fn align(&self, window: Duration) {
        let scratch = self.limiter(RateLimitConfig::new("__clock", Quota::unlimited()).window(window));
        let p = scratch.acquire(0).await.unwrap();
        let wait = p.admission().window_end() - p.admission().at();
        p.finish(None).await.unwrap();
        let margin = if self.exact {
            Duration::ZERO
        } else {
            Duration::from_millis(5)
        };
        tokio::time::sleep(wait + margin).await;
    }
}

pub fn standalone() -> RedisTarget {
    RedisTarget::Standalone(pgw_test_support::redis_url().expect("REDIS_URL"))
}

pub fn cluster() -> RedisTarget {
    RedisTarget::Cluster(pgw_test_support::redis_cluster_nodes().expect("REDIS_CLUSTER_NODES"))
}
