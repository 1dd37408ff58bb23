//! Admission cost, in one run:
//!
//! - memory backend, per call on one task: the limiter's admission against governor's
//!   `check()`, and the whole layer (`poll_ready` + `call` + the future) around an
//!   always-ready service against tower's `RateLimit` doing the same (the fairest
//!   peer: it reads the same tokio clock once per call);
//! - Redis (a private `redis-server` started for the run): admissions per second from
//!   one multiplexed connection at 32 in flight, against `redis-benchmark -c 32`
//!   running the same script with the same keys on the same server (printed after the
//!   divan table, with the ratio).

use std::num::NonZeroU32;
use std::process::{Command, Stdio};
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use pgw_core::redis_conn::{RedisConn, RedisTarget};
use tower::{Service, service_fn};
use tower_layer::Layer;
use tower_ratelimit_redis::{
    MemoryBackend, NoTokens, Quota, RateLimitConfig, RateLimitLayer, RateLimiter, RedisBackend,
};

const HUGE: u64 = 1 << 40;

fn main() {
    divan::main();
    redis_throughput();
}

fn memory_limiter() -> RateLimiter {
    RateLimiter::new(
        RateLimitConfig::new("s1", Quota::unlimited().requests(HUGE)),
        MemoryBackend::new(),
    )
    .unwrap()
}

#[divan::bench(sample_count = 200, sample_size = 2000)]
fn governor_check(b: divan::Bencher<'_, '_>) {
    let g = governor::RateLimiter::direct(governor::Quota::per_second(NonZeroU32::MAX));
    b.bench(|| divan::black_box(g.check().is_ok()));
}

/// The clock read every admission pays (tokio's, with `test-util` unified in by the
/// dev-dependencies here: dearer than in a release build of an application).
#[divan::bench(sample_count = 200, sample_size = 2000)]
fn tokio_instant_now() -> tokio::time::Instant {
    tokio::time::Instant::now()
}

#[divan::bench(sample_count = 200, sample_size = 2000)]
fn memory_acquire(b: divan::Bencher<'_, '_>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _g = rt.enter();
    let l = memory_limiter();
    b.bench(|| divan::black_box(l.acquire(0).now_or_never().unwrap().is_ok()));
}

#[divan::bench(sample_count = 200, sample_size = 2000)]
fn memory_layer_call(b: divan::Bencher<'_, '_>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _g = rt.enter();
    let mut svc = RateLimitLayer::new(memory_limiter())
        .token_estimate(NoTokens)
        .usage(NoTokens)
        .layer(service_fn(|x: u32| {
            std::future::ready(Ok::<_, std::convert::Infallible>(x))
        }));
    let mut cx = Context::from_waker(Waker::noop());
    b.bench_local(|| {
        assert!(svc.poll_ready(&mut cx).is_ready());
        divan::black_box(svc.call(1).now_or_never().unwrap().is_ok())
    });
}

/// The peer of `memory_layer_call`: tower's own rate limit, same inner service, same
/// steps (it never refuses within `HUGE` requests per minute).
#[divan::bench(sample_count = 200, sample_size = 2000)]
fn tower_rate_limit_call(b: divan::Bencher<'_, '_>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _g = rt.enter();
    let mut svc =
        tower::limit::RateLimitLayer::new(HUGE, Duration::from_secs(60)).layer(service_fn(|x: u32| {
            std::future::ready(Ok::<_, std::convert::Infallible>(x))
        }));
    let mut cx = Context::from_waker(Waker::noop());
    b.bench_local(|| {
        assert!(svc.poll_ready(&mut cx).is_ready());
        divan::black_box(svc.call(1).now_or_never().unwrap().is_ok())
    });
}

fn redis_throughput() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let Ok(mut server) = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .spawn()
    else {
        println!("redis: redis-server not found, Redis throughput not measured");
        return;
    };
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        std::thread::sleep(Duration::from_millis(10));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    const N: usize = 100_000;
    const IN_FLIGHT: usize = 32;
    let config = RateLimitConfig::new("bench", Quota::unlimited().requests(HUGE).tokens(HUGE));
    let (ours, sha) = rt.block_on(async {
        let conn = RedisConn::connect(&RedisTarget::Standalone(format!("redis://127.0.0.1:{port}")))
            .await
            .unwrap();
        let l = RateLimiter::new(config.clone(), RedisBackend::new(conn)).unwrap();
        for _ in 0..1000 {
            l.acquire(1).await.unwrap();
        }
        let start = Instant::now();
        let tasks: Vec<_> = (0..IN_FLIGHT)
            .map(|_| {
                let l = l.clone();
                tokio::spawn(async move {
                    for _ in 0..N / IN_FLIGHT {
                        l.acquire(1).await.unwrap();
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let rate = (N / IN_FLIGHT * IN_FLIGHT) as f64 / start.elapsed().as_secs_f64();
        (rate, RedisBackend::admit_script().get_hash().to_owned())
    });
    let keys = RedisBackend::keys(&config);
    let mut args: Vec<String> = [
        "-p",
        &port.to_string(),
        "-c",
        "32",
        "-n",
        &N.to_string(),
        "-q",
        "EVALSHA",
        &sha,
        "3",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    args.extend(keys[0].iter().cloned());
    // nscopes, window_ms, sub_window_ms, sub_windows, tokens, lease ('' = none),
    // lease_ttl_ms, slot_hint_ms, rpm, tpm, concurrency (the defaults: 60 s in 60)
    for a in [
        "1",
        "60000",
        "1000",
        "60",
        "1",
        "",
        "30000",
        "50",
        &HUGE.to_string(),
        &HUGE.to_string(),
        "-1",
    ] {
        args.push(a.to_owned());
    }
    let out = Command::new("redis-benchmark").args(&args).output();
    let _ = server.kill();
    let _ = server.wait();
    let theirs = out.ok().and_then(|o| {
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        let line = text
            .lines()
            .rev()
            .find(|l| l.contains("requests per second"))?
            .to_owned();
        let before = line.split(" requests per second").next()?;
        before.rsplit(' ').next()?.parse::<f64>().ok()
    });
    println!("redis: ours {ours:.0} admissions/s (one multiplexed connection, {IN_FLIGHT} in flight)");
    match theirs {
        Some(t) => println!(
            "redis: redis-benchmark -c 32 EVALSHA same script {t:.0}/s; ratio ours/theirs = {:.2}",
            ours / t
        ),
        None => println!("redis: redis-benchmark output not understood"),
    }
}
