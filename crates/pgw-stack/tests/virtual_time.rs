//! The gateway over the simulator's virtual-time `SimService` (custom transport),
//! under tokio's paused clock: what the soak runs.

use std::sync::Arc;
use std::time::Duration;

use pgw_core::BoxError;
use pgw_core::openai::ChatRequest;
use pgw_sim::{PoolConfig, SimPool};
use pgw_stack::client::box_transport;
use pgw_stack::{Gateway, GatewayConfig, MemorySink, SecretKey, SourceConfig};

const KEY: &str = "sk-virtual-0123456789";

fn pool(sources: Vec<pgw_sim::SourceConfig>) -> SimPool {
    let config = PoolConfig {
        sources,
        bad_prompt_rate: 0.0,
        ..PoolConfig::default()
    };
    SimPool::new(config, 11).unwrap()
}

async fn gateway(pool: &SimPool, mut cfg: GatewayConfig, sink: &MemorySink) -> Gateway {
    for name in pool.sources() {
        let mut s = SourceConfig::new(
            name.as_str(),
            format!("http://sim.invalid/{name}/v1"),
            SecretKey::new(KEY),
        );
        s.first_token_timeout_s = Some(60.0);
        s.total_timeout_s = Some(300.0);
        if name == "only" {
            s.max_concurrency = Some(1);
        }
        cfg.sources.push(s);
    }
    let p = pool.clone();
    Gateway::builder(cfg)
        .sink(Arc::new(sink.clone()))
        .transport(move |sc: &SourceConfig| -> Result<_, BoxError> {
            let svc = p.service(&sc.name).ok_or("unknown sim source")?;
            Ok(box_transport(svc))
        })
        .build()
        .await
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_black_hole_costs_one_timeout_in_virtual_time() {
    let hole = pgw_sim::SourceConfig {
        black_hole_rate: 1.0,
        ..pgw_sim::SourceConfig::healthy("hole")
    };
    let pool = pool(vec![hole, pgw_sim::SourceConfig::healthy("good")]);
    let mut cfg = GatewayConfig::default();
    cfg.balance.policy = Some("round_robin".into());
    let sink = MemorySink::new();
    let gw = gateway(&pool, cfg, &sink).await;
    let started = tokio::time::Instant::now();
    for i in 0..3 {
        let a = gw.chat(ChatRequest::user("m", format!("q{i}"))).await.unwrap();
        assert_eq!(a.source.as_ref().unwrap().as_str(), "good");
    }
    let recs = sink.records();
    let cut: Vec<_> = recs
        .iter()
        .filter(|r| r.source.as_ref().unwrap().as_str() == "hole")
        .collect();
    assert!(!cut.is_empty());
    assert!(
        cut.iter()
            .all(|r| r.error.as_deref().unwrap().contains("total timeout of 300"))
    );
    // Minutes of virtual time (timeouts and 12 s TTFTs) ran on the paused clock.
    assert!(started.elapsed() >= Duration::from_secs(300));
}

#[tokio::test(start_paused = true)]
async fn dropping_a_call_releases_every_reservation() {
    let hole = pgw_sim::SourceConfig {
        black_hole_rate: 1.0,
        ..pgw_sim::SourceConfig::healthy("only")
    };
    let pool = pool(vec![hole]);
    let mut cfg = GatewayConfig::default();
    cfg.aimd.initial_limit = Some(1.0);
    let sink = MemorySink::new();
    let mut gw_cfg = cfg;
    gw_cfg.cache.enabled = false;
    let gw = gateway(&pool, gw_cfg, &sink).await;
    // AIMD limit 1 and a concurrency quota of 1: a leaked slot would refuse call 2.
    let h = &gw.sources()[0];
    for n in 1..=2_u64 {
        let call = gw.chat(ChatRequest::user("m", "hang"));
        let r = tokio::time::timeout(Duration::from_secs(5), call).await;
        assert!(r.is_err(), "still waiting on the black hole");
        assert_eq!(h.aimd.inflight(), 0, "AIMD inflight released on drop");
        assert_eq!(pool.stats().sources["only"].received, n, "call {n} was admitted");
        assert_eq!(
            pool.stats().sources["only"].in_flight,
            0,
            "the upstream request was dropped"
        );
    }
}
