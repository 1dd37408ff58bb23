//! What the examples of this package share: a gateway from `PGW_CONFIG` (a TOML file,
//! with `PGW__...` overrides), or, when it is unset, over a simulated provider served
//! on loopback, so every example runs on a machine with no provider key.
//!
//! ```text
//! cargo run -p pgw-examples --example axum_app       # an axum handler calling the gateway
//! cargo run -p pgw-examples --example openai_proxy   # pgw-server: an OpenAI-compatible server
//! cargo run -p pgw-examples --example tower_service  # the gateway inside a plain tower stack
//! ```

use pgw_core::BoxError;
use pgw_stack::{Gateway, GatewayConfig, SecretKey, SourceConfig};

/// The simulated provider behind the examples, kept alive as long as this handle.
pub type Simulator = pgw_sim::http::ServerHandle;

/// The gateway configuration of `PGW_CONFIG` when set, else two simulated sources on
/// loopback (`sim-a` healthy, `sim-hole` a black hole) and the simulator serving them.
///
/// # Errors
/// The config file does not load, or the simulator cannot bind a loopback port.
pub async fn gateway_config() -> Result<(GatewayConfig, Option<Simulator>), BoxError> {
    if let Ok(path) = std::env::var("PGW_CONFIG") {
        return Ok((GatewayConfig::from_file(path)?, None));
    }
    let quick = pgw_sim::config::LogNormal {
        median: 0.3,
        p95: 0.8,
        min: 0.1,
        max: 2.0,
    };
    let sources = vec![
        pgw_sim::SourceConfig {
            ttft_s: quick.into(),
            ..pgw_sim::SourceConfig::healthy("sim-a")
        },
        pgw_sim::SourceConfig {
            black_hole_rate: 1.0.into(),
            ..pgw_sim::SourceConfig::healthy("sim-hole")
        },
    ];
    let pool = pgw_sim::SimPool::new(
        pgw_sim::PoolConfig {
            sources,
            bad_prompt_rate: 0.0,
            ..pgw_sim::PoolConfig::default()
        },
        1,
    )?;
    let (_, server) = pgw_sim::http::serve(pool, "127.0.0.1:0".parse()?).await?;
    let mut config = GatewayConfig::default();
    for name in ["sim-a", "sim-hole"] {
        let mut s = SourceConfig::new(name, server.base_url(name), SecretKey::new("sk-example"));
        s.first_token_timeout_s = Some(5.0);
        s.total_timeout_s = Some(10.0);
        config.sources.push(s);
    }
    config.telemetry.tracing = true;
    Ok((config, Some(server)))
}

/// A gateway built from [`gateway_config`].
///
/// # Errors
/// As [`gateway_config`], or the gateway cannot be built (Redis unreachable, ...).
pub async fn gateway() -> Result<(Gateway, Option<Simulator>), BoxError> {
    let (config, sim) = gateway_config().await?;
    Ok((Gateway::from_config(config).await?, sim))
}
