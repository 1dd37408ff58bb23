//! [`RateLimit`]: the service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use pgw_core::{BoxError, QuotaExceeded};
use tower_service::Service;

use crate::RateLimiter;
use crate::config::Mode;
use crate::future::ResponseFuture;
use crate::hooks::{AdmissionObserver, ChatEstimate, ChatUsage, NoObserver, TokenEstimate, UsageReport};
use crate::limiter::{Pending, Started};

/// What every call of one service shares: the limiter and the hooks.
pub(crate) struct Hooks<E, U, O> {
    pub(crate) limiter: RateLimiter,
    pub(crate) estimate: E,
    pub(crate) usage: U,
    pub(crate) observer: O,
}

/// Admits every request through a [`RateLimiter`] before calling the inner service.
///
/// Shedding (the default): always ready (once the inner service is); a request that
/// is not admitted gets [`QuotaExceeded`] from its future at once. Waiting
/// ([`Mode::Wait`]): the future waits until admitted (or `max_wait`). An error from the
/// inner service that is itself *not admitted* ([`pgw_core::NotAdmitted::of`]) refunds
/// the request and its tokens and releases the lease: it was not an attempt.
pub struct RateLimit<S, E = ChatEstimate, U = ChatUsage, O = NoObserver> {
    inner: S,
    shared: Arc<Hooks<E, U, O>>,
}

impl<S: Clone, E, U, O> Clone for RateLimit<S, E, U, O> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, E, U, O> fmt::Debug for RateLimit<S, E, U, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("limiter", &self.shared.limiter)
            .finish()
    }
}

impl<S> RateLimit<S> {
    /// Wraps `inner` with `limiter` and the chat hooks.
    pub fn new(inner: S, limiter: RateLimiter) -> Self {
        Self::from_hooks(
            inner,
            Arc::new(Hooks {
                limiter,
                estimate: ChatEstimate,
                usage: ChatUsage,
                observer: NoObserver,
            }),
        )
    }
}

impl<S, E, U, O> RateLimit<S, E, U, O> {
    pub(crate) const fn from_hooks(inner: S, shared: Arc<Hooks<E, U, O>>) -> Self {
        Self { inner, shared }
    }

    /// The inner service.
    pub const fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub const fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the limiter, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// The limiter.
    pub fn limiter(&self) -> &RateLimiter {
        &self.shared.limiter
    }
}

impl<S, Req, E, U, O> Service<Req> for RateLimit<S, E, U, O>
where
    S: Service<Req> + Clone,
    S::Error: Into<BoxError>,
    S::Response: 'static,
    E: TokenEstimate<Req>,
    U: UsageReport<S::Response> + Clone + Send + 'static,
    O: AdmissionObserver<Req>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S, Req, E, U, O>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let shared = &self.shared;
        let limiter = &shared.limiter;
        let tokens = shared.estimate.estimate(&req);
        if let Mode::Wait { max_wait } = limiter.config().mode
            && let Some(wait) = limiter.queue_ahead()
        {
            // Others wait already: behind them, first come first served.
            if let Err(e) = limiter.check_size(tokens) {
                return self.failed(Box::new(e));
            }
            let inner = take_ready(&mut self.inner);
            return ResponseFuture::behind(shared, inner, req, tokens, max_wait, wait);
        }
        match limiter.start_now(tokens) {
            Err(e) => self.failed(Box::new(e)),
            // The memory backend answers at once: dispatch on the service made ready
            // by `poll_ready`, no clone.
            Ok(Started::Now(ticket, verdict)) => match limiter.conclude_now(ticket, verdict) {
                Ok(permit) => {
                    shared.observer.on_admission(&req, permit.admission());
                    let fut = self.inner.call(req);
                    ResponseFuture::calling(shared, fut, permit)
                }
                Err(e) => self.refused(req, ticket.tokens, e),
            },
            Ok(Started::Later(Pending { fut, ticket })) => match fut.into_ready() {
                Ok(verdict) => match limiter.conclude(ticket, verdict) {
                    Ok(permit) => {
                        shared.observer.on_admission(&req, permit.admission());
                        let fut = self.inner.call(req);
                        ResponseFuture::calling(shared, fut, permit)
                    }
                    Err(e) => self.refused(req, ticket.tokens, e),
                },
                Err(fut) => {
                    let inner = take_ready(&mut self.inner);
                    ResponseFuture::admitting(shared, inner, req, Pending { fut, ticket })
                }
            },
        }
    }
}

impl<S, E, U, O> RateLimit<S, E, U, O>
where
    U: Clone,
{
    /// Not admitted at once: wait (waiting mode, a quota refusal) or answer the error.
    #[cold]
    #[inline(never)]
    fn refused<Req>(&mut self, req: Req, tokens: u64, e: BoxError) -> ResponseFuture<S, Req, E, U, O>
    where
        S: Service<Req> + Clone,
    {
        let shared = &self.shared;
        match (shared.limiter.config().mode, e.downcast::<QuotaExceeded>()) {
            (Mode::Wait { max_wait }, Ok(q)) => {
                let inner = take_ready(&mut self.inner);
                ResponseFuture::waiting(shared, inner, req, tokens, max_wait, *q)
            }
            (_, Ok(q)) => self.failed(q),
            (_, Err(e)) => self.failed(e),
        }
    }

    /// A call refused here: the service `poll_ready` made ready is dropped (a clone
    /// stays), so what its readiness reserved below (a concurrency permit, a slot) is
    /// given back now, not held until this service's next call.
    #[cold]
    #[inline(never)]
    fn failed<Req>(&mut self, e: BoxError) -> ResponseFuture<S, Req, E, U, O>
    where
        S: Service<Req> + Clone,
    {
        drop(take_ready(&mut self.inner));
        ResponseFuture::failed(e)
    }
}

/// Moves the service made ready by `poll_ready` into the future, leaving a clone
/// (tower-service's "Be careful when cloning inner services").
fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}
