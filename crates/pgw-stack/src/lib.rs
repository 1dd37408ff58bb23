//! The pgw gateway: resilient OpenAI-compatible chat completions as one tower
//! `Service`, composed from the pgw layer crates.
//!
//! ```text
//! Gateway ............. cache (hit returns first), fallback chain of model groups
//!  └ per group: tower-retry-pushback (attempt budget, 429 pushback, re-ask)
//!     └ tower-health-p2c (health-aware order, falls through not-admitted sources)
//!        └ per source: tower-aimd -> tower-breaker-window -> tower-ratelimit-redis
//!           -> validator + telemetry -> pgw-client (watchdogs, hyper-util or a custom transport)
//! ```
//!
//! ```
//! use pgw_stack::{Gateway, GatewayConfig};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), pgw_core::BoxError> {
//! let config = GatewayConfig::from_toml_str(r#"
//!     [[sources]]
//!     name = "s1"
//!     base_url = "http://127.0.0.1:9/v1"
//!     key = "sk-demo"
//!     rpm = 60
//! "#)?;
//! let gateway = Gateway::from_config(config).await?;
//! assert_eq!(gateway.groups(), ["default"]);
//! // gateway.chat(ChatRequest::user("gpt-4o-mini", "hello")).await?
//! # Ok(())
//! # }
//! ```
//!
//! The layer crates are re-exported: [`aimd`], [`breaker`], [`balance`], [`ratelimit`],
//! [`retry`], [`client`], [`core`].

mod attempt;
mod builder;
pub mod cache;
mod cached;
pub mod config;
mod gateway;
mod relay;
mod route;
mod settings;
mod source;
pub mod telemetry;
mod validate;

pub use builder::{GatewayBuilder, TransportFactory};
pub use cache::{CacheKey, CachePartition, CachedAnswer, MemoryCache, NoCache, RedisCache, ResponseCache};
pub use config::{
    BackendKind, CacheWhen, Choices, ConfigError, GatewayConfig, ModelConfig, RouteConfig, SourceConfig,
};
pub use gateway::{AllowedModels, Gateway, GatewayAnswer, GatewayError, SourceHandles};
/// The chunks equivalent to a non-streamed answer (moved to [`pgw_core::openai`],
/// beside the `ChunkAccumulator` that folds them back).
pub use pgw_core::openai::chunks_of;
pub use relay::ChatStream;
pub use settings::{DEFAULT_MAX_CALL_DURATION, GATEWAY_CHOICES};
pub use source::SourceService;
pub use telemetry::{AttemptTelemetry, JsonlSink, MemorySink, PriceTable, TelemetrySink, TracingSink};
pub use validate::{JsonValidator, Validate, Validator, json_text};

pub use pgw_client as client;
pub use pgw_client::{ChatAnswer, ChatCall, SecretKey};
pub use pgw_core as core;
pub use tower_aimd as aimd;
pub use tower_breaker_window as breaker;
pub use tower_health_p2c as balance;
pub use tower_ratelimit_redis as ratelimit;
pub use tower_retry_pushback as retry;
