//! The HTTP routes: `POST /v1/chat/completions`, `GET /v1/models`, `GET /healthz`,
//! `GET /readyz`, `GET /metrics`, all on the public `pgw_stack::Gateway` API.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use http_body_util::BodyExt;
use metrics::{Counter, Histogram};
use metrics_exporter_prometheus::PrometheusHandle;
use pgw_core::MetricHandles;
use pgw_core::openai::{ChatRequest, Usage};
use pgw_stack::{BackendKind, Gateway, GatewayConfig};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::trace::{DefaultOnFailure, DefaultOnResponse, TraceLayer};

use crate::auth::{KeyRing, Tenant, TenantPermit};
use crate::config::Settings;
use crate::error::ApiError;
use crate::sse;
use crate::track::TrackLayer;

/// Everything a request handler needs. Cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub(crate) gateway: Gateway,
    pub(crate) keys: Arc<KeyRing>,
    pub(crate) models: Arc<[String]>,
    pub(crate) expose_sources: bool,
    pub(crate) share_cache_across_keys: bool,
    pub(crate) sse_keep_alive: Duration,
    pub(crate) shed_retry_after: Duration,
    pub(crate) body_read_timeout: Duration,
    /// `server.max_body_bytes`.
    pub(crate) max_body_bytes: usize,
    pub(crate) in_flight: Arc<Semaphore>,
    pub(crate) metrics: Option<PrometheusHandle>,
    pub(crate) draining: Arc<AtomicBool>,
    /// Set when a shutdown's grace period is over: each stream still running ends
    /// with an error event (the connections are closed right after).
    pub(crate) grace_over: Arc<tokio::sync::watch::Sender<bool>>,
    pub(crate) redis_backend: bool,
    pub(crate) handles: Arc<CallHandles>,
    /// When `/metrics` last refreshed the gateway's gauges (`None`: never); locked
    /// while one refreshes.
    pub(crate) metrics_refreshed: Arc<tokio::sync::Mutex<Option<tokio::time::Instant>>>,
    /// `/readyz`'s last probe of the backend; locked while one runs.
    pub(crate) readiness: Arc<tokio::sync::Mutex<Option<Probe>>>,
}

/// What a call holds from before its body is read to its answer's end: one of the
/// server's `max_in_flight` slots and, for a key with `max_concurrency`, one of its
/// slots on this process ([`crate::auth::Tenant::local_slot`]).
pub(crate) struct Slot {
    _global: OwnedSemaphorePermit,
    _tenant: Option<OwnedSemaphorePermit>,
}

/// The handles of the series every call updates (see [`MetricHandles`]).
#[derive(Default)]
pub(crate) struct CallHandles {
    /// `http_server_request_duration_seconds` by route, method and status.
    pub(crate) requests: MetricHandles<Histogram, 3>,
    /// `gen_ai_client_operation_duration_seconds` by model and error type.
    duration: MetricHandles<Histogram, 2>,
    /// `pgw_server_calls_total` by tenant and status.
    calls: MetricHandles<Counter, 2>,
    /// `gen_ai_client_token_usage` by token type and model.
    tokens: MetricHandles<Histogram, 2>,
    /// `gen_ai_server_time_to_first_token_seconds` by model.
    pub(crate) first_token: MetricHandles<Histogram, 1>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("gateway", &self.gateway)
            .field("keys", &self.keys)
            .field("models", &self.models)
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// The state of a server over `gateway` (built from `config`) with `settings`,
    /// `keys` and the Prometheus handle rendered by `/metrics`.
    #[must_use]
    pub fn new(
        gateway: Gateway,
        config: &GatewayConfig,
        settings: &Settings,
        keys: KeyRing,
        metrics: Option<PrometheusHandle>,
    ) -> Self {
        Self {
            models: model_names(config).into(),
            gateway,
            keys: Arc::new(keys),
            expose_sources: settings.expose_sources,
            share_cache_across_keys: settings.share_cache_across_keys,
            sse_keep_alive: settings.sse_keep_alive,
            shed_retry_after: settings.shed_retry_after,
            body_read_timeout: settings.body_read_timeout,
            max_body_bytes: settings.max_body_bytes,
            in_flight: Arc::new(Semaphore::new(settings.max_in_flight)),
            metrics,
            draining: Arc::new(AtomicBool::new(false)),
            grace_over: Arc::new(tokio::sync::watch::Sender::new(false)),
            redis_backend: config.backend == BackendKind::Redis,
            handles: Arc::default(),
            metrics_refreshed: Arc::default(),
            readiness: Arc::default(),
        }
    }

    /// Marks the server as draining: `/readyz` answers 503 from now on.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// The answer to a failed call ([`ApiError::from_gateway`]). A 503 whose wait is
    /// not known (the backend unreachable, a stalled call, an exhausted retry budget)
    /// says `Retry-After: shed_retry_after_s`, as the server's own sheds do, so a
    /// client backs off instead of retrying at once.
    pub(crate) fn call_error(&self, e: &pgw_core::BoxError) -> ApiError {
        let mut err = ApiError::from_gateway(e, self.expose_sources);
        if err.status == StatusCode::SERVICE_UNAVAILABLE && err.retry_after.is_none() {
            err.retry_after = Some(self.shed_retry_after);
        }
        err
    }

    /// The label of a model for metrics: the name itself when it is configured,
    /// else `other` (callers choose model names; labels must stay bounded).
    pub(crate) fn model_label(&self, model: &str) -> String {
        if self.models.iter().any(|m| m == model) {
            model.to_owned()
        } else {
            "other".to_owned()
        }
    }
}

/// The request header that bypasses the response cache (`x-pgw-cache: no`, also
/// `bypass`), and the response header that says whether the answer was a cache hit
/// (`x-pgw-cache: hit` or `miss`).
pub(crate) const CACHE_HEADER: &str = "x-pgw-cache";

/// What the cache did for a call, as [`CACHE_HEADER`] tells it: `hit`, `bypass` (the
/// caller said not to use it), `miss`, or `off` (a call the cache is not asked for:
/// not deterministic, or no cache).
pub(crate) fn cache_verdict(hit: bool, bypassed: bool, cacheable: bool) -> HeaderValue {
    HeaderValue::from_static(match (hit, bypassed, cacheable) {
        (true, _, _) => "hit",
        (false, true, _) => "bypass",
        (false, false, true) => "miss",
        (false, false, false) => "off",
    })
}

/// The header naming a request: `req_` and the request's id in decimal, which is also
/// the `id` of its log span and the `call` of its telemetry records (the gateway
/// call's id).
pub(crate) const REQUEST_ID_HEADER: &str = "x-request-id";

/// The id of one request to the server: a random prefix per process (16 bits) and a
/// counter (37 bits, from a random start: 1,000 requests a second for four years
/// before it comes round), so ids from the replicas behind one balancer rarely collide,
/// and every id stays below 2^53, read exactly by any JSON reader of the telemetry
/// (`call`). Every response carries it in
/// [`REQUEST_ID_HEADER`]; the chat call made for the request has it as its call id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RequestId(pub(crate) u64);

impl RequestId {
    pub(crate) fn next() -> Self {
        use std::hash::{BuildHasher, Hasher};
        use std::sync::atomic::AtomicU64;
        const COUNTER: u64 = (1 << 37) - 1;
        // A process-random prefix and starting point (std's hasher keys: random
        // without a dependency), so two processes that draw the same prefix, at once
        // or one after the other's restart, still give out different ids.
        static START: std::sync::LazyLock<(u64, u64)> = std::sync::LazyLock::new(|| {
            let r = std::hash::RandomState::new().build_hasher().finish();
            ((r >> 48) << 37, r & COUNTER)
        });
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let (prefix, start) = *START;
        Self(prefix | (start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) & COUNTER))
    }

    /// `req_` and the id in decimal digits, as the telemetry's `call` writes it.
    fn header(self) -> HeaderValue {
        // Digits written on the stack: one copy into the header, no `String`.
        let mut digits = itoa::Buffer::new();
        let mut buf = [0u8; 4 + 20];
        let text = digits.format(self.0).as_bytes();
        buf[..4].copy_from_slice(b"req_");
        buf[4..4 + text.len()].copy_from_slice(text);
        HeaderValue::from_bytes(&buf[..4 + text.len()]).unwrap_or(HeaderValue::from_static("req_"))
    }
}

/// Gives every request a [`RequestId`] (an extension, for the handlers and the
/// request's log span) and its response the id's header, whatever answered it (a
/// handler, a framework error, a panic caught). A plain layer: nothing is cloned per
/// request.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RequestIdLayer;

impl<S> tower::Layer<S> for RequestIdLayer {
    type Service = WithRequestId<S>;

    fn layer(&self, inner: S) -> WithRequestId<S> {
        WithRequestId { inner }
    }
}

/// The service of [`RequestIdLayer`].
#[derive(Clone, Debug)]
pub(crate) struct WithRequestId<S> {
    inner: S,
}

impl<S, B, RB> tower::Service<http::Request<B>> for WithRequestId<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future = RequestIdFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        let id = RequestId::next();
        request.extensions_mut().insert(id);
        RequestIdFuture {
            inner: self.inner.call(request),
            id,
        }
    }
}

pin_project_lite::pin_project! {
    /// The response future of [`WithRequestId`]: the inner one's, with the id's header.
    pub(crate) struct RequestIdFuture<F> {
        #[pin]
        inner: F,
        id: RequestId,
    }
}

impl<F, E, RB> std::future::Future for RequestIdFuture<F>
where
    F: std::future::Future<Output = Result<http::Response<RB>, E>>,
{
    type Output = Result<http::Response<RB>, E>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let mut response = std::task::ready!(this.inner.poll(cx))?;
        response.headers_mut().insert(REQUEST_ID_HEADER, this.id.header());
        std::task::Poll::Ready(Ok(response))
    }
}

/// A response made outside the router (past the connection cap) with a request id of
/// its own.
pub(crate) fn with_new_request_id(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(REQUEST_ID_HEADER, RequestId::next().header());
    response
}

/// The request header that bounds the call: `x-pgw-timeout-ms: 30000` gives it 30 s
/// from its arrival, for every wait and attempt (the sooner of it and the gateway's
/// `retry.max_call_duration_s`); past it the answer is 504 `deadline_exceeded`.
pub(crate) const TIMEOUT_HEADER: &str = "x-pgw-timeout-ms";

/// The longest call a caller may ask for with [`TIMEOUT_HEADER`]: 24 hours.
const MAX_TIMEOUT_MS: u64 = 24 * 3600 * 1000;

/// The call's own time bound, from [`TIMEOUT_HEADER`]: `None` without the header, a
/// 400 naming it when it is not a whole number of milliseconds from 1 to 24 hours.
fn call_timeout(headers: &HeaderMap) -> Result<Option<Duration>, ApiError> {
    let Some(v) = headers.get(TIMEOUT_HEADER) else {
        return Ok(None);
    };
    // Digits only, no sign and no leading zero: `+100` and `0100` are not how a
    // number of milliseconds is written, and `u64::from_str` took both.
    let ms = v
        .to_str()
        .ok()
        .map(str::trim)
        .filter(|s| s.bytes().all(|b| b.is_ascii_digit()) && !s.starts_with('0'))
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|ms| (1..=MAX_TIMEOUT_MS).contains(ms));
    match ms {
        Some(ms) => Ok(Some(Duration::from_millis(ms))),
        None => {
            let mut e = ApiError::invalid_request(
                "invalid_header",
                format!("{TIMEOUT_HEADER} must be a whole number of milliseconds from 1 to {MAX_TIMEOUT_MS}"),
            );
            e.param = Some(TIMEOUT_HEADER.to_owned());
            Err(e)
        }
    }
}

/// Whether the request asks to bypass the cache (neither read nor stored):
/// [`CACHE_HEADER`] `no`, `bypass` or `no-store`; `yes` or no header uses it. Any other
/// value is a 400 naming the header: an `off` read as "use the cache" would serve what
/// the caller asked not to be served.
fn skips_cache(headers: &HeaderMap) -> Result<bool, ApiError> {
    let Some(v) = headers.get(CACHE_HEADER) else {
        return Ok(false);
    };
    match v.to_str().map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        Ok("no" | "bypass" | "no-store") => Ok(true),
        Ok("yes") => Ok(false),
        _ => {
            let mut e = ApiError::invalid_request(
                "invalid_header",
                format!(
                    "{CACHE_HEADER} must be `no` (or `bypass`, `no-store`) to bypass the cache, or `yes`"
                ),
            );
            e.param = Some(CACHE_HEADER.to_owned());
            Err(e)
        }
    }
}

/// The model names `/v1/models` lists: with `[models]`, the public names (what a caller
/// may ask for; the routes' upstream models are not); without, every group, then every
/// source's own `model`, each once, in config order.
#[must_use]
pub fn model_names(config: &GatewayConfig) -> Vec<String> {
    if !config.models.is_empty() {
        return config.models.keys().cloned().collect();
    }
    let mut out = config.group_order();
    for s in &config.sources {
        if let Some(m) = &s.model
            && !out.contains(m)
        {
            out.push(m.clone());
        }
    }
    out
}

/// The router with every route, limit and error mapping, with a request body limit of
/// `max_body_bytes`.
///
/// Each group of layers is applied as one `ServiceBuilder` stack: every
/// `Router::layer` call boxes each route once more, and a request clones every box
/// below the one it enters, so one call per group saves most of that per request.
/// The layers are tower's kind, which call their inner service from `call`: axum's
/// `middleware::from_fn` and `map_response` clone it (boxes and all) on every request
/// instead, to hand it to an `async fn`.
pub fn router(state: AppState, max_body_bytes: usize) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .layer(
            ServiceBuilder::new()
                // The body limited as it is read (a chunked body past the limit is a
                // 413 there); a `Content-Length` past it is refused by the handler once
                // the key is checked (tower-http's layer answered 413 before the 401).
                .map_request(move |r: Request<_>| {
                    r.map(|b| Body::new(http_body_util::Limited::new(b, max_body_bytes)))
                })
                .layer(DefaultBodyLimit::disable()),
        );
    Router::new()
        .merge(api)
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .fallback(|| async { ApiError::of_status(StatusCode::NOT_FOUND) })
        .method_not_allowed_fallback(|| async { ApiError::of_status(StatusCode::METHOD_NOT_ALLOWED) })
        .layer(
            ServiceBuilder::new()
                .layer(RequestIdLayer)
                .layer(
                    TraceLayer::new_for_http()
                        .make_span_with(|r: &Request| {
                            let id = r.extensions().get::<RequestId>().map_or(0, |i| i.0);
                            tracing::info_span!(
                                "request",
                                method = %r.method(),
                                uri = %r.uri(),
                                version = ?r.version(),
                                id,
                            )
                        })
                        .on_response(DefaultOnResponse::new().level(tracing::Level::INFO))
                        // Every 5xx is a "failure" to tower-http, logged at ERROR: a shed
                        // 503 or an upstream's 502 is not the server's error, and the
                        // handlers log their own failures (warn) already.
                        .on_failure(DefaultOnFailure::new().level(tracing::Level::DEBUG)),
                )
                .layer(CatchPanicLayer::custom(|_| {
                    ApiError::of_status(StatusCode::INTERNAL_SERVER_ERROR).into_response()
                }))
                .map_response(as_openai_error)
                .layer(TrackLayer(Arc::clone(&state.handles))),
        )
        // Behind one Arc: a handler's `State` is a clone of it on every request.
        .with_state(Arc::new(state))
}

/// Reads the whole request body within `body_read_timeout` of its headers, before
/// anything else is done with the request: a client trickling its body is answered
/// 408 and its connection closed then, before the call costs an attempt (hyper's
/// header read timeout only covers the head). A body over the limit (tower-http's
/// `Limited` in the router) is a 413.
async fn read_body(state: &AppState, body: Body) -> Result<Bytes, Response> {
    body_read(state, async move {
        body.collect().await.map(http_body_util::Collected::to_bytes)
    })
    .await
}

/// Reads `body` to its end, keeping nothing.
async fn drain(mut body: Body) -> Result<(), axum::Error> {
    while let Some(frame) = body.frame().await {
        drop(frame?);
    }
    Ok(())
}

/// A body read (`read`) within the body read timeout: a 413 past the body limit, a 400
/// for a body that cannot be read, a 408 (closing the connection) when it is too slow.
async fn body_read<T>(
    state: &AppState,
    read: impl std::future::Future<Output = Result<T, axum::Error>>,
) -> Result<T, Response> {
    match tokio::time::timeout(state.body_read_timeout, read).await {
        Ok(Ok(read)) => Ok(read),
        Ok(Err(e)) => Err({
            let too_large = crate::error::find::<http_body_util::LengthLimitError>(&e).is_some();
            if too_large {
                ApiError::of_status(StatusCode::PAYLOAD_TOO_LARGE).into_response()
            } else {
                ApiError::invalid_request("invalid_body", "the request body could not be read")
                    .into_response()
            }
        }),
        Err(_) => {
            let mut response = ApiError::of_status(StatusCode::REQUEST_TIMEOUT).into_response();
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            Err(response)
        }
    }
}

/// Any error answer that is not JSON yet (a layer's 413, the framework's 405) becomes
/// the OpenAI shape for its status; its headers (`Retry-After`, `Allow`) stay.
fn as_openai_error(response: Response) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (mut parts, _) = response.into_parts();
    let fresh = ApiError::of_status(status).into_response();
    let (fresh_parts, body) = fresh.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    if let Some(v) = fresh_parts.headers.get(crate::error::SHOULD_RETRY_HEADER) {
        parts.headers.insert(crate::error::SHOULD_RETRY_HEADER, v.clone());
    }
    parts.headers.insert(
        header::CONTENT_TYPE,
        fresh_parts
            .headers
            .get(header::CONTENT_TYPE)
            .cloned()
            .unwrap_or(HeaderValue::from_static("application/json")),
    );
    Response::from_parts(parts, body)
}

/// A 413 for a body whose `Content-Length` is past `max_body_bytes`, before it is read.
fn declared_too_large(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(n) if n > state.max_body_bytes as u64 => Err(ApiError::of_status(StatusCode::PAYLOAD_TOO_LARGE)),
        _ => Ok(()),
    }
}

/// The tenant of the request: `Ok(None)` when no keys are configured.
fn authenticate(state: &AppState, headers: &HeaderMap) -> Result<Option<Arc<Tenant>>, ApiError> {
    if state.keys.is_empty() {
        return Ok(None);
    }
    state.keys.authenticate(headers).map(Some).ok_or_else(|| {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_api_key",
            "missing or unknown API key: send `Authorization: Bearer <key>`",
        )
    })
}

fn rejection(r: &JsonRejection) -> ApiError {
    match r.status() {
        StatusCode::UNSUPPORTED_MEDIA_TYPE | StatusCode::PAYLOAD_TOO_LARGE => ApiError::of_status(r.status()),
        StatusCode::UNPROCESSABLE_ENTITY => ApiError::invalid_request("invalid_request", r.body_text()),
        _ => ApiError::invalid_request("invalid_json", r.body_text()),
    }
}

/// What one call's bookkeeping needs after the handler returned (streams).
pub(crate) struct CallMetrics {
    pub(crate) tenant: Arc<str>,
    pub(crate) model: String,
    pub(crate) started: Instant,
    pub(crate) handles: Arc<CallHandles>,
    /// Whether the end was recorded; dropped before that, the client went away.
    pub(crate) recorded: bool,
}

/// The status label of a call whose client went away before its end (nginx's 499,
/// "client closed request"); its `error_type` is `cancelled`.
const CANCELLED_STATUS: &str = "499";

impl CallMetrics {
    /// The metrics of a call of `tenant` (`anonymous` without one) naming `model` (its
    /// label: [`AppState::model_label`]), started now.
    fn new(state: &AppState, tenant: Option<&Tenant>, model: String) -> Self {
        Self {
            recorded: false,
            tenant: tenant.map_or_else(|| Arc::from("anonymous"), |t| Arc::clone(&t.label)),
            model,
            started: Instant::now(),
            handles: Arc::clone(&state.handles),
        }
    }

    /// Records the end of the call: `gen_ai_client_operation_duration_seconds` and
    /// `pgw_server_calls_total`.
    pub(crate) fn finish(&mut self, error: Option<&ApiError>) {
        let error_type = crate::error::code_label(error.and_then(|e| e.code.as_deref()));
        let status = error.map_or(StatusCode::OK, |e| e.status);
        self.record(status.as_str(), error_type);
    }

    fn record(&mut self, status: &str, error_type: &str) {
        self.recorded = true;
        self.handles
            .duration
            .get([&self.model, error_type], |[model, error_type]| {
                metrics::histogram!(
                    "gen_ai_client_operation_duration_seconds",
                    "gen_ai_operation_name" => "chat",
                    "gen_ai_request_model" => model.to_owned(),
                    "error_type" => error_type.to_owned(),
                )
            })
            .record(self.started.elapsed().as_secs_f64());
        self.handles
            .calls
            .get([&self.tenant, status], |[tenant, status]| {
                metrics::counter!("pgw_server_calls_total", "tenant" => tenant.to_owned(), "status" => status.to_owned())
            })
            .increment(1);
    }

    /// Records token usage: `gen_ai_client_token_usage`.
    pub(crate) fn tokens(&self, usage: &Usage) {
        #[allow(clippy::cast_precision_loss)]
        for (kind, n) in [
            ("input", usage.prompt_tokens),
            ("output", usage.completion_tokens),
        ] {
            self.handles
                .tokens
                .get([kind, &self.model], |[kind, model]| {
                    metrics::histogram!(
                        "gen_ai_client_token_usage",
                        "gen_ai_token_type" => kind.to_owned(),
                        "gen_ai_request_model" => model.to_owned(),
                    )
                })
                .record(n as f64);
        }
    }
}

impl Drop for CallMetrics {
    /// A call dropped before its end was recorded: the client closed the connection
    /// (a stopped stream, a timed-out client). Counted, so such calls do not vanish
    /// from the call metrics.
    fn drop(&mut self) {
        if !self.recorded {
            self.record(CANCELLED_STATUS, "cancelled");
        }
    }
}

/// The chat request in `body`, as axum's `Json` extractor reads it.
///
/// A body sent with a JSON content type (`application/json`, with parameters such as
/// `; charset=utf-8` or not, or `application/*+json`, as `Json` takes them) is parsed
/// with serde_json alone, under the server's own body limit. Any other content type is
/// refused by `Json` itself, for its rejection (415), without the body: `Json` run
/// on the body applied axum's own 2 MiB limit, and a 3 MB request sent as
/// `application/json; charset=utf-8` was a 413 where plain `application/json` passed.
async fn chat_request(headers: &HeaderMap, body: Bytes) -> Result<ChatRequest, ApiError> {
    let content_type = headers.get(header::CONTENT_TYPE);
    if content_type.is_some_and(|v| is_json(v.as_bytes())) {
        return parse_chat(&body);
    }
    // `Json` looks at the content type before the body: an empty one is enough.
    let mut request = Request::new(Body::empty());
    if let Some(v) = content_type {
        request.headers_mut().insert(header::CONTENT_TYPE, v.clone());
    }
    match Json::<ChatRequest>::from_request(request, &()).await {
        // Not reached: `Json` takes the content types `is_json` takes.
        Ok(_) => parse_chat(&body),
        Err(r) => Err(rejection(&r)),
    }
}

/// A JSON content type as axum's `Json` takes it: `application/json` or
/// `application/<anything>+json`, any parameters after `;`, any case.
fn is_json(content_type: &[u8]) -> bool {
    let essence = content_type
        .split(|b| *b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii()
        .to_ascii_lowercase();
    essence == b"application/json"
        || essence
            .strip_prefix(b"application/")
            .is_some_and(|sub| sub.len() > b"+json".len() && sub.ends_with(b"+json"))
}

/// A chat request from a JSON body, or the 400 a client can act on: `invalid_json`
/// with the line and column of the syntax error, or `invalid_request` naming the
/// field in `param` (`max_tokens`, `messages[0].content`), never serde's own type
/// names ("expected struct ChatRequest").
fn parse_chat(body: &[u8]) -> Result<ChatRequest, ApiError> {
    // The path is tracked only to name what is wrong: a wrapper on every value of the
    // body costs a valid request about 2,300 instructions (callgrind). Read as text
    // checked once: `from_slice` checks each string's UTF-8 on its own.
    if let Some(request) = pgw_core::openai::from_json_bytes(body) {
        return Ok(request);
    }
    let syntax = |e: &serde_json::Error| {
        ApiError::invalid_request(
            "invalid_json",
            format!(
                "the body is not valid JSON (line {} column {}): {}",
                e.line(),
                e.column(),
                json_reason(e)
            ),
        )
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    let request = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let at = format!("line {} column {}", inner.line(), inner.column());
        if inner.is_syntax() || inner.is_eof() {
            return syntax(&inner);
        }
        // A missing field is named by its message, under the path of its object.
        let missing = json_reason(&inner)
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split_once('`'))
            .map(|(name, _)| name.to_owned());
        let path = match (missing, path.as_str()) {
            (Some(name), ".") => name,
            (Some(name), _) => format!("{path}.{name}"),
            (None, _) => path,
        };
        let mut err = if path == "." {
            ApiError::invalid_request(
                "invalid_request",
                format!(
                    "the body must be a chat completion request, a JSON object ({at}): {}",
                    json_reason(&inner)
                ),
            )
        } else {
            ApiError::invalid_request("invalid_request", format!("`{path}`: {}", json_reason(&inner)))
        };
        err.param = (path != ".").then_some(path);
        err
    })?;
    de.end().map_err(|e| syntax(&e))?;
    Ok(request)
}

/// serde_json's message without its position (said apart) and without the Rust type
/// names it may carry (`expected struct ChatRequest` says nothing to a client).
fn json_reason(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let text = text
        .rsplit_once(" at line ")
        .map_or(text.as_str(), |(head, _)| head);
    match text.split_once(", expected struct ") {
        Some((head, _)) => format!("{head}, expected an object"),
        None => text.to_owned(),
    }
}

/// The answer of a call the shutdown's grace period ended before anything of it was
/// sent: 503 `shutting_down` with `Retry-After`. The tenant stays charged its estimate
/// (the provider may have run the request).
pub(crate) async fn cut_before_answer(mut metrics: CallMetrics, permit: Option<TenantPermit>) -> Response {
    let err = ApiError::shutting_down("the call was cut before its answer");
    tracing::warn!(tenant = %metrics.tenant, "call cut at the end of the shutdown grace period");
    metrics.finish(Some(&err));
    if let Some(p) = permit {
        p.finish(None).await;
    }
    err.into_response()
}

async fn chat(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let headers = &parts.headers;
    // The key first, from the headers alone: a client without one is answered 401
    // before its body is read (it cannot hold `max_body_bytes` per connection for the
    // body read timeout).
    let tenant = match authenticate(&state, headers) {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = declared_too_large(&state, headers) {
        return e.into_response();
    }
    // Counted from the request's arrival: the body read and every wait are in it.
    let deadline = match call_timeout(headers) {
        Ok(t) => t.and_then(|t| tokio::time::Instant::now().checked_add(t)),
        Err(e) => return e.into_response(),
    };
    let no_cache = match skips_cache(headers) {
        Ok(skip) => skip,
        Err(e) => return e.into_response(),
    };
    // The key's own slot on this process first (its `max_concurrency`), so a key
    // whose bodies trickle in holds no more of the server's slots than its quota.
    let tenant_slot = match tenant.as_deref().map(|t| t.local_slot(state.shed_retry_after)) {
        Some(Err(e)) => {
            // The model is not read yet: counted as `other`.
            let err = state.call_error(&e);
            CallMetrics::new(&state, tenant.as_deref(), "other".to_owned()).finish(Some(&err));
            return err.into_response();
        }
        Some(Ok(s)) => s,
        None => None,
    };
    // Taken before the body is read, and held until the answer is complete (for a
    // stream: its last event), so streams count as in flight (tower's concurrency
    // limit would free the slot at the headers) and the bodies held in memory at once
    // are at most `max_in_flight` (not `max_connections`) times `max_body_bytes`.
    let Ok(global) = Arc::clone(&state.in_flight).try_acquire_owned() else {
        metrics::counter!("pgw_server_shed_total", "reason" => "in_flight").increment(1);
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "overloaded",
            "too many requests in flight; retry shortly",
        )
        .retry_after(Some(state.shed_retry_after))
        .into_response();
    };
    let slot = Slot {
        _global: global,
        _tenant: tenant_slot,
    };
    let body = match read_body(&state, body).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let request = match chat_request(headers, body).await {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let mut call = CallMetrics::new(&state, tenant.as_deref(), state.model_label(&request.model));
    if let Some(t) = &tenant
        && !t.may_use(&request.model)
    {
        // Counted as the gateway's own `model_not_found` is (it was not).
        let err = model_not_found(&request.model);
        call.finish(Some(&err));
        return err.into_response();
    }
    let permit = match &tenant {
        Some(t) => match t.admit(&request).await {
            Ok(p) => p,
            Err(e) => {
                let err = state.call_error(&e);
                call.finish(Some(&err));
                return err.into_response();
            }
        },
        None => None,
    };
    let mut chat_call = pgw_stack::ChatCall::new(request);
    if let Some(id) = parts.extensions.get::<RequestId>() {
        chat_call = chat_call.with_call_id(pgw_stack::client::CallId(id.0));
    }
    if let Some(at) = deadline {
        chat_call
            .extensions_mut()
            .insert(pgw_stack::retry::CallDeadline(at));
    }
    if no_cache {
        chat_call.extensions_mut().insert(pgw_stack::NoCache);
    }
    if let Some(allowed) = tenant.as_deref().and_then(Tenant::allowed_models) {
        chat_call.extensions_mut().insert(allowed);
    }
    if let Some(t) = &tenant
        && !state.share_cache_across_keys
    {
        chat_call
            .extensions_mut()
            .insert(pgw_stack::CachePartition(Arc::clone(&t.label)));
    }
    let cached = state.gateway.caches(&chat_call);
    if chat_call.is_stream() {
        return sse::respond(&state, chat_call, permit, slot, call, (no_cache, cached)).await;
    }
    let mut grace = state.grace_over.subscribe();
    let result = tokio::select! {
        // The answer first: one ready with the grace's end is still given.
        biased;
        result = tower::ServiceExt::oneshot(state.gateway.clone(), chat_call) => result,
        () = crate::sse::grace_over(&mut grace) => {
            // The upstream call is dropped (cancelled, its slots given back), and the
            // caller answered, not reset when the connection is closed a moment later.
            drop(slot);
            return cut_before_answer(call, permit).await;
        }
    };
    drop(slot);
    match result {
        Ok(mut answer) => {
            let usage = answer.answer.response.usage.clone();
            if let Some(u) = &usage {
                call.tokens(u);
            }
            if let Some(p) = permit {
                p.finish(usage.as_ref().and_then(Usage::charged)).await;
            }
            call.finish(None);
            // The provider's body as it came, when there is one: byte for byte, and no
            // second serialization (a cache hit is serialized from the stored answer).
            let mut response = match answer.answer.body.take() {
                Some(body) => (
                    [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
                    body,
                )
                    .into_response(),
                None => Json(&answer.answer.response).into_response(),
            };
            let h = response.headers_mut();
            h.insert(CACHE_HEADER, cache_verdict(answer.cache_hit, no_cache, cached));
            if let Ok(g) = HeaderValue::from_str(&answer.group) {
                h.insert("x-pgw-group", g);
            }
            if state.expose_sources
                && let Some(s) = answer.source.as_ref()
                && let Ok(v) = HeaderValue::from_str(s.as_str())
            {
                h.insert("x-pgw-source", v);
            }
            response
        }
        Err(e) => {
            let err = state.call_error(&e);
            tracing::warn!(tenant = %call.tenant, status = err.status.as_u16(), code = ?err.code, error = %e, "call failed");
            call.finish(Some(&err));
            if let Some(p) = permit {
                p.failed(&e).await;
            }
            err.into_response()
        }
    }
}

async fn models(State(state): State<Arc<AppState>>, request: Request) -> Response {
    match visible_models(&state, request).await {
        Ok(names) => {
            let data: Vec<serde_json::Value> = names.iter().map(|id| model_object(id)).collect();
            Json(serde_json::json!({"object": "list", "data": data})).into_response()
        }
        Err(refused) => refused,
    }
}

/// `GET /v1/models/{id}` (the SDKs' `models.retrieve`): the model's object when the
/// caller may see it, else 404 `model_not_found`, as a chat call naming it would get.
async fn model(
    State(state): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
    request: Request,
) -> Response {
    match visible_models(&state, request).await {
        Ok(names) if names.contains(&id) => Json(model_object(&id)).into_response(),
        Ok(_) => model_not_found(&id).into_response(),
        Err(refused) => refused,
    }
}

/// The 404 of a model the caller may not name: one the gateway does not serve, or its
/// key may not use (the two are not told apart: a key learns nothing of others').
fn model_not_found(model: &str) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "model_not_found",
        format!("the model `{model}` does not exist or this key may not use it"),
    );
    e.param = Some("model".to_owned());
    e
}

/// One model in the OpenAI list's shape.
fn model_object(id: &str) -> serde_json::Value {
    serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "pgw"})
}

/// The models the caller may see: its key's, else every model the gateway lists; or
/// the refusal (authentication, the body's limits).
async fn visible_models(state: &AppState, request: Request) -> Result<Vec<String>, Response> {
    let (parts, body) = request.into_parts();
    let tenant = authenticate(state, &parts.headers).map_err(IntoResponse::into_response)?;
    declared_too_large(state, &parts.headers).map_err(IntoResponse::into_response)?;
    // Read and thrown away frame by frame: this route holds no in-flight slot, so it
    // keeps none of a body (a body is read at all so the connection stays reusable).
    body_read(state, drain(body)).await?;
    Ok(match &tenant {
        Some(t) if !t.models().is_empty() => t.models().to_vec(),
        _ => state.models.to_vec(),
    })
}

async fn healthz() -> Response {
    healthy()
}

/// The answer of `/healthz`: the process is up (also past the connection cap).
pub(crate) fn healthy() -> Response {
    Json(serde_json::json!({"status": "ok"})).into_response()
}

/// A probe of the backend by `/readyz`: when, and what was wrong (`None`: ready).
pub(crate) type Probe = (tokio::time::Instant, Option<String>);

/// The least time between two probes of the backend by `/readyz`: 1 s. `/readyz` needs
/// no key and is never shed: probes closer together than this, or while one runs,
/// get its answer, so a client looping on it makes at most one Redis round trip a
/// second per process (before, one per request).
const READY_PROBE_EVERY: Duration = Duration::from_secs(1);

/// Ready when not draining and, on the Redis backend, the backend answers (one read of
/// the first source's limiter state, at most 2 s, at most once per
/// [`READY_PROBE_EVERY`]).
async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    if state.draining.load(Ordering::Relaxed) {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "draining",
            "shutting down",
        )
        .into_response();
    }
    if state.redis_backend
        && let Some(h) = state.gateway.sources().first()
    {
        let mut last = state.readiness.lock().await;
        let why = match &*last {
            Some((at, why)) if at.elapsed() < READY_PROBE_EVERY => why.clone(),
            _ => {
                let probe = tokio::time::timeout(Duration::from_secs(2), h.limiter.held()).await;
                let why = match probe {
                    Ok(Ok(_)) => None,
                    Ok(Err(e)) => Some(e.to_string()),
                    Err(_) => Some("no answer within 2 s".to_owned()),
                };
                if let Some(why) = &why {
                    // The probe's caller hears only "unreachable"; the log says why
                    // (the error names the redacted target).
                    tracing::warn!(error = %why, "readyz: the shared-state backend is unreachable");
                }
                *last = Some((tokio::time::Instant::now(), why.clone()));
                why
            }
        };
        drop(last);
        if why.is_some() {
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "backend_unavailable",
                "the shared-state backend is unreachable",
            )
            .into_response();
        }
    }
    Json(serde_json::json!({"status": "ready"})).into_response()
}

/// How long a scrape waits for the gateway's gauges to be refreshed before it answers
/// with the ones it has: 2 s (as `/readyz`'s probe), under Prometheus's default scrape
/// timeout (10 s).
const METRICS_REFRESH_TIMEOUT: Duration = Duration::from_secs(2);

/// The least time between two refreshes of the gateway's gauges: 1 s. `/metrics` needs
/// no key and answers past the connection cap, and on the Redis backend a refresh is a
/// round trip per route: scrapes closer together than this (or while one refreshes)
/// answer the gauges as they are.
const METRICS_REFRESH_EVERY: Duration = Duration::from_secs(1);

/// Prometheus text; the gateway's gauges (breaker state, AIMD limit, health, inflight,
/// quota) are refreshed first, at most once per [`METRICS_REFRESH_EVERY`] and for at
/// most [`METRICS_REFRESH_TIMEOUT`].
async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    let Some(handle) = &state.metrics else {
        return ApiError::of_status(StatusCode::NOT_FOUND).into_response();
    };
    if let Ok(mut last) = state.metrics_refreshed.try_lock()
        && last.is_none_or(|at| at.elapsed() >= METRICS_REFRESH_EVERY)
    {
        if tokio::time::timeout(METRICS_REFRESH_TIMEOUT, state.gateway.refresh_metrics())
            .await
            .is_err()
        {
            tracing::warn!("/metrics: the gauges' refresh took over 2 s; answered without it");
        }
        *last = Some(tokio::time::Instant::now());
    }
    handle.run_upkeep();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        handle.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Request ids are distinct, below 2^53 (exact in any JSON reader), share their
    /// process's prefix, and read `req_` and the id in decimal.
    #[test]
    fn request_ids_are_unique_json_safe_and_well_formed() {
        let ids: Vec<RequestId> = (0..1000).map(|_| RequestId::next()).collect();
        let distinct: std::collections::HashSet<u64> = ids.iter().map(|i| i.0).collect();
        assert_eq!(distinct.len(), ids.len());
        assert!(ids.iter().all(|i| i.0 < 1 << 53));
        assert!(
            ids.iter().all(|i| i.0 >> 37 == ids[0].0 >> 37),
            "one prefix per process"
        );
        for id in [RequestId(0), RequestId(7), RequestId((1 << 53) - 1), ids[0]] {
            assert_eq!(id.header().to_str().unwrap(), format!("req_{}", id.0));
        }
    }

    #[test]
    fn the_cache_bypass_header_is_read_case_and_space_blind() {
        let with = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(CACHE_HEADER, HeaderValue::from_static(v));
            skips_cache(&h).map_err(|e| e.param)
        };
        assert!(with("no").unwrap() && with(" Bypass ").unwrap() && with("no-store").unwrap());
        assert!(!with("yes").unwrap() && !skips_cache(&HeaderMap::new()).unwrap());
        assert_eq!(
            with("off"),
            Err(Some(CACHE_HEADER.to_owned())),
            "not read as `yes`"
        );
    }

    #[test]
    fn a_json_content_type_is_read_as_axum_reads_it() {
        for yes in [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
            " application/json ;charset=UTF-8",
            "application/vnd.api+json",
            "application/merge-patch+json; x=y",
        ] {
            assert!(is_json(yes.as_bytes()), "{yes}");
        }
        for no in [
            "",
            "text/plain",
            "application/jsonx",
            "application/+json",
            "text/json",
            "application/json-seq",
            "json",
        ] {
            assert!(!is_json(no.as_bytes()), "{no}");
        }
    }

    #[test]
    fn models_lists_the_public_names_when_routing_is_configured() {
        let plain = GatewayConfig::from_toml_str(
            "[[sources]]\nname = \"s1\"\nbase_url = \"http://127.0.0.1:9/v1\"\nkey = \"k\"\nmodel = \"gpt-4o\"\n",
        )
        .unwrap();
        assert_eq!(model_names(&plain), ["default", "gpt-4o"]);
        let routed = GatewayConfig::from_toml_str(
            "[[sources]]\nname = \"s1\"\nbase_url = \"http://127.0.0.1:9/v1\"\nkey = \"k\"\n\n\
             [models.chat]\nroutes = [{ source = \"s1\", model = \"gpt-4o-2024-08-06\" }]\n",
        )
        .unwrap();
        assert_eq!(model_names(&routed), ["chat"]);
    }
}
