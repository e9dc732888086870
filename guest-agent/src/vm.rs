//! VM mode: the agent as the guest kernel's `/init` (PID 1 of a microVM).
//!
//! Start-up: if the root is the initramfs `rootfs` (which `pivot_root` cannot leave, so
//! libcontainer could not jail containers), its files move to a tmpfs that becomes `/` and the
//! agent re-executes itself there. Then it mounts `/proc`, `/sys`, `/dev` (devtmpfs),
//! `/dev/pts`, `/dev/shm`, cgroup2 on `/sys/fs/cgroup` (every controller enabled for
//! children), tmpfs on `/run` and `/tmp`, brings `lo` up, reaps orphans and serves the agent
//! API on vsock port [`crate::vsock::AGENT_PORT`]. A `vessel-stop` line on the console is the
//! power button: every container is stopped, then the guest powers off; so it does after
//! `Shutdown`. PID 1 never exits (that would panic the kernel): fatal errors are printed on
//! the console and the guest powers off.
//!
//! The kernel command line may carry `vessel.log=<tracing filter>` (default `warn`: every
//! console byte is a VM exit), and `vessel.userns=<uid map>,<gid map>` for a pod with its
//! own user namespace ([`pod_userns`]).

use std::ffi::CString;
use std::io::BufRead;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nix::mount::{mount, MsFlags};

use crate::error::{io, sys};
use crate::libct::Libct;
use crate::listener::AgentListener;
use crate::reaper::Reaper;
use crate::service::{AgentState, VmParts};

/// The agent's state directory in the guest (on the `/run` tmpfs).
pub const STATE_DIR: &str = "/run/vessel";
/// The console line that asks the guest to shut down.
pub const STOP_LINE: &str = "vessel-stop";
const NEW_ROOT: &str = "/.vessel-root";

/// Why VM start-up failed.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error(transparent)]
    Sys(#[from] crate::error::SysError),
    #[error("serving: {0}")]
    Serve(#[from] tonic::transport::Error),
}

/// Whether this process should run VM mode without being asked: PID 1 and no subcommand.
pub fn is_implicit() -> bool {
    std::process::id() == 1
        && !matches!(
            std::env::args().nth(1).as_deref(),
            Some("libct" | "flat" | "vm" | "debug-client" | "help" | "--help" | "--version")
        )
}

/// Runs VM mode. As PID 1 it never returns (the guest powers off); otherwise (a test run of
/// `vessel-agent vm`) it returns the exit code.
pub fn main() -> i32 {
    let pid1 = std::process::id() == 1;
    let r = std::panic::catch_unwind(run);
    let code = match r {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            console(&format!("vessel-agent: fatal: {e}"));
            1
        }
        Err(_) => {
            console("vessel-agent: fatal: panic");
            1
        }
    };
    if pid1 {
        power_off();
    }
    code
}

/// Writes a line to the console (stderr), whatever tracing's level is.
fn console(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{msg}");
}

/// sync, then power the guest off; never returns.
pub fn power_off() -> ! {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    // SAFETY: reboot(2) with a valid command; as PID 1 with CAP_SYS_BOOT it does not return.
    unsafe { libc::reboot(libc::RB_POWER_OFF) };
    console(&format!(
        "vessel-agent: power off failed: {}",
        std::io::Error::last_os_error()
    ));
    loop {
        // SAFETY: pause(2) only waits for a signal.
        unsafe { libc::pause() };
    }
}

fn run() -> Result<(), VmError> {
    let pid1 = std::process::id() == 1;
    ensure_console();
    if pid1 {
        mount_fs("proc", "/proc", "proc", MsFlags::empty(), None)?;
        if root_is_initramfs() {
            // The VMM timestamps `vessel-event:` console lines (boot timing).
            console("vessel-event: agent-init");
            let _ = nix::mount::umount("/proc");
            return switch_root_and_reexec();
        }
        // The agent runs from the pod's root: kernel boot is over (timed by the VMM).
        console("vessel-event: agent-start");
    }
    let level = kernel_param("vessel.log").unwrap_or_else(|| "warn".into());
    crate::flat::init_logging(&level);
    if pid1 {
        setup_system()?;
        raise_nofile();
        if let Some(maps) = kernel_param("vessel.userns") {
            // Not fatal here: ConfigureSandbox reports it, so the host learns why.
            if let Err(e) = pod_userns(&maps) {
                tracing::error!(error = %e, "the pod's user namespace");
                crate::userns::set_failed(format!("the pod's user namespace in the guest: {e}"));
            }
        }
    }
    for d in ["libcontainer", "containers", "layers", "files"] {
        let p = Path::new(STATE_DIR).join(d);
        std::fs::create_dir_all(&p).map_err(io(format!("creating {}", p.display())))?;
    }
    let listener = AgentListener::bind_vsock(crate::vsock::AGENT_PORT).map_err(io(format!(
        "binding vsock port {}",
        crate::vsock::AGENT_PORT
    )))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(io("building the runtime"))?;
    let r = rt.block_on(serve(listener, level));
    rt.shutdown_timeout(Duration::from_secs(1));
    r
}

/// Makes sure fds 0-2 are the console (the kernel leaves them closed without `/dev/console`
/// in the initramfs, and a later socket must not become fd 0).
fn ensure_console() {
    // SAFETY: F_GETFD on fd 0 only queries flags.
    if unsafe { libc::fcntl(0, libc::F_GETFD) } >= 0 {
        return;
    }
    let _ = std::fs::create_dir_all("/dev");
    let _ = mount_fs("devtmpfs", "/dev", "devtmpfs", MsFlags::MS_NOSUID, None);
    if let Ok(f) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/console")
    {
        for fd in 0..3 {
            let _ = nix::unistd::dup2(f.as_raw_fd(), fd);
        }
    }
}

fn mount_fs(
    src: &str,
    target: &str,
    fstype: &str,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), VmError> {
    std::fs::create_dir_all(target).map_err(io(format!("creating {target}")))?;
    match mount(Some(src), target, Some(fstype), flags, data) {
        Ok(()) | Err(nix::errno::Errno::EBUSY) => Ok(()),
        Err(e) => Err(sys(format!("mounting {fstype} on {target}"))(e).into()),
    }
}

fn root_is_initramfs() -> bool {
    std::fs::read_to_string("/proc/self/mounts")
        .map(|m| {
            m.lines().any(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                f.len() > 2 && f[1] == "/" && f[2] == "rootfs"
            })
        })
        .unwrap_or(false)
}

/// Moves the initramfs's files to a tmpfs, makes it `/` and execs `/init vm` there.
fn switch_root_and_reexec() -> Result<(), VmError> {
    mount_fs(
        "root",
        NEW_ROOT,
        "tmpfs",
        MsFlags::empty(),
        Some("mode=0755"),
    )?;
    let new_root = Path::new(NEW_ROOT);
    let rd = std::fs::read_dir("/").map_err(io("reading /"))?;
    for entry in rd.flatten() {
        let p = entry.path();
        if p == new_root {
            continue;
        }
        copy_tree(&p, &new_root.join(entry.file_name()))?;
        // Free the initramfs's memory as we go.
        let _ = match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&p),
            _ => std::fs::remove_file(&p),
        };
    }
    nix::unistd::chdir(new_root).map_err(sys("chdir to the new root"))?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(sys("moving the new root to /"))?;
    nix::unistd::chroot(".").map_err(sys("chroot"))?;
    nix::unistd::chdir("/").map_err(sys("chdir /"))?;
    let exe = CString::new("/init").expect("no NUL");
    let arg = CString::new("vm").expect("no NUL");
    let e = nix::unistd::execv(&exe, &[exe.clone(), arg]).unwrap_err();
    Err(sys("re-executing /init")(e).into())
}

fn copy_tree(from: &Path, to: &Path) -> Result<(), VmError> {
    let m = std::fs::symlink_metadata(from).map_err(io(format!("{}", from.display())))?;
    let ft = m.file_type();
    if ft.is_dir() {
        std::fs::create_dir_all(to).map_err(io(format!("creating {}", to.display())))?;
        for e in std::fs::read_dir(from)
            .map_err(io(format!("reading {}", from.display())))?
            .flatten()
        {
            copy_tree(&e.path(), &to.join(e.file_name()))?;
        }
    } else if ft.is_symlink() {
        let target = std::fs::read_link(from).map_err(io("readlink"))?;
        std::os::unix::fs::symlink(target, to).map_err(io(format!("symlink {}", to.display())))?;
        let _ = std::os::unix::fs::lchown(to, Some(m.uid()), Some(m.gid()));
        return Ok(());
    } else if ft.is_file() {
        std::fs::copy(from, to).map_err(io(format!("copying {}", from.display())))?;
    } else if ft.is_char_device() || ft.is_block_device() {
        let kind = if ft.is_char_device() {
            nix::sys::stat::SFlag::S_IFCHR
        } else {
            nix::sys::stat::SFlag::S_IFBLK
        };
        nix::sys::stat::mknod(
            to,
            kind,
            nix::sys::stat::Mode::from_bits_truncate(m.mode()),
            m.rdev(),
        )
        .map_err(sys(format!("mknod {}", to.display())))?;
    } else {
        return Ok(());
    }
    let _ = std::os::unix::fs::lchown(to, Some(m.uid()), Some(m.gid()));
    Ok(
        std::fs::set_permissions(to, std::fs::Permissions::from_mode(m.mode() & 0o7777))
            .map_err(io(format!("chmod {}", to.display())))?,
    )
}

/// The value of `name=value` on the kernel command line.
pub fn kernel_param(name: &str) -> Option<String> {
    let cmdline = std::fs::read_to_string("/proc/cmdline").ok()?;
    parse_param(&cmdline, name)
}

fn parse_param(cmdline: &str, name: &str) -> Option<String> {
    cmdline.split_whitespace().find_map(|w| {
        w.strip_prefix(name)
            .and_then(|r| r.strip_prefix('='))
            .map(str::to_string)
    })
}

/// Containers inherit the agent's open-file limit, and the kernel gives init 1024 (4096
/// hard): raised to the kernel's most (`fs.nr_open`, 1048576), what a host's container
/// runtime runs with (containerd's unit and vesseld's say LimitNOFILE=1048576; flat pods
/// inherit vesseld's). Elasticsearch, databases and Go programs need more than 4096.
fn raise_nofile() {
    let max = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(1 << 20);
    let limit = rustix::process::Rlimit {
        current: Some(max),
        maximum: Some(max),
    };
    if let Err(e) = rustix::process::setrlimit(rustix::process::Resource::Nofile, limit) {
        tracing::warn!(error = %e, max, "raising the open-file limit");
    }
}

/// The guest's filesystems, cgroups and loopback.
fn setup_system() -> Result<(), VmError> {
    let nosuid_nodev_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount_fs("sysfs", "/sys", "sysfs", nosuid_nodev_noexec, None)?;
    mount_fs(
        "devtmpfs",
        "/dev",
        "devtmpfs",
        MsFlags::MS_NOSUID,
        Some("mode=0755"),
    )?;
    mount_fs(
        "devpts",
        "/dev/pts",
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("gid=5,mode=0620,ptmxmode=0666"),
    )?;
    mount_fs(
        "shm",
        "/dev/shm",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777"),
    )?;
    mount_fs(
        "cgroup2",
        "/sys/fs/cgroup",
        "cgroup2",
        nosuid_nodev_noexec,
        None,
    )?;
    mount_fs(
        "run",
        "/run",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755"),
    )?;
    mount_fs(
        "tmp",
        "/tmp",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777"),
    )?;
    enable_controllers(Path::new("/sys/fs/cgroup"));
    if let Err(e) = crate::flat::loopback_up() {
        tracing::warn!(error = %e, "bringing up lo");
    }
    Ok(())
}

/// `vessel.userns=<uid map>,<gid map>` (each `container:host:size`): the pod has a user
/// namespace of its own. As in a flat pod (`crate::userns`), it is made with the pod's net,
/// uts, ipc and pid namespaces owned by it, and the agent (still in the guest's initial user
/// namespace) joins the first three; the guest's interfaces move into the pod's network
/// namespace, where `ConfigureSandbox` then gives them their addresses.
fn pod_userns(maps: &str) -> Result<(), VmError> {
    use nix::sched::CloneFlags;
    let bad = |e: String| {
        VmError::from(io(format!("vessel.userns={maps}"))(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            e,
        )))
    };
    let (u, g) = maps
        .split_once(',')
        .ok_or_else(|| bad("want <uid map>,<gid map>".into()))?;
    let uid: crate::userns::IdMap = u.parse().map_err(bad)?;
    let gid: crate::userns::IdMap = g.parse().map_err(bad)?;
    // Read and opened here, in the guest's first network namespace, where they stay.
    let links =
        crate::net::device_links(Path::new("/sys/class/net")).map_err(io("listing interfaces"))?;
    let nl = crate::netlink::Socket::open().map_err(io("netlink socket"))?;
    let inside = CloneFlags::CLONE_NEWNET
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWPID;
    let made = crate::userns::create(uid, gid, inside)?;
    let pod_net =
        std::fs::File::open("/proc/self/ns/net").map_err(io("opening the pod's netns"))?;
    for (name, index) in links {
        nl.request(&crate::net::move_link(index, pod_net.as_raw_fd()))
            .map_err(io(format!(
                "moving {name} into the pod's network namespace"
            )))?;
    }
    crate::flat::loopback_up().map_err(io("bringing up the pod's lo"))?;
    crate::userns::set_pod(crate::userns::PodUserns {
        fd: made.user,
        uid,
        gid,
        pid_holder: made.pid_holder,
    });
    Ok(())
}

/// Enables every available controller for the children of `root`, one by one (so one the
/// kernel refuses does not block the others).
pub fn enable_controllers(root: &Path) {
    let Ok(avail) = std::fs::read_to_string(root.join("cgroup.controllers")) else {
        tracing::warn!("no cgroup.controllers: cgroup limits will not work");
        return;
    };
    for c in avail.split_whitespace() {
        if let Err(e) = std::fs::write(root.join("cgroup.subtree_control"), format!("+{c}")) {
            tracing::warn!(controller = c, error = %e, "enabling a cgroup controller");
        }
    }
}

/// Reads console lines on a thread; resolves when one is [`STOP_LINE`].
fn watch_console() -> tokio::sync::oneshot::Receiver<()> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("console".into())
        .spawn(move || {
            // A duplicate of stdin (the console), so the thread owns its descriptor.
            let Ok(fd) = nix::unistd::dup(0) else { return };
            // SAFETY: dup just returned this descriptor; the File owns it from here on.
            let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            for line in std::io::BufReader::new(file).lines() {
                match line {
                    Ok(l) if l.trim() == STOP_LINE => {
                        let _ = tx.send(());
                        return;
                    }
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {}
                    Err(_) => return,
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no console watcher");
    }
    rx
}

async fn serve(listener: AgentListener, level: String) -> Result<(), VmError> {
    let reaper = Reaper::new();
    reaper.start().map_err(io("starting the reaper"))?;
    let libct = Libct {
        exe: PathBuf::from("/proc/self/exe"),
        root: Path::new(STATE_DIR).join("libcontainer"),
        reaper: reaper.clone(),
        log_level: level,
    };
    let parts = VmParts::new(
        crate::disks::Layers::new(
            crate::disks::DiskRoots::default(),
            Path::new(STATE_DIR).join("layers"),
        ),
        PathBuf::from(crate::files::FILES_DIR),
        PathBuf::from("/proc/sys"),
    );
    let state: Arc<AgentState> = AgentState::new_vm(PathBuf::from(STATE_DIR), libct, parts);
    let stop = watch_console();
    let st = state.clone();
    tokio::spawn(async move {
        if stop.await.is_ok() {
            tracing::warn!("vessel-stop on the console: shutting down");
            st.shutdown_all().await;
            st.request_exit();
        }
    });
    match crate::vsock::VsockListener::bind(crate::vsock::FORWARD_PORT) {
        Ok(l) => {
            tokio::spawn(async move {
                if let Err(e) = crate::forward::serve(l).await {
                    tracing::warn!(error = %e, "port-forward listener");
                }
            });
        }
        Err(e) => {
            tracing::warn!(error = %e, port = crate::vsock::FORWARD_PORT, "no port-forward listener")
        }
    }
    tracing::info!(listen = %listener.describe(), "serving");
    if std::process::id() == 1 {
        console("vessel-event: agent-serving");
    }
    // Idle clients get 1 s after the Shutdown answer went out.
    let r = listener
        .serve_until_exit(&state, Duration::from_secs(1))
        .await
        .map_err(VmError::from);
    state.shutdown_all().await;
    tracing::info!("powering off");
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params() {
        let c = "console=ttyS0 quiet vessel.log=info,x=debug vessel.logx=1\n";
        assert_eq!(
            parse_param(c, "vessel.log").as_deref(),
            Some("info,x=debug")
        );
        assert_eq!(parse_param(c, "vessel"), None);
        assert_eq!(parse_param(c, "nope"), None);
    }

    #[test]
    fn controllers_are_enabled_one_by_one() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        enable_controllers(t.path());
        // A regular file keeps the last write; the real one accumulates.
        assert_eq!(
            std::fs::read_to_string(t.path().join("cgroup.subtree_control")).unwrap(),
            "+pids"
        );
    }
}
