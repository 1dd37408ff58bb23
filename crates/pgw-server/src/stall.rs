//! A client connection whose writes make no progress for the write timeout is ended.
//!
//! A client that stops reading (its receive window full) leaves hyper's write pending:
//! hyper stops polling the response body, so nothing of the call runs again, and its
//! in-flight slot, its tenant lease (renewed in the background) and the connection
//! were held for as long as the peer kept answering the kernel's zero-window probes:
//! indefinitely. [`StallGuard`] wraps the accepted socket: a write (or flush) pending
//! for the whole `limit` fails with `TimedOut`, hyper ends the connection, and dropping
//! the response body releases the call (its slot, lease and upstream stream). A client
//! that reads slowly but steadily never trips it: every write that completes restarts
//! the count. The timer is armed only while a write is pending.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// A socket whose writes may stay pending for at most `limit` at a stretch.
pub(crate) struct StallGuard<S> {
    io: S,
    limit: Duration,
    /// Armed when a write went pending, until one completes.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<S> StallGuard<S> {
    pub(crate) const fn new(io: S, limit: Duration) -> Self {
        Self {
            io,
            limit,
            stalled: None,
        }
    }

    /// The outcome of one write-side poll: a pending one arms (or checks) the timer,
    /// a ready one disarms it.
    fn guard<T>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.limit;
        let sleep = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if sleep.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {limit:?} (server.write_timeout_s)"),
            )));
        }
        Poll::Pending
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for StallGuard<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for StallGuard<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.guard(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.guard(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_flush(cx);
        this.guard(cx, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_shutdown(cx);
        this.guard(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A peer that reads nothing: the write pending past the limit fails with
    /// `TimedOut` (it stayed pending for good). A peer that reads slowly but steadily
    /// (a little every 20 s, under the 30 s limit) gets everything.
    #[tokio::test(start_paused = true)]
    async fn a_write_pending_for_the_limit_fails_a_slow_reader_does_not() {
        let limit = Duration::from_secs(30);
        let (ours, _theirs) = tokio::io::duplex(64);
        let mut guarded = StallGuard::new(ours, limit);
        let start = tokio::time::Instant::now();
        let err = guarded.write_all(&[7u8; 1024]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(start.elapsed(), limit);

        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut guarded = StallGuard::new(ours, limit);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 64];
            while got.len() < 1024 {
                tokio::time::sleep(Duration::from_secs(20)).await;
                let n = theirs.read(&mut buf).await.unwrap();
                got.extend_from_slice(&buf[..n]);
            }
            got.len()
        });
        guarded.write_all(&[7u8; 1024]).await.unwrap();
        assert_eq!(reader.await.unwrap(), 1024);
    }
}
