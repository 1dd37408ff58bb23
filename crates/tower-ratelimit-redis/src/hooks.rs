//! The hooks the layer calls: token estimate of a request, real usage of a response,
//! and an observer of every admission.

use std::sync::Arc;

use pgw_core::openai::{ChatRequest, ChatResponse, Usage};

use crate::Admission;

/// Estimates a request's tokens before dispatch: the TPM reservation, reconciled to
/// real usage afterwards.
///
/// Closures `Fn(&Req) -> u64` implement it.
pub trait TokenEstimate<Req> {
    /// The tokens to reserve for `req`.
    fn estimate(&self, req: &Req) -> u64;
}

impl<F, Req> TokenEstimate<Req> for F
where
    F: Fn(&Req) -> u64,
{
    fn estimate(&self, req: &Req) -> u64 {
        self(req)
    }
}

/// Reads the real token usage from a response, to reconcile the reservation.
///
/// Closures `Fn(&Res) -> Option<u64>` implement it. `None` keeps the estimate charged.
///
/// A response still running when it is handed up (a stream passed through to the
/// caller) says so with [`UsageReport::in_progress`]: the layer then keeps the
/// concurrency lease (renewed) and the reservation until the response ends, and
/// settles with the usage of the final result ([`UsageReport::defer`]).
pub trait UsageReport<Res> {
    /// Tokens the call really used, if the response says.
    fn tokens_used(&self, res: &Res) -> Option<u64>;

    /// Tokens a call that failed still used, if its error says (a provider's answer
    /// refused above the provider, by a validator, was billed). The default: none, so
    /// the estimate stays charged.
    fn tokens_used_by_error(&self, err: &pgw_core::BoxError) -> Option<u64> {
        let _ = err;
        None
    }

    /// Whether `res` is still running. The default: every response is final.
    fn in_progress(&self, res: &Res) -> bool {
        let _ = res;
        false
    }

    /// Keeps `then` to be called with the final result when the running response
    /// ends (dropped unrun if it is dropped first: the lease is then released and the
    /// estimate stays charged). Called only when [`UsageReport::in_progress`] said so;
    /// the default runs `then` at once.
    fn defer(
        &self,
        result: &mut Result<Res, pgw_core::BoxError>,
        then: pgw_core::Settle<Res, pgw_core::BoxError>,
    ) {
        then(result);
    }
}

impl<F, Res> UsageReport<Res> for F
where
    F: Fn(&Res) -> Option<u64>,
{
    fn tokens_used(&self, res: &Res) -> Option<u64> {
        self(res)
    }
}

/// Sees every admission before dispatch, with its record on the limiter's clock (for
/// telemetry and scoreboards).
///
/// Closures `Fn(&Req, &Admission)` implement it.
pub trait AdmissionObserver<Req> {
    /// Called once per admission, before the inner service is called.
    fn on_admission(&self, req: &Req, admission: &Admission);
}

impl<F, Req> AdmissionObserver<Req> for F
where
    F: Fn(&Req, &Admission),
{
    fn on_admission(&self, req: &Req, admission: &Admission) {
        self(req, admission);
    }
}

/// Requests whose tokens can be estimated: chat requests and what carries them.
pub trait EstimateTokens {
    /// The estimate (for chat: prompt bytes / 3 + `max_tokens`,
    /// [`ChatRequest::estimate_tokens`]).
    fn estimate_tokens(&self) -> u64;
}

impl EstimateTokens for ChatRequest {
    fn estimate_tokens(&self) -> u64 {
        ChatRequest::estimate_tokens(self)
    }
}

impl<B: EstimateTokens> EstimateTokens for http::Request<B> {
    fn estimate_tokens(&self) -> u64 {
        self.body().estimate_tokens()
    }
}

impl<T: EstimateTokens + ?Sized> EstimateTokens for Arc<T> {
    fn estimate_tokens(&self) -> u64 {
        (**self).estimate_tokens()
    }
}

impl<T: EstimateTokens + ?Sized> EstimateTokens for Box<T> {
    fn estimate_tokens(&self) -> u64 {
        (**self).estimate_tokens()
    }
}

/// Responses that report token usage: chat answers and what carries them.
pub trait ReportsUsage {
    /// Total tokens used, if reported.
    fn tokens_used(&self) -> Option<u64>;
}

impl ReportsUsage for ChatResponse {
    fn tokens_used(&self) -> Option<u64> {
        self.usage.as_ref().and_then(Usage::charged)
    }
}

impl<B: ReportsUsage> ReportsUsage for http::Response<B> {
    fn tokens_used(&self) -> Option<u64> {
        self.body().tokens_used()
    }
}

impl<T: ReportsUsage + ?Sized> ReportsUsage for Arc<T> {
    fn tokens_used(&self) -> Option<u64> {
        (**self).tokens_used()
    }
}

impl<T: ReportsUsage + ?Sized> ReportsUsage for Box<T> {
    fn tokens_used(&self) -> Option<u64> {
        (**self).tokens_used()
    }
}

/// The default estimate: [`EstimateTokens`] on the request (chat requests: prompt
/// bytes / 3 + `max_tokens`). For other request types, give the layer a closure.
#[derive(Clone, Copy, Debug, Default)]
pub struct ChatEstimate;

impl<Req: EstimateTokens> TokenEstimate<Req> for ChatEstimate {
    fn estimate(&self, req: &Req) -> u64 {
        req.estimate_tokens()
    }
}

/// The default usage reader: [`ReportsUsage`] on the response (chat answers:
/// [`Usage::charged`], `total_tokens` or the prompt's and completion's sum).
#[derive(Clone, Copy, Debug, Default)]
pub struct ChatUsage;

impl<Res: ReportsUsage> UsageReport<Res> for ChatUsage {
    fn tokens_used(&self, res: &Res) -> Option<u64> {
        res.tokens_used()
    }
}

/// No token accounting: every request reserves 0 tokens, nothing is reconciled. For
/// services that only limit requests and concurrency.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoTokens;

impl<Req> TokenEstimate<Req> for NoTokens {
    fn estimate(&self, _req: &Req) -> u64 {
        0
    }
}

impl<Res> UsageReport<Res> for NoTokens {
    fn tokens_used(&self, _res: &Res) -> Option<u64> {
        None
    }
}

/// The default observer: does nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoObserver;

impl<Req> AdmissionObserver<Req> for NoObserver {
    fn on_admission(&self, _req: &Req, _admission: &Admission) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A provider that leaves `total_tokens` out or `null` (read as 0) is charged its
    /// prompt and completion tokens, and `"usage": {}` keeps the estimate: before,
    /// both settled to 0 and gave the whole reservation back.
    #[test]
    fn a_usage_without_its_total_is_charged_its_parts_and_an_empty_one_keeps_the_estimate() {
        let answer = |usage: Usage| ChatResponse {
            usage: Some(usage),
            ..ChatResponse::default()
        };
        assert_eq!(ChatUsage.tokens_used(&answer(Usage::new(9, 5, 0))), Some(14));
        assert_eq!(ChatUsage.tokens_used(&answer(Usage::new(9, 5, 20))), Some(20));
        assert_eq!(ChatUsage.tokens_used(&answer(Usage::default())), None);
        assert_eq!(ChatUsage.tokens_used(&ChatResponse::default()), None);
    }
}
