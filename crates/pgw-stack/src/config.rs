//! Gateway configuration: a TOML file, `PGW__...` environment overrides, every
//! default named and documented.
//!
//! ```toml
//! backend = "memory"                 # or "redis" (then redis_url is required)
//! # redis_url = "redis://127.0.0.1:6379"          # standalone
//! # redis_url = "redis+cluster://h1:7000,h2:7001" # cluster
//! fallback = ["primary", "backup"]   # group order; default: groups in source order
//!
//! [[sources]]
//! name = "s1"
//! group = "primary"
//! base_url = "https://api.openai.com/v1"
//! key = "sk-..."                     # or key_env = "OPENAI_API_KEY"
//! model = "gpt-4o-mini"              # optional override of the request's model
//! rpm = 500                          # optional quotas; 0 or absent = unlimited
//! tpm = 200000
//! max_concurrency = 16
//! account = "acct-a"                 # optional: several sources sharing one account
//! first_token_timeout_s = 30
//!
//! [accounts.acct-a]
//! rpm = 1000
//!
//! [retry]
//! max_attempts = 3
//!
//! [cache]
//! ttl_s = 600
//!
//! # Or, instead of groups and `fallback`, model routing (see ModelConfig):
//! [models.gpt-4o]
//! routes = [{ source = "s1", model = "gpt-4o-2024-08-06" }]
//! fallback = ["gpt-4o-mini"]
//! ```
//!
//! An environment variable `PGW__A__B=value` sets `a.b` (segments lowercased; a
//! number indexes an array: `PGW__SOURCES__0__KEY=sk-...`). The value is read as a
//! TOML value when it parses as one (`5`, `true`, `0.5`, `["a"]`), else as a string.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::time::Duration;

use pgw_client::{KeyHeader, SecretKey, SourceSettings, Timeouts};
use serde::Deserialize;

/// Default breaker consecutive-failure threshold: 5, the value of the production
/// client the design was measured on; raised per source to `2 x max_concurrency`.
pub const DEFAULT_FAIL_THRESHOLD: u32 = 5;
/// Default breaker cooldown: 10 s, the first open duration and the period at which a
/// source with transient failures is probed (only a dead source's streak doubles it):
/// traffic returns within 10 s of a recovery. The original design had 30 s;
/// measured on the flapping soak (a source failing one minute in two), 30 s with the
/// old doubling 131 ok/min, 10 s without it 174 ok/min; P6 unchanged within noise.
pub const DEFAULT_COOLDOWN_S: f64 = 10.0;
/// Default cache TTL: 600 s (an identical prompt within ten minutes gets the same answer).
pub const DEFAULT_CACHE_TTL_S: f64 = 600.0;
/// Default TTL of an answer from a fallback group: 10 s, the breaker's default
/// cooldown ([`DEFAULT_COOLDOWN_S`]): by then the primary is probed again, and an
/// answer of the backup must not be served once the primary answers.
pub const DEFAULT_CACHE_FALLBACK_TTL_S: f64 = DEFAULT_COOLDOWN_S;
/// Default cache size bound: 10,000 answers (memory backend).
pub const DEFAULT_CACHE_MAX_ENTRIES: usize = 10_000;
/// Default key prefix of every Redis key the gateway writes: `pgw`.
pub const DEFAULT_KEY_PREFIX: &str = "pgw";
/// Default group name of a source that names none: `default`.
pub const DEFAULT_GROUP: &str = "default";

/// A configuration that cannot work, naming the field as a path (`sources[2].rpm`):
/// the workspace's shared [`pgw_core::ConfigError`] (component `gateway`).
pub use pgw_core::ConfigError;

/// A [`ConfigError`] of this crate's configuration.
pub(crate) fn config_error(field: impl AsRef<str>, reason: impl Into<String>) -> ConfigError {
    ConfigError::new("gateway", field.as_ref().to_owned(), reason.into())
}

/// Where shared state lives (one switch for breaker, limiter and cache).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// One process (the default).
    #[default]
    Memory,
    /// Several processes sharing one Redis (standalone or cluster, `redis_url`).
    Redis,
}

/// The whole gateway configuration. Every field has a default except `sources`.
///
/// `Debug` redacts the password of `redis_url` and the sources' keys.
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// `memory` (default) or `redis`.
    #[serde(default)]
    pub backend: BackendKind,
    /// `redis://host:port[/db]` or `redis+cluster://h1:p1,h2:p2`; required with
    /// `backend = "redis"`.
    #[serde(default)]
    pub redis_url: Option<String>,
    /// Prefix of every Redis key (default [`DEFAULT_KEY_PREFIX`]).
    #[serde(default)]
    pub key_prefix: Option<String>,
    /// Group order of the fallback chain. Default: groups in order of first
    /// appearance in `sources`.
    #[serde(default)]
    pub fallback: Vec<String>,
    /// The sources.
    #[serde(default)]
    pub sources: Vec<SourceConfig>,
    /// Quotas of accounts shared by several sources.
    #[serde(default)]
    pub accounts: BTreeMap<String, AccountConfig>,
    /// Retry loop (tower-retry-pushback).
    #[serde(default)]
    pub retry: RetrySection,
    /// Balancer (tower-health-p2c).
    #[serde(default)]
    pub balance: BalanceSection,
    /// Breaker (tower-breaker-window); `fail_threshold` and `cooldown_s` default to
    /// [`DEFAULT_FAIL_THRESHOLD`] and [`DEFAULT_COOLDOWN_S`], the rest to the crate's.
    #[serde(default)]
    pub breaker: BreakerSection,
    /// AIMD (tower-aimd).
    #[serde(default)]
    pub aimd: AimdSection,
    /// Rate limiter (tower-ratelimit-redis).
    #[serde(default)]
    pub ratelimit: RateLimitSection,
    /// Response cache.
    #[serde(default)]
    pub cache: CacheSection,
    /// Telemetry.
    #[serde(default)]
    pub telemetry: TelemetrySection,
    /// Prices per model, for telemetry's cost.
    #[serde(default)]
    pub prices: BTreeMap<String, Price>,
    /// Model routing: each public model name the callers may ask for, with its routes
    /// (source + upstream model), its fallback chain and its context-window fallback
    /// chain. Empty (the default): the caller's `model` is forwarded (unless a source
    /// overrides it) and every call walks the groups in `fallback` order.
    #[serde(default)]
    pub models: BTreeMap<String, ModelConfig>,
}

impl fmt::Debug for GatewayConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GatewayConfig")
            .field("backend", &self.backend)
            .field(
                "redis_url",
                &self.redis_url.as_deref().map(pgw_core::redis_conn::redact_url),
            )
            .field("key_prefix", &self.key_prefix)
            .field("fallback", &self.fallback)
            .field("sources", &self.sources)
            .field("accounts", &self.accounts)
            .field("retry", &self.retry)
            .field("balance", &self.balance)
            .field("breaker", &self.breaker)
            .field("aimd", &self.aimd)
            .field("ratelimit", &self.ratelimit)
            .field("cache", &self.cache)
            .field("telemetry", &self.telemetry)
            .field("prices", &self.prices)
            .field("models", &self.models)
            .finish()
    }
}

/// One source.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// Unique name, used in telemetry, Redis keys and errors.
    pub name: String,
    /// Model group (default [`DEFAULT_GROUP`]).
    #[serde(default)]
    pub group: Option<String>,
    /// Base URL (`.../v1`); the client posts to `{base_url}/chat/completions`.
    pub base_url: String,
    /// The API key (redacted everywhere). One of `key` and `key_env` is required.
    #[serde(default)]
    pub key: Option<SecretKey>,
    /// The name of an environment variable holding the key.
    #[serde(default)]
    pub key_env: Option<String>,
    /// Model override.
    #[serde(default)]
    pub model: Option<String>,
    /// Requests per rate window (absent or 0: unlimited).
    #[serde(default)]
    pub rpm: Option<i64>,
    /// Tokens per rate window (absent or 0: unlimited).
    #[serde(default)]
    pub tpm: Option<i64>,
    /// Concurrent requests (absent or 0: unlimited); also the AIMD ceiling and the
    /// breaker's consecutive-failure threshold floor (`2 x max_concurrency`).
    #[serde(default)]
    pub max_concurrency: Option<i64>,
    /// The account this source's key belongs to (quotas in `[accounts.NAME]`).
    #[serde(default)]
    pub account: Option<String>,
    /// Connect timeout, seconds (default [`pgw_client::DEFAULT_CONNECT_TIMEOUT`]).
    #[serde(default)]
    pub connect_timeout_s: Option<f64>,
    /// Time to first token, seconds (default [`pgw_client::DEFAULT_FIRST_TOKEN_TIMEOUT`]).
    #[serde(default)]
    pub first_token_timeout_s: Option<f64>,
    /// Inter-token stall, seconds (default [`pgw_client::DEFAULT_INTER_TOKEN_TIMEOUT`]).
    #[serde(default)]
    pub inter_token_timeout_s: Option<f64>,
    /// Whole attempt, seconds (default [`pgw_client::DEFAULT_TOTAL_TIMEOUT`]).
    #[serde(default)]
    pub total_timeout_s: Option<f64>,
    /// Whether the source continues an answer from a trailing assistant message (an
    /// assistant prefill), so that a stream cut after it reached the caller can be
    /// finished here: the request is re-sent with the text so far and only the
    /// continuation is streamed on. Default `false`: OpenAI's API does not continue a
    /// trailing assistant message (it answers it); Anthropic-style and most
    /// self-hosted (vLLM, llama.cpp with `continue_final_message`) do.
    #[serde(default)]
    pub accepts_prefill: bool,
    /// Whether a streamed request asks the source for its usage chunk
    /// (`stream_options.include_usage`; default `true`), so the token quota settles to
    /// real usage. `false` for a server that refuses the field with a 400 (older Azure
    /// OpenAI API versions): its streamed calls settle to the estimate.
    #[serde(default)]
    pub stream_usage: Option<bool>,
    /// The header the key goes in: `"authorization"` sends `Bearer <key>`, any other
    /// name the bare key (`"api-key"`, `"x-api-key"`; not one the client sets itself,
    /// such as `"content-type"`). Default: `"api-key"` for an Azure OpenAI host
    /// (`*.openai.azure.com`, `*.cognitiveservices.azure.com`, `*.openai.azure.us`,
    /// `*.cognitiveservices.azure.us`, `*.openai.azure.cn`), else `"authorization"`.
    #[serde(default)]
    pub key_header: Option<String>,
}

impl fmt::Debug for SourceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SourceConfig")
            .field("name", &self.name)
            .field("group", &self.group)
            .field("base_url", &pgw_core::redact::redact_endpoint(&self.base_url))
            .field("key", &self.key)
            .field("key_env", &self.key_env)
            .field("model", &self.model)
            .field("rpm", &self.rpm)
            .field("tpm", &self.tpm)
            .field("max_concurrency", &self.max_concurrency)
            .field("account", &self.account)
            .field("accepts_prefill", &self.accepts_prefill)
            .field("stream_usage", &self.stream_usage)
            .field("key_header", &self.key_header)
            .finish_non_exhaustive()
    }
}

impl SourceConfig {
    /// A source named `name` at `base_url` with `key`, every other field default.
    pub fn new(name: impl Into<String>, base_url: impl Into<String>, key: SecretKey) -> Self {
        Self {
            name: name.into(),
            group: None,
            base_url: base_url.into(),
            key: Some(key),
            key_env: None,
            model: None,
            rpm: None,
            tpm: None,
            max_concurrency: None,
            account: None,
            connect_timeout_s: None,
            first_token_timeout_s: None,
            inter_token_timeout_s: None,
            total_timeout_s: None,
            accepts_prefill: false,
            stream_usage: None,
            key_header: None,
        }
    }

    /// Says the source continues a trailing assistant message (see
    /// [`SourceConfig::accepts_prefill`]).
    #[must_use]
    pub const fn accepts_prefill(mut self, yes: bool) -> Self {
        self.accepts_prefill = yes;
        self
    }

    /// Sets the group.
    #[must_use]
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = Some(group.into());
        self
    }

    /// The group name (default [`DEFAULT_GROUP`]).
    #[must_use]
    pub fn group_name(&self) -> &str {
        self.group.as_deref().unwrap_or(DEFAULT_GROUP)
    }

    /// The timeouts, defaults filled in.
    ///
    /// # Errors
    /// A [`ConfigError`] naming a timeout that is not a positive number of seconds.
    pub fn timeouts(&self, at: &str) -> Result<Timeouts, ConfigError> {
        let d = Timeouts::default();
        Ok(Timeouts {
            connect: secs(&format!("{at}.connect_timeout_s"), self.connect_timeout_s)?.unwrap_or(d.connect),
            first_token: secs(&format!("{at}.first_token_timeout_s"), self.first_token_timeout_s)?
                .unwrap_or(d.first_token),
            inter_token: secs(&format!("{at}.inter_token_timeout_s"), self.inter_token_timeout_s)?
                .unwrap_or(d.inter_token),
            total: secs(&format!("{at}.total_timeout_s"), self.total_timeout_s)?.unwrap_or(d.total),
        })
    }

    /// The client's view of this source (key resolved from `key_env` if needed).
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field: missing key, bad timeout.
    pub fn settings(&self, at: &str) -> Result<SourceSettings, ConfigError> {
        let key = match (&self.key, &self.key_env) {
            (Some(_), Some(var)) => {
                // Which would win is a guess the reader of the file should not make.
                return Err(config_error(
                    format!("{at}.key_env"),
                    format!("`key` is set too: set one of `key` and `key_env` ({var}), not both"),
                ));
            }
            (Some(k), None) if !k.is_empty() => k.clone(),
            (_, Some(var)) => match std::env::var(var) {
                Ok(v) if !v.is_empty() => SecretKey::new(v),
                _ => {
                    return Err(config_error(
                        format!("{at}.key_env"),
                        format!("environment variable {var} is not set"),
                    ));
                }
            },
            _ => {
                return Err(config_error(
                    format!("{at}.key"),
                    "missing (set `key` or `key_env`)",
                ));
            }
        };
        let mut s = SourceSettings::new(self.name.as_str(), self.base_url.clone())
            .key(key)
            .timeouts(self.timeouts(at)?)
            .ask_stream_usage(self.stream_usage.unwrap_or(true));
        s.model.clone_from(&self.model);
        if let Some(h) = &self.key_header {
            s.key_header = KeyHeader::parse(h).map_err(|e| config_error(format!("{at}.key_header"), e))?;
        }
        s.endpoint()
            .map_err(|e| config_error(format!("{at}.base_url"), e.to_string()))?;
        let key_field = if self.key_env.is_some() { "key_env" } else { "key" };
        s.authorization()
            .map_err(|e| config_error(format!("{at}.{key_field}"), e.to_string()))?;
        Ok(s)
    }
}

/// Quotas of an account shared by several sources.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccountConfig {
    /// Requests per window for the whole account.
    #[serde(default)]
    pub rpm: Option<i64>,
    /// Tokens per window for the whole account.
    #[serde(default)]
    pub tpm: Option<i64>,
    /// Concurrent requests for the whole account.
    #[serde(default)]
    pub max_concurrency: Option<i64>,
}

/// `[models.NAME]`: one public model name and where its calls go.
///
/// ```
/// use pgw_stack::GatewayConfig;
///
/// let cfg = GatewayConfig::from_toml_str(r#"
///     [[sources]]
///     name = "openai"
///     base_url = "https://api.openai.com/v1"
///     key = "sk-demo"
///
///     [models.gpt-4o]
///     routes = [{ source = "openai", model = "gpt-4o-2024-08-06" }]
///     fallback = ["gpt-4o-mini"]
///     context_fallback = ["gpt-4.1"]
///
///     [models.gpt-4o-mini]
///     routes = [{ source = "openai" }]
///
///     [models."gpt-4.1"]
///     routes = [{ source = "openai" }]
/// "#).unwrap();
/// assert_eq!(cfg.models["gpt-4o"].routes[0].upstream_model("gpt-4o", None), "gpt-4o-2024-08-06");
/// assert_eq!(cfg.models["gpt-4o-mini"].routes[0].upstream_model("gpt-4o-mini", None), "gpt-4o-mini");
/// ```
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Where the model is served: one route per source (at least one). The balancer
    /// picks among them per attempt; each route has its own breaker, health and 429
    /// holds, so one model's faults leave the source's other models alone.
    pub routes: Vec<RouteConfig>,
    /// Other public models tried in order, each with its own routes, when every route
    /// of this one failed or none was admitted (not for a rejected request, which
    /// every model would refuse). Not followed transitively.
    #[serde(default)]
    pub fallback: Vec<String>,
    /// Public models tried in order when the request does not fit this model's
    /// context window (`context_length_exceeded` from every route tried). Not followed
    /// transitively.
    #[serde(default)]
    pub context_fallback: Vec<String>,
}

/// One route of a public model: a source, and the model name sent upstream.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The source's `name`.
    pub source: String,
    /// The model name sent to that source. Default: the source's `model`, else the
    /// public model name.
    #[serde(default)]
    pub model: Option<String>,
}

impl RouteConfig {
    /// The model sent upstream for public model `public` on a source whose `model`
    /// override is `source_model`.
    #[must_use]
    pub fn upstream_model<'a>(&'a self, public: &'a str, source_model: Option<&'a str>) -> &'a str {
        self.model.as_deref().or(source_model).unwrap_or(public)
    }
}

/// `[retry]`: defaults from tower-retry-pushback (`max_attempts` 3, `max_reasks` 2,
/// backoff 0.5 s to 20 s, stall window 120 s, pushback wait 60 s, no deadline, no
/// retry budget, no adaptive throttling).
///
/// ```
/// let cfg = pgw_stack::GatewayConfig::from_toml_str(r#"
///     [[sources]]
///     name = "s1"
///     base_url = "http://127.0.0.1:9/v1"
///     key = "sk-demo"
///     [retry.budget]
///     ratio = 0.2
///     [retry.throttle]
///     k = 1.5
/// "#).unwrap();
/// assert_eq!(cfg.retry.budget.unwrap().ratio, Some(0.2));
/// assert_eq!(cfg.retry.throttle.unwrap().window_s, None);
/// ```
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrySection {
    /// Attempts per group per call (a 429 never spends one).
    pub max_attempts: Option<u32>,
    /// Re-asks after an invalid answer, apart from `max_attempts`.
    pub max_reasks: Option<u32>,
    /// Backoff base, seconds.
    pub base_backoff_s: Option<f64>,
    /// Backoff cap, seconds.
    pub max_backoff_s: Option<f64>,
    /// Stall window, seconds: a call that has waited longer fails as stalled, unless
    /// something in the process succeeded within it.
    pub stall_window_s: Option<f64>,
    /// The most one call waits on pushback in one group, seconds (default
    /// `tower_retry_pushback::DEFAULT_MAX_PUSHBACK_WAIT`, 60): the time covered by the
    /// waits its 429s asked for (Retry-After, else the backoff); waits for pacing and
    /// quotas do not count. Past it the group gives up with `pushback_exhausted` and
    /// the call goes on down the fallback chain.
    pub max_pushback_wait_s: Option<f64>,
    /// Deadline of one call, seconds, from its start: across the fallback chain (every
    /// group), the wait on an identical call's answer in the cache, and a committed
    /// stream. A call's own sooner deadline (`CallDeadline`) stands. Unset, a call
    /// without a deadline of its own gets [`crate::DEFAULT_MAX_CALL_DURATION`] (600 s,
    /// the OpenAI SDKs' own timeout) until its answer starts: a stream in progress is
    /// not cut by it.
    pub max_call_duration_s: Option<f64>,
    /// The shared retry budget (`[retry.budget]`): retries at most `ratio` of requests
    /// over a sliding window, plus a floor of retries per second. Off unless the table
    /// is present; shared by every group of the gateway.
    pub budget: Option<RetryBudgetSection>,
    /// Client-side adaptive throttling (`[retry.throttle]`, the Google SRE book's):
    /// reject locally with probability `max(0, (requests - k * accepts) / (requests +
    /// 1))` over a window. Off unless the table is present; shared by every group.
    pub throttle: Option<ThrottleSection>,
}

/// `[retry.budget]`: tower-retry-pushback's `RetryBudgetConfig`, durations in seconds.
/// Every field defaults to the crate's default.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryBudgetSection {
    /// Retries allowed per request, in `[0, 1]` (default 0.1: Google SRE's 10%).
    pub ratio: Option<f64>,
    /// Retries per second allowed whatever the traffic (default 10, as tower's
    /// `TpsBudget` and Finagle).
    pub min_retries_per_sec: Option<u32>,
    /// The sliding window, seconds, 1 to 3600 (default 10).
    pub ttl_s: Option<f64>,
}

/// `[retry.throttle]`: tower-retry-pushback's `ThrottleConfig`, durations in seconds.
/// Every field defaults to the crate's default.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThrottleSection {
    /// The multiplier K, finite and at least 1 (default 2, the SRE book's).
    pub k: Option<f64>,
    /// The history window, seconds, 1 to 86400 (default 120, the SRE book's two
    /// minutes).
    pub window_s: Option<f64>,
}

/// `[balance]`: defaults from tower-health-p2c (`health_aware`, wait at most its
/// `DEFAULT_MAX_WAIT` when nothing is admitted), but for `choices`: the gateway
/// compares every source ([`GATEWAY_CHOICES`](crate::GATEWAY_CHOICES)).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BalanceSection {
    /// `health_aware` (default), `round_robin` or `least_inflight`.
    pub policy: Option<String>,
    /// How many distinct random sources `health_aware` compares for an attempt's first
    /// candidate, the best-ranked going first: `"all"` (the gateway's default,
    /// [`GATEWAY_CHOICES`](crate::GATEWAY_CHOICES)) or a number of at least 2 (2: the
    /// power of two choices, tower-health-p2c's own default).
    pub choices: Option<Choices>,
    /// Longest wait for an admission, seconds.
    pub max_wait_s: Option<f64>,
    /// Slow-call detection: a source with attempts in flight that answered nothing for
    /// this long is not dispatched to until they end, seconds (default 60,
    /// `tower_health_p2c::DEFAULT_SILENT_AFTER`; 0 turns it off).
    pub silent_after_s: Option<f64>,
    /// How often a silent source (its last 3 attempts timed out, nothing heard) is
    /// probed off the caller's path with a copy of one call's request, seconds
    /// (default 10, `tower_health_p2c::DEFAULT_PROBE_EVERY`; 0: the next fresh call
    /// probes it itself and waits for the answer).
    pub probe_every_s: Option<f64>,
    /// Slow-call detection also cuts attempts in flight (default true,
    /// `tower_health_p2c::BalanceConfig::cut_silent`): an attempt to a source silent
    /// for `silent_after_s` that has run that long and 4x the source's latency ends as
    /// a timeout and the call's next attempt goes elsewhere; a source that never
    /// answered a success, and a stream whose first chunk came, are never cut.
    pub cut_silent: Option<bool>,
    /// Seed of the balancer's random choices and the retry jitter (default: from the OS).
    pub seed: Option<u64>,
}

/// `balance.choices`: a number of sources, or every source (`"all"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choices {
    /// This many distinct random sources (validated: at least 2).
    Count(usize),
    /// Every source: `"all"`.
    All,
}

impl Choices {
    /// The count `tower_health_p2c::BalanceConfig::choices` takes.
    #[must_use]
    pub const fn count(self) -> usize {
        match self {
            Self::Count(n) => n,
            Self::All => tower_health_p2c::CHOICES_ALL,
        }
    }
}

/// `"all"` or the number, as the config writes it.
impl fmt::Display for Choices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Count(n) => write!(f, "{n}"),
            Self::All => f.write_str("all"),
        }
    }
}

/// Reads `"all"` or a number of at least 2 (a command-line flag's value): a flag of 1
/// used to pass here and leave the balancer unbuilt further on.
impl std::str::FromStr for Choices {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s.trim() {
            "all" => Ok(Self::All),
            n => n
                .parse::<usize>()
                .ok()
                .filter(|&n| n >= 2)
                .map(Self::Count)
                .ok_or_else(|| {
                    config_error(
                        "balance.choices",
                        format!("{s:?} is neither a number of sources (at least 2) nor \"all\""),
                    )
                }),
        }
    }
}

impl serde::Serialize for Choices {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Count(n) => s.serialize_u64(*n as u64),
            Self::All => s.serialize_str("all"),
        }
    }
}

impl<'de> Deserialize<'de> for Choices {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Choices;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                // Named here: an error in a value's type reaches the caller without its path.
                f.write_str("`balance.choices` as a number of sources (at least 2) or \"all\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Choices, E> {
                usize::try_from(v)
                    .ok()
                    .filter(|&n| n >= 2)
                    .map(Choices::Count)
                    .ok_or_else(|| E::invalid_value(serde::de::Unexpected::Unsigned(v), &self))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Choices, E> {
                u64::try_from(v)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Choices, E> {
                // The flag's rule: `"all"`, or a number written as text (as an
                // environment override may come).
                v.parse()
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Str(v), &self))
            }
        }
        d.deserialize_any(V)
    }
}

/// `[breaker]`: see tower-breaker-window's `BreakerConfigBuilder`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerSection {
    /// Consecutive failures that open (default [`DEFAULT_FAIL_THRESHOLD`]).
    pub fail_threshold: Option<u32>,
    /// Samples before the rate channel may open (default 10).
    pub min_calls: Option<u32>,
    /// Failure rate that opens (default 0.6).
    pub fail_rate: Option<f64>,
    /// Rate window, seconds (default 60).
    pub window_s: Option<f64>,
    /// First open duration, seconds (default [`DEFAULT_COOLDOWN_S`]).
    pub cooldown_s: Option<f64>,
    /// Cap of the open duration, seconds (default `max(300, cooldown_s)`).
    pub max_cooldown_s: Option<f64>,
    /// Probe lease TTL, seconds (default `max(cooldown, 60, 1.1 x the attempt timeout)`:
    /// the lease must outlive the probe's own attempt).
    pub probe_ttl_s: Option<f64>,
    /// How long a source that answered `insufficient_quota` (no credit left) is held,
    /// seconds: not admitted by any process, while its breaker's cooldown would let a
    /// probe through every few seconds to a minute; after it, one probe asks again
    /// (default: the breaker's `max_cooldown_s`, the longest it would keep a source out).
    pub quota_hold_s: Option<f64>,
    /// Redis backend: how long a process trusts a closed breaker that admitted it,
    /// seconds, admitting without a round trip meanwhile; another process's open
    /// reaches it at its next recorded outcome, or when this ends (default 5,
    /// `tower_breaker_window::DEFAULT_CLOSED_VIEW`; 0 asks Redis every time). Within
    /// it, successes are counted in the process and sent with its next failure or its
    /// first success after the view (`RedisBackend::with_deferred_successes`); 0 sends
    /// each.
    pub closed_view_s: Option<f64>,
}

/// `[aimd]`: defaults from tower-aimd (initial 8, floor 1, cut 0.5, tolerated pushback
/// share 0.5, slow start until the first cut).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AimdSection {
    /// Starting limit.
    pub initial_limit: Option<f64>,
    /// Floor.
    pub min_limit: Option<f64>,
    /// Cut on 429.
    pub decrease_factor: Option<f64>,
    /// The share of recent outcomes that may be 429s before a 429 cuts (0.0: every
    /// congestion episode cuts; see `tower_aimd::DEFAULT_TOLERATED_PUSHBACK`).
    pub tolerated_pushback: Option<f64>,
    /// The caller's concurrency (caps the limit).
    pub caller_concurrency: Option<usize>,
}

/// `[ratelimit]`: defaults from tower-ratelimit-redis (window 60 s, lease TTL 30 s).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitSection {
    /// Window length, seconds.
    pub window_s: Option<f64>,
    /// Concurrency lease TTL, seconds.
    pub lease_ttl_s: Option<f64>,
}

/// Which requests the cache serves (`cache.when`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheWhen {
    /// Only deterministic requests: `temperature` 0 or a fixed `seed` (the default):
    /// a sampled request must not get the same text twice.
    #[default]
    Deterministic,
    /// Every request (repeated prompts whose sampling the caller does not care about).
    Always,
}

/// `[cache]`: the response cache.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSection {
    /// On by default.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Which requests: `deterministic` (default) or `always`. A call carrying
    /// [`crate::NoCache`] is never served from the cache nor stored.
    #[serde(default)]
    pub when: CacheWhen,
    /// Time to live, seconds (default [`DEFAULT_CACHE_TTL_S`]).
    #[serde(default)]
    pub ttl_s: Option<f64>,
    /// Time to live of an answer from a fallback group (not the call's first),
    /// seconds (default [`DEFAULT_CACHE_FALLBACK_TTL_S`]); at most `ttl_s`.
    #[serde(default)]
    pub fallback_ttl_s: Option<f64>,
    /// Size bound of the memory cache (default [`DEFAULT_CACHE_MAX_ENTRIES`]); a
    /// config error with `backend = "redis"`, whose cache it would not bound.
    #[serde(default)]
    pub max_entries: Option<usize>,
    /// Byte bound of the memory cache, each answer weighed as its JSON length
    /// (default [`crate::cache::DEFAULT_MAX_BYTES`], 128 MiB); a config error with
    /// `backend = "redis"`, whose cache it would not bound.
    #[serde(default)]
    pub max_bytes: Option<u64>,
}

fn yes() -> bool {
    true
}

impl Default for CacheSection {
    fn default() -> Self {
        Self {
            enabled: true,
            when: CacheWhen::default(),
            ttl_s: None,
            fallback_ttl_s: None,
            max_entries: None,
            max_bytes: None,
        }
    }
}

/// `[telemetry]`: one record per attempt to a sink.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetrySection {
    /// Append one JSON line per attempt to this file.
    pub jsonl_path: Option<String>,
    /// Emit one `tracing` event per attempt (target `pgw::attempt`); off by default.
    #[serde(default)]
    pub tracing: bool,
}

/// The price of a model, in dollars per million tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Prompt tokens.
    pub input_per_mtok: f64,
    /// Completion tokens.
    pub output_per_mtok: f64,
}

/// The longest duration a `*_s` field accepts: ten years. Longer ones mean "never" in
/// practice, and deadlines computed from them (`now + d`) would overflow the clock.
pub const MAX_DURATION_S: f64 = 10.0 * 365.0 * 86_400.0;

/// `text` with the raw `url` replaced by its redacted form (no password).
pub(crate) fn redact_in(text: &str, url: &str) -> String {
    if url.is_empty() {
        return text.to_owned();
    }
    text.replace(url, &pgw_core::redis_conn::redact_url(url))
}

/// Like [`secs`], for a field where 0 means off: `Some(Duration::ZERO)`.
pub(crate) fn secs_or_off(field: &str, v: Option<f64>) -> Result<Option<Duration>, ConfigError> {
    match v {
        Some(0.0) => Ok(Some(Duration::ZERO)),
        v => secs(field, v),
    }
}

pub(crate) fn secs(field: &str, v: Option<f64>) -> Result<Option<Duration>, ConfigError> {
    match v {
        None => Ok(None),
        Some(s) if s.is_finite() && s > MAX_DURATION_S => Err(config_error(
            field,
            format!("must be at most {MAX_DURATION_S} seconds (ten years), got {s}"),
        )),
        Some(s) if s.is_finite() && s > 0.0 => Duration::try_from_secs_f64(s)
            .map(Some)
            .map_err(|e| config_error(field, e.to_string())),
        Some(s) => Err(config_error(
            field,
            format!("must be a positive number of seconds (got {s})"),
        )),
    }
}

pub(crate) fn quota(field: &str, v: Option<i64>) -> Result<Option<u64>, ConfigError> {
    match v {
        None | Some(0) => Ok(None),
        Some(n) if n > 0 => Ok(Some(n.unsigned_abs())),
        Some(n) => Err(config_error(field, format!("must not be negative (got {n})"))),
    }
}

impl GatewayConfig {
    /// Parses TOML text (no environment overrides).
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field (unknown fields are refused).
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let value: toml::Table = toml::from_str(text).map_err(|e| toml_error(&e, Some(text)))?;
        Self::from_table(value)
    }

    /// Reads a TOML file and applies `PGW__...` overrides from the environment.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the file or the field.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| config_error(path.display().to_string(), format!("cannot read: {e}")))?;
        Self::from_toml_str_with_env(&text, std::env::vars())
    }

    /// Parses TOML text and applies `PGW__A__B=value` overrides taken from `vars`.
    ///
    /// ```
    /// use pgw_stack::GatewayConfig;
    /// let text = "[[sources]]\nname = \"s1\"\nbase_url = \"http://127.0.0.1:1/v1\"\nkey = \"sk-x\"\n";
    /// let env = [("PGW__RETRY__MAX_ATTEMPTS".to_string(), "5".to_string()),
    ///            ("PGW__SOURCES__0__RPM".to_string(), "60".to_string())];
    /// let cfg = GatewayConfig::from_toml_str_with_env(text, env).unwrap();
    /// assert_eq!(cfg.retry.max_attempts, Some(5));
    /// assert_eq!(cfg.sources[0].rpm, Some(60));
    /// ```
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field.
    pub fn from_toml_str_with_env(
        text: &str,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut table: toml::Table = toml::from_str(text).map_err(|e| toml_error(&e, Some(text)))?;
        let mut overrides: Vec<(String, String)> =
            vars.into_iter().filter(|(k, _)| k.starts_with("PGW__")).collect();
        overrides.sort();
        for (k, v) in &overrides {
            apply_override(&mut table, k, v)?;
        }
        Self::from_table(table).map_err(|e| name_override(e, &overrides))
    }

    fn from_table(table: toml::Table) -> Result<Self, ConfigError> {
        let cfg: Self = from_table(table, "")?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks what serde cannot: names, quotas, timeouts, keys, the backend switch.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.sources.is_empty() {
            return Err(config_error("sources", "at least one source is required"));
        }
        if self.backend == BackendKind::Redis && self.redis_url.is_none() {
            return Err(config_error("redis_url", "required when backend = \"redis\""));
        }
        if let Some(url) = &self.redis_url {
            pgw_core::redis_conn::RedisTarget::parse(url)
                .map_err(|e| config_error("redis_url", redact_in(&e, url)))?;
        }
        let mut names = std::collections::HashSet::new();
        for (i, s) in self.sources.iter().enumerate() {
            let at = format!("sources[{i}]");
            if s.name.trim().is_empty() {
                return Err(config_error(format!("{at}.name"), "must not be empty"));
            }
            if !names.insert(s.name.as_str()) {
                return Err(config_error(
                    format!("{at}.name"),
                    format!("duplicate source {:?}", s.name),
                ));
            }
            quota(&format!("{at}.rpm"), s.rpm)?;
            quota(&format!("{at}.tpm"), s.tpm)?;
            quota(&format!("{at}.max_concurrency"), s.max_concurrency)?;
            if s.account.as_ref().is_some_and(|a| a.trim().is_empty()) {
                return Err(config_error(format!("{at}.account"), "must not be empty"));
            }
            s.settings(&at)?;
        }
        for (name, a) in &self.accounts {
            let at = format!("accounts.{name}");
            if !self
                .sources
                .iter()
                .any(|s| s.account.as_deref() == Some(name.as_str()))
            {
                // Most likely a misspelt `account` on a source, which would then run
                // without its account's quota.
                return Err(config_error(
                    at,
                    format!("no source names account {name:?}: its quota would limit nothing"),
                ));
            }
            quota(&format!("{at}.rpm"), a.rpm)?;
            quota(&format!("{at}.tpm"), a.tpm)?;
            quota(&format!("{at}.max_concurrency"), a.max_concurrency)?;
        }
        let groups = self.group_order();
        for g in &self.fallback {
            if !self.sources.iter().any(|s| s.group_name() == g) {
                return Err(config_error("fallback", format!("group {g:?} has no source")));
            }
        }
        for (i, s) in self.sources.iter().enumerate() {
            if !groups.iter().any(|g| g == s.group_name()) {
                return Err(config_error(
                    format!("sources[{i}].group"),
                    format!(
                        "group {:?} is not in `fallback`: the source would never be used",
                        s.group_name()
                    ),
                ));
            }
        }
        for (i, g) in self.fallback.iter().enumerate() {
            if self.fallback[..i].contains(g) {
                return Err(config_error("fallback", format!("group {g:?} is listed twice")));
            }
        }
        debug_assert!(!groups.is_empty());
        for (k, v) in [
            ("retry.base_backoff_s", self.retry.base_backoff_s),
            ("retry.max_backoff_s", self.retry.max_backoff_s),
            ("retry.stall_window_s", self.retry.stall_window_s),
            ("retry.max_pushback_wait_s", self.retry.max_pushback_wait_s),
            ("retry.max_call_duration_s", self.retry.max_call_duration_s),
            (
                "retry.budget.ttl_s",
                self.retry.budget.as_ref().and_then(|b| b.ttl_s),
            ),
            (
                "retry.throttle.window_s",
                self.retry.throttle.as_ref().and_then(|t| t.window_s),
            ),
            ("balance.max_wait_s", self.balance.max_wait_s),
            ("ratelimit.window_s", self.ratelimit.window_s),
            ("ratelimit.lease_ttl_s", self.ratelimit.lease_ttl_s),
            ("cache.ttl_s", self.cache.ttl_s),
            ("cache.fallback_ttl_s", self.cache.fallback_ttl_s),
            ("breaker.quota_hold_s", self.breaker.quota_hold_s),
        ] {
            secs(k, v)?;
        }
        for (k, v) in [
            ("breaker.closed_view_s", self.breaker.closed_view_s),
            ("balance.silent_after_s", self.balance.silent_after_s),
            ("balance.probe_every_s", self.balance.probe_every_s),
        ] {
            secs_or_off(k, v)?;
        }
        if self.backend == BackendKind::Redis && self.cache.enabled {
            // The bounds are the memory cache's: set with the Redis backend they would
            // bound nothing, silently.
            for (k, set) in [
                ("cache.max_entries", self.cache.max_entries.is_some()),
                ("cache.max_bytes", self.cache.max_bytes.is_some()),
            ] {
                if set {
                    return Err(config_error(
                        k,
                        "bounds the in-memory cache only; with backend = \"redis\" answers \
                         live in Redis for cache.ttl_s (bound them with Redis's maxmemory and \
                         an eviction policy): remove it",
                    ));
                }
            }
        }
        if self.cache.max_entries == Some(0) {
            return Err(config_error("cache.max_entries", "must be at least 1"));
        }
        if self.cache.max_bytes.is_some_and(|b| b < 1024) {
            return Err(config_error(
                "cache.max_bytes",
                "must be at least 1024 (one answer's JSON is rarely less)",
            ));
        }
        if let Some(p) = &self.balance.policy
            && !matches!(p.as_str(), "health_aware" | "round_robin" | "least_inflight")
        {
            return Err(config_error(
                "balance.policy",
                format!("{p:?} is not one of health_aware, round_robin, least_inflight"),
            ));
        }
        self.validate_models()?;
        for (model, p) in &self.prices {
            let ok = |x: f64| x.is_finite() && x >= 0.0;
            if !(ok(p.input_per_mtok) && ok(p.output_per_mtok)) {
                return Err(config_error(
                    format!("prices.{model}"),
                    "prices must be finite and not negative",
                ));
            }
        }
        // What each layer is given, checked by the layer's own rules, so a config this
        // passes is one `Gateway::builder(..).build()` takes (but for Redis and the
        // telemetry file, which only a start can try).
        crate::settings::check_layers(self)
    }

    fn validate_models(&self) -> Result<(), ConfigError> {
        if self.models.is_empty() {
            return Ok(());
        }
        if !self.fallback.is_empty() {
            return Err(config_error(
                "fallback",
                "with [models], each model names its own fallback chain (models.NAME.fallback)",
            ));
        }
        for (name, m) in &self.models {
            let at = format!("models.{name}");
            if name.trim().is_empty() {
                return Err(config_error(at, "a model name must not be empty"));
            }
            if m.routes.is_empty() {
                return Err(config_error(
                    format!("{at}.routes"),
                    "at least one route is required",
                ));
            }
            for (i, r) in m.routes.iter().enumerate() {
                let at = format!("{at}.routes[{i}]");
                let Some(source) = self.sources.iter().find(|s| s.name == r.source) else {
                    return Err(config_error(
                        format!("{at}.source"),
                        format!("no source is named {:?}", r.source),
                    ));
                };
                if r.model.as_ref().is_some_and(|m| m.trim().is_empty()) {
                    return Err(config_error(format!("{at}.model"), "must not be empty"));
                }
                let upstream = r.upstream_model(name, source.model.as_deref());
                if m.routes[..i].iter().any(|o| {
                    o.source == r.source && o.upstream_model(name, source.model.as_deref()) == upstream
                }) {
                    return Err(config_error(
                        at,
                        format!("route {}/{upstream} is listed twice", r.source),
                    ));
                }
            }
            for (field, chain) in [
                ("fallback", &m.fallback),
                ("context_fallback", &m.context_fallback),
            ] {
                for (i, other) in chain.iter().enumerate() {
                    let at = format!("{at}.{field}[{i}]");
                    if other == name {
                        return Err(config_error(at, "a model cannot fall back to itself"));
                    }
                    if !self.models.contains_key(other) {
                        return Err(config_error(
                            at,
                            format!("no model is named {other:?} in [models]"),
                        ));
                    }
                    if chain[..i].contains(other) {
                        return Err(config_error(at, format!("model {other:?} is listed twice")));
                    }
                }
            }
        }
        for (i, s) in self.sources.iter().enumerate() {
            if !self
                .models
                .values()
                .any(|m| m.routes.iter().any(|r| r.source == s.name))
            {
                return Err(config_error(
                    format!("sources[{i}]"),
                    format!(
                        "source {:?} is in no route of [models]: it would never be used",
                        s.name
                    ),
                ));
            }
        }
        Ok(())
    }

    /// What each layer is given, every default filled in, as text (secrets redacted):
    /// the retry loop, the balancer, the cache, then per source its client settings,
    /// breaker, AIMD limit and rate limits. The config's own fields leave a default as
    /// `None`; this says what it is.
    ///
    /// ```
    /// let cfg = pgw_stack::GatewayConfig::from_toml_str(
    ///     "[[sources]]\nname = \"s1\"\nbase_url = \"http://127.0.0.1:1/v1\"\nkey = \"sk-secret\"\n",
    /// ).unwrap();
    /// let text = cfg.effective().unwrap();
    /// assert!(text.contains("max_attempts: 3"), "{text}");
    /// assert!(text.contains("choices: all,"), "{text}");
    /// assert!(!text.contains("sk-secret"));
    /// ```
    ///
    /// # Errors
    /// As [`validate`](Self::validate).
    pub fn effective(&self) -> Result<String, ConfigError> {
        crate::settings::effective(self)
    }

    /// The fallback order: `fallback` if set, else groups in order of first appearance.
    #[must_use]
    pub fn group_order(&self) -> Vec<String> {
        if !self.fallback.is_empty() {
            return self.fallback.clone();
        }
        let mut out: Vec<String> = Vec::new();
        for s in &self.sources {
            if !out.iter().any(|g| g == s.group_name()) {
                out.push(s.group_name().to_owned());
            }
        }
        out
    }
}

/// A TOML error as a [`ConfigError`] naming the field. Only the message and the line
/// number (when `text`, the parsed source, is given) are kept: toml's `Display` quotes
/// the offending source line, which may hold a key or a Redis password. Public so that
/// configurations embedding [`GatewayConfig`] (pgw-server's) report errors alike.
#[must_use]
pub fn toml_error(e: &toml::de::Error, text: Option<&str>) -> ConfigError {
    let line = e
        .span()
        .zip(text)
        .map(|(span, text)| text[..span.start.min(text.len())].matches('\n').count() + 1);
    let message = hide_unexpected_value(e.message());
    let msg = match line {
        Some(line) => format!("line {line}: {message}"),
        None => message,
    };
    // serde's "unknown field `x`" / "missing field `x`" name the field; keep them first.
    let field = ["unknown field `", "missing field `", "for key `"]
        .iter()
        .find_map(|p| {
            let start = msg.find(p)? + p.len();
            let len = msg[start..].find('`')?;
            Some(msg[start..start + len].to_owned())
        })
        .unwrap_or_else(|| "config".to_owned());
    config_error(field, msg.trim().replace('\n', " "))
}

/// Reads `table` (a parsed file, `PGW__...` overrides applied) as `T`, naming the
/// field of an error by its whole path under `prefix`: `sources[1].rpm` for a value of
/// the wrong type, `sources[0].rmp` for an unknown field, `server.keys[0].label` for a
/// missing one (with `prefix = "server"`). toml's own error names the innermost key at
/// most, so a list of sources or keys left the entry to guess.
///
/// ```
/// let text = "[[sources]]\nname = \"a\"\nbase_url = \"http://127.0.0.1:1/v1\"\n\
///             [[sources]]\nname = \"b\"\nrmp = 5\n";
/// let table: toml::Table = toml::from_str(text).unwrap();
/// let err = pgw_stack::config::from_table::<pgw_stack::GatewayConfig>(table, "").unwrap_err();
/// assert_eq!(err.field(), "sources[1].rmp");
/// ```
///
/// # Errors
/// A [`ConfigError`] naming the field's path, its value hidden (it may be a secret).
pub fn from_table<T: serde::de::DeserializeOwned>(
    table: toml::Table,
    prefix: &str,
) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
        let path = e.path().to_string();
        let named = toml_error(e.inner(), None);
        let mut field: Vec<&str> = Vec::new();
        if !prefix.is_empty() {
            field.push(prefix);
        }
        if path != "." {
            field.push(&path);
        }
        // An unknown or missing field's name is in the message, under the path of its
        // table; for any other error the path ends at the field itself.
        let inner = named.field();
        if inner != "config" && path != inner && !path.ends_with(&format!(".{inner}")) {
            field.push(named.field());
        }
        let field = if field.is_empty() {
            "config".to_owned()
        } else {
            field.join(".")
        };
        config_error(field, named.reason().to_owned())
    })
}

/// The field an override `PGW__A__0__B` sets, as errors name it: `a[0].b`.
fn override_field(var: &str) -> Option<String> {
    let rest = var.strip_prefix("PGW__")?;
    let mut out = String::new();
    for seg in rest.split("__") {
        if !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit()) {
            out.push_str(&format!("[{seg}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(&seg.to_ascii_lowercase());
        }
    }
    Some(out)
}

/// `err` with the variable that set its field, when an override did: a bad value
/// given as `PGW__SERVER__MAX_BODY_BYTES=abc` is not in the file the user reads.
///
/// ```
/// let text = "[[sources]]\nname = \"a\"\nbase_url = \"http://127.0.0.1:1/v1\"\nkey = \"sk-x\"\n";
/// let env = [("PGW__SOURCES__0__RPM".to_string(), "lots".to_string())];
/// let err = pgw_stack::GatewayConfig::from_toml_str_with_env(text, env).unwrap_err();
/// assert_eq!(err.field(), "sources[0].rpm");
/// assert!(err.reason().contains("set by PGW__SOURCES__0__RPM"), "{err}");
/// ```
#[must_use]
pub fn name_override(err: ConfigError, overrides: &[(String, String)]) -> ConfigError {
    let Some((var, _)) = overrides
        .iter()
        .find(|(k, _)| override_field(k).is_some_and(|f| f == err.field()))
    else {
        return err;
    };
    ConfigError::new(
        err.component(),
        err.field().to_owned(),
        format!("{} (set by {var})", err.reason()),
    )
}

/// serde's "invalid type: integer `8231945712345`, expected a string" without the
/// value: the field may be a secret (a numeric key written without quotes), and the
/// line number and the expected type say enough.
fn hide_unexpected_value(message: &str) -> String {
    for lead in ["invalid type: ", "invalid value: ", "unknown variant "] {
        let Some(start) = message.find(lead).map(|i| i + lead.len()) else {
            continue;
        };
        let rest = &message[start..];
        let end = rest.find(", expected").unwrap_or(rest.len());
        let Some(quote) = rest[..end].find(['`', '"']) else {
            continue;
        };
        let kind = rest[..quote].trim_end();
        let head = &message[..start];
        return if kind.is_empty() {
            // `unknown variant `redis://:pw@h`, expected one of ...`
            format!("{}(value not shown){}", head, &rest[end..])
        } else {
            format!("{head}{kind} (value not shown){}", &rest[end..])
        };
    }
    message.to_owned()
}

/// Fields an environment override sets as the string given, never read as TOML:
/// secrets (a source's `key`, `redis_url`, a virtual key's `sha256`).
const SECRET_FIELDS: [&str; 3] = ["key", "redis_url", "sha256"];

/// Applies one `PGW__A__B=raw` environment override to `table`: sets `a.b` (segments
/// lowercased, split on `__`; a number indexes an existing array item) to `raw` read as
/// a TOML value when it parses as one (`60`, `true`, `[1, 2]`), else as a string; a
/// secret (`key`, `redis_url`, `sha256`) is always the string given. This
/// is what [`GatewayConfig::from_toml_str_with_env`] does for each variable; it is
/// public so a program embedding the gateway's TOML in a larger file (the `pgw`
/// server) applies the same rules to its own tables.
///
/// ```
/// let mut table: toml::Table = toml::from_str("[[sources]]\nname = \"s1\"\n").unwrap();
/// pgw_stack::config::apply_override(&mut table, "PGW__SOURCES__0__RPM", "60").unwrap();
/// assert_eq!(table["sources"][0]["rpm"].as_integer(), Some(60));
/// pgw_stack::config::apply_override(&mut table, "PGW__SOURCES__0__KEY", "8231945712345").unwrap();
/// assert_eq!(table["sources"][0]["key"].as_str(), Some("8231945712345"));
/// let err = pgw_stack::config::apply_override(&mut table, "PGW__SOURCES__9__RPM", "1").unwrap_err();
/// assert_eq!(err.field(), "PGW__SOURCES__9__RPM");
/// ```
///
/// # Errors
/// A [`ConfigError`] naming the variable: not `PGW__...`, an empty segment, an index
/// past an array's end, a path through a value that is not a table.
pub fn apply_override(table: &mut toml::Table, var: &str, raw: &str) -> Result<(), ConfigError> {
    let Some(rest) = var.strip_prefix("PGW__") else {
        return Err(config_error(var, "is not a PGW__ variable"));
    };
    let path: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
    if path.iter().any(String::is_empty) {
        return Err(config_error(var, "empty path segment"));
    }
    // A secret is always a string, as given: read as TOML, a numeric key (a
    // self-hosted server's `--api-key 8231945712345`) became an integer whose type
    // error quoted it, and `1234#abcd` was cut at the `#`.
    let secret = path.last().is_some_and(|f| SECRET_FIELDS.contains(&f.as_str()));
    let value = if secret {
        toml::Value::String(raw.to_owned())
    } else {
        toml::from_str::<toml::Table>(&format!("v = {raw}"))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .unwrap_or_else(|| toml::Value::String(raw.to_owned()))
    };
    let mut root = toml::Value::Table(std::mem::take(table));
    let result = set_path(&mut root, &path, &value, var);
    if let toml::Value::Table(t) = root {
        *table = t;
    }
    result
}

fn set_path(
    root: &mut toml::Value,
    path: &[String],
    value: &toml::Value,
    var: &str,
) -> Result<(), ConfigError> {
    let mut cur = root;
    for (i, seg) in path.iter().enumerate() {
        let last = i + 1 == path.len();
        let next: &mut toml::Value = match cur {
            toml::Value::Table(t) => {
                if last {
                    t.insert(seg.clone(), value.clone());
                    break;
                }
                t.entry(seg.clone())
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            }
            toml::Value::Array(a) => {
                let idx: usize = seg
                    .parse()
                    .map_err(|_| config_error(var, format!("{seg:?} is not an array index")))?;
                if idx >= a.len() {
                    return Err(config_error(
                        var,
                        format!("index {idx} is past the end ({} items)", a.len()),
                    ));
                }
                if last {
                    a[idx] = value.clone();
                    break;
                }
                &mut a[idx]
            }
            _ => {
                return Err(config_error(
                    var,
                    format!("{seg:?} is inside a value that is not a table"),
                ));
            }
        };
        cur = next;
    }
    Ok(())
}
