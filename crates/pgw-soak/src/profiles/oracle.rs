//! `oracle`: the clairvoyant client, the physical limit row of every report.
//!
//! It reads the pool's configuration (`pgw_sim::PoolConfig`), evaluated at the current
//! scenario second (schedules included), so it knows which source is revoked, which is
//! a black hole, which stalls its streams, every source's and account's limits and the
//! account 429 curve. It does not know the seeded draws (which answer will be empty,
//! which stream will stall): those it meets like every client, with the same timeouts,
//! cache and attempt limit.
//!
//! - **Routing.** For each attempt it ranks the sources by expected successful answers
//!   per second of occupancy, `p_ok / expected latency`, both derived from the
//!   configuration for this call's shape (streamed or not, structured or not, its
//!   prompt and completion budget): `p_ok` multiplies the chances of every fault on the
//!   path (black hole, 5xx, 529, billing 429, empty, invalid JSON, an error event in a
//!   stream, a stall the inter-token watchdog cuts, a first token later than its
//!   watchdog) and is 0 for a revoked key, a model the source does not serve or a
//!   context window the call does not fit. Sources at least 0.8 x as likely to
//!   answer as the best one are tried first (a retry waits for one of them); sources
//!   with `p_ok = 0` are never sent to; a call no source can answer fails at once
//!   without an attempt. A call that has waited 30 s goes before later ones.
//! - **Pacing.** Every quota the clients are given and every provider rate gate is
//!   kept as a sliding 60-second log (never over any fixed or sliding window; a TPM
//!   quota is charged the clients' token estimate while the attempt is in flight and
//!   settled to its usage, as the scoreboard counts it, when the attempt ends); every
//!   hard limit of a key or an account as a mirror of the provider's token bucket;
//!   concurrency caps are counted. An account with a 429 curve is paced at the arrival rate that
//!   maximises its successful answers per minute, **derived from the model**: with
//!   `L` the account's expected attempt latency over the traffic mix, arrivals `r` per
//!   minute keep `r L / 60` in flight, the curve gives `p(r L / 60, r)`, and the
//!   oracle takes the `r` of a 400-point grid (up to what the callers' concurrency can
//!   carry) that maximises `r (1 - p)`.
//! - **Retries.** Transient and dead-source outcomes spend the attempt budget (the
//!   scenario's, like every profile); a 429 does not (the pacing makes them the
//!   curve's, not the quota's); a rejected prompt fails at once; a content filter or a
//!   refusal is handed to the caller at once (the same prompt gets it everywhere); an
//!   invalid structured answer is re-asked up to [`MAX_REASKS`] times, as pgw does.
//!
//! It is a measuring stick, not a design: it reads what no real client can.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use pgw_client::{AnswerClassifier, BoxTransport, ChatAnswer, UpstreamClient};
use pgw_core::openai::ChatResponse;
use pgw_core::sync::lock;
use pgw_core::{BoxError, Classify, Outcome};
use pgw_sim::config::HardLimits;
use pgw_sim::{LogNormal, PoolConfig, RateLimitCurve, SourceConfig};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Built, Env, Inflight, Recorded, ResponseCache, attempt_on, chat_call, counted_tokens};
use crate::driver::{Client, Delivered, SoakCall, is_valid_structured, provider_verdict};
use crate::scenario::{ClientSettings, Scenario};
use crate::telemetry::{Accounting, Recorder};

/// Re-asks of an invalid structured answer, apart from the attempt budget (pgw's
/// default `max_reasks`).
pub const MAX_REASKS: u32 = 2;
/// 429s one call accepts before it gives up (a guard; the pacing keeps them rare).
pub const MAX_PUSHBACKS: u32 = 50;
/// Points of the rate grid the curve pacing is chosen on.
const RATE_GRID: u32 = 400;
/// The window of every rate limit the oracle keeps: one minute.
const MINUTE: Duration = Duration::from_secs(60);
/// Longest sleep of a waiting call before it looks again (a release also wakes it).
const MAX_NAP: Duration = Duration::from_secs(1);
/// Shortest sleep of a waiting call: time must advance between two looks.
const MIN_NAP: Duration = Duration::from_millis(1);
/// How long a waiting call may be passed by later ones before it goes first.
const PRIORITY_AFTER: Duration = Duration::from_secs(30);
/// A source is credible for a call when it is at least this fraction as likely to
/// answer as the most likely one: attempts go to credible sources first, retries only
/// to them.
const CREDIBLE: f64 = 0.8;
/// Smallest argument of the log-normal CDF's logarithm.
const ZSCORE_EPS: f64 = 1e-12;

/// No source of the pool can answer this call, by the pool's configuration.
#[derive(Debug)]
pub struct NoSourceCanAnswer;

impl std::fmt::Display for NoSourceCanAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no source of the pool can answer this call")
    }
}

impl std::error::Error for NoSourceCanAnswer {}

/// A sliding log of admissions and their costs over one window.
#[derive(Debug)]
struct Log {
    window: Duration,
    entries: VecDeque<(Instant, u64)>,
    sum: u64,
}

impl Log {
    fn new(window: Duration) -> Self {
        Self {
            window,
            entries: VecDeque::new(),
            sum: 0,
        }
    }

    fn expire(&mut self, now: Instant) {
        while let Some(&(t, c)) = self.entries.front() {
            if now.saturating_duration_since(t) < self.window {
                break;
            }
            self.entries.pop_front();
            self.sum -= c;
        }
    }

    /// `None` when `cost` fits under `limit` now, else when it may (`None` limit: always).
    fn blocked_until(&mut self, now: Instant, cost: u64, limit: Option<u64>) -> Option<Instant> {
        let limit = limit?;
        self.expire(now);
        if self.sum + cost <= limit {
            return None;
        }
        if cost > limit {
            // Never fits: a configuration the call cannot pass (its odds said so).
            return Some(now + Duration::from_secs(3600));
        }
        let mut left = self.sum;
        for &(t, c) in &self.entries {
            left -= c;
            if left + cost <= limit {
                return Some(t + self.window);
            }
        }
        Some(now + self.window)
    }

    fn push(&mut self, now: Instant, cost: u64) {
        if cost > 0 {
            self.entries.push_back((now, cost));
            self.sum += cost;
        }
    }

    /// Corrects the entry pushed at `at` with `charged` to `real` (an estimate settled
    /// to what the attempt really used). An entry the window has dropped stays dropped:
    /// it no longer counts, whatever it cost.
    fn settle(&mut self, at: Instant, charged: u64, real: u64) {
        if charged == real {
            return;
        }
        // The log is in time order: the entry is among those of its instant.
        let from = self.entries.partition_point(|e| e.0 < at);
        let entry = self
            .entries
            .range_mut(from..)
            .take_while(|e| e.0 == at)
            .find(|e| e.1 == charged);
        if let Some(e) = entry {
            // The entry is in the sum: `sum >= charged`.
            self.sum = (self.sum - charged).saturating_add(real);
            e.1 = real;
        } else if charged == 0 {
            // Nothing was pushed for it; its place keeps the log in time order.
            let i = self.entries.partition_point(|e| e.0 <= at);
            self.entries.insert(i, (at, real));
            self.sum = self.sum.saturating_add(real);
        }
    }
}

/// The limits of one scope at one instant.
#[derive(Clone, Copy, Debug, Default)]
struct Limits {
    rpm: Option<u64>,
    tpm: Option<u64>,
    concurrency: Option<u32>,
}

impl Limits {
    fn hard(h: &HardLimits) -> Self {
        Self {
            rpm: h.rpm,
            tpm: h.tpm,
            concurrency: h.concurrency,
        }
    }
}

/// A mirror of a provider's token bucket: capacity the limit, refilled at `limit / 60`
/// per scenario second, full at the start (the simulator's hard limits, exactly).
#[derive(Debug)]
struct Bucket {
    /// Tokens in the bucket at `at`; `None` until first used (then full).
    level: Option<(f64, Instant)>,
    /// Real seconds per scenario second.
    time_scale: f64,
}

impl Bucket {
    fn level(&self, now: Instant, limit: u64) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let cap = limit as f64;
        self.level.map_or(cap, |(l, at)| {
            let dt = now.saturating_duration_since(at).as_secs_f64() / self.time_scale;
            (l + dt * cap / 60.0).min(cap)
        })
    }

    #[allow(clippy::cast_precision_loss)]
    fn blocked_until(&self, now: Instant, cost: u64, limit: Option<u64>) -> Option<Instant> {
        let limit = limit?;
        let level = self.level(now, limit);
        let need = cost as f64 - level;
        if need <= 0.0 {
            return None;
        }
        let secs = need / (limit as f64 / 60.0) * self.time_scale;
        // At least a millisecond: a float's last bit must not make a zero-length wait
        // (under the paused clock that would spin without time advancing).
        Some(now + Duration::from_secs_f64(secs.clamp(1e-3, 3600.0)))
    }

    #[allow(clippy::cast_precision_loss)]
    fn take(&mut self, now: Instant, cost: u64, limit: Option<u64>) {
        if let Some(limit) = limit {
            self.level = Some((self.level(now, limit) - cost as f64, now));
        }
    }
}

/// How a scope counts requests or tokens: a sliding minute (the clients' quotas and
/// rate gates, never over any fixed or sliding window) or a token bucket (a provider's
/// hard limit).
#[derive(Debug)]
enum Meter {
    Log(Log),
    Bucket(Bucket),
}

impl Meter {
    fn blocked_until(&mut self, now: Instant, cost: u64, limit: Option<u64>) -> Option<Instant> {
        match self {
            Self::Log(l) => l.blocked_until(now, cost, limit),
            Self::Bucket(b) => b.blocked_until(now, cost, limit),
        }
    }

    fn take(&mut self, now: Instant, cost: u64, limit: Option<u64>) {
        match self {
            Self::Log(l) => l.push(now, cost),
            Self::Bucket(b) => b.take(now, cost, limit),
        }
    }

    /// Corrects what was taken at `at` from `charged` to `real`: a sliding log counts
    /// what was used, as a quota that settles to real usage does; a token bucket keeps
    /// what it took (the simulator's hard limits never give tokens back).
    fn settle(&mut self, at: Instant, charged: u64, real: u64) {
        if let Self::Log(l) = self {
            l.settle(at, charged, real);
        }
    }
}

/// Requests, tokens and attempts in flight of one scope.
#[derive(Debug)]
struct Gate {
    requests: Meter,
    tokens: Meter,
    inflight: u32,
}

impl Gate {
    /// A gate counting sliding minutes (of `time_scale` real seconds per scenario one).
    fn sliding(time_scale: f64) -> Self {
        Self {
            requests: Meter::Log(Log::new(MINUTE.mul_f64(time_scale))),
            tokens: Meter::Log(Log::new(MINUTE.mul_f64(time_scale))),
            inflight: 0,
        }
    }

    /// A gate mirroring a provider's token buckets.
    fn buckets(time_scale: f64) -> Self {
        let bucket = || {
            Meter::Bucket(Bucket {
                level: None,
                time_scale,
            })
        };
        Self {
            requests: bucket(),
            tokens: bucket(),
            inflight: 0,
        }
    }

    /// `Ok` when admitted under `limits`; else when to look again (`None`: at a release).
    fn check(&mut self, now: Instant, tokens: u64, limits: Limits) -> Result<(), Option<Instant>> {
        if limits.concurrency.is_some_and(|c| self.inflight >= c) {
            return Err(None);
        }
        let a = self.requests.blocked_until(now, 1, limits.rpm);
        let b = self.tokens.blocked_until(now, tokens, limits.tpm);
        match a.into_iter().chain(b).max() {
            None => Ok(()),
            Some(t) => Err(Some(t)),
        }
    }

    fn take(&mut self, now: Instant, tokens: u64, limits: Limits) {
        self.requests.take(now, 1, limits.rpm);
        self.tokens.take(now, tokens, limits.tpm);
        self.inflight += 1;
    }
}

/// An account: its hard limits' gate and the pacing of its 429 curve.
#[derive(Debug)]
struct Account {
    /// Index in `PoolConfig::accounts`; `None`: a source's own account (no limits).
    config: Option<usize>,
    gate: Gate,
    pace: Log,
    /// Expected attempt latency on this account over the traffic mix, seconds.
    latency_s: f64,
    /// Median latency of an error answer (a 429) on this account's sources, seconds.
    latency_429_s: f64,
    /// The last curve paced for and its best rate (the curve changes only on a
    /// schedule; the grid search runs once per change).
    paced: Option<(RateLimitCurve, Option<f64>)>,
}

impl Account {
    fn best_rate(&mut self, curve: &RateLimitCurve, max_inflight: u32) -> Option<f64> {
        match &self.paced {
            Some((c, r)) if c == curve => *r,
            _ => {
                let r = best_rate(curve, self.latency_s, self.latency_429_s, max_inflight);
                self.paced = Some((*curve, r));
                r
            }
        }
    }
}

#[derive(Debug)]
struct SourceState {
    /// The quota the clients are given: charged the clients' token estimate while an
    /// attempt is in flight, settled to its usage as the scoreboard counts it
    /// ([`counted_tokens`]) when it ends.
    quota: Gate,
    /// The key's hard limits (counted in the simulator's own tokens, as it does).
    key: Gate,
    /// The source's provider-side RPM gate (`rpm_gate`, a sliding minute).
    provider_gate: Log,
    account: usize,
}

struct State {
    sources: Vec<SourceState>,
    accounts: Vec<Account>,
    /// Calls waiting for a source: ticket -> since when. After [`PRIORITY_AFTER`] the
    /// oldest goes first, so a large call is not starved by small ones.
    waiting: BTreeMap<u64, Instant>,
    next_ticket: u64,
}

/// What one attempt costs: the clients' token estimate (their quotas) and the
/// simulator's own count (prompt tokens + budget: its hard limits).
#[derive(Clone, Copy, Debug)]
struct Cost {
    estimate: u64,
    provider: u64,
}

/// What the oracle needs of a call.
#[derive(Clone, Debug)]
struct Shape {
    model: String,
    stream: bool,
    structured: bool,
    prompt_tokens: u64,
    budget: u64,
}

struct Shared {
    pool: PoolConfig,
    /// Index in `pool.accounts` of each source's account (`None`: its own, no limits).
    account_of: Vec<Option<usize>>,
    client: ClientSettings,
    clients: Vec<Mutex<UpstreamClient<BoxTransport>>>,
    names: Vec<String>,
    state: Mutex<State>,
    released: Notify,
    cache: ResponseCache,
    origin: Instant,
    global_concurrency: u32,
    inflight: Inflight,
    recorder: Recorder,
}

/// The standard normal CDF (Abramowitz and Stegun 7.1.26, error below 1.5e-7).
fn phi(z: f64) -> f64 {
    let x = z.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736 + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erf = 1.0 - poly * (-x * x).exp();
    if z >= 0.0 {
        0.5 * (1.0 + erf)
    } else {
        0.5 * (1.0 - erf)
    }
}

/// `P(X <= x)` for the simulator's clamped log-normal.
fn cdf(d: &LogNormal, x: f64) -> f64 {
    if x < d.min {
        return 0.0;
    }
    if x >= d.max {
        return 1.0;
    }
    if d.p95 <= d.median {
        return if x >= d.median { 1.0 } else { 0.0 };
    }
    let sigma = (d.p95 / d.median).ln() / 1.644_853_6;
    phi((x.max(ZSCORE_EPS) / d.median).ln() / sigma)
}

/// The chance one attempt of `shape` on `src` (at scenario second `t`) answers well,
/// and its expected latency in seconds.
#[allow(clippy::cast_precision_loss)]
fn odds(src: &SourceConfig, t: f64, shape: &Shape, client: &ClientSettings) -> (f64, f64) {
    if src.revoked.at(t) {
        return (0.0, f64::INFINITY);
    }
    if let Some(models) = &src.models
        && !shape.model.is_empty()
        && !models.contains(&shape.model)
    {
        return (0.0, f64::INFINITY);
    }
    if src
        .context_window
        .is_some_and(|w| shape.prompt_tokens.saturating_add(shape.budget) > w)
    {
        return (0.0, f64::INFINITY);
    }
    let ttft = src.ttft_s.at(t);
    let tps = src.tokens_per_second.at(t);
    let completion = &src.completion;
    let tokens = shape.budget.min(pgw_sim::config::MAX_GENERATED_TOKENS) as f64
        * f64::midpoint(completion.min_fraction, completion.max_fraction);
    let generation_s = tokens / tps.median.max(1e-9);
    let stall = src.stall.at(t);
    let stall_mean_s = f64::midpoint(stall.min_gap_s, stall.max_gap_s);
    let mut p = (1.0 - src.black_hole_rate.at(t))
        * (1.0 - src.server_error_rate.at(t))
        * (1.0 - src.overloaded_rate.at(t))
        * (1.0 - src.insufficient_quota_rate.at(t))
        * (1.0 - src.empty_rate.at(t));
    if shape.structured {
        p *= 1.0 - src.invalid_json_rate.at(t);
    }
    let mut latency_s = ttft.median + generation_s;
    if shape.stream {
        // The stream quirks the clients' shared HTTP client fails an attempt on today
        // (an error event, a malformed chunk, no `[DONE]`): the oracle sees the pool
        // through the same client as every profile.
        p *= 1.0 - src.stream_error_rate.at(t);
        p *= 1.0 - src.malformed_chunk_rate.at(t);
        p *= 1.0 - src.no_done_rate.at(t);
        p *= cdf(&ttft, client.first_token_s);
        // A stall longer than the inter-token watchdog is cut.
        let span = stall.max_gap_s - stall.min_gap_s;
        let cut = if stall.min_gap_s > client.inter_token_s {
            1.0
        } else if span > 0.0 {
            ((stall.max_gap_s - client.inter_token_s) / span).clamp(0.0, 1.0)
        } else {
            0.0
        };
        p *= 1.0 - stall.rate * cut;
    } else {
        latency_s += stall.rate * stall_mean_s;
        p *= cdf(&ttft, client.total_s - generation_s - stall.rate * stall_mean_s);
    }
    (p.clamp(0.0, 1.0), latency_s.max(1e-3))
}

/// The arrival rate (per minute) that maximises `r (1 - p)` on `curve`, where `p` is
/// the curve at `r` arrivals per minute and the in-flight count they keep: a fixed
/// point of `inflight = r / 60 x ((1 - p) L + p L429)` (an answer occupies `L`
/// seconds, a 429 `L429`). Rates are searched up to what `max_inflight` can carry, and
/// only where the curve is below its cap: the cap bounds the simulator's model, it is
/// not a provider behaviour worth exploiting (past it, more 429s would buy more
/// answers). `None` when the curve never refuses (no pacing needed).
#[must_use]
pub fn best_rate(
    curve: &RateLimitCurve,
    latency_s: f64,
    latency_429_s: f64,
    max_inflight: u32,
) -> Option<f64> {
    if curve.probability(1e9, 1e9) <= 0.0 {
        return None;
    }
    let l = latency_s.max(1e-3);
    let r_max = f64::from(max_inflight.max(1)) * 60.0 / l;
    let mut best: Option<(f64, f64)> = None;
    for i in 1..=RATE_GRID {
        let r = r_max * f64::from(i) / f64::from(RATE_GRID);
        let mut p = curve.probability(r * l / 60.0, r);
        for _ in 0..8 {
            p = curve.probability(r / 60.0 * ((1.0 - p) * l + p * latency_429_s), r);
        }
        if p >= curve.max {
            break;
        }
        let g = r * (1.0 - p);
        if best.is_none_or(|(bg, _)| g > bg) {
            best = Some((g, r));
        }
    }
    Some(best.map_or(r_max / f64::from(RATE_GRID), |(_, r)| r))
}

impl Shared {
    fn scenario_s(&self, now: Instant) -> f64 {
        now.saturating_duration_since(self.origin).as_secs_f64() / self.pool.time_scale
    }

    /// The quota the clients are given for source `i`.
    fn quota_limits(&self, i: usize) -> Limits {
        let q = self.client.quota(&self.names[i]);
        Limits {
            rpm: q.rpm,
            tpm: q.tpm,
            concurrency: Some(q.max_concurrency),
        }
    }

    /// The hard limits of source `i`'s key and of its account at `t`, and the account's
    /// 429 curve.
    fn provider_limits(
        &self,
        i: usize,
        account: Option<usize>,
        t: f64,
    ) -> (Limits, Limits, Option<RateLimitCurve>) {
        let key = Limits::hard(&self.pool.sources[i].limits.at(t));
        match account {
            Some(a) => {
                let c = &self.pool.accounts[a];
                (key, Limits::hard(&c.limits.at(t)), Some(c.rate_limit.at(t)))
            }
            None => (key, Limits::default(), None),
        }
    }

    /// The sources that can answer `shape` at `t`, in the order to try them: the
    /// credible ones (at least [`CREDIBLE`] x the best chance) by answers per second of
    /// occupancy, then, for a first attempt only, the rest.
    fn ranked(&self, shape: &Shape, cost: Cost, t: f64, retry: bool) -> Vec<usize> {
        let mut ranked: Vec<(f64, f64, usize)> = Vec::new();
        for (i, s) in self.pool.sources.iter().enumerate() {
            let (p, l) = odds(s, t, shape, &self.client);
            let (key, acct, _) = self.provider_limits(i, self.account_of[i], t);
            // A call larger than a token bucket can ever hold never passes there.
            let too_large = [key.tpm, acct.tpm, self.quota_limits(i).tpm]
                .into_iter()
                .flatten()
                .any(|cap| cost.provider.min(cost.estimate) > cap);
            if p > 0.0 && !too_large {
                ranked.push((p, p / l, i));
            }
        }
        let best = ranked.iter().map(|o| o.0).fold(0.0, f64::max);
        if retry {
            // A retry waits for a credible source rather than spend the budget on a
            // doubtful one.
            ranked.retain(|o| o.0 >= CREDIBLE * best);
        }
        ranked.sort_by(|a, b| {
            let (ca, cb) = (a.0 >= CREDIBLE * best, b.0 >= CREDIBLE * best);
            cb.cmp(&ca).then(b.1.total_cmp(&a.1))
        });
        ranked.into_iter().map(|o| o.2).collect()
    }

    /// Tries to admit the call holding `ticket` on one of `ranked` now: `Ok((source,
    /// now))` (reserved), else when to look again (`None`: at the next release).
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    fn admit(&self, ranked: &[usize], cost: Cost, ticket: u64) -> Result<(usize, Instant), Option<Instant>> {
        let now = Instant::now();
        let t = self.scenario_s(now);
        let mut st = lock(&self.state);
        if let Some((&head, &since)) = st.waiting.first_key_value()
            && head != ticket
            && now.saturating_duration_since(since) >= PRIORITY_AFTER
        {
            return Err(None);
        }
        let mut wake: Option<Instant> = None;
        let mut later = |w: Option<Instant>| {
            if let Some(w) = w {
                wake = Some(wake.map_or(w, |x| x.min(w)));
            }
        };
        for &i in ranked {
            let State {
                sources, accounts, ..
            } = &mut *st;
            let src = &mut sources[i];
            let acct = &mut accounts[src.account];
            let (key_limits, acct_limits, curve) = self.provider_limits(i, acct.config, t);
            if let Err(w) = src.quota.check(now, cost.estimate, self.quota_limits(i)) {
                later(w);
                continue;
            }
            if let Err(w) = src.key.check(now, cost.provider, key_limits) {
                later(w);
                continue;
            }
            let gate_rpm = self.pool.sources[i].rpm_gate.at(t).map(u64::from);
            if let Some(w) = src.provider_gate.blocked_until(now, 1, gate_rpm) {
                later(Some(w));
                continue;
            }
            if let Err(w) = acct.gate.check(now, cost.provider, acct_limits) {
                later(w);
                continue;
            }
            if let Some(curve) = curve
                && let Some(rate) = acct.best_rate(&curve, self.global_concurrency)
            {
                acct.pace.window = Duration::from_secs_f64(curve.window_s * self.pool.time_scale);
                let per_window = (rate * curve.window_s / 60.0).floor().max(1.0) as u64;
                if let Some(w) = acct.pace.blocked_until(now, 1, Some(per_window)) {
                    later(Some(w));
                    continue;
                }
                acct.pace.push(now, 1);
            }
            src.quota.take(now, cost.estimate, self.quota_limits(i));
            src.key.take(now, cost.provider, key_limits);
            src.provider_gate.push(now, 1);
            acct.gate.take(now, cost.provider, acct_limits);
            st.waiting.remove(&ticket);
            return Ok((i, now));
        }
        Err(wake)
    }

    /// Settles source `i`'s quota for the attempt admitted at `at`: the estimate it was
    /// charged becomes what the attempt counts.
    fn settle(&self, i: usize, at: Instant, cost: Cost, counted: u64) {
        lock(&self.state).sources[i]
            .quota
            .tokens
            .settle(at, cost.estimate, counted);
    }

    /// A ticket in the waiting line, taken now.
    fn ticket(&self) -> u64 {
        let mut st = lock(&self.state);
        st.next_ticket += 1;
        let t = st.next_ticket;
        st.waiting.insert(t, Instant::now());
        t
    }

    fn release(&self, i: usize) {
        {
            let mut st = lock(&self.state);
            let State {
                sources, accounts, ..
            } = &mut *st;
            let src = &mut sources[i];
            src.quota.inflight = src.quota.inflight.saturating_sub(1);
            src.key.inflight = src.key.inflight.saturating_sub(1);
            let a = &mut accounts[src.account].gate;
            a.inflight = a.inflight.saturating_sub(1);
        }
        self.released.notify_waiters();
    }
}

/// A place in the waiting line, left on every path (the future may be dropped).
struct Ticket<'a> {
    shared: &'a Shared,
    id: Option<u64>,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            lock(&self.shared.state).waiting.remove(&id);
        }
    }
}

/// Releases an admitted attempt's slots on every path (the future may be dropped).
struct Slot {
    shared: Arc<Shared>,
    source: usize,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.shared.release(self.source);
    }
}

/// The simulator's own prompt-token count of a plain-text request: prompt bytes over
/// `prompt_bytes_per_token`, rounded up, plus 4 per message.
#[allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]
fn prompt_tokens(pool: &PoolConfig, call: &SoakCall) -> u64 {
    let r = &call.request;
    (r.prompt_bytes() as f64 / pool.prompt_bytes_per_token).ceil() as u64 + 4 * r.messages.len() as u64
}

/// The completion budget the simulator counts for `call`: its `max_tokens` (or
/// `max_completion_tokens`), else the largest default budget of the pool's sources (a
/// bound for whichever source answers).
fn budget(pool: &PoolConfig, call: &SoakCall) -> u64 {
    let r = &call.request;
    r.max_tokens
        .or_else(|| {
            r.extra
                .get("max_completion_tokens")
                .and_then(serde_json::Value::as_u64)
        })
        .unwrap_or_else(|| {
            pool.sources
                .iter()
                .map(|s| s.completion.default_max_tokens)
                .max()
                .unwrap_or(pgw_sim::config::DEFAULT_MAX_TOKENS)
        })
}

struct Worker {
    shared: Arc<Shared>,
    worker: u32,
}

impl Worker {
    async fn wait_for_source(
        &self,
        shape: &Shape,
        cost: Cost,
        retry: bool,
    ) -> Result<(usize, Instant), NoSourceCanAnswer> {
        let shared = &self.shared;
        let mut ticket = Ticket { shared, id: None };
        loop {
            let released = shared.released.notified();
            tokio::pin!(released);
            // Registered before looking, so a release between the look and the wait wakes us.
            released.as_mut().enable();
            let t = shared.scenario_s(Instant::now());
            let ranked = shared.ranked(shape, cost, t, retry);
            if ranked.is_empty() {
                return Err(NoSourceCanAnswer);
            }
            let id = *ticket.id.get_or_insert_with(|| shared.ticket());
            let wake = match shared.admit(&ranked, cost, id) {
                Ok(admitted) => {
                    ticket.id = None;
                    return Ok(admitted);
                }
                Err(w) => w,
            };
            let now = Instant::now();
            let until = wake.map_or(now + MAX_NAP, |w| w.clamp(now + MIN_NAP, now + MAX_NAP));
            tokio::select! {
                () = released => {}
                () = tokio::time::sleep_until(until) => {}
            }
        }
    }

    async fn run(self: Arc<Self>, call: SoakCall) -> Result<ChatResponse, BoxError> {
        let shared = Arc::clone(&self.shared);
        if let Some(resp) = shared.cache.hit(&call, self.worker, &shared.recorder) {
            return Ok(resp);
        }
        let chat = chat_call(&call);
        let tokens = chat.estimate_tokens();
        let prompt = prompt_tokens(&shared.pool, &call);
        let shape = Shape {
            model: call.request.model.clone(),
            stream: call.request.stream,
            structured: call.structured,
            prompt_tokens: prompt,
            budget: budget(&shared.pool, &call),
        };
        let cost = Cost {
            estimate: tokens,
            provider: prompt.saturating_add(shape.budget),
        };
        let (mut attempts, mut reasks, mut pushbacks) = (shared.client.max_attempts, MAX_REASKS, 0);
        let mut last: Result<ChatResponse, BoxError> = Err(Box::new(NoSourceCanAnswer));
        while attempts > 0 {
            let retry = attempts < shared.client.max_attempts;
            let (source, admitted) = match self.wait_for_source(&shape, cost, retry).await {
                Ok(a) => a,
                Err(e) => return Err(Box::new(e)),
            };
            let slot = Slot {
                shared: Arc::clone(&shared),
                source,
            };
            let client = lock(&shared.clients[source]).clone();
            let svc = Recorded::new(
                client,
                &shared.names[source],
                self.worker,
                shared.recorder.clone(),
                shared.inflight.clone(),
            );
            let result: Result<ChatAnswer, BoxError> = attempt_on(svc, chat.clone()).await;
            // Settled before the release wakes the waiting calls: they see the room.
            shared.settle(source, admitted, cost, counted_tokens(&result, cost.estimate));
            drop(slot);
            let outcome = AnswerClassifier.classify(&result);
            match result {
                Ok(a) if provider_verdict(&a.response).is_some() => return Ok(a.response),
                Ok(a) if outcome == Outcome::Success => {
                    if call.structured && !is_valid_structured(a.content()) && reasks > 0 {
                        reasks -= 1;
                        last = Ok(a.response);
                        continue;
                    }
                    if !call.structured || is_valid_structured(a.content()) {
                        shared.cache.insert(&call, &a.response);
                    }
                    return Ok(a.response);
                }
                Ok(a) => {
                    attempts -= 1;
                    last = Ok(a.response);
                }
                Err(e) => match outcome {
                    Outcome::RateLimited { .. } if pushbacks < MAX_PUSHBACKS => {
                        pushbacks += 1;
                        last = Err(e);
                    }
                    Outcome::Rejected => return Err(e),
                    _ => {
                        attempts -= 1;
                        last = Err(e);
                    }
                },
            }
            if pushbacks >= MAX_PUSHBACKS {
                break;
            }
        }
        last
    }
}

struct OracleClient(Arc<Worker>);

impl Client for OracleClient {
    fn call(&self, call: SoakCall) -> BoxFuture<'static, Result<Delivered, BoxError>> {
        let run = Arc::clone(&self.0).run(call);
        Box::pin(async move { run.await.map(Delivered::from) })
    }
}

/// The expected attempt latency over the traffic mix on the best of `sources`, at the
/// scenario's start.
fn mix_latency(sc: &Scenario, sources: &[usize]) -> f64 {
    let t = &sc.traffic;
    let total: f64 = t.mix.iter().sum();
    let mut latency = 0.0;
    for (k, share) in t.mix.iter().enumerate() {
        let shape = Shape {
            model: t.model.clone(),
            stream: k == 4,
            structured: k == 2,
            prompt_tokens: if k == 1 {
                (t.large_prompt_bytes as u64) / 4
            } else {
                100
            },
            budget: t.max_tokens[k],
        };
        let best = sources
            .iter()
            .map(|&i| odds(&sc.pool.sources[i], 0.0, &shape, &sc.client))
            .filter(|(p, _)| *p > 0.0)
            .map(|(p, l)| (p / l, l))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map_or(30.0, |(_, l)| l);
        latency += share / total.max(1e-9) * best;
    }
    latency
}

/// Builds the oracle profile: one shared client over the pool's configuration.
///
/// # Errors
/// Unknown source or bad client settings.
pub fn build(env: &Env) -> Result<Built, BoxError> {
    let sc = &env.scenario;
    let names = env.sources();
    let mut accounts: Vec<Account> = Vec::new();
    let mut sources = Vec::new();
    for s in &sc.pool.sources {
        let config = s
            .account
            .as_ref()
            .and_then(|a| sc.pool.accounts.iter().position(|x| &x.name == a));
        let account = match config.and_then(|c| accounts.iter().position(|a| a.config == Some(c))) {
            Some(a) => a,
            None => {
                accounts.push(Account {
                    config,
                    gate: Gate::buckets(sc.pool.time_scale),
                    pace: Log::new(MINUTE),
                    latency_s: 0.0,
                    latency_429_s: 0.0,
                    paced: None,
                });
                accounts.len() - 1
            }
        };
        sources.push(SourceState {
            quota: Gate::sliding(sc.pool.time_scale),
            key: Gate::buckets(sc.pool.time_scale),
            provider_gate: Log::new(MINUTE.mul_f64(sc.pool.time_scale)),
            account,
        });
    }
    for (a, acct) in accounts.iter_mut().enumerate() {
        let members: Vec<usize> = (0..sources.len()).filter(|&i| sources[i].account == a).collect();
        acct.latency_s = mix_latency(sc, &members);
        acct.latency_429_s = members
            .iter()
            .map(|&i| sc.pool.sources[i].error_latency_s.at(0.0).median)
            .fold(0.0, f64::max);
    }
    let clients = names
        .iter()
        .map(|n| env.upstream.client(sc, n).map(Mutex::new))
        .collect::<Result<Vec<_>, _>>()?;
    let inflight = Inflight::new(&names);
    let account_of = sources.iter().map(|s| accounts[s.account].config).collect();
    let shared = Arc::new(Shared {
        pool: sc.pool.clone(),
        account_of,
        client: sc.client.clone(),
        clients,
        names,
        state: Mutex::new(State {
            sources,
            accounts,
            waiting: BTreeMap::new(),
            next_ticket: 0,
        }),
        released: Notify::new(),
        cache: ResponseCache::default(),
        origin: env.recorder.clock().origin(),
        global_concurrency: sc.global_concurrency(),
        inflight: inflight.clone(),
        recorder: env.recorder.clone(),
    });
    let clients = (0..sc.workers)
        .map(|w| {
            Arc::new(OracleClient(Arc::new(Worker {
                shared: Arc::clone(&shared),
                worker: w,
            }))) as Arc<dyn Client>
        })
        .collect();
    let books = Arc::clone(&shared);
    Ok(Built {
        clients,
        accounting: Box::new(move || {
            let mut acc = Accounting::default();
            inflight.report(&mut acc);
            let st = lock(&books.state);
            acc.counters
                .insert("calls waiting".into(), st.waiting.len() as u64);
            for (i, s) in st.sources.iter().enumerate() {
                acc.counters.insert(
                    format!("slots held {}", books.names[i]),
                    u64::from(s.quota.inflight),
                );
            }
            Box::pin(std::future::ready(acc))
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phi_and_cdf() {
        assert!((phi(0.0) - 0.5).abs() < 1e-7);
        assert!((phi(1.644_853_6) - 0.95).abs() < 1e-6);
        assert!((phi(-1.96) - 0.025).abs() < 1e-4);
        let d = LogNormal {
            median: 10.0,
            p95: 40.0,
            min: 1.0,
            max: 100.0,
        };
        assert!((cdf(&d, 10.0) - 0.5).abs() < 1e-6);
        assert!((cdf(&d, 40.0) - 0.95).abs() < 1e-6);
        assert_eq!(cdf(&d, 0.5), 0.0);
        assert_eq!(cdf(&d, 100.0), 1.0);
    }

    #[test]
    fn sliding_log_says_when_a_cost_fits() {
        let t0 = Instant::now();
        let mut log = Log::new(MINUTE);
        assert_eq!(log.blocked_until(t0, 1, None), None);
        log.push(t0, 3);
        log.push(t0 + Duration::from_secs(10), 2);
        assert_eq!(log.blocked_until(t0 + Duration::from_secs(20), 1, Some(6)), None);
        // 5 used of 5: the first entry's 3 free at t0 + 60 s.
        assert_eq!(
            log.blocked_until(t0 + Duration::from_secs(20), 1, Some(5)),
            Some(t0 + MINUTE)
        );
        // 4 needs both entries gone.
        assert_eq!(
            log.blocked_until(t0 + Duration::from_secs(20), 4, Some(5)),
            Some(t0 + Duration::from_secs(70))
        );
        assert_eq!(log.blocked_until(t0 + MINUTE, 1, Some(3)), None);
    }

    #[test]
    fn an_entry_settles_to_real_usage() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let mut log = Log::new(MINUTE);
        log.push(t0, 1_000);
        log.push(t1, 1_000);
        // 2000 charged of 2500: a third call of 1000 waits for the first entry.
        assert_eq!(log.blocked_until(t1, 1_000, Some(2_500)), Some(t0 + MINUTE));
        log.settle(t0, 1_000, 300);
        assert_eq!(log.sum, 1_300, "the sum is the real usage plus what is in flight");
        assert_eq!(log.blocked_until(t1, 1_000, Some(2_500)), None);
        // Upwards too, and an entry the window dropped stays dropped.
        log.settle(t1, 1_000, 1_200);
        assert_eq!(log.sum, 1_500);
        log.expire(t0 + MINUTE);
        log.settle(t0, 300, 5_000);
        assert_eq!((log.sum, log.entries.len()), (1_200, 1));
        // Nothing was pushed for a zero charge: the real usage takes its place in order.
        log.settle(t0 + Duration::from_millis(500), 0, 40);
        assert_eq!(log.sum, 1_240);
        assert_eq!(log.entries.front(), Some(&(t0 + Duration::from_millis(500), 40)));
    }

    /// The clients' TPM quota is charged the estimate at admission and settled to the
    /// real usage at the attempt's end (the scoreboard judges real usage, and pgw's
    /// limiter settles so): a second call whose estimate fits only beside the first's
    /// real usage goes at once, where it waited for the first's estimate to leave the
    /// minute.
    #[test]
    fn the_quota_settles_to_real_usage() {
        use crate::profiles::ProfileKind;
        use crate::run::{run_profile_virtual, traffic};
        let mut sc = Scenario {
            name: "tpm".into(),
            calls: 2,
            workers: 1,
            concurrency: 1,
            pool: PoolConfig::of(vec![SourceConfig::quick("a")]),
            ..Scenario::default()
        };
        sc.traffic.mix = [1.0, 0.0, 0.0, 0.0, 0.0];
        let estimates: Vec<u64> = traffic(&sc, 1.0).map(|c| c.request.estimate_tokens()).collect();
        // Room for both estimates but one token.
        let limit = estimates[0] + estimates[1] - 1;
        sc.client.quotas = vec![crate::scenario::SourceQuota {
            tpm: Some(limit),
            ..crate::scenario::SourceQuota::unlimited("a")
        }];
        sc.validate().unwrap();
        let run =
            run_profile_virtual(&sc, ProfileKind::Oracle, None, &indicatif::ProgressBar::hidden()).unwrap();
        let mut attempts = run.attempts.clone();
        attempts.sort_by_key(|a| a.admitted_ms);
        assert_eq!(attempts.len(), 2, "{attempts:?}");
        assert!(attempts.iter().all(|a| a.outcome == "success" && !a.cache_hit));
        assert!(attempts[0].tokens < estimates[0], "{attempts:?} {estimates:?}");
        // The second went when the first ended (a quick source: seconds), not after
        // the minute its estimate would have held.
        let first_end = attempts[0].admitted_ms + attempts[0].latency_ms;
        assert!(
            attempts[1].admitted_ms <= first_end + 1_000,
            "{attempts:?}, limit {limit}"
        );
        assert!(crate::scoreboard::quota_violations(&run).is_empty());
    }

    #[test]
    fn the_best_rate_balances_the_curve() {
        let curve = RateLimitCurve {
            rpm_knee: 30.0,
            rpm_slope: 0.005,
            ..RateLimitCurve::default()
        };
        // g(r) = r (1 - 0.005 (r - 30)) peaks at r = 115; the grid is within a step.
        let r = best_rate(&curve, 1.0, 1.0, 64).unwrap();
        assert!((r - 115.0).abs() < 10.0, "{r}");
        assert_eq!(best_rate(&RateLimitCurve::default(), 1.0, 1.0, 64), None);
        // The callers' concurrency bounds the rate: 4 in flight x 60 / 20 s = 12/min.
        let slow = best_rate(&curve, 20.0, 20.0, 4).unwrap();
        assert!(slow <= 12.0 + 1e-9, "{slow}");
        // A concurrency term lowers the best rate: answers that last 20 s keep r/3 in
        // flight, and each one above 8 adds 1%.
        let busy = RateLimitCurve {
            concurrency_knee: 8.0,
            concurrency_slope: 0.01,
            ..curve
        };
        let rb = best_rate(&busy, 20.0, 0.3, 64).unwrap();
        assert!(rb < r - 5.0 && rb > 30.0, "{rb} vs {r}");
    }

    #[test]
    fn odds_follow_the_configuration() {
        let client = ClientSettings::default();
        let shape = Shape {
            model: "sim-model".into(),
            stream: true,
            structured: false,
            prompt_tokens: 100,
            budget: 500,
        };
        let healthy = SourceConfig::healthy("a");
        let (p, l) = odds(&healthy, 0.0, &shape, &client);
        assert!(p > 0.9 && l > 1.0, "{p} {l}");
        let mut dead = SourceConfig::healthy("b");
        dead.revoked = true.into();
        assert_eq!(odds(&dead, 0.0, &shape, &client).0, 0.0);
        let mut small = SourceConfig::healthy("c");
        small.context_window = Some(300);
        assert_eq!(odds(&small, 0.0, &shape, &client).0, 0.0);
        let mut stalls = SourceConfig::healthy("d");
        stalls.stall = pgw_sim::StallConfig {
            rate: 0.9,
            min_gap_s: 20.0,
            max_gap_s: 90.0,
        }
        .into();
        let (ps, _) = odds(&stalls, 0.0, &shape, &client);
        assert!((ps - p * 0.1).abs() < 1e-9, "{ps}");
    }
}
