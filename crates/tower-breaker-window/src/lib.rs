//! A dual-channel circuit breaker for tower, on memory or Redis.
//!
//! A source that fails often must be isolated quickly, while pushback (429) and the
//! random failure streaks of a healthy source must never open it. The breaker keeps
//! two channels:
//!
//! - **consecutive**: `failures >= max(fail_threshold, 2 * max_concurrency)` opens
//!   (per source, never global), unless the window holds enough evidence of health
//!   (`calls >= min_calls` at a failure rate below `fail_rate`);
//! - **rate**: over a `window` kept as two fixed buckets, `calls >= min_calls` and
//!   `failures / calls >= fail_rate` opens, so a source with 10% success is
//!   isolated at its `min_calls`-th sample.
//!
//! An open breaker stays open `cooldown * 2^(streak - 1)`, capped by `max_cooldown`,
//! where only a dead source's verdicts (`SourceDead`) grow the streak: transient
//! failures reopen it for one period, so recovery is seen within one cooldown; then one
//! probe at a time is admitted under a lease with a TTL (an expired lease is re-issued,
//! so a lost probe never hangs a source). Every outcome is recorded against the epoch
//! it was admitted under; stale epochs change nothing. Outcomes come from a
//! [`pgw_core::Classify`]: `RateLimited`, `Rejected`, `Invalid` and `LocalExhaustion` are ignored,
//! `SourceDead` forces the breaker open.
//!
//! By default a refused call fails at once with [`pgw_core::CircuitOpen`] (carrying
//! `retry_after`) without touching the inner service, so a balancer can try the
//! next source; [`BreakerLayer::waiting`] makes `poll_ready` wait instead. With the
//! Redis backend, an unreachable server fails admission closed with
//! [`pgw_core::BackendUnavailable`] and turns records into warnings.
//!
//! ```
//! use std::time::Duration;
//! use pgw_core::{BoxError, CircuitOpen};
//! use tower::{Service, ServiceExt, service_fn};
//! use tower_breaker_window::{BreakerConfig, BreakerLayer, BreakerState};
//! use tower_layer::Layer;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BoxError> {
//! let config = BreakerConfig::builder()
//!     .fail_threshold(3)
//!     .cooldown(Duration::from_secs(30))
//!     .build()?;
//! let layer = BreakerLayer::memory("s1", &config);
//! let handle = layer.handle();
//! let mut svc = layer.layer(service_fn(|fail: bool| async move {
//!     if fail { Err::<&str, BoxError>("reset".into()) } else { Ok("hello") }
//! }));
//!
//! assert_eq!(svc.ready().await?.call(false).await?, "hello");
//! for _ in 0..3 {
//!     assert!(svc.ready().await?.call(true).await.is_err());
//! }
//! // Three consecutive failures on a cold source: open, shed without calling.
//! let err = svc.ready().await?.call(false).await.unwrap_err();
//! let open = err.downcast_ref::<CircuitOpen>().expect("circuit open");
//! assert_eq!(open.retry_after(), Duration::from_secs(30));
//! assert_eq!(handle.view().await?.state, BreakerState::Open);
//! # Ok(())
//! # }
//! ```

pub mod backend;
mod config;
mod error;
mod future;
mod layer;
mod service;
mod state;

pub use backend::memory::{MemoryBackend, MemoryGate};
#[cfg(feature = "redis")]
pub use backend::redis::{DEFAULT_CLOSED_VIEW, RedisBackend, RedisGate};
pub use backend::{Admission, Backend, Gate};
pub use config::{
    BreakerConfig, BreakerConfigBuilder, DEFAULT_FAIL_RATE, DEFAULT_MAX_COOLDOWN_FLOOR, DEFAULT_MIN_CALLS,
    DEFAULT_PROBE_TTL_FLOOR, DEFAULT_WINDOW, MAX_DURATION, RESOLUTION,
};
pub use error::ConfigError;
pub use future::ResponseFuture;
pub use layer::BreakerLayer;
pub use service::{Breaker, BreakerHandle, Mode};
pub use state::{BreakerState, BreakerView, Ticket};
