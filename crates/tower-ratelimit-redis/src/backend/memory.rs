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
///
/// Requests and tokens of the current window are one atomic word each (the window's
/// tag and the count, see [`Counter`]), the hold's end another: admission takes no
/// lock for them. Only a scope with a concurrency quota locks, for its lease list.
#[derive(Debug, Default)]
struct Cell {
    requests: Counter,
    tokens: Counter,
    hold_until: AtomicU64,
    /// Live leases and their expiry. Few: at most the concurrency limit.
    leases: Mutex<Vec<(LeaseId, u64)>>,
    queue: Mutex<Queue>,
    /// How many wait in `queue`: read without its lock, so a release with nobody
    /// waiting costs one load.
    queued: AtomicUsize,
}

/// Bits of a [`Counter`] word that count; the others tag the window.
const COUNT_BITS: u32 = 40;
/// The largest count: counts saturate there (over 10^12 requests or tokens in one
/// window of one process: a quota at least this large never refuses).
const COUNT_MAX: u64 = (1 << COUNT_BITS) - 1;
/// Window ids are tagged modulo `2^(64 - COUNT_BITS)`.
const TAG_MASK: u64 = (1 << (64 - COUNT_BITS)) - 1;

/// A count per window in one atomic word, `tag << COUNT_BITS | count`, where `tag` is
/// the window id modulo 2^24: a compare-and-swap checks the limit, rolls the window and
/// reserves at once. `window` remembers the full id of the last window started, so a
/// tag that came round again (the scope idle for 2^24 windows) reads as a new window,
/// not as the old count.
#[derive(Debug, Default)]
struct Counter {
    word: AtomicU64,
    window: AtomicU64,
}

impl Counter {
    /// The count `word` holds for window `win`, if it is that window's.
    #[inline]
    fn of(&self, word: u64, win: u64) -> Option<u64> {
        (word >> COUNT_BITS == win & TAG_MASK
            && self.window.load(Ordering::Acquire).abs_diff(win) < 1 << (63 - COUNT_BITS))
            .then_some(word & COUNT_MAX)
    }

    /// The count of window `win`.
    #[inline]
    fn get(&self, win: u64) -> u64 {
        self.of(self.word.load(Ordering::Acquire), win).unwrap_or(0)
    }

    /// Adds `n` in window `win` if the count stays within `limit` (`None`: always).
    #[inline]
    fn try_add(&self, win: u64, n: u64, limit: Option<u64>) -> bool {
        let mut word = self.word.load(Ordering::Acquire);
        loop {
            let cur = self.of(word, win);
            let next = cur.unwrap_or(0).saturating_add(n);
            if limit.is_some_and(|l| next > l) {
                return false;
            }
            if cur.is_none() && self.window.load(Ordering::Relaxed) < win {
                // Starting a window: its full id first, so a reader that sees the new
                // tag also knows it is not an old window whose tag came round again
                // (the other order would let a stale count read as current).
                self.window.fetch_max(win, Ordering::AcqRel);
            }
            let next = (win & TAG_MASK) << COUNT_BITS | next.min(COUNT_MAX);
            match self
                .word
                .compare_exchange_weak(word, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return true,
                Err(actual) => word = actual,
            }
        }
    }

    /// Applies a signed settle delta to window `win` (not below zero, past the limit if
    /// need be: a reconciliation charge), nothing once `win` is over; `true` when it
    /// gave some back.
    fn settle(&self, win: u64, delta: i64) -> bool {
        let mut word = self.word.load(Ordering::Acquire);
        loop {
            let Some(cur) = self.of(word, win) else {
                return false;
            };
            let n = delta.unsigned_abs();
            let count = if delta < 0 {
                cur.saturating_sub(n)
            } else {
                cur.saturating_add(n).min(COUNT_MAX)
            };
            let next = (win & TAG_MASK) << COUNT_BITS | count;
            match self
                .word
                .compare_exchange_weak(word, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return delta < 0,
                Err(actual) => word = actual,
            }
        }
    }
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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Never held across an await or user code; the state stays valid if a panic
    // unwound through a holder.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Nanoseconds in `d`, saturating (u64 nanoseconds last 584 years).
#[inline]
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
/// lasts, one compare-and-swap per limited count, no lock (but for the lease list of a
/// scope with a concurrency quota), no allocation and no reference count.
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
    #[inline]
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

    /// Checks and reserves every dimension of every scope, all or nothing: a
    /// compare-and-swap per limited count, in scope order (account first), the lease
    /// lists of scopes with a concurrency quota last; what does not fit undoes what was
    /// reserved before it.
    ///
    /// The undo is not atomic with the reservation: a concurrent admission that sees a
    /// count before it is undone may be refused although it would fit (never admitted
    /// beyond a quota). A single limited count (requests only, the common case) is one
    /// compare-and-swap and exact.
    #[inline]
    pub(crate) fn admit_now(&self, tokens: u64, lease: Option<LeaseId>) -> Verdict {
        let instant = Instant::now();
        let now = self.since_base(instant);
        let win = self.window_of(now);
        let admitted = Verdict::Admitted {
            at: Duration::from_nanos(now),
            window: win,
            local: Some(instant),
        };
        if self
            .scopes()
            .any(|s| s.cell.hold_until.load(Ordering::Acquire) > now)
        {
            return self.refusal(now, win, tokens, (0, "hold"));
        }
        // Steps reserved so far: 2 per scope (requests, tokens), then leases.
        let mut reserved = 0;
        for (i, scope) in self.scopes().enumerate() {
            let (q, cell) = (&scope.quota, &scope.cell);
            if let Some(r) = q.requests
                && !cell.requests.try_add(win, 1, Some(r))
            {
                self.undo(reserved, win, tokens, None);
                return self.refusal(now, win, tokens, (i, "rpm"));
            }
            reserved += 1;
            if let Some(t) = q.tokens
                && !cell.tokens.try_add(win, tokens, Some(t))
            {
                self.undo(reserved, win, tokens, None);
                return self.refusal(now, win, tokens, (i, "tpm"));
            }
            reserved += 1;
        }
        let Some(id) = lease else { return admitted };
        let entry = (id, now.saturating_add(self.lease_ttl_ns));
        for (i, scope) in self.scopes().enumerate() {
            let Some(c) = scope.quota.concurrency else {
                continue;
            };
            let mut leases = lock(&scope.cell.leases);
            if live_leases(&mut leases, now) >= c {
                drop(leases);
                self.undo(reserved, win, tokens, Some((i, id)));
                return self.refusal(now, win, tokens, (i, "concurrency"));
            }
            leases.push(entry);
        }
        admitted
    }

    /// Undoes the first `steps` count reservations (two per scope: requests, tokens)
    /// and the lease `id` in the scopes before `upto`.
    #[cold]
    fn undo(&self, steps: usize, win: u64, tokens: u64, lease: Option<(usize, LeaseId)>) {
        for (i, scope) in self.scopes().enumerate() {
            let (q, cell) = (&scope.quota, &scope.cell);
            if 2 * i < steps && q.requests.is_some() {
                cell.requests.settle(win, -1);
            }
            if 2 * i + 1 < steps && q.tokens.is_some() {
                cell.tokens
                    .settle(win, -i64::try_from(tokens).unwrap_or(i64::MAX));
            }
            if let Some((upto, id)) = lease
                && i < upto
                && q.concurrency.is_some()
            {
                lock(&cell.leases).retain(|&(l, _)| l != id);
            }
        }
        // What was taken back may be what a waiter waits for.
        for scope in self.scopes() {
            scope.cell.wake_one();
        }
    }

    /// Why an admission that does not fit is refused: the dimension with the longest
    /// wait; on ties the first in the order hold, rpm, tpm, concurrency, account first
    /// (as the Lua script). Read after the undo; should a concurrent release have made
    /// room since, the step that did not fit (`failed`) answers.
    #[cold]
    #[inline(never)]
    fn refusal(&self, now: u64, win: u64, tokens: u64, failed: (usize, &'static str)) -> Verdict {
        let to_window_end = win.saturating_add(1).saturating_mul(self.window_ns) - now;
        let hint = nanos(self.slot_hint);
        let mut worst: Option<(&Scope, &'static str, u64)> = None;
        for scope in self.scopes() {
            let mut refuse = |dim: &'static str, wait: u64| {
                if worst.is_none_or(|(_, _, w)| wait > w) {
                    worst = Some((scope, dim, wait));
                }
            };
            let (q, cell) = (&scope.quota, &scope.cell);
            let hold = cell.hold_until.load(Ordering::Acquire);
            if hold > now {
                refuse("hold", hold - now);
            }
            if q.requests.is_some_and(|r| cell.requests.get(win) >= r) {
                refuse("rpm", to_window_end);
            }
            if q.tokens
                .is_some_and(|t| cell.tokens.get(win).saturating_add(tokens) > t)
            {
                refuse("tpm", to_window_end);
            }
            if let Some(c) = q.concurrency {
                let mut leases = lock(&cell.leases);
                if live_leases(&mut leases, now) >= c {
                    let first = leases.iter().map(|&(_, e)| e - now).min();
                    refuse("concurrency", first.map_or(hint, |f| f.min(hint)));
                }
            }
        }
        let (scope, dim, wait) = worst.unwrap_or_else(|| {
            let wait = match failed.1 {
                "concurrency" => hint,
                _ => to_window_end,
            };
            (self.scope_at(failed.0), failed.1, wait)
        });
        Verdict::Refused(QuotaExceeded::new(dim, Duration::from_nanos(wait)).with_scope(&*scope.spec.label))
    }

    fn settle_now(&self, s: Settle) {
        for scope in self.scopes() {
            let (q, cell) = (&scope.quota, &scope.cell);
            let mut freed = false;
            if q.requests.is_some() && s.requests != 0 {
                freed |= cell.requests.settle(s.window, s.requests);
            }
            if q.tokens.is_some() && s.tokens != 0 {
                freed |= cell.tokens.settle(s.window, s.tokens);
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
    /// when it fits, else the latest of the hold's end, the window's end (requests or
    /// tokens full) and the first lease expiry (slots full).
    fn free_at(&self, scope: &Scope, now: u64, tokens: u64) -> u64 {
        let win = self.window_of(now);
        let (q, cell) = (&scope.quota, &scope.cell);
        let mut due = now.max(cell.hold_until.load(Ordering::Acquire));
        if q.requests.is_some_and(|r| cell.requests.get(win) >= r)
            || q.tokens
                .is_some_and(|t| cell.tokens.get(win).saturating_add(tokens) > t)
        {
            due = due.max(win.saturating_add(1).saturating_mul(self.window_ns));
        }
        if let Some(c) = q.concurrency {
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

    fn hold_now(&self, which: HoldScope, d: Duration) -> Duration {
        let until = self.since_base(Instant::now()).saturating_add(nanos(d));
        for scope in self.scopes() {
            if scope.spec.held_by(which, self.has_account) {
                scope.cell.hold_until.fetch_max(until, Ordering::AcqRel);
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
            let leases = lock(&scope.cell.leases);
            let live = leases.iter().filter(|&&(_, exp)| exp > now);
            let hold = scope.cell.hold_until.load(Ordering::Acquire);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Quota, RateLimitConfig, RateLimiter};

    #[test]
    fn a_counter_counts_per_window_and_never_below_zero() {
        let c = Counter::default();
        assert!(c.try_add(5, 1, Some(2)) && c.try_add(5, 1, Some(2)));
        assert!(!c.try_add(5, 1, Some(2)), "full");
        assert_eq!(c.get(5), 2);
        assert!(c.try_add(6, 1, Some(2)), "a new window starts at zero");
        assert_eq!((c.get(5), c.get(6)), (0, 1));
        // Settles of a closed window change nothing; refunds stop at zero; charges may
        // go past the limit.
        assert!(!c.settle(5, -1));
        assert!(c.settle(6, -5));
        assert_eq!(c.get(6), 0);
        assert!(!c.settle(6, 7));
        assert_eq!(c.get(6), 7);
        assert!(!c.try_add(6, 0, Some(6)), "overspent: not even zero fits");
        // Counts saturate instead of spilling into the tag.
        assert!(c.try_add(6, u64::MAX / 4, None));
        assert_eq!(c.get(6), COUNT_MAX);
        assert!(c.try_add(6, 1, Some(COUNT_MAX + 1)));
    }

    /// A scope idle for exactly 2^24 windows sees its tag again: the full window id
    /// tells the old count from a new window's.
    #[test]
    fn a_tag_that_came_round_again_is_a_new_window() {
        let c = Counter::default();
        assert!(c.try_add(3, 1, Some(1)));
        let later = 3 + (TAG_MASK + 1);
        assert_eq!(c.get(later), 0);
        assert!(
            c.try_add(later, 1, Some(1)),
            "not refused by the old window's count"
        );
        assert!(!c.try_add(later, 1, Some(1)));
        assert_eq!(c.get(3), 0);
    }

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
        let probe = RateLimiter::new(RateLimitConfig::new("probe", Quota::unlimited()), backend.clone());
        let p = rt.block_on(probe.unwrap().acquire(0)).unwrap();
        let win = p.admission().window();
        let cells = lock(&backend.inner.scopes);
        assert_eq!(cells["account:acct"].tokens.get(win), 3000);
        let requests = cells["source:s1"].requests.get(win) + cells["source:s2"].requests.get(win);
        assert_eq!(requests, 1000);
        drop(cells);
        drop(p);
    }
}
