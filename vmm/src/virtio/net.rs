//! virtio-net on a tap device (or any fd that carries one Ethernet frame per read/write).
//!
//! A tap opened with `IFF_VNET_HDR` (ours are) carries the 12-byte `virtio_net_hdr_v1` in
//! front of each frame, as the guest does: headers pass through unchanged both ways, so
//! checksum and TCP segmentation offloads are offered (CSUM, HOST_TSO4/6 for what the guest
//! sends; GUEST_CSUM, GUEST_TSO4/6 for what it receives, enabled on the tap with
//! TUNSETOFFLOAD as the guest acks them). The guest then moves up to 64 KiB per descriptor
//! chain instead of one MTU-sized frame, which is what makes a VM exit per chain affordable.
//! Any other fd (no vnet header) gets no offloads: the header is stripped from frames the guest
//! sends and prepended (all zeros, `num_buffers = 1`) to frames it receives. A thread polls the
//! tap; the vCPU thread sends on TX notifications and refills RX when the driver adds buffers.
//!
//! Multiqueue: given N > 1 fds on one `IFF_MULTI_QUEUE` tap ([`create_tap_queues`]), the
//! device offers N queue pairs (VIRTIO_NET_F_MQ, with the control queue it needs), each pair
//! served by its own thread on its own tap queue. Only the pairs the driver enabled
//! (`VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET` on the control queue; one until it says more) are
//! attached to the tap, so that the tap never steers a frame to a queue the guest does not
//! read. The guest's TX queues follow its CPUs, so a guest with several vCPUs sends from each
//! without sharing one queue; on the host, each pair's thread moves its queue's frames into
//! the guest, while what the guest sends is written to the tap on the notifying vCPU's thread
//! (one at a time: the transport serialises a device's notifications).

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::{read_config_bytes, DeviceError, Interrupt, VirtioDevice, Worker};

pub const VIRTIO_ID_NET: u32 = 1;
const QUEUE_SIZE: u16 = 256;
const RXQ: usize = 0;
#[cfg(test)]
const TXQ: usize = 1;
const VIRTIO_NET_F_CSUM: u64 = 1 << 0;
const VIRTIO_NET_F_GUEST_CSUM: u64 = 1 << 1;
const VIRTIO_NET_F_MTU: u64 = 1 << 3;
const VIRTIO_NET_F_MAC: u64 = 1 << 5;
const VIRTIO_NET_F_GUEST_TSO4: u64 = 1 << 7;
const VIRTIO_NET_F_GUEST_TSO6: u64 = 1 << 8;
const VIRTIO_NET_F_HOST_TSO4: u64 = 1 << 11;
const VIRTIO_NET_F_HOST_TSO6: u64 = 1 << 12;
const VIRTIO_NET_F_CTRL_VQ: u64 = 1 << 17;
const VIRTIO_NET_F_MQ: u64 = 1 << 22;
/// The most queue pairs a device offers (one per vCPU up to this).
pub const MAX_QUEUE_PAIRS: usize = 8;
/// `virtio_net_ctrl` classes and commands, and the ack values.
const CTRL_MQ: u8 = 4;
const CTRL_MQ_VQ_PAIRS_SET: u8 = 0;
const CTRL_OK: u8 = 0;
const CTRL_ERR: u8 = 1;
/// The longest control command we read (class, command and a le16 take 4 bytes).
const MAX_CTRL_COMMAND: usize = 64;
/// What a tap with a vnet header can do for the guest.
const OFFLOADS: u64 = VIRTIO_NET_F_CSUM
    | VIRTIO_NET_F_GUEST_CSUM
    | VIRTIO_NET_F_GUEST_TSO4
    | VIRTIO_NET_F_GUEST_TSO6
    | VIRTIO_NET_F_HOST_TSO4
    | VIRTIO_NET_F_HOST_TSO6;
/// `virtio_net_config.max_virtqueue_pairs`: after mac[6] and status.
const CONFIG_PAIRS_OFFSET: usize = 8;
/// `virtio_net_config.mtu`: after mac[6], status and max_virtqueue_pairs.
const CONFIG_MTU_OFFSET: usize = 10;
/// `virtio_net_hdr_v1`: flags, gso_type, hdr_len, gso_size, csum_start, csum_offset, num_buffers.
pub const NET_HDR_LEN: usize = 12;
const MAX_FRAME: usize = 65562;

/// Errors setting up the device.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("tap {name}: {source}")]
    Tap {
        name: String,
        source: std::io::Error,
    },
    #[error("bad MAC address {0:?} (want aa:bb:cc:dd:ee:ff)")]
    BadMac(String),
    #[error("net: {0}")]
    Io(#[from] std::io::Error),
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6], NetError> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.len() != 6 {
        return Err(NetError::BadMac(s.into()));
    }
    let mut mac = [0u8; 6];
    for (m, p) in mac.iter_mut().zip(parts) {
        *m = u8::from_str_radix(p, 16).map_err(|_| NetError::BadMac(s.into()))?;
    }
    Ok(mac)
}

/// An interface name the kernel takes (and no path).
fn valid_tap_name(name: &str) -> std::io::Result<()> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('/') {
        return Err(std::io::Error::from(ErrorKind::InvalidInput));
    }
    Ok(())
}

fn tap_error(name: &str) -> impl Fn(std::io::Error) -> NetError + '_ {
    move |source| NetError::Tap {
        name: name.into(),
        source,
    }
}

/// Opens the existing tap interface `name` (`IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`, a
/// [`NET_HDR_LEN`]-byte header per frame), non-blocking.
pub fn open_tap(name: &str) -> Result<File, NetError> {
    let err = tap_error(name);
    valid_tap_name(name).map_err(&err)?;
    // TUNSETIFF would create a missing interface; we only attach to one that was set up.
    if !std::path::Path::new("/sys/class/net").join(name).exists() {
        return Err(err(std::io::Error::new(
            ErrorKind::NotFound,
            "no such interface",
        )));
    }
    tun_set_iff(name, false).map_err(err)
}

/// Creates tap interface `name` in the calling thread's network namespace (or attaches to it
/// if it exists), non-blocking, with a [`NET_HDR_LEN`]-byte vnet header before every frame
/// read or written, and `queues` queues: for more than one, the tap is created
/// `IFF_MULTI_QUEUE` and each returned fd is one of its queues (a [`Net`] on them offers as
/// many queue pairs); one queue is a plain tap. Not persistent: it goes when the last fd on
/// it closes.
pub fn create_tap_queues(name: &str, queues: usize) -> Result<Vec<File>, NetError> {
    let err = tap_error(name);
    valid_tap_name(name).map_err(&err)?;
    let multi = queues > 1;
    (0..queues.max(1))
        .map(|_| tun_set_iff(name, multi).map_err(&err))
        .collect()
}

fn tun_set_iff(name: &str, multi_queue: bool) -> std::io::Result<File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open("/dev/net/tun")?;
    // struct ifreq: 16 bytes of name, then a union whose first member is the flags (short).
    let mut ifr = [0u8; 40];
    ifr[..name.len()].copy_from_slice(name.as_bytes());
    let mut flags = libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR;
    if multi_queue {
        flags |= libc::IFF_MULTI_QUEUE;
    }
    // IFF_TAP | IFF_NO_PI | IFF_VNET_HDR | IFF_MULTI_QUEUE is 0x5102: it fits the short flags.
    #[allow(clippy::cast_possible_truncation)]
    let flags = flags as i16;
    ifr[16..18].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: TUNSETIFF reads and writes a struct ifreq, for which `ifr` is a large enough,
    // properly initialised buffer that lives across the call.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::TUNSETIFF as _, ifr.as_mut_ptr()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if !vnet_tap(&f) {
        return Err(std::io::Error::other(
            "cannot set the tap's vnet header size",
        ));
    }
    Ok(f)
}

/// The tun flags of `fd` (TUNGETIFF; `IFF_DETACH_QUEUE` set for a detached queue), or None
/// if it is not a tun/tap fd.
fn tun_flags(fd: &File) -> Option<i32> {
    let mut ifr = [0u8; 40];
    // SAFETY: TUNGETIFF writes a struct ifreq into `ifr`, which is large enough and lives
    // across the call; on anything but a tun fd it fails and writes nothing.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNGETIFF as _, ifr.as_mut_ptr()) } < 0 {
        return None;
    }
    Some(i32::from(i16::from_ne_bytes([ifr[16], ifr[17]])))
}

/// Whether `fd` is a tap with `IFF_VNET_HDR`; if so, sets its header size to ours.
fn vnet_tap(fd: &File) -> bool {
    if tun_flags(fd).is_none_or(|f| f & libc::IFF_VNET_HDR == 0) {
        return false;
    }
    let size: libc::c_int = 12; // NET_HDR_LEN
                                // SAFETY: TUNSETVNETHDRSZ reads an int through the pointer, which lives across the call.
    unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETVNETHDRSZ as _, &size) >= 0 }
}

use std::os::unix::fs::OpenOptionsExt;

/// Attaches (`on`) or detaches one queue of a multi-queue tap (TUNSETQUEUE): a detached
/// queue gets no frames from the tap and takes none.
fn set_tap_queue(tap: &File, on: bool) -> std::io::Result<()> {
    let mut ifr = [0u8; 40];
    let flags = if on {
        libc::IFF_ATTACH_QUEUE
    } else {
        libc::IFF_DETACH_QUEUE
    };
    // IFF_ATTACH_QUEUE and IFF_DETACH_QUEUE fit the short flags.
    #[allow(clippy::cast_possible_truncation)]
    ifr[16..18].copy_from_slice(&(flags as i16).to_ne_bytes());
    // SAFETY: TUNSETQUEUE reads a struct ifreq, for which `ifr` is a large enough,
    // initialised buffer that lives across the call.
    if unsafe { libc::ioctl(tap.as_raw_fd(), libc::TUNSETQUEUE as _, ifr.as_ptr()) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// One queue pair: its tap queue, and its queues once the driver is ready.
struct Inner {
    tap: File,
    /// The tap carries a vnet header per frame (offloads possible).
    vnet: bool,
    active: Option<(GuestMemoryMmap, Queue, Queue, Arc<Interrupt>)>,
    /// The guest had no RX buffer for the last frame we tried to deliver.
    rx_blocked: bool,
    /// A frame read from the tap that found no RX buffer yet.
    held: Option<Vec<u8>>,
}

/// A queue pair and the thread that moves its tap's frames into its RX queue.
struct Pair {
    inner: Arc<Mutex<Inner>>,
    worker: Worker,
    /// Its tap queue is attached (gets frames from the tap).
    attached: bool,
}

/// The virtio-net device.
pub struct Net {
    pairs: Vec<Pair>,
    /// The control queue, where the driver enables queue pairs (multiqueue only).
    ctrl: Option<(GuestMemoryMmap, Queue, Arc<Interrupt>)>,
    /// Its index: after the pairs the driver uses (2 without VIRTIO_NET_F_MQ).
    ctrl_index: usize,
    /// The queue pairs the driver has (all with VIRTIO_NET_F_MQ, else one).
    driver_pairs: usize,
    /// The fds are queues of one multi-queue tap, attached and detached as the driver
    /// enables pairs (not so for a single queue, or for fds that are not taps).
    steer: bool,
    queue_sizes: Vec<u16>,
    mac: Option<[u8; 6]>,
    mtu: Option<u16>,
    vnet: bool,
}

fn lock(m: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Net {
    /// A device on `tap` (an open tap or any frame-per-message fd; set non-blocking here).
    pub fn new(tap: OwnedFd, mac: Option<[u8; 6]>) -> Result<Self, NetError> {
        Self::with_queues(vec![tap], mac)
    }

    /// A device with one queue pair per fd in `taps`: the queues of one multi-queue tap
    /// ([`create_tap_queues`]); more than [`MAX_QUEUE_PAIRS`] is an error.
    pub fn with_queues(taps: Vec<OwnedFd>, mac: Option<[u8; 6]>) -> Result<Self, NetError> {
        if taps.is_empty() || taps.len() > MAX_QUEUE_PAIRS {
            return Err(NetError::Io(std::io::Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "a net device takes 1 to {MAX_QUEUE_PAIRS} tap queues, not {}",
                    taps.len()
                ),
            )));
        }
        let n = taps.len();
        let taps: Vec<(File, Option<i32>)> = taps
            .into_iter()
            .map(|t| {
                let tap = File::from(t);
                let flags = tun_flags(&tap);
                (tap, flags)
            })
            .collect();
        let steer = n > 1
            && taps
                .iter()
                .all(|(_, f)| f.is_some_and(|f| f & libc::IFF_MULTI_QUEUE != 0));
        // Offloads only where every queue carries the vnet header; its size is set on each
        // queue that has one.
        let vnet = taps
            .iter()
            .map(|(tap, _)| vnet_tap(tap))
            .fold(true, |all, this| all & this);
        let mut pairs = Vec::with_capacity(n);
        for (i, (tap, flags)) in taps.into_iter().enumerate() {
            let attached = flags.is_some_and(|f| f & libc::IFF_DETACH_QUEUE == 0);
            // SAFETY: F_GETFL/F_SETFL on a valid, owned fd.
            unsafe {
                let fl = libc::fcntl(tap.as_raw_fd(), libc::F_GETFL);
                libc::fcntl(tap.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
            }
            let inner = Arc::new(Mutex::new(Inner {
                tap,
                vnet,
                active: None,
                rx_blocked: false,
                held: None,
            }));
            let worker = {
                let inner = inner.clone();
                let name = if n == 1 {
                    "virtio-net".to_string()
                } else {
                    format!("virtio-net-q{i}")
                };
                Worker::spawn(&name, move |wake, stop| event_loop(&inner, wake, stop))?
            };
            pairs.push(Pair {
                inner,
                worker,
                attached,
            });
        }
        let mut queue_sizes = vec![QUEUE_SIZE; 2 * n];
        if n > 1 {
            queue_sizes.push(QUEUE_SIZE);
        }
        Ok(Net {
            pairs,
            ctrl: None,
            ctrl_index: 2,
            driver_pairs: 1,
            steer,
            queue_sizes,
            mac,
            mtu: None,
            vnet,
        })
    }

    /// Offers the guest an MTU (VIRTIO_NET_F_MTU): its eth0 comes up with it, as the pod
    /// network's interface on the host has it.
    pub fn with_mtu(mut self, mtu: Option<u16>) -> Self {
        self.mtu = mtu;
        self
    }

    /// Attaches the first `n` queue pairs' tap queues and detaches the rest (nothing to do
    /// unless the queues are a multi-queue tap's). Attaches before it detaches, so that the
    /// tap always has a queue; if the tap refuses, what this call changed is undone.
    fn enable_pairs(&mut self, n: usize) -> std::io::Result<()> {
        if !self.steer {
            return Ok(());
        }
        let order: Vec<usize> = (0..self.pairs.len())
            .filter(|i| *i < n)
            .chain((0..self.pairs.len()).filter(|i| *i >= n))
            .collect();
        let mut changed = Vec::new();
        for i in order {
            let want = i < n;
            let p = &mut self.pairs[i];
            if p.attached == want {
                continue;
            }
            let r = set_tap_queue(&lock(&p.inner).tap, want);
            if let Err(e) = r {
                for j in changed.into_iter().rev() {
                    let p: &mut Pair = &mut self.pairs[j];
                    if set_tap_queue(&lock(&p.inner).tap, !p.attached).is_ok() {
                        p.attached = !p.attached;
                    }
                }
                return Err(e);
            }
            p.attached = want;
            changed.push(i);
        }
        Ok(())
    }

    /// Answers the driver's commands on the control queue (on the vCPU thread: Linux waits
    /// for each answer spinning).
    fn process_ctrl(&mut self) {
        let Some((mem, mut q, irq)) = self.ctrl.take() else {
            return;
        };
        let mut used = false;
        while let Some(chain) = q.pop_descriptor_chain(&mem) {
            let head = chain.head_index();
            let (Ok(mut r), Ok(mut w)) = (chain.clone().reader(&mem), chain.writer(&mem)) else {
                tracing::warn!("virtio-net: bad control chain");
                let _ = q.add_used(&mem, head, 0);
                used = true;
                continue;
            };
            // Every command we take is a few bytes; a larger chain is refused unread (its
            // descriptors could name all of guest memory, many times over).
            let mut cmd = Vec::new();
            if r.available_bytes() <= MAX_CTRL_COMMAND {
                let _ = r.read_to_end(&mut cmd);
            }
            let ack = match cmd.as_slice() {
                [CTRL_MQ, CTRL_MQ_VQ_PAIRS_SET, lo, hi, ..] => {
                    let n = usize::from(u16::from_le_bytes([*lo, *hi]));
                    // Only with VIRTIO_NET_F_MQ, which gives the driver every pair.
                    if (1..=self.driver_pairs).contains(&n) && self.driver_pairs > 1 {
                        match self.enable_pairs(n) {
                            Ok(()) => {
                                tracing::debug!(pairs = n, "virtio-net: queue pairs enabled");
                                CTRL_OK
                            }
                            Err(e) => {
                                tracing::warn!("virtio-net: enabling {n} queue pairs: {e}");
                                CTRL_ERR
                            }
                        }
                    } else {
                        CTRL_ERR
                    }
                }
                [class, command, ..] => {
                    tracing::debug!(class, command, "virtio-net: control command refused");
                    CTRL_ERR
                }
                _ => CTRL_ERR,
            };
            // The ack is the chain's device-writable part (one byte).
            let len = u32::from(w.write_all(&[ack]).is_ok());
            let _ = q.add_used(&mem, head, len);
            used = true;
        }
        if used && q.needs_notification(&mem).unwrap_or(true) {
            irq.signal_used();
        }
        self.ctrl = Some((mem, q, irq));
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        let mut f = 0;
        if self.mac.is_some() {
            f |= VIRTIO_NET_F_MAC;
        }
        if self.mtu.is_some() {
            f |= VIRTIO_NET_F_MTU;
        }
        if self.vnet {
            f |= OFFLOADS;
        }
        if self.pairs.len() > 1 {
            f |= VIRTIO_NET_F_CTRL_VQ | VIRTIO_NET_F_MQ;
        }
        f
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut config = [0u8; CONFIG_MTU_OFFSET + 2];
        config[..6].copy_from_slice(&self.mac.unwrap_or_default());
        // At most MAX_QUEUE_PAIRS.
        #[allow(clippy::cast_possible_truncation)]
        let pairs = self.pairs.len() as u16;
        config[CONFIG_PAIRS_OFFSET..CONFIG_MTU_OFFSET].copy_from_slice(&pairs.to_le_bytes());
        config[CONFIG_MTU_OFFSET..].copy_from_slice(&self.mtu.unwrap_or_default().to_le_bytes());
        read_config_bytes(&config, offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        acked: u64,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), DeviceError> {
        // The driver uses every pair with VIRTIO_NET_F_MQ, else the first; the control queue
        // comes after them.
        let used_pairs = if acked & VIRTIO_NET_F_MQ != 0 {
            self.pairs.len()
        } else {
            1
        };
        self.ctrl_index = 2 * used_pairs;
        self.driver_pairs = used_pairs;
        let mut queues: Vec<Option<Queue>> = queues.into_iter().map(Some).collect();
        let mut take = |i: usize| {
            queues
                .get_mut(i)
                .and_then(Option::take)
                .ok_or(DeviceError::BadQueue(i))
        };
        let mut pair_queues = Vec::with_capacity(used_pairs);
        for i in 0..used_pairs {
            pair_queues.push((take(2 * i)?, take(2 * i + 1)?));
        }
        self.ctrl = if acked & VIRTIO_NET_F_CTRL_VQ != 0 {
            Some((mem.clone(), take(self.ctrl_index)?, interrupt.clone()))
        } else {
            None
        };
        // Until the driver says otherwise, one pair takes the tap's frames.
        self.enable_pairs(1).map_err(DeviceError::Io)?;
        if self.vnet {
            // What the tap may hand us (and so the guest) unsegmented and unchecksummed: a
            // setting of the tap, made through its first queue.
            let mut tun = 0;
            if acked & VIRTIO_NET_F_GUEST_CSUM != 0 {
                tun |= libc::TUN_F_CSUM;
                if acked & VIRTIO_NET_F_GUEST_TSO4 != 0 {
                    tun |= libc::TUN_F_TSO4;
                }
                if acked & VIRTIO_NET_F_GUEST_TSO6 != 0 {
                    tun |= libc::TUN_F_TSO6;
                }
            }
            let g = lock(&self.pairs[0].inner);
            // SAFETY: TUNSETOFFLOAD takes its flags by value on a tap fd we own.
            if unsafe {
                libc::ioctl(
                    g.tap.as_raw_fd(),
                    libc::TUNSETOFFLOAD as _,
                    tun as libc::c_ulong,
                )
            } < 0
            {
                tracing::warn!(
                    "virtio-net: TUNSETOFFLOAD {tun:#x}: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
        for (p, (rx, tx)) in self.pairs.iter().zip(pair_queues) {
            lock(&p.inner).active = Some((mem.clone(), rx, tx, interrupt.clone()));
            p.worker.wake();
        }
        Ok(())
    }

    fn process_queue(&mut self, index: usize) {
        if self.ctrl.is_some() && index == self.ctrl_index {
            self.process_ctrl();
            return;
        }
        let Some(p) = self.pairs.get(index / 2) else {
            return;
        };
        let mut g = lock(&p.inner);
        if index % 2 == RXQ {
            g.rx_blocked = false;
            g.fill_rx();
        } else {
            g.process_tx();
        }
        drop(g);
        p.worker.wake();
    }

    fn reset(&mut self) {
        for p in &self.pairs {
            let mut g = lock(&p.inner);
            g.active = None;
            g.held = None;
            g.rx_blocked = false;
        }
        self.ctrl = None;
    }
}

impl Inner {
    fn process_tx(&mut self) {
        let Some((mem, _, tx, irq)) = self.active.as_mut() else {
            return;
        };
        let mut used = false;
        let mut frame = Vec::with_capacity(MAX_FRAME);
        while let Some(chain) = tx.pop_descriptor_chain(&*mem) {
            let head = chain.head_index();
            frame.clear();
            match chain.reader(&*mem) {
                // Larger than any frame a tap takes: dropped without copying.
                Ok(r) if r.available_bytes() > NET_HDR_LEN + MAX_FRAME => {
                    tracing::debug!(
                        "virtio-net: dropping a {} byte TX chain",
                        r.available_bytes()
                    );
                }
                Ok(mut r) => {
                    let _ = r.read_to_end(&mut frame);
                }
                Err(e) => tracing::warn!("virtio-net: bad TX chain: {e}"),
            }
            if frame.len() > NET_HDR_LEN {
                let out = if self.vnet {
                    &frame[..]
                } else {
                    &frame[NET_HDR_LEN..]
                };
                match self.tap.write(out) {
                    Ok(_) => {}
                    // A full tap queue drops the frame, as a real link would.
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(e) => tracing::debug!("virtio-net: tap write: {e}"),
                }
            }
            let _ = tx.add_used(&*mem, head, 0);
            used = true;
        }
        if used && tx.needs_notification(&*mem).unwrap_or(true) {
            irq.signal_used();
        }
    }

    /// Moves frames from the tap into RX buffers until one of them runs out.
    fn fill_rx(&mut self) {
        let Some((mem, rx, _, irq)) = self.active.as_mut() else {
            return;
        };
        let mut used = false;
        let mut buf = vec![0u8; MAX_FRAME];
        loop {
            let frame = match self.held.take() {
                Some(f) => f,
                None => {
                    let read = if self.vnet {
                        self.tap
                            .read(&mut buf[..])
                            .map(|n| n.saturating_sub(NET_HDR_LEN))
                    } else {
                        buf[..NET_HDR_LEN].fill(0);
                        self.tap.read(&mut buf[NET_HDR_LEN..])
                    };
                    match read {
                        Ok(0) => break,
                        Ok(n) => {
                            // num_buffers: one chain per frame (no MRG_RXBUF).
                            buf[10..12].copy_from_slice(&1u16.to_le_bytes());
                            buf[..NET_HDR_LEN + n].to_vec()
                        }
                        Err(_) => break,
                    }
                }
            };
            let Some(chain) = rx.pop_descriptor_chain(&*mem) else {
                self.held = Some(frame);
                self.rx_blocked = true;
                break;
            };
            let head = chain.head_index();
            let len = match chain.writer(&*mem) {
                // frame.len() <= MAX_FRAME (64 KiB + a header).
                #[allow(clippy::cast_possible_truncation)]
                Ok(mut w) if w.available_bytes() >= frame.len() => {
                    let _ = w.write_all(&frame);
                    frame.len() as u32
                }
                Ok(_) => {
                    tracing::debug!(
                        "virtio-net: RX buffer too small for a {} byte frame",
                        frame.len()
                    );
                    0
                }
                Err(e) => {
                    tracing::warn!("virtio-net: bad RX chain: {e}");
                    0
                }
            };
            let _ = rx.add_used(&*mem, head, len);
            used = true;
        }
        if used && rx.needs_notification(&*mem).unwrap_or(true) {
            irq.signal_used();
        }
    }
}

fn event_loop(inner: &Mutex<Inner>, wake: &EventFd, stop: &AtomicBool) {
    // A tap whose interface went away (deleted under the VM) reports an error at once on
    // every poll: after one, the tap is left out until the next wake-up or a second passes,
    // rather than spun on.
    let mut skip_tap = false;
    while !stop.load(Ordering::SeqCst) {
        let (tap_fd, want_rx) = {
            let g = lock(inner);
            (g.tap.as_raw_fd(), g.active.is_some() && !g.rx_blocked)
        };
        let mut fds = [
            libc::pollfd {
                fd: wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                // poll ignores a negative fd.
                fd: if skip_tap { -1 } else { tap_fd },
                events: if want_rx { libc::POLLIN } else { 0 },
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfd structures that outlives the call.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, 1000) };
        if r == 0 {
            skip_tap = false;
        }
        if r <= 0 {
            continue;
        }
        if fds[0].revents != 0 {
            let _ = wake.read();
            skip_tap = false;
        }
        if fds[1].revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
            tracing::debug!(
                revents = fds[1].revents,
                "virtio-net: the tap reports an error"
            );
            skip_tap = true;
        } else if fds[1].revents & libc::POLLIN != 0 {
            lock(inner).fill_rx();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::testing::{Driver, F_READ, F_WRITE};
    use std::os::unix::net::UnixDatagram;
    use std::time::{Duration, Instant};

    // Bytes n, n+1, ... wrapping at 256: truncation intended.
    #[allow(clippy::cast_possible_truncation)]
    fn frame(n: u8, len: usize) -> Vec<u8> {
        (0..len).map(|i| n.wrapping_add(i as u8)).collect()
    }

    #[test]
    // The test frames' lengths are about 100 bytes.
    #[allow(clippy::cast_possible_truncation)]
    fn frames_flow_both_ways_through_the_queues() {
        let (ours, theirs) = UnixDatagram::pair().unwrap();
        theirs
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let dev = Net::new(
            OwnedFd::from(ours),
            Some(parse_mac("52:54:00:12:34:56").unwrap()),
        )
        .unwrap();
        let mut d = Driver::new(Box::new(dev), 0);
        assert_eq!(d.read_reg(0x08), VIRTIO_ID_NET);
        assert_ne!(d.device_features() & VIRTIO_NET_F_MAC, 0);
        let mut mac = [0u8; 6];
        d.t.read(0x100, &mut mac);
        assert_eq!(mac, [0x52, 0x54, 0, 0x12, 0x34, 0x56]);
        d.init(&[0, 1]);

        // Guest -> tap: the header is stripped.
        let mut pkt = vec![0u8; NET_HDR_LEN];
        pkt.extend(frame(7, 60));
        let b = d.buf(&pkt);
        d.submit(TXQ, &[(b, pkt.len() as u32, F_READ)]);
        assert_eq!(d.used(TXQ).len(), 1);
        let mut got = [0u8; 2048];
        let n = theirs.recv(&mut got).unwrap();
        assert_eq!(&got[..n], frame(7, 60).as_slice());

        // Tap -> guest: a frame arriving before any RX buffer waits for one.
        theirs.send(&frame(9, 100)).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let rxb = d.buf(&[0u8; 1526]);
        d.submit(RXQ, &[(rxb, 1526, F_WRITE)]);
        let deadline = Instant::now() + Duration::from_secs(5);
        let used = loop {
            let u = d.used(RXQ);
            if !u.is_empty() || Instant::now() > deadline {
                break u;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        assert_eq!(used, vec![(NET_HDR_LEN + 100) as u32]);
        let data = d.read(rxb, NET_HDR_LEN + 100);
        assert_eq!(data[10], 1, "num_buffers");
        assert_eq!(&data[NET_HDR_LEN..], frame(9, 100).as_slice());
    }

    #[test]
    fn mtu_is_offered_in_the_config_space() {
        let (ours, _theirs) = UnixDatagram::pair().unwrap();
        let dev = Net::new(OwnedFd::from(ours), None)
            .unwrap()
            .with_mtu(Some(1450));
        let mut d = Driver::new(Box::new(dev), 0);
        assert_ne!(d.device_features() & VIRTIO_NET_F_MTU, 0);
        assert_eq!(d.device_features() & VIRTIO_NET_F_MAC, 0);
        let mut mtu = [0u8; 2];
        d.t.read(0x100 + CONFIG_MTU_OFFSET as u64, &mut mtu);
        assert_eq!(u16::from_le_bytes(mtu), 1450);
    }

    /// Sends a control command on queue `ctrl`; returns the device's ack.
    fn ctrl(d: &mut Driver, ctrl: usize, cmd: &[u8]) -> u8 {
        let c = d.buf(cmd);
        let ack = d.buf(&[0xee]);
        // A command is a few bytes.
        #[allow(clippy::cast_possible_truncation)]
        d.submit(ctrl, &[(c, cmd.len() as u32, F_READ), (ack, 1, F_WRITE)]);
        assert_eq!(
            d.used(ctrl),
            vec![1],
            "the control command was not answered"
        );
        d.read(ack, 1)[0]
    }

    #[test]
    // The test frames' lengths are about 100 bytes.
    #[allow(clippy::cast_possible_truncation)]
    fn several_queue_pairs_and_the_control_queue() {
        let (a, theirs_a) = UnixDatagram::pair().unwrap();
        let (b, theirs_b) = UnixDatagram::pair().unwrap();
        for t in [&theirs_a, &theirs_b] {
            t.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        }
        let dev = Net::with_queues(vec![OwnedFd::from(a), OwnedFd::from(b)], None).unwrap();
        let mut d = Driver::new(Box::new(dev), 0);
        let f = d.device_features();
        assert_ne!(f & VIRTIO_NET_F_MQ, 0);
        assert_ne!(f & VIRTIO_NET_F_CTRL_VQ, 0);
        let mut pairs = [0u8; 2];
        d.t.read(0x100 + CONFIG_PAIRS_OFFSET as u64, &mut pairs);
        assert_eq!(u16::from_le_bytes(pairs), 2);
        // rx0 tx0 rx1 tx1 ctrl
        d.init(&[0, 1, 2, 3, 4]);
        assert_eq!(
            ctrl(&mut d, 4, &[CTRL_MQ, CTRL_MQ_VQ_PAIRS_SET, 2, 0]),
            CTRL_OK
        );
        assert_eq!(
            ctrl(&mut d, 4, &[CTRL_MQ, CTRL_MQ_VQ_PAIRS_SET, 3, 0]),
            CTRL_ERR
        );
        assert_eq!(
            ctrl(&mut d, 4, &[CTRL_MQ, CTRL_MQ_VQ_PAIRS_SET, 0, 0]),
            CTRL_ERR
        );
        assert_eq!(
            ctrl(&mut d, 4, &[0, 0, 1]),
            CTRL_ERR,
            "rx mode is not offered"
        );
        assert_eq!(ctrl(&mut d, 4, &[CTRL_MQ]), CTRL_ERR, "a truncated command");
        let mut long = vec![CTRL_MQ, CTRL_MQ_VQ_PAIRS_SET, 2, 0];
        long.resize(MAX_CTRL_COMMAND + 1, 0);
        assert_eq!(
            ctrl(&mut d, 4, &long),
            CTRL_ERR,
            "a command too long to read"
        );

        // Each pair has its own fd: the second pair's TX leaves through the second.
        let mut pkt = vec![0u8; NET_HDR_LEN];
        pkt.extend(frame(3, 70));
        let buf = d.buf(&pkt);
        d.submit(3, &[(buf, pkt.len() as u32, F_READ)]);
        assert_eq!(d.used(3).len(), 1);
        let mut got = [0u8; 2048];
        let n = theirs_b.recv(&mut got).unwrap();
        assert_eq!(&got[..n], frame(3, 70).as_slice());

        // ... and what arrives on the second fd fills the second pair's RX queue.
        let rxb = d.buf(&[0u8; 1526]);
        d.submit(2, &[(rxb, 1526, F_WRITE)]);
        theirs_b.send(&frame(5, 90)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let used = loop {
            let u = d.used(2);
            if !u.is_empty() || Instant::now() > deadline {
                break u;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        assert_eq!(used, vec![(NET_HDR_LEN + 90) as u32]);
        assert_eq!(&d.read(rxb, NET_HDR_LEN + 90)[NET_HDR_LEN..], frame(5, 90));
        assert!(
            d.used(0).is_empty(),
            "the first pair got the second's frame"
        );
        drop(theirs_a);
    }

    #[test]
    fn a_multiqueue_tap_has_only_the_enabled_pairs_attached() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || !std::path::Path::new("/dev/net/tun").exists() {
            println!("SKIP a_multiqueue_tap_has_only_the_enabled_pairs_attached: needs root and /dev/net/tun");
            return;
        }
        let name = format!("vmq{}", std::process::id() % 1_000_000);
        let taps = create_tap_queues(&name, 3).unwrap();
        // The tap's real TX queue count is the number of attached queues.
        let attached = || {
            std::fs::read_dir(format!("/sys/class/net/{name}/queues"))
                .unwrap()
                .filter(|e| {
                    e.as_ref()
                        .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("tx-"))
                })
                .count()
        };
        assert_eq!(attached(), 3);
        let dev = Net::with_queues(taps.into_iter().map(OwnedFd::from).collect(), None).unwrap();
        let mut d = Driver::new(Box::new(dev), 0);
        assert_ne!(d.device_features() & OFFLOADS, 0, "a tap offers offloads");
        d.init(&[0, 1, 2, 3, 4, 5, 6]);
        // Activated: the driver uses one pair until it enables more.
        assert_eq!(attached(), 1);
        assert_eq!(
            ctrl(&mut d, 6, &[CTRL_MQ, CTRL_MQ_VQ_PAIRS_SET, 3, 0]),
            CTRL_OK
        );
        assert_eq!(attached(), 3);
        assert_eq!(
            ctrl(&mut d, 6, &[CTRL_MQ, CTRL_MQ_VQ_PAIRS_SET, 2, 0]),
            CTRL_OK
        );
        assert_eq!(attached(), 2);
        // A reset and a new driver start from one pair again.
        d.init(&[0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(attached(), 1);
        drop(d);
        assert!(
            !std::path::Path::new("/sys/class/net").join(&name).exists(),
            "the tap outlived its queues"
        );
    }

    #[test]
    fn bad_tap_and_mac_are_clear_errors() {
        assert!(parse_mac("52:54:00:12:34").is_err());
        assert!(parse_mac("zz:54:00:12:34:56").is_err());
        let e = open_tap("this-name-is-far-too-long-for-a-tap").unwrap_err();
        assert!(e.to_string().contains("this-name-is-far-too-long"), "{e}");
        let e = open_tap("vessel-nope0").unwrap_err();
        assert!(e.to_string().contains("no such interface"), "{e}");
    }
}
