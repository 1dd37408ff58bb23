//! Turning a decision into bytes: OpenAI-style JSON answers, SSE frames and error bodies.

use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode, header};
use pgw_core::sse;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::IndexedRandom;
use serde::Serialize;
use serde_json::{Value, json};

use crate::body::SimBody;
use crate::dist::{mix, uniform};
use crate::limits::{RateHeaders, openai_duration};

/// Words the simulated model says (ASCII, so frames split on byte boundaries).
const WORDS: &[&str] = &[
    "the",
    "pool",
    "answers",
    "with",
    "latency",
    "tokens",
    "stream",
    "quota",
    "account",
    "source",
    "retry",
    "breaker",
    "window",
    "health",
    "model",
    "prompt",
    "result",
    "value",
    "under",
    "over",
    "simulated",
    "provider",
    "gateway",
    "budget",
    "minute",
    "second",
    "request",
    "reply",
    "data",
    "field",
];

/// What a refusing model says.
pub(crate) const REFUSAL: &str = "I'm sorry, but I can't help with that.";

/// Completion tokens of [`REFUSAL`] (one per word).
pub(crate) const REFUSAL_TOKENS: u64 = 8;

/// The error event of a 200 stream that fails at once.
const STREAM_ERROR: &str = r#"{"error":{"message":"The server had an error processing your request.","type":"server_error","param":null,"code":null}}"#;

/// What kind of 200 an answer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AnswerKind {
    /// A completion (possibly empty or invalid JSON).
    Text,
    /// No content, `finish_reason: "content_filter"`.
    ContentFilter,
    /// No content, a `refusal`.
    Refusal,
    /// A stream whose only event is an error object.
    StreamError,
}

/// The OpenAI fields an answer echoes when [`SourceConfig::echo_openai_fields`] is on.
///
/// [`SourceConfig::echo_openai_fields`]: crate::SourceConfig::echo_openai_fields
#[derive(Debug)]
pub(crate) struct Echo {
    pub(crate) system_fingerprint: String,
    pub(crate) service_tier: String,
    /// The request asked for `logprobs`.
    pub(crate) logprobs: bool,
}

/// A planned completion (all random choices already drawn).
#[derive(Debug)]
pub(crate) struct AnswerPlan {
    pub(crate) id: String,
    pub(crate) model: String,
    pub(crate) created: u64,
    pub(crate) stream: bool,
    pub(crate) json_mode: bool,
    pub(crate) ttft: Duration,
    pub(crate) tokens_per_second: f64,
    pub(crate) tokens: u64,
    pub(crate) prompt_tokens: u64,
    pub(crate) empty: bool,
    pub(crate) invalid_json: bool,
    /// Position in `[0, 1)` of the stretched gap and its length.
    pub(crate) stall: Option<(f64, Duration)>,
    pub(crate) text_seed: u64,
    pub(crate) max_frames: u32,
    pub(crate) kind: AnswerKind,
    /// A stream ends with a usage chunk.
    pub(crate) usage_chunk: bool,
    /// A stream ends with `data: [DONE]`.
    pub(crate) done: bool,
    /// A stream carries one event that is not JSON.
    pub(crate) malformed: bool,
    pub(crate) echo: Option<Echo>,
    /// The assistant prefill this answer continues (sources that accept one).
    pub(crate) prefix: Option<String>,
}

impl AnswerPlan {
    /// Completion tokens reported (and counted).
    pub(crate) fn completion_tokens(&self) -> u64 {
        match self.kind {
            AnswerKind::Text if !self.empty => self.tokens,
            AnswerKind::Refusal => REFUSAL_TOKENS,
            _ => 0,
        }
    }
}

/// A built answer: when its headers go out after arrival, the response, and when its
/// last byte is planned to go out after arrival.
pub(crate) struct Built {
    pub(crate) delay: Duration,
    pub(crate) response: Response<SimBody>,
    pub(crate) total: Duration,
}

fn content(plan: &AnswerPlan, rng: &mut SmallRng) -> String {
    if plan.empty {
        return String::new();
    }
    // A continuation's `tokens` come after its prefill's words, as a provider counts
    // `max_tokens` from the end of the prefill: the text is drawn whole (the same
    // words on every prefill source) and the prefill's part taken off.
    let prefilled = plan.prefix.as_deref().map_or(0, |p| p.split_whitespace().count());
    let n = usize::try_from(plan.tokens)
        .unwrap_or(usize::MAX)
        .saturating_add(prefilled);
    let mut words = String::with_capacity(n * 7);
    for i in 0..n {
        if i > 0 {
            words.push(' ');
        }
        words.push_str(WORDS.choose(rng).copied().unwrap_or("x"));
    }
    if !plan.json_mode {
        return words;
    }
    let confidence = (uniform(rng, 0.5, 1.0) * 100.0).round() / 100.0;
    let mut json = format!("{{\"answer\":\"{words}\",\"confidence\":{confidence},\"complete\":true}}");
    if plan.invalid_json {
        // Two real-world failures: a truncated object, or prose around it.
        if rand::Rng::random_bool(rng, 0.5) {
            let cut = rand::Rng::random_range(rng, 1..=12usize).min(json.len() - 1);
            json.truncate(json.len() - cut);
        } else {
            json = format!("Sure! Here is the JSON you asked for:\n{json}");
        }
    }
    json
}

/// The text after an assistant prefill that starts it: a continuation.
fn continuation(text: String, prefix: Option<&str>) -> String {
    match prefix {
        Some(p) if !p.is_empty() && text.starts_with(p) => text[p.len()..].to_owned(),
        _ => text,
    }
}

/// `usage`, in the field order of `pgw_core::openai::Usage` (and OpenAI's details when
/// echoing).
#[derive(Serialize)]
struct WireUsage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    completion_tokens_details: Option<CompletionDetails>,
}

#[derive(Serialize)]
struct CompletionDetails {
    reasoning_tokens: u64,
}

fn usage(plan: &AnswerPlan) -> WireUsage {
    let completion_tokens = plan.completion_tokens();
    WireUsage {
        prompt_tokens: plan.prompt_tokens,
        completion_tokens,
        total_tokens: plan.prompt_tokens + completion_tokens,
        completion_tokens_details: plan
            .echo
            .as_ref()
            .map(|_| CompletionDetails { reasoning_tokens: 0 }),
    }
}

/// A non-streamed answer. Field order and omissions match `pgw_core`'s `ChatResponse`
/// when nothing is echoed, so historical answers keep their bytes.
#[derive(Serialize)]
struct Completion<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [CompletionChoice<'a>; 1],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<WireUsage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    service_tier: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system_fingerprint: Option<&'a str>,
}

#[derive(Serialize)]
struct CompletionChoice<'a> {
    index: u32,
    message: WireMessage<'a>,
    /// Absent unless echoing; then `null` or the log probabilities.
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<Option<Value>>,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct WireMessage<'a> {
    role: &'static str,
    content: Option<&'a str>,
    /// Absent unless echoing or refusing.
    #[serde(skip_serializing_if = "Option::is_none")]
    refusal: Option<Option<&'a str>>,
}

/// One streamed chunk, in the field order of `pgw_core`'s `ChatChunk`.
#[derive(Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<ChunkChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<WireUsage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    service_tier: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system_fingerprint: Option<&'a str>,
}

#[derive(Serialize)]
struct ChunkChoice<'a> {
    index: u32,
    delta: WireDelta<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<Option<Value>>,
    finish_reason: Option<&'static str>,
}

#[derive(Default, Serialize)]
struct WireDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    refusal: Option<&'a str>,
}

/// Per-token log probabilities of `text` (one entry per space-ended piece), with
/// deterministic values.
#[allow(clippy::cast_precision_loss)]
fn logprobs(text: &str, seed: u64) -> Value {
    let content: Vec<Value> = text
        .split_inclusive(' ')
        .enumerate()
        .map(|(i, token)| {
            let logprob = -((mix(seed ^ i as u64) % 2000) as f64) / 1000.0;
            json!({"token": token, "logprob": logprob, "bytes": token.as_bytes(), "top_logprobs": []})
        })
        .collect();
    json!({"content": content, "refusal": null})
}

fn split(text: &str, pieces: usize) -> Vec<&str> {
    let len = text.len();
    let mut out = Vec::with_capacity(pieces);
    let mut start = 0;
    for i in 1..=pieces {
        let mut end = len * i / pieces;
        while !text.is_char_boundary(end) {
            end += 1;
        }
        out.push(&text[start..end]);
        start = end;
    }
    out
}

/// Builds the answer: the delay before headers and the response (JSON or SSE).
#[allow(clippy::too_many_lines)] // one answer, JSON then SSE, read top to bottom
pub(crate) fn build(plan: &AnswerPlan, request_id: &str) -> Built {
    let mut rng = SmallRng::seed_from_u64(plan.text_seed);
    let text = match plan.kind {
        AnswerKind::Text => continuation(content(plan, &mut rng), plan.prefix.as_deref()),
        AnswerKind::Refusal => REFUSAL.to_owned(),
        AnswerKind::ContentFilter | AnswerKind::StreamError => String::new(),
    };
    let generated = match plan.kind {
        AnswerKind::Text => plan.tokens,
        AnswerKind::Refusal => REFUSAL_TOKENS,
        AnswerKind::ContentFilter | AnswerKind::StreamError => 1,
    };
    let mut resp = Response::builder().header("x-request-id", request_id);
    if plan.kind == AnswerKind::StreamError {
        let frames = vec![(Duration::ZERO, Bytes::from(sse::encode_data(STREAM_ERROR)))];
        resp = resp
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache");
        return Built {
            delay: plan.ttft,
            response: finish(&resp, StatusCode::OK, SimBody::stream(frames)),
            total: plan.ttft,
        };
    }
    // Frames: `k` content frames, then one final frame (finish, usage, [DONE]).
    let k = if plan.empty || plan.kind == AnswerKind::ContentFilter {
        1
    } else {
        usize::try_from(generated)
            .unwrap_or(usize::MAX)
            .clamp(1, plan.max_frames as usize - 1)
    };
    let tokens_per_frame = generated.max(1) as f64 / k as f64;
    let mut gaps = Vec::with_capacity(k + 1);
    gaps.push(Duration::ZERO);
    for j in 1..=k {
        let toks = if j == k { 1.0 } else { tokens_per_frame };
        let secs = toks / plan.tokens_per_second * uniform(&mut rng, 0.5, 1.5);
        gaps.push(Duration::from_secs_f64(secs));
    }
    if let Some((pos, gap)) = plan.stall {
        let j = 1 + ((pos * k as f64) as usize).min(k - 1);
        gaps[j] += gap;
    }
    let generation: Duration = gaps.iter().sum();
    let echo = plan.echo.as_ref();
    let service_tier = echo.map(|e| e.service_tier.as_str());
    let system_fingerprint = echo.map(|e| e.system_fingerprint.as_str());
    let wants_logprobs = |piece: &str| echo.map(|e| e.logprobs.then(|| logprobs(piece, plan.text_seed)));
    let finish_reason = if plan.kind == AnswerKind::ContentFilter {
        "content_filter"
    } else {
        "stop"
    };
    if !plan.stream {
        let body = Completion {
            id: &plan.id,
            object: "chat.completion",
            created: plan.created,
            model: &plan.model,
            choices: [CompletionChoice {
                index: 0,
                message: WireMessage {
                    role: "assistant",
                    content: (plan.kind == AnswerKind::Text).then_some(text.as_str()),
                    refusal: match plan.kind {
                        AnswerKind::Refusal => Some(Some(REFUSAL)),
                        _ => echo.map(|_| None),
                    },
                },
                logprobs: wants_logprobs(&text),
                finish_reason,
            }],
            usage: Some(usage(plan)),
            service_tier,
            system_fingerprint,
        };
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        resp = resp.header(header::CONTENT_TYPE, "application/json");
        return Built {
            delay: plan.ttft + generation,
            response: finish(&resp, StatusCode::OK, SimBody::full(Bytes::from(bytes))),
            total: plan.ttft + generation,
        };
    }
    let chunk =
        |delta: WireDelta<'_>, logprobs: Option<Option<Value>>, finish_reason: Option<&'static str>| {
            let c = Chunk {
                id: &plan.id,
                object: "chat.completion.chunk",
                created: plan.created,
                model: &plan.model,
                choices: vec![ChunkChoice {
                    index: 0,
                    delta,
                    logprobs,
                    finish_reason,
                }],
                usage: None,
                service_tier,
                system_fingerprint,
            };
            sse::encode_data(&serde_json::to_string(&c).unwrap_or_default())
        };
    let pieces = split(&text, k);
    let mut frames = Vec::with_capacity(k + 1);
    for (j, piece) in pieces.iter().enumerate() {
        let role = (j == 0).then_some("assistant");
        let delta = match plan.kind {
            AnswerKind::Refusal => WireDelta {
                role,
                refusal: Some(piece),
                ..WireDelta::default()
            },
            AnswerKind::ContentFilter => WireDelta {
                role,
                ..WireDelta::default()
            },
            _ => WireDelta {
                role,
                content: Some(piece),
                ..WireDelta::default()
            },
        };
        let logprobs = if plan.kind == AnswerKind::Text {
            wants_logprobs(piece)
        } else {
            echo.map(|_| None)
        };
        frames.push((gaps[j], chunk(delta, logprobs, None)));
    }
    if plan.malformed {
        // A provider hiccup: half an event, then the stream goes on.
        let m = (frames.len() - 1) / 2;
        frames[m].1.push_str(&sse::encode_data(&format!(
            r#"{{"id":"{}","object":"chat.completion.chunk","choices":[{{"index":0,"delta":{{"content":"#,
            plan.id
        )));
    }
    let mut last = chunk(WireDelta::default(), echo.map(|_| None), Some(finish_reason));
    if plan.usage_chunk {
        let usage_chunk = Chunk {
            id: &plan.id,
            object: "chat.completion.chunk",
            created: plan.created,
            model: &plan.model,
            choices: Vec::new(),
            usage: Some(usage(plan)),
            service_tier,
            system_fingerprint,
        };
        last.push_str(&sse::encode_data(
            &serde_json::to_string(&usage_chunk).unwrap_or_default(),
        ));
    }
    if plan.done {
        last.push_str(sse::DONE);
    }
    frames.push((gaps[k], last));
    resp = resp
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache");
    let frames = frames.into_iter().map(|(gap, s)| (gap, Bytes::from(s))).collect();
    Built {
        delay: plan.ttft,
        response: finish(&resp, StatusCode::OK, SimBody::stream(frames)),
        total: plan.ttft + generation,
    }
}

/// The body shape of an error answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ErrorShape {
    /// `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`.
    Anthropic,
}

/// An OpenAI-style error answer.
#[derive(Debug)]
pub(crate) struct ErrorPlan {
    pub(crate) status: StatusCode,
    pub(crate) kind: &'static str,
    pub(crate) code: &'static str,
    pub(crate) param: Option<&'static str>,
    pub(crate) message: String,
    pub(crate) shape: ErrorShape,
    pub(crate) delay: Duration,
    pub(crate) retry_after_s: Option<u64>,
    /// An exact hint in real time (hard limits): `retry-after` (whole seconds rounded
    /// up when unscaled, else decimal) and `retry-after-ms` (rounded up).
    pub(crate) retry_exact: Option<Duration>,
    /// The pool's time scale: `retry_after_s` and the reset are scenario seconds, sent
    /// times this (as decimal seconds when it is not 1).
    pub(crate) time_scale: f64,
    /// `(limit, reset seconds)` for `x-ratelimit-*` headers.
    pub(crate) rpm_limit: Option<(u32, u64)>,
}

/// `secs` scenario seconds in real seconds: an integer when unscaled, else a decimal
/// with millisecond precision (at least 0.001).
#[allow(clippy::cast_precision_loss, clippy::float_cmp)]
fn scaled_secs(secs: u64, scale: f64) -> String {
    if scale == 1.0 {
        secs.to_string()
    } else {
        format!("{:.3}", (secs as f64 * scale).max(0.001))
    }
}

#[allow(clippy::float_cmp)]
pub(crate) fn build_error(plan: &ErrorPlan, request_id: &str) -> Built {
    let body = match plan.shape {
        ErrorShape::OpenAi => json!({
            "error": {
                "message": plan.message,
                "type": plan.kind,
                "param": plan.param,
                "code": plan.code,
            }
        }),
        ErrorShape::Anthropic => json!({
            "type": "error",
            "error": {"type": plan.kind, "message": plan.message},
        }),
    };
    let mut resp = Response::builder()
        .header("x-request-id", request_id)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(s) = plan.retry_after_s {
        resp = resp.header(header::RETRY_AFTER, scaled_secs(s, plan.time_scale));
    }
    if let Some(d) = plan.retry_exact {
        let ms = d.as_nanos().div_ceil(1_000_000);
        let value = if plan.time_scale == 1.0 {
            d.as_nanos().div_ceil(1_000_000_000).to_string()
        } else {
            format!("{}.{:03}", ms / 1000, ms % 1000)
        };
        resp = resp
            .header(header::RETRY_AFTER, value)
            .header("retry-after-ms", ms.to_string());
    }
    if let Some((limit, reset)) = plan.rpm_limit {
        resp = resp
            .header("x-ratelimit-limit-requests", limit)
            .header("x-ratelimit-remaining-requests", 0)
            .header(
                "x-ratelimit-reset-requests",
                format!("{}s", scaled_secs(reset, plan.time_scale)),
            );
    }
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    Built {
        delay: plan.delay,
        response: finish(&resp, plan.status, SimBody::full(Bytes::from(bytes))),
        total: plan.delay,
    }
}

/// Sets the `x-ratelimit-*` headers (replacing a gate's), reset times in real time.
pub(crate) fn set_rate_headers(resp: &mut Response<SimBody>, h: &RateHeaders, scale: f64) {
    for (dim, trio) in [("requests", h.requests), ("tokens", h.tokens)] {
        let Some(t) = trio else { continue };
        let headers = resp.headers_mut();
        let mut set = |name: String, value: String| {
            if let (Ok(n), Ok(v)) = (
                header::HeaderName::try_from(name),
                header::HeaderValue::try_from(value),
            ) {
                headers.insert(n, v);
            }
        };
        set(format!("x-ratelimit-limit-{dim}"), t.limit.to_string());
        set(format!("x-ratelimit-remaining-{dim}"), t.remaining.to_string());
        set(
            format!("x-ratelimit-reset-{dim}"),
            openai_duration(t.reset.mul_f64(scale)),
        );
    }
}

fn finish(builder: &http::response::Builder, status: StatusCode, body: SimBody) -> Response<SimBody> {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    if let Some(h) = builder.headers_ref() {
        resp.headers_mut().clone_from(h);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_text() {
        let t = "abcdefghij";
        let p = split(t, 3);
        assert_eq!(p.len(), 3);
        assert_eq!(p.concat(), t);
        assert_eq!(split("", 1), vec![""]);
    }
}
