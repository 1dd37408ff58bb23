//! Health per request class: a source that fails one shape of call keeps its health
//! for the other.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

mod common;

use common::Req;
use pgw_core::BoxError;
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt, service_fn};
use tower_health_p2c::{BalanceConfig, HealthP2c, Sources};

type Svc = BoxCloneSyncService<Req, &'static str, BoxError>;

/// `good` answers everything; `slow` answers short calls and fails every stream. Both
/// in 1 s, the latency an unmeasured source is scored with: the score is health alone.
fn source(name: &'static str, fails_streams: bool, hits: Arc<[AtomicUsize; 2]>) -> Svc {
    BoxCloneSyncService::new(service_fn(move |req: Req| {
        hits[usize::from(req.streamed)].fetch_add(1, Ordering::SeqCst);
        let result = if fails_streams && req.streamed {
            Err::<&'static str, BoxError>("watchdog cut".into())
        } else {
            Ok(name)
        };
        async move {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            result
        }
    }))
}

#[tokio::test(start_paused = true)]
async fn a_source_failing_streams_keeps_its_short_call_share() {
    for with_classes in [true, false] {
        let good: Arc<[AtomicUsize; 2]> = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
        let slow: Arc<[AtomicUsize; 2]> = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
        let sources: Sources<Svc> = Sources::new();
        sources.insert("good".into(), source("good", false, Arc::clone(&good)));
        sources.insert("slow".into(), source("slow", true, Arc::clone(&slow)));
        let lb = HealthP2c::new(sources.clone(), BalanceConfig::default())
            .unwrap()
            .with_seed(3);
        // One call at a time, alternating shapes: the score is health alone.
        if with_classes {
            let mut lb = lb.with_class(|r: &Req| usize::from(r.streamed));
            for i in 0..400 {
                let req = Req {
                    streamed: i % 2 == 1,
                    ..Req::default()
                };
                let _ = lb.ready().await.unwrap().call(req).await;
            }
            let slow_views = sources.view("slow").unwrap();
            assert!(
                slow_views.health_of(1) < 1.0,
                "stream failures lower the stream health"
            );
            assert!(
                (slow_views.health_of(0) - 1.0).abs() < 1e-9,
                "short-call health untouched: {}",
                slow_views.health_of(0)
            );
        } else {
            let mut lb = lb;
            for i in 0..400 {
                let req = Req {
                    streamed: i % 2 == 1,
                    ..Req::default()
                };
                let _ = lb.ready().await.unwrap().call(req).await;
            }
        }
        let slow_streams = slow[1].load(Ordering::SeqCst);
        let slow_short = slow[0].load(Ordering::SeqCst);
        if with_classes {
            // Streams leave the slow source after its first failure; short calls keep
            // about half (ties between two healthy sources are broken at random).
            assert!(slow_streams <= 2, "slow got {slow_streams} of 200 streams");
            assert!(slow_short > 60, "slow got only {slow_short} of 200 short calls");
        } else {
            // One EWMA per source: the stream failures cost the slow source its
            // short calls too.
            assert!(
                slow_short < 10,
                "without classes slow still got {slow_short} short calls"
            );
        }
    }
}
