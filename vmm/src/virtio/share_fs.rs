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
//! Here the four xattr requests name the inode by its path instead, which the filesystem reads
//! from its `/proc/self/fd` directory (opened before the thread was confined) and which the
//! kernel writes relative to the reading thread's root, the shared directory. They use the
//! `l*xattr` calls: the inode itself, a symbolic link included, as the passthrough
//! filesystem's magic-link path does. A path that changes (a rename) between the two calls
//! names another file in the same share, never one outside it: the thread's root is the share.
//! An inode whose last name was removed has no path (`... (deleted)`), and its xattr requests
//! fail with ENOENT as before. Every other request goes to the passthrough filesystem as is.

use std::any::Any;
use std::ffi::{CStr, CString};
use std::io;
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

/// The passthrough filesystem, and whether its thread is confined to the share (a root
/// without `/proc`); unconfined, its own xattr requests work and are left to it.
pub struct ShareFs {
    inner: PassthroughFs<()>,
    confined: bool,
}

impl ShareFs {
    pub fn new(inner: PassthroughFs<()>, confined: bool) -> ShareFs {
        ShareFs { inner, confined }
    }

    /// The inode's path from the thread's root.
    fn path(&self, inode: Inode) -> io::Result<CString> {
        let p = self.inner.readlinkat_proc_file(inode)?;
        if !p.is_absolute() {
            // Not a name in the tree (an anonymous inode): nothing to ask by path.
            return Err(io::Error::from_raw_os_error(libc::ENOENT));
        }
        CString::new(p.into_os_string().into_vec())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
    }
}

/// `r` (a byte count from an xattr call) as a result.
fn xattr_result(r: libc::ssize_t) -> io::Result<u32> {
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    u32::try_from(r).map_err(|_| io::Error::from_raw_os_error(libc::E2BIG))
}

/// `r` (a status from an xattr call) as a result.
fn status(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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
        if !self.confined {
            return self.inner.setxattr(ctx, inode, name, value, flags);
        }
        let path = self.path(inode)?;
        let flags =
            libc::c_int::try_from(flags).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: `path` and `name` are NUL-terminated strings and `value` a slice of
        // `value.len()` bytes, all alive for the call; nothing is written.
        let r = unsafe {
            libc::lsetxattr(
                path.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                flags,
            )
        };
        status(r)
    }

    fn getxattr(
        &self,
        ctx: &Context,
        inode: Inode,
        name: &CStr,
        size: u32,
    ) -> io::Result<GetxattrReply> {
        if !self.confined {
            return self.inner.getxattr(ctx, inode, name, size);
        }
        let path = self.path(inode)?;
        let mut buf = vec![0u8; size as usize];
        // SAFETY: `path` and `name` are NUL-terminated strings alive for the call; the kernel
        // writes at most `buf.len()` bytes into `buf` (nothing when it is empty).
        let r = unsafe {
            libc::lgetxattr(
                path.as_ptr(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        let n = xattr_result(r)?;
        if size == 0 {
            return Ok(GetxattrReply::Count(n));
        }
        buf.truncate(n as usize);
        Ok(GetxattrReply::Value(buf))
    }

    fn listxattr(&self, ctx: &Context, inode: Inode, size: u32) -> io::Result<ListxattrReply> {
        if !self.confined {
            return self.inner.listxattr(ctx, inode, size);
        }
        let path = self.path(inode)?;
        let mut buf = vec![0u8; size as usize];
        // SAFETY: `path` is a NUL-terminated string alive for the call; the kernel writes at
        // most `buf.len()` bytes into `buf` (nothing when it is empty).
        let r = unsafe { libc::llistxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        let n = xattr_result(r)?;
        if size == 0 {
            return Ok(ListxattrReply::Count(n));
        }
        buf.truncate(n as usize);
        Ok(ListxattrReply::Names(buf))
    }

    fn removexattr(&self, ctx: &Context, inode: Inode, name: &CStr) -> io::Result<()> {
        if !self.confined {
            return self.inner.removexattr(ctx, inode, name);
        }
        let path = self.path(inode)?;
        // SAFETY: `path` and `name` are NUL-terminated strings alive for the call.
        let r = unsafe { libc::lremovexattr(path.as_ptr(), name.as_ptr()) };
        status(r)
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
