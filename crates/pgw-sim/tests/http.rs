//! The pool served over HTTP on 127.0.0.1, read by a real HTTP client (hyper-util).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use pgw_core::openai::{ChatChunk, ChatRequest, ChunkAccumulator};
use pgw_core::sse::{SseDecoder, SseEvent};
use pgw_sim::{PoolConfig, SimPool, SourceConfig};
use tower_service::Service;

fn config() -> PoolConfig {
    PoolConfig {
        sources: vec![
            SourceConfig {
                api_key: Some("sk-a".into()),
                ..SourceConfig::healthy("a")
            },
            SourceConfig {
                black_hole_rate: 1.0.into(),
                ..SourceConfig::healthy("hole")
            },
        ],
        bad_prompt_rate: 0.0,
        ..PoolConfig::default()
    }
}

fn stream_request() -> Bytes {
    let mut req = ChatRequest::user("m", "tell me a long story");
    req.stream = true;
    req.max_tokens = Some(2000);
    Bytes::from(serde_json::to_vec(&req).unwrap())
}

fn post(url: String, key: &str, body: Bytes) -> http::Request<Full<Bytes>> {
    http::Request::post(url)
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(Full::new(body))
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_stream_served_over_http_is_parsed_chunk_by_chunk() {
    let pool = SimPool::new(config(), 5).unwrap();
    let (addr, handle) = pgw_sim::http::serve(pool.clone(), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    assert_eq!(handle.base_url("a"), format!("http://{addr}/a/v1"));
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let url = format!("{}/chat/completions", handle.base_url("a"));
    let resp = client.request(post(url, "sk-a", stream_request())).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    assert!(resp.headers().contains_key("x-request-id"));

    let mut body = resp.into_body();
    let mut dec = SseDecoder::default();
    let mut acc = ChunkAccumulator::default();
    let (mut frames, mut chunks, mut done) = (0, 0, false);
    let mut raw = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.unwrap().into_data() else {
            continue;
        };
        frames += 1;
        raw.extend_from_slice(&data);
        dec.feed(&data).unwrap();
        while let Some(ev) = dec.next_event() {
            match ev {
                SseEvent::Data(d) => {
                    assert!(!done, "data after [DONE]");
                    acc.push(&serde_json::from_str::<ChatChunk>(&d).unwrap());
                    chunks += 1;
                }
                SseEvent::Done => done = true,
                SseEvent::Error(e) => panic!("an error event: {e}"),
            }
        }
    }
    assert!(done);
    assert!(
        frames >= 10,
        "{frames} frames: the stream must arrive piece by piece"
    );
    assert!(chunks > frames, "{chunks} chunks");
    let answer = acc.finish();
    let usage = answer.usage.clone().expect("usage chunk");
    assert_eq!(
        answer.content().split(' ').count() as u64,
        usage.completion_tokens
    );
    assert!((400..=1800).contains(&usage.completion_tokens), "{usage:?}");

    // The same bytes as the virtual service gives for the same seed and arrival.
    let twin = SimPool::new(config(), 5).unwrap();
    let mut svc = twin.service("a").unwrap();
    let req = http::Request::post("/v1/chat/completions")
        .header("authorization", "Bearer sk-a")
        .body(stream_request())
        .unwrap();
    let virtual_bytes = svc
        .call(req)
        .await
        .unwrap()
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(Bytes::from(raw), virtual_bytes);

    let st = pool.stats();
    assert_eq!(st.sources["a"].streams_completed, 1);
    assert_eq!(st.in_flight(), 0);
    handle.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn statuses_and_black_holes_over_http() {
    let pool = SimPool::new(config(), 5).unwrap();
    let (addr, handle) = pgw_sim::http::serve(pool.clone(), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let body = Bytes::from(serde_json::to_vec(&ChatRequest::user("m", "hi")).unwrap());

    let bad_key = client
        .request(post(
            format!("http://{addr}/a/v1/chat/completions"),
            "sk-wrong",
            body.clone(),
        ))
        .await
        .unwrap();
    assert_eq!(bad_key.status(), 401);
    let err: serde_json::Value =
        serde_json::from_slice(&bad_key.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(err["error"]["code"], "invalid_api_key");

    let unknown = client
        .request(post(
            format!("http://{addr}/zz/v1/chat/completions"),
            "k",
            body.clone(),
        ))
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);

    let ok = client
        .request(post(
            format!("http://{addr}/a/v1/chat/completions"),
            "sk-a",
            body.clone(),
        ))
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert_eq!(ok.headers()["content-type"], "application/json");

    // The black hole: no status line until the caller gives up.
    let hole = client.request(post(format!("http://{addr}/hole/v1/chat/completions"), "k", body));
    let r = tokio::time::timeout(Duration::from_secs(600), hole).await;
    assert!(r.is_err(), "the black hole answered");
    assert_eq!(pool.stats().sources["hole"].black_holed, 1);
    // Shutting the server down closes the silent connection and ends the request.
    handle.shutdown().await;
    assert_eq!(pool.stats().in_flight(), 0);
}
