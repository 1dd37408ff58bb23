//! A streamed answer's body is read to its end after `[DONE]`, so its HTTP/1.1
//! connection goes back to the pool: a body dropped before its end closes its
//! connection, and the end of a chunked body usually comes after `[DONE]`, in a
//! packet of its own. Paused clock, a scripted body.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use pgw_client::{ChunkStream, Timeouts};
use pgw_core::BoxError;
use tokio::time::Instant;

const EVENTS: &str = concat!(
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"},\"finish_reason\":\"stop\"}]}\n\n",
    "data: [DONE]\n\n"
);

/// A body sending `EVENTS`, then nothing for `tail_after`, then its end; `ended` is
/// set when it is read to its end.
fn body(tail_after: Duration, ended: Arc<AtomicBool>) -> pgw_client::UpstreamBody {
    let s = futures_util::stream::unfold(0, move |step| {
        let ended = Arc::clone(&ended);
        async move {
            match step {
                0 => Some((Ok::<_, BoxError>(http_body::Frame::data(Bytes::from(EVENTS))), 1)),
                1 => {
                    tokio::time::sleep(tail_after).await;
                    // The terminating chunk of a chunked body: no data, then the end.
                    Some((Ok(http_body::Frame::data(Bytes::new())), 2))
                }
                _ => {
                    ended.store(true, Ordering::SeqCst);
                    None
                }
            }
        }
    });
    StreamBody::new(s).boxed_unsync()
}

fn timeouts() -> Timeouts {
    Timeouts {
        connect: Duration::from_secs(1),
        first_token: Duration::from_secs(5),
        inter_token: Duration::from_secs(5),
        total: Duration::from_secs(60),
    }
}

/// A stream over [`body`] whose end comes `end_after` the `[DONE]`, and the flag its
/// end sets.
fn stream_ending_after(end_after: Duration) -> (ChunkStream, Arc<AtomicBool>) {
    let ended = Arc::new(AtomicBool::new(false));
    let stream = ChunkStream::new(body(end_after, Arc::clone(&ended)), Instant::now(), timeouts());
    (stream, ended)
}

#[tokio::test(start_paused = true)]
async fn the_body_is_read_to_its_end_after_done() {
    let (mut stream, ended) = stream_ending_after(Duration::from_millis(20));
    let chunk = stream.next().await.unwrap().unwrap();
    assert_eq!(chunk.choices[0].delta.content.as_deref(), Some("hi"));
    assert!(
        stream.next().await.is_none(),
        "[DONE] after a finish reason: the end"
    );
    drop(stream);
    assert!(!ended.load(Ordering::SeqCst), "the body's end has not come yet");
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(ended.load(Ordering::SeqCst), "read to its end once it came");
}

/// A body whose end never comes is given up after `DRAIN_WAIT`.
#[tokio::test(start_paused = true)]
async fn a_body_that_never_ends_is_given_up() {
    let (mut stream, ended) = stream_ending_after(Duration::from_secs(3600));
    assert!(stream.next().await.unwrap().is_ok());
    assert!(stream.next().await.is_none());
    drop(stream);
    tokio::task::yield_now().await;
    assert!(Arc::strong_count(&ended) > 1, "the body is being read to its end");
    tokio::time::sleep(pgw_client::DRAIN_WAIT * 2).await;
    assert_eq!(Arc::strong_count(&ended), 1, "given up and dropped");
    assert!(!ended.load(Ordering::SeqCst));
}
