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
use k8s_cri::v1 as cri;
use serde::Deserialize;
use std::fs::File;
use std::io;
use std::path::{Component, Path, PathBuf};

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
                let read = |n: &str| std::fs::read(dir.join(n)).ok();
                (read("config.dump"), read("spec.dump"))
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
        let missing: Vec<&str> = self
            .binds
            .iter()
            .filter(|d| !have.contains(d))
            .map(String::as_str)
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        Err(format!(
            "the {} has a volume or bind mount at {}, which CRIU restores onto a mount at the same path: give the container a mount there",
            self.source,
            missing.join(", ")
        ))
    }

    /// An archive's `config.dump` and `spec.dump`.
    fn read_archive(source: &Source, archive: &Path) -> Result<Dumps> {
        let f = File::open(archive).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => RuntimeError::NotFound(format!("{source} not found")),
            _ => bad(source, e),
        })?;
        let (mut config, mut spec) = (None, None);
        let mut a = tar::Archive::new(f);
        for e in a.entries_with_seek().map_err(|e| bad(source, e))? {
            let mut e = e.map_err(|e| bad(source, e))?;
            let path = e.path().map_err(|e| bad(source, e))?.into_owned();
            let slot = match path.to_str() {
                Some("config.dump") => &mut config,
                Some("spec.dump") => &mut spec,
                _ => continue,
            };
            let mut buf = Vec::new();
            io::Read::read_to_end(&mut e, &mut buf).map_err(|e| bad(source, e))?;
            *slot = Some(buf);
        }
        Ok((config, spec))
    }

    /// The image the checkpointed container ran from, as the store may know it: its name,
    /// its digest reference, its id.
    pub fn base_images(&self) -> impl Iterator<Item = &str> {
        [
            &self.config.rootfs_image_name,
            &self.config.rootfs_image_ref,
            &self.config.rootfs_image,
        ]
        .into_iter()
        .map(|s| s.as_str())
        .filter(|s| !s.is_empty())
    }

    /// The base image, for messages.
    pub fn base_image_name(&self) -> &str {
        self.base_images().next().unwrap_or("")
    }

    /// Whether the checkpointed process had a terminal (not restorable here).
    pub fn terminal(&self) -> bool {
        self.process.terminal
    }

    /// The container config of the restored container: the request's, with the base image
    /// and, where the request names no command, the checkpointed process's.
    pub fn apply(&self, config: &mut cri::ContainerConfig, image_name: &str) {
        config.image = Some(cri::ImageSpec {
            image: image_name.to_string(),
            ..config.image.clone().unwrap_or_default()
        });
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

    /// Unpacks the checkpoint into the container's snapshot (blocking): the CRIU images into
    /// `<snapshot>/checkpoint`, the root filesystem changes into `upper` (the overlay upper
    /// directory: files with their owners and modes, whiteouts for the deleted files).
    /// Answers the images directory.
    pub fn unpack(&self, snapshot_dir: &Path, upper: &Path) -> io::Result<PathBuf> {
        let images = snapshot_dir.join(IMAGES_DIR);
        std::fs::create_dir_all(&images)?;
        match &self.source {
            Source::Archive(archive) => {
                let mut a = tar::Archive::new(File::open(archive)?);
                for e in a.entries()? {
                    let mut e = e?;
                    let path = e.path()?.into_owned();
                    if path.starts_with(IMAGES_DIR) {
                        // Checked by unpack_in: nothing lands outside the snapshot directory.
                        e.unpack_in(snapshot_dir)?;
                    } else if path == Path::new("rootfs-diff.tar") {
                        unpack_diff(&mut e, upper)?;
                    } else if path == Path::new("deleted.files") {
                        whiteouts(&mut e, upper)?;
                    }
                }
            }
            Source::Dir(dir) => {
                copy_images(&dir.join(IMAGES_DIR), &images)?;
                let present = |r: io::Result<File>| match r {
                    Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                    r => r.map(Some),
                };
                if let Some(mut f) = present(File::open(dir.join("rootfs-diff.tar")))? {
                    unpack_diff(&mut f, upper)?;
                }
                if let Some(mut f) = present(File::open(dir.join("deleted.files")))? {
                    whiteouts(&mut f, upper)?;
                }
            }
        }
        if !images.join("inventory.img").exists() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "no CRIU images (checkpoint/inventory.img) in it",
            ));
        }
        Ok(images)
    }
}

/// Unpacks `rootfs-diff.tar` into the overlay upper dir, owners, modes and times kept.
fn unpack_diff(diff: &mut dyn io::Read, upper: &Path) -> io::Result<()> {
    let mut diff = tar::Archive::new(diff);
    diff.set_preserve_permissions(true);
    diff.set_preserve_ownerships(true);
    diff.set_preserve_mtime(true);
    diff.set_unpack_xattrs(true);
    for f in diff.entries()? {
        // unpack_in keeps every entry inside `upper`.
        f?.unpack_in(upper)?;
    }
    Ok(())
}

/// Makes a whiteout in the overlay upper dir for each path of `deleted.files`.
fn whiteouts(list: &mut dyn io::Read, upper: &Path) -> io::Result<()> {
    let mut buf = Vec::new();
    list.read_to_end(&mut buf)?;
    let deleted: Vec<String> = serde_json::from_slice(&buf).map_err(io::Error::other)?;
    deleted.iter().try_for_each(|d| whiteout(upper, d))
}

/// Copies a checkpoint image layer's CRIU images (plain files; CRIU writes its restore log
/// beside them, which the read-only layer must not get).
fn copy_images(from: &Path, to: &Path) -> io::Result<()> {
    for e in std::fs::read_dir(from)? {
        let e = e?;
        if e.file_type()?.is_file() {
            std::fs::copy(e.path(), to.join(e.file_name()))?;
        }
    }
    Ok(())
}

/// Marks `path` (absolute, in the container) deleted in the overlay upper dir `upper`: a
/// character device 0:0, overlayfs's whiteout. A path that leaves the root is refused; one
/// the diff brought back is left as it is.
fn whiteout(upper: &Path, path: &str) -> io::Result<()> {
    let rel = Path::new(path.trim_start_matches('/'));
    if rel.as_os_str().is_empty() || rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("deleted.files: bad path {path:?}"),
        ));
    }
    let at = upper.join(rel);
    if std::fs::symlink_metadata(&at).is_ok() {
        return Ok(());
    }
    if let Some(parent) = at.parent() {
        std::fs::create_dir_all(parent)?;
    }
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &at,
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::empty(),
        0,
    )
    .map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deleted_files_become_whiteouts_inside_the_upper_dir_only() {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let d = tempfile::tempdir().unwrap();
        whiteout(d.path(), "/etc/gone").unwrap();
        let m = std::fs::symlink_metadata(d.path().join("etc/gone")).unwrap();
        assert!(m.file_type().is_char_device() && m.rdev() == 0);
        for bad in ["/", "/../x", "/a/../../x", ""] {
            assert!(whiteout(d.path(), bad).is_err(), "{bad:?}");
        }
        // A file the diff brought back stays.
        std::fs::write(d.path().join("kept"), "x").unwrap();
        whiteout(d.path(), "/kept").unwrap();
        assert_eq!(std::fs::read_to_string(d.path().join("kept")).unwrap(), "x");
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
            ..Default::default()
        };
        c.apply(&mut cfg, "busybox:latest");
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
        let mut own = cri::ContainerConfig {
            command: vec!["top".into()],
            ..Default::default()
        };
        c.apply(&mut own, "busybox:latest");
        assert_eq!(own.command, ["top"]);
        assert!(own.envs.is_empty());
    }
}
