//! Configuration and the named defaults.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

use crate::error::ConfigError;

/// Smoothing factor of the per-source success EWMA: 0.2, so about 10 successes bring a
/// source from 0 back to 0.9 (the climb is the recovering source's slow start).
pub const HEALTH_ALPHA: f64 = 0.2;

/// Starting health of a new source: 1.0, optimistic: fully healthy until its outcomes
/// say otherwise.
pub const HEALTH_INITIAL: f64 = 1.0;

/// Floor of the health in the score `max(ewma, 0.05) / ((1 + inflight) x latency)`: keeps a little
/// exploration traffic on a bad source so it can recover.
pub const HEALTH_FLOOR: f64 = 0.05;

/// How many call shapes ("classes") a source keeps a separate health EWMA for: 4.
///
/// A source can serve one shape of call and fail another: in the P6 pool, `s5` answers
/// short calls but its slow stream is cut by the watchdog 90% of the time. One EWMA
/// per source averages the two and keeps sending streams there; one per (source,
/// class) learns each. The inflight count stays per source (it measures load, whatever
/// the shape). Class 0 is the default; see [`HealthP2c::with_class`](crate::HealthP2c::with_class).
pub const HEALTH_CLASSES: usize = 4;

/// In-call failures after which a source goes to the tail of the order, when a credible
/// alternative exists: 2. One failure of a healthy source is usually transient, so one
/// does not move it.
pub const DEPRIORITIZE_AFTER_FAILURES: u32 = 2;

/// How long a source that refused a request as too large for it (a context window:
/// `context_length_exceeded`) is not offered requests of that size or more first: 10
/// minutes. It stays a last resort for them (tried only once every other source failed
/// or cannot admit), and after this a request that large is offered again: a provider
/// that raised its window gets them back at the cost of one refusal per 10 minutes.
/// Sizes come from [`ClassOf::size_of`](crate::ClassOf::size_of); a success of a size
/// lifts the mark for every size up to it.
pub const OVERSIZE_MEMORY: Duration = Duration::from_secs(600);

/// What an unmeasured source (no successful answer yet) counts as answering in, in the
/// score's latency term: 1 s. LLM calls take seconds, so a new source is tried early
/// without drawing a whole burst of calls on no evidence.
pub const UNMEASURED_LATENCY_S: f64 = 1.0;

/// The least latency the score counts: 1 ms (a measured 0 must not divide by zero).
pub const MIN_LATENCY_S: f64 = 0.001;

/// A source not yet failed in this call is a credible alternative when its health is
/// at least this share of the failed source's. Without this bar, a healthy source that
/// failed twice gave the call's next attempt to a source that succeeded 10% of the time.
pub const CREDIBLE_HEALTH_RATIO: f64 = 0.5;

/// A source is poor for a class, and no fallback for a wait, when its health is below
/// this share of the best health among the sources refused as over a quota that ends
/// within `max_wait` ([`DEFAULT_MAX_WAIT`]) in the same round: 0.25. When a call's wait
/// for a credible source ends, the sources held back go next, but not the poor ones
/// while a source that answers four times as often is over such a quota: the call
/// returns that quota's refusal and waits for its end (a retry layer above waits it
/// out; `tower-retry-pushback` bounds that wait). A longer quota (an account out of
/// credit, held for minutes) leaves the poor source its attempt. In the P6 pool,
/// streams released after a 30 s wait went to the source whose watchdog cuts nine
/// streams in ten; each of them spent one of the call's attempts and the shared
/// account's quota on it.
pub const POOR_HEALTH_RATIO: f64 = 0.25;

/// Default bound on how long a call waits when no source is admitted. The retry
/// layer's stall guard usually decides earlier; this keeps the balancer alone
/// from waiting forever.
pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(30);

/// While every source is paced, re-check at least this often even without a release
/// signal (a gate that does not fire one must not stall a call until `max_wait`): 1 s.
/// The release signal wakes waiters when a slot frees; the poll is only the safety
/// net. At 100 ms, 64 waiting callers re-ran their rounds 640 times a second: the P6
/// soak's pgw profile spent 18.3 s of CPU against naive's 2.7 s; at 1 s, 4.9 s, with
/// success 99.55% -> 99.61% and goodput 30.0 -> 30.6 ok/min.
pub const DEFAULT_PACED_POLL: Duration = Duration::from_millis(1000);

/// How long a source with attempts in flight may answer nothing before it is silent
/// (slow-call detection): 60 s. A black hole accepts and never answers, so each
/// attempt holds a caller for the whole attempt timeout (180 s in P6) while the
/// breaker sees nothing; a busy healthy source answers something far more often (P6's
/// slowest healthy answers take about a minute, but with many in flight one ends every
/// few seconds). A streamed attempt counts as an answer at its first chunk.
pub const DEFAULT_SILENT_AFTER: Duration = Duration::from_secs(60);

/// An attempt in flight to a silent source is cut ([`BalanceConfig::cut_silent`]) only
/// once it has run for at least this many times the source's latency EWMA (and for
/// `silent_after`): 4. A source whose answers take long is given as long before its
/// silence ends an attempt; one that answers in seconds, `silent_after`.
pub const CUT_LATENCY_FACTOR: f64 = 4.0;

/// How often a silent source is probed off the caller's path
/// ([`BalanceConfig::probe_every`]): 10 s, so traffic returns to a black hole that
/// heals within about 10 s plus its time to answer. A probe
/// into the silence hangs until its attempt timeout; the gates below (AIMD's limit)
/// bound how many hang at once.
pub const DEFAULT_PROBE_EVERY: Duration = Duration::from_secs(10);

/// Timeouts in a row, with no answer between them, after which a source is silent
/// even with nothing in flight: 3, a call's default attempts. A timeout may be a slow
/// answer (a long generation past the attempt timeout), and one call alone on a slow
/// source may retry it to its last attempt; more timeouts than one call makes, with
/// nothing heard, is silence (a black hole's concurrent attempts time out together).
/// Such a source is probed (see [`BalanceConfig::probe_every`]) until it answers.
pub const SILENT_TIMEOUTS: u32 = 3;

/// The shortest wait after a round in which no source admitted, whatever `retry_after`
/// the gates said: 10 ms, so a gate answering `retry_after = 0` cannot make a call spin
/// (the same floor as tower-retry-pushback's `MIN_NOT_ADMITTED_WAIT`).
pub const MIN_WAKE_WAIT: Duration = Duration::from_millis(10);

/// How many distinct random sources the health-aware policy compares for an attempt's
/// first candidate: 2, the power of two choices (the design's H3).
///
/// Two spreads traffic over a pool whose sources are alike and hedges against a health
/// that lags (a source that just went bad still looks good for a few calls). Over a
/// pool of unlike sources it leaves goodput behind: with two of eight drawn, more than
/// half the draws hold neither of the two fast sources. See
/// [`BalanceConfig::choices`] for the measured trade.
pub const DEFAULT_CHOICES: usize = 2;

/// [`BalanceConfig::choices`] that compares every source: the best-ranked of all (of
/// equal ranks, a random one). Any value at or above the number of sources does the
/// same.
pub const CHOICES_ALL: usize = usize::MAX;

/// How sources are ordered for each attempt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Power of two choices (or of [`BalanceConfig::choices`]) on `max(ewma, 0.05) /
    /// ((1 + inflight) x latency)`, then the rest by descending score. The default.
    #[default]
    HealthAware,
    /// A shared cursor: each call starts one source further.
    RoundRobin,
    /// Fewest attempts in flight first.
    LeastInflight,
}

impl Policy {
    /// The policy's name in config: `health_aware`, `round_robin`, `least_inflight`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::HealthAware => "health_aware",
            Self::RoundRobin => "round_robin",
            Self::LeastInflight => "least_inflight",
        }
    }

    /// Whether the policy has a health view (the others deprioritize a source that
    /// failed in this call unconditionally, with no credible-alternative check).
    #[must_use]
    pub const fn has_health_view(self) -> bool {
        matches!(self, Self::HealthAware)
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Policy {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "health_aware" => Ok(Self::HealthAware),
            "round_robin" => Ok(Self::RoundRobin),
            "least_inflight" => Ok(Self::LeastInflight),
            _ => Err(crate::error::config_error(
                "policy",
                "must be one of health_aware, round_robin, least_inflight",
            )),
        }
    }
}

/// Balancer settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BalanceConfig {
    /// Ordering policy (default [`Policy::HealthAware`]).
    pub policy: Policy,
    /// How many distinct random sources [`Policy::HealthAware`] compares for an
    /// attempt's first candidate, the best-ranked going first (default
    /// [`DEFAULT_CHOICES`], 2; at least 2; [`CHOICES_ALL`] or any value at or above the
    /// number of sources compares every one). The rest of the order is by descending
    /// score whatever this is.
    ///
    /// More choices put more of the traffic on the best-scored sources: better goodput
    /// over unlike sources, a little worse where the best source keeps going bad. The
    /// soak, pgw's goodput against the oracle's, mean over 30 seeds (12 for P6), the
    /// worst seed and how many seeds fell under x0.80:
    ///
    /// | choices | mixed-8-sources | flapping | P6 |
    /// |---|---|---|---|
    /// | 2 | x0.83, x0.72, 6 | x0.90, x0.84, 0 | x0.87, x0.85, 0 |
    /// | 4 | x0.84, x0.77, 3 | x0.90, x0.81, 0 | - |
    /// | all | x0.86, x0.79, 1 | x0.90, x0.81, 0 | x0.88, x0.85, 0 |
    ///
    /// pgw-stack's gateway compares all of them by default. Each balancer ranks by its
    /// own view (its calls in flight, its health and latency averages): balancers in
    /// several processes, each comparing every source, may all favour the same one,
    /// which only its gates then hold back; two random draws spread them.
    pub choices: usize,
    /// Longest wait of one call when no source is admitted (default
    /// [`DEFAULT_MAX_WAIT`]), counted from the call's first wait (a source whose
    /// `poll_ready` is pending, or a round every source refused); zero fails at once
    /// rather than wait on any source. A call whose history carries a
    /// sooner deadline ([`pgw_core::CallHistory::deadline`]) waits only until then.
    pub max_wait: Duration,
    /// Re-check interval while sources are paced (default [`DEFAULT_PACED_POLL`], at
    /// least [`MIN_WAKE_WAIT`]);
    /// also the longest wait on one source whose `poll_ready` is `Pending` before the
    /// round goes on to the others (counted as [`pgw_core::Paced`]).
    pub paced_poll: Duration,
    /// A source with attempts in flight that has answered nothing for this long is
    /// silent: it is not dispatched to (refused as open, with this as `retry_after`)
    /// until its attempts end (default [`DEFAULT_SILENT_AFTER`]); `None` turns it off.
    pub silent_after: Option<Duration>,
    /// How often a silent source is probed off the caller's path (default
    /// [`DEFAULT_PROBE_EVERY`]). A source whose last [`SILENT_TIMEOUTS`] attempts timed
    /// out with nothing heard is refused to every call (as open, `silent_after` as
    /// `retry_after`); a call that finds it so starts a detached probe there, a copy of
    /// its request on a spawned task, when the last one started this long ago or more.
    /// The probe's answer feeds the source's health and silence and is then dropped:
    /// no caller waits an attempt timeout on a black hole, and the first answer after
    /// it heals ends the silence. `None`: such a source is probed by the next fresh
    /// call itself (one that has not failed yet), which waits for its answer. Needs a
    /// tokio runtime (the balancer already runs on tokio's clock).
    pub probe_every: Option<Duration>,
    /// Slow-call detection also ends attempts already in flight (default `true`): an
    /// attempt to a silent source (nothing heard for `silent_after` while attempts
    /// were in flight) that has itself run for `silent_after` and for
    /// [`CUT_LATENCY_FACTOR`] times the source's latency EWMA is cut with
    /// [`SilentCut`](crate::SilentCut), a timeout, so the call's next attempt goes
    /// elsewhere instead of waiting out the attempt timeout on a black hole. An attempt
    /// whose answer has begun (a stream's first chunk) is never cut, nor one to a
    /// source that has not answered a success yet (nothing says how long its answers
    /// take: a first long generation is not a black hole). Needs `silent_after`;
    /// `false` leaves attempts to their own timeouts.
    ///
    /// An attempt the source looks to have swallowed is cut at the same age
    /// (`silent_after` and [`CUT_LATENCY_FACTOR`] times the latency EWMA) even though the
    /// source is no longer silent: attempts to the source timed out after it was sent,
    /// and the source then answered one sent after it. That is a black hole that took
    /// the request and healed; once the source answers again it is not silent, and the
    /// attempt used to wait out its whole attempt timeout (180 s on the soak's flapping
    /// pool, often the last call of the run). An attempt merely overtaken by shorter
    /// ones, with no timeout since it was sent, is a long answer and is left alone.
    ///
    /// The trade: a source that is not silent but answers one call far slower than
    /// usual, with nothing else of its traffic answered meanwhile, may have that call
    /// cut (and retried elsewhere) after `silent_after`. On the soak's flapping pool
    /// (a black hole 30% of every five minutes) goodput over seeds 0-9 went from
    /// x0.72-0.86 to x0.83-0.88 of the oracle's, with success as before.
    pub cut_silent: bool,
}

impl Default for BalanceConfig {
    fn default() -> Self {
        Self {
            policy: Policy::HealthAware,
            choices: DEFAULT_CHOICES,
            max_wait: DEFAULT_MAX_WAIT,
            paced_poll: DEFAULT_PACED_POLL,
            silent_after: Some(DEFAULT_SILENT_AFTER),
            probe_every: Some(DEFAULT_PROBE_EVERY),
            cut_silent: true,
        }
    }
}

impl BalanceConfig {
    /// Checks every field.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.choices < 2 {
            return Err(crate::error::config_error(
                "choices",
                format!(
                    "must be at least 2 (got {}): one draw is a random source, blind to health and load",
                    self.choices
                ),
            ));
        }
        if self.probe_every.is_some_and(|d| d.is_zero()) {
            return Err(crate::error::config_error(
                "probe_every",
                "must be greater than zero (or None to probe with a caller's call)",
            ));
        }
        if self.silent_after.is_some_and(|d| d.is_zero()) {
            return Err(crate::error::config_error(
                "silent_after",
                "must be greater than zero (or None to turn it off)",
            ));
        }
        if self.paced_poll < MIN_WAKE_WAIT {
            return Err(crate::error::config_error(
                "paced_poll",
                format!(
                    "must be at least {MIN_WAKE_WAIT:?} (got {:?}): shorter re-runs a waiting call's round on every timer tick",
                    self.paced_poll
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_names_roundtrip_and_bad_names_name_the_field() {
        for p in [Policy::HealthAware, Policy::RoundRobin, Policy::LeastInflight] {
            assert_eq!(p.as_str().parse::<Policy>().unwrap(), p);
        }
        let err = "p2c".parse::<Policy>().unwrap_err();
        assert_eq!(err.field(), "policy");
        assert!(err.to_string().contains("policy"), "{err}");
        for paced_poll in [Duration::ZERO, Duration::from_micros(1)] {
            let bad = BalanceConfig {
                paced_poll,
                ..BalanceConfig::default()
            };
            assert_eq!(bad.validate().unwrap_err().field(), "paced_poll");
        }
        let floor = BalanceConfig {
            paced_poll: MIN_WAKE_WAIT,
            ..BalanceConfig::default()
        };
        assert!(floor.validate().is_ok());
        for choices in [0, 1] {
            let bad = BalanceConfig {
                choices,
                ..BalanceConfig::default()
            };
            assert_eq!(bad.validate().unwrap_err().field(), "choices");
        }
        for choices in [2, 3, CHOICES_ALL] {
            let ok = BalanceConfig {
                choices,
                ..BalanceConfig::default()
            };
            assert!(ok.validate().is_ok(), "{choices}");
        }
    }
}
