//! Hard provider limits: exact RPM/TPM token buckets and a concurrency cap per scope
//! (a key or an account), the 429 they send and the `x-ratelimit-*` headers.
//!
//! Buckets count in integers (scenario nanoseconds, and tokens times nanoseconds per
//! minute), so the wait they announce is exact: a request arriving at the announced
//! instant passes, one a nanosecond earlier does not.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::config::HardLimits;

/// Nanoseconds per minute: a bucket of limit `L` refills `L` units per nanosecond and
/// one token is this many units, so it refills `L` tokens per minute exactly.
const NS_PER_MIN: u128 = 60_000_000_000;

/// Scenario time, nanoseconds since the pool's start.
pub(crate) type Nanos = u128;

/// An RPM or TPM bucket: `limit` tokens of capacity, refilled at `limit / 60` per second.
#[derive(Debug)]
struct Bucket {
    /// Tokens times [`NS_PER_MIN`].
    level: u128,
    at: Nanos,
}

impl Bucket {
    fn full(limit: u64, now: Nanos) -> Self {
        Self {
            level: u128::from(limit) * NS_PER_MIN,
            at: now,
        }
    }

    fn refill(&mut self, limit: u64, now: Nanos) {
        let cap = u128::from(limit) * NS_PER_MIN;
        let gained = now.saturating_sub(self.at).saturating_mul(u128::from(limit));
        self.level = self.level.saturating_add(gained).min(cap);
        self.at = self.at.max(now);
    }

    /// Scenario nanoseconds until `cost` tokens are in the bucket (0: now).
    fn wait_for(&self, limit: u64, cost: u64) -> Nanos {
        let need = u128::from(cost) * NS_PER_MIN;
        need.saturating_sub(self.level).div_ceil(u128::from(limit))
    }

    fn take(&mut self, cost: u64) {
        self.level = self.level.saturating_sub(u128::from(cost) * NS_PER_MIN);
    }

    fn remaining(&self) -> u64 {
        u64::try_from(self.level / NS_PER_MIN).unwrap_or(u64::MAX)
    }

    /// Scenario nanoseconds until the bucket is full again.
    fn reset(&self, limit: u64) -> Nanos {
        (u128::from(limit) * NS_PER_MIN)
            .saturating_sub(self.level)
            .div_ceil(u128::from(limit))
    }
}

/// The limit state of one scope.
#[derive(Debug, Default)]
pub(crate) struct ScopeState {
    rpm: Option<Bucket>,
    tpm: Option<Bucket>,
    /// Admitted requests in flight, by ticket, with their planned end (`None`: unknown,
    /// e.g. a black hole, or not built yet).
    inflight: BTreeMap<u64, Option<Instant>>,
}

impl ScopeState {
    /// Brings the buckets to `now` under `limits` (a bucket appears full when its limit
    /// is set and disappears when it is lifted).
    fn sync(&mut self, limits: HardLimits, now: Nanos) {
        for (slot, limit) in [(&mut self.rpm, limits.rpm), (&mut self.tpm, limits.tpm)] {
            match limit {
                None => *slot = None,
                Some(l) => slot.get_or_insert_with(|| Bucket::full(l, now)).refill(l, now),
            }
        }
    }

    pub(crate) fn enter(&mut self, ticket: u64) {
        self.inflight.insert(ticket, None);
    }

    pub(crate) fn planned_end(&mut self, ticket: u64, end: Instant) {
        if let Some(e) = self.inflight.get_mut(&ticket) {
            *e = Some(end);
        }
    }

    pub(crate) fn leave(&mut self, ticket: u64) {
        self.inflight.remove(&ticket);
    }
}

/// Which scope a limit belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scope {
    /// The source's own key (`in project <source>`).
    Key,
    /// The account over all its sources (`in organization <account>`).
    Account,
}

/// What a limit counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dimension {
    Requests,
    Tokens,
    Concurrency,
}

/// Why a request was refused by a hard limit.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Refusal {
    pub(crate) scope: Scope,
    pub(crate) dimension: Dimension,
    pub(crate) limit: u64,
    pub(crate) used: u64,
    pub(crate) requested: u64,
    /// The request can never pass (TPM cost above the bucket's capacity).
    pub(crate) too_large: bool,
    /// Scenario time until the request would pass, over every limit it hits (`None`:
    /// unknown, or never).
    pub(crate) wait: Option<Duration>,
}

/// One `x-ratelimit-*` trio, in scenario time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Trio {
    pub(crate) limit: u64,
    pub(crate) remaining: u64,
    pub(crate) reset: Duration,
}

/// The `x-ratelimit-*` headers of the tightest scope.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RateHeaders {
    pub(crate) requests: Option<Trio>,
    pub(crate) tokens: Option<Trio>,
}

fn nanos(d: Nanos) -> Duration {
    let secs = u64::try_from(d / 1_000_000_000).unwrap_or(u64::MAX);
    Duration::new(secs, u32::try_from(d % 1_000_000_000).unwrap_or(0))
}

/// One scope's part of a check: its state, its limits now, and which scope it is.
pub(crate) struct Check<'a> {
    pub(crate) state: &'a mut ScopeState,
    pub(crate) limits: HardLimits,
    pub(crate) scope: Scope,
}

/// Checks a request costing `tokens` against every scope (the key, then the account),
/// all or nothing: an admitted request takes one request and `tokens` from every
/// bucket; a refused one takes nothing. `now_s` is scenario time, `now` the tokio
/// instant (for the in-flight requests' planned ends), `scale` the pool's time scale.
pub(crate) fn check(
    scopes: &mut [Check<'_>],
    now_s: Nanos,
    now: Instant,
    scale: f64,
    tokens: u64,
) -> (Result<(), Refusal>, RateHeaders) {
    for c in scopes.iter_mut() {
        c.state.sync(c.limits, now_s);
    }
    let refusal = refuse(scopes, now, scale, tokens);
    if refusal.is_none() {
        for c in scopes.iter_mut() {
            for (bucket, cost) in [(&mut c.state.rpm, 1), (&mut c.state.tpm, tokens)] {
                if let Some(b) = bucket {
                    b.take(cost);
                }
            }
        }
    }
    (refusal.map_or(Ok(()), Err), headers(scopes))
}

fn refuse(scopes: &[Check<'_>], now: Instant, scale: f64, tokens: u64) -> Option<Refusal> {
    // A request no bucket can ever hold is refused for good, whatever else is full.
    for c in scopes {
        if let Some(l) = c.limits.tpm
            && tokens > l
        {
            return Some(Refusal {
                scope: c.scope,
                dimension: Dimension::Tokens,
                limit: l,
                used: 0,
                requested: tokens,
                too_large: true,
                wait: None,
            });
        }
    }
    let mut first: Option<Refusal> = None;
    // The longest wait over every limit hit; `None` once one of them is unknown.
    let mut wait: Option<Duration> = Some(Duration::ZERO);
    let mut hit = |r: Refusal, w: Option<Duration>| {
        wait = wait.zip(w).map(|(a, b)| a.max(b));
        first.get_or_insert(r);
    };
    for c in scopes {
        if let Some(cap) = c.limits.concurrency
            && c.state.inflight.len() >= cap as usize
        {
            let earliest = c.state.inflight.values().flatten().min().copied();
            let w = earliest.map(|e| e.saturating_duration_since(now).div_f64(scale));
            let r = Refusal {
                scope: c.scope,
                dimension: Dimension::Concurrency,
                limit: u64::from(cap),
                used: c.state.inflight.len() as u64,
                requested: 1,
                too_large: false,
                wait: None,
            };
            hit(r, w);
        }
        for (bucket, limit, cost, dimension) in [
            (&c.state.rpm, c.limits.rpm, 1, Dimension::Requests),
            (&c.state.tpm, c.limits.tpm, tokens, Dimension::Tokens),
        ] {
            let (Some(b), Some(l)) = (bucket, limit) else {
                continue;
            };
            let w = b.wait_for(l, cost);
            if w > 0 {
                let r = Refusal {
                    scope: c.scope,
                    dimension,
                    limit: l,
                    used: l.saturating_sub(b.remaining()),
                    requested: cost,
                    too_large: false,
                    wait: None,
                };
                hit(r, Some(nanos(w)));
            }
        }
    }
    first.map(|r| Refusal { wait, ..r })
}

fn headers(scopes: &[Check<'_>]) -> RateHeaders {
    let mut out = RateHeaders::default();
    for c in scopes {
        for (slot, bucket, limit) in [
            (&mut out.requests, &c.state.rpm, c.limits.rpm),
            (&mut out.tokens, &c.state.tpm, c.limits.tpm),
        ] {
            let (Some(b), Some(l)) = (bucket, limit) else {
                continue;
            };
            let trio = Trio {
                limit: l,
                remaining: b.remaining(),
                reset: nanos(b.reset(l)),
            };
            // The tightest scope: the fewest left, then the longest to full.
            if slot.is_none_or(|t| {
                (trio.remaining, std::cmp::Reverse(trio.reset)) < (t.remaining, std::cmp::Reverse(t.reset))
            }) {
                *slot = Some(trio);
            }
        }
    }
    out
}

/// A duration the way OpenAI writes it in `x-ratelimit-reset-*` and in "Please try
/// again in ...": `250ms` under a second, else `[Hh][Mm]S[.fff]s` (`1s`, `6m0s`,
/// `1.234s`), rounded up to the millisecond.
pub(crate) fn openai_duration(d: Duration) -> String {
    let ms = d.as_nanos().div_ceil(1_000_000);
    if ms < 1000 {
        return if ms == 0 { "0s".into() } else { format!("{ms}ms") };
    }
    let (h, rest) = (ms / 3_600_000, ms % 3_600_000);
    let (m, rest) = (rest / 60_000, rest % 60_000);
    let (s, frac) = (rest / 1000, rest % 1000);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if h > 0 || m > 0 {
        out.push_str(&format!("{m}m"));
    }
    if frac == 0 {
        out.push_str(&format!("{s}s"));
    } else {
        let f = format!("{frac:03}");
        out.push_str(&format!("{s}.{}s", f.trim_end_matches('0')));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_written_like_openai() {
        let ms = Duration::from_millis;
        assert_eq!(openai_duration(ms(250)), "250ms");
        assert_eq!(openai_duration(ms(1000)), "1s");
        assert_eq!(openai_duration(ms(1234)), "1.234s");
        assert_eq!(openai_duration(ms(1500)), "1.5s");
        assert_eq!(openai_duration(ms(360_000)), "6m0s");
        assert_eq!(openai_duration(ms(3_723_000)), "1h2m3s");
        assert_eq!(openai_duration(Duration::from_nanos(1)), "1ms");
        assert_eq!(openai_duration(Duration::ZERO), "0s");
    }

    #[test]
    fn bucket_refills_exactly() {
        // 7 per minute: one token every 60/7 s = 8_571_428_571.43 ns.
        let mut b = Bucket::full(7, 0);
        for _ in 0..7 {
            assert_eq!(b.wait_for(7, 1), 0);
            b.take(1);
        }
        let w = b.wait_for(7, 1);
        assert_eq!(w, 8_571_428_572);
        let mut early = Bucket {
            level: b.level,
            at: 0,
        };
        early.refill(7, w - 1);
        assert!(early.wait_for(7, 1) > 0);
        b.refill(7, w);
        assert_eq!(b.wait_for(7, 1), 0);
        assert_eq!(b.remaining(), 1);
    }
}
