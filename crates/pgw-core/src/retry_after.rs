//! `Retry-After` parsing (RFC 9110 section 10.2.3), defensive against garbage.

use std::time::{Duration, SystemTime};

/// The longest `Retry-After` a pgw layer will honour: one hour.
///
/// A provider asking for more is either broken or has cut the account off for the
/// day; holding a source longer than this hides the problem instead of surfacing it.
/// Larger values are clamped to this cap (never rejected), so a call can still decide
/// that the wait is longer than it may wait, and move on or fail at once.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// Parses a `Retry-After` value relative to `now` (the wall clock, needed only for the
/// HTTP-date form).
///
/// Accepts delta-seconds (`"7"`, and leniently a non-negative decimal such as `"1.5"`,
/// which some providers send) and an HTTP-date (`"Wed, 21 Oct 2015 07:28:00 GMT"`).
/// Returns `None` for garbage, negative and non-finite values; a date in the past gives
/// `Some(Duration::ZERO)`; anything longer than [`MAX_RETRY_AFTER`] is clamped to it.
/// Never panics.
///
/// ```
/// use std::time::{Duration, SystemTime, UNIX_EPOCH};
/// use pgw_core::retry_after::{parse_retry_after, MAX_RETRY_AFTER};
///
/// let now = UNIX_EPOCH + Duration::from_secs(1_445_412_470); // 07:27:50 GMT
/// assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
/// assert_eq!(
///     parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now),
///     Some(Duration::from_secs(10))
/// );
/// assert_eq!(parse_retry_after("-3", now), None);
/// assert_eq!(parse_retry_after("soon", now), None);
/// assert_eq!(parse_retry_after("99999999999", now), Some(MAX_RETRY_AFTER));
/// ```
#[must_use]
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let v = value.trim();
    if v.is_empty() {
        return None;
    }
    if v.bytes().all(|b| b.is_ascii_digit()) {
        // Any number of digits: too long to fit means "absurdly large", i.e. the cap.
        return Some(
            v.parse::<u64>()
                .map_or(MAX_RETRY_AFTER, Duration::from_secs)
                .min(MAX_RETRY_AFTER),
        );
    }
    if v.bytes().all(|b| b.is_ascii_digit() || b == b'.') && v.bytes().filter(|&b| b == b'.').count() == 1 {
        let secs: f64 = v.parse().ok()?;
        return seconds_f64(secs);
    }
    let when = httpdate::parse_http_date(v).ok()?;
    Some(
        when.duration_since(now)
            .unwrap_or(Duration::ZERO)
            .min(MAX_RETRY_AFTER),
    )
}

/// Parses a millisecond hint (`retry-after-ms`, sent by some OpenAI-compatible
/// providers). Same contract as [`parse_retry_after`].
#[must_use]
pub fn parse_retry_after_ms(value: &str) -> Option<Duration> {
    let v = value.trim();
    let ms: f64 = v.parse().ok()?;
    seconds_f64(ms / 1000.0)
}

/// `secs` as a wait: `None` when negative or not finite, clamped to [`MAX_RETRY_AFTER`].
pub(crate) fn seconds_f64(secs: f64) -> Option<Duration> {
    if !secs.is_finite() || secs < 0.0 {
        return None;
    }
    if secs >= MAX_RETRY_AFTER.as_secs_f64() {
        return Some(MAX_RETRY_AFTER);
    }
    Some(Duration::from_secs_f64(secs))
}

/// Reads the `Retry-After` hint from response headers: `retry-after-ms` first (more
/// precise), then `retry-after`.
#[must_use]
pub fn from_headers(headers: &http::HeaderMap, now: SystemTime) -> Option<Duration> {
    if let Some(d) = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(parse_retry_after_ms)
    {
        return Some(d);
    }
    headers
        .get(http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parse_retry_after(v, now))
}

/// Reads the wait a provider's 429 message names, as the providers write it: OpenAI
/// and Groq "Please try again in 4s." (`4s`, `1.234s`, `250ms`, `6m0s`:
/// [`crate::headroom::parse_reset`]), Gemini "Please retry in 37.94s.", Azure OpenAI
/// "Please retry after 6 seconds." (a number and a unit word: `seconds`, `ms`,
/// `milliseconds`, `minutes`). The last such phrase wins; `None` when the message names
/// no readable wait. OpenAI sends no `Retry-After` on most 429s: this and the
/// `x-ratelimit-*` headers ([`crate::headroom`]) are what it says.
///
/// ```
/// use std::time::Duration;
/// use pgw_core::retry_after::from_message;
///
/// let m = "Rate limit reached for gpt-4o on requests per min (RPM): Limit 3, Used 3, \
///          Requested 1. Please try again in 20s. Visit https://platform.openai.com/...";
/// assert_eq!(from_message(m), Some(Duration::from_secs(20)));
/// assert_eq!(from_message("Please retry after 6 seconds."), Some(Duration::from_secs(6)));
/// assert_eq!(from_message("Please try again later."), None);
/// ```
#[must_use]
pub fn from_message(message: &str) -> Option<Duration> {
    const PHRASES: [&str; 3] = ["try again in ", "retry in ", "retry after "];
    // Lowercased: ASCII only, so every byte offset is kept.
    let lower = message.to_ascii_lowercase();
    let at = PHRASES
        .iter()
        .filter_map(|p| lower.rfind(p).map(|i| i + p.len()))
        .max()?;
    // The sentence's full stop or a comma is not part of the duration ("4s." "1.5s,").
    let mut words = lower[at..]
        .split_whitespace()
        .map(|w| w.trim_end_matches(['.', ',', ';', ')']));
    let first = words.next()?;
    if first.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        // A bare number: its unit is the next word, if it names one.
        let scale = match words.next() {
            Some("ms" | "millisecond" | "milliseconds") => 1e-3,
            Some("minute" | "minutes" | "min" | "mins") => 60.0,
            _ => 1.0,
        };
        let secs: f64 = first.parse().ok()?;
        return seconds_f64(secs * scale);
    }
    crate::headroom::parse_reset(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::UNIX_EPOCH;

    fn now() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_445_412_470)
    }

    #[test]
    fn table() {
        let cases: &[(&str, Option<Duration>)] = &[
            ("0", Some(Duration::ZERO)),
            (" 12 ", Some(Duration::from_secs(12))),
            ("1.5", Some(Duration::from_millis(1500))),
            ("3600", Some(MAX_RETRY_AFTER)),
            ("3601", Some(MAX_RETRY_AFTER)),
            ("184467440737095516160000", Some(MAX_RETRY_AFTER)),
            ("-1", None),
            ("1e3", None),
            ("NaN", None),
            ("inf", None),
            ("", None),
            ("1.2.3", None),
            ("Wed, 21 Oct 2015 07:27:00 GMT", Some(Duration::ZERO)),
            ("Wed, 21 Oct 2015 07:28:00 GMT", Some(Duration::from_secs(10))),
            ("Thu, 22 Oct 2015 07:28:00 GMT", Some(MAX_RETRY_AFTER)),
            ("Wed, 32 Oct 2015 07:28:00 GMT", None),
        ];
        for (input, want) in cases {
            assert_eq!(parse_retry_after(input, now()), *want, "input {input:?}");
        }
        assert_eq!(parse_retry_after_ms("250"), Some(Duration::from_millis(250)));
        assert_eq!(parse_retry_after_ms("-250"), None);
    }

    #[test]
    fn waits_named_in_a_message() {
        let cases: &[(&str, Option<Duration>)] = &[
            ("Please try again in 4s.", Some(Duration::from_secs(4))),
            (
                "... Please try again in 1.234s. Visit https://x",
                Some(Duration::from_millis(1234)),
            ),
            ("Please try again in 250ms.", Some(Duration::from_millis(250))),
            ("Please Try Again In 6m0s", Some(Duration::from_secs(360))),
            (
                "try again in 2s, or in 5s. Try again in 3s.",
                Some(Duration::from_secs(3)),
            ),
            ("Please retry in 37.5s.", Some(Duration::from_millis(37_500))),
            ("Please retry after 6 seconds.", Some(Duration::from_secs(6))),
            ("Please retry after 1 second", Some(Duration::from_secs(1))),
            ("retry after 250 ms", Some(Duration::from_millis(250))),
            ("retry after 2 minutes.", Some(Duration::from_secs(120))),
            ("retry after 7", Some(Duration::from_secs(7))),
            ("Please retry after some time.", None),
            ("retry in a few seconds", None),
            ("retry after 99999999999 minutes", Some(MAX_RETRY_AFTER)),
            ("Please try again later.", None),
            ("Please try again in a moment.", None),
            ("Please try again in ", None),
            ("try again in -4s", None),
            ("", None),
        ];
        for (m, want) in cases {
            assert_eq!(from_message(m), *want, "message {m:?}");
        }
    }

    #[test]
    fn headers_prefer_ms() {
        let mut h = http::HeaderMap::new();
        h.insert("retry-after", "7".parse().unwrap());
        assert_eq!(from_headers(&h, now()), Some(Duration::from_secs(7)));
        h.insert("retry-after-ms", "1200".parse().unwrap());
        assert_eq!(from_headers(&h, now()), Some(Duration::from_millis(1200)));
    }

    proptest! {
        #[test]
        fn never_panics_never_exceeds_cap(s in "\\PC{0,40}", secs in 0u64..4_000_000_000) {
            let t = UNIX_EPOCH + Duration::from_secs(secs);
            if let Some(d) = parse_retry_after(&s, t) {
                prop_assert!(d <= MAX_RETRY_AFTER);
            }
            if let Some(d) = parse_retry_after_ms(&s) {
                prop_assert!(d <= MAX_RETRY_AFTER);
            }
            for m in [s.clone(), format!("Please try again in {s}")] {
                if let Some(d) = from_message(&m) {
                    prop_assert!(d <= MAX_RETRY_AFTER);
                }
            }
        }

        #[test]
        fn digits_roundtrip(n in 0u64..3600) {
            prop_assert_eq!(parse_retry_after(&n.to_string(), now()), Some(Duration::from_secs(n)));
        }

        #[test]
        fn numeric_like_inputs_never_exceed_cap(s in "[-0-9.eE+]{0,30}") {
            if let Some(d) = parse_retry_after(&s, now()) {
                prop_assert!(d <= MAX_RETRY_AFTER);
            }
        }
    }
}
