//! The counts of one scope over a sliding window, kept per sub-window: what the
//! memory backend locks, and what `lua/window.lua` keeps in a Redis hash.
//!
//! A window of `k` sub-windows of length `g` (`k * g` = the window). At instant `t`,
//! in sub-window `cur = t / g`, the sub-windows `cur - k ..= cur` are *live*: together
//! they cover every instant of the span `(t - window, t]`, so their sum is never less
//! than what the span holds. An admission that keeps that sum within the quota keeps
//! every span of the window's length within it: the last admission into any span saw
//! every earlier one of that span in its sum. Sub-window `b` stops being live at
//! `(b + k + 1) * g`: what it holds comes back then, at most one sub-window later than
//! an exact sliding log would give it back.

use std::collections::VecDeque;

/// One sub-window's counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Bucket {
    id: u64,
    requests: u64,
    tokens: u64,
}

/// The non-empty live sub-windows of one scope, oldest first, and their totals.
///
/// At most `k + 1` entries: memory bounded by the sub-windows, not by the traffic.
#[derive(Debug, Default)]
pub(crate) struct Sliding {
    buckets: VecDeque<Bucket>,
    requests: u64,
    tokens: u64,
}

/// Which count of a sub-window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Count {
    Requests,
    Tokens,
}

impl Bucket {
    const fn get(&self, c: Count) -> u64 {
        match c {
            Count::Requests => self.requests,
            Count::Tokens => self.tokens,
        }
    }
}

impl Sliding {
    /// Drops the sub-windows before `oldest` (no longer live).
    #[inline]
    pub(crate) fn roll(&mut self, oldest: u64) {
        while let Some(b) = self.buckets.front().copied() {
            if b.id >= oldest {
                break;
            }
            self.buckets.pop_front();
            self.requests = self.requests.saturating_sub(b.requests);
            self.tokens = self.tokens.saturating_sub(b.tokens);
        }
    }

    /// The total of `c` over the sub-windows kept (call [`roll`](Self::roll) first).
    #[inline]
    pub(crate) const fn total(&self, c: Count) -> u64 {
        match c {
            Count::Requests => self.requests,
            Count::Tokens => self.tokens,
        }
    }

    /// Adds to sub-window `id` (the current one; kept in order should a later one
    /// already be there).
    #[inline]
    pub(crate) fn add(&mut self, id: u64, requests: u64, tokens: u64) {
        self.requests = self.requests.saturating_add(requests);
        self.tokens = self.tokens.saturating_add(tokens);
        match self.buckets.back_mut() {
            Some(b) if b.id == id => {
                b.requests = b.requests.saturating_add(requests);
                b.tokens = b.tokens.saturating_add(tokens);
            }
            Some(b) if b.id > id => {
                let at = self.buckets.partition_point(|b| b.id < id);
                match self.buckets.get_mut(at) {
                    Some(b) if b.id == id => {
                        b.requests = b.requests.saturating_add(requests);
                        b.tokens = b.tokens.saturating_add(tokens);
                    }
                    _ => self.buckets.insert(at, Bucket { id, requests, tokens }),
                }
            }
            _ => self.buckets.push_back(Bucket { id, requests, tokens }),
        }
    }

    /// Gives back to sub-window `id` what an admission there reserved and did not use
    /// (never below zero); nothing when that sub-window is no longer kept (it left the
    /// span: no quota depends on it any more). `true` when something came back.
    pub(crate) fn give_back(&mut self, id: u64, requests: u64, tokens: u64) -> bool {
        let at = self.buckets.partition_point(|b| b.id < id);
        let Some(b) = self.buckets.get_mut(at).filter(|b| b.id == id) else {
            return false;
        };
        let (r, t) = (requests.min(b.requests), tokens.min(b.tokens));
        b.requests -= r;
        b.tokens -= t;
        self.requests = self.requests.saturating_sub(r);
        self.tokens = self.tokens.saturating_sub(t);
        if b.requests == 0 && b.tokens == 0 {
            self.buckets.remove(at);
        }
        r > 0 || t > 0
    }

    /// The first sub-window whose end of life brings `excess` of `c` back: the total
    /// of `c` in it and the ones before it is at least `excess`. `None` when
    /// everything kept is not enough.
    pub(crate) fn frees(&self, c: Count, excess: u64) -> Option<u64> {
        let mut freed = 0u64;
        self.buckets.iter().find_map(|b| {
            freed = freed.saturating_add(b.get(c));
            (freed >= excess).then_some(b.id)
        })
    }

    /// Whether nothing is kept.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rolls_adds_gives_back_and_says_what_frees() {
        let mut s = Sliding::default();
        s.add(10, 1, 5);
        s.add(10, 1, 5);
        s.add(12, 1, 7);
        s.add(11, 0, 3); // a late writer: kept in order
        assert_eq!((s.total(Count::Requests), s.total(Count::Tokens)), (3, 20));
        assert_eq!(s.frees(Count::Requests, 2), Some(10));
        assert_eq!(s.frees(Count::Requests, 3), Some(12));
        assert_eq!(s.frees(Count::Tokens, 11), Some(11));
        assert_eq!(s.frees(Count::Tokens, 21), None);
        // Refunds never go below zero, and an emptied sub-window goes.
        assert!(s.give_back(11, 1, 9));
        assert_eq!(s.total(Count::Tokens), 17);
        assert!(!s.give_back(11, 0, 1), "gone");
        assert!(!s.give_back(99, 1, 1), "never there");
        s.roll(11);
        assert_eq!((s.total(Count::Requests), s.total(Count::Tokens)), (1, 7));
        s.roll(13);
        assert!(s.is_empty());
        assert_eq!((s.total(Count::Requests), s.total(Count::Tokens)), (0, 0));
        // Saturating, never wrapping.
        s.add(20, u64::MAX, u64::MAX);
        s.add(20, 1, 1);
        assert_eq!(s.total(Count::Tokens), u64::MAX);
    }
}
