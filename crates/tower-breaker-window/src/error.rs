//! The errors this crate creates.
//!
//! Refusals are the shared [`pgw_core::CircuitOpen`] (not admitted, B10) and
//! [`pgw_core::BackendUnavailable`] (admission failed closed, B12), returned as
//! [`BoxError`](pgw_core::BoxError) from the response future. Only configuration has
//! its own error.

use std::borrow::Cow;
use std::fmt;

/// An invalid breaker configuration, naming the field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    field: &'static str,
    reason: Cow<'static, str>,
}

impl ConfigError {
    pub(crate) fn new(field: &'static str, reason: impl Into<Cow<'static, str>>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }

    /// The offending field, as spelled in config files (`fail_threshold`, `cooldown_s`, ...).
    #[must_use]
    pub const fn field(&self) -> &'static str {
        self.field
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid breaker config: {} {}", self.field, self.reason)
    }
}

impl std::error::Error for ConfigError {}
