//! The memory backend: the same contract as Redis, for one process, on the tokio clock.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use pgw_core::sync::lock;
use pgw_core::{BackendUnavailable, QuotaExceeded};
use tokio::time::{Instant, Sleep};

use super::sliding::Count;
use super::window::{Guard, Window};
use super::{
    BackendFuture, Clock, Gate, Held, HoldScope, LeaseId, ScopeHeld, ScopeKind, ScopeSpec, Settle, Verdict,
    nanos,
};
use crate::config::{self, Quota, RateLimitConfig};

/// Limiter state in this process's memory.
///
/// Clone it and give the clones to every limiter that must share scopes (sources of one
/// account share the account's quota only when they share one `MemoryBackend`).
/// Instants are on the tokio clock, counted from the backend's creation (tests run
/// under a paused clock); every span of one window's length holds at most the quota
/// (counted per sub-window, as on Redis: see
/// [`RateLimitConfig::sub_windows`](crate::RateLimitConfig::sub_windows)).
#[derive(Clone)]
pub struct MemoryBackend {
    inner: Arc<Shared>,
}

struct Shared {
    base: Instant,
    scopes: Mutex<HashMap<Arc<str>, Arc<Cell>>>,
}

impl fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("scopes", &lock(&self.inner.scopes).len())
            .finish()
    }
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// One scope: its state (times are nanoseconds since the backend's creation) and the
/// queue of admissions waiting for it ([`Mode::Wait`](crate::Mode::Wait)).
///
/// The hold's end is one atomic word: holds take no lock. A scope with a requests or
/// tokens quota admits through its sliding window's atomic words ([`Window`]), locking
/// the window only once per sub-window or when they do not decide; one with a
/// concurrency quota locks its lease list. A scope that limits neither takes no lock.
#[derive(Debug, Default)]
struct Cell {
    window: Window,
    /// The hold's end (ns since base) shifted left by one, its low bit set when it was
    /// placed after an overloaded provider's pushback: one word, so the longest hold
    /// and its reason move together (`fetch_max`). Read through [`Cell::hold`].
    hold: AtomicU64,
    /// Live leases and their expiry. Few: at most the concurrency limit.
    leases: Mutex<Vec<(LeaseId, u64)>>,
    queue: Mutex<Queue>,
    /// How many wait in `queue`: read without its lock, so a release with nobody
    /// waiting costs one load.
    queued: AtomicUsize,
}

/// The live leases of `leases`, after dropping the expired ones.
#[inline]
fn live_leases(leases: &mut Vec<(LeaseId, u64)>, now: u64) -> u64 {
    leases.retain(|&(_, exp)| exp > now);
    leases.len() as u64
}

/// Waiting admissions of one scope, first come first served.
#[derive(Debug, Default)]
struct Queue {
    next_id: u64,
    waiters: VecDeque<Place>,
}

/// One waiting admission's place in a [`Queue`].
#[derive(Debug)]
struct Place {
    id: u64,
    waker: Option<Waker>,
    /// Woken to try again (a slot freed, or the one before it was admitted and saw
    /// room left); cleared when it tries.
    woken: bool,
}

impl Cell {
    /// The hold's end (ns since base, 0: none) and whether it was placed after an
    /// overloaded provider's pushback.
    #[inline]
    fn hold(&self) -> (u64, bool) {
        let v = self.hold.load(Ordering::Acquire);
        (v >> 1, v & 1 == 1)
    }

    /// Wakes the first waiter not woken yet, to try again: one per freed slot.
    fn wake_one(&self) {
        if self.queued.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut q = lock(&self.queue);
        if let Some(p) = q.waiters.iter_mut().find(|p| !p.woken) {
            p.woken = true;
            if let Some(w) = p.waker.take() {
                w.wake();
            }
        }
    }
}

/// A waiting admission's place in the queue of the scope that refused it.
///
/// Only the first in the queue keeps a timer (for what only the clock frees: a window's
/// end, a hold's end, a lease's TTL); the others sleep until a freed slot or the one
/// before them wakes them. Dropping it gives up the place: a wake-up it received and
/// did not use goes to the next in line, and a new first in line is woken to start
/// its timer.
pub(crate) struct Waiter {
    cell: Arc<Cell>,
    scope: usize,
    id: u64,
    timer: Option<Pin<Box<Sleep>>>,
}

impl fmt::Debug for Waiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Waiter")
            .field("scope", &self.scope)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut q = lock(&self.cell.queue);
        let Some(pos) = q.waiters.iter().position(|p| p.id == self.id) else {
            return;
        };
        let gone = q.waiters.remove(pos).expect("position is in the queue");
        self.cell.queued.store(q.waiters.len(), Ordering::Release);
        let next = if gone.woken {
            // Its wake-up is the next one's.
            let next = q.waiters.iter_mut().find(|p| !p.woken);
            if let Some(p) = next {
                p.woken = true;
                Some(p)
            } else {
                None
            }
        } else if pos == 0 {
            // A new first in line: it starts its timer (no retry unless it is due).
            q.waiters.front_mut()
        } else {
            None
        };
        if let Some(w) = next.and_then(|p| p.waker.take()) {
            w.wake();
        }
    }
}

impl MemoryBackend {
    /// A new, empty backend; its clock starts now.
    #[must_use]
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Shared {
                base: Instant::now(),
                scopes: Mutex::new(HashMap::new()),
            }),
        }
    }

    pub(crate) fn bind(&self, scopes: Vec<ScopeSpec>, config: &RateLimitConfig) -> MemoryGate {
        let mut map = lock(&self.inner.scopes);
        let mut cells = scopes.into_iter().map(|spec| Scope {
            cell: map.entry(spec.label.clone()).or_default().clone(),
            quota: spec.quota,
            counts: spec.quota.requests.is_some() || spec.quota.tokens.is_some(),
            spec,
        });
        let first = cells.next().expect("a limiter has at least its source scope");
        let second = cells.next();
        drop(map);
        let limits = std::iter::once(&first)
            .chain(second.as_ref())
            .flat_map(|s| {
                let q = &s.quota;
                let limit = |count, limit: Option<u64>| {
                    limit.map(|limit| Limit {
                        cell: s.cell.clone(),
                        count,
                        limit,
                    })
                };
                limit(Count::Requests, q.requests)
                    .into_iter()
                    .chain(limit(Count::Tokens, q.tokens))
            })
            .collect::<Box<[Limit]>>();
        assert!(limits.len() <= MAX_LIMITS, "two scopes, two counts each");
        let window_ms = config::window_ms(config.window);
        let sub_ms = config::sub_window_ms(window_ms, config.sub_windows);
        MemoryGate {
            base: self.inner.base,
            base_ns: pgw_core::clock::nanos(self.inner.base),
            first,
            second,
            limits,
            has_account: config.account.is_some(),
            sub_ns: sub_ms.saturating_mul(1_000_000),
            subs: window_ms / sub_ms,
            sub_hint: AtomicU64::new(0),
            lease_ttl_ns: nanos(config.lease_ttl),
            slot_hint: config.slot_retry_after,
        }
    }
}

/// One scope of a [`MemoryGate`]: its quota (copied out of the spec, read on every
/// admission) and its shared state.
struct Scope {
    quota: Quota,
    /// Whether the scope limits requests or tokens: only then is its window used.
    counts: bool,
    cell: Arc<Cell>,
    spec: ScopeSpec,
}

/// One count a gate limits in one of its scopes, flattened at bind time: the fast
/// path walks these (at most four: requests and tokens, source and account).
struct Limit {
    cell: Arc<Cell>,
    count: Count,
    limit: u64,
}

impl Limit {
    /// How much one admission of `tokens` takes of this count.
    #[inline]
    const fn amount(&self, tokens: u64) -> u64 {
        match self.count {
            Count::Requests => 1,
            Count::Tokens => tokens,
        }
    }
}

/// The most counts one gate limits.
const MAX_LIMITS: usize = 4;

/// One limiter's scopes in a [`MemoryBackend`].
///
/// The hot path: one clock read, no division while the
/// sub-window lasts, one compare-and-swap per limited count of a scope (its window's
/// word; the window's lock once per sub-window), one lock for the lease list of a
/// scope with a concurrency quota, no allocation, and no reference count.
pub(crate) struct MemoryGate {
    base: Instant,
    /// `base` in `pgw_core::clock::nanos`: times are nanoseconds since it.
    base_ns: u64,
    /// The account when there is one, else the source: the lock order, the same for
    /// every limiter.
    first: Scope,
    /// The source, when `first` is its account.
    second: Option<Scope>,
    /// The counts limited, in the lock order of their scopes.
    limits: Box<[Limit]>,
    has_account: bool,
    /// The sub-window's length and how many make a window (`subs * sub_ns` is the
    /// window).
    sub_ns: u64,
    subs: u64,
    /// The last sub-window id computed: a hint, checked against the clock on every use.
    sub_hint: AtomicU64,
    lease_ttl_ns: u64,
    slot_hint: Duration,
}

impl fmt::Debug for MemoryGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryGate")
            .field(
                "scopes",
                &self.scopes().map(|s| &s.spec.label).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

/// The period of length `len` holding `now`: `hint` when it still does (a multiply and
/// a compare), else a division (and the hint updated).
#[inline]
fn period_of(hint: &AtomicU64, len: u64, now: u64) -> u64 {
    let h = hint.load(Ordering::Relaxed);
    if now.wrapping_sub(h.wrapping_mul(len)) < len {
        return h;
    }
    let id = now / len;
    hint.store(id, Ordering::Relaxed);
    id
}

impl MemoryGate {
    #[inline]
    fn scopes(&self) -> impl Iterator<Item = &Scope> {
        std::iter::once(&self.first).chain(self.second.as_ref())
    }

    /// The tokio instant of `at` (on this gate's clock).
    pub(crate) fn local(&self, at: u64) -> Instant {
        self.base + Duration::from_nanos(at)
    }

    #[inline]
    fn since_base(&self, t: Instant) -> u64 {
        pgw_core::clock::nanos(t).saturating_sub(self.base_ns)
    }

    /// The oldest sub-window still live in sub-window `sub`: the `subs + 1` from it to
    /// `sub` cover the whole span of one window ending now.
    #[inline]
    const fn oldest(&self, sub: u64) -> u64 {
        sub.saturating_sub(self.subs)
    }

    /// When what sub-window `id` holds leaves every span ending from then on (ns
    /// since base).
    #[inline]
    const fn leaves_at(&self, id: u64) -> u64 {
        id.saturating_add(self.subs)
            .saturating_add(1)
            .saturating_mul(self.sub_ns)
    }

    /// Checks and reserves every dimension of every scope, all or nothing.
    ///
    /// The fast path reads the clock and takes each count through its window's atomic
    /// word ([`Window::take`]); leases then go into the lease lists of scopes with a
    /// concurrency quota, and what was taken is given back when a scope has no slot.
    /// When a word does not decide (a new sub-window, no room by it, a huge count),
    /// [`admit_locked`](Self::admit_locked) decides.
    #[inline]
    pub(crate) fn admit_now(&self, tokens: u64, lease: Option<LeaseId>) -> Verdict {
        // Under a balancer, the instant of its dispatch (this admission runs inside that
        // poll): no second clock read. An admission the words cannot decide reads the
        // clock itself, after locking (`admit_locked`).
        let now = pgw_core::clock::now_nanos().saturating_sub(self.base_ns);
        let sub = period_of(&self.sub_hint, self.sub_ns, now);
        if self.held_at(now) {
            return self.refusal(now, sub, tokens, (0, "hold"));
        }
        let mut generations = [0u64; MAX_LIMITS];
        for (k, (l, g)) in self.limits.iter().zip(&mut generations).enumerate() {
            match l.cell.window.take(l.count, sub, l.amount(tokens), l.limit) {
                Some(taken) => *g = taken,
                None => {
                    self.put_back(&generations[..k], sub, tokens);
                    return self.admit_locked(tokens, lease);
                }
            }
        }
        if let Some(id) = lease
            && let Err(i) = self.take_lease(id, now)
        {
            self.put_back(&generations, sub, tokens);
            return self.refusal(now, sub, tokens, (i, "concurrency"));
        }
        Verdict::Admitted { at: now }
    }

    /// Whether a hold of either scope lasts past `now`.
    #[inline]
    fn held_at(&self, now: u64) -> bool {
        let held = |s: &Scope| s.cell.hold().0 > now;
        held(&self.first) || self.second.as_ref().is_some_and(held)
    }

    /// Gives back what the fast path took: the first `generations.len()` limits.
    #[cold]
    fn put_back(&self, generations: &[u64], sub: u64, tokens: u64) {
        for (l, &g) in self.limits.iter().zip(generations) {
            l.cell.window.put_back(l.count, sub, l.amount(tokens), g);
            // What was taken back may be what a waiter waits for.
            l.cell.wake_one();
        }
    }

    /// Takes lease `id` in every scope with a concurrency quota: `Err(i)` (and nothing
    /// taken) when scope `i` has no slot.
    #[inline]
    fn take_lease(&self, id: LeaseId, now: u64) -> Result<(), usize> {
        let entry = (id, now.saturating_add(self.lease_ttl_ns));
        for (i, scope) in self.scopes().enumerate() {
            let Some(c) = scope.quota.concurrency else {
                continue;
            };
            let mut leases = lock(&scope.cell.leases);
            if live_leases(&mut leases, now) >= c {
                drop(leases);
                self.undo_lease(i, id);
                return Err(i);
            }
            leases.push(entry);
        }
        Ok(())
    }

    /// [`admit_now`](Self::admit_now) under the windows' locks (account first), where
    /// the words did not decide: once per sub-window, and for what does not fit. The
    /// windows are locked before the clock is read: the admissions of a scope count in
    /// the order they read the clock, so none counts at an instant older than a
    /// sub-window another has already rolled away. The words are published again for
    /// the sub-window of this admission.
    #[cold]
    #[inline(never)]
    fn admit_locked(&self, tokens: u64, lease: Option<LeaseId>) -> Verdict {
        let mut windows = [
            self.first.counts.then(|| self.first.cell.window.lock()),
            self.second
                .as_ref()
                .filter(|s| s.counts)
                .map(|s| s.cell.window.lock()),
        ];
        let now = self.since_base(Instant::now());
        let sub = period_of(&self.sub_hint, self.sub_ns, now);
        let verdict = self.admit_in(&mut windows, now, sub, tokens, lease);
        for w in windows.into_iter().flatten() {
            w.publish(sub);
        }
        match verdict {
            Ok(()) => Verdict::Admitted { at: now },
            Err(failed) => self.refusal(now, sub, tokens, failed),
        }
    }

    /// The locked admission: rolls the windows to `sub`, checks every count, takes the
    /// lease, and counts; the scope and dimension that did not fit otherwise.
    fn admit_in(
        &self,
        windows: &mut [Option<Guard<'_>>; 2],
        now: u64,
        sub: u64,
        tokens: u64,
        lease: Option<LeaseId>,
    ) -> Result<(), (usize, &'static str)> {
        if self.held_at(now) {
            return Err((0, "hold"));
        }
        for (i, (scope, w)) in self.scopes().zip(windows.iter_mut()).enumerate() {
            let Some(w) = w else { continue };
            w.roll(sub, self.oldest(sub));
            let w = w.counts();
            let q = &scope.quota;
            if q.requests.is_some_and(|r| w.total(Count::Requests) >= r) {
                return Err((i, "rpm"));
            }
            if q.tokens
                .is_some_and(|t| w.total(Count::Tokens).saturating_add(tokens) > t)
            {
                return Err((i, "tpm"));
            }
        }
        if let Some(id) = lease {
            self.take_lease(id, now).map_err(|i| (i, "concurrency"))?;
        }
        for (scope, w) in self.scopes().zip(windows.iter_mut()) {
            if let Some(w) = w {
                let q = &scope.quota;
                w.counts().add(
                    sub,
                    u64::from(q.requests.is_some()),
                    if q.tokens.is_some() { tokens } else { 0 },
                );
            }
        }
        Ok(())
    }
    /// Gives back the lease `id` taken in the scopes before `upto`.
    #[cold]
    fn undo_lease(&self, upto: usize, id: LeaseId) {
        for scope in self.scopes().take(upto) {
            if scope.quota.concurrency.is_some() {
                lock(&scope.cell.leases).retain(|&(l, _)| l != id);
                // What was taken back may be what a waiter waits for.
                scope.cell.wake_one();
            }
        }
    }

    /// When the counts of `scope` leave room for one more request of `tokens` (ns
    /// since base), per limited dimension that has none now: the end of life of the
    /// first sub-window whose departure makes room. Locks the scope's window.
    fn count_waits(&self, scope: &Scope, sub: u64, tokens: u64) -> [Option<(&'static str, u64)>; 2] {
        if !scope.counts {
            return [None, None];
        }
        // Left closed: the next admission publishes it again.
        let mut g = scope.cell.window.lock();
        g.roll(sub, self.oldest(sub));
        let w = g.counts();
        let q = &scope.quota;
        // Room for `need` more of `c`: what is over the limit must leave first.
        let due = |c: Count, need: u64, limit: Option<u64>| {
            let excess = w.total(c).saturating_add(need).checked_sub(limit?)?;
            (excess > 0).then(|| self.leaves_at(w.frees(c, excess).unwrap_or(sub)))
        };
        let rpm = due(Count::Requests, 1, q.requests);
        let tpm = due(Count::Tokens, tokens, q.tokens);
        [rpm.map(|d| ("rpm", d)), tpm.map(|d| ("tpm", d))]
    }

    /// Why an admission that does not fit is refused: the dimension with the longest
    /// wait; on ties the first in the order hold, rpm, tpm, concurrency, account first
    /// (as the Lua script). Read after the locks were let go; should a concurrent
    /// release have made room since, the step that did not fit (`failed`) answers.
    #[cold]
    #[inline(never)]
    fn refusal(&self, now: u64, sub: u64, tokens: u64, failed: (usize, &'static str)) -> Verdict {
        let hint = nanos(self.slot_hint);
        // The dimension, its wait, and for a hold whether an overload placed it.
        let mut worst: Option<(&Scope, &'static str, u64, bool)> = None;
        for scope in self.scopes() {
            let mut refuse = |dim: &'static str, wait: u64, after_overload: bool| {
                if worst.is_none_or(|(_, _, w, _)| wait > w) {
                    worst = Some((scope, dim, wait, after_overload));
                }
            };
            let cell = &scope.cell;
            let (hold, after_overload) = cell.hold();
            if hold > now {
                refuse("hold", hold - now, after_overload);
            }
            for (dim, due) in self.count_waits(scope, sub, tokens).into_iter().flatten() {
                refuse(dim, due.saturating_sub(now), false);
            }
            if let Some(c) = scope.quota.concurrency {
                let mut leases = lock(&cell.leases);
                if live_leases(&mut leases, now) >= c {
                    let first = leases.iter().map(|&(_, e)| e - now).min();
                    refuse("concurrency", first.map_or(hint, |f| f.min(hint)), false);
                }
            }
        }
        let (scope, dim, wait, after_overload) = worst.unwrap_or_else(|| {
            let wait = match failed.1 {
                "concurrency" => hint,
                // Room was made since: one sub-window, the finest a count frees by.
                _ => self.sub_ns,
            };
            (self.scope_at(failed.0), failed.1, wait, false)
        });
        let q = QuotaExceeded::new(dim, Duration::from_nanos(wait)).with_scope(&*scope.spec.label);
        Verdict::Refused(Box::new(if after_overload { q.after_overload() } else { q }))
    }

    /// Reconciles one admission: what it reserved and did not use goes back to its
    /// sub-window (if still live); what it used beyond is charged where the settle
    /// lands, the current sub-window, so it counts in every span from now on.
    fn settle_now(&self, s: Settle) {
        let at_sub = nanos(s.at) / self.sub_ns;
        for scope in self.scopes() {
            let (q, cell) = (&scope.quota, &scope.cell);
            let mut freed = false;
            let dr = if q.requests.is_some() { s.requests } else { 0 };
            let dt = if q.tokens.is_some() { s.tokens } else { 0 };
            if dr != 0 || dt != 0 {
                let back = |d: i64| if d < 0 { d.unsigned_abs() } else { 0 };
                let charge = |d: i64| u64::try_from(d).unwrap_or(0);
                let mut w = cell.window.lock();
                freed |= w.counts().give_back(at_sub, back(dr), back(dt));
                if dr > 0 || dt > 0 {
                    let sub = self.since_base(Instant::now()) / self.sub_ns;
                    w.roll(sub, self.oldest(sub));
                    w.counts().add(sub, charge(dr), charge(dt));
                }
                // Published again (for the sub-window it was, or the one a charge
                // rolled it to), so the next admissions keep the fast path.
                w.publish(0);
            }
            if let Some(id) = s.lease
                && q.concurrency.is_some()
            {
                let mut leases = lock(&cell.leases);
                let before = leases.len();
                leases.retain(|&(l, _)| l != id);
                freed |= leases.len() < before;
            }
            if freed {
                cell.wake_one();
            }
        }
    }

    /// The scope named `label` (`source:NAME` / `account:NAME`), else the source.
    fn scope_index(&self, label: Option<&str>) -> usize {
        self.scopes()
            .position(|s| Some(&*s.spec.label) == label)
            .unwrap_or(usize::from(self.second.is_some()))
    }

    fn scope_at(&self, i: usize) -> &Scope {
        self.scopes().nth(i).expect("a scope index of this gate")
    }

    /// A place at the back of the queue of the scope named `label` (the one that
    /// refused), or the same place when `prev` already is in that queue.
    pub(crate) fn enqueue(&self, label: Option<&str>, prev: Option<Waiter>) -> Waiter {
        let scope = self.scope_index(label);
        if let Some(mut w) = prev
            && w.scope == scope
        {
            // Keeps its place; its timer is recomputed on the next poll.
            w.timer = None;
            return w;
        }
        let cell = self.scope_at(scope).cell.clone();
        let mut q = lock(&cell.queue);
        let id = q.next_id;
        q.next_id += 1;
        q.waiters.push_back(Place {
            id,
            waker: None,
            woken: false,
        });
        cell.queued.store(q.waiters.len(), Ordering::Release);
        drop(q);
        Waiter {
            cell,
            scope,
            id,
            timer: None,
        }
    }

    /// The first scope with admissions waiting: a newcomer that waits queues behind
    /// them (first come first served) instead of taking a slot they wait for.
    pub(crate) fn queue_ahead(&self) -> Option<Waiter> {
        let i = self
            .scopes()
            .position(|s| s.cell.queued.load(Ordering::Acquire) > 0)?;
        let label = self.scope_at(i).spec.label.clone();
        Some(self.enqueue(Some(&label), None))
    }

    /// Ready when `w` should try again: woken (a slot freed for it), or first in line
    /// and its scope's clock-bound refusal (window, hold, lease TTL) is over.
    pub(crate) fn poll_wait(&self, w: &mut Waiter, tokens: u64, cx: &mut Context<'_>) -> Poll<()> {
        let mut q = lock(&w.cell.queue);
        let pos = q
            .waiters
            .iter()
            .position(|p| p.id == w.id)
            .expect("a waiter is in its queue until dropped");
        let place = &mut q.waiters[pos];
        if place.woken {
            place.woken = false;
            return Poll::Ready(());
        }
        if !place.waker.as_ref().is_some_and(|k| k.will_wake(cx.waker())) {
            place.waker = Some(cx.waker().clone());
        }
        drop(q);
        if pos != 0 {
            w.timer = None;
            return Poll::Pending;
        }
        if w.timer.is_none() {
            let now = self.since_base(Instant::now());
            let due = self.free_at(self.scope_at(w.scope), now, tokens);
            if due <= now {
                return Poll::Ready(());
            }
            let at = self.base + Duration::from_nanos(due);
            w.timer = Some(Box::pin(tokio::time::sleep_until(at)));
        }
        let timer = w.timer.as_mut().expect("armed above");
        if timer.as_mut().poll(cx).is_ready() {
            w.timer = None;
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// `w` was admitted: it leaves the queue, and wakes the next in line when its scope
    /// still has room (a window that rolled over, a hold that ended, frees many slots at
    /// once: each admitted waiter hands on to the next while room is left).
    pub(crate) fn admitted(&self, w: Waiter) {
        let scope = self.scope_at(w.scope);
        let now = self.since_base(Instant::now());
        let room = self.free_at(scope, now, 0) <= now;
        let cell = w.cell.clone();
        drop(w);
        if room {
            cell.wake_one();
        }
    }

    /// When `scope` could next admit `tokens` by the clock alone (ns since base): now
    /// when it fits, else the latest of the hold's end, the departure of the
    /// sub-window that makes room for requests or tokens, and the first lease expiry
    /// (slots full).
    fn free_at(&self, scope: &Scope, now: u64, tokens: u64) -> u64 {
        let cell = &scope.cell;
        let mut due = now.max(cell.hold().0);
        let sub = now / self.sub_ns;
        for (_, d) in self.count_waits(scope, sub, tokens).into_iter().flatten() {
            due = due.max(d);
        }
        if let Some(c) = scope.quota.concurrency {
            let mut leases = lock(&cell.leases);
            if live_leases(&mut leases, now) >= c {
                let first = leases.iter().map(|&(_, e)| e).min().unwrap_or(now);
                due = due.max(first);
            }
        }
        due
    }

    /// `true` when every scope with a concurrency limit still held the lease (as the
    /// Lua script answers).
    fn renew_now(&self, id: LeaseId) -> bool {
        let now = self.since_base(Instant::now());
        let exp = now.saturating_add(self.lease_ttl_ns);
        self.scopes()
            .filter(|s| s.quota.concurrency.is_some())
            .map(|scope| {
                let mut leases = lock(&scope.cell.leases);
                let found = leases.iter_mut().find(|(l, _)| *l == id);
                found.map(|(_, e)| *e = exp).is_some()
            })
            .fold(true, |all, renewed| all & renewed)
    }

    fn hold_now(&self, which: HoldScope, d: Duration, overloaded: bool) -> Duration {
        // At most 2^63 ns (292 years) from the base: the end fits the shifted word.
        let until = self
            .since_base(Instant::now())
            .saturating_add(nanos(d))
            .min(u64::MAX >> 1);
        let word = (until << 1) | u64::from(overloaded);
        // The end of the longest hold of these scopes now (a longer one stays).
        let mut end = until;
        for scope in self.scopes() {
            if scope.spec.held_by(which, self.has_account) {
                let before = scope.cell.hold.fetch_max(word, Ordering::AcqRel);
                end = end.max(before >> 1);
            }
        }
        Duration::from_nanos(end)
    }

    /// What the scopes hold now. Reads only: expired leases are left for the next
    /// admission to purge, as the Lua script leaves them.
    fn held_now(&self) -> Held {
        let now = self.since_base(Instant::now());
        let mut source = None;
        let mut account = None;
        for scope in self.scopes() {
            let leases = lock(&scope.cell.leases);
            let live = leases.iter().filter(|&&(_, exp)| exp > now);
            let (hold, _) = scope.cell.hold();
            let held = ScopeHeld {
                scope: scope.spec.label.to_string(),
                leases: live.clone().count() as u64,
                leases_expire_in: live.map(|&(_, exp)| Duration::from_nanos(exp - now)).max(),
                hold_ends_in: (hold > now).then(|| Duration::from_nanos(hold - now)),
            };
            match scope.spec.kind {
                ScopeKind::Source => source = Some(held),
                ScopeKind::Account => account = Some(held),
            }
        }
        Held {
            source: source.expect("a limiter has its source scope"),
            account,
        }
    }
}

impl Gate for MemoryGate {
    fn admit(
        &self,
        tokens: u64,
        lease: Option<LeaseId>,
    ) -> BackendFuture<Result<Verdict, BackendUnavailable>> {
        BackendFuture::ready(Ok(self.admit_now(tokens, lease)))
    }

    fn settle(&self, settle: Settle) -> BackendFuture<Result<(), BackendUnavailable>> {
        self.settle_now(settle);
        BackendFuture::ready(Ok(()))
    }

    fn renew(&self, lease: LeaseId) -> BackendFuture<Result<bool, BackendUnavailable>> {
        BackendFuture::ready(Ok(self.renew_now(lease)))
    }

    fn hold(
        &self,
        which: HoldScope,
        duration: Duration,
        overloaded: bool,
    ) -> BackendFuture<Result<Duration, BackendUnavailable>> {
        BackendFuture::ready(Ok(self.hold_now(which, duration, overloaded)))
    }

    fn held(&self) -> BackendFuture<Result<Held, BackendUnavailable>> {
        BackendFuture::ready(Ok(self.held_now()))
    }

    fn clock(&self) -> Clock {
        Clock::Tokio
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Quota, RateLimitConfig, RateLimiter};

    /// Four threads race for one window's quotas (source and account, requests, tokens
    /// and slots): exactly the quota is admitted, and what was refused left nothing
    /// reserved behind (the counts equal what was admitted).
    #[test]
    fn racing_threads_admit_exactly_the_quota() {
        let backend = MemoryBackend::new();
        let config = |s: &str| {
            RateLimitConfig::new(s, Quota::unlimited().requests(700).concurrency(6))
                .account("acct", Quota::unlimited().tokens(3000).concurrency(8))
        };
        let limiters = [
            RateLimiter::new(config("s1"), backend.clone()).unwrap(),
            RateLimiter::new(config("s2"), backend.clone()).unwrap(),
        ];
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let l = limiters[t % 2].clone();
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
                    let mut admitted = 0u64;
                    for _ in 0..5000 {
                        if let Ok(p) = rt.block_on(l.acquire(3)) {
                            admitted += 1;
                            drop(p);
                        }
                    }
                    admitted
                })
            })
            .collect();
        let admitted: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        // The account's 3000 tokens bind first: 1000 requests of 3 (each source's 700
        // requests would allow 1400).
        assert_eq!(admitted, 1000);
        let s: u64 = limiters.iter().map(|l| l.stats().admitted).sum();
        assert_eq!(s, 1000);
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        for l in &limiters {
            assert_eq!(rt.block_on(l.held()).unwrap().leases(), 0, "every slot released");
        }
        // The window's counts are exactly what was admitted.
        let cells = lock(&backend.inner.scopes);
        let total = |scope: &str, c| cells[scope].window.lock().counts().total(c);
        assert_eq!(total("account:acct", Count::Tokens), 3000);
        let requests = total("source:s1", Count::Requests) + total("source:s2", Count::Requests);
        assert_eq!(requests, 1000);
    }
}
