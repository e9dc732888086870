//! The jailed VMM's seccomp filter (rust-vmm's `seccompiler`), on every thread once the VM is
//! built: the system calls a VMM never makes after that, and that a guest which took over
//! a device thread would want first, fail with EPERM. New namespaces, mounts and root
//! changes, running programs or forking, tracing or reading other processes, kernel modules,
//! kexec, BPF, perf, keyrings, io_uring, userfaultfd, clocks, swap and reboot. Threads may
//! still start (`clone` with `CLONE_THREAD` and no namespace flag); `clone3`, whose flags a
//! filter cannot read, answers ENOSYS, so that the C library falls back to `clone`.
//!
//! Not yet: an allow-list per thread kind (vCPU, device worker, file server, control), as
//! Firecracker has. Their syscall sets are not measured yet.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

#[derive(Debug, thiserror::Error)]
#[error("seccomp filter: {0}")]
pub struct SeccompError(String);

/// Refused with EPERM whatever their arguments.
const DENIED: &[libc::c_long] = &[
    // Namespaces, mounts, roots.
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    // Other programs and processes.
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_fork,
    libc::SYS_vfork,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_pidfd_getfd,
    libc::SYS_kcmp,
    // The kernel itself.
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_userfaultfd,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_syslog,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_lookup_dcookie,
    libc::SYS_uselib,
    // The machine.
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_sethostname,
    libc::SYS_setdomainname,
    libc::SYS_vhangup,
];

const NAMESPACE_FLAGS: [libc::c_int; 8] = [
    libc::CLONE_NEWNS,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWCGROUP,
    0x80, // CLONE_NEWTIME
];

fn rule(c: Vec<SeccompCondition>) -> Result<SeccompRule, SeccompError> {
    SeccompRule::new(c).map_err(|e| SeccompError(e.to_string()))
}

fn flag_is(flag: libc::c_int, set: bool) -> Result<SeccompCondition, SeccompError> {
    let f = u64::from(flag.unsigned_abs());
    SeccompCondition::new(
        0,
        SeccompCmpArgLen::Qword,
        SeccompCmpOp::MaskedEq(f),
        if set { f } else { 0 },
    )
    .map_err(|e| SeccompError(e.to_string()))
}

fn compile(rules: BTreeMap<i64, Vec<SeccompRule>>, errno: i32) -> Result<BpfProgram, SeccompError> {
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e: seccompiler::BackendError| SeccompError(e.to_string()))?;
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(errno.unsigned_abs()),
        arch,
    )
    .map_err(|e| SeccompError(e.to_string()))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| SeccompError(e.to_string()))
}

/// Refuses every system call made through the x32 ABI (numbers with bit 30 set): they carry
/// the x86_64 architecture, and a deny-list matches only the x86_64 numbers. Hand-written,
/// as seccompiler (made for allow-lists) checks the architecture only.
fn no_x32() -> BpfProgram {
    const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    const X32_BIT: u32 = 0x4000_0000;
    const RET_ERRNO: u32 = 0x0005_0000; // SECCOMP_RET_ERRNO
    const RET_ALLOW: u32 = 0x7fff_0000; // SECCOMP_RET_ALLOW
    let op = |code, jt, jf, k| seccompiler::sock_filter { code, jt, jf, k };
    vec![
        // offsetof(struct seccomp_data, nr) is 0.
        op(LD_W_ABS, 0, 0, 0),
        op(JGE_K, 0, 1, X32_BIT),
        op(RET_K, 0, 0, RET_ERRNO | libc::EPERM.unsigned_abs()),
        op(RET_K, 0, 0, RET_ALLOW),
    ]
}

/// The filters, in the order they are installed.
pub fn programs() -> Result<Vec<BpfProgram>, SeccompError> {
    let mut denied: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|s| (*s, Vec::new())).collect();
    // clone: a thread (CLONE_THREAD) without a namespace flag; anything else is a new
    // process or namespace.
    let mut clone = vec![rule(vec![flag_is(libc::CLONE_THREAD, false)?])?];
    for f in NAMESPACE_FLAGS {
        clone.push(rule(vec![flag_is(f, true)?])?);
    }
    denied.insert(libc::SYS_clone, clone);
    let clone3: BTreeMap<i64, Vec<SeccompRule>> =
        [(libc::SYS_clone3, Vec::new())].into_iter().collect();
    Ok(vec![
        no_x32(),
        compile(denied, libc::EPERM)?,
        compile(clone3, libc::ENOSYS)?,
    ])
}

/// Installs the filters on every thread of the process (TSYNC); threads started later
/// inherit them. Sets `no_new_privs` (a filter needs it).
pub fn install() -> Result<(), SeccompError> {
    for p in programs()? {
        seccompiler::apply_filter_all_threads(&p).map_err(|e| SeccompError(e.to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filters_compile_for_this_machine() {
        let p = programs().unwrap();
        assert_eq!(p.len(), 3);
        assert!(p[1].len() > DENIED.len());
    }
}
