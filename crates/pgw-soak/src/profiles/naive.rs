//! `naive`: the seeds' first design, the baseline.
//!
//! - Round robin over the sources, one cursor step per pick, skipping sources whose
//!   breaker is open or whose RPM/TPM gate is full: the "hole funnel" comes with it:
//!   the traffic of skipped sources falls to the next live one.
//! - A consecutive-failure breaker reset by any success, with the effective threshold
//!   `max(configured, 2 x global concurrency)` and a fixed cooldown; 401
//!   forces it open; 429s count as failures (the seeds' first design did); a half-open
//!   breaker admits one probe.
//! - 3 attempts per call, consumed by every failure, 429s and invalid answers
//!   included, with a fixed exponential backoff; 400 fails fast.
//! - The seed's response cache and a simple fixed-window RPM/TPM gate (to be fair: the
//!   same quotas as every profile), both shared by the workers (the seed kept them in
//!   Redis). The scoreboard judges every span of a quota's window, so this gate's
//!   bursts across window edges (up to twice the quota in one span) show as violations:
//!   the seed's design, kept as it was.
//!
//! Profile-local code on purpose: it is the baseline, not library code.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use pgw_client::{AnswerClassifier, BoxTransport, ChatAnswer, UpstreamClient};
use pgw_core::openai::ChatResponse;
use pgw_core::sync::lock;
use pgw_core::{BoxError, Classify, Outcome};
use tokio::time::Instant;

use super::{Built, Env, Inflight, Recorded, ResponseCache, attempt_on, chat_call};
use crate::driver::{Client, Delivered, SoakCall, is_valid_structured};
use crate::scenario::QUOTA_WINDOW;
use crate::telemetry::{Accounting, Recorder};

/// How long a call waits for any source to be admitted before it gives up.
const MAX_WAIT_FOR_SOURCE: Duration = Duration::from_secs(120);
/// Poll interval while no source is admitted.
const WAIT_STEP: Duration = Duration::from_secs(1);

/// No source could be admitted for 120 s of scenario time.
#[derive(Debug)]
pub struct NoSourceAdmitted;

impl std::fmt::Display for NoSourceAdmitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no source admitted")
    }
}

impl std::error::Error for NoSourceAdmitted {}

#[derive(Debug, Default)]
struct Breaker {
    consecutive: u32,
    open_until: Option<Instant>,
    probing: bool,
}

#[derive(Debug, Default)]
struct Gate {
    window: u64,
    requests: u64,
    tokens: u64,
}

struct SourceState {
    name: String,
    /// The transport is `Send` but not `Sync`: each attempt clones the client out.
    client: Mutex<UpstreamClient<BoxTransport>>,
    rpm: Option<u64>,
    tpm: Option<u64>,
    breaker: Mutex<Breaker>,
    gate: Mutex<Gate>,
}

struct Shared {
    sources: Vec<SourceState>,
    cache: Option<ResponseCache>,
    threshold: u32,
    cooldown: Duration,
    backoff: Duration,
    attempts: u32,
    origin: Instant,
    inflight: Inflight,
    recorder: Recorder,
}

/// Admission of one source: `Some(probe)` when admitted (`probe` when half-open).
fn admit(shared: &Shared, s: &SourceState, now: Instant, tokens: u64) -> Option<bool> {
    let probe = {
        let mut b = lock(&s.breaker);
        match b.open_until {
            Some(t) if now < t || b.probing => return None,
            Some(_) => {
                b.probing = true;
                true
            }
            None => false,
        }
    };
    let window = u64::try_from(now.saturating_duration_since(shared.origin).as_millis()).unwrap_or(u64::MAX)
        / u64::try_from(QUOTA_WINDOW.as_millis()).unwrap_or(60_000);
    let mut g = lock(&s.gate);
    if g.window != window {
        *g = Gate {
            window,
            ..Gate::default()
        };
    }
    let rpm_ok = s.rpm.is_none_or(|l| g.requests < l);
    let tpm_ok = s.tpm.is_none_or(|l| g.tokens + tokens <= l || g.tokens == 0);
    if rpm_ok && tpm_ok {
        g.requests += 1;
        g.tokens += tokens;
        Some(probe)
    } else {
        if probe {
            lock(&s.breaker).probing = false;
        }
        None
    }
}

/// Releases a probe flag if the attempt ends without a verdict (dropped future).
struct ProbeGuard<'a> {
    breaker: &'a Mutex<Breaker>,
    armed: bool,
}

impl Drop for ProbeGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            lock(self.breaker).probing = false;
        }
    }
}

fn record(shared: &Shared, s: &SourceState, probe: bool, outcome: Outcome) {
    let now = Instant::now();
    let mut b = lock(&s.breaker);
    if probe {
        b.probing = false;
    }
    match outcome {
        Outcome::Success | Outcome::Invalid => {
            b.consecutive = 0;
            if probe {
                b.open_until = None;
            }
        }
        Outcome::SourceDead => {
            b.consecutive += 1;
            b.open_until = Some(now + shared.cooldown);
        }
        Outcome::Transient | Outcome::RateLimited { .. } => {
            b.consecutive += 1;
            if probe || b.consecutive >= shared.threshold {
                b.open_until = Some(now + shared.cooldown);
            }
        }
        Outcome::Rejected | Outcome::LocalExhaustion => {}
    }
}

struct Worker {
    shared: Arc<Shared>,
    worker: u32,
    cursor: AtomicUsize,
}

impl Worker {
    /// Round robin from the cursor, skipping sources that are not admitted.
    fn pick(&self, tokens: u64) -> Option<(usize, bool)> {
        let n = self.shared.sources.len();
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        (0..n).find_map(|i| {
            let idx = (start + i) % n;
            admit(&self.shared, &self.shared.sources[idx], now, tokens).map(|probe| (idx, probe))
        })
    }

    async fn run(self: Arc<Self>, call: SoakCall) -> Result<ChatResponse, BoxError> {
        let shared = Arc::clone(&self.shared);
        if let Some(resp) = shared
            .cache
            .as_ref()
            .and_then(|c| c.hit(&call, self.worker, &shared.recorder))
        {
            return Ok(resp);
        }
        let chat = chat_call(&call);
        let tokens = chat.estimate_tokens();
        let mut last: BoxError = NoSourceAdmitted.into();
        for attempt in 1..=shared.attempts {
            if attempt > 1 {
                tokio::time::sleep(shared.backoff * 2u32.saturating_pow(attempt - 2)).await;
            }
            let waited_since = Instant::now();
            let (idx, probe) = loop {
                if let Some(p) = self.pick(tokens) {
                    break p;
                }
                if waited_since.elapsed() >= MAX_WAIT_FOR_SOURCE {
                    return Err(NoSourceAdmitted.into());
                }
                tokio::time::sleep(WAIT_STEP).await;
            };
            let source = &shared.sources[idx];
            let mut guard = ProbeGuard {
                breaker: &source.breaker,
                armed: probe,
            };
            let client = lock(&source.client).clone();
            let svc = Recorded::new(
                client,
                &source.name,
                self.worker,
                shared.recorder.clone(),
                shared.inflight.clone(),
            );
            let result: Result<ChatAnswer, BoxError> = attempt_on(svc, chat.clone()).await;
            guard.armed = false;
            let mut outcome = AnswerClassifier.classify(&result);
            if let Ok(a) = &result
                && call.structured
                && outcome.is_success()
                && !is_valid_structured(a.content())
            {
                outcome = Outcome::Invalid;
            }
            record(&shared, source, probe, outcome);
            match (result, outcome) {
                (Ok(a), Outcome::Success) => {
                    if let Some(cache) = &shared.cache {
                        cache.insert(&call, &a.response);
                    }
                    return Ok(a.response);
                }
                (Ok(a), _) => {
                    last = pgw_core::InvalidResponse::new(format!(
                        "{} chars of non-JSON content",
                        a.content().len()
                    ))
                    .into();
                }
                (Err(e), Outcome::Rejected) => return Err(e),
                (Err(e), _) => last = e,
            }
        }
        Err(last)
    }
}

struct NaiveClient(Arc<Worker>);

impl Client for NaiveClient {
    fn call(&self, call: SoakCall) -> BoxFuture<'static, Result<Delivered, BoxError>> {
        let run = Arc::clone(&self.0).run(call);
        Box::pin(async move { run.await.map(Delivered::from) })
    }
}

/// Builds the naive profile: one round-robin cursor per worker over shared breakers,
/// gates and cache.
///
/// # Errors
/// Unknown source or bad client settings.
pub fn build(env: &Env) -> Result<Built, BoxError> {
    let sc = &env.scenario;
    let names = env.sources();
    let mut sources = Vec::new();
    for name in &names {
        let q = sc.client.quota(name);
        sources.push(SourceState {
            name: name.clone(),
            client: Mutex::new(env.upstream.client(sc, name)?),
            rpm: q.rpm,
            tpm: q.tpm,
            breaker: Mutex::default(),
            gate: Mutex::default(),
        });
    }
    let inflight = Inflight::new(&names);
    let shared = Arc::new(Shared {
        sources,
        cache: sc.naive.cache.then(ResponseCache::default),
        threshold: sc.naive.breaker_threshold.max(2 * sc.global_concurrency()),
        cooldown: Duration::from_secs_f64(sc.naive.cooldown_s),
        backoff: Duration::from_secs_f64(sc.naive.backoff_s),
        attempts: sc.client.max_attempts,
        origin: env.recorder.clock().origin(),
        inflight: inflight.clone(),
        recorder: env.recorder.clone(),
    });
    let clients = (0..sc.workers)
        .map(|w| {
            Arc::new(NaiveClient(Arc::new(Worker {
                shared: Arc::clone(&shared),
                worker: w,
                cursor: AtomicUsize::new(0),
            }))) as Arc<dyn Client>
        })
        .collect();
    let books = Arc::clone(&shared);
    Ok(Built {
        clients,
        accounting: Box::new(move || {
            Box::pin(std::future::ready({
                let mut acc = Accounting::default();
                inflight.report(&mut acc);
                let probes = books.sources.iter().filter(|s| lock(&s.breaker).probing).count();
                acc.counters.insert("probes in flight".into(), probes as u64);
                acc
            }))
        }),
    })
}
