//! The limiter of one source: admission, permits (reservations + leases), holds.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use pgw_core::{BackendUnavailable, BoxError, Hold, HoldFuture, QuotaExceeded, SourceId};

use thread_local::ThreadLocal;
use tokio::time::{Instant, Sleep};

use crate::backend::memory::Waiter;
use crate::backend::{
    AnyGate, Backend, BackendFuture, Clock, Gate, Held, HoldScope, LeaseId, Settle, Verdict,
};
use crate::config::{MAX_WAIT_JITTER, RENEW_FRACTION, RateLimitConfig, SLOT_BACKOFF_DOUBLINGS};
use crate::error::{ConfigError, RequestTooLarge, UnknownSource};

/// Lease ids, unique in the process: limiters of one account share the account's
/// lease set (the Redis backend adds a per-process nonce).
static NEXT_LEASE: AtomicU64 = AtomicU64::new(1);

/// One source's rate limiter: its quotas (and its account's), bound to a backend.
///
/// Cheap to clone (an `Arc`). Used by [`RateLimitLayer`](crate::RateLimitLayer), or
/// directly: [`RateLimiter::acquire`] returns a [`Permit`] to settle after the call.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use tower_ratelimit_redis::{MemoryBackend, Quota, RateLimitConfig, RateLimiter};
///
/// let limiter = RateLimiter::new(
///     RateLimitConfig::new("s1", Quota::unlimited().requests(1).tokens(1000)),
///     MemoryBackend::new(),
/// )
/// .unwrap();
/// let permit = limiter.acquire(400).await.unwrap();
/// assert_eq!(permit.admission().tokens(), 400);
/// assert!(limiter.acquire(1).await.is_err()); // one request per minute, any minute
/// permit.finish(Some(250)).await.unwrap(); // real usage: 150 tokens refunded
/// # }
/// ```
#[derive(Clone)]
pub struct RateLimiter {
    inner: Arc<Inner>,
}

struct Inner {
    config: RateLimitConfig,
    gate: AnyGate,
    stats: Stats,
    uses_leases: bool,
    /// Whether any scope limits requests / tokens: a settle changes only what is
    /// limited, and skips the backend when nothing is left to change.
    counts_requests: bool,
    counts_tokens: bool,
    max_tokens: Option<(u64, String)>,
    /// The window in nanoseconds (whole milliseconds, validated): an admission's
    /// window id is its instant divided by it, as the Redis script divides.
    window_ns: u64,
    /// The state of the wait jitter's generator (splitmix64).
    jitter: AtomicU64,
}

impl fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimiter")
            .field("config", &self.inner.config)
            .field("gate", &self.inner.gate)
            .finish_non_exhaustive()
    }
}

/// Counters of the limiter's own health (reconciliation failures are logged *and*
/// counted here; nothing panics).
#[derive(Debug, Default)]
struct Stats {
    /// One counter per thread, written only by its thread: an admission counts
    /// with a load and a store, no read-modify-write (summed when read).
    admitted: ThreadLocal<AtomicU64>,
    refused: AtomicU64,
    unavailable: AtomicU64,
    settle_failures: AtomicU64,
    renew_failures: AtomicU64,
    leases_lost: AtomicU64,
}

/// A snapshot of a limiter's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LimiterStats {
    /// Admissions granted.
    pub admitted: u64,
    /// Admissions refused (`QuotaExceeded`).
    pub refused: u64,
    /// Admissions failed closed because the backend was unreachable.
    pub unavailable: u64,
    /// Reconciliations, refunds or lease releases that failed (logged; the lease then
    /// expires by its TTL, the reservation stays charged).
    pub settle_failures: u64,
    /// Lease renewals that failed (logged).
    pub renew_failures: u64,
    /// Renewals that found their lease already expired.
    pub leases_lost: u64,
}

impl RateLimiter {
    /// A limiter for `config`'s source, with its state in `backend`.
    ///
    /// # Errors
    /// [`ConfigError`] naming the invalid field.
    pub fn new(config: RateLimitConfig, backend: impl Into<Backend>) -> Result<Self, ConfigError> {
        config.validate()?;
        let gate = backend.into().bind(&config);
        let uses_leases = config.source_quota.concurrency.is_some()
            || config
                .account
                .as_ref()
                .is_some_and(|(_, q)| q.concurrency.is_some());
        let quotas = || std::iter::once(&config.source_quota).chain(config.account.as_ref().map(|(_, q)| q));
        let counts_requests = quotas().any(|q| q.requests.is_some());
        let counts_tokens = quotas().any(|q| q.tokens.is_some());
        let max_tokens = config.max_tokens().map(|(t, kind)| {
            let scope = if kind == "account" {
                format!("account:{}", config.account_name().unwrap_or_default())
            } else {
                format!("source:{}", config.source)
            };
            (t, scope)
        });
        let jitter = AtomicU64::new(config.jitter_seed.unwrap_or_else(random_seed));
        let window_ns = crate::config::window_ms(config.window).saturating_mul(1_000_000);
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                gate,
                stats: Stats::default(),
                uses_leases,
                counts_requests,
                counts_tokens,
                max_tokens,
                window_ns,
                jitter,
            }),
        })
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &RateLimitConfig {
        &self.inner.config
    }

    /// The source this limiter guards.
    #[must_use]
    pub fn source(&self) -> &SourceId {
        &self.inner.config.source
    }

    /// The clock admissions are read on.
    #[must_use]
    pub fn clock(&self) -> Clock {
        self.inner.gate.clock()
    }

    /// The limiter's counters.
    #[must_use]
    pub fn stats(&self) -> LimiterStats {
        let s = &self.inner.stats;
        LimiterStats {
            admitted: s.admitted.iter().map(|c| c.load(Ordering::Relaxed)).sum(),
            refused: s.refused.load(Ordering::Relaxed),
            unavailable: s.unavailable.load(Ordering::Relaxed),
            settle_failures: s.settle_failures.load(Ordering::Relaxed),
            renew_failures: s.renew_failures.load(Ordering::Relaxed),
            leases_lost: s.leases_lost.load(Ordering::Relaxed),
        }
    }

    /// How often a live lease is renewed.
    pub(crate) fn renew_every(&self) -> Option<Duration> {
        self.inner
            .uses_leases
            .then(|| self.inner.config.lease_ttl / RENEW_FRACTION)
    }

    /// Starts one admission of `tokens`: refused at once when it can never fit.
    #[inline(always)]
    pub(crate) fn start(&self, tokens: u64) -> Result<Pending, RequestTooLarge> {
        self.check_size(tokens)?;
        let lease = self.inner.uses_leases.then(next_lease);
        Ok(Pending {
            fut: self.inner.gate.admit(tokens, lease),
            ticket: Ticket { tokens, lease },
        })
    }

    /// Forgets the backend's remembered concurrency refusals, so the next admission
    /// asks (a waiter's last try before its deadline).
    pub(crate) fn forget_slot_refusals(&self) {
        self.inner.gate.forget_slot_refusals();
    }

    /// Starts one admission and, when the backend answers at once (memory), concludes
    /// it: the hot path, without the backend future's wrapping.
    #[inline(always)]
    pub(crate) fn start_now(&self, tokens: u64) -> Result<Started, RequestTooLarge> {
        if let AnyGate::Memory(g) = &self.inner.gate {
            self.check_size(tokens)?;
            let lease = self.inner.uses_leases.then(next_lease);
            let ticket = Ticket { tokens, lease };
            return Ok(Started::Now(ticket, g.admit_now(tokens, lease)));
        }
        self.start(tokens).map(Started::Later)
    }

    /// Turns a backend answer into a permit or a boxed not-admitted/unavailable error.
    #[inline(always)]
    pub(crate) fn conclude(
        &self,
        ticket: Ticket,
        verdict: Result<Verdict, BackendUnavailable>,
    ) -> Result<Permit, BoxError> {
        match verdict {
            Ok(Verdict::Admitted { at }) => Ok(self.admitted(&ticket, at)),
            other => Err(self.not_admitted(other)),
        }
    }

    /// The permit of an admitted ticket (counted in the stats).
    #[inline(always)]
    fn admitted(&self, ticket: &Ticket, at: u64) -> Permit {
        let admitted = self.inner.stats.admitted.get_or_default();
        // Only this thread writes its counter (a thread's id is reused only after it
        // exited).
        admitted.store(admitted.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        Permit {
            admission: Admission {
                limiter: self.clone(),
                at,
                tokens: ticket.tokens,
            },
            lease: ticket.lease,
        }
    }

    /// [`conclude`](Self::conclude) for a verdict answered at once.
    #[inline(always)]
    pub(crate) fn conclude_now(&self, ticket: Ticket, verdict: Verdict) -> Result<Permit, BoxError> {
        match verdict {
            Verdict::Admitted { at } => Ok(self.admitted(&ticket, at)),
            refused @ Verdict::Refused(_) => Err(self.not_admitted(Ok(refused))),
        }
    }

    #[cold]
    #[inline(never)]
    fn not_admitted(&self, verdict: Result<Verdict, BackendUnavailable>) -> BoxError {
        let s = &self.inner.stats;
        match verdict {
            Ok(Verdict::Refused(q)) => {
                s.refused.fetch_add(1, Ordering::Relaxed);
                q
            }
            Err(e) => {
                s.unavailable.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(source = %self.inner.config.source, error = %e, "rate limit admission failed closed");
                Box::new(e)
            }
            Ok(Verdict::Admitted { .. }) => unreachable!("admissions are concluded by `conclude`"),
        }
    }

    /// A refusal this limiter already knows, for any admission (of 0 tokens), without
    /// a round trip and without reserving anything: on the Redis backend, a hold it
    /// learnt, a request-count or concurrency refusal it remembers, or, after a
    /// refusal, another admission asking Redis (see the crate's README and
    /// [`PROBE_RETRY`](crate::PROBE_RETRY)); `None` otherwise, and always on the memory backend (whose admission
    /// costs no more). Counted as a refusal in [`stats`](Self::stats).
    ///
    /// For a gate asked before this one, to skip its own round trip for a call this
    /// limiter would refuse anyway: pgw-stack asks it before a source's breaker.
    #[must_use]
    pub fn known_refusal(&self) -> Option<BoxError> {
        let q = self.inner.gate.known_refusal(0)?;
        Some(self.not_admitted(Ok(Verdict::Refused(q))))
    }

    /// Asks for one admission of `tokens` (shedding: one try, no waiting).
    ///
    /// # Errors
    /// [`QuotaExceeded`](pgw_core::QuotaExceeded) when not admitted,
    /// [`RequestTooLarge`] when `tokens` exceeds a window's whole token quota,
    /// [`BackendUnavailable`] when the backend cannot answer (fails closed).
    pub async fn acquire(&self, tokens: u64) -> Result<Permit, BoxError> {
        let Pending { fut, ticket } = match self.start_now(tokens)? {
            Started::Now(ticket, verdict) => return self.conclude_now(ticket, verdict),
            Started::Later(pending) => pending,
        };
        let verdict = match fut.into_ready() {
            Ok(verdict) => verdict,
            Err(fut) => InFlight::new(self.clone(), fut, ticket).await,
        };
        self.conclude(ticket, verdict)
    }

    /// Holds a scope: not admitted until `duration` from now (on the backend's clock),
    /// in every process. One round trip. Answers when the scopes' holds end, on the
    /// backend's clock: this one's, or a longer one already there. A hold only
    /// extends; a shorter one never cuts a longer one. On Redis a hold may end 1 ms
    /// later than asked (the end's parity carries its reason: see
    /// [`hold_after_overload`](Self::hold_after_overload)).
    ///
    /// # Errors
    /// [`BackendUnavailable`] when the backend cannot answer.
    pub async fn hold(&self, scope: HoldScope, duration: Duration) -> Result<Duration, BackendUnavailable> {
        self.inner.gate.hold(scope, duration, false).await
    }

    /// [`hold`](Self::hold) after an overloaded provider's pushback (a 503 or 529 with
    /// `Retry-After`), not a rate limit: the admissions it refuses, in every process,
    /// say so ([`QuotaExceeded::is_after_overload`](pgw_core::QuotaExceeded::is_after_overload)),
    /// so a server answers them 503, not 429. Of two holds of a scope the longer one's
    /// reason counts. On Redis the reason rides in the end's parity (odd: overload;
    /// every process reads it from the end it learns, no extra key or command), so the
    /// end may be 1 ms later than asked, for a [`hold`](Self::hold) too; a hold written
    /// by an older version of this crate has a reason at random.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// use std::time::Duration;
    /// use tower_ratelimit_redis::{HoldScope, MemoryBackend, Quota, RateLimitConfig, RateLimiter};
    ///
    /// let limiter = RateLimiter::new(RateLimitConfig::new("s1", Quota::unlimited()), MemoryBackend::new()).unwrap();
    /// limiter.hold_after_overload(HoldScope::Source, Duration::from_secs(30)).await.unwrap();
    /// let err = limiter.acquire(0).await.unwrap_err();
    /// let q = err.downcast_ref::<pgw_core::QuotaExceeded>().unwrap();
    /// assert_eq!(q.dimension(), "hold");
    /// assert!(q.is_after_overload());
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`BackendUnavailable`] when the backend cannot answer.
    pub async fn hold_after_overload(
        &self,
        scope: HoldScope,
        duration: Duration,
    ) -> Result<Duration, BackendUnavailable> {
        self.inner.gate.hold(scope, duration, true).await
    }

    /// Reads what this limiter's scopes (its source and its account) hold in the
    /// backend right now: unexpired concurrency leases, of every process sharing the
    /// scope, and active holds. One round trip (a read-only script on Redis, on the
    /// server clock); nothing is changed or counted.
    ///
    /// This is the backend's own answer, not this process's counters: a lease whose
    /// release failed ([`LimiterStats::settle_failures`]) is still held here until its
    /// TTL runs out, and a lease no process will release shows up here as long as
    /// something keeps renewing it. Read it after the traffic has stopped to check
    /// that nothing was left behind.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use tower_ratelimit_redis::{MemoryBackend, Quota, RateLimitConfig, RateLimiter};
    ///
    /// let limiter = RateLimiter::new(
    ///     RateLimitConfig::new("s1", Quota::unlimited().concurrency(2))
    ///         .account("acct", Quota::unlimited().concurrency(4)),
    ///     MemoryBackend::new(),
    /// )
    /// .unwrap();
    /// let permit = limiter.acquire(0).await.unwrap();
    /// let held = limiter.held().await.unwrap();
    /// assert_eq!(held.source.leases, 1);
    /// assert_eq!(held.account.as_ref().unwrap().leases, 1);
    /// permit.finish(None).await.unwrap();
    /// assert_eq!(limiter.held().await.unwrap().leases(), 0);
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`BackendUnavailable`] when the backend cannot answer.
    pub async fn held(&self) -> Result<Held, BackendUnavailable> {
        self.inner.gate.held().await
    }

    /// A settle operation with failure logging and counting.
    fn settle(&self, mut settle: Settle) -> BackendFuture<Result<(), BackendUnavailable>> {
        if !self.inner.counts_requests {
            settle.requests = 0;
        }
        if !self.inner.counts_tokens {
            settle.tokens = 0;
        }
        if settle.is_noop() {
            return BackendFuture::ready(Ok(()));
        }
        match self.inner.gate.settle(settle).into_ready() {
            Ok(r) => {
                self.note_settle(r.as_ref().err());
                BackendFuture::ready(r)
            }
            Err(fut) => {
                let this = self.clone();
                BackendFuture::Pending(Box::pin(async move {
                    let r = fut.await;
                    this.note_settle(r.as_ref().err());
                    r
                }))
            }
        }
    }

    fn note_settle(&self, err: Option<&BackendUnavailable>) {
        if let Some(e) = err {
            self.inner.stats.settle_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                source = %self.inner.config.source,
                error = %e,
                "rate limit reconciliation failed; the lease expires by its TTL"
            );
        }
    }

    pub(crate) fn renew(&self, lease: LeaseId) -> BackendFuture<Result<bool, BackendUnavailable>> {
        let this = self.clone();
        let note = move |r: &Result<bool, BackendUnavailable>| match r {
            Ok(true) => {}
            Ok(false) => {
                this.inner.stats.leases_lost.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(source = %this.inner.config.source, "concurrency lease had expired before renewal");
            }
            Err(e) => {
                this.inner.stats.renew_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(source = %this.inner.config.source, error = %e, "concurrency lease renewal failed");
            }
        };
        match self.inner.gate.renew(lease).into_ready() {
            Ok(r) => {
                note(&r);
                BackendFuture::ready(r)
            }
            Err(fut) => BackendFuture::Pending(Box::pin(async move {
                let r = fut.await;
                note(&r);
                r
            })),
        }
    }
}

#[cold]
fn too_large(tokens: u64, max: u64, scope: &str) -> RequestTooLarge {
    RequestTooLarge::new(tokens, max, scope.to_owned())
}

/// A new lease id, unique in this process.
pub(crate) fn next_lease() -> LeaseId {
    LeaseId::MIN.saturating_add(NEXT_LEASE.fetch_add(1, Ordering::Relaxed))
}

/// A seed for a limiter's jitter when none is configured: different in every limiter
/// and process, so waits spread instead of falling in step.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(NEXT_LEASE.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

/// A wait before another try at admission ([`Mode::Wait`](crate::Mode::Wait)).
#[derive(Debug)]
pub(crate) enum Wait {
    /// Redis: a sleep keyed to the refusal's `retry_after`, with jitter.
    Sleep(Pin<Box<Sleep>>),
    /// Memory: a place in the refusing scope's queue, woken when a slot frees for it.
    Queue(Waiter),
}

impl RateLimiter {
    /// Checks only the size of a request: what can never be admitted.
    #[inline]
    pub(crate) fn check_size(&self, tokens: u64) -> Result<(), RequestTooLarge> {
        match &self.inner.max_tokens {
            Some((max, scope)) if tokens > *max => Err(too_large(tokens, *max, scope)),
            _ => Ok(()),
        }
    }

    /// How to wait out `refused` (the `refusals`-th in a row): a place in the queue of
    /// the refusing scope (memory, kept from `prev` when it is the same scope), or a
    /// sleep (Redis): `retry_after` plus up to a quarter of it (at most
    /// [`MAX_WAIT_JITTER`]) when the clock frees the slot (window, hold), or a backoff
    /// from `retry_after` doubling per refusal ([`SLOT_BACKOFF_DOUBLINGS`] times at
    /// most), plus up to half of it, when only a release does (concurrency).
    pub(crate) fn wait(&self, refused: &QuotaExceeded, refusals: u32, prev: Option<Wait>) -> Wait {
        match &self.inner.gate {
            AnyGate::Memory(g) => {
                let prev = match prev {
                    Some(Wait::Queue(w)) => Some(w),
                    _ => None,
                };
                Wait::Queue(g.enqueue(refused.scope(), prev))
            }
            AnyGate::Redis(_) => Wait::Sleep(Box::pin(tokio::time::sleep(self.backoff(refused, refusals)))),
        }
    }

    fn backoff(&self, refused: &QuotaExceeded, refusals: u32) -> Duration {
        let ra = refused.retry_after();
        // A uniform fraction in [0, 1).
        #[allow(clippy::cast_precision_loss, reason = "53 random bits")]
        let frac = (self.next_random() >> 11) as f64 / (1u64 << 53) as f64;
        if refused.dimension() == "concurrency" {
            let base = ra
                .max(Duration::from_millis(1))
                .saturating_mul(1 << refusals.min(SLOT_BACKOFF_DOUBLINGS));
            base.saturating_add(base.mul_f64(frac / 2.0))
        } else {
            ra.saturating_add((ra / 4).min(MAX_WAIT_JITTER).mul_f64(frac))
        }
    }

    /// splitmix64 over an atomic state: lock-free, seedable.
    fn next_random(&self) -> u64 {
        const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut z = self
            .inner
            .jitter
            .fetch_add(GAMMA, Ordering::Relaxed)
            .wrapping_add(GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Ready when the wait is over: try again.
    pub(crate) fn poll_wait(&self, w: &mut Wait, tokens: u64, cx: &mut Context<'_>) -> Poll<()> {
        match (w, &self.inner.gate) {
            (Wait::Sleep(s), _) => s.as_mut().poll(cx),
            (Wait::Queue(w), AnyGate::Memory(g)) => g.poll_wait(w, tokens, cx),
            (Wait::Queue(_), AnyGate::Redis(_)) => Poll::Ready(()),
        }
    }

    /// The wait ended in an admission: a queue hands on to the next in line when room
    /// is left.
    pub(crate) fn waited(&self, w: Wait) {
        if let (Wait::Queue(w), AnyGate::Memory(g)) = (w, &self.inner.gate) {
            g.admitted(w);
        }
    }

    /// A place behind the admissions already waiting in one of this limiter's scopes
    /// (memory), so a newcomer does not take the slot they wait for.
    pub(crate) fn queue_ahead(&self) -> Option<Wait> {
        match &self.inner.gate {
            AnyGate::Memory(g) => g.queue_ahead().map(Wait::Queue),
            AnyGate::Redis(_) => None,
        }
    }
}

/// An admission answered at once, or in flight.
#[derive(Debug)]
pub(crate) enum Started {
    Now(Ticket, Verdict),
    Later(Pending),
}

/// An admission in flight.
#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) fut: BackendFuture<Result<Verdict, BackendUnavailable>>,
    pub(crate) ticket: Ticket,
}

/// A backend admission in flight (a Redis round trip) that undoes itself when dropped
/// before its answer: the script may have reserved anyway, so the answer is awaited in
/// the background and an admission refunded (the request never went out: not an
/// attempt) and its lease released, instead of staying charged until the window ends
/// and the lease's TTL.
pub(crate) struct InFlight {
    fut: Option<BackendFuture<Result<Verdict, BackendUnavailable>>>,
    limiter: RateLimiter,
    ticket: Ticket,
}

impl fmt::Debug for InFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight")
            .field("ticket", &self.ticket)
            .finish_non_exhaustive()
    }
}

impl InFlight {
    pub(crate) const fn new(
        limiter: RateLimiter,
        fut: BackendFuture<Result<Verdict, BackendUnavailable>>,
        ticket: Ticket,
    ) -> Self {
        Self {
            fut: Some(fut),
            limiter,
            ticket,
        }
    }
}

impl InFlight {
    pub(crate) const fn ticket(&self) -> Ticket {
        self.ticket
    }
}

impl Future for InFlight {
    type Output = Result<Verdict, BackendUnavailable>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let fut = self.fut.as_mut().expect("InFlight polled after completion");
        let out = ready!(Pin::new(fut).poll(cx));
        self.fut = None;
        Poll::Ready(out)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(fut) = self.fut.take() else { return };
        let ticket = self.ticket;
        let undo = move |verdict: Result<Verdict, BackendUnavailable>| match verdict {
            Ok(Verdict::Admitted { at, .. }) => Some(Settle {
                at: Duration::from_nanos(at),
                requests: -1,
                tokens: -i64::try_from(ticket.tokens).unwrap_or(i64::MAX),
                lease: ticket.lease,
            }),
            _ => None,
        };
        match fut.into_ready() {
            Ok(verdict) => {
                if let Some(settle) = undo(verdict) {
                    detach(self.limiter.settle(settle));
                }
            }
            Err(fut) => {
                let limiter = self.limiter.clone();
                detach(BackendFuture::Pending(Box::pin(async move {
                    if let Some(settle) = undo(fut.await) {
                        // Failures are logged and counted by `settle`.
                        let _ = limiter.settle(settle).await;
                    }
                })));
            }
        }
    }
}

/// What one admission asks for.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ticket {
    pub(crate) tokens: u64,
    lease: Option<LeaseId>,
}

/// The record of one admission: when (on the limiter's clock), in which aligned
/// window, how many tokens were reserved.
///
/// The scoreboard's measure: judge quotas by [`Admission::at`] on this clock, over
/// every span of [`Admission::window_len`] (the limiter keeps each of them within the
/// quota, not only the aligned windows), counting only traffic that passed the gate.
/// [`Admission::window`] labels the aligned window `at` falls in, for reports.
/// Judged by completion time or by a local clock, a run that kept its quotas shows
/// violations that never happened.
#[derive(Clone)]
pub struct Admission {
    /// The limiter that admitted: source, account, window length and clock come from
    /// it (one reference count per admission, not three).
    limiter: RateLimiter,
    /// Nanoseconds on the limiter's clock (a `Duration`, and the window's id, when
    /// asked: no division per admission).
    at: u64,
    tokens: u64,
}

impl fmt::Debug for Admission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admission")
            .field("source", self.source())
            .field("account", &self.account())
            .field("at", &self.at())
            .field("window", &self.window())
            .field("tokens", &self.tokens)
            .field("clock", &self.clock())
            .finish()
    }
}

impl PartialEq for Admission {
    fn eq(&self, other: &Self) -> bool {
        self.source() == other.source()
            && self.account() == other.account()
            && (self.at, self.tokens, self.window_len()) == (other.at, other.tokens, other.window_len())
    }
}

impl Eq for Admission {}

impl Admission {
    /// The admission instant on the limiter's [`clock`](Self::clock): since the Unix
    /// epoch on the Redis server, or since the memory backend's creation.
    #[must_use]
    pub const fn at(&self) -> Duration {
        Duration::from_nanos(self.at)
    }

    /// The id of the aligned window `at` falls in: `at / window_len`, rounded down. A
    /// label for reports: quotas hold over every span of the window's length, whether
    /// aligned or not.
    #[must_use]
    pub fn window(&self) -> u64 {
        self.at / self.limiter.inner.window_ns
    }

    /// The window length.
    #[must_use]
    pub fn window_len(&self) -> Duration {
        self.limiter.inner.config.window
    }

    /// The end of the aligned window [`window`](Self::window), on the limiter's clock.
    #[must_use]
    pub fn window_end(&self) -> Duration {
        let nanos = (u128::from(self.window()) + 1) * self.window_len().as_nanos();
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// The tokens reserved at admission (the estimate).
    #[must_use]
    pub const fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The admitted source.
    #[must_use]
    pub fn source(&self) -> &SourceId {
        self.limiter.source()
    }

    /// The source's account, when it has one.
    #[must_use]
    pub fn account(&self) -> Option<&str> {
        self.limiter.inner.config.account_name()
    }

    /// The clock [`at`](Self::at) is read on.
    #[must_use]
    pub fn clock(&self) -> Clock {
        self.limiter.clock()
    }
}

/// An admission's reservation and concurrency lease.
///
/// Settle it with [`finish`](Self::finish) (reconcile tokens to real usage) or
/// [`refund`](Self::refund) (the call was not admitted below: undo everything).
/// Dropping it releases the lease (the reservation stays charged: the request may
/// have reached the provider).
pub struct Permit {
    admission: Admission,
    /// The lease while it is held: taken when the permit ends (or is forgotten), so
    /// the drop releases only a lease still held.
    lease: Option<LeaseId>,
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("admission", &self.admission)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

/// How a permit ends.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Ending {
    /// The call happened; `Some(n)`: the response reported `n` tokens used.
    Finished(Option<u64>),
    /// The call was not admitted further down: not an attempt, undo everything.
    Refunded,
}

impl Permit {
    /// The admission record.
    #[must_use]
    pub const fn admission(&self) -> &Admission {
        &self.admission
    }

    /// Whether this permit holds a concurrency lease.
    #[must_use]
    pub const fn has_lease(&self) -> bool {
        self.lease.is_some()
    }

    pub(crate) fn renew_now(&self) -> Option<BackendFuture<Result<bool, BackendUnavailable>>> {
        self.lease.map(|l| self.admission.limiter.renew(l))
    }

    /// What renews this permit's lease, apart from the permit (for a lease held by a
    /// response still running after the layer's future).
    pub(crate) fn renewer(
        &self,
    ) -> Option<impl Fn() -> BackendFuture<Result<bool, BackendUnavailable>> + Send + 'static> {
        let lease = self.lease?;
        let limiter = self.admission.limiter.clone();
        Some(move || limiter.renew(lease))
    }

    pub(crate) fn limiter(&self) -> &RateLimiter {
        &self.admission.limiter
    }

    /// The tokio instant of the admission, if the backend read the tokio clock.
    pub(crate) fn admitted_local(&self) -> Option<Instant> {
        self.admission.limiter.inner.gate.local(self.admission.at)
    }

    #[inline]
    pub(crate) fn end(mut self, ending: Ending) -> BackendFuture<Result<(), BackendUnavailable>> {
        let changes = self.changes(ending);
        // Taken: the drop below releases nothing more.
        let lease = self.lease.take();
        if !changes {
            return BackendFuture::ready(Ok(()));
        }
        let tokens = i64::try_from(self.admission.tokens).unwrap_or(i64::MAX);
        let (requests, tokens) = match ending {
            Ending::Finished(None) => (0, 0),
            // A provider's absurd usage (`total_tokens` near 2^64) is charged as
            // `MAX_QUOTA`: already past any window's quota, and inside the range the
            // backends count exactly (Lua numbers are exact to 2^53 only).
            Ending::Finished(Some(used)) => (
                0,
                i64::try_from(used.min(crate::config::MAX_QUOTA)).unwrap_or(i64::MAX) - tokens,
            ),
            Ending::Refunded => (-1, -tokens),
        };
        self.admission.limiter.settle(Settle {
            at: self.admission.at(),
            requests,
            tokens,
            lease,
        })
    }

    /// Whether ending so changes anything in the backend.
    #[inline]
    fn changes(&self, ending: Ending) -> bool {
        let inner = &self.admission.limiter.inner;
        self.lease.is_some()
            || match ending {
                Ending::Finished(used) => inner.counts_tokens && used.is_some(),
                Ending::Refunded => inner.counts_requests || inner.counts_tokens,
            }
    }

    /// [`end`](Self::end)s the permit in the background, after the answer: nothing
    /// at all when the ending changes nothing.
    #[inline]
    pub(crate) fn end_detached(self, ending: Ending) {
        // Without a change there is no lease either: the drop releases nothing.
        if self.changes(ending) {
            detach(self.end(ending));
        }
    }

    /// The call is done and used `used_tokens` (when the response said): the token
    /// reservation is reconciled and the lease released, in one round trip. Tokens
    /// reserved and not used go back to the sub-window of admission (while it still
    /// counts); tokens used beyond the estimate are charged where the settle lands,
    /// so they count against every span from now on. On standalone Redis, tokens given
    /// back alone ride with this limiter's next admission instead (or a settle script
    /// a quarter window later): until then other processes count the estimate.
    ///
    /// # Errors
    /// [`BackendUnavailable`] (also logged and counted in
    /// [`LimiterStats::settle_failures`]).
    pub async fn finish(self, used_tokens: Option<u64>) -> Result<(), BackendUnavailable> {
        Awaited(Some(self.end(Ending::Finished(used_tokens)))).await
    }

    /// The call was not admitted below (not an attempt): the request and its tokens are
    /// given back to the sub-window of admission (while it still counts) and the lease
    /// released.
    ///
    /// # Errors
    /// As [`finish`](Self::finish).
    pub async fn refund(self) -> Result<(), BackendUnavailable> {
        Awaited(Some(self.end(Ending::Refunded))).await
    }

    /// [`finish`](Self::finish) in the background: the settle is sent now (polled once,
    /// so on a multiplexed connection it goes ahead of this caller's next command,
    /// except the first time the settle script runs on a server: an `EVALSHA` answered
    /// `NOSCRIPT` is sent again after loading it) and not waited for; nothing is sent when finishing changes nothing. A failure is
    /// logged and counted as `finish`'s is. For a permit without a lease this keeps the
    /// backend's round trip off the answer's path; with a lease, a caller that must see
    /// its slot free before it answers (a strictly sequential client of a concurrency
    /// quota, on any replica) awaits `finish` instead.
    pub fn finish_detached(self, used_tokens: Option<u64>) {
        self.end_detached(Ending::Finished(used_tokens));
    }

    /// [`refund`](Self::refund) in the background, as
    /// [`finish_detached`](Self::finish_detached).
    pub fn refund_detached(self) {
        self.end_detached(Ending::Refunded);
    }

    /// Renews the lease now; `Ok(false)` when it had already expired.
    ///
    /// # Errors
    /// [`BackendUnavailable`] (also counted in [`LimiterStats::renew_failures`]).
    pub async fn renew(&self) -> Result<bool, BackendUnavailable> {
        match self.lease {
            Some(l) => self.admission.limiter.renew(l).await,
            None => Ok(true),
        }
    }

    /// Keeps this permit's concurrency lease alive while the returned guard lives: the
    /// lease is renewed in the background every `lease_ttl / RENEW_FRACTION` (10 s with
    /// the default 30 s TTL), so a call that runs longer than the TTL keeps its slot.
    /// Without a renewal, a lease expires `lease_ttl` after the admission and its slot
    /// goes to the next caller while the call still runs. The layer renews the leases
    /// of the permits it holds; a permit from [`RateLimiter::acquire`] needs this.
    ///
    /// Does nothing for a permit without a lease, or outside a tokio runtime. Drop the
    /// guard before [`finish`](Self::finish)ing the permit.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_ratelimit_redis::{MemoryBackend, Quota, RateLimitConfig, RateLimiter};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let limiter = RateLimiter::new(
    ///     RateLimitConfig::new("tenant", Quota::unlimited().concurrency(1)).lease_ttl(Duration::from_secs(3)),
    ///     MemoryBackend::new(),
    /// )
    /// .unwrap();
    /// let permit = limiter.acquire(0).await.unwrap();
    /// let renewal = permit.renewal();
    /// tokio::time::sleep(Duration::from_secs(10)).await; // a long call
    /// assert!(limiter.acquire(0).await.is_err(), "the slot is still held");
    /// drop(renewal);
    /// permit.finish(None).await.unwrap();
    /// assert!(limiter.acquire(0).await.is_ok());
    /// # }
    /// ```
    pub fn renewal(&self) -> Renewal {
        let every = self.admission.limiter.renew_every();
        let (Some(every), Some(handle), Some(renew)) = (
            every.filter(|_| self.has_lease()),
            tokio::runtime::Handle::try_current().ok(),
            self.renewer(),
        ) else {
            return Renewal(None);
        };
        Renewal(Some(handle.spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                detach(renew());
            }
        })))
    }

    /// Abandons the permit without releasing anything, as a crashed process would: the
    /// lease frees itself when its TTL expires. For tests and crash drills.
    pub fn forget(mut self) {
        self.lease = None;
    }
}

impl Drop for Permit {
    #[inline]
    fn drop(&mut self) {
        let Some(lease) = self.lease else {
            return;
        };
        let fut = self.admission.limiter.settle(Settle {
            at: self.admission.at(),
            requests: 0,
            tokens: 0,
            lease: Some(lease),
        });
        detach(fut);
    }
}

/// A permit's ending awaited by its caller ([`Permit::finish`], [`Permit::refund`]).
/// Dropped before it completed (the caller went away: a client that hung up, a
/// stream aborted at the end of a shutdown's grace), what is left of it goes on in
/// the background: the permit's lease was taken from it at the first poll, and the
/// command may not be on the connection yet (a reconnect, a script to load again),
/// so the slot would otherwise stay taken until the lease's TTL.
struct Awaited(Option<BackendFuture<Result<(), BackendUnavailable>>>);

impl Future for Awaited {
    type Output = Result<(), BackendUnavailable>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(fut) = self.0.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        let out = ready!(Pin::new(fut).poll(cx));
        self.0 = None;
        Poll::Ready(out)
    }
}

impl Drop for Awaited {
    fn drop(&mut self) {
        if let Some(fut) = self.0.take() {
            detach(fut);
        }
    }
}

/// The background renewal of a permit's lease ([`Permit::renewal`]); stops when
/// dropped.
#[derive(Debug)]
#[must_use = "the lease is renewed only while the guard lives"]
pub struct Renewal(Option<tokio::task::JoinHandle<()>>);

impl Drop for Renewal {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// Lets a backend operation finish in the background (failures are already logged
/// and counted by the limiter). Without a runtime, the lease expires by its TTL.
///
/// The operation is polled once here, before it is handed to a task: that puts its
/// command on the (multiplexed) connection now, ahead of whatever this caller sends
/// next, so a release is never overtaken by the caller's next admission.
#[inline]
pub(crate) fn detach<T: Send + 'static>(fut: BackendFuture<T>) {
    if let BackendFuture::Pending(f) = fut {
        detach_pending(f);
    }
}

#[cold]
fn detach_pending<T: Send + 'static>(mut f: Pin<Box<dyn Future<Output = T> + Send + 'static>>) {
    {
        let Ok(h) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no tokio runtime to release a concurrency lease; it expires by its TTL");
            return;
        };
        if f.as_mut()
            .poll(&mut Context::from_waker(std::task::Waker::noop()))
            .is_ready()
        {
            return;
        }
        drop(h.spawn(f));
    }
}

/// A cheap, cloneable handle that holds sources (and their accounts) for 429 pushback:
/// `pgw_core::Hold` for the retry layer. A held scope answers `QuotaExceeded` like a full
/// window until the hold ends, in every process sharing the backend.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// use std::time::Duration;
/// use pgw_core::Hold;
/// use tower_ratelimit_redis::{Holds, MemoryBackend, Quota, RateLimitConfig, RateLimiter};
///
/// let backend = MemoryBackend::new();
/// let s1 = RateLimiter::new(RateLimitConfig::new("s1", Quota::unlimited()), backend.clone()).unwrap();
/// let holds = Holds::new([s1.clone()]);
/// holds.hold(&"s1".into(), Duration::from_secs(5)).await.unwrap();
/// let err = s1.acquire(1).await.unwrap_err();
/// assert!(err.to_string().contains("hold"));
/// # }
/// ```
#[derive(Clone, Default)]
pub struct Holds {
    by_source: Arc<HashMap<SourceId, RateLimiter>>,
}

impl fmt::Debug for Holds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.by_source.keys()).finish()
    }
}

impl Holds {
    /// A handle over the limiters of several sources.
    pub fn new(limiters: impl IntoIterator<Item = RateLimiter>) -> Self {
        Self {
            by_source: Arc::new(limiters.into_iter().map(|l| (l.source().clone(), l)).collect()),
        }
    }

    /// The limiter of `source`, if this handle knows it.
    #[must_use]
    pub fn limiter(&self, source: &SourceId) -> Option<&RateLimiter> {
        self.by_source.get(source)
    }
}

impl Hold for Holds {
    /// Holds the source and its account (when configured) in one round trip.
    fn hold(&self, source: &SourceId, duration: Duration) -> HoldFuture {
        match self.by_source.get(source) {
            Some(l) => l.hold_future(HoldScope::Both, duration, false),
            None => unknown(source),
        }
    }

    /// Holds the source alone.
    fn hold_source(&self, source: &SourceId, duration: Duration) -> HoldFuture {
        match self.by_source.get(source) {
            Some(l) => l.hold_future(HoldScope::Source, duration, false),
            None => unknown(source),
        }
    }

    /// Holds the source (and its account when `account_wide`), the reason kept
    /// ([`RateLimiter::hold_after_overload`]).
    fn hold_after_overload(&self, source: &SourceId, duration: Duration, account_wide: bool) -> HoldFuture {
        match self.by_source.get(source) {
            Some(l) => l.hold_future(HoldScope::of(account_wide), duration, true),
            None => unknown(source),
        }
    }
}

fn unknown(source: &SourceId) -> HoldFuture {
    Box::pin(std::future::ready(Err(
        Box::new(UnknownSource(source.to_string())) as BoxError,
    )))
}

impl RateLimiter {
    fn hold_future(&self, scope: HoldScope, duration: Duration, overloaded: bool) -> HoldFuture {
        let fut = self.inner.gate.hold(scope, duration, overloaded);
        Box::pin(async move { fut.await.map(|_| ()).map_err(|e| Box::new(e) as BoxError) })
    }
}

impl Hold for RateLimiter {
    /// Holds this limiter's source and its account; an error for another source.
    fn hold(&self, source: &SourceId, duration: Duration) -> HoldFuture {
        if source == self.source() {
            self.hold_future(HoldScope::Both, duration, false)
        } else {
            unknown(source)
        }
    }

    /// Holds this limiter's source alone.
    fn hold_source(&self, source: &SourceId, duration: Duration) -> HoldFuture {
        if source == self.source() {
            self.hold_future(HoldScope::Source, duration, false)
        } else {
            unknown(source)
        }
    }

    /// Holds this limiter's source (and its account when `account_wide`), the reason
    /// kept ([`RateLimiter::hold_after_overload`]).
    fn hold_after_overload(&self, source: &SourceId, duration: Duration, account_wide: bool) -> HoldFuture {
        if source == self.source() {
            self.hold_future(HoldScope::of(account_wide), duration, true)
        } else {
            unknown(source)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemoryBackend, Quota};

    fn limiter(seed: u64) -> RateLimiter {
        RateLimiter::new(
            RateLimitConfig::new("s", Quota::unlimited()).jitter_seed(seed),
            MemoryBackend::new(),
        )
        .unwrap()
    }

    /// The layer's future carries a permit and moves with it: a permit is four words
    /// (the limiter, the instant, the tokens, the lease: a lease id is never 0, so its
    /// `Option` needs no tag, and no flag says whether it is still held). At 48 bytes
    /// the layer's call took 58 ns against tower's `RateLimit`'s 24; at 32, 48.
    #[test]
    fn a_permit_is_four_words() {
        assert_eq!(std::mem::size_of::<Permit>(), 4 * std::mem::size_of::<u64>());
        assert_eq!(
            std::mem::size_of::<Option<Permit>>(),
            std::mem::size_of::<Permit>()
        );
    }

    /// A wait whose end the clock knows lands after it, by at most a quarter of it
    /// (capped); a wait for a slot doubles, capped, with up to half as much jitter;
    /// one seed replays the same waits, another spreads them.
    #[test]
    fn backoff_is_keyed_to_retry_after_with_jitter() {
        let l = limiter(1);
        let window = QuotaExceeded::new("rpm", Duration::from_millis(400));
        let long = QuotaExceeded::new("hold", Duration::from_secs(60));
        let slot = QuotaExceeded::new("concurrency", Duration::from_millis(50));
        for _ in 0..100 {
            let w = l.backoff(&window, 3);
            assert!(
                w >= Duration::from_millis(400) && w <= Duration::from_millis(500),
                "{w:?}"
            );
            let w = l.backoff(&long, 0);
            assert!(w >= Duration::from_secs(60) && w <= Duration::from_secs(60) + MAX_WAIT_JITTER);
        }
        for (refusals, base) in [(0, 50), (1, 100), (2, 200), (4, 800), (9, 800)] {
            let w = l.backoff(&slot, refusals);
            let base = Duration::from_millis(base);
            assert!(w >= base && w <= base * 3 / 2, "{refusals}: {w:?}");
        }
        let waits = |seed| {
            (0..8)
                .map(|_| limiter(seed).backoff(&window, 0))
                .collect::<Vec<_>>()
        };
        assert_eq!(waits(5), waits(5));
        let (a, b) = (limiter(5), limiter(6));
        assert_ne!(a.backoff(&window, 0), b.backoff(&window, 0));
    }
}
