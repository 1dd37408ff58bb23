// Shared by the examples: a gateway from `PGW_CONFIG` (a TOML file, with `PGW__...`
// overrides), or, when unset, over a simulated provider served on loopback.

use pgw_core::BoxError;
use pgw_stack::{Gateway, GatewayConfig, SecretKey, SourceConfig};

pub(crate) async fn gateway() -> Result<(Gateway, Option<pgw_sim::http::ServerHandle>), BoxError> {
    if let Ok(path) = std::env::var("PGW_CONFIG") {
        let config = GatewayConfig::from_file(path)?;
        return Ok((Gateway::from_config(config).await?, None));
    }
    // No config: two simulated sources on loopback, one of them a black hole.
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
    Ok((Gateway::from_config(config).await?, Some(server)))
}
