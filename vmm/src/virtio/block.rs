//! virtio-blk over a raw image file: read-only or read-write, flush, and a serial id.
//!
//! Requests are served synchronously when the driver notifies the queue.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;

use super::{read_config_bytes, DeviceError, Interrupt, VirtioDevice};

pub const VIRTIO_ID_BLOCK: u32 = 2;
const SECTOR_SIZE: u64 = 512;
const QUEUE_SIZE: u16 = 256;
const VIRTIO_BLK_F_RO: u64 = 1 << 5;
const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;
const VIRTIO_BLK_T_IN: u32 = 0;
const VIRTIO_BLK_T_OUT: u32 = 1;
const VIRTIO_BLK_T_FLUSH: u32 = 4;
const VIRTIO_BLK_T_GET_ID: u32 = 8;
const VIRTIO_BLK_S_OK: u8 = 0;
const VIRTIO_BLK_S_IOERR: u8 = 1;
const VIRTIO_BLK_S_UNSUPP: u8 = 2;
/// Largest piece of a request copied at once.
const CHUNK: usize = 128 * 1024;
/// Length of the serial id (`VIRTIO_BLK_ID_BYTES`).
pub const ID_BYTES: usize = 20;

/// Errors opening a disk image or using a disk slot.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("disk image {path}: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("no spare disk slot {slot} (the VM has {count})")]
    NoSlot { slot: usize, count: usize },
}

/// What a block device serves: an image file (or nothing: an empty slot), its size and serial.
struct Backing {
    file: Option<File>,
    read_only: bool,
    sectors: u64,
    serial: [u8; ID_BYTES],
}

impl Backing {
    fn open(path: &Path, read_only: bool, serial: &str) -> Result<Self, BlockError> {
        let p = path.display().to_string();
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|source| BlockError::Open {
                path: p.clone(),
                source,
            })?;
        Self::from_file(file, &p, read_only, serial)
    }

    /// Serves an open image; `name` names it in errors. A read-write disk needs a file
    /// opened for writing.
    fn from_file(
        mut file: File,
        name: &str,
        read_only: bool,
        serial: &str,
    ) -> Result<Self, BlockError> {
        let p = name.to_string();
        // SAFETY: F_GETFL only reads the flags of an fd `file` owns.
        let flags = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), libc::F_GETFL) };
        let mode = flags & libc::O_ACCMODE;
        if flags < 0 || mode == libc::O_WRONLY || (!read_only && mode != libc::O_RDWR) {
            return Err(BlockError::Open {
                path: p,
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    if read_only {
                        "the image is not open for reading"
                    } else {
                        "a read-write disk needs its image open for reading and writing"
                    },
                ),
            });
        }
        let len = file
            .seek(SeekFrom::End(0))
            .map_err(|source| BlockError::Open { path: p, source })?;
        let mut id = [0u8; ID_BYTES];
        let n = serial.len().min(ID_BYTES);
        id[..n].copy_from_slice(&serial.as_bytes()[..n]);
        Ok(Backing {
            file: Some(file),
            read_only,
            sectors: len / SECTOR_SIZE,
            serial: id,
        })
    }

    fn empty() -> Self {
        Backing {
            file: None,
            read_only: false,
            sectors: 0,
            serial: [0u8; ID_BYTES],
        }
    }
}

/// The part of a block device that a [`DiskSlot`] may change while the guest runs; requests
/// are served under the same lock, so a swap never lands in the middle of one.
struct Shared {
    backing: Backing,
    generation: u32,
    interrupt: Option<Arc<Interrupt>>,
}

/// A virtio block device.
pub struct Block {
    shared: Arc<Mutex<Shared>>,
    /// Offer VIRTIO_BLK_F_RO (fixed at build time: features are negotiated once).
    offer_ro: bool,
    queue_sizes: [u16; 1],
    active: Option<(GuestMemoryMmap, Queue)>,
}

/// A handle on a block device that swaps its image while the guest runs (hotplug of a disk
/// into a spare slot): the guest learns of it through a configuration-change interrupt.
#[derive(Clone)]
pub struct DiskSlot {
    shared: Arc<Mutex<Shared>>,
}

impl DiskSlot {
    /// Serves `path` from now on. The image is opened first: on error the slot is unchanged.
    /// A read-only attachment fails guest writes with an I/O error (the RO feature bit cannot
    /// change after the driver negotiated features).
    pub fn attach(&self, path: &Path, read_only: bool, serial: &str) -> Result<(), BlockError> {
        let b = Backing::open(path, read_only, serial)?;
        self.swap(b);
        Ok(())
    }

    /// [`DiskSlot::attach`] for an image the caller opened; `name` names it in errors.
    pub fn attach_file(
        &self,
        file: File,
        name: &str,
        read_only: bool,
        serial: &str,
    ) -> Result<(), BlockError> {
        let b = Backing::from_file(file, name, read_only, serial)?;
        self.swap(b);
        Ok(())
    }

    /// Empties the slot: 0 sectors, serial "".
    pub fn detach(&self) {
        self.swap(Backing::empty());
    }

    /// The slot's size in 512-byte sectors and its serial.
    pub fn info(&self) -> (u64, String) {
        let g = lock(&self.shared);
        let end = g
            .backing
            .serial
            .iter()
            .position(|b| *b == 0)
            .unwrap_or(ID_BYTES);
        (
            g.backing.sectors,
            String::from_utf8_lossy(&g.backing.serial[..end]).into_owned(),
        )
    }

    fn swap(&self, b: Backing) {
        let mut g = lock(&self.shared);
        tracing::debug!(sectors = b.sectors, "virtio-blk: slot backing swapped");
        g.backing = b;
        g.generation = g.generation.wrapping_add(1);
        if let Some(i) = &g.interrupt {
            i.signal_config();
        }
    }
}

fn lock(m: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Block {
    /// Opens `path` (read-only or read-write); `serial` is cut to 20 bytes.
    pub fn new(path: &Path, read_only: bool, serial: &str) -> Result<Self, BlockError> {
        Ok(Self::with_backing(
            Backing::open(path, read_only, serial)?,
            read_only,
        ))
    }

    /// An empty device (0 sectors, serial ""), to be given an image through its [`DiskSlot`].
    pub fn empty() -> Self {
        Self::with_backing(Backing::empty(), false)
    }

    fn with_backing(backing: Backing, offer_ro: bool) -> Self {
        Block {
            shared: Arc::new(Mutex::new(Shared {
                backing,
                generation: 0,
                interrupt: None,
            })),
            offer_ro,
            queue_sizes: [QUEUE_SIZE],
            active: None,
        }
    }

    /// A handle that swaps this device's image while the guest runs.
    pub fn slot(&self) -> DiskSlot {
        DiskSlot {
            shared: self.shared.clone(),
        }
    }

    /// Serves one request chain; returns the number of bytes written to the driver.
    fn handle(
        backing: &mut Backing,
        mem: &GuestMemoryMmap,
        chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>,
    ) -> Result<u32, DeviceError> {
        let Backing {
            file,
            read_only,
            sectors,
            serial,
        } = backing;
        let (read_only, sectors) = (*read_only, *sectors);
        let mut reader = chain.clone().reader(mem).map_err(DeviceError::Queue)?;
        let mut writer = chain.writer(mem).map_err(DeviceError::Queue)?;
        let typ: u32 = reader.read_obj()?;
        let _reserved: u32 = reader.read_obj()?;
        let sector: u64 = reader.read_obj()?;
        // The last writable byte is the status; data buffers come before it.
        let data_len = writer.available_bytes().saturating_sub(1);
        let mut status_w = writer.split_at(data_len).map_err(DeviceError::Queue)?;
        let in_range = |len: u64| {
            sector
                .checked_mul(SECTOR_SIZE)
                .zip(Some(len))
                .is_some_and(|(o, l)| o.checked_add(l).is_some_and(|e| e <= sectors * SECTOR_SIZE))
        };
        let (status, written) = match typ {
            VIRTIO_BLK_T_IN => {
                if !in_range(data_len as u64) {
                    (VIRTIO_BLK_S_IOERR, 0)
                } else {
                    // In bounded chunks: the request size is the guest's to choose.
                    let mut buf = vec![0u8; CHUNK.min(data_len)];
                    let mut done = 0usize;
                    let mut status = VIRTIO_BLK_S_OK;
                    while done < data_len {
                        let n = buf.len().min(data_len - done);
                        let Some(f) = file.as_ref() else {
                            status = VIRTIO_BLK_S_IOERR;
                            break;
                        };
                        if f.read_exact_at(&mut buf[..n], sector * SECTOR_SIZE + done as u64)
                            .is_err()
                        {
                            status = VIRTIO_BLK_S_IOERR;
                            break;
                        }
                        writer.write_all(&buf[..n])?;
                        done += n;
                    }
                    // done <= data_len, which only a chain of overlapping descriptors can
                    // push past 4 GiB: the used length then saturates.
                    (status, u32::try_from(done).unwrap_or(u32::MAX))
                }
            }
            VIRTIO_BLK_T_OUT => {
                let len = reader.available_bytes();
                if read_only || file.is_none() || !in_range(len as u64) {
                    (VIRTIO_BLK_S_IOERR, 0)
                } else {
                    let mut buf = vec![0u8; CHUNK.min(len)];
                    let mut done = 0usize;
                    let mut status = VIRTIO_BLK_S_OK;
                    while done < len {
                        let n = buf.len().min(len - done);
                        reader.read_exact(&mut buf[..n])?;
                        let Some(f) = file.as_ref() else {
                            status = VIRTIO_BLK_S_IOERR;
                            break;
                        };
                        if f.write_all_at(&buf[..n], sector * SECTOR_SIZE + done as u64)
                            .is_err()
                        {
                            status = VIRTIO_BLK_S_IOERR;
                            break;
                        }
                        done += n;
                    }
                    (status, 0)
                }
            }
            VIRTIO_BLK_T_FLUSH => match file.as_ref().map(File::sync_all) {
                Some(Ok(())) | None => (VIRTIO_BLK_S_OK, 0),
                Some(Err(_)) => (VIRTIO_BLK_S_IOERR, 0),
            },
            // n <= ID_BYTES (20).
            #[allow(clippy::cast_possible_truncation)]
            VIRTIO_BLK_T_GET_ID => {
                let n = data_len.min(ID_BYTES);
                writer.write_all(&serial[..n])?;
                (VIRTIO_BLK_S_OK, n as u32)
            }
            _ => (VIRTIO_BLK_S_UNSUPP, 0),
        };
        status_w.write_all(&[status])?;
        Ok(written.saturating_add(1))
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn features(&self) -> u64 {
        VIRTIO_BLK_F_FLUSH | if self.offer_ro { VIRTIO_BLK_F_RO } else { 0 }
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let sectors = lock(&self.shared).backing.sectors;
        read_config_bytes(&sectors.to_le_bytes(), offset, data);
    }

    fn config_generation(&self) -> u32 {
        lock(&self.shared).generation
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        mut queues: Vec<Queue>,
        _acked: u64,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), DeviceError> {
        let q = queues.pop().ok_or(DeviceError::BadQueue(0))?;
        lock(&self.shared).interrupt = Some(interrupt);
        self.active = Some((mem, q));
        Ok(())
    }

    fn process_queue(&mut self, _index: usize) {
        let Some((mem, queue)) = self.active.as_mut() else {
            return;
        };
        let mut shared = lock(&self.shared);
        let mut used = false;
        while let Some(chain) = queue.pop_descriptor_chain(&*mem) {
            let head = chain.head_index();
            let len = match Self::handle(&mut shared.backing, mem, chain) {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!("virtio-blk: bad request: {e}");
                    0
                }
            };
            if let Err(e) = queue.add_used(&*mem, head, len) {
                tracing::warn!("virtio-blk: add_used: {e}");
            }
            used = true;
        }
        if used && queue.needs_notification(&*mem).unwrap_or(true) {
            if let Some(i) = &shared.interrupt {
                i.signal_used();
            }
        }
    }

    fn reset(&mut self) {
        self.active = None;
        lock(&self.shared).interrupt = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::testing::{Driver, F_READ, F_WRITE};
    use crate::virtio::INT_CONFIG;

    fn disk(bytes: usize) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        // Each sector's bytes are its number, wrapping at 256: truncation intended.
        #[allow(clippy::cast_possible_truncation)]
        let data: Vec<u8> = (0..bytes).map(|i| (i / 512) as u8).collect();
        std::fs::write(f.path(), data).unwrap();
        f
    }

    fn header(t: u32, sector: u64) -> Vec<u8> {
        let mut h = Vec::new();
        h.extend_from_slice(&t.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&sector.to_le_bytes());
        h
    }

    #[test]
    fn read_write_flush_id_through_the_queue() {
        let f = disk(8 * 512);
        let dev = Block::new(f.path(), false, "vessel-disk-0").unwrap();
        let mut d = Driver::new(Box::new(dev), 0);
        assert_eq!(d.read_reg(0x08), VIRTIO_ID_BLOCK);
        assert_eq!(d.read_config_u64(0), 8);
        assert_eq!(d.device_features() & VIRTIO_BLK_F_RO, 0);
        d.init(&[0]);

        // Read sector 3.
        let hdr = d.buf(&header(VIRTIO_BLK_T_IN, 3));
        let data = d.buf(&[0u8; 512]);
        let st = d.buf(&[0xff]);
        d.submit(
            0,
            &[(hdr, 16, F_READ), (data, 512, F_WRITE), (st, 1, F_WRITE)],
        );
        assert_eq!(d.used(0), vec![513]);
        assert_eq!(d.read(st, 1), vec![VIRTIO_BLK_S_OK]);
        assert!(d.read(data, 512).iter().all(|b| *b == 3));
        assert!(d.take_interrupt());

        // Write sector 5, flush, then the file has it.
        let hdr = d.buf(&header(VIRTIO_BLK_T_OUT, 5));
        let data = d.buf(&[0xabu8; 512]);
        let st = d.buf(&[0xff]);
        d.submit(
            0,
            &[(hdr, 16, F_READ), (data, 512, F_READ), (st, 1, F_WRITE)],
        );
        assert_eq!(d.read(st, 1), vec![VIRTIO_BLK_S_OK]);
        let hdr = d.buf(&header(VIRTIO_BLK_T_FLUSH, 0));
        let st = d.buf(&[0xff]);
        d.submit(0, &[(hdr, 16, F_READ), (st, 1, F_WRITE)]);
        assert_eq!(d.read(st, 1), vec![VIRTIO_BLK_S_OK]);
        let on_disk = std::fs::read(f.path()).unwrap();
        assert!(on_disk[5 * 512..6 * 512].iter().all(|b| *b == 0xab));

        // Serial id.
        let hdr = d.buf(&header(VIRTIO_BLK_T_GET_ID, 0));
        let id = d.buf(&[0u8; 20]);
        let st = d.buf(&[0xff]);
        d.submit(0, &[(hdr, 16, F_READ), (id, 20, F_WRITE), (st, 1, F_WRITE)]);
        assert_eq!(&d.read(id, 13), b"vessel-disk-0");

        // Out of range and unsupported requests fail cleanly.
        let hdr = d.buf(&header(VIRTIO_BLK_T_IN, 8));
        let data = d.buf(&[0u8; 512]);
        let st = d.buf(&[0xff]);
        d.submit(
            0,
            &[(hdr, 16, F_READ), (data, 512, F_WRITE), (st, 1, F_WRITE)],
        );
        assert_eq!(d.read(st, 1), vec![VIRTIO_BLK_S_IOERR]);
        let hdr = d.buf(&header(99, 0));
        let st = d.buf(&[0xff]);
        d.submit(0, &[(hdr, 16, F_READ), (st, 1, F_WRITE)]);
        assert_eq!(d.read(st, 1), vec![VIRTIO_BLK_S_UNSUPP]);
    }

    #[test]
    fn large_requests_over_several_buffers() {
        let f = disk(1024 * 512);
        let dev = Block::new(f.path(), false, "big").unwrap();
        let mut d = Driver::new(Box::new(dev), 0);
        d.init(&[0]);
        // 300 KiB write from three buffers, then read it back into two.
        let pattern: Vec<u8> = (0..300 * 1024).map(|i| (i % 251) as u8).collect();
        let hdr = d.buf(&header(VIRTIO_BLK_T_OUT, 10));
        let a = d.buf(&pattern[..100 * 1024]);
        let b = d.buf(&pattern[100 * 1024..250 * 1024]);
        let c = d.buf(&pattern[250 * 1024..]);
        let st = d.buf(&[0xff]);
        d.submit(
            0,
            &[
                (hdr, 16, F_READ),
                (a, 100 * 1024, F_READ),
                (b, 150 * 1024, F_READ),
                (c, 50 * 1024, F_READ),
                (st, 1, F_WRITE),
            ],
        );
        assert_eq!(d.read(st, 1), vec![VIRTIO_BLK_S_OK]);
        let hdr = d.buf(&header(VIRTIO_BLK_T_IN, 10));
        let x = d.buf(&vec![0u8; 200 * 1024]);
        let y = d.buf(&vec![0u8; 100 * 1024]);
        let st = d.buf(&[0xff]);
        d.submit(
            0,
            &[
                (hdr, 16, F_READ),
                (x, 200 * 1024, F_WRITE),
                (y, 100 * 1024, F_WRITE),
                (st, 1, F_WRITE),
            ],
        );
        assert_eq!(d.read(st, 1), vec![VIRTIO_BLK_S_OK]);
        let mut back = d.read(x, 200 * 1024);
        back.extend(d.read(y, 100 * 1024));
        assert!(back == pattern, "data read back differs");
        assert_eq!(d.used(0), vec![1, 300 * 1024 + 1]);
    }

    #[test]
    fn read_only_disk_refuses_writes() {
        let f = disk(4 * 512);
        let dev = Block::new(f.path(), true, "ro").unwrap();
        let mut d = Driver::new(Box::new(dev), 0);
        assert_ne!(d.device_features() & VIRTIO_BLK_F_RO, 0);
        d.init(&[0]);
        let hdr = d.buf(&header(VIRTIO_BLK_T_OUT, 1));
        let data = d.buf(&[0x11u8; 512]);
        let st = d.buf(&[0xff]);
        d.submit(
            0,
            &[(hdr, 16, F_READ), (data, 512, F_READ), (st, 1, F_WRITE)],
        );
        assert_eq!(d.read(st, 1), vec![VIRTIO_BLK_S_IOERR]);
        assert!(std::fs::read(f.path()).unwrap()[512..1024]
            .iter()
            .all(|b| *b == 1));
    }

    /// A sector whose byte offset fits in 64 bits but whose end does not is past the disk:
    /// an I/O error, not an overflow (a panic of the vCPU thread with overflow checks on,
    /// a wrapped range check without).
    #[test]
    fn a_sector_at_the_end_of_the_u64_range_is_an_io_error() {
        let f = disk(4 * 512);
        let dev = Block::new(f.path(), false, "big").unwrap();
        let mut d = Driver::new(Box::new(dev), 0);
        d.init(&[0]);
        for sector in [u64::MAX / 512, u64::MAX / 512 - 1, 4, u64::MAX] {
            assert_eq!(
                read_sector(&mut d, sector).0,
                VIRTIO_BLK_S_IOERR,
                "{sector}"
            );
        }
        assert_eq!(read_sector(&mut d, 3).0, VIRTIO_BLK_S_OK);
    }

    #[test]
    fn missing_image_is_a_clear_error() {
        let e = Block::new(Path::new("/nonexistent/disk.img"), true, "x")
            .err()
            .unwrap();
        assert!(e.to_string().contains("/nonexistent/disk.img"), "{e}");
    }

    fn read_sector(d: &mut Driver, sector: u64) -> (u8, Vec<u8>) {
        let hdr = d.buf(&header(VIRTIO_BLK_T_IN, sector));
        let data = d.buf(&[0u8; 512]);
        let st = d.buf(&[0xff]);
        d.submit(
            0,
            &[(hdr, 16, F_READ), (data, 512, F_WRITE), (st, 1, F_WRITE)],
        );
        (d.read(st, 1)[0], d.read(data, 512))
    }

    fn get_id(d: &mut Driver) -> Vec<u8> {
        let hdr = d.buf(&header(VIRTIO_BLK_T_GET_ID, 0));
        let id = d.buf(&[0xeeu8; 20]);
        let st = d.buf(&[0xff]);
        d.submit(0, &[(hdr, 16, F_READ), (id, 20, F_WRITE), (st, 1, F_WRITE)]);
        assert_eq!(d.read(st, 1), vec![VIRTIO_BLK_S_OK]);
        d.read(id, 20)
    }

    #[test]
    fn spare_slot_attach_detach_while_running() {
        let dev = Block::empty();
        let slot = dev.slot();
        let mut d = Driver::new(Box::new(dev), 0);
        assert_eq!(d.read_config_u64(0), 0);
        d.init(&[0]);
        assert_eq!(get_id(&mut d), vec![0u8; 20]);
        // Empty: reads fail, writes fail, flush is harmless.
        assert_eq!(read_sector(&mut d, 0).0, VIRTIO_BLK_S_IOERR);
        let hdr = d.buf(&header(VIRTIO_BLK_T_OUT, 0));
        let data = d.buf(&[1u8; 512]);
        let st = d.buf(&[0xff]);
        d.submit(
            0,
            &[(hdr, 16, F_READ), (data, 512, F_READ), (st, 1, F_WRITE)],
        );
        assert_eq!(d.read(st, 1), vec![VIRTIO_BLK_S_IOERR]);
        d.take_interrupt();
        let gen0 = d.read_reg(0xfc);

        // A bad path leaves the slot as it was, with no interrupt.
        assert!(slot
            .attach(Path::new("/nonexistent/x.img"), true, "bad")
            .is_err());
        assert_eq!(d.read_reg(0x60) & INT_CONFIG, 0);
        assert_eq!(d.read_reg(0xfc), gen0);

        // Attach: config-change interrupt, new generation, capacity, serial, data.
        let a = disk(8 * 512);
        slot.attach(a.path(), true, "layer-a").unwrap();
        assert_ne!(d.read_reg(0x60) & INT_CONFIG, 0);
        assert!(d.t.interrupt().evt.read().is_ok());
        d.write_reg(0x64, INT_CONFIG);
        assert_ne!(d.read_reg(0xfc), gen0);
        assert_eq!(d.read_config_u64(0), 8);
        assert_eq!(slot.info(), (8, "layer-a".to_string()));
        assert_eq!(&get_id(&mut d)[..8], b"layer-a\0");
        let (st, data) = read_sector(&mut d, 6);
        assert_eq!(st, VIRTIO_BLK_S_OK);
        assert!(data.iter().all(|b| *b == 6));
        // Read-only attachment: writes fail and the file is untouched.
        let hdr = d.buf(&header(VIRTIO_BLK_T_OUT, 1));
        let data = d.buf(&[0x55u8; 512]);
        let st = d.buf(&[0xff]);
        d.submit(
            0,
            &[(hdr, 16, F_READ), (data, 512, F_READ), (st, 1, F_WRITE)],
        );
        assert_eq!(d.read(st, 1), vec![VIRTIO_BLK_S_IOERR]);
        assert!(std::fs::read(a.path()).unwrap()[512..1024]
            .iter()
            .all(|b| *b == 1));

        // Detach: empty again, with another config interrupt.
        let gen1 = d.read_reg(0xfc);
        slot.detach();
        assert_ne!(d.read_reg(0x60) & INT_CONFIG, 0);
        d.write_reg(0x64, INT_CONFIG);
        assert_ne!(d.read_reg(0xfc), gen1);
        assert_eq!(d.read_config_u64(0), 0);
        assert_eq!(get_id(&mut d), vec![0u8; 20]);
        assert_eq!(read_sector(&mut d, 0).0, VIRTIO_BLK_S_IOERR);

        // Another image in the same slot, read-write this time.
        let b = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(b.path(), vec![0x77u8; 4 * 512]).unwrap();
        slot.attach(b.path(), false, "layer-b").unwrap();
        assert_eq!(d.read_config_u64(0), 4);
        assert_eq!(&get_id(&mut d)[..7], b"layer-b");
        let (st, data) = read_sector(&mut d, 3);
        assert_eq!(st, VIRTIO_BLK_S_OK);
        assert!(data.iter().all(|b| *b == 0x77));
        let hdr = d.buf(&header(VIRTIO_BLK_T_OUT, 2));
        let data = d.buf(&[0x99u8; 512]);
        let st = d.buf(&[0xff]);
        d.submit(
            0,
            &[(hdr, 16, F_READ), (data, 512, F_READ), (st, 1, F_WRITE)],
        );
        assert_eq!(d.read(st, 1), vec![VIRTIO_BLK_S_OK]);
        assert!(std::fs::read(b.path()).unwrap()[1024..1536]
            .iter()
            .all(|b| *b == 0x99));
    }

    #[test]
    fn attach_before_the_driver_is_up_needs_no_interrupt() {
        let dev = Block::empty();
        let slot = dev.slot();
        let a = disk(2 * 512);
        slot.attach(a.path(), true, "early").unwrap();
        let mut d = Driver::new(Box::new(dev), 0);
        assert_eq!(d.read_reg(0x60), 0);
        assert_eq!(d.read_config_u64(0), 2);
        d.init(&[0]);
        assert_eq!(&get_id(&mut d)[..5], b"early");
    }
}
