//! What the client needs to know about one source.

use std::fmt;
use std::time::Duration;

use pgw_core::SourceId;

use crate::SecretKey;

/// Default connect timeout: 10 s. A TCP/TLS handshake to a live provider takes
/// milliseconds; ten seconds only passes through an overloaded network.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time to first token: 60 s. Large prompts (~300 KB) take tens of seconds of
/// prefill before the first token.
pub const DEFAULT_FIRST_TOKEN_TIMEOUT: Duration = Duration::from_secs(60);
/// Default inter-token stall: 30 s without a chunk once the answer started.
pub const DEFAULT_INTER_TOKEN_TIMEOUT: Duration = Duration::from_secs(30);
/// Default total time of one attempt: 600 s. Calls last seconds to minutes, and
/// 64k-token answers take minutes.
pub const DEFAULT_TOTAL_TIMEOUT: Duration = Duration::from_secs(600);

/// `at + d`, saturating: a `Duration::MAX` timeout means "never".
pub(crate) use pgw_core::clock::saturating_after as after;

/// The four timeouts of one attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// Connecting (TCP + TLS), enforced by the transport ([`crate::HyperTransport`]).
    pub connect: Duration,
    /// From dispatch to the first token of a streamed answer (the response head
    /// included). Non-streamed answers arrive in one piece and are bounded by `total`.
    pub first_token: Duration,
    /// Longest gap between two chunks of a streamed answer once it started (and
    /// between two body frames of a non-streamed one once its head arrived).
    pub inter_token: Duration,
    /// The whole attempt, head to last byte.
    pub total: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            connect: DEFAULT_CONNECT_TIMEOUT,
            first_token: DEFAULT_FIRST_TOKEN_TIMEOUT,
            inter_token: DEFAULT_INTER_TOKEN_TIMEOUT,
            total: DEFAULT_TOTAL_TIMEOUT,
        }
    }
}

/// The settings of one source as the client needs them: where, with which key and
/// model, and how long to wait.
#[derive(Clone)]
pub struct SourceSettings {
    /// The source's name (telemetry, errors).
    pub id: SourceId,
    /// Base URL, e.g. `https://api.openai.com/v1`; the client posts to
    /// `{base_url}/chat/completions`.
    pub base_url: String,
    /// The API key, sent as [`key_header`](Self::key_header) says; `None` sends no
    /// header.
    pub key: Option<SecretKey>,
    /// How the key is sent: `authorization: Bearer <key>`, or Azure OpenAI's
    /// `api-key: <key>` (what [`SourceSettings::new`] picks for an Azure host).
    pub key_header: KeyHeader,
    /// Replaces the request's `model` when set (sources of one group may name the
    /// same model differently).
    pub model: Option<String>,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// Whether a streamed request asks for the usage chunk
    /// (`stream_options.include_usage`, default `true`), so the token quota settles to
    /// the provider's usage. `false` for a server that refuses the field (older Azure
    /// OpenAI API versions answer 400): streamed calls then settle to the estimate, and
    /// a caller's own `stream_options` go as they came.
    pub ask_stream_usage: bool,
}

impl SourceSettings {
    /// Settings for `id` at `base_url`, no key, no model override, default timeouts;
    /// the key header the host calls for ([`KeyHeader::for_base_url`]).
    pub fn new(id: impl Into<SourceId>, base_url: impl Into<String>) -> Self {
        let base_url = base_url.into();
        Self {
            id: id.into(),
            key_header: KeyHeader::for_base_url(&base_url),
            base_url,
            key: None,
            model: None,
            timeouts: Timeouts::default(),
            ask_stream_usage: true,
        }
    }

    /// Sets [`SourceSettings::ask_stream_usage`].
    #[must_use]
    pub const fn ask_stream_usage(mut self, ask: bool) -> Self {
        self.ask_stream_usage = ask;
        self
    }

    /// Sets the key.
    #[must_use]
    pub fn key(mut self, key: SecretKey) -> Self {
        self.key = Some(key);
        self
    }

    /// Sets how the key is sent.
    #[must_use]
    pub fn key_header(mut self, header: KeyHeader) -> Self {
        self.key_header = header;
        self
    }

    /// Sets the model override.
    #[must_use]
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = Some(model.into());
        self
    }

    /// Sets the timeouts.
    #[must_use]
    pub fn timeouts(mut self, timeouts: Timeouts) -> Self {
        self.timeouts = timeouts;
        self
    }

    /// The header carrying the key (`Authorization: Bearer KEY`, or the named header
    /// with the key alone), marked sensitive; `None` without a key. `pgw check` calls
    /// it, so a key that cannot be sent fails there, as the client would.
    ///
    /// # Errors
    /// [`BadSettings`] naming `key` when it is not a valid header value (a control
    /// character, a trailing newline from a secret file).
    pub fn authorization(&self) -> Result<Option<(http::HeaderName, http::HeaderValue)>, BadSettings> {
        let Some(key) = &self.key else {
            return Ok(None);
        };
        let (name, value) = match &self.key_header {
            KeyHeader::Bearer => (http::header::AUTHORIZATION, format!("Bearer {}", key.expose())),
            KeyHeader::Named(name) => (name.clone(), key.expose().to_owned()),
        };
        let mut v = http::HeaderValue::try_from(value).map_err(|_| {
            BadSettings::new(
                &self.id,
                "key",
                "contains characters not allowed in a header (a trailing newline?)",
            )
        })?;
        v.set_sensitive(true);
        Ok(Some((name, v)))
    }

    /// The URL the client posts to: `base_url` with `/chat/completions` added to its
    /// path; a query (Azure's `?api-version=...`) stays after it.
    ///
    /// # Errors
    /// [`BadSettings`] naming `base_url` when it is not an absolute http(s) URL.
    pub fn endpoint(&self) -> Result<http::Uri, BadSettings> {
        let (path, query) = match self.base_url.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (self.base_url.as_str(), None),
        };
        let base = path.trim_end_matches('/');
        let url = match query {
            Some(q) => format!("{base}/chat/completions?{q}"),
            None => format!("{base}/chat/completions"),
        };
        let uri: http::Uri = url.parse().map_err(|e| {
            BadSettings::new(
                &self.id,
                "base_url",
                format!(
                    "{:?} is not a URL: {e}",
                    pgw_core::redact::redact_endpoint(&self.base_url)
                ),
            )
        })?;
        match uri.scheme_str() {
            Some("http" | "https") if uri.authority().is_some() => Ok(uri),
            _ => Err(BadSettings::new(
                &self.id,
                "base_url",
                format!(
                    "{:?} must be an absolute http:// or https:// URL",
                    pgw_core::redact::redact_endpoint(&self.base_url)
                ),
            )),
        }
    }
}

impl fmt::Debug for SourceSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SourceSettings")
            .field("id", &self.id)
            .field("base_url", &pgw_core::redact::redact_endpoint(&self.base_url))
            .field("key", &self.key)
            .field("key_header", &self.key_header)
            .field("model", &self.model)
            .field("timeouts", &self.timeouts)
            .finish()
    }
}

/// How a source's key is sent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum KeyHeader {
    /// `authorization: Bearer <key>`: OpenAI and most compatible servers.
    #[default]
    Bearer,
    /// `<name>: <key>`: Azure OpenAI's `api-key`, a gateway's `x-api-key`.
    Named(http::HeaderName),
}

impl KeyHeader {
    /// Azure OpenAI's header, `api-key`.
    #[must_use]
    pub fn azure() -> Self {
        Self::Named(http::HeaderName::from_static("api-key"))
    }

    /// What the host of `base_url` calls for: [`azure`](Self::azure) for Azure OpenAI
    /// (`*.openai.azure.com`, `*.cognitiveservices.azure.com`, and the Government
    /// and China clouds' `*.openai.azure.us`, `*.openai.azure.cn`: they answer a bearer
    /// API key 401), else [`Bearer`](Self::Bearer).
    ///
    /// ```
    /// use pgw_client::KeyHeader;
    /// let azure = KeyHeader::for_base_url("https://r.openai.azure.com/openai/v1");
    /// assert_eq!(azure, KeyHeader::azure());
    /// assert_eq!(KeyHeader::for_base_url("https://api.openai.com/v1"), KeyHeader::Bearer);
    /// ```
    #[must_use]
    pub fn for_base_url(base_url: &str) -> Self {
        let host = base_url
            .parse::<http::Uri>()
            .ok()
            .and_then(|u| u.host().map(str::to_ascii_lowercase));
        const AZURE: [&str; 5] = [
            ".openai.azure.com",
            ".cognitiveservices.azure.com",
            ".openai.azure.us",
            ".cognitiveservices.azure.us",
            ".openai.azure.cn",
        ];
        match host {
            // A fully qualified name's trailing dot names the same host.
            Some(h) if AZURE.iter().any(|d| h.trim_end_matches('.').ends_with(d)) => Self::azure(),
            _ => Self::Bearer,
        }
    }

    /// Parses a config value: `authorization` (any case) is [`Bearer`](Self::Bearer),
    /// any other header name is sent as that header.
    ///
    /// # Errors
    /// The reason, when `name` is not a header name, or names a header the client sets
    /// itself (`host`, `content-type`, `accept`, `content-length`, ...), which the key
    /// would replace.
    pub fn parse(name: &str) -> Result<Self, String> {
        const OWN: [http::HeaderName; 7] = [
            http::header::HOST,
            http::header::CONTENT_TYPE,
            http::header::CONTENT_LENGTH,
            http::header::ACCEPT,
            http::header::TRANSFER_ENCODING,
            http::header::CONNECTION,
            http::header::TE,
        ];
        if name.eq_ignore_ascii_case("authorization") {
            return Ok(Self::Bearer);
        }
        let header =
            http::HeaderName::try_from(name).map_err(|_| format!("{name:?} is not a header name"))?;
        if OWN.contains(&header) {
            return Err(format!(
                "{name:?} is a header the client sets itself; the key goes in another"
            ));
        }
        Ok(Self::Named(header))
    }

    /// The header's name.
    #[must_use]
    pub fn name(&self) -> &str {
        match self {
            Self::Bearer => "authorization",
            Self::Named(n) => n.as_str(),
        }
    }
}

/// Settings that cannot work, naming the source and the field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadSettings {
    source: SourceId,
    field: &'static str,
    reason: String,
}

impl BadSettings {
    /// A new error for `field` of `source`.
    pub fn new(source: &SourceId, field: &'static str, reason: impl Into<String>) -> Self {
        Self {
            source: source.clone(),
            field,
            reason: reason.into(),
        }
    }

    /// The offending field.
    #[must_use]
    pub const fn field(&self) -> &'static str {
        self.field
    }
}

impl fmt::Display for BadSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "source {}: field `{}`: {}",
            self.source, self.field, self.reason
        )
    }
}

impl std::error::Error for BadSettings {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_and_debug() {
        let s = SourceSettings::new("s1", "http://127.0.0.1:9/v1/").key(SecretKey::new("sk-secret-1"));
        assert_eq!(
            s.endpoint().unwrap().to_string(),
            "http://127.0.0.1:9/v1/chat/completions"
        );
        assert!(!format!("{s:?}").contains("sk-secret"));
        let bad = SourceSettings::new("s2", "ftp://x").endpoint().unwrap_err();
        assert_eq!(bad.field(), "base_url");
        assert!(bad.to_string().contains("source s2"), "{bad}");
        assert!(SourceSettings::new("s3", "no url").endpoint().is_err());
        // A query stays a query (Azure's deployments URL).
        let azure = SourceSettings::new(
            "az",
            "https://r.openai.azure.com/openai/deployments/d/?api-version=2024-10-21",
        );
        assert_eq!(
            azure.endpoint().unwrap().to_string(),
            "https://r.openai.azure.com/openai/deployments/d/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(azure.key_header, KeyHeader::azure(), "picked from the host");
        assert_eq!(s.key_header, KeyHeader::Bearer);
    }

    #[test]
    fn key_header_from_the_host_or_config() {
        for (url, header) in [
            ("https://MY-R.openai.azure.com/openai/v1", "api-key"),
            (
                "https://r.cognitiveservices.azure.com/openai/deployments/d?api-version=1",
                "api-key",
            ),
            ("https://api.openai.com/v1", "authorization"),
            // Only the host decides: a path or another host's name in it does not.
            ("https://proxy.example/openai.azure.com/v1", "authorization"),
            ("https://openai.azure.com.evil.example/v1", "authorization"),
            ("https://r.openai.azure.com.:443/openai/v1", "api-key"),
            ("https://r.openai.azure.us/openai/v1", "api-key"),
            ("https://r.openai.azure.cn/openai/v1", "api-key"),
            ("https://[::1]:8443/v1", "authorization"),
            ("not a url", "authorization"),
        ] {
            assert_eq!(KeyHeader::for_base_url(url).name(), header, "{url}");
        }
        assert_eq!(KeyHeader::parse("Authorization"), Ok(KeyHeader::Bearer));
        assert_eq!(KeyHeader::parse("api-key"), Ok(KeyHeader::azure()));
        assert_eq!(KeyHeader::parse("X-Api-Key").unwrap().name(), "x-api-key");
        assert!(
            KeyHeader::parse("bad header")
                .unwrap_err()
                .contains("not a header name")
        );
        for own in ["Host", "content-type", "Accept", "content-length"] {
            assert!(
                KeyHeader::parse(own).unwrap_err().contains("sets itself"),
                "{own}"
            );
        }
    }
}
