//! What a profile's success cost in time: scenario time, goodput,
//! latency percentiles of successful and of failed calls, time to first token as the
//! caller and as the upstream saw it, and the wait before a call's first attempt.
//!
//! Computed from the stored rows only (like every figure of the scoreboard), so
//! `--rescore` reproduces them. Percentiles come from an HDR histogram of milliseconds
//! with 3 significant digits (exact below 2048 ms, within 0.1% above).

use std::collections::HashMap;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::telemetry::{AttemptRow, ProfileRun};

/// Points of the latency distribution kept for the CDF chart: every 2nd percentile.
const CDF_POINTS: u32 = 50;

/// The percentiles of one latency distribution, ms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Percentiles {
    /// Samples.
    pub n: u64,
    /// Median.
    pub p50: u64,
    /// 95th percentile.
    pub p95: u64,
    /// 99th percentile.
    pub p99: u64,
    /// Largest sample.
    pub max: u64,
}

/// Milliseconds as seconds, for display and ratios.
#[allow(clippy::cast_precision_loss)] // ms far below 2^52
#[must_use]
pub fn secs(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

impl Percentiles {
    /// `f` of these percentiles, or `None` when there are no samples.
    #[must_use]
    pub fn get(&self, f: impl Fn(&Self) -> u64) -> Option<u64> {
        (self.n > 0).then(|| f(self))
    }

    /// The percentiles of `samples` (ms); all zero when there are none.
    #[must_use]
    pub fn of(samples: impl IntoIterator<Item = u64>) -> Self {
        let h = histogram(samples);
        Self::of_histogram(&h)
    }

    fn of_histogram(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        Self {
            n: h.len(),
            p50: h.value_at_quantile(0.50),
            p95: h.value_at_quantile(0.95),
            p99: h.value_at_quantile(0.99),
            max: h.max(),
        }
    }
}

fn histogram(samples: impl IntoIterator<Item = u64>) -> Histogram<u64> {
    // Auto-resizing; `new` fails only for more than 5 significant digits.
    let mut h = Histogram::<u64>::new(3).expect("3 significant digits are valid");
    for v in samples {
        // Auto-resizing records any value; only one beyond u64's range could fail.
        if h.record(v).is_err() {
            h.saturating_record(v);
        }
    }
    h
}

/// What one profile's success cost in time.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Timing {
    /// Scenario time of the run, minutes.
    pub scenario_min: f64,
    /// Successful calls per scenario minute (goodput).
    pub goodput_per_min: f64,
    /// Upstream attempts that succeeded per scenario minute (cache hits excluded).
    pub upstream_successes_per_min: f64,
    /// Latency of successful calls (start to end, as the caller saw it), ms.
    pub success: Percentiles,
    /// Latency of failed calls, ms.
    pub failure: Percentiles,
    /// Streamed successful calls: time from the call's start to its first chunk reaching
    /// the caller, ms.
    pub caller_ttft: Percentiles,
    /// Streamed successful calls: the upstream's time to first token on the attempt
    /// that answered (from that attempt's admission), ms.
    pub upstream_ttft: Percentiles,
    /// Time from a call's start to its first attempt (or cache hit); a call that never
    /// made one counts its whole life, ms.
    pub first_attempt_wait: Percentiles,
    /// Successful call latency at every 2nd percentile (`cdf[i]` is the
    /// `(i + 1) * 2`-th), ms: the CDF chart.
    pub success_cdf: Vec<u64>,
}

#[allow(clippy::cast_precision_loss)] // counts and ms far below 2^52
fn per_minute(n: u64, minutes: f64) -> f64 {
    if minutes > 0.0 { n as f64 / minutes } else { 0.0 }
}

/// The timing figures of `run`.
#[must_use]
#[allow(clippy::cast_precision_loss)]
pub fn timing(run: &ProfileRun) -> Timing {
    let scenario_min = run.scenario_ms as f64 / 60_000.0;
    let mut first_attempt: HashMap<&str, u64> = HashMap::with_capacity(run.calls.len());
    let mut answering: HashMap<&str, &AttemptRow> = HashMap::new();
    let mut upstream_ok = 0;
    for a in &run.attempts {
        first_attempt
            .entry(a.call_id.as_str())
            .and_modify(|t| *t = (*t).min(a.admitted_ms))
            .or_insert(a.admitted_ms);
        if !a.cache_hit && a.outcome == "success" {
            upstream_ok += 1;
            let e = answering.entry(a.call_id.as_str()).or_insert(a);
            if a.attempt > e.attempt {
                *e = a;
            }
        }
    }
    // Durations in scenario milliseconds (the Redis mode's rows are real time).
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let scaled = |ms: u64| -> u64 {
        if run.time_scale > 0.0 && (run.time_scale - 1.0).abs() > f64::EPSILON {
            (ms as f64 / run.time_scale).round() as u64
        } else {
            ms
        }
    };
    let life = |c: &crate::telemetry::CallRow| scaled(c.ended_ms.saturating_sub(c.started_ms));
    let ok = || run.calls.iter().filter(|c| c.ok);
    let success = histogram(ok().map(life));
    let streamed_ok = || ok().filter(|c| c.stream);
    let success_cdf = if success.is_empty() {
        Vec::new()
    } else {
        (1..=CDF_POINTS)
            .map(|i| success.value_at_quantile(f64::from(i) / f64::from(CDF_POINTS)))
            .collect()
    };
    Timing {
        scenario_min,
        goodput_per_min: per_minute(ok().count() as u64, scenario_min),
        upstream_successes_per_min: per_minute(upstream_ok, scenario_min),
        success: Percentiles::of_histogram(&success),
        failure: Percentiles::of(run.calls.iter().filter(|c| !c.ok).map(life)),
        caller_ttft: Percentiles::of(streamed_ok().map(|c| {
            scaled(
                c.first_chunk_ms
                    .unwrap_or(c.ended_ms)
                    .saturating_sub(c.started_ms),
            )
        })),
        upstream_ttft: Percentiles::of(
            streamed_ok()
                .filter_map(|c| answering.get(c.call_id.as_str()))
                .filter_map(|a| a.ttft_ms)
                .map(scaled),
        ),
        first_attempt_wait: Percentiles::of(run.calls.iter().map(|c| {
            scaled(
                first_attempt
                    .get(c.call_id.as_str())
                    .map_or(c.ended_ms, |&t| t.min(c.ended_ms))
                    .saturating_sub(c.started_ms),
            )
        })),
        success_cdf,
    }
}

/// `value / reference`, or `None` when the reference is zero (nothing to compare with).
#[must_use]
pub fn ratio_to(value: f64, reference: f64) -> Option<f64> {
    (reference > 0.0 && value.is_finite()).then(|| value / reference)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::CallRow;

    fn call(id: &str, ok: bool, start: u64, end: u64, stream: bool, first_chunk: Option<u64>) -> CallRow {
        CallRow {
            call_id: id.into(),
            worker: 0,
            kind: "P1".into(),
            started_ms: start,
            ended_ms: end,
            ok,
            cause: if ok { "ok".into() } else { "transient".into() },
            stream,
            first_chunk_ms: first_chunk,
        }
    }

    fn attempt(id: &str, n: u32, at: u64, outcome: &str, ttft: Option<u64>, cache_hit: bool) -> AttemptRow {
        AttemptRow {
            call_id: id.into(),
            attempt: n,
            worker: 0,
            source: "s1".into(),
            admitted_ms: at,
            latency_ms: 1,
            ttft_ms: ttft,
            tokens: 1,
            outcome: outcome.into(),
            cache_hit,
            request_error: false,
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let p = Percentiles::of(1..=100);
        assert_eq!(
            p,
            Percentiles {
                n: 100,
                p50: 50,
                p95: 95,
                p99: 99,
                max: 100
            }
        );
        assert_eq!(Percentiles::of([]), Percentiles::default());
        assert_eq!(Percentiles::of([7]).p99, 7);
        // Above 2048 ms the histogram keeps 3 significant digits.
        let big = Percentiles::of([1_000_000]);
        assert!(big.p50.abs_diff(1_000_000) <= 1000, "{big:?}");
    }

    #[test]
    fn timing_from_hand_made_rows() {
        let run = ProfileRun {
            profile: "p".into(),
            scenario_ms: 120_000, // two minutes
            calls: vec![
                // ok, non-streamed, 10 s; its first attempt 2 s after its start.
                call("a", true, 0, 10_000, false, Some(10_000)),
                // ok, streamed, 30 s, first chunk at 25 s; answered on attempt 2.
                call("b", true, 1_000, 31_000, true, Some(26_000)),
                // ok, streamed, answered from the cache at once.
                call("c", true, 5_000, 5_000, true, None),
                // failed after 100 s without any attempt.
                call("d", false, 0, 100_000, false, None),
            ],
            attempts: vec![
                attempt("a", 1, 2_000, "success", None, false),
                attempt("b", 1, 1_500, "transient", Some(900), false),
                attempt("b", 2, 12_000, "success", Some(4_000), false),
                attempt("c", 1, 5_000, "success", None, true),
            ],
            ..ProfileRun::default()
        };
        let t = timing(&run);
        assert!((t.scenario_min - 2.0).abs() < 1e-9);
        assert!((t.goodput_per_min - 1.5).abs() < 1e-9, "{}", t.goodput_per_min);
        // Cache hits are not upstream successes.
        assert!((t.upstream_successes_per_min - 1.0).abs() < 1e-9);
        assert_eq!(t.success.n, 3);
        assert_eq!(t.success.p50 / 1000, 10);
        assert_eq!(t.success.max / 1000, 30);
        assert_eq!((t.failure.n, t.failure.p50 / 1000), (1, 100));
        // b: first chunk 25 s after its start; c: delivered whole at its end (0 s).
        assert_eq!(t.caller_ttft.n, 2);
        assert_eq!(t.caller_ttft.max / 1000, 25);
        assert_eq!(t.caller_ttft.p50, 0);
        // Only the attempt that answered counts, and only upstream answers have one.
        assert_eq!((t.upstream_ttft.n, t.upstream_ttft.max / 10), (1, 400));
        // a waited 2 s, b 0.5 s, c 0 s, d its whole 100 s life.
        assert_eq!(t.first_attempt_wait.n, 4);
        assert_eq!(t.first_attempt_wait.max / 1000, 100);
        assert_eq!(t.first_attempt_wait.p50, 500);
        assert_eq!(t.success_cdf.len(), 50);
        assert_eq!(t.success_cdf.last().map(|v| v / 1000), Some(30));
        assert!(t.success_cdf.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn scaled_runs_report_scenario_time() {
        // A real-time run at 1/60: a call of 1 s real time lasted a scenario minute.
        let run = ProfileRun {
            scenario_ms: 120_000,
            time_scale: 1.0 / 60.0,
            calls: vec![call("a", true, 0, 1_000, false, None)],
            attempts: vec![attempt("a", 1, 500, "success", None, false)],
            ..ProfileRun::default()
        };
        let t = timing(&run);
        assert_eq!(t.success.max / 1000, 60);
        assert_eq!(t.first_attempt_wait.max / 1000, 30);
        assert!((t.goodput_per_min - 0.5).abs() < 1e-9);
    }

    #[test]
    fn ratios() {
        assert_eq!(ratio_to(5.0, 10.0), Some(0.5));
        assert_eq!(ratio_to(5.0, 0.0), None);
    }
}
