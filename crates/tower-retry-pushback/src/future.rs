//! [`ResponseFuture`]: one call's retry loop as a state machine.
//!
//! Everything a call holds lives in this future (the attempt in flight, a hold round
//! trip, a backoff timer, the request copy for the next attempt and the counters'
//! guards), so dropping it stops the call and releases everything.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use pgw_core::{
    BoxError, CallHistory, CarriesHistory, Classify, HoldFuture, NotAdmitted, Outcome, Recording, SourceId,
};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use crate::budget::Withdrawal;
use crate::config::MIN_NOT_ADMITTED_WAIT;
use crate::error::{Reason, RetryError};
use crate::resend::Resend;
use crate::service::{Core, Counters};

pin_project! {
    #[project = StateProj]
    enum State<F> {
        // An attempt is in flight.
        Attempt { #[pin] fut: F },
        // Holding the source of a 429 (R3); `wait` is slept instead if the hold fails.
        // With `then_fail`, the call ends once the hold is placed (its pushback is
        // exhausted; the hold still spares the source the other calls' attempts).
        // With `unheld_fail`, a failed hold ends the call instead of the sleep: that
        // sleep would take its pushback past the bound.
        Holding {
            fut: HoldFuture,
            wait: Duration,
            then_fail: Option<Reason>,
            unheld_fail: Option<Reason>,
            waiting: WaitGuard,
        },
        // Sleeping through a backoff, a Retry-After or a gate's retry_after (boxed:
        // the fast path never sleeps, so its future stays small).
        Waiting { sleep: Pin<Box<Sleep>>, waiting: WaitGuard },
        // About to send the next attempt (stall guard, readiness, throttle first).
        Ready,
        // Ended before the first attempt.
        Failed { err: Option<BoxError> },
        Done,
    }
}

/// Counts a call as waiting while alive.
struct WaitGuard(Arc<Counters>);

impl WaitGuard {
    fn new(counters: &Arc<Counters>) -> Self {
        counters.waiting.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(counters))
    }
}

impl Drop for WaitGuard {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

pin_project! {
    /// The future of one call through [`Retry`](crate::Retry).
    pub struct ResponseFuture<S, Req, C, R>
    where
        S: Service<Req>,
    {
        #[pin]
        state: State<S::Future>,
        deadline: Option<Pin<Box<Sleep>>>,
        // The service of the attempts after the first: made (from the layer's
        // prototype) only when the call needs a second attempt.
        service: Option<S>,
        call: Call<S, Req, C, R>,
    }
}

/// The call's own bookkeeping.
struct Call<S, Req, C, R> {
    /// The layer's shared state, and the service later attempts go to.
    shared: Arc<Core<S, C, R>>,
    /// The copy of the request for the next attempt.
    next: Option<Req>,
    /// Our own handle on the call's history, when the request copies do not carry it
    /// (see [`Call::history`]).
    history: Option<CallHistory>,
    /// What the attempts sent without a history recorded, until the call needs one
    /// (see `pgw_core::Recording`).
    recording: Option<Recording>,
    /// Whether this layer created the history (nobody else reads it then).
    own_history: bool,
    /// History records known so far: more after an attempt means the service below
    /// recorded it (with its source).
    known_len: usize,
    /// History records before this layer's first attempt: the attempts of the call
    /// made elsewhere (another group of a fallback chain), not this one's.
    first_record: usize,
    deadline_at: Option<Instant>,
    /// Created at the first failed or refused attempt, so a call that succeeds at once
    /// carries (and moves) only what it needs.
    slow: Option<Box<Slow>>,
}

/// The bookkeeping of a call that had to wait.
struct Slow {
    /// When the call first had to wait: the stall guard's clock.
    waiting_since: Instant,
    /// Attempt budget spent.
    spent: u32,
    reasks: u32,
    /// Backoffs drawn so far: the exponent of the next one.
    backoffs: u32,
    /// The call's pushback so far: the time covered by the waits its 429s asked
    /// for, each from its answer on (slept or held), overlaps counted once.
    pushback: Pushback,
    last_error: Option<BoxError>,
    /// Whether the call still counts as retrying (and watches the progress signal).
    counted: bool,
    /// A retry drawn from the budget for an attempt not sent yet: given back if the
    /// call ends (or is dropped) before it sends it.
    withdrawn: Option<Withdrawal>,
    /// The withdrawal of the attempt in flight: spent when it proves an attempt,
    /// pending again when a gate below refused it (not an attempt).
    dispatched: Option<Withdrawal>,
}

/// The time a call's 429s asked it to wait, bounded by `max_pushback_wait`.
///
/// Each 429 asks for `[answer, answer + wait]`; the call's pushback is the length of
/// the union of those spans. A call that moves on at once from one source's 429 to
/// another source's (two sources of one account, held together) waits for both holds
/// at once, not one after the other: overlapping spans count once. The answers come
/// in time order, so the union is kept as its length and its end.
#[derive(Clone, Copy, Debug, Default)]
struct Pushback {
    covered: Duration,
    until: Option<Instant>,
}

impl Pushback {
    /// The part of it already behind the call at `now` (a hold's span may reach past
    /// `now`).
    fn waited(self, now: Instant) -> Duration {
        let ahead = self
            .until
            .map_or(Duration::ZERO, |u| u.saturating_duration_since(now));
        self.covered.saturating_sub(ahead)
    }

    /// The pushback once a 429 answered `now` asks for `wait` more.
    fn with(self, now: Instant, wait: Duration) -> Self {
        let end = now.checked_add(wait);
        let added = match (self.until, end) {
            (Some(until), Some(end)) if until > now => end.saturating_duration_since(until),
            _ => wait,
        };
        Self {
            covered: self.covered.saturating_add(added),
            until: self.until.max(end),
        }
    }
}

impl<S, Req, C, R> Call<S, Req, C, R> {
    /// The call ended (or was dropped): no longer retrying, and a retry drawn for an
    /// attempt it never sent goes back to the budget (one drawn during a backoff). One
    /// dispatched stays spent, whether or not a gate below had let it through: the
    /// history's counts cannot tell them apart on every path (a history made at the
    /// first retry, a continuation's).
    fn uncount(&mut self) {
        let Some(slow) = &mut self.slow else {
            return;
        };
        if std::mem::take(&mut slow.counted) {
            self.shared.counters.retrying.fetch_sub(1, Ordering::Relaxed);
            self.shared.progress.unwatch();
        }
        if let Some(withdrawal) = slow.withdrawn.take()
            && let Some(budget) = &self.shared.budget
        {
            budget.refund(withdrawal, Instant::now());
        }
    }

    /// The attempt the budget was drawn for goes out: the retry is spent unless a
    /// gate below refuses it ([`answered`](Self::answered)).
    fn sent(&mut self) {
        if let Some(slow) = &mut self.slow {
            slow.dispatched = slow.withdrawn.take();
        }
    }

    /// The attempt in flight came back: an attempt (`refused` false) spent its
    /// retry; one a gate below refused was none, and its retry is pending again, for
    /// the next dispatch (or given back if the call ends first).
    fn answered(&mut self, refused: bool) {
        if let Some(slow) = &mut self.slow
            && let Some(w) = slow.dispatched.take()
            && refused
        {
            slow.withdrawn = Some(w);
        }
    }
}

impl<S, Req, C, R> Drop for Call<S, Req, C, R> {
    fn drop(&mut self) {
        self.uncount();
    }
}

enum Next<T> {
    Dispatch,
    Sleep(Duration),
    /// Hold the source (and its account when the provider said the limit is the
    /// account's) for the wait, then dispatch, or end the call with `then_fail`; if
    /// the hold fails, sleep through the wait, or end the call with `unheld_fail`.
    Hold {
        source: SourceId,
        wait: Duration,
        account_wide: bool,
        /// The pushback was a 5xx (the provider overloaded), not a rate limit.
        overloaded: bool,
        then_fail: Option<Reason>,
        unheld_fail: Option<Reason>,
    },
    Finish(Result<T, BoxError>),
}

/// What `Retry::call` hands to the future.
pub(crate) struct CallStart<Req> {
    pub(crate) next: Option<Req>,
    pub(crate) history: Option<CallHistory>,
    pub(crate) own_history: bool,
    pub(crate) known_len: usize,
    pub(crate) deadline_at: Option<Instant>,
    pub(crate) recording: Option<Recording>,
}

impl<S, Req: CarriesHistory, C, R> Call<S, Req, C, R> {
    /// [`CallHistory::may_wait`] of the call's history; a call without one may.
    fn may_wait(&self) -> bool {
        self.history
            .as_ref()
            .or_else(|| self.next.as_ref().and_then(CarriesHistory::call_history))
            .is_none_or(CallHistory::may_wait)
    }

    /// The call's history: our own handle, else the one the next request carries, else
    /// (history from the first retry on, or a request that cannot carry one) a new one,
    /// holding what the attempts sent without one recorded, attached to the next
    /// request so the service below sees it from now on.
    fn history(&mut self) -> &CallHistory {
        if self.history.is_none() {
            let carried = self.next.as_ref().and_then(CarriesHistory::call_history).cloned();
            let recording = &mut self.recording;
            let history = carried.unwrap_or_else(|| {
                let h = recording
                    .take()
                    .map_or_else(CallHistory::new, Recording::into_history);
                if let Some(at) = self.deadline_at {
                    h.set_deadline(at);
                }
                if let Some(next) = &mut self.next {
                    next.set_call_history(h.clone());
                }
                h
            });
            self.history = Some(history);
        }
        self.history.get_or_insert_with(CallHistory::new)
    }

    #[inline(always)]
    fn new(shared: Arc<Core<S, C, R>>, start: CallStart<Req>) -> Self {
        Self {
            shared,
            next: start.next,
            history: start.history,
            recording: start.recording,
            own_history: start.own_history,
            known_len: start.known_len,
            first_record: start.known_len,
            deadline_at: start.deadline_at,
            slow: None,
        }
    }

    /// The deadline cut the attempt in flight: when it was sent (numbered by the
    /// service below, [`pgw_core::Recording::next_attempt`]) and not recorded, it is
    /// recorded now, timed out at an unknown source, so the verdict says a provider
    /// was asked (a server charges the caller for it, as for any attempt). An attempt
    /// still waiting for an admission below was never numbered and is not recorded, nor
    /// is a probe sent with a copy of the call's request (numbered, never recorded).
    fn record_cut_attempt(&mut self) {
        let history = self.history();
        if history.in_flight() {
            history.push(pgw_core::AttemptRecord {
                source: None,
                outcome: pgw_core::Outcome::Transient,
                timed_out: true,
                too_large: false,
                status: None,
            });
        }
    }

    fn fail<T>(&mut self, reason: Reason) -> Result<T, BoxError> {
        let attempts = self.history().attempts();
        tracing::debug!(
            reason = reason.as_str(),
            attempts = attempts.len(),
            "retry loop gave up"
        );
        Err(Box::new(RetryError::new(
            reason,
            attempts,
            self.slow.as_mut().and_then(|s| s.last_error.take()),
        )))
    }

    /// The call has to wait: from now on it counts as retrying and watches progress.
    fn start_waiting(&mut self, now: Instant) -> &mut Slow {
        let shared = &self.shared;
        self.slow.get_or_insert_with(|| {
            shared.counters.retrying.fetch_add(1, Ordering::Relaxed);
            shared.progress.watch();
            Box::new(Slow {
                waiting_since: now,
                spent: 0,
                reasks: 0,
                backoffs: 0,
                pushback: Pushback::default(),
                last_error: None,
                counted: true,
                withdrawn: None,
                dispatched: None,
            })
        })
    }

    fn next_backoff(&mut self) -> Duration {
        let n = self.slow.as_ref().map_or(0, |s| s.backoffs);
        let d = self.shared.backoff(n);
        if let Some(s) = &mut self.slow {
            s.backoffs = n.saturating_add(1);
        }
        d
    }

    /// The longest this call may still wait in one go: the stall window, or less
    /// when the deadline is nearer.
    fn wait_limit(&self, now: Instant) -> Duration {
        let stall = self.shared.config.stall_window;
        match self.deadline_at {
            Some(d) => stall.min(d.saturating_duration_since(now)),
            None => stall,
        }
    }

    /// `wait` from `now`, plus the call's place among the calls waiting beside it
    /// ([`pgw_core::fair`]): by when it first waited (its stall clock, noted in its
    /// history for the layers below); `wait` itself when none does.
    fn fair_wait(&mut self, wait: Duration, now: Instant) -> Duration {
        let first = self.start_waiting(now).waiting_since;
        let since = self.history().waiting_since(first);
        let Some(end) = now.checked_add(wait) else {
            return wait;
        };
        let others = self.shared.counters.waiting.load(Ordering::Relaxed);
        let fair = pgw_core::fair::wake_at(now, end, since, others).saturating_duration_since(now);
        // Not past what the call may wait in one go (its deadline, the stall window):
        // the offset must not turn its last try into a failure.
        if fair < self.wait_limit(now) { fair } else { wait }
    }

    fn sleep_or_fail<T>(&mut self, wait: Duration, now: Instant) -> Next<T> {
        let limit = self.wait_limit(now);
        if wait > limit {
            Next::Finish(self.fail(Reason::WaitTooLong { wait, limit }))
        } else {
            Next::Sleep(wait)
        }
    }

    /// The stall guard, checked before every attempt after the first: the time this call
    /// has waited, when it is longer than the stall window and nothing in the process
    /// succeeded within it.
    fn stalled(&self) -> Option<Duration> {
        let since = self.slow.as_ref()?.waiting_since;
        let now = Instant::now();
        let waited = now.saturating_duration_since(since);
        let stall = self.shared.config.stall_window;
        (waited > stall && self.shared.progress.idle_for(now) > stall).then_some(waited)
    }

    /// The call's end when a retry is due and the request cannot be sent again: decided
    /// before any wait, budget or readiness is spent on an attempt that cannot happen.
    fn unresendable<T>(&mut self) -> Option<Next<T>> {
        self.next
            .is_none()
            .then(|| Next::Finish(self.fail(Reason::NotResendable)))
    }

    /// Decides what follows one attempt.
    fn after_attempt<T>(&mut self, result: Result<T, BoxError>) -> Next<T>
    where
        C: Classify<T, BoxError>,
    {
        let refused = result.as_ref().err().and_then(|e| NotAdmitted::of(&**e));
        self.answered(refused.is_some());
        if let Some(refused) = refused {
            return self.not_admitted(refused, result);
        }
        let outcome = self.shared.classify.classify(&result);
        if let Some(t) = &self.shared.throttle
            && outcome.health_sample() != Some(false)
        {
            t.record_accept(Instant::now());
        }
        if outcome.is_success() {
            self.shared.progress.record_success_if_watched();
            if !self.own_history {
                // The caller reads the history: make sure this attempt is in it,
                // provisionally: a stream's is replaced by the balancer below, judging
                // it at its end, with its source (others stay as recorded here).
                let known_len = self.known_len;
                let history = self.history();
                if history.len() == known_len {
                    history.record_provisional(outcome);
                }
            }
            return Next::Finish(result);
        }

        // The upstream's HTTP status, when the attempt's error carries one.
        let status = result
            .as_ref()
            .err()
            .and_then(|e| pgw_core::UpstreamStatus::find(&**e))
            .map(pgw_core::UpstreamStatus::status);
        // The service below records its attempts with their source; otherwise we do.
        let known_len = self.known_len;
        let history = self.history();
        let source = if history.len() > known_len {
            history.last().and_then(|a| a.source)
        } else {
            history.push(pgw_core::AttemptRecord {
                source: None,
                outcome,
                timed_out: false,
                too_large: false,
                status,
            });
            None
        };
        self.known_len = history.len();
        let too_large = result
            .as_ref()
            .err()
            .is_some_and(|e| pgw_core::exceeds_source(&**e));
        let account_wide = result
            .as_ref()
            .err()
            .is_some_and(|e| pgw_core::pushback_is_account_wide(&**e));
        let timed_out = result.as_ref().err().is_some_and(|e| pgw_core::is_timeout(&**e));
        // A 5xx pushback (503, 529 with `Retry-After`): the provider is overloaded, the
        // hold says so to the calls it refuses.
        let overloaded = status.is_some_and(|s| s.is_server_error());
        let now = Instant::now();
        self.start_waiting(now).last_error = result.err();
        tracing::debug!(outcome = outcome.as_str(), source = ?source, "attempt failed");

        // A balancer below names each attempt's source: the next one can go elsewhere.
        let balanced = source.is_some();
        match outcome {
            // Too large for that source, not for every one: spend an attempt and move on
            // (the balancer puts that source last for this call); the last one's answer
            // is the caller's when none takes it. Without a balancer below, the same
            // upstream would get the same request again: final.
            Outcome::Rejected if too_large && balanced => {
                let max_attempts = self.shared.config.max_attempts;
                // Every source the balancer chooses from said, in this layer's
                // attempts, it does not fit (a single route, say): sent again, it
                // would give the same answer, after waiting for its quota. The
                // balancer offers a source that said so only when no other is left:
                // such a second answer ends it too.
                let first_record = self.first_record;
                let history = self.history();
                let attempts = history.attempts();
                let mut said: Vec<&pgw_core::SourceId> = attempts
                    .iter()
                    .skip(first_record)
                    .filter(|a| a.too_large)
                    .filter_map(|a| a.source.as_ref())
                    .collect();
                let again = attempts
                    .iter()
                    .rev()
                    .skip(1)
                    .any(|a| a.too_large && a.source == source);
                said.sort_unstable();
                said.dedup();
                let again = again || history.sources().is_some_and(|n| said.len() >= n);
                let slow = self.start_waiting(now);
                slow.spent += 1;
                if again || slow.spent >= max_attempts {
                    Next::Finish(self.fail(Reason::Rejected))
                } else {
                    self.unresendable().unwrap_or(Next::Dispatch)
                }
            }
            Outcome::Rejected => Next::Finish(self.fail(Reason::Rejected)),
            // The process itself is out of descriptors: another source would fail
            // alike, and waiting here holds what little is left.
            Outcome::LocalExhaustion => Next::Finish(self.fail(Reason::LocalExhaustion)),
            Outcome::Invalid => {
                let max_reasks = self.shared.config.max_reasks;
                if self.start_waiting(now).reasks >= max_reasks {
                    return Next::Finish(self.fail(Reason::ReasksExhausted));
                }
                if let Some(end) = self.unresendable() {
                    return end;
                }
                self.start_waiting(now).reasks += 1;
                Next::Dispatch
            }
            Outcome::Transient | Outcome::SourceDead => {
                let max_attempts = self.shared.config.max_attempts;
                let slow = self.start_waiting(now);
                slow.spent += 1;
                if slow.spent >= max_attempts {
                    return Next::Finish(self.fail(Reason::BudgetExhausted));
                }
                if let Some(end) = self.unresendable() {
                    return end;
                }
                // Nothing to wait for: a dead source's breaker is open now, and a
                // timed-out attempt already gave its source the whole timeout (the
                // balancer sends the next attempt elsewhere, R1). A backoff on top only
                // delayed the call: on a pool of black holes, past one attempt timeout.
                // Without a balancer below, the next attempt goes to the same upstream:
                // it backs off like any other.
                let backoff = (!(balanced && (outcome == Outcome::SourceDead || timed_out)))
                    .then(|| self.next_backoff());
                // A backoff longer than the call may wait ends it before the budget
                // is drawn on: a retry that never happens spends nothing.
                if let Some(wait) = backoff {
                    let limit = self.wait_limit(now);
                    if wait > limit {
                        return Next::Finish(self.fail(Reason::WaitTooLong { wait, limit }));
                    }
                }
                if let Some(budget) = &self.shared.budget {
                    let Some(withdrawal) = budget.withdrawal(now) else {
                        return Next::Finish(self.fail(Reason::RetryBudgetExhausted));
                    };
                    self.start_waiting(now).withdrawn = Some(withdrawal);
                }
                backoff.map_or(Next::Dispatch, Next::Sleep)
            }
            Outcome::RateLimited { retry_after } => {
                if let Some(end) = self.unresendable() {
                    return end;
                }
                let wait = retry_after.unwrap_or_default().max(self.next_backoff());
                let limit = self.shared.config.max_pushback_wait;
                let held = self.shared.hold.is_some();
                let wait_limit = self.wait_limit(now);
                let slow = self.start_waiting(now);
                let waited = slow.pushback.waited(now);
                let after = slow.pushback.with(now, wait);
                let exhausted = Reason::PushbackExhausted { waited, wait, limit };
                // The sleep would take the call's pushback past the bound (one longer
                // than the call may wait at all is WaitTooLong).
                let past_bound = wait <= wait_limit && after.covered > limit;
                match (held, source) {
                    // The call goes on at once and waits for the hold only if no other
                    // source admits it: counted whole all the same (an upper bound of
                    // its wait), and the call ends at its first 429 once it has waited
                    // the bound.
                    (true, Some(source)) => {
                        slow.pushback = after;
                        Next::Hold {
                            source,
                            wait,
                            account_wide,
                            overloaded,
                            then_fail: (waited >= limit).then_some(exhausted),
                            // A failed hold is slept through as without a hook: by
                            // the same bound.
                            unheld_fail: past_bound.then_some(exhausted),
                        }
                    }
                    // A sleep that would take the call's pushback past the bound is not
                    // slept.
                    _ if past_bound => Next::Finish(self.fail(exhausted)),
                    _ => {
                        slow.pushback = after;
                        self.sleep_or_fail(wait, now)
                    }
                }
            }
            // Handled above; kept for exhaustiveness.
            Outcome::Success => Next::Dispatch,
        }
    }

    /// The service below refused before dispatch: not an attempt, nothing spent.
    fn not_admitted<T>(&mut self, refused: NotAdmitted, result: Result<T, BoxError>) -> Next<T> {
        if let Some(t) = &self.shared.throttle {
            // A local gate's refusal says nothing about upstream overload.
            t.record_accept(Instant::now());
        }
        let now = Instant::now();
        self.start_waiting(now).last_error = result.err();
        // Its caller has somewhere else to send it at once (a fallback group): a wait
        // for a quota, a hold or a slot is not this call's (R3).
        if matches!(refused, NotAdmitted::QuotaExceeded(_) | NotAdmitted::Paced) && !self.may_wait() {
            return Next::Finish(self.fail(Reason::NotAdmittedHere {
                retry_after: refused.retry_after(),
            }));
        }
        match refused {
            NotAdmitted::CircuitOpen(retry_after) => {
                Next::Finish(self.fail(Reason::AllCircuitsOpen { retry_after }))
            }
            NotAdmitted::QuotaExceeded(retry_after) => {
                let wait = retry_after.max(MIN_NOT_ADMITTED_WAIT);
                let limit = self.shared.config.max_pushback_wait;
                let wait_limit = self.wait_limit(now);
                let slow = self.start_waiting(now);
                if slow.pushback.until.is_some_and(|u| u > now) {
                    // Refused while the call's own pushback holds its sources: a wait
                    // for the hold, bounded as the pushback it is (a 429's hold took
                    // the call past the bound as a quota wait before). One longer
                    // than the call may wait at all is `WaitTooLong`, as for a 429.
                    let waited = slow.pushback.waited(now);
                    let after = slow.pushback.with(now, wait);
                    if wait <= wait_limit && after.covered > limit {
                        return Next::Finish(self.fail(Reason::PushbackExhausted { waited, wait, limit }));
                    }
                    slow.pushback = after;
                }
                match self.sleep_or_fail(wait, now) {
                    // Oldest first among the calls that wait for the same end.
                    Next::Sleep(wait) => Next::Sleep(self.fair_wait(wait, now)),
                    other => other,
                }
            }
            // The gate's own backend is down: nothing spent, asked again shortly, for
            // as long as the stall guard and the deadline allow.
            NotAdmitted::Never => Next::Finish(self.fail(Reason::Rejected)),
            NotAdmitted::Unavailable => {
                self.sleep_or_fail(pgw_core::UNAVAILABLE_RETRY_AFTER.max(MIN_NOT_ADMITTED_WAIT), now)
            }
            NotAdmitted::Paced => {
                let wait = self.next_backoff().max(MIN_NOT_ADMITTED_WAIT);
                self.sleep_or_fail(wait, now)
            }
        }
    }
}

impl<S, Req, C, R> ResponseFuture<S, Req, C, R>
where
    S: Service<Req>,
    Req: CarriesHistory,
{
    #[inline(always)]
    pub(crate) fn new(attempt: S::Future, shared: Arc<Core<S, C, R>>, start: CallStart<Req>) -> Self {
        Self {
            state: State::Attempt { fut: attempt },
            deadline: start.deadline_at.map(|at| Box::pin(tokio::time::sleep_until(at))),
            service: None,
            call: Call::new(shared, start),
        }
    }

    pub(crate) fn failed(shared: Arc<Core<S, C, R>>, start: CallStart<Req>, err: BoxError) -> Self {
        Self {
            state: State::Failed { err: Some(err) },
            deadline: None,
            service: None,
            call: Call::new(shared, start),
        }
    }
}

impl<S, Req, C, R> Future for ResponseFuture<S, Req, C, R>
where
    S: Service<Req> + Clone,
    S::Error: Into<BoxError>,
    Req: CarriesHistory,
    C: Classify<S::Response, BoxError>,
    R: Resend<Req>,
{
    type Output = Result<S::Response, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if let Some(deadline) = this.deadline.as_mut()
            && !matches!(*this.state, State::Done)
            && deadline.as_mut().poll(cx).is_ready()
        {
            // Drops the attempt in flight (R7).
            let in_flight = matches!(*this.state, State::Attempt { .. });
            this.state.set(State::Done);
            this.call.uncount();
            if in_flight {
                this.call.record_cut_attempt();
            }
            return Poll::Ready(this.call.fail(Reason::DeadlineExceeded));
        }
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Attempt { fut } => {
                    let polled = {
                        let _scope = this.call.recording.as_mut().map(Recording::enter);
                        fut.poll(cx)
                    };
                    let result = ready!(polled).map_err(Into::into);
                    this.call.after_attempt(result)
                }
                StateProj::Holding {
                    fut,
                    wait,
                    then_fail,
                    unheld_fail,
                    ..
                } => {
                    let wait = *wait;
                    let held = ready!(fut.as_mut().poll(cx));
                    match (held, then_fail.take()) {
                        (_, Some(reason)) => Next::Finish(this.call.fail(reason)),
                        // The gates below keep the source not admitted: go on at once.
                        (Ok(()), None) => Next::Dispatch,
                        (Err(e), None) => match unheld_fail.take() {
                            Some(reason) => {
                                tracing::warn!(error = %e, "hold failed; sleeping through the pushback would pass its bound");
                                Next::Finish(this.call.fail(reason))
                            }
                            None => {
                                tracing::warn!(error = %e, "hold failed; sleeping through the pushback instead");
                                this.call.sleep_or_fail(wait, Instant::now())
                            }
                        },
                    }
                }
                StateProj::Waiting { sleep, .. } => {
                    ready!(sleep.as_mut().poll(cx));
                    Next::Dispatch
                }
                StateProj::Ready => {
                    if let Some(waited) = this.call.stalled() {
                        Next::Finish(this.call.fail(Reason::Stalled { waited }))
                    } else if let Err(e) = ready!(
                        this.service
                            .get_or_insert_with(|| this.call.shared.later_attempts())
                            .poll_ready(cx)
                    ) {
                        // A RetryError like every failed call's: the attempts so far
                        // and the reason, the service's error as its source.
                        this.call.start_waiting(Instant::now()).last_error = Some(e.into());
                        Next::Finish(this.call.fail(Reason::ServiceFailed))
                    } else if !this.call.shared.throttle_admits() {
                        // What the service's readiness reserved goes now, not when
                        // the caller drops this future.
                        *this.service = None;
                        Next::Finish(this.call.fail(Reason::Throttled))
                    } else if let Some(req) = this.call.next.take() {
                        this.call.sent();
                        this.call.next = this.call.shared.resend.resend(&req);
                        let fut = this
                            .service
                            .as_mut()
                            .expect("the service was made ready above")
                            .call(req);
                        this.state.set(State::Attempt { fut });
                        continue;
                    } else {
                        Next::Finish(this.call.fail(Reason::NotResendable))
                    }
                }
                StateProj::Failed { err } => {
                    let err = err
                        .take()
                        .unwrap_or_else(|| "retry future polled after completion".into());
                    Next::Finish(Err(err))
                }
                StateProj::Done => {
                    return Poll::Ready(Err("retry future polled after completion".into()));
                }
            };
            match next {
                Next::Dispatch => this.state.set(State::Ready),
                Next::Sleep(wait) => {
                    let waiting = WaitGuard::new(&this.call.shared.counters);
                    this.state.set(State::Waiting {
                        sleep: Box::pin(tokio::time::sleep(wait)),
                        waiting,
                    });
                }
                Next::Hold {
                    source,
                    wait,
                    account_wide,
                    overloaded,
                    then_fail,
                    unheld_fail,
                } => {
                    let waiting = WaitGuard::new(&this.call.shared.counters);
                    let fut = match &this.call.shared.hold {
                        Some(hold) if overloaded => hold.hold_after_overload(&source, wait, account_wide),
                        Some(hold) if account_wide => hold.hold(&source, wait),
                        Some(hold) => hold.hold_source(&source, wait),
                        None => Box::pin(std::future::ready(Err("no hold hook".into()))),
                    };
                    tracing::debug!(%source, wait_s = wait.as_secs_f64(), "holding source after pushback");
                    this.state.set(State::Holding {
                        fut,
                        wait,
                        then_fail,
                        unheld_fail,
                        waiting,
                    });
                }
                Next::Finish(result) => {
                    this.state.set(State::Done);
                    this.call.uncount();
                    return Poll::Ready(result);
                }
            }
        }
    }
}
