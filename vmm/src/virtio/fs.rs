//! virtio-fs (virtio 1.2 §5.11): a host directory shared with the guest, served in-process.
//!
//! The guest mounts it with `mount -t virtiofs <tag> <dir>`; its FUSE requests arrive on the
//! request queue (and FORGETs on the high-priority one) and are answered by
//! `fuse-backend-rs`'s passthrough filesystem rooted at the shared directory, on the device's
//! own thread (a vCPU only kicks it). Writes are on the host when the guest's write returns;
//! the guest's caches of entries and attributes expire after [`CACHE_TIMEOUT`], so changes made
//! on the host (a kubelet ConfigMap swap) show up within it.
//!
//! `fuse-backend-rs` is built on vm-memory 0.17 and virtio-queue 0.17 while the VMM uses 0.18:
//! at activation the device builds a 0.17 view of the same guest mappings (not owning them;
//! it holds the VMM's memory, which does) and 0.17 queues with the addresses the driver set.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fuse_backend_rs::abi::fuse_abi::FsOptions;
use fuse_backend_rs::api::server::Server;
use fuse_backend_rs::api::{Vfs, VfsOptions};
use fuse_backend_rs::passthrough::{CachePolicy, Config, PassthroughFs};
use fuse_backend_rs::transport::{FsCacheReqHandler, Reader, VirtioFsWriter};
use fuse_virtio_queue::QueueT as _;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use super::share_fs::ShareFs;
use super::{read_config_bytes, DeviceError, Interrupt, VirtioDevice, Worker};
use crate::caps::FILE_SERVER_CAPS;

pub const VIRTIO_ID_FS: u32 = 26;
const VIRTIO_RING_F_EVENT_IDX: u64 = 1 << 29;
const QUEUE_SIZE: u16 = 1024;
/// The high-priority queue and one request queue.
const QUEUE_SIZES: [u16; 2] = [QUEUE_SIZE, QUEUE_SIZE];
const REQUEST_QUEUES: u32 = 1;
/// `virtio_fs_config.tag` is 36 bytes, NUL-padded.
pub const TAG_LEN: usize = 36;
/// How long the guest may trust a looked-up entry or attributes without asking again.
pub const CACHE_TIMEOUT: Duration = Duration::from_secs(1);

/// Errors setting up the device.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("virtio-fs tag {0:?}: want 1 to {TAG_LEN} bytes")]
    BadTag(String),
    #[error("virtio-fs shared directory {dir}: {source}")]
    Shared { dir: String, source: std::io::Error },
}

type Fs017 = PassthroughFs<()>;
type FsServer = Server<Arc<Vfs>>;
type Mem017 = fuse_vm_memory::GuestMemoryMmap<()>;

struct Active {
    /// Keeps the mappings that `view` points into alive.
    _mem: GuestMemoryMmap,
    view: Mem017,
    queues: Vec<fuse_virtio_queue::Queue>,
    irq: Arc<Interrupt>,
}

/// A virtio-fs device sharing one host directory under one tag.
pub struct Fs {
    tag: String,
    active: Arc<Mutex<Option<Active>>>,
    worker: Worker,
}

fn lock(m: &Mutex<Option<Active>>) -> std::sync::MutexGuard<'_, Option<Active>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Fs {
    /// Shares `dir` (which must exist) as `tag`, its owners shifted by `shift` if given.
    pub fn new(
        tag: &str,
        dir: &Path,
        shift: Option<super::share_fs::IdShift>,
    ) -> Result<Self, FsError> {
        if tag.is_empty() || tag.len() > TAG_LEN || tag.contains('\0') {
            return Err(FsError::BadTag(tag.into()));
        }
        if let Some(Err(e)) = shift.map(|s| s.check()) {
            return Err(FsError::Shared {
                dir: dir.display().to_string(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
            });
        }
        let shared = |source| FsError::Shared {
            dir: dir.display().to_string(),
            source,
        };
        if dir.to_str().is_none() {
            let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not UTF-8");
            return Err(shared(e));
        }
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(shared(std::io::Error::from_raw_os_error(libc::ENOTDIR))),
            Err(e) => return Err(shared(e)),
        }
        raise_nofile_limit();
        let active: Arc<Mutex<Option<Active>>> = Arc::new(Mutex::new(None));
        // The server is built on its own thread, which it then never leaves: that thread's
        // confinement (mount namespace, root) is what the server's lookups see.
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let worker = {
            let (active, dir) = (active.clone(), dir.to_path_buf());
            Worker::spawn_privileged("virtio-fs", move |wake, stop| {
                let server = match passthrough_server(&dir, shift).and_then(|s| {
                    crate::threads::confine(crate::threads::ThreadRole::FileServer)
                        .map_err(std::io::Error::other)?;
                    Ok(s)
                }) {
                    Ok(s) => {
                        let _ = ready_tx.send(Ok(()));
                        s
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                serve(&server, &active, wake, stop)
            })
            .map_err(shared)?
        };
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(shared(e)),
            Err(_) => return Err(shared(std::io::Error::other("the server thread ended"))),
        }
        Ok(Fs {
            tag: tag.into(),
            active,
            worker,
        })
    }
}

/// The server keeps an `O_PATH` fd for each inode the guest holds (until it forgets it), so
/// a volume with many files needs many fds: the process's soft limit goes up to its hard one.
fn raise_nofile_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the rlimit we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 && lim.rlim_cur < lim.rlim_max
    {
        let want = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads the rlimit we pass.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } != 0 {
            tracing::warn!(
                "virtio-fs: raising RLIMIT_NOFILE to {}: {}",
                lim.rlim_max,
                std::io::Error::last_os_error()
            );
        }
    }
}

fn passthrough_config(root: &str) -> Config {
    Config {
        root_dir: root.into(),
        entry_timeout: CACHE_TIMEOUT,
        attr_timeout: CACHE_TIMEOUT,
        cache_policy: CachePolicy::Auto,
        // The guest is not trusted with the host's file handles.
        inode_file_handles: false,
        // Under the VFS, which negotiates the options (imported once, before mounting).
        do_import: false,
        xattr: true,
        ..Default::default()
    }
}

/// The passthrough filesystem serving `dir`, built on (and for) the calling thread, which it
/// confines to `dir` first as virtiofsd confines itself: its own mount namespace (a slave
/// copy of the host's, so that volumes mounted under `dir` on the host later still arrive)
/// whose root is `dir`, with the rest of the host's tree detached. The filesystem opens
/// `/proc/self/fd` (which it needs to reopen files) before the old root goes, and its root,
/// `/`, after. Where the thread cannot be confined (no privilege), it serves `dir` by path,
/// with a warning.
fn passthrough_server(
    dir: &Path,
    shift: Option<super::share_fs::IdShift>,
) -> std::io::Result<FsServer> {
    let (fs, proc_fd) = match enter_namespace(dir) {
        Ok(()) => {
            let fs = Fs017::new(passthrough_config("/"))?;
            // For ShareFs's xattr requests, which name inodes in it.
            let proc_fd = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
                .open("/proc/self/fd")?;
            pivot_into(dir)?;
            crate::caps::set_thread(FILE_SERVER_CAPS)?;
            tracing::debug!(dir = %dir.display(), "virtio-fs server confined to its share");
            (fs, Some(proc_fd))
        }
        Err(e) => {
            tracing::warn!(dir = %dir.display(), "virtio-fs server not confined to its share: {e}");
            (
                Fs017::new(passthrough_config(dir.to_str().unwrap_or_default()))?,
                None,
            )
        }
    };
    // Under fuse-backend-rs's VFS (the passthrough filesystem alone offers the guest 4 KiB
    // writes): 1 MiB requests (BIG_WRITES, MAX_PAGES), parallel lookups and async reads, the
    // data cache dropped when the host changes a file (AUTO_INVAL_DATA); no writeback cache
    // (the host changes files too) and no DAX. Not HANDLE_KILLPRIV_V2 (which would spare
    // the guest a `security.capability` lookup before each write): with it the guest leaves
    // clearing setuid bits to the server, and fuse-backend-rs's fallocate does not.
    let vfs = Vfs::new(VfsOptions {
        no_open: false,
        no_opendir: false,
        no_writeback: true,
        killpriv_v2: false,
        out_opts: FsOptions::ASYNC_READ
            | FsOptions::PARALLEL_DIROPS
            | FsOptions::BIG_WRITES
            | FsOptions::ASYNC_DIO
            | FsOptions::AUTO_INVAL_DATA
            | FsOptions::MAX_PAGES
            | FsOptions::ATOMIC_O_TRUNC
            | FsOptions::DO_READDIRPLUS
            | FsOptions::READDIRPLUS_AUTO,
        ..Default::default()
    });
    fs.import()?;
    vfs.mount(Box::new(ShareFs::new(fs, proc_fd, shift)), "/")
        .map_err(|e| std::io::Error::other(format!("mounting the share in the VFS: {e:?}")))?;
    Ok(Server::new(Arc::new(vfs)))
}

fn check_os(r: libc::c_int, what: &str) -> std::io::Result<()> {
    if r < 0 {
        let e = std::io::Error::last_os_error();
        Err(std::io::Error::new(e.kind(), format!("{what}: {e}")))
    } else {
        Ok(())
    }
}

/// Gives the calling thread its own mount namespace, a slave copy of the host's, with `dir`
/// bound onto itself (a mount point to pivot into).
fn enter_namespace(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let d = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: unshare affects only the calling thread's filesystem context (CLONE_FS) and its
    // mount namespace; nothing else in the process depends on either.
    let r = unsafe { libc::unshare(libc::CLONE_FS | libc::CLONE_NEWNS) };
    check_os(r, "unshare")?;
    check_os(
        // SAFETY: "/" is a NUL-terminated string, the other pointers may be null for a
        // propagation change; it changes only this thread's new namespace.
        unsafe {
            libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_SLAVE,
                std::ptr::null(),
            )
        },
        "making / a slave",
    )?;
    check_os(
        // SAFETY: `d` is a NUL-terminated string alive for the call; a bind in this thread's
        // own namespace.
        unsafe {
            libc::mount(
                d.as_ptr(),
                d.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            )
        },
        "binding the share onto itself",
    )
}

/// Makes `dir` (a mount point in the thread's own namespace) the thread's root and detaches
/// the old one.
fn pivot_into(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let d = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    let dot = c".";
    // SAFETY: `d` is a NUL-terminated string alive for the call; CLONE_FS was unshared, so
    // the working directory is this thread's own.
    check_os(unsafe { libc::chdir(d.as_ptr()) }, "chdir")?;
    // SAFETY: "." is a NUL-terminated string; pivot_root(".", ".") stacks the old root on
    // the new one, in this thread's own namespace.
    let r = unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) };
    check_os(if r < 0 { -1 } else { 0 }, "pivot_root")?;
    // SAFETY: "." is a NUL-terminated string; this detaches the old root stacked on it.
    let r = unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) };
    check_os(r, "detaching the old root")?;
    // SAFETY: "/" is a NUL-terminated string.
    check_os(unsafe { libc::chdir(c"/".as_ptr()) }, "chdir /")
}

/// A 0.17 view of the VMM's guest memory: the same host mappings, not owned.
fn memory_view(mem: &GuestMemoryMmap) -> Result<Mem017, DeviceError> {
    let mut regions = Vec::new();
    for r in mem.iter() {
        let len = usize::try_from(r.len()).map_err(|_| DeviceError::BadQueue(0))?;
        // SAFETY: `r` is a live anonymous read-write mapping of `len` bytes owned by `mem`, which
        // the device keeps (in `Active`) for as long as the view exists; a raw-pointer region
        // never unmaps what it points at.
        let m = unsafe {
            fuse_vm_memory::MmapRegion::<()>::build_raw(
                r.as_ptr(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            )
        }
        .map_err(|e| DeviceError::Io(std::io::Error::other(e.to_string())))?;
        let at = fuse_vm_memory::GuestAddress(r.start_addr().raw_value());
        regions.push(
            fuse_vm_memory::GuestRegionMmap::new(m, at)
                .ok_or_else(|| DeviceError::Io(std::io::Error::other("region overflows")))?,
        );
    }
    fuse_vm_memory::GuestMemoryMmap::from_regions(regions)
        .map_err(|e| DeviceError::Io(std::io::Error::other(e.to_string())))
}

/// A 0.17 queue with what the driver set on the transport's queue.
fn queue_view(i: usize, q: &Queue) -> Result<fuse_virtio_queue::Queue, DeviceError> {
    let bad = |_| DeviceError::BadQueue(i);
    let mut v = fuse_virtio_queue::Queue::new(q.max_size()).map_err(bad)?;
    v.set_size(q.size());
    // The low and high halves of a 64-bit guest address, as the driver wrote them.
    #[allow(clippy::cast_possible_truncation)]
    let split = |a: u64| (Some(a as u32), Some((a >> 32) as u32));
    let (lo, hi) = split(q.desc_table());
    v.set_desc_table_address(lo, hi);
    let (lo, hi) = split(q.avail_ring());
    v.set_avail_ring_address(lo, hi);
    let (lo, hi) = split(q.used_ring());
    v.set_used_ring_address(lo, hi);
    v.set_event_idx(q.event_idx_enabled());
    v.set_ready(q.ready());
    Ok(v)
}

impl VirtioDevice for Fs {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_FS
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &QUEUE_SIZES
    }

    /// VIRTIO_RING_F_EVENT_IDX: the guest does not kick while the device is still draining
    /// a queue, and the device interrupts only when the guest waits for it (each a VM exit).
    fn features(&self) -> u64 {
        VIRTIO_RING_F_EVENT_IDX
    }

    /// `virtio_fs_config`: tag[36], num_request_queues (le32).
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut config = [0u8; TAG_LEN + 4];
        config[..self.tag.len()].copy_from_slice(self.tag.as_bytes());
        config[TAG_LEN..].copy_from_slice(&REQUEST_QUEUES.to_le_bytes());
        read_config_bytes(&config, offset, data);
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        _acked: u64,
        interrupt: Arc<Interrupt>,
    ) -> Result<(), DeviceError> {
        let view = memory_view(&mem)?;
        let queues = queues
            .iter()
            .enumerate()
            .map(|(i, q)| queue_view(i, q))
            .collect::<Result<Vec<_>, _>>()?;
        if queues.len() != QUEUE_SIZES.len() || queues.iter().any(|q| !q.is_valid(&view)) {
            return Err(DeviceError::BadQueue(queues.len()));
        }
        *lock(&self.active) = Some(Active {
            _mem: mem,
            view,
            queues,
            irq: interrupt,
        });
        self.worker.wake();
        Ok(())
    }

    fn process_queue(&mut self, _index: usize) {
        self.worker.wake();
    }

    fn reset(&mut self) {
        *lock(&self.active) = None;
    }
}

/// The device thread: answers every request the guest has queued whenever it is woken.
fn serve(server: &FsServer, active: &Mutex<Option<Active>>, wake: &EventFd, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        let mut fds = [libc::pollfd {
            fd: wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: `fds` is a valid array of one pollfd that outlives the call.
        if unsafe { libc::poll(fds.as_mut_ptr(), 1, 1000) } <= 0 {
            continue;
        }
        let _ = wake.read();
        let mut g = lock(active);
        let Some(a) = g.as_mut() else {
            continue;
        };
        for q in 0..a.queues.len() {
            drain(server, a, q);
        }
    }
}

/// Handles every available chain of queue `q`, then tells the driver if it wants to know.
fn drain(server: &FsServer, a: &mut Active, q: usize) {
    let mut used = false;
    let mut looked_again = false;
    loop {
        let Some(chain) = a.queues[q].pop_descriptor_chain(&a.view) else {
            // Notifications were off while we worked; look again after turning them on,
            // once: a driver whose available index is bogus (more than a queue ahead) has
            // more to pop by that index, and nothing that can be popped.
            if looked_again {
                break;
            }
            looked_again = true;
            match a.queues[q].enable_notification(&a.view) {
                Ok(true) => continue,
                _ => break,
            }
        };
        looked_again = false;
        let head = chain.head_index();
        let len = match handle(server, &a.view, chain) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("virtio-fs: request dropped: {e}");
                0
            }
        };
        let len = u32::try_from(len).unwrap_or(0);
        if let Err(e) = a.queues[q].add_used(&a.view, head, len) {
            tracing::warn!("virtio-fs: add_used: {e}");
        }
        used = true;
    }
    if used && a.queues[q].needs_notification(&a.view).unwrap_or(true) {
        a.irq.signal_used();
    }
}

fn handle(
    server: &FsServer,
    mem: &Mem017,
    chain: fuse_virtio_queue::DescriptorChain<&Mem017>,
) -> Result<usize, String> {
    let reader = Reader::from_descriptor_chain(mem, chain.clone()).map_err(|e| e.to_string())?;
    let writer = VirtioFsWriter::new(mem, chain).map_err(|e| e.to_string())?;
    server
        .handle_message(
            reader,
            writer.into(),
            None::<&mut dyn FsCacheReqHandler>,
            None,
        )
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::testing::{Driver, F_READ, F_WRITE};
    use std::time::Instant;
    use vm_memory::{Bytes, GuestAddress};

    const REQQ: usize = 1;

    /// Sends one FUSE request (`fuse_in_header` + `body`) and returns (error, reply body).
    fn call(d: &mut Driver, unique: u64, opcode: u32, nodeid: u64, body: &[u8]) -> (i32, Vec<u8>) {
        let mut req = Vec::new();
        let len = u32::try_from(40 + body.len()).unwrap();
        req.extend(len.to_le_bytes());
        req.extend(opcode.to_le_bytes());
        req.extend(unique.to_le_bytes());
        req.extend(nodeid.to_le_bytes());
        req.extend([0u8; 16]); // uid, gid, pid, padding: root
        req.extend(body);
        let rb = d.buf(&req);
        let out = d.buf(&[0u8; 8192]);
        d.submit(REQQ, &[(rb, len, F_READ), (out, 8192, F_WRITE)]);
        let deadline = Instant::now() + Duration::from_secs(5);
        let used = loop {
            let u = d.used(REQQ);
            if !u.is_empty() || Instant::now() > deadline {
                break u;
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        assert_eq!(used.len(), 1, "one reply to opcode {opcode}");
        let reply = d.read(out, used[0] as usize);
        let olen = u32::from_le_bytes(reply[0..4].try_into().unwrap()) as usize;
        let error = i32::from_le_bytes(reply[4..8].try_into().unwrap());
        assert_eq!(u64::from_le_bytes(reply[8..16].try_into().unwrap()), unique);
        (error, reply[16..olen].to_vec())
    }

    /// A device sharing `dir`, its queues set up and a FUSE session begun (INIT 7.31, no
    /// flags).
    fn session(dir: &Path) -> Driver {
        let mut drv = Driver::new(Box::new(Fs::new("vessel", dir, None).unwrap()), 0);
        drv.init(&[0, 1]);
        let mut init = Vec::new();
        for v in [7u32, 31, 1 << 20, 0] {
            init.extend(v.to_le_bytes());
        }
        assert_eq!(call(&mut drv, 1, 26, 0, &init).0, 0);
        drv
    }

    /// A driver whose available index runs more than a queue ahead of the device (nothing
    /// can be popped, while the index says there is more) neither spins the device's
    /// worker nor holds up a reset and the device's end: before, the worker looped for good
    /// holding the device, and the reset (a vCPU) and the drop (the VMM's teardown) hung.
    #[test]
    fn a_bogus_available_index_does_not_hang_the_device() {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let d = tempfile::tempdir().unwrap();
            let mut drv = session(d.path());
            // Queue 1's available ring is at 0x2_1000; its index at +2.
            drv.mem
                .write_obj(0x2000u16, GuestAddress(0x2_1002))
                .unwrap();
            drv.notify(1);
            std::thread::sleep(Duration::from_millis(200));
            drv.write_reg(0x70, 0);
            drop(drv);
            tx.send(()).unwrap();
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the reset and the drop returned");
    }

    fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }

    #[test]
    fn the_guest_reads_and_writes_host_files_through_the_queue() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("hello"), b"from the host").unwrap();
        let mut drv = Driver::new(Box::new(Fs::new("vessel", d.path(), None).unwrap()), 0);
        assert_eq!(drv.read_reg(0x08), VIRTIO_ID_FS);
        drv.init(&[0, 1]);

        // INIT: major 7, minor 31, max_readahead, flags (BIG_WRITES, MAX_PAGES): the guest
        // may write 1 MiB per request.
        let mut init = Vec::new();
        for v in [7u32, 31, 1 << 20, (1 << 5) | (1 << 22)] {
            init.extend(v.to_le_bytes());
        }
        let (e, out) = call(&mut drv, 1, 26, 0, &init);
        assert_eq!(e, 0);
        assert_eq!(u32::from_le_bytes(out[0..4].try_into().unwrap()), 7);
        assert_eq!(
            u32::from_le_bytes(out[20..24].try_into().unwrap()),
            1 << 20,
            "max_write"
        );

        // LOOKUP "hello" in the root (nodeid 1): fuse_entry_out.nodeid, attr.size.
        let (e, out) = call(&mut drv, 2, 1, 1, b"hello\0");
        assert_eq!(e, 0);
        let node = u64_at(&out, 0);
        assert_eq!(u64_at(&out, 40 + 8), 13, "attr.size");
        let (e, _) = call(&mut drv, 3, 1, 1, b"absent\0");
        assert_eq!(e, -libc::ENOENT);

        // OPEN read-write, READ, WRITE at the end: the host sees the write at once.
        let (e, out) = call(&mut drv, 4, 14, node, &[2u8, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(e, 0);
        let fh = u64_at(&out, 0);
        let mut read = Vec::new();
        read.extend(fh.to_le_bytes());
        read.extend(0u64.to_le_bytes());
        read.extend(100u32.to_le_bytes());
        read.extend([0u8; 20]);
        let (e, out) = call(&mut drv, 5, 15, node, &read);
        assert_eq!((e, out.as_slice()), (0, b"from the host".as_slice()));
        let mut write = Vec::new();
        write.extend(fh.to_le_bytes());
        write.extend(13u64.to_le_bytes());
        write.extend(10u32.to_le_bytes());
        write.extend([0u8; 20]); // write_flags, lock_owner, flags, padding
        write.extend(b", and back");
        let (e, out) = call(&mut drv, 6, 16, node, &write);
        assert_eq!(
            (e, u32::from_le_bytes(out[0..4].try_into().unwrap())),
            (0, 10)
        );
        assert_eq!(
            std::fs::read(d.path().join("hello")).unwrap(),
            b"from the host, and back"
        );
    }

    #[test]
    fn the_server_cannot_reach_beyond_its_share() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            println!("SKIP the_server_cannot_reach_beyond_its_share: confining needs root");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("outside"), b"host secret").unwrap();
        let share = d.path().join("share");
        std::fs::create_dir(&share).unwrap();
        let mut drv = session(&share);
        // The server's thread: the one whose root holds this share's marker.
        std::fs::write(share.join("marker"), b"").unwrap();
        let me = std::fs::read_link("/proc/self/ns/mnt").unwrap();
        let ours: Vec<_> = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .flatten()
            .map(|t| t.path())
            .filter(|t| {
                std::fs::read_to_string(t.join("comm")).is_ok_and(|c| c.trim() == "virtio-fs")
                    && t.join("root/marker").exists()
            })
            .collect();
        assert_eq!(ours.len(), 1, "the server thread is found by its root");
        let t = &ours[0];
        assert!(
            !t.join("root/outside").exists(),
            "the server sees beside its share"
        );
        assert!(!t.join("root/share").exists());
        assert_ne!(std::fs::read_link(t.join("ns/mnt")).unwrap(), me);
        let status = std::fs::read_to_string(t.join("status")).unwrap();
        let cap = |k: &str| {
            let v = status.lines().find_map(|l| l.strip_prefix(k)).unwrap();
            u64::from_str_radix(v.trim(), 16).unwrap()
        };
        assert_eq!(cap("CapEff:"), u64::from(FILE_SERVER_CAPS));
        assert_eq!(cap("CapPrm:"), u64::from(FILE_SERVER_CAPS));
        // And it serves on from there.
        let (e, _) = call(&mut drv, 2, 1, 1, b"marker\0");
        assert_eq!(e, 0);
    }

    /// Extended attributes through a confined server (whose root has no `/proc`): a host
    /// file's attribute reads and lists, the guest sets and removes one, a missing
    /// `security.capability` (which execve asks for) is ENODATA, not ENOENT, and a file
    /// whose name is gone is not mistaken for another.
    #[test]
    fn xattrs_work_in_a_confined_server() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            println!("SKIP xattrs_work_in_a_confined_server: confining needs root");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("prog");
        std::fs::write(&file, b"#!").unwrap();
        let path = std::ffi::CString::new(file.to_str().unwrap()).unwrap();
        let value = b"from the host";
        // SAFETY: NUL-terminated strings and a slice alive for the call.
        let r = unsafe {
            libc::setxattr(
                path.as_ptr(),
                c"user.vessel".as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if r != 0 {
            println!(
                "SKIP xattrs_work_in_a_confined_server: {} has no user xattrs: {}",
                d.path().display(),
                std::io::Error::last_os_error()
            );
            return;
        }
        let mut drv = session(d.path());
        let (e, out) = call(&mut drv, 2, 1, 1, b"prog\0");
        assert_eq!(e, 0);
        let node = u64_at(&out, 0);
        // fuse_getxattr_in: size, padding; then the name. Opcodes: SETXATTR 21, GETXATTR 22,
        // LISTXATTR 23, REMOVEXATTR 24.
        let get = |size: u32, name: &[u8]| {
            let mut b = Vec::new();
            b.extend(size.to_le_bytes());
            b.extend(0u32.to_le_bytes());
            b.extend(name);
            b
        };
        let (e, out) = call(&mut drv, 3, 22, node, &get(64, b"user.vessel\0"));
        assert_eq!((e, out.as_slice()), (0, value.as_slice()));
        let (e, out) = call(&mut drv, 4, 22, node, &get(0, b"user.vessel\0"));
        assert_eq!(
            (e, u32::from_le_bytes(out[0..4].try_into().unwrap())),
            (0, 13)
        );
        let (e, _) = call(&mut drv, 5, 22, node, &get(64, b"security.capability\0"));
        assert_eq!(e, -libc::ENODATA, "the attribute execve asks for");
        let (e, out) = call(&mut drv, 6, 23, node, &get(256, b""));
        assert_eq!(e, 0);
        assert!(
            out.split(|b| *b == 0).any(|n| n == b"user.vessel"),
            "{out:?}"
        );
        // fuse_setxattr_in: size, flags; the name, then the value.
        let mut set = Vec::new();
        set.extend(5u32.to_le_bytes());
        set.extend(0u32.to_le_bytes());
        set.extend(b"user.guest\0hello");
        assert_eq!(call(&mut drv, 7, 21, node, &set).0, 0);
        let mut buf = [0u8; 16];
        // SAFETY: NUL-terminated strings and a buffer alive for the call.
        let n = unsafe {
            libc::getxattr(
                path.as_ptr(),
                c"user.guest".as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        assert_eq!(
            &buf[..usize::try_from(n).unwrap()],
            b"hello",
            "set on the host"
        );
        assert_eq!(call(&mut drv, 8, 24, node, b"user.guest\0").0, 0);
        let (e, _) = call(&mut drv, 9, 22, node, &get(64, b"user.guest\0"));
        assert_eq!(e, -libc::ENODATA);
        // The share's root too (its path is "/").
        let (e, _) = call(&mut drv, 10, 23, 1, &get(256, b""));
        assert_eq!(e, 0);
        // A file whose name is gone: its path reads "/gone (deleted)", and a decoy of that
        // name is not asked in its place.
        std::fs::write(d.path().join("gone"), b"").unwrap();
        let (e, out) = call(&mut drv, 11, 1, 1, b"gone\0");
        assert_eq!(e, 0);
        let gone = u64_at(&out, 0);
        std::fs::remove_file(d.path().join("gone")).unwrap();
        let decoy = d.path().join("gone (deleted)");
        std::fs::write(&decoy, b"").unwrap();
        let decoy = std::ffi::CString::new(decoy.to_str().unwrap()).unwrap();
        // SAFETY: NUL-terminated strings and a slice alive for the call.
        let r = unsafe {
            libc::setxattr(
                decoy.as_ptr(),
                c"user.vessel".as_ptr(),
                b"decoy".as_ptr().cast(),
                5,
                0,
            )
        };
        assert_eq!(r, 0);
        let (e, _) = call(&mut drv, 12, 22, gone, &get(64, b"user.vessel\0"));
        assert_eq!(e, -libc::ENOENT);
    }

    #[test]
    fn bad_tags_and_missing_dirs_are_clear_errors() {
        let d = tempfile::tempdir().unwrap();
        assert!(matches!(
            Fs::new("", d.path(), None),
            Err(FsError::BadTag(_))
        ));
        let long = "x".repeat(TAG_LEN + 1);
        assert!(matches!(
            Fs::new(&long, d.path(), None),
            Err(FsError::BadTag(_))
        ));
        let e = Fs::new("vol", &d.path().join("absent"), None)
            .err()
            .unwrap();
        assert!(e.to_string().contains("absent"), "{e}");
    }

    #[test]
    fn config_space_carries_the_tag_and_one_request_queue() {
        let d = tempfile::tempdir().unwrap();
        let fs = Fs::new("vessel", d.path(), None).unwrap();
        let mut cfg = [0u8; TAG_LEN + 4];
        fs.read_config(0, &mut cfg);
        assert_eq!(&cfg[..6], b"vessel");
        assert!(cfg[6..TAG_LEN].iter().all(|b| *b == 0));
        assert_eq!(u32::from_le_bytes(cfg[TAG_LEN..].try_into().unwrap()), 1);
        assert_eq!(fs.device_type(), VIRTIO_ID_FS);
    }
}
