//! The process-wide progress signal of the stall guard.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// When something last succeeded, shared by every call of a stack: one atomic holding
/// the milliseconds since the signal was created.
///
/// The stall guard fails a call only when the call has waited longer than
/// `stall_window` **and** this signal is older than `stall_window`. Every service made
/// by one [`RetryLayer`](crate::RetryLayer) shares its signal; hand the same
/// [`Progress`] to several layers (or record successes from elsewhere, e.g. a fallback
/// chain) to widen what "the process made progress" means.
///
/// The signal starts as if something succeeded when it was created.
///
/// Successes of the layer's own calls are timed only while some call is waiting (has
/// failed or been refused at least once): a success from before a call started waiting
/// can never keep it from stalling (it is older than the window by the time the call
/// has waited a window), so the fast path skips the clock read when nobody waits.
#[derive(Clone, Debug)]
pub struct Progress {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    base: Instant,
    last_ms: AtomicU64,
    /// Calls of the layer currently waiting (the only readers of `last_ms`).
    watchers: AtomicUsize,
}

impl Default for Progress {
    fn default() -> Self {
        Self::new()
    }
}

impl Progress {
    /// A new signal; "now" counts as the last success.
    #[must_use]
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                base: Instant::now(),
                last_ms: AtomicU64::new(0),
                watchers: AtomicUsize::new(0),
            }),
        }
    }

    fn millis(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.inner.base).as_millis()).unwrap_or(u64::MAX)
    }

    /// Records a success now.
    pub fn record_success(&self) {
        self.record_success_at(Instant::now());
    }

    /// Records a success now if some call is waiting (the layer's fast path).
    pub(crate) fn record_success_if_watched(&self) {
        if self.inner.watchers.load(Ordering::SeqCst) > 0 {
            self.record_success();
        }
    }

    /// A call starts waiting: successes must be timed from now on.
    pub(crate) fn watch(&self) {
        self.inner.watchers.fetch_add(1, Ordering::SeqCst);
    }

    /// A waiting call ended.
    pub(crate) fn unwatch(&self) {
        self.inner.watchers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Records a success at `at` (older records never move the signal back).
    pub fn record_success_at(&self, at: Instant) {
        let ms = self.millis(at);
        // A load first: most successes land in a millisecond already recorded, and a
        // plain load keeps the cache line shared between cores.
        if ms > self.inner.last_ms.load(Ordering::Relaxed) {
            self.inner.last_ms.fetch_max(ms, Ordering::Relaxed);
        }
    }

    /// When something last succeeded (millisecond resolution).
    #[must_use]
    pub fn last_success(&self) -> Instant {
        self.inner.base + Duration::from_millis(self.inner.last_ms.load(Ordering::Relaxed))
    }

    /// How long nothing has succeeded, as seen at `now`.
    #[must_use]
    pub fn idle_for(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.last_success())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn tracks_the_latest_success_only() {
        let p = Progress::new();
        let start = Instant::now();
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(p.idle_for(Instant::now()), Duration::from_secs(5));
        p.record_success();
        let clone = p.clone();
        clone.record_success_at(start); // older: ignored
        assert_eq!(p.idle_for(Instant::now()), Duration::ZERO);
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(clone.idle_for(Instant::now()), Duration::from_secs(3));
        assert_eq!(p.last_success(), start + Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn unwatched_successes_are_not_timed() {
        let p = Progress::new();
        tokio::time::advance(Duration::from_secs(5)).await;
        p.record_success_if_watched();
        assert_eq!(p.idle_for(Instant::now()), Duration::from_secs(5));
        p.watch();
        p.record_success_if_watched();
        assert_eq!(p.idle_for(Instant::now()), Duration::ZERO);
        p.unwatch();
    }
}
