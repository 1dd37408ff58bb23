//! The shared retry budget and client-side adaptive throttling.
//!
//! Both count two things over a sliding window kept as ten fixed buckets (a bucket is
//! a tenth of the window, so the window slides in tenths). Both are off by default and
//! only touched when configured; the lock is held for a handful of additions and never
//! across an `.await`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgw_core::sync::lock;
use tokio::time::Instant;

use crate::config::{RetryBudgetConfig, ThrottleConfig};

const BUCKETS: u64 = 10;

#[derive(Clone, Copy, Debug, Default)]
struct Bucket {
    /// Bucket index since the window's base, plus one (0: never used).
    id: u64,
    a: u64,
    b: u64,
}

/// Two counters over a sliding window of ten buckets.
#[derive(Debug)]
struct Window {
    base: Instant,
    width_ns: u64,
    buckets: Mutex<[Bucket; BUCKETS as usize]>,
}

impl Window {
    fn new(window: Duration) -> Self {
        let width_ns = u64::try_from(window.as_nanos() / u128::from(BUCKETS))
            .unwrap_or(u64::MAX)
            .max(1);
        Self {
            base: Instant::now(),
            width_ns,
            buckets: Mutex::new([Bucket::default(); BUCKETS as usize]),
        }
    }

    /// The id of the bucket `now` falls in.
    fn bucket_id(&self, now: Instant) -> u64 {
        let since = u64::try_from(now.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX);
        since / self.width_ns + 1
    }

    /// Runs `f` with the window's totals `(a, b)` at `now`; `f` returns what to add to
    /// the current bucket and a result.
    fn update<T>(&self, now: Instant, f: impl FnOnce(u64, u64) -> (u64, u64, T)) -> T {
        let id = self.bucket_id(now);
        let mut buckets = lock(&self.buckets);
        let (mut a, mut b) = (0, 0);
        for bucket in buckets.iter() {
            if bucket.id != 0 && bucket.id + BUCKETS > id {
                a += bucket.a;
                b += bucket.b;
            }
        }
        let (da, db, out) = f(a, b);
        if da != 0 || db != 0 {
            // `id % BUCKETS` never exceeds 9.
            #[allow(clippy::cast_possible_truncation)]
            let cur = &mut buckets[(id % BUCKETS) as usize];
            if cur.id != id {
                *cur = Bucket { id, a: 0, b: 0 };
            }
            cur.a += da;
            cur.b += db;
        }
        out
    }
}

/// The shared retry budget, after tower's `TpsBudget` and Finagle's `RetryBudget`:
/// every call deposits one request; every retry withdraws one; a retry is allowed while
/// `retries + 1 <= ratio * requests + min_retries_per_sec * ttl` over the last `ttl`.
///
/// A *retry* here is another attempt after a `Transient` or `SourceDead` outcome, the
/// ones that multiply load on a failing upstream. Going on after a 429 (pushback, paced
/// by holds and `Retry-After`), re-asking after `Invalid` and waiting for a gate are not
/// withdrawn. A retry withdrawn and never sent (the call ended, or its caller dropped
/// it, during the backoff) is given back; one a gate below refused (not an attempt) is
/// kept for the call's next dispatch.
///
/// Cheap to clone (a handle); every service of one layer shares one budget.
#[derive(Clone, Debug)]
pub struct RetryBudget {
    inner: Arc<BudgetInner>,
}

#[derive(Debug)]
struct BudgetInner {
    ratio: f64,
    reserve: f64,
    window: Window,
}

impl RetryBudget {
    /// A new budget (the config is assumed valid, see
    /// [`RetryConfig::validate`](crate::RetryConfig::validate)).
    #[must_use]
    pub fn new(config: &RetryBudgetConfig) -> Self {
        Self {
            inner: Arc::new(BudgetInner {
                ratio: config.ratio,
                reserve: f64::from(config.min_retries_per_sec) * config.ttl.as_secs_f64(),
                window: Window::new(config.ttl),
            }),
        }
    }

    /// Records one request (a call's first attempt).
    pub fn deposit(&self, now: Instant) {
        self.inner.window.update(now, |_, _| (1, 0, ()));
    }

    /// Takes one retry from the budget; `false` when none is left.
    pub fn withdraw(&self, now: Instant) -> bool {
        self.withdrawal(now).is_some()
    }

    /// [`withdraw`](Self::withdraw), answering the withdrawal (for a
    /// [`refund`](Self::refund)) when allowed.
    pub(crate) fn withdrawal(&self, now: Instant) -> Option<Withdrawal> {
        let (ratio, reserve) = (self.inner.ratio, self.inner.reserve);
        let allowed = self.inner.window.update(now, |requests, retries| {
            #[allow(clippy::cast_precision_loss)]
            let allowed = (retries + 1) as f64 <= ratio * requests as f64 + reserve;
            (0, u64::from(allowed), allowed)
        });
        allowed.then(|| Withdrawal(self.inner.window.bucket_id(now)))
    }

    /// Gives back a retry withdrawn for an attempt that was never sent (the call ended,
    /// or was dropped, while it waited to send it): from the bucket it was counted in,
    /// while that bucket is still in the window at `now`; nothing once it has left.
    pub(crate) fn refund(&self, withdrawal: Withdrawal, now: Instant) {
        let w = &self.inner.window;
        let (id, current) = (withdrawal.0, w.bucket_id(now));
        if id + BUCKETS <= current {
            return;
        }
        let mut buckets = lock(&w.buckets);
        // `id % BUCKETS` never exceeds 9.
        #[allow(clippy::cast_possible_truncation)]
        let bucket = &mut buckets[(id % BUCKETS) as usize];
        if bucket.id == id && bucket.b > 0 {
            bucket.b -= 1;
        }
    }

    /// Requests and retries counted in the window at `now`.
    #[must_use]
    pub fn counts(&self, now: Instant) -> (u64, u64) {
        self.inner.window.update(now, |a, b| (0, 0, (a, b)))
    }
}

/// One retry taken from a [`RetryBudget`]: the bucket it was counted in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Withdrawal(u64);

/// Client-side adaptive throttling, from the Google SRE book ("Handling
/// Overload"): each attempt is dropped locally with probability
/// `max(0, (requests - K * accepts) / (requests + 1))` over the window, where
/// `requests` counts every attempt the client wanted to send (dropped ones included) and
/// `accepts` those the upstream accepted (any outcome but `RateLimited`, `Transient` and
/// `SourceDead`).
///
/// Cheap to clone (a handle); every service of one layer shares one throttle.
#[derive(Clone, Debug)]
pub struct AdaptiveThrottle {
    inner: Arc<ThrottleInner>,
}

#[derive(Debug)]
struct ThrottleInner {
    k: f64,
    window: Window,
}

fn drop_probability(k: f64, requests: u64, accepts: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let (r, a) = (requests as f64, accepts as f64);
    ((r - k * a) / (r + 1.0)).max(0.0)
}

impl AdaptiveThrottle {
    /// A new throttle (the config is assumed valid).
    #[must_use]
    pub fn new(config: &ThrottleConfig) -> Self {
        Self {
            inner: Arc::new(ThrottleInner {
                k: config.k,
                window: Window::new(config.window),
            }),
        }
    }

    /// The current drop probability.
    #[must_use]
    pub fn drop_probability(&self, now: Instant) -> f64 {
        let k = self.inner.k;
        self.inner
            .window
            .update(now, |r, a| (0, 0, drop_probability(k, r, a)))
    }

    /// Counts one wanted attempt and decides whether it may go: `draw` is a uniform
    /// number in `[0, 1)`; the attempt is dropped when `draw < probability`.
    pub fn admit(&self, now: Instant, draw: f64) -> bool {
        let k = self.inner.k;
        self.inner
            .window
            .update(now, |r, a| (1, 0, draw >= drop_probability(k, r, a)))
    }

    /// Records that the upstream accepted an attempt.
    pub fn record_accept(&self, now: Instant) {
        self.inner.window.update(now, |_, _| (0, 1, ()));
    }

    /// Attempts wanted and accepted in the window at `now`.
    #[must_use]
    pub fn counts(&self, now: Instant) -> (u64, u64) {
        self.inner.window.update(now, |a, b| (0, 0, (a, b)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    #[tokio::test(start_paused = true)]
    async fn window_slides_by_tenths() {
        let w = Window::new(Duration::from_secs(10));
        let t0 = Instant::now();
        w.update(t0, |_, _| (5, 1, ()));
        w.update(t0 + Duration::from_millis(4_500), |_, _| (2, 0, ()));
        assert_eq!(
            w.update(t0 + Duration::from_millis(9_999), |a, b| (0, 0, (a, b))),
            (7, 1)
        );
        // The first bucket ([0, 1 s)) has left the window at 10 s.
        assert_eq!(
            w.update(t0 + Duration::from_secs(10), |a, b| (0, 0, (a, b))),
            (2, 0)
        );
        assert_eq!(
            w.update(t0 + Duration::from_secs(15), |a, b| (0, 0, (a, b))),
            (0, 0)
        );
        // A reused slot starts from zero.
        w.update(t0 + Duration::from_secs(20), |_, _| (1, 0, ()));
        assert_eq!(
            w.update(t0 + Duration::from_secs(20), |a, b| (0, 0, (a, b))),
            (1, 0)
        );
    }

    /// A refund gives back its own withdrawal while that is in the window, and
    /// nothing once it has left: never another call's retry.
    #[tokio::test(start_paused = true)]
    async fn a_refund_gives_back_its_own_withdrawal_only() {
        let b = RetryBudget::new(&RetryBudgetConfig {
            ratio: 0.0,
            min_retries_per_sec: 1,
            ttl: Duration::from_secs(10),
        });
        let t0 = Instant::now();
        let early = b.withdrawal(t0).unwrap();
        let later = b.withdrawal(t0 + Duration::from_secs(5)).unwrap();
        assert_eq!(b.counts(t0 + Duration::from_secs(5)), (0, 2));
        b.refund(later, t0 + Duration::from_secs(6));
        assert_eq!(
            b.counts(t0 + Duration::from_secs(6)),
            (0, 1),
            "its own, in the window"
        );
        // `early` has left the window at 10 s; refunding it must not take `later`'s
        // real retry (counted again).
        let again = b.withdrawal(t0 + Duration::from_secs(7)).unwrap();
        b.refund(early, t0 + Duration::from_secs(11));
        assert_eq!(
            b.counts(t0 + Duration::from_secs(11)),
            (0, 1),
            "left the window: nothing"
        );
        b.refund(again, t0 + Duration::from_secs(11));
        assert_eq!(b.counts(t0 + Duration::from_secs(11)), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn budget_allows_ratio_plus_floor() {
        let b = RetryBudget::new(&RetryBudgetConfig {
            ratio: 0.1,
            min_retries_per_sec: 1,
            ttl: Duration::from_secs(10),
        });
        let now = Instant::now();
        for _ in 0..100 {
            b.deposit(now);
        }
        // 0.1 * 100 + 1 * 10 = 20 retries.
        let allowed = (0..50).filter(|_| b.withdraw(now)).count();
        assert_eq!(allowed, 20);
        assert_eq!(b.counts(now), (100, 20));
        // Ten seconds later the window is empty again: only the floor.
        let later = now + Duration::from_secs(10);
        assert_eq!((0..50).filter(|_| b.withdraw(later)).count(), 10);
    }

    /// Drops happen exactly when the seeded draw falls under the documented
    /// probability, step by step, and the drop rate matches it.
    #[tokio::test(start_paused = true)]
    async fn throttle_drops_with_the_documented_probability() {
        let t = AdaptiveThrottle::new(&ThrottleConfig::default());
        let now = Instant::now();
        assert!(t.drop_probability(now).abs() < f64::EPSILON);
        // An upstream accepting one attempt in four.
        let mut rng = SmallRng::seed_from_u64(7);
        let (mut requests, mut accepts, mut dropped) = (0u64, 0u64, 0u64);
        let mut expected_sum = 0.0;
        for i in 0..20_000u64 {
            #[allow(clippy::cast_precision_loss)]
            let p = ((requests as f64 - 2.0 * accepts as f64) / (requests as f64 + 1.0)).max(0.0);
            assert!((t.drop_probability(now) - p).abs() < 1e-12, "step {i}");
            let draw: f64 = rng.random();
            let admitted = t.admit(now, draw);
            assert_eq!(admitted, draw >= p, "step {i}");
            requests += 1;
            expected_sum += p;
            if admitted {
                if i % 4 == 0 {
                    t.record_accept(now);
                    accepts += 1;
                }
            } else {
                dropped += 1;
            }
        }
        assert_eq!(t.counts(now), (requests, accepts));
        #[allow(clippy::cast_precision_loss)]
        let (rate, expected) = (dropped as f64 / 20_000.0, expected_sum / 20_000.0);
        assert!(expected > 0.2, "the throttle should be dropping: {expected}");
        assert!((rate - expected).abs() < 0.02, "rate {rate} expected {expected}");
    }
}
