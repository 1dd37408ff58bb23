//! The source set: per-source health and score, and a handle to change the set at runtime.

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, TryLockError};
use std::task::{Context, Poll};

use std::time::Duration;

use pgw_core::SourceId;
use pgw_core::sync::{read, write};
use tokio::sync::Notify;
use tokio::time::Instant;
use tower_service::Service;

use crate::{
    CUT_LATENCY_FACTOR, HEALTH_ALPHA, HEALTH_CLASSES, HEALTH_FLOOR, HEALTH_INITIAL, MIN_LATENCY_S,
    UNMEASURED_LATENCY_S,
};

/// One attempt in flight in [`SourceState::load`].
const INFLIGHT_ONE: u64 = 1;
/// Where the attempts awaiting their first answer start in [`SourceState::load`].
const AWAITED_SHIFT: u32 = 32;
/// One attempt awaiting its first answer in [`SourceState::load`].
const AWAITED_ONE: u64 = 1 << AWAITED_SHIFT;

/// Process-local health of one source: a success EWMA per call class and the
/// balancer's inflight count, all atomics.
pub(crate) struct SourceState {
    id: SourceId,
    ewma_bits: [AtomicU64; HEALTH_CLASSES],
    /// Two counts in one word, so an attempt's dispatch, and the end of an attempt
    /// answered at once, each change both with one atomic operation: the attempts in
    /// flight (the low 32 bits) and, in the high 32 bits, those dispatched and not
    /// answered yet (no first answer, no error, no timeout), what silence is judged
    /// on. A stream that answered counts in flight until its end, not as awaited: a
    /// source streaming a long answer is not silent.
    load: AtomicU64,
    /// Nanoseconds after `epoch` when the source last answered anything (an error
    /// included, a timeout not), or when it went from idle to busy, whichever is later.
    heard_ns: AtomicU64,
    /// Attempts timed out since the source last answered.
    timeouts: AtomicU32,
    /// Nanoseconds after `epoch` when the latest-dispatched attempt that was answered
    /// (anything but a timeout) was dispatched (0: none yet).
    answered_sent_ns: AtomicU64,
    /// Nanoseconds after `epoch` when an attempt last timed out (0: none yet).
    timed_out_ns: AtomicU64,
    /// Nanoseconds after `epoch` when the last detached probe started (0: none yet).
    probed_ns: AtomicU64,
    /// EWMA of the time to a successful answer, seconds, as f64 bits (0: none yet).
    latency_bits: AtomicU64,
    /// The smallest request size the source refused as too large for it
    /// ([`pgw_core::exceeds_source`]; `u64::MAX`: none), and when it last refused one
    /// (nanoseconds after `epoch`): what [`too_large_for`](Self::too_large_for) judges.
    too_large_from: AtomicU64,
    too_large_ns: AtomicU64,
    /// The largest request size the source answered with a success (0: none yet).
    fits_up_to: AtomicU64,
    epoch: Instant,
    /// `epoch` in `pgw_core::clock::nanos`.
    epoch_ns: u64,
}

impl SourceState {
    pub(crate) fn new(id: SourceId) -> Self {
        let epoch = Instant::now();
        Self {
            id,
            ewma_bits: std::array::from_fn(|_| AtomicU64::new(HEALTH_INITIAL.to_bits())),
            load: AtomicU64::new(0),
            heard_ns: AtomicU64::new(0),
            timeouts: AtomicU32::new(0),
            answered_sent_ns: AtomicU64::new(0),
            timed_out_ns: AtomicU64::new(0),
            probed_ns: AtomicU64::new(0),
            latency_bits: AtomicU64::new(0),
            too_large_from: AtomicU64::new(u64::MAX),
            too_large_ns: AtomicU64::new(0),
            fits_up_to: AtomicU64::new(0),
            epoch,
            epoch_ns: pgw_core::clock::nanos(epoch),
        }
    }

    fn now_ns(&self) -> u64 {
        self.ns_at(Instant::now())
    }

    /// Nanoseconds from `epoch` to `at` (0 before it); the instant of the dispatching
    /// poll costs no conversion (`pgw_core::clock`).
    fn ns_at(&self, at: Instant) -> u64 {
        pgw_core::clock::nanos(at).saturating_sub(self.epoch_ns)
    }

    /// The source answered something at `at` (it is alive, whatever the answer).
    pub(crate) fn heard(&self, at: Instant) {
        self.hear_at(self.ns_at(at));
        if self.timeouts.load(Ordering::Relaxed) != 0 {
            self.timeouts.store(0, Ordering::Relaxed);
        }
    }

    /// Moves `heard_ns` to `ns` when that is later: a load, and a read-modify-write
    /// only when it moves (an answer at its dispatch's instant, already heard, writes
    /// nothing).
    fn hear_at(&self, ns: u64) {
        if self.heard_ns.load(Ordering::Relaxed) < ns {
            self.heard_ns.fetch_max(ns, Ordering::Relaxed);
        }
    }

    /// An attempt dispatched at `sent` was answered (anything but a timeout).
    ///
    /// A plain store after the load, not a read-modify-write: every answered call
    /// writes here (each is sent later than the last), and a locked operation per call
    /// was a measurable share of the in-memory path. Two answers racing may leave the
    /// earlier send time; the next answer moves it on, and [`swallowed`](Self::swallowed)
    /// only decides a cut sooner or later, never a wrong one (a send time kept is always
    /// one that was answered).
    pub(crate) fn answered_sent_at(&self, sent: Instant) {
        let ns = self.ns_at(sent).max(1);
        if self.answered_sent_ns.load(Ordering::Relaxed) < ns {
            self.answered_sent_ns.store(ns, Ordering::Relaxed);
        }
    }

    /// Whether an attempt sent at `at` and still unanswered looks swallowed: attempts
    /// timed out since it was sent (the source was dropping requests around then), and
    /// an attempt sent after it has been answered (it overtook this one).
    pub(crate) fn swallowed(&self, at: Instant) -> bool {
        // At least 1, as stored: 0 means "none yet".
        let sent = self.ns_at(at).max(1);
        self.timed_out_ns.load(Ordering::Relaxed) >= sent
            && self.answered_sent_ns.load(Ordering::Relaxed) > sent
    }

    /// An attempt sent at `sent` ran out of time at `now`: the source said nothing.
    /// One more timeout since it was heard, unless an attempt sent after this one was
    /// answered: the source answers now, and a probe (or call) swallowed before it
    /// healed says nothing of its silence since (counting it re-silenced a healed
    /// source once enough such attempts ended).
    pub(crate) fn timed_out(&self, sent: Instant, now: Instant) {
        if self.answered_sent_ns.load(Ordering::Relaxed) <= self.ns_at(sent).max(1) {
            self.timeouts.fetch_add(1, Ordering::Relaxed);
        }
        self.timed_out_ns
            .fetch_max(self.ns_at(now).max(1), Ordering::Relaxed);
    }

    /// Whether attempts timed out since the source last answered: at least `n`.
    pub(crate) fn timed_out_since_heard(&self, n: u32) -> bool {
        self.timeouts.load(Ordering::Relaxed) >= n
    }

    /// Attempts awaiting their first answer and nothing heard from the source for
    /// `after` or longer (a slot freed by a timeout at exactly `after` does not admit a
    /// fresh call to it). Streams that answered and still run do not count: a source
    /// streaming one long answer is busy, not silent.
    pub(crate) fn silent(&self, after: Duration) -> bool {
        self.load.load(Ordering::Relaxed) >> AWAITED_SHIFT != 0 && self.quiet_for(after)
    }

    /// Whether nothing was heard from the source (nor was it dispatched to while idle)
    /// for `after`: no call has used it for that long.
    pub(crate) fn quiet_for(&self, after: Duration) -> bool {
        let quiet = self
            .now_ns()
            .saturating_sub(self.heard_ns.load(Ordering::Relaxed));
        quiet >= u64::try_from(after.as_nanos()).unwrap_or(u64::MAX)
    }

    /// When the source was last heard from (or went from idle to busy).
    pub(crate) fn heard_at(&self) -> Instant {
        let heard = Duration::from_nanos(self.heard_ns.load(Ordering::Relaxed));
        self.epoch + heard
    }

    pub(crate) const fn id(&self) -> &SourceId {
        &self.id
    }

    /// The success EWMA of call class `class` (clamped to the known classes).
    pub(crate) fn health(&self, class: usize) -> f64 {
        f64::from_bits(self.ewma_bits[class.min(HEALTH_CLASSES - 1)].load(Ordering::Relaxed))
    }

    pub(crate) fn inflight(&self) -> usize {
        // At most 2^32 - 1 attempts in flight: the low half of the word.
        #[allow(clippy::cast_possible_truncation)]
        let n = self.load.load(Ordering::Relaxed) as u32;
        n as usize
    }

    /// `max(ewma, floor) / ((1 + inflight) * latency)`, with
    /// the EWMA of `class` and the source's [`latency`](Self::latency).
    pub(crate) fn score(&self, class: usize) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let load = 1.0 + self.inflight() as f64;
        self.health(class).max(HEALTH_FLOOR) / (load * self.latency())
    }

    /// The EWMA of the time to a successful answer, seconds, at least
    /// [`MIN_LATENCY_S`]; [`UNMEASURED_LATENCY_S`] before the first one.
    pub(crate) fn latency(&self) -> f64 {
        self.measured_latency().unwrap_or(UNMEASURED_LATENCY_S)
    }

    /// The EWMA of the time to a successful answer, seconds, at least
    /// [`MIN_LATENCY_S`]; `None` before the first one.
    pub(crate) fn measured_latency(&self) -> Option<f64> {
        let lat = f64::from_bits(self.latency_bits.load(Ordering::Relaxed));
        (lat > 0.0).then(|| lat.max(MIN_LATENCY_S))
    }

    /// How long an attempt to this source may run before slow-call detection may cut
    /// it: `silent_after`, or [`CUT_LATENCY_FACTOR`] times the source's latency when
    /// longer. `None` before the source answered a success: it gives no measure of a
    /// slow answer (its first may be a long generation).
    pub(crate) fn cut_age(&self, silent_after: Duration) -> Option<Duration> {
        let latency = self.measured_latency()?;
        let expected = Duration::try_from_secs_f64(CUT_LATENCY_FACTOR * latency).unwrap_or(Duration::MAX);
        Some(silent_after.max(expected))
    }

    /// Feeds the time one successful attempt took to answer (to its first chunk when
    /// it streams), with the health weight [`HEALTH_ALPHA`]. Failures feed none: a
    /// source answering errors fast must not look fast.
    pub(crate) fn sample_latency(&self, took: Duration) {
        // At least MIN_LATENCY_S: a stored 0 means "none yet", and an answer in the
        // poll that dispatched it (a cache, an in-process source) took "no time".
        let secs = took.as_secs_f64().max(MIN_LATENCY_S);
        let _ = self
            .latency_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let old = f64::from_bits(bits);
                let next = if old > 0.0 {
                    old + HEALTH_ALPHA * (secs - old)
                } else {
                    secs
                };
                // At its fixed point (answers as fast as the average): nothing to write.
                (next.to_bits() != bits).then_some(next.to_bits())
            });
    }

    /// Feeds one health sample of call class `class`.
    pub(crate) fn record(&self, class: usize, ok: bool) {
        let sample = if ok { 1.0 } else { 0.0 };
        let ewma = &self.ewma_bits[class.min(HEALTH_CLASSES - 1)];
        let mut cur = ewma.load(Ordering::Relaxed);
        loop {
            let old = f64::from_bits(cur);
            let next = (old + HEALTH_ALPHA * (sample - old)).to_bits();
            if next == cur {
                // At its fixed point (a healthy source's 1.0): nothing to write, and
                // the line every ordering reads stays clean.
                return;
            }
            match ewma.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return,
                Err(actual) => cur = actual,
            }
        }
    }

    /// The source refused a request of `size` as too large for it at `now` (a context
    /// window): requests of that size or more are not offered to it first for
    /// [`OVERSIZE_MEMORY`](crate::OVERSIZE_MEMORY).
    pub(crate) fn refused_size(&self, size: u64, now: Instant) {
        // `u64::MAX` means "none refused": a saturated estimate is stored just under it.
        let size = size.min(u64::MAX - 1);
        let now = self.ns_at(now);
        if self.oversize_forgotten(now) {
            self.too_large_from.store(size, Ordering::Relaxed);
        } else {
            self.too_large_from.fetch_min(size, Ordering::Relaxed);
        }
        self.too_large_ns.store(now, Ordering::Relaxed);
    }

    /// The source answered a request of `size` with a success: requests up to that
    /// size fit it, whatever it refused before.
    pub(crate) fn fitted_size(&self, size: u64) {
        if self.fits_up_to.load(Ordering::Relaxed) < size {
            self.fits_up_to.fetch_max(size, Ordering::Relaxed);
        }
    }

    /// Whether a request of `size` is known too large for the source: it refused one
    /// of that size or less within [`OVERSIZE_MEMORY`](crate::OVERSIZE_MEMORY), and
    /// never answered one as large. One load when it never refused any (the clock is
    /// read only for a request that large).
    pub(crate) fn too_large_for(&self, size: u64) -> bool {
        let from = self.too_large_from.load(Ordering::Relaxed);
        from != u64::MAX
            && size >= from
            && size > self.fits_up_to.load(Ordering::Relaxed)
            && !self.oversize_forgotten(self.now_ns())
    }

    fn oversize_forgotten(&self, now_ns: u64) -> bool {
        let memory = u64::try_from(crate::OVERSIZE_MEMORY.as_nanos()).unwrap_or(u64::MAX);
        now_ns.saturating_sub(self.too_large_ns.load(Ordering::Relaxed)) >= memory
    }

    /// The source recovered at `at`, as a gate below judged it (see
    /// [`SourceHealth::recovered`]): every class's health back to [`HEALTH_INITIAL`],
    /// and heard from (its silence, if any, is over).
    pub(crate) fn restore(&self, at: Instant) {
        for ewma in &self.ewma_bits {
            ewma.store(HEALTH_INITIAL.to_bits(), Ordering::Relaxed);
        }
        self.heard(at);
    }

    /// An attempt dispatched at `at`: in flight, and awaiting its first answer until
    /// [`answered`](Self::answered).
    pub(crate) fn inc(&self, at: Instant) {
        let before = self.load.fetch_add(INFLIGHT_ONE | AWAITED_ONE, Ordering::Relaxed);
        if before >> AWAITED_SHIFT == 0 && !self.timed_out_since_heard(1) {
            // Nothing awaited until now: the silence starts with this attempt. After a
            // timeout it goes on: this attempt is a probe, and the others wait for its
            // answer.
            self.hear_at(self.ns_at(at));
        }
    }

    /// An attempt's first answer came (a stream's head, an error, a timeout), or it
    /// ended without one (dropped, refused below): once per [`inc`](Self::inc).
    pub(crate) fn answered(&self) {
        self.load.fetch_sub(AWAITED_ONE, Ordering::Relaxed);
    }

    /// The attempt left the flight (answered before, or by [`answered_and_ended`](Self::answered_and_ended)).
    pub(crate) fn dec(&self) {
        self.load.fetch_sub(INFLIGHT_ONE, Ordering::Relaxed);
    }

    /// [`answered`](Self::answered) and [`dec`](Self::dec) at once: an attempt whose
    /// first answer was its end.
    pub(crate) fn answered_and_ended(&self) {
        self.load.fetch_sub(INFLIGHT_ONE | AWAITED_ONE, Ordering::Relaxed);
    }

    /// Takes the turn of a detached probe at `at`: `false` when the last one started
    /// less than `every` before (one caller wins a turn, whatever the race).
    pub(crate) fn probe_turn(&self, at: Instant, every: Duration) -> bool {
        let now = self.ns_at(at).max(1);
        let every = u64::try_from(every.as_nanos()).unwrap_or(u64::MAX);
        let last = self.probed_ns.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < every {
            return false;
        }
        self.probed_ns
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

/// A live view of one source's health and inflight count, for metrics, and the
/// one thing a gate below may tell the balancer about it: that it
/// [recovered](Self::recovered).
#[derive(Clone)]
pub struct SourceHealth {
    state: Arc<SourceState>,
}

impl SourceHealth {
    /// The source's name.
    #[must_use]
    pub fn id(&self) -> &SourceId {
        self.state.id()
    }

    /// The success EWMA in `[0, 1]` of call class 0, the default class.
    #[must_use]
    pub fn health(&self) -> f64 {
        self.state.health(0)
    }

    /// The success EWMA of call class `class` (see
    /// [`HealthP2c::with_class`](crate::HealthP2c::with_class)); classes past
    /// [`HEALTH_CLASSES`](crate::HEALTH_CLASSES) read the last one.
    #[must_use]
    pub fn health_of(&self, class: usize) -> f64 {
        self.state.health(class)
    }

    /// Attempts this balancer has in flight on the source.
    #[must_use]
    pub fn inflight(&self) -> usize {
        self.state.inflight()
    }

    /// The ordering score `max(health, 0.05) / ((1 + inflight) x latency)` of call
    /// class 0.
    #[must_use]
    pub fn score(&self) -> f64 {
        self.state.score(0)
    }

    /// How long an attempt to this source may run before the balancer's slow-call
    /// detection ([`BalanceConfig::cut_silent`](crate::BalanceConfig::cut_silent)) may
    /// cut it: `silent_after`, or [`CUT_LATENCY_FACTOR`](crate::CUT_LATENCY_FACTOR)
    /// times the source's latency EWMA when longer; `None` before the source answered a
    /// success. For a layer below that gives up its own attempts by the same rule.
    #[must_use]
    pub fn cut_age(&self, silent_after: Duration) -> Option<Duration> {
        self.state.cut_age(silent_after)
    }

    /// Says that the source recovered: a gate below that had put it out after failures
    /// saw it answer again (a circuit breaker whose half-open probe succeeded, the probe
    /// sent off the balancer's path). Its health starts afresh, every class back to
    /// [`HEALTH_INITIAL`](crate::HEALTH_INITIAL) as for a new source, and it counts as
    /// heard from now (not silent).
    ///
    /// Without it the balancer keeps the health the failures left (near the floor after
    /// a failing minute) until calls go there, and calls do not go to a source below
    /// half the health of one that is merely busy ([`CREDIBLE_HEALTH_RATIO`](crate::CREDIBLE_HEALTH_RATIO)):
    /// a source back from an outage stayed out while callers waited for busy ones, up
    /// to [`BalanceConfig::max_wait`](crate::BalanceConfig::max_wait). If it fails
    /// again, its failures bring the health down as fast as before.
    pub fn recovered(&self) {
        self.state.restore(Instant::now());
    }
}

impl fmt::Debug for SourceHealth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SourceHealth")
            .field("id", self.id())
            .field("health", &self.health())
            .field("inflight", &self.inflight())
            .finish()
    }
}

pub(crate) struct Entry<S> {
    pub(crate) state: Arc<SourceState>,
    /// The service as inserted, never polled: what a dispatch that cannot take
    /// [`live`](Self::live) sends on (a clone of it), and what a probe sends on.
    pub(crate) service: S,
    /// The instance dispatches call in turn, readiness and call under the lock, so a
    /// dispatch copies no service (tower's p2c owns its services the same way). An
    /// instance left not ready, or failed, goes to the call that polled it and a fresh
    /// clone of [`service`](Self::service) takes its place.
    live: Mutex<S>,
}

/// What [`Entry::dispatch`] did with a request.
pub(crate) enum Dispatch<S, F, E> {
    /// Sent on the live instance.
    Called(F),
    /// The live instance refused in `poll_ready`.
    Refused(E),
    /// An instance of this call's own to poll until ready: the live one, left not
    /// ready (its readiness in progress is this call's), or a clone when another call
    /// held the live one.
    Own(S),
}

impl<S: Clone> Entry<S> {
    pub(crate) fn new(state: Arc<SourceState>, service: S) -> Self {
        Self {
            state,
            live: Mutex::new(service.clone()),
            service,
        }
    }

    /// Asks the live instance to take `req` now, without copying it.
    pub(crate) fn dispatch<Req>(
        &self,
        cx: &mut Context<'_>,
        req: impl FnOnce() -> Req,
    ) -> Dispatch<S, S::Future, S::Error>
    where
        S: Service<Req>,
    {
        let mut live = match self.live.try_lock() {
            Ok(live) => live,
            Err(TryLockError::WouldBlock) => {
                return Dispatch::Own(self.service.clone());
            }
            Err(TryLockError::Poisoned(p)) => {
                // A panic in a call below: its instance is not trusted again.
                let mut live = p.into_inner();
                *live = self.service.clone();
                self.live.clear_poison();
                live
            }
        };
        match live.poll_ready(cx) {
            Poll::Ready(Ok(())) => Dispatch::Called(live.call(req())),
            Poll::Ready(Err(e)) => {
                *live = self.service.clone();
                Dispatch::Refused(e)
            }
            Poll::Pending => Dispatch::Own(std::mem::replace(&mut *live, self.service.clone())),
        }
    }
}

/// An immutable view of the set, shared by the calls that started under it.
pub(crate) struct Snapshot<S> {
    pub(crate) entries: Vec<Entry<S>>,
    /// The set's wake signal, reachable from a call without touching the set.
    pub(crate) wake: Arc<Notify>,
    /// The calls waiting for a round's earliest `retry_after` (any snapshot of the set).
    pub(crate) waiting: Arc<pgw_core::fair::Waiting>,
    /// When the set's abandoned sources are next looked for ([`Snapshot::explore_due`]).
    pub(crate) explore: Arc<ExploreClock>,
}

/// When a call dispatching an attempt next looks for sources to probe off its path
/// (nanoseconds on `pgw_core::clock`, shared by every snapshot of a set).
#[derive(Debug, Default)]
pub(crate) struct ExploreClock(AtomicU64);

impl<S> Snapshot<S> {
    /// Whether the call dispatching at `now_ns` is the one to look for sources to probe:
    /// at most one call per `every` does (a load and a compare for the others).
    #[inline]
    pub(crate) fn explore_due(&self, now_ns: u64, every: Duration) -> bool {
        let next = self.explore.0.load(Ordering::Relaxed);
        if now_ns < next {
            return false;
        }
        let every = u64::try_from(every.as_nanos()).unwrap_or(u64::MAX);
        self.explore
            .0
            .compare_exchange(
                next,
                now_ns.saturating_add(every),
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .is_ok()
    }
}

struct Inner<S> {
    current: RwLock<Arc<Snapshot<S>>>,
    version: AtomicU64,
    wake: Arc<Notify>,
    waiting: Arc<pgw_core::fair::Waiting>,
    explore: Arc<ExploreClock>,
    cursor: AtomicUsize,
    clones: AtomicU64,
}

/// The set of sources a balancer orders, shared by handle.
///
/// [`insert`](Self::insert) and [`remove`](Self::remove) change it at runtime; sources
/// that stay keep their health and inflight count (the calls already running finish on
/// the set they started with). Cloning shares the same set.
///
/// ```
/// use tower::service_fn;
/// use tower_health_p2c::Sources;
///
/// let svc = service_fn(|x: u32| async move { Ok::<_, std::convert::Infallible>(x) });
/// let sources = Sources::new();
/// sources.insert("s1".into(), svc.clone());
/// sources.insert("s2".into(), svc);
/// assert_eq!(sources.len(), 2);
/// assert!(sources.remove("s1"));
/// assert_eq!(sources.views()[0].id().as_str(), "s2");
/// ```
pub struct Sources<S> {
    inner: Arc<Inner<S>>,
}

impl<S> Clone for Sources<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<S> Default for Sources<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Sources<S> {
    /// An empty set.
    #[must_use]
    pub fn new() -> Self {
        let wake = Arc::new(Notify::new());
        let waiting = Arc::new(pgw_core::fair::Waiting::new());
        let explore = Arc::new(ExploreClock::default());
        Self {
            inner: Arc::new(Inner {
                current: RwLock::new(Arc::new(Snapshot {
                    entries: Vec::new(),
                    wake: Arc::clone(&wake),
                    waiting: Arc::clone(&waiting),
                    explore: Arc::clone(&explore),
                })),
                version: AtomicU64::new(0),
                wake,
                waiting,
                explore,
                cursor: AtomicUsize::new(0),
                clones: AtomicU64::new(0),
            }),
        }
    }

    pub(crate) fn snapshot(&self) -> (Arc<Snapshot<S>>, u64) {
        // Read the version first: a change racing with us bumps it again after
        // swapping, so the next call refreshes.
        let version = self.inner.version.load(Ordering::Acquire);
        let snap = Arc::clone(&read(&self.inner.current));
        (snap, version)
    }

    pub(crate) fn version(&self) -> u64 {
        self.inner.version.load(Ordering::Acquire)
    }

    pub(crate) fn cursor(&self) -> usize {
        self.inner.cursor.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn next_clone(&self) -> u64 {
        self.inner.clones.fetch_add(1, Ordering::Relaxed)
    }

    /// The signal a balancer waits on when every source is paced. Give it to each
    /// source's pacing gate, e.g. `tower_aimd::AimdLayer::with_release_signal`.
    #[must_use]
    pub fn wake_signal(&self) -> Arc<Notify> {
        Arc::clone(&self.inner.wake)
    }

    /// The number of sources.
    #[must_use]
    pub fn len(&self) -> usize {
        self.snapshot().0.entries.len()
    }

    /// Whether the set is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A live view of every source's health and inflight count, in insertion order.
    #[must_use]
    pub fn views(&self) -> Vec<SourceHealth> {
        self.snapshot()
            .0
            .entries
            .iter()
            .map(|e| SourceHealth {
                state: Arc::clone(&e.state),
            })
            .collect()
    }

    /// The view of one source.
    #[must_use]
    pub fn view(&self, id: &str) -> Option<SourceHealth> {
        self.views().into_iter().find(|v| v.id().as_str() == id)
    }
}

impl<S: Clone> Sources<S> {
    fn update(&self, f: impl FnOnce(&mut Vec<Entry<S>>) -> bool) -> bool {
        let mut guard = write(&self.inner.current);
        let mut entries: Vec<Entry<S>> = guard
            .entries
            .iter()
            .map(|e| Entry::new(Arc::clone(&e.state), e.service.clone()))
            .collect();
        let changed = f(&mut entries);
        if changed {
            *guard = Arc::new(Snapshot {
                entries,
                wake: Arc::clone(&self.inner.wake),
                waiting: Arc::clone(&self.inner.waiting),
                explore: Arc::clone(&self.inner.explore),
            });
            self.inner.version.fetch_add(1, Ordering::Release);
        }
        changed
    }

    /// Adds a source, or replaces the service of a source already present (keeping its
    /// health). Returns `true` when the source was new.
    pub fn insert(&self, id: SourceId, service: S) -> bool {
        let mut new = false;
        self.update(|entries| {
            if let Some(e) = entries.iter_mut().find(|e| e.state.id() == &id) {
                *e = Entry::new(Arc::clone(&e.state), service);
            } else {
                new = true;
                entries.push(Entry::new(Arc::new(SourceState::new(id)), service));
            }
            true
        });
        new
    }

    /// Removes a source; returns whether it was present.
    pub fn remove(&self, id: &str) -> bool {
        self.update(|entries| {
            let before = entries.len();
            entries.retain(|e| e.state.id().as_str() != id);
            entries.len() != before
        })
    }
}

impl<S: Clone> FromIterator<(SourceId, S)> for Sources<S> {
    fn from_iter<I: IntoIterator<Item = (SourceId, S)>>(iter: I) -> Self {
        let sources = Self::new();
        for (id, svc) in iter {
            sources.insert(id, svc);
        }
        sources
    }
}

impl<S> fmt::Debug for Sources<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.views()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An attempt this process could not make (out of file descriptors for its
    /// connection) says nothing of the source's silence: a silent source stays so (its
    /// timeouts and the time it was last heard unchanged), where any other error is
    /// an answer. Before, it reset the timeouts: a black hole probed while the process
    /// ran out of descriptors looked alive, and calls went back to it.
    #[cfg(unix)]
    #[tokio::test(start_paused = true)]
    async fn an_attempt_that_never_left_the_process_is_not_an_answer() {
        use crate::future::heard_from;
        use pgw_core::{BoxError, Classify};
        let outcome_of = |r: &Result<http::Response<()>, BoxError>| pgw_core::HttpClassifier.classify(r);
        let s = SourceState::new("hole".into());
        let sent = Instant::now();
        tokio::time::advance(Duration::from_secs(30)).await;
        let timeout: Result<http::Response<()>, BoxError> = Err(Box::new(pgw_core::TimedOut));
        heard_from(&s, Some(outcome_of(&timeout)), &timeout, sent, Instant::now());
        heard_from(&s, Some(outcome_of(&timeout)), &timeout, sent, Instant::now());
        assert!(s.timed_out_since_heard(2));
        let heard = s.heard_at();
        let emfile: Result<http::Response<()>, BoxError> =
            Err(Box::new(std::io::Error::from_raw_os_error(24)));
        heard_from(
            &s,
            Some(outcome_of(&emfile)),
            &emfile,
            Instant::now(),
            Instant::now(),
        );
        assert!(
            s.timed_out_since_heard(2),
            "EMFILE: still two timeouts since heard"
        );
        assert_eq!(s.heard_at(), heard);
        // Any other error is an answer: the source is alive.
        let reset: Result<http::Response<()>, BoxError> = Err("connection reset".into());
        heard_from(
            &s,
            Some(outcome_of(&reset)),
            &reset,
            Instant::now(),
            Instant::now(),
        );
        assert!(!s.timed_out_since_heard(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_size_is_known_too_large_until_a_success_or_the_memory_ends() {
        let s = SourceState::new("small".into());
        assert!(!s.too_large_for(u64::MAX), "nothing refused yet");
        assert!(!s.too_large_for(0));
        s.refused_size(5_000, Instant::now());
        assert!(s.too_large_for(5_000) && s.too_large_for(80_000));
        assert!(!s.too_large_for(4_999), "a smaller request was never refused");
        s.refused_size(2_000, Instant::now());
        assert!(s.too_large_for(2_000), "the smallest refusal counts");
        // A success of 3000 says every size up to it fits, whatever was refused.
        s.fitted_size(3_000);
        assert!(!s.too_large_for(2_500) && !s.too_large_for(3_000));
        assert!(s.too_large_for(3_001));
        tokio::time::advance(crate::OVERSIZE_MEMORY - Duration::from_secs(1)).await;
        assert!(s.too_large_for(5_000), "still within the memory");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!s.too_large_for(5_000), "forgotten: offered again");
        // Refused again after it was forgotten: learnt from that refusal alone.
        s.refused_size(9_000, Instant::now());
        assert!(s.too_large_for(9_000));
        assert!(!s.too_large_for(5_000), "the forgotten 2000 is not back");
    }

    #[test]
    fn ewma_converges_and_score_has_a_floor() {
        let s = SourceState::new("s".into());
        assert!((s.health(0) - 1.0).abs() < 1e-12, "starts optimistic");
        s.record(0, false);
        assert!((s.health(0) - 0.8).abs() < 1e-12, "alpha 0.2");
        for _ in 0..60 {
            s.record(0, false);
        }
        assert!(s.health(0) < 1e-5, "converges to 0: {}", s.health(0));
        assert!((s.score(0) - HEALTH_FLOOR).abs() < 1e-12, "floored at 0.05");
        s.inc(tokio::time::Instant::now());
        assert!(
            (s.score(0) - HEALTH_FLOOR / 2.0).abs() < 1e-12,
            "divided by 1 + inflight"
        );
        s.dec();
        for _ in 0..10 {
            s.record(0, true);
        }
        // 1 - 0.8^10 = 0.8926: about 10 successes bring it back to 0.9 (seed 000 section 3.2).
        assert!((s.health(0) - 0.892_6).abs() < 1e-3, "{}", s.health(0));
        // A 10%-success stream settles near 0.1.
        let t = SourceState::new("t".into());
        let mut sum = 0.0;
        for i in 0..1000 {
            t.record(0, i % 10 == 0);
            if i >= 500 {
                sum += t.health(0);
            }
        }
        assert!((sum / 500.0 - 0.1).abs() < 0.02, "{}", sum / 500.0);
    }

    /// A timeout of an attempt sent before one that was answered is stale: probes
    /// swallowed before a black hole healed, timing out after a newer probe was
    /// answered, re-silenced it once three had ended.
    #[test]
    fn a_timeout_of_an_attempt_sent_before_an_answered_one_is_stale() {
        let s = SourceState::new("a".into());
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        // Attempts sent at 1, 2, 3 s into silence; one sent at 4 s answered at 5 s.
        s.heard(at(5));
        s.answered_sent_at(at(4));
        // The three older ones time out a minute later: the source answers since.
        for k in 1..=3 {
            s.timed_out(at(k), at(60 + k));
        }
        assert!(
            !s.timed_out_since_heard(1),
            "stale timeouts silenced a healed source"
        );
        // One sent after the answered one times out: it counts.
        s.timed_out(at(6), at(66));
        assert!(s.timed_out_since_heard(1));
    }

    /// An answer in the poll that dispatched it samples zero time: it counts as
    /// MIN_LATENCY_S, measured (it read as "unmeasured", 1 s, so a source answering at
    /// once scored below one answering in 100 ms, and its attempts were never cut).
    #[test]
    fn a_zero_latency_sample_is_measured() {
        let s = SourceState::new("s".into());
        assert_eq!(s.measured_latency(), None);
        s.sample_latency(Duration::ZERO);
        assert_eq!(s.measured_latency(), Some(MIN_LATENCY_S));
        let slow = SourceState::new("slow".into());
        slow.sample_latency(Duration::from_millis(100));
        assert!(s.score(0) > slow.score(0), "{} vs {}", s.score(0), slow.score(0));
    }

    #[test]
    fn insert_and_remove_keep_health_of_sources_that_stay() {
        let set: Sources<u8> = [("a".into(), 1), ("b".into(), 2)].into_iter().collect();
        set.view("a").unwrap().state.record(0, false);
        let v0 = set.version();
        assert!(set.insert("c".into(), 3));
        assert!(!set.insert("a".into(), 9), "replaced, not new");
        assert!(set.remove("b"));
        assert!(!set.remove("b"));
        assert!(set.version() > v0);
        let a = set.view("a").unwrap();
        assert!((a.health() - 0.8).abs() < 1e-12, "health kept across changes");
        let (snap, _) = set.snapshot();
        let ids: Vec<_> = snap
            .entries
            .iter()
            .map(|e| (e.state.id().as_str().to_owned(), e.service))
            .collect();
        assert_eq!(ids, vec![("a".to_owned(), 9), ("c".to_owned(), 3)]);
    }
}
