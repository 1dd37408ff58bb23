//! The response cache: asked before every gate, so a hit never reaches the
//! limiter or the upstream. Memory (size-bounded, TTL on the tokio clock) or Redis.
//!
//! What is cached (the gateway decides, see `[cache]` in the crate's README): by
//! default only deterministic requests (`temperature: 0` or a fixed `seed`); never a
//! call carrying [`NoCache`]; an answer of a fallback group only for
//! `cache.fallback_ttl_s`, so it is not served past the primary's recovery.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use pgw_core::SourceId;
use pgw_core::openai::{ChatChunk, ChatRequest, ChatResponse};
use pgw_core::redis_conn::RedisConn;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::time::Instant;

/// The key of a request: the first 128 bits of a SHA-256 over a canonical JSON form of
/// its model, messages, `max_tokens` and every other field but `stream` (a streamed
/// and a plain call share answers: each replays as the other), and the route the
/// gateway would send it on. Stable across processes, builds and Rust releases, so a
/// Redis cache shared by several gateways keeps hitting after an upgrade.
///
/// ```
/// use pgw_stack::CacheKey;
/// use pgw_stack::core::openai::ChatRequest;
///
/// let a = CacheKey::of(&ChatRequest::user("gpt-4o", "hello"));
/// let mut streamed = ChatRequest::user("gpt-4o", "hello");
/// streamed.stream = true;
/// assert_eq!(a, CacheKey::of(&streamed));
/// assert_ne!(a, CacheKey::for_route(&ChatRequest::user("gpt-4o", "hello"), "default=s1"));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey(pub u128);

impl CacheKey {
    /// The key of `req` on no particular route.
    #[must_use]
    pub fn of(req: &ChatRequest) -> Self {
        Self::for_route(req, "")
    }

    /// The key of `req` sent on `route` (the gateway's description of where the call
    /// goes: groups, sources and upstream models), so an answer is never served for a
    /// request that would now be routed elsewhere.
    #[must_use]
    pub fn for_route(req: &ChatRequest, route: &str) -> Self {
        Self::in_partition(req, route, None)
    }

    /// The key of `req` sent on `route` in the cache's `partition` (see
    /// [`CachePartition`]): `None` is [`for_route`](Self::for_route)'s key, unchanged.
    ///
    /// ```
    /// use pgw_stack::CacheKey;
    /// use pgw_stack::core::openai::ChatRequest;
    ///
    /// let req = ChatRequest::user("gpt-4o", "hello");
    /// assert_eq!(CacheKey::in_partition(&req, "r", None), CacheKey::for_route(&req, "r"));
    /// assert_ne!(CacheKey::in_partition(&req, "r", Some("team-a")), CacheKey::for_route(&req, "r"));
    /// ```
    #[must_use]
    pub fn in_partition(req: &ChatRequest, route: &str, partition: Option<&str>) -> Self {
        #[derive(Serialize)]
        struct Canon<'a> {
            route: &'a str,
            model: &'a str,
            messages: &'a [pgw_core::openai::ChatMessage],
            max_tokens: Option<u64>,
            extra: &'a serde_json::Map<String, serde_json::Value>,
            // Last and left out when absent: the keys of unpartitioned calls are
            // the same bytes as before partitions existed.
            #[serde(skip_serializing_if = "Option::is_none")]
            partition: Option<&'a str>,
        }
        // serde_json keeps each object's keys in the order the caller wrote them
        // (`preserve_order`: a JSON schema's field order is what a model fills in
        // first), so a request with its keys in another order is another key.
        let bytes = serde_json::to_vec(&Canon {
            route,
            model: &req.model,
            messages: &req.messages,
            max_tokens: req.max_tokens,
            extra: &req.extra,
            partition,
        })
        .unwrap_or_default();
        let digest = Sha256::digest(&bytes);
        let mut first = [0u8; 16];
        first.copy_from_slice(&digest[..16]);
        Self(u128::from_be_bytes(first))
    }

    fn hex(self) -> String {
        format!("{:032x}", self.0)
    }
}

/// A call carrying this extension neither reads nor fills the response cache (a chat
/// UI's "regenerate"; pgw-server can map a request header to it).
///
/// ```
/// use pgw_stack::{ChatCall, NoCache};
/// use pgw_stack::core::openai::ChatRequest;
///
/// let mut call = ChatCall::new(ChatRequest::user("gpt-4o", "hello"));
/// call.extensions_mut().insert(NoCache);
/// // gateway.clone().oneshot(call).await
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoCache;

/// A call carrying this reads and fills only its partition of the response cache: the
/// answers stored by calls of the same partition. pgw-server gives each virtual key's
/// calls the key's label, so one tenant's answers never serve another (and a cache
/// hit cannot tell a tenant what another asked).
///
/// ```
/// use std::sync::Arc;
/// use pgw_stack::{CachePartition, ChatCall};
/// use pgw_stack::core::openai::ChatRequest;
///
/// let mut call = ChatCall::new(ChatRequest::user("gpt-4o", "hello"));
/// call.extensions_mut().insert(CachePartition(Arc::from("team-a")));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachePartition(pub Arc<str>);

/// Whether `req` asks for a deterministic answer: `temperature` 0 or a fixed `seed`.
/// Only those are cached by default: a sampled answer (a chat UI's regenerate) must
/// not come back identical.
///
/// ```
/// use pgw_stack::cache::is_deterministic;
/// use pgw_stack::core::openai::ChatRequest;
///
/// let mut req = ChatRequest::user("m", "hi");
/// assert!(!is_deterministic(&req), "the provider's default temperature samples");
/// req.extra.insert("temperature".into(), 0.0.into());
/// assert!(is_deterministic(&req));
/// req.extra.insert("temperature".into(), 1.2.into());
/// assert!(!is_deterministic(&req));
/// req.extra.insert("seed".into(), 42.into());
/// assert!(is_deterministic(&req));
/// ```
#[must_use]
pub fn is_deterministic(req: &ChatRequest) -> bool {
    let zero_temperature = req
        .extra
        .get("temperature")
        .and_then(serde_json::Value::as_f64)
        .is_some_and(|t| t == 0.0);
    let seeded = req.extra.get("seed").is_some_and(serde_json::Value::is_number);
    zero_temperature || seeded
}

/// A cached answer: what a caller gets on a hit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CachedAnswer {
    /// The answer.
    pub response: ChatResponse,
    /// Its chunks, when it was streamed.
    #[serde(default)]
    pub chunks: Vec<ChatChunk>,
    /// The group that answered first.
    pub group: String,
    /// The source that answered first.
    pub source: Option<SourceId>,
}

/// A response cache backend.
pub trait ResponseCache: Send + Sync {
    /// The answer stored under `key`, if fresh.
    fn get(&self, key: CacheKey) -> BoxFuture<'static, Option<Arc<CachedAnswer>>>;
    /// Stores `answer` under `key` for `ttl`.
    fn put(&self, key: CacheKey, answer: Arc<CachedAnswer>, ttl: Duration) -> BoxFuture<'static, ()>;
}

/// An in-process cache bounded by answers and by bytes: at most `max_entries`
/// answers and at most `max_bytes` of them (each weighed as its JSON length, which is
/// about what it holds in memory; a streamed answer's chunks count), with
/// quick_cache's CLOCK-Pro eviction (recently and often used answers stay), each
/// until its TTL on the tokio clock.
///
/// Both bounds hold with one weight: an answer weighs its bytes, and at least
/// `max_bytes / max_entries`. quick_cache splits the capacity across shards, so one
/// answer heavier than a shard's share (about `max_bytes` divided by the shard count,
/// 1 to 4 per core) is not stored at all.
///
/// ```
/// use pgw_stack::cache::{MemoryCache, DEFAULT_MAX_BYTES};
///
/// let cache = MemoryCache::new(10_000);
/// assert_eq!(cache.max_bytes(), DEFAULT_MAX_BYTES);
/// let small = MemoryCache::bounded(100, 1 << 20);
/// assert_eq!(small.max_bytes(), 1 << 20);
/// ```
#[derive(Clone)]
pub struct MemoryCache {
    inner: Arc<quick_cache::sync::Cache<CacheKey, Stored, Weight>>,
    max_bytes: u64,
}

/// The memory cache's default byte bound: 128 MiB. At the default 10,000 answers it
/// is 13 KiB each on average: a long non-streamed answer is 2-10 KiB of JSON, a
/// streamed one several times that (every chunk repeats the call's id and model), so
/// 10,000 streamed answers alone could take gigabytes without it.
pub const DEFAULT_MAX_BYTES: u64 = 128 << 20;

/// A stored answer: when it expires, the answer, its weight.
#[derive(Clone)]
struct Stored {
    expires: Instant,
    answer: Arc<CachedAnswer>,
    bytes: u64,
}

/// An answer's weight: its bytes, at least `floor` (`max_bytes / max_entries`), so
/// that the weight bound is also the entries bound.
#[derive(Clone)]
struct Weight {
    floor: u64,
}

impl quick_cache::Weighter<CacheKey, Stored> for Weight {
    fn weight(&self, _key: &CacheKey, val: &Stored) -> u64 {
        val.bytes.max(self.floor)
    }
}

/// Counts the bytes written to it.
struct Counter(u64);

impl std::io::Write for Counter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl CachedAnswer {
    /// Its JSON length in bytes (what the Redis cache stores; the memory cache's
    /// weight), counted without building the JSON.
    #[must_use]
    pub fn json_len(&self) -> u64 {
        let mut n = Counter(0);
        // Serializing plain data into a writer that never fails cannot fail.
        let _ = serde_json::to_writer(&mut n, self);
        n.0
    }
}

impl std::fmt::Debug for MemoryCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryCache")
            .field("len", &self.len())
            .field("bytes", &self.inner.weight())
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

impl MemoryCache {
    /// A cache holding at most `max_entries` answers (at least 1) and at most
    /// [`DEFAULT_MAX_BYTES`] of them.
    #[must_use]
    pub fn new(max_entries: usize) -> Self {
        Self::bounded(max_entries, DEFAULT_MAX_BYTES)
    }

    /// A cache holding at most `max_entries` answers (at least 1) and at most
    /// `max_bytes` (at least 1) of them.
    #[must_use]
    pub fn bounded(max_entries: usize, max_bytes: u64) -> Self {
        let entries = max_entries.max(1);
        let max_bytes = max_bytes.max(1);
        let floor = (max_bytes / entries as u64).max(1);
        Self {
            inner: Arc::new(quick_cache::sync::Cache::with_weighter(
                entries,
                max_bytes,
                Weight { floor },
            )),
            max_bytes,
        }
    }

    /// How many answers it holds (expired ones included until read or evicted).
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Whether it holds nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What its answers weigh together, in bytes (each at least
    /// `max_bytes / max_entries`).
    #[must_use]
    pub fn weight(&self) -> u64 {
        self.inner.weight()
    }

    /// Its byte bound.
    #[must_use]
    pub const fn max_bytes(&self) -> u64 {
        self.max_bytes
    }
}

impl ResponseCache for MemoryCache {
    fn get(&self, key: CacheKey) -> BoxFuture<'static, Option<Arc<CachedAnswer>>> {
        let now = Instant::now();
        let hit = match self.inner.get(&key) {
            Some(stored) if stored.expires > now => Some(stored.answer),
            Some(_) => {
                // Only while it is still the expired entry: a `put` that landed since
                // the read is fresh and stays.
                self.inner.remove_if(&key, |s| s.expires <= now);
                None
            }
            None => None,
        };
        Box::pin(std::future::ready(hit))
    }

    fn put(&self, key: CacheKey, answer: Arc<CachedAnswer>, ttl: Duration) -> BoxFuture<'static, ()> {
        let now = Instant::now();
        let expires = now
            .checked_add(ttl)
            .unwrap_or(now + Duration::from_secs(86_400 * 365));
        let bytes = answer.json_len();
        self.inner.insert(
            key,
            Stored {
                expires,
                answer,
                bytes,
            },
        );
        Box::pin(std::future::ready(()))
    }
}

/// A cache in Redis shared by every process: `SET key json EX ttl`, `GET key`.
/// A Redis failure is a miss (and a warning): the cache never fails a call.
#[derive(Clone, Debug)]
pub struct RedisCache {
    conn: RedisConn,
    prefix: String,
}

impl RedisCache {
    /// A cache on `conn`, keys `{prefix}:cache:{digest}`.
    #[must_use]
    pub fn new(conn: RedisConn, prefix: impl Into<String>) -> Self {
        Self {
            conn,
            prefix: prefix.into(),
        }
    }

    fn key(&self, key: CacheKey) -> String {
        format!("{}:cache:{}", self.prefix, key.hex())
    }
}

const REDIS_TIMEOUT: Duration = pgw_core::redis_conn::DEFAULT_RESPONSE_TIMEOUT;

impl ResponseCache for RedisCache {
    fn get(&self, key: CacheKey) -> BoxFuture<'static, Option<Arc<CachedAnswer>>> {
        let mut conn = self.conn.clone();
        let k = self.key(key);
        Box::pin(async move {
            let cmd = redis::cmd("GET").arg(&k).clone();
            let got: Option<Vec<u8>> =
                match pgw_core::redis_conn::run("cache get", REDIS_TIMEOUT, cmd.query_async(&mut conn)).await
                {
                    Ok(v) => v,
                    Err(e) => {
                        tracing::warn!(error = %e, "cache: redis get failed; treated as a miss");
                        return None;
                    }
                };
            serde_json::from_slice(&got?).ok().map(Arc::new)
        })
    }

    fn put(&self, key: CacheKey, answer: Arc<CachedAnswer>, ttl: Duration) -> BoxFuture<'static, ()> {
        let mut conn = self.conn.clone();
        let k = self.key(key);
        Box::pin(async move {
            // Polled where a stream ended, perhaps outside a runtime: the connection and
            // its timeout need one (they would panic).
            if tokio::runtime::Handle::try_current().is_err() {
                tracing::debug!("cache: redis put skipped outside a Tokio runtime");
                return;
            }
            let Ok(json) = serde_json::to_vec(&*answer) else {
                return;
            };
            let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
            let cmd = redis::cmd("SET").arg(&k).arg(json).arg("PX").arg(ms).clone();
            let r: Result<(), _> =
                pgw_core::redis_conn::run("cache put", REDIS_TIMEOUT, cmd.query_async(&mut conn)).await;
            if let Err(e) = r {
                tracing::warn!(error = %e, "cache: redis put failed");
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(text: &str) -> Arc<CachedAnswer> {
        Arc::new(CachedAnswer {
            response: ChatResponse::default(),
            chunks: Vec::new(),
            group: text.into(),
            source: None,
        })
    }

    #[test]
    fn key_ignores_stream_and_sees_content_model_and_route() {
        let a = ChatRequest::user("m", "hello");
        let mut b = a.clone();
        b.stream = true;
        assert_eq!(CacheKey::of(&a), CacheKey::of(&b));
        assert_ne!(CacheKey::of(&a), CacheKey::of(&ChatRequest::user("m", "hellO")));
        assert_ne!(CacheKey::of(&a), CacheKey::of(&ChatRequest::user("m2", "hello")));
        assert_ne!(
            CacheKey::for_route(&a, "x=s1/m"),
            CacheKey::for_route(&a, "x=s2/m")
        );
    }

    /// The digest is SHA-256 of a fixed canonical form: a key computed by any build of
    /// the gateway (any Rust release, any process) is this one, so a Redis cache
    /// shared across upgrades keeps its hits. If this changes, every shared cache
    /// starts cold: change it only on purpose, and say so in the changelog.
    #[test]
    fn key_is_stable_across_builds() {
        let mut req = ChatRequest::user("gpt-4o", "What is the capital of France?");
        req.max_tokens = Some(16);
        req.extra.insert("temperature".into(), 0.0.into());
        let key = CacheKey::for_route(&req, "gpt-4o=openai/gpt-4o");
        assert_eq!(key.hex(), EXPECTED_KEY);
    }

    /// SHA-256 of `{"route":"gpt-4o=openai/gpt-4o","model":"gpt-4o","messages":[{"role":"user",
    /// "content":"What is the capital of France?"}],"max_tokens":16,"extra":{"temperature":0.0}}`
    /// (without the line break), first 16 bytes; checked with `sha256sum` outside Rust.
    const EXPECTED_KEY: &str = "596809ecfd03a0fba72f24421a3ac720";

    #[tokio::test(start_paused = true)]
    async fn ttl_and_bound() {
        let c = MemoryCache::new(2);
        let k = |n: &str| CacheKey::of(&ChatRequest::user("m", n));
        c.put(k("a"), answer("a"), Duration::from_secs(10)).await;
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(c.get(k("a")).await.is_some());
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(c.get(k("a")).await.is_none(), "expired");
        for n in ["x", "y", "z", "w"] {
            c.put(k(n), answer(n), Duration::from_secs(60)).await;
        }
        assert!(c.len() <= 2, "bounded: {}", c.len());
        c.put(k("z"), answer("z2"), Duration::from_secs(60)).await;
        assert_eq!(c.get(k("z")).await.unwrap().group, "z2", "an overwrite wins");
    }

    /// The byte bound holds whatever the entries bound allows: 200 answers of about
    /// 4 KiB each (800 KiB) into a cache of 1,000 entries and 64 KiB keep at most
    /// 64 KiB (entries alone would have kept all 200). Before the byte bound, a cache
    /// of 10,000 streamed answers could take gigabytes.
    #[tokio::test(start_paused = true)]
    async fn bytes_bound_the_cache_as_well_as_entries() {
        let big = |n: usize| {
            let mut a = (*answer(&n.to_string())).clone();
            a.response.choices.push(pgw_core::openai::Choice {
                message: pgw_core::openai::ChatMessage::new("assistant", "x".repeat(4096)),
                ..Default::default()
            });
            Arc::new(a)
        };
        let one = big(0).json_len();
        assert!((4096..5000).contains(&one), "an answer weighs its JSON: {one}");
        let c = MemoryCache::bounded(1_000, 64 << 10);
        for n in 0..200 {
            let key = CacheKey::of(&ChatRequest::user("m", n.to_string()));
            c.put(key, big(n), Duration::from_secs(60)).await;
        }
        assert!(c.weight() <= 64 << 10, "weight {} over the bound", c.weight());
        assert!(c.len() >= 8, "it still holds answers: {}", c.len());
        assert!(c.len() <= 16, "at most 64 KiB of 4 KiB answers: {}", c.len());

        // Small answers are bounded by entries: each weighs at least 64 KiB / 4.
        let c = MemoryCache::bounded(4, 64 << 10);
        for n in 0..50 {
            let key = CacheKey::of(&ChatRequest::user("m", n.to_string()));
            c.put(key, answer("tiny"), Duration::from_secs(60)).await;
        }
        assert!(c.len() <= 4, "entries bound: {}", c.len());
    }
}
