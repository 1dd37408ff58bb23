//! Configuration and the named defaults.

use crate::error::ConfigError;

/// Initial limit of a source: 8 attempts in flight.
pub const DEFAULT_INITIAL_LIMIT: f64 = 8.0;

/// The limit never drops below this floor: 1, so a source under pushback still admits
/// one attempt at a time.
pub const DEFAULT_MIN_LIMIT: f64 = 1.0;

/// Multiplicative cut on a `RateLimited` outcome, once per congestion episode: 0.5, the
/// aggressive end of Netflix's 0.5-0.9 advice. With 0.7 the limit oscillated above what
/// the provider sustained, and 5.8% of a healthy source's attempts were still 429s.
pub const DEFAULT_DECREASE_FACTOR: f64 = 0.5;

/// Ceiling when neither the source's max concurrency nor the caller's concurrency is
/// known (the default `maxLimit` of Netflix concurrency-limits' `AIMDLimit`).
pub const DEFAULT_MAX_LIMIT: usize = 200;

/// The share of recent outcomes that may be pushback (429) before a 429 cuts the limit:
/// 0.5, a goodput-seeking limit. A 429 answers in well under a second and is retried at
/// once elsewhere or after its hold, so the most successful answers per minute are had
/// with some pushback: a provider whose 429 probability grows linearly with load gives
/// most where `rate x (1 - p)` peaks, which is near `p = 0.5`, not where `p` is zero
/// (the oracle of the soak paces P6's account at about 50% 429s). Measured on P6 (seed
/// 20260721, with slow start and the cache as the other profiles have it): 0.3 47.7
/// ok/min at 99.39%, 0.5 54.8 ok/min at 99.30% (oracle 64.5). Set 0.0 to cut on
/// every 429 episode, for a provider that penalises pushback.
pub const DEFAULT_TOLERATED_PUSHBACK: f64 = 0.5;

/// The weight of one outcome in the pushback share (an EWMA): 0.05, about the last 20
/// outcomes.
pub const PUSHBACK_ALPHA: f64 = 0.05;

/// AIMD settings of one source.
///
/// The ceiling is `min(max_concurrency, caller_concurrency)`, whichever of the two
/// are set, or [`DEFAULT_MAX_LIMIT`] when neither is. An `initial_limit` above the
/// ceiling starts at the ceiling.
#[derive(Clone, Debug, PartialEq)]
pub struct AimdConfig {
    /// Starting limit (default [`DEFAULT_INITIAL_LIMIT`]).
    pub initial_limit: f64,
    /// Floor of the limit (default [`DEFAULT_MIN_LIMIT`]); at least 1.
    pub min_limit: f64,
    /// Multiplicative cut applied on `RateLimited` (default [`DEFAULT_DECREASE_FACTOR`]),
    /// in `(0, 1)`.
    pub decrease_factor: f64,
    /// The source's configured max concurrency, if any.
    pub max_concurrency: Option<usize>,
    /// The caller's concurrency (workers x tasks), if known.
    pub caller_concurrency: Option<usize>,
    /// The share of recent outcomes (EWMA, [`PUSHBACK_ALPHA`]) that may be pushback
    /// before a 429 cuts the limit (default [`DEFAULT_TOLERATED_PUSHBACK`]), in `[0, 1)`.
    pub tolerated_pushback: f64,
}

impl Default for AimdConfig {
    fn default() -> Self {
        Self {
            initial_limit: DEFAULT_INITIAL_LIMIT,
            min_limit: DEFAULT_MIN_LIMIT,
            decrease_factor: DEFAULT_DECREASE_FACTOR,
            max_concurrency: None,
            caller_concurrency: None,
            tolerated_pushback: DEFAULT_TOLERATED_PUSHBACK,
        }
    }
}

impl AimdConfig {
    /// The ceiling of the limit: `min(max_concurrency, caller_concurrency)`, whichever
    /// of the two are set, or [`DEFAULT_MAX_LIMIT`] when neither is.
    #[must_use]
    pub fn ceiling(&self) -> f64 {
        let c = match (self.max_concurrency, self.caller_concurrency) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => DEFAULT_MAX_LIMIT,
        };
        #[allow(clippy::cast_precision_loss)]
        let c = c as f64;
        c
    }

    /// Checks every field.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(0.0..1.0).contains(&self.tolerated_pushback) {
            return Err(crate::error::config_error(
                "tolerated_pushback",
                "must be in [0, 1)",
            ));
        }
        if !(self.min_limit.is_finite() && self.min_limit >= 1.0) {
            return Err(crate::error::config_error(
                "min_limit",
                "must be a finite number >= 1",
            ));
        }
        if !(self.initial_limit.is_finite() && self.initial_limit >= self.min_limit) {
            return Err(crate::error::config_error(
                "initial_limit",
                "must be a finite number >= min_limit",
            ));
        }
        if !(self.decrease_factor > 0.0 && self.decrease_factor < 1.0) {
            return Err(crate::error::config_error("decrease_factor", "must be in (0, 1)"));
        }
        if self.max_concurrency == Some(0) {
            return Err(crate::error::config_error(
                "max_concurrency",
                "must be at least 1",
            ));
        }
        if self.caller_concurrency == Some(0) {
            return Err(crate::error::config_error(
                "caller_concurrency",
                "must be at least 1",
            ));
        }
        if self.ceiling() < self.min_limit {
            return Err(crate::error::config_error(
                "min_limit",
                "is above the ceiling min(max_concurrency, caller_concurrency)",
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
        let cases = [
            (
                AimdConfig {
                    min_limit: 0.5,
                    ..AimdConfig::default()
                },
                "min_limit",
            ),
            (
                AimdConfig {
                    initial_limit: f64::NAN,
                    ..AimdConfig::default()
                },
                "initial_limit",
            ),
            (
                AimdConfig {
                    decrease_factor: 1.0,
                    ..AimdConfig::default()
                },
                "decrease_factor",
            ),
            (
                AimdConfig {
                    max_concurrency: Some(0),
                    ..AimdConfig::default()
                },
                "max_concurrency",
            ),
            (
                AimdConfig {
                    caller_concurrency: Some(0),
                    ..AimdConfig::default()
                },
                "caller_concurrency",
            ),
            (
                AimdConfig {
                    min_limit: 4.0,
                    max_concurrency: Some(2),
                    ..AimdConfig::default()
                },
                "min_limit",
            ),
        ];
        for (cfg, field) in cases {
            let err = cfg.validate().unwrap_err();
            assert_eq!(err.field(), field);
            assert!(err.to_string().contains(field), "{err}");
        }
        assert!(AimdConfig::default().validate().is_ok());
    }

    #[test]
    fn ceiling_is_the_smaller_bound() {
        let c = AimdConfig {
            max_concurrency: Some(10),
            caller_concurrency: Some(64),
            ..AimdConfig::default()
        };
        assert!((c.ceiling() - 10.0).abs() < f64::EPSILON);
        let c = AimdConfig {
            max_concurrency: Some(100),
            caller_concurrency: Some(64),
            ..AimdConfig::default()
        };
        assert!((c.ceiling() - 64.0).abs() < f64::EPSILON);
        #[allow(clippy::cast_precision_loss)]
        let d = DEFAULT_MAX_LIMIT as f64;
        assert!((AimdConfig::default().ceiling() - d).abs() < f64::EPSILON);
    }
}
