//! The upstream attempt of the pgw gateway: one OpenAI-compatible chat completion
//! against one source, over any HTTP transport.
//!
//! - [`ChatCall`]: the request that flows through the whole stack (cheap to clone,
//!   carries its [`pgw_core::CallHistory`], knows its token estimate);
//! - [`UpstreamClient`]: a tower `Service<ChatCall>` answering a [`ChatAnswer`] (or an
//!   error the [`pgw_core::OpenAiClassifier`]-compatible [`AnswerClassifier`] classifies);
//! - [`ChunkStream`]: a streamed answer under the first-token, inter-token and total
//!   watchdogs, on tokio's clock;
//! - transports: [`HyperTransport`] (hyper-util, HTTP/1.1 + HTTP/2, rustls with `ring`)
//!   or anything with the same shape (`pgw_sim::SimService`), erased by
//!   [`box_transport`];
//! - [`SourceSettings`] with a [`SecretKey`] that never prints.
//!
//! ```
//! use bytes::Bytes;
//! use pgw_client::{ChatCall, SecretKey, SourceSettings, UpstreamClient};
//! use pgw_core::openai::ChatRequest;
//! use pgw_core::BoxError;
//! use tower::{service_fn, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), BoxError> {
//! // A transport is any service from http::Request<Bytes> to http::Response<impl Body>.
//! let provider = service_fn(|req: http::Request<Bytes>| async move {
//!     assert_eq!(req.uri(), "http://provider.test/v1/chat/completions");
//!     let body = r#"{"choices":[{"message":{"role":"assistant","content":"hi!"}}]}"#;
//!     Ok::<_, BoxError>(http::Response::new(http_body_util::Full::new(Bytes::from(body))))
//! });
//! let settings = SourceSettings::new("s1", "http://provider.test/v1").key(SecretKey::new("sk-1"));
//! let client = UpstreamClient::new(settings, provider)?;
//! let answer = client.oneshot(ChatCall::new(ChatRequest::user("m", "hello"))).await?;
//! assert_eq!(answer.content(), "hi!");
//! # Ok(())
//! # }
//! ```

mod call;
mod client;
pub mod error;
mod secret;
mod settings;
mod stream;
mod tail;
mod transport;

pub use call::{AnswerClassifier, AttemptStats, CallId, ChatAnswer, ChatCall};
pub use client::{MAX_KEPT_CHUNK_BYTES, MAX_KEPT_CHUNKS, UpstreamClient};
pub use error::{MalformedResponse, TransportError, Watchdog, WatchdogCut};
pub use secret::SecretKey;
pub use settings::{
    BadSettings, DEFAULT_CONNECT_TIMEOUT, DEFAULT_FIRST_TOKEN_TIMEOUT, DEFAULT_INTER_TOKEN_TIMEOUT,
    DEFAULT_TOTAL_TIMEOUT, KeyHeader, SourceSettings, Timeouts,
};
pub use stream::{ChunkStream, DRAIN_BYTES, DRAIN_WAIT};
pub use tail::{PassThrough, Tail, TailStream};
pub use transport::{BoxTransport, HyperTransport, UpstreamBody, box_transport};
