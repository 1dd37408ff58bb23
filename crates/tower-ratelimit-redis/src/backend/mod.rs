//! Where the limiter's state lives: [`MemoryBackend`] (one process, tokio clock) or
//! [`RedisBackend`] (every process, Redis server clock). Both keep one contract, checked
//! by one test suite.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use pgw_core::{BackendUnavailable, QuotaExceeded};
use tokio::time::Instant;

use crate::config::{Quota, RateLimitConfig};

pub(crate) mod memory;
pub(crate) mod redis;
mod sliding;
mod window;

pub use memory::MemoryBackend;
pub use redis::{PROBE_RETRY, RedisBackend};

/// The shared state of the limiter: memory or Redis.
#[derive(Clone, Debug)]
pub enum Backend {
    /// One process; windows on the tokio clock.
    Memory(MemoryBackend),
    /// Every process sharing one Redis (standalone or cluster); windows on the server clock.
    Redis(RedisBackend),
}

impl From<MemoryBackend> for Backend {
    fn from(b: MemoryBackend) -> Self {
        Self::Memory(b)
    }
}

impl From<RedisBackend> for Backend {
    fn from(b: RedisBackend) -> Self {
        Self::Redis(b)
    }
}

impl Backend {
    pub(crate) fn bind(&self, config: &RateLimitConfig) -> AnyGate {
        let scopes = ScopeSpec::of(config);
        match self {
            Self::Memory(m) => AnyGate::Memory(m.bind(scopes, config)),
            Self::Redis(r) => AnyGate::Redis(r.bind(&scopes, config)),
        }
    }
}

/// Nanoseconds in `d`, saturating (u64 nanoseconds last 584 years).
#[inline]
pub(crate) fn nanos(d: Duration) -> u64 {
    d.as_secs()
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::from(d.subsec_nanos()))
}

/// The clock an [`Admission`](crate::Admission)'s instant is read on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clock {
    /// The Redis server's `TIME`: instants are durations since the Unix epoch.
    RedisServer,
    /// The tokio clock of the process: instants are durations since the memory backend
    /// was created.
    Tokio,
}

/// Which scope a [`hold`](crate::RateLimiter::hold) applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldScope {
    /// The source only.
    Source,
    /// The account only (every source of the account); the source alone if it has none.
    Account,
    /// The source and its account, in one round trip.
    Both,
}

impl HoldScope {
    /// [`Both`](Self::Both) for a pushback the provider said is the account's, else
    /// [`Source`](Self::Source) (as [`pgw_core::Hold`]'s `hold` and `hold_source`).
    pub(crate) const fn of(account_wide: bool) -> Self {
        if account_wide { Self::Both } else { Self::Source }
    }
}

/// What a limiter's scopes hold in the backend right now: the answer of
/// [`RateLimiter::held`](crate::RateLimiter::held).
///
/// Read on the backend's clock, in one round trip, changing nothing. A lease counts
/// while it is unexpired: one whose release failed (the backend was unreachable) is
/// held until its TTL runs out, and then no longer.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Held {
    /// The source's scope.
    pub source: ScopeHeld,
    /// The account's scope, when the source has an account.
    pub account: Option<ScopeHeld>,
}

impl Held {
    /// The scopes, account first (the order of [`RedisBackend::keys`]).
    pub fn scopes(&self) -> impl Iterator<Item = &ScopeHeld> {
        self.account.iter().chain(std::iter::once(&self.source))
    }

    /// Concurrency leases held in every scope together.
    #[must_use]
    pub fn leases(&self) -> u64 {
        self.scopes().map(|s| s.leases).sum()
    }
}

/// What one scope (a source or an account) holds in the backend right now.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScopeHeld {
    /// `source:NAME` or `account:NAME`, as in [`QuotaExceeded::scope`].
    pub scope: String,
    /// Unexpired concurrency leases in the scope (of every process and every source
    /// sharing it). Zero when the scope has no concurrency limit.
    pub leases: u64,
    /// How long until the last of those leases expires by its TTL, if nothing
    /// releases or renews it; `None` when no lease is held.
    pub leases_expire_in: Option<Duration>,
    /// How much longer the scope is held (not admitted, see
    /// [`RateLimiter::hold`](crate::RateLimiter::hold)); `None` when no hold is active.
    pub hold_ends_in: Option<Duration>,
}

/// Whether a scope is a source or an account.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ScopeKind {
    Source,
    Account,
}

/// One scope of a limiter, as the backends see it.
#[derive(Clone, Debug)]
pub(crate) struct ScopeSpec {
    pub(crate) kind: ScopeKind,
    pub(crate) quota: Quota,
    /// `source:NAME` or `account:NAME`: the name used in errors and state.
    pub(crate) label: Arc<str>,
}

impl ScopeSpec {
    /// The scopes of a limiter, account first (the order every backend locks or lists
    /// them in).
    fn of(config: &RateLimitConfig) -> Vec<Self> {
        let mut v = Vec::with_capacity(2);
        if let Some((a, q)) = &config.account {
            v.push(Self {
                kind: ScopeKind::Account,
                quota: *q,
                label: Arc::from(format!("account:{a}")),
            });
        }
        v.push(Self {
            kind: ScopeKind::Source,
            quota: config.source_quota,
            label: Arc::from(format!("source:{}", config.source)),
        });
        v
    }

    pub(crate) fn held_by(&self, which: HoldScope, has_account: bool) -> bool {
        self.kind.held_by(which, has_account)
    }
}

impl ScopeKind {
    /// Whether a hold of `which` covers a scope of this kind.
    pub(crate) const fn held_by(self, which: HoldScope, has_account: bool) -> bool {
        match (which, self) {
            (HoldScope::Both, _)
            | (HoldScope::Source, ScopeKind::Source)
            | (HoldScope::Account, ScopeKind::Account) => true,
            (HoldScope::Account, ScopeKind::Source) => !has_account,
            (HoldScope::Source, ScopeKind::Account) => false,
        }
    }
}

/// A concurrency lease id, unique in this process (the Redis backend adds a process
/// nonce). Never 0, so an `Option<LeaseId>` (in every permit) takes 8 bytes.
pub(crate) type LeaseId = std::num::NonZeroU64;

/// The backend's answer to an admission.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Admitted at `at` (nanoseconds on the backend's clock; the aligned window's id
    /// follows from it, computed when asked: [`Admission::window`](crate::Admission::window)).
    Admitted { at: u64 },
    /// Not admitted (boxed: the error it becomes is, and the verdict stays small).
    Refused(Box<QuotaExceeded>),
}

/// What settling an admission changes: refunds go back to the sub-window of the
/// admission instant `at` (on the backend's clock), charges to the sub-window the
/// settle lands in.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settle {
    pub(crate) at: Duration,
    pub(crate) requests: i64,
    pub(crate) tokens: i64,
    pub(crate) lease: Option<LeaseId>,
}

impl Settle {
    pub(crate) const fn is_noop(&self) -> bool {
        self.requests == 0 && self.tokens == 0 && self.lease.is_none()
    }
}

/// One limiter's view of a backend: its scopes resolved to state cells or keys.
pub(crate) trait Gate: Send + Sync + fmt::Debug {
    /// Checks and reserves every dimension of every scope, all or nothing.
    fn admit(
        &self,
        tokens: u64,
        lease: Option<LeaseId>,
    ) -> BackendFuture<Result<Verdict, BackendUnavailable>>;
    /// Reconciles or refunds, and releases the lease.
    fn settle(&self, settle: Settle) -> BackendFuture<Result<(), BackendUnavailable>>;
    /// Extends a lease; `false` when it had already expired.
    fn renew(&self, lease: LeaseId) -> BackendFuture<Result<bool, BackendUnavailable>>;
    /// Holds scopes for `duration`; answers when their holds end on the backend's
    /// clock (this one's, or a longer one already there, which keeps its reason).
    /// `overloaded`: placed after an overloaded provider's pushback, not a rate limit
    /// (the refusals it gives say so: [`QuotaExceeded::after_overload`](pgw_core::QuotaExceeded::after_overload)).
    fn hold(
        &self,
        which: HoldScope,
        duration: Duration,
        overloaded: bool,
    ) -> BackendFuture<Result<Duration, BackendUnavailable>>;
    /// Reads what the scopes hold now (leases, holds), changing nothing.
    fn held(&self) -> BackendFuture<Result<Held, BackendUnavailable>>;
    /// The clock admissions are read on.
    fn clock(&self) -> Clock;
}

/// A bound gate, dispatched statically: the memory path inlines into the caller.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "one per limiter, inside its Arc; boxing would add a pointer chase to every admission"
)]
pub(crate) enum AnyGate {
    Memory(memory::MemoryGate),
    Redis(redis::RedisGate),
}

impl Gate for AnyGate {
    #[inline]
    fn admit(
        &self,
        tokens: u64,
        lease: Option<LeaseId>,
    ) -> BackendFuture<Result<Verdict, BackendUnavailable>> {
        match self {
            Self::Memory(g) => BackendFuture::ready(Ok(g.admit_now(tokens, lease))),
            Self::Redis(g) => g.admit(tokens, lease),
        }
    }

    #[inline]
    fn settle(&self, settle: Settle) -> BackendFuture<Result<(), BackendUnavailable>> {
        match self {
            Self::Memory(g) => g.settle(settle),
            Self::Redis(g) => g.settle(settle),
        }
    }

    fn renew(&self, lease: LeaseId) -> BackendFuture<Result<bool, BackendUnavailable>> {
        match self {
            Self::Memory(g) => g.renew(lease),
            Self::Redis(g) => g.renew(lease),
        }
    }

    fn hold(
        &self,
        which: HoldScope,
        duration: Duration,
        overloaded: bool,
    ) -> BackendFuture<Result<Duration, BackendUnavailable>> {
        match self {
            Self::Memory(g) => g.hold(which, duration, overloaded),
            Self::Redis(g) => g.hold(which, duration, overloaded),
        }
    }

    fn held(&self) -> BackendFuture<Result<Held, BackendUnavailable>> {
        match self {
            Self::Memory(g) => g.held(),
            Self::Redis(g) => g.held(),
        }
    }

    fn clock(&self) -> Clock {
        match self {
            Self::Memory(g) => g.clock(),
            Self::Redis(g) => g.clock(),
        }
    }
}

impl AnyGate {
    /// A refusal this process already knows for an admission of `tokens`, with no
    /// round trip and no reservation: the Redis backend's remembered refusal or
    /// known hold. The memory backend answers `None` (its admission is as cheap).
    pub(crate) fn known_refusal(&self, tokens: u64) -> Option<Box<QuotaExceeded>> {
        match self {
            Self::Memory(_) => None,
            Self::Redis(g) => g.known_refusal(tokens),
        }
    }

    /// Forgets remembered concurrency refusals (Redis; the memory backend remembers
    /// none): the next admission asks.
    pub(crate) fn forget_slot_refusals(&self) {
        if let Self::Redis(g) = self {
            g.forget_slot_refusals();
        }
    }

    /// The tokio instant of an admission at `at`, when the backend's clock is the
    /// tokio clock (memory): nothing after the admission reads the clock again.
    pub(crate) fn local(&self, at: u64) -> Option<Instant> {
        match self {
            Self::Memory(g) => Some(g.local(at)),
            Self::Redis(_) => None,
        }
    }
}

/// A backend operation: already done (memory) or a round trip in flight (Redis).
pub(crate) enum BackendFuture<T> {
    Ready(Option<T>),
    Pending(Pin<Box<dyn Future<Output = T> + Send + 'static>>),
}

impl<T> BackendFuture<T> {
    #[inline]
    pub(crate) fn ready(v: T) -> Self {
        Self::Ready(Some(v))
    }

    /// The value, when the operation finished synchronously; else the operation, to await.
    #[inline]
    pub(crate) fn into_ready(self) -> Result<T, Self> {
        match self {
            Self::Ready(Some(v)) => Ok(v),
            other => Err(other),
        }
    }
}

impl<T> Unpin for BackendFuture<T> {}

impl<T> Future for BackendFuture<T> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match self.get_mut() {
            Self::Ready(v) => Poll::Ready(v.take().expect("BackendFuture polled after completion")),
            Self::Pending(f) => f.as_mut().poll(cx),
        }
    }
}

impl<T> fmt::Debug for BackendFuture<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Ready(_) => "BackendFuture::Ready",
            Self::Pending(_) => "BackendFuture::Pending",
        })
    }
}
