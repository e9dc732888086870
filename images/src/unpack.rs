//! Applying an OCI image layer (an already-decompressed tar stream) to a directory that
//! becomes an overlayfs lower layer.
//!
//! Safety model: every path is resolved component by component beneath a directory file
//! descriptor for the layer root, with `O_NOFOLLOW`/`AT_SYMLINK_NOFOLLOW` on every step.
//! A symlink met on the way to a parent directory (necessarily one created earlier by this
//! layer) is followed only when its target stays lexically inside the root; anything else is
//! [`UnpackError::PathEscape`]. The final component of an entry is never followed: whatever
//! is there is removed and replaced. Nothing is ever written through a path outside `dest`.
//!
//! OCI whiteouts are converted to overlayfs form: `.wh.NAME` becomes a 0:0 character device,
//! `.wh..wh..opq` sets `trusted.overlay.opaque=y` on its directory.

use crate::digest::{Digest, Hashing};
use rustix::fs::{
    self as rfs, AtFlags, FileType, Mode, OFlags, ResolveFlags, Timespec, Timestamps, XattrFlags,
};
use rustix::io::Errno;
use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// How to apply a layer.
#[derive(Debug, Clone, Default)]
pub struct UnpackOptions {
    /// Unpacked lower layers, top-most first, used ONLY to satisfy a hard link whose target
    /// is not in this layer (copy the file from the first lower layer that has it).
    pub lowers: Vec<PathBuf>,
    /// Whether to apply ownership (lchown) from the tar headers. true when running as root.
    pub same_owner: bool,
    /// Leave durability to the caller (the image store syncs once per pull, before the
    /// record that makes the layer reachable). By default the filesystem is synced at the end.
    pub skip_sync: bool,
    /// Bounds on what one layer may write.
    pub limits: UnpackLimits,
    /// Compressed bytes read so far (counted by the caller below the decompressor), for
    /// [`UnpackLimits::max_ratio`]; `None`: the ratio is not checked.
    pub compressed_read: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
    /// Bytes written by every layer of the image being pulled, shared by its layers'
    /// unpacks, for [`UnpackLimits::max_image_bytes`]; `None`: not checked.
    pub image_written: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
}

/// What one layer may write: a small layer must not fill the disk (a gzip bomb, or a GNU
/// sparse file whose holes the tar reader expands to zeros). 0 turns a bound off. A sparse
/// file counts at its full (logical) size: that is what is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnpackLimits {
    /// Bytes of file content written (`images.max_layer_bytes`).
    pub max_bytes: u64,
    /// Bytes of file content written by all the layers one pull unpacks
    /// (`images.max_image_bytes`; layers already on the node cost nothing).
    pub max_image_bytes: u64,
    /// Tar entries (`images.max_layer_entries`).
    pub max_entries: u64,
    /// Bytes written per compressed byte read (`images.max_unpack_ratio`), checked once
    /// [`UnpackLimits::ratio_floor`] bytes were written.
    pub max_ratio: u64,
    pub ratio_floor: u64,
}

impl Default for UnpackLimits {
    fn default() -> Self {
        UnpackLimits {
            max_bytes: 32 << 30,
            max_image_bytes: 64 << 30,
            max_entries: 1_000_000,
            max_ratio: 100,
            ratio_floor: 1 << 30,
        }
    }
}

/// What applying a layer found.
#[derive(Debug, Clone)]
pub struct UnpackStats {
    /// sha256 of the whole uncompressed tar stream, trailing padding and zero blocks included.
    pub diff_id: Digest,
    /// Bytes of the uncompressed stream.
    pub tar_size: u64,
    /// Tar entries seen (metadata-only entries such as PAX global headers included).
    pub entries: u64,
}

/// Why a layer could not be applied. On error the caller removes `dest` entirely.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// An entry would land outside the layer root: a `..` that climbs above it, or a parent
    /// path that goes through a symlink whose target resolves outside (an absolute symlink
    /// target, or `..` above the root).
    #[error("layer entry {entry:?} escapes the root filesystem: {reason}")]
    PathEscape { entry: String, reason: String },
    #[error("layer entry {entry:?}: {reason}")]
    BadEntry { entry: String, reason: String },
    #[error("layer entry {entry:?}: {op}: {source}")]
    Io {
        entry: String,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("reading layer tar stream: {0}")]
    Read(#[source] io::Error),
    /// The layer went past one of [`UnpackLimits`]; `key` is the configuration key.
    #[error("layer exceeds {key} = {limit}: {what}")]
    Limit {
        key: &'static str,
        limit: u64,
        what: String,
    },
}

/// Applies the uncompressed layer tar `reader` to the existing, empty directory `dest`.
///
/// The whole stream is read (to EOF, past the end-of-archive blocks) so that
/// [`UnpackStats::diff_id`] is the layer's diff ID. The filesystem is synced once at the end.
pub fn unpack_layer<R: Read>(
    reader: R,
    dest: &Path,
    opts: &UnpackOptions,
) -> Result<UnpackStats, UnpackError> {
    let root = rfs::openat(
        rfs::CWD,
        dest,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io_err(b".", "open destination directory", e))?;
    let mut unpacker = Unpacker {
        root,
        dest,
        opts,
        buf: vec![0u8; COPY_BUF],
        cache: Vec::with_capacity(DIR_CACHE),
        dirs: HashMap::new(),
        openat2_ok: true,
        written: 0,
    };

    let mut archive = tar::Archive::new(Hashing::new(reader));
    archive.set_ignore_zeros(false);
    let mut entries = 0u64;
    for entry in archive.entries().map_err(UnpackError::Read)? {
        let mut entry = entry.map_err(UnpackError::Read)?;
        entries += 1;
        let max = opts.limits.max_entries;
        if max > 0 && entries > max {
            return Err(UnpackError::Limit {
                key: "images.max_layer_entries",
                limit: max,
                what: format!("more than {max} entries"),
            });
        }
        unpacker.apply(&mut entry)?;
    }
    // Drain whatever follows the end-of-archive marker (the second zero block, record
    // padding) so the digest covers the whole stream.
    let mut hashing = archive.into_inner();
    io::copy(&mut hashing, &mut io::sink()).map_err(UnpackError::Read)?;
    let (diff_id, tar_size, _) = hashing.finish();

    unpacker.finish_dirs()?;
    if !opts.skip_sync {
        rfs::syncfs(&unpacker.root).map_err(|e| io_err(b".", "syncfs", e))?;
    }
    tracing::debug!(
        dest = %dest.display(),
        %diff_id,
        tar_size,
        entries,
        "unpacked layer"
    );
    Ok(UnpackStats {
        diff_id,
        tar_size,
        entries,
    })
}

const COPY_BUF: usize = 128 * 1024;
const DIR_CACHE: usize = 8;
const MAX_SYMLINK_FOLLOWS: u32 = 40;
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
const OVERLAY_XATTR_PREFIX: &[u8] = b"trusted.overlay.";
const PAX_XATTR_PREFIX: &[u8] = b"SCHILY.xattr.";
const WHITEOUT_PREFIX: &[u8] = b".wh.";
const WHITEOUT_META_PREFIX: &[u8] = b".wh..wh.";
const WHITEOUT_OPAQUE: &[u8] = b".wh..wh..opq";

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn io_err(entry: &[u8], op: &'static str, e: impl Into<io::Error>) -> UnpackError {
    UnpackError::Io {
        entry: lossy(entry),
        op,
        source: e.into(),
    }
}

fn bad(entry: &[u8], reason: impl Into<String>) -> UnpackError {
    UnpackError::BadEntry {
        entry: lossy(entry),
        reason: reason.into(),
    }
}

fn escape(entry: &[u8], reason: impl Into<String>) -> UnpackError {
    UnpackError::PathEscape {
        entry: lossy(entry),
        reason: reason.into(),
    }
}

/// Why a path could not be normalised.
enum NormError {
    /// A `..` climbed above the root.
    Escape,
    /// A NUL byte in a component.
    Nul,
}

/// Appends the components of `raw` to the normalised path `out` (`a/b/c`, no leading or
/// trailing slash, empty for the root), resolving `.`, `..` and repeated slashes lexically.
/// Leading slashes are ignored: the result is always relative to the root.
fn normalize_into(out: &mut Vec<u8>, raw: &[u8]) -> Result<(), NormError> {
    for comp in raw.split(|&b| b == b'/') {
        match comp {
            b"" | b"." => {}
            b".." => {
                if out.is_empty() {
                    return Err(NormError::Escape);
                }
                let cut = out.iter().rposition(|&b| b == b'/').unwrap_or(0);
                out.truncate(cut);
            }
            _ => {
                if comp.contains(&0) {
                    return Err(NormError::Nul);
                }
                push_comp(out, comp);
            }
        }
    }
    Ok(())
}

fn push_comp(out: &mut Vec<u8>, comp: &[u8]) {
    if !out.is_empty() {
        out.push(b'/');
    }
    out.extend_from_slice(comp);
}

fn joined(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(dir.len() + 1 + name.len());
    p.extend_from_slice(dir);
    push_comp(&mut p, name);
    p
}

/// Splits a normalised, non-empty path into its parent and last component.
fn split_last(norm: &[u8]) -> (&[u8], &[u8]) {
    match norm.iter().rposition(|&b| b == b'/') {
        Some(i) => (&norm[..i], &norm[i + 1..]),
        None => (&[], norm),
    }
}

fn mode(bits: u32) -> Mode {
    Mode::from_raw_mode(bits)
}

fn times(mtime: Timespec) -> Timestamps {
    Timestamps {
        last_access: mtime,
        last_modification: mtime,
    }
}

/// The parts of `stat` we use, in fixed types (the raw struct differs per architecture).
#[derive(Clone, Copy)]
struct FileStat {
    kind: FileType,
    mode: u32,
    uid: u32,
    gid: u32,
    rdev: u64,
    dev: u64,
    ino: u64,
    mtime: Timespec,
}

#[allow(clippy::unnecessary_cast, clippy::useless_conversion)]
fn file_stat(st: &rfs::Stat) -> FileStat {
    FileStat {
        kind: FileType::from_raw_mode(st.st_mode as _),
        mode: (st.st_mode as u32) & 0o7777,
        uid: st.st_uid as u32,
        gid: st.st_gid as u32,
        rdev: st.st_rdev as u64,
        dev: st.st_dev as u64,
        ino: st.st_ino as u64,
        mtime: Timespec {
            tv_sec: st.st_mtime as i64,
            tv_nsec: st.st_mtime_nsec as _,
        },
    }
}

fn lstat_at(dir: BorrowedFd<'_>, name: &[u8]) -> rustix::io::Result<Option<FileStat>> {
    match rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(file_stat(&st))),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

fn is_whiteout(st: &FileStat) -> bool {
    st.kind == FileType::CharacterDevice && st.rdev == 0
}

/// Parses a PAX time (`[-]seconds[.fraction]`).
fn parse_pax_time(v: &[u8]) -> Option<Timespec> {
    let (neg, v) = match v.strip_prefix(b"-") {
        Some(rest) => (true, rest),
        None => (false, v),
    };
    let (int, frac) = match v.iter().position(|&b| b == b'.') {
        Some(i) => (&v[..i], &v[i + 1..]),
        None => (v, &[][..]),
    };
    if int.is_empty() || !int.iter().chain(frac).all(u8::is_ascii_digit) {
        return None;
    }
    let secs: i64 = std::str::from_utf8(int).ok()?.parse().ok()?;
    let mut nsec: i64 = 0;
    for i in 0..9 {
        nsec = nsec * 10 + frac.get(i).map_or(0, |d| i64::from(d - b'0'));
    }
    let (secs, nsec) = if neg && nsec > 0 {
        (-secs - 1, 1_000_000_000 - nsec)
    } else if neg {
        (-secs, 0)
    } else {
        (secs, nsec)
    };
    Some(Timespec {
        tv_sec: secs,
        tv_nsec: nsec as _,
    })
}

/// Ownership, mode, mtime and xattrs to give an object.
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: Timespec,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// What an entry creates.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    File,
    Dir,
    Symlink,
    HardLink,
    Node(FileType),
}

/// A directory inside the layer, resolved and open.
struct ResolvedDir {
    /// The normalised path as the entry named it (the cache key).
    key: Vec<u8>,
    fd: OwnedFd,
    /// The physical path below the root, symlinks resolved.
    path: Vec<u8>,
}

/// The outcome of resolving a directory path.
enum Walk {
    Dir(OwnedFd, Vec<u8>),
    /// A component does not exist (lookups only).
    Missing,
    /// A component exists but is not a directory (lookups only).
    NotDir,
}

/// Resolves the normalised directory path `rel` beneath `root`, following symlinks that stay
/// inside the root. With `create`, missing directories are made (mode 0755) and a
/// non-directory component is an error; without, those are reported as [`Walk::Missing`] and
/// [`Walk::NotDir`]. `opaque`, when given, is set if a directory on the way is marked opaque.
fn walk_dir(
    root: BorrowedFd<'_>,
    rel: &[u8],
    create: bool,
    entry: &[u8],
    mut opaque: Option<&mut bool>,
) -> Result<Walk, UnpackError> {
    let mut path: Cow<'_, [u8]> = Cow::Borrowed(rel);
    let mut pos = 0usize;
    let mut cur: Vec<u8> = Vec::with_capacity(rel.len());
    let mut fd: Option<OwnedFd> = None;
    let mut follows = 0u32;
    let dir_flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    while pos < path.len() {
        let end = path[pos..]
            .iter()
            .position(|&b| b == b'/')
            .map_or(path.len(), |i| pos + i);
        let comp = &path[pos..end];
        let next_pos = end + 1;
        let dirfd = fd.as_ref().map_or(root, |f| f.as_fd());
        let opened = match rfs::openat(dirfd, comp, dir_flags, Mode::empty()) {
            Ok(nfd) => Some(nfd),
            Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => None,
            Err(e) => return Err(io_err(entry, "open parent directory", e)),
        };
        let nfd = match opened {
            Some(nfd) => nfd,
            None => match lstat_at(dirfd, comp).map_err(|e| io_err(entry, "stat parent", e))? {
                None if create => {
                    rfs::mkdirat(dirfd, comp, mode(0o755))
                        .map_err(|e| io_err(entry, "create parent directory", e))?;
                    let nfd = rfs::openat(dirfd, comp, dir_flags, Mode::empty())
                        .map_err(|e| io_err(entry, "open parent directory", e))?;
                    // The umask may have narrowed the mode.
                    rfs::fchmod(&nfd, mode(0o755))
                        .map_err(|e| io_err(entry, "chmod parent directory", e))?;
                    nfd
                }
                None => return Ok(Walk::Missing),
                Some(st) if st.kind == FileType::Symlink => {
                    follows += 1;
                    let link = joined(&cur, comp);
                    if follows > MAX_SYMLINK_FOLLOWS {
                        return Err(bad(
                            entry,
                            format!(
                                "too many levels of symbolic links resolving parent {:?}",
                                lossy(&link)
                            ),
                        ));
                    }
                    let target = rfs::readlinkat(dirfd, comp, Vec::new())
                        .map_err(|e| io_err(entry, "read parent symlink", e))?;
                    let target = target.as_bytes();
                    if target.first() == Some(&b'/') {
                        return Err(escape(
                            entry,
                            format!(
                                "parent {:?} is a symlink to the absolute path {:?}",
                                lossy(&link),
                                lossy(target)
                            ),
                        ));
                    }
                    let mut next = cur;
                    if normalize_into(&mut next, target).is_err() {
                        return Err(escape(
                            entry,
                            format!(
                                "parent {:?} is a symlink to {:?}, which points above the root",
                                lossy(&link),
                                lossy(target)
                            ),
                        ));
                    }
                    let rest = path.get(next_pos..).unwrap_or_default();
                    if !rest.is_empty() {
                        push_comp(&mut next, rest);
                    }
                    // Re-walk the resolved path from the root.
                    path = Cow::Owned(next);
                    pos = 0;
                    cur = Vec::with_capacity(path.len());
                    fd = None;
                    continue;
                }
                Some(_) if create => {
                    return Err(bad(
                        entry,
                        format!(
                            "parent {:?} exists and is not a directory",
                            lossy(&joined(&cur, comp))
                        ),
                    ));
                }
                Some(_) => return Ok(Walk::NotDir),
            },
        };
        if let Some(flag) = opaque.as_deref_mut() {
            *flag |= is_opaque(nfd.as_fd());
        }
        push_comp(&mut cur, comp);
        fd = Some(nfd);
        pos = next_pos;
    }
    let fd = match fd {
        Some(fd) => fd,
        None => root
            .try_clone_to_owned()
            .map_err(|e| io_err(entry, "dup root directory", e))?,
    };
    Ok(Walk::Dir(fd, cur))
}

fn is_opaque(fd: BorrowedFd<'_>) -> bool {
    let mut v = [0u8; 2];
    matches!(rfs::fgetxattr(fd, OPAQUE_XATTR, &mut v[..]), Ok(1) if v[0] == b'y')
}

/// Removes `name` in `dir`, recursively if it is a directory, without following symlinks.
fn remove_all(dir: BorrowedFd<'_>, name: &[u8]) -> rustix::io::Result<()> {
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    // An explicit stack instead of recursion: layer trees can be arbitrarily deep.
    let mut stack: Vec<(OwnedFd, Vec<u8>)> =
        vec![(rfs::openat(dir, name, flags, Mode::empty())?, name.to_vec())];
    while let Some((fd, _)) = stack.last() {
        let mut child = None;
        for ent in rfs::Dir::read_from(fd)? {
            let ent = ent?;
            let n = ent.file_name().to_bytes();
            if n == b"." || n == b".." {
                continue;
            }
            let is_dir = match ent.file_type() {
                FileType::Directory => true,
                FileType::Unknown => {
                    lstat_at(fd.as_fd(), n)?.is_some_and(|st| st.kind == FileType::Directory)
                }
                _ => false,
            };
            if is_dir {
                child = Some((rfs::openat(fd, n, flags, Mode::empty())?, n.to_vec()));
                break;
            }
            rfs::unlinkat(fd, n, AtFlags::empty())?;
        }
        match child {
            Some(c) => stack.push(c),
            None => {
                let Some((_, n)) = stack.pop() else { break };
                let parent = stack.last().map_or(dir, |(f, _)| f.as_fd());
                rfs::unlinkat(parent, n.as_slice(), AtFlags::REMOVEDIR)?;
            }
        }
    }
    Ok(())
}

/// Reads all xattrs of `fd` except overlayfs' own.
fn read_xattrs(fd: BorrowedFd<'_>) -> rustix::io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut names = vec![0u8; 64 * 1024];
    let n = match rfs::flistxattr(fd, &mut names[..]) {
        Ok(n) => n,
        Err(Errno::OPNOTSUPP) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    let mut value = vec![0u8; 64 * 1024];
    for name in names[..n].split(|&b| b == 0) {
        if name.is_empty() || name.starts_with(OVERLAY_XATTR_PREFIX) {
            continue;
        }
        match rfs::fgetxattr(fd, name, &mut value[..]) {
            Ok(len) => out.push((name.to_vec(), value[..len].to_vec())),
            Err(Errno::NODATA | Errno::OPNOTSUPP) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

struct Unpacker<'a> {
    root: OwnedFd,
    dest: &'a Path,
    opts: &'a UnpackOptions,
    /// Reused buffer for file contents.
    buf: Vec<u8>,
    /// The directories resolved last, most recent first. Cleared whenever a directory or
    /// symlink is removed, the only way a resolved path can change meaning.
    cache: Vec<Rc<ResolvedDir>>,
    /// Directories whose mode and mtime are applied at the end (children change mtimes, and a
    /// read-only directory could not be filled), by physical path.
    dirs: HashMap<Vec<u8>, (u32, Timespec)>,
    /// Whether openat2 is usable (it may be missing or filtered by seccomp).
    openat2_ok: bool,
    /// File content bytes written so far, for [`UnpackLimits`].
    written: u64,
}

impl Unpacker<'_> {
    fn apply<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), UnpackError> {
        let header = entry.header();
        let raw_type = header.as_old().linkflag[0];
        let etype = header.entry_type();
        let raw = entry.path_bytes().into_owned();
        let kind = match etype {
            tar::EntryType::XGlobalHeader | tar::EntryType::XHeader => return Ok(()),
            // Old (pre-POSIX) archives mark directories by a trailing slash only.
            tar::EntryType::Regular if raw_type == 0 && raw.ends_with(b"/") => Kind::Dir,
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                Kind::File
            }
            tar::EntryType::Directory => Kind::Dir,
            tar::EntryType::Symlink => Kind::Symlink,
            tar::EntryType::Link => Kind::HardLink,
            tar::EntryType::Char => Kind::Node(FileType::CharacterDevice),
            tar::EntryType::Block => Kind::Node(FileType::BlockDevice),
            tar::EntryType::Fifo => Kind::Node(FileType::Fifo),
            // GNU dumpdir: a directory with a listing of its contents as data.
            _ if raw_type == b'D' => Kind::Dir,
            // GNU volume label.
            _ if raw_type == b'V' => return Ok(()),
            _ => {
                return Err(bad(
                    &raw,
                    format!("unsupported entry type {:?}", char::from(raw_type)),
                ))
            }
        };

        let mut norm = Vec::with_capacity(raw.len());
        match normalize_into(&mut norm, &raw) {
            Ok(()) => {}
            Err(NormError::Escape) => {
                return Err(escape(&raw, "a \"..\" component climbs above the root"))
            }
            Err(NormError::Nul) => return Err(bad(&raw, "NUL byte in path")),
        }

        if norm.is_empty() {
            if kind != Kind::Dir {
                return Err(bad(&raw, "only a directory can name the layer root"));
            }
            let meta = parse_meta(entry, &raw)?;
            self.fd_meta(&raw, self.root.as_fd(), &meta, false, true)?;
            self.dirs.insert(Vec::new(), (meta.mode, meta.mtime));
            return Ok(());
        }

        let (parent, name) = split_last(&norm);
        if name.starts_with(WHITEOUT_PREFIX) {
            return self.whiteout(&raw, parent, name);
        }

        match kind {
            Kind::HardLink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| bad(&raw, "hard link without a target"))?
                    .into_owned();
                let dir = self.dir(parent, &raw)?;
                self.hard_link(&raw, &dir, name, &target)
            }
            Kind::File => {
                let meta = parse_meta(entry, &raw)?;
                let dir = self.dir(parent, &raw)?;
                self.write_file(entry, &raw, &dir, name, &meta)
            }
            Kind::Dir => {
                let meta = parse_meta(entry, &raw)?;
                let dir = self.dir(parent, &raw)?;
                self.make_dir(&raw, &dir, name, &meta)
            }
            Kind::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| bad(&raw, "symlink without a target"))?
                    .into_owned();
                if target.is_empty() || target.contains(&0) {
                    return Err(bad(&raw, "invalid symlink target"));
                }
                let meta = parse_meta(entry, &raw)?;
                let dir = self.dir(parent, &raw)?;
                self.create_excl(&raw, &dir, name, "create symlink", |d, n| {
                    rfs::symlinkat(target.as_slice(), d, n)
                })?;
                self.at_meta(&raw, &dir, name, &meta, false)
            }
            Kind::Node(ft) => {
                // FIFOs carry no device number (and often an unparsable field).
                let dev = if ft == FileType::Fifo {
                    0
                } else {
                    let header = entry.header();
                    let major = header
                        .device_major()
                        .map_err(|e| bad(&raw, format!("invalid device major: {e}")))?
                        .unwrap_or(0);
                    let minor = header
                        .device_minor()
                        .map_err(|e| bad(&raw, format!("invalid device minor: {e}")))?
                        .unwrap_or(0);
                    rfs::makedev(major, minor)
                };
                let meta = parse_meta(entry, &raw)?;
                let dir = self.dir(parent, &raw)?;
                self.create_excl(&raw, &dir, name, "create device node", |d, n| {
                    rfs::mknodat(d, n, ft, mode(0o600), dev)
                })?;
                self.at_meta(&raw, &dir, name, &meta, true)
            }
        }
    }

    /// The directory `rel` (normalised) inside the layer, created if missing.
    fn dir(&mut self, rel: &[u8], entry: &[u8]) -> Result<Rc<ResolvedDir>, UnpackError> {
        if let Some(d) = self.cached(rel) {
            return Ok(d);
        }
        match walk_dir(self.root.as_fd(), rel, true, entry, None)? {
            Walk::Dir(fd, path) => Ok(self.remember(rel, fd, path)),
            Walk::Missing | Walk::NotDir => Err(bad(entry, "cannot create parent directory")),
        }
    }

    /// The directory `rel` inside the layer, if it exists.
    fn lookup_dir(
        &mut self,
        rel: &[u8],
        entry: &[u8],
    ) -> Result<Option<Rc<ResolvedDir>>, UnpackError> {
        if let Some(d) = self.cached(rel) {
            return Ok(Some(d));
        }
        match walk_dir(self.root.as_fd(), rel, false, entry, None)? {
            Walk::Dir(fd, path) => Ok(Some(self.remember(rel, fd, path))),
            Walk::Missing | Walk::NotDir => Ok(None),
        }
    }

    fn remember(&mut self, rel: &[u8], fd: OwnedFd, path: Vec<u8>) -> Rc<ResolvedDir> {
        let d = Rc::new(ResolvedDir {
            key: rel.to_vec(),
            fd,
            path,
        });
        if self.cache.len() == DIR_CACHE {
            self.cache.pop();
        }
        self.cache.insert(0, Rc::clone(&d));
        d
    }

    fn cached(&self, rel: &[u8]) -> Option<Rc<ResolvedDir>> {
        self.cache.iter().find(|d| d.key == rel).map(Rc::clone)
    }

    /// Removes whatever is at `name` in `dir` (recursively for a directory).
    fn remove_existing(
        &mut self,
        entry: &[u8],
        dir: &ResolvedDir,
        name: &[u8],
    ) -> Result<(), UnpackError> {
        let Some(st) = lstat_at(dir.fd.as_fd(), name).map_err(|e| io_err(entry, "stat", e))? else {
            return Ok(());
        };
        match st.kind {
            FileType::Directory => {
                remove_all(dir.fd.as_fd(), name)
                    .map_err(|e| io_err(entry, "remove existing directory", e))?;
                self.cache.clear();
                let path = joined(&dir.path, name);
                self.dirs.retain(|k, _| {
                    !(k.starts_with(&path) && (k.len() == path.len() || k[path.len()] == b'/'))
                });
            }
            kind => {
                rfs::unlinkat(dir.fd.as_fd(), name, AtFlags::empty())
                    .map_err(|e| io_err(entry, "remove existing file", e))?;
                if kind == FileType::Symlink {
                    self.cache.clear();
                }
            }
        }
        Ok(())
    }

    /// Runs `create` (which must fail with EEXIST rather than replace); if something is in
    /// the way, removes it and tries once more.
    fn create_excl<T>(
        &mut self,
        entry: &[u8],
        dir: &ResolvedDir,
        name: &[u8],
        op: &'static str,
        mut create: impl FnMut(BorrowedFd<'_>, &[u8]) -> rustix::io::Result<T>,
    ) -> Result<T, UnpackError> {
        match create(dir.fd.as_fd(), name) {
            Err(Errno::EXIST) => {}
            r => return r.map_err(|e| io_err(entry, op, e)),
        }
        self.remove_existing(entry, dir, name)?;
        create(dir.fd.as_fd(), name).map_err(|e| io_err(entry, op, e))
    }

    /// Counts `n` more bytes written and checks them against the limits.
    fn charge(&mut self, raw: &[u8], n: u64) -> Result<(), UnpackError> {
        self.written += n;
        let l = self.opts.limits;
        if l.max_bytes > 0 && self.written > l.max_bytes {
            return Err(UnpackError::Limit {
                key: "images.max_layer_bytes",
                limit: l.max_bytes,
                what: format!("{} bytes written by {:?}", self.written, lossy(raw)),
            });
        }
        if let Some(w) = &self.opts.image_written {
            let total = w.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
            if l.max_image_bytes > 0 && total > l.max_image_bytes {
                return Err(UnpackError::Limit {
                    key: "images.max_image_bytes",
                    limit: l.max_image_bytes,
                    what: format!(
                        "{total} bytes written by the image's layers (at {:?})",
                        lossy(raw)
                    ),
                });
            }
        }
        if let (Some(c), true) = (&self.opts.compressed_read, l.max_ratio > 0) {
            let read = c.load(std::sync::atomic::Ordering::Relaxed).max(1);
            if self.written > l.ratio_floor && self.written / read > l.max_ratio {
                return Err(UnpackError::Limit {
                    key: "images.max_unpack_ratio",
                    limit: l.max_ratio,
                    what: format!(
                        "{} bytes written from {read} compressed bytes (at {:?})",
                        self.written,
                        lossy(raw)
                    ),
                });
            }
        }
        Ok(())
    }

    fn write_file<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        raw: &[u8],
        dir: &ResolvedDir,
        name: &[u8],
        meta: &Meta,
    ) -> Result<(), UnpackError> {
        let flags =
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = self.create_excl(raw, dir, name, "create file", |d, n| {
            rfs::openat(d, n, flags, mode(0o600))
        })?;
        let mut file = File::from(fd);
        let expected = entry.size();
        let mut written = 0u64;
        loop {
            let n = match entry.read(&mut self.buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(UnpackError::Read(e)),
            };
            self.charge(raw, n as u64)?;
            file.write_all(&self.buf[..n])
                .map_err(|e| io_err(raw, "write file", e))?;
            written += n as u64;
        }
        if written != expected {
            return Err(UnpackError::Read(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "archive truncated in {:?}: {written} of {expected} bytes",
                    lossy(raw)
                ),
            )));
        }
        self.fd_meta(raw, file.as_fd(), meta, true, true)
    }

    fn make_dir(
        &mut self,
        raw: &[u8],
        dir: &ResolvedDir,
        name: &[u8],
        meta: &Meta,
    ) -> Result<(), UnpackError> {
        match rfs::mkdirat(dir.fd.as_fd(), name, mode(0o700)) {
            Ok(()) => {}
            Err(Errno::EXIST) => {
                let existing =
                    lstat_at(dir.fd.as_fd(), name).map_err(|e| io_err(raw, "stat", e))?;
                if existing.is_none_or(|st| st.kind != FileType::Directory) {
                    self.remove_existing(raw, dir, name)?;
                    rfs::mkdirat(dir.fd.as_fd(), name, mode(0o700))
                        .map_err(|e| io_err(raw, "create directory", e))?;
                }
            }
            Err(e) => return Err(io_err(raw, "create directory", e)),
        }
        let fd = rfs::openat(
            dir.fd.as_fd(),
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err(raw, "open directory", e))?;
        self.fd_meta(raw, fd.as_fd(), meta, false, true)?;
        self.dirs
            .insert(joined(&dir.path, name), (meta.mode, meta.mtime));
        Ok(())
    }

    fn whiteout(&mut self, raw: &[u8], parent: &[u8], name: &[u8]) -> Result<(), UnpackError> {
        if name == WHITEOUT_OPAQUE {
            let dir = self.dir(parent, raw)?;
            return rfs::fsetxattr(&dir.fd, OPAQUE_XATTR, b"y", XattrFlags::empty())
                .map_err(|e| io_err(raw, "mark directory opaque", e));
        }
        if name.starts_with(WHITEOUT_META_PREFIX) {
            // aufs metadata (.wh..wh.plnk, .wh..wh.aufs): meaningless for overlayfs.
            return Ok(());
        }
        let target = &name[WHITEOUT_PREFIX.len()..];
        if target.is_empty() || target == b"." || target == b".." {
            return Err(bad(raw, "invalid whiteout name"));
        }
        let dir = self.dir(parent, raw)?;
        self.remove_existing(raw, &dir, target)?;
        rfs::mknodat(&dir.fd, target, FileType::CharacterDevice, Mode::empty(), 0)
            .map_err(|e| io_err(raw, "create whiteout", e))
    }

    fn hard_link(
        &mut self,
        raw: &[u8],
        dir: &ResolvedDir,
        name: &[u8],
        target_raw: &[u8],
    ) -> Result<(), UnpackError> {
        let mut target = Vec::with_capacity(target_raw.len());
        match normalize_into(&mut target, target_raw) {
            Ok(()) => {}
            Err(NormError::Escape) => {
                return Err(escape(
                    raw,
                    format!(
                        "hard link target {:?} climbs above the root",
                        lossy(target_raw)
                    ),
                ))
            }
            Err(NormError::Nul) => return Err(bad(raw, "NUL byte in hard link target")),
        }
        if target.is_empty() {
            return Err(bad(raw, "hard link to the layer root"));
        }
        let (tparent, tname) = split_last(&target);
        let mut found = None;
        if let Some(tdir) = self.lookup_dir(tparent, raw)? {
            let st = lstat_at(tdir.fd.as_fd(), tname)
                .map_err(|e| io_err(raw, "stat hard link target", e))?;
            match st {
                Some(st) if st.kind == FileType::Directory => {
                    return Err(bad(raw, "hard link target is a directory"))
                }
                Some(st) if is_whiteout(&st) => {
                    return Err(bad(raw, "hard link target was deleted in this layer"))
                }
                Some(_) => found = Some(tdir),
                None => {}
            }
        }
        let tdir = match found {
            Some(tdir) => tdir,
            None => {
                self.copy_up(raw, &target)?;
                self.dir(tparent, raw)?
            }
        };
        match rfs::linkat(&tdir.fd, tname, &dir.fd, name, AtFlags::empty()) {
            Ok(()) => return Ok(()),
            Err(Errno::EXIST) => {}
            Err(e) => return Err(io_err(raw, "create hard link", e)),
        }
        let existing = lstat_at(dir.fd.as_fd(), name).map_err(|e| io_err(raw, "stat", e))?;
        let tst = lstat_at(tdir.fd.as_fd(), tname)
            .map_err(|e| io_err(raw, "stat hard link target", e))?;
        if let (Some(a), Some(b)) = (existing, tst) {
            if a.dev == b.dev && a.ino == b.ino {
                return Ok(());
            }
        }
        self.remove_existing(raw, dir, name)?;
        rfs::linkat(&tdir.fd, tname, &dir.fd, name, AtFlags::empty())
            .map_err(|e| io_err(raw, "create hard link", e))
    }

    /// Copies the hard link target `target` (normalised) from the first lower layer that has
    /// it into this layer, at the same path.
    fn copy_up(&mut self, raw: &[u8], target: &[u8]) -> Result<(), UnpackError> {
        let (tparent, tname) = split_last(target);
        let opts = self.opts;
        for lower in &opts.lowers {
            let lroot = rfs::openat(
                rfs::CWD,
                lower,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| io_err(raw, "open lower layer", e))?;
            let mut opaque = false;
            match walk_dir(lroot.as_fd(), tparent, false, raw, Some(&mut opaque))? {
                Walk::Missing if opaque => break,
                Walk::Missing => continue,
                Walk::NotDir => break,
                Walk::Dir(lfd, _) => {
                    match lstat_at(lfd.as_fd(), tname)
                        .map_err(|e| io_err(raw, "stat lower file", e))?
                    {
                        None if opaque => break,
                        None => continue,
                        Some(st) if is_whiteout(&st) => break,
                        Some(st) if st.kind == FileType::Directory => {
                            return Err(bad(raw, "hard link target is a directory"))
                        }
                        Some(st) => return self.copy_from_lower(raw, lfd.as_fd(), target, st),
                    }
                }
            }
        }
        Err(bad(
            raw,
            format!(
                "hard link target {:?} is neither in this layer nor in a lower one",
                lossy(target)
            ),
        ))
    }

    fn copy_from_lower(
        &mut self,
        raw: &[u8],
        lfd: BorrowedFd<'_>,
        target: &[u8],
        st: FileStat,
    ) -> Result<(), UnpackError> {
        let (tparent, tname) = split_last(target);
        let dir = self.dir(tparent, raw)?;
        let mut meta = Meta {
            mode: st.mode,
            uid: st.uid,
            gid: st.gid,
            mtime: st.mtime,
            xattrs: Vec::new(),
        };
        match st.kind {
            FileType::RegularFile => {
                let src = rfs::openat(
                    lfd,
                    tname,
                    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| io_err(raw, "open lower file", e))?;
                meta.xattrs =
                    read_xattrs(src.as_fd()).map_err(|e| io_err(raw, "read lower xattrs", e))?;
                let flags = OFlags::WRONLY
                    | OFlags::CREATE
                    | OFlags::EXCL
                    | OFlags::NOFOLLOW
                    | OFlags::CLOEXEC;
                let dst = self.create_excl(raw, &dir, tname, "create file", |d, n| {
                    rfs::openat(d, n, flags, mode(0o600))
                })?;
                let mut dst = File::from(dst);
                let src = File::from(src);
                let len = src
                    .metadata()
                    .map_err(|e| io_err(raw, "stat lower file", e))?
                    .len();
                self.charge(raw, len)?;
                io::copy(&mut src.take(len), &mut dst)
                    .map_err(|e| io_err(raw, "copy file from lower layer", e))?;
                self.fd_meta(raw, dst.as_fd(), &meta, true, true)
            }
            FileType::Symlink => {
                let link = rfs::readlinkat(lfd, tname, Vec::new())
                    .map_err(|e| io_err(raw, "read lower symlink", e))?;
                self.create_excl(raw, &dir, tname, "create symlink", |d, n| {
                    rfs::symlinkat(link.as_c_str(), d, n)
                })?;
                self.at_meta(raw, &dir, tname, &meta, false)
            }
            kind @ (FileType::CharacterDevice | FileType::BlockDevice | FileType::Fifo) => {
                self.create_excl(raw, &dir, tname, "create device node", |d, n| {
                    rfs::mknodat(d, n, kind, mode(0o600), st.rdev)
                })?;
                self.at_meta(raw, &dir, tname, &meta, true)
            }
            _ => Err(bad(
                raw,
                "hard link target in lower layer has an unsupported type",
            )),
        }
    }

    /// Ownership and xattrs, then (with `chmod`) mode and mtime, through an open fd.
    fn fd_meta(
        &self,
        raw: &[u8],
        fd: BorrowedFd<'_>,
        meta: &Meta,
        chmod: bool,
        regular_or_dir: bool,
    ) -> Result<(), UnpackError> {
        if self.opts.same_owner {
            rfs::fchown(
                fd,
                Some(rfs::Uid::from_raw(meta.uid)),
                Some(rfs::Gid::from_raw(meta.gid)),
            )
            .map_err(|e| io_err(raw, "chown", e))?;
        }
        // After chown (which drops security.capability) and after the data was written.
        for (k, v) in &meta.xattrs {
            let r = rfs::fsetxattr(fd, k.as_slice(), v, XattrFlags::empty());
            xattr_result(raw, k, r, regular_or_dir)?;
        }
        if chmod {
            // After chown, which clears setuid/setgid.
            rfs::fchmod(fd, mode(meta.mode)).map_err(|e| io_err(raw, "chmod", e))?;
            rfs::futimens(fd, &times(meta.mtime)).map_err(|e| io_err(raw, "set mtime", e))?;
        }
        Ok(())
    }

    /// Ownership, xattrs, mode (unless a symlink) and mtime of `name` in `dir`, never
    /// following a symlink there.
    fn at_meta(
        &self,
        raw: &[u8],
        dir: &ResolvedDir,
        name: &[u8],
        meta: &Meta,
        chmod: bool,
    ) -> Result<(), UnpackError> {
        let d = dir.fd.as_fd();
        if self.opts.same_owner {
            rfs::chownat(
                d,
                name,
                Some(rfs::Uid::from_raw(meta.uid)),
                Some(rfs::Gid::from_raw(meta.gid)),
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_err(|e| io_err(raw, "chown", e))?;
        }
        if !meta.xattrs.is_empty() {
            // No fd-based call sets xattrs on a symlink or device node: use the path, which
            // is made only of directories checked during the walk, and lsetxattr.
            let mut path = self.dest.as_os_str().as_bytes().to_vec();
            path.push(b'/');
            path.extend_from_slice(&dir.path);
            path.push(b'/');
            path.extend_from_slice(name);
            for (k, v) in &meta.xattrs {
                let r = rfs::lsetxattr(path.as_slice(), k.as_slice(), v, XattrFlags::empty());
                xattr_result(raw, k, r, false)?;
            }
        }
        if chmod {
            // Not a symlink (we just created a node here), so following is harmless; Linux
            // has no AT_SYMLINK_NOFOLLOW for fchmodat before fchmodat2.
            rfs::chmodat(d, name, mode(meta.mode), AtFlags::empty())
                .map_err(|e| io_err(raw, "chmod", e))?;
        }
        rfs::utimensat(d, name, &times(meta.mtime), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io_err(raw, "set mtime", e))
    }

    /// Applies the deferred directory modes and mtimes, deepest first.
    fn finish_dirs(&mut self) -> Result<(), UnpackError> {
        let mut dirs: Vec<(Vec<u8>, (u32, Timespec))> =
            std::mem::take(&mut self.dirs).into_iter().collect();
        let depth = |p: &[u8]| {
            if p.is_empty() {
                0
            } else {
                1 + p.iter().filter(|&&b| b == b'/').count()
            }
        };
        dirs.sort_unstable_by(|a, b| depth(&b.0).cmp(&depth(&a.0)).then_with(|| a.0.cmp(&b.0)));
        for (path, (bits, mtime)) in dirs {
            let owned;
            let fd = if path.is_empty() {
                self.root.as_fd()
            } else {
                match self.open_dir_beneath(&path) {
                    Ok(fd) => {
                        owned = fd;
                        owned.as_fd()
                    }
                    // Replaced by something else since: nothing to do.
                    Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP | Errno::XDEV) => continue,
                    Err(e) => return Err(io_err(&path, "open directory", e)),
                }
            };
            rfs::fchmod(fd, mode(bits)).map_err(|e| io_err(&path, "chmod", e))?;
            rfs::futimens(fd, &times(mtime)).map_err(|e| io_err(&path, "set mtime", e))?;
        }
        Ok(())
    }

    /// Opens the directory at the physical path `path` without following any symlink.
    fn open_dir_beneath(&mut self, path: &[u8]) -> rustix::io::Result<OwnedFd> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        if self.openat2_ok {
            match rfs::openat2(
                &self.root,
                path,
                flags,
                Mode::empty(),
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
            ) {
                Err(Errno::NOSYS | Errno::PERM) => self.openat2_ok = false,
                r => return r,
            }
        }
        let mut fd: Option<OwnedFd> = None;
        for comp in path.split(|&b| b == b'/') {
            let dirfd = fd.as_ref().map_or(self.root.as_fd(), |f| f.as_fd());
            fd = Some(rfs::openat(dirfd, comp, flags, Mode::empty())?);
        }
        fd.ok_or(Errno::NOENT)
    }
}

/// Xattr errors: an unsupported filesystem is ignored, and so is the kernel refusing
/// `user.*` xattrs on anything but regular files and directories; the rest fail.
fn xattr_result(
    raw: &[u8],
    key: &[u8],
    r: rustix::io::Result<()>,
    regular_or_dir: bool,
) -> Result<(), UnpackError> {
    match r {
        Ok(()) => Ok(()),
        Err(Errno::OPNOTSUPP) => {
            tracing::debug!(entry = %lossy(raw), xattr = %lossy(key), "xattrs not supported, skipped");
            Ok(())
        }
        Err(Errno::PERM) if !regular_or_dir && key.starts_with(b"user.") => Ok(()),
        Err(e) => Err(io_err(raw, "set xattr", e)),
    }
}

/// Mode, ownership, mtime and xattrs of an entry, from its header and PAX records.
fn parse_meta<R: Read>(entry: &mut tar::Entry<'_, R>, raw: &[u8]) -> Result<Meta, UnpackError> {
    let header = entry.header();
    let old = header.as_old();
    // Like Go's archive/tar, an empty numeric field (all NULs or spaces) reads as 0.
    let num = |field: &[u8], v: fn(&tar::Header) -> io::Result<u64>, what: &str| {
        if field.iter().all(|&b| b == 0 || b == b' ') {
            return Ok(0);
        }
        v(header).map_err(|e| bad(raw, format!("invalid {what}: {e}")))
    };
    let mode = (num(&old.mode, |h| h.mode().map(u64::from), "mode")? & 0o7777) as u32;
    let id = |field: &[u8], v: fn(&tar::Header) -> io::Result<u64>, what: &str| {
        u32::try_from(num(field, v, what)?)
            .ok()
            .filter(|&v| v != u32::MAX)
            .ok_or_else(|| bad(raw, format!("invalid {what}")))
    };
    let uid = id(&old.uid, tar::Header::uid, "uid")?;
    let gid = id(&old.gid, tar::Header::gid, "gid")?;
    let secs = num(&old.mtime, tar::Header::mtime, "mtime")?;
    let mut mtime = Timespec {
        tv_sec: i64::try_from(secs).unwrap_or(i64::MAX),
        tv_nsec: 0,
    };
    let mut xattrs = Vec::new();
    let pax = entry
        .pax_extensions()
        .map_err(|e| bad(raw, format!("invalid PAX header: {e}")))?;
    if let Some(pax) = pax {
        for ext in pax {
            let ext = ext.map_err(|e| bad(raw, format!("invalid PAX record: {e}")))?;
            let key = ext.key_bytes();
            if let Some(name) = key.strip_prefix(PAX_XATTR_PREFIX) {
                if name.is_empty() || name.contains(&0) {
                    return Err(bad(raw, "invalid xattr name"));
                }
                if name.starts_with(OVERLAY_XATTR_PREFIX) {
                    // The layer must not forge overlayfs metadata (redirects, metacopy...).
                    tracing::debug!(entry = %lossy(raw), xattr = %lossy(name), "overlay xattr in layer ignored");
                    continue;
                }
                xattrs.push((name.to_vec(), ext.value_bytes().to_vec()));
            } else if key == b"mtime" {
                if let Some(t) = parse_pax_time(ext.value_bytes()) {
                    mtime = t;
                }
            } else if key.starts_with(b"GNU.sparse.") {
                return Err(bad(raw, "PAX-format GNU sparse files are not supported"));
            }
        }
    }
    Ok(Meta {
        mode,
        uid,
        gid,
        mtime,
        xattrs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};

    const MTIME: u64 = 1_600_000_000;

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_mtime(MTIME);
        h.set_uid(0);
        h.set_gid(0);
        h
    }

    /// Appends an entry with a raw (unchecked) name and link name.
    fn raw(
        b: &mut tar::Builder<Vec<u8>>,
        name: &str,
        kind: tar::EntryType,
        link: &str,
        data: &[u8],
    ) {
        let mut h = header(kind, 0o644, data.len() as u64);
        let old = h.as_old_mut();
        old.name[..name.len()].copy_from_slice(name.as_bytes());
        old.linkname[..link.len()].copy_from_slice(link.as_bytes());
        h.set_cksum();
        b.append(&h, data).unwrap();
    }

    fn raw_mode(b: &mut tar::Builder<Vec<u8>>, name: &str, kind: tar::EntryType, mode: u32) {
        let mut h = header(kind, mode, 0);
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        h.set_cksum();
        b.append(&h, &[][..]).unwrap();
    }

    fn file(b: &mut tar::Builder<Vec<u8>>, path: &str, mode: u32, data: &[u8]) {
        let mut h = header(tar::EntryType::Regular, mode, data.len() as u64);
        b.append_data(&mut h, path, data).unwrap();
    }

    fn dir(b: &mut tar::Builder<Vec<u8>>, path: &str, mode: u32) {
        let mut h = header(tar::EntryType::Directory, mode, 0);
        b.append_data(&mut h, path, &[][..]).unwrap();
    }

    fn symlink(b: &mut tar::Builder<Vec<u8>>, path: &str, target: &str) {
        let mut h = header(tar::EntryType::Symlink, 0o777, 0);
        b.append_link(&mut h, path, target).unwrap();
    }

    fn hardlink(b: &mut tar::Builder<Vec<u8>>, path: &str, target: &str) {
        let mut h = header(tar::EntryType::Link, 0o644, 0);
        b.append_link(&mut h, path, target).unwrap();
    }

    fn builder() -> tar::Builder<Vec<u8>> {
        let mut b = tar::Builder::new(Vec::new());
        b.mode(tar::HeaderMode::Complete);
        b
    }

    fn root_opts() -> UnpackOptions {
        UnpackOptions {
            lowers: Vec::new(),
            same_owner: true,
            skip_sync: false,
            ..Default::default()
        }
    }

    fn unpack(bytes: &[u8], dest: &Path) -> Result<UnpackStats, UnpackError> {
        unpack_layer(bytes, dest, &root_opts())
    }

    fn lmeta(p: &Path) -> std::fs::Metadata {
        std::fs::symlink_metadata(p).unwrap()
    }

    #[test]
    fn files_dirs_symlinks_modes_and_mtimes() {
        let mut b = builder();
        raw_mode(&mut b, "./", tar::EntryType::Directory, 0o751);
        dir(&mut b, "etc/", 0o755);
        file(&mut b, "etc/hosts", 0o644, b"127.0.0.1 localhost\n");
        dir(&mut b, "bin/", 0o755);
        let mut h = header(tar::EntryType::Regular, 0o4755, 3);
        h.set_uid(1000);
        h.set_gid(2000);
        b.append_data(&mut h, "bin/su", &b"su!"[..]).unwrap();
        symlink(&mut b, "bin/sh", "/bin/busybox");
        dir(&mut b, "ro/", 0o555);
        file(&mut b, "ro/inside", 0o400, b"x");
        dir(&mut b, "tmp/", 0o1777);
        let long = format!("usr/share/{}/file", "d".repeat(120));
        file(&mut b, &long, 0o600, b"long");
        // Old-style entry: type '\0'.
        let mut h = header(tar::EntryType::Regular, 0o640, 3);
        h.as_old_mut().linkflag[0] = 0;
        b.append_data(&mut h, "old", &b"old"[..]).unwrap();
        let mut h = header(tar::EntryType::Char, 0o666, 0);
        h.set_device_major(1).unwrap();
        h.set_device_minor(3).unwrap();
        b.append_data(&mut h, "dev/null", &[][..]).unwrap();
        let mut h = header(tar::EntryType::Fifo, 0o600, 0);
        b.append_data(&mut h, "run/fifo", &[][..]).unwrap();
        let bytes = b.into_inner().unwrap();

        let t = tempfile::tempdir().unwrap();
        let stats = unpack(&bytes, t.path()).unwrap();
        assert_eq!(stats.entries, 13);
        let p = t.path();

        assert_eq!(lmeta(p).permissions().mode() & 0o7777, 0o751);
        assert_eq!(lmeta(p).mtime() as u64, MTIME);
        assert_eq!(
            std::fs::read(p.join("etc/hosts")).unwrap(),
            b"127.0.0.1 localhost\n"
        );
        let m = lmeta(&p.join("etc/hosts"));
        assert_eq!(m.permissions().mode() & 0o7777, 0o644);
        assert_eq!(m.mtime() as u64, MTIME);
        let m = lmeta(&p.join("etc"));
        assert!(m.is_dir());
        assert_eq!(m.mtime() as u64, MTIME, "dir mtime applied after children");
        let m = lmeta(&p.join("bin/su"));
        assert_eq!(m.permissions().mode() & 0o7777, 0o4755, "setuid kept");
        assert_eq!((m.uid(), m.gid()), (1000, 2000));
        let m = lmeta(&p.join("bin/sh"));
        assert!(m.file_type().is_symlink());
        assert_eq!(m.mtime() as u64, MTIME);
        assert_eq!(
            std::fs::read_link(p.join("bin/sh")).unwrap(),
            Path::new("/bin/busybox")
        );
        assert_eq!(lmeta(&p.join("ro")).permissions().mode() & 0o7777, 0o555);
        assert_eq!(
            lmeta(&p.join("ro/inside")).permissions().mode() & 0o7777,
            0o400
        );
        assert_eq!(lmeta(&p.join("tmp")).permissions().mode() & 0o7777, 0o1777);
        assert_eq!(std::fs::read(p.join(&long)).unwrap(), b"long");
        let m = lmeta(&p.join("usr"));
        assert_eq!(m.permissions().mode() & 0o7777, 0o755, "implicit parent");
        assert_eq!(std::fs::read(p.join("old")).unwrap(), b"old");
        let m = lmeta(&p.join("dev/null"));
        assert!(m.file_type().is_char_device());
        assert_eq!(m.rdev(), rfs::makedev(1, 3));
        assert_eq!(m.permissions().mode() & 0o7777, 0o666);
        assert!(lmeta(&p.join("run/fifo")).file_type().is_fifo());
    }

    #[test]
    fn hard_links_in_same_layer() {
        let mut b = builder();
        file(&mut b, "bin/busybox", 0o755, b"BUSYBOX");
        file(&mut b, "bin/ls", 0o644, b"old ls, replaced");
        for name in ["ls", "cat", "sh"] {
            hardlink(&mut b, &format!("bin/{name}"), "bin/busybox");
        }
        // Linking again to the same inode is fine.
        hardlink(&mut b, "bin/sh", "./bin/busybox");
        let bytes = b.into_inner().unwrap();
        let t = tempfile::tempdir().unwrap();
        unpack(&bytes, t.path()).unwrap();
        let bb = lmeta(&t.path().join("bin/busybox"));
        assert_eq!(bb.nlink(), 4);
        for name in ["ls", "cat", "sh"] {
            let m = lmeta(&t.path().join("bin").join(name));
            assert_eq!(m.ino(), bb.ino());
        }
        assert_eq!(std::fs::read(t.path().join("bin/ls")).unwrap(), b"BUSYBOX");
    }

    #[test]
    fn hard_link_from_lower_layer() {
        let lower = tempfile::tempdir().unwrap();
        let mut b = builder();
        let mut h = header(tar::EntryType::Regular, 0o750, 4);
        h.set_uid(5);
        h.set_gid(6);
        b.append_data(&mut h, "usr/bin/tool", &b"tool"[..]).unwrap();
        unpack(&b.into_inner().unwrap(), lower.path()).unwrap();

        let mut b = builder();
        hardlink(&mut b, "usr/bin/tool2", "usr/bin/tool");
        let bytes = b.into_inner().unwrap();
        let t = tempfile::tempdir().unwrap();
        let opts = UnpackOptions {
            lowers: vec![lower.path().to_path_buf()],
            same_owner: true,
            skip_sync: false,
            ..Default::default()
        };
        unpack_layer(&bytes[..], t.path(), &opts).unwrap();
        let a = lmeta(&t.path().join("usr/bin/tool"));
        let c = lmeta(&t.path().join("usr/bin/tool2"));
        assert_eq!(a.ino(), c.ino());
        assert_eq!(a.permissions().mode() & 0o7777, 0o750);
        assert_eq!((a.uid(), a.gid()), (5, 6));
        assert_eq!(
            std::fs::read(t.path().join("usr/bin/tool2")).unwrap(),
            b"tool"
        );
        // The lower is untouched.
        assert_eq!(lmeta(&lower.path().join("usr/bin/tool")).nlink(), 1);

        // Nowhere to be found.
        let mut b = builder();
        hardlink(&mut b, "x", "usr/bin/missing");
        let t = tempfile::tempdir().unwrap();
        let err = unpack_layer(&b.into_inner().unwrap()[..], t.path(), &opts).unwrap_err();
        assert!(matches!(err, UnpackError::BadEntry { .. }), "{err}");
    }

    #[test]
    fn whiteouts_and_opaque_dirs() {
        let mut b = builder();
        file(&mut b, "etc/gone", 0o644, b"added then deleted");
        file(&mut b, "etc/.wh.gone", 0o644, b"");
        file(&mut b, "etc/.wh.lowerfile", 0o644, b"");
        file(&mut b, "var/.wh..wh..opq", 0o644, b"");
        file(&mut b, "var/.wh..wh.plnk", 0o644, b"");
        let bytes = b.into_inner().unwrap();
        let t = tempfile::tempdir().unwrap();
        unpack(&bytes, t.path()).unwrap();
        for name in ["etc/gone", "etc/lowerfile"] {
            let m = lmeta(&t.path().join(name));
            assert!(m.file_type().is_char_device(), "{name}");
            assert_eq!(m.rdev(), 0);
        }
        assert!(!t.path().join("etc/.wh.gone").exists());
        assert!(!t.path().join("var/.wh..wh..opq").exists());
        assert!(!t.path().join("var/.wh..wh.plnk").exists());
        let mut v = [0u8; 8];
        let n = rfs::lgetxattr(t.path().join("var"), OPAQUE_XATTR, &mut v[..]).unwrap();
        assert_eq!(&v[..n], b"y");
    }

    #[test]
    fn dotdot_escape_is_rejected() {
        let base = tempfile::tempdir().unwrap();
        let dest = base.path().join("x/layer");
        std::fs::create_dir_all(&dest).unwrap();
        for name in ["../../evil", "a/../../../evil"] {
            let mut b = builder();
            raw(&mut b, name, tar::EntryType::Regular, "", b"evil");
            let err = unpack(&b.into_inner().unwrap(), &dest).unwrap_err();
            assert!(
                matches!(err, UnpackError::PathEscape { .. }),
                "{name}: {err}"
            );
        }
        // A hard link to outside, too.
        let mut b = builder();
        raw(&mut b, "l", tar::EntryType::Link, "../../etc/passwd", b"");
        let err = unpack(&b.into_inner().unwrap(), &dest).unwrap_err();
        assert!(matches!(err, UnpackError::PathEscape { .. }), "{err}");
        assert!(!base.path().join("evil").exists());
        assert!(!base.path().join("x/evil").exists());
        assert!(!dest.join("l").exists());
    }

    #[test]
    fn absolute_path_stays_inside() {
        let mut b = builder();
        raw(&mut b, "/abs/path", tar::EntryType::Regular, "", b"in");
        raw(&mut b, "//abs/./x//y", tar::EntryType::Regular, "", b"y");
        let t = tempfile::tempdir().unwrap();
        unpack(&b.into_inner().unwrap(), t.path()).unwrap();
        assert_eq!(std::fs::read(t.path().join("abs/path")).unwrap(), b"in");
        assert_eq!(std::fs::read(t.path().join("abs/x/y")).unwrap(), b"y");
    }

    #[test]
    fn write_through_escaping_symlink_is_rejected() {
        let base = tempfile::tempdir().unwrap();
        let dest = base.path().join("x/layer");
        std::fs::create_dir_all(&dest).unwrap();
        let mut b = builder();
        symlink(&mut b, "a", "../../..");
        raw(&mut b, "a/evil", tar::EntryType::Regular, "", b"evil");
        let err = unpack(&b.into_inner().unwrap(), &dest).unwrap_err();
        assert!(matches!(err, UnpackError::PathEscape { .. }), "{err}");
        assert!(err.to_string().contains("../../.."), "{err}");
        assert!(!base.path().join("evil").exists());
        assert!(!base.path().parent().unwrap().join("evil").exists());

        let before = std::fs::read("/etc/passwd").unwrap();
        let dest = tempfile::tempdir().unwrap();
        let mut b = builder();
        symlink(&mut b, "b", "/etc");
        raw(
            &mut b,
            "b/passwd",
            tar::EntryType::Regular,
            "",
            b"root::0:0::/:/bin/sh\n",
        );
        let err = unpack(&b.into_inner().unwrap(), dest.path()).unwrap_err();
        assert!(matches!(err, UnpackError::PathEscape { .. }), "{err}");
        assert!(err.to_string().contains("/etc"), "{err}");
        assert_eq!(std::fs::read("/etc/passwd").unwrap(), before);

        // A relative symlink that escapes only through a chain.
        let dest = tempfile::tempdir().unwrap();
        let mut b = builder();
        dir(&mut b, "d/", 0o755);
        symlink(&mut b, "d/s", "../e");
        symlink(&mut b, "e", "..");
        raw(&mut b, "d/s/evil", tar::EntryType::Regular, "", b"evil");
        let err = unpack(&b.into_inner().unwrap(), dest.path()).unwrap_err();
        assert!(matches!(err, UnpackError::PathEscape { .. }), "{err}");
    }

    #[test]
    fn write_through_inside_symlink_is_followed() {
        let mut b = builder();
        dir(&mut b, "sub/", 0o755);
        symlink(&mut b, "c", "sub");
        symlink(&mut b, "deep/c2", "../c");
        file(&mut b, "c/file", 0o644, b"via c");
        file(&mut b, "deep/c2/file2", 0o644, b"via c2");
        hardlink(&mut b, "c/link", "deep/c2/file2");
        let t = tempfile::tempdir().unwrap();
        unpack(&b.into_inner().unwrap(), t.path()).unwrap();
        assert_eq!(std::fs::read(t.path().join("sub/file")).unwrap(), b"via c");
        assert_eq!(
            std::fs::read(t.path().join("sub/file2")).unwrap(),
            b"via c2"
        );
        assert_eq!(std::fs::read(t.path().join("sub/link")).unwrap(), b"via c2");
        assert!(lmeta(&t.path().join("c")).file_type().is_symlink());

        // A loop is a bad entry, not a hang.
        let mut b = builder();
        symlink(&mut b, "l1", "l2");
        symlink(&mut b, "l2", "l1");
        raw(&mut b, "l1/x", tar::EntryType::Regular, "", b"x");
        let t = tempfile::tempdir().unwrap();
        let err = unpack(&b.into_inner().unwrap(), t.path()).unwrap_err();
        assert!(matches!(err, UnpackError::BadEntry { .. }), "{err}");
    }

    #[test]
    fn replacing_entries() {
        let mut b = builder();
        file(&mut b, "a", 0o644, b"file first");
        dir(&mut b, "a/", 0o700);
        file(&mut b, "a/child", 0o644, b"child");
        dir(&mut b, "b/", 0o755);
        file(&mut b, "b/child", 0o644, b"child");
        file(&mut b, "b", 0o600, b"file now");
        symlink(&mut b, "s", "/nowhere");
        file(&mut b, "s", 0o644, b"no longer a symlink");
        file(&mut b, "f", 0o644, b"one");
        hardlink(&mut b, "f2", "f");
        file(&mut b, "f", 0o644, b"two");
        let t = tempfile::tempdir().unwrap();
        unpack(&b.into_inner().unwrap(), t.path()).unwrap();
        let p = t.path();
        assert!(lmeta(&p.join("a")).is_dir());
        assert_eq!(lmeta(&p.join("a")).permissions().mode() & 0o7777, 0o700);
        assert_eq!(std::fs::read(p.join("a/child")).unwrap(), b"child");
        assert!(lmeta(&p.join("b")).is_file());
        assert_eq!(std::fs::read(p.join("b")).unwrap(), b"file now");
        assert_eq!(std::fs::read(p.join("s")).unwrap(), b"no longer a symlink");
        assert_eq!(std::fs::read(p.join("f")).unwrap(), b"two");
        assert_eq!(
            std::fs::read(p.join("f2")).unwrap(),
            b"one",
            "hard link kept"
        );
    }

    #[test]
    fn parent_that_is_a_file_is_bad() {
        let mut b = builder();
        file(&mut b, "f", 0o644, b"x");
        raw(&mut b, "f/x", tar::EntryType::Regular, "", b"x");
        let t = tempfile::tempdir().unwrap();
        let err = unpack(&b.into_inner().unwrap(), t.path()).unwrap_err();
        assert!(matches!(err, UnpackError::BadEntry { .. }), "{err}");
    }

    #[test]
    fn pax_xattrs() {
        let mut b = builder();
        b.append_pax_extensions([
            ("SCHILY.xattr.user.test", &b"hello"[..]),
            ("SCHILY.xattr.trusted.overlay.redirect", &b"/etc"[..]),
            ("mtime", &b"1600000000.5"[..]),
        ])
        .unwrap();
        file(&mut b, "x", 0o644, b"data");
        let t = tempfile::tempdir().unwrap();
        unpack(&b.into_inner().unwrap(), t.path()).unwrap();
        let p = t.path().join("x");
        let m = lmeta(&p);
        assert_eq!((m.mtime() as u64, m.mtime_nsec()), (MTIME, 500_000_000));
        let mut v = [0u8; 16];
        match rfs::lgetxattr(&p, "user.test", &mut v[..]) {
            Ok(n) => assert_eq!(&v[..n], b"hello"),
            Err(Errno::OPNOTSUPP) => {}
            Err(e) => panic!("lgetxattr: {e}"),
        }
        assert!(rfs::lgetxattr(&p, "trusted.overlay.redirect", &mut v[..]).is_err());
    }

    #[test]
    fn diff_id_covers_whole_stream() {
        let mut b = builder();
        file(&mut b, "a", 0o644, &[7u8; 1000]);
        let mut bytes = b.into_inner().unwrap();
        // Record padding after the two zero blocks, as tar(1) writes.
        bytes.resize(10240, 0);
        let t = tempfile::tempdir().unwrap();
        let stats = unpack(&bytes, t.path()).unwrap();
        assert_eq!(stats.diff_id, Digest::of(&bytes));
        assert_eq!(stats.tar_size, 10240);
        assert_eq!(stats.entries, 1);
    }

    #[test]
    fn truncated_archive_is_a_read_error() {
        let mut b = builder();
        file(&mut b, "a", 0o644, &[7u8; 4000]);
        file(&mut b, "b", 0o644, b"b");
        let bytes = b.into_inner().unwrap();
        for cut in [700, 512 + 4096 + 100] {
            let t = tempfile::tempdir().unwrap();
            let err = unpack(&bytes[..cut], t.path()).unwrap_err();
            assert!(matches!(err, UnpackError::Read(_)), "cut {cut}: {err}");
        }
    }

    #[test]
    fn whiteout_of_parent_directory_is_created() {
        let mut b = builder();
        raw(&mut b, "./deep/dir/.wh.x", tar::EntryType::Regular, "", b"");
        let t = tempfile::tempdir().unwrap();
        unpack(&b.into_inner().unwrap(), t.path()).unwrap();
        assert!(lmeta(&t.path().join("deep/dir/x"))
            .file_type()
            .is_char_device());
    }

    fn limited(max_bytes: u64, max_entries: u64) -> UnpackOptions {
        UnpackOptions {
            limits: UnpackLimits {
                max_bytes,
                max_entries,
                ..UnpackLimits::default()
            },
            ..root_opts()
        }
    }

    /// An old-GNU sparse file: 512 bytes of data in the archive, `real` bytes unpacked (the
    /// tar reader fills the hole with zeros).
    fn sparse_layer(real: u64) -> Vec<u8> {
        let mut b = builder();
        let mut h = header(tar::EntryType::GNUSparse, 0o644, 512);
        h.as_old_mut().name[..6].copy_from_slice(b"sparse");
        let octal = |v: u64| {
            // 11 digits and a NUL, or all 12 digits for sizes past 8 GiB (as GNU tar does).
            let d = format!("{v:011o}");
            let mut f = [0u8; 12];
            f[..d.len()].copy_from_slice(d.as_bytes());
            f
        };
        let g = h.as_gnu_mut().unwrap();
        g.realsize = octal(real);
        g.sparse[0].offset = octal(real - 512);
        g.sparse[0].numbytes = octal(512);
        h.set_cksum();
        b.append(&h, &[7u8; 512][..]).unwrap();
        b.into_inner().unwrap()
    }

    #[test]
    fn layers_of_one_image_share_its_byte_bound() {
        // Two layers of 6 MiB each: each under the per-layer bound of 8 MiB, together over
        // the image's 10 MiB.
        let layer = |name: &str| {
            let mut b = builder();
            raw(
                &mut b,
                name,
                tar::EntryType::Regular,
                "",
                &vec![1u8; 6 << 20],
            );
            b.into_inner().unwrap()
        };
        let written = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut opts = limited(8 << 20, 0);
        opts.limits.max_image_bytes = 10 << 20;
        opts.image_written = Some(written.clone());
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        unpack_layer(&layer("a")[..], a.path(), &opts).unwrap();
        let e = unpack_layer(&layer("b")[..], b.path(), &opts).unwrap_err();
        assert!(
            matches!(
                e,
                UnpackError::Limit {
                    key: "images.max_image_bytes",
                    ..
                }
            ),
            "{e}"
        );
        // Another pull has a budget of its own.
        opts.image_written = Some(std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0)));
        let c = tempfile::tempdir().unwrap();
        unpack_layer(&layer("b")[..], c.path(), &opts).unwrap();
    }

    #[test]
    fn a_sparse_file_counts_at_its_full_size() {
        // 20 GiB from a 2 KiB layer: stopped at the bound, not after writing it all.
        let layer = sparse_layer(20 << 30);
        assert!(layer.len() < 4096);
        let t = tempfile::tempdir().unwrap();
        let e = unpack_layer(&layer[..], t.path(), &limited(8 << 20, 0)).unwrap_err();
        assert!(
            matches!(
                e,
                UnpackError::Limit {
                    key: "images.max_layer_bytes",
                    ..
                }
            ),
            "{e}"
        );
        let (bytes, _) = crate::fsutil::disk_usage(t.path()).unwrap();
        assert!(bytes <= 9 << 20, "{bytes} bytes on disk");
        // Within the bound it unpacks, holes as zeros.
        let t = tempfile::tempdir().unwrap();
        unpack_layer(&sparse_layer(4096)[..], t.path(), &limited(8 << 20, 0)).unwrap();
        let data = std::fs::read(t.path().join("sparse")).unwrap();
        assert_eq!(data.len(), 4096);
        assert!(data[..3584].iter().all(|b| *b == 0) && data[3584..].iter().all(|b| *b == 7));
    }

    #[test]
    fn too_many_entries() {
        let mut b = builder();
        for i in 0..10 {
            file(&mut b, &format!("f{i}"), 0o644, b"x");
        }
        let layer = b.into_inner().unwrap();
        let t = tempfile::tempdir().unwrap();
        let e = unpack_layer(&layer[..], t.path(), &limited(0, 5)).unwrap_err();
        assert!(
            matches!(
                e,
                UnpackError::Limit {
                    key: "images.max_layer_entries",
                    limit: 5,
                    ..
                }
            ),
            "{e}"
        );
        let t = tempfile::tempdir().unwrap();
        unpack_layer(&layer[..], t.path(), &limited(0, 10)).unwrap();
    }
}
