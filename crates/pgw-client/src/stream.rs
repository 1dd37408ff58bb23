//! [`ChunkStream`]: a streamed answer, decoded from SSE, under the watchdogs.

use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use futures_core::Stream;
use http_body::Body;
use pgw_core::BoxError;
use pgw_core::openai::{ChatChunk, MAX_STREAMED_INDEX, Usage};
use pgw_core::sse::{SseDecoder, SseEvent};
use tokio::time::{Instant, Sleep};

use crate::error::{MalformedResponse, Watchdog, WatchdogCut};
use crate::settings::after;
use crate::{Timeouts, UpstreamBody};

/// The chunks of a streamed answer as they arrive, decoded from server-sent events.
///
/// Three watchdogs run on tokio's clock while it is polled: no first token within
/// `first_token` of dispatch, a gap longer than `inter_token` between two chunks with
/// output once the answer started (an empty delta sent as a keep-alive does not count),
/// or the attempt running past `total`, each end the stream with a
/// [`WatchdogCut`] error (outcome `Transient`).
///
/// The end is the provider's word that the answer is complete: `data: [DONE]` or the
/// body's end, each after a `finish_reason` for every choice seen (some providers
/// never send `[DONE]`). A stream that ends without a finish reason was cut: it ends with a
/// [`MalformedResponse`], never cleanly on a truncated answer. So do an oversized
/// event and a stream none of whose events parse. A provider's error event ends it
/// with an [`UpstreamStatus`](pgw_core::UpstreamStatus) carrying the provider's error
/// (its status the numeric `code` when there is one, else 502), so its `code` and
/// `type` decide the outcome as in an error answer (a rate limit is pushback, a
/// context window moves on). An event that is not
/// a chunk among chunks that are is skipped and counted ([`ChunkStream::skipped`],
/// metric `pgw_stream_chunks_skipped_total`): the answer goes on. One that names
/// `choices` but cannot be read (broken JSON included, but not half an event: that
/// one is a provider's hiccup, skipped) ends it with a [`MalformedResponse`]: its text
/// would be missing from an answer that looked whole. After the first
/// error or the end the stream yields `None`; dropping it closes the connection.
/// Each chunk keeps its event's payload as [`ChatChunk::raw`].
///
/// A "token" for the first-token and inter-token watchdogs is a chunk carrying output
/// ([`Delta::carries_output`](pgw_core::openai::Delta::carries_output)) or a finish
/// reason: a provider that sends the role chunk at once and then nothing is still cut
/// at `first_token`.
pub struct ChunkStream {
    body: UpstreamBody,
    decoder: SseDecoder,
    /// Fires at or before `due`.
    sleep: Pin<Box<Sleep>>,
    /// When the armed watchdog cuts.
    due: Instant,
    armed: (Watchdog, Duration),
    timeouts: Timeouts,
    start: Instant,
    deadline: Instant,
    first_token_at: Option<Instant>,
    usage: Option<Usage>,
    finished: bool,
    /// Every choice seen finished: the end may come.
    complete: bool,
    /// Per choice index (at most [`MAX_STREAMED_INDEX`]): whether it finished,
    /// `None` before it is seen.
    seen: Vec<Option<bool>>,
    /// Choices seen, and how many of them finished.
    choices: (usize, usize),
    parsed: u64,
    skipped: u64,
    /// Bytes of the body read so far.
    read: usize,
    /// The last poll handed out a chunk: until the next poll, the time is the
    /// consumer's, not the source's.
    delivered: bool,
    /// Scrubbed from the errors the stream ends with (a provider may echo it).
    key: Option<crate::SecretKey>,
}

/// How a provider's error event starts its status's message.
const MID_STREAM: &str = "provider error mid-stream: ";

/// How long the end of a streamed body is read for after `[DONE]`, so its connection
/// can be reused: 1 s.
pub const DRAIN_WAIT: Duration = Duration::from_secs(1);

/// How many bytes after `[DONE]` are read for the same: 64 KiB (a provider that
/// sends more has its connection closed).
pub const DRAIN_BYTES: usize = 64 * 1024;

impl std::fmt::Debug for ChunkStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkStream")
            .field("armed", &self.armed.0)
            .field("ttft", &self.ttft())
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl ChunkStream {
    /// A stream over `body`, an SSE response to a request dispatched at `start`.
    #[must_use]
    pub fn new(body: UpstreamBody, start: Instant, timeouts: Timeouts) -> Self {
        let deadline = after(start, timeouts.total);
        let mut s = Self {
            body,
            decoder: SseDecoder::default(),
            sleep: Box::pin(tokio::time::sleep_until(deadline)),
            due: deadline,
            armed: (Watchdog::Total, timeouts.total),
            timeouts,
            start,
            deadline,
            first_token_at: None,
            usage: None,
            finished: false,
            complete: false,
            seen: Vec::new(),
            choices: (0, 0),
            parsed: 0,
            skipped: 0,
            read: 0,
            delivered: false,
            key: None,
        };
        s.arm(
            after(start, timeouts.first_token),
            Watchdog::FirstToken,
            timeouts.first_token,
        );
        s
    }

    /// Scrubs `key` from the errors the stream ends with: a provider's error event, an
    /// unreadable chunk (both may echo the key the attempt was sent with), as
    /// [`UpstreamClient`](crate::UpstreamClient)'s own streams do. Without it the messages are only
    /// truncated.
    #[must_use]
    pub fn scrubbing(mut self, key: Option<crate::SecretKey>) -> Self {
        self.key = key;
        self
    }

    /// Arms the watchdog to cut at `at` (at the total deadline when that comes first).
    ///
    /// The timer is moved only when the cut comes earlier than it fires: a later cut
    /// (every chunk pushes the inter-token one on) is only noted in `due`, and the
    /// timer, when it fires before it, is moved there then. A timer reset per chunk was
    /// a tenth of a relayed chunk's instructions.
    fn arm(&mut self, at: Instant, watchdog: Watchdog, limit: Duration) {
        self.armed = if at >= self.deadline {
            (Watchdog::Total, self.timeouts.total)
        } else {
            (watchdog, limit)
        };
        self.due = at.min(self.deadline);
        if self.due < self.sleep.deadline() {
            self.sleep.as_mut().reset(self.due);
        }
    }

    /// Notes the choices of a chunk: complete once every choice seen finished. With
    /// several choices (`n > 1`), one finished while another still runs is not the
    /// whole answer: a stream that ends then was cut. A provider that ignores `n` and
    /// streams one choice is whole at its finish reason.
    ///
    /// Noted after the answer looked whole too: a choice first seen then makes it
    /// incomplete again (with `n = 2`, choice 1 starting after choice 0 finished, then
    /// a reset, was taken for a whole answer). Constant time per choice: an event of a
    /// million choices must not hold the executor.
    ///
    /// # Errors
    /// A choice index past [`MAX_STREAMED_INDEX`].
    fn note_choices(&mut self, chunk: &ChatChunk) -> Result<(), BoxError> {
        for c in &chunk.choices {
            let i = usize::try_from(c.index).unwrap_or(usize::MAX);
            if i > MAX_STREAMED_INDEX {
                return Err(MalformedResponse::new(format!(
                    "stream chunk names choice {i} (at most {MAX_STREAMED_INDEX})"
                ))
                .into());
            }
            if self.seen.len() <= i {
                self.seen.resize(i + 1, None);
            }
            let finished = c.finish_reason.is_some();
            match self.seen[i] {
                None => {
                    self.seen[i] = Some(finished);
                    self.choices.0 += 1;
                    self.choices.1 += usize::from(finished);
                }
                Some(false) if finished => {
                    self.seen[i] = Some(true);
                    self.choices.1 += 1;
                }
                Some(_) => {}
            }
        }
        self.complete = self.choices.0 > 0 && self.choices.1 == self.choices.0;
        Ok(())
    }

    /// Time from dispatch to the first token, once it arrived.
    #[must_use]
    pub fn ttft(&self) -> Option<Duration> {
        self.first_token_at.map(|t| t - self.start)
    }

    /// Usage, once a chunk reported it.
    #[must_use]
    pub const fn usage(&self) -> Option<&Usage> {
        self.usage.as_ref()
    }

    /// Events skipped because they were not a chunk, among events that were.
    #[must_use]
    pub const fn skipped(&self) -> u64 {
        self.skipped
    }

    /// When the request was dispatched.
    #[must_use]
    pub const fn started(&self) -> Instant {
        self.start
    }

    /// Ready once the armed cut ([`arm`](Self::arm)) is due.
    fn watchdog(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            ready!(self.sleep.as_mut().poll(cx));
            if self.due <= self.sleep.deadline() {
                return Poll::Ready(());
            }
            // Fired at an earlier cut since pushed on: wait for the new one.
            self.sleep.as_mut().reset(self.due);
        }
    }

    fn fail(&mut self, err: BoxError) -> Poll<Option<Result<ChatChunk, BoxError>>> {
        self.finished = true;
        if self.complete {
            // The answer was whole (a finish reason came): a reset, a stall or an
            // error event before `[DONE]` or the usage chunk ends the stream, it does
            // not cut the answer (a continuation would answer twice).
            tracing::debug!(error = %err, "stream failed after its finish reason: ended");
            return Poll::Ready(None);
        }
        Poll::Ready(Some(Err(err)))
    }

    /// The provider's end: complete only after a finish reason.
    fn end(&mut self, cx: &mut Context<'_>, what: &str) -> Poll<Option<Result<ChatChunk, BoxError>>> {
        if self.complete {
            self.finished = true;
            self.release_connection(cx);
            return Poll::Ready(None);
        }
        let why = if self.parsed == 0 && self.skipped > 0 {
            format!(
                "no stream event was a chat completion chunk ({} skipped)",
                self.skipped
            )
        } else {
            format!("stream ended ({what}) before a finish_reason")
        };
        self.fail(MalformedResponse::new(why).into())
    }

    /// Reads the body to its end after `[DONE]`, so the connection goes back to the
    /// pool: an HTTP/1.1 body dropped before its end (the last chunk of a chunked body
    /// usually comes after `[DONE]`, in a packet of its own) closes its connection,
    /// and every streamed call paid a new connection (TCP, TLS). At once when the end
    /// is already there; otherwise in a task of its own, for at most
    /// [`DRAIN_WAIT`] and [`DRAIN_BYTES`].
    fn release_connection(&mut self, cx: &mut Context<'_>) {
        let mut body = std::mem::take(&mut self.body);
        if body.is_end_stream() {
            return;
        }
        match Pin::new(&mut body).poll_frame(cx) {
            Poll::Ready(None | Some(Err(_))) => return,
            Poll::Ready(Some(Ok(_))) | Poll::Pending => {}
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            let drain = async {
                let mut read = 0;
                while let Some(Ok(frame)) = http_body_util::BodyExt::frame(&mut body).await {
                    read += frame.data_ref().map_or(0, bytes::Buf::remaining);
                    if read > DRAIN_BYTES {
                        return;
                    }
                }
            };
            let _ = tokio::time::timeout(DRAIN_WAIT, drain).await;
        });
    }

    /// `Ok(None)`: an event that is not a chunk, skipped. A chunk keeps `data` as its
    /// [`ChatChunk::raw`] (moved, not copied).
    fn on_data(&mut self, data: String) -> Result<Option<ChatChunk>, BoxError> {
        let mut chunk: ChatChunk = match serde_json::from_str(&data) {
            Ok(c) => c,
            Err(e) => {
                if let Some(status) =
                    crate::client::error_in_answer(data.as_bytes(), self.key.as_ref(), MID_STREAM)
                {
                    return Err(status.into());
                }
                if !e.is_eof() && data.contains("\"choices\"") {
                    // A whole chunk this crate cannot read (choices of another shape, or
                    // a raw control character in a delta, a syntax error): skipped, its
                    // text would be lost from an answer that still looked whole. Half
                    // an event (it ends mid-value: a provider's hiccup, the text going
                    // on in the next chunks) and an event without choices are skipped
                    // below.
                    let msg =
                        crate::client::clean(format!("unreadable stream chunk: {e}"), self.key.as_ref());
                    return Err(MalformedResponse::new(msg).into());
                }
                self.skipped += 1;
                metrics::counter!("pgw_stream_chunks_skipped_total").increment(1);
                let error = crate::client::clean(e.to_string(), self.key.as_ref());
                tracing::debug!(%error, "skipped a stream event that is not a chat completion chunk");
                return Ok(None);
            }
        };
        self.parsed += 1;
        if (chunk.extra.contains_key("error") || chunk.choices.is_empty() && chunk.usage.is_none())
            && let Some(status) =
                crate::client::error_in_answer(data.as_bytes(), self.key.as_ref(), MID_STREAM)
        {
            // OpenRouter sends a mid-stream error with choices too (`finish_reason:
            // "error"`): the answer so far is cut short, never complete.
            return Err(status.into());
        }
        crate::client::ended_in_error(chunk.choices.iter().map(|c| c.finish_reason.as_deref()), "stream")?;
        if chunk.usage.is_some() {
            self.usage.clone_from(&chunk.usage);
        }
        let now = Instant::now();
        let token = chunk
            .choices
            .iter()
            .any(|c| c.delta.carries_output() || c.finish_reason.is_some());
        if self.first_token_at.is_none() && token {
            self.first_token_at = Some(now);
        }
        if !chunk.choices.is_empty() {
            self.note_choices(&chunk)?;
        }
        // Only output pushes the inter-token cut on: a stalled answer whose provider
        // keeps sending empty deltas (`data: {}`, a role-only or `""` delta as a
        // keep-alive) is cut at `inter_token`, not at `total`.
        if self.first_token_at.is_some() && token {
            let limit = self.timeouts.inter_token;
            self.arm(after(now, limit), Watchdog::InterToken, limit);
        }
        chunk.raw = Some(data.into());
        Ok(Some(chunk))
    }
}

impl Stream for ChunkStream {
    type Item = Result<ChatChunk, BoxError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.finished {
            return Poll::Ready(None);
        }
        if std::mem::take(&mut this.delivered) && this.armed.0 == Watchdog::InterToken {
            // The consumer came back after the inter-token limit (a slow client of a
            // passed-through stream: nothing read the body meanwhile). That silence
            // was its own; the source's is counted from now. Cut here, a healthy
            // source was failed for a slow reader.
            let now = Instant::now();
            if now >= this.due {
                let limit = this.timeouts.inter_token;
                this.arm(after(now, limit), Watchdog::InterToken, limit);
            }
        }
        loop {
            match this.decoder.next_event() {
                Some(SseEvent::Done) => return this.end(cx, "[DONE]"),
                Some(SseEvent::Error(data)) => {
                    // `event: error`: the provider's error whatever its data (`data:
                    // Overloaded` was skipped as a chunk that did not parse, and the
                    // stream ended as a plain cut, its message lost).
                    let status = crate::client::error_event(data.as_bytes(), this.key.as_ref(), MID_STREAM);
                    return this.fail(status.into());
                }
                Some(SseEvent::Data(data)) => match this.on_data(data) {
                    Ok(Some(chunk)) => {
                        this.delivered = true;
                        return Poll::Ready(Some(Ok(chunk)));
                    }
                    Ok(None) => continue,
                    Err(e) => return this.fail(e),
                },
                None => {}
            }
            match Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        this.read += data.len();
                        if this.read > crate::client::MAX_ANSWER_BODY {
                            // A streamed answer is bounded as a whole one is: what it
                            // brings is kept (the answer so far, a continuation's text).
                            return this.fail(
                                MalformedResponse::new(format!(
                                    "stream larger than {} bytes",
                                    crate::client::MAX_ANSWER_BODY
                                ))
                                .into(),
                            );
                        }
                        if let Err(e) = this.decoder.feed(&data) {
                            return this.fail(MalformedResponse::new(e.to_string()).into());
                        }
                    }
                }
                Poll::Ready(Some(Err(e))) => return this.fail(e),
                Poll::Ready(None) => {
                    // Ended: never polled again.
                    this.body = UpstreamBody::default();
                    return this.end(cx, "body end without [DONE]");
                }
                Poll::Pending => {
                    ready!(this.watchdog(cx));
                    let (watchdog, limit) = this.armed;
                    return this.fail(WatchdogCut::new(watchdog, limit).into());
                }
            }
        }
    }
}
