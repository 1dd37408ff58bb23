//! [`ResponseFuture`]: admission (or waiting for it), the call, and settling.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use pgw_core::{BackendUnavailable, BoxError, NotAdmitted, QuotaExceeded};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use crate::backend::BackendFuture;
use crate::hooks::{AdmissionObserver, UsageReport};
use crate::limiter::{Ending, Pending, Permit, detach};
use crate::service::Hooks;

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Admitting,
        Waiting { sleep: Pin<Box<Sleep>> },
        Calling { #[pin] fut: F },
        Settling,
        Failed,
        Done,
    }
}

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit).
    ///
    /// It owns the [`Permit`]: dropping it (or a panic unwinding through it) releases
    /// the concurrency lease; a settle still in flight finishes in the background.
    pub struct ResponseFuture<S, Req, E, U, O>
    where
        S: Service<Req>,
    {
        #[pin]
        state: State<S::Future>,
        // Only while admitting or waiting: the answered-at-once path holds no reference.
        shared: Option<Arc<Hooks<E, U, O>>>,
        usage: U,
        inner: Option<S>,
        req: Option<Req>,
        pending: Option<Pending>,
        tokens: u64,
        deadline: Option<Instant>,
        permit: Option<Permit>,
        renew: Option<Pin<Box<Sleep>>>,
        settling: Option<Detached>,
        output: Option<Result<S::Response, BoxError>>,
    }
}

impl<S, Req, E, U, O> fmt::Debug for ResponseFuture<S, Req, E, U, O>
where
    S: Service<Req>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("permit", &self.permit)
            .finish_non_exhaustive()
    }
}

/// A settle in flight; finished in the background if the future is dropped first.
struct Detached(Option<BackendFuture<Result<(), BackendUnavailable>>>);

impl Drop for Detached {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            detach(f);
        }
    }
}

impl<S, Req, E, U: Clone, O> ResponseFuture<S, Req, E, U, O>
where
    S: Service<Req>,
{
    fn new(shared: &Arc<Hooks<E, U, O>>, keep: bool, state: State<S::Future>) -> Self {
        Self {
            state,
            shared: keep.then(|| shared.clone()),
            usage: shared.usage.clone(),
            inner: None,
            req: None,
            pending: None,
            tokens: 0,
            deadline: None,
            permit: None,
            renew: None,
            settling: None,
            output: None,
        }
    }

    pub(crate) fn failed(shared: &Arc<Hooks<E, U, O>>, err: BoxError) -> Self {
        let mut f = Self::new(shared, false, State::Failed);
        f.output = Some(Err(err));
        f
    }

    pub(crate) fn calling(shared: &Arc<Hooks<E, U, O>>, fut: S::Future, permit: Permit) -> Self {
        let mut f = Self::new(shared, false, State::Calling { fut });
        f.renew = renewal(&permit);
        f.permit = Some(permit);
        f
    }

    pub(crate) fn admitting(shared: &Arc<Hooks<E, U, O>>, inner: S, req: Req, pending: Pending) -> Self {
        let mut f = Self::new(shared, true, State::Admitting);
        f.tokens = pending.ticket.tokens;
        f.deadline = match shared.limiter.config().mode {
            crate::Mode::Wait { max_wait: Some(w) } => Some(Instant::now() + w),
            _ => None,
        };
        f.inner = Some(inner);
        f.req = Some(req);
        f.pending = Some(pending);
        f
    }

    pub(crate) fn waiting(
        shared: &Arc<Hooks<E, U, O>>,
        inner: S,
        req: Req,
        tokens: u64,
        max_wait: Option<Duration>,
        refused: QuotaExceeded,
    ) -> Self {
        let deadline = max_wait.map(|w| Instant::now() + w);
        if deadline.is_some_and(|d| Instant::now() + refused.retry_after() > d) {
            return Self::failed(shared, Box::new(refused));
        }
        let sleep = Box::pin(tokio::time::sleep(refused.retry_after()));
        let mut f = Self::new(shared, true, State::Waiting { sleep });
        f.tokens = tokens;
        f.deadline = deadline;
        f.inner = Some(inner);
        f.req = Some(req);
        f
    }
}

fn renewal(permit: &Permit) -> Option<Pin<Box<Sleep>>> {
    if !permit.has_lease() {
        return None;
    }
    let every = permit.limiter().renew_every()?;
    Some(Box::pin(tokio::time::sleep(every)))
}

impl<S, Req, E, U, O> Future for ResponseFuture<S, Req, E, U, O>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    U: UsageReport<S::Response>,
    O: AdmissionObserver<Req>,
{
    type Output = Result<S::Response, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Admitting => {
                    let pending = this.pending.as_mut().expect("admitting without an admission");
                    let verdict = ready!(Pin::new(&mut pending.fut).poll(cx));
                    let ticket = pending.ticket;
                    *this.pending = None;
                    let shared = this.shared.as_ref().expect("admitting without hooks");
                    match shared.limiter.conclude(ticket, verdict) {
                        Ok(permit) => {
                            let req = this.req.take().expect("request taken twice");
                            shared.observer.on_admission(&req, permit.admission());
                            let mut svc = this.inner.take().expect("service taken twice");
                            let fut = svc.call(req);
                            *this.renew = renewal(&permit);
                            *this.permit = Some(permit);
                            this.state.set(State::Calling { fut });
                        }
                        Err(e) => match (waits(&shared.limiter), e.downcast::<QuotaExceeded>()) {
                            (true, Ok(q)) => {
                                if this
                                    .deadline
                                    .is_some_and(|d| Instant::now() + q.retry_after() > d)
                                {
                                    this.state.set(State::Done);
                                    return Poll::Ready(Err(q));
                                }
                                let sleep = Box::pin(tokio::time::sleep(q.retry_after()));
                                this.state.set(State::Waiting { sleep });
                            }
                            (_, Ok(q)) => {
                                this.state.set(State::Done);
                                return Poll::Ready(Err(q));
                            }
                            (_, Err(e)) => {
                                this.state.set(State::Done);
                                return Poll::Ready(Err(e));
                            }
                        },
                    }
                }
                StateProj::Waiting { sleep } => {
                    ready!(sleep.as_mut().poll(cx));
                    let shared = this.shared.as_ref().expect("waiting without hooks");
                    match shared.limiter.start(*this.tokens) {
                        Ok(p) => *this.pending = Some(p),
                        Err(e) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(Box::new(e)));
                        }
                    }
                    this.state.set(State::Admitting);
                }
                StateProj::Calling { fut } => {
                    if let (Some(sleep), Some(permit)) = (this.renew.as_mut(), this.permit.as_ref()) {
                        while sleep.as_mut().poll(cx).is_ready() {
                            detach_renewal(permit);
                            let every = permit.limiter().renew_every().unwrap_or(Duration::from_secs(1));
                            sleep.as_mut().reset(Instant::now() + every);
                        }
                    }
                    let out = ready!(fut.poll(cx)).map_err(Into::into);
                    *this.renew = None;
                    let Some(permit) = this.permit.take() else {
                        this.state.set(State::Done);
                        return Poll::Ready(out);
                    };
                    let ending = match &out {
                        Ok(res) => Ending::Finished(this.usage.tokens_used(res)),
                        Err(e) if NotAdmitted::of(&**e).is_some() => Ending::Refunded,
                        Err(_) => Ending::Finished(None),
                    };
                    match permit.end(ending).now_or() {
                        Ok(_) => {
                            this.state.set(State::Done);
                            return Poll::Ready(out);
                        }
                        Err(f) => {
                            *this.settling = Some(Detached(Some(f)));
                            *this.output = Some(out);
                            this.state.set(State::Settling);
                        }
                    }
                }
                StateProj::Settling => {
                    let d = this.settling.as_mut().expect("settling without a settle");
                    let fut = d.0.as_mut().expect("settle taken twice");
                    // Failures are logged and counted by the limiter; the answer stands.
                    let _ = ready!(Pin::new(fut).poll(cx));
                    d.0 = None;
                    this.state.set(State::Done);
                    return Poll::Ready(this.output.take().expect("output taken twice"));
                }
                StateProj::Failed => {
                    this.state.set(State::Done);
                    return Poll::Ready(this.output.take().expect("output taken twice"));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

fn waits(limiter: &crate::RateLimiter) -> bool {
    matches!(limiter.config().mode, crate::Mode::Wait { .. })
}

fn detach_renewal(permit: &Permit) {
    if let Some(fut) = permit.renew_now() {
        detach(fut);
    }
}
