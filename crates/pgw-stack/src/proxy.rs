//! An OpenAI-compatible HTTP front for the gateway: `POST /v1/chat/completions`, JSON
//! or server-sent events, so any OpenAI client (any language) can point its base URL
//! at pgw.
//!
//! A streamed answer is passed through as `data: {chunk}\n\n` events, each as it
//! arrives, ending with `data: [DONE]\n\n` (see [`crate::ChatStream`]: the call is
//! committed to the first source whose stream yields output; a stream cut after that
//! is continued on a source that accepts an assistant prefill, or ends with an
//! OpenAI-style error event, `data: {"error": {...}}`, and no `[DONE]`). Errors are OpenAI-style
//! JSON bodies: a request every source rejects gets the provider's own status (400,
//! 404 for an unknown model, 413, 422) and error (`message`, `type`, `param`, `code`:
//! `model_not_found`, `context_length_exceeded`, `content_policy_violation`, ...);
//! 429 when the pool pushes back, 502 otherwise. A content filter's verdict or a
//! refusal is an answer (200), passed on as the provider wrote it. `x-pgw-group` and
//! `x-pgw-source` say who answered.
//!
//! ```no_run
//! # async fn run(gateway: pgw_stack::Gateway) -> std::io::Result<()> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, pgw_stack::proxy::router(gateway)).await
//! # }
//! ```

use std::convert::Infallible;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use futures_util::StreamExt;
use pgw_core::openai::ChatRequest;
use pgw_core::{BoxError, Outcome, UpstreamStatus, classify_error};

use crate::Gateway;

/// The router: `POST /v1/chat/completions` on `gateway`.
pub fn router(gateway: Gateway) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(completions))
        .with_state(gateway)
}

fn error(status: StatusCode, message: &str) -> Response {
    let body =
        serde_json::json!({"error": {"message": message, "type": "gateway_error", "code": status.as_u16()}});
    (status, Json(body)).into_response()
}

/// The caller's answer to a failed call. A rejected request is the caller's to fix,
/// so it gets what the provider said: its status and its error, field by field.
fn failure(e: &BoxError) -> Response {
    let outcome = classify_error(&**e);
    let upstream = UpstreamStatus::find(&**e);
    if outcome == Outcome::Rejected
        && let Some(u) = upstream
        && let Some(provider) = u.provider()
    {
        let status = if u.status().is_client_error() {
            u.status()
        } else {
            StatusCode::BAD_REQUEST
        };
        return (status, Json(provider.to_json())).into_response();
    }
    let status = match outcome {
        Outcome::Rejected => StatusCode::BAD_REQUEST,
        Outcome::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
        _ => StatusCode::BAD_GATEWAY,
    };
    error(status, &e.to_string())
}

/// The event that ends a stream cut after the caller saw part of it: an error in
/// OpenAI's shape, so SDKs raise it instead of returning a truncated answer as whole.
fn error_event(e: &BoxError) -> Event {
    let body = serde_json::json!({"error": {"message": e.to_string(), "type": "server_error", "param": null, "code": "stream_cut"}});
    Event::default().data(body.to_string())
}

async fn completions(State(gw): State<Gateway>, Json(req): Json<ChatRequest>) -> Response {
    if req.stream {
        let stream = match gw.chat_stream(req).await {
            Ok(s) => s,
            Err(e) => return failure(&e),
        };
        let (group, source) = (
            stream.group().to_owned(),
            stream.source().map(ToString::to_string),
        );
        // After an error event nothing more is sent: no `[DONE]`.
        let events = stream
            .map(Some)
            .chain(futures_util::stream::once(async { None }))
            .scan(false, |failed, item| {
                let event = match item {
                    _ if *failed => None,
                    Some(Ok(c)) => Some(
                        serde_json::to_string(&c)
                            .map_or_else(|e| error_event(&e.into()), |json| Event::default().data(json)),
                    ),
                    Some(Err(e)) => {
                        *failed = true;
                        Some(error_event(&e))
                    }
                    None => Some(Event::default().data("[DONE]")),
                };
                futures_util::future::ready(event.map(Ok::<_, Infallible>))
            });
        let mut response = Sse::new(events).into_response();
        who_answered(&mut response, &group, source.as_deref().unwrap_or_default());
        return response;
    }
    let answer = match gw.chat(req).await {
        Ok(a) => a,
        Err(e) => return failure(&e),
    };
    let source = answer
        .source
        .as_ref()
        .map(ToString::to_string)
        .unwrap_or_default();
    let group = answer.group.clone();
    let mut response = Json(answer.answer.response).into_response();
    who_answered(&mut response, &group, &source);
    response
}

fn who_answered(response: &mut Response, group: &str, source: &str) {
    let h = response.headers_mut();
    if let (Ok(g), Ok(s)) = (group.parse(), source.parse()) {
        h.insert("x-pgw-group", g);
        h.insert("x-pgw-source", s);
    }
}
