//! Container stdio plumbing: pipes, pty masters received over a console socket, and an
//! async wrapper for raw fds (pty masters are not pipes, so tokio's pipe types do not fit).

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use nix::fcntl::OFlag;
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A pipe with both ends close-on-exec: (read, write).
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(io::Error::from)
}

/// `/dev/null`, opened read-write and close-on-exec.
pub fn dev_null() -> io::Result<OwnedFd> {
    Ok(std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")?
        .into())
}

fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    let flags = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFL)?;
    let flags = OFlag::from_bits_retain(flags) | OFlag::O_NONBLOCK;
    nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_SETFL(flags))?;
    Ok(())
}

/// An fd (a pty master) read and written asynchronously.
pub struct AsyncFdIo {
    fd: AsyncFd<OwnedFd>,
}

impl AsyncFdIo {
    /// Wraps `fd`, switching it to non-blocking mode (shared with any dup of it).
    pub fn new(fd: OwnedFd) -> io::Result<AsyncFdIo> {
        set_nonblocking(&fd)?;
        // SAFETY: an OwnedFd's raw fd is valid, stays open and refers to the same file
        // description until the OwnedFd (owned by the AsyncFd) is dropped.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(io::Error::from)?;
        Ok(AsyncFdIo { fd })
    }

    pub fn raw(&self) -> RawFd {
        self.fd.get_ref().as_raw_fd()
    }
}

impl AsyncRead for AsyncFdIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|inner| {
                nix::unistd::read(inner.get_ref().as_raw_fd(), unfilled).map_err(io::Error::from)
            }) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for AsyncFdIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            match guard
                .try_io(|inner| nix::unistd::write(inner.get_ref(), data).map_err(io::Error::from))
            {
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Sets the window size of the terminal `fd` (a pty master).
pub fn set_winsize(fd: RawFd, rows: u32, cols: u32) -> io::Result<()> {
    // A size beyond what the kernel's `winsize` holds is clamped.
    let ws = libc::winsize {
        ws_row: u16::try_from(rows).unwrap_or(u16::MAX),
        ws_col: u16::try_from(cols).unwrap_or(u16::MAX),
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a `winsize` from the pointer, which points to a live local
    // value of the right type for the duration of the call.
    let r = unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws as *const libc::winsize) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A console socket: libcontainer's container process connects to it and sends the pty
/// master it created (SCM_RIGHTS).
pub struct ConsoleSocket {
    listener: UnixListener,
}

impl ConsoleSocket {
    pub fn bind(path: &Path) -> io::Result<ConsoleSocket> {
        let _ = std::fs::remove_file(path);
        Ok(ConsoleSocket {
            listener: UnixListener::bind(path)?,
        })
    }

    /// Blocks until a pty master arrives (or `timeout` passes), and gives it `size`
    /// (rows, cols) at once. libcontainer ignores `process.consoleSize`, so the process may
    /// start a moment before the size is set; clients resize later anyway.
    pub fn recv_master(self, timeout: Duration, size: Option<(u32, u32)>) -> io::Result<OwnedFd> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        // poll(2) takes an i32 of milliseconds: a longer timeout is clamped.
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        let mut fds = [PollFd::new(self.listener.as_fd(), PollFlags::POLLIN)];
        let n = poll(
            &mut fds,
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
        )?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no pty master arrived on the console socket",
            ));
        }
        let (stream, _) = self.listener.accept()?;
        stream.set_read_timeout(Some(timeout))?;
        let mut name = [0u8; 4096];
        let mut iov = [IoSliceMut::new(&mut name)];
        let mut cmsg = nix::cmsg_space!([RawFd; 4]);
        let msg = recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )?;
        let mut got: Option<OwnedFd> = None;
        for c in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(fds) = c {
                for fd in fds {
                    // SAFETY: SCM_RIGHTS just installed `fd` in our table; nothing else
                    // owns it, so wrapping it (and closing extras on drop) is sound.
                    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                    if got.is_none() {
                        got = Some(owned);
                    }
                }
            }
        }
        let master = got.ok_or_else(|| io::Error::other("console socket message carried no fd"))?;
        if let Some((rows, cols)) = size {
            set_winsize(master.as_raw_fd(), rows, cols)?;
        }
        Ok(master)
    }
}

/// Sends a pty master to a console socket ([`ConsoleSocket::recv_master`]'s end), as
/// libcontainer does for a container it creates: one message naming it, the fd attached.
pub fn send_master(socket: &Path, master: &impl AsFd) -> io::Result<()> {
    let stream = UnixStream::connect(socket)?;
    let fds = [master.as_fd().as_raw_fd()];
    let name = b"/dev/ptmx";
    sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(name)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// What [`send_master`] sends, [`ConsoleSocket::recv_master`] receives: the same open
    /// file (a pipe's end here, to see it is the same).
    #[test]
    fn a_sent_master_arrives_at_the_console_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.sock");
        let sock = ConsoleSocket::bind(&path).unwrap();
        let (r, w) = pipe().unwrap();
        let sender = std::thread::spawn(move || send_master(&path, &w));
        let got = sock.recv_master(Duration::from_secs(10), None).unwrap();
        sender.join().unwrap().unwrap();
        std::fs::File::from(got)
            .write_all(b"over the socket")
            .unwrap();
        let mut text = String::new();
        std::fs::File::from(r).read_to_string(&mut text).unwrap();
        assert_eq!(text, "over the socket");
    }
}
