//! Test doubles: a scripted single upstream, a two-source router that respects holds,
//! and a test hold.

#![allow(dead_code, unreachable_pub)]

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pgw_core::{
    BoxError, CallHistory, CarriesHistory, Hold, HoldFuture, Outcome, QuotaExceeded, Recording, SourceId,
};
use tokio::time::Instant;
use tower::Service;

/// A request that carries its history in a field.
#[derive(Clone, Debug, Default)]
pub struct Req {
    pub id: u32,
    pub history: Option<CallHistory>,
}

impl Req {
    pub fn new(id: u32) -> Self {
        Self { id, history: None }
    }
}

impl CarriesHistory for Req {
    fn call_history(&self) -> Option<&CallHistory> {
        self.history.as_ref()
    }
    fn set_call_history(&mut self, history: CallHistory) {
        self.history = Some(history);
    }
}

/// What an upstream answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ans {
    Ok,
    RateLimited(Option<Duration>),
    /// A 429 whose `Retry-After` header has this raw value.
    RateLimitedHeader(&'static str),
    Transient,
    Dead,
    Rejected,
    Invalid,
}

/// The wall clock the `RateLimitedHeader` dates are read against: 07:27:50 GMT.
pub fn fixed_wall_clock() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_445_412_470)
}

/// The test classifier as a type (fn pointers trip up `Send` checks of spawned futures).
#[derive(Clone, Copy, Debug, Default)]
pub struct TestClassifier;

impl pgw_core::Classify<Ans, BoxError> for TestClassifier {
    fn classify(&self, r: &Result<Ans, BoxError>) -> Outcome {
        classify(r)
    }
}

pub fn classify(r: &Result<Ans, BoxError>) -> Outcome {
    match r {
        Ok(Ans::Ok) => Outcome::Success,
        Ok(Ans::RateLimited(retry_after)) => Outcome::RateLimited {
            retry_after: *retry_after,
        },
        Ok(Ans::RateLimitedHeader(v)) => Outcome::RateLimited {
            retry_after: pgw_core::retry_after::parse_retry_after(v, fixed_wall_clock()),
        },
        Ok(Ans::Dead) => Outcome::SourceDead,
        Ok(Ans::Rejected) => Outcome::Rejected,
        Ok(Ans::Invalid) => Outcome::Invalid,
        Ok(Ans::Transient) | Err(_) => Outcome::Transient,
    }
}

/// Counts attempts in flight; decremented when the attempt's future ends or is dropped.
pub struct InflightGuard(Arc<AtomicUsize>);

impl InflightGuard {
    pub fn new(c: &Arc<AtomicUsize>) -> Self {
        c.fetch_add(1, Ordering::SeqCst);
        Self(c.clone())
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

pub type BoxFut<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send>>;

type Script = Box<dyn FnMut(&Req) -> Result<Ans, BoxError> + Send>;

/// A single upstream answering from a script; records nothing into the history unless
/// [`named`](Upstream::named) names it.
#[derive(Clone)]
pub struct Upstream {
    script: Arc<Mutex<Script>>,
    pub sent: Arc<Mutex<Vec<(u32, Instant)>>>,
    pub inflight: Arc<AtomicUsize>,
    delay: Duration,
    /// Records each attempt into the call's history under this source, as a balancer
    /// below the retry layer does (the retry layer then knows the next attempt may go
    /// elsewhere).
    source: Option<SourceId>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Upstream")
    }
}

impl Upstream {
    /// Answers `answers` in order, then `Ok` forever.
    pub fn with(answers: Vec<Result<Ans, BoxError>>) -> Self {
        let mut queue: VecDeque<_> = answers.into();
        Self::from_fn(move |_| queue.pop_front().unwrap_or(Ok(Ans::Ok)))
    }

    pub fn always(ans: Ans) -> Self {
        Self::from_fn(move |_| Ok(ans.clone()))
    }

    pub fn from_fn(f: impl FnMut(&Req) -> Result<Ans, BoxError> + Send + 'static) -> Self {
        Self {
            script: Arc::new(Mutex::new(Box::new(f))),
            sent: Arc::default(),
            inflight: Arc::default(),
            delay: Duration::ZERO,
            source: None,
        }
    }

    /// Records its attempts as source `name`, as a balancer below would.
    pub fn named(mut self, name: &str) -> Self {
        self.source = Some(SourceId::from(name));
        self
    }

    /// Every attempt takes `delay`.
    pub fn delayed(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    pub fn sent_count(&self) -> usize {
        self.sent.lock().unwrap().len()
    }

    pub fn sent_times(&self) -> Vec<Instant> {
        self.sent.lock().unwrap().iter().map(|s| s.1).collect()
    }
}

impl Service<Req> for Upstream {
    type Response = Ans;
    type Error = BoxError;
    type Future = BoxFut<Ans>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Req) -> Self::Future {
        self.sent.lock().unwrap().push((req.id, Instant::now()));
        let answer = (self.script.lock().unwrap())(&req);
        if let (Some(source), Some(history)) = (&self.source, req.call_history()) {
            history.record(Some(source.clone()), classify(&answer));
        }
        let guard = InflightGuard::new(&self.inflight);
        let delay = self.delay;
        Box::pin(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            drop(guard);
            answer
        })
    }
}

/// Holds kept in memory: a source is not admitted until its instant.
#[derive(Clone, Default)]
pub struct TestHold {
    pub until: Arc<Mutex<HashMap<SourceId, Instant>>>,
    pub calls: Arc<Mutex<Vec<(SourceId, Duration)>>>,
    /// The holds placed through `hold_after_overload` (also in `calls`).
    pub overloaded: Arc<Mutex<Vec<SourceId>>>,
}

impl Hold for TestHold {
    fn hold(&self, source: &SourceId, duration: Duration) -> HoldFuture {
        self.calls.lock().unwrap().push((source.clone(), duration));
        let until = Instant::now() + duration;
        let mut map = self.until.lock().unwrap();
        let e = map.entry(source.clone()).or_insert(until);
        *e = (*e).max(until);
        Box::pin(std::future::ready(Ok(())))
    }

    fn hold_after_overload(&self, source: &SourceId, duration: Duration, _account_wide: bool) -> HoldFuture {
        self.overloaded.lock().unwrap().push(source.clone());
        self.hold(source, duration)
    }
}

/// A hold whose backend is down.
pub struct FailingHold;

impl Hold for FailingHold {
    fn hold(&self, _: &SourceId, _: Duration) -> HoldFuture {
        Box::pin(std::future::ready(Err("redis down".into())))
    }
}

/// A hold whose round trip never ends (to drop a call mid-hold).
pub struct StuckHold;

impl Hold for StuckHold {
    fn hold(&self, _: &SourceId, _: Duration) -> HoldFuture {
        Box::pin(std::future::pending())
    }
}

/// A small balancer over named sources, tried in order, that skips held sources,
/// answers `QuotaExceeded` when all are held, and records `(source, outcome)` in the
/// call's history like tower-health-p2c.
#[derive(Clone)]
pub struct Router {
    pub sources: Vec<(SourceId, Upstream)>,
    pub holds: TestHold,
    pub log: Arc<Mutex<Vec<(SourceId, Instant)>>>,
}

impl Router {
    pub fn new(sources: Vec<(&str, Upstream)>, holds: TestHold) -> Self {
        Self {
            sources: sources.into_iter().map(|(n, u)| (SourceId::from(n), u)).collect(),
            holds,
            log: Arc::default(),
        }
    }

    pub fn times_of(&self, source: &str) -> Vec<Instant> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, _)| s.as_str() == source)
            .map(|(_, t)| *t)
            .collect()
    }
}

impl Service<Req> for Router {
    type Response = Ans;
    type Error = BoxError;
    type Future = BoxFut<Ans>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let now = Instant::now();
        let holds = self.holds.until.lock().unwrap().clone();
        let admitted = self
            .sources
            .iter_mut()
            .find(|(s, _)| holds.get(s).is_none_or(|until| *until <= now));
        let Some((source, upstream)) = admitted else {
            let earliest = holds.values().min().copied().unwrap_or(now);
            let err = QuotaExceeded::new("hold", earliest - now);
            return Box::pin(std::future::ready(Err(err.into())));
        };
        let source = source.clone();
        self.log.lock().unwrap().push((source.clone(), now));
        let history = req.history.clone();
        let fut = upstream.call(req);
        Box::pin(async move {
            let result = fut.await;
            let outcome = classify(&result);
            // Like tower-health-p2c: a request without a history records a failure
            // into the history of the retry layer's recording (`HistoryMode::OnDemand`).
            let history = history.or_else(|| (!outcome.is_success()).then(Recording::adopt::<Req>).flatten());
            if let Some(h) = history {
                h.record(Some(source), outcome);
            }
            result
        })
    }
}
