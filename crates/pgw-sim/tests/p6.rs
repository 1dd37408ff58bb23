//! The P6 pool under a naive client, on the paused clock: determinism, ground truth
//! per source, and the wall time of a simulated hour.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Seen, call};
use pgw_sim::config::{P6_ASSUMED_INTER_TOKEN_WATCHDOG_S, P6_SHARED_KEY};
use pgw_sim::p6::{Kind, Traffic, TrafficConfig};
use pgw_sim::{PoolConfig, SimPool};
use tokio::task::JoinSet;
use tokio::time::Instant;

const SOURCES: [&str; 5] = ["s1", "s2", "s3", "s4", "s5"];
const TOTAL_TIMEOUT: Duration = Duration::from_secs(120);

fn key(source: &str) -> &'static str {
    match source {
        "s2" => "sk-sim-revoked",
        "s3" => "sk-sim-black-hole",
        _ => P6_SHARED_KEY,
    }
}

/// One call as the naive client saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Row {
    index: usize,
    kind: Kind,
    source: &'static str,
    /// `200`, a status, `-1` timeout, `-2` watchdog cut.
    outcome: i32,
    content_len: usize,
    finished_at_ms: u128,
}

/// Round robin over the five sources, one attempt per call, `workers` in flight,
/// stopping after `until` of virtual time (or when the traffic runs out).
async fn naive_run(
    seed: u64,
    traffic: TrafficConfig,
    workers: usize,
    until: Duration,
) -> (SimPool, Vec<Row>) {
    let pool = SimPool::new(PoolConfig::p6(), seed).unwrap();
    let traffic = Arc::new(Mutex::new(Traffic::with_config(traffic, seed)));
    let start = Instant::now();
    let watchdog = Duration::from_secs_f64(P6_ASSUMED_INTER_TOKEN_WATCHDOG_S);
    let mut set = JoinSet::new();
    for _ in 0..workers {
        let pool = pool.clone();
        let traffic = Arc::clone(&traffic);
        set.spawn(async move {
            let mut rows = Vec::new();
            loop {
                if start.elapsed() >= until {
                    break;
                }
                let Some(item) = traffic.lock().unwrap().next() else {
                    break;
                };
                let source = SOURCES[item.index % SOURCES.len()];
                let mut svc = pool.service(source).unwrap();
                let seen = call(
                    &mut svc,
                    &item.request,
                    Some(key(source)),
                    TOTAL_TIMEOUT,
                    watchdog,
                )
                .await;
                let (outcome, content_len) = match &seen {
                    Seen::Answer { resp, .. } => (200, resp.content().len()),
                    Seen::Status { status, .. } => (i32::from(*status), 0),
                    Seen::TimedOut => (-1, 0),
                    Seen::Cut => (-2, 0),
                };
                rows.push(Row {
                    index: item.index,
                    kind: item.kind,
                    source,
                    outcome,
                    content_len,
                    finished_at_ms: start.elapsed().as_millis(),
                });
            }
            rows
        });
    }
    let mut rows = Vec::new();
    while let Some(r) = set.join_next().await {
        rows.extend(r.unwrap());
    }
    rows.sort_by_key(|r| r.index);
    (pool, rows)
}

#[tokio::test(start_paused = true)]
async fn the_same_seed_gives_the_identical_outcome_sequence() {
    // Small P2 prompts: determinism does not depend on their size, and debug builds
    // of serde_json are slow on 300 KB strings.
    let t = TrafficConfig {
        calls: 600,
        large_prompt_bytes: 3_000,
        ..TrafficConfig::default()
    };
    let (_, a) = naive_run(3, t.clone(), 64, Duration::MAX).await;
    let (_, b) = naive_run(3, t.clone(), 64, Duration::MAX).await;
    let (_, c) = naive_run(4, t, 64, Duration::MAX).await;
    assert_eq!(a.len(), 600);
    assert_eq!(a, b, "same seed, same outcomes, same instants");
    assert_ne!(a, c, "another seed, another run");
}

/// All 8000 P6 calls (full-size 300 KB P2 prompts) under a naive client with 64 in
/// flight; the calls finished within the first simulated hour are judged per source.
/// Prints the wall time: a release build takes a few seconds, a debug build is slower
/// (serde_json on 300 KB strings dominates).
#[tokio::test(start_paused = true)]
async fn a_simulated_hour_of_the_p6_pool_takes_seconds() {
    let wall = std::time::Instant::now();
    let (pool, all) = naive_run(2026, TrafficConfig::default(), 64, Duration::MAX).await;
    let wall = wall.elapsed();
    let hour_ms = 3_600_000;
    let rows: Vec<Row> = all
        .iter()
        .filter(|r| r.finished_at_ms <= hour_ms)
        .cloned()
        .collect();
    let end_s = all.iter().map(|r| r.finished_at_ms).max().unwrap_or(0) as f64 / 1000.0;
    println!(
        "P6: {} calls in the first simulated hour, all {} calls in {end_s:.0} simulated s; wall time {:.2}s",
        rows.len(),
        all.len(),
        wall.as_secs_f64()
    );
    assert_eq!(all.len(), 8000);
    assert!(rows.len() >= 1000, "{} calls in an hour", rows.len());

    let mut by: BTreeMap<(&str, i32), usize> = BTreeMap::new();
    for r in &rows {
        *by.entry((r.source, r.outcome)).or_default() += 1;
    }
    println!("first hour, calls by (source, outcome): {by:?}");
    let count = |s: &str, o: i32| by.get(&(s, o)).copied().unwrap_or(0);
    let on = |s: &str| rows.iter().filter(|r| r.source == s).count();
    // s2: 401 on every call; s3: only timeouts.
    assert_eq!(count("s2", 401), on("s2"));
    assert_eq!(count("s3", -1), on("s3"));
    let st = pool.stats();
    // s4: its own gate never lets more than 5 requests per minute through.
    let s4 = &st.sources["s4"];
    println!(
        "s4: {} received, {} answered 429 by its 5/min gate",
        s4.received, s4.rate_limited
    );
    let s4_ok = s4.answered_total() - s4.rate_limited;
    assert!(s4_ok as f64 <= 5.0 * (end_s / 60.0 + 1.0), "{s4_ok}");
    // s5: the 8 s watchdog cuts ~90% of the streams it gets an answer for.
    let s5_streams: Vec<_> = all
        .iter()
        .filter(|r| r.source == "s5" && r.kind == Kind::LongStream && matches!(r.outcome, 200 | -2))
        .collect();
    let cut = s5_streams.iter().filter(|r| r.outcome == -2).count();
    common::assert_rate(
        "s5 streams cut by an 8 s watchdog",
        cut,
        s5_streams.len(),
        0.9,
        0.06,
    );
    // s1: 429s from the shared account, ~15% empty completions.
    let s1 = &st.sources["s1"];
    println!(
        "s1: {} received, {} 429s, {} empty of {} 200s; account acct-a peak in flight {}",
        s1.received,
        s1.rate_limited,
        s1.empty_completions,
        s1.answered_with(200),
        st.accounts["acct-a"].peak_in_flight
    );
    assert!(s1.rate_limited > 0);
    common::assert_rate(
        "s1 empty completions",
        s1.empty_completions as usize,
        s1.answered_with(200) as usize,
        0.15,
        0.03,
    );
    assert_eq!(st.received(), 8000);
    let arrivals: usize = SOURCES.iter().map(|n| st.sources[*n].arrivals.len()).sum();
    assert_eq!(arrivals, 8000);
    assert_eq!(st.in_flight(), 0, "every request ended");
}
