//! The container's mounts: the standard set, the pod's files, then the request's.

use super::{invalid, SpecError, SpecInput};
use crate::userns::PodUserns;
use serde_json::{json, Value};
use vessel_cri_api::v1 as cri;

/// The spec's `mounts`; a request's mount without an absolute container path, without a
/// host path that exists, or with options that do not go together is refused.
pub(super) fn build(
    input: &SpecInput<'_>,
    sc: Option<&cri::LinuxContainerSecurityContext>,
    userns: Option<&PodUserns>,
    (pid_mode, ipc_mode): (cri::NamespaceMode, cri::NamespaceMode),
    privileged: bool,
) -> Result<Vec<Value>, SpecError> {
    let c = input.config;
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", if privileged { "rw" } else { "ro" }]}),
        json!({"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["nosuid", "noexec", "nodev", "relatime", if privileged { "rw" } else { "ro" }]}),
    ];
    // libcontainer 0.7 emulates cgroup v1's /sys/fs/cgroup from the /proc entry of the
    // container's pid as its own pid namespace numbers it, looked up in the agent's /proc:
    // right only where that pid is 1 (a pid namespace of the container's own, whose PID 1 it
    // is). In a flat pod's shared pid namespace (below the agent's, held by a holder) or a
    // target container's, the entry is missing or another process's. Such a container gets
    // an empty read-only /sys/fs/cgroup on a v1 host (its own cgroup namespace on v2, where
    // this does not arise); in a VM pod the pod's pid namespace is the guest agent's own.
    let not_own = matches!(
        pid_mode,
        cri::NamespaceMode::Pod | cri::NamespaceMode::Target
    );
    if not_own && !input.cgroup_ns && !input.vm_guest {
        mounts.pop();
        mounts.push(json!({"destination": "/sys/fs/cgroup", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "noexec", "nodev", "ro", "mode=555", "size=4k"]}));
    }
    // /dev/shm: a container in the pod's IPC namespace shares the pod's (its agent's; a VM
    // pod's host IPC namespace is its guest's), one in the host's shares the host's, as
    // with containerd; one with its own IPC namespace (or in a pod started before pods had
    // one) has its own.
    let shm = match ipc_mode {
        cri::NamespaceMode::Node if !input.vm_guest => Some("/dev/shm"),
        cri::NamespaceMode::Pod | cri::NamespaceMode::Node if input.shared_shm => {
            Some(vessel_agent::spec::POD_SHM)
        }
        _ => None,
    };
    if let Some(source) = shm.filter(|s| !s.starts_with('/') || std::path::Path::new(s).is_dir()) {
        if let Some(m) = mounts.iter_mut().find(|m| m["destination"] == "/dev/shm") {
            *m = json!({"destination": "/dev/shm", "type": "bind", "source": source, "options": ["rbind", "rprivate", "nosuid", "noexec", "nodev", "rw"]});
        }
    }
    let readonly_root = sc.map(|s| s.readonly_rootfs).unwrap_or(false);
    let dests: Vec<String> = c.mounts.iter().map(|m| clean(&m.container_path)).collect();
    // A request's mount replaces the standard one at its path (as containerd does): nothing
    // is mounted only to be hidden. But /dev: the runtime makes its nodes and links in the
    // standard tmpfs there, and the agent puts a request's /dev (and the mounts below it)
    // over it once the container is made, then the container's own pts, shm and mqueue
    // back over the host's (the agent's `devbind`), so the host's /dev is never written.
    mounts.retain(|m| {
        let dest = m["destination"].as_str().unwrap_or_default();
        dest == "/dev" || !dests.iter().any(|d| d == dest)
    });
    let dests: Vec<&str> = dests.iter().map(String::as_str).collect();
    for (file, dest) in [
        ("hostname", "/etc/hostname"),
        ("hosts", "/etc/hosts"),
        ("resolv.conf", "/etc/resolv.conf"),
    ] {
        if dests.contains(&dest) {
            continue; // kubelet mounts its own /etc/hosts
        }
        let src = input.pod_dir.join(file);
        let mut opts = vec!["rbind", "rprivate", if readonly_root { "ro" } else { "rw" }];
        if userns.is_some() && !input.vm_guest {
            // Root's files show as the container root's, as without a user namespace. (A
            // VM pod's files are written as its root's.)
            opts.push("idmap");
        }
        mounts.push(json!({
            "destination": dest, "type": "bind", "source": src, "options": opts
        }));
    }
    // Parents before children, whatever order the request has them in (kubelet keeps the pod
    // spec's): a volume at /a/b listed before one at /a would otherwise be hidden by it.
    // Stable, so mounts at one depth keep the request's order (containerd's rule).
    let mut requested: Vec<&cri::Mount> = c.mounts.iter().collect();
    requested.sort_by_key(|m| depth(&m.container_path));
    for m in requested {
        if m.container_path.is_empty() || !m.container_path.starts_with('/') {
            return Err(invalid(format!(
                "mount container path {:?} must be absolute",
                m.container_path
            )));
        }
        if m.host_path.is_empty() {
            return Err(invalid(format!(
                "mount at {:?} has no host path",
                m.container_path
            )));
        }
        if clean(&m.container_path) == "/dev" {
            if input.vm_guest {
                return Err(invalid(format!(
                    "a volume at /dev (from {:?}) is not supported in a VM pod: its guest kernel has its own devices, and the host's nodes mean nothing there (run the pod with a flat runtime handler)",
                    m.host_path
                )));
            }
            if userns.is_some() {
                return Err(invalid(format!(
                    "a volume at /dev (from {:?}) is not supported in a pod with its own user namespace",
                    m.host_path
                )));
            }
        }
        if !m.host_path.starts_with('/') {
            return Err(invalid(format!(
                "mount source {:?} (for {:?}) must be an absolute path",
                m.host_path, m.container_path
            )));
        }
        // kubelet gives a pod without host users its volumes with the pod's mappings: the
        // agent idmaps them through the pod's user namespace. Other mappings are refused.
        let idmap = !m.uid_mappings.is_empty() || !m.gid_mappings.is_empty();
        if idmap
            && !userns
                .as_ref()
                .is_some_and(|u| crate::userns::mount_matches(u, m))
        {
            return Err(invalid(format!(
                "mount at {:?}: its ID mappings are not the pod's user namespace's (only \
                 those are supported, and only in a pod with its own user namespace)",
                m.container_path
            )));
        }
        if std::fs::symlink_metadata(&m.host_path).is_err() {
            return Err(invalid(format!(
                "mount source {:?} (for {:?}) does not exist",
                m.host_path, m.container_path
            )));
        }
        let mut opts = vec!["rbind".to_string(), propagation(m.propagation).to_string()];
        opts.push(if m.readonly { "ro" } else { "rw" }.into());
        if m.recursive_read_only {
            // Read-only all the way down (mount_setattr AT_RECURSIVE): only for a read-only,
            // private mount, as the CRI defines it (kubelet asks only where Status says so).
            if !m.readonly {
                return Err(invalid(format!(
                    "mount at {:?}: recursive_read_only needs readonly",
                    m.container_path
                )));
            }
            if m.propagation != cri::MountPropagation::PropagationPrivate as i32 {
                return Err(invalid(format!(
                    "mount at {:?}: recursive_read_only needs private propagation",
                    m.container_path
                )));
            }
            opts.push("rro".into());
        }
        // A VM pod's volumes come through its share, whose file server shows every owner
        // through the pod's mapping (the guest kernel cannot idmap virtio-fs).
        if idmap && !input.vm_guest {
            opts.push("idmap".into());
        }
        mounts.push(json!({"destination": m.container_path, "type": "bind", "source": m.host_path, "options": opts}));
    }
    Ok(mounts)
}

/// A container path without `.`, `..`, doubled or trailing slashes, worked out by name as
/// the runtime resolves it inside the root (`..` at `/` stays there), so that `/x/../dev`
/// is `/dev` for ordering, replacement and refusals alike.
pub(crate) fn clean(path: &str) -> String {
    // The agent's rule, which places the mount.
    vessel_agent::mount_tree::lexical(std::path::Path::new(path))
        .to_string_lossy()
        .into_owned()
}

/// How many components a container path has (`/` has none).
fn depth(path: &str) -> usize {
    clean(path).split('/').filter(|p| !p.is_empty()).count()
}

fn propagation(p: i32) -> &'static str {
    match cri::MountPropagation::try_from(p).unwrap_or(cri::MountPropagation::PropagationPrivate) {
        cri::MountPropagation::PropagationPrivate => "rprivate",
        cri::MountPropagation::PropagationHostToContainer => "rslave",
        cri::MountPropagation::PropagationBidirectional => "rshared",
    }
}
