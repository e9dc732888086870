//! The container's devices and device cgroup rules: the standard character devices (for a
//! privileged container, every device), then the request's device nodes, each with its rule.

use super::{invalid, SpecError};
use serde_json::{json, Value};
use vessel_cri_api::v1 as cri;

/// The spec's `linux.devices` and the device cgroup rules (`linux.resources.devices`).
pub(super) fn build(
    c: &cri::ContainerConfig,
    privileged: bool,
    vm_guest: bool,
) -> Result<(Vec<Value>, Vec<Value>), SpecError> {
    let mut devices = Vec::new();
    let mut dev_rules = vec![json!({"allow": false, "access": "rwm"})];
    for (t, maj, min) in [
        ("c", 1, 3),
        ("c", 1, 5),
        ("c", 1, 7),
        ("c", 1, 8),
        ("c", 1, 9),
        ("c", 5, 0),
        ("c", 5, 1),
        ("c", 5, 2),
        ("c", 10, 200),
    ] {
        dev_rules
            .push(json!({"allow": true, "type": t, "major": maj, "minor": min, "access": "rwm"}));
    }
    dev_rules.push(json!({"allow": true, "type": "c", "major": 136, "access": "rwm"}));
    if privileged {
        dev_rules = vec![json!({"allow": true, "access": "rwm"})];
    }
    for d in &c.devices {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let m = std::fs::metadata(&d.host_path)
            .map_err(|e| invalid(format!("device {:?}: {e}", d.host_path)))?;
        let t = if m.file_type().is_char_device() {
            "c"
        } else if m.file_type().is_block_device() {
            "b"
        } else {
            return Err(invalid(format!(
                "device {:?} is not a device node",
                d.host_path
            )));
        };
        let rdev = m.rdev();
        let (maj, min) = (libc::major(rdev), libc::minor(rdev));
        let perms = if d.permissions.is_empty() {
            "rwm"
        } else {
            d.permissions.as_str()
        };
        if !perms.chars().all(|c| "rwm".contains(c)) {
            return Err(invalid(format!(
                "device {:?}: bad permissions {perms:?}",
                d.host_path
            )));
        }
        devices.push(json!({
            "path": if d.container_path.is_empty() { &d.host_path } else { &d.container_path },
            "type": t, "major": maj, "minor": min,
            "fileMode": m.mode() & 0o7777, "uid": m.uid(), "gid": m.gid()
        }));
        dev_rules
            .push(json!({"allow": true, "type": t, "major": maj, "minor": min, "access": perms}));
    }
    // A privileged container of a flat pod sees the host's device nodes, as with containerd
    // and CRI-O (CSI and device plugins find the node's disks, loop devices, /dev/fuse);
    // a VM pod's guest has its own devices.
    if privileged && !vm_guest {
        let asked: Vec<String> = devices
            .iter()
            .filter_map(|d| d["path"].as_str().map(str::to_string))
            .collect();
        let mut host = Vec::new();
        host_devices(std::path::Path::new("/dev"), &mut host);
        devices.extend(host.into_iter().filter(|d| {
            d["path"]
                .as_str()
                .is_some_and(|p| !asked.iter().any(|a| a == p))
        }));
    }
    Ok((devices, dev_rules))
}

/// Nodes every container gets anyway (libcontainer makes them, or its devpts does).
const STANDARD: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/ptmx",
    "/dev/console",
];

/// The character and block device nodes under `dir` (the host's /dev), as spec devices,
/// without the standard ones and the directories other mounts own (pts, shm, mqueue) or
/// that are not devices (fd). Symlinks are not followed; unreadable entries are skipped.
fn host_devices(dir: &std::path::Path, out: &mut Vec<Value>) {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let Ok(m) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let ft = m.file_type();
        if ft.is_dir() {
            let name = e.file_name();
            if !matches!(
                name.to_str(),
                Some("pts" | "shm" | "mqueue" | "fd" | ".lxc" | ".lxd-mounts" | ".udev")
            ) {
                host_devices(&path, out);
            }
            continue;
        }
        let t = if ft.is_char_device() {
            "c"
        } else if ft.is_block_device() {
            "b"
        } else {
            continue;
        };
        let Some(p) = path.to_str() else {
            continue;
        };
        if STANDARD.contains(&p) {
            continue;
        }
        let rdev = m.rdev();
        out.push(json!({
            "path": p, "type": t, "major": libc::major(rdev), "minor": libc::minor(rdev),
            "fileMode": m.mode() & 0o7777, "uid": m.uid(), "gid": m.gid()
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A privileged flat container lists the host's nodes (not the standard ones, not twice
    /// one the request names); a VM guest's or an unprivileged one's does not.
    #[test]
    fn privileged_flat_containers_get_the_hosts_devices() {
        if std::fs::metadata("/dev/kmsg").is_err() {
            return; // no such host node to look for
        }
        let c = cri::ContainerConfig {
            devices: vec![cri::Device {
                container_path: "/dev/kmsg".into(),
                host_path: "/dev/kmsg".into(),
                permissions: "r".into(),
            }],
            ..Default::default()
        };
        let paths = |privileged, vm| -> Vec<String> {
            build(&c, privileged, vm)
                .unwrap()
                .0
                .iter()
                .map(|d| d["path"].as_str().unwrap().to_string())
                .collect()
        };
        let all = paths(true, false);
        assert_eq!(all.iter().filter(|p| *p == "/dev/kmsg").count(), 1);
        assert!(
            !all.iter().any(|p| STANDARD.contains(&p.as_str())),
            "{all:?}"
        );
        assert!(!all.iter().any(|p| p.starts_with("/dev/pts/")), "{all:?}");
        assert_eq!(paths(true, true), ["/dev/kmsg"]);
        assert_eq!(paths(false, false), ["/dev/kmsg"]);
    }
}
