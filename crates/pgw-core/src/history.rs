//! The in-call history: which sources this call tried and how each attempt ended.
//!
//! Created by the retry layer for each call, carried with the request to the balancer
//! on every attempt, and never shared between calls. Cloning shares the same history
//! (it is a handle), so a request cloned for the next attempt carries what the earlier
//! attempts recorded.
//!
//! It also carries the call's deadline, when it has one, so every wait below the
//! retry layer (the balancer's wait for an admission) honours it.
//!
//! A call whose first attempt succeeds needs no history at all, and a history costs an
//! allocation and a counted reference in every copy of the request. So the retry layer
//! sends the first attempt without one, inside a [`Recording`] scope: a layer below
//! numbers the attempt in the scope, on this thread, while the retry layer polls it,
//! and the history is made there only when something has to be written into it (an
//! attempt that did not succeed).

use std::any::TypeId;
use std::cell::{Cell, RefCell};
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::time::Instant;

use crate::{Outcome, SourceId};

/// One attempt of a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttemptRecord {
    /// The source that served it (`None` when the service below has no sources).
    pub source: Option<SourceId>,
    /// How it ended.
    pub outcome: Outcome,
    /// It ended by a timeout (connect, first token, inter-token, total): the call's
    /// next attempt should go elsewhere.
    pub timed_out: bool,
    /// The source said the request does not fit it (`context_length_exceeded`,
    /// [`crate::exceeds_source`]): another source may take it.
    pub too_large: bool,
    /// The upstream's HTTP status, when the attempt ended on an error that carried one
    /// ([`crate::UpstreamStatus`]: a 429, a 503 or 529 with `Retry-After`, a 401);
    /// `None` for an answer and for errors without one (a timeout, a reset). Tells a
    /// provider's overload (a 5xx) from its quota (a 429) where both are pushback.
    pub status: Option<http::StatusCode>,
}

/// A call-local record of attempts, shared by handle between the retry layer and the
/// balancer of one call, with the call's deadline.
///
/// Cheap where every call pays: its count is read without a lock, and the first
/// attempt's record is kept inline (a call that ends at its first attempt allocates
/// only the handle).
#[derive(Clone, Default)]
pub struct CallHistory {
    inner: Arc<Records>,
}

#[derive(Default)]
struct Records {
    /// How many attempts are recorded: written under the lock, read without it.
    len: AtomicUsize,
    /// How many attempts were numbered ([`CallHistory::next_attempt`]), in the low 32
    /// bits, and how many of them were probes ([`CallHistory::next_probe`], never
    /// recorded here) in the high 32: one word, so a reader never sees a probe counted
    /// in one and not yet in the other.
    numbered: AtomicU64,
    /// [`CallHistory::may_wait`], negated (so `Default` is "may wait").
    goes_elsewhere: AtomicBool,
    /// [`CallHistory::sources`]; 0 while unknown.
    sources: AtomicUsize,
    list: Mutex<List>,
}

/// One probe in [`Records::numbered`]'s high 32 bits.
const PROBE: u64 = 1 << 32;

/// The attempts numbered, out of [`Records::numbered`]'s word.
#[allow(clippy::cast_possible_truncation)]
const fn low(word: u64) -> u32 {
    word as u32
}

/// The attempts, oldest first: the first inline, the others after it; and the call's
/// deadline.
#[derive(Default)]
struct List {
    first: Option<AttemptRecord>,
    rest: Vec<AttemptRecord>,
    deadline: Option<Instant>,
    waiting_since: Option<Instant>,
    /// The last record is provisional ([`CallHistory::record_provisional`]).
    provisional: bool,
}

impl List {
    fn iter(&self) -> impl DoubleEndedIterator<Item = &AttemptRecord> {
        self.first.iter().chain(&self.rest)
    }

    fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.rest.len()
    }

    fn push(&mut self, attempt: AttemptRecord) {
        if self.first.is_none() {
            self.first = Some(attempt);
        } else {
            self.rest.push(attempt);
        }
    }

    fn last_mut(&mut self) -> Option<&mut AttemptRecord> {
        self.rest.last_mut().or(self.first.as_mut())
    }
}

/// An attempt's record that neither timed out nor was too large for its source.
const fn plain(source: Option<SourceId>, outcome: Outcome) -> AttemptRecord {
    AttemptRecord {
        source,
        outcome,
        timed_out: false,
        too_large: false,
        status: None,
    }
}

impl fmt::Debug for CallHistory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = self.lock();
        f.debug_struct("CallHistory")
            .field("attempts", &list.iter().collect::<Vec<_>>())
            .field("deadline", &list.deadline)
            .finish()
    }
}

impl CallHistory {
    /// An empty history for a new call.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty history whose attempts `1..=numbered` were already numbered (by a
    /// [`Recording`] before the history was made).
    fn numbered(numbered: u32) -> Self {
        let history = Self::new();
        history
            .inner
            .numbered
            .store(u64::from(numbered), Ordering::Relaxed);
        history
    }

    fn lock(&self) -> MutexGuard<'_, List> {
        // The lock is never held across an await or a user callback; a poisoned lock can
        // only come from a panic inside one of these short methods, and the data is
        // still a valid list.
        crate::sync::lock(&self.inner.list)
    }

    /// Numbers one attempt as it is sent: 1, 2, ... in the order they are sent,
    /// whatever order they end in (the balancer's detached probe of a silent source,
    /// sent with a copy of this call's request, runs beside the call's own attempts).
    pub fn next_attempt(&self) -> u32 {
        low(self.inner.numbered.fetch_add(1, Ordering::Relaxed)).saturating_add(1)
    }

    /// Numbers a probe as it is sent: a copy of this call's request sent off its path
    /// (a breaker's half-open probe, the balancer's probe of a silent source), numbered
    /// among the call's attempts ([`next_attempt`](Self::next_attempt)) but never
    /// recorded in its history, so not counted in [`in_flight`](Self::in_flight).
    pub fn next_probe(&self) -> u32 {
        low(self.inner.numbered.fetch_add(PROBE | 1, Ordering::Relaxed)).saturating_add(1)
    }

    /// Whether one of the call's own attempts was sent and has not been recorded yet:
    /// numbered, probes aside, more than [`len`](Self::len).
    #[must_use]
    pub fn in_flight(&self) -> bool {
        let word = self.inner.numbered.load(Ordering::Relaxed);
        let own = low(word).saturating_sub(u32::try_from(word >> 32).unwrap_or(u32::MAX));
        own as usize > self.len()
    }

    /// Says whether the call may wait for an admission where it is sent now: `false`
    /// while its caller has somewhere else to send it at once (the next group of a
    /// fallback chain: R3, a call waits only when nothing admits it). A refusal then
    /// ends the call's turn there at once (the retry layer's
    /// `Reason::NotAdmittedHere`; the balancer waits for no slot). Default `true`.
    ///
    /// ```
    /// let h = pgw_core::CallHistory::new();
    /// assert!(h.may_wait());
    /// h.set_may_wait(false);
    /// assert!(!h.clone().may_wait(), "one flag for every copy of the call");
    /// ```
    pub fn set_may_wait(&self, may: bool) {
        self.inner.goes_elsewhere.store(!may, Ordering::Relaxed);
    }

    /// Whether the call may wait for an admission ([`set_may_wait`](Self::set_may_wait)).
    #[must_use]
    pub fn may_wait(&self) -> bool {
        !self.inner.goes_elsewhere.load(Ordering::Relaxed)
    }

    /// Sets the call's deadline: the instant after which it may not wait (the retry
    /// layer sets it; the balancer does not wait for an admission past it). An earlier
    /// deadline set before stays.
    pub fn set_deadline(&self, at: Instant) {
        let mut list = self.lock();
        list.deadline = Some(list.deadline.map_or(at, |d| d.min(at)));
    }

    /// Notes how many sources the service below chooses from for this call (a
    /// balancer sets it as it takes the call): a request every one of them said does
    /// not fit ends there, not sent to one of them again.
    pub fn set_sources(&self, n: usize) {
        self.inner.sources.store(n, Ordering::Relaxed);
    }

    /// How many sources the service below chooses from for this call, once it said
    /// ([`set_sources`](Self::set_sources)).
    ///
    /// ```
    /// let h = pgw_core::CallHistory::new();
    /// assert_eq!(h.sources(), None);
    /// h.set_sources(3);
    /// assert_eq!(h.sources(), Some(3));
    /// ```
    #[must_use]
    pub fn sources(&self) -> Option<usize> {
        Some(self.inner.sources.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    /// Forgets the call's deadline, so the next [`set_deadline`](Self::set_deadline)
    /// sets it whole: a continuation of the call (a stream cut and asked again) that
    /// brings a fresh deadline of its own, later than the first.
    ///
    /// ```
    /// use tokio::time::{Duration, Instant};
    /// let h = pgw_core::CallHistory::new();
    /// let now = Instant::now();
    /// h.set_deadline(now + Duration::from_secs(1));
    /// h.set_deadline(now + Duration::from_secs(9));
    /// assert_eq!(h.deadline(), Some(now + Duration::from_secs(1)), "only ever sooner");
    /// h.clear_deadline();
    /// h.set_deadline(now + Duration::from_secs(9));
    /// assert_eq!(h.deadline(), Some(now + Duration::from_secs(9)));
    /// ```
    pub fn clear_deadline(&self) {
        self.lock().deadline = None;
    }

    /// The call's deadline, if it has one.
    #[must_use]
    pub fn deadline(&self) -> Option<Instant> {
        self.lock().deadline
    }

    /// When the call first had to wait for an admission or a pushback, noting `now`
    /// if it never did: the key that orders waiting calls, oldest first
    /// ([`crate::fair::wake_at`]), the same in every layer that waits for it.
    pub fn waiting_since(&self, now: Instant) -> Instant {
        *self.lock().waiting_since.get_or_insert(now)
    }

    /// Records one attempt that neither timed out nor was too large for its source.
    pub fn record(&self, source: Option<SourceId>, outcome: Outcome) {
        self.push(plain(source, outcome));
    }

    /// Records one attempt as it ended.
    pub fn push(&self, attempt: AttemptRecord) {
        self.put(attempt, false);
    }

    /// Appends `attempt`, provisional or not ([`settle`](Self::settle)).
    fn put(&self, attempt: AttemptRecord, provisional: bool) {
        self.put_in(&mut self.lock(), attempt, provisional);
    }

    fn put_in(&self, list: &mut List, attempt: AttemptRecord, provisional: bool) {
        list.provisional = provisional;
        list.push(attempt);
        // Written under the lock only: a plain store, no read-modify-write.
        self.inner.len.store(list.len(), Ordering::Release);
    }

    /// Records the success of an attempt whose end a layer below may record later, in
    /// its place ([`settle`](Self::settle)): a stream committed to the caller, which
    /// the retry layer sees succeed without its source, and the balancer judges at its
    /// end. Without such a layer, or when the stream is dropped before its end (the
    /// caller gone, a deadline's cut), it stays, as [`record`](Self::record) would
    /// have it.
    pub fn record_provisional(&self, outcome: Outcome) {
        self.put(plain(None, outcome), true);
    }

    /// Records one attempt judged after its answer began (a stream, at its end): in
    /// place of the provisional record of it ([`record_provisional`](Self::record_provisional))
    /// when that is the last one, else as [`push`](Self::push). One attempt, one record.
    ///
    /// ```
    /// use pgw_core::{AttemptRecord, CallHistory, Outcome, SourceId};
    /// let h = CallHistory::new();
    /// h.record_provisional(Outcome::Success);
    /// let end = AttemptRecord { source: Some(SourceId::from("a")), outcome: Outcome::Transient,
    ///     timed_out: true, too_large: false, status: None };
    /// h.settle(end.clone());
    /// assert_eq!(h.attempts(), vec![end.clone()]);
    /// h.settle(end.clone());
    /// assert_eq!(h.len(), 2, "nothing provisional left: appended");
    /// ```
    pub fn settle(&self, attempt: AttemptRecord) {
        let mut list = self.lock();
        if std::mem::take(&mut list.provisional)
            && let Some(last) = list.last_mut()
        {
            *last = attempt;
            return;
        }
        self.put_in(&mut list, attempt, false);
    }

    /// How many attempts of this call failed on `source` (outcomes whose health sample
    /// is a failure: 429, transient, source dead).
    #[must_use]
    pub fn failures(&self, source: &SourceId) -> u32 {
        if self.is_empty() {
            return 0;
        }
        let n = self
            .lock()
            .iter()
            .filter(|a| a.source.as_ref() == Some(source) && a.outcome.health_sample() == Some(false))
            .count();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// The most recent attempt.
    #[must_use]
    pub fn last(&self) -> Option<AttemptRecord> {
        if self.is_empty() {
            return None;
        }
        self.lock().iter().next_back().cloned()
    }

    /// Every attempt so far, oldest first.
    #[must_use]
    pub fn attempts(&self) -> Vec<AttemptRecord> {
        if self.is_empty() {
            return Vec::new();
        }
        self.lock().iter().cloned().collect()
    }

    /// The number of attempts so far.
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner.len.load(Ordering::Acquire)
    }

    /// Whether no attempt was recorded yet.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

thread_local! {
    /// The recording in scope on this thread, if any (its history, when it has one, is
    /// in `MADE`).
    static FRAME: Cell<Option<Frame>> = const { Cell::new(None) };
    /// The history made for the recording in scope.
    static MADE: RefCell<Option<CallHistory>> = const { RefCell::new(None) };
}

/// The part of a [`Recording`] in scope on this thread: small and `Copy`, so entering
/// and leaving a scope in which nothing failed costs a few moves.
#[derive(Clone, Copy)]
struct Frame {
    req: TypeId,
    numbered: u32,
    /// `MADE` holds this scope's history.
    made: bool,
}

/// A call's attempts while its request carries no [`CallHistory`]: their numbering,
/// and the history made for them once a layer below had something to record.
///
/// The retry layer keeps one per call, [`enter`](Self::enter)s it around every poll of
/// the call's first attempt (the attempt's layers run inside that poll, synchronously),
/// and makes it the call's history ([`into_history`](Self::into_history)) when the
/// attempt failed. Below it, a layer that finds no history on the request numbers
/// its attempt through [`Recording::next_attempt`] and, when it has to record one (an
/// attempt that did not succeed) or to hand the history on (a copy of the request that
/// outlives the poll), takes it from [`Recording::adopt`]: it is made then, and only
/// then. A call whose first attempt succeeds allocates none.
///
/// Each names the type of its request: a scope serves only requests of the type it
/// was made for (a layer below that sends requests of another type, an HTTP client's,
/// is not the call's attempt). Outside a scope of that type these do what they would
/// without a history: number 1, `None`.
///
/// ```
/// use pgw_core::{Outcome, Recording};
///
/// type Req = http::Request<()>;
/// let mut recording = Recording::of::<Req>();
/// {
///     let _scope = recording.enter();
///     // A layer below, its request without a history:
///     assert_eq!(Recording::next_attempt::<Req>(None), 1);
///     let history = Recording::adopt::<Req>().expect("in scope");
///     history.record(Some("s1".into()), Outcome::Transient);
/// }
/// assert_eq!(Recording::next_attempt::<Req>(None), 1); // outside the scope
/// assert!(Recording::adopt::<Req>().is_none());
/// let history = recording.into_history();
/// assert_eq!(history.last().unwrap().source, Some("s1".into()));
/// assert_eq!(history.next_attempt(), 2);
/// ```
pub struct Recording {
    /// The type of the requests it serves.
    req: TypeId,
    numbered: u32,
    history: Option<CallHistory>,
}

impl fmt::Debug for Recording {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recording")
            .field("numbered", &self.numbered)
            .field("history", &self.history)
            .finish_non_exhaustive()
    }
}

/// While alive, the [`Recording`] it was entered from is the one in scope on this
/// thread; dropping it puts back what was in scope before (scopes nest: a retry layer
/// under a retry layer). Not `Send`: a scope belongs to the thread, and to the poll,
/// that entered it.
#[must_use = "the scope ends when the guard is dropped"]
pub struct RecordingScope<'a> {
    recording: &'a mut Recording,
    prev: Option<Frame>,
    /// The history of the scope entered over, given back when this one ends.
    prev_made: Option<CallHistory>,
    _thread: PhantomData<*const ()>,
}

impl fmt::Debug for RecordingScope<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordingScope").finish_non_exhaustive()
    }
}

impl Drop for RecordingScope<'_> {
    #[inline]
    fn drop(&mut self) {
        let Some(frame) = FRAME.with(|f| f.replace(self.prev)) else {
            return;
        };
        self.recording.numbered = frame.numbered;
        if frame.made {
            self.recording.history = MADE.with(|m| m.borrow_mut().take());
        }
        if let Some(prev) = self.prev_made.take() {
            MADE.with(|m| *m.borrow_mut() = Some(prev));
        }
    }
}

impl Recording {
    /// An empty recording of the attempts of one call sent as `Req`.
    #[must_use]
    pub fn of<Req: 'static>() -> Self {
        Self {
            req: TypeId::of::<Req>(),
            numbered: 0,
            history: None,
        }
    }

    /// Makes this recording the one in scope on this thread until the guard drops.
    #[inline]
    pub fn enter(&mut self) -> RecordingScope<'_> {
        let frame = Frame {
            req: self.req,
            numbered: self.numbered,
            made: self.history.is_some(),
        };
        let prev = FRAME.with(|f| f.replace(Some(frame)));
        // Rare: a scope inside another that has a history (kept aside), or a history
        // made in an earlier scope of this recording.
        let prev_made = if prev.is_some_and(|p| p.made) {
            MADE.with(|m| m.borrow_mut().take())
        } else {
            None
        };
        if frame.made {
            MADE.with(|m| *m.borrow_mut() = self.history.take());
        }
        RecordingScope {
            recording: self,
            prev,
            prev_made,
            _thread: PhantomData,
        }
    }

    /// The call's history: the one made for it already, else a new one holding its
    /// numbering so far.
    #[must_use]
    pub fn into_history(self) -> CallHistory {
        self.history
            .unwrap_or_else(|| CallHistory::numbered(self.numbered))
    }

    /// The frame in scope, when it serves `Req`s.
    fn frame<Req: 'static>() -> Option<Frame> {
        FRAME
            .with(Cell::get)
            .filter(|frame| frame.req == TypeId::of::<Req>())
    }

    /// Numbers an attempt as it is sent ([`CallHistory::next_attempt`]): through
    /// `history` when the request carries one, else through the recording in scope;
    /// 1 without either.
    #[must_use]
    pub fn next_attempt<Req: 'static>(history: Option<&CallHistory>) -> u32 {
        if let Some(h) = history {
            return h.next_attempt();
        }
        let Some(frame) = Self::frame::<Req>() else {
            return 1;
        };
        if frame.made
            && let Some(h) = MADE.with(|m| m.borrow().clone())
        {
            return h.next_attempt();
        }
        let numbered = frame.numbered.saturating_add(1);
        FRAME.with(|f| f.set(Some(Frame { numbered, ..frame })));
        numbered
    }

    /// The call's history for a `Req` that carries none, made now if needed: to record
    /// an attempt into, or for a copy of the request that outlives the scope (sent on
    /// another task, or to a layer that keeps its own history). `None` outside a
    /// scope.
    #[must_use]
    pub fn adopt<Req: 'static>() -> Option<CallHistory> {
        let frame = Self::frame::<Req>()?;
        MADE.with(|m| {
            let mut made = m.borrow_mut();
            if let Some(h) = made.as_ref() {
                return Some(h.clone());
            }
            let history = CallHistory::numbered(frame.numbered);
            *made = Some(history.clone());
            FRAME.with(|f| f.set(Some(Frame { made: true, ..frame })));
            Some(history)
        })
    }
}

/// Requests that can carry a [`CallHistory`].
///
/// Implemented for `http::Request<B>` (in its extensions). Implement it for your own
/// request type to let the retry layer and the balancer share in-call history; a type
/// that returns `None` simply gets no in-call deprioritization.
pub trait CarriesHistory {
    /// The history this request carries, if any.
    fn call_history(&self) -> Option<&CallHistory>;
    /// Attaches a history to this request.
    fn set_call_history(&mut self, history: CallHistory);

    /// Marks this request as a copy sent off its call's path: a balancer's background
    /// probe of a silent source. The copy still carries the call's history (its
    /// attempt is numbered there), but the layers below must not charge what happens
    /// to it (its time, its refusals) to the call, which has moved on.
    ///
    /// The default does nothing, for a request type without per-call state; a type
    /// that keeps some (time budgets, counters shared by the call's copies) marks the
    /// copy and answers [`is_probe_copy`](Self::is_probe_copy).
    fn mark_probe_copy(&mut self) {}

    /// Whether this request is a copy marked by
    /// [`mark_probe_copy`](Self::mark_probe_copy) (default `false`).
    fn is_probe_copy(&self) -> bool {
        false
    }
}

/// The mark of a probe copy in an `http::Request`'s extensions.
#[derive(Clone, Copy, Debug)]
struct ProbeCopy;

impl<B> CarriesHistory for http::Request<B> {
    fn call_history(&self) -> Option<&CallHistory> {
        self.extensions().get::<CallHistory>()
    }

    fn set_call_history(&mut self, history: CallHistory) {
        self.extensions_mut().insert(history);
    }

    fn mark_probe_copy(&mut self) {
        self.extensions_mut().insert(ProbeCopy);
    }

    fn is_probe_copy(&self) -> bool {
        self.extensions().get::<ProbeCopy>().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marked_probe_copy_keeps_the_history_and_leaves_the_original_unmarked() {
        let mut req = http::Request::new(());
        req.set_call_history(CallHistory::new());
        let mut copy = http::Request::new(());
        copy.set_call_history(req.call_history().unwrap().clone());
        copy.mark_probe_copy();
        assert!(copy.is_probe_copy());
        assert!(!req.is_probe_copy());
        assert!(
            copy.call_history().is_some(),
            "the copy is still the call's attempt"
        );
    }

    #[test]
    fn clones_share_and_failures_count_health_failures_only() {
        let h = CallHistory::new();
        let s1 = SourceId::from("s1");
        let mut req = http::Request::new(());
        req.set_call_history(h.clone());
        let carried = req.call_history().unwrap().clone();
        carried.record(Some(s1.clone()), Outcome::Transient);
        carried.record(Some(s1.clone()), Outcome::Invalid);
        carried.record(Some(s1.clone()), Outcome::RateLimited { retry_after: None });
        carried.record(Some("s2".into()), Outcome::Transient);
        assert_eq!(h.failures(&s1), 2);
        assert_eq!(h.len(), 4);
        assert_eq!(h.last().unwrap().source, Some(SourceId::from("s2")));
    }

    #[test]
    fn the_deadline_is_shared_and_only_moves_earlier() {
        let h = CallHistory::new();
        assert_eq!(h.deadline(), None);
        let carried = h.clone();
        let t = Instant::now();
        carried.set_deadline(t + std::time::Duration::from_secs(5));
        h.set_deadline(t + std::time::Duration::from_secs(9));
        assert_eq!(h.deadline(), Some(t + std::time::Duration::from_secs(5)));
        carried.set_deadline(t + std::time::Duration::from_secs(2));
        assert_eq!(h.deadline(), Some(t + std::time::Duration::from_secs(2)));
    }

    #[test]
    fn attempts_are_numbered_as_sent_by_every_handle_whatever_is_recorded() {
        let h = CallHistory::new();
        let probe = h.clone();
        assert_eq!(h.next_attempt(), 1);
        // A probe sent beside the call's second attempt, before either is recorded.
        assert_eq!(probe.next_attempt(), 2);
        assert_eq!(h.next_attempt(), 3);
        assert_eq!(h.len(), 0);
    }
}
