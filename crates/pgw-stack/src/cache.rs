//! The response cache (S4): asked before every gate, so a hit never reaches the
//! limiter or the upstream. Memory (TTL + size bound, tokio clock) or Redis.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::future::BoxFuture;
use pgw_core::SourceId;
use pgw_core::openai::{ChatChunk, ChatRequest, ChatResponse};
use pgw_core::redis_conn::RedisConn;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// The key of a request: a 128-bit digest of its model, messages, `max_tokens` and
/// other fields (everything but `stream`: a streamed and a plain call share answers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheKey(pub u128);

impl CacheKey {
    /// The key of `req`.
    #[must_use]
    pub fn of(req: &ChatRequest) -> Self {
        #[derive(Serialize)]
        struct Canon<'a> {
            model: &'a str,
            messages: &'a [pgw_core::openai::ChatMessage],
            max_tokens: Option<u64>,
            extra: &'a serde_json::Map<String, serde_json::Value>,
        }
        // serde_json maps are sorted (no `preserve_order`), so the bytes are canonical.
        let bytes = serde_json::to_vec(&Canon {
            model: &req.model,
            messages: &req.messages,
            max_tokens: req.max_tokens,
            extra: &req.extra,
        })
        .unwrap_or_default();
        let half = |salt: u64| {
            // SipHash with fixed keys: the same digest in every process of one build.
            let mut h = std::hash::DefaultHasher::new();
            salt.hash(&mut h);
            bytes.hash(&mut h);
            h.finish()
        };
        Self((u128::from(half(0x9e37_79b9)) << 64) | u128::from(half(0x7f4a_7c15)))
    }

    fn hex(self) -> String {
        format!("{:032x}", self.0)
    }
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

/// An in-process cache with a TTL (tokio clock) and a size bound (the oldest entry is
/// evicted first).
#[derive(Clone, Debug)]
pub struct MemoryCache {
    inner: Arc<Mutex<MemoryInner>>,
    max_entries: usize,
}

#[derive(Debug, Default)]
struct MemoryInner {
    /// key -> (expiry, insertion number, answer)
    map: HashMap<CacheKey, (Instant, u64, Arc<CachedAnswer>)>,
    /// (key, insertion number, expiry), oldest first; pairs of overwritten entries are
    /// stale (their number no longer matches the map's) and skipped.
    order: VecDeque<(CacheKey, u64, Instant)>,
    seq: u64,
}

impl MemoryCache {
    /// A cache holding at most `max_entries` answers (at least 1).
    #[must_use]
    pub fn new(max_entries: usize) -> Self {
        Self {
            inner: Arc::default(),
            max_entries: max_entries.max(1),
        }
    }

    /// How many answers it holds (expired ones included until evicted).
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .map
            .len()
    }

    /// Whether it holds nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl ResponseCache for MemoryCache {
    fn get(&self, key: CacheKey) -> BoxFuture<'static, Option<Arc<CachedAnswer>>> {
        let now = Instant::now();
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let hit = match g.map.get(&key) {
            Some((exp, _, a)) if *exp > now => Some(Arc::clone(a)),
            Some(_) => {
                g.map.remove(&key);
                None
            }
            None => None,
        };
        Box::pin(std::future::ready(hit))
    }

    fn put(&self, key: CacheKey, answer: Arc<CachedAnswer>, ttl: Duration) -> BoxFuture<'static, ()> {
        let now = Instant::now();
        let expires = now + ttl;
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        g.seq += 1;
        let seq = g.seq;
        g.map.insert(key, (expires, seq, answer));
        g.order.push_back((key, seq, expires));
        // Evict expired entries from the front, then the oldest while over the bound.
        while let Some(&(k, n, exp)) = g.order.front() {
            let over = g.map.len() > self.max_entries;
            if !(over || exp <= now) {
                break;
            }
            g.order.pop_front();
            if g.map.get(&k).is_some_and(|(_, m, _)| *m == n) {
                g.map.remove(&k);
            }
        }
        // Overwritten keys leave stale pairs behind: compact before they outgrow the map.
        if g.order.len() > 2 * self.max_entries {
            let MemoryInner { map, order, .. } = &mut *g;
            order.retain(|(k, n, _)| map.get(k).is_some_and(|(_, m, _)| m == n));
        }
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
    fn key_ignores_stream_and_sees_content() {
        let a = ChatRequest::user("m", "hello");
        let mut b = a.clone();
        b.stream = true;
        assert_eq!(CacheKey::of(&a), CacheKey::of(&b));
        assert_ne!(CacheKey::of(&a), CacheKey::of(&ChatRequest::user("m", "hellO")));
        assert_ne!(CacheKey::of(&a), CacheKey::of(&ChatRequest::user("m2", "hello")));
    }

    #[tokio::test(start_paused = true)]
    async fn ttl_and_bound() {
        let c = MemoryCache::new(2);
        let k = |n: &str| CacheKey::of(&ChatRequest::user("m", n));
        c.put(k("a"), answer("a"), Duration::from_secs(10)).await;
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(c.get(k("a")).await.is_some());
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(c.get(k("a")).await.is_none(), "expired");
        for n in ["x", "y", "z"] {
            c.put(k(n), answer(n), Duration::from_secs(60)).await;
        }
        assert_eq!(c.len(), 2);
        assert!(c.get(k("x")).await.is_none(), "oldest evicted");
        assert_eq!(c.get(k("z")).await.unwrap().group, "z");
        for _ in 0..10 {
            c.put(k("z"), answer("z2"), Duration::from_secs(60)).await;
        }
        assert!(
            c.inner.lock().unwrap().order.len() <= 4,
            "stale order entries compacted"
        );
        assert_eq!(c.get(k("z")).await.unwrap().group, "z2");
        assert!(
            c.get(k("y")).await.is_some(),
            "overwrites do not evict live entries"
        );
    }
}
