//! The container's devices and device cgroup rules: the standard character devices (for a
//! privileged container, every device), then the request's device nodes, each with its rule.

use super::{invalid, SpecError};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
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
        let m = std::fs::metadata(&d.host_path)
            .map_err(|e| invalid(format!("device {:?}: {e}", d.host_path)))?;
        let at = if d.container_path.is_empty() {
            &d.host_path
        } else {
            &d.container_path
        };
        // A directory (`/dev/dri`, `/dev/snd`) gives the nodes in it, at the same places
        // under the container path, as containerd and CRI-O give them.
        let nodes = if m.is_dir() {
            // Not another mount's nodes (a devpts' ptys); none at all gives none, as with
            // containerd.
            let mut found = Vec::new();
            device_nodes(Path::new(&d.host_path), NOT_DEVICES, &mut found);
            found
                .into_iter()
                .filter_map(|(p, m)| {
                    let rel = p.strip_prefix(&d.host_path).ok()?;
                    Some((Path::new(at).join(rel), m))
                })
                .collect()
        } else if node_type(&m).is_some() {
            vec![(PathBuf::from(at), m)]
        } else {
            return Err(invalid(format!(
                "device {:?} is not a device node",
                d.host_path
            )));
        };
        for (path, m) in nodes {
            let Some((t, maj, min)) = node_type(&m) else {
                continue;
            };
            devices.push(node_json(&path, &m));
            dev_rules.push(
                json!({"allow": true, "type": t, "major": maj, "minor": min, "access": perms}),
            );
        }
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
        host_devices(Path::new("/dev"), &mut host);
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

/// The device nodes of the host's /dev, as spec devices, without the standard ones and
/// the directories other mounts own (pts, shm, mqueue) or that hold no devices (fd).
fn host_devices(dir: &Path, out: &mut Vec<Value>) {
    let mut found = Vec::new();
    device_nodes(dir, NOT_DEVICES, &mut found);
    out.extend(
        found
            .iter()
            .filter(|(p, _)| !p.to_str().is_some_and(|p| STANDARD.contains(&p)))
            .map(|(p, m)| node_json(p, m)),
    );
}

/// Directories of /dev that other mounts own or that hold no devices of the node's.
const NOT_DEVICES: &[&str] = &["pts", "shm", "mqueue", "fd", ".lxc", ".lxd-mounts", ".udev"];

/// The character and block device nodes under `dir`, recursively, but for the
/// subdirectories named in `skip`. Symlinks are not followed; unreadable entries are
/// skipped.
fn device_nodes(dir: &Path, skip: &[&str], out: &mut Vec<(PathBuf, std::fs::Metadata)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let Ok(m) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if m.is_dir() {
            if !e.file_name().to_str().is_some_and(|n| skip.contains(&n)) {
                device_nodes(&path, skip, out);
            }
        } else if node_type(&m).is_some() && path.to_str().is_some() {
            // (A name that is not UTF-8 cannot be written into the spec.)
            out.push((path, m));
        }
    }
}

/// A device node's type (`c` or `b`) and numbers; `None` for anything else.
fn node_type(m: &std::fs::Metadata) -> Option<(&'static str, u32, u32)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let t = if m.file_type().is_char_device() {
        "c"
    } else if m.file_type().is_block_device() {
        "b"
    } else {
        return None;
    };
    let rdev = m.rdev();
    Some((t, libc::major(rdev), libc::minor(rdev)))
}

/// A spec device at container path `path` for the node `m` describes.
fn node_json(path: &Path, m: &std::fs::Metadata) -> Value {
    use std::os::unix::fs::MetadataExt;
    let (t, maj, min) = node_type(m).unwrap_or(("c", 0, 0));
    json!({
        "path": path, "type": t, "major": maj, "minor": min,
        "fileMode": m.mode() & 0o7777, "uid": m.uid(), "gid": m.gid()
    })
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

    /// A device directory gives the nodes in it under the container path, each with its
    /// rule (one without nodes, none); a file that is no node is refused.
    #[test]
    fn a_device_directory_gives_its_nodes() {
        let dev = |host: &str, at: &str| cri::ContainerConfig {
            devices: vec![cri::Device {
                container_path: at.into(),
                host_path: host.into(),
                permissions: "rw".into(),
            }],
            ..Default::default()
        };
        if std::fs::metadata("/dev/net/tun").is_ok() {
            let (devices, rules) = build(&dev("/dev/net", "/dev/vnet"), false, false).unwrap();
            assert!(
                devices
                    .iter()
                    .any(|d| d["path"] == "/dev/vnet/tun" && d["type"] == "c"),
                "{devices:?}"
            );
            assert!(
                rules
                    .iter()
                    .any(|r| r["major"] == 10 && r["access"] == "rw"),
                "{rules:?}"
            );
        }
        let empty = tempfile::tempdir().unwrap();
        let (devices, _) =
            build(&dev(empty.path().to_str().unwrap(), "/dev/x"), false, false).unwrap();
        assert!(devices.is_empty(), "{devices:?}");
        let file = empty.path().join("f");
        std::fs::write(&file, "").unwrap();
        let e = build(&dev(file.to_str().unwrap(), "/dev/x"), false, false).unwrap_err();
        assert!(e.to_string().contains("not a device node"), "{e}");
    }
}
