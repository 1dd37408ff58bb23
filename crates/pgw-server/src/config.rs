//! The server's configuration: the gateway's own TOML (`pgw_stack::GatewayConfig`, at
//! the top level, unchanged) plus one `[server]` table for what only a server needs.
//!
//! ```toml
//! [server]
//! listen = "0.0.0.0:8080"
//! expose_sources = false
//! header_read_timeout_s = 10
//! body_read_timeout_s = 30
//! max_body_bytes = 8388608
//! max_connections = 1024
//! max_in_flight = 512
//! shutdown_grace_s = 30
//! shutdown_delay_s = 0         # behind a balancer: what it needs to see /readyz 503
//! sse_keep_alive_s = 15
//! threads = 4                  # absent: one per core
//!
//! [[server.keys]]
//! label = "team-a"
//! sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08" # pgw hash-key
//! models = ["gpt-4o-mini"]     # absent: every model (an empty list is refused)
//! rpm = 600
//! tpm = 200000
//! max_concurrency = 8
//!
//! # ... then the gateway's keys as pgw-stack reads them:
//! [[sources]]
//! name = "s1"
//! base_url = "https://api.openai.com/v1"
//! key_env = "OPENAI_API_KEY"
//! ```
//!
//! Environment overrides work as in pgw-stack: `PGW__A__B=value` sets `a.b`
//! (`PGW__SERVER__LISTEN=0.0.0.0:9000`, `PGW__SOURCES__0__KEY=sk-...`).

use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use pgw_core::ConfigError;
use pgw_stack::GatewayConfig;
use serde::Deserialize;

/// Default listen address: loopback only, `127.0.0.1:8080`.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
/// Default time a client has to send a request's headers (and the longest a kept-alive
/// connection may sit idle between requests): 10 s. Slow-header clients are cut then.
pub const DEFAULT_HEADER_READ_TIMEOUT_S: f64 = 10.0;
/// Default time a client has to send a request's whole body once its headers are in:
/// 30 s. A body trickled slower is cut then with a 408, before it costs an attempt.
pub const DEFAULT_BODY_READ_TIMEOUT_S: f64 = 30.0;
/// Default write timeout: 60 s. A client that reads nothing for a minute (its receive
/// window full) has stopped reading; one that reads at all, however slowly, never
/// meets it, and a stream's silent stretches are not writes (keep-alive comments go
/// out every `sse_keep_alive_s`).
pub const DEFAULT_WRITE_TIMEOUT_S: f64 = 60.0;
/// Default request body limit: 8 MiB (a long prompt is a few hundred KB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
/// Default cap on open client connections: 1024 (well under a default `ulimit -n` of
/// 1024 plus what the upstream connections need only with a raised limit; see the README).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default cap on requests in flight: 512.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 512;
/// Default `Retry-After` of a request or connection shed for load: 1 s.
pub const DEFAULT_SHED_RETRY_AFTER_S: f64 = 1.0;
/// Default grace period of a shutdown: in-flight calls and streams get 30 s to finish.
pub const DEFAULT_SHUTDOWN_GRACE_S: f64 = 30.0;
/// Default delay between a shutdown signal and the listener's close: 0 s (see
/// [`ServerSection::shutdown_delay_s`]).
pub const DEFAULT_SHUTDOWN_DELAY_S: f64 = 0.0;
/// Default interval of SSE keep-alive comments while a stream is silent: 15 s.
pub const DEFAULT_SSE_KEEP_ALIVE_S: f64 = 15.0;
/// Most event-loop threads `server.threads` may ask for: 1024 (far past any core count;
/// a typo like `threads = 40000` is refused rather than spawned).
pub const MAX_THREADS: usize = 1024;

/// Default number of event-loop threads: one per core the process may run on
/// (`std::thread::available_parallelism`), 1 when that is unknown.
#[must_use]
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}

/// Log output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines (the default).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// One virtual API key: what a client presents as `Authorization: Bearer ...`.
///
/// Only the SHA-256 of the key is stored (`pgw hash-key` prints it). `Debug` shows the
/// first 8 hex digits of the hash.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyConfig {
    /// A name for the key, used in metrics (`tenant` label) and logs.
    pub label: String,
    /// SHA-256 of the key, 64 lowercase or uppercase hex digits.
    pub sha256: String,
    /// The models this key may name (with `[models]`, each one of those); absent:
    /// every model. An empty list is refused: read
    /// as "every model", it would grant what it seems to deny.
    #[serde(default, deserialize_with = "listed_models")]
    pub models: Vec<String>,
    /// Requests per rate window (the gateway's `ratelimit.window_s`, default 60 s); absent or 0: unlimited.
    #[serde(default)]
    pub rpm: Option<u64>,
    /// Tokens per rate window (estimated at admission: prompt bytes / 3 + `max_tokens`,
    /// reconciled to the reported usage); absent or 0: unlimited.
    #[serde(default)]
    pub tpm: Option<u64>,
    /// Requests in flight at once; absent or 0: unlimited.
    #[serde(default)]
    pub max_concurrency: Option<u64>,
}

/// A key's `models`: a list of at least one name.
fn listed_models<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let models = Vec::<String>::deserialize(d)?;
    if models.is_empty() {
        return Err(serde::de::Error::custom(
            "an empty list would allow every model: leave `models` out for every model, \
             or name the ones this key may use",
        ));
    }
    Ok(models)
}

impl fmt::Debug for KeyConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: String = self.sha256.chars().take(8).collect();
        f.debug_struct("KeyConfig")
            .field("label", &self.label)
            .field("sha256", &format_args!("{shown}..."))
            .field("models", &self.models)
            .field("rpm", &self.rpm)
            .field("tpm", &self.tpm)
            .field("max_concurrency", &self.max_concurrency)
            .finish()
    }
}

/// The `[server]` table. Every field has a default (the `DEFAULT_*` constants).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSection {
    /// Address to listen on (default [`DEFAULT_LISTEN`]); `--listen` overrides it.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Serve without virtual keys on a non-loopback address (default false: refused).
    #[serde(default)]
    pub allow_unauthenticated: bool,
    /// Name sources in error messages and the `x-pgw-source` header (default false).
    #[serde(default)]
    pub expose_sources: bool,
    /// Let virtual keys share cached answers (default false: each key label has its
    /// own partition of the response cache, so one tenant's answers never serve
    /// another, and `x-pgw-cache: hit` cannot tell a tenant what another asked).
    #[serde(default)]
    pub share_cache_across_keys: bool,
    /// Seconds a client has to send a request's headers, also the idle limit of a
    /// kept-alive connection (default [`DEFAULT_HEADER_READ_TIMEOUT_S`]).
    #[serde(default)]
    pub header_read_timeout_s: Option<f64>,
    /// Seconds a client has to send a request's whole body after its headers (default
    /// [`DEFAULT_BODY_READ_TIMEOUT_S`]); a slower body is answered 408 and the
    /// connection closed.
    #[serde(default)]
    pub body_read_timeout_s: Option<f64>,
    /// Seconds a write to a client may stay pending (the client reads nothing) before
    /// the connection is ended and its call released (default
    /// [`DEFAULT_WRITE_TIMEOUT_S`]). Without it, a client that stopped reading a
    /// stream held its in-flight slot, its tenant lease and its connection for good.
    #[serde(default)]
    pub write_timeout_s: Option<f64>,
    /// Keep connections alive between requests (default true).
    #[serde(default = "yes")]
    pub keep_alive: bool,
    /// Largest request body, bytes (default [`DEFAULT_MAX_BODY_BYTES`]); larger is 413.
    #[serde(default)]
    pub max_body_bytes: Option<usize>,
    /// Open client connections at most (default [`DEFAULT_MAX_CONNECTIONS`]); past it a
    /// connection gets one 503 and is closed.
    #[serde(default)]
    pub max_connections: Option<usize>,
    /// Requests in flight at most (default [`DEFAULT_MAX_IN_FLIGHT`]); past it 503.
    #[serde(default)]
    pub max_in_flight: Option<usize>,
    /// `Retry-After` of a shed request or connection, seconds (default
    /// [`DEFAULT_SHED_RETRY_AFTER_S`]).
    #[serde(default)]
    pub shed_retry_after_s: Option<f64>,
    /// Seconds in-flight calls and streams get to finish on SIGTERM / SIGINT (default
    /// [`DEFAULT_SHUTDOWN_GRACE_S`]).
    #[serde(default)]
    pub shutdown_grace_s: Option<f64>,
    /// Seconds between SIGTERM / SIGINT and the listener's close (default
    /// [`DEFAULT_SHUTDOWN_DELAY_S`]): meanwhile `/readyz` answers 503 and new calls are
    /// still served, so a load balancer polling `/readyz` takes the replica out before
    /// it refuses connections. Set it to what the balancer needs to notice (its check
    /// interval times its unhealthy threshold); the grace period follows it.
    #[serde(default)]
    pub shutdown_delay_s: Option<f64>,
    /// Seconds between SSE keep-alive comments while a stream is silent (default
    /// [`DEFAULT_SSE_KEEP_ALIVE_S`]).
    #[serde(default)]
    pub sse_keep_alive_s: Option<f64>,
    /// Event-loop threads (default [`default_threads`]: one per core). Each runs its
    /// own single-threaded tokio runtime, accepts on the shared listener and keeps its
    /// own upstream connection pools, so a call and its upstream request stay on one
    /// thread; the gateway's state (limits, breakers, health) is shared by all. At
    /// most [`MAX_THREADS`].
    #[serde(default)]
    pub threads: Option<usize>,
    /// `text` (default) or `json`; `--log-format` overrides it.
    #[serde(default)]
    pub log_format: LogFormat,
    /// Virtual API keys; none: no authentication (loopback only unless
    /// `allow_unauthenticated`).
    #[serde(default)]
    pub keys: Vec<KeyConfig>,
}

fn default_listen() -> String {
    DEFAULT_LISTEN.to_owned()
}

const fn yes() -> bool {
    true
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            listen: default_listen(),
            allow_unauthenticated: false,
            expose_sources: false,
            share_cache_across_keys: false,
            header_read_timeout_s: None,
            body_read_timeout_s: None,
            write_timeout_s: None,
            keep_alive: true,
            max_body_bytes: None,
            max_connections: None,
            max_in_flight: None,
            shed_retry_after_s: None,
            shutdown_grace_s: None,
            shutdown_delay_s: None,
            sse_keep_alive_s: None,
            threads: None,
            log_format: LogFormat::Text,
            keys: Vec::new(),
        }
    }
}

/// The `[server]` settings with every default filled in and validated.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Where to listen.
    pub listen: SocketAddr,
    /// See [`ServerSection::allow_unauthenticated`].
    pub allow_unauthenticated: bool,
    /// See [`ServerSection::expose_sources`].
    pub expose_sources: bool,
    /// See [`ServerSection::share_cache_across_keys`].
    pub share_cache_across_keys: bool,
    /// See [`ServerSection::header_read_timeout_s`].
    pub header_read_timeout: Duration,
    /// See [`ServerSection::body_read_timeout_s`].
    pub body_read_timeout: Duration,
    /// See [`ServerSection::write_timeout_s`].
    pub write_timeout: Duration,
    /// See [`ServerSection::keep_alive`].
    pub keep_alive: bool,
    /// See [`ServerSection::max_body_bytes`].
    pub max_body_bytes: usize,
    /// See [`ServerSection::max_connections`].
    pub max_connections: usize,
    /// See [`ServerSection::max_in_flight`].
    pub max_in_flight: usize,
    /// See [`ServerSection::shed_retry_after_s`].
    pub shed_retry_after: Duration,
    /// See [`ServerSection::shutdown_grace_s`].
    pub shutdown_grace: Duration,
    /// See [`ServerSection::shutdown_delay_s`].
    pub shutdown_delay: Duration,
    /// See [`ServerSection::sse_keep_alive_s`].
    pub sse_keep_alive: Duration,
    /// See [`ServerSection::threads`].
    pub threads: usize,
    /// See [`ServerSection::log_format`].
    pub log_format: LogFormat,
    /// See [`ServerSection::keys`].
    pub keys: Vec<KeyConfig>,
}

/// The whole configuration of `pgw serve`: the gateway's and the server's.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The `[server]` table, defaults filled in.
    pub server: Settings,
    /// Everything else: the gateway (sources, backend, retry, ...).
    pub gateway: GatewayConfig,
}

pub(crate) fn config_error(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::new("server", field.into(), reason.into())
}

fn secs(field: &str, v: Option<f64>, default: f64) -> Result<Duration, ConfigError> {
    let s = v.unwrap_or(default);
    if !(s.is_finite() && s > 0.0 && s <= pgw_stack::config::MAX_DURATION_S) {
        return Err(config_error(
            field,
            format!("must be a positive number of seconds, at most ten years (got {s})"),
        ));
    }
    Ok(Duration::from_secs_f64(s))
}

/// As [`secs`], zero allowed.
fn secs_or_zero(field: &str, v: Option<f64>, default: f64) -> Result<Duration, ConfigError> {
    let s = v.unwrap_or(default);
    if s == 0.0 {
        return Ok(Duration::ZERO);
    }
    secs(field, Some(s), default).map_err(|_| {
        config_error(
            field,
            format!("must be zero or a positive number of seconds, at most ten years (got {s})"),
        )
    })
}

fn positive(field: &str, v: Option<usize>, default: usize) -> Result<usize, ConfigError> {
    match v.unwrap_or(default) {
        0 => Err(config_error(field, "must be at least 1")),
        n => Ok(n),
    }
}

/// The largest `max_connections` and `max_in_flight`: 2^30. Each is a semaphore,
/// whose constructor panics past 2^61 permits; a billion is already far beyond what one
/// process can hold open, so a larger value is a typo, refused here by `pgw check` too.
pub const MAX_CAP: usize = 1 << 30;

/// A cap: at least 1, at most [`MAX_CAP`].
fn cap(field: &str, v: Option<usize>, default: usize) -> Result<usize, ConfigError> {
    match positive(field, v, default)? {
        n if n > MAX_CAP => Err(config_error(
            field,
            format!("must be at most {MAX_CAP} (got {n})"),
        )),
        n => Ok(n),
    }
}

fn threads(v: Option<usize>) -> Result<usize, ConfigError> {
    match v {
        None => Ok(default_threads()),
        Some(0) => Err(config_error("server.threads", "must be at least 1")),
        Some(n) if n > MAX_THREADS => Err(config_error(
            "server.threads",
            format!("must be at most {MAX_THREADS} (got {n})"),
        )),
        Some(n) => Ok(n),
    }
}

impl Settings {
    /// Checks what [`ServerSection::settings`] checks of the fields a caller building
    /// `Settings` by hand could get wrong so that serving would panic: `threads` in
    /// `1..=`[`MAX_THREADS`], `max_connections` and `max_in_flight` in `1..=`[`MAX_CAP`],
    /// `max_body_bytes` at least 1, every duration at most ten years
    /// ([`pgw_stack::config::MAX_DURATION_S`]). [`crate::Server::bind`] calls it.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field.
    pub fn check(&self) -> Result<(), ConfigError> {
        threads(Some(self.threads))?;
        cap("server.max_connections", Some(self.max_connections), 1)?;
        cap("server.max_in_flight", Some(self.max_in_flight), 1)?;
        positive("server.max_body_bytes", Some(self.max_body_bytes), 1)?;
        // Settings built by hand may say `Duration::MAX` for "never": the deadlines
        // hyper and the keep-alive comments compute from them (`now + d`) would
        // overflow the clock on every connection. Ten years, as the file's bound.
        let longest = Duration::from_secs_f64(pgw_stack::config::MAX_DURATION_S);
        for (field, d) in [
            ("server.header_read_timeout_s", self.header_read_timeout),
            ("server.body_read_timeout_s", self.body_read_timeout),
            ("server.write_timeout_s", self.write_timeout),
            ("server.shed_retry_after_s", self.shed_retry_after),
            ("server.shutdown_grace_s", self.shutdown_grace),
            ("server.shutdown_delay_s", self.shutdown_delay),
            ("server.sse_keep_alive_s", self.sse_keep_alive),
        ] {
            if d > longest {
                return Err(config_error(
                    field,
                    format!("must be at most ten years (got {d:?})"),
                ));
            }
        }
        Ok(())
    }

    /// Why these settings would not be served, if they would not: no virtual keys on
    /// an address that is not loopback, without `allow_unauthenticated`. `pgw serve`
    /// refuses to start and `pgw check` fails on it, in these words.
    #[must_use]
    pub fn unauthenticated_exposure(&self) -> Option<String> {
        (self.keys.is_empty() && !self.listen.ip().is_loopback() && !self.allow_unauthenticated).then(|| {
            format!(
                "refusing to serve {} without authentication: configure [[server.keys]] \
                 (see `pgw hash-key`) or pass --allow-unauthenticated",
                self.listen
            )
        })
    }
}

impl ServerSection {
    /// Fills in the defaults and checks every field.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field (`server.max_connections`, `server.keys[1].sha256`, ...).
    pub fn settings(&self) -> Result<Settings, ConfigError> {
        let listen = self.listen.parse().map_err(|e| {
            config_error(
                "server.listen",
                format!("{:?} is not an address like 127.0.0.1:8080: {e}", self.listen),
            )
        })?;
        let mut labels = std::collections::HashSet::new();
        let mut hashes = std::collections::HashSet::new();
        for (i, k) in self.keys.iter().enumerate() {
            let at = format!("server.keys[{i}]");
            if k.label.trim().is_empty() {
                return Err(config_error(format!("{at}.label"), "must not be empty"));
            }
            if k.label.contains(['{', '}']) {
                // The label names the tenant's quota scope in Redis, where braces
                // delimit a Cluster hash tag (the limiter refuses it at start).
                return Err(config_error(
                    format!("{at}.label"),
                    "must not contain '{' or '}' (they delimit Redis Cluster hash tags)",
                ));
            }
            if !labels.insert(k.label.as_str()) {
                return Err(config_error(
                    format!("{at}.label"),
                    format!("duplicate label {:?}", k.label),
                ));
            }
            if k.sha256.len() != 64 || !k.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(config_error(
                    format!("{at}.sha256"),
                    "must be 64 hex digits (the output of `pgw hash-key`), not the key itself",
                ));
            }
            if !hashes.insert(k.sha256.to_ascii_lowercase()) {
                return Err(config_error(
                    format!("{at}.sha256"),
                    "the same key is listed twice",
                ));
            }
            for (field, v) in [
                ("rpm", k.rpm),
                ("tpm", k.tpm),
                ("max_concurrency", k.max_concurrency),
            ] {
                if v.is_some_and(|v| v > tower_ratelimit_redis::MAX_QUOTA) {
                    return Err(config_error(
                        format!("{at}.{field}"),
                        format!("is too large (at most {})", tower_ratelimit_redis::MAX_QUOTA),
                    ));
                }
            }
        }
        Ok(Settings {
            listen,
            allow_unauthenticated: self.allow_unauthenticated,
            expose_sources: self.expose_sources,
            share_cache_across_keys: self.share_cache_across_keys,
            header_read_timeout: secs(
                "server.header_read_timeout_s",
                self.header_read_timeout_s,
                DEFAULT_HEADER_READ_TIMEOUT_S,
            )?,
            body_read_timeout: secs(
                "server.body_read_timeout_s",
                self.body_read_timeout_s,
                DEFAULT_BODY_READ_TIMEOUT_S,
            )?,
            write_timeout: secs(
                "server.write_timeout_s",
                self.write_timeout_s,
                DEFAULT_WRITE_TIMEOUT_S,
            )?,
            keep_alive: self.keep_alive,
            max_body_bytes: positive(
                "server.max_body_bytes",
                self.max_body_bytes,
                DEFAULT_MAX_BODY_BYTES,
            )?,
            max_connections: cap(
                "server.max_connections",
                self.max_connections,
                DEFAULT_MAX_CONNECTIONS,
            )?,
            max_in_flight: cap("server.max_in_flight", self.max_in_flight, DEFAULT_MAX_IN_FLIGHT)?,
            shed_retry_after: secs(
                "server.shed_retry_after_s",
                self.shed_retry_after_s,
                DEFAULT_SHED_RETRY_AFTER_S,
            )?,
            shutdown_grace: secs(
                "server.shutdown_grace_s",
                self.shutdown_grace_s,
                DEFAULT_SHUTDOWN_GRACE_S,
            )?,
            shutdown_delay: secs_or_zero(
                "server.shutdown_delay_s",
                self.shutdown_delay_s,
                DEFAULT_SHUTDOWN_DELAY_S,
            )?,
            sse_keep_alive: secs(
                "server.sse_keep_alive_s",
                self.sse_keep_alive_s,
                DEFAULT_SSE_KEEP_ALIVE_S,
            )?,
            threads: threads(self.threads)?,
            log_format: self.log_format,
            keys: self.keys.clone(),
        })
    }
}

impl ServerConfig {
    /// Reads a TOML file and applies `PGW__...` overrides from the environment.
    ///
    /// # Errors
    /// A [`ConfigError`] naming the file or the field.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| config_error(path.display().to_string(), format!("cannot read: {e}")))?;
        Self::from_toml_str_with_env(&text, std::env::vars())
    }

    /// Parses TOML text (no environment overrides).
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        Self::from_toml_str_with_env(text, std::iter::empty())
    }

    /// Parses TOML text and applies the `PGW__...` overrides among `vars`: those under
    /// `PGW__SERVER__` to `[server]`, the others to the gateway, as pgw-stack does.
    ///
    /// ```
    /// use pgw_server::ServerConfig;
    /// let text = "[server]\nlisten = \"127.0.0.1:9000\"\n\n[[sources]]\nname = \"s1\"\n\
    ///             base_url = \"http://127.0.0.1:1/v1\"\nkey = \"sk-x\"\n";
    /// let env = [("PGW__SERVER__MAX_IN_FLIGHT".to_string(), "7".to_string())];
    /// let cfg = ServerConfig::from_toml_str_with_env(text, env).unwrap();
    /// assert_eq!(cfg.server.listen.port(), 9000);
    /// assert_eq!(cfg.server.max_in_flight, 7);
    /// assert_eq!(cfg.gateway.sources[0].name, "s1");
    /// ```
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field.
    pub fn from_toml_str_with_env(
        text: &str,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let mut table: toml::Table =
            toml::from_str(text).map_err(|e| pgw_stack::config::toml_error(&e, Some(text)))?;
        // pgw-stack's own override rules, over the whole file: `PGW__SERVER__...` lands
        // in `[server]`, everything else in the gateway's tables.
        let mut overrides: Vec<(String, String)> =
            vars.into_iter().filter(|(k, _)| k.starts_with("PGW__")).collect();
        overrides.sort();
        for (k, v) in &overrides {
            pgw_stack::config::apply_override(&mut table, k, v).map_err(|e| {
                if k.to_ascii_uppercase().starts_with("PGW__SERVER__") {
                    config_error(e.field(), e.reason().to_owned())
                } else {
                    e
                }
            })?;
        }
        let server = match table.remove("server") {
            None => toml::Table::new(),
            Some(toml::Value::Table(t)) => t,
            Some(_) => return Err(config_error("server", "must be a table")),
        };
        let named = |e: ConfigError| pgw_stack::config::name_override(e, &overrides);
        let section: ServerSection = pgw_stack::config::from_table(server, "server")
            .map_err(|e| named(config_error(e.field().to_owned(), e.reason().to_owned())))?;
        let server = section.settings().map_err(named)?;
        let rest = toml::to_string(&table).map_err(|e| config_error("config", e.to_string()))?;
        let gateway = GatewayConfig::from_toml_str(&rest).map_err(named)?;
        // With [models], the gateway serves those names and no other; without, any name
        // goes to a group (and upstream as the source's model), so none can be wrong.
        if !gateway.models.is_empty() {
            let served = crate::routes::model_names(&gateway);
            for (i, k) in server.keys.iter().enumerate() {
                if let Some(m) = k.models.iter().find(|m| !served.contains(m)) {
                    return Err(named(config_error(
                        format!("server.keys[{i}].models"),
                        format!("the gateway serves no model {m:?} (it serves {served:?})"),
                    )));
                }
            }
        }
        Ok(Self { server, gateway })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCES: &str =
        "[[sources]]\nname = \"s1\"\nbase_url = \"http://127.0.0.1:1/v1\"\nkey = \"sk-x\"\n";

    #[test]
    fn defaults_without_a_server_table() {
        let cfg = ServerConfig::from_toml_str(SOURCES).unwrap();
        assert_eq!(cfg.server.listen, DEFAULT_LISTEN.parse().unwrap());
        assert_eq!(cfg.server.max_connections, DEFAULT_MAX_CONNECTIONS);
        assert_eq!(cfg.server.threads, default_threads());
        assert!(cfg.server.keys.is_empty());
    }

    #[test]
    fn bad_fields_are_named() {
        let cases = [
            ("[server]\nmax_connections = 0\n", "server.max_connections"),
            // Past a semaphore's limit (its constructor would panic at start).
            (
                "[server]\nmax_connections = 9223372036854775807\n",
                "server.max_connections",
            ),
            ("[server]\nmax_in_flight = 1073741825\n", "server.max_in_flight"),
            ("[server]\nlisten = \"nowhere\"\n", "server.listen"),
            ("[server]\nbogus = 1\n", "server.bogus"),
            ("[server]\nthreads = 0\n", "server.threads"),
            ("[server]\nthreads = 4096\n", "server.threads"),
            (
                "[server]\nheader_read_timeout_s = -1\n",
                "server.header_read_timeout_s",
            ),
            (
                "[server]\nbody_read_timeout_s = 0\n",
                "server.body_read_timeout_s",
            ),
            ("[server]\nshutdown_delay_s = -1\n", "server.shutdown_delay_s"),
            (
                "[[server.keys]]\nlabel = \"a\"\nsha256 = \"sk-plaintext\"\n",
                "server.keys[0].sha256",
            ),
        ];
        for (server, field) in cases {
            let err = ServerConfig::from_toml_str(&format!("{server}\n{SOURCES}")).unwrap_err();
            assert_eq!(err.field(), field, "{server}: {err}");
        }
        let err = ServerConfig::from_toml_str("[[sources]]\nname = \"s1\"\nbase_url = \"x\"\n").unwrap_err();
        assert_eq!(err.field(), "sources[0].key", "{err}");
    }

    /// Type errors, unknown and missing fields are named by their whole path, the entry
    /// of a list included, and a value set by an override names its variable.
    #[test]
    fn settings_built_by_hand_are_checked_before_serving() {
        let good = ServerConfig::from_toml_str(SOURCES).unwrap().server;
        good.check().unwrap();
        let bad = |edit: fn(&mut Settings), field: &str| {
            let mut s = good.clone();
            edit(&mut s);
            assert_eq!(s.check().unwrap_err().field(), field);
        };
        bad(|s| s.threads = 0, "server.threads");
        bad(|s| s.threads = MAX_THREADS + 1, "server.threads");
        bad(|s| s.max_in_flight = 0, "server.max_in_flight");
        bad(|s| s.max_in_flight = usize::MAX, "server.max_in_flight");
        bad(|s| s.max_connections = MAX_CAP + 1, "server.max_connections");
        bad(|s| s.max_body_bytes = 0, "server.max_body_bytes");
        bad(
            |s| s.header_read_timeout = Duration::MAX,
            "server.header_read_timeout_s",
        );
        bad(|s| s.sse_keep_alive = Duration::MAX, "server.sse_keep_alive_s");
    }

    #[test]
    fn errors_name_the_whole_path() {
        let hash = "ab".repeat(32);
        let second = "[[sources]]\nname = \"s2\"\nbase_url = \"http://127.0.0.1:1/v1\"\nkey = \"sk-y\"\n";
        let cases = [
            (
                "[server]\nmax_body_bytes = \"big\"\n".to_owned(),
                "server.max_body_bytes",
            ),
            (
                "[server]\nmax_body_bytes = -1\n".to_owned(),
                "server.max_body_bytes",
            ),
            (
                "[server]\nlog_format = \"yaml\"\n".to_owned(),
                "server.log_format",
            ),
            (
                format!("[[server.keys]]\nlabel = \"a\"\nsha256 = \"{hash}\"\nrpn = 1\n"),
                "server.keys[0].rpn",
            ),
            (
                format!("[[server.keys]]\nsha256 = \"{hash}\"\n"),
                "server.keys[0].label",
            ),
            (
                format!("[[server.keys]]\nlabel = \"a\"\nsha256 = \"{hash}\"\nrpm = -1\n"),
                "server.keys[0].rpm",
            ),
            (format!("{second}rmp = 5\n"), "sources[1].rmp"),
            (format!("{second}rpm = \"five\"\n"), "sources[1].rpm"),
            (
                "[[sources]]\nname = \"s2\"\nbase_url = \"http://127.0.0.1:1/v1\"\nkey = 12345678\n"
                    .to_owned(),
                "sources[1].key",
            ),
            (
                format!("[[server.keys]]\nlabel = \"team{{a}}\"\nsha256 = \"{hash}\"\nrpm = 5\n"),
                "server.keys[0].label",
            ),
            ("[retry]\nmax_atempts = 3\n".to_owned(), "retry.max_atempts"),
            ("[cache]\nwhen = \"sometimes\"\n".to_owned(), "cache.when"),
        ];
        for (extra, field) in cases {
            // The second source's fields come last, so they land in its table.
            let text = if extra.starts_with("[[sources]]") {
                format!("{SOURCES}{extra}")
            } else {
                format!("{extra}\n{SOURCES}")
            };
            let err = ServerConfig::from_toml_str(&text).unwrap_err();
            assert_eq!(err.field(), field, "{extra}: {err}");
            assert!(
                !err.to_string().contains("12345678"),
                "a value is never shown: {err}"
            );
        }
        let key = |models: &str, more: &str| {
            format!(
                "[[server.keys]]\nlabel = \"a\"\nsha256 = \"{hash}\"\nmodels = {models}\n\n{SOURCES}{more}"
            )
        };
        let err = ServerConfig::from_toml_str(&key("[]", "")).unwrap_err();
        assert_eq!(err.field(), "server.keys[0].models", "{err}");
        assert!(err.reason().contains("every model"), "{err}");
        // With [models], a key names those; without, any name goes to a group.
        let models = "[models.gpt-4o]\nroutes = [{ source = \"s1\" }]\n";
        let err = ServerConfig::from_toml_str(&key("[\"gpt-4o\", \"typo-model\"]", models)).unwrap_err();
        assert_eq!(err.field(), "server.keys[0].models", "{err}");
        assert!(err.reason().contains("typo-model"), "{err}");
        ServerConfig::from_toml_str(&key("[\"gpt-4o\"]", models)).unwrap();
        ServerConfig::from_toml_str(&key("[\"typo-model\"]", "")).unwrap();
        let env = [("PGW__SERVER__MAX_BODY_BYTES".to_owned(), "abc".to_owned())];
        let err = ServerConfig::from_toml_str_with_env(SOURCES, env).unwrap_err();
        assert_eq!(err.field(), "server.max_body_bytes", "{err}");
        assert!(
            err.reason().contains("set by PGW__SERVER__MAX_BODY_BYTES"),
            "{err}"
        );
        let env = [("PGW__SOURCES__0__RPM".to_owned(), "-1".to_owned())];
        let err = ServerConfig::from_toml_str_with_env(SOURCES, env).unwrap_err();
        assert_eq!(err.field(), "sources[0].rpm", "{err}");
        assert!(err.reason().contains("set by PGW__SOURCES__0__RPM"), "{err}");
    }

    #[test]
    fn env_overrides_reach_server_keys_and_gateway() {
        let text = format!(
            "[[server.keys]]\nlabel = \"a\"\nsha256 = \"{}\"\n\n{SOURCES}",
            "ab".repeat(32)
        );
        let env = [
            ("PGW__SERVER__KEYS__0__RPM".to_owned(), "9".to_owned()),
            ("PGW__SERVER__EXPOSE_SOURCES".to_owned(), "true".to_owned()),
            ("PGW__SOURCES__0__RPM".to_owned(), "60".to_owned()),
        ];
        let cfg = ServerConfig::from_toml_str_with_env(&text, env).unwrap();
        assert_eq!(cfg.server.keys[0].rpm, Some(9));
        assert!(cfg.server.expose_sources);
        assert_eq!(cfg.gateway.sources[0].rpm, Some(60));
    }

    #[test]
    fn debug_hides_key_hashes_and_source_keys() {
        let text = format!(
            "[[server.keys]]\nlabel = \"a\"\nsha256 = \"{}\"\n\n{SOURCES}",
            "cd".repeat(32)
        );
        let shown = format!("{:?}", ServerConfig::from_toml_str(&text).unwrap());
        assert!(!shown.contains(&"cd".repeat(32)), "{shown}");
        assert!(!shown.contains("sk-x"), "{shown}");
    }
}
