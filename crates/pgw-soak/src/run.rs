//! Runs profiles on the scenario, stores their telemetry, judges and reports.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use pgw_core::BoxError;
use pgw_sim::p6::{Kind, Traffic, TrafficConfig};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::acceptance;
use crate::driver::{DriveOptions, SoakCall, drive};
use crate::profiles::{self, Env, ProfileKind, Upstream};
use crate::report::{self, RunInfo};
use crate::scenario::{Arrival, Scenario};
use crate::scoreboard::{self, Expectations, Score};
use crate::telemetry::{ProfileRun, Recorder, RunClock, stored_profiles};

/// The success bar of the pgw profile on P6: >= 99%.
pub const PGW_SUCCESS_BAR: f64 = crate::scenario::DEFAULT_SUCCESS_BAR;
/// RSS samples per profile run.
pub const RSS_SAMPLES: u64 = 100;
/// Scenario time given to the books to settle after the last call (spawned releases,
/// hold expiries) before they are read; then they are read until they are back to zero,
/// for at most one attempt timeout (a detached probe still out).
const SETTLE: Duration = Duration::from_secs(5);

/// How to run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Profiles to run, in order.
    pub profiles: Vec<ProfileKind>,
    /// Where to store telemetry and the report (`None`: in memory only).
    pub dir: Option<PathBuf>,
    /// Show the progress bars.
    pub progress: bool,
}

/// What the scoreboard expects of `profile` on `scenario`: pgw its success bar, naive
/// its calibration band (when the scenario has one).
#[must_use]
pub fn expectations(profile: &str, scenario: &Scenario) -> Expectations {
    Expectations {
        calls: scenario.calls,
        success_bar: (profile == ProfileKind::Pgw.as_str()).then_some(scenario.success_bar),
        success_band: scenario
            .naive_band
            .filter(|_| profile == ProfileKind::Naive.as_str())
            .map(|[lo, hi]| (lo, hi)),
        request_errors_gate: scenario.request_errors_gate && profile == ProfileKind::Pgw.as_str(),
        fail_fast_after_ms: scenario
            .fail_fast_after_s
            .filter(|_| profile == ProfileKind::Pgw.as_str())
            .map(|s| {
                Duration::try_from_secs_f64(s)
                    .map_or(u64::MAX, |d| d.as_millis().try_into().unwrap_or(u64::MAX))
            }),
    }
}

/// The traffic kind's report name (`P1` .. `P5`).
const fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::ShortChat => "P1",
        Kind::LargePrompt => "P2",
        Kind::Structured => "P3",
        Kind::Repeated => "P4",
        Kind::LongStream => "P5",
    }
}

/// Salt of the open-loop arrival process's RNG (independent of the traffic's own).
const ARRIVAL_SALT: u64 = 0xA771_7A15_0000_0001;

/// The scenario's traffic as soak calls. With open-loop arrivals each call carries its
/// arrival offset: exponential gaps of mean `60 / per_min` scenario seconds (seeded),
/// times `time_scale` (1 in virtual time).
pub fn traffic(scenario: &Scenario, time_scale: f64) -> impl Iterator<Item = SoakCall> + Send + 'static {
    let calls = usize::try_from(scenario.calls).unwrap_or(usize::MAX);
    let mut arrivals = match scenario.arrival {
        Arrival::Closed => None,
        Arrival::Open { per_min } => Some((SmallRng::seed_from_u64(scenario.seed ^ ARRIVAL_SALT), per_min)),
    };
    let mut at_s = 0.0_f64;
    Traffic::with_config(
        TrafficConfig {
            calls,
            ..scenario.traffic.clone()
        },
        scenario.seed,
    )
    .map(move |item| {
        let arrival = arrivals.as_mut().map(|(rng, per_min)| {
            let u: f64 = rng.random();
            at_s += -(1.0 - u).ln() * 60.0 / *per_min;
            Duration::from_secs_f64(at_s * time_scale)
        });
        SoakCall {
            id: item.index as u64 + 1,
            worker: 0,
            kind: kind_name(item.kind),
            structured: item.kind == Kind::Structured,
            request: Arc::new(item.request),
            arrival,
        }
    })
}

/// Runs one profile on the scenario in virtual time (tokio's paused clock, memory
/// state, the simulator in process) and returns its run (rows included).
///
/// # Errors
/// The profile cannot be built, the pool is invalid, or storing failed.
pub fn run_profile_virtual(
    scenario: &Scenario,
    kind: ProfileKind,
    dir: Option<&Path>,
    progress: &ProgressBar,
) -> Result<ProfileRun, BoxError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    // Wall time of the run for the report only; every behaviour runs on tokio's clock.
    let wall = std::time::Instant::now();
    let mut run = rt.block_on(async {
        let clock = RunClock::start();
        let pool = pgw_sim::SimPool::new(scenario.pool.clone(), scenario.seed)?;
        let sources: Vec<String> = scenario.pool.sources.iter().map(|s| s.name.clone()).collect();
        let recorder = match dir {
            Some(d) => Recorder::to_dir(clock, sources.clone(), d, kind.as_str())?,
            None => Recorder::in_memory(clock, sources.clone()),
        };
        let env = Env {
            scenario: scenario.clone(),
            upstream: Upstream::sim(pool),
            recorder: recorder.clone(),
        };
        let mut built = profiles::build(kind, &env)
            .await
            .map_err(|e| profiles::BuildError(e.to_string()))?;
        let opts = DriveOptions {
            concurrency: scenario.concurrency,
            rss_samples: RSS_SAMPLES,
            calls: scenario.calls,
        };
        let rss = drive(
            std::mem::take(&mut built.clients),
            traffic(scenario, 1.0),
            &recorder,
            opts,
            progress,
        )
        .await;
        let scenario_ms = clock.now_ms();
        tokio::time::sleep(SETTLE).await;
        let patience = Duration::from_secs_f64(scenario.client.total_s);
        let accounting = built
            .settled_books(patience, Duration::from_secs(1), |acc| {
                for (name, st) in env.upstream.pool().stats().sources {
                    acc.counters
                        .insert(format!("provider in flight {name}"), st.in_flight);
                }
            })
            .await;
        let provider_received = env
            .upstream
            .pool()
            .stats()
            .sources
            .into_iter()
            .map(|(name, st)| (name, st.received))
            .collect();
        let (attempts, calls) = recorder.finish()?;
        Ok::<_, BoxError>(ProfileRun {
            profile: kind.as_str().to_owned(),
            attempts,
            calls,
            rss,
            accounting,
            quotas: scenario.judged_quotas(),
            wall_ms: 0,
            scenario_ms,
            sources,
            time_scale: 1.0,
            redis_round_trips: None,
            redis_commands_sent: None,
            provider_received,
        })
    })?;
    drop(rt);
    run.wall_ms = u64::try_from(wall.elapsed().as_millis()).unwrap_or(u64::MAX);
    if let Some(d) = dir {
        run.store_meta(d)?;
        run = ProfileRun::load(d, kind.as_str())?;
    }
    Ok(run)
}

fn bar(kind: ProfileKind, calls: u64, show: bool) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(calls);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>11} [{bar:16}] {pos:>5}/{len} {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_prefix(kind.as_str());
    pb
}

/// The scores of a run, and the profiles that could not be built.
#[derive(Debug)]
pub struct RunOutcome {
    /// Scores in profile order.
    pub scores: Vec<Score>,
    /// Profiles that could not be built, with the reason.
    pub skipped: Vec<(ProfileKind, String)>,
    /// The Redis mode: the commands the run's Redis ran, per call.
    pub redis_commands: Option<crate::commands::RedisCommands>,
}

/// Runs every profile of `opts` on `scenario`, judges them, writes the report when a
/// directory is given. A profile that cannot be built is skipped and named in
/// [`RunOutcome::skipped`].
///
/// # Errors
/// Invalid scenario or I/O errors.
pub fn run(scenario: &Scenario, opts: &RunOptions) -> Result<RunOutcome, BoxError> {
    scenario.validate()?;
    if let Some(d) = &opts.dir {
        fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        fs::write(d.join("scenario.json"), serde_json::to_vec_pretty(scenario)?)?;
    }
    let mut scores = Vec::new();
    let mut skipped = Vec::new();
    for &kind in &opts.profiles {
        let pb = bar(kind, scenario.calls, opts.progress);
        let run = match run_profile_virtual(scenario, kind, opts.dir.as_deref(), &pb) {
            Ok(run) => run,
            Err(e) if e.is::<profiles::BuildError>() => {
                pb.abandon_with_message(format!("skipped: {e}"));
                skipped.push((kind, e.to_string()));
                continue;
            }
            Err(e) => return Err(e),
        };
        let score = scoreboard::judge(&run, &expectations(kind.as_str(), scenario));
        pb.finish_with_message(format!(
            "ok {:.2}%, {} quota violations, {:.2} attempts/call",
            score.success_rate * 100.0,
            score.violations.len(),
            score.attempts_per_call
        ));
        scores.push(score);
    }
    acceptance::judge(&mut scores, scenario);
    if let Some(d) = &opts.dir {
        let names: Vec<&str> = scores.iter().map(|s| s.profile.as_str()).collect();
        fs::write(d.join("profiles.txt"), names.join("\n") + "\n")?;
        write_report(d, &scenario.name, &describe(scenario), &scores)?;
    }
    Ok(RunOutcome {
        scores,
        skipped,
        redis_commands: None,
    })
}

/// One line describing the scenario for the report.
#[must_use]
pub fn describe(s: &Scenario) -> String {
    let arrival = match s.arrival {
        Arrival::Closed => format!("{} workers x {} concurrent", s.workers, s.concurrency),
        Arrival::Open { per_min } => format!(
            "open loop at {per_min} calls/min (at most {} x {} in flight)",
            s.workers, s.concurrency
        ),
    };
    format!(
        "{} pool ({} sources), {} calls, {arrival}, seed {}, virtual time, memory backend; \
         timeouts: first token {}s, inter-token {}s, attempt {}s; {} attempts per call.",
        s.name,
        s.pool.sources.len(),
        s.calls,
        s.seed,
        s.client.first_token_s,
        s.client.inter_token_s,
        s.client.total_s,
        s.client.max_attempts
    )
}

/// Writes `report.md`, `chart.svg` and `latency.svg` into `dir`.
///
/// # Errors
/// I/O errors.
pub fn write_report(dir: &Path, title: &str, scenario_line: &str, scores: &[Score]) -> std::io::Result<()> {
    let info = RunInfo {
        title: title.to_owned(),
        scenario: scenario_line.to_owned(),
        chart_file: "chart.svg".into(),
        latency_chart_file: "latency.svg".into(),
    };
    fs::write(dir.join("chart.svg"), report::svg(scores))?;
    fs::write(dir.join("latency.svg"), report::latency_svg(scores))?;
    fs::write(dir.join("report.md"), report::markdown(&info, scores))
}

/// How far past a stored run's end ([`ProfileRun::scenario_ms`]) its rows may lie:
/// the books are read after [`SETTLE`] for up to one attempt timeout (a detached probe
/// may be admitted then), plus [`ROW_MARGIN`].
fn row_slack_ms(scenario: &Scenario) -> u64 {
    let patience = Duration::try_from_secs_f64(scenario.client.total_s).unwrap_or(Duration::MAX);
    u64::try_from((SETTLE + ROW_MARGIN).saturating_add(patience).as_millis()).unwrap_or(u64::MAX)
}

/// Margin past the settling of a stored run's rows that [`rescore`] still accepts.
const ROW_MARGIN: Duration = Duration::from_secs(60);

/// Re-judges a stored run without traffic (`--rescore RUN`), rewriting its report.
///
/// # Errors
/// The run directory is missing or malformed, or a row lies past the run's end (a
/// damaged file).
pub fn rescore(dir: &Path) -> Result<Vec<Score>, BoxError> {
    let scenario: Scenario = serde_json::from_slice(
        &fs::read(dir.join("scenario.json")).map_err(|e| format!("{}/scenario.json: {e}", dir.display()))?,
    )
    .map_err(|e| format!("{}/scenario.json: {e}", dir.display()))?;
    let mut scores = Vec::new();
    for p in stored_profiles(dir)? {
        let run = ProfileRun::load(dir, &p)?;
        run.check_times(row_slack_ms(&scenario))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        scores.push(scoreboard::judge(&run, &expectations(&p, &scenario)));
    }
    acceptance::judge(&mut scores, &scenario);
    // A Redis-mode run keeps its description and its Redis commands (it was rewritten
    // as a memory run, its commands section dropped).
    let real: Option<crate::realtime::RealTime> =
        crate::telemetry::read_json_if_there(&dir.join(crate::realtime::REALTIME_FILE))?;
    let described = real.as_ref().map_or_else(
        || describe(&scenario),
        |r| crate::realtime::describe_redis(&scenario, r),
    );
    write_report(dir, &scenario.name, &format!("{described} (rescored)"), &scores)?;
    if let Some(commands) = crate::commands::RedisCommands::load(dir)? {
        let report = dir.join("report.md");
        let mut md = fs::read_to_string(&report)?;
        md.push_str(&commands.markdown());
        fs::write(&report, md)?;
    }
    Ok(scores)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::AttemptRow;

    /// A stored row edited to an admission at `u64::MAX` is refused by `--rescore`
    /// with the file and the row named, where it was judged as a time (and overflowed
    /// the quota spans).
    #[test]
    fn rescore_refuses_a_row_past_the_runs_end() {
        let dir = std::env::temp_dir().join(format!("pgw-soak-damaged-{}", std::process::id()));
        let mut scenario = Scenario::p6(7);
        scenario.calls = 5;
        let opts = RunOptions {
            profiles: vec![ProfileKind::Naive],
            dir: Some(dir.clone()),
            progress: false,
        };
        run(&scenario, &opts).unwrap();
        rescore(&dir).unwrap();
        let path = dir.join("naive.attempts.jsonl");
        let text = fs::read_to_string(&path).unwrap();
        let mut rows: Vec<AttemptRow> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        rows[0].admitted_ms = u64::MAX;
        let damaged: Vec<String> = rows.iter().map(|r| serde_json::to_string(r).unwrap()).collect();
        fs::write(&path, damaged.join("\n") + "\n").unwrap();
        let e = rescore(&dir).unwrap_err().to_string();
        assert!(
            e.contains(&format!(
                "naive.attempts.jsonl: call {} attempt {} admitted at {} ms",
                rows[0].call_id,
                rows[0].attempt,
                u64::MAX
            )) && e.ends_with("the stored rows are damaged"),
            "{e}"
        );
        let _ = fs::remove_dir_all(&dir);
    }
}
