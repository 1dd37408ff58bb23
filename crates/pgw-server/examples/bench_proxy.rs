//! The added latency and CPU of `pgw serve` over calling an upstream directly, on
//! loopback, at concurrency 1. Run through `cargo xtask bench-proxy` (release build).
//!
//! ```text
//! bench_proxy PGW_BINARY [--requests N] [--litellm]
//! ```
//!
//! A minimal upstream in this process answers at once (a fixed completion, or five SSE
//! chunks and `[DONE]`); `pgw serve` runs as a child process over it (memory backend,
//! cache off, one source; with `REDIS_URL` set, a second one on the Redis backend).
//! One keep-alive connection each, requests interleaved in blocks (direct, then
//! through pgw) so drift hits both alike. CPU per request is the pgw process's own
//! user + system time (`/proc/PID/stat`) over the measured requests. With `--litellm`,
//! LiteLLM's proxy (`litellm --config`) on the same upstream, when it is installed.

#![allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, missing_docs)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The client's key: LiteLLM's master key (it refuses to start without a strong one);
/// pgw runs without virtual keys on loopback and ignores it.
const CLIENT_KEY: &str = "sk-bench-5f0c2a9e4b7d41c8a3e6f1b2d9c8e7a6";

const COMPLETION: &str = r#"{"id":"cmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hello! How can I help you today?"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":9,"total_tokens":18}}"#;

fn sse_body() -> String {
    let mut out = String::new();
    for (i, word) in ["Hello", "!", " How", " can", " I"].iter().enumerate() {
        let finish = if i == 4 { "\"stop\"" } else { "null" };
        out.push_str(&format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{word}\"}},\"finish_reason\":{finish}}}]}}\n\n"
        ));
    }
    out.push_str("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":5,\"total_tokens\":14}}\n\n");
    out.push_str("data: [DONE]\n\n");
    out
}

async fn upstream(listener: TcpListener) {
    let sse: Bytes = sse_body().into();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let sse = sse.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                let sse = sse.clone();
                async move {
                    let body = req
                        .into_body()
                        .collect()
                        .await
                        .map(http_body_util::Collected::to_bytes)
                        .unwrap_or_default();
                    let stream = body.windows(13).any(|w| w == b"\"stream\":true");
                    let (ct, bytes) = if stream {
                        ("text/event-stream", sse)
                    } else {
                        ("application/json", Bytes::from_static(COMPLETION.as_bytes()))
                    };
                    Ok::<_, Infallible>(
                        http::Response::builder()
                            .header("content-type", ct)
                            .body(Full::new(bytes))
                            .unwrap_or_default(),
                    )
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

struct Client {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    addr: SocketAddr,
    path: String,
}

impl Client {
    async fn connect(addr: SocketAddr, path: &str) -> Result<Self, BoxError> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        Ok(Self {
            sender,
            addr,
            path: path.to_owned(),
        })
    }

    /// One call, timed to the end of its body.
    async fn call(&mut self, body: &Bytes) -> Result<Duration, BoxError> {
        let req = http::Request::post(&self.path)
            .header("host", "bench")
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {CLIENT_KEY}"))
            .body(Full::new(body.clone()))?;
        // A server that closed the idle connection (uvicorn after 5 s) is reconnected
        // before the clock starts, as a pooling client would.
        if self.sender.is_closed() || self.sender.ready().await.is_err() {
            *self = Self::connect(self.addr, &self.path).await?;
        }
        let started = Instant::now();
        let resp = self.sender.send_request(req).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        let took = started.elapsed();
        if status != 200 {
            return Err(format!("status {status}: {}", String::from_utf8_lossy(&bytes)).into());
        }
        Ok(took)
    }
}

fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

struct Row {
    name: String,
    p50: f64,
    p99: f64,
    added_p50: f64,
    added_p99: f64,
    cpu_us: Option<f64>,
}

async fn wait_healthy(addr: SocketAddr, path: &str) -> Result<(), BoxError> {
    for _ in 0..600 {
        if let Ok(stream) = TcpStream::connect(addr).await
            && let Ok((mut s, conn)) =
                hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(stream)).await
        {
            tokio::spawn(conn);
            let req = http::Request::get(path)
                .header("host", "bench")
                .body(Full::new(Bytes::new()))?;
            if let Ok(r) = s.send_request(req).await
                && r.status().is_success()
            {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("{addr}{path} never became healthy").into())
}

fn free_port() -> Result<u16, BoxError> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

struct Proxy {
    name: String,
    child: Child,
    addr: SocketAddr,
    path: String,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_pgw(bin: &str, name: &str, upstream: SocketAddr, top: &str) -> Result<Proxy, BoxError> {
    let port = free_port()?;
    let dir = std::env::temp_dir().join(format!("pgw-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!(
            "{top}\n[server]\nlisten = \"127.0.0.1:{port}\"\nheader_read_timeout_s = 600\n\n[cache]\nenabled = false\n\n[[sources]]\nname = \"up\"\nbase_url = \"http://{upstream}/v1\"\nkey = \"sk-bench\"\n"
        ),
    )?;
    let child = Command::new(bin)
        .args(["serve", "--config"])
        .arg(&path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()?;
    Ok(Proxy {
        name: name.to_owned(),
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        path: "/v1/chat/completions".into(),
    })
}

fn spawn_litellm(upstream: SocketAddr) -> Result<Proxy, BoxError> {
    let port = free_port()?;
    let dir = std::env::temp_dir().join(format!("pgw-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("litellm.yaml");
    std::fs::write(
        &path,
        format!(
            "model_list:\n  - model_name: m\n    litellm_params:\n      model: openai/m\n      api_base: http://{upstream}/v1\n      api_key: sk-bench\n"
        ),
    )?;
    let child = Command::new("litellm")
        .args(["--config"])
        .arg(&path)
        .args([
            "--port",
            &port.to_string(),
            "--host",
            "127.0.0.1",
            "--num_workers",
            "1",
        ])
        .env("LITELLM_LOG", "ERROR")
        .env("LITELLM_MASTER_KEY", CLIENT_KEY)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    Ok(Proxy {
        name: "litellm".into(),
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        path: "/v1/chat/completions".into(),
    })
}

/// Interleaved blocks: direct, then through each proxy; the latencies of each.
async fn measure(
    upstream: SocketAddr,
    proxies: &[Proxy],
    body: &Bytes,
    requests: usize,
) -> Result<(Vec<Duration>, Vec<(Vec<Duration>, Option<f64>)>), BoxError> {
    let mut direct = Client::connect(upstream, "/v1/chat/completions").await?;
    let mut clients = Vec::new();
    for p in proxies {
        clients.push(Client::connect(p.addr, &p.path).await?);
    }
    for _ in 0..200 {
        direct.call(body).await?;
        for c in &mut clients {
            c.call(body).await?;
        }
    }
    let tck = clk_tck();
    let mut d = Vec::with_capacity(requests);
    let mut through: Vec<(Vec<Duration>, u64)> = proxies.iter().map(|_| (Vec::new(), 0)).collect();
    let block = 250;
    let mut done = 0;
    while done < requests {
        let n = block.min(requests - done);
        for _ in 0..n {
            d.push(direct.call(body).await?);
        }
        for ((c, p), (lat, ticks)) in clients.iter_mut().zip(proxies).zip(&mut through) {
            let before = cpu_ticks(p.child.id());
            for _ in 0..n {
                lat.push(c.call(body).await?);
            }
            if let (Some(b), Some(a)) = (before, cpu_ticks(p.child.id())) {
                *ticks += a - b;
            }
        }
        done += n;
    }
    let out = through
        .into_iter()
        .map(|(lat, ticks)| {
            let cpu = (ticks > 0).then(|| ticks as f64 / tck / lat.len() as f64 * 1e6);
            (lat, cpu)
        })
        .collect();
    Ok((d, out))
}

fn rows(
    label: &str,
    direct: &mut [Duration],
    through: Vec<(Vec<Duration>, Option<f64>)>,
    proxies: &[Proxy],
) -> Vec<Row> {
    direct.sort();
    let (d50, d99) = (pct(direct, 0.5), pct(direct, 0.99));
    let mut out = vec![Row {
        name: format!("direct ({label})"),
        p50: d50,
        p99: d99,
        added_p50: 0.0,
        added_p99: 0.0,
        cpu_us: None,
    }];
    for ((mut lat, cpu), p) in through.into_iter().zip(proxies) {
        lat.sort();
        let (p50, p99) = (pct(&lat, 0.5), pct(&lat, 0.99));
        out.push(Row {
            name: format!("{} ({label})", p.name),
            p50,
            p99,
            added_p50: p50 - d50,
            added_p99: p99 - d99,
            cpu_us: cpu,
        });
    }
    out
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let bin = args
        .next()
        .ok_or("usage: bench_proxy PGW_BINARY [--requests N] [--litellm]")?;
    let mut requests = 3000;
    let mut litellm = false;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--requests" => requests = args.next().ok_or("--requests N")?.parse()?,
            "--litellm" => litellm = true,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let up = listener.local_addr()?;
    tokio::spawn(upstream(listener));

    let mut proxies = vec![spawn_pgw(&bin, "pgw memory", up, "")?];
    if let Ok(url) = std::env::var("REDIS_URL") {
        let top = format!(
            "backend = \"redis\"\nredis_url = \"{url}\"\nkey_prefix = \"pgwbench:{}\"\n",
            std::process::id()
        );
        proxies.push(spawn_pgw(&bin, "pgw redis", up, &top)?);
    } else {
        eprintln!("REDIS_URL not set: the Redis backend is not measured");
    }
    if litellm {
        match spawn_litellm(up) {
            Ok(p) => proxies.push(p),
            Err(e) => eprintln!("LiteLLM's proxy did not start ({e}): not measured"),
        }
    }
    for p in &proxies {
        let health = if p.name == "litellm" {
            "/health/liveliness"
        } else {
            "/healthz"
        };
        wait_healthy(p.addr, health).await?;
    }
    let json =
        Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":16}"#);
    let stream = Bytes::from_static(
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":16,"stream":true}"#,
    );
    let mut table = Vec::new();
    let (mut d, t) = measure(up, &proxies, &json, requests).await?;
    table.extend(rows("json", &mut d, t, &proxies));
    let (mut d, t) = measure(up, &proxies, &stream, requests).await?;
    table.extend(rows("stream", &mut d, t, &proxies));

    println!("concurrency 1, {requests} requests each, loopback, release build");
    println!();
    println!("| path | p50 ms | p99 ms | added p50 ms | added p99 ms | CPU/request us |");
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &table {
        let cpu = r.cpu_us.map_or_else(|| "-".to_owned(), |c| format!("{c:.0}"));
        println!(
            "| {} | {:.3} | {:.3} | {:+.3} | {:+.3} | {cpu} |",
            r.name, r.p50, r.p99, r.added_p50, r.added_p99
        );
    }
    Ok(())
}
