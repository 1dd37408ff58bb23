//! Every error the server answers, in the OpenAI shape
//! `{"error": {"message", "type", "param", "code"}}`, so the official SDKs show it.
//!
//! | status | `type` | `code` | when |
//! |---|---|---|---|
//! | 400 | `invalid_request_error` | `invalid_json`, `invalid_request`, `invalid_body`, `tokens_exceed_quota`, `rejected`, the provider's own | a body that does not parse or could not be read, a request no quota window admits, a request every source rejects |
//! | 401 | `authentication_error` | `invalid_api_key` | no or unknown virtual key |
//! | 404 | `invalid_request_error` | `not_found`, `model_not_found` | unknown path; a model the key may not use |
//! | 405 | `invalid_request_error` | `method_not_allowed` | |
//! | 413 | `invalid_request_error` | `request_too_large` | body over `max_body_bytes` |
//! | 415 | `invalid_request_error` | `unsupported_media_type` | not `application/json` |
//! | 429 | `rate_limit_error` | `rate_limit_exceeded` | the key's quota, the pool's quotas or pushback; `Retry-After` when known |
//! | 502 | `upstream_error` | `upstream_failed` | every attempt failed |
//! | 503 | `service_unavailable` | `all_circuits_open`, `overloaded`, `backend_unavailable`, `stalled` | local refusals, and a provider's 503 or 529 that said when to come back (`overloaded`); `Retry-After` when known (the server adds `shed_retry_after_s` otherwise) |
//! | 504 | `timeout_error` | `deadline_exceeded`, `upstream_timeout` | the call's deadline, attempts that timed out |

use std::time::Duration;

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use pgw_core::{
    BackendUnavailable, BoxError, CircuitOpen, NeverAdmitted, NotAdmitted, Outcome, QuotaExceeded,
    UpstreamStatus, classify_error, is_timeout,
};
use pgw_stack::GatewayError;
use pgw_stack::retry::{Reason, RetryError};
use tower_ratelimit_redis::RequestTooLarge;

/// An error answer: status, OpenAI fields, and the `Retry-After` hint.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// `error.message`.
    pub message: String,
    /// `error.type`.
    pub kind: String,
    /// `error.code`.
    pub code: Option<String>,
    /// `error.param`.
    pub param: Option<String>,
    /// Sent as `Retry-After` (whole seconds, rounded up).
    pub retry_after: Option<Duration>,
    /// Sent as `x-should-retry: false`: the same request cannot succeed on a retry (the
    /// provider refused the request itself), whatever its status. Also sent for every
    /// 500, 502 and 504 (the gateway retried already).
    pub no_retry: bool,
}

impl ApiError {
    /// An error of `status` with `type`, `code` and `message`.
    pub fn new(status: StatusCode, kind: &str, code: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind: kind.to_owned(),
            code: Some(code.to_owned()),
            param: None,
            retry_after: None,
            no_retry: false,
        }
    }

    /// 503 `shutting_down`: the server's shutdown grace period ended before the call
    /// did (`what` happened to it); ask again in a second, another replica answers.
    #[must_use]
    pub fn shutting_down(what: &str) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "shutting_down",
            format!("the server is shutting down and its grace period is over: {what}"),
        )
        .retry_after(Some(Duration::from_secs(1)))
    }

    /// Sets the `Retry-After` hint.
    #[must_use]
    pub const fn retry_after(mut self, after: Option<Duration>) -> Self {
        self.retry_after = after;
        self
    }

    /// A 400 `invalid_request_error`.
    pub fn invalid_request(code: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", code, message)
    }

    /// The default error of a bare status (the framework's 404, 405, 413, 415, ...).
    #[must_use]
    pub fn of_status(status: StatusCode) -> Self {
        let (kind, code, message) = match status.as_u16() {
            400 => (
                "invalid_request_error",
                "invalid_request",
                "the request is malformed",
            ),
            401 => (
                "authentication_error",
                "invalid_api_key",
                "missing or unknown API key",
            ),
            404 => ("invalid_request_error", "not_found", "no such endpoint"),
            405 => (
                "invalid_request_error",
                "method_not_allowed",
                "method not allowed on this endpoint",
            ),
            408 => (
                "invalid_request_error",
                "request_timeout",
                "the request took too long to arrive",
            ),
            413 => (
                "invalid_request_error",
                "request_too_large",
                "the request body is larger than this server accepts",
            ),
            415 => (
                "invalid_request_error",
                "unsupported_media_type",
                "expected a body with content-type: application/json",
            ),
            422 => (
                "invalid_request_error",
                "invalid_request",
                "the request does not match the schema",
            ),
            429 => ("rate_limit_error", "rate_limit_exceeded", "rate limit exceeded"),
            503 => ("service_unavailable", "overloaded", "the server is overloaded"),
            504 => ("timeout_error", "deadline_exceeded", "the call took too long"),
            s if s >= 500 => ("server_error", "internal_error", "internal server error"),
            _ => (
                "invalid_request_error",
                "invalid_request",
                "the request was refused",
            ),
        };
        Self::new(status, kind, code, message)
    }

    /// The JSON body.
    #[must_use]
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }

    /// The `Retry-After` header value: whole seconds, rounded up, at least 1.
    #[must_use]
    pub fn retry_after_header(&self) -> Option<HeaderValue> {
        let d = self.retry_after?;
        let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
        Some(HeaderValue::from(secs.max(1)))
    }

    /// The answer to a failed gateway call. A request the providers rejected gets what
    /// the provider said (status, `type`, `code`, `param`, message); local refusals are
    /// 429 or 503 with `Retry-After` when known; deadlines 504. Source names appear in
    /// the message only when `expose_sources`.
    #[must_use]
    pub fn from_gateway(err: &BoxError, expose_sources: bool) -> Self {
        let detail = |summary: String| {
            if expose_sources {
                format!("{summary} ({err})")
            } else {
                summary
            }
        };
        // The last group's verdict decides (the fallback chain stopped there).
        let last: &(dyn std::error::Error + 'static) = match err.downcast_ref::<GatewayError>() {
            Some(g) => match g.failures().last() {
                Some((_, e)) => &**e,
                None => &**err,
            },
            None => &**err,
        };
        let mut answer = match last.downcast_ref::<RetryError>() {
            Some(r) => Self::from_retry(r, &detail),
            None => Self::from_refusal(last, &detail),
        };
        if !expose_sources {
            // A provider's message passed through names the operator's organization
            // ("... in organization org-AbC123 on tokens per min"): not the caller's.
            answer.message = hide_organizations(&answer.message);
        }
        answer
    }

    fn from_retry(r: &RetryError, detail: &dyn Fn(String) -> String) -> Self {
        let last = r.last_error();
        let upstream_retry = last
            .and_then(|e| UpstreamStatus::find(e))
            .and_then(UpstreamStatus::retry_after);
        match r.reason() {
            Reason::Rejected => {
                if let Some(e) = last {
                    return Self::rejected(e, detail);
                }
                Self::invalid_request("rejected", detail("every source rejected the request".into()))
            }
            Reason::AllCircuitsOpen { retry_after } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "all_circuits_open",
                detail(r.reason().to_string()),
            )
            .retry_after(Some(retry_after)),
            Reason::WaitTooLong { wait, .. } if last.is_some_and(|e| overload_pushback(e, r)) => {
                Self::upstream_pushback(r, true, Some(wait), detail)
            }
            Reason::WaitTooLong { wait, .. } => Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "rate_limit_exceeded",
                detail(format!(
                    "the pool is at its quota or pushing back; {}",
                    r.reason()
                )),
            )
            .retry_after(Some(wait)),
            // Refused at once where it had somewhere else to go (never the last word
            // of a chain, which waits on the groups that refused it so; a caller of
            // the stack's groups may see it).
            Reason::NotAdmittedHere { retry_after } => Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "rate_limit_exceeded",
                detail(format!("the pool is at its quota; {}", r.reason())),
            )
            .retry_after(retry_after),
            // Ended on the upstream's pushback: the last error may be the hold's refusal
            // (holds on), not the 429 or 503 itself, so this goes by the reason, and by
            // the last attempt the upstream pushed back on.
            Reason::PushbackExhausted { wait, .. } => Self::upstream_pushback(
                r,
                last.is_some_and(|e| overload_pushback(e, r)) || last_pushback_overloaded(r),
                upstream_retry.or(Some(wait)),
                detail,
            ),
            Reason::DeadlineExceeded => Self::new(
                StatusCode::GATEWAY_TIMEOUT,
                "timeout_error",
                "deadline_exceeded",
                detail(r.reason().to_string()),
            ),
            Reason::Stalled { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "stalled",
                detail(r.reason().to_string()),
            ),
            // Throttled here, or this process out of descriptors for a connection (no
            // source was blamed): shed like any load.
            Reason::RetryBudgetExhausted | Reason::Throttled | Reason::LocalExhaustion => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "overloaded",
                detail(r.reason().to_string()),
            )
            .retry_after(upstream_retry),
            _ => {
                if last.is_some_and(|e| is_timeout(e)) {
                    return Self::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        "timeout_error",
                        "upstream_timeout",
                        detail(format!("{}; the last attempt timed out", r.reason())),
                    );
                }
                if let Some(e) = last
                    && matches!(classify_error(e), Outcome::RateLimited { .. })
                {
                    return Self::upstream_pushback(r, overload_pushback(e, r), upstream_retry, detail);
                }
                Self::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    "upstream_failed",
                    detail(r.reason().to_string()),
                )
            }
        }
    }

    /// A call that ended on the upstream's pushback: 503 `overloaded` when the
    /// provider's 503 or 529 said when to come back (`overloaded`), else a 429.
    fn upstream_pushback(
        r: &RetryError,
        overloaded: bool,
        retry_after: Option<Duration>,
        detail: &dyn Fn(String) -> String,
    ) -> Self {
        let e = if overloaded {
            Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "overloaded",
                detail(format!("{}; the upstream is overloaded", r.reason())),
            )
        } else {
            Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "rate_limit_exceeded",
                detail(format!("{}; the upstream pushed back", r.reason())),
            )
        };
        e.retry_after(retry_after)
    }

    /// A request the provider rejected: its status and its error, field by field.
    fn rejected(e: &(dyn std::error::Error + 'static), detail: &dyn Fn(String) -> String) -> Self {
        if let Some(u) = UpstreamStatus::find(e) {
            let status = if u.status().is_client_error() {
                u.status()
            } else {
                StatusCode::BAD_REQUEST
            };
            if let Some(p) = u.provider() {
                return Self {
                    status,
                    message: p.message.clone(),
                    kind: p.kind.clone().unwrap_or_else(|| "invalid_request_error".into()),
                    code: p.code.clone(),
                    param: p.param.clone(),
                    retry_after: None,
                    // A 429 "Request too large for ... tokens per min" (or a 408/409)
                    // is one the OpenAI SDKs would send twice more, through the whole
                    // fallback chain again, to the same refusal.
                    no_retry: true,
                };
            }
            let mut err = Self::new(
                status,
                "invalid_request_error",
                "rejected",
                detail(u.message().to_owned()),
            );
            err.no_retry = true;
            return err;
        }
        Self::invalid_request("rejected", detail("the request was rejected".into()))
    }

    /// A refusal before any attempt (a gate, the backend), or an error without a
    /// retry verdict.
    fn from_refusal(e: &(dyn std::error::Error + 'static), detail: &dyn Fn(String) -> String) -> Self {
        if let Some(q) = find::<QuotaExceeded>(e) {
            return Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "rate_limit_exceeded",
                detail("quota exceeded".into()),
            )
            .retry_after(Some(q.retry_after()));
        }
        if let Some(c) = find::<CircuitOpen>(e) {
            return Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "all_circuits_open",
                detail("all circuits open".into()),
            )
            .retry_after(Some(c.retry_after()));
        }
        if find::<NeverAdmitted>(e).is_some() || find::<RequestTooLarge>(e).is_some() {
            return Self::invalid_request(
                "tokens_exceed_quota",
                detail("the request needs more tokens than a quota window ever admits".into()),
            );
        }
        if find::<BackendUnavailable>(e).is_some() {
            return Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "backend_unavailable",
                detail("the shared-state backend is unreachable".into()),
            );
        }
        if let Some(n) = NotAdmitted::of(e) {
            return Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "overloaded",
                detail("no source admitted the call".into()),
            )
            .retry_after(n.retry_after());
        }
        match classify_error(e) {
            Outcome::Rejected => return Self::rejected(e, detail),
            Outcome::LocalExhaustion => {
                return Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    "overloaded",
                    detail("this process is out of file descriptors for a connection".into()),
                );
            }
            _ => {}
        }
        Self::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "upstream_failed",
            detail("the call failed".into()),
        )
    }
}

/// Whether a failed call may have reached a provider: the gateway's verdict
/// ([`GatewayError::reached_a_provider`]), or for another error, anything but a
/// refusal before any attempt ([`NotAdmitted`]: a quota, open circuits, the backend
/// down, ...; or a request no window admits) or an attempt this process could not make
/// (out of file descriptors). What is not known to be a refusal counts as reached.
pub(crate) fn reached_a_provider(e: &BoxError) -> bool {
    if let Some(g) = e.downcast_ref::<GatewayError>() {
        return g.reached_a_provider();
    }
    if let Some(r) = e.downcast_ref::<RetryError>() {
        return r.reached_a_provider();
    }
    let e: &(dyn std::error::Error + 'static) = &**e;
    NotAdmitted::of(e).is_none() && find::<RequestTooLarge>(e).is_none() && !pgw_core::is_local_exhaustion(e)
}

/// The first error of type `T` in `e`'s source chain.
pub(crate) fn find<'a, T: std::error::Error + 'static>(
    e: &'a (dyn std::error::Error + 'static),
) -> Option<&'a T> {
    let mut cur = Some(e);
    while let Some(e) = cur {
        if let Some(t) = e.downcast_ref::<T>() {
            return Some(t);
        }
        cur = e.source();
    }
    None
}

/// `message` with every OpenAI organization id (`org-` and at least 16 letters or
/// digits: OpenAI's are 24) written `org-***`.
fn hide_organizations(message: &str) -> String {
    /// The fewest letters or digits after `org-` taken for an id ("an org-specific
    /// limit", a model `org-llama3-70b`, are words).
    const ORG_ID_LEN: usize = 16;
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(i) = rest.find("org-") {
        let id = rest[i + 4..]
            .bytes()
            .take_while(u8::is_ascii_alphanumeric)
            .count();
        // A word that only starts with "org-" (a model, a path) is kept.
        let starts_word = !rest[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '-');
        if id >= ORG_ID_LEN && starts_word {
            out.push_str(&rest[..i]);
            out.push_str("org-***");
        } else {
            out.push_str(&rest[..i + 4 + id]);
        }
        rest = &rest[i + 4 + id..];
    }
    out.push_str(rest);
    out
}

/// The header the OpenAI SDKs read before retrying (`false`: do not).
pub(crate) const SHOULD_RETRY_HEADER: &str = "x-should-retry";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry = self.retry_after_header();
        let no_retry = self.no_retry
            || matches!(
                self.status,
                StatusCode::INTERNAL_SERVER_ERROR | StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT
            );
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(v) = retry {
            response.headers_mut().insert(header::RETRY_AFTER, v);
        }
        if no_retry {
            // The gateway has retried already (every source of the chain, up to its
            // attempts), or the caller's deadline passed, or the provider refused the
            // request itself: the OpenAI SDKs, which retry 408, 409, 429 and 5xx twice
            // by default, are told not to multiply the attempts.
            response
                .headers_mut()
                .insert(SHOULD_RETRY_HEADER, HeaderValue::from_static("false"));
        }
        response
    }
}

/// The codes an error's metric label keeps: every code the server writes itself, and
/// the providers' codes pgw reads (OpenAI's; the compatible APIs use the same words).
const LABELLED_CODES: &[&str] = &[
    // The server's own.
    "all_circuits_open",
    "backend_unavailable",
    "deadline_exceeded",
    "draining",
    "internal_error",
    "invalid_header",
    "invalid_api_key",
    "invalid_body",
    "invalid_json",
    "invalid_request",
    "method_not_allowed",
    "model_not_found",
    "not_found",
    "overloaded",
    "rate_limit_exceeded",
    "rejected",
    "request_timeout",
    "request_too_large",
    "shutting_down",
    "stalled",
    "tokens_exceed_quota",
    "unsupported_media_type",
    "upstream_failed",
    "upstream_timeout",
    // The providers' (passed through with their answer).
    "content_filter",
    "content_policy_violation",
    "context_length_exceeded",
    "insufficient_quota",
    "invalid_value",
    "model_not_available",
    "server_error",
    "unsupported_parameter",
];

/// The `error_type` label of a call that ended with `code`: the code when the server
/// wrote it or it is a provider code pgw knows ([`LABELLED_CODES`]), `other` for any
/// other provider code, `none` without one. A provider's code is its own string; a
/// series per string it invents would grow the metrics without bound.
pub(crate) fn code_label(code: Option<&str>) -> &'static str {
    match code {
        None => "none",
        Some(c) => LABELLED_CODES
            .iter()
            .find(|k| **k == c)
            .copied()
            .unwrap_or("other"),
    }
}

/// Whether `e` is a provider's 503 or 529 that said when to come back (pushback, see
/// `pgw_core::classify_status`): the answer is 503 `overloaded`, not a quota's 429.
fn overloaded(e: &(dyn std::error::Error + 'static)) -> bool {
    UpstreamStatus::find(e).is_some_and(|u| u.status().is_server_error())
        && matches!(classify_error(e), Outcome::RateLimited { .. })
}

/// Whether the call's last error `last` is an overloaded provider's pushback: its own
/// answer ([`overloaded`]), or a hold placed after one ([`held_after_overload`]).
fn overload_pushback(last: &(dyn std::error::Error + 'static), r: &RetryError) -> bool {
    overloaded(last) || held_after_overload(last, r)
}

/// Whether `last` is a hold's refusal (holds on: the source or account held for the
/// time the upstream asked) after an overloaded provider's pushback: the wait that
/// ended the call is the provider's, not a quota's. The hold says so itself when it
/// was placed after one ([`pgw_core::QuotaExceeded::is_after_overload`]: also a hold
/// another call or process placed, refusing a call with no attempt of its own);
/// otherwise the call's own last pushback tells.
fn held_after_overload(last: &(dyn std::error::Error + 'static), r: &RetryError) -> bool {
    let hold = std::iter::successors(Some(last), |e| e.source())
        .find_map(|e| e.downcast_ref::<pgw_core::QuotaExceeded>())
        .filter(|q| q.dimension() == "hold");
    hold.is_some_and(|q| q.is_after_overload() || last_pushback_overloaded(r))
}

/// Whether the call's last attempt that the upstream pushed back on was a 5xx (a 503
/// or 529 with `Retry-After`), as its record says: what [`overloaded`] tells from the
/// last error, when that error is a hold's refusal instead.
fn last_pushback_overloaded(r: &RetryError) -> bool {
    r.attempts()
        .iter()
        .rev()
        .find(|a| a.outcome.is_rate_limited())
        .and_then(|a| a.status)
        .is_some_and(|s| s.is_server_error())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgw_core::ProviderError;

    #[test]
    fn a_code_label_is_one_of_a_known_few() {
        assert_eq!(code_label(None), "none");
        assert_eq!(code_label(Some("all_circuits_open")), "all_circuits_open");
        assert_eq!(
            code_label(Some("context_length_exceeded")),
            "context_length_exceeded"
        );
        assert_eq!(code_label(Some("acme_quota_9f2c")), "other");
        assert_eq!(code_label(Some("")), "other");
        // Every code the server writes itself is kept as it is.
        for status in [400, 401, 404, 405, 408, 413, 415, 429, 500, 502, 503, 504] {
            let e = ApiError::of_status(StatusCode::from_u16(status).unwrap());
            let code = e.code.as_deref();
            assert_eq!(code_label(code), code.unwrap_or("none"), "{status}");
        }
    }

    #[test]
    fn retry_after_rounds_up() {
        let e =
            ApiError::of_status(StatusCode::TOO_MANY_REQUESTS).retry_after(Some(Duration::from_millis(1200)));
        assert_eq!(e.retry_after_header().unwrap(), "2");
        let e = e.retry_after(Some(Duration::ZERO));
        assert_eq!(e.retry_after_header().unwrap(), "1");
    }

    #[test]
    fn quota_and_circuit_refusals() {
        let q: BoxError = Box::new(QuotaExceeded::new("rpm", Duration::from_secs(3)));
        let e = ApiError::from_gateway(&q, false);
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.retry_after, Some(Duration::from_secs(3)));
        let c: BoxError = Box::new(CircuitOpen::new(Duration::from_secs(9)).with_source("s-secret".into()));
        let e = ApiError::from_gateway(&c, false);
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code.as_deref(), Some("all_circuits_open"));
        assert!(!e.message.contains("s-secret"), "{}", e.message);
        assert!(ApiError::from_gateway(&c, true).message.contains("s-secret"));
    }

    /// The answer of a call whose upstream kept pushing back with `Retry-After: 30`:
    /// a 503 or 529 (overloaded) is the gateway's 503 `overloaded`, a 429 its 429;
    /// both with the upstream's `Retry-After`.
    #[tokio::test(start_paused = true)]
    async fn an_overloaded_upstream_that_said_when_is_503_overloaded() {
        use pgw_stack::retry::{RetryConfig, RetryLayer};
        use tower::{Layer, ServiceExt};

        async fn answer(status: u16) -> ApiError {
            let layer = RetryLayer::new(RetryConfig {
                max_pushback_wait: Duration::from_secs(10),
                ..RetryConfig::default()
            })
            .unwrap()
            .classifier(pgw_core::OpenAiClassifier);
            let upstream = tower::service_fn(move |_: pgw_stack::ChatCall| async move {
                let busy = UpstreamStatus::new(
                    StatusCode::from_u16(status).unwrap(),
                    Some(Duration::from_secs(30)),
                    "busy",
                );
                Err::<pgw_core::openai::ChatResponse, BoxError>(Box::new(busy))
            });
            let call = pgw_stack::ChatCall::new(pgw_core::openai::ChatRequest::user("m", "hi"));
            let err = layer.layer(upstream).oneshot(call).await.unwrap_err();
            ApiError::from_gateway(&err, false)
        }
        for status in [503, 529] {
            let e = answer(status).await;
            assert_eq!(
                e.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "{status}: {}",
                e.message
            );
            assert_eq!(e.code.as_deref(), Some("overloaded"), "{status}");
            assert_eq!(e.retry_after, Some(Duration::from_secs(30)), "{status}");
        }
        let e = answer(429).await;
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS, "{}", e.message);
        assert_eq!(e.code.as_deref(), Some("rate_limit_exceeded"));
        assert_eq!(e.retry_after, Some(Duration::from_secs(30)));
    }

    /// A call that failed because this process is out of file descriptors (`EMFILE`
    /// on the upstream connect) is shed, 503 `overloaded` (the server adds its
    /// `Retry-After`), not a 502 that blames the upstream, and did not reach a
    /// provider (the tenant's quota gets it back); with or without the retry layer's
    /// verdict around it.
    #[cfg(unix)]
    #[tokio::test(start_paused = true)]
    async fn running_out_of_file_descriptors_is_503_overloaded() {
        use pgw_stack::retry::{RetryConfig, RetryLayer};
        use tower::{Layer, ServiceExt};

        let emfile = || -> BoxError { Box::new(std::io::Error::from_raw_os_error(24)) };
        let layer = RetryLayer::new(RetryConfig::default())
            .unwrap()
            .classifier(pgw_core::OpenAiClassifier);
        let upstream = tower::service_fn(move |_: pgw_stack::ChatCall| async move {
            Err::<pgw_core::openai::ChatResponse, BoxError>(emfile())
        });
        let call = pgw_stack::ChatCall::new(pgw_core::openai::ChatRequest::user("m", "hi"));
        let through_retry = layer.layer(upstream).oneshot(call).await.unwrap_err();
        for err in [through_retry, emfile()] {
            let e = ApiError::from_gateway(&err, false);
            assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE, "{}", e.message);
            assert_eq!(e.code.as_deref(), Some("overloaded"), "{}", e.message);
            // Nothing was sent: the tenant's quota gets the call back.
            assert!(!reached_a_provider(&err), "{err}");
        }
        let refused: BoxError = Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(
            ApiError::from_gateway(&refused, false).status,
            StatusCode::BAD_GATEWAY
        );
        assert!(reached_a_provider(&refused));
    }

    #[test]
    fn a_rejected_request_keeps_the_providers_error() {
        let p = ProviderError::parse(
            br#"{"error":{"message":"no such model","type":"invalid_request_error","param":"model","code":"model_not_found"}}"#,
        )
        .unwrap();
        let err: BoxError =
            Box::new(UpstreamStatus::new(StatusCode::NOT_FOUND, None, "no such model").with_provider(p));
        let e = ApiError::from_gateway(&err, false);
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        assert_eq!(e.code.as_deref(), Some("model_not_found"));
        assert_eq!(e.param.as_deref(), Some("model"));
    }

    /// OpenAI's 429 for one request over the whole tokens-per-minute limit is the
    /// request's fault (`Rejected`): the caller gets the provider's 429 with
    /// `x-should-retry: false` (the SDKs would send it twice more through the whole
    /// chain), and without the operator's organization id unless `expose_sources`.
    #[tokio::test(start_paused = true)]
    async fn a_request_too_large_is_not_retried_by_the_sdk_and_hides_the_organization() {
        use pgw_stack::retry::{RetryConfig, RetryLayer};
        use tower::{Layer, ServiceExt};

        let layer = RetryLayer::new(RetryConfig::default())
            .unwrap()
            .classifier(pgw_core::OpenAiClassifier);
        let upstream = tower::service_fn(|_: pgw_stack::ChatCall| async {
            let p = ProviderError::parse(
                br#"{"error":{"message":"Request too large for gpt-4o in organization org-AbC123xyzAbC123xyzAb on tokens per min (TPM): Limit 30000, Requested 50000.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#,
            )
            .unwrap();
            let status = UpstreamStatus::new(StatusCode::TOO_MANY_REQUESTS, None, "").with_provider(p);
            Err::<pgw_core::openai::ChatResponse, BoxError>(Box::new(status))
        });
        let call = pgw_stack::ChatCall::new(pgw_core::openai::ChatRequest::user("m", "hi"));
        let err = layer.layer(upstream).oneshot(call).await.unwrap_err();

        let e = ApiError::from_gateway(&err, false);
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS, "{}", e.message);
        assert!(
            e.message.contains("organization org-*** on tokens"),
            "{}",
            e.message
        );
        assert!(!e.message.contains("AbC123xyz"), "{}", e.message);
        let response = e.into_response();
        assert_eq!(response.headers()[SHOULD_RETRY_HEADER], "false");
        assert!(response.headers().get(header::RETRY_AFTER).is_none());

        let exposed = ApiError::from_gateway(&err, true);
        assert!(
            exposed.message.contains("org-AbC123xyzAbC123xyzAb"),
            "{}",
            exposed.message
        );
    }

    #[test]
    fn organization_ids_are_hidden_and_nothing_else() {
        for (given, want) in [
            (
                "in organization org-AbC123xyzAbC123xyzAb on",
                "in organization org-*** on",
            ),
            (
                "org-1234567890123456 and org-abcdefghijklmnopqrstuvwx.",
                "org-*** and org-***.",
            ),
            ("model my-org-model and org-abc", "model my-org-model and org-abc"),
            (
                "an org-specific limit, org-llama3-70b",
                "an org-specific limit, org-llama3-70b",
            ),
            ("é org-AbC123xyzAbC123xyzAb é", "é org-*** é"),
            ("no org here", "no org here"),
            ("trailing org-", "trailing org-"),
        ] {
            assert_eq!(hide_organizations(given), want, "{given}");
        }
    }

    /// Every code the server writes keeps its own `error_type` label: those of
    /// `of_status`, and every string literal passed as the code to `ApiError::new`
    /// (after its status) or `ApiError::invalid_request` in the crate's sources. A
    /// code missing from [`LABELLED_CODES`] was counted as `other` (`stalled` and
    /// `shutting_down` were), and an alert on it never fired.
    #[test]
    fn every_code_the_server_writes_keeps_its_label() {
        for s in 100..600u16 {
            let status = StatusCode::from_u16(s).unwrap();
            let e = ApiError::of_status(status);
            assert_ne!(code_label(e.code.as_deref()), "other", "{s}");
        }
        let sources = [
            include_str!("auth.rs"),
            include_str!("config.rs"),
            include_str!("error.rs"),
            include_str!("lib.rs"),
            include_str!("main.rs"),
            include_str!("routes.rs"),
            include_str!("serve.rs"),
            include_str!("sse.rs"),
            include_str!("stall.rs"),
            include_str!("track.rs"),
        ];
        // Argument `n` of the call whose arguments start `args`, when it is a string
        // literal (top-level commas split them; the literals here have no escapes).
        let literal_arg = |args: &str, n: usize| -> Option<String> {
            let (mut depth, mut quoted, mut start, mut k) = (0i32, false, 0, 0);
            for (i, c) in args.char_indices() {
                match c {
                    '"' => quoted = !quoted,
                    _ if quoted => {}
                    '(' | '[' | '{' => depth += 1,
                    ')' | ']' | '}' if depth == 0 => {
                        return (k == n)
                            .then(|| args[start..i].trim().to_owned())?
                            .strip_prefix('"')?
                            .strip_suffix('"')
                            .map(str::to_owned);
                    }
                    ')' | ']' | '}' => depth -= 1,
                    ',' if depth == 0 => {
                        if k == n {
                            let a = args[start..i].trim();
                            return a.strip_prefix('"')?.strip_suffix('"').map(str::to_owned);
                        }
                        k += 1;
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            None
        };
        let mut codes = Vec::new();
        for src in sources {
            for (at, call) in src
                .match_indices("ApiError::new(")
                .chain(src.match_indices("Self::new("))
            {
                let args = &src[at + call.len()..];
                if args.trim_start().starts_with("StatusCode::") {
                    codes.extend(literal_arg(args, 2));
                }
            }
            for (at, call) in src.match_indices("ApiError::invalid_request(") {
                codes.extend(literal_arg(&src[at + call.len()..], 0));
            }
        }
        for must in ["stalled", "shutting_down", "deadline_exceeded", "invalid_json"] {
            assert!(
                codes.iter().any(|c| c == must),
                "the scan finds {must}: {codes:?}"
            );
        }
        let unlabelled: Vec<_> = codes
            .iter()
            .filter(|c| code_label(Some(c)) != c.as_str())
            .collect();
        assert!(unlabelled.is_empty(), "not in LABELLED_CODES: {unlabelled:?}");
    }
}
