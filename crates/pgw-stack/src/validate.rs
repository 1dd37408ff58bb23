//! Structured output: a validator refuses an answer, the attempt becomes
//! `Invalid`, and the retry layer re-asks (up to `max_reasks` times, apart from the
//! attempt budget).

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use pgw_core::openai::ChatResponse;
use serde::de::DeserializeOwned;

/// Accepts or refuses an answer. Closures `Fn(&ChatResponse) -> Result<(), String>`
/// implement it.
pub trait Validate: Send + Sync {
    /// `Err(reason)` refuses the answer: the attempt's outcome becomes `Invalid`.
    ///
    /// # Errors
    /// The reason for refusing.
    fn validate(&self, answer: &ChatResponse) -> Result<(), String>;
}

impl<F> Validate for F
where
    F: Fn(&ChatResponse) -> Result<(), String> + Send + Sync,
{
    fn validate(&self, answer: &ChatResponse) -> Result<(), String> {
        self(answer)
    }
}

/// Accepts an answer whose content parses as JSON into `T` (code fences around it
/// are tolerated).
///
/// ```
/// use pgw_stack::{JsonValidator, Validate};
/// use pgw_core::openai::{ChatMessage, ChatResponse, Choice};
///
/// #[derive(serde::Deserialize)]
/// struct Verdict { ok: bool }
///
/// let answer = |text: &str| ChatResponse {
///     choices: vec![Choice::new(0, ChatMessage::new("assistant", text), None)],
///     ..ChatResponse::default()
/// };
/// let v = JsonValidator::<Verdict>::new();
/// assert!(v.validate(&answer("{\"ok\": true}")).is_ok());
/// assert!(v.validate(&answer("```json\n{\"ok\": false}\n```")).is_ok());
/// assert!(v.validate(&answer("sure! here it is")).is_err());
/// ```
pub struct JsonValidator<T>(PhantomData<fn() -> T>);

impl<T> JsonValidator<T> {
    /// A validator for `T`.
    #[must_use]
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

impl<T> Default for JsonValidator<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> fmt::Debug for JsonValidator<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JsonValidator<{}>", std::any::type_name::<T>())
    }
}

/// The JSON part of an answer: the content without surrounding code fences.
#[must_use]
pub fn json_text(content: &str) -> &str {
    let t = content.trim();
    let Some(rest) = t.strip_prefix("```") else {
        return t;
    };
    let rest = rest.strip_prefix("json").unwrap_or(rest);
    rest.strip_suffix("```").unwrap_or(rest).trim()
}

impl<T: DeserializeOwned> JsonValidator<T> {
    /// Parses the answer's content into `T`.
    ///
    /// # Errors
    /// The parse error, as the refusal reason.
    pub fn parse(answer: &ChatResponse) -> Result<T, String> {
        serde_json::from_str(json_text(answer.content()))
            .map_err(|e| format!("content is not the expected JSON: {e}"))
    }
}

impl<T: DeserializeOwned> Validate for JsonValidator<T> {
    fn validate(&self, answer: &ChatResponse) -> Result<(), String> {
        Self::parse(answer).map(drop)
    }
}

/// A validator attached to one call (in [`pgw_client::ChatCall::extensions_mut`]);
/// it overrides the gateway's default validator.
#[derive(Clone)]
pub struct Validator(pub Arc<dyn Validate>);

impl Validator {
    /// Wraps a validator.
    pub fn new(v: impl Validate + 'static) -> Self {
        Self(Arc::new(v))
    }
}

impl fmt::Debug for Validator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Validator")
    }
}
