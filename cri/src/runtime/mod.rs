//! Pods and containers: the logic behind the CRI RuntimeService.
//!
//! Each pod has a record (`state::PodRecord`), a sandbox made by its backend
//! (`crate::sandbox`: flat or VM) and a pod agent; each container a record and a snapshot.
//! Reads use the in-memory copy of a record; changes of one object are serialised by its
//! `op` lock and persisted before they are acknowledged. Exits are observed by a watcher task
//! per started container (`WaitContainer` on the agent), so listing never asks the agent.
//! Nothing here knows how a backend does its part.
//!
//! - [`pod`]: RunPodSandbox, StopPodSandbox, RemovePodSandbox, status and list.
//! - [`container`]: container lifecycle and resources.
//! - [`exec`]: ExecSync, Exec, Attach, ReopenContainerLog.
//! - [`stats`]: container and pod stats.
//! - [`watch`]: exit and death watchers.
//! - [`recover`]: rebuilding state at start.
//! - [`translate`]: records to CRI messages.

mod checkpoint;
mod container;
pub mod cri_metrics;
mod events;
mod exec;
mod pod;
mod recover;
mod restore;
mod stats;
mod translate;
mod watch;

#[cfg(test)]
mod double_tests;

pub use crate::errors::RuntimeError;
pub use crate::sandbox::{VmSupport, HANDLERS};
pub use exec::ExecChannels;

use crate::errors::{internal, Result};
use crate::sandbox::{flat::FlatBackend, vm::VmBackend, Pod, SandboxBackend};
use crate::state::{BackendKind, ContainerRecord, PodRecord, StateDirs};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use vessel_agent::proto as ap;
use vessel_cri_api::v1 as cri;
use vessel_images::ImageStore;

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
    /// The node's CNI plugins, for pods with their own network namespace.
    pub cni: crate::cni::Cni,
    /// How pod cgroups are made (`runtime.cgroup_driver`).
    pub cgroups: crate::sandbox::cgroup::Driver,
    /// Where CDI device specs are looked up (`runtime.cdi_spec_dirs`).
    pub cdi_spec_dirs: Vec<PathBuf>,
    /// CheckpointContainer and restores (`runtime.enable_criu_support`).
    pub criu: bool,
    /// The image's declared volumes are not made (`runtime.ignore_image_defined_volumes`).
    pub ignore_image_defined_volumes: bool,
}

/// A container in memory: its record and the lock that orders its operations.
pub struct Ctr {
    rec: RwLock<ContainerRecord>,
    op: tokio::sync::Mutex<()>,
    /// Orders the record's writes to disk, which are not all made under `op` (a watcher
    /// records an exit, a lost pod marks its containers); true once the record is deleted,
    /// so that such a late write cannot bring a removed container back.
    disk: Mutex<bool>,
    /// The CPU figure of the container's last stats, for the next one's rate.
    cpu: Mutex<Option<CpuSample>>,
    /// A stop with a grace period has sent the stop signal: another stop does not send it
    /// again (some programs take a second SIGTERM or SIGINT as "quit now"), as containerd's.
    stop_signalled: std::sync::atomic::AtomicBool,
    /// StopContainer calls under way (a checkpoint is refused meanwhile).
    stopping: std::sync::atomic::AtomicUsize,
}

/// Counts a StopContainer under way in its container's `stopping` while it lives.
struct Stopping<'a>(&'a Ctr);

impl<'a> Stopping<'a> {
    fn new(ctr: &'a Ctr) -> Self {
        ctr.stopping
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Stopping(ctr)
    }
}

impl Drop for Stopping<'_> {
    fn drop(&mut self) {
        self.0
            .stopping
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A container's cumulative CPU time at a moment, and the rate worked out then.
#[derive(Clone, Copy)]
struct CpuSample {
    at_ns: i64,
    usage_ns: u64,
    nano_cores: Option<u64>,
}

impl CpuSample {
    /// The sample to keep after stats at `at_ns` read `usage_ns`; its `nano_cores` is CRI's
    /// `usage_nano_cores` for them: the container's CPU use since its previous stats (from
    /// whichever client asked), in billionths of a core, as containerd works it out. None at
    /// the first stats or when the counter went back (a restarted container). Stats within
    /// 100 ms of the last sample keep it and its rate (too short a window to measure).
    fn next(prev: Option<CpuSample>, at_ns: i64, usage_ns: u64) -> CpuSample {
        // A reading older than the kept one (two callers' stats crossed on their way back):
        // the newer stays, with its rate.
        if let Some(p) = prev {
            if at_ns <= p.at_ns && usage_ns <= p.usage_ns {
                return p;
            }
        }
        let dt = prev.and_then(|p| u64::try_from(at_ns.checked_sub(p.at_ns)?).ok());
        if let (Some(p), Some(dt)) = (prev, dt) {
            if dt < 100_000_000 && usage_ns >= p.usage_ns {
                return p;
            }
        }
        let nano_cores = prev.zip(dt).and_then(|(p, dt)| {
            let used = u128::from(usage_ns.checked_sub(p.usage_ns)?);
            u64::try_from(used * 1_000_000_000 / u128::from(dt)).ok()
        });
        CpuSample {
            at_ns,
            usage_ns,
            nano_cores,
        }
    }
}

impl Ctr {
    fn new(rec: ContainerRecord) -> Ctr {
        Ctr {
            rec: RwLock::new(rec),
            op: tokio::sync::Mutex::new(()),
            disk: Mutex::new(false),
            cpu: Mutex::new(None),
            stop_signalled: std::sync::atomic::AtomicBool::new(false),
            stopping: std::sync::atomic::AtomicUsize::new(0),
        }
    }
    /// CRI's `usage_nano_cores` of stats taken now (see [`CpuSample::next`]). A usage of 0
    /// is no reading (no cpuacct, a failed read): no rate, and the kept sample stays.
    fn nano_cores(&self, at_ns: i64, usage_ns: u64) -> Option<u64> {
        if usage_ns == 0 {
            return None;
        }
        let mut last = self.cpu.lock().unwrap_or_else(|p| p.into_inner());
        let next = CpuSample::next(*last, at_ns, usage_ns);
        *last = Some(next);
        next.nano_cores
    }
    /// Writes the record as it is now (so writes that race land newest last); nothing once
    /// the container is removed (false: then its changes are not to be announced either).
    fn persist(&self, dirs: &StateDirs) -> std::result::Result<bool, crate::state::StateError> {
        let removed = self.disk.lock().unwrap_or_else(|p| p.into_inner());
        if *removed {
            return Ok(false);
        }
        dirs.save_container(&self.record()).map(|()| true)
    }
    /// Deletes the record from disk for good: later [`Ctr::persist`] calls write nothing.
    /// A delete that fails leaves the record to be written on (and deleted at the retry).
    fn delete(&self, dirs: &StateDirs) -> std::result::Result<(), crate::state::StateError> {
        let mut removed = self.disk.lock().unwrap_or_else(|p| p.into_inner());
        dirs.delete_container(&self.record().id)?;
        *removed = true;
        Ok(())
    }
    pub fn record(&self) -> ContainerRecord {
        self.rec.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn update(&self, f: impl FnOnce(&mut ContainerRecord)) -> ContainerRecord {
        let mut g = self.rec.write().unwrap_or_else(|p| p.into_inner());
        f(&mut g);
        g.clone()
    }
}

/// The two sandbox backends a runtime dispatches to.
pub struct Backends {
    pub flat: Arc<dyn SandboxBackend>,
    pub vm: Arc<dyn SandboxBackend>,
}

pub struct Runtime {
    opts: RuntimeOptions,
    dirs: StateDirs,
    store: Arc<ImageStore>,
    backends: Backends,
    pods: Mutex<HashMap<String, Arc<Pod>>>,
    ctrs: Mutex<HashMap<String, Arc<Ctr>>>,
    /// Reserved names (pod and container name keys) -> id.
    names: Mutex<HashMap<String, String>>,
    /// The pod CIDR kubelet announced with UpdateRuntimeConfig.
    pod_cidr: Mutex<String>,
    /// Records found unreadable (and moved aside) at start, for Status.
    quarantined: Mutex<Vec<PathBuf>>,
    /// Container lifecycle events, for GetContainerEvents subscribers.
    events: tokio::sync::broadcast::Sender<cri::ContainerEventResponse>,
    /// Set at shutdown: event streams end.
    shutting_down: tokio::sync::watch::Sender<bool>,
}

/// A request's config and the metadata in it, both of which CRI requires: InvalidArgument
/// (`{rpc}: no config`, `{rpc}: config has no metadata`) where one is missing.
fn config_with_metadata<C, M: Clone>(
    rpc: &str,
    config: Option<C>,
    metadata: impl FnOnce(&C) -> Option<&M>,
) -> Result<(C, M)> {
    let missing = |what: &str| RuntimeError::InvalidArgument(format!("{rpc}: {what}"));
    let config = config.ok_or_else(|| missing("no config"))?;
    let meta = metadata(&config)
        .cloned()
        .ok_or_else(|| missing("config has no metadata"))?;
    Ok((config, meta))
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

/// The records of `objects` (the runtime's pods or containers) as they are now, read under
/// one lock.
fn records<T, R>(
    objects: &Mutex<HashMap<String, Arc<T>>>,
    record: impl Fn(&T) -> R,
) -> impl Iterator<Item = R> {
    let records: Vec<R> = objects
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .values()
        .map(|o| record(o))
        .collect();
    records.into_iter()
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
    /// Removes snapshots `ids` on a path that is already failing or cleaning up: one that
    /// cannot be removed now is left to the next start's sweep of snapshots without a
    /// container.
    fn discard_snapshots<'a>(&self, ids: impl IntoIterator<Item = &'a String>) {
        for s in ids {
            let _ = self.store.remove_snapshot(s);
        }
    }

    pub async fn open(opts: RuntimeOptions, store: Arc<ImageStore>) -> Result<Arc<Runtime>> {
        let dirs = StateDirs::new(&opts.root_dir, &opts.state_dir).map_err(internal("state"))?;
        let backends = Backends {
            flat: Arc::new(FlatBackend {
                agent_binary: opts.agent_binary.clone(),
                log_level: opts.log_level.clone(),
                dirs: dirs.clone(),
                cni: opts.cni.clone(),
            }),
            vm: Arc::new(VmBackend {
                shim_binary: opts.shim_binary.clone(),
                cfg: opts.vm_cfg.clone(),
                guest_root: opts.guest_root.clone(),
                log_level: opts.log_level.clone(),
                dirs: dirs.clone(),
                store: store.clone(),
                cni: opts.cni.clone(),
            }),
        };
        Self::with_backends(opts, dirs, store, backends).await
    }

    /// A runtime over given backends (tests use doubles), after recovering the state in
    /// `dirs`.
    pub async fn with_backends(
        opts: RuntimeOptions,
        dirs: StateDirs,
        store: Arc<ImageStore>,
        backends: Backends,
    ) -> Result<Arc<Runtime>> {
        let rt = Arc::new(Runtime {
            opts,
            dirs,
            store,
            backends,
            pods: Mutex::default(),
            ctrs: Mutex::default(),
            names: Mutex::default(),
            pod_cidr: Mutex::default(),
            quarantined: Mutex::default(),
            events: tokio::sync::broadcast::channel(events::EVENT_BACKLOG).0,
            shutting_down: tokio::sync::watch::channel(false).0,
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

    /// Pods and containers by (state, backend), for the metrics endpoint.
    pub fn counts(&self) -> (crate::metrics::StateCounts, crate::metrics::StateCounts) {
        use std::collections::BTreeMap;
        let mut pods: BTreeMap<(String, String), i64> = BTreeMap::new();
        let mut backends: HashMap<String, &'static str> = HashMap::new();
        for r in records(&self.pods, Pod::record) {
            let backend = r.backend.kind().as_str();
            backends.insert(r.id.clone(), backend);
            let state = format!("{:?}", r.state).to_ascii_lowercase();
            *pods.entry((state, backend.into())).or_default() += 1;
        }
        let mut ctrs: BTreeMap<(String, String), i64> = BTreeMap::new();
        for r in records(&self.ctrs, Ctr::record) {
            let backend = backends.get(&r.pod_id).copied().unwrap_or("unknown");
            let state = format!("{:?}", r.state).to_ascii_lowercase();
            *ctrs.entry((state, backend.into())).or_default() += 1;
        }
        let flat = |m: BTreeMap<(String, String), i64>| {
            m.into_iter().map(|((s, b), n)| (s, b, n)).collect()
        };
        (flat(pods), flat(ctrs))
    }

    pub fn cni(&self) -> &crate::cni::Cni {
        &self.opts.cni
    }

    /// The cgroup driver in use (`RuntimeConfig`).
    pub fn cgroup_driver(&self) -> &crate::sandbox::cgroup::Driver {
        &self.opts.cgroups
    }

    pub fn vm_support(&self) -> &VmSupport {
        &self.opts.vm
    }

    /// Whether pods of runtime `handler` can have their own user namespace: VM pods always;
    /// flat pods where every host id can reach the state dir's `userns` (their containers'
    /// roots are under it).
    pub fn handler_has_userns(&self, handler: &str) -> bool {
        match self.admission().handler_backend(handler) {
            Some(BackendKind::Vm) => true,
            Some(BackendKind::Flat) => self.dirs.userns_root_reachable(),
            None => false,
        }
    }

    /// The node's policy for choosing a pod's backend.
    fn admission(&self) -> crate::sandbox::Admission<'_> {
        crate::sandbox::Admission {
            default_handler: &self.opts.default_handler,
            vm: &self.opts.vm,
            host_namespaces: self.opts.vm_cfg.host_namespaces,
        }
    }

    /// The backend of a pod (by its record).
    fn backend(&self, rec: &PodRecord) -> &dyn SandboxBackend {
        self.backend_of(rec.backend.kind())
    }

    fn backend_of(&self, kind: BackendKind) -> &dyn SandboxBackend {
        self.shared_backend(kind).as_ref()
    }

    /// The backend of `kind`, for work that outlives the call (a task of its own).
    fn shared_backend(&self, kind: BackendKind) -> &Arc<dyn SandboxBackend> {
        match kind {
            BackendKind::Flat => &self.backends.flat,
            BackendKind::Vm => &self.backends.vm,
        }
    }

    /// A pod object for a record, with its backend's agent address.
    fn pod_object(&self, rec: PodRecord) -> Arc<Pod> {
        let addr = self.backend(&rec).agent_addr(&rec);
        Arc::new(Pod::new(rec, addr))
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_rate_between_two_stats() {
        const S: i64 = 1_000_000_000;
        let first = CpuSample::next(None, 10 * S, 5_000_000);
        assert_eq!(first.nano_cores, None);
        // Half a core over two seconds.
        let second = CpuSample::next(Some(first), 12 * S, 1_005_000_000);
        assert_eq!(second.nano_cores, Some(500_000_000));
        // Asked again 50 ms later: the same sample, the same rate.
        let again = CpuSample::next(Some(second), 12 * S + 50_000_000, 1_006_000_000);
        assert_eq!((again.at_ns, again.nano_cores), (12 * S, Some(500_000_000)));
        // The counter went back (the container restarted), or the clock did: no rate.
        assert_eq!(CpuSample::next(Some(second), 13 * S, 1).nano_cores, None);
        assert_eq!(
            CpuSample::next(Some(second), 11 * S, 2_000_000_000).nano_cores,
            None
        );
        // An older reading that arrives after a newer one leaves the newer and its rate.
        let crossed = CpuSample::next(Some(second), 11 * S, 900_000_000);
        assert_eq!(
            (crossed.at_ns, crossed.nano_cores),
            (12 * S, Some(500_000_000))
        );
    }

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
}
