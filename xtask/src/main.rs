//! Project automation for the pgw workspace.
//!
//! - `cargo xtask test`: installs redis-server when missing, starts a throwaway
//!   standalone Redis and a 3-node Redis Cluster on free loopback ports, installs the
//!   official OpenAI Python SDK into a venv under `target/` when missing (for the SDK
//!   check in `tests/openai_sdk.rs`), runs the whole test suite, stops the servers,
//!   exits with the tests' status.
//! - `cargo xtask lint`: fmt, clippy `-D warnings`, rustdoc `-D warnings`.
//! - `cargo xtask ci`: exactly what CI does (`.ci/run`): `cargo xtask lint`, then `cargo xtask test`.
//! - `cargo xtask soak`: the soak, P6 by default (see the `pgw-soak` crate; `-- --scenario NAME`, `-- --matrix`).
//! - `cargo xtask redis`: starts the same servers and waits, for running tests by hand.
//! - `cargo xtask bench-proxy`: added latency and CPU of `pgw serve` over a minimal
//!   upstream on loopback (release build; `REDIS_URL` adds the Redis backend,
//!   `-- --litellm` LiteLLM's proxy when installed).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod redis;
mod sdk;

#[derive(Parser)]
#[command(about = "pgw project automation")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start Redis (standalone + 3-node cluster) on loopback, run the whole test suite.
    Test {
        /// Extra arguments passed to `cargo test` (after `--workspace --all-features`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run exactly what CI runs: `cargo xtask lint`, then `cargo xtask test`.
    Ci,
    /// The lints: `cargo fmt --check`, clippy `-D warnings`, rustdoc `-D warnings`.
    Lint,
    /// Run the soak (P6 by default) on the simulated fault pool and print the scoreboard.
    Soak {
        /// Arguments for the soak (see `cargo xtask soak -- --help`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Start the test servers, print their addresses, and wait for Ctrl-C.
    Redis,
    /// Measure `pgw serve` against calling a minimal upstream directly (release build).
    BenchProxy {
        /// Arguments for the bench (`--requests N`, `--litellm`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Test { args } => test(&args),
        Cmd::Ci => ci(),
        Cmd::Lint => lint(),
        Cmd::Soak { args } => soak(&args),
        Cmd::Redis => redis::serve_forever(),
        Cmd::BenchProxy { args } => bench_proxy(&args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

type Result<T> = std::result::Result<T, String>;

fn cargo() -> std::process::Command {
    std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn status_code(status: std::process::ExitStatus) -> ExitCode {
    match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
        None => ExitCode::FAILURE,
    }
}

fn test(args: &[String]) -> Result<ExitCode> {
    let sdk = sdk::python()?;
    let servers = redis::Servers::start()?;
    eprintln!(
        "xtask: REDIS_URL={} REDIS_CLUSTER_NODES={}",
        servers.standalone_url(),
        servers.cluster_nodes()
    );
    let mut cmd = cargo();
    if let Some(python) = &sdk {
        cmd.env("PGW_SDK_PYTHON", python);
    }
    let status = cmd
        .args(["test", "--workspace", "--all-features"])
        .args(args)
        .env("REDIS_URL", servers.standalone_url())
        .env("REDIS_CLUSTER_NODES", servers.cluster_nodes())
        .env("PGW_REDIS_CLI", redis::cli_path())
        .status()
        .map_err(|e| format!("cannot run cargo test: {e}"))?;
    drop(servers);
    Ok(status_code(status))
}

/// One lint step of CI.
struct Lint {
    name: &'static str,
    args: &'static [&'static str],
    rustdocflags: bool,
}

const LINTS: [Lint; 3] = [
    Lint {
        name: "fmt",
        args: &["fmt", "--all", "--", "--check"],
        rustdocflags: false,
    },
    Lint {
        name: "clippy",
        args: &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--all-features",
            "--",
            "-D",
            "warnings",
        ],
        rustdocflags: false,
    },
    Lint {
        name: "doc",
        args: &["doc", "--workspace", "--no-deps", "--all-features"],
        rustdocflags: true,
    },
];

fn lint() -> Result<ExitCode> {
    for step in &LINTS {
        eprintln!("xtask lint: cargo {}", step.args.join(" "));
        let mut cmd = cargo();
        cmd.args(step.args);
        if step.rustdocflags {
            cmd.env("RUSTDOCFLAGS", "-D warnings");
        }
        let status = cmd
            .status()
            .map_err(|e| format!("cannot run cargo {}: {e}", step.name))?;
        if !status.success() {
            eprintln!("xtask lint: {} failed", step.name);
            return Ok(status_code(status));
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn ci() -> Result<ExitCode> {
    let code = lint()?;
    if code != ExitCode::SUCCESS {
        return Ok(code);
    }
    test(&[])
}

fn soak(args: &[String]) -> Result<ExitCode> {
    // The soak runs hours of virtual time; it is built with optimizations so the default
    // 8000-call run takes seconds, not minutes.
    let status = cargo()
        .args(["run", "--quiet", "--release", "--package", "pgw-soak", "--"])
        .args(args)
        .status()
        .map_err(|e| format!("cannot run the soak: {e}"))?;
    Ok(status_code(status))
}

fn bench_proxy(args: &[String]) -> Result<ExitCode> {
    let status = cargo()
        .args([
            "build",
            "--quiet",
            "--release",
            "--package",
            "pgw-server",
            "--bin",
            "pgw",
            "--example",
            "bench_proxy",
        ])
        .status()
        .map_err(|e| format!("cannot build the bench: {e}"))?;
    if !status.success() {
        return Ok(status_code(status));
    }
    let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".to_owned());
    let release = std::path::Path::new(&target).join("release");
    let status = std::process::Command::new(release.join("examples").join("bench_proxy"))
        .arg(release.join("pgw"))
        .args(args)
        .status()
        .map_err(|e| format!("cannot run the bench: {e}"))?;
    Ok(status_code(status))
}
