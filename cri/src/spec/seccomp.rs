//! Seccomp: the CRI profile choice (RuntimeDefault, Unconfined, Localhost, and the deprecated
//! `seccomp_profile_path` strings) turned into an OCI `linux.seccomp`, and vessel's
//! RuntimeDefault profile.
//!
//! RuntimeDefault is an allow-list with the semantics of containerd's and Docker's default
//! profile: what is not listed fails with EPERM; syscalls that only make sense with a
//! capability are allowed only where the container's bounding set holds it; without
//! CAP_SYS_ADMIN, `clone` may not create namespaces and `clone3` answers ENOSYS (so that libc
//! falls back to `clone`, whose flags a filter can see); `personality` takes only the
//! harmless personas; `socket` refuses AF_ALG and AF_VSOCK. io_uring is left out, as containerd 2.0
//! leaves it out: its requests (socket creation among them) run where no filter sees them.
//!
//! Argument comparisons are written with runc's meaning of SCMP_CMP_MASKED_EQ
//! (`arg & value == valueTwo`), as every OCI profile in the wild is; the agent hands them to
//! libcontainer in the form it expects.
//!
//! In a VM pod, vsock is how the guest reaches the host (the shim's log port): a Localhost
//! profile gets a rule refusing AF_VSOCK there too. An Unconfined container stays unfiltered
//! (`Seccomp: 0`, which upstream critest checks); what keeps it, and a privileged one, from
//! the log port is the pod's log token, which only the agent holds.

use super::{invalid, SpecError};
use serde_json::{json, Value};
use vessel_cri_api::v1 as cri;

/// The largest Localhost profile read (Docker's default profile is about 20 KiB).
const MAX_PROFILE: u64 = 1 << 20;

/// `AF_VSOCK` from <sys/socket.h>.
const AF_VSOCK: u64 = 40;

/// `AF_ALG` from <sys/socket.h>: the kernel crypto API, which containerd's default profile
/// refuses since 2026 (its sockets reached exploitable kernel code from any container).
const AF_ALG: u64 = 38;

/// `AF_MAX` of Linux 6.x: no family has this number or more.
const AF_MAX: u64 = 46;

/// The namespace flags of `clone` (NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET).
const CLONE_NS_FLAGS: u64 =
    0x0002_0000 | 0x0200_0000 | 0x0400_0000 | 0x0800_0000 | 0x1000_0000 | 0x2000_0000 | 0x4000_0000;

/// The personas `personality(2)` may switch to: Linux, UNAME26, READ_IMPLIES_EXEC-free
/// variants, and the query (0xffffffff).
const PERSONAS: &[u64] = &[0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

/// Syscalls any RuntimeDefault container may make, by what they are for. Names a kernel or
/// libseccomp does not know are skipped by the agent.
#[rustfmt::skip]
const ALLOWED: &[&[&str]] = &[
    // Files, directories, descriptors and their metadata.
    &[
        "access", "chdir", "chmod", "chown", "chown32", "close", "close_range",
        "copy_file_range", "creat", "dup", "dup2", "dup3", "faccessat", "faccessat2",
        "fadvise64", "fadvise64_64", "fallocate", "fanotify_mark", "fchdir", "fchmod",
        "fchmodat", "fchmodat2", "fchown", "fchown32", "fchownat", "fcntl", "fcntl64", "fdatasync",
        "fgetxattr", "flistxattr", "flock", "fremovexattr", "fsetxattr", "fstat", "fstat64",
        "fstatat64", "fstatfs", "fstatfs64", "fsync", "ftruncate", "ftruncate64", "futimesat",
        "getcwd", "getdents", "getdents64", "getxattr", "inotify_add_watch", "inotify_init",
        "inotify_init1", "inotify_rm_watch", "lchown", "lchown32", "lgetxattr", "link",
        "linkat", "listxattr", "llistxattr", "_llseek", "lremovexattr", "lseek", "lsetxattr",
        "lstat", "lstat64", "mkdir", "mkdirat", "mknod", "mknodat", "name_to_handle_at",
        "newfstatat", "open", "openat", "openat2", "pipe", "pipe2", "pread64", "preadv",
        "preadv2", "pwrite64", "pwritev", "pwritev2", "read", "readahead", "readlink",
        "readlinkat", "readv", "removexattr", "rename", "renameat", "renameat2", "rmdir",
        "sendfile", "sendfile64",
        "setxattr", "splice", "stat", "stat64", "statfs", "statfs64", "statx", "symlink",
        "symlinkat", "sync", "sync_file_range", "syncfs", "tee", "truncate", "truncate64",
        "umask", "unlink", "unlinkat", "utime", "utimensat", "utimensat_time64", "utimes",
        "vmsplice", "write", "writev",
        // Newer than containerd 1.7's list: glibc 2.39 implements fchmodat's
        // AT_SYMLINK_NOFOLLOW with fchmodat2 and falls back only on ENOSYS, so an EPERM
        // broke tar and chmod -h in current images.
        "cachestat", "getxattrat", "listmount", "listxattrat", "removexattrat", "setxattrat",
        "statmount",
    ],
    // Asynchronous and multiplexed I/O.
    &[
        "epoll_create", "epoll_create1", "epoll_ctl", "epoll_ctl_old", "epoll_pwait",
        "epoll_pwait2", "epoll_wait", "epoll_wait_old", "eventfd", "eventfd2", "io_cancel",
        "io_destroy", "io_getevents", "io_pgetevents", "io_pgetevents_time64", "io_setup",
        "io_submit", "ioctl", "ioprio_get", "ioprio_set", "_newselect", "poll", "ppoll",
        "ppoll_time64", "pselect6", "pselect6_time64", "select", "signalfd", "signalfd4",
        "timerfd_create", "timerfd_gettime", "timerfd_gettime64", "timerfd_settime",
        "timerfd_settime64",
    ],
    // Memory.
    &[
        "brk", "madvise", "membarrier", "memfd_create", "memfd_secret", "mincore", "mlock",
        "mlock2", "mlockall", "mmap", "mmap2", "mprotect", "mremap", "msync", "munlock",
        "munlockall", "munmap", "pkey_alloc", "pkey_free", "pkey_mprotect", "remap_file_pages",
        "map_shadow_stack", "mseal",
    ],
    // Processes, threads, credentials and limits.
    &[
        "capget", "capset", "execve", "execveat", "exit", "exit_group", "fork", "futex",
        "futex_requeue", "futex_time64", "futex_wait", "futex_waitv", "futex_wake",
        "lsm_get_self_attr", "lsm_list_modules", "lsm_set_self_attr", "uretprobe", "get_robust_list", "get_thread_area", "getcpu",
        "getegid", "getegid32", "geteuid", "geteuid32", "getgid", "getgid32", "getgroups",
        "getgroups32", "getpgid", "getpgrp", "getpid", "getppid", "getpriority", "getrandom",
        "getresgid", "getresgid32", "getresuid", "getresuid32", "getrlimit", "getrusage",
        "getsid", "gettid", "getuid", "getuid32", "landlock_add_rule",
        "landlock_create_ruleset", "landlock_restrict_self", "pidfd_open", "pidfd_send_signal",
        "prctl", "prlimit64", "process_mrelease", "rseq", "seccomp", "set_robust_list",
        "set_thread_area", "set_tid_address", "setfsgid", "setfsgid32", "setfsuid",
        "setfsuid32", "setgid", "setgid32", "setgroups", "setgroups32", "setpgid",
        "setpriority", "setregid", "setregid32", "setresgid", "setresgid32", "setresuid",
        "setresuid32", "setreuid", "setreuid32", "setrlimit", "setsid", "setuid", "setuid32",
        "ugetrlimit", "uname", "vfork", "wait4", "waitid", "waitpid", "sysinfo",
        // Harmless since Linux 4.8 (ptrace can no longer bypass seccomp).
        "ptrace", "process_vm_readv", "process_vm_writev",
    ],
    // Signals.
    &[
        "kill", "pause", "restart_syscall", "rt_sigaction", "rt_sigpending", "rt_sigprocmask",
        "rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait",
        "rt_sigtimedwait_time64", "rt_tgsigqueueinfo", "sigaltstack", "sigprocmask",
        "sigreturn", "tgkill", "tkill",
    ],
    // Clocks and timers (reading them; setting the clock needs CAP_SYS_TIME).
    &[
        "adjtimex", "alarm", "clock_adjtime", "clock_adjtime64", "clock_getres",
        "clock_getres_time64", "clock_gettime", "clock_gettime64", "clock_nanosleep",
        "clock_nanosleep_time64", "getitimer", "gettimeofday", "nanosleep", "setitimer",
        "time", "timer_create", "timer_delete", "timer_getoverrun", "timer_gettime",
        "timer_gettime64", "timer_settime", "timer_settime64", "times",
    ],
    // Sockets (`socket` itself is below: not for AF_ALG nor AF_VSOCK).
    &[
        "accept", "accept4", "bind", "connect", "getpeername", "getsockname", "getsockopt",
        "listen", "recv", "recvfrom", "recvmmsg", "recvmmsg_time64", "recvmsg", "send",
        "sendmmsg", "sendmsg", "sendto", "setsockopt", "shutdown", "socketpair",
    ],
    // System V and POSIX IPC.
    &[
        "ipc", "mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive",
        "mq_timedreceive_time64", "mq_timedsend", "mq_timedsend_time64", "mq_unlink", "msgctl",
        "msgget", "msgrcv", "msgsnd", "semctl", "semget", "semop", "semtimedop",
        "semtimedop_time64", "shmat", "shmctl", "shmdt", "shmget",
    ],
    // Scheduling.
    &[
        "sched_get_priority_max", "sched_get_priority_min", "sched_getaffinity",
        "sched_getattr", "sched_getparam", "sched_getscheduler", "sched_rr_get_interval",
        "sched_rr_get_interval_time64", "sched_setaffinity", "sched_setattr",
        "sched_setparam", "sched_setscheduler", "sched_yield",
    ],
    // x86 thread-local storage and segment set-up.
    &["arch_prctl", "modify_ldt"],
];

/// Syscalls RuntimeDefault allows only to a container whose bounding set holds the capability.
#[rustfmt::skip]
const BY_CAPABILITY: &[(&str, &[&str])] = &[
    ("CAP_DAC_READ_SEARCH", &["open_by_handle_at"]),
    (
        "CAP_SYS_ADMIN",
        &[
            "bpf", "clone", "clone3", "fanotify_init", "fsconfig", "fsmount", "fsopen", "fspick",
            "lookup_dcookie", "mount", "mount_setattr", "move_mount", "open_tree",
            "perf_event_open", "quotactl", "quotactl_fd", "setdomainname", "sethostname",
            "setns", "syslog", "umount", "umount2", "unshare",
        ],
    ),
    ("CAP_SYS_BOOT", &["reboot"]),
    ("CAP_SYS_CHROOT", &["chroot"]),
    ("CAP_SYS_MODULE", &["delete_module", "init_module", "finit_module"]),
    ("CAP_SYS_PACCT", &["acct"]),
    (
        "CAP_SYS_PTRACE",
        &["kcmp", "pidfd_getfd", "process_madvise"],
    ),
    ("CAP_SYS_RAWIO", &["iopl", "ioperm"]),
    (
        "CAP_SYS_TIME",
        &["settimeofday", "stime", "clock_settime", "clock_settime64"],
    ),
    ("CAP_SYS_TTY_CONFIG", &["vhangup"]),
    (
        "CAP_SYS_NICE",
        &["get_mempolicy", "mbind", "set_mempolicy", "set_mempolicy_home_node"],
    ),
    ("CAP_SYSLOG", &["syslog"]),
    ("CAP_BPF", &["bpf"]),
    ("CAP_PERFMON", &["perf_event_open"]),
];

/// The OCI `linux.seccomp` for a container: `None` runs it unfiltered. `bounding` is its
/// final bounding capability set; `vm_guest` says it runs inside a VM pod's guest.
pub(super) fn profile(
    sc: Option<&cri::LinuxContainerSecurityContext>,
    privileged: bool,
    bounding: &[String],
    vm_guest: bool,
) -> Result<Option<Value>, SpecError> {
    if privileged {
        return Ok(None);
    }
    use cri::security_profile::ProfileType;
    let chosen = chosen(sc)?;
    let kind = chosen
        .as_ref()
        .map(|p| ProfileType::try_from(p.profile_type).unwrap_or(ProfileType::Unconfined))
        .unwrap_or(ProfileType::Unconfined);
    let mut filter = match kind {
        ProfileType::Unconfined => return Ok(None),
        ProfileType::RuntimeDefault => runtime_default(bounding),
        ProfileType::Localhost => {
            let path = chosen.map(|p| p.localhost_ref).unwrap_or_default();
            localhost(path.trim())?
        }
    };
    if vm_guest && kind == ProfileType::Localhost {
        refuse_vsock(&mut filter);
    }
    Ok(Some(filter))
}

/// The profile the container asks for: the `seccomp` field, or else the deprecated string
/// form (runtime/default, docker/default, unconfined, localhost/<path>) older kubelets send.
fn chosen(
    sc: Option<&cri::LinuxContainerSecurityContext>,
) -> Result<Option<cri::SecurityProfile>, SpecError> {
    use cri::security_profile::ProfileType;
    if let Some(p) = sc.and_then(|s| s.seccomp.as_ref()) {
        return Ok(Some(p.clone()));
    }
    #[allow(deprecated)]
    let old = sc
        .map(|s| s.seccomp_profile_path.trim())
        .unwrap_or_default();
    let of = |t: ProfileType, r: &str| {
        Some(cri::SecurityProfile {
            profile_type: t as i32,
            localhost_ref: r.to_string(),
        })
    };
    Ok(match old {
        "" => None,
        "runtime/default" | "docker/default" => of(ProfileType::RuntimeDefault, ""),
        "unconfined" => of(ProfileType::Unconfined, ""),
        _ => match old.strip_prefix("localhost/") {
            Some(p) if !p.is_empty() => of(ProfileType::Localhost, p),
            _ => {
                return Err(invalid(format!(
                    "seccomp profile path {old:?} is not runtime/default, unconfined or localhost/<path>"
                )))
            }
        },
    })
}

/// A Localhost profile: an OCI `linux.seccomp` JSON file on the node.
fn localhost(path: &str) -> Result<Value, SpecError> {
    use std::io::Read as _;
    let err = |e: &dyn std::fmt::Display| invalid(format!("seccomp profile {path:?}: {e}"));
    let f = std::fs::File::open(path).map_err(|e| err(&e))?;
    // A profile is a regular file of JSON: not a device to read forever (/dev/zero), not
    // something larger than any profile.
    if !f.metadata().map_err(|e| err(&e))?.is_file() {
        return Err(err(&"not a regular file"));
    }
    let mut data = Vec::new();
    f.take(MAX_PROFILE + 1)
        .read_to_end(&mut data)
        .map_err(|e| err(&e))?;
    if data.len() as u64 > MAX_PROFILE {
        return Err(err(&format!("larger than {MAX_PROFILE} bytes")));
    }
    let v: Value = serde_json::from_slice(&data).map_err(|e| err(&e))?;
    if v.get("defaultAction").and_then(Value::as_str).is_none() {
        return Err(invalid(format!(
            "seccomp profile {path:?} has no defaultAction"
        )));
    }
    if v.get("syscalls").is_some_and(|s| !s.is_array()) {
        return Err(invalid(format!(
            "seccomp profile {path:?}: syscalls is not a list"
        )));
    }
    Ok(v)
}

fn arg(index: u32, value: u64, op: &str) -> Value {
    json!({"index": index, "value": value, "op": op})
}

/// vessel's RuntimeDefault profile for a container with this bounding set.
pub fn runtime_default(bounding: &[String]) -> Value {
    let has = |c: &str| bounding.iter().any(|b| b == c);
    let mut allowed: Vec<&str> = ALLOWED.iter().flat_map(|g| g.iter().copied()).collect();
    for (cap, names) in BY_CAPABILITY {
        if has(cap) {
            allowed.extend(names.iter().copied());
        }
    }
    allowed.sort_unstable();
    allowed.dedup();
    // Every family but AF_ALG and AF_VSOCK, one condition a rule (several conditions on one
    // argument are read as "any of them" by runc): below AF_ALG, then each known family
    // above it by its number. The comparison is of 64 bits, while the kernel reads an int:
    // "greater than" would let 0x1_0000_0026 through as AF_ALG.
    let mut rules = vec![
        json!({"names": allowed, "action": "SCMP_ACT_ALLOW"}),
        json!({"names": ["socket"], "action": "SCMP_ACT_ALLOW",
               "args": [arg(0, AF_ALG, "SCMP_CMP_LT")]}),
    ];
    for family in (AF_ALG + 1..AF_MAX).filter(|f| *f != AF_VSOCK) {
        rules.push(json!({"names": ["socket"], "action": "SCMP_ACT_ALLOW",
                          "args": [arg(0, family, "SCMP_CMP_EQ")]}));
    }
    // 32-bit socketcall carries the family where no filter can read it: ENOSYS (not the
    // default EPERM, or runc drops the rule), as moby's and containerd's profiles now have
    // it; a current libc makes the direct socket calls (Linux 4.3+), which the rules above
    // see.
    rules.push(json!({"names": ["socketcall"], "action": "SCMP_ACT_ERRNO",
                      "errnoRet": libc::ENOSYS}));
    for p in PERSONAS {
        rules.push(json!({"names": ["personality"], "action": "SCMP_ACT_ALLOW",
                          "args": [arg(0, *p, "SCMP_CMP_EQ")]}));
    }
    if !has("CAP_SYS_ADMIN") {
        // clone without namespace flags; clone3 hides its flags in memory a filter cannot
        // read, so it answers ENOSYS and libc falls back to clone.
        rules.push(json!({"names": ["clone"], "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": CLONE_NS_FLAGS, "valueTwo": 0,
                      "op": "SCMP_CMP_MASKED_EQ"}]}));
        rules.push(json!({"names": ["clone3"], "action": "SCMP_ACT_ERRNO",
                          "errnoRet": libc::ENOSYS}));
    }
    json!({
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": libc::EPERM,
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": rules,
    })
}

/// Makes a Localhost profile refuse AF_VSOCK sockets: a profile that allows by default gets
/// a rule refusing them; an unconditional allow of `socket` becomes an allow of every other
/// family. (A `socket` rule that already compares the family is left as the profile says.)
fn refuse_vsock(filter: &mut Value) {
    let allows_by_default = filter["defaultAction"] == "SCMP_ACT_ALLOW";
    if !filter["syscalls"].is_array() {
        filter["syscalls"] = json!([]);
    }
    let Some(rules) = filter["syscalls"].as_array_mut() else {
        return;
    };
    if allows_by_default {
        // The low 32 bits, which the kernel reads: 0x1_0000_0028 is AF_VSOCK too.
        rules.push(json!({"names": ["socket"], "action": "SCMP_ACT_ERRNO",
            "errnoRet": libc::EPERM, "args": [{"index": 0, "value": 0xffff_ffffu64,
            "valueTwo": AF_VSOCK, "op": "SCMP_CMP_MASKED_EQ"}]}));
        return;
    }
    let mut split = Vec::new();
    for r in rules.iter_mut() {
        let unconditional = r
            .get("args")
            .and_then(Value::as_array)
            .is_none_or(|a| a.is_empty());
        if r["action"] != "SCMP_ACT_ALLOW" || !unconditional {
            continue;
        }
        let Some(names) = r.get_mut("names").and_then(Value::as_array_mut) else {
            continue;
        };
        let before = names.len();
        names.retain(|n| n != "socket");
        if names.len() != before {
            // Every family below AF_VSOCK, and each above it by its number ("not equal"
            // compares 64 bits: 0x1_0000_0028 would pass as AF_VSOCK).
            split.push(json!({"names": ["socket"], "action": "SCMP_ACT_ALLOW",
                              "args": [arg(0, AF_VSOCK, "SCMP_CMP_LT")]}));
            for family in AF_VSOCK + 1..AF_MAX {
                split.push(json!({"names": ["socket"], "action": "SCMP_ACT_ALLOW",
                                  "args": [arg(0, family, "SCMP_CMP_EQ")]}));
            }
        }
    }
    rules.extend(split);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names_allowed(p: &Value) -> Vec<String> {
        p["syscalls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["action"] == "SCMP_ACT_ALLOW" && r.get("args").is_none())
            .flat_map(|r| r["names"].as_array().unwrap().clone())
            .map(|n| n.as_str().unwrap().to_string())
            .collect()
    }

    fn caps(c: &[&str]) -> Vec<String> {
        c.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn runtime_default_is_an_allow_list_gated_by_capabilities() {
        let p = runtime_default(&caps(super::super::DEFAULT_CAPS));
        assert_eq!(p["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(p["defaultErrnoRet"], libc::EPERM);
        let allowed = names_allowed(&p);
        for n in ["read", "pipe", "execve", "futex", "chroot", "ptrace"] {
            assert!(allowed.iter().any(|a| a == n), "{n} not allowed");
        }
        // Not listed at all, or gated by a capability the default set lacks.
        for n in [
            "mount",
            "unshare",
            "setns",
            "keyctl",
            "add_key",
            "kexec_load",
            "reboot",
            "init_module",
            "bpf",
            "clone",
            "clone3",
            "socket",
            "personality",
            "swapon",
            "settimeofday",
            "io_uring_setup",
            "userfaultfd",
        ] {
            assert!(!allowed.iter().any(|a| a == n), "{n} allowed");
        }
        let rules = p["syscalls"].as_array().unwrap();
        let clone = rules
            .iter()
            .find(|r| r["names"] == json!(["clone"]))
            .unwrap();
        assert_eq!(clone["args"][0]["value"], CLONE_NS_FLAGS);
        assert_eq!(clone["args"][0]["valueTwo"], 0);
        let clone3 = rules
            .iter()
            .find(|r| r["names"] == json!(["clone3"]))
            .unwrap();
        assert_eq!(clone3["errnoRet"], libc::ENOSYS);
        // socket: every family but AF_ALG (38) and AF_VSOCK (40).
        let socket: Vec<_> = rules
            .iter()
            .filter(|r| r["names"] == json!(["socket"]))
            .collect();
        let allows = |family: u64| {
            socket.iter().any(|r| {
                let (v, op) = (r["args"][0]["value"].as_u64().unwrap(), &r["args"][0]["op"]);
                assert_eq!(r["args"].as_array().unwrap().len(), 1, "{r}");
                match op.as_str().unwrap() {
                    "SCMP_CMP_LT" => family < v,
                    "SCMP_CMP_EQ" => family == v,
                    o => panic!("{o}"),
                }
            })
        };
        for (family, want) in [(1, true), (2, true), (10, true), (16, true), (17, true)] {
            assert_eq!(allows(family), want, "family {family}");
        }
        for (family, want) in [(37, true), (38, false), (39, true), (40, false), (44, true)] {
            assert_eq!(allows(family), want, "family {family}");
        }
        // The kernel reads an int: high bits must not carry AF_ALG or AF_VSOCK past a rule.
        for family in [(1 << 32) | 38, (1 << 32) | 40, u64::MAX] {
            assert!(!allows(family), "family {family:#x}");
        }
        let socketcall = rules
            .iter()
            .find(|r| r["names"] == json!(["socketcall"]))
            .unwrap();
        assert_eq!(socketcall["errnoRet"], libc::ENOSYS);
        assert!(!allowed.iter().any(|a| a == "socketcall"));
        // What containerd's list gained since 1.7: refused with EPERM, glibc's fchmodat2
        // fallback (on ENOSYS only) never ran, and tar failed.
        for n in [
            "fchmodat2",
            "cachestat",
            "futex_wait",
            "futex_wake",
            "futex_requeue",
            "map_shadow_stack",
            "mseal",
            "statmount",
            "listmount",
            "lsm_get_self_attr",
        ] {
            assert!(allowed.iter().any(|a| a == n), "{n} not allowed");
        }

        let admin = runtime_default(&caps(&["CAP_SYS_ADMIN", "CAP_SYS_TIME"]));
        let allowed = names_allowed(&admin);
        for n in [
            "mount",
            "unshare",
            "setns",
            "clone",
            "clone3",
            "sethostname",
            "settimeofday",
        ] {
            assert!(
                allowed.iter().any(|a| a == n),
                "{n} not allowed with CAP_SYS_ADMIN"
            );
        }
        assert!(
            !allowed.iter().any(|a| a == "chroot"),
            "chroot without CAP_SYS_CHROOT"
        );
        let rules = admin["syscalls"].as_array().unwrap();
        assert!(!rules.iter().any(|r| r["names"] == json!(["clone3"])));
    }

    fn sc(t: cri::security_profile::ProfileType, r: &str) -> cri::LinuxContainerSecurityContext {
        cri::LinuxContainerSecurityContext {
            seccomp: Some(cri::SecurityProfile {
                profile_type: t as i32,
                localhost_ref: r.into(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn vm_guests_refuse_vsock_under_a_profile() {
        use cri::security_profile::ProfileType;
        let c = caps(super::super::DEFAULT_CAPS);
        // Unconfined: no filter, on the host and in a guest.
        let u = sc(ProfileType::Unconfined, "");
        for vm in [false, true] {
            assert!(profile(Some(&u), false, &c, vm).unwrap().is_none());
            assert!(profile(None, false, &c, vm).unwrap().is_none());
        }
        // Privileged: nothing anywhere.
        assert!(profile(None, true, &c, true).unwrap().is_none());

        let d = tempfile::tempdir().unwrap();
        // An allow-by-default Localhost profile gets a refusing rule.
        let p = d.path().join("deny.json");
        std::fs::write(&p, r#"{"defaultAction":"SCMP_ACT_ALLOW","syscalls":[{"names":["sethostname"],"action":"SCMP_ACT_ERRNO"}]}"#).unwrap();
        let l = sc(ProfileType::Localhost, p.to_str().unwrap());
        let host = profile(Some(&l), false, &c, false).unwrap().unwrap();
        assert_eq!(host["syscalls"].as_array().unwrap().len(), 1);
        let guest = profile(Some(&l), false, &c, true).unwrap().unwrap();
        let rules = guest["syscalls"].as_array().unwrap();
        assert_eq!(rules.len(), 2);
        assert_eq!(rules[1]["action"], "SCMP_ACT_ERRNO");
        assert_eq!(rules[1]["args"][0]["op"], "SCMP_CMP_MASKED_EQ");
        assert_eq!(rules[1]["args"][0]["value"], 0xffff_ffffu64);
        assert_eq!(rules[1]["args"][0]["valueTwo"], AF_VSOCK);
        // An allow-list that allows socket outright: socket moves to a rule without vsock.
        let p = d.path().join("allow.json");
        std::fs::write(&p, r#"{"defaultAction":"SCMP_ACT_ERRNO","syscalls":[{"names":["read","socket"],"action":"SCMP_ACT_ALLOW"}]}"#).unwrap();
        let l = sc(ProfileType::Localhost, p.to_str().unwrap());
        let guest = profile(Some(&l), false, &c, true).unwrap().unwrap();
        let rules = guest["syscalls"].as_array().unwrap();
        assert_eq!(rules[0]["names"], json!(["read"]));
        assert_eq!(rules[1]["names"], json!(["socket"]));
        assert_eq!(rules[1]["args"][0]["op"], "SCMP_CMP_LT");
        assert_eq!(rules[1]["args"][0]["value"], AF_VSOCK);
        let eq: Vec<u64> = rules[2..]
            .iter()
            .map(|r| r["args"][0]["value"].as_u64().unwrap())
            .collect();
        assert_eq!(eq, (41..46).collect::<Vec<_>>());
        // RuntimeDefault refuses vsock on its own.
        let rd = sc(ProfileType::RuntimeDefault, "");
        assert_eq!(
            profile(Some(&rd), false, &c, true).unwrap(),
            profile(Some(&rd), false, &c, false).unwrap()
        );
    }

    #[test]
    fn a_bad_localhost_profile_is_refused_naming_it() {
        use cri::security_profile::ProfileType;
        let (_d, p) = crate::testing::temp_path("bad.json");
        std::fs::write(&p, r#"{"syscalls":[]}"#).unwrap();
        let l = sc(ProfileType::Localhost, p.to_str().unwrap());
        let e = profile(Some(&l), false, &[], false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad.json") && e.contains("defaultAction"), "{e}");
        std::fs::write(&p, "not json").unwrap();
        let e = profile(Some(&l), false, &[], false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad.json"), "{e}");
    }
}
