//! Redis-only properties: never over quota under many processes, one round trip per
//! operation, failing closed when the server dies.

mod common;

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Harness;
use pgw_core::redis_conn::{RedisConn, RedisTarget};
use pgw_core::{BackendUnavailable, BoxError};
use pgw_test_support::PrivateRedis;
use tower::{Service, ServiceExt, service_fn};
use tower_layer::Layer;
use tower_ratelimit_redis::{
    HoldScope, NoTokens, Quota, RateLimitConfig, RateLimitLayer, RateLimiter, RedisBackend,
};

/// Several connections (stand-ins for processes), 64 tasks hammering RPM 5 and TPM 50
/// with 10-token requests: every window admits exactly 5 requests and 50 tokens, never
/// more, judged by admission instants on the server clock.
async fn hammer(target: RedisTarget) {
    let prefix = pgw_test_support::unique_prefix("hammer");
    let window = Duration::from_secs(1);
    let config = RateLimitConfig::new("s4", Quota::unlimited().requests(5))
        .account("acct", Quota::unlimited().tokens(50))
        .window(window)
        .key_prefix(prefix.clone());
    let mut limiters = Vec::new();
    for _ in 0..4 {
        let conn = RedisConn::connect(&target).await.unwrap();
        limiters.push(RateLimiter::new(config.clone(), RedisBackend::new(conn)).unwrap());
    }
    let conn = RedisConn::connect(&target).await.unwrap();
    let h = Harness {
        backend: RedisBackend::new(conn.clone()).into(),
        prefix,
        exact: false,
        conn: Some(conn),
    };
    h.align(window).await;
    let admitted = Arc::new(Mutex::new(Vec::new()));
    let stop = tokio::time::Instant::now() + Duration::from_millis(3500);
    let mut tasks = Vec::new();
    for i in 0..64 {
        let l = limiters[i % limiters.len()].clone();
        let admitted = admitted.clone();
        tasks.push(tokio::spawn(async move {
            while tokio::time::Instant::now() < stop {
                match l.acquire(10).await {
                    Ok(p) => {
                        admitted.lock().unwrap().push(p.admission().clone());
                        p.finish(Some(10)).await.unwrap();
                    }
                    Err(e) => {
                        assert!(e.is::<pgw_core::QuotaExceeded>(), "{e}");
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let admitted = admitted.lock().unwrap();
    let mut per_window: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for a in admitted.iter() {
        let by_instant = u64::try_from(a.at().as_millis() / window.as_millis()).unwrap();
        assert_eq!(a.window(), by_instant, "window id follows the server instant");
        let e = per_window.entry(by_instant).or_default();
        e.0 += 1;
        e.1 += a.tokens();
    }
    assert!(per_window.len() >= 3, "{per_window:?}");
    for (w, (n, t)) in &per_window {
        assert!(
            *n <= 5 && *t <= 50,
            "window {w} over quota: {n} requests, {t} tokens"
        );
    }
    // Every window but the last (cut by the stop) is full: exactly the quota.
    let full: Vec<_> = per_window.values().take(per_window.len() - 1).collect();
    for (n, t) in full {
        assert_eq!((*n, *t), (5, 50), "{per_window:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_over_quota_standalone() {
    hammer(common::standalone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_over_quota_cluster() {
    hammer(common::cluster()).await;
}

/// `calls=` of a `cmdstat_NAME:calls=..,usec=..` line.
fn calls(info: &str, cmd: &str) -> u64 {
    let prefix = format!("cmdstat_{cmd}:calls=");
    info.lines()
        .find_map(|l| l.trim().strip_prefix(prefix.as_str()))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |v| v.parse().unwrap())
}

/// A private Redis and a connection to it.
async fn private_redis() -> (PrivateRedis, RedisConn) {
    let server = PrivateRedis::start();
    let conn = RedisConn::connect(&RedisTarget::Standalone(server.url()))
        .await
        .unwrap();
    (server, conn)
}

/// Client commands seen by `MONITOR` (script-internal calls are marked `lua` and
/// left out), collected by a `redis-cli monitor` child.
struct Monitor {
    child: std::process::Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Monitor {
    fn start(port: u16) -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new("redis-cli")
            .args(["-p", &port.to_string(), "monitor"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if line == "OK" {
                    let _ = tx.send(());
                } else {
                    sink.lock().unwrap().push(line);
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(5)).expect("MONITOR started");
        Self { child, lines }
    }

    fn client_commands(mut self) -> Vec<String> {
        std::thread::sleep(Duration::from_millis(200));
        let _ = self.child.kill();
        let _ = self.child.wait();
        let lines = self.lines.lock().unwrap();
        lines
            .iter()
            .filter(|l| !l.contains(" lua]"))
            .map(|l| l.split('"').nth(1).unwrap_or_default().to_lowercase())
            .collect()
    }
}

/// Exactly one round trip per admission, per settle and per hold, counted by the
/// server (INFO commandstats on a private server nobody else uses). A settle that
/// gives only tokens back is its lease's `ZREM`s (pipelined, one per scope with a
/// concurrency quota); the next admission's script gives the tokens back.
#[tokio::test]
async fn one_round_trip_per_operation() {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let conn = RedisConn::connect(&target).await.unwrap();
    let l = RateLimiter::new(
        RateLimitConfig::new(
            "s1",
            Quota::unlimited()
                .requests(10_000)
                .tokens(1_000_000)
                .concurrency(1000),
        )
        .account(
            "acct",
            Quota::unlimited()
                .requests(10_000)
                .tokens(1_000_000)
                .concurrency(1000),
        ),
        RedisBackend::new(conn.clone()),
    )
    .unwrap();
    // Warm-up loads the scripts (NOSCRIPT -> SCRIPT LOAD, once per server); its settle
    // changes a count (1 token reserved, none used), so the settle script runs.
    l.acquire(1).await.unwrap().finish(Some(0)).await.unwrap();
    l.hold(HoldScope::Both, Duration::from_millis(1)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let mut info_conn = conn.clone();
    let info = |c: &mut RedisConn| {
        let mut c = c.clone();
        async move {
            redis::cmd("INFO")
                .arg("all")
                .query_async::<String>(&mut c)
                .await
                .unwrap()
        }
    };
    let before = info(&mut info_conn).await;
    let monitor = Monitor::start(server.port());
    const N: u64 = 50;
    for _ in 0..N {
        let p = l.acquire(7).await.unwrap();
        p.finish(Some(3)).await.unwrap();
    }
    l.hold(HoldScope::Both, Duration::from_millis(1)).await.unwrap();
    let seen = monitor.client_commands();
    let after = info(&mut info_conn).await;
    let evalsha = calls(&after, "evalsha") - calls(&before, "evalsha");
    assert_eq!(evalsha, N + 1, "an admission per call, one per hold");
    let zrem = seen.iter().filter(|c| *c == "zrem").count() as u64;
    assert_eq!(zrem, 2 * N, "a ZREM per scope per settle: {seen:?}");
    assert_eq!(seen.len() as u64, 3 * N + 1, "client commands: {seen:?}");
    assert!(seen.iter().all(|c| c == "evalsha" || c == "zrem"), "{seen:?}");
}

/// Scripts (`EVALSHA`) and every command in total (scripts' own included) the server
/// has run, from `INFO commandstats`, leaving out the `INFO`s that read them.
async fn commands(conn: &RedisConn) -> (u64, u64) {
    let mut c = conn.clone();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut c)
        .await
        .unwrap();
    let mut total = 0;
    for l in info.lines() {
        if let Some(rest) = l.trim().strip_prefix("cmdstat_")
            && let Some((name, stats)) = rest.split_once(":calls=")
            && name != "info"
        {
            total += stats.split(',').next().unwrap().parse::<u64>().unwrap();
        }
    }
    (calls(&info, "evalsha"), total)
}

/// Redis scripts and commands per call through the layer, for a limiter with nothing
/// to enforce, RPM only, and RPM + TPM + concurrency in the source and its account:
/// none, one (admission), one (admission; the settle, which the answer does not wait
/// for, is a `ZREM` per scope, and the tokens it gives back ride with the next
/// admission). Printed for the README.
#[tokio::test]
async fn redis_commands_per_call() {
    let server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let conn = RedisConn::connect(&target).await.unwrap();
    let full = Quota::unlimited()
        .requests(10_000)
        .tokens(1_000_000)
        .concurrency(1000);
    let cases = [
        ("unlimited", RateLimitConfig::new("s0", Quota::unlimited()), 0),
        (
            "rpm",
            RateLimitConfig::new("s1", Quota::unlimited().requests(10_000)),
            1,
        ),
        (
            "rpm+tpm+concurrency, account",
            RateLimitConfig::new("s2", full).account("acct", full),
            1,
        ),
    ];
    for (name, config, scripts) in cases {
        // Long enough that no background hold refresh falls inside the measurement.
        let config = config.hold_refresh(Duration::from_secs(60));
        let l = RateLimiter::new(config, RedisBackend::new(conn.clone())).unwrap();
        let mut svc = RateLimitLayer::new(l.clone())
            .token_estimate(|_: &()| 7)
            .usage(|_: &()| Some(3))
            .layer(service_fn(|_: ()| async { Ok::<_, BoxError>(()) }));
        // Warm-up: loads the scripts, reads the holds once.
        svc.ready().await.unwrap().call(()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (sc0, all0) = commands(&conn).await;
        const N: u64 = 50;
        for _ in 0..N {
            svc.ready().await.unwrap().call(()).await.unwrap();
        }
        // The settles finish in the background.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (sc1, all1) = commands(&conn).await;
        #[allow(clippy::cast_precision_loss)]
        let per_call = (all1 - all0) as f64 / N as f64;
        println!(
            "{name}: {} scripts, {per_call:.1} commands per call",
            (sc1 - sc0) / N
        );
        assert_eq!(sc1 - sc0, scripts * N, "{name}");
        assert_eq!(l.stats().admitted, N + 1);
        assert_eq!(l.stats().settle_failures, 0);
        assert_eq!(
            l.held().await.unwrap().leases(),
            0,
            "{name}: every lease released"
        );
    }
}

/// A settle that changes no count (the call used what it reserved, or no count is
/// limited) only gives its lease back: one `ZREM` per scope with a concurrency quota,
/// pipelined, no script. The slot is free for another process once it has answered.
#[tokio::test]
async fn a_lease_only_settle_is_one_zrem_per_scope_and_no_script() {
    let (_server, conn) = private_redis().await;
    let quota = Quota::unlimited().requests(10_000).concurrency(1);
    let config = || {
        RateLimitConfig::new("s1", quota)
            .account("acct", quota)
            .hold_refresh(Duration::from_secs(60))
    };
    let here = RateLimiter::new(config(), RedisBackend::new(conn.clone())).unwrap();
    let elsewhere = RateLimiter::new(config(), RedisBackend::new(conn.clone())).unwrap();
    // Warm-up: the admission and settle scripts loaded, holds read once.
    here.acquire(0).await.unwrap().refund().await.unwrap();
    const N: u64 = 20;
    for _ in 0..N {
        let permit = here.acquire(0).await.unwrap();
        assert_eq!(
            elsewhere.held().await.unwrap().leases(),
            2,
            "the slot of each scope is taken"
        );
        let (scripts0, all0) = commands(&conn).await;
        permit.finish(None).await.unwrap();
        let (scripts1, all1) = commands(&conn).await;
        assert_eq!(scripts1 - scripts0, 0, "no script for a lease-only settle");
        assert_eq!(all1 - all0, 2, "one ZREM per scope (source and account)");
        assert_eq!(elsewhere.held().await.unwrap().leases(), 0, "free for everyone");
    }
    // Another process takes the slot given back.
    elsewhere.acquire(0).await.unwrap().finish(None).await.unwrap();
    // A settle that changes a count still runs the script (a refund here).
    let permit = here.acquire(0).await.unwrap();
    let (scripts0, _) = commands(&conn).await;
    permit.refund().await.unwrap();
    let (scripts1, _) = commands(&conn).await;
    assert_eq!(scripts1 - scripts0, 1);
    assert_eq!(here.held().await.unwrap().leases(), 0);
    assert_eq!(here.stats().settle_failures, 0);
}

/// A settle that gives only tokens back (the call used fewer than its estimate) runs
/// no script: the next admission this process sends carries the tokens, and gives them
/// back before its checks, even when it is refused. Here another process sees them
/// once this one's refused admission carried them.
#[tokio::test]
async fn a_token_refund_rides_with_the_next_admission_even_a_refused_one() {
    let (_server, conn) = private_redis().await;
    // Sub-windows of 6 s: no flush of the deferred refund falls inside the test.
    let config = || {
        RateLimitConfig::new("s1", Quota::unlimited().tokens(100).concurrency(1))
            .window(Duration::from_secs(60))
            .sub_windows(10)
            .hold_refresh(Duration::from_secs(60))
    };
    let here = RateLimiter::new(config(), RedisBackend::new(conn.clone())).unwrap();
    let elsewhere = RateLimiter::new(config(), RedisBackend::new(conn.clone())).unwrap();
    // Warm-up: the scripts loaded.
    here.acquire(0).await.unwrap().refund().await.unwrap();
    let p = here.acquire(90).await.unwrap();
    let (s0, all0) = commands(&conn).await;
    p.finish(Some(0)).await.unwrap();
    let (s1, all1) = commands(&conn).await;
    assert_eq!(s1 - s0, 0, "no script for a settle that gives only tokens back");
    assert_eq!(all1 - all0, 1, "its lease's ZREM");
    // Not given back yet: 90 of 100 still count for everyone else.
    let e = elsewhere.acquire(20).await.unwrap_err();
    assert!(e.to_string().contains("tpm"), "{e}");
    // The other process takes the slot; this one's next admission is refused for it,
    // and carries the refund all the same.
    let slot = elsewhere.acquire(0).await.unwrap();
    let (s0, _) = commands(&conn).await;
    let e = here.acquire(5).await.unwrap_err();
    assert!(e.to_string().contains("concurrency"), "{e}");
    let (s1, _) = commands(&conn).await;
    assert_eq!(s1 - s0, 1, "the refused admission went to Redis");
    slot.finish(None).await.unwrap();
    // The whole quota is free again: the 90 came back with the refused admission.
    elsewhere
        .acquire(100)
        .await
        .expect("the refund landed with the refused admission")
        .finish(Some(100))
        .await
        .unwrap();
    assert_eq!(here.stats().settle_failures, 0);
}

/// On a cluster, whose client may run a script twice, tokens given back go by the
/// settle script at once (its lease check keeps a second run from giving back again),
/// not with the next admission (which has no lease to tell a second run by): another
/// process sees them at once.
#[tokio::test]
async fn on_a_cluster_a_token_refund_goes_at_once() {
    let h = Harness::redis(common::cluster(), "cluster_token_refund").await;
    let config = h
        .config("s1", Quota::unlimited().tokens(100).concurrency(2))
        .window(Duration::from_secs(60));
    let here = h.limiter(config.clone());
    let elsewhere = h.other_process(config).unwrap();
    let p = here.acquire(90).await.unwrap();
    p.finish(Some(0)).await.unwrap();
    elsewhere
        .acquire(100)
        .await
        .expect("the 90 given back at once")
        .finish(Some(100))
        .await
        .unwrap();
    assert_eq!(here.stats().settle_failures, 0);
}

/// A deferred token refund that no admission carries lands on its own within a
/// quarter window (a settle script the first deferral schedules): a process that goes
/// quiet does not keep its unused estimate counted for the rest of the window.
#[tokio::test]
async fn a_deferred_token_refund_lands_within_a_quarter_window_without_an_admission() {
    let (_server, conn) = private_redis().await;
    // Four sub-windows of 2 s: the refund is sent after one. Without it, the 90
    // would count for 8 s and more.
    let config = || {
        RateLimitConfig::new("s1", Quota::unlimited().tokens(100))
            .window(Duration::from_secs(8))
            .sub_windows(4)
            .hold_refresh(Duration::from_secs(60))
    };
    let here = RateLimiter::new(config(), RedisBackend::new(conn.clone())).unwrap();
    let elsewhere = RateLimiter::new(config(), RedisBackend::new(conn.clone())).unwrap();
    let p = here.acquire(90).await.unwrap();
    p.finish(Some(10)).await.unwrap();
    let e = elsewhere.acquire(20).await.unwrap_err();
    assert!(e.to_string().contains("tpm"), "80 not given back yet: {e}");
    let (s0, _) = commands(&conn).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (s1, _) = commands(&conn).await;
    assert_eq!(s1 - s0, 1, "one settle script sent the deferred refund");
    elsewhere
        .acquire(90)
        .await
        .expect("10 used + 90 fit once the refund landed")
        .finish(Some(90))
        .await
        .unwrap();
}

/// A settle sent without waiting is the settle script's first use on a fresh server
/// (its earlier settles gave only leases back, with `ZREM`s), and it still lands before
/// the caller's next admission: the backend's first admission loaded the script.
/// Without that, the `EVALSHA` answered NOSCRIPT and was sent again after the
/// admission, which did not see the tokens given back.
#[tokio::test]
async fn a_detached_settle_lands_first_on_a_fresh_server() {
    let (_server, conn) = private_redis().await;
    let l = RateLimiter::new(
        RateLimitConfig::new("s1", Quota::unlimited().tokens(100).concurrency(1))
            .hold_refresh(Duration::from_secs(60)),
        RedisBackend::new(conn.clone()),
    )
    .unwrap();
    // Settles that change no count: leases given back, no script.
    for _ in 0..3 {
        l.acquire(0).await.unwrap().finish(None).await.unwrap();
    }
    // A refund (the call was not admitted below) runs the settle script. (Tokens
    // alone given back would ride with the next admission, no script.)
    let p = l.acquire(60).await.unwrap();
    p.refund_detached();
    // 60 more fit only with the 60 reserved given back.
    l.acquire(60).await.unwrap().finish(Some(60)).await.unwrap();
    assert_eq!(l.stats().settle_failures, 0);
}

/// Waiting on Redis never polls: a wait for the window's end is one try at its end
/// (with jitter after it), and a wait for a slot backs off, doubling from the 50 ms
/// hint: a second's wait costs a handful of tries, not twenty. Counted in `EVALSHA`
/// (admission tries are the limiter's only round trips here).
#[tokio::test]
async fn waiting_on_redis_tries_by_retry_after_not_by_poll() {
    use tower_ratelimit_redis::Mode;
    let (_server, conn) = private_redis().await;
    let wait = Mode::Wait { max_wait: None };
    let l = RateLimiter::new(
        RateLimitConfig::new("s1", Quota::unlimited().requests(1))
            .window(Duration::from_secs(1))
            .mode(wait)
            .jitter_seed(7),
        RedisBackend::new(conn.clone()),
    )
    .unwrap();
    let mut svc = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|_: ()| async { Ok::<_, BoxError>(()) }));
    svc.ready().await.unwrap().call(()).await.unwrap();
    let (before, _) = commands(&conn).await;
    svc.ready().await.unwrap().call(()).await.unwrap();
    let (after, _) = commands(&conn).await;
    // The first admission said it filled the window: refused here (counted), then
    // admitted at the window's end, one round trip.
    assert_eq!(after - before, 1, "refused here, admitted at the window's end");
    assert_eq!((l.stats().admitted, l.stats().refused), (2, 1));

    let l = RateLimiter::new(
        RateLimitConfig::new("s2", Quota::unlimited().concurrency(1))
            .mode(wait)
            .jitter_seed(7),
        RedisBackend::new(conn.clone()),
    )
    .unwrap();
    let svc = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|_: ()| async { Ok::<_, BoxError>(()) }));
    let held = l.acquire(0).await.unwrap();
    let waiter = tokio::spawn(svc.oneshot(()));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let refused = l.stats().refused;
    // A 50 ms poll would have tried 20 times; 0, 50, 150, 350, 750 ms (plus jitter).
    assert!((2..=5).contains(&refused), "{refused} tries in a second");
    held.finish(None).await.unwrap();
    waiter.await.unwrap().unwrap();
    assert_eq!(l.stats().admitted, 2);
    assert_eq!(l.held().await.unwrap().leases(), 0);
}

/// A wait for a slot shorter than the slot hint, on Redis: the slot another process
/// frees meanwhile is taken at the wait's last try, which asks Redis. Before, the
/// remembered refusal (trusted for the hint) answered that try: refused, with the slot
/// free for 190 ms.
#[tokio::test]
async fn a_slot_freed_by_another_process_is_seen_at_the_last_try() {
    use tower_ratelimit_redis::Mode;
    let (_server, conn) = private_redis().await;
    let config = |max_wait| {
        RateLimitConfig::new("s1", Quota::unlimited().concurrency(1))
            .slot_retry_after(Duration::from_secs(5))
            .mode(Mode::Wait { max_wait })
            .jitter_seed(7)
    };
    // Two processes: two backends on one Redis.
    let other = RateLimiter::new(config(None), RedisBackend::new(conn.clone())).unwrap();
    let here = RateLimiter::new(
        config(Some(Duration::from_millis(200))),
        RedisBackend::new(conn.clone()),
    )
    .unwrap();
    let svc = RateLimitLayer::new(here.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|_: ()| async { Ok::<_, BoxError>(()) }));
    let held = other.acquire(0).await.unwrap();
    let waiter = tokio::spawn(svc.oneshot(()));
    tokio::time::sleep(Duration::from_millis(10)).await;
    held.finish(None).await.unwrap();
    waiter.await.unwrap().expect("admitted at the last try");
    assert_eq!(here.stats().admitted, 1);
    assert_eq!(here.held().await.unwrap().leases(), 0);
}

/// A limiter with nothing to enforce admits from its cached holds: a hold set through
/// this process is honoured at once; one set by another process is honoured by every
/// admission that starts `hold_refresh` after it; and with the server gone, admission
/// fails closed once the cache is older than `hold_refresh`.
#[tokio::test]
async fn unlimited_honours_holds_within_the_refresh_bound() {
    let mut server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let connect = || async {
        RedisConn::connect_with(&target, Duration::from_millis(200), Duration::from_millis(200))
            .await
            .unwrap()
    };
    let every = Duration::from_millis(300);
    let config = RateLimitConfig::new("s1", Quota::unlimited())
        .account("acct", Quota::unlimited())
        .hold_refresh(every)
        .response_timeout(Duration::from_millis(200));
    let here = RedisBackend::new(connect().await);
    let l = RateLimiter::new(config.clone(), here.clone()).unwrap();
    let sibling = RateLimiter::new(config.clone(), here).unwrap();
    let other_process = RateLimiter::new(config, RedisBackend::new(connect().await)).unwrap();
    l.acquire(0).await.unwrap();

    // This process: at once, through another limiter of the same backend.
    sibling
        .hold(HoldScope::Source, Duration::from_millis(400))
        .await
        .unwrap();
    let err = l.acquire(0).await.unwrap_err();
    let q = err.downcast_ref::<pgw_core::QuotaExceeded>().unwrap();
    assert_eq!((q.dimension(), q.scope()), ("hold", Some("source:s1")));
    tokio::time::sleep(q.retry_after()).await;
    l.acquire(0).await.expect("admitted when the hold ends");

    // Another process: within `hold_refresh`.
    other_process
        .hold(HoldScope::Account, Duration::from_secs(5))
        .await
        .unwrap();
    tokio::time::sleep(every).await;
    let err = l.acquire(0).await.unwrap_err();
    let q = err.downcast_ref::<pgw_core::QuotaExceeded>().unwrap();
    assert_eq!((q.dimension(), q.scope()), ("hold", Some("account:acct")));

    server.stop();
    tokio::time::sleep(every).await;
    let err = l.acquire(0).await.unwrap_err();
    let e = err.downcast_ref::<BackendUnavailable>().expect("fails closed");
    assert_eq!((e.backend(), e.operation()), ("redis", "admit"));
}

/// The server dies: admission fails closed with BackendUnavailable, settling failures
/// are counted, nothing panics, and the service answers the error quickly.
#[tokio::test]
async fn redis_down_fails_closed() {
    let mut server = PrivateRedis::start();
    let target = RedisTarget::Standalone(server.url());
    let conn = RedisConn::connect_with(&target, Duration::from_millis(200), Duration::from_millis(200))
        .await
        .unwrap();
    let l = RateLimiter::new(
        // Three slots: the two leases below do not fill it (a full scope would refuse
        // here, from the memory the filling admission left).
        RateLimitConfig::new("s1", Quota::unlimited().concurrency(3))
            .response_timeout(Duration::from_millis(200)),
        RedisBackend::new(conn),
    )
    .unwrap();
    let p1 = l.acquire(0).await.unwrap();
    let p2 = l.acquire(0).await.unwrap();
    server.stop();

    let err = l.acquire(0).await.unwrap_err();
    let e = err.downcast_ref::<BackendUnavailable>().expect("fails closed");
    assert_eq!((e.backend(), e.operation()), ("redis", "admit"));
    assert_eq!(l.stats().unavailable, 1);

    let err = p1.finish(Some(5)).await.unwrap_err();
    assert_eq!(err.operation(), "settle");
    assert_eq!(l.stats().settle_failures, 1);
    drop(p2); // background release fails: counted, not a panic
    for _ in 0..100 {
        if l.stats().settle_failures == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(l.stats().settle_failures, 2);
    assert!(l.hold(HoldScope::Source, Duration::from_secs(1)).await.is_err());

    let mut svc = RateLimitLayer::new(l.clone())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|_: ()| async { Ok::<_, BoxError>(()) }));
    let started = tokio::time::Instant::now();
    let err = svc.ready().await.unwrap().call(()).await.unwrap_err();
    assert!(err.is::<BackendUnavailable>(), "{err}");
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// A caller that gives up while the admission round trip is in flight (the script may
/// already have reserved) costs nothing: the request, its tokens and its lease are
/// given back when the answer arrives, through the layer and through `acquire` alike.
#[tokio::test]
async fn dropped_while_admitting_gives_everything_back() {
    use futures_util::FutureExt;
    use std::task::{Context, Waker};

    let h = Harness::redis(common::standalone(), "dropped_while_admitting").await;
    // One request per minute: without the refund the second admission fails for the
    // rest of the window; one slot whose lease lives a minute.
    let l = h.limiter(
        RateLimitConfig::new("s1", Quota::unlimited().requests(1).tokens(10).concurrency(1))
            .lease_ttl(Duration::from_secs(60)),
    );
    let mut svc = RateLimitLayer::new(l.clone())
        .token_estimate(|_: &()| 10)
        .usage(NoTokens)
        .layer(service_fn(|_: ()| async { Ok::<_, BoxError>(()) }));
    let mut fut = Box::pin(svc.ready().await.unwrap().call(()));
    // One poll sends the script; the answer is not back yet.
    assert!(
        fut.as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_pending()
    );
    drop(fut);
    let again = async {
        for _ in 0..200 {
            if let Ok(p) = l.acquire(10).await {
                return Some(p);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        None
    };
    let p = again
        .await
        .expect("the dropped admission was refunded and its lease released");
    assert_eq!(l.stats().settle_failures, 0);
    p.refund().await.unwrap();

    // The same through `acquire`: polled once, then dropped.
    assert!(l.acquire(10).now_or_never().is_none());
    let mut back = false;
    for _ in 0..200 {
        if let Ok(p) = l.acquire(10).await {
            back = true;
            p.refund().await.unwrap();
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(back, "a dropped acquire gives its reservation back");
}

/// A TCP link to a server that can be cut: while cut, its connections are closed and
/// new ones closed at once (a network outage; the server keeps its state, unlike a
/// killed and restarted one).
struct Wire {
    addr: std::net::SocketAddr,
    cut: tokio::sync::watch::Sender<bool>,
}

impl Wire {
    async fn to(port: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, watch) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if *watch.borrow() {
                    continue; // dropped: closed at once
                }
                let mut watch = watch.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = watch.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        Self { addr, cut }
    }

    fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    fn cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

/// A release that fails in an outage leaves its lease in Redis, held until its TTL and
/// then gone, by itself: `held` reads it from the server, where the limiter's own
/// counters only say that the release failed.
#[tokio::test]
async fn a_release_lost_in_an_outage_is_held_until_its_ttl() {
    let server = PrivateRedis::start();
    let wire = Wire::to(server.port()).await;
    let ttl = Duration::from_secs(2);
    let config = RateLimitConfig::new("s1", Quota::unlimited().concurrency(2))
        .account("acct", Quota::unlimited().concurrency(4))
        .lease_ttl(ttl)
        .response_timeout(Duration::from_millis(200));
    let connect = |url: String| async move {
        let target = RedisTarget::Standalone(url);
        RedisConn::connect_with(&target, Duration::from_millis(200), Duration::from_millis(200))
            .await
            .unwrap()
    };
    // This process reaches Redis over the wire; another one (the observer) directly.
    let l = RateLimiter::new(config.clone(), RedisBackend::new(connect(wire.url()).await)).unwrap();
    let observer = RateLimiter::new(config, RedisBackend::new(connect(server.url()).await)).unwrap();

    let before = tokio::time::Instant::now();
    let lost = l.acquire(0).await.unwrap();
    let admitted = tokio::time::Instant::now();
    l.acquire(0).await.unwrap().finish(None).await.unwrap();
    let held = observer.held().await.unwrap();
    assert_eq!(
        (held.source.leases, held.account.as_ref().unwrap().leases),
        (1, 1)
    );

    wire.cut(true);
    let err = lost.finish(None).await.unwrap_err();
    assert_eq!(err.operation(), "settle");
    assert_eq!(l.stats().settle_failures, 1);
    let err = l.held().await.unwrap_err();
    assert_eq!(err.operation(), "held");
    wire.cut(false);

    // Still held in both scopes: the server never heard of the release.
    let held = observer.held().await.unwrap();
    assert_eq!(
        (held.source.leases, held.account.as_ref().unwrap().leases),
        (1, 1)
    );
    let left = held.source.leases_expire_in.unwrap();
    assert!(left <= ttl, "{left:?}");
    // The limiter's own connection comes back and sees the same.
    let mut back = None;
    for _ in 0..100 {
        if let Ok(h) = l.held().await {
            back = Some(h);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(back.expect("the wire is back").leases(), 2);
    // The lease expires no sooner than `ttl` after the admission was sent.
    tokio::time::sleep_until(before + ttl - Duration::from_millis(300)).await;
    assert_eq!(observer.held().await.unwrap().leases(), 2, "held until its TTL");
    // ... and no later than `ttl` after its answer came back.
    tokio::time::sleep_until(admitted + ttl + Duration::from_millis(50)).await;
    let held = observer.held().await.unwrap();
    assert_eq!(held.leases(), 0, "gone by its TTL: {held:?}");
    assert!(held.scopes().all(|s| s.leases_expire_in.is_none()));
    // Its slots are free again, with no purge or release by anyone.
    let a = l.acquire(0).await.unwrap();
    let b = l.acquire(0).await.unwrap();
    a.finish(None).await.unwrap();
    b.finish(None).await.unwrap();
    assert_eq!(l.stats().settle_failures, 1);
}

/// A private Redis, a connection to it, and source `s1`'s limiter on it: `requests`
/// per 1 s window, nothing else limited.
async fn rpm_on_private_redis(requests: u64) -> (PrivateRedis, RedisConn, RateLimiter) {
    let (server, conn) = private_redis().await;
    let l = RateLimiter::new(
        RateLimitConfig::new("s1", Quota::unlimited().requests(requests)).window(Duration::from_secs(1)),
        RedisBackend::new(conn.clone()),
    )
    .unwrap();
    (server, conn, l)
}

/// A refused request quota is remembered until its `retry_after`: the waiting calls'
/// rounds ask this process, not Redis (nothing can free a request count before the
/// oldest sub-window leaves); a refund forgets it; and once the wait is over the next
/// admission asks Redis again and is admitted.
#[tokio::test]
async fn a_refused_request_quota_is_not_asked_again_before_its_retry_after() {
    let (_server, conn, l) = rpm_on_private_redis(1).await;
    // The admission that takes the window's last request says so, and until when:
    // the next ones are refused here, without asking.
    l.acquire(0).await.unwrap().finish(None).await.unwrap();
    let (before, _) = commands(&conn).await;
    let mut waits = Vec::new();
    for _ in 0..5 {
        let e = l.acquire(0).await.unwrap_err();
        match pgw_core::NotAdmitted::of(&*e) {
            Some(pgw_core::NotAdmitted::QuotaExceeded(d)) => waits.push(d),
            other => panic!("{other:?}: {e}"),
        }
    }
    let (after, _) = commands(&conn).await;
    assert_eq!(after - before, 0, "the filling admission told the refusal");
    assert!(waits.windows(2).all(|w| w[1] <= w[0]), "{waits:?}");
    // At most a window and a sub-window of slack (the server's clock, 60 sub-windows).
    assert!(
        waits[0] > Duration::ZERO && waits[0] <= Duration::from_millis(1100),
        "{waits:?}"
    );
    assert_eq!(l.stats().refused, 5);
    tokio::time::sleep(waits[4] + Duration::from_millis(50)).await;
    let (before, _) = commands(&conn).await;
    let p = l
        .acquire(0)
        .await
        .expect("admitted once the oldest sub-window left");
    let (after, _) = commands(&conn).await;
    assert_eq!(after - before, 1, "asked Redis again");
    // Refused again (and remembered); then the admitted request is given back (not
    // admitted below): the refund frees its place and forgets the refusal.
    assert!(l.acquire(0).await.is_err());
    p.refund().await.unwrap();
    let p = l
        .acquire(0)
        .await
        .expect("the refund freed the place and forgot the refusal");
    p.finish(None).await.unwrap();
}

/// A refund forgets only the refusals it can free: tokens given back (an estimate
/// above the usage, nearly every settle) leave a remembered request-count refusal in
/// place, so the waiting calls keep asking this process; they forget a token refusal,
/// and the next admission asks Redis and fits.
#[tokio::test]
async fn a_refund_of_tokens_forgets_a_token_refusal_but_not_a_request_one() {
    let (_server, conn) = private_redis().await;
    let l = RateLimiter::new(
        RateLimitConfig::new("s1", Quota::unlimited().requests(2).tokens(100))
            .window(Duration::from_secs(60)),
        RedisBackend::new(conn.clone()),
    )
    .unwrap();
    // Tokens: 60 of 100 reserved; another 60 is refused once over the wire, then here.
    let first = l.acquire(60).await.unwrap();
    let (before, _) = commands(&conn).await;
    assert!(l.acquire(60).await.is_err(), "over the token quota");
    assert!(l.acquire(60).await.is_err(), "still over it");
    let (after, _) = commands(&conn).await;
    assert_eq!(after - before, 1, "one round trip learned the token refusal");
    // 50 of the 60 come back: the token refusal is forgotten and the next one fits.
    first.finish(Some(10)).await.unwrap();
    let (before, _) = commands(&conn).await;
    let second = l.acquire(60).await.expect("the refund made room");
    let (after, _) = commands(&conn).await;
    assert_eq!(after - before, 1, "asked Redis again after the token refund");
    // That admission took the window's last request: remembered. Its tokens come back
    // (used 1 of 60), which frees no request: still refused here, without asking.
    second.finish(Some(1)).await.unwrap();
    let (before, _) = commands(&conn).await;
    for _ in 0..3 {
        let e = l.acquire(0).await.unwrap_err();
        match pgw_core::NotAdmitted::of(&*e) {
            Some(pgw_core::NotAdmitted::QuotaExceeded(d)) => assert!(d > Duration::ZERO, "{d:?}"),
            other => panic!("{other:?}: {e}"),
        }
    }
    let (after, _) = commands(&conn).await;
    assert_eq!(after - before, 0, "a refund of tokens frees no request");
}

/// A refusal answered after a refund was sent but judged before it landed is
/// forgotten when the refund lands: the refund counts when it is sent and again when it
/// lands. A refund in the background (`refund_detached`) lands after an admission the
/// caller asks at once, which Redis refuses (the request is not back yet); once the
/// refund has landed, the next admission asks Redis and is admitted. Before, the
/// refusal was answered here for its sub-window (1 s).
///
/// The refund lands late as after a restart of Redis, which forgets its scripts: the
/// settle script is flushed (the backend's first admission had loaded it), so the
/// refund is answered NOSCRIPT and sent again after the admission, whose script is
/// loaded again by another backend's admission that settles no count.
#[tokio::test]
async fn a_refusal_judged_before_a_refund_landed_is_forgotten_when_it_lands() {
    let (_server, conn) = private_redis().await;
    let config = RateLimitConfig::new("s1", Quota::unlimited().requests(1)).window(Duration::from_secs(60));
    assert_eq!(config.sub_window_len(), Duration::from_secs(1));
    let l = RateLimiter::new(config, RedisBackend::new(conn.clone())).unwrap();
    let p = l.acquire(0).await.unwrap();
    let mut c = conn.clone();
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut c)
        .await
        .unwrap();
    let slots_only = RateLimiter::new(
        RateLimitConfig::new("s2", Quota::unlimited().concurrency(1)),
        RedisBackend::new(conn.clone()),
    )
    .unwrap();
    slots_only.acquire(0).await.unwrap().finish(None).await.unwrap();
    p.refund_detached();
    let e = l.acquire(0).await.unwrap_err();
    assert!(
        e.to_string().contains("rpm"),
        "judged before the refund landed: {e}"
    );
    // Far less than the sub-window the refusal would be trusted for.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (before, _) = commands(&conn).await;
    let p = l
        .acquire(0)
        .await
        .expect("the landed refund forgot the refusal, and its request is back");
    let (after, _) = commands(&conn).await;
    assert_eq!(after - before, 1, "asked Redis");
    p.finish(None).await.unwrap();
}

/// Source `s1-{round}`'s limit of `quota` over a 60 s window of two 30 s sub-windows:
/// its config, the sub-window's length (ms), its window and lease keys.
fn one_minute_of_two(round: usize, quota: Quota) -> (RateLimitConfig, u64, String, String) {
    let config = RateLimitConfig::new(format!("s1-{round}"), quota)
        .window(Duration::from_secs(60))
        .sub_windows(2);
    let sub_ms = u64::try_from(config.sub_window_len().as_millis()).unwrap();
    let [[window_key, lease_key, _]] = <[[String; 3]; 1]>::try_from(RedisBackend::keys(&config)).unwrap();
    (config, sub_ms, window_key, lease_key)
}

/// Runs the settle script (window.lua prepended) as the limiter sends the refund of
/// one request admitted at `at_ms` to one scope of [`one_minute_of_two`] with rpm 1
/// (tpm unlimited, concurrency `concurrency`, -1 for none): `keys` its window and lease
/// keys (and a marker), `lease` the admission's lease member ("" for none).
async fn refund_one_request(
    conn: &RedisConn,
    keys: &[&str],
    sub_ms: u64,
    at_ms: u64,
    lease: &str,
    concurrency: i64,
) -> i64 {
    let settle = redis::Script::new(concat!(
        include_str!("../src/lua/window.lua"),
        include_str!("../src/lua/settle.lua")
    ));
    let mut inv = settle.prepare_invoke();
    for key in keys {
        inv.key(*key);
    }
    inv.arg(1)
        .arg(sub_ms)
        .arg(60_000 / sub_ms)
        .arg(at_ms)
        .arg(-1)
        .arg(0)
        .arg(lease)
        .arg(1)
        .arg(-1)
        .arg(concurrency);
    inv.invoke_async(&mut conn.clone()).await.unwrap()
}

/// B's request (admitted, its call finished) still counts in its window: another
/// process (no memory of refusals: it asks Redis) is refused on the rpm of 1.
async fn b_still_counts(config: RateLimitConfig, conn: &RedisConn) {
    let other = RateLimiter::new(config, RedisBackend::new(conn.clone())).unwrap();
    let e = other
        .acquire(0)
        .await
        .expect_err("B's request still counts: one a window");
    assert!(e.to_string().contains("rpm"), "{e}");
}

/// The same for a limiter without a concurrency quota, which has no lease to tell a
/// second run by: on a cluster, its settle names a marker of its own (`SET NX`), and
/// the script run again with it gives nothing back. Before, the second refund took
/// another call's request out of the window: two more admitted against rpm 1.
#[tokio::test]
async fn a_settle_without_a_lease_run_twice_gives_back_once() {
    let (_server, conn) = private_redis().await;
    for round in 0..3 {
        let (config, sub_ms, window_key, lease_key) =
            one_minute_of_two(round, Quota::unlimited().requests(1));
        let l = RateLimiter::new(config.clone(), RedisBackend::new(conn.clone())).unwrap();
        let a = l.acquire(0).await.unwrap();
        let at_ms = u64::try_from(a.admission().at().as_millis()).unwrap();
        // A's refund, as the limiter sends it on a cluster: one scope, the request
        // given back, no lease, rpm 1, tpm and concurrency unlimited, and its marker.
        let marker = format!("{window_key}:settled:test-{round}");
        let keys = [window_key.as_str(), lease_key.as_str(), marker.as_str()];
        let run = || refund_one_request(&conn, &keys, sub_ms, at_ms, "", -1);
        assert_eq!(run().await, 1, "the first run gives the request back");
        // Another process (this one remembers its window full: it never saw the
        // refund it did not send).
        let second = RateLimiter::new(config.clone(), RedisBackend::new(conn.clone())).unwrap();
        let b = second.acquire(0).await.expect("A's request is back");
        let b_ms = u64::try_from(b.admission().at().as_millis()).unwrap();
        if b_ms / sub_ms != at_ms / sub_ms {
            // The second refund would go to A's sub-window, not B's: no proof.
            b.finish(None).await.unwrap();
            continue;
        }
        assert_eq!(
            run().await,
            2,
            "the second run found its marker and gave nothing back"
        );
        b.finish(None).await.unwrap();
        b_still_counts(config, &conn).await;
        // A's own settle: nothing to give back or charge, so nothing is sent.
        a.finish(None).await.unwrap();
        assert_eq!(l.stats().settle_failures, 0);
        return;
    }
    panic!("A and B straddled a 30 s sub-window boundary three times");
}

/// On a cluster the limiter's own settle of a leaseless admission that gives back
/// names such a marker, in its scope's hash slot, kept 30 s (a client resends within
/// seconds; kept for a long window, one per call would pile up).
#[tokio::test]
async fn on_a_cluster_a_leaseless_refund_names_its_marker() {
    let h = Harness::redis(common::cluster(), "cluster_leaseless_marker").await;
    let config = h
        .config("s1", Quota::unlimited().requests(1))
        .window(Duration::from_secs(60));
    let [[window_key, _, _]] = <[[String; 3]; 1]>::try_from(RedisBackend::keys(&config)).unwrap();
    let here = h.limiter(config.clone());
    here.acquire(0).await.unwrap().refund().await.unwrap();
    // Back once: the next admission is taken, and the one after it refused.
    let p = here.acquire(0).await.expect("the request given back");
    let elsewhere = h.other_process(config).unwrap();
    elsewhere.acquire(0).await.expect_err("rpm 1");
    p.finish(None).await.unwrap();
    let mut markers = Vec::new();
    for node in pgw_test_support::redis_cluster_nodes().expect("REDIS_CLUSTER_NODES") {
        let client = redis::Client::open(node).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let found: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{window_key}:settled:*"))
            .query_async(&mut c)
            .await
            .unwrap();
        for key in found {
            let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut c).await.unwrap();
            markers.push((key, ttl));
        }
    }
    let [(_, ttl)] = markers.as_slice() else {
        panic!("one marker: {markers:?}")
    };
    assert!(
        (1..=30_000).contains(ttl),
        "kept 30 s (the window is 60 s): {ttl} ms"
    );
    assert_eq!(here.stats().settle_failures, 0);
}

/// A settle run twice gives back once: a cluster client resends a script whose answer
/// it lost (its connection dropped after Redis ran it), and a second refund would count
/// another call's request out of the window. The settle finds its lease gone and gives
/// nothing back again. A's request is refunded; B takes the window's one request; A's
/// settle runs once more (as the resend would); a fresh process asking Redis is still
/// refused. Before, the second refund emptied B's sub-window and it was admitted: two
/// requests in a window of one.
#[tokio::test]
async fn a_settle_run_twice_gives_back_once() {
    let (_server, conn) = private_redis().await;
    // The second refund only takes B's request when A and B count in one sub-window
    // (else it goes to A's, already empty): 30 s sub-windows, and a fresh scope when the
    // two straddle a boundary anyway, so the test cannot pass without the fix.
    for round in 0..3 {
        let (config, sub_ms, window_key, lease_key) =
            one_minute_of_two(round, Quota::unlimited().requests(1).concurrency(1));
        let l = RateLimiter::new(config.clone(), RedisBackend::new(conn.clone())).unwrap();
        let a = l.acquire(0).await.unwrap();
        let at_ms = u64::try_from(a.admission().at().as_millis()).unwrap();
        let mut c = conn.clone();
        let leases: Vec<String> = redis::cmd("ZRANGE")
            .arg(&lease_key)
            .arg(0)
            .arg(-1)
            .query_async(&mut c)
            .await
            .unwrap();
        let [lease] = leases.as_slice() else {
            panic!("one lease: {leases:?}")
        };
        a.refund().await.unwrap();
        let b = l.acquire(0).await.expect("A's request and slot are back");
        let b_ms = u64::try_from(b.admission().at().as_millis()).unwrap();
        if b_ms / sub_ms != at_ms / sub_ms {
            b.finish(None).await.unwrap();
            continue;
        }
        // A's settle again, with the arguments the limiter sent: one scope, the request
        // given back, its lease, the scope's rpm 1, tpm unlimited, concurrency 1.
        let again = refund_one_request(&conn, &[&window_key, &lease_key], sub_ms, at_ms, lease, 1).await;
        assert_eq!(again, 2, "the settle found its lease gone and gave nothing back");
        b.finish(None).await.unwrap();
        b_still_counts(config, &conn).await;
        return;
    }
    panic!("A and B straddled a 30 s sub-window boundary three times");
}

/// Concurrency, token and hold refusals are remembered too, each only while nothing
/// this process can see frees them:
/// - a full account (concurrency 1, shared by two sources' limiters): the admission
///   that took its last slot says so, and the sibling is refused here until a lease of
///   that account is given back by either limiter: then the next admission asks and
///   is admitted;
/// - a token refusal holds for requests at least as large; a smaller one asks;
/// - a hold one limiter was refused by refuses its sibling without a round trip.
#[tokio::test]
async fn concurrency_token_and_hold_refusals_are_remembered_until_something_frees_them() {
    let (server, conn) = private_redis().await;
    let backend = RedisBackend::new(conn.clone());
    // A long slot hint: only a release can end the concurrency memory here.
    let limiter = |source: &str, account: Quota| {
        RateLimiter::new(
            RateLimitConfig::new(source, Quota::unlimited().tokens(100))
                .account("acct", account)
                .window(Duration::from_secs(60))
                .slot_retry_after(Duration::from_secs(30)),
            backend.clone(),
        )
        .unwrap()
    };
    let (a, b) = (
        limiter("s1", Quota::unlimited().concurrency(1)),
        limiter("s2", Quota::unlimited().concurrency(1)),
    );
    let held = a.acquire(1).await.unwrap();
    let (before, _) = commands(&conn).await;
    for _ in 0..5 {
        let e = b.acquire(1).await.unwrap_err();
        assert!(
            matches!(
                pgw_core::NotAdmitted::of(&*e),
                Some(pgw_core::NotAdmitted::QuotaExceeded(_))
            ),
            "{e}"
        );
    }
    let (after, _) = commands(&conn).await;
    assert_eq!(
        after - before,
        0,
        "a's admission told it took the account's last slot"
    );
    // The sibling's lease ends: the account's slot is free, and b asks again.
    held.finish(None).await.unwrap();
    let (before, _) = commands(&conn).await;
    let p = b.acquire(1).await.expect("the released slot is seen at once");
    let (after, _) = commands(&conn).await;
    assert_eq!(after - before, 1, "asked Redis again after the release");
    p.finish(None).await.unwrap();

    // Tokens: s1 has 100 a window, 1 spent above; 100 cannot fit, 99 may.
    let (before, _) = commands(&conn).await;
    for _ in 0..3 {
        assert!(a.acquire(100).await.is_err(), "over the token quota");
    }
    let (after, _) = commands(&conn).await;
    assert_eq!(after - before, 1, "one round trip learned the token refusal");
    let p = a.acquire(99).await.expect("a smaller request asks, and fits");
    let (again, _) = commands(&conn).await;
    assert_eq!(again - after, 1, "the smaller request asked Redis");
    p.finish(None).await.unwrap();

    // A hold placed by another process on the account: a learns it over the wire,
    // then b (the same account) refuses without a round trip.
    let other = RateLimiter::new(
        RateLimitConfig::new("s3", Quota::unlimited().requests(1000))
            .account("acct", Quota::unlimited().concurrency(1)),
        RedisBackend::new(
            RedisConn::connect(&RedisTarget::Standalone(server.url()))
                .await
                .unwrap(),
        ),
    )
    .unwrap();
    other
        .hold(HoldScope::Account, Duration::from_secs(600))
        .await
        .unwrap();
    let (before, _) = commands(&conn).await;
    let e = a.acquire(1).await.unwrap_err();
    assert!(e.to_string().contains("hold"), "{e}");
    let e = b.acquire(1).await.unwrap_err();
    assert!(e.to_string().contains("hold"), "{e}");
    let (after, _) = commands(&conn).await;
    assert_eq!(after - before, 1, "the sibling knew the hold");
}

/// An account's refusal learnt through one of its sources refuses its other sources'
/// limiters in this process without a round trip (they share the account's memory),
/// as long as they ask for the same quota of it: a limiter with another quota for the
/// account asks. A refund through any of them forgets it for all.
#[tokio::test]
async fn an_accounts_refusal_is_shared_by_the_limiters_of_its_sources() {
    let (server, conn) = private_redis().await;
    let backend = RedisBackend::new(conn.clone());
    let limiter = |source: &str, rpm: u64| {
        RateLimiter::new(
            RateLimitConfig::new(source, Quota::unlimited())
                .account("acct", Quota::unlimited().requests(rpm))
                .window(Duration::from_secs(60)),
            backend.clone(),
        )
        .unwrap()
    };
    let (a, b, c) = (limiter("s1", 1), limiter("s2", 1), limiter("s3", 2));
    // Another process takes the account's one request.
    let other = RateLimiter::new(
        RateLimitConfig::new("s9", Quota::unlimited())
            .account("acct", Quota::unlimited().requests(1))
            .window(Duration::from_secs(60)),
        RedisBackend::new(
            RedisConn::connect(&RedisTarget::Standalone(server.url()))
                .await
                .unwrap(),
        ),
    )
    .unwrap();
    other.acquire(0).await.unwrap().finish(None).await.unwrap();
    let (before, _) = commands(&conn).await;
    let e = a.acquire(0).await.unwrap_err();
    assert!(e.to_string().contains("rpm"), "{e}");
    for _ in 0..3 {
        let e = b.acquire(0).await.unwrap_err();
        assert!(
            e.to_string().contains("rpm") && e.to_string().contains("acct"),
            "{e}"
        );
    }
    let (after, _) = commands(&conn).await;
    assert_eq!(
        after - before,
        1,
        "one round trip learnt the account's refusal for both"
    );
    // Another quota of the account (2 a window) asks Redis, and fits.
    let p = c.acquire(0).await.expect("another quota of the account asks");
    let (again, _) = commands(&conn).await;
    assert_eq!(again - after, 1, "the other quota asked");
    // Its refund gives its request back: a and b ask again (and are refused: the
    // first request still counts).
    p.refund().await.unwrap();
    let (before, _) = commands(&conn).await;
    assert!(b.acquire(0).await.is_err());
    let (after, _) = commands(&conn).await;
    assert_eq!(after - before, 1, "the refund forgot the account's refusal");
}

/// The lease zset's TTL is set by the admission that creates it and renewed once less
/// than one lease TTL of it is left, not by every admission (its end is noted in the
/// scope's window hash); the zset always has one while leases are out.
#[tokio::test]
async fn a_lease_zset_ttl_is_renewed_when_due_not_per_admission() {
    let (server, conn) = private_redis().await;
    let config = RateLimitConfig::new("s1", Quota::unlimited().requests(100).concurrency(10))
        .window(Duration::from_secs(60));
    let zset = RedisBackend::keys(&config)[0][1].clone();
    let l = RateLimiter::new(config, RedisBackend::new(conn.clone())).unwrap();
    let pttl = || server.pttl(&zset);
    let first = l.acquire(0).await.unwrap();
    assert!(pttl() > 0, "the zset that holds a lease has a TTL");
    let before = server.command_calls("pexpire");
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(l.acquire(0).await.unwrap());
    }
    assert_eq!(
        server.command_calls("pexpire") - before,
        0,
        "five more leases, no PEXPIRE"
    );
    assert!(pttl() > 0);
    // Every lease given back: the zset is gone, and the next lease makes it again,
    // with a TTL.
    first.finish(None).await.unwrap();
    for p in held {
        p.finish(None).await.unwrap();
    }
    let p = l.acquire(0).await.unwrap();
    assert!(pttl() > 0, "a zset made again has a TTL");
    p.finish(None).await.unwrap();
}

/// Limiters sharing an account's concurrency quota with different lease TTLs: the
/// short one's admissions and renewals never shorten the account's lease zset. They
/// set it to two of their own TTLs (200 ms here) and a long call's live lease (30 s)
/// ended with it: a third call was admitted on a concurrency of 2.
#[tokio::test]
async fn a_shorter_lease_ttl_never_shortens_a_shared_lease_zset() {
    let (server, conn) = private_redis().await;
    let account = Quota::unlimited().concurrency(2);
    let config = |source: &str, ttl: Duration| {
        RateLimitConfig::new(source, Quota::unlimited())
            .account("acct", account)
            .lease_ttl(ttl)
    };
    let long_config = config("s2", Duration::from_secs(30));
    let zset = RedisBackend::keys(&long_config)[0][1].clone();
    let long = RateLimiter::new(long_config, RedisBackend::new(conn.clone())).unwrap();
    let short = RateLimiter::new(
        config("s1", Duration::from_millis(100)),
        RedisBackend::new(conn.clone()),
    )
    .unwrap();
    let running = long.acquire(0).await.unwrap();
    let pttl = || server.pttl(&zset);
    assert!(pttl() > 30_000, "two long TTLs: {}", pttl());
    let p = short.acquire(0).await.unwrap();
    assert!(pttl() > 30_000, "a short admission shortened it: {}", pttl());
    assert!(p.renew().await.unwrap());
    assert!(pttl() > 30_000, "a short renewal shortened it: {}", pttl());
    p.finish(None).await.unwrap();
    running.finish(None).await.unwrap();
}

/// The same when the account has a window too, where an admission goes by the end it
/// noted in the window hash: X's renewals (TTL 1.8 s) extend the zset without noting
/// it there, and Y (TTL 0.3 s) admits when the noted end is near. Before, Y set the
/// zset to end 0.6 s later, under X's live lease; now it keeps the later end.
#[tokio::test]
async fn a_shorter_lease_ttl_never_ends_the_zset_under_a_longer_live_lease() {
    let (server, conn) = private_redis().await;
    let backend = RedisBackend::new(conn.clone());
    let config = |source: &str, ttl_ms: u64| {
        RateLimitConfig::new(source, Quota::unlimited())
            .account("acct", Quota::unlimited().requests(1000).concurrency(5))
            .lease_ttl(Duration::from_millis(ttl_ms))
    };
    let zset = RedisBackend::keys(&config("s1", 1800))[0][1].clone();
    let x = RateLimiter::new(config("s1", 1800), backend.clone()).unwrap();
    let y = RateLimiter::new(config("s2", 300), backend.clone()).unwrap();
    let start = tokio::time::Instant::now();
    let at = |ms: u64| tokio::time::sleep_until(start + Duration::from_millis(ms));
    // The zset ends at 3.6 s, as noted in the window hash; X's lease at 1.8 s.
    let held = x.acquire(0).await.unwrap();
    // X renews as its renewer would, every third of its TTL or so: the second renewal
    // finds less than one TTL left on the zset and extends it to 6.8 s (not noted).
    at(1600).await;
    assert!(held.renew().await.unwrap());
    at(3200).await;
    assert!(held.renew().await.unwrap());
    // Y admits within its TTL of the noted end; X's lease lives to 5 s.
    at(3450).await;
    let other = y.acquire(0).await.unwrap();
    let left = server.pttl(&zset);
    assert!(left > 1000, "the zset ends in {left} ms, under X's lease");
    other.finish(None).await.unwrap();
    held.finish(None).await.unwrap();
}

/// The cells of sub-windows that left are deleted in batches (once a quarter window
/// of them has gathered), not at every roll, and the window hash stays bounded: its
/// live sub-windows, at most a quarter window of left ones, and its fixed fields.
/// Real time (the server's clock): 20 sub-windows of 50 ms, 3 s of admissions.
#[tokio::test]
async fn left_sub_windows_are_deleted_in_batches_and_the_hash_stays_bounded() {
    let (server, conn) = private_redis().await;
    let config = RateLimitConfig::new("s1", Quota::unlimited().requests(1_000_000))
        .window(Duration::from_secs(1))
        .sub_windows(20);
    let window = RedisBackend::keys(&config)[0][0].clone();
    let l = RateLimiter::new(config, RedisBackend::new(conn.clone())).unwrap();
    let (mut hlen_max, mut admissions) = (0, 0u64);
    let started = tokio::time::Instant::now();
    while started.elapsed() < Duration::from_millis(3000) {
        l.acquire(0).await.unwrap().finish(None).await.unwrap();
        admissions += 1;
        let mut c = conn.clone();
        let hlen: u64 = redis::cmd("HLEN").arg(&window).query_async(&mut c).await.unwrap();
        hlen_max = hlen_max.max(hlen);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let hdel = server.command_calls("hdel");
    // About 40 sub-windows left over the run (60 went by, 20 are live), each rolled out
    // by the next admission or settle: deleted about 5 at a time (12 HDELs measured),
    // not at every roll (60 before).
    let left = u64::try_from(started.elapsed().as_millis() / 50).unwrap() - 20;
    assert!(
        hdel >= 1 && hdel * 2 <= left,
        "{hdel} HDELs, {left} sub-windows left, {admissions} admissions"
    );
    // 21 live sub-windows and at most 4 left, two cells each, and 8 fixed fields.
    assert!(hlen_max <= 2 * (21 + 4) + 8, "the hash grew to {hlen_max} fields");
}

/// When a remembered refusal ends, the calls waiting on the limiter do not all ask at
/// once: one asks Redis, the others are refused here (asked again after
/// `PROBE_RETRY`) until its answer is in. Once one is admitted, as many ask at once as
/// the answer said the scope has room for. An asking admission dropped before its
/// answer lets the next one ask.
#[tokio::test]
async fn after_a_refusal_one_admission_at_a_time_asks_until_one_is_admitted() {
    use futures_util::future::join_all;
    let (_server, conn, l) = rpm_on_private_redis(2).await;
    l.acquire(0).await.unwrap().finish(None).await.unwrap();
    l.acquire(0).await.unwrap().finish(None).await.unwrap();
    let e = l.acquire(0).await.unwrap_err();
    let Some(pgw_core::NotAdmitted::QuotaExceeded(wait)) = pgw_core::NotAdmitted::of(&*e) else {
        panic!("{e}")
    };
    tokio::time::sleep(wait + Duration::from_millis(50)).await;

    // Eight calls come back at once: one round trip, one admitted.
    let (before, _) = commands(&conn).await;
    let results = join_all((0..8).map(|_| l.acquire(0))).await;
    let (after, _) = commands(&conn).await;
    assert_eq!(after - before, 1, "one admission asked");
    let mut admitted = 0;
    for r in results {
        match r {
            Ok(p) => {
                admitted += 1;
                p.finish(None).await.unwrap();
            }
            Err(e) => match pgw_core::NotAdmitted::of(&*e) {
                Some(pgw_core::NotAdmitted::QuotaExceeded(d)) => {
                    assert_eq!(d, tower_ratelimit_redis::PROBE_RETRY, "{e}");
                }
                other => panic!("{other:?}: {e}"),
            },
        }
    }
    assert_eq!(admitted, 1);
    // Admitted, with room for one more request: as many ask at once as there is room
    // for. Of two calls one asks (and fills the window), the other is refused here.
    let (before, _) = commands(&conn).await;
    let results = join_all((0..2).map(|_| l.acquire(0))).await;
    let (after, _) = commands(&conn).await;
    assert_eq!(after - before, 1, "as many asked as there was room for");
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 1);
    for p in results.into_iter().flatten() {
        p.finish(None).await.unwrap();
    }

    // No room again (the window is full): an asking admission dropped before its
    // answer does not keep the others from asking.
    let e = l.acquire(0).await.unwrap_err();
    let Some(pgw_core::NotAdmitted::QuotaExceeded(wait)) = pgw_core::NotAdmitted::of(&*e) else {
        panic!("{e}")
    };
    tokio::time::sleep(wait + Duration::from_millis(50)).await;
    {
        let mut asking = Box::pin(l.acquire(0));
        let first_poll = futures_util::FutureExt::now_or_never(asking.as_mut());
        assert!(first_poll.is_none(), "sent to Redis");
        // A gate asked before this limiter learns it would be refused, and why.
        let known = l.known_refusal().expect("refused here while another one asks");
        assert!(known.to_string().contains("rpm"), "{known}");
    }
    let (before, _) = commands(&conn).await;
    l.acquire(0)
        .await
        .expect("asked Redis, and the window has room")
        .finish(None)
        .await
        .unwrap();
    let (after, _) = commands(&conn).await;
    assert!(after - before >= 1, "asked Redis");
}

/// An admission whose answer comes after its timeout (the server was frozen: the script
/// ran when it woke up) is undone when the answer comes: its request, tokens and lease
/// do not stay charged for the window and the lease TTL (a minute each here), in every
/// process, while its caller has already heard `BackendUnavailable`.
#[tokio::test]
async fn an_admission_answered_after_its_timeout_is_undone() {
    let (server, conn) = private_redis().await;
    let backend = RedisBackend::new(conn);
    let config = |source: &str| {
        RateLimitConfig::new(source, Quota::unlimited().requests(1).tokens(10).concurrency(1))
            .lease_ttl(Duration::from_secs(60))
            .response_timeout(Duration::from_millis(100))
    };
    // Load the scripts on a limiter of its own (the one under test has one request).
    let warm = RateLimiter::new(config("warm"), backend.clone()).unwrap();
    warm.acquire(1).await.unwrap().refund().await.unwrap();
    let l = RateLimiter::new(config("s1"), backend).unwrap();

    server.freeze();
    let err = l.acquire(10).await.unwrap_err();
    assert!(err.is::<BackendUnavailable>(), "{err}");
    server.thaw();
    let mut back = None;
    for _ in 0..200 {
        if let Ok(p) = l.acquire(10).await {
            back = Some(p);
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let p = back.expect("the admission answered late was undone: request, tokens and slot back");
    assert_eq!(l.held().await.unwrap().leases(), 1, "only this admission's lease");
    p.refund().await.unwrap();
    assert_eq!(l.held().await.unwrap().leases(), 0);
}

/// A loopback proxy to a Redis server that passes everything both ways, except that
/// once `cut` is set it takes the server's next answer and closes the client's
/// connection instead of passing it on: a question that ran whose answer was lost.
struct CuttingProxy {
    port: u16,
    cut: Arc<std::sync::atomic::AtomicBool>,
}

impl CuttingProxy {
    async fn start(upstream: u16) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let cutting = Arc::clone(&cut);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else {
                    return;
                };
                let cut = Arc::clone(&cutting);
                tokio::spawn(async move {
                    let (mut from_client, mut to_client) = client.into_split();
                    let (mut from_server, mut to_server) = server.into_split();
                    let up = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                    });
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match from_server.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if cut.swap(false, Ordering::SeqCst) || to_client.write_all(&buf[..n]).await.is_err()
                        {
                            break;
                        }
                    }
                    up.abort();
                });
            }
        });
        Self { port, cut }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn cut_next_answer(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// An admission whose answer is lost to a broken connection (the script ran: its lease
/// is in the zset) gives its lease back at once, blindly: with concurrency 1 and a
/// minute's lease TTL, the next admission is not refused for that minute. Its request
/// stays charged (whether the script ran is not known to the process).
#[tokio::test]
async fn an_admission_answered_with_an_error_gives_its_lease_back() {
    let server = PrivateRedis::start();
    let proxy = CuttingProxy::start(server.port()).await;
    let conn = RedisConn::connect(&RedisTarget::Standalone(proxy.url()))
        .await
        .unwrap();
    let config = RateLimitConfig::new("s1", Quota::unlimited().requests(10).concurrency(1))
        .lease_ttl(Duration::from_secs(60));
    let l = RateLimiter::new(config, RedisBackend::new(conn)).unwrap();
    // The scripts loaded and the connection set up before the cut.
    l.acquire(1).await.unwrap().refund().await.unwrap();

    proxy.cut_next_answer();
    let err = l.acquire(1).await.unwrap_err();
    assert!(err.is::<BackendUnavailable>(), "{err}");
    let mut back = None;
    for _ in 0..200 {
        if let Ok(p) = l.acquire(1).await {
            back = Some(p);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let p = back.expect("the lost admission's lease was given back: its slot is free");
    assert_eq!(l.held().await.unwrap().leases(), 1, "only this admission's lease");
    p.finish(None).await.unwrap();
    // The lost admission's request was counted by the script that ran and stays: with
    // the last one, two (the first was refunded), so a limit of 2 on the same scope
    // is full.
    let direct = RedisConn::connect(&RedisTarget::Standalone(server.url()))
        .await
        .unwrap();
    let counted = RateLimiter::new(
        RateLimitConfig::new("s1", Quota::unlimited().requests(2)),
        RedisBackend::new(direct),
    )
    .unwrap();
    let refused = counted.acquire(1).await.unwrap_err();
    assert!(
        refused.is::<pgw_core::QuotaExceeded>(),
        "2 requests counted: {refused}"
    );
}

/// A `finish` whose caller goes away before it completed still releases the lease:
/// here its settle script had to be loaded again (the server flushed its scripts), and
/// the future was dropped after the first `NOSCRIPT` answer, before the script was
/// loaded and sent again. The rest goes on in the background; before, the slot stayed
/// taken for the lease's TTL (a minute).
#[tokio::test]
async fn a_finish_dropped_half_way_still_releases_its_lease() {
    use futures_util::FutureExt;
    let (server, conn) = private_redis().await;
    let config = RateLimitConfig::new("s1", Quota::unlimited().tokens(1000).concurrency(1))
        .lease_ttl(Duration::from_secs(60));
    let l = RateLimiter::new(config, RedisBackend::new(conn)).unwrap();
    let p = l.acquire(10).await.unwrap();
    let direct = RedisConn::connect(&RedisTarget::Standalone(server.url()))
        .await
        .unwrap();
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut direct.clone())
        .await
        .unwrap();
    let mut finishing = Box::pin(p.finish(Some(5)));
    assert!((&mut finishing).now_or_never().is_none(), "asked Redis");
    // The NOSCRIPT answer comes back; nobody polls the settle again.
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(finishing);
    let mut freed = false;
    for _ in 0..200 {
        if let Ok(p) = l.acquire(1).await {
            p.refund().await.unwrap();
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(freed, "the dropped finish's lease was released in the background");
}

/// A request count's refusal is trusted for its whole wait (until the oldest
/// sub-window leaves): a call polling it asks Redis once, not once a sub-window. RPM 1
/// over a 6 s window (100 ms sub-windows), the request held by another process: 1.5 s
/// of polling every 20 ms asks once (16 questions at one a sub-window, 5 with the
/// trust doubling at each refusal, as before 2026-12-05).
#[tokio::test]
async fn a_request_count_refusal_is_trusted_for_its_whole_wait() {
    let (_server, conn) = private_redis().await;
    let config = RateLimitConfig::new("s1", Quota::unlimited().requests(1)).window(Duration::from_secs(6));
    assert_eq!(config.sub_window_len(), Duration::from_millis(100));
    let a = RateLimiter::new(config.clone(), RedisBackend::new(conn.clone())).unwrap();
    let b = RateLimiter::new(config, RedisBackend::new(conn.clone())).unwrap();
    let held = b.acquire(0).await.unwrap();
    let (before, _) = commands(&conn).await;
    let start = std::time::Instant::now();
    while start.elapsed() < Duration::from_millis(1550) {
        let e = a.acquire(0).await.unwrap_err();
        assert!(e.to_string().contains("rpm"), "{e}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (after, _) = commands(&conn).await;
    assert_eq!(after - before, 1, "one question in 1.5 s");
    held.finish(None).await.unwrap();
}

/// A token refusal this process remembers is trusted one sub-window at most: another
/// process's refund (tokens used below their estimate, a call refunded) frees it
/// unseen here. Two processes on one TPM of 1000: B's 900 refunded, A asked again
/// after a sub-window (100 ms of a 6 s window) and was admitted.
#[tokio::test]
async fn a_remembered_token_refusal_is_trusted_one_sub_window() {
    let (_server, conn) = private_redis().await;
    let config = RateLimitConfig::new("s1", Quota::unlimited().requests(10).tokens(1000))
        .window(Duration::from_secs(6));
    let sub = config.sub_window_len();
    assert_eq!(sub, Duration::from_millis(100));
    // Two processes: each its own backend (its own memory of refusals).
    let a = RateLimiter::new(config.clone(), RedisBackend::new(conn.clone())).unwrap();
    let b = RateLimiter::new(config, RedisBackend::new(conn.clone())).unwrap();
    let held = b.acquire(900).await.unwrap();
    let refused = a.acquire(200).await.unwrap_err();
    assert!(refused.to_string().contains("tpm"), "{refused}");
    held.refund().await.unwrap();
    // At once, A still answers from its memory (no round trip).
    let (before, _) = commands(&conn).await;
    assert!(a.acquire(200).await.is_err());
    let (after, _) = commands(&conn).await;
    assert_eq!(after, before, "answered from memory");
    tokio::time::sleep(sub + Duration::from_millis(20)).await;
    let p = a
        .acquire(200)
        .await
        .expect("asked again after a sub-window: the tokens are back");
    p.finish(None).await.unwrap();
}
