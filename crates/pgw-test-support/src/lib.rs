//! Test helpers shared by the pgw crates.
//!
//! Redis tests run against real servers started by `cargo xtask test`, which exports
//! `REDIS_URL` (a standalone server) and `REDIS_CLUSTER_NODES` (a comma-separated list
//! of the nodes of a 3-node cluster). A test that needs Redis and finds none **fails**
//! with a message saying how to run it; it never passes silently. The only way to skip
//! is to say so explicitly with `PGW_SKIP_REDIS=1`, which is refused when `CI` is set.

use std::env;

const HOW: &str = "run the suite with `cargo xtask test`, which starts a throwaway Redis \
                   and a 3-node cluster on loopback and exports REDIS_URL and REDIS_CLUSTER_NODES";

fn skip_allowed(var: &str) -> bool {
    let ci = env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "0" && v != "false");
    let skip = env::var_os("PGW_SKIP_REDIS").is_some_and(|v| v == "1");
    if ci || !skip {
        panic!("{var} is not set: this test needs a real Redis; {HOW}");
    }
    eprintln!("{var} is not set and PGW_SKIP_REDIS=1: skipping this Redis test");
    true
}

/// The URL of the standalone test Redis (`REDIS_URL`).
///
/// Returns `None` only when `PGW_SKIP_REDIS=1` is set outside CI; otherwise a missing
/// server makes the calling test panic with instructions.
#[must_use]
pub fn redis_url() -> Option<String> {
    match env::var("REDIS_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            skip_allowed("REDIS_URL");
            None
        }
    }
}

/// The node URLs of the 3-node test cluster (`REDIS_CLUSTER_NODES`, comma-separated).
///
/// Same contract as [`redis_url`].
#[must_use]
pub fn redis_cluster_nodes() -> Option<Vec<String>> {
    match env::var("REDIS_CLUSTER_NODES") {
        Ok(nodes) if !nodes.is_empty() => Some(
            nodes
                .split(',')
                .map(|n| {
                    let n = n.trim();
                    if n.starts_with("redis://") {
                        n.to_owned()
                    } else {
                        format!("redis://{n}")
                    }
                })
                .collect(),
        ),
        _ => {
            skip_allowed("REDIS_CLUSTER_NODES");
            None
        }
    }
}

/// A key prefix unique to this test run and name, so tests sharing one server never
/// see each other's keys.
#[must_use]
pub fn unique_prefix(test: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("pgwtest:{}:{}:{test}:{n}", std::process::id(), nanos())
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}
