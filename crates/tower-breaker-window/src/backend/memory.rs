//! The memory backend: one process, `tokio::time`, a short-held lock per source.

use std::collections::HashMap;
use std::fmt;
use std::future::{Ready, ready};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use pgw_core::sync::lock;
use pgw_core::{BoxError, BreakerVerdict, SourceId};
use tokio::time::Instant;

use super::{Admission, Backend, BoxFuture, Gate};
use crate::config::BreakerConfig;
use crate::state::{BreakerView, Effect, GateState, Ms, Params, Ticket};

/// State in this process's memory. Clones share the same sources.
///
/// Time is `tokio::time`, read once per operation, so tests run under a paused clock.
#[derive(Clone)]
pub struct MemoryBackend {
    sources: Arc<Mutex<HashMap<SourceId, Arc<Shared>>>>,
    base: Instant,
}

impl fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryBackend").finish_non_exhaustive()
    }
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBackend {
    /// An empty backend.
    #[must_use]
    pub fn new() -> Self {
        Self {
            sources: Arc::default(),
            base: Instant::now(),
        }
    }
}

impl Backend for MemoryBackend {
    type Gate = MemoryGate;

    fn gate(&self, source: &SourceId, config: &BreakerConfig) -> MemoryGate {
        let state = lock(&self.sources).entry(source.clone()).or_default().clone();
        MemoryGate(Arc::new(Inner {
            state,
            params: Params::of(config),
            base_ns: pgw_core::clock::nanos(self.base),
        }))
    }
}

/// One source's state, shared by its gates.
#[derive(Default)]
struct Shared {
    state: Mutex<GateState>,
    /// `epoch << 1 | open`, written under the lock after every transition: a closed-state
    /// admission reads it without locking and without reading the clock.
    summary: AtomicU64,
    /// Fired when a probe ends ([`Gate::changes`]).
    changes: Arc<tokio::sync::Notify>,
}

struct Inner {
    state: Arc<Shared>,
    params: Params,
    /// The backend's creation, in `pgw_core::clock::nanos`.
    base_ns: u64,
}

/// One source's gate in memory.
#[derive(Clone)]
pub struct MemoryGate(Arc<Inner>);

impl fmt::Debug for MemoryGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryGate").finish_non_exhaustive()
    }
}

impl MemoryGate {
    fn now(&self) -> Ms {
        // Inside a balancer's dispatching poll, its dispatch's instant (an answer that
        // came at once is recorded at it): no second clock read, no conversion.
        pgw_core::clock::now_nanos().saturating_sub(self.0.base_ns) / 1_000_000
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        // Held for a few arithmetic operations, never across an await; a poisoned lock
        // can only come from a panic in that arithmetic and the state is still valid.
        pgw_core::sync::lock(&self.0.state.state)
    }

    fn publish(&self, g: &GateState) {
        self.0
            .state
            .summary
            .store(g.epoch << 1 | u64::from(g.open), Ordering::Release);
    }

    /// Admission, synchronously.
    #[must_use]
    pub fn admit_now(&self) -> Admission {
        let summary = self.0.state.summary.load(Ordering::Acquire);
        if summary & 1 == 0 {
            // Closed: admitted under the current epoch. Racing with an open is the same
            // as being admitted just before it; the epoch fences the record.
            return Admission::Admitted(Ticket::new(summary >> 1, 0));
        }
        let now = self.now();
        let mut g = self.lock();
        // An admission never changes `open` or `epoch`: nothing to publish.
        let answer = g.admit(now, &self.0.params);
        drop(g);
        match answer {
            Ok(ticket) => Admission::Admitted(ticket),
            Err(ms) => Admission::Refused {
                retry_after: std::time::Duration::from_millis(ms),
            },
        }
    }

    /// Record, synchronously.
    pub fn record_now(&self, ticket: Ticket, verdict: BreakerVerdict) {
        let now = self.now();
        let mut g = self.lock();
        let effect = g.record(ticket, verdict, now, &self.0.params);
        if matches!(effect, Effect::Opened | Effect::Closed) {
            // Only transitions change `open` and `epoch`; skipping the store otherwise
            // keeps the line every closed-state admission reads unwritten.
            self.publish(&g);
        }
        drop(g);
        if ticket.is_probe() {
            // The probe ended: closed, or its lease is free for the next caller.
            // Waiters ask again now rather than at their `retry_after` (up to a
            // cooldown away).
            self.0.state.changes.notify_waiters();
        }
    }

    /// The state view, synchronously.
    #[must_use]
    pub fn view_now(&self) -> BreakerView {
        let now = self.now();
        self.lock().view(now, &self.0.params)
    }
}

impl Gate for MemoryGate {
    type Admit = Ready<Result<Admission, BoxError>>;
    type Record = Ready<()>;

    fn admit(&self) -> Self::Admit {
        ready(Ok(self.admit_now()))
    }

    fn record(&self, ticket: Ticket, verdict: BreakerVerdict) -> Self::Record {
        self.record_now(ticket, verdict);
        ready(())
    }

    fn view(&self) -> BoxFuture<Result<BreakerView, BoxError>> {
        Box::pin(ready(Ok(self.view_now())))
    }

    fn record_errors(&self) -> u64 {
        0
    }

    fn changes(&self) -> Option<Arc<tokio::sync::Notify>> {
        Some(Arc::clone(&self.0.state.changes))
    }
}
