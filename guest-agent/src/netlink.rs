//! A small rtnetlink client: one request at a time, each acknowledged. The agent uses it to
//! give a VM's interfaces their addresses and routes; the shim to set up tc on the host.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_ACK: u16 = 0x4;
pub const NLM_F_REPLACE: u16 = 0x100;
pub const NLM_F_EXCL: u16 = 0x200;
pub const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 0x2;
const NLA_F_NESTED: u16 = 0x8000;

/// One request being built: `nlmsghdr`, the family's fixed header, then attributes.
#[derive(Debug, Clone)]
pub struct Msg {
    buf: Vec<u8>,
    nests: Vec<usize>,
}

impl Msg {
    /// A request of type `kind` (RTM_*) with `flags` (besides REQUEST and ACK) and the fixed
    /// header `fixed` (e.g. a `struct tcmsg`, `ifaddrmsg` or `rtmsg`).
    pub fn new(kind: u16, flags: u16, fixed: &[u8]) -> Msg {
        let mut buf = Vec::with_capacity(128);
        buf.extend_from_slice(&0u32.to_ne_bytes()); // nlmsg_len, set in finish()
        buf.extend_from_slice(&kind.to_ne_bytes());
        buf.extend_from_slice(&(flags | NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
        buf.extend_from_slice(&1u32.to_ne_bytes()); // seq
        buf.extend_from_slice(&0u32.to_ne_bytes()); // pid: the kernel
        buf.extend_from_slice(fixed);
        let mut m = Msg {
            buf,
            nests: Vec::new(),
        };
        m.pad();
        m
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    /// Appends attribute `kind` with `data`.
    pub fn attr(mut self, kind: u16, data: &[u8]) -> Msg {
        let len = u16::try_from(4 + data.len()).unwrap_or(u16::MAX);
        self.buf.extend_from_slice(&len.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.pad();
        self
    }

    /// Opens a nested attribute; [`Msg::end`] closes it.
    pub fn begin(mut self, kind: u16) -> Msg {
        self.nests.push(self.buf.len());
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf
            .extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
        self
    }

    pub fn end(mut self) -> Msg {
        if let Some(at) = self.nests.pop() {
            let len = u16::try_from(self.buf.len() - at).unwrap_or(u16::MAX);
            self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
        }
        self
    }

    /// The bytes to send.
    pub fn finish(mut self) -> Vec<u8> {
        let len = u32::try_from(self.buf.len()).unwrap_or(u32::MAX);
        self.buf[..4].copy_from_slice(&len.to_ne_bytes());
        self.buf
    }
}

/// A NETLINK_ROUTE socket in the calling thread's network namespace.
pub struct Socket(OwnedFd);

impl Socket {
    pub fn open() -> std::io::Result<Socket> {
        // SAFETY: socket(2) with constant arguments; the fd is owned at once.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let tv = libc::timeval {
            tv_sec: 5,
            tv_usec: 0,
        };
        #[allow(clippy::cast_possible_truncation)] // a timeval is 16 bytes
        let len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
        // SAFETY: SO_RCVTIMEO reads a timeval of the given size.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                std::ptr::addr_of!(tv).cast(),
                len,
            );
        }
        Ok(Socket(fd))
    }

    /// Sends `msg` to the kernel and returns its ack's verdict.
    pub fn request(&self, msg: &[u8]) -> std::io::Result<()> {
        // SAFETY: send(2) reads `msg.len()` bytes of `msg`; an unconnected netlink socket
        // sends to the kernel.
        let n = unsafe { libc::send(self.0.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: recv(2) writes at most `buf.len()` bytes into `buf`.
            let n =
                unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let got = &buf[..usize::try_from(n).unwrap_or(0)];
            if let Some(verdict) = ack_of(got) {
                return verdict;
            }
        }
    }
}

/// The error code of the first `NLMSG_ERROR` in a datagram (0 is an ack), if there is one.
pub fn ack_of(datagram: &[u8]) -> Option<std::io::Result<()>> {
    let mut at = 0;
    while at + 16 <= datagram.len() {
        let len = u32::from_ne_bytes(datagram[at..at + 4].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(datagram[at + 4..at + 6].try_into().ok()?);
        if kind == NLMSG_ERROR && at + 20 <= datagram.len() {
            let code = i32::from_ne_bytes(datagram[at + 16..at + 20].try_into().ok()?);
            return Some(if code == 0 {
                Ok(())
            } else {
                Err(std::io::Error::from_raw_os_error(-code))
            });
        }
        if len < 16 {
            return None;
        }
        at += (len + 3) & !3;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_attributes_carry_their_length() {
        let m = Msg::new(44, NLM_F_CREATE, &[1, 2, 3])
            .attr(1, b"u32\0")
            .begin(2)
            .attr(5, &[9; 6])
            .end()
            .finish();
        assert_eq!(
            u32::from_ne_bytes(m[..4].try_into().unwrap()) as usize,
            m.len()
        );
        let flags = u16::from_ne_bytes(m[6..8].try_into().unwrap());
        assert_eq!(flags, NLM_F_CREATE | NLM_F_REQUEST | NLM_F_ACK);
        // The fixed header is padded to 4: attributes start at 20.
        assert_eq!(&m[24..28], b"u32\0");
        let nest_len = u16::from_ne_bytes(m[28..30].try_into().unwrap());
        assert_eq!(nest_len, 4 + 12);
        assert_eq!(
            u16::from_ne_bytes(m[30..32].try_into().unwrap()),
            2 | NLA_F_NESTED
        );
        assert_eq!(m.len() % 4, 0);
    }

    #[test]
    fn acks_and_errors_are_read_from_the_reply() {
        let mut ok = vec![0u8; 36];
        ok[..4].copy_from_slice(&36u32.to_ne_bytes());
        ok[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        assert!(matches!(ack_of(&ok), Some(Ok(()))));
        ok[16..20].copy_from_slice(&(-libc::EEXIST).to_ne_bytes());
        let e = ack_of(&ok).unwrap().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EEXIST));
        assert!(ack_of(&[0u8; 8]).is_none());
    }
}
