//! vessel-shim: the per-VM host process. One shim runs one microVM: it reads a spec, boots the
//! guest with `vessel-vmm`, and exits with the guest's outcome.
//!
//! Exit status: 0 poweroff, 10 reboot, 11 panic, 12 stopped by a signal, 1 error.

use std::path::Path;

use vessel_vmm::vm::{Outcome, VmConfig};

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

/// A VM spec: the VM configuration, as JSON or (for a `.toml` file) TOML.
pub type Spec = VmConfig;

/// Reads a spec from a JSON or TOML file.
pub fn read_spec(path: &Path) -> Result<Spec, SpecError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| SpecError::Read {
        path: p.clone(),
        source,
    })?;
    if path.extension().is_some_and(|e| e == "toml") {
        toml::from_str(&text).map_err(|e| SpecError::Parse {
            path: p,
            detail: e.to_string(),
        })
    } else {
        serde_json::from_str(&text).map_err(|e| SpecError::Parse {
            path: p,
            detail: e.to_string(),
        })
    }
}

/// Removes the host files a VM of `spec` leaves when its shim is killed: the vsock socket,
/// unless a live process still accepts connections on it. Returns what was removed.
pub fn cleanup(spec: &Spec) -> std::io::Result<Vec<std::path::PathBuf>> {
    let mut removed = Vec::new();
    if let Some(v) = &spec.vsock {
        let p = &v.uds_path;
        if p.exists() {
            match std::os::unix::net::UnixStream::connect(p) {
                Ok(_) => {} // alive: not ours to remove
                Err(_) => {
                    std::fs::remove_file(p)?;
                    removed.push(p.clone());
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
        assert_eq!((s.mem_mib, s.vcpus), (128, 2));
        let t = d.path().join("s.toml");
        std::fs::write(
            &t,
            "kernel = \"/k\"\ninitrd = \"/i\"\nmem_mib = 64\nvcpus = 1\nconsole = \"stderr\"\n",
        )
        .unwrap();
        let s = read_spec(&t).unwrap();
        assert_eq!(s.initrd.as_deref(), Some(Path::new("/i")));
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
    fn cleanup_removes_a_dead_socket_only() {
        let d = tempfile::tempdir().unwrap();
        let sock = d.path().join("v.sock");
        let mut spec: Spec = serde_json::from_str(&format!(
            r#"{{"kernel":"/k","mem_mib":64,"vcpus":1,"vsock":{{"uds_path":"{}"}}}}"#,
            sock.display()
        ))
        .unwrap();
        let live = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        assert!(cleanup(&spec).unwrap().is_empty());
        drop(live); // a bound socket whose listener is gone: what SIGKILL leaves
        assert_eq!(cleanup(&spec).unwrap(), vec![sock.clone()]);
        assert!(!sock.exists());
        spec.vsock = None;
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
