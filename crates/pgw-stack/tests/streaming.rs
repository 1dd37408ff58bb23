//! Streams stream: the gateway passes a streamed answer through as it arrives, judges
//! the attempt at the stream's end, and never ends a truncated answer cleanly. Against
//! the simulator's wire bytes, on tokio's paused clock.

mod support;

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::BodyExt;
use pgw_core::BoxError;
use pgw_core::openai::{ChatChunk, ChatRequest};
use pgw_sim::{LogNormal, PoolConfig, SimPool, StallConfig};
use pgw_stack::{AttemptTelemetry, ChatStream, Gateway, GatewayConfig, MemorySink, SecretKey, SourceConfig};
use tokio::time::Instant;
use tower::ServiceExt;

const KEY: &str = "sk-virtual-0123456789";
/// Every answer is exactly this long on every source (the completion fraction is 1).
const TOKENS: u64 = 60;

/// A source streaming `TOKENS` tokens at 2 per second after a 2 s first token.
fn slow(name: &str) -> pgw_sim::SourceConfig {
    let mut s = pgw_sim::SourceConfig {
        ttft_s: LogNormal::constant(2.0).into(),
        tokens_per_second: LogNormal::constant(2.0).into(),
        error_latency_s: LogNormal::constant(0.1).into(),
        accepts_prefill: true,
        ..pgw_sim::SourceConfig::healthy(name)
    };
    s.completion.min_fraction = 1.0;
    s.completion.max_fraction = 1.0;
    s
}

/// A source whose every stream stalls for 60 s half way.
fn stalling(name: &str) -> pgw_sim::SourceConfig {
    pgw_sim::SourceConfig {
        stall: StallConfig {
            rate: 1.0,
            min_gap_s: 60.0,
            max_gap_s: 60.0,
        }
        .into(),
        ..slow(name)
    }
}

fn pool(sources: Vec<pgw_sim::SourceConfig>) -> SimPool {
    let config = PoolConfig::of(sources);
    SimPool::new(config, 11).unwrap()
}

/// A gateway over `pool` trying its sources in order (round robin), whose sources in
/// `prefill` accept an assistant prefill.
async fn gateway(pool: &SimPool, sink: &MemorySink, prefill: &[&str]) -> Gateway {
    let mut cfg = GatewayConfig::default();
    cfg.cache.enabled = false;
    cfg.balance.policy = Some("round_robin".into());
    for name in pool.sources() {
        let mut s = SourceConfig::new(
            name.as_str(),
            format!("http://sim.invalid/{name}/v1"),
            SecretKey::new(KEY),
        )
        .accepts_prefill(prefill.contains(&name.as_str()));
        s.inter_token_timeout_s = Some(5.0);
        s.total_timeout_s = Some(300.0);
        s.max_concurrency = Some(4);
        cfg.sources.push(s);
    }
    support::sim_gateway(pool, cfg, sink).await
}

fn request() -> ChatRequest {
    let mut r = ChatRequest::user("m", "tell me a story");
    r.max_tokens = Some(TOKENS);
    r
}

fn text(c: &ChatChunk) -> &str {
    c.choices
        .first()
        .and_then(|c| c.delta.content.as_deref())
        .unwrap_or("")
}

/// Drains a stream: the text, each item's arrival time since `t0`, and the error it
/// ended with.
async fn drain(mut s: ChatStream, t0: Instant) -> (String, Vec<Duration>, Option<BoxError>, Vec<ChatChunk>) {
    let (mut out, mut times, mut chunks) = (String::new(), Vec::new(), Vec::new());
    while let Some(item) = s.next().await {
        times.push(t0.elapsed());
        match item {
            Ok(c) => {
                out.push_str(text(&c));
                chunks.push(c);
            }
            Err(e) => return (out, times, Some(e), chunks),
        }
    }
    (out, times, None, chunks)
}

/// What `source` answers `request()` when nothing goes wrong (its whole text).
async fn clean_text(pool: &SimPool, source: &str) -> String {
    let body = serde_json::to_vec(&serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": TOKENS,
    }))
    .unwrap();
    let req = http::Request::post(format!("http://sim.invalid/{source}/v1/chat/completions"))
        .header("authorization", format!("Bearer {KEY}"))
        .header("content-type", "application/json")
        .body(Bytes::from(body))
        .unwrap();
    let resp = pool.service(source).unwrap().oneshot(req).await.unwrap();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    v["choices"][0]["message"]["content"].as_str().unwrap().to_owned()
}

fn records(sink: &MemorySink, source: &str) -> Vec<AttemptTelemetry> {
    sink.records()
        .into_iter()
        .filter(|r| r.source.as_ref().is_some_and(|s| s.as_str() == source))
        .collect()
}

async fn all_released(gw: &Gateway, pool: &SimPool) {
    for h in gw.sources() {
        assert_eq!(h.aimd.inflight(), 0, "{}: AIMD slot held", h.source);
        let held = h.limiter.held().await.unwrap();
        assert_eq!(held.leases(), 0, "{}: concurrency lease held", h.source);
    }
    for (name, s) in &pool.stats().sources {
        assert_eq!(s.in_flight, 0, "{name}: upstream request still running");
    }
}

#[tokio::test(start_paused = true)]
async fn chunks_reach_the_caller_as_the_upstream_sends_them() {
    let pool = pool(vec![slow("a")]);
    let sink = MemorySink::default();
    let gw = gateway(&pool, &sink, &[]).await;
    let t0 = Instant::now();
    let stream = gw.chat_stream(request()).await.unwrap();
    let committed = t0.elapsed();
    let (content, times, err, _) = drain(stream, t0).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(content, clean_text(&pool, "a").await);
    let rec = &records(&sink, "a")[0];
    let ttft = Duration::from_secs_f64(rec.ttft_ms.unwrap() / 1000.0);
    // The first chunk is handed over the instant the upstream's first token arrived
    // (paused clock: exactly), not when the last one did.
    assert_eq!(committed.as_millis(), ttft.as_millis());
    assert_eq!(times[0], committed);
    let total = *times.last().unwrap();
    assert!(total > committed + Duration::from_secs(20), "{total:?}");
    // The attempt is recorded when the stream ends, with the usage asked upstream.
    assert_eq!(rec.outcome, "success");
    assert_eq!(rec.completion_tokens, Some(TOKENS));
    assert!(
        (rec.latency_ms - total.as_secs_f64() * 1000.0).abs() < 1.0,
        "{}",
        rec.latency_ms
    );
    all_released(&gw, &pool).await;
}

#[tokio::test(start_paused = true)]
async fn an_error_event_before_the_first_token_moves_on_invisibly() {
    let broken = pgw_sim::SourceConfig {
        stream_error_rate: 1.0.into(),
        ..slow("a")
    };
    let pool = pool(vec![broken, slow("b")]);
    let sink = MemorySink::default();
    let gw = gateway(&pool, &sink, &[]).await;
    for _ in 0..2 {
        let stream = gw.chat_stream(request()).await.unwrap();
        assert_eq!(stream.source().unwrap().as_str(), "b");
        let (content, _, err, _) = drain(stream, Instant::now()).await;
        assert!(err.is_none(), "{err:?}");
        assert_eq!(content, clean_text(&pool, "b").await);
    }
    assert!(pool.stats().sources["a"].stream_errors >= 1);
    assert!(records(&sink, "a").iter().all(|r| r.outcome == "transient"));
}

#[tokio::test(start_paused = true)]
async fn a_stream_cut_after_commit_is_continued_on_a_prefill_source_byte_exact() {
    let pool = pool(vec![stalling("a"), slow("b")]);
    let sink = MemorySink::default();
    let gw = gateway(&pool, &sink, &["b"]).await;
    let reference = clean_text(&pool, "b").await;
    let mut cut_seen = false;
    for _ in 0..2 {
        let stream = gw.chat_stream(request()).await.unwrap();
        let from_a = stream.source().unwrap().as_str() == "a";
        let (content, _, err, chunks) = drain(stream, Instant::now()).await;
        assert!(err.is_none(), "{err:?}");
        assert_eq!(content, reference, "the caller's text is the whole answer, once");
        assert_eq!(
            chunks.last().unwrap().choices[0].finish_reason.as_deref(),
            Some("stop")
        );
        let roles = chunks
            .iter()
            .filter(|c| c.choices.iter().any(|ch| ch.delta.role.is_some()))
            .count();
        assert_eq!(roles, 1, "one role chunk, not one per source");
        cut_seen |= from_a;
    }
    assert!(cut_seen, "a call committed to the stalling source");
    // The cut was judged a failure of `a` when it happened.
    let a = records(&sink, "a");
    assert!(a.iter().any(|r| r.outcome == "transient"), "{a:?}");
    assert!(gw.stream_health("a").unwrap() < 1.0);
    assert_eq!(gw.stream_health("b"), Some(1.0));
    all_released(&gw, &pool).await;
}

#[tokio::test(start_paused = true)]
async fn a_cut_with_no_prefill_source_ends_with_an_error_never_cleanly() {
    let pool = pool(vec![stalling("a")]);
    let sink = MemorySink::default();
    let gw = gateway(&pool, &sink, &[]).await;
    let stream = gw.chat_stream(request()).await.unwrap();
    let (content, _, err, chunks) = drain(stream, Instant::now()).await;
    let err = err.expect("a cut stream ends with its error");
    assert!(
        err.to_string().contains("inter-token") || err.to_string().contains("inter_token"),
        "{err}"
    );
    assert!(!content.is_empty());
    assert!(
        chunks
            .iter()
            .all(|c| c.choices.iter().all(|ch| ch.finish_reason.is_none()))
    );
    assert_eq!(records(&sink, "a")[0].outcome, "transient");

    all_released(&gw, &pool).await;
}

#[tokio::test(start_paused = true)]
async fn a_caller_dropping_mid_stream_releases_everything_and_cancels_upstream() {
    let pool = pool(vec![slow("a")]);
    let sink = MemorySink::default();
    let gw = gateway(&pool, &sink, &[]).await;
    let mut stream = gw.chat_stream(request()).await.unwrap();
    for _ in 0..3 {
        stream.next().await.unwrap().unwrap();
    }
    assert_eq!(gw.sources()[0].aimd.inflight(), 1, "held while the stream runs");
    assert_eq!(pool.stats().sources["a"].in_flight, 1);
    drop(stream);
    tokio::time::sleep(Duration::from_millis(1)).await;
    all_released(&gw, &pool).await;
    assert_eq!(records(&sink, "a")[0].outcome, "cancelled");
}

#[tokio::test(start_paused = true)]
async fn the_usage_chunk_reaches_the_caller_only_when_asked_and_quirks_are_tolerated() {
    let quirky = pgw_sim::SourceConfig {
        no_done_rate: 1.0.into(),
        malformed_chunk_rate: 1.0.into(),
        ..slow("a")
    };
    let pool = pool(vec![quirky]);
    let sink = MemorySink::default();
    let gw = gateway(&pool, &sink, &[]).await;
    let usage_chunks = |chunks: &[ChatChunk]| chunks.iter().filter(|c| c.usage.is_some()).count();

    let (content, _, err, chunks) = drain(gw.chat_stream(request()).await.unwrap(), Instant::now()).await;
    assert!(
        err.is_none(),
        "no [DONE] after a finish reason is complete; a bad chunk is skipped: {err:?}"
    );
    assert_eq!(content, clean_text(&pool, "a").await);
    assert_eq!(usage_chunks(&chunks), 0, "not asked: no usage chunk");
    // Upstream it was asked anyway, so the quota settles to real usage.
    assert_eq!(records(&sink, "a")[0].completion_tokens, Some(TOKENS));

    let mut asked = request();
    asked.extra.insert(
        "stream_options".into(),
        serde_json::json!({"include_usage": true}),
    );
    let (_, _, err, chunks) = drain(gw.chat_stream(asked).await.unwrap(), Instant::now()).await;
    assert!(err.is_none());
    assert_eq!(usage_chunks(&chunks), 1);
}

#[tokio::test(start_paused = true)]
async fn a_source_whose_streams_get_cut_is_no_longer_trusted_with_the_callers_stream() {
    let pool = pool(vec![stalling("a"), slow("b")]);
    let sink = MemorySink::default();
    let gw = gateway(&pool, &sink, &[]).await;
    let reference = clean_text(&pool, "b").await;
    let (mut cut, mut whole) = (0, 0);
    for _ in 0..8 {
        let (content, _, err, _) = drain(gw.chat_stream(request()).await.unwrap(), Instant::now()).await;
        match err {
            Some(_) => cut += 1,
            None => {
                assert_eq!(content, reference);
                whole += 1;
            }
        }
    }
    // Two cuts passed through (0.2, then 0.36 > 0.3); after that `a`'s streams are
    // consumed whole first, so its cuts are retried on `b`, unseen.
    assert_eq!(cut, 2, "{whole} whole");
    let a = records(&sink, "a");
    assert!(a.len() > 2, "a is still tried: {a:?}");
    all_released(&gw, &pool).await;
}

/// The caller's deadline bounds a committed stream, not only the wait for its first
/// output: a 30 s stream (60 tokens at 2 per second) called with a 10 s deadline ends
/// at 10 s with `DeadlineExceeded`, and everything is released.
#[tokio::test(start_paused = true)]
async fn a_committed_stream_ends_at_the_callers_deadline() {
    let pool = pool(vec![slow("a")]);
    let sink = MemorySink::default();
    let gw = gateway(&pool, &sink, &[]).await;
    let t0 = Instant::now();
    let mut call = pgw_stack::ChatCall::new({
        let mut r = request();
        r.stream = true;
        r
    });
    call.extensions_mut()
        .insert(pgw_stack::retry::CallDeadline(t0 + Duration::from_secs(10)));
    let stream = gw.stream_call(call).await.unwrap();
    let (text, times, err, _) = drain(stream, t0).await;
    let err = err.expect("the stream ends with the deadline's error");
    let retry = err
        .downcast_ref::<pgw_stack::retry::RetryError>()
        .expect("a retry error");
    assert_eq!(retry.reason(), pgw_stack::retry::Reason::DeadlineExceeded);
    assert_eq!(
        *times.last().unwrap(),
        Duration::from_secs(10),
        "cut at the deadline"
    );
    assert!(
        !text.is_empty(),
        "the text before the deadline reached the caller"
    );
    all_released(&gw, &pool).await;
}

/// A call asking for several choices (`n > 1`) is not continued after a cut: a prefill
/// continues one choice's text, and the others would be sent twice or interleaved.
/// Its cut ends the stream with its error, as with no prefill source.
#[tokio::test(start_paused = true)]
async fn a_cut_of_several_choices_is_not_continued() {
    let pool = pool(vec![stalling("a"), slow("b")]);
    let sink = MemorySink::default();
    let gw = gateway(&pool, &sink, &["b"]).await;
    let mut cut = 0;
    for _ in 0..2 {
        let mut r = request();
        r.extra.insert("n".into(), serde_json::json!(2));
        let stream = gw.chat_stream(r).await.unwrap();
        let from_a = stream.source().unwrap().as_str() == "a";
        let (_, _, err, _) = drain(stream, Instant::now()).await;
        if from_a {
            cut += 1;
            assert!(
                err.is_some(),
                "a cut of n = 2 ends with its error, not a continuation"
            );
        } else {
            assert!(err.is_none(), "{err:?}");
        }
    }
    assert!(cut > 0, "a call committed to the stalling source");
    all_released(&gw, &pool).await;
}

/// A continuation keeps the caller's cache partition (a tenant's): it is read from and
/// stored in the tenant's own part of the cache. It carried only the deadline and the
/// opt-out, so a tenant's continuation (its prompt and the text so far) was stored
/// unpartitioned and answered another tenant's identical call.
#[tokio::test(start_paused = true)]
async fn a_continuation_keeps_the_callers_cache_partition() {
    let pool = pool(vec![stalling("a"), slow("b")]);
    let sink = MemorySink::default();
    let mut cfg = GatewayConfig::default();
    cfg.cache.when = pgw_stack::CacheWhen::Always;
    cfg.balance.policy = Some("round_robin".into());
    for (name, prefill) in [("a", false), ("b", true)] {
        let mut s = SourceConfig::new(name, format!("http://sim.invalid/{name}/v1"), SecretKey::new(KEY))
            .accepts_prefill(prefill);
        s.inter_token_timeout_s = Some(5.0);
        s.total_timeout_s = Some(300.0);
        cfg.sources.push(s);
    }
    let gw = support::sim_gateway(&pool, cfg, &sink).await;
    let partitioned = |mut r: ChatRequest| {
        r.stream = true;
        let mut call = pgw_stack::ChatCall::new(r);
        call.extensions_mut()
            .insert(pgw_stack::CachePartition(std::sync::Arc::from("team-a")));
        call
    };
    // Round robin: one of the first two calls commits to the stalling source (a
    // call answered by `b` whole is cached and answers the next: the prompts differ).
    let mut drained = None;
    for n in 0..2 {
        let mut r = request();
        r.messages[0] = pgw_core::openai::ChatMessage::new("user", format!("tell me story {n}"));
        let stream = gw.stream_call(partitioned(r.clone())).await.unwrap();
        if stream.source().map(pgw_core::SourceId::as_str) == Some("a") {
            drained = Some((r, drain(stream, Instant::now()).await));
            break;
        }
        drop(drain(stream, Instant::now()).await);
    }
    let (asked, (content, times, err, chunks)) = drained.expect("a call committed to `a`");
    assert!(err.is_none(), "{err:?}");
    // The text before the cut (the stall: the one gap longer than the 5 s watchdog).
    let cut = (1..times.len())
        .find(|&i| times[i] - times[i - 1] >= Duration::from_secs(5))
        .expect("the stream was cut and continued");
    let prefix: String = chunks[..cut].iter().map(text).collect();
    assert!(!prefix.is_empty() && content.starts_with(&prefix));
    // The continuation's request, asked by another tenant (unpartitioned): not
    // answered from the first tenant's continuation. It asks for what is left of the
    // caller's `max_tokens` (the tokens relayed counted as the relay counts them).
    let relayed = chunks[..cut]
        .iter()
        .filter(|c| !text(c).is_empty())
        .count()
        .max(prefix.split_whitespace().count());
    let mut continuation = asked;
    continuation.max_tokens = Some(TOKENS - u64::try_from(relayed).unwrap());
    continuation
        .messages
        .push(pgw_core::openai::ChatMessage::new("assistant", prefix.clone()));
    continuation.stream = true;
    let other = gw
        .stream_call(pgw_stack::ChatCall::new(continuation.clone()))
        .await
        .unwrap();
    assert!(
        !other.cache_hit(),
        "another tenant got the first tenant's continuation"
    );
    drop(other);
    // The first tenant asking it is answered from its own part.
    let own = gw.stream_call(partitioned(continuation)).await.unwrap();
    assert!(
        own.cache_hit(),
        "the continuation was stored in the tenant's partition"
    );
}

/// A continuation brings a fresh default deadline, and the call's history (where the
/// balancer reads the deadline) carries it too: the first call's, which only ever
/// moves sooner, would have every wait of a continuation begun past it fail at once.
#[tokio::test(start_paused = true)]
async fn a_continuation_takes_a_fresh_default_deadline_into_its_history() {
    let pool = pool(vec![stalling("a"), slow("b")]);
    let sink = MemorySink::default();
    let gw = gateway(&pool, &sink, &["b"]).await;
    let mut continued = false;
    for _ in 0..6 {
        let t0 = Instant::now();
        let history = pgw_core::CallHistory::new();
        let mut r = request();
        r.stream = true;
        let mut call = pgw_stack::ChatCall::new(r);
        pgw_core::CarriesHistory::set_call_history(&mut call, history.clone());
        let stream = gw.stream_call(call).await.unwrap();
        if stream.source().map(pgw_core::SourceId::as_str) != Some("a") {
            drop(drain(stream, Instant::now()).await);
            continue;
        }
        let (_, times, err, _) = drain(stream, Instant::now()).await;
        assert!(err.is_none(), "{err:?}");
        // Continued: the stall (the one gap past the 5 s watchdog) was cut.
        if !times.windows(2).any(|w| w[1] - w[0] >= Duration::from_secs(5)) {
            continue;
        }
        let first = t0 + pgw_stack::DEFAULT_MAX_CALL_DURATION;
        let deadline = history.deadline().expect("the continuation's deadline");
        assert!(deadline > first, "{:?} after the first deadline", deadline - t0);
        continued = true;
        break;
    }
    assert!(continued, "a call committed to the stalling source");
}

/// A streamed attempt is one record in the call's history, with its source and the
/// outcome of its end: the retry layer's record of the stream's commit (a success,
/// without its source) is taken over by the balancer's at the stream's end. Before,
/// both stayed: a cut stream read as a success and a failure.
#[tokio::test(start_paused = true)]
async fn a_streamed_attempt_is_one_record_in_the_calls_history() {
    for (source, outcome) in [
        (slow("a"), pgw_core::Outcome::Success),
        (stalling("a"), pgw_core::Outcome::Transient),
    ] {
        let pool = pool(vec![source]);
        let sink = MemorySink::default();
        let gw = gateway(&pool, &sink, &[]).await;
        let history = pgw_core::CallHistory::new();
        let mut r = request();
        r.stream = true;
        let mut call = pgw_stack::ChatCall::new(r);
        pgw_core::CarriesHistory::set_call_history(&mut call, history.clone());
        let (_, _, err, _) = drain(gw.stream_call(call).await.unwrap(), Instant::now()).await;
        assert_eq!(err.is_some(), outcome != pgw_core::Outcome::Success, "{err:?}");
        let attempts = history.attempts();
        assert_eq!(attempts.len(), 1, "{attempts:?}");
        assert_eq!(
            attempts[0].source.as_ref().map(pgw_core::SourceId::as_str),
            Some("a")
        );
        assert_eq!(attempts[0].outcome, outcome);
        assert!(!history.in_flight());
        all_released(&gw, &pool).await;
    }
}
