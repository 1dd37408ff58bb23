//! A tenant's quota holds across two servers sharing one Redis (a real server: run
//! with `cargo xtask test`, or `REDIS_URL=...`; without one this test fails).

mod support;

use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_quota_holds_across_two_servers_on_one_redis() {
    let Some(url) = pgw_test_support::redis_url() else {
        return;
    };
    let prefix = pgw_test_support::unique_prefix("tenant-quota");
    let top = format!("backend = \"redis\"\nredis_url = \"{url}\"\nkey_prefix = \"{prefix}\"\n");
    let keys = key_toml("shared-tenant", CLIENT_KEY, "rpm = 3\n");
    let a = start_with(&top, &keys, vec![fast("s1")]).await;
    let b = start_with(&top, &keys, vec![fast("s1")]).await;
    let mut statuses = Vec::new();
    for h in [&a, &b, &a, &b, &a] {
        let (status, headers, body) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
        if status == 429 {
            openai_error(&body, "rate_limit_exceeded");
            assert!(headers.contains_key("retry-after"));
        }
        statuses.push(status.as_u16());
    }
    // Three per window for the tenant, whichever server it calls.
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    for h in [&a, &b] {
        let (status, _, _) = call(h.addr, request("GET", "/readyz"), bytes::Bytes::new()).await;
        assert_eq!(status, 200, "the Redis backend answers");
    }
}

/// `/readyz` needs no key and is never shed: a client looping on it gets the last
/// probe's answer within a second, not a Redis round trip per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_probes_redis_at_most_once_a_second() {
    let redis = pgw_test_support::PrivateRedis::start();
    let top = format!("backend = \"redis\"\nredis_url = \"{}\"\n", redis.url());
    let h = start_with(&top, "", vec![fast("s1")]).await;
    // The first probe loads its script (a second EVALSHA after NOSCRIPT).
    let (status, _, _) = call(h.addr, request("GET", "/readyz"), bytes::Bytes::new()).await;
    assert_eq!(status, 200);
    let before = redis.command_calls("evalsha");
    let started = std::time::Instant::now();
    for _ in 0..20 {
        let (status, _, _) = call(h.addr, request("GET", "/readyz"), bytes::Bytes::new()).await;
        assert_eq!(status, 200);
    }
    let probes = redis.command_calls("evalsha") - before;
    // At most one probe per second begun (before: one per request, 20).
    let most = started.elapsed().as_secs() + 1;
    assert!(probes <= most, "{probes} probes in {:?}", started.elapsed());
}

/// Redis gone: a call on the Redis backend is refused with 503 `backend_unavailable`
/// and a `Retry-After` (the server's shed hint: the outage's end is not known), and
/// `/readyz` says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_is_503_with_retry_after_and_not_ready() {
    let mut redis = pgw_test_support::PrivateRedis::start();
    let top = format!("backend = \"redis\"\nredis_url = \"{}\"\n", redis.url());
    // A tenant quota, so every call asks Redis before its attempt.
    let server = format!(
        "shed_retry_after_s = 3\n{}",
        key_toml("t", CLIENT_KEY, "rpm = 100\n")
    );
    let h = start_with(&top, &server, vec![fast("s1")]).await;
    let (status, _, _) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
    assert_eq!(status, 200);
    redis.stop();
    let (status, headers, body) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&body));
    openai_error(&body, "backend_unavailable");
    assert_eq!(headers["retry-after"], "3");
    let (status, _, _) = call(h.addr, request("GET", "/readyz"), bytes::Bytes::new()).await;
    assert_eq!(status, 503);
}

/// A scrape while Redis hangs answers within one backend timeout, not one per route:
/// the breakers' views are read concurrently (each bounded by the 500 ms response
/// timeout), and the server answers with the gauges it has after 2 s at most. Read one
/// route at a time, 20 routes took 10 s, past Prometheus's scrape timeout. The bound
/// asserted (5 s) is a liveness bound with a wide margin, not a speed goal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_answer_while_redis_hangs() {
    let redis = pgw_test_support::PrivateRedis::start();
    let top = format!("backend = \"redis\"\nredis_url = \"{}\"\n", redis.url());
    let sources = (1..=20).map(|i| fast(&format!("s{i}"))).collect();
    let h = start_with(&top, "", sources).await;
    // The first scrape refreshes the gauges: with Redis hung, one breaker view per
    // route times out.
    redis.freeze();
    let started = std::time::Instant::now();
    let (status, _, body) = call(h.addr, request("GET", "/metrics"), bytes::Bytes::new()).await;
    let took = started.elapsed();
    redis.thaw();
    assert_eq!(status, 200);
    assert!(String::from_utf8_lossy(&body).contains("pgw_aimd_limit"));
    assert!(took < std::time::Duration::from_secs(5), "a scrape took {took:?}");
}

/// A tenant's settle is off the answer's path unless it holds a lease: with Redis not
/// answering, finishing a tokens-only permit returns at once (before, the answer waited
/// for the round trip, up to the settle's timeout), and the settle still lands ahead of
/// the tenant's next admission. A permit with a concurrency lease is awaited: a
/// strictly sequential client must find its slot free at its next call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_settle_waits_for_redis_only_with_a_lease() {
    use futures_util::FutureExt;
    let redis = pgw_test_support::PrivateRedis::start();
    let gateway = pgw_stack::GatewayConfig {
        backend: pgw_stack::BackendKind::Redis,
        redis_url: Some(redis.url()),
        ..Default::default()
    };
    let key = |label: &str, tpm, max_concurrency| pgw_server::KeyConfig {
        label: label.into(),
        sha256: pgw_server::hash_key(label),
        models: Vec::new(),
        rpm: None,
        tpm,
        max_concurrency,
    };
    let ring = pgw_server::KeyRing::new(
        &[key("tokens", Some(100), None), key("slots", None, Some(1))],
        &gateway,
    )
    .await
    .unwrap();
    let req: pgw_core::openai::ChatRequest = serde_json::from_value(serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 60,
    }))
    .unwrap();
    assert!(req.estimate_tokens() > 50, "two estimates exceed the 100 tokens");

    let slots = ring.find("slots").unwrap();
    let permit = slots.admit(&req).await.unwrap().unwrap();
    redis.freeze();
    let mut finish = Box::pin(permit.finish(None));
    let early = (&mut finish).now_or_never();
    redis.thaw();
    assert!(early.is_none(), "a lease's release is awaited");
    finish.await;
    // The slot is free for the next call.
    slots.admit(&req).await.unwrap().unwrap().finish(None).await;

    let tokens = ring.find("tokens").unwrap();
    let permit = tokens.admit(&req).await.unwrap().unwrap();
    redis.freeze();
    let finished = permit.finish(Some(0)).now_or_never();
    redis.thaw();
    assert!(finished.is_some(), "a permit without a lease waited for Redis");
    // The tokens reserved and not used came back before this admission: it fits (the
    // settle script is loaded by now: a first EVALSHA answered NOSCRIPT is sent again,
    // after whatever the caller sent meanwhile).
    let permit = tokens.admit(&req).await.unwrap().unwrap();
    permit.finish(None).await;
}
