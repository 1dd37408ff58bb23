//! Shared by the gateway suites: a gateway whose sources are the simulator's, in
//! process (the simulator's wire bytes, tokio's clock).

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use pgw_core::BoxError;
use pgw_sim::SimPool;
use pgw_stack::client::box_transport;
use pgw_stack::{Gateway, GatewayConfig, MemorySink, SourceConfig};

/// `cfg` built with every source's transport the simulated source of its name, and
/// attempt telemetry into `sink`.
pub async fn sim_gateway(pool: &SimPool, cfg: GatewayConfig, sink: &MemorySink) -> Gateway {
    let p = pool.clone();
    Gateway::builder(cfg)
        .sink(Arc::new(sink.clone()))
        .transport(move |sc: &SourceConfig| -> Result<_, BoxError> {
            Ok(box_transport(p.service(&sc.name).ok_or("unknown sim source")?))
        })
        .build()
        .await
        .unwrap()
}
