//! Guest memory layout and direct 64-bit Linux boot: kernel (ELF vmlinux or bzImage), initrd,
//! command line and the zero page (`boot_params`) with the E820 map.
//!
//! ```text
//! 0x0500 GDT   0x0520 IDT   0x7000 boot_params   0x8ff0 boot stack   0x9000.. page tables
//! 0x20000 command line   0x9fc00 MP tables   0x100000 kernel   ..initrd at the top of low RAM
//! 0xd0000000.. virtio-mmio devices   0xfec00000 IO-APIC   0xfee00000 LAPIC   4 GiB.. high RAM
//! ```

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use linux_loader::cmdline::Cmdline;
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::{load_cmdline, BzImage, Elf, KernelLoader};
use vm_memory::{
    Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};

pub const ZERO_PAGE: u64 = 0x7000;
pub const BOOT_STACK: u64 = 0x8ff0;
pub const CMDLINE_ADDR: u64 = 0x20000;
pub const CMDLINE_MAX: usize = 0x10000;
pub const HIMEM_START: u64 = 0x10_0000;
/// End of low RAM: the 32-bit MMIO hole starts here.
pub const MMIO_HOLE_START: u64 = 0xc000_0000;
pub const MMIO_HOLE_END: u64 = 0x1_0000_0000;
/// Where virtio-mmio device windows are placed.
pub const VIRTIO_MMIO_BASE: u64 = 0xd000_0000;

const E820_RAM: u32 = 1;
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448;
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;

/// Errors loading the guest.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("kernel {path}: {source}")]
    KernelOpen {
        path: String,
        source: std::io::Error,
    },
    #[error("kernel {path}: not an ELF vmlinux or x86 bzImage")]
    KernelFormat { path: String },
    #[error("kernel {path}: cannot load: {detail}")]
    KernelLoad { path: String, detail: String },
    #[error("initrd {path}: {source}")]
    InitrdOpen {
        path: String,
        source: std::io::Error,
    },
    #[error("initrd {path} ({size} bytes) does not fit in guest memory")]
    InitrdTooBig { path: String, size: u64 },
    #[error("command line: {0}")]
    Cmdline(String),
    #[error("guest memory: {0}")]
    Memory(String),
}

/// The RAM ranges for `size` bytes of guest memory, around the 32-bit MMIO hole.
// usize is 64 bits on the (x86_64 KVM) hosts this VMM builds for, so the sizes never truncate.
#[allow(clippy::cast_possible_truncation)]
pub fn ram_ranges(size: u64) -> Vec<(GuestAddress, usize)> {
    if size <= MMIO_HOLE_START {
        vec![(GuestAddress(0), size as usize)]
    } else {
        vec![
            (GuestAddress(0), MMIO_HOLE_START as usize),
            (
                GuestAddress(MMIO_HOLE_END),
                (size - MMIO_HOLE_START) as usize,
            ),
        ]
    }
}

/// Where the kernel was put.
#[derive(Debug, Clone, Copy)]
pub struct LoadedKernel {
    /// The 64-bit entry point.
    pub entry: u64,
    /// The bzImage setup header, if the kernel was a bzImage.
    pub setup_header: Option<linux_loader::loader::bootparam::setup_header>,
}

/// Loads an ELF vmlinux or a bzImage, whichever `path` is.
pub fn load_kernel(mem: &GuestMemoryMmap, path: &Path) -> Result<LoadedKernel, BootError> {
    let p = path.display().to_string();
    let mut f = File::open(path).map_err(|source| BootError::KernelOpen {
        path: p.clone(),
        source,
    })?;
    let mut magic = [0u8; 4];
    let mut hdr = [0u8; 4];
    let is_elf = f.read_exact(&mut magic).is_ok() && magic == *b"\x7fELF";
    let is_bz =
        f.seek(SeekFrom::Start(0x202)).is_ok() && f.read_exact(&mut hdr).is_ok() && hdr == *b"HdrS";
    f.seek(SeekFrom::Start(0))
        .map_err(|source| BootError::KernelOpen {
            path: p.clone(),
            source,
        })?;
    let load_err = |e: linux_loader::loader::Error| BootError::KernelLoad {
        path: p.clone(),
        detail: e.to_string(),
    };
    if is_elf {
        let r = Elf::load(mem, None, &mut f, Some(GuestAddress(HIMEM_START))).map_err(load_err)?;
        Ok(LoadedKernel {
            entry: r.kernel_load.raw_value(),
            setup_header: r.setup_header,
        })
    } else if is_bz {
        let r =
            BzImage::load(mem, None, &mut f, Some(GuestAddress(HIMEM_START))).map_err(load_err)?;
        // The 64-bit entry point is 0x200 past the protected-mode kernel's start.
        Ok(LoadedKernel {
            entry: r.kernel_load.raw_value() + 0x200,
            setup_header: r.setup_header,
        })
    } else {
        Err(BootError::KernelFormat { path: p })
    }
}

/// Copies the initrd to the highest page-aligned spot of low RAM below `max_addr`.
pub fn load_initrd(
    mem: &GuestMemoryMmap,
    path: &Path,
    max_addr: u64,
) -> Result<(u64, u64), BootError> {
    let p = path.display().to_string();
    let mut f = File::open(path).map_err(|source| BootError::InitrdOpen {
        path: p.clone(),
        source,
    })?;
    let size = f
        .metadata()
        .map_err(|source| BootError::InitrdOpen {
            path: p.clone(),
            source,
        })?
        .len();
    let low_end = mem.last_addr().raw_value().min(MMIO_HOLE_START - 1) + 1;
    let top = low_end.min(max_addr);
    let addr = top
        .checked_sub(size)
        .map(|a| a & !0xfff)
        .filter(|a| *a >= HIMEM_START + 0x40_0000)
        .ok_or(BootError::InitrdTooBig {
            path: p.clone(),
            size,
        })?;
    // size <= top <= MMIO_HOLE_START (checked_sub above): it fits a usize.
    #[allow(clippy::cast_possible_truncation)]
    mem.read_exact_volatile_from(GuestAddress(addr), &mut f, size as usize)
        .map_err(|e| BootError::Memory(format!("reading initrd {p}: {e}")))?;
    Ok((addr, size))
}

/// Writes the command line and the zero page.
pub fn write_boot_params(
    mem: &GuestMemoryMmap,
    kernel: &LoadedKernel,
    cmdline: &str,
    initrd: Option<(u64, u64)>,
) -> Result<(), BootError> {
    let mut cl = Cmdline::new(CMDLINE_MAX).map_err(|e| BootError::Cmdline(e.to_string()))?;
    cl.insert_str(cmdline)
        .map_err(|e| BootError::Cmdline(e.to_string()))?;
    load_cmdline(mem, GuestAddress(CMDLINE_ADDR), &cl)
        .map_err(|e| BootError::Cmdline(e.to_string()))?;

    let mut params = boot_params::default();
    if let Some(h) = kernel.setup_header {
        params.hdr = h;
    } else {
        params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
        params.hdr.header = KERNEL_HDR_MAGIC;
        params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    // CMDLINE_ADDR is below 1 MiB, and the command line fitted in CMDLINE_MAX (64 KiB) above.
    #[allow(clippy::cast_possible_truncation)]
    let (cmd_line_ptr, cmdline_size) = (CMDLINE_ADDR as u32, (cmdline.len() + 1) as u32);
    params.hdr.cmd_line_ptr = cmd_line_ptr;
    params.hdr.cmdline_size = cmdline_size;
    if let Some((addr, size)) = initrd {
        // The boot protocol's ramdisk fields are 32-bit ([`load_initrd`] stays below 4 GiB).
        let (Ok(image), Ok(len)) = (u32::try_from(addr), u32::try_from(size)) else {
            return Err(BootError::Memory(format!(
                "initrd at {addr:#x} ({size} bytes) is not below 4 GiB"
            )));
        };
        params.hdr.ramdisk_image = image;
        params.hdr.ramdisk_size = len;
    }
    let mut e820 = vec![(0u64, crate::mptable::MPTABLE_START)];
    for r in mem.iter() {
        let start = r.start_addr().raw_value();
        let end = start + r.len();
        let start = start.max(HIMEM_START);
        if end > start {
            e820.push((start, end - start));
        }
    }
    for (i, (addr, size)) in e820.iter().enumerate() {
        params.e820_table[i] = boot_e820_entry {
            addr: *addr,
            size: *size,
            r#type: E820_RAM,
        };
    }
    // At most 3 entries (the low area and two RAM ranges); e820_table holds 128.
    #[allow(clippy::cast_possible_truncation)]
    let e820_entries = e820.len() as u8;
    params.e820_entries = e820_entries;
    mem.write_obj(params, GuestAddress(ZERO_PAGE))
        .map_err(|e| BootError::Memory(e.to_string()))?;
    Ok(())
}

/// The initrd address limit a kernel allows (`initrd_addr_max`), 2 GiB - 1 by default.
pub fn initrd_addr_max(kernel: &LoadedKernel) -> u64 {
    match kernel.setup_header {
        Some(h) if h.initrd_addr_max != 0 => u64::from(h.initrd_addr_max) + 1,
        _ => 0x8000_0000,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    // usize is 64 bits here, as for [`ram_ranges`].
    #[allow(clippy::cast_possible_truncation)]
    fn ram_ranges_skip_the_mmio_hole() {
        assert_eq!(ram_ranges(128 << 20), vec![(GuestAddress(0), 128 << 20)]);
        let r = ram_ranges(4 << 30);
        assert_eq!(r[0], (GuestAddress(0), MMIO_HOLE_START as usize));
        assert_eq!(
            r[1],
            (
                GuestAddress(MMIO_HOLE_END),
                ((4u64 << 30) - MMIO_HOLE_START) as usize
            )
        );
        const { assert!(VIRTIO_MMIO_BASE >= MMIO_HOLE_START && VIRTIO_MMIO_BASE < 0xfec0_0000) };
    }

    #[test]
    fn zero_page_e820_and_initrd_placement() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&ram_ranges(64 << 20)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let initrd = dir.path().join("initrd");
        std::fs::write(&initrd, vec![7u8; 10_000]).unwrap();
        let (addr, size) = load_initrd(&mem, &initrd, 0x8000_0000).unwrap();
        assert_eq!(size, 10_000);
        assert_eq!(addr % 4096, 0);
        assert!(addr + size <= 64 << 20);
        let k = LoadedKernel {
            entry: 0x100_0000,
            setup_header: None,
        };
        write_boot_params(&mem, &k, "console=ttyS0", Some((addr, size))).unwrap();
        let p: boot_params = mem.read_obj(GuestAddress(ZERO_PAGE)).unwrap();
        assert_eq!(p.e820_entries, 2);
        let e = p.e820_table[1];
        let (addr1, size1) = (e.addr, e.size);
        assert_eq!(addr1, HIMEM_START);
        assert_eq!(size1, (64 << 20) - HIMEM_START);
        let (ramdisk, cmd_line) = (p.hdr.ramdisk_image, p.hdr.cmd_line_ptr);
        assert_eq!(u64::from(ramdisk), addr);
        assert_eq!(u64::from(cmd_line), CMDLINE_ADDR);
        let mut cl = [0u8; 14];
        mem.read_slice(&mut cl, GuestAddress(CMDLINE_ADDR)).unwrap();
        assert_eq!(&cl, b"console=ttyS0\0");
        // An initrd that cannot fit is a clear error.
        std::fs::write(&initrd, vec![0u8; 70 << 20]).unwrap();
        assert!(matches!(
            load_initrd(&mem, &initrd, 0x8000_0000),
            Err(BootError::InitrdTooBig { .. })
        ));
    }

    #[test]
    fn non_kernels_are_refused() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&ram_ranges(64 << 20)).unwrap();
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), vec![0x55u8; 100_000]).unwrap();
        assert!(matches!(
            load_kernel(&mem, f.path()),
            Err(BootError::KernelFormat { .. })
        ));
        assert!(matches!(
            load_kernel(&mem, Path::new("/nonexistent/vmlinux")),
            Err(BootError::KernelOpen { .. })
        ));
    }
}
