//! The Redis backend: every process shares the quota; one Lua script, one round trip
//! per admission; windows on the server clock (`TIME`); works on Redis Cluster.
//!
//! # Key layout
//!
//! Each scope has three keys, `PREFIX:{TAG}:SCOPE:sw` (the sliding window: a hash of
//! per-sub-window counts and their totals, see `lua/window.lua`),
//! `...:c` (lease zset scored by expiry) and `...:h` (hold end, ms), where `SCOPE` is
//! `source:NAME` or `account:NAME`. The hash tag `TAG` is `a:ACCOUNT` for a source
//! that has an account and for the account itself, `s:SOURCE` otherwise. So every key
//! one admission touches (the source's and its account's) lives in one cluster slot,
//! which a Lua script requires. The cost: all sources of one account share that
//! account's slot (one shard carries the account's whole traffic).
//!
//! Every key has a TTL: the window hash at least a window and two sub-windows past its
//! newest write (set for two windows and two sub-windows, renewed only when less than
//! one window and two sub-windows of it is left), the lease zset two lease TTLs
//! (refreshed on renewal), the hold exactly its duration.
//!
//! Scripts: `admit`, `settle`, `renew`, `hold`, `held` (reads the lease zsets and
//! holds, writes nothing) and `peek` (reads the holds and the server clock), each one
//! round trip on the keys of one hash tag.
//!
//! # A limiter with nothing to enforce
//!
//! A limiter whose scopes limit nothing (no requests, tokens or concurrency quota) has
//! only holds to honour, and makes no round trip to admit or settle. Its holds are read
//! from a cache this backend shares between its limiters: a hold set through any of
//! them is in the cache when its round trip answers; a hold set by another process is
//! read by `peek`, at most once per `hold_refresh` per limiter (in the background once
//! half of it has passed; an admission waits for the read only when the cache is older
//! than `hold_refresh`, e.g. after an idle spell). So another process's hold is
//! honoured by every admission that starts `hold_refresh` (default 1 s) after it was
//! set. Such an admission's instant is the server clock estimated from the last
//! answer (local clock plus the offset it showed, late by at most one round trip).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use pgw_core::redis_conn::{LATE_ANSWER_WAIT, RedisConn, RedisTarget, run, unique_id};
use pgw_core::sync::lock;
use pgw_core::{BackendUnavailable, QuotaExceeded};
use redis::Script;
use tokio::time::Instant;

use super::{
    BackendFuture, Clock, Gate, Held, HoldScope, LeaseId, ScopeHeld, ScopeKind, ScopeSpec, Settle, Verdict,
    nanos,
};
use crate::config::RateLimitConfig;

static ADMIT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("../lua/window.lua"),
        include_str!("../lua/admit.lua")
    ))
});
static SETTLE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("../lua/window.lua"),
        include_str!("../lua/settle.lua")
    ))
});
static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/renew.lua")));
static HOLD: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/hold.lua")));
static HELD: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/held.lua")));
static PEEK: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/peek.lua")));

/// The longest hold sent to Redis, in milliseconds (ten years).
const MAX_HOLD_MS: u128 = 10 * 365 * 24 * 3600 * 1000;

/// Limiter state in Redis, shared by every process.
///
/// Cheap to clone (one multiplexed connection underneath). Give every limiter of a
/// process clones of one backend: they share its cache of holds.
///
/// A limiter whose scopes limit nothing (no requests, tokens or concurrency quota)
/// has only holds to honour and makes no round trip to admit or settle: it reads that
/// cache. A hold set through any limiter of the backend is in it as soon as its round
/// trip answers; a hold set by another process is read at most once per
/// [`RateLimitConfig::hold_refresh`] (default
/// [`DEFAULT_HOLD_REFRESH`](crate::DEFAULT_HOLD_REFRESH)) per limiter, so every
/// admission that starts that long after the hold was set honours it. With Redis
/// unreachable, such a limiter fails closed once its cache is older than that.
#[derive(Clone)]
pub struct RedisBackend {
    conn: RedisConn,
    book: Arc<HoldBook>,
}

/// What this process knows of holds, shared by every limiter of one backend: the end
/// of each hold key (server milliseconds, 0 = none), and the server clock's offset from
/// the local one.
struct HoldBook {
    base: Instant,
    /// Server ms minus local ms (since `base`), from the last answer that showed it.
    offset_ms: AtomicI64,
    ends: Mutex<HashMap<String, Arc<AtomicI64>>>,
    /// Per scope (its leases' key): how many of its concurrency leases this process
    /// gave back, counted when a settle is sent and when it lands. A concurrency
    /// refusal is remembered only while the count stays what it was.
    releases: Mutex<HashMap<String, Arc<AtomicU64>>>,
    /// Per scope (its window key): the last refusal this process learnt of it, shared
    /// by every limiter of the backend with that scope (the sources of one account
    /// share the account's).
    memos: Mutex<HashMap<String, Arc<ScopeMemo>>>,
    /// Whether an admission through this backend has loaded the settle script on the
    /// server (see [`RedisGate::load_settle`]).
    settle_loaded: AtomicBool,
}

impl HoldBook {
    fn local_ms(&self, t: Instant) -> i64 {
        i64::try_from(t.saturating_duration_since(self.base).as_millis()).unwrap_or(i64::MAX)
    }

    /// Notes the server's `now` read by a round trip answered at local `at`: the offset
    /// is an underestimate by the answer's flight, so holds are judged to end late,
    /// never early.
    fn saw_server(&self, now: i64, at: Instant) {
        self.offset_ms
            .store(now.saturating_sub(self.local_ms(at)), Ordering::Relaxed);
    }

    fn end_of(&self, key: &str) -> Arc<AtomicI64> {
        let mut ends = lock(&self.ends);
        ends.entry(key.to_owned()).or_default().clone()
    }

    fn memo_of(&self, key: &str) -> Arc<ScopeMemo> {
        let mut memos = lock(&self.memos);
        memos.entry(key.to_owned()).or_default().clone()
    }

    fn releases_of(&self, key: &str) -> Arc<AtomicU64> {
        let mut releases = lock(&self.releases);
        releases.entry(key.to_owned()).or_default().clone()
    }

    /// The server's clock now, as this process estimates it (late, never early).
    fn server_ms(&self, at: Instant) -> i64 {
        self.local_ms(at)
            .saturating_add(self.offset_ms.load(Ordering::Relaxed))
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RedisBackend").field(&self.conn).finish()
    }
}

impl RedisBackend {
    /// A backend over an existing connection.
    #[must_use]
    pub fn new(conn: RedisConn) -> Self {
        Self {
            conn,
            book: Arc::new(HoldBook {
                base: Instant::now(),
                offset_ms: AtomicI64::new(0),
                ends: Mutex::new(HashMap::new()),
                releases: Mutex::new(HashMap::new()),
                memos: Mutex::new(HashMap::new()),
                settle_loaded: AtomicBool::new(false),
            }),
        }
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

    /// The keys of `config`'s scopes, account first: `(w, c, h)` for each (sliding
    /// window, leases, hold).
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
                [format!("{base}:sw"), format!("{base}:c"), format!("{base}:h")]
            })
            .collect()
    }

    pub(crate) fn bind(&self, scopes: &[ScopeSpec], config: &RateLimitConfig) -> RedisGate {
        let keys = Self::keys(config);
        let limit = |v: Option<u64>| v.map_or(-1, |v| i64::try_from(v).unwrap_or(i64::MAX));
        let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        let window_ms = crate::config::window_ms(config.window);
        let sub_ms = crate::config::sub_window_ms(window_ms, config.sub_windows);
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
        let unlimited = scopes.iter().all(|s| s.quota == crate::Quota::unlimited());
        let ends: Vec<_> = keys.iter().map(|k| self.book.end_of(&k[2])).collect();
        let released: Vec<_> = keys.iter().map(|k| self.book.releases_of(&k[1])).collect();
        let memos: Vec<_> = keys.iter().map(|k| self.book.memo_of(&k[0])).collect();
        RedisGate {
            conn: self.conn.clone(),
            book: self.book.clone(),
            cache: unlimited.then(|| {
                Arc::new(HoldCache {
                    refreshed_ms: AtomicI64::new(NEVER),
                    refreshing: AtomicBool::new(false),
                    every_ms: ms(config.hold_refresh),
                })
            }),
            inner: Arc::new(GateKeys {
                ends,
                released,
                memos,
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
                sub_ms: i64::try_from(sub_ms).unwrap_or(i64::MAX),
                subs: i64::try_from(window_ms / sub_ms).unwrap_or(i64::MAX),
                ttl_ms: ms(config.lease_ttl),
                hint_ms: ms(config.slot_retry_after),
                limits,
                timeout: config.response_timeout,
                has_account,
                last_refusal: AtomicU64::new(0),
                deferred: Mutex::default(),
            }),
        }
    }
}

/// "Never refreshed", as a local millisecond count.
const NEVER: i64 = i64::MIN;

/// The holds of a limiter with nothing else to enforce: when they were last read from
/// Redis, whether a read is under way.
#[derive(Debug)]
struct HoldCache {
    /// Local ms (since the book's base) when the last successful read was sent.
    refreshed_ms: AtomicI64,
    refreshing: AtomicBool,
    every_ms: i64,
}

#[derive(Debug)]
struct GateKeys {
    /// Per scope, account first: the shared end of its hold (server ms).
    ends: Vec<Arc<AtomicI64>>,
    /// Per scope: the shared count of its leases this process gave back.
    released: Vec<Arc<AtomicU64>>,
    /// Per scope: this process's memory of its last refusal, shared by every limiter
    /// of the backend with the scope.
    memos: Vec<Arc<ScopeMemo>>,
    admit_keys: Vec<String>,
    settle_keys: Vec<String>,
    lease_keys: Vec<String>,
    hold_keys: Vec<(ScopeKind, String)>,
    held_keys: Vec<String>,
    labels: Vec<Arc<str>>,
    n: i64,
    window_ms: i64,
    /// The sub-window's length and how many make a window.
    sub_ms: i64,
    subs: i64,
    ttl_ms: i64,
    hint_ms: i64,
    limits: Vec<i64>,
    timeout: Duration,
    has_account: bool,
    /// The last refusal's dimension (the script's number) and scope index, `dim << 8 |
    /// scope`: what a local refusal while others ask names.
    last_refusal: AtomicU64,
    /// Token refunds deferred to this gate's next admission (see [`Deferred`]).
    deferred: Mutex<Deferred>,
}

/// Token refunds of settles that changed no other count (the call used fewer tokens
/// than its estimate: nearly every settle), deferred to the gate's next admission,
/// whose script gives them back before its checks: the settle itself is then only its
/// lease's `ZREM`s (one command a scope instead of a script of five to seven; Redis-mode
/// P6: about 4 of 27 Redis commands per call). Until they land, the window counts the
/// estimate: more than was used, never less, so a quota holds; only this limiter's
/// next admission sees them at once (it carries them, and gives them back even when it
/// is refused), not another process nor a sibling limiter of the same account (its
/// admissions ask without them). They land within a quarter window
/// ([`deferral_subs`]) all the same: the first one deferred schedules a settle script
/// that sends whatever no admission carried by then ([`RedisGate::flush_deferred`]).
/// Standalone Redis only (see [`RedisGate::settle`]: a cluster client may run a script
/// twice).
///
/// One entry per sub-window of admission (server ms, aligned down to it), tokens
/// negative; at most [`MAX_DEFERRED`] entries (past that they are sent at once).
#[derive(Debug, Default)]
struct Deferred {
    refunds: Vec<(i64, i64)>,
    /// A flush is scheduled.
    armed: bool,
}

/// The sub-windows of admission a gate keeps deferred refunds for before it sends them
/// (a call lasting longer than a sub-window settles in a later one than it was
/// admitted in, so a busy gate holds a few): 16.
const MAX_DEFERRED: usize = 16;

/// How many sub-windows a deferred refund waits for an admission to carry it before
/// it is sent on its own: a quarter of the window, rounded up (3 of the default 10).
///
/// A sub-window was too short: P6's Redis mode admits to each source about every 1.2
/// sub-windows, so half the refunds went by a flush (a settle script each, as before)
/// and the settles' commands fell by a fifth instead of four fifths.
const fn deferral_subs(subs: i64) -> i64 {
    let q = (subs + 3) / 4;
    if q < 1 { 1 } else { q }
}

impl Deferred {
    /// Adds `tokens` (negative) given back to the sub-window starting at `at`.
    fn add(&mut self, at: i64, tokens: i64) {
        match self.refunds.iter_mut().find(|(a, _)| *a == at) {
            Some((_, t)) => *t = t.saturating_add(tokens),
            None => self.refunds.push((at, tokens)),
        }
    }
}

/// How soon an admission refused because others are asking Redis for the room its
/// scopes have left asks again: 5 ms, a few loopback or LAN round trips.
///
/// Each scope lets as many admissions ask at once, through every limiter of the
/// backend, as the last answer said it has room for (requests or slots left; one
/// after a refusal, unbounded before any answer). When a remembered refusal or a hold
/// ends, or a slot frees, every call waiting on that scope would otherwise ask at
/// once, and all but the first few be refused again (P6's Redis mode: 2.3 refused
/// admissions per call, about 16 Redis commands; later, bursts of ten refusals in a
/// row after the account's slots filled). The others ask when they retry, after this.
pub const PROBE_RETRY: Duration = Duration::from_millis(5);

/// One admission asking Redis, counted in each of its scopes' `asking` until its
/// answer is in or it is dropped.
struct Asking(Arc<GateKeys>);

impl Asking {
    /// Counts an admission through `k` as asking, unless one of its scopes already has
    /// as many asking as it has room for: then the index of that scope.
    fn take(k: &Arc<GateKeys>) -> Result<Self, usize> {
        for (i, memo) in k.memos.iter().enumerate() {
            let room = memo.room.load(Ordering::Acquire).max(1);
            if memo.asking.fetch_add(1, Ordering::AcqRel) >= room {
                for m in &k.memos[..=i] {
                    m.asking.fetch_sub(1, Ordering::AcqRel);
                }
                return Err(i);
            }
        }
        Ok(Self(Arc::clone(k)))
    }
}

impl Drop for Asking {
    fn drop(&mut self) {
        for m in &self.0.memos {
            m.asking.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl GateKeys {
    /// Each scope's count of leases this process gave back, account first (a limiter
    /// has at most two scopes: its account's and its source's).
    fn release_counts(&self) -> [u64; 2] {
        let mut counts = [0; 2];
        for (c, r) in counts.iter_mut().zip(&self.released) {
            *c = r.load(Ordering::Acquire);
        }
        counts
    }

    /// Whether a settle of this gate may change a count (a request or token quota in
    /// some scope: `limits` holds rpm, tpm and concurrency per scope, -1 unlimited),
    /// and so run the settle script.
    fn settles_counts(&self) -> bool {
        self.limits.chunks_exact(3).any(|l| l[0] >= 0 || l[1] >= 0)
    }

    /// Whether some scope of this gate has a token quota (a count of tokens to give
    /// back).
    fn limits_tokens(&self) -> bool {
        self.limits.chunks_exact(3).any(|l| l[1] >= 0)
    }

    /// Each scope's count of refunds this process sent, account first.
    fn refund_counts(&self) -> [u64; 2] {
        let mut counts = [0; 2];
        for (c, m) in counts.iter_mut().zip(&self.memos) {
            *c = m.refunds.load(Ordering::Acquire);
        }
        counts
    }

    /// Remembers that scope `i` refuses dimension `dim` (the script's number) for
    /// `wait` ms from `sent` (local ms, when the question was sent: never past the
    /// server's answer), as answered to a question of `tokens` sent when the scopes'
    /// refund and release counts were `refunds` and `released`. Not when a refund of
    /// the scope that can free it was sent since (see [`refund_frees`]): it may have
    /// freed what refused.
    #[allow(clippy::too_many_arguments)]
    fn remember(
        &self,
        i: usize,
        dim: i64,
        sent: i64,
        wait: i64,
        tokens: u64,
        refunds: [u64; 2],
        released: [u64; 2],
    ) {
        let (Some(memo), Some(limits)) = (self.memos.get(i), self.limits.get(3 * i..3 * i + 3)) else {
            return;
        };
        let before = refunds.get(i).copied().unwrap_or(0);
        let since = |now: u64| refund_frees(dim, now.wrapping_sub(before));
        if wait <= 0 || since(memo.refunds.load(Ordering::Acquire)) {
            return;
        }
        let mut known = lock(&memo.refused);
        // Checked again under the lock a refund takes.
        if !since(memo.refunds.load(Ordering::Acquire)) {
            // Other processes give back too: a token refusal is trusted for one
            // sub-window, then one admission asks again (tokens come back with nearly
            // every settle; its wait is still answered whole). A request count is
            // trusted for its whole wait, until the oldest sub-window leaves: another
            // process's refund of a request is rare, and that process takes the
            // request itself first (its own refund forgets its refusal).
            let trusted = if dim == 2 {
                wait.min(self.sub_ms.max(1))
            } else {
                wait
            };
            *known = Some(Refusal {
                until_ms: sent.saturating_add(wait),
                trusted_ms: sent.saturating_add(trusted),
                dim,
                tokens,
                released: released.get(i).copied().unwrap_or(0),
                limits: [limits[0], limits[1], limits[2]],
            });
        }
    }

    /// One refund (`refund`: see [`REQUEST_REFUND`]) of each scope: forgets the
    /// remembered refusals it can free. Tokens alone free no request or slot: an rpm
    /// refusal outlives the refunds of tokens that nearly every settle sends (an
    /// estimate above the usage).
    fn count_refund(&self, refund: u64) {
        for memo in &self.memos {
            let mut known = lock(&memo.refused);
            memo.refunds.fetch_add(refund, Ordering::AcqRel);
            if known.is_some_and(|r| refund_frees(r.dim, refund)) {
                *known = None;
            }
        }
    }

    /// One lease given back: a slot of each scope.
    fn count_release(&self) {
        for r in &self.released {
            r.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// A refusal this process remembers, and answers again without a round trip while it
/// [`holds`](Refusal::holds).
///
/// What it answers, and for how long:
/// - a request count (`rpm`, dimension 1) frees when the oldest sub-window leaves, or
///   when another process gives a request back (a refund, unseen here, and rare):
///   trusted for its whole wait;
/// - tokens (`tpm`, 2) come back with nearly every settle of another process (a call
///   using fewer than it reserved): trusted for one sub-window, then one admission
///   asks again; only for an admission asking at least as many tokens (a smaller one
///   may fit);
/// - a concurrency slot (3) frees when a lease ends: until the earliest lease's expiry
///   or the slot hint, while this process gives back no lease of that scope (another
///   process's release is seen when the memory ends: at most the slot hint late);
/// - holds (4) are kept in the book instead, where every limiter of the backend sees
///   them ([`GateKeys::ends`]).
///
/// A refund from this process that can free it (requests for `rpm`, requests or tokens
/// for `tpm`) forgets it at once, and a refusal answered across one is not kept.
///
/// It is kept per scope ([`ScopeMemo`]), so every limiter of the backend with that
/// scope answers it: a refusal by an account's quota, learnt through one of its
/// sources, refuses the account's other sources too (P6's Redis mode: the rounds of a
/// waiting call asked s1, s4 and s5 in turn, each a refused round trip), as long as
/// they ask for the same quota of it.
#[derive(Clone, Copy, Debug)]
struct Refusal {
    /// Until when (local ms since the book's base), counted from when it was asked.
    until_ms: i64,
    /// Until when it is answered without a round trip: `until_ms`, or one sub-window
    /// after the question for a token refusal (another process's refund frees it
    /// unseen).
    trusted_ms: i64,
    /// The dimension, as the script numbers it.
    dim: i64,
    /// `tpm`: the tokens asked.
    tokens: u64,
    /// Concurrency: the scope's count of releases when it was asked.
    released: u64,
    /// The scope's quota as the refused limiter asked for it (rpm, tpm, concurrency;
    /// -1 unlimited): another limiter with a different quota for the scope asks.
    limits: [i64; 3],
}

impl Refusal {
    /// Whether it still refuses an admission of `tokens` at `at_ms` through limiter `k`,
    /// whose scope `i` it is.
    fn holds(&self, k: &GateKeys, i: usize, at_ms: i64, tokens: u64) -> bool {
        at_ms < self.trusted_ms
            && k.limits.get(3 * i..3 * i + 3) == Some(&self.limits[..])
            && match self.dim {
                1 => true,
                2 => tokens >= self.tokens,
                3 => k
                    .released
                    .get(i)
                    .is_some_and(|r| r.load(Ordering::Acquire) == self.released),
                _ => false,
            }
    }
}

/// One scope's memory in this process, shared by every limiter of the backend with
/// the scope: its last refusal, the refunds sent for it, and how many may ask at once.
#[derive(Debug)]
struct ScopeMemo {
    /// The last refusal learnt (see [`Refusal`]).
    refused: Mutex<Option<Refusal>>,
    /// Refunds this process sent that touch the scope: a refusal answered across one
    /// that could free it is not remembered (it may have been judged before the refund
    /// landed). Counted by what they give back: [`REQUEST_REFUND`] per refund of
    /// requests, plus one per refund of tokens (see [`refund_frees`]).
    refunds: AtomicU64,
    /// Requests or slots the scope had left at the last answer (`i64::MAX`: none yet,
    /// or nothing counted; 0 after a refusal): how many may ask at once (at least one;
    /// see [`PROBE_RETRY`]).
    room: AtomicI64,
    /// Admissions asking Redis now, through any limiter of the backend.
    asking: AtomicI64,
}

impl Default for ScopeMemo {
    fn default() -> Self {
        Self {
            refused: Mutex::new(None),
            refunds: AtomicU64::new(0),
            room: AtomicI64::new(i64::MAX),
            asking: AtomicI64::new(0),
        }
    }
}

/// What a refund of requests adds to a scope's [`ScopeMemo::refunds`]; a refund of
/// tokens adds one (the low half counts those, the high half refunds of requests).
const REQUEST_REFUND: u64 = 1 << 32;

/// Whether refunds that moved a scope's count by `delta` (see [`REQUEST_REFUND`]) can
/// free what refused in dimension `dim` (the script's number): requests free an rpm
/// refusal, and requests or tokens a tpm one (a refund of requests gives their tokens
/// back too); a slot is freed by a release, never by a refund (see [`Refusal`]).
const fn refund_frees(dim: i64, delta: u64) -> bool {
    let (requests, tokens) = (delta >> 32, delta & (REQUEST_REFUND - 1));
    match dim {
        1 => requests != 0,
        2 => requests != 0 || tokens != 0,
        3 => false,
        _ => delta != 0,
    }
}

/// The script's dimension number, as [`QuotaExceeded`] names it.
const fn dim_name(dim: i64) -> Option<&'static str> {
    match dim {
        1 => Some("rpm"),
        2 => Some("tpm"),
        3 => Some("concurrency"),
        4 => Some("hold"),
        _ => None,
    }
}

/// The refusal of a hold ending at server millisecond `end`, `wait` ms from now: an
/// odd end was placed after an overloaded provider's pushback (`hold.lua`).
fn hold_refusal(end: i64, wait: i64) -> QuotaExceeded {
    let q = QuotaExceeded::new("hold", millis(wait));
    if end & 1 == 1 { q.after_overload() } else { q }
}

/// One limiter's keys in a [`RedisBackend`].
#[derive(Clone)]
pub(crate) struct RedisGate {
    conn: RedisConn,
    book: Arc<HoldBook>,
    /// `Some` when no scope limits anything: admission reads cached holds.
    cache: Option<Arc<HoldCache>>,
    inner: Arc<GateKeys>,
}

impl fmt::Debug for RedisGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisGate")
            .field("scopes", &self.inner.labels)
            .finish_non_exhaustive()
    }
}

/// Takes the gate's deferred refunds into a script's arguments (see [`refund_args`]),
/// and answers them.
fn carry_deferred(inv: &mut redis::ScriptInvocation<'static>, k: &GateKeys) -> Vec<(i64, i64)> {
    let carried = std::mem::take(&mut lock(&k.deferred).refunds);
    refund_args(inv, &carried);
    carried
}

/// The settle script on gate `k`'s keys, up to its limits (`settle.lua`'s arguments
/// but the refunds it carries): the sub-window of admission `at_ms` (server ms), the
/// changes of requests and tokens, and the lease (`""`: none).
fn settle_invocation(
    k: &GateKeys,
    at_ms: u64,
    requests: i64,
    tokens: i64,
    lease: String,
) -> redis::ScriptInvocation<'static> {
    let mut inv = SETTLE.prepare_invoke();
    for key in &k.settle_keys {
        inv.key(key);
    }
    inv.arg(k.n)
        .arg(k.sub_ms)
        .arg(k.subs)
        .arg(at_ms)
        .arg(requests)
        .arg(tokens)
        .arg(lease);
    for l in &k.limits {
        inv.arg(*l);
    }
    inv
}

/// Refunds as `admit.lua` and `settle.lua` read them: their count, then each
/// sub-window of admission (server ms) and its tokens.
fn refund_args(inv: &mut redis::ScriptInvocation<'static>, refunds: &[(i64, i64)]) {
    inv.arg(refunds.len());
    for (at, tokens) in refunds {
        inv.arg(*at).arg(*tokens);
    }
}

/// A scheduled flush of a gate's deferred refunds: clears the gate's `armed` flag if
/// its task is dropped (with its runtime) before the flush took the refunds. Once it
/// took them, the flag is another flush's.
struct Armed {
    gate: RedisGate,
    /// The flush has not taken the refunds yet.
    live: bool,
}

impl Drop for Armed {
    fn drop(&mut self) {
        if self.live {
            lock(&self.gate.inner.deferred).armed = false;
        }
    }
}

/// A key unique to one settle, in the hash slot of the gate's keys (the first scope's
/// window key, extended): `settle.lua`'s marker for a settle without a lease.
fn settle_marker(k: &GateKeys) -> String {
    let id = unique_id(crate::limiter::next_lease().get());
    match k.settle_keys.first() {
        Some(w) => format!("{w}:settled:{id}"),
        None => format!("settled:{id}"),
    }
}

fn lease_member(id: LeaseId) -> String {
    unique_id(id.get())
}

fn millis(v: i64) -> Duration {
    Duration::from_millis(u64::try_from(v).unwrap_or(0))
}

fn garbage(operation: &'static str, reply: &[i64]) -> BackendUnavailable {
    BackendUnavailable::new("redis", operation, format!("unexpected script reply {reply:?}"))
}

impl RedisGate {
    /// Sends one admission script and waits up to `timeout` for its answer. Past it,
    /// the caller hears `BackendUnavailable`, and the script may still run (queued
    /// behind a slow server): its answer is read when it comes, in a task of its own,
    /// and an admission it reports is undone at once (its request, tokens and lease
    /// given back through `late`), instead of staying charged for its window and its
    /// lease TTL. The connection must wait longer than `timeout` for an answer for
    /// that (`RedisConn::connect` waits [`pgw_core::redis_conn::LATE_ANSWER_WAIT`]).
    ///
    /// `carried`: the deferred refunds the question carries. Put back when the
    /// connection was refused (the question never went out); lost otherwise on an
    /// error (the script may have run them): the window then counts them until they
    /// leave it, more than was used, never less.
    async fn ask_admission(
        inv: redis::ScriptInvocation<'static>,
        mut conn: RedisConn,
        timeout: Duration,
        late: Self,
        tokens: u64,
        lease: Option<LeaseId>,
        carried: Vec<(i64, i64)>,
    ) -> Result<Vec<i64>, BackendUnavailable> {
        let mut question = Box::pin(async move { inv.invoke_async::<Vec<i64>>(&mut conn).await });
        match tokio::time::timeout(timeout, question.as_mut()).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => {
                if e.is_connection_refusal() && !carried.is_empty() {
                    late.put_back(carried);
                }
                // Whether the script ran is unknown (a connection that broke after the
                // question went out, an error part-way through): its lease is given
                // back blindly (a lease it never took is not there to remove). Not
                // when the connection was refused: the question never went out, and
                // an outage would double every failing admission. Its request and
                // tokens stay charged: giving back what may never have been counted
                // would let a window overfill.
                if let Some(lease) = lease.filter(|_| !e.is_connection_refusal()) {
                    late.release_in_background(lease);
                }
                Err(BackendUnavailable::new("redis", "admit", e))
            }
            Err(_) => {
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(async move {
                        let reply = match tokio::time::timeout(LATE_ANSWER_WAIT, question).await {
                            Ok(Ok(reply)) => reply,
                            late_answer => {
                                // Whether it ran is unknown, as after a connection that
                                // broke: its request and tokens stay charged, its lease
                                // is given back blindly.
                                let error = match late_answer {
                                    Ok(Err(e)) => e.to_string(),
                                    _ => format!("no answer within {LATE_ANSWER_WAIT:?} more"),
                                };
                                tracing::warn!(
                                    scopes = ?late.inner.labels,
                                    %error,
                                    "an admission that timed out never answered; its request and tokens stay charged for their window"
                                );
                                if let Some(lease) = lease {
                                    late.release_in_background(lease);
                                }
                                return;
                            }
                        };
                        if let [1, now, ..] = reply.as_slice() {
                            let undo = Settle {
                                at: millis(*now),
                                requests: -1,
                                tokens: -i64::try_from(tokens).unwrap_or(i64::MAX),
                                lease,
                            };
                            tracing::debug!(scopes = ?late.inner.labels, "an admission answered after its timeout: undone");
                            // The gate's settle neither logs nor counts (the limiter's
                            // does, and no limiter is at hand here): logged here.
                            if let Err(e) = Gate::settle(&late, undo).await {
                                tracing::warn!(
                                    scopes = ?late.inner.labels,
                                    error = %e,
                                    "undoing an admission answered after its timeout failed; it stays charged (a lease until its TTL)"
                                );
                            }
                        }
                    });
                }
                Err(BackendUnavailable::new(
                    "redis",
                    "admit",
                    format!("no answer within {timeout:?}"),
                ))
            }
        }
    }

    /// The verdict on the cached holds at local instant `at` (a limiter with nothing
    /// else to enforce): the longest hold wins, account first on ties, as in the script.
    ///
    /// The ends are read before the clock offset, with `Acquire`: every writer stores
    /// the offset the answer brought before it publishes an end (`Release`), so an end
    /// read here comes with its offset. Read the other way round, the first hold a
    /// process learned could meet the offset's initial 0 and wait 54 years.
    fn judge_cached(book: &HoldBook, k: &GateKeys, at: Instant) -> Verdict {
        let mut latest: Option<(usize, i64)> = None;
        for (i, end) in k.ends.iter().enumerate() {
            let end = end.load(Ordering::Acquire);
            if latest.is_none_or(|(_, e)| end > e) {
                latest = Some((i, end));
            }
        }
        let now = book.server_ms(at);
        let worst = latest
            .map(|(i, end)| (i, end.saturating_sub(now)))
            .filter(|&(_, wait)| wait > 0);
        match worst {
            Some((i, wait)) => {
                Verdict::Refused(Box::new(hold_refusal(now + wait, wait).with_scope(&*k.labels[i])))
            }
            None => Verdict::Admitted {
                at: nanos(millis(now)),
            },
        }
    }

    /// Reads the scopes' holds and the server clock into the book (`peek.lua`).
    fn refresh(
        &self,
        cache: Arc<HoldCache>,
    ) -> impl std::future::Future<Output = Result<(), BackendUnavailable>> + Send + 'static {
        let mut inv = PEEK.prepare_invoke();
        for (_, key) in &self.inner.hold_keys {
            inv.key(key);
        }
        let mut conn = self.conn.clone();
        let book = self.book.clone();
        let inner = self.inner.clone();
        async move {
            let sent = Instant::now();
            let r: Result<Vec<i64>, _> = run("admit", inner.timeout, inv.invoke_async(&mut conn)).await;
            cache.refreshing.store(false, Ordering::Release);
            let reply = r?;
            let [now, ends @ ..] = reply.as_slice() else {
                return Err(garbage("admit", &reply));
            };
            if ends.len() != inner.ends.len() {
                return Err(garbage("admit", &reply));
            }
            book.saw_server(*now, Instant::now());
            for (slot, &end) in inner.ends.iter().zip(ends) {
                slot.fetch_max(end, Ordering::Release);
            }
            cache
                .refreshed_ms
                .fetch_max(book.local_ms(sent), Ordering::Release);
            Ok(())
        }
    }

    /// Admission with nothing to enforce but holds: from the cache, without a round
    /// trip while it is fresh; refreshed in the background once half its age limit has
    /// passed; waited for only when older than that limit.
    fn admit_cached(&self, cache: &Arc<HoldCache>) -> BackendFuture<Result<Verdict, BackendUnavailable>> {
        let at = Instant::now();
        let refreshed = cache.refreshed_ms.load(Ordering::Acquire);
        let age = self.book.local_ms(at).saturating_sub(refreshed);
        if refreshed == NEVER || age >= cache.every_ms {
            let refresh = self.refresh(cache.clone());
            let book = self.book.clone();
            let inner = self.inner.clone();
            return BackendFuture::Pending(Box::pin(async move {
                refresh.await?;
                Ok(Self::judge_cached(&book, &inner, Instant::now()))
            }));
        }
        if age >= cache.every_ms / 2 && !cache.refreshing.swap(true, Ordering::AcqRel) {
            let refresh = self.refresh(cache.clone());
            let source = self.inner.labels.last().cloned();
            crate::limiter::detach(BackendFuture::Pending(Box::pin(async move {
                if let Err(e) = refresh.await {
                    // The next admission past the age limit waits for a read, and
                    // fails closed if it fails too.
                    tracing::warn!(scope = ?source, error = %e, "rate limit hold refresh failed");
                }
            })));
        }
        BackendFuture::ready(Ok(Self::judge_cached(&self.book, &self.inner, at)))
    }
}

impl RedisGate {
    /// The local refusal of an admission while as many as scope `i` has room for are
    /// asking: the last refusal's dimension, scope `i`, asked again after
    /// [`PROBE_RETRY`].
    fn while_asking(k: &GateKeys, i: usize) -> Box<QuotaExceeded> {
        let last = k.last_refusal.load(Ordering::Relaxed);
        let dim = i64::try_from(last >> 8)
            .ok()
            .and_then(dim_name)
            .unwrap_or("concurrency");
        let label = k.labels.get(i).or_else(|| k.labels.last());
        let q = QuotaExceeded::new(dim, PROBE_RETRY);
        Box::new(match label {
            Some(l) => q.with_scope(&**l),
            None => q,
        })
    }

    /// Loads the settle script on the server, once per backend, in its first admission
    /// that may need it. A settle is sent without being waited for
    /// ([`Permit::finish_detached`](crate::Permit::finish_detached)): the first one on a
    /// server, answered NOSCRIPT, was loaded and sent again after whatever the caller
    /// sent meanwhile, so the caller's next admission did not see what it gave back.
    /// The settles that only give a lease back send no script (`ZREM`s), so a process
    /// may settle many calls before the script's first use. A failure is left to the
    /// admission that follows (and the script is then loaded by its first use).
    async fn load_settle(book: &HoldBook, conn: &RedisConn, timeout: Duration) {
        let mut conn = conn.clone();
        let loaded: Result<String, _> =
            run("load", timeout, SETTLE.prepare_invoke().load_async(&mut conn)).await;
        if loaded.is_ok() {
            book.settle_loaded.store(true, Ordering::Relaxed);
        }
    }

    /// Gives `lease` back in a task of its own (when a runtime is at hand), logging a
    /// failure: the lease of an admission whose answer was an error.
    fn release_in_background(self, lease: LeaseId) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            // Not counted as a release: it may free nothing, and the count would
            // make this process forget the slot refusals it remembers.
            match self.zrem_lease(lease).await {
                Ok(()) => {
                    tracing::debug!(scopes = ?self.inner.labels, "the lease of an admission answered with an error: given back");
                }
                // Redis is failing already: its admissions say so, at their level.
                Err(e) => tracing::debug!(
                    scopes = ?self.inner.labels,
                    error = %e,
                    "giving back the lease of an admission answered with an error failed; it stays until its TTL"
                ),
            }
        });
    }

    /// The settle of a permit whose counts stay as they are: only its lease goes, by a
    /// `ZREM` per scope with a concurrency quota, pipelined (one round trip, and no
    /// script: the settle script's `EVALSHA` was half of this settle's commands, and
    /// two in five settles of the Redis-mode soak change no count). With nothing to
    /// give back, a lease already gone changes nothing either.
    fn release(&self, lease: LeaseId) -> BackendFuture<Result<(), BackendUnavailable>> {
        let done = self.zrem_lease(lease);
        let k = Arc::clone(&self.inner);
        BackendFuture::Pending(Box::pin(async move {
            let done = done.await;
            // As the settle script's landing: counted whether or not the answer came.
            k.count_release();
            done
        }))
    }

    /// Removes `lease` from every lease zset of the gate (one pipelined round trip).
    fn zrem_lease(
        &self,
        lease: LeaseId,
    ) -> impl Future<Output = Result<(), BackendUnavailable>> + Send + 'static {
        let k = &*self.inner;
        let member = lease_member(lease);
        let mut pipe = redis::pipe();
        for key in &k.lease_keys {
            pipe.zrem(key, &member).ignore();
        }
        let mut conn = self.conn.clone();
        let timeout = k.timeout;
        async move { run("settle", timeout, pipe.query_async(&mut conn)).await }
    }

    /// Defers a refund of `tokens` (negative) admitted at server ms `at_ms` to the
    /// next admission (see [`Deferred`]).
    fn defer_refund(&self, at_ms: i64, tokens: i64) {
        let sub = self.inner.sub_ms.max(1);
        self.put_back(vec![(at_ms - at_ms.rem_euclid(sub), tokens)]);
    }

    /// Adds refunds (sub-window of admission, tokens) to the deferred ones, scheduling
    /// a flush [`deferral_subs`] sub-windows from now if none is, or flushing at once
    /// past [`MAX_DEFERRED`] sub-windows of admission.
    fn put_back(&self, refunds: Vec<(i64, i64)>) {
        let k = &*self.inner;
        let mut deferred = lock(&k.deferred);
        for (at, tokens) in refunds {
            deferred.add(at, tokens);
        }
        let now = deferred.refunds.len() > MAX_DEFERRED;
        if deferred.armed && !now {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // No runtime to send them from: the next admission carries them.
            return;
        };
        deferred.armed = true;
        drop(deferred);
        let wait = if now {
            Duration::ZERO
        } else {
            millis(k.sub_ms.max(1).saturating_mul(deferral_subs(k.subs)))
        };
        // Disarmed however the task ends (run, or dropped with its runtime), so a
        // later refund schedules another.
        let mut armed = Armed {
            gate: self.clone(),
            live: true,
        };
        rt.spawn(async move {
            tokio::time::sleep(wait).await;
            Self::flush_deferred(&mut armed).await;
        });
    }

    /// Sends the refunds no admission carried (the settle script, with no lease and
    /// no delta of its own), disarming the gate as it takes them (a refund deferred
    /// meanwhile schedules the next flush). A failure is logged: they stay counted for
    /// their window.
    async fn flush_deferred(armed: &mut Armed) {
        let k = &*armed.gate.inner;
        let refunds = {
            let mut deferred = lock(&k.deferred);
            deferred.armed = false;
            armed.live = false;
            std::mem::take(&mut deferred.refunds)
        };
        if refunds.is_empty() {
            return;
        }
        let mut inv = settle_invocation(k, 0, 0, 0, String::new());
        refund_args(&mut inv, &refunds);
        let mut conn = armed.gate.conn.clone();
        let sent: Result<i64, _> = run("settle", k.timeout, inv.invoke_async(&mut conn)).await;
        if let Err(e) = sent {
            tracing::warn!(
                scopes = ?k.labels,
                error = %e,
                "giving back deferred token refunds failed; they stay counted for their window"
            );
        }
    }

    /// Forgets the remembered concurrency refusals of this gate's scopes: the next
    /// admission asks Redis. For a waiter's last try before its deadline: a lease
    /// another process ended since is unseen here, and the memory may outlast the wait.
    pub(crate) fn forget_slot_refusals(&self) {
        for memo in &self.inner.memos {
            let mut known = lock(&memo.refused);
            if known.is_some_and(|r| r.dim == 3) {
                *known = None;
            }
        }
    }

    /// A refusal this process knows for an admission of `tokens` (see
    /// [`AnyGate::known_refusal`](super::AnyGate::known_refusal)).
    pub(crate) fn known_refusal(&self, tokens: u64) -> Option<Box<QuotaExceeded>> {
        let k = &*self.inner;
        self.known_at(Instant::now(), tokens).or_else(|| {
            // As many are asking as a scope has room for: this one would be refused here.
            k.memos
                .iter()
                .position(|m| m.asking.load(Ordering::Acquire) >= m.room.load(Ordering::Acquire).max(1))
                .map(|i| Self::while_asking(k, i))
        })
    }

    fn known_at(&self, now: Instant, tokens: u64) -> Option<Box<QuotaExceeded>> {
        let k = &*self.inner;
        // A hold any limiter of this backend learnt (placed, or refused by): it ends
        // when it ends, so no round trip asks before.
        if let Verdict::Refused(q) = Self::judge_cached(&self.book, k, now) {
            return Some(q);
        }
        let sent = self.book.local_ms(now);
        // Refused a moment ago and nothing can have freed since: no round trip. The
        // longest wait wins, as in the script.
        let mut worst: Option<(usize, Refusal)> = None;
        for (i, memo) in k.memos.iter().enumerate() {
            let known = *lock(&memo.refused);
            if let Some(r) = known.filter(|r| r.holds(k, i, sent, tokens))
                && worst.is_none_or(|(_, w)| r.until_ms > w.until_ms)
            {
                worst = Some((i, r));
            }
        }
        let (i, r) = worst?;
        let (dim, label) = (dim_name(r.dim)?, k.labels.get(i)?);
        Some(Box::new(
            QuotaExceeded::new(dim, millis(r.until_ms - sent)).with_scope(&**label),
        ))
    }
}

impl Gate for RedisGate {
    fn admit(
        &self,
        tokens: u64,
        lease: Option<LeaseId>,
    ) -> BackendFuture<Result<Verdict, BackendUnavailable>> {
        if let Some(cache) = &self.cache {
            return self.admit_cached(cache);
        }
        let k = &*self.inner;
        let now = Instant::now();
        let sent = self.book.local_ms(now);
        let refunds = k.refund_counts();
        if let Some(q) = self.known_at(now, tokens) {
            return BackendFuture::ready(Ok(Verdict::Refused(q)));
        }
        let asking = match Asking::take(&self.inner) {
            Ok(asking) => asking,
            Err(i) => return BackendFuture::ready(Ok(Verdict::Refused(Self::while_asking(k, i)))),
        };
        let released = k.release_counts();
        let mut inv = ADMIT.prepare_invoke();
        for key in &k.admit_keys {
            inv.key(key);
        }
        inv.arg(k.n)
            .arg(k.window_ms)
            .arg(k.sub_ms)
            .arg(k.subs)
            .arg(tokens)
            .arg(lease.map(lease_member).unwrap_or_default())
            .arg(k.ttl_ms)
            .arg(k.hint_ms);
        for l in &k.limits {
            inv.arg(*l);
        }
        let conn = self.conn.clone();
        let inner = self.inner.clone();
        let book = self.book.clone();
        let late = Self {
            cache: None,
            ..self.clone()
        };
        let load_settle = !book.settle_loaded.load(Ordering::Relaxed) && k.settles_counts();
        BackendFuture::Pending(Box::pin(async move {
            let _asking = asking;
            if load_settle {
                Self::load_settle(&book, &conn, inner.timeout).await;
            }
            // Taken as the question goes out: an admission dropped before it asks
            // leaves them to the next.
            let carried = carry_deferred(&mut inv, &inner);
            let reply = Self::ask_admission(inv, conn, inner.timeout, late, tokens, lease, carried).await?;
            match reply.as_slice() {
                // The script's window id is `now / window_ms`: the admission's own.
                [1, now, _win, scope, dim_no, wait, rooms @ ..] => {
                    if rooms.len() != inner.memos.len() {
                        return Err(garbage("admit", &reply));
                    }
                    for (memo, room) in inner.memos.iter().zip(rooms) {
                        memo.room
                            .store(if *room < 0 { i64::MAX } else { *room }, Ordering::Release);
                    }
                    if *dim_no != 0 {
                        // This admission took the last request or slot of a scope:
                        // remembered as the refusal the next admission would get, so
                        // the calls waiting here do not ask first (and, once it ends,
                        // one asks at a time).
                        let i = usize::try_from(*scope)
                            .ok()
                            .filter(|i| *i < inner.labels.len() && dim_name(*dim_no).is_some())
                            .ok_or_else(|| garbage("admit", &reply))?;
                        inner.last_refusal.store(
                            u64::try_from(*dim_no << 8).unwrap_or(0) | i as u64,
                            Ordering::Relaxed,
                        );
                        inner.remember(i, *dim_no, sent, *wait, tokens, refunds, released);
                    }
                    Ok(Verdict::Admitted {
                        at: nanos(millis(*now)),
                    })
                }
                [0, server_now, scope, dim_no, wait] => {
                    let dim = dim_name(*dim_no).ok_or_else(|| garbage("admit", &reply))?;
                    let i = usize::try_from(*scope)
                        .ok()
                        .filter(|i| *i < inner.labels.len())
                        .ok_or_else(|| garbage("admit", &reply))?;
                    let label = &inner.labels[i];
                    inner.last_refusal.store(
                        u64::try_from(*dim_no << 8).unwrap_or(0) | i as u64,
                        Ordering::Relaxed,
                    );
                    // No room in that scope: one admission at a time asks until one is
                    // admitted and tells what is left.
                    inner.memos[i].room.store(0, Ordering::Release);
                    if *dim_no == 4 {
                        // A hold: every limiter of the backend honours it from now on.
                        book.saw_server(*server_now, Instant::now());
                        inner.ends[i].fetch_max(server_now.saturating_add(*wait), Ordering::Release);
                    } else {
                        inner.remember(i, *dim_no, sent, *wait, tokens, refunds, released);
                    }
                    let refusal = if *dim_no == 4 {
                        hold_refusal(server_now.saturating_add(*wait), *wait)
                    } else {
                        QuotaExceeded::new(dim, millis(*wait))
                    };
                    Ok(Verdict::Refused(Box::new(refusal.with_scope(&**label))))
                }
                _ => Err(garbage("admit", &reply)),
            }
        }))
    }

    fn settle(&self, s: Settle) -> BackendFuture<Result<(), BackendUnavailable>> {
        let k = &*self.inner;
        // Something given back: a remembered refusal of its scopes that it can free may
        // no longer hold, nor one answered before this settle lands. Counted now and
        // when it lands, as a release is.
        let refund = if s.requests < 0 { REQUEST_REFUND } else { 0 } + u64::from(s.tokens < 0);
        if refund != 0 {
            k.count_refund(refund);
        }
        // A lease given back frees a slot of each scope it holds: counted now and when
        // the settle lands, so a concurrency refusal answered before it lands is not
        // kept past it.
        let released = s.lease.is_some();
        if released {
            k.count_release();
        }
        // Tokens matter only to a scope with a token quota. A settle that changes no
        // request count and charges no tokens sends no script: tokens given back are
        // deferred (see [`Deferred`]), so an admission this process sends next carries
        // them (even one sent before this settle's future runs), and the lease goes by
        // `ZREM`s.
        //
        // Not on a cluster: its client resends a script whose connection dropped after
        // Redis ran it, and the script carrying the refunds (an admission, a settle, a
        // flush) has no lease to tell a second run by, so it would give them back
        // twice (the settle script's own refund finds its lease gone the second time
        // and gives nothing back; without a lease, its marker, below). A standalone
        // connection sends a script once. There,
        // such a refund does not depend on the lease being still there: a lease that
        // expired before its settle gets its unused tokens back too.
        let tokens = if k.limits_tokens() { s.tokens } else { 0 };
        if s.requests == 0 && (tokens == 0 || (tokens < 0 && !self.conn.is_cluster())) {
            if tokens < 0 {
                self.defer_refund(i64::try_from(s.at.as_millis()).unwrap_or(i64::MAX), tokens);
            }
            return match s.lease {
                Some(lease) => self.release(lease),
                None => BackendFuture::ready(Ok(())),
            };
        }
        let leaseless = s.lease.is_none();
        let mut inv = settle_invocation(
            k,
            u64::try_from(s.at.as_millis()).unwrap_or(u64::MAX),
            s.requests,
            tokens,
            s.lease.map(lease_member).unwrap_or_default(),
        );
        if leaseless && refund != 0 && self.conn.is_cluster() {
            // No lease to tell a second run of this script by (a cluster client resends
            // one whose answer it lost): a marker of its own, set once (`SET NX`, kept
            // 30 s), so a second run gives nothing back again. One command more, on a
            // cluster only, for a settle that gives back without a lease: nearly every
            // call of a limiter with a token quota and no concurrency quota (an
            // estimate above the usage gives tokens back).
            inv.key(settle_marker(k));
        }
        let mut conn = self.conn.clone();
        let timeout = k.timeout;
        // One reference for the counts when it lands and the warning.
        let k = Arc::clone(&self.inner);
        BackendFuture::Pending(Box::pin(async move {
            // Refunds deferred so far go along.
            carry_deferred(&mut inv, &k);
            let applied: Result<i64, _> = run("settle", timeout, inv.invoke_async(&mut conn)).await;
            // Counted whether or not the answer came: a settle that timed out may still
            // run, and a count too many only forgets a refusal (one more question).
            if released {
                k.count_release();
            }
            if refund != 0 {
                k.count_refund(refund);
            }
            if applied? == 2 {
                tracing::warn!(
                    scopes = ?k.labels,
                    "a settle found its concurrency lease gone, or its marker set (it \
                     expired, or this settle already ran: a cluster client resent it): \
                     its refund was not given back again, the reservation stays counted \
                     for its window"
                );
            }
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
        overloaded: bool,
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
        inv.arg(u8::from(overloaded));
        let mut conn = self.conn.clone();
        let timeout = k.timeout;
        let book = self.book.clone();
        let ends: Vec<_> = k
            .hold_keys
            .iter()
            .zip(&k.ends)
            .filter(|((kind, _), _)| kind.held_by(which, k.has_account))
            .map(|(_, end)| end.clone())
            .collect();
        BackendFuture::Pending(Box::pin(async move {
            let reply: Vec<i64> = run("hold", timeout, inv.invoke_async(&mut conn)).await?;
            match reply.as_slice() {
                [now, untils @ ..] if untils.len() == ends.len() => {
                    // Every limiter of this backend honours it from now on, also those
                    // that admit from the cache. Each key's own end: a longer hold
                    // already there stays, with its reason (its end's parity).
                    book.saw_server(*now, Instant::now());
                    for (end, until) in ends.iter().zip(untils) {
                        end.fetch_max(*until, Ordering::Release);
                    }
                    Ok(millis(untils.iter().copied().fold(*now, i64::max)))
                }
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
