//! The errors this layer creates: why a call ended, with its attempt history.

use std::error::Error;
use std::fmt;
use std::time::Duration;

use pgw_core::{AttemptRecord, BoxError};

/// Why the retry loop gave up on a call.
///
/// Match on it through [`RetryError::reason`]:
///
/// ```
/// use tower_retry_pushback::{Reason, RetryError};
/// # fn handle(err: pgw_core::BoxError) {
/// match err.downcast_ref::<RetryError>().map(RetryError::reason) {
///     Some(Reason::AllCircuitsOpen { retry_after }) => println!("come back in {retry_after:?}"),
///     Some(Reason::Rejected) => println!("the request itself is bad"),
///     Some(_) => println!("gave up: {err}"),
///     None => println!("the inner service failed before any attempt: {err}"),
/// }
/// # }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reason {
    /// The attempt budget (`max_attempts`) is spent on `Transient` and
    /// `SourceDead` outcomes.
    BudgetExhausted,
    /// The answer was refused by the validator `max_reasks + 1` times.
    ReasksExhausted,
    /// The upstream rejected the request itself (400/413/422): another attempt would be
    /// rejected too, so the call fails fast.
    Rejected,
    /// The call has waited longer than `stall_window` and nothing in the process
    /// succeeded within `stall_window`.
    Stalled {
        /// How long this call had been waiting (since its first failed or refused
        /// attempt) when the guard fired.
        waited: Duration,
    },
    /// The service below answered that no source is admitted and all circuits are
    /// open: fail fast, nothing was spent.
    AllCircuitsOpen {
        /// When the first circuit admits again.
        retry_after: Duration,
    },
    /// The next attempt may only be sent after `wait`, longer than the call may still
    /// wait (`limit`: the stall window or the time left before the deadline), so the call
    /// fails now instead of sleeping past it.
    WaitTooLong {
        /// The wait asked for (`Retry-After`, backoff or a gate's `retry_after`).
        wait: Duration,
        /// The longest this call could still wait.
        limit: Duration,
    },
    /// The call's waits on pushback reached `max_pushback_wait`: the 429s it met
    /// had it wait `waited` (the time covered by the waits they asked for, each its
    /// `Retry-After`, else the backoff, slept or held on its source; overlaps once),
    /// and another `wait` would pass `limit`. Waits for pacing, quotas and breakers
    /// do not count.
    PushbackExhausted {
        /// What the call's pushback (429s, 503s and 529s with `Retry-After`) had it
        /// wait so far.
        waited: Duration,
        /// The wait the last pushback asked for.
        wait: Duration,
        /// `max_pushback_wait`.
        limit: Duration,
    },
    /// Nothing below admitted the call and it may not wait for an admission here: its
    /// caller has somewhere else to send it at once (`CallHistory::may_wait` is
    /// false: the next group of a fallback chain). The refusal itself spends nothing;
    /// the attempts before it (a 429 that held the source) are in the history.
    NotAdmittedHere {
        /// When the service below said it may admit (a quota's or hold's end), if it
        /// said.
        retry_after: Option<Duration>,
    },
    /// The call's deadline (`max_call_duration` or the request's own) passed; the
    /// attempt in flight, if any, was dropped.
    DeadlineExceeded,
    /// The shared retry budget has no balance left for another retry.
    RetryBudgetExhausted,
    /// Client-side adaptive throttling dropped the attempt locally.
    Throttled,
    /// Another attempt was needed but the request could not be re-sent (the clone
    /// hook returned `None`).
    NotResendable,
    /// The service below failed its readiness before a retry (its `poll_ready`
    /// error is the [`RetryError`]'s source): a service that errors there cannot be
    /// called again.
    ServiceFailed,
    /// The attempt failed for want of this process's own resources (`Outcome::
    /// LocalExhaustion`: out of file descriptors for the connection): every source
    /// would fail alike, so the call ends at once; nothing was counted against the
    /// source.
    LocalExhaustion,
}

impl Reason {
    /// A short stable name for telemetry: `budget_exhausted`, `reasks_exhausted`,
    /// `rejected`, `stalled`, `all_circuits_open`, `wait_too_long`,
    /// `pushback_exhausted`, `not_admitted_here`, `deadline_exceeded`,
    /// `retry_budget_exhausted`, `throttled`, `not_resendable`, `service_failed`,
    /// `local_exhaustion`.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::BudgetExhausted => "budget_exhausted",
            Self::ReasksExhausted => "reasks_exhausted",
            Self::Rejected => "rejected",
            Self::Stalled { .. } => "stalled",
            Self::AllCircuitsOpen { .. } => "all_circuits_open",
            Self::WaitTooLong { .. } => "wait_too_long",
            Self::PushbackExhausted { .. } => "pushback_exhausted",
            Self::NotAdmittedHere { .. } => "not_admitted_here",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::RetryBudgetExhausted => "retry_budget_exhausted",
            Self::Throttled => "throttled",
            Self::NotResendable => "not_resendable",
            Self::ServiceFailed => "service_failed",
            Self::LocalExhaustion => "local_exhaustion",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BudgetExhausted => f.write_str("attempt budget exhausted"),
            Self::ReasksExhausted => f.write_str("re-ask budget exhausted"),
            Self::Rejected => f.write_str("request rejected"),
            Self::Stalled { waited } => write!(
                f,
                "stalled: waited {:.3}s with no progress in the process",
                waited.as_secs_f64()
            ),
            Self::AllCircuitsOpen { retry_after } => write!(
                f,
                "all circuits open; retry after {:.3}s",
                retry_after.as_secs_f64()
            ),
            Self::WaitTooLong { wait, limit } => write!(
                f,
                "next attempt only in {:.3}s, longer than the call may wait ({:.3}s)",
                wait.as_secs_f64(),
                limit.as_secs_f64()
            ),
            Self::PushbackExhausted { waited, wait, limit } => write!(
                f,
                "pushback wait exhausted: the upstream's pushback (429s, or 503s and 529s with \
                 Retry-After) had the call wait {:.3}s (Retry-After or backoff); another \
                 {:.3}s would pass its limit of {:.3}s",
                waited.as_secs_f64(),
                wait.as_secs_f64(),
                limit.as_secs_f64()
            ),
            Self::NotAdmittedHere {
                retry_after: Some(after),
            } => write!(
                f,
                "not admitted here for {:.3}s, and the call goes elsewhere instead of waiting",
                after.as_secs_f64()
            ),
            Self::NotAdmittedHere { retry_after: None } => {
                f.write_str("not admitted here, and the call goes elsewhere instead of waiting")
            }
            Self::DeadlineExceeded => f.write_str("call deadline exceeded"),
            Self::RetryBudgetExhausted => f.write_str("retry budget exhausted"),
            Self::Throttled => f.write_str("throttled locally (adaptive throttling)"),
            Self::NotResendable => f.write_str("request cannot be re-sent"),
            Self::ServiceFailed => f.write_str("the service below failed before a retry"),
            Self::LocalExhaustion => f.write_str("this process is out of file descriptors for a connection"),
        }
    }
}

/// The final error of a call that did not succeed: why it ended, every attempt it
/// made (source and outcome, oldest first) and the last attempt's error, if the last
/// attempt ended in an error (its [`Error::source`]).
///
/// When the last attempt answered `Ok` with a failing outcome (say an `http::Response`
/// with status 400 under `HttpClassifier`), that response is dropped: map such statuses
/// to errors below this layer (`pgw_core::UpstreamStatus`) to keep their details.
#[derive(Debug)]
pub struct RetryError {
    reason: Reason,
    attempts: Vec<AttemptRecord>,
    last_error: Option<BoxError>,
}

impl RetryError {
    pub(crate) fn new(reason: Reason, attempts: Vec<AttemptRecord>, last_error: Option<BoxError>) -> Self {
        Self {
            reason,
            attempts,
            last_error,
        }
    }

    /// A call whose deadline passed after this layer had answered it: a committed
    /// stream that a layer above relays, cut at the caller's [`CallDeadline`]
    /// (`Reason::DeadlineExceeded`, no attempts of its own).
    ///
    /// [`CallDeadline`]: crate::CallDeadline
    #[must_use]
    pub const fn deadline_exceeded() -> Self {
        Self {
            reason: Reason::DeadlineExceeded,
            attempts: Vec::new(),
            last_error: None,
        }
    }

    /// Why the call ended.
    #[must_use]
    pub const fn reason(&self) -> Reason {
        self.reason
    }

    /// Every attempt of the call, oldest first (not-admitted refusals are not attempts
    /// and do not appear).
    #[must_use]
    pub fn attempts(&self) -> &[AttemptRecord] {
        &self.attempts
    }

    /// Whether an attempt of the call may have reached a provider (and cost it, or a
    /// quota, something): any attempt but one this process could not make
    /// ([`Outcome::LocalExhaustion`](pgw_core::Outcome::LocalExhaustion): out of file
    /// descriptors for the connection, nothing was sent).
    #[must_use]
    pub fn reached_a_provider(&self) -> bool {
        self.attempts
            .iter()
            .any(|a| a.outcome != pgw_core::Outcome::LocalExhaustion)
    }

    /// The error of the last attempt (or of the refusal that ended the call), if any.
    #[must_use]
    pub fn last_error(&self) -> Option<&(dyn Error + Send + Sync + 'static)> {
        self.last_error.as_deref()
    }

    /// Takes the last attempt's error out, e.g. to return the upstream's own error.
    #[must_use]
    pub fn into_last_error(self) -> Option<BoxError> {
        self.last_error
    }
}

impl fmt::Display for RetryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "call failed: {} after {} attempt",
            self.reason,
            self.attempts.len()
        )?;
        if self.attempts.len() != 1 {
            f.write_str("s")?;
        }
        if !self.attempts.is_empty() {
            f.write_str(" [")?;
            for (i, a) in self.attempts.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                match &a.source {
                    Some(s) => write!(f, "{s}: {}", a.outcome)?,
                    None => write!(f, "{}", a.outcome)?,
                }
            }
            f.write_str("]")?;
        }
        if let Some(e) = &self.last_error {
            write!(f, "; last error: {e}")?;
        }
        Ok(())
    }
}

impl Error for RetryError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.last_error.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}

/// A bad configuration field: the workspace's shared [`pgw_core::ConfigError`]
/// (component `retry`).
pub use pgw_core::ConfigError;

/// A [`ConfigError`] of this crate's configuration.
pub(crate) fn config_error(
    field: impl Into<std::borrow::Cow<'static, str>>,
    reason: impl Into<std::borrow::Cow<'static, str>>,
) -> ConfigError {
    ConfigError::new("retry", field, reason)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgw_core::Outcome;

    #[test]
    fn display_lists_attempts_and_cause() {
        let e = RetryError::new(
            Reason::BudgetExhausted,
            vec![
                AttemptRecord {
                    source: Some("s1".into()),
                    outcome: Outcome::Transient,
                    timed_out: false,
                    too_large: false,
                    status: None,
                },
                AttemptRecord {
                    source: None,
                    outcome: Outcome::SourceDead,
                    timed_out: false,
                    too_large: false,
                    status: None,
                },
            ],
            Some("reset".into()),
        );
        assert_eq!(
            e.to_string(),
            "call failed: attempt budget exhausted after 2 attempts [s1: transient, source_dead]; last error: reset"
        );
        assert_eq!(e.source().unwrap().to_string(), "reset");
        let c = config_error("max_attempts", "must be at least 1");
        assert_eq!(
            c.to_string(),
            "invalid retry config: max_attempts: must be at least 1"
        );
    }
}
