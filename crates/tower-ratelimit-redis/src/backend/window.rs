//! The sliding window of one scope in memory: the sub-windows under a lock
//! ([`Sliding`], the truth) and, beside them, one atomic word per count through which
//! admissions in the current sub-window take their share without the lock.
//!
//! Whoever holds the lock *publishes* the window for one sub-window, its *head*: each
//! word gets the live total there and a generation, and is *open*. An admission whose
//! clock reads the head adds itself to the word with one compare-and-swap, when the
//! total stays within its quota. Taking the lock *closes* both words first and adds
//! what was taken through them to the head's sub-window in [`Sliding`]: every admission
//! taken through a word counts in the sub-window its clock read, and none after a
//! locked holder rolled past it (a closed word takes nothing; a word republished for a
//! later head carries another generation, and the head is checked). Whatever does not
//! fit, or finds its word closed or its head stale, goes to the locked path, which
//! decides exactly as before.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::sliding::{Count, Sliding};

/// Bits of a word's total: a total beyond them is never published (the locked path
/// decides), far past any count one window holds.
const TOTAL_BITS: u32 = 47;
const TOTAL: u64 = (1 << TOTAL_BITS) - 1;
/// Set while the word is open (published, not yet closed by a lock holder).
const OPEN: u64 = 1 << TOTAL_BITS;
/// The generation of the publication, in the bits above: a word republished since an
/// admission read it no longer compares equal.
const GEN_SHIFT: u32 = TOTAL_BITS + 1;
const CLOSED: u64 = 0;

/// One scope's sliding window: [`Sliding`] under a lock, and one lock-free word per
/// count (requests, tokens) for the head sub-window.
#[derive(Debug, Default)]
pub(crate) struct Window {
    locked: Mutex<Locked>,
    words: [AtomicU64; 2],
    /// The sub-window the open words were published for.
    head: AtomicU64,
}

/// What the lock holds: the sub-windows, and what each word was published with.
#[derive(Debug, Default)]
struct Locked {
    counts: Sliding,
    /// The total each word was opened with: what was taken through it is the
    /// difference when it is closed.
    published: [u64; 2],
    head: u64,
    /// The latest sub-window the counts were rolled to: never published older.
    rolled: u64,
    generation: u64,
}

/// The window, locked: its words closed, what they took counted in [`Sliding`].
/// Dropped as it is, the words stay closed (the next admission takes the lock and
/// publishes); [`publish`](Self::publish) reopens them.
pub(crate) struct Guard<'a> {
    window: &'a Window,
    locked: MutexGuard<'a, Locked>,
}

const fn index(c: Count) -> usize {
    match c {
        Count::Requests => 0,
        Count::Tokens => 1,
    }
}

impl Window {
    /// Locks the window and closes its words, counting what they took in the head's
    /// sub-window.
    pub(crate) fn lock(&self) -> Guard<'_> {
        // Never held across an await or user code; the state stays valid if a panic
        // unwound through a holder.
        let mut locked = pgw_core::sync::lock(&self.locked);
        let mut taken = [0u64; 2];
        for (i, word) in self.words.iter().enumerate() {
            let w = word.swap(CLOSED, Ordering::AcqRel);
            if w & OPEN != 0 {
                // Only the holder of the lock publishes: an open word is its own last
                // publication, and its total only grew from what was published.
                taken[i] = (w & TOTAL) - locked.published[i];
            }
        }
        if taken != [0, 0] {
            let head = locked.head;
            locked.counts.add(head, taken[0], taken[1]);
        }
        Guard { window: self, locked }
    }

    /// Takes `n` of `c` in sub-window `sub` when the total stays within `limit`,
    /// without the lock: the generation taken in, or `None` when the locked path must
    /// decide (closed, published for another sub-window, no room by this word).
    #[inline]
    pub(crate) fn take(&self, c: Count, sub: u64, n: u64, limit: u64) -> Option<u64> {
        let word = &self.words[index(c)];
        let mut w = word.load(Ordering::Acquire);
        loop {
            // The head is read after the word: a publication stores it first, so a
            // head equal to `sub` belongs to this word's publication or a later one,
            // which closed the word before and fails the exchange below.
            if w & OPEN == 0 || self.head.load(Ordering::Relaxed) != sub {
                return None;
            }
            let after = (w & TOTAL).checked_add(n)?;
            if after > limit || after > TOTAL {
                return None;
            }
            if n == 0 {
                return Some(w >> GEN_SHIFT);
            }
            match word.compare_exchange_weak(w, w + n, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(w >> GEN_SHIFT),
                Err(now) => w = now,
            }
        }
    }

    /// Gives back `n` of `c` taken by [`take`](Self::take) in `generation` at
    /// sub-window `sub`: through the word while that publication is open, else from
    /// the sub-window it was counted in (under the lock, the words left closed).
    pub(crate) fn put_back(&self, c: Count, sub: u64, n: u64, generation: u64) {
        if n == 0 {
            return;
        }
        let word = &self.words[index(c)];
        let mut w = word.load(Ordering::Acquire);
        while w & OPEN != 0 && w >> GEN_SHIFT == generation {
            match word.compare_exchange_weak(w, w - n, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(now) => w = now,
            }
        }
        let mut g = self.lock();
        let (r, t) = match c {
            Count::Requests => (n, 0),
            Count::Tokens => (0, n),
        };
        g.counts().give_back(sub, r, t);
    }
}

impl Guard<'_> {
    /// The sub-windows, exact while the lock is held.
    pub(crate) fn counts(&mut self) -> &mut Sliding {
        &mut self.locked.counts
    }

    /// Drops the sub-windows before `oldest`, no longer live in sub-window `sub`.
    pub(crate) fn roll(&mut self, sub: u64, oldest: u64) {
        let l = &mut *self.locked;
        l.rolled = l.rolled.max(sub);
        l.counts.roll(oldest);
    }

    /// Opens the words for sub-window `head` (or the latest one the counts were rolled
    /// to, if later: a word never admits at an instant whose live sub-windows were
    /// rolled away), with the live totals, and lets go of the lock.
    pub(crate) fn publish(mut self, head: u64) {
        let l = &mut *self.locked;
        l.generation = (l.generation + 1) & (u64::MAX >> GEN_SHIFT);
        l.head = head.max(l.rolled).max(l.head);
        // Before the words (released below): a reader of an open word sees this head
        // or a later one.
        self.window.head.store(l.head, Ordering::Relaxed);
        for c in [Count::Requests, Count::Tokens] {
            let total = l.counts.total(c);
            if total <= TOTAL {
                l.published[index(c)] = total;
                self.window.words[index(c)]
                    .store((l.generation << GEN_SHIFT) | OPEN | total, Ordering::Release);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Taken through the words, counted in the head's sub-window once locked; a
    /// stale head, a closed word or no room sends to the lock; a give-back after a
    /// republication comes out of the sub-window it was counted in.
    #[test]
    fn takes_counts_closes_and_gives_back() {
        let w = Window::default();
        assert_eq!(w.take(Count::Requests, 0, 1, 10), None, "closed until published");
        w.lock().publish(5);
        let g1 = w.take(Count::Requests, 5, 1, 2).unwrap();
        assert!(w.take(Count::Requests, 5, 1, 2).is_some());
        assert_eq!(w.take(Count::Requests, 5, 1, 2), None, "no room");
        assert_eq!(w.take(Count::Requests, 6, 1, 10), None, "another sub-window");
        let gt = w.take(Count::Tokens, 5, 30, 40).unwrap();
        assert_eq!(w.take(Count::Tokens, 5, 11, 40), None);
        w.put_back(Count::Tokens, 5, 30, gt);
        assert!(
            w.take(Count::Tokens, 5, 40, 40).is_some(),
            "given back through the word"
        );
        {
            let mut g = w.lock();
            assert_eq!(g.counts().total(Count::Requests), 2);
            assert_eq!(g.counts().total(Count::Tokens), 40);
            g.publish(6);
        }
        assert_eq!(w.take(Count::Requests, 6, 1, 2), None, "the totals carry over");
        assert!(w.take(Count::Requests, 6, 1, 3).is_some());
        // Taken in the first publication, given back after the second: from sub 5.
        w.put_back(Count::Requests, 5, 1, g1);
        let mut g = w.lock();
        assert_eq!(g.counts().total(Count::Requests), 2);
        assert_eq!(g.counts().frees(Count::Requests, 2), Some(6));
    }
}
