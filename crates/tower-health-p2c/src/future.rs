//! [`ResponseFuture`]: one call's walk through the order, with the wait when no source
//! admits.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use pgw_core::{
    AttemptRecord, BoxError, CallHistory, CarriesHistory, CircuitOpen, Classify, NotAdmitted, Outcome, Paced,
    Recording, clock,
};
use pin_project_lite::pin_project;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use tokio::sync::futures::OwnedNotified;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use crate::error::{NoSources, NoneAdmitted, SilentCut};
use crate::order;
use crate::probe;
use crate::sources::{Dispatch, Snapshot, SourceState};
use crate::{BalanceConfig, CREDIBLE_HEALTH_RATIO, MIN_WAKE_WAIT, POOR_HEALTH_RATIO, SILENT_TIMEOUTS};

/// Which sources this round still has to try.
pub(crate) enum Plan {
    Empty,
    /// Only the first candidate is known (the fast path: no allocation).
    First(usize),
    /// The first candidate was tried; the rest is computed on demand.
    FirstTried(usize),
    /// A full order, the position of the next candidate, and where the sources
    /// deprioritized in this call start.
    Full(Vec<usize>, usize, usize),
}

/// What the refusals of the current round said.
struct Round {
    all_open: bool,
    /// The earliest `CircuitOpen`, kept whole to be returned unchanged.
    open: Option<(Duration, BoxError)>,
    /// The earliest `QuotaExceeded`, kept whole: the source of a [`NoneAdmitted`], so
    /// a retry layer above waits for the earliest quota, not the last one refused.
    quota: Option<(Duration, BoxError)>,
    /// The earliest `retry_after` of any refusal.
    wake_after: Option<Duration>,
    /// A `Paced` refusal: admissible as soon as an attempt in flight ends.
    paced: Option<BoxError>,
    /// This round stopped before the sources deprioritized in this call, to wait for
    /// a credible source that is only briefly not admitted.
    held_back: bool,
    /// The best health (of the call's class) among sources refused as paced or over
    /// quota in this round: the bar a source must be credible against.
    soon_best: f64,
    /// The best health (of the call's class) among sources refused as over a quota
    /// that ends within `max_wait` in this round: the bar a source must not be poor
    /// against ([`POOR_HEALTH_RATIO`]).
    quota_best: f64,
}

impl Round {
    const fn new() -> Self {
        Self {
            all_open: true,
            open: None,
            quota: None,
            wake_after: None,
            paced: None,
            held_back: false,
            soon_best: 0.0,
            quota_best: 0.0,
        }
    }

    /// The round in `slot`, allocated at its first use (its first refusal).
    fn at(slot: &mut Option<Box<Self>>) -> &mut Self {
        slot.get_or_insert_with(|| Box::new(Self::new()))
    }

    fn refuse(&mut self, na: NotAdmitted, err: BoxError) {
        if let Some(d) = na.retry_after() {
            self.wake_after = Some(self.wake_after.map_or(d, |w| w.min(d)));
        }
        let keep_earliest = |slot: &mut Option<(Duration, BoxError)>, d: Duration, err: BoxError| {
            if slot.as_ref().is_none_or(|(o, _)| d < *o) {
                *slot = Some((d, err));
            }
        };
        match na {
            NotAdmitted::CircuitOpen(d) => keep_earliest(&mut self.open, d, err),
            // A gate's own backend down: like a full quota, asked again shortly.
            NotAdmitted::QuotaExceeded(d) => {
                self.all_open = false;
                keep_earliest(&mut self.quota, d, err);
            }
            NotAdmitted::Unavailable => {
                self.all_open = false;
                keep_earliest(&mut self.quota, pgw_core::UNAVAILABLE_RETRY_AFTER, err);
            }
            // Waiting cannot cure it: like an open circuit that never closes, so a
            // round of such refusals fails fast (with an open circuit's error first).
            NotAdmitted::Never => keep_earliest(&mut self.open, Duration::MAX, err),
            NotAdmitted::Paced => {
                self.all_open = false;
                self.paced.get_or_insert(err);
            }
        }
    }

    /// Whether the earliest wake-up is a quota's end: the earliest of `quota` is then a
    /// `QuotaExceeded` (not a gate's backend down, kept there too) ending at it, and no
    /// breaker reopens at that instant.
    fn quota_ends_first(&self) -> bool {
        let (Some(w), Some((d, err))) = (self.wake_after, &self.quota) else {
            return false;
        };
        *d == w
            && matches!(NotAdmitted::of(&**err), Some(NotAdmitted::QuotaExceeded(_)))
            && self.open.as_ref().is_none_or(|(o, _)| *o != w)
    }

    fn earliest_open(&mut self) -> BoxError {
        self.open.take().map_or_else(|| self.last_error(), |(_, e)| e)
    }

    /// The refusal that says best when to come back: a `Paced` (as soon as an attempt
    /// ends), else the earliest `QuotaExceeded`, else the earliest `CircuitOpen`.
    fn last_error(&mut self) -> BoxError {
        self.paced
            .take()
            .or_else(|| self.quota.take().map(|(_, e)| e))
            .or_else(|| self.open.take().map(|(_, e)| e))
            .unwrap_or_else(|| Box::new(NoSources))
    }
}

/// The slow path: waiting for a wake-up when no source admitted.
struct Wait {
    started: Instant,
    /// `max_wait` from `started`, or the call's deadline when sooner.
    deadline: Instant,
    /// Enabled before the round it guards, so a release during that round wakes us.
    armed: Option<Pin<Box<OwnedNotified>>>,
    /// `armed` was dropped when an attempt went out: the next arming is not followed
    /// by a round at once (a release meanwhile is a permit of the `Notify`, so it is
    /// not missed; a round at once would spin on a source refusing at each attempt).
    disarmed: bool,
    sleep: Option<Pin<Box<Sleep>>>,
    /// Counted among the set's waiting calls while `sleep` waits for a `retry_after`.
    counted: Option<pgw_core::fair::Counted>,
    rounds: u64,
}

/// The call's wait for an admission, begun the first time it waits (a source not
/// ready, or a round in which every source refused): `max_wait` bounds it from then,
/// and the call's deadline when sooner.
fn begin_wait(wait: &mut Option<Box<Wait>>, max_wait: Duration, call_deadline: Option<Instant>) -> &mut Wait {
    wait.get_or_insert_with(|| {
        let now = Instant::now();
        let max_wait = clock::saturating_after(now, max_wait);
        Box::new(Wait {
            started: now,
            // The call's own deadline, when sooner: a wake-up past it is hopeless.
            deadline: call_deadline.map_or(max_wait, |d| d.min(max_wait)),
            armed: None,
            disarmed: false,
            sleep: None,
            counted: None,
            rounds: 0,
        })
    })
}

/// The state of one balanced call: its request, the sources' snapshot, the order of
/// attempts and what is dispatched or waited for.
struct CallState<S, Req, C> {
    /// The request, with the call's history when it carries one (read through it: no
    /// handle of our own to take and give back).
    req: Req,
    snapshot: Arc<Snapshot<S>>,
    /// The request's health class (see `HealthP2c::with_class`).
    class: usize,
    /// The request's size, when its `ClassOf` gives one (`ClassOf::size_of`).
    size: Option<u64>,
    plan: Plan,
    config: BalanceConfig,
    classifier: C,
    seed: u64,
    /// The source holding one of our inflight counts.
    dispatched: Option<usize>,
    dispatched_at: Option<Instant>,
    /// The wait for a credible source ended without one admitting: the sources
    /// deprioritized in this call may be dispatched.
    release_deferred: bool,
    /// Allocated at the first refusal ([`Round::at`]): a call admitted at once
    /// carries none, and its future stays small (it is moved several times).
    round: Option<Box<Round>>,
    wait: Option<Box<Wait>>,
    /// Slow-call detection's timer on the attempt in flight: when its source could
    /// first be silent with the attempt old enough to cut (armed only once the attempt
    /// waits).
    cut: Option<Pin<Box<Sleep>>>,
}

impl<S, Req, C> Drop for CallState<S, Req, C> {
    fn drop(&mut self) {
        // Dropped while it listened for releases: a wake-up it took goes on.
        if let Some(wait) = self.wait.as_mut() {
            pass_on(&mut wait.armed, &self.snapshot.wake);
        }
        // Dropped or panicked mid-attempt: give the inflight count back (A4).
        if let Some(i) = self.dispatched.take() {
            let state = &self.snapshot.entries[i].state;
            // `finish` takes the dispatch instant when it counts the answer: a panic
            // in judging after that must not count it twice (the awaited count
            // wrapped, and the source looked silent for good).
            if self.dispatched_at.take().is_some() {
                state.answered_and_ended();
            } else {
                state.dec();
            }
        }
    }
}

impl<S, Req: CarriesHistory, C> CallState<S, Req, C> {
    /// The call's history, when the request carries one.
    fn history(&self) -> Option<&CallHistory> {
        self.req.call_history()
    }

    /// An attempt of this call already failed: it is not the one to probe a source
    /// that has said nothing since [`SILENT_TIMEOUTS`] timeouts (a call must not spend what
    /// is left of its attempts, nor two attempt timeouts, on silence). Fresh calls
    /// probe.
    fn failed_before(&self) -> bool {
        self.history().is_some_and(|h| {
            h.attempts()
                .iter()
                .any(|a| a.outcome.health_sample() == Some(false))
        })
    }

    fn next_candidate(&mut self) -> Option<usize> {
        let entries = &self.snapshot.entries;
        if let Plan::FirstTried(i) = self.plan {
            let full = order::full(self.config.policy, entries, self.class, i);
            let len = full.len();
            self.plan = Plan::Full(full, 1, len);
        }
        match &mut self.plan {
            // (`FirstTried` was made `Full` just above.)
            Plan::Empty | Plan::FirstTried(_) => None,
            &mut Plan::First(i) => {
                self.plan = Plan::FirstTried(i);
                Some(i)
            }
            Plan::Full(order, pos, defer_at) => {
                let next = *order.get(*pos)?;
                // A source is dispatched only when no credible source can admit within
                // the wait: while one is merely paced or over quota, end the round and
                // wait for it instead of spending an attempt on a source that failed
                // twice in this call (H5) or whose health is below half of the waiting
                // source's (H5's credible-alternative rule, applied to every attempt).
                let round = Round::at(&mut self.round);
                let soon = round.paced.is_some() || round.quota.is_some();
                let not_credible = *pos >= *defer_at
                    || entries[next].state.health(self.class) < CREDIBLE_HEALTH_RATIO * round.soon_best;
                if soon && not_credible && !self.release_deferred {
                    round.held_back = true;
                    return None;
                }
                *pos += 1;
                Some(next)
            }
        }
    }

    /// The wait for a credible source is over without one admitting: what is left of
    /// the round, the sources held back as not credible and those deprioritized for
    /// failing in this call alike, goes healthiest first (of the call's class), but a
    /// source the request did not fit stays last. A source that failed twice in this
    /// call but answers most calls of its class is a better last attempt than one that
    /// fails most (P6: streams' third attempts went to the source whose watchdog cuts
    /// nine streams in ten, while the one with a few empty answers waited at the tail).
    /// A poor source ([`POOR_HEALTH_RATIO`]) is left out while a source refused as over
    /// a quota ending within `max_wait` answers four times as often: the call waits for
    /// that quota's end instead.
    fn order_released(&mut self) {
        if !self.config.policy.has_health_view() {
            return;
        }
        let entries = &self.snapshot.entries;
        let attempts = self
            .req
            .call_history()
            .map(CallHistory::attempts)
            .unwrap_or_default();
        let oversized = order::oversized(entries, self.size);
        let too_large = order::too_large(entries, &attempts, oversized.as_deref());
        let Plan::Full(order, pos, _) = &mut self.plan else {
            return;
        };
        let class = self.class;
        let key = |i: usize| (too_large[i], entries[i].state.health(class));
        let Some(rest) = order.get_mut(*pos..) else {
            return;
        };
        rest.sort_by(|&a, &b| {
            let (la, ha) = key(a);
            let (lb, hb) = key(b);
            la.cmp(&lb).then(hb.total_cmp(&ha))
        });
        let poor_below = POOR_HEALTH_RATIO * self.round.as_ref().map_or(0.0, |r| r.quota_best);
        // The sources already offered (before `pos`) stay where they are, so `pos`
        // still points at the first one not offered. (Counted from `pos`, every
        // position passed it and a poor source already refused was dropped, shifting
        // the next one under `pos`: never offered.)
        let start = *pos;
        let mut k = 0;
        order.retain(|&i| {
            k += 1;
            k <= start || too_large[i] || entries[i].state.health(class) >= poor_below
        });
    }

    /// An attempt is out: the call no longer listens for releases. A listener kept
    /// (armed again when the call woke) stayed first in line and took the next release
    /// while the attempt ran, a waiting call sleeping on until its poll; dropped, a
    /// release it got goes on to the next waiter.
    fn disarm(&mut self) {
        if let Some(wait) = self.wait.as_mut()
            && wait.armed.is_some()
        {
            pass_on(&mut wait.armed, &self.snapshot.wake);
            wait.disarmed = true;
        }
    }

    /// How long a wait for a quota's end can still be: `max_wait` (the retry layer
    /// above waits a quota out and asks again, with a fresh `max_wait`), or the time to
    /// the call's deadline when sooner.
    fn wait_left(&self) -> Duration {
        let deadline = self.history().and_then(CallHistory::deadline);
        deadline.map_or(self.config.max_wait, |d| {
            d.saturating_duration_since(Instant::now())
                .min(self.config.max_wait)
        })
    }

    /// Orders the sources afresh for the next round.
    fn new_round(&mut self, rounds: u64) {
        if let Some(round) = &mut self.round {
            **round = Round::new();
        }
        let entries = &self.snapshot.entries;
        let policy = self.config.policy;
        let mut rng = SmallRng::seed_from_u64(self.seed.wrapping_add(rounds));
        #[allow(clippy::cast_possible_truncation)]
        let cursor = self.seed.wrapping_add(rounds) as usize;
        let class = self.class;
        let first = order::first(policy, self.config.choices, entries, class, &mut rng, || cursor);
        let oversized = order::oversized(entries, self.size);
        self.plan = order::plan(
            policy,
            entries,
            class,
            first,
            self.req.call_history().filter(|h| !h.is_empty()),
            oversized.as_deref(),
        );
    }

    /// How long a source whose `poll_ready` is `Pending` is waited for before the
    /// round goes on without it: `paced_poll` from now, or the end of the call's wait
    /// (its deadline, or `max_wait` from the first time the call waited) when sooner.
    fn readiness_deadline(&mut self) -> Instant {
        let paced = clock::saturating_after(Instant::now(), self.config.paced_poll);
        let call_deadline = self.history().and_then(CallHistory::deadline);
        paced.min(begin_wait(&mut self.wait, self.config.max_wait, call_deadline).deadline)
    }

    /// The end of a round in which every source refused: fail, or wait and start a
    /// new round (`Ready(Ok)`).
    fn poll_round_end(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        if self.snapshot.entries.is_empty() {
            return Poll::Ready(Err(Box::new(NoSources)));
        }
        if Round::at(&mut self.round).all_open {
            // Every source is breaker-open: fail fast with the earliest (H7).
            return Poll::Ready(Err(Round::at(&mut self.round).earliest_open()));
        }
        let call_deadline = self.history().and_then(CallHistory::deadline);
        // A call with somewhere else to go at once (a fallback group) waits for no slot
        // here: the round's refusal is its answer (R3).
        let may_wait = self.history().is_none_or(CallHistory::may_wait);
        let wait = begin_wait(&mut self.wait, self.config.max_wait, call_deadline);
        if wait.sleep.is_none() {
            let now = Instant::now();
            let round = Round::at(&mut self.round);
            let paced = round.paced.is_some();
            // With nothing paced, no source can admit before the earliest `retry_after`:
            // when that is past the deadline (`max_wait`, or the call's own), fail now
            // instead of sleeping until it.
            let wake_at = round.wake_after.map(|d| clock::saturating_after(now, d));
            let quota_end = round.quota_ends_first();
            let hopeless = !paced && wake_at.is_some_and(|at| at > wait.deadline);
            if now >= wait.deadline || hopeless || !may_wait {
                if round.held_back {
                    // No credible source will admit in time: go on to the sources held
                    // back, in the same round.
                    round.held_back = false;
                    self.release_deferred = true;
                    self.order_released();
                    return Poll::Ready(Ok(()));
                }
                let waited = now - wait.started;
                let last = round.last_error();
                pass_on(&mut wait.armed, &self.snapshot.wake);
                return Poll::Ready(Err(Box::new(NoneAdmitted::new(waited, last))));
            }
            if !paced {
                // No source refused for want of a slot: a release cannot admit this
                // call. A listener kept from the wake-up before this round would take
                // the next release's wake-up (first in line) from a call waiting for
                // one.
                pass_on(&mut wait.armed, &self.snapshot.wake);
            }
            if paced && wait.armed.is_none() && std::mem::take(&mut wait.disarmed) {
                // Armed again after an attempt: a release since then is the `Notify`'s
                // permit, and this listener completes at once on it.
                wait.armed = Some(armed(&self.snapshot));
            }
            if paced && wait.armed.is_none() {
                // Arm, then try once more at once: a slot released between a refusal
                // and the arming would otherwise be missed.
                wait.armed = Some(armed(&self.snapshot));
                wait.rounds += 1;
                let rounds = wait.rounds;
                self.new_round(rounds);
                return Poll::Ready(Ok(()));
            }
            let mut until = wait.deadline;
            if let Some(at) = wake_at {
                // A gate answering `retry_after = 0` must not make the call spin.
                let mut at = at.max(now + MIN_WAKE_WAIT);
                if quota_end {
                    // The calls woken by one quota's end (a hold, a window) go oldest
                    // first (`pgw_core::fair`). Not for a breaker's: its end admits one
                    // probe, whoever asks first.
                    // The request's field, not `self.history()`: `wait` borrows `self`.
                    let since = self
                        .req
                        .call_history()
                        .map_or(wait.started, |h| h.waiting_since(wait.started));
                    at = pgw_core::fair::wake_at(now, at, since, self.snapshot.waiting.count());
                    wait.counted = Some(self.snapshot.waiting.enter());
                }
                until = until.min(at);
            }
            if paced {
                until = until.min(clock::saturating_after(now, self.config.paced_poll));
            }
            wait.sleep = Some(Box::pin(tokio::time::sleep_until(until)));
        }
        let released = wait
            .armed
            .as_mut()
            .is_some_and(|n| n.as_mut().poll(cx).is_ready());
        let timer = wait
            .sleep
            .as_mut()
            .is_some_and(|s| s.as_mut().poll(cx).is_ready());
        if !released && !timer {
            return Poll::Pending;
        }
        wait.sleep = None;
        wait.counted = None;
        wait.armed = Some(armed(&self.snapshot));
        wait.rounds += 1;
        let rounds = wait.rounds;
        self.new_round(rounds);
        Poll::Ready(Ok(()))
    }

    /// Slow-call detection on the attempt in flight ([`BalanceConfig::cut_silent`]):
    /// `Ready` with the error to end it with once its source is silent (nothing heard
    /// for `silent_after`) and the attempt has run for `silent_after` and
    /// [`CUT_LATENCY_FACTOR`](crate::CUT_LATENCY_FACTOR) times the source's latency; else `Pending`, with a timer
    /// for when that could first hold (an answer heard meanwhile moves it on).
    fn poll_cut(&mut self, cx: &mut Context<'_>) -> Poll<BoxError> {
        let (Some(after), true, Some(i), Some(at)) = (
            self.config.silent_after,
            self.config.cut_silent,
            self.dispatched,
            self.dispatched_at,
        ) else {
            return Poll::Pending;
        };
        let state = &self.snapshot.entries[i].state;
        loop {
            let now = Instant::now();
            let due = match state.cut_age(after) {
                // A source never measured gives no measure of a slow answer: its attempts
                // are left to their own timeouts (its first may be a long generation).
                // Looked at again every `silent_after`: once other attempts' answers
                // measured it, this one is judged too (sent at a cold start to a source
                // that then went dark, it ran to its own timeout).
                None => clock::saturating_after(now, after),
                Some(age) => {
                    let heard = state.heard_at();
                    let old_enough = clock::saturating_after(at, age);
                    // Swallowed: the source timed out attempts since this one was sent
                    // and then answered one sent after it, so it is not silent, but
                    // this attempt's request is likely lost (a black hole that healed
                    // after taking it).
                    let due = if state.swallowed(at) {
                        old_enough
                    } else {
                        old_enough.max(clock::saturating_after(heard, after))
                    };
                    if now >= due {
                        return Poll::Ready(Box::new(SilentCut::new(
                            now.saturating_duration_since(heard),
                            now.saturating_duration_since(at),
                        )));
                    }
                    due
                }
            };
            let sleep = match &mut self.cut {
                Some(s) => {
                    if s.deadline() != due {
                        s.as_mut().reset(due);
                    }
                    s
                }
                None => self.cut.insert(Box::pin(tokio::time::sleep_until(due))),
            };
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }

    /// Accounts for one dispatched attempt's result. `None` means the source did not
    /// admit the call: nothing recorded, try the next one. An attempt still running
    /// (a stream passed through) keeps its inflight count and is judged at its end.
    ///
    /// `answered_now`: the attempt answered in the poll that dispatched it, without
    /// waiting for anything; its answer's instant is then its dispatch's (no second
    /// clock read: nothing can have been waited for in between, and a latency that
    /// small counts as [`MIN_LATENCY_S`](crate::MIN_LATENCY_S) either way).
    fn finish<T>(&mut self, result: Result<T, BoxError>, answered_now: bool) -> Option<Result<T, BoxError>>
    where
        T: 'static,
        Req: 'static,
        C: Classify<T, BoxError> + Clone + Send + 'static,
    {
        let Some(i) = self.dispatched else {
            return Some(result);
        };
        let state = &self.snapshot.entries[i].state;
        // Answered, whatever the answer: no longer awaited (a stream still runs). The
        // awaited count is given back below, with the inflight count in one atomic
        // operation when the answer ends the attempt; `dispatched_at` is taken when it
        // is (by `CallState`'s drop if judging panics before).
        let dispatched_at = self.dispatched_at;
        let mut result = match result {
            Err(e) => match NotAdmitted::of(&*e) {
                Some(na) => {
                    if !matches!(na, NotAdmitted::CircuitOpen(_) | NotAdmitted::Never) {
                        let h = state.health(self.class);
                        let wait_left = self.wait_left();
                        let round = Round::at(&mut self.round);
                        round.soon_best = round.soon_best.max(h);
                        // A quota that ends within `max_wait`, or the call's deadline
                        // when sooner: one more wait reaches it. A longer one (an account
                        // out of credit, held for minutes; or past the call's deadline)
                        // leaves even a poor source worth its attempt.
                        if let NotAdmitted::QuotaExceeded(d) = na
                            && d <= wait_left
                        {
                            round.quota_best = round.quota_best.max(h);
                        }
                    }
                    self.dispatched = None;
                    self.dispatched_at = None;
                    state.answered_and_ended();
                    Round::at(&mut self.round).refuse(na, e);
                    return None;
                }
                None => Err(e),
            },
            ok => ok,
        };
        let now = match dispatched_at {
            Some(at) if answered_now => at,
            _ => Instant::now(),
        };
        // Classified once, here: `None` for a stream under way (judged at its end).
        let outcome = (!self.classifier.in_progress(&result)).then(|| self.classifier.classify(&result));
        heard_from(state, outcome, &result, dispatched_at.unwrap_or(now), now);
        if let Some(outcome) = outcome {
            // Judged now, borrowing: no reference to take and give back. The count is
            // given back after (by `CallState`'s drop if judging panicked).
            judge::<Req, _>(
                state,
                (self.class, self.size),
                self.history(),
                true,
                outcome,
                &result,
            );
            self.dispatched = None;
            self.dispatched_at = None;
            state.answered_and_ended();
        } else {
            self.dispatched_at = None;
            state.answered();
            // Judged at its end: the closure owns what it needs, the inflight count too
            // (handed over before anything that may panic, so exactly one of the guard
            // and `CallState`'s drop gives it back).
            self.dispatched = None;
            let inflight = Inflight(Arc::clone(state));
            let (class, size, history, classifier) = (
                self.class,
                self.size,
                self.history().cloned(),
                self.classifier.clone(),
            );
            // Judged after this poll: the recording in scope then is not this call's.
            self.classifier.defer(
                &mut result,
                Box::new(move |r| {
                    judge::<Req, _>(
                        &inflight.0,
                        (class, size),
                        history.as_ref(),
                        false,
                        classifier.classify(r),
                        r,
                    );
                }),
            );
        }
        Some(result)
    }
}

/// The probes a call sends off its path: what they need of the services, the
/// requests and the classifier to run on a spawned task.
impl<S, Req, C> CallState<S, Req, C>
where
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    S::Response: Send + 'static,
    Req: CarriesHistory + Clone + Send + 'static,
    C: Classify<S::Response, BoxError> + Clone + Send + 'static,
{
    /// Whether source `i` is silent for this call: attempts in flight and nothing
    /// heard for `after`, or [`SILENT_TIMEOUTS`] timeouts since it last answered. In
    /// the second case it is probed: without
    /// [`probe_every`](BalanceConfig::probe_every) by a fresh call, which goes there
    /// itself; with it, by a detached probe (a copy of this call's request, at most one
    /// per `probe_every`), and every call is refused.
    fn refuses_silent(&mut self, i: usize, after: Duration) -> bool {
        let entry = &self.snapshot.entries[i];
        if !entry.state.timed_out_since_heard(SILENT_TIMEOUTS) {
            return entry.state.silent(after);
        }
        let Some(every) = self.config.probe_every else {
            return entry.state.silent(after) || self.failed_before();
        };
        // The turn first: a call that finds the source silent between two probes pays
        // no copy of anything.
        let at = Instant::now();
        if entry.state.probe_turn(at, every) {
            self.send_probe(i, at, after);
        }
        true
    }

    /// Sends a copy of this call's request to source `i` off the call's path (its probe
    /// turn taken), given up after as long as an attempt there may run before a cut.
    fn send_probe(&mut self, i: usize, at: Instant, after: Duration) {
        if self.req.call_history().is_none()
            && let Some(history) = Recording::adopt::<Req>()
        {
            // The probe numbers its attempt in the call's history, like the call's own
            // attempts: the copy carries it past this poll.
            self.req.set_call_history(history);
        }
        let entry = &self.snapshot.entries[i];
        probe::send(
            &entry.state,
            at,
            entry.state.cut_age(after).unwrap_or(after),
            entry.service.clone(),
            self.req.clone(),
            self.class,
            self.classifier.clone(),
        );
    }

    /// Recovery of an abandoned source: a source not credible for this call's class
    /// nor for the default class 0 (under [`CREDIBLE_HEALTH_RATIO`] x the best one's
    /// health in each) that no call has used for `probe_every` gets a copy of this
    /// call's request off its path (at most one per source per `probe_every`, shared
    /// with the silent-source probe), judged like any attempt. A gate below that sees
    /// the source recover says so ([`SourceHealth::recovered`](crate::SourceHealth::recovered):
    /// pgw-stack's breaker does when its half-open probe succeeds), and its health is
    /// whole again; a success alone moves it as one sample (a source failing nine calls
    /// of a shape in ten answers some probes too).
    ///
    /// Without it a source that failed hard was asked again only when every better
    /// source refused: in a pool with room to spare, never (the flapping soak at 4
    /// calls in flight sent nothing to a source back from its outage in seven
    /// recoveries of seven). Its gates decide what reaches it: an open breaker refuses
    /// the copy, or sends it as its half-open probe. Looked for by one dispatching call
    /// per `probe_every / 4`; the others pay a load and a compare.
    #[inline]
    fn probe_abandoned(&mut self, dispatched: usize, at: Instant) {
        let (Some(every), Some(after)) = (self.config.probe_every, self.config.silent_after) else {
            return;
        };
        // Without a health view every source gets its turn: none is abandoned.
        if self.config.policy.has_health_view()
            && self.snapshot.entries.len() >= 2
            && self.snapshot.explore_due(clock::nanos(at), every / 4)
        {
            self.send_abandoned_probes(dispatched, at, every, after);
        }
    }

    /// [`probe_abandoned`](Self::probe_abandoned)'s look for the sources, once per
    /// `probe_every / 4`: kept out of the dispatch's code.
    #[cold]
    #[inline(never)]
    fn send_abandoned_probes(&mut self, dispatched: usize, at: Instant, every: Duration, after: Duration) {
        let entries = &self.snapshot.entries;
        let class = self.class;
        let bar =
            |c: usize| CREDIBLE_HEALTH_RATIO * entries.iter().map(|e| e.state.health(c)).fold(0.0, f64::max);
        let (bar, default_bar) = (bar(class), bar(0));
        for i in 0..entries.len() {
            let state = &self.snapshot.entries[i].state;
            // Not credible for this call's class nor for the default one: a source that
            // serves one shape of call and fails another (P6's stream-cutting source)
            // is not abandoned, and probes of the shape it fails would spend its
            // account's quota for one lucky success in ten.
            if i == dispatched
                || state.health(class) >= bar
                || state.health(0) >= default_bar
                || !state.quiet_for(every)
                || !state.probe_turn(at, every)
            {
                continue;
            }
            self.send_probe(i, at, after);
        }
    }
}

/// What an attempt dispatched at `at` that ended `now` says of its source's silence:
/// a timeout is one more; any answer (a committed stream's first chunk included) says
/// it is alive, and a success (or a stream under way, `outcome` `None`: its first
/// chunk) also how fast it answers. A failure in an `Ok` (an empty completion, a 503
/// response, as the classifier says) answered fast must not make the source look fast.
pub(crate) fn heard_from<T>(
    state: &SourceState,
    outcome: Option<Outcome>,
    result: &Result<T, BoxError>,
    at: Instant,
    now: Instant,
) {
    if outcome == Some(Outcome::LocalExhaustion) {
        // Never left this process (out of descriptors for the connection): nothing
        // heard, and no timeout either.
        return;
    }
    if result.as_ref().err().is_some_and(|e| pgw_core::is_timeout(&**e)) {
        state.timed_out(at, now);
    } else {
        state.heard(now);
        state.answered_sent_at(at);
        if result.is_ok() && outcome.is_none_or(Outcome::is_success) {
            // An answer in the poll that dispatched it took no time: no subtraction.
            let latency = if now == at {
                Duration::ZERO
            } else {
                now.saturating_duration_since(at)
            };
            state.sample_latency(latency);
        }
    }
}

/// Records an attempt's outcome: the health sample of its class and the call's
/// history; when the request carries none and `offer` (an attempt judged in the poll
/// that runs it), the history of the call's [`Recording`] in scope. Not `offer` (a
/// stream judged at its end), its record takes the place of the provisional one the
/// retry layer made when the stream was committed ([`CallHistory::settle`]). With the request's
/// size (`shape`: its class and size), what the source fits: a refusal as too large,
/// or a success.
pub(crate) fn judge<Req: 'static, T>(
    state: &SourceState,
    shape: (usize, Option<u64>),
    history: Option<&CallHistory>,
    offer: bool,
    outcome: Outcome,
    result: &Result<T, BoxError>,
) {
    let (class, size) = shape;
    if let Some(ok) = outcome.health_sample() {
        state.record(class, ok);
    }
    let too_large = result
        .as_ref()
        .err()
        .is_some_and(|e| pgw_core::exceeds_source(&**e));
    if let Some(size) = size {
        if too_large {
            state.refused_size(size, Instant::now());
        } else if outcome.is_success() {
            state.fitted_size(size);
        }
    }
    let record = || {
        let err = result.as_ref().err();
        AttemptRecord {
            source: Some(state.id().clone()),
            outcome,
            timed_out: err.is_some_and(|e| pgw_core::is_timeout(&**e)),
            too_large,
            status: err
                .and_then(|e| pgw_core::UpstreamStatus::find(&**e))
                .map(pgw_core::UpstreamStatus::status),
        }
    };
    match history {
        // Judged at its end (a stream): in place of the retry layer's provisional
        // record of its success, if it made one.
        Some(h) if !offer => h.settle(record()),
        Some(h) => h.push(record()),
        // A success recorded nowhere yet is left so: a call whose first attempt
        // succeeds needs no history, and the retry layer above records it, without its
        // source, should its classifier disagree.
        None if offer && !outcome.is_success() => {
            if let Some(h) = Recording::adopt::<Req>() {
                h.push(record());
            }
        }
        None => {}
    }
}

/// One dispatched attempt's inflight count, owned by an attempt judged at its end (a
/// stream passed through): given back when judged or dropped, on every path.
pub(crate) struct Inflight(pub(crate) Arc<SourceState>);

/// An attempt awaiting its first answer; dropped when it comes (or never will).
pub(crate) struct Awaiting(pub(crate) Arc<SourceState>);

impl Drop for Awaiting {
    fn drop(&mut self) {
        self.0.answered();
    }
}

impl Drop for Inflight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Drops the call's release listener. A wake-up it had taken already (a release, or
/// the signal's stored permit taken when it was armed) goes on to the next waiter:
/// tokio's `Notified` passes on, when dropped, a wake-up it was sent but not one it
/// took. A call that stops listening never keeps a freed slot's wake-up from the call
/// waiting for it.
fn pass_on(armed: &mut Option<Pin<Box<OwnedNotified>>>, wake: &tokio::sync::Notify) {
    if let Some(mut listener) = armed.take()
        && listener
            .as_mut()
            .poll(&mut Context::from_waker(std::task::Waker::noop()))
            .is_ready()
    {
        wake.notify_one();
    }
}

fn armed<S>(snapshot: &Snapshot<S>) -> Pin<Box<OwnedNotified>> {
    let mut n = Box::pin(Arc::clone(&snapshot.wake).notified_owned());
    n.as_mut().enable();
    n
}

pin_project! {
    #[project = StateProj]
    enum State<S, F> {
        Next,
        // A source whose `poll_ready` said `Pending` (a layer that waits, such as
        // tower's `ConcurrencyLimit`); `patience` bounds the wait once it started.
        Ready { svc: S, patience: Option<Pin<Box<tokio::time::Sleep>>> },
        Calling { #[pin] fut: F },
        Done,
    }
}

pin_project! {
    /// The response future of [`HealthP2c`](crate::HealthP2c). Dropping it releases the
    /// inflight count of the attempt in progress.
    pub struct ResponseFuture<S, F, Req, C> {
        #[pin]
        state: State<S, F>,
        ctx: CallState<S, Req, C>,
    }
}

impl<S, F, Req, C> ResponseFuture<S, F, Req, C> {
    // A private constructor with one caller: a struct for its arguments would only rename them.
    #[allow(clippy::too_many_arguments)]
    pub(crate) const fn new(
        req: Req,
        snapshot: Arc<Snapshot<S>>,
        class: usize,
        size: Option<u64>,
        plan: Plan,
        config: BalanceConfig,
        classifier: C,
        seed: u64,
    ) -> Self {
        Self {
            state: State::Next,
            ctx: CallState {
                req,
                snapshot,
                class,
                size,
                plan,
                config,
                classifier,
                seed,
                dispatched: None,
                dispatched_at: None,
                release_deferred: false,
                round: None,
                wait: None,
                cut: None,
            },
        }
    }
}

/// The future was polled after it completed.
#[derive(Debug)]
struct PolledAfterCompletion;

impl fmt::Display for PolledAfterCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("balancer response future polled after completion")
    }
}

impl std::error::Error for PolledAfterCompletion {}

impl<S, Req, C> Future for ResponseFuture<S, S::Future, Req, C>
where
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    C: Classify<S::Response, BoxError> + Clone + Send + 'static,
    S::Response: Send + 'static,
    Req: Clone + CarriesHistory + Send + 'static,
{
    type Output = Result<S::Response, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        // An attempt dispatched in this poll: one that answers before the poll ends
        // answered at its dispatch's instant, and the gates it passes read that
        // instant (`pgw_core::clock`) until the poll ends.
        let mut dispatched_here: Option<clock::Dispatched> = None;
        loop {
            match this.state.as_mut().project() {
                StateProj::Next => match this.ctx.next_candidate() {
                    Some(i) => {
                        if let Some(after) = this.ctx.config.silent_after
                            && this.ctx.refuses_silent(i, after)
                        {
                            // Slow-call detection: calls hang there; refused like an
                            // open circuit until they end, or until a probe hears it.
                            let open = CircuitOpen::new(after);
                            Round::at(&mut this.ctx.round)
                                .refuse(NotAdmitted::CircuitOpen(after), Box::new(open));
                            continue;
                        }
                        let now = Instant::now();
                        // The scope first: it turns `now` into nanoseconds once, for
                        // the count below and the gates the dispatch passes.
                        match &dispatched_here {
                            Some(scope) => scope.update(now),
                            None => dispatched_here = Some(clock::Dispatched::enter(now)),
                        }
                        this.ctx.probe_abandoned(i, now);
                        let entry = &this.ctx.snapshot.entries[i];
                        entry.state.inc(now);
                        this.ctx.dispatched = Some(i);
                        this.ctx.dispatched_at = Some(now);
                        let req = &this.ctx.req;
                        match entry.dispatch(cx, || req.clone()) {
                            Dispatch::Called(fut) => this.state.set(State::Calling { fut }),
                            Dispatch::Own(svc) => this.state.set(State::Ready { svc, patience: None }),
                            Dispatch::Refused(e) => {
                                if let Some(r) = this.ctx.finish(Err(e.into()), true) {
                                    this.state.set(State::Done);
                                    return Poll::Ready(r);
                                }
                            }
                        }
                    }
                    None => {
                        if let Err(e) = ready!(this.ctx.poll_round_end(cx)) {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(e));
                        }
                    }
                },
                StateProj::Ready { svc, patience } => match svc.poll_ready(cx) {
                    Poll::Pending => {
                        // Waited for at most `paced_poll` (or what is left of the
                        // call's wait), then refused as paced: the round goes on to
                        // the other sources, which may sit idle meanwhile, and a call
                        // never waits on one unready source past its deadline.
                        let sleep = patience.get_or_insert_with(|| {
                            Box::pin(tokio::time::sleep_until(this.ctx.readiness_deadline()))
                        });
                        if sleep.as_mut().poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                        let mut paced = Paced::new();
                        if let Some(i) = this.ctx.dispatched {
                            paced = paced.with_source(this.ctx.snapshot.entries[i].state.id().clone());
                        }
                        // A refusal: `finish` counts it in the round and ends nothing.
                        if let Some(r) = this.ctx.finish(Err(Box::new(paced)), false) {
                            this.state.set(State::Done);
                            return Poll::Ready(r);
                        }
                        this.state.set(State::Next);
                    }
                    Poll::Ready(Ok(())) => {
                        let fut = svc.call(this.ctx.req.clone());
                        this.state.set(State::Calling { fut });
                    }
                    Poll::Ready(Err(e)) => {
                        if let Some(r) = this.ctx.finish(Err(e.into()), dispatched_here.is_some()) {
                            this.state.set(State::Done);
                            return Poll::Ready(r);
                        }
                        this.state.set(State::Next);
                    }
                },
                StateProj::Calling { fut } => {
                    let result = match fut.poll(cx) {
                        Poll::Ready(r) => r.map_err(Into::into),
                        Poll::Pending => {
                            // The attempt is out (not refused at once by a gate below,
                            // which keeps the call waiting with the listener it has):
                            // no longer listening for releases.
                            this.ctx.disarm();
                            let cut = ready!(this.ctx.poll_cut(cx));
                            // Dropping the attempt gives back what its gates hold (A4).
                            this.state.set(State::Next);
                            Err(cut)
                        }
                    };
                    if let Some(r) = this.ctx.finish(result, dispatched_here.is_some()) {
                        this.state.set(State::Done);
                        return Poll::Ready(r);
                    }
                    this.state.set(State::Next);
                }
                StateProj::Done => return Poll::Ready(Err(Box::new(PolledAfterCompletion))),
            }
        }
    }
}

impl<S, F, Req, C> fmt::Debug for ResponseFuture<S, F, Req, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field(
                "dispatched",
                &self
                    .ctx
                    .dispatched
                    .map(|i| self.ctx.snapshot.entries[i].state.id()),
            )
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::task::{Context, Waker};

    use tokio::sync::Notify;

    use super::pass_on;

    fn notified_now(wake: &Arc<Notify>) -> bool {
        let mut n = Box::pin(Arc::clone(wake).notified_owned());
        n.as_mut().enable();
        n.as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_ready()
    }

    /// A listener that took the signal's stored permit when it was armed, dropped,
    /// keeps it (tokio passes on only a wake-up it sent and was not taken): `pass_on`
    /// gives it to the next waiter. One that got nothing passes nothing on.
    #[test]
    fn a_wake_up_a_dropped_listener_took_goes_on_and_none_is_made_up() {
        let wake = Arc::new(Notify::new());
        wake.notify_one(); // a release with nobody listening: a stored permit
        let mut armed = Some(Box::pin(Arc::clone(&wake).notified_owned()));
        armed.as_mut().unwrap().as_mut().enable(); // takes the permit
        drop(armed.take());
        assert!(!notified_now(&wake), "tokio's drop alone loses the permit");

        wake.notify_one();
        let mut armed = Some(Box::pin(Arc::clone(&wake).notified_owned()));
        armed.as_mut().unwrap().as_mut().enable();
        pass_on(&mut armed, &wake);
        assert!(armed.is_none());
        assert!(notified_now(&wake), "passed on to the next waiter");

        let mut armed = Some(Box::pin(Arc::clone(&wake).notified_owned()));
        armed.as_mut().unwrap().as_mut().enable();
        pass_on(&mut armed, &wake);
        assert!(!notified_now(&wake), "nothing taken, nothing passed on");
    }
}
