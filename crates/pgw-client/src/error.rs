//! Errors the client creates (all classified `Transient` by
//! [`pgw_core::classify_error`]; non-2xx answers are [`pgw_core::UpstreamStatus`] and
//! empty completions [`pgw_core::EmptyCompletion`]).

use std::fmt;
use std::time::Duration;

use pgw_core::BoxError;

/// Which watchdog cut the attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Watchdog {
    /// No first token within `timeouts.first_token`.
    FirstToken,
    /// No chunk within `timeouts.inter_token` after the previous one.
    InterToken,
    /// The attempt ran past `timeouts.total`.
    Total,
}

impl Watchdog {
    /// `first_token`, `inter_token` or `total`, as in configuration and telemetry.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::FirstToken => "first_token",
            Self::InterToken => "inter_token",
            Self::Total => "total",
        }
    }
}

/// A watchdog cut the attempt: outcome `Transient`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchdogCut {
    watchdog: Watchdog,
    after: Duration,
}

impl WatchdogCut {
    /// A cut by `watchdog`, whose limit was `after`.
    #[must_use]
    pub const fn new(watchdog: Watchdog, after: Duration) -> Self {
        Self { watchdog, after }
    }

    /// Which watchdog.
    #[must_use]
    pub const fn watchdog(&self) -> Watchdog {
        self.watchdog
    }

    /// The limit that was exceeded.
    #[must_use]
    pub const fn after(&self) -> Duration {
        self.after
    }
}

impl fmt::Display for WatchdogCut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "watchdog cut the attempt: {} timeout of {:.3}s",
            self.watchdog.as_str(),
            self.after.as_secs_f64()
        )
    }
}

/// What every watchdog cut gives as its source: the workspace's timeout marker.
static TIMED_OUT: pgw_core::TimedOut = pgw_core::TimedOut;

impl std::error::Error for WatchdogCut {
    /// [`pgw_core::TimedOut`]: a cut is a timeout, so `pgw_core::is_timeout` tells it
    /// (and the balancer moves the call's next attempt to another source).
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&TIMED_OUT)
    }
}

/// The upstream answered 2xx with bytes that are not a chat completion (garbage, a
/// truncated stream, an oversized event): outcome `Transient`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MalformedResponse {
    reason: String,
}

impl MalformedResponse {
    /// A new error.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
        }
    }

    /// What was wrong.
    #[must_use]
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for MalformedResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed upstream response: {}", self.reason)
    }
}

impl std::error::Error for MalformedResponse {}

/// An HTTP transport's error (connect, TLS, a connection reset mid-body) whose
/// `Display` tells its whole chain of causes: hyper's own says `client error
/// (Connect)` or `error reading a body from connection` and keeps the reason (refused,
/// a DNS failure, a certificate it rejects, a reset) in its sources, which the logs,
/// the telemetry's `error` field and a failed call's `last error` never showed.
/// `source()` is the transport's error itself, so what walks the chain
/// (`pgw_core::is_timeout`) still finds what is in it.
#[derive(Debug)]
pub struct TransportError {
    inner: BoxError,
}

impl TransportError {
    /// Wraps a transport's error.
    pub fn new(inner: impl Into<BoxError>) -> Self {
        Self { inner: inner.into() }
    }
}

impl fmt::Display for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut told = self.inner.to_string();
        let mut cause = self.inner.source();
        while let Some(c) = cause {
            let text = c.to_string();
            // An error that already repeats its cause's text is not told twice.
            if !text.is_empty() && !told.contains(&text) {
                told.push_str(": ");
                told.push_str(&text);
            }
            cause = c.source();
        }
        f.write_str(&told)
    }
}

impl std::error::Error for TransportError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_watchdog_cut_is_a_timeout_and_a_malformed_answer_is_not() {
        for w in [Watchdog::FirstToken, Watchdog::InterToken, Watchdog::Total] {
            let cut: pgw_core::BoxError = Box::new(WatchdogCut::new(w, Duration::from_secs(8)));
            assert!(pgw_core::is_timeout(&*cut), "{}", w.as_str());
        }
        let bad: pgw_core::BoxError = Box::new(MalformedResponse::new("garbage"));
        assert!(!pgw_core::is_timeout(&*bad));
    }

    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("client error (Connect)")
        }
    }

    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_transport_error_tells_its_causes_and_keeps_its_chain() {
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        let err = TransportError::new(Outer(refused));
        assert_eq!(err.to_string(), "client error (Connect): connection refused");
        let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out");
        let err: pgw_core::BoxError = Box::new(TransportError::new(Outer(timed_out)));
        assert!(pgw_core::is_timeout(&*err), "the chain is still walked");
    }
}
