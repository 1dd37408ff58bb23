//! The response cache through the gateway, against the simulator on tokio's paused
//! clock: what is cached by default, the opt-out, single-flight, replay as a stream,
//! and a fallback group's shorter TTL.

mod support;

use std::time::Duration;

use futures_util::StreamExt;
use pgw_core::openai::{ChatRequest, ChunkAccumulator};
use pgw_sim::{PoolConfig, SimPool};
use pgw_stack::{ChatCall, Gateway, GatewayConfig, MemorySink, NoCache, SecretKey, SourceConfig};
use tower::ServiceExt;

fn pool(sources: Vec<pgw_sim::SourceConfig>) -> SimPool {
    let config = PoolConfig::of(sources);
    SimPool::new(config, 5).unwrap()
}

async fn gateway(pool: &SimPool, cfg: impl FnOnce(&mut GatewayConfig), sink: &MemorySink) -> Gateway {
    let mut c = GatewayConfig::default();
    for name in pool.sources() {
        let mut s = SourceConfig::new(
            name.as_str(),
            format!("http://sim.invalid/{name}/v1"),
            SecretKey::new("sk-virtual-0123456789"),
        );
        s.total_timeout_s = Some(60.0);
        c.sources.push(s);
    }
    cfg(&mut c);
    support::sim_gateway(pool, c, sink).await
}

fn received(pool: &SimPool) -> u64 {
    pool.stats().sources.values().map(|s| s.received).sum()
}

fn at(temperature: f64, prompt: &str) -> ChatRequest {
    let mut r = ChatRequest::user("m", prompt);
    r.extra.insert("temperature".into(), temperature.into());
    r
}

#[tokio::test(start_paused = true)]
async fn only_deterministic_requests_are_cached_by_default() {
    let pool = pool(vec![pgw_sim::SourceConfig::quick("a")]);
    let sink = MemorySink::new();
    let gw = gateway(&pool, |_| {}, &sink).await;

    for _ in 0..2 {
        let a = gw.chat(at(1.2, "regenerate me")).await.unwrap();
        assert!(!a.cache_hit, "a sampled answer is never replayed");
    }
    assert_eq!(received(&pool), 2);
    // No temperature: the provider's default samples.
    for _ in 0..2 {
        assert!(
            !gw.chat(ChatRequest::user("m", "default"))
                .await
                .unwrap()
                .cache_hit
        );
    }
    assert_eq!(received(&pool), 4);

    let first = gw.chat(at(0.0, "deterministic")).await.unwrap();
    let second = gw.chat(at(0.0, "deterministic")).await.unwrap();
    assert!(!first.cache_hit && second.cache_hit);
    assert_eq!(first.content(), second.content());
    assert_eq!(received(&pool), 5, "the hit reached no source");
    let mut seeded = ChatRequest::user("m", "seeded");
    seeded.extra.insert("seed".into(), 7.into());
    gw.chat(seeded.clone()).await.unwrap();
    assert!(gw.chat(seeded).await.unwrap().cache_hit);
    assert_eq!(received(&pool), 6);
    let hits = sink.records().iter().filter(|r| r.cache_hit).count();
    assert_eq!(hits, 2, "each hit leaves one record marked cache_hit");
}

#[tokio::test(start_paused = true)]
async fn always_caches_every_request_when_configured() {
    let pool = pool(vec![pgw_sim::SourceConfig::quick("a")]);
    let gw = gateway(
        &pool,
        |c| c.cache.when = pgw_stack::CacheWhen::Always,
        &MemorySink::new(),
    )
    .await;
    gw.chat(ChatRequest::user("m", "x")).await.unwrap();
    assert!(gw.chat(ChatRequest::user("m", "x")).await.unwrap().cache_hit);
    assert_eq!(received(&pool), 1);
}

#[tokio::test(start_paused = true)]
async fn a_call_that_opts_out_neither_reads_nor_fills_the_cache() {
    let pool = pool(vec![pgw_sim::SourceConfig::quick("a")]);
    let gw = gateway(&pool, |_| {}, &MemorySink::new()).await;
    let opted_out = || {
        let mut call = ChatCall::new(at(0.0, "fresh please"));
        call.extensions_mut().insert(NoCache);
        call
    };
    let a = gw.clone().oneshot(opted_out()).await.unwrap();
    assert!(!a.cache_hit);
    let b = gw.chat(at(0.0, "fresh please")).await.unwrap();
    assert!(!b.cache_hit, "the opted-out answer was not stored");
    assert_eq!(received(&pool), 2);
    let c = gw.clone().oneshot(opted_out()).await.unwrap();
    assert!(!c.cache_hit, "nor is a stored answer served to it");
    assert_eq!(received(&pool), 3);
}

#[tokio::test(start_paused = true)]
async fn identical_concurrent_misses_make_one_upstream_call() {
    let pool = pool(vec![
        pgw_sim::SourceConfig::quick("a"),
        pgw_sim::SourceConfig::quick("b"),
    ]);
    let gw = gateway(&pool, |_| {}, &MemorySink::new()).await;
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let gw = gw.clone();
            tokio::spawn(async move { gw.chat(at(0.0, "the same question")).await })
        })
        .collect();
    let mut hits = 0;
    let mut texts = Vec::new();
    for c in calls {
        let a = c.await.unwrap().unwrap();
        hits += usize::from(a.cache_hit);
        texts.push(a.content().to_owned());
    }
    assert_eq!(received(&pool), 1, "one leader went upstream");
    assert_eq!(hits, 7, "the followers got its answer, marked as cached");
    assert!(texts.iter().all(|t| *t == texts[0]));
    // A different request is not held behind that flight.
    let other = gw.chat(at(0.0, "another question")).await.unwrap();
    assert!(!other.cache_hit);
}

#[tokio::test(start_paused = true)]
async fn a_plain_answer_replays_as_a_proper_stream() {
    let pool = pool(vec![pgw_sim::SourceConfig::quick("a")]);
    let gw = gateway(&pool, |_| {}, &MemorySink::new()).await;
    let plain = gw.chat(at(0.0, "stream me later")).await.unwrap();
    let mut stream = gw.chat_stream(at(0.0, "stream me later")).await.unwrap();
    assert!(stream.cache_hit());
    let mut acc = ChunkAccumulator::default();
    let mut n = 0;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        assert_eq!(chunk.object, "chat.completion.chunk");
        acc.push(&chunk);
        n += 1;
    }
    assert!(n >= 1);
    let back = acc.finish();
    assert_eq!(back.content(), plain.content());
    assert_eq!(
        back.choices[0].finish_reason,
        plain.answer.response.choices[0].finish_reason
    );
    assert_eq!(back.choices[0].message.role, "assistant");
    assert_eq!(received(&pool), 1);
}

#[tokio::test(start_paused = true)]
async fn a_fallback_groups_answer_is_kept_only_briefly() {
    let down = pgw_sim::SourceConfig {
        server_error_rate: 1.0.into(),
        ..pgw_sim::SourceConfig::quick("primary")
    };
    let pool = pool(vec![down, pgw_sim::SourceConfig::quick("backup")]);
    let gw = gateway(
        &pool,
        |c| {
            c.sources[0].group = Some("main".into());
            c.sources[1].group = Some("spare".into());
            c.cache.fallback_ttl_s = Some(20.0);
        },
        &MemorySink::new(),
    )
    .await;
    let a = gw.chat(at(0.0, "q")).await.unwrap();
    assert_eq!(a.group, "spare");
    tokio::time::advance(Duration::from_secs(10)).await;
    assert!(
        gw.chat(at(0.0, "q")).await.unwrap().cache_hit,
        "within the fallback TTL"
    );
    tokio::time::advance(Duration::from_secs(15)).await;
    let after = gw.chat(at(0.0, "q")).await.unwrap();
    assert!(
        !after.cache_hit,
        "past the fallback TTL the chain is walked again"
    );

    // The primary group's answers keep the full TTL (600 s).
    let pool = pool_of_one();
    let gw = gateway(&pool, |c| c.cache.fallback_ttl_s = Some(20.0), &MemorySink::new()).await;
    gw.chat(at(0.0, "q")).await.unwrap();
    tokio::time::advance(Duration::from_secs(300)).await;
    assert!(gw.chat(at(0.0, "q")).await.unwrap().cache_hit);
}

/// An answer of the context fallback is kept the full TTL only when the call's first
/// group was too large for the request; reached from a fallback group (the first one
/// down), it is a fallback's answer, kept `fallback_ttl_s`: it would outlive the
/// first group's recovery.
#[tokio::test(start_paused = true)]
async fn a_context_fallback_reached_from_a_fallback_is_kept_only_briefly() {
    use pgw_stack::{ModelConfig, RouteConfig};
    let down = pgw_sim::SourceConfig {
        server_error_rate: 1.0.into(),
        ..pgw_sim::SourceConfig::quick("down")
    };
    let small = pgw_sim::SourceConfig {
        context_window: Some(4096),
        ..pgw_sim::SourceConfig::quick("small")
    };
    let large = pgw_sim::SourceConfig {
        context_window: Some(200_000),
        ..pgw_sim::SourceConfig::quick("large")
    };
    let sources = [down, small, large];
    let routed = |source: &str| ModelConfig {
        routes: vec![RouteConfig {
            source: source.into(),
            model: None,
        }],
        ..ModelConfig::default()
    };
    let big = |model: &str| {
        let mut r = at(0.0, "a long one");
        r.model = model.into();
        r.max_tokens = Some(100_000);
        r
    };
    for from_first in [false, true] {
        // Every source of the gateway is in a route: `down` only when it is used.
        let pool = pool(if from_first {
            sources[1..].to_vec()
        } else {
            sources.to_vec()
        });
        let gw = gateway(
            &pool,
            |c| {
                c.cache.fallback_ttl_s = Some(20.0);
                // `a`: down, then `b` (too small); or `a` too small itself.
                let mut first = routed(if from_first { "small" } else { "down" });
                if !from_first {
                    first.fallback = vec!["b".into()];
                }
                first.context_fallback = vec!["c".into()];
                c.models.insert("a".into(), first);
                c.models.insert("b".into(), routed("small"));
                c.models.insert("c".into(), routed("large"));
            },
            &MemorySink::new(),
        )
        .await;
        let a = gw.chat(big("a")).await.unwrap();
        assert_eq!(a.group, "c", "the context fallback answered");
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(gw.chat(big("a")).await.unwrap().cache_hit, "within the short TTL");
        tokio::time::advance(Duration::from_secs(15)).await;
        assert_eq!(
            gw.chat(big("a")).await.unwrap().cache_hit,
            from_first,
            "past the short TTL: kept only when the first group was too large"
        );
    }
}

/// A content filter's verdict is kept only `fallback_ttl_s`: it absorbs a burst of the
/// same prompt, but one provider's filter does not answer for the pool for the whole
/// TTL (another source may take the prompt). Streamed or not.
#[tokio::test(start_paused = true)]
async fn a_content_filters_verdict_is_kept_only_briefly() {
    let filtering = pgw_sim::SourceConfig {
        content_filter_rate: 1.0.into(),
        ..pgw_sim::SourceConfig::quick("a")
    };
    let pool = pool(vec![filtering]);
    let gw = gateway(&pool, |c| c.cache.fallback_ttl_s = Some(20.0), &MemorySink::new()).await;
    for (i, stream) in [false, true].into_iter().enumerate() {
        let mut req = at(0.0, &format!("filtered {i}"));
        req.stream = stream;
        let a = gw.chat(req.clone()).await.unwrap();
        assert!(a.answer.response.is_declined() && !a.cache_hit);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(
            gw.chat(req.clone()).await.unwrap().cache_hit,
            "within the short TTL"
        );
        tokio::time::advance(Duration::from_secs(15)).await;
        assert!(
            !gw.chat(req).await.unwrap().cache_hit,
            "stream {stream}: past the short TTL the sources are asked again"
        );
    }
}

fn pool_of_one() -> SimPool {
    pool(vec![pgw_sim::SourceConfig::quick("a")])
}

/// A streamed call neither leads nor follows identical calls: its flight would end
/// only with its stream's last chunk, pulled as its caller reads. Here the caller
/// reads one chunk and holds the stream; an identical call made meanwhile goes
/// upstream at once instead of waiting on it (it waited until the process had
/// answered nothing for a minute).
#[tokio::test(start_paused = true)]
async fn an_identical_call_does_not_wait_on_a_held_stream() {
    let pool = pool(vec![pgw_sim::SourceConfig::quick("a")]);
    let gw = gateway(&pool, |_| {}, &MemorySink::new()).await;
    let mut held = gw.chat_stream(at(0.0, "the same question")).await.unwrap();
    assert!(!held.cache_hit());
    assert!(held.next().await.unwrap().is_ok(), "the first chunk");
    let start = tokio::time::Instant::now();
    let other = gw.chat(at(0.0, "the same question")).await.unwrap();
    assert!(!other.cache_hit);
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "waited {:?} on the held stream",
        start.elapsed()
    );
    assert_eq!(received(&pool), 2);
    drop(held);
}
