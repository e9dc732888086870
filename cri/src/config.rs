//! vesseld's configuration file (TOML). `vesseld config default` prints [`DEFAULT_CONFIG`],
//! which documents every key; a test keeps it equal to `Config::default()`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use vessel_images::RegistryConfig;

/// The documented defaults, as `vesseld config default` prints them.
pub const DEFAULT_CONFIG: &str = r#"# vessel configuration (vesseld --config FILE).
# Every key is optional; the values below are the defaults.

[daemon]
# CRI endpoint. kubelet: --container-runtime-endpoint=unix:///run/vessel/vessel.sock
socket = "/run/vessel/vessel.sock"
# Group (name or gid) given the socket, which is created with mode 0660. Empty: root's group.
socket_group = ""
# Persistent state: the image store, pod and container records.
root_dir = "/var/lib/vessel"
# Runtime state that a reboot clears: sockets, netns pins, mounts.
state_dir = "/run/vessel"
# trace, debug, info, warn or error; the RUST_LOG environment variable overrides it.
log_level = "info"
# "text" or "json".
log_format = "text"
# Prometheus metrics over HTTP at this TCP address (GET /metrics). Empty disables them.
metrics_address = "127.0.0.1:9654"
# The streaming server (exec, port-forward) that the CRI Exec/PortForward URLs point at:
# host:port, port 0 picks a free port. kubelet connects here; keep it on loopback.
streaming_address = "127.0.0.1:0"
# An exec, attach or port-forward connection on which no byte moves either way for this
# long is closed (kubelet's and containerd's default: 4 h). 0: never.
stream_idle_timeout_secs = 14400

[runtime]
# The pod agent binary. Empty: vessel-agent next to the vesseld binary.
agent_binary = ""
# What runtime handler "vm" does when microVMs cannot run (KVM absent, or unusable because it
# runs guest code far below native speed, as nested emulating hypervisors do): "fallback" runs
# the pod flat and says so in the log and in Status; "refuse" fails RunPodSandbox.
vm_fallback = "fallback"
# The backend of pods whose runtime handler is empty: "vm" (a microVM when this node can run
# them, flat otherwise, without a warning) or "flat".
default_handler = "vm"
# How pod cgroups are made; it must match kubelet's cgroupDriver. "cgroupfs": directories
# under kubelet's cgroup parent (or /vessel/<pod>). "systemd": a transient scope unit per pod,
# vessel-pod-<id>.scope, in the slice kubelet gives (vessel.slice without one), made over
# systemd's D-Bus API; the pod's containers get cgroups beneath it. "systemd" needs systemd as
# the init system: vesseld does not start without it.
cgroup_driver = "cgroupfs"
# CheckpointContainer, and restoring a checkpoint (CreateContainer from an archive or a
# checkpoint image), with CRIU, for flat pods (CRI-O's option of the same name). A restore
# has CRIU, as root, load the images a checkpoint carries: false refuses both.
enable_criu_support = true
# Where CDI spec files (JSON or YAML) describe the devices containers may ask for by name
# (CRI cdi_devices, or cdi.k8s.io/ annotations); a later directory wins for the same device.
cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
# The volumes an image declares (Dockerfile VOLUME) that no CRI mount covers are made for each
# container, as containerd makes them: a writable directory holding what the image has there.
# true: not made (the path stays part of the container's root filesystem), as containerd's
# option of the same name.
ignore_image_defined_volumes = false

[vm]
# The guest kernel (an ELF vmlinux boots faster than a bzImage) and the initrd whose /init is
# vessel-agent: scripts/build-guest-kernel.sh and scripts/build-guest-initrd.sh build them and
# scripts/install.sh installs them here.
kernel = "/usr/local/share/vessel/guest/vmlinux"
initrd = "/usr/local/share/vessel/guest/initrd.img"
# The same agent as a read-only EROFS root filesystem on a virtio-blk disk
# (FORMAT=erofs scripts/build-guest-initrd.sh): used instead of the initrd when the file
# exists, because the guest then reads only the pages it touches (less guest memory, faster
# boot). Empty: always the initrd.
rootfs = "/usr/local/share/vessel/guest/rootfs.erofs"
# The per-pod VMM process. Empty: vessel-shim next to the vesseld binary.
shim_binary = ""
# vCPUs of a pod without a CPU limit; a limit (quota/period, rounded up) overrides it, up to
# the host's CPU count.
vcpus = 1
# Guest memory of a pod without a memory limit. Memory the guest never touches costs the
# host nothing.
memory_mib = 256
# Added to a pod's memory limit for the guest kernel and the agent.
memory_overhead_mib = 64
# How long the guest may take from the VMM's start until its agent answers.
boot_timeout_secs = 10
# Hot-swappable disk slots per VM for image layers (EROFS images): one per distinct layer
# in use by the pod's containers at once. A slot whose layer no container uses any more is
# reused.
spare_disks = 12
# Keep the guest console in <state_dir>/vms/<pod>/console.log (and boot verbosely).
console_log = false
# Pods that ask for the host's network, pid or ipc namespace, or a privileged pod, cannot be
# given what they ask in a VM: "flat" runs them flat (with a log line), "refuse" fails them.
host_namespaces = "flat"
# The VMM's seccomp filters, an allow-list per thread kind (docs/vm-pods.md): "enforce"
# refuses a system call outside its thread's list (EPERM, and a line in the pod's shim.log);
# "log" makes it and lets the kernel log it (audit, dmesg), to find what a list lacks.
seccomp = "enforce"

[cni]
# CNI for pods that have their own network namespace, flat and VM: the first valid network
# config (*.conflist, *.conf or *.json, by file name) in conf_dir is run through its plugin
# chain (ADD when the pod starts, DEL in reverse when it stops). A VM pod's guest gets the CNI
# interface's addresses, routes, MAC and MTU through a tap joined to it with tc redirect.
# Without a config, NetworkReady is false and such pods get loopback only. Host-network pods
# get no CNI.
conf_dir = "/etc/cni/net.d"
# Where plugin binaries are looked up, in order (Debian's containernetworking-plugins
# installs them in /usr/lib/cni). Also the plugins' CNI_PATH.
bin_dirs = ["/opt/cni/bin", "/usr/lib/cni"]
# What each pod's ADD was given and answered, for its DEL. Empty: <root_dir>/cni, which
# survives reboots, so the IPs of pods a reboot killed are still released.
cache_dir = ""

[images]
# The platform picked from multi-platform images (os/arch[/variant]).
platform = "linux/amd64"
# Layer downloads running at once, across all pulls.
max_concurrent_downloads = 3
# Seconds to wait for a TCP/TLS connection to a registry.
connect_timeout_secs = 10
# A pull fails when a registry sends nothing (headers or body) for this many seconds, like
# containerd's image_pull_progress_timeout; a slow but moving download goes on. 0: no limit.
pull_progress_timeout_secs = 300
# Bounds on what unpacking one layer may write, so that a small layer cannot fill the disk
# (a gzip bomb, a sparse file whose holes unpack as zeros); a pull that goes past one fails
# naming the key, and what it wrote is removed. 0 turns a bound off.
max_layer_bytes = 34359738368      # file content bytes (sparse files count in full)
max_image_bytes = 68719476736      # the same, all the layers one pull unpacks
max_layer_entries = 1000000        # tar entries
max_unpack_ratio = 100             # bytes written per compressed byte, past the first GiB

# The node's registry credentials, a docker `config.json` ({"auths": {"host": {"auth": ...}}}),
# read at each pull for registries that kubelet sends no credentials for (like CRI-O's
# global_auth_file). Empty: none.
auth_file = ""

# Per-registry settings, keyed by registry host as it appears in image names
# ("docker.io", "quay.io", "registry.local:5000"), like containerd's hosts.toml; the section
# "_default" applies to hosts that have none (docs/operator-guide.md maps every key):
#
# [images.registries."docker.io"]
# mirrors = ["https://mirror.example.com"]  # tried in order before the registry itself
# mirrors_only = false                      # true: never fall back to the registry itself
# skip_verify = false                       # accept TLS certificates that do not verify
# plain_http = false                        # try plain HTTP when HTTPS fails
# insecure = false                          # both of the above
# ca_file = "/etc/vessel/certs/registry.pem"  # extra CA to trust
# client_cert = "/etc/vessel/certs/client.pem"  # mutual TLS (with client_key)
# client_key = "/etc/vessel/certs/client.key"
# headers = { "X-Example" = "value" }       # sent with every request
#
# A mirror may be a table, with its own settings (unset ones come from its host section):
#
# [[images.registries."quay.io".mirrors]]
# url = "https://pull-through.example.com/quay"
# capabilities = ["pull"]       # "pull" (blobs, manifests by digest), "resolve" (tags)
# override_path = false         # true: the URL is the API root; no /v2 is added
# ca_file = "/etc/vessel/certs/mirror-ca.pem"
#
# Registries on loopback (localhost, 127.0.0.0/8) that have no section here are treated as
# insecure, as Docker does; a section for them applies as written.
"#;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub daemon: DaemonConfig,
    pub runtime: RuntimeConfig,
    pub vm: VmConfig,
    pub images: ImagesConfig,
    pub cni: CniConfig,
}

/// `[cni]`: the node's CNI plugins, for flat pods with their own network namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CniConfig {
    pub conf_dir: PathBuf,
    pub bin_dirs: Vec<PathBuf>,
    pub cache_dir: PathBuf,
}

impl Default for CniConfig {
    fn default() -> Self {
        CniConfig {
            conf_dir: "/etc/cni/net.d".into(),
            bin_dirs: vec!["/opt/cni/bin".into(), "/usr/lib/cni".into()],
            cache_dir: PathBuf::new(),
        }
    }
}

/// `[runtime]`: how pods and containers are run (see the default config for each key).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RuntimeConfig {
    pub agent_binary: String,
    pub vm_fallback: VmFallback,
    pub default_handler: String,
    pub cgroup_driver: CgroupDriver,
    /// CheckpointContainer and restores, with CRIU (CRI-O's `enable_criu_support`).
    pub enable_criu_support: bool,
    pub cdi_spec_dirs: Vec<PathBuf>,
    /// The volumes an image declares (Dockerfile `VOLUME`) are not made (containerd's
    /// option of the same name).
    pub ignore_image_defined_volumes: bool,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            agent_binary: String::new(),
            vm_fallback: VmFallback::Fallback,
            default_handler: "vm".into(),
            cgroup_driver: CgroupDriver::Cgroupfs,
            // On, as in CRI-O: a node without CRIU answers a checkpoint with why.
            enable_criu_support: true,
            cdi_spec_dirs: crate::cdi::default_dirs(),
            ignore_image_defined_volumes: false,
        }
    }
}

/// `[vm]`: how VM pods are booted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VmConfig {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub rootfs: PathBuf,
    pub shim_binary: String,
    pub vcpus: u8,
    pub memory_mib: u64,
    pub memory_overhead_mib: u64,
    pub boot_timeout_secs: u64,
    pub spare_disks: u32,
    pub console_log: bool,
    pub host_namespaces: HostNamespacesPolicy,
    pub seccomp: vessel_shim::seccomp::Mode,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            kernel: "/usr/local/share/vessel/guest/vmlinux".into(),
            initrd: "/usr/local/share/vessel/guest/initrd.img".into(),
            rootfs: "/usr/local/share/vessel/guest/rootfs.erofs".into(),
            shim_binary: String::new(),
            vcpus: 1,
            memory_mib: 256,
            memory_overhead_mib: 64,
            boot_timeout_secs: 10,
            spare_disks: 12,
            console_log: false,
            host_namespaces: HostNamespacesPolicy::Flat,
            seccomp: vessel_shim::seccomp::Mode::Enforce,
        }
    }
}

/// How the guest's agent is booted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestRoot {
    /// An initramfs whose /init is the agent.
    Initrd(PathBuf),
    /// A read-only EROFS root filesystem on the first virtio-blk disk.
    Erofs(PathBuf),
}

impl GuestRoot {
    pub fn path(&self) -> &Path {
        match self {
            GuestRoot::Initrd(p) | GuestRoot::Erofs(p) => p,
        }
    }
}

/// What happens to a `vm` pod that asks for host namespaces or privileges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HostNamespacesPolicy {
    #[default]
    Flat,
    Refuse,
}

/// `runtime.cgroup_driver`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupDriver {
    #[default]
    Cgroupfs,
    Systemd,
}

impl CgroupDriver {
    /// The driver itself.
    pub fn driver(self) -> crate::sandbox::cgroup::Driver {
        match self {
            CgroupDriver::Cgroupfs => crate::sandbox::cgroup::Driver::Cgroupfs,
            CgroupDriver::Systemd => crate::sandbox::cgroup::Driver::Systemd(Default::default()),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmFallback {
    #[default]
    Fallback,
    Refuse,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DaemonConfig {
    pub socket: PathBuf,
    pub socket_group: String,
    pub root_dir: PathBuf,
    pub state_dir: PathBuf,
    pub log_level: String,
    pub log_format: LogFormat,
    pub metrics_address: String,
    pub streaming_address: String,
    pub stream_idle_timeout_secs: u64,
}

impl DaemonConfig {
    /// The streaming server's idle timeout; none when 0.
    pub fn stream_idle_timeout(&self) -> Option<std::time::Duration> {
        (self.stream_idle_timeout_secs > 0)
            .then(|| std::time::Duration::from_secs(self.stream_idle_timeout_secs))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ImagesConfig {
    pub platform: String,
    pub max_concurrent_downloads: usize,
    pub connect_timeout_secs: u64,
    pub pull_progress_timeout_secs: u64,
    pub max_layer_bytes: u64,
    pub max_image_bytes: u64,
    pub max_layer_entries: u64,
    pub max_unpack_ratio: u64,
    pub auth_file: PathBuf,
    pub registries: BTreeMap<String, RegistryConfig>,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            socket: "/run/vessel/vessel.sock".into(),
            socket_group: String::new(),
            root_dir: "/var/lib/vessel".into(),
            state_dir: "/run/vessel".into(),
            log_level: "info".into(),
            log_format: LogFormat::Text,
            metrics_address: "127.0.0.1:9654".into(),
            streaming_address: "127.0.0.1:0".into(),
            stream_idle_timeout_secs: 4 * 3600,
        }
    }
}

impl Default for ImagesConfig {
    fn default() -> Self {
        ImagesConfig {
            platform: "linux/amd64".into(),
            max_concurrent_downloads: 3,
            connect_timeout_secs: 10,
            pull_progress_timeout_secs: 300,
            max_layer_bytes: vessel_images::unpack::UnpackLimits::default().max_bytes,
            max_image_bytes: vessel_images::unpack::UnpackLimits::default().max_image_bytes,
            max_layer_entries: vessel_images::unpack::UnpackLimits::default().max_entries,
            max_unpack_ratio: vessel_images::unpack::UnpackLimits::default().max_ratio,
            auth_file: PathBuf::new(),
            registries: BTreeMap::new(),
        }
    }
}

/// Why a configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing config {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// The drop-in directory beside a config file: `<dir>/config.d` (`/etc/vessel/config.d`).
pub fn dropin_dir(config: &Path) -> PathBuf {
    config.parent().unwrap_or(Path::new("/")).join("config.d")
}

/// The `*.toml` files of a drop-in directory, in name order (none when it does not exist).
pub fn dropins(dir: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(ConfigError::Read {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    let mut files: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml") && p.is_file())
        .collect();
    files.sort();
    Ok(files)
}

/// Merges `over` into `base`: tables key by key, at any depth; any other value (arrays
/// too) replaces the one before it, as CRI-O's `crio.conf.d` does.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

impl Config {
    /// Loads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Self::load_layers(Some(path), &[])
    }

    /// The configuration from the built-in defaults, then `main` (if any), then each drop-in
    /// file in order, merged key by key (see [`merge`]); validated once, at the end. An
    /// unknown key in any file is an error naming that file.
    pub fn load_layers(main: Option<&Path>, dropins: &[PathBuf]) -> Result<Config, ConfigError> {
        let read = |path: &Path| -> Result<toml::Table, ConfigError> {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.to_path_buf(),
                source,
            })?;
            let t: toml::Table = toml::from_str(&text).map_err(|e| ConfigError::Parse {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
            // Each file on its own must be a valid part of a config (unknown keys named
            // against the file that has them).
            toml::Value::Table(t.clone())
                .try_into::<Config>()
                .map_err(|e| ConfigError::Parse {
                    path: path.to_path_buf(),
                    message: e.to_string(),
                })?;
            Ok(t)
        };
        let mut merged = toml::Table::new();
        for p in main.into_iter().chain(dropins.iter().map(PathBuf::as_path)) {
            merge(&mut merged, read(p)?);
        }
        let last = dropins
            .last()
            .map(PathBuf::as_path)
            .or(main)
            .unwrap_or(Path::new("default"));
        let c: Config = toml::Value::Table(merged)
            .try_into()
            .map_err(|e| ConfigError::Parse {
                path: last.to_path_buf(),
                message: e.to_string(),
            })?;
        c.validate(last)?;
        Ok(c)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let c: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        c.validate(path)?;
        Ok(c)
    }

    pub fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        if vessel_images::oci::Platform::parse(&self.images.platform).is_none() {
            return Err(invalid(format!(
                "images.platform {:?} is not os/arch[/variant]",
                self.images.platform
            )));
        }
        if self.images.max_concurrent_downloads == 0 {
            return Err(invalid(
                "images.max_concurrent_downloads must be at least 1".into(),
            ));
        }
        for (k, v) in [
            ("daemon.socket", &self.daemon.socket),
            ("daemon.root_dir", &self.daemon.root_dir),
            ("daemon.state_dir", &self.daemon.state_dir),
        ] {
            if !v.is_absolute() {
                return Err(invalid(format!("{k} must be an absolute path, not {v:?}")));
            }
        }
        // Pod agent sockets live at <state_dir>/agents/<32 hex>.sock.
        if self.daemon.state_dir.as_os_str().len() + 45 > 107 {
            return Err(invalid(format!(
                "daemon.state_dir {:?} is too long: pod agent sockets under it would exceed the 107-byte unix socket path limit",
                self.daemon.state_dir
            )));
        }
        // A unix socket path is limited to 107 bytes.
        if self.daemon.socket.as_os_str().len() > 107 {
            return Err(invalid(format!(
                "daemon.socket {:?} is longer than a unix socket path may be (107 bytes)",
                self.daemon.socket
            )));
        }
        if !matches!(
            self.daemon.log_level.as_str(),
            "trace" | "debug" | "info" | "warn" | "error"
        ) {
            return Err(invalid(format!(
                "daemon.log_level {:?} is not one of trace, debug, info, warn, error",
                self.daemon.log_level
            )));
        }
        // The metrics endpoint is off where its address is empty.
        let addrs = [
            ("metrics_address", &self.daemon.metrics_address, true),
            ("streaming_address", &self.daemon.streaming_address, false),
        ];
        for (what, addr, may_be_empty) in addrs {
            if !(may_be_empty && addr.is_empty()) && addr.parse::<std::net::SocketAddr>().is_err() {
                return Err(invalid(format!("daemon.{what} {addr:?} is not host:port")));
            }
        }
        if !matches!(self.runtime.default_handler.as_str(), "vm" | "flat") {
            return Err(invalid(format!(
                "runtime.default_handler {:?} is not \"vm\" or \"flat\"",
                self.runtime.default_handler
            )));
        }
        if self.vm.vcpus == 0 {
            return Err(invalid("vm.vcpus must be at least 1".into()));
        }
        if self.vm.memory_mib < 64 {
            return Err(invalid(format!(
                "vm.memory_mib {} is too small (at least 64)",
                self.vm.memory_mib
            )));
        }
        if self.vm.boot_timeout_secs == 0 {
            return Err(invalid("vm.boot_timeout_secs must be at least 1".into()));
        }
        // 19 virtio devices fit the IOAPIC: the vsock device and up to 18 disks.
        if self.vm.spare_disks == 0 || self.vm.spare_disks > 18 {
            return Err(invalid(format!(
                "vm.spare_disks {} must be 1..=18",
                self.vm.spare_disks
            )));
        }
        for (k, v) in [
            ("vm.kernel", &self.vm.kernel),
            ("vm.initrd", &self.vm.initrd),
        ] {
            if !v.is_absolute() {
                return Err(invalid(format!("{k} must be an absolute path, not {v:?}")));
            }
        }
        if !self.vm.rootfs.as_os_str().is_empty() && !self.vm.rootfs.is_absolute() {
            return Err(invalid(format!(
                "vm.rootfs must be empty or an absolute path, not {:?}",
                self.vm.rootfs
            )));
        }
        if !self.cni.conf_dir.is_absolute() {
            return Err(invalid(format!(
                "cni.conf_dir must be an absolute path, not {:?}",
                self.cni.conf_dir
            )));
        }
        if self.cni.bin_dirs.is_empty() {
            return Err(invalid(
                "cni.bin_dirs must name at least one directory".into(),
            ));
        }
        for d in &self.cni.bin_dirs {
            if !d.is_absolute() {
                return Err(invalid(format!(
                    "cni.bin_dirs: {d:?} is not an absolute path"
                )));
            }
            if d.to_string_lossy().contains(':') {
                return Err(invalid(format!(
                    "cni.bin_dirs: {d:?} contains ':', which CNI_PATH cannot carry"
                )));
            }
        }
        if let Some(d) = self.runtime.cdi_spec_dirs.iter().find(|d| !d.is_absolute()) {
            return Err(invalid(format!(
                "runtime.cdi_spec_dirs: {d:?} is not an absolute path"
            )));
        }
        if !self.cni.cache_dir.as_os_str().is_empty() && !self.cni.cache_dir.is_absolute() {
            return Err(invalid(format!(
                "cni.cache_dir must be empty or an absolute path, not {:?}",
                self.cni.cache_dir
            )));
        }
        for (host, r) in &self.images.registries {
            r.validate(host).map_err(invalid)?;
        }
        if !self.images.auth_file.as_os_str().is_empty() && !self.images.auth_file.is_absolute() {
            return Err(invalid(format!(
                "images.auth_file must be empty or an absolute path, not {:?}",
                self.images.auth_file
            )));
        }
        Ok(())
    }

    /// The pod agent binary to run.
    pub fn agent_binary(&self) -> PathBuf {
        binary(&self.runtime.agent_binary, "vessel-agent")
    }

    /// The guest's root: the EROFS root filesystem if configured and present, else the initrd.
    pub fn guest_root(&self) -> GuestRoot {
        if !self.vm.rootfs.as_os_str().is_empty() && self.vm.rootfs.is_file() {
            GuestRoot::Erofs(self.vm.rootfs.clone())
        } else {
            GuestRoot::Initrd(self.vm.initrd.clone())
        }
    }

    /// The VM shim binary to run.
    pub fn shim_binary(&self) -> PathBuf {
        binary(&self.vm.shim_binary, "vessel-shim")
    }

    /// The node's CNI setup, with the cache dir resolved.
    pub fn cni(&self) -> crate::cni::Cni {
        crate::cni::Cni {
            conf_dir: self.cni.conf_dir.clone(),
            bin_dirs: self.cni.bin_dirs.clone(),
            cache_dir: if self.cni.cache_dir.as_os_str().is_empty() {
                self.daemon.root_dir.join("cni")
            } else {
                self.cni.cache_dir.clone()
            },
        }
    }

    /// The image store lives here.
    pub fn image_root(&self) -> PathBuf {
        self.daemon.root_dir.join("images")
    }

    /// What unpacking one layer may write (`[images] max_layer_*`, `max_unpack_ratio`).
    pub fn unpack_limits(&self) -> vessel_images::unpack::UnpackLimits {
        vessel_images::unpack::UnpackLimits {
            max_bytes: self.images.max_layer_bytes,
            max_image_bytes: self.images.max_image_bytes,
            max_entries: self.images.max_layer_entries,
            max_ratio: self.images.max_unpack_ratio,
            ..Default::default()
        }
    }

    /// The image store at [`Config::image_root`], with this config's unpack limits.
    pub fn open_image_store(&self) -> Result<vessel_images::ImageStore, vessel_images::ImageError> {
        let mut store = vessel_images::ImageStore::open(self.image_root())?;
        store.set_unpack_limits(self.unpack_limits());
        Ok(store)
    }

    pub fn pull_config(&self) -> vessel_images::PullConfig {
        vessel_images::PullConfig {
            platform: vessel_images::oci::Platform::parse(&self.images.platform)
                .unwrap_or_else(|| vessel_images::PullConfig::default().platform),
            registries: self.images.registries.clone(),
            auth_file: (!self.images.auth_file.as_os_str().is_empty())
                .then(|| self.images.auth_file.clone()),
            max_concurrent_downloads: self.images.max_concurrent_downloads,
            connect_timeout: std::time::Duration::from_secs(self.images.connect_timeout_secs),
            progress_timeout: (self.images.pull_progress_timeout_secs > 0)
                .then(|| std::time::Duration::from_secs(self.images.pull_progress_timeout_secs)),
        }
    }
}

/// The binary `name` to run: `configured` where it is set, else the one beside vesseld's
/// own executable, else the one in /usr/local/bin.
fn binary(configured: &str, name: &str) -> PathBuf {
    if !configured.is_empty() {
        return PathBuf::from(configured);
    }
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join(name)))
        .filter(|p| p.exists())
        .unwrap_or_else(|| Path::new("/usr/local/bin").join(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropins_merge_over_the_file_in_name_order() {
        let (d, main) = crate::testing::temp_path("config.toml");
        std::fs::write(
            &main,
            "[daemon]\nlog_level = \"info\"\n[images]\nmax_concurrent_downloads = 3\n",
        )
        .unwrap();
        let dir = dropin_dir(&main);
        assert_eq!(dir, d.path().join("config.d"));
        assert!(
            dropins(&dir).unwrap().is_empty(),
            "no directory: no drop-ins"
        );
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(
            dir.join("20-debug.toml"),
            "[daemon]\nlog_level = \"debug\"\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("10-first.toml"),
            "[daemon]\nlog_level = \"warn\"\n",
        )
        .unwrap();
        std::fs::write(dir.join("README"), "not toml").unwrap();
        let files = dropins(&dir).unwrap();
        assert_eq!(
            files,
            vec![dir.join("10-first.toml"), dir.join("20-debug.toml")]
        );
        let c = Config::load_layers(Some(&main), &files).unwrap();
        // The last drop-in wins; keys no drop-in names keep the file's value.
        assert_eq!(c.daemon.log_level, "debug");
        assert_eq!(c.images.max_concurrent_downloads, 3);
        // Without a file: defaults, then drop-ins.
        let c = Config::load_layers(None, &files).unwrap();
        assert_eq!(c.daemon.log_level, "debug");
        assert_eq!(
            c.images.max_concurrent_downloads,
            Config::default().images.max_concurrent_downloads
        );
        // A typo in a drop-in names that file and the key.
        std::fs::write(dir.join("30-typo.toml"), "[daemon]\nlog_levle = \"x\"\n").unwrap();
        let e = Config::load_layers(Some(&main), &dropins(&dir).unwrap()).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("30-typo.toml") && m.contains("log_levle"), "{m}");
    }

    #[test]
    fn documented_defaults_are_the_defaults() {
        let c = Config::parse(DEFAULT_CONFIG, Path::new("default")).unwrap();
        assert_eq!(c, Config::default());
    }

    #[test]
    fn empty_file_is_defaults() {
        assert_eq!(
            Config::parse("", Path::new("x")).unwrap(),
            Config::default()
        );
    }

    #[test]
    fn registries_parse() {
        let c = Config::parse(
            r#"
[images.registries."docker.io"]
mirrors = ["https://m1", "http://m2:5000"]
[images.registries."r.local:5000"]
insecure = true
ca_file = "/etc/ca.pem"
"#,
            Path::new("x"),
        )
        .unwrap();
        assert_eq!(c.images.registries["docker.io"].mirrors.len(), 2);
        assert!(c.images.registries["r.local:5000"].insecure);
    }

    #[test]
    fn rejects_typos_and_bad_values() {
        for bad in [
            "[daemon]\nsocket_path = \"/x\"",
            "[images]\nplatform = \"amd64\"",
            "[daemon]\nroot_dir = \"relative\"",
            "[daemon]\nlog_level = \"loud\"",
            "[images]\nmax_concurrent_downloads = 0",
            "[images.registries.\"x\"]\nmirror = [\"a\"]",
            "[images.registries.\"x\"]\nmirrors = [{ url = \"a\", capabilities = [] }]",
            "[images.registries.\"x\"]\nclient_key = \"/k\"",
            "[images]\nauth_file = \"auth.json\"",
            "[runtime]\ndefault_handler = \"kata\"",
            "[runtime]\ncgroup_driver = \"systemd-cgroup\"",
            "[runtime]\ncdi_spec_dirs = [\"cdi\"]",
            "[vm]\nspare_disks = 0",
            "[vm]\nvcpus = 0",
            "[vm]\nkernel = \"vmlinux\"",
            "[vm]\nhost_namespaces = \"maybe\"",
            "[cni]\nconf_dir = \"net.d\"",
            "[cni]\nbin_dirs = []",
            "[cni]\nbin_dirs = [\"bin\"]",
            "[cni]\ncache_dir = \"cache\"",
            "[cni]\nplugin_dir = \"/x\"",
        ] {
            assert!(Config::parse(bad, Path::new("x")).is_err(), "{bad}");
        }
    }
}
