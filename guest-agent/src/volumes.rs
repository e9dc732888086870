//! VM mode: the pod's volumes. The host shares one directory per pod with virtio-fs; under it
//! each container mount's host path is bind-mounted at `<container id>/<n>`. The agent mounts
//! the share once, at [`GUEST_SHARED`], and containers bind-mount their volumes from there, so
//! their writes go to the host's directories and the host's changes show in the guest.

use std::path::Path;

use nix::mount::{mount, MsFlags};

use crate::error::AgentError;

/// The virtio-fs tag of a VM pod's share.
pub const SHARED_TAG: &str = "vessel";
/// Where the guest mounts the pod's share.
pub const GUEST_SHARED: &str = "/run/vessel/shared";
/// virtio-fs tags are at most 36 bytes.
const MAX_TAG: usize = 36;

/// Whether `dir` is a mount point already (its device differs from its parent's).
fn is_mounted(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(dir), dir.parent().map(std::fs::metadata)) {
        (Ok(d), Some(Ok(p))) => d.dev() != p.dev(),
        _ => false,
    }
}

/// Mounts the virtio-fs share `tag` at `dir` (once; a second call finds it mounted).
pub fn mount_shared(tag: &str, dir: &Path) -> Result<(), AgentError> {
    if tag.is_empty() || tag.len() > MAX_TAG || tag.contains('\0') {
        return Err(AgentError::InvalidArgument(format!(
            "virtio-fs tag {tag:?}: want 1 to {MAX_TAG} bytes"
        )));
    }
    std::fs::create_dir_all(dir).map_err(|e| AgentError::internal(dir.display(), e))?;
    if is_mounted(dir) {
        return Ok(());
    }
    mount(
        Some(tag),
        dir,
        Some("virtiofs"),
        MsFlags::MS_NODEV,
        None::<&str>,
    )
    .map_err(|e| AgentError::internal(format!("mount virtiofs {tag} on {}", dir.display()), e))?;
    tracing::info!(tag, dir = %dir.display(), "pod volumes shared by the host are mounted");
    raise_readahead(dir);
    Ok(())
}

/// Read-ahead of the share, in KiB. The FUSE default (128 KiB) makes a sequential read a
/// train of small synchronous requests, each a round trip to the host; the device takes
/// 1 MiB per request, and a window of several keeps requests in flight.
pub const SHARE_READ_AHEAD_KB: u32 = 4096;

/// Sets the read-ahead of the filesystem mounted at `dir` (its backing device info, by the
/// mount's device number); files opened from then on use it. Best effort.
fn raise_readahead(dir: &Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(md) = std::fs::metadata(dir) else {
        return;
    };
    let dev = md.dev();
    let bdi = format!(
        "/sys/class/bdi/{}:{}/read_ahead_kb",
        libc::major(dev),
        libc::minor(dev)
    );
    if let Err(e) = std::fs::write(&bdi, SHARE_READ_AHEAD_KB.to_string()) {
        tracing::debug!(path = %bdi, error = %e, "share read-ahead left as it is");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_tags_are_refused_before_mounting() {
        let d = tempfile::tempdir().unwrap();
        for t in ["", &"x".repeat(37)] {
            assert!(matches!(
                mount_shared(t, d.path()),
                Err(AgentError::InvalidArgument(_))
            ));
        }
    }
}
