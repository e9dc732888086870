//! CDI: the Container Device Interface (cncf-tags/container-device-interface, spec 0.5-0.8).
//!
//! A CRI `ContainerConfig.cdi_devices` entry (or a `cdi.k8s.io/<key>` annotation, the older
//! form) names a device as `vendor.com/class=name`. Vendors describe their devices in spec
//! files, JSON or YAML, in the CDI spec directories (`/etc/cdi`, then `/var/run/cdi`, which
//! wins for the same device). A device's `containerEdits`, and those of its spec file, are
//! applied to the container's OCI spec: environment, device nodes (with their cgroup device
//! rule), mounts, hooks and additional groups. Files that do not parse are skipped with a
//! warning, so one vendor's broken file does not take the others' devices away.

use serde::Deserialize;
use serde_json::{json, Value};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Annotation prefix of CDI device requests (CDI's `AnnotationPrefix`).
pub const ANNOTATION_PREFIX: &str = "cdi.k8s.io/";

/// The OCI hooks a CDI spec may add to.
const HOOKS: &[&str] = &[
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
];

#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    #[error("CDI device name {0:?} is not vendor.com/class=name")]
    BadName(String),
    #[error("CDI device {name} is not in any spec file under {dirs}{skipped}")]
    Unresolved {
        name: String,
        dirs: String,
        skipped: String,
    },
    #[error("CDI device {name}: {reason}")]
    BadEdit { name: String, reason: String },
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    #[allow(dead_code)]
    cdi_version: String,
    kind: String,
    #[serde(default)]
    devices: Vec<Device>,
    #[serde(default)]
    container_edits: Edits,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Device {
    name: String,
    #[serde(default)]
    container_edits: Edits,
}

/// What a device (or its spec file) changes in a container.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Edits {
    #[serde(default)]
    env: Vec<String>,
    #[serde(default)]
    device_nodes: Vec<DeviceNode>,
    #[serde(default)]
    mounts: Vec<Mount>,
    #[serde(default)]
    hooks: Vec<Hook>,
    #[serde(default, rename = "additionalGIDs")]
    additional_gids: Vec<u32>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
struct DeviceNode {
    path: String,
    host_path: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    major: Option<i64>,
    minor: Option<i64>,
    file_mode: Option<u32>,
    permissions: Option<String>,
    uid: Option<u32>,
    gid: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
struct Mount {
    host_path: String,
    container_path: String,
    #[serde(default)]
    options: Vec<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
struct Hook {
    hook_name: String,
    path: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: Vec<String>,
    timeout: Option<i64>,
}

/// The CDI device names a container asks for: its `cdi_devices`, then the values of its
/// `cdi.k8s.io/*` annotations (comma-separated), in order, each once.
pub fn requested(
    devices: &[vessel_cri_api::v1::CdiDevice],
    annotations: &std::collections::HashMap<String, String>,
) -> Vec<String> {
    let mut keys: Vec<&String> = annotations
        .keys()
        .filter(|k| k.starts_with(ANNOTATION_PREFIX))
        .collect();
    keys.sort();
    let mut out: Vec<String> = Vec::new();
    let names = devices.iter().map(|d| d.name.trim().to_string()).chain(
        keys.into_iter()
            .flat_map(|k| annotations[k].split(','))
            .map(|s| s.trim().to_string()),
    );
    for n in names {
        if !n.is_empty() && !out.contains(&n) {
            out.push(n);
        }
    }
    out
}

/// `(kind, name)` of a fully qualified device name `vendor.com/class=name`.
fn split_name(q: &str) -> Result<(&str, &str), CdiError> {
    let bad = || CdiError::BadName(q.to_string());
    let (kind, name) = q.split_once('=').ok_or_else(bad)?;
    let (vendor, class) = kind.split_once('/').ok_or_else(bad)?;
    let ok = |s: &str, extra: &[u8]| {
        !s.is_empty()
            && s.bytes()
                .all(|c| c.is_ascii_alphanumeric() || extra.contains(&c))
    };
    if !ok(vendor, b"-_.") || !ok(class, b"-_.") || !ok(name, b"-_.:") {
        return Err(bad());
    }
    Ok((kind, name))
}

/// Every spec file in `dirs` (later directories win), with the files that did not parse.
fn load(dirs: &[PathBuf]) -> (Vec<Spec>, Vec<String>) {
    let mut specs = Vec::new();
    let mut skipped = Vec::new();
    for d in dirs {
        let mut files: Vec<PathBuf> = std::fs::read_dir(d)
            .map(|rd| rd.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        files.sort();
        for f in files {
            let ext = f.extension().and_then(|e| e.to_str()).unwrap_or("");
            let parsed: Result<Spec, String> = match ext {
                "json" => std::fs::read(&f)
                    .map_err(|e| e.to_string())
                    .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string())),
                "yaml" | "yml" => std::fs::read(&f)
                    .map_err(|e| e.to_string())
                    .and_then(|b| serde_yaml::from_slice(&b).map_err(|e| e.to_string())),
                _ => continue,
            };
            match parsed {
                Ok(s) => specs.push(s),
                Err(e) => {
                    tracing::warn!(file = %f.display(), error = %e, "CDI spec file skipped");
                    skipped.push(f.display().to_string());
                }
            }
        }
    }
    (specs, skipped)
}

/// The edits for `names`, resolved from the spec files in `dirs`: per device its own edits,
/// and its spec file's once.
pub fn resolve(dirs: &[PathBuf], names: &[String]) -> Result<Vec<(String, Edits)>, CdiError> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    let (specs, skipped) = load(dirs);
    let mut out = Vec::new();
    let mut spec_edits_done: Vec<usize> = Vec::new();
    for q in names {
        let (kind, name) = split_name(q)?;
        // The last directory's (and within it the last file's) definition wins.
        let found = specs.iter().enumerate().rev().find_map(|(i, s)| {
            (s.kind == kind)
                .then(|| s.devices.iter().find(|d| d.name == name))
                .flatten()
                .map(|d| (i, d))
        });
        let Some((i, dev)) = found else {
            return Err(CdiError::Unresolved {
                name: q.clone(),
                dirs: dirs
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                skipped: if skipped.is_empty() {
                    String::new()
                } else {
                    format!(" (unreadable spec files skipped: {})", skipped.join(", "))
                },
            });
        };
        if !spec_edits_done.contains(&i) {
            spec_edits_done.push(i);
            out.push((q.clone(), specs[i].container_edits.clone()));
        }
        out.push((q.clone(), dev.container_edits.clone()));
    }
    Ok(out)
}

/// Applies resolved edits to an OCI runtime spec (JSON).
pub fn apply(spec: &mut Value, edits: &[(String, Edits)]) -> Result<(), CdiError> {
    for (name, e) in edits {
        let bad = |reason: String| CdiError::BadEdit {
            name: name.clone(),
            reason,
        };
        for kv in &e.env {
            let key = kv.split_once('=').map_or(kv.as_str(), |(k, _)| k);
            let env = array(&mut spec["process"]["env"]);
            env.retain(|v| {
                v.as_str()
                    .is_none_or(|s| s.split_once('=').map_or(s, |(k, _)| k) != key)
            });
            env.push(json!(kv));
        }
        for n in &e.device_nodes {
            let node = device_node(n).map_err(bad)?;
            let rule = json!({
                "allow": true,
                "type": node["type"],
                "major": node["major"],
                "minor": node["minor"],
                "access": n.permissions.clone().unwrap_or_else(|| "rwm".into()),
            });
            array(&mut spec["linux"]["devices"]).push(node);
            array(&mut spec["linux"]["resources"]["devices"]).push(rule);
        }
        for m in &e.mounts {
            if !m.container_path.starts_with('/') {
                return Err(bad(format!(
                    "mount container path {:?} is not absolute",
                    m.container_path
                )));
            }
            let kind = m.kind.clone().unwrap_or_else(|| "bind".into());
            let mut options = m.options.clone();
            if kind == "bind" && !options.iter().any(|o| o == "bind" || o == "rbind") {
                options.push("rbind".into());
            }
            array(&mut spec["mounts"]).push(json!({
                "destination": m.container_path,
                "type": kind,
                "source": m.host_path,
                "options": options,
            }));
        }
        for h in &e.hooks {
            if !HOOKS.contains(&h.hook_name.as_str()) {
                return Err(bad(format!("unknown hook {:?}", h.hook_name)));
            }
            let mut hook = json!({"path": h.path});
            if !h.args.is_empty() {
                hook["args"] = json!(h.args);
            }
            if !h.env.is_empty() {
                hook["env"] = json!(h.env);
            }
            if let Some(t) = h.timeout {
                hook["timeout"] = json!(t);
            }
            array(&mut spec["hooks"][h.hook_name.as_str()]).push(hook);
        }
        if !e.additional_gids.is_empty() {
            let gids = array(&mut spec["process"]["user"]["additionalGids"]);
            for g in &e.additional_gids {
                if !gids.iter().any(|v| v.as_u64() == Some(u64::from(*g))) {
                    gids.push(json!(g));
                }
            }
        }
    }
    Ok(())
}

/// The array at `v`, made one if it is null.
fn array(v: &mut Value) -> &mut Vec<Value> {
    if !v.is_array() {
        *v = Value::Array(Vec::new());
    }
    match v {
        Value::Array(a) => a,
        // Made an array just above.
        _ => unreachable!("an array was just made"),
    }
}

/// The OCI `linux.devices` entry of a CDI device node; type and numbers the spec leaves out
/// come from the host's node.
fn device_node(n: &DeviceNode) -> Result<Value, String> {
    if !n.path.starts_with('/') {
        return Err(format!("device path {:?} is not absolute", n.path));
    }
    let host = n.host_path.as_deref().unwrap_or(&n.path);
    let meta = std::fs::metadata(host).ok();
    let (kind, major, minor) = match (&n.kind, n.major, n.minor, &meta) {
        (Some(k), Some(ma), Some(mi), _) => (k.clone(), ma, mi),
        (_, _, _, Some(m)) => {
            let ft = m.file_type();
            let k = if ft.is_char_device() {
                "c"
            } else if ft.is_block_device() {
                "b"
            } else {
                return Err(format!("{host} is not a device node"));
            };
            let rdev = m.rdev();
            (
                n.kind.clone().unwrap_or_else(|| k.into()),
                n.major
                    .unwrap_or_else(|| i64::from(rustix::fs::major(rdev))),
                n.minor
                    .unwrap_or_else(|| i64::from(rustix::fs::minor(rdev))),
            )
        }
        _ => {
            return Err(format!(
                "device node {host} does not exist and the spec gives no type and numbers"
            ))
        }
    };
    if !["c", "b", "u", "p"].contains(&kind.as_str()) {
        return Err(format!("device type {kind:?} is not c, b, u or p"));
    }
    let mode = n
        .file_mode
        .or_else(|| meta.as_ref().map(|m| m.mode() & 0o7777))
        .unwrap_or(0o666);
    Ok(json!({
        "path": n.path,
        "type": kind,
        "major": major,
        "minor": minor,
        "fileMode": mode,
        "uid": n.uid.or_else(|| meta.as_ref().map(|m| m.uid())).unwrap_or(0),
        "gid": n.gid.or_else(|| meta.as_ref().map(|m| m.gid())).unwrap_or(0),
    }))
}

/// The spec directories CDI defines, lowest priority first.
pub fn default_dirs() -> Vec<PathBuf> {
    vec![
        Path::new("/etc/cdi").into(),
        Path::new("/var/run/cdi").into(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn names_from_the_field_and_annotations() {
        let devs = vec![vessel_cri_api::v1::CdiDevice {
            name: "a.com/gpu=0".into(),
        }];
        let ann = std::collections::HashMap::from([
            (
                "cdi.k8s.io/x".to_string(),
                "a.com/gpu=0, b.io/nic=1".to_string(),
            ),
            ("other".to_string(), "c.com/x=1".to_string()),
        ]);
        assert_eq!(requested(&devs, &ann), ["a.com/gpu=0", "b.io/nic=1"]);
        for bad in [
            "gpu=0",
            "a.com/gpu",
            "a.com/=0",
            "a com/gpu=0",
            "a.com/gpu=",
        ] {
            assert!(split_name(bad).is_err(), "{bad}");
        }
        assert_eq!(
            split_name("nvidia.com/gpu=all").unwrap(),
            ("nvidia.com/gpu", "all")
        );
    }

    #[test]
    fn specs_resolve_by_priority_and_apply() {
        let etc = tempfile::tempdir().unwrap();
        let run = tempfile::tempdir().unwrap();
        write(
            etc.path(),
            "vendor.yaml",
            r#"
cdiVersion: "0.6.0"
kind: "vessel.test/dev"
containerEdits:
  env: ["SPEC_WIDE=1"]
devices:
  - name: "null"
    containerEdits:
      env: ["WHICH=etc", "FOO=bar"]
      deviceNodes:
        - path: /dev/vessel-null
          hostPath: /dev/null
      mounts:
        - hostPath: /tmp
          containerPath: /cdi-tmp
          options: ["ro"]
      hooks:
        - hookName: createContainer
          path: /bin/true
          args: ["true", "x"]
      additionalGIDs: [44]
"#,
        );
        write(
            run.path(),
            "vendor.json",
            r#"{"cdiVersion":"0.6.0","kind":"vessel.test/dev","devices":[{"name":"other","containerEdits":{"env":["WHICH=run"]}}]}"#,
        );
        write(run.path(), "broken.yaml", "kind: [unclosed");
        let dirs = vec![etc.path().to_path_buf(), run.path().to_path_buf()];
        let edits = resolve(&dirs, &["vessel.test/dev=null".into()]).unwrap();
        assert_eq!(edits.len(), 2, "the spec's edits, then the device's");
        let mut spec = json!({"process": {"env": ["PATH=/bin", "FOO=old"], "user": {"uid": 0, "gid": 0}}, "linux": {"resources": {"devices": [{"allow": false, "access": "rwm"}]}}, "mounts": []});
        apply(&mut spec, &edits).unwrap();
        let env: Vec<&str> = spec["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert_eq!(env, ["PATH=/bin", "SPEC_WIDE=1", "WHICH=etc", "FOO=bar"]);
        let dev = &spec["linux"]["devices"][0];
        assert_eq!(
            (
                dev["type"].as_str(),
                dev["major"].as_i64(),
                dev["minor"].as_i64()
            ),
            (Some("c"), Some(1), Some(3))
        );
        assert_eq!(spec["linux"]["resources"]["devices"][1]["allow"], true);
        assert_eq!(spec["mounts"][0]["destination"], "/cdi-tmp");
        assert_eq!(spec["mounts"][0]["options"], json!(["ro", "rbind"]));
        assert_eq!(spec["hooks"]["createContainer"][0]["path"], "/bin/true");
        assert_eq!(spec["process"]["user"]["additionalGids"], json!([44]));

        let e = resolve(&dirs, &["vessel.test/dev=missing".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("vessel.test/dev=missing") && e.contains("broken.yaml"),
            "{e}"
        );
        assert!(resolve(&dirs, &["nonsense".into()]).is_err());
        let bad_hook = vec![(
            "x".to_string(),
            Edits {
                hooks: vec![Hook {
                    hook_name: "whenever".into(),
                    path: "/bin/true".into(),
                    ..Default::default()
                }],
                ..Default::default()
            },
        )];
        assert!(apply(&mut spec, &bad_hook).is_err());
    }
}
