//! A tower rate limiter for LLM providers: requests, tokens and concurrent calls per
//! window, per source and per account, shared by every process through Redis.
//!
//! A provider's quota is shared by every process that calls it, so the limiter's
//! state lives in a [`Backend`]: [`RedisBackend`] (every process; windows on the Redis
//! server clock; one Lua script and at most one round trip per admission, all
//! dimensions checked and reserved atomically, none at all for a limiter with nothing
//! to enforce but holds; works on Redis Cluster) or [`MemoryBackend`] (one process; the
//! tokio clock; no lock on the hot path of requests and tokens, a short one on a
//! scope's lease list when it has a concurrency quota). Both keep one contract.
//!
//! - **Dimensions** per scope ([`Quota`]): requests per window, tokens per window,
//!   concurrent requests. **Scopes**: the source, and optionally an account shared by
//!   several sources. No window ever admits more than its quota.
//! - **Tokens** are reserved at admission from an estimate ([`TokenEstimate`]; chat
//!   requests: prompt bytes / 3 + `max_tokens`) and reconciled to the usage the
//!   response reports ([`UsageReport`]): a refund in the admission's sub-window while
//!   it is in the window, an overrun in the settle's sub-window. A request larger
//!   than a whole window's token quota is refused at once ([`RequestTooLarge`]).
//! - **Concurrency** slots are leases with a TTL, renewed while a call runs, released
//!   on every path (success, error, panic, drop); a dead process loses its slots when
//!   the TTL expires.
//! - **Holds** ([`RateLimiter::hold`], [`Holds`] as `pgw_core::Hold`): a source or an
//!   account is not admitted until a time, in every process (429 pushback).
//! - **What is held** ([`RateLimiter::held`]): the leases and holds a limiter's scopes
//!   hold in the backend right now, read from the backend itself (after a run: was
//!   anything left behind?).
//! - Not admitted is [`QuotaExceeded`] `{ retry_after }` (shedding, the default) or a
//!   wait ([`Mode::Wait`]: in memory a first-come-first-served queue per scope woken
//!   one waiter per freed slot; on Redis a wait keyed to `retry_after`, with jitter);
//!   an unreachable backend fails closed with [`BackendUnavailable`].
//! - Every [`Admission`] records its instant on the limiter's clock: bucket by it to
//!   check windows exactly ([`RateLimitLayer::on_admission`]).
//!
//! ```
//! use std::time::Duration;
//! use tower::{Service, ServiceExt, service_fn};
//! use tower_ratelimit_redis::{
//!     MemoryBackend, NoTokens, QuotaExceeded, Quota, RateLimitConfig, RateLimitLayer, RateLimiter,
//! };
//! use tower_layer::Layer;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let limiter = RateLimiter::new(
//!     RateLimitConfig::new("s4", Quota::unlimited().requests(2)).window(Duration::from_secs(60)),
//!     MemoryBackend::new(),
//! )
//! .unwrap();
//! let layer = RateLimitLayer::new(limiter)
//!     .token_estimate(NoTokens)
//!     .usage(NoTokens)
//!     .on_admission(|req: &String, adm: &tower_ratelimit_redis::Admission| {
//!         println!("{req} admitted at {:?} in window {}", adm.at(), adm.window());
//!     });
//! let mut svc = layer.layer(service_fn(|req: String| async move {
//!     Ok::<_, std::convert::Infallible>(req.len())
//! }));
//!
//! assert_eq!(svc.ready().await.unwrap().call("a".into()).await.unwrap(), 1);
//! assert_eq!(svc.ready().await.unwrap().call("bb".into()).await.unwrap(), 2);
//! let err = svc.ready().await.unwrap().call("ccc".into()).await.unwrap_err();
//! let q = err.downcast_ref::<QuotaExceeded>().unwrap();
//! assert_eq!(q.dimension(), "rpm");
//! // Until the first admission leaves the span: a window and a sub-window (1 s).
//! assert!(q.retry_after() <= Duration::from_secs(61));
//! # }
//! ```

mod backend;
mod config;
mod error;
mod future;
mod hooks;
mod layer;
mod limiter;
mod service;

pub use backend::{Backend, Clock, Held, HoldScope, MemoryBackend, PROBE_RETRY, RedisBackend, ScopeHeld};
pub use config::{
    DEFAULT_HOLD_REFRESH, DEFAULT_KEY_PREFIX, DEFAULT_LEASE_TTL, DEFAULT_SLOT_RETRY_AFTER,
    DEFAULT_SUB_WINDOWS, DEFAULT_WINDOW, MAX_QUOTA, MAX_SUB_WINDOWS, MAX_WAIT_JITTER, Mode, Quota,
    RENEW_FRACTION, RateLimitConfig, SLOT_BACKOFF_DOUBLINGS,
};
pub use error::{BackendUnavailable, ConfigError, QuotaExceeded, RequestTooLarge, UnknownSource};
pub use future::ResponseFuture;
pub use hooks::{
    AdmissionObserver, ChatEstimate, ChatUsage, EstimateTokens, NoObserver, NoTokens, ReportsUsage,
    TokenEstimate, UsageReport,
};
pub use layer::RateLimitLayer;
pub use limiter::{Admission, Holds, LimiterStats, Permit, RateLimiter, Renewal};
pub use service::RateLimit;
