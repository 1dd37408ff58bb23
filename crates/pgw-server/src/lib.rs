//! pgw as a server people deploy: the `pgw` binary and the library behind it.
//!
//! `pgw serve --config pgw.toml` serves an OpenAI-compatible API over a
//! [`pgw_stack::Gateway`]: `POST /v1/chat/completions` (JSON and server-sent events),
//! `GET /v1/models`, `GET /healthz`, `GET /readyz` and `GET /metrics` (Prometheus
//! text). `pgw check --config pgw.toml` validates a configuration and prints it with
//! its secrets redacted; `pgw hash-key` prints the SHA-256 a virtual key is stored as.
//!
//! What the server adds to the gateway:
//! - **errors in the OpenAI shape** for everything, framework errors included
//!   ([`ApiError`]): local refusals are 429 or 503 with `Retry-After`, deadlines 504,
//!   a provider's rejection passed through as the provider wrote it;
//! - **hardening with hyper's and tower-http's own settings**: `TCP_NODELAY` on every
//!   accepted socket, a header read timeout (slow clients are cut before they cost a
//!   request), a body limit, caps on open connections and on calls in flight (503 +
//!   `Retry-After` past them), graceful shutdown on SIGTERM and SIGINT that drains
//!   calls and streams for a grace period;
//! - **virtual API keys** ([`KeyRing`]): SHA-256 at rest, per-key models and a quota
//!   (requests, tokens, concurrency per window) on the gateway's backend, so a
//!   tenant's quota holds across replicas sharing one Redis.
//!
//! ```no_run
//! # async fn run() -> Result<(), pgw_core::BoxError> {
//! let config = pgw_server::ServerConfig::from_file("pgw.toml")?;
//! let gateway = pgw_stack::Gateway::from_config(config.gateway.clone()).await?;
//! let server = pgw_server::Server::bind(&config, gateway, pgw_server::install_metrics()).await?;
//! server.run(pgw_server::shutdown_signal()).await
//! # }
//! ```

mod auth;
pub mod config;
mod error;
mod routes;
mod serve;
mod sse;
mod stall;
mod track;

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

pub use auth::{KeyRing, Tenant, TenantPermit, hash_key};
pub use config::{KeyConfig, LogFormat, ServerConfig, ServerSection, Settings};
pub use error::ApiError;
pub use routes::{AppState, model_names, router};
pub use serve::{Server, StartError};

/// Histogram buckets of durations in seconds (5 ms to 10 min: LLM calls are slow).
const SECONDS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// Histogram buckets of token counts (OpenTelemetry's advice for `gen_ai.client.token.usage`).
const TOKEN_BUCKETS: &[f64] = &[
    1.0,
    4.0,
    16.0,
    64.0,
    256.0,
    1024.0,
    4096.0,
    16384.0,
    65536.0,
    262_144.0,
    1_048_576.0,
];

/// Descriptors the process keeps besides client and upstream connections: the
/// listener, Redis connections, the runtime's own, standard streams, a log file.
const SPARE_FILES: u64 = 64;

/// Raises this process's soft limit of open files to its hard limit (as Go's runtime
/// does at start; Rust's does not), and returns the limit now in force. A process out
/// of descriptors fails its upstream connects: pgw counts that as its own failure
/// (503 `overloaded`, no source blamed), and this makes it rarer. Logs a warning when
/// the limit is still below what `max_connections` client connections, one upstream
/// connection per call in flight (`max_in_flight`) and 64 more (the listener, Redis) may take:
/// raise the hard limit (`LimitNOFILE=` in a systemd unit, `--ulimit nofile=` for a
/// container) or lower the caps.
///
/// # Errors
/// The `getrlimit`/`setrlimit` error, when the limit cannot be read or set.
///
/// ```
/// let limit = pgw_server::raise_open_files_limit(16, 16).unwrap();
/// assert!(limit >= 16);
/// ```
pub fn raise_open_files_limit(max_connections: usize, max_in_flight: usize) -> std::io::Result<u64> {
    let limit = rlimit::increase_nofile_limit(u64::MAX)?;
    let want = u64::try_from(max_connections.saturating_add(max_in_flight))
        .unwrap_or(u64::MAX)
        .saturating_add(SPARE_FILES);
    if limit < want {
        tracing::warn!(
            limit,
            max_connections,
            max_in_flight,
            "the open-files limit is below what server.max_connections and server.max_in_flight may open: \
             raise it (LimitNOFILE=, --ulimit nofile=) or lower them"
        );
    } else {
        tracing::debug!(limit, "open-files limit");
    }
    Ok(limit)
}

/// Installs the process-wide Prometheus recorder once and returns its handle (every
/// `metrics` counter, gauge and histogram of the gateway and the server lands there).
/// `None` when another recorder was installed first.
pub fn install_metrics() -> Option<PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full("gen_ai_client_token_usage".into()), TOKEN_BUCKETS)
                });
            let recorder = match builder {
                Ok(b) => b.build_recorder(),
                Err(e) => {
                    tracing::warn!(error = %e, "metrics buckets refused; no /metrics");
                    return None;
                }
            };
            let handle = recorder.handle();
            match metrics::set_global_recorder(recorder) {
                Ok(()) => {
                    // Counters a scrape should see from the start, at 0: a series that
                    // appears only at its first event breaks `rate()` and alerts on
                    // its absence (the cache's appeared after the first cacheable call).
                    metrics::counter!("pgw_cache_hits_total").increment(0);
                    metrics::counter!("pgw_cache_misses_total").increment(0);
                    for reason in ["connections", "in_flight"] {
                        metrics::counter!("pgw_server_shed_total", "reason" => reason).increment(0);
                    }
                    Some(handle)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "a metrics recorder is already installed; no /metrics");
                    None
                }
            }
        })
        .clone()
}

/// Sets up logging: `RUST_LOG` (default `info`), as text or one JSON object per line,
/// to standard output; text has colours only when that is a terminal (a journal or a
/// file gets no escape codes). Does nothing when a subscriber is already set.
///
/// # Errors
/// A `RUST_LOG` that is set but not a valid filter, quoted: it used to be ignored
/// silently, logging at `info` whatever the operator asked.
pub fn init_logging(format: LogFormat) -> Result<(), String> {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => {
            EnvFilter::try_new(&v).map_err(|e| format!("RUST_LOG={v:?} is not a log filter: {e}"))?
        }
        _ => EnvFilter::new("info"),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stdout().is_terminal());
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    Ok(())
}

/// Completes on SIGTERM or SIGINT (Ctrl-C), whichever comes first.
///
/// The signals are listened to from the call, not from the future's first poll
/// (when it is called inside a tokio runtime): a signal sent between the call and
/// the first poll (the other event loops already accepting) is not taken by its
/// default action, which ends the process with nothing drained.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    let registered = tokio::runtime::Handle::try_current().ok().map(|_| {
        use tokio::signal::unix::{SignalKind, signal};
        (signal(SignalKind::interrupt()), signal(SignalKind::terminate()))
    });
    async move {
        #[cfg(unix)]
        if let Some((Ok(mut interrupt), Ok(mut terminate))) = registered {
            tokio::select! {
                _ = interrupt.recv() => tracing::info!("SIGINT received"),
                _ = terminate.recv() => tracing::info!("SIGTERM received"),
            }
            return;
        }
        // Called outside a runtime (or not on unix): listened to from here.
        let interrupt = async {
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        };
        #[cfg(unix)]
        let terminate = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut s) => {
                    s.recv().await;
                }
                Err(_) => std::future::pending::<()>().await,
            }
        };
        #[cfg(not(unix))]
        let terminate = std::future::pending::<()>();
        tokio::select! {
            () = interrupt => tracing::info!("SIGINT received"),
            () = terminate => tracing::info!("SIGTERM received"),
        }
    }
}
