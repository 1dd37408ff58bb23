//! Turning a decision into bytes: OpenAI-style JSON answers, SSE frames and error bodies.

use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode, header};
use pgw_core::openai::{ChatChunk, ChatMessage, ChatResponse, Choice, ChunkChoice, Delta, Usage};
use pgw_core::sse;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::IndexedRandom;

use crate::body::SimBody;
use crate::dist::uniform;

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
}

/// A built answer: when its headers go out after arrival, and the response.
pub(crate) struct Built {
    pub(crate) delay: Duration,
    pub(crate) response: Response<SimBody>,
}

fn content(plan: &AnswerPlan, rng: &mut SmallRng) -> String {
    if plan.empty {
        return String::new();
    }
    let n = usize::try_from(plan.tokens).unwrap_or(usize::MAX);
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

fn usage(plan: &AnswerPlan) -> Usage {
    let completion_tokens = if plan.empty { 0 } else { plan.tokens };
    Usage {
        prompt_tokens: plan.prompt_tokens,
        completion_tokens,
        total_tokens: plan.prompt_tokens + completion_tokens,
    }
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
pub(crate) fn build(plan: &AnswerPlan, request_id: &str) -> Built {
    let mut rng = SmallRng::seed_from_u64(plan.text_seed);
    let text = content(plan, &mut rng);
    let usage = usage(plan);
    // Frames: `k` content frames, then one final frame (finish, usage, [DONE]).
    let k = if plan.empty {
        1
    } else {
        usize::try_from(plan.tokens)
            .unwrap_or(usize::MAX)
            .clamp(1, plan.max_frames as usize - 1)
    };
    let tokens_per_frame = plan.tokens.max(1) as f64 / k as f64;
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
    let mut resp = Response::builder().header("x-request-id", request_id);
    if !plan.stream {
        let body = ChatResponse {
            id: plan.id.clone(),
            object: "chat.completion".into(),
            created: plan.created,
            model: plan.model.clone(),
            choices: vec![Choice {
                index: 0,
                message: ChatMessage::new("assistant", text),
                finish_reason: Some("stop".into()),
            }],
            usage: Some(usage),
        };
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        resp = resp.header(header::CONTENT_TYPE, "application/json");
        return Built {
            delay: plan.ttft + generation,
            response: finish(&resp, StatusCode::OK, SimBody::full(Bytes::from(bytes))),
        };
    }
    let chunk = |delta: Delta, finish_reason: Option<String>| ChatChunk {
        id: plan.id.clone(),
        object: "chat.completion.chunk".into(),
        created: plan.created,
        model: plan.model.clone(),
        choices: vec![ChunkChoice {
            index: 0,
            delta,
            finish_reason,
        }],
        usage: None,
    };
    let event = |c: &ChatChunk| sse::encode_data(&serde_json::to_string(c).unwrap_or_default());
    let pieces = split(&text, k);
    let mut frames = Vec::with_capacity(k + 1);
    for (j, piece) in pieces.iter().enumerate() {
        let delta = Delta {
            role: (j == 0).then(|| "assistant".into()),
            content: Some((*piece).to_owned()),
            ..Delta::default()
        };
        frames.push((gaps[j], Bytes::from(event(&chunk(delta, None)))));
    }
    let mut last = event(&chunk(Delta::default(), Some("stop".into())));
    let usage_chunk = ChatChunk {
        choices: Vec::new(),
        usage: Some(usage),
        ..chunk(Delta::default(), None)
    };
    last.push_str(&event(&usage_chunk));
    last.push_str(sse::DONE);
    frames.push((gaps[k], Bytes::from(last)));
    resp = resp
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache");
    Built {
        delay: plan.ttft,
        response: finish(&resp, StatusCode::OK, SimBody::stream(frames)),
    }
}

/// An OpenAI-style error answer.
#[derive(Debug)]
pub(crate) struct ErrorPlan {
    pub(crate) status: StatusCode,
    pub(crate) kind: &'static str,
    pub(crate) code: &'static str,
    pub(crate) message: String,
    pub(crate) delay: Duration,
    pub(crate) retry_after_s: Option<u64>,
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

pub(crate) fn build_error(plan: &ErrorPlan, request_id: &str) -> Built {
    let body = serde_json::json!({
        "error": {
            "message": plan.message,
            "type": plan.kind,
            "param": null,
            "code": plan.code,
        }
    });
    let mut resp = Response::builder()
        .header("x-request-id", request_id)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(s) = plan.retry_after_s {
        resp = resp.header(header::RETRY_AFTER, scaled_secs(s, plan.time_scale));
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
