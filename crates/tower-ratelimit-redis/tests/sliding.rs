//! The provider's sense of a quota, on every backend: any sequence of admissions (at
//! random times, of random token sizes, settled with usage above or below the
//! estimate, refunded, dropped) never puts more than the quota into any span of the
//! window's length, judged on the admission instants the limiter reports.
//!
//! Memory runs under the paused clock; Redis (standalone and the 3-node cluster) on
//! the server clock, so its gaps are real time (a few short cases: the server clock
//! cannot be paused). The check knows nothing of sub-windows: it is the invariant a
//! provider counting "N per minute" over any minute would apply.
//!
//! What a span holds: every admission in it that was not refunded, at its estimate or
//! its real usage when that was lower, plus every overrun (usage above the estimate)
//! settled between two admissions of the span. Such an overrun landed inside the span
//! before its last admission, which therefore had to count it. An overrun settled
//! after the span's last admission cannot be refused by anyone: it is the provider's
//! real usage.

mod common;

use std::time::Duration;

use common::Harness;
use pgw_core::QuotaExceeded;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use tower_ratelimit_redis::{Permit, Quota, RateLimiter};

const WINDOW: Duration = Duration::from_millis(300);
/// 10 sub-windows of 30 ms.
const SUB_WINDOWS: u32 = 10;
const SUB: Duration = Duration::from_millis(30);

#[derive(Clone, Debug)]
enum Op {
    Admit { source: usize, tokens: u64 },
    Finish { idx: usize, used: Option<u64> },
    Refund { idx: usize },
    Drop { idx: usize },
    Gap { ms: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..2usize, 0..70u64).prop_map(|(source, tokens)| Op::Admit { source, tokens }),
        3 => (any::<usize>(), proptest::option::of(0..140u64)).prop_map(|(idx, used)| Op::Finish { idx, used }),
        1 => any::<usize>().prop_map(|idx| Op::Refund { idx }),
        1 => any::<usize>().prop_map(|idx| Op::Drop { idx }),
        3 => (0..90u64).prop_map(|ms| Op::Gap { ms }),
    ]
}

/// Scopes: 0 = the account, 1 = s1, 2 = s2 (both sources in the account).
fn quotas() -> [Quota; 3] {
    [
        Quota::unlimited().requests(6).tokens(200).concurrency(4),
        Quota::unlimited().requests(4).tokens(120),
        Quota::unlimited().requests(3),
    ]
}

/// One admission as the check sees it.
#[derive(Debug)]
struct Admitted {
    seq: usize,
    at: Duration,
    source: usize,
    /// What it still counts for after its settle: (requests, tokens).
    counts: (u64, u64),
}

/// Tokens used beyond an admission's estimate, settled at step `seq`.
#[derive(Debug)]
struct Overrun {
    seq: usize,
    source: usize,
    tokens: u64,
}

/// Whether `source`'s admissions draw on `scope`.
const fn draws_on(source: usize, scope: usize) -> bool {
    scope == 0 || scope == source + 1
}

/// The first span (start, requests, tokens) over a quota, if any: every span that
/// starts at an admission (a span's contents only grow when its start moves right to
/// its first admission, so those are the fullest).
fn over_quota(q: &[Quota; 3], adm: &[Admitted], over: &[Overrun]) -> Option<String> {
    for (scope, quota) in q.iter().enumerate() {
        let mine: Vec<&Admitted> = adm.iter().filter(|a| draws_on(a.source, scope)).collect();
        for start in &mine {
            let span: Vec<&&Admitted> = mine
                .iter()
                .filter(|a| a.at >= start.at && a.at < start.at + WINDOW)
                .collect();
            let first = span.iter().map(|a| a.seq).min().unwrap_or(0);
            let last = span.iter().map(|a| a.seq).max().unwrap_or(0);
            let requests: u64 = span.iter().map(|a| a.counts.0).sum();
            let overrun: u64 = over
                .iter()
                .filter(|o| draws_on(o.source, scope) && o.seq > first && o.seq < last)
                .map(|o| o.tokens)
                .sum();
            let tokens = span.iter().map(|a| a.counts.1).sum::<u64>() + overrun;
            if quota.requests.is_some_and(|r| requests > r) || quota.tokens.is_some_and(|t| tokens > t) {
                return Some(format!(
                    "scope {scope}: span from {:?} holds {requests} requests, {tokens} tokens ({overrun} overrun) against {quota:?}",
                    start.at
                ));
            }
        }
    }
    None
}

struct Live {
    permit: Permit,
    index: usize,
    tokens: u64,
}

async fn run(h: Harness, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let q = quotas();
    let limiters: Vec<RateLimiter> = ["s1", "s2"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            h.limiter(
                h.config(name, q[i + 1])
                    .account("acct", q[0])
                    .window(WINDOW)
                    .sub_windows(SUB_WINDOWS),
            )
        })
        .collect();
    assert_eq!(limiters[0].config().sub_window_len(), SUB);
    let mut adm: Vec<Admitted> = Vec::new();
    let mut over: Vec<Overrun> = Vec::new();
    let mut live: Vec<Live> = Vec::new();
    for (seq, op) in ops.into_iter().enumerate() {
        match op {
            Op::Gap { ms } => tokio::time::sleep(Duration::from_millis(ms)).await,
            Op::Admit { source, tokens } => match limiters[source].acquire(tokens).await {
                Ok(permit) => {
                    adm.push(Admitted {
                        seq,
                        at: permit.admission().at(),
                        source,
                        counts: (1, tokens),
                    });
                    live.push(Live {
                        permit,
                        index: adm.len() - 1,
                        tokens,
                    });
                }
                Err(e) => {
                    let q = e
                        .downcast_ref::<QuotaExceeded>()
                        .ok_or_else(|| TestCaseError::fail(format!("not a refusal: {e}")))?;
                    // Everything counted now has left the span a window and a
                    // sub-window from now; a slot is a polling hint.
                    let bound = match q.dimension() {
                        "concurrency" => tower_ratelimit_redis::DEFAULT_SLOT_RETRY_AFTER,
                        _ => WINDOW + SUB,
                    };
                    prop_assert!(!q.retry_after().is_zero() && q.retry_after() <= bound, "{}", q);
                }
            },
            Op::Finish { idx, used } if !live.is_empty() => {
                let l = live.swap_remove(idx % live.len());
                if let Some(u) = used {
                    adm[l.index].counts.1 = u.min(l.tokens);
                    if u > l.tokens {
                        over.push(Overrun {
                            seq,
                            source: adm[l.index].source,
                            tokens: u - l.tokens,
                        });
                    }
                }
                l.permit.finish(used).await.unwrap();
            }
            Op::Refund { idx } if !live.is_empty() => {
                let l = live.swap_remove(idx % live.len());
                adm[l.index].counts = (0, 0);
                l.permit.refund().await.unwrap();
            }
            Op::Drop { idx } if !live.is_empty() => drop(live.swap_remove(idx % live.len()).permit),
            _ => {}
        }
    }
    if let Some(v) = over_quota(&q, &adm, &over) {
        return Err(TestCaseError::fail(format!(
            "{v}\nadmissions {adm:?}\noverruns {over:?}"
        )));
    }
    // Nothing leaks, and once everything has left the span every source admits again.
    for l in live.drain(..) {
        l.permit.finish(None).await.unwrap();
    }
    for l in &limiters {
        prop_assert_eq!(l.held().await.unwrap().leases(), 0);
    }
    tokio::time::sleep(WINDOW + SUB * 2).await;
    for l in &limiters {
        let p = l.acquire(0).await;
        prop_assert!(p.is_ok(), "{:?}", p.err().map(|e| e.to_string()));
    }
    Ok(())
}

fn check(cases: u32, rt: &tokio::runtime::Runtime, harness: impl Fn() -> Harness) {
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new(config)
        .run(&proptest::collection::vec(op(), 1..60), |ops| {
            rt.block_on(run(harness(), ops))
        })
        .unwrap();
}

#[test]
fn memory_never_over_quota_in_any_span() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    check(256, &rt, Harness::memory);
}

fn redis_case(target: impl Fn() -> pgw_core::redis_conn::RedisTarget) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    check(16, &rt, || rt.block_on(Harness::redis(target(), "sliding")));
}

#[test]
fn redis_standalone_never_over_quota_in_any_span() {
    redis_case(common::standalone);
}

#[test]
fn redis_cluster_never_over_quota_in_any_span() {
    redis_case(common::cluster);
}

/// The check catches a fixed-window limiter: two admissions at the end of one window
/// and two at the start of the next fit every aligned window of RPM 2 and are four in
/// one span.
#[test]
fn the_check_catches_a_fixed_window() {
    let q = [
        Quota::unlimited(),
        Quota::unlimited().requests(2),
        Quota::unlimited(),
    ];
    let at = |ms| Duration::from_millis(ms);
    let adm: Vec<Admitted> = [280, 290, 300, 310]
        .into_iter()
        .enumerate()
        .map(|(seq, ms)| Admitted {
            seq,
            at: at(ms),
            source: 0,
            counts: (1, 0),
        })
        .collect();
    assert!(over_quota(&q, &adm[..2], &[]).is_none());
    assert!(over_quota(&q, &adm, &[]).unwrap().contains("4 requests"));
}
