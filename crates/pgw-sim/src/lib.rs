//! A seeded, fault-injecting simulated LLM provider (a half-dead pool of sources).
//!
//! The fault model is a plain tower `Service` ([`SimService`]) over OpenAI-style
//! chat completion requests (`http::Request<Bytes>` carrying a JSON
//! [`ChatRequest`](pgw_core::openai::ChatRequest)). It runs on tokio's clock, so under
//! a paused clock an hour of traffic simulates in seconds, and every random choice
//! comes from a per-source stream seeded from the pool's seed: the same seed and the
//! same arrival order give byte-identical answers. [`http::serve`] serves the same
//! model on loopback for real-time runs.
//!
//! Behaviours, each configurable per source ([`SourceConfig`]): healthy completions
//! with latency distributions (TTFT, tokens/s, length), empty completions, 5xx, 401 on
//! a bad or revoked key, black holes, account-level 429s shared by the sources of one
//! account that grow with the account's request rate and concurrency (with and without
//! `retry-after`), a source's own RPM gate, slow streams with long inter-token gaps,
//! 400 for a fraction of prompts (a function of the prompt text), invalid JSON in JSON
//! mode, and token usage in every answer. [`PoolConfig::p6`] is the P6 pool and
//! [`p6::Traffic`] its traffic mix.
//!
//! The real wire, each knob off by default: faults that change over scenario time
//! ([`Schedule`]: phases, flaps, ramps), hard provider limits ([`HardLimits`]: exact
//! RPM/TPM token buckets and a concurrency cap whose 429s carry an honest
//! `retry-after`), provider error codes (404 `model_not_found`, 400
//! `context_length_exceeded` and `content_policy_violation`, 529 `overloaded_error`,
//! 429 `insufficient_quota`), content-filtered and refused answers, streams without
//! usage, without `[DONE]`, with a malformed chunk or an error event, content-part
//! messages, and the fields OpenAI echoes. [`SourceConfig::at`] tells what a source is
//! like at a scenario second, for clients that read the configuration.
//!
//! ```
//! use bytes::Bytes;
//! use http_body_util::BodyExt;
//! use pgw_core::openai::{ChatRequest, ChatResponse};
//! use pgw_sim::{PoolConfig, SimPool, SourceConfig};
//! use tower_service::Service;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), pgw_core::BoxError> {
//! let config = PoolConfig {
//!     sources: vec![SourceConfig::healthy("a")],
//!     bad_prompt_rate: 0.0,
//!     ..PoolConfig::default()
//! };
//! let pool = SimPool::new(config, 42)?;
//! let mut svc = pool.service("a").expect("configured");
//! let body = serde_json::to_vec(&ChatRequest::user("m", "hello"))?;
//! let req = http::Request::post("/v1/chat/completions").body(Bytes::from(body))?;
//!
//! let started = tokio::time::Instant::now();
//! let resp = svc.call(req).await?; // seconds of virtual time, microseconds of wall time
//! assert_eq!(resp.status(), 200);
//! assert!(started.elapsed().as_secs_f64() >= 0.5); // at least the minimum TTFT
//! let answer: ChatResponse = serde_json::from_slice(&resp.into_body().collect().await?.to_bytes())?;
//! assert!(answer.usage.is_some());
//! assert_eq!(pool.stats().sources["a"].answered_with(200), 1);
//! # Ok(()) }
//! ```

mod answer;
mod body;
pub mod config;
mod dist;
pub mod http;
mod limits;
pub mod p6;
mod pool;
mod request;
pub mod schedule;
mod service;
pub mod stats;

pub use body::SimBody;
pub use config::{
    AccountConfig, AccountSnapshot, CompletionConfig, ConfigError, HardLimits, LogNormal, PoolConfig,
    RateLimitCurve, RetryAfterConfig, SourceConfig, SourceSnapshot, StallConfig, StreamUsage,
};
pub use pool::SimPool;
pub use schedule::{Lerp, Schedule};
pub use service::{ResponseFuture, SimService};
pub use stats::{AccountStats, PoolStats, SourceStats};
