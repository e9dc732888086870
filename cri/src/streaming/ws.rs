//! WebSocket (RFC 6455) transports of the streaming server, server side, for clients that
//! do not speak SPDY upgrades (`crictl --transport websocket`, critest's `-websocket-*`,
//! client-go's WebSocket executor):
//!
//! - exec and attach: Kubernetes' channel protocols (`v5.channel.k8s.io`,
//!   `v4.channel.k8s.io`, `channel.k8s.io`): binary messages whose first byte is the channel
//!   (0 stdin, 1 stdout, 2 stderr, 3 error, 4 resize). v5 adds `[255, channel]`, the client
//!   closing its side of a channel (stdin's end). The base64 variants
//!   (`v4.base64.channel.k8s.io`, `base64.channel.k8s.io`) send text messages instead: the
//!   channel as an ASCII digit, then the data in base64 ([`Codec`]). The session ends with a
//!   close frame, which is each channel's end for the client. [`channels`] gives the exec
//!   code the same [`Writer`] and [`Incoming`] streams a SPDY connection does: a channel is a
//!   stream.
//! - port-forward: SPDY/3.1 tunnelled in binary messages (`SPDY/3.1+portforward.k8s.io`,
//!   client-go's tunnelling dialer). [`tunnel`] turns the messages back into a byte stream
//!   for the SPDY connection. Or kubelet's per-port channel protocol ([`forward_channels`]):
//!   a data and an error channel per port, each opened with the port number.
//!
//! Pings are answered with pongs; client frames must be masked; fragmented messages are
//! reassembled; no extensions are negotiated.

use super::conn::{self, Incoming, Session, Writer};
use super::idle::Expiry;
use super::spdy::Frame;
use super::ExecTarget;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// The GUID a handshake's accept key is derived with (RFC 6455, 1.3).
const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";
/// Largest message accepted from a client (stdin chunks and tunnelled SPDY frames are far
/// smaller).
const MAX_MESSAGE: usize = 16 << 20;
/// The channel protocols' channels.
const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const ERROR: u8 = 3;
const RESIZE: u8 = 4;
/// The v5 channel protocol's "close this channel" signal.
const CHANNEL_CLOSE: u8 = 255;

const OP_CONTINUATION: u8 = 0x0;
const OP_TEXT: u8 = 0x1;
const OP_BINARY: u8 = 0x2;
const OP_CLOSE: u8 = 0x8;
const OP_PING: u8 = 0x9;
const OP_PONG: u8 = 0xA;

/// Close codes sent.
const CLOSE_NORMAL: u16 = 1000;
const CLOSE_GOING_AWAY: u16 = 1001;
const CLOSE_PROTOCOL_ERROR: u16 = 1002;
const CLOSE_UNSUPPORTED: u16 = 1003;

/// The `Sec-WebSocket-Accept` value for a client's `Sec-WebSocket-Key`.
pub fn accept_key(key: &str) -> String {
    use base64::Engine;
    use sha1::Digest;
    let mut h = sha1::Sha1::new();
    h.update(key.trim().as_bytes());
    h.update(GUID.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(h.finalize())
}

/// Appends one unmasked, final frame (servers never mask).
fn encode(op: u8, payload: &[u8], out: &mut Vec<u8>) {
    out.push(0x80 | op);
    length(0, payload.len(), out);
    out.extend_from_slice(payload);
}

/// Appends a frame's payload length in its shortest form, with the mask bit `mask_bit`.
fn length(mask_bit: u8, n: usize, out: &mut Vec<u8>) {
    if let Some(b) = u8::try_from(n).ok().filter(|b| *b <= 125) {
        out.push(mask_bit | b);
    } else if let Ok(w) = u16::try_from(n) {
        out.push(mask_bit | 126);
        out.extend_from_slice(&w.to_be_bytes());
    } else {
        out.push(mask_bit | 127);
        out.extend_from_slice(&u64::try_from(n).unwrap_or(u64::MAX).to_be_bytes());
    }
}

fn close_payload(code: u16) -> Vec<u8> {
    code.to_be_bytes().to_vec()
}

/// A message or control frame from the client.
#[derive(Debug, PartialEq, Eq)]
enum Msg {
    Binary(Vec<u8>),
    Text(Vec<u8>),
    Ping(Vec<u8>),
    Pong,
    Close,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
enum WsError {
    #[error("unmasked client frame")]
    Unmasked,
    #[error("reserved bits set (no extension was negotiated)")]
    Reserved,
    #[error("bad control frame")]
    BadControl,
    #[error("continuation without a message, or a new message inside one")]
    BadFragment,
    #[error("message over {MAX_MESSAGE} bytes")]
    TooBig,
    #[error("unknown opcode {0:#x}")]
    Opcode(u8),
}

/// Reassembles the client's frames into messages.
#[derive(Default)]
struct Decoder {
    buf: Vec<u8>,
    /// Where the undecoded bytes of `buf` start (the buffer is compacted once per read, not
    /// once per frame: a read full of tiny frames costs one move, not one each).
    pos: usize,
    /// A fragmented message so far: its opcode and data.
    partial: Option<(u8, Vec<u8>)>,
}

impl Decoder {
    fn new(buf: Vec<u8>) -> Decoder {
        Decoder {
            buf,
            ..Decoder::default()
        }
    }

    /// Appends bytes read, dropping those already decoded.
    fn extend(&mut self, b: &[u8]) {
        self.buf.drain(..self.pos);
        self.pos = 0;
        self.buf.extend_from_slice(b);
    }

    /// The next complete message or control frame in what was read, if any.
    fn next(&mut self) -> Result<Option<Msg>, WsError> {
        loop {
            let Some((fin, op, payload)) = self.frame()? else {
                return Ok(None);
            };
            match op {
                OP_CLOSE => return Ok(Some(Msg::Close)),
                OP_PING => return Ok(Some(Msg::Ping(payload))),
                OP_PONG => return Ok(Some(Msg::Pong)),
                OP_TEXT | OP_BINARY if self.partial.is_some() => return Err(WsError::BadFragment),
                OP_TEXT | OP_BINARY if !fin => self.partial = Some((op, payload)),
                OP_TEXT => return Ok(Some(Msg::Text(payload))),
                OP_BINARY => return Ok(Some(Msg::Binary(payload))),
                OP_CONTINUATION => {
                    let Some((first, mut data)) = self.partial.take() else {
                        return Err(WsError::BadFragment);
                    };
                    if data.len() + payload.len() > MAX_MESSAGE {
                        return Err(WsError::TooBig);
                    }
                    data.extend_from_slice(&payload);
                    if !fin {
                        self.partial = Some((first, data));
                    } else if first == OP_TEXT {
                        return Ok(Some(Msg::Text(data)));
                    } else {
                        return Ok(Some(Msg::Binary(data)));
                    }
                }
                other => return Err(WsError::Opcode(other)),
            }
        }
    }

    /// One whole frame off the buffer, unmasked: (FIN, opcode, payload).
    fn frame(&mut self) -> Result<Option<(bool, u8, Vec<u8>)>, WsError> {
        let b = &self.buf[self.pos..];
        if b.len() < 2 {
            return Ok(None);
        }
        let (fin, rsv, op) = (b[0] & 0x80 != 0, b[0] & 0x70, b[0] & 0x0F);
        if rsv != 0 {
            return Err(WsError::Reserved);
        }
        if b[1] & 0x80 == 0 {
            return Err(WsError::Unmasked);
        }
        let (len, mut at) = match b[1] & 0x7F {
            126 if b.len() >= 4 => (u64::from(u16::from_be_bytes([b[2], b[3]])), 4),
            127 if b.len() >= 10 => {
                let mut n = [0u8; 8];
                n.copy_from_slice(&b[2..10]);
                (u64::from_be_bytes(n), 10)
            }
            126 | 127 => return Ok(None),
            n => (u64::from(n), 2),
        };
        if op & 0x8 != 0 && (!fin || len > 125) {
            return Err(WsError::BadControl);
        }
        let len = usize::try_from(len)
            .ok()
            .filter(|n| *n <= MAX_MESSAGE)
            .ok_or(WsError::TooBig)?;
        if b.len() < at + 4 + len {
            return Ok(None);
        }
        let mask = [b[at], b[at + 1], b[at + 2], b[at + 3]];
        at += 4;
        let mut payload = b[at..at + len].to_vec();
        for (i, x) in payload.iter_mut().enumerate() {
            *x ^= mask[i % 4];
        }
        self.pos += at + len;
        Ok(Some((fin, op, payload)))
    }
}

/// What the reader asks the writer to send.
enum Ctl {
    Pong(Vec<u8>),
    /// A close frame with this code, then the end of the connection.
    Close(u16),
}

/// How long the connection waits for the client's close frame after sending its own, and
/// for that close frame to be written.
const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
/// Control frames the writer may have queued; pongs past it are dropped (a client that
/// pings without reading must not grow the queue), and a close that does not fit is the
/// reader's end, which closes the connection as well.
const CTL_QUEUE: usize = 8;

/// Reads the client's messages, answers its pings (through `ctl`) and hands each data
/// message to `on_data` (false: stop), reading on once that is done: a consumer that is
/// slow slows the client down. Ends at the client's close, EOF, a read error or a protocol
/// error, and then asks the writer for a close frame with the matching code.
async fn read_messages<R, F>(
    rd: R,
    early: Vec<u8>,
    ctl: &mpsc::Sender<Ctl>,
    on_data: impl FnMut(Msg) -> F,
) where
    R: AsyncRead + Unpin,
    F: Future<Output = bool>,
{
    if let Some(code) = read_until_close(rd, early, ctl, on_data).await {
        let _ = ctl.try_send(Ctl::Close(code));
    }
}

/// [`read_messages`]' loop: the close code to answer with, or `None` when the writer has
/// closed already and the client did not answer in time.
async fn read_until_close<R, F>(
    mut rd: R,
    early: Vec<u8>,
    ctl: &mpsc::Sender<Ctl>,
    mut on_data: impl FnMut(Msg) -> F,
) -> Option<u16>
where
    R: AsyncRead + Unpin,
    F: Future<Output = bool>,
{
    let mut dec = Decoder::new(early);
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        loop {
            match dec.next() {
                Ok(Some(Msg::Ping(p))) => {
                    let _ = ctl.try_send(Ctl::Pong(p));
                }
                Ok(Some(Msg::Pong)) => {}
                Ok(Some(Msg::Close)) => {
                    tracing::debug!("streaming: WebSocket client closed the connection");
                    return Some(CLOSE_NORMAL);
                }
                Ok(Some(m)) => {
                    let go_on = tokio::select! {
                        go_on = on_data(m) => go_on,
                        // A consumer waiting for room must not outlive the connection.
                        () = ctl.closed() => return None,
                    };
                    if !go_on {
                        return Some(CLOSE_UNSUPPORTED);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "streaming: bad WebSocket input; closing the connection");
                    return Some(CLOSE_PROTOCOL_ERROR);
                }
            }
        }
        // Once the writer has sent its close frame, the client has a moment to answer it.
        let read = tokio::select! {
            r = rd.read(&mut chunk) => r,
            () = async {
                ctl.closed().await;
                tokio::time::sleep(CLOSE_GRACE).await;
            } => {
                tracing::debug!("streaming: no close frame from the WebSocket client in time");
                return None;
            }
        };
        match read {
            Ok(0) => {
                tracing::debug!("streaming: WebSocket client closed the connection");
                return Some(CLOSE_NORMAL);
            }
            Ok(n) => dec.extend(&chunk[..n]),
            Err(e) => {
                tracing::debug!(error = %e, "streaming: read failed");
                return Some(CLOSE_NORMAL);
            }
        }
    }
}

/// Writes the messages `first`, then control frames from `ctl` and, until it ends, the
/// messages `data` yields, all with opcode `op`; then a normal close frame. A close asked
/// for by the reader ends it at once.
async fn write_messages<W: AsyncWrite + Unpin>(
    mut wr: W,
    mut ctl: mpsc::Receiver<Ctl>,
    mut data: mpsc::Receiver<Vec<u8>>,
    (op, first): (u8, Vec<Vec<u8>>),
    expiry: Expiry,
) {
    let mut out = Vec::new();
    for m in first {
        encode(op, &m, &mut out);
    }
    let expired = expiry.wait();
    tokio::pin!(expired);
    let code = loop {
        if !out.is_empty() {
            if !conn::write_unless_expired(&mut wr, &out, expired.as_mut()).await {
                return;
            }
            out.clear();
        }
        tokio::select! {
            biased;
            () = &mut expired => break CLOSE_GOING_AWAY,
            c = ctl.recv() => match c {
                Some(Ctl::Pong(p)) => encode(OP_PONG, &p, &mut out),
                Some(Ctl::Close(code)) => break code,
                None => break CLOSE_NORMAL,
            },
            d = data.recv() => match d {
                Some(d) => encode(op, &d, &mut out),
                None => break CLOSE_NORMAL,
            },
        }
    };
    encode(OP_CLOSE, &close_payload(code), &mut out);
    let _ = tokio::time::timeout(CLOSE_GRACE, async {
        let _ = wr.write_all(&out).await;
        let _ = wr.shutdown().await;
    })
    .await;
}

/// How a channel protocol frames its messages. Kubelet's server speaks both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// `channel.k8s.io` and its versions: binary messages, the channel in the first byte.
    Binary,
    /// `base64.channel.k8s.io`, `v4.base64.channel.k8s.io`: text messages, the channel as an
    /// ASCII digit ('0' + channel), then the data in base64 (browsers' consoles).
    Base64,
}

impl Codec {
    /// The codec of a negotiated protocol (none: binary).
    pub fn of(protocol: Option<&str>) -> Codec {
        match protocol {
            Some(p) if p.contains("base64.") => Codec::Base64,
            _ => Codec::Binary,
        }
    }

    fn opcode(self) -> u8 {
        match self {
            Codec::Binary => OP_BINARY,
            Codec::Base64 => OP_TEXT,
        }
    }

    /// A message's payload for `data` on channel `ch`.
    fn frame(self, ch: u8, data: &[u8]) -> Vec<u8> {
        use base64::Engine;
        match self {
            Codec::Binary => {
                let mut m = Vec::with_capacity(data.len() + 1);
                m.push(ch);
                m.extend_from_slice(data);
                m
            }
            Codec::Base64 => {
                // As kubelet writes it (a rune, so UTF-8 past channel 79; text stays text).
                let mut m = String::with_capacity(2 + data.len().div_ceil(3) * 4);
                m.push(char::from(b'0'.wrapping_add(ch)));
                base64::engine::general_purpose::STANDARD.encode_string(data, &mut m);
                m.into_bytes()
            }
        }
    }
}

/// One channel of a session as the session code sees it: a stream with these headers.
struct Channel {
    num: u8,
    headers: Vec<(String, String)>,
    /// Whether what the client sends on it is delivered (else dropped, as kubelet does).
    input: bool,
}

fn header(k: &str, v: impl ToString) -> (String, String) {
    (k.to_string(), v.to_string())
}

/// A channel-protocol session (exec, attach of `t`) over an upgraded connection: at once,
/// one [`Incoming`] stream per channel kubelet's server opens for such a session, and a
/// [`Writer`] whose data on a stream id is sent on that channel. An empty message goes
/// first on the lowest channel the client reads, as kubelet tells the client the session is
/// up. The connection ends (close frame) once every clone of the writer is gone; the writer
/// is closed once the connection is.
pub fn channels<R, W>(
    (rd, wr, early): (R, W, Vec<u8>),
    codec: Codec,
    t: &ExecTarget,
    expiry: Expiry,
) -> Session
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let list = [
        (true, ERROR, "error"),
        (t.stdin, STDIN, "stdin"),
        (t.stdout, STDOUT, "stdout"),
        (t.stderr && !t.tty, STDERR, "stderr"),
        (t.tty, RESIZE, "resize"),
    ]
    .into_iter()
    .filter(|(want, ..)| *want)
    .map(|(_, num, kind)| Channel {
        num,
        headers: vec![header("streamtype", kind)],
        input: num == STDIN || num == RESIZE,
    })
    .collect();
    let opening = if t.stdout {
        STDOUT
    } else if t.stderr {
        STDERR
    } else {
        ERROR
    };
    open(
        (rd, wr, early),
        codec,
        list,
        vec![(opening, Vec::new())],
        expiry,
    )
}

/// Port-forward in a channel protocol (kubelet's `v4.channel.k8s.io`, as the Python,
/// JavaScript and Java clients speak it): a data channel (2i) and an error channel (2i+1)
/// for the i-th port, each opened with the port (2 bytes, little-endian). The streams carry
/// SPDY port-forward's headers (`streamtype`, `port`, `requestid`).
pub fn forward_channels<R, W>(
    (rd, wr, early): (R, W, Vec<u8>),
    codec: Codec,
    ports: &[u16],
    expiry: Expiry,
) -> Session
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mut list = Vec::new();
    let mut first = Vec::new();
    for (i, port) in ports.iter().enumerate() {
        for (num, kind) in [(2 * i, "data"), (2 * i + 1, "error")] {
            let num = u8::try_from(num).unwrap_or(u8::MAX);
            list.push(Channel {
                num,
                headers: vec![
                    header("streamtype", kind),
                    header("port", port),
                    header("requestid", i),
                ],
                input: kind == "data",
            });
            first.push((num, port.to_le_bytes().to_vec()));
        }
    }
    open((rd, wr, early), codec, list, first, expiry)
}

/// The session of `list`'s channels, after the messages `first` (channel, data).
fn open<R, W>(
    (rd, wr, early): (R, W, Vec<u8>),
    codec: Codec,
    list: Vec<Channel>,
    first: Vec<(u8, Vec<u8>)>,
    expiry: Expiry,
) -> Session
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (writer, mut frames) = Writer::channel();
    let (stx, srx) = mpsc::unbounded_channel();
    let mut routes = HashMap::new();
    let budget = conn::InputBudget::new();
    for c in list {
        let (tx, rx) = budget.queue();
        // What the client sends on channels it only reads is dropped.
        if c.input {
            routes.insert(c.num, Arc::new(tx));
        }
        let _ = stx.send(Incoming {
            id: u32::from(c.num),
            headers: c.headers,
            rx,
        });
    }
    let (ctx, crx) = mpsc::channel(CTL_QUEUE);
    let (dtx, drx) = mpsc::channel(64);
    let first = first.iter().map(|(ch, d)| codec.frame(*ch, d)).collect();
    let wtask = tokio::spawn(write_messages(
        wr,
        crx,
        drx,
        (codec.opcode(), first),
        expiry,
    ));
    // The writer's frames as messages: a data frame's stream is its channel. A stream's end
    // is the connection's end here; resets and the rest are SPDY's own.
    tokio::spawn(async move {
        loop {
            let f = tokio::select! {
                f = frames.recv() => f,
                () = dtx.closed() => return,
            };
            match f {
                Some(Frame::Data {
                    stream_id, data, ..
                }) if !data.is_empty() => {
                    let ch = u8::try_from(stream_id).unwrap_or(u8::MAX);
                    if dtx.send(codec.frame(ch, &data)).await.is_err() {
                        return;
                    }
                }
                Some(_) => {}
                None => return,
            }
        }
    });
    tokio::spawn(async move {
        // No stream is opened later; the receiver stays open while the session reads.
        let _streams = stx;
        read_messages(rd, early, &ctx, |m| {
            // The channel's queue and the data for it, if any.
            let to = match decode(codec, m, |ch| routes.contains_key(&ch)) {
                Input::Close(ch) => {
                    routes.remove(&ch);
                    None
                }
                Input::Data(ch, d) => routes.get(&ch).map(|tx| (Arc::clone(tx), d)),
                Input::Nothing => None,
                Input::Bad(why) => {
                    tracing::debug!(why, "streaming: channel message skipped");
                    None
                }
            };
            async move {
                if let Some((tx, d)) = to {
                    // A consumer that is gone drops what is sent to it, as before its end.
                    tx.deliver(d).await;
                }
                true
            }
        })
        .await;
    });
    (writer, srx, wtask)
}

/// A client's channel message, decoded.
#[derive(Debug, PartialEq, Eq)]
enum Input {
    /// Data for a channel.
    Data(u8, Vec<u8>),
    /// v5: the client closes its side of a channel (`[255, channel]`).
    Close(u8),
    /// Nothing to deliver: an empty message, one with a channel and no data, or one for a
    /// channel the session does not read.
    Nothing,
    /// A message that cannot be read, skipped as kubelet does.
    Bad(&'static str),
}

/// A client's message as kubelet reads it: a message of either kind in either codec. Data
/// for a channel the session does not read (`reads` says) is not decoded.
fn decode(codec: Codec, m: Msg, reads: impl Fn(u8) -> bool) -> Input {
    use base64::Engine;
    let (Msg::Binary(mut d) | Msg::Text(mut d)) = m else {
        return Input::Nothing;
    };
    match codec {
        Codec::Binary => match d.as_slice() {
            [CHANNEL_CLOSE, ch, ..] => Input::Close(*ch),
            [ch, _, ..] if reads(*ch) => {
                let ch = *ch;
                Input::Data(ch, d.split_off(1))
            }
            _ => Input::Nothing,
        },
        Codec::Base64 => {
            // The channel is one character, '0' + channel (UTF-8 past 79, as it is written).
            let Some((c, rest)) = std::str::from_utf8(&d).ok().and_then(|t| {
                let mut chars = t.chars();
                chars.next().map(|c| (c, chars.as_str()))
            }) else {
                return Input::Bad("a message that is not text");
            };
            let Some(ch) = u32::from(c)
                .checked_sub(u32::from(b'0'))
                .and_then(|n| u8::try_from(n).ok())
            else {
                return Input::Bad("a channel that is not a digit");
            };
            if rest.is_empty() || !reads(ch) {
                return Input::Nothing;
            }
            match base64::engine::general_purpose::STANDARD.decode(rest) {
                Ok(data) => Input::Data(ch, data),
                Err(_) => Input::Bad("data that is not base64"),
            }
        }
    }
}

/// A tunnel (port-forward's SPDY over WebSocket): returns the end that carries the
/// messages' bytes; what is written to it goes to the client in binary messages.
pub fn tunnel<R, W>(rd: R, wr: W, early: Vec<u8>, expiry: Expiry) -> tokio::io::DuplexStream
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (ours, theirs) = tokio::io::duplex(256 << 10);
    let (mut from_spdy, mut to_spdy) = tokio::io::split(ours);
    let (ctx, crx) = mpsc::channel(CTL_QUEUE);
    let (dtx, drx) = mpsc::channel(16);
    tokio::spawn(write_messages(
        wr,
        crx,
        drx,
        (OP_BINARY, Vec::new()),
        expiry,
    ));
    tokio::spawn(async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = tokio::select! {
                r = from_spdy.read(&mut buf) => r.unwrap_or(0),
                () = dtx.closed() => return,
            };
            if n == 0 || dtx.send(buf[..n].to_vec()).await.is_err() {
                return;
            }
        }
    });
    tokio::spawn(async move {
        // Bounded: the SPDY connection on the other end reads as its streams' consumers
        // take their data in, so a slow one slows the tunnel's reader, and the client.
        let (tx, mut rx) = conn::InputBudget::new().queue();
        let tx = Arc::new(tx);
        let pump = tokio::spawn(async move {
            while let Some(d) = rx.recv().await {
                if to_spdy.write_all(&d).await.is_err() {
                    return;
                }
            }
            let _ = to_spdy.shutdown().await;
        });
        read_messages(rd, early, &ctx, |m| {
            let tx = tx.clone();
            async move {
                match m {
                    Msg::Binary(d) => tx.deliver(d).await,
                    _ => {
                        tracing::info!("streaming: text message in a SPDY tunnel; closing");
                        false
                    }
                }
            }
        })
        .await;
        drop(tx);
        let _ = pump.await;
    });
    theirs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A masked client frame.
    fn client_frame(fin: bool, op: u8, payload: &[u8]) -> Vec<u8> {
        let mask = [0x12, 0x34, 0x56, 0x78];
        let mut out = vec![if fin { 0x80 } else { 0 } | op];
        length(0x80, payload.len(), &mut out);
        out.extend_from_slice(&mask);
        out.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        out
    }

    #[test]
    fn accept_key_of_rfc_example() {
        // RFC 6455, 1.3.
        assert_eq!(
            accept_key("dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[test]
    fn decodes_masked_fragmented_and_control_frames() {
        let mut d = Decoder::new(client_frame(true, OP_BINARY, &[1, b'h', b'i']));
        let big = vec![7u8; 70_000];
        d.extend(&client_frame(false, OP_BINARY, &[0, b'a']));
        assert_eq!(d.next(), Ok(Some(Msg::Binary(vec![1, b'h', b'i']))));
        // A ping between fragments comes out at once; bytes decoded before go at the next
        // read.
        d.extend(&client_frame(true, OP_PING, b"hb"));
        d.extend(&client_frame(false, OP_CONTINUATION, b"b"));
        d.extend(&client_frame(true, OP_CONTINUATION, b"c"));
        d.extend(&client_frame(true, OP_BINARY, &big));
        d.extend(&client_frame(true, OP_CLOSE, &close_payload(1000)));
        assert_eq!(d.next(), Ok(Some(Msg::Ping(b"hb".to_vec()))));
        assert_eq!(d.next(), Ok(Some(Msg::Binary(b"\0abc".to_vec()))));
        assert_eq!(d.next(), Ok(Some(Msg::Binary(big))));
        assert_eq!(d.next(), Ok(Some(Msg::Close)));
        assert_eq!(d.next(), Ok(None));
    }

    #[test]
    fn partial_frames_wait_for_more() {
        let f = client_frame(true, OP_BINARY, &[3u8; 300]);
        let mut d = Decoder::default();
        for (i, b) in f.iter().enumerate() {
            assert_eq!(d.next(), Ok(None), "after {i} bytes");
            d.extend(&[*b]);
        }
        assert_eq!(d.next(), Ok(Some(Msg::Binary(vec![3u8; 300]))));
    }

    #[test]
    fn refuses_bad_frames() {
        let bad = |bytes: Vec<u8>| Decoder::new(bytes).next();
        // Unmasked.
        let mut f = client_frame(true, OP_BINARY, b"x");
        f[1] &= 0x7F;
        assert_eq!(bad(f), Err(WsError::Unmasked));
        // A reserved bit.
        let mut f = client_frame(true, OP_BINARY, b"x");
        f[0] |= 0x40;
        assert_eq!(bad(f), Err(WsError::Reserved));
        // A fragmented ping, an oversized one.
        assert_eq!(
            bad(client_frame(false, OP_PING, b"")),
            Err(WsError::BadControl)
        );
        assert_eq!(
            bad(client_frame(true, OP_PING, &[0; 126])),
            Err(WsError::BadControl)
        );
        // A continuation out of the blue; a new message inside a fragmented one.
        assert_eq!(
            bad(client_frame(true, OP_CONTINUATION, b"x")),
            Err(WsError::BadFragment)
        );
        let mut f = client_frame(false, OP_BINARY, b"x");
        f.extend(client_frame(true, OP_BINARY, b"y"));
        assert_eq!(bad(f), Err(WsError::BadFragment));
        // A length past the limit is refused before its bytes arrive.
        let mut f = vec![0x82, 0x80 | 127];
        f.extend_from_slice(&(u64::MAX).to_be_bytes());
        assert_eq!(bad(f), Err(WsError::TooBig));
        assert_eq!(bad(vec![0x83, 0x80, 0, 0, 0, 0]), Err(WsError::Opcode(3)));
    }

    #[test]
    fn channel_messages_in_both_codecs() {
        // Kubelet's framings: a byte and raw data; an ASCII digit and base64.
        assert_eq!(Codec::Binary.frame(1, b"hi"), b"\x01hi");
        assert_eq!(Codec::Base64.frame(1, b"hi"), b"1aGk=");
        assert_eq!(Codec::Base64.frame(3, b""), b"3");
        assert_eq!(Codec::of(Some("v4.base64.channel.k8s.io")), Codec::Base64);
        assert_eq!(Codec::of(Some("base64.channel.k8s.io")), Codec::Base64);
        assert_eq!(Codec::of(Some("v5.channel.k8s.io")), Codec::Binary);
        assert_eq!(Codec::of(None), Codec::Binary);
        let all = |_| true;
        assert_eq!(
            decode(Codec::Binary, Msg::Binary(b"\x00ab".to_vec()), all),
            Input::Data(0, b"ab".to_vec())
        );
        assert_eq!(
            decode(Codec::Binary, Msg::Binary(vec![CHANNEL_CLOSE, 0]), all),
            Input::Close(0)
        );
        assert_eq!(
            decode(Codec::Binary, Msg::Binary(vec![0]), all),
            Input::Nothing
        );
        // Either kind of message, in either codec, as kubelet reads them.
        assert_eq!(
            decode(Codec::Binary, Msg::Text(b"\x00ab".to_vec()), all),
            Input::Data(0, b"ab".to_vec())
        );
        assert_eq!(
            decode(Codec::Base64, Msg::Text(b"4eyJXaWR0aCI6ODB9".to_vec()), all),
            Input::Data(4, br#"{"Width":80}"#.to_vec())
        );
        assert_eq!(
            decode(Codec::Base64, Msg::Binary(b"0aGk=".to_vec()), all),
            Input::Data(0, b"hi".to_vec())
        );
        assert_eq!(
            decode(Codec::Base64, Msg::Text(b"0".to_vec()), all),
            Input::Nothing
        );
        // Channels past 79 are one UTF-8 character, both ways.
        let far = Codec::Base64.frame(200, b"x");
        assert_eq!(
            decode(Codec::Base64, Msg::Text(far), all),
            Input::Data(200, b"x".to_vec())
        );
        // Bad messages are skipped; data for channels not read is not decoded.
        assert!(matches!(
            decode(Codec::Base64, Msg::Text(b"0not base64!".to_vec()), all),
            Input::Bad(_)
        ));
        assert!(matches!(
            decode(Codec::Base64, Msg::Text(b"\x01aGk=".to_vec()), all),
            Input::Bad(_)
        ));
        assert_eq!(
            decode(Codec::Base64, Msg::Text(b"3not base64!".to_vec()), |ch| ch
                == 0),
            Input::Nothing
        );
        assert_eq!(
            decode(Codec::Binary, Msg::Binary(b"\x03ab".to_vec()), |ch| ch == 0),
            Input::Nothing
        );
    }

    #[test]
    fn server_frames_use_the_shortest_length() {
        for (n, head) in [(5usize, 2usize), (200, 4), (70_000, 10)] {
            let mut out = Vec::new();
            encode(OP_BINARY, &vec![1u8; n], &mut out);
            assert_eq!(out.len(), head + n);
            assert_eq!(out[0], 0x82);
        }
    }
}
