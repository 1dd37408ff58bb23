//! The memory backend: the same contract as Redis, for one process, on the tokio clock.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use pgw_core::{BackendUnavailable, QuotaExceeded};
use tokio::time::{Instant, Sleep};

use super::{
    BackendFuture, Clock, Gate, Held, HoldScope, LeaseId, ScopeHeld, ScopeKind, ScopeSpec, Settle, Verdict,
};
use crate::config::{Quota, RateLimitConfig};

/// Limiter state in this process's memory.
///
/// Clone it and give the clones to every limiter that must share scopes (sources of one
/// account share the account's quota only when they share one `MemoryBackend`).
/// Windows are `[k * window, (k + 1) * window)` on the tokio clock, counted from the
/// backend's creation, so tests run under a paused clock.
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
#[derive(Debug, Default)]
struct Cell {
    state: Mutex<ScopeState>,
    queue: Mutex<Queue>,
    /// How many wait in `queue`: read without its lock, so a release with nobody
    /// waiting costs one load.
    queued: AtomicUsize,
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

#[derive(Debug, Default)]
struct ScopeState {
    window: u64,
    requests: u64,
    tokens: u64,
    /// Live leases and their expiry. Few: at most the concurrency limit.
    leases: Vec<(LeaseId, u64)>,
    hold_until: u64,
}

impl ScopeState {
    /// Starts the window `win` if this state still counts an earlier one.
    #[inline]
    fn roll(&mut self, win: u64) {
        if self.window != win {
            self.window = win;
            self.requests = 0;
            self.tokens = 0;
        }
    }

    /// The live leases, after dropping the expired ones.
    #[inline]
    fn live_leases(&mut self, now: u64) -> u64 {
        self.leases.retain(|&(_, exp)| exp > now);
        self.leases.len() as u64
    }

    /// Whether one more request of `tokens` fits every dimension of `q` (the state has
    /// rolled to the current window).
    #[inline]
    fn fits(&mut self, q: &Quota, now: u64, tokens: u64) -> bool {
        self.hold_until <= now
            && q.requests.is_none_or(|r| self.requests < r)
            && q.tokens.is_none_or(|t| self.tokens.saturating_add(tokens) <= t)
            && q.concurrency.is_none_or(|c| self.live_leases(now) < c)
    }

    #[inline]
    fn reserve(&mut self, q: &Quota, tokens: u64, lease: Option<(LeaseId, u64)>) {
        self.requests = self.requests.saturating_add(1);
        self.tokens = self.tokens.saturating_add(tokens);
        if let (Some(l), Some(_)) = (lease, q.concurrency) {
            self.leases.push(l);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Never held across an await or user code; the state stays valid if a panic
    // unwound through a holder.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Nanoseconds in `d`, saturating (u64 nanoseconds last 584 years).
fn nanos(d: Duration) -> u64 {
    d.as_secs()
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::from(d.subsec_nanos()))
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
            spec,
        });
        let first = cells.next().expect("a limiter has at least its source scope");
        let second = cells.next();
        drop(map);
        MemoryGate {
            base: self.inner.base,
            first,
            second,
            has_account: config.account.is_some(),
            // Whole milliseconds, at least one (validated).
            window_ns: nanos(config.window).max(1),
            win_hint: AtomicU64::new(0),
            lease_ttl_ns: nanos(config.lease_ttl),
            slot_hint: config.slot_retry_after,
        }
    }
}

/// One scope of a [`MemoryGate`]: its quota (copied out of the spec, read on every
/// admission) and its shared state.
struct Scope {
    quota: Quota,
    cell: Arc<Cell>,
    spec: ScopeSpec,
}

/// One limiter's scopes in a [`MemoryBackend`].
///
/// The hot path (DESIGN.md section 6): one clock read, no division while the window
/// lasts, one short uncontended lock per scope, no allocation and no reference count.
/// The lock stays because admission is all or nothing across every dimension of up to
/// two scopes: per-counter atomics would let a reservation that is later rolled back
/// refuse a concurrent request that fits.
pub(crate) struct MemoryGate {
    base: Instant,
    /// The account when there is one, else the source: the lock order, the same for
    /// every limiter.
    first: Scope,
    /// The source, when `first` is its account.
    second: Option<Scope>,
    has_account: bool,
    window_ns: u64,
    /// The last window id computed: a hint, checked against the clock on every use.
    win_hint: AtomicU64,
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

impl MemoryGate {
    fn scopes(&self) -> impl Iterator<Item = &Scope> {
        std::iter::once(&self.first).chain(self.second.as_ref())
    }

    #[inline]
    fn since_base(&self, t: Instant) -> u64 {
        nanos(t.saturating_duration_since(self.base))
    }

    /// The window holding `now`: the hint when it still does (a multiply and a
    /// compare), else a division.
    #[inline]
    fn window_of(&self, now: u64) -> u64 {
        let hint = self.win_hint.load(Ordering::Relaxed);
        if now.wrapping_sub(hint.wrapping_mul(self.window_ns)) < self.window_ns {
            return hint;
        }
        let win = now / self.window_ns;
        self.win_hint.store(win, Ordering::Relaxed);
        win
    }

    /// Checks and reserves every dimension of every scope, all or nothing, under the
    /// scopes' locks.
    #[inline]
    pub(crate) fn admit_now(&self, tokens: u64, lease: Option<LeaseId>) -> Verdict {
        let instant = Instant::now();
        let now = self.since_base(instant);
        let win = self.window_of(now);
        let lease = lease.map(|id| (id, now.saturating_add(self.lease_ttl_ns)));
        let mut a = lock(&self.first.cell.state);
        a.roll(win);
        let verdict = match &self.second {
            None => {
                if a.fits(&self.first.quota, now, tokens) {
                    a.reserve(&self.first.quota, tokens, lease);
                    None
                } else {
                    Some(self.refusal(&mut a, None, now, win, tokens))
                }
            }
            Some(second) => {
                let mut b = lock(&second.cell.state);
                b.roll(win);
                if a.fits(&self.first.quota, now, tokens) && b.fits(&second.quota, now, tokens) {
                    a.reserve(&self.first.quota, tokens, lease);
                    b.reserve(&second.quota, tokens, lease);
                    None
                } else {
                    Some(self.refusal(&mut a, Some(&mut b), now, win, tokens))
                }
            }
        };
        verdict.unwrap_or(Verdict::Admitted {
            at: Duration::from_nanos(now),
            window: win,
            local: Some(instant),
        })
    }

    /// Why an admission that does not fit is refused: the dimension with the longest
    /// wait; on ties the first in the order hold, rpm, tpm, concurrency, account first
    /// (as the Lua script).
    #[cold]
    #[inline(never)]
    fn refusal(
        &self,
        a: &mut ScopeState,
        b: Option<&mut ScopeState>,
        now: u64,
        win: u64,
        tokens: u64,
    ) -> Verdict {
        let to_window_end = win.saturating_add(1).saturating_mul(self.window_ns) - now;
        let hint = nanos(self.slot_hint);
        let mut worst: Option<(&Scope, &'static str, u64)> = None;
        for (scope, st) in self.scopes().zip(std::iter::once(a).chain(b)) {
            let mut refuse = |dim: &'static str, wait: u64| {
                if worst.is_none_or(|(_, _, w)| wait > w) {
                    worst = Some((scope, dim, wait));
                }
            };
            let q = scope.quota;
            if st.hold_until > now {
                refuse("hold", st.hold_until - now);
            }
            if q.requests.is_some_and(|r| st.requests >= r) {
                refuse("rpm", to_window_end);
            }
            if q.tokens.is_some_and(|t| st.tokens.saturating_add(tokens) > t) {
                refuse("tpm", to_window_end);
            }
            if let Some(c) = q.concurrency
                && st.live_leases(now) >= c
            {
                let first = st.leases.iter().map(|&(_, e)| e - now).min();
                refuse("concurrency", first.map_or(hint, |f| f.min(hint)));
            }
        }
        let (scope, dim, wait) = worst.expect("refusal() is called only when something does not fit");
        Verdict::Refused(QuotaExceeded::new(dim, Duration::from_nanos(wait)).with_scope(&*scope.spec.label))
    }

    fn settle_now(&self, s: Settle) {
        for scope in self.scopes() {
            let mut st = lock(&scope.cell.state);
            let mut freed = false;
            if st.window == s.window {
                st.requests = st.requests.saturating_add_signed(s.requests);
                st.tokens = st.tokens.saturating_add_signed(s.tokens);
                freed = s.requests < 0 || s.tokens < 0;
            }
            if let Some(id) = s.lease {
                let before = st.leases.len();
                st.leases.retain(|&(l, _)| l != id);
                freed |= st.leases.len() < before;
            }
            drop(st);
            if freed {
                scope.cell.wake_one();
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
    /// when it fits, else the latest of the hold's end, the window's end (requests or
    /// tokens full) and the first lease expiry (slots full).
    fn free_at(&self, scope: &Scope, now: u64, tokens: u64) -> u64 {
        let win = self.window_of(now);
        let mut st = lock(&scope.cell.state);
        st.roll(win);
        let q = &scope.quota;
        let mut due = now;
        if st.hold_until > now {
            due = due.max(st.hold_until);
        }
        if q.requests.is_some_and(|r| st.requests >= r)
            || q.tokens.is_some_and(|t| st.tokens.saturating_add(tokens) > t)
        {
            due = due.max(win.saturating_add(1).saturating_mul(self.window_ns));
        }
        if let Some(c) = q.concurrency
            && st.live_leases(now) >= c
        {
            let first = st.leases.iter().map(|&(_, e)| e).min().unwrap_or(now);
            due = due.max(first);
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
                let mut st = lock(&scope.cell.state);
                let found = st.leases.iter_mut().find(|(l, _)| *l == id);
                found.map(|(_, e)| *e = exp).is_some()
            })
            .fold(true, |all, renewed| all & renewed)
    }

    fn hold_now(&self, which: HoldScope, d: Duration) -> Duration {
        let until = self.since_base(Instant::now()).saturating_add(nanos(d));
        for scope in self.scopes() {
            if scope.spec.held_by(which, self.has_account) {
                let mut st = lock(&scope.cell.state);
                st.hold_until = st.hold_until.max(until);
            }
        }
        Duration::from_nanos(until)
    }

    /// What the scopes hold now. Reads only: expired leases are left for the next
    /// admission to purge, as the Lua script leaves them.
    fn held_now(&self) -> Held {
        let now = self.since_base(Instant::now());
        let mut source = None;
        let mut account = None;
        for scope in self.scopes() {
            let st = lock(&scope.cell.state);
            let live = st.leases.iter().filter(|&&(_, exp)| exp > now);
            let held = ScopeHeld {
                scope: scope.spec.label.to_string(),
                leases: live.clone().count() as u64,
                leases_expire_in: live.map(|&(_, exp)| Duration::from_nanos(exp - now)).max(),
                hold_ends_in: (st.hold_until > now).then(|| Duration::from_nanos(st.hold_until - now)),
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
    ) -> BackendFuture<Result<Duration, BackendUnavailable>> {
        BackendFuture::ready(Ok(self.hold_now(which, duration)))
    }

    fn held(&self) -> BackendFuture<Result<Held, BackendUnavailable>> {
        BackendFuture::ready(Ok(self.held_now()))
    }

    fn clock(&self) -> Clock {
        Clock::Tokio
    }
}
