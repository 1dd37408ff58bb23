//! The gateway over the simulator's virtual-time `SimService` (custom transport),
//! under tokio's paused clock: what the soak runs.

use std::sync::Arc;
use std::time::Duration;

use pgw_core::BoxError;
use pgw_core::openai::ChatRequest;
use pgw_sim::{PoolConfig, SimPool};
use pgw_stack::client::box_transport;
use pgw_stack::{ChatCall, Gateway, GatewayConfig, MemorySink, SecretKey, SourceConfig, Validator};
use tower::ServiceExt;

const KEY: &str = "sk-virtual-0123456789";

fn pool(sources: Vec<pgw_sim::SourceConfig>) -> SimPool {
    let config = PoolConfig::of(sources);
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
        black_hole_rate: 1.0.into(),
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
        black_hole_rate: 1.0.into(),
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
    // S6: one record per attempt, a cancelled one included.
    let recs = sink.records();
    assert_eq!(recs.len(), 2, "{recs:?}");
    assert!(recs.iter().all(|r| r.outcome == "cancelled" && r.error.is_some()));
    assert_eq!(recs[0].attempt, 1);
    assert!(recs.iter().all(|r| r.latency_ms >= 5000.0));
}

#[tokio::test(start_paused = true)]
async fn a_cache_hit_passes_the_gateway_validator_too() {
    let pool = pool(vec![pgw_sim::SourceConfig::healthy("good")]);
    let mut cfg = GatewayConfig::default();
    cfg.retry.max_reasks = Some(0);
    let mut s = SourceConfig::new("good", "http://sim.invalid/good/v1", SecretKey::new(KEY));
    s.total_timeout_s = Some(300.0);
    cfg.sources.push(s);
    let p = pool.clone();
    let gw = Gateway::builder(cfg)
        .validator(|_: &pgw_core::openai::ChatResponse| Err::<(), _>("strict: never good enough".to_owned()))
        .transport(move |sc: &SourceConfig| -> Result<_, BoxError> {
            Ok(box_transport(p.service(&sc.name).ok_or("unknown sim source")?))
        })
        .build()
        .await
        .unwrap();
    // A call with a lenient validator of its own is answered, and the answer cached.
    let mut lenient = ChatCall::new(ChatRequest::user("m", "same prompt"));
    lenient
        .extensions_mut()
        .insert(Validator::new(|_: &pgw_core::openai::ChatResponse| Ok(())));
    let a = gw.clone().oneshot(lenient).await.unwrap();
    assert!(!a.cache_hit);
    // The same prompt under the gateway's strict validator must not be served that hit.
    let r = gw.chat(ChatRequest::user("m", "same prompt")).await;
    assert!(
        r.is_err(),
        "the strict default validator was bypassed by the cache"
    );
    assert_eq!(
        pool.stats().sources["good"].received,
        2,
        "the second call went upstream"
    );
}
