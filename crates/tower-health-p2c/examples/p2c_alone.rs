//! The balancer alone over three sources: a healthy one, one that fails 90% of the
//! time, and one behind a tight AIMD gate. Health steers traffic away from the bad
//! source; the paced source is skipped at no cost.
//!
//! `cargo run -p tower-health-p2c --example p2c_alone` (simulated time: runs instantly)

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pgw_core::{BoxError, CallHistory, CarriesHistory};
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt, service_fn};
use tower_aimd::{AimdConfig, AimdLayer};
use tower_health_p2c::{BalanceConfig, HealthP2c, Sources};
use tower_layer::Layer;

/// The request: cheap to clone, carries the in-call history.
#[derive(Clone, Default)]
struct Prompt {
    history: Option<CallHistory>,
}

impl CarriesHistory for Prompt {
    fn call_history(&self) -> Option<&CallHistory> {
        self.history.as_ref()
    }
    fn set_call_history(&mut self, h: CallHistory) {
        self.history = Some(h);
    }
}

type Source = BoxCloneSyncService<Prompt, String, BoxError>;

/// An upstream succeeding once every `every` calls, after 300 ms.
fn upstream(name: &'static str, every: u64) -> Source {
    let n = Arc::new(AtomicU64::new(0));
    BoxCloneSyncService::new(service_fn(move |_: Prompt| {
        let k = n.fetch_add(1, Ordering::Relaxed);
        async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            if k.is_multiple_of(every) {
                Ok(format!("answer from {name}"))
            } else {
                Err::<String, BoxError>("watchdog cut".into())
            }
        }
    }))
}

fn main() -> Result<(), BoxError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?
        .block_on(run())
}

async fn run() -> Result<(), BoxError> {
    let sources: Sources<Source> = Sources::new();
    sources.insert("healthy".into(), upstream("healthy", 1));
    sources.insert("flaky".into(), upstream("flaky", 10));
    // A source behind a shedding AIMD gate that fires the balancer's wake signal.
    let gate = AimdLayer::new(AimdConfig {
        initial_limit: 1.0,
        max_concurrency: Some(1),
        ..AimdConfig::default()
    })?
    .with_source("tight".into())
    .with_release_signal(sources.wake_signal())
    .shedding();
    sources.insert(
        "tight".into(),
        BoxCloneSyncService::new(gate.layer(upstream("tight", 1))),
    );

    let lb = HealthP2c::new(sources.clone(), BalanceConfig::default())?.with_seed(2026);
    let mut callers = Vec::new();
    for _ in 0..4 {
        let mut lb = lb.clone();
        callers.push(tokio::spawn(async move {
            let mut ok = 0;
            for _ in 0..100 {
                let history = CallHistory::new();
                let mut prompt = Prompt::default();
                prompt.set_call_history(history.clone());
                if lb.ready().await?.call(prompt).await.is_ok() {
                    ok += 1;
                }
            }
            Ok::<_, BoxError>(ok)
        }));
    }
    let mut ok = 0;
    for c in callers {
        ok += c.await??;
    }
    println!("{ok}/400 calls succeeded (one attempt each, no retry layer)");
    for v in sources.views() {
        println!(
            "{:>8}: health {:.2}, inflight {}",
            v.id(),
            v.health(),
            v.inflight()
        );
    }
    Ok(())
}
