//! Configuration and its defaults, each with where it comes from.

use std::time::Duration;

use crate::error::ConfigError;

/// Attempt budget per call: three attempts, spent only by `Transient` and
/// `SourceDead` outcomes: the 3 fixed retries of the client measured in production,
/// no longer spent by 429s (under sustained pushback, 429s alone used them up).
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;

/// Re-asks after an `Invalid` answer: two, apart from the attempt budget, a conservative
/// version of the `instructor` library's 3 (with one, 3.2% of structured-output calls
/// still failed in production).
pub const DEFAULT_MAX_REASKS: u32 = 2;

/// Base of the full-jitter exponential backoff: 0.5 s. The n-th backoff of a call is
/// uniform in `[floor, min(max_backoff, base * 2^n)]` ("full jitter", M. Brooker,
/// *Exponential Backoff And Jitter*, AWS Architecture Blog, 2015; gRPC A6 uses the same
/// shape when the server sends no pushback), with a floor of `base / 2` (250 ms by
/// default; never above the ceiling) so that no two attempts of a call go back to back.
pub const DEFAULT_BASE_BACKOFF: Duration = Duration::from_millis(500);

/// Cap of the exponential backoff: 20 s, a third of a one-minute RPM window. A server
/// that needs longer says so with `Retry-After`, which always wins. With the
/// defaults, ten backoffs in a row add up to at most 111.5 s, inside the stall window.
pub const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(20);

/// Stall window: 120 s, two one-minute provider windows, so a call rides out a full
/// rate window rolling over before the guard may fire (and only if nothing else in the
/// process succeeded meanwhile).
pub const DEFAULT_STALL_WINDOW: Duration = Duration::from_secs(120);

/// The most a call waits on pushback in all: 60 s, half the stall window.
///
/// Counted per 429 from its answer on: the wait it asks for, `max(Retry-After,
/// backoff)`, slept by the layer or held on its source (a call's overlapping waits
/// count once); waits for pacing, quota windows and breakers are not pushback and do
/// not count. Why 60 s: on the pgw soak's scenario library (virtual time), 30 s and
/// 45 s ended calls of the account-wide 429 storm that waiting out the account's
/// honest pushback would have served (97.5% and 98.5% success against its 99% bar);
/// 60 s keeps it at its bar and changes nothing on P6 or any other scenario. A pool
/// answering nothing but 429s then ends a call (or, in a gateway, moves it down the
/// fallback chain) after a minute, not at the stall guard (which fires only when
/// nothing in the process succeeds) or never.
pub const DEFAULT_MAX_PUSHBACK_WAIT: Duration = Duration::from_secs(60);

/// The shortest wait after a gate refused (not admitted): 10 ms, so a gate answering
/// `retry_after = 0` cannot make the loop spin.
pub const MIN_NOT_ADMITTED_WAIT: Duration = Duration::from_millis(10);

/// Retry budget ratio: retries may be at most 10% of requests over the window.
/// Google SRE book, chapter "Handling Overload" ("per-client retry budget ... 10%").
pub const DEFAULT_BUDGET_RATIO: f64 = 0.1;

/// Retry budget floor: 10 retries per second are always allowed, so a quiet client
/// can still retry. tower `TpsBudget` / Finagle `RetryBudget` default `minRetriesPerSec`.
pub const DEFAULT_BUDGET_MIN_PER_SEC: u32 = 10;

/// Retry budget window: 10 s. tower `TpsBudget` / Finagle `RetryBudget` default `ttl`.
pub const DEFAULT_BUDGET_TTL: Duration = Duration::from_secs(10);

/// Adaptive throttling multiplier K: 2. Google SRE book, "Handling Overload",
/// client-side throttling: reject with probability
/// `max(0, (requests - K * accepts) / (requests + 1))`; "a value of 2" is the book's
/// recommendation.
pub const DEFAULT_THROTTLE_K: f64 = 2.0;

/// Adaptive throttling window: two minutes, as in the SRE book ("we use two
/// minutes of request history").
pub const DEFAULT_THROTTLE_WINDOW: Duration = Duration::from_secs(120);

/// The retry loop's configuration. `Default` gives the documented defaults; the shared
/// retry budget and adaptive throttling are off.
///
/// ```
/// use std::time::Duration;
/// use tower_retry_pushback::{RetryBudgetConfig, RetryConfig};
///
/// let config = RetryConfig {
///     max_attempts: 5,
///     max_call_duration: Some(Duration::from_secs(300)),
///     retry_budget: Some(RetryBudgetConfig::default()),
///     ..RetryConfig::default()
/// };
/// assert!(config.validate().is_ok());
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct RetryConfig {
    /// Attempts per call counted by `Transient`/`SourceDead` outcomes (a 429 never
    /// counts). At least 1.
    pub max_attempts: u32,
    /// Re-asks after an `Invalid` answer, apart from `max_attempts`.
    pub max_reasks: u32,
    /// Base of the full-jitter exponential backoff. Non-zero.
    pub base_backoff: Duration,
    /// Cap of the exponential backoff. At least `base_backoff`.
    pub max_backoff: Duration,
    /// Stall window: a call that has waited longer fails with
    /// [`Reason::Stalled`](crate::Reason::Stalled) if nothing in the process succeeded
    /// within it. Also the longest single wait a call accepts. Non-zero.
    pub stall_window: Duration,
    /// The most a call waits on pushback in all (default
    /// [`DEFAULT_MAX_PUSHBACK_WAIT`]): the time covered by the waits its 429s asked for
    /// (`max(Retry-After, backoff)` from each 429's answer on, slept or held; overlaps
    /// count once). A pushback sleep that would pass it is not slept, and a 429 after
    /// it was reached ends the call (its source still held), both with
    /// [`Reason::PushbackExhausted`](crate::Reason::PushbackExhausted). Non-zero.
    pub max_pushback_wait: Duration,
    /// Optional per-call deadline, from the call's start. Non-zero when set.
    pub max_call_duration: Option<Duration>,
    /// Optional shared retry budget (retries at most a share of requests). Off by
    /// default.
    pub retry_budget: Option<RetryBudgetConfig>,
    /// Optional client-side adaptive throttling (attempts dropped locally while the
    /// upstream accepts too few). Off by default.
    pub throttle: Option<ThrottleConfig>,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            max_reasks: DEFAULT_MAX_REASKS,
            base_backoff: DEFAULT_BASE_BACKOFF,
            max_backoff: DEFAULT_MAX_BACKOFF,
            stall_window: DEFAULT_STALL_WINDOW,
            max_pushback_wait: DEFAULT_MAX_PUSHBACK_WAIT,
            max_call_duration: None,
            retry_budget: None,
            throttle: None,
        }
    }
}

impl RetryConfig {
    /// Checks every field.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_attempts == 0 {
            return Err(crate::error::config_error("max_attempts", "must be at least 1"));
        }
        if self.base_backoff.is_zero() {
            return Err(crate::error::config_error(
                "base_backoff",
                "must be greater than zero",
            ));
        }
        if self.max_backoff < self.base_backoff {
            return Err(crate::error::config_error(
                "max_backoff",
                format!(
                    "must be at least base_backoff ({:?} < {:?})",
                    self.max_backoff, self.base_backoff
                ),
            ));
        }
        if self.stall_window.is_zero() {
            return Err(crate::error::config_error(
                "stall_window",
                "must be greater than zero",
            ));
        }
        if self.max_pushback_wait.is_zero() {
            return Err(crate::error::config_error(
                "max_pushback_wait",
                "must be greater than zero",
            ));
        }
        if self.max_call_duration.is_some_and(|d| d.is_zero()) {
            return Err(crate::error::config_error(
                "max_call_duration",
                "must be greater than zero when set",
            ));
        }
        if let Some(b) = &self.retry_budget {
            b.validate()?;
        }
        if let Some(t) = &self.throttle {
            t.validate()?;
        }
        Ok(())
    }
}

/// The shared retry budget: retries at most `ratio` of requests over `ttl`, plus
/// `min_retries_per_sec * ttl` retries always allowed.
#[derive(Clone, Debug, PartialEq)]
pub struct RetryBudgetConfig {
    /// Retries allowed per request, in `[0, 1]`. Default 0.1.
    pub ratio: f64,
    /// Retries per second allowed whatever the traffic. Default 10.
    pub min_retries_per_sec: u32,
    /// The sliding window. At least 1 s. Default 10 s.
    pub ttl: Duration,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        Self {
            ratio: DEFAULT_BUDGET_RATIO,
            min_retries_per_sec: DEFAULT_BUDGET_MIN_PER_SEC,
            ttl: DEFAULT_BUDGET_TTL,
        }
    }
}

impl RetryBudgetConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !self.ratio.is_finite() || !(0.0..=1.0).contains(&self.ratio) {
            return Err(crate::error::config_error(
                "retry_budget.ratio",
                format!("must be within [0, 1], got {}", self.ratio),
            ));
        }
        if self.ttl < Duration::from_secs(1) {
            return Err(crate::error::config_error(
                "retry_budget.ttl",
                "must be at least 1 s",
            ));
        }
        if self.ttl > Duration::from_secs(3600) {
            return Err(crate::error::config_error(
                "retry_budget.ttl",
                "must be at most 1 h",
            ));
        }
        Ok(())
    }
}

/// Client-side adaptive throttling (Google SRE book): attempts are dropped locally
/// with probability `max(0, (requests - K * accepts) / (requests + 1))` over `window`.
#[derive(Clone, Debug, PartialEq)]
pub struct ThrottleConfig {
    /// The multiplier K: finite, at least 1. Default 2.
    pub k: f64,
    /// The history window. At least 1 s. Default 120 s.
    pub window: Duration,
}

impl Default for ThrottleConfig {
    fn default() -> Self {
        Self {
            k: DEFAULT_THROTTLE_K,
            window: DEFAULT_THROTTLE_WINDOW,
        }
    }
}

impl ThrottleConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !self.k.is_finite() || self.k < 1.0 {
            return Err(crate::error::config_error(
                "throttle.k",
                format!("must be finite and at least 1, got {}", self.k),
            ));
        }
        if self.window < Duration::from_secs(1) {
            return Err(crate::error::config_error(
                "throttle.window",
                "must be at least 1 s",
            ));
        }
        if self.window > Duration::from_secs(24 * 3600) {
            return Err(crate::error::config_error(
                "throttle.window",
                "must be at most 24 h",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_fields_are_named() {
        let cases: Vec<(RetryConfig, &str)> = vec![
            (
                RetryConfig {
                    max_attempts: 0,
                    ..RetryConfig::default()
                },
                "max_attempts",
            ),
            (
                RetryConfig {
                    base_backoff: Duration::ZERO,
                    ..RetryConfig::default()
                },
                "base_backoff",
            ),
            (
                RetryConfig {
                    max_backoff: Duration::from_millis(1),
                    ..RetryConfig::default()
                },
                "max_backoff",
            ),
            (
                RetryConfig {
                    stall_window: Duration::ZERO,
                    ..RetryConfig::default()
                },
                "stall_window",
            ),
            (
                RetryConfig {
                    max_pushback_wait: Duration::ZERO,
                    ..RetryConfig::default()
                },
                "max_pushback_wait",
            ),
            (
                RetryConfig {
                    max_call_duration: Some(Duration::ZERO),
                    ..RetryConfig::default()
                },
                "max_call_duration",
            ),
            (
                RetryConfig {
                    retry_budget: Some(RetryBudgetConfig {
                        ratio: f64::NAN,
                        ..RetryBudgetConfig::default()
                    }),
                    ..RetryConfig::default()
                },
                "retry_budget.ratio",
            ),
            (
                RetryConfig {
                    retry_budget: Some(RetryBudgetConfig {
                        ttl: Duration::from_millis(10),
                        ..RetryBudgetConfig::default()
                    }),
                    ..RetryConfig::default()
                },
                "retry_budget.ttl",
            ),
            (
                RetryConfig {
                    throttle: Some(ThrottleConfig {
                        k: 0.5,
                        ..ThrottleConfig::default()
                    }),
                    ..RetryConfig::default()
                },
                "throttle.k",
            ),
            (
                RetryConfig {
                    throttle: Some(ThrottleConfig {
                        window: Duration::ZERO,
                        ..ThrottleConfig::default()
                    }),
                    ..RetryConfig::default()
                },
                "throttle.window",
            ),
        ];
        for (config, field) in cases {
            let err = config.validate().unwrap_err();
            assert_eq!(err.field(), field, "{err}");
            assert!(err.to_string().contains(field));
        }
        assert!(RetryConfig::default().validate().is_ok());
    }

    #[test]
    fn the_pushback_bound_is_under_the_stall_window_and_outlasts_a_few_backoffs() {
        assert!(DEFAULT_MAX_PUSHBACK_WAIT * 2 <= DEFAULT_STALL_WINDOW);
        // Six 429s without Retry-After in a row never reach it: their backoffs are at
        // most 0.5 + 1 + 2 + 4 + 8 + 16 = 31.5 s.
        let six: Duration = (0..6)
            .map(|n| DEFAULT_MAX_BACKOFF.min(DEFAULT_BASE_BACKOFF * 2u32.pow(n)))
            .sum();
        assert!(six < DEFAULT_MAX_PUSHBACK_WAIT, "{six:?}");
    }

    #[test]
    fn ten_default_backoffs_fit_in_the_stall_window() {
        let mut total = Duration::ZERO;
        for n in 0..10 {
            total += DEFAULT_MAX_BACKOFF.min(DEFAULT_BASE_BACKOFF * 2u32.pow(n));
        }
        assert!(total < DEFAULT_STALL_WINDOW, "{total:?}");
    }
}
