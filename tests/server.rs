//! pgw-server against the simulator served over HTTP on 127.0.0.1, on tokio's paused
//! clock (the simulator's latencies and the server's timeouts run in virtual time).

mod support;

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use pgw_stack::breaker::BreakerState;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A body that is not a chat request is a 400 in the client's terms: the field in
/// `param`, the syntax error's line and column, no framework or Rust type names.
#[tokio::test(start_paused = true)]
async fn a_bad_body_is_named_in_the_clients_terms() {
    let h = start("", vec![fast("s1")]).await;
    let msgs = r#""messages":[{"role":"user","content":"hi"}]"#;
    let cases = [
        ("[1]".to_owned(), "invalid_request", None),
        (
            format!(r#"{{"model":"m",{msgs},"stream":"yes"}}"#),
            "invalid_request",
            Some("stream"),
        ),
        (
            format!(r#"{{"model":"m",{msgs},"max_tokens":-5}}"#),
            "invalid_request",
            Some("max_tokens"),
        ),
        (
            r#"{"model":"m","messages":"hi"}"#.to_owned(),
            "invalid_request",
            Some("messages"),
        ),
        (r#"{"model":"m"}"#.to_owned(), "invalid_request", Some("messages")),
        (
            r#"{"model":"m","messages":[{"content":"hi"}]}"#.to_owned(),
            "invalid_request",
            Some("messages[0].role"),
        ),
        ("{not json".to_owned(), "invalid_json", None),
        (
            format!(r#"{{"model":"m",{msgs}}} trailing"#),
            "invalid_json",
            None,
        ),
    ];
    for (body, code, param) in cases {
        for content_type in ["application/json", "application/json; charset=utf-8"] {
            let req = request("POST", "/v1/chat/completions").header("content-type", content_type);
            let (status, _, bytes) = call(h.addr, req, Bytes::from(body.clone())).await;
            assert_eq!(status, 400, "{body}");
            let v = openai_error(&bytes, code);
            assert_eq!(
                v["error"]["param"].as_str(),
                param,
                "{body} ({content_type}): {v}"
            );
            let message = v["error"]["message"].as_str().unwrap();
            for internal in ["ChatRequest", "Failed to deserialize", "struct "] {
                assert!(!message.contains(internal), "{body}: {message}");
            }
            if code == "invalid_json" {
                assert!(message.contains("line 1 column"), "{message}");
            }
        }
    }
}

/// A body between axum's own 2 MiB default and the server's `max_body_bytes` (8 MiB)
/// passes whatever JSON content type it is sent as: with parameters it was read by
/// axum's `Json`, under axum's limit, and refused as too large.
#[tokio::test(start_paused = true)]
async fn a_body_over_axums_default_limit_passes_as_any_json_type() {
    let h = start("", vec![fast("s1")]).await;
    let mut req = pgw_core::openai::ChatRequest::user("m", "hello there");
    req.max_tokens = Some(40);
    let mut v = serde_json::to_value(&req).unwrap();
    v["metadata"] = serde_json::json!({ "blob": "x".repeat(3 << 20) });
    let body = Bytes::from(serde_json::to_vec(&v).unwrap());
    assert!(body.len() > 3 << 20);
    for content_type in [
        "application/json",
        "application/json; charset=utf-8",
        "application/vnd.api+json",
    ] {
        let req = request("POST", "/v1/chat/completions").header("content-type", content_type);
        let (status, _, bytes) = call(h.addr, req, body.clone()).await;
        assert_eq!(status, 200, "{content_type}: {}", String::from_utf8_lossy(&bytes));
    }
}

/// A body past the limit from a client without a key is a 401, as any request of
/// theirs: the key is checked first (tower-http's layer answered 413 before it).
#[tokio::test(start_paused = true)]
async fn the_key_is_checked_before_the_body_size() {
    let keys = format!("max_body_bytes = 1024\n{}", key_toml("team-a", CLIENT_KEY, ""));
    let h = start(&keys, vec![fast("s1")]).await;
    let big = Bytes::from(vec![b' '; 4096]);
    let (status, _, body) = call(h.addr, chat(None), big.clone()).await;
    assert_eq!(status, 401);
    openai_error(&body, "invalid_api_key");
    let (status, _, body) = call(h.addr, chat(Some(CLIENT_KEY)), big).await;
    assert_eq!(status, 413);
    openai_error(&body, "request_too_large");
}

/// A call the cache does not take says `x-pgw-cache: off`, not `miss` (which the miss
/// counter counts): here the cache is off, and with `when = "deterministic"` a request
/// without `temperature = 0` is not taken.
#[tokio::test(start_paused = true)]
async fn a_call_the_cache_does_not_take_says_off() {
    let h = start("", vec![fast("s1")]).await;
    let (status, headers, _) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(
        (status.as_u16(), headers["x-pgw-cache"].to_str().unwrap()),
        (200, "off")
    );
    let h = start_edited("", "", vec![fast("s1")], |t| {
        t.replace("[cache]\nenabled = false", "[cache]\nwhen = \"deterministic\"")
    })
    .await;
    let (status, headers, _) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(
        (status.as_u16(), headers["x-pgw-cache"].to_str().unwrap()),
        (200, "off")
    );
}

/// A chunked body (no `Content-Length`) past the limit is a 413 when the read reaches
/// the limit.
#[tokio::test(start_paused = true)]
async fn a_chunked_body_past_the_limit_is_413() {
    let h = start("max_body_bytes = 1024\n", vec![fast("s1")]).await;
    let mut sock = TcpStream::connect(h.addr).await.unwrap();
    let chunk = format!("800\r\n{}\r\n", " ".repeat(0x800));
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                transfer-encoding: chunked\r\nconnection: close\r\n\r\n";
    sock.write_all(format!("{head}{chunk}{chunk}0\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut answer = Vec::new();
    sock.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("request_too_large"), "{answer}");
}

#[tokio::test(start_paused = true)]
async fn every_framework_error_is_openai_json() {
    let h = start("max_body_bytes = 1024\n", vec![fast("s1")]).await;
    let cases: Vec<(http::request::Builder, Bytes, u16, &str)> = vec![
        (chat(None), Bytes::from_static(b"{not json"), 400, "invalid_json"),
        (
            request("POST", "/v1/chat/completions").header("content-type", "text/plain"),
            chat_body("m", false),
            415,
            "unsupported_media_type",
        ),
        (
            chat(None),
            Bytes::from(vec![b' '; 4096]),
            413,
            "request_too_large",
        ),
        (
            chat(None),
            Bytes::from_static(br#"{"model":"m"}"#),
            400,
            "invalid_request",
        ),
        (request("GET", "/nowhere"), Bytes::new(), 404, "not_found"),
        (
            request("GET", "/v1/chat/completions"),
            Bytes::new(),
            405,
            "method_not_allowed",
        ),
        (
            request("DELETE", "/v1/models"),
            Bytes::new(),
            405,
            "method_not_allowed",
        ),
    ];
    let mut ids = std::collections::HashSet::new();
    for (req, body, status, code) in cases {
        let (got, headers, bytes) = call(h.addr, req, body).await;
        assert_eq!(got.as_u16(), status, "{}", String::from_utf8_lossy(&bytes));
        // Every answer names its request, each with an id of its own.
        let id = headers["x-request-id"].to_str().unwrap().to_owned();
        assert!(
            id.starts_with("req_") && id.len() > 4 && id[4..].bytes().all(|b| b.is_ascii_digit()),
            "{id}"
        );
        assert!(ids.insert(id), "ids are unique");
        assert!(
            !headers.contains_key("x-should-retry"),
            "{code}: a 4xx says nothing"
        );
        assert!(
            headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("application/json"),
            "{code}: {headers:?}"
        );
        openai_error(&bytes, code);
    }
}

// On the real clock: a stream passed through crosses two loopback sockets (simulator ->
// gateway -> client), and the paused clock jumps to the next timer (the watchdog) whenever
// every task waits, bytes in flight or not. The simulated source answers in milliseconds;
// nothing here asserts on time.
#[tokio::test]
async fn chat_answers_json_and_streams_sse_ending_with_done() {
    let h = start("", vec![fast("s1")]).await;
    let (status, headers, body) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(headers["x-pgw-group"], "default");
    assert!(
        !headers.contains_key("x-pgw-source"),
        "sources are hidden by default"
    );
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .is_some_and(|c| !c.is_empty())
    );

    let cache = headers["x-pgw-cache"].clone();
    let (status, headers, body) = call(h.addr, chat(None), chat_body("m", true)).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "text/event-stream");
    assert_eq!(headers["x-pgw-group"], "default", "streams say who answered too");
    assert_eq!(headers["x-pgw-cache"], cache, "and what the cache did");
    assert!(!headers.contains_key("x-pgw-source"));
    let ev = events(&body);
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{ev:?}");
    let chunks: Vec<serde_json::Value> = ev[..ev.len() - 1]
        .iter()
        .filter(|e| *e != ":")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(!chunks.is_empty());
    assert!(
        chunks.iter().all(|c| c["object"] == "chat.completion.chunk"),
        "{chunks:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stream_failing_before_its_head_went_out_is_an_ordinary_error_answer() {
    let revoked = pgw_sim::SourceConfig {
        revoked: true.into(),
        ..fast("dead")
    };
    let h = start("", vec![revoked]).await;
    let (status, headers, body) = call(h.addr, chat(None), chat_body("m", true)).await;
    assert!(status.is_server_error(), "{status}");
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json"),
        "{headers:?}"
    );
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(
        !String::from_utf8_lossy(&body).contains("dead"),
        "source names stay hidden: {v}"
    );
}

/// A 502 (every attempt failed upstream) tells the OpenAI SDKs not to retry: the
/// gateway has tried already, and the SDKs' own two retries would triple the attempts.
/// A 503 with `Retry-After` (every circuit open) leaves the SDK its retry.
#[tokio::test(start_paused = true)]
async fn a_502_says_the_sdk_should_not_retry() {
    let failing = pgw_sim::SourceConfig {
        server_error_rate: 1.0.into(),
        ..fast("s1")
    };
    let h = start("", vec![failing]).await;
    let (status, headers, body) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    assert_eq!(headers["x-should-retry"], "false");
    let mut saw_503 = false;
    for _ in 0..20 {
        let (status, headers, _) = call(h.addr, chat(None), chat_body("m", false)).await;
        if status == 503 {
            assert!(!headers.contains_key("x-should-retry"));
            assert!(headers.contains_key("retry-after"));
            saw_503 = true;
            break;
        }
        assert_eq!(headers["x-should-retry"], "false", "{status}");
    }
    assert!(saw_503, "the source's breaker opened: 503");
}

#[tokio::test(start_paused = true)]
async fn a_stream_failing_after_its_head_went_out_ends_with_an_error_event_and_no_done() {
    // The revoked key's 401 takes 30 s to come back; the head goes out after 15 s.
    let revoked = pgw_sim::SourceConfig {
        revoked: true.into(),
        error_latency_s: quick(30.0).into(),
        ..fast("dead")
    };
    let h = start(
        "sse_keep_alive_s = 15
",
        vec![revoked],
    )
    .await;
    let (status, headers, body) = call(h.addr, chat(None), chat_body("m", true)).await;
    assert_eq!(status, 200, "the SSE head went out before the call failed");
    assert_eq!(headers["content-type"], "text/event-stream");
    assert!(
        !headers.contains_key("x-pgw-group"),
        "no group was committed when the head went out"
    );
    let ev = events(&body);
    assert_eq!(ev.first().map(String::as_str), Some(":"), "{ev:?}");
    assert!(!ev.iter().any(|e| e == "[DONE]"), "{ev:?}");
    let last = ev.last().unwrap();
    let v: serde_json::Value = serde_json::from_str(last).unwrap();
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(!last.contains("dead"), "source names stay hidden: {last}");
}

#[tokio::test(start_paused = true)]
async fn keep_alive_comments_flow_while_the_first_chunk_is_awaited() {
    let h = start("sse_keep_alive_s = 15\n", vec![slow("s1", 50.0)]).await;
    let resp = send(h.addr, chat(None).body(Full::new(chat_body("m", true))).unwrap()).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut seen = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            seen.extend(events(&data));
        }
    }
    let first_data = seen.iter().position(|e| e != ":").unwrap();
    // 50 s (p95 60 s) to the first token, a comment every 15 s of silence.
    assert!(first_data >= 3, "{seen:?}");
    assert_eq!(seen.last().map(String::as_str), Some("[DONE]"));
}

/// Comments come only after a whole keep-alive interval of silence: none while events
/// flow (they flow here for longer than several intervals), and in a stall one every
/// interval after the last event (events do not move the timer; it is moved when it
/// ticks too early).
#[tokio::test(start_paused = true)]
async fn keep_alive_comments_come_only_after_an_interval_of_silence_mid_stream() {
    let source = pgw_sim::SourceConfig {
        // About 40 frames 0.2-1.5 s apart, and one 12 s stall among them.
        tokens_per_second: quick(2.0).into(),
        completion: pgw_sim::CompletionConfig {
            min_fraction: 1.0,
            max_fraction: 1.0,
            ..pgw_sim::CompletionConfig::default()
        },
        stall: pgw_sim::StallConfig {
            rate: 1.0,
            min_gap_s: 12.0,
            max_gap_s: 12.0,
        }
        .into(),
        ..fast("s1")
    };
    let h = start("sse_keep_alive_s = 5\n", vec![source]).await;
    let resp = send(h.addr, chat(None).body(Full::new(chat_body("m", true))).unwrap()).await;
    assert_eq!(resp.status(), 200);
    let start = tokio::time::Instant::now();
    let mut body = resp.into_body();
    // Per comment: the silence before it (since the last event or comment).
    let (mut last_data, mut last_out, mut comments, mut data) = (start, start, Vec::new(), 0);
    while let Some(frame) = body.frame().await {
        let Ok(bytes) = frame.unwrap().into_data() else {
            continue;
        };
        let now = tokio::time::Instant::now();
        for e in events(&bytes) {
            if e == ":" {
                comments.push(now - last_out);
            } else {
                data += 1;
                last_data = now;
            }
            last_out = now;
        }
    }
    let streamed = last_data - start;
    assert!(
        streamed > Duration::from_secs(20),
        "events flowed for {streamed:?} only"
    );
    assert!(data > 20, "{data} events");
    // The stall (12 s and one frame's gap, under 15 s): a comment 5 s after its last
    // event and another 5 s later; none while events flow.
    assert_eq!(comments.len(), 2, "{comments:?}");
    for quiet in &comments {
        assert!(
            *quiet >= Duration::from_secs(5) && *quiet < Duration::from_millis(5500),
            "a comment after {quiet:?} of silence: {comments:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn models_lists_the_groups_in_the_openai_shape() {
    let h = start("", vec![fast("s1")]).await;
    let (status, _, body) = call(h.addr, request("GET", "/v1/models"), Bytes::new()).await;
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "default");
    assert_eq!(v["data"][0]["object"], "model");
    assert!(v["data"][0]["created"].is_u64());
    assert!(v["data"][0]["owned_by"].is_string());
}

/// A key's `max_concurrency` is held on this process from before its body is read: a
/// key trickling a body holds its one slot, its next call is a 429 before any body is
/// read, and another key's call is served (the key's calls used to take the server's
/// in-flight slots first, and its quota was asked only once a body was read).
#[tokio::test(start_paused = true)]
async fn a_keys_concurrency_is_held_before_its_body_is_read() {
    const OTHER_KEY: &str = "pgw-client-key-other";
    let keys = format!(
        "max_in_flight = 2\n{}{}",
        key_toml("slow", CLIENT_KEY, "max_concurrency = 1\n"),
        key_toml("other", OTHER_KEY, "")
    );
    let h = start(&keys, vec![fast("s1")]).await;
    // Headers, and a body that does not come.
    let mut sock = TcpStream::connect(h.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         authorization: Bearer {CLIENT_KEY}\r\ncontent-length: 100\r\n\r\n"
    );
    sock.write_all(head.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    for _ in 0..3 {
        let (status, headers, body) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
        assert_eq!(status, 429, "{}", String::from_utf8_lossy(&body));
        openai_error(&body, "rate_limit_exceeded");
        assert!(headers.contains_key("retry-after"));
    }
    // The server's second in-flight slot is still there for another key.
    let (status, _, body) = call(h.addr, chat(Some(OTHER_KEY)), chat_body("m", false)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    // The slot comes back with the trickling call's end.
    drop(sock);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let (status, _, body) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
}

/// A model id with a `/` (`meta-llama/Llama-3.1-8B-Instruct`, as vLLM and OpenRouter
/// name models) is retrieved by its path: `{id}` matched one segment only, and such an
/// id was the fallback's 404 "no such endpoint".
#[tokio::test(start_paused = true)]
async fn a_model_id_with_a_slash_is_retrieved() {
    let h = start_with(
        "[models.\"meta-llama/Llama-3.1-8B-Instruct\"]\nroutes = [{ source = \"s1\" }]\n",
        "",
        vec![fast("s1")],
    )
    .await;
    let path = "/v1/models/meta-llama/Llama-3.1-8B-Instruct";
    let (status, _, body) = call(h.addr, request("GET", path), Bytes::new()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["id"], "meta-llama/Llama-3.1-8B-Instruct");
    let (status, _, body) = call(
        h.addr,
        request("GET", "/v1/models/meta-llama/other"),
        Bytes::new(),
    )
    .await;
    assert_eq!(status, 404);
    openai_error(&body, "model_not_found");
}

#[tokio::test(start_paused = true)]
async fn virtual_keys_401_unknown_404_foreign_models_429_past_quota() {
    let keys = key_toml("team-a", CLIENT_KEY, "models = [\"m\"]\nrpm = 1\n");
    let h = start(&keys, vec![fast("s1")]).await;
    for key in [None, Some("wrong-key")] {
        let (status, _, body) = call(h.addr, chat(key), chat_body("m", false)).await;
        assert_eq!(status, 401);
        let v = openai_error(&body, "invalid_api_key");
        assert_eq!(v["error"]["type"], "authentication_error");
        let (status, _, _) = call(h.addr, request("GET", "/v1/models"), Bytes::new()).await;
        assert_eq!(status, 401);
    }
    // The scheme is case-insensitive (it was 401 for anything but `Bearer`/`bearer`).
    let upper = request("GET", "/v1/models").header("authorization", format!("BEARER {CLIENT_KEY}"));
    let (status, _, _) = call(h.addr, upper, Bytes::new()).await;
    assert_eq!(status, 200);
    let (status, _, body) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("other-model", false)).await;
    assert_eq!(status, 404);
    openai_error(&body, "model_not_found");

    let (status, _, body) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (status, headers, body) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
    assert_eq!(status, 429, "rpm = 1");
    openai_error(&body, "rate_limit_exceeded");
    let after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    // A sliding minute frees the request one sub-window (1 s) after it leaves the span:
    // up to 61 s, rounded up to whole seconds.
    assert!((1..=61).contains(&after), "{after}");
    // The tenant's refusal never reached a source.
    assert_eq!(upstream_requests(&h), 1);
}

/// Each virtual key has its own partition of the response cache: the same prompt from
/// another key is a miss that goes upstream (it was a hit, and `x-pgw-cache: hit` told
/// the second tenant what the first had asked); the same key's repeat is a hit; with
/// `share_cache_across_keys`, keys share answers.
#[tokio::test(start_paused = true)]
async fn keys_do_not_share_cached_answers_unless_told() {
    for shared in [false, true] {
        let keys = format!(
            "share_cache_across_keys = {shared}\n{}{}",
            key_toml("team-a", CLIENT_KEY, ""),
            key_toml("team-b", "sk-client-b", "")
        );
        let h = start_edited("", &keys, vec![fast("s1")], |t| {
            t.replace("[cache]\nenabled = false", "[cache]\nwhen = \"always\"")
        })
        .await;
        let cache_of = |headers: &http::HeaderMap| headers["x-pgw-cache"].to_str().unwrap().to_owned();
        let (status, headers, _) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
        assert_eq!((status.as_u16(), cache_of(&headers).as_str()), (200, "miss"));
        let (status, headers, _) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
        assert_eq!(
            (status.as_u16(), cache_of(&headers).as_str()),
            (200, "hit"),
            "the same key"
        );
        let (status, headers, _) = call(h.addr, chat(Some("sk-client-b")), chat_body("m", false)).await;
        let other = if shared { "hit" } else { "miss" };
        assert_eq!(
            (status.as_u16(), cache_of(&headers).as_str()),
            (200, other),
            "shared {shared}"
        );
        assert_eq!(upstream_requests(&h), if shared { 1 } else { 2 });
        // Asked to bypass: neither read nor stored, and the header says so.
        let bypass = chat(Some(CLIENT_KEY)).header("x-pgw-cache", "no");
        let (status, headers, _) = call(h.addr, bypass, chat_body("m", false)).await;
        assert_eq!((status.as_u16(), cache_of(&headers).as_str()), (200, "bypass"));
        assert_eq!(upstream_requests(&h), if shared { 2 } else { 3 });
        let unknown = chat(Some(CLIENT_KEY)).header("x-pgw-cache", "off");
        let (status, _, body) = call(h.addr, unknown, chat_body("m", false)).await;
        assert_eq!(status, 400, "an unknown value is not read as `yes`");
        let v = openai_error(&body, "invalid_header");
        assert_eq!(v["error"]["param"], "x-pgw-cache");
    }
}

#[tokio::test(start_paused = true)]
async fn loopback_only_without_keys_unless_allowed() {
    let pool = pgw_sim::SimPool::new(
        pgw_sim::PoolConfig {
            sources: vec![fast("s1")],
            ..pgw_sim::PoolConfig::default()
        },
        1,
    )
    .unwrap();
    let (_, sim) = pgw_sim::http::serve(pool, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let text = config_text("", &sim, &[fast("s1")]).replace("127.0.0.1:0\"", "0.0.0.0:0\"");
    let config = pgw_server::ServerConfig::from_toml_str(&text).unwrap();
    let gateway = pgw_stack::Gateway::from_config(config.gateway.clone())
        .await
        .unwrap();
    let err = pgw_server::Server::bind(&config, gateway.clone(), None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("--allow-unauthenticated"), "{err}");
    let mut open = config.clone();
    open.server.allow_unauthenticated = true;
    assert!(
        pgw_server::Server::bind(&open, gateway.clone(), None)
            .await
            .is_ok()
    );
    let keyed = text.replace("[cache]", &format!("{}\n[cache]", key_toml("k", CLIENT_KEY, "")));
    let keyed = pgw_server::ServerConfig::from_toml_str(&keyed).unwrap();
    assert!(pgw_server::Server::bind(&keyed, gateway, None).await.is_ok());
}

/// Sends `bytes` one at a time, `every` apart; how many were sent when the server
/// closed the connection (or answered), `None` when the server waited for them all.
async fn trickle(addr: std::net::SocketAddr, bytes: &[u8], every: Duration) -> Option<usize> {
    trickle_after(addr, b"", bytes, every).await.0
}

/// Sends `head` at once, then `bytes` one at a time, `every` apart: how many of
/// `bytes` were sent when the server closed the connection (or answered), and what
/// it answered.
async fn trickle_after(
    addr: std::net::SocketAddr,
    head: &[u8],
    bytes: &[u8],
    every: Duration,
) -> (Option<usize>, Vec<u8>) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head).await.unwrap();
    for (i, b) in bytes.iter().enumerate() {
        if s.write_all(std::slice::from_ref(b)).await.is_err() {
            return (Some(i), Vec::new());
        }
        tokio::time::sleep(every).await;
        let mut buf = [0u8; 1024];
        // A closed connection reads as EOF or a reset; a live one has nothing to read.
        if let Ok(r) = tokio::time::timeout(Duration::from_millis(1), s.read(&mut buf)).await {
            let n = r.unwrap_or(0);
            assert!(
                n == 0 || !buf.starts_with(b"HTTP/1.1 2"),
                "a slow request was served"
            );
            let mut answer = buf[..n].to_vec();
            let _ = tokio::time::timeout(Duration::from_secs(1), s.read_to_end(&mut answer)).await;
            return (Some(i + 1), answer);
        }
    }
    (None, Vec::new())
}

#[tokio::test(start_paused = true)]
async fn slow_header_trickle_is_cut_at_the_header_timeout_and_opens_no_breaker() {
    let h = start("header_read_timeout_s = 2\n", vec![fast("s1")]).await;
    let head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: pgw.test\r\ncontent-type: application/json\r\nx-slow: aaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    // Each client would need head.len() * 0.5 s, about a minute, to send its headers.
    let clients: Vec<_> = (0..8)
        .map(|_| tokio::spawn(trickle(h.addr, head, Duration::from_millis(500))))
        .collect();
    for c in clients {
        let sent = c.await.unwrap();
        // 2 s at one byte per 0.5 s: cut after about 4 bytes, long before the head ends.
        assert!(
            sent.is_some_and(|n| n < head.len() / 2),
            "a slow client kept its connection past the header timeout: {sent:?} of {}",
            head.len()
        );
    }
    for s in h.gateway.sources() {
        assert_eq!(s.breaker.view().await.unwrap().state, BreakerState::Closed);
    }
    assert_eq!(upstream_requests(&h), 0);
    let (status, _, _) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(status, 200);
}

#[tokio::test(start_paused = true)]
async fn slow_body_trickle_is_cut_at_the_body_timeout_with_408_and_opens_no_breaker() {
    let h = start("body_read_timeout_s = 2\n", vec![fast("s1")]).await;
    let body = chat_body("m", false);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: pgw.test\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    // The head at once, then the body at one byte per 0.5 s: a minute for all of it.
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let (head, body) = (head.clone(), body.clone());
            tokio::spawn(async move {
                trickle_after(h.addr, head.as_bytes(), &body, Duration::from_millis(500)).await
            })
        })
        .collect();
    for c in clients {
        let (sent, answer) = c.await.unwrap();
        // 2 s at one byte per 0.5 s: cut after about 4 bytes, long before the body ends.
        assert!(
            sent.is_some_and(|n| n < body.len() / 2),
            "a slow body kept its connection past the body timeout: {sent:?} of {}",
            body.len()
        );
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(
            answer.to_ascii_lowercase().contains("connection: close"),
            "{answer}"
        );
        let json = answer.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        openai_error(json.as_bytes(), "request_timeout");
    }
    for s in h.gateway.sources() {
        assert_eq!(s.breaker.view().await.unwrap().state, BreakerState::Closed);
    }
    assert_eq!(upstream_requests(&h), 0, "a trickled body cost no attempt");
    let (status, _, _) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(status, 200);
}

#[tokio::test(start_paused = true)]
async fn an_idle_kept_alive_connection_is_closed_after_the_header_timeout() {
    let h = start("header_read_timeout_s = 5\n", vec![fast("s1")]).await;
    let stream = TcpStream::connect(h.addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let resp = sender
        .send_request(request("GET", "/healthz").body(Full::new(Bytes::new())).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    drop(resp.into_body().collect().await);
    // Kept alive after the answer, then closed by the server once idle for 5 s.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!conn.is_finished());
    tokio::time::timeout(Duration::from_secs(30), conn)
        .await
        .expect("the idle connection was never closed")
        .unwrap()
        .ok();
}

/// `n` streamed chat calls on `n` connections, each answering its status and events.
fn streamed_calls(
    addr: std::net::SocketAddr,
    n: usize,
) -> Vec<tokio::task::JoinHandle<(http::StatusCode, Vec<String>)>> {
    (0..n)
        .map(|_| {
            tokio::spawn(async move {
                let (status, _, body) = call(addr, chat(None), chat_body("m", true)).await;
                (status, events(&body))
            })
        })
        .collect()
}
#[tokio::test(start_paused = true)]
async fn a_connection_flood_past_the_cap_gets_503_while_calls_in_flight_finish() {
    let h = start(
        "max_connections = 2\nshed_retry_after_s = 2\n",
        vec![slow("s1", 30.0)],
    )
    .await;
    let in_flight = streamed_calls(h.addr, 2);
    // Both calls are waiting for their first token (30 s away) on the two connections.
    while upstream_requests(&h) < 2 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Liveness and the metrics still answer past the cap (the metrics were 503: a
    // flood was when the operator could not see it).
    let shed = || async {
        let (status, _, text) = call(h.addr, request("GET", "/metrics"), Bytes::new()).await;
        assert_eq!(status, 200);
        let text = String::from_utf8_lossy(&text).into_owned();
        metric(&text, "pgw_server_shed_total", &[("reason", "connections")])
    };
    let before = shed().await;
    for _ in 0..5 {
        let (status, headers, body) = call(h.addr, chat(None), chat_body("m", false)).await;
        assert_eq!(status, 503);
        assert_eq!(headers["retry-after"], "2");
        openai_error(&body, "overloaded");
    }
    let refused = shed().await;
    assert!(refused - before >= 5.0, "{before} -> {refused}");
    for _ in 0..20 {
        let (status, _, _) = call(h.addr, request("GET", "/healthz"), Bytes::new()).await;
        assert_eq!(status, 200);
    }
    // Probes served past the cap are not refusals (each counted one, before). The
    // counter is the process's: other tests of this binary may add a few meanwhile.
    let probed = shed().await;
    assert!(probed - refused < 20.0, "{refused} -> {probed}");
    for c in in_flight {
        let (status, ev) = c.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{ev:?}");
    }
    assert_eq!(
        upstream_requests(&h),
        2,
        "the refused calls cost nothing upstream"
    );
    let (status, _, _) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(status, 200, "slots are free again");
}

#[tokio::test(start_paused = true)]
async fn calls_past_the_in_flight_cap_get_503_with_retry_after() {
    let h = start("max_in_flight = 1\n", vec![slow("s1", 20.0)]).await;
    let addr = h.addr;
    let first = tokio::spawn(async move { call(addr, chat(None), chat_body("m", true)).await });
    while upstream_requests(&h) < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, headers, body) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(status, 503);
    assert_eq!(headers["retry-after"], "1");
    openai_error(&body, "overloaded");
    // Health and metrics are not shed.
    let (status, _, _) = call(h.addr, request("GET", "/healthz"), Bytes::new()).await;
    assert_eq!(status, 200);
    let (status, _, body) = first.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(events(&body).last().map(String::as_str), Some("[DONE]"));
}

/// A request whose body is still coming holds its in-flight slot: with `max_in_flight
/// = 1`, a second request meanwhile is shed. Before, the slot was taken after the body
/// was read, so as many bodies as connections (1024 x 8 MiB by default) could be held
/// in memory at once.
#[tokio::test(start_paused = true)]
async fn a_body_being_read_holds_its_in_flight_slot() {
    let h = start("max_in_flight = 1\n", vec![fast("s1")]).await;
    let body = chat_body("m", false);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let mut slow = TcpStream::connect(h.addr).await.unwrap();
    slow.write_all(head.as_bytes()).await.unwrap();
    slow.write_all(&body[..10]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, _, body_503) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(status, 503);
    openai_error(&body_503, "overloaded");
    // The slow body ends: its call is answered, and the slot is free again.
    slow.write_all(&body[10..]).await.unwrap();
    let mut answer = vec![0u8; 12];
    slow.read_exact(&mut answer).await.unwrap();
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    drop(slow);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, _, _) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(status, 200);
}

#[tokio::test(start_paused = true)]
async fn shutdown_drains_a_running_stream_then_stops() {
    let mut h = start("shutdown_grace_s = 120\n", vec![slow("s1", 20.0)]).await;
    let addr = h.addr;
    let stream = tokio::spawn(async move {
        let resp = send(addr, chat(None).body(Full::new(chat_body("m", true))).unwrap()).await;
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, events(&body))
    });
    while upstream_requests(&h) < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    h.shutdown();
    tokio::time::sleep(Duration::from_millis(10)).await;
    // Draining: no new connections are accepted (the listener is closed).
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "still accepting after shutdown"
    );
    let (status, ev) = stream.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{ev:?}");
    h.stopped().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn shutdown_cuts_what_is_left_after_the_grace_period() {
    // The head goes out after 1 s of waiting for the first token (60 s away), the cut at 5 s.
    let mut h = start(
        "shutdown_grace_s = 5\nsse_keep_alive_s = 1\n",
        vec![slow("s1", 60.0)],
    )
    .await;
    let addr = h.addr;
    let stream = tokio::spawn(async move {
        let resp = send(addr, chat(None).body(Full::new(chat_body("m", true))).unwrap()).await;
        resp.into_body()
            .collect()
            .await
            .map(http_body_util::Collected::to_bytes)
    });
    while upstream_requests(&h) < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    h.stopped().await.unwrap();
    // The stream was cut, not completed: no [DONE], and an error event saying why (the
    // connection was closed without one, which a client reads as a network fault).
    let body = stream.await.unwrap().expect("the body ended, not the connection");
    let ev = events(&body);
    assert!(!ev.iter().any(|e| e == "[DONE]"), "{ev:?}");
    let last: serde_json::Value = serde_json::from_str(ev.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "shutting_down", "{ev:?}");
}

/// A call still waiting for its answer when the grace period ends (a non-streamed
/// one, or a stream before its head: the keep-alive interval is longer than the
/// grace) is answered 503 `shutting_down` with `Retry-After`, not reset when the
/// connection is closed.
#[tokio::test(start_paused = true)]
async fn a_call_without_an_answer_at_the_end_of_the_grace_period_is_answered_503() {
    for streamed in [false, true] {
        let mut h = start(
            "shutdown_grace_s = 5\nsse_keep_alive_s = 30\n",
            vec![slow("s1", 60.0)],
        )
        .await;
        let addr = h.addr;
        let waiting = tokio::spawn(async move {
            let resp = send(
                addr,
                chat(None).body(Full::new(chat_body("m", streamed))).unwrap(),
            )
            .await;
            let status = resp.status();
            let retry = resp.headers().get("retry-after").cloned();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            (status, retry, body)
        });
        while upstream_requests(&h) < 1 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        h.stopped().await.unwrap();
        let (status, retry, body) = waiting.await.unwrap();
        assert_eq!(
            status,
            503,
            "streamed {streamed}: {}",
            String::from_utf8_lossy(&body)
        );
        assert_eq!(retry.unwrap(), "1", "streamed {streamed}");
        openai_error(&body, "shutting_down");
    }
}

/// The names of this process's threads (Linux; empty elsewhere).
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
                .map(|n| n.trim().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

// On the real clock: the second event loop has a runtime of its own, out of a paused
// clock's reach. The simulated source takes 0.5 s to its first token, so both streams
// are in flight when the cap is tested and when the shutdown comes.
#[tokio::test]
async fn event_loops_on_threads_share_the_connection_cap_and_all_drain_on_shutdown() {
    let mut h = start(
        "threads = 2\nmax_connections = 2\nshutdown_grace_s = 60\n",
        vec![slow("s1", 0.5)],
    )
    .await;
    let streams = streamed_calls(h.addr, 2);
    while upstream_requests(&h) < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let linux = cfg!(target_os = "linux");
    if linux {
        assert!(
            thread_names().iter().any(|n| n == "pgw-loop-1"),
            "{:?}",
            thread_names()
        );
    }
    // Whichever loops accepted the two, the cap is the server's, not a loop's.
    let (status, _, body) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(status, 503);
    openai_error(&body, "overloaded");
    h.shutdown();
    for s in streams {
        let (status, ev) = s.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{ev:?}");
    }
    h.stopped().await.unwrap();
    if linux {
        assert!(
            !thread_names().iter().any(|n| n.starts_with("pgw-loop")),
            "run returned before its loops ended: {:?}",
            thread_names()
        );
    }
}

fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Every line of a Prometheus text exposition: a comment, or `name{labels} value`.
fn assert_prometheus_text(text: &str) {
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# ") {
            assert!(rest.starts_with("TYPE ") || rest.starts_with("HELP "), "{line}");
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
        assert!(
            value.parse::<f64>().is_ok() || ["+Inf", "-Inf", "NaN"].contains(&value),
            "{line}"
        );
        let name_end = series.find('{').unwrap_or(series.len());
        let name = &series[..name_end];
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "{line}"
        );
        if name_end < series.len() {
            assert!(series.ends_with('}'), "{line}");
        }
    }
}

// On the real clock: a stream passed through crosses two loopback sockets (simulator ->
// gateway -> client), and the paused clock jumps to the next timer (the watchdog) whenever
// every task waits, bytes in flight or not. The simulated source answers in milliseconds;
// nothing here asserts on time.
#[tokio::test]
async fn metrics_parse_as_prometheus_text_and_move_when_calls_run() {
    let keys = key_toml("metrics-tenant", CLIENT_KEY, "models = [\"m\"]\n");
    // Behind a hard limit of 600 requests a minute (ten a second refill), so its answers
    // carry `x-ratelimit-*` headers.
    let limited = pgw_sim::SourceConfig {
        limits: pgw_sim::HardLimits {
            rpm: Some(600),
            ..pgw_sim::HardLimits::default()
        }
        .into(),
        ..fast("s1")
    };
    let h = start(&keys, vec![limited]).await;
    let scrape = || async {
        let (status, headers, body) = call(h.addr, request("GET", "/metrics"), Bytes::new()).await;
        assert_eq!(status, 200);
        assert!(
            headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/plain")
        );
        String::from_utf8(body.to_vec()).unwrap()
    };
    let before = scrape().await;
    assert_prometheus_text(&before);
    let calls = [("tenant", "metrics-tenant"), ("status", "200")];
    assert_eq!(metric(&before, "pgw_server_calls_total", &calls), 0.0);
    for stream in [false, true] {
        let (status, _, _) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", stream)).await;
        assert_eq!(status, 200);
    }
    // A model the key may not use is a call refused, and counted (it was not).
    let (status, _, _) = call(
        h.addr,
        chat(Some(CLIENT_KEY)),
        chat_body("not-for-this-key", false),
    )
    .await;
    assert_eq!(status, 404);
    let after = scrape().await;
    assert_prometheus_text(&after);
    assert_eq!(metric(&after, "pgw_server_calls_total", &calls), 2.0, "{after}");
    let refused = [("tenant", "metrics-tenant"), ("status", "404")];
    assert_eq!(metric(&after, "pgw_server_calls_total", &refused), 1.0, "{after}");
    assert!(
        metric(
            &after,
            "pgw_attempts_total",
            &[("source", "s1"), ("outcome", "success")]
        ) >= 2.0
    );
    assert_eq!(metric(&after, "pgw_breaker_state", &[("source", "s1")]), 0.0);
    assert!(after.contains("pgw_aimd_limit{source=\"s1\"}"), "{after}");
    // The provider's count after the last answer: two requests taken, and what refilled
    // meanwhile (under a minute: less than the whole limit).
    let left = metric(
        &after,
        "pgw_provider_remaining",
        &[("source", "s1"), ("limit", "requests")],
    );
    assert!((1.0..=599.0).contains(&left), "{after}");
    assert!(
        !after
            .lines()
            .any(|l| l.starts_with("pgw_provider_remaining{") && l.contains("limit=\"tokens\"")),
        "no TPM limit, no tokens figure: {after}"
    );
    assert!(
        after.contains("gen_ai_client_operation_duration_seconds_bucket"),
        "{after}"
    );
    assert!(
        after.contains("gen_ai_server_time_to_first_token_seconds_bucket"),
        "{after}"
    );
    assert!(
        after.contains("http_server_request_duration_seconds_bucket"),
        "{after}"
    );
    assert!(!after.contains(UPSTREAM_KEY) && !after.contains(CLIENT_KEY));
}

#[tokio::test(start_paused = true)]
async fn healthz_and_readyz() {
    let mut h = start("", vec![fast("s1")]).await;
    for path in ["/healthz", "/readyz"] {
        let (status, _, _) = call(h.addr, request("GET", path), Bytes::new()).await;
        assert_eq!(status, 200, "{path}");
    }
    h.stopped().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn past_the_connection_cap_liveness_answers_and_readiness_refuses() {
    let h = start("max_connections = 1\n", vec![slow("s1", 30.0)]).await;
    let in_flight = streamed_calls(h.addr, 1);
    while upstream_requests(&h) < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The only connection is taken: the process is up (an orchestrator must not
    // restart it) but full (a balancer must not send more).
    let (status, headers, body) = call(h.addr, request("GET", "/healthz"), Bytes::new()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (status, shed, body) = call(h.addr, request("GET", "/readyz"), Bytes::new()).await;
    assert_eq!(status, 503);
    openai_error(&body, "overloaded");
    // Answered outside the router, each still names itself.
    for h in [&headers, &shed] {
        assert!(h["x-request-id"].to_str().unwrap().starts_with("req_"), "{h:?}");
    }
    for c in in_flight {
        assert_eq!(c.await.unwrap().0, 200);
    }
}

#[tokio::test(start_paused = true)]
async fn a_tenant_is_refunded_for_calls_that_reached_no_provider() {
    let keys = key_toml("refunded", CLIENT_KEY, "rpm = 1\n");
    // With `[models]`, a model no route serves is the gateway's own 404: no source asked.
    let h = start_with(
        "[models.m]\nroutes = [{ source = \"s1\" }]\n",
        &keys,
        vec![fast("s1")],
    )
    .await;
    for stream in [false, true] {
        let (status, _, body) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("nope", stream)).await;
        assert_eq!(status, 404, "stream {stream}");
        openai_error(&body, "model_not_found");
    }
    assert_eq!(upstream_requests(&h), 0);
    // Both refusals were given back: the one request of the minute is still there.
    let (status, _, body) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    // And the quota holds: a call that reached the provider stays charged.
    let (status, _, body) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
    assert_eq!(status, 429);
    let v = openai_error(&body, "rate_limit_exceeded");
    assert_eq!(
        v["error"]["message"], "quota exceeded",
        "the tenant's own refusal"
    );
}

/// Calls the provider served until `retry.max_call_duration_s` cut them are charged
/// to the tenant: a stream cut after its head went out (the caller has the text so
/// far), and a plain call whose attempt was in flight. Before, both were refunded as
/// if no provider had been asked: a tenant could stream without limit past its quota.
#[tokio::test(start_paused = true)]
async fn calls_cut_at_the_call_deadline_are_charged_to_the_tenant() {
    const PLAIN_KEY: &str = "sk-pgw-plain-client-0123456789";
    let keys = format!(
        "{}{}",
        key_toml("cut-stream", CLIENT_KEY, "rpm = 1\n"),
        key_toml("cut-plain", PLAIN_KEY, "rpm = 1\n")
    );
    // 8-36 tokens at one every 2 s: far more than the 2 s the call may last.
    let slow_tokens = pgw_sim::SourceConfig {
        tokens_per_second: quick(0.5).into(),
        ..fast("s1")
    };
    let h = start_edited("", &keys, vec![slow_tokens], |t| {
        t.replace("[retry]\n", "[retry]\nmax_call_duration_s = 2\n")
    })
    .await;
    let (status, _, body) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", true)).await;
    assert_eq!(status, 200, "the head went out");
    let ev = events(&body);
    assert!(
        ev.iter().any(|e| e.contains("\"content\"")),
        "text so far: {ev:?}"
    );
    assert_ne!(ev.last().map(String::as_str), Some("[DONE]"), "cut: {ev:?}");
    let (status, _, body) = call(h.addr, chat(Some(PLAIN_KEY)), chat_body("m", false)).await;
    assert_eq!(status, 504, "{}", String::from_utf8_lossy(&body));
    for key in [CLIENT_KEY, PLAIN_KEY] {
        let (status, _, body) = call(h.addr, chat(Some(key)), chat_body("m", false)).await;
        assert_eq!(status, 429, "charged: {}", String::from_utf8_lossy(&body));
    }
}

/// A call that ends on the upstream's pushback is a 429 with a `Retry-After`, not a
/// 502: the source answers 429 with `Retry-After` past the call's pushback bound (5 s
/// here), the retry layer holds the source (holds are on), and the call ends on the
/// bound with the hold's refusal as its last error.
#[tokio::test(start_paused = true)]
async fn a_call_ended_by_upstream_pushback_is_429_with_retry_after() {
    let tight = pgw_sim::SourceConfig {
        limits: pgw_sim::HardLimits {
            rpm: Some(1),
            ..pgw_sim::HardLimits::default()
        }
        .into(),
        ..fast("s1")
    };
    let h = start_edited("", "", vec![tight], |t| {
        t.replace("[retry]\n", "[retry]\nmax_pushback_wait_s = 5\n")
    })
    .await;
    let (status, _, body) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (status, headers, body) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(status, 429, "{}", String::from_utf8_lossy(&body));
    openai_error(&body, "rate_limit_exceeded");
    let after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=60).contains(&after), "{after}");
}

/// The same with an overloaded provider: a source answering 529 `overloaded_error`
/// with `Retry-After: 30` is the gateway's 503 `overloaded`, not a quota's 429,
/// although the call's last error is the hold's refusal (holds on, the default): the
/// attempt's record keeps the upstream's status. Whether the wait passed the call's
/// pushback bound (5 s here) or its own deadline (`x-pgw-timeout-ms: 10000`).
#[tokio::test(start_paused = true)]
async fn a_call_ended_by_an_overloaded_upstream_is_503_with_retry_after() {
    for (pushback_bound, deadline) in [(Some(5), None), (None, Some("10000"))] {
        let busy = pgw_sim::SourceConfig {
            overloaded_rate: 1.0.into(),
            overloaded_retry_after_s: Some(30),
            ..fast("s1")
        };
        let h = start_edited("", "", vec![busy], |t| match pushback_bound {
            Some(s) => t.replace("[retry]\n", &format!("[retry]\nmax_pushback_wait_s = {s}\n")),
            None => t,
        })
        .await;
        let req = move || match deadline {
            Some(ms) => chat(None).header("x-pgw-timeout-ms", ms),
            None => chat(None),
        };
        let addr = h.addr;
        let first = tokio::spawn(async move { call(addr, req(), chat_body("m", false)).await });
        while upstream_requests(&h) < 1 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Its 529 came back and the route is held.
        tokio::time::sleep(Duration::from_secs(1)).await;
        // A second call while the hold lasts, which may wait 3 s, asks no provider:
        // refused by the hold alone (`WaitTooLong`), it is told by the hold itself
        // that the provider is overloaded (it was 429 `rate_limit_exceeded`: no
        // pushback of its own to tell by).
        let later = chat(None).header("x-pgw-timeout-ms", "3000");
        let later = call(h.addr, later, chat_body("m", false)).await;
        for (which, (status, headers, body)) in [("first", first.await.unwrap()), ("later", later)] {
            let case = format!("bound {pushback_bound:?}, deadline {deadline:?}, {which} call");
            assert_eq!(status, 503, "{case}: {}", String::from_utf8_lossy(&body));
            openai_error(&body, "overloaded");
            let after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
            assert!((1..=30).contains(&after), "{case}: {after}");
        }
        assert_eq!(upstream_requests(&h), 1, "held after the first 529");
    }
}

/// `x-pgw-timeout-ms` bounds one call (R3: a deadline per request, honoured by every
/// wait): a source whose first token takes 30 s gives a 2 s call a 504 at 2 s; a value
/// that is not a whole number of milliseconds from 1 to 24 h is a 400 naming the
/// header, before the body is read or the call asks anything.
#[tokio::test(start_paused = true)]
async fn a_request_header_bounds_the_call() {
    let h = start("", vec![slow("s1", 30.0)]).await;
    let start = tokio::time::Instant::now();
    let timed = chat(None).header("x-pgw-timeout-ms", "2000");
    let (status, _, body) = call(h.addr, timed, chat_body("m", false)).await;
    assert_eq!(status, 504, "{}", String::from_utf8_lossy(&body));
    openai_error(&body, "deadline_exceeded");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_millis(2500),
        "{took:?}"
    );
    let before = upstream_requests(&h);
    for bad in ["0", "-5", "soon", "1.5", "86400001", "+100", "0100"] {
        let req = chat(None).header("x-pgw-timeout-ms", bad);
        let (status, _, body) = call(h.addr, req, chat_body("m", false)).await;
        assert_eq!(status, 400, "{bad}");
        let v = openai_error(&body, "invalid_header");
        assert_eq!(v["error"]["param"], "x-pgw-timeout-ms", "{bad}");
    }
    assert_eq!(upstream_requests(&h), before, "refused before asking anyone");
}

#[tokio::test(start_paused = true)]
async fn a_tenant_keeps_its_concurrency_slot_for_a_call_longer_than_the_lease() {
    let keys = key_toml("long-calls", CLIENT_KEY, "max_concurrency = 1\n");
    // Leases of 3 s, renewed every second while the call runs; the call takes 30 s.
    let h = start_with("[ratelimit]\nlease_ttl_s = 3\n", &keys, vec![slow("s1", 30.0)]).await;
    let addr = h.addr;
    let first = tokio::spawn(async move { call(addr, chat(Some(CLIENT_KEY)), chat_body("m", true)).await });
    while upstream_requests(&h) < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (status, _, body) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
    assert_eq!(
        status,
        429,
        "the slot is still held: {}",
        String::from_utf8_lossy(&body)
    );
    openai_error(&body, "rate_limit_exceeded");
    let (status, _, body) = first.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(events(&body).last().map(String::as_str), Some("[DONE]"));
    let (status, _, _) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
    assert_eq!(status, 200, "released at the end");
}

/// A source serving two public models: its quota (one limiter for both routes) is one
/// series under the source's name, not one per route counting every admission twice.
#[tokio::test(start_paused = true)]
async fn quota_admissions_are_one_series_per_source_under_models() {
    let h = start_with(
        "[models.qa]\nroutes = [{ source = \"quota-src\", model = \"x\" }]\n\
         [models.qb]\nroutes = [{ source = \"quota-src\", model = \"y\" }]\n",
        "",
        vec![fast("quota-src")],
    )
    .await;
    for model in ["qa", "qa", "qb"] {
        let (status, _, _) = call(h.addr, chat(None), chat_body(model, false)).await;
        assert_eq!(status, 200, "{model}");
    }
    let (_, _, text) = call(h.addr, request("GET", "/metrics"), Bytes::new()).await;
    let text = String::from_utf8(text.to_vec()).unwrap();
    assert_eq!(
        metric(&text, "pgw_quota_admitted", &[("source", "quota-src")]),
        3.0,
        "{text}"
    );
    assert!(!text.contains("pgw_quota_admitted{source=\"quota-src/"), "{text}");
    assert!(
        text.contains("pgw_aimd_limit{source=\"quota-src/x\"}"),
        "route gauges stay per route: {text}"
    );
}

#[tokio::test(start_paused = true)]
async fn metrics_stay_bounded_and_count_streamed_usage_and_cancelled_calls() {
    let h = start_with(
        "[models.usage-probe]\nroutes = [{ source = \"s1\" }]\n[models.cancel-probe]\nroutes = [{ source = \"s2\" }]\n",
        "",
        vec![fast("s1"), slow("s2", 30.0)],
    )
    .await;
    // A method hyper accepts but HTTP does not define: one `_OTHER` series, whatever
    // the name.
    for m in ["BREW", "WHEN"] {
        let (status, _, _) = call(h.addr, request(m, "/v1/models"), Bytes::new()).await;
        assert_eq!(status, 405, "{m}");
    }
    // A stream whose caller did not ask for the usage chunk: the usage still counts.
    let (status, _, body) = call(h.addr, chat(None), chat_body("usage-probe", true)).await;
    assert_eq!(status, 200);
    let ev = events(&body);
    assert!(!ev.iter().any(|e| e.contains("\"usage\"")), "{ev:?}");
    // A call whose client goes away before the answer.
    let addr = h.addr;
    let gone = tokio::spawn(async move { call(addr, chat(None), chat_body("cancel-probe", false)).await });
    while h.pool.stats().sources.get("s2").map_or(0, |s| s.received) < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gone.abort();
    let _ = gone.await;
    tokio::time::sleep(Duration::from_millis(100)).await;

    let (_, _, text) = call(h.addr, request("GET", "/metrics"), Bytes::new()).await;
    let text = String::from_utf8(text.to_vec()).unwrap();
    assert!(!text.contains("BREW") && !text.contains("WHEN"), "{text}");
    assert!(text.contains("http_request_method=\"_OTHER\""), "{text}");
    let usage = [
        ("gen_ai_token_type", "output"),
        ("gen_ai_request_model", "usage-probe"),
    ];
    assert_eq!(
        metric(&text, "gen_ai_client_token_usage_count", &usage),
        1.0,
        "{text}"
    );
    let cancelled = [
        ("gen_ai_request_model", "cancel-probe"),
        ("error_type", "cancelled"),
    ];
    assert_eq!(
        metric(
            &text,
            "gen_ai_client_operation_duration_seconds_count",
            &cancelled
        ),
        1.0,
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_delay_keeps_serving_while_readyz_says_503() {
    let mut h = start("shutdown_delay_s = 5\n", vec![fast("s1")]).await;
    h.shutdown();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let (status, _, body) = call(h.addr, request("GET", "/readyz"), Bytes::new()).await;
    assert_eq!(status, 503);
    openai_error(&body, "draining");
    let (status, _, _) = call(h.addr, chat(None), chat_body("m", false)).await;
    assert_eq!(status, 200, "still serving during the delay");
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        TcpStream::connect(h.addr).await.is_err(),
        "the listener is closed after the delay"
    );
    h.stopped().await.unwrap();
}

/// An upstream that streams chunks of about 1 KiB of text without end, as fast as its
/// connection takes them: its address, and a signal sent once its connection closed.
async fn endless_upstream() -> (std::net::SocketAddr, tokio::sync::oneshot::Receiver<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (closed, closed_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut request = vec![0; 64 * 1024];
        let _ = conn.read(&mut request).await.unwrap();
        let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        conn.write_all(head.as_bytes()).await.unwrap();
        let text = "x".repeat(1024);
        let event = format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}},\"finish_reason\":null}}]}}\n\n"
        );
        let frame = format!("{:x}\r\n{event}\r\n", event.len());
        while conn.write_all(frame.as_bytes()).await.is_ok() {}
        let _ = closed.send(());
    });
    (addr, closed_rx)
}

/// A client that stops reading a stream is cut once the server's writes to it have
/// waited `write_timeout_s`: until then the call holds the tenant's one concurrency
/// slot; then the connection ends (no `[DONE]`), the upstream request is cancelled,
/// the slot serves the next call, and the source is not blamed.
#[tokio::test(start_paused = true)]
async fn a_client_that_stops_reading_is_cut_at_the_write_timeout_and_its_slot_freed() {
    use tokio::sync::oneshot::error::TryRecvError;
    let keys = key_toml("stalled-reader", CLIENT_KEY, "max_concurrency = 1\n");
    // Model `endless` is s1, which streams without end; model `m` is s2, a simulated
    // source that answers the calls that follow (never routed to s1).
    let (upstream, mut upstream_closed) = endless_upstream().await;
    let h = start_edited(
        "[models.endless]\nroutes = [{ source = \"s1\" }]\n[models.m]\nroutes = [{ source = \"s2\" }]\n",
        &format!("write_timeout_s = 10\n{keys}"),
        vec![fast("s1"), fast("s2")],
        |text| {
            let key = "name = \"s1\"\nbase_url = \"";
            let at = text.find(key).unwrap() + key.len();
            let end = at + text[at..].find('"').unwrap();
            format!("{}http://{upstream}/v1{}", &text[..at], &text[end..])
        },
    )
    .await;
    let req = chat(Some(CLIENT_KEY))
        .body(Full::new(chat_body("endless", true)))
        .unwrap();
    let resp = send(h.addr, req).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(upstream_closed.try_recv(), Err(TryRecvError::Empty));
    // Not read: the server's writes wait, the call holds its slot...
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (status, _, answer) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
    assert_eq!(status, 429, "{}", String::from_utf8_lossy(&answer));
    assert_eq!(
        upstream_closed.try_recv(),
        Err(TryRecvError::Empty),
        "the upstream still streams"
    );
    // ... until they have waited 10 s: then the connection is cut, the call dropped
    // (checked well after, so a late first blocked write does not matter).
    tokio::time::sleep(Duration::from_secs(20)).await;
    let (status, _, answer) = call(h.addr, chat(Some(CLIENT_KEY)), chat_body("m", false)).await;
    assert_eq!(
        status,
        200,
        "the stalled call's slot is free: {}",
        String::from_utf8_lossy(&answer)
    );
    // The upstream request was cancelled with it, not ended by its own timeouts.
    tokio::time::timeout(Duration::from_secs(1), upstream_closed)
        .await
        .expect("the upstream request was not cancelled")
        .unwrap();
    // What the stalled reader can still read (what the sockets held) is whole chunks
    // and at most the start of one, then the connection's end: no error event, no
    // `[DONE]`.
    let mut stalled = resp.into_body();
    let mut read = Vec::new();
    while let Some(Ok(frame)) = stalled.frame().await {
        read.extend_from_slice(frame.data_ref().map_or(&[][..], |d| &d[..]));
    }
    let text = String::from_utf8_lossy(&read);
    let whole = &text[..text.rfind("\n\n").map_or(0, |i| i + 2)];
    let ev = events(whole.as_bytes());
    assert!(!ev.is_empty(), "no whole event reached the reader");
    assert!(
        ev.iter().all(|e| e.contains("chat.completion.chunk")),
        "{:?}",
        ev.last().map(|e| &e[..e.len().min(200)])
    );
    assert!(!text.contains("[DONE]") && !text.contains("\"error\""));
    assert_eq!(
        h.gateway.health("s1/endless"),
        Some(1.0),
        "the source is not blamed"
    );
    assert_eq!(
        h.gateway.stream_health("s1/endless"),
        Some(1.0),
        "the source is not blamed"
    );
}
