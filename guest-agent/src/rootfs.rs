//! Container root filesystems: overlayfs mounts made by the agent in its own mount namespace
//! (so nothing is left on the host when the pod goes) and writable-layer accounting.

use std::collections::HashSet;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::error::AgentError;
use crate::proto::OverlayRootfs;

fn check_option_path(what: &str, p: &str) -> Result<(), AgentError> {
    if p.is_empty() || !p.starts_with('/') || p.contains([',', ':', '\n']) {
        return Err(AgentError::InvalidArgument(format!(
            "overlay {what} {p:?} must be an absolute path without ',' or ':'"
        )));
    }
    Ok(())
}

/// The overlayfs mount data for `ov`: `lowerdir=top:...:bottom,upperdir=..,workdir=..`.
pub fn overlay_options(ov: &OverlayRootfs) -> Result<String, AgentError> {
    if ov.lowerdirs.is_empty() {
        return Err(AgentError::InvalidArgument(
            "overlay rootfs needs at least one lowerdir".into(),
        ));
    }
    for l in &ov.lowerdirs {
        check_option_path("lowerdir", l)?;
    }
    // The proto lists layers bottom-most first; overlayfs wants the top-most first.
    let lower: Vec<&str> = ov.lowerdirs.iter().rev().map(String::as_str).collect();
    let mut opts = format!("lowerdir={}", lower.join(":"));
    match (ov.upperdir.is_empty(), ov.workdir.is_empty()) {
        (true, true) => {}
        (false, false) => {
            check_option_path("upperdir", &ov.upperdir)?;
            check_option_path("workdir", &ov.workdir)?;
            opts.push_str(&format!(",upperdir={},workdir={}", ov.upperdir, ov.workdir));
        }
        _ => {
            return Err(AgentError::InvalidArgument(
                "overlay rootfs needs both upperdir and workdir, or neither".into(),
            ));
        }
    }
    // The kernel takes at most a page of mount data.
    if opts.len() >= 4096 {
        return Err(AgentError::InvalidArgument(format!(
            "overlay mount options are {} bytes, over the kernel's 4095",
            opts.len()
        )));
    }
    Ok(opts)
}

/// An overlay rootfs ready to mount: its options checked, its directories made.
#[derive(Debug, Clone)]
pub struct PreparedOverlay {
    opts: String,
    /// The layers, top-most first (for idmapped copies of them).
    lowers: Vec<String>,
    /// `,upperdir=..,workdir=..`, or empty.
    upper: String,
    writable: bool,
}

/// Checks `ov`'s options and makes its upper, work and `target` directories; the mount
/// itself is [`mount_prepared`] (a container's, when it starts). In a pod with its own user
/// namespace the writable layer's top belongs to the container's root.
pub fn prepare_overlay(target: &Path, ov: &OverlayRootfs) -> Result<PreparedOverlay, AgentError> {
    let opts = overlay_options(ov)?;
    for d in [&ov.upperdir, &ov.workdir] {
        if !d.is_empty() {
            std::fs::create_dir_all(d)
                .map_err(|e| AgentError::internal(format!("creating {d}"), e))?;
        }
    }
    if let (Some(u), false) = (crate::userns::pod(), ov.upperdir.is_empty()) {
        let (Some(uid), Some(gid)) = (u.uid.to_host(0), u.gid.to_host(0)) else {
            return Err(AgentError::InvalidArgument(
                "the pod's user namespace does not map root".into(),
            ));
        };
        std::os::unix::fs::chown(&ov.upperdir, Some(uid), Some(gid))
            .map_err(|e| AgentError::internal(format!("chown of {}", ov.upperdir), e))?;
    }
    std::fs::create_dir_all(target)
        .map_err(|e| AgentError::internal(format!("creating {}", target.display()), e))?;
    let upper = if ov.upperdir.is_empty() {
        String::new()
    } else {
        format!(",upperdir={},workdir={}", ov.upperdir, ov.workdir)
    };
    Ok(PreparedOverlay {
        opts,
        lowers: ov.lowerdirs.iter().rev().cloned().collect(),
        upper,
        writable: !ov.upperdir.is_empty(),
    })
}

/// Idmapped copies of an overlay's layers, attached under `<target>.idmapped/<n>` for as
/// long as the overlay mount takes (overlayfs keeps its own reference to each layer).
struct IdmappedLayers {
    dir: PathBuf,
    attached: Vec<PathBuf>,
}

impl IdmappedLayers {
    fn attach(
        target: &Path,
        lowers: &[String],
        userns: &crate::userns::PodUserns,
    ) -> Result<Self, AgentError> {
        use std::os::fd::AsFd;
        let mut name = target.file_name().unwrap_or_default().to_os_string();
        name.push(".idmapped");
        let mut layers = IdmappedLayers {
            dir: target.with_file_name(name),
            attached: Vec::new(),
        };
        std::fs::create_dir_all(&layers.dir)
            .map_err(|e| AgentError::internal(format!("creating {}", layers.dir.display()), e))?;
        for (i, l) in lowers.iter().enumerate() {
            let at = layers.dir.join(i.to_string());
            std::fs::create_dir_all(&at)
                .map_err(|e| AgentError::internal(format!("creating {}", at.display()), e))?;
            let tree = crate::userns::idmapped_clone(Path::new(l), userns.fd.as_fd(), false)
                .map_err(|e| {
                    AgentError::FailedPrecondition(format!(
                        "an idmapped mount of image layer {l} (needed by the pod's user namespace; \
                         Linux 5.19+ and a filesystem that supports idmapped mounts): {e}"
                    ))
                })?;
            crate::mount_tree::attach_tree(tree.as_fd(), &at)
                .map_err(|e| AgentError::internal(format!("attaching {}", at.display()), e))?;
            layers.attached.push(at);
        }
        Ok(layers)
    }

    fn lowerdir(&self) -> String {
        let paths: Vec<String> = self
            .attached
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        format!("lowerdir={}", paths.join(":"))
    }
}

impl Drop for IdmappedLayers {
    fn drop(&mut self) {
        // Never a recursive removal: a layer still attached would have its files deleted.
        for p in &self.attached {
            unmount_all(p);
            let _ = std::fs::remove_dir(p);
        }
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                let _ = std::fs::remove_dir(e.path());
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Mounts a prepared overlay at `target`; in a pod with its own user namespace, over
/// idmapped copies of the layers, so the image's files show to the containers' ids as they
/// are on disk (root's as root's).
pub fn mount_prepared(target: &Path, p: &PreparedOverlay) -> Result<(), AgentError> {
    let idmapped = match crate::userns::pod() {
        Some(u) => Some(IdmappedLayers::attach(target, &p.lowers, u)?),
        None => None,
    };
    let opts = match &idmapped {
        Some(l) => format!("{}{}", l.lowerdir(), p.upper),
        None => p.opts.clone(),
    };
    if opts.len() >= 4096 {
        return Err(AgentError::InvalidArgument(format!(
            "overlay mount options are {} bytes, over the kernel's 4095",
            opts.len()
        )));
    }
    let mount_with = |opts: &str| {
        mount(
            Some("overlay"),
            target,
            Some("overlay"),
            MsFlags::empty(),
            Some(opts),
        )
    };
    // `volatile` (Linux 5.10+): the writable layer is never synced to its filesystem, which
    // spares every unmount a sync of the host's filesystem (~1 ms here, far more on a busy
    // disk) and the container's fsyncs on its rootfs a disk flush. Safe for CRI containers:
    // a writable layer is never mounted again, and one a host crash interrupted is thrown
    // away with its pod (its volumes, which do sync, are not overlays). Older kernels refuse
    // the option: then without it.
    let mut r = Err(nix::errno::Errno::EINVAL);
    if p.writable {
        r = mount_with(&format!("{opts},volatile"));
    }
    if r == Err(nix::errno::Errno::EINVAL) {
        r = mount_with(&opts);
    }
    drop(idmapped);
    r.map_err(|e| {
        let msg = format!("mounting overlay at {} ({opts})", target.display());
        if e == nix::errno::Errno::ENOENT || e == nix::errno::Errno::ENOTDIR {
            AgentError::InvalidArgument(format!("{msg}: {e}"))
        } else {
            AgentError::internal(msg, e)
        }
    })
}

/// Mounts `ov` at `target` (created if missing).
pub fn mount_overlay(target: &Path, ov: &OverlayRootfs) -> Result<(), AgentError> {
    mount_prepared(target, &prepare_overlay(target, ov)?)
}

/// Where a flat container's bind sources are attached (see `libct::stage_binds`), inside the
/// container's directory.
pub const BINDS_DIR: &str = "binds";

/// Detaches the staged bind sources of the container directory `dir` and removes their mount
/// points. Returns false if one is still mounted: the caller must then leave `dir` alone, as
/// a recursive removal would delete the host's files through it.
pub fn unstage_binds(dir: &Path) -> bool {
    let binds = dir.join(BINDS_DIR);
    let entries = match std::fs::read_dir(&binds) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return true,
        Err(e) => {
            tracing::warn!(dir = %binds.display(), error = %e, "listing staged bind mounts");
            return false;
        }
    };
    let mut ok = true;
    for e in entries.flatten() {
        let p = e.path();
        // Private first: a staged source may be in the host's peer group, and unmounting it
        // (with everything below it) would otherwise unmount the host's own submounts too.
        let _ = nix::mount::mount(
            None::<&str>,
            &p,
            None::<&str>,
            nix::mount::MsFlags::MS_PRIVATE | nix::mount::MsFlags::MS_REC,
            None::<&str>,
        );
        unmount_all(&p);
        // Non-recursive removal: a mount point that is still mounted is busy and stays.
        let removed = std::fs::remove_dir(&p).or_else(|_| std::fs::remove_file(&p));
        if let Err(err) = removed {
            tracing::warn!(path = %p.display(), error = %err, "staged bind mount not removed");
            ok = false;
        }
    }
    ok && std::fs::remove_dir(&binds).is_ok()
}

/// Unmounts whatever is mounted at `target` (lazily); not mounted is fine.
pub fn unmount_all(target: &Path) {
    // Loop in case something got stacked on top.
    for _ in 0..8 {
        match umount2(target, MntFlags::MNT_DETACH) {
            Ok(()) => continue,
            Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => return,
            Err(e) => {
                tracing::warn!(target = %target.display(), error = %e, "unmounting rootfs");
                return;
            }
        }
    }
}

/// Bytes (allocated blocks) and inodes under `dir`, not following symlinks nor crossing
/// mount points; hard links count once.
pub fn usage(dir: &Path) -> (u64, u64) {
    let Ok(meta) = std::fs::symlink_metadata(dir) else {
        return (0, 0);
    };
    let dev = meta.dev();
    let mut seen: HashSet<(u64, u64)> = HashSet::new();
    let mut bytes = 0u64;
    let mut inodes = 0u64;
    let mut stack: Vec<PathBuf> = vec![dir.to_path_buf()];
    seen.insert((meta.dev(), meta.ino()));
    bytes += meta.blocks() * 512;
    inodes += 1;
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in rd.flatten() {
            let Ok(m) = entry.metadata() else { continue };
            if m.dev() != dev || !seen.insert((m.dev(), m.ino())) {
                continue;
            }
            bytes += m.blocks() * 512;
            inodes += 1;
            if m.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    (bytes, inodes)
}

/// Makes a container's working directory in its root filesystem where the image has none,
/// as runc does: each missing directory 0755, owned by `owner` (the container's root as the
/// host sees it). Every step is resolved inside the root (the image's links stay in it); a
/// file where a directory should be fails. What is made is changed through a descriptor of
/// the new directory itself, opened without following a link: a container that shares the
/// tree (a volume) and puts a link in its place gets nothing changed outside.
pub fn make_cwd(rootfs: &Path, cwd: &Path, owner: (u32, u32)) -> std::io::Result<()> {
    make_cwd_at(open_dir_path(rootfs)?.as_fd(), cwd, owner)
}

/// Whether a failure to make a working directory is the request's (what the image or the
/// volume has in the way: a file, a link loop, a missing parent) rather than the node's.
pub fn cwd_error_is_request(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOTDIR | libc::ENOENT | libc::ELOOP | libc::EEXIST)
    )
}

/// An `O_PATH` descriptor of the directory `dir`.
fn open_dir_path(dir: &Path) -> std::io::Result<std::os::fd::OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
    Ok(rustix::fs::open(dir, flags, Mode::empty())?)
}

/// [`make_cwd`] in the root `root` (a descriptor, opened by the caller).
fn make_cwd_at(
    root: std::os::fd::BorrowedFd<'_>,
    cwd: &Path,
    owner: (u32, u32),
) -> std::io::Result<()> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let resolve = |rel: &Path| {
        let rel = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        rustix::fs::openat2(
            root,
            rel,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
        )
    };
    let rel = cwd.strip_prefix("/").unwrap_or(cwd);
    match resolve(rel) {
        // A component missing: made below. Anything else (there, a file in the way, a
        // kernel before 5.6 without openat2) is left to libcontainer's chdir, as before.
        Err(rustix::io::Errno::NOENT) => {}
        _ => return Ok(()),
    }
    let mut done = PathBuf::new();
    for part in cwd.components() {
        let std::path::Component::Normal(name) = part else {
            if part == std::path::Component::ParentDir {
                done.push("..");
            }
            continue;
        };
        let parent = resolve(&done)?;
        done.push(name);
        match rustix::fs::mkdirat(&parent, name, Mode::from_raw_mode(0o755)) {
            Ok(()) => {
                // The mode as asked, whatever the umask; the owner the container's root.
                let made = rustix::fs::openat(
                    &parent,
                    name,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )?;
                rustix::fs::fchmod(&made, Mode::from_raw_mode(0o755))?;
                let uid = rustix::fs::Uid::from_raw(owner.0);
                let gid = rustix::fs::Gid::from_raw(owner.1);
                rustix::fs::fchown(&made, Some(uid), Some(gid))?;
            }
            Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(e.into()),
        }
    }
    resolve(&done).map(drop).map_err(Into::into)
}

/// The bind mount (a volume) under which the container's working directory `cwd` is, the
/// innermost (a later one at the same destination, which covers an earlier one); none where
/// `cwd` is in the root filesystem or is itself the mount point.
pub fn covering_bind<'a>(
    spec: &'a oci_spec::runtime::Spec,
    cwd: &Path,
) -> Option<&'a oci_spec::runtime::Mount> {
    let cwd = crate::mount_tree::lexical(cwd);
    // The innermost mount over it, whatever its type (a tmpfs in a volume hides the volume).
    let m = spec
        .mounts()
        .iter()
        .flatten()
        .filter(|m| cwd.starts_with(crate::mount_tree::lexical(m.destination())))
        .max_by_key(|m| {
            crate::mount_tree::lexical(m.destination())
                .components()
                .count()
        })?;
    let bind = crate::mount_tree::is_bind(m.options().as_deref().unwrap_or_default());
    (bind && cwd != crate::mount_tree::lexical(m.destination())).then_some(m)
}

/// Makes the working directory of the container in `bundle` inside the volume whose mount
/// covers it ([`covering_bind`]), as runc makes it there once the volume is mounted: under
/// the mount's source (as the spec names it now: the helper's staged clone, in a flat pod),
/// resolved inside it, each missing directory 0755, made as `owner` (the container's root
/// as the host sees it): with its permissions, not the helper's, and through a volume's
/// id mapping as the container's root writes through it. A read-only volume is not written
/// (EROFS, as runc fails). Must run single-threaded (the filesystem ids are the thread's).
pub fn make_cwd_in_volume(bundle: &Path, owner: (u32, u32)) -> std::io::Result<()> {
    let spec = oci_spec::runtime::Spec::load(bundle.join("config.json"))
        .map_err(|e| std::io::Error::other(format!("reading the bundle spec: {e}")))?;
    let Some(cwd) = spec.process().as_ref().map(|p| p.cwd().clone()) else {
        return Ok(());
    };
    let Some(m) = covering_bind(&spec, &cwd) else {
        return Ok(());
    };
    let Some(source) = m.source().as_ref().filter(|s| s.is_dir()) else {
        return Ok(());
    };
    let opts = m.options().as_deref().unwrap_or_default();
    if opts.iter().any(|o| o == "ro") {
        return Err(std::io::Error::from_raw_os_error(libc::EROFS));
    }
    let cwd = crate::mount_tree::lexical(&cwd);
    let dest = crate::mount_tree::lexical(m.destination());
    let rel = Path::new("/").join(cwd.strip_prefix(&dest).unwrap_or(&cwd));
    // Opened as root: the staged source's own path (the container's dir) is root's only.
    let root = open_dir_path(source)?;
    // The filesystem ids become the owner's (which drops the capabilities that override
    // file permissions, where the owner is not root), and come back whatever happened.
    // SAFETY: setfsgid/setfsuid take plain ids and change only this thread's filesystem
    // ids; the previous ones are put back below.
    let (old_gid, old_uid) = unsafe { (libc::setfsgid(owner.1), libc::setfsuid(owner.0)) };
    let r = make_cwd_at(root.as_fd(), &rel, owner);
    // SAFETY: as above, back to the ids they returned.
    unsafe {
        libc::setfsuid(old_uid as u32);
        libc::setfsgid(old_gid as u32);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_volume_over_a_working_directory() {
        let spec: oci_spec::runtime::Spec = serde_json::from_value(serde_json::json!({
            "ociVersion": "1.0.2",
            "root": {"path": "rootfs"},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/work", "type": "bind", "source": "/a", "options": ["rbind"]},
                {"destination": "/work/sub/", "type": "bind", "source": "/b", "options": ["rbind", "ro"]},
                {"destination": "/work/sub", "type": "bind", "source": "/c", "options": ["bind"]},
                {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}
            ]
        }))
        .unwrap();
        let src = |cwd: &str| {
            covering_bind(&spec, Path::new(cwd))
                .and_then(|m| m.source().clone())
                .map(|s| s.display().to_string())
        };
        assert_eq!(src("/work/x"), Some("/a".into()));
        // The innermost; of two at one destination, the later.
        assert_eq!(src("/work/sub/y/z"), Some("/c".into()));
        // The mount point itself, a tmpfs, the root filesystem: none.
        assert_eq!(src("/work"), None);
        assert_eq!(src("/tmp/x"), None);
        assert_eq!(src("/workspace"), None);
    }

    #[test]
    fn a_missing_working_directory_is_made_inside_the_root() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        std::fs::create_dir(root.join("usr")).unwrap();
        std::fs::write(root.join("file"), "").unwrap();
        std::os::unix::fs::symlink("/", root.join("up")).unwrap();
        make_cwd(root, Path::new("/workspace/a/b"), (1234, 5678)).unwrap();
        for d in ["workspace", "workspace/a", "workspace/a/b"] {
            let m = std::fs::metadata(root.join(d)).unwrap();
            assert!(m.is_dir(), "{d}");
            assert_eq!((m.uid(), m.gid()), (1234, 5678), "{d}");
            assert_eq!(m.permissions().mode() & 0o7777, 0o755, "{d}");
        }
        // What is there stays as it is; a link leads inside the root, never out of it.
        make_cwd(root, Path::new("/usr"), (1, 1)).unwrap();
        assert_eq!(std::fs::metadata(root.join("usr")).unwrap().uid(), 0);
        let name = format!("vessel-cwd-{}", std::process::id());
        make_cwd(root, &Path::new("/up/..").join(&name), (0, 0)).unwrap();
        assert!(root.join(&name).is_dir());
        assert!(!Path::new("/").join(&name).exists());
        // A file where a directory should be is left as it is, to libcontainer's chdir.
        make_cwd(root, Path::new("/file/x"), (0, 0)).unwrap();
        assert!(root.join("file").is_file());
    }

    #[test]
    fn options() {
        let ov = OverlayRootfs {
            lowerdirs: vec!["/l/bottom".into(), "/l/top".into()],
            upperdir: "/u".into(),
            workdir: "/w".into(),
        };
        assert_eq!(
            overlay_options(&ov).unwrap(),
            "lowerdir=/l/top:/l/bottom,upperdir=/u,workdir=/w"
        );
        let bad = OverlayRootfs {
            lowerdirs: vec!["/a,b".into()],
            ..Default::default()
        };
        assert!(overlay_options(&bad).is_err());
    }

    #[test]
    fn walks() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("x")).unwrap();
        std::fs::write(d.path().join("x/f"), vec![1u8; 10000]).unwrap();
        std::fs::hard_link(d.path().join("x/f"), d.path().join("g")).unwrap();
        let (bytes, inodes) = usage(d.path());
        assert_eq!(inodes, 3);
        assert!(bytes >= 10000);
    }
}
