//! VM mode: the pod's identity and files. `ConfigureSandbox` (hostname, sysctls) and
//! `WriteFiles`/`RemoveFiles` under [`FILES_DIR`]. Paths in requests are guest paths; the
//! roots are parameters so tests can work in a temporary directory.

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::AgentError;
use crate::proto::{file_entry, FileEntry};

/// The only directory `WriteFiles`/`RemoveFiles` touch.
pub const FILES_DIR: &str = "/run/vessel/files";

fn invalid(msg: String) -> AgentError {
    AgentError::InvalidArgument(msg)
}

/// Maps an absolute guest path under [`FILES_DIR`] to the same place under `root`, refusing
/// relative paths, `.`/`..` components, NULs and the directory itself.
pub fn resolve(root: &Path, path: &str) -> Result<PathBuf, AgentError> {
    let rest = path
        .strip_prefix(FILES_DIR)
        .and_then(|r| r.strip_prefix('/'))
        .ok_or_else(|| invalid(format!("path {path:?} is not under {FILES_DIR}/")))?;
    if path.contains('\0') {
        return Err(invalid(format!("path {path:?} contains a NUL")));
    }
    let mut out = root.to_path_buf();
    let mut any = false;
    for seg in rest.split('/') {
        match seg {
            "" => continue,
            "." | ".." => return Err(invalid(format!("path {path:?} has a {seg:?} component"))),
            s => {
                out.push(s);
                any = true;
            }
        }
    }
    if !any {
        return Err(invalid(format!("path {path:?} names {FILES_DIR} itself")));
    }
    Ok(out)
}

/// Refuses a path whose existing ancestors between `root` and it include a symlink (which
/// could lead a write outside `root`); creates the missing ones (0755).
fn prepare_parents(root: &Path, target: &Path, create: bool) -> Result<(), AgentError> {
    let rel = target.strip_prefix(root).expect("resolved under root");
    let mut cur = root.to_path_buf();
    if create {
        std::fs::create_dir_all(root)
            .map_err(|e| AgentError::internal(format!("creating {}", root.display()), e))?;
    }
    let comps: Vec<_> = rel.components().collect();
    for c in &comps[..comps.len().saturating_sub(1)] {
        cur.push(c);
        match std::fs::symlink_metadata(&cur) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(invalid(format!(
                    "{} is a symlink: refusing to write through it",
                    cur.display()
                )))
            }
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(invalid(format!("{} is not a directory", cur.display())));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
                std::fs::create_dir(&cur)
                    .map_err(|e| AgentError::internal(format!("creating {}", cur.display()), e))?;
                std::fs::set_permissions(&cur, std::fs::Permissions::from_mode(0o755))
                    .map_err(|e| AgentError::internal("chmod", e))?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(AgentError::internal(format!("{}", cur.display()), e)),
        }
    }
    Ok(())
}

fn tmp_name(target: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    target.with_file_name(format!(
        ".{name}.vessel-tmp-{}",
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

fn chown(p: &Path, uid: u32, gid: u32) -> Result<(), AgentError> {
    std::os::unix::fs::lchown(p, Some(uid), Some(gid))
        .map_err(|e| AgentError::internal(format!("chown {}", p.display()), e))
}

/// Writes one entry under `root` (see [`resolve`]).
pub fn write_entry(root: &Path, e: &FileEntry) -> Result<(), AgentError> {
    let target = resolve(root, &e.path)?;
    prepare_parents(root, &target, true)?;
    let internal = |what: &str| {
        let what = format!("{what} {}", target.display());
        move |err: std::io::Error| AgentError::internal(what, err)
    };
    match &e.kind {
        Some(file_entry::Kind::Data(data)) => {
            let mode = if e.mode & 0o7777 == 0 {
                0o644
            } else {
                e.mode & 0o7777
            };
            let tmp = tmp_name(&target);
            let r = (|| {
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&tmp)
                    .map_err(internal("creating"))?;
                f.write_all(data).map_err(internal("writing"))?;
                chown(&tmp, e.uid, e.gid)?;
                // After chown, which clears set-id bits.
                f.set_permissions(std::fs::Permissions::from_mode(mode))
                    .map_err(internal("chmod"))?;
                if target.is_dir() && !target.is_symlink() {
                    return Err(invalid(format!(
                        "{} is a directory; remove it first",
                        e.path
                    )));
                }
                std::fs::rename(&tmp, &target).map_err(internal("replacing"))
            })();
            if r.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            r
        }
        Some(file_entry::Kind::Dir(_)) => {
            let mode = if e.mode & 0o7777 == 0 {
                0o755
            } else {
                e.mode & 0o7777
            };
            match std::fs::symlink_metadata(&target) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    std::fs::remove_file(&target).map_err(internal("replacing"))?;
                    std::fs::create_dir(&target).map_err(internal("creating"))?;
                }
                Err(_) => std::fs::create_dir(&target).map_err(internal("creating"))?,
            }
            chown(&target, e.uid, e.gid)?;
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode))
                .map_err(internal("chmod"))
        }
        Some(file_entry::Kind::Symlink(to)) => {
            if to.is_empty() || to.contains('\0') {
                return Err(invalid(format!("bad symlink target {to:?} for {}", e.path)));
            }
            let tmp = tmp_name(&target);
            std::os::unix::fs::symlink(to, &tmp).map_err(internal("creating symlink"))?;
            let r = chown(&tmp, e.uid, e.gid).and_then(|()| {
                if target.is_dir() && !target.is_symlink() {
                    return Err(invalid(format!(
                        "{} is a directory; remove it first",
                        e.path
                    )));
                }
                std::fs::rename(&tmp, &target).map_err(internal("replacing"))
            });
            if r.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            r
        }
        None => Err(invalid(format!(
            "entry {} has no data, dir or symlink",
            e.path
        ))),
    }
}

/// Writes `entries` in order under `root`, stopping at the first error.
pub fn write_files(root: &Path, entries: &[FileEntry]) -> Result<(), AgentError> {
    // Check every path before touching anything.
    for e in entries {
        resolve(root, &e.path)?;
    }
    for e in entries {
        write_entry(root, e)?;
    }
    Ok(())
}

/// Removes `paths` (recursively; a symlink itself, never what it points to) under `root`;
/// missing paths are fine.
pub fn remove_files(root: &Path, paths: &[String]) -> Result<(), AgentError> {
    let targets = paths
        .iter()
        .map(|p| resolve(root, p))
        .collect::<Result<Vec<_>, _>>()?;
    for t in targets {
        prepare_parents(root, &t, false)?;
        let r = match std::fs::symlink_metadata(&t) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&t),
            Ok(_) => std::fs::remove_file(&t),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        };
        match r {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(AgentError::internal(format!("removing {}", t.display()), e)),
        }
    }
    Ok(())
}

/// Checks a hostname: 1-64 bytes of letters, digits, `-` and `.`.
pub fn validate_hostname(h: &str) -> Result<(), AgentError> {
    if h.is_empty()
        || h.len() > 64
        || !h
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
    {
        return Err(invalid(format!("invalid hostname {h:?}")));
    }
    Ok(())
}

/// The file under `proc_sys` (`/proc/sys`) for a sysctl name (`net.ipv4.ip_forward` or
/// `net/ipv4/ip_forward`).
pub fn sysctl_path(proc_sys: &Path, name: &str) -> Result<PathBuf, AgentError> {
    let sep = if name.contains('/') { '/' } else { '.' };
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'/'));
    let segs: Vec<&str> = name.split(sep).collect();
    if name.is_empty() || !ok_chars || segs.iter().any(|s| s.is_empty() || *s == "." || *s == "..")
    {
        return Err(invalid(format!("invalid sysctl name {name:?}")));
    }
    let mut p = proc_sys.to_path_buf();
    for s in segs {
        p.push(s);
    }
    Ok(p)
}

/// Applies `sysctls` under `proc_sys`; all names are checked before any is written.
pub fn apply_sysctls(proc_sys: &Path, sysctls: &HashMap<String, String>) -> Result<(), AgentError> {
    let mut items: Vec<(&String, &String, PathBuf)> = Vec::new();
    for (k, v) in sysctls {
        let p = sysctl_path(proc_sys, k)?;
        if !p.is_file() {
            return Err(invalid(format!(
                "sysctl {k:?} is not known to the guest kernel"
            )));
        }
        if v.contains('\n') {
            return Err(invalid(format!("sysctl {k:?} value has a newline")));
        }
        items.push((k, v, p));
    }
    items.sort_by(|a, b| a.0.cmp(b.0));
    for (k, v, p) in items {
        std::fs::write(&p, v.as_bytes()).map_err(|e| {
            if e.kind() == std::io::ErrorKind::InvalidInput {
                invalid(format!("sysctl {k}={v}: {e}"))
            } else {
                AgentError::internal(format!("sysctl {k}={v}"), e)
            }
        })?;
        tracing::info!(sysctl = %k, value = %v, "sysctl set");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn data(path: &str, bytes: &[u8], mode: u32) -> FileEntry {
        FileEntry {
            path: path.into(),
            mode,
            uid: 0,
            gid: 0,
            kind: Some(file_entry::Kind::Data(bytes.to_vec())),
        }
    }

    #[test]
    fn path_validation() {
        let root = Path::new("/r");
        assert_eq!(
            resolve(root, "/run/vessel/files/pod/hosts").unwrap(),
            Path::new("/r/pod/hosts")
        );
        assert_eq!(
            resolve(root, "/run/vessel/files//a/").unwrap(),
            Path::new("/r/a")
        );
        for bad in [
            "",
            "pod/hosts",
            "run/vessel/files/a",
            "/run/vessel/files",
            "/run/vessel/files/",
            "/run/vessel/filesx/a",
            "/run/vessel/files/../x",
            "/run/vessel/files/a/../../etc",
            "/run/vessel/files/./a",
            "/etc/passwd",
            "/run/vessel/files/a\0b",
        ] {
            let e = resolve(root, bad).unwrap_err();
            assert!(matches!(e, AgentError::InvalidArgument(_)), "{bad:?}");
        }
    }

    #[test]
    fn write_replace_dirs_symlinks_remove() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("files");
        write_files(
            &root,
            &[
                data(
                    "/run/vessel/files/pod/hosts",
                    b"127.0.0.1 localhost\n",
                    0o644,
                ),
                FileEntry {
                    path: "/run/vessel/files/ctr/c1/0".into(),
                    mode: 0o700,
                    uid: 1000,
                    gid: 1000,
                    kind: Some(file_entry::Kind::Dir(true)),
                },
                data("/run/vessel/files/ctr/c1/0/run.sh", b"#!/bin/sh\n", 0o4755),
                FileEntry {
                    path: "/run/vessel/files/ctr/c1/0/link".into(),
                    mode: 0,
                    uid: 0,
                    gid: 0,
                    kind: Some(file_entry::Kind::Symlink("run.sh".into())),
                },
            ],
        )
        .unwrap();
        assert_eq!(
            std::fs::read(root.join("pod/hosts")).unwrap(),
            b"127.0.0.1 localhost\n"
        );
        let m = std::fs::metadata(root.join("ctr/c1/0")).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o700);
        assert_eq!((m.uid(), m.gid()), (1000, 1000));
        assert_eq!(
            std::fs::metadata(root.join("ctr/c1/0/run.sh"))
                .unwrap()
                .mode()
                & 0o7777,
            0o4755
        );
        assert_eq!(
            std::fs::read_link(root.join("ctr/c1/0/link")).unwrap(),
            Path::new("run.sh")
        );
        assert_eq!(
            std::fs::metadata(root.join("pod")).unwrap().mode() & 0o777,
            0o755
        );

        // Atomic replace: the old inode stays intact for whoever holds it.
        let old = std::fs::File::open(root.join("pod/hosts")).unwrap();
        write_files(&root, &[data("/run/vessel/files/pod/hosts", b"new\n", 0)]).unwrap();
        assert_eq!(std::fs::read(root.join("pod/hosts")).unwrap(), b"new\n");
        assert_ne!(
            old.metadata().unwrap().ino(),
            std::fs::metadata(root.join("pod/hosts")).unwrap().ino()
        );
        let leftovers: Vec<_> = std::fs::read_dir(root.join("pod"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(leftovers.len(), 1, "{leftovers:?}");

        // No writing through a symlink that leads outside.
        let outside = t.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("evil")).unwrap();
        let e = write_files(&root, &[data("/run/vessel/files/evil/x", b"x", 0)]).unwrap_err();
        assert!(matches!(e, AgentError::InvalidArgument(_)), "{e}");
        assert!(!outside.join("x").exists());
        // A bad path later in the list: nothing is written.
        let e = write_files(
            &root,
            &[
                data("/run/vessel/files/first", b"1", 0),
                data("/run/vessel/files/../x", b"x", 0),
            ],
        )
        .unwrap_err();
        assert!(matches!(e, AgentError::InvalidArgument(_)));
        assert!(!root.join("first").exists());

        // Removing: a symlink itself, not its target; missing is fine; escapes refused.
        remove_files(&root, &["/run/vessel/files/evil".into()]).unwrap();
        assert!(outside.exists());
        remove_files(
            &root,
            &[
                "/run/vessel/files/ctr".into(),
                "/run/vessel/files/missing/x".into(),
            ],
        )
        .unwrap();
        assert!(!root.join("ctr").exists());
        assert!(remove_files(&root, &["/run/vessel/files/..".into()]).is_err());
        assert!(remove_files(&root, &["/tmp".into()]).is_err());
        assert!(root.join("pod/hosts").exists());
    }

    #[test]
    fn sysctls() {
        let t = tempfile::tempdir().unwrap();
        let ps = t.path();
        std::fs::create_dir_all(ps.join("net/ipv4")).unwrap();
        std::fs::write(ps.join("net/ipv4/ip_forward"), "0").unwrap();
        assert_eq!(
            sysctl_path(ps, "net.ipv4.ip_forward").unwrap(),
            ps.join("net/ipv4/ip_forward")
        );
        assert_eq!(
            sysctl_path(ps, "net/ipv4/conf/eth0.1/rp_filter").unwrap(),
            ps.join("net/ipv4/conf/eth0.1/rp_filter")
        );
        for bad in [
            "",
            "net..x",
            "../etc",
            "net/../x",
            "a b",
            "net.ipv4.",
            "/net",
        ] {
            assert!(sysctl_path(ps, bad).is_err(), "{bad:?}");
        }
        let mut m = HashMap::new();
        m.insert("net.ipv4.ip_forward".to_string(), "1".to_string());
        apply_sysctls(ps, &m).unwrap();
        assert_eq!(
            std::fs::read_to_string(ps.join("net/ipv4/ip_forward")).unwrap(),
            "1"
        );
        m.insert("net.ipv4.nope".to_string(), "1".to_string());
        let e = apply_sysctls(ps, &m).unwrap_err();
        assert!(matches!(e, AgentError::InvalidArgument(_)));
        assert!(validate_hostname("pod-1.example").is_ok());
        assert!(validate_hostname("").is_err());
        assert!(validate_hostname("a/b").is_err());
    }
}
