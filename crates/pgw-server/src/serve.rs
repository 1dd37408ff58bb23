//! The listener: accepted sockets with `TCP_NODELAY`, hyper's HTTP/1 server with a
//! header read timeout, a cap on open connections, and a graceful shutdown that drains
//! in-flight calls and streams for up to a grace period.

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
use tokio::sync::Semaphore;
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
    /// A [`StartError`] when no virtual keys are configured and the address is not
    /// loopback without `allow_unauthenticated`; a bind error; Redis unreachable for
    /// tenant quotas.
    pub async fn bind(
        config: &ServerConfig,
        gateway: Gateway,
        metrics: Option<PrometheusHandle>,
    ) -> Result<Self, BoxError> {
        let settings = config.server.clone();
        if settings.keys.is_empty() && !settings.listen.ip().is_loopback() && !settings.allow_unauthenticated
        {
            return Err(Box::new(StartError(format!(
                "refusing to serve {} without authentication: configure [[server.keys]] \
                 (see `pgw hash-key`) or pass --allow-unauthenticated",
                settings.listen
            ))));
        }
        let keys = KeyRing::new(&settings.keys, &config.gateway).await?;
        let state = AppState::new(gateway, &config.gateway, &settings, keys, metrics);
        let router = routes::router(state.clone(), settings.max_body_bytes);
        let listener = TcpListener::bind(settings.listen).await?;
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
    /// # Errors
    /// None today: accept errors (out of file descriptors) are logged and retried.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<(), BoxError> {
        let Self {
            listener,
            router,
            state,
            settings,
        } = self;
        let mut http = http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(settings.header_read_timeout)
            .keep_alive(settings.keep_alive);
        let mut refuse = http.clone();
        refuse.keep_alive(false);
        let open = Arc::new(Semaphore::new(settings.max_connections));
        // Connections past the cap get one 503 each; at most a quarter of the cap of
        // them at a time, the rest are closed at once.
        let refusing = Arc::new(Semaphore::new((settings.max_connections / 4).max(1)));
        let overloaded = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "overloaded",
            "too many open connections; retry shortly",
        )
        .retry_after(Some(settings.shed_retry_after));
        let graceful = GracefulShutdown::new();
        let mut tasks = JoinSet::new();
        tokio::pin!(shutdown);
        tracing::info!(listen = %listener.local_addr()?, "serving");
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
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
                    accept(&AcceptCtx {
                        http: &http,
                        refuse: &refuse,
                        router: &router,
                        open: &open,
                        refusing: &refusing,
                        overloaded: &overloaded,
                        graceful: &graceful,
                    }, &mut tasks, stream, peer);
                }
            }
        }
        state.set_draining();
        drop(listener);
        tracing::info!(
            connections = graceful.count(),
            grace_s = settings.shutdown_grace.as_secs_f64(),
            "shutting down: draining in-flight calls"
        );
        if tokio::time::timeout(settings.shutdown_grace, graceful.shutdown())
            .await
            .is_err()
        {
            tracing::warn!(
                connections = tasks.len(),
                "grace period over: closing what is left"
            );
            tasks.abort_all();
        }
        while tasks.join_next().await.is_some() {}
        tracing::info!("stopped");
        Ok(())
    }
}

struct AcceptCtx<'a> {
    http: &'a http1::Builder,
    refuse: &'a http1::Builder,
    router: &'a Router,
    open: &'a Arc<Semaphore>,
    refusing: &'a Arc<Semaphore>,
    overloaded: &'a ApiError,
    graceful: &'a GracefulShutdown,
}

fn accept(ctx: &AcceptCtx<'_>, tasks: &mut JoinSet<()>, stream: TcpStream, peer: SocketAddr) {
    // SSE events must not wait for the client's delayed ACK (Nagle).
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(%peer, error = %e, "TCP_NODELAY not set");
    }
    let io = TokioIo::new(stream);
    if let Ok(slot) = Arc::clone(ctx.open).try_acquire_owned() {
        let service = TowerToHyperService::new(ctx.router.clone());
        let conn = ctx.graceful.watch(ctx.http.serve_connection(io, service));
        metrics::gauge!("pgw_server_connections").increment(1.0);
        tasks.spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
            metrics::gauge!("pgw_server_connections").decrement(1.0);
            drop(slot);
        });
        return;
    }
    metrics::counter!("pgw_server_shed_total", "reason" => "connections").increment(1);
    let Ok(slot) = Arc::clone(ctx.refusing).try_acquire_owned() else {
        return; // dropping the stream closes it
    };
    let overloaded = ctx.overloaded.clone();
    let service = hyper::service::service_fn(move |_req| {
        let response = overloaded.clone().into_response();
        async move { Ok::<_, Infallible>(response) }
    });
    let conn = ctx.graceful.watch(ctx.refuse.serve_connection(io, service));
    tasks.spawn(async move {
        let _ = conn.await;
        drop(slot);
    });
}
