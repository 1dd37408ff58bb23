//! The breaker alone in front of a plain HTTP-like service.
//!
//! A flaky "upstream" fails 90% of its calls. The breaker's rate channel isolates it at
//! the 10th sample; later calls are refused with `CircuitOpen` without reaching it.
//! Run with `cargo run -p tower-breaker-window --example breaker_alone`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use pgw_core::{BoxError, CircuitOpen, HttpClassifier};
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
use tower_breaker_window::{BreakerConfig, BreakerLayer};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let config = BreakerConfig::builder()
        .fail_threshold(20) // the consecutive channel alone would wait for 20 failures
        .cooldown(Duration::from_secs(30))
        .build()?;
    let layer = BreakerLayer::memory("flaky", &config).with_classifier(HttpClassifier);
    let handle = layer.handle();

    let served = Arc::new(AtomicU32::new(0));
    let upstream = {
        let served = served.clone();
        service_fn(move |_req: Request<String>| {
            let n = served.fetch_add(1, Ordering::Relaxed);
            async move {
                // One call in ten gets an answer; the rest are 503s.
                let status = if n.is_multiple_of(10) {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                };
                Ok::<_, BoxError>(Response::builder().status(status).body(String::new())?)
            }
        })
    };
    let mut svc = ServiceBuilder::new().layer(layer).service(upstream);

    for i in 1..=15 {
        let req = Request::builder()
            .uri("/v1/chat/completions")
            .body(String::new())?;
        match svc.ready().await?.call(req).await {
            Ok(resp) => println!("call {i:2}: upstream answered {}", resp.status()),
            Err(e) if e.is::<CircuitOpen>() => println!("call {i:2}: not admitted: {e}"),
            Err(e) => println!("call {i:2}: failed: {e}"),
        }
    }
    let view = handle.view().await?;
    println!(
        "upstream saw {} calls; breaker {} (streak {}, window {}/{} failed, retry after {:?})",
        served.load(Ordering::Relaxed),
        view.state.as_str(),
        view.streak,
        view.window_failures,
        view.window_calls,
        view.retry_after
    );
    Ok(())
}
