//! [`ResponseFuture`]: admission (or waiting for it), the call, and settling.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use pgw_core::{BoxError, NotAdmitted, QuotaExceeded};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use crate::hooks::{AdmissionObserver, UsageReport};
use crate::limiter::{Ending, InFlight, Pending, Permit, Wait, detach};
use crate::service::Hooks;

pin_project! {
    #[project = StateProj]
    enum State<F, U, Deferred> {
        // The admission round trip (Redis) or a wait: everything boxed, allocated only
        // on those paths.
        Deferred { deferred: Box<Deferred> },
        // Admitted: the inner call, with the permit (and the lease's renewal) it holds.
        Calling {
            #[pin]
            fut: F,
            permit: Option<Permit>,
            renew: Option<Pin<Box<Sleep>>>,
            usage: U,
        },
        Failed { error: Option<BoxError> },
        Done,
    }
}

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit).
    ///
    /// It owns the [`Permit`]: dropping it (or a panic unwinding through it) releases
    /// the concurrency lease, and an admission still in flight (Redis) is refunded when
    /// it answers. The answer is returned as soon as the inner service gives it: the
    /// settle (reconcile and release) that follows never delays it; a settle round trip
    /// finishes in the background.
    ///
    /// Small on the path answered at once (memory): one state, the inner future and
    /// the permit; the state of the admission round trip or of a wait is boxed,
    /// allocated only on those paths.
    pub struct ResponseFuture<S, Req, E, U, O>
    where
        S: Service<Req>,
    {
        #[pin]
        state: State<S::Future, U, Deferred<S, Req, E, U, O>>,
    }
}

/// Whether a [`Deferred`] future waits for an admission's answer or for another try.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Admitting,
    Waiting,
}

/// An admission not answered at once: what only its round trip (Redis) or a wait
/// needs, boxed.
struct Deferred<S: Service<Req>, Req, E, U, O> {
    phase: Phase,
    shared: Arc<Hooks<E, U, O>>,
    inner: Option<S>,
    req: Option<Req>,
    pending: Option<InFlight>,
    tokens: u64,
    deadline: Option<Instant>,
    /// The wait for another try, and how many refusals it has waited out (the Redis
    /// backoff for slots grows with them).
    wait: Option<Wait>,
    refusals: u32,
    deadline_timer: Option<Pin<Box<Sleep>>>,
}

impl<S, Req, E, U, O> fmt::Debug for ResponseFuture<S, Req, E, U, O>
where
    S: Service<Req>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let permit = match &self.state {
            State::Calling { permit, .. } => permit.as_ref(),
            _ => None,
        };
        f.debug_struct("ResponseFuture")
            .field("permit", &permit)
            .finish_non_exhaustive()
    }
}

impl<S, Req, E, U: Clone, O> ResponseFuture<S, Req, E, U, O>
where
    S: Service<Req>,
{
    fn deferred(
        phase: Phase,
        shared: &Arc<Hooks<E, U, O>>,
        inner: S,
        req: Req,
        tokens: u64,
    ) -> Box<Deferred<S, Req, E, U, O>> {
        Box::new(Deferred {
            phase,
            shared: shared.clone(),
            inner: Some(inner),
            req: Some(req),
            pending: None,
            tokens,
            deadline: None,
            wait: None,
            refusals: 0,
            deadline_timer: None,
        })
    }

    #[cold]
    pub(crate) fn failed(err: BoxError) -> Self {
        Self {
            state: State::Failed { error: Some(err) },
        }
    }

    #[inline(always)]
    pub(crate) fn calling(shared: &Hooks<E, U, O>, fut: S::Future, permit: Permit) -> Self {
        Self {
            state: State::Calling {
                fut,
                renew: if permit.has_lease() {
                    renewal(&permit)
                } else {
                    None
                },
                permit: Some(permit),
                usage: shared.usage.clone(),
            },
        }
    }

    pub(crate) fn admitting(shared: &Arc<Hooks<E, U, O>>, inner: S, req: Req, pending: Pending) -> Self {
        let mut deferred = Self::deferred(Phase::Admitting, shared, inner, req, pending.ticket.tokens);
        deferred.deadline = match shared.limiter.config().mode {
            crate::Mode::Wait { max_wait: Some(w) } => Instant::now().checked_add(w),
            _ => None,
        };
        deferred.pending = Some(InFlight::new(shared.limiter.clone(), pending.fut, pending.ticket));
        Self {
            state: State::Deferred { deferred },
        }
    }

    pub(crate) fn waiting(
        shared: &Arc<Hooks<E, U, O>>,
        inner: S,
        req: Req,
        tokens: u64,
        max_wait: Option<Duration>,
        refused: QuotaExceeded,
    ) -> Self {
        // One clock read; a `max_wait` too large for the clock is no deadline.
        let now = Instant::now();
        let deadline = max_wait.and_then(|w| now.checked_add(w));
        if deadline.is_some_and(|d| out_of_time(&refused, now, d)) {
            return Self::failed(Box::new(refused));
        }
        let wait = shared.limiter.wait(&refused, 0, None);
        Self::queued(shared, inner, req, tokens, deadline, wait)
    }

    /// Waits behind admissions already waiting (first come first served), without
    /// trying first.
    pub(crate) fn behind(
        shared: &Arc<Hooks<E, U, O>>,
        inner: S,
        req: Req,
        tokens: u64,
        max_wait: Option<Duration>,
        wait: Wait,
    ) -> Self {
        let deadline = max_wait.and_then(|w| Instant::now().checked_add(w));
        Self::queued(shared, inner, req, tokens, deadline, wait)
    }

    fn queued(
        shared: &Arc<Hooks<E, U, O>>,
        inner: S,
        req: Req,
        tokens: u64,
        deadline: Option<Instant>,
        wait: Wait,
    ) -> Self {
        let mut deferred = Self::deferred(Phase::Waiting, shared, inner, req, tokens);
        deferred.deadline = deadline;
        deferred.wait = Some(wait);
        deferred.refusals = 1;
        Self {
            state: State::Deferred { deferred },
        }
    }
}

#[cold]
fn renewal(permit: &Permit) -> Option<Pin<Box<Sleep>>> {
    if !permit.has_lease() {
        return None;
    }
    let every = permit.limiter().renew_every()?;
    // From the admission's own instant when the backend read it: no second clock read.
    let at = permit
        .admitted_local()
        .unwrap_or_else(Instant::now)
        .checked_add(every)?;
    Some(Box::pin(tokio::time::sleep_until(at)))
}

impl<S, Req, E, U, O> Future for ResponseFuture<S, Req, E, U, O>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    S::Response: 'static,
    U: UsageReport<S::Response> + Clone + Send + 'static,
    O: AdmissionObserver<Req>,
{
    type Output = Result<S::Response, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            let deferred = match state.as_mut().project() {
                StateProj::Calling {
                    fut,
                    permit,
                    renew,
                    usage,
                } => {
                    if let (Some(sleep), Some(permit)) = (renew.as_mut(), permit.as_ref()) {
                        while sleep.as_mut().poll(cx).is_ready() {
                            detach_renewal(permit);
                            let every = permit.limiter().renew_every().unwrap_or(Duration::from_secs(1));
                            // The lease TTL is bounded (validated): the clock cannot overflow.
                            sleep.as_mut().reset(Instant::now() + every);
                        }
                    }
                    let mut out = ready!(fut.poll(cx)).map_err(Into::into);
                    if let Some(permit) = permit.take() {
                        if matches!(&out, Ok(res) if usage.in_progress(res)) {
                            defer_settle(usage, permit, &mut out);
                        } else {
                            // The answer never waits for the settle (reconcile,
                            // release): a round trip still in flight finishes in the
                            // background, its command already on the connection (see
                            // `detach`).
                            permit.end_detached(ending(usage, &out));
                        }
                    }
                    state.set(State::Done);
                    return Poll::Ready(out);
                }
                StateProj::Deferred { deferred } => deferred,
                StateProj::Failed { error } => {
                    let error = error.take().expect("error taken twice");
                    state.set(State::Done);
                    return Poll::Ready(Err(error));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            };
            match deferred.phase {
                Phase::Admitting => {
                    let pending = deferred.pending.as_mut().expect("admitting without an admission");
                    let verdict = ready!(Pin::new(&mut *pending).poll(cx));
                    let ticket = pending.ticket();
                    deferred.pending = None;
                    let shared = &deferred.shared;
                    match shared.limiter.conclude(ticket, verdict) {
                        Ok(permit) => {
                            if let Some(w) = deferred.wait.take() {
                                shared.limiter.waited(w);
                            }
                            let req = deferred.req.take().expect("request taken twice");
                            shared.observer.on_admission(&req, permit.admission());
                            let mut svc = deferred.inner.take().expect("service taken twice");
                            let fut = svc.call(req);
                            let next = State::Calling {
                                fut,
                                renew: renewal(&permit),
                                permit: Some(permit),
                                usage: shared.usage.clone(),
                            };
                            state.set(next);
                        }
                        Err(e) => match (waits(&shared.limiter), e.downcast::<QuotaExceeded>()) {
                            (true, Ok(q)) => {
                                let now = Instant::now();
                                if deferred.deadline.is_some_and(|d| out_of_time(&q, now, d)) {
                                    deferred.wait = None;
                                    state.set(State::Done);
                                    return Poll::Ready(Err(q));
                                }
                                let wait = shared.limiter.wait(&q, deferred.refusals, deferred.wait.take());
                                deferred.wait = Some(wait);
                                deferred.refusals = deferred.refusals.saturating_add(1);
                                deferred.phase = Phase::Waiting;
                            }
                            (_, Ok(q)) => {
                                state.set(State::Done);
                                return Poll::Ready(Err(q));
                            }
                            (_, Err(e)) => {
                                deferred.wait = None;
                                state.set(State::Done);
                                return Poll::Ready(Err(e));
                            }
                        },
                    }
                }
                Phase::Waiting => {
                    let limiter = &deferred.shared.limiter;
                    let wait = deferred.wait.as_mut().expect("waiting without a wait");
                    if limiter.poll_wait(wait, deferred.tokens, cx).is_pending() {
                        let Some(deadline) = deferred.deadline else {
                            return Poll::Pending;
                        };
                        let timer = deferred
                            .deadline_timer
                            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                        // Out of time: one last try, answered as it comes (a refusal
                        // past the deadline is final), and asked: a slot refusal
                        // remembered may outlast the wait, while another process's
                        // release would go unseen.
                        ready!(timer.as_mut().poll(cx));
                        limiter.forget_slot_refusals();
                    }
                    // Asked again at the clock the wait read: in the poll a balancer
                    // dispatches in, `pgw_core::clock` answers the dispatch's instant,
                    // and a hold or lease that ended between it and the wait's reading
                    // was refused at it and found over by the wait, again and again
                    // in the same poll, for ever.
                    let _now = pgw_core::clock::Dispatched::enter(Instant::now());
                    match limiter.start(deferred.tokens) {
                        Ok(p) => deferred.pending = Some(InFlight::new(limiter.clone(), p.fut, p.ticket)),
                        Err(e) => {
                            deferred.wait = None;
                            state.set(State::Done);
                            return Poll::Ready(Err(Box::new(e)));
                        }
                    }
                    deferred.phase = Phase::Admitting;
                }
            }
        }
    }
}

fn waits(limiter: &crate::RateLimiter) -> bool {
    matches!(limiter.config().mode, crate::Mode::Wait { .. })
}

/// How a call ended, for its settle: a refusal from below, or an attempt this process
/// could not make (out of file descriptors for its connection: nothing was sent,
/// `pgw_core::is_local_exhaustion`), refunds (it was not an attempt); anything else is
/// charged its real usage when the response reports it.
fn ending<R, U: UsageReport<R>>(usage: &U, out: &Result<R, BoxError>) -> Ending {
    match out {
        Ok(res) => Ending::Finished(usage.tokens_used(res)),
        Err(e) if NotAdmitted::of(&**e).is_some() || pgw_core::is_local_exhaustion(&**e) => Ending::Refunded,
        Err(e) => Ending::Finished(usage.tokens_used_by_error(e)),
    }
}

/// Settles `permit` when the running response in `out` ends; its lease is renewed
/// in the background until then.
fn defer_settle<R, U>(usage: &U, permit: Permit, out: &mut Result<R, BoxError>)
where
    R: 'static,
    U: UsageReport<R> + Clone + Send + 'static,
{
    let renewing = permit.renewal();
    let report = usage.clone();
    usage.defer(
        out,
        Box::new(move |r| {
            drop(renewing);
            permit.end_detached(ending(&report, r));
        }),
    );
}

fn detach_renewal(permit: &Permit) {
    if let Some(fut) = permit.renew_now() {
        detach(fut);
    }
}

/// Whether a wait for `refused`, at `now`, cannot end by `deadline`: it has passed, or
/// the refusal frees only after it. A concurrency refusal's `retry_after` is a hint (a
/// lease may end at any moment), so only the deadline itself ends that wait.
fn out_of_time(refused: &QuotaExceeded, now: Instant, deadline: Instant) -> bool {
    now >= deadline
        || (refused.dimension() != "concurrency"
            && now
                .checked_add(refused.retry_after())
                .is_none_or(|t| t > deadline))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reports no usage on answers and 7 tokens on every error.
    struct BilledErrors;

    impl UsageReport<()> for BilledErrors {
        fn tokens_used(&self, (): &()) -> Option<u64> {
            None
        }

        fn tokens_used_by_error(&self, _: &BoxError) -> Option<u64> {
            Some(7)
        }
    }

    #[test]
    fn a_failed_call_whose_error_reports_usage_is_charged_it() {
        let billed = ending(&BilledErrors, &Err("refused by a validator".into()));
        assert!(matches!(billed, Ending::Finished(Some(7))), "{billed:?}");
        // The default: an error says nothing, the estimate stays charged.
        let plain = ending(&|(): &()| Some(3), &Err("upstream 500".into()));
        assert!(matches!(plain, Ending::Finished(None)), "{plain:?}");
        // A refusal from below is still refunded, whatever the report says.
        let refused: BoxError = Box::new(pgw_core::Paced::new());
        assert!(matches!(ending(&BilledErrors, &Err(refused)), Ending::Refunded));
    }
}
