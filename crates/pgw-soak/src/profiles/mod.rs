//! The client profiles run side by side, and what they share: the upstream
//! attempt (`pgw-client` over the simulator), the attempt recorder and the accounting.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::str::FromStr;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use futures_util::future::BoxFuture;
use pgw_client::{
    AnswerClassifier, BoxTransport, ChatAnswer, ChatCall, SecretKey, SourceSettings, UpstreamClient,
    WatchdogCut,
};
use pgw_core::openai::ChatResponse;
use pgw_core::sync::lock;
use pgw_core::{BoxError, Classify};
use tower::Service;

use crate::driver::{Client, SoakCall};
use crate::scenario::Scenario;
use crate::telemetry::{Accounting, AttemptRow, Recorder};

pub mod naive;
pub mod oracle;
pub mod pgw;
pub mod tower_stock;

/// The profiles a run can compare.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProfileKind {
    /// The seeds' first design (round robin, consecutive-only breaker, 3 fixed attempts).
    Naive,
    /// tower alone: p2c + retry with `TpsBudget` + rate/concurrency limits.
    TowerStock,
    /// `pgw-stack`'s `Gateway` with its defaults.
    Pgw,
    /// The clairvoyant client: reads the pool's configuration, sends each call straight
    /// to a source that can answer it, paced for the most answers per minute.
    Oracle,
}

impl ProfileKind {
    /// All profiles, in report order.
    pub const ALL: [Self; 4] = [Self::Naive, Self::TowerStock, Self::Pgw, Self::Oracle];

    /// The profile's name (`naive`, `tower-stock`, `pgw`).
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Naive => "naive",
            Self::TowerStock => "tower-stock",
            Self::Pgw => "pgw",
            Self::Oracle => "oracle",
        }
    }
}

impl fmt::Display for ProfileKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ProfileKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s.trim())
            .ok_or_else(|| format!("unknown profile {s:?}; expected naive, tower-stock, pgw or oracle"))
    }
}

/// Where a profile's attempts go: the virtual pool (or, later, HTTP on loopback).
#[derive(Clone)]
pub struct Upstream {
    pool: pgw_sim::SimPool,
}

impl fmt::Debug for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Upstream(sim)")
    }
}

impl Upstream {
    /// The simulated pool, in process (virtual time).
    #[must_use]
    pub const fn sim(pool: pgw_sim::SimPool) -> Self {
        Self { pool }
    }

    /// The simulated pool.
    #[must_use]
    pub const fn pool(&self) -> &pgw_sim::SimPool {
        &self.pool
    }

    /// The transport of `source`.
    ///
    /// # Errors
    /// The source is not in the pool.
    pub fn transport(&self, source: &str) -> Result<BoxTransport, BoxError> {
        let svc = self
            .pool
            .service(source)
            .ok_or_else(|| format!("source {source:?} is not in the simulated pool"))?;
        Ok(pgw_client::box_transport(svc))
    }

    /// The client settings of `source`: the key its account uses and the scenario's
    /// timeouts (the same for every profile).
    #[must_use]
    pub fn settings(&self, scenario: &Scenario, source: &str) -> SourceSettings {
        let mut s = SourceSettings::new(source, format!("http://sim.invalid/{source}/v1"))
            .timeouts(scenario.client.timeouts());
        if let Some(key) = scenario
            .pool
            .sources
            .iter()
            .find(|c| c.name == source)
            .and_then(|c| c.api_key.clone())
        {
            s = s.key(SecretKey::new(key));
        }
        s
    }

    /// The upstream attempt service of `source`.
    ///
    /// # Errors
    /// Unknown source or bad settings.
    pub fn client(
        &self,
        scenario: &Scenario,
        source: &str,
    ) -> Result<UpstreamClient<BoxTransport>, BoxError> {
        Ok(UpstreamClient::new(
            self.settings(scenario, source),
            self.transport(source)?,
        )?)
    }
}

/// What a profile builder gets.
#[derive(Clone, Debug)]
pub struct Env {
    /// The scenario.
    pub scenario: Scenario,
    /// Where attempts go.
    pub upstream: Upstream,
    /// Where rows go.
    pub recorder: Recorder,
}

impl Env {
    /// The pool's source names, in order.
    #[must_use]
    pub fn sources(&self) -> Vec<String> {
        self.scenario
            .pool
            .sources
            .iter()
            .map(|s| s.name.clone())
            .collect()
    }
}

/// A built profile: one client per worker, and a way to read its books after the run.
pub struct Built {
    /// One client per worker.
    pub clients: Vec<Arc<dyn Client>>,
    /// Reads what is left in the books (in flight, leases, probes).
    pub accounting: Box<dyn Fn() -> BoxFuture<'static, Accounting> + Send + Sync>,
}

impl Built {
    /// The books once they are back to zero, read every `step`, or as they are after
    /// `patience`: what a client still has in flight after its last call (pgw's
    /// detached probe of a silent source lasts up to one attempt timeout) ends within
    /// it. `extra` adds what the books do not hold (the provider's own in-flight count).
    pub async fn settled_books(
        &self,
        patience: std::time::Duration,
        step: std::time::Duration,
        extra: impl Fn(&mut Accounting),
    ) -> Accounting {
        let until = tokio::time::Instant::now() + patience;
        loop {
            let mut acc = (self.accounting)().await;
            extra(&mut acc);
            if acc.counters.values().all(|v| *v == 0) || tokio::time::Instant::now() >= until {
                return acc;
            }
            tokio::time::sleep(step).await;
        }
    }
}

impl fmt::Debug for Built {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Built")
            .field("clients", &self.clients.len())
            .finish_non_exhaustive()
    }
}

/// A profile could not be built (the run goes on without it).
#[derive(Debug)]
pub struct BuildError(pub String);

impl fmt::Display for BuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot build the profile: {}", self.0)
    }
}

impl std::error::Error for BuildError {}

/// Builds `kind` for `env`.
///
/// # Errors
/// The profile cannot be built (bad settings, unknown source).
pub async fn build(kind: ProfileKind, env: &Env) -> Result<Built, BoxError> {
    match kind {
        ProfileKind::Naive => naive::build(env),
        ProfileKind::TowerStock => tower_stock::build(env),
        ProfileKind::Pgw => pgw::build(env).await,
        ProfileKind::Oracle => oracle::build(env),
    }
}

/// The pgw retry layer's reason a call ended (`budget_exhausted`, `stalled`, ...),
/// when `e`'s chain holds a `RetryError`.
#[must_use]
pub fn retry_reason(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<pgw_stack::retry::RetryError>() {
            return Some(r.reason().as_str().to_owned());
        }
        cur = err.source();
    }
    None
}

/// Names errors of the client crates for the failure causes of the report.
#[must_use]
pub fn error_name(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    if let Some(w) = e.downcast_ref::<WatchdogCut>() {
        return Some(format!("watchdog_{}", w.watchdog().as_str()));
    }
    if e.is::<naive::NoSourceAdmitted>() {
        return Some("no_source_admitted".into());
    }
    if e.is::<oracle::NoSourceCanAnswer>() {
        return Some("no_source_can_answer".into());
    }
    if e.is::<pgw_client::MalformedResponse>() {
        return Some("malformed".into());
    }
    None
}

/// The attempt number of a call, carried in its extensions so every attempt of one
/// call, through any retry layer, gets the next number.
#[derive(Clone, Debug, Default)]
pub struct AttemptNo(Arc<AtomicU32>);

impl AttemptNo {
    /// The next attempt's number (1-based).
    fn next(&self) -> u32 {
        self.0.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// A new [`ChatCall`] for a soak call: its id and a fresh attempt counter.
#[must_use]
pub fn chat_call(call: &crate::driver::SoakCall) -> ChatCall {
    let mut c = ChatCall::from_arc(Arc::clone(&call.request)).with_call_id(pgw_client::CallId(call.id));
    c.extensions_mut().insert(AttemptNo::default());
    c
}

/// The seeds' response cache, as the naive and oracle profiles use it: keyed by model,
/// messages, `max_tokens` and every other request field; a hit is recorded as a
/// cache-hit attempt row (it never reaches a source nor its gates).
#[derive(Debug, Default)]
pub struct ResponseCache(Mutex<HashMap<u64, ChatResponse>>);

impl ResponseCache {
    fn key(call: &SoakCall) -> u64 {
        let mut h = DefaultHasher::new();
        let r = &*call.request;
        r.model.hash(&mut h);
        for m in &r.messages {
            m.role.hash(&mut h);
            m.content.hash(&mut h);
        }
        r.max_tokens.hash(&mut h);
        serde_json::to_string(&r.extra).unwrap_or_default().hash(&mut h);
        h.finish()
    }

    fn map(&self) -> MutexGuard<'_, HashMap<u64, ChatResponse>> {
        lock(&self.0)
    }

    /// The cached answer to `call`, recording the hit for `worker`.
    pub fn hit(&self, call: &SoakCall, worker: u32, recorder: &Recorder) -> Option<ChatResponse> {
        let resp = self.map().get(&Self::key(call)).cloned()?;
        recorder.attempt(AttemptRow {
            call_id: call.call_id(),
            attempt: 1,
            worker,
            source: "cache".into(),
            admitted_ms: recorder.clock().now_ms(),
            latency_ms: 0,
            ttft_ms: None,
            tokens: 0,
            outcome: "success".into(),
            cache_hit: true,
            request_error: false,
        });
        Some(resp)
    }

    /// Stores the answer to `call`.
    pub fn insert(&self, call: &SoakCall, answer: &ChatResponse) {
        self.map().insert(Self::key(call), answer.clone());
    }
}

/// The tokens an attempt counts against a TPM quota, as its [`AttemptRow`] records
/// them and the scoreboard judges them: the usage the provider reported, else the
/// `estimate` the gates charged (an error, or an answer without usage).
pub(crate) fn counted_tokens(result: &Result<ChatAnswer, BoxError>, estimate: u64) -> u64 {
    match result {
        Ok(a) => a.stats.usage.as_ref().map_or(estimate, |u| u.total_tokens),
        Err(_) => estimate,
    }
}

/// One attempt on a recorded upstream client, as a concrete boxed future (an `async`
/// block awaiting `oneshot` directly trips a higher-ranked lifetime error of rustc in
/// the `Send` futures the driver needs).
pub(crate) fn attempt_on(
    mut svc: Recorded<UpstreamClient<BoxTransport>>,
    call: ChatCall,
) -> BoxFuture<'static, Result<ChatAnswer, BoxError>> {
    Box::pin(async move {
        std::future::poll_fn(|cx| svc.poll_ready(cx)).await?;
        svc.call(call).await
    })
}

/// In-flight attempts per source, counted by [`Recorded`]: the books the scoreboard
/// checks are back to zero.
#[derive(Clone, Debug, Default)]
pub struct Inflight(Arc<BTreeMap<String, AtomicI64>>);

impl Inflight {
    /// Counters for `sources`.
    #[must_use]
    pub fn new(sources: &[String]) -> Self {
        Self(Arc::new(
            sources.iter().map(|s| (s.clone(), AtomicI64::new(0))).collect(),
        ))
    }

    fn add(&self, source: &str, d: i64) {
        if let Some(n) = self.0.get(source) {
            n.fetch_add(d, Ordering::Relaxed);
        }
    }

    /// Current attempts in flight on `source`.
    #[must_use]
    pub fn get(&self, source: &str) -> i64 {
        self.0.get(source).map_or(0, |n| n.load(Ordering::Relaxed))
    }

    /// Writes `inflight <source>` counters into `acc`.
    pub fn report(&self, acc: &mut Accounting) {
        for (s, n) in self.0.iter() {
            acc.counters
                .insert(format!("inflight {s}"), n.load(Ordering::Relaxed).unsigned_abs());
        }
    }
}

struct InflightGuard {
    inflight: Inflight,
    source: String,
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.inflight.add(&self.source, -1);
    }
}

/// Records one [`AttemptRow`] per attempt of the wrapped upstream client, with the
/// admission instant taken at `call` (the gates above it admitted at that instant).
#[derive(Clone)]
pub struct Recorded<S> {
    inner: S,
    source: String,
    worker: u32,
    recorder: Recorder,
    inflight: Inflight,
}

impl<S> Recorded<S> {
    /// Wraps the upstream client of `source` for `worker`.
    pub fn new(inner: S, source: &str, worker: u32, recorder: Recorder, inflight: Inflight) -> Self {
        Self {
            inner,
            source: source.to_owned(),
            worker,
            recorder,
            inflight,
        }
    }
}

impl<S> Service<ChatCall> for Recorded<S>
where
    S: Service<ChatCall, Response = ChatAnswer, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = ChatAnswer;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<ChatAnswer, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, call: ChatCall) -> Self::Future {
        let clock = self.recorder.clock();
        let admitted_ms = clock.now_ms();
        let attempt = call.extensions().get::<AttemptNo>().map_or(1, AttemptNo::next);
        let call_id = call.id().to_string();
        let estimate = call.estimate_tokens();
        self.inflight.add(&self.source, 1);
        let guard = InflightGuard {
            inflight: self.inflight.clone(),
            source: self.source.clone(),
        };
        let recorder = self.recorder.clone();
        let worker = self.worker;
        let source = self.source.clone();
        let fut = self.inner.call(call);
        Box::pin(async move {
            let result = fut.await;
            drop(guard);
            let outcome = AnswerClassifier.classify(&result);
            let ttft_ms = result
                .as_ref()
                .ok()
                .and_then(|a| a.stats.ttft)
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            let tokens = counted_tokens(&result, estimate);
            recorder.attempt(AttemptRow {
                call_id,
                attempt,
                worker,
                source,
                admitted_ms,
                latency_ms: clock.now_ms().saturating_sub(admitted_ms),
                ttft_ms,
                tokens,
                outcome: outcome.as_str().to_owned(),
                cache_hit: false,
                request_error: result.as_ref().err().is_some_and(|e| {
                    pgw_core::UpstreamStatus::find(&**e).is_some_and(|u| {
                        let code = u.provider().and_then(|p| p.code.as_deref().or(p.kind.as_deref()));
                        crate::telemetry::is_request_error(Some(u.status().as_u16()), code)
                    })
                }),
            });
            result
        })
    }
}
