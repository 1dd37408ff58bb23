//! Errors created by this crate (besides [`pgw_core::Paced`], the not-admitted answer).

/// A bad configuration field: the workspace's shared [`pgw_core::ConfigError`]
/// (component `aimd`).
pub use pgw_core::ConfigError;

/// A [`ConfigError`] of this crate's configuration.
pub(crate) fn config_error(
    field: impl Into<std::borrow::Cow<'static, str>>,
    reason: impl Into<std::borrow::Cow<'static, str>>,
) -> ConfigError {
    ConfigError::new("aimd", field, reason)
}
