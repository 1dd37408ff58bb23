//! The scenario: the P6 pool, the traffic, and what every client profile is given.
//!
//! One documented struct ([`Scenario`]) holds everything a run depends on, so a run is
//! reproducible from it and its seed, and it is stored next to the run's telemetry.
//! The pool and the traffic are the same for every profile (K2); so are the timeouts,
//! watchdogs and quotas ([`ClientSettings`]). What differs between profiles is only
//! their own machinery ([`NaiveSettings`], [`TowerStockSettings`]; `pgw` runs with
//! `pgw-stack`'s defaults).

use std::time::Duration;

use pgw_client::Timeouts;
use pgw_sim::PoolConfig;
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
        a.rate_limit.concurrency_slope = CALIBRATED_CONCURRENCY_SLOPE;
        a.rate_limit.rpm_slope = CALIBRATED_RPM_SLOPE;
    }
    pool
}

/// The window every quota is enforced and judged on: one minute.
pub const QUOTA_WINDOW: Duration = Duration::from_secs(60);

/// One source's quotas as configured in every client (S2).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceQuota {
    /// The source's name in the pool.
    pub source: String,
    /// Requests per minute (`None`: unlimited).
    pub rpm: Option<u64>,
    /// Tokens per minute (`None`: unlimited).
    pub tpm: Option<u64>,
    /// Most attempts in flight at once on this source, over all workers.
    pub max_concurrency: u32,
}

/// What every profile is given alike: timeouts, watchdogs, keys and quotas.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClientSettings {
    /// Connect timeout, s.
    pub connect_s: f64,
    /// First-token watchdog, s (streamed answers).
    pub first_token_s: f64,
    /// Inter-token watchdog, s: the P6 "tight watchdog" (`pgw_sim`'s assumed 8 s).
    pub inter_token_s: f64,
    /// Whole attempt, s.
    pub total_s: f64,
    /// Per-source quotas, pool order.
    pub quotas: Vec<SourceQuota>,
    /// Attempts per call (the seeds' `LLM_MAX_RETRIES` 3, for every profile).
    pub max_attempts: u32,
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

    /// The quota of `source`.
    #[must_use]
    pub fn quota(&self, source: &str) -> Option<&SourceQuota> {
        self.quotas.iter().find(|q| q.source == source)
    }

    /// The quota rules the scoreboard judges every profile on.
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

/// The seeds' first design (seed 003, seed 000 section 1), the baseline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NaiveSettings {
    /// Configured consecutive-failure threshold; the effective one is
    /// `max(this, 2 x global concurrency)` (seed 000 section 1, defect 2).
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

/// What a user assembles from tower alone.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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

/// Everything a soak run depends on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Scenario {
    /// The seed of the pool and the traffic.
    pub seed: u64,
    /// Calls to run.
    pub calls: u64,
    /// Worker processes (client instances sharing the backend).
    pub workers: u32,
    /// Calls in flight per worker.
    pub concurrency: u32,
    /// The simulated pool ([`calibrated_p6_pool`] unless given by a scenario file).
    pub pool: PoolConfig,
    /// What every profile gets alike.
    pub client: ClientSettings,
    /// The naive profile's own knobs.
    pub naive: NaiveSettings,
    /// The tower-stock profile's own knobs.
    pub tower_stock: TowerStockSettings,
}

impl Scenario {
    /// The P6 scenario with `seed`.
    ///
    /// Quotas: s4 has RPM 5 (the pool's tight gate, DESIGN.md section 5); every source
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
            seed,
            calls: P6_CALLS,
            workers: P6_WORKERS,
            concurrency: P6_CONCURRENCY,
            pool: calibrated_p6_pool(),
            client: ClientSettings {
                connect_s: 10.0,
                first_token_s: 60.0,
                inter_token_s: pgw_sim::config::P6_ASSUMED_INTER_TOKEN_WATCHDOG_S,
                total_s: 180.0,
                quotas: vec![
                    quota("s1", 600),
                    quota("s2", 600),
                    quota("s3", 600),
                    quota("s4", 5),
                    quota("s5", 600),
                ],
                max_attempts: 3,
            },
            naive: NaiveSettings {
                breaker_threshold: 5,
                cooldown_s: 300.0,
                backoff_s: 1.0,
                cache: true,
            },
            tower_stock: TowerStockSettings {
                load: TowerLoad::PendingRequests,
                budget_ttl_s: 10,
                budget_min_per_sec: 10,
                budget_retry_percent: 0.2,
                backoff_s: 1.0,
            },
        }
    }

    /// Calls in flight over all workers.
    #[must_use]
    pub const fn global_concurrency(&self) -> u32 {
        self.workers * self.concurrency
    }

    /// Checks the scenario; the error names the bad field.
    ///
    /// # Errors
    /// A message naming the first bad field.
    pub fn validate(&self) -> Result<(), String> {
        self.pool.validate().map_err(|e| format!("pool: {e}"))?;
        if self.calls == 0 {
            return Err("calls: must be >= 1".into());
        }
        if self.workers == 0 {
            return Err("workers: must be >= 1".into());
        }
        if self.concurrency == 0 {
            return Err("concurrency: must be >= 1".into());
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
                return Err(format!("{name}: must be > 0, got {v}"));
            }
        }
        for (name, v) in [
            ("naive.backoff_s", self.naive.backoff_s),
            ("tower_stock.backoff_s", self.tower_stock.backoff_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name}: must be >= 0, got {v}"));
            }
        }
        if c.max_attempts == 0 {
            return Err("client.max_attempts: must be >= 1".into());
        }
        for (i, q) in c.quotas.iter().enumerate() {
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
        for s in &self.pool.sources {
            if c.quota(&s.name).is_none() {
                return Err(format!("client.quotas: no quota for source {:?}", s.name));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut bad = s;
        bad.client.quotas.pop();
        assert!(bad.validate().unwrap_err().contains("s5"));
    }
}
