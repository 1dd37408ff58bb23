//! The scenario matrix in short (CI): every library scenario with every profile at a
//! small call count. Every run keeps the invariants every profile must keep (ids,
//! accounting, quotas for the profiles that have quota machinery), the oracle row is
//! there for every scenario, and a scenario's stored run rescored gives the same time
//! figures.

use pgw_soak::matrix::{MatrixOptions, matrix_table, run_matrix};
use pgw_soak::profiles::ProfileKind;
use pgw_soak::run::rescore;
use pgw_soak::scenario::{LIBRARY, library};

const CALLS: u64 = 120;
/// all-dead's calls arrive at 120 a minute and its fail-fast check judges those from
/// minute 1 on: 300 calls give it about 180 of them.
const ALL_DEAD_CALLS: u64 = 300;

/// The calls each scenario runs here.
fn calls_of(scenario: &str) -> u64 {
    if scenario == "all-dead" {
        ALL_DEAD_CALLS
    } else {
        CALLS
    }
}

#[test]
fn every_scenario_with_every_profile() {
    let mut scenarios = library().unwrap();
    for s in &mut scenarios {
        s.calls = calls_of(&s.name);
    }
    let dir = std::env::temp_dir().join(format!("pgw-soak-matrix-{}", std::process::id()));
    let opts = MatrixOptions {
        profiles: ProfileKind::ALL.to_vec(),
        dir: dir.clone(),
        threads: 2,
        progress: false,
    };
    let cells = run_matrix(&scenarios, &opts).unwrap();
    println!("{}", matrix_table(&cells));
    assert_eq!(cells.len(), LIBRARY.len() * ProfileKind::ALL.len());
    for c in &cells {
        assert_eq!(
            c.score.calls,
            calls_of(&c.scenario),
            "{} {}",
            c.scenario,
            c.score.profile
        );
        for check in ["call ids unique", "accounting back to zero"] {
            let k = c.score.check(check).unwrap();
            assert!(
                k.pass,
                "{} {}: {check}: {}",
                c.scenario, c.score.profile, k.detail
            );
        }
        if c.score.profile != ProfileKind::TowerStock.as_str() {
            // tower has no TPM limiter; every other profile keeps every quota.
            assert!(
                c.score.violations.is_empty(),
                "{} {}: {:?}",
                c.scenario,
                c.score.profile,
                c.score.violations
            );
        }
        assert!(c.oracle_goodput.is_some(), "{}: no oracle row", c.scenario);
    }
    // Nothing can answer on all-dead: the oracle knows it and sends nothing.
    let dead = cells
        .iter()
        .find(|c| c.scenario == "all-dead" && c.score.profile == "oracle")
        .unwrap();
    assert_eq!((dead.score.ok, dead.score.attempts), (0, 0));
    // pgw learns it within the first minute; after it, calls are refused at once but
    // for the few that carry a revoked key's half-open breaker probe (a black hole is
    // probed off the caller's path; 1-3 of ~480 calls in the full run). At most 1 in 20.
    let dead = cells
        .iter()
        .find(|c| c.scenario == "all-dead" && c.score.profile == "pgw")
        .unwrap();
    let ff = dead.score.fail_fast.unwrap();
    assert!(
        ff.calls >= 100 && ff.fast * 20 >= ff.calls * 19,
        "all-dead pgw: {ff:?}"
    );
    let md = std::fs::read_to_string(dir.join("matrix.md")).unwrap();
    assert_eq!(md.lines().filter(|l| l.starts_with("| [")).count(), cells.len());
    let again = rescore(&dir.join("flapping")).unwrap();
    let stored: Vec<_> = cells.iter().filter(|c| c.scenario == "flapping").collect();
    assert_eq!(again.len(), stored.len());
    for (a, b) in again.iter().zip(stored) {
        assert_eq!(a.timing, b.score.timing, "{}", a.profile);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
