//! The request and the answer that flow through the whole stack.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pgw_core::openai::{ChatChunk, ChatRequest, ChatResponse, Usage};
use pgw_core::{
    BoxError, CallHistory, CarriesHistory, Classify, Outcome, Settle, SourceId, classify_error,
    classify_response,
};

use crate::Tail;

/// The identity of one call, unique within a process (a counter) unless the caller
/// sets it ([`ChatCall::with_call_id`]), e.g. to make ids unique across processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct CallId(pub u64);

impl CallId {
    /// The next id of this process.
    #[must_use]
    pub fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl fmt::Display for CallId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// One chat completion call, as it flows through every layer of the stack.
///
/// Cheap to clone (the request is behind an `Arc`; the history is a handle), because
/// the balancer re-sends it to the next source when one is not admitted and the retry
/// layer re-sends it on every attempt. Carries its [`CallHistory`]
/// ([`CarriesHistory`]) and knows its token estimate ([`ChatCall::estimate_tokens`],
/// what a TPM limit reserves before dispatch). Whether the upstream is asked to stream
/// follows `request.stream`.
///
/// ```
/// use pgw_client::ChatCall;
/// use pgw_core::openai::ChatRequest;
///
/// let call = ChatCall::new(ChatRequest::user("gpt-4o-mini", "hello"));
/// let again = call.clone(); // an Arc clone, whatever the prompt's size
/// assert_eq!(call.id(), again.id());
/// assert_eq!(call.estimate_tokens(), 1 + 1024);
/// ```
#[derive(Clone, Debug)]
pub struct ChatCall {
    id: CallId,
    request: Arc<ChatRequest>,
    history: Option<CallHistory>,
    /// A copy sent off the call's path ([`CarriesHistory::mark_probe_copy`]).
    probe_copy: bool,
    extensions: http::Extensions,
}

impl ChatCall {
    /// A new call with a fresh [`CallId`].
    #[must_use]
    pub fn new(request: ChatRequest) -> Self {
        Self::from_arc(Arc::new(request))
    }

    /// A new call sharing an already shared request.
    #[must_use]
    pub fn from_arc(request: Arc<ChatRequest>) -> Self {
        Self {
            id: CallId::next(),
            request,
            history: None,
            probe_copy: false,
            extensions: http::Extensions::new(),
        }
    }

    /// Sets the call id.
    #[must_use]
    pub fn with_call_id(mut self, id: CallId) -> Self {
        self.id = id;
        self
    }

    /// The call id.
    #[must_use]
    pub const fn id(&self) -> CallId {
        self.id
    }

    /// The request.
    #[must_use]
    pub fn request(&self) -> &ChatRequest {
        &self.request
    }

    /// The shared request.
    #[must_use]
    pub fn request_arc(&self) -> &Arc<ChatRequest> {
        &self.request
    }

    /// Whether the upstream is asked to stream (`request.stream`).
    #[must_use]
    pub fn is_stream(&self) -> bool {
        self.request.stream
    }

    /// The tokens a TPM limit reserves before dispatch (reconciled to real usage
    /// afterwards), see
    /// [`ChatRequest::estimate_tokens`].
    #[must_use]
    pub fn estimate_tokens(&self) -> u64 {
        self.request.estimate_tokens()
    }

    /// Extensions for layers that need to pass per-call data down or up (like
    /// `http::Request::extensions`). Cloned with the call: keep entries small.
    #[must_use]
    pub const fn extensions(&self) -> &http::Extensions {
        &self.extensions
    }

    /// Mutable extensions.
    pub fn extensions_mut(&mut self) -> &mut http::Extensions {
        &mut self.extensions
    }
}

impl CarriesHistory for ChatCall {
    fn call_history(&self) -> Option<&CallHistory> {
        self.history.as_ref()
    }

    fn set_call_history(&mut self, history: CallHistory) {
        self.history = Some(history);
    }

    fn mark_probe_copy(&mut self) {
        self.probe_copy = true;
    }

    fn is_probe_copy(&self) -> bool {
        self.probe_copy
    }
}

/// What one attempt measured, for telemetry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttemptStats {
    /// The source that answered.
    pub source: Option<SourceId>,
    /// Time from dispatch to the first token (streamed answers only).
    pub ttft: Option<Duration>,
    /// Time from dispatch to the last byte.
    pub latency: Duration,
    /// Token usage as reported by the provider.
    pub usage: Option<Usage>,
    /// Whether the upstream streamed the answer.
    pub streamed: bool,
    /// What the provider's `x-ratelimit-*` headers said is left of its limits, when it
    /// sent them.
    pub headroom: Option<pgw_core::headroom::Headroom>,
}

/// The verdict of one successful attempt: the complete answer, the chunks it was
/// streamed as (to replay to a streaming caller), and what the attempt measured.
///
/// A call marked [`PassThrough`](crate::PassThrough) is answered as soon as its
/// stream's first chunk with output arrives: `response` and `chunks` then hold what
/// arrived so far, and [`ChatAnswer::tail`] the rest.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatAnswer {
    /// The answer, streamed chunks folded in.
    pub response: ChatResponse,
    /// The chunks as the provider streamed them (empty when it did not stream, and
    /// for a stream of more than [`MAX_KEPT_CHUNKS`](crate::MAX_KEPT_CHUNKS) chunks or
    /// [`MAX_KEPT_CHUNK_BYTES`](crate::MAX_KEPT_CHUNK_BYTES) of them:
    /// [`response`](Self::response) holds it folded, and a replay is rebuilt from it).
    pub chunks: Vec<ChatChunk>,
    /// Measurements.
    pub stats: AttemptStats,
    /// The rest of a stream still running, passed through (`None`: the answer is
    /// complete).
    pub tail: Option<Tail>,
    /// The provider's JSON body exactly as it arrived, when `response` is that body
    /// parsed (a non-streamed answer from a provider); `None` for a streamed, cached
    /// or assembled answer. A server can send it as is: byte for byte what the
    /// provider wrote, and no second serialization. Whoever changes `response` clears
    /// it.
    pub body: Option<bytes::Bytes>,
}

impl ChatAnswer {
    /// The first choice's text.
    #[must_use]
    pub fn content(&self) -> &str {
        self.response.content()
    }
}

/// The classifier of [`ChatAnswer`] results, pgw-core's decision applied to the
/// answer: [`classify_response`] (text, tool calls and declines, i.e. a content
/// filter's verdict or a refusal, are `Success`; the client already turned empty
/// completions into [`pgw_core::EmptyCompletion`] errors, but an answer built
/// elsewhere is checked again); errors by [`classify_error`] (the provider's error
/// code and type, then the status).
#[derive(Clone, Copy, Debug, Default)]
pub struct AnswerClassifier;

///
/// A passed-through stream ([`ChatAnswer::tail`]) is an attempt still in progress:
/// what each layer would record now is left on its tail and runs at its end.
impl Classify<ChatAnswer, BoxError> for AnswerClassifier {
    fn classify(&self, result: &Result<ChatAnswer, BoxError>) -> Outcome {
        match result {
            Ok(a) => classify_response(&a.response),
            Err(e) => classify_error(&**e),
        }
    }

    fn in_progress(&self, result: &Result<ChatAnswer, BoxError>) -> bool {
        matches!(result, Ok(a) if a.tail.is_some())
    }

    fn defer(&self, result: &mut Result<ChatAnswer, BoxError>, then: Settle<ChatAnswer, BoxError>) {
        match result {
            Ok(ChatAnswer { tail: Some(tail), .. }) => tail.on_end(then),
            done => then(done),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clone_shares_request_and_history() {
        let mut call = ChatCall::new(ChatRequest::user("m", "x".repeat(3000)));
        call.set_call_history(CallHistory::new());
        let c2 = call.clone();
        assert!(Arc::ptr_eq(call.request_arc(), c2.request_arc()));
        c2.call_history().unwrap().record(None, Outcome::Transient);
        assert_eq!(call.call_history().unwrap().len(), 1);
        assert_ne!(ChatCall::new(ChatRequest::default()).id(), call.id());
        assert_eq!(call.estimate_tokens(), 1000 + 1024);
    }
}
