//! [`SimService`]: one source of the pool as a tower `Service`.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use pgw_core::BoxError;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep, sleep_until};
use tower_service::Service;

use crate::body::SimBody;
use crate::pool::{AnswerTag, InflightGuard, Inner};

/// One source of a [`SimPool`](crate::SimPool): the virtual provider endpoint.
///
/// Always ready. Each `call` decides the request's fate at once (in arrival order,
/// from the source's seeded RNG) and returns a future that answers on the tokio clock:
/// after the error latency for an error, after TTFT for a stream, after TTFT plus the
/// whole generation for a JSON answer, and never for a black hole. The service never
/// fails: every fault is an HTTP answer (or silence).
#[derive(Clone)]
pub struct SimService {
    pool: Arc<Inner>,
    source: usize,
}

impl fmt::Debug for SimService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimService")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl SimService {
    pub(crate) fn new(pool: Arc<Inner>, source: usize) -> Self {
        Self { pool, source }
    }
}

impl Service<http::Request<Bytes>> for SimService {
    type Response = http::Response<SimBody>;
    type Error = BoxError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Bytes>) -> ResponseFuture {
        self.pool.dispatch(self.source, &req)
    }
}

pin_project! {
    /// The answer of a [`SimService`] call. Dropping it before it resolves counts as
    /// `dropped_before_answer` and ends the request's in-flight accounting.
    pub struct ResponseFuture {
        #[pin]
        sleep: Sleep,
        state: Option<Pending>,
    }
}

struct Pending {
    /// `None`: a black hole, never answered.
    response: Option<http::Response<SimBody>>,
    tag: AnswerTag,
    guard: InflightGuard,
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("deadline", &self.sleep.deadline())
            .field(
                "black_hole",
                &self.state.as_ref().is_some_and(|p| p.response.is_none()),
            )
            .finish()
    }
}

impl ResponseFuture {
    pub(crate) fn black_hole(guard: InflightGuard) -> Self {
        Self {
            sleep: sleep_until(Instant::now()),
            state: Some(Pending {
                response: None,
                tag: AnswerTag::default(),
                guard,
            }),
        }
    }

    pub(crate) fn answer(
        at: Instant,
        response: http::Response<SimBody>,
        tag: AnswerTag,
        guard: InflightGuard,
    ) -> Self {
        Self {
            sleep: sleep_until(at),
            state: Some(Pending {
                response: Some(response),
                tag,
                guard,
            }),
        }
    }
}

impl Future for ResponseFuture {
    type Output = Result<http::Response<SimBody>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        match this.state {
            None => return Poll::Ready(Err("pgw-sim response future polled after completion".into())),
            // A black hole: never woken, never ready; the caller's timeout ends it.
            Some(p) if p.response.is_none() => return Poll::Pending,
            Some(_) => {}
        }
        if this.sleep.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        // The stream's schedule starts when the headers were due, not when we were
        // polled: the provider generates at its own pace.
        let sent_at = this.sleep.deadline();
        let Some(Pending {
            response: Some(mut response),
            tag,
            guard,
        }) = this.state.take()
        else {
            return Poll::Pending;
        };
        guard.pool().record_answer(guard.source(), tag);
        response.body_mut().start(sent_at, guard);
        Poll::Ready(Ok(response))
    }
}
