//! Pod and container records on disk.
//!
//! ```text
//! <root>/pods/<pod-id>/pod.json              PodRecord
//! <root>/pods/<pod-id>/{hostname,hosts,resolv.conf}   files bind-mounted into containers
//! <root>/pods/<pod-id>/agent.log             the pod agent's own log
//! <root>/containers/<ctr-id>.json            ContainerRecord
//! ```
//! Every record is written atomically (temp file, fsync, rename): a crash of vesseld at any
//! point leaves the old record or the new one, never half of one. The directory is not
//! synced (it cost a journal commit per operation): after a power loss a rename may be rolled
//! back, and the next start reconciles what it finds with the pod agents and sweeps what no
//! record owns (netns pins, CNI cache entries, snapshots, scopes). A record is written in
//! state `Creating` before anything is created for it, so that a crash at any point leaves
//! a record the next start can finish cleaning up.

use serde::{Deserialize, Serialize};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use vessel_cri_api::v1 as cri;
use vessel_images::fsutil;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PodState {
    /// Being set up; a crash here means "clean everything up".
    Creating,
    Ready,
    NotReady,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PodRecord {
    pub id: String,
    pub name_key: String,
    pub config: cri::PodSandboxConfig,
    pub runtime_handler: String,
    /// The sandbox backend and its state. On disk as `"backend": "flat"` or
    /// `"backend": "vm", "vm": {...}`, the form records have always had.
    #[serde(flatten)]
    pub backend: BackendState,
    pub state: PodState,
    pub created_at: i64,
    /// Host pid of the pod agent, and its start time (clock ticks since boot, from
    /// /proc/<pid>/stat), which tells our agent from a later process that reused the pid.
    pub agent_pid: u32,
    pub agent_start_time: u64,
    pub agent_socket: PathBuf,
    pub agent_state_dir: PathBuf,
    /// The pinned netns (empty for host-network pods).
    pub netns_path: PathBuf,
    pub hostname: String,
    /// cgroupfs parent of the pod's containers, e.g. /kubepods/pod<uid> or /vessel/<id>; with
    /// the systemd driver, the pod scope's path
    /// (`/kubepods.slice/.../kubepods-pod<uid>.slice/vessel-pod-<id>.scope`).
    pub cgroup_parent: String,
    /// The pod's systemd scope unit (systemd cgroup driver; empty with cgroupfs).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cgroup_unit: String,
    /// Why the pod is not ready, when it is not.
    #[serde(default)]
    pub reason: String,
    /// The pod's IPs from CNI, IPv4 first (empty without CNI).
    #[serde(default)]
    pub ips: Vec<String>,
    /// A StopPodSandbox began and has not finished: the pod is reported not ready, and a
    /// vesseld that starts and finds this finishes the stop.
    #[serde(default)]
    pub stopping: bool,
    /// The pod's containers that share its IPC namespace share one /dev/shm, which its
    /// agent keeps (pods started by earlier vesselds, whose agents do not: false, each
    /// container its own).
    #[serde(default)]
    pub shared_shm: bool,
    /// The pod's shared pid namespace has a holder as its PID 1, not the agent (pods started
    /// by earlier vesselds, whose agents do not: false).
    #[serde(default)]
    pub pid_holder: bool,
}

impl PodRecord {
    /// Whether CRI sees the pod ready: Ready, and no stop under way.
    pub fn is_ready(&self) -> bool {
        self.state == PodState::Ready && !self.stopping
    }
}

/// Which sandbox backend a pod has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendKind {
    Flat,
    Vm,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Flat => "flat",
            BackendKind::Vm => "vm",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A pod's backend with what only that backend keeps.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "backend")]
pub enum BackendState {
    #[serde(rename = "flat")]
    Flat {},
    /// The microVM of a VM pod.
    #[serde(rename = "vm")]
    Vm { vm: VmPodState },
}

impl BackendState {
    pub fn kind(&self) -> BackendKind {
        match self {
            BackendState::Flat {} => BackendKind::Flat,
            BackendState::Vm { .. } => BackendKind::Vm,
        }
    }
}

/// A VM pod's host side: its shim process, sockets and disk slots.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct VmPodState {
    /// `<run>/vms/<32 hex>`: spec.json, the sockets, console.log, shim.log.
    /// The shim's pid and start time are the record's `agent_pid` and `agent_start_time`:
    /// the pod's host process.
    pub dir: PathBuf,
    pub vsock: PathBuf,
    pub control: PathBuf,
    pub vcpus: u8,
    pub mem_mib: u64,
    /// The layer (diff ID) each spare disk slot holds; empty for an empty slot.
    pub slots: Vec<String>,
    /// The secret the guest agent presents first on every connection to the shim's log port
    /// (the shim drops any other), so that no other guest process can write into a
    /// container's log. Empty in records of earlier versions: their shims ask for none.
    #[serde(default)]
    pub log_token: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ContainerState {
    Creating,
    Created,
    Running,
    Exited,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContainerRecord {
    pub id: String,
    pub pod_id: String,
    pub name_key: String,
    pub config: cri::ContainerConfig,
    /// The image as the request named it, and the image ID it resolved to.
    pub image_name: String,
    pub image_id: String,
    /// What ContainerStatus reports as image_ref: a repo digest if the image has one.
    pub image_ref: String,
    pub log_path: String,
    pub state: ContainerState,
    pub created_at: i64,
    pub started_at: i64,
    pub finished_at: i64,
    pub exit_code: i32,
    pub reason: String,
    pub message: String,
    /// Pid in the pod agent's pid namespace, while running.
    pub pid: u32,
    /// The uid/gid/groups the process runs as (for ContainerStatus.user).
    pub uid: u32,
    pub gid: u32,
    #[serde(default)]
    pub groups: Vec<u32>,
    /// The signal StopContainer sends first.
    pub stop_signal: i32,
    pub snapshot: String,
    /// Diff IDs of the image's layers, bottom first (VM pods attach them as disks).
    #[serde(default)]
    pub layers: Vec<String>,
    /// Snapshots mounted read-only for the container's image volumes (CRI `Mount.image`),
    /// removed with the container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_snapshots: Vec<String>,
    /// The OCI runtime spec the container was created with (its resources as
    /// UpdateContainerResources last set them), shown by a verbose ContainerStatus as
    /// `info.runtimeSpec`, where containerd and CRI-O show theirs. The JSON text as the agent
    /// got it, shared and not parsed again; records written before it have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<std::sync::Arc<serde_json::value::RawValue>>,
}

impl ContainerRecord {
    /// A running container's record with empty names and no layers, for tests.
    #[cfg(test)]
    pub fn for_test(id: &str, pod_id: &str) -> ContainerRecord {
        ContainerRecord {
            id: id.into(),
            pod_id: pod_id.into(),
            name_key: "k".into(),
            config: Default::default(),
            image_name: String::new(),
            image_id: String::new(),
            image_ref: String::new(),
            log_path: String::new(),
            state: ContainerState::Running,
            created_at: 1,
            started_at: 2,
            finished_at: 0,
            exit_code: 0,
            reason: String::new(),
            message: String::new(),
            pid: 7,
            uid: 0,
            gid: 0,
            groups: Vec::new(),
            stop_signal: 15,
            snapshot: id.into(),
            layers: Vec::new(),
            volume_snapshots: Vec::new(),
            spec: None,
        }
    }

    /// Every snapshot the container owns: its root filesystem and its image volumes.
    pub fn snapshots(&self) -> impl Iterator<Item = &String> {
        std::iter::once(&self.snapshot).chain(&self.volume_snapshots)
    }
}

/// Where records live, and their atomic reads and writes.
#[derive(Debug, Clone)]
pub struct StateDirs {
    pub root: PathBuf,
    pub run: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Io(#[from] crate::errors::IoAt),
    #[error("record {path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StateError {
    crate::errors::io_at(op, path)
}

impl StateDirs {
    pub fn new(root: &Path, run: &Path) -> Result<StateDirs, StateError> {
        let s = StateDirs {
            root: root.to_path_buf(),
            run: run.to_path_buf(),
        };
        // Records hold the containers' environment; the run dirs hold agent sockets, shim
        // sockets and pinned netns: root only, whatever the parent allows.
        for d in [
            s.pods_dir(),
            s.containers_dir(),
            s.checkpoints_dir(),
            s.run.join("pods"),
            s.netns_dir(),
            s.run.join("vms"),
            s.run.join("agents"),
        ] {
            fs::create_dir_all(&d).map_err(io("create", &d))?;
            fs::set_permissions(&d, fs::Permissions::from_mode(0o700)).map_err(io("chmod", &d))?;
        }
        // Where the agent of a pod with its own user namespace mounts, in its own mount
        // namespace, the tmpfs that holds its containers' roots and bind mounts: a container's
        // root (an unprivileged host id) must be able to reach them. Empty on the host.
        let u = s.userns_root();
        fs::create_dir_all(&u).map_err(io("create", &u))?;
        fs::set_permissions(&u, fs::Permissions::from_mode(0o711)).map_err(io("chmod", &u))?;
        if !s.userns_root_reachable() {
            tracing::warn!(dir = %u.display(), "a directory above it is not traversable by other users: flat pods cannot have user namespaces (Status does not advertise them for flat pods)");
        }
        for d in [s.pods_dir(), s.containers_dir()] {
            fsutil::clean_dead_temps(&d).map_err(io("clean", &d))?;
        }
        // A dump a dead vesseld staged: best effort, as an agent's CRIU may still be writing.
        let c = s.checkpoints_dir();
        if let Err(e) = fsutil::clean_dead_temps(&c) {
            tracing::warn!(dir = %c.display(), error = %e, "cannot clear checkpoint staging left by an earlier vesseld");
        }
        Ok(s)
    }

    pub fn pods_dir(&self) -> PathBuf {
        self.root.join("pods")
    }
    pub fn containers_dir(&self) -> PathBuf {
        self.root.join("containers")
    }
    pub fn netns_dir(&self) -> PathBuf {
        self.run.join("netns")
    }
    /// Where CheckpointContainer stages CRIU's images before archiving them.
    pub fn checkpoints_dir(&self) -> PathBuf {
        self.root.join("checkpoints")
    }
    pub fn pod_dir(&self, id: &str) -> PathBuf {
        self.pods_dir().join(id)
    }
    /// The agent socket of a pod: short, because a Unix socket path has at most 107 bytes.
    pub fn agent_socket(&self, id: &str) -> PathBuf {
        self.run
            .join("agents")
            .join(format!("{}.sock", &id[..id.len().min(32)]))
    }

    /// The files of a VM pod's shim: short, for the Unix socket path limit.
    pub fn vm_dir(&self, id: &str) -> PathBuf {
        self.run.join("vms").join(&id[..id.len().min(32)])
    }

    /// Whether every host id can reach [`StateDirs::userns_root`] (each directory above it
    /// traversable by others), as a flat pod's user-namespaced containers must.
    pub fn userns_root_reachable(&self) -> bool {
        use std::os::unix::fs::PermissionsExt;
        let root = self.userns_root();
        root.ancestors()
            .all(|d| fs::metadata(d).is_ok_and(|m| m.permissions().mode() & 0o001 != 0))
    }
    /// See [`StateDirs::new`]: the mount point of user-namespaced pods' container dirs.
    pub fn userns_root(&self) -> PathBuf {
        self.run.join("userns")
    }
    /// Runtime files of a pod (agent state), cleared by a reboot.
    pub fn pod_run_dir(&self, id: &str) -> PathBuf {
        self.run.join("pods").join(id)
    }

    fn write<T: Serialize>(path: &Path, v: &T) -> Result<(), StateError> {
        let data = serde_json::to_vec(v).map_err(|source| StateError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        // Write, fsync, rename: a record is never half written. The directory is not synced:
        // a record a crash rolls back is reconciled with the pod agents at the next start.
        fsutil::atomic_write_fast(path, &data).map_err(io("write", path))
    }

    fn read_all<T: for<'de> Deserialize<'de>>(files: Vec<PathBuf>) -> Vec<T> {
        let mut out = Vec::new();
        for p in files {
            let err = match fs::read(&p) {
                Ok(d) => match serde_json::from_slice(&d) {
                    Ok(r) => {
                        out.push(r);
                        continue;
                    }
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            };
            // Kept, moved aside: the next start does not trip over it again, an operator can
            // look at it, and what it described (snapshot, pins, VM files) is not deleted.
            let q = quarantined(&p);
            match fs::rename(&p, &q) {
                Ok(()) => {
                    tracing::error!(path = %p.display(), quarantined = %q.display(), error = %err, "unreadable record moved aside; its pod's or container's data is kept")
                }
                Err(e) => {
                    tracing::error!(path = %p.display(), error = %err, rename_error = %e, "unreadable record, ignored")
                }
            }
        }
        out
    }

    /// Records that could not be read and were moved aside (`*.quarantined`), pods' first.
    pub fn quarantined(&self) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = fs::read_dir(self.pods_dir())
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path().join(format!("pod.json.{QUARANTINE_EXT}")))
                    .filter(|p| p.exists())
                    .collect()
            })
            .unwrap_or_default();
        if let Ok(rd) = fs::read_dir(self.containers_dir()) {
            out.extend(
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == QUARANTINE_EXT)),
            );
        }
        out
    }

    pub fn save_pod(&self, p: &PodRecord) -> Result<(), StateError> {
        let dir = self.pod_dir(&p.id);
        fs::create_dir_all(&dir).map_err(io("create", &dir))?;
        Self::write(&dir.join("pod.json"), p)
    }

    /// Removes a pod's files, its record last: a crash part way leaves the record, and the
    /// pod with it, for the next RemovePodSandbox to finish.
    pub fn delete_pod(&self, id: &str) -> Result<(), StateError> {
        let run = self.pod_run_dir(id);
        fsutil::remove_any(&run).map_err(io("remove", &run))?;
        let vm = self.vm_dir(id);
        fsutil::remove_any(&vm).map_err(io("remove", &vm))?;
        let sock = self.agent_socket(id);
        fsutil::remove_any(&sock).map_err(io("remove", &sock))?;
        let dir = self.pod_dir(id);
        fsutil::remove_any(&dir).map_err(io("remove", &dir))
    }

    pub fn load_pods(&self) -> Vec<PodRecord> {
        let files = fs::read_dir(self.pods_dir())
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path().join("pod.json"))
                    .filter(|p| p.exists())
                    .collect()
            })
            .unwrap_or_default();
        Self::read_all(files)
    }

    /// Pod directories that have no record (debris of a crash before the first write; a dir
    /// whose record was quarantined is not one), and runtime directories of pods that have no
    /// directory.
    pub fn orphan_pod_dirs(&self) -> Vec<PathBuf> {
        let dirs = |d: PathBuf| -> Vec<PathBuf> {
            fs::read_dir(d)
                .map(|rd| {
                    rd.flatten()
                        .map(|e| e.path())
                        .filter(|p| p.is_dir())
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut out: Vec<PathBuf> = dirs(self.pods_dir())
            .into_iter()
            .filter(|p| {
                !p.join("pod.json").exists()
                    && !p.join(format!("pod.json.{QUARANTINE_EXT}")).exists()
            })
            .collect();
        // Runtime files of a pod with no directory of its own left (a removal that an older
        // version left half done).
        out.extend(dirs(self.run.join("pods")).into_iter().filter(|p| {
            p.file_name()
                .is_none_or(|id| !self.pods_dir().join(id).exists())
        }));
        out
    }

    pub fn save_container(&self, c: &ContainerRecord) -> Result<(), StateError> {
        Self::write(&self.containers_dir().join(format!("{}.json", c.id)), c)
    }

    pub fn delete_container(&self, id: &str) -> Result<(), StateError> {
        let p = self.containers_dir().join(format!("{id}.json"));
        fsutil::remove_any(&p).map_err(io("remove", &p))?;
        fsutil::sync_dir(&self.containers_dir()).map_err(io("fsync", &self.containers_dir()))
    }

    pub fn load_containers(&self) -> Vec<ContainerRecord> {
        let files = fs::read_dir(self.containers_dir())
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "json"))
                    .collect()
            })
            .unwrap_or_default();
        Self::read_all(files)
    }
}

/// The extension an unreadable record gets when it is moved aside.
pub const QUARANTINE_EXT: &str = "quarantined";
/// The name key of a stand-in for a pod whose record could not be read (then its id).
pub const UNREADABLE_POD_KEY: &str = "unreadable/";
/// The label such a stand-in carries.
pub const UNREADABLE_LABEL: &str = "vessel.dev/unreadable-record";

/// The pod or container id a quarantined record (from [`StateDirs::quarantined`]) was for.
pub fn quarantined_id(p: &Path) -> Option<String> {
    quarantined_pod_id(p).or_else(|| {
        p.file_name()?
            .to_str()?
            .strip_suffix(&format!(".json.{QUARANTINE_EXT}"))
            .map(str::to_string)
    })
}

/// The pod id of a quarantined pod record (`pods/<id>/pod.json.quarantined`); None for a
/// container's.
pub fn quarantined_pod_id(p: &Path) -> Option<String> {
    if p.file_name()? == format!("pod.json.{QUARANTINE_EXT}").as_str() {
        p.parent()?.file_name()?.to_str().map(str::to_string)
    } else {
        None
    }
}

fn quarantined(p: &Path) -> PathBuf {
    let mut name = p.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{QUARANTINE_EXT}"));
    p.with_file_name(name)
}

/// A new random 64-hex-digit id, as containerd makes them.
pub fn new_id() -> String {
    let mut b = [0u8; 32];
    if let Err(e) = rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()) {
        tracing::warn!(error = %e, "getrandom failed; falling back to time-based id");
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let s = format!("{t:032x}{:08x}", std::process::id());
        return format!("{:0<64}", s)[..64].to_string();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Unix nanoseconds now.
pub fn now_nanos() -> i64 {
    chrono::Utc::now().timestamp_nanos_opt().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(backend: BackendState) -> PodRecord {
        PodRecord {
            id: "p1".into(),
            name_key: "k".into(),
            config: cri::PodSandboxConfig::default(),
            runtime_handler: String::new(),
            backend,
            state: PodState::Ready,
            created_at: 1,
            agent_pid: 2,
            agent_start_time: 3,
            agent_socket: "/run/a.sock".into(),
            agent_state_dir: "/run/a".into(),
            netns_path: PathBuf::new(),
            hostname: "h".into(),
            cgroup_parent: "/vessel/p1".into(),
            cgroup_unit: String::new(),
            reason: String::new(),
            ips: vec![],
            stopping: false,
            shared_shm: true,
            pid_holder: true,
        }
    }

    #[test]
    fn a_removal_cut_short_leaves_the_record_or_nothing_of_the_pod() {
        let t = tempfile::tempdir().unwrap();
        let dirs = StateDirs::new(&t.path().join("root"), &t.path().join("run")).unwrap();
        let rec = record(BackendState::Flat {});
        dirs.save_pod(&rec).unwrap();
        fs::create_dir_all(dirs.pod_run_dir(&rec.id).join("agent")).unwrap();
        assert!(dirs.orphan_pod_dirs().is_empty());
        // The record goes last.
        dirs.delete_pod(&rec.id).unwrap();
        assert!(!dirs.pod_run_dir(&rec.id).exists() && !dirs.pod_dir(&rec.id).exists());
        // Runtime files whose pod directory is gone (an older version removed the record
        // first) are debris for the next start.
        fs::create_dir_all(dirs.pod_run_dir("p2").join("agent")).unwrap();
        assert_eq!(dirs.orphan_pod_dirs(), vec![dirs.pod_run_dir("p2")]);
    }

    #[test]
    fn a_containers_spec_survives_its_record_and_older_records_have_none() {
        let t = tempfile::tempdir().unwrap();
        let dirs = StateDirs::new(&t.path().join("root"), &t.path().join("run")).unwrap();
        let text = r#"{"ociVersion":"1.0.2","process":{"args":["sh","-c","x"]},"linux":{"resources":{"memory":{"limit":1048576}}}}"#;
        let rec = ContainerRecord {
            state: ContainerState::Created,
            started_at: 0,
            spec: Some(
                serde_json::value::RawValue::from_string(text.into())
                    .unwrap()
                    .into(),
            ),
            ..ContainerRecord::for_test("c1", "p1")
        };
        dirs.save_container(&rec).unwrap();
        let mut old = serde_json::to_value(&rec).unwrap();
        old.as_object_mut().unwrap().remove("spec");
        old["id"] = serde_json::json!("c0");
        fs::write(
            dirs.containers_dir().join("c0.json"),
            serde_json::to_vec(&old).unwrap(),
        )
        .unwrap();
        let mut loaded = dirs.load_containers();
        loaded.sort_by(|a, b| a.id.cmp(&b.id));
        assert_eq!(loaded.len(), 2, "{:?}", dirs.quarantined());
        assert!(loaded[0].spec.is_none());
        assert_eq!(loaded[1].spec.as_ref().unwrap().get(), text);
        // As verbose ContainerStatus puts it: the spec as JSON, not a string.
        let info = serde_json::json!({"runtimeSpec": loaded[1].spec});
        assert_eq!(info["runtimeSpec"]["process"]["args"][0], "sh");
    }

    #[test]
    fn configs_written_before_a_cri_api_update_still_load() {
        // A container config as vesseld wrote it with cri-api 0.32: no stop_signal, no
        // image_sub_path, no image_ref (the fields Kubernetes 1.33-1.36 added).
        let config = cri::ContainerConfig {
            mounts: vec![cri::Mount {
                container_path: "/iv".into(),
                image: Some(cri::ImageSpec {
                    image: "busybox".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            stop_signal: cri::Signal::Sigusr1 as i32,
            ..Default::default()
        };
        let mut old = serde_json::to_value(&config).unwrap();
        let o = old.as_object_mut().unwrap();
        assert!(o.remove("stop_signal").is_some());
        let m = old["mounts"][0].as_object_mut().unwrap();
        assert!(m.remove("image_sub_path").is_some());
        let i = old["mounts"][0]["image"].as_object_mut().unwrap();
        assert!(i.remove("image_ref").is_some());
        // And a field of a later API than this one (a downgrade) is ignored.
        old["a_later_field"] = serde_json::json!(1);
        let back: cri::ContainerConfig = serde_json::from_value(old).unwrap();
        assert_eq!(back.stop_signal, 0);
        assert_eq!(back.mounts[0].image.as_ref().unwrap().image, "busybox");
    }

    #[test]
    fn backend_state_keeps_the_record_format_of_earlier_versions() {
        let vm = VmPodState {
            dir: "/run/vms/p1".into(),
            slots: vec!["sha256:aa".into(), String::new()],
            vcpus: 2,
            ..Default::default()
        };
        let v = serde_json::to_value(record(BackendState::Vm { vm: vm.clone() })).unwrap();
        assert_eq!(v["backend"], "vm");
        assert_eq!(v["vm"]["slots"][0], "sha256:aa");
        let f = serde_json::to_value(record(BackendState::Flat {})).unwrap();
        assert_eq!(f["backend"], "flat");
        assert!(f.get("vm").is_none());

        // As the previous version wrote them: `backend` a string, `vm` null for flat pods
        // (or absent, before VM pods existed).
        let mut old_flat = f.clone();
        old_flat["vm"] = serde_json::Value::Null;
        let r: PodRecord = serde_json::from_value(old_flat).unwrap();
        assert_eq!(r.backend.kind(), BackendKind::Flat);
        assert_eq!(r.agent_pid, 2);
        let r: PodRecord = serde_json::from_value(v).unwrap();
        match r.backend {
            BackendState::Vm { vm: got } => {
                assert_eq!(got.slots, vm.slots);
                assert_eq!(got.vcpus, 2);
            }
            other => panic!("{other:?}"),
        }
        let mut unknown = f;
        unknown["backend"] = "gvisor".into();
        assert!(serde_json::from_value::<PodRecord>(unknown).is_err());
    }
}
