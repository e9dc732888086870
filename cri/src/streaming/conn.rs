//! A SPDY/3.1 connection over an upgraded TCP stream (or a WebSocket tunnel, see `ws`),
//! server side: one reader task that decodes frames and routes stream data, one writer task
//! that owns the connection's write half and the deflate context.

use super::spdy::{self, Codec, Frame, Headers};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// Largest data frame sent.
const CHUNK: usize = 32 << 10;

/// A stream the client opened.
pub struct Incoming {
    pub id: u32,
    pub headers: Headers,
    /// Data the client sends on it; closed at FIN or reset.
    pub rx: mpsc::UnboundedReceiver<Vec<u8>>,
}

/// The write side of a connection (cheap to clone).
#[derive(Clone)]
pub struct Writer {
    tx: mpsc::UnboundedSender<Frame>,
}

impl Writer {
    /// A writer and the frames written to it, for a transport that encodes them itself.
    pub fn channel() -> (Writer, mpsc::UnboundedReceiver<Frame>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Writer { tx }, rx)
    }
    pub fn send(&self, f: Frame) -> bool {
        self.tx.send(f).is_ok()
    }
    /// Sends `data` on `stream`, in frames of at most 32 KiB.
    pub fn data(&self, stream: u32, data: &[u8]) -> bool {
        data.chunks(CHUNK).all(|c| {
            self.send(Frame::Data {
                stream_id: stream,
                flags: 0,
                data: c.to_vec(),
            })
        })
    }
    /// Half-closes `stream` from our side.
    pub fn fin(&self, stream: u32) -> bool {
        self.send(Frame::Data {
            stream_id: stream,
            flags: spdy::FLAG_FIN,
            data: vec![],
        })
    }
    /// Resolves when the connection's writer has ended (client gone or write failed).
    pub async fn closed(&self) {
        self.tx.closed().await
    }
    pub fn reset(&self, stream: u32, status: u32) -> bool {
        self.send(Frame::RstStream {
            stream_id: stream,
            status,
        })
    }
}

/// An upgraded connection: its writer, the streams the client opens, and the writer's task
/// (done once every clone of the writer is gone and what was queued is written).
pub type Session = (
    Writer,
    mpsc::UnboundedReceiver<Incoming>,
    tokio::task::JoinHandle<()>,
);

type Routes = Arc<Mutex<HashMap<u32, mpsc::UnboundedSender<Vec<u8>>>>>;

/// Starts the reader and writer tasks. `early` holds bytes read past the HTTP request head.
/// Returns the writer and the streams the client opens (ends when the connection does).
pub fn start<R, W>(rd: R, wr: W, early: Vec<u8>) -> Session
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (writer, frx) = Writer::channel();
    let (stx, srx) = mpsc::unbounded_channel();
    let wtask = tokio::spawn(write_loop(wr, frx));
    tokio::spawn(read_loop(rd, early, writer.clone(), stx));
    (writer, srx, wtask)
}

async fn write_loop<W: AsyncWrite + Unpin>(mut wr: W, mut rx: mpsc::UnboundedReceiver<Frame>) {
    let mut codec = Codec::new();
    let mut buf = Vec::new();
    while let Some(f) = rx.recv().await {
        buf.clear();
        codec.encode(&f, &mut buf);
        // Batch what is queued already.
        while let Ok(f) = rx.try_recv() {
            codec.encode(&f, &mut buf);
            if buf.len() > 256 << 10 {
                break;
            }
        }
        if let Err(e) = wr.write_all(&buf).await {
            tracing::debug!(error = %e, "streaming: write failed; connection closed");
            return;
        }
    }
    let _ = wr.shutdown().await;
}

async fn read_loop<R: AsyncRead + Unpin>(
    mut rd: R,
    early: Vec<u8>,
    w: Writer,
    streams: mpsc::UnboundedSender<Incoming>,
) {
    let routes: Routes = Arc::default();
    let mut codec = Codec::new();
    let mut buf = early;
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(f)) => {
                    if !handle(f, &w, &routes, &streams) {
                        return;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "streaming: bad SPDY input; closing the connection");
                    w.send(Frame::GoAway {
                        last_stream_id: 0,
                        status: 1,
                    });
                    return;
                }
            }
        }
        match rd.read(&mut chunk).await {
            Ok(0) => {
                tracing::debug!("streaming: client closed the connection");
                return;
            }
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => {
                tracing::debug!(error = %e, "streaming: read failed");
                return;
            }
        }
    }
}

/// Handles one frame; false ends the connection.
fn handle(
    f: Frame,
    w: &Writer,
    routes: &Routes,
    streams: &mpsc::UnboundedSender<Incoming>,
) -> bool {
    let mut r = routes.lock().unwrap_or_else(|p| p.into_inner());
    match f {
        Frame::SynStream {
            stream_id,
            flags,
            headers,
            ..
        } => {
            if stream_id == 0 || r.contains_key(&stream_id) {
                w.reset(stream_id, spdy::RST_PROTOCOL_ERROR);
                return true;
            }
            let (tx, rx) = mpsc::unbounded_channel();
            if flags & spdy::FLAG_FIN == 0 {
                r.insert(stream_id, tx);
            }
            w.send(Frame::SynReply {
                stream_id,
                flags: 0,
                headers: vec![],
            });
            tracing::debug!(stream = stream_id, ?headers, "streaming: stream opened");
            if streams
                .send(Incoming {
                    id: stream_id,
                    headers,
                    rx,
                })
                .is_err()
            {
                w.reset(stream_id, spdy::RST_REFUSED_STREAM);
            }
        }
        Frame::Data {
            stream_id,
            flags,
            data,
        } => {
            if !data.is_empty() {
                // Flow control: give the stream's window back at once. (No connection-level
                // update on stream 0: SPDY/3 framers, which kubelet's is, refuse stream 0.)
                // A frame is at most spdy::MAX_FRAME (1 MiB) long.
                let delta = u32::try_from(data.len()).unwrap_or(u32::MAX);
                w.send(Frame::WindowUpdate { stream_id, delta });
                if let Some(tx) = r.get(&stream_id) {
                    let _ = tx.send(data);
                }
            }
            if flags & spdy::FLAG_FIN != 0 {
                r.remove(&stream_id);
            }
        }
        Frame::RstStream { stream_id, .. } => {
            r.remove(&stream_id);
        }
        Frame::Ping(id) => {
            w.send(Frame::Ping(id));
        }
        Frame::GoAway { .. } => return false,
        Frame::Headers { .. }
        | Frame::SynReply { .. }
        | Frame::Settings { .. }
        | Frame::WindowUpdate { .. }
        | Frame::Unknown { .. } => {}
    }
    true
}
