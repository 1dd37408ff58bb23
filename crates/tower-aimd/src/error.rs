//! Errors created by this crate (besides [`pgw_core::Paced`], the not-admitted answer).

use std::fmt;

/// A bad [`AimdConfig`](crate::AimdConfig) field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    field: &'static str,
    reason: &'static str,
}

impl ConfigError {
    pub(crate) const fn new(field: &'static str, reason: &'static str) -> Self {
        Self { field, reason }
    }

    /// The name of the bad field.
    #[must_use]
    pub const fn field(&self) -> &'static str {
        self.field
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid aimd config: `{}` {}", self.field, self.reason)
    }
}

impl std::error::Error for ConfigError {}
