//! Hard provider limits seen by a plain client on the paused clock: token buckets whose
//! 429 carries the exact refill time, `x-ratelimit-*` headers that count down, request
//! too large, the concurrency cap, over the tower Service and over HTTP.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{json_request, raw, read};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use pgw_sim::{PoolConfig, SimPool};
use serde_json::json;
use tokio::time::{Instant, advance, sleep_until};
use tower_service::Service;

fn chat(max_tokens: u64) -> serde_json::Value {
    // 20 bytes of prompt: 5 tokens + 4 per message = 9 prompt tokens.
    json!({"model": "gpt-x", "messages": [{"role": "user", "content": "twenty bytes, exact."}], "max_tokens": max_tokens})
}

fn pool(v: serde_json::Value) -> SimPool {
    let mut v = v;
    v["bad_prompt_rate"] = json!(0.0);
    SimPool::new(serde_json::from_value::<PoolConfig>(v).unwrap(), 3).unwrap()
}

/// Sends seven requests to source `k` of `p` (not awaited: admitted, in flight) and an
/// eighth, read: a bucket of 7 RPM refuses it.
async fn seven_then_one(
    p: &SimPool,
) -> (
    Vec<<pgw_sim::SimService as Service<http::Request<Bytes>>>::Future>,
    common::Raw,
) {
    let mut svc = p.service("k").unwrap();
    let admitted = (0..7).map(|_| svc.call(json_request(&chat(10), None))).collect();
    let refused = read(svc.call(json_request(&chat(10), None)).await.unwrap()).await;
    (admitted, refused)
}

/// `limit_retry_after = false`: the 429 of a hard limit as OpenAI sends it, the wait only
/// in the message and the `x-ratelimit-*` headers.
#[tokio::test(start_paused = true)]
async fn a_limit_without_retry_after_names_its_wait_in_the_message_only() {
    let p = pool(json!({"sources": [{"name": "k", "limits": {"rpm": 7}, "limit_retry_after": false}]}));
    let (admitted, refused) = seven_then_one(&p).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("retry-after"), None);
    assert_eq!(refused.header("retry-after-ms"), None);
    assert_eq!(refused.header("x-ratelimit-remaining-requests"), Some("0"));
    assert_eq!(refused.header("x-ratelimit-reset-requests"), Some("1m0s"));
    let message = refused.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.ends_with("Please try again in 8.572s."), "{message}");
    drop(admitted);
}

#[tokio::test(start_paused = true)]
async fn an_rpm_bucket_announces_its_exact_refill_and_keeps_its_word() {
    // 7 per minute: one request every 60/7 s = 8.571428572 s (rounded up to the ns).
    let p = pool(json!({"sources": [{"name": "k", "limits": {"rpm": 7}}]}));
    let start = Instant::now();
    let (admitted, refused) = seven_then_one(&p).await;
    assert_eq!(refused.status, 429);
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "a hard-limit 429 is answered at once"
    );
    assert_eq!(refused.header("retry-after"), Some("9"));
    assert_eq!(refused.header("retry-after-ms"), Some("8572"));
    assert_eq!(refused.header("x-ratelimit-limit-requests"), Some("7"));
    assert_eq!(refused.header("x-ratelimit-remaining-requests"), Some("0"));
    assert_eq!(refused.header("x-ratelimit-reset-requests"), Some("1m0s"));
    assert_eq!(
        refused.json(),
        json!({"error": {
            "message": "Rate limit reached for gpt-x in project k on requests per min (RPM): Limit 7, Used 7, Requested 1. Please try again in 8.572s.",
            "type": "requests", "param": null, "code": "rate_limit_exceeded"}})
    );
    // Remaining counts down on the admitted answers.
    let mut remaining = Vec::new();
    for f in admitted {
        let r = read(f.await.unwrap()).await;
        assert_eq!(r.status, 200);
        remaining.push(r.header("x-ratelimit-remaining-requests").unwrap().to_owned());
    }
    assert_eq!(remaining, ["6", "5", "4", "3", "2", "1", "0"]);
    // 1 ms before the announced instant: still refused; at it: admitted.
    let now = Instant::now();
    let p = pool(json!({"sources": [{"name": "k", "limits": {"rpm": 7}}]}));
    let mut svc = p.service("k").unwrap();
    for _ in 0..7 {
        drop(svc.call(json_request(&chat(10), None)));
    }
    advance(Duration::from_millis(8571)).await;
    let early = read(svc.call(json_request(&chat(10), None)).await.unwrap()).await;
    assert_eq!(early.status, 429);
    assert_eq!(early.header("retry-after-ms"), Some("1"));
    advance(Duration::from_millis(1)).await;
    let on_time = svc.call(json_request(&chat(10), None));
    assert_eq!(now.elapsed(), Duration::from_millis(8572));
    let on_time = read(on_time.await.unwrap()).await;
    assert_eq!(on_time.status, 200);
    assert_eq!(on_time.header("x-ratelimit-remaining-requests"), Some("0"));
    let st = p.stats();
    assert_eq!(
        (st.sources["k"].hard_limited, st.accounts["k"].hard_limited),
        (1, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn an_account_tpm_bucket_is_shared_and_refuses_what_can_never_fit() {
    let p = pool(json!({
        "sources": [{"name": "a", "account": "org"}, {"name": "b", "account": "org"}],
        "accounts": [{"name": "org", "limits": {"tpm": 1200}}],
    }));
    let mut a = p.service("a").unwrap();
    let mut b = p.service("b").unwrap();
    // 9 prompt tokens + 591 = 600 each: two fill the bucket, across both sources.
    let first = a.call(json_request(&chat(591), None));
    let second = b.call(json_request(&chat(591), None));
    let third = raw(&mut a, &chat(591), None).await;
    assert_eq!(third.status, 429);
    let e = third.json();
    assert_eq!(e["error"]["type"], "tokens");
    assert_eq!(e["error"]["code"], "rate_limit_exceeded");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(
        msg.starts_with("Rate limit reached for gpt-x in organization org on tokens per min (TPM): Limit 1200, Used 1200, Requested 600."),
        "{msg}"
    );
    // 600 tokens at 20 per second: 30 s.
    assert_eq!(third.header("retry-after"), Some("30"));
    assert_eq!(third.header("retry-after-ms"), Some("30000"));
    assert_eq!(third.header("x-ratelimit-limit-tokens"), Some("1200"));
    assert_eq!(third.header("x-ratelimit-remaining-tokens"), Some("0"));
    assert_eq!(third.header("x-ratelimit-reset-tokens"), Some("1m0s"));
    assert_eq!(
        third.header("x-ratelimit-limit-requests"),
        None,
        "no RPM limit set"
    );
    for f in [first, second] {
        let r = read(f.await.unwrap()).await;
        assert_eq!(r.status, 200);
    }
    // Larger than the bucket: refused for good, no hint.
    let huge = raw(&mut b, &chat(5000), None).await;
    assert_eq!(huge.status, 429);
    assert_eq!(huge.header("retry-after"), None);
    assert_eq!(huge.header("retry-after-ms"), None);
    let msg = huge.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        msg.starts_with("Request too large for gpt-x in organization org on tokens per min (TPM): Limit 1200, Requested 5009."),
        "{msg}"
    );
    assert_eq!(p.stats().accounts["org"].hard_limited, 2);
}

#[tokio::test(start_paused = true)]
async fn a_concurrency_cap_refuses_at_once_until_the_earliest_planned_end() {
    let p = pool(json!({"sources": [{"name": "c", "limits": {"concurrency": 2}}]}));
    let start = Instant::now();
    let mut svc = p.service("c").unwrap();
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let fut = svc.call(json_request(&chat(40), None));
        tasks.push(tokio::spawn(async move { read(fut.await.unwrap()).await.status }));
    }
    let refused = raw(&mut svc, &chat(40), None).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.json()["error"]["type"], "requests");
    let ms: u64 = refused.header("retry-after-ms").unwrap().parse().unwrap();
    assert!(ms > 500, "at least the minimum TTFT: {ms}");
    // 1 ms before the earliest planned end both are still in flight...
    sleep_until(start + Duration::from_millis(ms - 1)).await;
    let early = raw(&mut svc, &chat(40), None).await;
    assert_eq!(early.status, 429);
    assert_eq!(early.header("retry-after-ms"), Some("1"));
    // ...at it, one slot is free.
    sleep_until(start + Duration::from_millis(ms)).await;
    for _ in 0..3 {
        tokio::task::yield_now().await;
    }
    let fut = svc.call(json_request(&chat(40), None));
    assert_eq!(read(fut.await.unwrap()).await.status, 200);
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert_eq!(p.stats().sources["c"].hard_limited, 2);
}

#[tokio::test(start_paused = true)]
async fn a_slot_held_by_a_black_hole_has_no_known_end() {
    let p = pool(json!({
        "sources": [{"name": "hole", "account": "org", "black_hole_rate": 1.0}, {"name": "ok", "account": "org"}],
        "accounts": [{"name": "org", "limits": {"concurrency": 1}}],
    }));
    let mut hole = p.service("hole").unwrap();
    let swallowed = hole.call(json_request(&chat(5), None));
    let mut ok = p.service("ok").unwrap();
    let refused = raw(&mut ok, &chat(5), None).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("retry-after"), None);
    let msg = refused.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        msg.contains("in organization org on concurrent requests")
            && msg.ends_with("Please try again later."),
        "{msg}"
    );
    drop(swallowed); // the caller gives up: the slot is free
    assert_eq!(raw(&mut ok, &chat(5), None).await.status, 200);
}

#[tokio::test(start_paused = true)]
async fn a_hard_limit_429_over_http() {
    let p = pool(json!({"sources": [{"name": "k", "limits": {"rpm": 1}}]}));
    let (_, handle) = pgw_sim::http::serve(p.clone(), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let url = format!("{}/chat/completions", handle.base_url("k"));
    let post = || {
        http::Request::post(url.clone())
            .body(Full::new(Bytes::from(chat(5).to_string())))
            .unwrap()
    };
    let ok = client.request(post()).await.unwrap();
    assert_eq!(ok.status(), 200);
    assert_eq!(ok.headers()["x-ratelimit-remaining-requests"], "0");
    ok.into_body().collect().await.unwrap();
    let refused = client.request(post()).await.unwrap();
    assert_eq!(refused.status(), 429);
    let ms: u64 = refused.headers()["retry-after-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let secs: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    // One request per minute, less the time the first answer took.
    assert!(ms > 0 && ms <= 60_000, "{ms}");
    assert_eq!(secs, ms.div_ceil(1000));
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("in project k on requests per min (RPM)")
    );
    handle.shutdown().await;
}
