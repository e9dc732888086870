//! The user a container runs as: the CRI's run_as_* or the image's `User`, resolved
//! against the image's own /etc/passwd and /etc/group (read from its layers), as containerd
//! does; and whether the image has a command on its PATH.

use super::{invalid, ResolvedUser, SpecError};
use std::path::{Path, PathBuf};
use vessel_cri_api::v1 as cri;

/// Reads a file from an image's layers (top-most wins; overlay whiteouts and opaque dirs
/// hide lower copies), for /etc/passwd and friends.
pub fn read_image_file(layer_dirs: &[PathBuf], rel: &str) -> Option<Vec<u8>> {
    use std::os::unix::fs::FileTypeExt;
    let rel = rel.trim_start_matches('/');
    for dir in layer_dirs.iter().rev() {
        let p = dir.join(rel);
        if let Ok(m) = std::fs::symlink_metadata(&p) {
            if m.file_type().is_char_device() {
                return None; // whiteout
            }
            if m.is_file() {
                return std::fs::read(&p).ok();
            }
            if m.file_type().is_symlink() {
                // Resolve inside the image (one level is enough for /etc files).
                let t = std::fs::read_link(&p).ok()?;
                let target = if t.is_absolute() {
                    t.to_string_lossy().to_string()
                } else {
                    Path::new(rel)
                        .parent()
                        .unwrap_or(Path::new(""))
                        .join(t)
                        .to_string_lossy()
                        .to_string()
                };
                if target.trim_start_matches('/') == rel {
                    return None;
                }
                return read_image_file(layer_dirs, &target);
            }
            return None;
        }
        // An opaque parent in this layer hides everything below it.
        let mut parent = Path::new(rel).parent();
        while let Some(pp) = parent {
            if pp.as_os_str().is_empty() {
                break;
            }
            if let Ok(Some(v)) = xattr_get(&dir.join(pp), "trusted.overlay.opaque") {
                if v == b"y" {
                    return None;
                }
            }
            parent = pp.parent();
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
