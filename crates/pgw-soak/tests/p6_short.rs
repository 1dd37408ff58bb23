//! A deterministic P6 run in virtual time (the CI soak): every profile side by
//! side on the same pool and seed; the invariants hold; pgw clears its bar; the run is
//! reproducible; `--rescore` re-judges the stored run to the same verdict.

use pgw_soak::profiles::ProfileKind;
use pgw_soak::run::{PGW_SUCCESS_BAR, RunOptions, rescore, run};
use pgw_soak::scenario::Scenario;

/// Calls of the CI run: P6's own 8000 at its default seed, the scoreboard's scenario
/// (a few minutes for every profile in a debug build). Shorter runs judged the seed
/// rather than the code: the learning phase (the revoked key and the black hole cost
/// their attempts before they are known) and the 0.55% of prompts every source rejects
/// weigh more, and a 4000-call sample's noise (sd about 0.3 points) was as large as
/// the margin (seed 42 at 4000 calls went 99.33 -> 98.90% over changes that left the
/// 8000-call P6 at 99.36%).
const CALLS: u64 = pgw_soak::scenario::P6_CALLS;
const SEED: u64 = pgw_soak::scenario::DEFAULT_SEED;

fn scenario() -> Scenario {
    let mut s = Scenario::p6(SEED);
    s.calls = CALLS;
    s
}

#[test]
fn short_p6_side_by_side() {
    let dir = std::env::temp_dir().join(format!("pgw-soak-ci-{}", std::process::id()));
    let opts = RunOptions {
        profiles: ProfileKind::ALL.to_vec(),
        dir: Some(dir.clone()),
        progress: false,
    };
    let out = run(&scenario(), &opts).unwrap();
    let names: Vec<&str> = out.scores.iter().map(|s| s.profile.as_str()).collect();
    println!("{}", pgw_soak::report::terminal(&out.scores));
    for (p, why) in &out.skipped {
        println!("skipped {p}: {why}");
    }

    for s in &out.scores {
        for check in ["call ids unique", "accounting back to zero", "current RSS stable"] {
            let c = s.check(check).unwrap();
            assert!(c.pass, "{}: {check}: {}", s.profile, c.detail);
        }
        assert_eq!(s.calls, CALLS, "{}", s.profile);
        assert!(s.attempts > 0, "{}", s.profile);
    }
    let naive = &out.scores[names.iter().position(|n| *n == "naive").unwrap()];
    // The naive profile has its own RPM/TPM gate, a fixed window as in the seed: the
    // scoreboard judges every span, so its bursts across window edges are caught, but
    // never beyond what a fixed window can let through, twice the RPM in one span (its
    // TPM is judged on real usage, which the gate only estimated).
    for v in naive.violations.iter().filter(|v| v.dimension == "rpm") {
        assert!(v.used <= 2 * v.limit, "{v:?}");
    }
    // The revoked key and the black hole are visited by the baseline (it learns slowly).
    let s3 = naive
        .attempts_by_source
        .iter()
        .find(|(s, _)| s == "s3")
        .unwrap()
        .1;
    assert!(s3 > 0);

    // Offline re-judgement of the stored rows gives the same verdicts.
    let again = rescore(&dir).unwrap();
    assert_eq!(again.len(), out.scores.len());
    for (a, b) in again.iter().zip(&out.scores) {
        assert_eq!(
            (a.ok, a.attempts, a.violations.len()),
            (b.ok, b.attempts, b.violations.len())
        );
        assert_eq!(a.passed(), b.passed());
        // The time figures come from the rows alone: the same offline.
        assert_eq!(a.timing, b.timing, "{}", a.profile);
    }
    assert!(dir.join("report.md").exists() && dir.join("chart.svg").exists());
    let _ = std::fs::remove_dir_all(&dir);

    // The oracle is the pool's physical limit: no profile that succeeds delivers more
    // answers per minute, and it keeps every quota.
    let oracle = &out.scores[names.iter().position(|n| *n == "oracle").unwrap()];
    assert!(oracle.violations.is_empty(), "{:?}", oracle.violations);
    assert!(
        oracle.success_rate >= naive.success_rate,
        "{}",
        oracle.success_rate
    );
    for s in out.scores.iter().filter(|s| s.success_rate > 0.9) {
        assert!(
            oracle.timing.goodput_per_min >= s.timing.goodput_per_min,
            "{} {:.1} ok/min beats the oracle's {:.1}",
            s.profile,
            s.timing.goodput_per_min,
            oracle.timing.goodput_per_min
        );
    }
    assert!(oracle.timing.goodput_per_min > naive.timing.goodput_per_min);

    if let Some(pgw) = out.scores.iter().find(|s| s.profile == "pgw") {
        assert!(pgw.violations.is_empty(), "{:?}", pgw.violations);
        assert!(pgw.success_rate > naive.success_rate);
        assert!(pgw.success_rate >= PGW_SUCCESS_BAR, "pgw {:.4}", pgw.success_rate);
        // Every bar against the oracle was judged (both rows ran) and is in the verdict.
        for name in pgw_soak::acceptance::CHECKS {
            let c = pgw.check(name).unwrap();
            assert!(c.gating && c.pass, "pgw {name}: {}", c.detail);
        }
        assert!(pgw.passed(), "{:?}", pgw.checks);
    } else {
        panic!("the pgw profile did not run: {:?}", out.skipped);
    }
}

fn assert_deterministic(profiles: &[ProfileKind]) {
    let mut s = scenario();
    s.calls = 120;
    let opts = RunOptions {
        profiles: profiles.to_vec(),
        dir: None,
        progress: false,
    };
    let a = run(&s, &opts).unwrap();
    let b = run(&s, &opts).unwrap();
    assert_eq!(a.scores.len(), profiles.len(), "{:?}", a.skipped);
    for (x, y) in a.scores.iter().zip(&b.scores) {
        let key = |s: &pgw_soak::scoreboard::Score| {
            (
                s.ok,
                s.attempts,
                s.attempts_by_source.clone(),
                s.failed_by_cause.clone(),
                s.scenario_ms,
            )
        };
        assert_eq!(key(x), key(y), "{} is not deterministic", x.profile);
    }
}

#[test]
fn baselines_same_seed_same_run() {
    assert_deterministic(&[ProfileKind::Naive, ProfileKind::TowerStock]);
}

/// pgw-stack seeds its balancer from `balance.seed`, but its retry layer's jitter RNG
/// comes from the OS unless `RetryLayer::rng_seed` is called: until the gateway seeds
/// it, two runs of the same seed differ.
#[test]
fn pgw_same_seed_same_run() {
    assert_deterministic(&[ProfileKind::Pgw]);
}
