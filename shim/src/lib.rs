//! vessel-shim: the per-VM host process. One shim runs one microVM: it reads a spec, boots the
//! guest with `vessel-vmm`, and exits with the guest's outcome.
//!
//! Exit status: 0 poweroff, 10 reboot, 11 panic, 12 stopped by a signal, 1 error.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vessel_vmm::vm::{Outcome, VmConfig};

pub mod control;
pub mod jail;
pub mod logs;
pub mod podnet;
pub mod seccomp;

static HOST_PID: std::sync::OnceLock<u32> = std::sync::OnceLock::new();

/// The shim's pid as the host sees it: the supervisor's, when the VMM runs jailed in a pid
/// namespace of its own (where it is pid 1); the process's own otherwise.
pub fn host_pid() -> u32 {
    HOST_PID.get().copied().unwrap_or_else(std::process::id)
}

pub(crate) fn set_host_pid(pid: u32) {
    let _ = HOST_PID.set(pid);
}

/// Errors reading a spec.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("reading spec {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("spec {path}: {detail}")]
    Parse { path: String, detail: String },
}

/// The shim's own keys of a spec, beside the VM configuration's.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShimConfig {
    /// The control socket (0600): disk slots and log files (docs/vm-pods.md).
    #[serde(default)]
    pub control_socket: Option<PathBuf>,
    /// The host vsock port the guest sends container logs to; the shim listens on
    /// `<vsock uds_path>_<port>`. Needs `vsock`.
    #[serde(default)]
    pub log_port: Option<u32>,
    /// The secret every log connection must start with (`<token> <container-id>\n`): the
    /// shim drops a connection without it. Absent: the id line alone.
    #[serde(default)]
    pub log_token: Option<String>,
    /// The pod network: a tap in this namespace, joined to its CNI interface, becomes the
    /// guest's first virtio-net interface ([`podnet`]).
    #[serde(default)]
    pub pod_net: Option<podnet::PodNet>,
    /// The file the shim's stderr goes to: rotated past `vessel_agent::logs::OWN_LOG_MAX`.
    #[serde(default)]
    pub log_file: Option<PathBuf>,
    /// Run the VMM in its jail ([`jail`]): needs root. vesseld's pods always do.
    #[serde(default)]
    pub jail: bool,
    /// With `jail`: what a system call outside its thread's allow-list does ([`seccomp`]).
    #[serde(default)]
    pub seccomp: seccomp::Mode,
}

/// A shim spec, as JSON or (for a `.toml` file) TOML: the VM configuration and, at the same
/// level, the shim's keys. Unknown keys are an error.
#[derive(Debug, Clone)]
pub struct Spec {
    pub vm: VmConfig,
    pub shim: ShimConfig,
}

impl Spec {
    /// The log listener's socket path, if the spec has one.
    pub fn log_socket(&self) -> Option<PathBuf> {
        let port = self.shim.log_port?;
        let v = self.vm.vsock.as_ref()?;
        let mut p = v.uds_path.clone().into_os_string();
        p.push(format!("_{port}"));
        Some(PathBuf::from(p))
    }

    /// The spec as the JSON the shim reads ([`Spec::from_value`]): the VM configuration's
    /// keys and the shim's at one level.
    pub fn to_value(&self) -> Result<serde_json::Value, serde_json::Error> {
        let mut v = serde_json::to_value(&self.vm)?;
        if let (Some(obj), serde_json::Value::Object(shim)) =
            (v.as_object_mut(), serde_json::to_value(&self.shim)?)
        {
            obj.extend(shim.into_iter().filter(|(_, x)| !x.is_null()));
        }
        Ok(v)
    }

    /// Parses a spec from a JSON value (what a TOML file reads as, too).
    pub fn from_value(mut v: serde_json::Value) -> Result<Spec, String> {
        let obj = v
            .as_object_mut()
            .ok_or_else(|| "a spec is an object".to_string())?;
        fn key<T: serde::de::DeserializeOwned>(
            obj: &mut serde_json::Map<String, serde_json::Value>,
            k: &str,
        ) -> Result<Option<T>, String> {
            obj.remove(k)
                .map(|x| serde_json::from_value(x).map_err(|e| format!("{k}: {e}")))
                .transpose()
        }
        let shim = ShimConfig {
            control_socket: key(obj, "control_socket")?,
            log_port: key(obj, "log_port")?,
            log_token: key(obj, "log_token")?,
            pod_net: key(obj, "pod_net")?,
            log_file: key(obj, "log_file")?,
            jail: key(obj, "jail")?.unwrap_or(false),
            seccomp: key(obj, "seccomp")?.unwrap_or_default(),
        };
        let vm: VmConfig = serde_json::from_value(v).map_err(|e| e.to_string())?;
        if shim.log_port.is_some() && vm.vsock.is_none() {
            return Err("log_port needs a vsock device".into());
        }
        Ok(Spec { vm, shim })
    }
}

/// Reads a spec from a JSON or TOML file.
pub fn read_spec(path: &Path) -> Result<Spec, SpecError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| SpecError::Read {
        path: p.clone(),
        source,
    })?;
    let parse = |detail: String| SpecError::Parse {
        path: p.clone(),
        detail,
    };
    let v: serde_json::Value = if path.extension().is_some_and(|e| e == "toml") {
        toml::from_str(&text).map_err(|e| parse(e.to_string()))?
    } else {
        serde_json::from_str(&text).map_err(|e| parse(e.to_string()))?
    };
    Spec::from_value(v).map_err(parse)
}

/// Removes the host files a VM of `spec` leaves when its shim is killed: the vsock socket,
/// the log socket and the control socket, each unless a live process still accepts
/// connections on it. Returns what was removed.
pub fn cleanup(spec: &Spec) -> std::io::Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let paths = [
        spec.vm.vsock.as_ref().map(|v| v.uds_path.clone()),
        spec.log_socket(),
        spec.shim.control_socket.clone(),
    ];
    for p in paths.into_iter().flatten() {
        if p.exists() {
            match std::os::unix::net::UnixStream::connect(&p) {
                Ok(_) => {} // alive: not ours to remove
                Err(_) => {
                    std::fs::remove_file(&p)?;
                    removed.push(p);
                }
            }
        }
    }
    Ok(removed)
}

/// The shim's exit status for an outcome.
pub fn exit_code(o: &Outcome) -> i32 {
    match o {
        Outcome::Poweroff => 0,
        Outcome::Reboot => 10,
        Outcome::Panic => 11,
        Outcome::Stopped => 12,
        Outcome::Error(_) => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_and_toml_specs() {
        let d = tempfile::tempdir().unwrap();
        let j = d.path().join("s.json");
        std::fs::write(
            &j,
            r#"{"kernel":"/k","mem_mib":128,"vcpus":2,"console":{"file":"/tmp/c"}}"#,
        )
        .unwrap();
        let s = read_spec(&j).unwrap();
        assert_eq!((s.vm.mem_mib, s.vm.vcpus), (128, 2));
        assert!(s.shim.control_socket.is_none() && s.shim.log_port.is_none());
        assert_eq!(s.vm.spare_disks, 0);
        let t = d.path().join("s.toml");
        std::fs::write(
            &t,
            "kernel = \"/k\"\ninitrd = \"/i\"\nmem_mib = 64\nvcpus = 1\nconsole = \"stderr\"\n",
        )
        .unwrap();
        let s = read_spec(&t).unwrap();
        assert_eq!(s.vm.initrd.as_deref(), Some(Path::new("/i")));
        assert!(matches!(
            read_spec(&d.path().join("none.json")),
            Err(SpecError::Read { .. })
        ));
        std::fs::write(&j, "{").unwrap();
        assert!(matches!(read_spec(&j), Err(SpecError::Parse { .. })));
        // A misspelt key is an error, not silently ignored.
        std::fs::write(
            &j,
            r#"{"kernel":"/k","mem_mib":128,"vcpus":1,"mem_mb":256}"#,
        )
        .unwrap();
        match read_spec(&j) {
            Err(SpecError::Parse { detail, .. }) => assert!(detail.contains("mem_mb"), "{detail}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn shim_keys_beside_the_vm_config() {
        let d = tempfile::tempdir().unwrap();
        let j = d.path().join("s.json");
        std::fs::write(
            &j,
            r#"{"kernel":"/k","mem_mib":128,"vcpus":1,"spare_disks":3,
                "control_socket":"/run/x/control.sock","log_port":1025,
                "vsock":{"uds_path":"/run/x/vsock.sock"}}"#,
        )
        .unwrap();
        let s = read_spec(&j).unwrap();
        assert_eq!(s.vm.spare_disks, 3);
        assert_eq!(
            s.shim.control_socket.as_deref(),
            Some(Path::new("/run/x/control.sock"))
        );
        assert_eq!(s.shim.log_port, Some(1025));
        assert_eq!(
            s.log_socket().as_deref(),
            Some(Path::new("/run/x/vsock.sock_1025"))
        );
        let t = d.path().join("s.toml");
        std::fs::write(
            &t,
            "kernel = \"/k\"\nmem_mib = 64\nvcpus = 1\nspare_disks = 2\ncontrol_socket = \"/c\"\n",
        )
        .unwrap();
        let s = read_spec(&t).unwrap();
        assert_eq!(s.vm.spare_disks, 2);
        assert_eq!(s.shim.control_socket.as_deref(), Some(Path::new("/c")));
        assert!(s.log_socket().is_none());
        // log_port needs vsock; shim keys are typed; unknown keys still fail.
        for (body, what) in [
            (
                r#"{"kernel":"/k","mem_mib":64,"vcpus":1,"log_port":1025}"#,
                "vsock",
            ),
            (
                r#"{"kernel":"/k","mem_mib":64,"vcpus":1,"log_port":"x"}"#,
                "log_port",
            ),
            (
                r#"{"kernel":"/k","mem_mib":64,"vcpus":1,"control_sock":"/c"}"#,
                "control_sock",
            ),
            (
                r#"{"kernel":"/k","mem_mib":64,"vcpus":1,"spare_disks":-1}"#,
                "-1",
            ),
            (r#"[1]"#, "object"),
        ] {
            std::fs::write(&j, body).unwrap();
            match read_spec(&j) {
                Err(SpecError::Parse { detail, .. }) => {
                    assert!(detail.contains(what), "{body}: {detail}")
                }
                other => panic!("{body}: {other:?}"),
            }
        }
    }

    #[test]
    fn cleanup_removes_a_dead_socket_only() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("v.sock");
        let ctl = d.path().join("control.sock");
        let mut spec = Spec::from_value(
            serde_json::from_str(&format!(
                r#"{{"kernel":"/k","mem_mib":64,"vcpus":1,"vsock":{{"uds_path":"{}"}},
                    "log_port":1025,"control_socket":"{}"}}"#,
                sock.display(),
                ctl.display()
            ))
            .unwrap(),
        )
        .unwrap();
        let logs = d.path().join("v.sock_1025");
        let live = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let live_logs = std::os::unix::net::UnixListener::bind(&logs).unwrap();
        let live_ctl = std::os::unix::net::UnixListener::bind(&ctl).unwrap();
        assert!(cleanup(&spec).unwrap().is_empty());
        // Bound sockets whose listeners are gone: what SIGKILL leaves.
        drop(live);
        drop(live_ctl);
        assert_eq!(cleanup(&spec).unwrap(), vec![sock.clone(), ctl.clone()]);
        drop(live_logs);
        assert_eq!(cleanup(&spec).unwrap(), vec![logs.clone()]);
        assert!(!sock.exists() && !logs.exists() && !ctl.exists());
        spec.vm.vsock = None;
        assert!(cleanup(&spec).unwrap().is_empty());
    }

    #[test]
    fn exit_codes_are_distinct() {
        let all = [
            Outcome::Poweroff,
            Outcome::Reboot,
            Outcome::Panic,
            Outcome::Stopped,
            Outcome::Error(String::new()),
        ];
        let mut codes: Vec<i32> = all.iter().map(exit_code).collect();
        codes.dedup();
        assert_eq!(codes.len(), all.len());
    }
}
