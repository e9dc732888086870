//! The flat sandbox backend: the pod agent runs on the host as PID 1 of the pod's own
//! namespaces (`vessel-agent flat`), a session leader that outlives vesseld. Its network
//! namespace is pinned by bind-mounting `/proc/<pid>/ns/net` under `<run>/netns/` and
//! attached to CNI; there is no pause process. Container roots are overlayfs mounts of the
//! image store's unpacked layers, mounted by the agent.

use super::{
    cgroup, netns, network, process, AgentAddr, ContainerRequest, Dump, ForwardTarget, HostShare,
    Pod, PodLayout, PreparedContainer, SandboxBackend,
};
use crate::cni::Cni;
use crate::errors::{agent_err, internal, Result, RuntimeError};
use crate::state::{BackendKind, BackendState, ContainerRecord, PodRecord, PodState, StateDirs};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncBufReadExt;
use vessel_agent::proto as ap;
use vessel_cri_api::v1 as cri;

/// How long an agent may take to say READY.
const READY_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug, thiserror::Error)]
pub enum FlatError {
    #[error("starting the pod agent {binary}: {source}")]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the pod agent failed to start: {0}")]
    Agent(String),
    #[error("the pod agent did not report ready within {0:?}")]
    Timeout(Duration),
    #[error(transparent)]
    Io(#[from] crate::errors::IoAt),
}

/// The flat backend and what it needs from the node.
pub struct FlatBackend {
    pub agent_binary: PathBuf,
    pub log_level: String,
    pub dirs: StateDirs,
    pub cni: Cni,
}

#[tonic::async_trait]
impl SandboxBackend for FlatBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Flat
    }

    fn layout(&self, id: &str, _config: &cri::PodSandboxConfig, share: HostShare) -> PodLayout {
        PodLayout {
            state: BackendState::Flat {},
            agent_socket: self.dirs.agent_socket(id),
            netns_path: if share.net {
                PathBuf::new()
            } else {
                self.dirs.netns_dir().join(id)
            },
        }
    }

    fn agent_addr(&self, rec: &PodRecord) -> AgentAddr {
        AgentAddr::Unix(rec.agent_socket.clone())
    }

    async fn start(&self, pod: &Pod, config: &cri::PodSandboxConfig) -> Result<()> {
        let rec = pod.record();
        let share = HostShare::of(config);
        let dir = self.dirs.pod_dir(&rec.id);
        let io = |what: &str, e: std::io::Error| internal(format!("pod {}: {what}", rec.id))(e);
        std::fs::write(dir.join("hostname"), format!("{}\n", rec.hostname))
            .map_err(|e| io("writing hostname", e))?;
        std::fs::write(
            dir.join("hosts"),
            super::hosts_file(&rec.hostname, share.net),
        )
        .map_err(|e| io("writing hosts", e))?;
        std::fs::write(
            dir.join("resolv.conf"),
            super::resolv_conf(config.dns_config.as_ref())?,
        )
        .map_err(|e| io("writing resolv.conf", e))?;
        std::fs::create_dir_all(self.dirs.pod_run_dir(&rec.id))
            .map_err(|e| io("creating run dir", e))?;
        super::create_log_directory(&rec, config)?;
        let launched = launch(&LaunchSpec {
            agent_binary: &self.agent_binary,
            socket: &rec.agent_socket,
            state_dir: &rec.agent_state_dir,
            hostname: &rec.hostname,
            share,
            log_file: &dir.join("agent.log"),
            log_level: &self.log_level,
            userns: crate::userns::of_pod(config).map_err(RuntimeError::InvalidArgument)?,
            userns_root: &self.dirs.userns_root(),
        })
        .await
        .map_err(internal(format!("pod {}", rec.id)))?;
        // Not saved yet: until the Ready record is written, a crash is cleaned up through the
        // Creating record (the agent is found by its socket path).
        let rec = pod.update(|r| {
            r.agent_pid = launched.pid;
            r.agent_start_time = launched.start_time;
        });
        let sysctls = super::net_sysctls(config);
        if !share.net {
            netns::pin(launched.pid, &rec.netns_path)
                .map_err(internal(format!("pod {}", rec.id)))?;
            netns::apply_net_sysctls(&rec.netns_path, &sysctls)
                .await
                .map_err(|e| {
                    RuntimeError::InvalidArgument(format!("pod {}: sysctls: {e}", rec.id))
                })?;
            network::attach(&self.cni, pod, config).await?;
        } else if sysctls.keys().any(|k| k.starts_with("net.")) {
            return Err(RuntimeError::InvalidArgument(format!(
                "pod {}: net.* sysctls need the pod's own network namespace, not the host's",
                rec.id
            )));
        }
        pod.update(|r| r.state = PodState::Ready);
        let mut c = pod.client().await?;
        c.ping(ap::PingRequest {})
            .await
            .map_err(|s| agent_err(&format!("pod {}", rec.id), s))?;
        Ok(())
    }

    fn host_process(&self) -> &'static str {
        "the pod agent"
    }

    async fn after_shutdown(&self, _rec: &PodRecord) {}

    async fn teardown(&self, rec: &PodRecord) -> Result<()> {
        process::kill_pod_process(
            rec.agent_pid,
            rec.agent_start_time,
            "--socket",
            &rec.agent_socket,
        )
        .await;
        // The pod's cgroups go in `cgroup::Driver::release`, next.
        network::release(&self.cni, rec).await
    }

    /// The containers live in kubelet's pod cgroup, which kubelet resized before it called.
    fn resize(&self, _rec: &PodRecord, _config: &cri::PodSandboxConfig) -> Result<()> {
        Ok(())
    }

    fn admit_container(&self, _prec: &PodRecord, _config: &cri::ContainerConfig) -> Result<()> {
        Ok(())
    }

    fn pod_files_dir(&self, prec: &PodRecord) -> PathBuf {
        self.dirs.pod_dir(&prec.id)
    }

    fn cgroup_ns(&self) -> bool {
        crate::spec::host_is_cgroup_v2()
    }

    async fn prepare_container(
        &self,
        _pod: &Pod,
        req: ContainerRequest<'_>,
    ) -> Result<PreparedContainer> {
        let snap = req.snapshot;
        Ok(PreparedContainer {
            rootfs: ap::Rootfs {
                kind: Some(ap::rootfs::Kind::Overlay(ap::OverlayRootfs {
                    lowerdirs: snap
                        .layer_dirs
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect(),
                    upperdir: snap.upper().display().to_string(),
                    workdir: snap.work().display().to_string(),
                })),
            },
            log_path: req.log_path.to_string(),
            log_vsock_port: 0,
            log_vsock_token: String::new(),
        })
    }

    async fn release_container(&self, pod: &Pod, rec: &ContainerRecord) {
        // The agent removes the cgroup of containers it deletes; one whose agent died is ours.
        let parent = pod.record().cgroup_parent;
        cgroup::remove_dead_cgroup(&format!("{}/{}", parent.trim_end_matches('/'), rec.id)).await;
    }

    async fn reopen_log(&self, pod: &Pod, rec: &ContainerRecord) -> Result<()> {
        let mut c = pod.client().await?;
        c.reopen_log(ap::ReopenLogRequest { id: rec.id.clone() })
            .await
            .map_err(|s| agent_err(&format!("ReopenContainerLog {}", rec.id), s))?;
        Ok(())
    }

    async fn checkpoint(&self, pod: &Pod, rec: &ContainerRecord, dump: &Dump) -> Result<Vec<u8>> {
        let mut c = pod.client().await?;
        // Answered once the agent's CRIU has ended, however long that takes: the caller's
        // deadline is answered above this, without cutting the dump short.
        let r = c
            .checkpoint_container(ap::CheckpointContainerRequest {
                id: rec.id.clone(),
                image_dir: dump.image_dir.display().to_string(),
                work_dir: String::new(),
                timeout_secs: 0,
                upper_dir: dump
                    .upper
                    .as_ref()
                    .map(|u| u.display().to_string())
                    .unwrap_or_default(),
                diff_dir: dump.diff_dir.display().to_string(),
            })
            .await
            .map_err(|s| agent_err(&format!("CheckpointContainer {}", rec.id), s))?;
        Ok(r.into_inner().oci_spec)
    }

    fn forward_target(&self, rec: &PodRecord) -> Result<ForwardTarget> {
        Ok(ForwardTarget::Netns(rec.netns_path.clone()))
    }

    /// From the pod's network namespace: none for a host-network pod, whose counters are
    /// the node's, or once the agent is gone.
    fn network_usage(&self, rec: &PodRecord) -> Option<cri::NetworkUsage> {
        if !process::is_alive(rec.agent_pid, rec.agent_start_time) {
            return None;
        }
        netns::network_usage(&rec.netns_path, &[])
    }

    fn info(&self, _rec: &PodRecord) -> serde_json::Value {
        serde_json::Value::Null
    }

    async fn sweep_orphans(&self, _recorded: &[PodRecord], _kept: &HashSet<String>) {}
}

struct LaunchSpec<'a> {
    agent_binary: &'a Path,
    socket: &'a Path,
    state_dir: &'a Path,
    hostname: &'a str,
    share: HostShare,
    log_file: &'a Path,
    log_level: &'a str,
    userns: Option<crate::userns::PodUserns>,
    userns_root: &'a Path,
}

struct Launched {
    pid: u32,
    start_time: u64,
}

async fn launch(spec: &LaunchSpec<'_>) -> Result<Launched, FlatError> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(spec.log_file)
        .map_err(crate::errors::io_at::<FlatError>("open", spec.log_file))?;
    let mut cmd = tokio::process::Command::new(spec.agent_binary);
    cmd.arg("flat")
        .arg("--socket")
        .arg(spec.socket)
        .arg("--state-dir")
        .arg(spec.state_dir)
        .arg("--hostname")
        .arg(spec.hostname)
        .arg("--log-level")
        .arg(spec.log_level)
        .arg("--log-file")
        .arg(spec.log_file);
    let mut shared = Vec::new();
    if spec.share.net {
        shared.push("net");
    }
    if spec.share.pid {
        shared.push("pid");
    }
    if spec.share.ipc {
        shared.push("ipc");
    }
    if let Some(u) = &spec.userns {
        let [uid, gid] = u.flags();
        cmd.arg("--uid-map").arg(uid).arg("--gid-map").arg(gid);
        cmd.arg("--userns-root").arg(spec.userns_root);
    }
    if !shared.is_empty() {
        cmd.arg("--share-host").arg(shared.join(","));
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .env_remove("RUST_LOG")
        // Only vesseld talks to its service manager.
        .env_remove("NOTIFY_SOCKET")
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|source| FlatError::Spawn {
        binary: spec.agent_binary.to_path_buf(),
        source,
    })?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| FlatError::Agent("no stdout pipe".into()))?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(READY_TIMEOUT, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(pid) = line.strip_prefix("READY ") {
                return pid.trim().parse::<u32>().ok();
            }
        }
        None
    })
    .await;
    let pid = match ready {
        Ok(Some(pid)) => pid,
        Ok(None) => {
            let status = child.wait().await.ok();
            return Err(FlatError::Agent(format!(
                "launcher exited ({}) without READY; see {}: {}",
                status.map(|s| s.to_string()).unwrap_or_default(),
                spec.log_file.display(),
                process::log_tail(spec.log_file, 5)
            )));
        }
        Err(_) => {
            let _ = child.kill().await;
            process::kill_by_arg("--socket", spec.socket);
            return Err(FlatError::Timeout(READY_TIMEOUT));
        }
    };
    // The launcher exits once the agent serves; reap it.
    let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
    let start_time = process::process_start_time(pid).ok_or_else(|| {
        FlatError::Agent(format!(
            "agent pid {pid} vanished right after READY: {}",
            process::log_tail(spec.log_file, 5)
        ))
    })?;
    Ok(Launched { pid, start_time })
}
