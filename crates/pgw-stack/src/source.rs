//! [`SourceLayer`]: one route's gates as one `Layer`, asked cheapest first:
//! AIMD (local, cheapest) -> what the limiters already know (no round trip) ->
//! breaker -> the route's holds -> the source's rate limit, over the attempt service.

use std::future::Ready;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::future::Either;
use pgw_client::{AnswerClassifier, ChatAnswer, ChatCall, PassThrough};
use pgw_core::{BoxError, CarriesHistory, CircuitOpen, Classify, Recording, SourceId};
use sync_wrapper::SyncWrapper;
use tower::util::BoxCloneSyncService;
use tower_aimd::{Aimd, AimdLayer};
use tower_breaker_window::{Breaker, BreakerHandle, BreakerLayer, Gate, MemoryGate, RedisGate};
use tower_health_p2c::SourceHealth;
use tower_layer::Layer;
use tower_ratelimit_redis::{Admission, NoTokens, RateLimitLayer, RateLimiter};
use tower_service::Service;

use crate::attempt::{AdmissionCell, AnswerUsage};

/// One source's stack as the balancer holds it: AIMD -> breaker -> rate limit ->
/// attempt (validator, telemetry) -> client.
pub type SourceService = BoxCloneSyncService<ChatCall, ChatAnswer, BoxError>;

/// The token estimate the limiter reserves (prompt bytes / 3 + `max_tokens`).
type Estimate = fn(&ChatCall) -> u64;
/// Leaves each admission where the attempt's telemetry record finds it.
type Observe = fn(&ChatCall, &Admission);

fn estimate(call: &ChatCall) -> u64 {
    call.estimate_tokens()
}

fn observe(call: &ChatCall, admission: &Admission) {
    if let Some(cell) = call.extensions().get::<AdmissionCell>() {
        cell.set(admission.at(), admission.window());
    }
}

/// The limiter's layer with the gateway's hooks.
pub(crate) fn limit_layer(limiter: RateLimiter) -> RateLimitLayer<Estimate, AnswerUsage, Observe> {
    RateLimitLayer::new(limiter)
        .token_estimate(estimate as Estimate)
        .usage(AnswerUsage)
        .on_admission(observe as Observe)
}

/// The layer of a route's own hold scope (an unlimited limiter: only holds, no round
/// trip in memory, cached holds on Redis).
pub(crate) fn hold_layer(limiter: RateLimiter) -> RateLimitLayer<NoTokens, NoTokens> {
    RateLimitLayer::new(limiter)
        .token_estimate(NoTokens)
        .usage(NoTokens)
}

/// The breaker of a source on the configured backend.
#[derive(Clone)]
pub(crate) enum SourceBreaker {
    /// One process.
    Memory(BreakerLayer<MemoryGate, AnswerClassifier>),
    /// Shared through Redis.
    Redis(BreakerLayer<RedisGate, AnswerClassifier>),
}

impl SourceBreaker {
    pub(crate) fn handle(&self) -> BreakerHandle {
        match self {
            Self::Memory(b) => b.handle(),
            Self::Redis(b) => b.handle(),
        }
    }
}

/// The gates of one source, wrapped around its attempt service: AIMD (adaptive
/// concurrency, local) -> breaker -> rate limit. Builds the [`SourceService`] the
/// balancer holds.
#[derive(Clone)]
pub(crate) struct SourceLayer {
    pub(crate) aimd: AimdLayer<AnswerClassifier>,
    pub(crate) breaker: SourceBreaker,
    /// The route's own hold scope, when the route is not the whole source.
    pub(crate) hold: Option<RateLimitLayer<NoTokens, NoTokens>>,
    pub(crate) limit: RateLimitLayer<Estimate, AnswerUsage, Observe>,
    /// What a caller whose admission was the half-open probe is told to wait
    /// ([`ProbeOffPath`]): the breaker's `min(probe_ttl, cooldown)`.
    pub(crate) probe_retry_after: Duration,
    /// The balancers' views of the route, told when a probe succeeds ([`ProbeOffPath`]).
    pub(crate) health: HealthViews,
}

/// The balancers' views of one route (one per group it is in), filled once the route's
/// service is in its groups. A half-open probe that succeeds tells them the source
/// [recovered](SourceHealth::recovered) ([`ProbeOffPath`]).
#[derive(Clone, Default)]
pub(crate) struct HealthViews {
    views: Arc<OnceLock<Vec<SourceHealth>>>,
    /// The balancer's `silent_after` when it cuts attempts (`cut_silent`): a probe is
    /// given up as such an attempt would be cut.
    cut_after: Option<Duration>,
}

impl HealthViews {
    pub(crate) fn new(cut_after: Option<Duration>) -> Self {
        Self {
            views: Arc::default(),
            cut_after,
        }
    }

    /// Sets the views (once; a second call changes nothing).
    pub(crate) fn set(&self, views: Vec<SourceHealth>) {
        let _ = self.views.set(views);
    }

    /// How long a probe may go unanswered before it is given up: as long as the
    /// balancer lets an attempt run before it may cut it ([`SourceHealth::cut_age`];
    /// `None`: no cut configured, or the source never answered a success).
    fn probe_limit(&self) -> Option<Duration> {
        let after = self.cut_after?;
        self.views.get()?.iter().find_map(|v| v.cut_age(after))
    }

    fn recovered(&self) {
        for view in self.views.get().into_iter().flatten() {
            view.recovered();
        }
    }
}

impl<S> Layer<S> for SourceLayer
where
    S: Service<ChatCall, Response = ChatAnswer, Error = BoxError> + Clone + Send + Sync + 'static,
    S::Future: Send + 'static,
{
    type Service = SourceService;

    fn layer(&self, attempt: S) -> SourceService {
        let inner = self.limit.layer(attempt);
        let aimd = self.aimd.clone();
        // The limiters below the breaker, asked for what they already know first.
        let known: Arc<[RateLimiter]> = self
            .hold
            .iter()
            .map(|h| h.limiter().clone())
            .chain([self.limit.limiter().clone()])
            .collect();
        let probe = (self.probe_retry_after, self.health.clone());
        match (&self.breaker, &self.hold) {
            (SourceBreaker::Memory(b), None) => lazy(aimd, known, b.clone(), probe, inner),
            (SourceBreaker::Redis(b), None) => lazy(aimd, known, b.clone(), probe, inner),
            (SourceBreaker::Memory(b), Some(h)) => lazy(aimd, known, b.clone(), probe, h.layer(inner)),
            (SourceBreaker::Redis(b), Some(h)) => lazy(aimd, known, b.clone(), probe, h.layer(inner)),
        }
    }
}

/// The gated stack of one source over `R`.
type Gated<R, G> = Aimd<Known<ProbeOffPath<Breaker<R, G, AnswerClassifier>>>, AnswerClassifier>;

fn lazy<G, R>(
    aimd: AimdLayer<AnswerClassifier>,
    known: Arc<[RateLimiter]>,
    breaker: BreakerLayer<G, AnswerClassifier>,
    (probe_retry_after, health): (Duration, HealthViews),
    inner: R,
) -> SourceService
where
    G: Gate,
    R: Clone + Send + Sync + 'static,
    Gated<R, G>: Service<ChatCall, Response = ChatAnswer, Error = BoxError> + Send + 'static,
    <Gated<R, G> as Service<ChatCall>>::Future: Send + 'static,
{
    let probe = (breaker.source().clone(), probe_retry_after, health);
    let proto = Arc::new(SourceProto {
        aimd,
        known,
        breaker,
        probe,
        inner,
    });
    BoxCloneSyncService::new(LazySource::new(proto))
}

/// Between AIMD and the breaker: a call the limiters below would refuse from what
/// they already know (a hold, a remembered refusal: [`RateLimiter::known_refusal`])
/// is refused here, before the breaker's admission (a Redis round trip on the Redis
/// backend). Cheapest gate first: a waiting call's rounds ask
/// no breaker for a source whose quota is known to be full. On the memory backend the
/// limiters know nothing this way and it passes through.
#[derive(Clone)]
struct Known<S> {
    limiters: Arc<[RateLimiter]>,
    inner: S,
}

impl<S> Service<ChatCall> for Known<S>
where
    S: Service<ChatCall, Error = BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        if let Some(refused) = self.limiters.iter().find_map(RateLimiter::known_refusal) {
            return Poll::Ready(Err(refused));
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: ChatCall) -> Self::Future {
        self.inner.call(req)
    }
}

/// Right over the breaker: a call admitted as the half-open probe is not made to wait
/// for it. The probe goes out on a task of its own (a copy of the call, its answer
/// dropped once judged), and the caller is refused as by an open circuit, with the
/// `retry_after` every other caller gets while a probe is out, so it goes on at once
/// to another source or group, or fails fast with `CircuitOpen` when none is left.
///
/// Without it, the first call after a cooldown waited for the probe's verdict: on a
/// revoked key, a 401 that took 2.3 s; on a source still silent, a whole attempt
/// timeout. The probe's verdict closes or reopens the breaker exactly as before (the
/// breaker's response future records it wherever it is polled), so a recovered source
/// is back as soon as its probe answers.
///
/// A probe that succeeds also tells the balancers the source
/// [recovered](SourceHealth::recovered): the balancer saw only refusals while the
/// breaker was open, and its health of the source is still what the failures left.
/// Without that, on the flapping soak (a source failing one minute in two) the source
/// took 20-55 s after its breaker closed to carry 8 calls again, while callers waited
/// for busy healthier ones.
///
/// A probe unanswered for as long as the balancer lets an attempt run unanswered
/// before it cuts it ([`HealthViews`]' limit) is given up without a verdict: the lease
/// goes back and the next admission probes again. A probe a black hole swallowed used
/// to hold the lease for its whole attempt timeout, the source out that long after it
/// healed.
#[derive(Clone)]
pub(crate) struct ProbeOffPath<S> {
    inner: S,
    source: SourceId,
    /// What a caller refused because a probe is out hears: the breaker's own
    /// `min(probe_ttl, cooldown)`.
    retry_after: Duration,
    health: HealthViews,
}

impl<S> ProbeOffPath<S> {
    pub(crate) const fn new(inner: S, source: SourceId, retry_after: Duration, health: HealthViews) -> Self {
        Self {
            inner,
            source,
            retry_after,
            health,
        }
    }
}

impl<R, G> Service<ChatCall> for ProbeOffPath<Breaker<R, G, AnswerClassifier>>
where
    G: Gate,
    Breaker<R, G, AnswerClassifier>: Service<ChatCall, Response = ChatAnswer, Error = BoxError>,
    <Breaker<R, G, AnswerClassifier> as Service<ChatCall>>::Future: Send + 'static,
{
    type Response = ChatAnswer;
    type Error = BoxError;
    type Future = Either<
        <Breaker<R, G, AnswerClassifier> as Service<ChatCall>>::Future,
        Ready<Result<ChatAnswer, BoxError>>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: ChatCall) -> Self::Future {
        if !self.inner.admitted_probe() {
            return Either::Left(self.inner.call(req));
        }
        // Judged whole: a stream passed through would be dropped here at its first
        // chunk, unjudged, and its lease given back without a verdict.
        req.extensions_mut().remove::<PassThrough>();
        // Its time is its own, not the caller's run of refusals.
        req.mark_probe_copy();
        if req.call_history().is_none()
            && let Some(history) = Recording::adopt::<ChatCall>()
        {
            // Numbered in the caller's history like its own attempts (its telemetry
            // record carries the caller's call id): the copy carries it off this poll.
            req.set_call_history(history);
        }
        let probe = self.inner.call(req);
        let health = self.health.clone();
        let limit = health.probe_limit();
        tokio::spawn(async move {
            let result = match limit {
                // A probe the source swallowed (a black hole) would hold the breaker's
                // lease for a whole attempt timeout, the source kept out that long after
                // it heals: given up as the balancer would cut such an attempt, it ends
                // without a verdict and the next admission probes again at once.
                Some(limit) => match tokio::time::timeout(limit, probe).await {
                    Ok(result) => result,
                    Err(_) => return,
                },
                None => probe.await,
            };
            if AnswerClassifier.classify(&result).is_success() {
                // The breaker closed on it (its future recorded the verdict).
                health.recovered();
            }
        });
        let open = CircuitOpen::new(self.retry_after).with_source(self.source.clone());
        Either::Right(std::future::ready(Err(Box::new(open))))
    }
}

/// What a source's service is built from: the layers and the inner service, all `Sync`.
struct SourceProto<G: Gate, R> {
    aimd: AimdLayer<AnswerClassifier>,
    known: Arc<[RateLimiter]>,
    breaker: BreakerLayer<G, AnswerClassifier>,
    /// The breaker's source, the `retry_after` of a caller whose admission was the
    /// probe, and the balancers' views a successful probe tells ([`ProbeOffPath`]).
    probe: (SourceId, Duration, HealthViews),
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
/// state. `SyncWrapper` makes the slot `Sync`: `Service` methods take `&mut self`, so
/// it is only ever reached through `get_mut`.
struct LazySource<G: Gate, R> {
    proto: Arc<SourceProto<G, R>>,
    svc: SyncWrapper<Option<Gated<R, G>>>,
}

impl<G: Gate, R> LazySource<G, R> {
    const fn new(proto: Arc<SourceProto<G, R>>) -> Self {
        Self {
            proto,
            svc: SyncWrapper::new(None),
        }
    }
}

impl<G: Gate, R> Clone for LazySource<G, R> {
    fn clone(&self) -> Self {
        Self::new(Arc::clone(&self.proto))
    }
}

impl<G: Gate, R: Clone> LazySource<G, R> {
    fn built(&mut self) -> &mut Gated<R, G> {
        let p = &self.proto;
        self.svc.get_mut().get_or_insert_with(|| {
            p.aimd.layer(Known {
                limiters: Arc::clone(&p.known),
                inner: ProbeOffPath::new(
                    p.breaker.layer(p.inner.clone()),
                    p.probe.0.clone(),
                    p.probe.1,
                    p.probe.2.clone(),
                ),
            })
        })
    }
}

impl<G, R> Service<ChatCall> for LazySource<G, R>
where
    G: Gate,
    R: Clone,
    Gated<R, G>: Service<ChatCall>,
{
    type Response = <Gated<R, G> as Service<ChatCall>>::Response;
    type Error = <Gated<R, G> as Service<ChatCall>>::Error;
    type Future = <Gated<R, G> as Service<ChatCall>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.built().poll_ready(cx)
    }

    fn call(&mut self, req: ChatCall) -> Self::Future {
        self.built().call(req)
    }
}
