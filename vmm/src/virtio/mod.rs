//! virtio over MMIO: the transport ([`mmio`]) and the devices ([`block`]).
//!
//! A device sees guest memory and its queues only after the driver set `DRIVER_OK`
//! ([`VirtioDevice::activate`]); queue notifications reach it through
//! [`VirtioDevice::process_queue`], and it raises its interrupt with [`Interrupt::signal_used`].

pub mod block;
pub mod fs;
pub mod mmio;
pub mod net;
pub mod share_fs;
#[cfg(test)]
pub(crate) mod testing;
pub mod vsock;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

/// A device's worker thread (vsock, net): woken through an eventfd when the guest or the
/// host side has news, and stopped, woken and joined when the device is dropped.
pub(crate) struct Worker {
    wake: Arc<EventFd>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Spawns `run(wake, stop)` on a thread named `name`, which first drops every
    /// capability it got from its creator (a device worker handles what the guest sends and
    /// needs none) and confines itself ([`crate::threads`]); an error there is the spawn's.
    /// `run` returns once `stop` is set.
    pub(crate) fn spawn(
        name: &str,
        run: impl FnOnce(&EventFd, &AtomicBool) + Send + 'static,
    ) -> std::io::Result<Worker> {
        let owned = name.to_string();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let mut worker = Self::spawn_privileged(name, move |wake, stop| {
            if let Err(e) = crate::caps::drop_all() {
                tracing::warn!(worker = owned, "dropping capabilities: {e}");
            }
            let confined = crate::threads::confine(crate::threads::ThreadRole::Device);
            let ok = confined.is_ok();
            let _ = ready_tx.send(confined);
            if ok {
                run(wake, stop)
            }
        })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(worker),
            Ok(Err(e)) => {
                worker.stop();
                Err(std::io::Error::other(format!("{name}: {e}")))
            }
            Err(_) => {
                worker.stop();
                Err(std::io::Error::other(format!("{name}: the thread ended")))
            }
        }
    }

    /// [`Worker::spawn`] for a worker that keeps its creator's capabilities: `run` must drop
    /// what it does not need itself (the virtio-fs server confines itself first).
    pub(crate) fn spawn_privileged(
        name: &str,
        run: impl FnOnce(&EventFd, &AtomicBool) + Send + 'static,
    ) -> std::io::Result<Worker> {
        let wake = Arc::new(EventFd::new(libc::EFD_NONBLOCK)?);
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (wake, stop) = (wake.clone(), stop.clone());
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || run(&wake, &stop))?
        };
        Ok(Worker {
            wake,
            stop,
            thread: Some(thread),
        })
    }

    /// Makes the thread look at its work now.
    pub(crate) fn wake(&self) {
        let _ = self.wake.write(1);
    }

    /// Stops the thread and waits for it (idempotent).
    pub(crate) fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// VIRTIO_F_VERSION_1: the modern (1.0+) interface, the only one we offer.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;

/// Interrupt status bit: used buffers.
pub const INT_USED_RING: u32 = 1;
/// Interrupt status bit: configuration change.
pub const INT_CONFIG: u32 = 2;

/// A device's interrupt line: the status register the driver reads, and an irqfd.
pub struct Interrupt {
    pub status: AtomicU32,
    pub evt: EventFd,
}

impl Interrupt {
    pub fn new() -> std::io::Result<Self> {
        Ok(Interrupt {
            status: AtomicU32::new(0),
            evt: EventFd::new(libc::EFD_NONBLOCK)?,
        })
    }

    /// Tells the driver it has used buffers.
    pub fn signal_used(&self) {
        self.status.fetch_or(INT_USED_RING, Ordering::SeqCst);
        if let Err(e) = self.evt.write(1) {
            tracing::warn!("virtio interrupt: {e}");
        }
    }

    /// Tells the driver the device configuration changed (it re-reads config space).
    pub fn signal_config(&self) {
        self.status.fetch_or(INT_CONFIG, Ordering::SeqCst);
        if let Err(e) = self.evt.write(1) {
            tracing::warn!("virtio interrupt: {e}");
        }
    }
}

/// Errors a device reports while activating or processing.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("queue {0} is not valid (addresses or size)")]
    BadQueue(usize),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("virtio queue: {0}")]
    Queue(#[from] virtio_queue::Error),
}

/// What a virtio device implements; the MMIO transport does the rest.
pub trait VirtioDevice: Send {
    /// The virtio device ID (2 block, 1 net, 19 vsock, 26 fs).
    fn device_type(&self) -> u32;
    /// Maximum size of each queue; the number of queues is its length.
    fn queue_max_sizes(&self) -> &[u16];
    /// Feature bits offered (VERSION_1 is added by the transport).
    fn features(&self) -> u64;
    /// Reads device configuration space at `offset`.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// The device's part of the configuration generation: a device whose configuration
    /// changes while the driver runs bumps it, so that the driver's config reads see one
    /// consistent snapshot.
    fn config_generation(&self) -> u32 {
        0
    }
    /// Writes device configuration space (most devices ignore it).
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// The driver is ready: the device gets memory, queues, negotiated features and its interrupt.
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        acked_features: u64,
        interrupt: std::sync::Arc<Interrupt>,
    ) -> Result<(), DeviceError>;
    /// The driver notified queue `index`.
    fn process_queue(&mut self, index: usize);
    /// The driver reset the device; it must drop its queues.
    fn reset(&mut self);
}

/// Copies `src` (a config space image) at `offset` into `data`; out-of-range bytes read as 0.
pub fn read_config_bytes(src: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        let at = usize::try_from(offset).ok().and_then(|o| o.checked_add(i));
        *b = at.and_then(|at| src.get(at)).copied().unwrap_or(0);
    }
}
