//! Flat mode: the agent as PID 1 of a pod's own namespaces on the host.
//!
//! `vessel-agent flat` (the launcher) becomes a session leader, unshares the pod's
//! namespaces (mount always; net, pid, ipc unless shared with the host; uts unless the pod
//! uses the host network) and forks. The child is the agent: PID 1 of the new pid namespace
//! (or a child subreaper with the host's). The launcher waits until the agent serves, prints
//! `READY <agent pid on the host>` and exits 0; on failure it kills the agent, removes what
//! it created, prints the error on stderr and exits non-zero. vesseld pins the pod network
//! namespace by bind-mounting `/proc/<that pid>/ns/net`.
//!
//! With `--uid-map`/`--gid-map` (a pod with its own user namespace) the launcher unshares
//! only mount and pid; the agent, still in the host's user namespace, makes the pod's user
//! namespace and, owned by it, the pod's net, uts, ipc and pid namespaces, joining the first
//! three (`crate::userns`). Its containers' dirs go on a tmpfs of its own at
//! `--userns-root`, which the containers' root can reach.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::waitpid;
use nix::unistd::{fork, setsid, ForkResult};

use crate::error::{io, sys};
use crate::libct::Libct;
use crate::listener::AgentListener;
use crate::reaper::Reaper;
use crate::service::AgentState;

/// How long the launcher waits for the agent to serve.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A namespace a flat pod may share with the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HostNs {
    Net,
    Pid,
    Ipc,
}

/// `vessel-agent flat` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct FlatArgs {
    /// The gRPC Unix socket to serve on (created mode 0600).
    #[arg(long)]
    pub socket: PathBuf,
    /// The agent's state directory (bundles, rootfs mounts, libcontainer state).
    #[arg(long)]
    pub state_dir: PathBuf,
    /// The pod's hostname (ignored when the pod uses the host network).
    #[arg(long)]
    pub hostname: String,
    /// Host namespaces the pod shares.
    #[arg(long, value_delimiter = ',')]
    pub share_host: Vec<HostNs>,
    /// tracing filter for the agent's log (stderr).
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// The file stderr goes to: rotated past [`crate::logs::OWN_LOG_MAX`] (one old file kept).
    #[arg(long)]
    pub log_file: Option<PathBuf>,
    /// The pod's user namespace uid mapping (`container:host:size`); with `--gid-map`, the
    /// pod gets its own user namespace, which owns its net, uts, ipc and pid namespaces.
    #[arg(long)]
    pub uid_map: Option<crate::userns::IdMap>,
    /// The pod's user namespace gid mapping (`container:host:size`).
    #[arg(long)]
    pub gid_map: Option<crate::userns::IdMap>,
    /// With a user namespace: an empty directory every host id can traverse to, where the
    /// agent mounts (in its own mount namespace) the tmpfs that holds its containers' dirs,
    /// so that a container's root, an unprivileged id on the host, reaches its rootfs and
    /// bind sources.
    #[arg(long)]
    pub userns_root: Option<PathBuf>,
}

impl FlatArgs {
    /// Where the agent keeps its containers' dirs.
    fn containers_dir(&self) -> PathBuf {
        match (&self.userns_root, self.uid_map) {
            (Some(r), Some(_)) => r.clone(),
            _ => self.state_dir.join("containers"),
        }
    }
}

impl FlatArgs {
    fn shares(&self, ns: HostNs) -> bool {
        self.share_host.contains(&ns)
    }
}

/// Why flat mode failed.
#[derive(Debug, thiserror::Error)]
pub enum FlatError {
    #[error(transparent)]
    Sys(#[from] crate::error::SysError),
    #[error("the agent failed to start: {0}")]
    Agent(String),
}

/// Runs the launcher; returns only in the launcher (the agent child exits the process).
/// Must be called while the process is single-threaded.
pub fn launch(args: FlatArgs) -> Result<(), FlatError> {
    // A session leader outlives vesseld and its terminal/process-group signals. Fails only
    // if we already lead a process group, in which case we fork into one that does not.
    if setsid().is_err() {
        tracing::debug!("setsid failed (already a group leader); the agent will call it");
    }
    let mut pod_ns = CloneFlags::empty();
    if !args.shares(HostNs::Net) {
        pod_ns |= CloneFlags::CLONE_NEWNET | CloneFlags::CLONE_NEWUTS;
    }
    if !args.shares(HostNs::Pid) {
        pod_ns |= CloneFlags::CLONE_NEWPID;
    }
    if !args.shares(HostNs::Ipc) {
        pod_ns |= CloneFlags::CLONE_NEWIPC;
    }
    let state_existed = args.state_dir.exists();
    let socket_existed = args.socket.exists();
    // The host's mount namespace, for the helpers that look bind sources up there.
    let host_mnt = std::fs::File::open("/proc/self/ns/mnt")
        .map_err(io("opening the host's mount namespace"))?;
    match (args.uid_map, args.gid_map) {
        (None, None) => {}
        (Some(_), Some(_)) => {
            if !args.share_host.is_empty() {
                return Err(FlatError::Agent(
                    "a pod with its own user namespace cannot share host namespaces".into(),
                ));
            }
            // The agent makes the pod's net, uts, ipc and pid namespaces inside the pod's
            // user namespace (so that it owns them) as it starts; its own pid namespace,
            // of which it is PID 1, stays the host's user namespace's.
            pod_ns = CloneFlags::CLONE_NEWPID;
        }
        _ => {
            return Err(FlatError::Agent(
                "--uid-map and --gid-map go together".into(),
            ))
        }
    }
    let flags = CloneFlags::CLONE_NEWNS | pod_ns;
    unshare(flags).map_err(sys(format!("unshare({flags:?})")))?;
    let (ready_r, ready_w) = crate::stdio::pipe().map_err(io("pipe"))?;

    // SAFETY: the process is single-threaded here (no runtime has been built, and main
    // calls us before anything spawns threads), so the child may run arbitrary code.
    match unsafe { fork() }.map_err(sys("fork"))? {
        ForkResult::Child => {
            drop(ready_r);
            if let Err(e) = crate::libct::export_host_mount_ns(host_mnt) {
                tracing::warn!(error = %e, "bind sources will be looked up in the pod's own mount namespace");
            }
            let code = agent_child(&args, ready_w);
            std::process::exit(code);
        }
        ForkResult::Parent { child } => {
            drop(ready_w);
            match wait_ready(ready_r) {
                Ok(()) => {
                    let mut out = std::io::stdout().lock();
                    writeln!(out, "READY {child}").map_err(io("writing READY"))?;
                    out.flush().map_err(io("writing READY"))?;
                    Ok(())
                }
                Err(e) => {
                    let _ = kill(child, Signal::SIGKILL);
                    let _ = waitpid(child, None);
                    if !state_existed {
                        let _ = std::fs::remove_dir_all(&args.state_dir);
                    }
                    if !socket_existed {
                        let _ = std::fs::remove_file(&args.socket);
                    }
                    Err(e)
                }
            }
        }
    }
}

fn wait_ready(r: OwnedFd) -> Result<(), FlatError> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut file = std::fs::File::from(r);
    let mut buf = Vec::new();
    let deadline = std::time::Instant::now() + READY_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(FlatError::Agent(format!(
                "not serving after {READY_TIMEOUT:?}"
            )));
        }
        let ms =
            PollTimeout::try_from(left.as_millis().min(60_000) as i32).unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(
            std::os::fd::AsFd::as_fd(&file),
            PollFlags::POLLIN,
        )];
        match poll(&mut fds, ms) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(sys("poll")(e).into()),
        }
        let mut chunk = [0u8; 4096];
        let n = file.read(&mut chunk).map_err(io("reading readiness"))?;
        if n == 0 {
            let msg = String::from_utf8_lossy(&buf).trim().to_string();
            return Err(FlatError::Agent(if msg.is_empty() {
                "exited before serving (see its log)".into()
            } else {
                msg
            }));
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.ends_with(b"\n") {
            let line = String::from_utf8_lossy(&buf).trim().to_string();
            return match line.strip_prefix("ERR ") {
                None if line == "OK" => Ok(()),
                Some(msg) => Err(FlatError::Agent(msg.to_string())),
                None => Err(FlatError::Agent(format!("unexpected readiness {line:?}"))),
            };
        }
    }
}

/// The agent process. Returns its exit code.
fn agent_child(args: &FlatArgs, ready: OwnedFd) -> i32 {
    let mut ready = std::fs::File::from(ready);
    // stdout belongs to the launcher's READY line: do not hold the pipe open.
    if let Ok(null) = crate::stdio::dev_null() {
        let _ = nix::unistd::dup2(null.as_raw_fd(), 1);
    }
    let _ = setsid();
    let listener = match setup_pod(args) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "pod setup");
            let _ = writeln!(ready, "ERR {}", e.to_string().replace('\n', " "));
            return 1;
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = writeln!(ready, "ERR building the runtime: {e}");
            return 1;
        }
    };
    if let Some(p) = &args.log_file {
        let every = Duration::from_secs(10);
        if let Err(e) = crate::logs::bound_stderr(p.clone(), crate::logs::OWN_LOG_MAX, every) {
            tracing::warn!(error = %e, "no log rotation");
        }
    }
    let code = rt.block_on(serve(args.clone(), listener, ready));
    // Do not wait for stray blocking tasks (a console socket accept, say).
    rt.shutdown_timeout(Duration::from_secs(1));
    code
}

/// Namespaces, mounts, hostname, loopback, state dir and the socket; single-threaded.
fn setup_pod(args: &FlatArgs) -> Result<AgentListener, FlatError> {
    // Host mounts propagate in; ours never leak out.
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_SLAVE,
        None::<&str>,
    )
    .map_err(sys("making / rslave"))?;
    if args.shares(HostNs::Pid) {
        // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes integer arguments only.
        if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
            return Err(io("PR_SET_CHILD_SUBREAPER")(std::io::Error::last_os_error()).into());
        }
    } else {
        mount(
            Some("proc"),
            "/proc",
            Some("proc"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            None::<&str>,
        )
        .map_err(sys("mounting /proc"))?;
    }
    if let (Some(uid), Some(gid)) = (args.uid_map, args.gid_map) {
        let inside = CloneFlags::CLONE_NEWNET
            | CloneFlags::CLONE_NEWUTS
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWPID;
        let made = crate::userns::create(uid, gid, inside)
            .map_err(|e| FlatError::Agent(format!("the pod's user namespace: {e}")))?;
        crate::userns::set_pod(crate::userns::PodUserns {
            fd: made.user,
            uid,
            gid,
            pid_holder: made.pid_holder,
        });
    } else if !args.shares(HostNs::Pid) {
        crate::userns::create_pid_holder()
            .map_err(|e| FlatError::Agent(format!("the pod's pid namespace holder: {e}")))?;
    }
    if !args.shares(HostNs::Net) {
        nix::unistd::sethostname(&args.hostname).map_err(sys("sethostname"))?;
        loopback_up().map_err(io("bringing up lo"))?;
    }
    std::fs::create_dir_all(&args.state_dir)
        .map_err(io(format!("creating {}", args.state_dir.display())))?;
    std::fs::create_dir_all(args.state_dir.join("libcontainer"))
        .map_err(io("libcontainer root"))?;
    if let (Some(root), Some(_)) = (&args.userns_root, args.uid_map) {
        // Private to the agent's mount namespace (its mounts never propagate out), and gone
        // with it.
        mount(
            Some("tmpfs"),
            root,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some("mode=0711,size=64m"),
        )
        .map_err(sys(format!(
            "mounting the containers' tmpfs at {}",
            root.display()
        )))?;
    }
    std::fs::create_dir_all(args.containers_dir()).map_err(io("containers dir"))?;
    Ok(AgentListener::bind_unix(&args.socket)
        .map_err(io(format!("binding {}", args.socket.display())))?)
}

/// `ip link set lo up`, by ioctl.
pub fn loopback_up() -> std::io::Result<()> {
    link_up("lo")
}

/// Sets IFF_UP (and IFF_RUNNING) on interface `name` of this thread's network namespace.
pub fn link_up(name: &str) -> std::io::Result<()> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('\0') {
        return Err(std::io::ErrorKind::InvalidInput.into());
    }
    // SAFETY: a plain socket(2) call; the returned fd is checked and owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let sock = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
        *d = *s as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS writes the flags into the live `req` we pass.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // IFF_UP | IFF_RUNNING is 0x41: it fits the short `ifr_flags`.
    #[allow(clippy::cast_possible_truncation)]
    let up = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: after SIOCGIFFLAGS the union holds `ifru_flags`.
    unsafe {
        req.ifr_ifru.ifru_flags |= up;
    }
    // SAFETY: SIOCSIFFLAGS reads the flags from the live `req` we pass.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

async fn serve(args: FlatArgs, listener: AgentListener, mut ready: std::fs::File) -> i32 {
    use tokio::signal::unix::{signal, SignalKind};
    let reaper = Reaper::new();
    let setup = (|| -> std::io::Result<_> {
        reaper.start()?;
        Ok((
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
        ))
    })();
    let (mut term, mut int) = match setup {
        Ok(s) => s,
        Err(e) => {
            let _ = writeln!(ready, "ERR signal handlers: {e}");
            return 1;
        }
    };
    let libct = Libct {
        exe: PathBuf::from("/proc/self/exe"),
        root: args.state_dir.join("libcontainer"),
        reaper: reaper.clone(),
        log_level: args.log_level.clone(),
    };
    let state = AgentState::new_with(
        args.state_dir.clone(),
        args.containers_dir(),
        libct,
        args.hostname.clone(),
    );
    let st = state.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        st.shutdown_all().await;
        st.request_exit();
    });
    tracing::info!(listen = %listener.describe(), pid = state.pid, "serving");
    let _ = writeln!(ready, "OK");
    drop(ready);

    // Idle clients get 3 s after the last answers went out.
    let code = match listener
        .serve_until_exit(&state, Duration::from_secs(3))
        .await
    {
        Ok(()) => 0,
        Err(e) => {
            tracing::error!(error = %e, "serving");
            1
        }
    };
    state.shutdown_all().await;
    AgentListener::cleanup(&args.socket);
    remove_state(&args.state_dir);
    tracing::info!("agent exiting");
    code
}

fn remove_state(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        tracing::warn!(dir = %dir.display(), error = %e, "removing the state dir");
    }
}

/// Sets up `tracing` to stderr with `level` (a filter); libcontainer's chatter is kept to
/// warnings unless the level asks for debug.
pub fn init_logging(level: &str) {
    init_logging_to(level, std::io::stderr);
}

/// Like [`init_logging`], for the libcontainer helper: logs go to a close-on-exec duplicate
/// of stderr, because libcontainer's container process keeps logging after it has put the
/// container's stdio on fds 0-2, and those lines must not end up in the container's log.
pub fn init_helper_logging(level: &str) {
    match nix::fcntl::fcntl(2, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(3)) {
        Ok(fd) => {
            // SAFETY: F_DUPFD_CLOEXEC just returned this new descriptor; we own it.
            let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            init_logging_to(level, std::sync::Mutex::new(file));
        }
        Err(_) => init_logging_to(level, std::io::sink),
    }
}

fn init_logging_to<W>(level: &str, writer: W)
where
    W: for<'a> tracing_subscriber::fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    let filter = if level.contains('=') || level.contains("debug") || level.contains("trace") {
        level.to_string()
    } else {
        format!("{level},libcontainer=warn,libcgroups=warn")
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(filter)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(writer)
        .with_ansi(false)
        .try_init();
}
