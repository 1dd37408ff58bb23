//! The memory backend: the same contract as Redis, for one process, on the tokio clock.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use pgw_core::{BackendUnavailable, QuotaExceeded};
use tokio::time::Instant;

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

/// The state of one scope. Times are nanoseconds since the backend's creation.
#[derive(Debug, Default)]
struct Cell(Mutex<ScopeState>);

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
        let mut a = lock(&self.first.cell.0);
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
                let mut b = lock(&second.cell.0);
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
            let mut st = lock(&scope.cell.0);
            if st.window == s.window {
                st.requests = st.requests.saturating_add_signed(s.requests);
                st.tokens = st.tokens.saturating_add_signed(s.tokens);
            }
            if let Some(id) = s.lease {
                st.leases.retain(|&(l, _)| l != id);
            }
        }
    }

    /// `true` when every scope with a concurrency limit still held the lease (as the
    /// Lua script answers).
    fn renew_now(&self, id: LeaseId) -> bool {
        let now = self.since_base(Instant::now());
        let exp = now.saturating_add(self.lease_ttl_ns);
        self.scopes()
            .filter(|s| s.quota.concurrency.is_some())
            .map(|scope| {
                let mut st = lock(&scope.cell.0);
                let found = st.leases.iter_mut().find(|(l, _)| *l == id);
                found.map(|(_, e)| *e = exp).is_some()
            })
            .fold(true, |all, renewed| all & renewed)
    }

    fn hold_now(&self, which: HoldScope, d: Duration) -> Duration {
        let until = self.since_base(Instant::now()).saturating_add(nanos(d));
        for scope in self.scopes() {
            if scope.spec.held_by(which, self.has_account) {
                let mut st = lock(&scope.cell.0);
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
            let st = lock(&scope.cell.0);
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
