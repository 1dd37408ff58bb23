//! Classifiers for HTTP and OpenAI-compatible chat completion results.

use std::error::Error;
use std::time::SystemTime;

use http::StatusCode;

use crate::error::{BoxError, EmptyCompletion, InvalidResponse, UpstreamStatus};
use crate::openai::ChatResponse;
use crate::{Classify, Outcome};

/// The outcome of an HTTP status (with its parsed `Retry-After` hint), when nothing
/// else is known about the answer (no body: see [`classify_upstream`] for the full
/// decision).
///
/// | status | outcome |
/// |---|---|
/// | 2xx | `Success` |
/// | 429 | `RateLimited { retry_after }` |
/// | 401, 402, 403, 404 | `SourceDead` (bad or revoked key, no credit, a wrong path: nobody gets through this source) |
/// | 408, 409, 425 | `Transient` (timing, may pass on a retry) |
/// | 498 | `Transient` (Groq's `capacity_exceeded`: its flex tier is full, retry later) |
/// | 400, 413, 422 and other 4xx | `Rejected` (the request itself is bad) |
/// | 503 and 529 (overloaded) with a `Retry-After` | `RateLimited { retry_after }`: the source said when to come back (RFC 9110, 10.2.3), pushback like a 429's |
/// | 5xx (503 and 529 without `Retry-After` included), 1xx, 3xx | `Transient` |
#[must_use]
pub fn classify_status(status: StatusCode, retry_after: Option<std::time::Duration>) -> Outcome {
    match status.as_u16() {
        200..=299 => Outcome::Success,
        429 => Outcome::RateLimited { retry_after },
        503 | 529 if retry_after.is_some() => Outcome::RateLimited { retry_after },
        401..=404 => Outcome::SourceDead,
        408 | 409 | 425 | 498 => Outcome::Transient,
        400..=499 => Outcome::Rejected,
        _ => Outcome::Transient,
    }
}

/// What a provider's error `code` or `type` means, whatever the status it came with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Meaning {
    /// The request is wrong: every source would refuse it.
    Rejected,
    /// The key or the account cannot serve anyone.
    SourceDead,
    /// The account has no credit (billing): dead, and for long.
    QuotaExhausted,
    /// Pushback: slow down.
    RateLimited,
    /// The provider is busy: may pass on a retry.
    Transient,
    /// The model does not exist here.
    UnknownModel,
}

/// Provider error codes and types (OpenAI, Azure OpenAI, Anthropic) whose meaning does
/// not depend on the status, looked up by `code` first, then by `type`. Anything
/// else is classified by its status ([`classify_status`]).
const MEANINGS: &[(&str, Meaning)] = &[
    // A model this source does not serve: the request is wrong when the caller named
    // it (a typo in `model` must not force-open every breaker of the pool), the source
    // when its configuration did (see `classify_upstream`).
    ("model_not_found", Meaning::UnknownModel),
    ("context_length_exceeded", Meaning::Rejected),
    ("content_policy_violation", Meaning::Rejected),
    ("content_filter", Meaning::Rejected),
    ("string_above_max_length", Meaning::Rejected),
    // Billing: the account has no credit left; retry-after would not help.
    ("insufficient_quota", Meaning::QuotaExhausted),
    ("billing_hard_limit_reached", Meaning::QuotaExhausted),
    ("invalid_api_key", Meaning::SourceDead),
    ("authentication_error", Meaning::SourceDead),
    ("permission_error", Meaning::SourceDead),
    ("rate_limit_exceeded", Meaning::RateLimited),
    ("rate_limit_error", Meaning::RateLimited),
    ("overloaded_error", Meaning::Transient),
    // Groq's 498 (its flex tier at capacity).
    ("capacity_exceeded", Meaning::Transient),
    // Google's status words, Gemini's `status` beside a numeric code.
    ("UNAUTHENTICATED", Meaning::SourceDead),
    ("PERMISSION_DENIED", Meaning::SourceDead),
    ("RESOURCE_EXHAUSTED", Meaning::RateLimited),
    ("UNAVAILABLE", Meaning::Transient),
    // Gemini's reasons (`details[].reason`) and a key, region or billing state the
    // source cannot serve anyone in: a 400 `INVALID_ARGUMENT` "API key expired", a
    // 400 `FAILED_PRECONDITION` "User location is not supported for the API use".
    ("API_KEY_INVALID", Meaning::SourceDead),
    ("FAILED_PRECONDITION", Meaning::SourceDead),
];

/// What an error message alone says of the source, whatever its code and status:
/// the account has no credit (Anthropic's 400 "Your credit balance is too low to
/// access the Anthropic API", OpenRouter's "Insufficient credits"), or the key is not
/// one (Gemini's 400 `INVALID_ARGUMENT` "API key not valid. Please pass a valid API
/// key."). Without it such a 400 was `Rejected`: the call failed at once, and the
/// source, never counted against, kept every call it was offered.
fn meaning_of_message(message: &str) -> Option<Meaning> {
    let m = message.to_ascii_lowercase();
    if m.contains("credit balance is too low") || m.contains("insufficient credits") {
        Some(Meaning::QuotaExhausted)
    } else if m.contains("api key not valid")
        || m.contains("api key expired")
        || m.contains("api_key_invalid")
    {
        Some(Meaning::SourceDead)
    } else {
        None
    }
}

/// Whether `code` is a provider code or type whose meaning pgw knows ([`MEANINGS`]).
pub(crate) fn is_known_code(code: &str) -> bool {
    meaning(Some(code)).is_some()
}

fn meaning(name: Option<&str>) -> Option<Meaning> {
    let name = name?;
    MEANINGS.iter().find(|(n, _)| *n == name).map(|(_, m)| *m)
}

/// Whether an error message says a model does not exist (a 404 without a known code:
/// OpenAI-compatible servers that write only the message, Anthropic's
/// `not_found_error` with `model: <name>`).
fn names_a_missing_model(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.starts_with("model:") || (m.contains("model") && (m.contains("not exist") || m.contains("not found")))
}

/// Whether an error message says this request is too large for the source that
/// answered, not wrong everywhere: a context window it does not fit (vLLM's and
/// OpenAI's "maximum context length", Anthropic's "prompt is too long", whatever the
/// code beside it), or one request above the account's whole token-per-minute limit
/// (OpenAI's 429 and Groq's 413 "Request too large for ... on tokens per min", coded
/// `rate_limit_exceeded`: waiting never lets it through, and it says nothing about
/// the account's load).
///
/// Also a feature of the request the source's model lacks (OpenRouter's 404 "No
/// endpoints found that support tool use", "... the provided 'tool_choice' value",
/// "... image input"): another source may have it, and the source serves other calls.
pub(crate) fn names_a_request_too_large(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("no endpoints found that support")
        || m.contains("maximum context length")
        || m.contains("context length exceeded")
        || m.contains("prompt is too long")
        // Gemini: "The input token count (1048577) exceeds the maximum number of
        // tokens allowed (1048576)."
        || m.contains("exceeds the maximum number of tokens")
        || (m.contains("request too large") && (m.contains("tokens per min") || m.contains("tpm")))
}

/// Whether a 403's message is a moderation refusal of this request (OpenRouter's
/// moderation: "... flagged ..."), not a key or account that serves nobody.
fn names_a_moderation_refusal(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("flagged") || m.contains("moderation")
}

/// The outcome of a non-2xx answer: the provider's error code and type first, then
/// the status. The one place where an upstream error becomes an outcome.
///
/// | answer | outcome |
/// |---|---|
/// | `code`/`type` `model_not_found`, or a 404 whose message says the model does not exist | `Rejected`; `SourceDead` when the model was the source's own ([`UpstreamStatus::with_source_model`]: a misconfigured source serves nobody) |
/// | `context_length_exceeded`, `content_policy_violation`, `content_filter` | `Rejected` |
/// | a message saying the request does not fit the source (context length, one request over the whole tokens-per-minute limit: OpenAI's 429 "Request too large", whatever its code; a feature its model lacks: OpenRouter's 404 "No endpoints found that support tool use") | `Rejected` (and [`crate::exceeds_source`]: another source may take it) |
/// | a 403 whose message is a moderation refusal ("flagged") | `Rejected` (the request, not the key) |
/// | `insufficient_quota` (429, billing), `invalid_api_key`, `authentication_error`, `permission_error`, Google's `UNAUTHENTICATED`, `PERMISSION_DENIED` and `FAILED_PRECONDITION` (a region it does not serve), Gemini's reason `API_KEY_INVALID` (also an expired key) | `SourceDead` |
/// | without a known code: a message saying the account has no credit (Anthropic's 400 "credit balance is too low", "insufficient credits") or the key is not valid (Gemini's 400 "API key not valid", "API key expired") | `SourceDead` |
/// | `rate_limit_exceeded`, `rate_limit_error`, Google's `RESOURCE_EXHAUSTED` | `RateLimited { retry_after }` |
/// | `overloaded_error` (also Groq's `capacity_exceeded`, Google's `UNAVAILABLE`), 503 or 529 with a `Retry-After` | `RateLimited { retry_after }` (the source said when it can take more: held until then, as after a 429) |
/// | `overloaded_error` (and the same), 503 or 529 without one | `Transient` |
/// | anything else | by status ([`classify_status`]) |
///
/// ```
/// use http::StatusCode;
/// use pgw_core::{classify_upstream, Outcome, ProviderError, UpstreamStatus};
///
/// let body = br#"{"error":{"message":"The model `gpt-4o-mimi` does not exist or you do not have access to it.","type":"invalid_request_error","param":null,"code":"model_not_found"}}"#;
/// let err = UpstreamStatus::new(StatusCode::NOT_FOUND, None, "")
///     .with_provider(ProviderError::parse(body).unwrap());
/// assert_eq!(classify_upstream(&err), Outcome::Rejected);
/// // A 404 with no body says the path is wrong: nobody gets through this source.
/// assert_eq!(classify_upstream(&UpstreamStatus::new(StatusCode::NOT_FOUND, None, "")), Outcome::SourceDead);
/// ```
#[must_use]
pub fn classify_upstream(err: &UpstreamStatus) -> Outcome {
    let status = err.status();
    let provider = err.provider();
    let message = provider.map_or(err.message(), |p| p.message.as_str());
    let by_name = provider
        .and_then(|p| meaning(p.code.as_deref()).or_else(|| meaning(p.kind.as_deref())))
        .or_else(|| meaning_of_message(message));
    let unknown_model = by_name == Some(Meaning::UnknownModel)
        || (by_name.is_none() && status == StatusCode::NOT_FOUND && names_a_missing_model(message));
    if unknown_model {
        return if err.is_source_model() {
            Outcome::SourceDead
        } else {
            Outcome::Rejected
        };
    }
    if names_a_request_too_large(message)
        || (status == StatusCode::FORBIDDEN && by_name.is_none() && names_a_moderation_refusal(message))
    {
        return Outcome::Rejected;
    }
    match by_name {
        Some(Meaning::Rejected) => return Outcome::Rejected,
        Some(Meaning::SourceDead | Meaning::QuotaExhausted) => return Outcome::SourceDead,
        Some(Meaning::RateLimited) => {
            return Outcome::RateLimited {
                retry_after: err.retry_after(),
            };
        }
        // Overloaded, and told when to come back: pushback (the source is held until
        // then instead of being sent the next attempt after a backoff).
        Some(Meaning::Transient) if err.retry_after().is_some() => {
            return Outcome::RateLimited {
                retry_after: err.retry_after(),
            };
        }
        Some(Meaning::Transient) => return Outcome::Transient,
        Some(Meaning::UnknownModel) | None => {}
    }
    classify_status(status, err.retry_after())
}

/// Whether `err`'s chain holds a provider's answer saying the account has no credit
/// left (`insufficient_quota`, `billing_hard_limit_reached`, by `code` or `type`; or,
/// without a known code, a message saying so: Anthropic's "credit balance is too low").
/// Such a source is `SourceDead` ([`classify_upstream`]) and stays dead until someone
/// pays: the gateway holds it far longer than a breaker's cooldown.
///
/// ```
/// use http::StatusCode;
/// use pgw_core::{BoxError, ProviderError, UpstreamStatus, is_quota_exhausted};
///
/// let body = br#"{"error":{"message":"You exceeded your current quota.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#;
/// let err: BoxError = Box::new(
///     UpstreamStatus::new(StatusCode::TOO_MANY_REQUESTS, None, "")
///         .with_provider(ProviderError::parse(body).unwrap()),
/// );
/// assert!(is_quota_exhausted(&*err));
/// let rate: BoxError = Box::new(UpstreamStatus::new(StatusCode::TOO_MANY_REQUESTS, None, ""));
/// assert!(!is_quota_exhausted(&*rate));
/// ```
#[must_use]
pub fn is_quota_exhausted(err: &(dyn Error + 'static)) -> bool {
    let Some(p) = UpstreamStatus::find(err).and_then(UpstreamStatus::provider) else {
        return false;
    };
    let by_name = meaning(p.code.as_deref())
        .or_else(|| meaning(p.kind.as_deref()))
        .or_else(|| meaning_of_message(&p.message));
    by_name == Some(Meaning::QuotaExhausted)
}

/// The outcome of a parsed chat completion answer: an empty completion is
/// `Transient`; text, a tool call, a refusal or a content filter's verdict is
/// `Success` (the source did its job; a decline is the caller's answer, not a fault
/// of the source, and another source would decline the same prompt).
#[must_use]
pub fn classify_response(resp: &ChatResponse) -> Outcome {
    if resp.is_empty_completion() {
        Outcome::Transient
    } else {
        Outcome::Success
    }
}

/// The outcome of an attempt that ended in an error: walks the source chain for an
/// [`UpstreamStatus`] (classified by [`classify_upstream`]), an [`InvalidResponse`]
/// (`Invalid`), an [`EmptyCompletion`] (`Transient`) or the process out of file
/// descriptors (`LocalExhaustion`, see [`is_local_exhaustion`]); anything else
/// (timeouts, connect errors, resets, watchdog cuts, garbage bytes) is `Transient`.
#[must_use]
pub fn classify_error(err: &(dyn Error + 'static)) -> Outcome {
    let mut cur: Option<&(dyn Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(s) = e.downcast_ref::<UpstreamStatus>() {
            return classify_upstream(s);
        }
        if e.is::<InvalidResponse>() {
            return Outcome::Invalid;
        }
        if e.is::<EmptyCompletion>() {
            return Outcome::Transient;
        }
        cur = e.source();
    }
    if is_local_exhaustion(err) {
        Outcome::LocalExhaustion
    } else {
        Outcome::Transient
    }
}

/// Whether an error's source chain holds an I/O error that says this process ran out
/// of file descriptors (`EMFILE`, the process's own limit; `ENFILE`, the system's). A
/// descriptor is taken only to open a connection (or resolve its name), before any
/// byte of the request is sent: such an attempt never reached the source, and every
/// other source would fail alike. [`classify_error`] makes it `LocalExhaustion`, which
/// no breaker, health score, budget or quota counts. (`ENOBUFS` and `ENOMEM` may come
/// after a request was sent: they stay `Transient`.) Unix only (elsewhere always
/// `false`).
///
/// ```
/// use pgw_core::is_local_exhaustion;
///
/// let emfile = std::io::Error::from_raw_os_error(24); // EMFILE on Linux, the BSDs, macOS
/// assert_eq!(is_local_exhaustion(&emfile), cfg!(unix));
/// let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
/// assert!(!is_local_exhaustion(&refused));
/// ```
#[must_use]
pub fn is_local_exhaustion(err: &(dyn Error + 'static)) -> bool {
    let mut cur: Option<&(dyn Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if e.downcast_ref::<std::io::Error>().is_some_and(exhausted) {
            return true;
        }
        cur = e.source();
    }
    false
}

#[cfg(unix)]
fn exhausted(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

#[cfg(not(unix))]
fn exhausted(_: &std::io::Error) -> bool {
    false
}

/// Classifies raw `http::Response`s by status and `Retry-After` header; errors by
/// [`classify_error`]. It cannot see the body, so an empty completion in a 200 is a
/// `Success` here; use [`OpenAiClassifier`] on parsed answers for that.
#[derive(Clone, Copy, Debug, Default)]
pub struct HttpClassifier;

impl<B> Classify<http::Response<B>, BoxError> for HttpClassifier {
    fn classify(&self, result: &Result<http::Response<B>, BoxError>) -> Outcome {
        match result {
            Ok(resp) => classify_status(
                resp.status(),
                crate::retry_after::from_headers(resp.headers(), SystemTime::now()),
            ),
            Err(e) => classify_error(&**e),
        }
    }
}

/// Classifies parsed chat completion answers by [`classify_response`] (an empty
/// completion is `Transient`; text, tool calls and declines are `Success`); errors by
/// [`classify_error`].
#[derive(Clone, Copy, Debug, Default)]
pub struct OpenAiClassifier;

impl Classify<ChatResponse, BoxError> for OpenAiClassifier {
    fn classify(&self, result: &Result<ChatResponse, BoxError>) -> Outcome {
        match result {
            Ok(resp) => classify_response(resp),
            Err(e) => classify_error(&**e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ProviderError;
    use crate::openai::{ChatMessage, Choice};
    use std::time::Duration;

    fn answer(text: &str) -> ChatResponse {
        ChatResponse {
            choices: vec![Choice::new(
                0,
                ChatMessage::new("assistant", text),
                Some("stop".into()),
            )],
            ..ChatResponse::default()
        }
    }

    fn status_err(code: u16, ra: Option<Duration>) -> BoxError {
        Box::new(UpstreamStatus::new(StatusCode::from_u16(code).unwrap(), ra, "x"))
    }

    /// A 503 or 529 that says when to come back is pushback: the source is held until
    /// then, as after a 429. Without `Retry-After`, and for other 5xx whatever their
    /// headers, a failure.
    #[test]
    fn an_overloaded_source_that_says_when_to_come_back_is_pushback() {
        let after = Some(Duration::from_secs(30));
        let overloaded = r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
        let busy = r#"{"error":{"message":"The engine is currently overloaded","type":"server_error","param":null,"code":null}}"#;
        for (status, body) in [
            (503, ""),
            (529, ""),
            (529, overloaded),
            (503, overloaded),
            (503, busy),
        ] {
            let with = |ra| {
                let e = UpstreamStatus::new(StatusCode::from_u16(status).unwrap(), ra, "");
                match ProviderError::parse(body.as_bytes()) {
                    Some(p) => e.with_provider(p),
                    None => e,
                }
            };
            assert_eq!(
                classify_upstream(&with(after)),
                Outcome::RateLimited { retry_after: after },
                "{status} {body}"
            );
            assert_eq!(
                classify_upstream(&with(None)),
                Outcome::Transient,
                "{status} {body}"
            );
        }
        for status in [500, 502, 504] {
            let e = UpstreamStatus::new(StatusCode::from_u16(status).unwrap(), after, "");
            assert_eq!(classify_upstream(&e), Outcome::Transient, "{status}");
        }
        assert_eq!(
            classify_status(StatusCode::SERVICE_UNAVAILABLE, after),
            Outcome::RateLimited { retry_after: after }
        );
        assert_eq!(
            classify_status(StatusCode::SERVICE_UNAVAILABLE, None),
            Outcome::Transient
        );
    }

    /// One row per example of every outcome class, through the OpenAI classifier.
    #[test]
    fn design_table_rows() {
        let c = OpenAiClassifier;
        let ra = Some(Duration::from_secs(7));
        let rows: Vec<(Result<ChatResponse, BoxError>, Outcome)> = vec![
            (Ok(answer("hello")), Outcome::Success),
            (Err(status_err(429, ra)), Outcome::RateLimited { retry_after: ra }),
            (
                Err(status_err(429, None)),
                Outcome::RateLimited { retry_after: None },
            ),
            (
                Err(Box::new(std::io::Error::new(std::io::ErrorKind::TimedOut, "t"))),
                Outcome::Transient,
            ),
            (
                Err(Box::new(std::io::Error::from(
                    std::io::ErrorKind::ConnectionReset,
                ))),
                Outcome::Transient,
            ),
            (Err(status_err(500, None)), Outcome::Transient),
            (Err(status_err(503, None)), Outcome::Transient),
            (Ok(answer("")), Outcome::Transient),
            (Ok(answer("  \n")), Outcome::Transient),
            (Err(Box::new(EmptyCompletion)), Outcome::Transient),
            (Err(status_err(401, None)), Outcome::SourceDead),
            (Err(status_err(403, None)), Outcome::SourceDead),
            (Err(status_err(400, None)), Outcome::Rejected),
            (Err(status_err(413, None)), Outcome::Rejected),
            (Err(status_err(422, None)), Outcome::Rejected),
            (Err(Box::new(InvalidResponse::new("not json"))), Outcome::Invalid),
        ];
        for (i, (result, want)) in rows.iter().enumerate() {
            assert_eq!(c.classify(result), *want, "row {i}");
        }
    }

    #[test]
    fn http_classifier_reads_headers() {
        let resp = http::Response::builder()
            .status(429)
            .header("retry-after", "3")
            .body(())
            .unwrap();
        assert_eq!(
            HttpClassifier.classify(&Ok(resp)),
            Outcome::RateLimited {
                retry_after: Some(Duration::from_secs(3))
            }
        );
        let ok = http::Response::builder().status(204).body(()).unwrap();
        assert_eq!(HttpClassifier.classify(&Ok(ok)), Outcome::Success);
        let err: Result<http::Response<()>, BoxError> = Err("connection refused".into());
        assert_eq!(HttpClassifier.classify(&err), Outcome::Transient);
    }

    /// One row per provider error answer, as the providers write them (status,
    /// body): what `classify_upstream` makes of it.
    #[test]
    fn provider_codes_table() {
        let ra = Some(Duration::from_secs(3));
        let rows: &[(u16, &str, Outcome)] = &[
            // A model the caller named that does not exist: the request is wrong.
            (
                404,
                r#"{"error":{"message":"The model `gpt-4o-mimi` does not exist or you do not have access to it.","type":"invalid_request_error","param":null,"code":"model_not_found"}}"#,
                Outcome::Rejected,
            ),
            (
                404,
                r#"{"error":{"message":"The model `x` does not exist","type":"invalid_request_error","param":"model","code":null}}"#,
                Outcome::Rejected,
            ),
            (
                404,
                r#"{"type":"error","error":{"type":"not_found_error","message":"model: claude-9"}}"#,
                Outcome::Rejected,
            ),
            (
                400,
                r#"{"error":{"message":"model not found","code":"model_not_found"}}"#,
                Outcome::Rejected,
            ),
            // A 404 that does not name a model: a wrong base URL, nobody gets through.
            (
                404,
                r#"{"error":{"message":"Not Found","type":"invalid_request_error"}}"#,
                Outcome::SourceDead,
            ),
            (404, "<html>404 page not found</html>", Outcome::SourceDead),
            // Billing: a 429 that no waiting cures.
            (
                429,
                r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#,
                Outcome::SourceDead,
            ),
            (
                429,
                r#"{"error":{"message":"quota","type":"insufficient_quota","param":null,"code":null}}"#,
                Outcome::SourceDead,
            ),
            (
                429,
                r#"{"error":{"message":"Rate limit reached for m on requests per min (RPM)","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#,
                Outcome::RateLimited { retry_after: ra },
            ),
            (429, "", Outcome::RateLimited { retry_after: ra }),
            (
                429,
                r#"{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}"#,
                Outcome::RateLimited { retry_after: ra },
            ),
            (
                401,
                r#"{"error":{"message":"Incorrect API key provided","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}"#,
                Outcome::SourceDead,
            ),
            (
                400,
                r#"{"error":{"message":"bad key","code":"invalid_api_key"}}"#,
                Outcome::SourceDead,
            ),
            (
                401,
                r#"{"type":"error","error":{"type":"authentication_error","message":"invalid x-api-key"}}"#,
                Outcome::SourceDead,
            ),
            // Overloaded, with the table's `Retry-After`: pushback (see the test below).
            (
                529,
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
                Outcome::RateLimited { retry_after: ra },
            ),
            // Overloaded, with the table's `Retry-After`: pushback (see the test below).
            (
                503,
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
                Outcome::RateLimited { retry_after: ra },
            ),
            (
                400,
                r#"{"error":{"message":"This model's maximum context length is 8192 tokens.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#,
                Outcome::Rejected,
            ),
            (
                400,
                r#"{"error":{"message":"Invalid prompt: flagged","type":"invalid_request_error","param":null,"code":"content_policy_violation"}}"#,
                Outcome::Rejected,
            ),
            (
                400,
                r#"{"error":{"message":"filtered","type":null,"param":"prompt","code":"content_filter","status":400}}"#,
                Outcome::Rejected,
            ),
            (
                500,
                r#"{"error":{"message":"The server had an error","type":"server_error","param":null,"code":null}}"#,
                Outcome::Transient,
            ),
            (400, r#"{"error":"bad request"}"#, Outcome::Rejected),
            (403, r#"{"message":"forbidden"}"#, Outcome::SourceDead),
            // One request over the whole tokens-per-minute limit: waiting never lets
            // it through (OpenAI's 429, Groq's 413, both coded as a rate limit).
            (
                429,
                r#"{"error":{"message":"Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 45000.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#,
                Outcome::Rejected,
            ),
            (
                413,
                r#"{"error":{"message":"Request too large for model `llama-3.1-8b-instant` in organization `org_x` on tokens per minute (TPM): Limit 6000, Requested 9000","type":"tokens","code":"rate_limit_exceeded"}}"#,
                Outcome::Rejected,
            ),
            // A context window said only in the message (vLLM, Anthropic).
            (
                400,
                r#"{"object":"error","message":"This model's maximum context length is 4096 tokens. However, you requested 5000 tokens.","type":"BadRequestError","param":null,"code":400}"#,
                Outcome::Rejected,
            ),
            (
                400,
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#,
                Outcome::Rejected,
            ),
            // OpenRouter's moderation: the request was refused, the key is fine.
            (
                403,
                r#"{"error":{"code":403,"message":"Input required moderation and was flagged","metadata":{"reasons":["violence"]}}}"#,
                Outcome::Rejected,
            ),
            // A feature the source's model lacks (OpenRouter): this request, not the
            // source (it was SourceDead, force-opening the breaker for every caller).
            (
                404,
                r#"{"error":{"message":"No endpoints found that support tool use. To learn more about provider routing, visit: https://openrouter.ai/docs/provider-routing","code":404}}"#,
                Outcome::Rejected,
            ),
            // OpenRouter's "no endpoints" for a data policy serves nobody: by status.
            (
                404,
                r#"{"error":{"message":"No endpoints found matching your data policy.","code":404}}"#,
                Outcome::SourceDead,
            ),
            // Anthropic out of credit: a 400 whose message says so, coded as a bad
            // request. The source is dead (and for long), not the request.
            (
                400,
                r#"{"type":"error","error":{"type":"invalid_request_error","message":"Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing to upgrade or purchase credits."}}"#,
                Outcome::SourceDead,
            ),
            // Gemini's OpenAI-compatible endpoint: a list of one error, `status` for
            // the type. A key that is not one is a dead source.
            (
                400,
                r#"[{"error":{"code":400,"message":"API key not valid. Please pass a valid API key.","status":"INVALID_ARGUMENT","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"API_KEY_INVALID"}]}}]"#,
                Outcome::SourceDead,
            ),
            (
                403,
                r#"[{"error":{"code":403,"message":"Method doesn't allow unregistered callers.","status":"PERMISSION_DENIED"}}]"#,
                Outcome::SourceDead,
            ),
            // An expired key says so in its details' reason (and its message); a
            // region the API does not serve is a precondition of the source. Both
            // were `Rejected` (a 400): every call failed at once, no failover.
            (
                400,
                r#"[{"error":{"code":400,"message":"API key expired. Please renew the API key.","status":"INVALID_ARGUMENT","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"API_KEY_INVALID","domain":"googleapis.com"}]}}]"#,
                Outcome::SourceDead,
            ),
            (
                400,
                r#"[{"error":{"code":400,"message":"The key has expired.","status":"INVALID_ARGUMENT","details":[{"@type":"type.googleapis.com/google.rpc.ErrorInfo","reason":"API_KEY_INVALID"}]}}]"#,
                Outcome::SourceDead,
            ),
            (
                400,
                r#"[{"error":{"code":400,"message":"User location is not supported for the API use.","status":"FAILED_PRECONDITION"}}]"#,
                Outcome::SourceDead,
            ),
            (
                400,
                r#"[{"error":{"code":400,"message":"The input token count (1048577) exceeds the maximum number of tokens allowed (1048576).","status":"INVALID_ARGUMENT"}}]"#,
                Outcome::Rejected,
            ),
            // Groq's flex tier at capacity: overloaded, so pushback when it says when
            // to come back (every row here has a Retry-After), else retried elsewhere.
            (
                498,
                r#"{"error":{"message":"Flex tier capacity exceeded. This is a known issue and we're working on fixing it.","type":"internal_server_error","code":"capacity_exceeded"}}"#,
                Outcome::RateLimited { retry_after: ra },
            ),
            (498, r#"{"error":"busy"}"#, Outcome::Transient),
        ];
        for (i, (status, body, want)) in rows.iter().enumerate() {
            let mut e = UpstreamStatus::new(StatusCode::from_u16(*status).unwrap(), ra, "");
            if let Some(p) = ProviderError::parse(body.as_bytes()) {
                e = e.with_provider(p);
            }
            assert_eq!(classify_upstream(&e), *want, "{status} {body}");
            // The same answer when the model was the source's own: for the first
            // four rows (an unknown model) the source is misconfigured, serving nobody.
            let theirs = e.clone().with_source_model();
            let want_theirs = if i < 4 { Outcome::SourceDead } else { *want };
            assert_eq!(
                classify_upstream(&theirs),
                want_theirs,
                "source model: {status} {body}"
            );
            // Through the error chain, as the layers see it.
            let boxed: BoxError = Box::new(e);
            assert_eq!(classify_error(&*boxed), *want, "{status} {body}");
            // Only billing says the source is dead for long.
            assert_eq!(
                is_quota_exhausted(&*boxed),
                body.contains("insufficient_quota") || body.contains("credit balance is too low"),
                "{status} {body}"
            );
        }
    }

    /// A request too large for the source moves on to another source (it may fit
    /// there) and never holds the account, whatever word its message uses for it.
    #[test]
    fn a_request_too_large_for_the_source_moves_on_and_holds_nothing() {
        let error = |status: u16, body: &str| -> BoxError {
            let e = UpstreamStatus::new(StatusCode::from_u16(status).unwrap(), None, "");
            Box::new(e.with_provider(ProviderError::parse(body.as_bytes()).unwrap()))
        };
        let too_large = error(
            429,
            r#"{"error":{"message":"Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 45000.","type":"tokens","code":"rate_limit_exceeded"}}"#,
        );
        assert!(crate::exceeds_source(&*too_large));
        assert!(!crate::pushback_is_account_wide(&*too_large));
        let vllm = error(
            400,
            r#"{"object":"error","message":"This model's maximum context length is 4096 tokens.","code":400}"#,
        );
        assert!(crate::exceeds_source(&*vllm));
        let gemini = error(
            400,
            r#"[{"error":{"code":400,"message":"The input token count (1048577) exceeds the maximum number of tokens allowed (1048576).","status":"INVALID_ARGUMENT"}}]"#,
        );
        assert!(crate::exceeds_source(&*gemini));
        // The account's own rate limit still holds the account.
        let busy = error(
            429,
            r#"{"error":{"message":"Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Used 29000, Requested 2000.","type":"tokens","code":"rate_limit_exceeded"}}"#,
        );
        assert!(!crate::exceeds_source(&*busy));
        assert!(crate::pushback_is_account_wide(&*busy));
    }

    #[test]
    fn declined_answers_are_successes_and_empty_ones_transient() {
        let parse = |json: &str| -> ChatResponse { serde_json::from_str(json).unwrap() };
        let rows = [
            (
                r#"{"choices":[{"message":{"role":"assistant","content":null},"finish_reason":"content_filter"}]}"#,
                Outcome::Success,
            ),
            (
                r#"{"choices":[{"message":{"role":"assistant","content":null,"refusal":"I can't help with that."},"finish_reason":"stop"}]}"#,
                Outcome::Success,
            ),
            (
                r#"{"choices":[{"message":{"role":"assistant","content":null,"refusal":null},"finish_reason":"stop"}]}"#,
                Outcome::Transient,
            ),
            (
                r#"{"choices":[{"message":{"role":"assistant","content":"","tool_calls":null}}]}"#,
                Outcome::Transient,
            ),
            (
                r#"{"choices":[{"message":{"role":"assistant","content":null,"tool_calls":[{"id":"c"}]}}]}"#,
                Outcome::Success,
            ),
            (r#"{"choices":[]}"#, Outcome::Transient),
            // A reasoning model that spent `max_tokens` thinking: the caller's limit,
            // answered as the provider sent it.
            (
                r#"{"choices":[{"message":{"role":"assistant","content":""},"finish_reason":"length"}],"usage":{"completion_tokens":100,"completion_tokens_details":{"reasoning_tokens":100}}}"#,
                Outcome::Success,
            ),
        ];
        for (json, want) in rows {
            assert_eq!(OpenAiClassifier.classify(&Ok(parse(json))), want, "{json}");
        }
    }

    #[test]
    fn the_callers_error_keeps_the_providers_fields() {
        let body = br#"{"error":{"message":"too long","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#;
        let e = UpstreamStatus::new(StatusCode::BAD_REQUEST, None, "too long")
            .with_provider(ProviderError::parse(body).unwrap());
        assert_eq!(e.code(), Some("context_length_exceeded"));
        assert_eq!(
            e.to_string(),
            "upstream answered 400 Bad Request (context_length_exceeded): too long"
        );
        assert_eq!(
            e.provider().unwrap().to_json(),
            serde_json::from_slice::<serde_json::Value>(body).unwrap()
        );
    }
}
