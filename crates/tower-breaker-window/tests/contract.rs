//! The contract suite (B11): nine cases of deterministic sequences, one set of tests
//! instantiated for the memory backend (paused clock) and for Redis, standalone and
//! cluster (real server, small durations).

mod common;

use common::*;
use pgw_core::{BreakerVerdict, Outcome};
use tower_breaker_window::{BreakerState, Gate};

mod cases {
    use super::*;

    /// (1) The disease-1 regression: a 10%-success sequence opens the rate channel at
    /// exactly `min_calls` samples, long before the consecutive channel would.
    pub(super) async fn c1_rate_opens_at_min_calls(env: impl Env) {
        let g = env.gate("s5", &cfg(&env, 100).build().unwrap());
        call(&g, S).await;
        for i in 2..=10 {
            let v = view(&g).await;
            assert_eq!(
                v.state,
                BreakerState::Closed,
                "open before min_calls, at sample {i}"
            );
            call(&g, F).await;
        }
        let v = view(&g).await;
        assert_eq!(v.state, BreakerState::Open);
        assert_eq!((v.window_calls, v.window_failures), (10, 9));
        assert_eq!(v.streak, 0, "transient failures do not grow the streak (B7)");
        env.assert_near(refused(&g).await, env.unit(), "first open lasts one cooldown");
    }

    /// (1, at the bar) A failure rate exactly at `fail_rate` opens: 7 failures in 25
    /// samples against 0.28 (where `0.28 * 25` rounds above 7).
    pub(super) async fn c1_rate_exactly_at_fail_rate_opens(env: impl Env) {
        let config = cfg(&env, 100).min_calls(25).fail_rate(0.28).build().unwrap();
        let g = env.gate("s", &config);
        calls(&g, S, 18).await;
        calls(&g, F, 6).await;
        let v = view(&g).await;
        assert_eq!((v.state, v.window_calls), (BreakerState::Closed, 24));
        call(&g, F).await;
        let v = view(&g).await;
        assert_eq!(
            (v.state, v.window_calls, v.window_failures, v.streak, v.failures),
            (BreakerState::Open, 25, 7, 0, 100),
            "7 / 25 = 0.28 >= 0.28"
        );
    }

    /// (2) The same 90% failure rate spread over fewer than `min_calls` samples per
    /// window never rate-opens, however long it goes on.
    pub(super) async fn c2_fewer_samples_never_rate_open(env: impl Env) {
        let window = env.units(4);
        let g = env.gate("s5", &cfg(&env, 100).window(window).build().unwrap());
        for round in 0..3 {
            call(&g, S).await;
            calls(&g, F, 8).await;
            let v = view(&g).await;
            assert_eq!(v.state, BreakerState::Closed, "round {round}");
            assert_eq!((v.window_calls, v.window_failures), (9, 8), "round {round}");
            env.pass(window).await;
        }
        assert_eq!(
            view(&g).await.window_calls,
            0,
            "a full window later the buckets are empty"
        );
    }

    /// (3) The consecutive threshold is `max(configured, 2 * max_concurrency)` of this
    /// source, and one source's failures never touch another's.
    pub(super) async fn c3_threshold_uses_source_concurrency(env: impl Env) {
        let wide = env.gate(
            "wide",
            &cfg(&env, 3).max_concurrency(4).min_calls(1000).build().unwrap(),
        );
        let narrow = env.gate(
            "narrow",
            &cfg(&env, 3).max_concurrency(1).min_calls(1000).build().unwrap(),
        );
        calls(&wide, F, 7).await;
        assert_eq!(view(&wide).await.state, BreakerState::Closed, "7 < 2 * 4");
        call(&wide, F).await;
        let v = view(&wide).await;
        assert_eq!((v.state, v.failures, v.streak), (BreakerState::Open, 8, 0));
        assert_eq!(
            view(&narrow).await.state,
            BreakerState::Closed,
            "state is per source"
        );
        calls(&narrow, F, 2).await;
        assert_eq!(view(&narrow).await.state, BreakerState::Closed);
        call(&narrow, F).await;
        assert_eq!(
            view(&narrow).await.state,
            BreakerState::Open,
            "configured 3 > 2 * 1"
        );
    }

    /// (4) The open duration doubles with the streak, which only a dead source's
    /// verdict grows (a transient open or failed probe reopens for one cooldown, so a
    /// source back from an outage is seen within it), is capped, and the streak decays
    /// after the source stayed closed for twice the effective cooldown.
    pub(super) async fn c4_backoff_doubles_caps_decays(env: impl Env) {
        let u = env.unit();
        let config = cfg(&env, 100)
            .min_calls(2)
            .fail_rate(0.5)
            .max_cooldown(u * 2)
            .build()
            .unwrap();
        let g = env.gate("s", &config);
        calls(&g, F, 2).await;
        assert_eq!(view(&g).await.streak, 0);
        env.assert_near(refused(&g).await, u, "a transient open: one cooldown");
        env.pass(u).await;

        let probe = admit(&g).await;
        assert!(probe.is_probe());
        g.record(probe, BreakerVerdict::Failure).await;
        assert_eq!(
            view(&g).await.streak,
            0,
            "a transient probe failure does not grow it"
        );
        env.assert_near(refused(&g).await, u, "probed again after one cooldown");
        env.pass(u).await;

        let probe = admit(&g).await;
        g.record(probe, BreakerVerdict::ForceOpen).await;
        assert_eq!(view(&g).await.streak, 1);
        env.assert_near(refused(&g).await, u, "streak 1");
        env.pass(u).await;

        let probe = admit(&g).await;
        g.record(probe, BreakerVerdict::ForceOpen).await;
        assert_eq!(view(&g).await.streak, 2);
        env.assert_near(refused(&g).await, u * 2, "streak 2 doubles");
        env.pass(u * 2).await;

        let probe = admit(&g).await;
        g.record(probe, BreakerVerdict::ForceOpen).await;
        assert_eq!(view(&g).await.streak, 3);
        env.assert_near(refused(&g).await, u * 2, "streak 3 is capped at max_cooldown");
        env.pass(u * 2).await;

        let probe = admit(&g).await;
        g.record(probe, BreakerVerdict::Success).await;
        let v = view(&g).await;
        assert_eq!(
            (v.state, v.streak),
            (BreakerState::Closed, 3),
            "closing keeps the streak"
        );
        call(&g, S).await;
        assert_eq!(view(&g).await.streak, 3, "too early to decay");
        env.pass(u * 3).await;
        call(&g, S).await;
        assert_eq!(
            view(&g).await.streak,
            3,
            "closed for 3 cooldowns: past 2 x cooldown, not yet 2 x the effective one"
        );
        env.pass(u).await; // 2 x the effective (capped) cooldown since the close
        call(&g, S).await;
        assert_eq!(
            view(&g).await.streak,
            0,
            "decayed at the first success after 2 x cooldown"
        );
        calls(&g, F, 3).await; // 3 failures of 6 since the close: rate 0.5
        env.assert_near(
            refused(&g).await,
            u,
            "after decay the first open is one cooldown again",
        );
    }

    /// (5) Invalid and Rejected are not evidence: neither the window nor the
    /// consecutive counter moves.
    pub(super) async fn c5_invalid_and_rejected_stay_out(env: impl Env) {
        let g = env.gate("s", &cfg(&env, 3).build().unwrap());
        calls(&g, F, 2).await;
        for _ in 0..10 {
            call(&g, Outcome::Invalid).await;
            call(&g, Outcome::Rejected).await;
        }
        let v = view(&g).await;
        assert_eq!(
            (v.state, v.failures, v.window_calls, v.window_failures),
            (BreakerState::Closed, 2, 2, 2)
        );
        call(&g, F).await;
        assert_eq!(
            view(&g).await.state,
            BreakerState::Open,
            "the third real failure still counts as consecutive"
        );
    }

    /// (6) A 429 burst never opens; a timeout burst opens (consecutive channel) and
    /// heals after one cooldown without growing the streak.
    pub(super) async fn c6_pushback_never_opens_timeouts_heal(env: impl Env) {
        let g = env.gate("s1", &cfg(&env, 5).build().unwrap());
        calls(&g, RL, 50).await;
        let v = view(&g).await;
        assert_eq!(
            (v.state, v.failures, v.window_calls),
            (BreakerState::Closed, 0, 0)
        );
        calls(&g, F, 4).await;
        assert_eq!(view(&g).await.state, BreakerState::Closed);
        call(&g, F).await;
        let v = view(&g).await;
        assert_eq!((v.state, v.streak), (BreakerState::Open, 0));
        env.assert_near(refused(&g).await, env.unit(), "one cooldown");
        env.pass(env.unit()).await;
        let probe = admit(&g).await;
        assert!(probe.is_probe());
        g.record(probe, BreakerVerdict::Success).await;
        let v = view(&g).await;
        assert_eq!((v.state, v.streak, v.failures), (BreakerState::Closed, 0, 0));
        call(&g, S).await;
    }

    /// (7) A rate-channel open pins the reported failure count to the (effective)
    /// threshold.
    pub(super) async fn c7_rate_open_pins_failure_count(env: impl Env) {
        let g = env.gate("s", &cfg(&env, 3).max_concurrency(10).build().unwrap());
        calls(&g, F, 10).await;
        let v = view(&g).await;
        assert_eq!((v.state, v.failures, v.streak), (BreakerState::Open, 20, 0));
    }

    /// (8) With `min_calls` samples of evidence below `fail_rate`, consecutive failures
    /// do not open; the rate channel takes over once the rate crosses the bar. A cold
    /// source still opens on the consecutive channel.
    pub(super) async fn c8_health_evidence_suppresses_consecutive(env: impl Env) {
        let config = cfg(&env, 3).build().unwrap();
        let warm = env.gate("warm", &config);
        calls(&warm, S, 10).await;
        calls(&warm, F, 14).await; // 14 / 24 = 0.583 < 0.6
        let v = view(&warm).await;
        assert_eq!((v.state, v.failures), (BreakerState::Closed, 14));
        call(&warm, F).await; // 15 / 25 = 0.6
        let v = view(&warm).await;
        assert_eq!((v.state, v.streak, v.failures), (BreakerState::Open, 0, 3));

        let cold = env.gate("cold", &config);
        calls(&cold, F, 3).await;
        let v = view(&cold).await;
        assert_eq!((v.state, v.streak), (BreakerState::Open, 0));
    }

    /// (9) An expired probe lease is re-issued; the old probe's failure and any
    /// stale-epoch record change nothing; a probe without a verdict releases at once.
    pub(super) async fn c9_probe_lease_expiry_and_fencing(env: impl Env) {
        let u = env.unit();
        let g = env.gate("s", &cfg(&env, 1).probe_ttl(u * 2).build().unwrap());
        let old = admit(&g).await;
        call(&g, F).await;
        let opened = still(&g).await;
        assert_eq!(
            (opened.state, opened.epoch),
            (BreakerState::Open, old.epoch() + 1)
        );
        g.record(old, BreakerVerdict::Failure).await;
        g.record(old, BreakerVerdict::Success).await;
        assert_eq!(still(&g).await, opened, "stale-epoch records change nothing");

        env.pass(u).await;
        let first = admit(&g).await;
        assert!(first.is_probe());
        assert_eq!(first.epoch(), opened.epoch);
        assert!(view(&g).await.probe_in_flight);
        let wait = refused(&g).await;
        assert!(wait <= u && !wait.is_zero(), "one probe at a time: {wait:?}");

        env.pass(u * 2).await; // the first probe is lost: its lease expires
        let second = admit(&g).await;
        assert!(
            second.is_probe() && second.probe() != first.probe(),
            "lease re-issued"
        );
        let before = still(&g).await;
        g.record(first, BreakerVerdict::Failure).await;
        assert_eq!(
            still(&g).await,
            before,
            "the expired probe's failure changes nothing: the current probe decides"
        );

        // B3: ending the probe with no verdict lets the next admission probe at once.
        g.record(second, BreakerVerdict::Ignore).await;
        let third = admit(&g).await;
        assert!(third.is_probe());
        g.record(third, BreakerVerdict::Success).await;
        let closed = still(&g).await;
        assert_eq!(
            (closed.state, closed.epoch),
            (BreakerState::Closed, opened.epoch + 1)
        );
        g.record(third, BreakerVerdict::Failure).await;
        g.record(old, BreakerVerdict::Failure).await;
        assert_eq!(still(&g).await, closed, "stale tickets cannot reopen");
    }

    /// (9b) A probe whose answer outlives its lease still closes the breaker with its
    /// success, though a later probe holds the lease: a source whose every answer takes
    /// longer than `probe_ttl` is not kept open while calls keep coming.
    pub(super) async fn c9_a_late_probe_success_closes(env: impl Env) {
        let u = env.unit();
        let g = env.gate("s", &cfg(&env, 1).probe_ttl(u * 2).build().unwrap());
        call(&g, F).await;
        let opened = still(&g).await;
        env.pass(u).await;
        let first = admit(&g).await;
        env.pass(u * 2).await; // the first probe is still running; its lease expires
        let second = admit(&g).await;
        assert!(second.is_probe() && second.probe() != first.probe());
        g.record(first, BreakerVerdict::Success).await;
        let closed = still(&g).await;
        assert_eq!(
            (closed.state, closed.epoch),
            (BreakerState::Closed, opened.epoch + 1),
            "the late probe's success closed the breaker"
        );
        g.record(second, BreakerVerdict::Failure).await;
        assert_eq!(still(&g).await, closed, "the later probe's verdict is stale");
    }
}

macro_rules! contract_suite {
    ($name:ident, $test:meta, $env:expr) => {
        mod $name {
            use super::*;

            #[$test]
            async fn c1_rate_opens_at_min_calls() {
                cases::c1_rate_opens_at_min_calls($env("c1").await).await;
            }
            #[$test]
            async fn c1_rate_exactly_at_fail_rate_opens() {
                cases::c1_rate_exactly_at_fail_rate_opens($env("c1b").await).await;
            }
            #[$test]
            async fn c2_fewer_samples_never_rate_open() {
                cases::c2_fewer_samples_never_rate_open($env("c2").await).await;
            }
            #[$test]
            async fn c3_threshold_uses_source_concurrency() {
                cases::c3_threshold_uses_source_concurrency($env("c3").await).await;
            }
            #[$test]
            async fn c4_backoff_doubles_caps_decays() {
                cases::c4_backoff_doubles_caps_decays($env("c4").await).await;
            }
            #[$test]
            async fn c5_invalid_and_rejected_stay_out() {
                cases::c5_invalid_and_rejected_stay_out($env("c5").await).await;
            }
            #[$test]
            async fn c6_pushback_never_opens_timeouts_heal() {
                cases::c6_pushback_never_opens_timeouts_heal($env("c6").await).await;
            }
            #[$test]
            async fn c7_rate_open_pins_failure_count() {
                cases::c7_rate_open_pins_failure_count($env("c7").await).await;
            }
            #[$test]
            async fn c8_health_evidence_suppresses_consecutive() {
                cases::c8_health_evidence_suppresses_consecutive($env("c8").await).await;
            }
            #[$test]
            async fn c9_probe_lease_expiry_and_fencing() {
                cases::c9_probe_lease_expiry_and_fencing($env("c9").await).await;
            }
            #[$test]
            async fn c9_a_late_probe_success_closes() {
                cases::c9_a_late_probe_success_closes($env("c9b").await).await;
            }
        }
    };
}

async fn memory(_test: &str) -> MemEnv {
    MemEnv::new()
}

async fn standalone(test: &str) -> RedisEnv {
    RedisEnv::standalone(test).await
}

async fn cluster(test: &str) -> RedisEnv {
    RedisEnv::cluster(test).await
}

contract_suite!(memory, tokio::test(start_paused = true), memory);
contract_suite!(redis_standalone, tokio::test, standalone);
contract_suite!(redis_cluster, tokio::test, cluster);
