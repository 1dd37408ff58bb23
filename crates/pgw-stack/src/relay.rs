//! [`ChatStream`]: a streamed call as the caller sees it. The chunks of the committed
//! attempt as they arrive; when that attempt is cut after the caller saw its first
//! chunk, the continuation on a source that accepts an assistant prefill, or the cut's
//! error.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_core::Stream;
use futures_util::StreamExt;
use pgw_client::{ChatCall, PassThrough, TailStream};
use pgw_core::openai::{ChatChunk, ChatMessage, ChatRequest, Content, ContentPart, Usage};
use pgw_core::{BoxError, CallHistory, CarriesHistory, SourceId};
use tower::ServiceExt;
use tower_retry_pushback::{CallDeadline, RetryError};

use crate::attempt::Continuation;
use crate::gateway::DefaultDeadline;
use crate::{Gateway, GatewayAnswer};

/// How many times one streamed call is continued after a cut: as many as a call has
/// attempts by default (`tower_retry_pushback::RetryConfig::max_attempts`, 3), minus
/// the one that was cut.
pub(crate) const MAX_CONTINUATIONS: u32 = 2;

/// The chunks of one streamed call ([`Gateway::chat_stream`]), each as soon as it
/// arrived from the provider.
///
/// The call was committed to a source when that source's first chunk with output
/// arrived; failures before it (an error event in a 200, a silent source, a 429) were
/// retried on other sources without the caller seeing anything of them. After it:
///
/// - the stream ends (`None`) only after a chunk with a `finish_reason` (a stream
///   that stopped without one is a cut, never a clean end on a truncated answer);
/// - a cut (a watchdog, a reset, an error event) is continued on another admitted
///   source whose configuration says it accepts an assistant prefill
///   (`accepts_prefill`): the request is re-sent with the text so far as a trailing
///   assistant message and only the continuation is streamed on;
/// - with no such source, or when the continuation fails too, the stream yields the
///   original cut's error and ends. A proxy sends it as an error event, without
///   `[DONE]`.
///
/// The usage chunk (`choices: []` with `usage`) reaches the caller only when the
/// request asked for it (`stream_options.include_usage`); upstream it is always asked,
/// so the quota settles to real usage.
///
/// Dropping the stream cancels the upstream request and releases every slot, lease
/// and probe the attempt held.
pub struct ChatStream {
    call_id: u64,
    group: String,
    source: Option<SourceId>,
    cache_hit: bool,
    /// The last usage a provider reported in this stream, whether the caller gets the
    /// usage chunk or not.
    usage: Arc<std::sync::Mutex<Option<Usage>>>,
    inner: Pin<Box<dyn Stream<Item = Result<ChatChunk, BoxError>> + Send>>,
}

impl fmt::Debug for ChatStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatStream")
            .field("call_id", &self.call_id)
            .field("group", &self.group)
            .field("source", &self.source)
            .field("cache_hit", &self.cache_hit)
            .finish_non_exhaustive()
    }
}

impl ChatStream {
    /// The call.
    #[must_use]
    pub const fn call_id(&self) -> u64 {
        self.call_id
    }

    /// The model group the stream was committed to.
    #[must_use]
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The source the stream was committed to (a continuation may finish it elsewhere).
    #[must_use]
    pub const fn source(&self) -> Option<&SourceId> {
        self.source.as_ref()
    }

    /// The token usage the provider reported in the chunks streamed so far (the last
    /// one, for a stream continued on another source: the continuation's), also when
    /// the request did not ask for the usage chunk (it is always asked upstream). At
    /// the stream's end: what the call used, for a quota to settle.
    #[must_use]
    pub fn usage(&self) -> Option<Usage> {
        pgw_core::sync::lock(&self.usage).clone()
    }

    /// Whether the answer is a replay from the cache.
    #[must_use]
    pub const fn cache_hit(&self) -> bool {
        self.cache_hit
    }

    /// A stream replaying a complete answer (a cache hit, a buffered call).
    pub(crate) fn replay(answer: &GatewayAnswer, include_usage: bool) -> Self {
        let head = Head::of(answer);
        let usage = Arc::new(std::sync::Mutex::new(answer.answer.response.usage.clone()));
        let chunks = answer
            .chunks()
            .into_iter()
            .filter_map(move |c| for_caller(c, include_usage, false));
        head.with(usage, futures_util::stream::iter(chunks.map(Ok)))
    }

    /// The committed answer of `call`, then its tail, continued after a cut.
    pub(crate) fn relay(
        gateway: Gateway,
        call: ChatCall,
        mut answer: GatewayAnswer,
        include_usage: bool,
    ) -> Self {
        let head = Head::of(&answer);
        let tail = answer.answer.tail.take().and_then(|t| t.take());
        // The provider's chunks are moved, not cloned: the answer ends here.
        let queue = if answer.answer.chunks.is_empty() {
            answer.chunks()
        } else {
            std::mem::take(&mut answer.answer.chunks)
        };
        let usage = Arc::new(std::sync::Mutex::new(None));
        // `n > 1` asks for several choices from the start.
        let text_only = call
            .request()
            .extra
            .get("n")
            .and_then(serde_json::Value::as_u64)
            .is_none_or(|n| n <= 1);
        let continues_prefill = head
            .source
            .as_ref()
            .is_some_and(|s| gateway.inner.prefill_routes.contains(s));
        let relay = Relay {
            continues_prefill,
            usage: Arc::clone(&usage),
            gateway,
            call,
            queue: queue.into(),
            tail,
            text: String::new(),
            text_chunks: 0,
            include_usage,
            continued: 0,
            ended: false,
            text_only,
            deadline: None,
        };
        // Boxed: `unfold` moves its state into each step's future and back out, and a
        // `Relay` (the call, the tail stream, the gateway) is large enough for those
        // copies to show in a profile (93 `memcpy` calls for a five-chunk answer).
        head.with(usage, futures_util::stream::unfold(Box::new(relay), Relay::step))
    }
}

impl Stream for ChatStream {
    type Item = Result<ChatChunk, BoxError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

/// Who answered, kept apart from the answer that moves into the stream.
struct Head {
    call_id: u64,
    group: String,
    source: Option<SourceId>,
    cache_hit: bool,
}

impl Head {
    fn of(a: &GatewayAnswer) -> Self {
        Self {
            call_id: a.call_id,
            group: a.group.clone(),
            source: a.source.clone(),
            cache_hit: a.cache_hit,
        }
    }

    fn with(
        self,
        usage: Arc<std::sync::Mutex<Option<Usage>>>,
        s: impl Stream<Item = Result<ChatChunk, BoxError>> + Send + 'static,
    ) -> ChatStream {
        ChatStream {
            call_id: self.call_id,
            group: self.group,
            source: self.source,
            cache_hit: self.cache_hit,
            usage,
            inner: Box::pin(s),
        }
    }
}

/// A chunk as the caller gets it: the usage chunk only when asked; a continuation's
/// chunks without the role its provider restates. A chunk this changes loses its
/// provider's payload ([`ChatChunk::raw`]), so it is serialized again; one it leaves
/// as it was (the usual case) keeps it.
fn for_caller(mut c: ChatChunk, include_usage: bool, continued: bool) -> Option<ChatChunk> {
    if !include_usage && c.usage.is_some() {
        if c.choices.is_empty() {
            return None;
        }
        c.usage = None;
        c.raw = None;
    }
    if continued {
        for choice in &mut c.choices {
            if choice.delta.role.take().is_some() {
                c.raw = None;
            }
        }
    }
    Some(c)
}

struct Relay {
    gateway: Gateway,
    call: ChatCall,
    queue: VecDeque<ChatChunk>,
    tail: Option<TailStream>,
    /// The first choice's text the caller received: the prefix of a continuation.
    text: String,
    /// The chunks of [`text`](Self::text) that carried some: the tokens the caller
    /// received, for the continuation's `max_tokens`.
    text_chunks: u64,
    /// [`ChatStream::usage`].
    usage: Arc<std::sync::Mutex<Option<Usage>>>,
    include_usage: bool,
    continued: u32,
    ended: bool,
    /// Everything the caller received is the first choice's text: only then can a cut
    /// be continued from it (a tool call's arguments or a second choice would be sent
    /// twice, as broken JSON or interleaved text).
    text_only: bool,
    /// The source the stream was committed to continues an assistant prefill: the text
    /// relayed goes on from the caller's own prefill, if it sent one (a source that
    /// does not answers it with a turn of its own).
    continues_prefill: bool,
    /// The caller's deadline ([`CallDeadline`]) as one timer for the whole stream,
    /// armed when the tail is first read (not a timer per chunk).
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Relay {
    async fn step(mut self: Box<Self>) -> Option<(Result<ChatChunk, BoxError>, Box<Self>)> {
        loop {
            if self.ended {
                return None;
            }
            if let Some(c) = self.queue.pop_front() {
                if let Some(u) = &c.usage {
                    *pgw_core::sync::lock(&self.usage) = Some(u.clone());
                }
                if let Some(c) = for_caller(c, self.include_usage, self.continued > 0) {
                    if let Some(t) = c.choices.first().and_then(|ch| ch.delta.content.as_deref())
                        && !t.is_empty()
                    {
                        self.text.push_str(t);
                        self.text_chunks += 1;
                    }
                    // A prefill continues one choice's text: not a tool call's
                    // arguments (`tool_calls`, the legacy `function_call`), a refusal,
                    // reasoning (`reasoning_content`, `reasoning`) or anything else a
                    // delta carries beside its text (the prefill holds the text only:
                    // the continuation would start those over), nor several choices.
                    self.text_only &= c.choices.iter().all(|ch| {
                        ch.index == 0
                            && ch
                                .delta
                                .extra
                                .values()
                                .all(|v| v.is_null() || v.as_array().is_some_and(Vec::is_empty))
                    });
                    return Some((Ok(c), self));
                }
                continue;
            }
            self.tail.as_ref()?;
            // The gateway's default deadline bounds the wait for the answer, not a
            // stream in progress.
            if self.deadline.is_none()
                && self.call.extensions().get::<DefaultDeadline>().is_none()
                && let Some(d) = self.call.extensions().get::<CallDeadline>()
            {
                self.deadline = Some(Box::pin(tokio::time::sleep_until(d.0)));
            }
            let Self { tail, deadline, .. } = &mut *self;
            let tail = tail.as_mut()?;
            let next = match deadline {
                // The caller's deadline bounds the stream too, not only the wait for
                // its first output: past it, the stream ends with the call's error
                // (the upstream request is dropped with the tail).
                Some(sleep) => {
                    // The next chunk first: one that is there is not lost to the timer.
                    let polled = std::future::poll_fn(|cx| {
                        if let std::task::Poll::Ready(next) = tail.poll_next_unpin(cx) {
                            return std::task::Poll::Ready(Some(next));
                        }
                        sleep.as_mut().poll(cx).map(|()| None)
                    })
                    .await;
                    let Some(next) = polled else {
                        self.tail = None;
                        self.ended = true;
                        return Some((Err(Box::new(RetryError::deadline_exceeded())), self));
                    };
                    next
                }
                None => tail.next().await,
            };
            match next {
                Some(Ok(c)) => self.queue.push_back(c),
                None => {
                    self.tail = None;
                    return None;
                }
                Some(Err(cut)) => {
                    self.tail = None;
                    match self.continuation(&cut).await {
                        Some(mut answer) => {
                            self.tail = answer.answer.tail.take().and_then(|t| t.take());
                            self.queue.extend(answer.chunks());
                        }
                        None => {
                            self.ended = true;
                            return Some((Err(cut), self));
                        }
                    }
                }
            }
        }
    }

    /// The call continued from the text so far on a source that accepts a prefill;
    /// `None` when there is none or it failed too (the cut's error is the one the
    /// caller gets: a prefill refusal must not hide it).
    async fn continuation(&mut self, cut: &BoxError) -> Option<GatewayAnswer> {
        if self.continued >= MAX_CONTINUATIONS
            || self.gateway.inner.prefill_routes.is_empty()
            || !self.text_only
        {
            return None;
        }
        let mut request = self.call.request().clone();
        // The caller's completion budget counts what it received already: a provider
        // counts `max_tokens` from the end of the prefill.
        if !request.spend_completion_tokens(self.relayed_tokens()) {
            return None;
        }
        self.continued += 1;
        prefill(&mut request, &self.text, self.continues_prefill);
        let mut next = ChatCall::from_arc(Arc::new(request)).with_call_id(self.call.id());
        // Everything the caller's call carries holds for the continuation too: its
        // deadline, its cache choice and partition (a tenant's continuation is read
        // from and stored in its own), the caller's own extensions.
        *next.extensions_mut() = self.call.extensions().clone();
        let history = self.call.call_history().cloned().unwrap_or_else(CallHistory::new);
        if next.extensions_mut().remove::<DefaultDeadline>().is_some() {
            // The default bounds one wait for an answer: the continuation's own, in
            // its history too (where the balancer reads it), not the first's.
            next.extensions_mut().remove::<CallDeadline>();
            history.clear_deadline();
        }
        next.set_call_history(history);
        next.extensions_mut().insert(PassThrough);
        next.extensions_mut().insert(Continuation);
        match self.gateway.clone().oneshot(next).await {
            Ok(answer) => {
                tracing::debug!(call = self.call.id().0, error = %cut, source = ?answer.source, "stream cut, continued");
                Some(answer)
            }
            Err(e) => {
                tracing::debug!(call = self.call.id().0, error = %cut, continuation = %e, "stream cut, not continued");
                None
            }
        }
    }
}

/// Makes `request` end with an assistant message that holds `text` as its last words.
/// When the text went on from the caller's own prefill (`continued`: the source cut
/// continues a prefill; the request ends with an assistant message of text or text
/// parts, `{` to start a JSON answer), that message is extended by it: a second
/// assistant message after it would be closed as a turn of its own by the templates
/// that continue the last message (vLLM's and llama.cpp's `continue_final_message`),
/// and the source would start a new answer. Else (no prefill, or a source that
/// answered it with a turn of its own) a new assistant message of it.
fn prefill(request: &mut ChatRequest, text: &str, continued: bool) {
    if continued
        && let Some(last) = request.messages.last_mut()
        && last.role == "assistant"
        && !last.calls_tool()
    {
        match &mut last.content {
            Content::Text(own) => {
                own.push_str(text);
                return;
            }
            Content::Parts(parts) if parts.iter().all(|p| p.text().is_some()) => {
                parts.push(ContentPart::new_text(text));
                return;
            }
            _ => {}
        }
    }
    request.messages.push(ChatMessage::new("assistant", text));
}

impl Relay {
    /// The completion tokens the caller received, counted low: the chunks with text
    /// or the words, whichever is more. Each is at most the tokens (a chunk holds at
    /// least one, a word one or more): exact where each chunk is a token (OpenAI,
    /// vLLM), under by a word's extra tokens where chunks carry several. A
    /// continuation may so go a little past the caller's limit, but never ends an
    /// answer short of it.
    fn relayed_tokens(&self) -> u64 {
        let words = u64::try_from(self.text.split_whitespace().count()).unwrap_or(u64::MAX);
        self.text_chunks.max(words)
    }
}

#[cfg(test)]
mod tests {
    use pgw_core::openai::{ChunkChoice, Delta, Usage};

    use super::*;

    /// A chunk as the client parses it: its fields and the payload they came from.
    fn parsed(data: &str) -> ChatChunk {
        let mut c: ChatChunk = serde_json::from_str(data).unwrap();
        c.raw = Some(data.to_owned().into());
        c
    }

    fn raw(c: &ChatChunk) -> Option<&[u8]> {
        c.raw.as_deref()
    }

    /// A continuation extends the caller's own prefill (one assistant message ending
    /// with the text relayed), and adds one only when the request has none: a second
    /// assistant message would be a turn of its own to the templates that continue the
    /// last one. A trailing assistant message that calls tools is no prefill.
    #[test]
    fn a_continuation_extends_the_callers_prefill_and_adds_one_only_without() {
        let mut own = ChatRequest::user("m", "a JSON object please");
        own.messages.push(ChatMessage::new("assistant", "{"));
        let mut answered = own.clone();
        prefill(&mut own, "\"a\": 1,", true);
        assert_eq!(own.messages.len(), 2);
        assert_eq!(own.messages[1].role, "assistant");
        assert_eq!(own.messages[1].text(), "{\"a\": 1,");
        // A source that does not continue a prefill answered it with a turn of its own.
        prefill(&mut answered, "Sure.", false);
        assert_eq!(answered.messages.len(), 3);
        assert_eq!(answered.messages[2].text(), "Sure.");

        let mut parts = ChatRequest::user("m", "a JSON object please");
        let mut open = ChatMessage::new("assistant", "");
        open.content = Content::Parts(vec![ContentPart::new_text("{")]);
        parts.messages.push(open);
        prefill(&mut parts, "\"a\": 1,", true);
        assert_eq!(parts.messages.len(), 2, "text parts extended by one more");
        assert_eq!(parts.messages[1].content.text_bytes(), 8);

        let mut none = ChatRequest::user("m", "hi");
        prefill(&mut none, "Hello", true);
        assert_eq!(none.messages.len(), 2);
        assert_eq!(none.messages[1].text(), "Hello");

        let mut tools = ChatRequest::user("m", "hi");
        let mut call = ChatMessage::new("assistant", "");
        call.extra
            .insert("tool_calls".into(), serde_json::json!([{"id": "t"}]));
        tools.messages.push(call);
        prefill(&mut tools, "Hello", true);
        assert_eq!(tools.messages.len(), 3, "a tool call is not extended");
        assert_eq!(tools.messages[2].text(), "Hello");
    }

    #[test]
    fn an_unchanged_chunk_keeps_the_providers_payload_a_changed_one_loses_it() {
        let text = r#"{"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}"#;
        let role = r#"{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        let last = r#"{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
        let usage =
            r#"{"id":"c","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
        for (include_usage, continued) in [(true, false), (false, false), (true, true), (false, true)] {
            let c = for_caller(parsed(text), include_usage, continued).unwrap();
            assert_eq!(raw(&c), Some(text.as_bytes()), "a null usage is no usage");
        }
        // A role restated by a continuation is dropped: the chunk is no longer the
        // provider's.
        let c = for_caller(parsed(role), true, false).unwrap();
        assert_eq!(raw(&c), Some(role.as_bytes()));
        let c = for_caller(parsed(role), true, true).unwrap();
        assert_eq!((c.choices[0].delta.role.as_deref(), raw(&c)), (None, None));
        // Usage the caller did not ask for is taken off the chunk that carries it.
        let c = for_caller(parsed(last), true, false).unwrap();
        assert_eq!(raw(&c), Some(last.as_bytes()));
        let c = for_caller(parsed(last), false, false).unwrap();
        assert_eq!((c.usage.as_ref(), raw(&c)), (None, None));
        assert_eq!(c.choices[0].finish_reason.as_deref(), Some("stop"));
        assert!(for_caller(parsed(usage), false, false).is_none());
        let c = for_caller(parsed(usage), true, true).unwrap();
        assert_eq!(raw(&c), Some(usage.as_bytes()));
        // A chunk built here has no payload to keep.
        let built = ChatChunk {
            choices: vec![ChunkChoice {
                delta: Delta {
                    content: Some("x".into()),
                    ..Delta::default()
                },
                ..ChunkChoice::default()
            }],
            usage: Some(Usage::default()),
            ..ChatChunk::default()
        };
        assert_eq!(raw(&for_caller(built, true, false).unwrap()), None);
    }
}
