//! The breaker's state machine, on plain numbers (milliseconds on the backend's clock).
//!
//! The memory backend runs this code under a short-held lock; `lua/*.lua` is the same
//! machine written for Redis, field for field (the rate window's
//! `win_id, a0, f0, a1, f1` included), so the one contract suite holds both to the same
//! behaviour.

use std::time::Duration;

use pgw_core::BreakerVerdict;

use crate::config::BreakerConfig;

/// Milliseconds on the backend's clock (tokio's for memory, `TIME` for Redis).
pub(crate) type Ms = u64;

/// The numbers the state machine needs from a [`BreakerConfig`], in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Params {
    /// Effective consecutive threshold: `max(fail_threshold, 2 * max_concurrency)`.
    pub(crate) threshold: u32,
    pub(crate) min_calls: u32,
    pub(crate) fail_rate: f64,
    /// One bucket: half the window.
    pub(crate) half_window: Ms,
    pub(crate) cooldown: Ms,
    pub(crate) max_cooldown: Ms,
    pub(crate) probe_ttl: Ms,
    /// TTL of the Redis hash, set on every state change and renewed by a record once
    /// less than half of it is left.
    pub(crate) key_ttl: Ms,
}

impl Params {
    pub(crate) fn of(config: &BreakerConfig) -> Self {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let max_cooldown = ms(config.max_cooldown());
        let longest = max_cooldown.max(ms(config.window())).max(ms(config.probe_ttl()));
        Self {
            threshold: config.effective_threshold(),
            min_calls: config.min_calls(),
            fail_rate: config.fail_rate(),
            half_window: (ms(config.window()) / 2).max(1),
            cooldown: ms(config.cooldown()),
            max_cooldown,
            probe_ttl: ms(config.probe_ttl()),
            // Long enough to outlive any open period and the streak's decay period
            // (2 x max cooldown), so only a source idle that long forgets its state.
            key_ttl: longest.saturating_mul(4),
        }
    }

    /// The rate channel's test: `calls >= min_calls` and `fails / calls >= fail_rate`.
    ///
    /// The rate is divided, not `fails >= fail_rate * calls`: a rate exactly at the bar
    /// (7 of 25 against 0.28) must open, and the product rounds above it
    /// (`0.28 * 25 = 7.000000000000001`). `record.lua` computes the same quotient.
    pub(crate) fn rate_opens(&self, calls: u32, fails: u32) -> bool {
        calls >= self.min_calls && calls > 0 && f64::from(fails) / f64::from(calls) >= self.fail_rate
    }

    /// Open duration for a streak: `cooldown * 2^(streak-1)`, capped; a streak of
    /// 0 (a consecutive-channel open on a fresh source) opens for one cooldown.
    pub(crate) fn open_for(&self, streak: u32) -> Ms {
        let exp = streak.max(1) - 1;
        let factor = 1u64 << exp.min(40);
        self.cooldown.saturating_mul(factor).min(self.max_cooldown)
    }
}

/// What an admission carries to its record: the epoch it was admitted under and,
/// for a half-open probe, the lease id (`0` when it is not a probe).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket {
    epoch: u64,
    probe: u64,
}

impl Ticket {
    /// A ticket for `epoch`; `probe` is the lease id of a half-open probe, `0` otherwise.
    #[must_use]
    pub const fn new(epoch: u64, probe: u64) -> Self {
        Self { epoch, probe }
    }

    /// The epoch the call was admitted under.
    #[must_use]
    pub const fn epoch(self) -> u64 {
        self.epoch
    }

    /// The probe lease id, `0` when the call is not a probe.
    #[must_use]
    pub const fn probe(self) -> u64 {
        self.probe
    }

    /// Whether the call is the half-open probe.
    #[must_use]
    pub const fn is_probe(self) -> bool {
        self.probe != 0
    }
}

/// What a record did; returned by both backends for tests and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Effect {
    /// An ended lease, or an ignored outcome: nothing changed.
    Nothing = 0,
    /// Counters changed, the state did not.
    Counted = 1,
    /// The breaker opened (or re-opened after a failed probe).
    Opened = 2,
    /// A probe succeeded: the breaker closed.
    Closed = 3,
    /// The ticket's epoch is over (the breaker opened or closed since its admission):
    /// nothing changed.
    Stale = 4,
}

impl Effect {
    #[cfg(feature = "redis")]
    pub(crate) fn from_code(code: i64) -> Self {
        match code {
            1 => Self::Counted,
            2 => Self::Opened,
            3 => Self::Closed,
            4 => Self::Stale,
            _ => Self::Nothing,
        }
    }
}

/// The state of one source's gate (the Redis hash, field for field).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct GateState {
    pub(crate) open: bool,
    pub(crate) epoch: u64,
    pub(crate) open_until: Ms,
    /// The last probe lease issued (monotonic).
    pub(crate) probe_id: u64,
    /// When the current lease expires; `0` when no lease is held.
    pub(crate) probe_until: Ms,
    /// Consecutive failures, pinned to the threshold by a rate-channel open.
    pub(crate) failures: u32,
    pub(crate) win_id: u64,
    /// Attempts per bucket (`a0`, `a1`), the bucket being `win_id % 2`.
    pub(crate) a: [u32; 2],
    /// Failures per bucket (`f0`, `f1`).
    pub(crate) f: [u32; 2],
    pub(crate) streak: u32,
    /// When a probe last closed the breaker; `0` when it has not since the last open.
    pub(crate) closed_since: Ms,
}

impl GateState {
    /// Admission: `Ok(ticket)` or `Err(retry_after)`; when open and due, one probe at a
    /// time under a lease (an expired lease is re-issued).
    pub(crate) fn admit(&mut self, now: Ms, p: &Params) -> Result<Ticket, Ms> {
        if !self.open {
            return Ok(Ticket::new(self.epoch, 0));
        }
        if now < self.open_until {
            return Err(self.open_until - now);
        }
        if self.probe_until != 0 && now < self.probe_until {
            // A probe is out; its verdict decides. Ask again within one cooldown at most.
            return Err((self.probe_until - now).min(p.cooldown));
        }
        // No lease, or the last one expired (a lost probe): issue a new one.
        self.probe_id += 1;
        self.probe_until = now.saturating_add(p.probe_ttl);
        Ok(Ticket::new(self.epoch, self.probe_id))
    }

    /// Records the verdict of a call admitted with `ticket`; a stale epoch changes nothing.
    pub(crate) fn record(&mut self, ticket: Ticket, verdict: BreakerVerdict, now: Ms, p: &Params) -> Effect {
        if ticket.epoch != self.epoch {
            return Effect::Stale;
        }
        if ticket.is_probe() {
            if !self.open {
                return Effect::Nothing;
            }
            let current = ticket.probe == self.probe_id && self.probe_until != 0;
            // An earlier probe of this open period, whose lease expired and was
            // issued again (an answer or a stream that outlived `probe_ttl`): its
            // success still shows the source answers, so it closes; any other verdict
            // is the current probe's to give. Else a source whose answers all take
            // longer than the lease would never close while calls keep coming.
            let late_success = verdict == BreakerVerdict::Success && ticket.probe <= self.probe_id;
            if !(current || late_success) {
                return Effect::Nothing;
            }
            return match verdict {
                BreakerVerdict::Success => {
                    self.close(now);
                    Effect::Closed
                }
                BreakerVerdict::ForceOpen => {
                    // A dead source's probe (B7): the streak grows.
                    self.streak = self.streak.saturating_add(1);
                    self.trip(now, p);
                    Effect::Opened
                }
                BreakerVerdict::Failure => {
                    // A transient failure does not grow it: probed again after one open
                    // period, so a source back from an outage is seen within it.
                    self.trip(now, p);
                    Effect::Opened
                }
                BreakerVerdict::Ignore => {
                    // B3: no verdict; the next admission may probe at once.
                    self.probe_until = 0;
                    self.open_until = now;
                    Effect::Counted
                }
            };
        }
        if self.open {
            return Effect::Nothing;
        }
        match verdict {
            BreakerVerdict::Ignore => Effect::Nothing,
            BreakerVerdict::Success => {
                self.failures = 0;
                self.count(now, p, false);
                if self.streak > 0
                    && self.closed_since != 0
                    && now.saturating_sub(self.closed_since) >= p.open_for(self.streak).saturating_mul(2)
                {
                    self.streak = 0;
                }
                Effect::Counted
            }
            BreakerVerdict::ForceOpen => {
                self.failures = self.failures.saturating_add(1);
                self.count(now, p, true);
                self.streak = self.streak.saturating_add(1);
                self.trip(now, p);
                Effect::Opened
            }
            BreakerVerdict::Failure => {
                self.failures = self.failures.saturating_add(1);
                let (calls, fails) = self.count(now, p, true);
                if p.rate_opens(calls, fails) {
                    // Rate channel (B5): pins the count (B9); transient failures do not
                    // grow the streak (B7).
                    self.failures = p.threshold;
                    self.trip(now, p);
                    Effect::Opened
                } else if self.failures >= p.threshold && calls < p.min_calls {
                    // Consecutive channel (B4), unless the window holds enough evidence
                    // of health (B8: calls >= min_calls with a rate below fail_rate).
                    self.trip(now, p);
                    Effect::Opened
                } else {
                    Effect::Counted
                }
            }
        }
    }

    fn trip(&mut self, now: Ms, p: &Params) {
        self.open = true;
        self.epoch += 1;
        self.open_until = now.saturating_add(p.open_for(self.streak));
        self.probe_until = 0;
        self.closed_since = 0;
    }

    fn close(&mut self, now: Ms) {
        self.open = false;
        self.epoch += 1;
        self.probe_until = 0;
        self.failures = 0;
        self.a = [0; 2];
        self.f = [0; 2];
        self.closed_since = now;
    }

    /// Rotates the buckets to `now` and counts one attempt; returns the window totals.
    fn count(&mut self, now: Ms, p: &Params, failed: bool) -> (u32, u32) {
        let w = now / p.half_window;
        if w > self.win_id {
            if w == self.win_id + 1 {
                let b = (w % 2) as usize;
                self.a[b] = 0;
                self.f[b] = 0;
            } else {
                self.a = [0; 2];
                self.f = [0; 2];
            }
            self.win_id = w;
        }
        let b = (self.win_id % 2) as usize;
        self.a[b] = self.a[b].saturating_add(1);
        if failed {
            self.f[b] = self.f[b].saturating_add(1);
        }
        self.totals()
    }

    /// Both buckets together (saturating: the counts may come from a Redis hash).
    fn totals(&self) -> (u32, u32) {
        (
            self.a[0].saturating_add(self.a[1]),
            self.f[0].saturating_add(self.f[1]),
        )
    }

    /// The window totals as of `now`, without writing.
    fn window(&self, now: Ms, p: &Params) -> (u32, u32) {
        let w = now / p.half_window;
        if w <= self.win_id {
            self.totals()
        } else if w == self.win_id + 1 {
            let b = (self.win_id % 2) as usize;
            (self.a[b], self.f[b])
        } else {
            (0, 0)
        }
    }

    /// The operator's view as of `now`.
    pub(crate) fn view(&self, now: Ms, p: &Params) -> BreakerView {
        let (window_calls, window_failures) = self.window(now, p);
        let state = if !self.open {
            BreakerState::Closed
        } else if now < self.open_until {
            BreakerState::Open
        } else {
            BreakerState::HalfOpen
        };
        BreakerView {
            state,
            epoch: self.epoch,
            retry_after: Duration::from_millis(self.open_until.saturating_sub(now)),
            streak: self.streak,
            failures: self.failures,
            window_calls,
            window_failures,
            probe_in_flight: self.open && self.probe_until != 0 && now < self.probe_until,
            record_errors: 0,
        }
    }
}

/// Where a breaker stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BreakerState {
    /// Calls are admitted and counted.
    Closed,
    /// Nothing is admitted until `open_until`.
    Open,
    /// The cooldown is over: one probe at a time is admitted under a lease.
    HalfOpen,
}

impl BreakerState {
    /// `closed`, `open` or `half_open`, as used in metrics.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }
}

/// A snapshot of one source's breaker, for operators and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BreakerView {
    /// Closed, open or half-open.
    pub state: BreakerState,
    /// Incremented on every open and close transition; outcomes admitted under an older
    /// epoch are ignored.
    pub epoch: u64,
    /// Time left until `open_until` (zero when closed or half-open).
    pub retry_after: Duration,
    /// The open streak that scales the open duration (`cooldown * 2^(streak - 1)`).
    pub streak: u32,
    /// The consecutive failure count (pinned to the threshold by a rate-channel open).
    pub failures: u32,
    /// Attempts in the rate window.
    pub window_calls: u32,
    /// Failures in the rate window.
    pub window_failures: u32,
    /// Whether a half-open probe holds an unexpired lease.
    pub probe_in_flight: bool,
    /// Records this process could not deliver to the backend (logged, never returned);
    /// process-local.
    pub record_errors: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn params() -> Params {
        Params::of(
            &BreakerConfig::builder()
                .fail_threshold(3)
                .cooldown(Duration::from_secs(1))
                .max_cooldown(Duration::from_secs(8))
                .build()
                .unwrap(),
        )
    }

    #[test]
    fn open_for_doubles_and_caps() {
        let p = params();
        let got: Vec<Ms> = (0..7).map(|s| p.open_for(s)).collect();
        assert_eq!(got, [1000, 1000, 2000, 4000, 8000, 8000, 8000]);
        assert_eq!(p.open_for(u32::MAX), 8000);
    }

    #[test]
    fn buckets_rotate_by_window_id() {
        let p = params(); // window 60 s: buckets of 30 s
        let mut g = GateState::default();
        assert_eq!(g.count(0, &p, true), (1, 1));
        assert_eq!(g.count(29_999, &p, false), (2, 1));
        // next bucket: the previous one still counts
        assert_eq!(g.count(30_000, &p, false), (3, 1));
        assert_eq!(g.window(59_999, &p), (3, 1));
        // the bucket two back is gone
        assert_eq!(g.window(60_000, &p), (1, 0));
        assert_eq!(g.count(60_000, &p, true), (2, 1));
        // a jump of several windows clears both
        assert_eq!(g.count(600_000, &p, false), (1, 0));
        // a clock going backwards writes into the current bucket
        assert_eq!(g.count(500_000, &p, false), (2, 0));
    }

    proptest! {
        /// Whatever happens, a stale ticket changes nothing, and the epoch only moves
        /// on transitions.
        #[test]
        fn stale_tickets_change_nothing(ops in proptest::collection::vec((0u8..6, 0u64..5000), 1..200)) {
            let p = params();
            let mut g = GateState::default();
            let mut now = 0;
            let mut tickets = vec![];
            for (op, dt) in ops {
                now += dt;
                let verdict = match op {
                    0 => BreakerVerdict::Success,
                    1 | 2 => BreakerVerdict::Failure,
                    3 => BreakerVerdict::Ignore,
                    4 => BreakerVerdict::ForceOpen,
                    _ => {
                        if let Ok(t) = g.admit(now, &p) { tickets.push(t); }
                        continue;
                    }
                };
                if let Some(t) = tickets.pop() {
                    let before = g.clone();
                    let was_open = g.open;
                    let effect = g.record(t, verdict, now, &p);
                    if t.epoch() != before.epoch {
                        prop_assert_eq!(&g, &before);
                    }
                    match effect {
                        Effect::Opened | Effect::Closed => {
                            prop_assert_eq!(g.epoch, before.epoch + 1);
                            prop_assert_eq!(g.open, effect == Effect::Opened);
                            prop_assert!(effect == Effect::Closed || g.open_until > now || p.open_for(g.streak) == 0);
                        }
                        Effect::Nothing | Effect::Counted | Effect::Stale => {
                            prop_assert_eq!(g.epoch, before.epoch);
                            prop_assert_eq!(g.open, was_open);
                        }
                    }
                }
            }
        }
    }
}
