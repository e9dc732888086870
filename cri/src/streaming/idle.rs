//! The streaming server's idle timeout: a connection on which no byte has moved either way
//! for the configured time (`daemon.stream_idle_timeout_secs`; kubelet's and containerd's
//! default is 4 h) is closed, as kubelet's streaming server does. An upgraded connection's
//! halves are wrapped: each byte either moves keeps the connection alive, and its
//! [`Expiry`], which the connection's writer waits on beside its work, ends it (the writer's
//! end ends the session). The halves also count the bytes they move
//! (`vessel_streaming_bytes`).

use prometheus_client::metrics::counter::Counter;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

/// When the connection last moved a byte, shared by its halves.
struct Clock {
    start: Instant,
    /// Milliseconds after `start`.
    last: AtomicU64,
    limit: Duration,
    /// Whether an [`Expiry`] of it has fired (logged and counted once per connection).
    fired: AtomicBool,
}

impl Clock {
    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(ms, Ordering::Relaxed);
    }
    fn deadline(&self) -> Instant {
        self.start + Duration::from_millis(self.last.load(Ordering::Relaxed)) + self.limit
    }
}

/// One half of a connection: counts what it moves and keeps the connection's clock.
pub struct Idle<T> {
    inner: T,
    bytes: Option<Counter>,
    clock: Option<Arc<Clock>>,
}

/// When a connection has been idle past its limit (clones: for a connection tunnelled in
/// it, which ends with it).
#[derive(Clone)]
pub struct Expiry(Option<Arc<Clock>>);

impl Expiry {
    /// A connection that never expires.
    #[cfg(test)]
    pub fn never() -> Expiry {
        Expiry(None)
    }
    /// Resolves once no byte has moved for the limit (never without one).
    pub async fn wait(self) {
        let Some(clock) = self.0 else {
            return std::future::pending().await;
        };
        loop {
            let deadline = clock.deadline();
            if deadline <= Instant::now() {
                break;
            }
            tokio::time::sleep_until(deadline).await;
        }
        if !clock.fired.swap(true, Ordering::Relaxed) {
            tracing::info!(limit = ?clock.limit, "streaming: connection idle past its timeout; closing it");
            crate::metrics::get().record_stream_idle_closed();
        }
    }
}

/// Wraps a connection's halves; `limit` none: no timeout. `bytes`: the counters of bytes
/// read and written.
pub fn wrap<R, W>(
    rd: R,
    wr: W,
    limit: Option<Duration>,
    bytes: Option<(Counter, Counter)>,
) -> (Idle<R>, Idle<W>, Expiry) {
    let clock = limit.map(|limit| {
        Arc::new(Clock {
            start: Instant::now(),
            last: AtomicU64::new(0),
            limit,
            fired: AtomicBool::new(false),
        })
    });
    let (bin, bout) = bytes.unzip();
    (
        Idle {
            inner: rd,
            bytes: bin,
            clock: clock.clone(),
        },
        Idle {
            inner: wr,
            bytes: bout,
            clock: clock.clone(),
        },
        Expiry(clock),
    )
}

impl<T> Idle<T> {
    fn moved(&self, n: usize) {
        if let Some(c) = &self.bytes {
            c.inc_by(u64::try_from(n).unwrap_or(u64::MAX));
        }
        if let Some(c) = &self.clock {
            c.touch();
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Idle<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0 {
            self.moved(n);
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Idle<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            if n > 0 {
                self.moved(n);
            }
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn expires_after_the_limit_without_a_byte_either_way() {
        let (a, b) = tokio::io::duplex(64);
        let (rd, wr) = tokio::io::split(a);
        let counters = (Counter::default(), Counter::default());
        let (mut rd, mut wr, expiry) = wrap(
            rd,
            wr,
            Some(Duration::from_secs(10)),
            Some(counters.clone()),
        );
        let t0 = Instant::now();
        let expired = tokio::spawn(async move {
            expiry.wait().await;
            Instant::now()
        });
        let (mut peer_rd, mut peer_wr) = tokio::io::split(b);
        // Writes only: not idle.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_secs(7)).await;
            wr.write_all(b"x").await.unwrap();
            let mut one = [0u8; 1];
            peer_rd.read_exact(&mut one).await.unwrap();
        }
        // Reads only.
        tokio::time::sleep(Duration::from_secs(7)).await;
        peer_wr.write_all(b"y").await.unwrap();
        let mut one = [0u8; 1];
        rd.read_exact(&mut one).await.unwrap();
        // Then nothing, with no one polling either half: expired 10 s after the last byte.
        assert_eq!(expired.await.unwrap() - t0, Duration::from_secs(38));
        assert_eq!((counters.0.get(), counters.1.get()), (1, 3));
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_limit_nothing_expires() {
        let (a, _b) = tokio::io::duplex(64);
        let (rd, wr) = tokio::io::split(a);
        let (_rd, _wr, expiry) = wrap(rd, wr, None, None);
        let r = tokio::time::timeout(Duration::from_secs(86_400), expiry.wait()).await;
        assert!(r.is_err(), "still waiting");
    }
}
