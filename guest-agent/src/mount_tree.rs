//! Mount-tree primitives the agent's helpers share: detached clones (open_tree), their
//! attributes (mount_setattr), and how spec mount paths and options read.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

/// Whether a spec mount's options make it a bind mount.
pub fn is_bind(opts: &[String]) -> bool {
    opts.iter().any(|o| o == "bind" || o == "rbind")
}

/// `path` with `.`, `..` and doubled slashes worked out by name (`..` at `/` stays there).
pub fn lexical(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    out
}

/// A detached clone of the mount tree at `path` (recursive for `recursive`).
pub fn clone_tree(path: &Path, recursive: bool) -> std::io::Result<OwnedFd> {
    use rustix::mount::OpenTreeFlags;
    let mut flags = OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC;
    if recursive {
        flags |= OpenTreeFlags::AT_RECURSIVE;
    }
    Ok(rustix::mount::open_tree(rustix::fs::CWD, path, flags)?)
}

/// mount_setattr(2) on the detached tree `tree`: sets `attr.attr_set`, clears
/// `attr.attr_clr`, on its top mount or (`recursive`) on all of it. The mount's other
/// flags (nosuid, nodev, ...) are kept, unlike a remount.
pub fn setattr_tree(
    tree: BorrowedFd<'_>,
    attr: &libc::mount_attr,
    recursive: bool,
) -> std::io::Result<()> {
    let mut flags = libc::AT_EMPTY_PATH as libc::c_uint;
    if recursive {
        flags |= libc::AT_RECURSIVE as libc::c_uint;
    }
    // SAFETY: mount_setattr(2) reads `attr` (a live, initialised mount_attr whose size we
    // pass) and the empty path string; it writes nothing of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            flags,
            attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Attaches the detached tree `tree` at `path` (not following a link there).
pub fn attach_tree(tree: BorrowedFd<'_>, path: &Path) -> std::io::Result<()> {
    use rustix::mount::MoveMountFlags;
    Ok(rustix::mount::move_mount(
        tree,
        "",
        rustix::fs::CWD,
        path,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )?)
}

/// A mountinfo path with its `\ooo` escapes (space, tab, newline, backslash) undone.
pub fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A line of a mountinfo (`/proc/<pid>/mountinfo`): where the mount is and how it propagates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    /// The mount ID (what statx's `STATX_MNT_ID` gives for a path on it).
    pub id: u64,
    /// The mount point, as the reading process sees it.
    pub mount_point: PathBuf,
    /// The optional fields: `shared:N`, `master:N`, `propagate_from:N`, `unbindable`.
    pub optional: Vec<String>,
}

impl MountInfo {
    /// A member of a peer group: mounts and unmounts below it reach its peers.
    pub fn is_shared(&self) -> bool {
        self.optional.iter().any(|o| o.starts_with("shared:"))
    }

    /// A slave of a peer group: mounts made in the group reach it.
    pub fn is_slave(&self) -> bool {
        self.optional.iter().any(|o| o.starts_with("master:"))
    }
}

/// A mountinfo's lines, in mount order (malformed lines are left out).
pub fn mountinfo(text: &str) -> Vec<MountInfo> {
    text.lines()
        .filter_map(|l| {
            let (head, _) = l.split_once(" - ")?;
            let f: Vec<&str> = head.split(' ').collect();
            Some(MountInfo {
                id: f.first()?.parse().ok()?,
                mount_point: PathBuf::from(unescape(f.get(4)?)),
                optional: f
                    .get(6..)
                    .unwrap_or_default()
                    .iter()
                    .map(|o| o.to_string())
                    .collect(),
            })
        })
        .collect()
}

/// The mount `path` (absolute, symlinks resolved) is on, by name: the one with the longest
/// mount point above it, the last mounted of those (what is usually visible there; a mount
/// tucked under another by propagation is not: where the kernel gives the path's mount ID,
/// match that instead).
pub fn mount_of<'a>(mounts: &'a [MountInfo], path: &Path) -> Option<&'a MountInfo> {
    mounts
        .iter()
        .filter(|m| path.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.components().count())
        .and_then(|best| {
            mounts
                .iter()
                .rev()
                .find(|m| m.mount_point == best.mount_point)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_and_the_mount_of_a_path() {
        let text = "\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
30 27 0:5 / /dev rw,nosuid shared:2 - devtmpfs udev rw
31 30 0:6 / /dev/pts rw master:3 - devpts devpts rw
40 27 0:40 / /srv/a\\040b rw shared:7 master:4 - tmpfs t rw
41 27 0:41 / /srv/a\\040b rw - tmpfs t rw
bad line
";
        let m = mountinfo(text);
        assert_eq!(m.len(), 5);
        assert_eq!(m[3].mount_point, Path::new("/srv/a b"));
        assert_eq!((m[0].id, m[4].id), (27, 41));
        assert!(m[3].is_shared() && m[3].is_slave());
        let of = |p: &str| mount_of(&m, Path::new(p)).map(|m| m.mount_point.clone());
        assert_eq!(of("/etc/x"), Some("/".into()));
        assert_eq!(of("/dev"), Some("/dev".into()));
        assert_eq!(of("/dev/pts/0"), Some("/dev/pts".into()));
        // Not by string prefix: /devx is on /.
        assert_eq!(of("/devx"), Some("/".into()));
        // Stacked: the last mounted is what the path shows.
        let top = mount_of(&m, Path::new("/srv/a b/f")).unwrap();
        assert!(!top.is_shared() && !top.is_slave());
        assert!(mount_of(&m, Path::new("/dev")).unwrap().is_shared());
        assert!(mount_of(&m, Path::new("/dev/pts")).unwrap().is_slave());
    }
}
