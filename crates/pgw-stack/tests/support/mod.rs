//! Shared by the gateway suites: a gateway whose sources are the simulator's, in
//! process (the simulator's wire bytes, tokio's clock).

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use pgw_core::BoxError;
use pgw_sim::SimPool;
use pgw_stack::client::{BoxTransport, box_transport};
use pgw_stack::{Gateway, GatewayConfig, MemorySink, SourceConfig};

/// `cfg` built with every source's transport the simulated source of its name, and
/// attempt telemetry into `sink`.
pub async fn sim_gateway(pool: &SimPool, cfg: GatewayConfig, sink: &MemorySink) -> Gateway {
    sim_gateway_with(pool, cfg, sink, |sim| sim).await
}

/// As [`sim_gateway`], each source's simulated transport passed through `wrap` (a
/// fault of the process's own in front of it, say).
pub async fn sim_gateway_with(
    pool: &SimPool,
    cfg: GatewayConfig,
    sink: &MemorySink,
    wrap: impl Fn(BoxTransport) -> BoxTransport + Send + Sync + 'static,
) -> Gateway {
    let p = pool.clone();
    Gateway::builder(cfg)
        .sink(Arc::new(sink.clone()))
        .transport(move |sc: &SourceConfig| -> Result<_, BoxError> {
            Ok(wrap(box_transport(
                p.service(&sc.name).ok_or("unknown sim source")?,
            )))
        })
        .build()
        .await
        .unwrap()
}
