//! A container's root filesystem changes as a checkpoint archive holds them: its overlay
//! upper directory as `rootfs-diff.tar`, and the image files it deleted as `deleted.files`
//! (the layout CRI-O, Podman and containerd's CRI write, which they all restore from).
//!
//! The checkpoint helper ([`crate::libct`]) writes them while CRIU still holds the dumped
//! tasks (its `post-dump` notification), so that the files match the dumped processes: a
//! file a task had open under a name it then renamed is in the diff under the name CRIU
//! recorded. vesseld writes them itself only for an agent too old to.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// The archive of changed files in a checkpoint.
pub const DIFF_TAR: &str = "rootfs-diff.tar";
/// The JSON list of deleted image paths in a checkpoint (absent when none were deleted).
pub const DELETED: &str = "deleted.files";

/// Writes [`DIFF_TAR`] (and [`DELETED`], when the container deleted image files) for the
/// overlay upper directory `upper` into the directory `out`; both are synced.
pub fn write(upper: &Path, out: &Path) -> io::Result<()> {
    let deleted = write_tar(upper, &out.join(DIFF_TAR))?;
    if !deleted.is_empty() {
        let json = serde_json::to_vec(&deleted).map_err(io::Error::other)?;
        let f = File::create(out.join(DELETED))?;
        io::Write::write_all(&mut &f, &json)?;
        f.sync_all()?;
    }
    Ok(())
}

/// Archives an overlay upper directory: directories, files and symlinks the container made
/// or changed, with their modes, owners and times. Answers the paths it deleted from the
/// image (overlayfs whiteouts, character devices 0:0), which are not archived, and the
/// directories it replaced whole (opaque: removed, then made again), which are archived
/// with what they hold now: a restore removes the image's before it unpacks the diff, or the
/// image's files would show through again. Other special files (sockets, fifos, devices)
/// are left out.
fn write_tar(upper: &Path, out: &Path) -> io::Result<Vec<String>> {
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
            // Where the container runs on (an old agent's diff, written after the dump):
            // what it removes meanwhile is left out.
            let gone = |r: io::Result<()>| match r {
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                r => r,
            };
            let m = match std::fs::symlink_metadata(&path) {
                Ok(m) => m,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            let ft = m.file_type();
            if ft.is_char_device() && m.rdev() == 0 {
                deleted.push(format!("/{}", name.display()));
            } else if ft.is_dir() {
                if is_opaque(&path) {
                    deleted.push(format!("/{}", name.display()));
                }
                gone(b.append_path_with_name(&path, &name))?;
                stack.push(name);
            } else if ft.is_file() {
                gone(append_file(&mut b, &path, &name))?;
            } else if ft.is_symlink() {
                gone(b.append_path_with_name(&path, &name))?;
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

/// Whether an upper directory is opaque: it hides the lower layers' directory of its name
/// (`trusted.overlay.opaque`, or `user.overlay.opaque` on an overlay mounted with
/// `userxattr`, set to `y`).
fn is_opaque(dir: &Path) -> bool {
    ["trusted.overlay.opaque", "user.overlay.opaque"]
        .iter()
        .any(|x| {
            let mut v = [0u8; 1];
            rustix::fs::lgetxattr(dir, *x, &mut v).is_ok_and(|n| n == 1 && v[0] == b'y')
        })
}

/// Appends a regular file as it is now, though a running container may be writing it: the
/// header's size is the one read at open, and exactly that many bytes follow (cut, or padded
/// with zeros where it shrank), so that a file that changes cannot misalign the archive.
fn append_file<W: io::Write>(b: &mut tar::Builder<W>, path: &Path, name: &Path) -> io::Result<()> {
    use io::Read;
    let mut f = File::open(path)?;
    let m = f.metadata()?;
    let mut h = tar::Header::new_gnu();
    h.set_metadata_in_mode(&m, tar::HeaderMode::Complete);
    let size = m.len();
    h.set_size(size);
    let data = (&mut f).take(size).chain(io::repeat(0)).take(size);
    b.append_data(&mut h, name, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (vesseld's checkpoint tests archive a whiteout and links through this module.)
    #[test]
    fn nothing_deleted_no_list() {
        let d = tempfile::tempdir().unwrap();
        let upper = d.path().join("upper");
        std::fs::create_dir_all(upper.join("data")).unwrap();
        std::fs::write(upper.join("data/f"), b"x").unwrap();
        write(&upper, d.path()).unwrap();
        let mut a = tar::Archive::new(File::open(d.path().join(DIFF_TAR)).unwrap());
        let paths: Vec<String> = a
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        assert_eq!(paths, ["data", "data/f"]);
        assert!(!d.path().join(DELETED).exists());
    }

    /// A directory the container replaced whole (opaque in the upper directory) is listed
    /// as deleted and archived with its new content; before, the image's files came back
    /// in it at a restore.
    #[test]
    fn an_opaque_directory_is_listed_as_deleted() {
        let d = tempfile::tempdir().unwrap();
        let upper = d.path().join("upper");
        std::fs::create_dir_all(upper.join("app/cache")).unwrap();
        std::fs::write(upper.join("app/cache/new"), b"x").unwrap();
        if let Err(e) = rustix::fs::lsetxattr(
            upper.join("app/cache"),
            "trusted.overlay.opaque",
            b"y",
            rustix::fs::XattrFlags::empty(),
        ) {
            println!("SKIP an_opaque_directory_is_listed_as_deleted: trusted xattrs: {e}");
            return;
        }
        write(&upper, d.path()).unwrap();
        let listed: Vec<String> =
            serde_json::from_slice(&std::fs::read(d.path().join(DELETED)).unwrap()).unwrap();
        assert_eq!(listed, ["/app/cache"]);
        let mut a = tar::Archive::new(File::open(d.path().join(DIFF_TAR)).unwrap());
        let paths: Vec<String> = a
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        assert_eq!(paths, ["app", "app/cache", "app/cache/new"]);
    }
}
