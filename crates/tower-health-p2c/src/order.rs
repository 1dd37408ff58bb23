//! Ordering of sources per attempt: the policy's order, then in-call deprioritization.

use pgw_core::{AttemptRecord, CallHistory};
use rand::Rng;
use rand::rngs::SmallRng;

use crate::future::Plan;
use crate::sources::Entry;
use crate::{CREDIBLE_HEALTH_RATIO, DEPRIORITIZE_AFTER_FAILURES, HEALTH_INITIAL, Policy};

/// The most health a source can have: a success's sample. The EWMA of 0s and 1s stays
/// at or under it as long as it starts there.
const MAX_HEALTH: f64 = 1.0;
const _: () = assert!(
    HEALTH_INITIAL <= MAX_HEALTH,
    "health starts at or under a success's sample"
);

/// Two distinct random indices in `0..n` (n >= 2).
pub(crate) fn p2c_pair(rng: &mut SmallRng, n: usize) -> (usize, usize) {
    debug_assert!(n >= 2);
    let a = rng.random_range(0..n);
    let mut b = rng.random_range(0..n - 1);
    if b >= a {
        b += 1;
    }
    (a, b)
}

/// The health a source needs to be credible for `class`: [`CREDIBLE_HEALTH_RATIO`] x
/// the best source's (the load term ranks credible sources among themselves, it
/// never puts a failing idle source before a healthy busy one).
fn credible_bar<S>(entries: &[Entry<S>], class: usize) -> f64 {
    let best = entries.iter().map(|e| e.state.health(class)).fold(0.0, f64::max);
    CREDIBLE_HEALTH_RATIO * best
}

/// The ordering key of source `i`: credible first, then the score.
fn rank<S>(entries: &[Entry<S>], class: usize, bar: f64, i: usize) -> (bool, f64) {
    let state = &entries[i].state;
    (state.health(class) >= bar, state.score(class))
}

/// The first candidate of an attempt under `policy` (n >= 1): for `health_aware`, the
/// best-ranked of `choices` distinct random sources (see
/// [`BalanceConfig::choices`](crate::BalanceConfig::choices)). `cursor` is the shared
/// round-robin cursor, read only by that policy.
pub(crate) fn first<S>(
    policy: Policy,
    choices: usize,
    entries: &[Entry<S>],
    class: usize,
    rng: &mut SmallRng,
    cursor: impl FnOnce() -> usize,
) -> usize {
    let n = entries.len();
    if n == 1 {
        return 0;
    }
    match policy {
        Policy::HealthAware if choices > 2 => best_of(entries, class, rng, choices),
        Policy::HealthAware => {
            let (a, b) = p2c_pair(rng, n);
            // Health never exceeds MAX_HEALTH (an EWMA of 0s and 1s that starts at or
            // under 1), so the bar never exceeds CREDIBLE_HEALTH_RATIO x that: two
            // candidates at or above it are both credible, and the best source need not
            // be looked for.
            let least = entries[a].state.health(class).min(entries[b].state.health(class));
            let bar = if least >= CREDIBLE_HEALTH_RATIO * MAX_HEALTH {
                least
            } else {
                credible_bar(entries, class)
            };
            if rank(entries, class, bar, b) > rank(entries, class, bar, a) {
                b
            } else {
                a
            }
        }
        Policy::RoundRobin => cursor() % n,
        Policy::LeastInflight => {
            // A random starting point spreads ties.
            let start = rng.random_range(0..n);
            let mut best = start;
            let mut best_load = entries[start].state.inflight();
            for k in 1..n {
                let i = (start + k) % n;
                let load = entries[i].state.inflight();
                if load < best_load {
                    best = i;
                    best_load = load;
                }
            }
            best
        }
    }
}

/// The best-ranked of `choices` (> 2) distinct random sources of `entries` (n >= 2),
/// every source when `choices >= n`; of equally ranked ones, each as likely.
fn best_of<S>(entries: &[Entry<S>], class: usize, rng: &mut SmallRng, choices: usize) -> usize {
    let n = entries.len();
    let bar = credible_bar(entries, class);
    let mut best = 0;
    let mut best_rank = (false, f64::NEG_INFINITY);
    // How many drawn so far share the best rank.
    let mut ties = 0u32;
    let mut left = choices.min(n);
    for i in 0..n {
        if left == 0 {
            break;
        }
        // Selection sampling (Knuth's algorithm S): each source is drawn with
        // probability (still to draw) / (still to see), so exactly `left` are drawn,
        // uniformly, without a buffer. Drawing all needs no dice.
        if left < n - i && rng.random_range(0..n - i) >= left {
            continue;
        }
        left -= 1;
        let r = rank(entries, class, bar, i);
        if r > best_rank {
            (best, best_rank, ties) = (i, r, 1);
        } else if r == best_rank {
            // Reservoir sampling of one among the tied: the t-th keeps the place with
            // probability 1/t, so each of them ends first as often (sources never
            // measured, or alike under a paused clock, tie exactly).
            ties += 1;
            if rng.random_range(0..ties) == 0 {
                best = i;
            }
        }
    }
    best
}

/// The full order of an attempt that starts with `first`: the rest by descending score
/// (health_aware), in ring order (round_robin), or by ascending inflight
/// (least_inflight, ties in ring order).
pub(crate) fn full<S>(policy: Policy, entries: &[Entry<S>], class: usize, first: usize) -> Vec<usize> {
    let n = entries.len();
    let mut order: Vec<usize> = Vec::with_capacity(n);
    order.push(first);
    order.extend((1..n).map(|k| (first + k) % n));
    match policy {
        Policy::HealthAware => {
            let bar = credible_bar(entries, class);
            let mut rest: Vec<((bool, f64), usize)> = order[1..]
                .iter()
                .map(|&i| (rank(entries, class, bar, i), i))
                .collect();
            rest.sort_by(|x, y| y.0.0.cmp(&x.0.0).then(y.0.1.total_cmp(&x.0.1)));
            for (slot, (_, i)) in order[1..].iter_mut().zip(rest) {
                *slot = i;
            }
        }
        Policy::RoundRobin => {}
        Policy::LeastInflight => order[1..].sort_by_key(|&i| entries[i].state.inflight()),
    }
    order
}

/// The sources a request of `size` is known too large for (they refused one as large
/// within [`OVERSIZE_MEMORY`](crate::OVERSIZE_MEMORY)), by index: `None` when the
/// request has no size or no source is (no allocation then).
pub(crate) fn oversized<S>(entries: &[Entry<S>], size: Option<u64>) -> Option<Vec<bool>> {
    let size = size?;
    let first = entries.iter().position(|e| e.state.too_large_for(size))?;
    let mut marks = vec![false; entries.len()];
    for (i, e) in entries.iter().enumerate().skip(first) {
        marks[i] = i == first || e.state.too_large_for(size);
    }
    Some(marks)
}

/// The sources the request does not fit, by index: those it was too large for in this
/// call (`attempts`) and those known too large for its size (`oversized`).
pub(crate) fn too_large<S>(
    entries: &[Entry<S>],
    attempts: &[AttemptRecord],
    oversized: Option<&[bool]>,
) -> Vec<bool> {
    let mut marks = oversized.map_or_else(|| vec![false; entries.len()], <[bool]>::to_vec);
    for a in attempts.iter().filter(|a| a.too_large) {
        if let Some(i) = a.source.as_ref().and_then(|src| index_of(entries, src)) {
            marks[i] = true;
        }
    }
    marks
}

fn index_of<S>(entries: &[Entry<S>], source: &pgw_core::SourceId) -> Option<usize> {
    entries.iter().position(|e| e.state.id() == source)
}

/// The plan of a round that starts with `first`: that candidate alone (the fast path)
/// for a call with no attempt yet and no source known too large for it; else the full
/// order, [`deprioritize`]d by the call's attempts and the sources known too large.
pub(crate) fn plan<S>(
    policy: Policy,
    entries: &[Entry<S>],
    class: usize,
    first: usize,
    history: Option<&CallHistory>,
    oversized: Option<&[bool]>,
) -> Plan {
    if history.is_none() && oversized.is_none() {
        return Plan::First(first);
    }
    let attempts = history.map(CallHistory::attempts).unwrap_or_default();
    let mut full = full(policy, entries, class, first);
    let defer_at = deprioritize(policy, entries, class, &attempts, oversized, &mut full);
    Plan::Full(full, 0, defer_at)
}

/// In-call deprioritization: a source that failed `>= 2` times in this call (or
/// timed out once, or did not fit the request, in this call or as `oversized` marks
/// it) goes to the tail, with a health view
/// only when a credible alternative exists (a source not yet failed in this call whose
/// health is `>= 0.5 x` the failed one's). With a health view the order becomes: the
/// sources credible for the class, then those that only failed twice, then the poor
/// ones, then those that timed out or did not fit.
///
/// Returns the position where the deferred part starts: `order.len()` when no source
/// was tried enough; with a health view, the end of the credible sources.
pub(crate) fn deprioritize<S>(
    policy: Policy,
    entries: &[Entry<S>],
    class: usize,
    attempts: &[AttemptRecord],
    oversized: Option<&[bool]>,
    order: &mut Vec<usize>,
) -> usize {
    let mut fails = vec![0u32; entries.len()];
    let mut timed_out = vec![false; entries.len()];
    let too_large = too_large(entries, attempts, oversized);
    for a in attempts {
        let Some(i) = a.source.as_ref().and_then(|src| index_of(entries, src)) else {
            continue;
        };
        if a.outcome.health_sample() == Some(false) {
            fails[i] += 1;
            timed_out[i] |= a.timed_out;
        }
    }
    // A source that failed twice in this call, or timed out once (R1: retrying a
    // silent source multiplies the wait), is a candidate for the tail; one the request
    // does not fit goes there whatever the others' health.
    let tried_enough = |f: usize| fails[f] >= DEPRIORITIZE_AFTER_FAILURES || timed_out[f] || too_large[f];
    if !(0..entries.len()).any(tried_enough) {
        return order.len();
    }
    let to_tail = |f: usize| -> bool {
        if too_large[f] {
            return true;
        }
        if !tried_enough(f) {
            return false;
        }
        if !policy.has_health_view() {
            return true;
        }
        let bar = CREDIBLE_HEALTH_RATIO * entries[f].state.health(class);
        (0..entries.len()).any(|s| fails[s] == 0 && entries[s].state.health(class) >= bar)
    };
    let (tail, mut head): (Vec<usize>, Vec<usize>) = order.iter().partition(|&&i| to_tail(i));
    if policy.has_health_view() {
        // A source that only failed twice in this call goes behind the credible
        // sources, not behind those failing most calls of the class: it answers most
        // calls, a better next attempt than one that fails most (P6: a stream's third
        // attempt went to the source whose watchdog cuts nine streams in ten, while the
        // credible alternative was over quota and the twice-failed source waited). One
        // that timed out (R1) or that the request did not fit stays last.
        let bar = credible_bar(entries, class);
        let (credible, poor): (Vec<usize>, Vec<usize>) =
            head.iter().partition(|&&i| entries[i].state.health(class) >= bar);
        let (last, failed): (Vec<usize>, Vec<usize>) =
            tail.iter().partition(|&&i| timed_out[i] || too_large[i]);
        let defer_at = credible.len();
        *order = credible;
        order.extend(failed);
        order.extend(poor);
        order.extend(last);
        return defer_at;
    }
    let defer_at = head.len();
    head.extend(tail);
    *order = head;
    defer_at
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use pgw_core::{Outcome, SourceId};
    use rand::SeedableRng;

    use super::*;
    use crate::CHOICES_ALL;
    use crate::sources::SourceState;

    fn entries(healths: &[f64]) -> Vec<Entry<()>> {
        healths
            .iter()
            .enumerate()
            .map(|(i, &h)| {
                let state = Arc::new(SourceState::new(SourceId::from(format!("s{}", i + 1))));
                // Drive the EWMA down to about `h` with failures, then settle exactly
                // enough: (1 - alpha)^k <= h.
                while state.health(0) > h {
                    state.record(0, false);
                }
                Entry::new(state, ())
            })
            .collect()
    }

    #[test]
    fn p2c_puts_the_better_of_two_first_and_visits_every_source() {
        let es = entries(&[1.0, 0.7, 0.5, 0.3, 0.1]);
        let mut rng = SmallRng::seed_from_u64(7);
        let mut replay = SmallRng::seed_from_u64(7);
        let mut drawn = [0u32; 5];
        let mut firsts = [0u32; 5];
        for _ in 0..2000 {
            let f = first(Policy::HealthAware, 2, &es, 0, &mut rng, || 0);
            let (a, b) = p2c_pair(&mut replay, es.len());
            assert_ne!(a, b, "two distinct sources");
            let better = if es[a].state.score(0) >= es[b].state.score(0) {
                a
            } else {
                b
            };
            assert_eq!(f, better, "the better of the pair ({a}, {b}) goes first");
            drawn[a] += 1;
            drawn[b] += 1;
            firsts[f] += 1;
        }
        assert!(drawn.iter().all(|&d| d > 0), "every source drawn: {drawn:?}");
        assert_eq!(firsts[4], 0, "the worst is never first");
        assert!(firsts[..4].iter().all(|&f| f > 0), "{firsts:?}");
        // The full order continues by descending score.
        let order = full(Policy::HealthAware, &es, 0, 2);
        assert_eq!(order, vec![2, 0, 1, 3, 4]);
    }

    /// More choices: the best-ranked of `choices` distinct random sources goes first.
    /// Of six sources ranked by load, three drawn: the two worst never go first, the
    /// best does as often as it is drawn (half the time: 1 - C(5,3)/C(6,3)); all six
    /// drawn (or more asked): always the best, and of equally good ones each as often.
    #[test]
    fn more_choices_pick_the_best_of_more() {
        let es = entries(&[1.0; 6]);
        // Source i carries 5 - i attempts: the higher the index, the better the score.
        for (i, e) in es.iter().enumerate() {
            for _ in i..5 {
                e.state.inc(tokio::time::Instant::now());
            }
        }
        let mut rng = SmallRng::seed_from_u64(3);
        let mut firsts = [0u32; 6];
        for _ in 0..6000 {
            firsts[first(Policy::HealthAware, 3, &es, 0, &mut rng, || 0)] += 1;
        }
        assert_eq!(firsts[0] + firsts[1], 0, "{firsts:?}");
        assert!((2700..3300).contains(&firsts[5]), "{firsts:?}");
        assert!(firsts[2..5].iter().all(|&f| f > 0), "{firsts:?}");
        for choices in [6, 7, CHOICES_ALL] {
            assert!((0..100).all(|_| first(Policy::HealthAware, choices, &es, 0, &mut rng, || 0) == 5));
        }
        // Equally good sources share the first place evenly, wherever they sit (a
        // worse one before the first of them must not favour it).
        let tied = entries(&[0.2, 1.0, 1.0, 1.0, 0.2, 1.0]);
        let mut firsts = [0u32; 6];
        for _ in 0..8000 {
            firsts[first(Policy::HealthAware, CHOICES_ALL, &tied, 0, &mut rng, || 0)] += 1;
        }
        assert_eq!(firsts[0] + firsts[4], 0, "{firsts:?}");
        for i in [1, 2, 3, 5] {
            assert!((1800..2200).contains(&firsts[i]), "{firsts:?}");
        }
    }

    /// The pick that skips the best-health scan when both candidates are credible is
    /// the pick of the full rule (the bar from the best source), over pools of mixed
    /// health and load where either rule could decide.
    #[test]
    fn the_shortcut_picks_as_the_full_bar_does() {
        let mut draws = SmallRng::seed_from_u64(11);
        let mut shortcut = 0;
        for _ in 0..300 {
            let healths: Vec<f64> = (0..draws.random_range(2..7usize))
                .map(|_| draws.random_range(0.0..=1.0))
                .collect();
            let es = entries(&healths);
            for e in &es {
                for _ in 0..draws.random_range(0..6u32) {
                    e.state.inc(tokio::time::Instant::now());
                }
            }
            let seed = draws.random::<u64>();
            let picked = first(
                Policy::HealthAware,
                2,
                &es,
                0,
                &mut SmallRng::seed_from_u64(seed),
                || 0,
            );
            let (a, b) = p2c_pair(&mut SmallRng::seed_from_u64(seed), es.len());
            let bar = credible_bar(&es, 0);
            let full_rule = if rank(&es, 0, bar, b) > rank(&es, 0, bar, a) {
                b
            } else {
                a
            };
            assert_eq!(picked, full_rule, "healths {healths:?}, pair ({a}, {b})");
            if es[a].state.health(0).min(es[b].state.health(0)) >= CREDIBLE_HEALTH_RATIO {
                shortcut += 1;
            }
        }
        assert!(
            shortcut > 30 && shortcut < 270,
            "both rules ran: {shortcut} shortcuts"
        );
    }

    /// The score with credibility: the load term ranks credible sources among
    /// themselves; an idle source failing most calls never goes before a healthy busy
    /// one (by score alone, 0.1 / 1 beats 0.9 / 11).
    #[test]
    fn a_failing_idle_source_never_goes_before_a_healthy_busy_one() {
        let es = entries(&[0.9, 0.1, 0.8]);
        for _ in 0..10 {
            es[0].state.inc(tokio::time::Instant::now());
            es[2].state.inc(tokio::time::Instant::now());
        }
        assert!(
            es[1].state.score(0) > es[0].state.score(0),
            "the score alone prefers s2"
        );
        let mut rng = SmallRng::seed_from_u64(3);
        for _ in 0..200 {
            assert_ne!(first(Policy::HealthAware, 2, &es, 0, &mut rng, || 0), 1);
        }
        assert_eq!(full(Policy::HealthAware, &es, 0, 0), vec![0, 2, 1]);
        assert_eq!(full(Policy::HealthAware, &es, 0, 2), vec![2, 0, 1]);
        // Among credible sources the load still decides: s3 idle goes before busy s1.
        for _ in 0..10 {
            es[2].state.dec();
        }
        assert_eq!(
            full(Policy::HealthAware, &es, 0, 1),
            vec![1, 2, 0],
            "first stays first"
        );
    }

    /// The score's latency term: with equal health and load, the source that answers faster
    /// ranks first, by the ratio of the latencies against the load: one answering in
    /// half the time may carry one more call in flight and still go first. Only
    /// successes are timed: a source answering errors fast gains nothing.
    #[test]
    fn the_faster_source_ranks_first_at_equal_health_and_load() {
        use std::time::Duration;
        let es = entries(&[1.0, 1.0, 1.0]);
        es[0].state.sample_latency(Duration::from_secs(4));
        es[1].state.sample_latency(Duration::from_secs(2));
        es[2].state.sample_latency(Duration::from_secs(4));
        assert_eq!(full(Policy::HealthAware, &es, 0, 0), vec![0, 1, 2]);
        assert_eq!(full(Policy::HealthAware, &es, 0, 2), vec![2, 1, 0]);
        // s1 wins every p2c pair it is in (two in three); at equal scores a pair's
        // first draw would win, s1 one time in three.
        let mut rng = SmallRng::seed_from_u64(3);
        let wins = (0..300)
            .filter(|_| first(Policy::HealthAware, 2, &es, 0, &mut rng, || 0) == 1)
            .count();
        assert!(wins > 170, "s1 first {wins} times of 300");
        // Twice as fast, one more in flight: 1 / (2 x 2 s) = 1 / (1 x 4 s), a tie kept
        // in ring order; two more: the slow idle one goes first.
        es[1].state.inc(tokio::time::Instant::now());
        assert!((es[1].state.score(0) - es[0].state.score(0)).abs() < 1e-12);
        es[1].state.inc(tokio::time::Instant::now());
        assert!(es[1].state.score(0) < es[0].state.score(0));
        // A failure is not timed: the latency stays what the successes said.
        es[0].state.record(0, false);
        assert!((es[0].state.latency() - 4.0).abs() < 1e-9);
    }

    #[test]
    fn round_robin_and_least_inflight_orders() {
        let es = entries(&[1.0, 1.0, 1.0]);
        let mut rng = SmallRng::seed_from_u64(1);
        assert_eq!(first(Policy::RoundRobin, 2, &es, 0, &mut rng, || 4), 1);
        assert_eq!(full(Policy::RoundRobin, &es, 0, 1), vec![1, 2, 0]);
        es[0].state.inc(tokio::time::Instant::now());
        es[0].state.inc(tokio::time::Instant::now());
        es[2].state.inc(tokio::time::Instant::now());
        for _ in 0..20 {
            assert_eq!(first(Policy::LeastInflight, 2, &es, 0, &mut rng, || 0), 1);
        }
        assert_eq!(full(Policy::LeastInflight, &es, 0, 1), vec![1, 2, 0]);
    }

    /// One attempt's record: `src` answered `outcome` (`timed_out`, `too_large` as said).
    fn record(src: &str, outcome: Outcome, timed_out: bool, too_large: bool) -> AttemptRecord {
        AttemptRecord {
            source: Some(src.into()),
            outcome,
            timed_out,
            too_large,
            status: None,
        }
    }

    fn failed(src: &str, times: usize) -> Vec<AttemptRecord> {
        (0..times)
            .map(|_| record(src, Outcome::Transient, false, false))
            .collect()
    }

    /// One timeout is enough to move the next attempt to a credible other source;
    /// one other failure is not.
    #[test]
    fn a_timeout_moves_the_next_attempt_elsewhere() {
        let es = entries(&[0.83, 0.1, 0.9]);
        let timeout = vec![record("s1", Outcome::Transient, true, false)];
        let mut order = vec![0, 2, 1];
        deprioritize(Policy::HealthAware, &es, 0, &timeout, None, &mut order);
        assert_eq!(order, vec![2, 1, 0], "s1 timed out: the credible s3 goes first");
        let mut order = vec![0, 2, 1];
        deprioritize(Policy::HealthAware, &es, 0, &failed("s1", 1), None, &mut order);
        assert_eq!(order, vec![0, 2, 1], "one plain failure keeps s1 first");
        // Without a credible alternative the timed-out source stays where it is.
        let es = entries(&[0.83, 0.1]);
        let mut order = vec![0, 1];
        deprioritize(Policy::HealthAware, &es, 0, &timeout, None, &mut order);
        assert_eq!(order, vec![0, 1]);
        // A request too large for s1 sends it to the tail even so: it cannot serve it.
        let too_large = vec![record("s1", Outcome::Rejected, false, true)];
        let mut order = vec![0, 1];
        deprioritize(Policy::HealthAware, &es, 0, &too_large, None, &mut order);
        assert_eq!(order, vec![1, 0]);
    }

    /// A healthy source that failed twice stays first when the
    /// only alternative is a 10% source, and goes to the tail when a credible one exists.
    #[test]
    fn deprioritization_needs_a_credible_alternative() {
        // s1 healthy (0.83), s2 the 10% watchdog source.
        let es = entries(&[0.83, 0.1]);
        let mut order = vec![0, 1];
        deprioritize(Policy::HealthAware, &es, 0, &failed("s1", 2), None, &mut order);
        assert_eq!(order, vec![0, 1], "no credible alternative: s1 stays first");

        let es = entries(&[0.83, 0.1, 0.9]);
        let mut order = vec![0, 2, 1];
        deprioritize(Policy::HealthAware, &es, 0, &failed("s1", 2), None, &mut order);
        assert_eq!(
            order,
            vec![2, 0, 1],
            "credible s3: s1 behind it, but before the 10% s2"
        );
        // Behind every credible source, and a timed-out source behind the poor ones.
        let es = entries(&[0.83, 0.1, 0.9, 0.7, 0.2]);
        let mut order = vec![0, 1, 2, 3, 4];
        let mut hist = failed("s1", 2);
        hist.push(record("s4", Outcome::Transient, true, false));
        let defer_at = deprioritize(Policy::HealthAware, &es, 0, &hist, None, &mut order);
        assert_eq!(order, vec![2, 0, 1, 4, 3]);
        assert_eq!(defer_at, 1, "only the credible s3 goes before the deferred");

        // One failure is not enough; Invalid and Rejected are not failures.
        let mut order = vec![0, 2, 1];
        let mut hist = failed("s1", 1);
        hist.push(record("s1", Outcome::Invalid, false, false));
        deprioritize(Policy::HealthAware, &es, 0, &hist, None, &mut order);
        assert_eq!(order, vec![0, 2, 1]);

        // A candidate that already failed once in this call is not credible.
        let es = entries(&[0.83, 0.9]);
        let mut hist = failed("s1", 2);
        hist.extend(failed("s2", 1));
        let mut order = vec![0, 1];
        deprioritize(Policy::HealthAware, &es, 0, &hist, None, &mut order);
        assert_eq!(order, vec![0, 1]);

        // Without a health view: unconditional.
        for policy in [Policy::RoundRobin, Policy::LeastInflight] {
            let es = entries(&[0.83, 0.1]);
            let mut order = vec![0, 1];
            deprioritize(policy, &es, 0, &failed("s1", 2), None, &mut order);
            assert_eq!(order, vec![1, 0], "{policy}");
        }
    }
}
