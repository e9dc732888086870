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
