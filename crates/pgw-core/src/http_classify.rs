//! Classifiers for HTTP and OpenAI-compatible chat completion results.

use std::error::Error;
use std::time::SystemTime;

use http::StatusCode;

use crate::error::{BoxError, EmptyCompletion, InvalidResponse, UpstreamStatus};
use crate::openai::ChatResponse;
use crate::{Classify, Outcome};

/// The outcome of an HTTP status (with its parsed `Retry-After` hint).
///
/// | status | outcome |
/// |---|---|
/// | 2xx | `Success` |
/// | 429 | `RateLimited { retry_after }` |
/// | 401, 402, 403, 404 | `SourceDead` (bad or revoked key, no credit, unknown model or path: nobody gets through this source) |
/// | 408, 409, 425 | `Transient` (timing, may pass on a retry) |
/// | 400, 413, 422 and other 4xx | `Rejected` (the request itself is bad) |
/// | 5xx, 1xx, 3xx | `Transient` |
#[must_use]
pub fn classify_status(status: StatusCode, retry_after: Option<std::time::Duration>) -> Outcome {
    match status.as_u16() {
        200..=299 => Outcome::Success,
        429 => Outcome::RateLimited { retry_after },
        401..=404 => Outcome::SourceDead,
        408 | 409 | 425 => Outcome::Transient,
        400..=499 => Outcome::Rejected,
        _ => Outcome::Transient,
    }
}

/// The outcome of an attempt that ended in an error: walks the source chain for an
/// [`UpstreamStatus`] (classified by [`classify_status`]), an [`InvalidResponse`]
/// (`Invalid`) or an [`EmptyCompletion`] (`Transient`); anything else (timeouts,
/// connect errors, resets, watchdog cuts, garbage bytes) is `Transient`.
#[must_use]
pub fn classify_error(err: &(dyn Error + 'static)) -> Outcome {
    let mut cur: Option<&(dyn Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(s) = e.downcast_ref::<UpstreamStatus>() {
            return classify_status(s.status(), s.retry_after());
        }
        if e.is::<InvalidResponse>() {
            return Outcome::Invalid;
        }
        if e.is::<EmptyCompletion>() {
            return Outcome::Transient;
        }
        cur = e.source();
    }
    Outcome::Transient
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

/// Classifies parsed chat completion answers: an empty completion is `Transient`,
/// any other answer `Success`; errors by [`classify_error`].
#[derive(Clone, Copy, Debug, Default)]
pub struct OpenAiClassifier;

impl Classify<ChatResponse, BoxError> for OpenAiClassifier {
    fn classify(&self, result: &Result<ChatResponse, BoxError>) -> Outcome {
        match result {
            Ok(resp) if resp.is_empty_completion() => Outcome::Transient,
            Ok(_) => Outcome::Success,
            Err(e) => classify_error(&**e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::{ChatMessage, Choice};
    use std::time::Duration;

    fn answer(text: &str) -> ChatResponse {
        ChatResponse {
            choices: vec![Choice {
                index: 0,
                message: ChatMessage::new("assistant", text),
                finish_reason: Some("stop".into()),
            }],
            ..ChatResponse::default()
        }
    }

    fn status_err(code: u16, ra: Option<Duration>) -> BoxError {
        Box::new(UpstreamStatus::new(StatusCode::from_u16(code).unwrap(), ra, "x"))
    }

    /// One row per line of DESIGN.md section 2, through the OpenAI classifier.
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
}
