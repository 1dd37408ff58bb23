//! The real-time Redis mode (`--backend redis --workers N --time-scale S`): several
//! worker processes sharing one Redis, the simulator served over HTTP on loopback,
//! every duration of the scenario times `S`.
//!
//! The parent ([`run_redis`]) serves the pool (`pgw_sim::http::serve` on
//! `127.0.0.1`, the pool's `time_scale` set to `S`), writes `scenario.json` and
//! `realtime.json` into the run directory, and starts `N` processes of the same binary
//! (`pgw-soak --worker-index I --out DIR`). Each worker ([`run_worker`]) builds a pgw
//! `Gateway` on the shared Redis (unique key prefix per run), runs its share of the
//! traffic (calls `I, I + N, ...`) with bounded concurrency, and stores its rows as
//! JSON Lines (`pgw.wI.*`). The parent then merges the rows into `pgw.*`, adds what
//! the provider still holds in flight, and judges them with the scoreboard: quota
//! windows are one scaled scenario minute, on the Redis server clock (the limiter's
//! admission record).

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use indicatif::ProgressBar;
use pgw_core::BoxError;
use serde::{Deserialize, Serialize};

use crate::commands::RedisCommands;
use crate::driver::{DriveOptions, drive};
use crate::profiles::pgw::{RedisWorker, build_redis};
use crate::profiles::{BuildError, ProfileKind};
use crate::run::{RSS_SAMPLES, RunOutcome, describe, expectations, traffic, write_report};
use crate::scenario::{QUOTA_WINDOW, Scenario};
use crate::scoreboard;
use crate::telemetry::{ProfileRun, Recorder, RunClock};

/// The file of the Redis commands the run made ([`RedisCommands`]).
pub const COMMANDS_FILE: &str = "redis-commands.json";

/// The file the parent writes for its workers.
pub const REALTIME_FILE: &str = "realtime.json";

/// The environment variable the parent gives its workers the Redis URL in (the run
/// directory's `realtime.json` keeps it without its password).
pub const REDIS_URL_ENV: &str = "PGW_SOAK_WORKER_REDIS_URL";

/// Scenario time given to the books to settle after the last call, before the time
/// scale (as in virtual time: 5 s); at least [`MIN_SETTLE`] of real time.
const SETTLE: Duration = Duration::from_secs(5);
/// The shortest real settling time (Redis round trips of spawned releases).
const MIN_SETTLE: Duration = Duration::from_millis(500);

/// What the parent tells its workers (stored as `realtime.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RealTime {
    /// The shared Redis (`redis://...` or `redis+cluster://...`), its password
    /// hidden: the workers get the URL itself in [`REDIS_URL_ENV`].
    pub redis_url: String,
    /// Prefix of every Redis key of the run.
    pub key_prefix: String,
    /// The simulator's address on loopback.
    pub sim_addr: SocketAddr,
    /// Every scenario duration times this.
    pub time_scale: f64,
    /// Worker processes.
    pub workers: u32,
    /// The rate window, ms: one scenario minute times the scale.
    pub window_ms: u64,
    /// Origin of the rows' admission instants, Unix ms (a multiple of `window_ms`).
    pub origin_ms: u64,
}

/// How to run the Redis mode.
#[derive(Clone, Debug)]
pub struct RedisOptions {
    /// The shared Redis.
    pub redis_url: String,
    /// Prefix of every Redis key (unique per run).
    pub key_prefix: String,
    /// Every scenario duration times this (e.g. `1/60`).
    pub time_scale: f64,
    /// The run directory (required: the workers write their rows there).
    pub dir: PathBuf,
    /// The worker binary (this `pgw-soak`).
    pub exe: PathBuf,
}

/// The rate window of time scale `s`, ms (one scenario minute times `s`).
///
/// # Errors
/// A message naming `--time-scale` when `s` is not in `(0, 1]` or the window would be
/// shorter than 100 ms.
pub fn window_ms(s: f64) -> Result<u64, String> {
    if !(s.is_finite() && s > 0.0 && s <= 1.0) {
        return Err(format!("--time-scale: must be in (0, 1], got {s}"));
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let ms = (QUOTA_WINDOW.as_millis() as f64 * s).round() as u64;
    if ms < 100 {
        return Err(format!(
            "--time-scale: {s} makes a scenario minute {ms} ms; at least 100 ms is needed"
        ));
    }
    Ok(ms)
}

fn unix_ms() -> u64 {
    // Only an origin for the rows (rounded down to a window); no duration is measured.
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn done_file(dir: &Path, i: u32) -> PathBuf {
    dir.join(format!("{}.done", worker_profile(i)))
}

/// The longest a worker waits for its peers to finish their calls (real time).
const BARRIER_TIMEOUT: Duration = Duration::from_secs(600);

/// Marks worker `index` done and waits until every worker of the run is.
async fn barrier(dir: &Path, index: u32, workers: u32) -> Result<(), BoxError> {
    fs::write(done_file(dir, index), b"")?;
    let wait = async {
        while !(0..workers).all(|i| done_file(dir, i).exists()) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(BARRIER_TIMEOUT, wait).await.map_err(|_| {
        format!("worker {index}: the other workers did not finish within {BARRIER_TIMEOUT:?}")
    })?;
    Ok(())
}

fn worker_profile(i: u32) -> String {
    format!("{}.w{i}", ProfileKind::Pgw.as_str())
}

/// Kills the worker processes still running when dropped (an error path).
struct Workers(Vec<Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Runs the pgw profile in real time over Redis with `scenario.workers` processes,
/// merges and judges their rows, writes the report.
///
/// # Errors
/// Bad options, the simulator cannot be served, a worker fails, or I/O errors.
pub fn run_redis(scenario: &Scenario, opts: &RedisOptions) -> Result<RunOutcome, BoxError> {
    let window_ms = window_ms(opts.time_scale)?;
    let mut scenario = scenario.clone();
    scenario.pool.time_scale = opts.time_scale;
    scenario.validate()?;
    if opts.key_prefix.is_empty() {
        return Err(
            "--key-prefix: must not be empty (the run's keys would sit at the top of the database)".into(),
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    // Before anything is written: an unreachable Redis left a directory that
    // `--rescore` could not read.
    let taken = rt
        .block_on(crate::commands::keys_under(
            &opts.redis_url,
            &opts.key_prefix,
            false,
        ))
        .map_err(|e| format!("--redis-url: {e}"))?;
    if taken > 0 {
        return Err(format!(
            "--key-prefix {:?}: {taken} keys are there already (another run's cache and breakers \
             would be this run's state): choose another prefix, or delete them",
            opts.key_prefix
        )
        .into());
    }
    let dir = &opts.dir;
    fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    fs::write(dir.join("scenario.json"), serde_json::to_vec_pretty(&scenario)?)?;
    let wall = std::time::Instant::now();
    let pool = pgw_sim::SimPool::new(scenario.pool.clone(), scenario.seed)?;
    let (sim_addr, server) = rt.block_on(pgw_sim::http::serve(
        pool.clone(),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    ))?;
    let real = RealTime {
        redis_url: pgw_core::redis_conn::redact_url(&opts.redis_url),
        key_prefix: opts.key_prefix.clone(),
        sim_addr,
        time_scale: opts.time_scale,
        workers: scenario.workers,
        window_ms,
        origin_ms: unix_ms() / window_ms * window_ms,
    };
    fs::write(dir.join(REALTIME_FILE), serde_json::to_vec_pretty(&real)?)?;
    let before = rt.block_on(crate::commands::read(&opts.redis_url))?;
    let mut workers = Workers(Vec::new());
    for i in 0..scenario.workers {
        match fs::remove_file(done_file(dir, i)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
            _ => {}
        }
    }
    for i in 0..scenario.workers {
        let child = Command::new(&opts.exe)
            .arg("--worker-index")
            .arg(i.to_string())
            .arg("--out")
            .arg(dir)
            .env(REDIS_URL_ENV, &opts.redis_url)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start worker {i} ({}): {e}", opts.exe.display()))?;
        workers.0.push(child);
    }
    // Waits for every worker; the first failure stops the others (dropping `workers`).
    let mut running: Vec<usize> = (0..workers.0.len()).collect();
    while !running.is_empty() {
        let mut still = Vec::new();
        for i in running {
            match workers.0[i].try_wait()? {
                None => still.push(i),
                Some(status) if status.success() => {}
                Some(status) => return Err(format!("worker {i}: {status} (see its stderr)").into()),
            }
        }
        running = still;
        rt.block_on(async { tokio::time::sleep(Duration::from_millis(50)).await });
    }
    let settle = SETTLE.mul_f64(opts.time_scale).max(MIN_SETTLE);
    rt.block_on(async { tokio::time::sleep(settle).await });
    let after = rt.block_on(crate::commands::read(&opts.redis_url))?;
    // The run's keys, now that the server's counts are read (the cache's would live
    // for hours).
    match rt.block_on(crate::commands::keys_under(
        &opts.redis_url,
        &opts.key_prefix,
        true,
    )) {
        Ok(_) => {}
        Err(e) => eprintln!(
            "pgw-soak: the run's keys under {:?} were not removed: {e}",
            opts.key_prefix
        ),
    }
    let mut commands = RedisCommands::between_readings(&before, &after, scenario.calls);
    // Stored now, so a merge that fails below does not lose the server's counts, and
    // again with the round trips once merged.
    fs::write(dir.join(COMMANDS_FILE), serde_json::to_vec_pretty(&commands)?)?;
    let stats = pool.stats();
    rt.block_on(server.shutdown());
    drop(rt);
    let mut run = merge(dir, &scenario, &real)?;
    commands.round_trips = run.redis_round_trips;
    commands.sent = run.redis_commands_sent;
    fs::write(dir.join(COMMANDS_FILE), serde_json::to_vec_pretty(&commands)?)?;
    for (name, st) in stats.sources {
        run.accounting
            .counters
            .insert(format!("provider in flight {name}"), st.in_flight);
    }
    run.wall_ms = u64::try_from(wall.elapsed().as_millis()).unwrap_or(u64::MAX);
    run.store(dir)?;
    let pgw = ProfileKind::Pgw.as_str();
    let score = scoreboard::judge(&run, &expectations(pgw, &scenario));
    fs::write(dir.join("profiles.txt"), format!("{pgw}\n"))?;
    let mut scores = vec![score];
    // Only pgw runs here: its bars against the oracle say they are not judged.
    crate::acceptance::judge(&mut scores, &scenario);
    write_report(dir, &scenario.name, &describe_redis(&scenario, &real), &scores)?;
    let report = dir.join("report.md");
    let mut md = fs::read_to_string(&report)?;
    md.push_str(&commands.markdown());
    fs::write(&report, md)?;
    Ok(RunOutcome {
        scores,
        skipped: Vec::new(),
        redis_commands: Some(commands),
    })
}

/// The report's scenario line in the Redis mode.
#[must_use]
pub fn describe_redis(s: &Scenario, real: &RealTime) -> String {
    describe(s).replace(
        "virtual time, memory backend",
        &format!(
            "real time x {} (a scenario minute lasts {} ms), Redis backend, {} worker processes, \
             the simulator over HTTP on loopback",
            real.time_scale, real.window_ms, real.workers
        ),
    )
}

/// Merges the workers' stored runs into the `pgw` run (rows of every worker; books
/// of every worker, judged and expired by TTL, prefixed `wI`; worker 0's RSS samples;
/// quota windows scaled; the workers' Redis round trips summed, `None` when one did not
/// count them).
fn merge(dir: &Path, scenario: &Scenario, real: &RealTime) -> Result<ProfileRun, BoxError> {
    let mut merged = ProfileRun {
        profile: ProfileKind::Pgw.as_str().to_owned(),
        time_scale: real.time_scale,
        sources: scenario.pool.sources.iter().map(|s| s.name.clone()).collect(),
        quotas: scenario.judged_quotas(),
        ..ProfileRun::default()
    };
    for q in &mut merged.quotas {
        q.window_ms = real.window_ms;
    }
    // Summed over the workers; unknown when one did not count.
    let sum = |a: Option<u64>, b: Option<u64>| a.zip(b).map(|(a, b)| a + b);
    merged.redis_round_trips = Some(0);
    merged.redis_commands_sent = Some(0);
    for i in 0..real.workers {
        let w = ProfileRun::load(dir, &worker_profile(i))?;
        merged.redis_round_trips = sum(merged.redis_round_trips, w.redis_round_trips);
        merged.redis_commands_sent = sum(merged.redis_commands_sent, w.redis_commands_sent);
        merged.attempts.extend(w.attempts);
        merged.calls.extend(w.calls);
        if i == 0 {
            merged.rss = w.rss;
        }
        merged.scenario_ms = merged.scenario_ms.max(w.scenario_ms);
        for (k, v) in w.accounting.counters {
            merged.accounting.counters.insert(format!("w{i} {k}"), v);
        }
        for (k, v) in w.accounting.expired_by_ttl {
            merged.accounting.expired_by_ttl.insert(format!("w{i} {k}"), v);
        }
    }
    Ok(merged)
}

/// Runs worker `index` of the Redis mode whose parent wrote `dir` (the hidden
/// `--worker-index` flag): its share of the traffic through a `Gateway` on the
/// shared Redis; stores its rows as `pgw.wINDEX.*` in `dir`.
///
/// # Errors
/// Missing or malformed run files, the gateway cannot be built, or I/O errors.
pub fn run_worker(dir: &Path, index: u32) -> Result<(), BoxError> {
    let read = |name: &str| fs::read(dir.join(name)).map_err(|e| format!("{}/{name}: {e}", dir.display()));
    let scenario: Scenario = serde_json::from_slice(&read("scenario.json")?)?;
    let real: RealTime = serde_json::from_slice(&read(REALTIME_FILE)?)?;
    if index >= real.workers {
        return Err(format!("--worker-index: {index} >= workers {}", real.workers).into());
    }
    let redis_url = std::env::var(REDIS_URL_ENV)
        .map_err(|_| format!("{REDIS_URL_ENV} is not set: a worker is started by the parent run"))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut run = rt.block_on(async {
        let clock = RunClock::start();
        // The call rows count from this worker's start, the attempt rows from the run's
        // origin (the Redis server clock): shift the calls onto the origin so a call's
        // wait before its first attempt is measured on one time line.
        let shift_ms = unix_ms().saturating_sub(real.origin_ms);
        let sources: Vec<String> = scenario.pool.sources.iter().map(|s| s.name.clone()).collect();
        let recorder = Recorder::in_memory(clock, sources.clone());
        let w = RedisWorker {
            redis_url: redis_url.clone(),
            key_prefix: real.key_prefix.clone(),
            sim_addr: real.sim_addr,
            time_scale: real.time_scale,
            window_ms: real.window_ms,
            origin_ms: real.origin_ms,
            index,
        };
        let mut built = build_redis(&scenario, &w, &recorder)
            .await
            .map_err(|e| BuildError(e.to_string()))?;
        let n = u64::from(real.workers);
        let mine = traffic(&scenario, real.time_scale).filter(move |c| (c.id - 1) % n == u64::from(index));
        let calls = (0..scenario.calls).filter(|c| c % n == u64::from(index)).count() as u64;
        let opts = DriveOptions {
            concurrency: scenario.concurrency,
            rss_samples: RSS_SAMPLES,
            calls,
        };
        let rss = drive(
            std::mem::take(&mut built.clients),
            mine,
            &recorder,
            opts,
            &ProgressBar::hidden(),
        )
        .await;
        let real_ms = clock.now_ms();
        // The breaker's probe and the limiter's leases live in the shared Redis: read
        // the books only once every worker has run its last call.
        barrier(dir, index, real.workers).await?;
        tokio::time::sleep(SETTLE.mul_f64(real.time_scale).max(MIN_SETTLE)).await;
        // The calls' round trips, their settles in the background included; not the
        // reading of the books below.
        let round_trips = pgw_core::redis_conn::round_trips();
        let commands_sent = pgw_core::redis_conn::commands_sent();
        let patience = Duration::from_secs_f64(scenario.client.total_s).mul_f64(real.time_scale);
        let accounting = built
            .settled_books(patience, Duration::from_millis(100), |_| {})
            .await;
        let (attempts, mut calls) = recorder.finish()?;
        for c in &mut calls {
            c.worker = index;
            c.started_ms += shift_ms;
            c.ended_ms += shift_ms;
            c.first_chunk_ms = c.first_chunk_ms.map(|t| t + shift_ms);
        }
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let scenario_ms = (real_ms as f64 / real.time_scale).round() as u64;
        Ok::<_, BoxError>(ProfileRun {
            profile: worker_profile(index),
            attempts,
            calls,
            rss,
            accounting,
            quotas: Vec::new(),
            wall_ms: real_ms,
            scenario_ms,
            sources,
            time_scale: real.time_scale,
            redis_round_trips: Some(round_trips),
            redis_commands_sent: Some(commands_sent),
            // The simulator runs in the parent process: not known to a worker.
            provider_received: std::collections::BTreeMap::new(),
        })
    })?;
    drop(rt);
    run.quotas = scenario.judged_quotas();
    run.store(dir)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_follows_the_scale_and_bad_scales_are_named() {
        assert_eq!(window_ms(1.0 / 60.0), Ok(1000));
        assert_eq!(window_ms(1.0), Ok(60_000));
        assert!(window_ms(0.0).unwrap_err().starts_with("--time-scale"));
        assert!(window_ms(2.0).unwrap_err().starts_with("--time-scale"));
        assert!(window_ms(f64::NAN).unwrap_err().starts_with("--time-scale"));
        assert!(window_ms(1e-4).unwrap_err().contains("at least 100 ms"));
    }

    #[test]
    fn a_worker_without_its_run_files_fails_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("pgw-soak-noworker-{}", std::process::id()));
        let err = run_worker(&dir, 0).unwrap_err().to_string();
        assert!(err.contains("scenario.json"), "{err}");
    }

    #[test]
    fn the_merge_sums_the_workers_counts_and_keeps_an_uncounted_one_unknown() {
        let dir = std::env::temp_dir().join(format!("pgw-soak-merge-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let scenario = Scenario::p6(1);
        let real = RealTime {
            redis_url: "redis://127.0.0.1:1".into(),
            key_prefix: "k".into(),
            sim_addr: SocketAddr::from(([127, 0, 0, 1], 1)),
            time_scale: 1.0 / 60.0,
            workers: 2,
            window_ms: 1000,
            origin_ms: 0,
        };
        let store = |i: u32, n: Option<u64>| {
            let w = ProfileRun {
                profile: worker_profile(i),
                redis_round_trips: n,
                redis_commands_sent: n.map(|n| n * 3),
                ..ProfileRun::default()
            };
            w.store(&dir).unwrap();
        };
        store(0, Some(30));
        store(1, Some(12));
        let merged = merge(&dir, &scenario, &real).unwrap();
        assert_eq!(merged.redis_round_trips, Some(42));
        assert_eq!(merged.redis_commands_sent, Some(126));
        store(1, None);
        let merged = merge(&dir, &scenario, &real).unwrap();
        assert_eq!(merged.redis_round_trips, None);
        assert_eq!(merged.redis_commands_sent, None);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn the_barrier_waits_for_every_worker() {
        let dir = std::env::temp_dir().join(format!("pgw-soak-barrier-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let d = dir.clone();
        let first = tokio::spawn(async move { barrier(&d, 0, 2).await.is_ok() });
        tokio::task::yield_now().await;
        assert!(done_file(&dir, 0).exists());
        assert!(!first.is_finished(), "worker 0 must wait for worker 1");
        barrier(&dir, 1, 2).await.unwrap();
        assert!(first.await.unwrap());
        fs::remove_dir_all(&dir).unwrap();
    }
}
