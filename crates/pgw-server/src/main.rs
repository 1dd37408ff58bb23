//! `pgw`: the pgw gateway as an OpenAI-compatible server.
//!
//! ```text
//! pgw serve --config pgw.toml [--listen 127.0.0.1:8080] [--allow-unauthenticated] [--log-format json]
//! pgw check --config pgw.toml [--listen 127.0.0.1:8080] [--allow-unauthenticated]
//! pgw hash-key [KEY]            # or the key on standard input
//! ```

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use pgw_server::{LogFormat, Server, ServerConfig};
use pgw_stack::SourceConfig;
use pgw_stack::client::{BoxTransport, HyperTransport, box_transport};

/// mimalloc rather than the system allocator: a relayed request allocates about 170
/// times, and glibc's malloc and free were a fifth of the process's instructions per
/// streamed request (callgrind, 2026-12-04).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "pgw", version, about = "Resilient OpenAI-compatible gateway")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API.
    Serve {
        /// The configuration file (TOML; `PGW__...` variables override it).
        #[arg(long, short)]
        config: PathBuf,
        /// Listen address, overriding `server.listen`.
        #[arg(long)]
        listen: Option<String>,
        /// Serve without virtual keys on a non-loopback address.
        #[arg(long)]
        allow_unauthenticated: bool,
        /// Log format, overriding `server.log_format`.
        #[arg(long, value_enum)]
        log_format: Option<LogFormat>,
    },
    /// Validate a configuration as `pgw serve` would take it and print it with its
    /// secrets redacted; exit 2 naming the first bad field.
    Check {
        /// The configuration file (TOML; `PGW__...` variables override it).
        #[arg(long, short)]
        config: PathBuf,
        /// Listen address, overriding `server.listen`, as `pgw serve` would take it.
        #[arg(long)]
        listen: Option<String>,
        /// Check as `pgw serve --allow-unauthenticated` would start.
        #[arg(long)]
        allow_unauthenticated: bool,
    },
    /// Print the SHA-256 of a virtual API key, as `[[server.keys]] sha256` stores it.
    HashKey {
        /// The key; read from standard input when absent (keeps it out of shell history).
        key: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check {
            config,
            listen,
            allow_unauthenticated,
        } => {
            let cfg = match load(&config, listen, allow_unauthenticated) {
                Ok(cfg) => cfg,
                Err(code) => return code,
            };
            if let Some(why) = cfg.server.unauthenticated_exposure() {
                eprintln!("{}: {why}", config.display());
                eprintln!("field: server.listen");
                return ExitCode::from(2);
            }
            let effective = match cfg.gateway.effective() {
                Ok(text) => text,
                Err(e) => return refused(&config, &e),
            };
            // A reader that stops early (`| head`) is not an error of the config.
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "{}: ok", config.display())
                .and_then(|()| writeln!(out, "# server, defaults filled in\n{:#?}", cfg.server))
                .and_then(|()| writeln!(out, "# gateway, as read\n{:#?}", cfg.gateway))
                .and_then(|()| writeln!(out, "# what each layer is given, defaults filled in\n{effective}"));
            ExitCode::SUCCESS
        }
        Command::HashKey { key } => {
            let key = match key {
                Some(k) => k,
                None => {
                    let mut s = String::new();
                    if let Err(e) = std::io::stdin().read_to_string(&mut s) {
                        eprintln!("cannot read the key from standard input: {e}");
                        return ExitCode::FAILURE;
                    }
                    s.trim_end_matches(['\r', '\n']).to_owned()
                }
            };
            if key.is_empty() {
                eprintln!("empty key");
                return ExitCode::FAILURE;
            }
            println!("{}", pgw_server::hash_key(&key));
            ExitCode::SUCCESS
        }
        Command::Serve {
            config,
            listen,
            allow_unauthenticated,
            log_format,
        } => {
            let cfg = match load(&config, listen, allow_unauthenticated) {
                Ok(cfg) => cfg,
                Err(code) => return code,
            };
            if let Err(e) = pgw_server::init_logging(log_format.unwrap_or(cfg.server.log_format)) {
                eprintln!("pgw serve: {e}");
                return ExitCode::from(2);
            }
            // The first event loop; `Server::run` starts the other `server.threads - 1`.
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(serve(cfg)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    // Once, on standard error (the logs go to standard output).
                    eprintln!("pgw serve: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// The configuration `pgw serve` and `pgw check` take: the file, its `PGW__...`
/// overrides, then the command line's. On an error, printed naming the field, the exit
/// code (2).
fn load(path: &Path, listen: Option<String>, allow_unauthenticated: bool) -> Result<ServerConfig, ExitCode> {
    if let Err(e) = std::fs::metadata(path) {
        eprintln!("--config {}: cannot read it: {e}", path.display());
        return Err(ExitCode::from(2));
    }
    let mut cfg = ServerConfig::from_file(path).map_err(|e| refused(path, &e))?;
    if let Some(l) = listen {
        cfg.server.listen = l.parse().map_err(|e| {
            eprintln!("--listen {l:?}: {e}");
            ExitCode::from(2)
        })?;
    }
    cfg.server.allow_unauthenticated |= allow_unauthenticated;
    Ok(cfg)
}

/// A config error printed for the operator, naming the field, and exit code 2.
fn refused(path: &Path, e: &pgw_core::ConfigError) -> ExitCode {
    eprintln!("{}: {e}", path.display());
    eprintln!("field: {}", e.field());
    ExitCode::from(2)
}

async fn serve(cfg: ServerConfig) -> Result<(), pgw_core::BoxError> {
    tracing::info!(version = env!("CARGO_PKG_VERSION"), listen = %cfg.server.listen, "pgw starting");
    // The handlers first, before anything is served: a signal that came between
    // "serving" and the first poll of a lazily registered handler took the default
    // action and killed the process without a drain.
    let shutdown = first_signal();
    if let Err(e) = pgw_server::raise_open_files_limit(cfg.server.max_connections, cfg.server.max_in_flight) {
        tracing::warn!(error = %e, "cannot read or raise the open-files limit");
    }
    let metrics = pgw_server::install_metrics();
    let gateway = pgw_stack::Gateway::builder(cfg.gateway.clone())
        .transport(per_thread_transport)
        .build()
        .await?;
    let server = Server::bind(&cfg, gateway, metrics).await?;
    server.run(shutdown).await
}

/// Exit code after a second signal during a shutdown: 130, a shell's for SIGINT.
const FORCED_EXIT: i32 = 130;

/// The first SIGTERM or SIGINT starts the graceful shutdown; a second one, while it
/// drains, ends the process at once (exit code 130). tokio's signal handling replaces
/// the default action, so without this a second Ctrl-C was ignored for the whole
/// `shutdown_delay_s` + `shutdown_grace_s`, and only SIGKILL stopped the process.
///
/// Both signals are listened to from the call (not from the future's first poll), so
/// neither the first nor a second one sent as soon as the first is taken (the log's
/// "SIGINT received") is missed.
#[cfg(unix)]
fn first_signal() -> impl Future<Output = ()> + Send {
    use tokio::signal::unix::{SignalKind, signal};
    let registered = (signal(SignalKind::interrupt()), signal(SignalKind::terminate()));
    async move {
        let (Ok(mut interrupt), Ok(mut terminate)) = registered else {
            // No signal handling: the portable listener (which waits forever without it).
            pgw_server::shutdown_signal().await;
            return;
        };
        tokio::select! {
            _ = interrupt.recv() => tracing::info!("SIGINT received"),
            _ = terminate.recv() => tracing::info!("SIGTERM received"),
        }
        tokio::spawn(async move {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
            tracing::warn!("second signal: exiting now, without draining");
            std::process::exit(FORCED_EXIT);
        });
    }
}

#[cfg(not(unix))]
async fn first_signal() {
    pgw_server::shutdown_signal().await;
    tokio::spawn(async {
        pgw_server::shutdown_signal().await;
        tracing::warn!("second signal: exiting now, without draining");
        std::process::exit(FORCED_EXIT);
    });
}

/// Each event loop's calls take upstream connections from a pool of that loop's thread,
/// driven by that loop (see `Server::run`).
fn per_thread_transport(source: &SourceConfig) -> Result<BoxTransport, pgw_core::BoxError> {
    let settings = source.settings(&format!("sources ({})", source.name))?;
    Ok(box_transport(HyperTransport::per_thread(
        settings.timeouts.connect,
    )?))
}
