//! The virtio-mmio transport (virtio 1.2 §4.2, version 2 register layout).
//!
//! The guest finds devices from the kernel command line
//! (`virtio_mmio.device=<size>@<base>:<irq>`, see [`MmioTransport::cmdline_arg`]).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;

use super::{Interrupt, VirtioDevice, VIRTIO_F_VERSION_1};

/// Size of one device's MMIO window.
pub const MMIO_WINDOW: u64 = 0x1000;

const MAGIC: u32 = 0x7472_6976; // "virt"
const VENDOR: u32 = 0x5653_4c56; // "VLSV"

const STATUS_ACKNOWLEDGE: u32 = 1;
const STATUS_DRIVER: u32 = 2;
const STATUS_DRIVER_OK: u32 = 4;
const STATUS_FEATURES_OK: u32 = 8;
const STATUS_FAILED: u32 = 0x80;

/// One virtio device behind an MMIO window.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
    queue_sel: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    driver_features: u64,
    status: u32,
    config_generation: u32,
    activated: bool,
    interrupt: Arc<Interrupt>,
}

impl MmioTransport {
    pub fn new(device: Box<dyn VirtioDevice>, mem: GuestMemoryMmap) -> std::io::Result<Self> {
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|s| Queue::new(*s).expect("device queue sizes are powers of two"))
            .collect();
        Ok(MmioTransport {
            device,
            mem,
            queues,
            queue_sel: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            driver_features: 0,
            status: 0,
            config_generation: 0,
            activated: false,
            interrupt: Arc::new(Interrupt::new()?),
        })
    }

    /// The interrupt to register as an irqfd.
    pub fn interrupt(&self) -> Arc<Interrupt> {
        self.interrupt.clone()
    }

    /// The kernel command-line argument that declares this device.
    pub fn cmdline_arg(base: u64, irq: u32) -> String {
        format!("virtio_mmio.device=4K@{base:#x}:{irq}")
    }

    fn offered_features(&self) -> u64 {
        self.device.features() | VIRTIO_F_VERSION_1
    }

    fn queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_sel as usize)
    }

    /// Handles a guest read at `offset` within the window.
    pub fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= 0x100 {
            self.device.read_config(offset - 0x100, data);
            return;
        }
        if data.len() != 4 {
            data.fill(0);
            return;
        }
        let v: u32 = match offset {
            0x00 => MAGIC,
            0x04 => 2,
            0x08 => self.device.device_type(),
            0x0c => VENDOR,
            0x10 => match self.device_features_sel {
                // The low half of the 64-bit feature word: truncation intended.
                #[allow(clippy::cast_possible_truncation)]
                0 => self.offered_features() as u32,
                1 => (self.offered_features() >> 32) as u32,
                _ => 0,
            },
            0x34 => self.queue().map(|q| u32::from(q.max_size())).unwrap_or(0),
            0x44 => self.queue().map(|q| u32::from(q.ready())).unwrap_or(0),
            0x60 => self.interrupt.status.load(Ordering::SeqCst),
            0x70 => self.status,
            0xfc => self
                .config_generation
                .wrapping_add(self.device.config_generation()),
            _ => 0,
        };
        data.copy_from_slice(&v.to_le_bytes());
    }

    /// Handles a guest write at `offset` within the window.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= 0x100 {
            self.device.write_config(offset - 0x100, data);
            return;
        }
        if data.len() != 4 {
            return;
        }
        let v = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        let setup = !self.activated;
        match offset {
            0x14 => self.device_features_sel = v,
            // Only before FEATURES_OK: what was checked then is what the device gets.
            0x20 if setup && self.status & STATUS_FEATURES_OK == 0 => {
                let shift = match self.driver_features_sel {
                    0 => 0,
                    1 => 32,
                    _ => return,
                };
                self.driver_features =
                    (self.driver_features & !(0xffff_ffffu64 << shift)) | (u64::from(v) << shift);
            }
            0x24 => self.driver_features_sel = v,
            0x30 => self.queue_sel = v,
            0x38 if setup => {
                // QueueNum is 16 bits: a larger value is an invalid size, ignored like others.
                if let (Some(q), Ok(size)) = (self.queue(), u16::try_from(v)) {
                    q.set_size(size);
                }
            }
            0x44 if setup => {
                if let Some(q) = self.queue() {
                    q.set_ready(v == 1);
                }
            }
            0x50 => {
                if self.activated && (v as usize) < self.queues.len() {
                    self.device.process_queue(v as usize);
                }
            }
            0x64 => {
                self.interrupt.status.fetch_and(!v, Ordering::SeqCst);
            }
            0x70 => self.set_status(v),
            0x80 if setup => self
                .queue()
                .map(|q| q.set_desc_table_address(Some(v), None))
                .unwrap_or(()),
            0x84 if setup => self
                .queue()
                .map(|q| q.set_desc_table_address(None, Some(v)))
                .unwrap_or(()),
            0x90 if setup => self
                .queue()
                .map(|q| q.set_avail_ring_address(Some(v), None))
                .unwrap_or(()),
            0x94 if setup => self
                .queue()
                .map(|q| q.set_avail_ring_address(None, Some(v)))
                .unwrap_or(()),
            0xa0 if setup => self
                .queue()
                .map(|q| q.set_used_ring_address(Some(v), None))
                .unwrap_or(()),
            0xa4 if setup => self
                .queue()
                .map(|q| q.set_used_ring_address(None, Some(v)))
                .unwrap_or(()),
            _ => tracing::debug!(offset, v, "virtio-mmio: ignored write"),
        }
    }

    fn set_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        if v & STATUS_FEATURES_OK != 0 && self.status & STATUS_FEATURES_OK == 0 {
            // Refuse features we did not offer, and a driver without VERSION_1.
            let offered = self.offered_features();
            if self.driver_features & !offered != 0
                || self.driver_features & VIRTIO_F_VERSION_1 == 0
            {
                self.status = v & !STATUS_FEATURES_OK;
                return;
            }
        }
        self.status = v;
        if v & STATUS_DRIVER_OK != 0 && !self.activated {
            let want = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK;
            if v & want != want {
                self.status |= STATUS_FAILED;
                return;
            }
            for q in self.queues.iter_mut() {
                q.set_event_idx(self.driver_features & (1 << 29) != 0);
            }
            let queues: Result<Vec<Queue>, _> = self
                .queues
                .iter()
                .map(|q| Queue::try_from(q.state()))
                .collect();
            let Ok(queues) = queues else {
                self.status |= STATUS_FAILED;
                return;
            };
            if let Some((i, _)) = queues
                .iter()
                .enumerate()
                .find(|(_, q)| q.ready() && !q.is_valid(&self.mem))
            {
                tracing::warn!(queue = i, "virtio-mmio: driver set up an invalid queue");
                self.status |= STATUS_FAILED;
                return;
            }
            match self.device.activate(
                self.mem.clone(),
                queues,
                self.driver_features,
                self.interrupt.clone(),
            ) {
                Ok(()) => self.activated = true,
                Err(e) => {
                    tracing::warn!("virtio device activation failed: {e}");
                    self.status |= STATUS_FAILED;
                }
            }
        }
    }

    fn reset(&mut self) {
        if self.activated {
            self.device.reset();
        }
        self.activated = false;
        self.status = 0;
        self.driver_features = 0;
        self.queue_sel = 0;
        self.interrupt.status.store(0, Ordering::SeqCst);
        for q in self.queues.iter_mut() {
            q.reset();
        }
        self.config_generation = self.config_generation.wrapping_add(1);
    }
}

/// The MMIO bus: device windows by base address.
#[derive(Default)]
pub struct MmioBus {
    devices: Vec<(u64, Arc<Mutex<MmioTransport>>)>,
}

impl MmioBus {
    pub fn add(&mut self, base: u64, dev: Arc<Mutex<MmioTransport>>) {
        self.devices.push((base, dev));
    }

    fn find(&self, addr: u64) -> Option<(u64, &Arc<Mutex<MmioTransport>>)> {
        self.devices
            .iter()
            .find(|(b, _)| addr >= *b && addr < b + MMIO_WINDOW)
            .map(|(b, d)| (addr - b, d))
    }

    /// Returns false if no device is at `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr) {
            Some((off, d)) => {
                d.lock().unwrap_or_else(|p| p.into_inner()).read(off, data);
                true
            }
            None => false,
        }
    }

    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr) {
            Some((off, d)) => {
                d.lock().unwrap_or_else(|p| p.into_inner()).write(off, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::testing::Driver;
    use crate::virtio::DeviceError;

    /// A device that offers nothing beyond VERSION_1 and records what it was activated
    /// with.
    struct Recorder(Arc<Mutex<Option<u64>>>);

    impl VirtioDevice for Recorder {
        fn device_type(&self) -> u32 {
            0x7f
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16]
        }
        fn features(&self) -> u64 {
            0
        }
        fn read_config(&self, _offset: u64, _data: &mut [u8]) {}
        fn activate(
            &mut self,
            _mem: GuestMemoryMmap,
            _queues: Vec<Queue>,
            acked: u64,
            _interrupt: Arc<Interrupt>,
        ) -> Result<(), DeviceError> {
            *self.0.lock().unwrap() = Some(acked);
            Ok(())
        }
        fn process_queue(&mut self, _index: usize) {}
        fn reset(&mut self) {}
    }

    /// Features written after FEATURES_OK (which checked the ones written before) never
    /// reach the device: it gets what was checked.
    #[test]
    fn features_written_after_features_ok_are_ignored() {
        let acked = Arc::new(Mutex::new(None));
        let mut d = Driver::new(Box::new(Recorder(acked.clone())), 0);
        d.init(&[0]);
        assert_eq!(*acked.lock().unwrap(), Some(VIRTIO_F_VERSION_1));
        // Again, from a reset, with a feature the device never offered written late.
        d.write_reg(0x70, 0);
        *acked.lock().unwrap() = None;
        d.write_reg(0x70, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        d.write_reg(0x24, 1);
        d.write_reg(0x20, 1); // VERSION_1 (bit 32)
        let ok = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK;
        d.write_reg(0x70, ok);
        assert_eq!(d.read_reg(0x70) & STATUS_FEATURES_OK, STATUS_FEATURES_OK);
        d.write_reg(0x24, 0);
        d.write_reg(0x20, 1 << 29); // EVENT_IDX, not offered
        d.write_reg(0x30, 0);
        d.write_reg(0x38, 16);
        d.write_reg(0x80, 0x1_0000);
        d.write_reg(0x90, 0x1_1000);
        d.write_reg(0xa0, 0x1_2000);
        d.write_reg(0x44, 1);
        d.write_reg(0x70, ok | STATUS_DRIVER_OK);
        assert_eq!(*acked.lock().unwrap(), Some(VIRTIO_F_VERSION_1));
    }
}
