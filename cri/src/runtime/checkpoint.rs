//! CheckpointContainer: a running container's processes, dumped with CRIU by its pod's agent
//! (flat pods), and the changes to its root filesystem, in one tar archive at the CRI
//! `location`. The container keeps running.
//!
//! The archive is laid out as CRI-O's, so that `checkpointctl` reads it and a restoring
//! runtime finds what it needs:
//! - `checkpoint/`: CRIU's images and its `dump.log`;
//! - `config.dump`: the container's identity and image (JSON);
//! - `spec.dump`: the OCI runtime spec the container ran with;
//! - `rootfs-diff.tar`: files the container added or changed in its root filesystem (its
//!   overlay upper directory), and `deleted.files` (JSON) the image files it removed.
//!
//! The images are made under vesseld's state root (`checkpoints/`, pid-tagged, so that a
//! crash's leftovers go at the next start), then archived into a temporary file beside
//! `location`, synced and renamed into place: a reader never sees half an archive.

use super::Runtime;
use crate::errors::{Result, RuntimeError};
use crate::sandbox::Dump;
use serde::Serialize;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;
use vessel_images::fsutil;

/// How long a dump may take when CRI's `timeout` is 0 ("use the CRI default").
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// `config.dump`: what CRI-O writes there (checkpointctl's `ContainerConfig`).
#[derive(Serialize)]
struct ConfigDump<'a> {
    id: &'a str,
    name: &'a str,
    #[serde(rename = "rootfsImage")]
    rootfs_image: &'a str,
    #[serde(rename = "rootfsImageRef")]
    rootfs_image_ref: &'a str,
    #[serde(rename = "rootfsImageName")]
    rootfs_image_name: &'a str,
    runtime: &'static str,
    #[serde(rename = "createdTime")]
    created_time: String,
    #[serde(rename = "checkpointedTime")]
    checkpointed_time: String,
}

fn rfc3339(nanos: i64) -> String {
    chrono::DateTime::from_timestamp_nanos(nanos)
        .to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
}

impl Runtime {
    /// CRI CheckpointContainer. `timeout_secs` 0 is [`DEFAULT_TIMEOUT`].
    pub async fn checkpoint_container(
        &self,
        id: &str,
        location: &str,
        timeout_secs: i64,
    ) -> Result<()> {
        let archive = Path::new(location);
        if location.is_empty() || !archive.is_absolute() {
            return Err(RuntimeError::InvalidArgument(format!(
                "CheckpointContainer {id}: location {location:?} is not an absolute path: give the archive's file path"
            )));
        }
        if archive.is_dir() {
            return Err(RuntimeError::InvalidArgument(format!(
                "CheckpointContainer {id}: location {location} is a directory: give the archive's file path"
            )));
        }
        let timeout = match timeout_secs {
            n if n < 0 => {
                return Err(RuntimeError::InvalidArgument(format!(
                    "CheckpointContainer {id}: negative timeout {n}"
                )))
            }
            0 => DEFAULT_TIMEOUT,
            n => Duration::from_secs(n as u64),
        };
        let ctr = self.ctr(id)?;
        // Not stopped or removed while it is dumped.
        let _op = ctr.op.lock().await;
        let (rec, pod) = self.running_in_pod(id, "CheckpointContainer")?;
        let backend = self.backend(&pod.record());

        let root = self.dirs.checkpoints_dir();
        let staging = fsutil::temp_path(&root, &format!("checkpoint-{id}"));
        std::fs::create_dir_all(&staging).map_err(io_err(id, "making", &staging))?;
        let _clean = RemoveOnDrop(staging.clone());
        let t = std::time::Instant::now();
        let dump = Dump {
            image_dir: staging.join("checkpoint"),
            timeout,
        };
        let spec = backend.checkpoint(&pod, &rec, &dump).await?;
        let dumped = t.elapsed();

        let config = ConfigDump {
            id: &rec.id,
            name: rec.config.metadata.as_ref().map_or("", |m| m.name.as_str()),
            rootfs_image: &rec.image_id,
            rootfs_image_ref: &rec.image_ref,
            rootfs_image_name: &rec.image_name,
            runtime: "vessel",
            created_time: rfc3339(rec.created_at),
            checkpointed_time: rfc3339(crate::state::now_nanos()),
        };
        let upper = self
            .store
            .snapshot(&rec.snapshot)
            .ok()
            .flatten()
            .map(|s| s.upper());
        let out = archive.to_path_buf();
        let dir = staging.clone();
        let config = serde_json::to_vec_pretty(&config).map_err(|e| {
            RuntimeError::Internal(format!("CheckpointContainer {id}: config.dump: {e}"))
        })?;
        let written = tokio::task::spawn_blocking(move || {
            write_archive(&dir, &out, &config, &spec, upper.as_deref())
        })
        .await
        .map_err(|e| RuntimeError::Internal(format!("CheckpointContainer {id}: {e}")))?;
        let size = written.map_err(|e| {
            RuntimeError::Internal(format!(
                "CheckpointContainer {id}: writing the archive {location}: {e}"
            ))
        })?;
        tracing::info!(id, location, bytes = size, dump = ?dumped, took = ?t.elapsed(), "container checkpointed");
        Ok(())
    }
}

fn io_err<'a>(
    id: &'a str,
    what: &'a str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> RuntimeError + 'a {
    move |e| {
        RuntimeError::Internal(format!(
            "CheckpointContainer {id}: {what} {}: {e}",
            path.display()
        ))
    }
}

/// Removes a staging directory however the checkpoint ends.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Err(e) = fsutil::remove_any(&self.0) {
            tracing::warn!(path = %self.0.display(), error = %e, "removing checkpoint staging");
        }
    }
}

/// Writes the metadata and the rootfs diff into `staging` (beside CRIU's `checkpoint/`),
/// then archives it all into `archive` atomically. Answers the archive's size.
fn write_archive(
    staging: &Path,
    archive: &Path,
    config: &[u8],
    spec: &[u8],
    upper: Option<&Path>,
) -> io::Result<u64> {
    std::fs::write(staging.join("config.dump"), config)?;
    std::fs::write(staging.join("spec.dump"), spec)?;
    if let Some(upper) = upper.filter(|u| u.is_dir()) {
        let deleted = write_rootfs_diff(upper, &staging.join("rootfs-diff.tar"))?;
        if !deleted.is_empty() {
            let json = serde_json::to_vec(&deleted).map_err(io::Error::other)?;
            std::fs::write(staging.join("deleted.files"), json)?;
        }
    }
    let dir = archive.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir)?;
    let tmp = fsutil::temp_path(dir, "checkpoint");
    let r = (|| {
        // Root's only: the dump holds the container's memory (its secrets too).
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        let mut b = tar::Builder::new(io::BufWriter::new(f));
        b.follow_symlinks(false);
        let mut names: Vec<_> = std::fs::read_dir(staging)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<io::Result<_>>()?;
        names.sort();
        for n in names {
            let p = staging.join(&n);
            if p.is_dir() {
                b.append_dir_all(&n, &p)?;
            } else {
                b.append_path_with_name(&p, &n)?;
            }
        }
        let f = b.into_inner()?.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        let size = f.metadata()?.len();
        std::fs::rename(&tmp, archive)?;
        fsutil::sync_dir(dir)?;
        Ok(size)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// Archives an overlay upper directory: directories, files and symlinks the container made
/// or changed, with their modes, owners and times. Answers the paths it deleted from the
/// image (overlayfs whiteouts, character devices 0:0), which are not archived. Other special
/// files (sockets, fifos, devices) are left out.
fn write_rootfs_diff(upper: &Path, out: &Path) -> io::Result<Vec<String>> {
    let mut b = tar::Builder::new(io::BufWriter::new(File::create(out)?));
    b.follow_symlinks(false);
    let mut deleted = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = upper.join(&rel);
        let mut entries: Vec<_> = std::fs::read_dir(&dir)?.collect::<io::Result<_>>()?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = rel.join(e.file_name());
            let path = e.path();
            let m = std::fs::symlink_metadata(&path)?;
            let ft = m.file_type();
            if ft.is_char_device() && m.rdev() == 0 {
                deleted.push(format!("/{}", name.display()));
            } else if ft.is_dir() {
                b.append_path_with_name(&path, &name)?;
                stack.push(name);
            } else if ft.is_file() || ft.is_symlink() {
                b.append_path_with_name(&path, &name)?;
            } else {
                tracing::debug!(path = %path.display(), "checkpoint: special file left out of rootfs-diff.tar");
            }
        }
    }
    b.into_inner()?
        .into_inner()
        .map_err(|e| e.into_error())?
        .sync_all()?;
    deleted.sort();
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// The entries of a tar file, sorted, directories without their trailing slash.
    fn names(path: &Path) -> Vec<String> {
        let mut names: Vec<String> = tar::Archive::new(File::open(path).unwrap())
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .map(|n| n.trim_end_matches('/').to_string())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn the_archive_holds_the_dump_the_metadata_and_the_rootfs_changes() {
        let d = tempfile::tempdir().unwrap();
        let upper = d.path().join("upper");
        std::fs::create_dir_all(upper.join("etc/app")).unwrap();
        std::fs::write(upper.join("etc/app/conf"), b"x=1").unwrap();
        std::os::unix::fs::symlink("conf", upper.join("etc/app/link")).unwrap();
        // A whiteout: what overlayfs makes when a container deletes an image file.
        rustix::fs::mknodat(
            rustix::fs::CWD,
            upper.join("etc/gone"),
            rustix::fs::FileType::CharacterDevice,
            rustix::fs::Mode::empty(),
            0,
        )
        .unwrap();
        let staging = d.path().join("staging");
        std::fs::create_dir_all(staging.join("checkpoint")).unwrap();
        std::fs::write(staging.join("checkpoint/inventory.img"), b"img").unwrap();
        let out = d.path().join("out/ckpt.tar");
        let size = write_archive(&staging, &out, b"{}", b"{}", Some(&upper)).unwrap();
        let meta = std::fs::metadata(&out).unwrap();
        assert_eq!(meta.len(), size);
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(
            names(&out),
            [
                "checkpoint",
                "checkpoint/inventory.img",
                "config.dump",
                "deleted.files",
                "rootfs-diff.tar",
                "spec.dump"
            ]
        );
        assert_eq!(
            names(&staging.join("rootfs-diff.tar")),
            ["etc", "etc/app", "etc/app/conf", "etc/app/link"]
        );
        let deleted = std::fs::read_to_string(staging.join("deleted.files")).unwrap();
        assert_eq!(deleted, r#"["/etc/gone"]"#);
        // Only the archive is left in its directory: no temporary file.
        assert_eq!(std::fs::read_dir(d.path().join("out")).unwrap().count(), 1);
    }
}
