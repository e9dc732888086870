//! The host's SELinux: whether it is enabled, and relabelling the host paths of CRI mounts
//! that ask for it (`Mount.selinux_relabel`), for flat and VM pods alike (a VM pod's volumes
//! are the host's directories, shared into the guest). As containerd does: the path and
//! everything under it get the container's file label, and system directories are refused.

use std::path::Path;

/// The paths a relabel is refused for: relabelling them would break the host (as
/// go-selinux refuses them for containerd and CRI-O).
const REFUSED: &[&str] = &[
    "/",
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/etc/passwd",
    "/etc/pki",
    "/etc/shadow",
    "/home",
    "/lib",
    "/lib64",
    "/media",
    "/opt",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/srv",
    "/sys",
    "/tmp",
    "/usr",
    "/var",
    "/var/lib",
    "/var/log",
    "/var/run",
    "/var/spool",
];

#[derive(Debug, thiserror::Error)]
pub enum RelabelError {
    #[error("relabelling {0} is refused: it is a system directory")]
    SystemPath(String),
    #[error("relabelling {path} with {label}: {source}")]
    Io {
        path: String,
        label: String,
        source: std::io::Error,
    },
}

/// Whether SELinux is enabled on the host (a fact of the boot: read once).
pub fn enabled() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| Path::new("/sys/fs/selinux/enforce").exists())
}

/// The file label of a container's mounts: container-selinux's `container_file_t`, at the
/// level (MCS categories) of the container's `selinux_options`, or `s0` without one.
pub fn mount_label(options: Option<&k8s_cri::v1::SeLinuxOption>) -> String {
    let level = options
        .map(|o| o.level.as_str())
        .filter(|l| !l.is_empty())
        .unwrap_or("s0");
    format!("system_u:object_r:container_file_t:{level}")
}

/// Gives `path` and everything under it (not following links) the file label `label`.
pub fn relabel(path: &Path, label: &str) -> Result<(), RelabelError> {
    let clean = path.to_string_lossy();
    let trimmed = clean.trim_end_matches('/');
    let key = if trimmed.is_empty() { "/" } else { trimmed };
    if REFUSED.contains(&key) {
        return Err(RelabelError::SystemPath(key.to_string()));
    }
    let io = |p: &Path, source| RelabelError::Io {
        path: p.display().to_string(),
        label: label.to_string(),
        source,
    };
    // The value as libselinux writes it: the context and its NUL.
    let mut value = label.as_bytes().to_vec();
    value.push(0);
    let mut stack = vec![path.to_path_buf()];
    while let Some(p) = stack.pop() {
        set_label(&p, &value).map_err(|e| io(&p, e))?;
        let meta = std::fs::symlink_metadata(&p).map_err(|e| io(&p, e))?;
        if meta.is_dir() {
            for e in std::fs::read_dir(&p).map_err(|e| io(&p, e))? {
                stack.push(e.map_err(|e| io(&p, e))?.path());
            }
        }
    }
    Ok(())
}

fn set_label(p: &Path, value: &[u8]) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `c` and the attribute name are NUL-terminated strings and `value` a buffer of
    // the length given, all alive for the call; lsetxattr does not follow a final link.
    let r = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            c"security.selinux".as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn label_of(p: &Path) -> Option<String> {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        let mut buf = [0u8; 256];
        // SAFETY: NUL-terminated strings and a buffer of the length given.
        let n = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                c"security.selinux".as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        (n > 0).then(|| String::from_utf8_lossy(&buf[..n as usize]).into_owned())
    }

    #[test]
    fn system_directories_are_refused() {
        for p in ["/", "/etc", "/usr/", "/var/lib"] {
            assert!(
                matches!(relabel(Path::new(p), "x"), Err(RelabelError::SystemPath(_))),
                "{p}"
            );
        }
    }

    #[test]
    fn the_label_follows_the_containers_level() {
        let o = k8s_cri::v1::SeLinuxOption {
            level: "s0:c1,c2".into(),
            ..Default::default()
        };
        assert_eq!(
            mount_label(Some(&o)),
            "system_u:object_r:container_file_t:s0:c1,c2"
        );
        assert_eq!(mount_label(None), "system_u:object_r:container_file_t:s0");
    }

    #[test]
    fn a_tree_is_relabelled_without_following_links() {
        // Writing security.* attributes needs CAP_SYS_ADMIN (root), where no LSM owns them.
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            println!("SKIP a_tree_is_relabelled_without_following_links: needs root");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let vol = d.path().join("vol");
        std::fs::create_dir_all(vol.join("a/b")).unwrap();
        std::fs::write(vol.join("a/b/f"), "x").unwrap();
        std::os::unix::fs::symlink(outside.path(), vol.join("link")).unwrap();
        let label = "system_u:object_r:container_file_t:s0:c1,c2";
        match relabel(&vol, label) {
            Ok(()) => {}
            // A host whose LSM refuses a label it does not know (SELinux off, another LSM).
            Err(RelabelError::Io { source, .. })
                if matches!(source.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)) =>
            {
                println!("SKIP a_tree_is_relabelled_without_following_links: {source}");
                return;
            }
            Err(e) => panic!("{e}"),
        }
        let want = format!("{label}\0");
        for p in ["", "a", "a/b", "a/b/f"] {
            assert_eq!(
                label_of(&vol.join(p)).as_deref(),
                Some(want.as_str()),
                "{p}"
            );
        }
        assert_eq!(label_of(outside.path()), None);
    }
}
