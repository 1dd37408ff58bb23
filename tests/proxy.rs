//! The OpenAI-compatible front (`pgw-server`'s router) over the gateway: the wire a
//! plain HTTP client reads, the providers' errors handed over as they wrote them,
//! every request field through, and a stream cut with nowhere to continue ending in
//! an error event. The router in process over the simulator's in-process service,
//! and the whole server over loopback, on tokio's paused clock.

mod support;

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use http_body_util::BodyExt;
use pgw_core::BoxError;
use pgw_core::openai::{ChatRequest, ChatResponse};
use pgw_server::{AppState, KeyRing, ServerSection};
use pgw_sim::{LogNormal, PoolConfig, SimPool, StallConfig};
use pgw_stack::client::box_transport;
use pgw_stack::{Gateway, GatewayConfig, MemorySink, SecretKey, SourceConfig};
use support::{fast, start};
use tower::ServiceExt;

const KEY: &str = "sk-virtual-0123456789";

fn pool(sources: Vec<pgw_sim::SourceConfig>) -> SimPool {
    let config = PoolConfig::of(sources);
    SimPool::new(config, 7).unwrap()
}

/// A source serving only `gpt-4o`, healthy otherwise, answering within a second or two.
fn serving(name: &str) -> pgw_sim::SourceConfig {
    pgw_sim::SourceConfig {
        models: Some(vec!["gpt-4o".into()]),
        ..pgw_sim::SourceConfig::quick(name)
    }
}

/// A source streaming 60 tokens at 2 per second after a 2 s first token, whose every
/// stream stalls for 60 s half way.
fn stalling(name: &str) -> pgw_sim::SourceConfig {
    let mut s = pgw_sim::SourceConfig {
        ttft_s: LogNormal::constant(2.0).into(),
        tokens_per_second: LogNormal::constant(2.0).into(),
        error_latency_s: LogNormal::constant(0.1).into(),
        stall: StallConfig {
            rate: 1.0,
            min_gap_s: 60.0,
            max_gap_s: 60.0,
        }
        .into(),
        ..pgw_sim::SourceConfig::healthy(name)
    };
    s.completion.min_fraction = 1.0;
    s.completion.max_fraction = 1.0;
    s
}

/// The gateway config over `pool`'s sources in order (round robin, no cache), each
/// with `tune` applied.
fn config(pool: &SimPool, tune: impl Fn(&mut SourceConfig)) -> GatewayConfig {
    let mut cfg = GatewayConfig::default();
    cfg.cache.enabled = false;
    cfg.balance.policy = Some("round_robin".into());
    for name in pool.sources() {
        let mut s = SourceConfig::new(
            name.as_str(),
            format!("http://sim.invalid/{name}/v1"),
            SecretKey::new(KEY),
        );
        tune(&mut s);
        cfg.sources.push(s);
    }
    cfg
}

/// A gateway over the simulator's in-process services (virtual time, no sockets).
async fn gateway(pool: &SimPool, cfg: GatewayConfig) -> Gateway {
    let p = pool.clone();
    Gateway::builder(cfg)
        .sink(Arc::new(MemorySink::new()))
        .transport(move |sc: &SourceConfig| -> Result<_, BoxError> {
            Ok(box_transport(p.service(&sc.name).ok_or("unknown sim source")?))
        })
        .build()
        .await
        .unwrap()
}

/// pgw-server's router over `gateway`, default `[server]` settings, no keys.
/// The router over one source `a`, cache off, whose every request `upstream` answers.
async fn router_over(upstream: pgw_stack::client::BoxTransport) -> Router {
    let mut cfg = GatewayConfig::default();
    cfg.cache.enabled = false;
    cfg.sources.push(SourceConfig::new(
        "a",
        "http://upstream.invalid/v1",
        SecretKey::new(KEY),
    ));
    let gw = Gateway::builder(cfg.clone())
        .transport(move |_: &SourceConfig| -> Result<_, BoxError> { Ok(upstream.clone()) })
        .build()
        .await
        .unwrap();
    router(gw, &cfg)
}

/// The router over one source `a` whose every request is answered 200 with `sse` as
/// its whole event stream, in one write.
async fn router_over_sse(sse: String) -> Router {
    let sse = bytes::Bytes::from(sse);
    let upstream = tower::service_fn(move |_: http::Request<bytes::Bytes>| {
        let body = sse.clone();
        async move { Ok::<_, BoxError>(answer_200("text/event-stream", body)) }
    });
    router_over(box_transport(upstream)).await
}

/// A 200 with `body` as `content_type`.
fn answer_200(content_type: &str, body: bytes::Bytes) -> http::Response<http_body_util::Full<bytes::Bytes>> {
    http::Response::builder()
        .status(200)
        .header("content-type", content_type)
        .body(http_body_util::Full::new(body))
        .unwrap()
}

fn router(gateway: Gateway, cfg: &GatewayConfig) -> Router {
    let settings = ServerSection::default().settings().unwrap();
    let state = AppState::new(gateway, cfg, &settings, KeyRing::default(), None);
    pgw_server::router(state, settings.max_body_bytes)
}

fn post(body: &str) -> http::Request<Body> {
    http::Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

async fn read(resp: axum::response::Response) -> (http::StatusCode, serde_json::Value) {
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20).await.unwrap();
    (
        status,
        serde_json::from_slice::<serde_json::Value>(&bytes).unwrap(),
    )
}

#[tokio::test(start_paused = true)]
async fn the_proxy_hands_the_callers_error_over_as_the_provider_wrote_it() {
    let small = pgw_sim::SourceConfig {
        context_window: Some(4096),
        ..serving("a")
    };
    let pool = pool(vec![small]);
    let cfg = config(&pool, |s| s.total_timeout_s = Some(60.0));
    let app = router(gateway(&pool, cfg.clone()).await, &cfg);
    let (status, body) = read(
        app.clone()
            .oneshot(post(
                r#"{"model":"gpt-4o-mimi","messages":[{"role":"user","content":"hi"}]}"#,
            ))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["code"], "model_not_found");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("gpt-4o-mimi"),
        "{body}"
    );

    let (status, body) = read(
        app.clone()
            .oneshot(post(
                r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}],"max_tokens":100000}"#,
            ))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    assert_eq!(body["error"]["param"], "messages");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length is 4096 tokens"),
        "{body}"
    );
}

#[tokio::test(start_paused = true)]
async fn every_field_survives_the_trip_through_the_proxy() {
    let echoing = pgw_sim::SourceConfig {
        echo_openai_fields: true,
        ..serving("a")
    };
    let pool = pool(vec![echoing]);
    let cfg = config(&pool, |s| s.total_timeout_s = Some(60.0));
    let app = router(gateway(&pool, cfg.clone()).await, &cfg);
    let body = r#"{"model":"gpt-4o","messages":[{"role":"user","content":[{"type":"text","text":"what is this?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA","detail":"low"}}]}],"logprobs":true,"max_completion_tokens":40}"#;
    let (status, v) = read(app.oneshot(post(body)).await.unwrap()).await;
    assert_eq!(status, 200);
    assert!(
        v["system_fingerprint"].as_str().unwrap().starts_with("fp_"),
        "{v}"
    );
    assert_eq!(v["service_tier"], "default");
    assert_eq!(v["usage"]["completion_tokens_details"]["reasoning_tokens"], 0);
    let logprobs = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(!logprobs.is_empty() && logprobs[0]["token"].is_string(), "{v}");
    // The image part reached the simulator and was counted (85 tokens per image).
    let answer: ChatResponse = serde_json::from_value(v).unwrap();
    assert!(answer.usage.unwrap().prompt_tokens >= 85);
}

/// A stream committed to its only source and cut there (the source stalls past the
/// inter-token watchdog; no source accepts a prefill to continue it) ends with an
/// error event and no `[DONE]`: never a clean end on a truncated answer. Every slot,
/// lease and upstream request is released after it.
#[tokio::test(start_paused = true)]
async fn a_cut_with_no_prefill_source_ends_with_an_error_event_never_done() {
    let pool = pool(vec![stalling("a")]);
    let cfg = config(&pool, |s| {
        s.inter_token_timeout_s = Some(5.0);
        s.total_timeout_s = Some(300.0);
        s.max_concurrency = Some(4);
    });
    let gw = gateway(&pool, cfg.clone()).await;
    let mut req = ChatRequest::user("m", "tell me a story");
    req.max_tokens = Some(60);
    req.stream = true;
    let resp = router(gw.clone(), &cfg)
        .oneshot(post(&serde_json::to_string(&req).unwrap()))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    assert!(
        body.starts_with("data: {"),
        "content streamed before the cut: {body}"
    );
    let last = body.trim_end().rsplit("\n\n").next().unwrap();
    assert!(last.starts_with("data: {\"error\""), "{last}");
    assert!(!body.contains("[DONE]"));
    for h in gw.sources() {
        assert_eq!(h.aimd.inflight(), 0, "{}: AIMD slot held", h.source);
        let held = h.limiter.held().await.unwrap();
        assert_eq!(held.leases(), 0, "{}: concurrency lease held", h.source);
    }
    for (name, s) in &pool.stats().sources {
        assert_eq!(s.in_flight, 0, "{name}: upstream request still running");
    }
}

/// What a plain HTTP client (curl) sends and reads: one request on a raw socket, the
/// whole response, byte for byte.
async fn raw_http(addr: std::net::SocketAddr, body: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    socket.read_to_end(&mut out).await.unwrap();
    String::from_utf8(out).unwrap()
}

/// Undoes `transfer-encoding: chunked`.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n").expect("chunk size line");
        let size = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
        if size == 0 {
            return out;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].strip_prefix("\r\n").expect("CRLF after chunk");
    }
}

/// The server serves a streamed answer to a plain HTTP client with byte-correct SSE
/// framing (`data: {chunk}\n\n` ... `data: [DONE]\n\n`) and says who answered in its
/// headers, and a JSON answer otherwise.
#[tokio::test(start_paused = true)]
async fn the_proxy_serves_byte_correct_sse_to_a_plain_http_client() {
    let h = start("expose_sources = true\n", vec![fast("p1")]).await;
    let body = r#"{"model":"m","messages":[{"role":"user","content":"stream please"}],"max_tokens":20,"stream":true}"#;
    let response = raw_http(h.addr, body).await;
    let (head, payload) = response.split_once("\r\n\r\n").unwrap();
    let head = head.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("content-type: text/event-stream"), "{head}");
    assert!(head.contains("x-pgw-group: default"), "{head}");
    assert!(head.contains("x-pgw-source: p1"), "{head}");
    let sse = if head.contains("transfer-encoding: chunked") {
        dechunk(payload)
    } else {
        payload.to_owned()
    };
    assert!(sse.ends_with("data: [DONE]\n\n"), "{sse:?}");
    let events: Vec<&str> = sse.split_terminator("\n\n").collect();
    assert!(events.len() >= 2, "{sse:?}");
    let mut text = String::new();
    for event in &events[..events.len() - 1] {
        let json = event
            .strip_prefix("data: ")
            .expect("every event is one data line");
        assert!(!json.contains('\n'), "one line per event: {event:?}");
        let chunk: pgw_core::openai::ChatChunk = serde_json::from_str(json).unwrap();
        for c in &chunk.choices {
            text.push_str(c.delta.content.as_deref().unwrap_or(""));
        }
    }
    assert!(!text.trim().is_empty(), "the chunks carry the answer: {sse:?}");

    let body = r#"{"model":"m","messages":[{"role":"user","content":"json please"}],"max_tokens":20}"#;
    let response = raw_http(h.addr, body).await;
    let (head, payload) = response.split_once("\r\n\r\n").unwrap();
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    let json = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(payload)
    } else {
        payload.to_owned()
    };
    let answer: ChatResponse = serde_json::from_str(&json).unwrap();
    assert!(!answer.is_empty_completion());
}

/// What the recording upstream answers: every field OpenAI sends that the gateway does
/// not read, and fields no provider sends yet, at every level. Written by serde_json
/// (keys sorted, numbers in its shortest form), so a field the proxy passed through
/// untouched appears in its output byte for byte.
fn rich_answer() -> serde_json::Value {
    serde_json::json!({
        "id": "chatcmpl-rich-1",
        "object": "chat.completion",
        "created": 1_784_000_000_u64,
        "model": "gpt-4o-2024-08-06",
        "system_fingerprint": "fp_0123456789",
        "service_tier": "default",
        "x_provider_trace": {"region": "eu-west", "hops": [1, 2, 3]},
        "choices": [{
            "index": 0,
            "finish_reason": "stop",
            "x_choice_score": 0.987_654_321_012_345_6,
            "logprobs": {
                "content": [
                    {"token": "It", "logprob": -0.000_012_345_678_9, "bytes": [73, 116],
                     "top_logprobs": [{"token": "It", "logprob": -0.000_012_345_678_9, "bytes": [73, 116]},
                                      {"token": "This", "logprob": -11.25, "bytes": [84, 104, 105, 115]}]},
                    {"token": "'s", "logprob": -1.0e-7, "bytes": [39, 115], "top_logprobs": []}
                ],
                "refusal": null
            },
            "message": {
                "role": "assistant",
                "content": "It's a picture.",
                "refusal": null,
                "annotations": [],
                "x_message_meta": {"lang": "en"}
            }
        }],
        "usage": {
            "prompt_tokens": 93,
            "completion_tokens": 5,
            "total_tokens": 98,
            "prompt_tokens_details": {"cached_tokens": 64, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 3, "audio_tokens": 0,
                "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0
            },
            "x_usage_cost": 0.000_123
        }
    })
}

/// The acceptance of "faithful OpenAI types" (issue #14), byte for byte: a response
/// with logprobs, `system_fingerprint`, usage details and unknown fields at every level
/// comes out of the proxy exactly as the upstream wrote it, and a request with content
/// parts (and fields the gateway does not know) reaches the upstream unchanged.
#[tokio::test(start_paused = true)]
async fn a_rich_answer_and_a_content_parts_request_cross_the_proxy_byte_for_byte() {
    use bytes::Bytes;
    use std::sync::Mutex;

    let sent: Arc<Mutex<Vec<Bytes>>> = Arc::default();
    let upstream_body = Bytes::from(serde_json::to_vec(&rich_answer()).unwrap());
    let seen = Arc::clone(&sent);
    let answered = upstream_body.clone();
    let upstream = tower::service_fn(move |req: http::Request<Bytes>| {
        seen.lock().unwrap().push(req.into_body());
        let body = answered.clone();
        async move { Ok::<_, BoxError>(answer_200("application/json", body)) }
    });
    let app = router_over(box_transport(upstream)).await;

    // As the OpenAI SDKs write them: `type` first in a part, `role` first in a message.
    let messages = r#"[{"role":"user","content":[{"type":"text","text":"what is this?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA","detail":"low"}}],"name":"ann"},{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"look","arguments":"{\"q\":1}"}}]},{"role":"tool","content":"{\"seen\":true}","tool_call_id":"call_1"}]"#;
    let request = format!(
        r#"{{"logprobs":true,"max_completion_tokens":40,"messages":{messages},"metadata":{{"tenant":"t1"}},"model":"gpt-4o","top_logprobs":2,"x_unknown":[1,2.5,"three"]}}"#
    );
    let resp = app.oneshot(post(&request)).await.unwrap();
    assert_eq!(resp.status(), 200);
    let out = String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();

    // The response: each field as the upstream wrote it.
    let want = rich_answer();
    let field =
        |name: &str, v: &serde_json::Value| format!("\"{name}\":{}", serde_json::to_string(v).unwrap());
    for (name, v) in [
        ("system_fingerprint", &want["system_fingerprint"]),
        ("service_tier", &want["service_tier"]),
        ("x_provider_trace", &want["x_provider_trace"]),
        ("logprobs", &want["choices"][0]["logprobs"]),
        ("x_choice_score", &want["choices"][0]["x_choice_score"]),
        ("annotations", &want["choices"][0]["message"]["annotations"]),
        ("x_message_meta", &want["choices"][0]["message"]["x_message_meta"]),
        ("prompt_tokens_details", &want["usage"]["prompt_tokens_details"]),
        (
            "completion_tokens_details",
            &want["usage"]["completion_tokens_details"],
        ),
        ("x_usage_cost", &want["usage"]["x_usage_cost"]),
    ] {
        let bytes = field(name, v);
        assert!(out.contains(&bytes), "{bytes} not in the proxy's answer: {out}");
    }
    // And the whole body as the upstream wrote it: passed on, not serialized again
    // (which would put the fields it knows first, and change the key order).
    assert_eq!(out.as_bytes(), &upstream_body[..], "the body byte for byte");
    let got: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(got["usage"], want["usage"], "usage whole");
    assert_eq!(got["choices"][0]["message"]["refusal"], serde_json::Value::Null);
    assert!(
        got["choices"][0]["message"].get("refusal").is_some(),
        "null stays null, not dropped"
    );

    // The request: the messages and every field the gateway does not read, unchanged.
    let sent = sent.lock().unwrap();
    assert_eq!(sent.len(), 1, "one attempt");
    let upstream = std::str::from_utf8(&sent[0]).unwrap();
    let parsed: serde_json::Value = serde_json::from_str(upstream).unwrap();
    let asked: serde_json::Value = serde_json::from_str(&request).unwrap();
    // Unchanged in every name and value; the content parts byte for byte. A tool
    // call's keys come out in serde_json's order (sorted), its values byte for byte.
    assert_eq!(parsed["messages"], asked["messages"], "{upstream}");
    for bytes in [
        r#""content":[{"type":"text","text":"what is this?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA","detail":"low"}}]"#,
        r#""arguments":"{\"q\":1}""#,
        r#""content":null"#,
        r#""content":"{\"seen\":true}","tool_call_id":"call_1""#,
        r#""name":"ann""#,
        r#""metadata":{"tenant":"t1"}"#,
        r#""x_unknown":[1,2.5,"three"]"#,
        r#""logprobs":true"#,
        r#""top_logprobs":2"#,
        r#""max_completion_tokens":40"#,
    ] {
        assert!(upstream.contains(bytes), "{bytes} not sent upstream: {upstream}");
    }
}

/// A streamed answer's chunks as a provider may write them: keys in its own order,
/// spaces, a `"usage": null`, fields missing (`created`, `model`) and unknown ones, one
/// payload over two `data:` lines, usage on the last chunk with a choice and in a
/// usage chunk.
const PROVIDER_CHUNKS: [&str; 6] = [
    r#"{"object":"chat.completion.chunk","id":"c-1","created":7,"model":"up-model","system_fingerprint":"fp_1","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":null}"#,
    r#"{"id": "c-1", "choices": [{"delta": {"content": "Hel"}, "index": 0}], "model": "up-model", "object": "chat.completion.chunk", "created": 7, "x_trace": 1.50}"#,
    r#"{"choices":[{"index":0,"delta":{"content":"lo"}}],"id":"c-1"}"#,
    "{\"id\":\"c-1\",\n \"choices\":[{\"index\":0,\"delta\":{\"content\":\"!\"}}]}",
    r#"{"id":"c-1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}}"#,
    r#"{"id":"c-1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}}"#,
];

/// Each chunk the gateway leaves as it came reaches the caller byte for byte as the
/// provider wrote it (not serialized again, which would reorder its keys, fill in
/// `created` and `model`, drop the null usage and rewrite `1.50`); a chunk it changes
/// (usage the caller did not ask for taken off) or cannot send as one line is
/// serialized from its fields.
#[tokio::test(start_paused = true)]
async fn a_streamed_chunk_left_unchanged_crosses_the_proxy_byte_for_byte() {
    let mut sse = String::new();
    for c in PROVIDER_CHUNKS {
        for line in c.split('\n') {
            sse.push_str(&format!("data: {line}\n"));
        }
        sse.push('\n');
    }
    sse.push_str("data: [DONE]\n\n");
    let app = router_over_sse(sse).await;

    for include_usage in [false, true] {
        let request = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"stream":true,"stream_options":{{"include_usage":{include_usage}}}}}"#
        );
        let resp = app.clone().oneshot(post(&request)).await.unwrap();
        assert_eq!(resp.status(), 200);
        let out = String::from_utf8(resp.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
        let events: Vec<&str> = out
            .split_terminator("\n\n")
            .map(|e| e.strip_prefix("data: ").expect("one data line per event"))
            .collect();
        assert!(events.iter().all(|e| !e.contains('\n')), "{out:?}");
        let want = if include_usage { 7 } else { 6 };
        assert_eq!(events.len(), want, "{out:?}");
        assert_eq!(events[want - 1], "[DONE]");
        for (i, provider) in PROVIDER_CHUNKS[..3].iter().enumerate() {
            assert_eq!(events[i], *provider, "chunk {i} left unchanged: byte for byte");
        }
        // Two lines, one event: the chunk's fields, serialized on one line.
        let joined: serde_json::Value = serde_json::from_str(events[3]).unwrap();
        assert_eq!(joined["id"], "c-1");
        assert_eq!(joined["choices"][0]["delta"]["content"], "!");
        if include_usage {
            assert_eq!(events[4], PROVIDER_CHUNKS[4]);
            assert_eq!(events[5], PROVIDER_CHUNKS[5]);
        } else {
            // The usage the caller did not ask for is taken off: the chunk is changed,
            // so written from its fields, not the provider's payload.
            assert_ne!(events[4], PROVIDER_CHUNKS[4]);
            let last: serde_json::Value = serde_json::from_str(events[4]).unwrap();
            assert_eq!(last["choices"][0]["finish_reason"], "stop");
            assert!(last.get("usage").is_none(), "{last}");
        }
    }
}

/// The chunks that arrived together (here the provider's whole answer, in one write)
/// go out in one body frame, not one frame per event; an error event that arrived with
/// them still goes out after them, as the stream's last event, with no `[DONE]`.
#[tokio::test(start_paused = true)]
async fn chunks_that_arrived_together_share_a_frame_and_an_error_still_comes_last() {
    let mut sse = String::new();
    for c in &PROVIDER_CHUNKS[..3] {
        sse.push_str(&format!("data: {c}\n\n"));
    }
    sse.push_str("data: {\"error\":{\"message\":\"upstream broke\",\"type\":\"server_error\"}}\n\n");
    let app = router_over_sse(sse).await;
    let request = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
    let resp = app.oneshot(post(request)).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut frames = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            frames.push(String::from_utf8(data.to_vec()).unwrap());
        }
    }
    let all = frames.concat();
    let events: Vec<&str> = all.split_terminator("\n\n").collect();
    assert_eq!(events.len(), 4, "three chunks and the error: {all:?}");
    for (event, provider) in events.iter().zip(&PROVIDER_CHUNKS[..3]) {
        assert_eq!(*event, format!("data: {provider}"));
    }
    assert!(events[3].starts_with("data: {\"error\""), "{all:?}");
    assert!(!all.contains("[DONE]"));
    assert!(
        frames.len() < events.len(),
        "events that arrived together share frames: {frames:?}"
    );
    assert!(
        frames[0].matches("data: ").count() >= 2,
        "the first frame carries the chunks that arrived with it: {frames:?}"
    );
}
