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
pub fn mount_label(options: Option<&vessel_cri_api::v1::SeLinuxOption>) -> String {
    let level = options
        .map(|o| o.level.as_str())
        .filter(|l| !l.is_empty())
        .unwrap_or("s0");
    format!("system_u:object_r:container_file_t:{level}")
}

/// Gives `path` and everything under it (not following links below it) the file label
/// `label`. The path is resolved first (a link names its target, `..` is gone), then checked
/// against the system directories. A tree whose top already has the label is left as it
/// is (a container's restart does not walk it again), and an entry removed during the walk
/// is skipped.
pub fn relabel(path: &Path, label: &str) -> Result<(), RelabelError> {
    let io = |p: &Path, source| RelabelError::Io {
        path: p.display().to_string(),
        label: label.to_string(),
        source,
    };
    if !path.is_absolute() {
        return Err(io(path, std::io::Error::from_raw_os_error(libc::EINVAL)));
    }
    let path = std::fs::canonicalize(path).map_err(|e| io(path, e))?;
    let key = path.to_string_lossy();
    if REFUSED.contains(&key.as_ref()) {
        return Err(RelabelError::SystemPath(key.into_owned()));
    }
    // The value as libselinux writes it: the context and its NUL.
    let mut value = label.as_bytes().to_vec();
    value.push(0);
    if get_label(&path).as_deref() == Some(value.as_slice()) {
        return Ok(());
    }
    let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    let mut stack = vec![path.clone()];
    while let Some(p) = stack.pop() {
        let top = p == path;
        let r = set_label(&p, &value).and_then(|()| std::fs::symlink_metadata(&p));
        let meta = match r {
            Ok(m) => m,
            Err(e) if !top && gone(&e) => continue,
            Err(e) => return Err(io(&p, e)),
        };
        if meta.is_dir() {
            let entries = match std::fs::read_dir(&p) {
                Ok(d) => d,
                Err(e) if !top && gone(&e) => continue,
                Err(e) => return Err(io(&p, e)),
            };
            for e in entries {
                match e {
                    Ok(e) => stack.push(e.path()),
                    Err(e) if gone(&e) => {}
                    Err(e) => return Err(io(&p, e)),
                }
            }
        }
    }
    Ok(())
}

/// The `security.selinux` attribute of `p` (not following a final link), if it has one.
fn get_label(p: &Path) -> Option<Vec<u8>> {
    let mut buf = [0u8; 256];
    let n = rustix::fs::lgetxattr(p, "security.selinux", &mut buf).ok()?;
    Some(buf[..n].to_vec())
}

/// Sets `p`'s `security.selinux` attribute (not following a final link).
fn set_label(p: &Path, value: &[u8]) -> std::io::Result<()> {
    rustix::fs::lsetxattr(
        p,
        "security.selinux",
        value,
        rustix::fs::XattrFlags::empty(),
    )
    .map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn label_of(p: &Path) -> Option<String> {
        get_label(p).map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    #[test]
    fn system_directories_are_refused() {
        for p in [
            "/",
            "/etc",
            "/usr/",
            "/var/lib",
            "//etc",
            "/usr/../etc",
            "/./var/lib/",
        ] {
            assert!(
                matches!(relabel(Path::new(p), "x"), Err(RelabelError::SystemPath(_))),
                "{p}"
            );
        }
    }

    #[test]
    fn the_label_follows_the_containers_level() {
        let o = vessel_cri_api::v1::SeLinuxOption {
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
        // Through a link to it, the tree itself is what gets the label; a relative path is
        // refused.
        std::os::unix::fs::symlink(&vol, d.path().join("to-vol")).unwrap();
        let other = "system_u:object_r:container_file_t:s0:c3,c4";
        relabel(&d.path().join("to-vol"), other).unwrap();
        assert_eq!(label_of(&vol.join("a/b/f")), Some(format!("{other}\0")));
        assert!(relabel(Path::new("relative"), other).is_err());
    }
}
