//! End-to-end behaviour of the balancer over fake per-source services.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgw_core::{
    BoxError, CallHistory, CarriesHistory, CircuitOpen, NotAdmitted, Outcome, Paced, QuotaExceeded,
    Recording, SourceId,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::time::Instant;
use tower::util::BoxCloneSyncService;
use tower::{Service, ServiceExt, service_fn};
use tower_aimd::{AimdConfig, AimdLayer};
use tower_health_p2c::{
    BalanceConfig, HEALTH_CLASSES, HealthP2c, NoSources, NoneAdmitted, POOR_HEALTH_RATIO, Policy, SilentCut,
    Sources,
};
use tower_layer::Layer;

#[derive(Clone, Default)]
struct Req(Option<CallHistory>, bool);

impl CarriesHistory for Req {
    fn call_history(&self) -> Option<&CallHistory> {
        self.0.as_ref()
    }
    fn set_call_history(&mut self, h: CallHistory) {
        self.0 = Some(h);
    }
    fn mark_probe_copy(&mut self) {
        self.1 = true;
    }
    fn is_probe_copy(&self) -> bool {
        self.1
    }
}

type Svc = BoxCloneSyncService<Req, &'static str, BoxError>;

fn with_history() -> (Req, CallHistory) {
    let h = CallHistory::new();
    let mut r = Req::default();
    r.set_call_history(h.clone());
    (r, h)
}

/// A source that answers `answer` after `latency`, counting attempts.
fn fixed(answer: Result<&'static str, fn() -> BoxError>, latency: Duration, hits: Arc<AtomicUsize>) -> Svc {
    BoxCloneSyncService::new(service_fn(move |_: Req| {
        hits.fetch_add(1, Ordering::SeqCst);
        async move {
            tokio::time::sleep(latency).await;
            answer.map_err(|f| f())
        }
    }))
}

/// A source answering success with probability `p` (seeded), after 1 s.
fn flaky(p: f64, seed: u64, hits: Arc<AtomicUsize>) -> Svc {
    let rng = Arc::new(Mutex::new(SmallRng::seed_from_u64(seed)));
    BoxCloneSyncService::new(service_fn(move |_: Req| {
        hits.fetch_add(1, Ordering::SeqCst);
        let ok = rng.lock().unwrap().random_bool(p);
        async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if ok {
                Ok("ok")
            } else {
                Err::<_, BoxError>("watchdog cut".into())
            }
        }
    }))
}

fn balancer(sources: &Sources<Svc>, policy: Policy) -> HealthP2c<Svc> {
    HealthP2c::new(
        sources.clone(),
        BalanceConfig {
            policy,
            ..BalanceConfig::default()
        },
    )
    .unwrap()
    .with_seed(7)
}

/// Four callers, `calls` calls each; returns the share of attempts the 10% source got
/// after the first quarter of the run.
async fn share_of_bad_source(policy: Policy) -> f64 {
    let hits: Vec<Arc<AtomicUsize>> = (0..5).map(|_| Arc::default()).collect();
    let sources = Sources::new();
    for (i, h) in hits.iter().enumerate() {
        let p = if i == 4 { 0.1 } else { 0.95 };
        sources.insert(
            SourceId::from(format!("s{}", i + 1)),
            flaky(p, i as u64, Arc::clone(h)),
        );
    }
    let lb = balancer(&sources, policy);
    let run = |calls: usize| {
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let mut lb = lb.clone();
                tokio::spawn(async move {
                    for _ in 0..calls {
                        let _ = lb.ready().await.unwrap().call(Req::default()).await;
                    }
                })
            })
            .collect();
        async move {
            for t in tasks {
                t.await.unwrap();
            }
        }
    };
    run(100).await; // warm-up
    let before: Vec<usize> = hits.iter().map(|h| h.load(Ordering::SeqCst)).collect();
    run(300).await;
    let after: Vec<usize> = hits.iter().map(|h| h.load(Ordering::SeqCst)).collect();
    let delta: Vec<usize> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let total: usize = delta.iter().sum();
    println!("{policy}: attempts per source after warm-up {delta:?}");
    assert!(sources.views().iter().all(|v| v.inflight() == 0));
    #[allow(clippy::cast_precision_loss)]
    let share = delta[4] as f64 / total as f64;
    share
}

#[tokio::test(start_paused = true)]
async fn a_ten_percent_source_gets_under_five_percent_with_health_and_its_share_with_round_robin() {
    let health = share_of_bad_source(Policy::HealthAware).await;
    let rr = share_of_bad_source(Policy::RoundRobin).await;
    println!(
        "share of the 10% source: health_aware {:.1}%, round_robin {:.1}%",
        health * 100.0,
        rr * 100.0
    );
    assert!(health < 0.05, "health_aware gave it {health}");
    assert!((rr - 0.2).abs() < 0.03, "round_robin gave it {rr}");
}

#[tokio::test(start_paused = true)]
async fn outcomes_feed_health_and_history_and_errors_pass_up_unchanged() {
    let sources = Sources::new();
    sources.insert(
        "s1".into(),
        fixed(
            Err(|| Box::new(std::io::Error::other("reset"))),
            Duration::ZERO,
            Arc::default(),
        ),
    );
    let mut lb = balancer(&sources, Policy::HealthAware);
    let (req, history) = with_history();
    let err = lb.ready().await.unwrap().call(req).await.unwrap_err();
    assert!(
        err.downcast_ref::<std::io::Error>().is_some(),
        "inner error unchanged: {err}"
    );
    assert_eq!(history.attempts().len(), 1);
    assert_eq!(history.last().unwrap().outcome, Outcome::Transient);
    assert_eq!(history.last().unwrap().source.unwrap().as_str(), "s1");
    assert!((sources.view("s1").unwrap().health() - 0.8).abs() < 1e-12);
}

/// A source answering `name`, or failing while `fail` is set.
fn fails_while(name: &'static str, fail: Arc<AtomicBool>) -> Svc {
    BoxCloneSyncService::new(service_fn(move |_: Req| {
        let failing = fail.load(Ordering::SeqCst);
        async move {
            if failing {
                Err::<&str, BoxError>("fail".into())
            } else {
                Ok(name)
            }
        }
    }))
}

/// Sources named `ids` answering their own name, or failing while their flag is set.
fn named(ids: &[&'static str]) -> (Sources<Svc>, Vec<Arc<AtomicBool>>) {
    let sources: Sources<Svc> = Sources::new();
    let mut flags = Vec::new();
    for &id in ids {
        let fail = Arc::new(AtomicBool::new(false));
        sources.insert(id.into(), fails_while(id, Arc::clone(&fail)));
        flags.push(fail);
    }
    (sources, flags)
}

/// Lowers source `idx`'s health by `n` real failed attempts (round robin visits it).
async fn degrade(sources: &Sources<Svc>, flags: &[Arc<AtomicBool>], idx: usize, n: usize) {
    flags[idx].store(true, Ordering::SeqCst);
    let mut lb = balancer(sources, Policy::RoundRobin);
    for _ in 0..n * flags.len() {
        let _ = lb.ready().await.unwrap().call(Req::default()).await;
    }
    flags[idx].store(false, Ordering::SeqCst);
}

/// Seed 000 section 3.36 through the service: s1 (healthy) failed twice in this call.
#[tokio::test(start_paused = true)]
async fn in_call_deprioritization_end_to_end() {
    let prior = |h: &CallHistory| {
        h.record(Some("s1".into()), Outcome::Transient);
        h.record(Some("s1".into()), Outcome::RateLimited { retry_after: None });
    };

    // s1 healthy (0.8), s5 the 10% source: no credible alternative, s1 stays first.
    let (sources, flags) = named(&["s1", "s5"]);
    degrade(&sources, &flags, 1, 11).await;
    degrade(&sources, &flags, 0, 1).await;
    let (h1, h5) = (
        sources.view("s1").unwrap().health(),
        sources.view("s5").unwrap().health(),
    );
    assert!(h5 < 0.5 * h1 && h1 < 0.85, "{sources:?}");
    for seed in 0..20 {
        let mut lb = balancer(&sources, Policy::HealthAware).with_seed(seed);
        let (req, h) = with_history();
        prior(&h);
        assert_eq!(lb.ready().await.unwrap().call(req).await.unwrap(), "s1");
        assert_eq!(h.len(), 3, "the balancer recorded its attempt");
    }
    // With a credible s3, s1 goes to the tail.
    let (sources, flags) = named(&["s1", "s3", "s5"]);
    degrade(&sources, &flags, 2, 11).await;
    degrade(&sources, &flags, 0, 1).await;
    for seed in 0..20 {
        let mut lb = balancer(&sources, Policy::HealthAware).with_seed(seed);
        let (req, h) = with_history();
        prior(&h);
        assert_eq!(lb.ready().await.unwrap().call(req).await.unwrap(), "s3");
    }
    // Round robin deprioritizes unconditionally, wherever its cursor is.
    let (sources, flags) = named(&["s1", "s5"]);
    degrade(&sources, &flags, 1, 11).await;
    let mut lb = balancer(&sources, Policy::RoundRobin);
    for _ in 0..4 {
        let (req, h) = with_history();
        prior(&h);
        assert_eq!(lb.ready().await.unwrap().call(req).await.unwrap(), "s5");
    }
}

#[tokio::test(start_paused = true)]
async fn all_breaker_open_fails_at_once_with_the_earliest_retry_after() {
    let sources = Sources::new();
    for (id, secs) in [("s1", 30), ("s2", 5), ("s3", 12)] {
        let source = SourceId::from(id);
        sources.insert(
            id.into(),
            BoxCloneSyncService::new(service_fn(move |_: Req| {
                let e = CircuitOpen::new(Duration::from_secs(secs)).with_source(source.clone());
                async move { Err::<&str, BoxError>(Box::new(e)) }
            })),
        );
    }
    let mut lb = balancer(&sources, Policy::HealthAware);
    let (req, history) = with_history();
    let t0 = Instant::now();
    let err = lb.ready().await.unwrap().call(req).await.unwrap_err();
    assert_eq!(t0.elapsed(), Duration::ZERO, "fail fast");
    let open = err.downcast_ref::<CircuitOpen>().expect("circuit open");
    assert_eq!(open.retry_after(), Duration::from_secs(5));
    assert_eq!(open.source().unwrap().as_str(), "s2");
    assert!(history.is_empty(), "refusals are not attempts");
    assert!(
        sources
            .views()
            .iter()
            .all(|v| (v.health() - 1.0).abs() < 1e-12 && v.inflight() == 0)
    );
}

/// Source `s1`'s AIMD gate of two slots for good (successes do not raise it), shedding,
/// its releases signalled to `sources`' waiting calls.
fn two_slots(sources: &Sources<Svc>) -> AimdLayer {
    AimdLayer::new(AimdConfig {
        initial_limit: 2.0,
        max_concurrency: Some(2),
        ..AimdConfig::default()
    })
    .unwrap()
    .with_source("s1".into())
    .with_release_signal(sources.wake_signal())
    .shedding()
}

/// A call that waited and then dispatched no longer listens for releases: a slot
/// freed while its attempt runs wakes a call still waiting. Before, the dispatched
/// call's listener (armed again when it woke) stayed first in line and took the
/// release; the waiting call slept until its poll or `max_wait` (here 500 s).
#[tokio::test(start_paused = true)]
async fn a_release_wakes_a_waiting_call_not_one_already_dispatched() {
    let sources: Sources<Svc> = Sources::new();
    let gate = two_slots(&sources);
    // Attempts of 10 s, 15 s and then 20 s.
    let n = Arc::new(AtomicUsize::new(0));
    let inner = BoxCloneSyncService::new(service_fn(move |_: Req| {
        let i = n.fetch_add(1, Ordering::SeqCst) as u64;
        async move {
            tokio::time::sleep(Duration::from_secs([10, 15, 20, 10][i.min(3) as usize])).await;
            Ok::<_, BoxError>("done")
        }
    }));
    sources.insert("s1".into(), BoxCloneSyncService::new(gate.layer(inner)));
    let lb = HealthP2c::new(
        sources.clone(),
        BalanceConfig {
            paced_poll: Duration::from_secs(1000),
            max_wait: Duration::from_secs(500),
            ..BalanceConfig::default()
        },
    )
    .unwrap();
    let t0 = Instant::now();
    // Two busy calls: slots free at t = 10 s and t = 15 s.
    let busy: Vec<_> = (0..2)
        .map(|_| tokio::spawn(lb.clone().oneshot(Req::default())))
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    // `a` waits, is woken at 10 s and runs until 30 s.
    let a = tokio::spawn(lb.clone().oneshot(Req::default()));
    tokio::time::sleep(Duration::from_secs(10)).await;
    // `b` waits from 11 s: the slot freed at 15 s is its.
    let b = lb.clone().oneshot(Req::default()).await.unwrap();
    assert_eq!(b, "done");
    assert_eq!(
        t0.elapsed(),
        Duration::from_secs(25),
        "woken at 15 s, not by a poll"
    );
    a.await.unwrap().unwrap();
    for c in busy {
        c.await.unwrap().unwrap();
    }
}

/// A call refused only by a quota (nothing paced: a freed slot cannot admit it) does
/// not listen for releases: the wake-up of a slot freed goes to the call waiting for
/// one. `a` is refused by a quota for 100 s at a time (its wake-ups by timer); `b`
/// waits for one of the two slots, freed at 110 s. `a`'s listener, armed again at its
/// timer's wake-up, took that release's wake-up (first in line), ran a round it could
/// not use, and `b` slept until the next release at 400 s.
#[tokio::test(start_paused = true)]
async fn a_release_wakes_the_call_waiting_for_a_slot_not_one_refused_by_a_quota() {
    let sources: Sources<Svc> = Sources::new();
    let gate = two_slots(&sources);
    // The two busy calls hold a slot until 110 s and 400 s; `b` then runs 10 s.
    let n = Arc::new(AtomicUsize::new(0));
    let slots = BoxCloneSyncService::new(gate.layer(service_fn(move |_: Req| {
        let i = n.fetch_add(1, Ordering::SeqCst);
        async move {
            tokio::time::sleep(Duration::from_secs([110, 400, 10][i.min(2)])).await;
            Ok::<_, BoxError>("done")
        }
    })));
    // `a` (its history has a deadline) is refused by a quota before the slots.
    let svc = service_fn(move |req: Req| {
        let slots = slots.clone();
        async move {
            if req.0.as_ref().and_then(CallHistory::deadline).is_some() {
                return Err::<&str, BoxError>(Box::new(QuotaExceeded::new("rpm", Duration::from_secs(100))));
            }
            slots.oneshot(req).await
        }
    });
    sources.insert("s1".into(), BoxCloneSyncService::new(svc));
    let lb = HealthP2c::new(
        sources.clone(),
        BalanceConfig {
            // No polling: only the release signal wakes `b` in time.
            paced_poll: Duration::from_secs(1000),
            max_wait: Duration::from_secs(500),
            // Attempts of minutes here are the test's, not a silent source's.
            silent_after: None,
            ..BalanceConfig::default()
        },
    )
    .unwrap();
    let t0 = Instant::now();
    let busy: Vec<_> = (0..2)
        .map(|_| tokio::spawn(lb.clone().oneshot(Req::default())))
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let history = CallHistory::new();
    history.set_deadline(t0 + Duration::from_secs(10_000));
    let a = tokio::spawn(lb.clone().oneshot(Req(Some(history), false)));
    tokio::time::sleep(Duration::from_secs(104)).await;
    let b = lb.clone().oneshot(Req::default()).await.unwrap();
    assert_eq!(b, "done");
    assert_eq!(
        t0.elapsed(),
        Duration::from_secs(120),
        "b woken by the release at 110 s"
    );
    a.abort();
    for c in busy {
        c.await.unwrap().unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn all_paced_waits_for_a_release_and_consumes_nothing() {
    let sources: Sources<Svc> = Sources::new();
    let hits = Arc::new(AtomicUsize::new(0));
    let mut gates = Vec::new();
    for id in ["s1", "s2"] {
        let gate = AimdLayer::new(AimdConfig {
            initial_limit: 1.0,
            ..AimdConfig::default()
        })
        .unwrap()
        .with_source(id.into())
        .with_release_signal(sources.wake_signal())
        .shedding();
        gates.push(gate.handle());
        let inner = fixed(Ok("done"), Duration::from_secs(10), Arc::clone(&hits));
        sources.insert(id.into(), BoxCloneSyncService::new(gate.layer(inner)));
    }
    // No polling: only the release signal can wake the waiting call in time.
    let lb = HealthP2c::new(
        sources.clone(),
        BalanceConfig {
            paced_poll: Duration::from_secs(1000),
            max_wait: Duration::from_secs(500),
            ..BalanceConfig::default()
        },
    )
    .unwrap()
    .with_seed(5);
    // Occupy both slots.
    let busy: Vec<_> = (0..2)
        .map(|_| tokio::spawn(lb.clone().oneshot(Req::default())))
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        gates.iter().map(tower_aimd::AimdHandle::inflight).sum::<usize>(),
        2
    );

    let (req, history) = with_history();
    let t0 = Instant::now();
    let answer = lb.clone().oneshot(req).await.unwrap();
    assert_eq!(answer, "done");
    // The busy calls end at t=10s, the waiting call starts then and takes 10s more.
    assert_eq!(
        t0.elapsed(),
        Duration::from_secs(19),
        "waited for the release, not a poll or max_wait"
    );
    assert_eq!(history.len(), 1, "only the dispatched attempt is recorded");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        3,
        "refusals never reached the upstream"
    );
    for b in busy {
        b.await.unwrap().unwrap();
    }
    assert!(gates.iter().all(|g| g.inflight() == 0));
    assert!(sources.views().iter().all(|v| v.inflight() == 0));
}

#[tokio::test(start_paused = true)]
async fn quota_exceeded_waits_for_the_earliest_retry_after() {
    let until = Instant::now() + Duration::from_secs(3);
    let sources: Sources<Svc> = Sources::new();
    for (id, wait) in [("s1", 3), ("s2", 8)] {
        sources.insert(
            id.into(),
            BoxCloneSyncService::new(service_fn(move |_: Req| async move {
                let now = Instant::now();
                if now < until || wait > 3 {
                    let left =
                        (until.max(now + Duration::from_secs(wait - 3)) - now).max(Duration::from_secs(1));
                    let left = if wait > 3 { Duration::from_secs(wait) } else { left };
                    return Err::<&str, BoxError>(Box::new(QuotaExceeded::new("rpm", left)));
                }
                Ok("admitted")
            })),
        );
    }
    let mut lb = HealthP2c::new(
        sources.clone(),
        BalanceConfig {
            paced_poll: Duration::from_secs(100),
            ..BalanceConfig::default()
        },
    )
    .unwrap()
    .with_seed(3);
    let t0 = Instant::now();
    let (req, history) = with_history();
    assert_eq!(lb.ready().await.unwrap().call(req).await.unwrap(), "admitted");
    assert_eq!(
        t0.elapsed(),
        Duration::from_secs(3),
        "woke at the earliest retry_after"
    );
    assert_eq!(history.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_wait_is_bounded_by_max_wait_and_ends_in_a_clear_error() {
    let sources: Sources<Svc> = Sources::new();
    sources.insert(
        "s1".into(),
        BoxCloneSyncService::new(service_fn(|_: Req| async {
            Err::<&str, BoxError>(Box::new(Paced::new()))
        })),
    );
    let mut lb = HealthP2c::new(
        sources.clone(),
        BalanceConfig {
            max_wait: Duration::from_secs(2),
            ..BalanceConfig::default()
        },
    )
    .unwrap();
    let t0 = Instant::now();
    let err = lb.ready().await.unwrap().call(Req::default()).await.unwrap_err();
    assert_eq!(t0.elapsed(), Duration::from_secs(2));
    let none = err.downcast_ref::<NoneAdmitted>().expect("none admitted");
    assert_eq!(none.waited(), Duration::from_secs(2));
    assert!(err.to_string().contains("no source admitted"), "{err}");
    assert_eq!(
        NotAdmitted::of(&*err),
        Some(NotAdmitted::Paced),
        "still recognisably not admitted"
    );

    let empty: Sources<Svc> = Sources::new();
    let err = balancer(&empty, Policy::HealthAware)
        .oneshot(Req::default())
        .await
        .unwrap_err();
    assert!(err.is::<NoSources>());
}

#[tokio::test(start_paused = true)]
async fn dropped_and_panicking_calls_release_inflight() {
    let sources: Sources<Svc> = Sources::new();
    let panic_now = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&panic_now);
    sources.insert(
        "s1".into(),
        BoxCloneSyncService::new(service_fn(move |_: Req| {
            let panic = flag.load(Ordering::SeqCst);
            async move {
                assert!(!panic, "inner future panicked");
                std::future::pending::<Result<&str, BoxError>>().await
            }
        })),
    );
    let lb = balancer(&sources, Policy::HealthAware);
    let view = sources.view("s1").unwrap();
    let call = tokio::spawn(lb.clone().oneshot(Req::default()));
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(view.inflight(), 1);
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    assert_eq!(view.inflight(), 0, "drop");

    panic_now.store(true, Ordering::SeqCst);
    let join = tokio::spawn(lb.clone().oneshot(Req::default())).await;
    assert!(join.unwrap_err().is_panic());
    assert_eq!(view.inflight(), 0, "panic");
    assert!((view.health() - 1.0).abs() < 1e-12, "no outcome, no sample");
}

#[tokio::test(start_paused = true)]
async fn sources_change_at_runtime_and_keep_health() {
    let sources: Sources<Svc> = Sources::new();
    sources.insert(
        "s1".into(),
        fixed(Err(|| "fail".into()), Duration::ZERO, Arc::default()),
    );
    let mut lb = balancer(&sources, Policy::HealthAware);
    let _ = lb.ready().await.unwrap().call(Req::default()).await;
    let s1 = sources.view("s1").unwrap();
    assert!((s1.health() - 0.8).abs() < 1e-12);

    sources.insert("s2".into(), fixed(Ok("s2"), Duration::ZERO, Arc::default()));
    sources.remove("s1");
    assert_eq!(
        lb.ready().await.unwrap().call(Req::default()).await.unwrap(),
        "s2",
        "the balancer sees the change"
    );
    sources.insert("s3".into(), fixed(Ok("s3"), Duration::ZERO, Arc::default()));
    let s2 = sources.view("s2").unwrap();
    assert!((s2.health() - 1.0).abs() < 1e-12);
    assert_eq!(sources.views().len(), 2);
    // s1's view is still the old state; re-adding s1 starts fresh.
    assert!((s1.health() - 0.8).abs() < 1e-12);

    // A source that stays keeps its health across changes, and the balancer keeps
    // feeding the same state after it picked up the new set.
    let s2_fails = Arc::new(AtomicBool::new(true));
    sources.insert("s2".into(), fails_while("s2", Arc::clone(&s2_fails)));
    sources.remove("s3");
    let _ = lb.ready().await.unwrap().call(Req::default()).await;
    assert!(
        (s2.health() - 0.8).abs() < 1e-12,
        "the view taken before the change sees it"
    );
    sources.insert("s4".into(), fixed(Ok("s4"), Duration::ZERO, Arc::default()));
    let fresh = sources.view("s2").unwrap();
    assert!(
        (fresh.health() - 0.8).abs() < 1e-12,
        "replacing the service kept the health"
    );
}

#[tokio::test(start_paused = true)]
async fn mixed_refusals_wait_for_the_earliest_wake_up_instead_of_failing_fast() {
    let t_open = Instant::now() + Duration::from_secs(4);
    let sources: Sources<Svc> = Sources::new();
    sources.insert(
        "s1".into(),
        BoxCloneSyncService::new(service_fn(|_: Req| async {
            Err::<&str, BoxError>(Box::new(CircuitOpen::new(Duration::from_secs(2))))
        })),
    );
    sources.insert(
        "s2".into(),
        BoxCloneSyncService::new(service_fn(move |_: Req| async move {
            let now = Instant::now();
            if now < t_open {
                return Err::<&str, BoxError>(Box::new(QuotaExceeded::new("rpm", t_open - now)));
            }
            Ok("s2")
        })),
    );
    let mut lb = balancer(&sources, Policy::HealthAware);
    let (req, history) = with_history();
    let t0 = Instant::now();
    assert_eq!(lb.ready().await.unwrap().call(req).await.unwrap(), "s2");
    assert_eq!(t0.elapsed(), Duration::from_secs(4));
    assert_eq!(history.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn least_inflight_avoids_the_busy_source_and_the_layer_builds_a_balancer() {
    let sources: Sources<Svc> = Sources::new();
    sources.insert(
        "slow".into(),
        fixed(Ok("slow"), Duration::from_secs(60), Arc::default()),
    );
    sources.insert("fast".into(), fixed(Ok("fast"), Duration::ZERO, Arc::default()));
    let layer = tower_health_p2c::HealthP2cLayer::new(BalanceConfig {
        policy: Policy::LeastInflight,
        ..BalanceConfig::default()
    })
    .unwrap()
    .with_seed(9);
    let lb = tower::ServiceBuilder::new().layer(layer).service(sources.clone());
    // Occupy "slow" (or "fast", whichever comes first; "fast" ends at once).
    let mut pending = Vec::new();
    while sources.view("slow").unwrap().inflight() == 0 {
        pending.push(tokio::spawn(lb.clone().oneshot(Req::default())));
        tokio::task::yield_now().await;
    }
    for _ in 0..10 {
        assert_eq!(lb.clone().oneshot(Req::default()).await.unwrap(), "fast");
    }
    assert_eq!(sources.view("slow").unwrap().inflight(), 1);
}

/// `choices` reaches the pick: with every source compared, six calls left in flight
/// over six idle sources land one per source (the busy ones score lower); with two
/// drawn at random, some seeds put two on one source while another stays idle.
#[tokio::test(start_paused = true)]
async fn every_source_compared_spreads_calls_in_flight_one_per_source() {
    async fn spread(choices: usize, seed: u64) -> Vec<usize> {
        let hits: Vec<Arc<AtomicUsize>> = (0..6).map(|_| Arc::default()).collect();
        let sources: Sources<Svc> = Sources::new();
        for (i, h) in hits.iter().enumerate() {
            sources.insert(
                SourceId::from(format!("s{i}")),
                fixed(Ok("late"), Duration::from_secs(3600), Arc::clone(h)),
            );
        }
        let lb = HealthP2c::new(
            sources,
            BalanceConfig {
                choices,
                ..BalanceConfig::default()
            },
        )
        .unwrap()
        .with_seed(seed);
        let mut calls = Vec::new();
        for _ in 0..6 {
            calls.push(tokio::spawn(lb.clone().oneshot(Req::default())));
            // Dispatched before the next call picks.
            tokio::task::yield_now().await;
        }
        let spread = hits.iter().map(|h| h.load(Ordering::SeqCst)).collect();
        for c in calls {
            c.abort();
        }
        spread
    }
    let mut doubled = 0;
    for seed in 0..20 {
        assert_eq!(
            spread(tower_health_p2c::CHOICES_ALL, seed).await,
            vec![1; 6],
            "seed {seed}"
        );
        let two = spread(2, seed).await;
        assert_eq!(two.iter().sum::<usize>(), 6, "seed {seed}: {two:?}");
        doubled += usize::from(two.contains(&0));
    }
    assert!(doubled > 0, "two random draws never doubled up over 20 seeds");
}

#[test]
fn bad_config_is_an_error_naming_the_field() {
    let err = HealthP2c::new(
        Sources::<Svc>::new(),
        BalanceConfig {
            paced_poll: Duration::ZERO,
            ..BalanceConfig::default()
        },
    )
    .unwrap_err();
    assert_eq!(err.field(), "paced_poll");
    assert!(err.to_string().contains("paced_poll"));
}

/// A source refusing with `retry_after = 0` while the other is paced: the call re-checks
/// every few milliseconds, it does not spin (with the paused clock, a spin would never
/// let time reach the moment the quota frees).
#[tokio::test(start_paused = true)]
async fn a_zero_retry_after_does_not_make_the_call_spin() {
    let free_at = Instant::now() + Duration::from_secs(1);
    let refusals = Arc::new(AtomicUsize::new(0));
    let sources: Sources<Svc> = Sources::new();
    sources.insert(
        "s1".into(),
        BoxCloneSyncService::new(service_fn(|_: Req| async {
            Err::<&str, BoxError>(Box::new(Paced::new()))
        })),
    );
    let counted = Arc::clone(&refusals);
    sources.insert(
        "s2".into(),
        BoxCloneSyncService::new(service_fn(move |_: Req| {
            let counted = Arc::clone(&counted);
            async move {
                if Instant::now() < free_at {
                    let n = counted.fetch_add(1, Ordering::SeqCst);
                    assert!(n < 10_000, "the balancer spins on retry_after = 0");
                    return Err::<&str, BoxError>(Box::new(QuotaExceeded::new("rpm", Duration::ZERO)));
                }
                Ok("s2")
            }
        })),
    );
    let mut lb = HealthP2c::new(
        sources.clone(),
        BalanceConfig {
            paced_poll: Duration::from_secs(1000),
            ..BalanceConfig::default()
        },
    )
    .unwrap()
    .with_seed(4);
    let t0 = Instant::now();
    assert_eq!(
        lb.ready().await.unwrap().call(Req::default()).await.unwrap(),
        "s2"
    );
    assert!(t0.elapsed() >= Duration::from_secs(1));
    let n = refusals.load(Ordering::SeqCst);
    assert!(n <= 1 + 1000 / 10 + 1, "one re-check per 10 ms at most: {n}");
}

/// No source paced and the earliest quota frees after `max_wait`: fail at once, and
/// say the earliest quota (not whichever refused last) so a retry layer above waits
/// for the right one.
#[tokio::test(start_paused = true)]
async fn quota_past_max_wait_fails_at_once_with_the_earliest_quota() {
    let sources: Sources<Svc> = Sources::new();
    for (id, secs) in [("s1", 60), ("s2", 200), ("s3", 90)] {
        sources.insert(
            id.into(),
            BoxCloneSyncService::new(service_fn(move |_: Req| async move {
                Err::<&str, BoxError>(Box::new(
                    QuotaExceeded::new("hold", Duration::from_secs(secs)).with_scope(id),
                ))
            })),
        );
    }
    for seed in 0..12 {
        let mut lb = HealthP2c::new(
            sources.clone(),
            BalanceConfig {
                max_wait: Duration::from_secs(30),
                ..BalanceConfig::default()
            },
        )
        .unwrap()
        .with_seed(seed);
        let (req, history) = with_history();
        let t0 = Instant::now();
        let err = lb.ready().await.unwrap().call(req).await.unwrap_err();
        assert_eq!(t0.elapsed(), Duration::ZERO, "seed {seed}: no sleep to max_wait");
        assert!(err.is::<NoneAdmitted>(), "{err}");
        assert_eq!(
            NotAdmitted::of(&*err),
            Some(NotAdmitted::QuotaExceeded(Duration::from_secs(60))),
            "seed {seed}: the earliest quota"
        );
        assert!(history.is_empty());
    }
}

/// The call's deadline, carried in its history, bounds the wait like `max_wait`: a
/// source over quota for 10 s fails a call due in 3 s at once (no source can admit in
/// time), is waited for by a call due in 20 s, and a paced source is waited for until
/// the deadline, not `max_wait`.
#[tokio::test(start_paused = true)]
async fn the_calls_deadline_in_its_history_bounds_the_wait() {
    let t0 = Instant::now();
    let sources: Sources<Svc> = Sources::new();
    let hits = Arc::new(AtomicUsize::new(0));
    sources.insert(
        "s1".into(),
        over_quota_until("s1", t0 + Duration::from_secs(10), hits.clone()),
    );
    let mut lb = balancer(&sources, Policy::HealthAware);

    let (req, history) = with_history();
    history.set_deadline(t0 + Duration::from_secs(3));
    let err = lb.ready().await.unwrap().call(req).await.unwrap_err();
    assert_eq!(t0.elapsed(), Duration::ZERO, "no sleep until the deadline: {err}");
    assert!(err.is::<NoneAdmitted>(), "{err}");
    assert_eq!(
        NotAdmitted::of(&*err),
        Some(NotAdmitted::QuotaExceeded(Duration::from_secs(10))),
        "says when a source admits again"
    );

    let (req, history) = with_history();
    history.set_deadline(t0 + Duration::from_secs(20));
    assert_eq!(lb.ready().await.unwrap().call(req).await.unwrap(), "s1");
    assert_eq!(
        t0.elapsed(),
        Duration::from_secs(10),
        "admitted once the quota freed"
    );
    assert_eq!(hits.load(Ordering::SeqCst), 1);

    let paced: Sources<Svc> = Sources::new();
    paced.insert(
        "p".into(),
        BoxCloneSyncService::new(service_fn(|_: Req| async {
            Err::<&str, BoxError>(Box::new(Paced::new()))
        })),
    );
    let mut lb = balancer(&paced, Policy::HealthAware);
    let (req, history) = with_history();
    let t1 = Instant::now();
    history.set_deadline(t1 + Duration::from_secs(2));
    let err = lb.ready().await.unwrap().call(req).await.unwrap_err();
    assert!(err.is::<NoneAdmitted>(), "{err}");
    assert_eq!(
        t1.elapsed(),
        Duration::from_secs(2),
        "paced: waited until the deadline"
    );
}

/// Huge durations (a `max_wait` meaning "forever", a garbage `retry_after`) do not
/// overflow the clock.
#[tokio::test(start_paused = true)]
async fn huge_durations_do_not_panic() {
    let free_at = Instant::now() + Duration::from_secs(2);
    let sources: Sources<Svc> = Sources::new();
    sources.insert(
        "s1".into(),
        BoxCloneSyncService::new(service_fn(|_: Req| async {
            Err::<&str, BoxError>(Box::new(QuotaExceeded::new("hold", Duration::MAX)))
        })),
    );
    sources.insert(
        "s2".into(),
        BoxCloneSyncService::new(service_fn(move |_: Req| async move {
            let now = Instant::now();
            if now < free_at {
                return Err::<&str, BoxError>(Box::new(QuotaExceeded::new("rpm", free_at - now)));
            }
            Ok("s2")
        })),
    );
    let mut lb = HealthP2c::new(
        sources.clone(),
        BalanceConfig {
            max_wait: Duration::MAX,
            ..BalanceConfig::default()
        },
    )
    .unwrap()
    .with_seed(2);
    let t0 = Instant::now();
    assert_eq!(
        lb.ready().await.unwrap().call(Req::default()).await.unwrap(),
        "s2"
    );
    assert_eq!(t0.elapsed(), Duration::from_secs(2));
}

/// A source over quota until `until` (answering `QuotaExceeded` with the time left),
/// then answering its name.
fn over_quota_until(name: &'static str, until: Instant, hits: Arc<AtomicUsize>) -> Svc {
    BoxCloneSyncService::new(service_fn(move |_: Req| {
        let now = Instant::now();
        let result: Result<&'static str, BoxError> = if now < until {
            Err(Box::new(QuotaExceeded::new("rpm", until - now)))
        } else {
            hits.fetch_add(1, Ordering::SeqCst);
            Ok(name)
        };
        async move { result }
    }))
}

/// Calls waiting for one source's quota end are woken oldest first, by when their call
/// first waited (noted in its history, by a layer above or here), not by when they
/// went to sleep; the first to sleep, alone then, wakes at the end itself.
#[tokio::test(start_paused = true)]
async fn calls_waiting_for_one_end_wake_oldest_first() {
    // A start 100 s back for the old call's wait (no Instant before the clock's own).
    let long_ago = Instant::now();
    tokio::time::sleep(Duration::from_secs(100)).await;
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs(20);
    let sources = Sources::new();
    sources.insert(
        "s".into(),
        over_quota_until("s", end, Arc::new(AtomicUsize::new(0))),
    );
    let spawn_call = |after: u64, waiting_since: Option<Instant>| {
        let mut lb = balancer(&sources, Policy::HealthAware);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(after)).await;
            let (req, h) = with_history();
            if let Some(at) = waiting_since {
                // A layer above had it waiting since then (the retry layer notes it).
                let _ = h.waiting_since(at);
            }
            lb.ready().await.unwrap().call(req).await.unwrap();
            Instant::now()
        })
    };
    let first = spawn_call(0, None);
    let young = spawn_call(1, None);
    let old = spawn_call(2, Some(long_ago));
    let (first, young, old) = (first.await.unwrap(), young.await.unwrap(), old.await.unwrap());
    assert_eq!(first, end, "alone when it went to sleep");
    let last = end + pgw_core::fair::ORDER_SPAN;
    assert!(
        end < old && old < young && young <= last,
        "{:?} {:?}",
        old - end,
        young - end
    );

    // A waiting call dropped is no longer counted: a later call waiting alone wakes at
    // its end exactly.
    let t1 = Instant::now();
    let end = t1 + Duration::from_secs(20);
    sources.insert(
        "s".into(),
        over_quota_until("s", end, Arc::new(AtomicUsize::new(0))),
    );
    let dropped = spawn_call(0, None);
    tokio::time::sleep(Duration::from_secs(1)).await;
    dropped.abort();
    assert!(dropped.await.unwrap_err().is_cancelled());
    let alone = spawn_call(0, Some(long_ago)).await.unwrap();
    assert_eq!(alone, end, "the dropped call's count went with it");
}

/// A breaker's end is not spread: it admits one probe, whoever asks first, so the
/// calls waiting for it (beside each other) wake at the end itself.
#[tokio::test(start_paused = true)]
async fn calls_waiting_for_a_breakers_end_wake_at_it() {
    let t0 = Instant::now();
    let (closes, refills) = (t0 + Duration::from_secs(10), t0 + Duration::from_secs(30));
    let sources = Sources::new();
    sources.insert(
        "open".into(),
        BoxCloneSyncService::new(service_fn(move |_: Req| {
            let now = Instant::now();
            let r: Result<&'static str, BoxError> = if now < closes {
                Err(Box::new(CircuitOpen::new(closes - now)))
            } else {
                Ok("open")
            };
            async move { r }
        })),
    );
    sources.insert(
        "quota".into(),
        over_quota_until("quota", refills, Arc::new(AtomicUsize::new(0))),
    );
    let calls: Vec<_> = (0..2)
        .map(|i| {
            let mut lb = balancer(&sources, Policy::HealthAware).with_seed(i);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_secs(i)).await;
                let (req, _h) = with_history();
                let got = lb.ready().await.unwrap().call(req).await.unwrap();
                (got, Instant::now())
            })
        })
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap(), ("open", closes));
    }
}

/// H5 with H7: a source that failed twice in this call is not dispatched while a
/// credible source is only briefly over quota; it is when the wait would be too long.
#[tokio::test(start_paused = true)]
async fn a_twice_failed_source_waits_behind_a_briefly_refused_credible_one() {
    for (quota_for, want, want_wait) in [
        (Duration::from_secs(5), "b", Duration::from_secs(5)),
        (Duration::from_secs(100), "a", Duration::ZERO),
    ] {
        let a_hits = Arc::new(AtomicUsize::new(0));
        let b_hits = Arc::new(AtomicUsize::new(0));
        let start = Instant::now();
        let sources = Sources::new();
        sources.insert("a".into(), fixed(Ok("a"), Duration::ZERO, Arc::clone(&a_hits)));
        sources.insert(
            "b".into(),
            over_quota_until("b", start + quota_for, Arc::clone(&b_hits)),
        );
        for seed in 0..8 {
            let mut lb = balancer(&sources, Policy::HealthAware).with_seed(seed);
            let (req, h) = with_history();
            h.record(Some("a".into()), Outcome::Transient);
            h.record(Some("a".into()), Outcome::Transient);
            let t0 = Instant::now();
            let got = lb.ready().await.unwrap().call(req).await.unwrap();
            assert_eq!(got, want, "quota for {quota_for:?}, seed {seed}");
            if seed == 0 {
                assert_eq!(t0.elapsed(), want_wait, "quota for {quota_for:?}");
            }
        }
        if want == "b" {
            assert_eq!(
                a_hits.load(Ordering::SeqCst),
                0,
                "the twice-failed source got nothing"
            );
        }
    }
}

/// H5's credible-alternative rule on a first attempt: while a healthy source is only
/// over quota for a moment, a source with less than half its health is not spent.
#[tokio::test(start_paused = true)]
async fn a_poor_source_waits_behind_a_briefly_refused_healthy_one() {
    let (sources, flags) = named(&["good", "poor"]);
    degrade(&sources, &flags, 1, 8).await; // poor: 0.8^8 = 0.17
    assert!(sources.view("poor").unwrap().health() < 0.5 * sources.view("good").unwrap().health());
    // Replace `good` by a service over quota for 3 s (its health stays).
    let good_hits = Arc::new(AtomicUsize::new(0));
    let until = Instant::now() + Duration::from_secs(3);
    sources.insert(
        "good".into(),
        over_quota_until("good", until, Arc::clone(&good_hits)),
    );
    let mut served = Vec::new();
    for seed in 0..6 {
        let mut lb = balancer(&sources, Policy::HealthAware).with_seed(seed);
        let t0 = Instant::now();
        let got = lb.ready().await.unwrap().call(Req::default()).await.unwrap();
        served.push((got, t0.elapsed()));
    }
    // Whichever the P2C draw put first, no call went to `poor` while `good` was only
    // briefly refused: the first waited for the quota, the rest found it open.
    assert!(served.iter().all(|(s, _)| *s == "good"), "{served:?}");
    assert_eq!(served[0].1, Duration::from_secs(3), "{served:?}");
}

/// Over quota until `first`, then again (a second hold) until `second`: each refusal
/// says when the hold it meets ends.
fn held_twice(name: &'static str, first: Instant, second: Instant) -> Svc {
    BoxCloneSyncService::new(service_fn(move |_: Req| {
        let now = Instant::now();
        let result: Result<&'static str, BoxError> = if now < first {
            Err(Box::new(QuotaExceeded::new("rpm", first - now)))
        } else if now < second {
            Err(Box::new(QuotaExceeded::new("rpm", second - now)))
        } else {
            Ok(name)
        };
        async move { result }
    }))
}

/// `POOR_HEALTH_RATIO`: when the wait for a credible source over quota ends (its next
/// hold ends past `max_wait` from the call's first wait), the sources held back go
/// next, but not one with under a quarter of its health while that quota ends within
/// `max_wait`: the call ends with the quota's refusal (a retry layer above waits for
/// its end). One below the credible bar but above the poor one is released to, and so
/// is a poor one when the quota ends past `max_wait` (an account out of credit).
#[tokio::test(start_paused = true)]
async fn a_poor_source_is_no_fallback_for_a_quota_that_ends() {
    let max_wait = Duration::from_secs(10);
    // (failures of `weak`, the second hold's length, whether `weak` answers)
    for (failures, second_hold, want_weak) in [
        (8, Duration::from_secs(8), false),
        (4, Duration::from_secs(8), true),
        (8, Duration::from_secs(100), true),
    ] {
        let (sources, flags) = named(&["good", "weak"]);
        degrade(&sources, &flags, 1, failures).await; // weak: 0.8^8 = 0.17 or 0.8^4 = 0.41
        let (good, weak) = (
            sources.view("good").unwrap().health(),
            sources.view("weak").unwrap().health(),
        );
        assert!(weak < 0.5 * good, "not credible: {weak} vs {good}");
        assert_eq!(weak < POOR_HEALTH_RATIO * good, failures == 8, "{weak} vs {good}");
        // `good`: held 8 s (within `max_wait`: the call waits), then again.
        let t0 = Instant::now();
        let first = t0 + Duration::from_secs(8);
        sources.insert("good".into(), held_twice("good", first, first + second_hold));
        let mut lb = HealthP2c::new(
            sources.clone(),
            BalanceConfig {
                max_wait,
                ..BalanceConfig::default()
            },
        )
        .unwrap();
        let got = lb.ready().await.unwrap().call(Req::default()).await;
        let case = format!("weak {weak:.2}, second hold {second_hold:?}");
        assert_eq!(
            t0.elapsed(),
            Duration::from_secs(8),
            "waited for the first hold: {case}"
        );
        if want_weak {
            assert_eq!(got.unwrap(), "weak", "{case}");
        } else {
            let err = got.unwrap_err();
            assert!(err.is::<NoneAdmitted>(), "{case}: {err}");
            match NotAdmitted::of(&*err) {
                Some(NotAdmitted::QuotaExceeded(d)) => assert_eq!(d, second_hold, "{case}"),
                other => panic!("{case}: {other:?}"),
            }
        }
    }
}

/// The same with a call due before the credible source's quota ends: that quota is
/// out of the call's reach, so it does not make the poor source "no fallback". Before,
/// the quota was weighed against `max_wait` alone, the poor source was dropped, and the
/// call failed at once with the quota's refusal (which the retry layer above could not
/// wait out either).
#[tokio::test(start_paused = true)]
async fn a_quota_past_the_calls_deadline_leaves_the_poor_source_its_attempt() {
    let (sources, flags) = named(&["good", "weak"]);
    degrade(&sources, &flags, 1, 8).await; // weak: 0.8^8 = 0.17, poor
    let t0 = Instant::now();
    let first = t0 + Duration::from_secs(8);
    sources.insert(
        "good".into(),
        held_twice("good", first, first + Duration::from_secs(8)),
    );
    let mut lb = HealthP2c::new(
        sources.clone(),
        BalanceConfig {
            max_wait: Duration::from_secs(10),
            ..BalanceConfig::default()
        },
    )
    .unwrap();
    let (req, history) = with_history();
    history.set_deadline(t0 + Duration::from_secs(4));
    let got = lb.ready().await.unwrap().call(req).await;
    assert_eq!(
        got.unwrap(),
        "weak",
        "the quota ends past the deadline: weak is tried"
    );
    assert_eq!(t0.elapsed(), Duration::ZERO);
}

/// When the wait for a credible source ends, the release keeps the sources already
/// offered in the round where they were: a poor one already refused (here `a`, its
/// breaker open) was dropped from the order, shifting the next source under the
/// round's position, and that source (`b`, above the poor bar) was never offered: the
/// call failed `NoneAdmitted` while `b` would have answered.
#[tokio::test(start_paused = true)]
async fn a_poor_source_already_refused_does_not_hide_the_next_one_at_release() {
    // Whatever the draw: the call is answered (by `b`, or by `c` when the draw offered
    // it first, before any refusal), never refused while `b` would answer. A fresh
    // pool per seed: `b`'s success would make it credible for the next call.
    let mut released_after_a = 0;
    for seed in 0..32 {
        let (sources, flags) = named(&["a", "q", "b", "c"]);
        // `a` and `c` fail 7 times (0.8^7 = 0.21: poor), `b` the last 4 (0.41: not
        // credible, not poor), `q` never.
        let mut rr = balancer(&sources, Policy::RoundRobin);
        for (failing, rounds) in [(&[0, 3][..], 3), (&[0, 2, 3][..], 4)] {
            for &i in failing {
                flags[i].store(true, Ordering::SeqCst);
            }
            for _ in 0..rounds * flags.len() {
                let _ = rr.ready().await.unwrap().call(Req::default()).await;
            }
        }
        for f in &flags {
            f.store(false, Ordering::SeqCst);
        }
        let health = |n: &str| sources.view(n).unwrap().health();
        assert!(health("a") < POOR_HEALTH_RATIO * health("q"));
        assert!(health("b") < 0.5 * health("q") && health("b") >= POOR_HEALTH_RATIO * health("q"));
        let t0 = Instant::now();
        let a_hits = Arc::new(AtomicUsize::new(0));
        let hits = Arc::clone(&a_hits);
        sources.insert(
            "a".into(),
            BoxCloneSyncService::new(service_fn(move |_: Req| {
                hits.fetch_add(1, Ordering::SeqCst);
                async { Err::<&str, BoxError>(Box::new(CircuitOpen::new(Duration::from_secs(60)))) }
            })),
        );
        // `q` over quota for 20 s: within `max_wait` (30 s), past the call's deadline.
        sources.insert(
            "q".into(),
            over_quota_until("q", t0 + Duration::from_secs(20), Arc::new(AtomicUsize::new(0))),
        );
        let mut lb = balancer(&sources, Policy::HealthAware).with_seed(seed);
        let (req, history) = with_history();
        history.set_deadline(t0 + Duration::from_secs(5));
        match lb.ready().await.unwrap().call(req).await {
            Ok("b") => released_after_a += a_hits.load(Ordering::SeqCst),
            Ok(other) => assert_eq!(other, "c", "seed {seed}"),
            Err(e) => panic!("seed {seed}: {e}"),
        }
        assert_eq!(t0.elapsed(), Duration::ZERO, "nothing waited past the deadline");
    }
    assert!(
        released_after_a > 0,
        "no draw offered `a` first: the case is not exercised"
    );
}

/// Failing until `fail` is cleared, counting the calls and, of them, the probe copies
/// the balancer sent off a caller's path; like a breaker below, it tells the balancer
/// the source recovered when a probe copy succeeds (`SourceHealth::recovered`).
fn counted(
    name: &'static str,
    fail: Arc<AtomicBool>,
    (calls, probes): (Arc<AtomicUsize>, Arc<AtomicUsize>),
    view: Arc<std::sync::OnceLock<tower_health_p2c::SourceHealth>>,
) -> Svc {
    BoxCloneSyncService::new(service_fn(move |req: Req| {
        calls.fetch_add(1, Ordering::SeqCst);
        let probe = req.is_probe_copy();
        if probe {
            probes.fetch_add(1, Ordering::SeqCst);
        }
        let failing = fail.load(Ordering::SeqCst);
        if probe && !failing {
            view.get().expect("set").recovered();
        }
        async move {
            if failing {
                Err::<&str, BoxError>("fail".into())
            } else {
                Ok(name)
            }
        }
    }))
}

/// A source that failed until no call went there any more (its health far under the
/// healthy one's, which always admits) gets a copy of a passing call's request once
/// per `probe_every` while it stays quiet; when the copy succeeds, the gate below says
/// it recovered and the calls go back. Without it, a source back from an outage in a
/// pool with room to spare was never asked again (nor its breaker's half-open probe
/// sent).
#[tokio::test(start_paused = true)]
async fn an_abandoned_source_is_probed_and_gets_calls_back_when_it_answers() {
    let fail = Arc::new(AtomicBool::new(true));
    let (calls, probes) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let sources = Sources::new();
    sources.insert(
        "good".into(),
        fixed(Ok("good"), Duration::ZERO, Arc::new(AtomicUsize::new(0))),
    );
    let view = Arc::new(std::sync::OnceLock::new());
    sources.insert(
        "back".into(),
        counted(
            "back",
            Arc::clone(&fail),
            (Arc::clone(&calls), Arc::clone(&probes)),
            Arc::clone(&view),
        ),
    );
    let _ = view.set(sources.view("back").unwrap());
    // Round robin visits `back` while it fails: its health falls far under `good`'s.
    let mut rr = balancer(&sources, Policy::RoundRobin);
    for _ in 0..30 {
        let _ = rr.ready().await.unwrap().call(Req::default()).await;
    }
    assert!(sources.view("back").unwrap().health() < 0.1);
    let mut lb = balancer(&sources, Policy::HealthAware);
    let call_each_second = |lb: &mut HealthP2c<Svc>, secs: u64| {
        let mut lb = lb.clone();
        async move {
            let mut served = Vec::new();
            for _ in 0..secs {
                served.push(lb.ready().await.unwrap().call(Req::default()).await.unwrap());
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            served
        }
    };
    // Still failing: one copy per `probe_every` (10 s) of quiet reaches it (looked for
    // every 2.5 s: one each 10-12.5 s), and no call.
    let before = calls.load(Ordering::SeqCst);
    let served = call_each_second(&mut lb, 60).await;
    assert!(served.iter().all(|s| *s == "good"), "{served:?}");
    let probed = probes.load(Ordering::SeqCst);
    assert_eq!(calls.load(Ordering::SeqCst) - before, probed, "only probe copies");
    assert!((4..=6).contains(&probed), "one per 10-12.5 s over 60 s: {probed}");
    // Back: the next probe succeeds within `probe_every`, and calls go there again.
    fail.store(false, Ordering::SeqCst);
    let served = call_each_second(&mut lb, 30).await;
    let first_back = served.iter().position(|s| *s == "back").expect("calls go back");
    assert!(first_back <= 13, "back within 12.5 s of healing: {first_back} s");
    assert!(sources.view("back").unwrap().health() > 0.9);
}

/// A source a gate below saw recover (`SourceHealth::recovered`) is healthy again at
/// once: it no longer waits behind a healthier source that is only briefly refused
/// (the call before `recovered` waited, see the test above).
#[tokio::test(start_paused = true)]
async fn a_recovered_source_is_dispatched_at_once() {
    let (sources, flags) = named(&["good", "back"]);
    degrade(&sources, &flags, 1, 8).await; // back: 0.8^8 = 0.17
    let back = sources.view("back").unwrap();
    assert!(back.health() < 0.5 * sources.view("good").unwrap().health());
    back.recovered();
    assert_eq!(back.health(), 1.0);
    assert!((1..HEALTH_CLASSES).all(|c| back.health_of(c) == 1.0));
    // `good` over quota for 3 s: the calls go to `back` without waiting for it.
    let until = Instant::now() + Duration::from_secs(3);
    sources.insert(
        "good".into(),
        over_quota_until("good", until, Arc::new(AtomicUsize::new(0))),
    );
    for seed in 0..6 {
        let mut lb = balancer(&sources, Policy::HealthAware).with_seed(seed);
        let t0 = Instant::now();
        let got = lb.ready().await.unwrap().call(Req::default()).await.unwrap();
        assert_eq!((got, t0.elapsed()), ("back", Duration::ZERO), "seed {seed}");
    }
}

/// When no credible source will admit in time, the sources held back go healthiest
/// first: one that failed twice in this call but answers most calls before one that
/// fails most (which it used to take, being earlier in the order).
#[tokio::test(start_paused = true)]
async fn released_sources_go_healthiest_first() {
    let poor_fails = Arc::new(AtomicBool::new(true));
    let sources = Sources::new();
    sources.insert(
        "a".into(),
        fixed(Ok("a"), Duration::ZERO, Arc::new(AtomicUsize::new(0))),
    );
    // Over quota far past `max_wait`: credible, but it will not admit in time.
    sources.insert(
        "b".into(),
        over_quota_until(
            "b",
            Instant::now() + Duration::from_secs(3600),
            Arc::new(AtomicUsize::new(0)),
        ),
    );
    sources.insert("p".into(), fails_while("p", Arc::clone(&poor_fails)));
    // `p` fails its calls (round robin visits it): its health falls far below `a`'s.
    let mut rr = balancer(&sources, Policy::RoundRobin);
    for _ in 0..60 {
        let _ = rr.ready().await.unwrap().call(Req::default()).await;
    }
    poor_fails.store(false, Ordering::SeqCst);
    let views = sources.views();
    let health = |id: &str| views.iter().find(|v| v.id().as_str() == id).unwrap().health();
    assert!(
        health("p") < 0.5 * health("a"),
        "p {} a {}",
        health("p"),
        health("a")
    );
    for seed in 0..8 {
        let mut lb = balancer(&sources, Policy::HealthAware).with_seed(seed);
        let (req, h) = with_history();
        h.record(Some("a".into()), Outcome::Transient);
        h.record(Some("a".into()), Outcome::Transient);
        let got = lb.ready().await.unwrap().call(req).await.unwrap();
        assert_eq!(got, "a", "seed {seed}");
    }
}

/// A black hole: accepts, says nothing for 180 s, then times out.
fn hole(hits: Arc<AtomicUsize>) -> Svc {
    BoxCloneSyncService::new(service_fn(move |_: Req| {
        hits.fetch_add(1, Ordering::SeqCst);
        async move {
            tokio::time::sleep(Duration::from_secs(180)).await;
            Err::<&'static str, BoxError>(Box::new(pgw_core::TimedOut))
        }
    }))
}

/// A black hole until `alive` is set, then a source answering `ok` after 1 s.
/// A black hole until `alive`, counting attempts (`hits`) and, of those, the probe
/// copies the balancer sent off a caller's path (`probes`).
fn hole_until(alive: Arc<AtomicBool>, hits: Arc<AtomicUsize>, probes: Arc<AtomicUsize>) -> Svc {
    BoxCloneSyncService::new(service_fn(move |req: Req| {
        hits.fetch_add(1, Ordering::SeqCst);
        if req.is_probe_copy() {
            probes.fetch_add(1, Ordering::SeqCst);
        }
        let alive = alive.load(Ordering::SeqCst);
        async move {
            if alive {
                tokio::time::sleep(Duration::from_secs(1)).await;
                return Ok("revived");
            }
            tokio::time::sleep(Duration::from_secs(180)).await;
            Err::<&'static str, BoxError>(Box::new(pgw_core::TimedOut))
        }
    }))
}

#[tokio::test(start_paused = true)]
async fn a_silent_source_stops_receiving_calls_and_gets_one_probe_after_its_timeouts() {
    let (hole_hits, good_hits) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let sources = Sources::new();
    sources.insert(SourceId::from("hole"), hole(Arc::clone(&hole_hits)));
    sources.insert(
        SourceId::from("good"),
        fixed(Ok("ok"), Duration::from_secs(1), Arc::clone(&good_hits)),
    );
    // The fresh call probes it itself (the behaviour without detached probes), and
    // the attempts in flight run to their own timeouts (without cuts; the hole never
    // answered, so it would not be cut either).
    let lb = HealthP2c::new(
        sources.clone(),
        BalanceConfig {
            policy: Policy::RoundRobin,
            probe_every: None,
            cut_silent: false,
            ..BalanceConfig::default()
        },
    )
    .unwrap()
    .with_seed(7);
    let spawn = |n: usize| {
        (0..n)
            .map(|_| tokio::spawn(lb.clone().oneshot(Req::default())))
            .collect::<Vec<_>>()
    };
    // Round robin: the hole takes its share while nothing is known.
    let first = spawn(4);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let early = hole_hits.load(Ordering::SeqCst);
    assert!(early >= 1, "the hole got calls at first");
    // Within the first minute the hole is only slow as far as anyone knows.
    tokio::time::sleep(Duration::from_secs(60)).await;
    // Silent for a minute with calls in flight: every new call goes to `good`.
    for h in spawn(10) {
        assert_eq!(h.await.unwrap().unwrap(), "ok");
    }
    assert_eq!(
        hole_hits.load(Ordering::SeqCst),
        early,
        "no call into the silence"
    );
    // Its attempts time out at 180 s; then one probe, and nothing more while it is out.
    tokio::time::sleep(Duration::from_secs(120)).await;
    for h in first {
        let _ = h.await.unwrap();
    }
    let later = spawn(10);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(hole_hits.load(Ordering::SeqCst), early + 1, "one probe");
    for h in later {
        let _ = h.await;
    }
}

/// A source answering `ok` after `latency` until `dark` is set, then a black hole
/// (accepts, says nothing for 180 s, times out).
fn goes_dark(latency: Duration, dark: Arc<AtomicBool>) -> Svc {
    BoxCloneSyncService::new(service_fn(move |_: Req| {
        let dark = dark.load(Ordering::SeqCst);
        async move {
            if dark {
                tokio::time::sleep(Duration::from_secs(180)).await;
                return Err::<&'static str, BoxError>(Box::new(pgw_core::TimedOut));
            }
            tokio::time::sleep(latency).await;
            Ok("ok")
        }
    }))
}

type Timed = (Duration, Result<&'static str, Option<(Duration, Duration)>>);

/// Starts a call on `lb` on its own task; its join says when it ended and how (a
/// `SilentCut`'s quiet and age, `None` for another timeout).
fn spawn_timed(lb: &HealthP2c<Svc>) -> impl Future<Output = Timed> {
    let start = Instant::now();
    let h = tokio::spawn(lb.clone().oneshot(Req::default()));
    async move {
        let r = h.await.unwrap();
        let took = start.elapsed();
        let r = match r {
            Ok(v) => Ok(v),
            Err(e) => {
                assert!(pgw_core::is_timeout(&*e), "a cut or a timeout: {e}");
                Err(e.downcast_ref::<SilentCut>().map(|c| (c.quiet(), c.age())))
            }
        };
        (took, r)
    }
}

#[tokio::test(start_paused = true)]
async fn a_silent_sources_attempts_in_flight_are_cut_once_silent_and_old_enough() {
    let dark = Arc::new(AtomicBool::new(false));
    let sources = Sources::new();
    sources.insert(
        SourceId::from("s"),
        goes_dark(Duration::from_secs(1), Arc::clone(&dark)),
    );
    let lb = balancer(&sources, Policy::HealthAware);
    // It answers in 1 s: measured.
    assert_eq!(spawn_timed(&lb).await, (Duration::from_secs(1), Ok("ok")));
    dark.store(true, Ordering::SeqCst);
    // Two attempts at t = 1 s (heard then, as it went busy), one at t = 31 s.
    let early = [spawn_timed(&lb), spawn_timed(&lb)];
    tokio::time::sleep(Duration::from_secs(30)).await;
    let late = spawn_timed(&lb);
    let sixty = Duration::from_secs(60);
    // Silent at t = 61 s: the early ones are cut then, 60 s old, not at their 180 s.
    for h in early {
        assert_eq!(h.await, (sixty, Err(Some((sixty, sixty)))));
    }
    // The late one is cut once it too has run for `silent_after` (t = 91 s).
    assert_eq!(late.await, (sixty, Err(Some((Duration::from_secs(90), sixty)))));
    // Every count given back; the cuts count as timeouts with nothing heard.
    assert_eq!(sources.views()[0].inflight(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_slow_or_never_measured_source_is_not_cut_before_its_time() {
    // Answers in 30 s: an attempt is cut only once 4 x 30 s old, though silent at 60 s.
    let dark = Arc::new(AtomicBool::new(false));
    let sources = Sources::new();
    sources.insert(
        SourceId::from("slow"),
        goes_dark(Duration::from_secs(30), Arc::clone(&dark)),
    );
    let lb = balancer(&sources, Policy::HealthAware);
    assert_eq!(spawn_timed(&lb).await.1, Ok("ok"));
    dark.store(true, Ordering::SeqCst);
    let (took, r) = spawn_timed(&lb).await;
    assert_eq!(took, Duration::from_secs(120));
    assert_eq!(r, Err(Some((Duration::from_secs(120), Duration::from_secs(120)))));

    // A source that never answered a success: no measure of its answers, no cut; the
    // attempt ends at its own timeout.
    let sources = Sources::new();
    sources.insert(SourceId::from("hole"), hole(Arc::new(AtomicUsize::new(0))));
    let lb = balancer(&sources, Policy::HealthAware);
    assert_eq!(spawn_timed(&lb).await, (Duration::from_secs(180), Err(None)));

    // And with `cut_silent: false` a measured source's attempt runs to its timeout.
    let dark = Arc::new(AtomicBool::new(false));
    let sources = Sources::new();
    sources.insert(
        SourceId::from("s"),
        goes_dark(Duration::from_secs(1), Arc::clone(&dark)),
    );
    let lb = HealthP2c::new(
        sources.clone(),
        BalanceConfig {
            cut_silent: false,
            ..BalanceConfig::default()
        },
    )
    .unwrap();
    assert_eq!(spawn_timed(&lb).await.1, Ok("ok"));
    dark.store(true, Ordering::SeqCst);
    assert_eq!(spawn_timed(&lb).await, (Duration::from_secs(180), Err(None)));
}

/// A source whose `n`-th request waits `script[n].0` and then answers `ok` (`true`) or
/// times out (`false`).
fn scripted(script: Vec<(u64, bool)>) -> Svc {
    let script = Arc::new(Mutex::new(script.into_iter()));
    BoxCloneSyncService::new(service_fn(move |_: Req| {
        let (secs, ok) = script.lock().unwrap().next().expect("a scripted answer");
        async move {
            tokio::time::sleep(Duration::from_secs(secs)).await;
            if ok {
                Ok("ok")
            } else {
                Err::<&'static str, BoxError>(Box::new(pgw_core::TimedOut))
            }
        }
    }))
}

/// An attempt sent before the source was ever measured is judged once it is: the
/// source answers one later call in 1 s and then nothing, and the first attempt, still
/// hanging, is cut once silent for `silent_after` (60 s) instead of running to its own
/// 180 s. Before, an attempt to a source unmeasured at its dispatch was never looked
/// at again.
#[tokio::test(start_paused = true)]
async fn an_attempt_sent_before_the_first_measure_is_judged_once_there_is_one() {
    let sources = Sources::new();
    sources.insert(SourceId::from("s"), scripted(vec![(180, false), (1, true)]));
    let lb = balancer(&sources, Policy::HealthAware);
    let cold = spawn_timed(&lb);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(spawn_timed(&lb).await, (Duration::from_secs(1), Ok("ok")));
    // Heard at t = 2 s: silent for 60 s at t = 62 s, the attempt 62 s old.
    let at = Duration::from_secs(62);
    assert_eq!(cold.await, (at, Err(Some((Duration::from_secs(60), at)))));
    assert_eq!(sources.views()[0].inflight(), 0);
}

/// A black hole that heals: an attempt it swallowed (attempts timed out since it was
/// sent, and the source then answered one sent after it) is cut once `silent_after`
/// old, though the source is not silent any more. Before, it was cut only once the
/// source had been quiet for `silent_after` again, and with traffic answered, never
/// before its own timeout.
#[tokio::test(start_paused = true)]
async fn an_attempt_a_healed_black_hole_swallowed_is_cut_once_old_enough() {
    // Measured at 1 s; then `swallowed` (t = 1 s) and `dropped` (t = 2 s, timing out
    // at t = 32 s) go into the hole; it heals and answers `after` (t = 35 s) in 1 s.
    let sources = Sources::new();
    sources.insert(
        SourceId::from("s"),
        scripted(vec![(1, true), (180, false), (30, false), (1, true)]),
    );
    let lb = balancer(&sources, Policy::HealthAware);
    assert_eq!(spawn_timed(&lb).await, (Duration::from_secs(1), Ok("ok")));
    let swallowed = spawn_timed(&lb);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let dropped = spawn_timed(&lb);
    assert_eq!(dropped.await, (Duration::from_secs(30), Err(None)));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(spawn_timed(&lb).await, (Duration::from_secs(1), Ok("ok")));
    // Cut at t = 61 s, 60 s old (heard from 25 s before), not at its 180 s.
    let sixty = Duration::from_secs(60);
    assert_eq!(
        swallowed.await,
        (sixty, Err(Some((Duration::from_secs(25), sixty))))
    );
    assert_eq!(sources.views()[0].inflight(), 0);
}

/// An attempt overtaken by later answers, with no timeout since it was sent, is a long
/// answer, not a swallowed request: it runs to its end while the source answers others.
#[tokio::test(start_paused = true)]
async fn an_overtaken_attempt_without_timeouts_is_left_to_answer() {
    let sources = Sources::new();
    sources.insert(
        SourceId::from("s"),
        scripted(vec![(1, true), (100, true), (1, true), (1, true), (1, true)]),
    );
    let lb = balancer(&sources, Policy::HealthAware);
    assert_eq!(spawn_timed(&lb).await.1, Ok("ok"));
    let long = spawn_timed(&lb);
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(spawn_timed(&lb).await.1, Ok("ok"));
    }
    assert_eq!(long.await, (Duration::from_secs(100), Ok("ok")));
}

#[test]
fn a_zero_silence_threshold_is_a_config_error() {
    let bad = BalanceConfig {
        silent_after: Some(Duration::ZERO),
        ..BalanceConfig::default()
    };
    assert!(bad.validate().unwrap_err().to_string().contains("silent_after"));
}

#[tokio::test(start_paused = true)]
async fn a_silent_source_is_probed_off_the_callers_path_until_it_answers() {
    let (hole_hits, good_hits) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let probes = Arc::new(AtomicUsize::new(0));
    let alive = Arc::new(AtomicBool::new(false));
    let sources = Sources::new();
    sources.insert(
        SourceId::from("hole"),
        hole_until(Arc::clone(&alive), Arc::clone(&hole_hits), Arc::clone(&probes)),
    );
    sources.insert(
        SourceId::from("good"),
        fixed(Ok("ok"), Duration::from_secs(1), Arc::clone(&good_hits)),
    );
    let lb = balancer(&sources, Policy::RoundRobin);
    let spawn = |n: usize| {
        (0..n)
            .map(|_| tokio::spawn(lb.clone().oneshot(Req::default())))
            .collect::<Vec<_>>()
    };
    // Round robin while nothing is known: three calls go into the hole and time out.
    let first = spawn(6);
    for h in first {
        let _ = h.await.unwrap();
    }
    assert_eq!(hole_hits.load(Ordering::SeqCst), 3);
    assert_eq!(
        probes.load(Ordering::SeqCst),
        0,
        "callers' own attempts are not probe copies"
    );
    // Silent now: fresh calls are all served by `good` at once (no caller waits on the
    // hole), and the hole gets one detached probe, not one per call.
    let start = Instant::now();
    for h in spawn(10) {
        assert_eq!(h.await.unwrap().unwrap(), "ok");
    }
    assert_eq!(start.elapsed(), Duration::from_secs(1), "served without a wait");
    assert_eq!(hole_hits.load(Ordering::SeqCst), 4, "one probe");
    assert_eq!(
        probes.load(Ordering::SeqCst),
        1,
        "the probe is marked as a copy off the caller's path"
    );
    // At most one probe per `probe_every` (10 s), however many calls find it silent
    // (round robin: every other call finds it first).
    let calls = |n: usize| async move {
        for h in spawn(n) {
            assert_eq!(h.await.unwrap().unwrap(), "ok");
        }
    };
    tokio::time::sleep(Duration::from_secs(8)).await;
    calls(4).await;
    assert_eq!(hole_hits.load(Ordering::SeqCst), 4, "not before 10 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
    calls(4).await;
    assert_eq!(hole_hits.load(Ordering::SeqCst), 5, "a second probe after 10 s");
    // The hole comes back; the next turn's probe hears it.
    alive.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(10)).await;
    calls(4).await;
    assert_eq!(hole_hits.load(Ordering::SeqCst), 6, "a third probe");
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Heard: it takes calls again (round robin alternates).
    let mut served = Vec::new();
    for _ in 0..4 {
        served.push(lb.clone().oneshot(Req::default()).await.unwrap());
    }
    assert!(served.contains(&"revived"), "{served:?}");
    // Every hold went back once the probes into the silence timed out: nothing in
    // flight on either source.
    tokio::time::sleep(Duration::from_secs(180)).await;
    for h in sources.views() {
        assert_eq!(h.inflight(), 0, "{}", h.id());
    }
}

/// A request without a history, its attempt polled inside the retry layer's
/// `Recording` scope (`HistoryMode::OnDemand`): a failure is recorded, with its source,
/// into the history made in the scope; a success makes none.
#[tokio::test(start_paused = true)]
async fn a_request_without_a_history_records_a_failure_in_the_recording_in_scope() {
    async fn through_scope(
        lb: &mut HealthP2c<Svc>,
        recording: &mut Recording,
    ) -> Result<&'static str, BoxError> {
        let mut fut = {
            let _scope = recording.enter();
            lb.ready().await.unwrap().call(Req::default())
        };
        std::future::poll_fn(|cx| {
            let _scope = recording.enter();
            std::pin::Pin::new(&mut fut).poll(cx)
        })
        .await
    }
    let sources = Sources::new();
    let failing = fixed(
        Err(|| Box::new(std::io::Error::other("reset"))),
        Duration::from_millis(10),
        Arc::default(),
    );
    sources.insert("s1".into(), failing);
    let mut lb = balancer(&sources, Policy::HealthAware);
    let mut recording = Recording::of::<Req>();
    through_scope(&mut lb, &mut recording).await.unwrap_err();
    let history = recording.into_history();
    assert_eq!(history.len(), 1);
    assert_eq!(history.last().unwrap().source.unwrap().as_str(), "s1");
    assert_eq!(history.last().unwrap().outcome, Outcome::Transient);

    sources.insert(
        "s1".into(),
        fixed(Ok("ok"), Duration::from_millis(10), Arc::default()),
    );
    let mut recording = Recording::of::<Req>();
    assert_eq!(through_scope(&mut lb, &mut recording).await.unwrap(), "ok");
    assert!(recording.into_history().is_empty(), "a success is not recorded");
}

/// Sources are called on one instance each, without a copy per call; a source not
/// ready leaves its instance to the call that polled it (the next call gets a fresh
/// one), and each waiting call is woken when its instance gets ready.
#[tokio::test(start_paused = true)]
async fn a_source_not_ready_keeps_each_waiting_call_on_its_own_instance() {
    let (mock, mut handle) = tower_test::mock::pair::<Req, &'static str>();
    let sources: Sources<tower_test::mock::Mock<Req, &'static str>> = Sources::new();
    sources.insert("s1".into(), mock);
    let lb = HealthP2c::new(sources.clone(), BalanceConfig::default())
        .unwrap()
        .with_seed(7);
    handle.allow(0);
    let a = tokio::spawn(lb.clone().oneshot(Req::default()));
    let b = tokio::spawn(lb.clone().oneshot(Req::default()));
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert!(!a.is_finished() && !b.is_finished(), "not ready: both wait");
    assert_eq!(sources.view("s1").unwrap().inflight(), 2);
    handle.allow(2);
    for _ in 0..2 {
        let (_, send) = handle.next_request().await.unwrap();
        send.send_response("ok");
    }
    assert_eq!(a.await.unwrap().unwrap(), "ok");
    assert_eq!(b.await.unwrap().unwrap(), "ok");
    assert_eq!(sources.view("s1").unwrap().inflight(), 0);
    // Ready now: later calls go through the source's own instance.
    handle.allow(3);
    for _ in 0..3 {
        let call = tokio::spawn(lb.clone().oneshot(Req::default()));
        let (_, send) = handle.next_request().await.unwrap();
        send.send_response("again");
        assert_eq!(call.await.unwrap().unwrap(), "again");
    }
}

/// A stream that answered its head and runs on: its end (`settles`) is run by the test.
#[derive(Clone, Default)]
struct Running(Arc<Mutex<Vec<pgw_core::Settle<Running, BoxError>>>>);

/// Every answer is a stream still running until the test ends it.
#[derive(Clone)]
struct StreamClassifier;

impl pgw_core::Classify<Running, BoxError> for StreamClassifier {
    fn classify(&self, result: &Result<Running, BoxError>) -> Outcome {
        if result.is_ok() {
            Outcome::Success
        } else {
            Outcome::Transient
        }
    }
    fn in_progress(&self, result: &Result<Running, BoxError>) -> bool {
        result.is_ok()
    }
    fn defer(&self, result: &mut Result<Running, BoxError>, then: pgw_core::Settle<Running, BoxError>) {
        if let Ok(r) = result {
            r.0.lock().unwrap().push(then);
        }
    }
}

/// A source streaming one long answer is busy, not silent: calls sent to it while
/// the stream runs past `silent_after` are served, not refused as open circuits.
#[tokio::test(start_paused = true)]
async fn a_source_streaming_a_long_answer_is_not_silent() {
    let sources = Sources::new();
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&hits);
    sources.insert(
        SourceId::from("s"),
        BoxCloneSyncService::new(service_fn(move |_: Req| {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, BoxError>(Running::default()) }
        })),
    );
    let lb = HealthP2c::new(sources, BalanceConfig::default())
        .unwrap()
        .with_classifier(StreamClassifier);
    let long = lb.clone().oneshot(Req::default()).await.unwrap();
    // Three minutes into the stream, the default `silent_after` (60 s) long past.
    tokio::time::sleep(Duration::from_secs(180)).await;
    let next = lb.clone().oneshot(Req::default()).await;
    assert!(next.is_ok(), "refused: {:?}", next.err().map(|e| e.to_string()));
    assert_eq!(hits.load(Ordering::SeqCst), 2);
    for end in long.0.lock().unwrap().drain(..) {
        end(&Ok(Running::default()));
    }
}

/// A black hole whose probe copies hang for good (nothing below bounds them; the
/// callers' own attempts time out at 180 s): each probe is given up as a timeout once
/// it is as old as a caller's attempt there may get, so probes do not pile up as load
/// on the source; once the calls stop, its in-flight count is back to zero.
#[tokio::test(start_paused = true)]
async fn a_probe_that_never_answers_is_given_up_and_its_load_returned() {
    let sources = Sources::new();
    sources.insert(
        SourceId::from("hole"),
        BoxCloneSyncService::new(service_fn(|req: Req| async move {
            if req.is_probe_copy() {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(Duration::from_secs(180)).await;
            Err::<&'static str, BoxError>(Box::new(pgw_core::TimedOut))
        })),
    );
    sources.insert(
        SourceId::from("good"),
        fixed(Ok("ok"), Duration::from_secs(1), Arc::new(AtomicUsize::new(0))),
    );
    let lb = balancer(&sources, Policy::RoundRobin);
    let spawn = |n: usize| {
        (0..n)
            .map(|_| tokio::spawn(lb.clone().oneshot(Req::default())))
            .collect::<Vec<_>>()
    };
    // Three calls go into the hole and time out: silent, probed from now on.
    for h in spawn(6) {
        let _ = h.await.unwrap();
    }
    // Five minutes of calls: a probe every 10 s.
    for _ in 0..30 {
        for h in spawn(2) {
            assert_eq!(h.await.unwrap().unwrap(), "ok");
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    let hole = || sources.view("hole").unwrap().inflight();
    assert!(hole() <= 7, "at most a minute of probes out: {}", hole());
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(hole(), 0, "every probe given up");
}

/// A source whose `poll_ready` stays `Pending` (tower's `ConcurrencyLimit` with its
/// slots held, say) is waited for at most `paced_poll`; then the call goes on to the
/// other sources, which would otherwise sit idle, and the unready source's count
/// comes back. Before, the call waited on it without limit.
#[tokio::test(start_paused = true)]
async fn a_source_not_ready_is_waited_for_at_most_paced_poll_then_the_call_goes_on() {
    let sources: Sources<tower_test::mock::Mock<Req, &'static str>> = Sources::new();
    let (stuck, mut stuck_handle) = tower_test::mock::pair::<Req, &'static str>();
    let (free, mut free_handle) = tower_test::mock::pair::<Req, &'static str>();
    stuck_handle.allow(0);
    sources.insert("stuck".into(), stuck);
    sources.insert("free".into(), free);
    // The free source answers in 1 s, the latency an unmeasured source is scored
    // with: the two tie, and the pick starts with either.
    let latency = Duration::from_secs(1);
    tokio::spawn(async move {
        loop {
            free_handle.allow(1);
            let Some((_, send)) = free_handle.next_request().await else {
                break;
            };
            tokio::time::sleep(latency).await;
            send.send_response("free");
        }
    });
    let config = BalanceConfig::default();
    let lb = HealthP2c::new(sources.clone(), config).unwrap().with_seed(7);
    let mut waited = 0;
    for _ in 0..8 {
        let start = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(60), lb.clone().oneshot(Req::default()))
            .await
            .expect("the call waited on the unready source without limit");
        assert_eq!(answer.unwrap(), "free");
        let took = start.elapsed();
        assert!(took <= config.paced_poll + latency, "{took:?}");
        if took == config.paced_poll + latency {
            waited += 1;
        }
        assert_eq!(sources.view("stuck").unwrap().inflight(), 0);
    }
    assert!(
        waited > 0,
        "no call picked the unready source first: the case is not tested"
    );
    drop(stuck_handle);
}

/// With only unready sources, a call ends in `NoneAdmitted` within `max_wait`: the
/// wait starts at the first source not ready. Before, each unready source of the first
/// round was given a whole `paced_poll` before the wait began (three sources and
/// `max_wait = 0.5 s`: 3.5 s).
#[tokio::test(start_paused = true)]
async fn a_call_on_unready_sources_only_ends_within_max_wait() {
    let sources: Sources<tower_test::mock::Mock<Req, &'static str>> = Sources::new();
    let mut handles = Vec::new();
    for id in ["stuck-a", "stuck-b", "stuck-c"] {
        let (stuck, mut stuck_handle) = tower_test::mock::pair::<Req, &'static str>();
        stuck_handle.allow(0);
        sources.insert(id.into(), stuck);
        handles.push(stuck_handle);
    }
    for max_wait in [Duration::from_secs(5), Duration::from_millis(500), Duration::ZERO] {
        let config = BalanceConfig {
            max_wait,
            ..BalanceConfig::default()
        };
        let lb = HealthP2c::new(sources.clone(), config).unwrap().with_seed(7);
        let start = Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(60), lb.oneshot(Req::default()))
            .await
            .expect("the call waited on the unready source without limit")
            .unwrap_err();
        assert!(err.is::<NoneAdmitted>(), "{err}");
        assert!(start.elapsed() <= max_wait, "{max_wait:?}: {:?}", start.elapsed());
        assert!(sources.views().iter().all(|v| v.inflight() == 0));
    }
    drop(handles);
}

/// A classifier that panics once (an `unwrap` on a malformed answer): the awaited
/// count was given back twice (by the judge and by the drop), wrapped, and the source
/// looked silent for good once a minute passed without answers: every later call was
/// refused. Now the next call after a quiet minute is served.
#[tokio::test(start_paused = true)]
async fn a_classifier_that_panics_does_not_silence_its_source() {
    #[derive(Clone)]
    struct PanicsOnce(Arc<AtomicBool>);
    impl pgw_core::Classify<&'static str, BoxError> for PanicsOnce {
        fn classify(&self, result: &Result<&'static str, BoxError>) -> Outcome {
            assert!(!self.0.swap(false, Ordering::SeqCst), "a classifier's bug");
            if result.is_ok() {
                Outcome::Success
            } else {
                Outcome::Transient
            }
        }
    }
    let sources = Sources::new();
    let hits = Arc::new(AtomicUsize::new(0));
    sources.insert(
        SourceId::from("s"),
        fixed(Ok("ok"), Duration::from_millis(10), Arc::clone(&hits)),
    );
    let lb = HealthP2c::new(sources, BalanceConfig::default())
        .unwrap()
        .with_classifier(PanicsOnce(Arc::new(AtomicBool::new(true))));
    let first = tokio::spawn(lb.clone().oneshot(Req::default()));
    assert!(first.await.unwrap_err().is_panic());
    tokio::time::sleep(Duration::from_secs(90)).await;
    let next = lb.clone().oneshot(Req::default()).await;
    assert!(next.is_ok(), "refused: {:?}", next.err().map(|e| e.to_string()));
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

/// A call that may not wait (`CallHistory::may_wait` false: it has a fallback group to
/// go to) still gives a source whose `poll_ready` is briefly pending (a Redis round
/// trip of its breaker) its readiness time: only the end of a round in which every
/// source refused is its answer at once. Before, the readiness wait was zero too, and
/// a healthy source lost the call to the fallback whenever its gate asked Redis.
#[tokio::test(start_paused = true)]
async fn a_call_that_may_not_wait_still_waits_for_a_source_getting_ready() {
    let sources: Sources<tower_test::mock::Mock<Req, &'static str>> = Sources::new();
    let (slow, mut handle) = tower_test::mock::pair::<Req, &'static str>();
    handle.allow(0);
    sources.insert("slow-ready".into(), slow);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(3)).await;
        handle.allow(1);
        if let Some((_, send)) = handle.next_request().await {
            send.send_response("answered");
        }
    });
    let lb = HealthP2c::new(sources, BalanceConfig::default()).unwrap();
    let history = CallHistory::new();
    history.set_may_wait(false);
    assert_eq!(lb.oneshot(Req(Some(history), false)).await.unwrap(), "answered");
}

/// `Ok("empty")` is a failure (as an empty completion is to `OpenAiClassifier`).
#[derive(Clone)]
struct EmptyIsTransient;

impl pgw_core::Classify<&'static str, BoxError> for EmptyIsTransient {
    fn classify(&self, result: &Result<&'static str, BoxError>) -> Outcome {
        match result {
            Ok(s) if *s != "empty" => Outcome::Success,
            _ => Outcome::Transient,
        }
    }
}

/// A failure handed up as `Ok` (an empty completion, a 503 response) and answered at
/// once does not make its source look fast: its latency is its successes' (2 s), so
/// a source failing 40% scores below a healthy one of the same speed. Sampled, the
/// instant failures pulled the latency down by the failure rate and the score came
/// out `health / (health x 2 s)`: health no longer counted.
#[tokio::test(start_paused = true)]
async fn failures_answered_as_ok_do_not_make_a_source_look_fast() {
    let sources: Sources<Svc> = Sources::new();
    let n = Arc::new(AtomicUsize::new(0));
    sources.insert(
        "s1".into(),
        BoxCloneSyncService::new(service_fn(move |_: Req| {
            let i = n.fetch_add(1, Ordering::SeqCst);
            async move {
                if matches!(i % 5, 0 | 3) {
                    return Ok::<_, BoxError>("empty");
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
                Ok("done")
            }
        })),
    );
    let mut lb = HealthP2c::new(sources.clone(), BalanceConfig::default())
        .unwrap()
        .with_classifier(EmptyIsTransient);
    for _ in 0..50 {
        let _ = lb.ready().await.unwrap().call(Req::default()).await;
    }
    let view = sources.view("s1").unwrap();
    assert!(view.health() < 0.9, "failures counted: {}", view.health());
    // The score is health / ((1 + inflight) x latency), nothing in flight.
    let latency = view.health() / view.score();
    assert!(
        (latency - 2.0).abs() < 0.01,
        "latency {latency} s, not its successes' 2 s"
    );
}
