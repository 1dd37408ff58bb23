//! [`Gateway`] and [`GatewayBuilder`]: the composition of DESIGN.md section 3.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_core::Stream;
use futures_util::future::BoxFuture;
use pgw_client::{
    AnswerClassifier, BoxTransport, ChatAnswer, ChatCall, HyperTransport, PassThrough, UpstreamClient,
    box_transport,
};
use pgw_core::openai::{ChatChunk, ChatRequest, chunks_of};
use pgw_core::redis_conn::{RedisConn, RedisTarget};
use pgw_core::{BoxError, CallHistory, CarriesHistory, SourceId};
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;
use tower_aimd::{Aimd, AimdConfig, AimdHandle, AimdLayer};
use tower_breaker_window::{Breaker, BreakerConfig, BreakerHandle, BreakerLayer, BreakerState, Gate};
use tower_health_p2c::{BalanceConfig, HealthP2c, Policy, Sources};
use tower_layer::Layer;
use tower_ratelimit_redis::{Admission, Holds, Quota, RateLimitConfig, RateLimitLayer, RateLimiter};
use tower_retry_pushback::{Progress, Reason, RetryConfig, RetryError, RetryLayer};
use tower_service::Service;

use crate::attempt::{AdmissionCell, AnswerUsage, Attempt, StreamCuts};
use crate::cache::{CacheKey, CachedAnswer, MemoryCache, RedisCache, ResponseCache};
use crate::config::{
    BackendKind, ConfigError, DEFAULT_CACHE_MAX_ENTRIES, DEFAULT_CACHE_TTL_S, DEFAULT_COOLDOWN_S,
    DEFAULT_FAIL_THRESHOLD, DEFAULT_KEY_PREFIX, GatewayConfig, SourceConfig, quota, secs,
};
use crate::relay::ChatStream;
use crate::telemetry::{AttemptTelemetry, JsonlSink, PriceTable, Telemetry, TelemetrySink, TracingSink};
use crate::validate::{JsonValidator, Validate, Validator};

/// One source's stack as the balancer holds it: AIMD -> breaker -> rate limit ->
/// attempt (validator, telemetry) -> client.
pub type SourceService = BoxCloneSyncService<ChatCall, ChatAnswer, BoxError>;

/// Builds the transport of a source (a custom one: the simulator, a proxy, a mock).
pub type TransportFactory = dyn Fn(&SourceConfig) -> Result<BoxTransport, BoxError> + Send + Sync;

/// What the gateway answers: the answer, and who gave it.
#[derive(Clone, Debug)]
pub struct GatewayAnswer {
    /// The call.
    pub call_id: u64,
    /// The answer (for a cache hit: as first received; `stats` describe that attempt).
    pub answer: ChatAnswer,
    /// The model group that answered (S5).
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

    /// The answer as the chunks of a stream: the provider's chunks when it streamed,
    /// else one chunk per choice with the whole text, then a usage chunk.
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

/// Observability handles of one source.
#[derive(Clone)]
pub struct SourceHandles {
    /// The source.
    pub source: SourceId,
    /// Its group.
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
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

struct Group {
    name: Arc<str>,
    service: SourceService,
    sources: Sources<SourceService>,
}

pub(crate) struct Inner {
    groups: Vec<Group>,
    cache: Option<Arc<dyn ResponseCache>>,
    cache_ttl: Duration,
    telemetry: Telemetry,
    handles: Vec<SourceHandles>,
    progress: Progress,
    /// The default validator, also applied to cache hits (a hit stored by a call
    /// with a more lenient validator of its own must not bypass it).
    validator: Option<Validator>,
    /// Some source accepts an assistant prefill: a cut stream may be continued.
    pub(crate) accepts_prefill: bool,
}

/// The gateway: a tower `Service<ChatCall>` for OpenAI-compatible chat completions.
///
/// Per call: the cache (a hit returns at once, recorded with `cache_hit`); then each
/// model group of the fallback chain in turn (S5), each a retry loop
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
    /// A builder on `config`.
    #[must_use]
    pub fn builder(config: GatewayConfig) -> GatewayBuilder {
        GatewayBuilder::new(config)
    }

    /// Builds a gateway from configuration, with real HTTP transports.
    ///
    /// # Errors
    /// As [`GatewayBuilder::build`].
    pub async fn from_config(config: GatewayConfig) -> Result<Self, BoxError> {
        GatewayBuilder::new(config).build().await
    }

    /// The handles of every source (breaker, AIMD, limiter).
    #[must_use]
    pub fn sources(&self) -> &[SourceHandles] {
        &self.inner.handles
    }

    /// The group names in fallback order.
    #[must_use]
    pub fn groups(&self) -> Vec<String> {
        self.inner.groups.iter().map(|g| g.name.to_string()).collect()
    }

    /// The health EWMA of `source` for calls that are not streamed, if known.
    #[must_use]
    pub fn health(&self, source: &str) -> Option<f64> {
        self.inner
            .groups
            .iter()
            .find_map(|g| g.sources.view(source))
            .map(|v| v.health())
    }

    /// The health EWMA of `source` for streamed calls (kept apart: a source's slow
    /// streams say nothing of its short answers), if known.
    #[must_use]
    pub fn stream_health(&self, source: &str) -> Option<f64> {
        self.inner
            .groups
            .iter()
            .find_map(|g| g.sources.view(source))
            .map(|v| v.health_of(call_shape_of(true)))
    }

    /// The process-wide progress signal of the stall guard (R4).
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

    /// One call whose answer must parse as JSON into `T` (S7): an answer that does not
    /// is `Invalid` and re-asked (R2).
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
        let answer = self.clone().oneshot(call.clone()).await?;
        Ok(ChatStream::relay(self.clone(), call, answer, include_usage))
    }

    /// Reads every source's breaker, AIMD limit, health, inflight and limiter usage
    /// and sets the `metrics` gauges: `pgw_breaker_state` (0 closed, 1 half-open,
    /// 2 open), `pgw_aimd_limit`, `pgw_inflight`, `pgw_health`, `pgw_quota_admitted`,
    /// each labelled `source`. Call it periodically (one backend read per source).
    pub async fn refresh_metrics(&self) {
        for h in &self.inner.handles {
            let source = h.source.to_string();
            if let Ok(view) = h.breaker.view().await {
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
            #[allow(clippy::cast_precision_loss)]
            metrics::gauge!("pgw_quota_admitted", "source" => source).set(h.limiter.stats().admitted as f64);
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
            let key = inner.cache.as_ref().map(|_| CacheKey::of(call.request()));
            if let (Some(cache), Some(key)) = (&inner.cache, key)
                && let Some(hit) = cache.get(key).await
            {
                let validator = call.extensions().get::<Validator>().or(inner.validator.as_ref());
                if validator.is_none_or(|v| hit.response.is_declined() || v.0.validate(&hit.response).is_ok())
                {
                    metrics::counter!("pgw_cache_hits_total").increment(1);
                    inner.telemetry.emit(&AttemptTelemetry {
                        call_id,
                        attempt: 0,
                        group: hit.group.clone(),
                        source: hit.source.clone(),
                        admitted_at_s: None,
                        admission_window: None,
                        latency_ms: 0.0,
                        ttft_ms: None,
                        prompt_tokens: None,
                        completion_tokens: None,
                        cost_usd: Some(0.0),
                        outcome: "success",
                        error: None,
                        cache_hit: true,
                    });
                    return Ok(GatewayAnswer {
                        call_id,
                        answer: ChatAnswer {
                            response: hit.response.clone(),
                            chunks: hit.chunks.clone(),
                            stats: pgw_client::AttemptStats {
                                source: hit.source.clone(),
                                ..pgw_client::AttemptStats::default()
                            },
                            tail: None,
                        },
                        group: hit.group.clone(),
                        source: hit.source.clone(),
                        cache_hit: true,
                    });
                }
            }
            if key.is_some() {
                metrics::counter!("pgw_cache_misses_total").increment(1);
            }
            call.extensions_mut().insert(AdmissionCell::default());
            let mut failures = Vec::new();
            for group in &inner.groups {
                let result = group.service.clone().oneshot(call.clone()).await;
                match result {
                    Ok(answer) => {
                        inner.progress.record_success();
                        let source = answer.stats.source.clone();
                        if let (Some(cache), Some(key)) = (&inner.cache, key) {
                            let (group, source, ttl) =
                                (group.name.to_string(), source.clone(), inner.cache_ttl);
                            match &answer.tail {
                                // Only a whole answer is cached: a stream passed
                                // through, when it ends complete.
                                Some(tail) => {
                                    let cache = Arc::clone(cache);
                                    tail.on_end(Box::new(move |end| {
                                        if let Ok(done) = end {
                                            let cached = Arc::new(CachedAnswer {
                                                response: done.response.clone(),
                                                chunks: Vec::new(),
                                                group,
                                                source,
                                            });
                                            tokio::spawn(async move { cache.put(key, cached, ttl).await });
                                        }
                                    }));
                                }
                                None => {
                                    let cached = Arc::new(CachedAnswer {
                                        response: answer.response.clone(),
                                        chunks: answer.chunks.clone(),
                                        group,
                                        source,
                                    });
                                    cache.put(key, cached, ttl).await;
                                }
                            }
                        }
                        return Ok(GatewayAnswer {
                            call_id,
                            answer,
                            group: group.name.to_string(),
                            source,
                            cache_hit: false,
                        });
                    }
                    Err(e) => {
                        let stop = e.downcast_ref::<RetryError>().is_some_and(|r| {
                            matches!(r.reason(), Reason::Rejected | Reason::DeadlineExceeded)
                        });
                        tracing::debug!(call = call_id, group = %group.name, error = %e, "group failed");
                        failures.push((group.name.to_string(), e));
                        if stop {
                            break;
                        }
                    }
                }
            }
            Err(GatewayError { call_id, failures }.into())
        })
    }
}

/// Builds a [`Gateway`] from a [`GatewayConfig`], with optional custom transports,
/// telemetry sinks and a default validator.
pub struct GatewayBuilder {
    config: GatewayConfig,
    transport: Option<Arc<TransportFactory>>,
    sinks: Vec<Arc<dyn TelemetrySink>>,
    validator: Option<Validator>,
}

impl fmt::Debug for GatewayBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GatewayBuilder")
            .field("config", &self.config)
            .field("custom_transport", &self.transport.is_some())
            .field("sinks", &self.sinks.len())
            .finish_non_exhaustive()
    }
}

impl GatewayBuilder {
    /// A builder on `config`.
    #[must_use]
    pub fn new(config: GatewayConfig) -> Self {
        Self {
            config,
            transport: None,
            sinks: Vec::new(),
            validator: None,
        }
    }

    /// Adds a source.
    #[must_use]
    pub fn source(mut self, source: SourceConfig) -> Self {
        self.config.sources.push(source);
        self
    }

    /// Builds each source's transport with `factory` instead of a [`HyperTransport`]
    /// (e.g. `pgw_sim::SimService` under tokio's paused clock).
    #[must_use]
    pub fn transport<F>(mut self, factory: F) -> Self
    where
        F: Fn(&SourceConfig) -> Result<BoxTransport, BoxError> + Send + Sync + 'static,
    {
        self.transport = Some(Arc::new(factory));
        self
    }

    /// Adds a telemetry sink (besides those the config names).
    #[must_use]
    pub fn sink(mut self, sink: Arc<dyn TelemetrySink>) -> Self {
        self.sinks.push(sink);
        self
    }

    /// Validates every answer with `v` unless the call carries its own [`Validator`].
    #[must_use]
    pub fn validator(mut self, v: impl Validate + 'static) -> Self {
        self.validator = Some(Validator::new(v));
        self
    }

    /// Validates the configuration, connects the backend and composes the stack.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field (an unreachable Redis names `redis_url`
    /// and the address); a layer's configuration error.
    pub async fn build(self) -> Result<Gateway, BoxError> {
        let cfg = self.config;
        cfg.validate()?;
        let prefix = cfg
            .key_prefix
            .clone()
            .unwrap_or_else(|| DEFAULT_KEY_PREFIX.to_owned());

        let mut sinks = self.sinks;
        if let Some(path) = &cfg.telemetry.jsonl_path {
            let sink = JsonlSink::open(path).map_err(|e| {
                crate::config::config_error("telemetry.jsonl_path", format!("cannot open {path}: {e}"))
            })?;
            sinks.push(Arc::new(sink));
        }
        if cfg.telemetry.tracing {
            sinks.push(Arc::new(TracingSink));
        }
        let telemetry = Telemetry {
            sinks: Arc::new(sinks),
            prices: Arc::new(PriceTable::new(cfg.prices.clone())),
        };

        let redis = match cfg.backend {
            BackendKind::Memory => None,
            BackendKind::Redis => {
                let url = cfg.redis_url.as_deref().unwrap_or_default();
                let target = RedisTarget::parse(url).map_err(|e| {
                    crate::config::config_error("redis_url", crate::config::redact_in(&e, url))
                })?;
                let conn = RedisConn::connect(&target).await.map_err(|e| {
                    let e = crate::config::redact_in(&e.to_string(), url);
                    crate::config::config_error("redis_url", format!("cannot connect to {target}: {e}"))
                })?;
                Some(conn)
            }
        };

        let cache: Option<Arc<dyn ResponseCache>> = match (&redis, cfg.cache.enabled) {
            (_, false) => None,
            (Some(conn), true) => Some(Arc::new(RedisCache::new(conn.clone(), prefix.clone()))),
            (None, true) => Some(Arc::new(MemoryCache::new(
                cfg.cache.max_entries.unwrap_or(DEFAULT_CACHE_MAX_ENTRIES),
            ))),
        };
        let cache_ttl = secs("cache.ttl_s", cfg.cache.ttl_s)?
            .unwrap_or_else(|| Duration::from_secs_f64(DEFAULT_CACHE_TTL_S));

        let rl_backend: tower_ratelimit_redis::Backend = match &redis {
            Some(conn) => tower_ratelimit_redis::RedisBackend::new(conn.clone()).into(),
            None => tower_ratelimit_redis::MemoryBackend::new().into(),
        };
        let breaker_memory = tower_breaker_window::MemoryBackend::new();
        let breaker_redis = redis
            .as_ref()
            .map(|c| tower_breaker_window::RedisBackend::new(c.clone()).with_prefix(format!("{prefix}:brk")));

        let retry_cfg = retry_config(&cfg)?;
        let balance_cfg = balance_config(&cfg)?;
        let progress = Progress::new();
        let factory = self.transport;

        let mut groups = Vec::new();
        let mut handles = Vec::new();
        for group_name in cfg.group_order() {
            let name: Arc<str> = Arc::from(group_name.as_str());
            let sources: Sources<SourceService> = Sources::new();
            let mut limiters = Vec::new();
            for (i, sc) in cfg.sources.iter().enumerate() {
                if sc.group_name() != group_name {
                    continue;
                }
                let at = format!("sources[{i}]");
                let settings = sc.settings(&at)?;
                let transport = match &factory {
                    Some(f) => f(sc)?,
                    None => box_transport(HyperTransport::new(settings.timeouts.connect)?),
                };
                let id = settings.id.clone();
                let model = settings.model.as_deref().map(Arc::from);
                let client = UpstreamClient::new(settings, transport)?;
                let attempt = Attempt {
                    inner: client,
                    source: id.clone(),
                    group: Arc::clone(&name),
                    model,
                    telemetry: telemetry.clone(),
                    validator: self.validator.clone(),
                    accepts_prefill: sc.accepts_prefill,
                    cuts: StreamCuts::default(),
                };

                let limiter =
                    RateLimiter::new(rate_limit_config(&cfg, sc, &at, &prefix)?, rl_backend.clone())
                        .map_err(|e| crate::config::config_error(at.clone(), e.to_string()))?;
                limiters.push(limiter.clone());
                let rl = RateLimitLayer::new(limiter.clone())
                    .token_estimate(|c: &ChatCall| c.estimate_tokens())
                    .usage(AnswerUsage)
                    .on_admission(|c: &ChatCall, adm: &Admission| {
                        if let Some(cell) = c.extensions().get::<AdmissionCell>() {
                            cell.set(adm.at(), adm.window());
                        }
                    });

                let max_conc = quota(&format!("{at}.max_concurrency"), sc.max_concurrency)?;
                let aimd = AimdLayer::new(aimd_config(&cfg, max_conc))
                    .map_err(|e| crate::config::config_error(format!("aimd ({at})"), e.to_string()))?
                    .with_source(id.clone())
                    .with_release_signal(sources.wake_signal())
                    .shedding()
                    .with_classifier(AnswerClassifier);
                let breaker_cfg = breaker_config(&cfg, max_conc)?;

                let inner = rl.layer(attempt);
                let (service, breaker) = match &breaker_redis {
                    Some(b) => compose(BreakerLayer::new(b, id.clone(), &breaker_cfg), &aimd, inner),
                    None => compose(
                        BreakerLayer::new(&breaker_memory, id.clone(), &breaker_cfg),
                        &aimd,
                        inner,
                    ),
                };
                sources.insert(id.clone(), service);
                handles.push(SourceHandles {
                    source: id,
                    group: group_name.clone(),
                    breaker,
                    aimd: aimd.handle(),
                    limiter,
                });
            }
            let mut lb = HealthP2c::new(sources.clone(), balance_cfg)
                .map_err(|e| crate::config::config_error("balance", e.to_string()))?
                .with_classifier(AnswerClassifier)
                .with_class(call_shape);
            if let Some(seed) = cfg.balance.seed {
                lb = lb.with_seed(seed);
            }
            let mut retry = RetryLayer::new(retry_cfg.clone())
                .map_err(|e| crate::config::config_error(format!("retry.{}", e.field()), e.to_string()))?
                .classifier(AnswerClassifier)
                .resend(ChatResend)
                .hold(Arc::new(Holds::new(limiters)))
                .progress(progress.clone());
            if let Some(seed) = cfg.balance.seed {
                // One seed makes the balancer's choices and the backoff jitter repeatable.
                retry = retry.rng_seed(seed.wrapping_add(groups.len() as u64));
            }
            let service = BoxCloneSyncService::new(retry.layer(lb));
            groups.push(Group {
                name,
                service,
                sources,
            });
        }
        Ok(Gateway {
            inner: Arc::new(Inner {
                groups,
                cache,
                cache_ttl,
                telemetry,
                handles,
                progress,
                validator: self.validator,
                accepts_prefill: cfg.sources.iter().any(|s| s.accepts_prefill),
            }),
        })
    }
}

/// Re-sends a [`ChatCall`] (an `Arc` clone) and reads the caller's deadline from a
/// [`tower_retry_pushback::CallDeadline`] in its extensions: every wait of the call
/// (backoff, holds, pushback) honours it, and the call fails with `DeadlineExceeded`
/// when it passes.
#[derive(Clone, Copy, Debug, Default)]
struct ChatResend;

impl tower_retry_pushback::Resend<ChatCall> for ChatResend {
    fn resend(&self, req: &ChatCall) -> Option<ChatCall> {
        Some(req.clone())
    }

    fn deadline(&self, req: &ChatCall) -> Option<tokio::time::Instant> {
        req.extensions()
            .get::<tower_retry_pushback::CallDeadline>()
            .map(|d| d.0)
    }
}

/// The balancer's health class of a call: streamed calls (1) apart from the rest (0).
///
/// A source's slow stream, cut by the inter-token watchdog, says nothing about its
/// short answers, and the reverse: P6's `s5` answers short calls and fails 90% of its
/// streams. One health EWMA per source would average the two and keep sending streams
/// there.
fn call_shape(call: &ChatCall) -> usize {
    call_shape_of(call.is_stream())
}

const fn call_shape_of(streamed: bool) -> usize {
    streamed as usize
}

fn compose<G, R>(
    breaker: BreakerLayer<G>,
    aimd: &AimdLayer<AnswerClassifier>,
    inner: R,
) -> (SourceService, BreakerHandle)
where
    G: Gate,
    BreakerLayer<G, AnswerClassifier>: Send + Sync + 'static,
    R: Service<ChatCall, Response = ChatAnswer, Error = BoxError> + Clone + Send + Sync + 'static,
    Aimd<Breaker<R, G, AnswerClassifier>, AnswerClassifier>:
        Service<ChatCall, Response = ChatAnswer, Error = BoxError> + Send + 'static,
    <Aimd<Breaker<R, G, AnswerClassifier>, AnswerClassifier> as Service<ChatCall>>::Future: Send + 'static,
{
    let breaker = breaker.with_classifier(AnswerClassifier);
    let handle = breaker.handle();
    let proto = Arc::new(SourceProto {
        aimd: aimd.clone(),
        breaker,
        inner,
    });
    (BoxCloneSyncService::new(LazySource::new(proto)), handle)
}

/// What a source's service is built from: the layers and the inner service, all `Sync`.
struct SourceProto<G: Gate, R> {
    aimd: AimdLayer<AnswerClassifier>,
    breaker: BreakerLayer<G, AnswerClassifier>,
    inner: R,
}

/// A source's service as the balancer's shared source set holds it: `Sync`, and a
/// clone costs one `Arc` increment (the balancer clones it for every attempt).
///
/// The breaker keeps its pending admission (a `Send` but not `Sync` boxed future) in
/// the service between `poll_ready` and `call`, so the built stack is not `Sync`. A
/// clone starts without it (readiness is per instance, exactly as `Aimd`'s and
/// `Breaker`'s own `Clone` reset it) and builds it from the layers on first
/// `poll_ready`; `Layer::layer` and `Clone` share the same limiter, gate and source
/// state. The `Mutex` only makes the unbuilt-or-owned slot `Sync`: `Service` methods
/// take `&mut self`, so it is reached with `get_mut` and never locked.
struct LazySource<G: Gate, R, S> {
    proto: Arc<SourceProto<G, R>>,
    svc: Mutex<Option<S>>,
}

impl<G: Gate, R, S> LazySource<G, R, S> {
    const fn new(proto: Arc<SourceProto<G, R>>) -> Self {
        Self {
            proto,
            svc: Mutex::new(None),
        }
    }
}

impl<G: Gate, R, S> Clone for LazySource<G, R, S> {
    fn clone(&self) -> Self {
        Self::new(Arc::clone(&self.proto))
    }
}

impl<G, R> LazySource<G, R, Aimd<Breaker<R, G, AnswerClassifier>, AnswerClassifier>>
where
    G: Gate,
    R: Clone,
{
    fn built(&mut self) -> &mut Aimd<Breaker<R, G, AnswerClassifier>, AnswerClassifier> {
        let p = &self.proto;
        self.svc
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert_with(|| p.aimd.layer(p.breaker.layer(p.inner.clone())))
    }
}

impl<G, R> Service<ChatCall> for LazySource<G, R, Aimd<Breaker<R, G, AnswerClassifier>, AnswerClassifier>>
where
    G: Gate,
    R: Clone,
    Aimd<Breaker<R, G, AnswerClassifier>, AnswerClassifier>: Service<ChatCall>,
{
    type Response = <Aimd<Breaker<R, G, AnswerClassifier>, AnswerClassifier> as Service<ChatCall>>::Response;
    type Error = <Aimd<Breaker<R, G, AnswerClassifier>, AnswerClassifier> as Service<ChatCall>>::Error;
    type Future = <Aimd<Breaker<R, G, AnswerClassifier>, AnswerClassifier> as Service<ChatCall>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.built().poll_ready(cx)
    }

    fn call(&mut self, req: ChatCall) -> Self::Future {
        self.built().call(req)
    }
}

fn retry_config(cfg: &GatewayConfig) -> Result<RetryConfig, ConfigError> {
    let r = &cfg.retry;
    let d = RetryConfig::default();
    let c = RetryConfig {
        max_attempts: r.max_attempts.unwrap_or(d.max_attempts),
        max_reasks: r.max_reasks.unwrap_or(d.max_reasks),
        base_backoff: secs("retry.base_backoff_s", r.base_backoff_s)?.unwrap_or(d.base_backoff),
        max_backoff: secs("retry.max_backoff_s", r.max_backoff_s)?.unwrap_or(d.max_backoff),
        stall_window: secs("retry.stall_window_s", r.stall_window_s)?.unwrap_or(d.stall_window),
        max_call_duration: secs("retry.max_call_duration_s", r.max_call_duration_s)?.or(d.max_call_duration),
        ..d
    };
    c.validate()
        .map_err(|e| crate::config::config_error(format!("retry.{}", e.field()), e.to_string()))?;
    Ok(c)
}

fn balance_config(cfg: &GatewayConfig) -> Result<BalanceConfig, ConfigError> {
    let b = &cfg.balance;
    let d = BalanceConfig::default();
    let policy = match b.policy.as_deref() {
        None | Some("health_aware") => Policy::HealthAware,
        Some("round_robin") => Policy::RoundRobin,
        Some("least_inflight") => Policy::LeastInflight,
        Some(other) => {
            return Err(crate::config::config_error(
                "balance.policy",
                format!("unknown policy {other:?}"),
            ));
        }
    };
    let c = BalanceConfig {
        policy,
        max_wait: secs("balance.max_wait_s", b.max_wait_s)?.unwrap_or(d.max_wait),
        silent_after: match secs("balance.silent_after_s", b.silent_after_s)? {
            Some(d) if d.is_zero() => None,
            Some(d) => Some(d),
            None => d.silent_after,
        },
        ..d
    };
    c.validate()
        .map_err(|e| crate::config::config_error("balance", e.to_string()))?;
    Ok(c)
}

fn breaker_config(cfg: &GatewayConfig, max_concurrency: Option<u64>) -> Result<BreakerConfig, ConfigError> {
    let b = &cfg.breaker;
    let mut builder = BreakerConfig::builder()
        .fail_threshold(b.fail_threshold.unwrap_or(DEFAULT_FAIL_THRESHOLD))
        .cooldown(
            secs("breaker.cooldown_s", b.cooldown_s)?.unwrap_or(Duration::from_secs_f64(DEFAULT_COOLDOWN_S)),
        );
    if let Some(n) = max_concurrency {
        builder = builder.max_concurrency(u32::try_from(n).unwrap_or(u32::MAX));
    }
    if let Some(n) = b.min_calls {
        builder = builder.min_calls(n);
    }
    if let Some(r) = b.fail_rate {
        builder = builder.fail_rate(r);
    }
    if let Some(d) = secs("breaker.window_s", b.window_s)? {
        builder = builder.window(d);
    }
    if let Some(d) = secs("breaker.max_cooldown_s", b.max_cooldown_s)? {
        builder = builder.max_cooldown(d);
    }
    if let Some(d) = secs("breaker.probe_ttl_s", b.probe_ttl_s)? {
        builder = builder.probe_ttl(d);
    }
    builder
        .build()
        .map_err(|e| crate::config::config_error(format!("breaker.{}", e.field()), e.to_string()))
}

fn aimd_config(cfg: &GatewayConfig, max_concurrency: Option<u64>) -> AimdConfig {
    let a = &cfg.aimd;
    let d = AimdConfig::default();
    AimdConfig {
        initial_limit: a.initial_limit.unwrap_or(d.initial_limit),
        min_limit: a.min_limit.unwrap_or(d.min_limit),
        decrease_factor: a.decrease_factor.unwrap_or(d.decrease_factor),
        tolerated_pushback: a.tolerated_pushback.unwrap_or(d.tolerated_pushback),
        max_concurrency: max_concurrency.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        caller_concurrency: a.caller_concurrency,
    }
}

fn rate_limit_config(
    cfg: &GatewayConfig,
    sc: &SourceConfig,
    at: &str,
    prefix: &str,
) -> Result<RateLimitConfig, ConfigError> {
    let q = |rpm: Option<u64>, tpm: Option<u64>, conc: Option<u64>| {
        let mut q = Quota::unlimited();
        if let Some(n) = rpm {
            q = q.requests(n);
        }
        if let Some(n) = tpm {
            q = q.tokens(n);
        }
        if let Some(n) = conc {
            q = q.concurrency(n);
        }
        q
    };
    let source_quota = q(
        quota(&format!("{at}.rpm"), sc.rpm)?,
        quota(&format!("{at}.tpm"), sc.tpm)?,
        quota(&format!("{at}.max_concurrency"), sc.max_concurrency)?,
    );
    let mut c = RateLimitConfig::new(sc.name.as_str(), source_quota).key_prefix(format!("{prefix}:rl"));
    if let Some(account) = &sc.account {
        let a = cfg.accounts.get(account).cloned().unwrap_or_default();
        let at = format!("accounts.{account}");
        let account_quota = q(
            quota(&format!("{at}.rpm"), a.rpm)?,
            quota(&format!("{at}.tpm"), a.tpm)?,
            quota(&format!("{at}.max_concurrency"), a.max_concurrency)?,
        );
        c = c.account(account, account_quota);
    }
    if let Some(d) = secs("ratelimit.window_s", cfg.ratelimit.window_s)? {
        c = c.window(d);
    }
    if let Some(d) = secs("ratelimit.lease_ttl_s", cfg.ratelimit.lease_ttl_s)? {
        c = c.lease_ttl(d);
    }
    Ok(c)
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
