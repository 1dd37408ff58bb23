//! [`UpstreamClient`]: one attempt of a chat completion against one source.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use http::header::{ACCEPT, CONTENT_TYPE, HOST, HeaderName, HeaderValue};
use http_body_util::BodyExt;
use pgw_core::openai::{ChatMessage, ChatResponse, ChunkAccumulator, FINISH_ERROR};
use pgw_core::{BoxError, EmptyCompletion, ProviderError, SourceId, UpstreamStatus};
use serde::Serialize;
use serde_json::{Map, Value};
use tokio::time::{Instant, timeout_at};
use tower::ServiceExt;
use tower_service::Service;

use crate::error::{MalformedResponse, Watchdog, WatchdogCut};
use crate::settings::after;
use crate::{
    AttemptStats, BadSettings, ChatAnswer, ChatCall, ChunkStream, HyperTransport, SourceSettings,
    UpstreamBody,
};

/// The most of a non-2xx body read for the provider's message: 64 KiB.
const MAX_ERROR_BODY: usize = 64 << 10;
/// The most of the provider's message kept in an error: 512 bytes.
const MAX_ERROR_MESSAGE: usize = 512;
/// The largest non-streamed answer accepted: 64 MiB.
pub(crate) const MAX_ANSWER_BODY: usize = 64 << 20;

/// The most chunks a streamed answer keeps as it streamed them
/// ([`ChatAnswer::chunks`](crate::ChatAnswer::chunks)): 4096, an answer of some 4000
/// tokens at one token per chunk. A longer stream keeps none (its text and usage are
/// folded into the answer either way): a parsed chunk costs 10-20 times its wire bytes,
/// and a 64 MiB stream kept whole would take a gigabyte.
pub const MAX_KEPT_CHUNKS: usize = 4096;

/// The most wire bytes (`data:` payloads) of the chunks a streamed answer keeps: 1 MiB,
/// [`MAX_KEPT_CHUNKS`] typical chunks. Fewer, larger chunks (a provider batching
/// tokens, `top_logprobs` on every token) reach it first; past it the answer keeps none,
/// as past the count.
pub const MAX_KEPT_CHUNK_BYTES: usize = 1 << 20;

struct Prepared {
    settings: SourceSettings,
    endpoint: http::Uri,
    /// The key's header (`authorization: Bearer ...`, or Azure's `api-key`).
    authorization: Option<(HeaderName, HeaderValue)>,
    /// The `Host` header of a plain `http://` endpoint (always HTTP/1.1), as hyper-util's
    /// client would write it: made once here rather than formatted on every request.
    /// `None` for `https://`, where HTTP/2 may be negotiated and hyper-util decides.
    host: Option<HeaderValue>,
}

/// What hyper-util's client puts in `Host` for `uri`: the host, and the port unless it
/// is the scheme's default; `None` unless `uri` is plain `http://`.
fn http1_host(uri: &http::Uri) -> Option<HeaderValue> {
    if uri.scheme() != Some(&http::uri::Scheme::HTTP) {
        return None;
    }
    let host = uri.host()?;
    let value = match uri.port_u16() {
        Some(port) if port != 80 => format!("{host}:{port}"),
        _ => host.to_owned(),
    };
    HeaderValue::try_from(value).ok()
}

/// One attempt of an OpenAI-compatible chat completion against one source, as a
/// tower `Service<ChatCall>` answering a complete [`ChatAnswer`] verdict.
///
/// It builds `POST {base_url}/chat/completions` with `authorization: Bearer <key>`
/// (marked sensitive) and the request as JSON (the model replaced by the source's
/// override), sends it on the transport `T`, and parses the answer:
///
/// - non-2xx: [`UpstreamStatus`] with the parsed `Retry-After` and the provider's
///   error as its body wrote it ([`ProviderError`]: message, type, code, param, each
///   scrubbed of the key), which the classifier reads before the status;
/// - 2xx JSON: a [`pgw_core::openai::ChatResponse`];
/// - 2xx SSE (when `request.stream`): the chunks through a [`ChunkStream`] with its
///   watchdogs, consumed to `[DONE]` and folded into the answer, the chunks kept in
///   [`ChatAnswer::chunks`] for replay;
/// - a refusal (`message.refusal`, `delta.refusal`) or a content filter's verdict
///   (`finish_reason: "content_filter"`) with `content: null`: an answer like any
///   other, handed up as is (another source would decline the same prompt);
/// - no text, no tool call and no decline: [`EmptyCompletion`]; bytes that are not a completion:
///   [`MalformedResponse`]; a watchdog: [`WatchdogCut`]. All three are `Transient`.
///
/// **A stream, whole or passed through.** By default an attempt consumes a streamed
/// answer to its end under the watchdogs: one verdict per attempt, and a stream cut
/// after its first token can be redone elsewhere, whole (what a validator needs). A
/// call marked [`PassThrough`](crate::PassThrough) is answered at its first chunk
/// with output instead, the rest in [`ChatAnswer::tail`]; the layers above then judge
/// the attempt when that tail ends ([`pgw_core::Classify::in_progress`]). Asked to
/// stream, the upstream is always asked for its usage chunk
/// (`stream_options.include_usage`), so token quotas settle to real usage. Callers
/// who want raw chunks without any layer use [`UpstreamClient::open_stream`].
///
/// The transport is any `Service<http::Request<Bytes>, Response = http::Response<B>,
/// Error = BoxError>`; [`HyperTransport`] for real providers, `pgw_sim::SimService`
/// in virtual time. Every timeout runs on tokio's clock.
pub struct UpstreamClient<T> {
    transport: T,
    prepared: Arc<Prepared>,
}

impl<T: Clone> Clone for UpstreamClient<T> {
    fn clone(&self) -> Self {
        Self {
            transport: self.transport.clone(),
            prepared: Arc::clone(&self.prepared),
        }
    }
}

impl<T> fmt::Debug for UpstreamClient<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamClient")
            .field("settings", &self.prepared.settings)
            .finish_non_exhaustive()
    }
}

impl UpstreamClient<HyperTransport> {
    /// A client on a fresh [`HyperTransport`] with the source's connect timeout.
    ///
    /// # Errors
    /// [`BadSettings`] for an unusable base URL or key; a TLS setup error.
    pub fn hyper(settings: SourceSettings) -> Result<Self, BoxError> {
        let transport = HyperTransport::new(settings.timeouts.connect)?;
        Ok(Self::new(settings, transport)?)
    }
}

impl<T> UpstreamClient<T> {
    /// A client for one source over `transport`.
    ///
    /// # Errors
    /// [`BadSettings`] naming `base_url` (not an absolute http(s) URL) or `key` (not a
    /// valid header value).
    pub fn new(settings: SourceSettings, transport: T) -> Result<Self, BadSettings> {
        let endpoint = settings.endpoint()?;
        let authorization = settings.authorization()?;
        Ok(Self {
            transport,
            prepared: Arc::new(Prepared {
                settings,
                host: http1_host(&endpoint),
                endpoint,
                authorization,
            }),
        })
    }

    /// The source's settings.
    #[must_use]
    pub fn settings(&self) -> &SourceSettings {
        &self.prepared.settings
    }

    /// The source's name.
    #[must_use]
    pub fn source(&self) -> &SourceId {
        &self.prepared.settings.id
    }

    /// The transport.
    #[must_use]
    pub const fn get_ref(&self) -> &T {
        &self.transport
    }
}

impl<T, B> UpstreamClient<T>
where
    T: Service<http::Request<Bytes>, Response = http::Response<B>, Error = BoxError> + Clone + Send + 'static,
    T::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    /// Opens a streamed answer (the upstream is asked to stream whatever
    /// `request.stream` says) and returns its chunks as they arrive, with the
    /// watchdogs running while the stream is polled.
    ///
    /// No retry can happen once the caller saw a chunk; see the type's docs.
    ///
    /// # Errors
    /// As the attempt: [`UpstreamStatus`], [`WatchdogCut`] (first token, before the
    /// head arrived), transport errors.
    pub fn open_stream(&self, call: &ChatCall) -> BoxFuture<'static, Result<ChunkStream, BoxError>> {
        let prepared = Arc::clone(&self.prepared);
        let transport = self.transport.clone();
        let req = prepared.build(call, true);
        Box::pin(async move {
            let start = Instant::now();
            let (parts, body) = head(transport.oneshot(req?), &prepared, start, true).await?;
            if !is_event_stream(&parts.headers) {
                return Err(MalformedResponse::new("asked for a stream, got no text/event-stream").into());
            }
            Ok(ChunkStream::new(body, start, prepared.settings.timeouts)
                .scrubbing(prepared.settings.key.clone()))
        })
    }
}

impl<T, B> Service<ChatCall> for UpstreamClient<T>
where
    T: Service<http::Request<Bytes>, Response = http::Response<B>, Error = BoxError> + Clone + Send + 'static,
    T::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = ChatAnswer;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<ChatAnswer, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.transport.poll_ready(cx)
    }

    fn call(&mut self, call: ChatCall) -> Self::Future {
        // The ready transport goes into the future; a fresh clone stays (tower-service's
        // "be careful when cloning inner services").
        let fresh = self.transport.clone();
        let mut transport = std::mem::replace(&mut self.transport, fresh);
        let prepared = Arc::clone(&self.prepared);
        Box::pin(async move {
            let start = Instant::now();
            let stream = call.is_stream();
            let pass = stream && call.extensions().get::<crate::PassThrough>().is_some();
            let req = prepared.build(&call, stream)?;
            let result = attempt(transport.call(req), &prepared, start, stream, pass).await;
            let id = &prepared.settings.id;
            if let Err(e) = &result {
                tracing::debug!(source = %id, call = %call.id(), error = %e, "attempt failed");
            }
            result
        })
    }
}

/// The outgoing body: the caller's request with the model replaced, serialized without
/// copying the (possibly large) messages.
#[derive(Serialize)]
struct Outgoing<'a> {
    model: &'a str,
    messages: &'a [ChatMessage],
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    stream: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<Value>,
    #[serde(flatten)]
    extra: &'a Map<String, Value>,
}

/// A streamed request asks for the usage chunk (`stream_options.include_usage`), so
/// the token quota settles to real usage; the caller's own stream options are kept,
/// and whether the caller sees the usage chunk is the caller's choice (the gateway
/// forwards it only when asked). `None`: the caller's options already say it, or the
/// request is not streamed.
fn stream_options(extra: &Map<String, Value>, stream: bool) -> (Option<Value>, Option<Map<String, Value>>) {
    if !stream {
        return (None, None);
    }
    match extra.get("stream_options") {
        None => (Some(serde_json::json!({"include_usage": true})), None),
        Some(Value::Object(o)) if o.get("include_usage") == Some(&Value::Bool(true)) => (None, None),
        Some(Value::Object(_)) => {
            // Set in place: the caller's options keep their place among the caller's
            // keys (a removal would move the last key into it).
            let mut rest = extra.clone();
            if let Some(Value::Object(o)) = rest.get_mut("stream_options") {
                o.insert("include_usage".into(), Value::Bool(true));
            }
            (None, Some(rest))
        }
        // Not an object: the provider will say what it thinks of it.
        Some(_) => (None, None),
    }
}

impl Prepared {
    fn build(&self, call: &ChatCall, stream: bool) -> Result<http::Request<Bytes>, BoxError> {
        let req = call.request();
        let (stream_options, rest) = stream_options(&req.extra, stream && self.settings.ask_stream_usage);
        let body = serde_json::to_vec(&Outgoing {
            model: self.settings.model.as_deref().unwrap_or(&req.model),
            messages: &req.messages,
            max_tokens: req.max_tokens,
            stream,
            stream_options,
            extra: rest.as_ref().unwrap_or(&req.extra),
        })?;
        // Built in place: `http::request::Builder` moves the request through a closure
        // per header.
        let mut r = http::Request::new(Bytes::from(body));
        *r.method_mut() = http::Method::POST;
        *r.uri_mut() = self.endpoint.clone();
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        h.insert(
            ACCEPT,
            HeaderValue::from_static(if stream {
                "text/event-stream"
            } else {
                "application/json"
            }),
        );
        if let Some((name, value)) = &self.authorization {
            h.insert(name.clone(), value.clone());
        }
        if let Some(host) = &self.host {
            h.insert(HOST, host.clone());
        }
        Ok(r)
    }
}

/// The provider ended the `what` (answer, stream) with `finish_reason: "error"` in one
/// of `reasons` (OpenRouter's way): the text so far is cut short, never complete.
pub(crate) fn ended_in_error<'a>(
    mut reasons: impl Iterator<Item = Option<&'a str>>,
    what: &str,
) -> Result<(), BoxError> {
    if reasons.any(|r| r == Some(FINISH_ERROR)) {
        return Err(MalformedResponse::new(format!(
            "the provider ended the {what} with finish_reason \"error\""
        ))
        .into());
    }
    Ok(())
}

/// Waits for the response head under the first-token (streaming) or total watchdog,
/// and turns a non-2xx head into an [`UpstreamStatus`].
async fn head<F, B>(
    fut: F,
    prepared: &Prepared,
    start: Instant,
    stream: bool,
) -> Result<(http::response::Parts, UpstreamBody), BoxError>
where
    F: Future<Output = Result<http::Response<B>, BoxError>>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let t = prepared.settings.timeouts;
    let (limit, watchdog, dur) = if stream && t.first_token < t.total {
        (after(start, t.first_token), Watchdog::FirstToken, t.first_token)
    } else {
        (after(start, t.total), Watchdog::Total, t.total)
    };
    let resp = timeout_at(limit, fut)
        .await
        .map_err(|_| WatchdogCut::new(watchdog, dur))??;
    let (parts, body) = resp.into_parts();
    let body: UpstreamBody = body.map_err(Into::into).boxed_unsync();
    if !parts.status.is_success() {
        return Err(status_error(&parts, body, prepared, start).await.into());
    }
    Ok((parts, body))
}

async fn attempt<F, B>(
    fut: F,
    prepared: &Prepared,
    start: Instant,
    stream: bool,
    pass: bool,
) -> Result<ChatAnswer, BoxError>
where
    F: Future<Output = Result<http::Response<B>, BoxError>>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (parts, body) = head(fut, prepared, start, stream).await?;
    let t = prepared.settings.timeouts;
    let mut stats = AttemptStats {
        source: Some(prepared.settings.id.clone()),
        headroom: pgw_core::headroom::Headroom::from_headers(&parts.headers),
        ..AttemptStats::default()
    };
    let (response, chunks, body) = if stream && is_event_stream(&parts.headers) {
        let mut s = ChunkStream::new(body, start, t).scrubbing(prepared.settings.key.clone());
        let mut acc = ChunkAccumulator::default();
        let mut chunks = Vec::new();
        let mut keep = true;
        let mut kept_bytes = 0usize;
        while let Some(chunk) = s.next().await {
            let chunk = chunk?;
            acc.push(&chunk);
            // The first-chunk gate: a passed-through attempt is committed by its first
            // output, and the rest goes to the caller as it arrives.
            let commit = pass && chunk.choices.iter().any(|c| c.delta.carries_output());
            // A parsed chunk costs 10-20 times its wire bytes (its maps, strings and
            // raw payload): a long stream keeps none, and is replayed from the folded
            // answer.
            if keep {
                // A chunk built here (no payload kept) weighs as a typical one.
                kept_bytes = kept_bytes.saturating_add(chunk.raw.as_ref().map_or(256, bytes::Bytes::len));
                if chunks.len() < MAX_KEPT_CHUNKS && kept_bytes <= MAX_KEPT_CHUNK_BYTES {
                    chunks.push(chunk);
                } else {
                    chunks = Vec::new();
                    keep = false;
                }
            }
            if commit {
                stats.ttft = s.ttft();
                stats.streamed = true;
                stats.latency = start.elapsed();
                let response = acc.so_far().clone();
                let tail = crate::Tail::new(s, acc, stats.clone());
                return Ok(ChatAnswer {
                    response,
                    chunks,
                    stats,
                    tail: Some(tail),
                    body: None,
                });
            }
        }
        stats.ttft = s.ttft();
        stats.streamed = true;
        (acc.finish(), chunks, None)
    } else {
        let bytes = read_body(body, after(start, t.total), t, MAX_ANSWER_BODY).await?;
        let resp: ChatResponse = match pgw_core::openai::from_json_bytes(&bytes) {
            Some(resp) => resp,
            // Read again to say what is wrong, in serde_json's words (or to read bytes
            // whose only invalid UTF-8 is in a string the answer's type skips).
            None => serde_json::from_slice(&bytes).map_err(|e| {
                let key = prepared.settings.key.as_ref();
                MalformedResponse::new(clean(
                    format!("body is not a chat completion: {e}: {}", snippet(&bytes, key)),
                    key,
                ))
            })?,
        };
        if resp.extra.contains_key("error")
            && let Some(status) = error_in_answer(&bytes, prepared.settings.key.as_ref(), "")
        {
            // A provider's error in a 2xx answer (with or without choices).
            return Err(status.into());
        }
        ended_in_error(resp.choices.iter().map(|c| c.finish_reason.as_deref()), "answer")?;
        (resp, Vec::new(), Some(bytes))
    };
    stats.latency = start.elapsed();
    stats.usage.clone_from(&response.usage);
    if response.is_empty_completion() {
        return Err(EmptyCompletion.into());
    }
    Ok(ChatAnswer {
        response,
        chunks,
        stats,
        tail: None,
        body,
    })
}

fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
        })
}

/// Reads a whole body: each frame within `inter_token` of the previous, all by
/// `deadline`, at most `max` bytes.
async fn read_body(
    body: UpstreamBody,
    deadline: Instant,
    t: crate::Timeouts,
    max: usize,
) -> Result<Bytes, BoxError> {
    let mut buf = BytesMut::new();
    read_into(&mut buf, body, deadline, t, max).await?;
    Ok(buf.freeze())
}

/// [`read_body`] into `buf`, which keeps what arrived (at most `max` bytes) when it
/// fails: a body cut by a watchdog, or past `max`.
async fn read_into(
    buf: &mut BytesMut,
    mut body: UpstreamBody,
    deadline: Instant,
    t: crate::Timeouts,
    max: usize,
) -> Result<(), BoxError> {
    loop {
        let stall = after(Instant::now(), t.inter_token);
        let (limit, cut) = if stall < deadline {
            (stall, WatchdogCut::new(Watchdog::InterToken, t.inter_token))
        } else {
            (deadline, WatchdogCut::new(Watchdog::Total, t.total))
        };
        match timeout_at(limit, body.frame()).await {
            Err(_) => return Err(cut.into()),
            Ok(None) => return Ok(()),
            Ok(Some(frame)) => {
                if let Ok(data) = frame?.into_data() {
                    if buf.len() + data.len() > max {
                        buf.extend_from_slice(&data[..max - buf.len()]);
                        return Err(MalformedResponse::new(format!("body larger than {max} bytes")).into());
                    }
                    buf.extend_from_slice(&data);
                }
            }
        }
    }
}

async fn status_error(
    parts: &http::response::Parts,
    body: UpstreamBody,
    prepared: &Prepared,
    start: Instant,
) -> UpstreamStatus {
    let retry_after = pgw_core::retry_after::from_headers(&parts.headers, SystemTime::now());
    let t = prepared.settings.timeouts;
    // The message is a courtesy: read it briefly, never let it hold the attempt.
    let deadline =
        after(start, t.total).min(after(Instant::now(), t.inter_token.min(Duration::from_secs(5))));
    // What arrived is read whatever stopped it: a body past MAX_ERROR_BODY (a
    // validation error echoing the input) or slow to come still says, in its first
    // bytes, what went wrong ("maximum context length ...").
    let mut bytes = BytesMut::new();
    let _ = read_into(&mut bytes, body, deadline, t, MAX_ERROR_BODY).await;
    let headroom = pgw_core::headroom::Headroom::from_headers(&parts.headers);
    let mut status = error_status(parts.status, retry_after, &bytes, prepared.settings.key.as_ref())
        .with_headroom(headroom);
    if retry_after.is_none() && parts.status == http::StatusCode::TOO_MANY_REQUESTS {
        let hint = pushback_hint(headroom, &status);
        status = status.with_retry_after(hint);
    }
    // The source's model override replaced the caller's: an unknown model is ours.
    if prepared.settings.model.is_some() {
        status.with_source_model()
    } else {
        status
    }
}

/// How long a 429 without `Retry-After` asks to wait, in the provider's other words:
/// the wait its message names (OpenAI: "Please try again in 4s."), else the time its
/// `x-ratelimit-*` headers say the exhausted limit needs to take one more request
/// ([`pgw_core::headroom::Headroom::exhausted_for`]). `None` when neither says: the
/// retry layer's short jittered backoff then applies.
fn pushback_hint(
    headroom: Option<pgw_core::headroom::Headroom>,
    status: &UpstreamStatus,
) -> Option<Duration> {
    named_wait(status).or_else(|| headroom?.exhausted_for(None))
}

/// The wait the provider's message names ([`pgw_core::retry_after::from_message`]): its
/// error's message, else the status's own text.
fn named_wait(status: &UpstreamStatus) -> Option<Duration> {
    let message = status.provider().map_or(status.message(), |p| p.message.as_str());
    pgw_core::retry_after::from_message(message)
}

/// A provider's error inside a 2xx answer (a JSON body, or a stream's event) as an
/// error status: the status its numeric `code` names (OpenRouter writes the HTTP
/// status there: `"code": 429`), else 502, so its `code`/`type` decide the outcome
/// (a rate limit holds, a context window moves on, an unknown one is transient). Its
/// message starts with `context`. `None` when `bytes` is not a provider's error.
pub(crate) fn error_in_answer(
    bytes: &[u8],
    key: Option<&crate::SecretKey>,
    context: &str,
) -> Option<UpstreamStatus> {
    let p = ProviderError::parse(bytes)?;
    let status = p
        .code
        .as_deref()
        .and_then(|c| c.parse::<u16>().ok())
        .filter(|c| (400..=599).contains(c))
        .and_then(|c| http::StatusCode::from_u16(c).ok())
        .unwrap_or(http::StatusCode::BAD_GATEWAY);
    let status = provider_status(status, None, p, key, context);
    // A rate limit in an answer has no headers of its own: the wait its message names.
    if pgw_core::classify_upstream(&status).is_rate_limited() {
        let hint = named_wait(&status);
        return Some(status.with_retry_after(hint));
    }
    Some(status)
}

/// A stream's `event: error`: the provider's error when its data is one
/// ([`error_in_answer`]), else a 502 whose message is the data (scrubbed, cut),
/// starting with `context`.
pub(crate) fn error_event(data: &[u8], key: Option<&crate::SecretKey>, context: &str) -> UpstreamStatus {
    error_in_answer(data, key, context).unwrap_or_else(|| {
        let text = format!("{context}{}", String::from_utf8_lossy(data).trim());
        UpstreamStatus::new(http::StatusCode::BAD_GATEWAY, None, clean(text, key))
    })
}

/// `text` scrubbed of `key`, then cut to [`MAX_ERROR_MESSAGE`] bytes. In that order: a
/// key echoed across the cut would otherwise survive as its first bytes.
pub(crate) fn clean(text: String, key: Option<&crate::SecretKey>) -> String {
    truncate(match key {
        Some(key) => key.scrub(&text),
        None => text,
    })
}

/// The error a provider wrote in `bytes`, answered with `status`: its fields (or, for
/// a body that is not a JSON error, a snippet of it) scrubbed of the key, then cut to
/// [`MAX_ERROR_MESSAGE`] bytes. In that order: a key echoed across the cut would
/// otherwise survive as its first bytes.
fn error_status(
    status: http::StatusCode,
    retry_after: Option<Duration>,
    bytes: &[u8],
    key: Option<&crate::SecretKey>,
) -> UpstreamStatus {
    match ProviderError::parse(bytes) {
        Some(p) => provider_status(status, retry_after, p, key, ""),
        None => UpstreamStatus::new(
            status,
            retry_after,
            clean(String::from_utf8_lossy(bytes).trim().to_owned(), key),
        ),
    }
}

/// `p` answered with `status`, every field the caller may see scrubbed (a provider
/// may echo the key) and cut; the status's message is `context` and the provider's.
fn provider_status(
    status: http::StatusCode,
    retry_after: Option<Duration>,
    p: ProviderError,
    key: Option<&crate::SecretKey>,
    context: &str,
) -> UpstreamStatus {
    let p = ProviderError {
        message: clean(p.message, key),
        kind: p.kind.map(|s| clean(s, key)),
        code: p.code.map(|s| clean(s, key)),
        param: p.param.map(|s| clean(s, key)),
    };
    UpstreamStatus::new(status, retry_after, format!("{context}{}", p.message)).with_provider(p)
}

fn snippet(bytes: &[u8], key: Option<&crate::SecretKey>) -> String {
    clean(String::from_utf8_lossy(bytes).trim().to_owned(), key)
}

fn truncate(mut s: String) -> String {
    if s.len() > MAX_ERROR_MESSAGE {
        let mut cut = MAX_ERROR_MESSAGE;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_header_of_a_plain_http_endpoint_is_made_as_hyper_util_makes_it() {
        let host = |u: &str| http1_host(&u.parse().unwrap()).map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(host("http://127.0.0.1:9/v1").as_deref(), Some("127.0.0.1:9"));
        assert_eq!(host("http://llm.internal/v1").as_deref(), Some("llm.internal"));
        assert_eq!(host("http://llm.internal:80/v1").as_deref(), Some("llm.internal"));
        assert_eq!(host("http://[::1]:8000/v1").as_deref(), Some("[::1]:8000"));
        // HTTP/2 may be negotiated: hyper-util decides.
        assert_eq!(host("https://api.openai.com/v1"), None);
    }

    /// A streamed request asks for the usage chunk unless the source says not to
    /// (a server that refuses `stream_options`); a caller's own options go as they came.
    #[test]
    fn stream_usage_is_asked_unless_the_source_refuses_the_field() {
        let body_of = |ask: bool, extra: Option<Value>| {
            let settings = SourceSettings::new("s1", "http://127.0.0.1:9/v1").ask_stream_usage(ask);
            let transport = tower::service_fn(|_: http::Request<Bytes>| async {
                Err::<http::Response<crate::UpstreamBody>, BoxError>("unused".into())
            });
            let client = UpstreamClient::new(settings, transport).unwrap();
            let mut req = pgw_core::openai::ChatRequest::user("m", "hi");
            req.stream = true;
            if let Some(o) = extra {
                req.extra.insert("stream_options".into(), o);
            }
            let built = client.prepared.build(&ChatCall::new(req), true).unwrap();
            serde_json::from_slice::<Value>(built.body()).unwrap()
        };
        assert_eq!(body_of(true, None)["stream_options"]["include_usage"], true);
        assert!(body_of(false, None).get("stream_options").is_none());
        let own = serde_json::json!({"include_usage": false});
        assert_eq!(body_of(false, Some(own.clone()))["stream_options"], own);
    }

    /// The caller's JSON goes upstream with its keys in the caller's order, at every
    /// depth: a structured output's schema is filled in its fields' order (reasoning
    /// before answer), which sorted keys silently changed.
    #[test]
    fn the_callers_key_order_reaches_the_provider() {
        let settings = SourceSettings::new("s1", "http://127.0.0.1:9/v1");
        let transport = tower::service_fn(|_: http::Request<Bytes>| async {
            Err::<http::Response<crate::UpstreamBody>, BoxError>("unused".into())
        });
        let client = UpstreamClient::new(settings, transport).unwrap();
        let json = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],
            "response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{
            "type":"object","properties":{"reasoning":{"type":"string"},"answer":{"type":"string"}}}}},
            "temperature":0}"#;
        let req: pgw_core::openai::ChatRequest = serde_json::from_str(json).unwrap();
        let built = client.prepared.build(&ChatCall::new(req), false).unwrap();
        let sent = std::str::from_utf8(built.body()).unwrap();
        let (r, a) = (
            sent.find("\"reasoning\"").unwrap(),
            sent.find("\"answer\"").unwrap(),
        );
        assert!(r < a, "{sent}");
        let (rf, t) = (
            sent.find("\"response_format\"").unwrap(),
            sent.find("\"temperature\"").unwrap(),
        );
        assert!(rf < t, "{sent}");
        // A streamed request's own `stream_options` gets `include_usage` where it is.
        let json = r#"{"model":"m","messages":[],"stream":true,"stream_options":{"x":1},"seed":1,"top_p":1}"#;
        let req: pgw_core::openai::ChatRequest = serde_json::from_str(json).unwrap();
        let built = client.prepared.build(&ChatCall::new(req), true).unwrap();
        let sent = std::str::from_utf8(built.body()).unwrap();
        let at = |k: &str| sent.find(&format!("\"{k}\"")).unwrap();
        assert!(
            at("stream_options") < at("seed") && at("seed") < at("top_p"),
            "{sent}"
        );
        assert!(
            sent.contains(r#""stream_options":{"x":1,"include_usage":true}"#),
            "{sent}"
        );
    }
}
