//! One contract, every backend: memory (paused clock), standalone Redis and the
//! 3-node cluster (real time, 1 s windows, instants on the server clock).

mod common;

use std::time::Duration;

use common::Harness;
use pgw_core::{Hold, QuotaExceeded};
use tower_ratelimit_redis::{HoldScope, Holds, Quota, RequestTooLarge};

const W: Duration = Duration::from_secs(1);

fn refused(err: &pgw_core::BoxError) -> &QuotaExceeded {
    err.downcast_ref::<QuotaExceeded>()
        .unwrap_or_else(|| panic!("expected QuotaExceeded, got {err}"))
}

/// How much later than asked a hold may end on Redis: its end's parity carries its
/// reason (`hold.lua`), rounded up to it.
const PARITY: Duration = Duration::from_millis(1);

/// One sub-window of the harness's 1 s window (the default 60 sub-windows: 10 ms).
const SUB: Duration = Duration::from_millis(10);

/// RPM 2 holds over every span of a window, not only over aligned windows: an
/// admission that a fixed window would take at the start of the next window is
/// refused until the first admission's sub-window leaves the span, and `retry_after`
/// says exactly when that is.
async fn sliding_span_never_over_quota(h: Harness) {
    let config = h.config("s1", Quota::unlimited().requests(2));
    assert_eq!(config.sub_window_len(), SUB);
    let l = h.limiter(config);
    h.align(W).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let a = l.acquire(0).await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let b = l.acquire(0).await.unwrap();
    assert_eq!(a.admission().window(), b.admission().window());
    // The next aligned window: a fixed window would admit here, 3 in one span.
    tokio::time::sleep(b.admission().window_end() - b.admission().at() + SUB).await;
    let err = l.acquire(0).await.unwrap_err();
    let q = refused(&err);
    assert_eq!((q.dimension(), q.scope()), ("rpm", Some("source:s1")));
    assert!(!q.retry_after().is_zero() && q.retry_after() <= W, "{q}");
    if h.exact {
        // a's sub-window (500 ms into the window) leaves the span one window and one
        // sub-window after it began: at 1510 ms, and this is 1010 ms.
        assert_eq!(q.retry_after(), Duration::from_millis(500));
        tokio::time::sleep(q.retry_after() - Duration::from_millis(1)).await;
        assert_eq!(
            refused(&l.acquire(0).await.unwrap_err()).retry_after(),
            Duration::from_millis(1)
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (c, since) = if h.exact {
        let since = tokio::time::Instant::now();
        (l.acquire(0).await.expect("a left the span"), since)
    } else {
        admitted_past_edge(&l, q.retry_after()).await
    };
    assert!(c.admission().at() - a.admission().at() >= W, "{c:?} {a:?}");
    // b is still in the span: the next waits for b's sub-window. The refusal came
    // after c, at most `slack` later on any clock (0 on the paused one; on a real
    // Redis, however long the two round trips took).
    let err = l.acquire(0).await.unwrap_err();
    let slack = since.elapsed();
    let q = refused(&err);
    assert!(
        c.admission().at() + slack + q.retry_after() >= b.admission().at() + W,
        "{q} (slack {slack:?})"
    );
    assert!(q.retry_after() <= W / 2, "{q}");
    if h.exact {
        assert_eq!(q.retry_after(), Duration::from_millis(400));
    }
}

/// A refusal on one dimension reserves nothing on any other, in any scope.
async fn all_or_nothing(h: Harness) {
    let acct = Quota::unlimited().requests(3);
    let s1 = h.limiter(
        h.config("s1", Quota::unlimited().tokens(100).concurrency(1))
            .account("acct", acct),
    );
    let s2 = h.limiter(h.config("s2", Quota::unlimited()).account("acct", acct));
    h.align(W).await;
    let p1 = s1.acquire(50).await.unwrap();
    let err = s1.acquire(10).await.unwrap_err();
    assert_eq!(refused(&err).dimension(), "concurrency");
    let p2 = s2.acquire(0).await.unwrap();
    p1.finish(None).await.unwrap();
    // Exactly the remaining 50 tokens and the third account request: the refused
    // admission above reserved neither.
    let p3 = s1.acquire(50).await.unwrap();
    assert_eq!(
        p3.admission().window(),
        p2.admission().window(),
        "test straddled a window"
    );
    let err = s2.acquire(0).await.unwrap_err();
    let q = refused(&err);
    assert_eq!((q.dimension(), q.scope()), ("rpm", Some("account:acct")));
    // Tokens full too: the source refuses on tpm, the account on rpm; the longest wait
    // (both to the window end) is reported, and nothing was reserved.
    drop(p3);
    let err = s1.acquire(1).await.unwrap_err();
    assert!(["tpm", "rpm"].contains(&refused(&err).dimension()));
}

/// `acquire(tokens)`, admitted at once on the paused clock; in real time (Redis) after
/// at most five more waits of the refusals' `retry_after`: a window's charges made a
/// few milliseconds apart may straddle sub-windows and leave the span one by one.
async fn admitted_after_waits(
    h: &Harness,
    l: &tower_ratelimit_redis::RateLimiter,
    tokens: u64,
) -> tower_ratelimit_redis::Permit {
    let mut waits = 0;
    loop {
        match l.acquire(tokens).await {
            Ok(p) => return p,
            Err(e) if !h.exact && waits < 5 => {
                waits += 1;
                tokio::time::sleep(refused(&e).retry_after()).await;
            }
            Err(e) => panic!("acquire({tokens}) after {waits} more waits: {e}"),
        }
    }
}

/// The reservation is reconciled to real usage: refunds and charges, in the window of
/// admission.
async fn tpm_reconcile_up_and_down(h: Harness) {
    let l = h.limiter(h.config("s1", Quota::unlimited().tokens(100)));
    h.align(W).await;
    let p = l.acquire(80).await.unwrap();
    let w = p.admission().window();
    p.finish(Some(30)).await.unwrap(); // 50 back
    let p = l.acquire(70).await.unwrap(); // 30 + 70 = 100
    assert_eq!(p.admission().window(), w, "test straddled a window");
    let err = l.acquire(1).await.unwrap_err();
    assert_eq!(refused(&err).dimension(), "tpm");
    p.finish(Some(40)).await.unwrap(); // 30 back: 70 used
    let p = l.acquire(30).await.unwrap();
    p.finish(Some(60)).await.unwrap(); // 30 charged: 130 used, over the quota after the fact
    // The window is overspent: not even a zero-token request fits.
    let err = l.acquire(0).await.unwrap_err();
    assert_eq!(refused(&err).dimension(), "tpm");
    // A refund must never go below zero. On the paused clock the window's charges
    // are all in one sub-window and leave the span together at `retry_after`.
    tokio::time::sleep(refused(&err).retry_after()).await;
    let p = admitted_after_waits(&h, &l, 10).await;
    p.finish(Some(0)).await.unwrap();
    let p = admitted_after_waits(&h, &l, 100).await;
    assert!(p.admission().window() > w);
}

/// A provider's absurd usage (`u64::MAX` tokens) is charged as `MAX_QUOTA`: the
/// window is spent, and once it leaves the span the count is exact again (charged
/// whole, its departure left a rounding error in the Redis window's running total,
/// Lua numbers being exact to 2^53 only).
async fn absurd_usage_is_charged_as_max_quota(h: Harness) {
    let l = h.limiter(h.config("s1", Quota::unlimited().tokens(100)));
    h.align(W).await;
    // A small count in one sub-window, the absurd one in a later one: their sum in
    // the running total is what a rounding would spoil.
    l.acquire(7).await.unwrap().finish(Some(7)).await.unwrap();
    tokio::time::sleep(SUB * 3).await;
    let p = l.acquire(10).await.unwrap();
    p.finish(Some(u64::MAX)).await.unwrap();
    let err = l.acquire(0).await.unwrap_err();
    assert_eq!(refused(&err).dimension(), "tpm");
    tokio::time::sleep(refused(&err).retry_after()).await;
    // The whole quota fits again: nothing of the charge is left over.
    let p = admitted_after_waits(&h, &l, 100).await;
    p.finish(Some(100)).await.unwrap();
}

/// A process that dies holds its slot only until the lease TTL; a renewed lease lives on.
async fn lease_expiry_after_crash(h: Harness) {
    let ttl = Duration::from_millis(400);
    let l = h.limiter(h.config("s1", Quota::unlimited().concurrency(1)).lease_ttl(ttl));
    let p = l.acquire(0).await.unwrap();
    p.forget(); // crash: nothing released
    let err = l.acquire(0).await.unwrap_err();
    let q = refused(&err);
    assert_eq!(q.dimension(), "concurrency");
    assert!(q.retry_after() <= tower_ratelimit_redis::DEFAULT_SLOT_RETRY_AFTER);
    tokio::time::sleep(ttl + Duration::from_millis(20)).await;
    let p = l.acquire(0).await.expect("the crashed process's slot expired");
    // Renewal keeps a live call's slot past the original TTL.
    tokio::time::sleep(ttl * 3 / 4).await;
    assert!(p.renew().await.unwrap());
    tokio::time::sleep(ttl * 3 / 4).await;
    let err = l.acquire(0).await.unwrap_err();
    assert_eq!(refused(&err).dimension(), "concurrency");
    drop(p);
    // Released on drop: for Redis the release runs in the background.
    let mut ok = false;
    for _ in 0..50 {
        if let Ok(p) = l.acquire(0).await {
            ok = true;
            p.finish(None).await.unwrap();
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(ok, "a dropped permit released its lease");
}

/// Tokens used beyond the estimate are charged where the settle lands: a call
/// admitted in one window and settled after it counts against the spans that follow
/// (with fixed windows the overrun was dropped with the closed window).
async fn overrun_charged_where_it_lands(h: Harness) {
    let l = h.limiter(h.config("s1", Quota::unlimited().tokens(100)));
    h.align(W).await;
    let p = l.acquire(80).await.unwrap();
    tokio::time::sleep(W + SUB * 2).await;
    // p's reservation has left the span: the whole quota is free...
    let probe = l.acquire(100).await.unwrap();
    probe.refund().await.unwrap();
    // ...until p reports 150 used: 70 over its estimate, charged now.
    p.finish(Some(150)).await.unwrap();
    let err = l.acquire(40).await.unwrap_err();
    let q = refused(&err);
    assert_eq!(q.dimension(), "tpm");
    assert!(q.retry_after() > W / 2 && q.retry_after() <= W + SUB, "{q}");
    let small = l.acquire(30).await.expect("70 + 30 fits");
    if h.exact {
        // The overrun's sub-window (aligned + W + 2 sub) leaves one window and a
        // sub-window later.
        assert_eq!(q.retry_after(), W + SUB);
    }
    // On Redis the clock is real: the 30 may have been admitted one sub-window after
    // the overrun was charged (a round trip across a sub-window edge), so it may leave
    // one sub-window later.
    let slack = if h.exact { Duration::ZERO } else { SUB };
    tokio::time::sleep(q.retry_after() + slack).await;
    small.finish(None).await.unwrap();
    // The overrun and the 30 left the span.
    l.acquire(100).await.expect("everything left the span");
}

/// Waits a refusal's `retry_after` on Redis's real clock and is admitted. The wait is
/// timed on this process's clock, which may wake a millisecond short of the server's
/// edge: then the refusal says so (a millisecond or two, asserted), and a next try, at
/// most three, is admitted. Answers the permit and the instant its admission was asked.
/// Stricter than [`admitted_after_waits`], which accepts a refusal of any length (a
/// window's charges leaving the span one by one): here the edge is known, and only the
/// two clocks' rounding may separate it from the wait.
async fn admitted_past_edge(
    l: &tower_ratelimit_redis::RateLimiter,
    retry_after: Duration,
) -> (tower_ratelimit_redis::Permit, tokio::time::Instant) {
    let mut wait = retry_after;
    for _ in 0..3 {
        tokio::time::sleep(wait).await;
        let asked = tokio::time::Instant::now();
        match l.acquire(0).await {
            Ok(p) => return (p, asked),
            Err(err) => {
                let again = refused(&err);
                assert!(again.retry_after() <= Duration::from_millis(2), "{again}");
                wait = again.retry_after();
            }
        }
    }
    panic!("still refused a few milliseconds past the span's edge");
}

/// `retry_after` just before a lone admission leaves the span is the time left until
/// its sub-window does, and admission works again right after it elapses.
async fn retry_after_at_span_edge(h: Harness) {
    let l = h.limiter(h.config("s1", Quota::unlimited().requests(1)));
    let margin = if h.exact {
        Duration::from_millis(50)
    } else {
        Duration::from_millis(250)
    };
    for _ in 0..3 {
        h.align(W).await;
        let p = l.acquire(0).await.unwrap();
        // p's sub-window leaves the span one window and one sub-window after it began.
        let began = Duration::from_millis(p.admission().at().as_millis() as u64 / 10 * 10);
        let leaves = began + W + SUB;
        tokio::time::sleep(leaves - p.admission().at() - margin).await;
        match l.acquire(0).await {
            Err(err) => {
                let q = refused(&err);
                assert!(q.retry_after() <= margin && !q.retry_after().is_zero(), "{q}");
                if h.exact {
                    assert_eq!(q.retry_after(), margin);
                    tokio::time::sleep(q.retry_after() - Duration::from_millis(1)).await;
                    let q2 = l.acquire(0).await.unwrap_err();
                    assert_eq!(refused(&q2).retry_after(), Duration::from_millis(1));
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    let next = l.acquire(0).await.unwrap();
                    assert!(next.admission().at() >= leaves, "{next:?}");
                    return;
                }
                let (next, _) = admitted_past_edge(&l, q.retry_after()).await;
                assert!(next.admission().at() >= leaves, "{next:?}");
                return;
            }
            // A loaded machine slept past the edge: p really left the span.
            Ok(next) => assert!(!h.exact && next.admission().at() >= leaves),
        }
    }
    panic!("could not observe the span's edge in three tries");
}

/// A request larger than a whole window's token quota is refused at once.
async fn oversize_request_rejected(h: Harness) {
    let l = h.limiter(
        h.config("s1", Quota::unlimited().tokens(100))
            .account("acct-big", Quota::unlimited().tokens(50)),
    );
    let err = l.acquire(51).await.unwrap_err();
    let e = err.downcast_ref::<RequestTooLarge>().expect("RequestTooLarge");
    assert_eq!((e.tokens(), e.quota(), e.scope()), (51, 50, "account:acct-big"));
    assert!(e.to_string().contains("51") && e.to_string().contains("account:acct-big"));
    assert_eq!(l.stats().admitted, 0);
    l.acquire(50).await.unwrap();
}

/// A hold on an account refuses every source of that account until it ends, and not a
/// moment longer; other accounts are untouched.
async fn account_hold(h: Harness) {
    let s1 = h.limiter(
        h.config("s1", Quota::unlimited())
            .account("acct", Quota::unlimited()),
    );
    let s2 = h.limiter(
        h.config("s2", Quota::unlimited())
            .account("acct", Quota::unlimited()),
    );
    let s3 = h.limiter(h.config("s3", Quota::unlimited()));
    let hold = Duration::from_millis(500);
    let until = s1.hold(HoldScope::Account, hold).await.unwrap();
    for l in [&s1, &s2] {
        let err = l.acquire(0).await.unwrap_err();
        let q = refused(&err);
        assert_eq!((q.dimension(), q.scope()), ("hold", Some("account:acct")));
        // On Redis a hold may end 1 ms late (its end's parity carries its reason).
        assert!(q.retry_after() <= hold + PARITY && !q.retry_after().is_zero());
    }
    s3.acquire(0).await.unwrap();
    let err = s2.acquire(0).await.unwrap_err();
    let left = refused(&err).retry_after();
    if h.exact {
        assert_eq!(left, hold);
        tokio::time::sleep(left - Duration::from_millis(1)).await;
        assert_eq!(
            refused(&s2.acquire(0).await.unwrap_err()).retry_after(),
            Duration::from_millis(1)
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    } else {
        tokio::time::sleep(left).await;
    }
    let p = s2.acquire(0).await.expect("admitted the moment the hold ends");
    assert!(p.admission().at() >= until);
    s1.acquire(0).await.unwrap();

    // The retry layer's handle holds the source and its account in one call.
    let holds = Holds::new([s1.clone(), s2.clone(), s3.clone()]);
    holds.hold(&"s1".into(), hold).await.unwrap();
    assert_eq!(refused(&s1.acquire(0).await.unwrap_err()).dimension(), "hold");
    assert_eq!(refused(&s2.acquire(0).await.unwrap_err()).dimension(), "hold");
    s3.acquire(0).await.unwrap();
    let err = holds.hold(&"nope".into(), hold).await.unwrap_err();
    assert!(err.to_string().contains("nope"));
    // A source hold leaves its account's other sources alone.
    holds.hold(&"s3".into(), hold).await.unwrap();
    assert_eq!(
        refused(&s3.acquire(0).await.unwrap_err()).scope(),
        Some("source:s3")
    );
    // A shorter hold never cuts a longer one.
    s3.hold(HoldScope::Source, Duration::from_millis(1))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(s3.acquire(0).await.is_err());
}

/// A hold placed after an overloaded provider's pushback says so to every admission it
/// refuses: through the backend's refusal (a limiter with a quota asks) and through the
/// cached holds (a limiter with nothing else to enforce), in this process and, on
/// Redis, in another. A rate limit's hold does not; of two holds the longer one's
/// reason counts.
async fn a_hold_after_overload_says_so(h: Harness) {
    fn after_overload(l: &tower_ratelimit_redis::RateLimiter, err: &pgw_core::BoxError) -> bool {
        let q = refused(err);
        assert_eq!(q.dimension(), "hold", "{} refused by {q}", l.source());
        assert_eq!(q.is_after_overload(), q.to_string().contains("overloaded"), "{q}");
        q.is_after_overload()
    }
    let hold = Duration::from_millis(500);
    // s1 asks the backend at each admission (a quota); s2 only honours holds.
    let configs = [
        h.config("s1", Quota::unlimited().requests(1000)),
        h.config("s2", Quota::unlimited()),
    ];
    for config in configs {
        let l = h.limiter(config.clone());
        let other = h.other_process(config);
        l.hold_after_overload(HoldScope::Source, hold).await.unwrap();
        assert!(after_overload(&l, &l.acquire(0).await.unwrap_err()));
        if let Some(o) = &other {
            assert!(
                after_overload(o, &o.acquire(0).await.unwrap_err()),
                "another process"
            );
        }
        // A longer hold after a rate limit takes over, with its reason; a shorter
        // overload one changes nothing.
        l.hold(HoldScope::Source, hold * 4).await.unwrap();
        l.hold_after_overload(HoldScope::Source, hold).await.unwrap();
        assert!(!after_overload(&l, &l.acquire(0).await.unwrap_err()));
        if let Some(o) = &other {
            // The other process learns the longer hold once the one it knew ended and
            // its cache of holds is older than `hold_refresh` (1 s).
            tokio::time::sleep(Duration::from_millis(1100)).await;
            assert!(
                !after_overload(o, &o.acquire(0).await.unwrap_err()),
                "another process"
            );
        }
    }
    // A process placing a shorter hold over a longer one (here, or on Redis placed by
    // another process) learns the longer one, with its reason and its end.
    let config = h.config("s5", Quota::unlimited().requests(1000));
    let l = h.limiter(config.clone());
    let placer = h.other_process(config).unwrap_or_else(|| l.clone());
    let longer = placer
        .hold_after_overload(HoldScope::Source, hold * 4)
        .await
        .unwrap();
    let end = l.hold(HoldScope::Source, hold).await.unwrap();
    assert!(end >= longer, "the longer hold's end: {end:?} < {longer:?}");
    let err = l.acquire(0).await.unwrap_err();
    assert!(after_overload(&l, &err));
    assert!(refused(&err).retry_after() > hold, "{}", refused(&err));
    // A hold of nothing holds nothing, not even for the parity's millisecond.
    let s6 = h.limiter(h.config("s6", Quota::unlimited()));
    s6.hold_after_overload(HoldScope::Source, Duration::ZERO)
        .await
        .unwrap();
    s6.acquire(0).await.expect("a zero hold holds nothing");
    // A rate limit's hold alone, through the retry layer's handle: not an overload.
    let s3 = h.limiter(h.config("s3", Quota::unlimited().requests(1000)));
    Holds::new([s3.clone()]).hold(&"s3".into(), hold).await.unwrap();
    assert!(!after_overload(&s3, &s3.acquire(0).await.unwrap_err()));
    let s4 = h.limiter(h.config("s4", Quota::unlimited().requests(1000)));
    Holds::new([s4.clone()])
        .hold_after_overload(&"s4".into(), hold, false)
        .await
        .unwrap();
    assert!(after_overload(&s4, &s4.acquire(0).await.unwrap_err()));
}

/// Sources of one account share its concurrency slots, and releasing one source's
/// lease never releases another's.
async fn account_concurrency_shared(h: Harness) {
    let acct = Quota::unlimited().concurrency(2);
    let s1 = h.limiter(
        h.config("s1", Quota::unlimited().concurrency(5))
            .account("acct", acct),
    );
    let s2 = h.limiter(
        h.config("s2", Quota::unlimited().concurrency(5))
            .account("acct", acct),
    );
    let p1 = s1.acquire(0).await.unwrap();
    let p2 = s2.acquire(0).await.unwrap();
    let err = s1.acquire(0).await.unwrap_err();
    assert_eq!(refused(&err).scope(), Some("account:acct"));
    p1.finish(None).await.unwrap();
    let p3 = s1.acquire(0).await.unwrap();
    let err = s2.acquire(0).await.unwrap_err();
    assert_eq!(
        refused(&err).dimension(),
        "concurrency",
        "p2's lease is still held"
    );
    p2.finish(None).await.unwrap();
    p3.finish(None).await.unwrap();
}

/// A renewal answers `false` when the lease was lost in any scope (here the account's,
/// purged by another source's admission after the TTL), on every backend alike.
async fn renew_reports_a_lease_lost_in_any_scope(h: Harness) {
    let ttl = Duration::from_millis(300);
    let acct = Quota::unlimited().concurrency(1);
    let s1 = h.limiter(
        h.config("s1", Quota::unlimited().concurrency(1))
            .account("acct", acct)
            .lease_ttl(ttl),
    );
    let s2 = h.limiter(
        h.config("s2", Quota::unlimited().concurrency(1))
            .account("acct", acct)
            .lease_ttl(ttl),
    );
    let p = s1.acquire(0).await.unwrap();
    assert!(p.renew().await.unwrap(), "a live lease renews");
    tokio::time::sleep(ttl + Duration::from_millis(20)).await;
    // s2's admission purges p's expired lease from the account (not from s1's scope).
    let q = s2.acquire(0).await.unwrap();
    assert!(
        !p.renew().await.unwrap(),
        "the account's slot is gone: the lease was lost"
    );
    assert_eq!(s1.stats().leases_lost, 1);
    q.finish(None).await.unwrap();
    p.finish(None).await.unwrap();
}

/// An absurd hold (`Duration::MAX`, e.g. from a bogus Retry-After) neither panics nor
/// fails: the scope is held.
async fn huge_hold(h: Harness) {
    let l = h.limiter(h.config("s1", Quota::unlimited()));
    let until = l.hold(HoldScope::Source, Duration::MAX).await.unwrap();
    assert!(until > Duration::from_secs(365 * 24 * 3600), "{until:?}");
    let err = l.acquire(0).await.unwrap_err();
    let q = refused(&err);
    assert_eq!(q.dimension(), "hold");
    assert!(q.retry_after() > Duration::from_secs(365 * 24 * 3600), "{q}");
}

/// `held` reads the backend: unexpired leases per scope (of every source sharing it),
/// when the last expires, active holds; a forgotten lease counts until its TTL runs
/// out and then no more, although nothing has purged it.
async fn held_reads_leases_and_holds(h: Harness) {
    let ttl = Duration::from_millis(400);
    let acct = Quota::unlimited().concurrency(4);
    let s1 = h.limiter(
        h.config("s1", Quota::unlimited().concurrency(2))
            .account("acct", acct)
            .lease_ttl(ttl),
    );
    let s2 = h.limiter(
        h.config("s2", Quota::unlimited().concurrency(2))
            .account("acct", acct)
            .lease_ttl(ttl),
    );
    let alone = h.limiter(h.config("s3", Quota::unlimited().requests(10)));

    let held = s1.held().await.unwrap();
    assert_eq!((held.source.scope.as_str(), held.source.leases), ("source:s1", 0));
    let account = held.account.as_ref().unwrap();
    assert_eq!((account.scope.as_str(), account.leases), ("account:acct", 0));
    assert_eq!(held.scopes().count(), 2);
    assert!(
        held.scopes()
            .all(|s| s.leases_expire_in.is_none() && s.hold_ends_in.is_none())
    );

    let a = s1.acquire(0).await.unwrap();
    let b = s2.acquire(0).await.unwrap();
    let c = s2.acquire(0).await.unwrap();
    let held = s1.held().await.unwrap();
    assert_eq!(held.source.leases, 1);
    assert_eq!(
        held.account.as_ref().unwrap().leases,
        3,
        "every source of the account"
    );
    assert_eq!(held.leases(), 4);
    let left = held.source.leases_expire_in.expect("a lease is held");
    assert!(left <= ttl && !left.is_zero(), "{left:?}");
    if h.exact {
        assert_eq!(left, ttl);
    }
    assert_eq!(s2.held().await.unwrap().source.leases, 2);

    b.finish(None).await.unwrap();
    c.refund().await.unwrap();
    a.forget(); // a crash (or a release lost in an outage): held until its TTL
    let held = s2.held().await.unwrap();
    assert_eq!(
        (held.source.leases, held.account.as_ref().unwrap().leases),
        (0, 1)
    );
    assert_eq!(held.source.leases_expire_in, None);
    assert_eq!(s1.held().await.unwrap().source.leases, 1);

    let hold = Duration::from_millis(600);
    s1.hold(HoldScope::Account, hold).await.unwrap();
    let held = s2.held().await.unwrap();
    assert_eq!(
        held.source.hold_ends_in, None,
        "an account hold is not the source's"
    );
    let ends = held
        .account
        .as_ref()
        .unwrap()
        .hold_ends_in
        .expect("the account is held");
    assert!(ends <= hold + PARITY && !ends.is_zero(), "{ends:?}");

    tokio::time::sleep(ttl + Duration::from_millis(20)).await;
    // Expired, not purged (nothing was admitted since): no longer held.
    let held = s1.held().await.unwrap();
    assert_eq!(held.leases(), 0, "{held:?}");
    assert!(held.account.as_ref().unwrap().hold_ends_in.is_some());
    tokio::time::sleep(hold).await;
    let held = s1.held().await.unwrap();
    assert!(held.scopes().all(|s| s.hold_ends_in.is_none()), "{held:?}");

    // A source without an account and without a concurrency limit.
    alone.acquire(1).await.unwrap().finish(None).await.unwrap();
    let held = alone.held().await.unwrap();
    assert_eq!(held.account, None);
    assert_eq!((held.source.scope.as_str(), held.leases()), ("source:s3", 0));
    alone.hold(HoldScope::Both, hold).await.unwrap();
    assert!(alone.held().await.unwrap().source.hold_ends_in.is_some());
}

macro_rules! contract {
    ($($case:ident),* $(,)?) => {
        mod memory {
            use super::*;
            $(
                #[tokio::test(start_paused = true)]
                async fn $case() {
                    super::$case(Harness::memory()).await;
                }
            )*
        }
        mod redis_standalone {
            use super::*;
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case(Harness::redis(common::standalone(), stringify!($case)).await).await;
                }
            )*
        }
        mod redis_cluster {
            use super::*;
            $(
                #[tokio::test]
                async fn $case() {
                    super::$case(Harness::redis(common::cluster(), stringify!($case)).await).await;
                }
            )*
        }
    };
}

contract!(
    sliding_span_never_over_quota,
    overrun_charged_where_it_lands,
    all_or_nothing,
    tpm_reconcile_up_and_down,
    absurd_usage_is_charged_as_max_quota,
    lease_expiry_after_crash,
    retry_after_at_span_edge,
    oversize_request_rejected,
    account_hold,
    a_hold_after_overload_says_so,
    account_concurrency_shared,
    renew_reports_a_lease_lost_in_any_scope,
    huge_hold,
    held_reads_leases_and_holds,
);
