//! `--matrix`: every scenario of the library with every profile, one table.
//!
//! Each (scenario, profile) pair is one virtual-time run ([`run_profile_virtual`]) on
//! its own current-thread runtime, so pairs run in parallel on `threads` OS threads.
//! Every scenario gets its own directory (`DIR/<scenario>/`) with the usual files and
//! report, so `--rescore DIR/<scenario>` re-judges it; `DIR/matrix.md` holds the table.

use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use indicatif::ProgressBar;
use pgw_core::BoxError;
use pgw_core::sync::lock;

use crate::acceptance;
use crate::profiles::ProfileKind;
use crate::run::{describe, expectations, run_profile_virtual, write_report};
use crate::scenario::Scenario;
use crate::scoreboard::{self, Score};
use crate::timing::ratio_to;

/// How to run the matrix.
#[derive(Clone, Debug)]
pub struct MatrixOptions {
    /// Profiles to run on every scenario, in report order.
    pub profiles: Vec<ProfileKind>,
    /// Where each scenario's run directory and `matrix.md` go.
    pub dir: PathBuf,
    /// Runs at once (one OS thread each).
    pub threads: usize,
    /// Print a line as each run ends.
    pub progress: bool,
}

/// One cell of the matrix: a profile's score on a scenario.
#[derive(Clone, Debug)]
pub struct Cell {
    /// The scenario's name.
    pub scenario: String,
    /// The score.
    pub score: Score,
    /// The oracle's goodput on the same scenario, when it ran.
    pub oracle_goodput: Option<f64>,
}

/// One finished run: scenario index, profile index, its score or why it failed.
type Done = (usize, usize, Result<Score, String>);

/// Runs every profile of `opts` on every scenario, judges them, writes each scenario's
/// report and `matrix.md`; returns the cells in scenario, then profile order.
///
/// # Errors
/// An invalid scenario, a profile that cannot be built, or I/O errors.
pub fn run_matrix(scenarios: &[Scenario], opts: &MatrixOptions) -> Result<Vec<Cell>, BoxError> {
    let mut jobs = Vec::new();
    for (i, s) in scenarios.iter().enumerate() {
        s.validate().map_err(|e| format!("scenario {}: {e}", s.name))?;
        let d = opts.dir.join(&s.name);
        fs::create_dir_all(&d).map_err(|e| format!("{}: {e}", d.display()))?;
        fs::write(d.join("scenario.json"), serde_json::to_vec_pretty(s)?)?;
        for (j, &p) in opts.profiles.iter().enumerate() {
            jobs.push((i, j, p));
        }
    }
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Done>> = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..opts.threads.clamp(1, jobs.len().max(1)) {
            scope.spawn(|| {
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(i, j, kind)) = jobs.get(k) else { break };
                    let s = &scenarios[i];
                    let d = opts.dir.join(&s.name);
                    let r = run_profile_virtual(s, kind, Some(&d), &ProgressBar::hidden())
                        .map(|run| scoreboard::judge(&run, &expectations(kind.as_str(), s)))
                        .map_err(|e| format!("{} on {}: {e}", kind, s.name));
                    if opts.progress {
                        match &r {
                            Ok(sc) => eprintln!(
                                "{:>20} {:>11}: ok {:.2}%, {:.1} ok/min, {} s wall",
                                s.name,
                                kind.as_str(),
                                sc.success_rate * 100.0,
                                sc.timing.goodput_per_min,
                                sc.wall_ms / 1000
                            ),
                            Err(e) => eprintln!("{e}"),
                        }
                    }
                    lock(&results).push((i, j, r));
                }
            });
        }
    });
    let mut results = results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    results.sort_by_key(|(i, j, _)| (*i, *j));
    let mut cells = Vec::new();
    for (i, s) in scenarios.iter().enumerate() {
        let mut scores = results
            .iter()
            .filter(|(k, _, _)| *k == i)
            .map(|(_, _, r)| r.clone())
            .collect::<Result<Vec<Score>, String>>()?;
        acceptance::judge(&mut scores, s);
        let d = opts.dir.join(&s.name);
        let names: Vec<&str> = scores.iter().map(|s| s.profile.as_str()).collect();
        fs::write(d.join("profiles.txt"), names.join("\n") + "\n")?;
        write_report(&d, &s.name, &describe(s), &scores)?;
        let oracle_goodput = scores
            .iter()
            .find(|x| x.profile == ProfileKind::Oracle.as_str())
            .map(|o| o.timing.goodput_per_min);
        cells.extend(scores.into_iter().map(|score| Cell {
            scenario: s.name.clone(),
            score,
            oracle_goodput,
        }));
    }
    fs::write(opts.dir.join("matrix.md"), matrix_markdown(&cells))?;
    Ok(cells)
}

fn vs(cell: &Cell) -> String {
    cell.oracle_goodput
        .and_then(|o| ratio_to(cell.score.timing.goodput_per_min, o))
        .map_or_else(|| "-".into(), |r| format!("x{r:.2}"))
}

fn p95_s(cell: &Cell) -> String {
    cell.score
        .timing
        .success
        .get(|p| p.p95)
        .map_or_else(|| "-".into(), |ms| format!("{:.1}", crate::timing::secs(ms)))
}

fn verdict(cell: &Cell) -> &'static str {
    if cell.score.passed() { "PASS" } else { "FAIL" }
}

/// One cell's columns: scenario, profile, success, goodput, vs oracle, p95, violations,
/// verdict.
fn columns(c: &Cell) -> [String; 8] {
    [
        c.scenario.clone(),
        c.score.profile.clone(),
        format!("{:.2}%", c.score.success_rate * 100.0),
        format!("{:.1}", c.score.timing.goodput_per_min),
        vs(c),
        p95_s(c),
        c.score.violations.len().to_string(),
        verdict(c).to_owned(),
    ]
}

/// The matrix as a terminal table.
#[must_use]
pub fn matrix_table(cells: &[Cell]) -> String {
    let mut out = String::new();
    let line = |out: &mut String, c: &[String; 8]| {
        let _ = writeln!(
            out,
            "{:<20} {:<11} {:>8} {:>10} {:>9} {:>8} {:>10} {:>7}",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]
        );
    };
    line(&mut out, &HEADER.map(str::to_owned));
    for c in cells {
        line(&mut out, &columns(c));
    }
    out
}

const HEADER: [&str; 8] = [
    "scenario",
    "profile",
    "success",
    "ok/min",
    "vs oracle",
    "p95 s",
    "violations",
    "verdict",
];

/// The matrix as Markdown (`matrix.md`).
#[must_use]
pub fn matrix_markdown(cells: &[Cell]) -> String {
    let mut md = String::from(
        "# Scenario matrix\n\nEvery library scenario with every profile, virtual time. \
         Goodput (ok/min) is successful calls per scenario minute; `vs oracle` is its ratio \
         to the clairvoyant client's on the same scenario; p95 is the successful calls' \
         latency. Each scenario's own report is in its directory.\n\n",
    );
    let _ = writeln!(md, "| {} |", HEADER.join(" | "));
    md.push_str("|---|---|---:|---:|---:|---:|---:|---|\n");
    for c in cells {
        let mut cols = columns(c);
        cols[0] = format!("[{0}]({0}/report.md)", cols[0]);
        let _ = writeln!(md, "| {} |", cols.join(" | "));
    }
    md
}
