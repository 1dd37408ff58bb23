//! [`Gateway`]: the call flow (cache, then the fallback chain
//! of model groups), and what it answers.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_core::Stream;
use futures_util::future::BoxFuture;
use pgw_client::{ChatAnswer, ChatCall, PassThrough};
use pgw_core::openai::{ChatChunk, ChatRequest, chunks_of};
use pgw_core::{
    BoxError, CallHistory, CarriesHistory, NotAdmitted, ProviderError, SourceId, UpstreamStatus,
    exceeds_source,
};
use tokio::time::Instant;
use tower::ServiceExt;
use tower_aimd::AimdHandle;
use tower_breaker_window::{BreakerHandle, BreakerState};
use tower_health_p2c::Sources;
use tower_ratelimit_redis::RateLimiter;
use tower_retry_pushback::{CallDeadline, Progress, Reason, RetryError};
use tower_service::Service;

use crate::attempt::{AdmissionCell, RefusedTime, TurnGroup};
use crate::cache::{CacheKey, CachePartition, CachedAnswer};
use crate::cached::{CacheFlow, Flight, Follow, Lookup, replay};
use crate::relay::ChatStream;
use crate::route::ModelChain;
use crate::source::SourceService;
use crate::telemetry::Telemetry;
use crate::validate::{JsonValidator, Validator};

/// What the gateway answers: the answer, and who gave it.
#[derive(Clone, Debug)]
pub struct GatewayAnswer {
    /// The call.
    pub call_id: u64,
    /// The answer (for a cache hit: as first received; `stats` describe that attempt).
    pub answer: ChatAnswer,
    /// The model group of the fallback chain that answered.
    pub group: String,
    /// The source that answered.
    pub source: Option<SourceId>,
    /// Whether the answer came from the cache.
    pub cache_hit: bool,
}

impl GatewayAnswer {
    /// The first choice's text.
    #[must_use]
    pub fn content(&self) -> &str {
        self.answer.content()
    }

    /// The answer as the chunks of a stream: the provider's chunks when it streamed
    /// (and the answer kept them: [`pgw_client::MAX_KEPT_CHUNKS`]), else one chunk per
    /// choice with the whole text, then a usage chunk.
    #[must_use]
    pub fn chunks(&self) -> Vec<ChatChunk> {
        if !self.answer.chunks.is_empty() {
            return self.answer.chunks.clone();
        }
        chunks_of(&self.answer.response)
    }

    /// A stream replaying [`GatewayAnswer::chunks`].
    pub fn into_stream(self) -> impl Stream<Item = Result<ChatChunk, BoxError>> + Send + 'static {
        futures_util::stream::iter(self.chunks().into_iter().map(Ok))
    }
}

/// The call failed in every group of the fallback chain.
#[derive(Debug)]
pub struct GatewayError {
    call_id: u64,
    failures: Vec<(String, BoxError)>,
    /// No route serves the call's model: no group was asked.
    no_route: bool,
}

impl GatewayError {
    /// The call.
    #[must_use]
    pub const fn call_id(&self) -> u64 {
        self.call_id
    }

    /// Each group tried, with its error, in order.
    #[must_use]
    pub fn failures(&self) -> &[(String, BoxError)] {
        &self.failures
    }

    /// Whether an attempt of the call may have reached a provider (and cost it, or a
    /// quota, something). `false` when no route serves the model, or when every group
    /// refused before its first attempt: its retry verdict lists no attempt (circuits
    /// open, quotas full, the call's deadline passed while it waited), or none that left
    /// the process ([`RetryError::reached_a_provider`]: out of file descriptors). A
    /// group's failure without a retry verdict counts as reached: nothing says it was not.
    ///
    /// The server gives such a call back to the tenant's quota: a client whose
    /// retries meet open circuits must not spend its own budget on them.
    #[must_use]
    pub fn reached_a_provider(&self) -> bool {
        !self.no_route
            && self.failures.iter().any(|(_, e)| {
                e.downcast_ref::<RetryError>()
                    .is_none_or(RetryError::reached_a_provider)
            })
    }

    /// The retry layer's verdict in the last group tried, if any.
    #[must_use]
    pub fn last_retry_error(&self) -> Option<&RetryError> {
        self.failures
            .last()
            .and_then(|(_, e)| e.downcast_ref::<RetryError>())
    }
}

impl fmt::Display for GatewayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "call {} failed", self.call_id)?;
        for (i, (g, e)) in self.failures.iter().enumerate() {
            write!(f, "{} group {g}: {e}", if i == 0 { ":" } else { ";" })?;
        }
        Ok(())
    }
}

impl std::error::Error for GatewayError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.failures
            .last()
            .map(|(_, e)| &**e as &(dyn std::error::Error + 'static))
    }
}

/// Observability handles of one route: a source serving one upstream model (without
/// `[models]`, each source is one route, named as the source).
#[derive(Clone)]
pub struct SourceHandles {
    /// The source.
    pub source: SourceId,
    /// The route: the key of its breaker, health and holds (`source/model` with
    /// `[models]`, else the source's name).
    pub route: SourceId,
    /// The model sent upstream (`None`: the caller's).
    pub model: Option<String>,
    /// Its group (with `[models]`: the first public model it serves).
    pub group: String,
    /// Its breaker.
    pub breaker: BreakerHandle,
    /// Its AIMD limit.
    pub aimd: AimdHandle,
    /// Its rate limiter (holds, stats).
    pub limiter: RateLimiter,
}

impl fmt::Debug for SourceHandles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SourceHandles")
            .field("source", &self.source)
            .field("route", &self.route)
            .field("model", &self.model)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

/// One model group of the fallback chain: its retry loop over its balancer.
pub(crate) struct Group {
    pub(crate) name: Arc<str>,
    pub(crate) service: SourceService,
    pub(crate) sources: Sources<SourceService>,
}

pub(crate) struct Inner {
    pub(crate) groups: Vec<Group>,
    /// Each public model's chains (empty without `[models]`).
    pub(crate) models: BTreeMap<String, ModelChain>,
    /// Every group in fallback order: the chain without `[models]`.
    pub(crate) all: ModelChain,
    pub(crate) cache: Option<CacheFlow>,
    pub(crate) telemetry: Telemetry,
    pub(crate) handles: Vec<SourceHandles>,
    pub(crate) progress: Progress,
    /// The default validator, also applied to cache hits (a hit stored by a call
    /// with a more lenient validator of its own must not bypass it).
    pub(crate) validator: Option<Validator>,
    /// The routes whose source accepts an assistant prefill (none: a cut stream is
    /// never continued).
    pub(crate) prefill_routes: Vec<SourceId>,
    /// `retry.max_call_duration_s`: the deadline of a call that brings none sooner, from
    /// its start, across the fallback chain, the cache and a committed stream.
    pub(crate) max_call_duration: Option<std::time::Duration>,
}

/// The call's [`CallDeadline`] is the gateway's default
/// ([`crate::DEFAULT_MAX_CALL_DURATION`]), neither configured nor the caller's own: it
/// bounds the call until its answer starts only.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DefaultDeadline;

/// The gateway: a tower `Service<ChatCall>` for OpenAI-compatible chat completions.
///
/// Per call: the cache (a hit returns at once, recorded with `cache_hit`); then each
/// model group of the fallback chain in turn, each a retry loop
/// (tower-retry-pushback) over a health-aware balancer (tower-health-p2c) over one
/// stack per source: AIMD (tower-aimd) -> breaker (tower-breaker-window) -> rate limit
/// (tower-ratelimit-redis) -> validator + telemetry -> client (pgw-client, watchdogs).
/// The next group is tried when a group fails for any reason but a rejected request
/// or the call's deadline.
///
/// Cheap to clone; always ready.
#[derive(Clone)]
pub struct Gateway {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for Gateway {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gateway")
            .field(
                "groups",
                &self.inner.groups.iter().map(|g| &*g.name).collect::<Vec<_>>(),
            )
            .field("sources", &self.inner.handles)
            .finish_non_exhaustive()
    }
}

impl Gateway {
    /// The handles of every source (breaker, AIMD, limiter).
    #[must_use]
    pub fn sources(&self) -> &[SourceHandles] {
        &self.inner.handles
    }

    /// The public model names callers may ask for (`[models]`), sorted; empty when the
    /// gateway forwards the caller's model as it is.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), pgw_core::BoxError> {
    /// let config = pgw_stack::GatewayConfig::from_toml_str(r#"
    ///     [[sources]]
    ///     name = "p"
    ///     base_url = "http://127.0.0.1:9/v1"
    ///     key = "sk-demo"
    ///     [models.gpt-4o]
    ///     routes = [{ source = "p" }]
    ///     [models.gpt-4o-mini]
    ///     routes = [{ source = "p" }]
    /// "#)?;
    /// let gateway = pgw_stack::Gateway::from_config(config).await?;
    /// assert_eq!(gateway.models(), ["gpt-4o", "gpt-4o-mini"]);
    /// # Ok(())
    /// # }
    /// ```
    #[must_use]
    pub fn models(&self) -> Vec<String> {
        self.inner.models.keys().cloned().collect()
    }

    /// Whether the response cache takes `call`: is read for it and stores its answer.
    /// Not without a cache, with `NoCache` in its extensions, or, under `cache.when =
    /// "deterministic"` (the default), when the request is not deterministic.
    #[must_use]
    pub fn caches(&self, call: &ChatCall) -> bool {
        self.inner.cache.as_ref().is_some_and(|c| c.applies(call))
    }

    /// The group names in fallback order (with `[models]`: the public model names).
    #[must_use]
    pub fn groups(&self) -> Vec<String> {
        self.inner.groups.iter().map(|g| g.name.to_string()).collect()
    }

    /// The health EWMA of route `source` (a source's name without `[models]`) for
    /// calls that are not streamed, if known.
    #[must_use]
    pub fn health(&self, source: &str) -> Option<f64> {
        self.inner
            .groups
            .iter()
            .find_map(|g| g.sources.view(source))
            .map(|v| v.health())
    }

    /// The health EWMA of route `source` for streamed calls (kept apart: a source's slow
    /// streams say nothing of its short answers), if known.
    #[must_use]
    pub fn stream_health(&self, source: &str) -> Option<f64> {
        self.inner
            .groups
            .iter()
            .find_map(|g| g.sources.view(source))
            .map(|v| v.health_of(call_shape_of(true)))
    }

    /// The process-wide progress signal of the stall guard (a waiting call fails as
    /// stalled only when nothing in the process succeeded within the stall window).
    #[must_use]
    pub fn progress(&self) -> &Progress {
        &self.inner.progress
    }

    /// One call, answered in full.
    ///
    /// # Errors
    /// A [`GatewayError`] listing each group's failure.
    pub async fn chat(&self, request: ChatRequest) -> Result<GatewayAnswer, BoxError> {
        self.clone().oneshot(ChatCall::new(request)).await
    }

    /// One call whose answer must parse as JSON into `T`: an answer that does not
    /// is `Invalid` and re-asked (up to `max_reasks` times, apart from the attempt
    /// budget).
    ///
    /// # Errors
    /// A [`GatewayError`]; the last group's reason is `ReasksExhausted` when no answer
    /// parsed.
    pub async fn chat_json<T>(&self, request: ChatRequest) -> Result<(T, GatewayAnswer), BoxError>
    where
        T: serde::de::DeserializeOwned + 'static,
    {
        let mut call = ChatCall::new(request);
        call.extensions_mut()
            .insert(Validator::new(JsonValidator::<T>::new()));
        let answer = self.clone().oneshot(call).await?;
        let value =
            JsonValidator::<T>::parse(&answer.answer.response).map_err(pgw_core::InvalidResponse::new)?;
        Ok((value, answer))
    }

    /// One call streamed to the caller, each chunk as it arrives (see [`ChatStream`]):
    /// the call is committed to the first source whose stream yields output, and
    /// every failure before that is retried invisibly. Sets `stream = true` upstream.
    ///
    /// A call with a validator (the gateway's default one) is buffered instead: its
    /// answer must be whole to be validated (and re-asked), so it is replayed once it
    /// passed.
    ///
    /// # Errors
    /// As [`Gateway::chat`], before the first chunk.
    pub async fn chat_stream(&self, mut request: ChatRequest) -> Result<ChatStream, BoxError> {
        request.stream = true;
        self.stream_call(ChatCall::new(request)).await
    }

    /// [`Gateway::chat_stream`] for a call built by the caller (its id, its
    /// extensions: a per-call [`Validator`] makes it buffered). The request should say
    /// `stream = true`; one that does not is answered whole, as one chunk per choice.
    ///
    /// # Errors
    /// As [`Gateway::chat`], before the first chunk.
    pub async fn stream_call(&self, mut call: ChatCall) -> Result<ChatStream, BoxError> {
        let include_usage = call
            .request()
            .extra
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        if self.inner.validator.is_some() || call.extensions().get::<Validator>().is_some() {
            let answer = self.clone().oneshot(call).await?;
            return Ok(ChatStream::replay(&answer, include_usage));
        }
        // Shared with the stream, so a continuation knows which source was cut.
        if call.call_history().is_none() {
            call.set_call_history(CallHistory::new());
        }
        call.extensions_mut().insert(PassThrough);
        // The deadline on the relay's copy too: it bounds the stream once committed,
        // and a continuation keeps it (a fresh one per continuation would extend it).
        self.inner.apply_max_call_duration(&mut call);
        let answer = self.clone().oneshot(call.clone()).await?;
        Ok(ChatStream::relay(self.clone(), call, answer, include_usage))
    }

    /// Reads every source's breaker, AIMD limit, health, inflight and limiter usage
    /// and sets the `metrics` gauges: `pgw_breaker_state` (0 closed, 1 half-open,
    /// 2 open), `pgw_aimd_limit`, `pgw_inflight`, `pgw_health`, `pgw_quota_admitted`,
    /// each labelled `source` with the route (the source's name without `[models]`,
    /// `source/model` with it), but `pgw_quota_admitted`, the source's own limiter
    /// (shared by its routes), labelled with the source's name. Call it periodically
    /// (one backend read per route).
    ///
    /// The breakers' views are read concurrently: on the Redis backend each is a round
    /// trip bounded by the backend's response timeout, so a refresh while Redis is
    /// unreachable takes one timeout, not one per route (20 routes took 10 s, past
    /// Prometheus's scrape timeout). A view that fails leaves its gauge as it was.
    pub async fn refresh_metrics(&self) {
        let views = futures_util::future::join_all(self.inner.handles.iter().map(|h| h.breaker.view())).await;
        let mut quotas = std::collections::HashSet::new();
        for (h, view) in self.inner.handles.iter().zip(views) {
            // One series per route (with `[models]`, a source has one per model).
            let source = h.route.to_string();
            if let Ok(view) = view {
                let state = match view.state {
                    BreakerState::Closed => 0.0,
                    BreakerState::HalfOpen => 1.0,
                    _ => 2.0,
                };
                metrics::gauge!("pgw_breaker_state", "source" => source.clone()).set(state);
            }
            metrics::gauge!("pgw_aimd_limit", "source" => source.clone()).set(h.aimd.limit());
            #[allow(clippy::cast_precision_loss)]
            metrics::gauge!("pgw_inflight", "source" => source.clone()).set(h.aimd.inflight() as f64);
            if let Some(health) = self.health(&source) {
                metrics::gauge!("pgw_health", "source" => source.clone()).set(health);
            }
            // Once per source: a series per route would count the source's admissions
            // once per model.
            if quotas.insert(h.source.as_str()) {
                #[allow(clippy::cast_precision_loss)]
                metrics::gauge!("pgw_quota_admitted", "source" => h.source.to_string())
                    .set(h.limiter.stats().admitted as f64);
            }
        }
    }
}

impl Service<ChatCall> for Gateway {
    type Response = GatewayAnswer;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<GatewayAnswer, BoxError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut call: ChatCall) -> Self::Future {
        let inner = Arc::clone(&self.inner);
        Box::pin(async move {
            let call_id = call.id().0;
            inner.apply_max_call_duration(&mut call);
            let Some(route) = inner.chain_of(&call.request().model) else {
                return Err(unknown_model(call_id, &call.request().model));
            };
            let allowed = call.extensions().get::<AllowedModels>().cloned();
            // With `[models]`, a call may use the models of its list only: the one it
            // names first (as if it did not exist, as OpenAI answers a key without it).
            let allowed = allowed.filter(|_| !inner.models.is_empty());
            if allowed
                .as_ref()
                .is_some_and(|a| !a.permits(&call.request().model))
            {
                return Err(unknown_model(call_id, &call.request().model));
            }
            let mut cached = None;
            if let Some(cache) = inner.cache.as_ref().filter(|c| c.applies(&call)) {
                let partition = call.extensions().get::<CachePartition>().map(|p| &*p.0);
                let key = CacheKey::in_partition(call.request(), &route.route_key, partition);
                let validator = call.extensions().get::<Validator>().or(inner.validator.as_ref());
                // A stored answer of a model the call may not use (a fallback's, stored
                // for a caller allowed it, with the cache shared across keys) is not one.
                let usable = |hit: &CachedAnswer| {
                    allowed.as_ref().is_none_or(|a| a.permits(&hit.group))
                        && validator
                            .is_none_or(|v| hit.response.is_declined() || v.0.validate(&hit.response).is_ok())
                };
                let follow = Follow {
                    progress: &inner.progress,
                    until: call.extensions().get::<CallDeadline>().map(|d| d.0),
                    streamed: call.extensions().get::<PassThrough>().is_some(),
                };
                match cache.lookup(key, follow, usable).await {
                    Lookup::Hit(hit) => return Ok(replay(&inner.telemetry, call_id, &hit)),
                    Lookup::Miss(flight) => {
                        metrics::counter!("pgw_cache_misses_total").increment(1);
                        cached = Some((cache, key, flight));
                    }
                }
            }
            call.extensions_mut().insert(AdmissionCell::default());
            call.extensions_mut().insert(RefusedTime::default());
            let permitted = |g: usize| allowed.as_ref().is_none_or(|a| a.permits(&inner.groups[g].name));
            // R3: with another group to go to, a call does not wait in one for a
            // quota, a hold or a slot: every group is asked at once (the first pass),
            // and the groups that refused it so are asked again, waiting (the second
            // pass), only when none took it: the soonest to admit first, the chain's
            // order within a second.
            // The flag that says so lives in the call's history, made for it only when
            // a chain has another group to go to.
            let several = |chain: &[usize]| chain.iter().filter(|&&g| permitted(g)).nth(1).is_some();
            let history = (several(&route.chain) || several(&route.context)).then(|| {
                call.call_history().cloned().unwrap_or_else(|| {
                    let h = CallHistory::new();
                    call.set_call_history(h.clone());
                    h
                })
            });
            let _may_wait = history.clone().map(MayWaitAgain);
            let mut turns = Turns::new(&route.chain);
            // The first pass: the chain, and the context chain when the request does
            // not fit.
            while let Some(turn) = turns.next_of_chain() {
                if !permitted(turn.g) {
                    // A fallback (or context-window fallback) to a model the caller
                    // may not use: not taken.
                    continue;
                }
                if let Some(h) = &history {
                    if turns.asked.contains(&turn.g) {
                        // In the chain and the context chain both: asked once a pass.
                        continue;
                    }
                    turns.asked.push(turn.g);
                    // Waits only with nowhere else to go: no other group in its chain,
                    // and none left for the second pass.
                    h.set_may_wait(turns.deferred.is_empty() && !several(turns.chain));
                }
                let (verdict, failure) = match inner.take_turn(call_id, turn, &call, &mut cached).await {
                    Ok(answer) => return Ok(answer),
                    Err(failed) => failed,
                };
                turns.failures.push(failure);
                if let Verdict::NotHere(after) = verdict {
                    turns.defer(turn, after);
                } else if verdict.too_large() && !turn.context && !route.context.is_empty() {
                    turns.enter_context(&route.context, turn.primary);
                } else if verdict.too_large() && turn.context
                    || verdict == Verdict::NeverHere
                    || matches!(verdict, Verdict::Rejected | Verdict::TooLarge)
                        && (!turns.deferred.is_empty() || turn.context || !turn.primary)
                {
                    // The next group of the context chain (of the chain); or a request
                    // error from this group, with groups left for later that never saw
                    // the request, or from a fallback or a context model (as in the
                    // second pass: its model's own limits, `max_tokens` past its
                    // maximum, say): this group's verdict, not the call's.
                } else if matches!(verdict, Verdict::Rejected | Verdict::TooLarge | Verdict::Ends) {
                    turns.deferred.clear();
                    break;
                }
            }
            // The second pass: the groups that refused the call for now, waiting.
            turns.start_waiting();
            turns.asked.clear();
            while let Some(turn) = turns.waiting.pop_front() {
                if let Some(h) = &history {
                    h.set_may_wait(true);
                }
                let (verdict, failure) = match inner.take_turn(call_id, turn, &call, &mut cached).await {
                    Ok(answer) => return Ok(answer),
                    Err(failed) => failed,
                };
                turns.asked.push(turn.g);
                turns.failures.push(failure);
                if verdict.too_large() && !turn.context && !route.context.is_empty() {
                    turns.wait_on_context(&permitted, &route.context, turn.primary);
                } else if matches!(verdict, Verdict::Rejected | Verdict::TooLarge)
                    && (turn.context || !turn.primary)
                {
                    // A fallback's (or a context model's) request error: the groups
                    // after it may take it.
                } else if matches!(verdict, Verdict::Rejected | Verdict::TooLarge | Verdict::Ends) {
                    // The primary's own request error (too large for it with no
                    // context chain, as in the first pass), or the deadline.
                    break;
                }
            }
            let failures = turns.failures;
            Err(GatewayError {
                call_id,
                failures,
                no_route: false,
            }
            .into())
        })
    }
}
/// What a group's failure says of the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// Refused for now where it may not wait (`Reason::NotAdmittedHere`): when the
    /// group said it may admit, if it said.
    NotHere(Option<Duration>),
    /// Too large for the group's model (its context window).
    TooLarge,
    /// Every source of the group refused it for good without an attempt (larger
    /// than a whole window's token quota, or a continuation none of them can
    /// prefill): the group's limits, not the request's fault.
    NeverHere,
    /// A request error.
    Rejected,
    /// The call ends here: its deadline passed, or the process ran out of what it
    /// needs for a connection (`Reason::LocalExhaustion`; every group would fail
    /// alike).
    Ends,
    /// Anything else: the next group may do better.
    Failed,
}

impl Verdict {
    fn of(e: &BoxError) -> Self {
        let verdict = e.downcast_ref::<RetryError>();
        let last = verdict.and_then(RetryError::last_error);
        match verdict.map(RetryError::reason) {
            Some(Reason::NotAdmittedHere { retry_after }) => Self::NotHere(retry_after),
            Some(Reason::Rejected) if last.is_some_and(|l| exceeds_source(l)) => Self::TooLarge,
            Some(Reason::Rejected) if last.and_then(|l| NotAdmitted::of(l)) == Some(NotAdmitted::Never) => {
                Self::NeverHere
            }
            Some(Reason::Rejected) => Self::Rejected,
            Some(Reason::DeadlineExceeded | Reason::LocalExhaustion) => Self::Ends,
            _ => Self::Failed,
        }
    }

    fn too_large(self) -> bool {
        self == Self::TooLarge
    }
}

/// One group's turn at a call.
#[derive(Clone, Copy, Debug)]
struct Turn {
    g: usize,
    /// The group stands as the call's primary (for the cache's time to live): the
    /// chain's first, or a context chain's group reached from it.
    primary: bool,
    /// The group is of the context-window chain.
    context: bool,
}

/// The groups a call is sent to, in turn, and what they answered.
struct Turns<'a> {
    /// The chain of the first pass: the model's, then the context-window chain's
    /// when the request does not fit.
    chain: &'a [usize],
    next: usize,
    /// In the context-window chain, reached from a primary (or not).
    context: Option<bool>,
    /// The groups that refused the call for now in the first pass, and when each
    /// said it may admit.
    deferred: Vec<(Turn, Instant)>,
    /// The second pass's groups, in order.
    waiting: VecDeque<Turn>,
    /// The groups asked in the pass under way (kept for calls with several groups:
    /// a single group cannot come twice).
    asked: Vec<usize>,
    /// Every group's failure, in the order they came: the last is the call's last
    /// word (what a server answers).
    failures: Vec<(String, BoxError)>,
}

impl<'a> Turns<'a> {
    fn new(chain: &'a [usize]) -> Self {
        Self {
            chain,
            next: 0,
            context: None,
            deferred: Vec::new(),
            waiting: VecDeque::new(),
            asked: Vec::new(),
            failures: Vec::new(),
        }
    }

    /// The first pass's next turn.
    fn next_of_chain(&mut self) -> Option<Turn> {
        let g = *self.chain.get(self.next)?;
        self.next += 1;
        Some(match self.context {
            Some(primary) => Turn {
                g,
                primary,
                context: true,
            },
            None => Turn {
                g,
                primary: self.next == 1,
                context: false,
            },
        })
    }

    /// The first pass goes on with the context-window chain, from its start.
    fn enter_context(&mut self, context: &'a [usize], primary: bool) {
        self.chain = context;
        self.next = 0;
        self.context = Some(primary);
    }

    fn defer(&mut self, turn: Turn, after: Option<Duration>) {
        let at = pgw_core::clock::saturating_after(Instant::now(), after.unwrap_or_default());
        self.deferred.push((turn, at));
    }

    /// The second pass: the deferred groups, the soonest to admit first (by the whole
    /// second: the chain's order within one).
    fn start_waiting(&mut self) {
        let start = Instant::now();
        let mut deferred = std::mem::take(&mut self.deferred);
        deferred.sort_by_key(|&(_, at)| at.saturating_duration_since(start).as_secs());
        self.waiting = deferred.into_iter().map(|(turn, _)| turn).collect();
    }

    /// The request does not fit a main group asked in the second pass: the context
    /// chain's groups not yet asked go first, waiting too, before the rest.
    fn wait_on_context(&mut self, permitted: &impl Fn(usize) -> bool, context: &[usize], primary: bool) {
        if primary {
            // Reached from the primary now: a context group already waiting (deferred
            // after a fallback's turn) answers as the primary's, for the cache.
            for turn in self.waiting.iter_mut().filter(|t| t.context) {
                turn.primary = true;
            }
        }
        let fresh: Vec<Turn> = context
            .iter()
            .copied()
            .filter(|&g| {
                permitted(g)
                    && !self.asked.contains(&g)
                    && !self.waiting.iter().any(|t| t.g == g)
                    && !self.chain.contains(&g)
            })
            .map(|g| Turn {
                g,
                primary,
                context: true,
            })
            .collect();
        for turn in fresh.into_iter().rev() {
            self.waiting.push_front(turn);
        }
    }
}

/// Gives the call's history back its "may wait" when the gateway is done with the
/// call, whichever way (an answer, an error, the caller dropping it).
struct MayWaitAgain(CallHistory);

impl Drop for MayWaitAgain {
    fn drop(&mut self) {
        self.0.set_may_wait(true);
    }
}

impl Inner {
    /// One group's turn at `call`: its answer, the call's; or its failure, with what
    /// that says of the call.
    async fn take_turn(
        &self,
        call_id: u64,
        turn: Turn,
        call: &ChatCall,
        cached: &mut Option<(&CacheFlow, CacheKey, Option<Flight>)>,
    ) -> Result<GatewayAnswer, (Verdict, (String, BoxError))> {
        let group = &self.groups[turn.g];
        let mut call = call.clone();
        call.extensions_mut().insert(TurnGroup(Arc::clone(&group.name)));
        match group.service.clone().oneshot(call).await {
            Ok(answer) => Ok(self.answered(call_id, turn.g, turn.primary, answer, cached).await),
            Err(e) => {
                tracing::debug!(call = call_id, group = %group.name, error = %e, "group failed");
                Err((Verdict::of(&e), (group.name.to_string(), e)))
            }
        }
    }

    /// `answer` from group `g` as the call's: stored in the cache when the call has a
    /// place there (a primary's answer for the primary's time to live).
    async fn answered(
        &self,
        call_id: u64,
        g: usize,
        primary: bool,
        answer: ChatAnswer,
        cached: &mut Option<(&CacheFlow, CacheKey, Option<Flight>)>,
    ) -> GatewayAnswer {
        self.progress.record_success();
        let group = &self.groups[g];
        let source = answer.stats.source.clone();
        if let Some((cache, key, flight)) = cached.take() {
            let ttl = cache.ttl_for(primary);
            cache
                .store(key, &answer, group.name.to_string(), ttl, flight)
                .await;
        }
        GatewayAnswer {
            call_id,
            answer,
            group: group.name.to_string(),
            source,
            cache_hit: false,
        }
    }

    /// Sets `retry.max_call_duration` from now as `call`'s deadline: one for the whole
    /// call (every group, the cache's wait, the stream), not a fresh one per group; a
    /// sooner one of the call's own stands.
    ///
    /// Without either, the call gets [`crate::DEFAULT_MAX_CALL_DURATION`] from now,
    /// marked [`DefaultDeadline`]: it bounds the call until its answer starts, not a
    /// committed stream, and a continuation gets a fresh one.
    fn apply_max_call_duration(&self, call: &mut ChatCall) {
        let now = tokio::time::Instant::now();
        let own = call.extensions().get::<CallDeadline>().map(|d| d.0);
        match self.max_call_duration {
            Some(d) => {
                if let Some(at) = now.checked_add(d) {
                    call.extensions_mut()
                        .insert(CallDeadline(own.map_or(at, |o| o.min(at))));
                }
            }
            None if own.is_none() => {
                if let Some(at) = now.checked_add(crate::DEFAULT_MAX_CALL_DURATION) {
                    call.extensions_mut().insert(CallDeadline(at));
                    call.extensions_mut().insert(DefaultDeadline);
                }
            }
            None => {}
        }
    }

    /// The chains of a call asking for `model`: without `[models]`, every group in
    /// fallback order; `None` for a model that is not configured.
    fn chain_of(&self, model: &str) -> Option<&ModelChain> {
        if self.models.is_empty() {
            return Some(&self.all);
        }
        self.models.get(model)
    }
}

/// The public models (the `[models]` names) a call may be answered by: a call that
/// carries it goes down its model's fallback and context-window fallback chains only
/// to models in the list. A server puts it on the calls of an API key limited to
/// some models, so a key allowed `small` is not answered by `large` when `small`
/// falls back to it. Without `[models]` the gateway does not route by model and the
/// list is not consulted.
///
/// ```
/// use std::sync::Arc;
/// use pgw_stack::{AllowedModels, ChatCall};
/// use pgw_stack::core::openai::ChatRequest;
///
/// let mut call = ChatCall::new(ChatRequest::user("small", "hello"));
/// let allowed = AllowedModels(Arc::from(vec!["small".to_owned()]));
/// assert!(allowed.permits("small") && !allowed.permits("large"));
/// call.extensions_mut().insert(allowed);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllowedModels(pub Arc<[String]>);

impl AllowedModels {
    /// Whether `model` is in the list.
    #[must_use]
    pub fn permits(&self, model: &str) -> bool {
        self.0.iter().any(|m| m == model)
    }
}

/// A call for a model no route serves: rejected before any source is asked, as
/// OpenAI answers it (404 `model_not_found`, `param: model`).
fn unknown_model(call_id: u64, model: &str) -> BoxError {
    let message = format!("The model `{model}` does not exist or you do not have access to it.");
    let status = UpstreamStatus::new(http::StatusCode::NOT_FOUND, None, message.clone()).with_provider(
        ProviderError {
            message,
            kind: Some("invalid_request_error".into()),
            code: Some("model_not_found".into()),
            param: Some("model".into()),
        },
    );
    GatewayError {
        call_id,
        failures: vec![(model.to_owned(), Box::new(status))],
        no_route: true,
    }
    .into()
}

/// What the balancer knows of a call: its health class and its size.
///
/// The class: streamed calls (1) apart from the rest (0). A source's slow stream, cut
/// by the inter-token watchdog, says nothing about its short answers, and the reverse:
/// P6's `s5` answers short calls and fails 90% of its streams. One health EWMA per
/// source would average the two and keep sending streams there.
///
/// The size: the call's token estimate (prompt and completion budget, as the rate
/// limiter reserves), so that a source that answered `context_length_exceeded` for a
/// prompt is not offered prompts as large first (`tower_health_p2c::OVERSIZE_MEMORY`).
/// Without it, the soak's mixed-8-sources pool sent about a hundred 75k-token prompts
/// per run to the source with a 16k window, each a refusal costing that source's
/// quota and the call's time.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallShape;

impl tower_health_p2c::ClassOf<ChatCall> for CallShape {
    fn class_of(&self, call: &ChatCall) -> usize {
        call_shape_of(call.is_stream())
    }

    fn size_of(&self, call: &ChatCall) -> Option<u64> {
        Some(call.estimate_tokens())
    }
}

const fn call_shape_of(streamed: bool) -> usize {
    streamed as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgw_core::openai::{ChatMessage, ChatResponse, Choice, ChunkAccumulator, Usage};

    #[test]
    fn a_plain_answer_replays_as_equivalent_chunks() {
        let r = ChatResponse {
            id: "x".into(),
            model: "m".into(),
            choices: vec![Choice::new(
                0,
                ChatMessage::new("assistant", "hello there"),
                Some("stop".into()),
            )],
            usage: Some(Usage::new(1, 2, 3)),
            ..ChatResponse::default()
        };
        let chunks = chunks_of(&r);
        assert_eq!(chunks.len(), 2);
        let mut acc = ChunkAccumulator::default();
        for c in &chunks {
            acc.push(c);
        }
        let back = acc.finish();
        assert_eq!(back.content(), "hello there");
        assert_eq!(back.usage, r.usage);
        assert_eq!(back.choices[0].finish_reason.as_deref(), Some("stop"));
    }
}
