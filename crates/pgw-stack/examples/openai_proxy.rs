//! An OpenAI-compatible HTTP server on top of the gateway, streaming included.
//!
//! ```text
//! cargo run -p pgw-stack --example openai_proxy
//! curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \
//!   -d '{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
//! ```
//!
//! The server is `pgw_stack::proxy::router`: a streamed answer is passed through as
//! SSE, each chunk as it arrives, once a source's stream yielded its first output
//! (failures before that are retried elsewhere, unseen).

mod support;

#[tokio::main]
async fn main() -> Result<(), pgw_core::BoxError> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let (gw, _sim) = support::gateway().await?;
    let addr = std::env::var("PGW_LISTEN").unwrap_or_else(|_| "127.0.0.1:8080".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!("OpenAI-compatible proxy on http://{addr}/v1");
    axum::serve(listener, pgw_stack::proxy::router(gw))
        .with_graceful_shutdown(async {
            tokio::signal::ctrl_c().await.ok();
        })
        .await?;
    Ok(())
}
