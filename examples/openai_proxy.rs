//! An OpenAI-compatible server on top of the gateway: `pgw-server`, the library behind
//! the `pgw` binary, over the simulated provider (or `PGW_CONFIG`'s sources).
//!
//! ```text
//! cargo run -p pgw-examples --example openai_proxy
//! curl -s localhost:8080/v1/chat/completions -H 'content-type: application/json' \
//!   -d '{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
//! ```
//!
//! Everything `pgw serve` does is here (SSE streaming with keep-alive comments,
//! OpenAI-shaped errors, `/v1/models`, `/metrics`, `/healthz`, `/readyz`, graceful
//! shutdown on Ctrl-C); `PGW_LISTEN` changes the address. To deploy, use the binary:
//! `cargo install --path crates/pgw-server`, then `pgw serve --config pgw.toml`.

use pgw_server::{Server, ServerConfig, ServerSection};

#[tokio::main]
async fn main() -> Result<(), pgw_core::BoxError> {
    pgw_server::init_logging(pgw_server::LogFormat::Text)?;
    let (gateway_config, _sim) = pgw_examples::gateway_config().await?;
    let listen = std::env::var("PGW_LISTEN").unwrap_or_else(|_| "127.0.0.1:8080".into());
    let config = ServerConfig {
        server: ServerSection {
            listen,
            ..ServerSection::default()
        }
        .settings()?,
        gateway: gateway_config,
    };
    let gateway = pgw_stack::Gateway::from_config(config.gateway.clone()).await?;
    let server = Server::bind(&config, gateway, pgw_server::install_metrics()).await?;
    tracing::info!("OpenAI-compatible proxy on http://{}/v1", server.local_addr()?);
    server.run(pgw_server::shutdown_signal()).await
}
