//! Shared test helpers: backends, alignment to window starts, a throwaway Redis.
#![allow(dead_code, unreachable_pub)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use pgw_core::redis_conn::{RedisConn, RedisTarget};
use tower_ratelimit_redis::{Backend, MemoryBackend, Quota, RateLimitConfig, RateLimiter, RedisBackend};

/// One backend under test.
pub struct Harness {
    pub backend: Backend,
    pub prefix: String,
    /// Memory under a paused clock: timings are exact.
    pub exact: bool,
}

impl Harness {
    pub fn memory() -> Self {
        Self {
            backend: MemoryBackend::new().into(),
            prefix: "mem".into(),
            exact: true,
        }
    }

    pub async fn redis(target: RedisTarget, name: &str) -> Self {
        let conn = RedisConn::connect(&target).await.expect("connect to test redis");
        Self {
            backend: RedisBackend::new(conn).into(),
            prefix: pgw_test_support::unique_prefix(name),
            exact: false,
        }
    }

    pub fn config(&self, source: &str, quota: Quota) -> RateLimitConfig {
        RateLimitConfig::new(source, quota)
            .key_prefix(self.prefix.clone())
            .window(Duration::from_secs(1))
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

/// A throwaway redis-server on a free loopback port, killed on drop.
pub struct PrivateRedis {
    pub port: u16,
    child: Option<Child>,
}

impl PrivateRedis {
    pub fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed");
        let me = Self {
            port,
            child: Some(child),
        };
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return me;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("private redis-server on port {port} did not start");
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}
