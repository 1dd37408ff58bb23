//! The added latency and CPU of `pgw serve` over calling an upstream directly, on
//! loopback, at concurrency 1. Run through `cargo xtask bench-proxy` (release build).
//!
//! ```text
//! bench_proxy PGW_BINARY [--requests N] [--litellm] [--placement both|same|other|none]
//! bench_proxy --upstream PORT                 # the upstream alone (for profilers)
//! bench_proxy --forwarder UPSTREAM_ADDR PORT  # the bare forwarder alone
//! ```
//!
//! A minimal upstream in this process answers at once (a fixed completion, or five SSE
//! chunks and `[DONE]`); `pgw serve` runs as a child process over it (memory backend,
//! cache off, one source; with `REDIS_URL` set, a second one on the Redis backend).
//! One keep-alive connection each, requests interleaved in blocks (direct, then
//! through pgw) so drift hits both alike. CPU per request is the pgw process's own
//! run time over the measured requests, summed over its threads in nanoseconds
//! (`/proc/PID/task/*/schedstat`; `/proc/PID/stat` counts in 10 ms ticks, a third of
//! the whole budget of 1000 calls). With `--litellm`, LiteLLM's proxy
//! (`litellm --config`) on the same upstream, when it is installed.
//!
//! Beside them, the floor: a bare forwarder (this binary run with `--forwarder`, its own
//! process): hyper's server and hyper-util's pooled client on one current-thread
//! runtime, as pgw runs, passing the request and the answer through as bytes, with no
//! parsing, no policy and no telemetry. Its CPU per request is what any hyper-based
//! proxy pays on this machine; pgw's is quoted as a multiple of it, a ratio that moves
//! far less between machines than the microseconds do. With LiteLLM measured, the
//! table is followed by LiteLLM's CPU per request over pgw's, per block: whole, and
//! above the forwarder's (what each proxy adds to that floor).
//!
//! On a VM the CPU figure depends mostly on whether the scheduler puts pgw on the
//! bench client's core (a wake-up across cores is dear), so the concurrency-1 table
//! is measured with the placement fixed by `taskset`: this process on the first CPU,
//! every proxy's threads on the same CPU (`same`), on the second (`other`), or each in
//! turn (`both`, the default when there are two CPUs and `taskset`); `none` leaves it
//! to the scheduler. The rest runs unpinned.
//!
//! Then, for each path: the most requests/s whose p99 stays <= 20 ms (closed loops of
//! 1, 2, 4, ... keep-alive connections); the first-chunk latency and the gaps between
//! chunks of a long stream (100 chunks 2 ms apart), pgw against direct; and the pgw
//! process's resident memory (`/proc/PID/statm`) before, while and after it streams a
//! 64k-token answer.

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

/// One SSE chunk event carrying `word`.
fn chunk_event(word: &str) -> Bytes {
    Bytes::from(format!(
        "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{word}\"}},\"finish_reason\":null}}]}}\n\n"
    ))
}

const LAST_EVENTS: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":5,\"total_tokens\":14}}\n\ndata: [DONE]\n\n";

/// Chunks of a long stream (`"long"` in the prompt): `LONG_CHUNKS` events `LONG_GAP` apart.
const LONG_CHUNKS: usize = 100;
const LONG_GAP: Duration = Duration::from_millis(2);
/// Chunks of a huge stream (`"huge"` in the prompt): a 64k-token answer, sent as fast
/// as the reader takes it.
const HUGE_CHUNKS: usize = 65_536;

type UpBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

fn paced(n: usize, gap: Option<Duration>) -> UpBody {
    let events = futures_util::stream::unfold(0usize, move |i| async move {
        if i > n {
            return None;
        }
        if i == n {
            return Some((
                Ok(hyper::body::Frame::data(Bytes::from_static(
                    LAST_EVENTS.as_bytes(),
                ))),
                i + 1,
            ));
        }
        if let Some(g) = gap
            && i > 0
        {
            tokio::time::sleep(g).await;
        }
        Some((
            Ok(hyper::body::Frame::data(chunk_event(if i % 2 == 0 {
                "tok"
            } else {
                "en "
            }))),
            i + 1,
        ))
    });
    BodyExt::boxed(http_body_util::StreamBody::new(events))
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
                    let has = |s: &[u8]| body.windows(s.len()).any(|w| w == s);
                    let stream = has(b"\"stream\":true");
                    let (ct, bytes): (&str, UpBody) = if stream && has(b"long") {
                        ("text/event-stream", paced(LONG_CHUNKS, Some(LONG_GAP)))
                    } else if stream && has(b"huge") {
                        ("text/event-stream", paced(HUGE_CHUNKS, None))
                    } else if stream {
                        ("text/event-stream", Full::new(sse).boxed())
                    } else {
                        (
                            "application/json",
                            Full::new(Bytes::from_static(COMPLETION.as_bytes())).boxed(),
                        )
                    };
                    Ok::<_, Infallible>(
                        http::Response::builder()
                            .header("content-type", ct)
                            .body(bytes)
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

/// The floor (see the crate docs): every request on `listener` forwarded to
/// `upstream` through a pooled client, the answer's body streamed back as it comes.
async fn forwarder(listener: TcpListener, upstream: SocketAddr) {
    let client: hyper_util::client::legacy::Client<_, Incoming> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build({
            let mut c = hyper_util::client::legacy::connect::HttpConnector::new();
            c.set_nodelay(true);
            c
        });
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let client = client.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: http::Request<Incoming>| {
                let client = client.clone();
                let (mut parts, body) = req.into_parts();
                let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                let uri = format!("http://{upstream}{path}").parse::<http::Uri>();
                // A concrete error type: hyper's server cannot take a boxed one here.
                async move {
                    parts.uri = uri.map_err(std::io::Error::other)?;
                    client
                        .request(http::Request::from_parts(parts, body))
                        .await
                        .map_err(std::io::Error::other)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// Runs this binary as the floor forwarder on a free port of loopback.
fn spawn_forwarder(upstream: SocketAddr) -> Result<Proxy, BoxError> {
    let port = free_port()?;
    let child = Command::new(std::env::current_exe()?)
        .args(["--forwarder", &upstream.to_string(), &port.to_string()])
        .stdout(Stdio::null())
        .spawn()?;
    Ok(Proxy {
        name: FLOOR.into(),
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        path: "/v1/chat/completions".into(),
    })
}

/// The floor's name in the tables.
const FLOOR: &str = "bare forwarder";

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

    /// The request for `body`, on a connection ready to send it: a server that closed
    /// the idle connection (uvicorn after 5 s) is reconnected before the clock starts,
    /// as a pooling client would.
    async fn ready_request(&mut self, body: &Bytes) -> Result<http::Request<Full<Bytes>>, BoxError> {
        let req = http::Request::post(&self.path)
            .header("host", "bench")
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {CLIENT_KEY}"))
            .body(Full::new(body.clone()))?;
        if self.sender.is_closed() || self.sender.ready().await.is_err() {
            *self = Self::connect(self.addr, &self.path).await?;
        }
        Ok(req)
    }

    /// One call, timed to the end of its body.
    async fn call(&mut self, body: &Bytes) -> Result<Duration, BoxError> {
        let req = self.ready_request(body).await?;
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

    /// One streamed call: the arrival offset of each `data:` event, and the bytes read.
    async fn events(&mut self, body: &Bytes) -> Result<(Vec<Duration>, usize), BoxError> {
        let req = self.ready_request(body).await?;
        let started = Instant::now();
        let resp = self.sender.send_request(req).await?;
        if resp.status() != 200 {
            return Err(format!("status {}", resp.status()).into());
        }
        let mut body = resp.into_body();
        let (mut at, mut bytes) = (Vec::new(), 0);
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                bytes += data.len();
                let n = data.windows(6).filter(|w| w == b"data: ").count();
                let t = started.elapsed();
                at.extend(std::iter::repeat_n(t, n));
            }
        }
        Ok((at, bytes))
    }
}

/// The CPU time (ns) the threads of `pid` have run so far.
fn cpu_ns(pid: u32) -> Option<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}

/// Where the concurrency-1 table runs pgw (see the crate docs).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// Left to the scheduler.
    Unpinned,
    /// The proxy's threads on the bench client's CPU.
    Same,
    /// The proxy's threads on another CPU.
    Other,
}

impl Placement {
    fn label(self) -> &'static str {
        match self {
            Self::Unpinned => "",
            Self::Same => ", same core",
            Self::Other => ", other core",
        }
    }
}

/// Restricts every thread of `pid` to `cpus` (a `taskset` list such as `0` or `0-1`).
fn pin(pid: u32, cpus: &str) -> Result<(), BoxError> {
    let out = Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .stdout(Stdio::null())
        .status()?;
    if !out.success() {
        return Err(format!("taskset -a -p -c {cpus} {pid} failed").into());
    }
    Ok(())
}

/// Pins this process and every proxy for `placement` (all CPUs `0-{cpus - 1}` when
/// unpinned).
fn place(placement: Placement, proxies: &[Proxy], cpus: usize) -> Result<(), BoxError> {
    let all = format!("0-{}", cpus - 1);
    let (me, them) = match placement {
        Placement::Unpinned => (all.as_str(), all.as_str()),
        Placement::Same => ("0", "0"),
        Placement::Other => ("0", "1"),
    };
    pin(std::process::id(), me)?;
    for p in proxies {
        pin(p.child.id(), them)?;
    }
    Ok(())
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
    /// CPU per request as a multiple of the bare forwarder's in the same block.
    over_floor: Option<f64>,
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
            let before = cpu_ns(p.child.id());
            for _ in 0..n {
                lat.push(c.call(body).await?);
            }
            if let (Some(b), Some(a)) = (before, cpu_ns(p.child.id())) {
                *ticks += a - b;
            }
        }
        done += n;
    }
    let out = through
        .into_iter()
        .map(|(lat, ns)| {
            let cpu = (ns > 0).then(|| ns as f64 / lat.len() as f64 / 1e3);
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
        over_floor: None,
    }];
    let floor = through
        .iter()
        .zip(proxies)
        .find_map(|((_, cpu), p)| (p.name == FLOOR).then_some(*cpu).flatten());
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
            over_floor: cpu.zip(floor).filter(|_| p.name != FLOOR).map(|(c, f)| c / f),
        });
    }
    out
}

/// LiteLLM's CPU per request over pgw's, per block (call kind and placement), whole and
/// above the bare forwarder's: a process woken on another core than its client pays a
/// wake-up cost per request that the forwarder pays too (on a VM, tens of
/// microseconds), and that bounds the whole ratio whatever the proxy does.
fn print_cpu_ratios(table: &[Row]) {
    let cpu_of = |name: &str, label: &str| {
        table
            .iter()
            .find(|r| r.name == format!("{name} ({label})"))
            .and_then(|r| r.cpu_us)
    };
    let labels = table
        .iter()
        .filter_map(|r| r.name.strip_prefix("direct (")?.strip_suffix(')'))
        .collect::<Vec<_>>();
    let mut printed = false;
    for label in labels {
        let (Some(lite), Some(floor)) = (cpu_of("litellm", label), cpu_of(FLOOR, label)) else {
            continue;
        };
        for pgw in table
            .iter()
            .filter(|r| r.name.starts_with("pgw ") && r.name.ends_with(&format!("({label})")))
        {
            let Some(ours) = pgw.cpu_us else { continue };
            if !printed {
                println!();
                printed = true;
            }
            let name = pgw.name.trim_end_matches(&format!(" ({label})"));
            let above = if ours > floor {
                format!("{:.0}x", (lite - floor) / (ours - floor))
            } else {
                "- (pgw at the floor)".to_owned()
            };
            println!(
                "LiteLLM / {name} CPU per request ({label}): {:.0}x whole, {above} above the {FLOOR}'s {floor:.0} us",
                lite / ours
            );
        }
    }
}

/// Requests/s of `concurrency` keep-alive connections in a closed loop for `run`, and
/// the p99 latency (ms) of those requests.
async fn closed_loop(
    addr: SocketAddr,
    path: &str,
    body: &Bytes,
    concurrency: usize,
    run: Duration,
) -> Result<(f64, f64), BoxError> {
    let mut tasks = tokio::task::JoinSet::new();
    let started = Instant::now();
    for _ in 0..concurrency {
        let mut c = Client::connect(addr, path).await?;
        let body = body.clone();
        tasks.spawn(async move {
            let mut lat = Vec::new();
            while started.elapsed() < run {
                lat.push(c.call(&body).await?);
            }
            Ok::<_, BoxError>(lat)
        });
    }
    let mut all = Vec::new();
    while let Some(r) = tasks.join_next().await {
        all.extend(r??);
    }
    let took = started.elapsed().as_secs_f64();
    all.sort();
    Ok((all.len() as f64 / took, pct(&all, 0.99)))
}

/// The most requests/s at p99 <= 20 ms over concurrency 1, 2, 4, ... 128: (rps,
/// concurrency, p99 ms), or why there is none; the ladder ends at the first p99 over
/// 20 ms or the first error (a proxy that fails under load, as LiteLLM's single worker
/// can with 500s, is reported, not the end of the bench).
async fn rps_at_p99(addr: SocketAddr, path: &str, body: &Bytes) -> Result<(f64, usize, f64), String> {
    let mut best: Option<(f64, usize, f64)> = None;
    let mut c = 1;
    while c <= 128 {
        let (rps, p99) = match closed_loop(addr, path, body, c, Duration::from_millis(1500)).await {
            Ok(r) => r,
            Err(e) => {
                let e = format!("an error at concurrency {c}: {e}");
                return best.ok_or(e);
            }
        };
        if p99 > 20.0 {
            return best.ok_or_else(|| format!("p99 {p99:.1} ms already at concurrency {c}"));
        }
        if best.is_none_or(|b| rps > b.0) {
            best = Some((rps, c, p99));
        }
        c *= 2;
    }
    best.ok_or_else(|| "no run".to_owned())
}

/// A long stream (`LONG_CHUNKS` events `LONG_GAP` apart), `n` times: per request the
/// first event's offset and every gap between events.
async fn long_stream(
    addr: SocketAddr,
    path: &str,
    n: usize,
) -> Result<(Vec<Duration>, Vec<Duration>), BoxError> {
    let body = Bytes::from_static(
        br#"{"model":"m","messages":[{"role":"user","content":"long"}],"max_tokens":200,"stream":true}"#,
    );
    let mut c = Client::connect(addr, path).await?;
    let (mut first, mut gaps) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let (at, _) = c.events(&body).await?;
        // The content events only: not the finish, usage and [DONE] events at the end.
        let content = &at[..at.len().min(LONG_CHUNKS)];
        if let Some(f) = content.first() {
            first.push(*f);
        }
        gaps.extend(content.windows(2).map(|w| w[1].saturating_sub(w[0])));
    }
    first.sort();
    gaps.sort();
    Ok((first, gaps))
}

fn rss_bytes(pid: u32) -> Option<u64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Streams a 64k-token answer through `p` while sampling its resident memory: (RSS
/// before, highest RSS while streaming, RSS after, bytes streamed).
async fn huge_stream_rss(p: &Proxy) -> Result<(u64, u64, u64, usize), BoxError> {
    let pid = p.child.id();
    let body = Bytes::from_static(
        br#"{"model":"m","messages":[{"role":"user","content":"huge"}],"max_tokens":65536,"stream":true}"#,
    );
    let mut c = Client::connect(p.addr, &p.path).await?;
    // One first, so allocator pools and lazily built state are in place.
    c.events(&body).await?;
    let before = rss_bytes(pid).ok_or("no /proc/PID/statm")?;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let done = std::sync::Arc::clone(&done);
        tokio::spawn(async move {
            let mut peak = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss_bytes(pid).unwrap_or(0));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            peak
        })
    };
    let (at, bytes) = c.events(&body).await?;
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.await?;
    if at.len() < HUGE_CHUNKS {
        return Err(format!("{}: {} events of {HUGE_CHUNKS}", p.name, at.len()).into());
    }
    let after = rss_bytes(pid).ok_or("no /proc/PID/statm")?;
    Ok((before, peak.max(before), after, bytes))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    const USAGE: &str =
        "usage: bench_proxy PGW_BINARY [--requests N] [--litellm] [--placement both|same|other|none]";
    let bin = args.next().ok_or(USAGE)?;
    if bin == "--help" || bin == "-h" {
        println!("{USAGE}");
        return Ok(());
    }
    if bin == "--upstream" {
        // The upstream alone, for a profiler's runs (callgrind over a fixed number of
        // calls counts instructions, which this VM's clock cannot blur).
        let port = args.next().ok_or("usage: bench_proxy --upstream PORT")?;
        upstream(TcpListener::bind(("127.0.0.1", port.parse::<u16>()?)).await?).await;
        return Ok(());
    }
    if bin == "--forwarder" {
        let (Some(up), Some(port)) = (args.next(), args.next()) else {
            return Err("usage: bench_proxy --forwarder UPSTREAM_ADDR PORT".into());
        };
        let listener = TcpListener::bind(("127.0.0.1", port.parse::<u16>()?)).await?;
        forwarder(listener, up.parse()?).await;
        return Ok(());
    }
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let can_pin = cpus >= 2 && Command::new("taskset").arg("-V").output().is_ok();
    let mut requests = 3000;
    let mut litellm = false;
    let mut placements = if can_pin {
        vec![Placement::Same, Placement::Other]
    } else {
        vec![Placement::Unpinned]
    };
    while let Some(a) = args.next() {
        match a.as_str() {
            "--requests" => requests = args.next().ok_or("--requests N")?.parse()?,
            "--litellm" => litellm = true,
            "--placement" => {
                placements = match args.next().as_deref() {
                    Some("both") => vec![Placement::Same, Placement::Other],
                    Some("same") => vec![Placement::Same],
                    Some("other") => vec![Placement::Other],
                    Some("none") => vec![Placement::Unpinned],
                    _ => return Err(USAGE.into()),
                };
            }
            "--help" | "-h" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other}\n{USAGE}").into()),
        }
    }
    if !can_pin && placements != [Placement::Unpinned] {
        eprintln!("no taskset or a single CPU: the placement is left to the scheduler");
        placements = vec![Placement::Unpinned];
    }
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let up = listener.local_addr()?;
    tokio::spawn(upstream(listener));

    let mut proxies = vec![spawn_forwarder(up)?, spawn_pgw(&bin, "pgw memory", up, "")?];
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
        let health = match p.name.as_str() {
            "litellm" => "/health/liveliness",
            // The upstream answers every path: a forwarded GET proves the forwarder up.
            FLOOR => "/v1/models",
            _ => "/healthz",
        };
        wait_healthy(p.addr, health).await?;
    }
    let json =
        Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":16}"#);
    let stream = Bytes::from_static(
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":16,"stream":true}"#,
    );
    let mut table = Vec::new();
    for &placement in &placements {
        if placement != Placement::Unpinned {
            place(placement, &proxies, cpus)?;
        }
        let (mut d, t) = measure(up, &proxies, &json, requests).await?;
        table.extend(rows(&format!("json{}", placement.label()), &mut d, t, &proxies));
        let (mut d, t) = measure(up, &proxies, &stream, requests).await?;
        table.extend(rows(&format!("stream{}", placement.label()), &mut d, t, &proxies));
    }
    if placements != [Placement::Unpinned] {
        place(Placement::Unpinned, &proxies, cpus)?;
    }

    println!("concurrency 1, {requests} requests each, loopback, release build");
    if placements != [Placement::Unpinned] {
        println!(
            "(same core: this bench and pgw pinned to CPU 0; other core: pgw on CPU 1; the rest unpinned)"
        );
    }
    println!();
    println!("| path | p50 ms | p99 ms | added p50 ms | added p99 ms | CPU/request us | CPU x {FLOOR} |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for r in &table {
        let cpu = r.cpu_us.map_or_else(|| "-".to_owned(), |c| format!("{c:.0}"));
        let over = r.over_floor.map_or_else(|| "-".to_owned(), |x| format!("{x:.2}"));
        println!(
            "| {} | {:.3} | {:.3} | {:+.3} | {:+.3} | {cpu} | {over} |",
            r.name, r.p50, r.p99, r.added_p50, r.added_p99
        );
    }
    print_cpu_ratios(&table);

    println!();
    println!("requests/s at p99 <= 20 ms (json, closed loop, concurrency 1..128, 1.5 s each)");
    println!();
    println!("| path | requests/s | at concurrency | p99 ms |");
    println!("|---|---:|---:|---:|");
    let path = "/v1/chat/completions";
    for (name, addr, path) in std::iter::once(("direct", up, path))
        .chain(proxies.iter().map(|p| (p.name.as_str(), p.addr, p.path.as_str())))
    {
        match rps_at_p99(addr, path, &json).await {
            Ok((rps, c, p99)) => println!("| {name} | {rps:.0} | {c} | {p99:.2} |"),
            Err(why) => println!("| {name} | none: {why} | | |"),
        }
    }

    println!();
    println!(
        "a long stream: {LONG_CHUNKS} chunks {} ms apart, 30 requests, concurrency 1",
        LONG_GAP.as_millis()
    );
    println!();
    println!("| path | first chunk p50 ms | added | chunk gap p50 ms | p99 ms | added p50 | added p99 |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let (df, dg) = long_stream(up, path, 30).await?;
    let (f50, g50, g99) = (pct(&df, 0.5), pct(&dg, 0.5), pct(&dg, 0.99));
    println!("| direct | {f50:.3} | | {g50:.3} | {g99:.3} | | |");
    for p in &proxies {
        let (pf, pg) = long_stream(p.addr, &p.path, 30).await?;
        let (pf50, pg50, pg99) = (pct(&pf, 0.5), pct(&pg, 0.5), pct(&pg, 0.99));
        println!(
            "| {} | {pf50:.3} | {:+.3} | {pg50:.3} | {pg99:.3} | {:+.3} | {:+.3} |",
            p.name,
            pf50 - f50,
            pg50 - g50,
            pg99 - g99
        );
    }

    println!();
    println!("a 64k-token streamed answer through pgw: resident memory of the pgw process (/proc/PID/statm)");
    println!();
    println!("| path | streamed | RSS before | peak while streaming | after |");
    println!("|---|---:|---:|---:|---:|");
    for p in proxies.iter().filter(|p| p.name.starts_with("pgw")) {
        let (before, peak, after, bytes) = huge_stream_rss(p).await?;
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        println!(
            "| {} | {:.1} MiB | {:.1} MiB | {:.1} MiB | {:.1} MiB |",
            p.name,
            mib(bytes as u64),
            mib(before),
            mib(peak),
            mib(after)
        );
    }
    Ok(())
}
