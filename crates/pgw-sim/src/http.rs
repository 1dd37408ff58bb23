//! The same simulated pool served over HTTP/1.1 on loopback, for real-time runs.
//!
//! `POST /{source}/v1/chat/completions`: the base URL of source `s1` is
//! `http://127.0.0.1:PORT/s1/v1`. The bytes are those of the virtual [`SimService`]
//! (same statuses, headers and bodies, streamed frame by frame as the tokio clock
//! releases them). A black hole holds the connection open and silent. An unknown source
//! gets 404 and another method 405, with OpenAI-style error bodies.

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};
use tower_service::Service;

use crate::SimPool;
use crate::body::SimBody;

#[cfg(doc)]
use crate::SimService;

/// The running server. Dropping it (or [`ServerHandle::shutdown`]) stops accepting
/// and closes every open connection, black-holed ones included.
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    /// Dropping the sender stops the server.
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl ServerHandle {
    /// The address the server listens on.
    #[must_use]
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL of `source` (`http://ADDR/{source}/v1`).
    #[must_use]
    pub fn base_url(&self, source: &str) -> String {
        format!("http://{}/{source}/v1", self.addr)
    }

    /// Stops the server and waits until its connections are closed.
    pub async fn shutdown(mut self) {
        self.stop.take();
        if let Some(task) = self.task.take()
            && let Err(e) = task.await
        {
            tracing::warn!(error = %e, "pgw-sim server task ended abnormally");
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        // Dropping `stop` ends the accept loop, which aborts every connection.
        self.stop.take();
    }
}

/// Serves `pool` on `addr` (use port 0 for any free port).
///
/// Returns the bound address and the handle that keeps the server running.
///
/// # Errors
/// The bind error, if `addr` cannot be bound.
pub async fn serve(pool: SimPool, addr: SocketAddr) -> std::io::Result<(SocketAddr, ServerHandle)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let (stop, stopped) = oneshot::channel();
    let task = tokio::spawn(accept_loop(listener, pool, stopped));
    Ok((
        local,
        ServerHandle {
            addr: local,
            stop: Some(stop),
            task: Some(task),
        },
    ))
}

async fn accept_loop(listener: TcpListener, pool: SimPool, mut stopped: oneshot::Receiver<()>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut stopped => {
                // Aborts every connection (black-holed ones included) and waits for them.
                conns.shutdown().await;
                return;
            }
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    // Out of descriptors or similar: back off instead of spinning.
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                };
                // Providers' servers flush each SSE event at once. With Nagle on, an
                // event written while the previous one is unacknowledged waits for the
                // client's delayed ACK (~40 ms; on the paused clock, the next timer).
                let _ = stream.set_nodelay(true);
                let pool = pool.clone();
                conns.spawn(async move {
                    let svc = hyper::service::service_fn(move |req| handle(pool.clone(), req));
                    if let Err(e) = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await
                    {
                        tracing::debug!(error = %e, "pgw-sim connection ended with an error");
                    }
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

fn error(status: StatusCode, message: &str) -> Response<SimBody> {
    let body = serde_json::json!({
        "error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}
    });
    let mut resp = Response::new(SimBody::full(Bytes::from(body.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

async fn handle(pool: SimPool, req: Request<Incoming>) -> Result<Response<SimBody>, Infallible> {
    let path = req.uri().path();
    let source = path
        .strip_prefix('/')
        .and_then(|p| p.strip_suffix("/v1/chat/completions"))
        .filter(|s| !s.is_empty() && !s.contains('/'))
        .map(str::to_owned);
    let Some(mut svc) = source.as_deref().and_then(|s| pool.service(s)) else {
        return Ok(error(StatusCode::NOT_FOUND, &format!("Unknown route {path}")));
    };
    if req.method() != http::Method::POST {
        return Ok(error(StatusCode::METHOD_NOT_ALLOWED, "Use POST"));
    }
    let (parts, body) = req.into_parts();
    let Ok(collected) = body.collect().await else {
        return Ok(error(StatusCode::BAD_REQUEST, "Could not read the request body"));
    };
    let req = Request::from_parts(parts, collected.to_bytes());
    match svc.call(req).await {
        Ok(resp) => Ok(resp),
        Err(e) => Ok(error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())),
    }
}
