//! An OpenAI-compatible HTTP front for the gateway: `POST /v1/chat/completions`, JSON
//! or server-sent events, so any OpenAI client (any language) can point its base URL
//! at pgw.
//!
//! A streamed answer is verified first (the attempt runs to `[DONE]` under the
//! watchdogs, so a cut stream can be retried on another source), then replayed as
//! `data: {chunk}\n\n` events ending with `data: [DONE]\n\n`. Errors are OpenAI-style
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

async fn completions(State(gw): State<Gateway>, Json(req): Json<ChatRequest>) -> Response {
    let stream = req.stream;
    let answer = match gw.chat(req).await {
        Ok(a) => a,
        Err(e) => return failure(&e),
    };
    let group = answer.group.clone();
    let source = answer
        .source
        .as_ref()
        .map(ToString::to_string)
        .unwrap_or_default();
    let mut response = if stream {
        let events = answer
            .into_stream()
            .filter_map(|c| async move {
                // A chunk that does not serialize is dropped, never sent as an empty event.
                let json = c.ok().and_then(|c| serde_json::to_string(&c).ok())?;
                Some(Ok::<_, Infallible>(Event::default().data(json)))
            })
            .chain(futures_util::stream::once(async {
                Ok(Event::default().data("[DONE]"))
            }));
        Sse::new(events).into_response()
    } else {
        Json(answer.answer.response).into_response()
    };
    let h = response.headers_mut();
    if let (Ok(g), Ok(s)) = (group.parse(), source.parse()) {
        h.insert("x-pgw-group", g);
        h.insert("x-pgw-source", s);
    }
    response
}
