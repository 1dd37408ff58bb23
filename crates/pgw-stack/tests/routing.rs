//! Model routing through the gateway, against the simulator on tokio's paused clock:
//! public model names, routes keyed by source and upstream model, the fallback and
//! context-window fallback chains.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pgw_core::openai::ChatRequest;
use pgw_core::{BoxError, Outcome, UpstreamStatus, classify_error};
use pgw_sim::{PoolConfig, SimPool};
use pgw_stack::breaker::BreakerState;
use pgw_stack::client::box_transport;
use pgw_stack::{
    Gateway, GatewayConfig, GatewayError, MemorySink, ModelConfig, RouteConfig, SecretKey, SourceConfig,
};
use tokio::time::Instant;

const KEY: &str = "sk-virtual-0123456789";

fn pool(sources: Vec<pgw_sim::SourceConfig>) -> SimPool {
    let config = PoolConfig::of(sources);
    SimPool::new(config, 11).unwrap()
}

/// A simulated backend serving only `model`, answering within a second or two.
fn serving(name: &str, model: &str) -> pgw_sim::SourceConfig {
    pgw_sim::SourceConfig {
        models: Some(vec![model.into()]),
        ttft_s: pgw_sim::LogNormal::constant(0.5).into(),
        tokens_per_second: pgw_sim::LogNormal::constant(200.0).into(),
        error_latency_s: pgw_sim::LogNormal::constant(0.1).into(),
        ..pgw_sim::SourceConfig::healthy(name)
    }
}

fn model(routes: &[(&str, Option<&str>)]) -> ModelConfig {
    ModelConfig {
        routes: routes
            .iter()
            .map(|(source, model)| RouteConfig {
                source: (*source).into(),
                model: model.map(Into::into),
            })
            .collect(),
        ..ModelConfig::default()
    }
}

fn source(name: &str) -> SourceConfig {
    let mut s = SourceConfig::new(name, format!("http://sim.invalid/{name}/v1"), SecretKey::new(KEY));
    s.total_timeout_s = Some(60.0);
    s
}

/// One provider (one source, one key) whose models are served by different simulated
/// backends: `backend_of(model)` names the simulator source that answers it. So one
/// model can be rate limited or broken while the provider's other models are fine.
async fn gateway(pool: &SimPool, mut cfg: GatewayConfig, sink: &MemorySink) -> Gateway {
    cfg.cache.enabled = false;
    let p = pool.clone();
    Gateway::builder(cfg)
        .sink(Arc::new(sink.clone()))
        .transport(move |sc: &SourceConfig| -> Result<_, BoxError> {
            let p = p.clone();
            let name = sc.name.clone();
            let by_model = tower::service_fn(move |req: http::Request<Bytes>| {
                let p = p.clone();
                let name = name.clone();
                async move {
                    let body: serde_json::Value = serde_json::from_slice(req.body())?;
                    let model = body["model"].as_str().unwrap_or_default();
                    let backend = format!("{name}-{model}");
                    let mut svc = p
                        .service(&backend)
                        .or_else(|| p.service(&name))
                        .ok_or("unknown sim source")?;
                    tower::Service::call(&mut svc, req).await
                }
            });
            Ok(box_transport(by_model))
        })
        .build()
        .await
        .unwrap()
}

fn two_models_on_one_provider() -> GatewayConfig {
    let mut cfg = GatewayConfig::default();
    cfg.sources.push(source("prov"));
    cfg.models.insert("gpt-4o".into(), model(&[("prov", None)]));
    cfg.models.insert("gpt-4o-mini".into(), model(&[("prov", None)]));
    cfg
}

/// Model `primary` served by source `a` (upstream model `big`), falling back to model
/// `backup` served by source `b` (`small`).
fn primary_and_backup(a: SourceConfig, b: SourceConfig) -> GatewayConfig {
    let mut cfg = GatewayConfig::default();
    cfg.sources.push(a);
    cfg.sources.push(b);
    let mut primary = model(&[("a", Some("big"))]);
    primary.fallback = vec!["backup".into()];
    cfg.models.insert("primary".into(), primary);
    cfg.models.insert("backup".into(), model(&[("b", Some("small"))]));
    cfg
}

/// The pool of [`primary_and_backup`] with the backup's context window 4096 tokens,
/// and source `a` at 1 request a minute.
fn primary_at_one_rpm_and_a_small_backup() -> (SimPool, SourceConfig) {
    let small = pgw_sim::SourceConfig {
        context_window: Some(4096),
        ..serving("b", "small")
    };
    let mut a = source("a");
    a.rpm = Some(1);
    (pool(vec![serving("a", "big"), small]), a)
}

async fn breaker_of(gw: &Gateway, route: &str) -> BreakerState {
    let h = gw.sources().iter().find(|h| h.route.as_str() == route).unwrap();
    h.breaker.view().await.unwrap().state
}

fn received(pool: &SimPool, backend: &str) -> u64 {
    pool.stats().sources[backend].received
}

#[tokio::test(start_paused = true)]
async fn one_models_faults_leave_the_providers_other_model_alone() {
    let broken = pgw_sim::SourceConfig {
        server_error_rate: 1.0.into(),
        ..serving("prov-gpt-4o", "gpt-4o")
    };
    let pool = pool(vec![broken, serving("prov-gpt-4o-mini", "gpt-4o-mini")]);
    let mut cfg = two_models_on_one_provider();
    cfg.breaker.fail_threshold = Some(2);
    let gw = gateway(&pool, cfg, &MemorySink::new()).await;
    assert_eq!(gw.models(), ["gpt-4o", "gpt-4o-mini"]);
    let routes: Vec<_> = gw.sources().iter().map(|h| h.route.to_string()).collect();
    assert_eq!(routes, ["prov/gpt-4o", "prov/gpt-4o-mini"]);

    for i in 0..2 {
        gw.chat(ChatRequest::user("gpt-4o", format!("q{i}")))
            .await
            .unwrap_err();
    }
    assert_eq!(breaker_of(&gw, "prov/gpt-4o").await, BreakerState::Open);
    assert_eq!(breaker_of(&gw, "prov/gpt-4o-mini").await, BreakerState::Closed);
    // Before, breakers were per source: the provider was closed for every model.
    for i in 0..3 {
        let a = gw
            .chat(ChatRequest::user("gpt-4o-mini", format!("m{i}")))
            .await
            .unwrap();
        assert_eq!(a.group, "gpt-4o-mini");
        assert_eq!(a.source.as_ref().unwrap().as_str(), "prov");
        assert_eq!(a.answer.response.model, "gpt-4o-mini");
    }
    assert_eq!(received(&pool, "prov-gpt-4o-mini"), 3, "one attempt each");
    assert_eq!(gw.health("prov/gpt-4o-mini"), Some(1.0), "health is per route");
    assert!(gw.health("prov/gpt-4o").unwrap() < 1.0);
}

#[tokio::test(start_paused = true)]
async fn a_models_429_holds_that_route_not_the_provider() {
    let gated = pgw_sim::SourceConfig {
        rpm_gate: Some(1).into(),
        ..serving("prov-gpt-4o", "gpt-4o")
    };
    let pool = pool(vec![gated, serving("prov-gpt-4o-mini", "gpt-4o-mini")]);
    let gw = gateway(&pool, two_models_on_one_provider(), &MemorySink::new()).await;
    gw.chat(ChatRequest::user("gpt-4o", "first")).await.unwrap();
    // The second gpt-4o call gets a 429 (one request per minute) and waits it out.
    let waiting = tokio::spawn({
        let gw = gw.clone();
        async move { gw.chat(ChatRequest::user("gpt-4o", "second")).await }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(pool.stats().sources["prov-gpt-4o"].rate_limited, 1);
    let held = gw.sources()[0].limiter.held().await.unwrap();
    assert_eq!(held.source.hold_ends_in, None, "the source is not held: {held:?}");
    // Before, the 429 held the source (and its account): every model waited.
    let start = Instant::now();
    let a = gw
        .chat(ChatRequest::user("gpt-4o-mini", "meanwhile"))
        .await
        .unwrap();
    assert_eq!(a.group, "gpt-4o-mini");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "answered at once: {:?}",
        start.elapsed()
    );
    assert!(!waiting.is_finished(), "gpt-4o is still held");
    waiting.abort();
}

#[tokio::test(start_paused = true)]
async fn a_typo_in_the_model_touches_no_source() {
    let pool = pool(vec![
        serving("prov-gpt-4o", "gpt-4o"),
        serving("prov-gpt-4o-mini", "gpt-4o-mini"),
    ]);
    let sink = MemorySink::new();
    let gw = gateway(&pool, two_models_on_one_provider(), &sink).await;
    for _ in 0..5 {
        let err = gw
            .chat(ChatRequest::user("gpt-4o-mimi", "hello"))
            .await
            .unwrap_err();
        assert_eq!(classify_error(&*err), Outcome::Rejected, "{err}");
        let status = UpstreamStatus::find(&*err).expect("an OpenAI-shaped error");
        assert_eq!(status.status(), 404);
        assert_eq!(status.code(), Some("model_not_found"));
        let provider = status.provider().unwrap();
        assert_eq!(provider.kind.as_deref(), Some("invalid_request_error"));
        assert_eq!(provider.param.as_deref(), Some("model"));
        assert!(provider.message.contains("gpt-4o-mimi"), "{provider:?}");
        let g = err.downcast_ref::<GatewayError>().unwrap();
        assert_eq!(g.failures().len(), 1);
    }
    let stats = pool.stats();
    assert_eq!(stats.sources.values().map(|s| s.received).sum::<u64>(), 0);
    assert!(sink.records().is_empty(), "no attempt");
    for h in gw.sources() {
        assert_eq!(h.breaker.view().await.unwrap().state, BreakerState::Closed);
    }
}

/// Model `chat` on a source with a 4k window, its context fallback `long` on one with
/// a 200k window.
async fn chat_with_a_long_context_fallback() -> (SimPool, MemorySink, Gateway) {
    let small = pgw_sim::SourceConfig {
        context_window: Some(4096),
        ..serving("small", "m-8k")
    };
    let large = pgw_sim::SourceConfig {
        context_window: Some(200_000),
        ..serving("large", "m-200k")
    };
    let pool = pool(vec![small, large]);
    let mut cfg = GatewayConfig::default();
    cfg.sources.push(source("small"));
    cfg.sources.push(source("large"));
    let mut short = model(&[("small", Some("m-8k"))]);
    short.context_fallback = vec!["long".into()];
    cfg.models.insert("chat".into(), short);
    cfg.models
        .insert("long".into(), model(&[("large", Some("m-200k"))]));
    let sink = MemorySink::new();
    let gw = gateway(&pool, cfg, &sink).await;
    (pool, sink, gw)
}

#[tokio::test(start_paused = true)]
async fn a_request_too_large_for_the_model_lands_on_its_context_fallback() {
    let (pool, _sink, gw) = chat_with_a_long_context_fallback().await;

    let fits = gw.chat(ChatRequest::user("chat", "hello")).await.unwrap();
    assert_eq!(fits.group, "chat");
    assert_eq!(fits.source.as_ref().unwrap().as_str(), "small");

    let mut big = ChatRequest::user("chat", "a long one");
    big.max_tokens = Some(100_000);
    let a = gw.chat(big).await.unwrap();
    assert_eq!(a.group, "long", "the context fallback answered");
    assert_eq!(a.source.as_ref().unwrap().as_str(), "large");
    assert_eq!(a.answer.response.model, "m-200k");
    assert_eq!(
        pool.stats().sources["small"].context_length_exceeded,
        1,
        "the only route asked once, not once per attempt of the budget"
    );
    assert_eq!(
        breaker_of(&gw, "small/m-8k").await,
        BreakerState::Closed,
        "too large is not the source's fault"
    );

    // A model without a context fallback hands the provider's answer to the caller.
    let mut too_big = ChatRequest::user("long", "far too long");
    too_big.max_tokens = Some(1_000_000);
    let err = gw.chat(too_big).await.unwrap_err();
    let status = UpstreamStatus::find(&*err).unwrap();
    assert_eq!(status.code(), Some("context_length_exceeded"));
}

/// A call limited to some models (an API key's list, `AllowedModels`) is not carried
/// by a fallback chain to another: the provider's answer comes back instead, and the
/// other model's source is never asked.
#[tokio::test(start_paused = true)]
async fn a_call_limited_to_its_model_does_not_fall_back_to_another() {
    let (pool, _sink, gw) = chat_with_a_long_context_fallback().await;
    let big = || {
        let mut r = ChatRequest::user("chat", "a long one");
        r.max_tokens = Some(100_000);
        pgw_stack::ChatCall::new(r)
    };

    let mut limited = big();
    limited
        .extensions_mut()
        .insert(pgw_stack::AllowedModels(Arc::from(vec!["chat".to_owned()])));
    let err = tower::ServiceExt::oneshot(gw.clone(), limited).await.unwrap_err();
    let status = UpstreamStatus::find(&*err).unwrap();
    assert_eq!(status.code(), Some("context_length_exceeded"));
    assert_eq!(
        pool.stats().sources["large"].received,
        0,
        "the fallback's source not asked"
    );

    // Allowed both (or no list): the context fallback answers, as before.
    let mut both = big();
    both.extensions_mut()
        .insert(pgw_stack::AllowedModels(Arc::from(vec![
            "chat".to_owned(),
            "long".to_owned(),
        ])));
    let a = tower::ServiceExt::oneshot(gw.clone(), both).await.unwrap();
    assert_eq!(a.group, "long");

    // A call naming a model outside its list: as if that model did not exist.
    let mut other = big();
    other
        .extensions_mut()
        .insert(pgw_stack::AllowedModels(Arc::from(vec!["long".to_owned()])));
    let err = tower::ServiceExt::oneshot(gw.clone(), other).await.unwrap_err();
    assert_eq!(
        UpstreamStatus::find(&*err).unwrap().code(),
        Some("model_not_found")
    );
}

#[tokio::test(start_paused = true)]
async fn a_route_that_refused_a_prompt_as_too_long_is_not_offered_one_as_long_first() {
    // One model over two routes of different windows, the small one faster (the
    // balancer prefers it): the first large prompt that meets the small window is
    // moved to the large one; later ones go there first.
    let small = pgw_sim::SourceConfig {
        context_window: Some(4096),
        ..serving("small", "m-8k")
    };
    let large = pgw_sim::SourceConfig {
        context_window: Some(200_000),
        ttft_s: pgw_sim::LogNormal::constant(3.0).into(),
        ..serving("large", "m-200k")
    };
    let pool = pool(vec![small, large]);
    let mut cfg = GatewayConfig::default();
    cfg.sources.push(source("small"));
    cfg.sources.push(source("large"));
    cfg.models.insert(
        "chat".into(),
        model(&[("small", Some("m-8k")), ("large", Some("m-200k"))]),
    );
    let sink = MemorySink::new();
    let gw = gateway(&pool, cfg, &sink).await;
    for i in 0..10 {
        gw.chat(ChatRequest::user("chat", format!("hello {i}")))
            .await
            .unwrap();
    }
    assert!(
        pool.stats().sources["small"].received >= 5,
        "short prompts prefer the fast source"
    );
    let long = "word ".repeat(8_000);
    for i in 0..20 {
        let mut big = ChatRequest::user("chat", format!("{long}{i}"));
        big.max_tokens = Some(50);
        let a = gw.chat(big).await.unwrap();
        assert_eq!(a.source.as_ref().unwrap().as_str(), "large");
    }
    let refused = pool.stats().sources["small"].context_length_exceeded;
    assert!(
        refused <= 1,
        "the small window refused {refused} of 20 large prompts"
    );
}

#[tokio::test(start_paused = true)]
async fn a_model_falls_back_to_another_when_its_routes_fail() {
    let down = pgw_sim::SourceConfig {
        server_error_rate: 1.0.into(),
        ..serving("a", "big")
    };
    let pool = pool(vec![down, serving("b", "small")]);
    let cfg = primary_and_backup(source("a"), source("b"));
    let gw = gateway(&pool, cfg, &MemorySink::new()).await;
    let a = gw.chat(ChatRequest::user("primary", "hi")).await.unwrap();
    assert_eq!(a.group, "backup");
    assert_eq!(a.answer.response.model, "small");
    // The fallback is not transitive, and "backup" has its own chain (none).
    let b = gw.chat(ChatRequest::user("backup", "hi")).await.unwrap();
    assert_eq!(b.group, "backup");
}

/// A request larger than a whole window of every primary route's token quota can
/// never be admitted there: the model's fallback takes it (the quota is the group's,
/// not the request's fault), without an attempt on the primary.
#[tokio::test(start_paused = true)]
async fn a_request_over_every_primary_quota_goes_to_the_fallback() {
    let pool = pool(vec![serving("a", "big"), serving("b", "small")]);
    let mut tight = source("a");
    tight.tpm = Some(1000);
    let cfg = primary_and_backup(tight, source("b"));
    let gw = gateway(&pool, cfg, &MemorySink::new()).await;

    let mut small = ChatRequest::user("primary", "hi");
    small.max_tokens = Some(100);
    let fits = gw.chat(small).await.unwrap();
    assert_eq!(fits.group, "primary", "a request within the quota stays");
    let mut large = ChatRequest::user("primary", "hi");
    large.max_tokens = Some(5000);
    let a = gw.chat(large).await.unwrap();
    assert_eq!(
        a.group, "backup",
        "never admitted by the primary: its fallback answered"
    );
    assert_eq!(received(&pool, "a"), 1, "no attempt on the primary");
}

/// R3: a call the primary's quota refuses goes on at once to the fallback instead of
/// waiting for the primary; when every group refuses it, it waits, on the primary
/// first.
#[tokio::test(start_paused = true)]
async fn a_primary_at_its_quota_hands_the_call_to_the_fallback_at_once() {
    let pool = pool(vec![serving("a", "big"), serving("b", "small")]);
    let [a, b] = ["a", "b"].map(|name| {
        let mut s = source(name);
        s.rpm = Some(1);
        s
    });
    let cfg = primary_and_backup(a, b);
    let gw = gateway(&pool, cfg, &MemorySink::new()).await;
    let ask = || {
        let mut r = ChatRequest::user("primary", "hi");
        r.max_tokens = Some(10);
        gw.chat(r)
    };

    let t0 = Instant::now();
    assert_eq!(ask().await.unwrap().group, "primary");
    let t1 = Instant::now();
    // The caller's own history: its "may wait" is given back once the gateway is done.
    let history = pgw_core::CallHistory::new();
    let mut call = pgw_stack::ChatCall::new({
        let mut r = ChatRequest::user("primary", "hi");
        r.max_tokens = Some(10);
        r
    });
    pgw_core::CarriesHistory::set_call_history(&mut call, history.clone());
    let second = tower::ServiceExt::oneshot(gw.clone(), call).await.unwrap();
    assert!(
        history.sources().is_some(),
        "the gateway used the caller's history"
    );
    assert!(history.may_wait(), "the flag was given back");
    assert_eq!(
        second.group, "backup",
        "the primary's quota is spent: the fallback answers"
    );
    assert!(
        t1.elapsed() < Duration::from_secs(5),
        "at once, not after the primary's minute: {:?}",
        t1.elapsed()
    );
    // Both quotas spent: the call waits, for the primary (its minute ends first here,
    // and it is the one the caller named).
    let third = ask().await.unwrap();
    assert_eq!(third.group, "primary");
    assert!(t0.elapsed() >= Duration::from_secs(60), "{:?}", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(70), "{:?}", t0.elapsed());
    assert_eq!((received(&pool, "a"), received(&pool, "b")), (2, 1));
}

/// A route serving two public models records each call's attempts under the model the
/// call named: before, every attempt through the route was recorded under the first
/// of them (in name order), and cost and counts per model were misattributed.
#[tokio::test(start_paused = true)]
async fn a_route_shared_by_two_models_records_attempts_under_the_called_one() {
    let pool = pool(vec![serving("a", "big")]);
    let mut cfg = GatewayConfig::default();
    cfg.sources.push(source("a"));
    cfg.models.insert("alpha".into(), model(&[("a", Some("big"))]));
    cfg.models.insert("zeta".into(), model(&[("a", Some("big"))]));
    let sink = MemorySink::new();
    let gw = gateway(&pool, cfg, &sink).await;
    for name in ["zeta", "alpha"] {
        let answer = gw.chat(ChatRequest::user(name, "hi")).await.unwrap();
        assert_eq!(answer.group, name);
    }
    let groups: Vec<String> = sink.records().into_iter().map(|r| r.group).collect();
    assert_eq!(groups, ["zeta", "alpha"]);
}

/// A fallback's request error hands the call on, as in the second pass, whatever the
/// primary failed of: the primary answers 5xx, the backup rejects the request as too
/// large for its model (no context chain), and the third group answers. Before, the
/// backup's 400 ended the call in the first pass (and not when the primary had been
/// refused for now instead).
#[tokio::test(start_paused = true)]
async fn a_fallbacks_request_error_hands_the_call_on_after_a_failed_primary() {
    let broken = pgw_sim::SourceConfig {
        server_error_rate: 1.0.into(),
        ..serving("a", "big")
    };
    let small = pgw_sim::SourceConfig {
        context_window: Some(4096),
        ..serving("b", "small")
    };
    let pool = pool(vec![broken, small, serving("c", "large")]);
    let mut cfg = primary_and_backup(source("a"), source("b"));
    cfg.sources.push(source("c"));
    cfg.models.get_mut("primary").unwrap().fallback = vec!["backup".into(), "third".into()];
    cfg.models.insert("third".into(), model(&[("c", Some("large"))]));
    let gw = gateway(&pool, cfg, &MemorySink::new()).await;
    let mut large = ChatRequest::user("primary", "a long one");
    large.max_tokens = Some(10_000);
    let answer = gw.chat(large).await.unwrap();
    assert_eq!(answer.group, "third");
    assert!(received(&pool, "a") >= 1, "the primary was asked");
    assert!(
        pool.stats().sources["b"].context_length_exceeded >= 1,
        "the backup was asked, and rejected it"
    );
}

/// The second pass is not skipped by a fallback's request error: a call the primary's
/// quota refused for now and the backup rejects (too large for it, no context chain)
/// waits for the primary, which takes it.
#[tokio::test(start_paused = true)]
async fn a_fallbacks_rejection_does_not_end_a_call_the_primary_can_take_later() {
    let (pool, a) = primary_at_one_rpm_and_a_small_backup();
    let cfg = primary_and_backup(a, source("b"));
    let gw = gateway(&pool, cfg, &MemorySink::new()).await;

    let t0 = Instant::now();
    let mut first = ChatRequest::user("primary", "hi");
    first.max_tokens = Some(10);
    assert_eq!(gw.chat(first).await.unwrap().group, "primary");
    let mut large = ChatRequest::user("primary", "a long one");
    large.max_tokens = Some(10_000);
    let a = gw.chat(large).await.unwrap();
    assert_eq!(a.group, "primary", "the backup's 400 did not end the call");
    assert!(t0.elapsed() >= Duration::from_secs(59), "{:?}", t0.elapsed());
    assert!(
        pool.stats().sources["b"].context_length_exceeded >= 1,
        "the backup was asked first"
    );
}

/// In the second pass a fallback asked first (its slot frees before the primary's
/// minute ends) that rejects the request does not end the call: the primary, asked
/// after it, takes it.
#[tokio::test(start_paused = true)]
async fn a_fallbacks_rejection_in_the_second_pass_leaves_the_primary_its_turn() {
    let (pool, a) = primary_at_one_rpm_and_a_small_backup();
    let mut b = source("b");
    b.max_concurrency = Some(1);
    let gw = gateway(&pool, primary_and_backup(a, b), &MemorySink::new()).await;
    let ask = |model: &str, max_tokens: u64| {
        let mut r = ChatRequest::user(model, "hi");
        r.max_tokens = Some(max_tokens);
        gw.chat(r)
    };

    let t0 = Instant::now();
    assert_eq!(ask("primary", 10).await.unwrap().group, "primary");
    // The backup's one slot, held for about 15 s (3000 tokens at 200 a second).
    let busy = tokio::spawn({
        let gw = gw.clone();
        async move {
            let mut r = ChatRequest::user("backup", "a long answer");
            r.max_tokens = Some(3000);
            gw.chat(r).await
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Too large for the backup, refused for now by both: the backup's slot frees
    // first, it rejects the request, and the primary's minute ends.
    let a = ask("primary", 10_000).await.unwrap();
    assert_eq!(a.group, "primary", "the backup's rejection did not end the call");
    assert!(t0.elapsed() >= Duration::from_secs(59), "{:?}", t0.elapsed());
    assert_eq!(busy.await.unwrap().unwrap().group, "backup");
    assert!(
        pool.stats().sources["b"].context_length_exceeded >= 1,
        "the backup was asked, and rejected it"
    );
}

/// When the second pass fails too, its failure is the call's last word, not the
/// fallback's request error of the first pass: a deadline that ends the wait for the
/// primary is reported as such (a 429 or 504 to a server's caller, not a 400 it
/// would not retry).
#[tokio::test(start_paused = true)]
async fn the_second_pass_failure_is_reported_after_a_fallbacks_rejection() {
    let (pool, a) = primary_at_one_rpm_and_a_small_backup();
    let gw = gateway(&pool, primary_and_backup(a, source("b")), &MemorySink::new()).await;
    let mut first = ChatRequest::user("primary", "hi");
    first.max_tokens = Some(10);
    assert_eq!(gw.chat(first).await.unwrap().group, "primary");
    let mut large = ChatRequest::user("primary", "a long one");
    large.max_tokens = Some(10_000);
    let mut call = pgw_stack::ChatCall::new(large);
    call.extensions_mut().insert(pgw_stack::retry::CallDeadline(
        Instant::now() + Duration::from_secs(30),
    ));
    let err = tower::ServiceExt::oneshot(gw.clone(), call).await.unwrap_err();
    let gateway_error = err.downcast_ref::<GatewayError>().unwrap();
    let reason = gateway_error
        .last_retry_error()
        .map(pgw_stack::retry::RetryError::reason);
    assert!(
        matches!(reason, Some(pgw_stack::retry::Reason::WaitTooLong { .. })),
        "the primary's wait ended the call, not the backup's 400: {err}"
    );
    assert!(
        pool.stats().sources["b"].context_length_exceeded >= 1,
        "the backup's 400 came first"
    );
}

/// The call's last word is what came last: a fallback's request error in the second
/// pass, not its own refusal for now from the first (a stale 429 to a server's caller).
#[tokio::test(start_paused = true)]
async fn the_last_failure_is_the_last_that_came() {
    let down = pgw_sim::SourceConfig {
        server_error_rate: 1.0.into(),
        ..serving("a", "big")
    };
    let policy = pgw_sim::SourceConfig {
        content_policy_rate: 1.0.into(),
        ..serving("b", "small")
    };
    let pool = pool(vec![down, policy]);
    let mut b = source("b");
    b.rpm = Some(1);
    let gw = gateway(&pool, primary_and_backup(source("a"), b), &MemorySink::new()).await;
    // The backup's one request of the minute.
    let mut r = ChatRequest::user("backup", "hi");
    r.max_tokens = Some(10);
    assert!(gw.chat(r).await.is_err(), "the backup refuses every prompt");
    // The primary fails (5xx), the backup refuses for now, then rejects the prompt.
    let err = gw.chat(ChatRequest::user("primary", "hi")).await.unwrap_err();
    let reason = err
        .downcast_ref::<GatewayError>()
        .unwrap()
        .last_retry_error()
        .map(pgw_stack::retry::RetryError::reason);
    assert_eq!(reason, Some(pgw_stack::retry::Reason::Rejected), "{err}");
}

/// The primary too small for the request, with no context chain, ends the call in the
/// second pass as it does in the first: the provider's 400, not a fallback taking a
/// request the model the caller named cannot.
#[tokio::test(start_paused = true)]
async fn the_primary_too_small_ends_the_second_pass_without_a_context_chain() {
    let small = pgw_sim::SourceConfig {
        context_window: Some(4096),
        ..serving("a", "big")
    };
    let pool = pool(vec![small, serving("b", "small")]);
    let [a, b] = ["a", "b"].map(|name| {
        let mut s = source(name);
        s.rpm = Some(1);
        s
    });
    let gw = gateway(&pool, primary_and_backup(a, b), &MemorySink::new()).await;
    for model in ["primary", "backup"] {
        let mut r = ChatRequest::user(model, "hi");
        r.max_tokens = Some(10);
        assert_eq!(gw.chat(r).await.unwrap().group, model);
    }
    let mut large = ChatRequest::user("primary", "a long one");
    large.max_tokens = Some(10_000);
    let err = gw.chat(large).await.unwrap_err();
    let status = UpstreamStatus::find(&*err).expect("the provider's answer");
    assert_eq!(status.code(), Some("context_length_exceeded"), "{err}");
    assert_eq!(received(&pool, "b"), 1, "the backup was not asked to take it");
}

/// A group asked again in the second pass that the request does not fit hands the
/// call to the context-window chain, as in the first pass.
#[tokio::test(start_paused = true)]
async fn the_second_pass_follows_the_context_chain() {
    let window = |name: &str, model: &str, w: u64| pgw_sim::SourceConfig {
        context_window: Some(w),
        ..serving(name, model)
    };
    let pool = pool(vec![
        window("small", "m-8k", 4096),
        window("other", "o-8k", 4096),
        window("large", "m-200k", 200_000),
    ]);
    let mut cfg = GatewayConfig::default();
    for name in ["small", "other"] {
        let mut s = source(name);
        s.rpm = Some(1);
        cfg.sources.push(s);
    }
    cfg.sources.push(source("large"));
    let mut chat = model(&[("small", Some("m-8k"))]);
    chat.fallback = vec!["other".into()];
    chat.context_fallback = vec!["long".into()];
    cfg.models.insert("chat".into(), chat);
    cfg.models
        .insert("other".into(), model(&[("other", Some("o-8k"))]));
    cfg.models
        .insert("long".into(), model(&[("large", Some("m-200k"))]));
    let gw = gateway(&pool, cfg, &MemorySink::new()).await;
    let ask = |model: &str, max_tokens: u64| {
        let mut r = ChatRequest::user(model, "hi");
        r.max_tokens = Some(max_tokens);
        gw.chat(r)
    };
    // Both quotas spent.
    assert_eq!(ask("chat", 10).await.unwrap().group, "chat");
    assert_eq!(ask("other", 10).await.unwrap().group, "other");
    // Too large for both: refused for now by each, then asked again waiting, the
    // primary first; it says the request does not fit, and the context chain answers.
    let a = ask("chat", 100_000).await.unwrap();
    assert_eq!(a.group, "long");
    assert_eq!(pool.stats().sources["small"].context_length_exceeded, 1);
}

#[test]
fn routing_config_errors_name_the_field() {
    let base = r#"
        [[sources]]
        name = "p"
        base_url = "http://127.0.0.1:9/v1"
        key = "sk-x"
    "#;
    let cases = [
        ("[models.a]\nroutes = []", "models.a.routes"),
        (
            "[models.a]\nroutes = [{ source = \"nope\" }]",
            "models.a.routes[0].source",
        ),
        (
            "[models.a]\nroutes = [{ source = \"p\" }]\nfallback = [\"b\"]",
            "models.a.fallback[0]",
        ),
        (
            "[models.a]\nroutes = [{ source = \"p\" }]\ncontext_fallback = [\"a\"]",
            "models.a.context_fallback[0]",
        ),
        (
            "[models.a]\nroutes = [{ source = \"p\" }, { source = \"p\", model = \"a\" }]",
            "models.a.routes[1]",
        ),
        (
            "fallback = [\"default\"]\n[models.a]\nroutes = [{ source = \"p\" }]",
            "fallback",
        ),
        (
            "[models.a]\nroutes = [{ source = \"p\", modle = \"x\" }]",
            "models.a.routes[0].modle",
        ),
    ];
    for (extra, field) in cases {
        // `fallback` is a top-level key: it must come before any table.
        let text = if extra.starts_with("fallback") {
            format!("{extra}\n{base}")
        } else {
            format!("{base}\n{extra}")
        };
        let err = GatewayConfig::from_toml_str(&text).unwrap_err();
        assert_eq!(err.field(), field, "{extra}: {err}");
    }
}

/// One upstream model behind two public models (one route in two groups): a slot the
/// route frees wakes a waiter of either group at once, not at the balancer's next
/// safety poll (a second). Before, only the first group's waiters heard of it (the
/// second model's call was served 1.1 s after the first's answer plus its own service
/// time; 0.05-0.2 s now, as within one model).
#[tokio::test(start_paused = true)]
async fn a_route_shared_by_two_models_wakes_either_models_waiter() {
    // Every answer the same length: the same service time.
    let fixed = pgw_sim::SourceConfig {
        completion: pgw_sim::CompletionConfig {
            min_fraction: 0.5,
            max_fraction: 0.5,
            ..pgw_sim::CompletionConfig::default()
        },
        ..serving("prov-m", "m")
    };
    let pool = pool(vec![fixed]);
    let mut cfg = GatewayConfig::default();
    let mut prov = source("prov");
    prov.max_concurrency = Some(1);
    cfg.sources.push(prov);
    cfg.models.insert("fast".into(), model(&[("prov", Some("m"))]));
    cfg.models.insert("smart".into(), model(&[("prov", Some("m"))]));
    let gw = gateway(&pool, cfg, &MemorySink::new()).await;
    assert_eq!(gw.sources().len(), 1, "one route");

    // The same model first: the wake-up every balancer had before (its control).
    for (first, second) in [("fast", "fast"), ("fast", "smart"), ("smart", "fast")] {
        let start = Instant::now();
        let a = tokio::spawn({
            let gw = gw.clone();
            async move {
                gw.chat(ChatRequest::user(first, "a")).await.unwrap();
                Instant::now()
            }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        let b = tokio::spawn({
            let gw = gw.clone();
            async move {
                gw.chat(ChatRequest::user(second, "b")).await.unwrap();
                Instant::now()
            }
        });
        let a_end = a.await.unwrap();
        let b_end = b.await.unwrap();
        let service = a_end - start;
        assert!(
            b_end - a_end < service + Duration::from_millis(500),
            "{second} waited for {first}'s slot: admitted at its release, then served in \
             {service:?}; took {:?}",
            b_end - a_end
        );
        assert!(
            b_end - a_end >= service,
            "one slot: {second} waited for {first}: {service:?} {:?}",
            b_end - a_end
        );
    }
}
