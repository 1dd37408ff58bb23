//! [`SimBody`]: the body of a simulated answer, whole or streamed on the tokio clock.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pgw_core::BoxError;
use tokio::time::{Instant, Sleep};

use crate::pool::InflightGuard;

/// The body of a simulated answer.
///
/// A JSON answer is one frame. A streamed answer yields its SSE frames on the tokio
/// clock (first frame at once, since the headers were sent at TTFT; then each after
/// its inter-token gap, on a schedule fixed when the headers went out, as a server
/// writing into a socket would). Dropping it before the end counts as a dropped stream
/// (`SourceStats::streams_dropped`) and ends the request's in-flight accounting.
pub struct SimBody {
    inner: Inner,
}

enum Inner {
    Full(Option<Bytes>),
    Stream(Box<StreamState>),
}

struct StreamState {
    frames: VecDeque<(Duration, Bytes)>,
    last: Option<Instant>,
    sleep: Option<Pin<Box<Sleep>>>,
    guard: Option<InflightGuard>,
}

impl fmt::Debug for SimBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Inner::Full(b) => f
                .debug_struct("SimBody")
                .field("len", &b.as_ref().map_or(0, Bytes::len))
                .finish(),
            Inner::Stream(s) => f
                .debug_struct("SimBody")
                .field("frames_left", &s.frames.len())
                .finish(),
        }
    }
}

impl SimBody {
    pub(crate) fn full(bytes: Bytes) -> Self {
        Self {
            inner: Inner::Full(Some(bytes)),
        }
    }

    /// `frames`: the gap before each frame (the first is sent with the headers).
    pub(crate) fn stream(frames: Vec<(Duration, Bytes)>) -> Self {
        Self {
            inner: Inner::Stream(Box::new(StreamState {
                frames: frames.into(),
                last: None,
                sleep: None,
                guard: None,
            })),
        }
    }

    /// Whether this body is streamed.
    #[must_use]
    pub fn is_stream(&self) -> bool {
        matches!(self.inner, Inner::Stream(_))
    }

    /// Starts the stream's schedule at `now` and hands it the request's in-flight
    /// guard; a whole body drops the guard (the request is over).
    pub(crate) fn start(&mut self, now: Instant, mut guard: InflightGuard) {
        match &mut self.inner {
            Inner::Full(_) => guard.done(),
            Inner::Stream(s) => {
                s.last = Some(now);
                guard.streaming();
                s.guard = Some(guard);
            }
        }
    }
}

impl Body for SimBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let s = match &mut self.get_mut().inner {
            Inner::Full(b) => return Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Inner::Stream(s) => s,
        };
        let Some(&(gap, _)) = s.frames.front() else {
            return Poll::Ready(None);
        };
        let last = *s.last.get_or_insert_with(Instant::now);
        let due = last + gap;
        if !gap.is_zero() {
            let sleep = match &mut s.sleep {
                Some(sl) => {
                    if sl.deadline() != due {
                        sl.as_mut().reset(due);
                    }
                    sl
                }
                slot @ None => slot.insert(Box::pin(tokio::time::sleep_until(due))),
            };
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
        s.last = Some(due);
        let Some((_, bytes)) = s.frames.pop_front() else {
            return Poll::Ready(None);
        };
        if s.frames.is_empty() {
            if let Some(mut g) = s.guard.take() {
                g.stream_completed();
            }
            s.sleep = None;
        }
        Poll::Ready(Some(Ok(Frame::data(bytes))))
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Full(b) => b.is_none(),
            Inner::Stream(s) => s.frames.is_empty(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Inner::Stream(s) => SizeHint::with_exact(s.frames.iter().map(|(_, b)| b.len() as u64).sum()),
        }
    }
}
