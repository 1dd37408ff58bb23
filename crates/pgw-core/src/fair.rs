//! Oldest first among calls woken by the same instant.
//!
//! Calls refused by one hold (an account's 429 with the time its quota refills) all
//! learn the same end and would all wake at it, in whatever order the timer fires
//! them: the first few in get the refilled quota, the rest meet the next hold, and a
//! call can lose that draw many times in a row while newer calls win it (the
//! account-429 storm of the soak: calls waiting 25 minutes beside a median of 52 s).
//!
//! [`wake_at`] spreads the wake-ups over [`ORDER_SPAN`] after the end, by how long each
//! call has been waiting: the one waiting longest wakes first, a call that just began
//! waiting last. The offset is a function of the wait's age alone, with no registry of
//! waiters, so every layer that waits (the balancer, the retry layer) and every process
//! sharing the hold order their calls the same way. Only a quota's end (a hold, a
//! window) is spread: a breaker's end admits one probe, whoever asks first, and
//! spreading those cost the soak's flapping pool 1.5% of its goodput.
//!
//! The order is approximate, by design of a registry-free rule:
//! - a call that finds no other call waiting in its layer ([`Waiting`]: the retry
//!   layer counts every call it has sleeping, the balancer those waiting for a quota's
//!   end) wakes at the end itself, and is not moved behind older calls that begin
//!   waiting after it;
//! - the offset is at most a quarter of the wait from when the call went to sleep, so
//!   a young call refused just before the end wakes within that quarter, possibly
//!   ahead of older ones;
//! - the retry layer and the balancer count their waiting calls apart.
//!
//! Measured where it matters (the soak's account-429 storm, many calls waiting for one
//! account's holds): the slowest successful call 1686 -> 597 s, P6's 1169 -> 532 s.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// The longest a call is woken after the end it waits for: 500 ms, for a call that
/// began waiting at that end; half of it after [`ORDER_AGE_SCALE`] of waiting.
pub const ORDER_SPAN: Duration = Duration::from_millis(500);

/// How the offset shrinks with the wait's age: halved after 30 s of waiting, a tenth
/// after 270 s (the ages a saturated account makes its callers wait).
pub const ORDER_AGE_SCALE: Duration = Duration::from_secs(30);

/// When a call waiting since `since` wakes, at `now`, for a wait that ends at `end`,
/// while `others` calls wait beside it (in the same layer of the same process, for
/// this end or another):
/// - with none, at `end`: nobody to order it against, and a lone call is not delayed;
/// - else at `end` plus [`ORDER_SPAN`] scaled down by the age the wait will have at
///   `end` (older waits first), and by at most a quarter of the wait, so a short wait
///   (a window's next request, a brief hold) is not stretched by it.
///
/// ```
/// use std::time::Duration;
/// use pgw_core::fair::{ORDER_SPAN, wake_at};
/// use tokio::time::Instant;
///
/// let now = Instant::now();
/// let end = now + Duration::from_secs(60);
/// assert_eq!(wake_at(now, end, now, 0), end); // alone
/// // Waiting since now (60 s old at the end), or since 50 s from now (10 s old).
/// let old = wake_at(now, end, now, 1);
/// let new = wake_at(now, end, now + Duration::from_secs(50), 1);
/// assert!(end < old && old < new);
/// assert!(new <= end + ORDER_SPAN);
/// // A wait of 100 ms is stretched by 25 ms at most.
/// let soon = now + Duration::from_millis(100);
/// assert!(wake_at(now, soon, now, 1) <= soon + Duration::from_millis(25));
/// ```
#[must_use]
pub fn wake_at(now: Instant, end: Instant, since: Instant, others: usize) -> Instant {
    if others == 0 {
        return end;
    }
    let most = end.saturating_duration_since(now) / 4;
    end.checked_add(offset(end.saturating_duration_since(since)).min(most))
        .unwrap_or(end)
}

/// Calls waiting in one layer: what [`wake_at`] orders a call against. Each waiting
/// call holds a [`Counted`] while it waits.
#[derive(Debug, Default)]
pub struct Waiting(AtomicUsize);

impl Waiting {
    /// No call waiting.
    #[must_use]
    pub const fn new() -> Self {
        Self(AtomicUsize::new(0))
    }

    /// Calls waiting now.
    #[must_use]
    pub fn count(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }

    /// Counts one more call waiting until the guard is dropped.
    #[must_use]
    pub fn enter(self: &Arc<Self>) -> Counted {
        self.0.fetch_add(1, Ordering::Relaxed);
        Counted(Arc::clone(self))
    }
}

/// One call counted in a [`Waiting`] until dropped.
#[derive(Debug)]
pub struct Counted(Arc<Waiting>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The wake-up offset of a wait `age` old at its end.
#[must_use]
pub fn offset(age: Duration) -> Duration {
    let scale = ORDER_AGE_SCALE.as_secs_f64();
    ORDER_SPAN.mul_f64(scale / (age.as_secs_f64() + scale))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lone_wait_ends_at_its_end_and_the_counted_leave_when_dropped() {
        let now = Instant::now();
        let end = now + Duration::from_secs(8);
        assert_eq!(wake_at(now, end, now, 0), end);
        // Not alone: half a second later (under a quarter of 8 s).
        assert_eq!(wake_at(now, end, end, 1), end + ORDER_SPAN);
        let waiting = Arc::new(Waiting::new());
        let a = waiting.enter();
        let b = waiting.enter();
        assert_eq!(waiting.count(), 2);
        drop(a);
        assert_eq!(waiting.count(), 1);
        drop(b);
        assert_eq!(waiting.count(), 0);
    }

    #[test]
    fn older_waits_wake_first_and_within_the_span() {
        let ages = [0, 1, 10, 30, 100, 300, 1000, 3000];
        let offsets: Vec<Duration> = ages.iter().map(|&s| offset(Duration::from_secs(s))).collect();
        assert_eq!(offsets[0], ORDER_SPAN);
        assert_eq!(offsets[3], ORDER_SPAN / 2);
        for w in offsets.windows(2) {
            assert!(w[1] < w[0], "{offsets:?}");
        }
        // Two calls ten seconds apart at ages a queue reaches stay at least a
        // millisecond apart (the timer's resolution).
        assert!(
            offset(Duration::from_secs(300)) - offset(Duration::from_secs(310)) >= Duration::from_millis(1)
        );
    }
}
