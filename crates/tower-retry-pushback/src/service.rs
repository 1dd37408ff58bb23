//! [`Retry`]: the service that runs the retry loop around an inner service.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use pgw_core::sync::lock;
use pgw_core::{BoxError, CallHistory, CarriesHistory, Classify, Hold, OkIsSuccess, Recording};
use rand::Rng;
use rand::rngs::SmallRng;
use tokio::time::Instant;
use tower_service::Service;

use crate::budget::{AdaptiveThrottle, RetryBudget};
use crate::config::RetryConfig;
use crate::error::{ConfigError, Reason, RetryError};
use crate::future::{CallStart, ResponseFuture};
use crate::layer::{HistoryMode, RetryLayer};
use crate::progress::Progress;
use crate::resend::{ByClone, Resend};

/// What every call of one layer shares (and what the layer is made of).
#[derive(Clone)]
pub(crate) struct Shared<C, R> {
    pub(crate) config: RetryConfig,
    pub(crate) classify: C,
    pub(crate) resend: R,
    pub(crate) hold: Option<Arc<dyn Hold>>,
    pub(crate) history_mode: HistoryMode,
    pub(crate) progress: Progress,
    pub(crate) budget: Option<RetryBudget>,
    pub(crate) throttle: Option<AdaptiveThrottle>,
    pub(crate) rng: Arc<Mutex<SmallRng>>,
    pub(crate) counters: Arc<Counters>,
}

impl<C, R> Shared<C, R> {
    /// The same shared state with the classifier and resend hook replaced by `f`.
    pub(crate) fn map<C2, R2>(self, f: impl FnOnce(C, R) -> (C2, R2)) -> Shared<C2, R2> {
        let (classify, resend) = f(self.classify, self.resend);
        Shared {
            config: self.config,
            classify,
            resend,
            hold: self.hold,
            history_mode: self.history_mode,
            progress: self.progress,
            budget: self.budget,
            throttle: self.throttle,
            rng: self.rng,
            counters: self.counters,
        }
    }

    /// The `n`-th backoff: full jitter with a floor, uniform in
    /// `[min(base / 2, ceiling), ceiling]` where `ceiling = min(max, base * 2^n)`.
    pub(crate) fn backoff(&self, n: u32) -> Duration {
        let ceiling = self
            .config
            .max_backoff
            .min(self.config.base_backoff.saturating_mul(1 << n.min(31)));
        let ns = u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX);
        // The floor: half the base (250 ms by default), so no two attempts of one call
        // go back to back (full jitter alone drew gaps of a few milliseconds).
        let floor = u64::try_from((self.config.base_backoff / 2).as_nanos())
            .unwrap_or(u64::MAX)
            .min(ns);
        Duration::from_nanos(self.rng().random_range(floor..=ns))
    }

    /// A uniform draw in `[0, 1)`.
    pub(crate) fn uniform(&self) -> f64 {
        self.rng().random()
    }

    fn rng(&self) -> std::sync::MutexGuard<'_, SmallRng> {
        // Held for one draw; a poisoned RNG is still a valid RNG.
        lock(&self.rng)
    }

    /// Adaptive throttling: counts the attempt and decides whether it may go.
    pub(crate) fn throttle_admits(&self) -> bool {
        match &self.throttle {
            None => true,
            Some(t) => t.admit(Instant::now(), self.uniform()),
        }
    }
}

/// Live counters of one layer, for tests and metrics.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) retrying: AtomicUsize,
    pub(crate) waiting: AtomicUsize,
}

impl Counters {
    pub(crate) fn snapshot(&self) -> RetryStats {
        RetryStats {
            retrying: self.retrying.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
        }
    }
}

/// A snapshot of a layer's live counters. Both return to zero when every call has
/// ended, however it ended (dropped futures included). Calls on the fast path (a
/// first attempt that succeeds) touch neither.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RetryStats {
    /// Calls past a failed or refused first attempt and not finished yet.
    pub retrying: usize,
    /// Calls sleeping through a backoff, a `Retry-After` or a hold.
    pub waiting: usize,
}

/// What the calls of one [`Retry`] (and its clones) share: the layer's state, and
/// the service their attempts after the first go to.
pub(crate) struct Core<S, C, R> {
    shared: Shared<C, R>,
    /// A clone of the wrapped service, taken when it was wrapped (or changed through
    /// [`Retry::get_mut`]). A call's first attempt goes to the service `poll_ready`
    /// made ready, without a clone; a call that needs another attempt clones this
    /// once and asks the clone to be ready before each later attempt. So a call that
    /// succeeds at once clones nothing.
    proto: Mutex<S>,
}

impl<S: Clone, C, R> Core<S, C, R> {
    /// The service for a call's attempts after the first (not ready yet).
    pub(crate) fn later_attempts(&self) -> S {
        lock(&self.proto).clone()
    }
}

impl<S, C, R> std::ops::Deref for Core<S, C, R> {
    type Target = Shared<C, R>;

    fn deref(&self) -> &Shared<C, R> {
        &self.shared
    }
}

/// Runs the retry loop around `S`: see the [crate docs](crate).
pub struct Retry<S, C = OkIsSuccess, R = ByClone> {
    inner: S,
    core: Arc<Core<S, C, R>>,
    /// Whether `inner` may have changed through [`get_mut`](Self::get_mut) since the
    /// prototype was taken: the next `call` or `clone` takes it again (a clone, from
    /// `&self`, then clears this).
    changed: AtomicBool,
    /// The adaptive throttle's verdict on the next call, drawn by `poll_ready` before
    /// it asks `inner` (so a refused call leaves nothing `inner` reserved for it held
    /// until the next call), taken by `call`. `None`: not drawn yet (no throttle, or
    /// `call` without `poll_ready`: drawn there).
    throttle_verdict: Option<bool>,
}

impl<S: Clone> Retry<S> {
    /// Wraps `inner` with `config` and the defaults of [`RetryLayer::new`].
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first invalid field.
    pub fn new(inner: S, config: RetryConfig) -> Result<Self, ConfigError> {
        Ok(tower_layer::Layer::layer(&RetryLayer::new(config)?, inner))
    }
}

impl<S: Clone, C, R> Retry<S, C, R> {
    pub(crate) fn from_shared(inner: S, shared: Shared<C, R>) -> Self {
        let proto = Mutex::new(inner.clone());
        Self {
            inner,
            core: Arc::new(Core { shared, proto }),
            changed: AtomicBool::new(false),
            throttle_verdict: None,
        }
    }
}

impl<S: Clone, C, R> Retry<S, C, R> {
    /// The prototype of later attempts becomes a clone of `inner` as it is now.
    fn retake_prototype(&self) {
        *lock(&self.core.proto) = self.inner.clone();
    }
}

impl<S, C, R> Retry<S, C, R> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably. A change made through it reaches the attempts
    /// after the first of the calls made from then on (through this service or its
    /// clones).
    pub fn get_mut(&mut self) -> &mut S {
        *self.changed.get_mut() = true;
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }

    /// Calls retrying and waiting, over every service of this service's layer.
    #[must_use]
    pub fn stats(&self) -> RetryStats {
        self.core.counters.snapshot()
    }

    /// The progress signal this service records successes into.
    #[must_use]
    pub fn progress_signal(&self) -> &Progress {
        &self.core.progress
    }
}

impl<S: Clone, C, R> Clone for Retry<S, C, R> {
    fn clone(&self) -> Self {
        // A change made through `get_mut` reaches the prototype here too: a service
        // kept as a template and cloned for each call never calls itself.
        if self.changed.swap(false, Ordering::Relaxed) {
            self.retake_prototype();
        }
        Self {
            inner: self.inner.clone(),
            core: Arc::clone(&self.core),
            changed: AtomicBool::new(false),
            throttle_verdict: None,
        }
    }
}

impl<S: fmt::Debug, C, R> fmt::Debug for Retry<S, C, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retry")
            .field("inner", &self.inner)
            .field("config", &self.core.config)
            .finish_non_exhaustive()
    }
}

impl<S, Req, C, R> Service<Req> for Retry<S, C, R>
where
    S: Service<Req> + Clone,
    S::Error: Into<BoxError>,
    Req: CarriesHistory + 'static,
    C: Classify<S::Response, BoxError>,
    R: Resend<Req>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S, Req, C, R>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The throttle first, once per call: a call it refuses needs nothing from
        // `inner`, and a readiness `inner` reserved (a concurrency permit, a
        // balancer's pick) would stay reserved until the next call. A verdict drawn
        // here and never used (the service dropped before `call`) counts one attempt
        // in the throttle's window that was not made.
        if self.core.throttle.is_some() {
            let admits = *self
                .throttle_verdict
                .get_or_insert_with(|| self.core.throttle_admits());
            if !admits {
                return Poll::Ready(Ok(()));
            }
        }
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Req) -> Self::Future {
        if std::mem::take(self.changed.get_mut()) {
            self.retake_prototype();
        }
        let shared = Arc::clone(&self.core);
        let deadline_at = match (shared.config.max_call_duration, shared.resend.deadline(&req)) {
            (None, None) => None,
            (max, own) => {
                // A duration too large for the clock (e.g. `Duration::MAX` for "no
                // limit") is no deadline, not a panic.
                let from_config = max.and_then(|d| Instant::now().checked_add(d));
                from_config.into_iter().chain(own).min()
            }
        };
        let mut own_history = req.call_history().is_none();
        let mut recording = None;
        if own_history {
            if let Some(outer) = Recording::adopt::<Req>() {
                // Sent inside the first attempt of an outer call that has no history
                // yet (`HistoryMode::OnDemand`): that call's history, as if the request
                // had carried it.
                req.set_call_history(outer);
                own_history = false;
            } else {
                match shared.history_mode {
                    HistoryMode::EveryAttempt => req.set_call_history(CallHistory::new()),
                    // The balancer below reads the deadline from the history.
                    HistoryMode::OnDemand if deadline_at.is_some() => {
                        req.set_call_history(CallHistory::new());
                    }
                    // The first attempt goes without one (no allocation, no counted
                    // reference in each copy of the request); the service below makes
                    // it in the recording's scope if it has something to write.
                    HistoryMode::OnDemand => recording = Some(Recording::of::<Req>()),
                    HistoryMode::FromFirstRetry => {}
                }
            }
        }
        let known_len = req.call_history().map_or(0, CallHistory::len);
        if let (Some(at), Some(history)) = (deadline_at, req.call_history()) {
            // The balancer below then waits for an admission no longer than the call
            // may: a wait that must end past the deadline fails at once (R3).
            history.set_deadline(at);
        }
        if let Some(budget) = &shared.budget {
            budget.deposit(Instant::now());
        }
        let next = shared.resend.resend(&req);
        // Keep our own handle only when no copy of the request will carry the history.
        let history = if next.is_none() {
            req.call_history().cloned()
        } else {
            None
        };
        let mut start = CallStart {
            next,
            history,
            own_history,
            known_len,
            deadline_at,
            recording,
        };
        let admits = self
            .throttle_verdict
            .take()
            .unwrap_or_else(|| shared.throttle_admits());
        if !admits {
            let attempts = req.call_history().map(CallHistory::attempts).unwrap_or_default();
            let err = RetryError::new(Reason::Throttled, attempts, None);
            return ResponseFuture::failed(shared, start, Box::new(err));
        }
        let attempt = {
            let _scope = start.recording.as_mut().map(Recording::enter);
            // The first attempt goes to the service `poll_ready` made ready; later
            // ones to a clone of the prototype, asked to be ready first (see `Core`).
            self.inner.call(req)
        };
        ResponseFuture::new(attempt, shared, start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn backoff_is_full_jitter_under_the_ceiling() {
        let shared = RetryLayer::default().rng_seed(5).shared;
        for n in [0u32, 1, 3, 6, 40, u32::MAX] {
            let ceiling =
                Duration::from_secs(20).min(Duration::from_millis(500).saturating_mul(1 << n.min(31)));
            let draws: Vec<Duration> = (0..200).map(|_| shared.backoff(n)).collect();
            assert!(draws.iter().all(|d| *d <= ceiling), "n={n}");
            assert!(
                draws.iter().all(|d| *d >= Duration::from_millis(250)),
                "n={n}: never under the floor"
            );
            // Spread over the whole range, not stuck at one end.
            assert!(
                draws
                    .iter()
                    .any(|d| *d < ceiling / 4 + Duration::from_millis(250)),
                "n={n}"
            );
            assert!(draws.iter().any(|d| *d > ceiling * 3 / 4), "n={n}");
        }
    }
}
