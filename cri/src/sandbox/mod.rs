//! Sandbox backends: how a pod's sandbox is made, reached and taken down.
//!
//! vesseld has one pod and container state machine (`crate::runtime`) and two ways to give a
//! pod its sandbox, both behind the [`SandboxBackend`] trait:
//!
//! - [`flat::FlatBackend`]: the pod agent runs on the host as PID 1 of the pod's own
//!   namespaces; its network namespace is pinned under `<run>/netns/` and attached to CNI;
//!   container roots are overlayfs mounts of the unpacked layers.
//! - [`vm::VmBackend`]: one `vessel-shim` process per pod runs a microVM whose PID 1 is the
//!   same agent, reached over hybrid vsock; layers reach the guest as EROFS disks in the VM's
//!   spare slots and container logs come back over a vsock port to the shim.
//!
//! A newcomer adding something that differs per backend (VM networking, VM volumes) adds a
//! method here and implements it in both modules; `crate::runtime` then calls it without
//! knowing which backend a pod has. What both backends share lives beside them: the pod's
//! host process ([`process`]), network namespaces ([`netns`]), cgroups ([`cgroup`]) and the
//! CNI attachment ([`network`]). The pod record holds one [`BackendState`], and
//! [`choose`] decides the backend of a new pod from its runtime handler, the node's KVM
//! support and the policy for pods a VM cannot honour.

pub mod cgroup;
pub mod dbus;
pub mod flat;
pub mod netns;
pub mod network;
pub mod process;
pub mod systemd;
pub mod vm;

use crate::errors::{internal, Result, RuntimeError};
use crate::state::{BackendKind, BackendState, ContainerRecord, PodRecord, PodState};
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::RwLock;
use std::time::Duration;
use tonic::transport::Channel;
use vessel_agent::proto::{self as ap, agent_client::AgentClient};
use vessel_cri_api::v1 as cri;

/// The pod agent's API port in a VM guest (hybrid vsock); the agent serves it, the shim
/// forwards to it, vesseld dials it.
pub const AGENT_PORT: u32 = vessel_agent::vsock::AGENT_PORT;
/// The host port a VM guest's agent sends container logs to (served by the shim).
pub const LOG_PORT: u32 = vessel_agent::vsock::LOG_PORT;

/// Namespaces a pod shares with the node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostShare {
    pub net: bool,
    pub pid: bool,
    pub ipc: bool,
}

impl HostShare {
    /// What a pod config asks to share with the node.
    pub fn of(config: &cri::PodSandboxConfig) -> HostShare {
        let ns = crate::spec::pod_namespace_options(config)
            .cloned()
            .unwrap_or_default();
        let node = cri::NamespaceMode::Node as i32;
        HostShare {
            net: ns.network == node,
            pid: ns.pid == node,
            ipc: ns.ipc == node,
        }
    }
}

/// Where a pod's agent serves its API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentAddr {
    /// A Unix socket on the host (flat pods).
    Unix(PathBuf),
    /// A guest vsock port behind the shim's hybrid vsock socket (VM pods): connect to the
    /// Unix socket, send `CONNECT <port>`, then speak to the guest.
    HybridVsock { uds: PathBuf, port: u32 },
}

impl AgentAddr {
    pub async fn connect(
        &self,
        timeout: Duration,
    ) -> Result<AgentClient<Channel>, vessel_agent::client::ClientError> {
        match self {
            AgentAddr::Unix(p) => vessel_agent::client::connect_unix(p).await,
            AgentAddr::HybridVsock { uds, port } => {
                vessel_agent::client::connect_hybrid_vsock(uds, *port, timeout).await
            }
        }
    }
}

/// What a new pod's record gets from its backend.
pub struct PodLayout {
    pub state: BackendState,
    pub agent_socket: PathBuf,
    /// The pinned netns (empty: none on the host, e.g. host network).
    pub netns_path: PathBuf,
}

/// Where port-forward connects for a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForwardTarget {
    /// 127.0.0.1 inside this network namespace on the host (empty: the host's own).
    Netns(PathBuf),
    /// The guest agent's forward port through a VM's hybrid vsock socket
    /// (`vessel_agent::forward`): localhost inside the guest.
    Vsock { uds: PathBuf, port: u32 },
}

/// What the backend needs to give a new container its root, log and files.
pub struct ContainerRequest<'a> {
    pub id: &'a str,
    /// The container's name key, for messages.
    pub key: &'a str,
    pub config: &'a cri::ContainerConfig,
    /// The OCI spec the agent gets; a backend may point mounts elsewhere.
    pub spec: &'a mut serde_json::Value,
    /// The image's layers, bottom first (diff IDs).
    pub layers: &'a [String],
    /// Layers other containers of the pod use.
    pub layers_in_use: HashSet<String>,
    pub snapshot: &'a vessel_images::snapshot::Snapshot,
    /// The resolved host log path (empty: no log).
    pub log_path: &'a str,
}

/// A container's root and log, as the agent's CreateContainer takes them.
pub struct PreparedContainer {
    pub rootfs: ap::Rootfs,
    /// Where the agent writes the log itself (flat), or empty when it sends it over vsock.
    pub log_path: String,
    pub log_vsock_port: u32,
    /// The secret the agent presents on that port (VM pods; empty otherwise).
    pub log_vsock_token: String,
}

/// A pod in memory: its record, the lock that orders its operations, and its agent
/// connection.
pub struct Pod {
    rec: RwLock<PodRecord>,
    /// Serialises pod operations (run, stop, remove, container create).
    pub op: tokio::sync::Mutex<()>,
    addr: AgentAddr,
    client: tokio::sync::Mutex<Option<AgentClient<Channel>>>,
    /// The highest cgroup counters (CPU ns, page faults, major page faults) PodSandboxStats
    /// gave for the pod: counters it answers never go back, whatever one reading says.
    pub counters: std::sync::Mutex<Option<[u64; 3]>>,
}

impl Pod {
    pub fn new(rec: PodRecord, addr: AgentAddr) -> Pod {
        Pod {
            rec: RwLock::new(rec),
            op: tokio::sync::Mutex::new(()),
            addr,
            client: tokio::sync::Mutex::new(None),
            counters: std::sync::Mutex::new(None),
        }
    }

    pub fn record(&self) -> PodRecord {
        self.rec.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Changes the in-memory record and returns the new one (the caller saves it).
    pub fn update(&self, f: impl FnOnce(&mut PodRecord)) -> PodRecord {
        let mut g = self.rec.write().unwrap_or_else(|p| p.into_inner());
        f(&mut g);
        g.clone()
    }

    /// The agent of a ready pod, connecting on first use.
    pub async fn client(&self) -> Result<AgentClient<Channel>> {
        let mut g = self.client.lock().await;
        if let Some(c) = g.as_ref() {
            return Ok(c.clone());
        }
        let rec = self.record();
        if rec.state != PodState::Ready {
            return Err(RuntimeError::FailedPrecondition(format!(
                "pod sandbox {} is not ready{}",
                rec.id,
                if rec.reason.is_empty() {
                    String::new()
                } else {
                    format!(": {}", rec.reason)
                }
            )));
        }
        let c = self
            .addr
            .connect(Duration::from_secs(5))
            .await
            .map_err(|e| RuntimeError::Unavailable(format!("pod sandbox {}: {e}", rec.id)))?;
        *g = Some(c.clone());
        Ok(c)
    }

    /// Keeps `c` as the pod's agent connection (`None`: forget it).
    pub async fn set_client(&self, c: Option<AgentClient<Channel>>) {
        *self.client.lock().await = c;
    }
}

/// What a CheckpointContainer dump is to make.
pub struct Dump {
    /// The host directory for CRIU's images (made if missing).
    pub image_dir: PathBuf,
    /// The container's overlay upper directory, whose changes go into `diff_dir` while
    /// CRIU holds the dumped tasks ([`vessel_agent::rootfs_diff`]); none for no diff.
    pub upper: Option<PathBuf>,
    /// Where `rootfs-diff.tar` and `deleted.files` go.
    pub diff_dir: PathBuf,
}

/// Everything that differs between the flat and the VM sandbox. Methods that take a pod are
/// called with its op lock held by the caller unless they say otherwise.
#[tonic::async_trait]
pub trait SandboxBackend: Send + Sync {
    fn kind(&self) -> BackendKind;

    /// The backend's part of a new pod's record (nothing is created yet).
    fn layout(&self, id: &str, config: &cri::PodSandboxConfig, share: HostShare) -> PodLayout;

    /// Where the agent of a pod with this record serves.
    fn agent_addr(&self, rec: &PodRecord) -> AgentAddr;

    /// Makes the sandbox: the host process, the pod's network and files, and the agent
    /// serving. The record is saved (in state `Creating`) before; on error the caller runs
    /// [`SandboxBackend::teardown`]. Returns with the pod's record updated (host pid, IPs)
    /// and an agent connection.
    async fn start(&self, pod: &Pod, config: &cri::PodSandboxConfig) -> Result<()>;

    /// What the host process is, for messages ("the pod agent", "the VM shim").
    fn host_process(&self) -> &'static str;

    /// After the agent's Shutdown at StopPodSandbox: lets the host process finish.
    async fn after_shutdown(&self, rec: &PodRecord);

    /// Removes everything the sandbox has on the host: process, network, netns pin,
    /// cgroup, files. Idempotent; safe on a half-made pod. The error is a CNI DEL that
    /// failed: all else is gone, and the network's cache entry stays to be asked again.
    async fn teardown(&self, rec: &PodRecord) -> Result<()>;

    /// Whether a ready pod can take new pod-level resources (`config`: its config with them):
    /// FailedPrecondition, naming what it cannot follow, where not.
    fn resize(&self, rec: &PodRecord, config: &cri::PodSandboxConfig) -> Result<()>;

    /// Refuses a container request the backend cannot honour.
    fn admit_container(&self, prec: &PodRecord, config: &cri::ContainerConfig) -> Result<()>;

    /// Where the pod's own files (hostname, hosts, resolv.conf) are as the agent sees them.
    fn pod_files_dir(&self, prec: &PodRecord) -> PathBuf;

    /// Whether containers get their own cgroup namespace.
    fn cgroup_ns(&self) -> bool;

    /// Gives a container its root filesystem and log before the agent creates it. On error
    /// (and when creation fails later) the caller runs [`SandboxBackend::release_container`].
    async fn prepare_container(
        &self,
        pod: &Pod,
        req: ContainerRequest<'_>,
    ) -> Result<PreparedContainer>;

    /// Best effort: forgets what the backend holds for a container that is being removed
    /// (its cgroup, its log fd, files in the guest).
    async fn release_container(&self, pod: &Pod, rec: &ContainerRecord);

    /// ReopenContainerLog for a running container.
    async fn reopen_log(&self, pod: &Pod, rec: &ContainerRecord) -> Result<()>;

    /// CheckpointContainer: dumps a running container's processes with CRIU, leaving it
    /// running; answers its OCI spec.
    async fn checkpoint(&self, pod: &Pod, rec: &ContainerRecord, dump: &Dump) -> Result<Vec<u8>>;

    /// Where PortForward connects, or why it cannot.
    fn forward_target(&self, rec: &PodRecord) -> Result<ForwardTarget>;

    /// The pod's network counters, where the host can see them (its own network namespace).
    fn network_usage(&self, rec: &PodRecord) -> Option<cri::NetworkUsage>;

    /// The backend's part of verbose PodSandboxStatus.
    fn info(&self, rec: &PodRecord) -> serde_json::Value;

    /// At start, after recovery: removes what the backend left on the host for pods that
    /// have no record. `recorded`: every pod record read; `kept`: ids whose records are
    /// quarantined (their pods may still run).
    async fn sweep_orphans(&self, recorded: &[PodRecord], kept: &HashSet<String>);
}

/// Whether `name` (an id, or a 32-character id prefix as VM dirs use) belongs to one of the
/// `kept` ids: records that could not be read, and what hangs off them.
pub fn held(kept: &HashSet<String>, name: &str) -> bool {
    !name.is_empty()
        && kept
            .iter()
            .any(|id| id.starts_with(name) || name.starts_with(id.as_str()))
}

/// What the KVM probe found at start, for backend choice and Status.
#[derive(Debug, Clone)]
pub struct VmSupport {
    /// KVM can run microVMs at near-native speed, and the guest kernel, initrd and shim
    /// are there.
    pub ready: bool,
    /// The KVM probe's verdict alone.
    pub kvm_usable: bool,
    /// A CamelCase reason for the Status condition (`VMBackendReady`, `KVMUnusable`,
    /// `GuestKernelMissing`, ...).
    pub reason_code: String,
    /// The probe's verdict and evidence, in a sentence.
    pub reason: String,
    /// Fall back to flat (true) or refuse (false) when a `vm` pod cannot get a VM.
    pub fallback: bool,
}

/// The node's policy for choosing a pod's backend.
pub struct Admission<'a> {
    /// "vm" or "flat": the backend of pods with no runtime handler.
    pub default_handler: &'a str,
    pub vm: &'a VmSupport,
    pub host_namespaces: crate::config::HostNamespacesPolicy,
}

impl Admission<'_> {
    /// Whether pods of runtime `handler` ask for a VM; `None` for an unknown handler.
    fn wants_vm(&self, handler: &str) -> Option<bool> {
        match handler {
            "flat" => Some(false),
            "vm" => Some(true),
            "" => Some(self.default_handler == "vm"),
            _ => None,
        }
    }

    /// The backend pods of runtime `handler` get when they ask for no host namespace or
    /// privilege (those run flat); `None` for an unknown handler, or one this node refuses
    /// (`vm` without a usable VM and without fallback). What [`choose`] decides, for `Status`.
    pub fn handler_backend(&self, handler: &str) -> Option<BackendKind> {
        match self.wants_vm(handler)? {
            true if self.vm.ready => Some(BackendKind::Vm),
            true if handler == "vm" && !self.vm.fallback => None,
            _ => Some(BackendKind::Flat),
        }
    }
}

/// The backends pods can get on this node.
pub fn available(vm: &VmSupport) -> Vec<&'static str> {
    let mut b = vec![BackendKind::Flat.as_str()];
    if vm.ready {
        b.push(BackendKind::Vm.as_str());
    }
    b
}

/// The runtime handlers a pod may name: the default (empty), `flat` and `vm`.
pub const HANDLERS: &[&str] = &["", "flat", "vm"];

/// The backend a pod runs on: its handler, the node's VM support and the policy for pods a
/// VM cannot honour (host namespaces, privileges).
pub fn choose(
    config: &cri::PodSandboxConfig,
    handler: &str,
    policy: &Admission<'_>,
) -> Result<BackendKind> {
    let meta = config.metadata.clone().unwrap_or_default();
    let Some(wants_vm) = policy.wants_vm(handler) else {
        return Err(RuntimeError::InvalidArgument(format!(
            "unknown runtime handler {handler:?} (known: flat, vm)"
        )));
    };
    if !wants_vm {
        return Ok(BackendKind::Flat);
    }
    let share = HostShare::of(config);
    let mut host = Vec::new();
    if share.net {
        host.push("network namespace");
    }
    if share.pid {
        host.push("pid namespace");
    }
    if share.ipc {
        host.push("ipc namespace");
    }
    let privileged = config
        .linux
        .as_ref()
        .and_then(|l| l.security_context.as_ref())
        .is_some_and(|s| s.privileged);
    if privileged {
        host.push("privileges");
    }
    if !host.is_empty() {
        let what = format!("the host's {}", host.join(", "));
        if policy.host_namespaces == crate::config::HostNamespacesPolicy::Refuse && handler == "vm"
        {
            return Err(RuntimeError::FailedPrecondition(format!(
                "pod {:?}: asks for {what}, which a VM cannot give, and vm.host_namespaces is \"refuse\"",
                meta.name
            )));
        }
        tracing::info!(pod = %meta.name, namespace = %meta.namespace, asks = %what, "pod runs flat by policy: a VM cannot give it the host's namespaces or privileges");
        return Ok(BackendKind::Flat);
    }
    if policy.vm.ready {
        return Ok(BackendKind::Vm);
    }
    let why = &policy.vm.reason;
    if handler == "vm" && !policy.vm.fallback {
        return Err(RuntimeError::FailedPrecondition(format!(
            "runtime handler vm: no microVM can run on this node ({why}) and runtime.vm_fallback is \"refuse\""
        )));
    }
    if handler == "vm" {
        tracing::warn!(pod = %meta.name, namespace = %meta.namespace, reason = %why, "runtime handler vm: running the pod flat");
    } else {
        tracing::debug!(pod = %meta.name, reason = %why, "default handler: running the pod flat");
    }
    Ok(BackendKind::Flat)
}

/// The pod's /etc/hosts: the node's for a host-network pod, a fresh one naming the pod's
/// hostname otherwise.
pub fn hosts_file(hostname: &str, host_net: bool) -> String {
    if host_net {
        if let Ok(h) = std::fs::read_to_string("/etc/hosts") {
            return h;
        }
    }
    format!(
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nfe00::0\tip6-localnet\nff00::0\tip6-mcastprefix\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n127.0.1.1\t{hostname}\n"
    )
}

/// The pod's resolv.conf: from the CRI DNS config, or the node's when it has none.
pub fn resolv_conf(dns: Option<&cri::DnsConfig>) -> Result<String> {
    let host = || std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    let Some(d) =
        dns.filter(|d| !d.servers.is_empty() || !d.searches.is_empty() || !d.options.is_empty())
    else {
        return Ok(host());
    };
    let mut s = String::new();
    for srv in &d.servers {
        if srv.parse::<std::net::IpAddr>().is_err() {
            return Err(RuntimeError::InvalidArgument(format!(
                "DNS server {srv:?} is not an IP address"
            )));
        }
        s.push_str(&format!("nameserver {srv}\n"));
    }
    if !d.searches.is_empty() {
        s.push_str(&format!("search {}\n", d.searches.join(" ")));
    }
    if !d.options.is_empty() {
        s.push_str(&format!("options {}\n", d.options.join(" ")));
    }
    Ok(s)
}

/// Creates kubelet's log directory for a pod, if it names one.
pub fn create_log_directory(rec: &PodRecord, config: &cri::PodSandboxConfig) -> Result<()> {
    if config.log_directory.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(&config.log_directory).map_err(|e| {
        RuntimeError::Internal(format!(
            "pod {}: creating log directory {}: {e}",
            rec.id, config.log_directory
        ))
    })
}

/// The pod's net sysctls apply in its own network namespace only.
pub fn net_sysctls(config: &cri::PodSandboxConfig) -> std::collections::HashMap<String, String> {
    config
        .linux
        .as_ref()
        .map(|l| l.sysctls.clone())
        .unwrap_or_default()
}

/// Saves a pod's record, as an internal error when it cannot be written.
pub fn save(dirs: &crate::state::StateDirs, rec: &PodRecord) -> Result<()> {
    dirs.save_pod(rec).map_err(internal("saving pod record"))
}
