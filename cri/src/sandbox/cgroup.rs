//! Pod cgroups: the cgroup driver (cgroupfs, or systemd units), and cgroupfs helpers for the
//! pod and container cgroups vesseld owns (v1 hierarchies and v2).

use super::systemd::{self, Systemd};
use crate::errors::{Result, RuntimeError};
use crate::state::PodRecord;
use std::collections::HashSet;
use std::path::PathBuf;

/// The leaf a flat pod's agent moves to under a systemd pod scope, so that the scope holds no
/// process of its own and its containers' cgroups may have controllers (cgroup v2 allows
/// processes only in leaves of a subtree with controllers enabled), and so that the agent's
/// cgroup is no prefix of its containers'.
pub const AGENT_LEAF: &str = "vessel-agent";

/// The leaf a VM pod's shim (the VMM) moves to under a cgroupfs pod cgroup that is kubelet's,
/// where kubelet may have enabled controllers for children.
const VMM_LEAF: &str = "vessel-vmm";

/// How pod cgroups are made: directly in cgroupfs (`/vessel/<pod>`, or kubelet's cgroupfs
/// parent), or as systemd units in kubelet's slices ([`super::systemd`]).
#[derive(Debug)]
pub enum Driver {
    Cgroupfs,
    Systemd(Systemd),
}

impl Driver {
    /// The name in config and in `RuntimeConfig`.
    pub fn name(&self) -> &'static str {
        match self {
            Driver::Cgroupfs => "cgroupfs",
            Driver::Systemd(_) => "systemd",
        }
    }

    /// The CRI `CgroupDriver` value kubelet reads from `RuntimeConfig`.
    pub fn cri(&self) -> vessel_cri_api::v1::CgroupDriver {
        match self {
            Driver::Cgroupfs => vessel_cri_api::v1::CgroupDriver::Cgroupfs,
            Driver::Systemd(_) => vessel_cri_api::v1::CgroupDriver::Systemd,
        }
    }

    /// The unit pod `id`'s cgroup lives in, where the driver makes units (`""` otherwise).
    pub fn pod_unit(&self, id: &str) -> String {
        match self {
            Driver::Cgroupfs => String::new(),
            Driver::Systemd(_) => systemd::pod_unit(id),
        }
    }

    /// Checks that the driver can work on this node (the daemon's start).
    pub async fn check(&self) -> std::result::Result<(), systemd::SystemdError> {
        match self {
            Driver::Cgroupfs => Ok(()),
            Driver::Systemd(s) => s.check().await,
        }
    }

    /// The cgroupfs path beneath which pod `id`'s containers get their cgroups, and its
    /// systemd unit (empty for cgroupfs), from the cgroup parent in the pod's config.
    pub fn pod_cgroup(&self, id: &str, parent: &str) -> Result<(String, String)> {
        match self {
            Driver::Cgroupfs if parent.is_empty() => Ok((format!("/vessel/{id}"), String::new())),
            Driver::Cgroupfs if parent.ends_with(".slice") => Err(RuntimeError::InvalidArgument(
                format!(
                    "cgroup parent {parent:?} is a systemd slice, but vessel's cgroup driver is cgroupfs (runtime.cgroup_driver; kubelet's cgroupDriver must match)"
                ),
            )),
            Driver::Cgroupfs => Ok((parent.to_string(), String::new())),
            Driver::Systemd(_) => {
                let slice = if parent.is_empty() {
                    systemd::DEFAULT_SLICE
                } else {
                    parent
                };
                let base = systemd::expand_slice(slice).map_err(|e| {
                    RuntimeError::InvalidArgument(format!(
                        "cgroup parent: {e}; vessel's cgroup driver is systemd (runtime.cgroup_driver; kubelet's cgroupDriver must match)"
                    ))
                })?;
                let unit = systemd::pod_unit(id);
                Ok((format!("{}/{unit}", base.trim_end_matches('/')), unit))
            }
        }
    }

    /// Puts the pod's host process into the pod's cgroup, so that what it uses is charged to
    /// the pod (kubelet sizes and accounts pods by their cgroup): under the systemd driver
    /// into the pod's scope, under cgroupfs into a leaf of the pod's cgroup parent (kubelet's
    /// `kubepods/.../pod<uid>`, or vessel's `/vessel/<pod>`). A flat pod's agent always goes
    /// on into a leaf ([`AGENT_LEAF`]), as the pod's containers get cgroups beside it; a VM
    /// pod's shim (the VMM: its vCPU threads and guest memory) into [`VMM_LEAF`] under
    /// cgroupfs, where the parent is kubelet's.
    pub async fn adopt(&self, rec: &PodRecord, flat: bool) -> Result<()> {
        // vesseld never moves itself (pid 0 in cgroup.procs is the writer; a test double's
        // host process is the test).
        if rec.agent_pid == 0 || rec.agent_pid == std::process::id() {
            return Ok(());
        }
        let leaf = if flat { AGENT_LEAF } else { VMM_LEAF };
        let sd = match self {
            Driver::Systemd(sd) if !rec.cgroup_unit.is_empty() => sd,
            Driver::Systemd(_) => return Ok(()),
            Driver::Cgroupfs => {
                let what = if flat { "agent" } else { "VMM" };
                for dir in cgroup_dirs(&rec.cgroup_parent) {
                    make_cgroup(&dir)
                        .and_then(|()| join_with_children(&dir, leaf, rec.agent_pid))
                        .map_err(|e| moving_err(rec, what, &dir, leaf, e))?;
                }
                tracing::debug!(pod = %rec.id, cgroup = %rec.cgroup_parent, leaf, "pod host process in the pod's cgroup");
                return Ok(());
            }
        };
        let parent = rec
            .config
            .linux
            .as_ref()
            .map(|l| l.cgroup_parent.as_str())
            .filter(|p| !p.is_empty())
            .unwrap_or(systemd::DEFAULT_SLICE);
        let name = rec
            .config
            .metadata
            .as_ref()
            .map(|m| format!("{}/{}", m.namespace, m.name))
            .unwrap_or_default();
        sd.start_scope(
            &rec.cgroup_unit,
            parent,
            rec.agent_pid,
            &format!("vessel pod {name} ({})", rec.id),
        )
        .await
        .map_err(|e| RuntimeError::Internal(format!("pod {}: {e}", rec.id)))?;
        if !flat {
            // The jailed VMM the shim forked, maybe before systemd moved the shim: into the
            // scope beside it (read after the move, so a later fork inherits the scope).
            for scope in cgroup_dirs(&rec.cgroup_parent) {
                for c in super::process::children(rec.agent_pid) {
                    if scope.is_dir() {
                        ignore_gone(std::fs::write(scope.join("cgroup.procs"), c.to_string()))
                            .map_err(|e| {
                                RuntimeError::Internal(format!(
                                    "pod {}: moving its VMM (pid {c}) into {}: {e}",
                                    rec.id,
                                    scope.display()
                                ))
                            })?;
                    }
                }
            }
        }
        if flat {
            // In every hierarchy where systemd made the scope. Not only for cgroup v2: a
            // container's parent process must not sit in a cgroup that is a prefix of the
            // container's, or libcontainer's emulated /sys/fs/cgroup (cgroup v1) strips it.
            for scope in cgroup_dirs(&rec.cgroup_parent) {
                if scope.is_dir() {
                    // With the agent, its children: a pod with its own user namespace has
                    // its pid namespace's holder there from the start.
                    join_with_children(&scope, leaf, rec.agent_pid)
                        .map_err(|e| moving_err(rec, "agent", &scope, leaf, e))?;
                }
            }
        }
        tracing::debug!(pod = %rec.id, unit = %rec.cgroup_unit, "pod scope started");
        Ok(())
    }

    /// Stops the pod's unit (which kills what is left in it) and removes its cgroups; under
    /// cgroupfs removes the host process's leaf, and the pod's cgroup where it is vessel's
    /// own. Called after the host process is gone. Idempotent; failures are logged.
    pub async fn release(&self, rec: &PodRecord) {
        let sd = match self {
            Driver::Systemd(sd) if !rec.cgroup_unit.is_empty() => sd,
            Driver::Systemd(_) => return,
            Driver::Cgroupfs => {
                if rec.cgroup_parent == format!("/vessel/{}", rec.id) {
                    remove_dead_cgroup(&rec.cgroup_parent).await;
                } else {
                    let parent = rec.cgroup_parent.trim_end_matches('/');
                    for leaf in [AGENT_LEAF, VMM_LEAF] {
                        remove_cgroup_patiently(&format!("{parent}/{leaf}")).await;
                    }
                }
                return;
            }
        };
        if let Err(e) = sd.stop_unit(&rec.cgroup_unit).await {
            tracing::warn!(pod = %rec.id, unit = %rec.cgroup_unit, error = %e, "cannot stop the pod's scope");
        }
        // The pod's own scope.
        remove_dead_cgroup(&rec.cgroup_parent).await;
    }

    /// Stops pod scopes that no record owns (pods whose record is gone), except `kept`
    /// (quarantined records' pods).
    pub async fn sweep(&self, recorded: &[PodRecord], kept: &HashSet<String>) {
        let Driver::Systemd(sd) = self else {
            return;
        };
        let units = match sd
            .units(&format!("{}*.scope", systemd::POD_UNIT_PREFIX))
            .await
        {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list pod scopes; orphans are not swept");
                return;
            }
        };
        let owned: HashSet<&str> = recorded.iter().map(|r| r.cgroup_unit.as_str()).collect();
        for unit in units {
            let id = unit
                .strip_prefix(systemd::POD_UNIT_PREFIX)
                .and_then(|u| u.strip_suffix(".scope"))
                .unwrap_or_default();
            if owned.contains(unit.as_str()) || kept.contains(id) {
                continue;
            }
            tracing::info!(unit = %unit, "stopping pod scope without record");
            if let Err(e) = sd.stop_unit(&unit).await {
                tracing::warn!(unit = %unit, error = %e, "cannot stop orphan pod scope");
            }
        }
    }
}

/// Creates the cgroup directory `dir` and its missing ancestors. In a v1 cpuset hierarchy a
/// new cgroup has no CPUs and memory nodes (and takes no process) until given its parent's.
fn make_cgroup(dir: &std::path::Path) -> std::io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        make_cgroup(parent)?;
    }
    match std::fs::create_dir(dir) {
        Ok(()) => inherit_cpuset(dir),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// Copies a v1 cpuset cgroup's CPUs and memory nodes from its parent (nothing elsewhere).
fn inherit_cpuset(dir: &std::path::Path) -> std::io::Result<()> {
    let Some(parent) = dir.parent() else {
        return Ok(());
    };
    for f in ["cpuset.cpus", "cpuset.mems"] {
        if !dir.join(f).exists() {
            continue;
        }
        if let Ok(v) = std::fs::read_to_string(parent.join(f)) {
            std::fs::write(dir.join(f), v.trim())?;
        }
    }
    Ok(())
}

/// A process that exited before it could be moved is not an error.
fn ignore_gone(r: std::io::Result<()>) -> std::io::Result<()> {
    match r {
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(()),
        r => r,
    }
}

/// Moves process `pid` into the leaf `leaf` under the cgroup directory `dir`, then its
/// children: a shim's jailed VMM (forked maybe before the shim moved), a flat pod's pid
/// namespace holder. They are read after the move, so a later fork inherits the leaf; one
/// gone by then is passed over.
fn join_with_children(dir: &std::path::Path, leaf: &str, pid: u32) -> std::io::Result<()> {
    join_leaf(dir, leaf, pid)?;
    super::process::children(pid)
        .into_iter()
        .try_for_each(|c| ignore_gone(join_leaf(dir, leaf, c)))
}

/// The error of moving a pod's `what` (its agent or VMM) into the leaf `leaf` under `dir`.
fn moving_err(
    rec: &PodRecord,
    what: &str,
    dir: &std::path::Path,
    leaf: &str,
    e: std::io::Error,
) -> RuntimeError {
    RuntimeError::Internal(format!(
        "pod {}: moving its {what} into {}/{leaf}: {e}",
        rec.id,
        dir.display()
    ))
}

/// Moves process `pid` (all its threads) into the leaf `leaf` under the cgroup directory `dir`.
fn join_leaf(dir: &std::path::Path, leaf: &str, pid: u32) -> std::io::Result<()> {
    let leaf = dir.join(leaf);
    match std::fs::create_dir(&leaf) {
        Ok(()) => inherit_cpuset(&leaf)?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    std::fs::write(leaf.join("cgroup.procs"), pid.to_string())
}

/// Mount points of the cgroup hierarchies, each with whether it is cgroup v2.
fn mounted_hierarchies() -> Vec<(PathBuf, bool)> {
    let mut out = Vec::new();
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return out;
    };
    for l in info.lines() {
        let parts: Vec<&str> = l.split(' ').collect();
        let Some(sep) = parts.iter().position(|p| *p == "-") else {
            continue;
        };
        let fstype = parts.get(sep + 1).copied().unwrap_or("");
        if fstype == "cgroup" || fstype == "cgroup2" {
            if let Some(mp) = parts.get(4) {
                out.push((PathBuf::from(mp), fstype == "cgroup2"));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// cgroupfs directories named `rel` under every mounted hierarchy (v1 controllers and v2).
pub fn cgroup_dirs(rel: &str) -> Vec<PathBuf> {
    let rel = rel.trim_start_matches('/');
    let mut out: Vec<PathBuf> = mounted_hierarchies()
        .into_iter()
        .map(|(mp, _)| mp.join(rel))
        .collect();
    out.dedup();
    out
}

/// Removes the cgroup `rel` (and its empty children, deepest first) from every hierarchy.
pub fn remove_cgroup(rel: &str) {
    for (d, e) in try_remove_cgroup(rel, false) {
        tracing::warn!(cgroup = %d.display(), error = %e, "cannot remove cgroup");
    }
}

/// Like [`remove_cgroup`], for a cgroup whose processes were just killed: a v1 cgroup stays
/// busy for a moment after its last process is killed (until it is gone for good), so a busy
/// one is tried again for up to a second.
pub async fn remove_cgroup_patiently(rel: &str) {
    remove_patiently(rel, false).await;
}

/// Like [`remove_cgroup_patiently`], for a cgroup that belongs to one pod or container
/// whose host process is gone (never one shared with another sandbox, as the leaves under a
/// kubelet pod cgroup are between the sandboxes of one pod): each of its cgroups is thawed
/// and emptied first ([`thaw_and_kill`]).
pub async fn remove_dead_cgroup(rel: &str) {
    remove_patiently(rel, true).await;
}

async fn remove_patiently(rel: &str, kill: bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    loop {
        let left = try_remove_cgroup(rel, kill);
        let busy = left
            .iter()
            .all(|(_, e)| e.raw_os_error() == Some(libc::EBUSY));
        if left.is_empty() || !busy || std::time::Instant::now() >= deadline {
            for (d, e) in left {
                tracing::warn!(cgroup = %d.display(), error = %e, "cannot remove cgroup");
            }
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Thaws the cgroup `d` if it is frozen (the v1 freezer's `freezer.state`, v2's
/// `cgroup.freeze`) and kills what is still in it. Only for the cgroup of a pod or container
/// being removed after its host process is gone: libcontainer freezes a container's cgroup
/// while it kills it, and a process in a frozen cgroup cannot die, so an agent killed in
/// between leaves processes that would keep the cgroup busy for ever.
fn thaw_and_kill(d: &std::path::Path) {
    let state = d.join("freezer.state");
    if std::fs::read_to_string(&state).is_ok_and(|s| s.trim() != "THAWED") {
        if let Err(e) = std::fs::write(&state, "THAWED") {
            tracing::warn!(cgroup = %d.display(), error = %e, "cannot thaw cgroup");
        }
    }
    let freeze = d.join("cgroup.freeze");
    if std::fs::read_to_string(&freeze).is_ok_and(|s| s.trim() == "1") {
        if let Err(e) = std::fs::write(&freeze, "0") {
            tracing::warn!(cgroup = %d.display(), error = %e, "cannot thaw cgroup");
        }
    }
    // cgroup v2 kills the whole cgroup without a race with pid reuse.
    if std::fs::write(d.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap_or_default();
    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        if pid > 0 {
            tracing::info!(cgroup = %d.display(), pid, "killing a process left in a removed pod's cgroup");
            if let Some(p) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
        }
    }
}

/// One pass of removing `rel` from every hierarchy: the directories left, with why.
fn try_remove_cgroup(rel: &str, kill: bool) -> Vec<(PathBuf, std::io::Error)> {
    let mut left = Vec::new();
    for dir in cgroup_dirs(rel) {
        if !dir.exists() {
            continue;
        }
        let mut dirs = vec![];
        let mut stack = vec![dir.clone()];
        while let Some(d) = stack.pop() {
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                        stack.push(e.path());
                    }
                }
            }
            dirs.push(d);
        }
        // Top down: a v1 freezer child of a frozen parent stays frozen until both thaw.
        dirs.sort_by_key(|d| d.components().count());
        if kill {
            for d in &dirs {
                thaw_and_kill(d);
            }
        }
        dirs.reverse();
        for d in dirs {
            if let Err(e) = std::fs::remove_dir(&d) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    left.push((d, e));
                }
            }
        }
    }
    left
}
