//! Transports: how the client's HTTP requests reach a provider.
//!
//! A transport is any `Service<http::Request<Bytes>, Response = http::Response<B>,
//! Error = BoxError>` whose body `B` yields `Bytes`.
//! [`HyperTransport`] talks to real providers; `pgw_sim::SimService` answers in virtual
//! time; [`BoxTransport`] erases either so a gateway can hold both.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::{BoxFuture, FutureExt};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use pgw_core::BoxError;
use thread_local::ThreadLocal;
use tower::util::BoxCloneSyncService;
use tower_service::Service;

use crate::error::TransportError;

/// The body type of a [`BoxTransport`]'s responses.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

/// A type-erased, cloneable transport.
pub type BoxTransport = BoxCloneSyncService<http::Request<Bytes>, http::Response<UpstreamBody>, BoxError>;

/// Erases a transport into a [`BoxTransport`] (boxing its body).
pub fn box_transport<T, B>(transport: T) -> BoxTransport
where
    T: Service<http::Request<Bytes>, Response = http::Response<B>, Error = BoxError>
        + Clone
        + Send
        + Sync
        + 'static,
    T::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    BoxCloneSyncService::new(tower::ServiceExt::map_response(
        transport,
        |r: http::Response<B>| r.map(|b| b.map_err(told).boxed_unsync()),
    ))
}

/// A body's error as the layers above see it: hyper's (a reset, a broken chunk) with
/// its causes told (see [`TransportError`]).
fn told(e: impl Into<BoxError>) -> BoxError {
    let e = e.into();
    if e.is::<hyper::Error>() {
        Box::new(TransportError::new(e))
    } else {
        e
    }
}

type Connector = ConnectTimeout<hyper_rustls::HttpsConnector<HttpConnector>>;

/// A connector whose whole connect (TCP, then the TLS handshake) ends by a timeout:
/// hyper-util's own bounds the TCP connect alone, and an endpoint that accepts and
/// then stalls the handshake held an attempt until its total timeout.
#[derive(Clone, Debug)]
struct ConnectTimeout<C> {
    inner: C,
    timeout: Duration,
}

/// The error of a connect that did not finish in time.
#[derive(Debug)]
struct ConnectTimedOut(Duration);

impl std::fmt::Display for ConnectTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "connect (TCP and TLS) timed out after {:?}", self.0)
    }
}

impl std::error::Error for ConnectTimedOut {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        // A timeout for every layer above (`pgw_core::is_timeout`).
        Some(&pgw_core::TimedOut)
    }
}

impl<C> Service<http::Uri> for ConnectTimeout<C>
where
    C: Service<http::Uri> + Send,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<C::Response, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let limit = self.timeout;
        let fut = self.inner.call(uri);
        async move {
            match tokio::time::timeout(limit, fut).await {
                Ok(r) => r.map_err(Into::into),
                Err(_) => Err(Box::new(ConnectTimedOut(limit)) as BoxError),
            }
        }
        .boxed()
    }
}
type Pooled = Client<Connector, Full<Bytes>>;

/// The production transport: hyper-util's pooled client, HTTP/1.1 and HTTP/2.
///
/// - Plain `http://` speaks HTTP/1.1; `https://` negotiates HTTP/2 or HTTP/1.1 by ALPN.
/// - Connections are pooled per host (idle ones closed after 90 s): one pool shared by
///   every thread ([`new`](Self::new)), or one pool per thread
///   ([`per_thread`](Self::per_thread)).
/// - TLS is rustls with the **`ring`** crypto provider and the Mozilla (webpki) roots:
///   `ring` builds with a plain C compiler, whereas rustls' default `aws-lc-rs` needs
///   cmake (and NASM on Windows), and the webpki roots need no system certificate store,
///   so the gateway builds and runs the same in minimal containers.
/// - `connect` bounds the whole connect, TCP and the TLS handshake
///   ([`crate::Timeouts::connect`]); every other timeout is the client's
///   ([`crate::UpstreamClient`]), on tokio's clock.
///
/// Cheap to clone: clones share the pool (or the pools).
#[derive(Clone, Debug)]
pub struct HyperTransport {
    pools: Arc<Pools>,
}

#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "one per transport, behind an Arc: its size is paid once"
)]
enum Pools {
    Shared(Pooled),
    /// One client (so one pool) per OS thread, each built on first use from `connector`.
    PerThread {
        connector: Connector,
        clients: ThreadLocal<Pooled>,
    },
}

fn connector(connect: Duration) -> Result<Connector, BoxError> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())?
        .https_or_http()
        .enable_all_versions()
        .wrap_connector(http);
    Ok(ConnectTimeout {
        inner: https,
        timeout: connect,
    })
}

fn pooled(connector: Connector) -> Pooled {
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .build(connector)
}

impl HyperTransport {
    /// A transport whose TCP connects time out after `connect`, with one connection
    /// pool shared by every thread.
    ///
    /// # Errors
    /// When rustls refuses the `ring` provider's protocol versions (it does not in
    /// practice; reported rather than unwrapped).
    pub fn new(connect: Duration) -> Result<Self, BoxError> {
        Ok(Self {
            pools: Arc::new(Pools::Shared(pooled(connector(connect)?))),
        })
    }

    /// As [`new`](Self::new), but with one connection pool per OS thread: a request
    /// takes a connection from the pool of the thread it is sent from, and a new
    /// connection's task is spawned on that thread's runtime.
    ///
    /// For servers that run one single-threaded tokio runtime per core (`pgw serve`):
    /// a call and its upstream connection then stay on one thread, with no wake-ups
    /// across threads. The cost is up to one set of idle connections per thread. On a
    /// work-stealing runtime, where tasks move between threads, prefer [`new`](Self::new).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn per_thread(connect: Duration) -> Result<Self, BoxError> {
        Ok(Self {
            pools: Arc::new(Pools::PerThread {
                connector: connector(connect)?,
                clients: ThreadLocal::new(),
            }),
        })
    }

    fn client(&self) -> &Pooled {
        match &*self.pools {
            Pools::Shared(client) => client,
            Pools::PerThread { connector, clients } => clients.get_or(|| pooled(connector.clone())),
        }
    }
}

impl Service<http::Request<Bytes>> for HyperTransport {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, BoxError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // The legacy client is always ready: it queues on its pool internally.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Bytes>) -> Self::Future {
        let fut = self.client().request(req.map(Full::new));
        fut.map(|r| r.map_err(|e| Box::new(TransportError::new(e)) as BoxError))
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::{mpsc, oneshot};
    use tower::ServiceExt;

    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// An HTTP/1.1 server on its own thread answering every request with an empty 200
    /// on a kept-alive connection; counts the connections it accepted.
    fn counting_server() -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        std::thread::spawn(move || {
            runtime().block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                while let Ok((mut conn, _)) = listener.accept().await {
                    count.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(async move {
                        let mut buf = Vec::new();
                        let mut chunk = [0u8; 1024];
                        while let Ok(n @ 1..) = conn.read(&mut chunk).await {
                            buf.extend_from_slice(&chunk[..n]);
                            while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                buf.drain(..end + 4);
                                let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                                if conn.write_all(ok).await.is_err() {
                                    return;
                                }
                            }
                        }
                    });
                }
            });
        });
        (addr, accepted)
    }

    /// A thread with a runtime of its own that sends one GET through `transport` per
    /// message and answers when the response has been read.
    fn sender(transport: HyperTransport, addr: SocketAddr) -> mpsc::Sender<oneshot::Sender<()>> {
        let (tx, mut rx) = mpsc::channel::<oneshot::Sender<()>>(1);
        std::thread::spawn(move || {
            runtime().block_on(async move {
                while let Some(done) = rx.recv().await {
                    let req = http::Request::get(format!("http://{addr}/"))
                        .body(Bytes::new())
                        .unwrap();
                    let resp = transport.clone().oneshot(req).await.unwrap();
                    assert_eq!(resp.status(), 200);
                    resp.into_body().collect().await.unwrap();
                    let _ = done.send(());
                }
            });
        });
        tx
    }

    fn send(to: &mpsc::Sender<oneshot::Sender<()>>) {
        let (done, answered) = oneshot::channel();
        to.blocking_send(done).unwrap();
        answered.blocking_recv().unwrap();
    }

    /// An endpoint that accepts TCP and never answers the TLS handshake is given up at
    /// the connect timeout, as a timeout (before, the attempt hung to its total
    /// timeout). Paused clock: the timeout passes once nothing else can happen.
    #[tokio::test(start_paused = true)]
    async fn a_stalled_tls_handshake_ends_at_the_connect_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let held = tokio::spawn(async move {
            let mut conns = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                conns.push(conn); // accepted, never answered
            }
        });
        let transport = HyperTransport::new(Duration::from_secs(2)).unwrap();
        let req = http::Request::get(format!("https://{addr}/"))
            .body(Bytes::new())
            .unwrap();
        let start = tokio::time::Instant::now();
        let err = tokio::time::timeout(Duration::from_secs(600), transport.oneshot(req))
            .await
            .expect("the handshake was waited for without limit")
            .unwrap_err();
        assert!(pgw_core::is_timeout(&*err), "{err:?}");
        assert!(start.elapsed() <= Duration::from_secs(2), "{:?}", start.elapsed());
        held.abort();
    }

    /// A refused connect says so in the error's text (hyper-util's own says only
    /// `client error (Connect)`).
    #[tokio::test]
    async fn a_refused_connect_tells_why() {
        // A port that was free a moment ago: nothing listens there.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap();
        let transport = HyperTransport::new(Duration::from_secs(2)).unwrap();
        let req = http::Request::get(format!("http://{addr}/"))
            .body(Bytes::new())
            .unwrap();
        let err = transport.oneshot(req).await.unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("client error (Connect): "), "{text}");
        assert!(text.to_lowercase().contains("refused"), "{text}");
    }

    #[test]
    fn per_thread_pools_reuse_a_connection_within_a_thread_and_never_across() {
        let (addr, accepted) = counting_server();
        let transport = HyperTransport::per_thread(Duration::from_secs(5)).unwrap();
        let (a, b) = (sender(transport.clone(), addr), sender(transport.clone(), addr));
        // Both runtimes stay alive throughout, so a shared pool would hand `a`'s idle
        // connection to `b`.
        for to in [&a, &a, &b, &b, &a, &b] {
            send(to);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "one connection per thread");
    }
}
