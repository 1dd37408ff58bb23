//! A tower retry loop where 429 is pushback, not failure.
//!
//! [`RetryLayer`] wraps any [`Service`](tower_service::Service) whose requests can be
//! re-sent (a [`Resend`] hook, cloning by default) and drives the loop from the shared
//! outcome classes of [`pgw_core::Classify`]:
//!
//! | outcome | what the loop does |
//! |---|---|
//! | `Success` | returns the answer; records progress for the stall guard |
//! | `Transient` | spends one of `max_attempts` (default 3), full-jitter backoff, retries |
//! | `SourceDead` | spends one of `max_attempts`, retries at once under a balancer (the source's breaker is open; the next attempt goes elsewhere), after a backoff when used alone |
//! | `RateLimited` | spends **nothing**; holds the source for `max(Retry-After, backoff)` through a [`Hold`](pgw_core::Hold) hook and goes on at once (or, with no hook, sleeps that long itself) |
//! | `Rejected` | fails at once; `context_length_exceeded` (too large for that source only) spends an attempt and moves on under a balancer (alone: fails at once) |
//! | `Invalid` | re-asks up to `max_reasks` (default 2), apart from the attempt budget |
//! | `LocalExhaustion` | fails at once: `Reason::LocalExhaustion` (this process is out of file descriptors for a connection) |
//! | not admitted | not an attempt: `CircuitOpen` fails at once ([`Reason::AllCircuitsOpen`]); `QuotaExceeded`/`Paced` waits for the gate, then tries again |
//!
//! - A wait longer than the call may still wait (the stall window, the deadline) fails
//!   at once with [`Reason::WaitTooLong`] instead of sleeping past it. The
//!   deadline is set on the call's history too, so a balancer below does not wait
//!   past it for an admission either: a call whose every source is held beyond its
//!   deadline fails at once, not when the deadline comes.
//! - Pushback is bounded: the waits a call's 429s ask for (`max(Retry-After,
//!   backoff)`, slept or held) add up to at most `max_pushback_wait` (default
//!   [`DEFAULT_MAX_PUSHBACK_WAIT`], 60 s); then the call ends with
//!   [`Reason::PushbackExhausted`], so persistent 429s end it (or, in a gateway, move
//!   it down the fallback chain) in seconds. Waits for pacing, quotas and breakers are
//!   not pushback and do not count.
//! - Stall guard: before each retry, a call that has waited longer than
//!   `stall_window` fails with [`Reason::Stalled`] **if** nothing in the process
//!   succeeded within `stall_window` ([`Progress`], one atomic shared by every call).
//! - Optional shared retry budget ([`RetryBudget`]) and client-side adaptive
//!   throttling ([`AdaptiveThrottle`]), both off by default.
//! - Cancellation safe: dropping the call's future drops the attempt in flight,
//!   the hold round trip or the timer; nothing is sent after that.
//! - Every failed call ends with a [`RetryError`] carrying its [`Reason`] and the list of
//!   attempts (source and outcome).
//!
//! The in-call history ([`pgw_core::CallHistory`]) is created per call and attached to
//! the request ([`pgw_core::CarriesHistory`]), so a balancer below (tower-health-p2c)
//! records the source of each attempt: that is where a 429's hold applies. A service
//! that records nothing is fine: the layer records the outcomes itself. With no
//! balancer below, [`HistoryMode::FromFirstRetry`] saves the history's allocation on
//! calls that succeed at once; over tower-health-p2c, [`HistoryMode::OnDemand`] saves
//! it too and still records the source of every failed attempt.
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::time::Duration;
//!
//! use pgw_core::{BoxError, CallHistory, CarriesHistory, Outcome};
//! use tower::{Service, ServiceExt, service_fn};
//! use tower_retry_pushback::{Reason, RetryConfig, RetryError, RetryLayer};
//!
//! #[derive(Clone)]
//! struct Ask(CallHistory);
//! impl CarriesHistory for Ask {
//!     fn call_history(&self) -> Option<&CallHistory> { Some(&self.0) }
//!     fn set_call_history(&mut self, h: CallHistory) { self.0 = h; }
//! }
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! // An upstream answering 429 twice, then "ok".
//! let calls = Arc::new(AtomicU32::new(0));
//! let upstream = {
//!     let calls = calls.clone();
//!     service_fn(move |_: Ask| {
//!         let n = calls.fetch_add(1, Ordering::SeqCst);
//!         async move { if n < 2 { Ok::<_, BoxError>(429u16) } else { Ok(200) } }
//!     })
//! };
//! let classify = |r: &Result<u16, BoxError>| match r {
//!     Ok(200) => Outcome::Success,
//!     Ok(429) => Outcome::RateLimited { retry_after: Some(Duration::from_secs(1)) },
//!     Ok(400) => Outcome::Rejected,
//!     _ => Outcome::Transient,
//! };
//! let layer = RetryLayer::new(RetryConfig::default()).unwrap().classifier(classify);
//! let mut svc = tower::ServiceBuilder::new().layer(layer).service(upstream);
//!
//! // The 429s cost nothing: the call succeeds with the default budget of 3.
//! let answer = svc.ready().await.unwrap().call(Ask(CallHistory::new())).await.unwrap();
//! assert_eq!(answer, 200);
//! assert_eq!(calls.load(Ordering::SeqCst), 3);
//!
//! // A failed call says why, with every attempt.
//! let mut bad = tower::ServiceBuilder::new()
//!     .layer(RetryLayer::default().classifier(classify))
//!     .service(service_fn(|_: Ask| async { Ok::<_, BoxError>(400u16) }));
//! let err = bad.ready().await.unwrap().call(Ask(CallHistory::new())).await.unwrap_err();
//! let err = err.downcast_ref::<RetryError>().unwrap();
//! assert_eq!(err.reason(), Reason::Rejected);
//! assert_eq!(err.attempts().len(), 1);
//! # }
//! ```

mod budget;
mod config;
mod error;
mod future;
mod layer;
mod progress;
mod resend;
mod service;

pub use budget::{AdaptiveThrottle, RetryBudget};
pub use config::{
    DEFAULT_BASE_BACKOFF, DEFAULT_BUDGET_MIN_PER_SEC, DEFAULT_BUDGET_RATIO, DEFAULT_BUDGET_TTL,
    DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_BACKOFF, DEFAULT_MAX_PUSHBACK_WAIT, DEFAULT_MAX_REASKS,
    DEFAULT_STALL_WINDOW, DEFAULT_THROTTLE_K, DEFAULT_THROTTLE_WINDOW, MIN_NOT_ADMITTED_WAIT,
    RetryBudgetConfig, RetryConfig, ThrottleConfig,
};
pub use error::{ConfigError, Reason, RetryError};
pub use future::ResponseFuture;
pub use layer::{HistoryMode, RetryLayer};
pub use progress::Progress;
pub use resend::{ByClone, CallDeadline, HttpResend, Resend};
pub use service::{Retry, RetryStats};
