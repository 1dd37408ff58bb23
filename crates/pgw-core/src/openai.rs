//! The OpenAI-compatible chat completion types that cross layer boundaries: the
//! simulator serves them, the gateway sends them, the limiter estimates their tokens.
//!
//! Only the fields the layers read are typed; everything else a client or provider
//! sends is kept in `extra` and passed through untouched.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Default completion budget assumed by [`ChatRequest::estimate_tokens`] when a request
/// sets no `max_tokens`: 1024, a typical chat answer's upper bound in the seeds' traffic.
pub const DEFAULT_MAX_TOKENS_ESTIMATE: u64 = 1024;

/// Bytes per token assumed by [`ChatRequest::estimate_tokens`]: 3, a deliberately
/// pessimistic ratio (English averages ~4 bytes/token; CJK text is closer to 3), so a
/// reservation is rarely too small (L4).
pub const BYTES_PER_TOKEN_ESTIMATE: u64 = 3;

/// One message of a chat.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text. Providers may send `null` for tool-call answers: read as empty.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub content: String,
    /// Fields this crate does not interpret (tool calls, names, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            extra: Map::new(),
        }
    }
}

/// A chat completion request (`POST /v1/chat/completions`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    /// The model name.
    pub model: String,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// The completion budget, if the caller set one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// Whether the answer is streamed as server-sent events.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
    /// Fields this crate does not interpret (temperature, tools, response_format, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ChatRequest {
    /// A request for `model` with one user message.
    pub fn user(model: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            model: model.into(),
            messages: vec![ChatMessage::new("user", content)],
            ..Self::default()
        }
    }

    /// The bytes of prompt text (all message contents).
    #[must_use]
    pub fn prompt_bytes(&self) -> u64 {
        self.messages.iter().map(|m| m.content.len() as u64).sum()
    }

    /// The token reservation made before dispatch (L4): prompt bytes /
    /// [`BYTES_PER_TOKEN_ESTIMATE`] + `max_tokens` (or
    /// [`DEFAULT_MAX_TOKENS_ESTIMATE`]).
    ///
    /// ```
    /// let mut req = pgw_core::openai::ChatRequest::user("m", "x".repeat(300));
    /// req.max_tokens = Some(50);
    /// assert_eq!(req.estimate_tokens(), 150);
    /// ```
    #[must_use]
    pub fn estimate_tokens(&self) -> u64 {
        self.prompt_bytes() / BYTES_PER_TOKEN_ESTIMATE
            + self.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS_ESTIMATE)
    }
}

/// Token usage reported by the provider.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens of the prompt.
    pub prompt_tokens: u64,
    /// Tokens of the completion.
    pub completion_tokens: u64,
    /// Their sum.
    pub total_tokens: u64,
}

/// One choice of a non-streaming answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// Index of the choice.
    #[serde(default)]
    pub index: u32,
    /// The answer.
    pub message: ChatMessage,
    /// Why generation stopped (`stop`, `length`, ...).
    #[serde(default)]
    pub finish_reason: Option<String>,
}

/// A non-streaming chat completion answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatResponse {
    /// Provider's completion id.
    #[serde(default)]
    pub id: String,
    /// `chat.completion`.
    #[serde(default)]
    pub object: String,
    /// Unix seconds.
    #[serde(default)]
    pub created: u64,
    /// The model that answered.
    #[serde(default)]
    pub model: String,
    /// The answers.
    #[serde(default)]
    pub choices: Vec<Choice>,
    /// Token usage, when reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

impl ChatResponse {
    /// The first choice's text, or `""`.
    #[must_use]
    pub fn content(&self) -> &str {
        self.choices.first().map_or("", |c| c.message.content.as_str())
    }

    /// True when no choice carries text or a tool call: the "200 with an empty
    /// completion" failure the seeds measured at 14-17% on a healthy source.
    #[must_use]
    pub fn is_empty_completion(&self) -> bool {
        self.choices
            .iter()
            .all(|c| c.message.content.trim().is_empty() && !c.message.extra.contains_key("tool_calls"))
    }
}

/// The incremental part of a streamed choice.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    /// Set on the first chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The next piece of text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Fields this crate does not interpret as text: `tool_calls` (merged by
    /// [`ChunkAccumulator`]), `refusal`, provider extensions.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Delta {
    /// Whether this piece carries output: text, or any other non-null field such as a
    /// tool call. A role-only delta does not (watchdogs wait for real output).
    #[must_use]
    pub fn carries_output(&self) -> bool {
        self.content.as_deref().is_some_and(|t| !t.is_empty()) || self.extra.values().any(|v| !v.is_null())
    }
}

/// One choice of a streamed chunk.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChunkChoice {
    /// Index of the choice.
    #[serde(default)]
    pub index: u32,
    /// What this chunk adds.
    #[serde(default)]
    pub delta: Delta,
    /// Set on the last chunk of the choice.
    #[serde(default)]
    pub finish_reason: Option<String>,
}

/// One server-sent event of a streamed answer (`chat.completion.chunk`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatChunk {
    /// Provider's completion id (the same on every chunk).
    #[serde(default)]
    pub id: String,
    /// `chat.completion.chunk`.
    #[serde(default)]
    pub object: String,
    /// Unix seconds.
    #[serde(default)]
    pub created: u64,
    /// The model that answers.
    #[serde(default)]
    pub model: String,
    /// The pieces.
    #[serde(default)]
    pub choices: Vec<ChunkChoice>,
    /// Usage, on the final chunk when the provider reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// Folds streamed chunks into the equivalent non-streaming answer.
#[derive(Debug, Default)]
pub struct ChunkAccumulator {
    resp: ChatResponse,
}

impl ChunkAccumulator {
    /// Adds one chunk.
    pub fn push(&mut self, chunk: &ChatChunk) {
        if self.resp.id.is_empty() {
            self.resp.id.clone_from(&chunk.id);
            self.resp.model.clone_from(&chunk.model);
            self.resp.created = chunk.created;
            "chat.completion".clone_into(&mut self.resp.object);
        }
        for c in &chunk.choices {
            let idx = c.index as usize;
            while self.resp.choices.len() <= idx {
                let index = u32::try_from(self.resp.choices.len()).unwrap_or(u32::MAX);
                self.resp.choices.push(Choice {
                    index,
                    message: ChatMessage::new("assistant", ""),
                    finish_reason: None,
                });
            }
            let choice = &mut self.resp.choices[idx];
            if let Some(role) = &c.delta.role {
                choice.message.role.clone_from(role);
            }
            if let Some(text) = &c.delta.content {
                choice.message.content.push_str(text);
            }
            if let Some(Value::Array(calls)) = c.delta.extra.get("tool_calls") {
                merge_tool_calls(&mut choice.message.extra, calls);
            }
            if c.finish_reason.is_some() {
                choice.finish_reason.clone_from(&c.finish_reason);
            }
        }
        if chunk.usage.is_some() {
            self.resp.usage = chunk.usage;
        }
    }

    /// The answer so far.
    #[must_use]
    pub fn finish(self) -> ChatResponse {
        self.resp
    }
}

/// Merges streamed tool-call fragments (OpenAI: each carries an `index`; `id`, `type`
/// and `function.name` arrive once, `function.arguments` in pieces) into the message's
/// `tool_calls` array.
fn merge_tool_calls(message_extra: &mut Map<String, Value>, fragments: &[Value]) {
    let calls = message_extra
        .entry("tool_calls")
        .or_insert_with(|| Value::Array(Vec::new()));
    let Value::Array(calls) = calls else { return };
    for (n, fragment) in fragments.iter().enumerate() {
        let Value::Object(fragment) = fragment else {
            continue;
        };
        let index = fragment
            .get("index")
            .and_then(Value::as_u64)
            .and_then(|i| usize::try_from(i).ok())
            .unwrap_or(n);
        // A garbage index must not make us allocate without bound.
        if index > 1024 {
            continue;
        }
        while calls.len() <= index {
            calls.push(serde_json::json!({"type": "function", "function": {"name": "", "arguments": ""}}));
        }
        let Value::Object(call) = &mut calls[index] else {
            continue;
        };
        for key in ["id", "type"] {
            if let Some(v) = fragment.get(key).filter(|v| !v.is_null()) {
                call.insert(key.to_owned(), v.clone());
            }
        }
        if let Some(Value::Object(f)) = fragment.get("function") {
            let function = call
                .entry("function")
                .or_insert_with(|| serde_json::json!({"name": "", "arguments": ""}));
            if let Value::Object(function) = function {
                for key in ["name", "arguments"] {
                    if let Some(piece) = f.get(key).and_then(Value::as_str) {
                        let slot = function
                            .entry(key)
                            .or_insert_with(|| Value::String(String::new()));
                        if let Value::String(text) = slot {
                            text.push_str(piece);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_call_streams_accumulate_and_count_as_output() {
        let frames = [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get_weather","arguments":""}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"Paris\"}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
        ];
        let mut acc = ChunkAccumulator::default();
        let mut outputs = Vec::new();
        for f in frames {
            let chunk: ChatChunk = serde_json::from_str(f).unwrap();
            outputs.push(chunk.choices[0].delta.carries_output());
            acc.push(&chunk);
        }
        assert_eq!(outputs, [false, true, true, true, false]);
        let resp = acc.finish();
        assert!(!resp.is_empty_completion(), "a tool call is an answer");
        let call = &resp.choices[0].message.extra["tool_calls"][0];
        assert_eq!(call["id"], "call_1");
        assert_eq!(call["function"]["name"], "get_weather");
        assert_eq!(call["function"]["arguments"], r#"{"city":"Paris"}"#);
        // Garbage fragments are skipped, never a panic or a huge allocation.
        let mut extra = Map::new();
        merge_tool_calls(
            &mut extra,
            &[Value::from(3), serde_json::json!({"index": u64::MAX})],
        );
        assert_eq!(extra["tool_calls"], serde_json::json!([]));
    }

    #[test]
    fn request_roundtrips_unknown_fields() {
        let json =
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.2,"stream":true}"#;
        let req: ChatRequest = serde_json::from_str(json).unwrap();
        assert!(req.stream);
        assert_eq!(req.extra["temperature"], 0.2);
        let back: Value = serde_json::to_value(&req).unwrap();
        assert_eq!(back["temperature"], 0.2);
        assert_eq!(req.estimate_tokens(), DEFAULT_MAX_TOKENS_ESTIMATE);
    }

    #[test]
    fn empty_completion_and_null_content() {
        let json = r#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":null}}]}"#;
        let resp: ChatResponse = serde_json::from_str(json).unwrap();
        assert!(resp.is_empty_completion());
        let json = r#"{"choices":[{"message":{"role":"assistant","content":"ok"}}]}"#;
        let resp: ChatResponse = serde_json::from_str(json).unwrap();
        assert!(!resp.is_empty_completion());
        assert_eq!(resp.content(), "ok");
    }

    #[test]
    fn chunks_accumulate() {
        let mut acc = ChunkAccumulator::default();
        for (i, t) in ["Hel", "lo"].iter().enumerate() {
            acc.push(&ChatChunk {
                id: "c".into(),
                choices: vec![ChunkChoice {
                    index: 0,
                    delta: Delta {
                        role: (i == 0).then(|| "assistant".into()),
                        content: Some((*t).into()),
                        extra: Map::new(),
                    },
                    finish_reason: None,
                }],
                ..ChatChunk::default()
            });
        }
        let r = acc.finish();
        assert_eq!(r.content(), "Hello");
        assert_eq!(r.id, "c");
    }
}
