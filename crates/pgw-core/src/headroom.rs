//! What a provider says is left of its rate limits: the `x-ratelimit-*` headers
//! OpenAI sends on every answer (and Azure OpenAI, Groq and most OpenAI-compatible
//! providers with it), read defensively.
//!
//! | header | meaning |
//! |---|---|
//! | `x-ratelimit-limit-requests` / `-tokens` | the limit (per minute, or per day) |
//! | `x-ratelimit-remaining-requests` / `-tokens` | what is left after this request |
//! | `x-ratelimit-reset-requests` / `-tokens` | time until the limit is whole again (`1s`, `6m0s`, `250ms`) |
//!
//! Once nothing is left, a request sent now is a 429; [`Headroom::exhausted_for`] says
//! for how long. pgw-client reads them into an answer's stats and, on a 429 without
//! `Retry-After` (OpenAI's usual 429), for the wait to hold the source; pgw-stack
//! reports what is left (`pgw_provider_remaining`).
//!
//! Not done, measured (2026-12-05, the pgw soak, memory backend): holding a source as
//! soon as an answer's headers say nothing is left. The 429s it was to spare stayed
//! (188 -> 186 on `flapping`'s 40 RPM key: the requests refused are the ones already on
//! their way when the answer arrives) and goodput fell (`flapping`, 12 seeds: mean
//! x0.923 -> x0.893).

use std::time::Duration;

use http::HeaderName;

use crate::retry_after::{MAX_RETRY_AFTER, seconds_f64};

/// The requests limit's headers: remaining, limit, reset.
const REQUESTS: [HeaderName; 3] = [
    HeaderName::from_static("x-ratelimit-remaining-requests"),
    HeaderName::from_static("x-ratelimit-limit-requests"),
    HeaderName::from_static("x-ratelimit-reset-requests"),
];

/// The tokens limit's headers: remaining, limit, reset.
const TOKENS: [HeaderName; 3] = [
    HeaderName::from_static("x-ratelimit-remaining-tokens"),
    HeaderName::from_static("x-ratelimit-limit-tokens"),
    HeaderName::from_static("x-ratelimit-reset-tokens"),
];

/// One limit's headers: what is left, the limit, and the time until it is whole.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Remaining {
    /// `x-ratelimit-limit-*`, when sent.
    pub limit: Option<u64>,
    /// `x-ratelimit-remaining-*`.
    pub remaining: u64,
    /// `x-ratelimit-reset-*`, when sent and readable.
    pub reset: Option<Duration>,
}

impl Remaining {
    /// How long until `need` units are left, `None` when they are now (or the headers
    /// do not say when).
    ///
    /// OpenAI's limits refill continuously (a token bucket): the reset is the time
    /// until the whole deficit `limit - remaining` is back, so `need - remaining`
    /// units take that share of it. Without a limit the reset is all the provider said:
    /// nothing is left until then.
    fn wait_for(&self, need: u64) -> Option<Duration> {
        if self.remaining >= need {
            return None;
        }
        let reset = self.reset.filter(|r| !r.is_zero())?;
        let wait = match self.limit {
            Some(limit) if limit > self.remaining => {
                let missing = need.min(limit) - self.remaining;
                #[allow(clippy::cast_precision_loss)]
                let share = missing as f64 / (limit - self.remaining) as f64;
                reset.mul_f64(share)
            }
            _ => reset,
        };
        Some(wait.min(MAX_RETRY_AFTER))
    }
}

/// The provider's account of its rate limits after one answer (`x-ratelimit-*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Headroom {
    /// The requests limit.
    pub requests: Option<Remaining>,
    /// The tokens limit.
    pub tokens: Option<Remaining>,
}

impl Headroom {
    /// Reads the `x-ratelimit-*` headers; `None` when no `remaining` header is there
    /// or readable (a limit without `remaining` says nothing about what is left).
    ///
    /// ```
    /// use std::time::Duration;
    /// use pgw_core::headroom::Headroom;
    ///
    /// let mut h = http::HeaderMap::new();
    /// h.insert("x-ratelimit-limit-requests", "60".parse().unwrap());
    /// h.insert("x-ratelimit-remaining-requests", "0".parse().unwrap());
    /// h.insert("x-ratelimit-reset-requests", "1m0s".parse().unwrap());
    /// let headroom = Headroom::from_headers(&h).unwrap();
    /// // One request refills in a 60th of the minute the whole limit takes.
    /// assert_eq!(headroom.exhausted_for(None), Some(Duration::from_secs(1)));
    /// ```
    #[must_use]
    pub fn from_headers(headers: &http::HeaderMap) -> Option<Self> {
        // Pre-parsed names (no name parsing per answer), `remaining` first: an answer
        // without the headers costs two lookups.
        let read = |[remaining, limit, reset]: &[HeaderName; 3]| -> Option<Remaining> {
            let get = |name| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim);
            let remaining = get(remaining)?.parse::<u64>().ok()?;
            Some(Remaining {
                limit: get(limit).and_then(|v| v.parse::<u64>().ok()),
                remaining,
                reset: get(reset).and_then(parse_reset),
            })
        };
        let out = Self {
            requests: read(&REQUESTS),
            tokens: read(&TOKENS),
        };
        (out.requests.is_some() || out.tokens.is_some()).then_some(out)
    }

    /// How long a request like the one just answered would be refused: until one
    /// request is left, and until `tokens` are left (the answered call's own usage, a
    /// measure of the next; `None` checks only that some token is left). `None` when
    /// the provider has room now, or did not say when it will.
    ///
    /// ```
    /// use std::time::Duration;
    /// use pgw_core::headroom::{Headroom, Remaining};
    ///
    /// let h = Headroom {
    ///     requests: Some(Remaining { limit: Some(500), remaining: 12, reset: Some(Duration::from_secs(3)) }),
    ///     tokens: Some(Remaining { limit: Some(30_000), remaining: 1_000, reset: Some(Duration::from_secs(58)) }),
    /// };
    /// // Requests are left, and 1,000 tokens are enough for a call of 1,000 ...
    /// assert_eq!(h.exhausted_for(Some(1_000)), None);
    /// // ... but not for one of 3,900: 2,900 of the 29,000 missing refill in 5.8 s.
    /// assert_eq!(h.exhausted_for(Some(3_900)), Some(Duration::from_millis(5_800)));
    /// ```
    #[must_use]
    pub fn exhausted_for(&self, tokens: Option<u64>) -> Option<Duration> {
        let requests = self.requests.and_then(|r| r.wait_for(1));
        let tokens = self.tokens.and_then(|t| t.wait_for(tokens.unwrap_or(1).max(1)));
        requests.max(tokens)
    }
}

/// Parses a reset time as OpenAI writes it: a Go duration (`1s`, `6m0s`, `1h2m3.5s`,
/// `250ms`, `20us`), or plain (decimal) seconds (`0.5`). `None` for garbage, never a
/// panic; longer than [`MAX_RETRY_AFTER`] is clamped to it.
///
/// ```
/// use std::time::Duration;
/// use pgw_core::headroom::parse_reset;
///
/// assert_eq!(parse_reset("6m0s"), Some(Duration::from_secs(360)));
/// assert_eq!(parse_reset("1.5s"), Some(Duration::from_millis(1500)));
/// assert_eq!(parse_reset("250ms"), Some(Duration::from_millis(250)));
/// assert_eq!(parse_reset("2"), Some(Duration::from_secs(2)));
/// assert_eq!(parse_reset("soon"), None);
/// ```
#[must_use]
pub fn parse_reset(value: &str) -> Option<Duration> {
    let v = value.trim();
    if v.is_empty() {
        return None;
    }
    if let Ok(secs) = v.parse::<f64>() {
        return seconds_f64(secs);
    }
    let mut total = 0.0_f64;
    let mut rest = v;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .filter(|&i| i > 0)?;
        let number: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" | "μs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        total += number * scale;
        rest = &rest[unit_len..];
    }
    seconds_f64(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn headers(pairs: &[(&str, &str)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn resets_in_every_form_openai_writes() {
        let cases: &[(&str, Option<Duration>)] = &[
            ("1s", Some(Duration::from_secs(1))),
            ("0s", Some(Duration::ZERO)),
            ("6m0s", Some(Duration::from_secs(360))),
            ("2m3.5s", Some(Duration::from_millis(123_500))),
            ("1h0m0s", Some(Duration::from_secs(3600))),
            ("20ms", Some(Duration::from_millis(20))),
            ("15us", Some(Duration::from_micros(15))),
            ("0.25", Some(Duration::from_millis(250))),
            (" 7 ", Some(Duration::from_secs(7))),
            ("48h", Some(MAX_RETRY_AFTER)),
            ("", None),
            ("s", None),
            ("1x", None),
            ("-1s", None),
            ("1.2.3s", None),
            ("NaN", None),
            ("inf", None),
        ];
        for (input, want) in cases {
            assert_eq!(parse_reset(input), *want, "input {input:?}");
        }
    }

    #[test]
    fn nothing_left_holds_for_what_one_request_takes_to_refill() {
        let h = Headroom::from_headers(&headers(&[
            ("x-ratelimit-limit-requests", "40"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "60s"),
        ]))
        .unwrap();
        assert_eq!(h.exhausted_for(None), Some(Duration::from_millis(1500)));
        // One left: room now.
        let h = Headroom::from_headers(&headers(&[
            ("x-ratelimit-limit-requests", "40"),
            ("x-ratelimit-remaining-requests", "1"),
            ("x-ratelimit-reset-requests", "58.5s"),
        ]))
        .unwrap();
        assert_eq!(h.exhausted_for(None), None);
    }

    #[test]
    fn without_a_limit_the_whole_reset_is_waited() {
        let h = Headroom::from_headers(&headers(&[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "12s"),
        ]))
        .unwrap();
        assert_eq!(h.exhausted_for(None), Some(Duration::from_secs(12)));
        // A limit under what is left is garbage: the reset alone counts.
        let h = Headroom::from_headers(&headers(&[
            ("x-ratelimit-limit-tokens", "5"),
            ("x-ratelimit-remaining-tokens", "10"),
            ("x-ratelimit-reset-tokens", "3s"),
        ]))
        .unwrap();
        assert_eq!(h.exhausted_for(Some(20)), Some(Duration::from_secs(3)));
    }

    #[test]
    fn the_longer_of_requests_and_tokens_wins() {
        let h = Headroom::from_headers(&headers(&[
            ("x-ratelimit-limit-requests", "10"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "10s"),
            ("x-ratelimit-limit-tokens", "1000"),
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "60s"),
        ]))
        .unwrap();
        // Requests: 1 s. Tokens: 500 of 1,000 missing: 30 s.
        assert_eq!(h.exhausted_for(Some(500)), Some(Duration::from_secs(30)));
        // A call larger than the whole limit waits for the whole reset, no longer.
        assert_eq!(h.exhausted_for(Some(5000)), Some(Duration::from_secs(60)));
    }

    #[test]
    fn no_reset_or_no_remaining_says_nothing() {
        assert_eq!(Headroom::from_headers(&http::HeaderMap::new()), None);
        assert_eq!(
            Headroom::from_headers(&headers(&[("x-ratelimit-limit-requests", "10")])),
            None
        );
        assert_eq!(
            Headroom::from_headers(&headers(&[("x-ratelimit-remaining-requests", "lots")])),
            None
        );
        let h = Headroom::from_headers(&headers(&[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "soon"),
        ]))
        .unwrap();
        assert_eq!(h.exhausted_for(None), None, "no readable reset: no hold");
    }

    proptest! {
        #[test]
        fn garbage_never_panics(s in "\\PC{0,24}") {
            let _ = parse_reset(&s);
        }

        #[test]
        fn waits_are_bounded(limit in 0u64..10_000_000, remaining in 0u64..10_000_000,
                             reset_ms in 0u64..100_000_000, need in proptest::option::of(0u64..10_000_000)) {
            let r = Remaining { limit: Some(limit), remaining, reset: Some(Duration::from_millis(reset_ms)) };
            let h = Headroom { requests: Some(r), tokens: Some(r) };
            if let Some(w) = h.exhausted_for(need) {
                prop_assert!(w <= Duration::from_millis(reset_ms).min(MAX_RETRY_AFTER));
            }
        }
    }
}
