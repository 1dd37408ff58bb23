//! Detached probes: a silent source is asked again off the caller's path
//! ([`BalanceConfig::probe_every`](crate::BalanceConfig::probe_every)).
//!
//! A source whose last attempts all timed out with nothing heard (a black hole) is
//! refused to every call, so no caller waits an attempt timeout on it; a copy of one
//! call's request goes there on a spawned task instead, at most once per
//! `probe_every`. Its answer is judged like any attempt's (health, latency, silence)
//! and then dropped: an answer, of any kind, ends the silence, and the next call may be
//! dispatched there.

use std::sync::Arc;
use std::time::Duration;

use pgw_core::{BoxError, CarriesHistory, Classify, NotAdmitted, settle};
use tokio::time::Instant;
use tower_service::Service;

use crate::future::{Awaiting, Inflight, heard_from, judge};
use crate::sources::SourceState;

/// Sends `req` to `svc` (source `state`) on a spawned task, started at `at`; the
/// caller took the source's probe turn ([`SourceState::probe_turn`]). A probe with no
/// answer within `limit` (the age at which a caller's attempt there would be cut) is
/// a timeout, and dropped: nothing below may bound it (a timeout above the balancer
/// does not reach a detached task), and a hanging probe every `probe_every` would
/// pile up as load on the source for good.
pub(crate) fn send<S, Req, C>(
    state: &Arc<SourceState>,
    at: Instant,
    limit: Duration,
    mut svc: S,
    mut req: Req,
    class: usize,
    classifier: C,
) where
    S: Service<Req> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    S::Response: Send + 'static,
    Req: CarriesHistory + Send + 'static,
    C: Classify<S::Response, BoxError> + Clone + Send + 'static,
{
    // The caller has moved on: nothing this copy meets is charged to its call.
    req.mark_probe_copy();
    state.inc(at);
    // Its inflight count, given back when it is judged or dropped (A4), and its
    // awaiting count, given back at its first answer or when dropped before it.
    let probing = Inflight(Arc::clone(state));
    let awaiting = Awaiting(Arc::clone(state));
    tokio::spawn(async move {
        let attempt = async {
            let ready = std::future::poll_fn(|cx| svc.poll_ready(cx))
                .await
                .map_err(Into::into);
            match ready {
                Ok(()) => svc.call(req).await.map_err(Into::into),
                Err(e) => Err(e),
            }
        };
        let Ok(mut result) = tokio::time::timeout(limit, attempt).await else {
            // Silent for as long as a caller's attempt may be: a timeout, one more.
            probing.0.timed_out(at, Instant::now());
            return;
        };
        drop(awaiting);
        if result
            .as_ref()
            .err()
            .is_some_and(|e| NotAdmitted::of(&**e).is_some())
        {
            // A gate below refused it: not an attempt, nothing learnt.
            return;
        }
        let outcome = (!classifier.in_progress(&result)).then(|| classifier.classify(&result));
        heard_from(&probing.0, outcome, &result, at, Instant::now());
        // A stream is judged at its end; dropping it (below) ends it unjudged, and the
        // hold goes back with the dropped judgement.
        let judging = classifier.clone();
        settle(&classifier, &mut result, move |r| {
            let outcome = outcome.unwrap_or_else(|| judging.classify(r));
            judge::<Req, _>(&probing.0, (class, None), None, false, outcome, r);
            drop(probing);
        });
    });
}
