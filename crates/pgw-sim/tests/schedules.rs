//! Faults that change over time, seen by a plain client on the paused clock: a flap
//! flips at exactly its instant, a ramp is halfway in its middle, phases switch, over
//! the tower Service and over HTTP.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{json_request, read};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use pgw_sim::{PoolConfig, SimPool};
use serde_json::json;
use tokio::time::{Instant, advance};
use tower_service::Service;

fn chat(stream: bool) -> serde_json::Value {
    json!({"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "stream": stream})
}

/// Moves the paused clock exactly to `start + at`.
async fn advance_to(start: Instant, at: Duration) {
    advance((start + at).saturating_duration_since(Instant::now())).await;
}

fn pool(source: &serde_json::Value) -> SimPool {
    let config: PoolConfig = serde_json::from_value(json!({
        "sources": [source],
        "bad_prompt_rate": 0.0,
    }))
    .unwrap();
    SimPool::new(config, 1).unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_flap_flips_at_exactly_the_scheduled_instant() {
    // 5xx for the first 30 s of every minute from t = 100 s; none before 100 s.
    let p = pool(&json!({
        "name": "a",
        "server_error_rate": {"flap": {"period_s": 60, "duty": 0.5, "on": 1.0, "off": 0.0, "start_s": 100}},
    }));
    let start = Instant::now();
    let mut svc = p.service("a").unwrap();
    let probes = [
        (99_999, 200),
        (100_000, 500),
        (129_999, 500),
        (130_000, 200),
        (159_999, 200),
        (160_000, 500),
    ];
    // Each request is decided when it is sent, so send them all first, then read.
    let mut pending = Vec::new();
    for (ms, want) in probes {
        advance_to(start, Duration::from_millis(ms)).await;
        assert_eq!(p.scenario_time_s(), ms as f64 / 1000.0);
        pending.push((ms, want, svc.call(json_request(&chat(false), None))));
    }
    for (ms, want, fut) in pending {
        let status = read(fut.await.unwrap()).await.status;
        let class = if (500..600).contains(&status) { 500 } else { status };
        assert_eq!(class, want, "at {ms} ms");
    }
    let cfg = &p.config().sources[0];
    assert_eq!(cfg.at(100.0).server_error_rate, 1.0);
    assert_eq!(cfg.at(99.999).server_error_rate, 0.0);
}

#[tokio::test(start_paused = true)]
async fn a_ramp_is_halfway_in_its_middle() {
    // TTFT ramps from a constant 1 s to a constant 11 s between t = 100 s and 200 s.
    let constant = |v: f64| json!({"median": v, "p95": v, "min": v, "max": v});
    let p = pool(&json!({
        "name": "a",
        "ttft_s": {"ramp": {"from_s": 100, "to_s": 200, "from": constant(1.0), "to": constant(11.0)}},
    }));
    let start = Instant::now();
    let mut svc = p.service("a").unwrap();
    let mut seen = Vec::new();
    for at_s in [50, 150, 175, 250] {
        advance_to(start, Duration::from_secs(at_s)).await;
        let sent = Instant::now();
        // A stream's headers go out at its TTFT.
        let resp = svc.call(json_request(&chat(true), None)).await.unwrap();
        seen.push((at_s, sent.elapsed()));
        drop(resp);
    }
    assert_eq!(
        seen,
        vec![
            (50, Duration::from_secs(1)),
            (150, Duration::from_secs(6)),
            (175, Duration::from_secs_f64(8.5)),
            (250, Duration::from_secs(11)),
        ]
    );
    assert_eq!(p.config().sources[0].at(150.0).ttft_s.median, 6.0);
}

#[tokio::test(start_paused = true)]
async fn phases_revoke_a_key_at_their_instant() {
    let p = pool(&json!({
        "name": "a",
        "revoked": {"phases": [{"from_s": 0, "value": false}, {"from_s": 600, "value": true}]},
        "insufficient_quota_rate": {"phases": [{"from_s": 0, "value": 0.0}, {"from_s": 300, "value": 1.0}]},
    }));
    let start = Instant::now();
    let mut svc = p.service("a").unwrap();
    let mut statuses = Vec::new();
    for at_s in [0, 299, 300, 599, 600, 5000] {
        advance_to(start, Duration::from_secs(at_s)).await;
        let fut = svc.call(json_request(&chat(false), None));
        statuses.push(fut);
    }
    let mut got = Vec::new();
    for f in statuses {
        got.push(read(f.await.unwrap()).await.status);
    }
    assert_eq!(got, vec![200, 200, 429, 429, 401, 401]);
    assert_eq!(p.stats().sources["a"].insufficient_quota, 2);
}

#[tokio::test(start_paused = true)]
async fn a_schedule_flips_over_http() {
    let p = pool(&json!({
        "name": "a",
        "server_error_rate": {"phases": [{"from_s": 0, "value": 0.0}, {"from_s": 600, "value": 1.0}]},
    }));
    let start = Instant::now();
    let (_, handle) = pgw_sim::http::serve(p.clone(), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let url = format!("{}/chat/completions", handle.base_url("a"));
    let post = || {
        http::Request::post(url.clone())
            .body(Full::new(Bytes::from(chat(false).to_string())))
            .unwrap()
    };
    // Well before and well after the flip: the paused clock may move while bytes cross
    // the loopback, the instant itself is pinned by the Service test above.
    advance_to(start, Duration::from_secs(100)).await;
    let before = client.request(post()).await.unwrap();
    assert_eq!(before.status(), 200);
    before.into_body().collect().await.unwrap();
    advance_to(start, Duration::from_secs(900)).await;
    let after = client.request(post()).await.unwrap();
    assert!(after.status().is_server_error(), "{}", after.status());
    let body = after.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["type"], "server_error");
    handle.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn bad_schedules_are_named() {
    let config: PoolConfig = serde_json::from_value(json!({
        "sources": [{"name": "a", "server_error_rate": {"phases": [{"from_s": 0, "value": 0.1}, {"from_s": 5, "value": 1.5}]}}],
    }))
    .unwrap();
    let e = SimPool::new(config, 1).unwrap_err();
    assert_eq!(e.field(), "sources[0].server_error_rate.phases[1].value");
    let config: PoolConfig = serde_json::from_value(json!({
        "sources": [{"name": "a", "account": "x"}],
        "accounts": [{"name": "x", "limits": {"flap": {"period_s": 10, "duty": 2, "on": {"rpm": 5}, "off": {}}}}],
    }))
    .unwrap();
    assert_eq!(
        SimPool::new(config, 1).unwrap_err().field(),
        "accounts[0].limits.flap.duty"
    );
    // A schedule round-trips through JSON as written.
    let json = json!({"flap": {"period_s": 10.0, "duty": 0.5, "on": {"rpm": 5}, "off": {}, "start_s": 0.0}});
    let s: pgw_sim::Schedule<pgw_sim::HardLimits> = serde_json::from_value(json.clone()).unwrap();
    assert_eq!(serde_json::to_value(&s).unwrap(), json);
}
