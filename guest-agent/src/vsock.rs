//! AF_VSOCK sockets for VM mode: the agent's listener (port 1024, any CID) and outgoing
//! connections to the host (CID 2) for container logs. Plain libc sockets driven by tokio's
//! `AsyncFd`, so no extra crate is needed.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::stdio::AsyncFdIo;

/// The port the agent serves its API on.
pub const AGENT_PORT: u32 = 1024;
/// The host port container logs go to (the shim serves it; vesseld tells the agent).
pub const LOG_PORT: u32 = 1025;
/// The guest port vesseld opens port-forward streams on ([`crate::forward`]).
pub const FORWARD_PORT: u32 = 1026;
/// The host's CID.
pub const HOST_CID: u32 = libc::VMADDR_CID_HOST;

// AF_VSOCK (40) fits `sa_family_t`.
#[allow(clippy::cast_possible_truncation)]
fn sockaddr(cid: u32, port: u32) -> libc::sockaddr_vm {
    // SAFETY: sockaddr_vm is plain old data; all-zero is a valid value.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = cid;
    addr.svm_port = port;
    addr
}

fn socket(nonblocking: bool) -> io::Result<OwnedFd> {
    let mut ty = libc::SOCK_STREAM | libc::SOCK_CLOEXEC;
    if nonblocking {
        ty |= libc::SOCK_NONBLOCK;
    }
    // SAFETY: a plain socket(2) call; the returned fd is checked and owned below.
    let fd = unsafe { libc::socket(libc::AF_VSOCK, ty, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A listening AF_VSOCK socket.
#[derive(Debug)]
pub struct VsockListener {
    fd: OwnedFd,
    pub port: u32,
}

impl VsockListener {
    /// Binds `port` on any CID and listens (non-blocking; no runtime needed yet).
    pub fn bind(port: u32) -> io::Result<VsockListener> {
        let fd = socket(true)?;
        let addr = sockaddr(libc::VMADDR_CID_ANY, port);
        // sockaddr_vm is 16 bytes: its size fits `socklen_t`.
        #[allow(clippy::cast_possible_truncation)]
        // SAFETY: `addr` is a valid sockaddr_vm and the length is its size.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &addr as *const libc::sockaddr_vm as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: listen(2) on a socket we own, integer arguments only.
        if unsafe { libc::listen(fd.as_raw_fd(), 128) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(VsockListener { fd, port })
    }

    /// A stream of accepted connections (needs a tokio runtime).
    pub fn incoming(self) -> io::Result<VsockIncoming> {
        // SAFETY: the OwnedFd stays open for as long as the AsyncFd that owns it.
        let fd = unsafe { AsyncFd::register(self.fd) }.map_err(io::Error::from)?;
        Ok(VsockIncoming { fd })
    }
}

/// Accepted vsock connections, as tonic's `serve_with_incoming` wants them.
pub struct VsockIncoming {
    fd: AsyncFd<OwnedFd>,
}

impl futures::Stream for VsockIncoming {
    type Item = io::Result<VsockStream>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            let mut guard = match self.fd.poll_read_ready(cx) {
                Poll::Ready(Ok(g)) => g,
                Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e))),
                Poll::Pending => return Poll::Pending,
            };
            let r = guard.try_io(|inner| {
                // SAFETY: accept4 on our listening fd; we do not ask for the peer address.
                let fd = unsafe {
                    libc::accept4(
                        inner.get_ref().as_raw_fd(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                    )
                };
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: accept4 returned a fresh descriptor that nothing else owns.
                Ok(unsafe { OwnedFd::from_raw_fd(fd) })
            });
            match r {
                Ok(Ok(fd)) => return Poll::Ready(Some(AsyncFdIo::new(fd).map(VsockStream))),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                // A connection that went away before accept must not end the server.
                Ok(Err(e))
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ECONNABORTED) | Some(libc::EPROTO) | Some(libc::ECONNRESET)
                    ) =>
                {
                    tracing::debug!(error = %e, "vsock accept");
                    continue;
                }
                Ok(Err(e)) => return Poll::Ready(Some(Err(e))),
                Err(_would_block) => continue,
            }
        }
    }
}

/// One vsock connection.
pub struct VsockStream(AsyncFdIo);

impl tonic::transport::server::Connected for VsockStream {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for VsockStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for VsockStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, data)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // SAFETY: shutdown(2) on a socket we own.
        unsafe { libc::shutdown(self.0.raw(), libc::SHUT_WR) };
        Poll::Ready(Ok(()))
    }
}

/// Connects (blocking) to `cid:port`, with `timeout` for the writes that follow, so that a
/// host that stops reading cannot wedge the writer forever. Returns the connected socket.
pub fn connect_blocking(cid: u32, port: u32, send_timeout: Duration) -> io::Result<OwnedFd> {
    let fd = socket(false)?;
    let addr = sockaddr(cid, port);
    loop {
        // sockaddr_vm is 16 bytes: its size fits `socklen_t`.
        #[allow(clippy::cast_possible_truncation)]
        // SAFETY: `addr` is a valid sockaddr_vm and the length is its size.
        let r = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                &addr as *const libc::sockaddr_vm as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
            )
        };
        if r == 0 {
            break;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    let tv = libc::timeval {
        tv_sec: send_timeout.as_secs() as libc::time_t,
        tv_usec: send_timeout.subsec_micros() as libc::suseconds_t,
    };
    // A timeval is 16 bytes: its size fits `socklen_t`.
    #[allow(clippy::cast_possible_truncation)]
    // SAFETY: SO_SNDTIMEO reads a timeval of the given size from a live local.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            &tv as *const libc::timeval as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}
