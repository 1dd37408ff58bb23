//! Streamed answers as server-sent events.
//!
//! The response head waits for the gateway to commit the stream to a source (its first
//! chunk of output), at most one keep-alive interval: then it goes out with
//! `x-pgw-group` (and `x-pgw-source` with `expose_sources`). A call that fails before
//! the head went out gets an ordinary error answer (status, OpenAI JSON,
//! `Retry-After`), as the provider's own API does, so an SDK's retry policy sees it.
//! When the interval passes first, the `200` goes out without those headers, and a
//! `: keep-alive` comment follows every `sse_keep_alive` of silence (proxies and
//! clients with idle timeouts keep the connection). Then each chunk as
//! `data: {json}\n\n` (the provider's own JSON, byte for byte, for every chunk pgw
//! left as it came), and `data: [DONE]\n\n` at the end. A call that fails after the
//! head went out, before or after its first chunk, ends with one OpenAI-style error
//! event `data: {"error": {...}}` and no `[DONE]`, so a client never takes a
//! truncated answer for a complete one.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use crate::auth::TenantPermit;
use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::StreamExt;
use pgw_core::BoxError;
use pgw_core::openai::{ChatChunk, Usage};
use pgw_stack::ChatStream;
use tokio::time::{Instant, Interval, MissedTickBehavior};

use crate::error::ApiError;
use crate::routes::{AppState, CallMetrics};

type Opening = Pin<Box<dyn Future<Output = Result<ChatStream, BoxError>> + Send>>;

enum Phase {
    Opening(Opening),
    Streaming(ChatStream),
    Done,
}

struct Call {
    phase: Phase,
    keep_alive: Interval,
    /// When the last event went out (`None`: none yet).
    last_event: Option<Instant>,
    permit: Option<TenantPermit>,
    usage: Option<Usage>,
    first_chunk: bool,
    expose_sources: bool,
    metrics: CallMetrics,
    /// How the stream ended (`Some(None)`: its end, `Some(Some(e))`: its error), when
    /// that was seen right after chunks that go out first.
    ended: Option<Option<BoxError>>,
    /// The server's shutdown grace period is over (`AppState::grace_over`).
    grace_over: tokio::sync::watch::Receiver<bool>,
    _slot: crate::routes::Slot,
}

const KEEP_ALIVE: &[u8] = b": keep-alive\n\n";
const DONE: &[u8] = b"data: [DONE]\n\n";

fn event(json: &serde_json::Value) -> Bytes {
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(b"data: ");
    // A `serde_json::Value` always serializes.
    let _ = serde_json::to_writer(&mut out, json);
    out.extend_from_slice(b"\n\n");
    out.into()
}

/// The most bytes of events that already arrived sent in one body frame: 16 KiB, so a
/// provider's burst is not held whole.
const MAX_FRAME: usize = 16 << 10;

/// Appends the event of one chunk to `out`: the provider's own payload when the chunk
/// is as it came ([`ChatChunk::raw`]) and fits one `data:` line, else the chunk
/// serialized. A chunk that does not serialize appends nothing, never an empty event.
fn chunk_event(chunk: &ChatChunk, out: &mut Vec<u8>) {
    // A payload the provider wrote over several `data:` lines was joined with `\n`:
    // sent as one line, its rest would be lost. Rare, so it is serialized again.
    if let Some(raw) = chunk.raw.as_deref()
        && !raw.contains(&b'\n')
    {
        out.reserve(raw.len() + 8);
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(raw);
        out.extend_from_slice(b"\n\n");
        return;
    }
    let start = out.len();
    out.reserve(256);
    out.extend_from_slice(b"data: ");
    if serde_json::to_writer(&mut *out, chunk).is_err() {
        out.truncate(start);
        return;
    }
    out.extend_from_slice(b"\n\n");
}

impl Call {
    /// The call failed: one error event, then the end.
    async fn fail(&mut self, e: &BoxError) -> Bytes {
        let err = ApiError::from_gateway(e, self.expose_sources);
        tracing::warn!(tenant = %self.metrics.tenant, status = err.status.as_u16(), code = ?err.code, error = %e, "streamed call failed");
        self.end_with(&err, Some(e)).await
    }

    /// The server's grace period is over: the stream ends with an error event saying
    /// so (503, `Retry-After` 1 s: another replica can take it).
    async fn cut(&mut self) -> Bytes {
        let err = ApiError::shutting_down("the answer was cut");
        tracing::warn!(tenant = %self.metrics.tenant, "streamed call cut at the end of the shutdown grace period");
        self.end_with(&err, None).await
    }

    /// The error event of `err`, the call's metrics and its tenant's permit settled:
    /// a stream that went out was served (charged as a call that ran, whatever cut it:
    /// the call's deadline says it asked no provider of its own); one that did not is
    /// given back when `cause` says it was not attempted.
    async fn end_with(&mut self, err: &ApiError, cause: Option<&BoxError>) -> Bytes {
        let served = matches!(self.phase, Phase::Streaming(_));
        self.phase = Phase::Done;
        self.metrics.finish(Some(err));
        if let Some(p) = self.permit.take() {
            match cause {
                Some(e) if !served => p.failed(e).await,
                _ => p.finish(self.usage.as_ref().and_then(Usage::charged)).await,
            }
        }
        event(&err.body())
    }

    async fn done(&mut self) -> Bytes {
        // The provider's usage also when the caller did not ask for the usage chunk
        // (most SDKs do not): the tenant's tokens settle to what was used.
        if let (None, Phase::Streaming(chunks)) = (&self.usage, &self.phase) {
            self.usage = chunks.usage();
        }
        self.phase = Phase::Done;
        if let Some(u) = &self.usage {
            self.metrics.tokens(u);
        }
        self.metrics.finish(None);
        if let Some(p) = self.permit.take() {
            p.finish(self.usage.as_ref().and_then(Usage::charged)).await;
        }
        Bytes::from_static(DONE)
    }

    /// A chunk is going out: its usage, the first-token metric, its event into `out`.
    fn on_chunk(&mut self, chunk: &ChatChunk, out: &mut Vec<u8>) {
        if chunk.usage.is_some() {
            self.usage.clone_from(&chunk.usage);
        }
        if self.first_chunk {
            self.first_chunk = false;
            self.metrics
                .handles
                .first_token
                .get([&self.metrics.model], |[model]| {
                    metrics::histogram!(
                        "gen_ai_server_time_to_first_token_seconds",
                        "gen_ai_request_model" => model.to_owned(),
                    )
                })
                .record(self.metrics.started.elapsed().as_secs_f64());
        }
        chunk_event(chunk, out);
    }

    /// The next chunk if it already arrived (polled once, never waited for). The
    /// stream's end or error, when that is what arrived, is kept for the next call.
    async fn ready_chunk(&mut self) -> Option<ChatChunk> {
        let Phase::Streaming(chunks) = &mut self.phase else {
            return None;
        };
        match std::future::poll_fn(|cx| Poll::Ready(chunks.poll_next_unpin(cx))).await {
            Poll::Ready(Some(Ok(chunk))) => Some(chunk),
            Poll::Ready(Some(Err(e))) => {
                self.ended = Some(Some(e));
                None
            }
            Poll::Ready(None) => {
                self.ended = Some(None);
                None
            }
            Poll::Pending => None,
        }
    }

    /// Whether a whole keep-alive interval passed since the last event (or there was
    /// none), now that the interval ticked; if not, the next tick is moved to the end
    /// of that interval. Events only note their instant (`last_event`),
    /// so a stream of many events does not move a timer at each.
    fn quiet(&mut self) -> bool {
        let Some(at) = self.last_event else {
            return true;
        };
        let quiet_at = at + self.keep_alive.period();
        if quiet_at <= Instant::now() {
            return true;
        }
        self.keep_alive.reset_at(quiet_at);
        false
    }

    /// The next bytes of the body, `None` at the end.
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            if let Some(ended) = self.ended.take() {
                return Some(match ended {
                    Some(e) => self.fail(&e).await,
                    None => self.done().await,
                });
            }
            match &mut self.phase {
                Phase::Done => return None,
                Phase::Opening(opening) => {
                    tokio::select! {
                        biased;
                        () = grace_over(&mut self.grace_over) => return Some(self.cut().await),
                        opened = opening => match opened {
                            Ok(chunks) => self.phase = Phase::Streaming(chunks),
                            Err(e) => return Some(self.fail(&e).await),
                        },
                        _ = self.keep_alive.tick() => return Some(Bytes::from_static(KEEP_ALIVE)),
                    }
                }
                Phase::Streaming(chunks) => {
                    tokio::select! {
                        biased;
                        () = grace_over(&mut self.grace_over) => return Some(self.cut().await),
                        item = chunks.next() => match item {
                            Some(Ok(chunk)) => {
                                // Noted, not a timer reset per event (see `quiet`).
                                self.last_event = Some(Instant::now());
                                // The chunks that arrived with it (a provider's write
                                // often holds several) go out in the same frame: each
                                // frame costs the body's layers and hyper a pass.
                                let mut out = Vec::new();
                                let mut next = Some(chunk);
                                while let Some(chunk) = next {
                                    self.on_chunk(&chunk, &mut out);
                                    next = if out.len() < MAX_FRAME { self.ready_chunk().await } else { None };
                                }
                                if !out.is_empty() {
                                    return Some(out.into());
                                }
                            }
                            Some(Err(e)) => return Some(self.fail(&e).await),
                            None => return Some(self.done().await),
                        },
                        _ = self.keep_alive.tick() => {
                            if !self.quiet() {
                                continue;
                            }
                            return Some(Bytes::from_static(KEEP_ALIVE));
                        }
                    }
                }
            }
        }
    }
}

/// Completes when the server's shutdown grace period is over; never, should the
/// server's state be gone (nothing can end the grace period then).
pub(crate) async fn grace_over(rx: &mut tokio::sync::watch::Receiver<bool>) {
    if rx.wait_for(|over| *over).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The SSE response of a streamed call: the head once the stream is committed (or one
/// keep-alive interval passed), events as they come.
pub(crate) async fn respond(
    state: &AppState,
    request: pgw_stack::ChatCall,
    mut permit: Option<TenantPermit>,
    slot: crate::routes::Slot,
    mut metrics: CallMetrics,
    (bypassed, cacheable): (bool, bool),
) -> Response {
    let gateway = state.gateway.clone();
    let mut opening: Opening = Box::pin(async move { gateway.stream_call(request).await });
    let every = state.sse_keep_alive.max(Duration::from_millis(1));
    let mut grace = state.grace_over.subscribe();
    let first = tokio::select! {
        // The stream first: one ready with the grace's end is still given.
        biased;
        first = tokio::time::timeout(every, &mut opening) => first,
        () = grace_over(&mut grace) => {
            // Nothing sent yet: the call is answered, not reset when the connection
            // is closed a moment later.
            drop(opening);
            drop(slot);
            return crate::routes::cut_before_answer(metrics, permit).await;
        }
    };
    let (phase, who) = match first {
        Ok(Ok(stream)) => {
            let who = (
                HeaderValue::from_str(stream.group()).ok(),
                stream
                    .source()
                    .filter(|_| state.expose_sources)
                    .and_then(|s| HeaderValue::from_str(s.as_str()).ok()),
                Some(crate::routes::cache_verdict(
                    stream.cache_hit(),
                    bypassed,
                    cacheable,
                )),
            );
            (Phase::Streaming(stream), who)
        }
        Ok(Err(e)) => {
            drop(slot);
            let err = state.call_error(&e);
            tracing::warn!(tenant = %metrics.tenant, status = err.status.as_u16(), code = ?err.code, error = %e, "streamed call failed");
            metrics.finish(Some(&err));
            if let Some(p) = permit.take() {
                p.failed(&e).await;
            }
            return err.into_response();
        }
        // A full interval of silence already: the first comment goes out with the head.
        // (What the cache did is not known yet either: no header says it.)
        Err(_) => (Phase::Opening(opening), (None, None, None)),
    };
    let first_tick = match phase {
        Phase::Opening(_) => Instant::now(),
        _ => Instant::now() + every,
    };
    let mut keep_alive = tokio::time::interval_at(first_tick, every);
    keep_alive.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let call = Call {
        phase,
        keep_alive,
        last_event: None,
        permit,
        usage: None,
        first_chunk: true,
        expose_sources: state.expose_sources,
        metrics,
        ended: None,
        grace_over: grace,
        _slot: slot,
    };
    // Boxed: `unfold` moves its state into each step's future and back out, and a
    // `Call` (the stream, its timers and metrics) is large enough for those copies to
    // show in a profile (93 `memcpy` calls for a five-chunk answer).
    let body = futures_util::stream::unfold(Box::new(call), |mut call| async move {
        let bytes = call.next().await?;
        Some((Ok::<_, Infallible>(bytes), call))
    });
    let mut response = Response::new(Body::from_stream(body));
    *response.status_mut() = StatusCode::OK;
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Tells nginx-style proxies not to buffer the stream.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    if let (Some(g), source, cache) = who {
        h.insert("x-pgw-group", g);
        if let Some(s) = source {
            h.insert("x-pgw-source", s);
        }
        if let Some(c) = cache {
            h.insert(crate::routes::CACHE_HEADER, c);
        }
    }
    response
}
