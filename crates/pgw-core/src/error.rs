//! Small public error types shared by the layers.
//!
//! Layers that create errors return [`BoxError`]; callers check them with
//! `err.downcast_ref::<CircuitOpen>()` or `err.is::<Paced>()`, like tower's
//! `load_shed::error::Overloaded`. The three *not admitted* errors
//! ([`CircuitOpen`], [`QuotaExceeded`], [`Paced`]) mean a gate refused **before**
//! dispatch: no attempt was made and nothing was spent; [`NotAdmitted::of`] recognises
//! them anywhere in an error's source chain.

use std::error::Error;
use std::fmt;
use std::time::Duration;

use crate::SourceId;

/// The boxed error type used by every layer that creates errors.
pub type BoxError = Box<dyn Error + Send + Sync>;

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// A circuit breaker is open: the source is not admitted until `retry_after` elapses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CircuitOpen {
    source: Option<SourceId>,
    retry_after: Duration,
}

impl CircuitOpen {
    /// A new error for a circuit that opens again for business in `retry_after`.
    #[must_use]
    pub const fn new(retry_after: Duration) -> Self {
        Self {
            source: None,
            retry_after,
        }
    }

    /// Names the source whose circuit is open.
    #[must_use]
    pub fn with_source(mut self, source: SourceId) -> Self {
        self.source = Some(source);
        self
    }

    /// Time until the breaker admits again.
    #[must_use]
    pub const fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// The source whose circuit is open, when known.
    #[must_use]
    pub const fn source(&self) -> Option<&SourceId> {
        self.source.as_ref()
    }
}

impl fmt::Display for CircuitOpen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("circuit open")?;
        if let Some(s) = &self.source {
            write!(f, " for source {s}")?;
        }
        write!(f, "; retry after {:.3}s", secs(self.retry_after))
    }
}

impl Error for CircuitOpen {}

/// A quota (requests, tokens, concurrency or a hold) is full: not admitted until
/// `retry_after` elapses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaExceeded {
    scope: Option<String>,
    dimension: &'static str,
    retry_after: Duration,
    after_overload: bool,
}

impl QuotaExceeded {
    /// A new error: `dimension` (`"rpm"`, `"tpm"`, `"concurrency"`, `"hold"`) is full
    /// for `retry_after`.
    #[must_use]
    pub const fn new(dimension: &'static str, retry_after: Duration) -> Self {
        Self {
            scope: None,
            dimension,
            retry_after,
            after_overload: false,
        }
    }

    /// Marks a `hold` placed after an overloaded provider's pushback (a 5xx such as
    /// 503 or 529 with `Retry-After`), not after a rate limit: a call refused by it
    /// waits on the provider's capacity, not on a quota (a server answers 503, not
    /// 429). See [`Hold::hold_after_overload`](crate::Hold::hold_after_overload).
    #[must_use]
    pub const fn after_overload(mut self) -> Self {
        self.after_overload = true;
        self
    }

    /// Whether this is a `hold` placed after an overloaded provider's pushback
    /// ([`after_overload`](Self::after_overload)).
    #[must_use]
    pub const fn is_after_overload(&self) -> bool {
        self.after_overload
    }

    /// Names the scope (a source or an account) whose quota is full.
    #[must_use]
    pub fn with_scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// Time until the quota may admit again.
    #[must_use]
    pub const fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// Which dimension refused: `rpm`, `tpm`, `concurrency` or `hold`.
    #[must_use]
    pub const fn dimension(&self) -> &'static str {
        self.dimension
    }

    /// The scope whose quota is full, when known.
    #[must_use]
    pub fn scope(&self) -> Option<&str> {
        self.scope.as_deref()
    }
}

impl fmt::Display for QuotaExceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "quota exceeded ({})", self.dimension)?;
        if self.after_overload {
            f.write_str(" after the provider was overloaded")?;
        }
        if let Some(s) = &self.scope {
            write!(f, " for {s}")?;
        }
        write!(f, "; retry after {:.3}s", secs(self.retry_after))
    }
}

impl Error for QuotaExceeded {}

/// The adaptive concurrency limit is reached: not admitted now, try another source
/// or wait for an attempt in flight to finish.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Paced {
    source: Option<SourceId>,
}

impl Paced {
    /// A new error.
    #[must_use]
    pub const fn new() -> Self {
        Self { source: None }
    }

    /// Names the paced source.
    #[must_use]
    pub fn with_source(mut self, source: SourceId) -> Self {
        self.source = Some(source);
        self
    }

    /// The paced source, when known.
    #[must_use]
    pub const fn source(&self) -> Option<&SourceId> {
        self.source.as_ref()
    }
}

impl fmt::Display for Paced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("paced: concurrency limit reached")?;
        if let Some(s) = &self.source {
            write!(f, " for source {s}")?;
        }
        Ok(())
    }
}

impl Error for Paced {}

/// How long a caller waits before asking a gate again after the gate's own backend
/// failed ([`NotAdmitted::Unavailable`]): 1 s, a few Redis reconnect attempts (the
/// connection's own timeouts are 0.5 s for a response and 2 s for a connect).
pub const UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Which gate refused, and until when: the not-admitted errors as one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotAdmitted {
    /// A [`CircuitOpen`] with its `retry_after`.
    CircuitOpen(Duration),
    /// A [`QuotaExceeded`] with its `retry_after`.
    QuotaExceeded(Duration),
    /// A [`Paced`]: admissible as soon as an attempt in flight ends.
    Paced,
    /// A [`BackendUnavailable`]: the gate failed closed because its own backend (Redis)
    /// did not answer. The gate's failure, never an outcome of the source: no breaker
    /// or health sample, no attempt spent; ask again after
    /// [`UNAVAILABLE_RETRY_AFTER`].
    Unavailable,
    /// A [`NeverAdmitted`]: this gate can never admit the request (larger than a whole
    /// window's quota). Another source may; when none can, the call fails at once.
    /// Never an outcome of the source, no attempt spent.
    Never,
}

/// The marker of a gate's refusal that waiting cannot cure (a request larger than a
/// whole window's token quota): [`NotAdmitted::Never`]. A gate's own error gives it as
/// its `source()` (tower-ratelimit-redis's `RequestTooLarge` does).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NeverAdmitted;

impl fmt::Display for NeverAdmitted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("never admitted by this gate")
    }
}

impl Error for NeverAdmitted {}

impl NotAdmitted {
    /// Finds a not-admitted error in `err` or its source chain.
    #[must_use]
    pub fn of(err: &(dyn Error + 'static)) -> Option<Self> {
        let mut cur: Option<&(dyn Error + 'static)> = Some(err);
        while let Some(e) = cur {
            if let Some(c) = e.downcast_ref::<CircuitOpen>() {
                return Some(Self::CircuitOpen(c.retry_after));
            }
            if let Some(q) = e.downcast_ref::<QuotaExceeded>() {
                return Some(Self::QuotaExceeded(q.retry_after));
            }
            if e.is::<Paced>() {
                return Some(Self::Paced);
            }
            if e.is::<BackendUnavailable>() {
                return Some(Self::Unavailable);
            }
            if e.is::<NeverAdmitted>() {
                return Some(Self::Never);
            }
            cur = e.source();
        }
        None
    }

    /// The time after which the gate may admit, if it said (`Paced` does not; an
    /// unavailable backend is asked again after [`UNAVAILABLE_RETRY_AFTER`]).
    #[must_use]
    pub const fn retry_after(self) -> Option<Duration> {
        match self {
            Self::CircuitOpen(d) | Self::QuotaExceeded(d) => Some(d),
            Self::Unavailable => Some(UNAVAILABLE_RETRY_AFTER),
            Self::Paced | Self::Never => None,
        }
    }
}

/// A shared-state backend (Redis) could not be reached or answered garbage.
///
/// Admission fails closed with this error; recording degrades to a warning.
#[derive(Debug)]
pub struct BackendUnavailable {
    backend: &'static str,
    operation: &'static str,
    cause: BoxError,
}

impl BackendUnavailable {
    /// A new error: `operation` on `backend` failed because of `cause`.
    pub fn new(backend: &'static str, operation: &'static str, cause: impl Into<BoxError>) -> Self {
        Self {
            backend,
            operation,
            cause: cause.into(),
        }
    }

    /// The backend's name (`redis`).
    #[must_use]
    pub const fn backend(&self) -> &'static str {
        self.backend
    }

    /// What was being done (`admit`, `record`, `hold`, ...).
    #[must_use]
    pub const fn operation(&self) -> &'static str {
        self.operation
    }
}

impl fmt::Display for BackendUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} backend unavailable during {}: {}",
            self.backend, self.operation, self.cause
        )
    }
}

impl Error for BackendUnavailable {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.cause)
    }
}

/// The error a provider wrote in a non-2xx body, field by field.
///
/// Read from OpenAI's `{"error":{"message","type","param","code"}}`, Anthropic's
/// `{"type":"error","error":{"type","message"}}`, a bare `{"error":"..."}` or
/// `{"message":"..."}`. A numeric `code` is kept as its decimal text.
///
/// ```
/// use pgw_core::ProviderError;
///
/// let e = ProviderError::parse(br#"{"error":{"message":"The model `gpt-5o` does not exist","type":"invalid_request_error","param":null,"code":"model_not_found"}}"#).unwrap();
/// assert_eq!(e.code.as_deref(), Some("model_not_found"));
/// assert_eq!(e.kind.as_deref(), Some("invalid_request_error"));
/// assert_eq!(e.param, None);
/// let e = ProviderError::parse(br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#).unwrap();
/// assert_eq!(e.kind.as_deref(), Some("overloaded_error"));
/// assert_eq!(ProviderError::parse(b"<html>502</html>"), None);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProviderError {
    /// `message`.
    pub message: String,
    /// `type` (`invalid_request_error`, `insufficient_quota`, `overloaded_error`, ...).
    pub kind: Option<String>,
    /// `code` (`model_not_found`, `context_length_exceeded`, `invalid_api_key`, ...).
    pub code: Option<String>,
    /// `param`: the request field at fault (`messages`, `model`, ...).
    pub param: Option<String>,
}

/// The first `reason` in a Google error's `details` (`google.rpc.ErrorInfo`) that pgw
/// knows the meaning of.
fn google_reason(e: &serde_json::Value) -> Option<String> {
    e.get("details")?
        .as_array()?
        .iter()
        .filter_map(|d| d.get("reason")?.as_str())
        .find(|r| crate::http_classify::is_known_code(r))
        .map(str::to_owned)
}

impl ProviderError {
    /// Reads the error of an error body; `None` when the body is not a JSON error.
    ///
    /// Takes OpenAI's `{"error": {...}}` (and a bare string `error`), Anthropic's
    /// `{"type": "error", "error": {...}}`, a top-level `message`, and Gemini's
    /// OpenAI-compatible endpoint's list of one, `[{"error": {"code": 400, "message":
    /// ..., "status": "INVALID_ARGUMENT"}}]`, whose `status` stands for the `type` and
    /// whose `details[].reason` (`API_KEY_INVALID`), when there is one, for a numeric
    /// `code`.
    #[must_use]
    pub fn parse(body: &[u8]) -> Option<Self> {
        let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
        if let serde_json::Value::Array(items) = &mut v {
            // Gemini's list of errors: the first one.
            v = std::mem::take(items.first_mut()?);
        }
        let text = |v: Option<&serde_json::Value>| match v? {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Number(n) => Some(n.to_string()),
            _ => None,
        };
        match v.get("error") {
            Some(serde_json::Value::String(s)) => Some(Self {
                message: s.clone(),
                ..Self::default()
            }),
            Some(e @ serde_json::Value::Object(_)) => Some(Self {
                message: text(e.get("message")).unwrap_or_else(|| e.to_string()),
                kind: text(e.get("type")).or_else(|| text(e.get("status"))),
                // Google's numeric `code` is the HTTP status again: the reason of its
                // `details`, when it is one pgw knows (`API_KEY_INVALID`), is the code
                // that says something. Another reason leaves the number, which an error
                // inside a 2xx answer is given as its status.
                code: match e.get("code") {
                    None | Some(serde_json::Value::Number(_)) => {
                        google_reason(e).or_else(|| text(e.get("code")))
                    }
                    code => text(code),
                },
                param: text(e.get("param")),
            }),
            _ => Some(Self {
                message: text(v.get("message"))?,
                kind: text(v.get("type")).filter(|t| t != "error"),
                code: text(v.get("code")),
                param: None,
            }),
        }
    }

    /// The error as an OpenAI-style body, `{"error":{"message","type","param","code"}}`,
    /// for handing it to the caller as the provider wrote it.
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// An upstream answered with a non-success HTTP status.
///
/// Carried as an error so the classifier can see the status, the `Retry-After` hint
/// and the provider's error code through any number of layers
/// ([`UpstreamStatus::find`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamStatus {
    status: http::StatusCode,
    retry_after: Option<Duration>,
    message: String,
    provider: Option<ProviderError>,
    source_model: bool,
    headroom: Option<crate::headroom::Headroom>,
}

impl UpstreamStatus {
    /// A new error for `status`; `message` is the provider's error text (never a key).
    pub fn new(status: http::StatusCode, retry_after: Option<Duration>, message: impl Into<String>) -> Self {
        Self {
            status,
            retry_after,
            message: message.into(),
            provider: None,
            source_model: false,
            headroom: None,
        }
    }

    /// Marks the request's model as the source's own (configured for the source,
    /// replacing the caller's): an unknown model is then the source's fault, not the
    /// caller's.
    #[must_use]
    pub const fn with_source_model(mut self) -> Self {
        self.source_model = true;
        self
    }

    /// Whether the request's model was the source's own ([`Self::with_source_model`]).
    #[must_use]
    pub const fn is_source_model(&self) -> bool {
        self.source_model
    }

    /// Attaches the provider's error as its body said it (its message should be
    /// scrubbed of keys by whoever read it).
    #[must_use]
    pub fn with_provider(mut self, provider: ProviderError) -> Self {
        self.provider = Some(provider);
        self
    }

    /// Attaches what the answer's `x-ratelimit-*` headers said is left of the
    /// provider's limits ([`crate::headroom`]): on a 429, usually nothing.
    #[must_use]
    pub const fn with_headroom(mut self, headroom: Option<crate::headroom::Headroom>) -> Self {
        self.headroom = headroom;
        self
    }

    /// What the answer's `x-ratelimit-*` headers said is left, when they were there.
    #[must_use]
    pub const fn headroom(&self) -> Option<crate::headroom::Headroom> {
        self.headroom
    }

    /// Finds an `UpstreamStatus` in `err` or its source chain.
    #[must_use]
    pub fn find<'a>(err: &'a (dyn Error + 'static)) -> Option<&'a Self> {
        let mut cur: Option<&(dyn Error + 'static)> = Some(err);
        while let Some(e) = cur {
            if let Some(s) = e.downcast_ref::<Self>() {
                return Some(s);
            }
            cur = e.source();
        }
        None
    }

    /// The HTTP status.
    #[must_use]
    pub const fn status(&self) -> http::StatusCode {
        self.status
    }

    /// The wait the upstream asked for: its parsed `Retry-After`, or one it named
    /// otherwise ([`Self::with_retry_after`]).
    #[must_use]
    pub const fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Sets the wait the upstream asked for when it said so otherwise than with
    /// `Retry-After`: in its message ("Please try again in 4s",
    /// [`crate::retry_after::from_message`]) or in its `x-ratelimit-*` headers
    /// ([`crate::headroom`]). `None` leaves the status without a hint.
    #[must_use]
    pub const fn with_retry_after(mut self, retry_after: Option<Duration>) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// The provider's error message.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The provider's error, when the body was a JSON error.
    #[must_use]
    pub const fn provider(&self) -> Option<&ProviderError> {
        self.provider.as_ref()
    }

    /// The provider's error `code`, if any.
    #[must_use]
    pub fn code(&self) -> Option<&str> {
        self.provider.as_ref()?.code.as_deref()
    }
}

impl fmt::Display for UpstreamStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "upstream answered {}", self.status)?;
        if let Some(name) = self
            .provider
            .as_ref()
            .and_then(|p| p.code.as_deref().or(p.kind.as_deref()))
        {
            write!(f, " ({name})")?;
        }
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

impl Error for UpstreamStatus {}

/// A response arrived but the caller's validator refused it (outcome `Invalid`).
/// The provider still billed it: its usage, when the answer reported one, stays
/// with the error for telemetry and for the token quota's settle.
///
/// ```
/// use pgw_core::InvalidResponse;
/// use pgw_core::openai::Usage;
/// let usage = Usage { prompt_tokens: 9, completion_tokens: 30, total_tokens: 39, ..Usage::default() };
/// let e = InvalidResponse::new("not json").with_usage(Some(usage.clone()));
/// assert_eq!((e.reason(), e.usage()), ("not json", Some(&usage)));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidResponse {
    reason: String,
    usage: Option<crate::openai::Usage>,
}

impl InvalidResponse {
    /// A new error with the validator's reason.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            usage: None,
        }
    }

    /// The refused answer's usage, as it reported it.
    #[must_use]
    pub fn with_usage(mut self, usage: Option<crate::openai::Usage>) -> Self {
        self.usage = usage;
        self
    }

    /// Why the validator refused the answer.
    #[must_use]
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// The refused answer's usage, if it reported one.
    #[must_use]
    pub const fn usage(&self) -> Option<&crate::openai::Usage> {
        self.usage.as_ref()
    }

    /// The usage of the refused answer in `err`'s chain, if any.
    #[must_use]
    pub fn usage_in<'a>(err: &'a (dyn Error + 'static)) -> Option<&'a crate::openai::Usage> {
        let mut cur = Some(err);
        while let Some(e) = cur {
            if let Some(i) = e.downcast_ref::<Self>() {
                return i.usage();
            }
            cur = e.source();
        }
        None
    }
}

impl fmt::Display for InvalidResponse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid response: {}", self.reason)
    }
}

impl Error for InvalidResponse {}

/// An upstream answered 2xx but with no completion (no content, no tool call, no
/// refusal or content-filter verdict): classified `Transient`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmptyCompletion;

impl fmt::Display for EmptyCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("empty completion")
    }
}

impl Error for EmptyCompletion {}

/// A bad configuration value, naming the component and the field.
///
/// Every layer validates its configuration when it is built and answers this error
/// (never a panic later): `field()` is the field as spelled in the layer's config
/// (`fail_threshold`, `source.requests`, `max_attempts`, ...).
///
/// ```
/// let e = pgw_core::ConfigError::new("breaker", "cooldown_s", "must be positive");
/// assert_eq!(e.field(), "cooldown_s");
/// assert_eq!(e.to_string(), "invalid breaker config: cooldown_s: must be positive");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    component: &'static str,
    field: std::borrow::Cow<'static, str>,
    reason: std::borrow::Cow<'static, str>,
}

impl ConfigError {
    /// A new error: `field` of `component`'s configuration is wrong because `reason`.
    pub fn new(
        component: &'static str,
        field: impl Into<std::borrow::Cow<'static, str>>,
        reason: impl Into<std::borrow::Cow<'static, str>>,
    ) -> Self {
        Self {
            component,
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The component whose configuration is wrong (`breaker`, `aimd`, ...).
    #[must_use]
    pub const fn component(&self) -> &'static str {
        self.component
    }

    /// The offending field.
    #[must_use]
    pub fn field(&self) -> &str {
        &self.field
    }

    /// What is wrong with it.
    #[must_use]
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid {} config: {}: {}",
            self.component, self.field, self.reason
        )
    }
}

impl Error for ConfigError {}

/// Whether `err`'s chain says the request does not fit the source that answered: the
/// provider's `context_length_exceeded`, or an error message saying so (vLLM's and
/// OpenAI's "maximum context length", Anthropic's "prompt is too long", OpenAI's
/// "Request too large ... on tokens per min"). The request is not wrong everywhere: a source
/// with a larger context window may take it, so the call spends an attempt and moves
/// on (that source last for this call) instead of failing at once. Still `Rejected`
/// for the breaker and health: the source is fine.
///
/// ```
/// use pgw_core::{BoxError, ProviderError, UpstreamStatus, exceeds_source};
/// let body = br#"{"error":{"message":"too long","param":"messages","code":"context_length_exceeded"}}"#;
/// let provider = ProviderError::parse(body).unwrap();
/// let e: BoxError = Box::new(
///     UpstreamStatus::new(http::StatusCode::BAD_REQUEST, None, "too long").with_provider(provider),
/// );
/// assert!(exceeds_source(&*e));
/// let other: BoxError = Box::new(UpstreamStatus::new(http::StatusCode::BAD_REQUEST, None, "bad"));
/// assert!(!exceeds_source(&*other));
/// ```
#[must_use]
pub fn exceeds_source(err: &(dyn Error + 'static)) -> bool {
    UpstreamStatus::find(err).is_some_and(|s| {
        s.code() == Some("context_length_exceeded")
            || crate::http_classify::names_a_request_too_large(
                s.provider().map_or(s.message(), |p| &p.message),
            )
    })
}

/// Whether the provider said a 429 in `err`'s chain is its account's limit, not the
/// key's or the deployment's: its message names the organization or the account
/// (OpenAI: "Rate limit reached for gpt-4o in organization org-... on requests per
/// min"), or its error `type` is `tokens`/`requests` with such a message. Only then is
/// the pushback hold applied to every source of the account; otherwise to the source
/// alone (a key's own RPM gate says nothing about its siblings).
#[must_use]
pub fn pushback_is_account_wide(err: &(dyn Error + 'static)) -> bool {
    let Some(s) = UpstreamStatus::find(err) else {
        return false;
    };
    if exceeds_source(err) {
        // One request too large for the account's limit says nothing of its load.
        return false;
    }
    let says = |text: &str| {
        let t = text.to_ascii_lowercase();
        t.contains("organization") || t.contains("account")
    };
    s.provider().is_some_and(|p| says(&p.message)) || says(s.message())
}

/// An attempt ran out of time: a connect, first-token, inter-token or total timeout.
///
/// The marker a timeout carries in its error chain so any layer can tell it from other
/// transient failures without knowing the client's own error types: `pgw-client`'s
/// watchdog cuts give it as their `source()`. See [`is_timeout`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TimedOut;

impl fmt::Display for TimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("timed out")
    }
}

impl Error for TimedOut {}

/// Whether `err`'s chain says the attempt timed out: a [`TimedOut`] anywhere in it, an
/// `io::Error` of kind `TimedOut`, or tokio's `Elapsed`. A timeout moves the call's
/// next attempt to another source (retrying a silent source multiplies the wait).
///
/// ```
/// use pgw_core::{BoxError, TimedOut, is_timeout};
/// let io: BoxError = Box::new(std::io::Error::from(std::io::ErrorKind::TimedOut));
/// assert!(is_timeout(&*io));
/// assert!(is_timeout(&TimedOut));
/// let reset: BoxError = Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
/// assert!(!is_timeout(&*reset));
/// ```
#[must_use]
pub fn is_timeout(err: &(dyn Error + 'static)) -> bool {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if e.is::<TimedOut>() || e.is::<tokio::time::error::Elapsed>() {
            return true;
        }
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        cur = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    /// A Google error's numeric code gives way to the first reason of its details that
    /// pgw knows; an unknown reason leaves the number (an error inside a 2xx answer
    /// takes it as its status).
    #[test]
    fn a_google_reason_stands_for_the_code_only_when_known() {
        let body = |reasons: &str| {
            format!(
                r#"[{{"error":{{"code":400,"message":"m","status":"INVALID_ARGUMENT","details":[{reasons}]}}}}]"#
            )
        };
        let code = |b: String| ProviderError::parse(b.as_bytes()).unwrap().code;
        assert_eq!(
            code(body(r#"{"reason":"SOMETHING_NEW"}"#)).as_deref(),
            Some("400")
        );
        assert_eq!(
            code(body(r#"{"reason":"SOMETHING_NEW"},{"reason":"API_KEY_INVALID"}"#)).as_deref(),
            Some("API_KEY_INVALID")
        );
        assert_eq!(code(body(r#"{"@type":"x"}"#)).as_deref(), Some("400"));
    }

    use super::*;

    #[derive(Debug)]
    struct Wrap(BoxError);
    impl fmt::Display for Wrap {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("wrapped")
        }
    }
    impl Error for Wrap {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&*self.0)
        }
    }

    #[test]
    fn not_admitted_found_through_source_chain() {
        let e = Wrap(Box::new(QuotaExceeded::new("rpm", Duration::from_secs(2))));
        assert_eq!(
            NotAdmitted::of(&e),
            Some(NotAdmitted::QuotaExceeded(Duration::from_secs(2)))
        );
        let boxed: BoxError = Box::new(CircuitOpen::new(Duration::from_millis(5)));
        assert_eq!(
            NotAdmitted::of(&*boxed).and_then(NotAdmitted::retry_after),
            Some(Duration::from_millis(5))
        );
        assert_eq!(NotAdmitted::of(&Paced::new()), Some(NotAdmitted::Paced));
        assert_eq!(NotAdmitted::of(&EmptyCompletion), None);
        // A gate's own backend failure, even wrapped, is not admitted, not an outcome.
        let down = Wrap(Box::new(BackendUnavailable::new("redis", "admit", "refused")));
        assert_eq!(NotAdmitted::of(&down), Some(NotAdmitted::Unavailable));
        assert_eq!(
            NotAdmitted::Unavailable.retry_after(),
            Some(UNAVAILABLE_RETRY_AFTER)
        );
        assert_eq!(
            NotAdmitted::of(&Wrap(Box::new(NeverAdmitted))),
            Some(NotAdmitted::Never)
        );
        assert_eq!(NotAdmitted::Never.retry_after(), None);
    }

    #[test]
    fn display_is_lowercase_and_names_the_source() {
        let e = CircuitOpen::new(Duration::from_millis(1500)).with_source("s1".into());
        assert_eq!(e.to_string(), "circuit open for source s1; retry after 1.500s");
        let q = QuotaExceeded::new("tpm", Duration::ZERO).with_scope("account:a");
        assert_eq!(
            q.to_string(),
            "quota exceeded (tpm) for account:a; retry after 0.000s"
        );
    }

    #[test]
    fn a_429_is_account_wide_only_when_the_provider_names_the_account() {
        let status =
            |msg: &str| UpstreamStatus::new(http::StatusCode::TOO_MANY_REQUESTS, None, msg.to_owned());
        let org = status("Rate limit reached for gpt-4o in organization org-abc on requests per min (RPM)");
        assert!(pushback_is_account_wide(&org));
        assert!(pushback_is_account_wide(&status(
            "Rate limit reached for account acct-a. Please slow down."
        )));
        assert!(!pushback_is_account_wide(&status(
            "Rate limit reached for requests on source s4"
        )));
        assert!(!pushback_is_account_wide(&status("Too Many Requests")));
        assert!(!pushback_is_account_wide(&QuotaExceeded::new(
            "rpm",
            Duration::from_secs(1)
        )));
    }
}
