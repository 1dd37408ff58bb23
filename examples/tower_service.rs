//! The gateway inside a plain tower stack: `Gateway` is a `tower::Service<ChatCall>`,
//! so tower's own layers wrap it like any other service. Here a domain request type
//! is mapped onto a call, the whole call gets a deadline and a concurrency cap, and
//! the answers are mapped back.
//!
//! ```text
//! cargo run -p pgw-examples --example tower_service
//! ```
//!
//! It sends a few questions over the simulated provider (one source of it a black
//! hole: the gateway routes around it) and prints who answered.

use std::time::Duration;

use pgw_core::openai::ChatRequest;
use pgw_stack::{ChatCall, GatewayAnswer};
use tower::{Service, ServiceBuilder, ServiceExt};

/// What the application deals in.
struct Question(String);

/// What it gets back.
#[derive(Debug)]
struct Reply {
    text: String,
    source: Option<String>,
}

#[tokio::main]
async fn main() -> Result<(), pgw_core::BoxError> {
    let (gateway, _sim) = pgw_examples::gateway().await?;
    let mut service = ServiceBuilder::new()
        .map_request(|q: Question| {
            let mut request = ChatRequest::user("gpt-4o-mini", q.0);
            request.max_tokens = Some(40);
            ChatCall::new(request)
        })
        .map_response(|a: GatewayAnswer| Reply {
            text: a.content().to_owned(),
            source: a.source.map(|s| s.to_string()),
        })
        .timeout(Duration::from_secs(30))
        .concurrency_limit(4)
        .service(gateway);
    for q in ["what is tower?", "what is a circuit breaker?", "why p2c?"] {
        let reply = service.ready().await?.call(Question(q.into())).await?;
        println!(
            "{q}\n  -> {:?} (from {})",
            reply.text,
            reply.source.as_deref().unwrap_or("cache")
        );
    }
    Ok(())
}
