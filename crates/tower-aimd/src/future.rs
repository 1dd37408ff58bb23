//! [`ResponseFuture`]: holds the slot until the attempt ends, on every path
//! (cancellation included).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use pgw_core::{BoxError, Classify, Paced, attempt_outcome, settle};
use pin_project_lite::pin_project;

use crate::limiter::Permit;

pin_project! {
    #[project = KindProj]
    enum Kind<F, C> {
        Called { #[pin] fut: F, permit: Option<Permit>, classifier: C },
        Paced { error: Option<Paced> },
    }
}

pin_project! {
    /// The response future of [`Aimd`](crate::Aimd). Dropping it (or a panic in the
    /// inner future) releases the slot.
    pub struct ResponseFuture<F, C> {
        #[pin]
        kind: Kind<F, C>,
    }
}

impl<F, C> ResponseFuture<F, C> {
    pub(crate) const fn called(fut: F, permit: Permit, classifier: C) -> Self {
        Self {
            kind: Kind::Called {
                fut,
                permit: Some(permit),
                classifier,
            },
        }
    }

    pub(crate) const fn paced(error: Paced) -> Self {
        Self {
            kind: Kind::Paced { error: Some(error) },
        }
    }
}

impl<F, C, T, E> Future for ResponseFuture<F, C>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
    C: Classify<T, BoxError> + Clone + Send + 'static,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Called {
                fut,
                permit,
                classifier,
            } => {
                let mut result = ready!(fut.poll(cx)).map_err(Into::into);
                if let Some(permit) = permit.take() {
                    // The slot is held until the attempt ends (a stream passed through
                    // ends after this future). A not-admitted answer from below is not
                    // an attempt: the limit stays, and the slot goes back as one the
                    // gate below refused in `poll_ready` (`Permit::unused`: it wakes a
                    // waiter only for a refusal counted while it was held). Released as
                    // an attempt's, it answered an old refusal: a balancer round woken
                    // for it met the same refusal below, and so on, round after round.
                    let c = classifier.clone();
                    settle(&*classifier, &mut result, move |r| match attempt_outcome(&c, r) {
                        Some(outcome) => permit.on_outcome(outcome),
                        None => permit.unused(),
                    });
                }
                Poll::Ready(result)
            }
            KindProj::Paced { error } => Poll::Ready(Err(error.take().unwrap_or_default().into())),
        }
    }
}

impl<F, C> fmt::Debug for ResponseFuture<F, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
