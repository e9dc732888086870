//! The shared directory's filesystem: `fuse-backend-rs`'s passthrough filesystem, with its
//! extended-attribute requests made to work in a confined server thread.
//!
//! The passthrough filesystem keeps an `O_PATH` fd per inode, and `f*xattr` refuse `O_PATH`
//! fds, so it names the inode by the absolute path `/proc/self/fd/<fd>`. The server thread
//! lives in a root of its own, the shared directory (see `fs.rs`), where `/proc` does not
//! exist: every xattr request failed with ENOENT. That broke more than `getfattr`: execve
//! reads `security.capability`, and a failure other than "no such attribute" fails the exec,
//! so no binary on a volume could run in a VM pod (scripts could: the kernel reads the
//! interpreter's attributes, and the interpreter was not on the volume).
//!
//! Here the four xattr requests open the inode anew, `O_PATH` by its path in the share (which
//! the filesystem reads from its `/proc/self/fd` directory, and the kernel writes relative to
//! the reading thread's root, the share), check that it is the same file (device and inode
//! number), and name that fd the way virtiofsd does: relative to the process's `/proc/self/fd`
//! directory, opened before the thread left the host's root, as the thread's working
//! directory (the thread has its own, CLONE_FS). A rename between reading the path and
//! opening it, or an inode whose last name is gone (`... (deleted)`), fails the request with
//! ENOENT rather than reaching another file. Every other request goes to the passthrough
//! filesystem as is, but for the owners an [`IdShift`] translates.

use std::any::Any;
use std::ffi::{CStr, CString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::time::Duration;

use fuse_backend_rs::abi::fuse_abi::{
    stat64, statvfs64, CreateIn, FsOptions, OpenOptions, SetattrValid,
};
use fuse_backend_rs::abi::virtio_fs::RemovemappingOne;
use fuse_backend_rs::api::filesystem::{
    Context, DirEntry, Entry, FileSystem, GetxattrReply, ListxattrReply, ZeroCopyReader,
    ZeroCopyWriter,
};
use fuse_backend_rs::api::BackendFileSystem;
use fuse_backend_rs::passthrough::PassthroughFs;
use fuse_backend_rs::transport::FsCacheReqHandler;

type Inode = u64;
type Handle = u64;

/// The most an attribute's value, or a list of names, can be (XATTR_SIZE_MAX,
/// XATTR_LIST_MAX): the kernel asks for no more, and a guest's larger size is not allocated.
const XATTR_MAX: u32 = 65536;

/// The passthrough filesystem and, where its thread is confined to the share (a root without
/// `/proc`), the process's `/proc/self/fd` directory; unconfined, its own xattr requests work
/// and are left to it.
pub struct ShareFs {
    inner: PassthroughFs<()>,
    proc_fd: Option<File>,
    shift: Option<IdShift>,
}

/// One id range of an [`IdShift`]: `size` ids from `disk` on the host's filesystem are
/// `guest` onwards in the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdRange {
    pub disk: u32,
    pub guest: u32,
    pub size: u32,
}

/// What an idmapped mount through a pod's user namespace does, done by the file server for
/// a guest whose kernel cannot idmap virtio-fs: a pod user namespace mapping container ids
/// `c..c+n` to guest ids `h..h+n` sees a file owned by `k` on disk as its own `k`, that is
/// guest id `h + (k - c)`; what a guest id in `h..h+n` creates or chowns is `c + (g - h)`
/// on disk. Owners on disk outside the range show as a guest id outside it (the overflow
/// id in the pod, as through an idmapped mount); guest ids outside the range (the agent's
/// root) are passed as they are. File capabilities follow (`security.capability`'s root
/// id), and so do POSIX ACLs' named user and group entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdShift {
    pub uid: IdRange,
    pub gid: IdRange,
}

impl IdRange {
    /// Whether the range is one the kernel could have taken (non-empty, no wrap-around).
    pub fn check(self) -> Result<(), String> {
        let end = |start: u32| start.checked_add(self.size);
        if self.size == 0 || end(self.disk).is_none() || end(self.guest).is_none() {
            return Err(format!("id range {self:?}: empty or past 2^32"));
        }
        Ok(())
    }

    /// A guest id outside the range, for owners the mapping does not cover: shown as the
    /// overflow id (65534) in the pod's user namespace, and never one of its users (65534
    /// itself may be in the range).
    fn outside(self) -> u32 {
        self.guest.checked_sub(1).unwrap_or(self.guest + self.size)
    }

    fn to_guest(self, disk: u32) -> u32 {
        match disk.checked_sub(self.disk) {
            Some(off) if off < self.size => self.guest + off,
            _ => self.outside(),
        }
    }

    fn to_disk(self, guest: u32) -> u32 {
        match guest.checked_sub(self.guest) {
            Some(off) if off < self.size => self.disk + off,
            _ => guest,
        }
    }
}

/// `security.capability` revisions: v2 (20 bytes) has no root id, v3 (24 bytes) ends with
/// the host id of the root its capabilities are for.
const VFS_CAP_REVISION_MASK: u32 = 0xff00_0000;
const VFS_CAP_REVISION_2: u32 = 0x0200_0000;
const VFS_CAP_REVISION_3: u32 = 0x0300_0000;
const XATTR_CAPS_SZ_2: usize = 20;
const XATTR_CAPS_SZ_3: usize = 24;

impl IdShift {
    /// Checks both ranges ([`IdRange::check`]).
    pub fn check(&self) -> Result<(), String> {
        self.uid.check()?;
        self.gid.check()
    }

    /// A file capability as the guest sees it: a v2 one is for the disk's root, so for the
    /// pod's root (v3 with that root id), as an idmapped mount shows it.
    fn caps_out(&self, v: &[u8]) -> Option<Vec<u8>> {
        let magic = u32::from_le_bytes(v.get(..4)?.try_into().ok()?);
        let (rev, root) = match (magic & VFS_CAP_REVISION_MASK, v.len()) {
            (VFS_CAP_REVISION_2, XATTR_CAPS_SZ_2) => (VFS_CAP_REVISION_2, 0),
            (VFS_CAP_REVISION_3, XATTR_CAPS_SZ_3) => (
                VFS_CAP_REVISION_3,
                u32::from_le_bytes(v[20..24].try_into().ok()?),
            ),
            _ => return None,
        };
        let mut out = v[..XATTR_CAPS_SZ_2].to_vec();
        let flags = magic & !VFS_CAP_REVISION_MASK;
        debug_assert!(rev == VFS_CAP_REVISION_2 || rev == VFS_CAP_REVISION_3);
        out[..4].copy_from_slice(&(VFS_CAP_REVISION_3 | flags).to_le_bytes());
        out.extend_from_slice(&self.uid.to_guest(root).to_le_bytes());
        Some(out)
    }

    /// A file capability as the disk keeps it: a v3 one's root id shifted back, and one for
    /// the disk's root written as v2 (what the host's kernel writes for its own root).
    fn caps_in(&self, v: &[u8]) -> Option<Vec<u8>> {
        let magic = u32::from_le_bytes(v.get(..4)?.try_into().ok()?);
        if magic & VFS_CAP_REVISION_MASK != VFS_CAP_REVISION_3 || v.len() != XATTR_CAPS_SZ_3 {
            return Some(v.to_vec());
        }
        let root = self
            .uid
            .to_disk(u32::from_le_bytes(v[20..24].try_into().ok()?));
        let mut out = v[..XATTR_CAPS_SZ_2].to_vec();
        if root == 0 {
            let flags = magic & !VFS_CAP_REVISION_MASK;
            out[..4].copy_from_slice(&(VFS_CAP_REVISION_2 | flags).to_le_bytes());
        } else {
            out.extend_from_slice(&root.to_le_bytes());
        }
        Some(out)
    }

    /// An id-naming xattr's value (`kind`) as the guest sees it; `None` if it is malformed.
    fn xattr_out(&self, kind: XattrKind, v: &[u8]) -> Option<Vec<u8>> {
        match kind {
            XattrKind::Caps => self.caps_out(v),
            XattrKind::Acl => self.acl_out(v),
            XattrKind::Other => Some(v.to_vec()),
        }
    }

    /// An id-naming xattr's value (`kind`) as the disk keeps it; `None` if it is malformed.
    fn xattr_in(&self, kind: XattrKind, v: &[u8]) -> Option<Vec<u8>> {
        match kind {
            XattrKind::Caps => self.caps_in(v),
            XattrKind::Acl => self.acl_in(v),
            XattrKind::Other => Some(v.to_vec()),
        }
    }

    /// A POSIX ACL as the guest sees it: its named users and groups shifted as owners are.
    fn acl_out(&self, v: &[u8]) -> Option<Vec<u8>> {
        acl_map(v, |u| self.uid.to_guest(u), |g| self.gid.to_guest(g))
    }

    /// A POSIX ACL as the disk keeps it.
    fn acl_in(&self, v: &[u8]) -> Option<Vec<u8>> {
        acl_map(v, |u| self.uid.to_disk(u), |g| self.gid.to_disk(g))
    }

    fn stat_out(&self, st: &mut stat64) {
        st.st_uid = self.uid.to_guest(st.st_uid);
        st.st_gid = self.gid.to_guest(st.st_gid);
    }

    fn ctx_in(&self, ctx: &Context) -> Context {
        let mut c = *ctx;
        c.uid = self.uid.to_disk(ctx.uid);
        c.gid = self.gid.to_disk(ctx.gid);
        c
    }
}

/// The POSIX ACL xattr (`system.posix_acl_*`): a version, then (tag, permissions, id)
/// entries, of which the named user and group ones carry an id.
const POSIX_ACL_XATTR_VERSION: u32 = 2;
const ACL_USER: u16 = 0x02;
const ACL_GROUP: u16 = 0x08;

/// `v` with the ids of its named user entries mapped by `uid` and of its named group entries
/// by `gid`; `None` if it is not a POSIX ACL xattr.
fn acl_map(v: &[u8], uid: impl Fn(u32) -> u32, gid: impl Fn(u32) -> u32) -> Option<Vec<u8>> {
    let version = u32::from_le_bytes(v.get(..4)?.try_into().ok()?);
    if version != POSIX_ACL_XATTR_VERSION || !(v.len() - 4).is_multiple_of(8) {
        return None;
    }
    let mut out = v.to_vec();
    for e in out[4..].chunks_exact_mut(8) {
        let id = u32::from_le_bytes(e[4..8].try_into().ok()?);
        let id = match u16::from_le_bytes([e[0], e[1]]) {
            ACL_USER => uid(id),
            ACL_GROUP => gid(id),
            _ => continue,
        };
        e[4..8].copy_from_slice(&id.to_le_bytes());
    }
    Some(out)
}

/// The inode of a request, opened for naming in `/proc/self/fd`.
struct Named<'a> {
    proc_fd: &'a File,
    /// Held open while `name`, its number, is used.
    _fd: OwnedFd,
    name: CString,
}

impl Named<'_> {
    /// Runs `f` with the name (`<fd>`), relative to the working directory, which is
    /// `/proc/self/fd` meanwhile, and `/` again after. `f` reads errno itself: the change back
    /// comes after it.
    fn with<T>(&self, f: impl FnOnce(&CStr) -> T) -> io::Result<T> {
        // SAFETY: fchdir on a directory fd we own; the working directory is this thread's own
        // (CLONE_FS was unshared), and nothing else on it depends on it.
        status(unsafe { libc::fchdir(self.proc_fd.as_raw_fd()) })?;
        let out = f(&self.name);
        // SAFETY: "/" is a NUL-terminated string: the thread's root, the share.
        status(unsafe { libc::chdir(c"/".as_ptr()) })?;
        Ok(out)
    }
}

impl ShareFs {
    /// `proc_fd` is `/proc/self/fd` for a confined server thread, `None` otherwise.
    pub fn new(inner: PassthroughFs<()>, proc_fd: Option<File>, shift: Option<IdShift>) -> ShareFs {
        ShareFs {
            inner,
            proc_fd,
            shift,
        }
    }

    /// The guest's view of `st`'s owners.
    fn out(&self, mut st: stat64) -> stat64 {
        if let Some(s) = &self.shift {
            s.stat_out(&mut st);
        }
        st
    }

    /// The guest's view of an entry's owners.
    fn entry(&self, mut e: Entry) -> Entry {
        e.attr = self.out(e.attr);
        e
    }

    /// The caller as the host's filesystem knows it.
    fn ctx(&self, ctx: &Context) -> Context {
        match &self.shift {
            Some(s) => s.ctx_in(ctx),
            None => *ctx,
        }
    }

    /// The inode opened anew (`O_PATH`, not following a last symlink) by its path from the
    /// thread's root, if it is still the same file there; `None` when unconfined.
    fn named(&self, ctx: &Context, inode: Inode) -> io::Result<Option<Named<'_>>> {
        let Some(proc_fd) = &self.proc_fd else {
            return Ok(None);
        };
        let gone = || io::Error::from_raw_os_error(libc::ENOENT);
        let p = self.inner.readlinkat_proc_file(inode)?;
        if !p.is_absolute() {
            // Not a name in the tree (an anonymous inode, an unreachable one).
            return Err(gone());
        }
        let path = CString::new(p.into_os_string().into_vec()).map_err(|_| gone())?;
        // SAFETY: `path` is a NUL-terminated string alive for the call; the fd returned, if
        // any, is new and ours.
        let raw = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is an open fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut st = std::mem::MaybeUninit::<libc::stat64>::zeroed();
        // SAFETY: fstat64 fills the stat we own from an open fd.
        status(unsafe { libc::fstat64(fd.as_raw_fd(), st.as_mut_ptr()) })?;
        // SAFETY: fstat64 succeeded, so it initialised `st` (zeroed before anyway).
        let st = unsafe { st.assume_init() };
        let (want, _) = self.inner.getattr(ctx, inode, None)?;
        if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino) {
            return Err(gone());
        }
        let name = CString::new(raw.to_string()).map_err(|_| gone())?;
        Ok(Some(Named {
            proc_fd,
            _fd: fd,
            name,
        }))
    }
}

/// `r` (a status from a libc call) as a result.
fn status(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `r` (a byte count from an xattr call) as a result.
fn byte_count(r: libc::ssize_t) -> io::Result<u32> {
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    u32::try_from(r).map_err(|_| io::Error::from_raw_os_error(libc::E2BIG))
}

impl BackendFileSystem for ShareFs {
    fn mount(&self) -> io::Result<(Entry, u64)> {
        let (e, n) = self.inner.mount()?;
        Ok((self.entry(e), n))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl FileSystem for ShareFs {
    type Inode = Inode;
    type Handle = Handle;

    fn setxattr(
        &self,
        ctx: &Context,
        inode: Inode,
        name: &CStr,
        value: &[u8],
        flags: u32,
    ) -> io::Result<()> {
        let shifted;
        let value = match (&self.shift, xattr_kind(name)) {
            (None, _) | (_, XattrKind::Other) => value,
            (Some(sh), kind) => {
                shifted = sh
                    .xattr_in(kind, value)
                    .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
                &shifted[..]
            }
        };
        let Some(n) = self.named(ctx, inode)? else {
            return self.inner.setxattr(ctx, inode, name, value, flags);
        };
        let flags =
            libc::c_int::try_from(flags).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        n.with(|file| {
            // SAFETY: `file` and `name` are NUL-terminated strings and `value` a slice of
            // `value.len()` bytes, all alive for the call; nothing is written.
            status(unsafe {
                libc::setxattr(
                    file.as_ptr(),
                    name.as_ptr(),
                    value.as_ptr().cast(),
                    value.len(),
                    flags,
                )
            })
        })?
    }

    fn getxattr(
        &self,
        ctx: &Context,
        inode: Inode,
        name: &CStr,
        size: u32,
    ) -> io::Result<GetxattrReply> {
        match (&self.shift, xattr_kind(name)) {
            (None, _) | (_, XattrKind::Other) => self.getxattr_raw(ctx, inode, name, size),
            (Some(sh), kind) => {
                // The whole value (a v2 capability grows by the root id), then sized as asked.
                let v = match self.getxattr_raw(ctx, inode, name, XATTR_MAX)? {
                    GetxattrReply::Value(v) => v,
                    GetxattrReply::Count(_) => Vec::new(),
                };
                let v = sh
                    .xattr_out(kind, &v)
                    .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
                let len = u32::try_from(v.len()).unwrap_or(u32::MAX);
                if size == 0 {
                    Ok(GetxattrReply::Count(len))
                } else if len > size {
                    Err(io::Error::from_raw_os_error(libc::ERANGE))
                } else {
                    Ok(GetxattrReply::Value(v))
                }
            }
        }
    }

    fn listxattr(&self, ctx: &Context, inode: Inode, size: u32) -> io::Result<ListxattrReply> {
        let Some(n) = self.named(ctx, inode)? else {
            return self.inner.listxattr(ctx, inode, size);
        };
        let mut buf = vec![0u8; size.min(XATTR_MAX) as usize];
        let len = n.with(|file| {
            // SAFETY: `file` is a NUL-terminated string alive for the call; the kernel writes
            // at most `buf.len()` bytes into `buf` (nothing when it is empty).
            byte_count(unsafe {
                libc::listxattr(file.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
            })
        })??;
        if size == 0 {
            return Ok(ListxattrReply::Count(len));
        }
        buf.truncate(len as usize);
        Ok(ListxattrReply::Names(buf))
    }

    fn removexattr(&self, ctx: &Context, inode: Inode, name: &CStr) -> io::Result<()> {
        let Some(n) = self.named(ctx, inode)? else {
            return self.inner.removexattr(ctx, inode, name);
        };
        n.with(|file| {
            // SAFETY: `file` and `name` are NUL-terminated strings alive for the call.
            status(unsafe { libc::removexattr(file.as_ptr(), name.as_ptr()) })
        })?
    }

    // Everything else: the passthrough filesystem's own.

    fn init(&self, capable: FsOptions) -> io::Result<FsOptions> {
        self.inner.init(capable)
    }

    fn destroy(&self) {
        self.inner.destroy();
    }

    fn lookup(&self, ctx: &Context, parent: Inode, name: &CStr) -> io::Result<Entry> {
        self.inner.lookup(ctx, parent, name).map(|e| self.entry(e))
    }

    fn forget(&self, ctx: &Context, inode: Inode, count: u64) {
        self.inner.forget(ctx, inode, count);
    }

    fn batch_forget(&self, ctx: &Context, requests: Vec<(Inode, u64)>) {
        self.inner.batch_forget(ctx, requests);
    }

    fn getattr(
        &self,
        ctx: &Context,
        inode: Inode,
        handle: Option<Handle>,
    ) -> io::Result<(stat64, Duration)> {
        let (st, d) = self.inner.getattr(ctx, inode, handle)?;
        Ok((self.out(st), d))
    }

    fn setattr(
        &self,
        ctx: &Context,
        inode: Inode,
        attr: stat64,
        handle: Option<Handle>,
        valid: SetattrValid,
    ) -> io::Result<(stat64, Duration)> {
        let mut attr = attr;
        if let Some(sh) = &self.shift {
            attr.st_uid = sh.uid.to_disk(attr.st_uid);
            attr.st_gid = sh.gid.to_disk(attr.st_gid);
        }
        let (st, d) = self
            .inner
            .setattr(&self.ctx(ctx), inode, attr, handle, valid)?;
        Ok((self.out(st), d))
    }

    fn readlink(&self, ctx: &Context, inode: Inode) -> io::Result<Vec<u8>> {
        self.inner.readlink(ctx, inode)
    }

    fn symlink(
        &self,
        ctx: &Context,
        linkname: &CStr,
        parent: Inode,
        name: &CStr,
    ) -> io::Result<Entry> {
        self.inner
            .symlink(&self.ctx(ctx), linkname, parent, name)
            .map(|e| self.entry(e))
    }

    fn mknod(
        &self,
        ctx: &Context,
        parent: Inode,
        name: &CStr,
        mode: u32,
        rdev: u32,
        umask: u32,
    ) -> io::Result<Entry> {
        self.inner
            .mknod(&self.ctx(ctx), parent, name, mode, rdev, umask)
            .map(|e| self.entry(e))
    }

    fn mkdir(
        &self,
        ctx: &Context,
        parent: Inode,
        name: &CStr,
        mode: u32,
        umask: u32,
    ) -> io::Result<Entry> {
        self.inner
            .mkdir(&self.ctx(ctx), parent, name, mode, umask)
            .map(|e| self.entry(e))
    }

    fn unlink(&self, ctx: &Context, parent: Inode, name: &CStr) -> io::Result<()> {
        self.inner.unlink(ctx, parent, name)
    }

    fn rmdir(&self, ctx: &Context, parent: Inode, name: &CStr) -> io::Result<()> {
        self.inner.rmdir(ctx, parent, name)
    }

    fn rename(
        &self,
        ctx: &Context,
        olddir: Inode,
        oldname: &CStr,
        newdir: Inode,
        newname: &CStr,
        flags: u32,
    ) -> io::Result<()> {
        self.inner
            .rename(ctx, olddir, oldname, newdir, newname, flags)
    }

    fn link(
        &self,
        ctx: &Context,
        inode: Inode,
        newparent: Inode,
        newname: &CStr,
    ) -> io::Result<Entry> {
        self.inner
            .link(ctx, inode, newparent, newname)
            .map(|e| self.entry(e))
    }

    fn open(
        &self,
        ctx: &Context,
        inode: Inode,
        flags: u32,
        fuse_flags: u32,
    ) -> io::Result<(Option<Handle>, OpenOptions, Option<u32>)> {
        self.inner.open(ctx, inode, flags, fuse_flags)
    }

    fn create(
        &self,
        ctx: &Context,
        parent: Inode,
        name: &CStr,
        args: CreateIn,
    ) -> io::Result<(Entry, Option<Handle>, OpenOptions, Option<u32>)> {
        let (e, h, o, p) = self.inner.create(&self.ctx(ctx), parent, name, args)?;
        Ok((self.entry(e), h, o, p))
    }

    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        ctx: &Context,
        inode: Inode,
        handle: Handle,
        w: &mut dyn ZeroCopyWriter,
        size: u32,
        offset: u64,
        lock_owner: Option<u64>,
        flags: u32,
    ) -> io::Result<usize> {
        self.inner
            .read(ctx, inode, handle, w, size, offset, lock_owner, flags)
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        ctx: &Context,
        inode: Inode,
        handle: Handle,
        r: &mut dyn ZeroCopyReader,
        size: u32,
        offset: u64,
        lock_owner: Option<u64>,
        delayed_write: bool,
        flags: u32,
        fuse_flags: u32,
    ) -> io::Result<usize> {
        self.inner.write(
            ctx,
            inode,
            handle,
            r,
            size,
            offset,
            lock_owner,
            delayed_write,
            flags,
            fuse_flags,
        )
    }

    fn flush(
        &self,
        ctx: &Context,
        inode: Inode,
        handle: Handle,
        lock_owner: u64,
    ) -> io::Result<()> {
        self.inner.flush(ctx, inode, handle, lock_owner)
    }

    fn fsync(&self, ctx: &Context, inode: Inode, datasync: bool, handle: Handle) -> io::Result<()> {
        self.inner.fsync(ctx, inode, datasync, handle)
    }

    fn fallocate(
        &self,
        ctx: &Context,
        inode: Inode,
        handle: Handle,
        mode: u32,
        offset: u64,
        length: u64,
    ) -> io::Result<()> {
        self.inner
            .fallocate(ctx, inode, handle, mode, offset, length)
    }

    #[allow(clippy::too_many_arguments)]
    fn release(
        &self,
        ctx: &Context,
        inode: Inode,
        flags: u32,
        handle: Handle,
        flush: bool,
        flock_release: bool,
        lock_owner: Option<u64>,
    ) -> io::Result<()> {
        self.inner
            .release(ctx, inode, flags, handle, flush, flock_release, lock_owner)
    }

    fn statfs(&self, ctx: &Context, inode: Inode) -> io::Result<statvfs64> {
        self.inner.statfs(ctx, inode)
    }

    fn opendir(
        &self,
        ctx: &Context,
        inode: Inode,
        flags: u32,
    ) -> io::Result<(Option<Handle>, OpenOptions)> {
        self.inner.opendir(ctx, inode, flags)
    }

    fn readdir(
        &self,
        ctx: &Context,
        inode: Inode,
        handle: Handle,
        size: u32,
        offset: u64,
        add_entry: &mut dyn FnMut(DirEntry) -> io::Result<usize>,
    ) -> io::Result<()> {
        self.inner
            .readdir(ctx, inode, handle, size, offset, add_entry)
    }

    fn readdirplus(
        &self,
        ctx: &Context,
        inode: Inode,
        handle: Handle,
        size: u32,
        offset: u64,
        add_entry: &mut dyn FnMut(DirEntry, Entry) -> io::Result<usize>,
    ) -> io::Result<()> {
        if self.shift.is_none() {
            return self
                .inner
                .readdirplus(ctx, inode, handle, size, offset, add_entry);
        }
        self.inner
            .readdirplus(ctx, inode, handle, size, offset, &mut |d, e| {
                add_entry(d, self.entry(e))
            })
    }

    fn fsyncdir(
        &self,
        ctx: &Context,
        inode: Inode,
        datasync: bool,
        handle: Handle,
    ) -> io::Result<()> {
        self.inner.fsyncdir(ctx, inode, datasync, handle)
    }

    fn releasedir(
        &self,
        ctx: &Context,
        inode: Inode,
        flags: u32,
        handle: Handle,
    ) -> io::Result<()> {
        self.inner.releasedir(ctx, inode, flags, handle)
    }

    #[allow(clippy::too_many_arguments)]
    fn setupmapping(
        &self,
        ctx: &Context,
        inode: Inode,
        handle: Handle,
        foffset: u64,
        len: u64,
        flags: u64,
        moffset: u64,
        vu_req: &mut dyn FsCacheReqHandler,
    ) -> io::Result<()> {
        self.inner
            .setupmapping(ctx, inode, handle, foffset, len, flags, moffset, vu_req)
    }

    fn removemapping(
        &self,
        ctx: &Context,
        inode: Inode,
        requests: Vec<RemovemappingOne>,
        vu_req: &mut dyn FsCacheReqHandler,
    ) -> io::Result<()> {
        self.inner.removemapping(ctx, inode, requests, vu_req)
    }

    fn access(&self, ctx: &Context, inode: Inode, mask: u32) -> io::Result<()> {
        self.inner.access(&self.ctx(ctx), inode, mask)
    }

    fn lseek(
        &self,
        ctx: &Context,
        inode: Inode,
        handle: Handle,
        offset: u64,
        whence: u32,
    ) -> io::Result<u64> {
        self.inner.lseek(ctx, inode, handle, offset, whence)
    }
}

/// The extended attributes whose values name ids.
enum XattrKind {
    Caps,
    Acl,
    Other,
}

fn xattr_kind(name: &CStr) -> XattrKind {
    match name.to_bytes() {
        b"security.capability" => XattrKind::Caps,
        b"system.posix_acl_access" | b"system.posix_acl_default" => XattrKind::Acl,
        _ => XattrKind::Other,
    }
}

impl ShareFs {
    fn getxattr_raw(
        &self,
        ctx: &Context,
        inode: Inode,
        name: &CStr,
        size: u32,
    ) -> io::Result<GetxattrReply> {
        let Some(n) = self.named(ctx, inode)? else {
            return self.inner.getxattr(ctx, inode, name, size);
        };
        let mut buf = vec![0u8; size.min(XATTR_MAX) as usize];
        let len = n.with(|file| {
            // SAFETY: `file` and `name` are NUL-terminated strings alive for the call; the
            // kernel writes at most `buf.len()` bytes into `buf` (nothing when it is empty).
            byte_count(unsafe {
                libc::getxattr(
                    file.as_ptr(),
                    name.as_ptr(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                )
            })
        })??;
        if size == 0 {
            return Ok(GetxattrReply::Count(len));
        }
        buf.truncate(len as usize);
        Ok(GetxattrReply::Value(buf))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kubelet's mapping for a pod: container ids 0..65536 are guest ids 100000.. .
    fn shift() -> IdShift {
        let r = IdRange {
            disk: 0,
            guest: 100_000,
            size: 65536,
        };
        IdShift { uid: r, gid: r }
    }

    #[test]
    fn owners_show_as_through_an_idmapped_mount() {
        let s = shift();
        // SAFETY: stat64 is plain old data; all-zero is a valid value.
        let mut st: stat64 = unsafe { std::mem::zeroed() };
        st.st_uid = 0;
        st.st_gid = 1000;
        s.stat_out(&mut st);
        assert_eq!((st.st_uid, st.st_gid), (100_000, 101_000));
        // An owner the mapping does not cover shows as a guest id outside it (so, in the
        // pod, as the overflow id), never as one of the pod's users.
        st.st_uid = 70_000;
        s.stat_out(&mut st);
        assert_eq!(st.st_uid, 99_999);
        assert!(
            IdRange {
                disk: 0,
                guest: 0,
                size: 10
            }
            .outside()
                == 10
        );
        assert!(s.check().is_ok());
        assert!(IdRange {
            disk: 0,
            guest: u32::MAX,
            size: 2
        }
        .check()
        .is_err());
        assert!(IdRange {
            disk: 0,
            guest: 1,
            size: 0
        }
        .check()
        .is_err());
        // The pod's root creates as root on disk; the guest's own root stays itself.
        let ctx = Context {
            uid: 100_000,
            gid: 100_005,
            pid: 1,
        };
        let c = s.ctx_in(&ctx);
        assert_eq!((c.uid, c.gid), (0, 5));
        let c = s.ctx_in(&Context {
            uid: 0,
            gid: 0,
            pid: 1,
        });
        assert_eq!((c.uid, c.gid), (0, 0));
        assert_eq!(s.uid.to_disk(165_536), 165_536);
        assert_eq!(s.uid.to_disk(165_535), 65_535);
    }

    #[test]
    fn file_capabilities_follow_the_root_id() {
        let s = shift();
        // v2 (the disk's root): the pod's root in the guest, as v3.
        let mut v2 = 0x0200_0001u32.to_le_bytes().to_vec();
        v2.extend_from_slice(&[7u8; 16]);
        let out = s.caps_out(&v2).unwrap();
        assert_eq!(out.len(), 24);
        assert_eq!(&out[..4], &0x0300_0001u32.to_le_bytes());
        assert_eq!(&out[4..20], &[7u8; 16]);
        assert_eq!(&out[20..], &100_000u32.to_le_bytes());
        // And back: for the disk's root, v2 again; for another root, v3 with its disk id.
        assert_eq!(s.caps_in(&out).unwrap(), v2);
        let mut other = out.clone();
        other[20..].copy_from_slice(&100_005u32.to_le_bytes());
        assert_eq!(&s.caps_in(&other).unwrap()[20..], &5u32.to_le_bytes());
        assert!(s.caps_out(&[1, 2, 3]).is_none());
    }

    #[test]
    fn posix_acls_name_users_and_groups_through_the_mapping() {
        let s = shift();
        let acl = |entries: &[(u16, u16, u32)]| {
            let mut v = POSIX_ACL_XATTR_VERSION.to_le_bytes().to_vec();
            for (tag, perm, id) in entries {
                v.extend_from_slice(&tag.to_le_bytes());
                v.extend_from_slice(&perm.to_le_bytes());
                v.extend_from_slice(&id.to_le_bytes());
            }
            v
        };
        const ACL_USER_OBJ: u16 = 0x01;
        const ACL_MASK: u16 = 0x10;
        let undefined = u32::MAX;
        // user::rwx, user:1000:r-x, group:33:rw-, mask::rwx, user:70000 (not in the mapping).
        let on_disk = acl(&[
            (ACL_USER_OBJ, 7, undefined),
            (ACL_USER, 5, 1000),
            (ACL_GROUP, 6, 33),
            (ACL_MASK, 7, undefined),
            (ACL_USER, 4, 70_000),
        ]);
        let seen = s.acl_out(&on_disk).unwrap();
        assert_eq!(
            seen,
            acl(&[
                (ACL_USER_OBJ, 7, undefined),
                (ACL_USER, 5, 101_000),
                (ACL_GROUP, 6, 100_033),
                (ACL_MASK, 7, undefined),
                (ACL_USER, 4, 99_999),
            ])
        );
        // What the pod writes is the disk's ids again.
        let written = acl(&[(ACL_USER, 5, 101_000), (ACL_GROUP, 6, 100_033)]);
        assert_eq!(
            s.acl_in(&written).unwrap(),
            acl(&[(ACL_USER, 5, 1000), (ACL_GROUP, 6, 33)])
        );
        // Not an ACL: refused, not passed on.
        assert!(s.acl_in(&[2, 0, 0, 0, 1]).is_none());
        assert!(s.acl_in(&[1, 0, 0, 0]).is_none());
        assert!(s.acl_out(&[]).is_none());
    }
}
