//! The listener: accepted sockets with `TCP_NODELAY`, hyper's HTTP/1 server with a
//! header read timeout, a cap on open connections, and a graceful shutdown that drains
//! in-flight calls and streams for up to a grace period.
//!
//! It serves on `server.threads` event loops: the runtime `run` is polled on, plus one
//! thread per further loop with a single-threaded runtime of its own. Every loop
//! accepts on the same listening socket and serves the connections it accepted to
//! the end, so a request, the gateway's work for it and its upstream request run on
//! one thread: no task is handed between threads per request (on a work-stealing
//! runtime each request woke the other worker once, about 10 us of CPU on a 2-core VM).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use metrics_exporter_prometheus::PrometheusHandle;
use pgw_core::BoxError;
use pgw_stack::Gateway;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, oneshot, watch};
use tokio::task::JoinSet;

use crate::auth::KeyRing;
use crate::config::{ServerConfig, Settings};
use crate::error::ApiError;
use crate::routes::{self, AppState};

/// The server refuses to start: why, in words an operator can act on.
#[derive(Debug)]
pub struct StartError(String);

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for StartError {}

/// A bound server, ready to [`run`](Server::run).
pub struct Server {
    listener: TcpListener,
    router: Router,
    state: AppState,
    settings: Settings,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("listener", &self.listener)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// Binds `config.server.listen` and prepares the routes over `gateway` (built from
    /// `config.gateway`). `metrics` is what `/metrics` renders (see
    /// [`crate::install_metrics`]).
    ///
    /// # Errors
    /// A `ConfigError` naming a field of `config.server` that cannot be served
    /// ([`Settings::check`](crate::config::Settings::check)); a [`StartError`] when no
    /// virtual keys are configured and the address is not loopback without
    /// `allow_unauthenticated`; a bind error; Redis unreachable for tenant quotas.
    pub async fn bind(
        config: &ServerConfig,
        gateway: Gateway,
        metrics: Option<PrometheusHandle>,
    ) -> Result<Self, BoxError> {
        let settings = config.server.clone();
        settings.check()?;
        // A configuration built by hand, not read from a file: its gateway part is
        // checked here too (the tenants' quotas are built from it).
        config.gateway.validate()?;
        if let Some(why) = settings.unauthenticated_exposure() {
            return Err(Box::new(StartError(why)));
        }
        let keys = KeyRing::new(&settings.keys, &config.gateway).await?;
        let state = AppState::new(gateway, &config.gateway, &settings, keys, metrics);
        let router = routes::router(state.clone(), settings.max_body_bytes);
        let listener = TcpListener::bind(settings.listen)
            .await
            .map_err(|e| StartError(format!("cannot listen on {}: {e}", settings.listen)))?;
        Ok(Self {
            listener,
            router,
            state,
            settings,
        })
    }

    /// The address it listens on (the port chosen when `listen` said `:0`).
    ///
    /// # Errors
    /// As `TcpListener::local_addr`.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until `shutdown` completes, then stops accepting, lets every in-flight
    /// call and stream finish for up to `shutdown_grace`, and closes what is left.
    ///
    /// With `threads` above 1 in the settings, it starts `threads - 1` more event
    /// loops, each on a thread of its own with a single-threaded tokio runtime, all
    /// accepting on this listener and sharing the gateway and the connection cap; it
    /// returns once every loop has drained. Those loops run on the real clock, so
    /// tests on tokio's paused clock serve with `threads = 1`. `pgw serve` also gives
    /// the gateway one upstream connection pool per thread
    /// (`pgw_stack::client::HyperTransport::per_thread`), so that a loop's calls use
    /// connections driven by the same loop.
    ///
    /// # Errors
    /// A thread or runtime of an event loop cannot be started; the listener cannot be
    /// shared between loops. Accept errors (out of file descriptors) are logged and
    /// retried.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), BoxError> {
        let Self {
            mut listener,
            router,
            state,
            settings,
        } = self;
        let shared = Arc::new(Shared::new(router, &settings, Arc::clone(&state.grace_over)));
        tracing::info!(listen = %listener.local_addr()?, threads = settings.threads, "serving");
        // Dropping `stop` (this future was dropped, or a loop failed to start) stops the
        // loops as sending it does.
        let (stop, stopped) = watch::channel(());
        let serving = Arc::new(watch::Sender::new(0usize));
        let mut exited = Vec::with_capacity(settings.threads - 1);
        if settings.threads > 1 {
            let shared_socket = listener.into_std().map_err(|e| {
                StartError(format!(
                    "cannot share the listening socket between event loops: {e}"
                ))
            })?;
            for i in 1..settings.threads {
                let socket = shared_socket.try_clone().map_err(|e| {
                    StartError(format!(
                        "cannot share the listening socket with event loop {i}: {e}"
                    ))
                })?;
                let guard = Serving::new(&serving);
                let thread = spawn_loop(i, socket, Arc::clone(&shared), stopped.clone(), guard);
                exited.push(thread.await?);
            }
            listener = TcpListener::from_std(shared_socket)
                .map_err(|e| StartError(format!("cannot listen on the shared socket: {e}")))?;
        }
        let guard = Serving::new(&serving);
        let signal = async {
            shutdown.await;
            state.set_draining();
            if !settings.shutdown_delay.is_zero() {
                // `/readyz` says 503 while calls are still served: a balancer polling
                // it takes this replica out before its connections are refused.
                tracing::info!(
                    delay_s = settings.shutdown_delay.as_secs_f64(),
                    "shutting down: not ready, still serving"
                );
                tokio::time::sleep(settings.shutdown_delay).await;
            }
            tracing::info!(
                connections = settings.max_connections - shared.open.available_permits(),
                grace_s = settings.shutdown_grace.as_secs_f64(),
                "shutting down: draining in-flight calls"
            );
            let _ = stop.send(());
        };
        event_loop(&shared, listener, signal).await;
        drop(guard);
        all_drained(&serving).await;
        for thread in exited {
            thread.join().await;
        }
        tracing::info!("stopped");
        Ok(())
    }
}

/// What every event loop shares: the HTTP settings, the routes, the caps.
struct Shared {
    http: http1::Builder,
    refuse: http1::Builder,
    router: Router,
    open: Arc<Semaphore>,
    refusing: Arc<Semaphore>,
    overloaded: ApiError,
    grace: Duration,
    /// Told when the grace period is over (see `AppState::grace_over`).
    grace_over: Arc<watch::Sender<bool>>,
    /// See [`crate::config::Settings::write_timeout`].
    write_timeout: Duration,
}

impl Shared {
    fn new(router: Router, settings: &Settings, grace_over: Arc<watch::Sender<bool>>) -> Self {
        let mut http = http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(settings.header_read_timeout)
            .keep_alive(settings.keep_alive);
        let mut refuse = http.clone();
        refuse.keep_alive(false);
        Self {
            http,
            refuse,
            router,
            open: Arc::new(Semaphore::new(settings.max_connections)),
            // Connections past the cap get one 503 each; at most a quarter of the cap
            // of them at a time, the rest are closed at once.
            refusing: Arc::new(Semaphore::new((settings.max_connections / 4).max(1))),
            overloaded: ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "overloaded",
                "too many open connections; retry shortly",
            )
            .retry_after(Some(settings.shed_retry_after)),
            grace: settings.shutdown_grace,
            grace_over,
            write_timeout: settings.write_timeout,
        }
    }
}

/// One event loop that has not drained yet; dropped when it has (or when its thread
/// failed to start or panicked), so the count reaches zero whatever happened.
struct Serving(Arc<watch::Sender<usize>>);

impl Serving {
    fn new(count: &Arc<watch::Sender<usize>>) -> Self {
        count.send_modify(|n| *n += 1);
        Self(Arc::clone(count))
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Waits until every event loop has drained: a loop keeps its runtime (and the tasks
/// the gateway spawned on it, which another loop's calls may wait for) until then.
async fn all_drained(count: &watch::Sender<usize>) {
    let _ = count.subscribe().wait_for(|n| *n == 0).await;
}

/// An event loop on a thread of its own.
struct LoopThread {
    /// Completes (with an error if the thread panicked) once its runtime is dropped.
    done: oneshot::Receiver<()>,
    thread: std::thread::JoinHandle<()>,
}

impl LoopThread {
    /// Waits for the thread to end.
    async fn join(self) {
        let _ = self.done.await;
        // Only the thread's exit is left: join it off this runtime's thread anyway.
        let name = self.thread.thread().name().unwrap_or("pgw-loop").to_owned();
        if let Ok(Err(_)) = tokio::task::spawn_blocking(move || self.thread.join()).await {
            tracing::error!(thread = name, "event loop panicked");
        }
    }
}

/// Starts event loop `i` on a thread of its own; completes once it accepts.
async fn spawn_loop(
    i: usize,
    socket: std::net::TcpListener,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<()>,
    guard: Serving,
) -> Result<LoopThread, BoxError> {
    let (started, ready) = oneshot::channel::<std::io::Result<()>>();
    let (exited, done) = oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name(format!("pgw-loop-{i}"))
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(r) => r,
                Err(e) => {
                    let _ = started.send(Err(e));
                    return;
                }
            };
            runtime.block_on(async move {
                let listener = match TcpListener::from_std(socket) {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = started.send(Err(e));
                        return;
                    }
                };
                let _ = started.send(Ok(()));
                let stop = async move {
                    let _ = stopped.changed().await;
                };
                event_loop(&shared, listener, stop).await;
                let serving = Arc::clone(&guard.0);
                drop(guard);
                all_drained(&serving).await;
            });
            drop(runtime);
            drop(exited);
        })
        .map_err(|e| {
            StartError(format!(
                "cannot start event loop {i} (server.threads = a thread each): {e}"
            ))
        })?;
    match ready.await {
        Ok(Ok(())) => Ok(LoopThread { done, thread }),
        Ok(Err(e)) => Err(Box::new(StartError(format!("event loop {i} did not start: {e}")))),
        Err(_) => Err(Box::new(StartError(format!(
            "event loop {i} ended before it started"
        )))),
    }
}

/// How often an event loop's timer wakes while it serves: 1 s, shorter than every
/// timer a call starts (header and body read timeouts, the upstream watchdogs, the SSE
/// keep-alive, all seconds or more).
///
/// Why at all: tokio's time driver sleeps until the earliest timer it had when it
/// went to sleep, and a timer registered earlier than that wakes it with an eventfd
/// write, even from the driver's own thread, where nothing sleeps. Without a timer
/// this close, the first watchdog a call arms (a stream's first-token timeout, then
/// its inter-token one) was earlier than any other, and each streamed call paid one or
/// two `write` syscalls and as many extra `epoll_wait` returns for it. One wake-up per
/// second per loop costs far less.
const TIMER_HEARTBEAT: Duration = Duration::from_secs(1);

/// How long streams cut at the end of the grace period have to send their error event
/// before their connections are closed.
const CUT_FLUSH: Duration = Duration::from_secs(1);

/// Accepts and serves connections until `stop` completes, then drains them for up to
/// the grace period, tells the streams still running to end, and closes what is left.
async fn event_loop(shared: &Shared, listener: TcpListener, stop: impl Future<Output = ()>) {
    let graceful = GracefulShutdown::new();
    let mut tasks = JoinSet::new();
    let mut heartbeat = tokio::time::interval(TIMER_HEARTBEAT);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            biased;
            () = &mut stop => break,
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
            _ = heartbeat.tick() => {}
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors, most likely: let connections close.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                accept(shared, &graceful, &mut tasks, stream, peer);
            }
        }
    }
    drop(listener);
    let drained = graceful.shutdown();
    tokio::pin!(drained);
    if tokio::time::timeout(shared.grace, &mut drained).await.is_err() {
        // Streams still running end with an error event, so a client does not take a
        // cut answer for a network fault; what has not ended soon after is closed.
        shared.grace_over.send_replace(true);
        if tokio::time::timeout(CUT_FLUSH, &mut drained).await.is_err() {
            tracing::warn!(
                connections = tasks.len(),
                "grace period over: closing what is left"
            );
            tasks.abort_all();
        }
    }
    while tasks.join_next().await.is_some() {}
}

/// One open connection in `pgw_server_connections`: counted while it lives, so the
/// gauge comes down however its task ends (an abort at the end of the grace period
/// included).
struct OpenConnection;

impl OpenConnection {
    fn new() -> Self {
        metrics::gauge!("pgw_server_connections").increment(1.0);
        Self
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        metrics::gauge!("pgw_server_connections").decrement(1.0);
    }
}

fn accept(
    ctx: &Shared,
    graceful: &GracefulShutdown,
    tasks: &mut JoinSet<()>,
    stream: TcpStream,
    peer: SocketAddr,
) {
    // SSE events must not wait for the client's delayed ACK (Nagle).
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, error = %e, "TCP_NODELAY not set");
    }
    let io = TokioIo::new(crate::stall::StallGuard::new(stream, ctx.write_timeout));
    if let Ok(slot) = Arc::clone(&ctx.open).try_acquire_owned() {
        let service = TowerToHyperService::new(ctx.router.clone());
        let conn = graceful.watch(ctx.http.serve_connection(io, service));
        let open = OpenConnection::new();
        tasks.spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(open);
            drop(slot);
        });
        return;
    }
    // Counted per refusal: a request answered 503 on a connection past the cap, or a
    // connection closed unanswered; a probe of /healthz or /metrics served past the cap
    // is not one.
    let shed = || metrics::counter!("pgw_server_shed_total", "reason" => "connections").increment(1);
    let Ok(slot) = Arc::clone(&ctx.refusing).try_acquire_owned() else {
        shed();
        return; // dropping the stream closes it
    };
    let overloaded = ctx.overloaded.clone();
    let router = ctx.router.clone();
    let service = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
        // Liveness still answers past the cap: the process is up, only full, and an
        // orchestrator must not restart it for that. So do the metrics: a flood of
        // connections is when they are needed most. Readiness says 503 with the rest
        // (send no more traffic here for now).
        let get = req.method() == http::Method::GET;
        let path = req.uri().path();
        let response: std::pin::Pin<Box<dyn Future<Output = _> + Send>> = if get && path == "/healthz" {
            Box::pin(std::future::ready(crate::routes::with_new_request_id(
                crate::routes::healthy(),
            )))
        } else if get && path == "/metrics" {
            let router = router.clone();
            Box::pin(async move {
                use tower::ServiceExt as _;
                match router.oneshot(req.map(axum::body::Body::new)).await {
                    Ok(r) => r,
                    Err(never) => match never {},
                }
            })
        } else {
            shed();
            Box::pin(std::future::ready(crate::routes::with_new_request_id(
                overloaded.clone().into_response(),
            )))
        };
        async move { Ok::<_, Infallible>(response.await) }
    });
    let conn = graceful.watch(ctx.refuse.serve_connection(io, service));
    tasks.spawn(async move {
        let _ = conn.await;
        drop(slot);
    });
}
