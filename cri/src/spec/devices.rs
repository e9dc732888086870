//! The container's devices and device cgroup rules: the standard character devices (for a
//! privileged container, every device), then the request's device nodes, each with its rule.

use super::{invalid, SpecError};
use serde_json::{json, Value};
use vessel_cri_api::v1 as cri;

/// The spec's `linux.devices` and the device cgroup rules (`linux.resources.devices`).
pub(super) fn build(
    c: &cri::ContainerConfig,
    privileged: bool,
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
    Ok((devices, dev_rules))
}
