//! [`HealthP2c`]: the balancer service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use pgw_core::{BoxError, CarriesHistory, Classify, OkIsSuccess};
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};
use tower_service::Service;

use crate::future::{Plan, ResponseFuture};
use crate::order;
use crate::sources::{Snapshot, Sources};
use crate::{BalanceConfig, ConfigError, HEALTH_CLASSES};

/// A health-aware balancer over a set of per-source services.
///
/// Per call it orders the sources ([`Policy`](crate::Policy)), skips those that answer
/// *not admitted* ([`pgw_core::NotAdmitted`]: no attempt, nothing recorded) and
/// dispatches to the first that admits. Each dispatched attempt's outcome (from the
/// classifier `C`) feeds the source's health EWMA and is recorded, with the source, in
/// the request's [`pgw_core::CallHistory`] when it carries one. When no source admits:
/// all breaker-open fails at once with the earliest [`pgw_core::CircuitOpen`];
/// otherwise the call waits for a release signal or the earliest `retry_after`, at
/// most `max_wait` (then [`NoneAdmitted`](crate::NoneAdmitted)).
///
/// Always ready: readiness is asked of the chosen source's service inside the response
/// future. Each source keeps one instance that dispatches use in turn (readiness and
/// call under a lock, no copy of the service); a call that finds it busy, or not
/// ready, goes on with a clone of its own, as a `Clone` service is meant to be used.
/// Requests are cloned once per dispatch (they are cheap in the pgw stack: `Arc`
/// inside).
pub struct HealthP2c<S, C = OkIsSuccess, K = SingleClass> {
    sources: Sources<S>,
    snapshot: Arc<Snapshot<S>>,
    version: u64,
    config: BalanceConfig,
    classifier: C,
    class_of: K,
    rng: SmallRng,
    seed: u64,
}

/// What the balancer knows of a request before dispatching it: its health class (see
/// [`HealthP2c::with_class`]) and, optionally, its size.
///
/// Implemented by [`SingleClass`] (every request in class 0, no size, the default) and
/// by any `Fn(&Req) -> usize` (no size).
pub trait ClassOf<Req> {
    /// The request's class, `0..HEALTH_CLASSES` (larger values share the last class).
    fn class_of(&self, req: &Req) -> usize;

    /// The request's size, in any unit that grows with what a source may refuse as too
    /// large (for chat calls: the estimated tokens, prompt and completion budget);
    /// `None` (the default) when unknown. A source that refused a request as too large
    /// for it ([`pgw_core::exceeds_source`]: a context window) is then not offered
    /// requests of that size or more first, for
    /// [`OVERSIZE_MEMORY`](crate::OVERSIZE_MEMORY): each process pays one refusal per
    /// source, not one per large call.
    fn size_of(&self, _req: &Req) -> Option<u64> {
        None
    }
}

/// Every request in class 0: one health EWMA per source.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleClass;

impl<Req> ClassOf<Req> for SingleClass {
    fn class_of(&self, _req: &Req) -> usize {
        0
    }
}

impl<Req, F: Fn(&Req) -> usize> ClassOf<Req> for F {
    fn class_of(&self, req: &Req) -> usize {
        self(req)
    }
}

impl<S> HealthP2c<S> {
    /// A balancer over `sources`, classifying with [`OkIsSuccess`], seeded from the OS.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the bad field.
    pub fn new(sources: Sources<S>, config: BalanceConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self::from_valid(sources, config))
    }

    pub(crate) fn from_valid(sources: Sources<S>, config: BalanceConfig) -> Self {
        let (snapshot, version) = sources.snapshot();
        let mut rng = SmallRng::from_os_rng();
        let seed = rng.next_u64();
        Self {
            sources,
            snapshot,
            version,
            config,
            classifier: OkIsSuccess,
            class_of: SingleClass,
            rng,
            seed,
        }
    }
}

impl<S, C, K> HealthP2c<S, C, K> {
    /// Classifies outcomes with `classifier` (e.g. `pgw_core::OpenAiClassifier`).
    #[must_use]
    pub fn with_classifier<C2>(self, classifier: C2) -> HealthP2c<S, C2, K> {
        HealthP2c {
            sources: self.sources,
            snapshot: self.snapshot,
            version: self.version,
            config: self.config,
            classifier,
            class_of: self.class_of,
            rng: self.rng,
            seed: self.seed,
        }
    }

    /// Keeps a separate health EWMA per request class (instead of one per source):
    /// `class_of` maps a request to `0..HEALTH_CLASSES`. Use it when a source can serve one
    /// shape of call and fail another (streamed vs not: a slow stream cut by a
    /// watchdog says nothing about short answers). Ordering, the in-call credible
    /// alternative and the health sample of each attempt use the request's class;
    /// the inflight count stays per source.
    ///
    /// ```
    /// use tower_health_p2c::{BalanceConfig, HealthP2c, Sources};
    /// # type Svc = tower::util::BoxCloneSyncService<(bool, ()), (), pgw_core::BoxError>;
    /// let sources: Sources<Svc> = Sources::new();
    /// // Streamed calls (true) in class 1, the rest in class 0.
    /// let lb = HealthP2c::new(sources, BalanceConfig::default())
    ///     .unwrap()
    ///     .with_class(|req: &(bool, ())| usize::from(req.0));
    /// # let _ = lb;
    /// ```
    #[must_use]
    pub fn with_class<K2>(self, class_of: K2) -> HealthP2c<S, C, K2> {
        HealthP2c {
            sources: self.sources,
            snapshot: self.snapshot,
            version: self.version,
            config: self.config,
            classifier: self.classifier,
            class_of,
            rng: self.rng,
            seed: self.seed,
        }
    }

    /// Makes every random choice reproducible. Clones of this
    /// balancer derive their own generators from `seed` and their clone number.
    #[must_use]
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.rng = SmallRng::seed_from_u64(seed);
        self.seed = seed;
        self
    }

    /// Uses `rng` for the random choices of this instance.
    #[must_use]
    pub fn with_rng(mut self, mut rng: SmallRng) -> Self {
        self.seed = rng.next_u64();
        self.rng = rng;
        self
    }

    /// The source set (insert/remove at runtime, health views for metrics).
    pub const fn sources(&self) -> &Sources<S> {
        &self.sources
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &BalanceConfig {
        &self.config
    }
}

impl<S, C: Clone, K: Clone> Clone for HealthP2c<S, C, K> {
    fn clone(&self) -> Self {
        // Each clone draws its own stream, reproducible from the seed and clone order.
        let n = self.sources.next_clone().wrapping_add(1);
        let seed = self.seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        Self {
            sources: self.sources.clone(),
            snapshot: Arc::clone(&self.snapshot),
            version: self.version,
            config: self.config,
            classifier: self.classifier.clone(),
            class_of: self.class_of.clone(),
            rng: SmallRng::seed_from_u64(seed),
            seed,
        }
    }
}

impl<S, C, K, Req> Service<Req> for HealthP2c<S, C, K>
where
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    C: Classify<S::Response, BoxError> + Clone + Send + 'static,
    S::Response: Send + 'static,
    K: ClassOf<Req>,
    Req: Clone + CarriesHistory + Send + 'static,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S, S::Future, Req, C>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Req) -> Self::Future {
        if self.sources.version() != self.version {
            (self.snapshot, self.version) = self.sources.snapshot();
        }
        let snapshot = Arc::clone(&self.snapshot);
        let policy = self.config.policy;
        let class = self.class_of.class_of(&req).min(HEALTH_CLASSES - 1);
        let size = self.class_of.size_of(&req);
        if let Some(h) = req.call_history() {
            h.set_sources(snapshot.entries.len());
        }
        let plan = if snapshot.entries.is_empty() {
            Plan::Empty
        } else {
            let sources = &self.sources;
            let entries = &snapshot.entries;
            let choices = self.config.choices;
            let first = order::first(policy, choices, entries, class, &mut self.rng, || {
                sources.cursor()
            });
            order::plan(
                policy,
                entries,
                class,
                first,
                req.call_history().filter(|h| !h.is_empty()),
                order::oversized(entries, size).as_deref(),
            )
        };
        ResponseFuture::new(
            req,
            snapshot,
            class,
            size,
            plan,
            self.config,
            self.classifier.clone(),
            self.rng.next_u64(),
        )
    }
}

impl<S, C, K> fmt::Debug for HealthP2c<S, C, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HealthP2c")
            .field("config", &self.config)
            .field("sources", &self.sources)
            .finish_non_exhaustive()
    }
}
