//! [`SimPool`]: the shared state of the simulated provider and the per-request decision.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use http::StatusCode;
use pgw_core::openai::ChatRequest;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use crate::answer::{AnswerPlan, Built, ErrorPlan, build, build_error};
use crate::config::{AccountConfig, ConfigError, PoolConfig, SourceConfig};
use crate::dist::{hash_bytes, log_normal, mix, uniform};
use crate::service::{ResponseFuture, SimService};
use crate::stats::{AccountStats, PoolStats, SourceStats};

/// The window of a source's own `rpm_gate`.
const RPM_GATE_WINDOW: Duration = Duration::from_secs(60);

/// The simulated provider pool: sources, accounts, their seeded randomness and counters.
///
/// Cheap to clone (an `Arc` inside); every [`SimService`] of one pool shares its state,
/// so traffic on one source raises the account-level 429 rate of its siblings.
#[derive(Clone)]
pub struct SimPool {
    inner: Arc<Inner>,
}

impl fmt::Debug for SimPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimPool")
            .field("sources", &self.inner.config.sources.len())
            .field("seed", &self.inner.seed)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    config: PoolConfig,
    seed: u64,
    names: HashMap<String, usize>,
    /// Account index of each source.
    source_account: Vec<usize>,
    accounts: Vec<AccountConfig>,
    start: Instant,
    state: Mutex<State>,
}

struct State {
    sources: Vec<SourceState>,
    accounts: Vec<AccountState>,
}

struct SourceState {
    rng: SmallRng,
    seq: u64,
    gate: VecDeque<Instant>,
    stats: SourceStats,
}

struct AccountState {
    window: VecDeque<Instant>,
    stats: AccountStats,
}

/// The outcome of the decision for one request.
pub(crate) enum Plan {
    BlackHole,
    Error(ErrorPlan),
    Answer(Box<AnswerPlan>),
}

/// What gets counted when the answer goes out.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AnswerTag {
    pub(crate) status: u16,
    pub(crate) empty: bool,
    pub(crate) invalid_json: bool,
    pub(crate) stalled: bool,
    pub(crate) prompt_tokens: u64,
    pub(crate) completion_tokens: u64,
}

impl SimPool {
    /// A pool from `config`, with every random choice derived from `seed` (each source
    /// draws from its own stream, seeded from `seed` and its name).
    ///
    /// Reads the tokio clock (the pool's start, for `created` fields), so call it
    /// inside a runtime.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first invalid field.
    pub fn new(config: PoolConfig, seed: u64) -> Result<Self, ConfigError> {
        config.validate()?;
        let mut accounts = config.accounts.clone();
        let mut account_index: HashMap<String, usize> = accounts
            .iter()
            .enumerate()
            .map(|(i, a)| (a.name.clone(), i))
            .collect();
        let mut source_account = Vec::with_capacity(config.sources.len());
        let mut names = HashMap::new();
        for (i, s) in config.sources.iter().enumerate() {
            names.insert(s.name.clone(), i);
            let a = if let Some(a) = &s.account {
                account_index[a]
            } else {
                // An account of its own, named after the source, with no 429 curve.
                let name = unique_name(&account_index, &s.name);
                accounts.push(AccountConfig {
                    name: name.clone(),
                    ..AccountConfig::default()
                });
                account_index.insert(name, accounts.len() - 1);
                accounts.len() - 1
            };
            source_account.push(a);
        }
        let sources = config
            .sources
            .iter()
            .enumerate()
            .map(|(i, s)| SourceState {
                rng: SmallRng::seed_from_u64(mix(seed ^ hash_bytes(0, s.name.as_bytes()))),
                seq: 0,
                gate: VecDeque::new(),
                stats: SourceStats {
                    account: accounts[source_account[i]].name.clone(),
                    ..SourceStats::default()
                },
            })
            .collect();
        let account_states = accounts
            .iter()
            .enumerate()
            .map(|(a, _)| AccountState {
                window: VecDeque::new(),
                stats: AccountStats {
                    sources: config
                        .sources
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| source_account[*i] == a)
                        .map(|(_, s)| s.name.clone())
                        .collect(),
                    ..AccountStats::default()
                },
            })
            .collect();
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                seed,
                names,
                source_account,
                accounts,
                start: Instant::now(),
                state: Mutex::new(State {
                    sources,
                    accounts: account_states,
                }),
            }),
        })
    }

    /// The virtual endpoint of `source`, or `None` if the pool has no such source.
    #[must_use]
    pub fn service(&self, source: &str) -> Option<SimService> {
        let idx = *self.inner.names.get(source)?;
        Some(SimService::new(Arc::clone(&self.inner), idx))
    }

    /// The names of the sources, in configuration order.
    #[must_use]
    pub fn sources(&self) -> Vec<String> {
        self.inner.config.sources.iter().map(|s| s.name.clone()).collect()
    }

    /// The configuration the pool runs.
    #[must_use]
    pub fn config(&self) -> &PoolConfig {
        &self.inner.config
    }

    /// A snapshot of every counter, with the arrival logs.
    #[must_use]
    pub fn stats(&self) -> PoolStats {
        let st = self.inner.lock();
        PoolStats {
            sources: self
                .inner
                .config
                .sources
                .iter()
                .zip(&st.sources)
                .map(|(c, s)| (c.name.clone(), s.stats.clone()))
                .collect(),
            accounts: self
                .inner
                .accounts
                .iter()
                .zip(&st.accounts)
                .map(|(c, a)| (c.name.clone(), a.stats.clone()))
                .collect(),
        }
    }
}

fn unique_name(taken: &HashMap<String, usize>, base: &str) -> String {
    let mut name = base.to_owned();
    while taken.contains_key(&name) {
        name.push('~');
    }
    name
}

fn bearer(headers: &http::HeaderMap) -> Option<&str> {
    let v = headers.get(http::header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// The 400 decision: a function of the prompt text only.
fn prompt_hash(req: &ChatRequest) -> u64 {
    req.messages
        .iter()
        .fold(0x5EED_u64, |h, m| mix(h ^ hash_bytes(h, m.content.as_bytes())))
}

fn secs(d: f64) -> Duration {
    Duration::from_secs_f64(d.max(0.0))
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent between statements: a panic elsewhere cannot
        // leave it half-written, so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Receives one request on source `idx`: decides its fate and builds the answer.
    pub(crate) fn dispatch(
        self: &Arc<Self>,
        idx: usize,
        req: &http::Request<bytes::Bytes>,
    ) -> ResponseFuture {
        let now = Instant::now();
        let parsed = serde_json::from_slice::<ChatRequest>(req.body());
        let token = bearer(req.headers()).map(str::to_owned);
        let (plan, request_id) = {
            let mut st = self.lock();
            self.decide(&mut st, idx, now, parsed, token.as_deref())
        };
        let guard = InflightGuard {
            pool: Arc::clone(self),
            source: idx,
            phase: Phase::Waiting,
        };
        match plan {
            Plan::BlackHole => ResponseFuture::black_hole(guard),
            Plan::Error(e) => {
                let tag = AnswerTag {
                    status: e.status.as_u16(),
                    ..AnswerTag::default()
                };
                let Built { delay, response } = build_error(&e, &request_id);
                ResponseFuture::answer(now + delay, response, tag, guard)
            }
            Plan::Answer(a) => {
                let tag = AnswerTag {
                    status: 200,
                    empty: a.empty,
                    invalid_json: a.invalid_json,
                    stalled: a.stall.is_some(),
                    prompt_tokens: a.prompt_tokens,
                    completion_tokens: if a.empty { 0 } else { a.tokens },
                };
                let Built { delay, response } = build(&a, &request_id);
                ResponseFuture::answer(now + delay, response, tag, guard)
            }
        }
    }

    #[allow(clippy::too_many_lines)] // one decision, read top to bottom in the documented order
    fn decide(
        &self,
        st: &mut State,
        idx: usize,
        now: Instant,
        parsed: Result<ChatRequest, serde_json::Error>,
        token: Option<&str>,
    ) -> (Plan, String) {
        let cfg: &SourceConfig = &self.config.sources[idx];
        let a = self.source_account[idx];
        let acct_cfg = &self.accounts[a];
        let State { sources, accounts } = st;
        let src = &mut sources[idx];
        let acct = &mut accounts[a];
        src.seq += 1;
        let request_id = format!("req_{}_{}", cfg.name, src.seq);
        src.stats.received += 1;
        src.stats.arrivals.push(now);
        acct.stats.received += 1;
        let scale = self.config.time_scale;
        let window = secs(acct_cfg.rate_limit.window_s * scale);
        acct.window.push_back(now);
        while acct
            .window
            .front()
            .is_some_and(|t| now.duration_since(*t) >= window)
        {
            acct.window.pop_front();
        }
        let account_inflight = acct.stats.in_flight;
        src.stats.in_flight += 1;
        acct.stats.in_flight += 1;
        acct.stats.peak_in_flight = acct.stats.peak_in_flight.max(acct.stats.in_flight);

        let rng = &mut src.rng;
        let error = |rng: &mut SmallRng, status: StatusCode, kind, code, message: String| ErrorPlan {
            status,
            kind,
            code,
            message,
            delay: secs(log_normal(rng, &cfg.error_latency_s) * scale),
            retry_after_s: None,
            time_scale: scale,
            rpm_limit: None,
        };

        // 1. Black hole: accepts and never answers.
        if rng.random::<f64>() < cfg.black_hole_rate {
            src.stats.black_holed += 1;
            return (Plan::BlackHole, request_id);
        }
        // 2. Authentication.
        let key_ok = cfg.api_key.as_deref().is_none_or(|k| token == Some(k));
        if cfg.revoked || !key_ok {
            let msg = "Incorrect API key provided. You can find your API key in your account settings.";
            let e = error(
                rng,
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "invalid_api_key",
                msg.into(),
            );
            return (Plan::Error(e), request_id);
        }
        // 3. The source's own RPM gate.
        if let Some(limit) = cfg.rpm_gate {
            let gate_window = RPM_GATE_WINDOW.mul_f64(scale);
            while src
                .gate
                .front()
                .is_some_and(|t| now.duration_since(*t) >= gate_window)
            {
                src.gate.pop_front();
            }
            if src.gate.len() >= limit as usize {
                let oldest = src.gate.front().copied().unwrap_or(now);
                // In scenario seconds, rounded up.
                let wait = (oldest + gate_window).duration_since(now).div_f64(scale);
                let wait_s = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
                let mut e = error(
                    rng,
                    StatusCode::TOO_MANY_REQUESTS,
                    "requests",
                    "rate_limit_exceeded",
                    format!(
                        "Rate limit reached for requests on source {}: Limit {limit}, Used {limit}, Requested 1. Please try again in {wait_s}s.",
                        cfg.name
                    ),
                );
                e.retry_after_s = Some(wait_s.max(1));
                e.rpm_limit = Some((limit, wait_s.max(1)));
                return (Plan::Error(e), request_id);
            }
            src.gate.push_back(now);
        }
        // 4. The account's 429 curve.
        let rpm = acct.window.len() as f64 * 60.0 / acct_cfg.rate_limit.window_s;
        let p429 = acct_cfg.rate_limit.probability(account_inflight as f64, rpm);
        if rng.random::<f64>() < p429 {
            let ra = &acct_cfg.retry_after;
            let retry_after_s =
                (rng.random::<f64>() < ra.rate).then(|| rng.random_range(ra.min_s..=ra.max_s));
            let mut e = error(
                rng,
                StatusCode::TOO_MANY_REQUESTS,
                "requests",
                "rate_limit_exceeded",
                format!(
                    "Rate limit reached for account {}. Please slow down.",
                    acct_cfg.name
                ),
            );
            e.retry_after_s = retry_after_s;
            return (Plan::Error(e), request_id);
        }
        // 5. The request itself.
        let req = match parsed {
            Ok(r) => r,
            Err(err) => {
                let e = error(
                    rng,
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    "invalid_json",
                    format!("We could not parse the JSON body of your request: {err}"),
                );
                return (Plan::Error(e), request_id);
            }
        };
        let bad = self.config.bad_prompt_rate;
        if bad > 0.0 && (prompt_hash(&req) as f64) < bad * u64::MAX as f64 {
            let e = error(
                rng,
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_prompt",
                "Invalid prompt: your prompt was flagged as potentially violating our usage policy.".into(),
            );
            return (Plan::Error(e), request_id);
        }
        // 6. Server errors.
        if rng.random::<f64>() < cfg.server_error_rate {
            let status = [
                StatusCode::INTERNAL_SERVER_ERROR,
                StatusCode::BAD_GATEWAY,
                StatusCode::SERVICE_UNAVAILABLE,
            ][rng.random_range(0..3usize)];
            let e = error(
                rng,
                status,
                "server_error",
                "server_error",
                "The server had an error while processing your request. Sorry about that!".into(),
            );
            return (Plan::Error(e), request_id);
        }
        // 7. A completion.
        let ttft = secs(log_normal(rng, &cfg.ttft_s) * scale);
        let tokens_per_second = log_normal(rng, &cfg.tokens_per_second) / scale;
        let budget = req.max_tokens.unwrap_or(cfg.completion.default_max_tokens).max(1);
        let fraction = uniform(rng, cfg.completion.min_fraction, cfg.completion.max_fraction);
        let tokens = ((budget as f64 * fraction).round() as u64).clamp(1, budget);
        let empty = rng.random::<f64>() < cfg.empty_rate;
        let json_mode = req
            .extra
            .get("response_format")
            .and_then(|f| f.get("type"))
            .and_then(|t| t.as_str())
            .is_some_and(|t| t.starts_with("json"));
        let invalid_json = rng.random::<f64>() < cfg.invalid_json_rate && json_mode && !empty;
        let stall = (rng.random::<f64>() < cfg.stall.rate).then(|| {
            let pos = rng.random::<f64>();
            (
                pos,
                secs(uniform(rng, cfg.stall.min_gap_s, cfg.stall.max_gap_s) * scale),
            )
        });
        let text_seed = rng.random::<u64>();
        let prompt_tokens = (req.prompt_bytes() as f64 / self.config.prompt_bytes_per_token).ceil() as u64
            + 4 * req.messages.len() as u64;
        let model = if req.model.is_empty() {
            cfg.model.clone()
        } else {
            req.model.clone()
        };
        let plan = AnswerPlan {
            id: format!("chatcmpl-{}-{}", cfg.name, src.seq),
            model,
            created: self.config.epoch_unix_s + now.duration_since(self.start).div_f64(scale).as_secs(),
            stream: req.stream,
            json_mode,
            ttft,
            tokens_per_second,
            tokens,
            prompt_tokens,
            empty,
            invalid_json,
            stall,
            text_seed,
            max_frames: self.config.max_stream_frames,
        };
        (Plan::Answer(Box::new(plan)), request_id)
    }

    /// Counts an answer going out.
    pub(crate) fn record_answer(&self, idx: usize, tag: AnswerTag) {
        let a = self.source_account[idx];
        let mut st = self.lock();
        let State { sources, accounts } = &mut *st;
        let (s, acct) = (&mut sources[idx].stats, &mut accounts[a].stats);
        *s.answered.entry(tag.status).or_default() += 1;
        *acct.answered.entry(tag.status).or_default() += 1;
        if tag.status == 429 {
            s.rate_limited += 1;
            acct.rate_limited += 1;
        }
        s.empty_completions += u64::from(tag.empty);
        s.invalid_json += u64::from(tag.invalid_json);
        s.stalled += u64::from(tag.stalled);
        s.prompt_tokens += tag.prompt_tokens;
        s.completion_tokens += tag.completion_tokens;
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Waiting,
    Streaming,
    Done,
    StreamCompleted,
}

/// Holds one request in flight; dropping it ends the request, counting how it ended.
pub(crate) struct InflightGuard {
    pool: Arc<Inner>,
    source: usize,
    phase: Phase,
}

impl InflightGuard {
    pub(crate) fn streaming(&mut self) {
        self.phase = Phase::Streaming;
    }

    pub(crate) fn done(&mut self) {
        self.phase = Phase::Done;
    }

    pub(crate) fn stream_completed(&mut self) {
        self.phase = Phase::StreamCompleted;
    }

    pub(crate) fn pool(&self) -> &Arc<Inner> {
        &self.pool
    }

    pub(crate) fn source(&self) -> usize {
        self.source
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        let a = self.pool.source_account[self.source];
        let mut st = self.pool.lock();
        let State { sources, accounts } = &mut *st;
        let s = &mut sources[self.source].stats;
        s.in_flight = s.in_flight.saturating_sub(1);
        let acct = &mut accounts[a].stats;
        acct.in_flight = acct.in_flight.saturating_sub(1);
        match self.phase {
            Phase::Waiting => s.dropped_before_answer += 1,
            Phase::Streaming => s.streams_dropped += 1,
            Phase::StreamCompleted => s.streams_completed += 1,
            Phase::Done => {}
        }
    }
}
