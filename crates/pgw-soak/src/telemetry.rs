//! Per-attempt and per-call telemetry of a soak run, and its storage as JSON Lines.
//!
//! Every profile writes the same rows, so the scoreboard judges them all alike: one
//! [`AttemptRow`] per attempt (and per cache hit, flagged), one [`CallRow`] per call.
//! Times are milliseconds since the start of the run on the clock the limiters use
//! (tokio's clock; virtual under the paused runtime).

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pgw_core::sync::lock;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// One attempt of one call (or one cache hit), as the scoreboard reads it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRow {
    /// The call this attempt belongs to.
    pub call_id: String,
    /// 1-based attempt number within the call.
    pub attempt: u32,
    /// The worker (client instance) that made it.
    pub worker: u32,
    /// The source it was dispatched to.
    pub source: String,
    /// Admission instant on the limiter's clock, ms since the run started.
    pub admitted_ms: u64,
    /// Time from admission to the end of the attempt, ms.
    pub latency_ms: u64,
    /// Time to the first token, ms, when a first token arrived.
    pub ttft_ms: Option<u64>,
    /// Tokens counted against the TPM quota (real usage when known, else the estimate).
    pub tokens: u64,
    /// The outcome's name (`pgw_core::Outcome::as_str`).
    pub outcome: String,
    /// A response-cache hit: never reached the source nor its gates.
    pub cache_hit: bool,
    /// The provider answered that the request itself was at fault
    /// ([`is_request_error`]): whatever the client made of it, no source is to blame.
    #[serde(default)]
    pub request_error: bool,
}

/// Whether a provider's error answer (its HTTP status and error `code`, else `type`)
/// says the request is at fault, not the source: a model the caller named that does
/// not exist, a prompt too long for the context window or refused by a content
/// policy, any other 400, 413 or 422 unless its code names the key or the account.
///
/// Read from the provider's words alone, not from any profile's classifier: the
/// scoreboard judges the classifiers with it.
///
/// ```
/// use pgw_soak::telemetry::is_request_error;
///
/// assert!(is_request_error(Some(404), Some("model_not_found")));
/// assert!(is_request_error(Some(400), Some("invalid_prompt")));
/// assert!(!is_request_error(Some(400), Some("invalid_api_key")));
/// assert!(!is_request_error(Some(429), Some("insufficient_quota")));
/// assert!(!is_request_error(Some(503), None));
/// ```
#[must_use]
pub fn is_request_error(status: Option<u16>, code: Option<&str>) -> bool {
    match code {
        Some(
            "model_not_found"
            | "context_length_exceeded"
            | "content_policy_violation"
            | "content_filter"
            | "string_above_max_length",
        ) => true,
        Some(
            "invalid_api_key"
            | "authentication_error"
            | "permission_error"
            | "insufficient_quota"
            | "billing_hard_limit_reached"
            | "rate_limit_exceeded"
            | "rate_limit_error"
            | "overloaded_error",
        ) => false,
        _ => matches!(status, Some(400 | 413 | 422)),
    }
}

/// One call, as the driver saw it end.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallRow {
    /// The call id.
    pub call_id: String,
    /// The worker that ran it.
    pub worker: u32,
    /// The traffic kind (`P1` .. `P5`).
    pub kind: String,
    /// Start, ms since the run started.
    pub started_ms: u64,
    /// End, ms since the run started.
    pub ended_ms: u64,
    /// Whether the call returned a valid answer.
    pub ok: bool,
    /// `ok`, or why the call failed (see [`crate::driver::failure_cause`]).
    pub cause: String,
    /// The caller asked for a streamed answer.
    #[serde(default)]
    pub stream: bool,
    /// When the answer's first chunk reached the caller, ms since the run started
    /// (`None`: no answer reached it). A client that hands the caller the whole answer
    /// at once delivers its first chunk at `ended_ms`.
    #[serde(default)]
    pub first_chunk_ms: Option<u64>,
}

/// The run's clock: milliseconds since the run started, on tokio's clock.
#[derive(Clone, Copy, Debug)]
pub struct RunClock {
    start: Instant,
}

impl RunClock {
    /// A clock starting now.
    #[must_use]
    pub fn start() -> Self {
        Self {
            start: Instant::now(),
        }
    }

    /// The instant the run started.
    #[must_use]
    pub const fn origin(&self) -> Instant {
        self.start
    }

    /// Milliseconds since the run started.
    #[must_use]
    pub fn now_ms(&self) -> u64 {
        self.ms_at(Instant::now())
    }

    /// Milliseconds from the run start to `t` (0 if `t` is earlier).
    #[must_use]
    pub fn ms_at(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.start).as_millis()).unwrap_or(u64::MAX)
    }
}

/// Live counters for the progress display.
#[derive(Debug, Default)]
pub struct LiveStats {
    /// Attempts per source index (same order as [`Recorder::sources`]).
    attempts: Vec<AtomicU64>,
}

/// Collects the rows of one profile's run; cheap to clone (a handle).
#[derive(Clone, Debug)]
pub struct Recorder {
    inner: Arc<RecorderInner>,
}

#[derive(Debug)]
struct RecorderInner {
    clock: RunClock,
    sources: Vec<String>,
    live: LiveStats,
    attempts: Mutex<Rows<AttemptRow>>,
    calls: Mutex<Rows<CallRow>>,
}

/// Rows kept in memory, or streamed to a JSON Lines file so the harness's own memory
/// stays flat and the RSS samples measure the client, not the telemetry.
#[derive(Debug)]
enum Rows<T> {
    Memory(Vec<T>),
    File(BufWriter<fs::File>),
}

impl<T: Serialize> Rows<T> {
    fn push(&mut self, row: T) {
        match self {
            Self::Memory(v) => v.push(row),
            Self::File(w) => {
                // A failed write shows at flush time in `finish`; the run goes on.
                let _ = serde_json::to_writer(&mut *w, &row).map(|()| w.write_all(b"\n"));
            }
        }
    }

    fn take(&mut self) -> std::io::Result<Vec<T>> {
        match self {
            Self::Memory(v) => Ok(std::mem::take(v)),
            Self::File(w) => w.flush().map(|()| Vec::new()),
        }
    }
}

impl Recorder {
    /// A recorder keeping rows in memory, for a run over `sources` timed by `clock`.
    #[must_use]
    pub fn in_memory(clock: RunClock, sources: Vec<String>) -> Self {
        Self::with(clock, sources, Rows::Memory(Vec::new()), Rows::Memory(Vec::new()))
    }

    /// A recorder streaming rows to `<profile>.attempts.jsonl` and
    /// `<profile>.calls.jsonl` in `dir`.
    ///
    /// # Errors
    /// The files cannot be created.
    pub fn to_dir(clock: RunClock, sources: Vec<String>, dir: &Path, profile: &str) -> std::io::Result<Self> {
        let open = |kind: &str| -> std::io::Result<BufWriter<fs::File>> {
            let path = dir.join(format!("{profile}.{kind}.jsonl"));
            fs::File::create(&path)
                .map(BufWriter::new)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
        };
        Ok(Self::with(
            clock,
            sources,
            Rows::File(open("attempts")?),
            Rows::File(open("calls")?),
        ))
    }

    fn with(clock: RunClock, sources: Vec<String>, attempts: Rows<AttemptRow>, calls: Rows<CallRow>) -> Self {
        let live = LiveStats {
            attempts: sources.iter().map(|_| AtomicU64::new(0)).collect(),
        };
        Self {
            inner: Arc::new(RecorderInner {
                clock,
                sources,
                live,
                attempts: Mutex::new(attempts),
                calls: Mutex::new(calls),
            }),
        }
    }

    /// The run's clock.
    #[must_use]
    pub fn clock(&self) -> RunClock {
        self.inner.clock
    }

    /// The pool's source names.
    #[must_use]
    pub fn sources(&self) -> &[String] {
        &self.inner.sources
    }

    /// Records one attempt.
    pub fn attempt(&self, row: AttemptRow) {
        if !row.cache_hit
            && let Some(i) = self.inner.sources.iter().position(|s| *s == row.source)
        {
            self.inner.live.attempts[i].fetch_add(1, Ordering::Relaxed);
        }
        lock(&self.inner.attempts).push(row);
    }

    /// Records one finished call.
    pub fn call(&self, row: CallRow) {
        lock(&self.inner.calls).push(row);
    }

    /// Attempts so far per source (cache hits excluded), in pool order.
    #[must_use]
    pub fn live_attempts(&self) -> Vec<(String, u64)> {
        self.inner
            .sources
            .iter()
            .zip(&self.inner.live.attempts)
            .map(|(s, n)| (s.clone(), n.load(Ordering::Relaxed)))
            .collect()
    }

    /// Ends recording: returns the in-memory rows (empty when streaming to files, which
    /// are flushed).
    ///
    /// # Errors
    /// Flushing the files failed.
    pub fn finish(&self) -> std::io::Result<(Vec<AttemptRow>, Vec<CallRow>)> {
        let a = lock(&self.inner.attempts).take()?;
        let c = lock(&self.inner.calls).take()?;
        Ok((a, c))
    }
}

/// One current-RSS sample (from `/proc/self/statm`, not the peak).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RssSample {
    /// Calls done when sampled.
    pub calls_done: u64,
    /// Resident set size, KiB.
    pub rss_kib: u64,
}

/// What was left in the gates' books after the run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accounting {
    /// What is really left after the run: counter name (`inflight s1`, `leases held
    /// source:s1`, ...) -> value. All must be zero.
    pub counters: BTreeMap<String, u64>,
    /// Informational: what failed to settle and was left to expire by its TTL, as
    /// designed (`lease settle failures s1`, `leases lost s1`, ...). Not a failure:
    /// whatever of it would still be there is counted in `counters`.
    #[serde(default)]
    pub expired_by_ttl: BTreeMap<String, u64>,
}

/// A quota the scoreboard checks: at most `limit` in any `window_ms` span in `scope`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaRule {
    /// `source s4` or `account a1`.
    pub scope: String,
    /// The sources the scope covers.
    pub sources: Vec<String>,
    /// `rpm` or `tpm`.
    pub dimension: String,
    /// The most admissions (rpm) or tokens (tpm) per window.
    pub limit: u64,
    /// Window length, ms: at most `limit` in every span of this length, wherever it
    /// starts.
    /// Default 60 000.
    #[serde(default = "default_window_ms")]
    pub window_ms: u64,
}

const fn default_window_ms() -> u64 {
    60_000
}

/// Everything one profile's run produced.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfileRun {
    /// The profile's name.
    pub profile: String,
    /// Per-attempt rows.
    #[serde(skip)]
    pub attempts: Vec<AttemptRow>,
    /// Per-call rows.
    #[serde(skip)]
    pub calls: Vec<CallRow>,
    /// RSS samples through the run.
    pub rss: Vec<RssSample>,
    /// Accounting left after the run.
    pub accounting: Accounting,
    /// Quotas the profile was configured to respect.
    pub quotas: Vec<QuotaRule>,
    /// Wall time of the run, ms (informational; not judged).
    pub wall_ms: u64,
    /// Scenario (virtual or scaled) time of the run, ms.
    pub scenario_ms: u64,
    /// The pool's source names, in order.
    pub sources: Vec<String>,
    /// Real seconds per scenario second of the rows' times (1 in virtual time; the
    /// Redis mode's `--time-scale`): the time figures divide durations by it.
    #[serde(default = "unscaled")]
    pub time_scale: f64,
    /// Requests the profile's processes sent to Redis over the calls of the run
    /// ([`pgw_core::redis_conn::round_trips`]): the Redis mode's; `None` elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis_round_trips: Option<u64>,
    /// Commands the profile's processes sent to Redis over the calls of the run
    /// ([`pgw_core::redis_conn::commands_sent`]: a pipeline's commands each, a script
    /// call once): the Redis mode's; `None` elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redis_commands_sent: Option<u64>,
    /// The requests each source of the simulator received over the run, by its own
    /// count (`pgw_sim::SourceStats::received`): what the provider saw, against which
    /// the upstream rows are judged. Empty where the simulator is not in the process
    /// (the Redis mode's workers) and in runs stored before it was kept.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub provider_received: BTreeMap<String, u64>,
}

const fn unscaled() -> f64 {
    1.0
}

impl Default for ProfileRun {
    fn default() -> Self {
        Self {
            profile: String::new(),
            attempts: Vec::new(),
            calls: Vec::new(),
            rss: Vec::new(),
            accounting: Accounting::default(),
            quotas: Vec::new(),
            wall_ms: 0,
            scenario_ms: 0,
            sources: Vec::new(),
            time_scale: 1.0,
            redis_round_trips: None,
            redis_commands_sent: None,
            provider_received: BTreeMap::new(),
        }
    }
}

fn write_jsonl<T: Serialize>(path: &Path, rows: &[T]) -> std::io::Result<()> {
    let mut w = BufWriter::new(fs::File::create(path)?);
    for r in rows {
        serde_json::to_writer(&mut w, r)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

fn read_jsonl<T: for<'de> Deserialize<'de>>(path: &Path) -> std::io::Result<Vec<T>> {
    let r = BufReader::new(fs::File::open(path)?);
    let mut rows = Vec::new();
    for (i, line) in r.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        rows.push(serde_json::from_str(&line).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}:{}: {e}", path.display(), i + 1),
            )
        })?);
    }
    Ok(rows)
}

impl ProfileRun {
    /// Writes `<profile>.attempts.jsonl`, `<profile>.calls.jsonl` and
    /// `<profile>.run.json` into `dir`.
    ///
    /// # Errors
    /// Any I/O error, with the file's path.
    pub fn store(&self, dir: &Path) -> std::io::Result<()> {
        let p = &self.profile;
        write_jsonl(&dir.join(format!("{p}.attempts.jsonl")), &self.attempts)?;
        write_jsonl(&dir.join(format!("{p}.calls.jsonl")), &self.calls)?;
        self.store_meta(dir)
    }

    /// Writes only `<profile>.run.json` (the rows were streamed by the recorder).
    ///
    /// # Errors
    /// Any I/O error.
    pub fn store_meta(&self, dir: &Path) -> std::io::Result<()> {
        let p = &self.profile;
        let meta = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        fs::write(dir.join(format!("{p}.run.json")), meta)
    }

    /// Reads back what [`store`](Self::store) wrote for `profile`.
    ///
    /// # Errors
    /// Missing or malformed files, naming the file.
    pub fn load(dir: &Path, profile: &str) -> std::io::Result<Self> {
        let meta_path = dir.join(format!("{profile}.run.json"));
        let meta = fs::read(&meta_path)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", meta_path.display())))?;
        let mut run: Self = serde_json::from_slice(&meta).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: {e}", meta_path.display()),
            )
        })?;
        run.attempts = read_jsonl(&dir.join(format!("{profile}.attempts.jsonl")))?;
        run.calls = read_jsonl(&dir.join(format!("{profile}.calls.jsonl")))?;
        Ok(run)
    }

    /// Checks that every row lies within the run: no attempt admitted, no call started
    /// or ended later than `slack_ms` after the run's end (`scenario_ms`; the books are
    /// read a while after the last call, and an attempt may still be admitted then). A
    /// stored run with such a row is damaged (an `admitted_ms` of `u64::MAX` was judged
    /// as if it were a time).
    ///
    /// # Errors
    /// The first row past the run's end, named.
    pub fn check_times(&self, slack_ms: u64) -> Result<(), String> {
        let end = self.scenario_ms.saturating_add(slack_ms);
        let past = |what: String, ms: u64| {
            format!(
                "{what} at {ms} ms, after the run's end ({} ms) plus {slack_ms} ms: the stored \
                 rows are damaged",
                self.scenario_ms
            )
        };
        let p = &self.profile;
        if let Some(a) = self.attempts.iter().find(|a| a.admitted_ms > end) {
            return Err(past(
                format!(
                    "{p}.attempts.jsonl: call {} attempt {} admitted",
                    a.call_id, a.attempt
                ),
                a.admitted_ms,
            ));
        }
        if let Some(c) = self.calls.iter().find(|c| c.started_ms.max(c.ended_ms) > end) {
            return Err(past(
                format!("{p}.calls.jsonl: call {} ended", c.call_id),
                c.started_ms.max(c.ended_ms),
            ));
        }
        Ok(())
    }
}

/// The JSON file at `path` read as `T`, or `None` when there is no such file (a run
/// that did not write it: `redis-commands.json` and `realtime.json` are the Redis
/// mode's only).
///
/// # Errors
/// The file is there but cannot be read or parsed, naming it.
pub(crate) fn read_json_if_there<T: for<'de> Deserialize<'de>>(
    path: &Path,
) -> Result<Option<T>, pgw_core::BoxError> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display()).into()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display()).into()),
    }
}

/// The profiles stored in a run directory, in the order they were run.
///
/// # Errors
/// `profiles.txt` cannot be read, lists no profile, or names one that is not a profile.
pub fn stored_profiles(dir: &Path) -> std::io::Result<Vec<String>> {
    let order = fs::read_to_string(dir.join("profiles.txt"))
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}/profiles.txt: {e}", dir.display())))?;
    let names: Vec<String> = order
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    // Said here: an empty list judged nothing and exited 0, and an unknown name was
    // reported as its missing run file.
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    if names.is_empty() {
        return Err(bad(format!("{}/profiles.txt: lists no profile", dir.display())));
    }
    if let Some(n) = names
        .iter()
        .find(|n| n.parse::<crate::profiles::ProfileKind>().is_err())
    {
        return Err(bad(format!(
            "{}/profiles.txt: {n:?} is not a profile (naive, tower-stock, pgw, oracle)",
            dir.display()
        )));
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_txt_must_name_profiles() {
        let dir = std::env::temp_dir().join(format!("pgw-soak-profiles-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let with = |text: &str| {
            fs::write(dir.join("profiles.txt"), text).unwrap();
            stored_profiles(&dir).map_err(|e| e.to_string())
        };
        assert_eq!(with("naive\n\npgw\n").unwrap(), ["naive", "pgw"]);
        assert!(with("\n").unwrap_err().contains("lists no profile"));
        assert!(
            with("pgw\nbogus\n")
                .unwrap_err()
                .contains("\"bogus\" is not a profile")
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn rows_past_the_runs_end_are_named() {
        let row = |call: &str, admitted_ms: u64| AttemptRow {
            call_id: call.into(),
            attempt: 2,
            worker: 0,
            source: "s1".into(),
            admitted_ms,
            latency_ms: 1,
            ttft_ms: None,
            tokens: 1,
            outcome: "success".into(),
            cache_hit: false,
            request_error: false,
        };
        let call = |id: &str, ended_ms: u64| CallRow {
            call_id: id.into(),
            worker: 0,
            kind: "P1".into(),
            started_ms: 0,
            ended_ms,
            ok: true,
            cause: "ok".into(),
            stream: false,
            first_chunk_ms: None,
        };
        let mut run = ProfileRun {
            profile: "pgw".into(),
            scenario_ms: 10_000,
            attempts: vec![row("a", 0), row("b", 10_500)],
            calls: vec![call("a", 10_000)],
            ..ProfileRun::default()
        };
        run.check_times(1_000).unwrap();
        run.attempts.push(row("c", u64::MAX));
        let e = run.check_times(1_000).unwrap_err();
        assert_eq!(
            e,
            format!(
                "pgw.attempts.jsonl: call c attempt 2 admitted at {} ms, after the run's end \
                 (10000 ms) plus 1000 ms: the stored rows are damaged",
                u64::MAX
            )
        );
        run.attempts.pop();
        run.calls.push(call("z", 11_001));
        let e = run.check_times(1_000).unwrap_err();
        assert!(e.starts_with("pgw.calls.jsonl: call z ended at 11001 ms"), "{e}");
        // A slack past u64::MAX saturates: nothing is past the end of time.
        run.check_times(u64::MAX).unwrap();
    }
}
