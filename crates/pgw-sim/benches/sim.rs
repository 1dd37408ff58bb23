//! Cost of one simulated call (decision + answer bytes + body), on a paused current-thread
//! runtime, against a minimal mock provider built with `tower::service_fn` that
//! serializes a fixed `ChatResponse` (the cheapest honest "fake LLM" a test could use).

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::BodyExt;
use pgw_core::openai::{ChatMessage, ChatRequest, ChatResponse, Choice, Usage};
use pgw_sim::{PoolConfig, SimPool, SourceConfig};
use tower::{Service, ServiceExt};

fn main() {
    divan::main();
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap()
}

fn pool(rt: &tokio::runtime::Runtime) -> SimPool {
    let config = PoolConfig {
        sources: vec![SourceConfig::healthy("a")],
        ..PoolConfig::default()
    };
    rt.block_on(async { SimPool::new(config, 1).unwrap() })
}

fn body(stream: bool, max_tokens: u64) -> Bytes {
    let mut r = ChatRequest::user("m", "a short question about resilient calls");
    r.stream = stream;
    r.max_tokens = Some(max_tokens);
    Bytes::from(serde_json::to_vec(&r).unwrap())
}

fn request(b: &Bytes) -> http::Request<Bytes> {
    http::Request::post("/v1/chat/completions")
        .body(b.clone())
        .unwrap()
}

/// The peer: a `service_fn` that parses the request and serializes a fixed answer.
#[divan::bench]
fn peer_service_fn_json(bencher: divan::Bencher<'_, '_>) {
    let rt = rt();
    let b = body(false, 300);
    let answer = ChatResponse {
        id: "x".into(),
        object: "chat.completion".into(),
        model: "m".into(),
        choices: vec![Choice::new(
            0,
            ChatMessage::new("assistant", "the pool answers with latency ".repeat(30)),
            Some("stop".into()),
        )],
        usage: Some(Usage::default()),
        ..ChatResponse::default()
    };
    let mut svc = tower::service_fn(move |req: http::Request<Bytes>| {
        let parsed: ChatRequest = serde_json::from_slice(req.body()).unwrap();
        let out = Bytes::from(serde_json::to_vec(&answer).unwrap());
        async move {
            drop(parsed);
            Ok::<_, Infallible>(http::Response::new(http_body_util::Full::new(out)))
        }
    });
    bencher.bench_local(|| {
        rt.block_on(async {
            let resp = svc.ready().await.unwrap().call(request(&b)).await.unwrap();
            resp.into_body().collect().await.unwrap().to_bytes().len()
        })
    });
}

/// One simulated non-streamed call (~150 tokens) and its body.
#[divan::bench]
fn sim_call_json(bencher: divan::Bencher<'_, '_>) {
    let rt = rt();
    let pool = pool(&rt);
    let mut svc = pool.service("a").unwrap();
    let b = body(false, 300);
    bencher.bench_local(|| {
        rt.block_on(async {
            let resp = svc.call(request(&b)).await.unwrap();
            resp.into_body().collect().await.unwrap().to_bytes().len()
        })
    });
}

/// One simulated streamed call (~1100 tokens in <= 48 frames) read frame by frame.
#[divan::bench]
fn sim_call_stream(bencher: divan::Bencher<'_, '_>) {
    let rt = rt();
    let pool = pool(&rt);
    let mut svc = pool.service("a").unwrap();
    let b = body(true, 2000);
    bencher.bench_local(|| {
        rt.block_on(async {
            let resp = svc.call(request(&b)).await.unwrap();
            let mut body = resp.into_body();
            let mut n = 0;
            while let Some(f) = body.frame().await {
                n += f.unwrap().into_data().map_or(0, |d| d.len());
            }
            n
        })
    });
}
