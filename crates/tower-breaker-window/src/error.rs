//! The errors this crate creates.
//!
//! Refusals are the shared [`pgw_core::CircuitOpen`] (not admitted, with the time until
//! the breaker admits again) and [`pgw_core::BackendUnavailable`] (the backend is
//! unreachable, so admission failed closed), returned as
//! [`BoxError`](pgw_core::BoxError) from the response future; configuration errors are
//! the shared [`ConfigError`].

/// A bad configuration field: the workspace's shared [`pgw_core::ConfigError`]
/// (component `breaker`).
pub use pgw_core::ConfigError;

/// A [`ConfigError`] of this crate's configuration.
pub(crate) fn config_error(
    field: impl Into<std::borrow::Cow<'static, str>>,
    reason: impl Into<std::borrow::Cow<'static, str>>,
) -> ConfigError {
    ConfigError::new("breaker", field, reason)
}
