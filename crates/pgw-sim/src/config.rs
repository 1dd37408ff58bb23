//! The pool's configuration: sources, accounts, their fault knobs and the P6 preset.
//!
//! Every knob is a serde field with a documented default, so the soak can calibrate
//! the pool from a TOML/JSON file. [`PoolConfig::validate`] names the first bad field.

use std::collections::HashSet;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::schedule::{Lerp, Schedule, is_default, lerp_u64};

/// Default fraction of prompts every source rejects with 400: 0.005 (the seeds measured
/// about 0.5% of prompts rejected by the provider whatever the client does).
pub const DEFAULT_BAD_PROMPT_RATE: f64 = 0.005;

/// Default bytes of prompt text per reported prompt token: 4.0, the usual English
/// average (the limiter's estimate in `pgw_core::openai` assumes a pessimistic 3).
pub const DEFAULT_PROMPT_BYTES_PER_TOKEN: f64 = 4.0;

/// Default upper bound on body frames of one streamed answer: 48. Tokens are grouped
/// so a long answer costs at most this many timer wake-ups (8000 calls must simulate
/// in seconds of wall time).
pub const DEFAULT_MAX_STREAM_FRAMES: u32 = 48;

/// Default Unix time of the pool's start, used for the `created` fields:
/// 2026-07-21T05:07:50Z, the start of the seeds' P6 run. The simulator never reads the
/// wall clock, so answers are byte-identical between runs.
pub const DEFAULT_EPOCH_UNIX_S: u64 = 1_784_610_470;

/// Default completion budget when a request sets no `max_tokens`: 1024 (the same
/// figure `pgw_core::openai::DEFAULT_MAX_TOKENS_ESTIMATE` assumes).
pub const DEFAULT_MAX_TOKENS: u64 = 1024;

/// Most tokens one answer generates: 16 384 (the output cap of OpenAI's current chat
/// models). A request's budget above it (up to `u64::MAX`) is accepted and counted in
/// full against the context window and TPM, but the answer is at most this long, so a
/// huge `max_tokens` cannot make the simulator allocate or sleep without end.
pub const MAX_GENERATED_TOKENS: u64 = 16_384;

/// A configuration that cannot work, naming the field as a path (`sources[2].rpm`):
/// the workspace's shared [`pgw_core::ConfigError`] (component `simulator`).
pub use pgw_core::ConfigError;

/// A [`ConfigError`] of this crate's configuration.
pub(crate) fn config_error(field: impl AsRef<str>, reason: impl Into<String>) -> ConfigError {
    ConfigError::new("simulator", field.as_ref().to_owned(), reason.into())
}

/// A log-normal distribution given by its median and 95th percentile, clamped to
/// `[min, max]`. The unit is the one of the field holding it (seconds, tokens/s).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogNormal {
    /// The median.
    pub median: f64,
    /// The 95th percentile (`>= median`; equal means a constant).
    pub p95: f64,
    /// Lower clamp.
    pub min: f64,
    /// Upper clamp.
    pub max: f64,
}

impl LogNormal {
    /// A constant value.
    #[must_use]
    pub const fn constant(v: f64) -> Self {
        Self {
            median: v,
            p95: v,
            min: v,
            max: v,
        }
    }

    fn validate(&self, field: &str) -> Result<(), ConfigError> {
        let all = [self.median, self.p95, self.min, self.max];
        if all.iter().any(|v| !v.is_finite() || *v < 0.0) {
            return Err(config_error(field, "values must be finite and >= 0"));
        }
        if self.median <= 0.0 {
            return Err(config_error(format!("{field}.median"), "must be > 0"));
        }
        if self.p95 < self.median {
            return Err(config_error(format!("{field}.p95"), "must be >= median"));
        }
        if self.min > self.median || self.max < self.median {
            return Err(config_error(field, "need min <= median <= max"));
        }
        Ok(())
    }
}

impl Lerp for LogNormal {
    fn lerp(from: &Self, to: &Self, f: f64) -> Self {
        Self {
            median: f64::lerp(&from.median, &to.median, f),
            p95: f64::lerp(&from.p95, &to.p95, f),
            min: f64::lerp(&from.min, &to.min, f),
            max: f64::lerp(&from.max, &to.max, f),
        }
    }
}

/// How long a completion is: `max_tokens` (or `default_max_tokens`) times a uniform
/// fraction in `[min_fraction, max_fraction]`, at least 1 token.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompletionConfig {
    /// Lower fraction of the budget (default 0.2).
    pub min_fraction: f64,
    /// Upper fraction of the budget (default 0.9: answers usually stop before the cap).
    pub max_fraction: f64,
    /// Budget when the request sets no `max_tokens` (default [`DEFAULT_MAX_TOKENS`]).
    pub default_max_tokens: u64,
}

impl Default for CompletionConfig {
    fn default() -> Self {
        Self {
            min_fraction: 0.2,
            max_fraction: 0.9,
            default_max_tokens: DEFAULT_MAX_TOKENS,
        }
    }
}

/// Slow streams: with probability `rate` one inter-token gap of a streamed (or
/// generated) answer is stretched to a uniform `[min_gap_s, max_gap_s]`, at a uniformly
/// chosen frame after the first.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StallConfig {
    /// Fraction of answers with one long gap (default 0: none).
    pub rate: f64,
    /// Shortest stall, seconds (default 20).
    pub min_gap_s: f64,
    /// Longest stall, seconds (default 90).
    pub max_gap_s: f64,
}

impl Default for StallConfig {
    fn default() -> Self {
        Self {
            rate: 0.0,
            min_gap_s: 20.0,
            max_gap_s: 90.0,
        }
    }
}

impl StallConfig {
    fn validate(&self, field: &str) -> Result<(), ConfigError> {
        rate(&format!("{field}.rate"), self.rate)?;
        if !(self.min_gap_s.is_finite()
            && self.max_gap_s.is_finite()
            && self.min_gap_s >= 0.0
            && self.min_gap_s <= self.max_gap_s)
        {
            return Err(config_error(field, "need 0 <= min_gap_s <= max_gap_s, finite"));
        }
        Ok(())
    }
}

impl Lerp for StallConfig {
    fn lerp(from: &Self, to: &Self, f: f64) -> Self {
        Self {
            rate: f64::lerp(&from.rate, &to.rate, f),
            min_gap_s: f64::lerp(&from.min_gap_s, &to.min_gap_s, f),
            max_gap_s: f64::lerp(&from.max_gap_s, &to.max_gap_s, f),
        }
    }
}

/// Hard provider limits of one scope (a key, i.e. a source, or an account over all its
/// sources), enforced exactly, unlike the probabilistic [`RateLimitCurve`].
///
/// RPM and TPM are token buckets in OpenAI's manner: capacity the limit, refilled
/// continuously at `limit / 60` per scenario second, full at the start. A request costs
/// one request and, for TPM, its prompt tokens (the simulator's count) plus its
/// completion budget (`max_tokens`, else `max_completion_tokens`, else
/// [`CompletionConfig::default_max_tokens`]). `concurrency` caps the scope's admitted
/// requests in flight. Default: no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HardLimits {
    /// Requests per minute (`None`: unlimited).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rpm: Option<u64>,
    /// Tokens per minute (`None`: unlimited).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpm: Option<u64>,
    /// Requests in flight at once (`None`: unlimited).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u32>,
}

impl HardLimits {
    /// No limit at all.
    #[must_use]
    pub const fn is_none(&self) -> bool {
        self.rpm.is_none() && self.tpm.is_none() && self.concurrency.is_none()
    }

    fn validate(&self, field: &str) -> Result<(), ConfigError> {
        for (n, v) in [
            ("rpm", self.rpm),
            ("tpm", self.tpm),
            ("concurrency", self.concurrency.map(u64::from)),
        ] {
            if v == Some(0) {
                return Err(config_error(format!("{field}.{n}"), "must be >= 1 (or absent)"));
            }
        }
        Ok(())
    }
}

impl Lerp for HardLimits {
    /// Componentwise, rounded; a limit only one end has holds for the whole ramp.
    fn lerp(from: &Self, to: &Self, f: f64) -> Self {
        Self {
            rpm: Option::lerp(&from.rpm, &to.rpm, f),
            tpm: Option::lerp(&from.tpm, &to.tpm, f),
            concurrency: Option::lerp(&from.concurrency, &to.concurrency, f),
        }
    }
}

/// When a streamed answer carries its usage chunk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamUsage {
    /// Always, before `[DONE]` (the simulator's historical behaviour).
    #[default]
    Always,
    /// Only when the request sets `stream_options.include_usage: true` (OpenAI's).
    WhenAsked,
    /// Never (providers that do not report usage on streams).
    Never,
}

/// One source: an endpoint + key + model with its own behaviour.
///
/// Defaults describe a healthy source with the seeds' latencies and no faults.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SourceConfig {
    /// The source's name (`s1`, ...): the path prefix over HTTP and the key of the stats.
    pub name: String,
    /// The account it belongs to (an entry of [`PoolConfig::accounts`]); `None` means
    /// an account of its own with a zero 429 curve.
    pub account: Option<String>,
    /// The model name echoed when the request names none (default `sim-model`).
    pub model: String,
    /// The bearer token the source accepts; `None` accepts any (even none). Redacted
    /// in `Debug`.
    pub api_key: Option<String>,
    /// The key is revoked: 401 on every call (default false). Schedulable.
    pub revoked: Schedule<bool>,
    /// Fraction of requests accepted and never answered (default 0). Schedulable.
    pub black_hole_rate: Schedule<f64>,
    /// Fraction of requests answered 500/502/503 (default 0). Schedulable.
    pub server_error_rate: Schedule<f64>,
    /// Fraction of completions that are empty (200, no content; default 0). Schedulable.
    pub empty_rate: Schedule<f64>,
    /// Fraction of JSON-mode completions whose content is not valid JSON (default 0).
    /// Schedulable.
    pub invalid_json_rate: Schedule<f64>,
    /// The source's own requests-per-60-s gate (a provider-side RPM limit); requests
    /// beyond it get 429 with `retry-after`. Counted over admitted requests. Default none.
    /// Schedulable.
    pub rpm_gate: Schedule<Option<u32>>,
    /// Time to first token, seconds (default median 12, p95 40, clamped 0.5..120).
    /// Schedulable.
    pub ttft_s: Schedule<LogNormal>,
    /// Generation speed, tokens/s, drawn once per answer (default median 60, p95 120,
    /// clamped 20..200). Schedulable.
    pub tokens_per_second: Schedule<LogNormal>,
    /// Latency of error answers (401, 429, 400, 5xx), seconds (default median 0.3,
    /// p95 1.5, clamped 0.05..5). Schedulable.
    pub error_latency_s: Schedule<LogNormal>,
    /// Completion length.
    pub completion: CompletionConfig,
    /// Slow streams. Schedulable.
    pub stall: Schedule<StallConfig>,
    /// The key's own hard limits (default none). Schedulable.
    #[serde(skip_serializing_if = "is_default")]
    pub limits: Schedule<HardLimits>,
    /// Whether this source's hard-limit 429s (its key's or its account's) carry the
    /// exact wait in `retry-after` and `retry-after-ms` (default true). False answers
    /// as OpenAI does: the wait only in the message ("Please try again in 1.5s.") and
    /// the `x-ratelimit-*` headers.
    #[serde(skip_serializing_if = "is_true")]
    pub limit_retry_after: bool,
    /// The models the source serves; a request naming another gets 404
    /// `model_not_found` (default `None`: any model).
    #[serde(skip_serializing_if = "is_default")]
    pub models: Option<Vec<String>>,
    /// The model's context window, tokens: prompt tokens plus the completion budget
    /// above it get 400 `context_length_exceeded` (default `None`: no check). Also caps
    /// an answer's length.
    #[serde(skip_serializing_if = "is_default")]
    pub context_window: Option<u64>,
    /// Fraction of prompts rejected with 400 `content_policy_violation`, chosen by a
    /// salted hash of the prompt (the same prompt on every source with the same rate;
    /// default 0). Schedulable.
    #[serde(skip_serializing_if = "is_default")]
    pub content_policy_rate: Schedule<f64>,
    /// Fraction of prompts (by hash) answered 200 with no content and `finish_reason:
    /// "content_filter"` (default 0). Schedulable.
    #[serde(skip_serializing_if = "is_default")]
    pub content_filter_rate: Schedule<f64>,
    /// Fraction of prompts (by hash) answered 200 with a `refusal` instead of content
    /// (default 0). Schedulable.
    #[serde(skip_serializing_if = "is_default")]
    pub refusal_rate: Schedule<f64>,
    /// Fraction of requests answered 529 with Anthropic's `overloaded_error` body
    /// (random; default 0). Schedulable.
    #[serde(skip_serializing_if = "is_default")]
    pub overloaded_rate: Schedule<f64>,
    /// The `retry-after` (whole scenario seconds) those 529s carry (default none, as
    /// Anthropic's usually do): a provider overloaded that says when to come back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overloaded_retry_after_s: Option<u64>,
    /// Fraction of requests answered 429 `insufficient_quota`, without `retry-after`
    /// (random; a schedule set to 1 from some instant is a key running out of credit;
    /// default 0). Schedulable.
    #[serde(skip_serializing_if = "is_default")]
    pub insufficient_quota_rate: Schedule<f64>,
    /// When streams carry their usage chunk (default [`StreamUsage::Always`]).
    #[serde(skip_serializing_if = "is_default")]
    pub stream_usage: StreamUsage,
    /// Fraction of streams that end cleanly after their last chunk without
    /// `data: [DONE]` (random; default 0). Schedulable.
    #[serde(skip_serializing_if = "is_default")]
    pub no_done_rate: Schedule<f64>,
    /// Fraction of streams with one extra event, mid-stream, whose data is not JSON
    /// (random; the answer's text stays whole in the other chunks; default 0). Schedulable.
    #[serde(skip_serializing_if = "is_default")]
    pub malformed_chunk_rate: Schedule<f64>,
    /// Fraction of streams answered 200 whose only event is an OpenAI error object
    /// (random; default 0). Schedulable.
    #[serde(skip_serializing_if = "is_default")]
    pub stream_error_rate: Schedule<f64>,
    /// Answers carry the fields OpenAI adds: `system_fingerprint`, `service_tier`,
    /// `choices[].logprobs` and `usage.completion_tokens_details` (default false: the
    /// simulator's historical bytes).
    #[serde(skip_serializing_if = "is_default")]
    pub echo_openai_fields: bool,
    /// The source continues a trailing assistant message (an assistant prefill) instead
    /// of answering it: its text depends only on the prompt before that message (the
    /// same words on every source that sets this), and a request ending with an
    /// assistant message that is a prefix of that text gets only the rest, its own
    /// token draw long, as a provider counts `max_tokens` after the prefill (default
    /// false).
    #[serde(skip_serializing_if = "is_default")]
    pub accepts_prefill: bool,
}

impl fmt::Debug for SourceConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SourceConfig")
            .field("name", &self.name)
            .field("account", &self.account)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("revoked", &self.revoked)
            .field("black_hole_rate", &self.black_hole_rate)
            .field("server_error_rate", &self.server_error_rate)
            .field("empty_rate", &self.empty_rate)
            .field("invalid_json_rate", &self.invalid_json_rate)
            .field("rpm_gate", &self.rpm_gate)
            .field("ttft_s", &self.ttft_s)
            .field("tokens_per_second", &self.tokens_per_second)
            .field("error_latency_s", &self.error_latency_s)
            .field("completion", &self.completion)
            .field("stall", &self.stall)
            .field("limits", &self.limits)
            .field("limit_retry_after", &self.limit_retry_after)
            .field("models", &self.models)
            .field("context_window", &self.context_window)
            .field("content_policy_rate", &self.content_policy_rate)
            .field("content_filter_rate", &self.content_filter_rate)
            .field("refusal_rate", &self.refusal_rate)
            .field("overloaded_rate", &self.overloaded_rate)
            .field("overloaded_retry_after_s", &self.overloaded_retry_after_s)
            .field("insufficient_quota_rate", &self.insufficient_quota_rate)
            .field("stream_usage", &self.stream_usage)
            .field("no_done_rate", &self.no_done_rate)
            .field("malformed_chunk_rate", &self.malformed_chunk_rate)
            .field("stream_error_rate", &self.stream_error_rate)
            .field("echo_openai_fields", &self.echo_openai_fields)
            .field("accepts_prefill", &self.accepts_prefill)
            .finish()
    }
}

impl Default for SourceConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            account: None,
            model: "sim-model".into(),
            api_key: None,
            revoked: false.into(),
            black_hole_rate: 0.0.into(),
            server_error_rate: 0.0.into(),
            empty_rate: 0.0.into(),
            invalid_json_rate: 0.0.into(),
            rpm_gate: None.into(),
            ttft_s: LogNormal {
                median: 12.0,
                p95: 40.0,
                min: 0.5,
                max: 120.0,
            }
            .into(),
            tokens_per_second: LogNormal {
                median: 60.0,
                p95: 120.0,
                min: 20.0,
                max: 200.0,
            }
            .into(),
            error_latency_s: LogNormal {
                median: 0.3,
                p95: 1.5,
                min: 0.05,
                max: 5.0,
            }
            .into(),
            completion: CompletionConfig::default(),
            stall: StallConfig::default().into(),
            limits: Schedule::default(),
            limit_retry_after: true,
            models: None,
            context_window: None,
            content_policy_rate: Schedule::default(),
            content_filter_rate: Schedule::default(),
            refusal_rate: Schedule::default(),
            overloaded_rate: Schedule::default(),
            overloaded_retry_after_s: None,
            insufficient_quota_rate: Schedule::default(),
            stream_usage: StreamUsage::Always,
            no_done_rate: Schedule::default(),
            malformed_chunk_rate: Schedule::default(),
            stream_error_rate: Schedule::default(),
            echo_openai_fields: false,
            accepts_prefill: false,
        }
    }
}

impl SourceConfig {
    /// A healthy source named `name` with the default knobs.
    #[must_use]
    pub fn healthy(name: &str) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }

    /// A healthy source that answers at once, in constant time: first token after
    /// 0.5 s, 200 tokens per second, errors after 0.1 s (the tests' quick source: no
    /// breaker cooldown runs out between the calls of a test).
    #[must_use]
    pub fn quick(name: &str) -> Self {
        Self {
            ttft_s: LogNormal::constant(0.5).into(),
            tokens_per_second: LogNormal::constant(200.0).into(),
            error_latency_s: LogNormal::constant(0.1).into(),
            ..Self::healthy(name)
        }
    }

    /// Puts the source in `account`.
    #[must_use]
    pub fn in_account(mut self, account: &str) -> Self {
        self.account = Some(account.into());
        self
    }

    /// What the source is like at scenario second `t_s`: every schedulable knob's value
    /// then (what the pool applies to a request arriving at `t_s`).
    ///
    /// ```
    /// use pgw_sim::{Schedule, SourceConfig};
    /// use pgw_sim::schedule::Phase;
    ///
    /// let src = SourceConfig {
    ///     server_error_rate: Schedule::Phases {
    ///         phases: vec![Phase { from_s: 0.0, value: 0.0 }, Phase { from_s: 600.0, value: 1.0 }],
    ///     },
    ///     ..SourceConfig::healthy("a")
    /// };
    /// assert_eq!(src.at(10.0).server_error_rate, 0.0);
    /// assert_eq!(src.at(600.0).server_error_rate, 1.0);
    /// ```
    #[must_use]
    pub fn at(&self, t_s: f64) -> SourceSnapshot {
        SourceSnapshot {
            revoked: self.revoked.at(t_s),
            black_hole_rate: self.black_hole_rate.at(t_s),
            server_error_rate: self.server_error_rate.at(t_s),
            empty_rate: self.empty_rate.at(t_s),
            invalid_json_rate: self.invalid_json_rate.at(t_s),
            rpm_gate: self.rpm_gate.at(t_s),
            ttft_s: self.ttft_s.at(t_s),
            tokens_per_second: self.tokens_per_second.at(t_s),
            error_latency_s: self.error_latency_s.at(t_s),
            stall: self.stall.at(t_s),
            limits: self.limits.at(t_s),
            content_policy_rate: self.content_policy_rate.at(t_s),
            content_filter_rate: self.content_filter_rate.at(t_s),
            refusal_rate: self.refusal_rate.at(t_s),
            overloaded_rate: self.overloaded_rate.at(t_s),
            insufficient_quota_rate: self.insufficient_quota_rate.at(t_s),
            no_done_rate: self.no_done_rate.at(t_s),
            malformed_chunk_rate: self.malformed_chunk_rate.at(t_s),
            stream_error_rate: self.stream_error_rate.at(t_s),
        }
    }
}

/// The schedulable knobs of a [`SourceConfig`] at one instant, as plain values
/// ([`SourceConfig::at`]). Each field means what the config field of the same name means.
#[derive(Clone, Copy, Debug, PartialEq)]
#[allow(clippy::struct_excessive_bools)]
pub struct SourceSnapshot {
    /// The key is revoked.
    pub revoked: bool,
    /// Fraction of requests never answered.
    pub black_hole_rate: f64,
    /// Fraction answered 500/502/503.
    pub server_error_rate: f64,
    /// Fraction of empty completions.
    pub empty_rate: f64,
    /// Fraction of JSON-mode answers that are not JSON.
    pub invalid_json_rate: f64,
    /// The source's own RPM gate.
    pub rpm_gate: Option<u32>,
    /// Time to first token, seconds.
    pub ttft_s: LogNormal,
    /// Generation speed, tokens/s.
    pub tokens_per_second: LogNormal,
    /// Latency of error answers, seconds.
    pub error_latency_s: LogNormal,
    /// Slow streams.
    pub stall: StallConfig,
    /// The key's hard limits.
    pub limits: HardLimits,
    /// Fraction of prompts rejected as a policy violation.
    pub content_policy_rate: f64,
    /// Fraction of prompts cut by the content filter.
    pub content_filter_rate: f64,
    /// Fraction of prompts refused.
    pub refusal_rate: f64,
    /// Fraction answered 529 overloaded.
    pub overloaded_rate: f64,
    /// Fraction answered 429 insufficient_quota.
    pub insufficient_quota_rate: f64,
    /// Fraction of streams without `[DONE]`.
    pub no_done_rate: f64,
    /// Fraction of streams with a malformed chunk.
    pub malformed_chunk_rate: f64,
    /// Fraction of streams that are one error event.
    pub stream_error_rate: f64,
}

/// The account-level 429 curve: the probability that a request is answered 429 is
/// `min(max, base + concurrency_slope * max(0, inflight - concurrency_knee)
/// + rpm_slope * max(0, rpm - rpm_knee))`, where `inflight` is the account's requests
/// in flight (over all its sources, before this one) and `rpm` the account's arrivals
/// (429s included) over the last `window_s` seconds, scaled to one minute.
///
/// The default is a zero curve (no 429s).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RateLimitCurve {
    /// Probability at rest (default 0).
    pub base: f64,
    /// In-flight requests the account absorbs for free (default 0).
    pub concurrency_knee: f64,
    /// Added probability per in-flight request above the knee (default 0).
    pub concurrency_slope: f64,
    /// Requests per minute the account absorbs for free (default 0).
    pub rpm_knee: f64,
    /// Added probability per request/minute above the knee (default 0).
    pub rpm_slope: f64,
    /// Cap on the probability (default 0.95).
    pub max: f64,
    /// Window of the request-rate measure, seconds (default 60).
    pub window_s: f64,
}

impl Default for RateLimitCurve {
    fn default() -> Self {
        Self {
            base: 0.0,
            concurrency_knee: 0.0,
            concurrency_slope: 0.0,
            rpm_knee: 0.0,
            rpm_slope: 0.0,
            max: 0.95,
            window_s: 60.0,
        }
    }
}

impl Lerp for RateLimitCurve {
    fn lerp(from: &Self, to: &Self, f: f64) -> Self {
        let l = |a: f64, b: f64| f64::lerp(&a, &b, f);
        Self {
            base: l(from.base, to.base),
            concurrency_knee: l(from.concurrency_knee, to.concurrency_knee),
            concurrency_slope: l(from.concurrency_slope, to.concurrency_slope),
            rpm_knee: l(from.rpm_knee, to.rpm_knee),
            rpm_slope: l(from.rpm_slope, to.rpm_slope),
            max: l(from.max, to.max),
            window_s: l(from.window_s, to.window_s),
        }
    }
}

impl RateLimitCurve {
    /// Every answer a 429 (probability 1 at rest and at the cap): an account that
    /// never admits, for tests of what a client does under nothing but pushback.
    #[must_use]
    pub fn always() -> Self {
        Self {
            base: 1.0,
            max: 1.0,
            ..Self::default()
        }
    }

    fn validate(&self, field: &str) -> Result<(), ConfigError> {
        for (n, v) in [
            ("base", self.base),
            ("concurrency_knee", self.concurrency_knee),
            ("concurrency_slope", self.concurrency_slope),
            ("rpm_knee", self.rpm_knee),
            ("rpm_slope", self.rpm_slope),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(config_error(format!("{field}.{n}"), "must be finite and >= 0"));
            }
        }
        rate(&format!("{field}.max"), self.max)?;
        if !(self.window_s.is_finite() && self.window_s > 0.0) {
            return Err(config_error(format!("{field}.window_s"), "must be > 0"));
        }
        Ok(())
    }

    /// The 429 probability at `inflight` requests in flight and `rpm` requests/minute.
    #[must_use]
    pub fn probability(&self, inflight: f64, rpm: f64) -> f64 {
        let p = self.base
            + self.concurrency_slope * (inflight - self.concurrency_knee).max(0.0)
            + self.rpm_slope * (rpm - self.rpm_knee).max(0.0);
        p.clamp(0.0, self.max)
    }
}

/// Which 429s carry `retry-after`: a fraction `rate`, with a whole number of seconds
/// uniform in `[min_s, max_s]`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryAfterConfig {
    /// Fraction of account-level 429s with a `retry-after` header (default 0.5).
    pub rate: f64,
    /// Shortest hint, seconds (default 1).
    pub min_s: u64,
    /// Longest hint, seconds (default 20).
    pub max_s: u64,
}

impl Default for RetryAfterConfig {
    fn default() -> Self {
        Self {
            rate: 0.5,
            min_s: 1,
            max_s: 20,
        }
    }
}

impl RetryAfterConfig {
    fn validate(&self, field: &str) -> Result<(), ConfigError> {
        rate(&format!("{field}.rate"), self.rate)?;
        if self.min_s > self.max_s {
            return Err(config_error(format!("{field}.min_s"), "must be <= max_s"));
        }
        Ok(())
    }
}

impl Lerp for RetryAfterConfig {
    /// `rate` linearly, the bounds rounded to whole seconds.
    fn lerp(from: &Self, to: &Self, f: f64) -> Self {
        Self {
            rate: f64::lerp(&from.rate, &to.rate, f),
            min_s: lerp_u64(from.min_s, to.min_s, f),
            max_s: lerp_u64(from.max_s, to.max_s, f),
        }
    }
}

/// An account (one provider key / organisation) shared by several sources: its 429s
/// are decided on the traffic of all of them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AccountConfig {
    /// The account's name, referenced by [`SourceConfig::account`].
    pub name: String,
    /// The 429 curve. Schedulable.
    pub rate_limit: Schedule<RateLimitCurve>,
    /// Which 429s carry `retry-after`. Schedulable.
    pub retry_after: Schedule<RetryAfterConfig>,
    /// The account's hard limits, shared by its sources (default none). Schedulable.
    #[serde(skip_serializing_if = "is_default")]
    pub limits: Schedule<HardLimits>,
}

impl AccountConfig {
    /// What the account is like at scenario second `t_s`.
    #[must_use]
    pub fn at(&self, t_s: f64) -> AccountSnapshot {
        AccountSnapshot {
            rate_limit: self.rate_limit.at(t_s),
            retry_after: self.retry_after.at(t_s),
            limits: self.limits.at(t_s),
        }
    }
}

/// The schedulable knobs of an [`AccountConfig`] at one instant ([`AccountConfig::at`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AccountSnapshot {
    /// The 429 curve.
    pub rate_limit: RateLimitCurve,
    /// Which 429s carry `retry-after`.
    pub retry_after: RetryAfterConfig,
    /// The hard limits.
    pub limits: HardLimits,
}

/// The whole simulated provider pool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    /// The sources, in order.
    pub sources: Vec<SourceConfig>,
    /// The accounts sources may share.
    pub accounts: Vec<AccountConfig>,
    /// Fraction of prompts rejected with 400 by every source, decided by a hash of the
    /// prompt text (default [`DEFAULT_BAD_PROMPT_RATE`]).
    pub bad_prompt_rate: f64,
    /// Prompt bytes per reported prompt token (default [`DEFAULT_PROMPT_BYTES_PER_TOKEN`]).
    pub prompt_bytes_per_token: f64,
    /// Most body frames of a streamed answer (default [`DEFAULT_MAX_STREAM_FRAMES`]).
    pub max_stream_frames: u32,
    /// Unix seconds of the pool's start for `created` fields (default [`DEFAULT_EPOCH_UNIX_S`]).
    pub epoch_unix_s: u64,
    /// Every duration of the simulation times this (default 1: unscaled). For real-time
    /// runs that should take minutes instead of hours (e.g. `1/60`: a scenario minute
    /// lasts one second). Scaled: TTFTs, error latencies and stall gaps (times S), token
    /// rates (divided by S), the account 429 curve's window and the `rpm_gate` window
    /// (times S; rates stay "per scenario minute", so the curve and the gate keep their
    /// meaning) and `retry-after` values (times S, sent as decimal seconds when S != 1).
    pub time_scale: f64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            sources: Vec::new(),
            accounts: Vec::new(),
            bad_prompt_rate: DEFAULT_BAD_PROMPT_RATE,
            prompt_bytes_per_token: DEFAULT_PROMPT_BYTES_PER_TOKEN,
            max_stream_frames: DEFAULT_MAX_STREAM_FRAMES,
            epoch_unix_s: DEFAULT_EPOCH_UNIX_S,
            time_scale: 1.0,
        }
    }
}

/// The account the P6 sources s1, s4 and s5 share.
pub const P6_SHARED_ACCOUNT: &str = "acct-a";

/// The bearer token of the P6 shared account (s1, s4, s5 accept it).
pub const P6_SHARED_KEY: &str = "sk-sim-account-a";

/// The inter-token watchdog the P6 preset assumes for s5: 8 s. Its stalls last 20-90 s,
/// so any watchdog shorter than 20 s cuts them; healthy gaps stay under ~5 s.
pub const P6_ASSUMED_INTER_TOKEN_WATCHDOG_S: f64 = 8.0;

impl PoolConfig {
    /// A pool of `sources` whose prompts no source rejects (`bad_prompt_rate` 0), every
    /// other knob at its default: the deterministic pool of tests and examples.
    ///
    /// ```
    /// use pgw_sim::{PoolConfig, SourceConfig};
    /// let c = PoolConfig::of(vec![SourceConfig::healthy("a")]);
    /// assert_eq!((c.sources.len(), c.bad_prompt_rate), (1, 0.0));
    /// ```
    #[must_use]
    pub fn of(sources: Vec<SourceConfig>) -> Self {
        Self {
            sources,
            bad_prompt_rate: 0.0,
            ..Self::default()
        }
    }

    /// The P6 pool: five sources, s1/s4/s5 on one account.
    ///
    /// The pool is the same for every client profile. The soak calibrates only
    /// `accounts[0].rate_limit` (the account 429 curve) so the `naive` profile lands near
    /// the seeds' 58.1%; every other value comes from the seeds:
    ///
    /// - s1 healthy, `empty_rate` 0.15 (seed 003: 2211 real empty completions; seed 000
    ///   measured 14.4-17%), account-level 429s (996 on the healthy source in seed 003,
    ///   34% of its attempts under the naive profile's ~135 attempts/min and ~50 in flight);
    /// - s2 revoked key: 401 always; s3 black hole: never answers;
    /// - s4 healthy with a provider-side gate of 5 requests per minute (the client is
    ///   configured with RPM 5; a client that exceeds it gets 429 + `retry-after`);
    /// - s5 slow stream: 90% of answers stall 20-90 s between two frames, so an
    ///   inter-token watchdog of [`P6_ASSUMED_INTER_TOKEN_WATCHDOG_S`] cuts them (seeds:
    ///   10% success, 3390 inter-token cuts); non-streamed answers are delayed as much.
    ///
    /// Latencies: TTFT median 12 s / p95 40 s, 60 tokens/s median, so a typical
    /// non-cached answer takes 15-25 s and the tail a minute (seed 003: successful
    /// non-cached calls ~17-22 s p50, ~50 s p95). P3 answers are invalid JSON 8% of the
    /// time on every healthy source (seed 003: P3 success 0.942 on a healthy pool).
    ///
    /// The 429 curve starting point: free up to 30 requests/min and 8 in flight, then
    /// +0.002 per request/min and +0.004 per request in flight, capped at 0.9: about
    /// 0.37 at the naive regime (135/min, 50 in flight) and under 0.1 at 60/min with
    /// 12 in flight. Half of the 429s carry `retry-after` of 1-20 s.
    #[must_use]
    pub fn p6() -> Self {
        let shared = |name: &str| SourceConfig {
            api_key: Some(P6_SHARED_KEY.into()),
            invalid_json_rate: 0.08.into(),
            ..SourceConfig::healthy(name).in_account(P6_SHARED_ACCOUNT)
        };
        let s1 = SourceConfig {
            empty_rate: 0.15.into(),
            ..shared("s1")
        };
        let s2 = SourceConfig {
            api_key: Some("sk-sim-revoked".into()),
            revoked: true.into(),
            ..SourceConfig::healthy("s2")
        };
        let s3 = SourceConfig {
            api_key: Some("sk-sim-black-hole".into()),
            black_hole_rate: 1.0.into(),
            ..SourceConfig::healthy("s3")
        };
        let s4 = SourceConfig {
            rpm_gate: Some(5).into(),
            ..shared("s4")
        };
        let s5 = SourceConfig {
            stall: StallConfig {
                rate: 0.9,
                min_gap_s: 20.0,
                max_gap_s: 90.0,
            }
            .into(),
            ..shared("s5")
        };
        Self {
            sources: vec![s1, s2, s3, s4, s5],
            accounts: vec![AccountConfig {
                name: P6_SHARED_ACCOUNT.into(),
                rate_limit: RateLimitCurve {
                    base: 0.0,
                    concurrency_knee: 8.0,
                    concurrency_slope: 0.004,
                    rpm_knee: 30.0,
                    rpm_slope: 0.002,
                    max: 0.9,
                    window_s: 60.0,
                }
                .into(),
                retry_after: RetryAfterConfig {
                    rate: 0.5,
                    min_s: 1,
                    max_s: 20,
                }
                .into(),
                limits: Schedule::default(),
            }],
            ..Self::default()
        }
    }

    /// Checks every field; the error names the first bad one.
    ///
    /// # Errors
    /// [`ConfigError`] naming the field (e.g. `sources[1].empty_rate`).
    pub fn validate(&self) -> Result<(), ConfigError> {
        rate("bad_prompt_rate", self.bad_prompt_rate)?;
        if !(self.prompt_bytes_per_token.is_finite() && self.prompt_bytes_per_token > 0.0) {
            return Err(config_error("prompt_bytes_per_token", "must be > 0"));
        }
        if self.max_stream_frames < 2 {
            return Err(config_error("max_stream_frames", "must be >= 2"));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(config_error("time_scale", "must be finite and > 0"));
        }
        if self.sources.is_empty() {
            return Err(config_error("sources", "at least one source is needed"));
        }
        let mut accounts = HashSet::new();
        for (i, a) in self.accounts.iter().enumerate() {
            let f = |n: &str| format!("accounts[{i}].{n}");
            if a.name.is_empty() {
                return Err(config_error(f("name"), "must not be empty"));
            }
            if !accounts.insert(a.name.as_str()) {
                return Err(config_error(f("name"), format!("duplicate account {:?}", a.name)));
            }
            a.rate_limit
                .validate(&f("rate_limit"), RateLimitCurve::validate)?;
            a.retry_after
                .validate(&f("retry_after"), RetryAfterConfig::validate)?;
            a.limits.validate(&f("limits"), HardLimits::validate)?;
        }
        let mut names = HashSet::new();
        for (i, s) in self.sources.iter().enumerate() {
            let f = |n: &str| format!("sources[{i}].{n}");
            if s.name.is_empty() || s.name.contains('/') {
                return Err(config_error(f("name"), "must be non-empty and contain no '/'"));
            }
            if !names.insert(s.name.as_str()) {
                return Err(config_error(f("name"), format!("duplicate source {:?}", s.name)));
            }
            if let Some(a) = &s.account
                && !accounts.contains(a.as_str())
            {
                return Err(config_error(f("account"), format!("unknown account {a:?}")));
            }
            let is_rate = |v: &f64, field: &str| rate(field, *v);
            for (n, v) in [
                ("black_hole_rate", &s.black_hole_rate),
                ("server_error_rate", &s.server_error_rate),
                ("empty_rate", &s.empty_rate),
                ("invalid_json_rate", &s.invalid_json_rate),
                ("content_policy_rate", &s.content_policy_rate),
                ("content_filter_rate", &s.content_filter_rate),
                ("refusal_rate", &s.refusal_rate),
                ("overloaded_rate", &s.overloaded_rate),
                ("insufficient_quota_rate", &s.insufficient_quota_rate),
                ("no_done_rate", &s.no_done_rate),
                ("malformed_chunk_rate", &s.malformed_chunk_rate),
                ("stream_error_rate", &s.stream_error_rate),
            ] {
                v.validate(&f(n), is_rate)?;
            }
            s.revoked.validate(&f("revoked"), |_, _| Ok(()))?;
            s.rpm_gate.validate(&f("rpm_gate"), |v, field| {
                if *v == Some(0) {
                    Err(config_error(field, "must be >= 1 (or absent)"))
                } else {
                    Ok(())
                }
            })?;
            s.ttft_s.validate(&f("ttft_s"), LogNormal::validate)?;
            s.tokens_per_second
                .validate(&f("tokens_per_second"), |d, field| {
                    d.validate(field)?;
                    if d.min <= 0.0 {
                        return Err(config_error(format!("{field}.min"), "must be > 0"));
                    }
                    Ok(())
                })?;
            s.error_latency_s
                .validate(&f("error_latency_s"), LogNormal::validate)?;
            let c = &s.completion;
            if !(0.0 < c.min_fraction && c.min_fraction <= c.max_fraction && c.max_fraction <= 1.0) {
                return Err(config_error(
                    f("completion"),
                    "need 0 < min_fraction <= max_fraction <= 1",
                ));
            }
            if c.default_max_tokens == 0 {
                return Err(config_error(f("completion.default_max_tokens"), "must be >= 1"));
            }
            s.stall.validate(&f("stall"), StallConfig::validate)?;
            s.limits.validate(&f("limits"), HardLimits::validate)?;
            if s.models.as_ref().is_some_and(Vec::is_empty) {
                return Err(config_error(
                    f("models"),
                    "must not be empty (or absent: any model)",
                ));
            }
            if s.context_window == Some(0) {
                return Err(config_error(f("context_window"), "must be >= 1 (or absent)"));
            }
        }
        Ok(())
    }
}

fn rate(field: &str, v: f64) -> Result<(), ConfigError> {
    if (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(config_error(field, format!("must be within [0, 1], got {v}")))
    }
}

/// Serde's `skip_serializing_if` for a flag that defaults to true.
#[allow(clippy::trivially_copy_pass_by_ref)] // serde passes a reference
const fn is_true(v: &bool) -> bool {
    *v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p6_is_valid_and_roundtrips() {
        let p6 = PoolConfig::p6();
        p6.validate().unwrap();
        let json = serde_json::to_string(&p6).unwrap();
        let back: PoolConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, p6);
    }

    #[test]
    fn bad_fields_are_named() {
        let mut c = PoolConfig::p6();
        c.sources[1].empty_rate = 1.5.into();
        assert_eq!(c.validate().unwrap_err().field(), "sources[1].empty_rate");
        let mut c = PoolConfig::p6();
        c.sources[0].account = Some("nope".into());
        let e = c.validate().unwrap_err();
        assert_eq!(e.field(), "sources[0].account");
        assert!(e.to_string().contains("unknown account"), "{e}");
        let mut c = PoolConfig::p6();
        for d in c.sources[2].ttft_s.values_mut() {
            d.p95 = 1.0;
        }
        assert_eq!(c.validate().unwrap_err().field(), "sources[2].ttft_s.p95");
        let mut c = PoolConfig::p6();
        c.sources.push(SourceConfig::healthy("s1"));
        assert_eq!(c.validate().unwrap_err().field(), "sources[5].name");
        assert_eq!(PoolConfig::default().validate().unwrap_err().field(), "sources");
    }

    #[test]
    fn debug_redacts_key() {
        let s = format!("{:?}", PoolConfig::p6());
        assert!(!s.contains(P6_SHARED_KEY), "{s}");
        assert!(s.contains("<redacted>"));
    }

    #[test]
    fn curve_grows_and_caps() {
        let c = PoolConfig::p6().accounts[0].rate_limit.at(0.0);
        assert_eq!(c.probability(0.0, 0.0), 0.0);
        let mid = c.probability(12.0, 60.0);
        let high = c.probability(50.0, 135.0);
        assert!(mid > 0.0 && mid < 0.1, "{mid}");
        assert!(high > 0.3 && high < 0.45, "{high}");
        assert_eq!(c.probability(1e6, 1e6), c.max);
    }
}
