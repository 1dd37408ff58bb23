// Shared by the server suites: the simulator served over HTTP on 127.0.0.1, a gateway
// over it, a pgw-server in front, and a small HTTP/1 client (one connection per call).

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use pgw_core::BoxError;
use pgw_server::{Server, ServerConfig};
use pgw_sim::config::LogNormal;
use pgw_sim::http::ServerHandle;
use pgw_sim::{PoolConfig, SimPool};
use pgw_stack::Gateway;
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const UPSTREAM_KEY: &str = "sk-upstream-secret-0123456789";
pub const CLIENT_KEY: &str = "pgw-client-key-abc";

pub fn quick(median: f64) -> LogNormal {
    LogNormal {
        median,
        p95: median * 1.2,
        min: median / 2.0,
        max: median * 1.5,
    }
}

/// A healthy simulated source answering within a few virtual milliseconds.
pub fn fast(name: &str) -> pgw_sim::SourceConfig {
    pgw_sim::SourceConfig {
        api_key: Some(UPSTREAM_KEY.into()),
        ttft_s: quick(0.02).into(),
        tokens_per_second: quick(2000.0).into(),
        error_latency_s: quick(0.01).into(),
        ..pgw_sim::SourceConfig::healthy(name)
    }
}

/// A source whose first token takes `ttft` seconds.
pub fn slow(name: &str, ttft: f64) -> pgw_sim::SourceConfig {
    pgw_sim::SourceConfig {
        ttft_s: quick(ttft).into(),
        ..fast(name)
    }
}

pub struct Harness {
    pub addr: SocketAddr,
    pub gateway: Gateway,
    pub pool: SimPool,
    shutdown: Option<oneshot::Sender<()>>,
    pub task: Option<JoinHandle<Result<(), BoxError>>>,
    _sim: ServerHandle,
}

impl Harness {
    /// Triggers the shutdown as SIGTERM would.
    pub fn shutdown(&mut self) {
        self.shutdown.take();
    }

    /// Waits for `run` to return.
    pub async fn stopped(&mut self) -> Result<(), BoxError> {
        self.shutdown();
        match self.task.take() {
            Some(t) => t.await.unwrap(),
            None => Ok(()),
        }
    }
}

/// The config text of a server over `sim`: `[server]` listening on any loopback port
/// with one event loop, then `server` (more `[server]` lines, then any
/// `[[server.keys]]`), then the gateway.
/// The watchdogs are long: on the paused clock, time jumps to the next timer whenever
/// every task waits, including while bytes are on their way through a loopback socket;
/// a short watchdog would then cut a healthy stream between two chunks.
pub fn config_text(server: &str, sim: &ServerHandle, sources: &[pgw_sim::SourceConfig]) -> String {
    // One event loop, the test's runtime, unless the test asks for more: further loops
    // have runtimes (and clocks) of their own, out of a paused clock's reach.
    let threads = if server.contains("threads") {
        ""
    } else {
        "threads = 1\n"
    };
    let mut text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n{threads}{server}\n\n[cache]\nenabled = false\n\n[balance]\nmax_wait_s = 0.5\nseed = 1\n\n[retry]\nbase_backoff_s = 0.01\nmax_backoff_s = 0.02\n\n"
    );
    for s in sources {
        text.push_str(&format!(
            "[[sources]]\nname = \"{0}\"\nbase_url = \"{1}\"\nkey = \"{UPSTREAM_KEY}\"\nfirst_token_timeout_s = 300\ninter_token_timeout_s = 300\ntotal_timeout_s = 600\n\n",
            s.name,
            sim.base_url(&s.name)
        ));
    }
    text
}

pub async fn start(server: &str, sources: Vec<pgw_sim::SourceConfig>) -> Harness {
    start_with("", server, sources).await
}

/// As [`start`], with top-level gateway keys (`backend = "redis"`, ...) first.
pub async fn start_with(top: &str, server: &str, sources: Vec<pgw_sim::SourceConfig>) -> Harness {
    start_edited(top, server, sources, |t| t).await
}

/// As [`start_with`], with the configuration's text passed through `edit` first.
pub async fn start_edited(
    top: &str,
    server: &str,
    sources: Vec<pgw_sim::SourceConfig>,
    edit: impl FnOnce(String) -> String,
) -> Harness {
    let pool = SimPool::new(PoolConfig::of(sources.clone()), 7).unwrap();
    let (_, sim) = pgw_sim::http::serve(pool.clone(), "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let text = edit(format!("{top}\n{}", config_text(server, &sim, &sources)));
    let config = ServerConfig::from_toml_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let gateway = Gateway::from_config(config.gateway.clone()).await.unwrap();
    let server = Server::bind(&config, gateway.clone(), pgw_server::install_metrics())
        .await
        .unwrap();
    let addr = server.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(server.run(async move {
        let _ = rx.await;
    }));
    Harness {
        addr,
        gateway,
        pool,
        shutdown: Some(tx),
        task: Some(task),
        _sim: sim,
    }
}

/// Sends one request on a new connection; the response with its body still streaming.
pub async fn send(addr: SocketAddr, req: Request<Full<Bytes>>) -> http::Response<Incoming> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender.send_request(req).await.unwrap()
}

pub fn request(method: &str, path: &str) -> http::request::Builder {
    Request::builder()
        .method(method)
        .uri(path)
        .header("host", "pgw.test")
}

/// One whole call: status, headers, body.
pub async fn call(
    addr: SocketAddr,
    req: http::request::Builder,
    body: impl Into<Bytes>,
) -> (StatusCode, HeaderMap, Bytes) {
    let resp = send(addr, req.body(Full::new(body.into())).unwrap()).await;
    let (parts, body) = resp.into_parts();
    let bytes = body
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .unwrap_or_default();
    (parts.status, parts.headers, bytes)
}

pub fn chat_body(model: &str, stream: bool) -> Bytes {
    let mut req = pgw_core::openai::ChatRequest::user(model, "hello there");
    req.stream = stream;
    req.max_tokens = Some(40);
    Bytes::from(serde_json::to_vec(&req).unwrap())
}

pub fn chat(key: Option<&str>) -> http::request::Builder {
    let b = request("POST", "/v1/chat/completions").header("content-type", "application/json");
    match key {
        Some(k) => b.header("authorization", format!("Bearer {k}")),
        None => b,
    }
}

/// Asserts `body` is an OpenAI error with `code`; returns it.
pub fn openai_error(body: &[u8], code: &str) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(body)));
    let err = v.get("error").unwrap_or_else(|| panic!("no error field: {v}"));
    for field in ["message", "type", "param", "code"] {
        assert!(err.get(field).is_some(), "error.{field} missing: {v}");
    }
    assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(err["code"], code, "{v}");
    v
}

/// The events of an SSE body: `data` payloads, and `:keep-alive` comments as ":".
pub fn events(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            if e.starts_with(':') {
                ":".to_owned()
            } else {
                e.strip_prefix("data: ").unwrap_or(e).to_owned()
            }
        })
        .collect()
}

/// A config of one `[[server.keys]]` for `CLIENT_KEY` with `extra` lines.
pub fn key_toml(label: &str, key: &str, extra: &str) -> String {
    format!(
        "[[server.keys]]\nlabel = \"{label}\"\nsha256 = \"{}\"\n{extra}\n",
        pgw_server::hash_key(key)
    )
}

/// Requests the simulated pool has received so far.
pub fn upstream_requests(h: &Harness) -> u64 {
    h.pool.stats().sources.values().map(|s| s.received).sum()
}
