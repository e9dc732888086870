//! CNI for pods: the node's CNI network configuration (the first valid `.conflist`, `.conf`
//! or `.json` file in `cni.conf_dir`, by name) is run through its plugin chain for each pod
//! that has its own network namespace: a flat pod's, or the host-side netns pinned for a VM
//! pod (whose shim joins its tap to the CNI interface with tc redirect).
//!
//! ADD runs the plugins in order, each getting the previous one's result as `prevResult`;
//! DEL runs them in reverse with the final ADD result. What ADD was asked (the network
//! config as sent, the pod's arguments, its port mappings) and what it answered is kept in
//! `<cache_dir>/<pod-id>.json`, written atomically before the first plugin runs and again
//! after the last, so that DEL undoes exactly what ADD did, also after a crash or a reboot
//! and also when the node's config has changed since.
//!

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use vessel_images::fsutil;

/// How long one plugin may run.
pub const PLUGIN_TIMEOUT: Duration = Duration::from_secs(60);

/// The interface CNI creates in the pod's netns.
pub const IFNAME: &str = "eth0";

#[derive(Debug, thiserror::Error)]
pub enum CniError {
    #[error("no CNI network config (*.conflist, *.conf, *.json) in {0}")]
    NoConfig(PathBuf),
    #[error("CNI network config {path}: {message}")]
    BadConfig { path: PathBuf, message: String },
    #[error("CNI plugin {plugin:?} (network {network:?}) not found in {dirs}")]
    PluginNotFound {
        plugin: String,
        network: String,
        dirs: String,
    },
    #[error("CNI {command} of pod {pod}: plugin {plugin:?} did not finish within {timeout:?}")]
    Timeout {
        command: &'static str,
        pod: String,
        plugin: String,
        timeout: Duration,
    },
    #[error("CNI {command} of pod {pod}: plugin {plugin:?} failed: {message}")]
    Plugin {
        command: &'static str,
        pod: String,
        plugin: String,
        message: String,
    },
    #[error("CNI cache {path}: {message}")]
    Cache { path: PathBuf, message: String },
    #[error("CNI ADD of pod {pod}: network {network:?} gave the pod no IP address on {IFNAME}")]
    NoAddress { pod: String, network: String },
}

/// A network configuration list, as loaded from `conf_dir`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NetworkList {
    pub name: String,
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    /// Each plugin's config object as written in the file.
    pub plugins: Vec<Value>,
    /// The file it came from.
    pub source: PathBuf,
}

impl NetworkList {
    /// Parses a `.conflist` (`plugins` list) or a `.conf` (one plugin).
    pub fn parse(path: &Path, text: &str) -> Result<NetworkList, CniError> {
        let bad = |message: String| CniError::BadConfig {
            path: path.to_path_buf(),
            message,
        };
        let v: Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let obj = v
            .as_object()
            .ok_or_else(|| bad("not a JSON object".into()))?;
        let name = obj
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if name.is_empty() {
            return Err(bad("no \"name\"".into()));
        }
        // CNI 1.1's `cniVersions`: the highest we speak of them and `cniVersion`, as libcni
        // picks it; an entry that is not a version makes the config invalid.
        let mut versions: Vec<&str> = obj
            .get("cniVersion")
            .and_then(Value::as_str)
            .into_iter()
            .collect();
        for v in obj
            .get("cniVersions")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            match v.as_str().filter(|v| version_key(v).is_some()) {
                Some(v) => versions.push(v),
                None => return Err(bad(format!("\"cniVersions\" has {v}, not a version"))),
            }
        }
        let cni_version = versions
            .iter()
            .filter_map(|v| Some((version_key(v)?, *v)))
            .filter(|(k, _)| *k <= (1, 1, 0))
            .max()
            .map(|(_, v)| v)
            .or_else(|| obj.get("cniVersion").and_then(Value::as_str))
            .unwrap_or("0.2.0")
            .to_string();
        let plugins = match obj.get("plugins") {
            Some(Value::Array(p)) => p.clone(),
            Some(_) => return Err(bad("\"plugins\" is not a list".into())),
            None if obj.contains_key("type") => vec![v.clone()],
            None => return Err(bad("neither \"plugins\" nor \"type\"".into())),
        };
        if plugins.is_empty() {
            return Err(bad("\"plugins\" is empty".into()));
        }
        for (i, p) in plugins.iter().enumerate() {
            if p.get("type")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .is_empty()
            {
                return Err(bad(format!("plugin {i} has no \"type\"")));
            }
        }
        Ok(NetworkList {
            name,
            cni_version,
            plugins,
            source: path.to_path_buf(),
        })
    }

    pub fn plugin_types(&self) -> impl Iterator<Item = &str> {
        self.plugins
            .iter()
            .map(|p| p.get("type").and_then(Value::as_str).unwrap_or_default())
    }
}

/// The node's CNI setup: where configs, plugins and the result cache are.
#[derive(Debug, Clone)]
pub struct Cni {
    pub conf_dir: PathBuf,
    pub bin_dirs: Vec<PathBuf>,
    pub cache_dir: PathBuf,
}

/// What one pod's attachment needs to know.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PodNetwork {
    pub id: String,
    pub netns: PathBuf,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// CNI `runtimeConfig.portMappings` entries.
    pub port_mappings: Vec<Value>,
    /// CNI `runtimeConfig.bandwidth`, from the pod's bandwidth annotations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth: Option<Value>,
    /// CNI `runtimeConfig.dns` (`servers`, `searches`, `options`), from the pod's DNS config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<Value>,
    /// The pod's annotations: `runtimeConfig["io.kubernetes.cri.pod-annotations"]`.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub annotations: std::collections::BTreeMap<String, String>,
    /// The pod's cgroup parent: `runtimeConfig.cgroupPath`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cgroup_path: String,
}

/// What ADD was asked and answered: enough to DEL it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Attachment {
    pub network: NetworkList,
    pub pod: PodNetwork,
    /// The final result of the chain; null until ADD finished.
    pub result: Value,
}

impl Attachment {
    /// The pod's IPs (without prefix length) from the result, IPv4 first.
    pub fn ips(&self) -> Vec<String> {
        result_ips(&self.result)
    }
}

/// The IPs of a CNI result (0.3.0 and later: `ips`; 0.1/0.2: `ip4`/`ip6`), IPv4 first.
pub fn result_ips(r: &Value) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let strip = |s: &str| s.split('/').next().unwrap_or_default().to_string();
    if let Some(ips) = r.get("ips").and_then(Value::as_array) {
        let ifaces = r.get("interfaces").and_then(Value::as_array);
        for ip in ips {
            // Only addresses of an interface inside the pod (one with a sandbox), when the
            // result says which interface an address is on.
            if let (Some(i), Some(ifaces)) = (ip.get("interface").and_then(Value::as_u64), ifaces) {
                let in_pod = usize::try_from(i)
                    .ok()
                    .and_then(|i| ifaces.get(i))
                    .and_then(|f| f.get("sandbox"))
                    .and_then(Value::as_str)
                    .is_some_and(|s| !s.is_empty());
                if !in_pod {
                    continue;
                }
            }
            if let Some(a) = ip.get("address").and_then(Value::as_str) {
                out.push(strip(a));
            }
        }
    } else {
        for k in ["ip4", "ip6"] {
            if let Some(a) = r.get(k).and_then(|x| x.get("ip")).and_then(Value::as_str) {
                out.push(strip(a));
            }
        }
    }
    out.retain(|s| !s.is_empty());
    out.dedup();
    out.sort_by_key(|s| s.contains(':'));
    out
}

/// What a VM guest's `ifname` needs from a CNI result (0.3.0 and later): the addresses of the
/// pod's interface (with their prefixes) and the routes. A route without `gw` goes via the
/// gateway of the pod's first address of its family (as the IPAM plugins install it), or is
/// on-link if there is none; a gateway outside every prefix of the pod (a /32 pod address
/// with a link-local gateway) first gets an on-link route of its own.
pub fn guest_network(
    r: &Value,
    ifname: &str,
) -> (
    Vec<vessel_agent::proto::GuestInterface>,
    Vec<vessel_agent::proto::GuestRoute>,
) {
    use std::net::IpAddr;
    use vessel_agent::proto::{GuestInterface, GuestRoute};
    // A 0.1/0.2 result (`ip4`, `ip6`, each with its address, gateway and routes) read as a
    // later one, as go-cni converts it.
    let legacy;
    let r = if r.get("ips").is_none() && (r.get("ip4").is_some() || r.get("ip6").is_some()) {
        let (mut ips, mut routes) = (Vec::new(), Vec::new());
        for k in ["ip4", "ip6"] {
            let Some(x) = r.get(k) else { continue };
            let mut ip = serde_json::Map::new();
            for (from, to) in [("ip", "address"), ("gateway", "gateway")] {
                if let Some(v) = x.get(from) {
                    ip.insert(to.into(), v.clone());
                }
            }
            ips.push(Value::Object(ip));
            routes.extend(
                x.get("routes")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default(),
            );
        }
        legacy = json!({"ips": ips, "routes": routes});
        &legacy
    } else {
        r
    };
    let ifaces = r.get("interfaces").and_then(Value::as_array);
    let in_pod = |ip: &Value| match (ip.get("interface").and_then(Value::as_u64), ifaces) {
        (Some(i), Some(ifaces)) => usize::try_from(i)
            .ok()
            .and_then(|i| ifaces.get(i))
            .and_then(|f| f.get("sandbox"))
            .and_then(Value::as_str)
            .is_some_and(|s| !s.is_empty()),
        _ => true,
    };
    let parse = |cidr: &str| -> Option<(IpAddr, u8)> {
        let (a, n) = cidr.split_once('/')?;
        Some((a.parse().ok()?, n.parse().ok()?))
    };
    // (address, prefix, gateway) of the pod's interface.
    let mut addrs: Vec<(IpAddr, u8, Option<IpAddr>)> = Vec::new();
    for ip in r.get("ips").and_then(Value::as_array).into_iter().flatten() {
        if !in_pod(ip) {
            continue;
        }
        let Some((a, n)) = ip.get("address").and_then(Value::as_str).and_then(parse) else {
            continue;
        };
        let gw = ip
            .get("gateway")
            .and_then(Value::as_str)
            .and_then(|g| g.parse().ok());
        addrs.push((a, n, gw));
    }
    let covered = |g: &IpAddr| {
        addrs.iter().any(|(a, n, _)| match (a, g) {
            (IpAddr::V4(a), IpAddr::V4(g)) => {
                let m = u32::MAX.checked_shl(32 - u32::from(*n)).unwrap_or(0);
                u32::from(*a) & m == u32::from(*g) & m
            }
            (IpAddr::V6(a), IpAddr::V6(g)) => {
                let m = u128::MAX.checked_shl(128 - u32::from(*n)).unwrap_or(0);
                u128::from(*a) & m == u128::from(*g) & m
            }
            _ => false,
        })
    };
    let mut routes: Vec<GuestRoute> = Vec::new();
    let route = |dst: String, gw: String| GuestRoute {
        destination: dst,
        gateway: gw,
        interface: ifname.to_string(),
    };
    for rt in r
        .get("routes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let Some((dst, len)) = rt.get("dst").and_then(Value::as_str).and_then(parse) else {
            continue;
        };
        let gw: Option<IpAddr> = rt
            .get("gw")
            .and_then(Value::as_str)
            .and_then(|g| g.parse().ok())
            .or_else(|| {
                addrs
                    .iter()
                    .find(|(a, _, g)| a.is_ipv4() == dst.is_ipv4() && g.is_some())
                    .and_then(|(_, _, g)| *g)
            });
        if let Some(g) = gw.filter(|g| !covered(g)) {
            let host = if g.is_ipv4() { 32 } else { 128 };
            let link = route(format!("{g}/{host}"), String::new());
            if !routes.contains(&link) {
                routes.push(link);
            }
        }
        routes.push(route(
            format!("{dst}/{len}"),
            gw.map(|g| g.to_string()).unwrap_or_default(),
        ));
    }
    let interfaces = if addrs.is_empty() {
        Vec::new()
    } else {
        vec![GuestInterface {
            name: ifname.to_string(),
            addresses: addrs.iter().map(|(a, n, _)| format!("{a}/{n}")).collect(),
            ..Default::default()
        }]
    };
    (interfaces, routes)
}

/// A CNI version as (major, minor, patch).
fn version_key(v: &str) -> Option<(u32, u32, u32)> {
    let mut it = v.split('.').map(|p| p.parse::<u32>().ok());
    let k = (it.next()??, it.next()??, it.next().unwrap_or(Some(0))?);
    it.next().is_none().then_some(k)
}

/// CNI versions before 0.4.0 give DEL no `prevResult`.
fn del_has_prev_result(version: &str) -> bool {
    !["0.1.", "0.2.", "0.3."]
        .iter()
        .any(|p| version.starts_with(p))
}

impl Cni {
    /// The node's network config: the first file in `conf_dir`, by name. One that does not
    /// parse is an error, as go-cni makes it, not a reason to take the next: a half-written
    /// config of the node's CNI (its installer rewriting it) must not put pods on a stale
    /// network left behind by another.
    pub fn load(&self) -> Result<NetworkList, CniError> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.conf_dir)
            .map_err(|_| CniError::NoConfig(self.conf_dir.clone()))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.is_file()
                    && p.extension()
                        .is_some_and(|x| x == "conflist" || x == "conf" || x == "json")
            })
            .collect();
        files.sort();
        let Some(f) = files.into_iter().next() else {
            return Err(CniError::NoConfig(self.conf_dir.clone()));
        };
        std::fs::read_to_string(&f)
            .map_err(|e| CniError::BadConfig {
                path: f.clone(),
                message: e.to_string(),
            })
            .and_then(|t| NetworkList::parse(&f, &t))
    }

    fn dirs_text(&self) -> String {
        self.bin_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The plugin binary `name` in the first bin dir that has it.
    pub fn find_plugin(&self, name: &str) -> Option<PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        if name.contains('/') {
            return None;
        }
        self.bin_dirs.iter().map(|d| d.join(name)).find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    }

    /// Whether pods can be networked: a valid config whose plugins all exist.
    pub fn ready(&self) -> Result<NetworkList, CniError> {
        let net = self.load()?;
        for t in net.plugin_types() {
            if self.find_plugin(t).is_none() {
                return Err(CniError::PluginNotFound {
                    plugin: t.to_string(),
                    network: net.name.clone(),
                    dirs: self.dirs_text(),
                });
            }
        }
        Ok(net)
    }

    fn cache_path(&self, pod_id: &str) -> PathBuf {
        self.cache_dir.join(format!("{pod_id}.json"))
    }

    fn save(&self, a: &Attachment) -> Result<(), CniError> {
        let path = self.cache_path(&a.pod.id);
        let cache = |message: String| CniError::Cache {
            path: path.clone(),
            message,
        };
        std::fs::create_dir_all(&self.cache_dir).map_err(|e| cache(e.to_string()))?;
        let data = serde_json::to_vec(a).map_err(|e| cache(e.to_string()))?;
        fsutil::atomic_write_fast(&path, &data).map_err(|e| cache(e.to_string()))
    }

    /// The cached attachment of a pod, if it has one.
    pub fn cached(&self, pod_id: &str) -> Option<Attachment> {
        let path = self.cache_path(pod_id);
        let data = std::fs::read(&path).ok()?;
        match serde_json::from_slice(&data) {
            Ok(a) => Some(a),
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "unreadable CNI cache entry");
                None
            }
        }
    }

    /// Pod ids that have a cache entry.
    pub fn cached_ids(&self) -> Vec<String> {
        std::fs::read_dir(&self.cache_dir)
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| {
                        e.file_name()
                            .to_str()
                            .and_then(|n| n.strip_suffix(".json"))
                            .map(str::to_string)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Drops a pod's cache entry.
    pub fn forget(&self, pod_id: &str) {
        let p = self.cache_path(pod_id);
        if let Err(e) = fsutil::remove_any(&p) {
            tracing::warn!(path = %p.display(), error = %e, "cannot remove CNI cache entry");
        }
    }

    /// Attaches a pod to the node's network. On failure, whatever the chain did is undone
    /// (DEL through every plugin) and the cache entry removed.
    pub async fn add(&self, pod: PodNetwork) -> Result<Attachment, CniError> {
        let t = std::time::Instant::now();
        let r = self.add_chain(pod).await;
        crate::metrics::get().record_cni("ADD", r.is_ok(), t.elapsed());
        r
    }

    async fn add_chain(&self, pod: PodNetwork) -> Result<Attachment, CniError> {
        let network = self.ready()?;
        let mut a = Attachment {
            network,
            pod,
            result: Value::Null,
        };
        // Cached before the first plugin runs: a crash mid-chain is undone by DEL later.
        self.save(&a)?;
        let mut prev: Option<Value> = None;
        for i in 0..a.network.plugins.len() {
            match self.exec(&a, i, "ADD", prev.as_ref()).await {
                Ok(r) => prev = Some(r),
                Err(e) => {
                    // Kept where DEL failed too: the pod's teardown, or the next start's
                    // sweep, asks again (host-local's IP stays taken until one succeeds).
                    match self.del(&a).await {
                        Ok(()) => self.forget(&a.pod.id),
                        Err(d) => {
                            tracing::warn!(pod = %a.pod.id, error = %d, "CNI DEL after a failed ADD failed; its cache entry is kept to try again");
                        }
                    }
                    return Err(e);
                }
            }
        }
        a.result = prev.unwrap_or(Value::Null);
        // A pod without an address is not on the network (containerd refuses it the same
        // way); kubelet would find it without an IP and make it again and again.
        let saved = if result_ips(&a.result).is_empty() {
            Err(CniError::NoAddress {
                pod: a.pod.id.clone(),
                network: a.network.name.clone(),
            })
        } else {
            self.save(&a)
        };
        if let Err(e) = saved {
            match self.del(&a).await {
                Ok(()) => self.forget(&a.pod.id),
                Err(d) => {
                    tracing::warn!(pod = %a.pod.id, error = %d, "CNI DEL after a failed ADD failed; its cache entry is kept to try again");
                }
            }
            return Err(e);
        }
        Ok(a)
    }

    /// Detaches a pod: DEL through the chain in reverse. Every plugin is asked even when one
    /// fails; the first error is returned.
    pub async fn del(&self, a: &Attachment) -> Result<(), CniError> {
        let t = std::time::Instant::now();
        let r = self.del_chain(a).await;
        crate::metrics::get().record_cni("DEL", r.is_ok(), t.elapsed());
        r
    }

    async fn del_chain(&self, a: &Attachment) -> Result<(), CniError> {
        let prev = (!a.result.is_null() && del_has_prev_result(&a.network.cni_version))
            .then_some(&a.result);
        let mut first = None;
        for i in (0..a.network.plugins.len()).rev() {
            if let Err(e) = self.exec(a, i, "DEL", prev).await {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Runs plugin `i` of the attachment's network with `command`.
    async fn exec(
        &self,
        a: &Attachment,
        i: usize,
        command: &'static str,
        prev: Option<&Value>,
    ) -> Result<Value, CniError> {
        let net = &a.network;
        let mut conf = net.plugins[i].clone();
        let plugin = conf
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let fail = |message: String| CniError::Plugin {
            command,
            pod: a.pod.id.clone(),
            plugin: plugin.clone(),
            message,
        };
        let binary = self
            .find_plugin(&plugin)
            .ok_or_else(|| CniError::PluginNotFound {
                plugin: plugin.clone(),
                network: net.name.clone(),
                dirs: self.dirs_text(),
            })?;
        if let Some(o) = conf.as_object_mut() {
            o.insert("name".into(), json!(net.name));
            o.insert("cniVersion".into(), json!(net.cni_version));
            o.remove("prevResult");
            if let Some(p) = prev {
                o.insert("prevResult".into(), p.clone());
            }
            let wants = |cap: &str| {
                o.get("capabilities")
                    .and_then(|c| c.get(cap))
                    .and_then(Value::as_bool)
                    .unwrap_or(false)
            };
            let mut runtime = serde_json::Map::new();
            if wants("portMappings") && !a.pod.port_mappings.is_empty() {
                runtime.insert("portMappings".into(), json!(a.pod.port_mappings));
            }
            if let Some(b) = a.pod.bandwidth.as_ref().filter(|_| wants("bandwidth")) {
                runtime.insert("bandwidth".into(), b.clone());
            }
            // What containerd's and CRI-O's CNI calls carry besides.
            if let Some(d) = a.pod.dns.as_ref().filter(|_| wants("dns")) {
                runtime.insert("dns".into(), d.clone());
            }
            if wants("io.kubernetes.cri.pod-annotations") {
                runtime.insert(
                    "io.kubernetes.cri.pod-annotations".into(),
                    json!(a.pod.annotations),
                );
            }
            if wants("cgroupPath") && !a.pod.cgroup_path.is_empty() {
                runtime.insert("cgroupPath".into(), json!(a.pod.cgroup_path));
            }
            o.remove("runtimeConfig");
            if !runtime.is_empty() {
                o.insert("runtimeConfig".into(), Value::Object(runtime));
            }
        }
        let stdin = serde_json::to_vec(&conf).map_err(|e| fail(e.to_string()))?;
        let path = std::env::join_paths(&self.bin_dirs).map_err(|e| fail(e.to_string()))?;
        let args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}",
            a.pod.namespace, a.pod.name, a.pod.id, a.pod.uid
        );
        // A DEL after the namespace went (unpinned after a failed DEL, or a reboot emptied
        // `/run`) names none, as containerd's does: the spec lets a plugin skip an empty
        // CNI_NETNS, while some (host-device) fail on a path they cannot open, for good.
        let netns = match command {
            "DEL" if !crate::sandbox::netns::is_pinned(&a.pod.netns) => Path::new(""),
            _ => a.pod.netns.as_path(),
        };
        let mut cmd = tokio::process::Command::new(&binary);
        cmd.env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", &a.pod.id)
            .env("CNI_NETNS", netns)
            .env("CNI_IFNAME", IFNAME)
            .env("CNI_PATH", path)
            .env("CNI_ARGS", args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if std::env::var_os("PATH").is_none() {
            // portmap and bridge (ipMasq) run iptables.
            cmd.env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            );
        }
        tracing::debug!(pod = %a.pod.id, plugin = %plugin, command, "running CNI plugin");
        // A plugin being copied in (a CNI DaemonSet's installer) is busy for a moment:
        // tried again, as libcni does, 5 times a second apart.
        let mut tries = 0;
        let mut child = loop {
            match cmd.spawn() {
                Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 5 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                r => break r.map_err(|e| fail(format!("running {}: {e}", binary.display())))?,
            }
        };
        let mut input = child.stdin.take();
        let run = async {
            if let Some(mut s) = input.take() {
                s.write_all(&stdin).await?;
                drop(s);
            }
            child.wait_with_output().await
        };
        let out = match tokio::time::timeout(PLUGIN_TIMEOUT, run).await {
            Ok(r) => r.map_err(|e| fail(format!("running {}: {e}", binary.display())))?,
            Err(_) => {
                return Err(CniError::Timeout {
                    command,
                    pod: a.pod.id.clone(),
                    plugin,
                    timeout: PLUGIN_TIMEOUT,
                })
            }
        };
        let stdout: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        if !out.status.success() {
            let msg = stdout
                .get("msg")
                .and_then(Value::as_str)
                .map(|m| {
                    let details = stdout
                        .get("details")
                        .and_then(Value::as_str)
                        .filter(|d| !d.is_empty())
                        .map(|d| format!(" ({d})"))
                        .unwrap_or_default();
                    let code = stdout.get("code").and_then(Value::as_u64).unwrap_or(0);
                    format!("{m}{details} [code {code}]")
                })
                .unwrap_or_else(|| {
                    format!(
                        "{}: {}{}",
                        out.status,
                        String::from_utf8_lossy(&out.stdout).trim(),
                        String::from_utf8_lossy(&out.stderr).trim()
                    )
                });
            return Err(fail(msg));
        }
        if command == "ADD" && stdout.is_null() {
            return Err(fail(format!(
                "ADD printed no JSON result: {:?}",
                String::from_utf8_lossy(&out.stdout)
            )));
        }
        Ok(stdout)
    }
}

/// The pod's traffic limits (`kubernetes.io/ingress-bandwidth` and `egress-bandwidth`
/// annotations, in bits per second as Kubernetes quantities: `10M`, `1Gi`) as CNI
/// `runtimeConfig.bandwidth`, which a chain with the bandwidth plugin applies, with the
/// burst containerd gives (no limit of its own). Kubernetes' bounds: 1k to 1P.
pub fn bandwidth(
    annotations: &std::collections::HashMap<String, String>,
) -> Result<Option<Value>, String> {
    let mut out = serde_json::Map::new();
    for (key, rate, burst) in [
        (
            "kubernetes.io/ingress-bandwidth",
            "ingressRate",
            "ingressBurst",
        ),
        (
            "kubernetes.io/egress-bandwidth",
            "egressRate",
            "egressBurst",
        ),
    ] {
        let Some(v) = annotations.get(key) else {
            continue;
        };
        let bits =
            quantity(v).ok_or_else(|| format!("annotation {key}: {v:?} is not a quantity"))?;
        if !(1_000..=1_000_000_000_000_000).contains(&bits) {
            return Err(format!(
                "annotation {key}: {v:?} is outside 1k to 1P bits per second"
            ));
        }
        out.insert(rate.into(), json!(bits));
        out.insert(burst.into(), json!(u32::MAX));
    }
    Ok((!out.is_empty()).then_some(Value::Object(out)))
}

/// A Kubernetes quantity as a whole number (`100`, `1.5M`, `10Mi`, `2e3`, `500m` rounds
/// up, as Quantity.Value() does); `None` if it is not one or does not fit.
fn quantity(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    let (mul, div): (u128, u128) = match suffix {
        "" => (1, 1),
        "m" => (1, 1000),
        "k" => (1_000, 1),
        "M" => (1_000_000, 1),
        "G" => (1_000_000_000, 1),
        "T" => (1_000_000_000_000, 1),
        "P" => (1_000_000_000_000_000, 1),
        "E" => (1_000_000_000_000_000_000, 1),
        "Ki" => (1 << 10, 1),
        "Mi" => (1 << 20, 1),
        "Gi" => (1 << 30, 1),
        "Ti" => (1 << 40, 1),
        "Pi" => (1 << 50, 1),
        "Ei" => (1 << 60, 1),
        e if e.starts_with(['e', 'E']) => {
            let exp: u32 = e[1..].parse().ok().filter(|x| *x <= 18)?;
            (10u128.pow(exp), 1)
        }
        _ => return None,
    };
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    if (whole.is_empty() && frac.is_empty()) || frac.len() > 9 {
        return None;
    }
    let scale = 10u128.pow(u32::try_from(frac.len()).ok()?);
    let digits: u128 = format!("{whole}{frac}").parse().ok()?;
    let value = (digits * mul).div_ceil(scale * div);
    u64::try_from(value).ok()
}

/// CRI port mappings as CNI `portMappings` (ports 0 are left out: no host port).
pub fn port_mappings(pm: &[vessel_cri_api::v1::PortMapping]) -> Vec<Value> {
    pm.iter()
        .filter(|p| p.host_port > 0 && p.container_port > 0)
        .map(|p| {
            let proto = match vessel_cri_api::v1::Protocol::try_from(p.protocol) {
                Ok(vessel_cri_api::v1::Protocol::Udp) => "udp",
                Ok(vessel_cri_api::v1::Protocol::Sctp) => "sctp",
                _ => "tcp",
            };
            json!({
                "hostPort": p.host_port,
                "containerPort": p.container_port,
                "protocol": proto,
                "hostIP": p.host_ip,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_network_from_bridge_and_calico_like_results() {
        // bridge + host-local: the default route has no gw; the IP's gateway is used.
        let bridge = serde_json::json!({
            "cniVersion": "1.0.0",
            "interfaces": [{"name": "cni0"}, {"name": "veth1"}, {"name": "eth0", "sandbox": "/run/x"}],
            "ips": [
                {"address": "10.88.0.5/16", "gateway": "10.88.0.1", "interface": 2},
                {"address": "fd00::5/64", "gateway": "fd00::1", "interface": 2},
                {"address": "10.88.0.1/16", "interface": 0}
            ],
            "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]
        });
        let (ifs, routes) = guest_network(&bridge, "eth0");
        assert_eq!(ifs.len(), 1);
        assert_eq!(ifs[0].addresses, ["10.88.0.5/16", "fd00::5/64"]);
        let r: Vec<(&str, &str)> = routes
            .iter()
            .map(|r| (r.destination.as_str(), r.gateway.as_str()))
            .collect();
        assert_eq!(r, [("0.0.0.0/0", "10.88.0.1"), ("::/0", "fd00::1")]);
        // A /32 with a link-local gateway: an on-link route to the gateway comes first.
        let calico = serde_json::json!({
            "ips": [{"address": "192.168.7.9/32"}],
            "routes": [{"dst": "0.0.0.0/0", "gw": "169.254.1.1"}, {"dst": "10.0.0.0/8", "gw": "169.254.1.1"}]
        });
        let (ifs, routes) = guest_network(&calico, "eth0");
        assert_eq!(ifs[0].addresses, ["192.168.7.9/32"]);
        let r: Vec<(&str, &str)> = routes
            .iter()
            .map(|r| (r.destination.as_str(), r.gateway.as_str()))
            .collect();
        assert_eq!(
            r,
            [
                ("169.254.1.1/32", ""),
                ("0.0.0.0/0", "169.254.1.1"),
                ("10.0.0.0/8", "169.254.1.1")
            ]
        );
        assert!(routes.iter().all(|r| r.interface == "eth0"));
        // Nothing usable: loopback only.
        assert_eq!(
            guest_network(&serde_json::json!({}), "eth0"),
            (vec![], vec![])
        );
    }

    #[test]
    fn parses_conflist_and_conf() {
        let l = NetworkList::parse(
            Path::new("a.conflist"),
            r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"},{"type":"portmap","capabilities":{"portMappings":true}}]}"#,
        )
        .unwrap();
        assert_eq!(l.plugin_types().collect::<Vec<_>>(), ["bridge", "portmap"]);
        let c = NetworkList::parse(
            Path::new("b.conf"),
            r#"{"cniVersion":"0.4.0","name":"m","type":"bridge","bridge":"x"}"#,
        )
        .unwrap();
        assert_eq!(c.plugins.len(), 1);
        assert_eq!(c.cni_version, "0.4.0");
        for bad in [
            "[]",
            "{}",
            r#"{"name":"x","plugins":[]}"#,
            r#"{"name":"x","plugins":[{}]}"#,
            r#"{"type":"bridge"}"#,
        ] {
            assert!(NetworkList::parse(Path::new("x"), bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ips_of_results() {
        let r = json!({
            "interfaces": [{"name":"cni0"},{"name":"veth1"},{"name":"eth0","sandbox":"/x"}],
            "ips": [
                {"address":"fd00::5/64","interface":2},
                {"address":"10.88.0.5/24","interface":2,"gateway":"10.88.0.1"},
                {"address":"10.88.0.1/24","interface":0}
            ]
        });
        assert_eq!(result_ips(&r), ["10.88.0.5", "fd00::5"]);
        assert_eq!(
            result_ips(&json!({"ip4":{"ip":"10.1.0.2/16"}})),
            ["10.1.0.2"]
        );
        assert!(result_ips(&Value::Null).is_empty());
    }

    #[test]
    fn missing_conf_dir_and_plugins() {
        let d = tempfile_dir();
        let cni = Cni {
            conf_dir: d.join("none"),
            bin_dirs: vec![d.join("bin")],
            cache_dir: d.join("cache"),
        };
        assert!(matches!(cni.ready(), Err(CniError::NoConfig(_))));
        std::fs::create_dir_all(d.join("none")).unwrap();
        std::fs::write(
            d.join("none/10-x.conflist"),
            r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"nosuchplugin"}]}"#,
        )
        .unwrap();
        let e = cni.ready().unwrap_err().to_string();
        assert!(e.contains("nosuchplugin"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    /// The first config by name decides: one that does not parse is an error, not a reason
    /// to put pods on the next (a stale network) while the node's CNI rewrites it.
    #[test]
    fn an_invalid_first_config_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("10-a.conflist"),
            r#"{"cniVersion":"1.0.0","na"#,
        )
        .unwrap();
        std::fs::write(
            d.path().join("20-b.conflist"),
            r#"{"cniVersion":"1.0.0","name":"b","plugins":[{"type":"bridge"}]}"#,
        )
        .unwrap();
        let cni = Cni {
            conf_dir: d.path().to_path_buf(),
            bin_dirs: vec![],
            cache_dir: d.path().join("cache"),
        };
        let e = cni.load().unwrap_err();
        assert!(
            matches!(&e, CniError::BadConfig { path, .. } if path.ends_with("10-a.conflist")),
            "{e}"
        );
        std::fs::remove_file(d.path().join("10-a.conflist")).unwrap();
        assert_eq!(cni.load().unwrap().name, "b");
        // CNI 1.1: the highest of `cniVersions` we speak, where `cniVersion` is not given.
        let l = NetworkList::parse(
            Path::new("c"),
            r#"{"cniVersions":["0.4.0","1.1.0","1.0.0","2.0.0"],"name":"c","type":"bridge"}"#,
        )
        .unwrap();
        assert_eq!(l.cni_version, "1.1.0");
        // With `cniVersion` among the candidates; a bad entry is a bad config.
        let l = NetworkList::parse(
            Path::new("c"),
            r#"{"cniVersion":"0.4.0","cniVersions":["1.0.0"],"name":"c","type":"bridge"}"#,
        )
        .unwrap();
        assert_eq!(l.cni_version, "1.0.0");
        assert!(NetworkList::parse(
            Path::new("c"),
            r#"{"cniVersions":["1.0.0","x"],"name":"c","type":"bridge"}"#,
        )
        .is_err());
    }

    /// A 0.1/0.2 result (`ip4` with its gateway and routes) configures a VM guest as a later
    /// one does: before, the guest's eth0 got no address while the pod reported one.
    #[test]
    fn a_legacy_result_configures_the_guest() {
        let r = serde_json::json!({
            "cniVersion": "0.2.0",
            "ip4": {"ip": "10.1.0.2/16", "gateway": "10.1.0.1", "routes": [{"dst": "0.0.0.0/0"}]},
            "dns": {}
        });
        let (ifs, routes) = guest_network(&r, "eth0");
        assert_eq!(ifs.len(), 1);
        assert_eq!(ifs[0].addresses, ["10.1.0.2/16"]);
        assert_eq!(routes.len(), 1);
        assert_eq!(
            (routes[0].destination.as_str(), routes[0].gateway.as_str()),
            ("0.0.0.0/0", "10.1.0.1")
        );
    }

    /// ADD waits out a plugin that is being written (ETXTBSY, as libcni does), passes the
    /// runtime config the plugin asks for (DNS, the pod's annotations, its cgroup), and
    /// the version of `cniVersions`; an ADD that gives the pod no address fails and is
    /// undone; a DEL whose namespace is gone names none.
    #[tokio::test]
    async fn add_waits_for_a_busy_plugin_and_passes_its_runtime_config() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let (bin, conf) = (d.path().join("bin"), d.path().join("net.d"));
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(&conf).unwrap();
        let log = d.path().join("log");
        std::fs::create_dir_all(&log).unwrap();
        let plugin = bin.join("fake");
        std::fs::write(
            &plugin,
            format!(
                r#"#!/bin/sh
l={log}
cat > "$l/stdin-$CNI_COMMAND"
printf '%s' "$CNI_NETNS" > "$l/netns-$CNI_COMMAND"
if [ "$CNI_COMMAND" = ADD ] && [ ! -e "$l/noip" ]; then
  echo '{{"cniVersion":"1.1.0","interfaces":[{{"name":"eth0","sandbox":"x"}}],"ips":[{{"address":"10.123.0.5/24","interface":0}}]}}'
elif [ "$CNI_COMMAND" = ADD ]; then
  echo '{{"cniVersion":"1.1.0"}}'
fi
"#,
                log = log.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(
            conf.join("10-n.conflist"),
            r#"{"cniVersions":["1.0.0","1.1.0"],"name":"n","plugins":[{"type":"fake",
                "capabilities":{"dns":true,"io.kubernetes.cri.pod-annotations":true,"cgroupPath":true}}]}"#,
        )
        .unwrap();
        let cni = Cni {
            conf_dir: conf,
            bin_dirs: vec![bin],
            cache_dir: d.path().join("cache"),
        };
        let pod = |id: &str| PodNetwork {
            id: id.into(),
            netns: d.path().join("no-such-netns"),
            namespace: "ns".into(),
            name: "p".into(),
            uid: "u".into(),
            port_mappings: vec![],
            bandwidth: None,
            dns: Some(json!({"servers": ["10.0.0.10"], "searches": ["svc"], "options": []})),
            annotations: [("a".to_string(), "b".to_string())].into(),
            cgroup_path: "/kubepods/pod-u".into(),
        };
        // Held open for writing, as an installer copying it in holds it.
        let w = std::fs::OpenOptions::new()
            .write(true)
            .open(&plugin)
            .unwrap();
        let held = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            drop(w);
        });
        let t = std::time::Instant::now();
        let a = cni.add(pod("p1")).await.unwrap();
        held.join().unwrap();
        assert!(t.elapsed() >= Duration::from_secs(1));
        assert_eq!(a.ips(), ["10.123.0.5"]);
        let stdin: Value =
            serde_json::from_slice(&std::fs::read(log.join("stdin-ADD")).unwrap()).unwrap();
        assert_eq!(stdin["cniVersion"], "1.1.0");
        let rc = &stdin["runtimeConfig"];
        assert_eq!(rc["dns"]["servers"], json!(["10.0.0.10"]), "{stdin}");
        assert_eq!(rc["io.kubernetes.cri.pod-annotations"], json!({"a": "b"}));
        assert_eq!(rc["cgroupPath"], "/kubepods/pod-u");
        // The pod's namespace is not pinned (gone): DEL names none.
        cni.del(&a).await.unwrap();
        assert_eq!(std::fs::read_to_string(log.join("netns-DEL")).unwrap(), "");
        cni.forget("p1");

        std::fs::write(log.join("noip"), "").unwrap();
        std::fs::remove_file(log.join("stdin-DEL")).unwrap();
        let e = cni.add(pod("p2")).await.unwrap_err();
        assert!(matches!(e, CniError::NoAddress { .. }), "{e}");
        assert!(log.join("stdin-DEL").exists(), "the ADD was undone");
        assert!(cni.cached("p2").is_none());
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("vessel-cni-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn quantities_and_bandwidth_annotations() {
        for (q, want) in [
            ("100", Some(100)),
            ("10M", Some(10_000_000)),
            ("1.5k", Some(1_500)),
            ("10Mi", Some(10 << 20)),
            ("2e3", Some(2_000)),
            ("1500m", Some(2)),
            ("", None),
            ("lots", None),
            ("1.2.3", None),
            ("10Q", None),
            ("-5", None),
        ] {
            assert_eq!(quantity(q), want, "{q:?}");
        }
        let ann =
            |k: &str, v: &str| std::collections::HashMap::from([(k.to_string(), v.to_string())]);
        assert_eq!(bandwidth(&Default::default()).unwrap(), None);
        let b = bandwidth(&ann("kubernetes.io/egress-bandwidth", "1G"))
            .unwrap()
            .unwrap();
        assert_eq!(
            b,
            json!({"egressRate": 1_000_000_000u64, "egressBurst": u32::MAX})
        );
        assert!(bandwidth(&ann("kubernetes.io/ingress-bandwidth", "10")).is_err());
        assert!(bandwidth(&ann("kubernetes.io/ingress-bandwidth", "2P")).is_err());
    }

    #[test]
    fn port_mappings_become_cni_entries() {
        let pm = port_mappings(&[
            vessel_cri_api::v1::PortMapping {
                protocol: vessel_cri_api::v1::Protocol::Udp as i32,
                container_port: 53,
                host_port: 5353,
                host_ip: String::new(),
            },
            vessel_cri_api::v1::PortMapping {
                protocol: 0,
                container_port: 80,
                host_port: 0,
                host_ip: String::new(),
            },
        ]);
        assert_eq!(
            pm,
            vec![json!({"hostPort":5353,"containerPort":53,"protocol":"udp","hostIP":""})]
        );
    }
}
