//! Errors created by the balancer. Errors of the sources pass up unchanged (boxed).

use std::error::Error;
use std::fmt;
use std::time::Duration;

use pgw_core::BoxError;

/// A bad configuration field: the workspace's shared [`pgw_core::ConfigError`]
/// (component `balancer`).
pub use pgw_core::ConfigError;

/// A [`ConfigError`] of this crate's configuration.
pub(crate) fn config_error(
    field: impl Into<std::borrow::Cow<'static, str>>,
    reason: impl Into<std::borrow::Cow<'static, str>>,
) -> ConfigError {
    ConfigError::new("balancer", field, reason)
}

/// The source set is empty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoSources;

impl fmt::Display for NoSources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("no sources to balance over")
    }
}

impl Error for NoSources {}

/// No source admitted the call within `max_wait`, or none can before `max_wait` ends.
///
/// Its [`source`](Error::source) is the refusal of the last round that says best when
/// to come back: a [`pgw_core::Paced`] if a source was paced, else the
/// [`pgw_core::QuotaExceeded`] with the earliest `retry_after`. So
/// [`pgw_core::NotAdmitted::of`] still recognises it (no attempt was made) and a retry
/// layer above waits for the earliest quota, not whichever was refused last.
#[derive(Debug)]
pub struct NoneAdmitted {
    waited: Duration,
    last: BoxError,
}

impl NoneAdmitted {
    pub(crate) fn new(waited: Duration, last: BoxError) -> Self {
        Self { waited, last }
    }

    /// How long the call waited.
    #[must_use]
    pub const fn waited(&self) -> Duration {
        self.waited
    }
}

impl fmt::Display for NoneAdmitted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no source admitted the call within {:.3}s (last answer: {})",
            self.waited.as_secs_f64(),
            self.last
        )
    }
}

impl Error for NoneAdmitted {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.last)
    }
}

/// An attempt cut by slow-call detection: its source answered nothing for `quiet`
/// while it was in flight, and it had run for `age`
/// ([`BalanceConfig::cut_silent`](crate::BalanceConfig::cut_silent)).
///
/// Its [`source`](Error::source) is [`pgw_core::TimedOut`]: a retry layer above treats
/// it as a timed-out attempt and sends the next one elsewhere at once, and the
/// source counts it as one more timeout with nothing heard.
#[derive(Clone, Debug)]
pub struct SilentCut {
    quiet: Duration,
    age: Duration,
}

impl SilentCut {
    pub(crate) const fn new(quiet: Duration, age: Duration) -> Self {
        Self { quiet, age }
    }

    /// How long the source had answered nothing when the attempt was cut.
    #[must_use]
    pub const fn quiet(&self) -> Duration {
        self.quiet
    }

    /// How long the attempt had been in flight.
    #[must_use]
    pub const fn age(&self) -> Duration {
        self.age
    }
}

impl fmt::Display for SilentCut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "attempt cut after {:.1}s in flight: its source answered nothing for {:.1}s \
             (slow-call detection)",
            self.age.as_secs_f64(),
            self.quiet.as_secs_f64()
        )
    }
}

impl Error for SilentCut {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&pgw_core::TimedOut)
    }
}
