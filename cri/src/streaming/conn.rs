//! A SPDY/3.1 connection over an upgraded TCP stream (or a WebSocket tunnel, see `ws`),
//! server side: one reader task that decodes frames and routes stream data, one writer task
//! that owns the connection's write half and the deflate context.

use super::spdy::{self, Codec, Frame, Headers};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Notify, Semaphore};

/// Largest data frame sent.
const CHUNK: usize = 32 << 10;
/// Streams a client may have open for sending on one connection; more are refused (an
/// exec opens at most five, a port-forward two per forwarded connection).
const MAX_STREAMS: usize = 1024;
/// Frames the writer may have queued. Stream data waits for room: output of a client that
/// does not read stays in the pod (the agent's pipe), not in vesseld (at most this many
/// 32 KiB frames per connection).
const WRITE_QUEUE: usize = 32;
/// Client data a connection may have queued for its streams' consumers, in bytes, and
/// pieces a stream may have queued, each at most [`INPUT_CHUNK`] long. The reader waits for
/// room: input a container (or a port-forward's server) does not read stays in the client
/// (TCP backpressure), as with kubelet's server, not in vesseld.
const INPUT_BUDGET: usize = 1 << 20;
const INPUT_QUEUE: usize = 8;
const INPUT_CHUNK: usize = 64 << 10;

/// A stream the client opened.
pub struct Incoming {
    pub id: u32,
    pub headers: Headers,
    /// Data the client sends on it; closed at FIN or reset.
    pub rx: InputRx,
}

/// What a connection's streams may have queued (a clone per stream).
#[derive(Clone)]
pub struct InputBudget(Arc<Semaphore>);

impl InputBudget {
    pub fn new() -> InputBudget {
        InputBudget(Arc::new(Semaphore::new(INPUT_BUDGET)))
    }
    /// A stream's input queue.
    pub fn queue(&self) -> (InputTx, InputRx) {
        let (tx, rx) = mpsc::channel(INPUT_QUEUE);
        (
            InputTx {
                tx,
                budget: self.clone(),
            },
            InputRx {
                rx,
                budget: self.clone(),
            },
        )
    }
    fn give_back(&self, n: usize) {
        self.0.add_permits(n);
    }
}

/// The reader's end of a stream's input queue.
pub struct InputTx {
    tx: mpsc::Sender<Vec<u8>>,
    budget: InputBudget,
}

impl InputTx {
    /// Hands `data` to the stream's consumer in pieces of at most [`INPUT_CHUNK`], waiting
    /// for room. False: the consumer is gone.
    pub async fn deliver(&self, data: Vec<u8>) -> bool {
        for piece in data.chunks(INPUT_CHUNK) {
            // Not for a consumer that is gone, even when the budget is spent.
            if self.tx.is_closed() {
                return false;
            }
            let n = u32::try_from(piece.len()).unwrap_or(u32::MAX);
            // Room in the budget, then in the queue; cancelled while waiting, neither is
            // taken.
            let Ok(permit) = self.budget.0.acquire_many(n).await else {
                return false;
            };
            let Ok(slot) = self.tx.reserve().await else {
                return false;
            };
            permit.forget();
            slot.send(piece.to_vec());
        }
        true
    }
}

/// The consumer's end of a stream's input queue; what it takes (or drops) goes back to the
/// connection's budget.
pub struct InputRx {
    rx: mpsc::Receiver<Vec<u8>>,
    budget: InputBudget,
}

impl InputRx {
    pub async fn recv(&mut self) -> Option<Vec<u8>> {
        let d = self.rx.recv().await?;
        self.budget.give_back(d.len());
        Some(d)
    }
    /// What is queued now, if anything.
    pub fn try_recv(&mut self) -> Option<Vec<u8>> {
        let d = self.rx.try_recv().ok()?;
        self.budget.give_back(d.len());
        Some(d)
    }
}

impl Drop for InputRx {
    fn drop(&mut self) {
        // Sends fail from here on; what was queued goes back.
        self.rx.close();
        while self.try_recv().is_some() {}
    }
}

/// Control frames the reader may have queued (window updates aside, which are merged per
/// stream); past it, the reader waits, as a client that does not read must not grow it.
const CONTROL_QUEUE: usize = 64;

/// The write side of a connection (cheap to clone), for the session's handlers. Data waits
/// while the connection's queue is full, which is how a client that reads slowly slows the
/// output down. The reader's control frames (replies to new streams, resets, pings, window
/// updates) go through [`Control`], ahead of queued data, so input never waits behind
/// output. The connection ends once every Writer is gone and what they queued is written.
#[derive(Clone)]
pub struct Writer {
    tx: mpsc::Sender<Frame>,
}

#[derive(Default)]
struct Control {
    q: std::sync::Mutex<ControlQueue>,
    /// Wakes the writer.
    more: Notify,
    /// Wakes a reader waiting for room.
    room: Notify,
}

#[derive(Default)]
struct ControlQueue {
    frames: Vec<Frame>,
    /// Window given back per stream, not yet sent.
    windows: BTreeMap<u32, u32>,
    /// The writer has ended.
    closed: bool,
}

impl Control {
    fn lock(&self) -> std::sync::MutexGuard<'_, ControlQueue> {
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Takes what is queued, as frames.
    fn take(&self) -> Vec<Frame> {
        let (mut frames, windows) = {
            let mut q = self.lock();
            (
                std::mem::take(&mut q.frames),
                std::mem::take(&mut q.windows),
            )
        };
        self.room.notify_waiters();
        frames.extend(
            windows
                .into_iter()
                .map(|(stream_id, delta)| Frame::WindowUpdate { stream_id, delta }),
        );
        frames
    }
    fn close(&self) {
        self.lock().closed = true;
        self.room.notify_waiters();
    }
    /// Waits until `f`, run on the queue under its lock, answers; it is run again each time
    /// the writer takes the queue or ends.
    async fn when<T>(&self, mut f: impl FnMut(&mut ControlQueue) -> Option<T>) -> T {
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            // Registered before the check: a wake-up in between is not lost.
            room.as_mut().enable();
            if let Some(t) = f(&mut self.lock()) {
                return t;
            }
            room.await;
        }
    }
    /// Resolves once the writer has ended.
    async fn ended(&self) {
        self.when(|q| q.closed.then_some(())).await
    }
    /// Queues a control frame ahead of data; waits while [`CONTROL_QUEUE`] are queued.
    /// False: the connection's writer has ended.
    async fn send(&self, f: Frame) -> bool {
        let mut f = Some(f);
        let queued = self
            .when(|q| {
                if q.closed {
                    Some(false)
                } else if q.frames.len() < CONTROL_QUEUE {
                    q.frames.extend(f.take());
                    Some(true)
                } else {
                    None
                }
            })
            .await;
        if queued {
            self.more.notify_one();
        }
        queued
    }
    /// Queues a reset of `stream` with `status`, as [`Control::send`].
    async fn reset(&self, stream_id: u32, status: u32) -> bool {
        self.send(Frame::RstStream { stream_id, status }).await
    }
    /// Gives `delta` bytes of `stream`'s window back to the client (never waits: at most
    /// one entry per routed stream, and streams are capped).
    fn window(&self, stream: u32, delta: u32) {
        let mut q = self.lock();
        if q.closed {
            return;
        }
        let w = q.windows.entry(stream).or_default();
        *w = w.saturating_add(delta);
        drop(q);
        self.more.notify_one();
    }
}

impl Writer {
    /// A writer and the data frames written to it, for a transport that encodes them itself.
    pub fn channel() -> (Writer, mpsc::Receiver<Frame>) {
        let (tx, rx) = mpsc::channel(WRITE_QUEUE);
        (Writer { tx }, rx)
    }
    pub async fn send(&self, f: Frame) -> bool {
        self.tx.send(f).await.is_ok()
    }
    /// Sends `data` on `stream`, in frames of at most 32 KiB.
    pub async fn data(&self, stream: u32, data: &[u8]) -> bool {
        for c in data.chunks(CHUNK) {
            let f = Frame::Data {
                stream_id: stream,
                flags: 0,
                data: c.to_vec(),
            };
            if !self.send(f).await {
                return false;
            }
        }
        true
    }
    /// Half-closes `stream` from our side.
    pub async fn fin(&self, stream: u32) -> bool {
        self.send(Frame::Data {
            stream_id: stream,
            flags: spdy::FLAG_FIN,
            data: vec![],
        })
        .await
    }
    /// Resolves when the connection's writer has ended (client gone or write failed).
    pub async fn closed(&self) {
        self.tx.closed().await
    }
    pub async fn reset(&self, stream: u32, status: u32) -> bool {
        self.send(Frame::RstStream {
            stream_id: stream,
            status,
        })
        .await
    }
}

/// An upgraded connection: its writer, the streams the client opens, and the writer's task
/// (done once every clone of the writer is gone and what was queued is written, or once
/// the client's side of the connection has ended, or the connection was idle too long).
pub type Session = (
    Writer,
    mpsc::UnboundedReceiver<Incoming>,
    tokio::task::JoinHandle<()>,
);

/// Starts the reader and writer tasks. `early` holds bytes read past the HTTP request head.
/// Returns the writer and the streams the client opens (ends when the connection does).
/// When the client's side ends (EOF, a read error, its GOAWAY, bad input), the writer sends
/// what is queued and ends too, as kubelet's SPDY server closes the connection then; it ends
/// at once when `expiry` (the idle timeout) passes.
pub fn start<R, W>(rd: R, wr: W, early: Vec<u8>, expiry: super::idle::Expiry) -> Session
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (writer, frx) = Writer::channel();
    let (stx, srx) = mpsc::unbounded_channel();
    // The reader holds no Writer: the connection ends once the session's are gone.
    let control = Arc::new(Control::default());
    let reader = tokio::spawn(read_loop(rd, early, control.clone(), stx));
    let wtask = tokio::spawn(async move {
        write_loop(wr, frx, &control, reader, expiry).await;
        control.close();
    });
    (writer, srx, wtask)
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut wr: W,
    mut rx: mpsc::Receiver<Frame>,
    control: &Control,
    mut reader: tokio::task::JoinHandle<()>,
    expiry: super::idle::Expiry,
) {
    let mut codec = Codec::new();
    let mut buf = Vec::new();
    let mut reading = true;
    let expired = expiry.wait();
    tokio::pin!(expired);
    let mut data = Vec::new();
    loop {
        let mut last = false;
        tokio::select! {
            biased;
            () = &mut expired => return,
            _ = &mut reader, if reading => {
                reading = false;
                // The client is done: what is queued goes out, nothing after it.
                rx.close();
                continue;
            }
            () = control.more.notified() => {}
            f = rx.recv() => match f {
                Some(f) => data.push(f),
                None => last = true,
            },
        }
        // Batch what is queued already.
        let mut size = 0;
        while size < 256 << 10 {
            let Ok(f) = rx.try_recv() else { break };
            if let Frame::Data { data, .. } = &f {
                size += data.len();
            }
            data.push(f);
        }
        // Control first, taken after the data: a stream's reply is queued before anything
        // is sent on it, so it goes out ahead of it.
        buf.clear();
        for f in control.take().iter().chain(data.iter()) {
            codec.encode(f, &mut buf);
        }
        data.clear();
        if !buf.is_empty() && !write_unless_expired(&mut wr, &buf, expired.as_mut()).await {
            return;
        }
        if last {
            break;
        }
    }
    let _ = wr.shutdown().await;
}

/// Writes `buf`, unless the connection expires first (a client that stopped reading, and
/// sends nothing either). False: the connection is done.
pub async fn write_unless_expired<W: AsyncWrite + Unpin>(
    wr: &mut W,
    buf: &[u8],
    expired: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> bool {
    let written = tokio::select! {
        r = wr.write_all(buf) => r,
        () = expired => return false,
    };
    if let Err(e) = written {
        tracing::debug!(error = %e, "streaming: write failed; connection closed");
        return false;
    }
    true
}

async fn read_loop<R: AsyncRead + Unpin>(
    mut rd: R,
    early: Vec<u8>,
    w: Arc<Control>,
    streams: mpsc::UnboundedSender<Incoming>,
) {
    let mut routes = HashMap::new();
    let budget = InputBudget::new();
    let mut codec = Codec::new();
    let mut buf = early;
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        loop {
            match codec.decode(&mut buf) {
                Ok(Some(f)) => {
                    let go_on = tokio::select! {
                        go_on = handle(f, &w, &mut routes, &budget, &streams) => go_on,
                        // A consumer waiting for room must not outlive the connection.
                        () = w.ended() => false,
                    };
                    if !go_on {
                        return;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "streaming: bad SPDY input; closing the connection");
                    w.send(Frame::GoAway {
                        last_stream_id: 0,
                        status: 1,
                    })
                    .await;
                    return;
                }
            }
        }
        let read = tokio::select! {
            r = rd.read(&mut chunk) => r,
            () = w.ended() => return,
        };
        match read {
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
async fn handle(
    f: Frame,
    w: &Control,
    routes: &mut HashMap<u32, InputTx>,
    budget: &InputBudget,
    streams: &mpsc::UnboundedSender<Incoming>,
) -> bool {
    match f {
        Frame::SynStream {
            stream_id,
            flags,
            headers,
            ..
        } => {
            if stream_id == 0 || routes.contains_key(&stream_id) {
                w.reset(stream_id, spdy::RST_PROTOCOL_ERROR).await;
                return true;
            }
            if routes.len() >= MAX_STREAMS {
                tracing::info!(
                    stream = stream_id,
                    "streaming: too many open streams on one connection; refused"
                );
                w.reset(stream_id, spdy::RST_REFUSED_STREAM).await;
                return true;
            }
            let (tx, rx) = budget.queue();
            if flags & spdy::FLAG_FIN == 0 {
                routes.insert(stream_id, tx);
            }
            w.send(Frame::SynReply {
                stream_id,
                flags: 0,
                headers: vec![],
            })
            .await;
            tracing::debug!(stream = stream_id, ?headers, "streaming: stream opened");
            if streams
                .send(Incoming {
                    id: stream_id,
                    headers,
                    rx,
                })
                .is_err()
            {
                w.reset(stream_id, spdy::RST_REFUSED_STREAM).await;
            }
        }
        Frame::Data {
            stream_id,
            flags,
            data,
        } => {
            if !data.is_empty() {
                // A frame is at most spdy::MAX_FRAME (1 MiB) long.
                let delta = u32::try_from(data.len()).unwrap_or(u32::MAX);
                // Data on a stream that is not open for sending is dropped, and its window
                // stays spent.
                let Some(tx) = routes.get(&stream_id) else {
                    return true;
                };
                if !tx.deliver(data).await {
                    routes.remove(&stream_id);
                }
                // Flow control: the stream's window comes back once its consumer has taken
                // the data in (or is gone). (No connection-level update on stream 0: SPDY/3
                // framers, which kubelet's is, refuse stream 0.)
                w.window(stream_id, delta);
            }
            if flags & spdy::FLAG_FIN != 0 {
                routes.remove(&stream_id);
            }
        }
        Frame::RstStream { stream_id, .. } => {
            routes.remove(&stream_id);
        }
        Frame::Ping(id) => {
            w.send(Frame::Ping(id)).await;
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn waits<F: std::future::Future>(f: F) -> bool {
        tokio::time::timeout(Duration::from_millis(100), f)
            .await
            .is_err()
    }

    /// The client's end of a connection under test.
    struct Client {
        io: tokio::io::DuplexStream,
        codec: Codec,
        buf: Vec<u8>,
    }

    impl Client {
        async fn send(&mut self, f: Frame) {
            let mut out = Vec::new();
            self.codec.encode(&f, &mut out);
            self.io.write_all(&out).await.unwrap();
        }
        async fn next(&mut self) -> Frame {
            let mut chunk = vec![0u8; 64 << 10];
            loop {
                if let Some(f) = self.codec.decode(&mut self.buf).unwrap() {
                    return f;
                }
                let n = self.io.read(&mut chunk).await.unwrap();
                assert!(n > 0, "connection closed");
                self.buf.extend_from_slice(&chunk[..n]);
            }
        }
    }

    fn syn(stream_id: u32, flags: u8) -> Frame {
        Frame::SynStream {
            stream_id,
            associated: 0,
            priority: 0,
            flags,
            headers: vec![],
        }
    }

    /// A client that does not read while the server has output queued: its pings are
    /// answered ahead of the queued output, and its input still flows.
    #[tokio::test]
    async fn control_and_input_do_not_wait_behind_output() {
        let (ours, theirs) = tokio::io::duplex(64 << 10);
        let (rd, wr) = tokio::io::split(ours);
        let (w, mut streams, _task) =
            start(rd, wr, Vec::new(), super::super::idle::Expiry::never());
        let mut c = Client {
            io: theirs,
            codec: Codec::new(),
            buf: Vec::new(),
        };
        c.send(syn(1, spdy::FLAG_FIN)).await;
        let out = streams.recv().await.unwrap();
        const FRAMES: usize = 100;
        let writer = w.clone();
        let output = tokio::spawn(async move {
            for _ in 0..FRAMES {
                assert!(writer.data(out.id, &[7u8; CHUNK]).await);
            }
        });
        // The queue and the pipe fill up.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!output.is_finished());
        c.send(Frame::Ping(7)).await;
        c.send(syn(3, 0)).await;
        c.send(Frame::Data {
            stream_id: 3,
            flags: spdy::FLAG_FIN,
            data: b"input".to_vec(),
        })
        .await;
        let mut input = tokio::time::timeout(Duration::from_secs(5), streams.recv())
            .await
            .expect("a stream opened while output waits")
            .unwrap();
        assert_eq!(input.id, 3);
        let got = tokio::time::timeout(Duration::from_secs(5), input.rx.recv()).await;
        assert_eq!(
            got.expect("input while output waits"),
            Some(b"input".to_vec())
        );
        // Now read: the pong comes before the output that was queued when it arrived.
        let mut data_before_pong = 0;
        loop {
            match c.next().await {
                Frame::Data { stream_id: 1, .. } => data_before_pong += 1,
                Frame::Ping(7) => break,
                _ => {}
            }
        }
        assert!(
            data_before_pong < WRITE_QUEUE,
            "{data_before_pong} data frames went ahead of the pong"
        );
        // All output arrives, and the window comes back for the input taken.
        let (mut data, mut window) = (data_before_pong, 0);
        while data < FRAMES || window == 0 {
            match c.next().await {
                Frame::Data {
                    stream_id: 1,
                    data: d,
                    ..
                } if !d.is_empty() => data += 1,
                Frame::WindowUpdate {
                    stream_id: 3,
                    delta,
                } => window += delta,
                _ => {}
            }
        }
        assert_eq!(window, 5);
        output.await.unwrap();
    }

    /// Once the session is done with the connection (its Writers dropped), what it queued
    /// goes out and the connection ends, although the client keeps it open.
    #[tokio::test]
    async fn the_connection_ends_with_its_session() {
        let (ours, theirs) = tokio::io::duplex(64 << 10);
        let (rd, wr) = tokio::io::split(ours);
        let (w, mut streams, task) = start(rd, wr, Vec::new(), super::super::idle::Expiry::never());
        let mut c = Client {
            io: theirs,
            codec: Codec::new(),
            buf: Vec::new(),
        };
        c.send(syn(1, 0)).await;
        let st = streams.recv().await.unwrap();
        assert!(w.data(st.id, b"bye").await);
        assert!(w.fin(st.id).await);
        drop(w);
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the writer ends")
            .unwrap();
        assert!(matches!(
            c.next().await,
            Frame::SynReply { stream_id: 1, .. }
        ));
        assert!(matches!(c.next().await, Frame::Data { data, .. } if data == b"bye"));
        assert!(matches!(
            c.next().await,
            Frame::Data {
                flags: spdy::FLAG_FIN,
                ..
            }
        ));
        let mut rest = Vec::new();
        c.io.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        // The reader ended too: the streams' channel is closed.
        assert!(streams.recv().await.is_none());
    }

    #[tokio::test]
    async fn input_waits_for_room_and_what_a_consumer_drops_goes_back() {
        let b = InputBudget::new();
        let (t1, mut r1) = b.queue();
        let (t2, r2) = b.queue();
        let (t3, mut r3) = b.queue();
        // A stream queues at most INPUT_QUEUE pieces of INPUT_CHUNK.
        assert!(t1.deliver(vec![1; INPUT_QUEUE * INPUT_CHUNK]).await);
        assert!(waits(t1.deliver(vec![1])).await, "a full stream waits");
        // The connection at most INPUT_BUDGET bytes (the cancelled delivery took none).
        assert!(
            t2.deliver(vec![2; INPUT_BUDGET - INPUT_QUEUE * INPUT_CHUNK])
                .await
        );
        assert!(waits(t3.deliver(vec![3])).await, "a full connection waits");
        // A consumer that goes away gives its queue back; delivering to it fails.
        drop(r2);
        assert!(!t2.deliver(vec![2]).await);
        assert!(t3.deliver(vec![3; 5]).await);
        assert_eq!(r3.try_recv(), Some(vec![3; 5]));
        // What is taken goes back too, in the order it came.
        assert_eq!(r1.recv().await, Some(vec![1; INPUT_CHUNK]));
        assert!(t1.deliver(vec![9]).await);
        let mut got = Vec::new();
        while let Some(d) = r1.try_recv() {
            got.extend(d);
        }
        assert_eq!(got.len(), (INPUT_QUEUE - 1) * INPUT_CHUNK + 1);
        assert_eq!(got.last(), Some(&9));
        assert_eq!(b.0.available_permits(), INPUT_BUDGET);
    }
}
