//! Small filesystem helpers: atomic writes and crash-debris names.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A unique temporary name inside `dir` that records the owning pid, so that a later start
/// can tell debris of dead processes from work in progress of live ones.
pub fn temp_path(dir: &Path, tag: &str) -> PathBuf {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    dir.join(format!(
        "{}.{}.{:x}{:x}.tmp",
        std::process::id(),
        tag,
        n,
        nanos
    ))
}

/// The pid that created a temp entry made by [`temp_path`] or [`atomic_write`], if any.
pub fn temp_owner(name: &str) -> Option<i32> {
    if !name.ends_with(".tmp") {
        return None;
    }
    name.split('.').next()?.parse().ok()
}

/// Whether a process with this pid exists.
pub fn pid_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    Path::new(&format!("/proc/{pid}")).exists()
}

/// fsyncs a directory, making renames and creations inside it durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Writes `data` to `path` atomically: temp file in the same directory, fsync, rename,
/// fsync of the directory. A crash leaves either the old or the new content.
pub fn atomic_write(path: &Path, data: &[u8]) -> io::Result<()> {
    atomic_write_fast(path, data)?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Like [`atomic_write`] without the directory fsync: the content is durable before it
/// becomes visible, but after a crash the rename itself may be lost (the old content, or
/// none, remains). For records whose loss the next start reconciles anyway.
pub fn atomic_write_fast(path: &Path, data: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = temp_path(dir, "w");
    let res = (|| {
        // Records and metadata are for root only (container records carry environments).
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

/// Removes temp entries in `dir` left by processes that no longer exist.
pub fn clean_dead_temps(dir: &Path) -> io::Result<usize> {
    let mut n = 0;
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    for entry in rd {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(pid) = temp_owner(name) {
            if pid != std::process::id() as i32 && !pid_alive(pid) {
                remove_any(&entry.path())?;
                n += 1;
            }
        }
    }
    Ok(n)
}

/// Removes a file or a whole directory tree; a missing path is fine.
pub fn remove_any(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => match fs::remove_dir_all(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            r => r,
        },
        Ok(_) => match fs::remove_file(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            r => r,
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Bytes (allocated blocks) and inodes used below `root`, counting hard-linked inodes once,
/// on `root`'s filesystem only: a directory of another (a mount point: an image volume's
/// overlay vesseld mounted under the store) is not gone into, as its files are its
/// filesystem's, counted again (and walked on every ImageFsInfo) otherwise.
///
/// Only `root` itself failing is an error (missing: nothing used). Below it, what cannot be
/// read is left out of the count: an entry gone since it was listed, or one a container put
/// deeper than a path can reach (PATH_MAX), which would otherwise fail the node's
/// ImageFsInfo for every caller.
pub fn disk_usage(root: &Path) -> io::Result<(u64, u64)> {
    use std::collections::HashSet;
    use std::os::unix::fs::MetadataExt;
    let mut seen: HashSet<(u64, u64)> = HashSet::new();
    let mut bytes = 0u64;
    let mut inodes = 0u64;
    let mut stack = vec![root.to_path_buf()];
    let mut dev = None;
    while let Some(p) = stack.pop() {
        let top = p == root;
        let m = match fs::symlink_metadata(&p) {
            Ok(m) => m,
            Err(e) if top && e.kind() != io::ErrorKind::NotFound => return Err(e),
            Err(_) => continue,
        };
        if *dev.get_or_insert(m.dev()) != m.dev() && m.is_dir() {
            continue;
        }
        if m.nlink() > 1 && !m.is_dir() && !seen.insert((m.dev(), m.ino())) {
            continue;
        }
        bytes += m.blocks() * 512;
        inodes += 1;
        if m.is_dir() {
            match fs::read_dir(&p) {
                Ok(rd) => {
                    for e in rd.flatten() {
                        stack.push(e.path());
                    }
                }
                Err(e) if top && e.kind() != io::ErrorKind::NotFound => return Err(e),
                Err(_) => {}
            }
        }
    }
    Ok((bytes, inodes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.json");
        atomic_write(&p, b"one").unwrap();
        atomic_write(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        assert_eq!(fs::read_dir(d.path()).unwrap().count(), 1);
    }

    #[test]
    fn cleans_only_dead_owners() {
        let d = tempfile::tempdir().unwrap();
        let mine = temp_path(d.path(), "x");
        fs::write(&mine, b"").unwrap();
        // pid 0x7fff_fff0 does not exist
        let dead = d.path().join("2147483632.x.1.tmp");
        fs::create_dir(&dead).unwrap();
        fs::write(dead.join("inner"), b"").unwrap();
        assert_eq!(clean_dead_temps(d.path()).unwrap(), 1);
        assert!(mine.exists());
        assert!(!dead.exists());
    }

    #[test]
    fn du_goes_on_past_what_a_path_cannot_reach() {
        use rustix::fs::{mkdirat, openat, Mode, OFlags};
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("a"), vec![1u8; 8192]).unwrap();
        // 25 levels of 200-byte names: deeper than PATH_MAX, made as a container can (from
        // inside, one level at a time).
        let name = "n".repeat(200);
        let mut fd = openat(rustix::fs::CWD, d.path(), OFlags::DIRECTORY, Mode::empty()).unwrap();
        for _ in 0..25 {
            mkdirat(&fd, name.as_str(), Mode::from_raw_mode(0o755)).unwrap();
            fd = openat(&fd, name.as_str(), OFlags::DIRECTORY, Mode::empty()).unwrap();
        }
        let (bytes, inodes) = disk_usage(d.path()).unwrap();
        assert!(bytes >= 8192);
        assert!((20..=27).contains(&inodes), "{inodes}");
        assert!(disk_usage(&d.path().join("missing")).unwrap() == (0, 0));
    }

    /// A filesystem mounted below the root (an image volume's overlay under the store) is
    /// not counted as the root's.
    #[test]
    fn du_stays_on_the_roots_filesystem() {
        use rustix::mount::{mount, unmount, MountFlags, UnmountFlags};
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("a"), vec![1u8; 8192]).unwrap();
        let m = d.path().join("m");
        fs::create_dir(&m).unwrap();
        let alone = disk_usage(d.path()).unwrap();
        if let Err(e) = mount("tmpfs", &m, "tmpfs", MountFlags::empty(), None) {
            println!("SKIP du_stays_on_the_roots_filesystem: cannot mount a tmpfs: {e}");
            return;
        }
        struct Unmount<'a>(&'a Path);
        impl Drop for Unmount<'_> {
            fn drop(&mut self) {
                let _ = unmount(self.0, UnmountFlags::DETACH);
            }
        }
        let _u = Unmount(&m);
        fs::create_dir(m.join("sub")).unwrap();
        fs::write(m.join("sub/big"), vec![1u8; 1 << 20]).unwrap();
        let (bytes, inodes) = disk_usage(d.path()).unwrap();
        assert!(
            bytes < alone.0 + (1 << 20),
            "{bytes} bytes, {} before",
            alone.0
        );
        assert!(inodes <= alone.1 + 1, "{inodes} inodes, {} before", alone.1);
    }

    #[test]
    fn du_counts_hardlinks_once() {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("a"), vec![1u8; 8192]).unwrap();
        fs::hard_link(d.path().join("a"), d.path().join("b")).unwrap();
        let (bytes, inodes) = disk_usage(d.path()).unwrap();
        assert_eq!(inodes, 2); // the dir and one file
        assert!(bytes >= 8192);
    }
}
