//! The Redis backend: state shared by every process, one Lua script per operation.
//!
//! Each source's gate is one HASH, `{prefix}:{source}:gate` (hash-tagged by
//! [`scope_key`], so a cluster keeps every key of a source in one slot), with the fixed
//! fields `open, epoch, open_until, probe_id, probe_until, failures, win_id, a0, f0, a1,
//! f1, streak, closed_since, ttl_end, probe_claim` and a TTL of four times the longest
//! of the window, the longest cooldown and the probe TTL, set on every state change and
//! by a record once less than half of it is left (`ttl_end`). Time is the server's
//! `TIME`, never the local clock. Admission is one `EVALSHA`, and so is a record.
//!
//! An admission that asks Redis sends its question at once, in a task of its own (see
//! [`RedisGate`]): a probe lease whose caller dropped the admission, or whose question
//! failed or timed out, is released by one more `EVALSHA` instead of refusing every
//! process for the probe TTL; the admissions waiting on that question hear its answer
//! or its failure.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::Duration;

use pgw_core::clock::saturating_after;
use pgw_core::redis_conn::{DEFAULT_RESPONSE_TIMEOUT, RedisConn, run, scope_key, unique_id};
use pgw_core::sync::lock;
use pgw_core::{BackendUnavailable, BoxError, BreakerVerdict, SourceId};
use redis::Script;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{Admission, Backend, BoxFuture, Gate};
use crate::config::BreakerConfig;
use crate::state::{BreakerView, Effect, GateState, Params, Ticket};

static ADMIT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/admit.lua")));
static RECORD: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/record.lua")));
static VIEW: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/view.lua")));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../lua/release.lua")));

/// The claims this process sent with admission questions (made unique across
/// processes by [`unique_id`]).
static CLAIMS: AtomicU64 = AtomicU64::new(1);

/// The default key prefix: `pgw:brk`.
pub const DEFAULT_PREFIX: &str = "pgw:brk";

/// How long a process trusts a closed breaker it was admitted by, by default: 5 s.
///
/// Within it, this process admits to the source without a round trip. Its own
/// outcomes take effect at once (a record that opens the breaker forgets the view),
/// and another process's open reaches it at the first outcome it records after that
/// open (the ticket's epoch is over: the record answers "stale" and the view is
/// forgotten), or when the view ends. So the view bounds the attempts this process
/// starts on an opened source before one of its outcomes lands: at most one view's
/// worth. A waiting call's rounds ask every source's gate each time a slot frees:
/// without a view, each such question was a round trip (P6 in the Redis mode: 32
/// breaker admissions per call, for 1.26 attempts). 5 s is half of pgw-stack's 10 s
/// cooldown and shorter than most LLM calls; Redis-mode P6 (2000 calls, 2 workers,
/// 2026-12-02): 43.2 Redis commands per call with 1 s, 38.0 with 5 s, 38.2 with 10 s,
/// success unchanged. `Duration::ZERO` asks Redis every time.
///
/// Within the view, successes are also counted in this process and sent with the next
/// record that goes to Redis (see [`RedisBackend::with_deferred_successes`]).
pub const DEFAULT_CLOSED_VIEW: Duration = Duration::from_secs(5);

/// Successes a gate keeps before it sends them even within its closed view: 1024.
pub const MAX_DEFERRED_SUCCESSES: u32 = 1024;

/// State in Redis (standalone or cluster), shared by every process using the same
/// prefix.
#[derive(Clone)]
pub struct RedisBackend {
    conn: RedisConn,
    prefix: String,
    timeout: Duration,
    closed_view: Duration,
    defer_successes: bool,
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("conn", &self.conn)
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("closed_view", &self.closed_view)
            .field("defer_successes", &self.defer_successes)
            .finish()
    }
}

impl RedisBackend {
    /// A backend on `conn` with the [`DEFAULT_PREFIX`], the connection's default
    /// timeout ([`DEFAULT_RESPONSE_TIMEOUT`]) and the [`DEFAULT_CLOSED_VIEW`].
    #[must_use]
    pub fn new(conn: RedisConn) -> Self {
        Self {
            conn,
            prefix: DEFAULT_PREFIX.to_owned(),
            timeout: DEFAULT_RESPONSE_TIMEOUT,
            closed_view: DEFAULT_CLOSED_VIEW,
            defer_successes: true,
        }
    }

    /// Whether a success admitted under this process's closed view is counted here
    /// and sent with the next record that goes to Redis, instead of in a round trip of
    /// its own (default `true`; needs a non-zero closed view).
    ///
    /// A success in a closed breaker changes nothing another process acts on at once:
    /// it resets the consecutive-failure count and adds to the window's calls. So the
    /// gate keeps a count of them (for the epoch they were admitted in) and sends it
    /// with this process's next failure, before it (the order of this process's
    /// outcomes is kept), or with the first success after the view ends (whose answer
    /// renews the view), or once [`MAX_DEFERRED_SUCCESSES`] have gathered; a record
    /// of another epoch leaves them, and an epoch that ended discards them, as their
    /// own records would have been. The price: another process sees this one's
    /// successes up to one closed view late (its failures may meanwhile weigh more in
    /// the window), and a process that ends, or stops recording, loses at most one
    /// view's successes; a count older than the rate window is dropped, not sent (sent
    /// after an idle spell, it would land in the current bucket and outweigh the
    /// failures of a source that died meanwhile). Redis-mode P6 (2000 calls, 2 workers): the breaker's records
    /// were 3.4 of 27.5 Redis commands per call.
    #[must_use]
    pub const fn with_deferred_successes(mut self, defer: bool) -> Self {
        self.defer_successes = defer;
        self
    }

    /// Sets how long an admission by a closed breaker is trusted without a round trip
    /// ([`DEFAULT_CLOSED_VIEW`]; `Duration::ZERO`: never; a huge value, up to
    /// `Duration::MAX`, saturates: trusted until a refusal is seen).
    #[must_use]
    pub const fn with_closed_view(mut self, closed_view: Duration) -> Self {
        self.closed_view = closed_view;
        self
    }

    /// Sets the key prefix (processes sharing state must use the same one).
    #[must_use]
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Sets how long one operation may take before the backend counts as unreachable
    /// (`pgw_core::redis_conn::DEFAULT_RESPONSE_TIMEOUT`). `Duration::ZERO` leaves no
    /// time: every operation counts as unreachable, and the breaker fails closed.
    #[must_use]
    pub const fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The gate hash of `source`.
    #[must_use]
    pub fn gate_key(&self, source: &SourceId) -> String {
        format!("{}gate", scope_key(&self.prefix, source.as_str()))
    }
}

impl Backend for RedisBackend {
    type Gate = RedisGate;

    fn gate(&self, source: &SourceId, config: &BreakerConfig) -> RedisGate {
        RedisGate(Arc::new(Inner {
            conn: self.conn.clone(),
            key: self.gate_key(source),
            source: source.clone(),
            params: Params::of(config),
            timeout: self.timeout,
            record_errors: AtomicU64::new(0),
            records: AtomicU64::new(0),
            record_seq: AtomicU64::new(0),
            closed_view: self.closed_view,
            defer_successes: self.defer_successes && !self.closed_view.is_zero(),
            deferred: std::sync::Mutex::new(Deferred {
                epoch: 0,
                n: 0,
                since: Instant::now(),
            }),
            window: config.window(),
            known: std::sync::Mutex::new(Known::Nothing),
            opens: AtomicU64::new(0),
            flight: std::sync::Mutex::new(None),
        }))
    }
}

struct Inner {
    conn: RedisConn,
    key: String,
    source: SourceId,
    params: Params,
    timeout: Duration,
    record_errors: AtomicU64,
    /// How the newest record that ended went ([`record_ended`]): its number (in the
    /// order sent) and whether it failed. While it failed, callers are not held for
    /// their records (B12), until a newer one lands or an admission is answered.
    records: AtomicU64,
    /// The numbers of records as sent.
    record_seq: AtomicU64,
    closed_view: Duration,
    defer_successes: bool,
    /// Successes counted here and not yet sent (see
    /// [`RedisBackend::with_deferred_successes`]).
    deferred: std::sync::Mutex<Deferred>,
    /// The rate window: deferred successes older than it are dropped, not sent.
    window: Duration,
    known: std::sync::Mutex<Known>,
    /// Opens recorded by this process: an admission answered across one is not kept
    /// as a closed view (it may have been judged before the open landed).
    opens: AtomicU64,
    /// The admission this process is asking Redis, if any: admissions that find the
    /// view unknown meanwhile wait for its answer instead of asking too.
    flight: std::sync::Mutex<Option<Flight>>,
}

/// Successes of the closed breaker of `epoch` this process counted and did not send,
/// the first of them at `since`.
#[derive(Clone, Copy, Debug)]
struct Deferred {
    epoch: u64,
    n: u32,
    since: Instant,
}

/// One admission question in flight, as the admissions that wait for it see it.
struct Flight {
    /// This process's count of opens when it was sent.
    opens: u64,
    /// Its answer once in (a sender dropped without one, when the runtime dropped the
    /// question, sends every waiter to ask on its own).
    answer: watch::Receiver<Option<Heard>>,
}

/// What the waiters on a question hear.
#[derive(Clone, Debug)]
enum Heard {
    /// The script's answer.
    Answer(Admission),
    /// No answer: the backend failed or did not answer within its timeout.
    Failed(Arc<str>),
}

/// The admission script's reply: admitted, epoch, probe lease id, retry after (ms),
/// open.
type AdmitReply = (i64, i64, i64, i64, i64);

impl Inner {
    /// What a record of `verdict` on `ticket` sends: `None` when it is a success kept
    /// here (admitted under the closed view, which still holds), else the deferred
    /// successes of its epoch to send first (taken).
    fn successes_to_send(&self, ticket: Ticket, verdict: BreakerVerdict) -> Option<u32> {
        if !self.defer_successes || ticket.is_probe() || verdict == BreakerVerdict::Ignore {
            return Some(0);
        }
        let now = Instant::now();
        let mut deferred = lock(&self.deferred);
        // Successes of an epoch that ended are discarded, as their own records would
        // have been (a record of another epoch answers "stale"): left, they stopped
        // this gate from deferring for good. Successes older than the window are
        // discarded too: sent now, they would land in the current bucket and, after
        // an idle spell, outweigh the failures of a source that died meanwhile (the
        // consecutive channel counts only while the window holds few calls).
        if deferred.n > 0
            && (deferred.epoch < ticket.epoch()
                || now.saturating_duration_since(deferred.since) > self.window)
        {
            deferred.n = 0;
        }
        if verdict == BreakerVerdict::Success {
            let known = *lock(&self.known);
            let in_view = matches!(known, Known::Closed(until, e) if e == ticket.epoch() && now < until);
            // Kept for a whole view already: sent with this one. Every admission of a
            // process that records no failure renews the view, so "the first success
            // after the view" never came, and the kept successes were sent only by a
            // failure here (or dropped after a window): another process's run of
            // failures opened the breaker on the consecutive channel meanwhile.
            // Within half a window, when the view is longer: kept successes older than
            // the window are dropped above, so a view as long as it sent none of them.
            let kept_a_view = deferred.n > 0
                && now.saturating_duration_since(deferred.since) >= self.closed_view.min(self.window / 2);
            if in_view
                && !kept_a_view
                && (deferred.n == 0 || deferred.epoch == ticket.epoch())
                && deferred.n + 1 < MAX_DEFERRED_SUCCESSES
            {
                let since = if deferred.n == 0 { now } else { deferred.since };
                *deferred = Deferred {
                    epoch: ticket.epoch(),
                    n: deferred.n + 1,
                    since,
                };
                return None;
            }
        }
        if deferred.n > 0 && deferred.epoch == ticket.epoch() {
            let n = deferred.n;
            deferred.n = 0;
            return Some(n);
        }
        Some(0)
    }

    /// Record number `seq` ended, `landed` or not: it says how records go if no newer
    /// one ended before it (a timeout sent before a record that landed may end after
    /// it, and says nothing of Redis now).
    fn record_ended(&self, seq: u64, landed: bool) {
        let _ = self
            .records
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                record_state(w, seq, landed)
            });
    }

    /// A probe is over (recorded, or its lease released): a "probe out" this process
    /// learnt is forgotten, and the next admission asks.
    fn probe_ended(&self) {
        let mut known = lock(&self.known);
        if matches!(*known, Known::ProbeOut(_)) {
            *known = Known::Nothing;
        }
    }

    /// Redis said, to a question sent at `sent`, that the breaker is closed in
    /// `epoch`: trusted for the closed view from then, unless an open of this process
    /// (its count was `opens` at `sent`) or a newer refusal came since.
    fn saw_closed(&self, sent: Instant, epoch: u64, opens: u64) {
        if self.closed_view.is_zero() {
            return;
        }
        let mut known = lock(&self.known);
        if self.opens.load(Ordering::Acquire) != opens {
            return;
        }
        let until = saturating_after(sent, self.closed_view);
        *known = match *known {
            // Never over a newer fact: an open seen meanwhile stands.
            k @ Known::Open(u) if u > sent => k,
            Known::Closed(u, e) if e == epoch && u > until => Known::Closed(u, e),
            _ => Known::Closed(until, epoch),
        };
    }
}

/// What this process last learnt of the gate, and until when (local clock, counted
/// from when the question was sent) it answers admissions without a round trip.
#[derive(Clone, Copy, Debug)]
enum Known {
    Nothing,
    /// Seen open: refused until then. Nothing closes an open breaker before its
    /// `open_until` (a probe is admitted only after it), so this loses nothing.
    Open(Instant),
    /// Refused because a probe is out: refused until then, at most the closed view
    /// after the question was sent. The probe may close the breaker any moment; this
    /// process learns it within the view, as it learns another process's open within
    /// the view of a closed breaker, and at once when the probe is its own (its record
    /// forgets this). Without it, every waiting call's round asked Redis while a probe
    /// hung on a black hole (P6's Redis mode: 3.3 admissions per call).
    ProbeOut(Instant),
    /// Admitted by the closed breaker of `epoch`: admitted until then (the closed
    /// view, [`DEFAULT_CLOSED_VIEW`]). Forgotten by any refusal, and by a record of
    /// this process that opens the breaker or finds its epoch over (another process
    /// opened it: learnt from the first outcome recorded since).
    Closed(Instant, u64),
}

/// An admission's answer on its way to the caller that asked. A probe lease in it
/// that the caller never reads (it dropped its admission, or the answer came after it
/// left) is released when this is dropped, instead of refusing every process "probe
/// out" for the probe TTL.
struct Delivery {
    answer: Option<Result<Admission, BackendUnavailable>>,
    /// The gate and the question's claim, until the caller takes the answer.
    claim: Option<(Arc<Inner>, String)>,
}

impl Delivery {
    /// The answer, taken by its caller: a lease in it is the caller's now.
    fn take(mut self) -> Result<Admission, BackendUnavailable> {
        self.claim = None;
        self.answer
            .take()
            .unwrap_or_else(|| Err(BackendUnavailable::new("redis", "admit", "no answer")))
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        let Some((inner, claim)) = self.claim.take() else {
            return;
        };
        if !matches!(self.answer, Some(Ok(Admission::Admitted(t))) if t.is_probe()) {
            return;
        }
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { RedisGate::release(&inner, &claim).await });
        }
    }
}

/// One source's gate in Redis.
///
/// [`Gate::admit`] answers from this process's view when it can; otherwise it sends
/// the admission script when called, not when first polled, in a task of its own
/// (inside a tokio runtime; outside one, the returned future asks). So a caller that
/// drops the admission, or whose question times out, leaves no probe lease behind
/// (the task releases it), and admissions waiting on one question fail with it when
/// Redis does not answer, after the backend's timeout, not twice that.
#[derive(Clone)]
pub struct RedisGate(Arc<Inner>);

impl fmt::Debug for RedisGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisGate")
            .field("key", &self.0.key)
            .finish_non_exhaustive()
    }
}

fn verdict_code(v: BreakerVerdict) -> &'static str {
    match v {
        BreakerVerdict::Success => "s",
        BreakerVerdict::Failure => "f",
        BreakerVerdict::ForceOpen => "o",
        BreakerVerdict::Ignore => "i",
    }
}

fn non_negative(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

impl RedisGate {
    /// Successes this process counted under its closed view and has not sent to Redis
    /// yet (see [`RedisBackend::with_deferred_successes`]).
    #[must_use]
    pub fn deferred_successes(&self) -> u32 {
        lock(&self.0.deferred).n
    }

    /// One admission question, sent in a task of its own where there is a runtime, so
    /// its answer is heard even when the caller that asked is gone or has given up:
    /// - a probe lease that no caller will record is released at once (`release.lua`,
    ///   as a probe ended without a verdict), instead of refusing every process "probe
    ///   out" for the probe TTL. That is a lease answered to a caller that dropped its
    ///   admission, and any lease the question may have taken when it failed or timed
    ///   out: the question sends a claim of its own, kept with a lease it takes, and
    ///   the release frees only a lease of that claim;
    /// - the admissions waiting on this question (`flight`) hear its answer, or its
    ///   failure, when it is in: they do not ask again after it failed.
    ///
    /// The question is sent when this is called, not when the future is first polled.
    fn ask(
        inner: Arc<Inner>,
        sent: Instant,
        opens: u64,
        flight: Option<watch::Sender<Option<Heard>>>,
    ) -> BoxFuture<Result<Admission, BoxError>> {
        let claim = unique_id(CLAIMS.fetch_add(1, Ordering::Relaxed));
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // No runtime to run it on: asked by the caller's future, as a plain call.
            return Box::pin(async move {
                let answer = Self::question(&inner, sent, opens, &claim).await;
                Self::publish(&inner, flight, &answer);
                answer.map_err(Into::into)
            });
        };
        let (tx, rx) = oneshot::channel::<Delivery>();
        rt.spawn(async move {
            let answer = Self::question(&inner, sent, opens, &claim).await;
            Self::publish(&inner, flight, &answer);
            let failed = answer.is_err();
            // A probe lease nobody takes is released when its delivery is dropped:
            // here when the caller is gone, or with the channel when the caller drops
            // its admission after the answer came, unread.
            let _ = tx.send(Delivery {
                answer: Some(answer),
                claim: Some((Arc::clone(&inner), claim.clone())),
            });
            // No answer: the script may have run, or may still run (queued behind a
            // slow server), and leased a probe to this claim; the release is queued
            // behind it on the same connection.
            if failed {
                Self::release(&inner, &claim).await;
            }
        });
        Box::pin(async move {
            match rx.await {
                Ok(delivery) => delivery.take().map_err(Into::into),
                Err(_) => {
                    Err(BackendUnavailable::new("redis", "admit", "the runtime dropped the question").into())
                }
            }
        })
    }

    /// Sends the admission script with `claim` and reads what its answer teaches.
    async fn question(
        inner: &Inner,
        sent: Instant,
        opens: u64,
        claim: &str,
    ) -> Result<Admission, BackendUnavailable> {
        let mut conn = inner.conn.clone();
        let p = &inner.params;
        let mut call = ADMIT.prepare_invoke();
        call.key(&inner.key)
            .arg(p.probe_ttl)
            .arg(p.cooldown)
            .arg(p.key_ttl)
            .arg(claim);
        let reply: AdmitReply = run("admit", inner.timeout, call.invoke_async(&mut conn)).await?;
        Ok(Self::heard(inner, sent, opens, reply))
    }

    /// Frees the probe lease of `claim`, if there is one (see [`Self::ask`]).
    async fn release(inner: &Inner, claim: &str) {
        let mut conn = inner.conn.clone();
        let mut call = RELEASE.prepare_invoke();
        call.key(&inner.key).arg(claim);
        match run("release", inner.timeout, call.invoke_async::<i64>(&mut conn)).await {
            Ok(released) => {
                tracing::debug!(source = %inner.source, released, "breaker probe claim of a gone caller");
                if released == 1 {
                    // The probe is free again: refusals learnt while it was out stop.
                    inner.probe_ended();
                }
            }
            Err(e) => {
                // The lease, if the question took one, ends with the probe TTL.
                tracing::debug!(source = %inner.source, error = %e, "breaker probe claim not released");
            }
        }
    }

    /// Tells the admissions waiting on a question what it answered.
    fn publish(
        inner: &Inner,
        flight: Option<watch::Sender<Option<Heard>>>,
        answer: &Result<Admission, BackendUnavailable>,
    ) {
        let Some(tx) = flight else { return };
        tx.send_replace(Some(match answer {
            Ok(a) => Heard::Answer(*a),
            Err(e) => Heard::Failed(e.to_string().into()),
        }));
        let mut flight = lock(&inner.flight);
        if flight
            .as_ref()
            .is_some_and(|f| f.answer.same_channel(&tx.subscribe()))
        {
            *flight = None;
        }
    }

    /// What one admission's answer, to a question sent at `sent`, teaches this
    /// process's view, and the admission it is.
    fn heard(inner: &Inner, sent: Instant, opens: u64, reply: AdmitReply) -> Admission {
        // Redis answers: records are waited for again.
        inner.records.fetch_and(!1, Ordering::AcqRel);
        let (admitted, epoch, probe, retry_ms, open) = reply;
        if admitted == 1 {
            let (epoch, probe) = (non_negative(epoch), non_negative(probe));
            if probe == 0 {
                inner.saw_closed(sent, epoch, opens);
            }
            Admission::Admitted(Ticket::new(epoch, probe))
        } else {
            let retry_after = Duration::from_millis(non_negative(retry_ms));
            let mut known = lock(&inner.known);
            *known = if open == 1 {
                let until = saturating_after(sent, retry_after);
                Known::Open(match *known {
                    Known::Open(k) => k.max(until),
                    _ => until,
                })
            } else if inner.closed_view.is_zero() || retry_after.is_zero() {
                Known::Nothing
            } else {
                match *known {
                    // Never over a newer fact: an open seen meanwhile stands.
                    k @ Known::Open(u) if u > sent => k,
                    _ => Known::ProbeOut(saturating_after(sent, retry_after.min(inner.closed_view))),
                }
            };
            Admission::Refused { retry_after }
        }
    }

    async fn record_once(inner: &Inner, seq: u64, ticket: Ticket, verdict: BreakerVerdict, oks: u32) {
        let sent = Instant::now();
        let opens = inner.opens.load(Ordering::Acquire);
        let mut conn = inner.conn.clone();
        let p = &inner.params;
        let mut call = RECORD.prepare_invoke();
        call.key(&inner.key)
            .arg(ticket.epoch())
            .arg(ticket.probe())
            .arg(verdict_code(verdict))
            .arg(p.threshold)
            .arg(p.min_calls)
            .arg(p.fail_rate)
            .arg(p.half_window)
            .arg(p.cooldown)
            .arg(p.max_cooldown)
            .arg(p.key_ttl)
            .arg(oks);
        match run("record", inner.timeout, call.invoke_async::<i64>(&mut conn)).await {
            Ok(code) => {
                inner.record_ended(seq, true);
                let effect = Effect::from_code(code);
                if ticket.is_probe() {
                    // This process's probe is over (closed, reopened, or released
                    // without a verdict): the next admission asks, and learns what
                    // it left.
                    inner.probe_ended();
                }
                if matches!(effect, Effect::Opened | Effect::Stale) {
                    // Opened by this process, or by another since this ticket (its epoch
                    // is over): the next admission asks, and learns until when.
                    let mut known = lock(&inner.known);
                    inner.opens.fetch_add(1, Ordering::AcqRel);
                    *known = Known::Nothing;
                } else if effect == Effect::Counted && !ticket.is_probe() {
                    // Counted by the closed breaker of the ticket's epoch: closed as of
                    // this record, a view as good as an admission's.
                    inner.saw_closed(sent, ticket.epoch(), opens);
                }
                tracing::trace!(source = %inner.source, effect = ?effect, "breaker record");
            }
            Err(e) => {
                inner.record_ended(seq, false);
                inner.record_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    source = %inner.source,
                    error = %e,
                    deferred_successes = oks,
                    "breaker outcome not recorded"
                );
            }
        }
    }
}

impl Gate for RedisGate {
    type Admit = BoxFuture<Result<Admission, BoxError>>;
    type Record = RecordFuture;

    fn admit(&self) -> Self::Admit {
        let sent = Instant::now();
        let opens = self.0.opens.load(Ordering::Acquire);
        let known = *lock(&self.0.known);
        match known {
            Known::Open(until) | Known::ProbeOut(until) if sent < until => {
                return Box::pin(std::future::ready(Ok(Admission::Refused {
                    retry_after: until - sent,
                })));
            }
            Known::Closed(until, epoch) if sent < until => {
                return Box::pin(std::future::ready(Ok(Admission::Admitted(Ticket::new(epoch, 0)))));
            }
            _ => {}
        }
        let inner = self.0.clone();
        if inner.closed_view.is_zero() {
            // No view: every admission asks.
            return Self::ask(inner, sent, opens, None);
        }
        let mut flight = lock(&inner.flight);
        if let Some(f) = flight.as_ref()
            && f.opens == opens
            && f.answer.has_changed().is_ok()
        {
            // A question is in flight, sent since this process's last open: its
            // answer is this admission's too (a round of waiting calls asked one
            // gate as many times as there were calls, all at once: P6's Redis mode,
            // 1.7 breaker admissions per attempt on the tight source).
            let mut answer = f.answer.clone();
            drop(flight);
            return Box::pin(async move {
                // The question runs in a task of its own, bounded by the backend's
                // timeout; this bound only guards against a runtime that stopped it.
                let got =
                    tokio::time::timeout(inner.timeout.saturating_mul(2), answer.wait_for(Option::is_some))
                        .await
                        .ok()
                        .and_then(|r| r.ok().and_then(|a| a.clone()));
                match got {
                    Some(Heard::Answer(a @ Admission::Refused { .. })) => Ok(a),
                    Some(Heard::Answer(a @ Admission::Admitted(t))) if !t.is_probe() => Ok(a),
                    // The backend did not answer the question: nor would it this one
                    // now (asking again doubled a caller's wait in an outage).
                    Some(Heard::Failed(cause)) => {
                        Err(BackendUnavailable::new("redis", "admit", cause.to_string()).into())
                    }
                    // The probe is the asker's alone; a question the runtime dropped
                    // answers nothing: ask.
                    _ => {
                        let opens = inner.opens.load(Ordering::Acquire);
                        Self::ask(inner, Instant::now(), opens, None).await
                    }
                }
            });
        }
        let (tx, rx) = watch::channel(None);
        *flight = Some(Flight { opens, answer: rx });
        drop(flight);
        Self::ask(inner, sent, opens, Some(tx))
    }

    fn record(&self, ticket: Ticket, verdict: BreakerVerdict) -> RecordFuture {
        let Some(oks) = self.0.successes_to_send(ticket, verdict) else {
            // Counted here; sent with a later record.
            return RecordFuture(None);
        };
        let inner = self.0.clone();
        // While records fail (Redis down or not answering), the caller is not held for
        // this one: each would wait out the backend's timeout with its answer in hand.
        // The record still goes out; a newer one that lands, or an admission Redis
        // answers, makes callers wait again, so a caller's next admission sees its
        // outcome.
        let failing = records_failing(inner.records.load(Ordering::Acquire));
        let seq = inner.record_seq.fetch_add(1, Ordering::Relaxed) + 1;
        // Spawned, so the record lands even when the caller drops the future (B3).
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let landing = rt.spawn(async move {
                    Self::record_once(&inner, seq, ticket, verdict, oks).await;
                });
                RecordFuture((!failing).then_some(landing))
            }
            Err(_) => {
                inner.record_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(source = %inner.source, "breaker outcome not recorded: no tokio runtime");
                RecordFuture(None)
            }
        }
    }

    fn view(&self) -> BoxFuture<Result<BreakerView, BoxError>> {
        let inner = self.0.clone();
        Box::pin(async move {
            let mut conn = inner.conn.clone();
            let mut call = VIEW.prepare_invoke();
            call.key(&inner.key);
            let v: Vec<i64> = run("view", inner.timeout, call.invoke_async(&mut conn)).await?;
            if v.len() != 14 {
                return Err(format!("breaker view script answered {} fields, expected 14", v.len()).into());
            }
            let n = |i: usize| non_negative(v[i]);
            let c = |i: usize| u32::try_from(n(i)).unwrap_or(u32::MAX);
            let state = GateState {
                open: n(1) == 1,
                epoch: n(2),
                open_until: n(3),
                probe_id: n(4),
                probe_until: n(5),
                failures: c(6),
                win_id: n(7),
                a: [c(8), c(10)],
                f: [c(9), c(11)],
                streak: c(12),
                closed_since: n(13),
            };
            let mut view = state.view(n(0), &inner.params);
            view.record_errors = inner.record_errors.load(Ordering::Relaxed);
            Ok(view)
        })
    }

    fn record_errors(&self) -> u64 {
        self.0.record_errors.load(Ordering::Relaxed)
    }
}

/// The record state word after record `seq` ended (`None`: unchanged, a newer one
/// ended first): its number shifted left, the low bit set when it failed.
fn record_state(word: u64, seq: u64, landed: bool) -> Option<u64> {
    (seq >= word >> 1).then_some(seq << 1 | u64::from(!landed))
}

/// Whether the newest record that ended failed.
const fn records_failing(word: u64) -> bool {
    word & 1 == 1
}

/// Waits for a spawned record to land. Dropping it does not cancel the record.
#[derive(Debug)]
pub struct RecordFuture(Option<JoinHandle<()>>);

impl Future for RecordFuture {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match &mut self.0 {
            Some(h) => Pin::new(h).poll(cx).map(|_| ()),
            None => Poll::Ready(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{record_state, records_failing};

    /// The newest record sent that ended says how records go: an older one ending
    /// after it (a timeout sent before it) changes nothing. Before, whichever ended
    /// last said it, and a late timeout left callers unheld after Redis came back.
    #[test]
    fn the_newest_record_that_ended_says_how_records_go() {
        let mut w = 0;
        let mut end = |seq, landed| {
            if let Some(next) = record_state(w, seq, landed) {
                w = next;
            }
            records_failing(w)
        };
        assert!(end(1, false), "failed");
        assert!(!end(3, true), "a newer one landed");
        assert!(!end(2, false), "an older timeout ending late says nothing");
        assert!(end(4, false));
    }
}
