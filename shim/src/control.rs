//! The shim's control socket (docs/vm-pods.md, "Shim"): one JSON request per line, one JSON
//! answer per line, any number per connection, connections served concurrently. `set_log`
//! carries a file descriptor (SCM_RIGHTS) in the same message as its request line, and so may
//! `attach_disk` (the image, opened by vesseld: a jailed shim cannot open it by path).

use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::logs::LogRouter;

/// The longest request line.
pub const MAX_REQUEST: usize = 64 * 1024;

/// What the control socket changes on the VM: its spare disk slots.
pub trait DiskSlots: Send + Sync {
    /// Attaches `file` if given (`path` then only names it), else opens `path`.
    fn attach(
        &self,
        slot: usize,
        path: &Path,
        file: Option<std::fs::File>,
        read_only: bool,
        serial: &str,
    ) -> Result<(), String>;
    fn detach(&self, slot: usize) -> Result<(), String>;
}

/// The spare slots of a VM that has not started yet (or has).
pub struct Slots(pub Vec<vessel_vmm::virtio::block::DiskSlot>);

impl Slots {
    fn get(&self, slot: usize) -> Result<&vessel_vmm::virtio::block::DiskSlot, String> {
        self.0
            .get(slot)
            .ok_or_else(|| format!("no spare disk slot {slot} (the VM has {})", self.0.len()))
    }
}

impl DiskSlots for Slots {
    fn attach(
        &self,
        slot: usize,
        path: &Path,
        file: Option<std::fs::File>,
        read_only: bool,
        serial: &str,
    ) -> Result<(), String> {
        let s = self.get(slot)?;
        match file {
            Some(f) => s.attach_file(f, &path.display().to_string(), read_only, serial),
            None => s.attach(path, read_only, serial),
        }
        .map_err(|e| e.to_string())
    }

    fn detach(&self, slot: usize) -> Result<(), String> {
        self.get(slot)?.detach();
        Ok(())
    }
}

/// A control request (one JSON line; `set_log` carries its fd with it). vesseld sends these
/// typed; the wire form is `{"op": "<snake_case name>", ...fields}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    Ping,
    /// The image comes as a descriptor with the request (vesseld sends one; `path` then
    /// names it in messages), or is opened by `path` where none came.
    AttachDisk {
        slot: usize,
        path: PathBuf,
        /// As for configured disks, read-write unless asked (layers: `true`).
        #[serde(default)]
        read_only: bool,
        #[serde(default)]
        serial: String,
    },
    DetachDisk {
        slot: usize,
    },
    SetLog {
        id: String,
    },
    DropLog {
        id: String,
    },
    /// Answers once the guest has printed `vessel-event: <name>` on its console (already or
    /// within `timeout_ms`, at most [`MAX_WAIT`]), or fails when the guest ended or the time
    /// ran out. vesseld waits for `agent-serving` this way instead of knocking on the
    /// agent's vsock port while the guest boots (each knock interrupts the guest).
    WaitEvent {
        name: String,
        timeout_ms: u64,
    },
}

/// The longest [`Request::WaitEvent`] wait.
pub const MAX_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

/// A control answer: `{"ok": true, ...}` or `{"ok": false, "error": "..."}`, with the
/// fields some requests add (`ping`: the shim's pid; `drop_log`: whether the id was known).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub known: Option<bool>,
    /// `wait_event`: the guest's events so far, each with how long before the answer it
    /// came (vesseld logs where a pod's boot went: kernel, agent start-up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<Vec<GuestEvent>>,
}

/// A `vessel-event:` line the guest printed, `ago_us` microseconds before the answer that
/// carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestEvent {
    pub name: String,
    pub ago_us: u64,
}

impl Reply {
    fn ok() -> Reply {
        Reply {
            ok: true,
            ..Default::default()
        }
    }
}

/// What the control socket acts on.
pub struct Server {
    pub disks: Arc<dyn DiskSlots>,
    pub logs: Arc<LogRouter>,
    /// The VM's run state, for [`Request::WaitEvent`] (none: it is refused).
    pub run: Option<Arc<vessel_vmm::vm::Control>>,
}

fn err(e: impl std::fmt::Display) -> Value {
    reply(Reply {
        error: Some(e.to_string()),
        ..Default::default()
    })
}

fn reply(r: Reply) -> Value {
    serde_json::to_value(r).unwrap_or_else(|_| json!({"ok": false}))
}

impl Server {
    /// Answers one request line; `fd` is the descriptor that came with it, if any.
    pub fn handle(&self, line: &[u8], fd: Option<OwnedFd>) -> Value {
        let req: Request = match serde_json::from_slice(line) {
            Ok(r) => r,
            Err(e) => return err(format!("bad request: {e}")),
        };
        tracing::debug!(?req, "control request");
        match req {
            Request::Ping => reply(Reply {
                pid: Some(crate::host_pid()),
                ..Reply::ok()
            }),
            Request::AttachDisk {
                slot,
                path,
                read_only,
                serial,
            } => match self.disks.attach(
                slot,
                &path,
                fd.map(std::fs::File::from),
                read_only,
                &serial,
            ) {
                Ok(()) => {
                    tracing::info!(slot, path = %path.display(), serial, "disk attached");
                    reply(Reply::ok())
                }
                Err(e) => err(e),
            },
            Request::DetachDisk { slot } => match self.disks.detach(slot) {
                Ok(()) => {
                    tracing::info!(slot, "disk detached");
                    reply(Reply::ok())
                }
                Err(e) => err(e),
            },
            Request::SetLog { id } => match fd {
                Some(fd) if !id.is_empty() => {
                    self.logs.set(&id, fd);
                    reply(Reply::ok())
                }
                Some(_) => err("set_log needs a non-empty id"),
                None => err("set_log needs a file descriptor (SCM_RIGHTS) with the request"),
            },
            Request::DropLog { id } => {
                let known = self.logs.drop_log(&id);
                reply(Reply {
                    known: Some(known),
                    ..Reply::ok()
                })
            }
            Request::WaitEvent { name, timeout_ms } => {
                let Some(run) = &self.run else {
                    return err("wait_event: this shim runs no VM");
                };
                let timeout = std::time::Duration::from_millis(timeout_ms).min(MAX_WAIT);
                match run.wait_event(&name, timeout) {
                    Ok(()) => {
                        let now = std::time::Instant::now();
                        let events = run
                            .events()
                            .into_iter()
                            .map(|(name, at)| GuestEvent {
                                name,
                                ago_us: u64::try_from(
                                    now.saturating_duration_since(at).as_micros(),
                                )
                                .unwrap_or(u64::MAX),
                            })
                            .collect();
                        reply(Reply {
                            events: Some(events),
                            ..Reply::ok()
                        })
                    }
                    Err(e) => err(format!("wait_event {name:?}: {e}")),
                }
            }
        }
    }

    /// Serves one connection until EOF or an I/O error.
    pub fn serve_connection(&self, s: &UnixStream) -> std::io::Result<()> {
        let mut buf: Vec<u8> = Vec::new();
        let mut fds: Vec<OwnedFd> = Vec::new();
        let mut chunk = vec![0u8; 16 * 1024];
        loop {
            let (n, got) = recv_with_fds(s.as_raw_fd(), &mut chunk)?;
            fds.extend(got);
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
            while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=pos).collect();
                let line = &line[..line.len() - 1];
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                // A descriptor is sent with its request line, so it came in before or with
                // that line's bytes: the oldest one unclaimed belongs to this request.
                let fd = if takes_fd(line) && !fds.is_empty() {
                    Some(fds.remove(0))
                } else {
                    None
                };
                let mut answer = serde_json::to_vec(&self.handle(line, fd))?;
                answer.push(b'\n');
                write_all(s, &answer)?;
            }
            if buf.is_empty() {
                // Descriptors that came with requests that did not want one.
                fds.clear();
            }
            if buf.len() > MAX_REQUEST {
                let mut answer =
                    serde_json::to_vec(&err(format!("request longer than {MAX_REQUEST} bytes")))?;
                answer.push(b'\n');
                write_all(s, &answer)?;
                return Ok(());
            }
        }
    }

    /// Accepts connections on a thread, one thread per connection.
    pub fn serve(self: Arc<Self>, listener: UnixListener) -> std::io::Result<()> {
        std::thread::Builder::new()
            .name("control-accept".into())
            .spawn(move || {
                for s in listener.incoming() {
                    match s {
                        Ok(s) => {
                            let me = self.clone();
                            let spawned = std::thread::Builder::new()
                                .name("control-conn".into())
                                .spawn(move || {
                                    if let Err(e) = me.serve_connection(&s) {
                                        tracing::debug!("control connection: {e}");
                                    }
                                });
                            if let Err(e) = spawned {
                                tracing::warn!("control connection thread: {e}");
                            }
                        }
                        Err(e) => {
                            tracing::warn!("control accept: {e}");
                            std::thread::sleep(std::time::Duration::from_millis(10));
                        }
                    }
                }
            })?;
        Ok(())
    }
}

/// Whether a request line takes a descriptor sent with it.
fn takes_fd(line: &[u8]) -> bool {
    serde_json::from_slice::<Value>(line).ok().is_some_and(|v| {
        matches!(
            v.get("op").and_then(Value::as_str),
            Some("set_log" | "attach_disk")
        )
    })
}

fn write_all(s: &UnixStream, mut data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut w = s;
    while !data.is_empty() {
        let n = w.write(data)?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        data = &data[n..];
    }
    Ok(())
}

/// recvmsg: bytes into `buf` and the descriptors that came with them (close-on-exec).
fn recv_with_fds(sock: RawFd, buf: &mut [u8]) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let mut cmsg = nix::cmsg_space!([RawFd; 8]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = loop {
        match recvmsg::<()>(sock, &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC) {
            Err(nix::errno::Errno::EINTR) => continue,
            r => break r.map_err(std::io::Error::from)?,
        }
    };
    let mut fds = Vec::new();
    for c in msg.cmsgs().map_err(std::io::Error::from)? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for fd in raw {
                // SAFETY: the kernel just installed this descriptor in our table for us
                // (SCM_RIGHTS); nothing else owns it.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        tracing::warn!("control: descriptors were truncated");
    }
    Ok((msg.bytes, fds))
}

/// Errors of the control client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connecting to {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("control socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("control socket: bad answer {0:?}")]
    BadAnswer(String),
}

/// How long a client waits for the shim to take a request or answer it.
pub const CLIENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// A control socket connection (the client side: vesseld, `vessel-shim ctl`, tests).
pub struct Client {
    s: UnixStream,
    pending: Vec<u8>,
}

impl Client {
    pub fn connect(path: &Path) -> Result<Client, ClientError> {
        let s = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            path: path.display().to_string(),
            source,
        })?;
        // A wedged shim must not hang its caller (vesseld's CRI calls) forever.
        s.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        s.set_write_timeout(Some(CLIENT_TIMEOUT))?;
        Ok(Client {
            s,
            pending: Vec::new(),
        })
    }

    /// Replaces [`CLIENT_TIMEOUT`] for this connection's reads and writes (a
    /// [`Request::WaitEvent`] waits longer).
    pub fn set_timeout(&self, t: std::time::Duration) -> std::io::Result<()> {
        self.s.set_read_timeout(Some(t))?;
        self.s.set_write_timeout(Some(t))
    }

    /// Sends one request (with `fd` in the same message) and returns the answer.
    pub fn request(
        &mut self,
        req: &Value,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<Value, ClientError> {
        let mut line = serde_json::to_vec(req).map_err(std::io::Error::from)?;
        line.push(b'\n');
        self.send_line(&line, fd)?;
        self.read_answer()
    }

    /// Sends a typed request (with `fd` in the same message) and returns the typed answer;
    /// an answer with `ok: false` is returned as it is, for the caller to report.
    pub fn call(
        &mut self,
        req: &Request,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<Reply, ClientError> {
        let v = self.request(
            &serde_json::to_value(req).map_err(std::io::Error::from)?,
            fd,
        )?;
        serde_json::from_value(v.clone()).map_err(|_| ClientError::BadAnswer(v.to_string()))
    }

    /// Sends raw bytes (a request line, or anything, for tests) with an optional fd.
    pub fn send_line(
        &mut self,
        line: &[u8],
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<(), ClientError> {
        let raw = fd.map(|f| [f.as_raw_fd()]);
        let cmsgs: Vec<ControlMessage<'_>> = raw
            .as_ref()
            .map(|r| ControlMessage::ScmRights(r))
            .into_iter()
            .collect();
        let iov = [std::io::IoSlice::new(line)];
        let n = loop {
            match sendmsg::<()>(self.s.as_raw_fd(), &iov, &cmsgs, MsgFlags::empty(), None) {
                Err(nix::errno::Errno::EINTR) => continue,
                r => break r.map_err(std::io::Error::from)?,
            }
        };
        // The descriptor went with the first byte; the rest (if any) is plain data.
        write_all(&self.s, &line[n..])?;
        Ok(())
    }

    /// Reads one answer line.
    pub fn read_answer(&mut self) -> Result<Value, ClientError> {
        use std::io::Read;
        let mut b = [0u8; 4096];
        loop {
            if let Some(pos) = self.pending.iter().position(|c| *c == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=pos).collect();
                return serde_json::from_slice(&line)
                    .map_err(|_| ClientError::BadAnswer(String::from_utf8_lossy(&line).into()));
            }
            let n = (&self.s).read(&mut b)?;
            if n == 0 {
                return Err(ClientError::BadAnswer(
                    String::from_utf8_lossy(&self.pending).into(),
                ));
            }
            self.pending.extend_from_slice(&b[..n]);
        }
    }
}
