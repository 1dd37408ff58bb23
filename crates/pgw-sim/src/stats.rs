//! What the provider saw and answered: the ground truth a scoreboard checks a client
//! against.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

/// Counters of one source.
///
/// "Answered" means the status line and headers were sent (for a stream: at the first
/// frame); token counts are those of the answers sent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceStats {
    /// The source's account.
    pub account: String,
    /// Requests received.
    pub received: u64,
    /// Requests being served now (waiting for their answer, or streaming).
    pub in_flight: u64,
    /// Answers sent, by HTTP status.
    pub answered: BTreeMap<u16, u64>,
    /// 429s sent for rate (the source's own gate, the account's curve and hard limits;
    /// not `insufficient_quota`).
    pub rate_limited: u64,
    /// 429s sent by a hard limit (RPM, TPM or concurrency, of the key or the account;
    /// "request too large" included).
    pub hard_limited: u64,
    /// 404s for a model the source does not serve.
    pub model_not_found: u64,
    /// 400s `context_length_exceeded`.
    pub context_length_exceeded: u64,
    /// 400s `content_policy_violation`.
    pub content_policy_violations: u64,
    /// 529s `overloaded_error`.
    pub overloaded: u64,
    /// 429s `insufficient_quota`.
    pub insufficient_quota: u64,
    /// 200s cut by the content filter (`finish_reason: "content_filter"`).
    pub content_filtered: u64,
    /// 200s with a refusal instead of content.
    pub refusals: u64,
    /// 200 streams whose only event is an error object.
    pub stream_errors: u64,
    /// Streams sent without a usage chunk.
    pub streams_without_usage: u64,
    /// Streams sent without `data: [DONE]`.
    pub streams_without_done: u64,
    /// Streams sent with one event that is not JSON.
    pub malformed_chunks: u64,
    /// Requests swallowed by the black hole.
    pub black_holed: u64,
    /// Requests the caller dropped before any answer (timeouts, cancellations).
    pub dropped_before_answer: u64,
    /// 200s with an empty completion.
    pub empty_completions: u64,
    /// JSON-mode answers whose content is not valid JSON.
    pub invalid_json: u64,
    /// Answers with a long stall between two frames.
    pub stalled: u64,
    /// Streams sent to the end (their last event delivered: `[DONE]`, unless the
    /// stream was planned without it).
    pub streams_completed: u64,
    /// Streams the caller dropped before the end (watchdog cuts, timeouts).
    pub streams_dropped: u64,
    /// Prompt tokens reported in answers sent.
    pub prompt_tokens: u64,
    /// Completion tokens reported in answers sent.
    pub completion_tokens: u64,
    /// Arrival instant of every request, in order (tokio clock).
    pub arrivals: Vec<Instant>,
}

impl SourceStats {
    /// Answers sent with `status`.
    #[must_use]
    pub fn answered_with(&self, status: u16) -> u64 {
        self.answered.get(&status).copied().unwrap_or(0)
    }

    /// Answers sent, any status.
    #[must_use]
    pub fn answered_total(&self) -> u64 {
        self.answered.values().sum()
    }

    /// The largest number of arrivals within any window of length `window` (a sliding
    /// window over the arrival log): the ground truth of an RPM invariant.
    #[must_use]
    pub fn max_arrivals_in(&self, window: Duration) -> usize {
        max_in_window(&self.arrivals, window)
    }
}

pub(crate) fn max_in_window(arrivals: &[Instant], window: Duration) -> usize {
    let mut best = 0;
    let mut lo = 0;
    for hi in 0..arrivals.len() {
        while arrivals[hi].duration_since(arrivals[lo]) >= window {
            lo += 1;
        }
        best = best.max(hi - lo + 1);
    }
    best
}

/// Counters of one account (over all its sources).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AccountStats {
    /// The account's sources.
    pub sources: Vec<String>,
    /// Requests received.
    pub received: u64,
    /// Requests being served now.
    pub in_flight: u64,
    /// The most requests ever in flight at once.
    pub peak_in_flight: u64,
    /// Answers sent, by HTTP status.
    pub answered: BTreeMap<u16, u64>,
    /// 429s sent for rate (not `insufficient_quota`).
    pub rate_limited: u64,
    /// 429s sent by a hard limit, of the key or the account.
    pub hard_limited: u64,
}

/// A snapshot of the pool's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Per source, by name.
    pub sources: BTreeMap<String, SourceStats>,
    /// Per account, by name (sources without an account have one named after them).
    pub accounts: BTreeMap<String, AccountStats>,
}

impl PoolStats {
    /// Requests in flight over the whole pool (0 after a clean run: nothing leaked).
    #[must_use]
    pub fn in_flight(&self) -> u64 {
        self.sources.values().map(|s| s.in_flight).sum()
    }

    /// Requests received over the whole pool.
    #[must_use]
    pub fn received(&self) -> u64 {
        self.sources.values().map(|s| s.received).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sliding_window_max() {
        let t = Instant::now();
        let at = |s: u64| t + Duration::from_secs(s);
        let log = [at(0), at(10), at(59), at(60), at(61), at(200)];
        assert_eq!(max_in_window(&log, Duration::from_secs(60)), 4); // 10, 59, 60, 61
        assert_eq!(max_in_window(&[], Duration::from_secs(60)), 0);
    }
}
