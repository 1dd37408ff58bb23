//! [`Tail`]: the rest of a streamed answer, passed through to the caller as it
//! arrives, and the verdicts the layers above left for its end.

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use futures_core::Stream;
use pgw_core::openai::{ChatChunk, ChunkAccumulator};
use pgw_core::{BoxError, Settle};

use crate::{AttemptStats, ChatAnswer, ChunkStream};

/// Asks the client to pass a streamed answer through: the attempt is committed when
/// its first chunk with output (text, a tool call, a refusal) arrives, and answers
/// then with a [`ChatAnswer`] whose [`ChatAnswer::tail`] streams the rest.
///
/// Insert it in [`ChatCall::extensions_mut`](crate::ChatCall::extensions_mut). An
/// error event, a keep-alive or a watchdog before that chunk fails the attempt like
/// any other, so the layers above may still try another source invisibly. Without the
/// marker a streamed answer is consumed to its end first (the call can then be
/// retried whole, and validated).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassThrough;

/// The rest of a streamed answer after the chunks in [`ChatAnswer::chunks`].
///
/// Shared by the clones of its answer; [`Tail::take`] hands the stream to one
/// consumer. The layers the answer passed through (breaker, AIMD, health, rate limit,
/// telemetry) judge the attempt when the stream ends: they leave their verdict here
/// ([`Tail::on_end`], called by [`AnswerClassifier`](crate::AnswerClassifier)'s
/// `defer`), and the stream runs them, innermost first, with the final result: the
/// whole answer (its usage included) or the error that cut it. A stream dropped
/// before its end runs none of them: what they hold (slots, leases, probes) is
/// released by their own drop, and the upstream connection is closed.
#[derive(Clone)]
pub struct Tail {
    running: Arc<Mutex<Option<Running>>>,
}

struct Running {
    stream: ChunkStream,
    acc: ChunkAccumulator,
    stats: AttemptStats,
    on_end: Vec<Settle<ChatAnswer, BoxError>>,
}

impl fmt::Debug for Tail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tail")
            .field("taken", &self.lock().is_none())
            .finish_non_exhaustive()
    }
}

impl PartialEq for Tail {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.running, &other.running)
    }
}

impl Tail {
    pub(crate) fn new(stream: ChunkStream, acc: ChunkAccumulator, stats: AttemptStats) -> Self {
        Self {
            running: Arc::new(Mutex::new(Some(Running {
                stream,
                acc,
                stats,
                on_end: Vec::new(),
            }))),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Running>> {
        pgw_core::sync::lock(&self.running)
    }

    /// Leaves `then` to run with the final result when the stream ends. Once the
    /// stream was taken it is too late to be told the end: `then` is dropped unrun.
    pub fn on_end(&self, then: Settle<ChatAnswer, BoxError>) {
        if let Some(r) = self.lock().as_mut() {
            r.on_end.push(then);
        }
    }

    /// Takes the stream of the remaining chunks; `None` once taken.
    #[must_use]
    pub fn take(&self) -> Option<TailStream> {
        self.lock().take().map(|r| TailStream { running: Some(r) })
    }
}

/// The remaining chunks of a passed-through answer, under the attempt's watchdogs.
/// Ends with the attempt's error when it is cut (`WatchdogCut`, a reset, an error
/// event, an end without a finish reason). See [`Tail`].
pub struct TailStream {
    running: Option<Running>,
}

impl fmt::Debug for TailStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TailStream")
            .field("ended", &self.running.is_none())
            .finish_non_exhaustive()
    }
}

impl TailStream {
    /// The text streamed so far by this attempt (the committed chunks included), of the
    /// first choice.
    #[must_use]
    pub fn content_so_far(&self) -> &str {
        self.running.as_ref().map_or("", |r| r.acc.so_far().content())
    }
}

impl Stream for TailStream {
    type Item = Result<ChatChunk, BoxError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let Some(r) = this.running.as_mut() else {
            return Poll::Ready(None);
        };
        let next = ready!(Pin::new(&mut r.stream).poll_next(cx));
        if let Some(Ok(chunk)) = next {
            r.acc.push(&chunk);
            return Poll::Ready(Some(Ok(chunk)));
        }
        let Some(mut r) = this.running.take() else {
            return Poll::Ready(None);
        };
        let mut stats = std::mem::take(&mut r.stats);
        stats.latency = r.stream.started().elapsed();
        stats.ttft = r.stream.ttft();
        let end = match next {
            Some(Err(e)) => Err(e),
            _ => {
                let response = std::mem::take(&mut r.acc).finish();
                stats.usage.clone_from(&response.usage);
                let answer = ChatAnswer {
                    response,
                    chunks: Vec::new(),
                    stats,
                    tail: None,
                    body: None,
                };
                Ok(answer)
            }
        };
        for then in r.on_end.drain(..) {
            then(&end);
        }
        Poll::Ready(end.err().map(Err))
    }
}
