//! VM pods' volumes: the host paths of CRI mounts, shared into the guest with virtio-fs.
//!
//! Each VM pod has a share, `<vm dir>/shared`: a small tmpfs of its own (so a guest writing
//! beside its volumes fills 1 MiB, not the host's `/run`), served by the pod's shim as the
//! virtio-fs tag [`SHARED_TAG`] and mounted by the agent at [`GUEST_SHARED`]. At
//! CreateContainer each mount's host path is bind-mounted (recursively) at
//! `shared/<container id>/<n>`, with the mount's propagation (host mounts made later under a
//! `rslave`/`rshared` source show up in the guest) and read-only all the way down when the
//! mount is read-only; the container's OCI bind mount then comes from
//! `GUEST_SHARED/<container id>/<n>`. Writes in the guest land in the host's directory when
//! they return, and the host's changes are seen in the guest within the device's cache
//! timeout. Character devices under `/dev` map onto the guest's own nodes; other non-file
//! sources (sockets, FIFOs, block devices) cannot cross into a VM and are refused.
//!
//! Nothing here ever deletes through a mount: the share's mounts are detached first
//! ([`unmount_under`]), and only then are the (empty) mount points removed.

use std::io;
use std::path::{Path, PathBuf};

pub use vessel_agent::volumes::{GUEST_SHARED, SHARED_TAG};
use vessel_cri_api::v1 as cri;

use crate::errors::{Result, RuntimeError};

/// The size of a pod share's own tmpfs (mount points only; the volumes are mounts on it).
const SHARE_TMPFS: &str = "size=1m,nr_inodes=16384,mode=0700";

/// The pod's share in its VM directory.
pub fn shared_dir(vm_dir: &Path) -> PathBuf {
    vm_dir.join("shared")
}

/// A CRI mount as the guest sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedMount {
    pub container_path: String,
    pub host_path: String,
    pub guest_path: String,
}

/// Creates the pod's share: a directory with a small tmpfs on it (idempotent).
pub fn create_share(vm_dir: &Path) -> io::Result<PathBuf> {
    let dir = shared_dir(vm_dir);
    std::fs::create_dir_all(&dir)?;
    if !vessel_images::snapshot::is_mountpoint(&dir) {
        use rustix::mount::{MountFlags, MountPropagationFlags};
        let opts = std::ffi::CString::new(SHARE_TMPFS)?;
        let at = |e: rustix::io::Errno| {
            io::Error::new(
                io::Error::from(e).kind(),
                format!("tmpfs {SHARE_TMPFS} on {}: {e}", dir.display()),
            )
        };
        let flags = MountFlags::NOSUID | MountFlags::NODEV;
        rustix::mount::mount("vessel-share", &dir, "tmpfs", flags, Some(opts.as_c_str()))
            .map_err(at)?;
        // A peer group of its own: the volumes mounted on it propagate to the shim's file
        // server (a slave copy in its own mount namespace) and nowhere else on the host.
        rustix::mount::mount_change(&dir, MountPropagationFlags::PRIVATE).map_err(at)?;
        rustix::mount::mount_change(&dir, MountPropagationFlags::SHARED).map_err(at)?;
    }
    Ok(dir)
}

/// What a mount's source is, for a VM.
enum Source {
    Dir,
    File,
    /// A character device node the guest has too: the container gets the guest's.
    GuestDevice(String),
}

/// Device nodes every guest has (devtmpfs), which a container may ask for by host path.
const GUEST_DEVICES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
    "/dev/fuse",
];

fn classify(m: &cri::Mount) -> std::result::Result<Source, String> {
    let md = std::fs::metadata(&m.host_path)
        .map_err(|e| format!("mount source {:?}: {e}", m.host_path))?;
    use std::os::unix::fs::FileTypeExt;
    let ft = md.file_type();
    if ft.is_dir() {
        Ok(Source::Dir)
    } else if ft.is_file() {
        Ok(Source::File)
    } else if ft.is_char_device() && GUEST_DEVICES.contains(&m.host_path.as_str()) {
        Ok(Source::GuestDevice(m.host_path.clone()))
    } else {
        let what = if ft.is_socket() {
            "a socket"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_block_device() {
            "a block device"
        } else {
            "a device node the guest does not have"
        };
        Err(format!(
            "mount source {:?} (for {:?}) is {what}: a VM pod's mounts share directories and files only",
            m.host_path, m.container_path
        ))
    }
}

/// `mount_setattr(2)`'s `struct mount_attr`.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}
const MOUNT_ATTR_RDONLY: u64 = 1;
const AT_RECURSIVE: libc::c_uint = 0x8000;

/// Sets `attr` on the (detached) mount tree `tree` and every mount in it.
fn set_tree_attr(tree: &std::os::fd::OwnedFd, attr: &MountAttr) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: the path is an empty NUL-terminated string and `attr` a mount_attr of the size
    // passed, both alive for the call (the kernel only reads them); `tree` is an open fd.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint | AT_RECURSIVE,
            attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Bind-mounts one source at `target` (created as a directory or an empty file). The source
/// is cloned detached (open_tree), given its propagation and read-only flag there, and only
/// then attached: the copy of it that the shim's sandboxed file server gets by propagation
/// is made from the finished mount, so a private volume never receives host mounts and a
/// read-only one is read-only there too.
fn bind(m: &cri::Mount, dir: bool, target: &Path) -> io::Result<()> {
    use rustix::mount::{MoveMountFlags, OpenTreeFlags};
    if dir {
        std::fs::create_dir(target)?;
    } else {
        std::fs::File::create(target)?;
    }
    let tree = rustix::mount::open_tree(
        rustix::fs::CWD,
        m.host_path.as_str(),
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_RECURSIVE,
    )?;
    // Host -> guest propagation where asked (a guest's mounts cannot reach the host, so
    // Bidirectional gets this direction only); otherwise later host mounts stay out.
    let propagation = if m.propagation == cri::MountPropagation::PropagationPrivate as i32 {
        libc::MS_PRIVATE
    } else {
        libc::MS_SLAVE
    };
    set_tree_attr(
        &tree,
        &MountAttr {
            attr_set: if m.readonly { MOUNT_ATTR_RDONLY } else { 0 },
            attr_clr: 0,
            propagation,
            userns_fd: 0,
        },
    )?;
    rustix::mount::move_mount(
        &tree,
        "",
        rustix::fs::CWD,
        target,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )?;
    Ok(())
}

/// Shares the host paths of container `id`'s CRI mounts with the guest (under
/// `shared/<id>/`) and returns where the guest finds each. On failure nothing is left.
pub fn share_mounts(vm_dir: &Path, id: &str, mounts: &[cri::Mount]) -> Result<Vec<SharedMount>> {
    let base = shared_dir(vm_dir).join(id);
    unshare_container(vm_dir, id);
    let mut shared = Vec::new();
    let r = (|| {
        for (i, m) in mounts.iter().enumerate() {
            let guest_path = match classify(m).map_err(RuntimeError::InvalidArgument)? {
                Source::GuestDevice(p) => p,
                kind => {
                    if !base.exists() {
                        std::fs::create_dir(&base).map_err(crate::errors::internal(format!(
                            "creating {}",
                            base.display()
                        )))?;
                    }
                    let target = base.join(i.to_string());
                    bind(m, matches!(kind, Source::Dir), &target).map_err(
                        crate::errors::internal(format!(
                            "sharing {:?} into the VM at {}",
                            m.host_path,
                            target.display()
                        )),
                    )?;
                    format!("{GUEST_SHARED}/{id}/{i}")
                }
            };
            shared.push(SharedMount {
                container_path: m.container_path.clone(),
                host_path: m.host_path.clone(),
                guest_path,
            });
        }
        Ok(())
    })();
    match r {
        Ok(()) => Ok(shared),
        Err(e) => {
            unshare_container(vm_dir, id);
            Err(e)
        }
    }
}

/// Mount points at or below `prefix`, deepest first.
fn mounts_under(prefix: &Path) -> Vec<PathBuf> {
    let mut points: Vec<PathBuf> = vessel_images::snapshot::mount_points()
        .into_iter()
        .filter(|p| p.starts_with(prefix))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points.dedup();
    points
}

/// Detaches every mount at or below `prefix`; true when none is left.
pub fn unmount_under(prefix: &Path) -> bool {
    for _ in 0..8 {
        let points = mounts_under(prefix);
        if points.is_empty() {
            return true;
        }
        for p in points {
            if let Err(e) = rustix::mount::unmount(&p, rustix::mount::UnmountFlags::DETACH) {
                if e != rustix::io::Errno::INVAL && e != rustix::io::Errno::NOENT {
                    tracing::warn!(path = %p.display(), error = %e, "cannot unmount");
                }
            }
        }
    }
    mounts_under(prefix).is_empty()
}

/// Takes container `id`'s volumes out of the share: unmounts them, then removes their
/// (now empty) mount points, never anything below one.
pub fn unshare_container(vm_dir: &Path, id: &str) {
    let base = shared_dir(vm_dir).join(id);
    if !unmount_under(&base) {
        tracing::warn!(dir = %base.display(), "volumes still mounted; their mount points stay");
        return;
    }
    if let Err(e) = remove_mount_points(&shared_dir(vm_dir), id) {
        tracing::warn!(dir = %base.display(), error = %e, "cannot remove the volume mount points");
    }
}

/// Removes `share/<id>` and the (empty) mount points in it, through directory descriptors
/// and never following a link: the share is writable by the guest (and its VMM), which may
/// have swapped `<id>` for a link to a host directory.
fn remove_mount_points(share: &Path, id: &str) -> io::Result<()> {
    use rustix::fs::{openat, unlinkat, AtFlags, Dir, FileType, Mode, OFlags, CWD};
    let dir_flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let share = match openat(CWD, share, dir_flags, Mode::empty()) {
        Ok(fd) => fd,
        // The pod's VM directory went first (its containers are forgotten after it).
        Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let sub = match openat(&share, id, dir_flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(()),
        // A link (or a file) in its place: remove that, not what it names.
        Err(rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR) => {
            return Ok(unlinkat(&share, id, AtFlags::empty())?);
        }
        Err(e) => return Err(e.into()),
    };
    let mut first_error = None;
    for e in Dir::read_from(&sub)? {
        let e = e?;
        let name = e.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        let how = if e.file_type() == FileType::Directory {
            AtFlags::REMOVEDIR
        } else {
            AtFlags::empty()
        };
        if let Err(err) = unlinkat(&sub, name, how) {
            tracing::warn!(container = id, entry = ?name, error = %err, "cannot remove a volume mount point");
            first_error.get_or_insert(err);
        }
    }
    unlinkat(&share, id, AtFlags::REMOVEDIR)?;
    match first_error {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// Removes a VM pod's directory, after detaching every mount in it (the share, the
/// volumes); if a mount cannot be detached the directory is left, never deleted through.
pub fn remove_vm_dir(vm_dir: &Path) {
    if !unmount_under(vm_dir) {
        tracing::warn!(dir = %vm_dir.display(), "mounts left in the VM's directory; not removing it");
        return;
    }
    if let Err(e) = vessel_images::fsutil::remove_any(vm_dir) {
        tracing::warn!(dir = %vm_dir.display(), error = %e, "cannot remove the VM's files");
    }
}

/// Points the spec's bind mounts of shared host paths at the guest's paths. Propagation
/// inside the guest means nothing (host mounts arrive through the share), so the guest's
/// binds are private.
pub fn rewrite_mount_sources(spec: &mut serde_json::Value, shared: &[SharedMount]) {
    let Some(mounts) = spec["mounts"].as_array_mut() else {
        return;
    };
    for m in mounts {
        let dest = m["destination"].as_str().unwrap_or_default().to_string();
        let src = m["source"].as_str().unwrap_or_default().to_string();
        if let Some(s) = shared
            .iter()
            .find(|s| s.container_path == dest && s.host_path == src)
        {
            m["source"] = serde_json::json!(s.guest_path);
            if let Some(opts) = m["options"].as_array_mut() {
                for o in opts.iter_mut() {
                    if matches!(o.as_str(), Some("rslave" | "rshared" | "slave" | "shared")) {
                        *o = serde_json::json!("rprivate");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_removed_without_following_a_link_the_guest_made() {
        let (d, share) = crate::testing::temp_path("shared");
        std::fs::create_dir_all(share.join("c1/0")).unwrap();
        std::fs::write(share.join("c1/1"), "").unwrap();
        remove_mount_points(&share, "c1").unwrap();
        assert!(!share.join("c1").exists());
        // The guest swapped a container's directory for a link to a host directory.
        let victim = d.path().join("victim");
        std::fs::create_dir_all(victim.join("dir")).unwrap();
        std::fs::write(victim.join("file"), "keep").unwrap();
        std::os::unix::fs::symlink(&victim, share.join("c2")).unwrap();
        remove_mount_points(&share, "c2").unwrap();
        assert!(
            share.join("c2").symlink_metadata().is_err(),
            "the link goes"
        );
        assert_eq!(
            std::fs::read_to_string(victim.join("file")).unwrap(),
            "keep"
        );
        assert!(victim.join("dir").is_dir());
        remove_mount_points(&share, "none").unwrap();
    }

    fn mount(host: &Path, ctr: &str, readonly: bool) -> cri::Mount {
        cri::Mount {
            host_path: host.display().to_string(),
            container_path: ctr.into(),
            readonly,
            ..Default::default()
        }
    }

    /// Where this runs as root (mounting needs it): a temporary directory, a VM directory in
    /// it (not made) and the host directory `host` in it (made).
    fn as_root(host: &str) -> Option<(tempfile::TempDir, PathBuf, PathBuf)> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            println!("SKIP: mounting needs root");
            return None;
        }
        let d = tempfile::tempdir().unwrap();
        let (vm, host) = (d.path().join("vm"), d.path().join(host));
        std::fs::create_dir(&host).unwrap();
        Some((d, vm, host))
    }

    #[test]
    fn volumes_are_bound_into_the_share_and_removed_without_touching_the_host() {
        let Some((d, vm, vol)) = as_root("vol") else {
            return;
        };
        std::fs::create_dir(vol.join("sub")).unwrap();
        std::fs::write(vol.join("sub/a"), "hello").unwrap();
        let file = d.path().join("hosts");
        std::fs::write(&file, "127.0.0.1 x\n").unwrap();
        let share = create_share(&vm).unwrap();
        assert!(vessel_images::snapshot::is_mountpoint(&share));

        let mounts = [
            mount(Path::new("/dev/null"), "/dev/x", false),
            mount(&vol, "/data", false),
            mount(&file, "/etc/hosts", true),
        ];
        let shared = share_mounts(&vm, "c1", &mounts).unwrap();
        assert_eq!(shared[0].guest_path, "/dev/null");
        assert_eq!(shared[1].guest_path, format!("{GUEST_SHARED}/c1/1"));
        assert_eq!(shared[2].guest_path, format!("{GUEST_SHARED}/c1/2"));
        // Writes through the share are the host's; the read-only file refuses them.
        std::fs::write(share.join("c1/1/sub/b"), "from the guest").unwrap();
        assert_eq!(std::fs::read(vol.join("sub/b")).unwrap(), b"from the guest");
        assert_eq!(std::fs::read(share.join("c1/2")).unwrap(), b"127.0.0.1 x\n");
        let e = std::fs::write(share.join("c1/2"), "x").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");

        // The OCI spec's bind mounts now come from the guest's share.
        let mut spec = serde_json::json!({"mounts": [
            {"destination": "/data", "source": vol.display().to_string(), "options": ["rbind", "rslave", "rw"]},
            {"destination": "/proc", "source": "proc"},
        ]});
        rewrite_mount_sources(&mut spec, &shared);
        assert_eq!(spec["mounts"][0]["source"], format!("{GUEST_SHARED}/c1/1"));
        assert_eq!(spec["mounts"][0]["options"][1], "rprivate");
        assert_eq!(spec["mounts"][1]["source"], "proc");

        // Removing the VM's directory while volumes are mounted deletes nothing of theirs.
        remove_vm_dir(&vm);
        assert!(!vm.exists());
        assert_eq!(std::fs::read(vol.join("sub/a")).unwrap(), b"hello");
        assert_eq!(std::fs::read(vol.join("sub/b")).unwrap(), b"from the guest");
        assert!(file.exists());
        assert!(mounts_under(&vm).is_empty());
    }

    #[test]
    fn a_failed_share_leaves_nothing_and_non_files_are_invalid() {
        let Some((d, vm, vol)) = as_root("vol") else {
            return;
        };
        let sock = d.path().join("s.sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        create_share(&vm).unwrap();
        let mounts = [
            mount(&vol, "/data", false),
            mount(&sock, "/run/s.sock", false),
        ];
        let e = share_mounts(&vm, "c1", &mounts).unwrap_err();
        assert!(
            matches!(&e, RuntimeError::InvalidArgument(m) if m.contains("socket")),
            "{e}"
        );
        assert!(!shared_dir(&vm).join("c1").exists());
        assert_eq!(mounts_under(&vm), vec![shared_dir(&vm)]);
        let e =
            share_mounts(&vm, "c2", &[mount(&d.path().join("absent"), "/x", false)]).unwrap_err();
        assert!(
            matches!(&e, RuntimeError::InvalidArgument(m) if m.contains("absent")),
            "{e}"
        );

        // A container's volumes go with it; the share stays for the next.
        share_mounts(&vm, "c3", &mounts[..1]).unwrap();
        unshare_container(&vm, "c3");
        assert!(!shared_dir(&vm).join("c3").exists());
        assert!(vol.exists());
        remove_vm_dir(&vm);
        assert!(mounts_under(&vm).is_empty() && !vm.exists());
    }

    #[test]
    fn host_mounts_reach_a_host_to_container_volume_only() {
        let Some((d, vm, src)) = as_root("src") else {
            return;
        };
        std::fs::create_dir(src.join("mnt")).unwrap();
        std::fs::create_dir_all(d.path().join("flag")).unwrap();
        std::fs::write(d.path().join("flag/flagFile"), "").unwrap();
        // The source is a shared mount, as kubelet makes mount-propagation host paths.
        rustix::mount::mount_bind_recursive(&src, &src).unwrap();
        use rustix::mount::MountPropagationFlags as P;
        rustix::mount::mount_change(&src, P::SHARED | P::REC).unwrap();
        create_share(&vm).unwrap();
        let mut slave = mount(&src, "/a", false);
        slave.propagation = cri::MountPropagation::PropagationHostToContainer as i32;
        let private = mount(&src, "/b", false);
        share_mounts(&vm, "c1", &[slave, private]).unwrap();
        rustix::mount::mount_bind(d.path().join("flag"), src.join("mnt")).unwrap();
        let share = shared_dir(&vm);
        assert!(
            share.join("c1/0/mnt/flagFile").exists(),
            "rslave sees the host's mount"
        );
        assert!(
            !share.join("c1/1/mnt/flagFile").exists(),
            "rprivate does not"
        );
        remove_vm_dir(&vm);
        vessel_images::snapshot::unmount_all(&src.join("mnt")).unwrap();
        vessel_images::snapshot::unmount_all(&src).unwrap();
        assert!(mounts_under(d.path()).is_empty());
    }
}
