//! The Redis connection shared by the breaker and limiter backends (feature `redis`).
//!
//! One multiplexed connection per process (cheap to clone, reconnects by itself), to a
//! standalone server or a cluster, behind one type so backends are written once.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::error::BackendUnavailable;

/// How long one Redis operation may take before it counts as unreachable: 500 ms.
///
/// A loopback round trip is ~70 us; a gate that waits longer than this costs the
/// caller more than refusing and trying another source.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_millis(500);

/// How long a connection made by [`RedisConn::connect`] waits for an answer: 10 s.
///
/// Longer than any operation's own timeout ([`DEFAULT_RESPONSE_TIMEOUT`], applied by
/// [`run`]): an operation that gave up may still have run on the server (queued
/// behind a slow one), and its late answer can still be read and acted on (the
/// limiter undoes an admission answered after its caller's timeout).
pub const LATE_ANSWER_WAIT: Duration = Duration::from_secs(10);

/// How long connecting may take: 2 s.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the shared state lives.
#[derive(Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// A standalone server, `redis://host:port[/db]`.
    Standalone(String),
    /// The seed nodes of a Redis Cluster.
    Cluster(Vec<String>),
}

impl RedisTarget {
    /// Parses `redis://host:port` (standalone) or
    /// `redis+cluster://host1:port1,host2:port2,...` (cluster).
    ///
    /// ```
    /// use pgw_core::redis_conn::RedisTarget;
    /// assert_eq!(
    ///     RedisTarget::parse("redis+cluster://127.0.0.1:7000,127.0.0.1:7001").unwrap(),
    ///     RedisTarget::Cluster(vec!["redis://127.0.0.1:7000".into(), "redis://127.0.0.1:7001".into()])
    /// );
    /// assert!(RedisTarget::parse("http://x").is_err());
    /// // Not a URL: its password is not repeated in the error.
    /// for bad in ["cache.test:6380,password=hunter2,ssl=True", "h,password=hunter2", "hunter2"] {
    ///     let err = RedisTarget::parse(bad).unwrap_err();
    ///     assert!(!err.contains("hunter2"), "{err}");
    /// }
    /// ```
    ///
    /// # Errors
    /// A message naming the scheme expected when the URL has none of them (the URL's
    /// text up to its first `:` only).
    pub fn parse(url: &str) -> Result<Self, String> {
        if let Some(rest) = url.strip_prefix("redis+cluster://") {
            let nodes: Vec<String> = rest
                .split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(|n| format!("redis://{n}"))
                .collect();
            if nodes.is_empty() {
                return Err(format!("redis cluster url {url:?} names no node"));
            }
            Ok(Self::Cluster(nodes))
        } else if url.starts_with("redis://") || url.starts_with("rediss://") || url.starts_with("unix://") {
            Ok(Self::Standalone(url.to_owned()))
        } else {
            // Not a URL: only what comes before its first `:` (or `,` `;` `@` `/` `=`
            // `?`) is shown, since a password may be anywhere after it
            // (`host:6380,password=...,ssl=True`, the connection-string form of other
            // clients, or a mistyped scheme); a value with none of them may be the
            // password itself, and is not shown at all.
            let shown = match url.find([':', ',', ';', '@', '/', '=', '?']) {
                Some(i) => format!(
                    "starting {:?}; the rest",
                    url[..i].chars().take(40).collect::<String>()
                ),
                None => "its value".to_owned(),
            };
            Err(format!(
                "redis url ({shown} not shown) must start with redis://, rediss://, unix:// or redis+cluster://"
            ))
        }
    }
}

/// Hides a password in a Redis URL: the user info (`redis://:secret@host` ->
/// `redis://***@host`) and a `pass` or `password` query parameter, which is how a
/// `unix://` URL carries one (`unix:///run/redis.sock?pass=secret` ->
/// `unix:///run/redis.sock?pass=***`).
///
/// ```
/// use pgw_core::redis_conn::redact_url;
///
/// assert_eq!(redact_url("redis://:hunter2@127.0.0.1:6379/0"), "redis://***@127.0.0.1:6379/0");
/// assert_eq!(
///     redact_url("unix:///run/redis.sock?db=1&pass=hunter2"),
///     "unix:///run/redis.sock?db=1&pass=***"
/// );
/// ```
#[must_use]
pub fn redact_url(url: &str) -> String {
    crate::redact::redact_url_with(url, |k| {
        k.eq_ignore_ascii_case("pass") || k.eq_ignore_ascii_case("password")
    })
}

impl fmt::Debug for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Standalone(u) => f.debug_tuple("Standalone").field(&redact_url(u)).finish(),
            Self::Cluster(n) => f
                .debug_tuple("Cluster")
                .field(&n.iter().map(|u| redact_url(u)).collect::<Vec<_>>())
                .finish(),
        }
    }
}

impl fmt::Display for RedisTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Standalone(u) => f.write_str(&redact_url(u)),
            Self::Cluster(n) => write!(
                f,
                "cluster {}",
                n.iter().map(|u| redact_url(u)).collect::<Vec<_>>().join(",")
            ),
        }
    }
}

/// A connection to a standalone server or a cluster; clone it freely (clones share one
/// multiplexed connection).
#[derive(Clone)]
pub enum RedisConn {
    /// A standalone server through a reconnecting multiplexed connection.
    Standalone(ConnectionManager),
    /// A cluster (commands routed by key slot).
    Cluster(ClusterConnection),
}

impl fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Standalone(_) => "RedisConn::Standalone",
            Self::Cluster(_) => "RedisConn::Cluster",
        })
    }
}

impl RedisConn {
    /// Connects with [`DEFAULT_CONNECT_TIMEOUT`]; the connection waits up to
    /// [`LATE_ANSWER_WAIT`] for an answer (operations bound their own waits, by
    /// default to [`DEFAULT_RESPONSE_TIMEOUT`]).
    ///
    /// # Errors
    /// [`BackendUnavailable`] naming the (redacted) address when the server cannot be
    /// reached.
    pub async fn connect(target: &RedisTarget) -> Result<Self, BackendUnavailable> {
        Self::connect_with(target, DEFAULT_CONNECT_TIMEOUT, LATE_ANSWER_WAIT).await
    }

    /// Connects with explicit timeouts.
    ///
    /// # Errors
    /// As [`RedisConn::connect`].
    pub async fn connect_with(
        target: &RedisTarget,
        connect_timeout: Duration,
        response_timeout: Duration,
    ) -> Result<Self, BackendUnavailable> {
        let fail =
            |e: redis::RedisError| BackendUnavailable::new("redis", "connect", format!("{target}: {e}"));
        match target {
            RedisTarget::Standalone(url) => {
                let client = redis::Client::open(url.as_str()).map_err(fail)?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(connect_timeout))
                    .set_response_timeout(Some(response_timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(200));
                let fut = ConnectionManager::new_with_config(client, config);
                match tokio::time::timeout(
                    connect_timeout.saturating_add(response_timeout.min(connect_timeout)),
                    fut,
                )
                .await
                {
                    Ok(r) => r.map(Self::Standalone).map_err(fail),
                    Err(_) => Err(BackendUnavailable::new(
                        "redis",
                        "connect",
                        format!("{target}: timed out after {connect_timeout:?}"),
                    )),
                }
            }
            RedisTarget::Cluster(nodes) => {
                let client = ClusterClientBuilder::new(nodes.clone())
                    .connection_timeout(connect_timeout)
                    .response_timeout(response_timeout)
                    .retries(1)
                    .build()
                    .map_err(fail)?;
                let fut = client.get_async_connection();
                match tokio::time::timeout(
                    connect_timeout.saturating_add(response_timeout.min(connect_timeout)),
                    fut,
                )
                .await
                {
                    Ok(r) => r.map(Self::Cluster).map_err(fail),
                    Err(_) => Err(BackendUnavailable::new(
                        "redis",
                        "connect",
                        format!("{target}: timed out after {connect_timeout:?}"),
                    )),
                }
            }
        }
    }

    /// Whether this is a cluster connection.
    #[must_use]
    pub const fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }
}

/// Requests this process has sent to Redis through every [`RedisConn`]: see
/// [`round_trips`].
static ROUND_TRIPS: AtomicU64 = AtomicU64::new(0);

/// How many requests this process has sent to Redis through any [`RedisConn`] since it
/// started: one per command and one per pipeline (a script's `EVALSHA` is one, however
/// many commands the script runs on the server; a script the server did not know yet
/// costs the `SCRIPT LOAD` and the second `EVALSHA` too). It counts requests as they are
/// handed to the connection, one that then fails included; what the client does on its
/// own (a cluster's redirects and retries, a reconnect's handshake) is not counted, and a
/// cluster pipeline spanning several nodes counts once.
///
/// A process-wide counter, for measuring what a workload costs in round trips: read it
/// before and after.
///
/// ```
/// let before = pgw_core::redis_conn::round_trips();
/// // ... calls through a gateway on the Redis backend ...
/// let sent = pgw_core::redis_conn::round_trips() - before;
/// # assert_eq!(sent, 0);
/// ```
#[must_use]
pub fn round_trips() -> u64 {
    ROUND_TRIPS.load(Ordering::Relaxed)
}

/// Commands this process has sent to Redis through every [`RedisConn`]: see
/// [`commands_sent`].
static COMMANDS_SENT: AtomicU64 = AtomicU64::new(0);

/// How many commands this process has sent to Redis through any [`RedisConn`] since it
/// started: as [`round_trips`], but a pipeline counts its commands, not once. A
/// script's `EVALSHA` is one command here, however many commands the script runs on
/// the server; the server's own count (`INFO commandstats`) includes those.
///
/// ```
/// let before = pgw_core::redis_conn::commands_sent();
/// // ... calls through a gateway on the Redis backend ...
/// let sent = pgw_core::redis_conn::commands_sent() - before;
/// # assert_eq!(sent, 0);
/// ```
#[must_use]
pub fn commands_sent() -> u64 {
    COMMANDS_SENT.load(Ordering::Relaxed)
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        ROUND_TRIPS.fetch_add(1, Ordering::Relaxed);
        COMMANDS_SENT.fetch_add(1, Ordering::Relaxed);
        match self {
            Self::Standalone(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        ROUND_TRIPS.fetch_add(1, Ordering::Relaxed);
        COMMANDS_SENT.fetch_add(pipeline.len() as u64, Ordering::Relaxed);
        match self {
            Self::Standalone(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Standalone(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// Runs one Redis operation under `timeout`, mapping every failure (server error,
/// dropped connection, timeout) to [`BackendUnavailable`] for `operation`.
///
/// # Errors
/// [`BackendUnavailable`] on any failure.
pub async fn run<T, F>(operation: &'static str, timeout: Duration, fut: F) -> Result<T, BackendUnavailable>
where
    F: std::future::Future<Output = redis::RedisResult<T>>,
{
    match tokio::time::timeout(timeout, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(BackendUnavailable::new("redis", operation, e)),
        Err(_) => Err(BackendUnavailable::new(
            "redis",
            operation,
            format!("no answer within {timeout:?}"),
        )),
    }
}

/// A per-process random nonce, so ids a process writes into shared state (the
/// limiter's leases, the breaker's probe claims) never collide with another process's.
static NONCE: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
});

/// `id` made unique across processes: `NONCE:id` in hex, where the nonce is random per
/// process. Ids a process hands out once each (a counter) stay unique in Redis.
#[must_use]
pub fn unique_id(id: u64) -> String {
    format!("{:x}:{id:x}", *NONCE)
}

/// The hash-tagged key prefix of one scope, so every key of a source (or an account)
/// lives in one cluster slot: `{prefix}:{scope}` becomes `prefix:{scope}:`.
#[must_use]
pub fn scope_key(prefix: &str, scope: &str) -> String {
    format!("{prefix}:{{{scope}}}:")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_hides_passwords() {
        assert_eq!(
            redact_url("redis://:hunter2@127.0.0.1:6379"),
            "redis://***@127.0.0.1:6379"
        );
        let t = RedisTarget::parse("redis://user:hunter2@h:1/0").unwrap();
        assert!(!format!("{t:?} {t}").contains("hunter2"));
        // A unix socket's password is a query parameter (it was printed whole).
        let t = RedisTarget::parse("unix:///run/redis.sock?db=2&PASS=hunter2&user=u").unwrap();
        assert!(!format!("{t:?} {t}").contains("hunter2"), "{t:?} {t}");
        assert!(format!("{t}").contains("db=2"), "{t}");
        let t = RedisTarget::parse("redis://:hun?ter2@h:1/0?password=hunter3").unwrap();
        assert!(!format!("{t:?} {t}").contains("ter2"), "{t:?}");
        assert!(!format!("{t:?} {t}").contains("hunter3"), "{t:?}");
        assert!(RedisTarget::parse("redis+cluster://").is_err());
        assert_eq!(scope_key("pgw:brk", "s1"), "pgw:brk:{s1}:");
    }

    #[tokio::test]
    async fn unreachable_server_is_a_clear_error() {
        let target = RedisTarget::Standalone("redis://127.0.0.1:1".into());
        let err = RedisConn::connect_with(&target, Duration::from_millis(200), Duration::from_millis(200))
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("127.0.0.1:1") && msg.contains("connect"), "{msg}");
    }
}
