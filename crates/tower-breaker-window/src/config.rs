//! Per-source configuration and its defaults.

use std::time::Duration;

use serde::Deserialize;

use crate::error::ConfigError;

/// Default `min_calls` (Resilience4j's `minimumNumberOfCalls`): the rate channel needs
/// 10 samples before it may open, so a source with little traffic is not judged on a
/// handful of calls.
pub const DEFAULT_MIN_CALLS: u32 = 10;

/// Default `fail_rate`: 0.6, wider than the industry's 0.5 to
/// tolerate LLM gateway jitter.
pub const DEFAULT_FAIL_RATE: f64 = 0.6;

/// Default rate window: 60 s, kept as two 30 s buckets.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(60);

/// Floor of the default `max_cooldown`: `max(300 s, cooldown)`.
pub const DEFAULT_MAX_COOLDOWN_FLOOR: Duration = Duration::from_secs(300);

/// Floor of the derived probe lease TTL: `max(cooldown, 60 s)`. A probe is a real call
/// (seconds to minutes for an LLM); the lease only has to outlive it and bound how long
/// a lost probe (a crashed process) keeps a source half-open.
pub const DEFAULT_PROBE_TTL_FLOOR: Duration = Duration::from_secs(60);

/// The finest duration the backends keep: 1 ms (Redis `TIME` is read in milliseconds).
pub const RESOLUTION: Duration = Duration::from_millis(1);

/// The longest duration a field may take: 365 days. Every sum of a backend's clock
/// and a duration, and the Redis key TTL (4 x the longest one), then stays exact in
/// `u64` milliseconds and in Lua's doubles, and within what `PEXPIRE` accepts.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// The validated configuration of one source's breaker.
///
/// Built with [`BreakerConfig::builder`]; every invalid value is refused by
/// [`BreakerConfigBuilder::build`] with the field's name, never later.
///
/// ```
/// use std::time::Duration;
/// use tower_breaker_window::BreakerConfig;
///
/// let config = BreakerConfig::builder()
///     .fail_threshold(5)
///     .cooldown(Duration::from_secs(30))
///     .max_concurrency(8)
///     .build()?;
/// assert_eq!(config.effective_threshold(), 16); // max(5, 8 * 2)
/// assert_eq!(config.min_calls(), 10);
/// assert_eq!(config.max_cooldown(), Duration::from_secs(300));
///
/// let err = BreakerConfig::builder().cooldown(Duration::from_secs(1)).build().unwrap_err();
/// assert_eq!(err.field(), "fail_threshold");
/// # Ok::<(), tower_breaker_window::ConfigError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct BreakerConfig {
    fail_threshold: u32,
    max_concurrency: u32,
    min_calls: u32,
    fail_rate: f64,
    window: Duration,
    cooldown: Duration,
    max_cooldown: Duration,
    probe_ttl: Duration,
}

impl BreakerConfig {
    /// A builder with every default and no required field set.
    #[must_use]
    pub fn builder() -> BreakerConfigBuilder {
        BreakerConfigBuilder::default()
    }

    /// The configured consecutive-failure threshold.
    #[must_use]
    pub const fn fail_threshold(&self) -> u32 {
        self.fail_threshold
    }

    /// The source's maximum concurrency (`0` when not given).
    #[must_use]
    pub const fn max_concurrency(&self) -> u32 {
        self.max_concurrency
    }

    /// The threshold the consecutive channel uses:
    /// `max(fail_threshold, 2 * max_concurrency)`, per source, never global.
    #[must_use]
    pub const fn effective_threshold(&self) -> u32 {
        let by_concurrency = self.max_concurrency.saturating_mul(2);
        if by_concurrency > self.fail_threshold {
            by_concurrency
        } else {
            self.fail_threshold
        }
    }

    /// Samples the rate channel needs before it may open.
    #[must_use]
    pub const fn min_calls(&self) -> u32 {
        self.min_calls
    }

    /// Failure rate at which the rate channel opens.
    #[must_use]
    pub const fn fail_rate(&self) -> f64 {
        self.fail_rate
    }

    /// The rate window (kept as two buckets of half of it).
    #[must_use]
    pub const fn window(&self) -> Duration {
        self.window
    }

    /// The first open duration; each further open caused by `SourceDead` doubles it,
    /// up to [`max_cooldown`](Self::max_cooldown).
    #[must_use]
    pub const fn cooldown(&self) -> Duration {
        self.cooldown
    }

    /// The cap of the open duration.
    #[must_use]
    pub const fn max_cooldown(&self) -> Duration {
        self.max_cooldown
    }

    /// How long a half-open probe's lease lasts before it is re-issued.
    #[must_use]
    pub const fn probe_ttl(&self) -> Duration {
        self.probe_ttl
    }

    /// The `retry_after` an admission refused because a probe just went out hears:
    /// `min(probe_ttl, cooldown)` (later refusals hear what is left of the probe's
    /// lease, at most `cooldown`). What a caller that sends the probe off its own path
    /// tells itself.
    #[must_use]
    pub fn probe_out_retry_after(&self) -> Duration {
        self.probe_ttl.min(self.cooldown)
    }
}

/// Builds a [`BreakerConfig`]; also deserializable from config files, with durations
/// in seconds (fractions allowed): `fail_threshold = 5`, `cooldown_s = 30`, ...
///
/// ```
/// use tower_breaker_window::BreakerConfigBuilder;
///
/// let b: BreakerConfigBuilder = toml::from_str("fail_threshold = 5\ncooldown_s = 0.25").unwrap();
/// let config = b.build().unwrap();
/// assert_eq!(config.cooldown().as_millis(), 250);
/// ```
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfigBuilder {
    fail_threshold: Option<u32>,
    max_concurrency: Option<u32>,
    min_calls: Option<u32>,
    fail_rate: Option<f64>,
    window_s: Option<f64>,
    cooldown_s: Option<f64>,
    max_cooldown_s: Option<f64>,
    probe_ttl_s: Option<f64>,
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn duration(field: &'static str, secs: Option<f64>) -> Result<Option<Duration>, ConfigError> {
    let Some(s) = secs else { return Ok(None) };
    let d = Duration::try_from_secs_f64(s).map_err(|_| {
        crate::error::config_error(
            field,
            format!("{s} is not a number of seconds from 0.001 to 365 days"),
        )
    })?;
    if d < RESOLUTION {
        return Err(crate::error::config_error(
            field,
            format!("{s}s is shorter than 1 ms"),
        ));
    }
    if d > MAX_DURATION {
        return Err(crate::error::config_error(
            field,
            format!("{s}s is longer than 365 days"),
        ));
    }
    Ok(Some(d))
}

impl BreakerConfigBuilder {
    /// Consecutive failures that open the breaker (required, at least 1; raised to
    /// `2 * max_concurrency` when that is higher).
    #[must_use]
    pub const fn fail_threshold(mut self, n: u32) -> Self {
        self.fail_threshold = Some(n);
        self
    }

    /// The source's maximum concurrency; raises the threshold to `2 * n` when that is
    /// higher.
    #[must_use]
    pub const fn max_concurrency(mut self, n: u32) -> Self {
        self.max_concurrency = Some(n);
        self
    }

    /// Samples before the rate channel may open (default [`DEFAULT_MIN_CALLS`]).
    #[must_use]
    pub const fn min_calls(mut self, n: u32) -> Self {
        self.min_calls = Some(n);
        self
    }

    /// Failure rate in `(0, 1]` that opens the rate channel (default [`DEFAULT_FAIL_RATE`]).
    #[must_use]
    pub const fn fail_rate(mut self, rate: f64) -> Self {
        self.fail_rate = Some(rate);
        self
    }

    /// The rate window, at least 2 ms (default [`DEFAULT_WINDOW`]).
    #[must_use]
    pub fn window(mut self, d: Duration) -> Self {
        self.window_s = Some(secs(d));
        self
    }

    /// The first open duration (required, at least 1 ms).
    #[must_use]
    pub fn cooldown(mut self, d: Duration) -> Self {
        self.cooldown_s = Some(secs(d));
        self
    }

    /// The open duration's cap (default `max(300 s, cooldown)`).
    #[must_use]
    pub fn max_cooldown(mut self, d: Duration) -> Self {
        self.max_cooldown_s = Some(secs(d));
        self
    }

    /// The probe lease TTL (default `max(cooldown, 60 s)`).
    #[must_use]
    pub fn probe_ttl(mut self, d: Duration) -> Self {
        self.probe_ttl_s = Some(secs(d));
        self
    }

    /// Validates and builds.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first invalid or missing field.
    pub fn build(&self) -> Result<BreakerConfig, ConfigError> {
        let fail_threshold = self
            .fail_threshold
            .ok_or_else(|| crate::error::config_error("fail_threshold", "is required"))?;
        if fail_threshold == 0 {
            return Err(crate::error::config_error("fail_threshold", "must be at least 1"));
        }
        let cooldown = duration("cooldown_s", self.cooldown_s)?
            .ok_or_else(|| crate::error::config_error("cooldown_s", "is required"))?;
        let min_calls = self.min_calls.unwrap_or(DEFAULT_MIN_CALLS);
        if min_calls == 0 {
            return Err(crate::error::config_error("min_calls", "must be at least 1"));
        }
        let fail_rate = self.fail_rate.unwrap_or(DEFAULT_FAIL_RATE);
        if !(fail_rate > 0.0 && fail_rate <= 1.0) {
            return Err(crate::error::config_error(
                "fail_rate",
                format!("{fail_rate} is not in (0, 1]"),
            ));
        }
        let window = duration("window_s", self.window_s)?.unwrap_or(DEFAULT_WINDOW);
        if window < 2 * RESOLUTION {
            return Err(crate::error::config_error(
                "window_s",
                "must be at least 2 ms (two buckets)",
            ));
        }
        let max_cooldown = duration("max_cooldown_s", self.max_cooldown_s)?
            .unwrap_or(DEFAULT_MAX_COOLDOWN_FLOOR.max(cooldown));
        if max_cooldown < cooldown {
            return Err(crate::error::config_error(
                "max_cooldown_s",
                format!(
                    "{}s is shorter than cooldown_s {}s",
                    secs(max_cooldown),
                    secs(cooldown)
                ),
            ));
        }
        let probe_ttl =
            duration("probe_ttl_s", self.probe_ttl_s)?.unwrap_or(DEFAULT_PROBE_TTL_FLOOR.max(cooldown));
        Ok(BreakerConfig {
            fail_threshold,
            max_concurrency: self.max_concurrency.unwrap_or(0),
            min_calls,
            fail_rate,
            window,
            cooldown,
            max_cooldown,
            probe_ttl,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> BreakerConfigBuilder {
        BreakerConfig::builder()
            .fail_threshold(5)
            .cooldown(Duration::from_secs(30))
    }

    #[test]
    fn defaults_follow_the_design() {
        let c = base().build().unwrap();
        assert_eq!(c.min_calls(), 10);
        assert!((c.fail_rate() - 0.6).abs() < f64::EPSILON);
        assert_eq!(c.window(), Duration::from_secs(60));
        assert_eq!(c.max_cooldown(), Duration::from_secs(300));
        assert_eq!(c.probe_ttl(), Duration::from_secs(60));
        assert_eq!(c.effective_threshold(), 5);
        let long = base().cooldown(Duration::from_secs(400)).build().unwrap();
        assert_eq!(long.max_cooldown(), Duration::from_secs(400));
        assert_eq!(long.probe_ttl(), Duration::from_secs(400));
        assert_eq!(
            base().max_concurrency(2).build().unwrap().effective_threshold(),
            5
        );
        assert_eq!(
            base().max_concurrency(3).build().unwrap().effective_threshold(),
            6
        );
    }

    #[test]
    fn every_bad_field_is_named() {
        let cases: Vec<(BreakerConfigBuilder, &str)> = vec![
            (
                BreakerConfig::builder().cooldown(Duration::from_secs(1)),
                "fail_threshold",
            ),
            (base().fail_threshold(0), "fail_threshold"),
            (BreakerConfig::builder().fail_threshold(1), "cooldown_s"),
            (base().cooldown(Duration::ZERO), "cooldown_s"),
            (base().cooldown(Duration::from_micros(999)), "cooldown_s"),
            (base().min_calls(0), "min_calls"),
            (base().fail_rate(0.0), "fail_rate"),
            (base().fail_rate(1.5), "fail_rate"),
            (base().fail_rate(f64::NAN), "fail_rate"),
            (base().window(Duration::from_millis(1)), "window_s"),
            (base().max_cooldown(Duration::from_secs(10)), "max_cooldown_s"),
            (base().probe_ttl(Duration::ZERO), "probe_ttl_s"),
            // Beyond MAX_DURATION the backends' clock arithmetic would overflow.
            (
                base().cooldown(Duration::from_secs(100_000_000_000_000_000)),
                "cooldown_s",
            ),
            (base().max_cooldown(MAX_DURATION + RESOLUTION), "max_cooldown_s"),
            (base().window(Duration::MAX), "window_s"),
            (base().probe_ttl(MAX_DURATION * 2), "probe_ttl_s"),
        ];
        for (b, field) in cases {
            let err = b.build().unwrap_err();
            assert_eq!(err.field(), field, "{err}");
            assert!(err.to_string().contains(field), "{err}");
        }
        let neg: BreakerConfigBuilder = toml::from_str("fail_threshold = 1\ncooldown_s = -1").unwrap();
        assert_eq!(neg.build().unwrap_err().field(), "cooldown_s");
        let huge: BreakerConfigBuilder = toml::from_str("fail_threshold = 1\ncooldown_s = 1e300").unwrap();
        assert_eq!(huge.build().unwrap_err().field(), "cooldown_s");
        let longest = base()
            .cooldown(MAX_DURATION)
            .window(MAX_DURATION)
            .probe_ttl(MAX_DURATION)
            .build()
            .unwrap();
        assert_eq!(longest.max_cooldown(), MAX_DURATION);
        let unknown = toml::from_str::<BreakerConfigBuilder>("fail_threshold = 1\ncooldown = 3");
        assert!(unknown.is_err());
    }
}
