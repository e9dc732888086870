//! Restoring a checkpoint: CreateContainer whose image is a CheckpointContainer archive
//! makes a container that StartContainer restores with CRIU instead of starting its command
//! (flat pods). The archive comes either as a file, named by its absolute path as the image
//! (CRI-O's convention, for `crictl create`), or as a checkpoint image, pulled like any other:
//! one layer holding the archive's files, marked by the manifest annotation
//! `io.kubernetes.cri-o.annotations.checkpoint.name` (what `buildah` makes of an archive for
//! a pod spec's `image`, the Kubernetes way to restore).
//!
//! The archive names the image the container ran from (`config.dump`): that image must be
//! here, and it is the new container's image; the archive's `rootfs-diff.tar` and
//! `deleted.files` are written into the new container's writable layer (its overlay upper
//! directory: files as they were, whiteouts for what it had deleted), and its CRIU images
//! (`checkpoint/`) are copied into the container's snapshot directory, so that they go
//! with the container (its agent removes them once restored, all but CRIU's log). The request's mounts give the volumes (by container path, as CRIU
//! recorded them); where the request names no command, the checkpointed process's
//! arguments, environment and working directory (`spec.dump`) are the container's.

use crate::errors::{Result, RuntimeError};
use serde::Deserialize;
use std::fs::File;
use std::io;
use std::path::{Component, Path, PathBuf};
use vessel_cri_api::v1 as cri;

/// The directory under a container's snapshot that holds the CRIU images it is restored
/// from.
const IMAGES_DIR: &str = "checkpoint";

/// `config.dump`, as CRI-O and vessel write it (the fields a restore reads).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ConfigDump {
    name: String,
    #[serde(rename = "rootfsImage")]
    rootfs_image: String,
    #[serde(rename = "rootfsImageRef")]
    rootfs_image_ref: String,
    #[serde(rename = "rootfsImageName")]
    rootfs_image_name: String,
}

/// The checkpointed process, from `spec.dump`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct Process {
    args: Vec<String>,
    env: Vec<String>,
    cwd: String,
    terminal: bool,
}

/// Where a checkpoint's files are.
#[derive(Debug, Clone)]
pub(super) enum Source {
    /// An archive file.
    Archive(PathBuf),
    /// A directory holding the archive's files: a checkpoint image's layer.
    Dir(PathBuf),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Archive(p) => write!(f, "checkpoint archive {}", p.display()),
            Source::Dir(p) => write!(f, "checkpoint image layer {}", p.display()),
        }
    }
}

/// A checkpoint's `config.dump` and `spec.dump`, where found.
type Dumps = (Option<Vec<u8>>, Option<Vec<u8>>);

/// An archive's `config.dump` and `spec.dump`, from its entries.
/// `deleted.files` of an archive's entries, if it has one (none: nothing deleted).
fn deleted_in<'a, R: 'a + io::Read>(
    entries: io::Result<tar::Entries<'a, R>>,
) -> io::Result<Vec<String>> {
    for e in entries? {
        let mut e = e?;
        if plain_name(&e.path()?) == Path::new("deleted.files") {
            return read_deleted(&mut e);
        }
    }
    Ok(Vec::new())
}

fn pick_dumps<'a, R: 'a + io::Read>(entries: io::Result<tar::Entries<'a, R>>) -> io::Result<Dumps> {
    let (mut config, mut spec) = (None, None);
    for e in entries? {
        let mut e = e?;
        let slot = match plain_name(&e.path()?).to_str() {
            Some("config.dump") => &mut config,
            Some("spec.dump") => &mut spec,
            _ => continue,
        };
        *slot = Some(read_small(&mut e)?);
    }
    Ok((config, spec))
}

/// A checkpoint a container is to be restored from.
#[derive(Debug)]
pub(super) struct Checkpoint {
    pub source: Source,
    config: ConfigDump,
    process: Process,
    /// The container paths of the checkpointed container's bind mounts, which CRIU recorded
    /// as external: the restored container needs a mount at each.
    binds: Vec<String>,
    /// The checkpointed container was in a user namespace (its pod's).
    userns: bool,
}

/// Whether a spec puts the container in a user namespace.
fn has_userns(spec: &serde_json::Value) -> bool {
    spec["linux"]["namespaces"]
        .as_array()
        .is_some_and(|ns| ns.iter().any(|n| n["type"] == "user"))
}

/// The destinations of a spec's bind mounts.
fn bind_destinations(spec: &serde_json::Value) -> Vec<String> {
    let mounts = spec["mounts"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    mounts
        .iter()
        .filter(|m| {
            m["type"] == "bind"
                || m["options"]
                    .as_array()
                    .is_some_and(|o| o.iter().any(|o| o == "bind" || o == "rbind"))
        })
        .filter_map(|m| m["destination"].as_str().map(str::to_string))
        .collect()
}

/// Whether a CreateContainer image names a checkpoint archive: an absolute path (no image
/// reference starts with `/`).
pub(super) fn is_archive(image: &str) -> bool {
    image.starts_with('/')
}

fn bad(source: &Source, what: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::InvalidArgument(format!("{source}: {what}"))
}

impl Checkpoint {
    /// Reads the checkpoint's `config.dump` and `spec.dump` (blocking).
    pub fn open(source: Source) -> Result<Checkpoint> {
        let (config, spec) = match &source {
            Source::Archive(archive) => Self::read_archive(&source, archive)?,
            Source::Dir(dir) => {
                let read = |n: &str| -> Result<Option<Vec<u8>>> {
                    let Some(f) = layer_file(dir, n).map_err(|e| bad(&source, e))? else {
                        return Ok(None);
                    };
                    read_small(f).map(Some).map_err(|e| bad(&source, e))
                };
                (read("config.dump")?, read("spec.dump")?)
            }
        };
        let (Some(config), Some(spec)) = (config, spec) else {
            return Err(bad(
                &source,
                "no config.dump or spec.dump in it: not a CheckpointContainer archive",
            ));
        };
        let config: ConfigDump = serde_json::from_slice(&config)
            .map_err(|e| bad(&source, format!("config.dump: {e}")))?;
        let spec: serde_json::Value =
            serde_json::from_slice(&spec).map_err(|e| bad(&source, format!("spec.dump: {e}")))?;
        let process: Process = serde_json::from_value(spec["process"].clone())
            .map_err(|e| bad(&source, format!("spec.dump process: {e}")))?;
        Ok(Checkpoint {
            source,
            config,
            process,
            binds: bind_destinations(&spec),
            userns: has_userns(&spec),
        })
    }

    /// Whether the restored container's spec can take the checkpoint: a bind mount wherever
    /// the checkpointed one had (CRIU maps its recorded external mounts onto them by
    /// container path), and no user namespace on either side (CRIU would make the
    /// container a user namespace of its own, not join the pod's, and its proc mount is
    /// refused there); otherwise, why not.
    pub fn check_spec(&self, spec: &serde_json::Value) -> std::result::Result<(), String> {
        if self.userns || has_userns(spec) {
            return Err(format!(
                "the {}: restoring a container in a pod with its own user namespace (hostUsers: false), or from one, is not supported",
                self.source
            ));
        }
        let have = bind_destinations(spec);
        if have.iter().any(|d| crate::spec::clean_path(d) == "/dev") {
            return Err(format!(
                "the {}: a restored container cannot have a volume at /dev (the host's /dev is put in place after the runtime made the container, which a restore does not do)",
                self.source
            ));
        }
        let missing: Vec<&str> = self
            .binds
            .iter()
            .filter(|d| !have.contains(d))
            .map(String::as_str)
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        if missing == ["/dev/shm"] {
            return Err(format!(
                "the {} shared its pod's /dev/shm, which CRIU restores onto the new pod's: restore it into a container in its pod's IPC namespace (ipc POD)",
                self.source
            ));
        }
        Err(format!(
            "the {} has a volume or bind mount at {}, which CRIU restores onto a mount at the same path: give the container a mount there",
            self.source,
            missing.join(", ")
        ))
    }

    /// An archive's `config.dump` and `spec.dump`.
    fn read_archive(source: &Source, archive: &Path) -> Result<Dumps> {
        let opened = open_archive(archive).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => RuntimeError::NotFound(format!("{source} not found")),
            _ => bad(source, e),
        })?;
        match opened {
            // Seeks past the CRIU images (the container's memory) to the metadata.
            Opened::Plain(f) => pick_dumps(tar::Archive::new(f).entries_with_seek()),
            Opened::Compressed(r) => pick_dumps(tar::Archive::new(r).entries()),
        }
        .map_err(|e| bad(source, e))
    }

    /// The image the checkpointed container ran from, as the store may know it: only by
    /// what names it exactly (an image id, a digest reference) where the archive has that,
    /// as CRI-O restores only by its image ref; by its names otherwise. A tag may have moved
    /// since: CRIU restoring the process onto other binaries fails obscurely, or worse.
    pub fn base_images(&self) -> impl Iterator<Item = &str> {
        let given = [
            &self.config.rootfs_image,
            &self.config.rootfs_image_ref,
            &self.config.rootfs_image_name,
        ]
        .into_iter()
        .map(|s| s.as_str())
        .filter(|s| !s.is_empty());
        let exact = |s: &str| {
            let hex = s.strip_prefix("sha256:").unwrap_or(s);
            s.contains('@') || (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
        };
        let any_exact = given.clone().any(exact);
        given.filter(move |s| !any_exact || exact(s))
    }

    /// The base image, for messages and for a container record that names no tag of it.
    pub fn base_image_name(&self) -> &str {
        self.base_images().last().unwrap_or("")
    }

    /// The container config of the restored container: the request's, with the base image,
    /// the checkpointed process's terminal (a process that had a tty gets one back, with a
    /// new pty; one with pipes gets pipes) and, where the request names no command, the
    /// checkpointed process's.
    pub fn apply(&self, config: &mut cri::ContainerConfig, image_name: &str) {
        config.image = Some(cri::ImageSpec {
            image: image_name.to_string(),
            ..config.image.clone().unwrap_or_default()
        });
        config.tty = self.process.terminal;
        if config.command.is_empty() && config.args.is_empty() {
            config.command = self.process.args.clone();
            if config.working_dir.is_empty() {
                config.working_dir = self.process.cwd.clone();
            }
            if config.envs.is_empty() {
                config.envs = self
                    .process
                    .env
                    .iter()
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, v)| cri::KeyValue {
                        key: k.to_string(),
                        value: v.to_string(),
                    })
                    .collect();
            }
        }
        tracing::debug!(checkpoint = %self.source, name = %self.config.name, "restoring a checkpointed container");
    }

    /// Unpacks the checkpoint (blocking): the CRIU images into `<snapshot>/checkpoint`, the
    /// root filesystem changes into `root`, the container's root filesystem (its snapshot,
    /// mounted), as CRI-O applies them: the diff's files, with their owners, modes and
    /// times, then `deleted.files` removed. Answers the images directory.
    pub fn unpack(&self, snapshot_dir: &Path, root: &Path) -> io::Result<PathBuf> {
        let images = snapshot_dir.join(IMAGES_DIR);
        std::fs::create_dir_all(&images)?;
        // The deletions go before the diff, wherever the archive has them: a directory the
        // container replaced whole is listed (opaque in its upper directory, as CRI-O lists it
        // too) and goes before its new content is unpacked; a path that was only deleted is
        // not in the diff, whichever order.
        match &self.source {
            Source::Archive(archive) => {
                let fault = |e| archive_fault("the archive", e);
                let deleted = match open_archive(archive)? {
                    // Seeks past the CRIU images, as the dumps are read.
                    Opened::Plain(f) => deleted_in(tar::Archive::new(f).entries_with_seek()),
                    Opened::Compressed(r) => deleted_in(tar::Archive::new(r).entries()),
                }
                .map_err(fault)?;
                deleted.iter().try_for_each(|d| remove_in(root, d))?;
                let mut a = tar::Archive::new(open_archive(archive)?.reader());
                for e in a.entries().map_err(fault)? {
                    let mut e = e.map_err(fault)?;
                    let name = plain_name(&e.path().map_err(fault)?);
                    if name.starts_with(IMAGES_DIR) {
                        let file = image_file(&name, e.header().entry_type())?;
                        if let Some(file) = file {
                            e.unpack(images.join(file)).map_err(fault)?;
                        }
                    } else if name == Path::new("rootfs-diff.tar") {
                        unpack_diff(&mut e, root)?;
                    }
                }
            }
            Source::Dir(dir) => {
                copy_images(dir, &images)?;
                if let Some(mut f) = layer_file(dir, "deleted.files")? {
                    read_deleted(&mut f)?
                        .iter()
                        .try_for_each(|d| remove_in(root, d))?;
                }
                if let Some(mut f) = layer_file(dir, "rootfs-diff.tar")? {
                    unpack_diff(&mut f, root)?;
                }
            }
        }
        if !images.join("inventory.img").is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "no CRIU images (checkpoint/inventory.img) in it",
            ));
        }
        Ok(images)
    }
}

/// An archive opened for reading, decompressed where it is gzip or zstd (podman exports
/// compress). Only a regular file is one.
fn open_archive(path: &Path) -> io::Result<Opened> {
    use io::{Read, Seek};
    let mut f = File::open(path)?;
    if !f.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    let mut magic = [0u8; 4];
    let n = f.read(&mut magic)?;
    f.rewind()?;
    Ok(match &magic[..n] {
        [0x1f, 0x8b, ..] => Opened::Compressed(Box::new(flate2::read::MultiGzDecoder::new(f))),
        [0x28, 0xb5, 0x2f, 0xfd] => Opened::Compressed(Box::new(zstd::Decoder::new(f)?)),
        _ => Opened::Plain(f),
    })
}

/// An opened archive: a plain tar (which can be seeked through) or a decompressing reader.
enum Opened {
    Plain(File),
    Compressed(Box<dyn io::Read>),
}

impl Opened {
    fn reader(self) -> Box<dyn io::Read> {
        match self {
            Opened::Plain(f) => Box::new(f),
            Opened::Compressed(r) => r,
        }
    }
}

/// An archive entry's name without `./` components (`tar -C dir .` writes them).
fn plain_name(p: &Path) -> PathBuf {
    p.components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect()
}

/// For an entry under `checkpoint/`: the image file name it unpacks to, or none for the
/// directory itself. CRIU's images are regular files directly in it; anything else (a
/// symlink would have CRIU read, or its log overwrite, a file of the host's) is refused.
fn image_file(name: &Path, kind: tar::EntryType) -> io::Result<Option<std::ffi::OsString>> {
    let mut parts = name.components().skip(1);
    match (parts.next(), parts.next(), kind) {
        (None, _, tar::EntryType::Directory) => Ok(None),
        (Some(Component::Normal(f)), None, tar::EntryType::Regular) => Ok(Some(f.to_owned())),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{}: only regular files belong in checkpoint/",
                name.display()
            ),
        )),
    }
}

/// Unpacks `rootfs-diff.tar` into the container's root filesystem, owners, modes and times
/// kept (`unpack_in` keeps every entry inside `root`).
fn unpack_diff(diff: &mut dyn io::Read, root: &Path) -> io::Result<()> {
    let mut diff = tar::Archive::new(diff);
    diff.set_preserve_permissions(true);
    diff.set_preserve_ownerships(true);
    diff.set_preserve_mtime(true);
    let ours = |e| archive_fault("rootfs-diff.tar", e);
    for f in diff.entries().map_err(ours)? {
        f.map_err(ours)?.unpack_in(root).map_err(ours)?;
    }
    Ok(())
}

/// An error met reading or applying an archive, as the archive's fault (InvalidData: a
/// malformed or truncated archive, an entry that leaves the root, a link to nothing), unless
/// it is the node's (a full, read-only or failing disk, no memory), which stays as it is.
fn archive_fault(what: &str, e: io::Error) -> io::Error {
    let node = matches!(
        e.raw_os_error(),
        Some(libc::ENOSPC | libc::EDQUOT | libc::EROFS | libc::EIO | libc::ENOMEM)
    ) || e.kind() == io::ErrorKind::OutOfMemory;
    if node || e.kind() == io::ErrorKind::InvalidData {
        return e;
    }
    io::Error::new(io::ErrorKind::InvalidData, format!("{what}: {e}"))
}

/// `deleted.files`: the paths (absolute, in the container) the container had removed.
fn read_deleted(list: &mut dyn io::Read) -> io::Result<Vec<String>> {
    let buf = read_small(list)?;
    serde_json::from_slice(&buf)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("deleted.files: {e}")))
}

/// The most a `config.dump`, `spec.dump` or `deleted.files` is read of.
const METADATA_LIMIT: u64 = 16 << 20;

/// A checkpoint image layer's file `name` (in `dir`, or its `checkpoint/` directory), if
/// there: a regular file, opened without following a symlink (the layer is whoever pushed
/// the image's: a link to a host file, a fifo or a device is refused).
fn layer_file(dir: &Path, name: &str) -> io::Result<Option<File>> {
    use rustix::fs::{Mode, OFlags};
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
    let fd = match rustix::fs::open(dir.join(name), flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Ok(None),
        Err(rustix::io::Errno::LOOP) => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{name} is a symlink"),
            ))
        }
        Err(e) => return Err(e.into()),
    };
    let f = File::from(fd);
    if !f.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{name} is not a regular file"),
        ));
    }
    Ok(Some(f))
}

/// A metadata file's content, up to [`METADATA_LIMIT`].
fn read_small(f: impl io::Read) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    io::Read::read_to_end(&mut io::Read::take(f, METADATA_LIMIT + 1), &mut buf)?;
    if buf.len() as u64 > METADATA_LIMIT {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a metadata file over {METADATA_LIMIT} bytes"),
        ));
    }
    Ok(buf)
}

/// Copies a checkpoint image layer's CRIU images (`<layer>/checkpoint/*`, regular files
/// only, none through a symlink; CRIU writes its restore log beside them, which the
/// read-only layer must not get).
fn copy_images(layer: &Path, to: &Path) -> io::Result<()> {
    let from = layer.join(IMAGES_DIR);
    match std::fs::symlink_metadata(&from) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "checkpoint is not a directory",
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    for e in std::fs::read_dir(&from)? {
        let name = e?.file_name();
        let Some(n) = name.to_str() else { continue };
        // Anything but a regular file is left out.
        let Ok(Some(mut src)) = layer_file(&from, n) else {
            continue;
        };
        let mut dst = File::create(to.join(&name))?;
        io::copy(&mut src, &mut dst)?;
    }
    Ok(())
}

/// Removes `path` (absolute, in the container; a directory with what it holds) from the
/// container's root filesystem `root`, resolving it inside `root` only: each parent is
/// opened without following symlinks, so that a symlink the container left (to `/etc`,
/// say) cannot make this remove a file of the host's. A path that is not there, or has a
/// symlink among its parents, removes nothing; one that leaves the root is refused.
fn remove_in(root: &Path, path: &str) -> io::Result<()> {
    use rustix::fs::{AtFlags, Mode, OFlags};
    let rel = Path::new(path.trim_start_matches('/'));
    let parts: Vec<&std::ffi::OsStr> = rel
        .components()
        .map(|c| match c {
            Component::Normal(n) => Ok(n),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("deleted.files: bad path {path:?}"),
            )),
        })
        .collect::<io::Result<_>>()?;
    let Some((last, parents)) = parts.split_last() else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("deleted.files: bad path {path:?}"),
        ));
    };
    let flags = OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::RDONLY;
    let mut dir = rustix::fs::open(root, flags, Mode::empty())?;
    for p in parents {
        match rustix::fs::openat(&dir, *p, flags, Mode::empty()) {
            Ok(d) => dir = d,
            Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR | rustix::io::Errno::LOOP) => {
                return Ok(())
            }
            Err(e) => return Err(e.into()),
        }
    }
    let st = match rustix::fs::statat(&dir, *last, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(rustix::io::Errno::NOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Directory {
        // Through this process's fd of the parent: nothing above it is looked up again, and
        // remove_dir_all follows no symlink below.
        use std::os::fd::AsRawFd;
        let at = Path::new("/proc/self/fd")
            .join(dir.as_raw_fd().to_string())
            .join(last);
        std::fs::remove_dir_all(at)
    } else {
        rustix::fs::unlinkat(&dir, *last, AtFlags::empty()).map_err(io::Error::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deleted_files_go_from_inside_the_root_only() {
        let d = tempfile::tempdir().unwrap();
        let (root, host) = (d.path().join("root"), d.path().join("host"));
        std::fs::create_dir_all(root.join("etc/sub")).unwrap();
        std::fs::create_dir_all(&host).unwrap();
        std::fs::write(root.join("etc/gone"), "x").unwrap();
        std::fs::write(root.join("etc/sub/f"), "x").unwrap();
        std::fs::write(host.join("x"), "host's").unwrap();
        remove_in(&root, "/etc/gone").unwrap();
        assert!(!root.join("etc/gone").exists());
        remove_in(&root, "/etc/sub").unwrap();
        assert!(!root.join("etc/sub").exists());
        // Not there: nothing to do.
        remove_in(&root, "/no/such/file").unwrap();
        // A symlink among the parents is not followed out of the root.
        std::os::unix::fs::symlink(&host, root.join("a")).unwrap();
        remove_in(&root, "/a/x").unwrap();
        assert_eq!(std::fs::read_to_string(host.join("x")).unwrap(), "host's");
        // A symlink itself goes, not what it names.
        remove_in(&root, "/a").unwrap();
        assert!(host.join("x").exists() && !root.join("a").exists());
        for bad in ["/", "/../x", "/a/../../x", ""] {
            assert!(remove_in(&root, bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_regular_files_are_criu_images() {
        use tar::EntryType;
        let f = |n: &str, k| image_file(Path::new(n), k);
        assert_eq!(f("checkpoint", EntryType::Directory).unwrap(), None);
        assert_eq!(
            f("checkpoint/pages-1.img", EntryType::Regular).unwrap(),
            Some("pages-1.img".into())
        );
        assert!(f("checkpoint/pages-1.img", EntryType::Symlink).is_err());
        assert!(f("checkpoint/restore.log", EntryType::Link).is_err());
        assert!(f("checkpoint/sub/x.img", EntryType::Regular).is_err());
        assert_eq!(
            plain_name(Path::new("./checkpoint/a")),
            Path::new("checkpoint/a")
        );
    }

    /// A directory the checkpointed container replaced whole is listed in `deleted.files`:
    /// it goes before the diff's new content is unpacked, wherever the archive has the list
    /// (vessel's before the diff, CRI-O's after it), so that the image's old files do not
    /// show through again, nor the new ones go.
    #[test]
    fn deletions_listed_before_the_diff_go_before_it() {
        let d = tempfile::tempdir().unwrap();
        let mut diff = tar::Builder::new(Vec::new());
        for (name, data) in [
            ("app/", None),
            ("app/cache/", None),
            ("app/cache/new", Some(b"n")),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o755);
            h.set_uid(0);
            h.set_gid(0);
            h.set_mtime(0);
            match data {
                Some(b) => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(1);
                    diff.append_data(&mut h, name, &b[..]).unwrap();
                }
                None => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    diff.append_data(&mut h, name, io::empty()).unwrap();
                }
            }
        }
        let diff = diff.into_inner().unwrap();
        let mut a = tar::Builder::new(Vec::new());
        let mut add = |name: &str, data: &[u8]| {
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o600);
            h.set_size(data.len() as u64);
            a.append_data(&mut h, name, data).unwrap();
        };
        add("checkpoint/inventory.img", b"i");
        add("deleted.files", br#"["/app/cache"]"#);
        add("rootfs-diff.tar", &diff);
        let all = a.into_inner().unwrap();
        // CRI-O's order too: the diff, then the list.
        let mut b = tar::Builder::new(Vec::new());
        let mut add = |name: &str, data: &[u8]| {
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o600);
            h.set_size(data.len() as u64);
            b.append_data(&mut h, name, data).unwrap();
        };
        add("checkpoint/inventory.img", b"i");
        add("rootfs-diff.tar", &diff);
        add("deleted.files", br#"["/app/cache"]"#);
        let crio = b.into_inner().unwrap();
        for (n, bytes) in [all, crio].into_iter().enumerate() {
            let archive = d.path().join(format!("a{n}.tar"));
            std::fs::write(&archive, bytes).unwrap();
            let root = d.path().join(format!("root{n}"));
            std::fs::create_dir_all(root.join("app/cache")).unwrap();
            std::fs::write(root.join("app/cache/old"), "image's").unwrap();
            let c = Checkpoint {
                source: Source::Archive(archive),
                config: ConfigDump::default(),
                process: Process::default(),
                binds: Vec::new(),
                userns: false,
            };
            c.unpack(&d.path().join(format!("snap{n}")), &root).unwrap();
            assert!(root.join("app/cache/new").is_file(), "archive {n}");
            assert!(!root.join("app/cache/old").exists(), "archive {n}");
        }
    }

    /// An archive that names its image exactly is restored onto that image only, never onto
    /// whatever its tag names now; one that has names only is looked up by them.
    #[test]
    fn the_base_image_is_taken_by_its_exact_name_where_there_is_one() {
        let id = format!("sha256:{}", "ab".repeat(32));
        let with = |image: &str, r: &str, name: &str| Checkpoint {
            source: Source::Archive("/a.tar".into()),
            config: ConfigDump {
                rootfs_image: image.into(),
                rootfs_image_ref: r.into(),
                rootfs_image_name: name.into(),
                ..Default::default()
            },
            process: Process::default(),
            binds: Vec::new(),
            userns: false,
        };
        // vessel's: id, digest reference, tag.
        let c = with(&id, "r.io/app@sha256:00", "r.io/app:1");
        assert_eq!(
            c.base_images().collect::<Vec<_>>(),
            [id.as_str(), "r.io/app@sha256:00"]
        );
        // CRI-O's: the name typed, the bare id, the name.
        let bare = "cd".repeat(32);
        let c = with("app:1", &bare, "localhost/app:1");
        assert_eq!(c.base_images().collect::<Vec<_>>(), [bare.as_str()]);
        // Names only.
        let c = with("app:1", "", "localhost/app:1");
        assert_eq!(
            c.base_images().collect::<Vec<_>>(),
            ["app:1", "localhost/app:1"]
        );
    }

    #[test]
    fn the_checkpointed_command_is_used_where_the_request_names_none() {
        let c = Checkpoint {
            source: Source::Archive("/a.tar".into()),
            config: ConfigDump::default(),
            process: Process {
                args: vec!["/bin/sh".into(), "-c".into(), "sleep 9".into()],
                env: vec!["A=1".into(), "B=x=y".into()],
                cwd: "/w".into(),
                terminal: false,
            },
            binds: Vec::new(),
            userns: false,
        };
        let mut cfg = cri::ContainerConfig {
            image: Some(cri::ImageSpec {
                image: "/a.tar".into(),
                ..Default::default()
            }),
            // The checkpoint's process decides: it had pipes.
            tty: true,
            ..Default::default()
        };
        c.apply(&mut cfg, "busybox:latest");
        assert!(!cfg.tty);
        assert_eq!(cfg.image.unwrap().image, "busybox:latest");
        assert_eq!(cfg.command, ["/bin/sh", "-c", "sleep 9"]);
        assert_eq!(cfg.working_dir, "/w");
        assert_eq!(cfg.envs[1].value, "x=y");
        let spec = serde_json::json!({"mounts": [
            {"destination": "/vol", "type": "bind", "source": "/a"},
            {"destination": "/etc/hosts", "source": "/h", "options": ["rbind", "ro"]},
            {"destination": "/proc", "type": "proc"}
        ]});
        let c = Checkpoint {
            binds: bind_destinations(&spec),
            ..c
        };
        let userns = serde_json::json!({"linux": {"namespaces": [{"type": "user"}]}});
        assert!(c
            .check_spec(&userns)
            .unwrap_err()
            .contains("user namespace"));
        assert_eq!(c.binds, ["/vol", "/etc/hosts"]);
        assert!(c.check_spec(&spec).is_ok());
        let e = c
            .check_spec(
                &serde_json::json!({"mounts": [{"destination": "/etc/hosts", "type": "bind"}]}),
            )
            .unwrap_err();
        assert!(e.contains("at /vol,") || e.contains("at /vol "), "{e}");
        let mut with_dev = spec.clone();
        with_dev["mounts"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({"destination": "/dev", "type": "bind", "source": "/dev"}));
        let e = c.check_spec(&with_dev).unwrap_err();
        assert!(e.contains("volume at /dev"), "{e}");
        let mut own = cri::ContainerConfig {
            command: vec!["top".into()],
            ..Default::default()
        };
        c.apply(&mut own, "busybox:latest");
        assert_eq!(own.command, ["top"]);
        assert!(own.envs.is_empty());
        assert!(!own.tty);
        // A process that had a terminal gets one back.
        let c = Checkpoint {
            process: Process {
                terminal: true,
                ..c.process
            },
            ..c
        };
        c.apply(&mut own, "busybox:latest");
        assert!(own.tty);
    }
}
