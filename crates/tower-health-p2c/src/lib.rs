//! A health-aware balancer for tower.
//!
//! [`HealthP2c`] sits above one service per source (each usually a stack of gates:
//! AIMD, breaker, rate limit) and below the retry layer. Per call it:
//!
//! 1. orders the sources ([`Policy`]): by default power of two choices (or of
//!    [`BalanceConfig::choices`]) on the score `max(ewma, 0.05) / ((1 + inflight) x latency)` (the latency term is
//!    the EWMA of the time to a successful answer, [`UNMEASURED_LATENCY_S`] before
//!    the first), the rest by descending score,
//!    credible sources (health `>=` [`CREDIBLE_HEALTH_RATIO`] x the best one's) always
//!    before the others: the load term never puts a failing idle source first;
//! 2. moves a source that failed `>= 2` times *in this call* to the tail when a
//!    credible alternative exists. The in-call history travels with the request
//!    ([`pgw_core::CallHistory`] via [`pgw_core::CarriesHistory`]);
//! 3. dispatches to the first source that admits. A source answering *not admitted*
//!    ([`pgw_core::CircuitOpen`], [`pgw_core::QuotaExceeded`], [`pgw_core::Paced`])
//!    costs nothing and is skipped;
//! 4. feeds the attempt's [`pgw_core::Outcome`] (from a [`pgw_core::Classify`]) to the
//!    source's success EWMA and records `(source, outcome)` in the history.
//!
//! When no source admits: if all are breaker-open, the earliest `CircuitOpen` comes
//! back at once; otherwise the call waits for the [wake signal](Sources::wake_signal)
//! (fired by `tower-aimd` on release) or the earliest `retry_after`, at most
//! [`BalanceConfig::max_wait`] (or until the call's deadline, when its history
//! carries a sooner one: [`pgw_core::CallHistory::deadline`]), then fails with
//! [`NoneAdmitted`]. When no source is paced and the earliest `retry_after` is past
//! that, it fails at once instead of sleeping until then for nothing.
//!
//! Health is process-local; the hot path is atomics only and never reads the clock.
//! The source set may change at runtime through [`Sources`] without losing the health
//! of the sources that stay.
//!
//! ```
//! use pgw_core::{CallHistory, CarriesHistory, Paced};
//! use tower::{Service, ServiceExt, service_fn};
//! use tower_health_p2c::{BalanceConfig, HealthP2c, Sources};
//!
//! // A request type that carries the in-call history (http::Request already does).
//! #[derive(Clone, Default)]
//! struct Req(Option<CallHistory>);
//! impl CarriesHistory for Req {
//!     fn call_history(&self) -> Option<&CallHistory> { self.0.as_ref() }
//!     fn set_call_history(&mut self, h: CallHistory) { self.0 = Some(h); }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), pgw_core::BoxError> {
//! type Svc = tower::util::BoxCloneSyncService<Req, &'static str, pgw_core::BoxError>;
//! let paced: Svc = tower::util::BoxCloneSyncService::new(service_fn(|_: Req| async {
//!     Err::<&'static str, pgw_core::BoxError>(Box::new(Paced::new()))
//! }));
//! let ok: Svc = tower::util::BoxCloneSyncService::new(service_fn(|_: Req| async { Ok("answer") }));
//!
//! let sources = Sources::new();
//! sources.insert("busy".into(), paced);
//! sources.insert("free".into(), ok);
//! let mut lb = HealthP2c::new(sources.clone(), BalanceConfig::default())?.with_seed(1);
//!
//! let history = CallHistory::new();
//! let mut req = Req::default();
//! req.set_call_history(history.clone());
//! for _ in 0..5 {
//!     assert_eq!(lb.ready().await?.call(req.clone()).await?, "answer");
//! }
//! // Only dispatched attempts are recorded: the paced source cost nothing.
//! assert_eq!(history.len(), 5);
//! assert!(history.attempts().iter().all(|a| a.source.as_ref().unwrap().as_str() == "free"));
//! assert_eq!(sources.view("busy").unwrap().health(), 1.0);
//! # Ok(())
//! # }
//! ```

mod config;
mod error;
mod future;
mod layer;
mod order;
mod probe;
mod service;
mod sources;

pub use config::{
    BalanceConfig, CHOICES_ALL, CREDIBLE_HEALTH_RATIO, CUT_LATENCY_FACTOR, DEFAULT_CHOICES, DEFAULT_MAX_WAIT,
    DEFAULT_PACED_POLL, DEFAULT_PROBE_EVERY, DEFAULT_SILENT_AFTER, DEPRIORITIZE_AFTER_FAILURES, HEALTH_ALPHA,
    HEALTH_CLASSES, HEALTH_FLOOR, HEALTH_INITIAL, MIN_LATENCY_S, MIN_WAKE_WAIT, OVERSIZE_MEMORY,
    POOR_HEALTH_RATIO, Policy, SILENT_TIMEOUTS, UNMEASURED_LATENCY_S,
};
pub use error::{ConfigError, NoSources, NoneAdmitted, SilentCut};
pub use future::ResponseFuture;
pub use layer::HealthP2cLayer;
pub use service::{ClassOf, HealthP2c, SingleClass};
pub use sources::{SourceHealth, Sources};
