//! Container root filesystems.
//!
//! A snapshot is a container's writable view of an image: the image's unpacked layers (shared,
//! read-only) plus a private upper and work dir. For flat pods it is mounted with overlayfs on
//! the host. A VM pod uses the same record differently: its layers go into the guest as
//! read-only block images named by the same diff IDs and the overlay is stacked in the guest,
//! so [`Snapshot::layers`] is the backend-neutral description and [`Snapshot::mount_overlay`]
//! the flat backend's use of it.
//!
//! ```text
//! <store>/snapshots/<id>/snapshot.json   SnapshotMeta (written atomically, before any mount)
//! <store>/snapshots/<id>/upper           the container's writes
//! <store>/snapshots/<id>/work            overlayfs work dir
//! <store>/snapshots/<id>/rootfs          mount point
//! ```
//! The store's garbage collector keeps every layer a snapshot names.

use crate::digest::Digest;
use crate::error::{ImageError, Result};
use crate::fsutil;
use crate::store::{ImageRecord, ImageStore};
use serde::{Deserialize, Serialize};
use std::fs;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SnapshotMeta {
    pub id: String,
    pub image: Digest,
    /// Diff IDs of the image's layers, bottom-most first.
    pub layers: Vec<Digest>,
    pub created: i64,
}

/// A prepared snapshot.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub meta: SnapshotMeta,
    pub dir: PathBuf,
    /// Unpacked layer dirs, bottom-most first.
    pub layer_dirs: Vec<PathBuf>,
}

/// An image's layers, bottom-most first, each kept only at its top-most place: legacy
/// builders repeat their empty layer, and overlayfs refuses a lower directory given twice
/// (ELOOP), as a VM guest would a disk. The tree is the same: a layer's top-most place
/// applies every file and whiteout it has over all that lies below, its lower places
/// included.
pub fn distinct_layers<T: PartialEq>(bottom_first: impl IntoIterator<Item = T>) -> Vec<T> {
    let all: Vec<T> = bottom_first.into_iter().collect();
    let mut out: Vec<T> = Vec::with_capacity(all.len());
    for l in all.into_iter().rev() {
        if !out.contains(&l) {
            out.push(l);
        }
    }
    out.reverse();
    out
}

impl Snapshot {
    pub fn upper(&self) -> PathBuf {
        self.dir.join("upper")
    }
    pub fn work(&self) -> PathBuf {
        self.dir.join("work")
    }
    /// Where [`Snapshot::mount_overlay`] mounts the root filesystem.
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }
    pub fn layers(&self) -> &[Digest] {
        &self.meta.layers
    }

    /// The overlayfs mount data for this snapshot.
    pub fn overlay_options(&self) -> Result<String> {
        let lowers: Vec<String> = self
            .layer_dirs
            .iter()
            .rev()
            .map(|p| p.display().to_string())
            .collect();
        for l in &lowers {
            if l.contains(':') || l.contains(',') {
                return Err(ImageError::BadImage {
                    reference: self.meta.image.to_string(),
                    reason: format!("layer path {l:?} cannot be used in overlayfs options"),
                });
            }
        }
        let data = format!(
            "lowerdir={},upperdir={},workdir={}",
            lowers.join(":"),
            self.upper().display(),
            self.work().display()
        );
        // The kernel takes at most one page of mount data.
        if data.len() >= 4096 {
            return Err(ImageError::BadImage {
                reference: self.meta.image.to_string(),
                reason: format!(
                    "{} layers make an overlayfs option string of {} bytes (limit 4095)",
                    self.layer_dirs.len(),
                    data.len()
                ),
            });
        }
        Ok(data)
    }

    /// Mounts the overlay at [`Snapshot::rootfs`] (flat backend). Idempotent.
    pub fn mount_overlay(&self) -> Result<PathBuf> {
        self.mount_with(rustix::mount::MountFlags::empty())
    }

    /// Mounts the overlay read-only at [`Snapshot::rootfs`]: an image's content as it is
    /// (CRI image volumes). Idempotent.
    pub fn mount_overlay_readonly(&self) -> Result<PathBuf> {
        self.mount_with(rustix::mount::MountFlags::RDONLY)
    }

    fn mount_with(&self, flags: rustix::mount::MountFlags) -> Result<PathBuf> {
        let target = self.rootfs();
        if is_mountpoint(&target) {
            return Ok(target);
        }
        let data =
            std::ffi::CString::new(self.overlay_options()?).map_err(|_| ImageError::BadImage {
                reference: self.meta.image.to_string(),
                reason: "overlayfs options contain a NUL byte".into(),
            })?;
        rustix::mount::mount("overlay", &target, "overlay", flags, Some(data.as_c_str()))
            .map_err(|e| ImageError::io("mount overlay", &target)(e.into()))?;
        Ok(target)
    }

    /// Unmounts [`Snapshot::rootfs`] if mounted.
    pub fn unmount(&self) -> Result<()> {
        unmount_all(&self.rootfs())
    }
}

/// Whether `p` is a mount point (its device differs from its parent's, or it is listed in
/// /proc/self/mountinfo for bind mounts on the same device).
pub fn is_mountpoint(p: &Path) -> bool {
    let Ok(canon) = fs::canonicalize(p) else {
        return false;
    };
    mount_points().contains(&canon)
}

/// Every mount point `/proc/self/mountinfo` lists, unescaped, in its order (empty if it
/// cannot be read).
pub fn mount_points() -> Vec<PathBuf> {
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape_mount_path(m)))
        .collect()
}

fn unescape_mount_path(s: &str) -> String {
    // mountinfo escapes space, tab, newline and backslash as \ooo
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Lazily unmounts everything stacked at `p` (a missing path or no mount is fine).
pub fn unmount_all(p: &Path) -> Result<()> {
    for _ in 0..16 {
        if !is_mountpoint(p) {
            return Ok(());
        }
        match rustix::mount::unmount(p, rustix::mount::UnmountFlags::DETACH) {
            Ok(()) => {}
            Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => return Ok(()),
            Err(e) => return Err(ImageError::io("unmount", p)(e.into())),
        }
    }
    Ok(())
}

fn valid_snapshot_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_' || c == b'.')
        && !id.starts_with('.')
}

impl ImageStore {
    fn snapshot_dir(&self, id: &str) -> PathBuf {
        self.root().join("snapshots").join(id)
    }

    /// Creates the snapshot `id` for `image` (upper, work, mount point, metadata). Fails if
    /// the id exists; nothing is left behind on failure.
    pub fn prepare_snapshot(&self, id: &str, image: &ImageRecord) -> Result<Snapshot> {
        if !valid_snapshot_id(id) {
            return Err(ImageError::BadImage {
                reference: image.id.to_string(),
                reason: format!("invalid snapshot id {id:?}"),
            });
        }
        for l in &image.layers {
            if !self.has_layer(&l.diff_id) {
                return Err(ImageError::BadImage {
                    reference: image.id.to_string(),
                    reason: format!("layer {} is not unpacked in the store", l.diff_id),
                });
            }
        }
        let dir = self.snapshot_dir(id);
        if dir.exists() {
            return Err(ImageError::BadImage {
                reference: image.id.to_string(),
                reason: format!("snapshot {id} already exists"),
            });
        }
        let meta = SnapshotMeta {
            id: id.to_string(),
            image: image.id.clone(),
            layers: image.layers.iter().map(|l| l.diff_id.clone()).collect(),
            created: chrono::Utc::now().timestamp(),
        };
        let tmp = fsutil::temp_path(&self.tmp_dir(), "snap");
        let res = (|| {
            for d in ["upper", "work", "rootfs"] {
                let p = tmp.join(d);
                fs::create_dir_all(&p).map_err(ImageError::io("create", &p))?;
            }
            let data = serde_json::to_vec_pretty(&meta).map_err(|e| ImageError::BadImage {
                reference: image.id.to_string(),
                reason: e.to_string(),
            })?;
            // The metadata is durable before the snapshot appears under its id; the renames
            // are not synced: a snapshot a crash loses is reconciled at start (its container
            // is marked lost, and snapshots without a container are removed).
            let mp = tmp.join("snapshot.json");
            fsutil::atomic_write_fast(&mp, &data).map_err(ImageError::io("write", &mp))?;
            fs::rename(&tmp, &dir).map_err(ImageError::io("create snapshot", &dir))
        })();
        if let Err(e) = res {
            let _ = fsutil::remove_any(&tmp);
            return Err(e);
        }
        Ok(Snapshot {
            layer_dirs: distinct_layers(meta.layers.iter().map(|d| self.layer_path(d))),
            meta,
            dir,
        })
    }

    /// Loads an existing snapshot.
    pub fn snapshot(&self, id: &str) -> Result<Option<Snapshot>> {
        if !valid_snapshot_id(id) {
            return Ok(None);
        }
        let dir = self.snapshot_dir(id);
        let mp = dir.join("snapshot.json");
        let data = match fs::read(&mp) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(ImageError::io("read", &mp)(e)),
        };
        let meta: SnapshotMeta =
            serde_json::from_slice(&data).map_err(|e| ImageError::BadImage {
                reference: id.to_string(),
                reason: format!("unreadable snapshot metadata: {e}"),
            })?;
        Ok(Some(Snapshot {
            layer_dirs: distinct_layers(meta.layers.iter().map(|d| self.layer_path(d))),
            meta,
            dir,
        }))
    }

    /// IDs of all snapshots.
    pub fn list_snapshots(&self) -> Result<Vec<String>> {
        let d = self.root().join("snapshots");
        let mut v: Vec<String> = fs::read_dir(&d)
            .map_err(ImageError::io("list", &d))?
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .collect();
        v.sort();
        Ok(v)
    }

    /// Unmounts and deletes a snapshot. A missing snapshot is fine.
    pub fn remove_snapshot(&self, id: &str) -> Result<()> {
        if !valid_snapshot_id(id) {
            return Ok(());
        }
        let dir = self.snapshot_dir(id);
        if !dir.exists() {
            return Ok(());
        }
        unmount_all(&dir.join("rootfs"))?;
        // Move aside first so a crash mid-delete never leaves a half snapshot under its id;
        // what was moved aside is then deleted in the background (a crash leaves it in tmp/,
        // which the next open removes).
        let tmp = fsutil::temp_path(&self.tmp_dir(), "rmsnap");
        fs::rename(&dir, &tmp).map_err(ImageError::io("remove snapshot", &dir))?;
        self.discard(tmp);
        Ok(())
    }

    /// Image IDs that snapshots use, with the snapshot ids, for "image in use" checks.
    pub fn snapshot_users(&self, image: &Digest) -> Vec<String> {
        self.list_snapshots()
            .unwrap_or_default()
            .into_iter()
            .filter(|id| matches!(self.snapshot(id), Ok(Some(s)) if &s.meta.image == image))
            .collect()
    }

    /// The layer diff IDs that snapshots still use (their lower dirs), from snapshot metadata.
    pub(crate) fn layers_in_snapshots(&self) -> std::collections::HashSet<String> {
        let mut used = std::collections::HashSet::new();
        let dir = self.root().join("snapshots");
        if let Ok(rd) = std::fs::read_dir(&dir) {
            for e in rd.flatten() {
                if let Ok(data) = std::fs::read(e.path().join("snapshot.json")) {
                    if let Ok(meta) = serde_json::from_slice::<SnapshotMeta>(&data) {
                        used.extend(meta.layers.iter().map(|d| d.hex().to_string()));
                    }
                }
            }
        }
        used
    }
}

#[cfg(test)]
mod tests {
    use super::distinct_layers;

    #[test]
    fn a_repeated_layer_is_kept_at_its_top_most_place() {
        assert_eq!(distinct_layers(["a", "e", "b", "e"]), ["a", "b", "e"]);
        assert_eq!(distinct_layers(["a", "a", "a"]), ["a"]);
        assert_eq!(distinct_layers(["a", "b"]), ["a", "b"]);
        assert!(distinct_layers(Vec::<u8>::new()).is_empty());
    }
}
