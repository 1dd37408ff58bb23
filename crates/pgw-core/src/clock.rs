//! One clock read per dispatch, shared by the layers it passes through.
//!
//! A balancer reads the clock when it dispatches an attempt. The gates below it
//! (a rate limiter's admission, a breaker's record of an answer that came at once)
//! run inside that same poll, synchronously: nothing can have been waited for in
//! between, so they may take that instant as theirs instead of reading the clock
//! again (on the 2-core VM of DESIGN.md section 6 a read costs about 23 ns, a third of
//! a whole gate).
//!
//! [`Dispatched::enter`] makes an instant "now" for [`now`] on this thread until the
//! guard is dropped (the end of the poll that dispatched); outside such a scope [`now`]
//! is [`Instant::now`]. Only code that runs synchronously inside the dispatching poll
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

use tokio::time::Instant;

thread_local! {
    /// The instant of the dispatch this thread is inside, if any.
    static DISPATCHED: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// The current instant: the dispatch's when inside a [`Dispatched`] scope on this
/// thread, else [`Instant::now`].
#[inline]
#[must_use]
pub fn now() -> Instant {
    DISPATCHED.with(Cell::get).unwrap_or_else(Instant::now)
}

/// While alive, [`now`] on this thread answers the dispatch's instant. Dropping it
/// restores what was before (scopes nest: a balancer under a balancer).
///
/// Not `Send`: a scope belongs to the thread, and to the poll, that entered it.
#[derive(Debug)]
#[must_use = "the scope ends when the guard is dropped"]
pub struct Dispatched {
    prev: Option<Instant>,
    _thread: PhantomData<*const ()>,
}

impl Dispatched {
    /// Makes `at` the current instant for [`now`] on this thread, until the guard drops.
    #[inline]
    pub fn enter(at: Instant) -> Self {
        Self {
            prev: DISPATCHED.with(|d| d.replace(Some(at))),
            _thread: PhantomData,
        }
    }

    /// Moves the scope to a later dispatch's instant (a second attempt dispatched in
    /// the same poll, after the first was not admitted).
    #[inline]
    pub fn update(&self, at: Instant) {
        DISPATCHED.with(|d| d.set(Some(at)));
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
    async fn a_scope_is_the_threads_own() {
        let t0 = Instant::now();
        tokio::time::advance(Duration::from_secs(3)).await;
        let _scope = Dispatched::enter(t0);
        let elsewhere = std::thread::spawn(|| DISPATCHED.with(Cell::get)).join().unwrap();
        assert_eq!(elsewhere, None);
        assert_eq!(now(), t0);
    }
}
