//! x86_64 CPU state for a 64-bit entry: GDT, identity page tables, long-mode segment
//! registers, CPUID normalisation, boot MSRs and the local APIC's LINT pins.
//!
//! Used by both the direct Linux boot and the KVM calibration probe, so the probe measures a
//! guest in the same mode a booting kernel runs in.

use kvm_bindings::{kvm_fpu, kvm_lapic_state, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs};
use kvm_bindings::{CpuId, Msrs};
use vm_memory::{Bytes, GuestAddress, GuestMemory};

/// Where the boot GDT is written in guest memory.
pub const GDT_ADDR: u64 = 0x500;
/// Where the boot IDT (empty) is written in guest memory.
pub const IDT_ADDR: u64 = 0x520;
/// The identity page tables: PML4, PDPT and one PD page mapping the first 1 GiB with 2 MiB pages.
pub const PML4_ADDR: u64 = 0x9000;
const PDPT_ADDR: u64 = 0xa000;
const PD_ADDR: u64 = 0xb000;

const X86_CR0_PE: u64 = 1 << 0;
const X86_CR0_ET: u64 = 1 << 4;
const X86_CR0_PG: u64 = 1 << 31;
const X86_CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

/// Errors writing boot CPU state.
#[derive(Debug, thiserror::Error)]
pub enum ArchError {
    #[error("writing boot tables to guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    #[error("KVM vCPU setup ({what}): {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("KVM rejected boot MSRs: {set} of {total} set")]
    Msrs { set: usize, total: usize },
}

fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> ArchError {
    move |source| ArchError::Kvm { what, source }
}

/// A flat GDT entry: `flags` are the access byte (low 8) and the G/DB/L/AVL nibble (bits 12..16).
const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
        | (((limit as u64 & 0x000f_0000) >> 16) << 48)
        | ((flags as u64 & 0xf0ff) << 40)
}

/// null, 64-bit code (0x08), data (0x10), TSS (0x18), the layout Linux's boot protocol expects
/// for `__BOOT_CS`/`__BOOT_DS`.
const GDT: [u64; 4] = [
    gdt_entry(0, 0, 0),
    gdt_entry(0xa09b, 0, 0xfffff),
    gdt_entry(0xc093, 0, 0xfffff),
    gdt_entry(0x808b, 0, 0xfffff),
];

fn segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let base = ((entry >> 16) & 0xff_ffff) | ((entry >> 32) & 0xff00_0000);
    // The segment limit is a 20-bit field (both parts masked).
    #[allow(clippy::cast_possible_truncation)]
    let limit = ((entry & 0xffff) | ((entry >> 32) & 0xf_0000)) as u32;
    let g = ((entry >> 55) & 1) as u8;
    kvm_segment {
        base,
        // With 4 KiB granularity the limit counts pages.
        limit: if g == 1 { (limit << 12) | 0xfff } else { limit },
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: u8::from(((entry >> 47) & 1) == 0),
    }
}

/// Writes the GDT, an empty IDT and identity page tables for the first 1 GiB.
pub fn write_boot_tables<M: GuestMemory>(mem: &M) -> Result<(), ArchError> {
    for (i, e) in GDT.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(GDT_ADDR + 8 * i as u64))?;
    }
    mem.write_obj(0u64, GuestAddress(IDT_ADDR))?;
    // PML4[0] -> PDPT, PDPT[0] -> PD, PD[i] = 2 MiB page i (present | writable | PS).
    mem.write_obj(PDPT_ADDR | 0x03, GuestAddress(PML4_ADDR))?;
    mem.write_obj(PD_ADDR | 0x03, GuestAddress(PDPT_ADDR))?;
    for i in 0..512u64 {
        mem.write_obj((i << 21) | 0x83, GuestAddress(PD_ADDR + i * 8))?;
    }
    Ok(())
}

/// Puts `sregs` into 64-bit long mode with paging on, using the tables of [`write_boot_tables`].
pub fn long_mode_sregs(sregs: &mut kvm_sregs) {
    let code = segment_from_gdt(GDT[1], 1);
    let data = segment_from_gdt(GDT[2], 2);
    let tss = segment_from_gdt(GDT[3], 3);
    sregs.gdt.base = GDT_ADDR;
    // The GDT is 4 entries (32 bytes): its limit fits the 16-bit field.
    #[allow(clippy::cast_possible_truncation)]
    let gdt_limit = (std::mem::size_of_val(&GDT) - 1) as u16;
    sregs.gdt.limit = gdt_limit;
    sregs.idt.base = IDT_ADDR;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    sregs.cr3 = PML4_ADDR;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.cr0 |= X86_CR0_PE | X86_CR0_ET | X86_CR0_PG;
    sregs.efer |= EFER_LME | EFER_LMA;
}

/// The vCPU's general registers for a 64-bit entry at `rip`.
pub fn entry_regs(rip: u64, rsp: u64, rsi: u64) -> kvm_regs {
    kvm_regs {
        rflags: 0x2,
        rip,
        rsp,
        rbp: rsp,
        rsi,
        ..Default::default()
    }
}

/// FPU state as after FNINIT, with MXCSR at its reset value.
pub fn reset_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

/// Normalises KVM's supported CPUID for vCPU `cpu_id` of `cpu_count`: the initial APIC ID,
/// logical-processor count and topology leaves, the hypervisor bit, and no
/// architectural-performance-monitoring leaf (we emulate no PMU).
pub fn normalize_cpuid(cpuid: &mut CpuId, cpu_id: u8, cpu_count: u8) {
    for e in cpuid.as_mut_slice() {
        match e.function {
            0x1 => {
                // EBX[31:24] initial APIC id, EBX[23:16] logical processors per package.
                e.ebx = (e.ebx & 0x0000_ffff)
                    | (u32::from(cpu_id) << 24)
                    | (u32::from(cpu_count) << 16);
                // EDX[28] HTT when more than one logical processor.
                if cpu_count > 1 {
                    e.edx |= 1 << 28;
                } else {
                    e.edx &= !(1 << 28);
                }
                // ECX[31] hypervisor present.
                e.ecx |= 1 << 31;
            }
            0x4 => {
                // Cores per package - 1 in EAX[31:26]; threads sharing this cache in EAX[25:14].
                let cores = u32::from(cpu_count.max(1)) - 1;
                e.eax = (e.eax & 0x03ff_ffff) | (cores << 26);
                e.eax &= !(0xfff << 14);
            }
            0xa => {
                e.eax = 0;
                e.ebx = 0;
                e.ecx = 0;
                e.edx = 0;
            }
            0xb | 0x1f => {
                // x2APIC topology: one thread per core, `cpu_count` cores.
                e.edx = u32::from(cpu_id);
                match e.index {
                    0 => {
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = 0x100; // level type SMT
                    }
                    1 => {
                        e.eax = u32::from(cpu_count.max(1))
                            .next_power_of_two()
                            .trailing_zeros();
                        e.ebx = u32::from(cpu_count);
                        e.ecx = 0x201; // level type core
                    }
                    _ => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = e.index & 0xff;
                    }
                }
            }
            0x8000_0001 => {
                // AMD: clear CmpLegacy/topology extensions we do not describe.
                e.ecx &= !(1 << 1);
                e.ecx &= !(1 << 22);
            }
            0x8000_0008 => {
                // AMD: ECX[7:0] number of cores - 1.
                e.ecx = (e.ecx & !0xff) | (u32::from(cpu_count.max(1)) - 1);
            }
            _ => {}
        }
    }
}

/// Advertises (or hides) the TSC-deadline mode of the local APIC timer, CPUID.1:ECX[24].
pub fn set_tsc_deadline(cpuid: &mut CpuId, on: bool) {
    for e in cpuid.as_mut_slice() {
        if e.function == 0x1 {
            if on {
                e.ecx |= 1 << 24;
            } else {
                e.ecx &= !(1 << 24);
            }
        }
    }
}

/// Boot MSRs: SYSENTER/SYSCALL state cleared, TSC 0, and fast-string enabled in
/// IA32_MISC_ENABLE, as firmware leaves them.
pub fn boot_msrs() -> Vec<kvm_msr_entry> {
    const MSR_IA32_SYSENTER_CS: u32 = 0x174;
    const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
    const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
    const MSR_STAR: u32 = 0xc000_0081;
    const MSR_LSTAR: u32 = 0xc000_0082;
    const MSR_CSTAR: u32 = 0xc000_0083;
    const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
    const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
    const MSR_IA32_TSC: u32 = 0x10;
    const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
    let e = |index, data| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    vec![
        e(MSR_IA32_SYSENTER_CS, 0),
        e(MSR_IA32_SYSENTER_ESP, 0),
        e(MSR_IA32_SYSENTER_EIP, 0),
        e(MSR_STAR, 0),
        e(MSR_CSTAR, 0),
        e(MSR_KERNEL_GS_BASE, 0),
        e(MSR_SYSCALL_MASK, 0),
        e(MSR_LSTAR, 0),
        e(MSR_IA32_TSC, 0),
        e(MSR_IA32_MISC_ENABLE, 1),
    ]
}

/// Writes the boot MSRs, failing if KVM refuses any.
pub fn set_boot_msrs(vcpu: &kvm_ioctls::VcpuFd) -> Result<(), ArchError> {
    let entries = boot_msrs();
    let msrs = Msrs::from_entries(&entries).expect("a handful of MSRs fit a FAM struct");
    let set = vcpu.set_msrs(&msrs).map_err(kvm_err("set_msrs"))?;
    if set != entries.len() {
        return Err(ArchError::Msrs {
            set,
            total: entries.len(),
        });
    }
    Ok(())
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn lapic_reg(l: &kvm_lapic_state, off: usize) -> u32 {
    let b = &l.regs[off..off + 4];
    u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
}

fn set_lapic_reg(l: &mut kvm_lapic_state, off: usize, v: u32) {
    for (i, b) in v.to_le_bytes().iter().enumerate() {
        l.regs[off + i] = *b as _;
    }
}

/// Configures LINT0 as ExtINT (the PIC's output) and LINT1 as NMI, as a PC's BIOS does
/// (the virtual-wire mode Linux expects before it sets up the IO-APIC).
pub fn set_lint(vcpu: &kvm_ioctls::VcpuFd) -> Result<(), ArchError> {
    let mut l = vcpu.get_lapic().map_err(kvm_err("get_lapic"))?;
    let lvt0 = lapic_reg(&l, APIC_LVT0);
    set_lapic_reg(&mut l, APIC_LVT0, (lvt0 & !0x700) | (APIC_MODE_EXTINT << 8));
    let lvt1 = lapic_reg(&l, APIC_LVT1);
    set_lapic_reg(&mut l, APIC_LVT1, (lvt1 & !0x700) | (APIC_MODE_NMI << 8));
    vcpu.set_lapic(&l).map_err(kvm_err("set_lapic"))?;
    Ok(())
}

/// Sets a vCPU up for a 64-bit entry at `rip` with `rsi` pointing at boot data.
pub fn setup_long_mode_vcpu(
    vcpu: &kvm_ioctls::VcpuFd,
    rip: u64,
    rsp: u64,
    rsi: u64,
) -> Result<(), ArchError> {
    let mut sregs = vcpu.get_sregs().map_err(kvm_err("get_sregs"))?;
    long_mode_sregs(&mut sregs);
    vcpu.set_sregs(&sregs).map_err(kvm_err("set_sregs"))?;
    vcpu.set_regs(&entry_regs(rip, rsp, rsi))
        .map_err(kvm_err("set_regs"))?;
    vcpu.set_fpu(&reset_fpu()).map_err(kvm_err("set_fpu"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_segments_decode_to_flat_long_mode() {
        let cs = segment_from_gdt(GDT[1], 1);
        assert_eq!(
            (cs.selector, cs.l, cs.db, cs.g, cs.present, cs.type_),
            (8, 1, 0, 1, 1, 0xb)
        );
        assert_eq!(cs.limit, 0xffff_ffff);
        let ds = segment_from_gdt(GDT[2], 2);
        assert_eq!(
            (ds.selector, ds.l, ds.db, ds.type_, ds.s),
            (0x10, 0, 1, 3, 1)
        );
        assert_eq!(gdt_entry(0xa09b, 0, 0xfffff), 0x00af_9b00_0000_ffff);
        assert_eq!(gdt_entry(0xc093, 0, 0xfffff), 0x00cf_9300_0000_ffff);
    }

    #[test]
    fn page_tables_identity_map_first_gib() {
        let mem =
            vm_memory::GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        write_boot_tables(&mem).unwrap();
        let pml4: u64 = mem.read_obj(GuestAddress(PML4_ADDR)).unwrap();
        assert_eq!(pml4 & !0xfff, PDPT_ADDR);
        let pd5: u64 = mem.read_obj(GuestAddress(PD_ADDR + 5 * 8)).unwrap();
        assert_eq!(pd5, (5 << 21) | 0x83);
    }
}
