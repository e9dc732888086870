//! virtio-vsock with a "hybrid" host side, as Firecracker and Cloud Hypervisor do it: the guest's
//! host peer (CID 2) is a set of Unix sockets.
//!
//! * Host-initiated: a host process connects to the device's Unix socket `<uds>` and writes
//!   `CONNECT <port>\n`; the device asks the guest to connect to `<port>`, and when the guest
//!   accepts it answers `OK <local port>\n` and the stream carries the connection. When the
//!   guest refuses (nobody listens), the host stream is closed without an `OK` line.
//! * Guest-initiated: a guest connection to CID 2 port `P` is connected to the Unix socket
//!   `<uds>_P`; if nothing listens there the guest gets a reset (ECONNRESET/ECONNREFUSED).
//!
//! The device runs a thread that polls the host sockets; the vCPU thread processes the TX
//! queue and refills the RX queue when the driver notifies. Flow control follows the virtio
//! credit scheme: each side advertises its buffer and how much it has consumed.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use virtio_vsock::packet::VsockPacket;
use vm_memory::{Bytes, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

use super::{read_config_bytes, DeviceError, Interrupt, VirtioDevice, Worker};

pub const VIRTIO_ID_VSOCK: u32 = 19;
/// The host's CID.
pub const HOST_CID: u64 = 2;
const QUEUE_SIZE: u16 = 256;
const RXQ: usize = 0;
const TXQ: usize = 1;
const MAX_PKT_DATA: u32 = 64 * 1024;
/// Receive buffer we advertise per connection.
const CONN_BUF: u32 = 256 * 1024;
/// First local port used for host-initiated connections.
const HOST_PORT_BASE: u32 = 1 << 30;
/// Resets waiting for an RX buffer, at most: a guest that posts none while it sends packets
/// that each want one makes no more of them (Firecracker bounds its queue too).
const MAX_CTL: usize = 1024;
/// Connections at most, as Firecracker's muxer has: each holds a host descriptor.
const MAX_CONNS: usize = 1024;
/// How long a host-initiated connection waits for the guest's RESPONSE: one the guest
/// ignores is dropped (its host client sees the stream close without an OK line). Longer
/// than Firecracker's 2 s: a guest in the nested test harness runs ~1000x slower.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;
pub const TYPE_STREAM: u16 = 1;
const SHUTDOWN_RCV: u32 = 1;
const SHUTDOWN_SEND: u32 = 2;

/// Errors creating the device.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error("vsock socket {path}: {source}")]
    Listen {
        path: String,
        source: std::io::Error,
    },
    #[error("vsock guest CID {0} is reserved (use 3 or more)")]
    BadCid(u64),
    #[error("vsock: {0}")]
    Io(#[from] std::io::Error),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Host-initiated, REQUEST sent to the guest, waiting for its RESPONSE.
    Connecting,
    Established,
}

struct Conn {
    stream: UnixStream,
    state: State,
    /// When the connection was made (a host-initiated one's REQUEST).
    since: std::time::Instant,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Bytes sent to the guest.
    tx_cnt: u32,
    /// Bytes from the guest written to the stream.
    fwd_cnt: u32,
    last_fwd_cnt_sent: u32,
    to_stream: Vec<u8>,
    /// The stream may have data to read (cleared on EAGAIN).
    readable: bool,
    /// The stream reached EOF; a SHUTDOWN was sent to the guest.
    host_eof: bool,
    /// The guest will send nothing more: shut the stream's write side once flushed.
    guest_eof: bool,
    /// Both sides are done: close (and reset the guest side) once flushed.
    close_when_flushed: bool,
}

impl Conn {
    fn new(stream: UnixStream, state: State) -> Self {
        Conn {
            stream,
            state,
            since: std::time::Instant::now(),
            peer_buf_alloc: 0,
            peer_fwd_cnt: 0,
            tx_cnt: 0,
            fwd_cnt: 0,
            last_fwd_cnt_sent: 0,
            to_stream: Vec::new(),
            readable: false,
            host_eof: false,
            guest_eof: false,
            close_when_flushed: false,
        }
    }

    fn peer_credit(&self) -> u32 {
        self.peer_buf_alloc
            .wrapping_sub(self.tx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }

    fn flush_to_stream(&mut self) -> std::io::Result<()> {
        while !self.to_stream.is_empty() {
            match self.stream.write(&self.to_stream) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                // fwd_cnt is a free-running u32 counter (virtio-vsock): adding n modulo 2^32
                // is the intent.
                #[allow(clippy::cast_possible_truncation)]
                Ok(n) => {
                    self.to_stream.drain(..n);
                    self.fwd_cnt = self.fwd_cnt.wrapping_add(n as u32);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// A control packet waiting for an RX buffer: (op, local port, peer port, flags).
type Ctl = (u16, u32, u32, u32);

/// Key of a connection: (local = host-side port, peer = guest port).
type Key = (u32, u32);

struct Inner {
    guest_cid: u64,
    uds: PathBuf,
    listener: UnixListener,
    /// Host clients that have not sent their CONNECT line yet.
    pending: Vec<(UnixStream, Vec<u8>)>,
    conns: HashMap<Key, Conn>,
    /// At most [`MAX_CONNS`], and [`CONNECT_TIMEOUT`] (fields, for tests).
    max_conns: usize,
    connect_timeout: std::time::Duration,
    ctl: VecDeque<Ctl>,
    /// Control packets dropped for want of room (logged once per burst).
    ctl_dropped: u64,
    next_port: u32,
    active: Option<(GuestMemoryMmap, Queue, Queue, Arc<Interrupt>)>,
}

/// The vsock device.
pub struct Vsock {
    inner: Arc<Mutex<Inner>>,
    worker: Worker,
    queue_sizes: [u16; 3],
    config: [u8; 8],
}

fn lock(m: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Vsock {
    /// Listens on `uds` (which must not exist) for host connections to guest `guest_cid`.
    pub fn new(guest_cid: u64, uds: &Path) -> Result<Self, VsockError> {
        if guest_cid < 3 || guest_cid > u64::from(u32::MAX) {
            return Err(VsockError::BadCid(guest_cid));
        }
        let listener = UnixListener::bind(uds).map_err(|source| VsockError::Listen {
            path: uds.display().to_string(),
            source,
        })?;
        listener.set_nonblocking(true)?;
        let inner = Arc::new(Mutex::new(Inner {
            guest_cid,
            uds: uds.to_path_buf(),
            listener,
            pending: Vec::new(),
            conns: HashMap::new(),
            max_conns: MAX_CONNS,
            connect_timeout: CONNECT_TIMEOUT,
            ctl: VecDeque::new(),
            ctl_dropped: 0,
            next_port: HOST_PORT_BASE,
            active: None,
        }));
        let worker = {
            let inner = inner.clone();
            Worker::spawn("vsock", move |wake, stop| event_loop(&inner, wake, stop))?
        };
        Ok(Vsock {
            inner,
            worker,
            queue_sizes: [QUEUE_SIZE; 3],
            config: guest_cid.to_le_bytes(),
        })
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        // The worker may still accept on the socket: stop it before removing the path.
        self.worker.stop();
        let uds = lock(&self.inner).uds.clone();
        let _ = std::fs::remove_file(&uds);
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        0
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        mut queues: Vec<Queue>,
        _acked: u64,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), DeviceError> {
        if queues.len() != 3 {
            return Err(DeviceError::BadQueue(queues.len()));
        }
        queues.truncate(2); // the event queue only carries transport resets, never sent
        let tx = queues.pop().ok_or(DeviceError::BadQueue(TXQ))?;
        let rx = queues.pop().ok_or(DeviceError::BadQueue(RXQ))?;
        let mut g = lock(&self.inner);
        g.active = Some((mem, rx, tx, interrupt));
        g.process();
        drop(g);
        self.worker.wake();
        Ok(())
    }

    fn process_queue(&mut self, _index: usize) {
        lock(&self.inner).process();
        self.worker.wake();
    }

    fn reset(&mut self) {
        let mut g = lock(&self.inner);
        g.active = None;
        g.conns.clear();
        g.ctl.clear();
    }
}

impl Inner {
    /// Queues a control packet for the guest. A reset is dropped where [`MAX_CTL`] wait
    /// (the answers to packets that want one, which a guest can send without end); what a
    /// connection needs (its RESPONSE, credit updates: at most one queued each, and
    /// connections are bounded) is always queued.
    fn push_ctl(&mut self, c: Ctl) {
        if c.0 == OP_RST && self.ctl.len() >= MAX_CTL {
            if self.ctl_dropped == 0 {
                tracing::warn!("vsock: the guest takes no control packets; dropping them");
            }
            self.ctl_dropped += 1;
            return;
        }
        self.ctl_dropped = 0;
        self.ctl.push_back(c);
    }

    /// Handles the TX queue, then fills the RX queue with what is waiting.
    fn process(&mut self) {
        let tx_used = self.process_tx();
        let rx_used = self.fill_rx();
        if let Some((mem, rx, tx, irq)) = self.active.as_mut() {
            let n_tx = tx_used && tx.needs_notification(&*mem).unwrap_or(true);
            let n_rx = rx_used && rx.needs_notification(&*mem).unwrap_or(true);
            if n_tx || n_rx {
                irq.signal_used();
            }
        }
    }

    fn process_tx(&mut self) -> bool {
        let Some((mem, _, tx, _)) = self.active.as_mut() else {
            return false;
        };
        let mem = mem.clone();
        let mut used = false;
        let mut pkts = Vec::new();
        while let Some(mut chain) = tx.pop_descriptor_chain(&mem) {
            let head = chain.head_index();
            match VsockPacket::from_tx_virtq_chain(&mem, &mut chain, MAX_PKT_DATA) {
                Ok(p) => {
                    let mut data = vec![0u8; if p.op() == OP_RW { p.len() as usize } else { 0 }];
                    if let Some(s) = p.data_slice() {
                        let n = data.len().min(s.len());
                        let _ = s.read_slice(&mut data[..n], 0);
                        data.truncate(n);
                    }
                    pkts.push(TxPkt {
                        src_cid: p.src_cid(),
                        dst_cid: p.dst_cid(),
                        src_port: p.src_port(),
                        dst_port: p.dst_port(),
                        op: p.op(),
                        type_: p.type_(),
                        flags: p.flags(),
                        buf_alloc: p.buf_alloc(),
                        fwd_cnt: p.fwd_cnt(),
                        data,
                    });
                }
                Err(e) => tracing::warn!("vsock: bad TX packet: {e:?}"),
            }
            let _ = tx.add_used(&mem, head, 0);
            used = true;
        }
        for p in pkts {
            self.handle_tx(p);
        }
        used
    }

    fn handle_tx(&mut self, p: TxPkt) {
        let key = (p.dst_port, p.src_port);
        if p.src_cid != self.guest_cid || p.dst_cid != HOST_CID || p.type_ != TYPE_STREAM {
            if p.op != OP_RST {
                self.push_ctl((OP_RST, p.dst_port, p.src_port, 0));
            }
            return;
        }
        if let Some(c) = self.conns.get_mut(&key) {
            c.peer_buf_alloc = p.buf_alloc;
            c.peer_fwd_cnt = p.fwd_cnt;
        }
        match p.op {
            OP_REQUEST => {
                if self.conns.contains_key(&key) || self.conns.len() >= self.max_conns {
                    self.push_ctl((OP_RST, key.0, key.1, 0));
                    return;
                }
                let path = format!("{}_{}", self.uds.display(), p.dst_port);
                match connect_nonblocking(Path::new(&path)) {
                    Ok(s) => {
                        let mut c = Conn::new(s, State::Established);
                        c.peer_buf_alloc = p.buf_alloc;
                        c.peer_fwd_cnt = p.fwd_cnt;
                        self.conns.insert(key, c);
                        self.push_ctl((OP_RESPONSE, key.0, key.1, 0));
                    }
                    Err(e) => {
                        tracing::debug!("vsock: guest connect to {path}: {e}");
                        self.push_ctl((OP_RST, key.0, key.1, 0));
                    }
                }
            }
            OP_RESPONSE => match self.conns.get_mut(&key) {
                // The OK line is a few bytes; fwd_cnt counts modulo 2^32 anyway.
                #[allow(clippy::cast_possible_truncation)]
                Some(c) if c.state == State::Connecting => {
                    c.state = State::Established;
                    let line = format!("OK {}\n", key.0);
                    c.to_stream.extend_from_slice(line.as_bytes());
                    // The OK line is not guest data: keep fwd_cnt counting guest bytes only.
                    c.fwd_cnt = c.fwd_cnt.wrapping_sub(line.len() as u32);
                    if c.flush_to_stream().is_err() {
                        self.close(key, true);
                    }
                }
                _ => self.push_ctl((OP_RST, key.0, key.1, 0)),
            },
            OP_RW => {
                let Some(c) = self.conns.get_mut(&key) else {
                    self.push_ctl((OP_RST, key.0, key.1, 0));
                    return;
                };
                // Data before the guest accepted a host connection (it would reach the
                // host client ahead of the OK line), or past the credit we gave (what the
                // host has not taken yet is bounded by our buffer, plus the OK line): reset.
                if c.state != State::Established
                    || c.to_stream.len() + p.data.len() > CONN_BUF as usize + 64
                {
                    tracing::warn!(
                        port = key.1,
                        "vsock: the guest sent data it had no right to; resetting"
                    );
                    self.close(key, true);
                    return;
                }
                c.to_stream.extend_from_slice(&p.data);
                if c.flush_to_stream().is_err() {
                    self.close(key, true);
                    return;
                }
                self.credit_update_if_due(key);
            }
            OP_CREDIT_REQUEST => {
                let update = (OP_CREDIT_UPDATE, key.0, key.1, 0);
                if self.conns.contains_key(&key) && !self.ctl.contains(&update) {
                    self.push_ctl(update);
                }
            }
            OP_CREDIT_UPDATE => {}
            OP_SHUTDOWN => {
                if let Some(c) = self.conns.get_mut(&key) {
                    let both = SHUTDOWN_SEND | SHUTDOWN_RCV;
                    if p.flags & SHUTDOWN_SEND != 0 {
                        c.guest_eof = true;
                    }
                    // Both directions done (the guest's flags, or its SEND after our EOF).
                    if p.flags & both == both || (c.host_eof && c.guest_eof) {
                        c.guest_eof = true;
                        c.close_when_flushed = true;
                    }
                }
                self.finish_if_flushed(key);
            }
            OP_RST => {
                if let Some(c) = self.conns.get(&key) {
                    if c.state == State::Connecting {
                        tracing::debug!(port = key.1, "vsock: the guest refused a host connection");
                    }
                }
                self.close(key, false);
            }
            _ => self.push_ctl((OP_RST, key.0, key.1, 0)),
        }
    }

    /// Tells the guest how much it may send again once a quarter of our buffer has been
    /// delivered since it last heard: a guest that used up its credit waits for this (data
    /// packets to it carry the count too, but none may be coming). Checked wherever bytes
    /// reach the host stream.
    fn credit_update_if_due(&mut self, key: Key) {
        let Some(c) = self.conns.get(&key) else {
            return;
        };
        if c.fwd_cnt.wrapping_sub(c.last_fwd_cnt_sent) >= CONN_BUF / 4
            && !self.ctl.contains(&(OP_CREDIT_UPDATE, key.0, key.1, 0))
        {
            self.push_ctl((OP_CREDIT_UPDATE, key.0, key.1, 0));
        }
    }

    /// Acts on a guest shutdown once everything it sent has reached the stream.
    fn finish_if_flushed(&mut self, key: Key) {
        let Some(c) = self.conns.get_mut(&key) else {
            return;
        };
        if !c.to_stream.is_empty() {
            return;
        }
        if c.close_when_flushed {
            self.close(key, true);
        } else if c.guest_eof {
            let _ = c.stream.shutdown(std::net::Shutdown::Write);
        }
    }

    fn close(&mut self, key: Key, send_rst: bool) {
        if let Some(c) = self.conns.remove(&key) {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
        if send_rst {
            self.push_ctl((OP_RST, key.0, key.1, 0));
        }
    }

    /// Fills RX buffers: control packets first, then data from readable streams. A buffer is
    /// taken before a stream is read, so no byte is read without a place to put it.
    fn fill_rx(&mut self) -> bool {
        let Some((mem, _, _, _)) = self.active.as_ref() else {
            return false;
        };
        let mem = mem.clone();
        let mut used = false;
        let mut buf = vec![0u8; MAX_PKT_DATA as usize];
        while let Some(mut chain) = self
            .active
            .as_mut()
            .and_then(|(_, rx, _, _)| rx.pop_descriptor_chain(&mem))
        {
            let head = chain.head_index();
            let mut p = match VsockPacket::from_rx_virtq_chain(&mem, &mut chain, MAX_PKT_DATA) {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!("vsock: bad RX buffer: {e:?}");
                    if let Some((_, rx, _, _)) = self.active.as_mut() {
                        let _ = rx.add_used(&mem, head, 0);
                    }
                    used = true;
                    continue;
                }
            };
            let cap = p.data_slice().map(|s| s.len()).unwrap_or(0).min(buf.len());
            let Some(((op, local, peer, flags), n)) = self.next_rx(&mut buf[..cap]) else {
                if let Some((_, rx, _, _)) = self.active.as_mut() {
                    rx.go_to_previous_position();
                }
                break;
            };
            let fwd_cnt = match self.conns.get_mut(&(local, peer)) {
                Some(c) => {
                    c.last_fwd_cnt_sent = c.fwd_cnt;
                    // tx_cnt is a free-running u32 counter (virtio-vsock): adding n modulo
                    // 2^32 is the intent (and n <= MAX_PKT_DATA anyway).
                    #[allow(clippy::cast_possible_truncation)]
                    if op == OP_RW {
                        c.tx_cnt = c.tx_cnt.wrapping_add(n as u32);
                    }
                    c.fwd_cnt
                }
                None => 0,
            };
            p.set_src_cid(HOST_CID)
                .set_dst_cid(self.guest_cid)
                .set_src_port(local)
                .set_dst_port(peer)
                .set_type(TYPE_STREAM)
                .set_op(op)
                .set_flags(flags)
                .set_buf_alloc(CONN_BUF)
                .set_fwd_cnt(fwd_cnt)
                .set_len(0);
            if op == OP_RW && n > 0 {
                if let Some(s) = p.data_slice() {
                    let _ = s.write_slice(&buf[..n], 0);
                    // n <= buf.len() = MAX_PKT_DATA, a u32.
                    #[allow(clippy::cast_possible_truncation)]
                    p.set_len(n as u32);
                }
            }
            // The header is 44 bytes.
            #[allow(clippy::cast_possible_truncation)]
            let len = p.header_slice().len() as u32 + p.len();
            let Some((_, rx, _, _)) = self.active.as_mut() else {
                break;
            };
            let _ = rx.add_used(&mem, head, len);
            used = true;
        }
        used
    }

    /// The next packet for the guest: a control packet, or up to `buf.len()` bytes (within the
    /// guest's credit) read from a stream into `buf`.
    fn next_rx(&mut self, buf: &mut [u8]) -> Option<(Ctl, usize)> {
        if let Some(c) = self.ctl.pop_front() {
            return Some((c, 0));
        }
        let keys: Vec<Key> = self.conns.keys().copied().collect();
        for key in keys {
            let c = self.conns.get_mut(&key).expect("key from the map");
            if c.state != State::Established || !c.readable || c.host_eof {
                continue;
            }
            let credit = c.peer_credit() as usize;
            if credit == 0 {
                continue;
            }
            let want = credit.min(buf.len());
            match c.stream.read(&mut buf[..want]) {
                Ok(0) => {
                    // The host closed its write side: we will send nothing more, but the
                    // guest may still send to us until it closes too.
                    c.host_eof = true;
                    c.readable = false;
                    return Some(((OP_SHUTDOWN, key.0, key.1, SHUTDOWN_SEND), 0));
                }
                Ok(n) => return Some(((OP_RW, key.0, key.1, 0), n)),
                Err(e) if e.kind() == ErrorKind::WouldBlock => c.readable = false,
                Err(_) => {
                    self.conns.remove(&key);
                    return Some(((OP_RST, key.0, key.1, 0), 0));
                }
            }
        }
        None
    }

    /// A host client sent its first line.
    fn host_connect(&mut self, stream: UnixStream, line: &str) {
        let port = line
            .strip_prefix("CONNECT ")
            .and_then(|p| p.trim().parse::<u32>().ok());
        let Some(port) = port else {
            tracing::debug!("vsock: bad host request {line:?}");
            return;
        };
        if self.conns.len() >= self.max_conns || self.ctl.len() >= MAX_CTL {
            tracing::warn!(port, "vsock: too many connections; refusing a host one");
            return;
        }
        let local = self.next_port;
        self.next_port = self.next_port.wrapping_add(1).max(HOST_PORT_BASE);
        self.conns
            .insert((local, port), Conn::new(stream, State::Connecting));
        self.push_ctl((OP_REQUEST, local, port, 0));
    }

    /// Drops host-initiated connections the guest has not answered within
    /// [`CONNECT_TIMEOUT`], resetting them on the guest's side.
    fn expire_connecting(&mut self) {
        let timeout = self.connect_timeout;
        let stale: Vec<Key> = self
            .conns
            .iter()
            .filter(|(_, c)| c.state == State::Connecting && c.since.elapsed() > timeout)
            .map(|(k, _)| *k)
            .collect();
        for key in stale {
            tracing::debug!(
                port = key.1,
                "vsock: the guest did not answer a host connection"
            );
            self.close(key, true);
        }
    }
}

struct TxPkt {
    src_cid: u64,
    dst_cid: u64,
    src_port: u32,
    dst_port: u32,
    op: u16,
    type_: u16,
    flags: u32,
    buf_alloc: u32,
    fwd_cnt: u32,
    data: Vec<u8>,
}

fn event_loop(inner: &Mutex<Inner>, wake: &EventFd, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        // Build the poll set under the lock.
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut what: Vec<Target> = Vec::new();
        {
            let g = lock(inner);
            let pfd = |fd, events| libc::pollfd {
                fd,
                events,
                revents: 0,
            };
            fds.push(pfd(wake.as_raw_fd(), libc::POLLIN));
            what.push(Target::Wake);
            fds.push(pfd(g.listener.as_raw_fd(), libc::POLLIN));
            what.push(Target::Listener);
            for (i, (s, _)) in g.pending.iter().enumerate() {
                fds.push(pfd(s.as_raw_fd(), libc::POLLIN));
                what.push(Target::Pending(i));
            }
            for (k, c) in g.conns.iter() {
                let mut ev = 0;
                if c.state == State::Established
                    && !c.readable
                    && !c.host_eof
                    && c.peer_credit() > 0
                {
                    ev |= libc::POLLIN;
                }
                if !c.to_stream.is_empty() {
                    ev |= libc::POLLOUT;
                }
                if ev != 0 {
                    fds.push(pfd(c.stream.as_raw_fd(), ev));
                    what.push(Target::Conn(*k));
                }
            }
        }
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd structures that outlives the call.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 1000) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                tracing::warn!("vsock poll: {e}");
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            continue;
        }
        let mut g = lock(inner);
        let mut back_off = false;
        let mut finished_pending = Vec::new();
        for (fd, t) in fds.iter().zip(what.iter()) {
            if fd.revents == 0 {
                continue;
            }
            match t {
                Target::Wake => {
                    let _ = wake.read();
                }
                Target::Listener => loop {
                    match g.listener.accept() {
                        Ok((s, _)) => {
                            if s.set_nonblocking(true).is_ok() {
                                g.pending.push((s, Vec::new()));
                            }
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e) => {
                            // Out of descriptors: the listener stays readable; wait a
                            // little rather than spin on it.
                            tracing::warn!("vsock: accept: {e}");
                            back_off = true;
                            break;
                        }
                    }
                },
                Target::Pending(i) => {
                    let (s, line) = &mut g.pending[*i];
                    let mut b = [0u8; 64];
                    match s.read(&mut b) {
                        Ok(0) => finished_pending.push((*i, None)),
                        Ok(n) => {
                            line.extend_from_slice(&b[..n]);
                            if let Some(pos) = line.iter().position(|c| *c == b'\n') {
                                let text = String::from_utf8_lossy(&line[..pos]).to_string();
                                finished_pending.push((*i, Some(text)));
                            } else if line.len() > 64 {
                                finished_pending.push((*i, None));
                            }
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(_) => finished_pending.push((*i, None)),
                    }
                }
                Target::Conn(k) => {
                    if let Some(c) = g.conns.get_mut(k) {
                        if fd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                            c.readable = true;
                        }
                        if fd.revents & libc::POLLOUT != 0 {
                            if c.flush_to_stream().is_err() {
                                g.close(*k, true);
                            } else {
                                g.credit_update_if_due(*k);
                                g.finish_if_flushed(*k);
                            }
                        }
                    }
                }
            }
        }
        finished_pending.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, line) in finished_pending {
            let (s, _) = g.pending.swap_remove(i);
            if let Some(line) = line {
                g.host_connect(s, &line);
            }
        }
        g.expire_connecting();
        g.process();
        drop(g);
        if back_off {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// Connects to the Unix socket at `path` without waiting: a listener whose backlog is full
/// refuses (EAGAIN) rather than holding up the vCPU thread that asked, with the device
/// locked.
fn connect_nonblocking(path: &Path) -> std::io::Result<UnixStream> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::NONBLOCK | SocketFlags::CLOEXEC,
        None,
    )?;
    rustix::net::connect(&fd, &SocketAddrUnix::new(path)?)?;
    Ok(UnixStream::from(fd))
}

enum Target {
    Wake,
    Listener,
    Pending(usize),
    Conn(Key),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::testing::{Driver, F_READ, F_WRITE};
    use std::time::{Duration, Instant};

    const GUEST: u64 = 3;
    const HDR: u32 = 44;

    #[allow(clippy::too_many_arguments)]
    fn hdr(src_port: u32, dst_port: u32, len: u32, op: u16, flags: u32, fwd_cnt: u32) -> Vec<u8> {
        let mut h = Vec::new();
        h.extend_from_slice(&GUEST.to_le_bytes());
        h.extend_from_slice(&HOST_CID.to_le_bytes());
        h.extend_from_slice(&src_port.to_le_bytes());
        h.extend_from_slice(&dst_port.to_le_bytes());
        h.extend_from_slice(&len.to_le_bytes());
        h.extend_from_slice(&TYPE_STREAM.to_le_bytes());
        h.extend_from_slice(&op.to_le_bytes());
        h.extend_from_slice(&flags.to_le_bytes());
        h.extend_from_slice(&65536u32.to_le_bytes()); // buf_alloc
        h.extend_from_slice(&fwd_cnt.to_le_bytes());
        h
    }

    struct Rx {
        src_port: u32,
        dst_port: u32,
        op: u16,
        flags: u32,
        buf_alloc: u32,
        fwd_cnt: u32,
        data: Vec<u8>,
    }

    struct Guest {
        d: Driver,
        rx_bufs: VecDeque<(u64, u64)>,
        /// Used lengths seen but not consumed yet.
        pending: VecDeque<u32>,
        /// Bytes of host data this guest has consumed (its credit counter).
        fwd_cnt: u32,
    }

    impl Guest {
        fn new(uds: &Path) -> Self {
            Self::with(Vsock::new(GUEST, uds).unwrap())
        }

        fn with(dev: Vsock) -> Self {
            let mut d = Driver::new(Box::new(dev), 0);
            assert_eq!(d.read_reg(0x08), VIRTIO_ID_VSOCK);
            assert_eq!(d.read_config_u64(0), GUEST);
            d.init(&[0, 1, 2]);
            let mut g = Guest {
                d,
                rx_bufs: VecDeque::new(),
                pending: VecDeque::new(),
                fwd_cnt: 0,
            };
            for _ in 0..8 {
                g.post_rx();
            }
            // A queue index.
            #[allow(clippy::cast_possible_truncation)]
            g.d.notify(RXQ as u32);
            g
        }

        fn post_rx(&mut self) {
            let h = self.d.buf(&[0u8; 44]);
            let data = self.d.buf(&[0u8; 4096]);
            self.d.add(RXQ, &[(h, 44, F_WRITE), (data, 4096, F_WRITE)]);
            self.rx_bufs.push_back((h, data));
        }

        /// Waits for the next packet the device put on the RX queue.
        fn recv(&mut self) -> Rx {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let more = self.d.used(RXQ);
                self.pending.extend(more);
                if let Some(len) = self.pending.pop_front() {
                    let len = &len;
                    let (h, data) = self.rx_bufs.pop_front().unwrap();
                    let hb = self.d.read(h, 44);
                    let u32at = |o: usize| u32::from_le_bytes(hb[o..o + 4].try_into().unwrap());
                    assert_eq!(u64::from_le_bytes(hb[0..8].try_into().unwrap()), HOST_CID);
                    assert_eq!(u64::from_le_bytes(hb[8..16].try_into().unwrap()), GUEST);
                    let dlen = u32at(24);
                    assert_eq!(*len, HDR + dlen);
                    let op = u16::from_le_bytes(hb[30..32].try_into().unwrap());
                    self.post_rx();
                    // A queue index.
                    #[allow(clippy::cast_possible_truncation)]
                    self.d.notify(RXQ as u32);
                    return Rx {
                        src_port: u32at(16),
                        dst_port: u32at(20),
                        op,
                        flags: u32at(32),
                        buf_alloc: u32at(36),
                        fwd_cnt: u32at(40),
                        data: self.d.read(data, dlen as usize),
                    };
                }
                assert!(Instant::now() < deadline, "no RX packet");
                std::thread::sleep(Duration::from_millis(2));
            }
        }

        // Test payloads are at most a few KiB.
        #[allow(clippy::cast_possible_truncation)]
        fn send(&mut self, src_port: u32, dst_port: u32, op: u16, flags: u32, data: &[u8]) {
            let h = self.d.buf(&hdr(
                src_port,
                dst_port,
                data.len() as u32,
                op,
                flags,
                self.fwd_cnt,
            ));
            if data.is_empty() {
                self.d.submit(TXQ, &[(h, HDR, F_READ)]);
            } else {
                let b = self.d.buf(data);
                self.d
                    .submit(TXQ, &[(h, HDR, F_READ), (b, data.len() as u32, F_READ)]);
            }
            assert_eq!(self.d.used(TXQ).len(), 1);
        }
    }

    /// A guest that posts no RX buffers while it sends packets that each want an answer
    /// (to a CID that is not the host's) leaves at most MAX_CTL answers queued; before,
    /// the queue grew without bound, by up to 256 entries a notification.
    #[test]
    fn unanswered_control_packets_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let dev = Vsock::new(GUEST, &dir.path().join("v.sock")).unwrap();
        let inner = dev.inner.clone();
        let mut d = Driver::new(Box::new(dev), 0);
        d.init(&[0, 1, 2]);
        let mut h = hdr(1, 2, 0, OP_REQUEST, 0, 0);
        h[8..16].copy_from_slice(&99u64.to_le_bytes()); // dst_cid: not the host
        let h = d.buf(&h);
        for _ in 0..(MAX_CTL + 200) / 8 {
            for _ in 0..8 {
                d.add(TXQ, &[(h, HDR, F_READ)]);
            }
            #[allow(clippy::cast_possible_truncation)]
            d.notify(TXQ as u32);
            d.used(TXQ);
        }
        let n = lock(&inner).ctl.len();
        assert_eq!(n, MAX_CTL, "control packets queued");
    }

    /// The guest's data past the credit the device gave (the host client reads nothing)
    /// resets the connection instead of growing the device's buffer without bound; data on a
    /// host connection the guest has not accepted does too, and never reaches the host
    /// client ahead of its OK line.
    #[test]
    fn data_past_the_credit_or_before_the_response_resets() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let listener = UnixListener::bind(format!("{}_5", uds.display())).unwrap();
        let dev = Vsock::new(GUEST, &uds).unwrap();
        let inner = dev.inner.clone();
        let mut g = Guest::with(dev);
        g.send(700, 5, OP_REQUEST, 0, &[]);
        assert_eq!(g.recv().op, OP_RESPONSE);
        let (_held, _) = listener.accept().unwrap(); // never read
        let chunk = vec![7u8; 4096];
        let mut reset = false;
        for _ in 0..(2 << 20) / chunk.len() {
            g.send(700, 5, OP_RW, 0, &chunk);
            if lock(&inner).conns.is_empty() {
                reset = true;
                break;
            }
        }
        assert!(reset, "2 MiB past a 256 KiB credit were taken");
        // Credit updates may come first.
        let mut ops = Vec::new();
        while ops.len() < 16 && ops.last() != Some(&OP_RST) {
            ops.push(g.recv().op);
        }
        assert_eq!(ops.last(), Some(&OP_RST), "{ops:?}");

        // A host connection: data before the guest's RESPONSE resets it.
        let mut host = UnixStream::connect(&uds).unwrap();
        host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        host.write_all(b"CONNECT 1234\n").unwrap();
        let local = loop {
            let p = g.recv();
            if p.op == OP_REQUEST {
                break p.src_port;
            }
        };
        g.send(1234, local, OP_RW, 0, b"injected");
        assert_eq!(g.recv().op, OP_RST);
        let mut b = Vec::new();
        host.read_to_end(&mut b).unwrap();
        assert!(b.is_empty(), "the host client read {b:?}");
    }

    /// The guest gets a reset, not a connection, past the connection limit; a host
    /// connection the guest never answers goes after the connect timeout (its client sees
    /// the stream close).
    #[test]
    fn connections_are_bounded_and_unanswered_ones_expire() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let listener = UnixListener::bind(format!("{}_7", uds.display())).unwrap();
        let dev = Vsock::new(GUEST, &uds).unwrap();
        let inner = dev.inner.clone();
        {
            let mut i = lock(&inner);
            i.max_conns = 4;
            i.connect_timeout = Duration::from_millis(300);
        }
        let mut g = Guest::with(dev);
        let mut accepted = Vec::new();
        for port in 0..6u32 {
            g.send(800 + port, 7, OP_REQUEST, 0, &[]);
            let p = g.recv();
            let want = if port < 4 { OP_RESPONSE } else { OP_RST };
            assert_eq!((p.dst_port, p.op), (800 + port, want), "connection {port}");
            if port < 4 {
                accepted.push(listener.accept().unwrap());
            }
        }
        assert_eq!(lock(&inner).conns.len(), 4);
        for port in 0..4u32 {
            g.send(800 + port, 7, OP_RST, 0, &[]);
        }
        assert!(lock(&inner).conns.is_empty());

        let mut host = UnixStream::connect(&uds).unwrap();
        host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        host.write_all(b"CONNECT 1234\n").unwrap();
        assert_eq!(g.recv().op, OP_REQUEST);
        let t = Instant::now();
        let mut b = Vec::new();
        host.read_to_end(&mut b).unwrap();
        assert!(
            b.is_empty() && t.elapsed() < Duration::from_secs(4),
            "{b:?}"
        );
        assert_eq!(g.recv().op, OP_RST);
        assert!(lock(&inner).conns.is_empty());
    }

    /// A guest connection to a host listener whose backlog is full is refused at once; it
    /// held up the vCPU thread, with the device locked, until the listener took one.
    #[test]
    fn a_full_backlog_refuses_without_waiting() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let dir = tempfile::tempdir().unwrap();
            let uds = dir.path().join("v.sock");
            // A listener with a backlog of one that accepts nothing.
            use rustix::net::{AddressFamily, SocketAddrUnix, SocketType};
            let _listener =
                rustix::net::socket(AddressFamily::UNIX, SocketType::STREAM, None).unwrap();
            let at = SocketAddrUnix::new(format!("{}_9", uds.display())).unwrap();
            rustix::net::bind(&_listener, &at).unwrap();
            rustix::net::listen(&_listener, 1).unwrap();
            let mut g = Guest::new(&uds);
            let mut refused = false;
            for port in 0..16u32 {
                g.send(2000 + port, 9, OP_REQUEST, 0, &[]);
                if g.recv().op == OP_RST {
                    refused = true;
                    break;
                }
            }
            tx.send(refused).unwrap();
        });
        let refused = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the guest's connections did not hang");
        assert!(refused, "16 connections to a listener that accepts none");
    }

    fn read_line(s: &mut UnixStream) -> String {
        let mut out = Vec::new();
        let mut b = [0u8; 1];
        while s.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
            out.push(b[0]);
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn host_initiated_connection_echoes_both_ways() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let mut g = Guest::new(&uds);
        let mut host = UnixStream::connect(&uds).unwrap();
        host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        host.write_all(b"CONNECT 1234\n").unwrap();
        let req = g.recv();
        assert_eq!((req.op, req.dst_port), (OP_REQUEST, 1234));
        let local = req.src_port;
        g.send(1234, local, OP_RESPONSE, 0, &[]);
        assert_eq!(read_line(&mut host), format!("OK {local}"));

        host.write_all(b"ping").unwrap();
        let rw = g.recv();
        assert_eq!((rw.op, rw.src_port, rw.dst_port), (OP_RW, local, 1234));
        assert_eq!(rw.data, b"ping");

        g.send(1234, local, OP_RW, 0, b"pong");
        let mut b = [0u8; 4];
        host.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"pong");

        // The guest closes: the host sees EOF, the device answers with a reset.
        g.send(1234, local, OP_SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND, &[]);
        assert_eq!(host.read(&mut b).unwrap(), 0);
        assert_eq!(g.recv().op, OP_RST);
    }

    #[test]
    fn host_half_close_lets_the_guest_answer() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let mut g = Guest::new(&uds);
        let mut host = UnixStream::connect(&uds).unwrap();
        host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        host.write_all(b"CONNECT 1234\n").unwrap();
        let local = g.recv().src_port;
        g.send(1234, local, OP_RESPONSE, 0, &[]);
        assert_eq!(read_line(&mut host), format!("OK {local}"));
        host.write_all(b"question").unwrap();
        host.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(g.recv().data, b"question");
        let sd = g.recv();
        // Only SEND: the host may still receive.
        assert_eq!((sd.op, sd.flags), (OP_SHUTDOWN, SHUTDOWN_SEND));
        g.send(1234, local, OP_RW, 0, b"answer");
        let mut b = [0u8; 6];
        host.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"answer");
        g.send(1234, local, OP_SHUTDOWN, SHUTDOWN_SEND | SHUTDOWN_RCV, &[]);
        assert_eq!(host.read(&mut b).unwrap(), 0);
        assert_eq!(g.recv().op, OP_RST);
    }

    #[test]
    // Byte patterns wrap at 256, and the u32 credit counter wraps by design.
    #[allow(clippy::cast_possible_truncation)]
    fn bulk_transfer_respects_credit_both_ways() {
        const N: usize = 256 * 1024;
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let mut g = Guest::new(&uds);
        let mut host = UnixStream::connect(&uds).unwrap();
        host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        host.write_all(b"CONNECT 2000\n").unwrap();
        let local = g.recv().src_port;
        g.send(2000, local, OP_RESPONSE, 0, &[]);
        assert_eq!(read_line(&mut host), format!("OK {local}"));

        // Host -> guest: the guest advertises 64 KiB and returns credit as it consumes.
        let data: Vec<u8> = (0..N).map(|i| (i % 253) as u8).collect();
        let mut w = host.try_clone().unwrap();
        let expected = data.clone();
        let writer = std::thread::spawn(move || w.write_all(&data).unwrap());
        let mut got = Vec::new();
        let mut unacked = 0usize;
        while got.len() < N {
            let p = g.recv();
            match p.op {
                OP_RW => {
                    got.extend_from_slice(&p.data);
                    unacked += p.data.len();
                    assert!(unacked <= 65536, "the device exceeded the guest's credit");
                    if unacked >= 32 * 1024 {
                        g.fwd_cnt = g.fwd_cnt.wrapping_add(unacked as u32);
                        unacked = 0;
                        g.send(2000, local, OP_CREDIT_UPDATE, 0, &[]);
                    }
                }
                OP_CREDIT_UPDATE | OP_CREDIT_REQUEST => {}
                op => panic!("unexpected op {op}"),
            }
        }
        writer.join().unwrap();
        assert!(got == expected, "host->guest data differs");

        // Guest -> host: 64 packets of 4 KiB, read back in full on the host.
        let chunk: Vec<u8> = (0..4096).map(|i| (i % 241) as u8).collect();
        let mut r = host.try_clone().unwrap();
        let reader = std::thread::spawn(move || {
            let mut b = vec![0u8; 64 * 4096];
            r.read_exact(&mut b).unwrap();
            b
        });
        for _ in 0..64 {
            g.send(2000, local, OP_RW, 0, &chunk);
        }
        let b = reader.join().unwrap();
        assert!(
            b.chunks(4096).all(|c| c == chunk.as_slice()),
            "guest->host data differs"
        );
    }

    #[test]
    // Byte patterns wrap at 256, and the u32 credit counters wrap by design.
    #[allow(clippy::cast_possible_truncation)]
    fn concurrent_echo_of_a_large_stream() {
        // The guest echoes everything while the host is still writing, within the credit the
        // device grants, and the host starts reading late so the device's writes to it stall:
        // the device must then return credit on its own, or the guest waits forever.
        const N: usize = 2 * 1024 * 1024;
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let mut g = Guest::new(&uds);
        let mut host = UnixStream::connect(&uds).unwrap();
        host.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        host.write_all(b"CONNECT 3000\n").unwrap();
        let local = g.recv().src_port;
        g.send(3000, local, OP_RESPONSE, 0, &[]);
        assert_eq!(read_line(&mut host), format!("OK {local}"));
        let mut w = host.try_clone().unwrap();
        let writer = std::thread::spawn(move || {
            let data: Vec<u8> = (0..N).map(|i| (i % 251) as u8).collect();
            w.write_all(&data).unwrap();
            w.shutdown(std::net::Shutdown::Write).unwrap();
        });
        let reader = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            let mut back = Vec::new();
            host.read_to_end(&mut back).map(|_| back)
        });
        let (mut peer_buf, mut peer_fwd) = (0u32, 0u32);
        let mut pending: VecDeque<Vec<u8>> = VecDeque::new();
        let (mut sent, mut unacked, mut host_done) = (0u32, 0usize, false);
        while !(host_done && pending.is_empty()) {
            // Send what the device's credit allows.
            while let Some(d) = pending.front() {
                let in_flight = sent.wrapping_sub(peer_fwd);
                if in_flight as usize + d.len() > peer_buf as usize {
                    break;
                }
                let d = pending.pop_front().unwrap();
                g.send(3000, local, OP_RW, 0, &d);
                sent = sent.wrapping_add(d.len() as u32);
            }
            if host_done && pending.is_empty() {
                break;
            }
            let p = g.recv();
            peer_buf = p.buf_alloc;
            peer_fwd = p.fwd_cnt;
            match p.op {
                OP_RW => {
                    unacked += p.data.len();
                    pending.push_back(p.data);
                    if unacked >= 32 * 1024 {
                        g.fwd_cnt = g.fwd_cnt.wrapping_add(unacked as u32);
                        unacked = 0;
                        g.send(3000, local, OP_CREDIT_UPDATE, 0, &[]);
                    }
                }
                OP_SHUTDOWN => host_done = true,
                OP_CREDIT_UPDATE | OP_CREDIT_REQUEST => {}
                op => panic!("unexpected op {op} after {sent} bytes"),
            }
        }
        assert_eq!(sent as usize, N);
        g.send(3000, local, OP_SHUTDOWN, SHUTDOWN_SEND | SHUTDOWN_RCV, &[]);
        writer.join().unwrap();
        let back = reader.join().unwrap().expect("host read");
        assert_eq!(back.len(), N);
        assert!(back.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
    }

    #[test]
    fn host_connect_to_a_port_nobody_listens_on_is_closed_without_ok() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let mut g = Guest::new(&uds);
        let mut host = UnixStream::connect(&uds).unwrap();
        host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        host.write_all(b"CONNECT 9\n").unwrap();
        let req = g.recv();
        g.send(9, req.src_port, OP_RST, 0, &[]);
        let mut b = [0u8; 8];
        assert_eq!(host.read(&mut b).unwrap(), 0, "closed, no OK line");
    }

    #[test]
    fn guest_initiated_connections_reach_uds_port() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let listener = UnixListener::bind(format!("{}_5000", uds.display())).unwrap();
        let mut g = Guest::new(&uds);
        g.send(777, 5000, OP_REQUEST, 0, &[]);
        let resp = g.recv();
        assert_eq!(
            (resp.op, resp.src_port, resp.dst_port),
            (OP_RESPONSE, 5000, 777)
        );
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        g.send(777, 5000, OP_RW, 0, b"hello host");
        let mut b = [0u8; 10];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"hello host");
        s.write_all(b"hello guest").unwrap();
        let rw = g.recv();
        assert_eq!((rw.op, rw.data.as_slice()), (OP_RW, &b"hello guest"[..]));
        // Host closes: the guest gets a shutdown.
        drop(s);
        let sd = g.recv();
        assert_eq!(sd.op, OP_SHUTDOWN);

        // Nobody at <uds>_5001: reset.
        g.send(778, 5001, OP_REQUEST, 0, &[]);
        let rst = g.recv();
        assert_eq!((rst.op, rst.dst_port), (OP_RST, 778));
    }

    #[test]
    fn socket_removed_on_drop_and_bad_cid_refused() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let v = Vsock::new(3, &uds).unwrap();
        assert!(uds.exists());
        drop(v);
        assert!(!uds.exists());
        assert!(matches!(Vsock::new(2, &uds), Err(VsockError::BadCid(2))));
        std::fs::write(&uds, b"").unwrap();
        assert!(matches!(
            Vsock::new(3, &uds),
            Err(VsockError::Listen { .. })
        ));
    }
}
