//! The outcome classes of one attempt.

use std::fmt;
use std::time::Duration;

/// What one attempt's result means for the gates above it.
///
/// Produced by a [`Classify`](crate::Classify) implementation; every layer reads the
/// same value, so the breaker, the health EWMA, AIMD and the retry budget can never
/// disagree about what happened.
///
/// | class | breaker | health | AIMD | retry budget |
/// |---|---|---|---|---|
/// | `Success` | success | ok | +1/limit | - |
/// | `RateLimited` | ignored | fail | x0.5 | not consumed |
/// | `Transient` | failure | fail | - | consumed |
/// | `SourceDead` | force open | fail | - | consumed |
/// | `Rejected` | ignored | not fed | - | fail fast |
/// | `Invalid` | ignored | not fed | - | own re-ask budget |
/// | `LocalExhaustion` | ignored | not fed | - | fail fast |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// A real answer (for chat completions: text, a tool call, or the provider's
    /// decline: a content filter's verdict or a refusal, handed to the caller as is).
    Success,
    /// The source pushed back (HTTP 429 `rate_limit_exceeded`, or a 503 / 529
    /// overloaded that said when to come back). `retry_after` is the server's hint, if
    /// any.
    RateLimited {
        /// How long the server asked us to wait, already parsed and capped.
        retry_after: Option<Duration>,
    },
    /// A failure that may not repeat: timeout, connect/reset, 5xx, 529 overloaded
    /// (without `Retry-After`), empty completion, a watchdog cut.
    Transient,
    /// The source cannot serve anyone: 401/403 (`invalid_api_key`), a revoked key, 429
    /// `insufficient_quota` (billing), a wrong base URL.
    SourceDead,
    /// The request itself is bad (400/413/422, `context_length_exceeded`,
    /// `content_policy_violation`, 404 `model_not_found` for the model the caller
    /// named); another source would refuse it too.
    Rejected,
    /// An answer arrived, but the caller's validator refused it.
    Invalid,
    /// The gateway's own process could not make the attempt: it is out of file
    /// descriptors (`EMFILE`, `ENFILE`) for the connection, and nothing was sent.
    /// Nothing about the source: every source would fail alike, so the call ends at
    /// once (a server answers 503 and sheds load), and no breaker, health score,
    /// budget or quota counts it.
    LocalExhaustion,
}

/// What the circuit breaker does with an [`Outcome`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerVerdict {
    /// Counts as a success.
    Success,
    /// Counts as a failure.
    Failure,
    /// Opens the circuit at once, whatever the counters say.
    ForceOpen,
    /// Not evidence about the source's health: not counted at all.
    Ignore,
}

impl Outcome {
    /// The breaker's view of this outcome: `Success` counts as a success, `Transient` as a
    /// failure, `SourceDead` forces the circuit open, and the rest are ignored.
    #[must_use]
    pub const fn breaker_verdict(self) -> BreakerVerdict {
        match self {
            Self::Success => BreakerVerdict::Success,
            Self::Transient => BreakerVerdict::Failure,
            Self::SourceDead => BreakerVerdict::ForceOpen,
            Self::RateLimited { .. } | Self::Rejected | Self::Invalid | Self::LocalExhaustion => {
                BreakerVerdict::Ignore
            }
        }
    }

    /// The sample this outcome feeds to the health EWMA: `Some(true)` for a
    /// success, `Some(false)` for a failure, `None` when it says nothing about the source.
    #[must_use]
    pub const fn health_sample(self) -> Option<bool> {
        match self {
            Self::Success => Some(true),
            Self::RateLimited { .. } | Self::Transient | Self::SourceDead => Some(false),
            Self::Rejected | Self::Invalid | Self::LocalExhaustion => None,
        }
    }

    /// Whether this outcome consumes one unit of the attempt budget: only `Transient` and
    /// `SourceDead` do (a 429 never does).
    #[must_use]
    pub const fn consumes_attempt(self) -> bool {
        matches!(self, Self::Transient | Self::SourceDead)
    }

    /// Whether this outcome is pushback (a 429).
    #[must_use]
    pub const fn is_rate_limited(self) -> bool {
        matches!(self, Self::RateLimited { .. })
    }

    /// Whether this outcome is a success.
    #[must_use]
    pub const fn is_success(self) -> bool {
        matches!(self, Self::Success)
    }

    /// The server's `Retry-After` hint, for `RateLimited`.
    #[must_use]
    pub const fn retry_after(self) -> Option<Duration> {
        match self {
            Self::RateLimited { retry_after } => retry_after,
            _ => None,
        }
    }

    /// The outcome's name as used in telemetry and config: `success`, `rate_limited`,
    /// `transient`, `source_dead`, `rejected`, `invalid`, `local_exhaustion`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::RateLimited { .. } => "rate_limited",
            Self::Transient => "transient",
            Self::SourceDead => "source_dead",
            Self::Rejected => "rejected",
            Self::Invalid => "invalid",
            Self::LocalExhaustion => "local_exhaustion",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RateLimited { retry_after: Some(d) } => {
                write!(f, "rate_limited (retry after {:.3}s)", d.as_secs_f64())
            }
            other => f.write_str(other.as_str()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every class: what it means for the breaker, the health EWMA and the budgets.
    #[test]
    fn accounting_table() {
        let rl = Outcome::RateLimited {
            retry_after: Some(Duration::from_secs(3)),
        };
        let rows = [
            (Outcome::Success, BreakerVerdict::Success, Some(true), false),
            (rl, BreakerVerdict::Ignore, Some(false), false),
            (Outcome::Transient, BreakerVerdict::Failure, Some(false), true),
            (Outcome::SourceDead, BreakerVerdict::ForceOpen, Some(false), true),
            (Outcome::Rejected, BreakerVerdict::Ignore, None, false),
            (Outcome::Invalid, BreakerVerdict::Ignore, None, false),
            (Outcome::LocalExhaustion, BreakerVerdict::Ignore, None, false),
        ];
        for (o, breaker, health, budget) in rows {
            assert_eq!(o.breaker_verdict(), breaker, "{o}");
            assert_eq!(o.health_sample(), health, "{o}");
            assert_eq!(o.consumes_attempt(), budget, "{o}");
        }
        assert_eq!(rl.retry_after(), Some(Duration::from_secs(3)));
        assert!(rl.is_rate_limited());
        assert_eq!(rl.to_string(), "rate_limited (retry after 3.000s)");
    }
}
