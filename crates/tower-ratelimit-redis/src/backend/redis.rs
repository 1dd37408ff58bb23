//! The Redis backend: every process shares the quota; one Lua script, one round trip
//! per admission; windows on the server clock (`TIME`); works on Redis Cluster.
//!
//! # Key layout
//!
//! Each scope has three keys, `PREFIX:{TAG}:SCOPE:q` (window hash `w, r, t`),
//! `...:c` (lease zset scored by expiry) and `...:h` (hold end, ms), where `SCOPE` is
//! `source:NAME` or `account:NAME`. The hash tag `TAG` is `a:ACCOUNT` for a source
//! that has an account and for the account itself, `s:SOURCE` otherwise. So every key
//! one admission touches (the source's and its account's) lives in one cluster slot,
//! which a Lua script requires. The cost: all sources of one account share that
//! account's slot (one shard carries the account's whole traffic).
//!
//! Every key has a TTL: the window hash two windows, the lease zset two lease TTLs
//! (refreshed on renewal), the hold exactly its duration.
//!
//! Scripts: `admit`, `settle`, `renew`, `hold`, and `held` (reads the lease zsets and
//! holds, writes nothing), each one round trip on the keys of one hash tag.

use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use pgw_core::redis_conn::{RedisConn, RedisTarget, run};
use pgw_core::{BackendUnavailable, QuotaExceeded};
use redis::Script;

use super::{
    BackendFuture, Clock, Gate, Held, HoldScope, LeaseId, ScopeHeld, ScopeKind, ScopeSpec, Settle, Verdict,
};
use crate::config::RateLimitConfig;

static ADMIT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/admit.lua")));
static SETTLE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/settle.lua")));
static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/renew.lua")));
static HOLD: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/hold.lua")));
static HELD: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/held.lua")));

/// The longest hold sent to Redis, in milliseconds (ten years).
const MAX_HOLD_MS: u128 = 10 * 365 * 24 * 3600 * 1000;

/// A per-process random nonce, so lease ids of different processes never collide.
static NONCE: LazyLock<u64> = LazyLock::new(|| {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
});

/// Limiter state in Redis, shared by every process.
///
/// Cheap to clone (one multiplexed connection underneath).
#[derive(Clone)]
pub struct RedisBackend {
    conn: RedisConn,
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RedisBackend").field(&self.conn).finish()
    }
}

impl RedisBackend {
    /// A backend over an existing connection.
    #[must_use]
    pub const fn new(conn: RedisConn) -> Self {
        Self { conn }
    }

    /// Connects to a standalone server or a cluster.
    ///
    /// # Errors
    /// [`BackendUnavailable`] when the server cannot be reached.
    pub async fn connect(target: &RedisTarget) -> Result<Self, BackendUnavailable> {
        Ok(Self::new(RedisConn::connect(target).await?))
    }

    /// The admission script (for tooling and benchmarks, e.g. `redis-benchmark ...
    /// EVALSHA`): see the key layout in this module's documentation.
    #[must_use]
    pub fn admit_script() -> &'static Script {
        &ADMIT
    }

    /// The keys of `config`'s scopes, account first: `(q, c, h)` for each.
    #[must_use]
    pub fn keys(config: &RateLimitConfig) -> Vec<[String; 3]> {
        let tag = match &config.account {
            Some((a, _)) => format!("a:{a}"),
            None => format!("s:{}", config.source),
        };
        super::ScopeSpec::of(config)
            .iter()
            .map(|s| {
                let base = format!("{}:{{{tag}}}:{}", config.key_prefix, s.label);
                [format!("{base}:q"), format!("{base}:c"), format!("{base}:h")]
            })
            .collect()
    }

    pub(crate) fn bind(&self, scopes: &[ScopeSpec], config: &RateLimitConfig) -> RedisGate {
        let keys = Self::keys(config);
        let limit = |v: Option<u64>| v.map_or(-1, |v| i64::try_from(v).unwrap_or(i64::MAX));
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        let has_account = config.account.is_some();
        let n = i64::try_from(scopes.len()).unwrap_or(2);
        let mut limits = Vec::new();
        for s in scopes {
            limits.extend([
                limit(s.quota.requests),
                limit(s.quota.tokens),
                limit(s.quota.concurrency),
            ]);
        }
        RedisGate {
            conn: self.conn.clone(),
            inner: Arc::new(GateKeys {
                admit_keys: keys.iter().flat_map(|k| k.iter().cloned()).collect(),
                settle_keys: keys.iter().flat_map(|k| [k[0].clone(), k[1].clone()]).collect(),
                lease_keys: keys
                    .iter()
                    .zip(scopes)
                    .filter(|(_, s)| s.quota.concurrency.is_some())
                    .map(|(k, _)| k[1].clone())
                    .collect(),
                hold_keys: keys
                    .iter()
                    .zip(scopes)
                    .map(|(k, s)| (s.kind, k[2].clone()))
                    .collect(),
                held_keys: keys.iter().flat_map(|k| [k[1].clone(), k[2].clone()]).collect(),
                labels: scopes.iter().map(|s| s.label.clone()).collect(),
                n,
                window_ms: ms(config.window),
                ttl_ms: ms(config.lease_ttl),
                hint_ms: ms(config.slot_retry_after),
                limits,
                timeout: config.response_timeout,
                has_account,
            }),
        }
    }
}

#[derive(Debug)]
struct GateKeys {
    admit_keys: Vec<String>,
    settle_keys: Vec<String>,
    lease_keys: Vec<String>,
    hold_keys: Vec<(ScopeKind, String)>,
    held_keys: Vec<String>,
    labels: Vec<Arc<str>>,
    n: i64,
    window_ms: i64,
    ttl_ms: i64,
    hint_ms: i64,
    limits: Vec<i64>,
    timeout: Duration,
    has_account: bool,
}

/// One limiter's keys in a [`RedisBackend`].
pub(crate) struct RedisGate {
    conn: RedisConn,
    inner: Arc<GateKeys>,
}

impl fmt::Debug for RedisGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisGate")
            .field("scopes", &self.inner.labels)
            .finish_non_exhaustive()
    }
}

fn lease_member(id: LeaseId) -> String {
    format!("{:x}:{id:x}", *NONCE)
}

fn millis(v: i64) -> Duration {
    Duration::from_millis(u64::try_from(v).unwrap_or(0))
}

fn garbage(operation: &'static str, reply: &[i64]) -> BackendUnavailable {
    BackendUnavailable::new("redis", operation, format!("unexpected script reply {reply:?}"))
}

impl Gate for RedisGate {
    fn admit(
        &self,
        tokens: u64,
        lease: Option<LeaseId>,
    ) -> BackendFuture<Result<Verdict, BackendUnavailable>> {
        let k = &*self.inner;
        let mut inv = ADMIT.prepare_invoke();
        for key in &k.admit_keys {
            inv.key(key);
        }
        inv.arg(k.n)
            .arg(k.window_ms)
            .arg(tokens)
            .arg(lease.map(lease_member).unwrap_or_default())
            .arg(k.ttl_ms)
            .arg(k.hint_ms);
        for l in &k.limits {
            inv.arg(*l);
        }
        let mut conn = self.conn.clone();
        let inner = self.inner.clone();
        BackendFuture::Pending(Box::pin(async move {
            let reply: Vec<i64> = run("admit", inner.timeout, inv.invoke_async(&mut conn)).await?;
            match reply.as_slice() {
                [1, now, win] => Ok(Verdict::Admitted {
                    at: millis(*now),
                    window: u64::try_from(*win).unwrap_or(0),
                    local: None,
                }),
                [0, _, scope, dim, wait] => {
                    let dim = match dim {
                        1 => "rpm",
                        2 => "tpm",
                        3 => "concurrency",
                        4 => "hold",
                        _ => return Err(garbage("admit", &reply)),
                    };
                    let label = usize::try_from(*scope)
                        .ok()
                        .and_then(|i| inner.labels.get(i))
                        .ok_or_else(|| garbage("admit", &reply))?;
                    Ok(Verdict::Refused(
                        QuotaExceeded::new(dim, millis(*wait)).with_scope(&**label),
                    ))
                }
                _ => Err(garbage("admit", &reply)),
            }
        }))
    }

    fn settle(&self, s: Settle) -> BackendFuture<Result<(), BackendUnavailable>> {
        let k = &*self.inner;
        let mut inv = SETTLE.prepare_invoke();
        for key in &k.settle_keys {
            inv.key(key);
        }
        inv.arg(k.n)
            .arg(s.window)
            .arg(s.requests)
            .arg(s.tokens)
            .arg(s.lease.map(lease_member).unwrap_or_default());
        let mut conn = self.conn.clone();
        let timeout = k.timeout;
        BackendFuture::Pending(Box::pin(async move {
            let _: i64 = run("settle", timeout, inv.invoke_async(&mut conn)).await?;
            Ok(())
        }))
    }

    fn renew(&self, lease: LeaseId) -> BackendFuture<Result<bool, BackendUnavailable>> {
        let k = &*self.inner;
        let mut inv = RENEW.prepare_invoke();
        for key in &k.lease_keys {
            inv.key(key);
        }
        inv.arg(lease_member(lease)).arg(k.ttl_ms);
        let expected = i64::try_from(k.lease_keys.len()).unwrap_or(0);
        let mut conn = self.conn.clone();
        let timeout = k.timeout;
        BackendFuture::Pending(Box::pin(async move {
            let n: i64 = run("renew", timeout, inv.invoke_async(&mut conn)).await?;
            Ok(n == expected)
        }))
    }

    fn hold(
        &self,
        which: HoldScope,
        duration: Duration,
    ) -> BackendFuture<Result<Duration, BackendUnavailable>> {
        let k = &*self.inner;
        let mut inv = HOLD.prepare_invoke();
        for (kind, key) in &k.hold_keys {
            if kind.held_by(which, k.has_account) {
                inv.key(key);
            }
        }
        // Round up: a hold must never end before the time asked for. Capped at ten
        // years: Redis rejects expiries past its clock's range, and the script's
        // numbers stay exact integers.
        let ms = duration.as_nanos().div_ceil(1_000_000).min(MAX_HOLD_MS);
        inv.arg(u64::try_from(ms).unwrap_or(u64::MAX));
        let mut conn = self.conn.clone();
        let timeout = k.timeout;
        BackendFuture::Pending(Box::pin(async move {
            let reply: Vec<i64> = run("hold", timeout, inv.invoke_async(&mut conn)).await?;
            match reply.as_slice() {
                [_, until] => Ok(millis(*until)),
                _ => Err(garbage("hold", &reply)),
            }
        }))
    }

    fn held(&self) -> BackendFuture<Result<Held, BackendUnavailable>> {
        let k = &*self.inner;
        let mut inv = HELD.prepare_invoke();
        for key in &k.held_keys {
            inv.key(key);
        }
        let mut conn = self.conn.clone();
        let inner = self.inner.clone();
        BackendFuture::Pending(Box::pin(async move {
            let reply: Vec<i64> = run("held", inner.timeout, inv.invoke_async(&mut conn)).await?;
            let bad = || garbage("held", &reply);
            let (&now, per_scope) = reply.split_first().ok_or_else(bad)?;
            if per_scope.len() != 3 * inner.labels.len() {
                return Err(bad());
            }
            let until = |at: i64| (at > now).then(|| millis(at - now));
            let mut source = None;
            let mut account = None;
            for ((kind, _), (label, v)) in inner
                .hold_keys
                .iter()
                .zip(inner.labels.iter().zip(per_scope.chunks_exact(3)))
            {
                let held = ScopeHeld {
                    scope: label.to_string(),
                    leases: u64::try_from(v[0]).map_err(|_| bad())?,
                    leases_expire_in: until(v[1]),
                    hold_ends_in: until(v[2]),
                };
                match kind {
                    ScopeKind::Source => source = Some(held),
                    ScopeKind::Account => account = Some(held),
                }
            }
            Ok(Held {
                source: source.ok_or_else(bad)?,
                account,
            })
        }))
    }

    fn clock(&self) -> Clock {
        Clock::RedisServer
    }
}
