//! [`SimPool`]: the shared state of the simulated provider and the per-request decision.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::StatusCode;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use crate::answer::{
    AnswerKind, AnswerPlan, Built, Echo, ErrorPlan, ErrorShape, build, build_error, set_rate_headers,
};
use crate::config::{
    AccountConfig, ConfigError, MAX_GENERATED_TOKENS, PoolConfig, SourceConfig, StreamUsage,
};
use crate::dist::{hash_bytes, log_normal, mix, uniform};
use crate::limits::{
    self, Check, Dimension, Nanos, RateHeaders, Refusal, Scope, ScopeState, openai_duration,
};
use crate::request::{IMAGE_PROMPT_TOKENS, SimRequest};
use crate::service::{ResponseFuture, SimService};
use crate::stats::{AccountStats, PoolStats, SourceStats};

/// The window of a source's own `rpm_gate`.
const RPM_GATE_WINDOW: Duration = Duration::from_secs(60);

/// Salts of the per-prompt decisions, so a prompt flagged by one is not flagged by all.
const CONTENT_POLICY_SALT: u64 = 0xC0_9011C7;
const CONTENT_FILTER_SALT: u64 = 0xF1_17E4;
const REFUSAL_SALT: u64 = 0x4EF_05A1;
const PREFILL_SALT: u64 = 0x9E_F111;

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
    /// Per source: whether a concurrency limit can ever apply to it (its own or its
    /// account's), so its admitted requests are tracked with their planned ends.
    track_inflight: Vec<bool>,
    start: Instant,
    state: Mutex<State>,
}

struct State {
    sources: Vec<SourceState>,
    accounts: Vec<AccountState>,
    /// The next in-flight ticket (unique over the pool).
    next_ticket: u64,
}

struct SourceState {
    rng: SmallRng,
    seq: u64,
    gate: VecDeque<Instant>,
    limits: ScopeState,
    stats: SourceStats,
}

struct AccountState {
    window: VecDeque<Instant>,
    limits: ScopeState,
    stats: AccountStats,
}

/// The decision for one request, with what the answer carries besides its plan.
struct Decision {
    plan: Plan,
    request_id: String,
    /// The request holds a slot of a concurrency limit.
    ticket: Option<u64>,
    /// `x-ratelimit-*` of the tightest scope, when a hard limit is set.
    rate_headers: Option<RateHeaders>,
}

/// What a counted answer was, beyond its status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    HardLimited,
    ModelNotFound,
    ContextLengthExceeded,
    ContentPolicy,
    Overloaded,
    InsufficientQuota,
    ContentFilter,
    Refusal,
    StreamError,
}

/// The outcome of the decision for one request.
pub(crate) enum Plan {
    BlackHole,
    Error(ErrorPlan, Option<Event>),
    Answer(Box<AnswerPlan>),
}

/// What gets counted when the answer goes out.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AnswerTag {
    pub(crate) status: u16,
    pub(crate) event: Option<Event>,
    pub(crate) without_usage: bool,
    pub(crate) without_done: bool,
    pub(crate) malformed_chunk: bool,
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
                limits: ScopeState::default(),
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
                limits: ScopeState::default(),
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
        let caps =
            |l: &crate::schedule::Schedule<crate::HardLimits>| l.values().any(|l| l.concurrency.is_some());
        let track_inflight = config
            .sources
            .iter()
            .zip(&source_account)
            .map(|(s, a)| caps(&s.limits) || caps(&accounts[*a].limits))
            .collect();
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                seed,
                names,
                source_account,
                accounts,
                track_inflight,
                start: Instant::now(),
                state: Mutex::new(State {
                    sources,
                    accounts: account_states,
                    next_ticket: 0,
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

    /// Scenario seconds since the pool's start: the tokio clock's elapsed time divided
    /// by [`PoolConfig::time_scale`]. The `t_s` at which [`SourceConfig::at`] and
    /// [`AccountConfig::at`] tell what a request arriving now meets.
    #[must_use]
    pub fn scenario_time_s(&self) -> f64 {
        self.inner.start.elapsed().as_secs_f64() / self.inner.config.time_scale
    }

    /// The account configuration of `source` (for a source without an account, the
    /// account of its own the pool made, with no 429 curve and no limits).
    #[must_use]
    pub fn account_of(&self, source: &str) -> Option<&AccountConfig> {
        let idx = *self.inner.names.get(source)?;
        Some(&self.inner.accounts[self.inner.source_account[idx]])
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

/// Whether a prompt whose hash is `h` falls in the fraction `rate` (no RNG draw).
#[allow(clippy::cast_precision_loss)]
fn by_hash(h: u64, rate: f64) -> bool {
    rate > 0.0 && (h as f64) < rate * u64::MAX as f64
}

/// Whether a random decision of probability `rate` fires; draws only when `rate > 0`,
/// so a knob that is off leaves the source's random sequence as it was.
fn draw(rng: &mut SmallRng, rate: f64) -> bool {
    rate > 0.0 && rng.random::<f64>() < rate
}

/// The 429 message of a hard limit, OpenAI's words.
fn limit_message(r: &Refusal, model: &str, source: &str, account: &str, scale: f64) -> String {
    let scope = match r.scope {
        Scope::Key => format!("project {source}"),
        Scope::Account => format!("organization {account}"),
    };
    let what = match r.dimension {
        Dimension::Requests => "requests per min (RPM)",
        Dimension::Tokens => "tokens per min (TPM)",
        Dimension::Concurrency => "concurrent requests",
    };
    if r.too_large {
        return format!(
            "Request too large for {model} in {scope} on {what}: Limit {}, Requested {}. The input or output tokens must be reduced in order to run successfully.",
            r.limit, r.requested
        );
    }
    let when = r.wait.map_or_else(
        || "later".to_owned(),
        |w| format!("in {}", openai_duration(w.mul_f64(scale))),
    );
    format!(
        "Rate limit reached for {model} in {scope} on {what}: Limit {}, Used {}, Requested {}. Please try again {when}.",
        r.limit, r.used, r.requested
    )
}

fn secs(d: f64) -> Duration {
    Duration::from_secs_f64(d.max(0.0))
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent between statements: a panic elsewhere cannot
        // leave it half-written, so a poisoned lock is still usable.
        pgw_core::sync::lock(&self.state)
    }

    /// Receives one request on source `idx`: decides its fate and builds the answer.
    pub(crate) fn dispatch(
        self: &Arc<Self>,
        idx: usize,
        req: &http::Request<bytes::Bytes>,
    ) -> ResponseFuture {
        let now = Instant::now();
        let parsed = SimRequest::parse(req.body());
        let token = bearer(req.headers()).map(str::to_owned);
        let Decision {
            plan,
            request_id,
            ticket,
            rate_headers,
        } = {
            let mut st = self.lock();
            self.decide(&mut st, idx, now, parsed, token.as_deref())
        };
        let guard = InflightGuard {
            pool: Arc::clone(self),
            source: idx,
            phase: Phase::Waiting,
            ticket,
        };
        let (tag, built) = match plan {
            Plan::BlackHole => return ResponseFuture::black_hole(guard),
            Plan::Error(e, event) => {
                let tag = AnswerTag {
                    status: e.status.as_u16(),
                    event,
                    ..AnswerTag::default()
                };
                (tag, build_error(&e, &request_id))
            }
            Plan::Answer(a) => {
                let stream = a.stream && a.kind != AnswerKind::StreamError;
                let tag = AnswerTag {
                    status: 200,
                    event: match a.kind {
                        AnswerKind::Text => None,
                        AnswerKind::ContentFilter => Some(Event::ContentFilter),
                        AnswerKind::Refusal => Some(Event::Refusal),
                        AnswerKind::StreamError => Some(Event::StreamError),
                    },
                    without_usage: stream && !a.usage_chunk,
                    without_done: stream && !a.done,
                    malformed_chunk: stream && a.malformed,
                    empty: a.empty && a.kind == AnswerKind::Text,
                    invalid_json: a.invalid_json && a.kind == AnswerKind::Text,
                    stalled: a.stall.is_some() && a.kind != AnswerKind::StreamError,
                    prompt_tokens: a.prompt_tokens,
                    completion_tokens: a.completion_tokens(),
                };
                (tag, build(&a, &request_id))
            }
        };
        let Built {
            delay,
            mut response,
            total,
        } = built;
        if let Some(h) = &rate_headers {
            set_rate_headers(&mut response, h, self.config.time_scale);
        }
        if let Some(t) = ticket {
            let a = self.source_account[idx];
            let mut st = self.lock();
            st.sources[idx].limits.planned_end(t, now + total);
            st.accounts[a].limits.planned_end(t, now + total);
        }
        ResponseFuture::answer(now + delay, response, tag, guard)
    }

    #[allow(clippy::too_many_lines, clippy::float_cmp)] // one decision, read top to bottom in the documented order
    fn decide(
        &self,
        st: &mut State,
        idx: usize,
        now: Instant,
        parsed: Result<SimRequest, String>,
        token: Option<&str>,
    ) -> Decision {
        let cfg: &SourceConfig = &self.config.sources[idx];
        let a = self.source_account[idx];
        let acct_cfg = &self.accounts[a];
        let State {
            sources,
            accounts,
            next_ticket,
        } = st;
        let src = &mut sources[idx];
        let acct = &mut accounts[a];
        src.seq += 1;
        let request_id = format!("req_{}_{}", cfg.name, src.seq);
        let mut decision = Decision {
            plan: Plan::BlackHole,
            request_id,
            ticket: None,
            rate_headers: None,
        };
        let finish = |mut d: Decision, plan: Plan| {
            d.plan = plan;
            d
        };
        src.stats.received += 1;
        src.stats.arrivals.push(now);
        acct.stats.received += 1;
        let scale = self.config.time_scale;
        // Scenario time: every schedule is read once, at arrival.
        let elapsed = now.duration_since(self.start);
        let t_s = elapsed.as_secs_f64() / scale;
        let now_ns: Nanos = if scale == 1.0 {
            elapsed.as_nanos()
        } else {
            Duration::from_secs_f64(t_s).as_nanos()
        };
        let snap = cfg.at(t_s);
        let acct_snap = acct_cfg.at(t_s);
        let window = secs(acct_snap.rate_limit.window_s * scale);
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
        let track = self.track_inflight[idx];
        let mut take_ticket = |src: &mut SourceState, acct: &mut AccountState| {
            let t = *next_ticket;
            *next_ticket += 1;
            src.limits.enter(t);
            acct.limits.enter(t);
            t
        };

        let error_latency = snap.error_latency_s;
        let error = |rng: &mut SmallRng, status: StatusCode, kind, code, message: String| ErrorPlan {
            status,
            kind,
            code,
            param: None,
            message,
            shape: ErrorShape::OpenAi,
            delay: secs(log_normal(rng, &error_latency) * scale),
            retry_after_s: None,
            retry_exact: None,
            time_scale: scale,
            rpm_limit: None,
        };
        // What the request is, when it could be read: the model it names, its prompt
        // tokens (the simulator's own count) and its completion budget.
        let model = match &parsed {
            Ok(r) if !r.model.is_empty() => r.model.clone(),
            _ => cfg.model.clone(),
        };
        let prompt_tokens = parsed.as_ref().map_or(0, |r| {
            (r.prompt_bytes() as f64 / self.config.prompt_bytes_per_token).ceil() as u64
                + 4 * r.messages.len() as u64
                + IMAGE_PROMPT_TOKENS * r.images()
        });
        let requested = parsed.as_ref().ok().and_then(|r| r.max_tokens);

        // 1. Black hole: accepts and never answers.
        if src.rng.random::<f64>() < snap.black_hole_rate {
            src.stats.black_holed += 1;
            if track {
                // Accepted: it holds a slot, with no known end, until the caller gives up.
                decision.ticket = Some(take_ticket(src, acct));
            }
            return finish(decision, Plan::BlackHole);
        }
        let rng = &mut src.rng;
        // 2. Authentication, then the key's billing.
        let key_ok = cfg.api_key.as_deref().is_none_or(|k| token == Some(k));
        if snap.revoked || !key_ok {
            let msg = "Incorrect API key provided. You can find your API key in your account settings.";
            let e = error(
                rng,
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "invalid_api_key",
                msg.into(),
            );
            return finish(decision, Plan::Error(e, None));
        }
        if draw(rng, snap.insufficient_quota_rate) {
            let e = error(
                rng,
                StatusCode::TOO_MANY_REQUESTS,
                "insufficient_quota",
                "insufficient_quota",
                "You exceeded your current quota, please check your plan and billing details.".into(),
            );
            return finish(decision, Plan::Error(e, Some(Event::InsufficientQuota)));
        }
        // 2b. Deterministic checks of the request against the source's model.
        if let Ok(req) = &parsed {
            if let Some(models) = &cfg.models
                && !models.contains(&model)
            {
                let e = error(
                    rng,
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    "model_not_found",
                    format!("The model `{model}` does not exist or you do not have access to it."),
                );
                return finish(decision, Plan::Error(e, Some(Event::ModelNotFound)));
            }
            if let Some(window) = cfg.context_window {
                let completion = req.max_tokens.unwrap_or(0);
                let total = prompt_tokens.saturating_add(completion);
                if total > window {
                    let mut e = error(
                        rng,
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        "context_length_exceeded",
                        format!(
                            "This model's maximum context length is {window} tokens. However, you requested {total} tokens ({prompt_tokens} in the messages, {completion} in the completion). Please reduce the length of the messages or completion."
                        ),
                    );
                    e.param = Some("messages");
                    return finish(decision, Plan::Error(e, Some(Event::ContextLengthExceeded)));
                }
            }
        }
        // 3. The source's own RPM gate.
        if let Some(limit) = snap.rpm_gate {
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
                return finish(decision, Plan::Error(e, None));
            }
            src.gate.push_back(now);
        }
        // 3b. Hard limits: the key's buckets, then the account's, all or nothing.
        if track || !snap.limits.is_none() || !acct_snap.limits.is_none() {
            let budget = requested.unwrap_or(cfg.completion.default_max_tokens);
            let tokens = if parsed.is_ok() {
                prompt_tokens.saturating_add(budget)
            } else {
                0
            };
            let mut scopes = [
                Check {
                    state: &mut src.limits,
                    limits: snap.limits,
                    scope: Scope::Key,
                },
                Check {
                    state: &mut acct.limits,
                    limits: acct_snap.limits,
                    scope: Scope::Account,
                },
            ];
            let (verdict, headers) = limits::check(&mut scopes, now_ns, now, scale, tokens);
            decision.rate_headers = (headers != RateHeaders::default()).then_some(headers);
            match verdict {
                Err(r) => {
                    let e = ErrorPlan {
                        status: StatusCode::TOO_MANY_REQUESTS,
                        kind: if r.dimension == Dimension::Tokens {
                            "tokens"
                        } else {
                            "requests"
                        },
                        code: "rate_limit_exceeded",
                        param: None,
                        message: limit_message(&r, &model, &cfg.name, &acct_cfg.name, scale),
                        shape: ErrorShape::OpenAi,
                        // Refused at the edge, at once: the hint is exact on arrival.
                        delay: Duration::ZERO,
                        retry_after_s: None,
                        retry_exact: r.wait.filter(|_| cfg.limit_retry_after).map(|w| w.mul_f64(scale)),
                        time_scale: scale,
                        rpm_limit: None,
                    };
                    return finish(decision, Plan::Error(e, Some(Event::HardLimited)));
                }
                Ok(()) if track => decision.ticket = Some(take_ticket(src, acct)),
                Ok(()) => {}
            }
        }
        let rng = &mut src.rng;
        // 4. The account's 429 curve.
        let rpm = acct.window.len() as f64 * 60.0 / acct_snap.rate_limit.window_s;
        let p429 = acct_snap.rate_limit.probability(account_inflight as f64, rpm);
        if rng.random::<f64>() < p429 {
            let ra = &acct_snap.retry_after;
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
            return finish(decision, Plan::Error(e, None));
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
                return finish(decision, Plan::Error(e, None));
            }
        };
        let hash = req.prompt_hash();
        if by_hash(hash, self.config.bad_prompt_rate) {
            let e = error(
                rng,
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_prompt",
                "Invalid prompt: your prompt was flagged as potentially violating our usage policy.".into(),
            );
            return finish(decision, Plan::Error(e, None));
        }
        if by_hash(mix(hash ^ CONTENT_POLICY_SALT), snap.content_policy_rate) {
            let e = error(
                rng,
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "content_policy_violation",
                "Your request was rejected as a result of our safety system. Your prompt may contain text that is not allowed by our safety system.".into(),
            );
            return finish(decision, Plan::Error(e, Some(Event::ContentPolicy)));
        }
        // 6. Server errors.
        if rng.random::<f64>() < snap.server_error_rate {
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
            return finish(decision, Plan::Error(e, None));
        }
        if draw(rng, snap.overloaded_rate) {
            let mut e = error(
                rng,
                StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
                "overloaded_error",
                "overloaded_error",
                "Overloaded".into(),
            );
            e.shape = ErrorShape::Anthropic;
            e.retry_after_s = cfg.overloaded_retry_after_s;
            return finish(decision, Plan::Error(e, Some(Event::Overloaded)));
        }
        // 7. A completion.
        let ttft = secs(log_normal(rng, &snap.ttft_s) * scale);
        let tokens_per_second = log_normal(rng, &snap.tokens_per_second) / scale;
        // The requested budget may be huge; the answer is at most MAX_GENERATED_TOKENS
        // long and fits the context window.
        let room = cfg
            .context_window
            .map_or(u64::MAX, |w| w.saturating_sub(prompt_tokens));
        let budget = requested
            .unwrap_or(cfg.completion.default_max_tokens)
            .min(MAX_GENERATED_TOKENS)
            .min(room)
            .max(1);
        let fraction = uniform(rng, cfg.completion.min_fraction, cfg.completion.max_fraction);
        let tokens = ((budget as f64 * fraction).round() as u64).clamp(1, budget);
        let empty = rng.random::<f64>() < snap.empty_rate;
        let json_mode = req.json_mode;
        let invalid_json = rng.random::<f64>() < snap.invalid_json_rate && json_mode && !empty;
        let stall = (rng.random::<f64>() < snap.stall.rate).then(|| {
            let pos = rng.random::<f64>();
            (
                pos,
                secs(uniform(rng, snap.stall.min_gap_s, snap.stall.max_gap_s) * scale),
            )
        });
        let mut text_seed = rng.random::<u64>();
        let mut prefix = None;
        if cfg.accepts_prefill {
            let (p, prompt) = req.prefill();
            text_seed = mix(prompt ^ PREFILL_SALT);
            prefix = p.map(str::to_owned);
        }
        let stream = req.stream;
        let kind = if stream && draw(rng, snap.stream_error_rate) {
            AnswerKind::StreamError
        } else if by_hash(mix(hash ^ CONTENT_FILTER_SALT), snap.content_filter_rate) {
            AnswerKind::ContentFilter
        } else if by_hash(mix(hash ^ REFUSAL_SALT), snap.refusal_rate) {
            AnswerKind::Refusal
        } else {
            AnswerKind::Text
        };
        let done = !(stream && draw(rng, snap.no_done_rate));
        let malformed = stream && draw(rng, snap.malformed_chunk_rate);
        let usage_chunk = match cfg.stream_usage {
            StreamUsage::Always => true,
            StreamUsage::WhenAsked => req.include_usage,
            StreamUsage::Never => false,
        };
        let echo = cfg.echo_openai_fields.then(|| Echo {
            system_fingerprint: format!("fp_{:010x}", hash_bytes(0, cfg.name.as_bytes()) >> 24),
            service_tier: req.service_tier.clone().unwrap_or_else(|| "default".into()),
            logprobs: req.logprobs,
        });
        let plan = AnswerPlan {
            id: format!("chatcmpl-{}-{}", cfg.name, src.seq),
            model,
            created: self.config.epoch_unix_s + now.duration_since(self.start).div_f64(scale).as_secs(),
            stream,
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
            kind,
            usage_chunk,
            done,
            malformed,
            echo,
            prefix,
        };
        finish(decision, Plan::Answer(Box::new(plan)))
    }

    /// Counts an answer going out.
    pub(crate) fn record_answer(&self, idx: usize, tag: AnswerTag) {
        let a = self.source_account[idx];
        let mut st = self.lock();
        let State {
            sources, accounts, ..
        } = &mut *st;
        let (s, acct) = (&mut sources[idx].stats, &mut accounts[a].stats);
        *s.answered.entry(tag.status).or_default() += 1;
        *acct.answered.entry(tag.status).or_default() += 1;
        if tag.status == 429 && tag.event != Some(Event::InsufficientQuota) {
            s.rate_limited += 1;
            acct.rate_limited += 1;
        }
        match tag.event {
            None => {}
            Some(Event::HardLimited) => {
                s.hard_limited += 1;
                acct.hard_limited += 1;
            }
            Some(Event::ModelNotFound) => s.model_not_found += 1,
            Some(Event::ContextLengthExceeded) => s.context_length_exceeded += 1,
            Some(Event::ContentPolicy) => s.content_policy_violations += 1,
            Some(Event::Overloaded) => s.overloaded += 1,
            Some(Event::InsufficientQuota) => s.insufficient_quota += 1,
            Some(Event::ContentFilter) => s.content_filtered += 1,
            Some(Event::Refusal) => s.refusals += 1,
            Some(Event::StreamError) => s.stream_errors += 1,
        }
        s.streams_without_usage += u64::from(tag.without_usage);
        s.streams_without_done += u64::from(tag.without_done);
        s.malformed_chunks += u64::from(tag.malformed_chunk);
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
    /// The slot it holds under a concurrency limit.
    ticket: Option<u64>,
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
        let State {
            sources, accounts, ..
        } = &mut *st;
        if let Some(t) = self.ticket {
            sources[self.source].limits.leave(t);
            accounts[a].limits.leave(t);
        }
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
