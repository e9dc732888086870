//! A microVM: guest memory, vCPU threads, the in-kernel irqchip and PIT, legacy devices, and
//! the outcome the guest ended with.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::thread::JoinHandleExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::devices::legacy::{ConsoleSink, PioBus, SERIAL_IRQ};
use crate::virtio::block::{Block, BlockError, DiskSlot};
use crate::virtio::fs::Fs;
use crate::virtio::mmio::{MmioBus, MmioTransport, MMIO_WINDOW};
use crate::virtio::net::{self, Net};
use crate::virtio::vsock::Vsock;
use crate::virtio::VirtioDevice;
use crate::{arch, boot, mptable};

pub use crate::run_state::{Control, Outcome};

/// How large a console file grows before it becomes `<path>.1` and a new one starts.
pub const CONSOLE_MAX: u64 = 1 << 20;

/// A console log file kept bounded: past `max` bytes it is renamed to `<path>.1` (replacing
/// the previous one) and a new file starts, so a chatty guest cannot fill the host's disk.
pub struct ConsoleFile {
    path: PathBuf,
    file: std::fs::File,
    written: u64,
    max: u64,
}

impl ConsoleFile {
    pub fn open(path: &std::path::Path, max: u64) -> std::io::Result<ConsoleFile> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let written = file.metadata()?.len();
        Ok(ConsoleFile {
            path: path.to_path_buf(),
            file,
            written,
            max,
        })
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        let mut old = self.path.as_os_str().to_owned();
        old.push(".1");
        std::fs::rename(&self.path, &old)?;
        self.file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        self.written = 0;
        Ok(())
    }
}

impl Write for ConsoleFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.written + buf.len() as u64 > self.max && self.written > 0 {
            if let Err(e) = self.rotate() {
                tracing::warn!(path = %self.path.display(), error = %e, "rotating the console log");
                self.written = 0; // keep writing where we are; try again after another max
            }
        }
        let n = self.file.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// Where the serial console goes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Console {
    /// Nowhere (it is still watched for the outcome markers).
    #[default]
    Off,
    /// Appended to a file.
    File(PathBuf),
    /// To the VMM's stderr.
    Stderr,
}

/// What to boot.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    pub kernel: PathBuf,
    #[serde(default)]
    pub initrd: Option<PathBuf>,
    /// Extra kernel command line; the VMM prepends what its devices need.
    #[serde(default)]
    pub cmdline: String,
    pub mem_mib: u64,
    pub vcpus: u8,
    #[serde(default)]
    pub console: Console,
    /// Print kernel messages (`quiet` is added otherwise).
    #[serde(default)]
    pub verbose: bool,
    #[serde(default = "default_kvm")]
    pub kvm_device: PathBuf,
    /// How long a guest asked to stop ([`VmHandle::request_stop`]) gets to power off before
    /// its vCPUs are stopped.
    #[serde(default = "default_stop_timeout")]
    pub stop_timeout_ms: u64,
    /// virtio-blk disks, in order (`/dev/vda`, `/dev/vdb`, ...).
    #[serde(default)]
    pub disks: Vec<DiskConfig>,
    /// Extra virtio-blk devices after `disks` that start empty (0 sectors, serial "") and get
    /// an image while the guest runs ([`VmHandle::attach_disk`]).
    #[serde(default)]
    pub spare_disks: usize,
    /// virtio-net interfaces, in order (`eth0`, `eth1`, ...).
    #[serde(default)]
    pub nets: Vec<NetConfig>,
    /// A virtio-vsock device with a hybrid (Unix socket) host side.
    #[serde(default)]
    pub vsock: Option<VsockConfig>,
    /// Host directories shared with virtio-fs (`mount -t virtiofs <tag> <dir>` in the guest).
    #[serde(default)]
    pub shared_dirs: Vec<SharedDirConfig>,
}

/// A host directory the guest mounts by its tag.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedDirConfig {
    pub tag: String,
    pub path: PathBuf,
    /// Owners as a pod's user namespace sees them through an idmapped mount (the guest
    /// kernel cannot idmap a virtio-fs mount): see [`crate::virtio::share_fs::IdShift`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_shift: Option<crate::virtio::share_fs::IdShift>,
}

/// A virtio-net interface on a tap: an existing tap interface by name, or an open tap fd
/// the VMM process inherited (which it then owns).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    #[serde(default)]
    pub tap: Option<String>,
    #[serde(default)]
    pub tap_fd: Option<i32>,
    /// With `tap_fd`: the further queues of the same multi-queue tap, one per extra queue
    /// pair the guest is offered (VIRTIO_NET_F_MQ). Owned like `tap_fd`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub queue_fds: Vec<i32>,
    /// `aa:bb:cc:dd:ee:ff`; the guest picks a random one if absent.
    #[serde(default)]
    pub mac: Option<String>,
    /// The MTU offered to the guest (VIRTIO_NET_F_MTU); the guest's default (1500) if absent.
    #[serde(default)]
    pub mtu: Option<u16>,
}

/// virtio-vsock: the guest's CID and the host Unix socket (`CONNECT <port>` to reach guest
/// ports; guest connections to host port P go to `<uds_path>_P`). The socket is removed when
/// the VM ends.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    #[serde(default = "default_cid")]
    pub guest_cid: u64,
    pub uds_path: PathBuf,
}

fn default_cid() -> u64 {
    3
}

/// A raw disk image attached with virtio-blk.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiskConfig {
    pub path: PathBuf,
    #[serde(default)]
    pub read_only: bool,
    /// The serial id the guest sees (`/sys/block/vdX/serial`), at most 20 bytes.
    #[serde(default)]
    pub serial: String,
}

/// The first interrupt line given to virtio devices.
pub const VIRTIO_IRQ_BASE: u32 = 5;

fn default_kvm() -> PathBuf {
    PathBuf::from("/dev/kvm")
}

fn default_stop_timeout() -> u64 {
    5000
}

/// The line written to the guest's serial console to ask it to shut down: the guest's PID 1
/// (the agent) treats it as a power button. Without ACPI or a keyboard controller driver in the
/// guest there is no other way to reach it before the agent's own channel is up.
pub const STOP_LINE: &[u8] = b"\nvessel-stop\n";

/// Errors building or starting a VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("cannot open {path}: {source}")]
    Kvm {
        path: String,
        source: kvm_ioctls::Error,
    },
    #[error("KVM {what}: {source}")]
    KvmIoctl {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("{0} MiB of guest memory is more than this host has ({1} MiB)")]
    MemoryTooLarge(u64, u64),
    #[error("guest memory: {0}")]
    Memory(String),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error(transparent)]
    Arch(#[from] arch::ArchError),
    #[error(transparent)]
    Mptable(#[from] mptable::MptableError),
    #[error("console {path}: {source}")]
    Console {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Disk(#[from] crate::virtio::block::BlockError),
    #[error(transparent)]
    Vsock(#[from] crate::virtio::vsock::VsockError),
    #[error(transparent)]
    Net(#[from] crate::virtio::net::NetError),
    #[error(transparent)]
    Fs(#[from] crate::virtio::fs::FsError),
    #[error("too many virtio devices (at most {0})")]
    TooManyDevices(usize),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmError {
    move |source| VmError::KvmIoctl { what, source }
}

/// The host's total memory in MiB (sysinfo(2): a jailed VMM has no /proc/meminfo).
pub fn host_mem_mib() -> Option<u64> {
    // SAFETY: sysinfo is plain data; the call fills it.
    let mut si: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: `si` is a valid out pointer for the call.
    if unsafe { libc::sysinfo(&mut si) } != 0 {
        return None;
    }
    let bytes = si.totalram.checked_mul(u64::from(si.mem_unit))?;
    Some(bytes >> 20)
}

/// A configured VM, ready to start.
pub struct Vm {
    _kvm: Kvm,
    vm: VmFd,
    mem: GuestMemoryMmap,
    vcpus: Vec<VcpuFd>,
    pio: Arc<PioBus>,
    mmio: Arc<MmioBus>,
    control: Arc<Control>,
    disk_slots: Vec<DiskSlot>,
    entry: u64,
    stop_timeout: Duration,
    phases: BuildPhases,
}

/// How long each step of [`Vm::new`] took, in order: `kvm`, `memory`, `kernel_load`, `initrd`,
/// `devices`, and `vcpus` (which also writes the boot parameters and tables and sets up the
/// console). The VMM's side of a boot-time breakdown: `vessel-shim run` reports them,
/// `vessel-shim bench` takes their medians.
#[derive(Debug, Clone)]
pub struct BuildPhases {
    last: Instant,
    steps: Vec<(&'static str, Duration)>,
}

impl BuildPhases {
    fn start() -> BuildPhases {
        BuildPhases {
            last: Instant::now(),
            steps: Vec::new(),
        }
    }

    /// Ends step `name`, begun where the last one ended.
    fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.steps.push((name, now - self.last));
        self.last = now;
    }

    /// The steps and their durations, in order.
    pub fn steps(&self) -> &[(&'static str, Duration)] {
        &self.steps
    }
}

impl Vm {
    /// Builds the VM: memory, kernel, initrd, boot tables, irqchip, devices and vCPUs.
    pub fn new(cfg: &VmConfig) -> Result<Vm, VmError> {
        let mut phases = BuildPhases::start();
        if cfg.vcpus == 0 || cfg.vcpus > 254 {
            return Err(VmError::Config(format!(
                "vcpus must be 1..=254, not {}",
                cfg.vcpus
            )));
        }
        if cfg.mem_mib < 32 {
            return Err(VmError::Config(format!(
                "mem_mib must be at least 32, not {}",
                cfg.mem_mib
            )));
        }
        if let Some(host) = host_mem_mib() {
            if cfg.mem_mib > host {
                return Err(VmError::MemoryTooLarge(cfg.mem_mib, host));
            }
        }
        // Check the kernel before opening KVM, for a clear error.
        if !cfg.kernel.is_file() {
            return Err(boot::BootError::KernelOpen {
                path: cfg.kernel.display().to_string(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            }
            .into());
        }
        let path = std::ffi::CString::new(cfg.kvm_device.as_os_str().as_encoded_bytes())
            .map_err(|_| VmError::Config("bad kvm device path".into()))?;
        let kvm = Kvm::new_with_path(&path).map_err(|source| VmError::Kvm {
            path: cfg.kvm_device.display().to_string(),
            source,
        })?;
        let vm = kvm.create_vm().map_err(ioctl("create_vm"))?;
        vm.set_tss_address(0xfffb_d000)
            .map_err(ioctl("set_tss_address"))?;
        vm.create_irq_chip().map_err(ioctl("create_irq_chip"))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        vm.create_pit2(pit).map_err(ioctl("create_pit2"))?;
        phases.mark("kvm");

        let mem = GuestMemoryMmap::<()>::from_ranges(&boot::ram_ranges(cfg.mem_mib << 20))
            .map_err(|e| VmError::Memory(e.to_string()))?;
        for (slot, r) in mem.iter().enumerate() {
            let host = mem
                .get_host_address(r.start_addr())
                .map_err(|e| VmError::Memory(e.to_string()))?;
            // At most two regions (around the MMIO hole).
            #[allow(clippy::cast_possible_truncation)]
            let region = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: 0,
                guest_phys_addr: r.start_addr().raw_value(),
                memory_size: r.len(),
                userspace_addr: host as u64,
            };
            // SAFETY: `host` is the start of a live mapping of `r.len()` bytes owned by `mem`,
            // which the Vm keeps for as long as the VM fd.
            unsafe { vm.set_user_memory_region(region) }
                .map_err(ioctl("set_user_memory_region"))?;
            // Transparent huge pages for guest RAM (as QEMU does): far fewer (nested) page
            // faults while the guest first touches its memory. Advisory; failure is harmless.
            // The region is mapped in our address space, so its length fits a usize.
            #[allow(clippy::cast_possible_truncation)]
            // SAFETY: madvise on a range inside a live anonymous mapping owned by `mem`.
            let rc = unsafe { libc::madvise(host.cast(), r.len() as usize, libc::MADV_HUGEPAGE) };
            if rc != 0 {
                tracing::debug!(
                    "madvise(MADV_HUGEPAGE): {}",
                    std::io::Error::last_os_error()
                );
            }
        }

        phases.mark("memory");
        let kernel = boot::load_kernel(&mem, &cfg.kernel)?;
        phases.mark("kernel_load");
        let initrd = match &cfg.initrd {
            Some(p) => Some(boot::load_initrd(&mem, p, boot::initrd_addr_max(&kernel))?),
            None => None,
        };
        phases.mark("initrd");
        let mut mmio = MmioBus::default();
        let mut device_args = Vec::new();
        let max_devices = (mptable::IOAPIC_PINS as u32 - VIRTIO_IRQ_BASE) as usize;
        let n_devices = cfg.disks.len()
            + cfg.spare_disks
            + cfg.nets.len()
            + cfg.shared_dirs.len()
            + usize::from(cfg.vsock.is_some());
        if n_devices > max_devices {
            return Err(VmError::TooManyDevices(max_devices));
        }
        // The vsock socket is bound first, so that a failure further on also shows that it is
        // removed again (its Drop does that); it is placed last on the bus.
        let vsock = match &cfg.vsock {
            Some(v) => Some(Vsock::new(v.guest_cid, &v.uds_path)?),
            None => None,
        };
        let mut devices: Vec<Box<dyn VirtioDevice>> = Vec::new();
        for d in &cfg.disks {
            devices.push(Box::new(Block::new(&d.path, d.read_only, &d.serial)?));
        }
        let mut disk_slots = Vec::new();
        for _ in 0..cfg.spare_disks {
            let b = Block::empty();
            disk_slots.push(b.slot());
            devices.push(Box::new(b));
        }
        // Every inherited tap fd, across all nets, checked before any is taken over: each
        // must be open and named once, so that each has exactly one owner.
        let mut seen = std::collections::HashSet::new();
        for n in &cfg.nets {
            for fd in n.tap_fd.iter().chain(&n.queue_fds) {
                // SAFETY: F_GETFD only queries the descriptor table.
                let open = unsafe { libc::fcntl(*fd, libc::F_GETFD) } >= 0;
                if *fd < 3 || !open || !seen.insert(*fd) {
                    return Err(VmError::Config(format!(
                        "tap fd {fd} is not an open descriptor of its own"
                    )));
                }
            }
            if n.tap.is_some() == n.tap_fd.is_some() || (n.tap.is_some() && !n.queue_fds.is_empty())
            {
                return Err(VmError::Config(
                    "a net needs exactly one of tap, tap_fd (queue_fds go with tap_fd)".into(),
                ));
            }
        }
        for n in &cfg.nets {
            let mac = n.mac.as_deref().map(net::parse_mac).transpose()?;
            let dev = match (&n.tap, n.tap_fd) {
                (Some(name), _) => Net::new(net::open_tap(name)?.into(), mac)?,
                (None, fd) => {
                    let owned = fd
                        .into_iter()
                        .chain(n.queue_fds.iter().copied())
                        // SAFETY: the spec hands this process these fds, checked above to be
                        // open and each named once across all nets; nothing else in the
                        // process uses those numbers.
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
                        .collect();
                    Net::with_queues(owned, mac)?
                }
            };
            devices.push(Box::new(dev.with_mtu(n.mtu)));
        }
        for d in &cfg.shared_dirs {
            devices.push(Box::new(Fs::new(&d.tag, &d.path, d.id_shift)?));
        }
        if let Some(v) = vsock {
            devices.push(Box::new(v));
        }
        for (i, dev) in devices.into_iter().enumerate() {
            let base = boot::VIRTIO_MMIO_BASE + i as u64 * MMIO_WINDOW;
            // i < max_devices (checked above), under 24.
            #[allow(clippy::cast_possible_truncation)]
            let irq = VIRTIO_IRQ_BASE + i as u32;
            let t = MmioTransport::new(dev, mem.clone())?;
            vm.register_irqfd(&t.interrupt().evt, irq)
                .map_err(ioctl("register_irqfd"))?;
            mmio.add(base, Arc::new(Mutex::new(t)));
            device_args.push(MmioTransport::cmdline_arg(base, irq));
        }
        let mmio = Arc::new(mmio);
        phases.mark("devices");

        let mut cmdline = String::from(
            "console=ttyS0 reboot=k panic=1 i8042.noaux i8042.nomux i8042.dumbkbd nomodule",
        );
        if !cfg.verbose {
            cmdline.push_str(" quiet");
        }
        for a in &device_args {
            cmdline.push(' ');
            cmdline.push_str(a);
        }
        if !cfg.cmdline.is_empty() {
            cmdline.push(' ');
            cmdline.push_str(&cfg.cmdline);
        }
        boot::write_boot_params(&mem, &kernel, &cmdline, initrd)?;
        arch::write_boot_tables(&mem)?;
        mptable::setup(&mem, cfg.vcpus)?;

        let control = Arc::new(Control::default());
        let console_out: Option<Box<dyn Write + Send>> = match &cfg.console {
            Console::Off => None,
            Console::Stderr => Some(Box::new(std::io::stderr())),
            Console::File(p) => Some(Box::new(ConsoleFile::open(p, CONSOLE_MAX).map_err(
                |source| VmError::Console {
                    path: p.display().to_string(),
                    source,
                },
            )?)),
        };
        let serial_irq = EventFd::new(libc::EFD_NONBLOCK)?;
        vm.register_irqfd(&serial_irq, SERIAL_IRQ)
            .map_err(ioctl("register_irqfd"))?;
        let pio = Arc::new(PioBus::new(
            serial_irq,
            ConsoleSink::new(console_out, control.clone()),
            control.clone(),
        ));

        let mut supported = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(ioctl("get_supported_cpuid"))?;
        // KVM emulates the TSC-deadline LAPIC timer but leaves it out of the supported set;
        // without it the guest calibrates its LAPIC timer against the PIT (~0.25 s nested).
        let tsc_deadline = kvm.check_extension(kvm_ioctls::Cap::TscDeadlineTimer);
        arch::set_tsc_deadline(&mut supported, tsc_deadline);
        let mut vcpus = Vec::new();
        for id in 0..cfg.vcpus {
            let vcpu = vm
                .create_vcpu(u64::from(id))
                .map_err(ioctl("create_vcpu"))?;
            let mut cpuid = supported.clone();
            arch::normalize_cpuid(&mut cpuid, id, cfg.vcpus);
            vcpu.set_cpuid2(&cpuid).map_err(ioctl("set_cpuid2"))?;
            arch::set_boot_msrs(&vcpu)?;
            arch::set_lint(&vcpu)?;
            if id == 0 {
                arch::setup_long_mode_vcpu(&vcpu, kernel.entry, boot::BOOT_STACK, boot::ZERO_PAGE)?;
            } else {
                // Application processors wait for INIT/SIPI from the boot CPU.
                vcpu.set_fpu(&arch::reset_fpu()).map_err(ioctl("set_fpu"))?;
            }
            vcpus.push(vcpu);
        }
        phases.mark("vcpus");
        Ok(Vm {
            _kvm: kvm,
            vm,
            mem,
            vcpus,
            pio,
            mmio,
            control,
            disk_slots,
            entry: kernel.entry,
            stop_timeout: Duration::from_millis(cfg.stop_timeout_ms),
            phases,
        })
    }

    /// How long each step of building this VM took.
    pub fn build_phases(&self) -> &BuildPhases {
        &self.phases
    }

    /// The kernel entry point.
    pub fn entry(&self) -> u64 {
        self.entry
    }

    /// The run state shared with the devices.
    pub fn control(&self) -> Arc<Control> {
        self.control.clone()
    }

    /// The spare disk slots (`spare_disks`), in order.
    pub fn disk_slots(&self) -> Vec<DiskSlot> {
        self.disk_slots.clone()
    }

    /// Starts the vCPU threads.
    pub fn start(self) -> Result<RunningVm, VmError> {
        crate::kick::install_kick_handler();
        let mut threads = Vec::new();
        for (id, mut vcpu) in self.vcpus.into_iter().enumerate() {
            let pio = self.pio.clone();
            let mmio = self.mmio.clone();
            let control = self.control.clone();
            let t = std::thread::Builder::new()
                .name(format!("vcpu{id}"))
                .spawn(move || {
                    // A vCPU runs guest code and emulates devices: it needs no capability.
                    if let Err(e) = crate::caps::drop_all() {
                        tracing::warn!(vcpu = id, "dropping capabilities: {e}");
                    }
                    if let Err(e) = crate::threads::confine(crate::threads::ThreadRole::Vcpu) {
                        control.finish(Outcome::Error(format!("vcpu{id}: {e}")));
                        return;
                    }
                    if let Err(e) = run_vcpu(&mut vcpu, &pio, &mmio, &control) {
                        control.finish(Outcome::Error(format!("vcpu{id}: {e}")));
                    }
                })?;
            threads.push(t);
        }
        Ok(RunningVm {
            _vm: self.vm,
            _mem: self.mem,
            threads,
            control: self.control,
            pio: self.pio,
            disk_slots: self.disk_slots,
            stop_timeout: self.stop_timeout,
        })
    }
}

fn run_vcpu(
    vcpu: &mut VcpuFd,
    pio: &PioBus,
    mmio: &MmioBus,
    control: &Control,
) -> Result<(), String> {
    loop {
        if control.stopping() {
            return Ok(());
        }
        match vcpu.run() {
            Ok(VcpuExit::IoIn(port, data)) => pio.read(port, data),
            Ok(VcpuExit::IoOut(port, data)) => pio.write(port, data),
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if !mmio.read(addr, data) {
                    data.fill(0xff);
                }
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                mmio.write(addr, data);
            }
            Ok(VcpuExit::Hlt) => {}
            Ok(VcpuExit::Shutdown) => {
                // Triple fault: what a reset without an i8042 looks like.
                control.finish(Outcome::Reboot);
                return Ok(());
            }
            Ok(VcpuExit::SystemEvent(t, _)) => {
                control.finish(match t {
                    kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => Outcome::Poweroff,
                    _ => Outcome::Reboot,
                });
                return Ok(());
            }
            Ok(VcpuExit::Intr) => {}
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                return Err(format!(
                    "KVM_EXIT_FAIL_ENTRY reason {reason:#x} on cpu {cpu}"
                ));
            }
            Ok(VcpuExit::InternalError) => {
                // SAFETY: after a KVM_EXIT_INTERNAL_ERROR exit, the kernel filled the `internal`
                // member of kvm_run's exit union.
                let internal = unsafe { vcpu.get_kvm_run().__bindgen_anon_1.internal };
                let n = (internal.ndata as usize).min(internal.data.len());
                return Err(format!(
                    "KVM_EXIT_INTERNAL_ERROR suberror {} ({}), data {:x?}",
                    internal.suberror,
                    match internal.suberror {
                        1 => "instruction emulation failed",
                        2 => "simultaneous exceptions",
                        3 => "delivery event",
                        4 => "unexpected exit reason",
                        _ => "unknown",
                    },
                    &internal.data[..n]
                ));
            }
            Ok(other) => return Err(format!("unexpected exit {other:?}")),
            // A secondary vCPU's first KVM_RUN may return EAGAIN until it got its SIPI.
            Err(e) if e.errno() == libc::EAGAIN || e.errno() == libc::EINTR => {}
            Err(e) => return Err(format!("KVM_RUN: {e}")),
        }
    }
}

/// A VM whose vCPUs are running.
pub struct RunningVm {
    _vm: VmFd,
    _mem: GuestMemoryMmap,
    threads: Vec<JoinHandle<()>>,
    control: Arc<Control>,
    pio: Arc<PioBus>,
    disk_slots: Vec<DiskSlot>,
    stop_timeout: Duration,
}

/// A handle on a running VM for other threads (a signal handler thread, a control socket):
/// stop it, change its spare disks.
#[derive(Clone)]
pub struct VmHandle {
    control: Arc<Control>,
    pio: Arc<PioBus>,
    disk_slots: Vec<DiskSlot>,
    stop_timeout: Duration,
}

impl VmHandle {
    /// Asks the guest to shut down ([`STOP_LINE`] on its console) and, if it has not ended
    /// within the VM's stop timeout, stops it ([`Outcome::Stopped`]). Returns at once.
    pub fn request_stop(&self) {
        self.pio.console_input(STOP_LINE);
        let (control, timeout) = (self.control.clone(), self.stop_timeout);
        std::thread::spawn(move || {
            if control.wait(Some(timeout)).is_none() {
                tracing::info!("the guest did not stop in {timeout:?}; stopping it");
                control.finish(Outcome::Stopped);
            }
        });
    }

    /// Stops the guest now.
    pub fn stop_now(&self) {
        self.control.finish(Outcome::Stopped);
    }

    /// The number of spare disk slots.
    pub fn spare_disks(&self) -> usize {
        self.disk_slots.len()
    }

    fn slot(&self, slot: usize) -> Result<&DiskSlot, BlockError> {
        self.disk_slots.get(slot).ok_or(BlockError::NoSlot {
            slot,
            count: self.disk_slots.len(),
        })
    }

    /// Spare slot `slot` (0-based) now serves `path`; the guest gets a configuration-change
    /// interrupt. On error (no such slot, the image cannot be opened) the slot is unchanged.
    pub fn attach_disk(
        &self,
        slot: usize,
        path: &std::path::Path,
        read_only: bool,
        serial: &str,
    ) -> Result<(), BlockError> {
        self.slot(slot)?.attach(path, read_only, serial)
    }

    /// Spare slot `slot` is empty again (0 sectors, serial "").
    pub fn detach_disk(&self, slot: usize) -> Result<(), BlockError> {
        self.slot(slot)?.detach();
        Ok(())
    }
}

impl RunningVm {
    pub fn control(&self) -> Arc<Control> {
        self.control.clone()
    }

    pub fn handle(&self) -> VmHandle {
        VmHandle {
            control: self.control.clone(),
            pio: self.pio.clone(),
            disk_slots: self.disk_slots.clone(),
            stop_timeout: self.stop_timeout,
        }
    }

    /// Waits for the guest's outcome (at most `timeout`), then stops and joins the vCPUs.
    pub fn wait(mut self, timeout: Option<Duration>) -> Outcome {
        let o = self.control.wait(timeout).unwrap_or_else(|| {
            self.control.finish(Outcome::Stopped);
            Outcome::Stopped
        });
        self.stop_vcpus();
        o
    }

    fn stop_vcpus(&mut self) {
        self.control.finish(Outcome::Stopped);
        for t in self.threads.drain(..) {
            let deadline = Instant::now() + Duration::from_secs(5);
            while !t.is_finished() && Instant::now() < deadline {
                crate::kick::kick_thread(t.as_pthread_t());
                std::thread::sleep(Duration::from_millis(2));
            }
            if t.is_finished() {
                let _ = t.join();
            } else {
                tracing::warn!("a vCPU thread did not stop");
            }
        }
    }
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        self.stop_vcpus();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_console_file_is_bounded() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("console.log");
        let mut c = ConsoleFile::open(&p, 1000).unwrap();
        for _ in 0..50 {
            c.write_all(&[b'x'; 99]).unwrap();
            c.write_all(b"\n").unwrap();
        }
        let now = std::fs::metadata(&p).unwrap().len();
        let old = std::fs::metadata(d.path().join("console.log.1"))
            .unwrap()
            .len();
        assert!(now <= 1000 && old <= 1000, "{now} {old}");
        assert!(now > 0 && old > 0);
    }
    use vm_memory::{Bytes, GuestAddress};

    #[test]
    fn tables_in_guest_memory_after_build() {
        let kernel = std::fs::read_dir("/boot").ok().and_then(|d| {
            d.flatten()
                .map(|e| e.path())
                .find(|p| p.to_string_lossy().contains("vmlinuz"))
        });
        let Some(kernel) = kernel else {
            println!("SKIP tables_in_guest_memory_after_build: no kernel in /boot");
            return;
        };
        if !std::path::Path::new("/dev/kvm").exists() {
            println!("SKIP tables_in_guest_memory_after_build: no /dev/kvm");
            return;
        }
        let cfg = VmConfig {
            kernel,
            initrd: None,
            cmdline: String::new(),
            mem_mib: 64,
            vcpus: 2,
            console: Console::Off,
            verbose: false,
            kvm_device: default_kvm(),
            stop_timeout_ms: default_stop_timeout(),
            disks: Vec::new(),
            spare_disks: 0,
            nets: Vec::new(),
            vsock: None,
            shared_dirs: Vec::new(),
        };
        let vm = Vm::new(&cfg).unwrap();
        let mut magic = [0u8; 4];
        vm.mem
            .read_slice(&mut magic, GuestAddress(mptable::MPTABLE_START))
            .unwrap();
        assert_eq!(&magic, b"_MP_");
    }
}
