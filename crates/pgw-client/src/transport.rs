//! Transports: how the client's HTTP requests reach a provider.
//!
//! A transport is any `Service<http::Request<Bytes>, Response = http::Response<B>,
//! Error = BoxError>` whose body `B` yields `Bytes`.
//! [`HyperTransport`] talks to real providers; `pgw_sim::SimService` answers in virtual
//! time; [`BoxTransport`] erases either so a gateway can hold both.

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
use tower::util::BoxCloneSyncService;
use tower_service::Service;

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
        |r: http::Response<B>| r.map(|b| b.map_err(Into::into).boxed_unsync()),
    ))
}

type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

/// The production transport: hyper-util's pooled client, HTTP/1.1 and HTTP/2.
///
/// - Plain `http://` speaks HTTP/1.1; `https://` negotiates HTTP/2 or HTTP/1.1 by ALPN.
/// - Connections are pooled per host (idle ones closed after 90 s).
/// - TLS is rustls with the **`ring`** crypto provider and the Mozilla (webpki) roots:
///   `ring` builds with a plain C compiler, whereas rustls' default `aws-lc-rs` needs
///   cmake (and NASM on Windows), and the webpki roots need no system certificate store,
///   so the gateway builds and runs the same in minimal containers.
/// - `connect` bounds TCP connect ([`crate::Timeouts::connect`]); every other timeout is
///   the client's ([`crate::UpstreamClient`]), on tokio's clock.
///
/// Cheap to clone: clones share the pool.
#[derive(Clone, Debug)]
pub struct HyperTransport {
    client: Client<Connector, Full<Bytes>>,
}

impl HyperTransport {
    /// A transport whose TCP connects time out after `connect`.
    ///
    /// # Errors
    /// When rustls refuses the `ring` provider's protocol versions (it does not in
    /// practice; reported rather than unwrapped).
    pub fn new(connect: Duration) -> Result<Self, BoxError> {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(connect));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())?
            .https_or_http()
            .enable_all_versions()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .build(https);
        Ok(Self { client })
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
        let fut = self.client.request(req.map(Full::new));
        fut.map(|r| r.map_err(|e| Box::new(e) as BoxError)).boxed()
    }
}
