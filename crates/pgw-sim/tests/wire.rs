//! The providers' wire, seen by a plain client on the paused clock: lenient requests,
//! provider error bodies, content filter and refusals, streams without usage, without
//! `[DONE]`, with a malformed chunk or an error event, and the fields OpenAI echoes.

mod common;

use common::{Raw, raw};
use pgw_sim::config::MAX_GENERATED_TOKENS;
use pgw_sim::{PoolConfig, SimPool};
use serde_json::{Value, json};

fn pool(source: &Value) -> SimPool {
    let config: PoolConfig =
        serde_json::from_value(json!({"sources": [source], "bad_prompt_rate": 0.0})).unwrap();
    SimPool::new(config, 9).unwrap()
}

fn chat(content: &str, stream: bool) -> Value {
    json!({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 30, "stream": stream})
}

async fn one(source: Value, req: &Value) -> (Raw, SimPool) {
    let p = pool(&source);
    let mut svc = p.service(&p.sources()[0]).unwrap();
    (raw(&mut svc, req, None).await, p)
}

/// The text of a stream's content deltas.
fn streamed_text(r: &Raw) -> String {
    r.chunks()
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn content_parts_unknown_fields_and_budgets_are_accepted() {
    let text = "describe this picture";
    let req = json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": null},
            {"role": "user", "name": "x", "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png", "detail": "low"}},
                {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
            ]},
        ],
        "max_completion_tokens": 12,
        "temperature": 0.2,
        "some_future_knob": {"nested": [1, 2]},
    });
    let (r, _) = one(json!({"name": "a"}), &req).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let usage = &r.json()["usage"];
    // ceil(21 / 4) + 4 per message + 85 per image.
    assert_eq!(usage["prompt_tokens"], 6 + 8 + 85);
    assert!(usage["completion_tokens"].as_u64().unwrap() <= 12);
    // A budget of u64::MAX is accepted; the answer stops at the generation cap.
    let huge = json!({"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": u64::MAX});
    let (r, _) = one(json!({"name": "a"}), &huge).await;
    assert_eq!(r.status, 200);
    let n = r.json()["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(n > 0 && n <= MAX_GENERATED_TOKENS, "{n}");
    // Still a 400 for what no provider accepts.
    let bad = json!({"model": "m", "messages": [{"role": "user", "content": 7}]});
    let (r, _) = one(json!({"name": "a"}), &bad).await;
    assert_eq!(
        (r.status, r.json()["error"]["code"].as_str()),
        (400, Some("invalid_json"))
    );
}

#[tokio::test(start_paused = true)]
async fn unknown_model_context_window_and_content_policy_are_provider_errors() {
    let (r, p) = one(
        json!({"name": "a", "models": ["gpt-a", "gpt-b"]}),
        &chat("hi", false),
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(
        r.json(),
        json!({"error": {"message": "The model `m` does not exist or you do not have access to it.",
            "type": "invalid_request_error", "param": null, "code": "model_not_found"}})
    );
    assert_eq!(p.stats().sources["a"].model_not_found, 1);

    let long = "x".repeat(400); // 100 + 4 prompt tokens, 30 of completion
    let (r, p) = one(json!({"name": "a", "context_window": 128}), &chat(&long, false)).await;
    assert_eq!(r.status, 400);
    let e = &r.json()["error"];
    assert_eq!(
        (e["code"].as_str(), e["param"].as_str()),
        (Some("context_length_exceeded"), Some("messages"))
    );
    assert!(
        e["message"].as_str().unwrap().starts_with(
            "This model's maximum context length is 128 tokens. However, you requested 134 tokens (104 in the messages, 30 in the completion)."
        ),
        "{e}"
    );
    assert_eq!(p.stats().sources["a"].context_length_exceeded, 1);
    let (ok, _) = one(json!({"name": "a", "context_window": 134}), &chat(&long, false)).await;
    assert_eq!(ok.status, 200);

    // The same prompts are flagged on two sources with the same rate, about half of them.
    let cfg = |name: &str| json!({"name": name, "content_policy_rate": 0.5});
    let config: PoolConfig =
        serde_json::from_value(json!({"sources": [cfg("a"), cfg("b")], "bad_prompt_rate": 0.0})).unwrap();
    let p = SimPool::new(config, 1).unwrap();
    let (mut a, mut b) = (p.service("a").unwrap(), p.service("b").unwrap());
    let mut flagged = 0;
    for i in 0..40 {
        let req = chat(&format!("prompt {i}"), false);
        let (ra, rb) = (raw(&mut a, &req, None).await, raw(&mut b, &req, None).await);
        assert_eq!(ra.status, rb.status, "prompt {i}");
        if ra.status == 400 {
            flagged += 1;
            let e = &ra.json()["error"];
            assert_eq!(
                (e["code"].as_str(), e["type"].as_str()),
                (Some("content_policy_violation"), Some("invalid_request_error"))
            );
        }
    }
    assert!((8..=32).contains(&flagged), "{flagged}");
    assert_eq!(p.stats().sources["a"].content_policy_violations, flagged);
}

#[tokio::test(start_paused = true)]
async fn overloaded_and_insufficient_quota_bodies() {
    let (r, p) = one(json!({"name": "a", "overloaded_rate": 1.0}), &chat("hi", false)).await;
    assert_eq!(r.status, 529);
    assert_eq!(
        r.json(),
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    );
    assert_eq!(p.stats().sources["a"].overloaded, 1);

    let (r, p) = one(
        json!({"name": "a", "insufficient_quota_rate": 1.0}),
        &chat("hi", false),
    )
    .await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), None);
    assert_eq!(
        r.json(),
        json!({"error": {"message": "You exceeded your current quota, please check your plan and billing details.",
            "type": "insufficient_quota", "param": null, "code": "insufficient_quota"}})
    );
    let st = &p.stats().sources["a"];
    assert_eq!((st.insufficient_quota, st.rate_limited), (1, 0));
}

#[tokio::test(start_paused = true)]
async fn content_filter_and_refusal_answers() {
    let src = json!({"name": "a", "content_filter_rate": 1.0});
    let (r, _) = one(src.clone(), &chat("hi", false)).await;
    let choice = &r.json()["choices"][0];
    assert_eq!((r.status, &choice["message"]["content"]), (200, &Value::Null));
    assert_eq!(choice["finish_reason"], "content_filter");
    let (r, p) = one(src, &chat("hi", true)).await;
    let chunks = r.chunks();
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant"}));
    assert_eq!(chunks[1]["choices"][0]["finish_reason"], "content_filter");
    assert_eq!(streamed_text(&r), "");
    assert_eq!(p.stats().sources["a"].content_filtered, 1);

    let refusal = "I'm sorry, but I can't help with that.";
    let src = json!({"name": "a", "refusal_rate": 1.0});
    let (r, _) = one(src.clone(), &chat("hi", false)).await;
    let choice = &r.json()["choices"][0];
    assert_eq!(choice["message"]["content"], Value::Null);
    assert_eq!(choice["message"]["refusal"], refusal);
    assert_eq!(choice["finish_reason"], "stop");
    let (r, p) = one(src, &chat("hi", true)).await;
    let refused: String = r
        .chunks()
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["refusal"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(refused, refusal);
    assert!(
        r.chunks()
            .iter()
            .any(|c| c["choices"][0]["finish_reason"] == "stop")
    );
    assert_eq!(p.stats().sources["a"].refusals, 1);
}

#[tokio::test(start_paused = true)]
async fn stream_usage_only_when_asked_or_never() {
    let asked = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30,
        "stream": true, "stream_options": {"include_usage": true}});
    let has_usage = |r: &Raw| r.chunks().iter().any(|c| c.get("usage").is_some());
    let src = json!({"name": "a", "stream_usage": "when_asked"});
    let (plain, p) = one(src.clone(), &chat("hi", true)).await;
    assert!(!has_usage(&plain), "{}", plain.body);
    assert_eq!(plain.events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(p.stats().sources["a"].streams_without_usage, 1);
    let (with, _) = one(src, &asked).await;
    assert!(has_usage(&with));
    let (never, _) = one(json!({"name": "a", "stream_usage": "never"}), &asked).await;
    assert!(!has_usage(&never));
    let (always, _) = one(json!({"name": "a"}), &chat("hi", true)).await;
    assert!(has_usage(&always));
}

#[tokio::test(start_paused = true)]
async fn streams_without_done_with_a_malformed_chunk_or_an_error_event() {
    let (r, p) = one(json!({"name": "a", "no_done_rate": 1.0}), &chat("hi", true)).await;
    assert_eq!(r.status, 200);
    assert!(!r.events.iter().any(|e| e == "[DONE]"), "{}", r.body);
    let last = r.chunks().last().cloned().unwrap();
    assert!(last.get("usage").is_some(), "ends after the usage chunk: {last}");
    let st = &p.stats().sources["a"];
    assert_eq!((st.streams_without_done, st.streams_completed), (1, 1));

    // The same source name and seed draw the same answer; only the extra event differs.
    let (clean, _) = one(json!({"name": "a"}), &chat("hi", true)).await;
    let (bad, p) = one(
        json!({"name": "a", "malformed_chunk_rate": 1.0}),
        &chat("hi", true),
    )
    .await;
    let broken: Vec<_> = bad
        .events
        .iter()
        .filter(|e| *e != "[DONE]" && serde_json::from_str::<Value>(e).is_err())
        .collect();
    assert_eq!(broken.len(), 1, "{}", bad.body);
    assert_eq!(bad.events.len(), clean.events.len() + 1);
    assert_eq!(streamed_text(&bad), streamed_text(&clean));
    assert!(!streamed_text(&clean).is_empty());
    let bad_at = bad
        .events
        .iter()
        .position(|e| serde_json::from_str::<Value>(e).is_err())
        .unwrap();
    assert!(
        bad_at > 0 && bad_at < bad.events.len() - 2,
        "mid-stream: {bad_at}"
    );
    assert_eq!(p.stats().sources["a"].malformed_chunks, 1);

    let (r, p) = one(json!({"name": "a", "stream_error_rate": 1.0}), &chat("hi", true)).await;
    assert_eq!(
        (r.status, r.header("content-type")),
        (200, Some("text/event-stream"))
    );
    assert_eq!(r.events.len(), 1, "{}", r.body);
    assert_eq!(
        serde_json::from_str::<Value>(&r.events[0]).unwrap(),
        json!({"error": {"message": "The server had an error processing your request.", "type": "server_error", "param": null, "code": null}})
    );
    assert_eq!(p.stats().sources["a"].stream_errors, 1);
    // Non-streamed requests are not affected by stream-only knobs.
    let (r, _) = one(
        json!({"name": "a", "stream_error_rate": 1.0, "no_done_rate": 1.0}),
        &chat("hi", false),
    )
    .await;
    assert_eq!(r.json()["object"], "chat.completion");
}

#[tokio::test(start_paused = true)]
async fn answers_echo_what_openai_echoes_when_asked_to() {
    let src = json!({"name": "a", "echo_openai_fields": true});
    let mut req = chat("hi", false);
    req["logprobs"] = json!(true);
    req["service_tier"] = json!("flex");
    let (r, _) = one(src.clone(), &req).await;
    let v = r.json();
    assert!(v["system_fingerprint"].as_str().unwrap().starts_with("fp_"));
    assert_eq!(v["service_tier"], "flex");
    assert_eq!(v["usage"]["completion_tokens_details"]["reasoning_tokens"], 0);
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    let tokens: String = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["token"].as_str().unwrap())
        .collect();
    assert_eq!(tokens, content);
    let (r, _) = one(src.clone(), &chat("hi", false)).await;
    let v = r.json();
    assert_eq!(
        (&v["service_tier"], &v["choices"][0]["logprobs"]),
        (&json!("default"), &Value::Null)
    );
    assert!(v["choices"][0].as_object().unwrap().contains_key("logprobs"));
    let (r, _) = one(src, &chat("hi", true)).await;
    assert!(r.chunks().iter().all(|c| c["system_fingerprint"].is_string()));
    // Off by default: the historical bytes.
    let (r, _) = one(json!({"name": "a"}), &chat("hi", false)).await;
    let v = r.json();
    assert!(v.get("system_fingerprint").is_none() && v["choices"][0].get("logprobs").is_none());
}
