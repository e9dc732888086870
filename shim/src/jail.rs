//! The shim's jail (docs/vm-pods.md, "The shim's jail"), as Firecracker's jailer confines
//! its VMM: the VMM runs as pid 1 of its own pid namespace, in its own mount, IPC, UTS and
//! network namespaces (its taps are opened before), with a root that holds
//! only what its spec names: its VM directory (sockets, console, logs, the volume share), the
//! kernel, initrd and disk images read-only, `/dev/kvm`, and a `/proc` that shows its own
//! pid namespace only. It cannot gain privileges (`no_new_privs`); each thread then drops
//! the capabilities its work does not need (`vessel_vmm::caps`). What it needs later from
//! outside (layer images, container log files) vesseld sends as open descriptors.
//!
//! The process vesseld started stays outside as the VMM's supervisor: it forwards SIGTERM
//! and SIGINT, exits with the VMM's status, and its death kills the VMM (`PDEATHSIG`).

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::Spec;

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("jail: {what}: {source}")]
    Sys {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("jail: {0}")]
    Plan(String),
}

fn sys(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> JailError {
    let what = what.into();
    move |source| JailError::Sys { what, source }
}

fn check(r: libc::c_int, what: impl Into<String>) -> Result<(), JailError> {
    if r < 0 {
        Err(sys(what)(std::io::Error::last_os_error()))
    } else {
        Ok(())
    }
}

fn cstr(p: &Path) -> Result<CString, JailError> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| JailError::Plan(format!("{} has a NUL byte", p.display())))
}

/// How a host path appears in the jail, at the same path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// A directory the VMM writes in (recursively: mounts under it come along).
    Dir,
    /// A file the VMM only reads.
    ReadOnly,
    /// A file the VMM reads and writes.
    ReadWrite,
    /// A device node.
    Device,
}

/// What a jail holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub binds: Vec<(PathBuf, Access)>,
    /// Files under a bound directory that the VMM must not change (its spec: vesseld reads
    /// it back to clean up after the shim).
    pub protect: Vec<PathBuf>,
}

impl Plan {
    /// The jail for a spec read from `spec_path`.
    pub fn for_spec(spec: &Spec, spec_path: &Path) -> Plan {
        let mut dirs: Vec<PathBuf> = Vec::new();
        let parent = |p: &Path| p.parent().map(Path::to_path_buf);
        if let Some(v) = &spec.vm.vsock {
            dirs.extend(parent(&v.uds_path));
        }
        for p in [&spec.shim.control_socket, &spec.shim.log_file]
            .into_iter()
            .flatten()
        {
            dirs.extend(parent(p));
        }
        if let vessel_vmm::vm::Console::File(p) = &spec.vm.console {
            dirs.extend(parent(p));
        }
        dirs.extend(spec.vm.shared_dirs.iter().map(|s| s.path.clone()));
        dirs.sort();
        dirs.dedup();
        // A directory under another one comes with it (a recursive bind).
        let dirs: Vec<PathBuf> = dirs
            .iter()
            .filter(|d| !dirs.iter().any(|o| o != *d && d.starts_with(o)))
            .cloned()
            .collect();
        let inside = |p: &Path| dirs.iter().any(|d| p.starts_with(d));
        let mut binds: Vec<(PathBuf, Access)> =
            dirs.iter().map(|d| (d.clone(), Access::Dir)).collect();
        let mut files: Vec<(PathBuf, Access)> = Vec::new();
        files.push((spec.vm.kernel.clone(), Access::ReadOnly));
        files.extend(spec.vm.initrd.iter().map(|i| (i.clone(), Access::ReadOnly)));
        for d in &spec.vm.disks {
            let a = if d.read_only {
                Access::ReadOnly
            } else {
                Access::ReadWrite
            };
            files.push((d.path.clone(), a));
        }
        let mut protect = Vec::new();
        for (p, a) in files {
            if inside(&p) {
                // Seen through its directory, which is writable: a read-only file there is
                // bound read-only on top.
                if a == Access::ReadOnly {
                    protect.push(p);
                }
            } else if !binds.iter().any(|(b, _)| *b == p) {
                binds.push((p, a));
            }
        }
        binds.push((spec.vm.kvm_device.clone(), Access::Device));
        if inside(spec_path) {
            protect.push(spec_path.to_path_buf());
        }
        Plan { binds, protect }
    }

    /// The plan's paths must be absolute: the jail binds each at its own path.
    fn check(&self) -> Result<(), JailError> {
        match self.binds.iter().find(|(p, _)| !p.is_absolute()) {
            Some((p, _)) => Err(JailError::Plan(format!(
                "{}: a jailed VM needs absolute paths",
                p.display()
            ))),
            None => Ok(()),
        }
    }
}

/// Forks the VMM into a new pid namespace. Returns in the VMM (pid 1 there). The calling
/// process becomes its supervisor and never returns: it forwards SIGTERM/SIGINT and exits
/// with the VMM's exit status (128 + the signal if a signal ended it). Call while the
/// process has one thread.
pub fn fork_into_pid_namespace() -> Result<(), JailError> {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    // The VMM watches this to end itself if the supervisor died before PDEATHSIG was armed.
    // SAFETY: pidfd_open on our own pid; the fd it returns is owned below.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, me, 0) };
    if pidfd < 0 {
        return Err(sys("pidfd_open")(std::io::Error::last_os_error()));
    }
    let pidfd = libc::c_int::try_from(pidfd)
        .map_err(|_| JailError::Plan(format!("pidfd_open returned {pidfd}")))?;
    // SAFETY: pidfd_open returned a new fd nobody else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    // SAFETY: sigset_t is plain data set up by sigemptyset/sigaddset before use.
    let (set, old) = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGTERM, libc::SIGINT, libc::SIGCHLD] {
            libc::sigaddset(&mut set, s);
        }
        libc::sigprocmask(libc::SIG_BLOCK, &set, &mut old);
        (set, old)
    };
    // A SIGCHLD ignored by whoever started us (that survives exec) would reap the VMM
    // before the supervisor could read its status.
    // SAFETY: resets one signal's disposition to the default; no handler is involved.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) };
    // SAFETY: unshare(CLONE_NEWPID) only decides the namespace of our next child.
    check(unsafe { libc::unshare(libc::CLONE_NEWPID) }, "unshare(pid)")?;
    // SAFETY: the process has one thread (the caller's promise), so the child may do
    // anything after fork.
    let child = unsafe { libc::fork() };
    check(child, "fork")?;
    if child == 0 {
        check(
            // SAFETY: prctl with an integer argument.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) },
            "PDEATHSIG",
        )?;
        let mut p = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd that lives across the call.
        if unsafe { libc::poll(&mut p, 1, 0) } != 0 {
            // The supervisor is gone already.
            std::process::exit(1);
        }
        drop(pidfd);
        // Its own process group: a terminal's ^C reaches it once, through the supervisor.
        // SAFETY: setpgid(0, 0) moves only the calling process.
        unsafe { libc::setpgid(0, 0) };
        // SAFETY: restores the mask the caller had (SIGCHLD unblocked again if it was).
        unsafe { libc::sigprocmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
        crate::set_host_pid(me.unsigned_abs());
        return Ok(());
    }
    drop(pidfd);
    // The supervisor needs no capability to signal its own child.
    let _ = vessel_vmm::caps::drop_all();
    supervise(child, &set)
}

fn supervise(child: libc::pid_t, set: &libc::sigset_t) -> ! {
    loop {
        // SAFETY: `set` is an initialised signal set; the info pointer may be null.
        let sig = unsafe { libc::sigwaitinfo(set, std::ptr::null_mut()) };
        match sig {
            libc::SIGTERM | libc::SIGINT => {
                // SAFETY: kill of our own child, which we have not reaped.
                unsafe { libc::kill(child, sig) };
            }
            _ => loop {
                let mut status = 0;
                // SAFETY: waitpid on our own child with a valid status pointer.
                let r = unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) };
                if r == child {
                    if libc::WIFEXITED(status) {
                        std::process::exit(libc::WEXITSTATUS(status));
                    }
                    if libc::WIFSIGNALED(status) {
                        std::process::exit(128 + libc::WTERMSIG(status));
                    }
                    continue;
                }
                if r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD) {
                    std::process::exit(1);
                }
                break;
            },
        }
    }
}

/// Confines the calling process (one thread; the VMM after
/// [`fork_into_pid_namespace`]) to `plan`: its own mount, IPC, UTS and network namespaces,
/// a root holding the plan's paths at their own paths, `/proc` of its pid namespace, and
/// `no_new_privs`.
pub fn confine(plan: &Plan) -> Result<(), JailError> {
    plan.check()?;
    let flags = libc::CLONE_NEWNS | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS | libc::CLONE_NEWNET;
    // SAFETY: unshare of namespaces for this single-threaded process.
    check(unsafe { libc::unshare(flags) }, "unshare")?;
    // Host mounts still propagate in (volumes mounted into the share later), ours never out.
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_SLAVE,
        None,
    )
    .map_err(sys("making / a slave"))?;
    let base = ["/mnt", "/srv", "/media", "/opt", "/tmp", "/run"]
        .iter()
        .map(Path::new)
        .find(|b| {
            // Not above a path to bind, as named or through links: the tmpfs would hide it.
            let above = |p: &Path| {
                p.starts_with(b)
                    || std::fs::canonicalize(p).is_ok_and(|c| c.starts_with(b))
                    || p.parent()
                        .and_then(|d| std::fs::canonicalize(d).ok())
                        .is_some_and(|c| c.starts_with(b))
            };
            b.is_dir() && !plan.binds.iter().any(|(p, _)| above(p))
        })
        .ok_or_else(|| JailError::Plan("no directory to build the root on".into()))?;
    mount(
        Some(Path::new("vessel-jail")),
        base,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        Some("size=64k,nr_inodes=1024,mode=0755"),
    )
    .map_err(sys(format!("tmpfs on {}", base.display())))?;
    let under = |p: &Path| base.join(p.strip_prefix("/").unwrap_or(p));
    for (p, a) in &plan.binds {
        let at = under(p);
        let made = if *a == Access::Dir {
            std::fs::create_dir_all(&at)
        } else {
            at.parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|()| std::fs::File::create(&at).map(drop))
        };
        made.map_err(sys(format!("mount point {}", at.display())))?;
        let rec = if *a == Access::Dir { libc::MS_REC } else { 0 };
        mount(Some(p), &at, None, libc::MS_BIND | rec, None)
            .map_err(sys(format!("binding {}", p.display())))?;
        if *a == Access::ReadOnly {
            read_only(&at).map_err(sys(format!("{} read-only", p.display())))?;
        }
    }
    for p in &plan.protect {
        let at = under(p);
        mount(Some(&at), &at, None, libc::MS_BIND, None)
            .map_err(sys(format!("binding {}", p.display())))?;
        read_only(&at).map_err(sys(format!("{} read-only", p.display())))?;
    }
    let proc_at = base.join("proc");
    std::fs::create_dir_all(&proc_at).map_err(sys("mount point /proc"))?;
    let pf = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC | libc::MS_RDONLY;
    // subset=pid (Linux 5.8): no /proc/sys and friends, only the processes.
    let proc = Some(Path::new("proc"));
    mount(proc, &proc_at, Some("proc"), pf, Some("subset=pid"))
        .or_else(|_| mount(proc, &proc_at, Some("proc"), pf, None))
        .map_err(sys("mounting /proc"))?;
    let b = cstr(base)?;
    // SAFETY: `b` is a NUL-terminated path alive for the call.
    check(unsafe { libc::chdir(b.as_ptr()) }, "chdir")?;
    let dot = c".";
    // SAFETY: pivot_root(".", ".") stacks the old root on the new one in our own namespace.
    let r = unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) };
    check(if r < 0 { -1 } else { 0 }, "pivot_root")?;
    check(
        // SAFETY: detaches the old root, stacked on ".".
        unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) },
        "detaching the host's root",
    )?;
    // SAFETY: "/" is a NUL-terminated string.
    check(unsafe { libc::chdir(c"/".as_ptr()) }, "chdir /")?;
    // The root itself (mount points only) is read-only from now on.
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REMOUNT
            | libc::MS_BIND
            | libc::MS_RDONLY
            | libc::MS_NOSUID
            | libc::MS_NODEV
            | libc::MS_NOEXEC,
        None,
    )
    .map_err(sys("making / read-only"))?;
    check(
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) },
        "no_new_privs",
    )?;
    Ok(())
}

fn read_only(at: &Path) -> std::io::Result<()> {
    mount(
        None,
        at,
        None,
        libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
        None,
    )
}

fn mount(
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> std::io::Result<()> {
    let c = |s: Option<&[u8]>| s.map(CString::new).transpose();
    let src = c(src.map(|p| p.as_os_str().as_bytes()))?;
    let (fstype, data) = (c(fstype.map(str::as_bytes))?, c(data.map(str::as_bytes))?);
    let t = CString::new(target.as_os_str().as_bytes())?;
    let p = |s: &Option<CString>| s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: every pointer is null or a NUL-terminated string alive for the call.
    let r = unsafe {
        libc::mount(
            p(&src),
            t.as_ptr(),
            p(&fstype),
            flags,
            p(&data).cast::<libc::c_void>(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(v: serde_json::Value) -> Spec {
        Spec::from_value(v).unwrap()
    }

    #[test]
    fn a_pods_jail_holds_its_directory_and_images() {
        let s = spec(serde_json::json!({
            "kernel": "/var/lib/vessel/guest/vmlinux", "mem_mib": 64, "vcpus": 1,
            "disks": [{"path": "/var/lib/vessel/guest/root.erofs", "read_only": true,
                       "serial": "vessel-root"}],
            "console": {"file": "/run/vessel/vm/p1/console.log"},
            "vsock": {"uds_path": "/run/vessel/vm/p1/v.sock"},
            "shared_dirs": [{"tag": "vessel", "path": "/run/vessel/vm/p1/shared"}],
            "control_socket": "/run/vessel/vm/p1/ctl.sock",
            "log_file": "/run/vessel/vm/p1/shim.log",
        }));
        let p = Plan::for_spec(&s, Path::new("/run/vessel/vm/p1/spec.json"));
        assert_eq!(
            p.binds,
            vec![
                (PathBuf::from("/run/vessel/vm/p1"), Access::Dir),
                (
                    PathBuf::from("/var/lib/vessel/guest/vmlinux"),
                    Access::ReadOnly
                ),
                (
                    PathBuf::from("/var/lib/vessel/guest/root.erofs"),
                    Access::ReadOnly
                ),
                (PathBuf::from("/dev/kvm"), Access::Device),
            ]
        );
        assert_eq!(
            p.protect,
            vec![PathBuf::from("/run/vessel/vm/p1/spec.json")]
        );
        assert!(p.check().is_ok());
    }

    #[test]
    fn read_write_disks_and_relative_paths() {
        let s = spec(serde_json::json!({
            "kernel": "/d/k", "initrd": "/d/i", "mem_mib": 64, "vcpus": 1,
            "disks": [{"path": "/d/rw.img"}],
            "nets": [{"tap": "tap0"}],
        }));
        let p = Plan::for_spec(&s, Path::new("/d/spec.json"));
        assert!(p
            .binds
            .contains(&(PathBuf::from("/d/rw.img"), Access::ReadWrite)));
        assert!(p.protect.is_empty());
        let s = spec(serde_json::json!({
            "kernel": "/d/k", "mem_mib": 64, "vcpus": 1, "console": {"file": "c.log"},
        }));
        let p = Plan::for_spec(&s, Path::new("/d/spec.json"));
        let e = p.check().unwrap_err().to_string();
        assert!(e.contains("absolute"), "{e}");
    }
}
