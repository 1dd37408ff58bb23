//! The OpenAI-compatible chat completion types that cross layer boundaries: the
//! simulator serves them, the gateway sends them, the limiter estimates their tokens.
//!
//! Only the fields the layers read are typed; everything else a client or provider
//! sends (`logprobs`, `system_fingerprint`, `service_tier`, usage details, `refusal`,
//! provider extensions) is kept in an `extra` map at its level and written back:
//! a response read and serialized again carries every field it came with, with the
//! same values. Message content is [`Content`]: a string, `null` or content parts,
//! written back as it was read.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

mod content;

/// A `T` read from JSON bytes, `None` when they are not one or are not UTF-8 as a
/// whole (read them again with `serde_json::from_slice`, for the error or for bytes
/// whose only invalid UTF-8 is in a string `T` skips). The bytes are checked as UTF-8 once, as
/// a whole, and read as text: `serde_json::from_slice` checks every string on its
/// own, about 1,200 of the 9,000 instructions a 257-byte answer takes to read
/// (callgrind, 2026-12-05).
///
/// ```
/// use pgw_core::openai::{from_json_bytes, ChatRequest};
/// let req: ChatRequest = from_json_bytes(br#"{"model":"m","messages":[]}"#).unwrap();
/// assert_eq!(req.model, "m");
/// assert!(from_json_bytes::<ChatRequest>(b"{\"model\":\"\xff\",\"messages\":[]}").is_none());
/// ```
#[must_use]
pub fn from_json_bytes<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Option<T> {
    serde_json::from_str(std::str::from_utf8(bytes).ok()?).ok()
}

/// A field that may come as `null` (a provider's way of saying "none") where this
/// crate keeps a default: `null` reads as the default instead of failing the whole
/// answer or chunk (and, for a chunk, losing its text).
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A JSON number as a `u64`: an integer as it is, a float truncated toward zero; a
/// negative or non-finite number, or one past `u64::MAX`, is `None`.
fn number_u64(n: &serde_json::Number) -> Option<u64> {
    n.as_u64().or_else(|| {
        n.as_f64()
            .filter(|f| f.is_finite() && *f >= 0.0 && *f < 1.8e19)
            .map(|f| f as u64)
    })
}

/// Unix seconds as an integer, a float (`1.7e9`) or `null` (0); a negative or
/// out-of-range time reads as 0.
fn unix_seconds<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    Ok(Option::<serde_json::Number>::deserialize(d)?
        .as_ref()
        .and_then(number_u64)
        .unwrap_or(0))
}

/// A token count as a provider writes it: an integer, a float (`12.0`), `null` (0,
/// as gateways in front of some providers send), a negative number (0). A count past
/// `u64::MAX` is `u64::MAX` (the limiter caps what it charges).
fn token_count<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    Ok(Option::<serde_json::Number>::deserialize(d)?
        .as_ref()
        .map_or(0, count_u64))
}

/// A count: as [`number_u64`], a negative number 0 and one past `u64::MAX` `u64::MAX`.
fn count_u64(n: &serde_json::Number) -> u64 {
    number_u64(n).unwrap_or_else(|| {
        if n.as_f64().is_some_and(|f| f > 0.0) {
            u64::MAX
        } else {
            0
        }
    })
}

pub use content::{Content, ContentPart, IMAGE_PART_TOKENS_ESTIMATE};

/// Default completion budget assumed by [`ChatRequest::estimate_tokens`] when a request
/// sets neither `max_tokens` nor `max_completion_tokens`: 1024, a typical chat
/// answer's upper bound.
pub const DEFAULT_MAX_TOKENS_ESTIMATE: u64 = 1024;

/// Bytes per token assumed by [`ChatRequest::estimate_tokens`]: 3, a deliberately
/// pessimistic ratio (English averages ~4 bytes/token; CJK text is closer to 3), so a
/// reservation is rarely too small.
pub const BYTES_PER_TOKEN_ESTIMATE: u64 = 3;

/// The `finish_reason` of an answer a provider's content filter stopped.
pub const FINISH_CONTENT_FILTER: &str = "content_filter";

/// `finish_reason` of a choice the provider could not finish (OpenRouter, when the
/// model behind it failed mid-answer): the answer is cut short, not complete.
pub const FINISH_ERROR: &str = "error";

/// The `finish_reason` of an answer cut by the caller's token limit (`max_tokens`).
pub const FINISH_LENGTH: &str = "length";

/// The `finish_reason` of an answer that ended by itself.
pub const FINISH_STOP: &str = "stop";

/// The `finish_reason` of an answer that ends to call tools.
pub const FINISH_TOOL_CALLS: &str = "tool_calls";

/// One message of a chat.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant`, `tool` or `function`.
    pub role: String,
    /// A string, `null` (tool-call answers, refusals) or content parts.
    #[serde(default)]
    pub content: Content,
    /// Fields this crate does not interpret (`tool_calls`, `name`, `refusal`, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ChatMessage {
    /// A message with `role` and a string `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Content::Text(content.into()),
            extra: Map::new(),
        }
    }

    /// The string content, or `""` when it is `null` or parts.
    #[must_use]
    pub fn text(&self) -> &str {
        self.content.as_text().unwrap_or("")
    }

    /// The model's refusal (`refusal`), when it refused.
    #[must_use]
    pub fn refusal(&self) -> Option<&str> {
        self.extra
            .get("refusal")
            .and_then(Value::as_str)
            .filter(|r| !r.trim().is_empty())
    }

    /// Whether the message calls a tool (`tool_calls` non-empty, or a legacy
    /// `function_call`).
    #[must_use]
    pub fn calls_tool(&self) -> bool {
        let present = |k: &str| match self.extra.get(k) {
            None | Some(Value::Null) => false,
            Some(Value::Array(a)) => !a.is_empty(),
            Some(_) => true,
        };
        present("tool_calls") || present("function_call")
    }

    /// Whether the message carries audio (`audio` with `modalities: ["audio"]`, whose
    /// `content` is `null`: the transcript is inside the audio object).
    #[must_use]
    pub fn carries_audio(&self) -> bool {
        matches!(self.extra.get("audio"), Some(Value::Object(o)) if !o.is_empty())
    }

    /// Whether the message answers: text, a tool call or audio (a decline or a cut
    /// by the token limit is judged on the choice, [`Choice::has_output`]).
    #[must_use]
    pub fn answers(&self) -> bool {
        self.content.has_output() || self.calls_tool() || self.carries_audio()
    }
}

/// A chat completion request (`POST /v1/chat/completions`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    /// The model name.
    pub model: String,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// The completion budget, if the caller set one (`max_completion_tokens`, its
    /// newer spelling, stays in `extra` and counts the same in the estimate).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// Whether the answer is streamed as server-sent events (`null` reads as `false`,
    /// as OpenAI's API takes it).
    #[serde(
        default,
        deserialize_with = "null_as_default",
        skip_serializing_if = "std::ops::Not::not"
    )]
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

    /// The bytes of prompt text: every message's string content or text parts.
    #[must_use]
    pub fn prompt_bytes(&self) -> u64 {
        self.messages
            .iter()
            .fold(0, |n, m| n.saturating_add(m.content.text_bytes()))
    }

    /// The number of image parts in the prompt.
    #[must_use]
    pub fn image_parts(&self) -> u64 {
        self.messages
            .iter()
            .fold(0, |n, m| n.saturating_add(m.content.image_parts()))
    }

    /// The completion budget the estimate counts: the larger of `max_tokens` and
    /// `max_completion_tokens` when either is set (the latter as an integer or a float,
    /// `1e6`; past `u64::MAX`, `u64::MAX`) times the choices asked for (`n`, at most
    /// [`MAX_CHOICES_ESTIMATE`]), each of which may spend it; else
    /// [`DEFAULT_MAX_TOKENS_ESTIMATE`], whatever `n`.
    ///
    /// ```
    /// let mut req = pgw_core::openai::ChatRequest::user("m", "hi");
    /// req.extra.insert("max_completion_tokens".into(), serde_json::json!(1e3));
    /// req.extra.insert("n".into(), serde_json::json!(3));
    /// assert_eq!(req.completion_budget(), 3000);
    /// req.extra.remove("max_completion_tokens");
    /// assert_eq!(req.completion_budget(), pgw_core::openai::DEFAULT_MAX_TOKENS_ESTIMATE);
    /// ```
    #[must_use]
    pub fn completion_budget(&self) -> u64 {
        let newer = self
            .extra
            .get("max_completion_tokens")
            .and_then(Value::as_number)
            .map(count_u64);
        let one = match (self.max_tokens, newer) {
            // Not multiplied by `n`: a default guess for several choices, at 1024 a
            // choice, could pass a small token quota and never be admitted.
            (None, None) => return DEFAULT_MAX_TOKENS_ESTIMATE,
            (a, b) => a.unwrap_or(0).max(b.unwrap_or(0)),
        };
        let choices = self
            .extra
            .get("n")
            .and_then(Value::as_number)
            .and_then(number_u64)
            .unwrap_or(1)
            .clamp(1, MAX_CHOICES_ESTIMATE);
        one.saturating_mul(choices)
    }

    /// Takes `used` tokens off the caller's completion limits (`max_tokens` and
    /// `max_completion_tokens`, each that is set): what a continuation of an answer
    /// that already has `used` tokens may still spend, as a provider counts the limit
    /// after an assistant prefill. `false`, with the request unchanged, when a limit
    /// has nothing left (or `max_completion_tokens` is not a count). Without a limit
    /// there is nothing to take: `true`.
    ///
    /// ```
    /// let mut req = pgw_core::openai::ChatRequest::user("m", "hi");
    /// req.max_tokens = Some(60);
    /// req.extra.insert("max_completion_tokens".into(), serde_json::json!(80));
    /// assert!(req.spend_completion_tokens(20));
    /// assert_eq!(req.max_tokens, Some(40));
    /// assert_eq!(req.extra["max_completion_tokens"], 60);
    /// assert!(!req.spend_completion_tokens(40), "max_tokens would be 0");
    /// assert_eq!(req.max_tokens, Some(40));
    /// ```
    #[must_use]
    pub fn spend_completion_tokens(&mut self, used: u64) -> bool {
        let left = |limit: u64| limit.checked_sub(used).filter(|&n| n > 0);
        let older = match self.max_tokens.map(left) {
            Some(None) => return false,
            older => older.flatten(),
        };
        let newer = match self.extra.get("max_completion_tokens").filter(|v| !v.is_null()) {
            Some(v) => match v.as_number().and_then(number_u64).and_then(left) {
                None => return false,
                newer => newer,
            },
            None => None,
        };
        if older.is_some() {
            self.max_tokens = older;
        }
        if let Some(n) = newer {
            self.extra.insert("max_completion_tokens".into(), n.into());
        }
        true
    }

    /// The token reservation made before dispatch: prompt bytes /
    /// [`BYTES_PER_TOKEN_ESTIMATE`] + [`IMAGE_PART_TOKENS_ESTIMATE`] per image part +
    /// [`completion_budget`](Self::completion_budget). Saturates at `u64::MAX` (a
    /// client may send `max_tokens: 18446744073709551615`).
    ///
    /// ```
    /// let mut req = pgw_core::openai::ChatRequest::user("m", "x".repeat(300));
    /// req.max_tokens = Some(50);
    /// assert_eq!(req.estimate_tokens(), 150);
    /// req.max_tokens = Some(u64::MAX);
    /// assert_eq!(req.estimate_tokens(), u64::MAX);
    /// ```
    #[must_use]
    pub fn estimate_tokens(&self) -> u64 {
        (self.prompt_bytes() / BYTES_PER_TOKEN_ESTIMATE)
            .saturating_add(self.image_parts().saturating_mul(IMAGE_PART_TOKENS_ESTIMATE))
            .saturating_add(self.completion_budget())
    }
}

/// The most choices (`n`) the completion budget counts: OpenAI's own bound on `n`.
pub const MAX_CHOICES_ESTIMATE: u64 = 128;

/// Token usage reported by the provider. A count written as `null`, a float or a
/// negative number is read (0, truncated, 0), not refused: an answer is not lost to
/// a gateway's way of writing its usage.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens of the prompt.
    #[serde(default, deserialize_with = "token_count")]
    pub prompt_tokens: u64,
    /// Tokens of the completion.
    #[serde(default, deserialize_with = "token_count")]
    pub completion_tokens: u64,
    /// Their sum.
    #[serde(default, deserialize_with = "token_count")]
    pub total_tokens: u64,
    /// Fields this crate does not interpret (`completion_tokens_details`,
    /// `prompt_tokens_details`, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Usage {
    /// Usage with these three counts and nothing else.
    #[must_use]
    pub fn new(prompt_tokens: u64, completion_tokens: u64, total_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens,
            extra: Map::new(),
        }
    }

    /// The tokens a quota is charged for this usage: `total_tokens`, or the prompt's
    /// and the completion's together when that is more (a provider that leaves
    /// `total_tokens` out, or writes it `null`, reads as 0 there); `None` when all of
    /// them are 0 (`"usage": {}`): nothing was reported, and a quota keeps its
    /// estimate instead of giving the whole reservation back.
    ///
    /// ```
    /// use pgw_core::openai::Usage;
    /// assert_eq!(Usage::new(9, 5, 14).charged(), Some(14));
    /// assert_eq!(Usage::new(9, 5, 0).charged(), Some(14));
    /// assert_eq!(Usage::new(0, 0, 0).charged(), None);
    /// ```
    #[must_use]
    pub fn charged(&self) -> Option<u64> {
        let n = self
            .total_tokens
            .max(self.prompt_tokens.saturating_add(self.completion_tokens));
        (n > 0).then_some(n)
    }
}

/// One choice of a non-streaming answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// Index of the choice.
    #[serde(default, deserialize_with = "null_as_default")]
    pub index: u32,
    /// The answer.
    pub message: ChatMessage,
    /// Why generation stopped (`stop`, `length`, `tool_calls`, `content_filter`, ...).
    #[serde(default)]
    pub finish_reason: Option<String>,
    /// Fields this crate does not interpret (`logprobs`, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Choice {
    /// Choice `index` with `message`, stopped for `finish_reason`.
    #[must_use]
    pub fn new(index: u32, message: ChatMessage, finish_reason: Option<String>) -> Self {
        Self {
            index,
            message,
            finish_reason,
            extra: Map::new(),
        }
    }

    /// Whether the provider declined to answer: its content filter stopped the
    /// answer (`finish_reason: "content_filter"`) or the model refused (`refusal`).
    #[must_use]
    pub fn is_declined(&self) -> bool {
        self.finish_reason.as_deref() == Some(FINISH_CONTENT_FILTER) || self.message.refusal().is_some()
    }

    /// Whether the choice is an answer: text, a tool call, audio, a decline, or an answer cut
    /// by the caller's token limit (`finish_reason: "length"`), even empty: a reasoning
    /// model (o-series, R1) that spends `max_tokens` thinking answers nothing, and
    /// another source would spend them the same way. The caller gets it as the
    /// provider sent it, as from the provider itself; it is no failure of the source.
    #[must_use]
    pub fn has_output(&self) -> bool {
        self.message.answers() || self.is_declined() || self.finish_reason.as_deref() == Some(FINISH_LENGTH)
    }
}

/// A non-streaming chat completion answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatResponse {
    /// Provider's completion id.
    #[serde(default, deserialize_with = "null_as_default")]
    pub id: String,
    /// `chat.completion`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub object: String,
    /// Unix seconds.
    #[serde(default, deserialize_with = "unix_seconds")]
    pub created: u64,
    /// The model that answered.
    #[serde(default, deserialize_with = "null_as_default")]
    pub model: String,
    /// The answers.
    #[serde(default, deserialize_with = "null_as_default")]
    pub choices: Vec<Choice>,
    /// Token usage, when reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Fields this crate does not interpret (`system_fingerprint`, `service_tier`, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ChatResponse {
    /// The first choice's string content, or `""`.
    #[must_use]
    pub fn content(&self) -> &str {
        self.choices.first().map_or("", |c| c.message.text())
    }

    /// True when no choice is an answer (no text, no tool call, no decline, none cut
    /// by the token limit: [`Choice::has_output`]): the "200 with an empty completion"
    /// failure, measured at 14-17% of the answers of a healthy production source.
    #[must_use]
    pub fn is_empty_completion(&self) -> bool {
        !self.choices.iter().any(Choice::has_output)
    }

    /// True when the provider declined (content filter or refusal) and gave no other
    /// answer: a final answer for the caller, not a failure of the source.
    #[must_use]
    pub fn is_declined(&self) -> bool {
        self.choices.iter().any(Choice::is_declined) && !self.choices.iter().any(|c| c.message.answers())
    }
}

/// The incremental part of a streamed choice.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    /// Set on the first chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The next piece of text. A provider that streams it as an array of content parts
    /// (Mistral's reasoning models) is read as the concatenation of its text parts
    /// (the chunk's [`raw`](ChatChunk::raw) keeps the parts as sent).
    #[serde(
        default,
        deserialize_with = "delta_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub content: Option<String>,
    /// Fields this crate does not interpret as text: `tool_calls` (merged by
    /// [`ChunkAccumulator`]), `refusal` (concatenated), provider extensions.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A delta's `content`: a string, `null`, or content parts read as their text.
fn delta_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match Content::deserialize(d)? {
        Content::Null => None,
        Content::Text(s) => Some(s),
        Content::Parts(parts) => Some(parts.iter().filter_map(ContentPart::text).collect()),
    })
}

impl Delta {
    /// Whether this piece carries output: text, or any other non-null field such as a
    /// tool call or a refusal. A role-only delta does not (watchdogs wait for real
    /// output).
    #[must_use]
    pub fn carries_output(&self) -> bool {
        self.content.as_deref().is_some_and(|t| !t.is_empty())
            || self.extra.values().any(|v| match v {
                Value::Null => false,
                Value::String(s) => !s.is_empty(),
                // OpenRouter's `"reasoning_details": []` on every chunk is not output.
                Value::Array(a) => !a.is_empty(),
                Value::Object(o) => !o.is_empty(),
                Value::Bool(_) | Value::Number(_) => true,
            })
    }
}

/// One choice of a streamed chunk.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChunkChoice {
    /// Index of the choice.
    #[serde(default, deserialize_with = "null_as_default")]
    pub index: u32,
    /// What this chunk adds.
    #[serde(default, deserialize_with = "null_as_default")]
    pub delta: Delta,
    /// Set on the last chunk of the choice.
    #[serde(default)]
    pub finish_reason: Option<String>,
    /// Fields this crate does not interpret (`logprobs`, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// One server-sent event of a streamed answer (`chat.completion.chunk`).
///
/// Two chunks are equal when their values are: [`ChatChunk::raw`], how one of them
/// was written, is not compared.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ChatChunk {
    /// Provider's completion id (the same on every chunk).
    #[serde(default, deserialize_with = "null_as_default")]
    pub id: String,
    /// `chat.completion.chunk`.
    #[serde(default, deserialize_with = "null_as_default")]
    pub object: String,
    /// Unix seconds.
    #[serde(default, deserialize_with = "unix_seconds")]
    pub created: u64,
    /// The model that answers.
    #[serde(default, deserialize_with = "null_as_default")]
    pub model: String,
    /// The pieces.
    #[serde(default, deserialize_with = "null_as_default")]
    pub choices: Vec<ChunkChoice>,
    /// Usage, on the final chunk when the provider reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Fields this crate does not interpret (`system_fingerprint`, `service_tier`, ...).
    #[serde(flatten)]
    pub extra: Map<String, Value>,
    /// The provider's `data:` payload exactly as it arrived, when the other fields are
    /// that payload parsed and left unchanged; `None` for a chunk built or changed here.
    /// A server can send it as is: byte for byte what the provider wrote (the fields
    /// this type fills with defaults stay absent, a `"usage": null` stays), and no
    /// second serialization. Whoever changes a field clears it. Never serialized.
    #[serde(skip)]
    pub raw: Option<bytes::Bytes>,
}

impl PartialEq for ChatChunk {
    fn eq(&self, other: &Self) -> bool {
        let Self {
            id,
            object,
            created,
            model,
            choices,
            usage,
            extra,
            raw: _,
        } = self;
        *id == other.id
            && *object == other.object
            && *created == other.created
            && *model == other.model
            && *choices == other.choices
            && *usage == other.usage
            && *extra == other.extra
    }
}

/// Folds streamed chunks into the equivalent non-streaming answer.
///
/// Text pieces are appended to `content` (which stays `null` when no text arrived, as
/// in the non-streamed answer of a refusal or a filtered prompt); string pieces of
/// other delta fields (`refusal`, `reasoning_content`) are appended to the message's
/// field of that name; tool-call fragments are merged by index; `logprobs.content`
/// entries are appended; any other field keeps its last non-null value.
#[derive(Debug, Default)]
pub struct ChunkAccumulator {
    resp: ChatResponse,
    /// Tool-call slots made so far, over every choice (at most [`MAX_STREAMED_INDEX`]).
    tool_slots: usize,
    /// Where a provider's tool-call index goes when it reused an index for a new call
    /// (a fragment with a different `id`): `(choice, index, slot)`.
    moved: Vec<(usize, usize, usize)>,
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
        set_non_null(&mut self.resp.extra, &chunk.extra);
        for c in &chunk.choices {
            let idx = c.index as usize;
            // A garbage index must not make us allocate without bound.
            if idx > MAX_STREAMED_INDEX {
                continue;
            }
            while self.resp.choices.len() <= idx {
                let index = u32::try_from(self.resp.choices.len()).unwrap_or(u32::MAX);
                let message = ChatMessage {
                    role: "assistant".into(),
                    ..ChatMessage::default()
                };
                self.resp.choices.push(Choice::new(index, message, None));
            }
            let choice = &mut self.resp.choices[idx];
            if let Some(role) = &c.delta.role {
                choice.message.role.clone_from(role);
            }
            if let Some(text) = c.delta.content.as_deref().filter(|t| !t.is_empty()) {
                match &mut choice.message.content {
                    Content::Text(s) => s.push_str(text),
                    other => *other = Content::Text(text.to_owned()),
                }
            }
            for (key, value) in &c.delta.extra {
                match (key.as_str(), value) {
                    (_, Value::Null) => {}
                    ("tool_calls", Value::Array(calls)) => merge_tool_calls(
                        &mut choice.message.extra,
                        calls,
                        idx,
                        &mut self.tool_slots,
                        &mut self.moved,
                    ),
                    (_, Value::String(piece)) => append_piece(&mut choice.message.extra, key, piece),
                    _ => {
                        choice.message.extra.insert(key.clone(), value.clone());
                    }
                }
            }
            for (key, value) in &c.extra {
                match (key.as_str(), value) {
                    (_, Value::Null) => {}
                    ("logprobs", Value::Object(lp)) => merge_logprobs(&mut choice.extra, lp),
                    _ => {
                        choice.extra.insert(key.clone(), value.clone());
                    }
                }
            }
            if c.finish_reason.is_some() {
                choice.finish_reason.clone_from(&c.finish_reason);
            }
        }
        if chunk.usage.is_some() {
            self.resp.usage.clone_from(&chunk.usage);
        }
    }

    /// The answer so far.
    #[must_use]
    pub fn finish(self) -> ChatResponse {
        self.resp
    }

    /// The answer so far, still accumulating.
    #[must_use]
    pub const fn so_far(&self) -> &ChatResponse {
        &self.resp
    }
}

/// The largest choice or tool-call index a stream may name: 1024. A chunk naming a
/// larger one is malformed (a slot per index up to it would be kept).
pub const MAX_STREAMED_INDEX: usize = 1024;

fn set_non_null(into: &mut Map<String, Value>, from: &Map<String, Value>) {
    for (k, v) in from {
        if !v.is_null() {
            into.insert(k.clone(), v.clone());
        }
    }
}

fn append_piece(extra: &mut Map<String, Value>, key: &str, piece: &str) {
    match extra.get_mut(key) {
        Some(Value::String(s)) => s.push_str(piece),
        _ => {
            extra.insert(key.to_owned(), Value::String(piece.to_owned()));
        }
    }
}

/// Appends streamed `logprobs` (`{"content":[..],"refusal":[..]}`) to the choice's.
fn merge_logprobs(choice_extra: &mut Map<String, Value>, piece: &Map<String, Value>) {
    let slot = choice_extra
        .entry("logprobs")
        .or_insert_with(|| Value::Object(Map::new()));
    if !slot.is_object() {
        *slot = Value::Object(Map::new());
    }
    let Value::Object(target) = slot else { return };
    for (k, v) in piece {
        match (target.get_mut(k), v) {
            (_, Value::Null) => {}
            (Some(Value::Array(have)), Value::Array(more)) => have.extend(more.iter().cloned()),
            _ => {
                target.insert(k.clone(), v.clone());
            }
        }
    }
}

/// Merges streamed tool-call fragments (OpenAI: each carries an `index`; `id`, `type`
/// and `function.name` arrive once, `function.arguments` in pieces) of choice `choice`
/// into the message's `tool_calls` array.
///
/// A fragment whose `id` differs from the one its index already holds starts a new
/// call (Ollama sends every call of a parallel batch whole, each with index 0; Mistral
/// sends none, read as the position in the chunk): its index's later fragments go to
/// that call. At most [`MAX_STREAMED_INDEX`] calls are made over the whole answer,
/// whatever the indices (a placeholder per index below a garbage one, per choice,
/// would otherwise grow without bound).
fn merge_tool_calls(
    message_extra: &mut Map<String, Value>,
    fragments: &[Value],
    choice: usize,
    slots: &mut usize,
    moved: &mut Vec<(usize, usize, usize)>,
) {
    let calls = message_extra
        .entry("tool_calls")
        .or_insert_with(|| Value::Array(Vec::new()));
    let Value::Array(calls) = calls else { return };
    for (n, fragment) in fragments.iter().enumerate() {
        let Value::Object(fragment) = fragment else {
            continue;
        };
        let given = fragment
            .get("index")
            .and_then(Value::as_u64)
            .and_then(|i| usize::try_from(i).ok())
            .unwrap_or(n);
        if given > MAX_STREAMED_INDEX {
            continue;
        }
        let mut index = moved
            .iter()
            .rev()
            .find(|(c, i, _)| *c == choice && *i == given)
            .map_or(given, |(_, _, slot)| *slot);
        let id = fragment
            .get("id")
            .and_then(Value::as_str)
            .filter(|id| !id.is_empty());
        let held = calls.get(index).and_then(|c| c.get("id")).and_then(Value::as_str);
        if let (Some(id), Some(held)) = (id, held)
            && id != held
        {
            // A new call under a used index.
            index = calls.len();
            moved.push((choice, given, index));
        }
        let grow = (index + 1).saturating_sub(calls.len());
        if *slots + grow > MAX_STREAMED_INDEX {
            continue;
        }
        *slots += grow;
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

/// The chunks equivalent to a non-streamed answer, for replaying it to a streaming
/// caller: one chunk per choice with the whole message, then a usage chunk.
/// [`ChunkAccumulator`] folds them back into `r` (string content, `null` content,
/// refusals, tool calls, logprobs and the untyped fields at every level).
#[must_use]
pub fn chunks_of(r: &ChatResponse) -> Vec<ChatChunk> {
    let base = |choices: Vec<ChunkChoice>| ChatChunk {
        id: r.id.clone(),
        object: "chat.completion.chunk".into(),
        created: r.created,
        model: r.model.clone(),
        choices,
        usage: None,
        extra: r.extra.clone(),
        raw: None,
    };
    let mut out: Vec<ChatChunk> = r
        .choices
        .iter()
        .map(|c| {
            let mut extra = c.message.extra.clone();
            if let Some(Value::Array(calls)) = extra.get_mut("tool_calls") {
                for (i, call) in calls.iter_mut().enumerate() {
                    if let Value::Object(o) = call {
                        o.insert("index".into(), i.into());
                    }
                }
            }
            base(vec![ChunkChoice {
                index: c.index,
                delta: Delta {
                    role: Some(c.message.role.clone()),
                    // A delta carries a string: an answer in parts (Mistral's
                    // reasoning models answer `[{"type":"text","text":...}]`) is
                    // replayed as the text of its text parts, not as no text.
                    content: match &c.message.content {
                        Content::Parts(parts) => Some(parts.iter().filter_map(ContentPart::text).collect()),
                        other => other.as_text().map(str::to_owned),
                    },
                    extra,
                },
                finish_reason: c.finish_reason.clone(),
                extra: c.extra.clone(),
            }])
        })
        .collect();
    if r.usage.is_some() {
        let mut u = base(Vec::new());
        u.usage.clone_from(&r.usage);
        out.push(u);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Empty extension fields on every chunk (OpenRouter's `reasoning_details: []`)
    /// are not output: the first-token watchdog still waits for real output.
    #[test]
    fn empty_extension_fields_are_not_output() {
        let delta = |json: &str| serde_json::from_str::<Delta>(json).unwrap().carries_output();
        assert!(!delta(r#"{"role":"assistant","reasoning_details":[]}"#));
        assert!(!delta(r#"{"reasoning_details":{},"refusal":null,"content":""}"#));
        assert!(delta(
            r#"{"reasoning_details":[{"type":"reasoning.text","text":"hm"}]}"#
        ));
        assert!(delta(r#"{"refusal":"no"}"#));
    }

    /// Usage counts written as `null`, floats or negative numbers are read, not
    /// refused (the answer around them was lost: "body is not a chat completion");
    /// `"stream": null` is a request that does not stream.
    #[test]
    fn odd_usage_counts_and_a_null_stream_are_read() {
        let body = r#"{"id":"c","object":"chat.completion","created":1,"model":"m",
            "choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],
            "usage":{"prompt_tokens":5,"completion_tokens":null,"total_tokens":7.0}}"#;
        let r: ChatResponse = serde_json::from_str(body).unwrap();
        let u = r.usage.unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens, u.total_tokens), (5, 0, 7));
        let u: Usage = serde_json::from_str(r#"{"prompt_tokens":-3,"completion_tokens":1e30}"#).unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (0, u64::MAX));
        let req: ChatRequest = serde_json::from_str(r#"{"model":"m","messages":[],"stream":null}"#).unwrap();
        assert!(!req.stream);
    }

    /// An audio answer (`modalities: ["text", "audio"]`) has `content: null` and its
    /// transcript inside `audio`: an answer, not an empty completion.
    #[test]
    fn an_audio_answer_is_an_answer() {
        let audio = r#""audio":{"id":"audio_1","data":"UklG","expires_at":1,"transcript":"hi"}"#;
        let body = format!(
            r#"{{"id":"c","object":"chat.completion","created":1,"model":"m","choices":[{{"index":0,
            "message":{{"role":"assistant","content":null,{audio}}},"finish_reason":"stop"}}]}}"#
        );
        let r: ChatResponse = serde_json::from_str(&body).unwrap();
        assert!(!r.is_empty_completion());
        let r: ChatResponse = serde_json::from_str(&body.replace(audio, r#""audio":null"#)).unwrap();
        assert!(r.is_empty_completion());
    }

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
            0,
            &mut 0,
            &mut Vec::new(),
        );
        assert_eq!(extra["tool_calls"], serde_json::json!([]));
    }

    fn accumulate(frames: &[String]) -> ChatResponse {
        let mut acc = ChunkAccumulator::default();
        for f in frames {
            acc.push(&serde_json::from_str::<ChatChunk>(f).unwrap());
        }
        acc.finish()
    }

    /// The tool-call index limit holds over the whole answer: 1,025 choices each naming
    /// tool call 1024 made a placeholder per index per choice (1.5 GiB from 68 KB).
    #[test]
    fn tool_call_placeholders_are_bounded_over_every_choice() {
        let frames: Vec<String> = (0..=1024)
            .map(|i| {
                format!(r#"{{"choices":[{{"index":{i},"delta":{{"tool_calls":[{{"index":1024}}]}}}}]}}"#)
            })
            .collect();
        let resp = accumulate(&frames);
        let calls: usize = resp
            .choices
            .iter()
            .filter_map(|c| c.message.extra.get("tool_calls").and_then(Value::as_array))
            .map(Vec::len)
            .sum();
        assert!(calls <= MAX_STREAMED_INDEX + 1, "{calls} tool-call slots");
    }

    /// Parallel calls sent whole under one index (Ollama: index 0 each; Mistral: no
    /// index, each in its own chunk) stay apart; OpenAI's fragments (the id once, then
    /// argument pieces without one) still merge.
    #[test]
    fn whole_tool_calls_under_one_index_stay_apart() {
        let call = |index: &str, id: &str, path: &str| {
            format!(
                r#"{{"choices":[{{"index":0,"delta":{{"tool_calls":[{{{index}"id":"{id}","type":"function","function":{{"name":"read","arguments":"{{\"path\":\"{path}\"}}"}}}}]}}}}]}}"#
            )
        };
        for index in [r#""index":0,"#, ""] {
            let frames = [
                call(index, "call_a", "a"),
                call(index, "call_b", "b"),
                format!(
                    r#"{{"choices":[{{"index":0,"delta":{{"tool_calls":[{{{index}"function":{{"arguments":" "}}}}]}}}}]}}"#
                ),
            ];
            let resp = accumulate(&frames);
            let calls = resp.choices[0].message.extra["tool_calls"].as_array().unwrap();
            assert_eq!(calls.len(), 2, "{index}: {calls:?}");
            assert_eq!(calls[0]["id"], "call_a");
            assert_eq!(calls[0]["function"]["arguments"], r#"{"path":"a"}"#);
            assert_eq!(calls[1]["id"], "call_b");
            assert_eq!(calls[1]["function"]["name"], "read");
            // A later piece of the reused index goes to the newest call.
            assert_eq!(calls[1]["function"]["arguments"], r#"{"path":"b"} "#);
        }
    }

    /// A delta's content as content parts (Mistral's reasoning models) is its text,
    /// not an unreadable chunk.
    #[test]
    fn delta_content_parts_read_as_their_text() {
        let d: Delta = serde_json::from_str(
            r#"{"content":[{"type":"thinking","thinking":[{"type":"text","text":"hm"}]},{"type":"text","text":"Hel"},{"type":"text","text":"lo"}]}"#,
        )
        .unwrap();
        assert_eq!(d.content.as_deref(), Some("Hello"));
        assert!(d.carries_output());
        let d: Delta = serde_json::from_str(r#"{"content":null}"#).unwrap();
        assert_eq!(d.content, None);
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
                    ..ChunkChoice::default()
                }],
                ..ChatChunk::default()
            });
        }
        let r = acc.finish();
        assert_eq!(r.content(), "Hello");
        assert_eq!(r.id, "c");
    }

    /// A response with every field OpenAI sends that pgw does not type.
    const ECHOED: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":7,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"hi","refusal":null,"annotations":[]},"logprobs":{"content":[{"token":"hi","logprob":-0.25,"bytes":[104,105],"top_logprobs":[]}],"refusal":null},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,"prompt_tokens_details":{"cached_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"accepted_prediction_tokens":0}},"system_fingerprint":"fp_1","service_tier":"default","x_provider":{"a":1}}"#;

    #[test]
    fn an_answer_in_parts_replays_its_text() {
        let r: ChatResponse = serde_json::from_str(
            r#"{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":[{"type":"thinking","thinking":[{"type":"text","text":"hmm"}]},{"type":"text","text":"Hello "},{"type":"text","text":"world"}]},"finish_reason":"stop"}]}"#,
        )
        .unwrap();
        let chunks = chunks_of(&r);
        assert_eq!(chunks[0].choices[0].delta.content.as_deref(), Some("Hello world"));
        let mut acc = ChunkAccumulator::default();
        for c in &chunks {
            acc.push(c);
        }
        assert_eq!(acc.finish().content(), "Hello world");
    }

    #[test]
    fn untyped_response_fields_survive_the_trip() {
        let r: ChatResponse = serde_json::from_str(ECHOED).unwrap();
        assert_eq!(r.extra["system_fingerprint"], "fp_1");
        assert_eq!(
            r.usage.as_ref().unwrap().extra["completion_tokens_details"]["reasoning_tokens"],
            0
        );
        assert_eq!(r.choices[0].extra["logprobs"]["content"][0]["token"], "hi");
        let back = serde_json::to_value(&r).unwrap();
        let want: Value = serde_json::from_str(ECHOED).unwrap();
        assert_eq!(back, want);
        // Streamed, the same fields arrive on chunks and fold into the same answer.
        let mut acc = ChunkAccumulator::default();
        for c in chunks_of(&r) {
            let wire = serde_json::to_string(&c).unwrap();
            assert!(wire.contains("fp_1"), "{wire}");
            acc.push(&serde_json::from_str(&wire).unwrap());
        }
        let mut folded = serde_json::to_value(acc.finish()).unwrap();
        // Null pieces are "nothing" in a stream: a `null` untyped field is not replayed.
        let mut want = want;
        want["choices"][0]["message"]
            .as_object_mut()
            .unwrap()
            .remove("refusal");
        want["choices"][0]["logprobs"]
            .as_object_mut()
            .unwrap()
            .remove("refusal");
        folded["choices"][0]["message"]
            .as_object_mut()
            .unwrap()
            .remove("refusal");
        assert_eq!(folded, want);
    }

    #[test]
    fn content_is_kept_as_sent() {
        for json in [
            r#"{"role":"user","content":"hi"}"#,
            // Untyped fields keep their values (serde_json writes their keys sorted).
            r#"{"role":"assistant","content":null,"tool_calls":[{"function":{"arguments":"{}","name":"f"},"id":"c","type":"function"}]}"#,
            r#"{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA","detail":"high"}},{"type":"input_audio","input_audio":{"format":"wav","data":"UklG"}}]}"#,
            r#"{"role":"user","content":[]}"#,
        ] {
            let m: ChatMessage = serde_json::from_str(json).unwrap();
            assert_eq!(serde_json::to_string(&m).unwrap(), json);
        }
        // Absent reads as null; numbers and other types are refused.
        let m: ChatMessage = serde_json::from_str(r#"{"role":"assistant"}"#).unwrap();
        assert!(m.content.is_null());
        assert!(serde_json::from_str::<ChatMessage>(r#"{"role":"user","content":3}"#).is_err());
        // A request with parts keeps them for the upstream.
        let req: ChatRequest = serde_json::from_str(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"abcdef"},{"type":"image_url","image_url":{"url":"u"}}]}]}"#,
        )
        .unwrap();
        assert_eq!(req.prompt_bytes(), 6);
        assert_eq!(req.image_parts(), 1);
        assert_eq!(
            req.estimate_tokens(),
            2 + IMAGE_PART_TOKENS_ESTIMATE + DEFAULT_MAX_TOKENS_ESTIMATE
        );
    }

    #[test]
    fn completion_budget_reads_both_spellings_and_saturates() {
        let mut req = ChatRequest::user("m", "x".repeat(30));
        req.extra.insert("max_completion_tokens".into(), 200.into());
        assert_eq!(req.estimate_tokens(), 10 + 200);
        req.max_tokens = Some(50);
        assert_eq!(req.completion_budget(), 200, "the larger of the two");
        let huge: ChatRequest = serde_json::from_str(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":18446744073709551615}"#,
        )
        .unwrap();
        assert_eq!(huge.estimate_tokens(), u64::MAX);
    }

    #[test]
    fn declines_are_answers_not_empty_completions() {
        let filtered = r#"{"choices":[{"index":0,"message":{"role":"assistant","content":null},"finish_reason":"content_filter"}]}"#;
        let refused = r#"{"choices":[{"index":0,"message":{"role":"assistant","content":null,"refusal":"I can't help with that."},"finish_reason":"stop"}]}"#;
        let empty = r#"{"choices":[{"index":0,"message":{"role":"assistant","content":null,"refusal":null},"finish_reason":"stop"}]}"#;
        for (json, declined) in [(filtered, true), (refused, true), (empty, false)] {
            let r: ChatResponse = serde_json::from_str(json).unwrap();
            assert_eq!(r.is_declined(), declined, "{json}");
            assert_eq!(r.is_empty_completion(), !declined, "{json}");
            let back = serde_json::to_value(&r).unwrap();
            assert_eq!(
                back["choices"],
                serde_json::from_str::<Value>(json).unwrap()["choices"]
            );
        }
        // Streamed: a role chunk with "" content, refusal pieces, a finish chunk.
        let frames = [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"refusal":"I can't "}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"refusal":"help."}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
        ];
        let mut acc = ChunkAccumulator::default();
        for f in frames {
            acc.push(&serde_json::from_str(f).unwrap());
        }
        let r = acc.finish();
        assert!(
            r.choices[0].message.content.is_null(),
            "no text arrived: content stays null"
        );
        assert_eq!(r.choices[0].message.refusal(), Some("I can't help."));
        assert!(r.is_declined() && !r.is_empty_completion());
        let mut acc = ChunkAccumulator::default();
        for f in [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"content_filter"}]}"#,
        ] {
            acc.push(&serde_json::from_str(f).unwrap());
        }
        assert!(acc.finish().is_declined());
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        fn json_leaf() -> impl Strategy<Value = Value> {
            prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::from),
                any::<i64>().prop_map(Value::from),
                any::<u64>().prop_map(Value::from),
                "[a-z ]{0,8}".prop_map(Value::from),
            ]
        }

        /// JSON text of an object with keys in an arbitrary (not sorted) order.
        fn json_text() -> impl Strategy<Value = String> {
            let leaf = json_leaf().prop_map(|v| v.to_string());
            leaf.prop_recursive(3, 24, 4, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
                    prop::collection::vec(("[a-z]{1,6}", inner), 0..4).prop_map(|kv| {
                        let fields: Vec<String> = kv.iter().map(|(k, v)| format!("{k:?}:{v}")).collect();
                        format!("{{{}}}", fields.join(","))
                    }),
                ]
            })
        }

        fn content_text() -> impl Strategy<Value = String> {
            prop_oneof![
                Just("null".to_owned()),
                any::<String>().prop_map(|s| serde_json::to_string(&s).unwrap()),
                prop::collection::vec(
                    prop_oneof![
                        "[a-z ]{0,10}".prop_map(|t| format!(r#"{{"type":"text","text":{t:?}}}"#)),
                        json_text().prop_map(|u| format!(
                            r#"{{"type":"image_url","image_url":{{"url":"u","z":{u}}}}}"#
                        )),
                        json_text(),
                    ],
                    0..4
                )
                .prop_map(|p| format!("[{}]", p.join(","))),
            ]
        }

        proptest! {
            /// A message's content survives a round trip byte for byte.
            #[test]
            fn messages_round_trip(content in content_text(), role in "[a-z]{1,9}") {
                let json = format!(r#"{{"role":"{role}","content":{content}}}"#);
                let m: ChatMessage = serde_json::from_str(&json).unwrap();
                prop_assert_eq!(serde_json::to_string(&m).unwrap(), json);
                // And inside a request (whose flattened extras buffer the fields).
                let req = format!(r#"{{"model":"m","messages":[{}],"temperature":0.5}}"#, serde_json::to_string(&m).unwrap());
                let r: ChatRequest = serde_json::from_str(&req).unwrap();
                prop_assert_eq!(&r.messages[0], &m);
            }

            /// The estimate never panics and never wraps, whatever the numbers.
            #[test]
            fn estimate_never_panics(
                max_tokens in proptest::option::of(any::<u64>()),
                max_completion in proptest::option::of(any::<u64>()),
                text in "[a-z]{0,64}",
                images in 0_usize..5,
            ) {
                let mut parts = vec![ContentPart::new_text(text.clone())];
                parts.extend((0..images).map(|_| ContentPart::from(serde_json::json!({"type":"image_url","image_url":{"url":"u"}}))));
                let mut req = ChatRequest::user("m", "");
                req.messages.push(ChatMessage { role: "user".into(), content: Content::Parts(parts), extra: Map::new() });
                req.max_tokens = max_tokens;
                if let Some(n) = max_completion {
                    req.extra.insert("max_completion_tokens".into(), n.into());
                }
                let est = req.estimate_tokens();
                let budget = max_tokens.unwrap_or(0).max(max_completion.unwrap_or(0));
                prop_assert!(est >= budget);
                prop_assert!(est >= images as u64 * IMAGE_PART_TOKENS_ESTIMATE);
                if max_tokens.is_none() && max_completion.is_none() {
                    prop_assert!(est >= DEFAULT_MAX_TOKENS_ESTIMATE);
                }
            }
        }
    }
}
