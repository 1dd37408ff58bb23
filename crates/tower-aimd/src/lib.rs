//! An adaptive (AIMD) concurrency limit per source, as a tower [`Layer`](tower_layer::Layer).
//!
//! Each source has a float limit: initial 8, floor 1, ceiling
//! `min(source max_concurrency, caller concurrency)`. A `RateLimited` outcome (429)
//! halves it, once per congestion episode: the first 429 of a request sent since the
//! last cut cuts and starts a new episode, and the 429s of requests already in flight
//! then do not cut again (as TCP's once per window). It cuts only while pushback is
//! more than a tolerated share of recent outcomes (default 0.5,
//! [`DEFAULT_TOLERATED_PUSHBACK`]: a goodput-seeking limit; 0.0 cuts on every
//! episode). A `Success` adds `1/limit`; before the first cut (slow start, as TCP's) a
//! success while at least half the limit is in flight adds a whole slot. Other
//! outcomes leave it alone, and an error
//! from below that is *not admitted* ([`pgw_core::NotAdmitted`]) changes nothing: it
//! was not an attempt. Outcomes come from a [`pgw_core::Classify`] (default
//! [`pgw_core::OkIsSuccess`]).
//!
//! Two modes:
//! - [`Mode::Wait`] (default): `poll_ready` waits for a slot, like tower's
//!   `ConcurrencyLimit`; use it alone in front of any service.
//! - [`Mode::Shed`]: always ready; a call over the limit answers [`pgw_core::Paced`]
//!   at once (not admitted, not an attempt), so a balancer above tries another
//!   source and waits on the [release signal](AimdHandle::release_signal) when all
//!   are paced.
//!
//! The inflight count returns to zero on success, error, panic in the inner future
//! and drop of the response future. The limit is observable through
//! [`AimdHandle`] (for metrics). The hot path is two atomics; each release answers one
//! counted refusal by waking one waiter of the release signal (the longest waiting
//! first, `Notify::notify_one`), and fires nothing when nobody was refused. The freed
//! slot is not reserved for the woken waiter: a caller arriving meanwhile may take it
//! first (barging; tower's `ConcurrencyLimit` hands it over instead).
//!
//! ```
//! use pgw_core::{Outcome, Paced};
//! use tower::{Service, ServiceExt, service_fn};
//! use tower_aimd::{AimdConfig, AimdLayer};
//! use tower_layer::Layer;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), pgw_core::BoxError> {
//! // 429s come back as an error the classifier recognises.
//! let classify = |r: &Result<&'static str, pgw_core::BoxError>| match r {
//!     Ok(_) => Outcome::Success,
//!     Err(_) => Outcome::RateLimited { retry_after: None },
//! };
//! // Every 429 episode cuts (no tolerated share), to show the cut.
//! let strict = AimdConfig { max_concurrency: Some(16), tolerated_pushback: 0.0, ..AimdConfig::default() };
//! let layer = AimdLayer::new(strict)?.with_classifier(classify);
//! let limits = layer.handle();
//! let mut svc = layer.layer(service_fn(|fail: bool| async move {
//!     if fail { Err::<&'static str, pgw_core::BoxError>("429".into()) } else { Ok("hi") }
//! }));
//!
//! assert_eq!(svc.ready().await?.call(false).await?, "hi");
//! assert_eq!(limits.limit(), 8.125); // + 1/limit
//! assert!(svc.ready().await?.call(true).await.is_err());
//! assert_eq!(limits.limit(), 4.0625); // x 0.5
//! assert_eq!(limits.inflight(), 0);
//!
//! // As a shedding gate (under a balancer): over the limit, answer `Paced` at once.
//! let gate = AimdLayer::new(AimdConfig { initial_limit: 1.0, ..AimdConfig::default() })?.shedding();
//! let mut a = gate.layer(service_fn(|()| std::future::pending::<Result<(), pgw_core::BoxError>>()));
//! let mut b = a.clone();
//! let _first = a.ready().await?.call(());
//! let err = b.ready().await?.call(()).await.unwrap_err();
//! assert!(err.is::<Paced>());
//! # Ok(())
//! # }
//! ```

mod config;
mod error;
mod future;
mod layer;
mod limiter;
mod service;

pub use config::{
    AimdConfig, DEFAULT_DECREASE_FACTOR, DEFAULT_INITIAL_LIMIT, DEFAULT_MAX_LIMIT, DEFAULT_MIN_LIMIT,
    DEFAULT_TOLERATED_PUSHBACK, PUSHBACK_ALPHA,
};
pub use error::ConfigError;
pub use future::ResponseFuture;
pub use layer::{AimdLayer, Mode};
pub use limiter::AimdHandle;
pub use service::Aimd;
