//! The scoreboard: judges one profile's stored telemetry.
//!
//! It reads only the rows ([`ProfileRun`]), never the live client, so `--rescore RUN`
//! re-judges a stored run with exactly the same code. Quotas are judged as the limiter
//! enforces them (anything else gives false violations): by **admission instant** on the
//! **limiter's clock** (the run's tokio clock), **excluding cache hits** (they never
//! pass a gate), over **every span** of a quota's window length, as a provider counts
//! "N per minute" over any minute: aligned windows alone miss a fixed-window limiter's
//! burst across a window edge (up to twice the quota in one span).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use serde::Serialize;

use crate::telemetry::{CallRow, ProfileRun, QuotaRule};
use crate::timing::{Timing, timing};

/// Failure causes no client can avoid: the provider rejects the prompt itself (about
/// 0.5% of P6 prompts), filters its answer or refuses it. The
/// caller got the provider's verdict; a client that retried it elsewhere and ended
/// with another cause did not deliver it.
pub const UNRECOVERABLE_CAUSES: [&str; 4] = ["rejected", "http_400", "content_filter", "refusal"];
/// Calls before this fraction of the run are warm-up for the RSS judgement.
const RSS_WARMUP_FRACTION: f64 = 0.25;
/// Allowed relative growth of current RSS from the run's middle to its end.
const RSS_GROWTH_RATIO: f64 = 0.25;
/// Allowed absolute growth of current RSS from the run's middle to its end, KiB.
const RSS_GROWTH_SLACK_KIB: u64 = 16 * 1024;

/// One judged invariant.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Check {
    /// Short name (`success rate`, `quotas`, ...).
    pub name: &'static str,
    /// Whether it passed.
    pub pass: bool,
    /// Whether a failure fails the run (informational checks do not).
    pub gating: bool,
    /// What was measured.
    pub detail: String,
}

impl Check {
    /// How the scoreboard shows it: `PASS` or `FAIL` for a gating check, `info` for
    /// another, whatever it measured (its detail says; a baseline's "success rate
    /// PASS" at 28% read as a verdict).
    #[must_use]
    pub const fn label(&self) -> &'static str {
        match (self.gating, self.pass) {
            (true, true) => "PASS",
            (true, false) => "FAIL",
            (false, _) => "info",
        }
    }
}

/// One run of overlapping spans where a quota was exceeded, by its fullest span.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// The quota's scope (`source s4`).
    pub scope: String,
    /// `rpm` or `tpm`.
    pub dimension: String,
    /// Start of the fullest span (any instant: a span of the window's length starting
    /// at an admission), ms since the run started.
    pub window_start_ms: u64,
    /// What was admitted in that span.
    pub used: u64,
    /// The limit.
    pub limit: u64,
}

/// The verdict on one profile's run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Score {
    /// The profile.
    pub profile: String,
    /// Calls run.
    pub calls: u64,
    /// Calls that returned a valid answer.
    pub ok: u64,
    /// `ok / calls`.
    pub success_rate: f64,
    /// Calls the provider rejected as bad requests (400: no client can make them pass).
    pub rejected: u64,
    /// `ok / (calls - rejected)`: the success of the calls a client could succeed.
    pub recoverable_success_rate: f64,
    /// Failed calls by cause.
    pub failed_by_cause: BTreeMap<String, u64>,
    /// Upstream attempts (cache hits excluded).
    pub attempts: u64,
    /// Cache hits.
    pub cache_hits: u64,
    /// Upstream attempts per call.
    pub attempts_per_call: f64,
    /// Upstream attempts per source, pool order.
    pub attempts_by_source: Vec<(String, u64)>,
    /// Attempt outcomes by name.
    pub outcomes: BTreeMap<String, u64>,
    /// Upstream attempts the provider answered with a request error (the request's
    /// fault: a wrong model, a context too long, a content policy, another 400).
    pub request_errors: u64,
    /// Of those, the attempts the client counted against the source: outcome
    /// `transient` (a breaker failure) or `source_dead` (forces the breaker open).
    /// A breaker opens only on such an outcome, so this bounds the breakers opened
    /// by request errors from above: 0 means none was.
    pub request_errors_against_source: u64,
    /// Every run of overlapping spans where a quota was exceeded.
    pub violations: Vec<Violation>,
    /// Success rate per scenario minute (by the call's end), `(minute, calls, ok)`.
    pub success_by_minute: Vec<(u64, u64, u64)>,
    /// The judged invariants, and for the pgw profile its bars against the oracle
    /// ([`crate::acceptance::judge`], once every profile of the run is judged).
    pub checks: Vec<Check>,
    /// Scenario time of the run, ms.
    pub scenario_ms: u64,
    /// Wall time of the run, ms.
    pub wall_ms: u64,
    /// Current RSS at the end of the run, KiB.
    pub rss_end_kib: u64,
    /// What the run cost in time: goodput, latency percentiles, time to first token.
    pub timing: Timing,
    /// How the calls after the pool was known dead ended, when the scenario asks.
    pub fail_fast: Option<FailFast>,
}

impl Score {
    /// Whether every gating check passed (for pgw, its bars against the oracle too,
    /// once [`crate::acceptance::judge`] has added them).
    #[must_use]
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.pass || !c.gating)
    }

    /// The check named `name`.
    #[must_use]
    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }
}

/// What the scoreboard expects of a profile beyond the invariants every profile must hold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Expectations {
    /// Calls the run was asked to make.
    pub calls: u64,
    /// Success bar: gating when `Some` (pgw: 0.99).
    pub success_bar: Option<f64>,
    /// Informational band for the calibration (`naive`: 0.50..=0.65).
    pub success_band: Option<(f64, f64)>,
    /// Whether "0 breakers opened by request errors" gates the verdict (pgw on a
    /// scenario that asks for it, `provider-quirks`); informational otherwise.
    pub request_errors_gate: bool,
    /// When `Some` (pgw on a pool where nothing can answer, `all-dead`): the calls
    /// arriving this many ms into the run or later are counted by [`FailFast`], and a
    /// check (shown, not gating) says whether each failed in under
    /// [`FAIL_FAST_WITHIN_MS`] as `all_circuits_open` (every source known dead, with
    /// the time until one may be tried again).
    pub fail_fast_after_ms: Option<u64>,
}

/// How fast a call to a pool known to be dead must fail (issue 12: "under 1 s").
pub const FAIL_FAST_WITHIN_MS: u64 = 1_000;
/// The cause of a call refused because every source's circuit is open
/// (`tower_retry_pushback::Reason::AllCircuitsOpen`, which always carries a
/// `retry_after`).
const ALL_CIRCUITS_OPEN: &str = "all_circuits_open";

/// Judges one run.
#[must_use]
pub fn judge(run: &ProfileRun, expect: &Expectations) -> Score {
    let calls = run.calls.len() as u64;
    let ok = run.calls.iter().filter(|c| c.ok).count() as u64;
    let success_rate = ratio(ok, calls);
    let rejected = run
        .calls
        .iter()
        .filter(|c| !c.ok && UNRECOVERABLE_CAUSES.contains(&c.cause.as_str()))
        .count() as u64;
    let mut failed_by_cause = BTreeMap::new();
    for c in run.calls.iter().filter(|c| !c.ok) {
        *failed_by_cause.entry(c.cause.clone()).or_insert(0) += 1;
    }
    let upstream: Vec<_> = run.attempts.iter().filter(|a| !a.cache_hit).collect();
    let attempts = upstream.len() as u64;
    let cache_hits = run.attempts.len() as u64 - attempts;
    let by_source = attempts_by_source(run);
    let mut outcomes = BTreeMap::new();
    for a in &upstream {
        *outcomes.entry(a.outcome.clone()).or_insert(0) += 1;
    }

    let mut checks = Vec::new();
    checks.push(success_check(success_rate, ok, calls, expect));
    if let Some((lo, hi)) = expect.success_band {
        let inside = (lo..=hi).contains(&success_rate);
        checks.push(Check {
            name: "calibration band",
            pass: inside,
            gating: false,
            detail: format!(
                "{:.1}%, {} [{:.0}%, {:.0}%]",
                success_rate * 100.0,
                if inside { "inside" } else { "outside" },
                lo * 100.0,
                hi * 100.0
            ),
        });
    }
    let (request_errors, request_errors_against_source) = request_errors(run);
    checks.push(request_error_check(
        request_errors,
        request_errors_against_source,
        expect.request_errors_gate,
    ));
    let violations = quota_violations(run);
    checks.push(quota_check(&violations, &run.quotas));
    checks.push(rows_check(run, &by_source));
    checks.push(ids_check(run, expect.calls));
    checks.push(accounting_check(run));
    checks.push(rss_check(run));
    let fail_fast = expect.fail_fast_after_ms.map(|after| {
        let f = FailFast::of(run, after);
        checks.push(f.check(after));
        f
    });

    Score {
        profile: run.profile.clone(),
        calls,
        ok,
        success_rate,
        rejected,
        recoverable_success_rate: ratio(ok, calls - rejected),
        failed_by_cause,
        attempts,
        cache_hits,
        attempts_per_call: ratio(attempts, calls),
        attempts_by_source: by_source,
        outcomes,
        request_errors,
        request_errors_against_source,
        violations,
        success_by_minute: success_by_minute(run),
        checks,
        scenario_ms: run.scenario_ms,
        wall_ms: run.wall_ms,
        rss_end_kib: run.rss.last().map_or(0, |s| s.rss_kib),
        timing: timing(run),
        fail_fast,
    }
}

#[allow(clippy::cast_precision_loss)] // counts far below 2^52
fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

fn success_check(rate: f64, ok: u64, calls: u64, expect: &Expectations) -> Check {
    let detail = format!("{ok}/{calls} = {:.2}%", rate * 100.0);
    match expect.success_bar {
        Some(bar) => Check {
            name: "success rate",
            pass: rate >= bar,
            gating: true,
            detail: format!("{detail} (bar {:.1}%)", bar * 100.0),
        },
        None => Check {
            name: "success rate",
            pass: true,
            gating: false,
            detail,
        },
    }
}

/// How the calls after a pool is known dead ended: [`Expectations::fail_fast_after_ms`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct FailFast {
    /// Calls that arrived at `after_ms` or later.
    pub calls: u64,
    /// Of those, the calls that failed within [`FAIL_FAST_WITHIN_MS`] as
    /// `all_circuits_open`.
    pub fast: u64,
    /// The longest of those calls, ms.
    pub longest_ms: u64,
}

impl FailFast {
    fn of(run: &ProfileRun, after_ms: u64) -> Self {
        let late = || run.calls.iter().filter(|c| c.started_ms >= after_ms);
        let took = |c: &CallRow| c.ended_ms.saturating_sub(c.started_ms);
        Self {
            calls: late().count() as u64,
            fast: late()
                .filter(|c| !c.ok && c.cause == ALL_CIRCUITS_OPEN && took(c) < FAIL_FAST_WITHIN_MS)
                .count() as u64,
            longest_ms: late().map(took).max().unwrap_or(0),
        }
    }

    /// Shown, not gating: a call that takes a dead source's half-open breaker probe
    /// waits for that attempt's answer (a revoked key's 401, up to seconds in the
    /// simulator). The report says how many did.
    fn check(self, after_ms: u64) -> Check {
        Check {
            name: "fails fast once all are dead",
            pass: self.calls > 0 && self.fast == self.calls,
            gating: false,
            detail: format!(
                "{} of {} calls from {:.0} s on failed in < {FAIL_FAST_WITHIN_MS} ms as \
                 {ALL_CIRCUITS_OPEN} (longest {} ms)",
                self.fast,
                self.calls,
                Duration::from_millis(after_ms).as_secs_f64(),
                self.longest_ms
            ),
        }
    }
}

/// Where a quota rule was exceeded, by admission instant, cache hits excluded: every
/// span `[t, t + window)` that starts at an admission is judged (a span that starts
/// elsewhere holds no more than the one starting at its first admission). Spans over
/// the quota that overlap are one [`Violation`], reported by the fullest of them.
#[must_use]
pub fn quota_violations(run: &ProfileRun) -> Vec<Violation> {
    let mut out = Vec::new();
    for rule in &run.quotas {
        let w = rule.window_ms.max(1);
        let mut rows: Vec<(u64, u64)> = run
            .attempts
            .iter()
            .filter(|a| !a.cache_hit && rule.sources.contains(&a.source))
            .map(|a| (a.admitted_ms, if rule.dimension == "tpm" { a.tokens } else { 1 }))
            .collect();
        rows.sort_unstable();
        let violation = |start: u64, used: u64| Violation {
            scope: rule.scope.clone(),
            dimension: rule.dimension.clone(),
            window_start_ms: start,
            used,
            limit: rule.limit,
        };
        // Two pointers: rows[i..end] is the span starting at rows[i], `used` its sum.
        // The span is measured from its start (`t - start < w`, rows are sorted), so a
        // row at `u64::MAX` is in its own span; the sum is a u128, so no stored token
        // count can overflow it.
        let (mut end, mut used) = (0, 0u128);
        let mut run_of: Option<Violation> = None;
        for &(start, add) in &rows {
            while end < rows.len() && rows[end].0 - start < w {
                used += u128::from(rows[end].1);
                end += 1;
            }
            if used > u128::from(rule.limit) {
                let used = u64::try_from(used).unwrap_or(u64::MAX);
                match &mut run_of {
                    Some(v) if start - v.window_start_ms < w => {
                        if used > v.used {
                            *v = violation(start, used);
                        }
                    }
                    _ => out.extend(run_of.replace(violation(start, used))),
                }
            }
            used -= u128::from(add);
        }
        out.extend(run_of);
    }
    out
}

/// The outcomes whose breaker verdict is a failure or a forced open.
const COUNTED_AGAINST_SOURCE: [&str; 2] = ["transient", "source_dead"];

/// Upstream attempts answered with a request error, and how many of them the client
/// counted against the source.
fn request_errors(run: &ProfileRun) -> (u64, u64) {
    let errors: Vec<_> = run
        .attempts
        .iter()
        .filter(|a| !a.cache_hit && a.request_error)
        .collect();
    let against = errors
        .iter()
        .filter(|a| COUNTED_AGAINST_SOURCE.contains(&a.outcome.as_str()))
        .count();
    (errors.len() as u64, against as u64)
}

/// Every request a source received has its upstream row, and no row names a request
/// the source never saw: the quota check judges the rows, so a request sent without
/// one would go unjudged. Against the simulator's own count
/// ([`ProfileRun::provider_received`]); not measured where it is not kept.
/// Upstream attempts (cache hits excluded) per source: the pool's sources first, in
/// their order (0 for one never asked), then any other name a row carries.
fn attempts_by_source(run: &ProfileRun) -> Vec<(String, u64)> {
    let mut by_source: Vec<(String, u64)> = run.sources.iter().map(|s| (s.clone(), 0)).collect();
    for a in run.attempts.iter().filter(|a| !a.cache_hit) {
        match by_source.iter_mut().find(|(s, _)| *s == a.source) {
            Some((_, n)) => *n += 1,
            None => by_source.push((a.source.clone(), 1)),
        }
    }
    by_source
}

/// `by_source`: the run's [`attempts_by_source`].
fn rows_check(run: &ProfileRun, by_source: &[(String, u64)]) -> Check {
    let name = "every upstream request recorded";
    if run.provider_received.is_empty() {
        return Check {
            name,
            pass: true,
            gating: false,
            detail: "not measured (the simulator is not in this process)".into(),
        };
    }
    let mut off = Vec::new();
    for (source, &received) in &run.provider_received {
        let recorded = by_source.iter().find(|(s, _)| s == source).map_or(0, |&(_, n)| n);
        if recorded != received {
            off.push(format!("{source}: {recorded} rows, {received} received"));
        }
    }
    off.extend(
        by_source
            .iter()
            .filter(|(source, n)| *n > 0 && !run.provider_received.contains_key(source))
            .map(|(source, n)| format!("{source}: {n} rows, no such source")),
    );
    let total: u64 = run.provider_received.values().sum();
    Check {
        name,
        pass: off.is_empty(),
        gating: true,
        detail: if off.is_empty() {
            format!("{total} requests received, each with its row")
        } else {
            off.join("; ")
        },
    }
}

fn request_error_check(errors: u64, against: u64, gating: bool) -> Check {
    Check {
        name: "0 breakers opened by request errors",
        pass: against == 0,
        gating,
        detail: format!(
            "{against} of {errors} request errors counted against a source \
             (a breaker opens only on those)"
        ),
    }
}

fn quota_check(violations: &[Violation], rules: &[QuotaRule]) -> Check {
    let detail = if violations.is_empty() {
        format!("0 violations over {} quota rules", rules.len())
    } else {
        let mut by: BTreeMap<(String, String), (u64, u64, u64)> = BTreeMap::new();
        for v in violations {
            let e = by
                .entry((v.scope.clone(), v.dimension.clone()))
                .or_insert((0, 0, v.limit));
            e.0 += 1;
            e.1 = e.1.max(v.used);
        }
        by.iter()
            .map(|((scope, dim), (n, worst, limit))| {
                format!("{scope} {dim}: {n} spans over (worst {worst} > {limit})")
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    Check {
        name: "quotas never exceeded",
        pass: violations.is_empty(),
        gating: true,
        detail,
    }
}

fn ids_check(run: &ProfileRun, expected: u64) -> Check {
    let mut seen = HashSet::with_capacity(run.calls.len());
    let dups = run
        .calls
        .iter()
        .filter(|c| !seen.insert(c.call_id.as_str()))
        .count();
    let orphans = run
        .attempts
        .iter()
        .filter(|a| !seen.contains(a.call_id.as_str()))
        .count();
    let mut per_call: HashMap<&str, Vec<u32>> = HashMap::new();
    for a in &run.attempts {
        per_call.entry(a.call_id.as_str()).or_default().push(a.attempt);
    }
    let mut repeated_attempt_no = 0;
    for v in per_call.values_mut() {
        v.sort_unstable();
        if v.windows(2).any(|w| w[0] == w[1]) {
            repeated_attempt_no += 1;
        }
    }
    let n = run.calls.len() as u64;
    Check {
        name: "call ids unique",
        pass: dups == 0 && orphans == 0 && repeated_attempt_no == 0 && n == expected,
        gating: true,
        detail: format!(
            "{n}/{expected} calls, {dups} duplicate ids, {orphans} attempts of unknown calls, \
             {repeated_attempt_no} calls with a repeated attempt number"
        ),
    }
}

/// Fails on what is really left (`counters`); what failed to settle and was left to
/// its TTL by design (`expired_by_ttl`) is shown, never judged.
fn accounting_check(run: &ProfileRun) -> Check {
    let acc = &run.accounting;
    let nonzero = |m: &BTreeMap<String, u64>| -> Vec<String> {
        m.iter()
            .filter(|&(_, &v)| v != 0)
            .map(|(k, v)| format!("{k} = {v}"))
            .collect()
    };
    let left = nonzero(&acc.counters);
    let expired = nonzero(&acc.expired_by_ttl);
    let judged = if acc.counters.is_empty() {
        "no accounting reported".to_owned()
    } else if left.is_empty() {
        format!("{} counters all zero", acc.counters.len())
    } else {
        left.join(", ")
    };
    let detail = if expired.is_empty() {
        judged
    } else {
        format!("{judged}; expired by TTL (not judged): {}", expired.join(", "))
    };
    Check {
        name: "accounting back to zero",
        pass: left.is_empty() && !acc.counters.is_empty(),
        gating: true,
        detail,
    }
}

#[allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]
fn rss_check(run: &ProfileRun) -> Check {
    let total = run.rss.last().map_or(0, |s| s.calls_done);
    let warm = (total as f64 * RSS_WARMUP_FRACTION) as u64;
    let steady: Vec<_> = run.rss.iter().filter(|s| s.calls_done >= warm).collect();
    if steady.len() < 4 {
        // Not measured, not failed: a run of a few calls is over before the samples
        // that could judge it (it failed the verdict of a 100% run).
        return Check {
            name: "current RSS stable",
            pass: false,
            gating: false,
            detail: format!(
                "not measured: only {} samples after warm-up (too short a run)",
                steady.len()
            ),
        };
    }
    let half = steady.len() / 2;
    let median = |xs: &[&crate::telemetry::RssSample]| {
        let mut v: Vec<u64> = xs.iter().map(|s| s.rss_kib).collect();
        v.sort_unstable();
        v[v.len() / 2]
    };
    let mid = median(&steady[..half]);
    let end = median(&steady[half..]);
    let allowed = ((mid as f64 * (1.0 + RSS_GROWTH_RATIO)) as u64).saturating_add(RSS_GROWTH_SLACK_KIB);
    Check {
        name: "current RSS stable",
        pass: end <= allowed,
        gating: true,
        detail: format!(
            "median {:.1} MiB mid-run -> {:.1} MiB at the end ({} samples, /proc/self/statm)",
            mid as f64 / 1024.0,
            end as f64 / 1024.0,
            run.rss.len()
        ),
    }
}

fn success_by_minute(run: &ProfileRun) -> Vec<(u64, u64, u64)> {
    let mut m: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for c in &run.calls {
        let e = m.entry(c.ended_ms / 60_000).or_insert((0, 0));
        e.0 += 1;
        e.1 += u64::from(c.ok);
    }
    m.into_iter().map(|(k, (n, ok))| (k, n, ok)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::{Accounting, AttemptRow, CallRow, RssSample};

    #[test]
    fn only_gating_checks_say_pass_or_fail() {
        let check = |pass, gating| Check {
            name: "x",
            pass,
            gating,
            detail: String::new(),
        };
        assert_eq!(check(true, true).label(), "PASS");
        assert_eq!(check(false, true).label(), "FAIL");
        // A baseline's success rate has no bar: it was shown PASS at any rate.
        assert_eq!(check(true, false).label(), "info");
        assert_eq!(check(false, false).label(), "info");
    }

    fn attempt(call: &str, n: u32, source: &str, at_ms: u64, cache_hit: bool) -> AttemptRow {
        AttemptRow {
            call_id: call.into(),
            attempt: n,
            worker: 0,
            source: source.into(),
            admitted_ms: at_ms,
            latency_ms: 10,
            ttft_ms: None,
            tokens: 100,
            outcome: "success".into(),
            cache_hit,
            request_error: false,
        }
    }

    fn call(id: &str, ok: bool, end: u64) -> CallRow {
        CallRow {
            call_id: id.into(),
            worker: 0,
            kind: "P1".into(),
            started_ms: 0,
            ended_ms: end,
            ok,
            cause: if ok { "ok".into() } else { "transient".into() },
            stream: false,
            first_chunk_ms: None,
        }
    }

    /// A TPM rule of 250 tokens a minute on source s4.
    fn s4_tpm_250() -> QuotaRule {
        QuotaRule {
            scope: "source s4".into(),
            sources: vec!["s4".into()],
            dimension: "tpm".into(),
            limit: 250,
            window_ms: 60_000,
        }
    }

    fn run() -> ProfileRun {
        let mut accounting = Accounting::default();
        accounting.counters.insert("inflight s4".into(), 0);
        ProfileRun {
            profile: "p".into(),
            sources: vec!["s4".into()],
            quotas: vec![QuotaRule {
                scope: "source s4".into(),
                sources: vec!["s4".into()],
                dimension: "rpm".into(),
                limit: 2,
                window_ms: 60_000,
            }],
            accounting,
            rss: (0..8)
                .map(|i| RssSample {
                    calls_done: i,
                    rss_kib: 10_000,
                })
                .collect(),
            ..ProfileRun::default()
        }
    }

    fn judged(r: &ProfileRun) -> Score {
        judge(
            r,
            &Expectations {
                calls: 4,
                success_bar: None,
                success_band: None,
                request_errors_gate: false,
                fail_fast_after_ms: None,
            },
        )
    }

    #[test]
    fn quota_spans_by_admission_and_cache_hits_excluded() {
        let mut r = run();
        r.calls = (0..4).map(|i| call(&format!("c{i}"), true, 1)).collect();
        // RPM 2 per 60 s: two in [1 s, 61 s), a cache hit among them, the third at
        // 61 s just outside; [2 s, 62 s) holds 2 s and 61 s: no violation.
        r.attempts = vec![
            attempt("c0", 1, "s4", 1_000, false),
            attempt("c1", 1, "s4", 2_000, false),
            attempt("c2", 1, "s4", 1_500, true),
            attempt("c3", 1, "s4", 61_000, false),
            attempt("c2", 2, "s4", 62_000, false),
        ];
        let s = judged(&r);
        assert!(s.violations.is_empty(), "{:?}", s.violations);
        assert!(s.check("quotas never exceeded").unwrap().pass);
        assert_eq!(s.cache_hits, 1);
        // A third real admission within 60 s of 61 s is a violation, reported once, by
        // the span that starts at 61 s.
        r.attempts.push(attempt("c1", 2, "s4", 100_000, false));
        let s = judged(&r);
        assert_eq!(
            s.violations,
            vec![Violation {
                scope: "source s4".into(),
                dimension: "rpm".into(),
                window_start_ms: 61_000,
                used: 3,
                limit: 2
            }]
        );
        assert!(!s.passed());
    }

    /// The check this scoreboard had: by aligned windows only.
    fn aligned_violations(run: &ProfileRun) -> usize {
        let mut n = 0;
        for rule in &run.quotas {
            let mut windows: BTreeMap<u64, u64> = BTreeMap::new();
            for a in run.attempts.iter().filter(|a| !a.cache_hit) {
                *windows.entry(a.admitted_ms / rule.window_ms).or_insert(0) += 1;
            }
            n += windows.values().filter(|&&used| used > rule.limit).count();
        }
        n
    }

    /// A fixed-window limiter with RPM 2 admits two at the end of one window and two at
    /// the start of the next: every aligned window passes, one span holds four.
    #[test]
    fn a_fixed_window_limiter_is_caught() {
        let mut r = run();
        r.calls = (0..4).map(|i| call(&format!("c{i}"), true, 1)).collect();
        r.attempts = [59_000, 59_500, 60_000, 60_500]
            .into_iter()
            .enumerate()
            .map(|(i, at)| attempt(&format!("c{i}"), 1, "s4", at, false))
            .collect();
        assert_eq!(aligned_violations(&r), 0, "the old check passes it");
        let s = judged(&r);
        assert_eq!(
            s.violations,
            vec![Violation {
                scope: "source s4".into(),
                dimension: "rpm".into(),
                window_start_ms: 59_000,
                used: 4,
                limit: 2
            }]
        );
        assert!(!s.check("quotas never exceeded").unwrap().pass);
        // Two overlapping runs over the quota far apart are two violations; the
        // tokens of TPM rules are weighed.
        r.attempts.extend(
            [300_000, 300_001, 300_002]
                .into_iter()
                .map(|at| attempt("c0", 2, "s4", at, false)),
        );
        r.quotas.push(s4_tpm_250());
        let v = quota_violations(&r);
        let starts: Vec<_> = v
            .iter()
            .map(|v| (v.dimension.as_str(), v.window_start_ms, v.used))
            .collect();
        assert_eq!(
            starts,
            [
                ("rpm", 59_000, 4),
                ("rpm", 300_000, 3),
                ("tpm", 59_000, 400),
                ("tpm", 300_000, 300)
            ]
        );
    }

    /// The rows are judged against what the provider received: a request sent without
    /// a row, or a row naming a source the pool does not have, fails the check.
    #[test]
    fn every_request_the_provider_received_has_its_row() {
        let mut r = run();
        r.attempts = vec![
            attempt("c0", 1, "s4", 0, false),
            attempt("c1", 1, "s4", 1_000, false),
            attempt("c2", 1, "s1", 2_000, false),
        ];
        let c = rows_check(&r, &attempts_by_source(&r));
        assert!(
            c.pass && !c.gating,
            "not measured without the provider's count: {c:?}"
        );
        r.provider_received = [("s1".to_owned(), 1), ("s4".to_owned(), 2)].into();
        let c = rows_check(&r, &attempts_by_source(&r));
        assert!(c.pass && c.gating, "{c:?}");
        // One request sent without its row.
        r.provider_received.insert("s4".into(), 3);
        let c = rows_check(&r, &attempts_by_source(&r));
        assert!(!c.pass, "{c:?}");
        assert_eq!(c.detail, "s4: 2 rows, 3 received");
        // A row for a source the pool does not have (a name that matches no quota).
        r.provider_received.insert("s4".into(), 2);
        r.attempts.push(attempt("c3", 1, "s4:model", 3_000, false));
        let c = rows_check(&r, &attempts_by_source(&r));
        assert!(!c.pass);
        assert_eq!(c.detail, "s4:model: 1 rows, no such source");
    }

    /// Damaged rows, as `--rescore` may read them from an edited file: an admission at
    /// `u64::MAX` was never added to its span yet subtracted from it (an underflow), and
    /// token counts near `u64::MAX` overflowed the span's sum.
    #[test]
    fn damaged_rows_are_judged_without_overflow() {
        let mut r = run();
        r.calls = (0..4).map(|i| call(&format!("c{i}"), true, 1)).collect();
        r.quotas.push(s4_tpm_250());
        let tokens = |a: AttemptRow, tokens: u64| AttemptRow { tokens, ..a };
        r.attempts = vec![
            attempt("c0", 1, "s4", 0, false),
            tokens(attempt("c1", 1, "s4", 1_000, false), u64::MAX),
            tokens(attempt("c2", 1, "s4", 2_000, false), u64::MAX),
            attempt("c3", 1, "s4", u64::MAX, false),
        ];
        let v: Vec<_> = quota_violations(&r)
            .iter()
            .map(|v| (v.dimension.clone(), v.window_start_ms, v.used))
            .collect();
        assert_eq!(
            v,
            [("rpm".to_owned(), 0, 3), ("tpm".to_owned(), 0, u64::MAX)],
            "the sum saturates in the report; the row at u64::MAX is alone in its span"
        );
        let s = judged(&r);
        assert!(!s.check("quotas never exceeded").unwrap().pass);
        // An RSS sample near u64::MAX overflowed the allowed growth.
        r.rss = (0..8)
            .map(|i| RssSample {
                calls_done: i,
                rss_kib: u64::MAX,
            })
            .collect();
        assert!(rss_check(&r).pass);
    }

    /// A request error the client counted against its source (a 404 for a model the
    /// caller named, read as the source being dead) fails the check; the same error
    /// read as the request's fault, or a source's own failure, does not.
    #[test]
    fn a_request_error_counted_against_a_source_fails_the_breaker_check() {
        let mut r = run();
        r.calls = (0..4).map(|i| call(&format!("c{i}"), true, 1)).collect();
        let row = |call: &str, outcome: &str, request_error: bool| AttemptRow {
            outcome: outcome.into(),
            request_error,
            ..attempt(call, 1, "s4", 0, false)
        };
        r.attempts = vec![
            row("c0", "rejected", true),
            row("c1", "source_dead", false),
            row("c2", "transient", false),
            row("c3", "success", false),
        ];
        let gate = |r: &ProfileRun| {
            judge(
                r,
                &Expectations {
                    calls: 4,
                    success_bar: None,
                    success_band: None,
                    request_errors_gate: true,
                    fail_fast_after_ms: None,
                },
            )
        };
        let s = gate(&r);
        assert_eq!((s.request_errors, s.request_errors_against_source), (1, 0));
        let c = s.check("0 breakers opened by request errors").unwrap();
        assert!(c.pass && c.gating, "{c:?}");
        // The same 404 read as the source being dead (it forces the breaker open).
        r.attempts[0].outcome = "source_dead".into();
        // A 400 read as a transient failure of the source, and one from the cache.
        r.attempts.push(row("c1", "transient", true));
        r.attempts.push(AttemptRow {
            cache_hit: true,
            ..row("c2", "transient", true)
        });
        let s = gate(&r);
        assert_eq!((s.request_errors, s.request_errors_against_source), (2, 2));
        let c = s.check("0 breakers opened by request errors").unwrap();
        assert!(!c.pass, "{c:?}");
        assert_eq!(
            c.detail,
            "2 of 2 request errors counted against a source (a breaker opens only on those)"
        );
        assert!(!s.passed());
    }

    #[test]
    fn accounting_fails_on_what_is_left_not_on_what_expired_by_ttl() {
        let mut r = run();
        r.accounting
            .expired_by_ttl
            .insert("lease settle failures s4".into(), 3);
        r.accounting.expired_by_ttl.insert("leases lost s4".into(), 0);
        r.accounting.counters.insert("leases held source:s4".into(), 0);
        let c = accounting_check(&r);
        assert!(c.pass && c.gating, "{c:?}");
        assert!(c.detail.contains("lease settle failures s4 = 3"), "{}", c.detail);
        assert!(
            !c.detail.contains("leases lost"),
            "zeros are not listed: {}",
            c.detail
        );
        r.accounting.counters.insert("leases held source:s4".into(), 1);
        let c = accounting_check(&r);
        assert!(!c.pass, "{c:?}");
        assert!(c.detail.starts_with("leases held source:s4 = 1"), "{}", c.detail);
        // Nothing reported at all proves nothing.
        r.accounting.counters.clear();
        assert!(!accounting_check(&r).pass);
    }

    #[test]
    fn stored_accounting_without_expired_by_ttl_loads() {
        let acc: Accounting = serde_json::from_str(r#"{"counters":{"inflight s4":0}}"#).unwrap();
        assert_eq!(acc.counters.get("inflight s4"), Some(&0));
        assert!(acc.expired_by_ttl.is_empty());
    }

    #[test]
    fn ids_accounting_rss_and_bar() {
        let mut r = run();
        r.calls = vec![call("a", true, 0), call("a", false, 70_000)];
        r.attempts = vec![attempt("zz", 1, "s4", 0, false)];
        r.accounting.counters.insert("probe leases".into(), 1);
        r.rss = (0..8)
            .map(|i| RssSample {
                calls_done: i,
                rss_kib: 10_000 + i * 20_000,
            })
            .collect();
        let s = judge(
            &r,
            &Expectations {
                calls: 2,
                success_bar: Some(0.99),
                success_band: Some((0.5, 0.65)),
                request_errors_gate: false,
                fail_fast_after_ms: None,
            },
        );
        for name in [
            "success rate",
            "call ids unique",
            "accounting back to zero",
            "current RSS stable",
        ] {
            assert!(!s.check(name).unwrap().pass, "{name} should fail: {:?}", s.checks);
        }
        assert!(s.check("calibration band").unwrap().pass);
        assert!(!s.check("calibration band").unwrap().gating);
        assert_eq!(s.success_by_minute, vec![(0, 1, 1), (1, 1, 0)]);
        assert_eq!(s.failed_by_cause.get("transient"), Some(&1));
    }

    #[test]
    fn fail_fast_judges_only_the_calls_after_the_first_minute() {
        let failed = |id: &str, start: u64, end: u64, cause: &str| CallRow {
            started_ms: start,
            cause: cause.into(),
            ..call(id, false, end)
        };
        let judged = |calls: Vec<CallRow>| {
            let mut r = run();
            r.calls = calls;
            let n = r.calls.len() as u64;
            judge(
                &r,
                &Expectations {
                    calls: n,
                    success_bar: Some(0.0),
                    success_band: None,
                    request_errors_gate: false,
                    fail_fast_after_ms: Some(60_000),
                },
            )
        };
        // A slow failure in the first minute is the learning; after it, fast refusals.
        let s = judged(vec![
            failed("a", 0, 180_000, "transient"),
            failed("b", 60_000, 60_999, ALL_CIRCUITS_OPEN),
        ]);
        let c = s.check("fails fast once all are dead").unwrap();
        assert!(c.pass && !c.gating, "{c:?}");
        assert_eq!(
            s.fail_fast,
            Some(FailFast {
                calls: 1,
                fast: 1,
                longest_ms: 999
            })
        );
        // One second or more, another cause, or no call after the minute: not fast.
        for (calls, fast) in [
            (vec![failed("b", 60_000, 61_000, ALL_CIRCUITS_OPEN)], 0),
            (vec![failed("b", 90_000, 90_001, "transient")], 0),
            (vec![failed("a", 0, 10, ALL_CIRCUITS_OPEN)], 0),
        ] {
            let s = judged(calls);
            assert!(!s.check("fails fast once all are dead").unwrap().pass);
            assert_eq!(s.fail_fast.unwrap().fast, fast);
        }
    }
}
