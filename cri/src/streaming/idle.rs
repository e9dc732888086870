//! The streaming server's idle timeout: a connection on which no byte has moved either way
//! for the configured time (`daemon.stream_idle_timeout_secs`; kubelet's and containerd's
//! default is 4 h) is closed, as kubelet's streaming server does. An upgraded connection's
//! two halves are wrapped together: activity on either keeps both alive, and a half that
//! waits past the deadline fails with `TimedOut`, which ends the session. The halves also
//! count the bytes they move (`vessel_streaming_bytes`).

use prometheus_client::metrics::counter::Counter;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// When the connection last moved a byte, shared by its halves.
struct Clock {
    start: Instant,
    /// Milliseconds after `start`.
    last: AtomicU64,
    limit: Duration,
    /// Whether a half has timed out (counted once per connection).
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

/// One half of a connection under the idle timeout.
pub struct Idle<T> {
    inner: T,
    /// Bytes this half moved.
    bytes: Option<Counter>,
    /// With its timer; none without a timeout.
    watch: Option<(Arc<Clock>, Pin<Box<Sleep>>)>,
}

/// Wraps a connection's halves; `limit` none: no timeout. `bytes`: the counters of bytes
/// read and written.
pub fn wrap<R, W>(
    rd: R,
    wr: W,
    limit: Option<Duration>,
    bytes: Option<(Counter, Counter)>,
) -> (Idle<R>, Idle<W>) {
    let clock = limit.map(|limit| {
        Arc::new(Clock {
            start: Instant::now(),
            last: AtomicU64::new(0),
            limit,
            fired: AtomicBool::new(false),
        })
    });
    let watch = || {
        clock
            .as_ref()
            .map(|c| (c.clone(), Box::pin(tokio::time::sleep(c.limit))))
    };
    let (bin, bout) = bytes.unzip();
    (
        Idle {
            inner: rd,
            bytes: bin,
            watch: watch(),
        },
        Idle {
            inner: wr,
            bytes: bout,
            watch: watch(),
        },
    )
}

fn timed_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "streaming connection idle past its timeout",
    )
}

impl<T> Idle<T> {
    fn moved(&self, n: usize) {
        if let Some(c) = &self.bytes {
            c.inc_by(u64::try_from(n).unwrap_or(u64::MAX));
        }
        if let Some((c, _)) = &self.watch {
            c.touch();
        }
    }
    /// Whether the connection has been idle past its limit; if not, the timer is armed for
    /// the current deadline (activity on the other half moves it).
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let Some((clock, timer)) = self.watch.as_mut() else {
            return false;
        };
        loop {
            if timer.as_mut().poll(cx).is_pending() {
                return false;
            }
            let deadline = clock.deadline();
            if deadline <= Instant::now() {
                if !clock.fired.swap(true, Ordering::Relaxed) {
                    tracing::info!(
                        limit = ?clock.limit,
                        "streaming: connection idle past its timeout; closing it"
                    );
                    crate::metrics::get().record_stream_idle_closed();
                }
                return true;
            }
            timer.as_mut().reset(deadline);
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
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len() - before;
                if n > 0 {
                    self.moved(n);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(timed_out())),
            other => other,
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Idle<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write(cx, buf) {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    self.moved(n);
                }
                Poll::Ready(Ok(n))
            }
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(timed_out())),
            other => other,
        }
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.inner).poll_flush(cx) {
            Poll::Pending if self.expired(cx) => Poll::Ready(Err(timed_out())),
            other => other,
        }
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
    async fn idle_connection_times_out_and_activity_either_way_keeps_it() {
        let (a, b) = tokio::io::duplex(64);
        let (rd, wr) = tokio::io::split(a);
        let counters = (Counter::default(), Counter::default());
        let (mut rd, mut wr) = wrap(
            rd,
            wr,
            Some(Duration::from_secs(10)),
            Some(counters.clone()),
        );
        let (mut peer_rd, mut peer_wr) = tokio::io::split(b);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 16];
            loop {
                match rd.read(&mut buf).await {
                    Ok(0) => return (got, None),
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) => return (got, Some((e.kind(), Instant::now()))),
                }
            }
        });
        let t0 = Instant::now();
        // Writes only (the read half waits all along): the connection is not idle.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_secs(7)).await;
            wr.write_all(b"x").await.unwrap();
            let mut one = [0u8; 1];
            peer_rd.read_exact(&mut one).await.unwrap();
        }
        // Reads only.
        tokio::time::sleep(Duration::from_secs(7)).await;
        peer_wr.write_all(b"y").await.unwrap();
        // Then nothing: the read fails 10 s after the last byte.
        let (got, err) = reader.await.unwrap();
        assert_eq!(got, b"y");
        let (kind, at) = err.expect("timed out");
        assert_eq!(kind, io::ErrorKind::TimedOut);
        assert_eq!(at - t0, Duration::from_secs(38));
        assert_eq!((counters.0.get(), counters.1.get()), (1, 3));
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_limit_nothing_times_out() {
        let (a, _b) = tokio::io::duplex(64);
        let (rd, wr) = tokio::io::split(a);
        let (mut rd, _wr) = wrap(rd, wr, None, None);
        let mut buf = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_secs(86_400), rd.read(&mut buf)).await;
        assert!(r.is_err(), "the read still waits");
    }
}
