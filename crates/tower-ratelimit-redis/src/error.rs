//! The limiter's errors.
//!
//! Not admitted is [`QuotaExceeded`] (re-exported from `pgw_core`), a backend that
//! cannot be reached is [`BackendUnavailable`] (admission fails closed); both come as a
//! `BoxError` from the response future. The errors defined here are the limiter's own.

use std::error::Error;
use std::fmt;

pub use pgw_core::{BackendUnavailable, QuotaExceeded};

/// A bad configuration field: the workspace's shared [`pgw_core::ConfigError`]
/// (component `rate limit`).
pub use pgw_core::ConfigError;

/// A [`ConfigError`] of this crate's configuration.
pub(crate) fn config_error(
    field: impl Into<std::borrow::Cow<'static, str>>,
    reason: impl Into<std::borrow::Cow<'static, str>>,
) -> ConfigError {
    ConfigError::new("rate limit", field, reason)
}

/// The request's token estimate is larger than a whole window's token quota: it can
/// never be admitted by this source, so it is refused at once instead of waiting
/// forever. Its source is [`pgw_core::NeverAdmitted`]: not admitted here, waiting
/// would not help, another source may take it (`NotAdmitted::Never`); never an
/// outcome of the source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestTooLarge {
    tokens: u64,
    quota: u64,
    scope: String,
}

impl RequestTooLarge {
    pub(crate) fn new(tokens: u64, quota: u64, scope: String) -> Self {
        Self { tokens, quota, scope }
    }

    /// The request's token estimate.
    #[must_use]
    pub const fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The token quota per window it exceeds.
    #[must_use]
    pub const fn quota(&self) -> u64 {
        self.quota
    }

    /// The scope whose quota it exceeds (`source:NAME` or `account:NAME`).
    #[must_use]
    pub fn scope(&self) -> &str {
        &self.scope
    }
}

impl fmt::Display for RequestTooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "request too large: estimated {} tokens exceed the whole token quota of {} per window for {}",
            self.tokens, self.quota, self.scope
        )
    }
}

/// The source of every [`RequestTooLarge`].
static NEVER: pgw_core::NeverAdmitted = pgw_core::NeverAdmitted;

impl Error for RequestTooLarge {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&NEVER)
    }
}

/// A hold was asked for a source no limiter of this [`Holds`](crate::Holds) knows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownSource(pub(crate) String);

impl fmt::Display for UnknownSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "no rate limiter is configured for source {}", self.0)
    }
}

impl Error for UnknownSource {}
