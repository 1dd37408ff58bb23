//! [`Aimd`]: the service.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use pgw_core::{BoxError, Classify, OkIsSuccess, Paced};
use tokio::sync::futures::OwnedNotified;
use tower_service::Service;

use crate::future::ResponseFuture;
use crate::limiter::{Limiter, Permit};
use crate::{AimdConfig, AimdHandle, ConfigError, Mode};

/// An adaptive (AIMD) concurrency limit in front of one source.
///
/// In [`Mode::Wait`] a slot is taken in `poll_ready` and spent in `call`, like tower's
/// `ConcurrencyLimit`. In [`Mode::Shed`] the service is always ready and a call over
/// the limit answers [`Paced`]: `poll_ready` takes a slot when one is free and only
/// then asks the inner service (the gates below, a breaker's admission round trip
/// among them, are not asked for a call this gate refuses); with none free it is
/// ready at once and the `call` answers [`Paced`]. A `call` made without a successful
/// `poll_ready` tries to take a slot and answers [`Paced`] when none is free (it
/// never panics).
pub struct Aimd<S, C = OkIsSuccess> {
    inner: S,
    limiter: Arc<Limiter>,
    mode: Mode,
    classifier: C,
    permit: Option<Permit>,
    /// Mode::Wait: waiting for a release, with a refusal counted.
    waiting: Option<Waiting>,
    /// Mode::Shed: `poll_ready` found no slot; the next `call` answers `Paced`
    /// without calling the inner service (which was not polled ready).
    shed: bool,
}

/// A waiter's registration on the release signal and the refusal it counted. Dropped
/// before its wake-up came (admitted by another path, or the service dropped while it
/// waits), it withdraws that refusal, so no release wakes anyone for it; woken, the
/// release took the refusal already.
struct Waiting {
    notified: Option<Pin<Box<OwnedNotified>>>,
    limiter: Arc<Limiter>,
}

impl Waiting {
    /// Whether the wake-up came (then nothing is left to withdraw).
    fn poll_woken(&mut self, cx: &mut Context<'_>) -> bool {
        let woken = self
            .notified
            .as_mut()
            .is_none_or(|n| n.as_mut().poll(cx).is_ready());
        if woken {
            self.notified = None;
        }
        woken
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let Some(mut n) = self.notified.take() else {
            return;
        };
        if n.as_mut()
            .poll(&mut Context::from_waker(std::task::Waker::noop()))
            .is_ready()
        {
            // Woken already: the release took this refusal. Its freed slot goes to
            // the next waiter with a refusal counted, as a release would wake it
            // (dropped unread, tokio's `Notified` would pass the wake-up on even with
            // nobody waiting, left as a permit that wakes the next waiter for nothing).
            // A wake-up that came just as this waiter took a slot anyway (admitted by
            // `try_acquire`) is passed on too: the next waiter may find no slot and
            // count its refusal again, where a wake-up kept back could leave a slot
            // idle.
            if self.limiter.take_refusal() {
                self.limiter.wake_one();
            }
        } else {
            drop(n);
            self.limiter.take_refusal();
        }
    }
}

impl<S> Aimd<S> {
    /// Wraps `inner` with its own limiter, in [`Mode::Wait`].
    ///
    /// # Errors
    /// A [`ConfigError`] naming the bad field.
    pub fn new(inner: S, config: &AimdConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let limiter = Arc::new(Limiter::new(config, None, Arc::default(), Vec::new()));
        Ok(Self::from_parts(inner, limiter, Mode::Wait, OkIsSuccess))
    }
}

impl<S, C> Aimd<S, C> {
    pub(crate) const fn from_parts(inner: S, limiter: Arc<Limiter>, mode: Mode, classifier: C) -> Self {
        Self {
            inner,
            limiter,
            mode,
            classifier,
            permit: None,
            waiting: None,
            shed: false,
        }
    }

    /// A read-only view of the limit and inflight count.
    #[must_use]
    pub fn handle(&self) -> AimdHandle {
        AimdHandle {
            limiter: Arc::clone(&self.limiter),
        }
    }

    /// The inner service.
    pub const fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub const fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service (a slot reserved by `poll_ready` is released).
    pub fn into_inner(self) -> S {
        self.inner
    }

    fn paced(&self) -> Paced {
        match self.limiter.source() {
            Some(s) => Paced::new().with_source(s.clone()),
            None => Paced::new(),
        }
    }

    /// Waits for a slot (Mode::Wait).
    fn poll_slot(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let seen = loop {
            // A wake-up is taken before the slot: a `Notified` dropped with its wake-up
            // unread would pass it on to the next waiter, who would find no slot.
            if self.waiting.as_mut().is_some_and(|w| w.poll_woken(cx)) {
                self.waiting = None;
            }
            if let Some(seen) = self.limiter.take() {
                // Admitted before our wake-up came: dropping the wait withdraws the
                // refusal it was for.
                self.waiting = None;
                break seen;
            }
            if self.waiting.is_some() {
                return Poll::Pending;
            }
            // Enable before marking, so a release between our refusal and our poll
            // still wakes us.
            let mut n = Box::pin(Arc::clone(self.limiter.signal()).notified_owned());
            n.as_mut().enable();
            if let Some(seen) = self.limiter.acquire_or_mark() {
                break seen;
            }
            self.waiting = Some(Waiting {
                notified: Some(n),
                limiter: Arc::clone(&self.limiter),
            });
        };
        self.permit = Some(Permit::new(Arc::clone(&self.limiter), seen));
        Poll::Ready(())
    }
}

impl<S: Clone, C: Clone> Clone for Aimd<S, C> {
    /// The clone shares the limiter but not a slot reserved by `poll_ready`.
    fn clone(&self) -> Self {
        Self::from_parts(
            self.inner.clone(),
            Arc::clone(&self.limiter),
            self.mode,
            self.classifier.clone(),
        )
    }
}

impl<S, C, Req> Service<Req> for Aimd<S, C>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    C: Classify<S::Response, BoxError> + Clone + Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, C>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if self.permit.is_none() {
            match self.mode {
                Mode::Wait => ready!(self.poll_slot(cx)),
                Mode::Shed if self.shed => return Poll::Ready(Ok(())),
                Mode::Shed => match self.limiter.acquire_or_mark() {
                    Some(seen) => self.permit = Some(Permit::new(Arc::clone(&self.limiter), seen)),
                    None => {
                        // Over the limit: the call answers `Paced`, and nothing below
                        // is asked (the cheapest gate first).
                        self.shed = true;
                        return Poll::Ready(Ok(()));
                    }
                },
            }
        }
        let ready = self.inner.poll_ready(cx).map_err(Into::into);
        if matches!(ready, Poll::Ready(Err(_))) {
            // Not admitted below: the slot goes back at once, waking a waiter only
            // for a refusal counted while it was held.
            if let Some(p) = self.permit.take() {
                p.unused();
            }
        }
        ready
    }

    fn call(&mut self, req: Req) -> Self::Future {
        if std::mem::take(&mut self.shed) {
            return ResponseFuture::paced(self.paced());
        }
        let permit = match self.permit.take() {
            Some(p) => p,
            None => match self.limiter.acquire_or_mark() {
                Some(seen) => Permit::new(Arc::clone(&self.limiter), seen),
                None => return ResponseFuture::paced(self.paced()),
            },
        };
        ResponseFuture::called(self.inner.call(req), permit, self.classifier.clone())
    }
}

impl<S: fmt::Debug, C> fmt::Debug for Aimd<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Aimd")
            .field("inner", &self.inner)
            .field("mode", &self.mode)
            .field("handle", &self.handle())
            .field("reserved", &self.permit.is_some())
            .finish_non_exhaustive()
    }
}
