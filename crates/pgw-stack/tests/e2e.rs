//! End-to-end: the gateway against the simulator served over HTTP on 127.0.0.1, the
//! same suite on the memory backend, a standalone Redis and a 3-node Redis Cluster.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use futures_util::StreamExt;
use pgw_core::openai::ChatRequest;
use pgw_sim::config::LogNormal;
use pgw_sim::http::ServerHandle;
use pgw_sim::{PoolConfig, SimPool};
use pgw_stack::breaker::BreakerState;
use pgw_stack::{
    AttemptTelemetry, BackendKind, ChatCall, Gateway, GatewayConfig, GatewayError, MemorySink, SecretKey,
    SourceConfig, Validator,
};
use tower::ServiceExt;

const KEY: &str = "sk-e2e-key-0123456789";

fn fast(name: &str) -> pgw_sim::SourceConfig {
    let quick = |median: f64| LogNormal {
        median,
        p95: median * 1.5,
        min: median / 2.0,
        max: median * 2.0,
    };
    pgw_sim::SourceConfig {
        name: name.into(),
        api_key: Some(KEY.into()),
        ttft_s: quick(0.02).into(),
        tokens_per_second: quick(2000.0).into(),
        error_latency_s: quick(0.01).into(),
        ..pgw_sim::SourceConfig::healthy(name)
    }
}

struct Env {
    pool: SimPool,
    server: ServerHandle,
    sink: MemorySink,
}

async fn serve(sources: Vec<pgw_sim::SourceConfig>) -> (SimPool, ServerHandle) {
    let config = PoolConfig::of(sources);
    let pool = SimPool::new(config, 7).unwrap();
    let (_, server) = pgw_sim::http::serve(pool.clone(), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    (pool, server)
}

#[derive(Clone, Copy, Debug)]
enum Backend {
    Memory,
    Redis,
    Cluster,
}

fn base_config(backend: Backend, test: &str) -> GatewayConfig {
    let mut cfg = GatewayConfig::default();
    cfg.balance.policy = Some("round_robin".into());
    cfg.balance.max_wait_s = Some(0.5);
    cfg.balance.seed = Some(1);
    cfg.retry.base_backoff_s = Some(0.01);
    cfg.retry.max_backoff_s = Some(0.02);
    match backend {
        Backend::Memory => {}
        Backend::Redis => cfg.redis_url = pgw_test_support::redis_url(),
        Backend::Cluster => {
            cfg.redis_url = pgw_test_support::redis_cluster_nodes().map(|nodes| {
                let hosts: Vec<&str> = nodes.iter().map(|n| n.trim_start_matches("redis://")).collect();
                format!("redis+cluster://{}", hosts.join(","))
            });
        }
    }
    if !matches!(backend, Backend::Memory) {
        cfg.backend = BackendKind::Redis;
        cfg.key_prefix = Some(pgw_test_support::unique_prefix(test));
    }
    cfg
}

fn source(server: &ServerHandle, name: &str, group: &str) -> SourceConfig {
    let mut s = SourceConfig::new(name, server.base_url(name), SecretKey::new(KEY)).group(group);
    s.first_token_timeout_s = Some(0.5);
    s.inter_token_timeout_s = Some(0.3);
    s.total_timeout_s = Some(2.0);
    s
}

async fn env(backend: Backend, test: &str, sim: Vec<(pgw_sim::SourceConfig, &str)>) -> (Env, Gateway) {
    let (pool, server) = serve(sim.iter().map(|(s, _)| s.clone()).collect()).await;
    let mut cfg = base_config(backend, test);
    for (s, group) in &sim {
        cfg.sources.push(source(&server, &s.name, group));
    }
    let sink = MemorySink::new();
    let gw = Gateway::builder(cfg)
        .sink(Arc::new(sink.clone()))
        .build()
        .await
        .unwrap();
    (Env { pool, server, sink }, gw)
}

fn req(text: &str) -> ChatRequest {
    let mut r = ChatRequest::user("m", text);
    r.max_tokens = Some(20);
    r
}

fn records_of<'a>(records: &'a [AttemptTelemetry], source: &str) -> Vec<&'a AttemptTelemetry> {
    records
        .iter()
        .filter(|r| r.source.as_ref().is_some_and(|s| s.as_str() == source) && !r.cache_hit)
        .collect()
}

macro_rules! both {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Backend::Memory, stringify!($name)).await; })*
        }
        mod redis {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Backend::Redis, stringify!($name)).await; })*
        }
        mod redis_cluster {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(super::Backend::Cluster, stringify!($name)).await; })*
        }
    };
}

both!(
    non_streaming_success,
    streaming_success,
    black_hole_is_cut_and_the_call_succeeds_elsewhere,
    a_401_source_is_force_opened_after_one_attempt,
    an_inter_token_stall_is_cut,
    a_cache_hit_never_reaches_the_limiter_or_the_upstream,
    the_fallback_group_answers_when_the_primary_is_dead,
    a_structured_call_is_reasked_after_an_invalid_answer,
);

async fn non_streaming_success(b: Backend, t: &str) {
    let (env, gw) = env(b, t, vec![(fast("a"), "g")]).await;
    let answer = gw.chat(req("hello")).await.unwrap();
    assert!(!answer.content().trim().is_empty());
    assert_eq!(answer.group, "g");
    assert_eq!(answer.source.as_ref().unwrap().as_str(), "a");
    assert!(!answer.cache_hit);
    let recs = env.sink.records();
    assert_eq!(recs.len(), 1);
    let r = &recs[0];
    assert_eq!((r.outcome, r.attempt, r.call_id), ("success", 1, answer.call_id));
    assert!(
        r.admitted_at_s.is_some(),
        "admission time from the limiter's clock"
    );
    assert!(r.completion_tokens.unwrap() > 0);
    assert_eq!(env.pool.stats().sources["a"].answered_with(200), 1);
}

async fn streaming_success(b: Backend, t: &str) {
    let (env, gw) = env(b, t, vec![(fast("a"), "g")]).await;
    let mut stream = Box::pin(gw.chat_stream(req("stream me")).await.unwrap());
    let mut text = String::new();
    let mut n = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        n += 1;
        for c in &chunk.choices {
            text.push_str(c.delta.content.as_deref().unwrap_or(""));
        }
    }
    assert!(n > 1, "several chunks");
    assert!(!text.trim().is_empty());
    let r = &env.sink.records()[0];
    assert!(r.ttft_ms.is_some(), "ttft recorded for a streamed attempt");
    assert_eq!(env.pool.stats().sources["a"].streams_completed, 1);
    drop(env.server);
}

async fn black_hole_is_cut_and_the_call_succeeds_elsewhere(b: Backend, t: &str) {
    let hole = pgw_sim::SourceConfig {
        black_hole_rate: 1.0.into(),
        ..fast("hole")
    };
    let (env, gw) = env(b, t, vec![(hole, "g"), (fast("good"), "g")]).await;
    for i in 0..2 {
        let a = gw.chat(req(&format!("q{i}"))).await.unwrap();
        assert_eq!(a.source.as_ref().unwrap().as_str(), "good");
    }
    let recs = env.sink.records();
    let cut = records_of(&recs, "hole");
    assert!(!cut.is_empty(), "round robin tried the black hole");
    assert!(
        cut.iter()
            .all(|r| r.outcome == "transient" && r.error.as_deref().unwrap().contains("watchdog"))
    );
    assert_eq!(env.pool.stats().sources["hole"].black_holed, cut.len() as u64);
}

async fn a_401_source_is_force_opened_after_one_attempt(b: Backend, t: &str) {
    let dead = pgw_sim::SourceConfig {
        revoked: true.into(),
        ..fast("dead")
    };
    let (env, gw) = env(b, t, vec![(dead, "g"), (fast("good"), "g")]).await;
    for i in 0..4 {
        gw.chat(req(&format!("q{i}"))).await.unwrap();
    }
    let recs = env.sink.records();
    let dead_recs = records_of(&recs, "dead");
    assert_eq!(dead_recs.len(), 1, "exactly one attempt on the dead source");
    assert_eq!(dead_recs[0].outcome, "source_dead");
    let h = gw.sources().iter().find(|h| h.source.as_str() == "dead").unwrap();
    assert_eq!(h.breaker.view().await.unwrap().state, BreakerState::Open);
    assert_eq!(env.pool.stats().sources["dead"].received, 1);
}

async fn an_inter_token_stall_is_cut(b: Backend, t: &str) {
    let slow = pgw_sim::SourceConfig {
        stall: pgw_sim::config::StallConfig {
            rate: 1.0,
            min_gap_s: 1.5,
            max_gap_s: 1.5,
        }
        .into(),
        ..fast("slow")
    };
    let (env, gw) = env(b, t, vec![(slow, "g"), (fast("good"), "g")]).await;
    for i in 0..2 {
        let mut r = req(&format!("long answer {i}"));
        r.max_tokens = Some(200);
        r.stream = true;
        let a = gw.chat(r).await.unwrap();
        assert_eq!(a.source.as_ref().unwrap().as_str(), "good");
    }
    let recs = env.sink.records();
    let cut = records_of(&recs, "slow");
    assert!(!cut.is_empty());
    assert!(
        cut.iter()
            .all(|r| r.outcome == "transient" && r.error.as_deref().unwrap().contains("inter_token")),
        "{cut:?}"
    );
}

async fn a_cache_hit_never_reaches_the_limiter_or_the_upstream(b: Backend, t: &str) {
    let (env, gw) = env(b, t, vec![(fast("a"), "g")]).await;
    // Only deterministic requests are cached by default.
    let mut same = req("same question");
    same.extra.insert("temperature".into(), 0.0.into());
    let first = gw.chat(same.clone()).await.unwrap();
    let second = gw.chat(same).await.unwrap();
    assert!(!first.cache_hit && second.cache_hit);
    assert_eq!(first.content(), second.content());
    assert_eq!(
        env.pool.stats().sources["a"].received,
        1,
        "the upstream saw one request"
    );
    let limiter = &gw.sources()[0].limiter;
    assert_eq!(limiter.stats().admitted, 1, "the limiter admitted one request");
    let recs = env.sink.records();
    assert_eq!(recs.len(), 2);
    assert!(recs[1].cache_hit && recs[1].call_id == second.call_id && recs[1].admitted_at_s.is_none());
}

async fn the_fallback_group_answers_when_the_primary_is_dead(b: Backend, t: &str) {
    let dead = |n: &str| pgw_sim::SourceConfig {
        revoked: true.into(),
        ..fast(n)
    };
    let (env, gw) = env(
        b,
        t,
        vec![
            (dead("p1"), "primary"),
            (dead("p2"), "primary"),
            (fast("b1"), "backup"),
        ],
    )
    .await;
    assert_eq!(gw.groups(), ["primary", "backup"]);
    let a = gw.chat(req("help")).await.unwrap();
    assert_eq!(a.group, "backup");
    assert_eq!(a.source.as_ref().unwrap().as_str(), "b1");
    // Both primaries are now open: the next call goes to the backup without touching them.
    let a = gw.chat(req("help again")).await.unwrap();
    assert_eq!(a.group, "backup");
    let s = env.pool.stats();
    assert_eq!(s.sources["p1"].received + s.sources["p2"].received, 2);
}

async fn a_structured_call_is_reasked_after_an_invalid_answer(b: Backend, t: &str) {
    let (env, gw) = env(b, t, vec![(fast("a"), "g")]).await;
    // A validator that refuses the first answer: the call must be re-asked.
    let seen = Arc::new(AtomicU32::new(0));
    let v = {
        let seen = Arc::clone(&seen);
        move |_: &pgw_core::openai::ChatResponse| {
            if seen.fetch_add(1, Ordering::SeqCst) == 0 {
                Err("not what I asked for".to_owned())
            } else {
                Ok(())
            }
        }
    };
    let mut call = ChatCall::new(req("give me json"));
    call.extensions_mut().insert(Validator::new(v));
    let a = gw.clone().oneshot(call).await.unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 2);
    let recs: Vec<_> = env
        .sink
        .records()
        .into_iter()
        .filter(|r| r.call_id == a.call_id)
        .collect();
    assert_eq!(
        recs.iter().map(|r| r.outcome).collect::<Vec<_>>(),
        ["invalid", "success"]
    );
    // The refused answer was billed: its record keeps the usage it reported.
    assert!(
        recs[0].completion_tokens.is_some_and(|n| n > 0) && recs[0].prompt_tokens.is_some(),
        "{:?}",
        recs[0]
    );

    // JSON mode through the typed helper.
    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct Anything(serde_json::Value);
    let mut r = req("structured please");
    r.extra.insert(
        "response_format".into(),
        serde_json::json!({"type": "json_object"}),
    );
    let (value, _) = gw.chat_json::<serde_json::Value>(r).await.unwrap();
    assert!(value.is_object());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_one_redis_share_breaker_and_quota() {
    let dead = pgw_sim::SourceConfig {
        revoked: true.into(),
        ..fast("dead")
    };
    let (pool, server) = serve(vec![dead.clone(), fast("tight")]).await;
    let mut cfg = base_config(Backend::Redis, "shared");
    cfg.cache.enabled = false;
    cfg.sources.push(source(&server, "dead", "d"));
    let mut tight = source(&server, "tight", "t");
    tight.rpm = Some(2);
    cfg.sources.push(tight);
    cfg.balance.max_wait_s = Some(0.05);
    // An hour-long window: a refused call cannot wait for the next one (R3: it fails
    // at once instead of sleeping past its stall window).
    cfg.ratelimit.window_s = Some(3600.0);
    cfg.retry.stall_window_s = Some(1.0);
    let a = Gateway::builder(cfg.clone()).build().await.unwrap();
    let b = Gateway::builder(cfg).build().await.unwrap();

    // Gateway A opens the dead source's breaker; gateway B sees it open.
    a.chat(req("x")).await.unwrap();
    let hb = b.sources().iter().find(|h| h.source.as_str() == "dead").unwrap();
    assert_eq!(hb.breaker.view().await.unwrap().state, BreakerState::Open);
    b.chat(req("y")).await.unwrap();
    assert_eq!(
        pool.stats().sources["dead"].received,
        1,
        "B never dispatched to the open source"
    );

    // "tight" has rpm 2: A and B together get two requests through it.
    let tight_received = pool.stats().sources["tight"].received;
    assert_eq!(tight_received, 2);
    let err = a.chat(req("z")).await.unwrap_err();
    let err = err.downcast_ref::<GatewayError>().unwrap();
    assert!(
        err.to_string().contains("quota") || err.to_string().contains("circuit"),
        "{err}"
    );
    assert_eq!(pool.stats().sources["tight"].received, 2, "the shared quota held");
}
