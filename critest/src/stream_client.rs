//! A small client of the CRI streaming protocols over SPDY/3.1, as kubelet and crictl speak
//! them to a runtime's streaming server: exec (`v4.channel.k8s.io`) and port-forward
//! (`portforward.k8s.io`). For tests: it sends all its input up front and collects the output.

pub use vessel_spdy as spdy;

use spdy::{Codec, Frame};
use std::collections::HashMap;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Debug, thiserror::Error)]
pub enum StreamClientError {
    #[error("URL {0:?} is not http://host:port/path")]
    Url(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("upgrade refused: {0}")]
    Refused(String),
    #[error(transparent)]
    Spdy(#[from] spdy::SpdyError),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("stream reset by the server (status {0})")]
    Reset(u32),
}

/// What to run an exec with.
#[derive(Debug, Clone, Default)]
pub struct ExecOptions {
    /// Sent on stdin, then stdin is closed. `None`: no stdin stream.
    pub stdin: Option<Vec<u8>>,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
    /// Sent on the resize stream first (tty only): (width, height).
    pub resize: Option<(u16, u16)>,
    /// How long the client waits, once it has sent its input, before it reads anything: a
    /// slow client, whose output the server must hold back rather than queue.
    pub stall: Duration,
}

/// What an exec produced.
#[derive(Debug, Clone, Default)]
pub struct ExecOutcome {
    pub protocol: String,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// What the error stream carried (v4: a JSON metav1.Status).
    pub error: String,
}

impl ExecOutcome {
    pub fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    /// The exit code from a v4 status: 0 for Success, N for NonZeroExitCode; `None` for
    /// anything else (a failure to run, or no status).
    pub fn exit_code(&self) -> Option<i32> {
        let v: serde_json::Value = serde_json::from_str(&self.error).ok()?;
        match v["status"].as_str()? {
            "Success" => Some(0),
            _ if v["reason"] == "NonZeroExitCode" => v["details"]["causes"]
                .as_array()?
                .iter()
                .find(|c| c["reason"] == "ExitCode")?["message"]
                .as_str()?
                .parse()
                .ok(),
            _ => None,
        }
    }
}

struct Conn {
    sock: TcpStream,
    codec: Codec,
    buf: Vec<u8>,
    protocol: String,
}

impl Conn {
    async fn open(url: &str, protocols: &[&str]) -> Result<Conn, StreamClientError> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| StreamClientError::Url(url.into()))?;
        let (host, path) = rest
            .split_once('/')
            .ok_or_else(|| StreamClientError::Url(url.into()))?;
        let mut sock = TcpStream::connect(host).await?;
        let mut req = format!(
            "POST /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
        );
        for p in protocols {
            req.push_str(&format!("X-Stream-Protocol-Version: {p}\r\n"));
        }
        req.push_str("Content-Length: 0\r\n\r\n");
        sock.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i;
            }
            let n = sock.read(&mut chunk).await?;
            if n == 0 {
                return Err(StreamClientError::Refused(
                    String::from_utf8_lossy(&buf).into_owned(),
                ));
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        let mut rest = buf[end + 4..].to_vec();
        if !head.starts_with("HTTP/1.1 101") {
            // Read the body too, for the message.
            let _ = tokio::time::timeout(Duration::from_secs(2), sock.read_to_end(&mut rest)).await;
            return Err(StreamClientError::Refused(format!(
                "{} {}",
                head.lines().next().unwrap_or_default(),
                String::from_utf8_lossy(&rest).trim()
            )));
        }
        let protocol = head
            .lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("x-stream-protocol-version"))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default();
        Ok(Conn {
            sock,
            codec: Codec::new(),
            buf: rest,
            protocol,
        })
    }

    async fn send(&mut self, frames: &[Frame]) -> Result<(), StreamClientError> {
        let mut out = Vec::new();
        for f in frames {
            self.codec.encode(f, &mut out);
        }
        self.sock.write_all(&out).await?;
        Ok(())
    }

    /// The next frame; `None` at end of connection.
    async fn next(&mut self) -> Result<Option<Frame>, StreamClientError> {
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            if let Some(f) = self.codec.decode(&mut self.buf)? {
                if let Frame::Ping(id) = f {
                    self.send(&[Frame::Ping(id)]).await?;
                    continue;
                }
                return Ok(Some(f));
            }
            let n = self.sock.read(&mut chunk).await?;
            if n == 0 {
                return Ok(None);
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

fn syn(id: u32, headers: &[(&str, String)]) -> Frame {
    Frame::SynStream {
        stream_id: id,
        associated: 0,
        priority: 0,
        flags: 0,
        headers: headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    }
}

fn data(id: u32, d: &[u8], fin: bool) -> Frame {
    Frame::Data {
        stream_id: id,
        flags: if fin { spdy::FLAG_FIN } else { 0 },
        data: d.to_vec(),
    }
}

/// Runs an exec at `url` (from the CRI Exec RPC) with protocol v4 (v3, v2 offered too).
pub async fn exec(
    url: &str,
    o: &ExecOptions,
    timeout: Duration,
) -> Result<ExecOutcome, StreamClientError> {
    tokio::time::timeout(timeout, exec_inner(url, o))
        .await
        .map_err(|_| StreamClientError::Timeout(timeout))?
}

async fn exec_inner(url: &str, o: &ExecOptions) -> Result<ExecOutcome, StreamClientError> {
    let mut c = Conn::open(
        url,
        &[
            "v4.channel.k8s.io",
            "v3.channel.k8s.io",
            "v2.channel.k8s.io",
        ],
    )
    .await?;
    const ERROR: u32 = 1;
    const STDIN: u32 = 3;
    const STDOUT: u32 = 5;
    const STDERR: u32 = 7;
    const RESIZE: u32 = 9;
    let st = |t: &str| [("streamtype", t.to_string())];
    // The error stream first, as client-go does; we never write to it.
    let mut frames = vec![syn(ERROR, &st("error")), data(ERROR, &[], true)];
    let mut open = vec![ERROR];
    if o.stdin.is_some() {
        frames.push(syn(STDIN, &st("stdin")));
    }
    if o.stdout {
        frames.push(syn(STDOUT, &st("stdout")));
        open.push(STDOUT);
    }
    if o.stderr && !o.tty {
        frames.push(syn(STDERR, &st("stderr")));
        open.push(STDERR);
    }
    if o.tty {
        frames.push(syn(RESIZE, &st("resize")));
        if let Some((w, h)) = o.resize {
            let j = format!("{{\"Width\":{w},\"Height\":{h}}}\n");
            frames.push(data(RESIZE, j.as_bytes(), false));
        }
    }
    if let Some(input) = &o.stdin {
        // In 32 KiB frames, as kubectl's SPDY streams write them.
        for chunk in input.chunks(32 << 10) {
            frames.push(data(STDIN, chunk, false));
        }
        frames.push(data(STDIN, &[], true));
    }
    c.send(&frames).await?;
    tokio::time::sleep(o.stall).await;
    let mut out = ExecOutcome {
        protocol: c.protocol.clone(),
        ..Default::default()
    };
    let mut error = Vec::new();
    while !open.is_empty() {
        match c.next().await? {
            None => break,
            Some(Frame::Data {
                stream_id,
                flags,
                data,
            }) => {
                match stream_id {
                    ERROR => error.extend_from_slice(&data),
                    STDOUT => out.stdout.extend_from_slice(&data),
                    STDERR => out.stderr.extend_from_slice(&data),
                    _ => {}
                }
                if flags & spdy::FLAG_FIN != 0 {
                    open.retain(|s| *s != stream_id);
                }
            }
            Some(Frame::RstStream { stream_id, status }) if open.contains(&stream_id) => {
                return Err(StreamClientError::Reset(status));
            }
            Some(Frame::GoAway { .. }) => break,
            Some(_) => {}
        }
    }
    out.error = String::from_utf8_lossy(&error).into_owned();
    Ok(out)
}

/// Port-forwards one connection to `port` through `url` (from the CRI PortForward RPC):
/// sends `input`, half-closes, and returns what came back until the server closed the data
/// stream, with what the error stream said.
pub async fn port_forward(
    url: &str,
    port: u16,
    input: &[u8],
    timeout: Duration,
) -> Result<(Vec<u8>, String), StreamClientError> {
    port_forward_with(url, port, input, true, timeout).await
}

/// [`port_forward`], half-closing after `input` or not: without, the data stream stays
/// open on the client's side, as kubectl's does until its local connection ends, and the
/// forward ends when the server ends it (an HTTP/1.0 server closing after its answer).
pub async fn port_forward_with(
    url: &str,
    port: u16,
    input: &[u8],
    half_close: bool,
    timeout: Duration,
) -> Result<(Vec<u8>, String), StreamClientError> {
    tokio::time::timeout(timeout, async {
        let mut c = Conn::open(url, &["portforward.k8s.io"]).await?;
        let h = |t: &str| {
            [
                ("streamtype", t.to_string()),
                ("port", port.to_string()),
                ("requestid", "0".to_string()),
            ]
        };
        let mut frames = vec![syn(1, &h("error")), data(1, &[], true), syn(3, &h("data"))];
        // In 32 KiB frames, as kubectl's SPDY streams write them.
        for chunk in input.chunks(32 << 10) {
            frames.push(data(3, chunk, false));
        }
        if half_close {
            frames.push(data(3, &[], true));
        }
        c.send(&frames).await?;
        let mut got: HashMap<u32, Vec<u8>> = HashMap::new();
        let mut open = vec![1u32, 3];
        while !open.is_empty() {
            match c.next().await? {
                None => break,
                Some(Frame::Data {
                    stream_id,
                    flags,
                    data,
                }) => {
                    got.entry(stream_id).or_default().extend_from_slice(&data);
                    if flags & spdy::FLAG_FIN != 0 {
                        open.retain(|s| *s != stream_id);
                    }
                }
                Some(Frame::RstStream { status, .. }) => {
                    return Err(StreamClientError::Reset(status))
                }
                Some(_) => {}
            }
        }
        let err = String::from_utf8_lossy(&got.remove(&1).unwrap_or_default()).into_owned();
        Ok((got.remove(&3).unwrap_or_default(), err))
    })
    .await
    .map_err(|_| StreamClientError::Timeout(timeout))?
}
