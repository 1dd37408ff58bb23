//! Random interleavings of admissions, completions (reconciled up or down), refunds,
//! drops, crashes (forgotten permits), holds and clock advances, on the memory
//! backend: the limiter decides exactly as a reference model of the quotas (a sliding
//! window counted per sub-window), and so never admits more than the quota of any
//! dimension in any span of a window's length.

use std::collections::HashMap;
use std::time::Duration;

use proptest::prelude::*;
use tower_ratelimit_redis::{HoldScope, MemoryBackend, Permit, Quota, RateLimitConfig, RateLimiter};

const WINDOW_MS: u64 = 1000;
/// The default 60 sub-windows of a 1 s window: 100 of 10 ms.
const SUB_MS: u64 = 10;
const SUBS: u64 = WINDOW_MS / SUB_MS;
const TTL_MS: u64 = 500;

#[derive(Clone, Debug)]
enum Op {
    Admit { source: usize, tokens: u64 },
    Finish { idx: usize, used: Option<u64> },
    Refund { idx: usize },
    Drop { idx: usize },
    Forget { idx: usize },
    Hold { source: usize, account: bool, ms: u64 },
    Advance { ms: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3usize, 0..70u64).prop_map(|(source, tokens)| Op::Admit { source, tokens }),
        2 => (any::<usize>(), proptest::option::of(0..90u64)).prop_map(|(idx, used)| Op::Finish { idx, used }),
        1 => any::<usize>().prop_map(|idx| Op::Refund { idx }),
        1 => any::<usize>().prop_map(|idx| Op::Drop { idx }),
        1 => any::<usize>().prop_map(|idx| Op::Forget { idx }),
        1 => (0..3usize, any::<bool>(), 1..400u64).prop_map(|(source, account, ms)| Op::Hold { source, account, ms }),
        3 => (0..600u64).prop_map(|ms| Op::Advance { ms }),
    ]
}

/// Scopes: 0 = account, 1..=3 = sources s1, s2 (both in the account), s3 (alone).
fn quotas() -> [Quota; 4] {
    [
        Quota::unlimited().requests(5).tokens(150).concurrency(3),
        Quota::unlimited().requests(4).tokens(100).concurrency(2),
        Quota::unlimited().requests(3).concurrency(1),
        Quota::unlimited().requests(2).tokens(50),
    ]
}

fn scopes_of(source: usize) -> Vec<usize> {
    if source == 2 { vec![3] } else { vec![0, source + 1] }
}

#[derive(Default)]
struct ScopeModel {
    /// (requests, tokens) per sub-window.
    windows: HashMap<u64, (u64, u64)>,
    /// Lease expiry (ms) per live permit id.
    leases: HashMap<usize, u64>,
    hold_until: u64,
}

struct Held {
    permit: Permit,
    id: usize,
    source: usize,
    /// The sub-window of admission.
    sub: u64,
    tokens: u64,
}

impl ScopeModel {
    /// Requests and tokens in the sub-windows live at `now` (ms): `now / SUB_MS - SUBS`
    /// and later.
    fn live(&self, now: u64) -> (u64, u64) {
        let oldest = (now / SUB_MS).saturating_sub(SUBS);
        self.windows
            .iter()
            .filter(|&(&b, _)| b >= oldest)
            .fold((0, 0), |(r, t), (_, &(br, bt))| (r + br, t + bt))
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async move {
        let backend = MemoryBackend::new();
        let q = quotas();
        let limiters: Vec<RateLimiter> = ["s1", "s2", "s3"]
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let mut c = RateLimitConfig::new(*name, q[i + 1])
                    .window(Duration::from_millis(WINDOW_MS))
                    .lease_ttl(Duration::from_millis(TTL_MS));
                if i < 2 {
                    c = c.account("acct", q[0]);
                }
                RateLimiter::new(c, backend.clone()).unwrap()
            })
            .collect();
        let mut model: Vec<ScopeModel> = (0..4).map(|_| ScopeModel::default()).collect();
        let mut held: Vec<Held> = Vec::new();
        let mut now = 0u64;
        let mut next_id = 0usize;
        // Refunds go back to the sub-window of admission, never below zero; charges
        // to the sub-window the settle lands in.
        let release = |model: &mut Vec<ScopeModel>, h: &Held, requests: i64, tokens: i64, now: u64| {
            for s in scopes_of(h.source) {
                let e = model[s].windows.entry(h.sub).or_default();
                if requests < 0 {
                    e.0 = e.0.saturating_sub(requests.unsigned_abs());
                }
                if tokens < 0 {
                    e.1 = e.1.saturating_sub(tokens.unsigned_abs());
                }
                if tokens > 0 {
                    model[s].windows.entry(now / SUB_MS).or_default().1 += tokens as u64;
                }
                model[s].leases.remove(&h.id);
            }
        };
        for op in ops {
            match op {
                Op::Advance { ms } => {
                    tokio::time::advance(Duration::from_millis(ms)).await;
                    now += ms;
                }
                Op::Admit { source, tokens } => {
                    let w = now / WINDOW_MS;
                    let sub = now / SUB_MS;
                    let scopes = scopes_of(source);
                    let too_large = scopes.iter().any(|&s| q[s].tokens.is_some_and(|t| tokens > t));
                    let fits = !too_large
                        && scopes.iter().all(|&s| {
                            let m = &model[s];
                            let (r, t) = m.live(now);
                            let live = m.leases.values().filter(|&&exp| exp > now).count() as u64;
                            m.hold_until <= now
                                && q[s].requests.is_none_or(|max| r < max)
                                && q[s].tokens.is_none_or(|max| t + tokens <= max)
                                && q[s].concurrency.is_none_or(|max| live < max)
                        });
                    let got = limiters[source].acquire(tokens).await;
                    prop_assert_eq!(
                        got.is_ok(),
                        fits,
                        "source {} tokens {} at {}ms: {:?}",
                        source,
                        tokens,
                        now,
                        got.as_ref().err().map(ToString::to_string)
                    );
                    if let Ok(permit) = got {
                        prop_assert_eq!(permit.admission().window(), w);
                        let id = next_id;
                        next_id += 1;
                        for &s in &scopes {
                            let e = model[s].windows.entry(sub).or_default();
                            e.0 += 1;
                            e.1 += tokens;
                            // The invariant itself: never more than the quota in the
                            // live sub-windows, which cover the span ending now.
                            let (r, t) = model[s].live(now);
                            prop_assert!(q[s].requests.is_none_or(|max| r <= max));
                            prop_assert!(q[s].tokens.is_none_or(|max| t <= max));
                            if q[s].concurrency.is_some() {
                                model[s].leases.insert(id, now + TTL_MS);
                                let live = model[s].leases.values().filter(|&&exp| exp > now).count() as u64;
                                prop_assert!(q[s].concurrency.is_none_or(|max| live <= max));
                            }
                        }
                        held.push(Held {
                            permit,
                            id,
                            source,
                            sub,
                            tokens,
                        });
                    }
                }
                Op::Finish { idx, used } if !held.is_empty() => {
                    let h = held.swap_remove(idx % held.len());
                    let delta = used.map_or(0, |u| u as i64 - h.tokens as i64);
                    release(&mut model, &h, 0, delta, now);
                    h.permit.finish(used).await.unwrap();
                }
                Op::Refund { idx } if !held.is_empty() => {
                    let h = held.swap_remove(idx % held.len());
                    release(&mut model, &h, -1, -(h.tokens as i64), now);
                    h.permit.refund().await.unwrap();
                }
                Op::Drop { idx } if !held.is_empty() => {
                    let h = held.swap_remove(idx % held.len());
                    release(&mut model, &h, 0, 0, now);
                    drop(h.permit);
                }
                Op::Forget { idx } if !held.is_empty() => {
                    // A crash: the lease stays until its TTL.
                    let h = held.swap_remove(idx % held.len());
                    h.permit.forget();
                }
                Op::Hold { source, account, ms } => {
                    let which = if account {
                        HoldScope::Account
                    } else {
                        HoldScope::Source
                    };
                    let targets: Vec<usize> = match (source, account) {
                        (2, _) => vec![3],
                        (_, true) => vec![0],
                        (s, false) => vec![s + 1],
                    };
                    for t in targets {
                        model[t].hold_until = model[t].hold_until.max(now + ms);
                    }
                    limiters[source]
                        .hold(which, Duration::from_millis(ms))
                        .await
                        .unwrap();
                }
                _ => {}
            }
        }
        // Nothing leaks: everything released and a window later, every scope admits.
        for h in held.drain(..) {
            h.permit.finish(None).await.unwrap();
        }
        tokio::time::advance(Duration::from_millis(WINDOW_MS + SUB_MS + TTL_MS + 400)).await;
        for l in &limiters {
            prop_assert!(l.acquire(0).await.is_ok());
        }
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn never_over_quota(ops in proptest::collection::vec(op(), 1..120)) {
        run(ops)?;
    }
}
