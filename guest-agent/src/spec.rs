//! Turning the caller's OCI runtime spec into the bundle libcontainer runs.
//!
//! Conventions (what vesseld must know):
//! - `root.path` is replaced with the container's rootfs (kept `readonly` flag).
//! - `process.terminal` is set from the request's `tty`.
//! - A namespace whose `path` is `"agent"` joins the agent's own namespace of that type
//!   (`/proc/<agent pid>/ns/<type>`, i.e. the pod's, or the host's where the pod shares it);
//!   a namespace without `path` is created; an absent type is inherited from the agent.
//! - `linux.cgroupsPath` is a cgroupfs path (`/a/b/c`, taken from each hierarchy's root);
//!   systemd-style `slice:prefix:name` paths are refused (no systemd manager). Absent, it
//!   defaults to `/vessel/<id>`.

use std::path::{Path, PathBuf};

use oci_spec::runtime::{LinuxBuilder, LinuxNamespaceType, RootBuilder, Spec};

use crate::error::AgentError;

/// The `/proc/<pid>/ns/<name>` name of a namespace type.
pub fn ns_file_name(t: LinuxNamespaceType) -> &'static str {
    match t {
        LinuxNamespaceType::Mount => "mnt",
        LinuxNamespaceType::Cgroup => "cgroup",
        LinuxNamespaceType::Uts => "uts",
        LinuxNamespaceType::Ipc => "ipc",
        LinuxNamespaceType::User => "user",
        LinuxNamespaceType::Pid => "pid",
        LinuxNamespaceType::Network => "net",
        LinuxNamespaceType::Time => "time",
    }
}

/// The cgroups path used for a container when its spec names none.
pub fn default_cgroups_path(id: &str) -> PathBuf {
    PathBuf::from(format!("/vessel/{id}"))
}

/// Parses and rewrites `json` for container `id` with its rootfs at `rootfs`.
pub fn prepare(
    json: &[u8],
    id: &str,
    rootfs: &Path,
    tty: bool,
    agent_pid: u32,
) -> Result<Spec, AgentError> {
    let mut spec: Spec = serde_json::from_slice(json)
        .map_err(|e| AgentError::InvalidArgument(format!("parsing the OCI spec: {e}")))?;

    let readonly = spec.root().as_ref().and_then(|r| r.readonly());
    let mut root = RootBuilder::default().path(rootfs.to_path_buf());
    if let Some(ro) = readonly {
        root = root.readonly(ro);
    }
    spec.set_root(Some(root.build().map_err(|e| {
        AgentError::InvalidArgument(format!("spec root: {e}"))
    })?));

    let process = spec
        .process_mut()
        .as_mut()
        .ok_or_else(|| AgentError::InvalidArgument("the OCI spec has no process".into()))?;
    if process.args().as_ref().is_none_or(|a| a.is_empty()) {
        return Err(AgentError::InvalidArgument(
            "the OCI spec's process has no args".into(),
        ));
    }
    process.set_terminal(Some(tty));
    // libcontainer 0.7 picks the moment it loads the seccomp filter by whether
    // noNewPrivileges is present, not by its value: `false` made it load after dropping
    // CAP_SYS_ADMIN without no_new_privs, which the kernel refuses. Absent means false.
    if process.no_new_privileges() == Some(false) {
        process.set_no_new_privileges(None);
    }
    clamp_capabilities(process)?;

    if spec.linux().is_none() {
        spec.set_linux(Some(LinuxBuilder::default().build().map_err(|e| {
            AgentError::InvalidArgument(format!("spec linux: {e}"))
        })?));
    }
    let linux = spec.linux_mut().as_mut().expect("set above");
    match linux.cgroups_path() {
        None => {
            linux.set_cgroups_path(Some(default_cgroups_path(id)));
        }
        Some(p) if p.to_string_lossy().contains(':') => {
            return Err(AgentError::InvalidArgument(format!(
                "cgroupsPath {p:?}: systemd-style paths are not supported (cgroupfs only)"
            )));
        }
        Some(_) => {}
    }
    if let Some(namespaces) = linux.namespaces_mut().as_mut() {
        for ns in namespaces.iter_mut() {
            if ns.path().as_deref() == Some(Path::new("agent")) {
                let p = format!("/proc/{agent_pid}/ns/{}", ns_file_name(ns.typ()));
                ns.set_path(Some(PathBuf::from(p)));
            }
        }
    }
    Ok(spec)
}

/// The cgroups path of a prepared spec.
/// Limits every capability set to the agent's own bounding set: asking for a capability the
/// agent does not hold (a host's root may lack some, e.g. CAP_SYS_RESOURCE in some
/// sandboxes) makes capset fail and the container with it. Privileged means "all we have".
fn clamp_capabilities(process: &mut oci_spec::runtime::Process) -> Result<(), AgentError> {
    let Some(mut c) = process.capabilities().clone() else {
        return Ok(());
    };
    let bounding = caps::read(None, caps::CapSet::Bounding)
        .map_err(|e| AgentError::Internal(format!("reading our bounding capability set: {e}")))?;
    let keep = |set: &Option<oci_spec::runtime::Capabilities>| {
        set.as_ref().map(|s| {
            s.iter()
                .copied()
                .filter(|x| {
                    format!("CAP_{x}")
                        .parse::<caps::Capability>()
                        .map_or(true, |k| bounding.contains(&k))
                })
                .collect()
        })
    };
    c.set_bounding(keep(c.bounding()));
    c.set_effective(keep(c.effective()));
    c.set_permitted(keep(c.permitted()));
    c.set_inheritable(keep(c.inheritable()));
    c.set_ambient(keep(c.ambient()));
    process.set_capabilities(Some(c));
    Ok(())
}

pub fn cgroups_path(spec: &Spec, id: &str) -> PathBuf {
    spec.linux()
        .as_ref()
        .and_then(|l| l.cgroups_path().clone())
        .unwrap_or_else(|| default_cgroups_path(id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites() {
        let json = br#"{
            "ociVersion": "1.0.2",
            "root": {"path": "rootfs", "readonly": true},
            "process": {"args": ["sh"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
            "linux": {"namespaces": [{"type": "network", "path": "agent"}, {"type": "pid"}]}
        }"#;
        let spec = prepare(json, "c1", Path::new("/r"), true, 1).unwrap();
        assert_eq!(spec.root().as_ref().unwrap().path(), Path::new("/r"));
        assert_eq!(spec.root().as_ref().unwrap().readonly(), Some(true));
        assert_eq!(spec.process().as_ref().unwrap().terminal(), Some(true));
        let ns = spec.linux().as_ref().unwrap().namespaces().clone().unwrap();
        assert_eq!(ns[0].path().as_deref(), Some(Path::new("/proc/1/ns/net")));
        assert_eq!(ns[1].path(), &None);
        assert_eq!(cgroups_path(&spec, "c1"), PathBuf::from("/vessel/c1"));
        assert!(matches!(
            prepare(b"{", "c1", Path::new("/r"), false, 1),
            Err(AgentError::InvalidArgument(_))
        ));
    }

    #[test]
    fn capabilities_are_limited_to_our_bounding_set() {
        let all: Vec<String> = [
            "CHOWN",
            "KILL",
            "SYS_ADMIN",
            "SYS_RESOURCE",
            "SYS_TIME",
            "BPF",
        ]
        .iter()
        .map(|c| format!("\"CAP_{c}\""))
        .collect();
        let json = format!(
            r#"{{"ociVersion": "1.0.2", "root": {{"path": "rootfs"}},
            "process": {{"args": ["sh"], "cwd": "/", "user": {{"uid": 0, "gid": 0}},
            "capabilities": {{"bounding": [{l}], "effective": [{l}], "permitted": [{l}]}}}}}}"#,
            l = all.join(",")
        );
        let spec = prepare(json.as_bytes(), "c1", Path::new("/r"), false, 1).unwrap();
        let caps = spec
            .process()
            .as_ref()
            .unwrap()
            .capabilities()
            .clone()
            .unwrap();
        let bounding = caps::read(None, caps::CapSet::Bounding).unwrap();
        let held = [
            "CHOWN",
            "KILL",
            "SYS_ADMIN",
            "SYS_RESOURCE",
            "SYS_TIME",
            "BPF",
        ]
        .iter()
        .filter(|c| bounding.contains(&format!("CAP_{c}").parse().unwrap()))
        .count();
        assert_eq!(caps.bounding().as_ref().unwrap().len(), held);
        assert_eq!(caps.effective().as_ref().unwrap().len(), held);
        assert_eq!(caps.permitted().as_ref().unwrap().len(), held);
    }

    #[test]
    fn no_new_privileges_false_is_dropped_true_kept() {
        let spec = |nnp: &str| {
            format!(
                r#"{{"ociVersion": "1.0.2", "root": {{"path": "rootfs"}},
                "process": {{"args": ["sh"], "cwd": "/", "user": {{"uid": 0, "gid": 0}}{nnp}}}}}"#
            )
        };
        let nnp = |j: String| {
            prepare(j.as_bytes(), "c1", Path::new("/r"), false, 1)
                .unwrap()
                .process()
                .as_ref()
                .unwrap()
                .no_new_privileges()
        };
        assert_eq!(nnp(spec(r#", "noNewPrivileges": false"#)), None);
        assert_eq!(nnp(spec(r#", "noNewPrivileges": true"#)), Some(true));
        assert_eq!(nnp(spec("")), None);
    }
}
