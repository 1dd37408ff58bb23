//! An axum handler calling the gateway.
//!
//! ```text
//! cargo run -p pgw-examples --example axum_app
//! curl -s localhost:3000/ask -H 'content-type: application/json' -d '{"question":"hello"}'
//! ```
//!
//! With `PGW_CONFIG=gateway.toml` it uses your sources; without, a simulated provider.

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use pgw_core::openai::ChatRequest;
use pgw_stack::Gateway;
use serde::{Deserialize, Serialize};

#[derive(Deserialize)]
struct Ask {
    question: String,
}

#[derive(Serialize)]
struct Answer {
    answer: String,
    group: String,
    source: Option<String>,
    cache_hit: bool,
}

async fn ask(State(gw): State<Gateway>, Json(ask): Json<Ask>) -> Result<Json<Answer>, (StatusCode, String)> {
    let a = gw
        .chat(ChatRequest::user("gpt-4o-mini", ask.question))
        .await
        .map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))?;
    Ok(Json(Answer {
        answer: a.content().to_owned(),
        group: a.group,
        source: a.source.map(|s| s.to_string()),
        cache_hit: a.cache_hit,
    }))
}

#[tokio::main]
async fn main() -> Result<(), pgw_core::BoxError> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let (gw, _sim) = pgw_examples::gateway().await?;
    let app = Router::new().route("/ask", post(ask)).with_state(gw);
    let addr = std::env::var("PGW_LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!("listening on http://{addr}/ask");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            tokio::signal::ctrl_c().await.ok();
        })
        .await?;
    Ok(())
}
