//! [`GatewayBuilder`]: from a [`GatewayConfig`] to a [`Gateway`]: the backend, the
//! cache, the telemetry sinks, then per group a retry loop over a balancer over one
//! [`SourceLayer`] stack per source.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use pgw_client::{AnswerClassifier, BoxTransport, ChatCall, HyperTransport, UpstreamClient, box_transport};
use pgw_core::BoxError;
use pgw_core::redis_conn::{RedisConn, RedisTarget};
use tokio::sync::Notify;
use tower::util::BoxCloneSyncService;
use tower_aimd::AimdLayer;
use tower_breaker_window::BreakerLayer;
use tower_health_p2c::{HealthP2c, Sources};
use tower_layer::Layer;
use tower_ratelimit_redis::{Quota, RateLimitConfig, RateLimiter};
use tower_retry_pushback::{HistoryMode, Progress, RetryLayer};

use crate::attempt::{Attempt, StreamCuts};
use crate::cache::{MemoryCache, RedisCache, ResponseCache};
use crate::cached::CacheFlow;
use crate::config::{
    BackendKind, ConfigError, DEFAULT_CACHE_FALLBACK_TTL_S, DEFAULT_CACHE_MAX_ENTRIES, DEFAULT_CACHE_TTL_S,
    DEFAULT_KEY_PREFIX, GatewayConfig, SourceConfig, config_error, quota, secs, secs_or_off,
};
use crate::gateway::{CallShape, Gateway, Group, Inner, SourceHandles};
use crate::route::{Plan, Pushback, QuotaHold, RouteHold, RouteHolds, RouteSpec};
use crate::settings::{
    aimd_config, aimd_error, balance_config, breaker_config, quota_hold, rate_limit_config, retry_config,
};
use crate::source::{HealthViews, SourceBreaker, SourceLayer, SourceService, hold_layer, limit_layer};
use crate::telemetry::{JsonlSink, PriceTable, Telemetry, TelemetrySink, TracingSink};
use crate::validate::{Validate, Validator};

/// Builds the transport of a source (a custom one: the simulator, a proxy, a mock).
pub type TransportFactory = dyn Fn(&SourceConfig) -> Result<BoxTransport, BoxError> + Send + Sync;
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
    /// A [`ConfigError`] naming the field; [`pgw_core::BackendUnavailable`] naming the
    /// address when Redis does not answer; a layer's configuration error.
    pub async fn build(self) -> Result<Gateway, BoxError> {
        let cfg = self.config;
        cfg.validate()?;
        let prefix = cfg
            .key_prefix
            .clone()
            .unwrap_or_else(|| DEFAULT_KEY_PREFIX.to_owned());
        let telemetry = telemetry(&cfg, self.sinks)?;
        let redis = connect(&cfg).await?;

        let store: Option<Arc<dyn ResponseCache>> = match (&redis, cfg.cache.enabled) {
            (_, false) => None,
            (Some(conn), true) => Some(Arc::new(RedisCache::new(conn.clone(), prefix.clone()))),
            (None, true) => Some(Arc::new(MemoryCache::bounded(
                cfg.cache.max_entries.unwrap_or(DEFAULT_CACHE_MAX_ENTRIES),
                cfg.cache.max_bytes.unwrap_or(crate::cache::DEFAULT_MAX_BYTES),
            ))),
        };
        let ttl = secs("cache.ttl_s", cfg.cache.ttl_s)?
            .unwrap_or_else(|| Duration::from_secs_f64(DEFAULT_CACHE_TTL_S));
        let fallback_ttl = secs("cache.fallback_ttl_s", cfg.cache.fallback_ttl_s)?
            .unwrap_or_else(|| Duration::from_secs_f64(DEFAULT_CACHE_FALLBACK_TTL_S))
            .min(ttl);
        let cache = store.map(|store| CacheFlow::new(store, cfg.cache.when, ttl, fallback_ttl));

        let closed_view = secs_or_off("breaker.closed_view_s", cfg.breaker.closed_view_s)?
            .unwrap_or(tower_breaker_window::DEFAULT_CLOSED_VIEW);
        let backends = Backends::new(redis.as_ref(), &prefix, closed_view);
        let retry_cfg = retry_config(&cfg)?;
        let max_call_duration = retry_cfg.max_call_duration;
        let balance_cfg = balance_config(&cfg)?;
        let wiring = Wiring {
            cfg: &cfg,
            prefix: &prefix,
            backends: &backends,
            telemetry: &telemetry,
            validator: self.validator.as_ref(),
            transport: self.transport.as_deref(),
            cut_after: balance_cfg.silent_after.filter(|_| balance_cfg.cut_silent),
        };
        let progress = Progress::new();

        let plan = Plan::of(&cfg);
        let group_sources: Vec<Sources<SourceService>> = plan.groups.iter().map(|_| Sources::new()).collect();
        let mut sources = SourceParts::default();
        let mut handles = Vec::new();
        let mut holds = HashMap::new();
        for (r, route) in plan.routes.iter().enumerate() {
            let in_groups: Vec<usize> = (0..plan.groups.len())
                .filter(|&g| plan.groups[g].routes.contains(&r))
                .collect();
            let Some(&first) = in_groups.first() else {
                continue;
            };
            let group = Arc::from(plan.groups[first].name.as_str());
            // A route in several groups (one upstream model behind two public models)
            // wakes a waiter of each group's balancer when a slot frees.
            let signals: Vec<_> = in_groups
                .iter()
                .map(|&g| group_sources[g].wake_signal())
                .collect();
            let (service, handle, hold, health) = wiring.route(route, &mut sources, &group, &signals)?;
            for &g in &in_groups {
                group_sources[g].insert(route.id.clone(), service.clone());
            }
            health.set(
                in_groups
                    .iter()
                    .filter_map(|&g| group_sources[g].view(route.id.as_str()))
                    .collect(),
            );
            holds.insert(route.id.clone(), hold);
            handles.push(handle);
        }
        let holds = Arc::new(RouteHolds {
            routes: Arc::new(holds),
        });

        // One layer cloned per group: the retry budget and the throttle are shared by
        // every group, as the process's view of upstream overload.
        // The balancer below records through the call's `Recording`, and the attempt
        // layer numbers through it: a call whose first attempt succeeds needs no history.
        let retry = RetryLayer::new(retry_cfg)
            .map_err(|e| config_error(format!("retry.{}", e.field()), e.to_string()))?
            .classifier(AnswerClassifier)
            .resend(ChatResend)
            .history_mode(HistoryMode::OnDemand)
            .hold(holds)
            .progress(progress.clone());
        let mut groups = Vec::new();
        for (spec, sources) in plan.groups.iter().zip(group_sources) {
            let mut lb = HealthP2c::new(sources.clone(), balance_cfg)
                .map_err(|e| config_error("balance", e.to_string()))?
                .with_classifier(AnswerClassifier)
                .with_class(CallShape);
            let mut retry = retry.clone();
            if let Some(seed) = cfg.balance.seed {
                lb = lb.with_seed(seed);
                // One seed makes the balancer's choices and the backoff jitter repeatable.
                retry = retry.rng_seed(seed.wrapping_add(groups.len() as u64));
            }
            groups.push(Group {
                name: Arc::from(spec.name.as_str()),
                service: BoxCloneSyncService::new(retry.layer(lb)),
                sources,
            });
        }
        Ok(Gateway {
            inner: Arc::new(Inner {
                groups,
                models: plan.models,
                all: plan.all,
                cache,
                telemetry,
                handles,
                progress,
                validator: self.validator,
                prefill_routes: sources.prefill,
                max_call_duration,
            }),
        })
    }
}

/// The telemetry sinks: the builder's, then those the config names.
fn telemetry(cfg: &GatewayConfig, mut sinks: Vec<Arc<dyn TelemetrySink>>) -> Result<Telemetry, ConfigError> {
    if let Some(path) = &cfg.telemetry.jsonl_path {
        let sink = JsonlSink::open(path)
            .map_err(|e| config_error("telemetry.jsonl_path", format!("cannot open {path}: {e}")))?;
        sinks.push(Arc::new(sink));
    }
    if cfg.telemetry.tracing {
        sinks.push(Arc::new(TracingSink));
    }
    Ok(Telemetry {
        sinks: Arc::new(sinks),
        prices: Arc::new(PriceTable::new(cfg.prices.clone())),
        attempts: Arc::default(),
        remaining: Arc::default(),
    })
}

/// The Redis connection, when the backend is Redis. A bad URL is a [`ConfigError`];
/// a Redis that does not answer is [`pgw_core::BackendUnavailable`] naming the address
/// (the config is fine: it was read as "invalid gateway config").
async fn connect(cfg: &GatewayConfig) -> Result<Option<RedisConn>, BoxError> {
    if cfg.backend != BackendKind::Redis {
        return Ok(None);
    }
    let url = cfg.redis_url.as_deref().unwrap_or_default();
    let target =
        RedisTarget::parse(url).map_err(|e| config_error("redis_url", crate::config::redact_in(&e, url)))?;
    let conn = RedisConn::connect(&target).await.map_err(|e| {
        let e = crate::config::redact_in(&e.to_string(), url);
        pgw_core::BackendUnavailable::new(
            "redis",
            "connect",
            format!("no answer from {target} (redis_url): {e}"),
        )
    })?;
    Ok(Some(conn))
}

/// Where the breakers and limiters keep their state.
struct Backends {
    limiter: tower_ratelimit_redis::Backend,
    breaker_memory: tower_breaker_window::MemoryBackend,
    breaker_redis: Option<tower_breaker_window::RedisBackend>,
}

impl Backends {
    fn new(redis: Option<&RedisConn>, prefix: &str, closed_view: Duration) -> Self {
        Self {
            limiter: match redis {
                Some(conn) => tower_ratelimit_redis::RedisBackend::new(conn.clone()).into(),
                None => tower_ratelimit_redis::MemoryBackend::new().into(),
            },
            breaker_memory: tower_breaker_window::MemoryBackend::new(),
            breaker_redis: redis.map(|c| {
                tower_breaker_window::RedisBackend::new(c.clone())
                    .with_prefix(format!("{prefix}:brk"))
                    .with_closed_view(closed_view)
            }),
        }
    }
}

/// What every source's stack is built with.
struct Wiring<'a> {
    cfg: &'a GatewayConfig,
    prefix: &'a str,
    backends: &'a Backends,
    telemetry: &'a Telemetry,
    validator: Option<&'a Validator>,
    transport: Option<&'a TransportFactory>,
    /// The balancer's `silent_after` when it cuts attempts in flight.
    cut_after: Option<Duration>,
}

/// What the routes of one source share: its transport (one connection pool) and its
/// limiter (its quotas and its account's), built when a route first needs them.
#[derive(Default)]
struct SourceParts {
    built: HashMap<usize, (BoxTransport, RateLimiter)>,
    /// The routes whose source continues an assistant prefill.
    prefill: Vec<pgw_core::SourceId>,
}

impl Wiring<'_> {
    /// One route's stack, its handles and what its holds need.
    fn route(
        &self,
        route: &RouteSpec,
        parts: &mut SourceParts,
        group: &Arc<str>,
        wake: &[Arc<Notify>],
    ) -> Result<(SourceService, SourceHandles, RouteHold, HealthViews), BoxError> {
        let cfg = self.cfg;
        let sc = &cfg.sources[route.source];
        let at = format!("sources[{}]", route.source);
        let mut settings = sc.settings(&at)?;
        settings.model.clone_from(&route.upstream);
        let attempt_timeout = settings.timeouts.total;
        let (transport, limiter) = match parts.built.get(&route.source) {
            Some(built) => built.clone(),
            None => {
                let transport = match self.transport {
                    Some(f) => f(sc)?,
                    None => box_transport(HyperTransport::new(settings.timeouts.connect)?),
                };
                let limiter = RateLimiter::new(
                    rate_limit_config(cfg, sc, &at, self.prefix)?,
                    self.backends.limiter.clone(),
                )
                .map_err(|e| config_error(&at, e.to_string()))?;
                parts
                    .built
                    .insert(route.source, (transport.clone(), limiter.clone()));
                (transport, limiter)
            }
        };
        let source = settings.id.clone();
        if sc.accepts_prefill {
            parts.prefill.push(source.clone());
        }
        let pushback = Pushback::default();
        let max_conc = quota(&format!("{at}.max_concurrency"), sc.max_concurrency)?;
        let breaker_cfg = breaker_config(cfg, max_conc, attempt_timeout)?;
        let attempt = Attempt {
            inner: UpstreamClient::new(settings, transport)?,
            source: source.clone(),
            group: Arc::clone(group),
            model: route.upstream.as_deref().map(Arc::from),
            telemetry: self.telemetry.clone(),
            validator: self.validator.cloned(),
            accepts_prefill: sc.accepts_prefill,
            cuts: StreamCuts::default(),
            pushback: pushback.clone(),
            quota_hold: QuotaHold {
                limiter: limiter.clone(),
                duration: quota_hold(cfg, &breaker_cfg)?,
            },
            attempt_timeout,
        };
        // A route that is not the whole source has a hold scope of its own, so a 429 of
        // one model leaves the source's other models admitted.
        let route_hold = if route.id == source {
            None
        } else {
            let config = RateLimitConfig::new(route.id.as_str(), Quota::unlimited())
                .key_prefix(format!("{}:rl", self.prefix));
            Some(
                RateLimiter::new(config, self.backends.limiter.clone())
                    .map_err(|e| config_error(&at, e.to_string()))?,
            )
        };
        let mut aimd = AimdLayer::new(aimd_config(cfg, max_conc))
            .map_err(|e| aimd_error(&at, &e))?
            .with_source(route.id.clone());
        for (i, signal) in wake.iter().enumerate() {
            aimd = if i == 0 {
                aimd.with_release_signal(Arc::clone(signal))
            } else {
                aimd.also_release_signal(Arc::clone(signal))
            };
        }
        let aimd = aimd.shedding().with_classifier(AnswerClassifier);
        let breaker = match &self.backends.breaker_redis {
            Some(b) => SourceBreaker::Redis(
                BreakerLayer::new(b, route.id.clone(), &breaker_cfg).with_classifier(AnswerClassifier),
            ),
            None => SourceBreaker::Memory(
                BreakerLayer::new(&self.backends.breaker_memory, route.id.clone(), &breaker_cfg)
                    .with_classifier(AnswerClassifier),
            ),
        };
        let handle = SourceHandles {
            source,
            route: route.id.clone(),
            model: route.upstream.clone(),
            group: group.to_string(),
            breaker: breaker.handle(),
            aimd: aimd.handle(),
            limiter: limiter.clone(),
        };
        let hold = RouteHold {
            source: limiter.clone(),
            route: route_hold.clone(),
            upstream: route.upstream.clone(),
            pushback,
        };
        let layer = SourceLayer {
            aimd,
            breaker,
            hold: route_hold.map(hold_layer),
            limit: limit_layer(limiter),
            probe_retry_after: breaker_cfg.probe_out_retry_after(),
            health: HealthViews::new(self.cut_after),
        };
        Ok((layer.layer(attempt), handle, hold, layer.health))
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
