//! [`RetryLayer`]: builds [`Retry`] services that share one progress signal, budget,
//! throttle and RNG.

use std::fmt;
use std::sync::{Arc, Mutex};

use pgw_core::{Hold, OkIsSuccess};
use rand::SeedableRng;
use rand::rngs::SmallRng;
use tower_layer::Layer;

use crate::budget::{AdaptiveThrottle, RetryBudget};
use crate::config::RetryConfig;
use crate::error::ConfigError;
use crate::progress::Progress;
use crate::resend::ByClone;
use crate::service::{Retry, RetryStats, Shared};

/// When the layer attaches a [`CallHistory`](pgw_core::CallHistory) to a request that
/// carries none (a request that already carries one always keeps it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HistoryMode {
    /// Before the first attempt (default): a balancer below records the source of every
    /// attempt, so a 429 on the first attempt holds its source and in-call
    /// deprioritization sees every failure. Costs one small allocation per call.
    #[default]
    EveryAttempt,
    /// From the first retry on: the fast path (a first attempt that succeeds) allocates
    /// nothing; the first attempt is recorded without its source, so a 429 on it is slept
    /// through rather than held. For services with no balancer below.
    FromFirstRetry,
    /// When something is written into it: the first attempt is sent without one,
    /// inside a [`Recording`](pgw_core::Recording) scope, and a service below that
    /// records through it (tower-health-p2c's balancer does) makes the history when an
    /// attempt does not succeed; this layer makes it at the first failure otherwise. As
    /// [`EveryAttempt`](Self::EveryAttempt) for such services (the source of every
    /// failed attempt is recorded), with no allocation and no counted reference in the
    /// request's copies when the first attempt succeeds. A request with a deadline
    /// gets its history before the first attempt (the balancer reads the deadline
    /// there). A service below that reads or writes the request's history directly
    /// sees none on the first attempt: use `EveryAttempt` for those.
    OnDemand,
}

/// Wraps a service in the retry loop. Every service it makes shares its
/// [`Progress`] signal, its retry budget and throttle (when configured), its RNG and
/// its counters.
///
/// `C` is the classifier (`pgw_core::Classify<S::Response, BoxError>`, default
/// [`OkIsSuccess`]) and `R` the clone hook ([`Resend`](crate::Resend), default
/// [`ByClone`]).
pub struct RetryLayer<C = OkIsSuccess, R = ByClone> {
    /// Exactly what every service built by this layer shares (one `Arc` per service).
    pub(crate) shared: Shared<C, R>,
}

impl<C: Clone, R: Clone> Clone for RetryLayer<C, R> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl Default for RetryLayer {
    fn default() -> Self {
        Self::from_valid(RetryConfig::default())
    }
}

impl RetryLayer {
    /// A layer with `config`, the [`OkIsSuccess`] classifier, the [`ByClone`] hook, no
    /// hold hook (the layer sleeps through pushback itself) and an RNG seeded from the
    /// operating system.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first invalid field.
    pub fn new(config: RetryConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self::from_valid(config))
    }

    fn from_valid(config: RetryConfig) -> Self {
        let shared = Shared {
            budget: config.retry_budget.as_ref().map(RetryBudget::new),
            throttle: config.throttle.as_ref().map(AdaptiveThrottle::new),
            config,
            classify: OkIsSuccess,
            resend: ByClone,
            hold: None,
            history_mode: HistoryMode::default(),
            progress: Progress::new(),
            rng: Arc::new(Mutex::new(SmallRng::from_os_rng())),
            counters: Arc::default(),
        };
        Self { shared }
    }
}

impl<C, R> RetryLayer<C, R> {
    /// Uses `classify` to turn each attempt's result into an outcome.
    #[must_use]
    pub fn classifier<C2>(self, classify: C2) -> RetryLayer<C2, R> {
        RetryLayer {
            shared: self.shared.map(|_, resend| (classify, resend)),
        }
    }

    /// Uses `resend` to copy requests for the next attempt (and read their deadline).
    #[must_use]
    pub fn resend<R2>(self, resend: R2) -> RetryLayer<C, R2> {
        RetryLayer {
            shared: self.shared.map(|classify, _| (classify, resend)),
        }
    }

    /// Holds the source of a 429 through `hold` and re-dispatches at once: the
    /// gates below (the limiter's holds) keep the source not admitted, so the balancer
    /// moves on to another source, or answers `QuotaExceeded` when none is admitted and
    /// the layer waits for it. The hook holds the source's account too when it knows it
    /// (tower-ratelimit-redis does, from its account configuration).
    ///
    /// Without a hold hook, or when the service below did not record a source, the layer
    /// sleeps `max(Retry-After, backoff)` itself before the next attempt; so it does if
    /// the hold fails (logged as a warning), and with a hook that enforces nothing
    /// ([`Hold::enforces`] `false`: `pgw_core::NoHold`), which is no hook.
    #[must_use]
    pub fn hold(mut self, hold: Arc<dyn Hold>) -> Self {
        self.shared.hold = hold.enforces().then_some(hold);
        self
    }

    /// When to attach a [`CallHistory`](pgw_core::CallHistory) to a request that
    /// carries none (default [`HistoryMode::EveryAttempt`]).
    #[must_use]
    pub const fn history_mode(mut self, mode: HistoryMode) -> Self {
        self.shared.history_mode = mode;
        self
    }

    /// Shares `progress` (the stall guard's signal) instead of this layer's own.
    #[must_use]
    pub fn progress(mut self, progress: Progress) -> Self {
        self.shared.progress = progress;
        self
    }

    /// Seeds the RNG (backoff jitter, throttling draws) for reproducible runs.
    #[must_use]
    pub fn rng_seed(mut self, seed: u64) -> Self {
        self.shared.rng = Arc::new(Mutex::new(SmallRng::seed_from_u64(seed)));
        self
    }

    /// The configuration.
    #[must_use]
    pub const fn config(&self) -> &RetryConfig {
        &self.shared.config
    }

    /// The progress signal shared by this layer's services.
    #[must_use]
    pub const fn progress_signal(&self) -> &Progress {
        &self.shared.progress
    }

    /// The shared retry budget, when configured.
    #[must_use]
    pub const fn retry_budget(&self) -> Option<&RetryBudget> {
        self.shared.budget.as_ref()
    }

    /// The adaptive throttle, when configured.
    #[must_use]
    pub const fn throttle(&self) -> Option<&AdaptiveThrottle> {
        self.shared.throttle.as_ref()
    }

    /// Calls retrying and calls waiting, over every service of this layer.
    #[must_use]
    pub fn stats(&self) -> RetryStats {
        self.shared.counters.snapshot()
    }
}

impl<S: Clone, C: Clone, R: Clone> Layer<S> for RetryLayer<C, R> {
    type Service = Retry<S, C, R>;

    fn layer(&self, inner: S) -> Self::Service {
        Retry::from_shared(inner, self.shared.clone())
    }
}

impl<C, R> fmt::Debug for RetryLayer<C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("config", &self.shared.config)
            .field("hold", &self.shared.hold.is_some())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}
