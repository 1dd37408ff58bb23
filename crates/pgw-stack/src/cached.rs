//! The gateway's side of the response cache: which calls it serves, single-flight for
//! identical concurrent misses, how long each answer is kept, and a hit as an answer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use pgw_client::{ChatAnswer, ChatCall};
use pgw_core::openai::{ChatChunk, ChatResponse};
use pgw_core::sync::lock;
use tokio::sync::watch;
use tokio::time::Instant;
use tower_retry_pushback::Progress;

use crate::cache::{CacheKey, CachedAnswer, NoCache, ResponseCache, is_deterministic};
use crate::config::CacheWhen;
use crate::gateway::GatewayAnswer;
use crate::telemetry::{AttemptTelemetry, Telemetry};

/// The answers of the calls in flight for a key, as their followers wait for them.
type Flights = Arc<Mutex<HashMap<CacheKey, watch::Receiver<Option<Arc<CachedAnswer>>>>>>;

/// The response cache as the gateway uses it.
pub(crate) struct CacheFlow {
    pub(crate) cache: Arc<dyn ResponseCache>,
    pub(crate) when: CacheWhen,
    /// TTL of an answer from the call's first group, or its context fallback.
    pub(crate) ttl: Duration,
    /// TTL of an answer from a fallback group: the primary may have recovered since.
    pub(crate) fallback_ttl: Duration,
    flights: Flights,
}

/// What the cache says about one call it applies to.
pub(crate) enum Lookup {
    /// A fresh answer: the call is done.
    Hit(Arc<CachedAnswer>),
    /// Go upstream and store the answer; with a [`Flight`] when this call leads the
    /// identical calls that arrive meanwhile.
    Miss(Option<Flight>),
}

/// How long a call that finds an identical one in flight may follow it (see
/// [`CacheFlow::lookup`]).
#[derive(Debug)]
pub(crate) struct Follow<'a> {
    /// The process's last success (the stall guard's signal).
    pub(crate) progress: &'a Progress,
    /// The call's deadline.
    pub(crate) until: Option<Instant>,
    /// The call is streamed to its caller: it neither leads nor follows identical
    /// calls. A streamed leader's flight ends with its stream's last chunk, pulled as
    /// its caller reads: its followers' first byte would wait for its last (or for as
    /// long as its caller holds the stream), and a streamed follower would get its
    /// answer whole, at the end. A stored answer is still a hit.
    pub(crate) streamed: bool,
}

impl Follow<'_> {
    /// Something answered within [`FOLLOW_IF_ANSWERED_WITHIN`].
    fn worth_it(&self) -> bool {
        self.progress.idle_for(Instant::now()) < FOLLOW_IF_ANSWERED_WITHIN
    }
}

/// A call follows an identical one in flight only when some call of the process
/// succeeded within this: the balancer's default `silent_after`, 60 s (a source that
/// said nothing that long is silent; a process that answered nothing that long has
/// leaders that are likely to fail, and waiting on one would make an all-dead pool's
/// calls take a whole attempt timeout instead of failing fast).
pub(crate) const FOLLOW_IF_ANSWERED_WITHIN: Duration = tower_health_p2c::DEFAULT_SILENT_AFTER;

/// The leader of the identical calls in flight: what it stores is handed to every
/// follower; dropped without an answer (failure, a stream cut or dropped), the
/// followers go upstream themselves.
pub(crate) struct Flight {
    key: CacheKey,
    tx: watch::Sender<Option<Arc<CachedAnswer>>>,
    flights: Flights,
}

impl Flight {
    /// Hands `answer` to the followers.
    pub(crate) fn done(self, answer: Arc<CachedAnswer>) {
        self.tx.send_replace(Some(answer));
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        let mut map = lock(&self.flights);
        if map
            .get(&self.key)
            .is_some_and(|rx| rx.same_channel(&self.tx.subscribe()))
        {
            map.remove(&self.key);
        }
    }
}

impl CacheFlow {
    pub(crate) fn new(
        cache: Arc<dyn ResponseCache>,
        when: CacheWhen,
        ttl: Duration,
        fallback_ttl: Duration,
    ) -> Self {
        Self {
            cache,
            when,
            ttl,
            fallback_ttl,
            flights: Arc::default(),
        }
    }

    /// Whether `call` is served from the cache and stored in it.
    pub(crate) fn applies(&self, call: &ChatCall) -> bool {
        call.extensions().get::<NoCache>().is_none()
            && (self.when == CacheWhen::Always || is_deterministic(call.request()))
    }

    /// Looks `key` up; on a miss, leads the identical calls that arrive while this one
    /// is upstream, or follows the one already there. `usable` says whether a stored
    /// answer may be given to this call (its validator). A follower waits no later than
    /// `follow.until` (the call's deadline: then it goes on, and its own gates fail it
    /// at once), and only while something in the process answers (a success within
    /// [`FOLLOW_IF_ANSWERED_WITHIN`]): in a process whose calls all fail, a leader's
    /// answer is not worth a wait, and the follower's own round fails fast
    /// (`CircuitOpen` on an all-dead pool).
    pub(crate) async fn lookup(
        &self,
        key: CacheKey,
        follow: Follow<'_>,
        usable: impl Fn(&CachedAnswer) -> bool,
    ) -> Lookup {
        // The call's deadline bounds the read too: past it, a miss.
        let get = self.cache.get(key);
        let hit = match follow.until {
            Some(d) => tokio::time::timeout_at(d, get).await.ok().flatten(),
            None => get.await,
        };
        if let Some(hit) = hit
            && usable(&hit)
        {
            return Lookup::Hit(hit);
        }
        if follow.streamed {
            return Lookup::Miss(None);
        }
        let mut rx = {
            let mut map = lock(&self.flights);
            match map.get(&key) {
                // Nothing answered lately: go upstream unled, and lead nobody.
                Some(_) if !follow.worth_it() => return Lookup::Miss(None),
                Some(rx) => rx.clone(),
                None => {
                    let (tx, rx) = watch::channel(None);
                    map.insert(key, rx);
                    return Lookup::Miss(Some(Flight {
                        key,
                        tx,
                        flights: Arc::clone(&self.flights),
                    }));
                }
            }
        };
        // Followed while something answers: each time the last success is a window old
        // the follower looks again, and goes on alone when nothing came meanwhile.
        let shared = loop {
            let quiet_at = follow.progress.last_success() + FOLLOW_IF_ANSWERED_WITHIN;
            let until = follow.until.map_or(quiet_at, |d| d.min(quiet_at));
            match tokio::time::timeout_at(until, rx.wait_for(Option::is_some)).await {
                Ok(answer) => break answer.ok().and_then(|v| v.clone()),
                Err(_) if follow.worth_it() && follow.until.is_none_or(|d| Instant::now() < d) => {}
                Err(_) => break None,
            }
        };
        match shared {
            Some(answer) if usable(&answer) => Lookup::Hit(answer),
            // The leader failed, or its answer does not pass this call's validator.
            _ => Lookup::Miss(None),
        }
    }

    /// The TTL of an answer: `ttl` when it came from the call's first group (or from
    /// the context fallback of that group: `primary`), else `fallback_ttl`, so it is
    /// not served long after the primary recovered.
    pub(crate) const fn ttl_for(&self, primary: bool) -> Duration {
        if primary { self.ttl } else { self.fallback_ttl }
    }

    /// The TTL an answer is stored for: a declined or content-filtered one (a refusal,
    /// `finish_reason: "content_filter"` on any choice) only `fallback_ttl`: one
    /// provider's verdict absorbs a burst of the same prompt, but does not stand for
    /// the pool's for `ttl` (another source's filter may answer it).
    fn kept_for(&self, response: &ChatResponse, ttl: Duration) -> Duration {
        kept_for(response, ttl, self.fallback_ttl)
    }

    /// Stores `answer` under `key` and hands it to the flight's followers. A stream
    /// passed through is stored when it ends complete (and not at all otherwise).
    pub(crate) async fn store(
        &self,
        key: CacheKey,
        answer: &ChatAnswer,
        group: String,
        ttl: Duration,
        flight: Option<Flight>,
    ) {
        let source = answer.stats.source.clone();
        match &answer.tail {
            Some(tail) => {
                let cache = Arc::clone(&self.cache);
                let fallback_ttl = self.fallback_ttl;
                tail.on_end(Box::new(move |end| {
                    if let Ok(done) = end {
                        // Its verdict is known at its end only.
                        let ttl = kept_for(&done.response, ttl, fallback_ttl);
                        let cached = Arc::new(CachedAnswer {
                            response: done.response.clone(),
                            chunks: Vec::new(),
                            group,
                            source,
                        });
                        let put = cache.put(key, Arc::clone(&cached), ttl);
                        let finish = move || {
                            if let Some(f) = flight {
                                f.done(cached);
                            }
                        };
                        // Run where the stream's last chunk was read: outside a runtime
                        // a store that is not done at once cannot run; the followers
                        // get the answer all the same.
                        if let Err((_store, finish)) = put_then(put, finish) {
                            tracing::debug!(
                                "a streamed answer was not cached: its stream ended outside a Tokio \
                                 runtime and the store was not done at once"
                            );
                            finish();
                        }
                    }
                }));
            }
            None => {
                let cached = Arc::new(CachedAnswer {
                    response: answer.response.clone(),
                    // Without the provider's payloads (`ChatChunk::raw`): the Redis
                    // backend cannot keep them (a hit is serialized from the chunks on
                    // either backend), and in memory they would double what a cached
                    // stream holds.
                    chunks: answer
                        .chunks
                        .iter()
                        .map(|c| ChatChunk {
                            raw: None,
                            ..c.clone()
                        })
                        .collect(),
                    group,
                    source,
                });
                // Stored first, so a call arriving after the flight ends finds it. The
                // answer does not wait for the store (B12): a store that is not done
                // at once (Redis) finishes in a task of its own, with the flight, whose
                // followers meanwhile wait as before.
                let ttl = self.kept_for(&cached.response, ttl);
                let put = self.cache.put(key, Arc::clone(&cached), ttl);
                let finish = move || {
                    if let Some(f) = flight {
                        f.done(cached);
                    }
                };
                if let Err((store, finish)) = put_then(put, finish) {
                    store.await;
                    finish();
                }
            }
        }
    }
}

/// See [`CacheFlow::kept_for`]: `ttl`, or at most `fallback_ttl` for a
/// declined or content-filtered answer.
fn kept_for(response: &ChatResponse, ttl: Duration, fallback_ttl: Duration) -> Duration {
    let filtered = response.is_declined()
        || response
            .choices
            .iter()
            .any(|c| c.finish_reason.as_deref() == Some(pgw_core::openai::FINISH_CONTENT_FILTER));
    if filtered { ttl.min(fallback_ttl) } else { ttl }
}

/// Runs `put`, then `finish` (the flight handed over after the store, so a call
/// arriving after the flight ends finds the answer): at once when the store is done at
/// once (the memory cache), else in a task on the current runtime. Outside a runtime, a
/// store still pending is given back with `finish`, neither run.
fn put_then<F: FnOnce() + Send + 'static>(
    mut put: BoxFuture<'static, ()>,
    finish: F,
) -> Result<(), (BoxFuture<'static, ()>, F)> {
    if futures_util::FutureExt::now_or_never(&mut put).is_some() {
        finish();
        return Ok(());
    }
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            rt.spawn(async move {
                put.await;
                finish();
            });
            Ok(())
        }
        Err(_) => Err((put, finish)),
    }
}

/// A stored answer as the answer of call `call_id`, recorded as a cache hit.
pub(crate) fn replay(telemetry: &Telemetry, call_id: u64, hit: &CachedAnswer) -> GatewayAnswer {
    metrics::counter!("pgw_cache_hits_total").increment(1);
    telemetry.emit(&AttemptTelemetry {
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
        status: None,
        code: None,
        cache_hit: true,
        probe: false,
        provider_remaining_requests: None,
        provider_remaining_tokens: None,
    });
    GatewayAnswer {
        call_id,
        answer: ChatAnswer {
            response: hit.response.clone(),
            chunks: hit.chunks.clone(),
            stats: pgw_client::AttemptStats {
                source: hit.source.clone(),
                ..pgw_client::AttemptStats::default()
            },
            tail: None,
            body: None,
        },
        group: hit.group.clone(),
        source: hit.source.clone(),
        cache_hit: true,
    }
}

#[cfg(test)]
mod tests {
    use futures_util::future::BoxFuture;
    use pgw_core::openai::ChatRequest;

    use super::*;

    /// A cache whose reads and writes never finish (a Redis that stopped answering,
    /// without the client's timeouts).
    struct Stuck;

    impl ResponseCache for Stuck {
        fn get(&self, _: CacheKey) -> BoxFuture<'static, Option<Arc<CachedAnswer>>> {
            Box::pin(std::future::pending())
        }
        fn put(&self, _: CacheKey, _: Arc<CachedAnswer>, _: Duration) -> BoxFuture<'static, ()> {
            Box::pin(std::future::pending())
        }
    }

    fn flow() -> CacheFlow {
        let ttl = Duration::from_secs(60);
        CacheFlow::new(Arc::new(Stuck), CacheWhen::Always, ttl, ttl)
    }

    fn answer() -> ChatAnswer {
        ChatAnswer {
            response: pgw_core::openai::ChatResponse::default(),
            chunks: Vec::new(),
            stats: pgw_client::AttemptStats::default(),
            tail: None,
            body: None,
        }
    }

    /// The answer does not wait for its store (B12): a store that does not finish
    /// at once finishes in a task of its own.
    #[tokio::test(start_paused = true)]
    async fn an_answer_does_not_wait_for_its_store() {
        let flow = flow();
        let key = CacheKey::of(&ChatRequest::user("m", "hi"));
        let stored = tokio::time::timeout(
            Duration::from_secs(1),
            flow.store(key, &answer(), "g".into(), Duration::from_secs(60), None),
        )
        .await;
        assert!(stored.is_ok(), "the store held the answer");
    }

    /// The call's deadline bounds the cache read: past it, a miss.
    #[tokio::test(start_paused = true)]
    async fn the_deadline_bounds_the_cache_read() {
        let flow = flow();
        let key = CacheKey::of(&ChatRequest::user("m", "hi"));
        let progress = Progress::new();
        let start = Instant::now();
        let follow = Follow {
            progress: &progress,
            until: Some(start + Duration::from_millis(200)),
            streamed: false,
        };
        let looked = tokio::time::timeout(Duration::from_secs(60), flow.lookup(key, follow, |_| true))
            .await
            .expect("the read was waited for past the deadline");
        assert!(matches!(looked, Lookup::Miss(_)));
        assert_eq!(start.elapsed(), Duration::from_millis(200));
    }

    /// A streamed answer's store runs where its last chunk was read, perhaps outside a
    /// runtime: a store done at once finishes there (it spawned a task, and panicked,
    /// before); one still pending is given back, nothing run.
    #[test]
    fn a_store_outside_a_runtime_neither_panics_nor_runs_half() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let finished = Arc::new(AtomicUsize::new(0));
        let count = |f: &Arc<AtomicUsize>| {
            let f = Arc::clone(f);
            move || {
                f.fetch_add(1, Ordering::SeqCst);
            }
        };
        assert!(put_then(Box::pin(async {}), count(&finished)).is_ok());
        assert_eq!(
            finished.load(Ordering::SeqCst),
            1,
            "done at once: finished at once"
        );
        let rest = put_then(Box::pin(std::future::pending()), count(&finished));
        let Err((_store, finish)) = rest else {
            panic!("pending outside a runtime: given back");
        };
        assert_eq!(
            finished.load(Ordering::SeqCst),
            1,
            "not finished before its store"
        );
        finish();
        assert_eq!(finished.load(Ordering::SeqCst), 2);
    }

    /// The Redis cache's store polled outside a runtime (a stream read to its end
    /// there): done at once, skipped, instead of panicking on its timeout's timer.
    #[test]
    fn a_redis_store_outside_a_runtime_is_skipped_not_a_panic() {
        let Some(url) = pgw_test_support::redis_url() else {
            return;
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let conn = rt.block_on(async {
            let target = pgw_core::redis_conn::RedisTarget::parse(&url).unwrap();
            pgw_core::redis_conn::RedisConn::connect(&target).await.unwrap()
        });
        let cache = crate::cache::RedisCache::new(conn, "pgw-test-outside");
        let hit = Arc::new(CachedAnswer {
            response: pgw_core::openai::ChatResponse::default(),
            chunks: Vec::new(),
            group: "g".into(),
            source: None,
        });
        let key = CacheKey::of(&ChatRequest::user("m", "q"));
        let put = cache.put(key, hit, Duration::from_secs(1));
        let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = Arc::clone(&finished);
        // Outside the runtime (it is still alive: only the thread has none).
        let done = std::thread::spawn(move || {
            put_then(put, move || f.store(true, std::sync::atomic::Ordering::SeqCst)).is_ok()
        })
        .join()
        .expect("no panic outside a runtime");
        assert!(done, "skipped at once");
        assert!(finished.load(std::sync::atomic::Ordering::SeqCst));
        drop(rt);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pending_store_inside_a_runtime_finishes_in_a_task() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let finished = Arc::new(AtomicBool::new(false));
        let f = Arc::clone(&finished);
        let put = Box::pin(tokio::time::sleep(Duration::from_millis(5)));
        assert!(put_then(put, move || f.store(true, Ordering::SeqCst)).is_ok());
        assert!(!finished.load(Ordering::SeqCst));
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(
            finished.load(Ordering::SeqCst),
            "finished after its store, in a task"
        );
    }
}
