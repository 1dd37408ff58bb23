//! The attempt against a scripted provider, on tokio's paused clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::BodyExt;
use http_body_util::StreamBody;
use http_body_util::combinators::UnsyncBoxBody;
use pgw_client::{
    AnswerClassifier, ChatCall, MalformedResponse, SecretKey, SourceSettings, Timeouts, UpstreamClient,
    Watchdog, WatchdogCut,
};
use pgw_core::openai::{ChatChunk, ChatRequest, ChunkChoice, Delta, Usage};
use pgw_core::{BoxError, Classify, EmptyCompletion, Outcome, UpstreamStatus};
use tokio::time::Instant;
use tower::{ServiceExt, service_fn};

const KEY: &str = "sk-test-very-secret-42";

/// What the scripted provider answers.
#[derive(Clone, Default)]
struct Script {
    status: u16,
    headers: Vec<(&'static str, String)>,
    head_after: Option<Duration>, // None: never answers
    frames: Vec<(Duration, Bytes)>,
    hang_after_frames: bool,
}

type Body = UnsyncBoxBody<Bytes, BoxError>;

struct DropFlag(Arc<AtomicBool>);
impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

fn body(script: &Script, dropped: Arc<AtomicBool>) -> Body {
    let frames = script.frames.clone();
    let hang = script.hang_after_frames;
    let guard = DropFlag(dropped);
    let s = futures_util::stream::unfold((frames.into_iter(), guard), move |(mut it, g)| async move {
        match it.next() {
            Some((delay, bytes)) => {
                tokio::time::sleep(delay).await;
                Some((Ok::<_, BoxError>(http_body::Frame::data(bytes)), (it, g)))
            }
            None if hang => std::future::pending().await,
            None => None,
        }
    });
    StreamBody::new(s).boxed_unsync()
}

#[derive(Clone, Default)]
struct Provider {
    seen: Arc<std::sync::Mutex<Vec<http::Request<Bytes>>>>,
    dropped: Arc<AtomicBool>,
}

impl Provider {
    fn client(
        &self,
        script: Script,
        timeouts: Timeouts,
    ) -> UpstreamClient<
        impl tower::Service<http::Request<Bytes>, Response = http::Response<Body>, Error = BoxError, Future: Send>
        + Clone
        + Send
        + 'static,
    > {
        self.client_for(script, timeouts, Some("override-model"))
    }

    /// A client whose source sends `model` instead of the caller's (none: the caller's).
    fn client_for(
        &self,
        script: Script,
        timeouts: Timeouts,
        model: Option<&str>,
    ) -> UpstreamClient<
        impl tower::Service<http::Request<Bytes>, Response = http::Response<Body>, Error = BoxError, Future: Send>
        + Clone
        + Send
        + 'static,
    > {
        let seen = Arc::clone(&self.seen);
        let dropped = Arc::clone(&self.dropped);
        let svc = service_fn(move |req: http::Request<Bytes>| {
            seen.lock().unwrap().push(req);
            let script = script.clone();
            let dropped = Arc::clone(&dropped);
            async move {
                match script.head_after {
                    Some(d) => tokio::time::sleep(d).await,
                    None => std::future::pending::<()>().await,
                }
                let mut b = http::Response::builder().status(script.status);
                for (k, v) in &script.headers {
                    b = b.header(*k, v);
                }
                Ok::<_, BoxError>(b.body(body(&script, dropped)).unwrap())
            }
        });
        let mut settings = SourceSettings::new("s1", "http://provider.test/v1")
            .key(SecretKey::new(KEY))
            .timeouts(timeouts);
        if let Some(m) = model {
            settings = settings.model(m);
        }
        UpstreamClient::new(settings, svc).unwrap()
    }
}

fn timeouts() -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(1),
        first_token: Duration::from_secs(5),
        inter_token: Duration::from_secs(2),
        total: Duration::from_secs(60),
    }
}

fn chunk(text: &str, finish: bool) -> Bytes {
    let c = ChatChunk {
        id: "c1".into(),
        object: "chat.completion.chunk".into(),
        model: "m".into(),
        choices: vec![ChunkChoice {
            index: 0,
            delta: Delta {
                content: Some(text.into()),
                ..Delta::default()
            },
            finish_reason: finish.then(|| "stop".into()),
            ..ChunkChoice::default()
        }],
        ..ChatChunk::default()
    };
    Bytes::from(pgw_core::sse::encode_data(&serde_json::to_string(&c).unwrap()))
}

fn usage_chunk() -> Bytes {
    let c = ChatChunk {
        usage: Some(Usage::new(3, 2, 5)),
        ..ChatChunk::default()
    };
    Bytes::from(pgw_core::sse::encode_data(&serde_json::to_string(&c).unwrap()))
}

fn sse(frames: Vec<(Duration, Bytes)>) -> Script {
    Script {
        status: 200,
        headers: vec![("content-type", "text/event-stream".into())],
        head_after: Some(Duration::from_millis(100)),
        frames,
        hang_after_frames: false,
    }
}

fn json(status: u16, body: &str) -> Script {
    Script {
        status,
        headers: vec![("content-type", "application/json".into())],
        head_after: Some(Duration::from_millis(300)),
        frames: vec![(Duration::ZERO, Bytes::from(body.to_owned()))],
        hang_after_frames: false,
    }
}

fn stream_call() -> ChatCall {
    let mut req = ChatRequest::user("asked-model", "hello");
    req.stream = true;
    ChatCall::new(req)
}

fn plain_call() -> ChatCall {
    ChatCall::new(ChatRequest::user("asked-model", "hello"))
}

fn outcome(r: &Result<pgw_client::ChatAnswer, BoxError>) -> Outcome {
    AnswerClassifier.classify(r)
}

const ANSWER: &str = r#"{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi there"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#;

#[tokio::test(start_paused = true)]
async fn non_streaming_success_builds_the_request_and_records_stats() {
    let p = Provider::default();
    let answer = p
        .client(json(200, ANSWER), timeouts())
        .oneshot(plain_call())
        .await
        .unwrap();
    assert_eq!(answer.content(), "hi there");
    assert_eq!(answer.stats.usage.unwrap().total_tokens, 5);
    assert_eq!(answer.stats.latency, Duration::from_millis(300));
    assert_eq!(
        answer.stats.source.as_ref().map(pgw_core::SourceId::as_str),
        Some("s1")
    );
    assert!(!answer.stats.streamed && answer.chunks.is_empty());
    let seen = p.seen.lock().unwrap();
    let req = &seen[0];
    assert_eq!(req.method(), http::Method::POST);
    assert_eq!(req.uri(), "http://provider.test/v1/chat/completions");
    assert_eq!(req.headers()["authorization"], format!("Bearer {KEY}").as_str());
    assert!(req.headers()["authorization"].is_sensitive());
    let sent: serde_json::Value = serde_json::from_slice(req.body()).unwrap();
    assert_eq!(sent["model"], "override-model");
    assert_eq!(sent["messages"][0]["content"], "hello");
    assert!(sent.get("stream").is_none());
}

/// Azure OpenAI answers a bearer API key 401: its hosts get the key in `api-key`
/// (picked from the host, or set), and no `authorization` header goes with it.
#[tokio::test(start_paused = true)]
async fn azure_hosts_get_the_key_in_api_key() {
    let cases = [
        (
            SourceSettings::new("az", "https://r.openai.azure.com/openai/v1"),
            "api-key",
        ),
        (
            SourceSettings::new("gw", "http://gw.test/v1")
                .key_header(pgw_client::KeyHeader::parse("x-api-key").unwrap()),
            "x-api-key",
        ),
        (SourceSettings::new("oa", "http://api.test/v1"), "authorization"),
    ];
    for (settings, header) in cases {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        let svc = service_fn(move |req: http::Request<Bytes>| {
            log.lock().unwrap().push(req.headers().clone());
            async move {
                let body = http_body_util::Full::new(Bytes::from_static(ANSWER.as_bytes()))
                    .map_err(|never| match never {})
                    .boxed_unsync();
                Ok::<_, BoxError>(
                    http::Response::builder()
                        .header("content-type", "application/json")
                        .body(body)
                        .unwrap(),
                )
            }
        });
        let client = UpstreamClient::new(settings.key(SecretKey::new(KEY)), svc).unwrap();
        client.oneshot(plain_call()).await.unwrap();
        let headers = seen.lock().unwrap().pop().unwrap();
        let expected = if header == "authorization" {
            format!("Bearer {KEY}")
        } else {
            KEY.to_owned()
        };
        assert_eq!(headers[header], expected.as_str(), "{header}");
        assert!(headers[header].is_sensitive());
        if header != "authorization" {
            assert!(
                !headers.contains_key("authorization"),
                "{header}: the key goes once"
            );
        }
    }
}

/// A stream of more chunks than an answer keeps: none kept (a parsed chunk costs
/// 10-20 times its wire bytes), the text and usage folded whole; one at the bound keeps
/// every chunk.
#[tokio::test(start_paused = true)]
async fn a_very_long_stream_keeps_its_text_not_its_chunks() {
    for (n, kept) in [
        (pgw_client::MAX_KEPT_CHUNKS - 2, true),
        (pgw_client::MAX_KEPT_CHUNKS + 5, false),
    ] {
        let p = Provider::default();
        let mut frames: Vec<_> = (0..n).map(|_| (Duration::ZERO, chunk("x", false))).collect();
        frames.push((Duration::ZERO, chunk("!", true)));
        frames.push((Duration::ZERO, usage_chunk()));
        let answer = p
            .client(sse(frames), timeouts())
            .oneshot(stream_call())
            .await
            .unwrap();
        assert_eq!(answer.content().len(), n + 1, "{n}: the whole text");
        assert!(answer.content().ends_with("x!"));
        assert_eq!(answer.stats.usage.unwrap().total_tokens, 5);
        if kept {
            assert_eq!(answer.chunks.len(), n + 2, "{n}: every chunk kept");
        } else {
            assert!(answer.chunks.is_empty(), "{n}: none kept, not a truncated list");
        }
    }
    // Few chunks, each large (a provider batching tokens): the bytes bound them.
    let p = Provider::default();
    let big = "y".repeat(64 << 10);
    let n = pgw_client::MAX_KEPT_CHUNK_BYTES / big.len() + 2;
    let mut frames: Vec<_> = (0..n).map(|_| (Duration::ZERO, chunk(&big, false))).collect();
    frames.push((Duration::ZERO, chunk("!", true)));
    let answer = p
        .client(sse(frames), timeouts())
        .oneshot(stream_call())
        .await
        .unwrap();
    assert_eq!(answer.content().len(), n * big.len() + 1, "the whole text");
    assert!(answer.chunks.is_empty(), "{n} chunks of 64 KiB: none kept");
}

#[tokio::test(start_paused = true)]
async fn streaming_success_folds_chunks_and_measures_ttft() {
    let p = Provider::default();
    let script = sse(vec![
        (Duration::from_millis(400), chunk("hel", false)),
        (Duration::from_millis(500), chunk("lo", true)),
        (Duration::ZERO, usage_chunk()),
        (Duration::ZERO, Bytes::from_static(pgw_core::sse::DONE.as_bytes())),
    ]);
    let answer = p.client(script, timeouts()).oneshot(stream_call()).await.unwrap();
    assert_eq!(answer.content(), "hello");
    assert_eq!(answer.chunks.len(), 3);
    assert!(answer.stats.streamed);
    assert_eq!(answer.stats.ttft, Some(Duration::from_millis(500)));
    assert_eq!(answer.stats.latency, Duration::from_millis(1000));
    assert_eq!(answer.stats.usage.unwrap().completion_tokens, 2);
    let sent: serde_json::Value = serde_json::from_slice(p.seen.lock().unwrap()[0].body()).unwrap();
    assert_eq!(sent["stream"], true);
}

fn cut_of(r: &Result<pgw_client::ChatAnswer, BoxError>) -> Watchdog {
    r.as_ref()
        .unwrap_err()
        .downcast_ref::<WatchdogCut>()
        .expect("a watchdog cut")
        .watchdog()
}

#[tokio::test(start_paused = true)]
async fn first_token_watchdog_cuts_a_late_stream() {
    let p = Provider::default();
    let script = sse(vec![(Duration::from_secs(6), chunk("late", true))]);
    let started = Instant::now();
    let r = p.client(script, timeouts()).oneshot(stream_call()).await;
    assert_eq!(cut_of(&r), Watchdog::FirstToken);
    assert_eq!(started.elapsed(), Duration::from_secs(5));
    assert_eq!(outcome(&r), Outcome::Transient);
    assert!(
        p.dropped.load(Ordering::SeqCst),
        "the body is dropped (connection closed)"
    );
}

#[tokio::test(start_paused = true)]
async fn a_role_only_chunk_does_not_count_as_first_token() {
    let p = Provider::default();
    let role = ChatChunk {
        choices: vec![ChunkChoice {
            delta: Delta {
                role: Some("assistant".into()),
                ..Delta::default()
            },
            ..ChunkChoice::default()
        }],
        ..ChatChunk::default()
    };
    let role = Bytes::from(pgw_core::sse::encode_data(&serde_json::to_string(&role).unwrap()));
    let mut script = sse(vec![(Duration::ZERO, role)]);
    script.hang_after_frames = true;
    let r = p.client(script, timeouts()).oneshot(stream_call()).await;
    assert_eq!(cut_of(&r), Watchdog::FirstToken);
}

#[tokio::test(start_paused = true)]
async fn inter_token_stall_is_cut() {
    let p = Provider::default();
    let script = sse(vec![
        (Duration::from_millis(100), chunk("a", false)),
        (Duration::from_millis(1900), chunk("b", false)),
        (Duration::from_millis(2100), chunk("c", true)),
    ]);
    let started = Instant::now();
    let r = p.client(script, timeouts()).oneshot(stream_call()).await;
    assert_eq!(cut_of(&r), Watchdog::InterToken);
    assert_eq!(started.elapsed(), Duration::from_millis(200 + 1900 + 2000));
    assert_eq!(outcome(&r), Outcome::Transient);
}

/// Empty deltas a stalled provider keeps sending (`{}`, a role-only or `""` delta)
/// are no output: the inter-token cut comes `inter_token` after the last text, not at
/// `total`.
#[tokio::test(start_paused = true)]
async fn keep_alive_chunks_do_not_push_the_inter_token_cut_on() {
    let p = Provider::default();
    let role =
        Bytes::from_static(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n");
    let empty = Bytes::from_static(b"data: {}\n\n");
    let mut frames = vec![(Duration::from_millis(100), chunk("a", false))];
    // A keep-alive every 700 ms for seven seconds, then the rest: the cut comes first.
    for i in 0..10 {
        let beat = match i % 3 {
            0 => role.clone(),
            1 => empty.clone(),
            _ => chunk("", false),
        };
        frames.push((Duration::from_millis(700), beat));
    }
    frames.push((Duration::ZERO, chunk("b", true)));
    let started = Instant::now();
    let r = p.client(sse(frames), timeouts()).oneshot(stream_call()).await;
    assert_eq!(cut_of(&r), Watchdog::InterToken);
    // Head at 100 ms, "a" at 200 ms, cut 2 s (inter_token) later.
    assert_eq!(started.elapsed(), Duration::from_millis(200 + 2000));
}

#[tokio::test(start_paused = true)]
async fn black_hole_is_cut_by_first_token_or_total() {
    let p = Provider::default();
    let hole = Script {
        head_after: None,
        ..Script::default()
    };
    let r = p.client(hole.clone(), timeouts()).oneshot(stream_call()).await;
    assert_eq!(cut_of(&r), Watchdog::FirstToken);
    let started = Instant::now();
    let r = p.client(hole, timeouts()).oneshot(plain_call()).await;
    assert_eq!(cut_of(&r), Watchdog::Total);
    assert_eq!(started.elapsed(), Duration::from_secs(60));
}

#[tokio::test(start_paused = true)]
async fn total_watchdog_caps_a_steady_trickle() {
    let p = Provider::default();
    let frames = (0..100)
        .map(|_| (Duration::from_secs(1), chunk("x", false)))
        .collect();
    let t = Timeouts {
        total: Duration::from_secs(10),
        ..timeouts()
    };
    let started = Instant::now();
    let r = p.client(sse(frames), t).oneshot(stream_call()).await;
    assert_eq!(cut_of(&r), Watchdog::Total);
    assert_eq!(started.elapsed(), Duration::from_secs(10));
}

/// An overloaded provider that says when to come back (Anthropic's 529, a 503) is
/// pushback, held like a 429; without `Retry-After` it stays a failure.
#[tokio::test(start_paused = true)]
async fn an_overloaded_answer_with_retry_after_is_pushback() {
    let p = Provider::default();
    let body = r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
    for status in [503, 529] {
        let mut s = json(status, body);
        s.headers.push(("retry-after", "12".into()));
        let r = p.client(s, timeouts()).oneshot(plain_call()).await;
        assert_eq!(
            outcome(&r),
            Outcome::RateLimited {
                retry_after: Some(Duration::from_secs(12))
            },
            "{status}"
        );
        let r = p
            .client(json(status, body), timeouts())
            .oneshot(plain_call())
            .await;
        assert_eq!(outcome(&r), Outcome::Transient, "{status} without retry-after");
    }
}

#[tokio::test(start_paused = true)]
async fn non_2xx_carries_status_retry_after_and_scrubbed_message() {
    let p = Provider::default();
    let mut s = json(429, r#"{"error":{"message":"slow down","type":"rate_limit"}}"#);
    s.headers.push(("retry-after", "7".into()));
    let r = p.client(s, timeouts()).oneshot(plain_call()).await;
    let e = r.as_ref().unwrap_err().downcast_ref::<UpstreamStatus>().unwrap();
    assert_eq!(e.status(), 429);
    assert_eq!(e.message(), "slow down");
    assert_eq!(
        outcome(&r),
        Outcome::RateLimited {
            retry_after: Some(Duration::from_secs(7))
        }
    );

    let s = json(
        401,
        &format!(r#"{{"error":{{"message":"Incorrect API key provided: {KEY}"}}}}"#),
    );
    let r = p.client(s, timeouts()).oneshot(stream_call()).await;
    assert_eq!(outcome(&r), Outcome::SourceDead);
    let text = format!("{} {:?}", r.as_ref().unwrap_err(), r.as_ref().unwrap_err());
    assert!(!text.contains(KEY), "{text}");
    assert!(text.contains("Incorrect API key provided: ***"), "{text}");

    let r = p
        .client(json(400, "plain text refusal"), timeouts())
        .oneshot(plain_call())
        .await;
    assert_eq!(outcome(&r), Outcome::Rejected);
    assert!(r.unwrap_err().to_string().contains("plain text refusal"));
}

/// OpenAI sends no `Retry-After` on most 429s: the wait it names in its message, else
/// the one its `x-ratelimit-*` headers imply, is the 429's hint; `Retry-After` wins.
#[tokio::test(start_paused = true)]
async fn a_429_without_retry_after_waits_what_the_message_or_headers_say() {
    let p = Provider::default();
    let pushback = |r: &Result<pgw_client::ChatAnswer, BoxError>| match outcome(r) {
        Outcome::RateLimited { retry_after } => retry_after,
        other => panic!("not pushback: {other:?}"),
    };
    let openai = r#"{"error":{"message":"Rate limit reached for gpt-4o in organization org-1 on tokens per min (TPM): Limit 30000, Used 29000, Requested 3000. Please try again in 4.5s. Visit https://platform.openai.com/account/rate-limits to learn more.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;
    let headers = [
        ("x-ratelimit-limit-requests", "10"),
        ("x-ratelimit-remaining-requests", "0"),
        ("x-ratelimit-reset-requests", "20s"),
    ];

    // The message names the wait.
    let r = p
        .client(json(429, openai), timeouts())
        .oneshot(plain_call())
        .await;
    assert_eq!(pushback(&r), Some(Duration::from_millis(4500)));

    // No wait in the message: the headers' (one request of ten refills in 2 s).
    let mut s = json(429, r#"{"error":{"message":"slow down","type":"requests"}}"#);
    s.headers.extend(headers.map(|(k, v)| (k, v.to_owned())));
    let r = p.client(s, timeouts()).oneshot(plain_call()).await;
    assert_eq!(pushback(&r), Some(Duration::from_secs(2)));

    // Retry-After wins over both.
    let mut s = json(429, openai);
    s.headers.extend(headers.map(|(k, v)| (k, v.to_owned())));
    s.headers.push(("retry-after", "7".into()));
    let r = p.client(s, timeouts()).oneshot(plain_call()).await;
    assert_eq!(pushback(&r), Some(Duration::from_secs(7)));

    // Neither: no hint (the retry layer's backoff applies).
    let r = p
        .client(json(429, r#"{"error":{"message":"slow down"}}"#), timeouts())
        .oneshot(plain_call())
        .await;
    assert_eq!(pushback(&r), None);

    // Only a 429's message is read so: a 400 naming a wait is still the request's.
    let r = p
        .client(
            json(400, r#"{"error":{"message":"bad. try again in 4s"}}"#),
            timeouts(),
        )
        .oneshot(plain_call())
        .await;
    let e = r.as_ref().unwrap_err().downcast_ref::<UpstreamStatus>().unwrap();
    assert_eq!(e.retry_after(), None);
}

#[tokio::test(start_paused = true)]
async fn empty_completion_is_an_error() {
    let p = Provider::default();
    let empty = ANSWER.replace("hi there", " ");
    let r = p
        .client(json(200, &empty), timeouts())
        .oneshot(plain_call())
        .await;
    assert!(r.as_ref().unwrap_err().is::<EmptyCompletion>());
    assert_eq!(outcome(&r), Outcome::Transient);
    let script = sse(vec![
        (Duration::ZERO, chunk("", true)),
        (Duration::ZERO, Bytes::from_static(pgw_core::sse::DONE.as_bytes())),
    ]);
    let r = p.client(script, timeouts()).oneshot(stream_call()).await;
    assert!(r.unwrap_err().is::<EmptyCompletion>());
}

#[tokio::test(start_paused = true)]
async fn garbage_is_a_clear_transient_error() {
    let p = Provider::default();
    let cases = [
        (
            json(200, "<html>gateway</html>"),
            plain_call(),
            "not a chat completion",
        ),
        (
            sse(vec![(Duration::ZERO, Bytes::from_static(b"data: {nope\n\n"))]),
            stream_call(),
            "no stream event was a chat completion chunk",
        ),
        (
            sse(vec![(Duration::ZERO, chunk("a", false))]),
            stream_call(),
            "before a finish_reason",
        ),
        (
            sse(vec![
                (Duration::ZERO, chunk("a", false)),
                (Duration::ZERO, Bytes::from_static(pgw_core::sse::DONE.as_bytes())),
            ]),
            stream_call(),
            "([DONE]) before a finish_reason",
        ),
    ];
    for (script, call, want) in cases {
        let r = p.client(script, timeouts()).oneshot(call).await;
        let err = r.as_ref().unwrap_err();
        assert!(err.is::<MalformedResponse>(), "{err}");
        assert!(err.to_string().contains(want), "{err} should mention {want}");
        assert_eq!(outcome(&r), Outcome::Transient);
    }
}

#[tokio::test(start_paused = true)]
async fn a_json_answer_to_a_stream_request_is_accepted() {
    let p = Provider::default();
    let answer = p
        .client(json(200, ANSWER), timeouts())
        .oneshot(stream_call())
        .await
        .unwrap();
    assert_eq!(answer.content(), "hi there");
    assert!(!answer.stats.streamed);
}

#[tokio::test(start_paused = true)]
async fn dropping_the_attempt_drops_the_connection() {
    let p = Provider::default();
    let mut script = sse(vec![(Duration::ZERO, chunk("a", false))]);
    script.hang_after_frames = true;
    let client = p.client(script, timeouts());
    let fut = client.oneshot(stream_call());
    let r = tokio::time::timeout(Duration::from_secs(1), fut).await;
    assert!(r.is_err(), "still streaming");
    assert!(p.dropped.load(Ordering::SeqCst));
}

#[tokio::test(start_paused = true)]
async fn open_stream_yields_chunks_as_they_arrive() {
    let p = Provider::default();
    let script = sse(vec![
        (Duration::from_millis(100), chunk("a", false)),
        (Duration::from_millis(3000), chunk("b", true)),
    ]);
    let client = p.client(script, timeouts());
    let started = Instant::now();
    let mut s = client.open_stream(&plain_call()).await.unwrap();
    let first = s.next().await.unwrap().unwrap();
    assert_eq!(first.choices[0].delta.content.as_deref(), Some("a"));
    assert_eq!(started.elapsed(), Duration::from_millis(200));
    assert_eq!(s.ttft(), Some(Duration::from_millis(200)));
    let second = s.next().await.unwrap().unwrap_err();
    assert_eq!(
        second.downcast_ref::<WatchdogCut>().unwrap().watchdog(),
        Watchdog::InterToken
    );
    assert!(s.next().await.is_none());
}

#[test]
fn nothing_prints_the_key() {
    let p = Provider::default();
    let client = p.client(json(200, ANSWER), timeouts());
    let dbg = format!("{client:?} {:?}", client.settings());
    assert!(!dbg.contains(KEY), "{dbg}");
    assert!(dbg.contains("***"));
    let bad = SourceSettings::new("s9", "http://x").key(SecretKey::new("bad\nkey"));
    let err = UpstreamClient::new(
        bad,
        tower::service_fn(|_: http::Request<Bytes>| async {
            Ok::<http::Response<Body>, BoxError>(http::Response::new(Body::default()))
        }),
    )
    .unwrap_err();
    assert_eq!(err.field(), "key");
    assert!(!err.to_string().contains("bad\nkey"));
}

#[tokio::test(start_paused = true)]
async fn huge_timeouts_mean_never_and_do_not_overflow_the_clock() {
    // `Instant + Duration::MAX` panics; the watchdogs saturate instead.
    let t = Timeouts {
        connect: Duration::MAX,
        first_token: Duration::MAX,
        inter_token: Duration::MAX,
        total: Duration::MAX,
    };
    let p = Provider::default();
    let script = sse(vec![
        (Duration::from_millis(400), chunk("hel", false)),
        (Duration::from_millis(500), chunk("lo", true)),
        (Duration::ZERO, Bytes::from_static(pgw_core::sse::DONE.as_bytes())),
    ]);
    let answer = p.client(script, t).oneshot(stream_call()).await.unwrap();
    assert_eq!(answer.content(), "hello");
    let answer = p
        .client(json(200, ANSWER), t)
        .oneshot(plain_call())
        .await
        .unwrap();
    assert_eq!(answer.content(), "hi there");
    let err = p
        .client(json(503, "{}"), t)
        .oneshot(plain_call())
        .await
        .unwrap_err();
    assert!(err.is::<pgw_core::UpstreamStatus>(), "{err}");
}

/// An agent's answer is often a tool call and no text: its fragments are output for
/// the watchdogs, and the folded answer carries the whole call.
#[tokio::test(start_paused = true)]
async fn a_tool_call_stream_is_output_for_the_watchdogs() {
    let p = Provider::default();
    let frame = |json: &str| Bytes::from(pgw_core::sse::encode_data(json));
    let step = Duration::from_millis(1500); // under inter_token (2 s); the whole stream outlasts first_token (5 s)
    let script = sse(vec![
        (
            Duration::from_secs(1),
            frame(
                r#"{"choices":[{"index":0,"delta":{"role":"assistant","tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"lookup","arguments":""}}]}}]}"#,
            ),
        ),
        (
            step,
            frame(
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"q\":"}}]}}]}"#,
            ),
        ),
        (
            step,
            frame(
                r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"1}"}}]}}]}"#,
            ),
        ),
        (
            step,
            frame(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#),
        ),
        (
            step,
            frame(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#),
        ),
        (Duration::ZERO, Bytes::from_static(pgw_core::sse::DONE.as_bytes())),
    ]);
    let answer = p.client(script, timeouts()).oneshot(stream_call()).await.unwrap();
    assert_eq!(answer.stats.ttft, Some(Duration::from_millis(1100)));
    let call = &answer.response.choices[0].message.extra["tool_calls"][0];
    assert_eq!(call["function"]["name"], "lookup");
    assert_eq!(call["function"]["arguments"], r#"{"q":1}"#);
    assert_eq!(outcome(&Ok(answer)), Outcome::Success);
}

#[tokio::test(start_paused = true)]
async fn the_providers_error_code_decides_and_reaches_the_caller() {
    let p = Provider::default();
    let rows: [(u16, String, Outcome, Option<&str>); 4] = [
        (
            404,
            r#"{"error":{"message":"The model `gpt-4o-mimi` does not exist or you do not have access to it.","type":"invalid_request_error","param":null,"code":"model_not_found"}}"#.into(),
            Outcome::Rejected,
            Some("model_not_found"),
        ),
        (
            429,
            r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#.into(),
            Outcome::SourceDead,
            Some("insufficient_quota"),
        ),
        (
            529,
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#.into(),
            Outcome::Transient,
            None,
        ),
        (
            400,
            format!(r#"{{"error":{{"message":"key {KEY}: This model's maximum context length is 8192 tokens.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}}}"#),
            Outcome::Rejected,
            Some("context_length_exceeded"),
        ),
    ];
    for (status, body, want, code) in rows {
        let r = p
            .client_for(json(status, &body), timeouts(), None)
            .oneshot(plain_call())
            .await;
        assert_eq!(outcome(&r), want, "{status} {body}");
        // With the source's model override, an unknown model is the source's fault.
        let theirs = p
            .client(json(status, &body), timeouts())
            .oneshot(plain_call())
            .await;
        let want_theirs = if code == Some("model_not_found") {
            Outcome::SourceDead
        } else {
            want
        };
        assert_eq!(outcome(&theirs), want_theirs, "override: {status} {body}");
        let e = r.as_ref().unwrap_err().downcast_ref::<UpstreamStatus>().unwrap();
        assert_eq!(e.code(), code);
        let provider = e.provider().expect("the body was a JSON error");
        assert!(!provider.message.contains(KEY), "{provider:?}");
        if status == 400 {
            assert_eq!(provider.param.as_deref(), Some("messages"));
            assert_eq!(provider.kind.as_deref(), Some("invalid_request_error"));
            assert!(
                provider
                    .message
                    .starts_with("key ***: This model's maximum context length")
            );
        }
        if status == 529 {
            assert_eq!(provider.kind.as_deref(), Some("overloaded_error"));
        }
    }
}

#[tokio::test(start_paused = true)]
async fn declines_are_answers_handed_up_as_is() {
    let p = Provider::default();
    let filtered = r#"{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null},"finish_reason":"content_filter"}],"usage":{"prompt_tokens":3,"completion_tokens":0,"total_tokens":3}}"#;
    let refused = r#"{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,"refusal":"I'm sorry, but I can't help with that."},"finish_reason":"stop"}]}"#;
    for body in [filtered, refused] {
        let r = p.client(json(200, body), timeouts()).oneshot(plain_call()).await;
        assert_eq!(outcome(&r), Outcome::Success, "{body}");
        let answer = r.unwrap();
        assert!(answer.response.choices[0].message.content.is_null());
        let back = serde_json::to_value(&answer.response).unwrap();
        let want: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(back["choices"], want["choices"]);
    }
    // Streamed: a role chunk, refusal pieces, the finish chunk.
    let frame = |json: &str| Bytes::from(pgw_core::sse::encode_data(json));
    let script = sse(vec![
        (
            Duration::ZERO,
            frame(r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null}}]}"#),
        ),
        (
            Duration::from_millis(10),
            frame(r#"{"choices":[{"index":0,"delta":{"refusal":"I'm sorry, "}}]}"#),
        ),
        (
            Duration::from_millis(10),
            frame(r#"{"choices":[{"index":0,"delta":{"refusal":"no."}}]}"#),
        ),
        (
            Duration::ZERO,
            frame(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#),
        ),
        (Duration::ZERO, Bytes::from_static(pgw_core::sse::DONE.as_bytes())),
    ]);
    let r = p.client(script, timeouts()).oneshot(stream_call()).await;
    assert_eq!(outcome(&r), Outcome::Success);
    let answer = r.unwrap();
    assert_eq!(
        answer.response.choices[0].message.refusal(),
        Some("I'm sorry, no.")
    );
    assert!(answer.response.choices[0].message.content.is_null());
    assert_eq!(
        answer.stats.ttft,
        Some(Duration::from_millis(110)),
        "a refusal piece is a token"
    );
    let script = sse(vec![
        (
            Duration::ZERO,
            frame(r#"{"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#),
        ),
        (
            Duration::ZERO,
            frame(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"content_filter"}]}"#),
        ),
        (Duration::ZERO, Bytes::from_static(pgw_core::sse::DONE.as_bytes())),
    ]);
    let r = p.client(script, timeouts()).oneshot(stream_call()).await;
    assert_eq!(outcome(&r), Outcome::Success);
    assert!(r.unwrap().response.is_declined());
}

#[tokio::test(start_paused = true)]
async fn every_field_survives_both_ways() {
    let p = Provider::default();
    let answer = r#"{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi","refusal":null},"logprobs":{"content":[{"bytes":[104,105],"logprob":-0.5,"token":"hi","top_logprobs":[]}]},"finish_reason":"stop"}],"usage":{"completion_tokens":1,"completion_tokens_details":{"reasoning_tokens":7},"prompt_tokens":3,"total_tokens":4},"service_tier":"default","system_fingerprint":"fp_1"}"#;
    let request = r#"{"model":"asked-model","messages":[{"role":"user","content":[{"type":"text","text":"what is it?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA","detail":"low"}}]},{"role":"assistant","content":null,"refusal":null}],"logprobs":true}"#;
    let req: ChatRequest = serde_json::from_str(request).unwrap();
    let got = p
        .client(json(200, answer), timeouts())
        .oneshot(ChatCall::new(req))
        .await
        .unwrap();
    let back = serde_json::to_value(&got.response).unwrap();
    assert_eq!(back, serde_json::from_str::<serde_json::Value>(answer).unwrap());
    let sent = String::from_utf8(p.seen.lock().unwrap()[0].body().to_vec()).unwrap();
    // The parts reach the upstream byte for byte; the model is the source's override.
    assert_eq!(
        sent,
        request.replace("asked-model", "override-model"),
        "content parts and null content unchanged"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stream_complete_without_done_is_an_answer_and_a_bad_chunk_among_good_ones_is_skipped() {
    let p = Provider::default();
    // No `[DONE]`: the body ends after the finish reason.
    let script = sse(vec![
        (Duration::ZERO, chunk("hel", false)),
        (Duration::ZERO, Bytes::from_static(b"data: {not json\n\n")),
        (Duration::ZERO, chunk("lo", true)),
    ]);
    let answer = p.client(script, timeouts()).oneshot(stream_call()).await.unwrap();
    assert_eq!(answer.content(), "hello");
    assert_eq!(answer.chunks.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_passed_through_stream_is_answered_at_its_first_output_and_judged_at_its_end() {
    use std::sync::Mutex;
    let p = Provider::default();
    let script = sse(vec![
        (Duration::from_millis(50), chunk("one ", false)),
        (Duration::from_secs(2), chunk("two", false)),
        (Duration::from_secs(2), chunk("", true)),
        (Duration::ZERO, usage_chunk()),
    ]);
    let mut call = stream_call();
    call.extensions_mut().insert(pgw_client::PassThrough);
    let start = tokio::time::Instant::now();
    let mut result = p.client(script, timeouts()).oneshot(call).await;
    // Committed by the first chunk: head after 100 ms, first chunk 50 ms later.
    assert_eq!(start.elapsed(), Duration::from_millis(150));
    let ended: Arc<Mutex<Option<Result<String, String>>>> = Arc::default();
    let seen = Arc::clone(&ended);
    assert!(AnswerClassifier.in_progress(&result));
    AnswerClassifier.defer(
        &mut result,
        Box::new(move |end| {
            *seen.lock().unwrap() = Some(
                end.as_ref()
                    .map(|a| a.content().to_owned())
                    .map_err(ToString::to_string),
            );
        }),
    );
    let answer = result.unwrap();
    assert_eq!(answer.content(), "one ");
    let mut tail = answer.tail.as_ref().unwrap().take().unwrap();
    assert!(answer.tail.as_ref().unwrap().take().is_none(), "one consumer");
    let mut rest = String::new();
    while let Some(c) = tail.next().await {
        rest.push_str(
            c.unwrap()
                .choices
                .first()
                .and_then(|c| c.delta.content.as_deref())
                .unwrap_or(""),
        );
        assert!(ended.lock().unwrap().is_none(), "judged only at the end");
    }
    assert_eq!(rest, "two");
    assert_eq!(start.elapsed(), Duration::from_millis(4150));
    assert_eq!(ended.lock().unwrap().clone(), Some(Ok("one two".to_owned())));
}

/// A consumer that reads a passed-through stream slowly (a caller on a slow link: the
/// body is not read while it is away) is not taken for a stalled source: the
/// inter-token silence is counted from when it comes back. It was cut as the source's
/// failure, the healthy source's breaker and health paying for a slow reader.
#[tokio::test(start_paused = true)]
async fn a_slow_consumer_of_a_passed_through_stream_is_no_stall() {
    let p = Provider::default();
    let script = sse(vec![
        (Duration::from_millis(50), chunk("one ", false)),
        (Duration::from_millis(500), chunk("two", false)),
        (Duration::from_millis(500), chunk("", true)),
        (Duration::ZERO, usage_chunk()),
    ]);
    let mut call = stream_call();
    call.extensions_mut().insert(pgw_client::PassThrough);
    let answer = p.client(script, timeouts()).oneshot(call).await.unwrap();
    let mut tail = answer.tail.as_ref().unwrap().take().unwrap();
    // Away for 2.5 inter-token limits before reading on.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut rest = String::new();
    while let Some(c) = tail.next().await {
        let c = c.unwrap();
        rest.push_str(
            c.choices
                .first()
                .and_then(|c| c.delta.content.as_deref())
                .unwrap_or(""),
        );
    }
    assert_eq!(rest, "two");

    // A source silent past the limit while the consumer waits is still cut.
    let script = sse(vec![
        (Duration::from_millis(50), chunk("one ", false)),
        (Duration::from_secs(3), chunk("two", false)),
    ]);
    let mut call = stream_call();
    call.extensions_mut().insert(pgw_client::PassThrough);
    let answer = p.client(script, timeouts()).oneshot(call).await.unwrap();
    let mut tail = answer.tail.as_ref().unwrap().take().unwrap();
    let err = tail.next().await.unwrap().unwrap_err();
    assert!(err.to_string().contains("inter"), "{err}");
}

#[tokio::test(start_paused = true)]
async fn a_pass_through_error_event_before_the_first_output_fails_the_attempt() {
    let p = Provider::default();
    let script = sse(vec![(
        Duration::ZERO,
        Bytes::from_static(b"data: {\"error\":{\"message\":\"overloaded\"}}\n\n"),
    )]);
    let mut call = stream_call();
    call.extensions_mut().insert(pgw_client::PassThrough);
    let r = p.client(script, timeouts()).oneshot(call).await;
    assert!(r.unwrap_err().to_string().contains("overloaded"));
}

/// A provider's error inside an answer that otherwise looks whole is never an answer:
/// OpenRouter's mid-stream error comes as a chunk with choices and `finish_reason:
/// "error"`, and a 2xx JSON body may be an error with its own code (which still
/// decides: a context window moves the call on, an unknown one is transient).
#[tokio::test(start_paused = true)]
async fn a_providers_error_inside_a_whole_looking_answer_is_an_error() {
    let p = Provider::default();
    let openrouter = Bytes::from_static(
        b"data: {\"id\":\"c1\",\"error\":{\"code\":502,\"message\":\"Provider disconnected\"},\"choices\":[{\"index\":0,\"delta\":{\"content\":\"\"},\"finish_reason\":\"error\"}]}\n\n",
    );
    let script = sse(vec![
        (Duration::ZERO, chunk("hel", false)),
        (Duration::ZERO, openrouter),
        (Duration::ZERO, Bytes::from_static(pgw_core::sse::DONE.as_bytes())),
    ]);
    let r = p.client(script, timeouts()).oneshot(stream_call()).await;
    let err = r.as_ref().unwrap_err();
    // The provider's error, its numeric code the status.
    let status = err.downcast_ref::<UpstreamStatus>().expect("an upstream status");
    assert_eq!(status.status(), 502);
    assert!(err.to_string().contains("Provider disconnected"), "{err}");
    assert_eq!(outcome(&r), Outcome::Transient);

    // `finish_reason: "error"` alone, streamed and not.
    let cut = Bytes::from_static(
        b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"error\"}]}\n\n",
    );
    let script = sse(vec![(Duration::ZERO, chunk("hel", false)), (Duration::ZERO, cut)]);
    let r = p.client(script, timeouts()).oneshot(stream_call()).await;
    assert!(r.as_ref().unwrap_err().is::<MalformedResponse>());
    let r = p
        .client(json(200, &ANSWER.replace("\"stop\"", "\"error\"")), timeouts())
        .oneshot(plain_call())
        .await;
    assert!(r.as_ref().unwrap_err().is::<MalformedResponse>());
    assert_eq!(outcome(&r), Outcome::Transient);

    // A 2xx JSON error: its code decides, its message reaches the caller scrubbed.
    let body = format!(
        r#"{{"error":{{"message":"too long for key {KEY}","type":"invalid_request_error","code":"context_length_exceeded"}}}}"#
    );
    let r = p.client(json(200, &body), timeouts()).oneshot(plain_call()).await;
    let err = r.as_ref().unwrap_err();
    let status = err
        .downcast_ref::<UpstreamStatus>()
        .expect("the provider's error");
    assert_eq!(status.code(), Some("context_length_exceeded"));
    assert!(pgw_core::exceeds_source(&**err));
    assert_eq!(outcome(&r), Outcome::Rejected);
    assert!(!format!("{err} {err:?}").contains(KEY));
    let r = p
        .client(json(200, r#"{"error":{"message":"quota gone"}}"#), timeouts())
        .oneshot(plain_call())
        .await;
    assert!(r.as_ref().unwrap_err().to_string().contains("quota gone"));
    assert_eq!(outcome(&r), Outcome::Transient);
}

/// A chunk with a `null` where a field has a default keeps its text; a chunk with
/// choices this crate cannot read fails the attempt instead of losing its text.
#[tokio::test(start_paused = true)]
async fn a_chunk_with_nulls_keeps_its_text_and_an_unreadable_one_fails() {
    let p = Provider::default();
    let nulls = Bytes::from_static(
        b"data: {\"id\":null,\"object\":null,\"created\":null,\"model\":null,\"choices\":[{\"index\":null,\"delta\":{\"content\":\"b\"}}]}\n\n",
    );
    let float = Bytes::from_static(
        b"data: {\"created\":1.7e9,\"choices\":[{\"index\":0,\"delta\":{\"content\":\"c\"}}]}\n\n",
    );
    let script = sse(vec![
        (Duration::ZERO, chunk("a", false)),
        (Duration::ZERO, nulls),
        (Duration::ZERO, float),
        (Duration::ZERO, chunk("d", true)),
    ]);
    let answer = p.client(script, timeouts()).oneshot(stream_call()).await.unwrap();
    assert_eq!(answer.content(), "abcd");

    let unreadable = Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":7}}]}\n\n");
    let script = sse(vec![
        (Duration::ZERO, chunk("a", false)),
        (Duration::ZERO, unreadable),
        (Duration::ZERO, chunk("d", true)),
    ]);
    let r = p.client(script, timeouts()).oneshot(stream_call()).await;
    let err = r.as_ref().unwrap_err();
    assert!(err.to_string().contains("unreadable stream chunk"), "{err}");

    // Broken JSON that names choices (a raw tab in the text is a syntax error) fails
    // too: skipped, "b" would be missing from an answer ending "a" + "d".
    let broken =
        Bytes::from_static(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"b\tc\"}}]}\n\n");
    let script = sse(vec![
        (Duration::ZERO, chunk("a", false)),
        (Duration::ZERO, broken),
        (Duration::ZERO, chunk("d", true)),
    ]);
    let r = p.client(script, timeouts()).oneshot(stream_call()).await;
    let err = r.as_ref().unwrap_err();
    assert!(err.to_string().contains("unreadable stream chunk"), "{err}");
    assert!(err.is::<MalformedResponse>(), "{err}");
}

/// An error body past the 64 KiB read for it (a validation error echoing the whole
/// input) is classified on what was read: its first bytes name the context window, so
/// the call may move to a source with a larger one. Before, the whole body was dropped
/// and the 400 was a plain `Rejected`.
#[tokio::test(start_paused = true)]
async fn an_oversized_error_body_is_classified_on_its_first_bytes() {
    let p = Provider::default();
    let body = format!(
        r#"{{"error":{{"message":"This model's maximum context length is 8192 tokens. However, your messages resulted in 90000 tokens.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded","input":"{}"}}}}"#,
        "x".repeat(100 << 10)
    );
    let r = p.client(json(400, &body), timeouts()).oneshot(plain_call()).await;
    let err = r.as_ref().unwrap_err();
    assert_eq!(outcome(&r), Outcome::Rejected);
    assert!(pgw_core::exceeds_source(&**err), "{err}");
}

/// An `event: error` whose data is not JSON (`data: Overloaded`) is the provider's
/// error with its message, not a chunk that failed to parse and was skipped (the
/// stream then ended as a plain cut, the message lost).
#[tokio::test(start_paused = true)]
async fn an_error_event_with_plain_text_is_the_providers_error() {
    let p = Provider::default();
    let script = sse(vec![
        (Duration::ZERO, chunk("a", false)),
        (
            Duration::ZERO,
            Bytes::from_static(b"event: error\ndata: Overloaded\n\n"),
        ),
        (Duration::ZERO, chunk("b", true)),
    ]);
    let r = p.client(script, timeouts()).oneshot(stream_call()).await;
    let err = r.as_ref().unwrap_err();
    let status = err
        .downcast_ref::<UpstreamStatus>()
        .expect("the provider's error");
    assert!(status.message().contains("Overloaded"), "{err}");
    assert_eq!(outcome(&r), Outcome::Transient);
}

/// A key the provider echoes across the message's cut is scrubbed before the cut, so
/// not even its first bytes reach the caller.
#[tokio::test(start_paused = true)]
async fn a_key_echoed_across_the_cut_is_scrubbed_whole() {
    let p = Provider::default();
    for pad in [470, 500, 505] {
        let message = format!("{}{KEY}", "x".repeat(pad));
        let body = format!(r#"{{"error":{{"message":"{message}"}}}}"#);
        let r = p.client(json(401, &body), timeouts()).oneshot(plain_call()).await;
        let err = r.unwrap_err();
        let text = format!("{err} {err:?}");
        assert!(!text.contains(&KEY[..KEY.len() / 2]), "pad {pad}: {text}");
        // The same for a body that is not a JSON error.
        let r = p
            .client(json(401, &message), timeouts())
            .oneshot(plain_call())
            .await;
        let err = r.unwrap_err();
        assert!(
            !format!("{err} {err:?}").contains(&KEY[..KEY.len() / 2]),
            "pad {pad}"
        );
    }
}

/// A key echoed mid-stream (an error event, a chunk whose fields cannot be read, a 2xx
/// body that is not an answer) never reaches the caller's error: streams scrub as
/// error statuses do.
#[tokio::test(start_paused = true)]
async fn a_key_echoed_mid_stream_is_scrubbed() {
    let p = Provider::default();
    let half = &KEY[..KEY.len() / 2];
    let events = [
        format!("data: {{\"error\":{{\"message\":\"bad key {KEY}\"}}}}\n\n"),
        format!("data: {{\"id\":\"x\",\"choices\":[{{\"index\":\"{KEY}\",\"delta\":{{}}}}]}}\n\n"),
    ];
    for event in events {
        let script = sse(vec![
            (Duration::ZERO, chunk("hi", false)),
            (Duration::ZERO, Bytes::from(event.clone())),
        ]);
        let r = p.client(script, timeouts()).oneshot(stream_call()).await;
        let err = r.unwrap_err();
        let text = format!("{err} {err:?}");
        assert!(text.contains("***"), "{event}: {text}");
        assert!(!text.contains(half), "{event}: {text}");
    }
    let r = p
        .client(json(200, &format!("not an answer {KEY}")), timeouts())
        .oneshot(plain_call())
        .await;
    let err = r.unwrap_err();
    let text = format!("{err} {err:?}");
    assert!(
        text.contains("not a chat completion") && !text.contains(half),
        "{text}"
    );
}

/// A provider's error inside a 2xx answer is classified by its code, as an error
/// answer is: a rate limit in a stream's first event is pushback (it was a transient
/// failure, spending an attempt and counting against the breaker), a context window is
/// the request's, and a numeric `code` (OpenRouter writes the HTTP status there) is the
/// status.
#[tokio::test(start_paused = true)]
async fn a_providers_error_in_a_2xx_answer_is_classified_by_its_code() {
    let p = Provider::default();
    let event = |body: &str| sse(vec![(Duration::ZERO, Bytes::from(format!("data: {body}\n\n")))]);
    let r = p
        .client(
            event(r#"{"error":{"message":"Rate limit reached for gpt-4o on requests per min (RPM). Please try again in 1.5s.","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#),
            timeouts(),
        )
        .oneshot(stream_call())
        .await;
    assert_eq!(
        outcome(&r),
        Outcome::RateLimited {
            retry_after: Some(Duration::from_millis(1500))
        },
        "the wait the message names: {r:?}"
    );
    assert!(r.unwrap_err().to_string().contains("mid-stream"));
    let r = p
        .client(
            event(r#"{"error":{"message":"This model's maximum context length is 8192 tokens.","type":"invalid_request_error","code":"context_length_exceeded"}}"#),
            timeouts(),
        )
        .oneshot(stream_call())
        .await;
    assert_eq!(outcome(&r), Outcome::Rejected, "{r:?}");
    let r = p
        .client(
            json(
                200,
                r#"{"error":{"code":429,"message":"Rate limit exceeded: free-models-per-min"}}"#,
            ),
            timeouts(),
        )
        .oneshot(plain_call())
        .await;
    assert!(matches!(outcome(&r), Outcome::RateLimited { .. }), "{r:?}");
    // An unknown error event is still a transient failure of the attempt.
    let r = p
        .client(event(r#"{"error":{"message":"boom"}}"#), timeouts())
        .oneshot(stream_call())
        .await;
    assert_eq!(outcome(&r), Outcome::Transient, "{r:?}");
}

/// A stream whose answer is whole (a finish reason came) and that then stalls or
/// breaks before `[DONE]` is the answer, not a cut: a continuation would answer twice.
#[tokio::test(start_paused = true)]
async fn a_stream_that_breaks_after_its_finish_reason_is_the_answer() {
    let p = Provider::default();
    let mut script = sse(vec![
        (Duration::ZERO, chunk("hi", false)),
        (Duration::ZERO, chunk("!", true)),
    ]);
    script.hang_after_frames = true;
    let answer = p.client(script, timeouts()).oneshot(stream_call()).await.unwrap();
    assert_eq!(answer.content(), "hi!");
    // An error event after the finish reason: the same.
    let script = sse(vec![
        (Duration::ZERO, chunk("hi", true)),
        (
            Duration::ZERO,
            Bytes::from_static(b"data: {\"error\":{\"message\":\"late\"}}\n\n"),
        ),
    ]);
    let answer = p.client(script, timeouts()).oneshot(stream_call()).await.unwrap();
    assert_eq!(answer.content(), "hi");
}

/// A streamed answer is bounded as a whole one is (64 MiB): a provider flooding large
/// chunks ends the attempt instead of growing memory until the total timeout.
#[tokio::test(start_paused = true)]
async fn a_stream_larger_than_an_answer_may_be_is_cut() {
    let p = Provider::default();
    let big = chunk(&"x".repeat(4 << 20), false);
    let frames = (0..20).map(|_| (Duration::from_millis(1), big.clone())).collect();
    let r = p.client(sse(frames), timeouts()).oneshot(stream_call()).await;
    let err = r.as_ref().unwrap_err();
    assert!(err.to_string().contains("stream larger than"), "{err}");
    assert_eq!(outcome(&r), Outcome::Transient);
}

/// A call asking for several choices (`n: 2`) is complete only once each choice seen
/// finished: a stream that ends after the first choice's finish reason, the second
/// still running, is a cut (it was taken for the whole answer, the second choice
/// truncated). A provider that ignores `n` and streams one choice is whole.
#[tokio::test(start_paused = true)]
async fn a_stream_of_two_choices_is_whole_only_when_both_finish() {
    let p = Provider::default();
    let two = || {
        let mut req = ChatRequest::user("m", "hi");
        req.stream = true;
        req.extra.insert("n".into(), 2.into());
        ChatCall::new(req)
    };
    let ev = |s: &'static str| Bytes::from(format!("data: {s}\n\n"));
    let first_done = [
        ev(r#"{"choices":[{"index":0,"delta":{"content":"a"}},{"index":1,"delta":{"content":"b"}}]}"#),
        ev(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#),
        ev(r#"{"choices":[{"index":1,"delta":{"content":"c"}}]}"#),
    ];
    let done = Bytes::from_static(pgw_core::sse::DONE.as_bytes());
    let mut cut: Vec<_> = first_done.iter().map(|b| (Duration::ZERO, b.clone())).collect();
    cut.push((Duration::ZERO, done.clone()));
    let r = p.client(sse(cut), timeouts()).oneshot(two()).await;
    let err = r.as_ref().unwrap_err();
    assert!(err.to_string().contains("before a finish_reason"), "{err}");
    assert_eq!(outcome(&r), Outcome::Transient);

    // The same with the second choice's finish reason: the answer.
    let mut whole: Vec<_> = first_done.iter().map(|b| (Duration::ZERO, b.clone())).collect();
    whole.push((
        Duration::ZERO,
        ev(r#"{"choices":[{"index":1,"delta":{},"finish_reason":"length"}]}"#),
    ));
    whole.push((Duration::ZERO, done));
    let answer = p.client(sse(whole), timeouts()).oneshot(two()).await.unwrap();
    assert_eq!(answer.response.choices.len(), 2);

    let one = vec![
        (
            Duration::ZERO,
            ev(r#"{"choices":[{"index":0,"delta":{"content":"a"}}]}"#),
        ),
        (
            Duration::ZERO,
            ev(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#),
        ),
        (Duration::ZERO, Bytes::from_static(pgw_core::sse::DONE.as_bytes())),
    ];
    let answer = p.client(sse(one), timeouts()).oneshot(two()).await.unwrap();
    assert_eq!(answer.content(), "a", "n ignored: one choice, whole");

    // Choice 1 first seen after choice 0 finished (the answer looked whole then),
    // then `[DONE]`: choice 1 never finished, a cut (it was taken for the answer).
    let late = vec![
        (
            Duration::ZERO,
            ev(r#"{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":"stop"}]}"#),
        ),
        (
            Duration::ZERO,
            ev(r#"{"choices":[{"index":1,"delta":{"content":"b"}}]}"#),
        ),
        (Duration::ZERO, Bytes::from_static(pgw_core::sse::DONE.as_bytes())),
    ];
    let r = p.client(sse(late), timeouts()).oneshot(two()).await;
    let err = r.as_ref().unwrap_err();
    assert!(err.to_string().contains("before a finish_reason"), "{err}");
}

/// A chunk naming a choice index past `MAX_STREAMED_INDEX` is malformed, and one event
/// of a hundred thousand choices is judged in linear time (a list searched per choice
/// held the executor for seconds).
#[tokio::test(start_paused = true)]
async fn a_stream_naming_too_many_choices_is_malformed() {
    let p = Provider::default();
    let call = || {
        let mut req = ChatRequest::user("m", "hi");
        req.stream = true;
        ChatCall::new(req)
    };
    let far = format!(
        "data: {{\"choices\":[{{\"index\":{},\"delta\":{{\"content\":\"a\"}}}}]}}\n\n",
        pgw_core::openai::MAX_STREAMED_INDEX + 1
    );
    let r = p
        .client(sse(vec![(Duration::ZERO, Bytes::from(far))]), timeouts())
        .oneshot(call())
        .await;
    let err = r.as_ref().unwrap_err();
    assert!(err.to_string().contains("names choice 1025"), "{err}");
    assert_eq!(outcome(&r), Outcome::Transient);
    // A hundred thousand choices within the index bound, in one event.
    let many: Vec<String> = (0..100_000)
        .map(|i| format!(r#"{{"index":{},"delta":{{}}}}"#, i % 1000))
        .collect();
    let event = format!("data: {{\"choices\":[{}]}}\n\n", many.join(","));
    let stop = r#"data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"stop"}]}

"#;
    let r = p
        .client(
            sse(vec![
                (Duration::ZERO, Bytes::from(event)),
                (Duration::ZERO, Bytes::from_static(stop.as_bytes())),
                (Duration::ZERO, Bytes::from_static(pgw_core::sse::DONE.as_bytes())),
            ]),
            timeouts(),
        )
        .oneshot(call())
        .await;
    // 999 choices never finished: a cut, not an answer.
    let err = r.as_ref().unwrap_err();
    assert!(err.to_string().contains("before a finish_reason"), "{err}");
}
