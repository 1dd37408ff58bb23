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
