//! Pods and containers: the logic behind the CRI RuntimeService.
//!
//! Each pod has a record (`state::PodRecord`) and a pod agent; each container a record and a
//! snapshot. Reads use the in-memory copy of a record; changes of one object are serialised
//! by its `op` lock and persisted before they are acknowledged. Exits are observed by a
//! watcher task per started container (`WaitContainer` on the agent), so listing never asks
//! the agent.

use crate::flat::{self, HostShare};
use crate::spec::{self, SpecInput};
use crate::state::{
    self, ContainerRecord, ContainerState, PodRecord, PodState, StateDirs, VmPodState,
};
use crate::vm;
use k8s_cri::v1 as cri;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tonic::transport::Channel;
use vessel_agent::proto::{self as ap, agent_client::AgentClient};
use vessel_images::ImageStore;

/// Errors of runtime operations; each maps to one gRPC code.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
}

impl RuntimeError {
    pub fn to_status(&self) -> tonic::Status {
        let m = crate::errors::bounded(self.to_string());
        match self {
            RuntimeError::InvalidArgument(_) => tonic::Status::invalid_argument(m),
            RuntimeError::NotFound(_) => tonic::Status::not_found(m),
            RuntimeError::AlreadyExists(_) => tonic::Status::already_exists(m),
            RuntimeError::FailedPrecondition(_) => tonic::Status::failed_precondition(m),
            RuntimeError::DeadlineExceeded(_) => tonic::Status::deadline_exceeded(m),
            RuntimeError::Unavailable(_) => tonic::Status::unavailable(m),
            RuntimeError::Internal(_) => tonic::Status::internal(m),
        }
    }
}

type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// The runtime handlers a pod may name: the default (empty), `flat` and `vm`.
pub const HANDLERS: &[&str] = &["", "flat", "vm"];

fn internal(ctx: &str) -> impl FnOnce(&dyn std::fmt::Display) -> RuntimeError + '_ {
    move |e| RuntimeError::Internal(format!("{ctx}: {e}"))
}

/// An agent answer that failed, as a runtime error with the agent's code.
/// A CNI failure as a runtime error.
fn cni_err(e: crate::cni::CniError) -> RuntimeError {
    use crate::cni::CniError as E;
    match e {
        E::NoConfig(_) | E::BadConfig { .. } | E::PluginNotFound { .. } => {
            RuntimeError::FailedPrecondition(e.to_string())
        }
        E::Timeout { .. } => RuntimeError::DeadlineExceeded(e.to_string()),
        E::Plugin { .. } | E::Cache { .. } => RuntimeError::Internal(e.to_string()),
    }
}

fn agent_err(ctx: &str, s: tonic::Status) -> RuntimeError {
    let m = format!("{ctx}: pod agent: {}", s.message());
    match s.code() {
        tonic::Code::InvalidArgument => RuntimeError::InvalidArgument(m),
        tonic::Code::NotFound => RuntimeError::NotFound(m),
        tonic::Code::AlreadyExists => RuntimeError::AlreadyExists(m),
        tonic::Code::FailedPrecondition => RuntimeError::FailedPrecondition(m),
        tonic::Code::DeadlineExceeded => RuntimeError::DeadlineExceeded(m),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
            RuntimeError::Unavailable(m)
        }
        _ => RuntimeError::Internal(m),
    }
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

pub struct RuntimeOptions {
    pub vm: VmSupport,
    pub vm_cfg: crate::config::VmConfig,
    /// What the guest boots from (initrd or EROFS root disk).
    pub guest_root: crate::config::GuestRoot,
    pub shim_binary: PathBuf,
    /// "vm" or "flat": the backend of pods with no runtime handler.
    pub default_handler: String,
    pub agent_binary: PathBuf,
    pub log_level: String,
    pub root_dir: PathBuf,
    pub state_dir: PathBuf,
    /// The node's CNI plugins, for flat pods with their own network namespace.
    pub cni: crate::cni::Cni,
}

pub struct Pod {
    rec: RwLock<PodRecord>,
    op: tokio::sync::Mutex<()>,
    client: tokio::sync::Mutex<Option<AgentClient<Channel>>>,
}

impl Pod {
    pub fn record(&self) -> PodRecord {
        self.rec.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn update(&self, f: impl FnOnce(&mut PodRecord)) -> PodRecord {
        let mut g = self.rec.write().unwrap_or_else(|p| p.into_inner());
        f(&mut g);
        g.clone()
    }
}

pub struct Ctr {
    rec: RwLock<ContainerRecord>,
    op: tokio::sync::Mutex<()>,
}

impl Ctr {
    pub fn record(&self) -> ContainerRecord {
        self.rec.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn update(&self, f: impl FnOnce(&mut ContainerRecord)) -> ContainerRecord {
        let mut g = self.rec.write().unwrap_or_else(|p| p.into_inner());
        f(&mut g);
        g.clone()
    }
}

pub struct Runtime {
    opts: RuntimeOptions,
    dirs: StateDirs,
    store: Arc<ImageStore>,
    pods: Mutex<HashMap<String, Arc<Pod>>>,
    ctrs: Mutex<HashMap<String, Arc<Ctr>>>,
    /// Reserved names (pod and container name keys) -> id.
    names: Mutex<HashMap<String, String>>,
    /// The pod CIDR kubelet announced with UpdateRuntimeConfig.
    pod_cidr: Mutex<String>,
    /// Records found unreadable (and moved aside) at start, for Status.
    quarantined: Mutex<Vec<PathBuf>>,
}

/// Whether `name` (an id, or a 32-character id prefix as VM dirs use) belongs to one of the
/// `kept` ids: records that could not be read, and what hangs off them.
fn held(kept: &std::collections::HashSet<String>, name: &str) -> bool {
    !name.is_empty()
        && kept
            .iter()
            .any(|id| id.starts_with(name) || name.starts_with(id.as_str()))
}

fn pod_name_key(m: &cri::PodSandboxMetadata) -> String {
    format!("{}_{}_{}_{}", m.name, m.namespace, m.uid, m.attempt)
}

fn valid_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'.')
}

fn exit_reason(exit: &ap::ExitInfo) -> (i32, String) {
    let code = if exit.signal != 0 {
        128 + exit.signal as i32
    } else {
        exit.exit_code
    };
    let reason = if exit.oom_killed {
        "OOMKilled"
    } else if code == 0 {
        "Completed"
    } else {
        "Error"
    };
    (code, reason.to_string())
}

/// An object by full id or by a unique id prefix, as crictl users type them.
fn lookup<T>(map: &HashMap<String, Arc<T>>, id: &str, what: &str) -> Result<Arc<T>> {
    if let Some(v) = map.get(id) {
        return Ok(v.clone());
    }
    let mut hits = map
        .iter()
        .filter(|(k, _)| !id.is_empty() && k.starts_with(id));
    match (hits.next(), hits.next()) {
        (Some((_, v)), None) => Ok(v.clone()),
        (None, _) => Err(RuntimeError::NotFound(format!("{what} {id:?} not found"))),
        (Some(_), Some(_)) => Err(RuntimeError::InvalidArgument(format!(
            "{what} id prefix {id:?} is ambiguous"
        ))),
    }
}

fn matches_labels(labels: &HashMap<String, String>, selector: &HashMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

impl Runtime {
    pub async fn open(opts: RuntimeOptions, store: Arc<ImageStore>) -> Result<Arc<Runtime>> {
        let dirs =
            StateDirs::new(&opts.root_dir, &opts.state_dir).map_err(|e| internal("state")(&e))?;
        let rt = Arc::new(Runtime {
            opts,
            dirs,
            store,
            pods: Mutex::default(),
            ctrs: Mutex::default(),
            names: Mutex::default(),
            pod_cidr: Mutex::default(),
            quarantined: Mutex::default(),
        });
        rt.recover().await;
        Ok(rt)
    }

    /// Records that could not be read at start and were moved aside, for Status.
    pub fn quarantined_records(&self) -> Vec<PathBuf> {
        self.quarantined
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn agent_binary(&self) -> &Path {
        &self.opts.agent_binary
    }

    pub fn cni(&self) -> &crate::cni::Cni {
        &self.opts.cni
    }

    pub fn vm_support(&self) -> &VmSupport {
        &self.opts.vm
    }

    // ---------- lookups ----------

    fn pod(&self, id: &str) -> Result<Arc<Pod>> {
        lookup(
            &self.pods.lock().unwrap_or_else(|p| p.into_inner()),
            id,
            "pod sandbox",
        )
    }

    fn ctr(&self, id: &str) -> Result<Arc<Ctr>> {
        lookup(
            &self.ctrs.lock().unwrap_or_else(|p| p.into_inner()),
            id,
            "container",
        )
    }

    fn ctrs_of(&self, pod_id: &str) -> Vec<Arc<Ctr>> {
        self.ctrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|c| c.record().pod_id == pod_id)
            .cloned()
            .collect()
    }

    fn reserve(&self, key: &str, id: &str, what: &str) -> Result<()> {
        let mut n = self.names.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(other) = n.get(key) {
            return Err(RuntimeError::AlreadyExists(format!(
                "{what} name {key:?} is reserved for {other}; remove it first"
            )));
        }
        n.insert(key.to_string(), id.to_string());
        Ok(())
    }

    fn release(&self, key: &str, id: &str) {
        let mut n = self.names.lock().unwrap_or_else(|p| p.into_inner());
        if n.get(key).map(|v| v == id).unwrap_or(false) {
            n.remove(key);
        }
    }

    async fn client(&self, pod: &Pod) -> Result<AgentClient<Channel>> {
        let mut g = pod.client.lock().await;
        if let Some(c) = g.as_ref() {
            return Ok(c.clone());
        }
        let rec = pod.record();
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
        let c = if rec.vm.is_some() {
            vessel_agent::client::connect_hybrid_vsock(
                &rec.agent_socket,
                vm::AGENT_PORT,
                Duration::from_secs(5),
            )
            .await
            .map_err(|e| RuntimeError::Unavailable(format!("pod sandbox {}: {e}", rec.id)))?
        } else {
            vessel_agent::client::connect_unix(&rec.agent_socket)
                .await
                .map_err(|e| RuntimeError::Unavailable(format!("pod sandbox {}: {e}", rec.id)))?
        };
        *g = Some(c.clone());
        Ok(c)
    }

    // ---------- pods ----------

    pub async fn run_pod_sandbox(
        self: &Arc<Self>,
        config: Option<cri::PodSandboxConfig>,
        handler: &str,
    ) -> Result<String> {
        let config = config
            .ok_or_else(|| RuntimeError::InvalidArgument("RunPodSandbox: no config".into()))?;
        let meta = config.metadata.clone().ok_or_else(|| {
            RuntimeError::InvalidArgument("RunPodSandbox: config has no metadata".into())
        })?;
        if meta.name.is_empty() || meta.namespace.is_empty() || meta.uid.is_empty() {
            return Err(RuntimeError::InvalidArgument(format!(
                "RunPodSandbox: metadata needs name, namespace and uid (got name={:?} namespace={:?} uid={:?})",
                meta.name, meta.namespace, meta.uid
            )));
        }
        let backend = self.choose_backend(&config, handler)?;
        let id = state::new_id();
        let key = pod_name_key(&meta);
        self.reserve(&key, &id, "pod sandbox")?;
        let res = self.create_pod(&id, &key, config, handler, backend).await;
        if res.is_err() {
            self.release(&key, &id);
        }
        res.map(|_| id)
    }

    /// The backend a pod runs on: its handler, the node's VM support and the policy for
    /// pods a VM cannot honour.
    fn choose_backend(
        &self,
        config: &cri::PodSandboxConfig,
        handler: &str,
    ) -> Result<&'static str> {
        let meta = config.metadata.clone().unwrap_or_default();
        let wants_vm = match handler {
            "flat" => false,
            "vm" => true,
            "" => self.opts.default_handler == "vm",
            other => {
                return Err(RuntimeError::InvalidArgument(format!(
                    "unknown runtime handler {other:?} (known: flat, vm)"
                )))
            }
        };
        if !wants_vm {
            return Ok("flat");
        }
        let sc = config
            .linux
            .as_ref()
            .and_then(|l| l.security_context.as_ref());
        let ns = sc
            .and_then(|s| s.namespace_options.clone())
            .unwrap_or_default();
        let node = cri::NamespaceMode::Node as i32;
        let mut host = Vec::new();
        if ns.network == node {
            host.push("network namespace");
        }
        if ns.pid == node {
            host.push("pid namespace");
        }
        if ns.ipc == node {
            host.push("ipc namespace");
        }
        if sc.is_some_and(|s| s.privileged) {
            host.push("privileges");
        }
        if !host.is_empty() {
            let what = format!("the host's {}", host.join(", "));
            if self.opts.vm_cfg.host_namespaces == crate::config::HostNamespacesPolicy::Refuse
                && handler == "vm"
            {
                return Err(RuntimeError::FailedPrecondition(format!(
                    "pod {:?}: asks for {what}, which a VM cannot give, and vm.host_namespaces is \"refuse\"",
                    meta.name
                )));
            }
            tracing::info!(pod = %meta.name, namespace = %meta.namespace, asks = %what, "pod runs flat by policy: a VM cannot give it the host's namespaces or privileges");
            return Ok("flat");
        }
        if self.opts.vm.ready {
            return Ok("vm");
        }
        let why = self.opts.vm.reason.clone();
        if handler == "vm" && !self.opts.vm.fallback {
            return Err(RuntimeError::FailedPrecondition(format!(
                "runtime handler vm: no microVM can run on this node ({why}) and runtime.vm_fallback is \"refuse\""
            )));
        }
        if handler == "vm" {
            tracing::warn!(pod = %meta.name, namespace = %meta.namespace, reason = %why, "runtime handler vm: running the pod flat");
        } else {
            tracing::debug!(pod = %meta.name, reason = %why, "default handler: running the pod flat");
        }
        Ok("flat")
    }

    async fn create_pod(
        self: &Arc<Self>,
        id: &str,
        key: &str,
        config: cri::PodSandboxConfig,
        handler: &str,
        backend: &str,
    ) -> Result<()> {
        let meta = config.metadata.clone().unwrap_or_default();
        let linux = config.linux.clone().unwrap_or_default();
        let ns = linux
            .security_context
            .as_ref()
            .and_then(|s| s.namespace_options.clone())
            .unwrap_or_default();
        let share = HostShare {
            net: ns.network == cri::NamespaceMode::Node as i32,
            pid: ns.pid == cri::NamespaceMode::Node as i32,
            ipc: ns.ipc == cri::NamespaceMode::Node as i32,
        };
        // A pod on the host's network, or one whose config names no hostname (critest sends
        // none; kubelet always does), gets the node's hostname, as with containerd and CRI-O.
        let hostname = if share.net || config.hostname.is_empty() {
            rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned()
        } else {
            config.hostname.clone()
        };
        if !valid_dns_label(&hostname) || hostname.len() > 64 {
            return Err(RuntimeError::InvalidArgument(format!(
                "pod {:?}: hostname {hostname:?} is not a valid host name",
                meta.name
            )));
        }
        let cgroup_parent = if linux.cgroup_parent.is_empty() {
            format!("/vessel/{id}")
        } else if linux.cgroup_parent.contains(".slice") {
            return Err(RuntimeError::InvalidArgument(format!(
                "cgroup parent {:?} is a systemd slice, but vessel's cgroup driver is cgroupfs",
                linux.cgroup_parent
            )));
        } else {
            linux.cgroup_parent.clone()
        };
        let run_dir = self.dirs.pod_run_dir(id);
        let vm = (backend == "vm").then(|| {
            let dir = self.dirs.vm_dir(id);
            let paths = vm::VmPaths::new(&dir);
            let (vcpus, mem_mib) = vm::size_of(
                &config,
                self.opts.vm_cfg.vcpus,
                self.opts.vm_cfg.memory_mib,
                self.opts.vm_cfg.memory_overhead_mib,
            );
            VmPodState {
                dir,
                vsock: paths.vsock,
                control: paths.control,
                vcpus,
                mem_mib,
                slots: vec![String::new(); self.opts.vm_cfg.spare_disks as usize],
            }
        });
        let rec = PodRecord {
            id: id.to_string(),
            name_key: key.to_string(),
            config: config.clone(),
            runtime_handler: handler.to_string(),
            backend: backend.to_string(),
            state: PodState::Creating,
            created_at: state::now_nanos(),
            agent_pid: 0,
            agent_start_time: 0,
            agent_socket: match &vm {
                Some(v) => v.vsock.clone(),
                None => self.dirs.agent_socket(id),
            },
            agent_state_dir: run_dir.join("agent"),
            // A VM pod's network namespace is the guest's.
            netns_path: if share.net || vm.is_some() {
                PathBuf::new()
            } else {
                self.dirs.netns_dir().join(id)
            },
            hostname: hostname.clone(),
            cgroup_parent,
            reason: String::new(),
            ips: Vec::new(),
            vm,
        };
        // The record comes first: a crash from here on leaves something recovery cleans.
        self.dirs
            .save_pod(&rec)
            .map_err(|e| internal("saving pod record")(&e))?;
        let pod = Arc::new(Pod {
            rec: RwLock::new(rec.clone()),
            op: tokio::sync::Mutex::new(()),
            client: tokio::sync::Mutex::new(None),
        });
        let setup = if backend == "vm" {
            self.setup_vm_pod(&pod, &config).await
        } else {
            self.setup_pod(&pod, &config, share).await
        };
        match setup {
            Ok(()) => {
                self.pods
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id.to_string(), pod.clone());
                self.spawn_pod_watcher(pod);
                tracing::info!(pod = %id, name = %meta.name, namespace = %meta.namespace, backend, "pod sandbox ready");
                Ok(())
            }
            Err(e) => {
                tracing::warn!(pod = %id, error = %e, "RunPodSandbox failed; cleaning up");
                self.teardown_pod_resources(&pod.record()).await;
                self.opts.cni.forget(id);
                let _ = self.dirs.delete_pod(id);
                Err(e)
            }
        }
    }

    async fn setup_pod(
        &self,
        pod: &Pod,
        config: &cri::PodSandboxConfig,
        share: HostShare,
    ) -> Result<()> {
        let rec = pod.record();
        let dir = self.dirs.pod_dir(&rec.id);
        let io = |what: &str, e: std::io::Error| {
            RuntimeError::Internal(format!("pod {}: {what}: {e}", rec.id))
        };
        std::fs::write(dir.join("hostname"), format!("{}\n", rec.hostname))
            .map_err(|e| io("writing hostname", e))?;
        std::fs::write(dir.join("hosts"), hosts_file(&rec.hostname, share.net))
            .map_err(|e| io("writing hosts", e))?;
        std::fs::write(
            dir.join("resolv.conf"),
            resolv_conf(config.dns_config.as_ref())?,
        )
        .map_err(|e| io("writing resolv.conf", e))?;
        std::fs::create_dir_all(self.dirs.pod_run_dir(&rec.id))
            .map_err(|e| io("creating run dir", e))?;
        if !config.log_directory.is_empty() {
            std::fs::create_dir_all(&config.log_directory)
                .map_err(|e| io("creating log directory", e))?;
        }
        let launched = flat::launch(&flat::LaunchSpec {
            agent_binary: &self.opts.agent_binary,
            socket: &rec.agent_socket,
            state_dir: &rec.agent_state_dir,
            hostname: &rec.hostname,
            share,
            log_file: &dir.join("agent.log"),
            log_level: &self.opts.log_level,
        })
        .await
        .map_err(|e| RuntimeError::Internal(format!("pod {}: {e}", rec.id)))?;
        // Not saved yet: until the Ready record is written, a crash is cleaned up through the
        // Creating record (the agent is found by its socket path).
        let rec = pod.update(|r| {
            r.agent_pid = launched.pid;
            r.agent_start_time = launched.start_time;
        });
        let sysctls = config
            .linux
            .as_ref()
            .map(|l| l.sysctls.clone())
            .unwrap_or_default();
        if !share.net {
            flat::pin_netns(launched.pid, &rec.netns_path)
                .map_err(|e| RuntimeError::Internal(format!("pod {}: {e}", rec.id)))?;
            flat::apply_net_sysctls(&rec.netns_path, &sysctls).map_err(|e| {
                RuntimeError::InvalidArgument(format!("pod {}: sysctls: {e}", rec.id))
            })?;
            self.cni_add(pod, config).await?;
        } else if sysctls.keys().any(|k| k.starts_with("net.")) {
            return Err(RuntimeError::InvalidArgument(format!(
                "pod {}: net.* sysctls need the pod's own network namespace, not the host's",
                rec.id
            )));
        }
        let rec = pod.update(|r| r.state = PodState::Ready);
        let mut c = self.client(pod).await?;
        c.ping(ap::PingRequest {})
            .await
            .map_err(|s| agent_err(&format!("pod {}", rec.id), s))?;
        self.dirs
            .save_pod(&rec)
            .map_err(|e| internal("saving pod record")(&e))?;
        Ok(())
    }

    /// Boots a VM pod: the shim, then the agent in the guest, then the pod's identity and
    /// files in the guest.
    async fn setup_vm_pod(&self, pod: &Pod, config: &cri::PodSandboxConfig) -> Result<()> {
        let rec = pod.record();
        let v = rec.vm.clone().unwrap_or_default();
        let fail =
            |e: &dyn std::fmt::Display| RuntimeError::Internal(format!("pod {}: {e}", rec.id));
        if !config.log_directory.is_empty() {
            std::fs::create_dir_all(&config.log_directory)
                .map_err(|e| fail(&format!("creating log directory: {e}")))?;
        }
        let cfg = &self.opts.vm_cfg;
        let launch = vm::LaunchSpec {
            shim_binary: &self.opts.shim_binary,
            kernel: &cfg.kernel,
            root: &self.opts.guest_root,
            dir: &v.dir,
            vcpus: v.vcpus,
            mem_mib: v.mem_mib,
            spare_disks: cfg.spare_disks,
            console_log: cfg.console_log,
            boot_timeout: Duration::from_secs(cfg.boot_timeout_secs),
            log_level: &self.opts.log_level,
        };
        let shim = vm::spawn(&launch).map_err(|e| fail(&e))?;
        // Saved at once: a crash from here on finds the shim through the Creating record.
        let rec = pod.update(|r| {
            r.agent_pid = shim.pid;
            r.agent_start_time = shim.start_time;
        });
        self.dirs
            .save_pod(&rec)
            .map_err(|e| internal("saving pod record")(&e))?;
        let mut c = vm::wait_for_agent(&v.dir, &shim, launch.boot_timeout)
            .await
            .map_err(|e| match e {
                vm::VmError::BootTimeout { .. } => {
                    RuntimeError::DeadlineExceeded(format!("pod {}: {e}", rec.id))
                }
                e => fail(&e),
            })?;
        let sysctls = config
            .linux
            .as_ref()
            .map(|l| l.sysctls.clone())
            .unwrap_or_default();
        c.configure_sandbox(ap::ConfigureSandboxRequest {
            hostname: rec.hostname.clone(),
            sysctls,
        })
        .await
        .map_err(|s| agent_err(&format!("pod {}", rec.id), s))?;
        let file = |name: &str, data: String| ap::FileEntry {
            path: format!("{}/pod/{name}", vm::GUEST_FILES),
            mode: 0o644,
            uid: 0,
            gid: 0,
            kind: Some(ap::file_entry::Kind::Data(data.into_bytes())),
        };
        c.write_files(ap::WriteFilesRequest {
            entries: vec![
                file("hostname", format!("{}\n", rec.hostname)),
                file("hosts", hosts_file(&rec.hostname, false)),
                file("resolv.conf", resolv_conf(config.dns_config.as_ref())?),
            ],
        })
        .await
        .map_err(|s| agent_err(&format!("pod {}", rec.id), s))?;
        *pod.client.lock().await = Some(c);
        let rec = pod.update(|r| r.state = PodState::Ready);
        self.dirs
            .save_pod(&rec)
            .map_err(|e| internal("saving pod record")(&e))?;
        Ok(())
    }

    /// Attaches a flat pod's pinned netns to the node's CNI network and keeps its IPs.
    /// Without a CNI config the pod keeps loopback only (NetworkReady says so).
    async fn cni_add(&self, pod: &Pod, config: &cri::PodSandboxConfig) -> Result<()> {
        let rec = pod.record();
        if let Err(e @ crate::cni::CniError::NoConfig(_)) = self.opts.cni.load() {
            tracing::warn!(pod = %rec.id, reason = %e, "no CNI network: the pod has loopback only");
            return Ok(());
        }
        let meta = config.metadata.clone().unwrap_or_default();
        let a = self
            .opts
            .cni
            .add(crate::cni::PodNetwork {
                id: rec.id.clone(),
                netns: rec.netns_path.clone(),
                namespace: meta.namespace,
                name: meta.name,
                uid: meta.uid,
                port_mappings: crate::cni::port_mappings(&config.port_mappings),
            })
            .await
            .map_err(cni_err)?;
        let ips = a.ips();
        tracing::info!(pod = %rec.id, network = %a.network.name, ips = ?ips, "pod attached to the CNI network");
        pod.update(|r| r.ips = ips);
        Ok(())
    }

    /// Runs CNI DEL for what ADD did to a pod, if anything. Errors are logged: the cache
    /// entry then stays, and the next teardown (RemovePodSandbox, recovery) tries again.
    async fn cni_del(&self, rec: &PodRecord) {
        let Some(a) = self.opts.cni.cached(&rec.id) else {
            return;
        };
        match self.opts.cni.del(&a).await {
            Ok(()) => {
                tracing::info!(pod = %rec.id, network = %a.network.name, "pod detached from the CNI network");
                self.opts.cni.forget(&rec.id);
            }
            Err(e) => tracing::warn!(pod = %rec.id, error = %e, "CNI DEL failed"),
        }
    }

    /// Kills the agent (or the VM's shim), detaches the pod from CNI, unpins the netns,
    /// removes the pod's cgroup and VM files. Idempotent.
    async fn teardown_pod_resources(&self, rec: &PodRecord) {
        if let Some(v) = &rec.vm {
            flat::kill_agent(rec.agent_pid, rec.agent_start_time);
            flat::kill_by_arg("--spec", &vm::VmPaths::new(&v.dir).spec);
            if let Err(e) = vessel_images::fsutil::remove_any(&v.dir) {
                tracing::warn!(pod = %rec.id, error = %e, "cannot remove the VM's files");
            }
            return;
        }
        if rec.agent_pid != 0 {
            flat::kill_agent(rec.agent_pid, rec.agent_start_time);
        }
        flat::kill_agents_by_socket(&rec.agent_socket);
        // The pin keeps the netns (and the veth in it) alive until after DEL.
        self.cni_del(rec).await;
        if let Err(e) = flat::unpin_netns(&rec.netns_path) {
            tracing::warn!(pod = %rec.id, error = %e, "cannot unpin netns");
        }
        if rec.cgroup_parent == format!("/vessel/{}", rec.id) {
            flat::remove_cgroup(&rec.cgroup_parent);
        }
    }

    pub async fn stop_pod_sandbox(self: &Arc<Self>, id: &str) -> Result<()> {
        let pod = match self.pod(id) {
            Ok(p) => p,
            // CRI: stopping what is gone is fine.
            Err(RuntimeError::NotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        let _op = pod.op.lock().await;
        let rec = pod.record();
        if rec.state == PodState::Ready {
            if let Ok(mut c) = self.client(&pod).await {
                for ctr in self.ctrs_of(&rec.id) {
                    let _cop = ctr.op.lock().await;
                    if ctr.record().state == ContainerState::Running {
                        let _ = self
                            .kill_and_wait(&mut c, &ctr, Duration::from_secs(10))
                            .await;
                    }
                }
                let _ = tokio::time::timeout(
                    Duration::from_secs(15),
                    c.shutdown(ap::ShutdownRequest {}),
                )
                .await;
            }
            if rec.vm.is_some() {
                // The guest powers off after Shutdown; the shim then exits by itself.
                vm::stop_shim(rec.agent_pid, rec.agent_start_time, Duration::from_secs(5)).await;
            }
        }
        *pod.client.lock().await = None;
        self.teardown_pod_resources(&rec).await;
        for ctr in self.ctrs_of(&rec.id) {
            self.mark_lost(&ctr, "pod sandbox stopped");
        }
        let rec = pod.update(|r| {
            r.state = PodState::NotReady;
            if r.reason.is_empty() {
                r.reason = "stopped".into();
            }
        });
        self.dirs
            .save_pod(&rec)
            .map_err(|e| internal("saving pod record")(&e))?;
        tracing::info!(pod = %rec.id, "pod sandbox stopped");
        Ok(())
    }

    pub async fn remove_pod_sandbox(self: &Arc<Self>, id: &str) -> Result<()> {
        let pod = match self.pod(id) {
            Ok(p) => p,
            Err(RuntimeError::NotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        if pod.record().state == PodState::Ready {
            self.stop_pod_sandbox(id).await?;
        }
        let _op = pod.op.lock().await;
        let rec = pod.record();
        for ctr in self.ctrs_of(&rec.id) {
            self.forget_container(&ctr).await?;
        }
        self.teardown_pod_resources(&rec).await;
        self.opts.cni.forget(&rec.id);
        self.dirs
            .delete_pod(&rec.id)
            .map_err(|e| internal("removing pod state")(&e))?;
        self.pods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&rec.id);
        self.release(&rec.name_key, &rec.id);
        tracing::info!(pod = %rec.id, "pod sandbox removed");
        Ok(())
    }

    pub fn pod_sandbox_status(
        &self,
        id: &str,
        verbose: bool,
    ) -> Result<cri::PodSandboxStatusResponse> {
        let pod = self.pod(id)?;
        let rec = pod.record();
        let ns = rec
            .config
            .linux
            .as_ref()
            .and_then(|l| l.security_context.as_ref())
            .and_then(|s| s.namespace_options.clone());
        let status = cri::PodSandboxStatus {
            id: rec.id.clone(),
            metadata: rec.config.metadata.clone(),
            state: if rec.state == PodState::Ready {
                cri::PodSandboxState::SandboxReady as i32
            } else {
                cri::PodSandboxState::SandboxNotready as i32
            },
            created_at: rec.created_at,
            network: Some(cri::PodSandboxNetworkStatus {
                ip: rec.ips.first().cloned().unwrap_or_default(),
                additional_ips: rec
                    .ips
                    .iter()
                    .skip(1)
                    .map(|ip| cri::PodIp { ip: ip.clone() })
                    .collect(),
            }),
            linux: Some(cri::LinuxPodSandboxStatus {
                namespaces: Some(cri::Namespace { options: ns }),
            }),
            labels: rec.config.labels.clone(),
            annotations: rec.config.annotations.clone(),
            runtime_handler: rec.runtime_handler.clone(),
        };
        let mut info = HashMap::new();
        if verbose {
            info.insert(
                "info".into(),
                serde_json::json!({
                    "backend": rec.backend,
                    "pid": rec.agent_pid,
                    "netns": rec.netns_path,
                    "agentSocket": rec.agent_socket,
                    "hostname": rec.hostname,
                    "cgroupParent": rec.cgroup_parent,
                    "reason": rec.reason,
                    "ips": rec.ips,
                    "vm": rec.vm.as_ref().map(|v| serde_json::json!({
                        "dir": v.dir, "vcpus": v.vcpus, "memoryMiB": v.mem_mib,
                        "shimPid": rec.agent_pid, "diskSlots": v.slots,
                    })),
                })
                .to_string(),
            );
        }
        Ok(cri::PodSandboxStatusResponse {
            status: Some(status),
            info,
            ..Default::default()
        })
    }

    pub fn list_pod_sandbox(&self, filter: Option<cri::PodSandboxFilter>) -> Vec<cri::PodSandbox> {
        let f = filter.unwrap_or_default();
        let mut out: Vec<cri::PodSandbox> = self
            .pods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|p| p.record())
            .filter(|r| r.state != PodState::Creating)
            .filter(|r| f.id.is_empty() || r.id.starts_with(&f.id))
            .filter(|r| {
                f.state.as_ref().is_none_or(|s| {
                    let ready = s.state == cri::PodSandboxState::SandboxReady as i32;
                    ready == (r.state == PodState::Ready)
                })
            })
            .filter(|r| matches_labels(&r.config.labels, &f.label_selector))
            .map(|r| cri::PodSandbox {
                id: r.id.clone(),
                metadata: r.config.metadata.clone(),
                state: if r.state == PodState::Ready {
                    cri::PodSandboxState::SandboxReady as i32
                } else {
                    cri::PodSandboxState::SandboxNotready as i32
                },
                created_at: r.created_at,
                labels: r.config.labels.clone(),
                annotations: r.config.annotations.clone(),
                runtime_handler: r.runtime_handler.clone(),
            })
            .collect();
        out.sort_by_key(|p| p.created_at);
        out
    }

    // ---------- containers ----------

    pub async fn create_container(
        self: &Arc<Self>,
        pod_id: &str,
        config: Option<cri::ContainerConfig>,
    ) -> Result<String> {
        let config = config
            .ok_or_else(|| RuntimeError::InvalidArgument("CreateContainer: no config".into()))?;
        let meta = config.metadata.clone().ok_or_else(|| {
            RuntimeError::InvalidArgument("CreateContainer: config has no metadata".into())
        })?;
        if meta.name.is_empty() {
            return Err(RuntimeError::InvalidArgument(
                "CreateContainer: metadata has no name".into(),
            ));
        }
        let pod = self.pod(pod_id)?;
        // Creation and pod stop/remove exclude each other: no container appears in a pod
        // that is going away.
        let _pod_op = pod.op.lock().await;
        let prec = pod.record();
        if prec.state != PodState::Ready {
            return Err(RuntimeError::FailedPrecondition(format!(
                "CreateContainer {:?}: pod sandbox {} is not ready",
                meta.name, prec.id
            )));
        }
        let pmeta = prec.config.metadata.clone().unwrap_or_default();
        let key = format!(
            "{}_{}_{}_{}_{}",
            meta.name, pmeta.name, pmeta.namespace, pmeta.uid, meta.attempt
        );
        let id = state::new_id();
        self.reserve(&key, &id, "container")?;
        let res = self
            .create_container_inner(&pod, &prec, &id, &key, config)
            .await;
        if res.is_err() {
            self.release(&key, &id);
        }
        res.map(|_| id)
    }

    async fn create_container_inner(
        self: &Arc<Self>,
        pod: &Arc<Pod>,
        prec: &PodRecord,
        id: &str,
        key: &str,
        config: cri::ContainerConfig,
    ) -> Result<()> {
        let image_name = config
            .image
            .as_ref()
            .map(|i| i.image.clone())
            .unwrap_or_default();
        if image_name.is_empty() {
            return Err(RuntimeError::InvalidArgument(
                "CreateContainer: no image".into(),
            ));
        }
        let store = self.store.clone();
        let q = image_name.clone();
        let image = tokio::task::spawn_blocking(move || store.find(&q))
            .await
            .map_err(|e| internal("image lookup")(&e))?
            .map_err(|e| match e {
                vessel_images::ImageError::InvalidReference(_) => {
                    RuntimeError::InvalidArgument(e.to_string())
                }
                e => RuntimeError::Internal(e.to_string()),
            })?
            .ok_or_else(|| {
                RuntimeError::NotFound(format!("image {image_name:?} not found; pull it first"))
            })?;
        let layer_dirs = self.store.layer_dirs(&image);
        // TARGET pid namespace: the target container's pid in the agent's namespace.
        let ns_target = config
            .linux
            .as_ref()
            .and_then(|l| l.security_context.as_ref())
            .and_then(|s| s.namespace_options.as_ref())
            .filter(|n| n.pid == cri::NamespaceMode::Target as i32)
            .map(|n| n.target_id.clone());
        let target_pid = match ns_target {
            Some(t) => {
                let tc = self.ctr(&t).map_err(|_| {
                    RuntimeError::NotFound(format!(
                        "pid namespace target container {t:?} not found"
                    ))
                })?;
                let tr = tc.record();
                (tr.pod_id == prec.id && tr.state == ContainerState::Running).then_some(tr.pid)
            }
            None => None,
        };
        let is_vm = prec.vm.is_some();
        if is_vm && !config.devices.is_empty() {
            return Err(RuntimeError::InvalidArgument(format!(
                "CreateContainer {key:?}: host devices cannot be passed into a VM pod (pod {})",
                prec.id
            )));
        }
        let guest_pod_dir = PathBuf::from(format!("{}/pod", vm::GUEST_FILES));
        let (mut spec, user) = spec::build(&SpecInput {
            pod: &prec.config,
            config: &config,
            image: &image.run_config,
            layer_dirs: &layer_dirs,
            hostname: &prec.hostname,
            pod_dir: &if is_vm {
                guest_pod_dir
            } else {
                self.dirs.pod_dir(&prec.id)
            },
            cgroups_path: format!("{}/{}", prec.cgroup_parent.trim_end_matches('/'), id),
            target_pid,
            cgroup_ns: is_vm || spec::host_is_cgroup_v2(),
        })
        .map_err(|e| RuntimeError::InvalidArgument(format!("CreateContainer {:?}: {e}", key)))?;
        // VM pods: CRI mounts of host paths are copied into the guest.
        let copy_in = if is_vm {
            let limit = self.opts.vm_cfg.copy_in_limit_mib << 20;
            let mounts = config.mounts.clone();
            let cid = id.to_string();
            let (entries, rewritten) =
                tokio::task::spawn_blocking(move || vm::copy_in_mounts(&cid, &mounts, limit))
                    .await
                    .map_err(|e| internal("copy-in")(&e))?
                    .map_err(|e| {
                        RuntimeError::InvalidArgument(format!("CreateContainer {key:?}: {e}"))
                    })?;
            vm::rewrite_mount_sources(&mut spec, &rewritten);
            entries
        } else {
            Vec::new()
        };
        let log_path = container_log_path(&prec.config.log_directory, &config.log_path).map_err(
            |e| match e {
                RuntimeError::InvalidArgument(m) => {
                    RuntimeError::InvalidArgument(format!("CreateContainer {key:?}: {m}"))
                }
                e => e,
            },
        )?;
        let stop_signal = image
            .run_config
            .stop_signal
            .as_deref()
            .and_then(spec::parse_signal)
            .unwrap_or(libc::SIGTERM);
        let image_ref = image
            .repo_digests
            .first()
            .cloned()
            .unwrap_or_else(|| image.id.to_string());
        let mut rec = ContainerRecord {
            id: id.to_string(),
            pod_id: prec.id.clone(),
            name_key: key.to_string(),
            config: config.clone(),
            image_name: image_name.clone(),
            image_id: image.id.to_string(),
            image_ref,
            log_path: log_path.clone(),
            state: ContainerState::Creating,
            created_at: state::now_nanos(),
            started_at: 0,
            finished_at: 0,
            exit_code: 0,
            reason: String::new(),
            message: String::new(),
            pid: 0,
            uid: user.uid,
            gid: user.gid,
            groups: user.additional_gids.clone(),
            stop_signal,
            snapshot: id.to_string(),
            layers: image.layers.iter().map(|l| l.diff_id.to_string()).collect(),
        };
        self.dirs
            .save_container(&rec)
            .map_err(|e| internal("saving container record")(&e))?;
        let cleanup = |rt: &Runtime| {
            let _ = rt.store.remove_snapshot(id);
            let _ = rt.dirs.delete_container(id);
        };
        let snap = match self.store.prepare_snapshot(id, &image) {
            Ok(s) => s,
            Err(e) => {
                cleanup(self);
                return Err(RuntimeError::Internal(format!("preparing rootfs: {e}")));
            }
        };
        let rootfs = if is_vm {
            // Layers as EROFS disks in the pod's slots, the log file handed to the shim, the
            // copied-in mounts written in the guest.
            let prepared = async {
                let serials = self.attach_layers(pod, &rec.layers).await?;
                let v = prec.vm.clone().unwrap_or_default();
                if !log_path.is_empty() {
                    let (ctl, cid, lp) = (v.control.clone(), id.to_string(), log_path.clone());
                    tokio::task::spawn_blocking(move || vm::set_log(&ctl, &cid, Path::new(&lp)))
                        .await
                        .map_err(|e| internal("set_log")(&e))?
                        .map_err(|e| RuntimeError::Internal(format!("pod {}: {e}", prec.id)))?;
                }
                if !copy_in.is_empty() {
                    let mut c = self.client(pod).await?;
                    c.write_files(ap::WriteFilesRequest { entries: copy_in })
                        .await
                        .map_err(|s| {
                            agent_err(&format!("CreateContainer {key:?}: copying mounts in"), s)
                        })?;
                }
                Ok::<_, RuntimeError>(serials)
            }
            .await;
            match prepared {
                Ok(serials) => ap::Rootfs {
                    kind: Some(ap::rootfs::Kind::Disks(ap::DiskLayersRootfs { serials })),
                },
                Err(e) => {
                    self.forget_vm_container_files(pod, id).await;
                    cleanup(self);
                    return Err(e);
                }
            }
        } else {
            ap::Rootfs {
                kind: Some(ap::rootfs::Kind::Overlay(ap::OverlayRootfs {
                    lowerdirs: snap
                        .layer_dirs
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect(),
                    upperdir: snap.upper().display().to_string(),
                    workdir: snap.work().display().to_string(),
                })),
            }
        };
        let req = ap::CreateContainerRequest {
            id: id.to_string(),
            oci_spec: serde_json::to_vec(&spec).map_err(|e| internal("spec")(&e))?,
            rootfs: Some(rootfs),
            log_path: if is_vm { String::new() } else { log_path },
            tty: config.tty,
            stdin: config.stdin,
            stdin_once: config.stdin_once,
            log_vsock_port: if is_vm { vm::LOG_PORT } else { 0 },
        };
        let created = async {
            let mut c = self.client(pod).await?;
            c.create_container(req)
                .await
                .map(|r| r.into_inner())
                .map_err(|s| agent_err(&format!("CreateContainer {key:?}"), s))
        }
        .await;
        let resp = match created {
            Ok(r) => r,
            Err(e) => {
                if let Ok(mut c) = self.client(pod).await {
                    let _ = c
                        .delete_container(ap::DeleteContainerRequest { id: id.to_string() })
                        .await;
                }
                if is_vm {
                    self.forget_vm_container_files(pod, id).await;
                }
                cleanup(self);
                return Err(e);
            }
        };
        rec.pid = resp.pid;
        rec.state = ContainerState::Created;
        if let Err(e) = self.dirs.save_container(&rec) {
            if let Ok(mut c) = self.client(pod).await {
                let _ = c
                    .delete_container(ap::DeleteContainerRequest { id: id.to_string() })
                    .await;
            }
            cleanup(self);
            return Err(internal("saving container record")(&e));
        }
        self.ctrs.lock().unwrap_or_else(|p| p.into_inner()).insert(
            id.to_string(),
            Arc::new(Ctr {
                rec: RwLock::new(rec),
                op: tokio::sync::Mutex::new(()),
            }),
        );
        tracing::info!(container = %id, pod = %prec.id, name = %key, image = %image_name, "container created");
        Ok(())
    }

    /// Puts each layer's EROFS image in a disk slot of the pod's VM (reusing the slot of a
    /// layer already there, then empty slots, then slots whose layer no container of the pod
    /// uses any more) and returns their serials, bottom layer first. The caller holds the
    /// pod's op lock.
    async fn attach_layers(&self, pod: &Pod, layers: &[String]) -> Result<Vec<String>> {
        let prec = pod.record();
        let v = prec.vm.clone().unwrap_or_default();
        let in_use: std::collections::HashSet<String> = self
            .ctrs_of(&prec.id)
            .iter()
            .flat_map(|c| c.record().layers)
            .collect();
        let mut slots = v.slots.clone();
        let mut plan = Vec::new(); // (slot, diff id) to attach
        for l in layers {
            if slots.iter().any(|s| s == l) {
                continue;
            }
            let free = slots
                .iter()
                .position(|s| s.is_empty())
                .or_else(|| {
                    slots
                        .iter()
                        .position(|s| !in_use.contains(s) && !layers.contains(s))
                })
                .ok_or_else(|| {
                    RuntimeError::FailedPrecondition(format!(
                        "pod {}: no free disk slot for layer {l}: the pod's VM has {} (vm.spare_disks) and its containers use them all",
                        prec.id,
                        slots.len()
                    ))
                })?;
            slots[free] = l.clone();
            plan.push((free, l.clone()));
        }
        for (slot, l) in plan {
            let digest: vessel_images::Digest = l
                .parse()
                .map_err(|e| RuntimeError::Internal(format!("layer {l}: {e}")))?;
            let img =
                self.store.erofs_layer(&digest).await.map_err(|e| {
                    RuntimeError::Internal(format!("EROFS image of layer {l}: {e}"))
                })?;
            let (ctl, serial) = (v.control.clone(), vm::layer_serial(&l));
            let req = serde_json::json!({
                "op": "attach_disk", "slot": slot, "path": img,
                "read_only": true, "serial": serial,
            });
            tokio::task::spawn_blocking(move || vm::control(&ctl, &req, None))
                .await
                .map_err(|e| internal("attach_disk")(&e))?
                .map_err(|e| RuntimeError::Internal(format!("pod {}: {e}", prec.id)))?;
            let rec = pod.update(|r| {
                if let Some(v) = r.vm.as_mut() {
                    if let Some(s) = v.slots.get_mut(slot) {
                        *s = l.clone();
                    }
                }
            });
            self.dirs
                .save_pod(&rec)
                .map_err(|e| internal("saving pod record")(&e))?;
            tracing::debug!(pod = %prec.id, slot, layer = %l, "layer disk attached");
        }
        Ok(layers.iter().map(|l| vm::layer_serial(l)).collect())
    }

    /// Best effort: forgets a VM container's log fd in the shim and its copied-in files in
    /// the guest.
    async fn forget_vm_container_files(&self, pod: &Pod, id: &str) {
        let rec = pod.record();
        let Some(v) = rec.vm.clone() else { return };
        if rec.state != PodState::Ready {
            return;
        }
        let cid = id.to_string();
        let _ = tokio::task::spawn_blocking(move || {
            vm::control(
                &v.control,
                &serde_json::json!({"op": "drop_log", "id": cid}),
                None,
            )
        })
        .await;
        if let Ok(mut c) = self.client(pod).await {
            let _ = c
                .remove_files(ap::RemoveFilesRequest {
                    paths: vec![format!("{}/ctr/{id}", vm::GUEST_FILES)],
                })
                .await;
        }
    }

    pub async fn start_container(self: &Arc<Self>, id: &str) -> Result<()> {
        let ctr = self.ctr(id)?;
        let _op = ctr.op.lock().await;
        let rec = ctr.record();
        match rec.state {
            ContainerState::Created => {}
            ContainerState::Running => {
                return Err(RuntimeError::FailedPrecondition(format!(
                    "container {} is already running",
                    rec.id
                )))
            }
            _ => {
                return Err(RuntimeError::FailedPrecondition(format!(
                    "container {} is {:?}, not created; it cannot be started",
                    rec.id, rec.state
                )))
            }
        }
        let pod = self.pod(&rec.pod_id)?;
        let mut c = self.client(&pod).await?;
        // Stamped before the call: a process that exits at once must not finish before it started.
        let started_at = state::now_nanos();
        if let Err(s) = c
            .start_container(ap::StartContainerRequest { id: rec.id.clone() })
            .await
        {
            let e = agent_err(&format!("StartContainer {}", rec.id), s);
            let rec = ctr.update(|r| {
                r.state = ContainerState::Exited;
                r.finished_at = state::now_nanos();
                r.exit_code = 128;
                r.reason = "StartError".into();
                r.message = e.to_string();
            });
            let _ = self.dirs.save_container(&rec);
            return Err(e);
        }
        let rec = ctr.update(|r| {
            if r.state == ContainerState::Created {
                r.state = ContainerState::Running;
            }
            r.started_at = started_at;
            if r.finished_at != 0 && r.finished_at < started_at {
                r.finished_at = started_at;
            }
        });
        self.dirs
            .save_container(&rec)
            .map_err(|e| internal("saving container record")(&e))?;
        self.spawn_watcher(pod, ctr.clone(), c);
        tracing::info!(container = %rec.id, "container started");
        Ok(())
    }

    /// Records a container's exit (once).
    fn record_exit(&self, ctr: &Ctr, exit: &ap::ExitInfo) -> ContainerRecord {
        let (code, reason) = exit_reason(exit);
        let rec = ctr.update(|r| {
            if r.state != ContainerState::Exited {
                r.state = ContainerState::Exited;
                r.exit_code = code;
                r.reason = reason.clone();
                r.finished_at = if exit.finished_at != 0 {
                    exit.finished_at
                } else {
                    state::now_nanos()
                }
                .max(r.started_at);
            }
        });
        if let Err(e) = self.dirs.save_container(&rec) {
            tracing::error!(container = %rec.id, error = %e, "cannot save exit");
        }
        rec
    }

    /// Marks a container that was created or running as exited with an unknown status.
    fn mark_lost(&self, ctr: &Ctr, why: &str) {
        let rec = ctr.update(|r| {
            if matches!(
                r.state,
                ContainerState::Running | ContainerState::Created | ContainerState::Creating
            ) {
                let was_running = r.state == ContainerState::Running;
                r.state = ContainerState::Exited;
                r.finished_at = state::now_nanos();
                r.exit_code = if was_running { 137 } else { 255 };
                r.reason = "Error".into();
                r.message = why.to_string();
            }
        });
        let _ = self.dirs.save_container(&rec);
    }

    fn spawn_watcher(self: &Arc<Self>, pod: Arc<Pod>, ctr: Arc<Ctr>, mut c: AgentClient<Channel>) {
        let rt = self.clone();
        tokio::spawn(async move {
            let id = ctr.record().id;
            loop {
                match c
                    .wait_container(ap::WaitContainerRequest { id: id.clone() })
                    .await
                {
                    Ok(r) => {
                        let exit = r.into_inner().exit.unwrap_or_default();
                        let rec = rt.record_exit(&ctr, &exit);
                        tracing::info!(container = %id, exit_code = rec.exit_code, reason = %rec.reason, "container exited");
                        return;
                    }
                    Err(s) if s.code() == tonic::Code::NotFound => {
                        rt.mark_lost(&ctr, "the pod agent no longer knows this container");
                        return;
                    }
                    Err(s) => {
                        let prec = pod.record();
                        if prec.state != PodState::Ready
                            || ctr.record().state == ContainerState::Exited
                        {
                            return;
                        }
                        if !flat::is_alive(prec.agent_pid, prec.agent_start_time) {
                            rt.agent_died(&pod).await;
                            return;
                        }
                        tracing::debug!(container = %id, error = %s, "wait interrupted; retrying");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        if let Ok(nc) = rt.client(&pod).await {
                            c = nc;
                        }
                    }
                }
            }
        });
    }

    /// Watches a ready pod's host process (flat agent or VM shim): when it exits without a
    /// StopPodSandbox, the pod becomes NotReady and its containers exited, whether or not a
    /// container was running to notice.
    fn spawn_pod_watcher(self: &Arc<Self>, pod: Arc<Pod>) {
        let rt = self.clone();
        let rec = pod.record();
        tokio::spawn(async move {
            flat::wait_exit(rec.agent_pid, rec.agent_start_time).await;
            flat::reap(rec.agent_pid);
            rt.agent_died(&pod).await;
        });
    }

    /// The pod's agent is gone: the pod is NotReady and its containers have exited.
    async fn agent_died(&self, pod: &Pod) {
        let _op = pod.op.lock().await;
        let rec = pod.record();
        if rec.state != PodState::Ready || flat::is_alive(rec.agent_pid, rec.agent_start_time) {
            return;
        }
        let what = if rec.vm.is_some() {
            "the VM shim exited unexpectedly"
        } else {
            "the pod agent exited unexpectedly"
        };
        tracing::warn!(pod = %rec.id, pid = rec.agent_pid, reason = what, "pod lost; pod is not ready");
        *pod.client.lock().await = None;
        self.teardown_pod_resources(&rec).await;
        for ctr in self.ctrs_of(&rec.id) {
            self.mark_lost(&ctr, what);
        }
        let rec = pod.update(|r| {
            r.state = PodState::NotReady;
            r.reason = what.into();
        });
        let _ = self.dirs.save_pod(&rec);
    }

    /// SIGKILLs every process of a container and waits for its exit.
    async fn kill_and_wait(
        &self,
        c: &mut AgentClient<Channel>,
        ctr: &Ctr,
        limit: Duration,
    ) -> Result<()> {
        let id = ctr.record().id;
        let _ = c
            .signal_container(ap::SignalContainerRequest {
                id: id.clone(),
                signal: libc::SIGKILL as u32,
                all: true,
            })
            .await;
        match tokio::time::timeout(
            limit,
            c.wait_container(ap::WaitContainerRequest { id: id.clone() }),
        )
        .await
        {
            Ok(Ok(r)) => {
                self.record_exit(ctr, &r.into_inner().exit.unwrap_or_default());
                Ok(())
            }
            Ok(Err(s)) => Err(agent_err(&format!("stopping container {id}"), s)),
            Err(_) => Err(RuntimeError::DeadlineExceeded(format!(
                "container {id} did not exit within {limit:?} of SIGKILL"
            ))),
        }
    }

    pub async fn stop_container(self: &Arc<Self>, id: &str, timeout_secs: i64) -> Result<()> {
        let ctr = match self.ctr(id) {
            Ok(c) => c,
            Err(RuntimeError::NotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        let _op = ctr.op.lock().await;
        let rec = ctr.record();
        if rec.state != ContainerState::Running {
            return Ok(());
        }
        let pod = self.pod(&rec.pod_id)?;
        let mut c = self.client(&pod).await?;
        if timeout_secs > 0 {
            let sig = rec.stop_signal;
            if let Err(s) = c
                .signal_container(ap::SignalContainerRequest {
                    id: rec.id.clone(),
                    signal: sig as u32,
                    all: false,
                })
                .await
            {
                tracing::debug!(container = %rec.id, error = %s, "stop signal not delivered");
            }
            let wait = c.wait_container(ap::WaitContainerRequest { id: rec.id.clone() });
            if let Ok(Ok(r)) =
                tokio::time::timeout(Duration::from_secs(timeout_secs as u64), wait).await
            {
                self.record_exit(&ctr, &r.into_inner().exit.unwrap_or_default());
                tracing::info!(container = %rec.id, "container stopped");
                return Ok(());
            }
            tracing::info!(container = %rec.id, timeout_secs, "stop signal timed out; killing");
        }
        self.kill_and_wait(&mut c, &ctr, Duration::from_secs(30))
            .await?;
        tracing::info!(container = %rec.id, "container killed");
        Ok(())
    }

    /// Deletes a container everywhere (agent, snapshot, record, name). Caller holds no locks.
    async fn forget_container(&self, ctr: &Ctr) -> Result<()> {
        let _op = ctr.op.lock().await;
        let rec = ctr.record();
        if let Ok(pod) = self.pod(&rec.pod_id) {
            if pod.record().state == PodState::Ready {
                if let Ok(mut c) = self.client(&pod).await {
                    if rec.state == ContainerState::Running {
                        let _ = self
                            .kill_and_wait(&mut c, ctr, Duration::from_secs(30))
                            .await;
                    }
                    if let Err(s) = c
                        .delete_container(ap::DeleteContainerRequest { id: rec.id.clone() })
                        .await
                    {
                        return Err(agent_err(&format!("RemoveContainer {}", rec.id), s));
                    }
                }
                self.forget_vm_container_files(&pod, &rec.id).await;
            }
        }
        self.store
            .remove_snapshot(&rec.snapshot)
            .map_err(|e| RuntimeError::Internal(format!("removing rootfs of {}: {e}", rec.id)))?;
        // The agent removes the cgroup of containers it deletes; one whose agent died is ours
        // (a VM pod's cgroups die with its guest).
        if let Some(pod) = self
            .pod(&rec.pod_id)
            .ok()
            .filter(|p| p.record().vm.is_none())
        {
            let parent = pod.record().cgroup_parent;
            flat::remove_cgroup(&format!("{}/{}", parent.trim_end_matches('/'), rec.id));
        }
        self.dirs
            .delete_container(&rec.id)
            .map_err(|e| internal("removing record")(&e))?;
        self.ctrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&rec.id);
        self.release(&rec.name_key, &rec.id);
        tracing::info!(container = %rec.id, "container removed");
        Ok(())
    }

    pub async fn remove_container(self: &Arc<Self>, id: &str) -> Result<()> {
        let ctr = match self.ctr(id) {
            Ok(c) => c,
            Err(RuntimeError::NotFound(_)) => return Ok(()),
            Err(e) => return Err(e),
        };
        self.forget_container(&ctr).await
    }

    fn to_status(&self, r: &ContainerRecord) -> cri::ContainerStatus {
        cri::ContainerStatus {
            id: r.id.clone(),
            metadata: r.config.metadata.clone(),
            state: cri_state(r.state) as i32,
            created_at: r.created_at,
            started_at: r.started_at,
            finished_at: r.finished_at,
            exit_code: r.exit_code,
            image: Some(cri::ImageSpec {
                image: r.image_name.clone(),
                ..Default::default()
            }),
            image_ref: r.image_ref.clone(),
            reason: r.reason.clone(),
            message: r.message.clone(),
            labels: r.config.labels.clone(),
            annotations: r.config.annotations.clone(),
            mounts: r.config.mounts.clone(),
            log_path: r.log_path.clone(),
            image_id: r.image_id.clone(),
            resources: r
                .config
                .linux
                .as_ref()
                .and_then(|l| l.resources.clone())
                .map(|l| cri::ContainerResources {
                    linux: Some(l),
                    ..Default::default()
                }),
            user: Some(cri::ContainerUser {
                linux: Some(cri::LinuxContainerUser {
                    uid: r.uid as i64,
                    gid: r.gid as i64,
                    supplemental_groups: r.groups.iter().map(|g| *g as i64).collect(),
                }),
            }),
        }
    }

    pub fn container_status(
        &self,
        id: &str,
        verbose: bool,
    ) -> Result<cri::ContainerStatusResponse> {
        let ctr = self.ctr(id)?;
        let r = ctr.record();
        if r.state == ContainerState::Creating {
            return Err(RuntimeError::NotFound(format!(
                "container {id:?} not found"
            )));
        }
        let mut info = HashMap::new();
        if verbose {
            info.insert(
                "info".into(),
                serde_json::json!({
                    "sandboxID": r.pod_id,
                    "pid": r.pid,
                    "snapshot": r.snapshot,
                    "stopSignal": r.stop_signal,
                })
                .to_string(),
            );
        }
        Ok(cri::ContainerStatusResponse {
            status: Some(self.to_status(&r)),
            info,
        })
    }

    pub fn list_containers(&self, filter: Option<cri::ContainerFilter>) -> Vec<cri::Container> {
        let f = filter.unwrap_or_default();
        let mut out: Vec<(i64, cri::Container)> = self
            .ctrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|c| c.record())
            .filter(|r| r.state != ContainerState::Creating)
            .filter(|r| f.id.is_empty() || r.id.starts_with(&f.id))
            .filter(|r| f.pod_sandbox_id.is_empty() || r.pod_id.starts_with(&f.pod_sandbox_id))
            .filter(|r| {
                f.state
                    .as_ref()
                    .is_none_or(|s| s.state == cri_state(r.state) as i32)
            })
            .filter(|r| matches_labels(&r.config.labels, &f.label_selector))
            .map(|r| {
                (
                    r.created_at,
                    cri::Container {
                        id: r.id.clone(),
                        pod_sandbox_id: r.pod_id.clone(),
                        metadata: r.config.metadata.clone(),
                        image: Some(cri::ImageSpec {
                            image: r.image_name.clone(),
                            ..Default::default()
                        }),
                        image_ref: r.image_ref.clone(),
                        state: cri_state(r.state) as i32,
                        created_at: r.created_at,
                        labels: r.config.labels.clone(),
                        annotations: r.config.annotations.clone(),
                        image_id: r.image_id.clone(),
                    },
                )
            })
            .collect();
        out.sort_by_key(|(t, _)| *t);
        out.into_iter().map(|(_, c)| c).collect()
    }

    async fn running(
        &self,
        id: &str,
        what: &str,
    ) -> Result<(ContainerRecord, AgentClient<Channel>)> {
        let ctr = self.ctr(id)?;
        let rec = ctr.record();
        if rec.state != ContainerState::Running {
            return Err(RuntimeError::FailedPrecondition(format!(
                "{what}: container {} is not running ({:?})",
                rec.id, rec.state
            )));
        }
        let pod = self.pod(&rec.pod_id)?;
        let c = self.client(&pod).await?;
        Ok((rec, c))
    }

    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: Vec<String>,
        timeout_secs: i64,
    ) -> Result<cri::ExecSyncResponse> {
        if cmd.is_empty() || cmd[0].is_empty() {
            return Err(RuntimeError::InvalidArgument(
                "ExecSync: empty command".into(),
            ));
        }
        let (rec, mut c) = self.running(id, "ExecSync").await?;
        let call = c.exec_sync(ap::ExecSyncRequest {
            id: rec.id.clone(),
            args: cmd.clone(),
            env: vec![],
            cwd: String::new(),
            timeout_ms: (timeout_secs.max(0) as u64) * 1000,
        });
        // The agent enforces the timeout; ours is a backstop in case it cannot.
        let r = if timeout_secs > 0 {
            tokio::time::timeout(Duration::from_secs(timeout_secs as u64 + 10), call)
                .await
                .map_err(|_| {
                    RuntimeError::DeadlineExceeded(format!(
                        "ExecSync in container {}: command {:?} timed out after {timeout_secs}s",
                        rec.id, cmd
                    ))
                })?
        } else {
            call.await
        }
        .map_err(|s| agent_err(&format!("ExecSync in {}", rec.id), s))?
        .into_inner();
        if r.timed_out {
            return Err(RuntimeError::DeadlineExceeded(format!(
                "ExecSync in container {}: command {:?} timed out after {timeout_secs}s",
                rec.id, cmd
            )));
        }
        Ok(cri::ExecSyncResponse {
            stdout: r.stdout,
            stderr: r.stderr,
            exit_code: r.exit_code,
        })
    }

    pub async fn reopen_log(&self, id: &str) -> Result<()> {
        let (rec, mut c) = self.running(id, "ReopenContainerLog").await?;
        let pod = self.pod(&rec.pod_id)?;
        if let Some(v) = pod.record().vm {
            if rec.log_path.is_empty() {
                return Ok(());
            }
            let (ctl, cid, lp) = (v.control, rec.id.clone(), rec.log_path.clone());
            return tokio::task::spawn_blocking(move || vm::set_log(&ctl, &cid, Path::new(&lp)))
                .await
                .map_err(|e| internal("reopen")(&e))?
                .map_err(|e| {
                    RuntimeError::Internal(format!("ReopenContainerLog {}: {e}", rec.id))
                });
        }
        c.reopen_log(ap::ReopenLogRequest { id: rec.id.clone() })
            .await
            .map_err(|s| agent_err(&format!("ReopenContainerLog {}", rec.id), s))?;
        Ok(())
    }

    pub async fn container_stats(&self, id: &str) -> Result<cri::ContainerStats> {
        let ctr = self.ctr(id)?;
        let rec = ctr.record();
        let mut stats = cri::ContainerStats {
            attributes: Some(cri::ContainerAttributes {
                id: rec.id.clone(),
                metadata: rec.config.metadata.clone(),
                labels: rec.config.labels.clone(),
                annotations: rec.config.annotations.clone(),
            }),
            ..Default::default()
        };
        if rec.state != ContainerState::Running {
            return Ok(stats);
        }
        let pod = self.pod(&rec.pod_id)?;
        let mut c = self.client(&pod).await?;
        let s = c
            .stats(ap::StatsRequest { id: rec.id.clone() })
            .await
            .map_err(|s| agent_err(&format!("ContainerStats {}", rec.id), s))?
            .into_inner();
        let ts = if s.timestamp != 0 {
            s.timestamp
        } else {
            state::now_nanos()
        };
        let u = |v: u64| Some(cri::UInt64Value { value: v });
        stats.cpu = Some(cri::CpuUsage {
            timestamp: ts,
            usage_core_nano_seconds: u(s.cpu_usage_ns),
            ..Default::default()
        });
        stats.memory = Some(cri::MemoryUsage {
            timestamp: ts,
            working_set_bytes: u(s.memory_working_set_bytes),
            usage_bytes: u(s.memory_usage_bytes),
            rss_bytes: u(s.memory_rss_bytes),
            page_faults: u(s.page_faults),
            major_page_faults: u(s.major_page_faults),
            ..Default::default()
        });
        stats.writable_layer = Some(cri::FilesystemUsage {
            timestamp: ts,
            fs_id: Some(cri::FilesystemIdentifier {
                mountpoint: self.store.root().display().to_string(),
            }),
            used_bytes: u(s.writable_layer_bytes),
            inodes_used: u(s.writable_layer_inodes),
        });
        Ok(stats)
    }

    pub async fn list_container_stats(
        &self,
        filter: Option<cri::ContainerStatsFilter>,
    ) -> Result<Vec<cri::ContainerStats>> {
        let f = filter.unwrap_or_default();
        let ids: Vec<String> = self
            .list_containers(Some(cri::ContainerFilter {
                id: f.id,
                pod_sandbox_id: f.pod_sandbox_id,
                label_selector: f.label_selector,
                state: None,
            }))
            .into_iter()
            .map(|c| c.id)
            .collect();
        let mut out = Vec::new();
        for id in ids {
            match self.container_stats(&id).await {
                Ok(s) => out.push(s),
                Err(RuntimeError::NotFound(_)) => {}
                Err(e) => tracing::debug!(container = %id, error = %e, "stats unavailable"),
            }
        }
        Ok(out)
    }

    /// Pod-level stats: the sum of its running containers' (flat pods have no pause process,
    /// and the agent's own usage is not the workload's).
    pub async fn pod_sandbox_stats(&self, id: &str) -> Result<cri::PodSandboxStats> {
        let pod = self.pod(id)?;
        let rec = pod.record();
        let mut containers = Vec::new();
        for ctr in self.ctrs_of(&rec.id) {
            let cid = ctr.record().id;
            match self.container_stats(&cid).await {
                Ok(s) => containers.push(s),
                Err(RuntimeError::NotFound(_)) => {}
                Err(e) => tracing::debug!(container = %cid, error = %e, "stats unavailable"),
            }
        }
        let ts = state::now_nanos();
        let sum = |f: &dyn Fn(&cri::ContainerStats) -> Option<u64>| -> Option<cri::UInt64Value> {
            let v: Vec<u64> = containers.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| cri::UInt64Value {
                value: v.iter().sum(),
            })
        };
        let cpu = cri::CpuUsage {
            timestamp: ts,
            usage_core_nano_seconds: sum(&|c| {
                c.cpu
                    .as_ref()?
                    .usage_core_nano_seconds
                    .as_ref()
                    .map(|v| v.value)
            }),
            ..Default::default()
        };
        let memory = cri::MemoryUsage {
            timestamp: ts,
            working_set_bytes: sum(&|c| {
                c.memory
                    .as_ref()?
                    .working_set_bytes
                    .as_ref()
                    .map(|v| v.value)
            }),
            usage_bytes: sum(&|c| c.memory.as_ref()?.usage_bytes.as_ref().map(|v| v.value)),
            rss_bytes: sum(&|c| c.memory.as_ref()?.rss_bytes.as_ref().map(|v| v.value)),
            page_faults: sum(&|c| c.memory.as_ref()?.page_faults.as_ref().map(|v| v.value)),
            major_page_faults: sum(&|c| {
                c.memory
                    .as_ref()?
                    .major_page_faults
                    .as_ref()
                    .map(|v| v.value)
            }),
            ..Default::default()
        };
        Ok(cri::PodSandboxStats {
            attributes: Some(cri::PodSandboxAttributes {
                id: rec.id.clone(),
                metadata: rec.config.metadata.clone(),
                labels: rec.config.labels.clone(),
                annotations: rec.config.annotations.clone(),
            }),
            linux: Some(cri::LinuxPodSandboxStats {
                cpu: Some(cpu),
                memory: Some(memory),
                containers,
                ..Default::default()
            }),
            windows: None,
        })
    }

    pub async fn list_pod_sandbox_stats(
        &self,
        filter: Option<cri::PodSandboxStatsFilter>,
    ) -> Result<Vec<cri::PodSandboxStats>> {
        let f = filter.unwrap_or_default();
        let ids: Vec<String> = self
            .list_pod_sandbox(Some(cri::PodSandboxFilter {
                id: f.id,
                label_selector: f.label_selector,
                state: Some(cri::PodSandboxStateValue {
                    state: cri::PodSandboxState::SandboxReady as i32,
                }),
            }))
            .into_iter()
            .map(|p| p.id)
            .collect();
        let mut out = Vec::new();
        for id in ids {
            match self.pod_sandbox_stats(&id).await {
                Ok(s) => out.push(s),
                Err(RuntimeError::NotFound(_)) => {}
                Err(e) => tracing::debug!(pod = %id, error = %e, "pod stats unavailable"),
            }
        }
        Ok(out)
    }

    /// CRI UpdateContainerResources: new cgroup limits for a created or running container.
    pub async fn update_container_resources(
        &self,
        id: &str,
        linux: Option<cri::LinuxContainerResources>,
    ) -> Result<()> {
        let ctr = self.ctr(id)?;
        let _op = ctr.op.lock().await;
        let rec = ctr.record();
        if !matches!(rec.state, ContainerState::Created | ContainerState::Running) {
            return Err(RuntimeError::FailedPrecondition(format!(
                "UpdateContainerResources: container {} is {:?}",
                rec.id, rec.state
            )));
        }
        let Some(r) = linux else {
            return Ok(());
        };
        spec::check_resources(&r).map_err(|e| {
            RuntimeError::InvalidArgument(format!("UpdateContainerResources {}: {e}", rec.id))
        })?;
        let pod = self.pod(&rec.pod_id)?;
        let mut c = self.client(&pod).await?;
        c.update_resources(ap::UpdateResourcesRequest {
            id: rec.id.clone(),
            resources: Some(ap::LinuxResources {
                cpu_period: r.cpu_period,
                cpu_quota: r.cpu_quota,
                cpu_shares: r.cpu_shares,
                memory_limit_in_bytes: r.memory_limit_in_bytes,
                cpuset_cpus: r.cpuset_cpus.clone(),
                cpuset_mems: r.cpuset_mems.clone(),
                memory_swap_limit_in_bytes: r.memory_swap_limit_in_bytes,
                unified: r.unified.clone(),
            }),
        })
        .await
        .map_err(|s| agent_err(&format!("UpdateContainerResources {}", rec.id), s))?;
        let rec = ctr.update(|c| {
            let l = c.config.linux.get_or_insert_with(Default::default);
            l.resources = Some(r.clone());
        });
        self.dirs
            .save_container(&rec)
            .map_err(|e| internal("saving container record")(&e))?;
        tracing::info!(container = %rec.id, "container resources updated");
        Ok(())
    }

    pub fn set_pod_cidr(&self, cidr: &str) {
        *self.pod_cidr.lock().unwrap_or_else(|p| p.into_inner()) = cidr.to_string();
        tracing::info!(pod_cidr = %cidr, "runtime config updated");
    }

    pub fn pod_cidr(&self) -> String {
        self.pod_cidr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    // ---------- recovery ----------

    /// Rebuilds memory from records after a (re)start: reconnects to live pod agents, marks
    /// pods whose agent died NotReady, finishes or undoes half-done work, and removes debris.
    async fn recover(self: &Arc<Self>) {
        for dir in self.dirs.orphan_pod_dirs() {
            tracing::info!(dir = %dir.display(), "removing pod dir without record");
            let _ = vessel_images::fsutil::remove_any(&dir);
        }
        let records = self.dirs.load_pods();
        let vm_dirs: std::collections::HashSet<PathBuf> = records
            .iter()
            .filter_map(|r| r.vm.as_ref().map(|v| v.dir.clone()))
            .collect();
        // What belongs to a record that could not be read is kept (its pod may still run).
        let mut kept = self.dirs.quarantined_ids();
        if !kept.is_empty() {
            tracing::error!(ids = ?kept, "records quarantined; their data is kept and their pods are not managed (see Status)");
        }
        if let Ok(rd) = std::fs::read_dir(self.dirs.run.join("vms")) {
            for e in rd.flatten() {
                if !vm_dirs.contains(&e.path()) && !held(&kept, &e.file_name().to_string_lossy()) {
                    tracing::info!(dir = %e.path().display(), "removing VM files without a pod");
                    flat::kill_by_arg("--spec", &vm::VmPaths::new(&e.path()).spec);
                    let _ = vessel_images::fsutil::remove_any(&e.path());
                }
            }
        }
        for rec in records {
            if rec.state == PodState::Creating {
                tracing::info!(pod = %rec.id, "cleaning up pod interrupted while being created");
                self.teardown_pod_resources(&rec).await;
                self.opts.cni.forget(&rec.id);
                let _ = self.dirs.delete_pod(&rec.id);
                continue;
            }
            self.names
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(rec.name_key.clone(), rec.id.clone());
            let pod = Arc::new(Pod {
                rec: RwLock::new(rec.clone()),
                op: tokio::sync::Mutex::new(()),
                client: tokio::sync::Mutex::new(None),
            });
            self.pods
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(rec.id.clone(), pod.clone());
            if rec.state == PodState::Ready {
                let alive = flat::is_alive(rec.agent_pid, rec.agent_start_time)
                    && matches!(
                        tokio::time::timeout(Duration::from_secs(5), async {
                            let mut c = self.client(&pod).await?;
                            c.ping(ap::PingRequest {})
                                .await
                                .map_err(|s| agent_err("ping", s))
                        })
                        .await,
                        Ok(Ok(_))
                    );
                if !alive {
                    tracing::warn!(pod = %rec.id, "pod agent is gone; pod is not ready");
                    *pod.client.lock().await = None;
                    self.teardown_pod_resources(&rec).await;
                    let r = pod.update(|r| {
                        r.state = PodState::NotReady;
                        r.reason = if r.vm.is_some() {
                            "the VM shim exited while vesseld was down"
                        } else {
                            "the pod agent exited while vesseld was down"
                        }
                        .into();
                    });
                    let _ = self.dirs.save_pod(&r);
                } else {
                    self.spawn_pod_watcher(pod.clone());
                }
            } else {
                // Not ready: make sure nothing of it runs or stays mounted.
                self.teardown_pod_resources(&rec).await;
            }
        }
        let mut agent_lists: HashMap<String, Option<HashMap<String, ap::ContainerInfo>>> =
            HashMap::new();
        for rec in self.dirs.load_containers() {
            if held(&kept, &rec.pod_id) {
                tracing::warn!(container = %rec.id, pod = %rec.pod_id, "container of a pod whose record is quarantined: kept, not managed");
                kept.insert(rec.id.clone());
                continue;
            }
            let Ok(pod) = self.pod(&rec.pod_id) else {
                tracing::info!(container = %rec.id, "removing container of a pod that no longer exists");
                let _ = self.store.remove_snapshot(&rec.snapshot);
                let _ = self.dirs.delete_container(&rec.id);
                continue;
            };
            let pod_ready = pod.record().state == PodState::Ready;
            if !agent_lists.contains_key(&rec.pod_id) {
                let list = if pod_ready {
                    match self.client(&pod).await {
                        Ok(mut c) => c
                            .list_containers(ap::ListContainersRequest {})
                            .await
                            .ok()
                            .map(|r| {
                                r.into_inner()
                                    .containers
                                    .into_iter()
                                    .map(|i| (i.id.clone(), i))
                                    .collect()
                            }),
                        Err(_) => None,
                    }
                } else {
                    None
                };
                agent_lists.insert(rec.pod_id.clone(), list);
            }
            let known = agent_lists.get(&rec.pod_id).cloned().flatten();
            if rec.state == ContainerState::Creating {
                tracing::info!(container = %rec.id, "cleaning up container interrupted while being created");
                if pod_ready {
                    if let Ok(mut c) = self.client(&pod).await {
                        let _ = c
                            .delete_container(ap::DeleteContainerRequest { id: rec.id.clone() })
                            .await;
                    }
                }
                let _ = self.store.remove_snapshot(&rec.snapshot);
                let _ = self.dirs.delete_container(&rec.id);
                continue;
            }
            self.names
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(rec.name_key.clone(), rec.id.clone());
            let ctr = Arc::new(Ctr {
                rec: RwLock::new(rec.clone()),
                op: tokio::sync::Mutex::new(()),
            });
            self.ctrs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(rec.id.clone(), ctr.clone());
            if rec.state == ContainerState::Exited {
                continue;
            }
            match known.as_ref().and_then(|m| m.get(&rec.id)) {
                None => self.mark_lost(&ctr, "the pod agent is gone"),
                Some(info) => {
                    if let Some(exit) = &info.exit {
                        if info.state == ap::ContainerState::Exited as i32 {
                            let r = self.record_exit(&ctr, exit);
                            tracing::info!(container = %rec.id, exit_code = r.exit_code, "container exited while vesseld was down");
                            continue;
                        }
                    }
                    if info.state == ap::ContainerState::Running as i32 {
                        let r = ctr.update(|r| {
                            r.state = ContainerState::Running;
                            r.pid = info.pid;
                            if r.started_at == 0 {
                                r.started_at = info.started_at;
                            }
                        });
                        let _ = self.dirs.save_container(&r);
                        if let Ok(c) = self.client(&pod).await {
                            self.spawn_watcher(pod.clone(), ctr.clone(), c);
                        }
                    }
                }
            }
        }
        // Container records quarantined just now, while loading them.
        let quarantined = self.dirs.quarantined();
        kept.extend(quarantined.iter().filter_map(|p| state::quarantined_id(p)));
        *self.quarantined.lock().unwrap_or_else(|p| p.into_inner()) = quarantined;
        // CNI attachments without a pod: DEL them (their netns may be gone; DEL still frees
        // the IP). A pod whose record is quarantined may still run: its network stays.
        for id in self.opts.cni.cached_ids() {
            if self.pod(&id).is_err() && !held(&kept, &id) {
                if let Some(a) = self.opts.cni.cached(&id) {
                    tracing::info!(pod = %id, "detaching CNI attachment without a pod");
                    if let Err(e) = self.opts.cni.del(&a).await {
                        tracing::warn!(pod = %id, error = %e, "CNI DEL failed");
                    }
                }
                self.opts.cni.forget(&id);
            }
        }
        // Snapshots without a container, and netns pins without a pod.
        let live: std::collections::HashSet<String> = self
            .ctrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|c| c.record().snapshot)
            .collect();
        for s in self.store.list_snapshots().unwrap_or_default() {
            if !live.contains(&s) && !held(&kept, &s) {
                tracing::info!(snapshot = %s, "removing snapshot without container");
                let _ = self.store.remove_snapshot(&s);
            }
        }
        if let Ok(rd) = std::fs::read_dir(self.dirs.netns_dir()) {
            let pods = self.pods.lock().unwrap_or_else(|p| p.into_inner()).clone();
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                let keep = held(&kept, &name)
                    || pods
                        .get(&name)
                        .is_some_and(|p| p.record().state == PodState::Ready);
                if !keep {
                    let _ = flat::unpin_netns(&e.path());
                }
            }
        }
        let (np, nc) = (
            self.pods.lock().unwrap_or_else(|p| p.into_inner()).len(),
            self.ctrs.lock().unwrap_or_else(|p| p.into_inner()).len(),
        );
        tracing::info!(pods = np, containers = nc, "state recovered");
    }
}

fn cri_state(s: ContainerState) -> cri::ContainerState {
    match s {
        ContainerState::Creating | ContainerState::Created => cri::ContainerState::ContainerCreated,
        ContainerState::Running => cri::ContainerState::ContainerRunning,
        ContainerState::Exited => cri::ContainerState::ContainerExited,
    }
}

/// Where a container's log goes: kubelet's `log_path` is relative to the pod's
/// `log_directory` (CRI contract). An absolute path or a `..` component is refused; the
/// directory is resolved here (kubelet's own, trusted), and the file is then opened beneath it
/// without following links (`vessel_agent::logs::open_log_nofollow`). Empty: no log.
fn container_log_path(log_directory: &str, log_path: &str) -> Result<String> {
    use std::path::Component;
    if log_directory.is_empty() || log_path.is_empty() {
        return Ok(String::new());
    }
    let rel = Path::new(log_path);
    if !rel
        .components()
        .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
        || rel.file_name().is_none()
    {
        return Err(RuntimeError::InvalidArgument(format!(
            "log_path {log_path:?} must be a relative file path inside the pod's log directory {log_directory:?} (no `..`, not absolute)"
        )));
    }
    let dir = Path::new(log_directory);
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::canonicalize(dir))
        .map(|d| d.join(rel).display().to_string())
        .map_err(|e| RuntimeError::Internal(format!("log directory {log_directory:?}: {e}")))
}

fn hosts_file(hostname: &str, host_net: bool) -> String {
    if host_net {
        if let Ok(h) = std::fs::read_to_string("/etc/hosts") {
            return h;
        }
    }
    format!(
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\nfe00::0\tip6-localnet\nff00::0\tip6-mcastprefix\nff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n127.0.1.1\t{hostname}\n"
    )
}

fn resolv_conf(dns: Option<&cri::DnsConfig>) -> Result<String> {
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

// ---------- streaming (Exec, PortForward through the streaming server) ----------

/// An interactive exec in progress: input to the agent, and its output.
pub type ExecChannels = (
    tokio::sync::mpsc::Sender<ap::ExecInput>,
    tonic::Streaming<ap::ExecOutput>,
);

impl Runtime {
    /// A container's record, for the streaming RPCs' checks.
    pub fn streaming_container(&self, id: &str) -> Result<ContainerRecord> {
        Ok(self.ctr(id)?.record())
    }

    /// A pod's record, for the streaming RPCs' checks and PortForward's netns.
    pub fn streaming_pod(&self, id: &str) -> Result<PodRecord> {
        Ok(self.pod(id)?.record())
    }

    /// Starts an interactive exec through the pod agent's `Exec` stream (flat and VM pods).
    pub async fn exec_stream(
        &self,
        id: &str,
        cmd: Vec<String>,
        tty: bool,
        stdin: bool,
        size: Option<ap::WindowSize>,
    ) -> Result<ExecChannels> {
        if cmd.is_empty() || cmd[0].is_empty() {
            return Err(RuntimeError::InvalidArgument("Exec: empty command".into()));
        }
        let (rec, mut c) = self.running(id, "Exec").await?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let start = ap::ExecInput {
            msg: Some(ap::exec_input::Msg::Start(ap::ExecStart {
                id: rec.id.clone(),
                args: cmd,
                env: vec![],
                cwd: String::new(),
                tty,
                stdin,
                size,
            })),
        };
        tx.send(start)
            .await
            .map_err(|_| RuntimeError::Internal("Exec: input channel closed".into()))?;
        let out = c
            .exec(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .map_err(|s| agent_err(&format!("Exec in {}", rec.id), s))?
            .into_inner();
        Ok((tx, out))
    }

    /// Attaches to a running container's own stdio through its pod agent (flat or VM alike):
    /// input goes in as for Exec; output is what the container writes from now on, then its
    /// exit code.
    pub async fn attach_stream(&self, id: &str, stdin: bool) -> Result<ExecChannels> {
        let (rec, mut c) = self.running(id, "Attach").await?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let start = ap::ExecInput {
            msg: Some(ap::exec_input::Msg::Attach(ap::AttachStart {
                id: rec.id.clone(),
                stdin,
            })),
        };
        tx.send(start)
            .await
            .map_err(|_| RuntimeError::Internal("Attach: input channel closed".into()))?;
        let out = c
            .attach(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .map_err(|s| agent_err(&format!("Attach to {}", rec.id), s))?
            .into_inner();
        Ok((tx, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_by_id_or_unique_prefix() {
        let m: HashMap<String, Arc<u8>> =
            [("abc1".into(), Arc::new(1)), ("abc2".into(), Arc::new(2))]
                .into_iter()
                .collect();
        assert_eq!(*lookup(&m, "abc2", "container").unwrap(), 2);
        assert_eq!(*lookup(&m, "abc1", "container").unwrap(), 1);
        let e = lookup(&m, "abc", "container").unwrap_err();
        assert!(matches!(e, RuntimeError::InvalidArgument(_)), "{e}");
        let e = lookup(&m, "x", "pod sandbox").unwrap_err();
        assert_eq!(e.to_string(), "pod sandbox \"x\" not found");
        assert!(matches!(
            lookup(&m, "", "container"),
            Err(RuntimeError::NotFound(_))
        ));
        let one: HashMap<String, Arc<u8>> = [("zz9".into(), Arc::new(9))].into_iter().collect();
        assert_eq!(*lookup(&one, "zz", "container").unwrap(), 9);
    }

    #[test]
    fn log_path_stays_inside_the_log_directory() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("pod");
        let ds = d.to_str().unwrap();
        for bad in [
            "../../../../../../etc/x.log",
            "/etc/x.log",
            "ctr/../../x.log",
            "..",
        ] {
            let e = container_log_path(ds, bad).unwrap_err();
            assert!(matches!(e, RuntimeError::InvalidArgument(_)), "{bad}: {e}");
        }
        assert!(!d.exists(), "nothing is created for a refused path");
        let canon = std::fs::canonicalize(t.path()).unwrap().join("pod");
        assert_eq!(
            container_log_path(ds, "ctr/0.log").unwrap(),
            canon.join("ctr/0.log").display().to_string()
        );
        assert_eq!(container_log_path(ds, "").unwrap(), "");
        assert_eq!(container_log_path("", "x.log").unwrap(), "");
    }
}
