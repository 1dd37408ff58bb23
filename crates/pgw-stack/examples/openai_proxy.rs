//! An OpenAI-compatible HTTP server on top of the gateway, streaming included.
//!
//! ```text
//! cargo run -p pgw-stack --example openai_proxy
//! curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \
//!   -d '{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
//! ```
//!
//! A streamed answer is verified first (the attempt runs to `[DONE]` under the
//! watchdogs, so a cut stream can be retried elsewhere), then replayed as SSE.

mod support;

use std::convert::Infallible;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use futures_util::StreamExt;
use pgw_core::openai::ChatRequest;
use pgw_core::{Outcome, classify_error};
use pgw_stack::Gateway;

fn error(status: StatusCode, message: &str) -> Response {
    let body =
        serde_json::json!({"error": {"message": message, "type": "gateway_error", "code": status.as_u16()}});
    (status, Json(body)).into_response()
}

async fn completions(State(gw): State<Gateway>, Json(req): Json<ChatRequest>) -> Response {
    let stream = req.stream;
    let answer = match gw.chat(req).await {
        Ok(a) => a,
        Err(e) => {
            let status = match classify_error(&*e) {
                Outcome::Rejected => StatusCode::BAD_REQUEST,
                Outcome::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
                _ => StatusCode::BAD_GATEWAY,
            };
            return error(status, &e.to_string());
        }
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
            .map(|c| {
                let json = c
                    .ok()
                    .and_then(|c| serde_json::to_string(&c).ok())
                    .unwrap_or_default();
                Ok::<_, Infallible>(Event::default().data(json))
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

#[tokio::main]
async fn main() -> Result<(), pgw_core::BoxError> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let (gw, _sim) = support::gateway().await?;
    let app = Router::new()
        .route("/v1/chat/completions", post(completions))
        .with_state(gw);
    let addr = std::env::var("PGW_LISTEN").unwrap_or_else(|_| "127.0.0.1:8080".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!("OpenAI-compatible proxy on http://{addr}/v1");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            tokio::signal::ctrl_c().await.ok();
        })
        .await?;
    Ok(())
}
