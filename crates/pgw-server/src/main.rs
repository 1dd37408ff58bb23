//! `pgw`: the pgw gateway as an OpenAI-compatible server.
//!
//! ```text
//! pgw serve --config pgw.toml [--listen 127.0.0.1:8080] [--allow-unauthenticated] [--log-format json]
//! pgw check --config pgw.toml
//! pgw hash-key [KEY]            # or the key on standard input
//! ```

use std::io::Read;
use std::path::PathBuf;
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
    /// Validate a configuration and print it with its secrets redacted.
    Check {
        /// The configuration file.
        #[arg(long, short)]
        config: PathBuf,
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
        Command::Check { config } => match ServerConfig::from_file(&config) {
            Ok(cfg) => {
                println!("{}: ok", config.display());
                println!("{cfg:#?}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{}: {e}", config.display());
                eprintln!("field: {}", e.field());
                ExitCode::from(2)
            }
        },
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
            let mut cfg = match ServerConfig::from_file(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{}: {e}", config.display());
                    return ExitCode::from(2);
                }
            };
            if let Some(l) = listen {
                match l.parse() {
                    Ok(addr) => cfg.server.listen = addr,
                    Err(e) => {
                        eprintln!("--listen {l:?}: {e}");
                        return ExitCode::from(2);
                    }
                }
            }
            cfg.server.allow_unauthenticated |= allow_unauthenticated;
            pgw_server::init_logging(log_format.unwrap_or(cfg.server.log_format));
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
                    tracing::error!(error = %e, "pgw serve failed");
                    eprintln!("pgw serve: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

async fn serve(cfg: ServerConfig) -> Result<(), pgw_core::BoxError> {
    let metrics = pgw_server::install_metrics();
    let gateway = pgw_stack::Gateway::builder(cfg.gateway.clone())
        .transport(per_thread_transport)
        .build()
        .await?;
    let server = Server::bind(&cfg, gateway, metrics).await?;
    server.run(pgw_server::shutdown_signal()).await
}

/// Each event loop's calls take upstream connections from a pool of that loop's thread,
/// driven by that loop (see `Server::run`).
fn per_thread_transport(source: &SourceConfig) -> Result<BoxTransport, pgw_core::BoxError> {
    let settings = source.settings(&format!("sources ({})", source.name))?;
    Ok(box_transport(HyperTransport::per_thread(
        settings.timeouts.connect,
    )?))
}
