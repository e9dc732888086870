//! The user a container runs as: the CRI's run_as_* or the image's `User`, resolved
//! against the image's own /etc/passwd and /etc/group (read from its layers), as containerd
//! does; and whether the image has a command on its PATH.

use super::{invalid, ResolvedUser, SpecError};
use std::path::{Path, PathBuf};
use vessel_cri_api::v1 as cri;

/// Reads a file from an image's layers (top-most wins; overlay whiteouts and opaque dirs
/// hide lower copies), for /etc/passwd and friends.
///
/// The path is resolved as the container would see it, inside the image: each component in
/// turn, in the top-most layer that has it; a symlink (last component or not) is followed
/// within the image (`..` stops at its root, an absolute target starts there), at most
/// [`MAX_LINKS`] times (a loop of links is "no file", as ELOOP). Nothing outside the layer
/// directories is ever looked at: no path given to the host crosses a link.
pub fn read_image_file(layer_dirs: &[PathBuf], rel: &str) -> Option<Vec<u8>> {
    let mut path = image_path(&[], rel);
    let mut links = 0;
    'resolve: loop {
        for i in 0..path.len() {
            let (dir, meta) = image_entry(layer_dirs, &path[..=i])?;
            let host = dir.join(path[..=i].join("/"));
            if meta.file_type().is_symlink() {
                links += 1;
                if links > MAX_LINKS {
                    return None;
                }
                let target = std::fs::read_link(&host).ok()?;
                let target = target.to_str()?;
                let base = if target.starts_with('/') {
                    &[][..]
                } else {
                    &path[..i]
                };
                let mut next = image_path(base, target);
                next.extend_from_slice(&path[i + 1..]);
                path = next;
                continue 'resolve;
            }
            if i + 1 == path.len() {
                return meta.is_file().then(|| std::fs::read(&host).ok()).flatten();
            }
            if !meta.is_dir() {
                return None;
            }
        }
        return None;
    }
}

/// How many symlinks a path resolution follows (the kernel's limit).
const MAX_LINKS: usize = 40;

/// `rel` taken from the image directory `base` (components), worked out by name: `.` and
/// empty components dropped, `..` back one (never above the image's root).
fn image_path(base: &[String], rel: &str) -> Vec<String> {
    let mut out = base.to_vec();
    for c in rel.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c.to_string()),
        }
    }
    out
}

/// The top-most layer holding `path` (whose parents the caller has found to be directories
/// in the image), with its entry there, not following it. A layer is passed over where a
/// parent is not a directory in it (overlay shows the upper layer's), and the search ends at
/// a whiteout of the path or an opaque parent directory, as overlay hides what is below.
fn image_entry<'a>(
    layer_dirs: &'a [PathBuf],
    path: &[String],
) -> Option<(&'a PathBuf, std::fs::Metadata)> {
    use std::os::unix::fs::FileTypeExt;
    'layers: for dir in layer_dirs.iter().rev() {
        // Each parent a real directory in this layer: the host path below never crosses a
        // link of the layer's.
        let mut opaque = false;
        for j in 0..path.len() - 1 {
            let p = dir.join(path[..=j].join("/"));
            match std::fs::symlink_metadata(&p) {
                Ok(m) if m.is_dir() => {
                    opaque |= xattr_get(&p, "trusted.overlay.opaque")
                        .ok()
                        .flatten()
                        .is_some_and(|v| v == b"y");
                }
                Ok(m) if m.file_type().is_char_device() => return None,
                Ok(_) => return None,
                Err(_) if opaque => return None,
                Err(_) => continue 'layers,
            }
        }
        match std::fs::symlink_metadata(dir.join(path.join("/"))) {
            Ok(m) if m.file_type().is_char_device() => return None, // whiteout
            Ok(m) => return Some((dir, m)),
            Err(_) if opaque => return None,
            Err(_) => {}
        }
    }
    None
}

fn xattr_get(p: &Path, name: &str) -> std::io::Result<Option<Vec<u8>>> {
    let mut buf = vec![0u8; 16];
    match rustix::fs::lgetxattr(p, name, &mut buf) {
        Ok(n) => {
            buf.truncate(n);
            Ok(Some(buf))
        }
        Err(rustix::io::Errno::NODATA) | Err(rustix::io::Errno::NOENT) => Ok(None),
        Err(rustix::io::Errno::OPNOTSUPP) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn parse_passwd(data: &str, name: &str) -> Option<(u32, u32)> {
    data.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 4 && f[0] == name).then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
    })
}

fn passwd_by_uid(data: &str, uid: u32) -> Option<(String, u32)> {
    data.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        if f.len() >= 4 && f[2].parse::<u32>().ok()? == uid {
            Some((f[0].to_string(), f[3].parse().ok()?))
        } else {
            None
        }
    })
}

fn group_gid(data: &str, name: &str) -> Option<u32> {
    data.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 3 && f[0] == name).then(|| f[2].parse().ok())?
    })
}

fn groups_of(data: &str, user: &str) -> Vec<u32> {
    data.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() >= 4 && f[3].split(',').any(|m| m == user) {
                f[2].parse().ok()
            } else {
                None
            }
        })
        .collect()
}

/// Resolves the user from the CRI security context, falling back to the image's `User`,
/// reading names from the image's /etc/passwd and /etc/group.
pub fn resolve_user(
    sc: Option<&cri::LinuxContainerSecurityContext>,
    image_user: Option<&str>,
    layer_dirs: &[PathBuf],
) -> Result<ResolvedUser, SpecError> {
    let passwd = read_image_file(layer_dirs, "etc/passwd")
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let group = read_image_file(layer_dirs, "etc/group")
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();

    // As containerd and CRI-O: a group alone would be combined with whatever user the image
    // names, which is not what the pod asked for.
    if let Some(sc) = sc {
        if sc.run_as_group.is_some() && sc.run_as_user.is_none() && sc.run_as_username.is_empty() {
            return Err(invalid(
                "run_as_group is set without run_as_user or run_as_username",
            ));
        }
    }
    let (user_part, group_part): (String, Option<String>) = match sc {
        Some(sc) if sc.run_as_user.is_some() => (
            sc.run_as_user
                .as_ref()
                .map(|u| u.value)
                .unwrap_or(0)
                .to_string(),
            None,
        ),
        Some(sc) if !sc.run_as_username.is_empty() => (sc.run_as_username.clone(), None),
        _ => {
            let u = image_user.unwrap_or("").trim();
            match u.split_once(':') {
                Some((a, b)) => (a.to_string(), Some(b.to_string())),
                None => (u.to_string(), None),
            }
        }
    };
    let (uid, mut gid, username) = if user_part.is_empty() {
        (0, 0, "root".to_string())
    } else if let Ok(uid) = user_part.parse::<u32>() {
        match passwd_by_uid(&passwd, uid) {
            Some((name, gid)) => (uid, gid, name),
            None => (uid, 0, String::new()),
        }
    } else {
        let (uid, gid) = parse_passwd(&passwd, &user_part).ok_or_else(|| {
            invalid(format!(
                "user {user_part:?} is not in the image's /etc/passwd"
            ))
        })?;
        (uid, gid, user_part.clone())
    };
    if let Some(g) = group_part.filter(|g| !g.is_empty()) {
        gid = match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => group_gid(&group, &g)
                .ok_or_else(|| invalid(format!("group {g:?} is not in the image's /etc/group")))?,
        };
    }
    if let Some(sc) = sc {
        if let Some(g) = &sc.run_as_group {
            gid = u32::try_from(g.value).map_err(|_| invalid("run_as_group out of range"))?;
        }
    }
    // Supplementary groups, as containerd gives them (and reports them in ContainerStatus):
    // the primary group, the groups the image's /etc/group lists the user in (policy Merge,
    // the default; not with Strict), and the pod's supplemental groups.
    let strict = sc.is_some_and(|s| {
        s.supplemental_groups_policy == cri::SupplementalGroupsPolicy::Strict as i32
    });
    let mut additional: Vec<u32> = vec![gid];
    if !username.is_empty() && !strict {
        additional.extend(groups_of(&group, &username));
    }
    if let Some(sc) = sc {
        for g in &sc.supplemental_groups {
            additional
                .push(u32::try_from(*g).map_err(|_| invalid("supplemental group out of range"))?);
        }
    }
    additional.sort_unstable();
    additional.dedup();
    Ok(ResolvedUser {
        uid,
        gid,
        additional_gids: additional,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// Layer directories under one temp dir, bottom first.
    fn layers(n: usize) -> (tempfile::TempDir, Vec<PathBuf>) {
        let t = tempfile::tempdir().unwrap();
        let dirs: Vec<PathBuf> = (0..n).map(|i| t.path().join(format!("l{i}"))).collect();
        for d in &dirs {
            std::fs::create_dir_all(d.join("etc")).unwrap();
        }
        (t, dirs)
    }

    #[test]
    fn image_files_resolve_inside_the_image() {
        let (t, l) = layers(2);
        let read = |p: &str| read_image_file(&l, p).map(|v| String::from_utf8(v).unwrap());
        std::fs::write(l[0].join("etc/passwd"), "low").unwrap();
        assert_eq!(read("/etc/passwd").as_deref(), Some("low"));
        // The upper layer's copy wins; a whiteout hides the lower one.
        std::fs::write(l[1].join("etc/passwd"), "up").unwrap();
        assert_eq!(read("etc/passwd").as_deref(), Some("up"));
        std::fs::remove_file(l[1].join("etc/passwd")).unwrap();
        let wh = std::ffi::CString::new(l[1].join("etc/passwd").to_str().unwrap()).unwrap();
        // SAFETY: mknod(2) with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mknod(wh.as_ptr(), libc::S_IFCHR, 0) }, 0);
        assert_eq!(read("etc/passwd"), None);
        // An opaque directory hides the lower layers' entries below it.
        std::fs::remove_file(l[1].join("etc/passwd")).unwrap();
        std::fs::write(l[0].join("etc/group"), "low").unwrap();
        assert_eq!(read("etc/group").as_deref(), Some("low"));
        let etc = l[1].join("etc");
        if rustix::fs::lsetxattr(
            &etc,
            "trusted.overlay.opaque",
            b"y",
            rustix::fs::XattrFlags::empty(),
        )
        .is_ok()
        {
            assert_eq!(read("etc/group"), None);
        }

        // Links, relative and absolute, with `..` that cannot leave the image; a linked
        // parent directory (as /etc -> private/etc) is followed in the image, not the host.
        let (_t2, l) = layers(1);
        let read = |p: &str| read_image_file(&l, p).map(|v| String::from_utf8(v).unwrap());
        std::fs::create_dir_all(l[0].join("private/etc")).unwrap();
        std::fs::write(l[0].join("private/etc/group"), "g").unwrap();
        std::fs::remove_dir(l[0].join("etc")).unwrap();
        symlink("private/etc", l[0].join("etc")).unwrap();
        assert_eq!(read("etc/group").as_deref(), Some("g"));
        std::fs::write(l[0].join("private/etc/real"), "r").unwrap();
        symlink(
            "../../../../../../../private/etc/real",
            l[0].join("private/etc/passwd"),
        )
        .unwrap();
        assert_eq!(read("etc/passwd").as_deref(), Some("r"));
        // An absolute link to a host path names the image's, which has none.
        let host = t.path().join("hostfile");
        std::fs::write(&host, "host").unwrap();
        symlink(&host, l[0].join("private/etc/shadow")).unwrap();
        assert_eq!(read("etc/shadow"), None);
        let up = format!("../../../../../../..{}", host.display());
        symlink(&up, l[0].join("private/etc/gshadow")).unwrap();
        assert_eq!(read("etc/gshadow"), None);
        // A parent linked out of the image is followed in it.
        std::fs::create_dir_all(t.path().join("outside")).unwrap();
        std::fs::write(t.path().join("outside/hosts"), "host").unwrap();
        symlink(t.path().join("outside"), l[0].join("out")).unwrap();
        assert_eq!(read("out/hosts"), None);
        // A loop of links is no file (it recursed for ever, overflowing the stack).
        symlink("b", l[0].join("private/etc/a")).unwrap();
        symlink("a", l[0].join("private/etc/b")).unwrap();
        assert_eq!(read("etc/a"), None);
        symlink("loop/x", l[0].join("loop")).unwrap();
        assert_eq!(read("loop/passwd"), None);
        assert_eq!(read(""), None);
        assert_eq!(read("/"), None);
    }
}
