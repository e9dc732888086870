//! VM mode: image layers on virtio-blk disks, found by serial id, mounted read-only (EROFS)
//! once each and shared by the containers that use them.
//!
//! A disk is `/dev/vdX` whose `/sys/block/vdX/serial` equals the layer's serial and whose
//! `size` is non-zero. Hot-attached disks (a spare slot given an image) get their capacity a
//! little later, through a config-change interrupt, and a reused slot shows a new serial, so
//! the lookup polls and re-reads both each time ([`DISK_WAIT`]). The sysfs and dev roots are
//! parameters so the lookup can be tested on a fake tree.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::mount::{mount, umount2, MntFlags, MsFlags};

use crate::error::AgentError;

/// How long a layer's disk may take to show up with its capacity.
pub const DISK_WAIT: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(20);
/// `BLKFLSBUF`: `_IO(0x12, 97)`.
const BLKFLSBUF: libc::c_ulong = 0x1261;

/// Where block devices are described and where their nodes are.
#[derive(Debug, Clone)]
pub struct DiskRoots {
    /// `/sys/block`.
    pub sys_block: PathBuf,
    /// `/dev`.
    pub dev: PathBuf,
}

impl Default for DiskRoots {
    fn default() -> Self {
        DiskRoots {
            sys_block: PathBuf::from("/sys/block"),
            dev: PathBuf::from("/dev"),
        }
    }
}

/// Checks a serial: 1-20 bytes of `[A-Za-z0-9_.-]`, not `.` or `..` (it names a directory).
pub fn validate_serial(serial: &str) -> Result<(), AgentError> {
    let ok = !serial.is_empty()
        && serial.len() <= 20
        && serial != "."
        && serial != ".."
        && serial
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(AgentError::InvalidArgument(format!(
            "invalid disk serial {serial:?}: want [A-Za-z0-9_.-]{{1,20}}"
        )))
    }
}

fn read_trimmed(p: &Path) -> Option<String> {
    let raw = std::fs::read(p).ok()?;
    let s = String::from_utf8_lossy(&raw);
    Some(s.trim_end_matches(['\n', '\0', ' ']).to_string())
}

/// One scan: the device node of the `vd*` disk with this serial and a non-zero size.
pub fn find_disk(roots: &DiskRoots, serial: &str) -> Option<PathBuf> {
    let rd = std::fs::read_dir(&roots.sys_block).ok()?;
    let mut names: Vec<String> = rd
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with("vd"))
        .collect();
    names.sort();
    names.into_iter().find_map(|name| {
        let dir = roots.sys_block.join(&name);
        let matches = read_trimmed(&dir.join("serial")).as_deref() == Some(serial);
        let sized = read_trimmed(&dir.join("size"))
            .and_then(|s| s.parse::<u64>().ok())
            .is_some_and(|n| n > 0);
        (matches && sized).then(|| roots.dev.join(&name))
    })
}

/// Polls [`find_disk`] until it answers or `timeout` passes.
pub async fn wait_for_disk(
    roots: &DiskRoots,
    serial: &str,
    timeout: Duration,
) -> Result<PathBuf, AgentError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(dev) = find_disk(roots, serial) {
            return Ok(dev);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(AgentError::FailedPrecondition(format!(
                "no disk with serial {serial:?} and a non-zero size after {timeout:?}"
            )));
        }
        tokio::time::sleep(POLL).await;
    }
}

struct Layer {
    users: usize,
    device: PathBuf,
    mountpoint: PathBuf,
}

/// The mounted layers, reference-counted by the containers using them.
pub struct Layers {
    roots: DiskRoots,
    /// `/run/vessel/layers`.
    mount_root: PathBuf,
    wait: Duration,
    table: tokio::sync::Mutex<HashMap<String, Layer>>,
}

impl Layers {
    pub fn new(roots: DiskRoots, mount_root: PathBuf) -> Layers {
        Layers {
            roots,
            mount_root,
            wait: DISK_WAIT,
            table: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// Mounts (or takes another reference to) each layer; returns their mount points in the
    /// order given. On failure nothing stays referenced.
    pub async fn acquire(&self, serials: &[String]) -> Result<Vec<PathBuf>, AgentError> {
        if serials.is_empty() {
            return Err(AgentError::InvalidArgument(
                "disk layer rootfs needs at least one serial".into(),
            ));
        }
        for s in serials {
            validate_serial(s)?;
        }
        let mut table = self.table.lock().await;
        let mut got: Vec<String> = Vec::new();
        let mut points = Vec::new();
        for s in serials {
            match self.acquire_one(&mut table, s).await {
                Ok(p) => {
                    got.push(s.clone());
                    points.push(p);
                }
                Err(e) => {
                    for g in &got {
                        Self::release_one(&mut table, g);
                    }
                    return Err(e);
                }
            }
        }
        Ok(points)
    }

    async fn acquire_one(
        &self,
        table: &mut HashMap<String, Layer>,
        serial: &str,
    ) -> Result<PathBuf, AgentError> {
        if let Some(l) = table.get_mut(serial) {
            l.users += 1;
            return Ok(l.mountpoint.clone());
        }
        let device = wait_for_disk(&self.roots, serial, self.wait).await?;
        let mountpoint = self.mount_root.join(serial);
        std::fs::create_dir_all(&mountpoint)
            .map_err(|e| AgentError::internal(format!("creating {}", mountpoint.display()), e))?;
        mount(
            Some(&device),
            &mountpoint,
            Some("erofs"),
            MsFlags::MS_RDONLY | MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
            None::<&str>,
        )
        .map_err(|e| {
            AgentError::internal(
                format!(
                    "mounting {} (serial {serial}) as EROFS at {}",
                    device.display(),
                    mountpoint.display()
                ),
                e,
            )
        })?;
        tracing::info!(serial, device = %device.display(), "layer mounted");
        table.insert(
            serial.to_string(),
            Layer {
                users: 1,
                device,
                mountpoint: mountpoint.clone(),
            },
        );
        Ok(mountpoint)
    }

    /// Drops one reference to each layer; the last one unmounts it and drops the device's
    /// buffers, so that a slot the host reuses shows its new image.
    pub async fn release(&self, serials: &[String]) {
        let mut table = self.table.lock().await;
        for s in serials {
            Self::release_one(&mut table, s);
        }
    }

    fn release_one(table: &mut HashMap<String, Layer>, serial: &str) {
        let Some(l) = table.get_mut(serial) else {
            return;
        };
        l.users -= 1;
        if l.users > 0 {
            return;
        }
        let l = table.remove(serial).expect("present");
        if let Err(e) = umount2(&l.mountpoint, MntFlags::empty()) {
            tracing::warn!(serial, error = %e, "unmounting a layer; detaching it");
            let _ = umount2(&l.mountpoint, MntFlags::MNT_DETACH);
        }
        let _ = std::fs::remove_dir(&l.mountpoint);
        match std::fs::File::open(&l.device) {
            Ok(f) => {
                // SAFETY: BLKFLSBUF takes no argument; the fd is a live block device.
                if unsafe { libc::ioctl(f.as_raw_fd(), BLKFLSBUF as _, 0) } != 0 {
                    tracing::warn!(serial, error = %std::io::Error::last_os_error(), "BLKFLSBUF");
                }
            }
            Err(e) => tracing::warn!(serial, error = %e, "opening the layer device to flush it"),
        }
        tracing::info!(serial, device = %l.device.display(), "layer unmounted");
    }

    /// How many containers use `serial` (0 if not mounted).
    pub async fn users(&self, serial: &str) -> usize {
        self.table.lock().await.get(serial).map_or(0, |l| l.users)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(root: &Path, name: &str, serial: &str, size: u64) {
        let d = root.join("sys/block").join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("serial"), serial).unwrap();
        std::fs::write(d.join("size"), format!("{size}\n")).unwrap();
    }

    fn roots(root: &Path) -> DiskRoots {
        DiskRoots {
            sys_block: root.join("sys/block"),
            dev: root.join("dev"),
        }
    }

    #[test]
    fn lookup_by_serial_and_size() {
        let t = tempfile::tempdir().unwrap();
        disk(t.path(), "vda", "layer-a", 8);
        disk(t.path(), "vdb", "layer-b", 0);
        disk(t.path(), "sda", "layer-c", 8);
        std::fs::create_dir_all(t.path().join("sys/block/loop0")).unwrap();
        let r = roots(t.path());
        assert_eq!(find_disk(&r, "layer-a"), Some(t.path().join("dev/vda")));
        // No capacity yet: not found.
        assert_eq!(find_disk(&r, "layer-b"), None);
        // Not a virtio disk.
        assert_eq!(find_disk(&r, "layer-c"), None);
        assert_eq!(find_disk(&r, "layer"), None);
        // The serial file of a reused slot changes.
        disk(t.path(), "vda", "layer-x", 8);
        assert_eq!(find_disk(&r, "layer-a"), None);
        assert_eq!(find_disk(&r, "layer-x"), Some(t.path().join("dev/vda")));
    }

    #[tokio::test]
    async fn waits_for_capacity() {
        let t = tempfile::tempdir().unwrap();
        disk(t.path(), "vdc", "late", 0);
        let r = roots(t.path());
        let p = t.path().to_path_buf();
        let later = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            disk(&p, "vdc", "late", 4096);
        });
        let dev = wait_for_disk(&r, "late", Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(dev, t.path().join("dev/vdc"));
        later.await.unwrap();
        let e = wait_for_disk(&r, "never", Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(e, AgentError::FailedPrecondition(_)), "{e}");
    }

    #[tokio::test]
    async fn bad_serials_and_missing_disks_leave_nothing() {
        let t = tempfile::tempdir().unwrap();
        let mut layers = Layers::new(roots(t.path()), t.path().join("layers"));
        layers.wait = Duration::from_millis(30);
        for bad in ["", "..", "a/b", "x".repeat(21).as_str()] {
            let e = layers.acquire(&[bad.to_string()]).await.unwrap_err();
            assert!(matches!(e, AgentError::InvalidArgument(_)), "{bad:?}: {e}");
        }
        assert!(layers.acquire(&[]).await.is_err());
        assert!(layers.acquire(&["absent".to_string()]).await.is_err());
        assert_eq!(layers.users("absent").await, 0);
    }
}
