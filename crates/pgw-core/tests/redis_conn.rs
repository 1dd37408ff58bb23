//! `RedisConn` against the standalone test server and the 3-node cluster: a Lua script
//! round-trips, and `round_trips` counts what this process sends (one per command, one
//! per pipeline, one per script call the server already knows), `commands_sent` the
//! same with a pipeline's commands counted each. One test in a binary of
//! its own: the counter is process-wide, and nothing else may send while it counts.
#![cfg(feature = "redis")]

use pgw_core::redis_conn::{
    DEFAULT_RESPONSE_TIMEOUT, RedisConn, RedisTarget, commands_sent, round_trips, run, scope_key,
};

#[tokio::test]
async fn scripts_run_and_each_request_is_one_round_trip_standalone_and_cluster() {
    let mut targets = Vec::new();
    if let Some(url) = pgw_test_support::redis_url() {
        targets.push(RedisTarget::Standalone(url));
    }
    if let Some(nodes) = pgw_test_support::redis_cluster_nodes() {
        targets.push(RedisTarget::Cluster(nodes));
    }
    for target in targets {
        lua_roundtrip(&target).await;
        counts_one_per_request(&target).await;
    }
}

/// A Lua script reads the server clock and a key it wrote, in the key's slot.
async fn lua_roundtrip(target: &RedisTarget) {
    let script = redis::Script::new(
        "local t = redis.call('TIME'); redis.call('SET', KEYS[1], ARGV[1], 'EX', 60); return {redis.call('GET', KEYS[1]), t[1]}",
    );
    let mut conn = RedisConn::connect(target).await.unwrap();
    let key = format!("{}x", scope_key(&pgw_test_support::unique_prefix("lua"), "s1"));
    let (v, t): (String, u64) = run(
        "test",
        DEFAULT_RESPONSE_TIMEOUT,
        script.key(&key).arg("hello").invoke_async(&mut conn),
    )
    .await
    .unwrap();
    assert_eq!(v, "hello", "{target}");
    assert!(t > 1_700_000_000, "server TIME looks wrong: {t}");
}

async fn counts_one_per_request(target: &RedisTarget) {
    let mut conn = RedisConn::connect(target).await.unwrap();
    let key = format!("{}k", pgw_test_support::unique_prefix("round-trips"));
    let script = redis::Script::new("return redis.call('INCR', KEYS[1]) + redis.call('INCR', KEYS[1])");
    // Once so the server knows the script (its first call may also load it).
    let _: i64 = run(
        "test",
        DEFAULT_RESPONSE_TIMEOUT,
        script.key(&key).invoke_async(&mut conn),
    )
    .await
    .unwrap();

    let before = round_trips();
    let sent = commands_sent();
    let _: Option<String> = run(
        "test",
        DEFAULT_RESPONSE_TIMEOUT,
        redis::cmd("GET").arg(&key).query_async(&mut conn),
    )
    .await
    .unwrap();
    assert_eq!(round_trips() - before, 1, "a command ({target})");
    assert_eq!(commands_sent() - sent, 1, "a command ({target})");

    let mut pipe = redis::pipe();
    pipe.cmd("SET")
        .arg(&key)
        .arg(0)
        .ignore()
        .cmd("PEXPIRE")
        .arg(&key)
        .arg(60_000)
        .ignore();
    let () = run("test", DEFAULT_RESPONSE_TIMEOUT, pipe.query_async(&mut conn))
        .await
        .unwrap();
    assert_eq!(round_trips() - before, 2, "a pipeline of two commands ({target})");
    assert_eq!(
        commands_sent() - sent,
        3,
        "a pipeline of two commands, each counted ({target})"
    );

    let n: i64 = run(
        "test",
        DEFAULT_RESPONSE_TIMEOUT,
        script.key(&key).invoke_async(&mut conn),
    )
    .await
    .unwrap();
    assert_eq!(n, 3, "the script ran its two commands on the server");
    assert_eq!(
        round_trips() - before,
        3,
        "a known script, however many commands it runs"
    );
    assert_eq!(
        commands_sent() - sent,
        4,
        "a script call is one command sent, however many it runs ({target})"
    );
}
