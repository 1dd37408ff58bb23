//! Where the breaker's state lives: one small trait, two implementations.
//!
//! - [`memory`]: one process, `tokio::time`, a short-held lock per source;
//! - [`redis`](mod@self::redis) (feature `redis`): many processes, one Lua script per
//!   operation, the server's clock, one hash per source under the source's hash tag.
//!
//! Both run the same state machine and pass the same contract suite.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use pgw_core::{BoxError, BreakerVerdict, SourceId};

use crate::config::BreakerConfig;
use crate::state::{BreakerView, Ticket};

pub mod memory;
#[cfg(feature = "redis")]
pub mod redis;

/// A boxed, sendable future.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// The answer of one admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Admitted: record the outcome against this ticket.
    Admitted(Ticket),
    /// Not admitted for `retry_after` (the breaker is open, or half-open with its probe
    /// out).
    Refused {
        /// Time until the breaker may admit again.
        retry_after: Duration,
    },
}

/// A state backend: hands out the gate of each source.
pub trait Backend {
    /// The gate of one source.
    type Gate: Gate;

    /// The gate of `source`, with that source's configuration. Gates of the same source
    /// from the same backend share their state.
    fn gate(&self, source: &SourceId, config: &BreakerConfig) -> Self::Gate;
}

/// One source's breaker state, wherever it lives.
///
/// Contract (checked by the contract suite for every backend): admission and record
/// are atomic and take one round trip each; [`Gate::record`] starts its work at once,
/// so dropping the returned future never loses the record; neither panics nor waits
/// longer than the backend's timeout.
pub trait Gate: Clone + Send + Sync + 'static {
    /// The future of [`Gate::admit`].
    type Admit: Future<Output = Result<Admission, BoxError>> + Send + Unpin + 'static;
    /// The future of [`Gate::record`]: completes when the record has landed (or failed
    /// and been logged).
    type Record: Future<Output = ()> + Send + 'static;

    /// Asks to admit one call. Errors mean the backend is unreachable (admission then
    /// fails closed).
    fn admit(&self) -> Self::Admit;

    /// Records the verdict of a call admitted with `ticket`. [`BreakerVerdict::Ignore`]
    /// ends a probe without a verdict: the lease is released and the next admission may
    /// probe at once. Failures are logged and counted, never returned.
    fn record(&self, ticket: Ticket, verdict: BreakerVerdict) -> Self::Record;

    /// A snapshot of the state, for operators and metrics.
    fn view(&self) -> BoxFuture<Result<BreakerView, BoxError>>;

    /// Records this process could not deliver to the backend.
    fn record_errors(&self) -> u64;

    /// A signal fired when an admission refused now may be admitted before its
    /// `retry_after`: a probe ended (closing the breaker, or freeing its lease for the
    /// next caller). A waiting service ([`Mode::Wait`](crate::Mode::Wait)) wakes on it
    /// as well as on its timer. `None` (the default, and the Redis backend, which
    /// cannot hear another process's probe end): waiters re-ask at their `retry_after`.
    fn changes(&self) -> Option<std::sync::Arc<tokio::sync::Notify>> {
        None
    }
}
