//! The [`ResponseFuture`] of [`Breaker`](crate::Breaker).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures_core::TryFuture;
use pgw_core::{BoxError, BreakerVerdict, Classify, attempt_outcome};
use pin_project_lite::pin_project;

use crate::backend::Gate;
use crate::service::Lease;

pin_project! {
    #[project = StateProj]
    enum State<F, R> {
        Refused { error: Option<BoxError> },
        Calling { #[pin] fut: F },
        Recording { #[pin] record: R },
    }
}

pin_project! {
    /// The response future of [`Breaker`](crate::Breaker).
    ///
    /// Holds the admission (and, in half-open, the probe lease): completing records the
    /// classified outcome against the admission's epoch; dropping it early, or a panic
    /// in the inner future, ends a probe with no verdict (the lease is released, so the
    /// next admission may probe at once). Resolves after the
    /// record has landed, so a caller's next admission sees its outcome.
    pub struct ResponseFuture<F, G, C>
    where
        F: TryFuture,
        G: Gate,
    {
        #[pin]
        state: State<F, G::Record>,
        lease: Option<Lease<G>>,
        classifier: Option<C>,
        output: Option<Result<F::Ok, BoxError>>,
    }
}

impl<F: TryFuture, G: Gate, C> ResponseFuture<F, G, C> {
    pub(crate) const fn called(fut: F, lease: Lease<G>, classifier: C) -> Self {
        Self {
            state: State::Calling { fut },
            lease: Some(lease),
            classifier: Some(classifier),
            output: None,
        }
    }

    pub(crate) const fn refused(error: BoxError) -> Self {
        Self {
            state: State::Refused { error: Some(error) },
            lease: None,
            classifier: None,
            output: None,
        }
    }
}

impl<F: TryFuture, G: Gate, C> fmt::Debug for ResponseFuture<F, G, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::Refused { .. } => "refused",
            State::Calling { .. } => "calling",
            State::Recording { .. } => "recording",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

impl<F, G, C> Future for ResponseFuture<F, G, C>
where
    F: TryFuture,
    F::Error: Into<BoxError>,
    F::Ok: 'static,
    G: Gate,
    C: Classify<F::Ok, BoxError> + Clone + Send + 'static,
{
    type Output = Result<F::Ok, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Refused { error } => {
                    return Poll::Ready(Err(error
                        .take()
                        .unwrap_or_else(|| "breaker response future polled after completion".into())));
                }
                StateProj::Calling { fut } => {
                    let mut result = ready!(fut.try_poll(cx)).map_err(Into::into);
                    // A gate below refused: not an attempt, nothing to count (B3).
                    let verdict = |c: &C, r: &Result<F::Ok, BoxError>| {
                        attempt_outcome(c, r)
                            .map_or(BreakerVerdict::Ignore, pgw_core::Outcome::breaker_verdict)
                    };
                    if this.classifier.as_ref().is_some_and(|c| c.in_progress(&result))
                        && let (Some(c), Some(lease)) = (this.classifier.take(), this.lease.take())
                    {
                        // Still running (a stream passed through): the verdict is the
                        // end's. The record starts when it is made; nothing waits for it.
                        let judge = c.clone();
                        c.defer(
                            &mut result,
                            Box::new(move |r| drop(lease.finish(verdict(&judge, r)))),
                        );
                        return Poll::Ready(result);
                    }
                    let verdict = this
                        .classifier
                        .as_ref()
                        .map_or(BreakerVerdict::Ignore, |c| verdict(c, &result));
                    let record = this.lease.take().and_then(|lease| lease.finish(verdict));
                    match record {
                        Some(record) => {
                            *this.output = Some(result);
                            this.state.set(State::Recording { record });
                        }
                        None => return Poll::Ready(result),
                    }
                }
                StateProj::Recording { record } => {
                    ready!(record.poll(cx));
                    return Poll::Ready(
                        this.output
                            .take()
                            .unwrap_or_else(|| Err("breaker response future polled after completion".into())),
                    );
                }
            }
        }
    }
}
