//! The retry layer alone, in front of a flaky upstream: 429s cost nothing, transient
//! failures spend the budget of 3, and a failed call says why.
//!
//! Run with `cargo run -p tower-retry-pushback --example retry_alone`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use pgw_core::{BoxError, CallHistory, CarriesHistory, Outcome};
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
use tower_retry_pushback::{RetryConfig, RetryError, RetryLayer};

/// A request: a prompt, and the call's history (the retry layer attaches one).
#[derive(Clone, Debug)]
struct Ask {
    prompt: Arc<str>,
    history: Option<CallHistory>,
}

impl CarriesHistory for Ask {
    fn call_history(&self) -> Option<&CallHistory> {
        self.history.as_ref()
    }
    fn set_call_history(&mut self, history: CallHistory) {
        self.history = Some(history);
    }
}

/// What the upstream answers: an HTTP-like status and a body.
#[derive(Debug)]
struct Reply {
    status: u16,
    body: String,
}

fn classify(result: &Result<Reply, BoxError>) -> Outcome {
    match result {
        Ok(r) if r.status == 200 => Outcome::Success,
        // A real classifier reads the Retry-After header; this upstream asks for 2 s.
        Ok(r) if r.status == 429 => Outcome::RateLimited {
            retry_after: Some(Duration::from_secs(2)),
        },
        Ok(r) if r.status == 400 => Outcome::Rejected,
        _ => Outcome::Transient,
    }
}

#[tokio::main(flavor = "current_thread", start_paused = true)]
async fn main() {
    // Answers 429, 429, 503, then 200; any prompt containing "bad" gets a 400.
    let count = Arc::new(AtomicU32::new(0));
    let upstream = {
        let count = count.clone();
        service_fn(move |ask: Ask| {
            let n = count.fetch_add(1, Ordering::SeqCst);
            async move {
                let status = match n {
                    _ if ask.prompt.contains("bad") => 400,
                    0 | 1 => 429,
                    2 => 503,
                    _ => 200,
                };
                Ok::<_, BoxError>(Reply {
                    status,
                    body: format!("answer to {:?}", ask.prompt),
                })
            }
        })
    };
    let layer = RetryLayer::new(RetryConfig::default())
        .expect("valid config")
        .classifier(classify)
        .rng_seed(7);
    let mut svc = ServiceBuilder::new().layer(layer).service(upstream);

    let start = tokio::time::Instant::now();
    let ask = Ask {
        prompt: "hello".into(),
        history: None,
    };
    let reply = svc.ready().await.unwrap().call(ask).await.unwrap();
    println!(
        "{} after {} upstream calls and {:.1}s (virtual): {}",
        reply.status,
        count.load(Ordering::SeqCst),
        start.elapsed().as_secs_f64(),
        reply.body
    );

    let bad = Ask {
        prompt: "bad prompt".into(),
        history: None,
    };
    let err = svc.ready().await.unwrap().call(bad).await.unwrap_err();
    let err = err.downcast_ref::<RetryError>().expect("the layer's error");
    println!("{err} (reason: {})", err.reason().as_str());
}
