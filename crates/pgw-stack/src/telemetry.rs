//! Telemetry: one [`AttemptTelemetry`] record per attempt (and per cache hit) to
//! a [`TelemetrySink`], and `metrics` gauges and counters.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, LineWriter, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};

use metrics::{Counter, Gauge};
use pgw_core::openai::Usage;
use pgw_core::sync::lock;
use pgw_core::{MetricHandles, SourceId};
use serde::Serialize;

use crate::config::Price;

/// One attempt (or one cache hit), as every sink receives it.
///
/// Never carries a key: errors are the client's messages, scrubbed of the key.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AttemptTelemetry {
    /// The call.
    pub call_id: u64,
    /// 1-based attempt number within the call's group (0 for a cache hit).
    pub attempt: u32,
    /// The model group.
    pub group: String,
    /// The source that served it (for a cache hit: the source that answered first).
    pub source: Option<SourceId>,
    /// Admission instant on the limiter's clock (seconds since its epoch: Redis server
    /// time, or the tokio clock of the memory backend); `None` for a cache hit.
    pub admitted_at_s: Option<f64>,
    /// The rate window of admission.
    pub admission_window: Option<u64>,
    /// Dispatch to verdict, milliseconds (0 for a cache hit).
    pub latency_ms: f64,
    /// Time to first token, milliseconds (streamed answers).
    pub ttft_ms: Option<f64>,
    /// Prompt tokens reported by the provider.
    pub prompt_tokens: Option<u64>,
    /// Completion tokens reported by the provider.
    pub completion_tokens: Option<u64>,
    /// Cost in dollars from the price table (`None` when the model has no price or
    /// no usage was reported; 0 for a cache hit).
    pub cost_usd: Option<f64>,
    /// `success`, `rate_limited`, `transient`, `source_dead`, `rejected`, `invalid`, or
    /// `cancelled` for an attempt dropped before its verdict (the caller gave up).
    pub outcome: &'static str,
    /// The error, when the attempt failed.
    pub error: Option<String>,
    /// The HTTP status of the provider's error answer, when the attempt ended in one
    /// (what the provider said, whatever the outcome made of it).
    pub status: Option<u16>,
    /// The provider's error `code` (else its `type`) in that answer
    /// (`model_not_found`, `context_length_exceeded`, `insufficient_quota`, ...).
    pub code: Option<String>,
    /// Whether the answer came from the cache.
    pub cache_hit: bool,
    /// Whether the attempt was a probe: a copy of the call's request sent off its path
    /// (a breaker's half-open probe, or the balancer's probe of a silent or abandoned
    /// source), whose answer the call never sees. Numbered among the call's attempts.
    pub probe: bool,
    /// Requests the provider said were left of its limit after this answer
    /// (`x-ratelimit-remaining-requests`, [`pgw_core::headroom`]), when it said so.
    pub provider_remaining_requests: Option<u64>,
    /// Tokens the provider said were left (`x-ratelimit-remaining-tokens`).
    pub provider_remaining_tokens: Option<u64>,
}

/// Where attempt records go.
pub trait TelemetrySink: Send + Sync {
    /// Receives one record. Must not block for long: it runs on the call's task.
    fn record(&self, record: &AttemptTelemetry);
}

/// Keeps every record in memory (tests, the soak).
#[derive(Clone, Debug, Default)]
pub struct MemorySink {
    records: Arc<Mutex<Vec<AttemptTelemetry>>>,
}

impl MemorySink {
    /// An empty sink.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// A copy of every record so far.
    #[must_use]
    pub fn records(&self) -> Vec<AttemptTelemetry> {
        lock(&self.records).clone()
    }

    /// Takes every record so far.
    #[must_use]
    pub fn drain(&self) -> Vec<AttemptTelemetry> {
        std::mem::take(&mut *lock(&self.records))
    }
}

impl TelemetrySink for MemorySink {
    fn record(&self, record: &AttemptTelemetry) {
        lock(&self.records).push(record.clone());
    }
}

/// Appends one JSON line per record to a file.
pub struct JsonlSink {
    out: Mutex<LineWriter<File>>,
}

impl fmt::Debug for JsonlSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JsonlSink").finish_non_exhaustive()
    }
}

impl JsonlSink {
    /// Opens (creates, appends to) `path`.
    ///
    /// # Errors
    /// The I/O error.
    pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            out: Mutex::new(LineWriter::new(file)),
        })
    }
}

impl TelemetrySink for JsonlSink {
    fn record(&self, record: &AttemptTelemetry) {
        let Ok(line) = serde_json::to_string(record) else {
            return;
        };
        let mut out = lock(&self.out);
        if let Err(e) = writeln!(out, "{line}") {
            tracing::warn!(error = %e, "telemetry: cannot write the jsonl file");
        }
    }
}

/// Emits one `tracing` event per record (target `pgw::attempt`, level INFO).
#[derive(Clone, Copy, Debug, Default)]
pub struct TracingSink;

impl TelemetrySink for TracingSink {
    fn record(&self, r: &AttemptTelemetry) {
        tracing::info!(
            target: "pgw::attempt",
            call_id = r.call_id,
            attempt = r.attempt,
            group = %r.group,
            source = r.source.as_ref().map_or("", SourceId::as_str),
            outcome = r.outcome,
            latency_ms = r.latency_ms,
            ttft_ms = r.ttft_ms,
            cache_hit = r.cache_hit,
            error = r.error.as_deref(),
            status = r.status,
            code = r.code.as_deref(),
            "attempt"
        );
    }
}

/// The price table: dollars per million tokens by model name.
#[derive(Clone, Debug, Default)]
pub struct PriceTable(BTreeMap<String, Price>);

impl PriceTable {
    /// A table from `(model, price)` pairs.
    #[must_use]
    pub fn new(prices: BTreeMap<String, Price>) -> Self {
        Self(prices)
    }

    /// The cost of `usage` on `model`, when both are known.
    #[must_use]
    pub fn cost(&self, model: &str, usage: Option<&Usage>) -> Option<f64> {
        let p = self.0.get(model)?;
        let u = usage?;
        #[allow(clippy::cast_precision_loss)] // token counts are far below 2^52
        let cost = (u.prompt_tokens as f64 * p.input_per_mtok
            + u.completion_tokens as f64 * p.output_per_mtok)
            / 1e6;
        Some(cost)
    }
}

/// The sinks of one gateway and its price table.
#[derive(Clone, Default)]
pub(crate) struct Telemetry {
    pub(crate) sinks: Arc<Vec<Arc<dyn TelemetrySink>>>,
    pub(crate) prices: Arc<PriceTable>,
    /// `pgw_attempts_total` by source, outcome and cache hit (every attempt updates it).
    pub(crate) attempts: Arc<MetricHandles<Counter, 3>>,
    /// `pgw_provider_remaining` by source and limit (`requests`, `tokens`): what the
    /// provider's `x-ratelimit-remaining-*` headers said on the source's last answer
    /// that carried them.
    pub(crate) remaining: Arc<MetricHandles<Gauge, 2>>,
}

impl Telemetry {
    pub(crate) fn emit(&self, record: &AttemptTelemetry) {
        let source = record.source.as_ref().map_or("", SourceId::as_str);
        let cache_hit = if record.cache_hit { "true" } else { "false" };
        self.attempts
            .get(
                [source, record.outcome, cache_hit],
                |[source, outcome, cache_hit]| {
                    metrics::counter!(
                        "pgw_attempts_total",
                        "source" => source.to_owned(),
                        "outcome" => outcome.to_owned(),
                        "cache_hit" => cache_hit.to_owned(),
                    )
                },
            )
            .increment(1);
        for (limit, left) in [
            ("requests", record.provider_remaining_requests),
            ("tokens", record.provider_remaining_tokens),
        ] {
            if let Some(left) = left {
                #[allow(clippy::cast_precision_loss)] // a gauge is a float
                self.remaining
                    .get([source, limit], |[source, limit]| {
                        metrics::gauge!(
                            "pgw_provider_remaining",
                            "source" => source.to_owned(),
                            "limit" => limit.to_owned(),
                        )
                    })
                    .set(left as f64);
            }
        }
        for s in self.sinks.iter() {
            s.record(record);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(outcome: &'static str) -> AttemptTelemetry {
        AttemptTelemetry {
            call_id: 7,
            attempt: 1,
            group: "g".into(),
            source: Some("s1".into()),
            admitted_at_s: Some(12.5),
            admission_window: Some(3),
            latency_ms: 10.0,
            ttft_ms: None,
            prompt_tokens: Some(1000),
            completion_tokens: Some(500),
            cost_usd: None,
            outcome,
            error: None,
            status: None,
            code: None,
            cache_hit: false,
            probe: false,
            provider_remaining_requests: None,
            provider_remaining_tokens: None,
        }
    }

    #[test]
    fn cost_from_the_price_table() {
        let mut m = BTreeMap::new();
        m.insert(
            "gpt".to_owned(),
            Price {
                input_per_mtok: 2.0,
                output_per_mtok: 8.0,
            },
        );
        let t = PriceTable::new(m);
        let u = Usage::new(1_000_000, 500_000, 1_500_000);
        assert_eq!(t.cost("gpt", Some(&u)), Some(6.0));
        assert_eq!(t.cost("other", Some(&u)), None);
        assert_eq!(t.cost("gpt", None), None);
    }

    #[test]
    fn jsonl_sink_writes_one_line_per_record() {
        let path = std::env::temp_dir().join(format!("pgw-jsonl-{}.jsonl", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let sink = JsonlSink::open(&path).unwrap();
        sink.record(&record("success"));
        sink.record(&record("transient"));
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["outcome"], "transient");
        assert_eq!(lines[0]["source"], "s1");
        assert_eq!(lines[0]["admitted_at_s"], 12.5);
        std::fs::remove_file(&path).ok();
    }
}
