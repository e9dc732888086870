//! Per-thread capabilities. Linux keeps capabilities per thread, and a new thread starts with
//! its creator's: each VMM thread keeps only what its own work needs ([`set_thread`]). The
//! virtio-fs servers keep [`FILE_SERVER_CAPS`]; every other device worker, the vCPUs and the
//! shim's own threads keep none.

/// The capabilities a passthrough file server needs (virtiofsd keeps the same): to act for
/// any guest user on files (chown, DAC override, owner checks, setgid bits, mknod, file
/// capabilities) and to switch to the guest's uid/gid per request. Bits of `CAP_*`.
pub const FILE_SERVER_CAPS: u32 = (1 << 0) // CAP_CHOWN
    | (1 << 1) // CAP_DAC_OVERRIDE
    | (1 << 3) // CAP_FOWNER
    | (1 << 4) // CAP_FSETID
    | (1 << 6) // CAP_SETGID
    | (1 << 7) // CAP_SETUID
    | (1 << 27) // CAP_MKNOD
    | (1 << 31); // CAP_SETFCAP

#[repr(C)]
struct Header {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Data {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const VERSION_3: u32 = 0x2008_0522;

/// Keeps only `keep` (capabilities 0-31) of the calling thread's effective and permitted
/// sets; inheritable none. Capabilities cannot come back once dropped.
pub fn set_thread(keep: u32) -> std::io::Result<()> {
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let data = [
        Data {
            effective: keep,
            permitted: keep,
            inheritable: 0,
        },
        Data::default(),
    ];
    // SAFETY: capset reads a v3 header and two data structs that live across the call; pid 0
    // is the calling thread.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return Err(std::io::Error::new(e.kind(), format!("capset: {e}")));
    }
    Ok(())
}

/// Drops every capability of the calling thread.
pub fn drop_all() -> std::io::Result<()> {
    set_thread(0)
}

/// The calling thread's effective capabilities (all 64 bits).
pub fn effective() -> std::io::Result<u64> {
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget writes two data structs that live across the call; pid 0 is the
    // calling thread.
    let r = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut Header,
            data.as_mut_ptr(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(u64::from(data[0].effective) | (u64::from(data[1].effective) << 32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_drops_its_own_capabilities_only() {
        let before = effective().unwrap();
        let t = std::thread::spawn(|| {
            set_thread(FILE_SERVER_CAPS).unwrap();
            let kept = effective().unwrap();
            drop_all().unwrap();
            (kept, effective().unwrap())
        });
        let (kept, none) = t.join().unwrap();
        assert_eq!(kept, before & u64::from(FILE_SERVER_CAPS));
        assert_eq!(none, 0);
        assert_eq!(
            effective().unwrap(),
            before,
            "the other threads keep theirs"
        );
    }
}
