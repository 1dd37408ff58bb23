//! The per-source limiter: a float limit and an inflight count, both atomics.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use pgw_core::{Outcome, SourceId};
use tokio::sync::Notify;

use crate::AimdConfig;

/// The share of the limit that must be in flight for a success to grow it by a whole
/// slot in slow start: a limit nobody uses says nothing about what the source takes.
const SLOW_START_USE: f64 = 0.5;

/// Shared state of one source.
pub(crate) struct Limiter {
    limit_bits: AtomicU64,
    /// The congestion episode: incremented by each cut. A 429 of a request sent in an
    /// earlier episode (before the last cut) does not cut again (as in TCP).
    episode: AtomicU64,
    inflight: AtomicUsize,
    /// Refusals not yet answered by a release: counted by whoever was refused (a shed
    /// `Paced`, a waiting `poll_ready`) before it re-checks. Each release takes one and
    /// wakes one waiter of the release signal (`Notify::notify_one`, first come first
    /// served): one freed slot, one wake-up, not a herd; and nothing (no lock) on the
    /// path where nobody was refused.
    refused: AtomicUsize,
    /// Refusals ever counted (never taken back): a slot given back unused answers a
    /// refusal only if one was counted while it was held (see [`Permit::unused`]).
    marked: AtomicU64,
    signal: Arc<Notify>,
    /// Further release signals, each woken with `signal`: a source under several
    /// balancers (one route in two model groups) wakes one waiter of each.
    also: Vec<Arc<Notify>>,
    floor: f64,
    ceiling: f64,
    cut: f64,
    /// The EWMA of pushback among outcomes (1 a 429, 0 a success).
    pushback_bits: AtomicU64,
    tolerated: f64,
    source: Option<SourceId>,
}

impl Limiter {
    pub(crate) fn new(
        config: &AimdConfig,
        source: Option<SourceId>,
        signal: Arc<Notify>,
        also: Vec<Arc<Notify>>,
    ) -> Self {
        let ceiling = config.ceiling();
        Self {
            limit_bits: AtomicU64::new(config.initial_limit.min(ceiling).to_bits()),
            episode: AtomicU64::new(0),
            inflight: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
            marked: AtomicU64::new(0),
            signal,
            also,
            floor: config.min_limit,
            ceiling,
            cut: config.decrease_factor,
            pushback_bits: AtomicU64::new(0f64.to_bits()),
            tolerated: config.tolerated_pushback,
            source,
        }
    }

    pub(crate) fn limit(&self) -> f64 {
        // SeqCst, as the growth's store and the `refused` count: a waiter counts its
        // refusal, then reads the limit; a growth stores the limit, then reads the
        // count. With a weaker order on either side both could miss the other (the
        // store-buffer pattern: on ARM a growth could leave its new slot idle).
        f64::from_bits(self.limit_bits.load(Ordering::SeqCst))
    }

    pub(crate) fn inflight(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }

    pub(crate) fn source(&self) -> Option<&SourceId> {
        self.source.as_ref()
    }

    pub(crate) fn signal(&self) -> &Arc<Notify> {
        &self.signal
    }

    pub(crate) fn also(&self) -> &[Arc<Notify>] {
        &self.also
    }

    /// Wakes one waiter of each release signal.
    pub(crate) fn wake_one(&self) {
        self.signal.notify_one();
        for s in &self.also {
            s.notify_one();
        }
    }

    /// Takes a slot if `inflight < floor(limit)`.
    pub(crate) fn try_acquire(&self) -> bool {
        // The limit is >= 1, so the truncation is the floor and fits.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let max = self.limit() as usize;
        let mut cur = self.inflight.load(Ordering::SeqCst);
        loop {
            if cur >= max {
                return false;
            }
            match self
                .inflight
                .compare_exchange_weak(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Takes a slot as [`try_acquire`](Self::try_acquire) does; the refusals counted
    /// before it was taken (read before, for its [`Permit`]), or `None`.
    pub(crate) fn take(&self) -> Option<u64> {
        let seen = self.marked.load(Ordering::SeqCst);
        self.try_acquire().then_some(seen)
    }

    /// Like [`take`](Self::take), but a refusal is counted so a release wakes one
    /// waiter for it. The caller must have enabled its `Notified` before calling this
    /// if it means to wait on it.
    pub(crate) fn acquire_or_mark(&self) -> Option<u64> {
        if let Some(seen) = self.take() {
            return Some(seen);
        }
        // Dekker-style: count the refusal, then re-check. A release that the re-check
        // does not see comes later in the SeqCst order and therefore sees the count.
        self.refused.fetch_add(1, Ordering::SeqCst);
        // Our own refusal is among those counted before the slot: it is withdrawn.
        let seen = self.marked.fetch_add(1, Ordering::SeqCst).wrapping_add(1);
        if self.try_acquire() {
            // Admitted after all: the refusal is withdrawn (unless a release took it
            // already, whose wake-up then finds a waiter who re-checks, or is kept
            // for the next one to wait).
            self.take_refusal();
            return Some(seen);
        }
        None
    }

    /// Takes one unanswered refusal, if any (a waiter admitted without its wake-up
    /// withdraws the refusal it waited for).
    pub(crate) fn take_refusal(&self) -> bool {
        self.refused
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    /// Gives a slot back and wakes one waiter if a refusal is unanswered: the one that
    /// waited longest (`Notify` is first in, first out).
    pub(crate) fn release(&self) {
        self.inflight.fetch_sub(1, Ordering::SeqCst);
        self.answer_a_refusal();
    }

    /// Wakes one waiter if a refusal is unanswered (taking it).
    fn answer_a_refusal(&self) {
        if self.refused.load(Ordering::SeqCst) > 0 && self.take_refusal() {
            self.wake_one();
        }
    }

    /// The current congestion episode.
    pub(crate) fn episode(&self) -> u64 {
        self.episode.load(Ordering::SeqCst)
    }

    /// Feeds the outcome of a request sent during `episode`: a 429 cuts the limit once
    /// per episode (the first 429 of a request sent since the last cut wins the cut and
    /// starts a new episode; the 429s of requests already in flight then do not cut
    /// again), a success grows it by `1 / limit`.
    pub(crate) fn on_outcome(&self, episode: u64, outcome: Outcome) {
        match outcome {
            Outcome::RateLimited { .. } => {
                let share = self.pushback(1.0);
                if share > self.tolerated
                    && self
                        .episode
                        .compare_exchange(
                            episode,
                            episode.wrapping_add(1),
                            Ordering::SeqCst,
                            Ordering::SeqCst,
                        )
                        .is_ok()
                {
                    self.update(|l| (l * self.cut).max(self.floor));
                }
            }
            Outcome::Success => {
                self.pushback(0.0);
                // Slow start (as TCP's, RFC 5681): until the first cut there is no sign of
                // a limit, so a success while the limit is in use (at least half of it
                // taken, RFC 7661's validation) adds a whole slot; after it, congestion
                // avoidance adds 1/limit.
                #[allow(clippy::cast_precision_loss)]
                let in_use = self.inflight() as f64 >= self.limit() * SLOW_START_USE;
                if self.episode() == 0 && in_use {
                    self.update(|l| (l + 1.0).min(self.ceiling));
                } else {
                    self.update(|l| (l + 1.0 / l).min(self.ceiling));
                }
            }
            Outcome::Transient
            | Outcome::SourceDead
            | Outcome::Rejected
            | Outcome::Invalid
            | Outcome::LocalExhaustion => {}
        }
    }

    /// Feeds one outcome to the pushback share; the share after it.
    fn pushback(&self, sample: f64) -> f64 {
        if self.tolerated == 0.0 {
            return 1.0;
        }
        let step = |b: u64| {
            let old = f64::from_bits(b);
            old + crate::config::PUSHBACK_ALPHA * (sample - old)
        };
        let mut cur = self.pushback_bits.load(Ordering::Relaxed);
        loop {
            let next = step(cur);
            // A share the sample does not move (a run of successes decays it to 0.0
            // and it stays there) is left unwritten: no read-modify-write per call.
            if next.to_bits() == cur {
                return next;
            }
            match self.pushback_bits.compare_exchange_weak(
                cur,
                next.to_bits(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return next,
                Err(actual) => cur = actual,
            }
        }
    }

    fn update(&self, f: impl Fn(f64) -> f64) {
        let mut cur = self.limit_bits.load(Ordering::SeqCst);
        loop {
            let next = f(f64::from_bits(cur)).to_bits();
            if next == cur {
                return;
            }
            // SeqCst: see `limit`.
            match self
                .limit_bits
                .compare_exchange_weak(cur, next, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => {
                    // A whole slot more: it wakes one waiter, as a release does.
                    if f64::from_bits(next).floor() > f64::from_bits(cur).floor()
                        && self.refused.load(Ordering::SeqCst) > 0
                        && self.take_refusal()
                    {
                        self.wake_one();
                    }
                    return;
                }
                Err(actual) => cur = actual,
            }
        }
    }
}

/// One slot of a source's limit; released on drop, on every path.
pub(crate) struct Permit {
    limiter: Arc<Limiter>,
    /// The congestion episode the request is sent in.
    episode: u64,
    /// The limiter's count of refusals ever counted, read before the slot was taken
    /// ([`Limiter::take`]).
    marked: u64,
    /// Given back unused ([`unused`](Self::unused)).
    unused: bool,
}

impl Permit {
    /// The slot just taken, `marked` being what [`Limiter::take`] or
    /// [`Limiter::acquire_or_mark`] answered.
    pub(crate) fn new(limiter: Arc<Limiter>, marked: u64) -> Self {
        let episode = limiter.episode();
        Self {
            limiter,
            episode,
            marked,
            unused: false,
        }
    }

    /// Gives the slot back unused (the service below refused in `poll_ready`): it
    /// wakes a waiter only if someone was refused while it was held. A refusal counted
    /// before it was taken was not caused by it, and is answered by a real release:
    /// waking for it here woke a balancer round that met the same refusal below, which
    /// gave its slot back again, one round after another while old refusals were
    /// counted.
    pub(crate) fn unused(mut self) {
        self.unused = true;
    }

    /// Feeds the request's outcome to its limiter, in the episode it was sent in.
    pub(crate) fn on_outcome(&self, outcome: Outcome) {
        self.limiter.on_outcome(self.episode, outcome);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.unused {
            self.limiter.release();
            return;
        }
        // The slot first, then the count: a refusal counted since the slot was taken,
        // up to its return, is answered (a refuser that saw it taken counted before
        // this read; one that came after finds the slot). Read before the return, a
        // refusal between the two waited for a wake-up nobody sent.
        self.limiter.inflight.fetch_sub(1, Ordering::SeqCst);
        if self.limiter.marked.load(Ordering::SeqCst) != self.marked {
            self.limiter.answer_a_refusal();
        }
    }
}

impl fmt::Debug for Permit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Permit")
            .field("source", &self.limiter.source)
            .finish()
    }
}

/// A read-only view of one source's limiter, for metrics and tests.
///
/// ```
/// use tower_aimd::{AimdLayer, DEFAULT_INITIAL_LIMIT};
/// let layer = AimdLayer::default();
/// let h = layer.handle();
/// assert_eq!(h.limit(), DEFAULT_INITIAL_LIMIT);
/// assert_eq!(h.inflight(), 0);
/// ```
#[derive(Clone)]
pub struct AimdHandle {
    pub(crate) limiter: Arc<Limiter>,
}

impl AimdHandle {
    /// The current (float) limit.
    #[must_use]
    pub fn limit(&self) -> f64 {
        self.limiter.limit()
    }

    /// Attempts in flight (slots taken), including a slot reserved by `poll_ready`.
    #[must_use]
    pub fn inflight(&self) -> usize {
        self.limiter.inflight()
    }

    /// The source this limiter belongs to, when named.
    #[must_use]
    pub fn source(&self) -> Option<&SourceId> {
        self.limiter.source()
    }

    /// The signal fired when a slot is released after a refusal (what a balancer
    /// waits on when every source is paced).
    #[must_use]
    pub fn release_signal(&self) -> Arc<Notify> {
        Arc::clone(self.limiter.signal())
    }
}

impl fmt::Debug for AimdHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AimdHandle")
            .field("source", &self.limiter.source)
            .field("limit", &self.limit())
            .field("inflight", &self.inflight())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(cfg: &AimdConfig) -> Arc<Limiter> {
        Arc::new(Limiter::new(cfg, None, Arc::new(Notify::new()), Vec::new()))
    }

    #[test]
    fn cut_growth_floor_and_ceiling() {
        let l = limiter(&AimdConfig {
            max_concurrency: Some(12),
            caller_concurrency: Some(10),
            tolerated_pushback: 0.0,
            ..AimdConfig::default()
        });
        let rl = Outcome::RateLimited { retry_after: None };
        assert!((l.limit() - 8.0).abs() < 1e-12);
        l.on_outcome(l.episode(), rl);
        assert!((l.limit() - 4.0).abs() < 1e-12, "x0.5 cut");
        l.on_outcome(l.episode(), Outcome::Success);
        assert!((l.limit() - 4.25).abs() < 1e-12, "+1/limit growth");
        for _ in 0..10 {
            // Each sent after the previous cut: each cuts.
            l.on_outcome(l.episode(), rl);
        }
        assert!((l.limit() - 1.0).abs() < 1e-12, "floor 1");
        for _ in 0..10_000 {
            l.on_outcome(l.episode(), Outcome::Success);
        }
        assert!((l.limit() - 10.0).abs() < 1e-12, "ceiling min(12, 10)");
        for o in [
            Outcome::Transient,
            Outcome::SourceDead,
            Outcome::Rejected,
            Outcome::Invalid,
        ] {
            l.on_outcome(l.episode(), o);
        }
        assert!((l.limit() - 10.0).abs() < 1e-12, "other outcomes leave the limit");
    }

    #[test]
    fn slow_start_adds_a_slot_per_success_in_use_until_the_first_cut() {
        let l = limiter(&AimdConfig {
            tolerated_pushback: 0.0,
            ..AimdConfig::default()
        });
        // Unused (nothing in flight): congestion avoidance, +1/8.
        l.on_outcome(l.episode(), Outcome::Success);
        assert!((l.limit() - 8.125).abs() < 1e-12, "{}", l.limit());
        // Half the limit in flight: each success adds a whole slot.
        let held: Vec<Permit> = (0..6)
            .map(|_| {
                let seen = l.take().expect("a slot");
                Permit::new(Arc::clone(&l), seen)
            })
            .collect();
        for p in &held[..3] {
            p.on_outcome(Outcome::Success);
        }
        assert!((l.limit() - 11.125).abs() < 1e-12, "{}", l.limit());
        // The first cut ends slow start: growth is 1/limit from then on.
        held[3].on_outcome(Outcome::RateLimited { retry_after: None });
        let cut = l.limit();
        assert!((cut - 5.5625).abs() < 1e-12, "{cut}");
        held[4].on_outcome(Outcome::Success);
        assert!((l.limit() - (cut + 1.0 / cut)).abs() < 1e-12, "{}", l.limit());
        drop(held);
        assert_eq!(l.inflight(), 0);
    }

    #[test]
    fn one_cut_per_congestion_episode() {
        let l = limiter(&AimdConfig {
            tolerated_pushback: 0.0,
            ..AimdConfig::default()
        });
        let send = || {
            let seen = l.take().expect("a slot");
            Permit::new(Arc::clone(&l), seen)
        };
        // Eight requests sent in the same episode, all answered 429: one cut, not eight.
        let sent: Vec<Permit> = (0..8).map(|_| send()).collect();
        for p in &sent {
            p.on_outcome(Outcome::RateLimited { retry_after: None });
        }
        assert!((l.limit() - 4.0).abs() < 1e-12, "{}", l.limit());
        // A request sent after the cut opens the next episode.
        drop(sent.into_iter().skip(1).collect::<Vec<_>>());
        send().on_outcome(Outcome::RateLimited { retry_after: None });
        assert!((l.limit() - 2.0).abs() < 1e-12, "{}", l.limit());
        assert_eq!(l.inflight(), 0);
    }

    #[test]
    fn pushback_under_the_tolerated_share_keeps_the_limit_and_above_it_cuts() {
        let l = limiter(&AimdConfig {
            tolerated_pushback: 0.3,
            ..AimdConfig::default()
        });
        let rl = Outcome::RateLimited { retry_after: None };
        // One 429 in four outcomes (share ~0.25 at equilibrium): the limit only grows.
        for _ in 0..200 {
            l.on_outcome(l.episode(), rl);
            for _ in 0..3 {
                l.on_outcome(l.episode(), Outcome::Success);
            }
        }
        assert!(l.limit() > 8.0, "no cut under the tolerated share: {}", l.limit());
        let grown = l.limit();
        // Then a storm: once the share passes 0.3, each episode cuts.
        for _ in 0..40 {
            l.on_outcome(l.episode(), rl);
        }
        assert!(l.limit() < grown / 4.0, "{} vs {grown}", l.limit());
        // Validation names the field.
        let bad = AimdConfig {
            tolerated_pushback: 1.0,
            ..AimdConfig::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("tolerated_pushback")
        );
    }

    #[test]
    fn initial_above_ceiling_starts_at_ceiling() {
        let l = limiter(&AimdConfig {
            max_concurrency: Some(3),
            ..AimdConfig::default()
        });
        assert!((l.limit() - 3.0).abs() < 1e-12);
    }

    #[test]
    fn admits_floor_of_limit() {
        let l = limiter(&AimdConfig {
            initial_limit: 2.9,
            ..AimdConfig::default()
        });
        assert!(l.try_acquire());
        assert!(l.try_acquire());
        assert!(l.acquire_or_mark().is_none());
        assert_eq!(l.inflight(), 2);
        l.release();
        assert!(l.try_acquire());
        l.release();
        l.release();
        assert_eq!(l.inflight(), 0);
    }

    /// A refusal counted after a slot was taken but before its permit was made (on
    /// another thread) is one counted while it was held: the slot given back unused
    /// answers it. Before, the permit read the count when it was made, took the
    /// refusal for an old one, and the refused waiter slept with the slot free.
    #[test]
    fn a_refusal_between_the_slot_and_its_permit_is_answered_by_the_unused_slot() {
        use futures_util::FutureExt;
        let l = limiter(&AimdConfig {
            initial_limit: 1.0,
            ..AimdConfig::default()
        });
        let seen = l.take().expect("the one slot");
        let mut waiter = Box::pin(Arc::clone(l.signal()).notified_owned());
        waiter.as_mut().enable();
        assert!(l.acquire_or_mark().is_none(), "refused: the slot is taken");
        Permit::new(Arc::clone(&l), seen).unused();
        assert_eq!(l.inflight(), 0);
        assert!(waiter.now_or_never().is_some(), "the refused waiter is woken");
    }

    #[tokio::test(start_paused = true)]
    async fn release_after_refusal_fires_the_signal() {
        let l = limiter(&AimdConfig {
            initial_limit: 1.0,
            ..AimdConfig::default()
        });
        assert!(l.try_acquire());
        let notified = Arc::clone(l.signal()).notified_owned();
        let mut notified = Box::pin(notified);
        notified.as_mut().enable();
        assert!(l.acquire_or_mark().is_none());
        l.release();
        // Completes at once: the release saw the mark.
        tokio::time::timeout(std::time::Duration::from_secs(1), notified)
            .await
            .expect("signal fired");
    }
}
