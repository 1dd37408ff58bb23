//! Every behaviour of the fault model shows up at its configured rate, on the paused
//! clock. Tolerances are about 3.5 standard deviations of a binomial over the number
//! of calls, so a correct simulator fails them about once in several thousand runs
//! per seed; the seeds are fixed, so the outcome is deterministic.

mod common;

use std::time::Duration;

use common::{Seen, assert_rate, call};
use pgw_core::openai::ChatRequest;
use pgw_sim::p6::is_valid_structured;
use pgw_sim::{
    AccountConfig, LogNormal, PoolConfig, RateLimitCurve, RetryAfterConfig, SimPool, SourceConfig,
    StallConfig,
};
use serde_json::json;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower_service::Service;

const LONG: Duration = Duration::from_secs(3600);

fn pool(sources: Vec<SourceConfig>, accounts: Vec<AccountConfig>, bad_prompt_rate: f64) -> SimPool {
    let config = PoolConfig {
        sources,
        accounts,
        bad_prompt_rate,
        ..PoolConfig::default()
    };
    SimPool::new(config, 11).unwrap()
}

/// Runs `n` calls on `source` concurrently, request `i` built by `make(i)`.
async fn run_many(
    pool: &SimPool,
    source: &str,
    n: usize,
    key: Option<&'static str>,
    make: impl Fn(usize) -> ChatRequest,
) -> Vec<Seen> {
    let mut set = JoinSet::new();
    for i in 0..n {
        let mut svc = pool.service(source).unwrap();
        let req = make(i);
        set.spawn(async move { (i, call(&mut svc, &req, key, LONG, LONG).await) });
    }
    let mut out = vec![Seen::TimedOut; n];
    while let Some(r) = set.join_next().await {
        let (i, seen) = r.unwrap();
        out[i] = seen;
    }
    out
}

fn chat(i: usize) -> ChatRequest {
    let mut r = ChatRequest::user("m", format!("question number {i}"));
    r.max_tokens = Some(300);
    r
}

#[tokio::test(start_paused = true)]
async fn healthy_completions_empty_5xx_and_usage_at_their_rates() {
    let src = SourceConfig {
        empty_rate: 0.15.into(),
        server_error_rate: 0.05.into(),
        ..SourceConfig::healthy("a")
    };
    let p = pool(vec![src.clone()], vec![], 0.0);
    let n = 4000;
    let seen = run_many(&p, "a", n, None, chat).await;
    let s5xx = seen
        .iter()
        .filter(|s| matches!(s.status(), Some(500 | 502 | 503)))
        .count();
    assert_rate("5xx", s5xx, n, 0.05, 0.012);
    let answers: Vec<_> = seen
        .iter()
        .filter_map(|s| match s {
            Seen::Answer { resp, to_headers, .. } => Some((resp, *to_headers)),
            _ => None,
        })
        .collect();
    assert_eq!(answers.len() + s5xx, n, "only 200s and 5xx expected");
    let empty = answers.iter().filter(|(r, _)| r.is_empty_completion()).count();
    assert_rate("empty completions among 200s", empty, answers.len(), 0.15, 0.02);
    for (r, _) in &answers {
        let u = r.usage.as_ref().expect("usage in every answer");
        assert_eq!(u.total_tokens, u.prompt_tokens + u.completion_tokens);
        assert!(u.prompt_tokens > 0);
        if r.is_empty_completion() {
            assert_eq!(u.completion_tokens, 0);
        } else {
            // 0.2..0.9 of max_tokens 300.
            assert!((60..=270).contains(&u.completion_tokens), "{u:?}");
            assert_eq!(r.content().split(' ').count() as u64, u.completion_tokens);
        }
    }
    // Non-streamed latency = TTFT + generation: at least the TTFT's median on median.
    let mut lat: Vec<f64> = answers.iter().map(|(_, d)| d.as_secs_f64()).collect();
    lat.sort_by(f64::total_cmp);
    let median = lat[lat.len() / 2];
    println!("non-streamed latency median {median:.1}s");
    assert!((12.0..20.0).contains(&median), "{median}");
    let st = p.stats();
    assert_eq!(st.sources["a"].received, n as u64);
    assert_eq!(st.sources["a"].empty_completions, empty as u64);
    assert_eq!(st.in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn streams_ttft_gaps_stalls_and_invalid_json_at_their_rates() {
    let src = SourceConfig {
        invalid_json_rate: 0.1.into(),
        stall: StallConfig {
            rate: 0.3,
            min_gap_s: 20.0,
            max_gap_s: 40.0,
        }
        .into(),
        ttft_s: LogNormal {
            median: 5.0,
            p95: 15.0,
            min: 0.1,
            max: 60.0,
        }
        .into(),
        ..SourceConfig::healthy("a")
    };
    let p = pool(vec![src], vec![], 0.0);
    let n = 3000;
    let seen = run_many(&p, "a", n, None, |i| {
        let mut r = chat(i);
        r.stream = true;
        r.max_tokens = Some(1000);
        if i % 2 == 0 {
            r.extra
                .insert("response_format".into(), json!({"type": "json_object"}));
        }
        r
    })
    .await;
    let mut ttft = Vec::new();
    let (mut stalled, mut invalid, mut json_n) = (0, 0, 0);
    for (i, s) in seen.iter().enumerate() {
        let Seen::Answer {
            resp,
            to_headers,
            max_gap,
            frames,
        } = s
        else {
            panic!("call {i}: {s:?}");
        };
        assert!(*frames >= 2 && *frames <= 48, "{frames} frames");
        ttft.push(to_headers.as_secs_f64());
        if *max_gap >= Duration::from_secs(20) {
            stalled += 1;
        } else {
            // Healthy gaps: a frame groups <= ~21 tokens at >= 20 tokens/s, jittered x1.5.
            assert!(*max_gap < Duration::from_secs(2), "{max_gap:?}");
        }
        let u = resp.usage.as_ref().expect("usage chunk");
        assert_eq!(
            u.completion_tokens as usize,
            if i % 2 == 0 {
                u.completion_tokens as usize
            } else {
                resp.content().split(' ').count()
            }
        );
        if i % 2 == 0 {
            json_n += 1;
            invalid += usize::from(!is_valid_structured(resp.content()));
        }
    }
    assert_rate("stalled streams", stalled, n, 0.3, 0.03);
    assert_rate(
        "invalid JSON among JSON-mode answers",
        invalid,
        json_n,
        0.1,
        0.025,
    );
    ttft.sort_by(f64::total_cmp);
    let (p50, p95) = (ttft[n / 2], ttft[n * 95 / 100]);
    println!("TTFT p50 {p50:.2}s p95 {p95:.2}s (configured 5 / 15)");
    assert!((4.5..5.5).contains(&p50) && (13.0..17.0).contains(&p95));
    let st = &p.stats().sources["a"];
    assert_eq!(st.stalled, stalled as u64);
    assert_eq!(st.invalid_json, invalid as u64);
    assert_eq!(st.streams_completed, n as u64);
    assert_eq!(st.in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn bad_key_and_revoked_key_get_401() {
    let keyed = SourceConfig {
        api_key: Some("sk-good".into()),
        ..SourceConfig::healthy("keyed")
    };
    let revoked = SourceConfig {
        revoked: true.into(),
        ..SourceConfig::healthy("revoked")
    };
    let p = pool(vec![keyed, revoked], vec![], 0.0);
    let bad = run_many(&p, "keyed", 20, Some("sk-bad"), chat).await;
    let none = run_many(&p, "keyed", 5, None, chat).await;
    let good = run_many(&p, "keyed", 20, Some("sk-good"), chat).await;
    let rev = run_many(&p, "revoked", 50, Some("sk-good"), chat).await;
    assert!(
        bad.iter()
            .chain(&none)
            .chain(&rev)
            .all(|s| s.status() == Some(401))
    );
    assert!(good.iter().all(|s| s.status() == Some(200)));
    let Seen::Status { body, .. } = &rev[0] else {
        unreachable!()
    };
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(v["error"]["code"], "invalid_api_key");
    assert_eq!(p.stats().sources["revoked"].answered_with(401), 50);
}

#[tokio::test(start_paused = true)]
async fn black_hole_never_answers_until_the_callers_timeout() {
    let src = SourceConfig {
        black_hole_rate: 1.0.into(),
        ..SourceConfig::healthy("hole")
    };
    let p = pool(vec![src], vec![], 0.0);
    let mut svc = p.service("hole").unwrap();
    let fut = svc.call(common::request(&chat(0), None));
    let started = Instant::now();
    let mut fut = Box::pin(fut);
    // A whole simulated day passes: still nothing.
    let r = tokio::time::timeout(Duration::from_secs(86_400), &mut fut).await;
    assert!(r.is_err(), "a black hole answered");
    assert_eq!(started.elapsed(), Duration::from_secs(86_400));
    assert_eq!(p.stats().sources["hole"].in_flight, 1);
    drop(fut);
    let st = &p.stats().sources["hole"];
    assert_eq!(
        (st.in_flight, st.dropped_before_answer, st.black_holed),
        (0, 1, 1)
    );
    assert_eq!(st.answered_total(), 0);
}

#[tokio::test(start_paused = true)]
async fn black_hole_rate_is_a_fraction() {
    let src = SourceConfig {
        black_hole_rate: 0.25.into(),
        ..SourceConfig::healthy("a")
    };
    let p = pool(vec![src], vec![], 0.0);
    let n = 4000;
    let mut set = JoinSet::new();
    for i in 0..n {
        let mut svc = p.service("a").unwrap();
        set.spawn(async move { call(&mut svc, &chat(i), None, Duration::from_secs(300), LONG).await });
    }
    let mut timed_out = 0;
    while let Some(r) = set.join_next().await {
        timed_out += usize::from(r.unwrap() == Seen::TimedOut);
    }
    assert_rate("black-holed", timed_out, n, 0.25, 0.025);
    assert_eq!(p.stats().in_flight(), 0);
}

#[tokio::test(start_paused = true)]
async fn bad_prompts_are_rejected_by_every_source_on_every_attempt() {
    let p = pool(
        vec![SourceConfig::healthy("a"), SourceConfig::healthy("b")],
        vec![],
        0.05,
    );
    let n = 4000;
    let make = |i: usize| ChatRequest::user("m", format!("prompt {i} about things"));
    let a = run_many(&p, "a", n, None, make).await;
    let b = run_many(&p, "b", n, None, make).await;
    let again = run_many(&p, "a", n, None, make).await;
    let rejected = |v: &[Seen]| -> Vec<usize> {
        v.iter()
            .enumerate()
            .filter(|(_, s)| s.status() == Some(400))
            .map(|(i, _)| i)
            .collect()
    };
    let ra = rejected(&a);
    assert_rate("400 bad prompts", ra.len(), n, 0.05, 0.012);
    assert_eq!(ra, rejected(&b), "another source rejects the same prompts");
    assert_eq!(ra, rejected(&again), "a retry is rejected again");
    assert!(a.iter().all(|s| matches!(s.status(), Some(200 | 400))));
}

fn account(curve: RateLimitCurve, ra_rate: f64) -> AccountConfig {
    AccountConfig {
        name: "acct".into(),
        rate_limit: curve.into(),
        retry_after: RetryAfterConfig {
            rate: ra_rate,
            min_s: 2,
            max_s: 9,
        }
        .into(),
        ..AccountConfig::default()
    }
}

#[tokio::test(start_paused = true)]
async fn account_429_on_one_source_is_caused_by_traffic_on_another() {
    let curve = RateLimitCurve {
        concurrency_knee: 2.0,
        concurrency_slope: 0.02,
        max: 0.9,
        ..RateLimitCurve::default()
    };
    let a = SourceConfig::healthy("a").in_account("acct");
    // The sibling never answers: its requests stay in flight on the account.
    let b = SourceConfig {
        black_hole_rate: 1.0.into(),
        ..SourceConfig::healthy("b").in_account("acct")
    };
    let p = pool(vec![a, b], vec![account(curve, 0.5)], 0.0);

    // Alone, one call at a time: the account never pushes back.
    let mut svc = p.service("a").unwrap();
    for i in 0..300 {
        assert_eq!(
            call(&mut svc, &chat(i), None, LONG, LONG).await.status(),
            Some(200)
        );
    }
    assert_eq!(p.stats().accounts["acct"].rate_limited, 0);

    // 32 requests parked on the sibling: 30 above the knee -> p = 0.6 on `a`.
    let mut parked = Vec::new();
    let mut sib = p.service("b").unwrap();
    for i in 0..32 {
        parked.push(Box::pin(sib.call(common::request(&chat(i), None))));
    }
    let n = 2000;
    let (mut limited, mut with_ra) = (0, 0);
    for i in 0..n {
        match call(&mut svc, &chat(i), None, LONG, LONG).await {
            Seen::Status {
                status: 429,
                retry_after,
                body,
            } => {
                limited += 1;
                if let Some(ra) = retry_after {
                    with_ra += 1;
                    assert!((2..=9).contains(&ra.parse::<u64>().unwrap()), "{ra}");
                }
                assert!(body.contains("rate_limit_exceeded"), "{body}");
            }
            s => assert_eq!(s.status(), Some(200)),
        }
    }
    assert_rate("429 on a caused by b", limited, n, 0.6, 0.04);
    assert_rate("429s with retry-after", with_ra, limited, 0.5, 0.05);
    let st = p.stats();
    assert_eq!(st.sources["a"].rate_limited, limited as u64);
    assert_eq!(st.sources["b"].rate_limited, 0);
    assert_eq!(st.accounts["acct"].rate_limited, limited as u64);
    assert_eq!(st.accounts["acct"].sources, vec!["a".to_owned(), "b".to_owned()]);

    // The sibling's traffic goes away: so do the 429s.
    drop(parked);
    assert_eq!(p.stats().accounts["acct"].in_flight, 0);
    for i in 0..200 {
        assert_eq!(
            call(&mut svc, &chat(i), None, LONG, LONG).await.status(),
            Some(200)
        );
    }
}

#[tokio::test(start_paused = true)]
async fn account_429_grows_with_the_accounts_request_rate() {
    let curve = RateLimitCurve {
        rpm_knee: 60.0,
        rpm_slope: 0.005,
        max: 0.9,
        ..RateLimitCurve::default()
    };
    let fast = |name: &str| SourceConfig {
        ttft_s: LogNormal::constant(0.5).into(),
        tokens_per_second: LogNormal::constant(1000.0).into(),
        ..SourceConfig::healthy(name).in_account("acct")
    };
    let p = pool(vec![fast("a"), fast("b")], vec![account(curve, 0.0)], 0.0);
    let mut a = p.service("a").unwrap();
    let mut b = p.service("b").unwrap();
    // One request every 1.2 s on each: 100/min on the account -> p = 0.2.
    let (mut n_a, mut limited_a, mut without_ra) = (0, 0, 0);
    for i in 0..3000 {
        let start = Instant::now();
        let req = chat(i);
        let (ra, _) = tokio::join!(
            call(&mut a, &req, None, LONG, LONG),
            call(&mut b, &req, None, LONG, LONG)
        );
        if i >= 100 {
            n_a += 1;
            if let Seen::Status {
                status: 429,
                retry_after,
                ..
            } = ra
            {
                limited_a += 1;
                without_ra += usize::from(retry_after.is_none());
            }
        }
        tokio::time::sleep_until(start + Duration::from_millis(1200)).await;
    }
    assert_rate("429 at 100 requests/min", limited_a, n_a, 0.2, 0.03);
    assert_eq!(without_ra, limited_a, "retry_after.rate 0: no header");
    assert!(p.stats().sources["b"].rate_limited > 0);
}

#[tokio::test(start_paused = true)]
async fn a_sources_own_rpm_gate_answers_429_with_retry_after() {
    let src = SourceConfig {
        rpm_gate: Some(5).into(),
        ..SourceConfig::healthy("s4")
    };
    let p = pool(vec![src], vec![], 0.0);
    let first = run_many(&p, "s4", 12, None, chat).await;
    let ok = first.iter().filter(|s| s.status() == Some(200)).count();
    assert_eq!(ok, 5);
    for s in first.iter().filter(|s| s.status() == Some(429)) {
        let Seen::Status { retry_after, .. } = s else {
            unreachable!()
        };
        let ra: u64 = retry_after.as_deref().unwrap().parse().unwrap();
        assert!((1..=60).contains(&ra), "{ra}");
    }
    tokio::time::sleep(Duration::from_secs(61)).await;
    let later = run_many(&p, "s4", 5, None, chat).await;
    assert!(later.iter().all(|s| s.status() == Some(200)));
    let st = &p.stats().sources["s4"];
    assert_eq!(st.rate_limited, 7);
    assert_eq!(st.max_arrivals_in(Duration::from_secs(60)), 12);
}

#[tokio::test(start_paused = true)]
async fn dropping_a_stream_midway_is_counted_and_frees_the_slot() {
    use http_body_util::BodyExt;
    let p = pool(vec![SourceConfig::healthy("a")], vec![], 0.0);
    let mut svc = p.service("a").unwrap();
    let mut req = chat(0);
    req.stream = true;
    let resp = svc.call(common::request(&req, None)).await.unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.data_ref().unwrap().starts_with(b"data: {"));
    assert_eq!(p.stats().sources["a"].in_flight, 1);
    drop(body);
    let st = &p.stats().sources["a"];
    assert_eq!(
        (st.in_flight, st.streams_dropped, st.streams_completed),
        (0, 1, 0)
    );
    assert_eq!(p.stats().accounts["a"].in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn unparseable_body_is_a_400() {
    let p = pool(vec![SourceConfig::healthy("a")], vec![], 0.0);
    let mut svc = p.service("a").unwrap();
    let req = http::Request::post("/")
        .body(bytes::Bytes::from_static(b"{not json"))
        .unwrap();
    let resp = svc.call(req).await.unwrap();
    assert_eq!(resp.status(), 400);
    assert!(resp.headers().contains_key("x-request-id"));
    assert!(p.service("nope").is_none());
}

#[test]
fn config_from_toml_uses_documented_defaults() {
    let toml = r#"
        bad_prompt_rate = 0.01
        [[sources]]
        name = "x"
        empty_rate = 0.2
        [sources.stall]
        rate = 0.5
    "#;
    let c: PoolConfig = toml::from_str(toml).unwrap();
    c.validate().unwrap();
    assert_eq!(c.sources[0].empty_rate, 0.2.into());
    let stall = c.sources[0].stall.as_constant().unwrap();
    assert_eq!(stall.rate, 0.5);
    assert_eq!(stall.min_gap_s, 20.0);
    assert_eq!(c.sources[0].ttft_s, SourceConfig::default().ttft_s);
    assert_eq!(c.max_stream_frames, 48);
    let typo: Result<PoolConfig, _> = toml::from_str("[[sources]]\nname = \"x\"\nempty_rat = 0.2\n");
    assert!(typo.unwrap_err().to_string().contains("empty_rat"));
}

#[tokio::test(start_paused = true)]
async fn time_scale_shortens_latencies_gate_window_and_retry_after() {
    let src = SourceConfig {
        rpm_gate: Some(5).into(),
        ttft_s: LogNormal::constant(12.0).into(),
        ..SourceConfig::healthy("s4")
    };
    let config = PoolConfig {
        sources: vec![src],
        bad_prompt_rate: 0.0,
        time_scale: 1.0 / 60.0,
        ..PoolConfig::default()
    };
    let p = SimPool::new(config, 11).unwrap();
    let first = run_many(&p, "s4", 12, None, chat).await;
    for s in first.iter().filter(|s| s.status() == Some(200)) {
        let Seen::Answer { to_headers, .. } = s else {
            unreachable!()
        };
        // A 12 s TTFT lasts 0.2 s at 1/60 (plus the scaled generation of a
        // non-streamed answer); unscaled it would be at least 12 s.
        assert!(
            *to_headers >= Duration::from_millis(200) && *to_headers < Duration::from_secs(1),
            "{to_headers:?}"
        );
    }
    assert_eq!(first.iter().filter(|s| s.status() == Some(200)).count(), 5);
    for s in first.iter().filter(|s| s.status() == Some(429)) {
        let Seen::Status { retry_after, .. } = s else {
            unreachable!()
        };
        // Decimal seconds: at most one scaled minute.
        let ra: f64 = retry_after.as_deref().unwrap().parse().unwrap();
        assert!(ra > 0.0 && ra <= 1.0, "{ra}");
    }
    // The gate's minute lasts one second.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let later = run_many(&p, "s4", 5, None, chat).await;
    assert!(later.iter().all(|s| s.status() == Some(200)));
    let bad = PoolConfig {
        time_scale: 0.0,
        ..PoolConfig::p6()
    };
    assert_eq!(bad.validate().unwrap_err().field(), "time_scale");
}
