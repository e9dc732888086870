//! CheckpointContainer: a running container's processes, dumped with CRIU by its pod's agent
//! (flat pods), and the changes to its root filesystem, in one tar archive at the CRI
//! `location`. The container keeps running.
//!
//! The archive has CRI-O's files, names and formats; `checkpointctl show` reads it as a
//! containerd one (the spec is named by containerd CRI's annotations):
//! - `checkpoint/`: CRIU's images and its `dump.log`;
//! - `config.dump`: the container's identity and image (JSON);
//! - `spec.dump`: the OCI runtime spec the container ran with (as its agent ran it: bind
//!   sources are the agent's staged copies of the volume paths), with `io.kubernetes.cri.*`
//!   annotations naming the container, its pod, namespace and image;
//! - `rootfs-diff.tar`: files the container added or changed in its root filesystem (its
//!   overlay upper directory, archived by the agent while CRIU still holds the dumped tasks,
//!   so that the files are those the dump's open files name), and `deleted.files` (JSON) the image files it removed
//!   (whiteouts; a directory it replaced whole, an opaque one, is in the diff as it is now).
//!
//! kubelet's deadline for the call is its `timeout`: vessel answers DeadlineExceeded at that
//! moment, but never cuts a dump short (a killed CRIU can leave its parasite code in the
//! tasks): the dump runs to its end in a task of its own, holding the container's op lock,
//! and no archive appears after the deadline.
//!
//! The images are made under vesseld's state root (`checkpoints/`, pid-tagged, so that a
//! crash's leftovers go at the next start), then archived into a temporary file beside
//! `location`, synced and renamed into place: a reader never sees half an archive.

use super::{Ctr, Runtime};
use crate::errors::{Result, RuntimeError};
use crate::sandbox::{Dump, Pod, SandboxBackend};
use crate::state::{ContainerRecord, ContainerState, PodRecord};
use serde::Serialize;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use vessel_agent::rootfs_diff;
use vessel_images::fsutil;
use vessel_images::ImageStore;

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
    /// FailedPrecondition where the node's operator turned CRIU off.
    pub(super) fn criu_enabled(&self, what: &str) -> Result<()> {
        if self.opts.criu {
            return Ok(());
        }
        Err(RuntimeError::FailedPrecondition(format!(
            "{what}: checkpoint and restore are turned off on this node (runtime.enable_criu_support = false)"
        )))
    }

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
        // Nor a device, a FIFO or a socket, which the archive would replace.
        if std::fs::metadata(archive).is_ok_and(|m| !m.is_file()) {
            return Err(RuntimeError::InvalidArgument(format!(
                "CheckpointContainer {id}: location {location} is not a regular file: give the archive's file path"
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
        self.criu_enabled(&format!("CheckpointContainer {id}"))?;
        let pod = self.pod(&ctr.record().pod_id)?;
        let backend = self.shared_backend(pod.record().backend.kind()).clone();
        let deadline = tokio::time::Instant::now() + timeout;
        let job = Job {
            id: id.to_string(),
            archive: archive.to_path_buf(),
            ctr,
            pod,
            backend,
            store: self.store.clone(),
            staging_root: self.dirs.checkpoints_dir(),
            deadline: deadline.into_std(),
        };
        // Its own task: a client that gives up (kubelet's deadline is this same timeout)
        // does not cut the dump short. The task holds the container's op lock until the
        // agent's CRIU has ended, and removes what it staged.
        let task = tokio::spawn(job.run());
        match tokio::time::timeout_at(deadline, task).await {
            Ok(r) => r.map_err(|e| RuntimeError::Internal(format!("CheckpointContainer {id}: {e}")))?,
            Err(_) => Err(RuntimeError::DeadlineExceeded(format!(
                "CheckpointContainer {id}: not done within {timeout:?}; the dump ends in the background and no archive is written"
            ))),
        }
    }
}

/// One CheckpointContainer, run to its end whether or not its caller waits.
struct Job {
    id: String,
    archive: PathBuf,
    ctr: Arc<Ctr>,
    pod: Arc<Pod>,
    backend: Arc<dyn SandboxBackend>,
    store: Arc<ImageStore>,
    staging_root: PathBuf,
    deadline: std::time::Instant,
}

impl Job {
    async fn run(self) -> Result<()> {
        let id = self.id.as_str();
        // Not stopped or removed while it is dumped.
        let _op = self.ctr.op.lock().await;
        let rec = self.ctr.record();
        if rec.state != ContainerState::Running {
            return Err(RuntimeError::FailedPrecondition(format!(
                "CheckpointContainer: container {id} is not running ({:?})",
                rec.state
            )));
        }
        // A StopContainer waiting out its grace period has signalled it: its processes
        // are shutting down, and a restore would bring back a container on its way out.
        // (Not once a stop given up on by its caller has gone: the container may run on.)
        if self.ctr.stopping.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            return Err(RuntimeError::FailedPrecondition(format!(
                "CheckpointContainer: container {id} is being stopped"
            )));
        }
        let staging = fsutil::temp_path(&self.staging_root, &format!("checkpoint-{id}"));
        std::fs::create_dir_all(&staging).map_err(io_err(id, "making", &staging))?;
        let clean = RemoveOnDrop(staging.clone());
        let t = std::time::Instant::now();
        let upper = self
            .store
            .snapshot(&rec.snapshot)
            .ok()
            .flatten()
            .map(|s| s.upper())
            .filter(|u| u.is_dir());
        let dump = Dump {
            image_dir: staging.join("checkpoint"),
            upper: upper.clone(),
            diff_dir: staging.clone(),
        };
        let spec = match self.backend.checkpoint(&self.pod, &rec, &dump).await {
            Ok(spec) => spec,
            Err(e) => {
                let _ = tokio::task::spawn_blocking(move || drop(clean)).await;
                return Err(e);
            }
        };
        let dumped = t.elapsed();
        let spec = annotate_spec(&spec, &self.pod.record(), &rec);
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
        let config = serde_json::to_vec_pretty(&config).map_err(|e| {
            RuntimeError::Internal(format!("CheckpointContainer {id}: config.dump: {e}"))
        })?;
        let out = self.archive.clone();
        let deadline = self.deadline;
        // The staging dir (the dump: gigabytes, maybe) goes on the blocking thread too.
        let written = tokio::task::spawn_blocking(move || {
            let r = write_archive(&staging, &out, &config, &spec, upper.as_deref(), deadline);
            drop(clean);
            r
        })
        .await
        .map_err(|e| RuntimeError::Internal(format!("CheckpointContainer {id}: {e}")))?;
        let location = self.archive.display();
        let size = written.map_err(|e| match e.kind() {
            io::ErrorKind::TimedOut => RuntimeError::DeadlineExceeded(format!(
                "CheckpointContainer {id}: the dump took {dumped:?}, and the archive {location} was not written in the time left"
            )),
            _ => RuntimeError::Internal(format!(
                "CheckpointContainer {id}: writing the archive {location}: {e}"
            )),
        })?;
        tracing::info!(id, %location, bytes = size, dump = ?dumped, took = ?t.elapsed(), "container checkpointed");
        Ok(())
    }
}

/// `spec.dump`: the spec the container ran with, plus the annotations that name it as
/// containerd's CRI does (`io.kubernetes.cri.*`: container, pod, namespace, image), which
/// checkpoint tools read for an archive that is neither CRI-O's nor Podman's. A spec that is
/// not JSON is kept as it is.
fn annotate_spec(spec: &[u8], pod: &PodRecord, rec: &ContainerRecord) -> Vec<u8> {
    let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(spec) else {
        return spec.to_vec();
    };
    let meta = pod.config.metadata.clone().unwrap_or_default();
    let name = rec.config.metadata.as_ref().map_or("", |m| m.name.as_str());
    if let Some(o) = v.as_object_mut() {
        let a = o
            .entry("annotations")
            .or_insert_with(|| serde_json::json!({}));
        if let Some(a) = a.as_object_mut() {
            for (k, val) in [
                ("io.kubernetes.cri.container-type", "container"),
                ("io.kubernetes.cri.container-name", name),
                ("io.kubernetes.cri.sandbox-id", pod.id.as_str()),
                ("io.kubernetes.cri.sandbox-name", meta.name.as_str()),
                (
                    "io.kubernetes.cri.sandbox-namespace",
                    meta.namespace.as_str(),
                ),
                ("io.kubernetes.cri.sandbox-uid", meta.uid.as_str()),
                ("io.kubernetes.cri.image-name", rec.image_name.as_str()),
            ] {
                a.insert(k.into(), val.into());
            }
        }
    }
    serde_json::to_vec_pretty(&v).unwrap_or_else(|_| spec.to_vec())
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
    deadline: std::time::Instant,
) -> io::Result<u64> {
    std::fs::write(staging.join("config.dump"), config)?;
    std::fs::write(staging.join("spec.dump"), spec)?;
    // The agent wrote the diff while CRIU held the tasks; an agent too old to leaves it to
    // us, after the dump, with the container running on.
    let agent_wrote = staging.join(rootfs_diff::DIFF_TAR).exists();
    if let Some(upper) = upper.filter(|u| u.is_dir() && !agent_wrote) {
        rootfs_diff::write(upper, staging)?;
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
        // Past the caller's deadline its caller has been told it failed: no archive then.
        if std::time::Instant::now() >= deadline {
            return Err(io::Error::from(io::ErrorKind::TimedOut));
        }
        std::fs::rename(&tmp, archive)?;
        fsutil::sync_dir(dir)?;
        Ok(size)
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
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
        let later = std::time::Instant::now() + Duration::from_secs(60);
        let size = write_archive(&staging, &out, b"{}", b"{}", Some(&upper), later).unwrap();
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
        // A diff the agent wrote (while CRIU held the tasks) is the one archived.
        std::fs::write(staging.join("rootfs-diff.tar"), b"the agent's").unwrap();
        let kept = d.path().join("out/kept.tar");
        write_archive(&staging, &kept, b"{}", b"{}", Some(&upper), later).unwrap();
        let mut a = tar::Archive::new(File::open(&kept).unwrap());
        let diff = a
            .entries()
            .unwrap()
            .map(|e| e.unwrap())
            .find(|e| e.path().unwrap() == Path::new("rootfs-diff.tar"))
            .map(|mut e| {
                let mut v = Vec::new();
                io::Read::read_to_end(&mut e, &mut v).unwrap();
                v
            });
        assert_eq!(diff.as_deref(), Some(&b"the agent's"[..]));
        std::fs::remove_file(&kept).unwrap();
        // Past the deadline: no archive, no temporary file.
        let late = d.path().join("out/late.tar");
        let past = std::time::Instant::now();
        let e = write_archive(&staging, &late, b"{}", b"{}", None, past).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(!late.exists());
        assert_eq!(std::fs::read_dir(d.path().join("out")).unwrap().count(), 1);
    }
}
