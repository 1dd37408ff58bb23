//! Redis round trips: one admission, one record, and 32 admissions in flight on one
//! multiplexed connection. Needs `REDIS_URL` (e.g. `source /tmp/devredis.env`).
//!
//! `cargo bench -p tower-breaker-window --bench redis`

use std::time::Duration;

use divan::Bencher;
use futures_util::future::join_all;
use pgw_core::BreakerVerdict;
use pgw_core::redis_conn::{RedisConn, RedisTarget};
use tokio::runtime::Runtime;
use tower_breaker_window::{Admission, Backend, BreakerConfig, Gate, RedisBackend, RedisGate};

fn main() {
    if std::env::var_os("REDIS_URL").is_none() {
        eprintln!("REDIS_URL is not set: source /tmp/devredis.env (or run `cargo xtask test`) first");
        std::process::exit(2);
    }
    divan::main();
}

fn setup() -> (Runtime, RedisGate) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = std::env::var("REDIS_URL").unwrap();
    let gate = rt.block_on(async {
        let conn = RedisConn::connect(&RedisTarget::Standalone(url)).await.unwrap();
        let config = BreakerConfig::builder()
            .fail_threshold(1_000_000)
            .cooldown(Duration::from_secs(1))
            .build()
            .unwrap();
        let prefix = format!("pgwbench:{}", std::process::id());
        let gate = RedisBackend::new(conn)
            .with_prefix(prefix)
            .gate(&"s".into(), &config);
        let _ = gate.admit().await.unwrap(); // loads the script
        gate
    });
    (rt, gate)
}

/// One admission (one EVALSHA), sequential.
#[divan::bench]
fn admit(b: Bencher<'_, '_>) {
    let (rt, gate) = setup();
    b.bench_local(|| rt.block_on(gate.admit()).unwrap());
}

/// One admission plus one record of a success (two EVALSHA), sequential.
#[divan::bench]
fn admit_and_record(b: Bencher<'_, '_>) {
    let (rt, gate) = setup();
    b.bench_local(|| {
        rt.block_on(async {
            if let Admission::Admitted(t) = gate.admit().await.unwrap() {
                gate.record(t, BreakerVerdict::Success).await;
            }
        });
    });
}

/// 32 admissions in flight on one multiplexed connection (time per batch of 32).
#[divan::bench]
fn admit_32_in_flight(b: Bencher<'_, '_>) {
    let (rt, gate) = setup();
    b.counter(divan::counter::ItemsCount::new(32usize))
        .bench_local(|| rt.block_on(join_all((0..32).map(|_| gate.admit()))));
}
