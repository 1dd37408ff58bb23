//! The innermost per-source service: the client, the validator (S7) and the
//! per-attempt telemetry record (S6).
//!
//! It sits below every gate, so only admitted attempts reach it: not-admitted
//! refusals cost nothing and leave no record.

use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::future::BoxFuture;
use pgw_client::{AnswerClassifier, ChatAnswer, ChatCall};
use pgw_core::{BoxError, CarriesHistory, Classify, InvalidResponse, SourceId};
use tokio::time::Instant;
use tower_service::Service;

use crate::telemetry::{AttemptTelemetry, Telemetry};
use crate::validate::Validator;

/// Where the rate limiter's admission observer leaves the admission of the attempt
/// about to be dispatched (one call has one attempt in flight at a time).
#[derive(Clone, Debug, Default)]
pub(crate) struct AdmissionCell(Arc<Mutex<Option<(Duration, u64)>>>);

impl AdmissionCell {
    pub(crate) fn set(&self, at: Duration, window: u64) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some((at, window));
    }

    fn take(&self) -> Option<(Duration, u64)> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

#[derive(Clone)]
pub(crate) struct Attempt<S> {
    pub(crate) inner: S,
    pub(crate) source: SourceId,
    pub(crate) group: Arc<str>,
    pub(crate) model: Option<Arc<str>>,
    pub(crate) telemetry: Telemetry,
    pub(crate) validator: Option<Validator>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl<S> Service<ChatCall> for Attempt<S>
where
    S: Service<ChatCall, Response = ChatAnswer, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = ChatAnswer;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<ChatAnswer, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, call: ChatCall) -> Self::Future {
        let attempt =
            u32::try_from(call.call_history().map_or(0, pgw_core::CallHistory::len) + 1).unwrap_or(u32::MAX);
        let admission = call
            .extensions()
            .get::<AdmissionCell>()
            .and_then(AdmissionCell::take);
        let validator = call
            .extensions()
            .get::<Validator>()
            .cloned()
            .or_else(|| self.validator.clone());
        let call_id = call.id().0;
        let model: Arc<str> = self
            .model
            .clone()
            .unwrap_or_else(|| Arc::from(call.request().model.as_str()));
        let source = self.source.clone();
        let group = Arc::clone(&self.group);
        let telemetry = self.telemetry.clone();
        let start = Instant::now();
        let fut = self.inner.call(call);
        Box::pin(async move {
            let mut result = fut.await;
            if let (Ok(answer), Some(v)) = (&result, &validator)
                && let Err(reason) = v.0.validate(&answer.response)
            {
                result = Err(InvalidResponse::new(reason).into());
            }
            let outcome = AnswerClassifier.classify(&result);
            let latency = start.elapsed();
            let (ttft, usage) = match &result {
                Ok(a) => (a.stats.ttft, a.stats.usage),
                Err(_) => (None, None),
            };
            telemetry.emit(&AttemptTelemetry {
                call_id,
                attempt,
                group: group.to_string(),
                source: Some(source),
                admitted_at_s: admission.map(|(at, _)| at.as_secs_f64()),
                admission_window: admission.map(|(_, w)| w),
                latency_ms: ms(latency),
                ttft_ms: ttft.map(ms),
                prompt_tokens: usage.map(|u| u.prompt_tokens),
                completion_tokens: usage.map(|u| u.completion_tokens),
                cost_usd: telemetry.prices.cost(&model, usage),
                outcome: outcome.as_str(),
                error: result.as_ref().err().map(ToString::to_string),
                cache_hit: false,
            });
            result
        })
    }
}
