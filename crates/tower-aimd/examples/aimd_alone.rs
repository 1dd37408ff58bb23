//! AIMD alone in front of an upstream that answers 429 when it gets more than 4
//! requests at once: the limit settles near what the upstream sustains.
//!
//! `cargo run -p tower-aimd --example aimd_alone` (simulated time: runs instantly)

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pgw_core::{BoxError, Outcome};
use tower::{Service, ServiceExt, service_fn};
use tower_aimd::{AimdConfig, AimdLayer};
use tower_layer::Layer;

fn main() -> Result<(), BoxError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?
        .block_on(run())
}

async fn run() -> Result<(), BoxError> {
    let upstream_inflight = Arc::new(AtomicUsize::new(0));
    let upstream = {
        let inflight = Arc::clone(&upstream_inflight);
        service_fn(move |_: u32| {
            let inflight = Arc::clone(&inflight);
            async move {
                let n = inflight.fetch_add(1, Ordering::SeqCst) + 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
                inflight.fetch_sub(1, Ordering::SeqCst);
                if n > 4 {
                    Err::<u32, BoxError>("429 too many requests".into())
                } else {
                    Ok(200)
                }
            }
        })
    };
    let classify = |r: &Result<u32, BoxError>| match r {
        Ok(_) => Outcome::Success,
        Err(_) => Outcome::RateLimited { retry_after: None },
    };
    let layer = AimdLayer::new(AimdConfig {
        caller_concurrency: Some(16),
        ..AimdConfig::default()
    })?
    .with_classifier(classify);
    let limits = layer.handle();
    let svc = layer.layer(upstream);

    let limited = Arc::new(AtomicUsize::new(0));
    let mut callers = Vec::new();
    for _ in 0..16 {
        let mut svc = svc.clone();
        let limited = Arc::clone(&limited);
        callers.push(tokio::spawn(async move {
            for i in 0..25 {
                if svc.ready().await?.call(i).await.is_err() {
                    limited.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok::<_, BoxError>(())
        }));
    }
    let watcher = tokio::spawn({
        let limits = limits.clone();
        async move {
            for second in 1..=6 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                println!(
                    "t={second}s limit={:.2} inflight={}",
                    limits.limit(),
                    limits.inflight()
                );
            }
        }
    });
    for c in callers {
        c.await??;
    }
    watcher.abort();
    println!(
        "400 calls, {} answered 429; final limit {:.2}, inflight {}",
        limited.load(Ordering::Relaxed),
        limits.limit(),
        limits.inflight()
    );
    Ok(())
}
