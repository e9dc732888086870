//! libcontainer, driven from a re-executed single-threaded helper.
//!
//! # Fork-safety: why a helper process
//!
//! libcontainer creates containers by `clone3`/`clone` straight from the calling process and
//! runs Rust code (allocations, `tracing`, channel I/O) in the child before `exec`. The raw
//! `clone3` syscall does not run glibc's `atfork` handlers, so in the multi-threaded tokio
//! agent a lock held by another thread at that moment (malloc arenas, the tracing
//! subscriber, stdio) would be copied locked into the child and could deadlock it. Running
//! libcontainer on one dedicated thread does not help: the *other* threads still exist at
//! clone time. So every libcontainer call that makes processes (create, exec), and start
//! (which `chdir`s, a process-wide change), runs in a fresh `vessel-agent libct ...` process:
//! single-threaded, no tokio, started with `std::process::Command` (fork+exec, which is safe
//! from a threaded parent). A container is created and started by one helper (`create
//! --start`) when CRI starts it. Delete forks nothing and changes no process-wide state
//! (it reads state, signals, removes cgroups and files), so the agent runs it in-process
//! ([`delete`]), on a blocking thread.
//!
//! Process ancestry: the helper is a child of the agent. For `create`, libcontainer's
//! intermediate process (the helper's child) forks the container init and exits, so the
//! init is reparented to the agent, which is PID 1 of the pod's pid namespace (or a child
//! subreaper when the pod shares the host's): the agent's reaper collects its exit status,
//! so exit codes are reliable. For `exec` the helper makes itself a child subreaper, so the
//! exec'd process is reparented to the helper, which waits for it and reports its status.
//!
//! Protocol: the helper writes lines on its stdout: `PID <n>`, `EXIT <code> <signal>`
//! (exec), and finally `OK` or `ERR <kind> <message>`. Container stdio arrives on fds
//! 3, 4, 5 (stdin, stdout, stderr) when `--stdio` is given; otherwise (tty) a console socket
//! path is given and libcontainer sends the pty master there.

use std::ffi::OsString;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use libcontainer::container::builder::ContainerBuilder;
use libcontainer::container::Container;
use libcontainer::error::LibcontainerError;
use libcontainer::syscall::syscall::SyscallType;
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::oneshot;

use crate::error::AgentError;
use crate::reaper::{ExitStatus, Reaper};

/// The helper's command line (`vessel-agent libct --root DIR <op>`).
#[derive(Debug, clap::Args)]
pub struct HelperArgs {
    /// libcontainer's state root.
    #[arg(long)]
    pub root: PathBuf,
    #[command(subcommand)]
    pub op: HelperOp,
}

#[derive(Debug, clap::Subcommand)]
pub enum HelperOp {
    /// Creates a container from a bundle; prints `PID <init pid>`.
    Create {
        #[arg(long)]
        id: String,
        #[arg(long)]
        bundle: PathBuf,
        #[arg(long)]
        console_socket: Option<PathBuf>,
        /// Container stdin/stdout/stderr are fds 3/4/5.
        #[arg(long)]
        stdio: bool,
        /// Start the container once created (after `PID <n>`); a failed start deletes it.
        #[arg(long)]
        start: bool,
        /// Make the process's working directory, missing in the volume mounted over it,
        /// owned by `<uid>:<gid>` ([`crate::rootfs::make_cwd_in_volume`]).
        #[arg(long, value_parser = parse_owner)]
        make_cwd_as: Option<(u32, u32)>,
    },
    /// Runs a process in a running container; prints `PID <n>` then `EXIT <code> <signal>`.
    Exec {
        #[arg(long)]
        id: String,
        #[arg(long)]
        cwd: Option<String>,
        #[arg(long = "env")]
        env: Vec<String>,
        #[arg(long)]
        console_socket: Option<PathBuf>,
        #[arg(long)]
        stdio: bool,
        #[arg(last = true, required = true)]
        args: Vec<String>,
    },
    /// Dumps a running container's processes with CRIU into `--image-path`, leaving them
    /// running (CRI CheckpointContainer).
    Checkpoint {
        #[arg(long)]
        id: String,
        #[arg(long)]
        image_path: PathBuf,
        #[arg(long)]
        work_path: Option<PathBuf>,
        /// The container's overlay upper directory: archived into `--diff-dir` while CRIU
        /// holds the dumped tasks ([`crate::rootfs_diff`]).
        #[arg(long, requires = "diff_dir")]
        upper_dir: Option<PathBuf>,
        #[arg(long)]
        diff_dir: Option<PathBuf>,
    },
    /// Restores a created container's processes from CRIU images (a checkpoint) instead of
    /// starting its command; prints `PID <init pid>`.
    Restore {
        #[arg(long)]
        id: String,
        #[arg(long)]
        bundle: PathBuf,
        #[arg(long)]
        image_path: PathBuf,
        /// The restored stdin/stdout/stderr (where the dumped ones were pipes) are fds 3/4/5.
        #[arg(long)]
        stdio: bool,
        /// The checkpointed process had a terminal: CRIU makes a new pty pair for it, and
        /// its master is sent here, as a created tty container's is.
        #[arg(long)]
        console_socket: Option<PathBuf>,
    },
}

/// `<uid>:<gid>`.
fn parse_owner(s: &str) -> Result<(u32, u32), String> {
    let (u, g) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: want uid:gid"))?;
    let num = |v: &str| v.parse::<u32>().map_err(|e| format!("{s:?}: {e}"));
    Ok((num(u)?, num(g)?))
}

/// The kind of a helper error, mapped to a gRPC code by the agent.
fn error_kind(e: &LibcontainerError) -> &'static str {
    match e {
        LibcontainerError::IncorrectStatus(_) => "precondition",
        LibcontainerError::Exist => "exists",
        LibcontainerError::NoDirectory => "notfound",
        LibcontainerError::InvalidInput(_)
        | LibcontainerError::InvalidID(_)
        | LibcontainerError::MissingSpec(_)
        | LibcontainerError::InvalidSpec(_)
        | LibcontainerError::Spec(_) => "invalid",
        _ => "internal",
    }
}

/// An error and its sources, on one line.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    // libcontainer's InvalidInput shows only "invalid input": its message is the point.
    let mut s = match e.downcast_ref::<LibcontainerError>() {
        Some(LibcontainerError::InvalidInput(m)) => format!("invalid input: {m}"),
        _ => e.to_string(),
    };
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s.replace('\n', " ")
}

/// Ends the helper at once with an internal error: for a helper that could not get back to
/// its own mount namespace, where going on (starting or deleting the container) would act
/// on the container's paths. The made container's init (`pid`) is killed (a signal needs no
/// path); its state and cgroup are left for its removal to delete.
fn abort_helper(msg: &str, pid: i32) -> ! {
    tracing::error!(error = %msg, "libcontainer helper");
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
    say(&format!("ERR internal {msg}"));
    std::process::exit(1)
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Takes ownership of fds 3, 4, 5.
fn take_stdio() -> [OwnedFd; 3] {
    // SAFETY: the agent placed the container's stdin/stdout/stderr at fds 3, 4 and 5 of this
    // process (see `Helper::spawn`) and nothing else in this process owns them.
    unsafe {
        [
            OwnedFd::from_raw_fd(3),
            OwnedFd::from_raw_fd(4),
            OwnedFd::from_raw_fd(5),
        ]
    }
}

fn load(root: &Path, id: &str) -> Result<Container, LibcontainerError> {
    let dir = root.join(id);
    if !dir.exists() {
        return Err(LibcontainerError::NoDirectory);
    }
    Container::load(dir)
}

/// Deletes a container's libcontainer state and cgroups (killing what is left of it), in the
/// calling process: nothing here forks or changes process-wide state. Blocking (cgroup
/// removal retries with sleeps): call it from a blocking thread. A container libcontainer
/// never created is not an error.
pub fn delete(root: &Path, id: &str) -> Result<(), AgentError> {
    let dir = root.join(id);
    match load(root, id) {
        Ok(mut c) => c.delete(true),
        Err(LibcontainerError::NoDirectory) => Ok(()),
        // A restore's helper killed before the restored init was recorded.
        Err(_)
            if dir.is_dir() && !libcontainer::container::state::State::file_path(&dir).exists() =>
        {
            discard_stateless(&dir, id);
            Ok(())
        }
        Err(e) => Err(e),
    }
    .map_err(|e| map_err(error_kind(&e), format!("libcontainer: {}", error_chain(&e))))
}

/// The environment variable naming the fd of the host's mount namespace, which a flat
/// agent hands to its helpers (see [`export_host_mount_ns`]).
pub const HOST_MNT_NS_ENV: &str = "VESSEL_HOST_MNT_NS_FD";

/// Flat mode, in the agent before it serves: makes `ns` (the host's mount namespace, opened
/// before the agent unshared its own) inheritable by the helpers the agent spawns, and names
/// it in their environment. The helper takes it over at once ([`take_host_mount_ns`]) so
/// that nothing it execs (container processes) inherits it. Must be called while the process
/// is single-threaded (it sets an environment variable).
pub fn export_host_mount_ns(ns: std::fs::File) -> std::io::Result<()> {
    // A copy without close-on-exec, above the fds a helper's stdio is moved to (3..=5), kept
    // open for the agent's life.
    // SAFETY: fcntl(F_DUPFD) on an fd this process owns (kept open by `ns` until the end).
    let fd = unsafe { libc::fcntl(ns.as_raw_fd(), libc::F_DUPFD, 64) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    std::env::set_var(HOST_MNT_NS_ENV, fd.to_string());
    Ok(())
}

/// In a helper: the host mount namespace the agent handed down, now close-on-exec, if any.
fn take_host_mount_ns() -> Option<OwnedFd> {
    let fd: RawFd = std::env::var(HOST_MNT_NS_ENV).ok()?.parse().ok()?;
    std::env::remove_var(HOST_MNT_NS_ENV);
    // Only a mount namespace file is taken; anything else at that number is left alone.
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok()?;
    if !link.to_string_lossy().starts_with("mnt:[") {
        return None;
    }
    // SAFETY: the agent passed this fd (checked above to be a mount namespace file) for this
    // helper to own; nothing else in this process refers to it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let cloexec = owned.try_clone().ok();
    drop(owned);
    cloexec
}

/// Flat pods: the sources of the spec's bind mounts are looked up in the host's mount
/// namespace, not in the agent's own (a private copy taken when the pod started, which never
/// sees host mounts made later when the host's root is private, and whose slave mounts would
/// never propagate back). Each source is cloned with open_tree(2) there (recursively for
/// `rbind`; a clone of a shared mount stays in its peer group, so rslave/rshared work as with
/// runc on the host), attached under `<container dir>/binds/<n>` in the agent's namespace
/// with move_mount(2), and the spec's source is rewritten to it. Must run single-threaded
/// (setns of a mount namespace requires it); this helper is.
fn stage_binds(host_ns: &OwnedFd, bundle: &Path) -> Result<(), LibcontainerError> {
    let other = |m: String| LibcontainerError::Other(m);
    let config = bundle.join("config.json");
    let mut spec = oci_spec::runtime::Spec::load(&config)
        .map_err(|e| other(format!("reading the bundle spec: {e}")))?;
    let mut mounts = spec.mounts().clone().unwrap_or_default();
    let is_idmap = |o: &String| o == "idmap" || o == "ridmap";
    // The agent's own (the pod's /dev/shm): in its containers' dir, which is the bundle's
    // grandparent, and mounted in its namespace only. Exactly that path: a request's source
    // under the containers' dir is a host path like any other.
    let own_shm = bundle
        .parent()
        .and_then(Path::parent)
        .map(crate::spec::pod_shm_dir);
    let todo: Vec<(usize, PathBuf, bool, bool)> = mounts
        .iter()
        .enumerate()
        .filter_map(|(i, m)| {
            let opts = m.options().clone().unwrap_or_default();
            let rbind = opts.iter().any(|o| o == "rbind");
            let bind = rbind || opts.iter().any(|o| o == "bind");
            let idmap = opts.iter().any(is_idmap);
            let src = m.source().clone()?;
            let own = own_shm.as_ref() == Some(&src);
            (bind && src.is_absolute() && !own).then_some((i, src, rbind, idmap))
        })
        .collect();
    if todo.is_empty() {
        return Ok(());
    }
    // `idmap` binds (a volume of a pod with its own user namespace) are idmapped through
    // the container's user namespace, the pod's (libcontainer 0.7 has no idmapped mounts).
    let userns = if todo.iter().any(|t| t.3) {
        let path =
            ns_path(&spec, oci_spec::runtime::LinuxNamespaceType::User).ok_or_else(|| {
                LibcontainerError::InvalidInput(
                    "an idmap bind mount needs the container to join a user namespace".into(),
                )
            })?;
        let f = std::fs::File::open(&path).map_err(|e| {
            other(format!(
                "opening the user namespace {}: {e}",
                path.display()
            ))
        })?;
        Some(OwnedFd::from(f))
    } else {
        None
    };
    let own = std::fs::File::open("/proc/self/ns/mnt")
        .map_err(|e| other(format!("opening the agent's mount namespace: {e}")))?;
    nix::sched::setns(host_ns, nix::sched::CloneFlags::CLONE_NEWNS)
        .map_err(|e| other(format!("joining the host's mount namespace: {e}")))?;
    let mut trees = Vec::new();
    let cloned = todo.iter().try_for_each(|(i, src, rbind, _)| {
        let fd = crate::mount_tree::clone_tree(src, *rbind)
            .map_err(|e| other(format!("bind source {}: {e}", src.display())))?;
        trees.push((*i, fd));
        Ok::<_, LibcontainerError>(())
    });
    // Back home whatever happened: the rest of the helper works in the agent's namespace.
    nix::sched::setns(&own, nix::sched::CloneFlags::CLONE_NEWNS)
        .map_err(|e| other(format!("returning to the agent's mount namespace: {e}")))?;
    cloned?;
    let dir = bundle
        .parent()
        .ok_or_else(|| other("bundle has no parent".into()))?
        .join(crate::rootfs::BINDS_DIR);
    std::fs::create_dir_all(&dir).map_err(LibcontainerError::OtherIO)?;
    for ((i, fd), (_, src, rbind, idmap)) in trees.into_iter().zip(&todo) {
        if let (true, Some(ns)) = (*idmap, &userns) {
            crate::userns::idmap_tree(fd.as_fd(), ns.as_fd(), *rbind).map_err(|e| {
                LibcontainerError::InvalidInput(format!(
                    "bind source {}: an idmapped mount (for the pod's user namespace) is not \
                     possible there: {e}",
                    src.display()
                ))
            })?;
            let opts = mounts[i].options().clone().unwrap_or_default();
            mounts[i].set_options(Some(opts.into_iter().filter(|o| !is_idmap(o)).collect()));
        }
        let target = dir.join(i.to_string());
        let is_dir = rustix::fs::fstat(&fd)
            .map(|st| {
                rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory
            })
            .map_err(|e| other(format!("stat of a bind source: {e}")))?;
        if is_dir {
            std::fs::create_dir(&target).map_err(LibcontainerError::OtherIO)?;
        } else {
            std::fs::File::create(&target).map_err(LibcontainerError::OtherIO)?;
        }
        crate::mount_tree::attach_tree(fd.as_fd(), &target).map_err(|e| {
            other(format!(
                "attaching a bind source at {}: {e}",
                target.display()
            ))
        })?;
        mounts[i].set_source(Some(target));
    }
    spec.set_mounts(Some(mounts));
    spec.save(&config)
        .map_err(|e| other(format!("writing the bundle spec: {e}")))?;
    Ok(())
}

/// Runs one helper operation; returns the process exit code.
pub fn helper_main(args: HelperArgs) -> i32 {
    match run_helper(&args.root, args.op) {
        Ok(()) => {
            say("OK");
            0
        }
        Err(e) => {
            let msg = error_chain(&e);
            tracing::error!(error = %msg, "libcontainer helper");
            say(&format!("ERR {} {msg}", error_kind(&e)));
            1
        }
    }
}

fn run_helper(root: &Path, op: HelperOp) -> Result<(), LibcontainerError> {
    match op {
        HelperOp::Create {
            id,
            bundle,
            console_socket,
            stdio,
            start,
            make_cwd_as,
        } => {
            if let Some(host_ns) = take_host_mount_ns() {
                stage_binds(&host_ns, &bundle)?;
            }
            if let Some(owner) = make_cwd_as {
                crate::rootfs::make_cwd_in_volume(&bundle, owner).map_err(|e| {
                    let m = format!("making the working directory in its volume: {e}");
                    if crate::rootfs::cwd_error_is_request(&e) {
                        LibcontainerError::InvalidInput(m)
                    } else {
                        LibcontainerError::Other(m)
                    }
                })?;
            }
            let dev_binds = crate::devbind::split(&bundle)?;
            let mut b = ContainerBuilder::new(id, SyscallType::default())
                .with_root_path(root)?
                .with_console_socket(console_socket);
            if stdio {
                let [i, o, e] = take_stdio();
                b = b.with_stdin(i).with_stdout(o).with_stderr(e);
            }
            let c = b
                .as_init(bundle.clone())
                .with_systemd(false)
                .with_detach(true)
                .build()?;
            let mut c = c;
            let launched = c
                .pid()
                .ok_or_else(|| LibcontainerError::Other("created container has no pid".into()))
                .and_then(|pid| {
                    apply_bind_propagation(pid.as_raw(), &bundle)?;
                    crate::devbind::attach(pid.as_raw(), &dev_binds)?;
                    if start {
                        c.start()?;
                    }
                    Ok(pid)
                });
            match launched {
                Ok(pid) => {
                    say(&format!("PID {pid}"));
                    Ok(())
                }
                Err(e) => {
                    // Nothing half-made stays: the waiting init, its cgroup, the state.
                    if let Err(d) = c.delete(true) {
                        tracing::warn!(error = %error_chain(&d), "deleting a container that did not start");
                    }
                    Err(e)
                }
            }
        }
        HelperOp::Exec {
            id,
            cwd,
            env,
            console_socket,
            stdio,
            args,
        } => exec(root, id, cwd, env, console_socket, stdio, args),
        HelperOp::Checkpoint {
            id,
            image_path,
            work_path,
            upper_dir,
            diff_dir,
        } => {
            let diff = upper_dir.zip(diff_dir);
            checkpoint(root, &id, image_path, work_path, diff)
        }
        HelperOp::Restore {
            id,
            bundle,
            image_path,
            stdio,
            console_socket,
        } => {
            let pid = restore(
                root,
                &id,
                &bundle,
                &image_path,
                stdio,
                console_socket.as_deref(),
            )?;
            say(&format!("PID {pid}"));
            Ok(())
        }
    }
}

/// Directories CRIU is looked for in beyond `PATH`: vesseld may run with a `PATH` without
/// the sbin directories, where CRIU installs.
const CRIU_DIRS: [&str; 4] = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/sbin"];

/// The log [`checkpoint`] has CRIU write (into the work directory, else the image one).
pub const CRIU_DUMP_LOG: &str = "dump.log";

/// The CRIU binary: on `PATH`, else in the sbin directories (vesseld may run with a `PATH`
/// without them, and CRIU installs there).
fn find_criu() -> Result<PathBuf, LibcontainerError> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .filter(|d| d.is_absolute())
        .chain(CRIU_DIRS.iter().map(PathBuf::from))
        .map(|d| d.join("criu"))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| {
            LibcontainerError::Other(
                "CRIU is not installed (no criu on PATH or in /usr/local/sbin, /usr/sbin); \
                 scripts/criu.sh installs one that works on this kernel"
                    .into(),
            )
        })
}

/// The devices libcontainer bind-mounts from the host (instead of making them) in a
/// container with its own user namespace: its defaults and the spec's.
const DEFAULT_DEVICES: [&str; 6] = [
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/tty",
    "/dev/urandom",
    "/dev/random",
];

/// One of a container's mounts whose source lies outside it: CRIU records `point` (in the
/// container) as external under `key` at a dump, and a restore binds `source` (on this
/// side) where `key` was.
#[derive(Debug, PartialEq)]
struct ExtMount {
    point: String,
    key: String,
    source: String,
}

/// The container's mounts whose source lies outside it, which CRIU must be told are
/// external: its bind mounts (volumes, the pod's hosts/resolv.conf), cgroup v1 hierarchies
/// (the container's cgroup, bound from the host's), masked files (/dev/null bound over
/// them) and, with a user namespace, the devices bound from the host. A dump (`pid` of the
/// container's init) lists the masked files it finds in the container; a restore (`None`)
/// maps them all, as a key no dump used is left alone.
fn external_mounts(spec: &oci_spec::runtime::Spec, pid: Option<i32>) -> Vec<ExtMount> {
    use oci_spec::runtime::LinuxNamespaceType;
    let mut out: Vec<ExtMount> = Vec::new();
    let mut add = |point: String, key: String, source: String| {
        if !out.iter().any(|x| x.point == point) {
            out.push(ExtMount { point, key, source });
        }
    };
    let mut cgroup = false;
    for m in spec.mounts().iter().flatten() {
        let dest = m.destination().display().to_string();
        let bind = m.typ().as_deref() == Some("bind")
            || m.options()
                .iter()
                .flatten()
                .any(|o| o == "bind" || o == "rbind");
        if bind {
            let source = m.source().as_ref().map(|s| s.display().to_string());
            add(dest.clone(), dest, source.unwrap_or_default());
        } else if m.typ().as_deref() == Some("cgroup") {
            cgroup = true;
        }
    }
    let linux = spec.linux().as_ref();
    if cgroup {
        // v1 (hybrid included): each hierarchy is the host's, the container's cgroup in it
        // bound in: a restore runs in the container's cgroups, so that is its own (named
        // hierarchies such as name=systemd, which no controller manages, included).
        for point in crate::cgroups::v1_mount_points() {
            // Unknown: no source (a restore leaves it unmapped, not the hierarchy's root).
            let source = crate::cgroups::v1_own_dir(point)
                .map(|d| d.display().to_string())
                .unwrap_or_default();
            let point = point.display().to_string();
            if point.starts_with("/sys/fs/cgroup/") {
                add(point.clone(), point, source);
            }
        }
    }
    for p in linux
        .and_then(|l| l.masked_paths().as_ref())
        .into_iter()
        .flatten()
    {
        // Directories get an empty read-only tmpfs, which CRIU dumps as it is.
        let file = pid.is_none_or(|pid| {
            std::fs::metadata(format!("/proc/{pid}/root{p}")).is_ok_and(|m| !m.is_dir())
        });
        if file {
            add(p.clone(), "/dev/null".into(), "/dev/null".into());
        }
    }
    let userns = linux
        .and_then(|l| l.namespaces().as_ref())
        .is_some_and(|ns| ns.iter().any(|n| n.typ() == LinuxNamespaceType::User));
    if userns {
        let devices = linux.and_then(|l| l.devices().as_ref());
        for d in DEFAULT_DEVICES.iter().map(|d| d.to_string()).chain(
            devices
                .into_iter()
                .flatten()
                .map(|d| d.path().display().to_string()),
        ) {
            add(d.clone(), d.clone(), d);
        }
    }
    out
}

/// Dumps container `id` with CRIU, leaving it running: its TCP connections, file locks and
/// deleted-but-open files are kept (`tcp_established`, `file_locks`, `link_remap`); its
/// external mounts ([`external_mounts`]) and the pod's network (and shared pid) namespace
/// are recorded as external; its cgroups are recorded, not made (soft mode). Where the
/// container's stdio went is kept in `descriptors.json`, as runc and libcontainer do. The
/// helper is single-threaded, which the fd juggling below relies on.
///
/// With `diff` (the container's overlay upper directory, and where its archive goes) the
/// root filesystem's changes are archived at CRIU's `post-dump` notification, while the
/// tasks are still stopped: a file the dump records open by name (a shell's `> c.new`) is
/// in the diff under that name, not under the one the resumed task renames it to.
fn checkpoint(
    root: &Path,
    id: &str,
    image_path: PathBuf,
    work_path: Option<PathBuf>,
    diff: Option<(PathBuf, PathBuf)>,
) -> Result<(), LibcontainerError> {
    use std::os::unix::fs::DirBuilderExt;
    // Closed: criu swrk is not to inherit the host's mount namespace.
    drop(take_host_mount_ns());
    let c = load(root, id)?;
    let pid = c
        .pid()
        .ok_or_else(|| LibcontainerError::Other(format!("container {id} has no pid")))?
        .as_raw();
    let spec = oci_spec::runtime::Spec::load(c.bundle().join("config.json"))?;
    let rootfs = rootfs_of(&spec, c.bundle())
        .map(|r| r.display().to_string())
        .unwrap_or_default();
    let criu_path = find_criu()?;
    let mkdir = |d: &Path| match std::fs::DirBuilder::new().mode(0o700).create(d) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            Err(LibcontainerError::OtherIO(e))
        }
        _ => Ok(()),
    };
    mkdir(&image_path)?;
    let images = std::fs::File::open(&image_path).map_err(LibcontainerError::OtherIO)?;
    let descriptors: Vec<String> = (0..3)
        .map(|n| {
            std::fs::read_link(format!("/proc/{pid}/fd/{n}"))
                .map(|l| l.display().to_string())
                .unwrap_or_else(|_| "/dev/null".into())
        })
        .collect();
    std::fs::write(
        image_path.join("descriptors.json"),
        serde_json::to_vec(&descriptors).map_err(LibcontainerError::OtherSerialization)?,
    )
    .map_err(LibcontainerError::OtherIO)?;

    let mut criu =
        rust_criu::Criu::new_with_criu_path(criu_path.display().to_string()).map_err(criu_err)?;
    criu.set_images_dir_fd(images.as_raw_fd());
    let work = match &work_path {
        Some(w) => {
            mkdir(w)?;
            Some(std::fs::File::open(w).map_err(LibcontainerError::OtherIO)?)
        }
        None => None,
    };
    if let Some(w) = &work {
        criu.set_work_dir_fd(w.as_raw_fd());
    }
    for m in external_mounts(&spec, Some(pid)) {
        criu.set_external_mount(m.point, m.key);
    }
    // The pod's namespaces the container joined (by path) are not the container's to dump.
    for (name, path) in pod_namespaces(&spec) {
        let ino = std::fs::metadata(&path)
            .map_err(LibcontainerError::OtherIO)?
            .ino();
        criu.add_external(format!("{name}[{ino}]:{}", rust_criu::criu_ns_to_key(name)));
    }
    criu.set_log_file(CRIU_DUMP_LOG.to_string());
    criu.set_log_level(4);
    criu.set_pid(pid);
    criu.set_leave_running(true);
    criu.set_ext_unix_sk(false);
    criu.set_shell_job(false);
    criu.set_tcp_established(true);
    criu.set_file_locks(true);
    criu.set_orphan_pts_master(true);
    criu.set_manage_cgroups(true);
    criu.cgroups_mode(rust_criu::CgMode::SOFT);
    criu.set_root(rootfs);
    criu.set_link_remap(true);
    let wants_diff = diff.is_some();
    if let Some(d) = diff {
        *lock_diff() = DiffJob::Wanted(d.0, d.1);
        criu.set_notify_scripts(true);
        criu.set_notify_cb(diff_at_post_dump);
    }

    // `criu swrk` inherits stdout, which is our answer pipe: it writes to stderr (the
    // agent's log) while it runs, and stdout is put back for the answer.
    std::io::stdout().flush().ok();
    // SAFETY: plain fd syscalls on fds this process owns; F_DUPFD_CLOEXEC makes a copy criu
    // does not inherit, and dup2 only retargets fd 1.
    let saved = unsafe { libc::fcntl(1, libc::F_DUPFD_CLOEXEC, 10) };
    // SAFETY: as above.
    if saved < 0 || unsafe { libc::dup2(2, 1) } < 0 {
        return Err(LibcontainerError::OtherIO(std::io::Error::last_os_error()));
    }
    let r = criu.dump();
    // SAFETY: `saved` is our copy of the answer pipe; it goes back to fd 1 and is closed.
    let back = unsafe { libc::dup2(saved, 1) };
    // SAFETY: as above.
    unsafe { libc::close(saved) };
    if back < 0 {
        // No way to answer: the agent sees the helper exit without an answer.
        std::process::exit(1);
    }
    drop(work);
    // CRIU writes its log into the work directory when there is one.
    let log = work_path
        .as_deref()
        .unwrap_or(&image_path)
        .join(CRIU_DUMP_LOG);
    r.map_err(|e| criu_failed(e, &log))?;
    if !wants_diff {
        return Ok(());
    }
    match std::mem::replace(&mut *lock_diff(), DiffJob::None) {
        DiffJob::Done => Ok(()),
        DiffJob::Failed(e) => Err(LibcontainerError::Other(format!(
            "archiving the root filesystem's changes while CRIU held the tasks: {e}"
        ))),
        DiffJob::Wanted(..) | DiffJob::None => Err(LibcontainerError::Other(
            "CRIU sent no post-dump notification: the root filesystem's changes were not archived"
                .into(),
        )),
    }
}

/// The rootfs diff a dump is to write at CRIU's `post-dump` (a notify callback is a plain
/// `fn`; the helper is single-threaded).
enum DiffJob {
    None,
    /// The upper directory, and the directory the archive goes into.
    Wanted(PathBuf, PathBuf),
    Done,
    Failed(String),
}

static DIFF_JOB: std::sync::Mutex<DiffJob> = std::sync::Mutex::new(DiffJob::None);

fn lock_diff() -> std::sync::MutexGuard<'static, DiffJob> {
    DIFF_JOB.lock().unwrap_or_else(|e| e.into_inner())
}

/// CRIU's notifications during a dump: at `post-dump` the tasks are dumped and still
/// stopped (CRIU resumes them after the answer). A failure is kept for the dump's caller,
/// not answered to CRIU: the tasks are resumed either way.
fn diff_at_post_dump(
    script: &str,
    _notify: &rust_criu::rust_criu_protobuf::rpc::Criu_notify,
    _fd: Option<RawFd>,
) -> i32 {
    if script != "post-dump" {
        return 0;
    }
    let mut job = lock_diff();
    if let DiffJob::Wanted(upper, out) = &*job {
        *job = match crate::rootfs_diff::write(upper, out) {
            Ok(()) => DiffJob::Done,
            Err(e) => DiffJob::Failed(format!("{} into {}: {e}", upper.display(), out.display())),
        };
    }
    0
}

/// The log [`restore`] has CRIU write into the image directory.
pub const CRIU_RESTORE_LOG: &str = "restore.log";

/// The pid of the restored init, from CRIU's `post-restore` notification (a notify callback
/// is a plain `fn`; the restoring process is single-threaded).
static RESTORED_PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// How many pty masters CRIU handed over (`orphan-pts-master`) in this restore.
static ORPHAN_MASTERS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

fn note_restored_pid(
    script: &str,
    notify: &rust_criu::rust_criu_protobuf::rpc::Criu_notify,
    _fd: Option<RawFd>,
) -> i32 {
    match script {
        "post-restore" => {
            RESTORED_PID.store(notify.pid(), std::sync::atomic::Ordering::SeqCst);
        }
        // One terminal per container: a second outside pty (a `setsid cmd &` from an
        // `exec -it`, say) would replace the first's master, hanging its terminal up.
        // Refusing aborts the restore.
        "orphan-pts-master"
            if ORPHAN_MASTERS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 =>
        {
            tracing::error!("the checkpoint has more than one terminal from outside the container; only the container's own can be restored");
            return 1;
        }
        _ => {}
    }
    0
}

/// Restores container `id` (made by the agent: its bundle written, its rootfs mounted with
/// the checkpoint's changes in it) from the CRIU images in `image_path`, a
/// CheckpointContainer dump; answers the restored init's pid. CRIU makes the container's
/// namespaces, mounts and processes; what came from outside at the dump is given back: the
/// external mounts by key ([`external_mounts`]: this container's volume sources and cgroup,
/// /dev/null over masked files), the pod's network (and shared pid) namespace, and this
/// container's stdio pipes where the dumped ones were pipes (`descriptors.json`).
/// CRIU runs in the container's cgroup, in a child of this helper (see
/// [`restore_in_child`]), so that a failed restore leaves a cgroup the helper can remove.
/// libcontainer's state for the restored init is then written as for a started container:
/// exec, kill, stats and delete work as for any other.
fn restore(
    root: &Path,
    id: &str,
    bundle: &Path,
    image_path: &Path,
    stdio: bool,
    console_socket: Option<&Path>,
) -> Result<i32, LibcontainerError> {
    use libcontainer::container::ContainerStatus;
    use std::os::unix::fs::DirBuilderExt;
    if let Some(host_ns) = take_host_mount_ns() {
        stage_binds(&host_ns, bundle)?;
    }
    let spec = oci_spec::runtime::Spec::load(bundle.join("config.json"))?;
    let rootfs = rootfs_of(&spec, bundle)
        .ok_or_else(|| LibcontainerError::InvalidInput("the spec has no root".into()))?;
    let config = libcontainer::config::YoukiConfig::from_spec(&spec, id)?;
    let dir = root.join(id);
    let restored = (|| {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(LibcontainerError::OtherIO)?;
        // First: it names the cgroup, for whoever cleans up after a restore that died.
        config.save(&dir)?;
        let cgroup = libcgroups::common::create_cgroup_manager(libcgroups::common::CgroupConfig {
            cgroup_path: config.cgroup_path.clone(),
            systemd_cgroup: false,
            container_name: id.to_string(),
        })?;
        let descriptors: Vec<String> = std::fs::read(image_path.join("descriptors.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        let stdio = stdio.then(take_stdio);
        let pid = restore_in_child(&RestoreIn {
            spec: &spec,
            rootfs: &rootfs,
            image_path,
            cgroup: &cgroup,
            stdio: stdio.as_ref(),
            descriptors: &descriptors,
            console_socket,
        })?;
        let mut c = Container::new(id, ContainerStatus::Running, Some(pid), bundle, &dir)?;
        c.set_creator(nix::unistd::geteuid().as_raw());
        c.state.created = Some(chrono::Utc::now());
        c.save()?;
        Ok(pid)
    })();
    if restored.is_err() {
        discard_stateless(&dir, id);
    }
    restored
}

/// Removes what a restore that failed (or died: its helper killed) left of container `id`
/// in its libcontainer dir `dir`, which has no state: the processes in its cgroup, the
/// cgroup (named by the config saved first) and the dir.
fn discard_stateless(dir: &Path, id: &str) {
    if let Ok(config) = libcontainer::config::YoukiConfig::load(dir) {
        let procs = crate::cgroups::Cgroup::new(&config.cgroup_path);
        for _ in 0..50 {
            if procs.signal_all_blocking(nix::sys::signal::SIGKILL) == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let removed = libcgroups::common::create_cgroup_manager(libcgroups::common::CgroupConfig {
            cgroup_path: config.cgroup_path.clone(),
            systemd_cgroup: false,
            container_name: id.to_string(),
        })
        .map_err(|e| e.to_string())
        .and_then(|m| libcgroups::common::CgroupManager::remove(&m).map_err(|e| e.to_string()));
        if let Err(e) = removed {
            tracing::warn!(id, error = %e, "removing the cgroup of a container that was not restored");
        }
    }
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(id, dir = %dir.display(), error = %e, "removing the state of a container that was not restored");
        }
    }
}

/// What [`restore_in_child`] restores, and from where.
struct RestoreIn<'a> {
    spec: &'a oci_spec::runtime::Spec,
    rootfs: &'a Path,
    image_path: &'a Path,
    cgroup: &'a libcgroups::common::AnyCgroupManager,
    stdio: Option<&'a [OwnedFd; 3]>,
    descriptors: &'a [String],
    /// Where the restored terminal's pty master goes (a tty container's checkpoint).
    console_socket: Option<&'a Path>,
}

/// Runs the CRIU restore in a forked child of this helper, which first joins the
/// container's cgroup (so that CRIU and everything it restores start there); the helper
/// itself stays out. The restored init is a sibling of CRIU's swrk (`rst_sibling`): a child
/// of that forked child, reparented to the agent (the pod's PID 1 or a subreaper) when the
/// child exits. Answers its pid.
fn restore_in_child(r: &RestoreIn) -> Result<i32, LibcontainerError> {
    use std::io::Read;
    let io = |e: nix::Error| LibcontainerError::OtherIO(std::io::Error::from(e));
    let (rd, wr) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(io)?;
    std::io::stdout().flush().ok();
    let helper = nix::unistd::getpid();
    // SAFETY: this helper is single-threaded (see the module docs), so the child may run
    // any code; it ends with _exit and never returns into the helper's.
    match unsafe { nix::unistd::fork() }.map_err(io)? {
        nix::unistd::ForkResult::Child => {
            drop(rd);
            // Dies with the helper (killed at its deadline), and at once if that happened
            // already: CRIU's swrk then loses its client and gives the restore up.
            // SAFETY: prctl and _exit on this process only.
            unsafe {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                if nix::unistd::getppid() != helper {
                    libc::_exit(1);
                }
            }
            let answer = match criu_restore(r) {
                Ok(pid) => format!("OK {pid}"),
                Err(e) => format!("ERR {}", error_chain(&e)),
            };
            let mut f = std::fs::File::from(wr);
            let _ = f.write_all(answer.as_bytes());
            drop(f);
            // SAFETY: ends the forked child at once, without the helper's exit path.
            unsafe { libc::_exit(0) }
        }
        nix::unistd::ForkResult::Parent { child } => {
            drop(wr);
            let mut answer = String::new();
            let read = std::fs::File::from(rd).read_to_string(&mut answer);
            let _ = waitpid(child, None);
            read.map_err(LibcontainerError::OtherIO)?;
            match answer.split_once(' ') {
                Some(("OK", pid)) => pid.trim().parse().map_err(|_| {
                    LibcontainerError::Other(format!("restore answered a bad pid {pid:?}"))
                }),
                Some(("ERR", msg)) => Err(LibcontainerError::Other(msg.to_string())),
                _ => Err(LibcontainerError::Other(
                    "the restoring process died without an answer".into(),
                )),
            }
        }
    }
}

/// In [`restore_in_child`]'s child: joins the container's cgroup and has CRIU restore.
fn criu_restore(r: &RestoreIn) -> Result<i32, LibcontainerError> {
    use libcgroups::common::{CgroupManager, ControllerOpt};
    r.cgroup.add_task(Pid::this())?;
    if let Some(resources) = r.spec.linux().as_ref().and_then(|l| l.resources().as_ref()) {
        r.cgroup.apply(&ControllerOpt {
            resources,
            disable_oom_killer: false,
            oom_score_adj: None,
            freezer_state: None,
        })?;
    }
    // `criu swrk` inherits stdout, the agent's answer pipe: it writes to stderr (the
    // agent's log) instead; this child answers through its own pipe.
    // SAFETY: dup2 retargets fd 1 of this single-threaded child only.
    if unsafe { libc::dup2(2, 1) } < 0 {
        return Err(LibcontainerError::OtherIO(std::io::Error::last_os_error()));
    }
    let mut criu = rust_criu::Criu::new_with_criu_path(find_criu()?.display().to_string())
        .map_err(criu_err)?;
    let images = std::fs::File::open(r.image_path).map_err(LibcontainerError::OtherIO)?;
    criu.set_images_dir_fd(images.as_raw_fd());
    criu.set_log_file(CRIU_RESTORE_LOG.to_string());
    criu.set_log_level(4);
    criu.set_root(r.rootfs.display().to_string());
    for m in external_mounts(r.spec, None)
        .into_iter()
        .filter(|m| !m.source.is_empty())
    {
        criu.set_external_mount(m.key, m.source);
    }
    // The pod's namespaces the dump recorded as external: CRIU puts the tasks back in them.
    let mut inherited = Vec::new();
    for (name, path) in pod_namespaces(r.spec) {
        let f = std::fs::File::open(&path).map_err(LibcontainerError::OtherIO)?;
        // Inherited by criu swrk: not close-on-exec.
        nix::fcntl::fcntl(
            f.as_raw_fd(),
            nix::fcntl::F_SETFD(nix::fcntl::FdFlag::empty()),
        )
        .map_err(|e| LibcontainerError::OtherIO(e.into()))?;
        criu.add_inherit_fd(f.as_raw_fd(), rust_criu::criu_ns_to_key(name))
            .map_err(criu_err)?;
        inherited.push(f);
    }
    // The dumped stdio pipes (to the old log pumps) become this container's.
    if let Some(stdio) = r.stdio {
        for (fd, was) in stdio.iter().zip(r.descriptors) {
            if was.starts_with("pipe:") {
                criu.add_inherit_fd(fd.as_raw_fd(), was.clone())
                    .map_err(criu_err)?;
            }
        }
    }
    criu.set_rst_sibling(true);
    criu.set_tcp_established(true);
    criu.set_file_locks(true);
    criu.set_ext_unix_sk(false);
    criu.set_shell_job(false);
    // The tasks stay in the cgroup CRIU runs in (this container's), not the dumped one's.
    criu.set_manage_cgroups(false);
    criu.cgroups_mode(rust_criu::CgMode::IGNORE);
    criu.set_notify_scripts(true);
    criu.set_notify_cb(note_restored_pid);
    // The dumped pty's master was the agent's, outside the dump: CRIU makes a new pair in
    // the container's devpts, gives the restored process the slave at its old index, and
    // hands the master over (its `orphan-pts-master` notification).
    criu.set_orphan_pts_master(r.console_socket.is_some());
    RESTORED_PID.store(0, std::sync::atomic::Ordering::SeqCst);
    ORPHAN_MASTERS.store(0, std::sync::atomic::Ordering::SeqCst);
    criu.restore()
        .map_err(|e| criu_failed(e, &r.image_path.join(CRIU_RESTORE_LOG)))?;
    drop(inherited);
    let pid = match RESTORED_PID.load(std::sync::atomic::Ordering::SeqCst) {
        pid if pid > 0 => pid,
        _ => {
            return Err(LibcontainerError::Other(
                "CRIU restored the container but did not say its pid".into(),
            ))
        }
    };
    if let Some(socket) = r.console_socket {
        let master = criu.take_orphan_pts_master_fd().ok_or_else(|| {
            LibcontainerError::Other(
                "the checkpointed process had a terminal, but its stdio was not on it, so CRIU gave no pty master"
                    .into(),
            )
        })?;
        crate::stdio::send_master(socket, &master).map_err(|e| {
            LibcontainerError::Other(format!(
                "sending the restored pty master to {}: {e}",
                socket.display()
            ))
        })?;
    }
    Ok(pid)
}

fn criu_err(e: rust_criu::CriuError) -> LibcontainerError {
    LibcontainerError::Other(format!("criu: {e}"))
}

/// A failed CRIU call, with the last errors of its `log` when it wrote any.
fn criu_failed(e: rust_criu::CriuError, log: &Path) -> LibcontainerError {
    match criu_errors(log) {
        errors if errors.is_empty() => criu_err(e),
        errors => LibcontainerError::Other(format!("criu: {e}; {errors}")),
    }
}

/// The container's root filesystem as an absolute path (CRIU would resolve a relative one
/// against its own working directory).
fn rootfs_of(spec: &oci_spec::runtime::Spec, bundle: &Path) -> Option<PathBuf> {
    spec.root().as_ref().map(|r| bundle.join(r.path()))
}

/// The last few `Error` lines of a CRIU log, joined: why a dump or restore failed.
pub fn criu_errors(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let errors: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("Error (") || l.starts_with("Error"))
        // Not why anything failed: CRIU goes on without raising its fd limit.
        .filter(|l| !l.contains("Can't setup RLIMIT_NOFILE"))
        .collect();
    let from = errors.len().saturating_sub(3);
    errors[from..]
        .iter()
        .map(|l| l.trim())
        .collect::<Vec<_>>()
        .join(" | ")
}

/// The propagation a mount's options ask for (`rslave`, `private`, ...): mount(2) flags.
pub(crate) fn propagation_flags(opts: &[String]) -> nix::mount::MsFlags {
    use nix::mount::MsFlags;
    opts.iter().fold(MsFlags::empty(), |flags, o| {
        flags
            | match o.as_str() {
                "rprivate" => MsFlags::MS_PRIVATE | MsFlags::MS_REC,
                "private" => MsFlags::MS_PRIVATE,
                "rslave" => MsFlags::MS_SLAVE | MsFlags::MS_REC,
                "slave" => MsFlags::MS_SLAVE,
                "rshared" => MsFlags::MS_SHARED | MsFlags::MS_REC,
                "shared" => MsFlags::MS_SHARED,
                _ => MsFlags::empty(),
            }
    })
}

/// Applies the propagation options (`rprivate`, `rslave`, `rshared` and their non-recursive
/// forms) of the spec's bind mounts inside the created container's mount namespace.
/// libcontainer 0.7 passes them in the same mount(2) call as MS_BIND, where the kernel ignores
/// them, so a bind mount would keep its source's propagation (the agent's rslave: host mounts
/// made later would show through a "private" mount). Like runc, we change propagation with a
/// separate mount(2) per mount point. Safe here: this helper is single-threaded (setns into a
/// mount namespace requires that) and goes back to its own namespace afterwards.
fn apply_bind_propagation(pid: i32, bundle: &Path) -> Result<(), LibcontainerError> {
    let spec = oci_spec::runtime::Spec::load(bundle.join("config.json"))
        .map_err(|e| LibcontainerError::Other(format!("reading the bundle spec: {e}")))?;
    let mut wanted = Vec::new();
    // Read-only cgroup mounts: libcontainer 0.7 mounts cgroup v1 hierarchies read-write
    // whatever the options say, which would let a container raise its own limits.
    let ro_cgroup = spec.mounts().iter().flatten().any(|m| {
        m.typ().as_deref() == Some("cgroup") && m.options().iter().flatten().any(|o| o == "ro")
    });
    for m in spec.mounts().iter().flatten() {
        let opts = m.options().clone().unwrap_or_default();
        if !crate::mount_tree::is_bind(&opts) {
            continue;
        }
        let flags = propagation_flags(&opts);
        if !flags.is_empty() {
            wanted.push((m.destination().clone(), flags));
        }
    }
    if wanted.is_empty() && !ro_cgroup {
        return Ok(());
    }
    // The init's mounts, with paths as the container sees them (read before joining: the
    // container's /proc has no entry for this helper).
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .map_err(|e| LibcontainerError::Other(format!("reading the container's mountinfo: {e}")))?;
    in_mount_ns_of(pid, || {
        set_propagation(wanted, ro_cgroup.then_some(mountinfo.as_str()))
    })
}

/// Runs `f` in the mount namespace of the made container `pid`, then comes back, whatever
/// `f` did: starting the container, or deleting it, reads this helper's /proc and the
/// container's state in the helper's namespace. A helper that cannot come back can do
/// neither safely: it stops there ([`abort_helper`]). Must run single-threaded (setns of a
/// mount namespace requires it); the helper is.
pub(crate) fn in_mount_ns_of<T>(
    pid: i32,
    f: impl FnOnce() -> Result<T, LibcontainerError>,
) -> Result<T, LibcontainerError> {
    let other = |m: String| LibcontainerError::Other(m);
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/mnt"))
        .map_err(|e| other(format!("opening the container's mount namespace: {e}")))?;
    let own = std::fs::File::open("/proc/self/ns/mnt")
        .map_err(|e| other(format!("opening the helper's mount namespace: {e}")))?;
    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNS)
        .map_err(|e| other(format!("joining the container's mount namespace: {e}")))?;
    let done = f();
    if let Err(e) = nix::sched::setns(&own, nix::sched::CloneFlags::CLONE_NEWNS) {
        abort_helper(
            &format!("returning to the helper's mount namespace: {e}"),
            pid,
        );
    }
    done
}

/// In the container's mount namespace: the propagation of its bind mounts, and its cgroup
/// mounts read-only when `ro_cgroup_mountinfo` (the init's mountinfo) is given.
fn set_propagation(
    wanted: Vec<(PathBuf, nix::mount::MsFlags)>,
    ro_cgroup_mountinfo: Option<&str>,
) -> Result<(), LibcontainerError> {
    use nix::mount::MsFlags;
    for (dest, flags) in wanted {
        nix::mount::mount(None::<&str>, &dest, None::<&str>, flags, None::<&str>).map_err(|e| {
            LibcontainerError::Other(format!(
                "setting the propagation of {} ({flags:?}): {e}",
                dest.display()
            ))
        })?;
    }
    if let Some(mountinfo) = ro_cgroup_mountinfo {
        let mut points: Vec<&str> = mountinfo
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|p| *p == "/sys/fs/cgroup" || p.starts_with("/sys/fs/cgroup/"))
            .collect();
        // Children first, then the tmpfs holding them.
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            let flags = MsFlags::MS_REMOUNT
                | MsFlags::MS_BIND
                | MsFlags::MS_RDONLY
                | MsFlags::MS_NOSUID
                | MsFlags::MS_NODEV
                | MsFlags::MS_NOEXEC;
            nix::mount::mount(None::<&str>, p, None::<&str>, flags, None::<&str>)
                .map_err(|e| LibcontainerError::Other(format!("making {p} read-only: {e}")))?;
        }
    }
    Ok(())
}

fn exec(
    root: &Path,
    id: String,
    cwd: Option<String>,
    env: Vec<String>,
    console_socket: Option<PathBuf>,
    stdio: bool,
    args: Vec<String>,
) -> Result<(), LibcontainerError> {
    let container = load(root, &id)?;
    let spec = oci_spec::runtime::Spec::load(container.bundle().join("config.json"))?;
    let mut process = exec_process(&spec, args, env, cwd, console_socket.is_some())?;
    // libcontainer 0.7's tenant path joins every namespace of the container but its user
    // namespace: in a pod with its own, the exec'd process is set up as host root with every
    // capability (what joining the user namespace needs) and our executor joins it, then
    // takes on the process's own user and capabilities, before the seccomp filter and exec.
    let userns = match ns_path(&spec, oci_spec::runtime::LinuxNamespaceType::User) {
        Some(path) => {
            let fd = std::fs::File::open(&path).map_err(|e| {
                LibcontainerError::Other(format!(
                    "opening the pod's user namespace {}: {e}",
                    path.display()
                ))
            })?;
            let own = UsernsEntry {
                fd: OwnedFd::from(fd),
                user: process.user().clone(),
                caps: process.capabilities().clone(),
            };
            // libcontainer gives a process without HOME the home of the user it sets up,
            // which is root here: the process's own user's, from the image's passwd.
            let env = process.env().clone().unwrap_or_default();
            if !env.iter().any(|e| e.starts_with("HOME=")) {
                let home = spec
                    .root()
                    .as_ref()
                    .and_then(|r| home_of(r.path(), own.user.uid()))
                    .unwrap_or_else(|| "/".into());
                let mut env = env;
                env.push(format!("HOME={home}"));
                process.set_env(Some(env));
            }
            process.set_user(oci_spec::runtime::User::default());
            process.set_capabilities(Some(all_capabilities()?));
            Some(Arc::new(own))
        }
        None => None,
    };
    // The whole process spec (user, capabilities, rlimits, no_new_privileges, terminal) goes
    // through a process.json: the tenant builder's piecemeal setters drop `terminal`, the
    // container's capabilities and its additional gids.
    let process_file = root
        .join(&id)
        .join(format!("exec-{}.json", std::process::id()));
    std::fs::write(
        &process_file,
        serde_json::to_vec(&process).map_err(LibcontainerError::OtherSerialization)?,
    )
    .map_err(LibcontainerError::OtherIO)?;

    // Orphans of the exec'd process, and the process itself once libcontainer's
    // intermediate exits, are reparented to us, so that we can report its exit status.
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        return Err(LibcontainerError::OtherIO(std::io::Error::last_os_error()));
    }
    let mut b = ContainerBuilder::new(id, SyscallType::default())
        .with_root_path(root)?
        .with_console_socket(console_socket);
    if stdio {
        let [i, o, e] = take_stdio();
        b = b.with_stdin(i).with_stdout(o).with_stderr(e);
    }
    // libcontainer 0.7's tenant path rebuilds `linux` without `seccomp`: the exec'd process
    // gets the container's filter from our executor instead, installed last before exec.
    let seccomp = spec.linux().as_ref().and_then(|l| l.seccomp().clone());
    b = b.with_executor(SeccompExecutor { seccomp, userns });
    let built = b
        .as_tenant()
        .with_detach(true)
        .with_process(Some(&process_file))
        .build();
    let _ = std::fs::remove_file(&process_file);
    let pid = built?;
    say(&format!("PID {pid}"));
    loop {
        match waitpid(pid, None) {
            Ok(WaitStatus::Exited(_, code)) => {
                say(&format!("EXIT {code} 0"));
                return Ok(());
            }
            Ok(WaitStatus::Signaled(_, sig, _)) => {
                say(&format!("EXIT {} {}", 128 + sig as i32, sig as i32));
                return Ok(());
            }
            Ok(_) | Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(LibcontainerError::OtherSyscall(e)),
        }
    }
}

/// Runs an exec'd process as libcontainer's default executor does, after installing the
/// container's seccomp filter, which the tenant (exec) path would otherwise drop. Runs in the
/// process to be exec'd, inside the container, after its user and capabilities are set: a
/// filter needs CAP_SYS_ADMIN or no_new_privs, so without the capability no_new_privs is set
/// first (what a container with a seccomp profile and no CAP_SYS_ADMIN needs anyway).
#[derive(Clone)]
struct SeccompExecutor {
    seccomp: Option<oci_spec::runtime::LinuxSeccomp>,
    /// The pod's user namespace to join first, with the exec'd process's own user and
    /// capabilities to take on there.
    userns: Option<Arc<UsernsEntry>>,
}

/// See [`SeccompExecutor::userns`].
struct UsernsEntry {
    fd: OwnedFd,
    user: oci_spec::runtime::User,
    caps: Option<oci_spec::runtime::LinuxCapabilities>,
}

impl UsernsEntry {
    /// In the exec'd process (single-threaded, host root with every capability): joins the
    /// user namespace, where it has every capability, and becomes the process's own user
    /// with its own capabilities, as libcontainer's init does for a container.
    fn enter(&self) -> Result<(), String> {
        use nix::unistd::{Gid, Uid};
        // Until it is the process's own user, it is host root with every capability in the
        // pod's user namespace: nothing there may attach to it meanwhile (exec resets this).
        nix::sys::prctl::set_dumpable(false).map_err(|e| format!("PR_SET_DUMPABLE: {e}"))?;
        nix::sched::setns(&self.fd, nix::sched::CloneFlags::CLONE_NEWUSER)
            .map_err(|e| format!("joining the pod's user namespace: {e}"))?;
        let sys = libcontainer::syscall::syscall::create_syscall();
        let groups: Vec<Gid> = self
            .user
            .additional_gids()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(Gid::from_raw)
            .collect();
        sys.set_groups(&groups)
            .map_err(|e| format!("setting supplementary groups {groups:?}: {e}"))?;
        sys.set_id(
            Uid::from_raw(self.user.uid()),
            Gid::from_raw(self.user.gid()),
        )
        .map_err(|e| format!("becoming {}:{}: {e}", self.user.uid(), self.user.gid()))?;
        libcontainer::capabilities::reset_effective(sys.as_ref())
            .map_err(|e| format!("resetting capabilities: {e}"))?;
        if let Some(c) = &self.caps {
            libcontainer::capabilities::drop_privileges(c, sys.as_ref())
                .map_err(|e| format!("dropping capabilities: {e}"))?;
        }
        if let Some(mask) = self.user.umask() {
            nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(mask));
        }
        Ok(())
    }
}

/// The home directory of `uid` in the image's `/etc/passwd` under `rootfs`, resolved
/// inside the rootfs (an image's symlink cannot lead out of it), a regular file, read up to
/// 1 MiB.
fn home_of(rootfs: &Path, uid: u32) -> Option<String> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    use std::io::Read;
    let root = rustix::fs::open(
        rootfs,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let fd = rustix::fs::openat2(
        &root,
        "etc/passwd",
        OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    )
    .ok()?;
    let st = rustix::fs::fstat(&fd).ok()?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return None;
    }
    let mut text = String::new();
    std::fs::File::from(fd)
        .take(1 << 20)
        .read_to_string(&mut text)
        .ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 6 && f[2].parse() == Ok(uid)).then(|| f[5].to_string())
    })
}

/// The path of the namespace of type `typ` the container joins, if it joins one.
fn ns_path(
    spec: &oci_spec::runtime::Spec,
    typ: oci_spec::runtime::LinuxNamespaceType,
) -> Option<PathBuf> {
    spec.linux()
        .as_ref()?
        .namespaces()
        .as_ref()?
        .iter()
        .find(|n| n.typ() == typ)?
        .path()
        .clone()
}

/// The pod's namespaces the container joined by path that CRIU takes as external: its
/// network namespace and, in a pod sharing one, its pid namespace; each with CRIU's name
/// for its type.
fn pod_namespaces(spec: &oci_spec::runtime::Spec) -> Vec<(&'static str, PathBuf)> {
    use oci_spec::runtime::LinuxNamespaceType;
    [
        (LinuxNamespaceType::Network, "net"),
        (LinuxNamespaceType::Pid, "pid"),
    ]
    .into_iter()
    .filter_map(|(typ, name)| Some((name, ns_path(spec, typ)?)))
    .collect()
}

/// Every capability this process has (root on a host may lack some), permitted, effective
/// and bounding; none inheritable or ambient.
fn all_capabilities() -> Result<oci_spec::runtime::LinuxCapabilities, LibcontainerError> {
    use oci_spec::runtime::{Capability, LinuxCapabilitiesBuilder};
    let own = caps::read(None, caps::CapSet::Permitted)
        .map_err(|e| LibcontainerError::Other(format!("reading capabilities: {e}")))?;
    let all: std::collections::HashSet<Capability> = own
        .into_iter()
        .filter_map(|c| serde_json::from_value::<Capability>(c.to_string().into()).ok())
        .collect();
    // Explicitly empty: the builder's defaults would raise ambient ones.
    LinuxCapabilitiesBuilder::default()
        .bounding(all.clone())
        .effective(all.clone())
        .permitted(all)
        .inheritable(std::collections::HashSet::new())
        .ambient(std::collections::HashSet::new())
        .build()
        .map_err(|e| LibcontainerError::Other(format!("capability set: {e}")))
}

impl libcontainer::workload::Executor for SeccompExecutor {
    fn exec(
        &self,
        spec: &oci_spec::runtime::Spec,
    ) -> Result<(), libcontainer::workload::ExecutorError> {
        use libcontainer::workload::ExecutorError;
        if let Some(u) = &self.userns {
            u.enter().map_err(ExecutorError::Other)?;
        }
        if let Some(filter) = &self.seccomp {
            let admin = caps::has_cap(
                None,
                caps::CapSet::Effective,
                caps::Capability::CAP_SYS_ADMIN,
            )
            .unwrap_or(false);
            if !admin {
                nix::sys::prctl::set_no_new_privs()
                    .map_err(|e| ExecutorError::Other(format!("setting no_new_privs: {e}")))?;
            }
            // A listener fd (SCMP_ACT_NOTIFY) has nobody to go to for an exec: closed.
            if let Some(fd) = libcontainer::seccomp::initialize_seccomp(filter)
                .map_err(|e| ExecutorError::Other(format!("installing the seccomp filter: {e}")))?
            {
                let _ = nix::unistd::close(fd);
            }
        }
        libcontainer::workload::default::DefaultExecutor {}.exec(spec)
    }

    fn validate(
        &self,
        spec: &oci_spec::runtime::Spec,
    ) -> Result<(), libcontainer::workload::ExecutorValidationError> {
        libcontainer::workload::default::DefaultExecutor {}.validate(spec)
    }
}

/// The exec'd process: the container's process spec with `args`, `env` added to (and
/// overriding) the container's, `cwd` if given, and a terminal if asked.
pub fn exec_process(
    spec: &oci_spec::runtime::Spec,
    args: Vec<String>,
    env: Vec<String>,
    cwd: Option<String>,
    terminal: bool,
) -> Result<oci_spec::runtime::Process, LibcontainerError> {
    let mut process = spec.process().clone().unwrap_or_default();
    let key = |kv: &str| kv.split('=').next().unwrap_or("").to_string();
    let overridden: Vec<String> = env.iter().map(|kv| key(kv)).collect();
    let mut merged: Vec<String> = process
        .env()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .filter(|kv| !overridden.contains(&key(kv)))
        .collect();
    merged.extend(env);
    process.set_env(Some(merged));
    process.set_args(Some(args));
    if let Some(c) = cwd.filter(|c| !c.is_empty()) {
        let c = PathBuf::from(c);
        if c.is_relative() {
            return Err(LibcontainerError::InvalidInput(format!(
                "exec cwd {c:?} must be absolute"
            )));
        }
        process.set_cwd(c);
    }
    process.set_terminal(Some(terminal));
    process.set_console_size(None);
    Ok(process)
}

// ---------------------------------------------------------------------------------------
// The agent side.

/// How the agent runs helpers.
#[derive(Clone)]
pub struct Libct {
    pub exe: PathBuf,
    pub root: PathBuf,
    pub reaper: Arc<Reaper>,
    pub log_level: String,
}

/// A running helper.
pub struct Helper {
    pub pid: i32,
    lines: tokio::io::Lines<BufReader<tokio::net::unix::pipe::Receiver>>,
    exit: oneshot::Receiver<ExitStatus>,
}

/// What a helper said.
#[derive(Debug, PartialEq, Eq)]
pub enum HelperLine {
    Pid(i32),
    Exit(i32, u32),
    Ok,
}

fn map_err(kind: &str, msg: String) -> AgentError {
    match kind {
        "precondition" => AgentError::FailedPrecondition(msg),
        "exists" => AgentError::AlreadyExists(msg),
        "notfound" => AgentError::NotFound(msg),
        "invalid" => AgentError::InvalidArgument(msg),
        _ => AgentError::Internal(msg),
    }
}

/// Parses one protocol line.
pub fn parse_line(line: &str) -> Result<HelperLine, AgentError> {
    let bad = || AgentError::Internal(format!("libcontainer helper said {line:?}"));
    let mut parts = line.splitn(3, ' ');
    match parts.next() {
        Some("PID") => Ok(HelperLine::Pid(
            parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?,
        )),
        Some("EXIT") => {
            let code = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
            let sig = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
            Ok(HelperLine::Exit(code, sig))
        }
        Some("OK") => Ok(HelperLine::Ok),
        Some("ERR") => {
            let kind = parts.next().unwrap_or("internal");
            let msg = parts.next().unwrap_or("").to_string();
            Err(map_err(kind, format!("libcontainer: {msg}")))
        }
        _ => Err(bad()),
    }
}

impl Libct {
    /// Spawns `vessel-agent libct --root R <args>`; `stdio` goes to fds 3/4/5.
    pub fn spawn(
        &self,
        args: &[OsString],
        stdio: Option<[OwnedFd; 3]>,
    ) -> Result<Helper, AgentError> {
        let mut cmd = Command::new(&self.exe);
        cmd.arg("libct")
            .arg("--root")
            .arg(&self.root)
            .args(args)
            .env("VESSEL_AGENT_LOG", &self.log_level)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(fds) = &stdio {
            let raw: [RawFd; 3] = [fds[0].as_raw_fd(), fds[1].as_raw_fd(), fds[2].as_raw_fd()];
            // SAFETY: the closure runs in the forked child before exec and only calls
            // async-signal-safe functions (fcntl, dup2) on fds that are open in the parent
            // (kept alive by `stdio` until after spawn returns).
            unsafe {
                cmd.pre_exec(move || {
                    let mut tmp = [0 as RawFd; 3];
                    for (t, r) in tmp.iter_mut().zip(raw) {
                        // Move out of the way of 3..=5 first; the copies are close-on-exec.
                        *t = libc::fcntl(r, libc::F_DUPFD_CLOEXEC, 10);
                        if *t < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    for (t, target) in tmp.iter().zip(3 as RawFd..) {
                        if libc::dup2(*t, target) < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    Ok(())
                });
            }
        }
        let (mut child, exit) = self
            .reaper
            .spawn(&mut cmd)
            .map_err(|e| AgentError::internal("spawning the libcontainer helper", e))?;
        drop(stdio);
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| AgentError::Internal("helper has no stdout".into()))?;
        let rx = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(stdout))
            .map_err(|e| AgentError::internal("helper stdout", e))?;
        Ok(Helper {
            pid: child.id() as i32,
            lines: BufReader::new(rx).lines(),
            exit,
        })
    }

    /// Runs a helper to completion, returning the pid it reported, if any.
    pub async fn run(
        &self,
        args: &[OsString],
        stdio: Option<[OwnedFd; 3]>,
        timeout: Duration,
    ) -> Result<Option<i32>, AgentError> {
        let mut h = self.spawn(args, stdio)?;
        let res = tokio::time::timeout(timeout, async {
            let mut pid = None;
            loop {
                match h.next().await? {
                    HelperLine::Pid(p) => pid = Some(p),
                    HelperLine::Ok => return Ok(pid),
                    HelperLine::Exit(..) => {}
                }
            }
        })
        .await;
        match res {
            Ok(r) => {
                h.wait().await;
                r
            }
            Err(_) => {
                h.kill();
                Err(AgentError::DeadlineExceeded(format!(
                    "libcontainer helper {:?} did not finish in {timeout:?}",
                    args.first()
                )))
            }
        }
    }
}

impl Helper {
    /// The next protocol line; an `ERR` line or a silent exit is an error.
    pub async fn next(&mut self) -> Result<HelperLine, AgentError> {
        match self.lines.next_line().await {
            Ok(Some(line)) => parse_line(&line),
            Ok(None) => Err(AgentError::Internal(
                "libcontainer helper exited without an answer (see the agent log)".into(),
            )),
            Err(e) => Err(AgentError::internal("reading the helper's answer", e)),
        }
    }

    /// Waits for the helper to exit.
    pub async fn wait(self) -> Option<ExitStatus> {
        self.exit.await.ok()
    }

    pub fn kill(&self) {
        let _ = nix::sys::signal::kill(Pid::from_raw(self.pid), nix::sys::signal::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn criu_is_told_which_mounts_come_from_outside() {
        let spec: oci_spec::runtime::Spec = serde_json::from_value(serde_json::json!({
            "ociVersion": "1.0.2",
            "root": {"path": "/rootfs"},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/vol", "type": "bind", "source": "/srv/vol", "options": ["rbind"]},
                {"destination": "/etc/hosts", "source": "/p/hosts", "options": ["bind", "ro"]},
                {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup"}
            ],
            "linux": {
                "maskedPaths": ["/proc/version", "/proc/no-such-thing", "/sys/firmware"],
                "namespaces": [{"type": "user"}, {"type": "mount"}],
                "devices": [{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}]
            }
        }))
        .unwrap();
        // Masked paths are looked at inside the container's root: ours here.
        let ext = external_mounts(&spec, Some(std::process::id() as i32));
        let has = |p: &str, k: &str| ext.iter().any(|m| m.point == p && m.key == k);
        assert!(
            has("/vol", "/vol") && has("/etc/hosts", "/etc/hosts"),
            "{ext:?}"
        );
        assert!(!ext.iter().any(|m| m.point == "/proc"), "{ext:?}");
        assert!(has("/proc/version", "/dev/null"), "{ext:?}");
        assert!(!ext
            .iter()
            .any(|m| m.point == "/proc/no-such-thing" || m.point == "/sys/firmware"));
        // A user namespace: devices are bound from the host's.
        assert!(
            has("/dev/null", "/dev/null") && has("/dev/fuse", "/dev/fuse"),
            "{ext:?}"
        );
        // cgroup v1 hierarchies of this host, where it has them.
        let v1 = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .any(|l| l.contains(" - cgroup ") && l.contains(" /sys/fs/cgroup/"));
        assert_eq!(
            ext.iter().any(|m| m.point.starts_with("/sys/fs/cgroup/")),
            v1,
            "{ext:?}"
        );
        // A restore binds each key's source: the volumes' (staged) sources, /dev/null
        // over every masked path, the devices from the host.
        let restore = external_mounts(&spec, None);
        let src = |k: &str| {
            restore
                .iter()
                .find(|m| m.key == k)
                .map(|m| m.source.as_str())
        };
        assert_eq!(src("/vol"), Some("/srv/vol"));
        assert_eq!(src("/etc/hosts"), Some("/p/hosts"));
        assert_eq!(src("/dev/null"), Some("/dev/null"));
        assert_eq!(src("/dev/fuse"), Some("/dev/fuse"));
        assert!(restore.iter().any(|m| m.point == "/proc/no-such-thing"));
    }

    #[test]
    fn criu_errors_are_the_last_error_lines() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("dump.log");
        assert_eq!(criu_errors(&log), "");
        std::fs::write(
            &log,
            "(00.1) Warn  (a.c:1): meh\n(00.2) Error (b.c:2): one\n(00.3) Error (c.c:3): two\n\
             (00.4) Error (d.c:4): three\n(00.5) Error (e.c:5): four\n",
        )
        .unwrap();
        assert_eq!(
            criu_errors(&log),
            "(00.3) Error (c.c:3): two | (00.4) Error (d.c:4): three | (00.5) Error (e.c:5): four"
        );
    }

    #[test]
    fn exec_process_merges_env() {
        let spec: oci_spec::runtime::Spec = serde_json::from_str(
            r#"{"ociVersion": "1.0.2",
                "process": {"args": ["sleep"], "cwd": "/w", "env": ["A=1", "B=2"],
                            "user": {"uid": 5, "gid": 6}}}"#,
        )
        .unwrap();
        let p = exec_process(
            &spec,
            vec!["sh".into()],
            vec!["B=3".into(), "C=4".into()],
            None,
            true,
        )
        .unwrap();
        assert_eq!(p.env().clone().unwrap(), ["A=1", "B=3", "C=4"]);
        assert_eq!(p.cwd(), Path::new("/w"));
        assert_eq!(p.user().uid(), 5);
        assert_eq!(p.terminal(), Some(true));
        let p = exec_process(&spec, vec!["sh".into()], vec![], Some("/x".into()), false).unwrap();
        assert_eq!(p.cwd(), Path::new("/x"));
        assert!(exec_process(&spec, vec!["sh".into()], vec![], Some("rel".into()), false).is_err());
    }

    #[test]
    fn lines() {
        assert_eq!(parse_line("PID 42").unwrap(), HelperLine::Pid(42));
        assert_eq!(parse_line("EXIT 137 9").unwrap(), HelperLine::Exit(137, 9));
        assert_eq!(parse_line("OK").unwrap(), HelperLine::Ok);
        assert!(matches!(
            parse_line("ERR precondition container is running"),
            Err(AgentError::FailedPrecondition(m)) if m.contains("container is running")
        ));
        assert!(matches!(parse_line("junk"), Err(AgentError::Internal(_))));
    }
}

#[cfg(test)]
mod home_tests {
    #[test]
    fn home_is_read_inside_the_rootfs_only() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("etc")).unwrap();
        std::fs::write(
            d.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\nweb:x:1001:1001::/srv/web:/bin/sh\n",
        )
        .unwrap();
        assert_eq!(super::home_of(d.path(), 1001).as_deref(), Some("/srv/web"));
        assert_eq!(super::home_of(d.path(), 7), None);
        // A link out of the image resolves inside it; a device is not read.
        let e = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(e.path().join("etc")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", e.path().join("etc/passwd")).unwrap();
        assert_eq!(super::home_of(e.path(), 0), None);
    }
}

#[cfg(test)]
mod caps_tests {
    #[test]
    fn all_capabilities_are_ours() {
        let c = super::all_capabilities().unwrap();
        let own = caps::read(None, caps::CapSet::Permitted).unwrap();
        assert_eq!(c.permitted().as_ref().map(|p| p.len()), Some(own.len()));
        assert_eq!(c.ambient().as_ref().map(|p| p.len()), Some(0));
        assert_eq!(c.inheritable().as_ref().map(|p| p.len()), Some(0));
    }
}
