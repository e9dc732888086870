//! The gRPC `Agent` service: the pod's containers, driven through [`crate::libct`].

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::cgroups::Cgroup;
use crate::container::{Container, Phase};
use crate::error::{validate_id, AgentError};
use crate::libct::{HelperLine, Libct};
use crate::logs::{pump, LogFile, Stream};
use crate::proto::agent_server::Agent;
use crate::proto::{self, exec_input, exec_output, rootfs};
use crate::stdio::{dev_null, pipe, set_winsize, AsyncFdIo, ConsoleSocket};

/// ExecSync keeps at most this much of its two output streams together: kubelet (and
/// vesseld) take CRI messages of 16 MiB at most, and the reply must fit in one, with room
/// for the rest of it. More is dropped, as a reply too large would fail the whole call.
pub const EXEC_OUTPUT_CAP: usize = 15 * 1024 * 1024;
/// How long a graceful shutdown waits after SIGTERM before SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(10);
const HELPER_TIMEOUT: Duration = Duration::from_secs(60);
const KILL_WAIT: Duration = Duration::from_secs(10);
/// How long a CRIU dump may run before it is killed, when the request does not say: a
/// safety valve, not the caller's deadline (vesseld answers that one itself).
const CHECKPOINT_LIMIT: Duration = Duration::from_secs(3600);
/// How long an exec's output may stay idle after the command exited before it is closed (a
/// background process it started holds it open).
const EXEC_DRAIN: Duration = Duration::from_secs(1);
/// How long a streaming exec's output is read at most after the command exited (a background
/// process that keeps writing).
const EXEC_DRAIN_MAX: Duration = Duration::from_secs(30);

/// What only a VM-mode agent has.
pub struct VmParts {
    /// The image layer disks, mounted once and shared.
    pub layers: crate::disks::Layers,
    /// Where `/run/vessel/files/` really is (itself, except in tests).
    pub files_root: PathBuf,
    /// `/proc/sys`.
    pub proc_sys: PathBuf,
    /// The layers each container uses, released on delete.
    uses: Mutex<HashMap<String, Vec<String>>>,
}

impl VmParts {
    pub fn new(layers: crate::disks::Layers, files_root: PathBuf, proc_sys: PathBuf) -> VmParts {
        VmParts {
            layers,
            files_root,
            proc_sys,
            uses: Mutex::new(HashMap::new()),
        }
    }

    fn take_uses(&self, id: &str) -> Vec<String> {
        self.uses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id)
            .unwrap_or_default()
    }
}

/// Everything the service owns.
pub struct AgentState {
    pub state_dir: PathBuf,
    /// Where each container's dir (bundle, rootfs mount point, staged binds) is made.
    pub containers_dir: PathBuf,
    pub libct: Libct,
    /// This agent's pid as seen by itself.
    pub pid: u32,
    pub hostname: String,
    pub started_at: i64,
    containers: Mutex<HashMap<String, Arc<Container>>>,
    /// Serialises create and delete.
    lifecycle: tokio::sync::Mutex<()>,
    shutdown_tx: watch::Sender<bool>,
    shut_down: tokio::sync::Mutex<bool>,
    /// Set in VM mode.
    pub vm: Option<VmParts>,
}

/// The `Agent` gRPC service.
#[derive(Clone)]
pub struct AgentService {
    pub state: Arc<AgentState>,
}

fn io_internal(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> AgentError {
    move |e| AgentError::internal(what, e)
}

/// Reads `r` to EOF into `out`, as far as `room` (shared by the streams of one exec) lasts;
/// the rest is read and dropped. `out` holds what came so far, for a caller that stops
/// waiting (a background process keeps the stream open).
async fn collect<R: AsyncRead + Unpin>(
    mut r: R,
    out: Arc<std::sync::Mutex<Vec<u8>>>,
    room: Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::Ordering;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let taken = room
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
                        Some(left - n.min(left))
                    })
                    .map_or(0, |left| n.min(left));
                if taken > 0 {
                    out.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .extend_from_slice(&buf[..taken]);
                }
            }
        }
    }
}

/// What [`collect`] gathered into `out`.
fn collected(out: &std::sync::Mutex<Vec<u8>>) -> Vec<u8> {
    std::mem::take(&mut *out.lock().unwrap_or_else(|p| p.into_inner()))
}

fn pipe_reader(fd: OwnedFd) -> Result<tokio::net::unix::pipe::Receiver, AgentError> {
    tokio::net::unix::pipe::Receiver::from_owned_fd(fd).map_err(io_internal("pipe reader"))
}

/// Clamps a negative `oomScoreAdj` we are not allowed to set (no CAP_SYS_RESOURCE) to our
/// own value, so that libcontainer's write does not fail the create.
fn clamp_oom_score_adj(spec: &mut oci_spec::runtime::Spec) {
    let Some(process) = spec.process_mut().as_mut() else {
        return;
    };
    let Some(want) = process.oom_score_adj() else {
        return;
    };
    let ours: i32 = std::fs::read_to_string("/proc/self/oom_score_adj")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    if want >= ours || has_cap_sys_resource() {
        return;
    }
    tracing::warn!(
        want,
        using = ours,
        "no CAP_SYS_RESOURCE: cannot lower oom_score_adj below the agent's; using the agent's"
    );
    process.set_oom_score_adj(Some(ours));
}

fn has_cap_sys_resource() -> bool {
    const CAP_SYS_RESOURCE: u32 = 24;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << CAP_SYS_RESOURCE) != 0)
}

/// What a started exec looks like to the service.
struct ExecProcess {
    helper: crate::libct::Helper,
    pid: i32,
    /// stdout (or the pty), stderr (absent with a tty).
    stdout: Box<dyn AsyncRead + Send + Unpin>,
    stderr: Option<Box<dyn AsyncRead + Send + Unpin>>,
    stdin: Option<Box<dyn tokio::io::AsyncWrite + Send + Unpin>>,
    pty: Option<OwnedFd>,
}

struct ExecParams<'a> {
    args: &'a [String],
    env: &'a [String],
    cwd: &'a str,
    tty: bool,
    stdin: bool,
    size: Option<proto::WindowSize>,
}

impl AgentState {
    /// `hostname` is reported by `Ping` only if the kernel's cannot be read.
    pub fn new(state_dir: PathBuf, libct: Libct, hostname: String) -> Arc<AgentState> {
        let containers = state_dir.join("containers");
        Self::build(state_dir, containers, libct, hostname, None)
    }

    /// The state of a flat agent whose containers' dirs are in `containers_dir` (not under
    /// `state_dir`: a pod with its own user namespace).
    pub fn new_with(
        state_dir: PathBuf,
        containers_dir: PathBuf,
        libct: Libct,
        hostname: String,
    ) -> Arc<AgentState> {
        Self::build(state_dir, containers_dir, libct, hostname, None)
    }

    /// The state of an agent in VM mode.
    pub fn new_vm(state_dir: PathBuf, libct: Libct, vm: VmParts) -> Arc<AgentState> {
        let containers = state_dir.join("containers");
        Self::build(state_dir, containers, libct, String::new(), Some(vm))
    }

    fn build(
        state_dir: PathBuf,
        containers_dir: PathBuf,
        libct: Libct,
        hostname: String,
        vm: Option<VmParts>,
    ) -> Arc<AgentState> {
        let (shutdown_tx, _) = watch::channel(false);
        // The pod's hostname as set (or the host's, for host-network pods).
        let hostname = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or(hostname);
        Arc::new(AgentState {
            state_dir,
            containers_dir,
            libct,
            pid: std::process::id(),
            hostname,
            started_at: crate::now_nanos(),
            containers: Mutex::new(HashMap::new()),
            lifecycle: tokio::sync::Mutex::new(()),
            shutdown_tx,
            shut_down: tokio::sync::Mutex::new(false),
            vm,
        })
    }

    /// Becomes true once the agent should stop serving.
    pub fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.shutdown_tx.subscribe()
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Container>>> {
        self.containers.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn get(&self, id: &str) -> Result<Arc<Container>, AgentError> {
        self.table()
            .get(id)
            .cloned()
            .ok_or_else(|| AgentError::no_container(id))
    }

    pub async fn create(&self, req: proto::CreateContainerRequest) -> Result<u32, AgentError> {
        validate_id(&req.id)?;
        let _guard = self.lifecycle.lock().await;
        if self.table().contains_key(&req.id) {
            return Err(AgentError::AlreadyExists(format!(
                "container {:?} already exists",
                req.id
            )));
        }
        let dir = self.containers_dir.join(&req.id);
        if dir.exists() {
            // A leftover from a failed attempt.
            self.cleanup_dir(&req.id, &dir, true).await;
        }
        std::fs::create_dir_all(&dir)
            .map_err(io_internal(format!("creating {}", dir.display())))?;
        match self.create_in(&req, &dir).await {
            Ok(c) => {
                self.table().insert(req.id.clone(), c);
                Ok(0)
            }
            Err(e) => {
                tracing::warn!(id = %req.id, error = %e, "create failed; cleaning up");
                // Nothing of libcontainer's exists yet: it runs at start.
                self.cleanup_dir(&req.id, &dir, false).await;
                self.release_layers(&req.id).await;
                Err(e)
            }
        }
    }

    async fn create_in(
        &self,
        req: &proto::CreateContainerRequest,
        dir: &Path,
    ) -> Result<Arc<Container>, AgentError> {
        let id = req.id.as_str();
        if !req.apparmor_policy.is_empty() {
            let policy = req.apparmor_policy.clone();
            tokio::task::spawn_blocking(move || crate::apparmor::load(&policy))
                .await
                .map_err(|e| AgentError::internal("loading AppArmor policy", e))??;
        }
        // An overlay rootfs is checked and its directories made here; it is mounted when the
        // container starts (`launch`), as containerd mounts a snapshot at task creation.
        let (rootfs, overlay, upperdir) = match req.rootfs.as_ref().and_then(|r| r.kind.as_ref()) {
            Some(rootfs::Kind::Path(p)) => {
                let p = PathBuf::from(p);
                if !p.is_dir() {
                    return Err(AgentError::InvalidArgument(format!(
                        "rootfs path {} is not a directory",
                        p.display()
                    )));
                }
                (p, None, None)
            }
            Some(rootfs::Kind::Overlay(ov)) => {
                let target = dir.join("rootfs");
                let prepared = crate::rootfs::prepare_overlay(&target, ov)?;
                let upper = (!ov.upperdir.is_empty()).then(|| PathBuf::from(&ov.upperdir));
                (target, Some(prepared), upper)
            }
            Some(rootfs::Kind::Disks(d)) => {
                let Some(vm) = &self.vm else {
                    return Err(AgentError::InvalidArgument(
                        "disk layer rootfs is for VM pods; this agent runs a flat pod".into(),
                    ));
                };
                let points = vm.layers.acquire(&d.serials).await?;
                vm.uses
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id.to_string(), d.serials.clone());
                let path_str = |p: PathBuf| {
                    p.into_os_string()
                        .into_string()
                        .map_err(|p| AgentError::Internal(format!("non-UTF-8 path {p:?}")))
                };
                let ov = proto::OverlayRootfs {
                    lowerdirs: points.into_iter().map(path_str).collect::<Result<_, _>>()?,
                    upperdir: path_str(dir.join("upper"))?,
                    workdir: path_str(dir.join("work"))?,
                };
                let target = dir.join("rootfs");
                let prepared = crate::rootfs::prepare_overlay(&target, &ov)?;
                (target, Some(prepared), Some(dir.join("upper")))
            }
            None => return Err(AgentError::InvalidArgument("rootfs is required".into())),
        };

        let restore = match req.restore_dir.as_str() {
            "" => None,
            _ if self.vm.is_some() => {
                return Err(AgentError::FailedPrecondition(format!(
                    "container {id:?}: a VM pod's guest has no CRIU: checkpoints are restored in flat pods"
                )))
            }
            d if Path::new(d).is_absolute() && Path::new(d).is_dir() => Some(PathBuf::from(d)),
            d => {
                return Err(AgentError::InvalidArgument(format!(
                    "container {id:?}: restore_dir {d:?} is not an absolute path to a directory"
                )))
            }
        };
        let mut spec = crate::spec::prepare(&req.oci_spec, id, &rootfs, req.tty, self.pid)?;
        // runc makes a missing working directory (kubelet passes a pod's workingDir as it
        // is); libcontainer fails the start instead. A restore's processes have theirs.
        let make_cwd = match (&restore, spec.process().as_ref()) {
            (None, Some(p)) if p.cwd() != Path::new("/") => {
                let owner = crate::userns::pod()
                    .map(|u| (u.uid.to_host(0).unwrap_or(0), u.gid.to_host(0).unwrap_or(0)))
                    .unwrap_or((0, 0));
                Some(crate::container::MakeCwd {
                    cwd: p.cwd().clone(),
                    owner,
                    in_volume: crate::rootfs::covering_bind(&spec, p.cwd()).is_some(),
                })
            }
            _ => None,
        };
        clamp_oom_score_adj(&mut spec);
        crate::spec::bind_pod_shm(&mut spec, &self.containers_dir)?;
        let cgroup = Cgroup::new(&crate::spec::cgroups_path(&spec, id));
        let bundle = dir.join("bundle");
        // Root's only: the spec holds the environment (secrets), and a user-namespaced pod's
        // container dirs are reachable by unprivileged ids.
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(&bundle)
            .map_err(io_internal("creating the bundle dir"))?;
        spec.save(bundle.join("config.json"))
            .map_err(|e| AgentError::internal("writing config.json", e))?;

        let log = if req.log_vsock_port != 0 {
            if self.vm.is_none() {
                return Err(AgentError::InvalidArgument(
                    "log_vsock_port is for VM pods; use log_path".into(),
                ));
            }
            LogFile::vsock(id, req.log_vsock_port, &req.log_vsock_token).map_err(io_internal(
                format!("connecting to the host's log port {}", req.log_vsock_port),
            ))?
        } else {
            LogFile::open(&req.log_path)
                .map_err(io_internal(format!("opening log {}", req.log_path)))?
        };

        let c = Container::new(
            id.to_string(),
            dir.to_path_buf(),
            rootfs,
            overlay,
            upperdir,
            cgroup,
            log,
            req.stdin,
            req.tty,
            req.stdin_once,
            restore,
            make_cwd,
        );
        tracing::info!(id, "container created");
        Ok(c)
    }

    /// Launches a created container: libcontainer creates its processes and starts it, in one
    /// helper (`libct create --start`). Done at StartContainer, as containerd does, so that
    /// CreateContainer stays cheap; the price of making the processes (the helper, the
    /// container's cgroups and mounts) is paid once, here.
    async fn launch(&self, c: &Arc<Container>) -> Result<i32, AgentError> {
        let id = c.id.as_str();
        let dir = c.dir.as_path();
        if let Some(overlay) = &c.overlay {
            crate::rootfs::mount_prepared(&c.rootfs, overlay)?;
        }
        let rootfs_cwd = c.make_cwd.as_ref().filter(|m| !m.in_volume);
        if let Some(crate::container::MakeCwd { cwd, owner, .. }) = rootfs_cwd {
            crate::rootfs::make_cwd(&c.rootfs, cwd, *owner).map_err(|e| {
                let m = format!(
                    "container {id:?}: making its working directory {}: {e}",
                    cwd.display()
                );
                if crate::rootfs::cwd_error_is_request(&e) {
                    AgentError::InvalidArgument(m)
                } else {
                    AgentError::Internal(m)
                }
            })?;
        }
        // As runc does on cgroup v2 where swap is accounted: no swap beyond the limit
        // (libcontainer leaves a v2 swap of 0 unwritten). From the final spec, after any
        // update of the created container; a restore's cgroup is made from it too.
        if c.cgroup.is_v2() && crate::cgroups::accounts_swap() {
            let config = dir.join("bundle").join("config.json");
            crate::spec::edit_bundle(&config, |s| Ok(crate::spec::no_swap_on_v2(s)))
                .map_err(|e| AgentError::internal("setting the bundle's cgroup v2 swap", e))?;
        }
        let mut args: Vec<OsString> = match &c.restore {
            None => vec!["create".into()],
            Some(images) => vec![
                "restore".into(),
                "--image-path".into(),
                images.clone().into_os_string(),
            ],
        };
        args.extend([
            "--id".into(),
            id.into(),
            "--bundle".into(),
            dir.join("bundle").into_os_string(),
        ]);
        if c.restore.is_none() {
            args.push("--start".into());
        }
        if let Some(m) = c.make_cwd.as_ref().filter(|m| m.in_volume) {
            args.push("--make-cwd-as".into());
            args.push(format!("{}:{}", m.owner.0, m.owner.1).into());
        }
        let log = c.log.clone();
        let mut pumps: Vec<JoinHandle<()>> = Vec::new();
        let mut keep_stdin: Option<OwnedFd> = None;
        let stdio;
        let mut console = None;
        // Not in the container's dir: a flat pod's is too deep for a socket path.
        let mut console_end = None;
        if c.tty {
            // The helper's side sends the master before it answers (a connection and its
            // message wait in the socket's queue), so it is received once the helper is
            // done: a helper that fails leaves nothing waiting.
            let (end, sock) = ConsoleEndpoint::bind(&self.state_dir)?;
            args.push("--console-socket".into());
            args.push(end.path.clone().into_os_string());
            console_end = Some(end);
            console = Some(sock);
            stdio = None;
        } else {
            let (stdin_r, stdin_w) = if c.want_stdin {
                let (r, w) = pipe().map_err(io_internal("pipe"))?;
                (r, Some(w))
            } else {
                (dev_null().map_err(io_internal("/dev/null"))?, None)
            };
            keep_stdin = stdin_w;
            let (out_r, out_w) = pipe().map_err(io_internal("pipe"))?;
            let (err_r, err_w) = pipe().map_err(io_internal("pipe"))?;
            pumps.push(tokio::spawn(pump(
                pipe_reader(out_r)?,
                Stream::Stdout,
                log.clone(),
            )));
            pumps.push(tokio::spawn(pump(
                pipe_reader(err_r)?,
                Stream::Stderr,
                log.clone(),
            )));
            args.push("--stdio".into());
            stdio = Some([stdin_r, out_w, err_w]);
        }

        let oom_before = c.cgroup.oom_kill_count().unwrap_or(0);
        // A restore's CRIU loads the container's whole memory back.
        let limit = match c.restore {
            Some(_) => CHECKPOINT_LIMIT,
            None => HELPER_TIMEOUT,
        };
        let created = self.libct.run(&args, stdio, limit).await;
        let pid = match created {
            Ok(Some(pid)) => pid,
            Ok(None) => {
                for p in &pumps {
                    p.abort();
                }
                return Err(AgentError::Internal("create reported no pid".into()));
            }
            Err(e) => {
                for p in &pumps {
                    p.abort();
                }
                return Err(e);
            }
        };
        // The reaper keeps an exit that came first: a container that exits at once is seen.
        let exit_rx = self.libct.reaper.watch(pid);

        if let Some(sock) = console {
            let master =
                tokio::task::spawn_blocking(move || sock.recv_master(HELPER_TIMEOUT, None)).await;
            drop(console_end.take());
            let master = match master
                .map_err(|e| AgentError::internal("console socket task", e))
                .and_then(|m| m.map_err(io_internal("receiving the pty master")))
            {
                Ok(m) => m,
                Err(e) => {
                    // Made (or restored) and running, but with no terminal anyone could
                    // read: it goes, as a failed helper's container does.
                    c.cgroup.signal_all(Signal::SIGKILL).await;
                    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                    return Err(e);
                }
            };
            if c.want_stdin {
                keep_stdin = Some(master.try_clone().map_err(io_internal("dup"))?);
            }
            let reader = AsyncFdIo::new(master).map_err(io_internal("pty master"))?;
            pumps.push(tokio::spawn(pump(reader, Stream::Stdout, log.clone())));
        }
        c.set_launched(pid, keep_stdin);
        if let Some(images) = c.restore.clone() {
            // Restored: the images (the container's memory, maybe gigabytes) are done with;
            // CRIU's log stays with the container.
            tokio::task::spawn_blocking(move || drop_restored_images(&images));
        }
        let c2 = c.clone();
        let root = self.libct.root.clone();
        tokio::spawn(async move {
            let status = exit_rx.await.unwrap_or(crate::reaper::ExitStatus {
                code: -1,
                signal: 0,
            });
            c2.set_reaped();
            // A container whose init was not its pid namespace's PID 1 (the pod's shared one,
            // the host's) leaves its other processes (children, exec sessions) running when
            // the init exits: they die with it, as runc's shim kills them all, before the exit
            // is known (a restarted container would find its ports held, its log written to).
            // The exit's moment, not the end of the clean-up below.
            let finished_at = crate::now_nanos();
            if !c2.cgroup.kill_all(KILL_WAIT).await {
                tracing::warn!(id = %c2.id, "processes of an exited container outlived SIGKILL");
            }
            let info = c2.exit_info(status, finished_at, oom_before, pumps).await;
            // Nothing needs libcontainer's state, the cgroups or the rootfs mount of an exited
            // container (its OOM count is read, its output drained): they go before the exit
            // is known, as containerd deletes its task when a container stops, so that
            // RemoveContainer has only files left to remove. Not while processes are left
            // (one that outlived SIGKILL): the removal tries again.
            if c2.cgroup.procs().is_empty() {
                release_exited(&root, &c2).await;
            }
            c2.publish_exit(info);
        });
        tracing::info!(id, pid, "container launched");
        Ok(pid)
    }

    /// Removes what a (possibly half-made) container left: libcontainer state and cgroup,
    /// the rootfs mount and the directory.
    async fn cleanup_dir(&self, id: &str, dir: &Path, libct: bool) {
        if libct {
            if let Err(e) = self.libct_delete(id).await {
                tracing::warn!(id, error = %e, "libcontainer delete during cleanup");
            }
        }
        crate::rootfs::unmount_all(&dir.join("rootfs"));
        if !crate::rootfs::unstage_binds(dir) {
            tracing::error!(id, dir = %dir.display(), "a staged bind mount is still mounted; leaving the container dir");
            return;
        }
        if let Err(e) = std::fs::remove_dir_all(dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(id, dir = %dir.display(), error = %e, "removing container dir");
            }
        }
    }

    /// New limits for a container: written into its cgroup once it runs; before that (created,
    /// not started: its cgroup is made at start from its bundle's spec) into the spec, as
    /// containerd updates a created container's. Zero or empty fields are left alone.
    pub async fn update_resources(
        &self,
        id: &str,
        res: &proto::LinuxResources,
    ) -> Result<(), AgentError> {
        let c = self.get(id)?;
        // A start under way holds the lock: afterwards the container runs, and its cgroup
        // takes the update.
        let _guard = match c.launched() || c.is_exited() {
            true => None,
            false => Some(self.lifecycle.lock().await),
        };
        let bad = |e: std::io::Error| match e.kind() {
            std::io::ErrorKind::InvalidInput | std::io::ErrorKind::Unsupported => {
                AgentError::InvalidArgument(format!("container {id}: {e}"))
            }
            _ => AgentError::FailedPrecondition(format!("container {id}: {e}")),
        };
        if c.launched() || c.is_exited() {
            return c.cgroup.update(res).map_err(bad);
        }
        update_spec_resources(&c.dir.join("bundle").join("config.json"), res).map_err(bad)
    }

    /// Starts a created container; returns its init's pid.
    pub async fn start(&self, id: &str) -> Result<i32, AgentError> {
        let c = self.get(id)?;
        // Launches exclude create, delete and shutdown of the pod's containers.
        let _guard = self.lifecycle.lock().await;
        c.begin_start().map_err(|phase| {
            AgentError::FailedPrecondition(format!(
                "container {id:?} cannot be started: it is {}",
                phase_name(&phase)
            ))
        })?;
        let r = self.launch(&c).await;
        if let Err(e) = &r {
            tracing::warn!(id, error = %e, "start failed");
        }
        c.end_start(r.is_ok());
        r
    }

    /// Sends `sig` to the init (or every process) of `c`.
    async fn signal(
        c: &Arc<Container>,
        sig: impl Into<crate::signals::SigNum>,
        all: bool,
    ) -> Result<(), AgentError> {
        let sig = sig.into();
        // Not launched: no process to signal (and pid 0 would mean the agent's own group).
        if c.is_exited() || !c.launched() {
            return Ok(());
        }
        if all {
            c.cgroup.signal_all(sig).await;
        }
        // A reaped init's pid is not signalled (it may be another process's by now); what is
        // left of the container is its cgroup's, which `all` reached.
        let Some(pid) = c.live_pid() else {
            return Ok(());
        };
        let sent = if all {
            crate::signals::kill(pid, sig)
        } else {
            crate::signals::send_to_init(c, sig)
        };
        match sent {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
            Err(e) => Err(AgentError::internal(format!("kill {}", c.pid()), e)),
        }
    }

    pub async fn delete(&self, id: &str) -> Result<(), AgentError> {
        validate_id(id)?;
        let _guard = self.lifecycle.lock().await;
        let Ok(c) = self.get(id) else {
            return Ok(());
        };
        self.delete_locked(&c).await
    }

    /// libcontainer's delete of `id` (state, cgroups), on a blocking thread.
    async fn libct_delete(&self, id: &str) -> Result<(), AgentError> {
        libct_delete_blocking(self.libct.root.clone(), id.to_string()).await
    }

    async fn delete_locked(&self, c: &Arc<Container>) -> Result<(), AgentError> {
        // Not while CRIU holds its processes.
        let _dumped = c.dumping.lock().await;
        if c.launched() && !c.is_exited() {
            Self::signal(c, Signal::SIGKILL, true).await?;
            if tokio::time::timeout(KILL_WAIT, c.wait()).await.is_err() {
                return Err(AgentError::DeadlineExceeded(format!(
                    "container {:?} did not die within {KILL_WAIT:?} of SIGKILL",
                    c.id
                )));
            }
        }
        // Also for a container never launched: a failed launch may have left state.
        libct_delete_once(&self.libct.root, c).await?;
        if c.overlay.is_some() {
            crate::rootfs::unmount_all(&c.rootfs);
        }
        self.release_layers(&c.id).await;
        if !crate::rootfs::unstage_binds(&c.dir) {
            return Err(AgentError::Internal(format!(
                "container {:?}: a staged bind mount under {} is still mounted",
                c.id,
                c.dir.display()
            )));
        }
        if let Err(e) = std::fs::remove_dir_all(&c.dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                return Err(AgentError::internal(
                    format!("removing {}", c.dir.display()),
                    e,
                ));
            }
        }
        self.table().remove(&c.id);
        tracing::info!(id = %c.id, "container deleted");
        Ok(())
    }

    /// Dumps a running container with CRIU into `req.image_dir`, leaving it running (flat
    /// pods); answers the container's OCI spec. The dump runs in a task of its own, which
    /// holds the container's `dumping` lock until CRIU has ended: a caller that gives up (a
    /// dropped call) leaves neither CRIU unwatched nor the container removable mid-dump.
    /// CRIU is not killed to meet a deadline (that can leave its parasite code and TCP repair
    /// mode in the tasks); only a dump past [`CHECKPOINT_LIMIT`] (or `timeout_secs`) is.
    pub async fn checkpoint(
        &self,
        req: &proto::CheckpointContainerRequest,
    ) -> Result<Vec<u8>, AgentError> {
        validate_id(&req.id)?;
        if self.vm.is_some() {
            return Err(AgentError::FailedPrecondition(format!(
                "container {:?} is in a VM pod, whose guest has no CRIU: checkpoints are for flat pods",
                req.id
            )));
        }
        let absolute = |p: &str| p.is_empty() || Path::new(p).is_absolute();
        if req.image_dir.is_empty()
            || !absolute(&req.image_dir)
            || !absolute(&req.work_dir)
            || !absolute(&req.upper_dir)
            || !absolute(&req.diff_dir)
            || (!req.upper_dir.is_empty() && req.diff_dir.is_empty())
        {
            return Err(AgentError::InvalidArgument(format!(
                "checkpoint directories must be absolute paths (a diff directory with an upper \
                 directory): {:?}, {:?}, {:?}, {:?}",
                req.image_dir, req.work_dir, req.upper_dir, req.diff_dir
            )));
        }
        let c = self.get(&req.id)?;
        if c.dir.join("bundle").join(crate::devbind::MARKER).exists() {
            return Err(AgentError::FailedPrecondition(format!(
                "container {:?} has the host's /dev bound at /dev, put in place after the \
                 runtime made it: CRIU cannot restore those mounts, so it is not checkpointed",
                req.id
            )));
        }
        let guard = {
            let _lifecycle = self.lifecycle.lock().await;
            if !c.launched() || c.is_exited() {
                return Err(AgentError::FailedPrecondition(format!(
                    "container {:?} is not running: only a running container can be checkpointed",
                    req.id
                )));
            }
            c.dumping.clone().try_lock_owned().map_err(|_| {
                AgentError::FailedPrecondition(format!(
                    "container {:?} is being checkpointed already",
                    req.id
                ))
            })?
        };
        let mut args: Vec<OsString> = vec![
            "checkpoint".into(),
            "--id".into(),
            req.id.clone().into(),
            "--image-path".into(),
            req.image_dir.clone().into(),
        ];
        if !req.work_dir.is_empty() {
            args.push("--work-path".into());
            args.push(req.work_dir.clone().into());
        }
        if !req.upper_dir.is_empty() {
            args.push("--upper-dir".into());
            args.push(req.upper_dir.clone().into());
            args.push("--diff-dir".into());
            args.push(req.diff_dir.clone().into());
        }
        let limit = match req.timeout_secs {
            0 => CHECKPOINT_LIMIT,
            n => Duration::from_secs(n.into()),
        };
        let t = std::time::Instant::now();
        let mut helper = self.libct.spawn(&args, None)?;
        let id = req.id.clone();
        let dump = tokio::spawn(async move {
            let _dumping = guard;
            let answer = tokio::time::timeout(limit, async {
                loop {
                    if let HelperLine::Ok = helper.next().await? {
                        return Ok(());
                    }
                }
            })
            .await;
            let r = match answer {
                Ok(r) => r,
                Err(_) => {
                    helper.kill();
                    Err(AgentError::DeadlineExceeded(format!(
                        "the dump of container {id:?} did not end within {limit:?}: CRIU was killed"
                    )))
                }
            };
            helper.wait().await;
            r
        });
        dump.await
            .map_err(|e| AgentError::internal("the dump task", e))??;
        tracing::info!(id = %req.id, image_dir = %req.image_dir, took = ?t.elapsed(), "container checkpointed");
        let spec = c.dir.join("bundle").join("config.json");
        std::fs::read(&spec).map_err(io_internal(format!("reading {}", spec.display())))
    }

    /// Drops the container's references to its layer disks (VM mode).
    async fn release_layers(&self, id: &str) {
        if let Some(vm) = &self.vm {
            let serials = vm.take_uses(id);
            if !serials.is_empty() {
                vm.layers.release(&serials).await;
            }
        }
    }

    /// VM mode only: the guest is the pod.
    fn vm(&self, what: &str) -> Result<&VmParts, AgentError> {
        self.vm.as_ref().ok_or_else(|| {
            AgentError::FailedPrecondition(format!(
                "{what} is for VM pods; vesseld does this on the host for a flat pod"
            ))
        })
    }

    pub fn configure_sandbox(
        &self,
        req: &proto::ConfigureSandboxRequest,
    ) -> Result<(), AgentError> {
        let vm = self.vm("ConfigureSandbox")?;
        if let Some(why) = crate::userns::failed() {
            return Err(AgentError::FailedPrecondition(why.to_string()));
        }
        if !req.hostname.is_empty() {
            crate::files::validate_hostname(&req.hostname)?;
        }
        for k in req.sysctls.keys() {
            crate::files::sysctl_path(&vm.proc_sys, k)?;
        }
        crate::net::validate(&req.interfaces, &req.routes)?;
        if !req.hostname.is_empty() {
            nix::unistd::sethostname(&req.hostname)
                .map_err(|e| AgentError::internal("sethostname", e))?;
            tracing::info!(hostname = %req.hostname, "hostname set");
        }
        crate::files::apply_sysctls(&vm.proc_sys, &req.sysctls)?;
        crate::net::configure(&req.interfaces, &req.routes)?;
        if !req.shared_fs_tag.is_empty() {
            crate::volumes::mount_shared(
                &req.shared_fs_tag,
                Path::new(crate::volumes::GUEST_SHARED),
            )?;
        }
        Ok(())
    }

    /// SIGTERM every container, SIGKILL what is left after [`STOP_GRACE`], delete them all.
    pub async fn shutdown_all(&self) {
        let mut done = self.shut_down.lock().await;
        if *done {
            return;
        }
        let _guard = self.lifecycle.lock().await;
        let all: Vec<Arc<Container>> = self.table().values().cloned().collect();
        for c in &all {
            // A created, never started container's init is PID 1 of its own pid namespace,
            // blocked before exec: it has no handler, so SIGTERM from here is ignored and would
            // cost the whole grace period. Only a running container gets a graceful stop.
            if c.is_running() {
                let _ = Self::signal(c, Signal::SIGTERM, false).await;
            } else if !c.is_exited() {
                let _ = Self::signal(c, Signal::SIGKILL, true).await;
            }
        }
        let waits =
            futures::future::join_all(all.iter().filter(|c| c.launched()).map(|c| c.wait()));
        if tokio::time::timeout(STOP_GRACE, waits).await.is_err() {
            for c in &all {
                let _ = Self::signal(c, Signal::SIGKILL, true).await;
            }
        }
        for c in &all {
            if let Err(e) = self.delete_locked(c).await {
                tracing::warn!(id = %c.id, error = %e, "deleting at shutdown");
            }
        }
        *done = true;
        tracing::info!("all containers removed");
    }

    /// Stops serving; `main` then exits.
    pub fn request_exit(&self) {
        self.shutdown_tx.send_replace(true);
    }

    async fn spawn_exec(
        &self,
        c: &Container,
        p: ExecParams<'_>,
    ) -> Result<ExecProcess, AgentError> {
        if !c.is_running() {
            return Err(AgentError::FailedPrecondition(format!(
                "container {:?} is {}, not running",
                c.id,
                phase_name(&c.phase())
            )));
        }
        if p.args.is_empty() {
            return Err(AgentError::InvalidArgument("exec needs args".into()));
        }
        let mut args: Vec<OsString> = vec!["exec".into(), "--id".into(), c.id.clone().into()];
        if !p.cwd.is_empty() {
            args.push("--cwd".into());
            args.push(p.cwd.into());
        }
        for e in p.env {
            args.push(format!("--env={e}").into());
        }
        let mut console = None;
        let mut stdout: Option<Box<dyn AsyncRead + Send + Unpin>> = None;
        let mut stderr: Option<Box<dyn AsyncRead + Send + Unpin>> = None;
        let mut stdin: Option<Box<dyn tokio::io::AsyncWrite + Send + Unpin>> = None;
        let stdio = if p.tty {
            let (end, sock) = ConsoleEndpoint::bind(&self.state_dir)?;
            args.push("--console-socket".into());
            args.push(end.path.clone().into_os_string());
            let size = p.size.map(|s| (s.rows, s.cols));
            console = Some((
                end,
                tokio::task::spawn_blocking(move || sock.recv_master(HELPER_TIMEOUT, size)),
            ));
            None
        } else {
            let stdin_r = if p.stdin {
                let (r, w) = pipe().map_err(io_internal("pipe"))?;
                stdin = Some(Box::new(
                    tokio::net::unix::pipe::Sender::from_owned_fd(w)
                        .map_err(io_internal("stdin pipe"))?,
                ));
                r
            } else {
                dev_null().map_err(io_internal("/dev/null"))?
            };
            let (out_r, out_w) = pipe().map_err(io_internal("pipe"))?;
            let (err_r, err_w) = pipe().map_err(io_internal("pipe"))?;
            stdout = Some(Box::new(pipe_reader(out_r)?));
            stderr = Some(Box::new(pipe_reader(err_r)?));
            args.push("--stdio".into());
            Some([stdin_r, out_w, err_w])
        };
        args.push("--".into());
        args.extend(p.args.iter().map(OsString::from));

        let mut helper = self.libct.spawn(&args, stdio)?;
        let pid = match tokio::time::timeout(HELPER_TIMEOUT, helper.next()).await {
            Ok(Ok(HelperLine::Pid(pid))) => pid,
            Ok(Ok(other)) => {
                helper.kill();
                return Err(AgentError::Internal(format!("exec helper said {other:?}")));
            }
            Ok(Err(e)) => {
                if let Some((_, t)) = console {
                    t.abort();
                }
                // libcontainer reports a stopped container as FailedPrecondition.
                return Err(e);
            }
            Err(_) => {
                helper.kill();
                return Err(AgentError::DeadlineExceeded("exec did not start".into()));
            }
        };
        let mut pty = None;
        if let Some((end, t)) = console {
            let master = t.await;
            drop(end);
            let master = master
                .map_err(|e| AgentError::internal("console task", e))?
                .map_err(io_internal("receiving the pty master"))?;
            let w = master.try_clone().map_err(io_internal("dup"))?;
            let ctl = master.try_clone().map_err(io_internal("dup"))?;
            stdout = Some(Box::new(
                AsyncFdIo::new(master).map_err(io_internal("pty"))?,
            ));
            if p.stdin {
                stdin = Some(Box::new(AsyncFdIo::new(w).map_err(io_internal("pty"))?));
            }
            pty = Some(ctl);
        }
        Ok(ExecProcess {
            helper,
            pid,
            stdout: stdout.expect("set for both tty and pipes"),
            stderr,
            stdin,
            pty,
        })
    }

    pub async fn exec_sync(
        &self,
        req: proto::ExecSyncRequest,
    ) -> Result<proto::ExecSyncResponse, AgentError> {
        let c = self.get(&req.id)?;
        let p = ExecParams {
            args: &req.args,
            env: &req.env,
            cwd: &req.cwd,
            tty: false,
            stdin: false,
            size: None,
        };
        // A command that cannot be run answers as a shell would (127: not found, 126: not
        // executable), with the reason on stderr: probes and scripts see an exit code, not an
        // RPC failure. The helper reports it while starting or as its outcome.
        let cannot_run = |e: &AgentError| {
            let msg = e.to_string();
            shell_code(&msg).map(|code| proto::ExecSyncResponse {
                stdout: Vec::new(),
                stderr: format!("{msg}\n").into_bytes(),
                exit_code: code,
                timed_out: false,
            })
        };
        let ExecProcess {
            mut helper,
            pid,
            stdout,
            stderr,
            ..
        } = match self.spawn_exec(&c, p).await {
            Ok(p) => p,
            Err(e) => return cannot_run(&e).ok_or(e),
        };
        // A call given up while the command runs (its client went away: a probe's context
        // ended, kubelet restarted) is dropped at an await below: the command must not run
        // on with nobody to wait for it, as containerd kills an exec whose request ended.
        let mut guard = KillOnDrop::new(pid);
        let room = Arc::new(std::sync::atomic::AtomicUsize::new(EXEC_OUTPUT_CAP));
        let (out_buf, err_buf) = (Arc::default(), Arc::default());
        let out = tokio::spawn(collect(stdout, Arc::clone(&out_buf), room.clone()));
        let err = {
            let err_buf = Arc::clone(&err_buf);
            tokio::spawn(async move {
                if let Some(s) = stderr {
                    collect(s, err_buf, room).await;
                }
            })
        };
        let mut timed_out = false;
        let exit = if req.timeout_ms > 0 {
            match tokio::time::timeout(Duration::from_millis(req.timeout_ms), helper.next()).await {
                Ok(r) => r,
                Err(_) => {
                    timed_out = true;
                    if !guard.kill() {
                        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                    }
                    helper.next().await
                }
            }
        } else {
            helper.next().await
        };
        let exit_code = match exit {
            Ok(HelperLine::Exit(code, _)) => {
                guard.disarm();
                code
            }
            Ok(other) => return Err(AgentError::Internal(format!("exec helper said {other:?}"))),
            Err(e) => {
                // Whether it runs is unknown: it is left as before.
                guard.disarm();
                tokio::spawn(helper.wait());
                return cannot_run(&e).ok_or(e);
            }
        };
        // A background process of the command may hold its output open: what came until
        // then is the answer, as containerd gives it.
        let _ = tokio::time::timeout(EXEC_DRAIN, out).await;
        let _ = tokio::time::timeout(EXEC_DRAIN, err).await;
        tokio::spawn(helper.wait());
        Ok(proto::ExecSyncResponse {
            stdout: collected(&out_buf),
            stderr: collected(&err_buf),
            exit_code,
            timed_out,
        })
    }

    pub fn stats(&self, id: &str) -> Result<proto::StatsResponse, AgentError> {
        let c = self.get(id)?;
        let s = c.cgroup.stats();
        // The moment of the cgroup figures (a CPU rate divides by it), before the layer walk.
        let timestamp = crate::now_nanos();
        let (bytes, inodes) = match &c.upperdir {
            Some(u) => c.layer_usage(|| crate::rootfs::usage(u)),
            None => (0, 0),
        };
        Ok(proto::StatsResponse {
            timestamp,
            cpu_usage_ns: s.cpu_usage_ns,
            memory_working_set_bytes: s.memory_working_set_bytes,
            memory_usage_bytes: s.memory_usage_bytes,
            memory_rss_bytes: s.memory_rss_bytes,
            page_faults: s.page_faults,
            major_page_faults: s.major_page_faults,
            pids: s.pids,
            writable_layer_bytes: bytes,
            writable_layer_inodes: inodes,
            cpu_pressure: s.cpu_pressure,
            memory_pressure: s.memory_pressure,
            io_pressure: s.io_pressure,
            memory_limit_bytes: s.memory_limit_bytes,
        })
    }
}

/// Writes new limits into a created container's spec (`linux.resources` of its bundle's
/// `config.json`, replaced atomically): what its cgroup gets at start. Zero or empty fields
/// are left alone; a negative CPU quota removes the quota.
fn update_spec_resources(config: &Path, r: &proto::LinuxResources) -> std::io::Result<()> {
    crate::spec::edit_bundle(config, |spec| {
        crate::spec::merge_resources(spec, r).map(|()| true)
    })
}

/// The console socket of one libcontainer helper (a tty container's launch, a tty exec),
/// in [`console_dir`]: removed, with its private directory if it has one, when dropped, on
/// every path out of the call that made it.
struct ConsoleEndpoint {
    path: PathBuf,
    _dir: Option<tempfile::TempDir>,
}

impl ConsoleEndpoint {
    /// Binds a fresh console socket for a helper's `--console-socket`.
    fn bind(state_dir: &Path) -> Result<(ConsoleEndpoint, ConsoleSocket), AgentError> {
        let (dir, private) =
            console_dir(state_dir).map_err(io_internal("creating the console dir"))?;
        let path = dir.join(format!("{}.sock", rand_suffix()));
        let sock = ConsoleSocket::bind(&path).map_err(io_internal("binding the console socket"))?;
        Ok((
            ConsoleEndpoint {
                path,
                _dir: private,
            },
            sock,
        ))
    }
}

impl Drop for ConsoleEndpoint {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Where a console socket goes. A unix socket path has at most 107 bytes, and the
/// container's own directory (state dir + 64-hex id) leaves too few: `<state dir>/x`, or where
/// even that is too long (flat pods' state dirs hold the pod id), a directory of this exec's
/// own in the temp dir, returned too so that it is removed when dropped. That one is made
/// with an unpredictable name and mode 0700: a shared, fixed-name directory in /tmp could be
/// made first by another user, who could then take the socket's place and receive the
/// exec's terminal.
fn console_dir(state_dir: &Path) -> std::io::Result<(PathBuf, Option<tempfile::TempDir>)> {
    let dir = state_dir.join("x");
    if dir.as_os_str().len() + 40 <= 107 {
        std::fs::create_dir_all(&dir)?;
        return Ok((dir, None));
    }
    use std::os::unix::fs::PermissionsExt;
    let private = tempfile::Builder::new()
        .prefix("vessel-exec-")
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir()?;
    Ok((private.path().to_path_buf(), Some(private)))
}

fn rand_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{:x}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// libcontainer's delete of `id` (state, cgroups) under `root`, on a blocking thread.
/// Removes a restored container's CRIU images, but CRIU's log of the restore.
fn drop_restored_images(images: &Path) {
    let Ok(entries) = std::fs::read_dir(images) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name() == crate::libct::CRIU_RESTORE_LOG {
            continue;
        }
        let p = e.path();
        let r = match e.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(&p),
            _ => std::fs::remove_file(&p),
        };
        if let Err(err) = r {
            tracing::warn!(path = %p.display(), error = %err, "removing a restored container's CRIU image");
        }
    }
}

async fn libct_delete_blocking(root: PathBuf, id: String) -> Result<(), AgentError> {
    tokio::task::spawn_blocking(move || crate::libct::delete(&root, &id))
        .await
        .map_err(|e| AgentError::internal("libcontainer delete task", e))?
}

/// What an exited container holds beyond its files: libcontainer's state and cgroups, the
/// rootfs mount and the staged bind sources. Failures are left for its removal to retry.
async fn release_exited(root: &Path, c: &Container) {
    if let Err(e) = libct_delete_once(root, c).await {
        tracing::debug!(id = %c.id, error = %e, "libcontainer delete at exit; retried at removal");
        return;
    }
    if c.overlay.is_some() {
        crate::rootfs::unmount_all(&c.rootfs);
    }
    crate::rootfs::unstage_binds(&c.dir);
}

/// libcontainer's delete of `c`, once: at its exit or at its removal, whichever comes first
/// (the other waits for it, then has nothing to do).
async fn libct_delete_once(root: &Path, c: &Container) -> Result<(), AgentError> {
    let mut deleted = c.libct_deleted.lock().await;
    if !*deleted {
        libct_delete_blocking(root.to_path_buf(), c.id.clone()).await?;
        *deleted = true;
    }
    Ok(())
}

fn phase_name(p: &Phase) -> &'static str {
    match p {
        Phase::Created => "created",
        Phase::Running => "running",
        Phase::Exited(_) => "exited",
    }
}

/// Drives one streaming exec: client input to the process, its output to the client.
/// The shell's exit code for a command the helper could not start, from its reason.
fn shell_code(msg: &str) -> Option<i32> {
    if msg.contains("not found in $PATH") || msg.contains("No such file or directory") {
        Some(127)
    } else if msg.contains("does not have correct permissions") || msg.contains("Permission denied")
    {
        Some(126)
    } else {
        None
    }
}

/// An exec'd process, SIGKILLed when this is dropped armed (the call that waited for it was
/// given up), through a pidfd opened when it started: a process that exited and was reaped
/// meanwhile is never mistaken for another that took its pid.
struct KillOnDrop(Option<OwnedFd>);

impl KillOnDrop {
    fn new(pid: i32) -> KillOnDrop {
        let fd = rustix::process::Pid::from_raw(pid).and_then(|p| {
            rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
        });
        KillOnDrop(fd)
    }

    /// SIGKILLs it; false without a pidfd (a kernel before 5.3, or it was gone already).
    fn kill(&self) -> bool {
        self.0.as_ref().is_some_and(|fd| {
            let _ = rustix::process::pidfd_send_signal(fd, rustix::process::Signal::KILL);
            true
        })
    }

    /// It exited: nothing to kill any more.
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.0.is_some() {
            tracing::info!("exec: its call was given up; killing its process");
            self.kill();
        }
    }
}

/// Forwards a client's Exec or Attach input until the client closes it (true) or the stream
/// breaks (false): stdin data to `stdin`, `close_stdin` as EOF (with a terminal and `eot`,
/// its EOF character) and then `on_close_stdin`, resizes to the `pty`.
async fn forward_input<W: tokio::io::AsyncWrite + Unpin>(
    input: &mut Streaming<proto::ExecInput>,
    mut stdin: Option<W>,
    pty: Option<&OwnedFd>,
    eot: bool,
    on_close_stdin: &(dyn Fn() + Sync),
) -> bool {
    loop {
        match input.message().await {
            Ok(Some(proto::ExecInput { msg: Some(m) })) => match m {
                exec_input::Msg::Stdin(data) => {
                    if let Some(w) = stdin.as_mut() {
                        if w.write_all(&data).await.is_err() || w.flush().await.is_err() {
                            stdin = None;
                        }
                    }
                }
                exec_input::Msg::CloseStdin(_) => {
                    if let (Some(w), true) = (stdin.as_mut(), pty.is_some() && eot) {
                        let _ = w.write_all(&[4]).await;
                        let _ = w.flush().await;
                    }
                    stdin = None;
                    on_close_stdin();
                }
                exec_input::Msg::Resize(ws) => {
                    if let Some(p) = pty {
                        let _ = set_winsize(p.as_raw_fd(), ws.rows, ws.cols);
                    }
                }
                exec_input::Msg::Start(_) | exec_input::Msg::Attach(_) => {}
            },
            Ok(Some(_)) => {}
            Ok(None) => return true,
            Err(_) => return false,
        }
    }
}

/// Runs one attach session: the container's output to the client until the container
/// exits (then its exit code) or the client leaves; the client's stdin and resizes to the
/// container. With `stdin_once` (and no terminal), the container's stdin closes when this
/// client closes its stdin or leaves, and the session goes on to the container's exit. Else
/// a client that closes the stdin it attached with detaches: the session ends (exit code 0,
/// a success) and the container's stdin stays open, as containerd does (`echo x | kubectl
/// attach -i` returns; `kubectl run -it` tells its user to reattach after a detach). A
/// terminal's gets no EOF character.
async fn drive_attach(
    c: Arc<Container>,
    mut tap: crate::logs::Tap,
    stdin: Option<OwnedFd>,
    mut input: Streaming<proto::ExecInput>,
    tx: mpsc::Sender<Result<proto::ExecOutput, Status>>,
) {
    fn out(m: exec_output::Msg) -> Result<proto::ExecOutput, Status> {
        Ok(proto::ExecOutput { msg: Some(m) })
    }
    let (tty, once) = (c.tty, c.stdin_once && !c.tty);
    let detached = Arc::new(tokio::sync::Notify::new());
    let close_stdin = {
        let c = c.clone();
        let detach = stdin.is_some() && !once;
        let detached = detached.clone();
        move || {
            if once {
                c.stdin.lock().unwrap_or_else(|e| e.into_inner()).take();
            } else if detach {
                detached.notify_one();
            }
        }
    };
    let input_task = tokio::spawn(async move {
        let pty = match (&stdin, tty) {
            (Some(fd), true) => fd.try_clone().ok(),
            _ => None,
        };
        let w = stdin.map(|fd| tokio::fs::File::from_std(std::fs::File::from(fd)));
        forward_input(&mut input, w, pty.as_ref(), false, &close_stdin).await;
        close_stdin();
    });
    let send = |s: Stream, d: Vec<u8>| {
        out(match s {
            Stream::Stdout => exec_output::Msg::Stdout(d),
            Stream::Stderr => exec_output::Msg::Stderr(d),
        })
    };
    let exit = loop {
        tokio::select! {
            m = tap.recv() => match m {
                Some((s, d)) => {
                    if tx.send(send(s, d)).await.is_err() {
                        break None;
                    }
                }
                // Dropped by the log (fell behind): end the session.
                None => break None,
            },
            e = c.wait() => break Some(e),
            _ = detached.notified() => {
                // What the container wrote before is the client's still.
                while let Ok((s, d)) = tap.try_recv() {
                    if tx.send(send(s, d)).await.is_err() {
                        break;
                    }
                }
                tracing::debug!(container = %c.id, "attach: the client closed its stdin and detached");
                let _ = tx.send(out(exec_output::Msg::ExitCode(0))).await;
                break None;
            }
            _ = tx.closed() => break None,
        }
    };
    if let Some(e) = exit {
        // The pumps drained into the log (and so to us) before the exit was published.
        while let Ok((s, d)) = tap.try_recv() {
            if tx.send(send(s, d)).await.is_err() {
                break;
            }
        }
        let code = if e.signal != 0 {
            128 + e.signal as i32
        } else {
            e.exit_code
        };
        let _ = tx.send(out(exec_output::Msg::ExitCode(code))).await;
    }
    input_task.abort();
}

/// Sends what a streaming exec writes to one of its streams to the client, until the stream
/// ends, the client goes away (the command is killed then), or, once the command has exited
/// (`exited`), nothing arrives for [`EXEC_DRAIN`]: a background process it left holds the
/// stream open. Only reading is timed, never sending: a slow client still gets every byte.
async fn pump_exec_output(
    mut r: Box<dyn AsyncRead + Send + Unpin>,
    stderr: bool,
    tx: mpsc::Sender<Result<proto::ExecOutput, Status>>,
    pid: i32,
    mut exited: tokio::sync::watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 32 * 1024];
    let mut draining = false;
    loop {
        let read = if draining || *exited.borrow() {
            draining = true;
            match tokio::time::timeout(EXEC_DRAIN, r.read(&mut buf)).await {
                Ok(read) => read,
                Err(_) => break,
            }
        } else {
            tokio::select! {
                read = r.read(&mut buf) => read,
                // Exited (or the sender is gone): read on, with the idle bound.
                _ = exited.changed() => {
                    draining = true;
                    continue;
                }
            }
        };
        let n = match read {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = buf[..n].to_vec();
        let m = if stderr {
            exec_output::Msg::Stderr(chunk)
        } else {
            exec_output::Msg::Stdout(chunk)
        };
        if tx
            .send(Ok(proto::ExecOutput { msg: Some(m) }))
            .await
            .is_err()
        {
            // The client went away: stop the process (if it still runs).
            if !draining && !*exited.borrow() {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            break;
        }
    }
}

async fn drive_exec(
    mut proc_: ExecProcess,
    mut input: Streaming<proto::ExecInput>,
    tx: mpsc::Sender<Result<proto::ExecOutput, Status>>,
) {
    fn out_msg(m: exec_output::Msg) -> Result<proto::ExecOutput, Status> {
        Ok(proto::ExecOutput { msg: Some(m) })
    }
    let pid = proc_.pid;
    let (exited_tx, exited) = tokio::sync::watch::channel(false);
    let forward = |r: Box<dyn AsyncRead + Send + Unpin>, stderr: bool| {
        tokio::spawn(pump_exec_output(r, stderr, tx.clone(), pid, exited.clone()))
    };
    let mut readers = vec![forward(proc_.stdout, false)];
    if let Some(e) = proc_.stderr.take() {
        readers.push(forward(e, true));
    }
    let stdin = proc_.stdin.take();
    let pty = proc_.pty.take();
    let input_task = tokio::spawn(async move {
        // The client closed its side: keep running, no more input. A broken stream: stop.
        if !forward_input(&mut input, stdin, pty.as_ref(), true, &|| {}).await {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    });
    let exit = tokio::select! {
        // The exit first: once the helper has reaped the command, its pid may be another's.
        biased;
        exit = proc_.helper.next() => exit,
        // The client went away (vesseld's stream was cancelled: its streaming connection
        // ended, or was idle past its timeout). A command that writes nothing would never
        // find out by a failed send: stop it now.
        () = tx.closed() => {
            tracing::info!(pid, "exec: the client went away; stopping the command");
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            proc_.helper.next().await
        }
    };
    // The rest of the output goes to the client however slowly it reads: only a stream that
    // stays idle (a background process holds it open) is given up on, and a bound stops one
    // that a background process keeps writing to.
    let _ = exited_tx.send(true);
    let stop: Vec<_> = readers.iter().map(|r| r.abort_handle()).collect();
    if tokio::time::timeout(EXEC_DRAIN_MAX, futures::future::join_all(readers))
        .await
        .is_err()
    {
        // Nothing more after the exit code: the stream ends with it.
        stop.iter().for_each(|r| r.abort());
    }
    input_task.abort();
    let code = match exit {
        Ok(HelperLine::Exit(code, _)) => code,
        Ok(other) => {
            let _ = tx
                .send(Err(Status::internal(format!("exec helper said {other:?}"))))
                .await;
            return;
        }
        Err(e) => {
            let _ = tx.send(Err(e.into())).await;
            return;
        }
    };
    let _ = tx.send(out_msg(exec_output::Msg::ExitCode(code))).await;
    proc_.helper.wait().await;
}

#[tonic::async_trait]
impl Agent for AgentService {
    async fn ping(
        &self,
        _req: Request<proto::PingRequest>,
    ) -> Result<Response<proto::PingResponse>, Status> {
        Ok(Response::new(proto::PingResponse {
            version: crate::VERSION.to_string(),
            pid: self.state.pid,
            hostname: nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
                .unwrap_or_else(|| self.state.hostname.clone()),
            started_at: self.state.started_at,
            features: crate::FEATURES.iter().map(|f| f.to_string()).collect(),
        }))
    }

    async fn create_container(
        &self,
        req: Request<proto::CreateContainerRequest>,
    ) -> Result<Response<proto::CreateContainerResponse>, Status> {
        let pid = self.state.create(req.into_inner()).await?;
        Ok(Response::new(proto::CreateContainerResponse { pid }))
    }

    async fn start_container(
        &self,
        req: Request<proto::StartContainerRequest>,
    ) -> Result<Response<proto::StartContainerResponse>, Status> {
        // Its own task: a caller that gives up (a deadline, a dropped call) does not leave a
        // launch (a restore may take minutes) half-done and untracked.
        let state = self.state.clone();
        let id = req.into_inner().id;
        let pid = tokio::spawn(async move { state.start(&id).await })
            .await
            .map_err(|e| AgentError::internal("the start task", e))??;
        Ok(Response::new(proto::StartContainerResponse {
            pid: pid as u32,
        }))
    }

    async fn signal_container(
        &self,
        req: Request<proto::SignalContainerRequest>,
    ) -> Result<Response<proto::SignalContainerResponse>, Status> {
        let req = req.into_inner();
        let c = self.state.get(&req.id)?;
        // Any of Linux's, real-time ones included (SIGRTMIN+3 stops systemd).
        let sig = i32::try_from(req.signal)
            .ok()
            .and_then(crate::signals::SigNum::new)
            .ok_or_else(|| AgentError::InvalidArgument(format!("bad signal {}", req.signal)))?;
        AgentState::signal(&c, sig, req.all).await?;
        Ok(Response::new(proto::SignalContainerResponse {}))
    }

    async fn wait_container(
        &self,
        req: Request<proto::WaitContainerRequest>,
    ) -> Result<Response<proto::WaitContainerResponse>, Status> {
        let c = self.state.get(&req.into_inner().id)?;
        let exit = c.wait().await;
        Ok(Response::new(proto::WaitContainerResponse {
            exit: Some(exit),
        }))
    }

    async fn container_status(
        &self,
        req: Request<proto::ContainerStatusRequest>,
    ) -> Result<Response<proto::ContainerStatusResponse>, Status> {
        let c = self.state.get(&req.into_inner().id)?;
        Ok(Response::new(proto::ContainerStatusResponse {
            info: Some(c.info()),
        }))
    }

    async fn list_containers(
        &self,
        _req: Request<proto::ListContainersRequest>,
    ) -> Result<Response<proto::ListContainersResponse>, Status> {
        let mut containers: Vec<proto::ContainerInfo> =
            self.state.table().values().map(|c| c.info()).collect();
        containers.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(Response::new(proto::ListContainersResponse { containers }))
    }

    async fn delete_container(
        &self,
        req: Request<proto::DeleteContainerRequest>,
    ) -> Result<Response<proto::DeleteContainerResponse>, Status> {
        self.state.delete(&req.into_inner().id).await?;
        Ok(Response::new(proto::DeleteContainerResponse {}))
    }

    async fn exec_sync(
        &self,
        req: Request<proto::ExecSyncRequest>,
    ) -> Result<Response<proto::ExecSyncResponse>, Status> {
        Ok(Response::new(self.state.exec_sync(req.into_inner()).await?))
    }

    type ExecStream = ReceiverStream<Result<proto::ExecOutput, Status>>;

    async fn exec(
        &self,
        req: Request<Streaming<proto::ExecInput>>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let mut input = req.into_inner();
        let start = match input.message().await? {
            Some(proto::ExecInput {
                msg: Some(exec_input::Msg::Start(s)),
            }) => s,
            _ => {
                return Err(Status::invalid_argument(
                    "the first Exec message must be `start`",
                ));
            }
        };
        let c = self.state.get(&start.id)?;
        let p = ExecParams {
            args: &start.args,
            env: &start.env,
            cwd: &start.cwd,
            tty: start.tty,
            stdin: start.stdin,
            size: start.size,
        };
        let proc_ = self.state.spawn_exec(&c, p).await?;
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(drive_exec(proc_, input, tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type AttachStream = ReceiverStream<Result<proto::ExecOutput, Status>>;

    async fn attach(
        &self,
        req: Request<Streaming<proto::ExecInput>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let mut input = req.into_inner();
        let start = match input.message().await? {
            Some(proto::ExecInput {
                msg: Some(exec_input::Msg::Attach(a)),
            }) => a,
            _ => {
                return Err(Status::invalid_argument(
                    "the first Attach message must be `attach`",
                ));
            }
        };
        let c = self.state.get(&start.id)?;
        if !c.is_running() {
            return Err(AgentError::FailedPrecondition(format!(
                "container {:?} is {}, not running",
                c.id,
                phase_name(&c.phase())
            ))
            .into());
        }
        // Subscribed before anything else can happen: no output is lost from here on.
        let tap = c.log.tap();
        // A stdin that is closed (a stdin_once container's first session ended) or was never
        // there takes no more input: the client's is dropped, as containerd does.
        let stdin = if start.stdin {
            let guard = c.stdin.lock().unwrap_or_else(|e| e.into_inner());
            if guard.is_none() {
                tracing::info!(container = %c.id, "attach: the container's stdin is closed; the client's input is dropped");
            }
            guard
                .as_ref()
                .map(|fd| fd.try_clone())
                .transpose()
                .map_err(io_internal("dup of the container's stdin"))?
        } else {
            None
        };
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(drive_attach(c, tap, stdin, input, tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn stats(
        &self,
        req: Request<proto::StatsRequest>,
    ) -> Result<Response<proto::StatsResponse>, Status> {
        // The writable layer's walk reads every inode of it: off the runtime's two workers,
        // which every other call of the pod's agent needs.
        let state = self.state.clone();
        let id = req.into_inner().id;
        let s = tokio::task::spawn_blocking(move || state.stats(&id))
            .await
            .map_err(|e| Status::internal(format!("stats: {e}")))??;
        Ok(Response::new(s))
    }

    async fn cgroup_pressure(
        &self,
        req: Request<proto::CgroupPressureRequest>,
    ) -> Result<Response<proto::CgroupPressureResponse>, Status> {
        let req = req.into_inner();
        let path = req.path;
        let p = std::path::Path::new(&path);
        // A pod's cgroup: below the root (whose pressure is the node's), without `..`.
        let named = p
            .components()
            .any(|c| matches!(c, std::path::Component::Normal(_)));
        if !named || p.components().any(|c| c == std::path::Component::ParentDir) {
            return Err(Status::invalid_argument(format!(
                "cgroup path {path:?}: not a cgroup below the root without `..`"
            )));
        }
        let cg = crate::cgroups::Cgroup::new(p);
        let (cpu, memory, io) = cg.pressure();
        // The excluded child (one name) first: what it uses meanwhile lands in the parent's
        // reading too, never taken off twice.
        let exclude = std::path::Path::new(&req.exclude);
        let mut parts = exclude.components();
        let excluded = match (parts.next(), parts.next()) {
            (Some(std::path::Component::Normal(_)), None) => {
                crate::cgroups::Cgroup::new(&p.join(exclude)).counters()
            }
            _ => None,
        };
        let counters = cg.counters().map(|c| {
            let x = excluded.unwrap_or_default();
            proto::CgroupCounters {
                cpu_usage_ns: c[0].saturating_sub(x[0]),
                page_faults: c[1].saturating_sub(x[1]),
                major_page_faults: c[2].saturating_sub(x[2]),
            }
        });
        Ok(Response::new(proto::CgroupPressureResponse {
            cpu,
            memory,
            io,
            counters,
            memory_limit_bytes: cg.memory_limit(),
        }))
    }

    async fn update_resources(
        &self,
        req: Request<proto::UpdateResourcesRequest>,
    ) -> Result<Response<proto::UpdateResourcesResponse>, Status> {
        let r = req.into_inner();
        let res = r.resources.unwrap_or_default();
        self.state.update_resources(&r.id, &res).await?;
        Ok(Response::new(proto::UpdateResourcesResponse {}))
    }

    async fn reopen_log(
        &self,
        req: Request<proto::ReopenLogRequest>,
    ) -> Result<Response<proto::ReopenLogResponse>, Status> {
        let c = self.state.get(&req.into_inner().id)?;
        c.log
            .reopen()
            .map_err(|e| AgentError::internal("reopening the log", e))?;
        Ok(Response::new(proto::ReopenLogResponse {}))
    }

    async fn checkpoint_container(
        &self,
        req: Request<proto::CheckpointContainerRequest>,
    ) -> Result<Response<proto::CheckpointContainerResponse>, Status> {
        let oci_spec = self.state.checkpoint(&req.into_inner()).await?;
        Ok(Response::new(proto::CheckpointContainerResponse {
            oci_spec,
        }))
    }

    async fn shutdown(
        &self,
        _req: Request<proto::ShutdownRequest>,
    ) -> Result<Response<proto::ShutdownResponse>, Status> {
        self.state.shutdown_all().await;
        self.state.request_exit();
        Ok(Response::new(proto::ShutdownResponse {}))
    }

    async fn configure_sandbox(
        &self,
        req: Request<proto::ConfigureSandboxRequest>,
    ) -> Result<Response<proto::ConfigureSandboxResponse>, Status> {
        self.state.configure_sandbox(&req.into_inner())?;
        Ok(Response::new(proto::ConfigureSandboxResponse {}))
    }

    async fn write_files(
        &self,
        req: Request<proto::WriteFilesRequest>,
    ) -> Result<Response<proto::WriteFilesResponse>, Status> {
        let root = self.state.vm("WriteFiles")?.files_root.clone();
        let entries = req.into_inner().entries;
        tokio::task::spawn_blocking(move || crate::files::write_files(&root, &entries))
            .await
            .map_err(|e| AgentError::internal("WriteFiles task", e))??;
        Ok(Response::new(proto::WriteFilesResponse {}))
    }

    async fn remove_files(
        &self,
        req: Request<proto::RemoveFilesRequest>,
    ) -> Result<Response<proto::RemoveFilesResponse>, Status> {
        let root = self.state.vm("RemoveFiles")?.files_root.clone();
        let paths = req.into_inner().paths;
        tokio::task::spawn_blocking(move || crate::files::remove_files(&root, &paths))
            .await
            .map_err(|e| AgentError::internal("RemoveFiles task", e))??;
        Ok(Response::new(proto::RemoveFilesResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A created container's new limits land in its spec: set fields replace, zero ones
    /// leave what was there, a negative quota removes the quota, bad unified names refused.
    #[test]
    fn a_created_containers_limits_go_into_its_spec() {
        let d = tempfile::tempdir().unwrap();
        let config = d.path().join("config.json");
        let spec = serde_json::json!({"process": {"args": ["sh"]}, "linux": {"resources": {
            "cpu": {"shares": 2, "quota": 50000, "period": 100000},
            "memory": {"limit": 1048576}
        }}});
        std::fs::write(&config, spec.to_string()).unwrap();
        let r = proto::LinuxResources {
            cpu_shares: 512,
            cpu_quota: -1,
            memory_limit_in_bytes: 64 << 20,
            cpuset_cpus: "0-1".into(),
            unified: [("memory.high".to_string(), "50M".to_string())].into(),
            ..Default::default()
        };
        update_spec_resources(&config, &r).unwrap();
        let got: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
        let res = &got["linux"]["resources"];
        assert_eq!(res["cpu"]["shares"], 512);
        assert!(res["cpu"].get("quota").is_none(), "{res}");
        assert_eq!(res["cpu"]["period"], 100000);
        assert_eq!(res["cpu"]["cpus"], "0-1");
        assert_eq!(res["memory"]["limit"], 64 << 20);
        assert_eq!(res["unified"]["memory.high"], "50M");
        assert_eq!(got["process"]["args"][0], "sh");
        let bad = proto::LinuxResources {
            unified: [("../x".to_string(), "1".to_string())].into(),
            ..Default::default()
        };
        let e = update_spec_resources(&config, &bad).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    }

    #[test]
    fn console_sockets_go_in_a_short_dir_or_a_private_one() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let (dir, private) = console_dir(d.path()).unwrap();
        assert_eq!(dir, d.path().join("x"));
        assert!(dir.is_dir() && private.is_none());
        // A flat pod's state dir: too long for a socket path beneath it.
        let long = d.path().join("p".repeat(80));
        let (dir, private) = console_dir(&long).unwrap();
        assert!(dir.starts_with(std::env::temp_dir()), "{}", dir.display());
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        let (other, _p2) = console_dir(&long).unwrap();
        assert_ne!(dir, other, "one per exec");
        std::fs::write(dir.join("1.sock"), b"").unwrap();
        drop(private);
        assert!(!dir.exists(), "removed with the exec");
        assert!(!long.exists());
    }

    fn state(dir: &Path, vm: bool) -> Arc<AgentState> {
        let libct = Libct {
            exe: PathBuf::from("/proc/self/exe"),
            root: dir.join("libcontainer"),
            reaper: crate::reaper::Reaper::new(),
            log_level: "info".into(),
        };
        if vm {
            let parts = VmParts::new(
                crate::disks::Layers::new(
                    crate::disks::DiskRoots {
                        sys_block: dir.join("sys/block"),
                        dev: dir.join("dev"),
                    },
                    dir.join("layers"),
                ),
                dir.join("files"),
                dir.join("proc-sys"),
            );
            AgentState::new_vm(dir.join("state"), libct, parts)
        } else {
            AgentState::new(dir.join("state"), libct, "h".into())
        }
    }

    /// What an exec writes reaches a client that reads slowly, also the part still in the pipe
    /// when the command exited; an output a background process holds open, writing nothing,
    /// is closed soon after the exit.
    #[tokio::test]
    async fn exec_output_waits_for_a_slow_client_not_for_an_idle_stream() {
        use tokio::io::AsyncWriteExt;
        let (tx, mut rx) = mpsc::channel(1);
        let (exited_tx, exited) = tokio::sync::watch::channel(false);
        let (reader, mut writer) = tokio::io::duplex(1024);
        let pump = tokio::spawn(pump_exec_output(
            Box::new(reader),
            false,
            tx,
            // No process: the pid is never signalled while the client stays.
            i32::MAX,
            exited,
        ));
        let payload: Vec<u8> = (0..200_000u32)
            .map(|i| (i % 251).to_le_bytes()[0])
            .collect();
        let w = payload.clone();
        let write = tokio::spawn(async move {
            writer.write_all(&w).await.unwrap();
            // Still open, as if a background process held it.
            writer
        });
        // The command exits; the client reads nothing for longer than the idle bound.
        tokio::time::sleep(Duration::from_millis(50)).await;
        exited_tx.send(true).unwrap();
        tokio::time::sleep(EXEC_DRAIN * 2).await;
        let mut got = Vec::new();
        while got.len() < payload.len() {
            match rx.recv().await.unwrap().unwrap().msg {
                Some(exec_output::Msg::Stdout(d)) => got.extend(d),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(got, payload);
        let _writer = write.await.unwrap();
        // Idle (the writer is still held): closed after about the bound, not never.
        let t = std::time::Instant::now();
        tokio::time::timeout(EXEC_DRAIN * 5, pump)
            .await
            .expect("an idle output is closed")
            .unwrap();
        assert!(t.elapsed() >= EXEC_DRAIN / 2, "{:?}", t.elapsed());
    }

    #[tokio::test]
    async fn vm_only_calls() {
        let t = tempfile::tempdir().unwrap();
        let flat = AgentService {
            state: state(t.path(), false),
        };
        let e = flat
            .configure_sandbox(Request::new(proto::ConfigureSandboxRequest::default()))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        let e = flat
            .remove_files(Request::new(proto::RemoveFilesRequest::default()))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);

        let vm = AgentService {
            state: state(t.path(), true),
        };
        std::fs::create_dir_all(t.path().join("proc-sys/net/core")).unwrap();
        std::fs::write(t.path().join("proc-sys/net/core/somaxconn"), "4096").unwrap();
        // Sysctls only (the hostname would change this test machine's).
        let req = proto::ConfigureSandboxRequest {
            hostname: String::new(),
            sysctls: [("net.core.somaxconn".to_string(), "1024".to_string())].into(),
            ..Default::default()
        };
        vm.configure_sandbox(Request::new(req)).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(t.path().join("proc-sys/net/core/somaxconn")).unwrap(),
            "1024"
        );
        for (h, k) in [("bad/host", "net.core.somaxconn"), ("", "../../etc/x")] {
            let req = proto::ConfigureSandboxRequest {
                hostname: h.into(),
                sysctls: [(k.to_string(), "1".to_string())].into(),
                ..Default::default()
            };
            let e = vm.configure_sandbox(Request::new(req)).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{h:?} {k:?}");
        }
        let entry = |p: &str| proto::FileEntry {
            path: p.into(),
            kind: Some(proto::file_entry::Kind::Data(b"x".to_vec())),
            ..Default::default()
        };
        vm.write_files(Request::new(proto::WriteFilesRequest {
            entries: vec![entry("/run/vessel/files/pod/hosts")],
        }))
        .await
        .unwrap();
        assert!(t.path().join("files/pod/hosts").is_file());
        let e = vm
            .write_files(Request::new(proto::WriteFilesRequest {
                entries: vec![entry("/run/vessel/files/../../etc/passwd")],
            }))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        vm.remove_files(Request::new(proto::RemoveFilesRequest {
            paths: vec!["/run/vessel/files/pod".into()],
        }))
        .await
        .unwrap();
        assert!(!t.path().join("files/pod").exists());
    }
}
