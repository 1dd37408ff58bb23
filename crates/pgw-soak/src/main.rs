//! `pgw-soak`: the P6 soak (`cargo xtask soak [args]`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use pgw_soak::matrix::{MatrixOptions, matrix_table, run_matrix};
use pgw_soak::profiles::ProfileKind;
use pgw_soak::realtime::{RedisOptions, run_redis, run_worker, window_ms};
use pgw_soak::report;
use pgw_soak::run::{RunOptions, rescore, run};
use pgw_soak::scenario::{DEFAULT_SEED, Scenario};

/// Runs the soak: profiles side by side on the simulated fault pool (P6, or a library
/// scenario, or a scenario file), in virtual time, and prints the scoreboard with what
/// the success cost in time; telemetry, report.md, chart.svg and latency.svg go to the
/// run directory.
#[derive(Parser, Debug)]
#[command(name = "pgw-soak", version)]
struct Args {
    /// Profiles to run, comma-separated, in report order.
    /// (default: naive,tower-stock,pgw,oracle; the Redis mode runs pgw only).
    #[arg(long, value_delimiter = ',')]
    profiles: Option<Vec<ProfileKind>>,
    /// Seed of the pool and the traffic.
    #[arg(long, default_value_t = DEFAULT_SEED)]
    seed: u64,
    /// Calls to run (P6: 8000).
    #[arg(long)]
    calls: Option<u64>,
    /// Worker client instances (P6: 2).
    #[arg(long)]
    workers: Option<u32>,
    /// Calls in flight per worker (P6: 32).
    #[arg(long)]
    concurrency: Option<u32>,
    /// A library scenario by name (p6, flapping, slow-decay, all-dead, account-429-storm,
    /// toxic-prompts, mixed-8-sources, provider-quirks, outage-and-recovery), or a
    /// scenario file (TOML, or JSON such as a stored run's scenario.json). Flags
    /// override it. Default: p6.
    #[arg(long)]
    scenario: Option<String>,
    /// Run every library scenario with every profile (each at its own call count, or
    /// `--calls`) and print one table: scenario x profile.
    #[arg(long, conflicts_with_all = ["scenario", "rescore", "worker_index"])]
    matrix: bool,
    /// Run directory (default `soak-runs/<scenario>-seed-<seed>-<unix time>`, or
    /// `soak-runs/matrix-<unix time>`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Re-judge a stored run directory without traffic, rewriting its report (the
    /// run's own scenario and profiles: no other flag applies).
    #[arg(
        long,
        value_name = "RUN",
        conflicts_with_all = [
            "profiles", "seed", "calls", "workers", "concurrency", "scenario", "out",
            "backend", "time_scale", "redis_url", "key_prefix", "balance_choices",
        ]
    )]
    rescore: Option<PathBuf>,
    /// State backend: `memory` (virtual time, one process) or `redis` (real time,
    /// `--workers` processes sharing one Redis, the simulator over HTTP on loopback;
    /// needs `--time-scale`; pgw profile only).
    #[arg(long, default_value = "memory")]
    backend: String,
    /// Time scale of the Redis mode: every scenario duration times S (e.g. 0.0166667
    /// for 1/60: a scenario minute lasts one second). Also accepts `1/N`.
    #[arg(long, value_parser = parse_scale)]
    time_scale: Option<f64>,
    /// Redis of the Redis mode (default: the REDIS_URL environment variable).
    #[arg(long)]
    redis_url: Option<String>,
    /// Prefix of every Redis key of the run (default: unique per run).
    #[arg(long)]
    key_prefix: Option<String>,
    /// Internal: run as worker I of the Redis mode run in `--out`.
    #[arg(long, hide = true)]
    worker_index: Option<u32>,
    /// No progress bars.
    #[arg(long)]
    no_progress: bool,
    /// The pgw profile's `balance.choices`: how many sources its balancer compares for
    /// an attempt's first candidate, `all` or a number of at least 2 (default: the
    /// scenario's, else the gateway's, all).
    #[arg(long, value_name = "N|all")]
    balance_choices: Option<pgw_stack::Choices>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match real_main(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("pgw-soak: {e}");
            ExitCode::FAILURE
        }
    }
}

fn real_main(args: &Args) -> Result<ExitCode, Box<dyn std::error::Error + Send + Sync>> {
    if let Some(dir) = &args.rescore {
        let scores = rescore(dir)?;
        print!("{}", report::terminal(&scores));
        if let Some(c) = pgw_soak::commands::RedisCommands::load(dir)? {
            print!("{}", c.terminal());
        }
        println!("report: {}", dir.join("report.md").display());
        return Ok(verdict(&scores));
    }
    if let Some(i) = args.worker_index {
        let dir = args.out.as_ref().ok_or("--worker-index needs --out")?;
        run_worker(dir, i)?;
        return Ok(ExitCode::SUCCESS);
    }
    let redis = match args.backend.as_str() {
        "memory" if args.time_scale.is_some() => {
            return Err("--time-scale: only with --backend redis (memory runs in virtual time)".into());
        }
        "memory" if args.redis_url.is_some() || args.key_prefix.is_some() => {
            return Err(
                "--redis-url, --key-prefix: only with --backend redis (memory keeps no state in Redis)"
                    .into(),
            );
        }
        "memory" => false,
        "redis" => true,
        other => return Err(format!("--backend: expected memory or redis, got {other:?}").into()),
    };
    if let Some(p) = &args.profiles
        && let Some(dup) = p
            .iter()
            .enumerate()
            .find_map(|(i, k)| p[..i].contains(k).then_some(k))
    {
        return Err(format!("--profiles: {} is listed twice", dup.as_str()).into());
    }
    if args.matrix {
        if redis {
            return Err("--matrix: runs in virtual time only (no --backend redis)".into());
        }
        return matrix_main(args);
    }
    let mut scenario = match &args.scenario {
        Some(p) => Scenario::named_or_file(p)?,
        None => Scenario::p6(args.seed),
    };
    if args.scenario.is_none() {
        scenario.seed = args.seed;
    }
    apply_flags(args, &mut scenario);
    let dir = run_dir(args, &format!("{}-seed-{}", scenario.name, scenario.seed));
    if redis {
        return redis_main(args, &scenario, &dir);
    }
    let opts = RunOptions {
        profiles: args.profiles.clone().unwrap_or_else(|| ProfileKind::ALL.to_vec()),
        dir: Some(dir.clone()),
        progress: !args.no_progress,
    };
    let outcome = run(&scenario, &opts)?;
    println!();
    print!("{}", report::terminal(&outcome.scores));
    for (p, why) in &outcome.skipped {
        println!("{p}: skipped ({why})");
    }
    println!("report: {}", dir.join("report.md").display());
    // pgw asked for and not run fails the run: a CI gate must not pass on nothing.
    if outcome.skipped.iter().any(|(p, _)| *p == ProfileKind::Pgw) {
        eprintln!("pgw-soak: the pgw profile could not run");
        return Ok(ExitCode::FAILURE);
    }
    Ok(verdict(&outcome.scores))
}

/// The flags that override a scenario: `--seed` (when not the default), `--calls`,
/// `--workers`, `--concurrency`, `--balance-choices`.
fn apply_flags(args: &Args, scenario: &mut Scenario) {
    if let Some(c) = args.balance_choices {
        scenario.pgw.balance_choices = Some(c);
    }
    if args.seed != DEFAULT_SEED {
        scenario.seed = args.seed;
    }
    if let Some(n) = args.calls {
        scenario.calls = n;
    }
    if let Some(n) = args.workers {
        scenario.workers = n;
    }
    if let Some(n) = args.concurrency {
        scenario.concurrency = n;
    }
}

/// `--out`, or `soak-runs/<stem>-<unix time>` (`-2`, `-3`, ... after it when a run of
/// the same second has it: two runs wrote into one directory).
fn run_dir(args: &Args, stem: &str) -> PathBuf {
    args.out.clone().unwrap_or_else(|| {
        // The directory name only; no duration is measured with the wall clock here.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let base = PathBuf::from("soak-runs").join(format!("{stem}-{now}"));
        if !base.exists() {
            return base;
        }
        (2..)
            .map(|n| base.with_file_name(format!("{stem}-{now}-{n}")))
            .find(|p| !p.exists())
            .unwrap_or(base)
    })
}

fn matrix_main(args: &Args) -> Result<ExitCode, Box<dyn std::error::Error + Send + Sync>> {
    let mut scenarios = pgw_soak::scenario::library()?;
    for s in &mut scenarios {
        apply_flags(args, s);
    }
    let dir = run_dir(args, "matrix");
    let opts = MatrixOptions {
        profiles: args.profiles.clone().unwrap_or_else(|| ProfileKind::ALL.to_vec()),
        dir: dir.clone(),
        threads: std::thread::available_parallelism().map_or(2, std::num::NonZero::get),
        progress: !args.no_progress,
    };
    let cells = run_matrix(&scenarios, &opts)?;
    print!("{}", matrix_table(&cells));
    println!("matrix: {}", dir.join("matrix.md").display());
    // Each scenario's pgw row was judged against its oracle row by `run_matrix`.
    let pgw_failed = cells
        .iter()
        .any(|c| c.score.profile == ProfileKind::Pgw.as_str() && !c.score.passed());
    Ok(if pgw_failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn redis_main(
    args: &Args,
    scenario: &Scenario,
    dir: &Path,
) -> Result<ExitCode, Box<dyn std::error::Error + Send + Sync>> {
    if let Some(p) = &args.profiles
        && p.as_slice() != [ProfileKind::Pgw]
    {
        return Err("--profiles: the Redis mode runs the pgw profile only (--profiles pgw)".into());
    }
    let time_scale = args
        .time_scale
        .ok_or("--time-scale: required with --backend redis (e.g. 1/60)")?;
    let redis_url = match &args.redis_url {
        Some(u) => u.clone(),
        None => std::env::var("REDIS_URL")
            .map_err(|_| "--redis-url: required with --backend redis (or set REDIS_URL)")?,
    };
    let key_prefix = args.key_prefix.clone().unwrap_or_else(|| {
        format!(
            "pgw-soak:{}:{}",
            dir.file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            std::process::id()
        )
    });
    let opts = RedisOptions {
        redis_url,
        key_prefix,
        time_scale,
        dir: dir.to_path_buf(),
        exe: std::env::current_exe()?,
    };
    let outcome = run_redis(scenario, &opts)?;
    print!("{}", report::terminal(&outcome.scores));
    if let Some(c) = &outcome.redis_commands {
        print!("{}", c.terminal());
    }
    println!("report: {}", dir.join("report.md").display());
    Ok(verdict(&outcome.scores))
}

/// `0.5`, or `1/N` (e.g. `1/60`).
fn parse_scale(s: &str) -> Result<f64, String> {
    let v = match s.split_once('/') {
        Some((a, b)) => {
            let a: f64 = a.trim().parse().map_err(|e| format!("{s:?}: {e}"))?;
            let b: f64 = b.trim().parse().map_err(|e| format!("{s:?}: {e}"))?;
            a / b
        }
        None => s.trim().parse().map_err(|e| format!("{s:?}: {e}"))?,
    };
    window_ms(v)?;
    Ok(v)
}

/// Fails when the pgw profile ran and failed a gating check, its bars against the
/// oracle included (`pgw_soak::acceptance`; the baselines are expected to fall short,
/// their verdicts are informational).
fn verdict(scores: &[pgw_soak::scoreboard::Score]) -> ExitCode {
    let pgw_failed = scores
        .iter()
        .any(|s| s.profile == ProfileKind::Pgw.as_str() && !s.passed());
    if pgw_failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
