//! The [`Breaker`] service.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use pgw_core::{BoxError, BreakerVerdict, CircuitOpen, Classify, OkIsSuccess, SourceId};
use tokio::sync::futures::OwnedNotified;
use tokio::time::Sleep;
use tower_service::Service;

use crate::backend::memory::MemoryGate;
use crate::backend::{Admission, BoxFuture, Gate};
use crate::future::ResponseFuture;
use crate::state::{BreakerView, Ticket};

/// What an open breaker does to a caller.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// Always ready; a refused call fails at once with [`CircuitOpen`] from the response
    /// future, without touching the inner service (like tower's `LoadShed`). The mode for
    /// a breaker under a balancer, which tries the next source.
    #[default]
    Shed,
    /// `poll_ready` is `Pending` until the breaker admits, woken by a timer at
    /// `open_until` (like tower's `ConcurrencyLimit`). The mode for a breaker used alone.
    Wait,
}

/// An admission held by a call: ends the probe lease on every path.
///
/// Dropped without [`Lease::finish`] (the caller dropped the future, or a panic
/// unwound it), a probe is released with no verdict so the next admission may probe
/// at once.
pub(crate) struct Lease<G: Gate> {
    gate: G,
    ticket: Ticket,
    live: bool,
}

impl<G: Gate> Lease<G> {
    fn new(gate: G, ticket: Ticket) -> Self {
        Self {
            gate,
            ticket,
            live: true,
        }
    }

    /// Ends the admission with `verdict`; `None` when there is nothing to record (a
    /// closed-state call whose outcome the breaker ignores costs no round trip).
    pub(crate) fn finish(mut self, verdict: BreakerVerdict) -> Option<G::Record> {
        self.live = false;
        if !self.ticket.is_probe() && verdict == BreakerVerdict::Ignore {
            return None;
        }
        Some(self.gate.record(self.ticket, verdict))
    }
}

impl<G: Gate> Drop for Lease<G> {
    fn drop(&mut self) {
        if self.live && self.ticket.is_probe() {
            // Started at once by the gate; the returned future only waits.
            drop(self.gate.record(self.ticket, BreakerVerdict::Ignore));
        }
    }
}

enum Readiness<G: Gate> {
    Idle,
    /// Asking; in `Mode::Wait` with the gate's signal armed before the question, so a
    /// probe ending while it is asked is not missed.
    Admitting(G::Admit, Option<Pin<Box<OwnedNotified>>>),
    /// Refused in `Mode::Wait`: until the refusal's `retry_after`, or the gate's
    /// signal that a probe ended ([`Gate::changes`]), whichever comes first.
    Waiting(Pin<Box<Sleep>>, Option<Pin<Box<OwnedNotified>>>),
    Admitted(Lease<G>),
    Refused(BoxError),
}

/// A cheap handle on one breaker's state, for operators and metrics.
#[derive(Clone)]
pub struct BreakerHandle {
    source: SourceId,
    view: Arc<dyn Fn() -> BoxFuture<Result<BreakerView, BoxError>> + Send + Sync>,
}

impl fmt::Debug for BreakerHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BreakerHandle")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl BreakerHandle {
    pub(crate) fn new<G: Gate>(source: SourceId, gate: G) -> Self {
        Self {
            source,
            view: Arc::new(move || gate.view()),
        }
    }

    /// The source this breaker guards.
    #[must_use]
    pub const fn source(&self) -> &SourceId {
        &self.source
    }

    /// A snapshot of the state: state, epoch, time to `open_until`, streak, counters.
    ///
    /// # Errors
    /// The backend could not be read ([`pgw_core::BackendUnavailable`]).
    pub fn view(&self) -> impl Future<Output = Result<BreakerView, BoxError>> + Send + 'static {
        (self.view)()
    }
}

/// What every service of one [`BreakerLayer`](crate::BreakerLayer) shares: one
/// reference count per clone (a balancer clones a source's service for every attempt).
pub(crate) struct Shared<G, C> {
    pub(crate) gate: G,
    pub(crate) source: SourceId,
    pub(crate) classifier: C,
}

impl<G: fmt::Debug, C: fmt::Debug> fmt::Debug for Shared<G, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("gate", &self.gate)
            .field("source", &self.source)
            .field("classifier", &self.classifier)
            .finish()
    }
}

/// A circuit breaker in front of one source's service `S`.
///
/// Built by [`BreakerLayer`](crate::BreakerLayer). Admission happens in `poll_ready`
/// and is spent by `call`; the response future holds it (with the probe lease, in
/// half-open) and records the classified outcome against its epoch.
pub struct Breaker<S, G: Gate = MemoryGate, C = OkIsSuccess> {
    inner: S,
    shared: Arc<Shared<G, C>>,
    mode: Mode,
    readiness: Readiness<G>,
}

impl<S: fmt::Debug, G: Gate + fmt::Debug, C: fmt::Debug> fmt::Debug for Breaker<S, G, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Breaker")
            .field("inner", &self.inner)
            .field("gate", &self.shared.gate)
            .field("source", &self.shared.source)
            .field("classifier", &self.shared.classifier)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl<S: Clone, G: Gate, C> Clone for Breaker<S, G, C> {
    fn clone(&self) -> Self {
        // Readiness is per service instance: a clone starts unadmitted.
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
            mode: self.mode,
            readiness: Readiness::Idle,
        }
    }
}

impl<S, G: Gate, C> Breaker<S, G, C> {
    /// A breaker for `source` on `gate`, classifying outcomes with `classifier`.
    pub fn new(inner: S, gate: G, source: SourceId, classifier: C, mode: Mode) -> Self {
        Self::from_shared(
            inner,
            Arc::new(Shared {
                gate,
                source,
                classifier,
            }),
            mode,
        )
    }

    pub(crate) const fn from_shared(inner: S, shared: Arc<Shared<G, C>>, mode: Mode) -> Self {
        Self {
            inner,
            shared,
            mode,
            readiness: Readiness::Idle,
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

    /// The inner service (an admission held by this instance is released).
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// Whether the admission this instance holds (once `poll_ready` returned
    /// `Ready(Ok)`) is the half-open probe: the one call whose verdict closes the
    /// breaker or opens it again.
    ///
    /// A caller that must not wait for a probe (a balancer with other sources to try)
    /// can send it off its own path: the response future of `call` records the
    /// verdict and ends the lease wherever it is polled, on a spawned task included,
    /// and dropping it unfinished releases the lease.
    #[must_use]
    pub const fn admitted_probe(&self) -> bool {
        matches!(&self.readiness, Readiness::Admitted(lease) if lease.ticket.is_probe())
    }

    /// A handle on this breaker's state.
    #[must_use]
    pub fn handle(&self) -> BreakerHandle {
        BreakerHandle::new(self.shared.source.clone(), self.shared.gate.clone())
    }
}

impl<S, G, C, Req> Service<Req> for Breaker<S, G, C>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    G: Gate,
    C: Classify<S::Response, BoxError> + Clone + Send + 'static,
    S::Response: 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, G, C>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        loop {
            match &mut self.readiness {
                Readiness::Idle => {
                    let changes = match self.mode {
                        Mode::Wait => self.shared.gate.changes().map(|n| {
                            let mut n = Box::pin(n.notified_owned());
                            n.as_mut().enable();
                            n
                        }),
                        Mode::Shed => None,
                    };
                    self.readiness = Readiness::Admitting(self.shared.gate.admit(), changes);
                }
                Readiness::Admitting(admit, changes) => {
                    self.readiness = match ready!(Pin::new(admit).poll(cx)) {
                        Ok(Admission::Admitted(ticket)) => {
                            Readiness::Admitted(Lease::new(self.shared.gate.clone(), ticket))
                        }
                        Ok(Admission::Refused { retry_after }) => match self.mode {
                            Mode::Shed => Readiness::Refused(Box::new(
                                CircuitOpen::new(retry_after).with_source(self.shared.source.clone()),
                            )),
                            Mode::Wait => {
                                Readiness::Waiting(Box::pin(tokio::time::sleep(retry_after)), changes.take())
                            }
                        },
                        // B12: fail closed, from the future, in both modes.
                        Err(e) => Readiness::Refused(e),
                    };
                }
                Readiness::Waiting(sleep, changes) => {
                    let changed = changes.as_mut().is_some_and(|n| n.as_mut().poll(cx).is_ready());
                    if !changed {
                        ready!(sleep.as_mut().poll(cx));
                    }
                    self.readiness = Readiness::Idle;
                }
                Readiness::Admitted(_) => {
                    let ready = ready!(self.inner.poll_ready(cx)).map_err(Into::into);
                    if ready.is_err() {
                        // The service below cannot take a call: the admission (a
                        // probe's lease) is given back now, not held for as long as
                        // the caller keeps this service.
                        self.readiness = Readiness::Idle;
                    }
                    return Poll::Ready(ready);
                }
                Readiness::Refused(_) => return Poll::Ready(Ok(())),
            }
        }
    }

    fn call(&mut self, req: Req) -> Self::Future {
        match std::mem::replace(&mut self.readiness, Readiness::Idle) {
            Readiness::Admitted(lease) => {
                ResponseFuture::called(self.inner.call(req), lease, self.shared.classifier.clone())
            }
            Readiness::Refused(error) => ResponseFuture::refused(error),
            _ => panic!("Breaker::call without poll_ready returning Ready first"),
        }
    }
}
