//! The CRI streaming server: `Exec` and `PortForward` hand back a one-time URL of this HTTP
//! server; kubelet (or crictl) connects there and upgrades the connection to SPDY/3.1, then
//! speaks Kubernetes' `channel.k8s.io` (exec) or `portforward.k8s.io` protocols over SPDY
//! streams.
//!
//! - Exec runs through the pod agent's `Exec` gRPC stream, so flat and VM pods behave alike.
//! - PortForward connects to 127.0.0.1:PORT inside a flat pod's network namespace (from a
//!   dedicated thread that enters the namespace; tokio workers never change namespace).
//! - Clients may upgrade to WebSocket instead (see `ws`): exec and attach in the
//!   `v5.channel.k8s.io`/`v4.channel.k8s.io`/`channel.k8s.io` channel protocols (and the
//!   base64 variants of the last two), port-forward as SPDY tunnelled over WebSocket
//!   (`SPDY/3.1+portforward.k8s.io`) or in kubelet's per-port channel protocol.

pub use vessel_spdy as spdy;

mod conn;
mod idle;
mod ws;

use crate::runtime::Runtime;
use crate::sandbox::ForwardTarget;
use conn::{Incoming, Writer};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use vessel_agent::proto::{exec_input, exec_output, ExecInput, WindowSize};

/// How long an unused token stays valid.
pub const TOKEN_TTL: Duration = Duration::from_secs(60);
/// How long the client has to send its request head, and to open the streams it needs.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a streaming connection may be silent before TCP keepalive probes it, and the
/// interval of the probes (three unanswered: the connection is gone).
const KEEPALIVE: Duration = Duration::from_secs(30);
/// Largest HTTP request head accepted.
const MAX_HEAD: usize = 16 << 10;

/// Kubernetes' channel protocols (exec, attach; port-forward over WebSocket).
const V5: &str = "v5.channel.k8s.io";
const V4: &str = "v4.channel.k8s.io";
const V4_BASE64: &str = "v4.base64.channel.k8s.io";
const V1: &str = "channel.k8s.io";
const V1_BASE64: &str = "base64.channel.k8s.io";
/// The exec protocols over SPDY, best first.
const EXEC_PROTOCOLS: &[&str] = &[V4, "v3.channel.k8s.io", "v2.channel.k8s.io", V1];
const PORT_FORWARD_PROTOCOL: &str = "portforward.k8s.io";
/// The exec protocols over WebSocket, binary and base64, as kubelet's server speaks them.
const WS_EXEC_PROTOCOLS: &[&str] = &[V5, V4, V4_BASE64, V1, V1_BASE64];
/// Port-forward's SPDY tunnelled over WebSocket (client-go's tunnelling dialer).
const WS_PORT_FORWARD_PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";
/// Port-forward over WebSocket: the SPDY tunnel, or kubelet's channel protocol (one data and
/// one error channel per port of the URL's `port` query).
const WS_PORT_FORWARD_PROTOCOLS: &[&str] = &[WS_PORT_FORWARD_PROTOCOL, V4, V4_BASE64];
/// Most ports one channel-protocol port-forward carries (two channels each, one byte each).
const WS_MAX_PORTS: usize = 128;
/// How long a forward waits for the client's side once the pod's side has ended, as
/// containerd's forwarder does: a channel-protocol client cannot half-close a channel, and
/// kubectl's SPDY one ends its data stream only once its local connection ends, which it
/// ends once the forward has (its error stream closed).
const FORWARD_LINGER: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum StreamingError {
    #[error("streaming server: bind {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

/// What an exec or attach session runs against and which streams it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecTarget {
    pub container_id: String,
    /// The command to run; `None` attaches to the container's own process (its terminal
    /// when it has one).
    pub cmd: Option<Vec<String>>,
    pub tty: bool,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
}

/// What a token stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamRequest {
    /// An exec of a command, or an attach to the container's own stdio.
    Exec(ExecTarget),
    PortForward {
        pod_id: String,
        /// Where the pod's localhost is.
        target: ForwardTarget,
        /// The ports the request named: a channel-protocol WebSocket forward's ports when
        /// its URL has no `port` query (SPDY names them per stream).
        ports: Vec<u16>,
    },
}

impl From<ExecTarget> for StreamRequest {
    fn from(t: ExecTarget) -> StreamRequest {
        StreamRequest::Exec(t)
    }
}

impl StreamRequest {
    fn kind(&self) -> &'static str {
        match self {
            StreamRequest::Exec(t) if t.cmd.is_some() => "exec",
            StreamRequest::Exec(_) => "attach",
            StreamRequest::PortForward { .. } => "portforward",
        }
    }
}

/// One-time tokens: random, single use, expire after [`TOKEN_TTL`] unused.
#[derive(Default)]
pub struct Tokens {
    map: Mutex<HashMap<String, (Instant, StreamRequest)>>,
}

impl Tokens {
    pub fn insert(&self, req: StreamRequest) -> String {
        let mut b = [0u8; 16];
        let mut filled = 0;
        while filled < b.len() {
            match rustix::rand::getrandom(&mut b[filled..], rustix::rand::GetRandomFlags::empty()) {
                Ok(n) => filled += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    // getrandom(2) cannot fail on Linux >= 3.17 with a valid buffer; mix the
                    // clock in rather than hand out a predictable token.
                    tracing::error!(error = %e, "getrandom failed; using the clock");
                    let t = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap_or_default()
                        .as_nanos();
                    b = t.to_le_bytes();
                    filled = b.len();
                }
            }
        }
        let token: String = b.iter().map(|x| format!("{x:02x}")).collect();
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        m.retain(|_, (t, _)| now.duration_since(*t) < TOKEN_TTL);
        m.insert(token.clone(), (now, req));
        token
    }

    /// Takes a token's request: valid once, and only before it expires.
    pub fn take(&self, token: &str) -> Option<StreamRequest> {
        let mut m = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let (t, req) = m.remove(token)?;
        (t.elapsed() < TOKEN_TTL).then_some(req)
    }
}

/// The streaming server: its address and its tokens.
pub struct StreamingServer {
    base: String,
    tokens: Tokens,
    rt: Arc<Runtime>,
    /// Upgraded connections idle this long are closed; none: never.
    idle_timeout: Option<Duration>,
}

impl StreamingServer {
    /// Binds `addr` (port 0: any free port). Upgraded connections on which nothing moves for
    /// `idle_timeout` are closed (none: never).
    pub async fn bind(
        addr: &str,
        rt: Arc<Runtime>,
        idle_timeout: Option<Duration>,
    ) -> Result<(Arc<StreamingServer>, TcpListener), StreamingError> {
        let err = |source| StreamingError::Bind {
            addr: addr.to_string(),
            source,
        };
        let l = TcpListener::bind(addr).await.map_err(err)?;
        let local = l.local_addr().map_err(err)?;
        let s = Arc::new(StreamingServer {
            base: format!("http://{local}"),
            tokens: Tokens::default(),
            rt,
            idle_timeout,
        });
        Ok((s, l))
    }

    /// The server's base URL, e.g. `http://127.0.0.1:34567`.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// A one-time URL for `req`.
    pub fn url(&self, req: impl Into<StreamRequest>) -> String {
        let req = req.into();
        let kind = req.kind();
        let token = self.tokens.insert(req);
        format!("{}/{kind}/{token}", self.base)
    }

    /// Accepts connections until the task is aborted.
    pub async fn serve(self: Arc<Self>, l: TcpListener) {
        tracing::info!(url = %self.base, "streaming server: serving exec and port-forward");
        loop {
            match l.accept().await {
                Ok((s, peer)) => {
                    let me = self.clone();
                    tokio::spawn(async move {
                        if let Err(e) = me.connection(s).await {
                            tracing::debug!(%peer, error = %e, "streaming: connection ended");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "streaming server: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    async fn connection(&self, mut s: TcpStream) -> std::io::Result<()> {
        let _ = s.set_nodelay(true);
        let (head, early) = match tokio::time::timeout(HANDSHAKE_TIMEOUT, read_head(&mut s)).await {
            Ok(Ok(Some(h))) => h,
            Ok(Ok(None)) => return reply(&mut s, 400, "bad request head").await,
            Ok(Err(e)) => return Err(e),
            Err(_) => return reply(&mut s, 408, "request head timed out").await,
        };
        let Some((kind, token)) = head.path.trim_start_matches('/').split_once('/') else {
            return reply(&mut s, 404, "no such streaming endpoint").await;
        };
        let token = token.split('?').next().unwrap_or_default();
        let Some(req) = self.tokens.take(token) else {
            tracing::info!(path = %head.path, "streaming: unknown, used or expired token");
            return reply(&mut s, 404, "unknown, used or expired streaming token").await;
        };
        if req.kind() != kind {
            return reply(&mut s, 404, "token is for another kind of stream").await;
        }
        let upgrade = head.get_all("upgrade").join(",").to_ascii_lowercase();
        if upgrade.contains("websocket") {
            return self.websocket(s, &head, early, req).await;
        }
        if !upgrade.contains("spdy/3.1") {
            return reply(&mut s, 400, "expected Upgrade: SPDY/3.1").await;
        }
        let offered = head.list("x-stream-protocol-version");
        let supported: &[&str] = match &req {
            StreamRequest::Exec(_) => EXEC_PROTOCOLS,
            StreamRequest::PortForward { .. } => &[PORT_FORWARD_PROTOCOL],
        };
        // The client's order decides, as in Kubernetes' handshake.
        let proto = if offered.is_empty() {
            None
        } else {
            match offered.iter().find(|o| supported.contains(&o.as_str())) {
                Some(p) => Some(p.clone()),
                None => {
                    return reply(
                        &mut s,
                        403,
                        &format!(
                        "no supported stream protocol in {offered:?}; vessel speaks {supported:?}"
                    ),
                    )
                    .await
                }
            }
        };
        let mut resp = String::from(
            "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n",
        );
        if let Some(p) = &proto {
            resp.push_str(&format!("X-Stream-Protocol-Version: {p}\r\n"));
        }
        resp.push_str("\r\n");
        s.write_all(resp.as_bytes()).await?;
        tracing::info!(kind, protocol = ?proto, "streaming: upgraded to SPDY/3.1");
        let _open = crate::metrics::get().stream_session(kind, "spdy");
        let (rd, wr, expiry) = self.halves(s);
        let version = match proto.as_deref() {
            Some(V4) => 4,
            Some("v3.channel.k8s.io") => 3,
            Some("v2.channel.k8s.io") => 2,
            _ => 1,
        };
        self.session(req, version, conn::start(rd, wr, early, expiry))
            .await;
        Ok(())
    }

    /// A WebSocket upgrade (RFC 6455): exec and attach in a channel protocol, port-forward
    /// as SPDY tunnelled in binary messages (see `ws`).
    async fn websocket(
        &self,
        mut s: TcpStream,
        head: &Head,
        early: Vec<u8>,
        req: StreamRequest,
    ) -> std::io::Result<()> {
        let key = head.get_all("sec-websocket-key").join("");
        if key.trim().is_empty() {
            return reply(&mut s, 400, "WebSocket upgrade without Sec-WebSocket-Key").await;
        }
        if !head.list("sec-websocket-version").iter().any(|v| v == "13") {
            return reply(
                &mut s,
                426,
                "WebSocket upgrade: Sec-WebSocket-Version 13 required",
            )
            .await;
        }
        let offered = head.list("sec-websocket-protocol");
        let supported: &[&str] = match &req {
            StreamRequest::Exec(_) => WS_EXEC_PROTOCOLS,
            StreamRequest::PortForward { .. } => WS_PORT_FORWARD_PROTOCOLS,
        };
        // The client's order decides, as in Kubernetes' handshake; none offered is the
        // binary channel protocol.
        let proto = offered.iter().find(|o| supported.contains(&o.as_str()));
        let tunnel = proto.is_some_and(|p| p == WS_PORT_FORWARD_PROTOCOL);
        if proto.is_none() && !offered.is_empty() {
            return reply(
                &mut s,
                400,
                &format!(
                    "no supported WebSocket protocol in {offered:?}; vessel speaks {supported:?} over WebSocket, and SPDY/3.1"
                ),
            )
            .await;
        }
        // A channel-protocol forward's ports, checked before the upgrade, as kubelet does.
        let ports = match &req {
            StreamRequest::PortForward { ports, .. } if !tunnel => {
                match forward_ports(&head.path, ports) {
                    Ok(p) => p,
                    Err(why) => return reply(&mut s, 400, &why).await,
                }
            }
            _ => Vec::new(),
        };
        let mut resp = format!(
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {}\r\n",
            ws::accept_key(&key)
        );
        if let Some(p) = proto {
            resp.push_str(&format!("Sec-WebSocket-Protocol: {p}\r\n"));
        }
        resp.push_str("\r\n");
        s.write_all(resp.as_bytes()).await?;
        tracing::info!(kind = req.kind(), protocol = ?proto, "streaming: upgraded to WebSocket");
        let _open = crate::metrics::get().stream_session(req.kind(), "websocket");
        let (rd, wr, expiry) = self.halves(s);
        let codec = ws::Codec::of(proto.map(String::as_str));
        match req {
            StreamRequest::Exec(t) => {
                let version = match proto.map(String::as_str) {
                    Some(V5 | V4 | V4_BASE64) => 4,
                    _ => 1,
                };
                let conn = ws::channels((rd, wr, early), codec, &t, expiry);
                self.session(StreamRequest::Exec(t), version, conn).await;
            }
            StreamRequest::PortForward { pod_id, target, .. } if !tunnel => {
                let (w, streams, wtask) =
                    ws::forward_channels((rd, wr, early), codec, &ports, expiry);
                forward_all(&pod_id, target, &ports, &w, streams).await;
                finish(w, wtask).await;
            }
            StreamRequest::PortForward { .. } => {
                // The tunnelled connection ends with the WebSocket one, also when idle.
                let (trd, twr) = tokio::io::split(ws::tunnel(rd, wr, early, expiry.clone()));
                let conn = conn::start(trd, twr, Vec::new(), expiry);
                self.session(req, 1, conn).await;
            }
        }
        Ok(())
    }

    /// An upgraded connection's halves, under the idle timeout, with TCP keepalive (a
    /// client that vanished without a FIN or RST is found in minutes, not never).
    fn halves(
        &self,
        s: TcpStream,
    ) -> (
        idle::Idle<tokio::net::tcp::OwnedReadHalf>,
        idle::Idle<tokio::net::tcp::OwnedWriteHalf>,
        idle::Expiry,
    ) {
        {
            use rustix::net::sockopt;
            let set = sockopt::set_tcp_keepidle(&s, KEEPALIVE)
                .and_then(|()| sockopt::set_tcp_keepintvl(&s, KEEPALIVE))
                .and_then(|()| sockopt::set_tcp_keepcnt(&s, 3))
                .and_then(|()| sockopt::set_socket_keepalive(&s, true));
            if let Err(e) = set {
                tracing::debug!(error = %e, "streaming: TCP keepalive not set");
            }
        }
        let (rd, wr) = s.into_split();
        let bytes = crate::metrics::get().stream_bytes();
        idle::wrap(rd, wr, self.idle_timeout, Some(bytes))
    }

    /// Runs an upgraded session on its connection (`version`: the exec protocol's).
    async fn session(&self, req: StreamRequest, version: u8, (w, streams, wtask): conn::Session) {
        match req {
            StreamRequest::Exec(target) => {
                exec(&self.rt, ExecParams { target, version }, &w, streams).await;
            }
            StreamRequest::PortForward { pod_id, target, .. } => {
                port_forward(&pod_id, target, &w, streams).await;
            }
        }
        finish(w, wtask).await;
    }
}

/// A session's end: its writer goes, and what it queued is flushed (the writer's task ends
/// once every clone of it is gone).
async fn finish(w: Writer, wtask: tokio::task::JoinHandle<()>) {
    drop(w);
    let _ = tokio::time::timeout(Duration::from_secs(5), wtask).await;
}

/// The ports of a channel-protocol WebSocket forward: the URL's `port` query (repeated or
/// comma-separated, as kubelet reads it), else what the PortForward request named.
fn forward_ports(path: &str, named: &[u16]) -> Result<Vec<u16>, String> {
    let query = path.split_once('?').map(|(_, q)| q).unwrap_or_default();
    let mut ports = Vec::new();
    for v in query.split('&').filter_map(|kv| kv.strip_prefix("port=")) {
        // Commas, also percent-encoded.
        for p in v.replace("%2C", ",").replace("%2c", ",").split(',') {
            match p.parse::<u16>() {
                Ok(n) if n > 0 => ports.push(n),
                _ => {
                    return Err(format!(
                        "port-forward: {p:?} in query parameter \"port\" is not a port"
                    ))
                }
            }
        }
    }
    if ports.is_empty() {
        ports = named.to_vec();
    }
    if ports.is_empty() {
        return Err(
            "port-forward over a WebSocket channel protocol: query parameter \"port\" is required"
                .into(),
        );
    }
    if ports.len() > WS_MAX_PORTS {
        return Err(format!(
            "port-forward: {} ports on one WebSocket connection; at most {WS_MAX_PORTS}",
            ports.len()
        ));
    }
    Ok(ports)
}

// ---------- HTTP/1.1 request head ----------

struct Head {
    path: String,
    headers: Vec<(String, String)>,
}

impl Head {
    /// The comma-separated values of every `name` header, in order.
    fn list(&self, name: &str) -> Vec<String> {
        self.get_all(name)
            .iter()
            .flat_map(|v| v.split(','))
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .collect()
    }
    fn get_all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// Reads the request head; returns it with the bytes read past it. `None`: malformed.
async fn read_head(s: &mut TcpStream) -> std::io::Result<Option<(Head, Vec<u8>)>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if buf.len() > MAX_HEAD {
            return Ok(None);
        }
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let early = buf[end + 4..].to_vec();
    Ok(parse_head(&buf[..end]).map(|h| (h, early)))
}

fn parse_head(b: &[u8]) -> Option<Head> {
    let text = std::str::from_utf8(b).ok()?;
    let mut lines = text.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let _method = first.next()?;
    let path = first.next()?.to_string();
    if !first.next()?.starts_with("HTTP/1.") {
        return None;
    }
    let mut headers = Vec::new();
    for l in lines {
        let (k, v) = l.split_once(':')?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    Some(Head { path, headers })
}

async fn reply(s: &mut TcpStream, code: u16, msg: &str) -> std::io::Result<()> {
    let reason = match code {
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        408 => "Request Timeout",
        426 => "Upgrade Required",
        _ => "Error",
    };
    // 426 is only a WebSocket version refusal here: it names the version spoken (RFC 6455).
    let extra = if code == 426 {
        "Sec-WebSocket-Version: 13\r\n"
    } else {
        ""
    };
    let body = format!("{msg}\n");
    let r = format!(
        "HTTP/1.1 {code} {reason}\r\n{extra}Content-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(r.as_bytes()).await?;
    s.shutdown().await
}

// ---------- exec ----------

/// An exec session: its target and the protocol version the client chose.
struct ExecParams {
    target: ExecTarget,
    version: u8,
}

impl std::ops::Deref for ExecParams {
    type Target = ExecTarget;
    fn deref(&self) -> &ExecTarget {
        &self.target
    }
}

#[derive(Default)]
struct ExecStreams {
    error: Option<Incoming>,
    stdin: Option<Incoming>,
    stdout: Option<Incoming>,
    stderr: Option<Incoming>,
    resize: Option<Incoming>,
}

impl ExecStreams {
    fn complete(&self, p: &ExecParams) -> bool {
        self.error.is_some()
            && (!p.stdin || self.stdin.is_some())
            && (!p.stdout || self.stdout.is_some())
            && (!p.stderr || p.tty || self.stderr.is_some())
            && (!(p.tty && p.version >= 3) || self.resize.is_some())
    }
}

/// The exit status as the error stream carries it: v4 a JSON `metav1.Status`, older
/// versions a message on failure only.
fn status_message(version: u8, exit: Result<i32, String>) -> Option<String> {
    if version >= 4 {
        let v = match exit {
            Ok(0) => serde_json::json!({"metadata": {}, "status": "Success"}),
            Ok(code) => serde_json::json!({
                "metadata": {},
                "status": "Failure",
                "message": format!("command terminated with non-zero exit code: error executing command, exit code {code}"),
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
            }),
            Err(msg) => serde_json::json!({
                "metadata": {},
                "status": "Failure",
                "message": msg,
                "reason": "InternalError",
                "details": {"causes": [{"message": msg}]},
            }),
        };
        Some(v.to_string())
    } else {
        match exit {
            Ok(0) => None,
            Ok(code) => Some(format!(
                "command terminated with non-zero exit code: error executing command, exit code {code}"
            )),
            Err(msg) => Some(msg),
        }
    }
}

#[derive(serde::Deserialize)]
struct TermSize {
    #[serde(rename = "Width")]
    width: u16,
    #[serde(rename = "Height")]
    height: u16,
}

/// Parses the JSON sizes in `buf`, leaving an incomplete tail in place.
fn take_sizes(buf: &mut Vec<u8>) -> Vec<TermSize> {
    let mut out = Vec::new();
    let mut it = serde_json::Deserializer::from_slice(buf).into_iter::<TermSize>();
    let mut used = 0;
    loop {
        match it.next() {
            Some(Ok(s)) => {
                used = it.byte_offset();
                out.push(s);
            }
            Some(Err(e)) if e.is_eof() => break,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "streaming: bad resize message; dropped");
                used = buf.len();
                break;
            }
            None => {
                used = it.byte_offset();
                break;
            }
        }
    }
    buf.drain(..used.min(buf.len()));
    out
}

async fn exec(
    rt: &Arc<Runtime>,
    p: ExecParams,
    w: &Writer,
    mut incoming: mpsc::UnboundedReceiver<Incoming>,
) {
    let mut s = ExecStreams::default();
    let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
    while !s.complete(&p) {
        let st = match tokio::time::timeout_at(deadline, incoming.recv()).await {
            Ok(Some(st)) => st,
            Ok(None) => {
                tracing::info!(container = %p.container_id, "streaming exec: client left before opening its streams");
                return;
            }
            Err(_) => break,
        };
        let kind = spdy::header(&st.headers, "streamtype").unwrap_or_default();
        tracing::debug!(stream = st.id, kind, "streaming exec: client stream");
        let slot = match kind {
            "error" => &mut s.error,
            "stdin" => &mut s.stdin,
            "stdout" => &mut s.stdout,
            "stderr" => &mut s.stderr,
            "resize" => &mut s.resize,
            other => {
                tracing::debug!(
                    streamtype = other,
                    "streaming exec: unexpected stream; reset"
                );
                w.reset(st.id, spdy::RST_REFUSED_STREAM).await;
                continue;
            }
        };
        *slot = Some(st);
    }
    let complete = s.complete(&p);
    let Some(error) = s.error.take() else {
        tracing::info!(container = %p.container_id, "streaming exec: no error stream in time; closing");
        return;
    };
    let finish = |exit: Result<i32, String>, s: &ExecStreams| {
        let out: Vec<u32> = [&s.stdout, &s.stderr]
            .into_iter()
            .flatten()
            .map(|st| st.id)
            .collect();
        let error = error.id;
        async move {
            for id in out {
                w.fin(id).await;
            }
            if let Some(m) = status_message(p.version, exit) {
                w.data(error, m.as_bytes()).await;
            }
            w.fin(error).await;
        }
    };
    if !complete {
        tracing::info!(container = %p.container_id, stdin = s.stdin.is_some(), stdout = s.stdout.is_some(), stderr = s.stderr.is_some(), resize = s.resize.is_some(), want_stdin = p.stdin, want_stdout = p.stdout, want_stderr = p.stderr, tty = p.tty, "streaming exec: the client did not open its streams in time");
        finish(Err("timed out waiting for the client's streams".into()), &s).await;
        return;
    }
    tracing::info!(container = %p.container_id, cmd = ?p.cmd, tty = p.tty, "streaming exec: start (no cmd: attach)");
    // The client sends the terminal's size first: start the process with it when it is here.
    let mut size_buf = Vec::new();
    let mut size = None;
    if let Some(r) = s.resize.as_mut() {
        while let Some(d) = r.rx.try_recv() {
            size_buf.extend_from_slice(&d);
        }
        size = take_sizes(&mut size_buf).pop().map(|sz| WindowSize {
            rows: sz.height.into(),
            cols: sz.width.into(),
        });
    }
    let started = match &p.cmd {
        Some(cmd) => {
            rt.exec_stream(&p.container_id, cmd.clone(), p.tty, p.stdin, size)
                .await
        }
        None => {
            let attached = rt.attach_stream(&p.container_id, p.stdin).await;
            // The terminal already runs: the client's first size is a resize.
            if let (Ok((tx, _)), Some(sz)) = (&attached, size) {
                let _ = tx
                    .send(ExecInput {
                        msg: Some(exec_input::Msg::Resize(sz)),
                    })
                    .await;
            }
            attached
        }
    };
    let (tx, mut out) = match started {
        Ok(c) => c,
        Err(e) => {
            tracing::info!(container = %p.container_id, error = %e, "streaming exec: cannot start");
            finish(Err(e.to_string()), &s).await;
            return;
        }
    };
    let mut tasks = Vec::new();
    if let Some(mut st) = s.stdin.take() {
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(d) = st.rx.recv().await {
                let m = ExecInput {
                    msg: Some(exec_input::Msg::Stdin(d)),
                };
                if tx.send(m).await.is_err() {
                    return;
                }
            }
            let _ = tx
                .send(ExecInput {
                    msg: Some(exec_input::Msg::CloseStdin(true)),
                })
                .await;
        }));
    }
    if let Some(mut st) = s.resize.take() {
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            let mut buf = size_buf;
            while let Some(d) = st.rx.recv().await {
                buf.extend_from_slice(&d);
                if buf.len() > 64 << 10 {
                    buf.clear();
                }
                for sz in take_sizes(&mut buf) {
                    let m = ExecInput {
                        msg: Some(exec_input::Msg::Resize(WindowSize {
                            rows: sz.height.into(),
                            cols: sz.width.into(),
                        })),
                    };
                    if tx.send(m).await.is_err() {
                        return;
                    }
                }
            }
        }));
    }
    // Our own sender would keep the agent's input open; the tasks hold theirs.
    drop(tx);
    let stdout = s.stdout.as_ref().map(|x| x.id);
    // With a tty, stderr is the terminal too.
    let stderr = s.stderr.as_ref().map(|x| x.id).or(stdout.filter(|_| p.tty));
    let exit = loop {
        tokio::select! {
            m = out.message() => match m {
                Ok(Some(m)) => match m.msg {
                    Some(exec_output::Msg::Stdout(b)) => {
                        if let Some(id) = stdout {
                            w.data(id, &b).await;
                        }
                    }
                    Some(exec_output::Msg::Stderr(b)) => {
                        if let Some(id) = stderr {
                            w.data(id, &b).await;
                        }
                    }
                    // An attach session ends with its container; it succeeded whatever
                    // the container's exit code (that is ContainerStatus's to report).
                    Some(exec_output::Msg::ExitCode(c)) => break Ok(if p.cmd.is_some() { c } else { 0 }),
                    None => {}
                },
                Ok(None) => break Err("the pod agent ended the exec without an exit code".to_string()),
                Err(st) => break Err(format!("pod agent: {}", st.message())),
            },
            Some(extra) = incoming.recv() => {
                tracing::debug!(stream = extra.id, "streaming exec: stream opened after the start; reset");
                w.reset(extra.id, spdy::RST_REFUSED_STREAM).await;
            }
            _ = w.closed() => {
                tracing::info!(container = %p.container_id, "streaming exec: client went away; stopping the command");
                for t in &tasks {
                    t.abort();
                }
                return;
            }
        }
    };
    for t in &tasks {
        t.abort();
    }
    tracing::info!(container = %p.container_id, exit = ?exit, "streaming exec: done");
    finish(exit, &s).await;
}

// ---------- port forward ----------

/// Connects to 127.0.0.1:`port` inside the network namespace `netns` (empty: the host's):
/// the socket keeps the namespace it was created in.
async fn connect_in_netns(netns: PathBuf, port: u16) -> std::io::Result<TcpStream> {
    let s = crate::sandbox::netns::run_in_netns(&netns, move || {
        // IPv4's localhost, then IPv6's (a server on ::1 only), as containerd tries both.
        let v4 = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let v6 = std::net::SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port));
        let limit = Duration::from_secs(5);
        let s = match std::net::TcpStream::connect_timeout(&v4, limit) {
            Ok(s) => s,
            Err(e4) => std::net::TcpStream::connect_timeout(&v6, limit).map_err(|e6| {
                std::io::Error::new(e4.kind(), format!("{e4}; [::1]:{port}: {e6}"))
            })?,
        };
        s.set_nonblocking(true)?;
        Ok(s)
    })
    .await?;
    TcpStream::from_std(s)
}

/// A connected port-forward stream, TCP or vsock.
trait Duplex: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Duplex for T {}

/// Connects to the pod's localhost:`port`: in its network namespace on the host, or through
/// the guest agent of a VM pod.
async fn connect_forward(target: ForwardTarget, port: u16) -> std::io::Result<Box<dyn Duplex>> {
    match target {
        ForwardTarget::Netns(netns) => Ok(Box::new(connect_in_netns(netns, port).await?)),
        ForwardTarget::Vsock { uds, port: vport } => {
            let s = vessel_agent::client::hybrid_vsock_stream(&uds, vport, Duration::from_secs(5))
                .await
                .map_err(std::io::Error::other)?;
            let s = vessel_agent::forward::open(s, port)
                .await
                .map_err(std::io::Error::other)?;
            Ok(Box::new(s))
        }
    }
}

/// Forwards whose error or data stream is open but not the other, per connection; more
/// are refused (client-go opens both at once).
const PENDING_PAIRS: usize = 128;

#[derive(Default)]
struct Pair {
    port: u16,
    error: Option<Incoming>,
    data: Option<Incoming>,
}

async fn port_forward(
    pod_id: &str,
    target: ForwardTarget,
    w: &Writer,
    mut incoming: mpsc::UnboundedReceiver<Incoming>,
) {
    let mut pairs: HashMap<String, Pair> = HashMap::new();
    let mut tasks = Vec::new();
    while let Some(st) = incoming.recv().await {
        let kind = spdy::header(&st.headers, "streamtype")
            .unwrap_or_default()
            .to_string();
        let port = spdy::header(&st.headers, "port").and_then(|p| p.parse::<u16>().ok());
        let Some(port) = port.filter(|p| *p != 0) else {
            tracing::info!(
                pod = pod_id,
                "port-forward: stream without a valid port; reset"
            );
            w.reset(st.id, spdy::RST_PROTOCOL_ERROR).await;
            continue;
        };
        let rid = spdy::header(&st.headers, "requestid")
            .map(str::to_string)
            .unwrap_or_else(|| format!("port-{port}"));
        if kind != "error" && kind != "data" {
            w.reset(st.id, spdy::RST_PROTOCOL_ERROR).await;
            continue;
        }
        if !pairs.contains_key(&rid) && pairs.len() >= PENDING_PAIRS {
            tracing::info!(
                pod = pod_id,
                "port-forward: too many half-opened forwards on one connection; reset"
            );
            w.reset(st.id, spdy::RST_REFUSED_STREAM).await;
            continue;
        }
        let e = pairs.entry(rid.clone()).or_default();
        e.port = port;
        if kind == "error" {
            e.error = Some(st);
        } else {
            e.data = Some(st);
        }
        if e.error.is_some() && e.data.is_some() {
            if let Some(Pair {
                port,
                error: Some(error),
                data: Some(data),
            }) = pairs.remove(&rid)
            {
                let w = w.clone();
                let target = target.clone();
                let pod = pod_id.to_string();
                // A long session (one kubectl port-forward) carries many connections: the
                // finished ones' tasks are let go as new ones come.
                tasks.retain(|t: &tokio::task::JoinHandle<()>| !t.is_finished());
                tasks.push(tokio::spawn(async move {
                    forward_one(&pod, target, port, (error, data), &w).await;
                }));
            }
        }
    }
    for t in tasks {
        t.abort();
    }
}

/// Port-forward over a WebSocket channel protocol: every port's streams (data, then error)
/// are there at once; the session ends when every forward has, as kubelet's does.
async fn forward_all(
    pod_id: &str,
    target: ForwardTarget,
    ports: &[u16],
    w: &Writer,
    mut incoming: mpsc::UnboundedReceiver<Incoming>,
) {
    let mut forwards = Vec::new();
    for port in ports {
        let (Some(data), Some(error)) = (incoming.recv().await, incoming.recv().await) else {
            break;
        };
        forwards.push(forward_one(pod_id, target.clone(), *port, (error, data), w));
    }
    // Also over once the connection is (the client left, or it was idle too long), though
    // a pod's server that stays open and silent would hold its forward.
    tokio::select! {
        _ = futures::future::join_all(forwards) => {}
        () = w.closed() => {}
    }
}

/// Relays one forwarded connection: once the pod's side has ended, the client's may go on
/// for [`FORWARD_LINGER`]; once the client's has, the pod's until it ends.
async fn forward_one(
    pod: &str,
    target: ForwardTarget,
    port: u16,
    (error, mut data): (Incoming, Incoming),
    w: &Writer,
) {
    let sock = match connect_forward(target, port).await {
        Ok(s) => s,
        Err(e) => {
            let msg = format!("vessel: pod {pod}: connecting to localhost:{port}: {e}");
            tracing::info!(pod, port, error = %e, "port-forward: connect failed");
            w.data(error.id, msg.as_bytes()).await;
            w.fin(error.id).await;
            w.fin(data.id).await;
            return;
        }
    };
    tracing::debug!(pod, port, "port-forward: connected");
    let (mut rd, mut wr) = tokio::io::split(sock);
    let up = async {
        while let Some(d) = data.rx.recv().await {
            if wr.write_all(&d).await.is_err() {
                break;
            }
        }
        let _ = wr.shutdown().await;
    };
    let down = async {
        let mut buf = vec![0u8; 32 << 10];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if !w.data(data.id, &buf[..n]).await {
                        break;
                    }
                }
            }
        }
        w.fin(data.id).await;
    };
    tokio::pin!(up, down);
    tokio::select! {
        () = &mut up => down.await,
        () = &mut down => {
            let _ = tokio::time::timeout(FORWARD_LINGER, up).await;
        }
    }
    w.fin(error.id).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn websocket_forward_ports_come_from_the_query_or_the_request() {
        let named = [7000];
        assert_eq!(
            forward_ports("/portforward/t?port=80", &named),
            Ok(vec![80])
        );
        assert_eq!(
            forward_ports("/portforward/t?port=80,443&x=1&port=8080", &named),
            Ok(vec![80, 443, 8080])
        );
        assert_eq!(
            forward_ports("/portforward/t?port=80%2C81", &[]),
            Ok(vec![80, 81])
        );
        assert_eq!(forward_ports("/portforward/t", &named), Ok(vec![7000]));
        assert!(forward_ports("/portforward/t", &[])
            .unwrap_err()
            .contains("required"));
        for bad in ["0", "65536", "x", ""] {
            let e = forward_ports(&format!("/portforward/t?port={bad}"), &named).unwrap_err();
            assert!(e.contains("not a port"), "{bad}: {e}");
        }
        let many = vec!["1"; WS_MAX_PORTS + 1].join(",");
        assert!(forward_ports(&format!("/p/t?port={many}"), &[]).is_err());
    }

    #[test]
    fn tokens_are_single_use_and_random() {
        let t = Tokens::default();
        let r = StreamRequest::PortForward {
            pod_id: "p".into(),
            target: ForwardTarget::Netns(PathBuf::new()),
            ports: Vec::new(),
        };
        let a = t.insert(r.clone());
        let b = t.insert(r.clone());
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert_eq!(t.take(&a), Some(r));
        assert_eq!(t.take(&a), None);
        assert_eq!(t.take("nope"), None);
    }

    #[test]
    fn expired_tokens_are_refused() {
        let t = Tokens::default();
        let a = t.insert(StreamRequest::PortForward {
            pod_id: "p".into(),
            target: ForwardTarget::Netns(PathBuf::new()),
            ports: Vec::new(),
        });
        if let Some(e) = t.map.lock().unwrap().get_mut(&a) {
            e.0 -= TOKEN_TTL + Duration::from_secs(1);
        }
        assert_eq!(t.take(&a), None);
    }

    #[test]
    fn request_heads() {
        let h = parse_head(b"POST /exec/abc HTTP/1.1\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\nX-Stream-Protocol-Version: v3.channel.k8s.io").unwrap();
        assert_eq!(h.path, "/exec/abc");
        assert_eq!(h.get_all("x-stream-protocol-version").len(), 2);
        assert!(parse_head(b"garbage").is_none());
        assert!(parse_head(b"GET / SPDY\r\n").is_none());
        assert!(parse_head(b"GET / HTTP/1.1\r\nno colon").is_none());
        assert!(parse_head(&[0xff, 0xfe]).is_none());
    }

    #[test]
    fn exit_status_messages() {
        let ok = status_message(4, Ok(0)).unwrap();
        assert_eq!(ok, r#"{"metadata":{},"status":"Success"}"#);
        let v: serde_json::Value =
            serde_json::from_str(&status_message(4, Ok(3)).unwrap()).unwrap();
        assert_eq!(v["reason"], "NonZeroExitCode");
        assert_eq!(v["details"]["causes"][0]["reason"], "ExitCode");
        assert_eq!(v["details"]["causes"][0]["message"], "3");
        assert_eq!(status_message(2, Ok(0)), None);
        assert!(status_message(2, Ok(1)).unwrap().contains("exit code 1"));
    }

    #[test]
    fn resize_messages_split_anywhere() {
        let mut b = br#"{"Width":80,"Height":24}{"Width":1"#.to_vec();
        let s = take_sizes(&mut b);
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].width, s[0].height), (80, 24));
        b.extend_from_slice(b"00,\"Height\":40}\n");
        let s = take_sizes(&mut b);
        assert_eq!((s[0].width, s[0].height), (100, 40));
        let mut b = b"nonsense".to_vec();
        assert!(take_sizes(&mut b).is_empty());
        assert!(b.is_empty());
    }
}
