//! A volume at `/dev` (a CSI node plugin's or a device operator's host `/dev`), put in place
//! once libcontainer has made the container.
//!
//! libcontainer 0.7 always makes its device nodes, `/dev/ptmx` and the `/dev/fd`, stdio and
//! kcore links in the container's `/dev`. Through a bind of the host's `/dev` those would be
//! the host's: it fails on the links the host has, and would replace the host's `/dev/ptmx`.
//! runc leaves a bound `/dev` alone. So the create helper takes the `/dev` bind, and the
//! binds the spec puts below it, out of the spec libcontainer reads ([`split`]), lets
//! libcontainer work in the standard `/dev` tmpfs, and then, in the made (not yet started)
//! container's mount namespace ([`attach`]):
//!
//! 1. clones the container's own mounts below `/dev` (devpts, shm, mqueue, console) and its
//!    devpts' `ptmx`;
//! 2. puts the `/dev` tree over `/dev` and makes it a slave (private, if asked) at once, so
//!    nothing mounted below it from here on reaches the host; then shared, if asked, in a
//!    peer group of its own: Bidirectional acts as HostToContainer, as the container's
//!    mounts below `/dev` (its ptys, its termination log) must not reach the host's;
//! 3. puts those clones back over the host's `/dev/pts`, `/dev/shm`, ... and the devpts'
//!    `ptmx` over `/dev/ptmx`: the container keeps its own ptys (a pty from the host's
//!    devpts fails libcontainer's ptmx checks, so `exec -t` would), shared memory and
//!    queues, among the host's device nodes;
//! 4. puts the request's binds below `/dev` (kubelet's `/dev/termination-log`) on top, in
//!    spec order. A missing mount point is made in the host's `/dev`, as runc makes it
//!    there (an empty file or directory, left for the next container).
//!
//! A bind elsewhere that the image's links would land on `/dev` is refused.
//!
//! The container's checkpoint is refused (CRIU would not know these mounts): [`MARKER`]
//! in the bundle says the container has them.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use crate::mount_tree::{attach_tree, clone_tree, is_bind, lexical, setattr_tree};
use std::path::{Path, PathBuf};

use libcontainer::error::LibcontainerError;
use nix::mount::MsFlags;

/// In a bundle: the container has a bound `/dev` (the file lists the deferred mounts).
pub const MARKER: &str = "dev-binds";

/// A bind mount put in place by [`attach`].
#[derive(Debug, Clone, PartialEq)]
pub struct Deferred {
    pub source: PathBuf,
    pub destination: PathBuf,
    /// `rbind`: the source's submounts too.
    pub recursive: bool,
    pub readonly: bool,
    /// `rro`: read-only all the way down.
    pub recursive_readonly: bool,
    pub propagation: MsFlags,
}

fn other(m: String) -> LibcontainerError {
    LibcontainerError::Other(m)
}

/// Takes a bind at `/dev` and every mount the spec has after it below `/dev` out of the
/// bundle's spec, and returns them (the `/dev` one first); nothing when the spec binds
/// nothing at `/dev`. A mount after it below `/dev` that is not a bind, or an idmapped one,
/// is refused.
pub fn split(bundle: &Path) -> Result<Vec<Deferred>, LibcontainerError> {
    let config = bundle.join("config.json");
    let mut spec = oci_spec::runtime::Spec::load(&config)
        .map_err(|e| other(format!("reading the bundle spec: {e}")))?;
    let mounts = spec.mounts().clone().unwrap_or_default();
    let dev = Path::new("/dev");
    let bind = |m: &oci_spec::runtime::Mount| is_bind(m.options().as_deref().unwrap_or_default());
    // libcontainer follows the image's links in a destination: a bind that lands on /dev
    // through them would have the runtime's nodes and links written into its source.
    let rootfs = spec.root().as_ref().map(|r| bundle.join(r.path()));
    if let Some(rootfs) = &rootfs {
        for m in mounts
            .iter()
            .filter(|m| bind(m) && lexical(m.destination()) != dev)
        {
            let at = resolved_in_root(rootfs, m.destination());
            if at.as_deref() == Some(dev) || at.as_deref() == Some(Path::new("/")) {
                return Err(LibcontainerError::InvalidInput(format!(
                    "the bind mount at {} lands on {} through the image's links, where the runtime would write its device nodes (a volume for /dev takes /dev as its path)",
                    m.destination().display(),
                    at.unwrap_or_default().display()
                )));
            }
        }
    }
    let Some(at) = mounts
        .iter()
        .position(|m| bind(m) && lexical(m.destination()) == dev)
    else {
        return Ok(Vec::new());
    };
    let userns = spec
        .linux()
        .as_ref()
        .and_then(|l| l.namespaces().clone())
        .unwrap_or_default()
        .iter()
        .any(|n| n.typ() == oci_spec::runtime::LinuxNamespaceType::User);
    if userns {
        return Err(LibcontainerError::InvalidInput(
            "a bind mount at /dev is not supported in a user namespace".into(),
        ));
    }
    let (mut keep, rest) = (mounts[..at].to_vec(), &mounts[at..]);
    let mut deferred = Vec::new();
    for m in rest {
        let dest = lexical(m.destination());
        if !dest.starts_with(dev) {
            keep.push(m.clone());
            continue;
        }
        let opts = m.options().clone().unwrap_or_default();
        let invalid = |why: &str| {
            LibcontainerError::InvalidInput(format!(
                "mount at {} below a bound /dev: {why}",
                dest.display()
            ))
        };
        if !is_bind(&opts) {
            return Err(invalid("only bind mounts can go over the host's /dev"));
        }
        if opts.iter().any(|o| o == "idmap" || o == "ridmap") {
            return Err(invalid("idmapped mounts are not supported there"));
        }
        let source = m
            .source()
            .clone()
            .ok_or_else(|| invalid("the bind has no source"))?;
        deferred.push(Deferred {
            source,
            destination: dest,
            recursive: opts.iter().any(|o| o == "rbind"),
            readonly: opts.iter().any(|o| o == "ro" || o == "rro"),
            recursive_readonly: opts.iter().any(|o| o == "rro"),
            propagation: crate::libct::propagation_flags(&opts),
        });
    }
    let listed: String = deferred
        .iter()
        .map(|d| format!("{}\n", d.destination.display()))
        .collect();
    std::fs::write(bundle.join(MARKER), listed)
        .map_err(|e| other(format!("writing the bundle's {MARKER}: {e}")))?;
    spec.set_mounts(Some(keep));
    spec.save(&config)
        .map_err(|e| other(format!("writing the bundle spec: {e}")))?;
    Ok(deferred)
}

/// Where `dest` is inside `rootfs` with the image's links followed there (as libcontainer
/// follows them); `None` when it is not there (yet).
fn resolved_in_root(rootfs: &Path, dest: &Path) -> Option<PathBuf> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let open = |p: &Path| {
        rustix::fs::open(
            p,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
    };
    let root = open(rootfs).ok()?;
    let rel = dest.strip_prefix("/").unwrap_or(dest);
    let rel = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    let fd = rustix::fs::openat2(
        &root,
        rel,
        OFlags::PATH | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS,
    )
    .ok()?;
    let real = |fd: &OwnedFd| std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok();
    let (at, top) = (real(&fd)?, real(&root)?);
    at.strip_prefix(&top).ok().map(|r| Path::new("/").join(r))
}

/// The outermost mount points strictly below `/dev` in a mountinfo (`/proc/<pid>/mountinfo`,
/// paths as that process sees them), in mount order.
pub fn own_dev_mounts(mountinfo: &str) -> Vec<PathBuf> {
    let below_dev = |p: &Path| p.starts_with("/dev") && p != Path::new("/dev");
    let points: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(crate::mount_tree::unescape(p)))
        .filter(|p| below_dev(p))
        .collect();
    let mut out: Vec<PathBuf> = Vec::new();
    for p in &points {
        let nested = points.iter().any(|q| q != p && p.starts_with(q));
        if !nested && !out.contains(p) {
            out.push(p.clone());
        }
    }
    out
}

/// Puts [`split`]'s mounts in place in the mount namespace of the made, not yet started,
/// container `pid` (see the module's steps). Must run single-threaded (setns of a mount
/// namespace requires it); the create helper is.
pub fn attach(pid: i32, deferred: &[Deferred]) -> Result<(), LibcontainerError> {
    if deferred.is_empty() {
        return Ok(());
    }
    // The sources are this namespace's paths (flat pods: binds staged from the host's).
    let mut trees = Vec::new();
    for d in deferred {
        let tree = clone_tree(&d.source, d.recursive)
            .map_err(|e| other(format!("cloning {}: {e}", d.source.display())))?;
        if d.readonly {
            let attr = libc::mount_attr {
                attr_set: libc::MOUNT_ATTR_RDONLY,
                attr_clr: 0,
                propagation: 0,
                userns_fd: 0,
            };
            setattr_tree(tree.as_fd(), &attr, d.recursive_readonly)
                .map_err(|e| other(format!("making {} read-only: {e}", d.destination.display())))?;
        }
        let dir = std::fs::metadata(&d.source)
            .map(|m| m.is_dir())
            .map_err(|e| other(format!("bind source {}: {e}", d.source.display())))?;
        trees.push((tree, dir));
    }
    // The container's mounts as it sees them (read before joining: its /proc has no entry
    // for this helper).
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .map_err(|e| other(format!("reading the container's mountinfo: {e}")))?;
    let own = own_dev_mounts(&mountinfo);
    crate::libct::in_mount_ns_of(pid, || attach_inside(deferred, trees, &own))
}

/// [`attach`], in the container's mount namespace (paths are the container's).
fn attach_inside(
    deferred: &[Deferred],
    trees: Vec<(OwnedFd, bool)>,
    own: &[PathBuf],
) -> Result<(), LibcontainerError> {
    let set = |path: &Path, flags: MsFlags| {
        nix::mount::mount(None::<&str>, path, None::<&str>, flags, None::<&str>).map_err(|e| {
            other(format!(
                "setting the propagation of {} ({flags:?}): {e}",
                path.display()
            ))
        })
    };
    // 1. The container's own mounts below /dev, and its devpts' ptmx.
    let mut kept = Vec::new();
    for p in own {
        let tree = clone_tree(p, true)
            .map_err(|e| other(format!("cloning the container's {}: {e}", p.display())))?;
        kept.push((p, tree));
    }
    let ptmx = Path::new("/dev/pts/ptmx");
    let ptmx_tree = if own.iter().any(|p| p == Path::new("/dev/pts")) {
        Some(
            clone_tree(ptmx, false)
                .map_err(|e| other(format!("cloning the container's {}: {e}", ptmx.display())))?,
        )
    } else {
        None
    };
    // 2. /dev, a slave (or private) before anything goes below it.
    let mut trees = trees.into_iter();
    let (dev, dev_tree) = match (deferred.first(), trees.next()) {
        (Some(d), Some((t, _))) => (d, t),
        _ => return Ok(()),
    };
    attach_tree(dev_tree.as_fd(), &dev.destination)
        .map_err(|e| other(format!("mounting over {}: {e}", dev.destination.display())))?;
    let first = if dev.propagation.contains(MsFlags::MS_PRIVATE) {
        MsFlags::MS_PRIVATE
    } else {
        MsFlags::MS_SLAVE
    };
    set(&dev.destination, first | MsFlags::MS_REC)?;
    // Shared, if asked, now: its new peer group has nothing of the host's, and what goes
    // below it next keeps the propagation it is given.
    if dev.propagation.contains(MsFlags::MS_SHARED) {
        set(&dev.destination, MsFlags::MS_SHARED | MsFlags::MS_REC)?;
    }
    // 3. The container's own back over the host's. The host's /dev has these places (but
    // /dev/mqueue, which hosts without systemd lack: the container then has none, as with
    // runc); one that is a link (an old /dev/shm -> /run/shm) would put the mount elsewhere.
    for (p, tree) in &kept {
        match std::fs::symlink_metadata(p) {
            Ok(m) if !m.file_type().is_symlink() => attach_tree(tree.as_fd(), p)
                .map_err(|e| other(format!("mounting the container's {}: {e}", p.display())))?,
            Err(_) if p.as_path() == Path::new("/dev/mqueue") => {
                tracing::debug!("no /dev/mqueue in the bound /dev; the container has none")
            }
            Ok(_) => {
                return Err(LibcontainerError::InvalidInput(format!(
                    "{} in the bound /dev is a link: the container's own cannot go there",
                    p.display()
                )))
            }
            Err(e) => {
                return Err(LibcontainerError::InvalidInput(format!(
                    "the bound /dev has no {} for the container's own: {e}",
                    p.display()
                )))
            }
        }
    }
    if let Some(tree) = ptmx_tree {
        let at = Path::new("/dev/ptmx");
        if std::fs::symlink_metadata(at).is_ok_and(|m| !m.file_type().is_symlink()) {
            attach_tree(tree.as_fd(), at)
                .map_err(|e| other(format!("mounting the container's ptmx: {e}")))?;
        }
    }
    // 4. The request's binds below /dev.
    for (d, (tree, dir)) in deferred[1..].iter().zip(trees) {
        let at = &d.destination;
        mount_point(at, dir)?;
        attach_tree(tree.as_fd(), at)
            .map_err(|e| other(format!("mounting over {}: {e}", at.display())))?;
        if !d.propagation.is_empty() {
            set(at, d.propagation)?;
        }
    }
    Ok(())
}

/// Makes `at` a mount point for a directory (`dir`) or a file, when it is not there: its
/// parents and itself, none through a link.
fn mount_point(at: &Path, dir: bool) -> Result<(), LibcontainerError> {
    use std::os::unix::fs::OpenOptionsExt;
    let bad = |why: String| {
        LibcontainerError::InvalidInput(format!("mount point {}: {why}", at.display()))
    };
    let mut here = PathBuf::from("/");
    for part in at.components().skip(1) {
        here.push(part);
        if std::fs::symlink_metadata(&here).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(bad(format!("{} is a link", here.display())));
        }
    }
    match std::fs::symlink_metadata(at) {
        Ok(m) if m.is_dir() != dir => {
            return Err(bad(format!(
                "is {}, the source {}",
                if m.is_dir() { "a directory" } else { "a file" },
                if dir { "a directory" } else { "a file" }
            )))
        }
        Ok(_) => return Ok(()),
        Err(_) => {}
    }
    let mut here = PathBuf::from("/");
    for part in at.parent().into_iter().flat_map(Path::components).skip(1) {
        here.push(part);
        match std::fs::symlink_metadata(&here) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => return Err(bad(format!("{} is not a directory", here.display()))),
            Err(_) => std::fs::create_dir(&here).map_err(|e| bad(e.to_string()))?,
        }
    }
    if dir {
        std::fs::create_dir(at).map_err(|e| bad(e.to_string()))?;
    } else {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW)
            .open(at)
            .map_err(|e| bad(e.to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_spec(dir: &Path, mounts: serde_json::Value) {
        let spec = serde_json::json!({
            "ociVersion": "1.0.2",
            "root": {"path": "rootfs"},
            "mounts": mounts,
        });
        std::fs::write(dir.join("config.json"), spec.to_string()).unwrap();
    }

    /// Nothing changes without a bind at /dev; with one, it and the binds below /dev after
    /// it leave the spec (the standard ones before it stay), in order, with their options.
    #[test]
    fn split_takes_the_dev_bind_and_those_below_it() {
        let dir = tempfile::tempdir().unwrap();
        let std_dev = serde_json::json!([
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
        ]);
        write_spec(dir.path(), std_dev.clone());
        assert_eq!(split(dir.path()).unwrap(), Vec::new());
        assert!(!dir.path().join(MARKER).exists());

        let mut mounts = std_dev.as_array().unwrap().clone();
        mounts.extend([
            serde_json::json!({"destination": "/dev", "type": "bind", "source": "/srv/dev", "options": ["rbind", "rslave", "rw"]}),
            serde_json::json!({"destination": "/etc/hosts", "type": "bind", "source": "/srv/hosts", "options": ["rbind", "rprivate", "ro"]}),
            serde_json::json!({"destination": "/dev/termination-log", "type": "bind", "source": "/srv/log", "options": ["rbind", "rprivate", "ro", "rro"]}),
        ]);
        write_spec(dir.path(), serde_json::Value::Array(mounts));
        let got = split(dir.path()).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].destination, Path::new("/dev"));
        assert!(got[0].recursive && !got[0].readonly);
        assert_eq!(got[0].propagation, MsFlags::MS_SLAVE | MsFlags::MS_REC);
        assert_eq!(got[1].source, Path::new("/srv/log"));
        assert!(got[1].readonly && got[1].recursive_readonly);
        let spec = oci_spec::runtime::Spec::load(dir.path().join("config.json")).unwrap();
        let left: Vec<_> = spec
            .mounts()
            .iter()
            .flatten()
            .map(|m| m.destination().display().to_string())
            .collect();
        assert_eq!(left, ["/proc", "/dev", "/dev/pts", "/etc/hosts"]);
        let marker = std::fs::read_to_string(dir.path().join(MARKER)).unwrap();
        assert_eq!(marker, "/dev\n/dev/termination-log\n");
    }

    #[test]
    fn split_refuses_what_cannot_go_over_the_host_dev() {
        let dir = tempfile::tempdir().unwrap();
        write_spec(
            dir.path(),
            serde_json::json!([
                {"destination": "/dev", "type": "bind", "source": "/dev", "options": ["rbind"]},
                {"destination": "/dev/x", "type": "tmpfs", "source": "tmpfs"},
            ]),
        );
        let e = split(dir.path()).unwrap_err();
        let msg = crate::libct::error_chain(&e);
        assert!(matches!(e, LibcontainerError::InvalidInput(_)), "{msg}");
        assert!(msg.contains("/dev/x"), "{msg}");
    }

    /// A /dev spelt otherwise is /dev; a bind the image's links land on /dev is refused; so
    /// is a bound /dev in a user namespace.
    #[test]
    fn split_sees_through_spellings_and_links() {
        let dir = tempfile::tempdir().unwrap();
        let rootfs = dir.path().join("rootfs");
        std::fs::create_dir_all(rootfs.join("dev")).unwrap();
        std::fs::create_dir_all(rootfs.join("etc")).unwrap();
        std::os::unix::fs::symlink("/dev", rootfs.join("hostdev")).unwrap();
        std::os::unix::fs::symlink("../../dev", rootfs.join("etc/up")).unwrap();
        assert_eq!(lexical(Path::new("/x/../dev/")), Path::new("/dev"));
        assert_eq!(
            lexical(Path::new("/../../dev/./pts")),
            Path::new("/dev/pts")
        );
        assert_eq!(
            resolved_in_root(&rootfs, Path::new("/etc/up")).as_deref(),
            Some(Path::new("/dev"))
        );
        assert_eq!(resolved_in_root(&rootfs, Path::new("/absent")), None);

        write_spec(
            dir.path(),
            serde_json::json!([
                {"destination": "/x/../dev", "type": "bind", "source": "/srv/dev", "options": ["rbind"]},
            ]),
        );
        let got = split(dir.path()).unwrap();
        assert_eq!(got[0].destination, Path::new("/dev"));
        for link in ["/hostdev", "/etc/up"] {
            write_spec(
                dir.path(),
                serde_json::json!([
                    {"destination": link, "type": "bind", "source": "/srv/dev", "options": ["rbind"]},
                ]),
            );
            let e = split(dir.path()).unwrap_err();
            let msg = crate::libct::error_chain(&e);
            assert!(msg.contains("lands on /dev"), "{msg}");
        }
        let spec = serde_json::json!({
            "ociVersion": "1.0.2",
            "root": {"path": "rootfs"},
            "mounts": [{"destination": "/dev", "type": "bind", "source": "/dev", "options": ["rbind"]}],
            "linux": {"namespaces": [{"type": "user"}, {"type": "mount"}]},
        });
        std::fs::write(dir.path().join("config.json"), spec.to_string()).unwrap();
        let msg = crate::libct::error_chain(&split(dir.path()).unwrap_err());
        assert!(msg.contains("user namespace"), "{msg}");
    }

    #[test]
    fn own_dev_mounts_are_the_outermost_below_dev() {
        let mi = "\
22 1 0:1 / / rw - overlay overlay rw
23 22 0:2 / /proc rw - proc proc rw
24 22 0:3 / /dev rw - tmpfs tmpfs rw
25 24 0:4 / /dev/pts rw - devpts devpts rw
26 24 0:5 / /dev/shm rw - tmpfs shm rw
27 26 0:6 / /dev/shm/in\\040it rw - tmpfs x rw
28 24 0:7 / /dev/mqueue rw - mqueue mqueue rw
29 22 0:8 / /devices rw - tmpfs x rw
30 24 0:4 /0 /dev/console rw - devpts devpts rw
";
        let got = own_dev_mounts(mi);
        let want: Vec<PathBuf> = ["/dev/pts", "/dev/shm", "/dev/mqueue", "/dev/console"]
            .iter()
            .map(PathBuf::from)
            .collect();
        assert_eq!(got, want);
        assert_eq!(crate::mount_tree::unescape("/a\\040b\\134c"), "/a b\\c");
    }
}
