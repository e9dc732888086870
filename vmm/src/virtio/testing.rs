//! A minimal virtio driver for unit tests: it programs a device through its MMIO registers,
//! lays out split virtqueues in guest memory and submits descriptor chains, as the guest
//! kernel's virtio-mmio driver does.

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::mmio::MmioTransport;
use super::VirtioDevice;

pub const F_NEXT: u16 = 1;
pub const F_WRITE: u16 = 2;
pub const F_READ: u16 = 0;

const QSIZE: u16 = 16;
const MEM: usize = 0x40_0000;
const BUF_START: u64 = 0x8_0000;

pub struct Driver {
    pub mem: GuestMemoryMmap,
    pub t: MmioTransport,
    next_buf: u64,
    /// Per queue: (desc table, avail ring, used ring, next free desc, avail idx, used idx seen).
    queues: Vec<(u64, u64, u64, u16, u16, u16)>,
}

impl Driver {
    pub fn new(dev: Box<dyn VirtioDevice>, _irq: u32) -> Self {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM)]).unwrap();
        let t = MmioTransport::new(dev, mem.clone()).unwrap();
        Driver {
            mem,
            t,
            next_buf: BUF_START,
            queues: Vec::new(),
        }
    }

    pub fn read_reg(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.t.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    pub fn write_reg(&mut self, off: u64, v: u32) {
        self.t.write(off, &v.to_le_bytes());
    }

    pub fn read_config_u64(&mut self, off: u64) -> u64 {
        let mut b = [0u8; 8];
        self.t.read(0x100 + off, &mut b);
        u64::from_le_bytes(b)
    }

    pub fn device_features(&mut self) -> u64 {
        self.write_reg(0x14, 0);
        let lo = self.read_reg(0x10);
        self.write_reg(0x14, 1);
        let hi = self.read_reg(0x10);
        u64::from(lo) | (u64::from(hi) << 32)
    }

    /// Status handshake (from a reset), accept all offered features, set up `queues`,
    /// DRIVER_OK.
    // Writes the low half of the feature word (the high half follows), and the low halves of
    // the queue addresses, all below 4 GiB (their high halves are written as 0).
    #[allow(clippy::cast_possible_truncation)]
    pub fn init(&mut self, queues: &[u32]) {
        assert_eq!(self.read_reg(0), 0x7472_6976);
        assert_eq!(self.read_reg(4), 2);
        self.write_reg(0x70, 0);
        self.queues.clear();
        self.write_reg(0x70, 1);
        self.write_reg(0x70, 1 | 2);
        let f = self.device_features();
        self.write_reg(0x24, 0);
        self.write_reg(0x20, f as u32);
        self.write_reg(0x24, 1);
        self.write_reg(0x20, (f >> 32) as u32);
        self.write_reg(0x70, 1 | 2 | 8);
        assert_eq!(self.read_reg(0x70) & 8, 8, "FEATURES_OK refused");
        for (i, q) in queues.iter().enumerate() {
            let base = 0x1_0000 + (i as u64) * 0x1_0000;
            let (desc, avail, used) = (base, base + 0x1000, base + 0x2000);
            self.write_reg(0x30, *q);
            assert!(self.read_reg(0x34) >= u32::from(QSIZE));
            self.write_reg(0x38, u32::from(QSIZE));
            self.write_reg(0x80, desc as u32);
            self.write_reg(0x84, 0);
            self.write_reg(0x90, avail as u32);
            self.write_reg(0x94, 0);
            self.write_reg(0xa0, used as u32);
            self.write_reg(0xa4, 0);
            self.write_reg(0x44, 1);
            self.queues.push((desc, avail, used, 0, 0, 0));
        }
        self.write_reg(0x70, 1 | 2 | 8 | 4);
        assert_eq!(self.read_reg(0x70) & 0x80, 0, "device FAILED");
    }

    /// Allocates a guest buffer holding `data`; returns its address. The arena is reused
    /// round-robin, so a buffer stays valid until ~3.5 MiB more have been allocated.
    pub fn buf(&mut self, data: &[u8]) -> u64 {
        let len = (data.len() as u64 + 15) & !15;
        if self.next_buf + len > MEM as u64 {
            self.next_buf = BUF_START;
        }
        let a = self.next_buf;
        self.mem.write_slice(data, GuestAddress(a)).unwrap();
        self.next_buf += len;
        a
    }

    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    /// Puts a chain of (addr, len, flags) on queue `q` without notifying.
    pub fn add(&mut self, q: usize, chain: &[(u64, u32, u16)]) {
        let (desc, avail, _, ref mut next, ref mut aidx, _) = self.queues[q];
        let head = *next;
        for (i, (addr, len, flags)) in chain.iter().enumerate() {
            let idx = (*next) % QSIZE;
            let more = i + 1 < chain.len();
            let nxt = (idx + 1) % QSIZE;
            let d = desc + u64::from(idx) * 16;
            self.mem.write_obj(*addr, GuestAddress(d)).unwrap();
            self.mem.write_obj(*len, GuestAddress(d + 8)).unwrap();
            self.mem
                .write_obj(flags | if more { F_NEXT } else { 0 }, GuestAddress(d + 12))
                .unwrap();
            self.mem.write_obj(nxt, GuestAddress(d + 14)).unwrap();
            *next = next.wrapping_add(1);
        }
        let slot = avail + 4 + u64::from(*aidx % QSIZE) * 2;
        self.mem
            .write_obj(head % QSIZE, GuestAddress(slot))
            .unwrap();
        *aidx = aidx.wrapping_add(1);
        self.mem.write_obj(*aidx, GuestAddress(avail + 2)).unwrap();
    }

    pub fn notify(&mut self, q: u32) {
        self.write_reg(0x50, q);
    }

    /// Adds a chain and notifies.
    pub fn submit(&mut self, q: usize, chain: &[(u64, u32, u16)]) {
        self.add(q, chain);
        // A queue index (0..3).
        #[allow(clippy::cast_possible_truncation)]
        self.notify(q as u32);
    }

    /// Lengths of used elements not seen yet on queue `q`.
    pub fn used(&mut self, q: usize) -> Vec<u32> {
        let (_, _, used, _, _, ref mut seen) = self.queues[q];
        let idx: u16 = self.mem.read_obj(GuestAddress(used + 2)).unwrap();
        let mut out = Vec::new();
        while *seen != idx {
            let e = used + 4 + u64::from(*seen % QSIZE) * 8;
            out.push(self.mem.read_obj::<u32>(GuestAddress(e + 4)).unwrap());
            *seen = seen.wrapping_add(1);
        }
        out
    }

    /// Whether the device raised its interrupt since the last call (and acks it).
    pub fn take_interrupt(&mut self) -> bool {
        let st = self.read_reg(0x60);
        self.write_reg(0x64, st);
        let fired = self.t.interrupt().evt.read().is_ok();
        st & 1 != 0 && fired
    }
}
