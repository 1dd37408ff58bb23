//! One clock read per dispatch, shared by the layers it passes through.
//!
//! A balancer reads the clock when it dispatches an attempt. The gates below it
//! (a rate limiter's admission, a breaker's record of an answer that came at once)
//! run inside that same poll, synchronously: nothing can have been waited for in
//! between, so they may take that instant as theirs instead of reading the clock
//! again (on a 2-core VM a read costs about 23 ns, a third of a whole gate).
//!
//! [`Dispatched::enter`] makes an instant "now" for [`now`] on this thread until the
//! guard is dropped (the end of the poll that dispatched); outside such a scope [`now`]
//! is [`Instant::now`]. The scope also keeps the instant as nanoseconds since a
//! process-wide [`epoch`], so the layers that count time in integers ([`nanos`]) turn
//! the dispatch's instant into one once, not each on its own (an `Instant`
//! subtraction is about 55 instructions; five layers made one each per call). Only code that runs synchronously inside the dispatching poll
//! sees the scope, and a layer that must order itself by the clock (a lock taken
//! before reading it) keeps reading [`Instant::now`].
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use pgw_core::clock::{self, Dispatched};
//! use tokio::time::Instant;
//!
//! let at = Instant::now();
//! {
//!     let _scope = Dispatched::enter(at);
//!     assert_eq!(clock::now(), at); // no second read inside the dispatching poll
//! }
//! assert!(clock::now() >= at); // outside it: the clock
//! # }
//! ```

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

thread_local! {
    /// The instant of the dispatch this thread is inside, if any, and its [`nanos`].
    static DISPATCHED: Cell<Option<(Instant, u64)>> = const { Cell::new(None) };
}

static EPOCH: OnceLock<Instant> = OnceLock::new();

/// How far before its first use the [`epoch`] is set: a paused tokio clock (tests,
/// virtual-time soaks) runs behind the real one by the real time it was paused, and
/// its instants must not fall before the epoch.
const EPOCH_MARGIN: Duration = Duration::from_secs(24 * 3600);

/// The process-wide origin of [`nanos`]: a day before the first call (or the first
/// call's instant, where the clock cannot go back that far).
#[must_use]
pub fn epoch() -> Instant {
    *EPOCH.get_or_init(|| {
        let now = std::time::Instant::now();
        Instant::from_std(now.checked_sub(EPOCH_MARGIN).unwrap_or(now))
    })
}

/// `at` as nanoseconds since [`epoch`] (0 for an instant before it, `u64::MAX` past
/// 584 years after it). Inside a [`Dispatched`] scope, the scope's instant costs a
/// compare: it was turned into nanoseconds once, when the scope began.
#[inline]
#[must_use]
pub fn nanos(at: Instant) -> u64 {
    match DISPATCHED.with(Cell::get) {
        Some((i, n)) if i == at => n,
        _ => nanos_since_epoch(at),
    }
}

fn nanos_since_epoch(at: Instant) -> u64 {
    let d = at.saturating_duration_since(epoch());
    d.as_secs()
        .checked_mul(1_000_000_000)
        .and_then(|s| s.checked_add(u64::from(d.subsec_nanos())))
        .unwrap_or(u64::MAX)
}

/// `at + d`, saturating about thirty years ahead: a huge `d` (a `Duration::MAX`
/// timeout meaning "never", a gate's garbage `retry_after`, a bad `max_wait`) must not
/// overflow the clock, where `Instant + Duration` panics.
///
/// ```
/// use std::time::Duration;
/// use tokio::time::Instant;
///
/// let now = Instant::now();
/// assert_eq!(pgw_core::clock::saturating_after(now, Duration::from_secs(1)), now + Duration::from_secs(1));
/// assert!(pgw_core::clock::saturating_after(now, Duration::MAX) > now + Duration::from_secs(365 * 86_400));
/// ```
#[must_use]
pub fn saturating_after(at: Instant, d: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(30 * 365 * 86_400);
    at.checked_add(d.min(FAR)).unwrap_or(at)
}

/// The current instant: the dispatch's when inside a [`Dispatched`] scope on this
/// thread, else [`Instant::now`].
#[inline]
#[must_use]
pub fn now() -> Instant {
    DISPATCHED.with(Cell::get).map_or_else(Instant::now, |(at, _)| at)
}

/// [`nanos`] of [`now`]: inside a [`Dispatched`] scope, without a clock read or a
/// conversion.
#[inline]
#[must_use]
pub fn now_nanos() -> u64 {
    DISPATCHED
        .with(Cell::get)
        .map_or_else(|| nanos_since_epoch(Instant::now()), |(_, n)| n)
}

/// While alive, [`now`] on this thread answers the dispatch's instant. Dropping it
/// restores what was before (scopes nest: a balancer under a balancer).
///
/// Not `Send`: a scope belongs to the thread, and to the poll, that entered it.
#[derive(Debug)]
#[must_use = "the scope ends when the guard is dropped"]
pub struct Dispatched {
    prev: Option<(Instant, u64)>,
    _thread: PhantomData<*const ()>,
}

impl Dispatched {
    /// Makes `at` the current instant for [`now`] on this thread, until the guard drops.
    #[inline]
    pub fn enter(at: Instant) -> Self {
        let scope = (at, nanos_since_epoch(at));
        Self {
            prev: DISPATCHED.with(|d| d.replace(Some(scope))),
            _thread: PhantomData,
        }
    }

    /// Moves the scope to a later dispatch's instant (a second attempt dispatched in
    /// the same poll, after the first was not admitted).
    #[inline]
    pub fn update(&self, at: Instant) {
        DISPATCHED.with(|d| d.set(Some((at, nanos_since_epoch(at)))));
    }
}

impl Drop for Dispatched {
    #[inline]
    fn drop(&mut self) {
        DISPATCHED.with(|d| d.set(self.prev));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn scopes_nest_and_end_with_their_guard() {
        let t0 = Instant::now();
        tokio::time::advance(Duration::from_secs(1)).await;
        let outer = Dispatched::enter(t0);
        assert_eq!(now(), t0);
        let t1 = t0 + Duration::from_millis(5);
        {
            let inner = Dispatched::enter(t1);
            assert_eq!(now(), t1);
            let t2 = t1 + Duration::from_millis(5);
            inner.update(t2);
            assert_eq!(now(), t2);
        }
        assert_eq!(now(), t0, "the inner scope gave the outer one back");
        drop(outer);
        assert_eq!(now(), Instant::now());
        assert_eq!(now(), t0 + Duration::from_secs(1), "outside a scope: the clock");
    }

    #[tokio::test(start_paused = true)]
    async fn nanos_count_from_the_epoch_and_the_scope_converts_once() {
        let t0 = Instant::now();
        let n0 = nanos(t0);
        assert!(n0 > 0, "a paused clock's instants fall after the epoch");
        let t1 = t0 + Duration::from_millis(1500);
        assert_eq!(nanos(t1) - n0, 1_500_000_000);
        assert_eq!(nanos(epoch()), 0);
        assert_eq!(nanos(epoch() - Duration::from_secs(1)), 0, "before the epoch: 0");
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(now_nanos(), n0 + 2_000_000_000, "outside a scope: the clock");
        let scope = Dispatched::enter(t1);
        assert_eq!(now_nanos(), n0 + 1_500_000_000, "inside: the dispatch's");
        assert_eq!(nanos(t1), now_nanos());
        assert_eq!(nanos(t0), n0, "another instant is converted");
        scope.update(t0);
        assert_eq!(now_nanos(), n0);
        drop(scope);
        assert_eq!(now_nanos(), n0 + 2_000_000_000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_scope_is_the_threads_own() {
        let t0 = Instant::now();
        tokio::time::advance(Duration::from_secs(3)).await;
        let _scope = Dispatched::enter(t0);
        let elsewhere = std::thread::spawn(|| DISPATCHED.with(Cell::get)).join().unwrap();
        assert!(elsewhere.is_none());
        assert_eq!(now(), t0);
    }
}
