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
//! filesystem as is.

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
    pub fn new(inner: PassthroughFs<()>, proc_fd: Option<File>) -> ShareFs {
        ShareFs { inner, proc_fd }
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
        self.inner.mount()
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
        self.inner.lookup(ctx, parent, name)
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
        self.inner.getattr(ctx, inode, handle)
    }

    fn setattr(
        &self,
        ctx: &Context,
        inode: Inode,
        attr: stat64,
        handle: Option<Handle>,
        valid: SetattrValid,
    ) -> io::Result<(stat64, Duration)> {
        self.inner.setattr(ctx, inode, attr, handle, valid)
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
        self.inner.symlink(ctx, linkname, parent, name)
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
        self.inner.mknod(ctx, parent, name, mode, rdev, umask)
    }

    fn mkdir(
        &self,
        ctx: &Context,
        parent: Inode,
        name: &CStr,
        mode: u32,
        umask: u32,
    ) -> io::Result<Entry> {
        self.inner.mkdir(ctx, parent, name, mode, umask)
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
        self.inner.link(ctx, inode, newparent, newname)
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
        self.inner.create(ctx, parent, name, args)
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
        self.inner
            .readdirplus(ctx, inode, handle, size, offset, add_entry)
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
        self.inner.access(ctx, inode, mask)
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
