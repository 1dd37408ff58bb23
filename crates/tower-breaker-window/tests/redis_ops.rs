//! Redis-specific behaviour: round trips per operation, two processes racing for the
//! probe, and an outage of the server (B12) on a throwaway `redis-server` of our own.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::*;
use futures_util::future::join_all;
use pgw_core::redis_conn::{RedisConn, RedisTarget};
use pgw_core::{BackendUnavailable, BoxError, BreakerVerdict};
use pgw_test_support::PrivateRedis;
use tower::{Service, ServiceExt, service_fn};
use tower_breaker_window::{
    Admission, Backend, BreakerConfig, BreakerLayer, BreakerState, Gate, RedisBackend, RedisGate,
};
use tower_layer::Layer;

fn config(threshold: u32) -> BreakerConfig {
    BreakerConfig::builder()
        .fail_threshold(threshold)
        .cooldown(REDIS_UNIT)
        .build()
        .unwrap()
}

fn commandstats(info: &str) -> Vec<(String, u64)> {
    info.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("cmdstat_")?;
            let (name, stats) = rest.split_once(':')?;
            let calls = stats
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// At most one round trip (one EVALSHA) per admission, exactly one per record, on every
/// path: closed (none within the closed view), open (refused: one, then none until
/// `open_until`), half-open probe, probe verdict.
#[tokio::test]
async fn one_round_trip_per_admission_and_per_record() {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    // A closed view longer than the test: its closed admissions are answered here.
    // Every outcome sent (deferred successes: see the next test).
    let backend = RedisBackend::new(RedisConn::connect(&target).await.unwrap())
        .with_prefix("rt")
        .with_closed_view(Duration::from_secs(3600))
        .with_deferred_successes(false);
    let gate = backend.gate(&"s".into(), &config(3));
    // Load the scripts (the first EVALSHA of each falls back to loading it).
    call(&gate, S).await;
    let _ = gate.view().await.unwrap();
    let client = redis::Client::open(server.url()).unwrap();
    let mut stats = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut stats)
        .await
        .unwrap();

    let (mut admissions, mut records) = (0u64, 0u64);
    // Closed: admitted by the view the first call left, no round trip; the third
    // failure in a row opens the breaker, and this process forgets its view.
    for outcome in [S, S, F, S, F, F, F] {
        let t = admit(&gate).await;
        gate.record(t, outcome.breaker_verdict()).await;
        records += 1;
    }
    // Open: the first refusal is one round trip and tells until when; the next four
    // are answered in this process (nothing closes it before then).
    let first = refused(&gate).await;
    admissions += 1;
    for _ in 0..4 {
        assert!(refused(&gate).await <= first);
    }
    tokio::time::sleep(REDIS_UNIT + REDIS_UNIT / 6).await;
    let probe = admit(&gate).await;
    assert!(probe.is_probe());
    gate.record(probe, BreakerVerdict::Success).await;
    admissions += 1;
    records += 1;

    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut stats)
        .await
        .unwrap();
    let calls = commandstats(&info);
    let evalsha = calls.iter().find(|(n, _)| n == "evalsha").map_or(0, |c| c.1);
    let others: Vec<_> = calls
        .iter()
        // Commands the scripts run inside the server are counted too; they are not
        // round trips.
        .filter(|(n, _)| {
            !matches!(
                n.as_str(),
                "evalsha" | "info" | "config|resetstat" | "time" | "hmget" | "hset" | "pexpire"
            )
        })
        .collect();
    println!(
        "round trips: {admissions} admissions + {records} records = {evalsha} EVALSHA; other commands: {others:?}"
    );
    assert_eq!(evalsha, admissions + records, "{info}");
    assert!(others.is_empty(), "unexpected commands: {others:?}");
}

/// Successes admitted under the closed view are counted in the process and sent with
/// its next failure, before it: one round trip for the lot, and the state Redis ends
/// in is the one of every outcome sent in order. A failure whose ticket is of another
/// epoch leaves them; one of theirs that finds the epoch over drops them (their own
/// records would have counted nowhere).
#[tokio::test]
async fn successes_under_the_closed_view_travel_with_the_next_failure() {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let conn = RedisConn::connect(&target).await.unwrap();
    let backend = RedisBackend::new(conn.clone())
        .with_prefix("defer")
        .with_closed_view(Duration::from_secs(3600));
    let sent = RedisBackend::new(conn)
        .with_prefix("sent")
        .with_closed_view(Duration::from_secs(3600))
        .with_deferred_successes(false);
    let config = config(3);
    let gate = backend.gate(&"s".into(), &config);
    let twin = sent.gate(&"s".into(), &config);
    let evalsha = || server.command_calls("evalsha");
    // The first admission asks (and loads the script); its success is kept.
    call(&gate, S).await;
    call(&twin, S).await;
    let before = evalsha();
    for _ in 0..4 {
        call(&gate, S).await;
    }
    assert_eq!(gate.deferred_successes(), 5);
    assert_eq!(evalsha(), before, "no round trip for a success under the view");
    assert_eq!(still(&gate).await.window_calls, 0, "not in Redis yet");
    for outcome in [S, S, S, S, F] {
        call(&twin, outcome).await;
    }
    let before = evalsha();
    call(&gate, F).await;
    assert_eq!(evalsha(), before + 1, "one record for the five and the failure");
    assert_eq!(gate.deferred_successes(), 0);
    assert_eq!(
        still(&gate).await,
        still(&twin).await,
        "the state of every outcome sent"
    );
    assert_eq!(still(&gate).await.window_calls, 6);

    // Another process opens the breaker; this one's kept successes die with the epoch.
    call(&gate, S).await;
    assert_eq!(gate.deferred_successes(), 1);
    let other = backend.clone().gate(&"s".into(), &config);
    let t = admit(&other).await;
    other.record(t, BreakerVerdict::ForceOpen).await;
    let stale = admit(&gate).await; // still the closed view
    gate.record(stale, BreakerVerdict::Failure).await;
    assert_eq!(
        gate.deferred_successes(),
        0,
        "sent with the failure, counted nowhere"
    );
    assert_eq!(still(&gate).await.state, BreakerState::Open);
}

/// A gate on a server of its own whose rate window (400 ms, answered) is far shorter
/// than its closed view (an hour): every admission within the test is the view's.
async fn short_window_under_a_long_view(prefix: &str) -> (PrivateRedis, RedisGate, Duration) {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let backend = RedisBackend::new(RedisConn::connect(&target).await.unwrap())
        .with_prefix(prefix)
        .with_closed_view(Duration::from_secs(3600));
    let window = Duration::from_millis(400);
    let config = BreakerConfig::builder()
        .fail_threshold(3)
        .cooldown(REDIS_UNIT)
        .window(window)
        .build()
        .unwrap();
    let gate = backend.gate(&"s".into(), &config);
    (server, gate, window)
}

/// Kept successes older than the window are dropped, not sent: sent with the first
/// failure after an idle spell, they landed in the current bucket and outweighed the
/// failures of a source that died meanwhile (the window showed 6 calls, 1 failure).
#[tokio::test]
async fn successes_kept_past_the_window_are_dropped_not_sent() {
    let (_server, gate, window) = short_window_under_a_long_view("old").await;
    for _ in 0..5 {
        call(&gate, S).await;
    }
    assert_eq!(gate.deferred_successes(), 5);
    tokio::time::sleep(window + window / 2).await;
    call(&gate, F).await;
    assert_eq!(gate.deferred_successes(), 0);
    assert_eq!(still(&gate).await.window_calls, 1, "the failure alone");
}

/// Kept successes of an epoch that ended are discarded when a newer epoch's ticket
/// comes: left, they stopped the gate from keeping successes for good (every success
/// of the new epoch went in a round trip of its own).
#[tokio::test]
async fn successes_kept_in_an_ended_epoch_do_not_stop_deferring() {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let view = REDIS_UNIT / 2;
    let backend = RedisBackend::new(RedisConn::connect(&target).await.unwrap())
        .with_prefix("epoch")
        .with_closed_view(view);
    let config = config(3);
    let gate = backend.gate(&"s".into(), &config);
    for _ in 0..3 {
        call(&gate, S).await;
    }
    assert_eq!(gate.deferred_successes(), 3);
    // Another process opens the breaker, and its probe closes it: a new epoch.
    let other = backend.clone().gate(&"s".into(), &config);
    let t = admit(&other).await;
    other.record(t, BreakerVerdict::ForceOpen).await;
    tokio::time::sleep(REDIS_UNIT + REDIS_UNIT / 6).await;
    let probe = admit(&other).await;
    assert!(probe.is_probe());
    other.record(probe, BreakerVerdict::Success).await;
    assert_eq!(still(&gate).await.state, BreakerState::Closed);
    // This process's view has ended: it asks, and keeps the new epoch's successes.
    call(&gate, S).await;
    call(&gate, S).await;
    assert_eq!(gate.deferred_successes(), 2, "the new epoch's two");
}

/// With a rate window shorter than the closed view, kept successes are sent once kept
/// half a window: kept a whole view, they were dropped as older than the window first,
/// and a process whose calls all succeeded counted none of them in Redis, where other
/// processes' failures alone then opened the breaker.
#[tokio::test]
async fn kept_successes_are_sent_within_a_window_shorter_than_the_view() {
    let (_server, gate, window) = short_window_under_a_long_view("short").await;
    for _ in 0..3 {
        call(&gate, S).await;
    }
    assert_eq!(gate.deferred_successes(), 3, "kept under the view");
    tokio::time::sleep(window / 2 + window / 8).await;
    call(&gate, S).await;
    assert_eq!(gate.deferred_successes(), 0, "sent once kept half a window");
    assert_eq!(still(&gate).await.window_calls, 4);
}

/// Successes kept under the closed view are sent at the first success once they were
/// kept a whole view, though every admission renews the view (a process that records
/// no failure asks Redis as each view ends, and is told "closed" again). Before, they
/// waited for a failure here, or were dropped after a window.
#[tokio::test]
async fn kept_successes_are_sent_once_kept_a_whole_view() {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let view = REDIS_UNIT / 2;
    let backend = RedisBackend::new(RedisConn::connect(&target).await.unwrap())
        .with_prefix("flush")
        .with_closed_view(view);
    let gate = backend.gate(&"s".into(), &config(3));
    for _ in 0..3 {
        call(&gate, S).await;
    }
    assert_eq!(gate.deferred_successes(), 3, "kept under the view");
    tokio::time::sleep(view + view / 4).await;
    call(&gate, S).await;
    assert_eq!(
        gate.deferred_successes(),
        0,
        "sent with the first success after a view"
    );
    assert_eq!(still(&gate).await.window_calls, 4, "all four counted in Redis");
}

/// The closed view: another process's open reaches this one at the first outcome it
/// records after it (its ticket's epoch is over), not only when the view ends.
async fn another_process_open_is_learnt_from_the_next_record(env: RedisEnv) {
    let other = env.other_process().await;
    let config = cfg(&env, 3).build().unwrap();
    // A view longer than the test, so only the record can end it.
    let a = env
        .backend
        .clone()
        .with_closed_view(Duration::from_secs(3600))
        .gate(&"s".into(), &config);
    let b = other.gate(&"s".into(), &config);
    let first = admit(&a).await;
    assert!(!first.is_probe());
    // The other process finds the source dead: open at once.
    let t = admit(&b).await;
    b.record(t, BreakerVerdict::ForceOpen).await;
    assert_eq!(view(&b).await.state, BreakerState::Open);
    // This process still trusts its closed view (the price of no round trip)...
    let stale = admit(&a).await;
    assert_eq!(stale, first, "admitted by the view, under the old epoch");
    // ...until its next outcome lands against the old epoch: counted nowhere, and
    // the next admission asks and is refused.
    let before = still(&a).await;
    a.record(stale, BreakerVerdict::Success).await;
    assert_eq!(still(&a).await, before, "a stale outcome counts nowhere");
    match a.admit().await.unwrap() {
        Admission::Refused { retry_after } => assert!(retry_after > Duration::ZERO),
        admitted @ Admission::Admitted(_) => panic!("still trusted the closed view: {admitted:?}"),
    }
}

#[tokio::test]
async fn standalone_another_process_open_is_learnt_from_the_next_record() {
    another_process_open_is_learnt_from_the_next_record(RedisEnv::standalone("stale").await).await;
}

#[tokio::test]
async fn cluster_another_process_open_is_learnt_from_the_next_record() {
    another_process_open_is_learnt_from_the_next_record(RedisEnv::cluster("stale").await).await;
}

/// A record counted by the closed breaker renews the closed view as an admission
/// does: a source in use is not asked about between its outcomes. Real time (the
/// server's clock); margins of 0.8 s either side.
#[tokio::test]
async fn a_counted_record_renews_the_closed_view() {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let view = Duration::from_secs(2);
    let backend = RedisBackend::new(RedisConn::connect(&target).await.unwrap())
        .with_prefix("renew")
        .with_closed_view(view)
        // Each success sent: this is the view a sent record renews.
        .with_deferred_successes(false);
    let gate = backend.gate(&"s".into(), &config(3));
    call(&gate, S).await; // asks (and loads the scripts): the view starts
    let start = server.command_calls("evalsha");
    tokio::time::sleep(view * 3 / 5).await;
    call(&gate, S).await; // admitted by the view; its record renews it
    tokio::time::sleep(view * 3 / 5).await;
    // Past the first view's end, within the renewed one.
    let t = admit(&gate).await;
    let end = server.command_calls("evalsha");
    assert_eq!(end - start, 1, "only the record went to Redis");
    gate.record(t, BreakerVerdict::Success).await;
}

/// A closed view of `Duration::MAX` ("trust a closed breaker until told otherwise")
/// saturates instead of overflowing the clock in the first admission.
#[tokio::test]
async fn a_closed_view_of_duration_max_saturates() {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let backend = RedisBackend::new(RedisConn::connect(&target).await.unwrap())
        .with_prefix("forever")
        .with_closed_view(Duration::MAX)
        .with_deferred_successes(false);
    let gate = backend.gate(&"s".into(), &config(3));
    call(&gate, S).await; // asks Redis: the view starts, without end
    let start = server.command_calls("evalsha");
    let t = admit(&gate).await;
    assert_eq!(server.command_calls("evalsha"), start, "admitted by the view");
    gate.record(t, BreakerVerdict::Success).await;
}

/// Admissions that find the view unknown while one is asking Redis wait for its
/// answer instead of asking too: a round of waiting calls asks a gate once, not once
/// per call. The question runs in a task of its own, so an asker dropped or never
/// polled still answers its waiters; with the view off, every admission asks.
#[tokio::test]
async fn concurrent_admissions_share_one_question() {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let conn = RedisConn::connect(&target).await.unwrap();
    let backend = RedisBackend::new(conn.clone()).with_prefix("flight");
    let evalsha = || server.command_calls("evalsha");
    // Load the admission script on a gate of its own.
    let _ = admit(&backend.gate(&"warm".into(), &config(3))).await;

    let gate = backend.gate(&"s".into(), &config(3));
    let before = evalsha();
    let answers = join_all((0..10).map(|_| gate.admit())).await;
    assert_eq!(evalsha() - before, 1, "ten admissions, one question");
    for a in answers {
        assert!(matches!(a.unwrap(), Admission::Admitted(t) if !t.is_probe()));
    }

    // The asker is dropped before it is polled: its question runs in a task of its
    // own, and the waiter hears its answer.
    let gate = backend.gate(&"t".into(), &config(3));
    let before = evalsha();
    let asker = gate.admit();
    let waiter = gate.admit();
    drop(asker);
    assert!(matches!(waiter.await.unwrap(), Admission::Admitted(_)));
    assert_eq!(evalsha() - before, 1, "one question, heard by the waiter");

    // The asker is held, never polled: the same.
    let gate = backend.gate(&"v".into(), &config(3));
    let before = evalsha();
    let asker = gate.admit();
    let waiter = gate.admit();
    assert!(matches!(waiter.await.unwrap(), Admission::Admitted(_)));
    assert_eq!(evalsha() - before, 1, "one question, heard by the waiter");
    drop(asker);

    // No view: no sharing either.
    let gate = backend
        .clone()
        .with_closed_view(Duration::ZERO)
        .gate(&"u".into(), &config(3));
    let before = evalsha();
    let answers = join_all((0..4).map(|_| gate.admit())).await;
    assert!(answers.into_iter().all(|a| a.is_ok()));
    assert_eq!(evalsha() - before, 4, "each asked");
}

/// Two processes (two connections) racing in half-open: exactly one probe.
async fn two_processes_one_probe(env: RedisEnv) {
    let other = env.other_process().await;
    let config = cfg(&env, 1).build().unwrap();
    let a = env.gate("s", &config);
    let b = other.gate(&"s".into(), &config);
    call(&a, F).await;
    env.pass(env.unit()).await;
    let admits = (0..64).map(|i| {
        let g = if i % 2 == 0 { a.clone() } else { b.clone() };
        async move { g.admit().await.unwrap() }
    });
    let answers = join_all(admits).await;
    let probes: Vec<_> = answers
        .iter()
        .filter_map(|a| match a {
            Admission::Admitted(t) => Some(*t),
            Admission::Refused { .. } => None,
        })
        .collect();
    assert_eq!(probes.len(), 1, "{answers:?}");
    assert!(probes[0].is_probe());
    // The other process sees the lease and the verdict.
    assert!(view(&b).await.probe_in_flight);
    b.record(probes[0], BreakerVerdict::Success).await;
    assert_eq!(view(&a).await.state, tower_breaker_window::BreakerState::Closed);
}

#[tokio::test]
async fn standalone_two_processes_one_probe() {
    two_processes_one_probe(RedisEnv::standalone("race").await).await;
}

#[tokio::test]
async fn cluster_two_processes_one_probe() {
    two_processes_one_probe(RedisEnv::cluster("race").await).await;
}

/// B12: Redis stops mid-test. Admission fails closed with `BackendUnavailable`
/// (through the layer too, without calling the inner service); recording warns, counts
/// and returns; nothing hangs past the timeout; after a restart the breaker works again.
#[tokio::test]
async fn outage_fails_closed_then_recovers() {
    let mut server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let timeout = Duration::from_millis(300);
    let conn = RedisConn::connect_with(&target, timeout, timeout).await.unwrap();
    // Every admission asks Redis: with a closed view, the admissions within it after
    // the last answer would still be admitted (see `DEFAULT_CLOSED_VIEW`).
    let backend = RedisBackend::new(conn)
        .with_prefix("outage")
        .with_timeout(timeout)
        .with_closed_view(Duration::ZERO);
    let layer = BreakerLayer::new(&backend, "s", &config(3));
    let gate = layer.gate().clone();
    let handle = layer.handle();
    let reached = Arc::new(AtomicU32::new(0));
    let mut svc = layer.layer({
        let reached = reached.clone();
        service_fn(move |()| {
            reached.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, BoxError>("ok") }
        })
    });
    assert_eq!(svc.ready().await.unwrap().call(()).await.unwrap(), "ok");
    let ticket = admit(&gate).await;

    server.stop();
    let bound = Duration::from_secs(3);
    let err = tokio::time::timeout(bound, gate.admit())
        .await
        .expect("admission hung")
        .unwrap_err();
    let unavailable = err
        .downcast_ref::<BackendUnavailable>()
        .expect("BackendUnavailable");
    assert_eq!(
        (unavailable.backend(), unavailable.operation()),
        ("redis", "admit")
    );
    let err = tokio::time::timeout(bound, async { svc.ready().await.unwrap().call(()).await })
        .await
        .expect("call hung")
        .unwrap_err();
    assert!(err.is::<BackendUnavailable>(), "{err}");
    assert_eq!(
        reached.load(Ordering::SeqCst),
        1,
        "fail closed: the inner service was not called"
    );
    tokio::time::timeout(bound, gate.record(ticket, BreakerVerdict::Failure))
        .await
        .expect("record hung");
    assert_eq!(gate.record_errors(), 1);
    assert!(
        tokio::time::timeout(bound, handle.view())
            .await
            .expect("view hung")
            .is_err()
    );

    server.restart();
    let mut back = false;
    for _ in 0..50 {
        if matches!(gate.admit().await, Ok(Admission::Admitted(_))) {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(back, "the breaker never recovered after Redis came back");
    assert_eq!(svc.ready().await.unwrap().call(()).await.unwrap(), "ok");
    let v = handle.view().await.unwrap();
    assert_eq!((v.window_calls, v.record_errors), (1, 1));
}

/// Counts in the hash beyond `u32` (another writer, a corrupted key) are clamped: the
/// view, an admission and a record neither panic nor fail.
#[tokio::test]
async fn oversized_counts_in_the_hash_are_clamped() {
    let env = RedisEnv::standalone("huge").await;
    let config = cfg(&env, 3).build().unwrap();
    let gate = env.gate("s", &config);
    let key = env.backend.gate_key(&"s".into());
    let client = redis::Client::open(pgw_test_support::redis_url().unwrap()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    redis::cmd("HSET")
        .arg(&key)
        .arg(&[
            "win_id",
            "9000000000000000000",
            "a0",
            "5000000000",
            "a1",
            "5000000000",
        ])
        .arg(&["f0", "0", "f1", "0", "failures", "0"])
        .query_async::<()>(&mut raw)
        .await
        .unwrap();
    let v = view(&gate).await;
    assert_eq!(
        (v.window_calls, v.window_failures),
        (u32::MAX, 0),
        "5e9 per bucket"
    );
    call(&gate, S).await;
    let v = view(&gate).await;
    assert_eq!((v.state, v.window_calls), (BreakerState::Closed, u32::MAX));
}

/// A record renews the hash's TTL only once less than half of it is left, not every
/// time (a PEXPIRE per record was a fifth of its commands), and the hash never ends
/// before the end it noted.
#[tokio::test]
async fn a_record_renews_the_ttl_only_when_half_of_it_is_gone() {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    // Each success sent: the TTL is what each record renews.
    let backend = RedisBackend::new(RedisConn::connect(&target).await.unwrap())
        .with_prefix("ttl")
        .with_deferred_successes(false);
    let gate = backend.gate(&"s".into(), &config(3));
    let key = backend.gate_key(&"s".into());
    let client = redis::Client::open(server.url()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    let pttl = || server.pttl(&key);
    call(&gate, S).await;
    let full = pttl();
    assert!(full > 0, "a counted record leaves a TTL: {full}");
    // Shortened by hand to three quarters, with its noted end still ahead by more
    // than half: the next records leave it alone.
    let shorter = full * 3 / 4;
    redis::cmd("PEXPIRE")
        .arg(&key)
        .arg(shorter)
        .query_async::<()>(&mut raw)
        .await
        .unwrap();
    call(&gate, S).await;
    call(&gate, F).await;
    let after = pttl();
    assert!(
        after <= shorter,
        "not renewed by every record: {after} > {shorter}"
    );
    // Its noted end near (as after half a TTL): the next record renews it.
    redis::cmd("HSET")
        .arg(&key)
        .arg("ttl_end")
        .arg(0)
        .query_async::<()>(&mut raw)
        .await
        .unwrap();
    call(&gate, S).await;
    let renewed = pttl();
    assert!(
        renewed > shorter,
        "renewed once its end is near: {renewed} <= {shorter}"
    );
}

/// One step of a differential sequence.
#[derive(Clone, Debug)]
enum Step {
    Admit,
    /// Record `verdict` on the `pick`-th ticket held (modulo), dropping it unless `keep`
    /// (a kept ticket is recorded again later: a stale or duplicate record).
    Record {
        verdict: BreakerVerdict,
        pick: usize,
        keep: bool,
    },
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    let verdict = prop_oneof![
        4 => Just(BreakerVerdict::Success),
        4 => Just(BreakerVerdict::Failure),
        1 => Just(BreakerVerdict::ForceOpen),
        1 => Just(BreakerVerdict::Ignore),
    ];
    prop_oneof![
        Just(Step::Admit),
        (verdict, any::<usize>(), proptest::bool::weighted(0.1))
            .prop_map(|(verdict, pick, keep)| Step::Record { verdict, pick, keep }),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// `record.lua` / `admit.lua` and the memory state machine are one contract: on any
    /// sequence of admissions and records (in one bucket, before any cooldown ends:
    /// durations of a year keep the real clock out of it), both backends answer the
    /// same and end in the same state after every step.
    #[test]
    fn memory_and_lua_agree_on_any_sequence(
        threshold in 1u32..6,
        max_concurrency in 0u32..3,
        min_calls in 1u32..8,
        fail_rate in proptest::prop_oneof![
            proptest::strategy::Just(0.28),
            proptest::strategy::Just(0.6),
            proptest::strategy::Just(1.0),
            0.05f64..1.0,
        ],
        steps in proptest::collection::vec(step(), 1..60),
    ) {
        let config = BreakerConfig::builder()
            .fail_threshold(threshold)
            .max_concurrency(max_concurrency)
            .min_calls(min_calls)
            .fail_rate(fail_rate)
            .cooldown(tower_breaker_window::MAX_DURATION)
            .window(tower_breaker_window::MAX_DURATION)
            .build()
            .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let env = RedisEnv::standalone("diff").await;
            let redis = env.gate("s", &config);
            // The same, keeping successes under its closed view: it must agree
            // whenever it has sent them all.
            let deferring = env
                .backend
                .clone()
                .with_deferred_successes(true)
                .gate(&"d".into(), &config);
            let memory = tower_breaker_window::MemoryBackend::new().gate(&"s".into(), &config);
            let mut held: Vec<tower_breaker_window::Ticket> = vec![];
            for (i, s) in steps.iter().enumerate() {
                match *s {
                    Step::Admit => {
                        let m = memory.admit().await.unwrap();
                        let r = redis.admit().await.unwrap();
                        let d = deferring.admit().await.unwrap();
                        match (m, d) {
                            (Admission::Admitted(a), Admission::Admitted(b)) => {
                                assert_eq!(a, b, "step {i}: tickets (deferring)");
                            }
                            (Admission::Refused { .. }, Admission::Refused { .. }) => {}
                            other => panic!("step {i}: admissions differ (deferring): {other:?}"),
                        }
                        match (m, r) {
                            (Admission::Admitted(a), Admission::Admitted(b)) => {
                                assert_eq!(a, b, "step {i}: tickets");
                                held.push(a);
                            }
                            (Admission::Refused { .. }, Admission::Refused { .. }) => {}
                            other => panic!("step {i}: admissions differ: {other:?}"),
                        }
                    }
                    Step::Record { verdict, pick, keep } => {
                        if held.is_empty() {
                            continue;
                        }
                        let at = pick % held.len();
                        let ticket = if keep { held[at] } else { held.swap_remove(at) };
                        memory.record(ticket, verdict).await;
                        redis.record(ticket, verdict).await;
                        deferring.record(ticket, verdict).await;
                    }
                }
                let m = still(&memory).await;
                assert_eq!(m, still(&redis).await, "step {i}: {s:?} in {steps:?}");
                if deferring.deferred_successes() == 0 {
                    assert_eq!(m, still(&deferring).await, "step {i} (deferring): {s:?} in {steps:?}");
                }
            }
        });
    }
}

/// A refusal because another process's probe is out is remembered for the closed
/// view: the calls waiting on a source whose probe hangs do not each ask Redis. The
/// probe's close reaches this process when the view ends; this process's own probe
/// forgets the memory as soon as its verdict lands. Real time (the server's clock);
/// the view is 2 s, the steps inside it take milliseconds.
#[tokio::test]
async fn a_probe_out_refusal_is_remembered_for_the_view_and_forgotten_by_its_own_probe() {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let view = Duration::from_secs(2);
    let backend = |conn| RedisBackend::new(conn).with_prefix("po").with_closed_view(view);
    let a = backend(RedisConn::connect(&target).await.unwrap()).gate(&"s".into(), &config(1));
    let b = backend(RedisConn::connect(&target).await.unwrap()).gate(&"s".into(), &config(1));
    let evalsha = || server.command_calls("evalsha");
    // Opened by a failure; after the cooldown the other process takes the probe.
    call(&a, F).await;
    tokio::time::sleep(REDIS_UNIT + REDIS_UNIT / 6).await;
    let probe = admit(&b).await;
    assert!(probe.is_probe());
    let start = evalsha();
    for _ in 0..5 {
        refused(&a).await;
    }
    assert_eq!(evalsha() - start, 1, "one round trip learnt the probe is out");
    // The probe closes the breaker: this process still refuses within its view...
    b.record(probe, BreakerVerdict::Success).await;
    refused(&a).await;
    // ...and asks once the view is over.
    tokio::time::sleep(view).await;
    assert!(!admit(&a).await.is_probe(), "closed");

    // This process's own probe: its verdict forgets the memory at once.
    call(&a, F).await;
    tokio::time::sleep(REDIS_UNIT + REDIS_UNIT / 6).await;
    let own = admit(&a).await;
    assert!(own.is_probe());
    refused(&a).await;
    a.record(own, BreakerVerdict::Success).await;
    let start = evalsha();
    assert!(!admit(&a).await.is_probe(), "admitted by the closed breaker");
    assert_eq!(evalsha() - start, 1, "asked Redis");
}

/// A probe lease whose caller is gone is released at once, not held for the probe TTL
/// (a minute here) while every process is refused "probe out": an admission dropped
/// after its question went out, one whose question timed out on a frozen server
/// (its script runs when the server wakes up), and one dropped unread after its
/// answer came. Real time (the server's clock).
#[tokio::test]
async fn a_probe_lease_whose_caller_is_gone_is_released() {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let timeout = Duration::from_millis(300);
    let config = BreakerConfig::builder()
        .fail_threshold(1)
        .cooldown(REDIS_UNIT)
        .probe_ttl(Duration::from_secs(60))
        .build()
        .unwrap();
    // Every admission asks (no view): the other process sees the lease at once.
    let backend = |conn| {
        RedisBackend::new(conn)
            .with_prefix("gone")
            .with_timeout(timeout)
            .with_closed_view(Duration::ZERO)
    };
    let conn = || RedisConn::connect_with(&target, timeout, timeout);
    let a = backend(conn().await.unwrap()).gate(&"s".into(), &config);
    let b = backend(conn().await.unwrap()).gate(&"s".into(), &config);
    // The other process takes the probe once the lease is free (a few ms after the
    // release); without the release it would be refused for the probe TTL.
    let probe_of_b = || async {
        for _ in 0..100 {
            if let Admission::Admitted(t) = b.admit().await.expect("backend answers") {
                return Some(t);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        None
    };

    // Opened; after the cooldown the next admission is the probe. Its caller gives
    // up while the question is surely out (the server is frozen) and drops it; the
    // script runs when the server wakes up.
    call(&a, F).await;
    tokio::time::sleep(REDIS_UNIT + REDIS_UNIT / 6).await;
    server.freeze();
    let gave_up = tokio::time::timeout(timeout / 3, a.admit()).await;
    assert!(gave_up.is_err(), "no answer from a frozen server");
    server.thaw();
    let t = probe_of_b()
        .await
        .expect("the dropped probe's lease was released");
    assert!(t.is_probe());
    b.record(t, BreakerVerdict::Failure).await; // open again, one cooldown

    // A question that times out on a frozen server: its script runs when the server
    // wakes up and leases the probe to a caller that has had its error.
    tokio::time::sleep(REDIS_UNIT + REDIS_UNIT / 6).await;
    server.freeze();
    let err = a.admit().await.unwrap_err();
    assert!(err.is::<BackendUnavailable>(), "{err}");
    server.thaw();
    let t = probe_of_b()
        .await
        .expect("the timed-out probe's lease was released");
    assert!(t.is_probe());
    b.record(t, BreakerVerdict::Failure).await; // open again, one cooldown

    // An answer that came to a caller that then drops its admission unread (the
    // lease was in the channel when the caller left).
    tokio::time::sleep(REDIS_UNIT + REDIS_UNIT / 6).await;
    let asked = a.admit(); // the question goes out now
    tokio::time::sleep(Duration::from_millis(200)).await; // and its answer is in
    drop(asked);
    let t = probe_of_b().await.expect("the unread probe's lease was released");
    assert!(t.is_probe());
}

/// A backend on a server of its own (to freeze) whose operations time out after
/// 300 ms, and that timeout.
async fn timing_out_backend(prefix: &str) -> (PrivateRedis, RedisBackend, Duration) {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let timeout = Duration::from_millis(300);
    let conn = RedisConn::connect_with(&target, timeout, timeout).await.unwrap();
    let backend = RedisBackend::new(conn).with_prefix(prefix).with_timeout(timeout);
    (server, backend, timeout)
}

/// Admissions waiting on a question that Redis does not answer fail with it, after
/// the backend's timeout, and do not ask again: before, each waited that timeout and
/// then asked, and was answered after twice the timeout. Paused clock, so the timeout
/// passes as soon as nothing else can happen; the server is frozen (connections open,
/// nothing answered).
#[tokio::test]
async fn waiters_hear_that_their_question_failed() {
    let (server, backend, timeout) = timing_out_backend("heard").await;
    let gate = backend.gate(&"s".into(), &config(3));
    // Load the script (a first question must not fail on NOSCRIPT's retry).
    let _ = admit(&backend.gate(&"warm".into(), &config(3))).await;

    server.freeze();
    tokio::time::pause();
    let start = tokio::time::Instant::now();
    let timed = |g: tower_breaker_window::RedisGate| async move {
        let r = g.admit().await;
        (r, start.elapsed())
    };
    let answers = join_all((0..4).map(|_| timed(gate.clone()))).await;
    tokio::time::resume();
    server.thaw();
    for (r, took) in answers {
        let err = r.unwrap_err();
        let unavailable = err
            .downcast_ref::<BackendUnavailable>()
            .expect("BackendUnavailable");
        assert_eq!(unavailable.operation(), "admit");
        // The timer wheel rounds up to the next millisecond; twice the timeout was
        // the defect.
        assert!(
            took >= timeout && took < timeout + Duration::from_millis(5),
            "each failed with the one question, after its timeout: {took:?}"
        );
    }
}

/// A Redis that takes connections and answers nothing holds one caller for its record,
/// the backend's timeout, not every caller (B12: recording never blocks the caller):
/// once a record failed, callers get their answers at once while their records go out
/// on their own; the first record that lands makes callers wait for theirs again (a
/// caller's next admission then sees its outcome). Paused clock, frozen server.
#[tokio::test]
async fn records_a_silent_redis_does_not_answer_hold_one_caller_not_all() {
    let (server, backend, timeout) = timing_out_backend("silent").await;
    let backend = backend.with_deferred_successes(false);
    let gate = backend.gate(&"s".into(), &config(100));
    // Scripts loaded, and three admissions in hand while the server answers.
    call(&gate, S).await;
    let tickets = [admit(&gate).await, admit(&gate).await, admit(&gate).await];

    server.freeze();
    tokio::time::pause();
    let start = tokio::time::Instant::now();
    gate.record(tickets[0], BreakerVerdict::Failure).await;
    assert!(
        start.elapsed() >= timeout,
        "the first record waited out the timeout"
    );
    assert_eq!(gate.record_errors(), 1);
    let second = gate.record(tickets[1], BreakerVerdict::Failure);
    assert!(
        futures_util::FutureExt::now_or_never(second).is_some(),
        "not held while records fail"
    );
    // Its record still went out, and failed on its own.
    tokio::time::sleep(timeout * 2).await;
    assert_eq!(gate.record_errors(), 2);
    tokio::time::resume();
    server.thaw();

    // Landed (not waited for: the last one failed), then callers wait again.
    call(&gate, F).await;
    for _ in 0..100 {
        let waited = gate.record(tickets[2], BreakerVerdict::Failure);
        if futures_util::FutureExt::now_or_never(waited).is_none() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("records were never waited for again after one landed");
}

/// An admission Redis answers ends the "records fail" state as a landed record does:
/// callers wait for their records again at once after an outage, not only once a
/// record sent after it landed (with successes kept under the view, the first record
/// after an outage may be the failure that opens the breaker, and its caller's next
/// admission must see it).
#[tokio::test]
async fn an_answered_admission_makes_callers_wait_for_their_records_again() {
    let (server, backend, _) = timing_out_backend("answered").await;
    let backend = backend.with_closed_view(Duration::ZERO);
    let gate = backend.gate(&"s".into(), &config(100));
    call(&gate, S).await;
    let failed = admit(&gate).await;
    server.freeze();
    tokio::time::pause();
    gate.record(failed, BreakerVerdict::Failure).await;
    tokio::time::resume();
    server.thaw();
    assert_eq!(gate.record_errors(), 1);
    let next = admit(&gate).await; // asked (no view), answered
    let waited = gate.record(next, BreakerVerdict::Failure);
    assert!(
        futures_util::FutureExt::now_or_never(waited).is_none(),
        "the record is waited for again"
    );
}
