//! pgw against the oracle: the soak's acceptance compares the pgw profile with the
//! clairvoyant client (the pool's physical limit) on the same scenario and seed.
//!
//! The issue that asked for the soak (issue 12) states three bars for P6: pgw's
//! goodput at least 0.80 x the oracle's, its successful calls' latency p95 at most
//! 2 x the oracle's, its scenario time at most 1.25 x the oracle's. The goodput bar is
//! every scenario's (the matrix judges it on each); the latency and time bars are the
//! scenario's own (`oracle_success_p95_max`, `oracle_scenario_time_max`), which P6
//! states ([`OracleBars::of`]).
//!
//! [`judge`] adds one gating check per bar to the pgw profile's [`Score`], so
//! [`Score::passed`], the report's verdict row, the exit code and the matrix's verdict
//! column all include them. A figure with nothing to compare with (no oracle row, an
//! empty latency sample, an oracle that answered nothing) is shown as not judged, and
//! does not fail the run.

use crate::profiles::ProfileKind;
use crate::scenario::Scenario;
use crate::scoreboard::{Check, Score};
use crate::timing::{ratio_to, secs};

/// pgw's goodput must be at least this fraction of the oracle's, on every scenario
/// (issue 12: ">= 0.8 x the oracle's").
pub const GOODPUT_BAR: f64 = 0.80;
/// On P6, pgw's successful-call latency p95 must be at most this many times the
/// oracle's (issue 12: "<= 2 x").
pub const P6_SUCCESS_P95_BAR: f64 = 2.0;
/// On P6, pgw's scenario time must be at most this many times the oracle's (issue 12:
/// "<= 1.25 x").
pub const P6_SCENARIO_TIME_BAR: f64 = 1.25;

/// The check of pgw's goodput against the oracle's.
pub const GOODPUT: &str = "oracle: goodput";
/// The check of pgw's successful-call latency p95 against the oracle's.
pub const SUCCESS_P95: &str = "oracle: success p95";
/// The check of pgw's scenario time against the oracle's.
pub const SCENARIO_TIME: &str = "oracle: scenario time";
/// Every check [`judge`] may add, in the order it adds them.
pub const CHECKS: [&str; 3] = [GOODPUT, SUCCESS_P95, SCENARIO_TIME];

/// What pgw must achieve against the oracle on one scenario; a bar that is `None` is
/// not judged there.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OracleBars {
    /// pgw's goodput at least this times the oracle's.
    pub goodput_min: f64,
    /// pgw's successful-call latency p95 at most this times the oracle's.
    pub success_p95_max: Option<f64>,
    /// pgw's scenario time at most this times the oracle's.
    pub scenario_time_max: Option<f64>,
}

impl OracleBars {
    /// The bars of `scenario`: the goodput bar everywhere, and the latency and time
    /// bars it states (P6 does; no other library scenario).
    #[must_use]
    pub fn of(scenario: &Scenario) -> Self {
        Self {
            goodput_min: GOODPUT_BAR,
            success_p95_max: scenario.oracle_success_p95_max,
            scenario_time_max: scenario.oracle_scenario_time_max,
        }
    }
}

/// Which side of the bar passes.
#[derive(Clone, Copy, Debug)]
enum Bound {
    AtLeast(f64),
    AtMost(f64),
}

/// The figures of a profile the bars compare; `None` where its sample is empty.
#[derive(Clone, Copy, Debug)]
struct Figures {
    goodput_per_min: f64,
    success_p95_ms: Option<u64>,
    scenario_ms: u64,
}

impl Figures {
    fn of(s: &Score) -> Self {
        Self {
            goodput_per_min: s.timing.goodput_per_min,
            success_p95_ms: s.timing.success.get(|p| p.p95),
            scenario_ms: s.scenario_ms,
        }
    }
}

/// Judges the pgw profile against the oracle on the bars of `scenario`
/// ([`OracleBars::of`]): adds one check per bar to every `pgw` score of `scores`
/// (gating when both figures exist, shown as not judged otherwise). Judging again
/// replaces the checks.
pub fn judge(scores: &mut [Score], scenario: &Scenario) {
    let bars = OracleBars::of(scenario);
    let oracle = scores
        .iter()
        .find(|s| s.profile == ProfileKind::Oracle.as_str())
        .map(Figures::of);
    for s in scores
        .iter_mut()
        .filter(|s| s.profile == ProfileKind::Pgw.as_str())
    {
        let pgw = Figures::of(s);
        s.checks.retain(|c| !CHECKS.contains(&c.name));
        s.checks.extend(checks(&pgw, oracle.as_ref(), bars));
    }
}

fn checks(pgw: &Figures, oracle: Option<&Figures>, bars: OracleBars) -> Vec<Check> {
    let mut out = vec![compare(
        GOODPUT,
        Bound::AtLeast(bars.goodput_min),
        Some(pgw.goodput_per_min),
        oracle.map(|o| Some(o.goodput_per_min)),
        &|v| format!("{v:.1} ok/min"),
    )];
    if let Some(bar) = bars.success_p95_max {
        out.push(compare(
            SUCCESS_P95,
            Bound::AtMost(bar),
            pgw.success_p95_ms.map(secs),
            oracle.map(|o| o.success_p95_ms.map(secs)),
            &|v| format!("{v:.1} s"),
        ));
    }
    if let Some(bar) = bars.scenario_time_max {
        out.push(compare(
            SCENARIO_TIME,
            Bound::AtMost(bar),
            Some(secs(pgw.scenario_ms)),
            oracle.map(|o| Some(secs(o.scenario_ms))),
            &|v| format!("{:.1} min", v / 60.0),
        ));
    }
    out
}

/// One bar: `pgw / oracle` against `bound`. `oracle` is `None` without an oracle row,
/// `Some(None)` when its sample is empty; `pgw` is `None` when pgw's is.
fn compare(
    name: &'static str,
    bound: Bound,
    pgw: Option<f64>,
    oracle: Option<Option<f64>>,
    shown: &dyn Fn(f64) -> String,
) -> Check {
    let not_judged = |why: &str| Check {
        name,
        pass: false,
        gating: false,
        detail: format!("not judged ({why})"),
    };
    let Some(oracle) = oracle else {
        return not_judged("no oracle profile");
    };
    let Some(theirs) = oracle else {
        return not_judged("the oracle has no sample");
    };
    let Some(ours) = pgw else {
        return not_judged("pgw has no sample");
    };
    let Some(r) = ratio_to(ours, theirs) else {
        return not_judged(&format!(
            "the oracle's is {}: nothing to compare with",
            shown(theirs)
        ));
    };
    let (op, bar) = match bound {
        Bound::AtLeast(b) => (">=", b),
        Bound::AtMost(b) => ("<=", b),
    };
    Check {
        name,
        pass: bound.passes(r),
        gating: true,
        detail: format!(
            "x{} ({op} x{bar:.2}): {} against the oracle's {}",
            ratio_digits(r, bound),
            shown(ours),
            shown(theirs)
        ),
    }
}

impl Bound {
    fn passes(self, r: f64) -> bool {
        match self {
            Self::AtLeast(b) => r >= b,
            Self::AtMost(b) => r <= b,
        }
    }
}

/// `r` with two decimals, or as many more as it takes not to read as the other side of
/// the bar (a ratio of 0.7958 shown as "x0.80 (>= x0.80)" next to FAIL).
fn ratio_digits(r: f64, bound: Bound) -> String {
    let pass = bound.passes(r);
    (2..=6)
        .map(|d| format!("{r:.d$}"))
        .find(|s| s.parse::<f64>().is_ok_and(|shown| bound.passes(shown) == pass))
        .unwrap_or_else(|| r.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scoreboard::{Expectations, judge as judge_run};
    use crate::telemetry::{CallRow, ProfileRun};

    /// A profile's score with `ok` successful calls of `latency_ms` each, over a run of
    /// `scenario_ms`; every invariant holds.
    fn score(profile: &str, ok: u64, latency_ms: u64, scenario_ms: u64) -> Score {
        let mut accounting = crate::telemetry::Accounting::default();
        accounting.counters.insert("inflight s1".into(), 0);
        let run = ProfileRun {
            profile: profile.into(),
            sources: vec!["s1".into()],
            calls: (0..ok)
                .map(|i| CallRow {
                    call_id: i.to_string(),
                    worker: 0,
                    kind: "P1".into(),
                    started_ms: 0,
                    ended_ms: latency_ms,
                    ok: true,
                    cause: "ok".into(),
                    stream: false,
                    first_chunk_ms: None,
                })
                .collect(),
            accounting,
            scenario_ms,
            ..ProfileRun::default()
        };
        judge_run(
            &run,
            &Expectations {
                calls: ok,
                success_bar: None,
                success_band: None,
                request_errors_gate: false,
                fail_fast_after_ms: None,
            },
        )
    }

    fn p6() -> Scenario {
        Scenario::p6(1)
    }

    #[test]
    fn a_p95_three_times_the_oracles_fails_the_verdict() {
        // The same goodput and scenario time; successful calls take 30 s against 10 s.
        let mut scores = vec![
            score("pgw", 10, 30_000, 600_000),
            score("oracle", 10, 10_000, 600_000),
        ];
        assert!(scores[0].passed(), "{:?}", scores[0].checks);
        judge(&mut scores, &p6());
        let pgw = &scores[0];
        let p95 = pgw.check(SUCCESS_P95).unwrap();
        assert!(p95.gating && !p95.pass, "{p95:?}");
        assert_eq!(p95.detail, "x3.00 (<= x2.00): 30.0 s against the oracle's 10.0 s");
        assert!(!pgw.passed());
        let goodput = pgw.check(GOODPUT).unwrap();
        assert!(goodput.gating && goodput.pass, "{goodput:?}");
        assert_eq!(
            goodput.detail,
            "x1.00 (>= x0.80): 1.0 ok/min against the oracle's 1.0 ok/min"
        );
        assert!(pgw.check(SCENARIO_TIME).unwrap().pass);
        // Only pgw is judged; judging again replaces, it does not add.
        assert!(scores[1].check(GOODPUT).is_none());
        judge(&mut scores, &p6());
        assert_eq!(scores[0].checks.iter().filter(|c| c.name == GOODPUT).count(), 1);
    }

    #[test]
    fn goodput_and_time_bars() {
        // 8 answers in 10 min against the oracle's 10 in 8 min: goodput x0.64, time
        // x1.25 (on the bar: passes).
        let mut scores = vec![
            score("pgw", 8, 1_000, 600_000),
            score("oracle", 10, 1_000, 480_000),
        ];
        judge(&mut scores, &p6());
        let pgw = &scores[0];
        assert!(!pgw.check(GOODPUT).unwrap().pass);
        let time = pgw.check(SCENARIO_TIME).unwrap();
        assert!(time.pass && time.gating, "{time:?}");
        assert_eq!(
            time.detail,
            "x1.25 (<= x1.25): 10.0 min against the oracle's 8.0 min"
        );
        assert!(!pgw.passed());
    }

    #[test]
    fn a_ratio_just_under_its_bar_does_not_read_as_on_it() {
        assert_eq!(ratio_digits(0.7958, Bound::AtLeast(0.8)), "0.796");
        assert_eq!(ratio_digits(0.87, Bound::AtLeast(0.8)), "0.87");
        assert_eq!(ratio_digits(0.8, Bound::AtLeast(0.8)), "0.80");
        assert_eq!(ratio_digits(2.004, Bound::AtMost(2.0)), "2.004");
        assert_eq!(ratio_digits(1.996, Bound::AtMost(2.0)), "2.00");
    }

    #[test]
    fn other_scenarios_have_the_goodput_bar_only() {
        let flapping = Scenario::named_or_file("flapping").unwrap();
        let bars = OracleBars::of(&flapping);
        assert_eq!((bars.success_p95_max, bars.scenario_time_max), (None, None));
        // The bars are the scenario's, whatever its name: P6's file, copied and renamed.
        let mut copy = Scenario::named_or_file("p6").unwrap();
        copy.name = "my-p6".into();
        let kept = OracleBars::of(&copy);
        assert_eq!(
            (kept.success_p95_max, kept.scenario_time_max),
            (Some(P6_SUCCESS_P95_BAR), Some(P6_SCENARIO_TIME_BAR))
        );
        let mut scores = vec![
            score("pgw", 10, 30_000, 600_000),
            score("oracle", 10, 10_000, 600_000),
        ];
        judge(&mut scores, &flapping);
        let names: Vec<_> = scores[0].checks.iter().map(|c| c.name).collect();
        assert!(names.contains(&GOODPUT), "{names:?}");
        assert!(!names.contains(&SUCCESS_P95) && !names.contains(&SCENARIO_TIME));
        assert!(scores[0].passed(), "{:?}", scores[0].checks);
    }

    #[test]
    fn without_an_oracle_or_a_sample_nothing_is_judged() {
        // No oracle row: every bar says so, and the verdict is the invariants'.
        let mut alone = vec![score("pgw", 10, 1_000, 600_000)];
        judge(&mut alone, &p6());
        for name in CHECKS {
            let c = alone[0].check(name).unwrap();
            assert!(!c.gating, "{c:?}");
            assert_eq!(c.detail, "not judged (no oracle profile)");
            assert_eq!(c.label(), "info");
        }
        assert!(alone[0].passed());
        // An empty latency sample is not judged, never compared as 0 s (x0.00).
        let mut scores = vec![score("pgw", 10, 1_000, 600_000), score("oracle", 0, 0, 600_000)];
        judge(&mut scores, &p6());
        let p95 = scores[0].check(SUCCESS_P95).unwrap();
        assert!(!p95.gating, "{p95:?}");
        assert_eq!(p95.detail, "not judged (the oracle has no sample)");
        let goodput = scores[0].check(GOODPUT).unwrap();
        assert!(!goodput.gating, "{goodput:?}");
        assert!(
            goodput
                .detail
                .starts_with("not judged (the oracle's is 0.0 ok/min")
        );
        // pgw without a successful call: its p95 is not judged, its goodput fails.
        let mut scores = vec![score("pgw", 0, 0, 600_000), score("oracle", 10, 1_000, 600_000)];
        judge(&mut scores, &p6());
        assert_eq!(
            scores[0].check(SUCCESS_P95).unwrap().detail,
            "not judged (pgw has no sample)"
        );
        assert!(!scores[0].check(GOODPUT).unwrap().pass);
        assert!(!scores[0].passed());
    }
}
