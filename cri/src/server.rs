//! Starting and stopping vesseld: directories, the store, the CRI socket, metrics.

use crate::config::Config;
use crate::image_service::ImageService;
use crate::runtime_service::RuntimeService;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use vessel_cri_api::v1::image_service_server::ImageServiceServer;
use vessel_cri_api::v1::runtime_service_server::RuntimeServiceServer;
use vessel_images::{ImageStore, Puller};

/// Largest CRI message accepted or sent (kubelet's own limit is 16 MiB).
const MAX_MESSAGE: usize = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Io(#[from] crate::errors::IoAt),
    #[error("another vesseld holds {path} (state dir in use)")]
    AlreadyRunning { path: PathBuf },
    #[error("opening the image store: {0}")]
    Store(#[from] vessel_images::ImageError),
    #[error("socket group {0:?} does not exist")]
    NoSuchGroup(String),
    #[error("recovering pods and containers: {0}")]
    Runtime(String),
    #[error("runtime.cgroup_driver = \"systemd\": {0}")]
    CgroupDriver(#[from] crate::sandbox::systemd::SystemdError),
    #[error(transparent)]
    Streaming(#[from] crate::streaming::StreamingError),
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ServeError {
    crate::errors::io_at(op, path)
}

/// A running daemon's shared parts.
pub struct Daemon {
    pub config: Config,
    pub store: Arc<ImageStore>,
    pub puller: Arc<Puller>,
    _lock: File,
}

impl Daemon {
    /// Prepares directories and state; takes the state dir lock.
    pub fn open(config: Config) -> Result<Daemon, ServeError> {
        // root_dir holds image layers (setuid binaries, device nodes), container records
        // (environment, secrets) and pod state: root only. state_dir is traversable (0711)
        // because the CRI socket may live there for `socket_group`; what it holds per pod is
        // made root-only by `StateDirs`. Set on every start: older versions made root_dir 0711.
        for (d, mode) in [
            (&config.daemon.root_dir, 0o700),
            (&config.daemon.state_dir, 0o711),
        ] {
            fs::create_dir_all(d).map_err(io("create", d))?;
            fs::set_permissions(d, fs::Permissions::from_mode(mode)).map_err(io("chmod", d))?;
        }
        let lock_path = config.daemon.state_dir.join("vesseld.lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io("open", &lock_path))?;
        if rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
            return Err(ServeError::AlreadyRunning { path: lock_path });
        }
        let store = Arc::new(config.open_image_store()?);
        store.collect_crash_leftovers()?;
        let puller = Arc::new(Puller::new(store.clone(), config.pull_config()));
        Ok(Daemon {
            config,
            store,
            puller,
            _lock: lock,
        })
    }

    fn bind_socket(&self) -> Result<tokio::net::UnixListener, ServeError> {
        let path = &self.config.daemon.socket;
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(io("create", dir))?;
        }
        // The state lock says no other vesseld runs with our state; a socket file left at our
        // path is debris of a crash.
        match fs::symlink_metadata(path) {
            Ok(_) => fs::remove_file(path).map_err(io("remove stale socket", path))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("stat", path)(e)),
        }
        let l = tokio::net::UnixListener::bind(path).map_err(io("bind", path))?;
        fs::set_permissions(path, fs::Permissions::from_mode(0o660)).map_err(io("chmod", path))?;
        let group = self.config.daemon.socket_group.trim();
        if !group.is_empty() {
            let gid = resolve_group(group).ok_or_else(|| ServeError::NoSuchGroup(group.into()))?;
            std::os::unix::fs::chown(path, None, Some(gid)).map_err(io("chown", path))?;
        }
        Ok(l)
    }

    /// Serves CRI until `shutdown` resolves, then removes the socket.
    pub async fn serve(
        self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), ServeError> {
        // Before the socket: a client that connects finds a daemon that can run pods.
        let cgroups = self.config.runtime.cgroup_driver.driver();
        cgroups.check().await?;
        tracing::info!(driver = cgroups.name(), "cgroup driver");
        let listener = self.bind_socket()?;
        let socket = self.config.daemon.socket.clone();
        let metrics_task = if self.config.daemon.metrics_address.is_empty() {
            None
        } else {
            let addr = &self.config.daemon.metrics_address;
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(io("bind metrics address", Path::new(addr)))?;
            tracing::info!(address = %addr, "metrics: serving GET /metrics");
            Some(tokio::spawn(crate::metrics::serve(l)))
        };
        crate::sandbox::process::become_subreaper();
        let probe = tokio::task::spawn_blocking(vessel_vmm::probe::probe)
            .await
            .map_err(|e| ServeError::Runtime(format!("KVM probe: {e}")))?;
        let kvm_usable = probe.verdict == vessel_vmm::probe::Verdict::Usable;
        crate::metrics::get().set_kvm_verdict(&probe.verdict.to_string());
        let kvm_reason = format!("KVM {}: {}", probe.verdict, probe.reason);
        // The VM backend also needs its guest kernel, initrd and shim.
        let shim = self.config.shim_binary();
        let guest_root = self.config.guest_root();
        let missing = [
            (
                "guest kernel",
                "GuestKernelMissing",
                self.config.vm.kernel.clone(),
            ),
            (
                "guest root (initrd or EROFS image)",
                "GuestInitrdMissing",
                guest_root.path().to_path_buf(),
            ),
            ("VM shim", "ShimMissing", shim.clone()),
        ]
        .into_iter()
        .find(|(_, _, p)| !p.is_file());
        let (ready, reason_code, reason) = match (kvm_usable, &missing) {
            (false, _) => (
                false,
                if probe.verdict == vessel_vmm::probe::Verdict::Absent {
                    "KVMAbsent"
                } else {
                    "KVMUnusable"
                },
                kvm_reason,
            ),
            (true, Some((what, code, p))) => (
                false,
                *code,
                format!("{kvm_reason}; but the {what} {} is missing", p.display()),
            ),
            (true, None) => (true, "VMBackendReady", kvm_reason),
        };
        let reason_code = reason_code.to_string();
        if ready {
            tracing::info!(verdict = %probe.verdict, reason = %probe.reason, probe_ms = probe.probe_ms, kernel = %self.config.vm.kernel.display(), guest_root = ?guest_root, shim = %shim.display(), "KVM probe: microVM pods enabled");
        } else {
            tracing::warn!(
                verdict = %probe.verdict,
                reason = %reason,
                ratio = probe.evidence.as_ref().map(|e| e.ratio),
                probe_ms = probe.probe_ms,
                fallback = ?self.config.runtime.vm_fallback,
                "microVMs cannot run on this node; runtime handler vm falls back to flat pods"
            );
        }
        let rt = crate::runtime::Runtime::open(
            crate::runtime::RuntimeOptions {
                vm: crate::runtime::VmSupport {
                    ready,
                    kvm_usable,
                    reason_code,
                    reason,
                    fallback: self.config.runtime.vm_fallback
                        == crate::config::VmFallback::Fallback,
                },
                vm_cfg: self.config.vm.clone(),
                guest_root,
                shim_binary: self.config.shim_binary(),
                default_handler: self.config.runtime.default_handler.clone(),
                agent_binary: self.config.agent_binary(),
                log_level: self.config.daemon.log_level.clone(),
                root_dir: self.config.daemon.root_dir.clone(),
                state_dir: self.config.daemon.state_dir.clone(),
                cni: self.config.cni(),
                cgroups,
                cdi_spec_dirs: self.config.runtime.cdi_spec_dirs.clone(),
                criu: self.config.runtime.enable_criu_support,
                ignore_image_defined_volumes: self.config.runtime.ignore_image_defined_volumes,
            },
            self.store.clone(),
        )
        .await
        .map_err(|e| ServeError::Runtime(e.to_string()))?;
        let (streaming, streaming_listener) = crate::streaming::StreamingServer::bind(
            &self.config.daemon.streaming_address,
            rt.clone(),
            self.config.daemon.stream_idle_timeout(),
        )
        .await?;
        let streaming_task = tokio::spawn(streaming.clone().serve(streaming_listener));
        let (counts_rt, counts_store) = (rt.clone(), self.store.clone());
        crate::metrics::get().set_source(move || {
            let (pods, containers) = counts_rt.counts();
            crate::metrics::Snapshot {
                pods,
                containers,
                images: counts_store
                    .list()
                    .map(|l| i64::try_from(l.len()).unwrap_or(i64::MAX))
                    .unwrap_or(0),
                blobs_committed: counts_store
                    .stats
                    .blobs_committed
                    .load(std::sync::atomic::Ordering::Relaxed),
                layers_unpacked: counts_store
                    .stats
                    .layers_unpacked
                    .load(std::sync::atomic::Ordering::Relaxed),
            }
        });
        let events_rt = rt.clone();
        let runtime = RuntimeService::new(rt, self.config.daemon.root_dir.display().to_string())
            .with_streaming(streaming);
        let images = ImageService::new(self.puller.clone());
        tracing::info!(
            socket = %socket.display(),
            root = %self.config.daemon.root_dir.display(),
            version = env!("CARGO_PKG_VERSION"),
            "vesseld: serving CRI runtime.v1"
        );
        let routes = tonic::service::Routes::new(
            RuntimeServiceServer::new(runtime)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        )
        .add_service(
            ImageServiceServer::new(images)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        );
        // The socket listens and the services are built: tell systemd (Type=notify).
        crate::notify::notify(&format!(
            "READY=1\nSTATUS=serving CRI on {}",
            socket.display()
        ));
        // At the signal: tell systemd, and end event streams (they never end by themselves,
        // and graceful shutdown waits for open calls).
        let shutdown = async move {
            shutdown.await;
            crate::notify::notify("STOPPING=1");
            events_rt.end_event_streams();
        };
        let res: Result<(), std::io::Error> = serve_grpc(listener, routes, shutdown).await;
        if let Some(t) = metrics_task {
            t.abort();
        }
        streaming_task.abort();
        let _ = fs::remove_file(&socket);
        tracing::info!("vesseld: stopped");
        res.map_err(io("serving", &socket))
    }
}

/// Serves gRPC (HTTP/2) on `listener` until `shutdown`, then lets the calls in flight finish
/// (up to [`SHUTDOWN_GRACE`]).
///
/// Not tonic's transport server: it answers a call whose `grpc-timeout` passes with
/// CANCELLED, where gRPC servers answer DEADLINE_EXCEEDED (upstream critest checks the code;
/// the client's own deadline raced ours). Here a call simply runs until it finishes or the
/// client resets the stream (which drops its future, as a timeout would); the client
/// enforces its deadline and reports DEADLINE_EXCEEDED itself.
async fn serve_grpc(
    listener: tokio::net::UnixListener,
    routes: tonic::service::Routes,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), std::io::Error> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // EMFILE and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting a CRI connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let svc = hyper_util::service::TowerToHyperService::new(crate::metrics::GrpcMetrics::new(
            routes.clone(),
        ));
        let mut stop = stop_rx.clone();
        conns.spawn(async move {
            let builder =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .http2_only();
            let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "CRI connection ended");
                    }
                    return;
                }
                _ = stop.wait_for(|s| *s) => conn.as_mut().graceful_shutdown(),
            }
            let _ = conn.await;
        });
        // Reap finished connections as we go.
        while conns.try_join_next().is_some() {}
    }
    drop(listener);
    let _ = stop_tx.send(true);
    if tokio::time::timeout(SHUTDOWN_GRACE, async {
        while conns.join_next().await.is_some() {}
    })
    .await
    .is_err()
    {
        tracing::warn!("CRI calls still running after {SHUTDOWN_GRACE:?}; closing them");
        conns.abort_all();
    }
    Ok(())
}

/// How long calls in flight may run on after vesseld was asked to stop.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

fn resolve_group(g: &str) -> Option<u32> {
    if let Ok(gid) = g.parse::<u32>() {
        return Some(gid);
    }
    let groups = fs::read_to_string("/etc/group").ok()?;
    groups.lines().find_map(|l| {
        let mut it = l.split(':');
        let name = it.next()?;
        let _ = it.next();
        let gid = it.next()?;
        (name == g).then(|| gid.parse().ok()).flatten()
    })
}

/// Resolves when SIGTERM or SIGINT arrives. The handlers are installed at the call, not at
/// the future's first poll: a SIGTERM right after READY (which comes before the server
/// polls this) must shut vesseld down, not kill it. Call it inside the runtime.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    async move {
        let (mut term, mut int) = match (term, int) {
            (Ok(t), Ok(i)) => (t, i),
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!(error = %e, "cannot watch SIGTERM and SIGINT");
                return std::future::pending().await;
            }
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("vesseld: SIGTERM, shutting down"),
            _ = int.recv() => tracing::info!("vesseld: SIGINT, shutting down"),
        }
    }
}
