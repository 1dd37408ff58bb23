//! The P6 soak: client profiles side by side on the
//! simulated fault pool, a scoreboard of invariants, and a Markdown + SVG report.
//!
//! - [`scenario::Scenario`]: the pool, the traffic and what every profile is given
//!   (timeouts, watchdogs, quotas), as one documented struct read from TOML or JSON,
//!   and the library of scenario files ([`scenario::LIBRARY`]);
//! - [`profiles`]: `naive` (the seeds' first design), `tower-stock` (tower alone),
//!   `pgw` (`pgw-stack`'s `Gateway`) and `oracle` (the clairvoyant physical limit),
//!   each built per worker over the simulator;
//! - [`driver`]: bounded dispatch, the success judgement, progress, RSS samples;
//! - [`telemetry`]: one row per attempt and per call, stored as JSON Lines;
//! - [`scoreboard`]: judges stored rows (so `--rescore` re-judges offline);
//! - [`acceptance`]: pgw against the oracle on the same scenario (goodput, and on P6
//!   latency p95 and scenario time), gating pgw's verdict;
//! - [`report`]: the side-by-side Markdown table and a hand-written SVG chart;
//! - [`timing`]: what the success cost in time (goodput, latency, time to first token);
//! - [`run`]: ties them together under tokio's paused clock;
//! - [`matrix`]: every library scenario with every profile, one table;
//! - [`realtime`]: the real-time Redis mode (worker processes, the simulator over HTTP).
//!
//! ```
//! use pgw_soak::profiles::ProfileKind;
//! use pgw_soak::run::{RunOptions, run};
//! use pgw_soak::scenario::Scenario;
//!
//! // A short P6 run of the naive baseline, in virtual time, rows kept in memory.
//! let mut scenario = Scenario::p6(7);
//! scenario.calls = 40;
//! let opts = RunOptions { profiles: vec![ProfileKind::Naive], dir: None, progress: false };
//! let outcome = run(&scenario, &opts).unwrap();
//! let naive = &outcome.scores[0];
//! assert_eq!(naive.calls, 40);
//! assert!(naive.check("call ids unique").unwrap().pass);
//! assert!(naive.check("accounting back to zero").unwrap().pass);
//! ```

pub mod acceptance;
pub mod commands;
pub mod driver;
pub mod matrix;
pub mod profiles;
pub mod realtime;
pub mod report;
pub mod rss;
pub mod run;
pub mod scenario;
pub mod scoreboard;
pub mod telemetry;
pub mod timing;
