//! The shared vocabulary of the pgw layers.
//!
//! Every pgw layer speaks the same small language, defined once here:
//!
//! - [`Outcome`]: the class of one attempt and what each class
//!   means for the breaker, the health EWMA, AIMD and the retry budget;
//! - [`Classify`]: how any service's `&Result<Res, E>` becomes an [`Outcome`], with
//!   ready classifiers for HTTP ([`HttpClassifier`]) and OpenAI-compatible chat
//!   completions ([`OpenAiClassifier`]), all deciding in one place: a provider's error
//!   by its code and type, then its status ([`classify_upstream`]), an answer by
//!   [`classify_response`] (a refusal or a content filter's verdict is an answer);
//! - the *not admitted* errors a gate answers before dispatch ([`CircuitOpen`],
//!   [`QuotaExceeded`], [`Paced`]) and [`NotAdmitted::of`] to recognise them;
//! - [`retry_after`] parsing, defensive against garbage, and [`headroom`]: what a
//!   provider's `x-ratelimit-*` headers say is left of its limits;
//! - [`SourceId`], the name of a source, and [`CallHistory`], the in-call record the
//!   retry layer and the balancer share;
//! - [`clock::now`]: one clock read per dispatch, shared by the gates it passes through;
//! - [`openai`] chat types and [`sse`] framing, shared by the simulator and the gateway;
//! - with feature `redis`, `redis_conn`: one connection type for standalone and
//!   cluster servers, used by every Redis backend.
//!
//! ```
//! use pgw_core::{Classify, NotAdmitted, OpenAiClassifier, Outcome, QuotaExceeded, BoxError};
//! use std::time::Duration;
//!
//! // A gate refused before dispatch: not an attempt, nothing spent.
//! let err: BoxError = Box::new(QuotaExceeded::new("rpm", Duration::from_secs(4)));
//! assert_eq!(NotAdmitted::of(&*err), Some(NotAdmitted::QuotaExceeded(Duration::from_secs(4))));
//!
//! // An attempt that timed out: a transient failure, one unit of the attempt budget.
//! let timeout: BoxError = Box::new(std::io::Error::from(std::io::ErrorKind::TimedOut));
//! let outcome = OpenAiClassifier.classify(&Err(timeout));
//! assert_eq!(outcome, Outcome::Transient);
//! assert!(outcome.consumes_attempt());
//! ```

mod classify;
pub mod clock;
pub mod error;
pub mod fair;
pub mod headroom;
mod history;
mod hold;
mod http_classify;
mod metric_handles;
pub mod openai;
mod outcome;
pub mod redact;
#[cfg(feature = "redis")]
pub mod redis_conn;
pub mod retry_after;
mod source;
pub mod sse;
pub mod sync;

pub use classify::{Classify, OkIsSuccess, Settle, attempt_outcome, settle};
pub use error::{
    BackendUnavailable, BoxError, CircuitOpen, ConfigError, EmptyCompletion, InvalidResponse, NeverAdmitted,
    NotAdmitted, Paced, ProviderError, QuotaExceeded, TimedOut, UNAVAILABLE_RETRY_AFTER, UpstreamStatus,
    exceeds_source, is_timeout, pushback_is_account_wide,
};
pub use history::{AttemptRecord, CallHistory, CarriesHistory, Recording, RecordingScope};
pub use hold::{Hold, HoldFuture, NoHold};
pub use http_classify::{
    HttpClassifier, OpenAiClassifier, classify_error, classify_response, classify_status, classify_upstream,
    is_local_exhaustion, is_quota_exhausted,
};
pub use metric_handles::MetricHandles;
pub use outcome::{BreakerVerdict, Outcome};
pub use source::SourceId;
