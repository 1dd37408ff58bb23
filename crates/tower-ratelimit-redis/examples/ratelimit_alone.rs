//! The rate limiter alone around a plain service: RPM 3 and a token quota on one
//! source, shedding, then the same limits shared through Redis when `REDIS_URL` is set.
//!
//! ```text
//! cargo run -p tower-ratelimit-redis --example ratelimit_alone
//! REDIS_URL=redis://127.0.0.1:6379 cargo run -p tower-ratelimit-redis --example ratelimit_alone
//! ```

use std::time::Duration;

use pgw_core::openai::{ChatRequest, ChatResponse, Usage};
use pgw_core::redis_conn::RedisTarget;
use pgw_core::{BoxError, QuotaExceeded};
use tower::{Service, ServiceExt, service_fn};
use tower_layer::Layer;
use tower_ratelimit_redis::{
    Admission, Backend, MemoryBackend, Quota, RateLimitConfig, RateLimitLayer, RateLimiter, RedisBackend,
};

async fn provider(req: ChatRequest) -> Result<ChatResponse, BoxError> {
    // A stand-in for the upstream: answers with a usage report.
    let used = req.prompt_bytes() / 4 + 20;
    Ok(ChatResponse {
        usage: Some(Usage::new(req.prompt_bytes() / 4, 20, used)),
        ..ChatResponse::default()
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let backend: Backend = match std::env::var("REDIS_URL") {
        Ok(url) => RedisBackend::connect(&RedisTarget::parse(&url)?).await?.into(),
        Err(_) => MemoryBackend::new().into(),
    };
    println!("backend: {backend:?}");
    let config = RateLimitConfig::new("s4", Quota::unlimited().requests(3).concurrency(2))
        .account("acct", Quota::unlimited().tokens(10_000))
        .window(Duration::from_secs(60))
        .key_prefix(format!("example:{}", std::process::id()));
    let limiter = RateLimiter::new(config, backend)?;

    let mut svc = RateLimitLayer::new(limiter.clone())
        .on_admission(|_: &ChatRequest, a: &Admission| {
            println!(
                "  admitted {} at {:?} ({:?} clock), window {}, {} tokens reserved",
                a.source(),
                a.at(),
                a.clock(),
                a.window(),
                a.tokens()
            );
        })
        .layer(service_fn(provider));

    for i in 0..5 {
        let mut req = ChatRequest::user("model", format!("question {i}: {}", "x".repeat(300)));
        req.max_tokens = Some(100);
        match svc.ready().await?.call(req).await {
            Ok(resp) => println!(
                "call {i}: ok, used {:?}",
                resp.usage.as_ref().map(|u| u.total_tokens)
            ),
            Err(e) => match e.downcast_ref::<QuotaExceeded>() {
                Some(q) => println!(
                    "call {i}: not admitted ({}), retry after {:?}",
                    q.dimension(),
                    q.retry_after()
                ),
                None => println!("call {i}: error {e}"),
            },
        }
    }
    println!("stats: {:?}", limiter.stats());
    Ok(())
}
