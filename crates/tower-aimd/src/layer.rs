//! [`AimdLayer`]: builds [`Aimd`] services that share one source's limiter.

use std::fmt;
use std::sync::Arc;

use pgw_core::{OkIsSuccess, SourceId};
use tokio::sync::Notify;
use tower_layer::Layer;

use crate::limiter::Limiter;
use crate::{Aimd, AimdConfig, AimdHandle, ConfigError};

/// What a service does when the limit is reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// `poll_ready` returns `Pending` until a slot frees, like tower's
    /// `ConcurrencyLimit` (the default, for use alone).
    #[default]
    Wait,
    /// Always ready; a call over the limit answers [`pgw_core::Paced`] at once (not
    /// admitted, not an attempt), so a balancer above can try another source.
    Shed,
}

/// A [`Layer`] adding an adaptive (AIMD) concurrency limit.
///
/// One layer is one source: every service it builds (and their clones) shares the
/// same limit and inflight count, observable through [`handle`](Self::handle).
#[derive(Clone)]
pub struct AimdLayer<C = OkIsSuccess> {
    limiter: Arc<Limiter>,
    config: AimdConfig,
    mode: Mode,
    classifier: C,
}

impl AimdLayer {
    /// A layer with `config`, in [`Mode::Wait`], classifying with [`OkIsSuccess`].
    ///
    /// # Errors
    /// A [`ConfigError`] naming the bad field.
    pub fn new(config: AimdConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            limiter: Arc::new(Limiter::new(&config, None, Arc::new(Notify::new()), Vec::new())),
            config,
            mode: Mode::Wait,
            classifier: OkIsSuccess,
        })
    }
}

impl Default for AimdLayer {
    /// The defaults: initial limit 8, floor 1, cut by half on pushback.
    fn default() -> Self {
        Self::new(AimdConfig::default()).expect("the default config is valid")
    }
}

impl<C> AimdLayer<C> {
    fn rebuild(mut self, source: Option<SourceId>, signal: Arc<Notify>, also: Vec<Arc<Notify>>) -> Self {
        self.limiter = Arc::new(Limiter::new(&self.config, source, signal, also));
        self
    }

    /// Names the source (put into [`pgw_core::Paced`] errors). Starts a fresh limiter:
    /// call it before building services.
    #[must_use]
    pub fn with_source(self, source: SourceId) -> Self {
        let signal = Arc::clone(self.limiter.signal());
        let also = self.limiter.also().to_vec();
        self.rebuild(Some(source), signal, also)
    }

    /// Uses `signal` as the release signal, e.g. the wake-up signal of a balancer
    /// above (`tower_health_p2c`). Starts a fresh limiter: call it before building services.
    #[must_use]
    pub fn with_release_signal(self, signal: Arc<Notify>) -> Self {
        let source = self.limiter.source().cloned();
        let also = self.limiter.also().to_vec();
        self.rebuild(source, signal, also)
    }

    /// Adds `signal` as a further release signal: a freed slot wakes one waiter of the
    /// release signal and one of each added signal. For a source under several
    /// balancers (the same upstream model in two model groups), each balancer's waiters
    /// hear of its slots; a waiter that finds the slot taken waits again. Starts a fresh
    /// limiter: call it before building services.
    #[must_use]
    pub fn also_release_signal(self, signal: Arc<Notify>) -> Self {
        let source = self.limiter.source().cloned();
        let primary = Arc::clone(self.limiter.signal());
        let mut also = self.limiter.also().to_vec();
        if !Arc::ptr_eq(&primary, &signal) && !also.iter().any(|s| Arc::ptr_eq(s, &signal)) {
            also.push(signal);
        }
        self.rebuild(source, primary, also)
    }

    /// Sets the [`Mode`].
    #[must_use]
    pub const fn with_mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// Shorthand for `with_mode(Mode::Shed)`: the gate mode under a balancer.
    #[must_use]
    pub const fn shedding(self) -> Self {
        self.with_mode(Mode::Shed)
    }

    /// Classifies outcomes with `classifier` (e.g. `pgw_core::OpenAiClassifier`).
    #[must_use]
    pub fn with_classifier<C2>(self, classifier: C2) -> AimdLayer<C2> {
        AimdLayer {
            limiter: self.limiter,
            config: self.config,
            mode: self.mode,
            classifier,
        }
    }

    /// A read-only view of the limit and inflight count.
    #[must_use]
    pub fn handle(&self) -> AimdHandle {
        AimdHandle {
            limiter: Arc::clone(&self.limiter),
        }
    }
}

impl<S, C: Clone> Layer<S> for AimdLayer<C> {
    type Service = Aimd<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        Aimd::from_parts(
            inner,
            Arc::clone(&self.limiter),
            self.mode,
            self.classifier.clone(),
        )
    }
}

impl<C> fmt::Debug for AimdLayer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AimdLayer")
            .field("config", &self.config)
            .field("mode", &self.mode)
            .field("handle", &self.handle())
            .finish_non_exhaustive()
    }
}
