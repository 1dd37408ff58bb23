//! The scenario: the pool, the traffic, and what every client profile is given.
//!
//! One documented struct ([`Scenario`]) holds everything a run depends on, so a run is
//! reproducible from it and its seed, and it is stored next to the run's telemetry.
//! The pool and the traffic are the same for every profile; so are the timeouts,
//! watchdogs and quotas ([`ClientSettings`]). What differs between profiles is only
//! their own machinery ([`NaiveSettings`], [`TowerStockSettings`]; `pgw` runs with
//! `pgw-stack`'s defaults).
//!
//! Scenarios are files (TOML or JSON; every field but the pool has P6's default, see
//! the crate README); [`library`] holds the ones shipped in `scenarios/`.

use std::time::Duration;

use pgw_client::Timeouts;
use pgw_sim::PoolConfig;
use pgw_sim::p6::TrafficConfig;
use serde::{Deserialize, Serialize};

use crate::telemetry::QuotaRule;

/// Calls of the P6 run (seed 003: 8000).
pub const P6_CALLS: u64 = 8000;
/// Worker processes (client instances) of the P6 run (seed 003: 2).
pub const P6_WORKERS: u32 = 2;
/// Calls in flight per worker (seed 003: 32).
pub const P6_CONCURRENCY: u32 = 32;
/// The default seed.
pub const DEFAULT_SEED: u64 = 20_260_721;
/// Calibrated account-429 curve: added 429 probability per request in flight above
/// the knee (`pgw_sim`'s P6 preset: 0.004). See the crate README, "Calibration".
pub const CALIBRATED_CONCURRENCY_SLOPE: f64 = 0.010;
/// Calibrated account-429 curve: added 429 probability per request/minute above the
/// knee (`pgw_sim`'s P6 preset: 0.002). See the crate README, "Calibration".
pub const CALIBRATED_RPM_SLOPE: f64 = 0.005;

/// The P6 pool with the calibrated account-429 curve: `PoolConfig::p6()` with only
/// `accounts[0].rate_limit.{concurrency_slope, rpm_slope}` changed (2.5x the preset),
/// so the `naive` profile lands at the seeds' 58.1% (58.0% at the default seed).
#[must_use]
pub fn calibrated_p6_pool() -> PoolConfig {
    let mut pool = PoolConfig::p6();
    for a in pool
        .accounts
        .iter_mut()
        .filter(|a| a.name == pgw_sim::config::P6_SHARED_ACCOUNT)
    {
        // The P6 preset's curve is a constant: calibrate that constant.
        let mut curve = a.rate_limit.at(0.0);
        curve.concurrency_slope = CALIBRATED_CONCURRENCY_SLOPE;
        curve.rpm_slope = CALIBRATED_RPM_SLOPE;
        a.rate_limit = curve.into();
    }
    pool
}

/// Attempts in flight per source when a scenario gives the source no quota: 16 (P6's).
pub const DEFAULT_MAX_CONCURRENCY: u32 = 16;
/// The pgw profile's success bar when a scenario sets none: 99%.
pub const DEFAULT_SUCCESS_BAR: f64 = 0.99;
/// The calibration band of the naive profile on P6 (seed 003 measured 58.1%).
pub const P6_NAIVE_BAND: [f64; 2] = [0.50, 0.65];

/// The window every quota is enforced and judged on: one minute.
pub const QUOTA_WINDOW: Duration = Duration::from_secs(60);

/// One source's quotas as configured in every client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceQuota {
    /// The source's name in the pool.
    pub source: String,
    /// Requests per minute (`None`: unlimited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpm: Option<u64>,
    /// Tokens per minute (`None`: unlimited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<u64>,
    /// Most attempts in flight at once on this source, over all workers (default
    /// [`DEFAULT_MAX_CONCURRENCY`]).
    #[serde(default = "default_max_concurrency")]
    pub max_concurrency: u32,
}

const fn default_max_concurrency() -> u32 {
    DEFAULT_MAX_CONCURRENCY
}

impl SourceQuota {
    /// No rate quota, [`DEFAULT_MAX_CONCURRENCY`] in flight: a source a scenario gives
    /// no quota.
    #[must_use]
    pub fn unlimited(source: &str) -> Self {
        Self {
            source: source.into(),
            rpm: None,
            tpm: None,
            max_concurrency: DEFAULT_MAX_CONCURRENCY,
        }
    }
}

/// What every profile is given alike: timeouts, watchdogs, keys and quotas.
///
/// Defaults are P6's timeouts and attempts, with no quotas.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientSettings {
    /// Connect timeout, s (default 10).
    pub connect_s: f64,
    /// First-token watchdog, s (streamed answers; default 60).
    pub first_token_s: f64,
    /// Inter-token watchdog, s: the P6 "tight watchdog" (`pgw_sim`'s assumed 8 s).
    pub inter_token_s: f64,
    /// Whole attempt, s (default 180).
    pub total_s: f64,
    /// Per-source quotas; a source without an entry has none
    /// ([`SourceQuota::unlimited`]).
    pub quotas: Vec<SourceQuota>,
    /// Attempts per call (the seeds' `LLM_MAX_RETRIES` 3, for every profile).
    pub max_attempts: u32,
}

impl Default for ClientSettings {
    fn default() -> Self {
        Self {
            connect_s: 10.0,
            first_token_s: 60.0,
            inter_token_s: pgw_sim::config::P6_ASSUMED_INTER_TOKEN_WATCHDOG_S,
            total_s: 180.0,
            quotas: Vec::new(),
            max_attempts: 3,
        }
    }
}

impl ClientSettings {
    /// The per-attempt timeouts.
    #[must_use]
    pub fn timeouts(&self) -> Timeouts {
        Timeouts {
            connect: Duration::from_secs_f64(self.connect_s),
            first_token: Duration::from_secs_f64(self.first_token_s),
            inter_token: Duration::from_secs_f64(self.inter_token_s),
            total: Duration::from_secs_f64(self.total_s),
        }
    }

    /// The quota of `source` ([`SourceQuota::unlimited`] when the scenario gives none).
    #[must_use]
    pub fn quota(&self, source: &str) -> SourceQuota {
        self.quotas
            .iter()
            .find(|q| q.source == source)
            .cloned()
            .unwrap_or_else(|| SourceQuota::unlimited(source))
    }

    /// The per-source quota rules the scoreboard judges every profile on.
    #[must_use]
    pub fn quota_rules(&self) -> Vec<QuotaRule> {
        let window_ms = u64::try_from(QUOTA_WINDOW.as_millis()).unwrap_or(60_000);
        let mut rules = Vec::new();
        for q in &self.quotas {
            for (dim, limit) in [("rpm", q.rpm), ("tpm", q.tpm)] {
                if let Some(limit) = limit {
                    rules.push(QuotaRule {
                        scope: format!("source {}", q.source),
                        sources: vec![q.source.clone()],
                        dimension: dim.into(),
                        limit,
                        window_ms,
                    });
                }
            }
        }
        rules
    }
}

/// The seeds' first design, the baseline. Defaults
/// are P6's (threshold 5, cooldown 300 s, backoff 1 s, cache on).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NaiveSettings {
    /// Configured consecutive-failure threshold; the effective one is
    /// `max(this, 2 x global concurrency)`, as the seeds' first design had it.
    pub breaker_threshold: u32,
    /// Fixed open duration, s (seed 003: one probe every 5 minutes on the black hole).
    pub cooldown_s: f64,
    /// Backoff before retry `n` (1-based): `backoff_s * 2^(n-1)`.
    pub backoff_s: f64,
    /// The seed's response cache (seed 003: 2373 hits).
    pub cache: bool,
}

/// Which `tower::load` metric the tower-stock balancer uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TowerLoad {
    /// `tower::load::PendingRequests`.
    PendingRequests,
    /// `tower::load::PeakEwma` (default decay 10 s, initial RTT 1 s).
    PeakEwma,
}

impl Default for NaiveSettings {
    fn default() -> Self {
        Self {
            breaker_threshold: 5,
            cooldown_s: 300.0,
            backoff_s: 1.0,
            cache: true,
        }
    }
}

/// What a user assembles from tower alone. Defaults are P6's (tower's own example
/// values).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TowerStockSettings {
    /// The balancer's load metric.
    pub load: TowerLoad,
    /// `TpsBudget` time-to-live of deposits, s (tower's example: 10).
    pub budget_ttl_s: u64,
    /// `TpsBudget` minimum retries per second (tower's example: 10).
    pub budget_min_per_sec: u32,
    /// `TpsBudget` retry ratio (tower's example: 0.2).
    pub budget_retry_percent: f32,
    /// Backoff before retry `n`: `backoff_s * 2^(n-1)`.
    pub backoff_s: f64,
}

impl Default for TowerStockSettings {
    fn default() -> Self {
        Self {
            load: TowerLoad::PendingRequests,
            budget_ttl_s: 10,
            budget_min_per_sec: 10,
            budget_retry_percent: 0.2,
            backoff_s: 1.0,
        }
    }
}

/// How calls arrive.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Arrival {
    /// Closed loop (default, P6): each worker starts the next call when one of its
    /// `concurrency` slots frees up.
    #[default]
    Closed,
    /// Open loop: calls arrive as a Poisson process of `per_min` calls per scenario
    /// minute (seeded), whatever the client does; at most `workers x concurrency` run
    /// at once, and a call's latency counts from its arrival (a wait for a slot
    /// included).
    Open {
        /// Mean arrivals per scenario minute.
        per_min: f64,
    },
}

/// Everything a soak run depends on.
///
/// A scenario file gives what differs from [`Scenario::default`] (P6's run with no
/// quotas; see `scenarios/` and the crate README, which documents each field).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Scenario {
    /// The scenario's name: the report's title and `--scenario NAME`.
    pub name: String,
    /// One paragraph saying what the scenario shows.
    pub description: String,
    /// The seed of the pool and the traffic.
    pub seed: u64,
    /// Calls to run.
    pub calls: u64,
    /// Worker processes (client instances sharing the backend).
    pub workers: u32,
    /// Calls in flight per worker (closed loop), or at most (open loop).
    pub concurrency: u32,
    /// How calls arrive (default: closed loop).
    pub arrival: Arrival,
    /// The traffic's shape: mix, stream share, prompt and answer sizes, distinct
    /// prompts (`pgw_sim::p6::TrafficConfig`; its defaults are P6's).
    pub traffic: TrafficConfig,
    /// The simulated pool ([`calibrated_p6_pool`] unless given by a scenario file).
    pub pool: PoolConfig,
    /// What every profile gets alike.
    pub client: ClientSettings,
    /// Quotas the scoreboard judges besides the per-source ones of `client.quotas`
    /// (e.g. an account's, over several sources).
    pub quota_rules: Vec<QuotaRule>,
    /// The pgw profile's success bar (gating; default [`DEFAULT_SUCCESS_BAR`]).
    pub success_bar: f64,
    /// The naive profile's calibration band (informational; P6: [`P6_NAIVE_BAND`]).
    pub naive_band: Option<[f64; 2]>,
    /// Whether "0 breakers opened by request errors" gates the pgw profile's verdict
    /// (default false: shown, not judged).
    pub request_errors_gate: bool,
    /// On a pool where nothing can answer: the calls arriving this many scenario
    /// seconds into the run or later are judged by "fails fast once all are dead" (each
    /// should fail in under a second as `all_circuits_open`; shown for pgw, not gating;
    /// default none). `all-dead` sets 60: the first minute is for learning that the pool
    /// is dead.
    pub fail_fast_after_s: Option<f64>,
    /// pgw's successful calls' latency p95 at most this many times the oracle's
    /// (gating; default none: not judged). P6:
    /// [`P6_SUCCESS_P95_BAR`](crate::acceptance::P6_SUCCESS_P95_BAR).
    pub oracle_success_p95_max: Option<f64>,
    /// pgw's scenario time at most this many times the oracle's (gating; default
    /// none: not judged). P6: [`P6_SCENARIO_TIME_BAR`](crate::acceptance::P6_SCENARIO_TIME_BAR).
    pub oracle_scenario_time_max: Option<f64>,
    /// The naive profile's own knobs.
    pub naive: NaiveSettings,
    /// The tower-stock profile's own knobs.
    pub tower_stock: TowerStockSettings,
    /// The pgw profile's own knobs (its gateway's defaults otherwise).
    pub pgw: PgwSettings,
}

/// The pgw profile's own knobs: what a scenario sets on its gateway beyond what every
/// profile gets alike. Unset, the gateway's default.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PgwSettings {
    /// `balance.choices`: how many sources the balancer compares for an attempt's first
    /// candidate (`"all"` or a number, at least 2; default the gateway's, all).
    pub balance_choices: Option<pgw_stack::Choices>,
}

/// What a scenario file leaves out: P6's seed, calls, workers, traffic, pool, timeouts
/// and profile knobs, with no quotas, no calibration band and the name `unnamed`.
impl Default for Scenario {
    fn default() -> Self {
        Self {
            name: "unnamed".into(),
            description: String::new(),
            client: ClientSettings::default(),
            naive_band: None,
            oracle_success_p95_max: None,
            oracle_scenario_time_max: None,
            ..Self::p6(DEFAULT_SEED)
        }
    }
}

impl Scenario {
    /// The P6 scenario with `seed`.
    ///
    /// Quotas: s4 has RPM 5 (the pool's tight gate); every source
    /// has RPM 600 (seed 000 section 1: "75/min, far below RPM 600") and TPM 2,000,000;
    /// 16 attempts in flight per source at most. Timeouts: connect 10 s, first token
    /// 60 s (P2's 300 KB prompts prefill for tens of seconds), inter-token 8 s (the P6
    /// tight watchdog), 180 s per attempt (the simulator's longest TTFT is 120 s).
    #[must_use]
    pub fn p6(seed: u64) -> Self {
        let quota = |source: &str, rpm: u64| SourceQuota {
            source: source.into(),
            rpm: Some(rpm),
            tpm: Some(2_000_000),
            max_concurrency: 16,
        };
        Self {
            name: "p6".into(),
            description: "The seeds' P6 pool: a healthy source with empty completions, a revoked key, \
                a black hole, a tight RPM gate and a tight watchdog; three of them share one \
                account whose 429s grow with its load."
                .into(),
            seed,
            calls: P6_CALLS,
            workers: P6_WORKERS,
            concurrency: P6_CONCURRENCY,
            arrival: Arrival::Closed,
            traffic: TrafficConfig::default(),
            pool: calibrated_p6_pool(),
            client: ClientSettings {
                quotas: vec![
                    quota("s1", 600),
                    quota("s2", 600),
                    quota("s3", 600),
                    quota("s4", 5),
                    quota("s5", 600),
                ],
                ..ClientSettings::default()
            },
            quota_rules: Vec::new(),
            success_bar: DEFAULT_SUCCESS_BAR,
            naive_band: Some(P6_NAIVE_BAND),
            request_errors_gate: false,
            fail_fast_after_s: None,
            oracle_success_p95_max: Some(crate::acceptance::P6_SUCCESS_P95_BAR),
            oracle_scenario_time_max: Some(crate::acceptance::P6_SCENARIO_TIME_BAR),
            naive: NaiveSettings::default(),
            tower_stock: TowerStockSettings::default(),
            pgw: PgwSettings::default(),
        }
    }

    /// Every quota rule the scoreboard judges: the per-source ones of `client.quotas`
    /// and the scenario's own `quota_rules`.
    #[must_use]
    pub fn judged_quotas(&self) -> Vec<QuotaRule> {
        let mut rules = self.client.quota_rules();
        rules.extend(self.quota_rules.iter().cloned());
        rules
    }

    /// Parses a scenario file's text: TOML, or JSON when `json` is set. Unknown fields
    /// are errors; the scenario is validated.
    ///
    /// # Errors
    /// A parse error (with its line) or the first invalid field.
    pub fn parse(text: &str, json: bool) -> Result<Self, String> {
        // With the field's path: serde_json names only the line and column.
        let named = |path: String, e: String| if path == "." { e } else { format!("{path}: {e}") };
        let s: Self = if json {
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text))
                .map_err(|e| named(e.path().to_string(), e.into_inner().to_string()))?
        } else {
            toml::from_str(text).map_err(|e| e.to_string())?
        };
        s.validate()?;
        Ok(s)
    }

    /// Reads a scenario file (`.json` is JSON, anything else TOML).
    ///
    /// # Errors
    /// The file cannot be read or parsed, naming it.
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let json = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"));
        Self::parse(&text, json).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// A scenario of the library ([`library`]) by name, or a file by path.
    ///
    /// # Errors
    /// Neither a library name nor a readable scenario file; the message lists the names.
    pub fn named_or_file(name_or_path: &str) -> Result<Self, String> {
        if let Some((_, text)) = LIBRARY.iter().find(|(n, _)| *n == name_or_path) {
            return Self::parse(text, false).map_err(|e| format!("scenario {name_or_path}: {e}"));
        }
        let path = std::path::Path::new(name_or_path);
        if path.exists() {
            return Self::load(path);
        }
        let names: Vec<&str> = LIBRARY.iter().map(|(n, _)| *n).collect();
        Err(format!(
            "--scenario: {name_or_path:?} is neither a library scenario ({}) nor a file",
            names.join(", ")
        ))
    }

    /// Calls in flight over all workers (at most [`MAX_IN_FLIGHT`] in a valid
    /// scenario; saturated, never overflowed, in one that is not).
    #[must_use]
    pub const fn global_concurrency(&self) -> u32 {
        self.workers.saturating_mul(self.concurrency)
    }

    /// Checks the scenario; the error names the bad field.
    ///
    /// # Errors
    /// A message naming the first bad field.
    pub fn validate(&self) -> Result<(), String> {
        // The name becomes the default run directory's: no path, no hidden file.
        if self.name.is_empty()
            || self.name.starts_with('.')
            || !self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return Err(format!(
                "name: {:?} must be letters, digits, '-', '_' or '.' (not first): it names the run directory",
                self.name
            ));
        }
        self.pool.validate().map_err(|e| format!("pool: {e}"))?;
        if !(1..=MAX_CALLS).contains(&self.calls) {
            return Err(format!(
                "calls: must be within 1..={MAX_CALLS}, got {}",
                self.calls
            ));
        }
        if self.workers == 0 {
            return Err("workers: must be >= 1".into());
        }
        if self.concurrency == 0 {
            return Err("concurrency: must be >= 1".into());
        }
        let in_flight = u64::from(self.workers) * u64::from(self.concurrency);
        if in_flight > u64::from(MAX_IN_FLIGHT) {
            return Err(format!(
                "workers x concurrency: at most {MAX_IN_FLIGHT} calls in flight, got {} x {} = {in_flight}",
                self.workers, self.concurrency
            ));
        }
        let c = &self.client;
        for (name, v) in [
            ("client.connect_s", c.connect_s),
            ("client.first_token_s", c.first_token_s),
            ("client.inter_token_s", c.inter_token_s),
            ("client.total_s", c.total_s),
            ("naive.cooldown_s", self.naive.cooldown_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{name}: must be a finite number > 0, got {v}"));
            }
        }
        for (name, v) in [
            ("naive.backoff_s", self.naive.backoff_s),
            ("tower_stock.backoff_s", self.tower_stock.backoff_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name}: must be a finite number >= 0, got {v}"));
            }
        }
        if c.max_attempts == 0 {
            return Err("client.max_attempts: must be >= 1".into());
        }
        for (i, q) in c.quotas.iter().enumerate() {
            if c.quotas[..i].iter().any(|o| o.source == q.source) {
                return Err(format!(
                    "client.quotas[{i}].source: {:?} has a quota already (one per source)",
                    q.source
                ));
            }
            if !self.pool.sources.iter().any(|s| s.name == q.source) {
                return Err(format!(
                    "client.quotas[{i}].source: {:?} is not in the pool",
                    q.source
                ));
            }
            if q.rpm == Some(0) || q.tpm == Some(0) || q.max_concurrency == 0 {
                return Err(format!(
                    "client.quotas[{i}]: rpm, tpm and max_concurrency must be >= 1"
                ));
            }
        }
        if let Some(s) = self.fail_fast_after_s
            && !(s.is_finite() && s >= 0.0)
        {
            return Err(format!("fail_fast_after_s: must be >= 0, got {s}"));
        }
        if let Arrival::Open { per_min } = self.arrival
            && !(per_min.is_finite() && per_min > 0.0)
        {
            return Err(format!(
                "arrival.open.per_min: must be a finite number > 0, got {per_min}"
            ));
        }
        let t = &self.traffic;
        if t.mix.iter().any(|m| !(m.is_finite() && *m >= 0.0)) || t.mix.iter().sum::<f64>() <= 0.0 {
            return Err("traffic.mix: shares must be >= 0 with a positive sum".into());
        }
        if !(0.0..=1.0).contains(&t.stream_share) {
            return Err(format!(
                "traffic.stream_share: must be within [0, 1], got {}",
                t.stream_share
            ));
        }
        if !(self.success_bar.is_finite() && (0.0..=1.0).contains(&self.success_bar)) {
            return Err(format!(
                "success_bar: must be within [0, 1], got {}",
                self.success_bar
            ));
        }
        for (field, bar) in [
            ("oracle_success_p95_max", self.oracle_success_p95_max),
            ("oracle_scenario_time_max", self.oracle_scenario_time_max),
        ] {
            if let Some(b) = bar
                && !(b.is_finite() && b > 0.0)
            {
                return Err(format!("{field}: must be a finite number > 0, got {b}"));
            }
        }
        if let Some([lo, hi]) = self.naive_band
            && !(0.0 <= lo && lo <= hi && hi <= 1.0)
        {
            return Err("naive_band: need 0 <= low <= high <= 1".into());
        }
        for (i, r) in self.quota_rules.iter().enumerate() {
            if r.sources.is_empty() || r.limit == 0 || r.window_ms == 0 {
                return Err(format!(
                    "quota_rules[{i}]: needs sources, a limit >= 1 and a window >= 1 ms"
                ));
            }
            if !matches!(r.dimension.as_str(), "rpm" | "tpm") {
                return Err(format!(
                    "quota_rules[{i}].dimension: expected rpm or tpm, got {:?}",
                    r.dimension
                ));
            }
            if let Some(s) = r
                .sources
                .iter()
                .find(|s| !self.pool.sources.iter().any(|p| p.name == **s))
            {
                return Err(format!("quota_rules[{i}].sources: {s:?} is not in the pool"));
            }
        }
        Ok(())
    }
}

/// The most calls a scenario runs: the traffic plan is built whole before the run (a
/// `--calls` of `u64::MAX` aborted on its allocation).
pub const MAX_CALLS: u64 = 1_000_000;

/// The most calls a scenario runs at once, `workers x concurrency`: 65 536 (P6 runs
/// 64). Each is a task with its own request, and the profiles count them in `u32`
/// (the naive breaker's threshold is twice it).
pub const MAX_IN_FLIGHT: u32 = 65_536;

/// The scenario library: `(name, TOML)` of every file in `crates/pgw-soak/scenarios/`,
/// compiled in so `--scenario NAME` works from any directory.
pub const LIBRARY: &[(&str, &str)] = &[
    ("p6", include_str!("../scenarios/p6.toml")),
    ("flapping", include_str!("../scenarios/flapping.toml")),
    ("slow-decay", include_str!("../scenarios/slow-decay.toml")),
    ("all-dead", include_str!("../scenarios/all-dead.toml")),
    (
        "account-429-storm",
        include_str!("../scenarios/account-429-storm.toml"),
    ),
    ("toxic-prompts", include_str!("../scenarios/toxic-prompts.toml")),
    (
        "mixed-8-sources",
        include_str!("../scenarios/mixed-8-sources.toml"),
    ),
    (
        "provider-quirks",
        include_str!("../scenarios/provider-quirks.toml"),
    ),
    (
        "outage-and-recovery",
        include_str!("../scenarios/outage-and-recovery.toml"),
    ),
];

/// Every scenario of the library, parsed, in library order.
///
/// # Errors
/// A library file that does not parse (a defect: the crate's tests parse them all).
pub fn library() -> Result<Vec<Scenario>, String> {
    LIBRARY
        .iter()
        .map(|(name, text)| {
            let s = Scenario::parse(text, false).map_err(|e| format!("scenario {name}: {e}"))?;
            if s.name == *name {
                Ok(s)
            } else {
                Err(format!("scenario {name}: its name field says {:?}", s.name))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a new user's review found let through: a name that is a path, a call count
    /// that aborted on its allocation, a quota given twice, a balancer that cannot be
    /// built, a JSON type error without its field.
    #[test]
    fn names_counts_quotas_choices_and_json_types_are_checked() {
        for name in ["../../esc", "x/y", "", ".hidden"] {
            let mut bad = Scenario::p6(1);
            bad.name = name.to_owned();
            assert!(bad.validate().unwrap_err().starts_with("name:"), "{name:?}");
        }
        let mut bad = Scenario::p6(1);
        bad.calls = u64::MAX;
        assert!(bad.validate().unwrap_err().starts_with("calls:"));
        bad.calls = MAX_CALLS;
        bad.validate().unwrap();
        let mut bad = Scenario::p6(1);
        let again = bad.client.quotas[0].clone();
        bad.client.quotas.push(again);
        let e = bad.validate().unwrap_err();
        assert!(e.contains("has a quota already"), "{e}");
        for choices in ["1", "0"] {
            let e = Scenario::parse(&format!("[pgw]\nbalance_choices = {choices}\n"), false).unwrap_err();
            assert!(e.contains("at least 2"), "{choices}: {e}");
        }
        let e = Scenario::parse("{\"name\": \"j\", \"calls\": \"x\"}", true).unwrap_err();
        assert!(e.starts_with("calls: invalid type"), "{e}");
    }

    /// `workers x concurrency` overflowed `u32` (a panic in a debug build, a wrapped
    /// count in a release one): it is capped, and the error names both fields.
    #[test]
    fn calls_in_flight_are_capped() {
        let mut bad = Scenario::p6(1);
        (bad.workers, bad.concurrency) = (u32::MAX, 2);
        let e = bad.validate().unwrap_err();
        assert!(e.starts_with("workers x concurrency: at most 65536"), "{e}");
        assert!(e.contains(&format!("{} x 2", u32::MAX)), "{e}");
        assert_eq!(bad.global_concurrency(), u32::MAX);
        (bad.workers, bad.concurrency) = (2, MAX_IN_FLIGHT / 2 + 1);
        assert!(bad.validate().is_err());
        (bad.workers, bad.concurrency) = (2, MAX_IN_FLIGHT / 2);
        bad.validate().unwrap();
        let e = Scenario::parse("workers = 65536\nconcurrency = 65536\n", false).unwrap_err();
        assert!(e.starts_with("workers x concurrency"), "{e}");
    }

    #[test]
    fn p6_is_valid_roundtrips_and_bad_fields_are_named() {
        let s = Scenario::p6(1);
        s.validate().unwrap();
        let back: Scenario = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
        assert_eq!(s.global_concurrency(), 64);
        assert_eq!(s.client.quota_rules().len(), 10);
        let mut bad = s.clone();
        bad.client.quotas[3].rpm = Some(0);
        assert!(bad.validate().unwrap_err().starts_with("client.quotas[3]"));
        let mut bad = s.clone();
        bad.client.inter_token_s = f64::NAN;
        assert!(bad.validate().unwrap_err().starts_with("client.inter_token_s"));
        let mut bad = s.clone();
        bad.quota_rules.push(QuotaRule {
            scope: "account x".into(),
            sources: vec!["s9".into()],
            dimension: "rpm".into(),
            limit: 1,
            window_ms: 60_000,
        });
        assert!(bad.validate().unwrap_err().contains("s9"));
        // A source without a quota entry has none.
        let mut open = s;
        open.client.quotas.pop();
        open.validate().unwrap();
        assert_eq!(open.client.quota("s5"), SourceQuota::unlimited("s5"));
    }

    #[test]
    fn the_library_parses_and_p6_is_todays_p6() {
        let all = library().unwrap();
        assert_eq!(all.len(), LIBRARY.len());
        assert_eq!(
            all[0],
            Scenario::p6(DEFAULT_SEED),
            "scenarios/p6.toml drifted from Scenario::p6"
        );
        for s in &all {
            assert!(!s.description.is_empty(), "{} has no description", s.name);
        }
        assert_eq!(Scenario::named_or_file("flapping").unwrap().name, "flapping");
        let e = Scenario::named_or_file("nope").unwrap_err();
        assert!(e.contains("all-dead") && e.contains("nope"), "{e}");
    }

    #[test]
    fn files_name_their_bad_fields() {
        let e = Scenario::parse("calls = 0\n", false).unwrap_err();
        assert!(e.starts_with("calls"), "{e}");
        let e = Scenario::parse("cals = 10\n", false).unwrap_err();
        assert!(e.contains("cals"), "{e}");
        let e = Scenario::parse("[arrival.open]\nper_min = -1\n", false).unwrap_err();
        assert!(e.contains("arrival.open.per_min"), "{e}");
        // JSON too, and a stored scenario.json round-trips.
        let p6 = Scenario::p6(3);
        let back = Scenario::parse(&serde_json::to_string(&p6).unwrap(), true).unwrap();
        assert_eq!(back, p6);
    }

    /// The pgw profile's balancer choices come from the file (a number or "all"),
    /// survive the stored scenario.json the Redis mode's workers read, and a bad one
    /// names the field.
    #[test]
    fn the_pgw_table_sets_the_balancers_choices() {
        use pgw_stack::Choices;
        assert_eq!(Scenario::parse("", false).unwrap().pgw.balance_choices, None);
        for (text, want) in [
            ("[pgw]\nbalance_choices = 3\n", Choices::Count(3)),
            ("[pgw]\nbalance_choices = \"all\"\n", Choices::All),
        ] {
            let s = Scenario::parse(text, false).unwrap();
            assert_eq!(s.pgw.balance_choices, Some(want), "{text}");
            let back = Scenario::parse(&serde_json::to_string(&s).unwrap(), true).unwrap();
            assert_eq!(back, s, "{text}");
        }
        let e = Scenario::parse("[pgw]\nbalance_choices = \"most\"\n", false).unwrap_err();
        assert!(
            e.contains("balance_choices") || e.contains("balance.choices"),
            "{e}"
        );
    }
}
