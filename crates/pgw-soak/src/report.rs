//! The report: a Markdown side-by-side table and a hand-written SVG chart.

use std::fmt::Write as _;

use crate::acceptance;
use crate::scoreboard::Score;
use crate::timing::{Percentiles, ratio_to, secs};

/// The profile every other is compared with: the clairvoyant client.
const ORACLE: &str = "oracle";

/// Chart size.
const W: f64 = 900.0;
const H: f64 = 620.0;
/// Series colours, one per profile (cycled).
const COLOURS: [&str; 5] = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e"];

/// What the report says about the run besides the scores.
#[derive(Clone, Debug, Default)]
pub struct RunInfo {
    /// The report's title: the scenario's name.
    pub title: String,
    /// One line describing the scenario (pool, calls, workers, seed, mode).
    pub scenario: String,
    /// The chart's file name, relative to the report.
    pub chart_file: String,
    /// The latency chart's file name, relative to the report (empty: none).
    pub latency_chart_file: String,
}

/// `p50 / p95 / p99 / max` in seconds, or `-` without samples.
fn pct_line(p: &Percentiles, max: bool) -> String {
    or_dash(p, |p| {
        let base = format!("{:.1} / {:.1} / {:.1}", secs(p.p50), secs(p.p95), secs(p.p99));
        if max {
            format!("{base} / {:.1}", secs(p.max))
        } else {
            base
        }
    })
}

/// `f(p)`, or `-` when `p` has no samples.
fn or_dash(p: &Percentiles, f: impl Fn(&Percentiles) -> String) -> String {
    if p.n == 0 { "-".into() } else { f(p) }
}

/// `value` as a ratio to the oracle's (`x0.42`), or `-` without an oracle to compare
/// or when either has no value (`f` gives `None` for a percentile of an empty sample:
/// it is not 0 s, and a profile without a successful call is not x0.00 as fast).
fn vs_oracle(scores: &[Score], s: &Score, f: &dyn Fn(&Score) -> Option<f64>) -> String {
    scores
        .iter()
        .find(|o| o.profile == ORACLE)
        .and_then(|o| ratio_to(f(s)?, f(o)?))
        .map_or_else(|| "-".into(), |r| format!("x{r:.2}"))
}

/// `f(p)` in seconds, or `None` when `p` has no samples.
fn secs_of(p: &Percentiles, f: impl Fn(&Percentiles) -> u64) -> Option<f64> {
    p.get(f).map(secs)
}

#[allow(clippy::cast_precision_loss)]
fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// The Markdown report: the side-by-side table, failures by cause, attempts per source,
/// every check with its detail, and the chart.
#[must_use]
pub fn markdown(info: &RunInfo, scores: &[Score]) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# {} soak\n\n{}\n", info.title, info.scenario);
    let header = |md: &mut String, first: &str| {
        let _ = write!(md, "| {first} |");
        for s in scores {
            let _ = write!(md, " {} |", s.profile);
        }
        md.push_str("\n|---|");
        for _ in scores {
            md.push_str("---:|");
        }
        md.push('\n');
    };
    let row = |md: &mut String, name: &str, f: &dyn Fn(&Score) -> String| {
        let _ = write!(md, "| {} |", name.replace('|', "\\|"));
        for s in scores {
            let _ = write!(md, " {} |", f(s).replace('|', "\\|"));
        }
        md.push('\n');
    };
    header(&mut md, "");
    row(&mut md, "**success**", &|s| {
        format!("**{:.2}%** ({}/{})", s.success_rate * 100.0, s.ok, s.calls)
    });
    row(&mut md, "success excl. rejected prompts", &|s| {
        format!(
            "{:.2}% ({} rejected)",
            s.recoverable_success_rate * 100.0,
            s.rejected
        )
    });
    row(&mut md, "verdict", &|s| {
        if s.passed() { "PASS".into() } else { "FAIL".into() }
    });
    row(&mut md, "quota violations", &|s| s.violations.len().to_string());
    row(&mut md, "request errors against a source", &|s| {
        format!("{} of {}", s.request_errors_against_source, s.request_errors)
    });
    row(&mut md, "attempts / call", &|s| {
        format!("{:.2}", s.attempts_per_call)
    });
    row(&mut md, "upstream attempts", &|s| s.attempts.to_string());
    row(&mut md, "cache hits", &|s| s.cache_hits.to_string());
    row(&mut md, "scenario time", &|s| {
        format!("{:.0} min", secs(s.scenario_ms) / 60.0)
    });
    row(&mut md, "wall time", &|s| format!("{:.1} s", secs(s.wall_ms)));
    row(&mut md, "RSS at end", &|s| {
        format!("{:.1} MiB", mib(s.rss_end_kib))
    });

    md.push_str("\n## Time\n\nWhat the success cost. Latencies in scenario seconds, p50 / p95 / p99 (/ max); ratios are to the `oracle` profile (the clairvoyant client: the pool's physical limit).\n\n");
    header(&mut md, "");
    row(&mut md, "scenario time", &|s| {
        format!("{:.0} min", s.timing.scenario_min)
    });
    row(&mut md, "**goodput** (successful calls / min)", &|s| {
        format!("**{:.1}**", s.timing.goodput_per_min)
    });
    row(&mut md, "goodput vs oracle", &|s| {
        vs_oracle(scores, s, &|x| Some(x.timing.goodput_per_min))
    });
    row(&mut md, "upstream successes / min", &|s| {
        format!("{:.1}", s.timing.upstream_successes_per_min)
    });
    row(&mut md, "successful calls: latency", &|s| {
        pct_line(&s.timing.success, true)
    });
    row(&mut md, "success p50 vs oracle", &|s| {
        vs_oracle(scores, s, &|x| secs_of(&x.timing.success, |p| p.p50))
    });
    row(&mut md, "success p95 vs oracle", &|s| {
        vs_oracle(scores, s, &|x| secs_of(&x.timing.success, |p| p.p95))
    });
    row(&mut md, "failed calls: latency", &|s| {
        pct_line(&s.timing.failure, true)
    });
    row(&mut md, "streams: first token as the caller sees it", &|s| {
        pct_line(&s.timing.caller_ttft, false)
    });
    row(&mut md, "streams: first token from the upstream", &|s| {
        pct_line(&s.timing.upstream_ttft, false)
    });
    row(&mut md, "wait before the first attempt (p95 / max)", &|s| {
        or_dash(&s.timing.first_attempt_wait, |w| {
            format!("{:.1} / {:.1}", secs(w.p95), secs(w.max))
        })
    });

    md.push_str(&against_oracle(scores));

    md.push_str("\n## Invariants\n\n");
    header(&mut md, "check");
    let names = check_names(scores);
    for name in names.into_iter().filter(|n| !acceptance::CHECKS.contains(n)) {
        row(&mut md, name, &|s| match s.check(name) {
            Some(c) => format!("{} {}", c.label(), c.detail),
            None => "-".into(),
        });
    }

    md.push_str("\n## Failed calls by cause\n\n");
    header(&mut md, "cause");
    let mut causes: Vec<&String> = scores.iter().flat_map(|s| s.failed_by_cause.keys()).collect();
    causes.sort();
    causes.dedup();
    for cause in causes {
        row(&mut md, cause, &|s| {
            s.failed_by_cause.get(cause).copied().unwrap_or(0).to_string()
        });
    }

    md.push_str("\n## Upstream attempts per source\n\n");
    header(&mut md, "source");
    let mut sources: Vec<&String> = Vec::new();
    for s in scores {
        for (src, _) in &s.attempts_by_source {
            if !sources.contains(&src) {
                sources.push(src);
            }
        }
    }
    for src in sources {
        row(&mut md, src, &|s| {
            let n = s
                .attempts_by_source
                .iter()
                .find(|(x, _)| x == src)
                .map_or(0, |(_, n)| *n);
            #[allow(clippy::cast_precision_loss)]
            let share = if s.attempts == 0 {
                0.0
            } else {
                n as f64 * 100.0 / s.attempts as f64
            };
            format!("{n} ({share:.0}%)")
        });
    }

    md.push_str("\n## Attempt outcomes\n\n");
    header(&mut md, "outcome");
    let mut outcomes: Vec<&String> = scores.iter().flat_map(|s| s.outcomes.keys()).collect();
    outcomes.sort();
    outcomes.dedup();
    for o in outcomes {
        row(&mut md, o, &|s| {
            s.outcomes.get(o).copied().unwrap_or(0).to_string()
        });
    }

    for s in scores.iter().filter(|s| !s.violations.is_empty()) {
        let _ = writeln!(md, "\n### Quota violations: {}\n", s.profile);
        md.push_str("| scope | dim | span start (s) | used | limit |\n|---|---|---:|---:|---:|\n");
        for v in s.violations.iter().take(20) {
            let _ = writeln!(
                md,
                "| {} | {} | {:.0} | {} | {} |",
                v.scope,
                v.dimension,
                secs(v.window_start_ms),
                v.used,
                v.limit
            );
        }
        if s.violations.len() > 20 {
            let _ = writeln!(md, "\n({} more)", s.violations.len() - 20);
        }
    }
    if !info.chart_file.is_empty() {
        let _ = writeln!(
            md,
            "\n![success over time and attempts per source]({})",
            info.chart_file
        );
    }
    if !info.latency_chart_file.is_empty() {
        let _ = writeln!(
            md,
            "\n![latency of successful calls, CDF]({})",
            info.latency_chart_file
        );
    }
    md
}

/// The report's section on pgw against the oracle ([`acceptance`]): one line per bar
/// of each judged profile, `oracle: goodput: PASS x0.87 (>= x0.80): ...`; nothing when
/// no profile was judged.
fn against_oracle(scores: &[Score]) -> String {
    let mut md = String::new();
    for s in scores {
        let judged: Vec<_> = s
            .checks
            .iter()
            .filter(|c| acceptance::CHECKS.contains(&c.name))
            .collect();
        if judged.is_empty() {
            continue;
        }
        if md.is_empty() {
            md.push_str(
                "\n## Against the oracle\n\nThe acceptance: pgw's figures as ratios to the \
                 `oracle` profile's on the same scenario and seed (gating: PASS or FAIL is in \
                 the verdict).\n\n",
            );
        }
        for c in judged {
            let _ = writeln!(md, "- {} {}: {} {}", s.profile, c.name, c.label(), c.detail);
        }
    }
    md
}

/// The side-by-side scoreboard for the terminal.
#[must_use]
pub fn terminal(scores: &[Score]) -> String {
    let mut out = String::new();
    let _ = write!(out, "{:<36}", "");
    for s in scores {
        let _ = write!(out, "{:>16}", s.profile);
    }
    out.push('\n');
    let line = |out: &mut String, name: &str, f: &dyn Fn(&Score) -> String| {
        let _ = write!(out, "{name:<36}");
        for s in scores {
            let _ = write!(out, "{:>16}", f(s));
        }
        out.push('\n');
    };
    line(&mut out, "success", &|s| {
        format!("{:.2}%", s.success_rate * 100.0)
    });
    line(&mut out, "success excl. 400s", &|s| {
        format!("{:.2}%", s.recoverable_success_rate * 100.0)
    });
    line(&mut out, "quota violations", &|s| s.violations.len().to_string());
    line(&mut out, "request errors against a source", &|s| {
        format!("{} of {}", s.request_errors_against_source, s.request_errors)
    });
    line(&mut out, "attempts / call", &|s| {
        format!("{:.2}", s.attempts_per_call)
    });
    line(&mut out, "cache hits", &|s| s.cache_hits.to_string());
    line(&mut out, "wall time", &|s| format!("{:.1}s", secs(s.wall_ms)));
    line(&mut out, "scenario time", &|s| {
        format!("{:.0} min", s.timing.scenario_min)
    });
    line(&mut out, "goodput (ok/min)", &|s| {
        format!("{:.1}", s.timing.goodput_per_min)
    });
    line(&mut out, "goodput vs oracle", &|s| {
        vs_oracle(scores, s, &|x| Some(x.timing.goodput_per_min))
    });
    line(&mut out, "ok latency p50/p95 s", &|s| {
        or_dash(&s.timing.success, |t| {
            format!("{:.1}/{:.1}", secs(t.p50), secs(t.p95))
        })
    });
    line(&mut out, "failed latency p50 s", &|s| {
        or_dash(&s.timing.failure, |t| format!("{:.1}", secs(t.p50)))
    });
    line(&mut out, "stream TTFT (caller) p50", &|s| {
        or_dash(&s.timing.caller_ttft, |t| format!("{:.1}s", secs(t.p50)))
    });
    line(&mut out, "longest first wait", &|s| {
        format!("{:.0}s", secs(s.timing.first_attempt_wait.max))
    });
    let names = check_names(scores);
    for name in names {
        line(&mut out, name, &|s| {
            s.check(name).map_or_else(|| "-".into(), |c| c.label().into())
        });
    }
    line(&mut out, "verdict", &|s| {
        if s.passed() { "PASS".into() } else { "FAIL".into() }
    });
    out.push_str(TERMINAL_LEGEND);
    out
}

/// What the terminal table's terser rows mean (report.md says it at length).
const TERMINAL_LEGEND: &str = "\
(request errors against a source: provider answers that blame the request, and how \
many a profile counted against the source; attempts / call: upstream attempts, cache \
hits excluded, so below 1 with hits; PASS/FAIL: gating checks, info: measured, not \
judged; the verdict is the gating checks')
";

/// One series of a chart: its polyline (none without points) and its legend entry
/// (a swatch at `legend`, then `label`).
fn series(s: &mut String, colour: &str, pts: &[String], legend: (f64, f64), label: &str) {
    if !pts.is_empty() {
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
            pts.join(" ")
        );
    }
    let (lx, ly) = legend;
    let _ = writeln!(
        s,
        r#"<rect x="{lx:.1}" y="{:.1}" width="12" height="12" fill="{colour}"/><text x="{:.1}" y="{ly:.1}">{}</text>"#,
        ly - 10.0,
        lx + 17.0,
        esc(label)
    );
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The SVG chart: success rate per scenario minute (cumulative, one line per profile)
/// on top, attempts per source (grouped bars) below. Written by hand: no dependency.
#[must_use]
#[allow(clippy::cast_precision_loss, clippy::too_many_lines)]
pub fn svg(scores: &[Score]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    s.push_str(r#"<rect width="100%" height="100%" fill="white"/>"#);
    s.push('\n');

    // Top: cumulative success rate over scenario time.
    let (x0, y0, pw, ph) = (60.0, 40.0, W - 200.0, 260.0);
    let _ = writeln!(
        s,
        r#"<text x="{x0}" y="22" font-size="14" font-weight="bold">Cumulative success rate over scenario time</text>"#
    );
    let max_min = scores
        .iter()
        .filter_map(|sc| sc.success_by_minute.last().map(|m| m.0))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    for pct in [0, 25, 50, 75, 100] {
        let y = y0 + ph - ph * f64::from(pct) / 100.0;
        let _ = writeln!(
            s,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{pct}%</text>"##,
            x0 + pw,
            x0 - 6.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        s,
        r##"<line x1="{x0}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#333"/><text x="{:.1}" y="{:.1}" text-anchor="middle">scenario minutes (0 .. {max_min:.0})</text>"##,
        y0 + ph,
        x0 + pw,
        y0 + ph,
        x0 + pw / 2.0,
        y0 + ph + 30.0
    );
    for (i, sc) in scores.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let (mut n, mut ok) = (0u64, 0u64);
        let pts: Vec<String> = sc
            .success_by_minute
            .iter()
            .map(|&(m, calls, good)| {
                n += calls;
                ok += good;
                let rate = if n == 0 { 0.0 } else { ok as f64 / n as f64 };
                format!("{:.1},{:.1}", x0 + pw * m as f64 / max_min, y0 + ph - ph * rate)
            })
            .collect();
        let label = format!("{} {:.1}%", sc.profile, sc.success_rate * 100.0);
        series(
            &mut s,
            colour,
            &pts,
            (x0 + pw + 15.0, y0 + 20.0 + 20.0 * i as f64),
            &label,
        );
    }

    // Bottom: attempts per source, grouped bars.
    let (bx0, by0, bw, bh) = (60.0, 370.0, W - 200.0, 200.0);
    let _ = writeln!(
        s,
        r#"<text x="{bx0}" y="{:.1}" font-size="14" font-weight="bold">Upstream attempts per source</text>"#,
        by0 - 18.0
    );
    let mut sources: Vec<&String> = Vec::new();
    for sc in scores {
        for (src, _) in &sc.attempts_by_source {
            if !sources.contains(&src) {
                sources.push(src);
            }
        }
    }
    let max_n = scores
        .iter()
        .flat_map(|sc| sc.attempts_by_source.iter().map(|(_, n)| *n))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let group = bw / sources.len().max(1) as f64;
    let bar = (group * 0.8) / scores.len().max(1) as f64;
    let _ = writeln!(
        s,
        r##"<line x1="{bx0}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#333"/><text x="{:.1}" y="{:.1}" text-anchor="end">{max_n:.0}</text>"##,
        by0 + bh,
        bx0 + bw,
        by0 + bh,
        bx0 - 6.0,
        by0 + 4.0
    );
    for (g, src) in sources.iter().enumerate() {
        let gx = bx0 + group * g as f64 + group * 0.1;
        for (i, sc) in scores.iter().enumerate() {
            let n = sc
                .attempts_by_source
                .iter()
                .find(|(x, _)| x == *src)
                .map_or(0, |(_, n)| *n) as f64;
            let h = bh * n / max_n;
            let _ = writeln!(
                s,
                r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{h:.1}" fill="{}"><title>{} {}: {n:.0}</title></rect>"#,
                gx + bar * i as f64,
                by0 + bh - h,
                bar.max(1.0) - 1.0,
                COLOURS[i % COLOURS.len()],
                esc(&sc.profile),
                esc(src)
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            gx + group * 0.4,
            by0 + bh + 16.0,
            esc(src)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// The latency chart: the CDF of successful calls' latency per profile, on a log
/// time axis (0.1 s .. the slowest p100). Written by hand, like [`svg`].
#[must_use]
#[allow(clippy::cast_precision_loss)]
pub fn latency_svg(scores: &[Score]) -> String {
    let (w, h) = (900.0, 420.0);
    let (x0, y0, pw, ph) = (60.0, 40.0, w - 240.0, h - 100.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    s.push_str("<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n");
    let _ = writeln!(
        s,
        r#"<text x="{x0}" y="22" font-size="14" font-weight="bold">Latency of successful calls (CDF, scenario seconds, log scale)</text>"#
    );
    let lo = 0.1_f64;
    let hi = scores
        .iter()
        .filter_map(|sc| sc.timing.success_cdf.last())
        .map(|&ms| secs(ms))
        .fold(10.0_f64, f64::max);
    let x = |sec: f64| x0 + pw * ((sec.max(lo) / lo).log10() / (hi / lo).log10());
    for pct in [0, 25, 50, 75, 95, 100] {
        let y = y0 + ph - ph * f64::from(pct) / 100.0;
        let _ = writeln!(
            s,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{pct}%</text>"##,
            x0 + pw,
            x0 - 6.0,
            y + 4.0
        );
    }
    let mut tick = lo;
    while tick <= hi * 1.0001 {
        let _ = writeln!(
            s,
            r##"<line x1="{:.1}" y1="{y0}" x2="{:.1}" y2="{:.1}" stroke="#eee"/><text x="{:.1}" y="{:.1}" text-anchor="middle">{tick}s</text>"##,
            x(tick),
            x(tick),
            y0 + ph,
            x(tick),
            y0 + ph + 16.0
        );
        tick *= 10.0;
    }
    for (i, sc) in scores.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let n = sc.timing.success_cdf.len().max(1) as f64;
        let pts: Vec<String> = sc
            .timing
            .success_cdf
            .iter()
            .enumerate()
            .map(|(k, &ms)| format!("{:.1},{:.1}", x(secs(ms)), y0 + ph - ph * (k as f64 + 1.0) / n))
            .collect();
        let label = format!(
            "{} p50 {:.1}s p95 {:.1}s",
            sc.profile,
            secs(sc.timing.success.p50),
            secs(sc.timing.success.p95)
        );
        series(
            &mut s,
            colour,
            &pts,
            (x0 + pw + 15.0, y0 + 20.0 + 20.0 * i as f64),
            &label,
        );
    }
    s.push_str("</svg>\n");
    s
}

/// The names of every check any profile ran, in first-seen order.
fn check_names(scores: &[Score]) -> Vec<&'static str> {
    let mut names: Vec<&'static str> = Vec::new();
    for s in scores {
        for c in &s.checks {
            if !names.contains(&c.name) {
                names.push(c.name);
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scoreboard::{Expectations, judge};
    use crate::telemetry::{AttemptRow, CallRow, ProfileRun};

    fn score(name: &str, ok: bool) -> Score {
        let mut accounting = crate::telemetry::Accounting::default();
        accounting.counters.insert("inflight s1".into(), 0);
        let run = ProfileRun {
            profile: name.into(),
            sources: vec!["s1".into(), "s<2>".into()],
            calls: vec![CallRow {
                call_id: "c".into(),
                worker: 0,
                kind: "P1".into(),
                started_ms: 0,
                ended_ms: 120_000,
                ok,
                cause: if ok { "ok".into() } else { "quota|x".into() },
                stream: false,
                first_chunk_ms: None,
            }],
            attempts: vec![AttemptRow {
                call_id: "c".into(),
                attempt: 1,
                worker: 0,
                source: "s<2>".into(),
                admitted_ms: 0,
                latency_ms: 1,
                ttft_ms: None,
                tokens: 1,
                outcome: "success".into(),
                cache_hit: false,
                request_error: false,
            }],
            accounting,
            ..ProfileRun::default()
        };
        judge(
            &run,
            &Expectations {
                calls: 1,
                success_bar: None,
                success_band: None,
                request_errors_gate: false,
                fail_fast_after_ms: None,
            },
        )
    }

    #[test]
    fn ratios_to_the_oracle() {
        // pgw: one answer in 120 s over a 2-minute run; the oracle: the same answer in
        // a 1-minute run: half its goodput, the same latency.
        let mut pgw = score("pgw", true);
        pgw.timing.goodput_per_min = 0.5;
        let mut oracle = score("oracle", true);
        oracle.timing.goodput_per_min = 1.0;
        oracle.timing.success.p50 /= 2;
        let scores = [pgw, oracle];
        let md = markdown(&RunInfo::default(), &scores);
        assert!(md.contains("| goodput vs oracle | x0.50 | x1.00 |"), "{md}");
        assert!(md.contains("| success p50 vs oracle | x2.00 | x1.00 |"), "{md}");
        assert!(terminal(&scores).contains("x0.50"));
    }

    /// pgw's successful calls at 3x the oracle's p95 on P6 fail its verdict, in the
    /// report's verdict row, its section against the oracle and the terminal; a
    /// profile without a successful call has no latency ratio (it was x0.00).
    #[test]
    fn the_bars_against_the_oracle_are_in_the_verdict() {
        let naive = score("naive", false);
        let mut pgw = score("pgw", true);
        let oracle = score("oracle", true);
        pgw.timing.success.p95 = oracle.timing.success.p95 * 3;
        let mut scores = vec![naive, pgw, oracle];
        assert!(scores.iter().all(Score::passed));
        acceptance::judge(&mut scores, &crate::scenario::Scenario::p6(1));
        let md = markdown(&RunInfo::default(), &scores);
        assert!(md.contains("| verdict | PASS | FAIL | PASS |"), "{md}");
        assert!(
            md.contains("| success p95 vs oracle | - | x3.00 | x1.00 |"),
            "{md}"
        );
        assert!(
            md.contains(
                "\n- pgw oracle: success p95: FAIL x3.00 (<= x2.00): 360.2 s against the oracle's 120.1 s\n"
            ),
            "{md}"
        );
        assert!(
            md.contains("- pgw oracle: goodput: info not judged (the oracle's is 0.0 ok/min"),
            "{md}"
        );
        assert!(!md.contains("| oracle: goodput |"), "not an invariant: {md}");
        let t = terminal(&scores);
        let row = t.lines().find(|l| l.starts_with("oracle: success p95")).unwrap();
        assert!(row.contains("FAIL"), "{t}");
    }

    #[test]
    fn markdown_has_a_column_per_profile_and_escapes() {
        let scores = [score("naive", false), score("pgw", true)];
        let md = markdown(
            &RunInfo {
                title: "t".into(),
                scenario: "x".into(),
                chart_file: "chart.svg".into(),
                latency_chart_file: "latency.svg".into(),
            },
            &scores,
        );
        assert!(md.contains("|  | naive | pgw |"), "{md}");
        assert!(
            md.contains("| **success** | **0.00%** (0/1) | **100.00%** (1/1) |"),
            "{md}"
        );
        assert!(md.contains("| quota\\|x | 1 | 0 |"), "{md}");
        assert!(md.contains("![success over time and attempts per source](chart.svg)"));
        assert!(md.starts_with("# t soak"), "{md}");
        assert!(md.contains("![latency of successful calls, CDF](latency.svg)"));
        // No oracle among the profiles: no ratio.
        assert!(md.contains("| goodput vs oracle | - | - |"), "{md}");
        let lat = latency_svg(&scores);
        assert!(lat.starts_with("<svg") && lat.trim_end().ends_with("</svg>"));
        assert_eq!(lat.matches("<polyline").count(), 1, "only pgw succeeded");
        let svg = svg(&scores);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("s&lt;2&gt;") && !svg.contains("s<2>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        let t = terminal(&scores);
        assert!(t.contains("success") && t.contains("100.00%"), "{t}");
    }
}
