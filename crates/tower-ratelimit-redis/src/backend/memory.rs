//! The memory backend: the same contract as Redis, for one process, on the tokio clock.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use pgw_core::{BackendUnavailable, QuotaExceeded};
use tokio::time::Instant;

use super::{BackendFuture, Clock, Gate, HoldScope, LeaseId, ScopeSpec, Settle, Verdict};
use crate::config::RateLimitConfig;

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

/// The state of one scope.
#[derive(Debug, Default)]
struct Cell(Mutex<ScopeState>);

#[derive(Debug, Default)]
struct ScopeState {
    window: u64,
    requests: u64,
    tokens: u64,
    /// Live leases and their expiry (since `base`). Few: at most the concurrency limit.
    leases: Vec<(LeaseId, Duration)>,
    hold_until: Duration,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Never held across an await or user code; the state stays valid if a panic
    // unwound through a holder.
    m.lock().unwrap_or_else(PoisonError::into_inner)
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
        let cells = scopes
            .into_iter()
            .map(|spec| {
                let cell = map.entry(spec.label.clone()).or_default().clone();
                (spec, cell)
            })
            .collect();
        drop(map);
        MemoryGate {
            shared: self.inner.clone(),
            scopes: cells,
            has_account: config.account.is_some(),
            // Whole milliseconds (validated): fits u64 nanos for centuries.
            window_ns: u64::try_from(config.window.as_nanos()).unwrap_or(u64::MAX),
            lease_ttl: config.lease_ttl,
            slot_hint: config.slot_retry_after,
        }
    }
}

/// One limiter's scopes in a [`MemoryBackend`].
pub(crate) struct MemoryGate {
    shared: Arc<Shared>,
    /// Account first: the lock order, the same for every limiter.
    scopes: Vec<(ScopeSpec, Arc<Cell>)>,
    has_account: bool,
    window_ns: u64,
    lease_ttl: Duration,
    slot_hint: Duration,
}

impl fmt::Debug for MemoryGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryGate")
            .field(
                "scopes",
                &self.scopes.iter().map(|(s, _)| &s.label).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl MemoryGate {
    fn now(&self) -> Duration {
        Instant::now().saturating_duration_since(self.shared.base)
    }

    fn admit_now(&self, tokens: u64, lease: Option<LeaseId>) -> Verdict {
        let now = self.now();
        // u64 arithmetic: a u128 division costs more than the rest of the admission.
        let now_ns = u64::try_from(now.as_nanos()).unwrap_or(u64::MAX);
        let win = now_ns / self.window_ns;
        // At most two scopes (account, source), locked in that order by every limiter.
        let mut guards = [
            Some(lock(&self.scopes[0].1.0)),
            self.scopes.get(1).map(|(_, c)| lock(&c.0)),
        ];
        let mut worst: Option<(usize, &'static str, Duration)> = None;
        let mut refuse = |i: usize, dim: &'static str, wait: Duration| {
            if worst.is_none_or(|(_, _, w)| wait > w) {
                worst = Some((i, dim, wait));
            }
        };
        let to_window_end = || Duration::from_nanos((win + 1).saturating_mul(self.window_ns) - now_ns);
        for (i, ((spec, _), st)) in self.scopes.iter().zip(guards.iter_mut().flatten()).enumerate() {
            if st.window != win {
                st.window = win;
                st.requests = 0;
                st.tokens = 0;
            }
            if st.hold_until > now {
                refuse(i, "hold", st.hold_until - now);
            }
            let q = spec.quota;
            if q.requests.is_some_and(|r| st.requests >= r) {
                refuse(i, "rpm", to_window_end());
            }
            if q.tokens.is_some_and(|t| st.tokens.saturating_add(tokens) > t) {
                refuse(i, "tpm", to_window_end());
            }
            if let Some(c) = q.concurrency {
                st.leases.retain(|&(_, exp)| exp > now);
                if st.leases.len() as u64 >= c {
                    let first = st
                        .leases
                        .iter()
                        .map(|&(_, e)| e - now)
                        .min()
                        .unwrap_or(self.slot_hint);
                    refuse(i, "concurrency", first.min(self.slot_hint));
                }
            }
        }
        if let Some((i, dim, wait)) = worst {
            return Verdict::Refused(QuotaExceeded::new(dim, wait).with_scope(&*self.scopes[i].0.label));
        }
        for ((spec, _), st) in self.scopes.iter().zip(guards.iter_mut().flatten()) {
            st.requests += 1;
            st.tokens = st.tokens.saturating_add(tokens);
            if let (Some(id), Some(_)) = (lease, spec.quota.concurrency) {
                st.leases.push((id, now + self.lease_ttl));
            }
        }
        Verdict::Admitted { at: now, window: win }
    }

    fn settle_now(&self, s: Settle) {
        for (_, cell) in &self.scopes {
            let mut st = lock(&cell.0);
            if st.window == s.window {
                st.requests = st.requests.saturating_add_signed(s.requests);
                st.tokens = st.tokens.saturating_add_signed(s.tokens);
            }
            if let Some(id) = s.lease {
                st.leases.retain(|&(l, _)| l != id);
            }
        }
    }

    fn renew_now(&self, id: LeaseId) -> bool {
        let now = self.now();
        let mut renewed = false;
        for (_, cell) in &self.scopes {
            let mut st = lock(&cell.0);
            for (l, exp) in &mut st.leases {
                if *l == id {
                    *exp = now + self.lease_ttl;
                    renewed = true;
                }
            }
        }
        renewed
    }

    fn hold_now(&self, which: HoldScope, d: Duration) -> Duration {
        let until = self.now() + d;
        for (spec, cell) in &self.scopes {
            if spec.held_by(which, self.has_account) {
                let mut st = lock(&cell.0);
                st.hold_until = st.hold_until.max(until);
            }
        }
        until
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

    fn clock(&self) -> Clock {
        Clock::Tokio
    }
}
