//! Intel MultiProcessor Specification 1.4 tables. With ACPI off, Linux finds its CPUs and the
//! IO-APIC only through these: without them an SMP guest boots on one CPU.
//!
//! Layout: the floating pointer structure at [`MPTABLE_START`] (scanned by the kernel in the
//! last KiB of base memory), followed by the configuration table: one processor entry per
//! vCPU, an ISA bus, the IO-APIC, one I/O interrupt entry per IO-APIC pin and the two local
//! interrupt entries (ExtINT on LINT0, NMI on LINT1).

use vm_memory::{Bytes, GuestAddress, GuestMemory};

/// Start of the MP tables: 639 KiB, the last KiB of conventional memory.
pub const MPTABLE_START: u64 = 0x9fc00;
/// The IO-APIC's MMIO base (KVM's in-kernel IO-APIC).
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
/// The local APIC's MMIO base.
pub const APIC_ADDR: u32 = 0xfee0_0000;
/// Pins of KVM's IO-APIC.
pub const IOAPIC_PINS: u8 = 24;

const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;

/// Errors building the tables.
#[derive(Debug, thiserror::Error)]
pub enum MptableError {
    #[error("too many vCPUs for the MP table: {0} (at most 254)")]
    TooManyCpus(u8),
    #[error("writing the MP table: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
}

fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |a, b| a.wrapping_add(*b))
        .wrapping_neg()
}

/// The tables as bytes, for `cpus` vCPUs, located at `start`.
pub fn build(cpus: u8, start: u64) -> Result<Vec<u8>, MptableError> {
    if cpus == 0 || cpus > 254 {
        return Err(MptableError::TooManyCpus(cpus));
    }
    let ioapic_id = cpus + 1;
    let config_addr = start + 16;

    // Configuration table entries.
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for cpu in 0..cpus {
        let flags = 1 | if cpu == 0 { 2 } else { 0 }; // enabled | bootstrap processor
        entries.extend_from_slice(&[0, cpu, APIC_VERSION, flags]);
        entries.extend_from_slice(&0x600u32.to_le_bytes()); // CPU signature: family 6
        entries.extend_from_slice(&0x201u32.to_le_bytes()); // features: FPU, APIC
        entries.extend_from_slice(&[0; 8]);
        count += 1;
    }
    entries.extend_from_slice(&[1, 0]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    entries.extend_from_slice(&[2, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&IOAPIC_ADDR.to_le_bytes());
    count += 1;
    for pin in 0..IOAPIC_PINS {
        // type 3 (I/O interrupt), INT, flags "conforms to bus", ISA bus 0, source IRQ = pin.
        entries.extend_from_slice(&[3, 0, 0, 0, 0, pin, ioapic_id, pin]);
        count += 1;
    }
    // type 4 (local interrupt): ExtINT -> LINT0 and NMI -> LINT1 of every local APIC.
    entries.extend_from_slice(&[4, 3, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, 1, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let mut table: Vec<u8> = Vec::with_capacity(44 + entries.len());
    table.extend_from_slice(b"PCMP");
    // With at most 254 vCPUs (checked above) the table is under 5.5 KiB.
    #[allow(clippy::cast_possible_truncation)]
    table.extend_from_slice(&((44 + entries.len()) as u16).to_le_bytes());
    table.push(4); // spec revision 1.4
    table.push(0); // checksum, below
    table.extend_from_slice(b"VESSEL  ");
    table.extend_from_slice(b"MICROVM     ");
    table.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    table.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&APIC_ADDR.to_le_bytes());
    table.extend_from_slice(&0u16.to_le_bytes()); // extended table length
    table.push(0); // extended table checksum
    table.push(0);
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut fp: Vec<u8> = Vec::with_capacity(16 + table.len());
    fp.extend_from_slice(b"_MP_");
    // The pointer to the configuration table is a 32-bit physical address.
    let config_addr = u32::try_from(config_addr)
        .map_err(|_| vm_memory::GuestMemoryError::InvalidGuestAddress(GuestAddress(config_addr)))?;
    fp.extend_from_slice(&config_addr.to_le_bytes());
    fp.push(1); // length in 16-byte units
    fp.push(4); // spec revision
    fp.push(0); // checksum, below
    fp.extend_from_slice(&[0; 5]); // feature bytes: 0 = configuration table present
    fp[10] = checksum(&fp);
    fp.extend_from_slice(&table);
    Ok(fp)
}

/// Writes the tables for `cpus` vCPUs at [`MPTABLE_START`].
pub fn setup<M: GuestMemory>(mem: &M, cpus: u8) -> Result<(), MptableError> {
    let bytes = build(cpus, MPTABLE_START)?;
    mem.write_slice(&bytes, GuestAddress(MPTABLE_START))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_and_counts() {
        let t = build(4, MPTABLE_START).unwrap();
        assert_eq!(&t[0..4], b"_MP_");
        assert_eq!(t[..16].iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
        let cfg = &t[16..];
        assert_eq!(&cfg[0..4], b"PCMP");
        let len = u16::from_le_bytes([cfg[4], cfg[5]]) as usize;
        assert_eq!(len, cfg.len());
        assert_eq!(cfg.iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
        let count = u16::from_le_bytes([cfg[34], cfg[35]]);
        assert_eq!(count, 4 + 1 + 1 + u16::from(IOAPIC_PINS) + 2);
        // Entry 0 is the bootstrap processor, entry 1 an application processor.
        assert_eq!(&cfg[44..48], &[0, 0, APIC_VERSION, 3]);
        assert_eq!(&cfg[64..68], &[0, 1, APIC_VERSION, 1]);
        assert!(build(0, 0).is_err());
        assert!(build(255, 0).is_err());
    }
}
