//! The [`BreakerLayer`].

use std::fmt;
use std::sync::Arc;

use pgw_core::{OkIsSuccess, SourceId};
use tower_layer::Layer;

use crate::backend::memory::{MemoryBackend, MemoryGate};
use crate::backend::{Backend, Gate};
use crate::config::BreakerConfig;
use crate::service::{Breaker, BreakerHandle, Mode, Shared};

/// Wraps a source's service in a [`Breaker`].
///
/// Every service this layer builds shares one gate (one source's state), so the
/// layer's [`handle`](BreakerLayer::handle) sees them all.
pub struct BreakerLayer<G: Gate = MemoryGate, C = OkIsSuccess> {
    /// The gate, the source and the classifier, shared by every service built.
    shared: Arc<Shared<G, C>>,
    mode: Mode,
}

impl<G: Gate, C> Clone for BreakerLayer<G, C> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            mode: self.mode,
        }
    }
}

impl<G: Gate + fmt::Debug, C: fmt::Debug> fmt::Debug for BreakerLayer<G, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BreakerLayer")
            .field("gate", &self.shared.gate)
            .field("source", &self.shared.source)
            .field("classifier", &self.shared.classifier)
            .field("mode", &self.mode)
            .finish()
    }
}

impl BreakerLayer {
    /// A shedding breaker for `source` with its own in-memory state.
    pub fn memory(source: impl Into<SourceId>, config: &BreakerConfig) -> Self {
        Self::new(&MemoryBackend::new(), source, config)
    }
}

impl<G: Gate> BreakerLayer<G> {
    /// A shedding breaker for `source` on `backend`, classifying with [`OkIsSuccess`].
    pub fn new<B: Backend<Gate = G>>(
        backend: &B,
        source: impl Into<SourceId>,
        config: &BreakerConfig,
    ) -> Self {
        let source = source.into();
        Self {
            shared: Arc::new(Shared {
                gate: backend.gate(&source, config),
                source,
                classifier: OkIsSuccess,
            }),
            mode: Mode::Shed,
        }
    }
}

impl<G: Gate, C> BreakerLayer<G, C> {
    /// Uses `classifier` to turn results into outcomes (it sees the inner error boxed).
    pub fn with_classifier<C2>(self, classifier: C2) -> BreakerLayer<G, C2> {
        let (gate, source) = match Arc::try_unwrap(self.shared) {
            Ok(s) => (s.gate, s.source),
            Err(shared) => (shared.gate.clone(), shared.source.clone()),
        };
        BreakerLayer {
            shared: Arc::new(Shared {
                gate,
                source,
                classifier,
            }),
            mode: self.mode,
        }
    }

    /// Waits instead of shedding: `poll_ready` is `Pending` until the breaker admits.
    #[must_use]
    pub const fn waiting(mut self) -> Self {
        self.mode = Mode::Wait;
        self
    }

    /// Sets the [`Mode`].
    #[must_use]
    pub const fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// A handle on the source's breaker state.
    #[must_use]
    pub fn handle(&self) -> BreakerHandle {
        BreakerHandle::new(self.shared.source.clone(), self.shared.gate.clone())
    }

    /// The source this layer guards.
    #[must_use]
    pub fn source(&self) -> &SourceId {
        &self.shared.source
    }

    /// The source's gate (for direct admission and recording).
    #[must_use]
    pub fn gate(&self) -> &G {
        &self.shared.gate
    }
}

impl<S, G: Gate, C> Layer<S> for BreakerLayer<G, C> {
    type Service = Breaker<S, G, C>;

    fn layer(&self, inner: S) -> Self::Service {
        Breaker::from_shared(inner, Arc::clone(&self.shared), self.mode)
    }
}
