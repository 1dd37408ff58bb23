//! `http_server_request_duration_seconds` (OpenTelemetry's `http.server.request.duration`),
//! by route, method and status, as a tower layer around each route.
//!
//! A tower layer rather than axum's `middleware::from_fn`: it calls the route from
//! `call` and times the future it returns, where `from_fn` clones the route (a boxed
//! service) on every request to move it into an `async fn`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::extract::{MatchedPath, Request};
use axum::http::Method;
use axum::response::Response;
use tokio::time::Instant;
use tower::{Layer, Service};

use crate::routes::CallHandles;

/// Wraps each route in a [`Track`].
#[derive(Clone)]
pub(crate) struct TrackLayer(pub(crate) Arc<CallHandles>);

impl<S> Layer<S> for TrackLayer {
    type Service = Track<S>;

    fn layer(&self, inner: S) -> Track<S> {
        Track {
            inner,
            handles: Arc::clone(&self.0),
        }
    }
}

/// A route whose requests are timed into `http_server_request_duration_seconds`.
#[derive(Clone)]
pub(crate) struct Track<S> {
    inner: S,
    handles: Arc<CallHandles>,
}

impl<S, B> Service<Request<B>> for Track<S>
where
    S: Service<Request<B>, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = TrackFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let route = request.extensions().get::<MatchedPath>().cloned();
        let method = method_label(request.method());
        TrackFuture {
            inner: self.inner.call(request),
            timing: Some(Timing {
                route,
                method,
                started: Instant::now(),
                handles: Arc::clone(&self.handles),
            }),
        }
    }
}

/// The `http_request_method` label: the method when it is one of HTTP's own, else
/// `_OTHER` (OpenTelemetry's rule). hyper accepts any token as a method, and each label
/// value is a series kept for the process's life: a client sending `M1`, `M2`, ...
/// must not grow the metrics without bound.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::HEAD => "HEAD",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "_OTHER",
    }
}

/// What the answer's duration is recorded with.
struct Timing {
    route: Option<MatchedPath>,
    method: &'static str,
    started: Instant,
    handles: Arc<CallHandles>,
}

impl Timing {
    fn record(self, response: &Response) {
        let status = response.status();
        let labels = [
            self.route.as_ref().map_or("unmatched", MatchedPath::as_str),
            self.method,
            status.as_str(),
        ];
        self.handles
            .requests
            .get(labels, |[route, method, status]| {
                metrics::histogram!(
                    "http_server_request_duration_seconds",
                    "http_route" => route.to_owned(),
                    "http_request_method" => method.to_owned(),
                    "http_response_status_code" => status.to_owned(),
                )
            })
            .record(self.started.elapsed().as_secs_f64());
    }
}

pin_project_lite::pin_project! {
    /// The route's future; records the duration when it answers.
    pub(crate) struct TrackFuture<F> {
        #[pin]
        inner: F,
        timing: Option<Timing>,
    }
}

impl<F, E> Future for TrackFuture<F>
where
    F: Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = std::task::ready!(this.inner.poll(cx));
        if let (Ok(response), Some(timing)) = (&result, this.timing.take()) {
            timing.record(response);
        }
        Poll::Ready(result)
    }
}
