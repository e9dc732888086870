//! Pod user namespaces (CRI `userns_options` with mode POD) and idmapped mounts.
//!
//! A flat pod with a user namespace: the launcher makes the namespace with the pod's one
//! uid and one gid mapping, and, owned by it, the pod's net, uts, ipc and pid namespaces
//! (so that root in a container has its capabilities over the pod's network, hostname, IPC
//! and processes, and may mount sysfs, proc and mqueue there). The agent itself stays in
//! the host's user namespace (it mounts overlays and manages cgroups for the pod), holding
//! the pod's user namespace open; containers join it through `/proc/<agent>/fd/<n>`.
//!
//! What the containers see of the host's files is made to match with idmapped mounts: the
//! image layers under a container's overlay, and the volumes whose CRI mount carries the
//! pod's mappings (what kubelet sends for a pod without host users).

use std::fmt;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::OnceLock;

use nix::sched::CloneFlags;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::waitpid;
use nix::unistd::{fork, ForkResult, Pid};

/// One id mapping: `size` ids from `container` inside map to `host` outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdMap {
    pub container: u32,
    pub host: u32,
    pub size: u32,
}

impl IdMap {
    /// The host id of container id `id`, if mapped.
    pub fn to_host(&self, id: u32) -> Option<u32> {
        let off = id.checked_sub(self.container)?;
        (off < self.size).then(|| self.host + off)
    }

    /// Checks the mapping is one the kernel takes: a non-empty range that overflows neither
    /// side.
    pub fn check(&self) -> Result<(), String> {
        if self.size == 0 {
            return Err(format!("mapping {self}: length 0"));
        }
        if self.container.checked_add(self.size - 1).is_none()
            || self.host.checked_add(self.size - 1).is_none()
        {
            return Err(format!("mapping {self}: the range overflows 32 bits"));
        }
        Ok(())
    }
}

impl fmt::Display for IdMap {
    /// `container:host:size`, the form the command line takes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.container, self.host, self.size)
    }
}

impl FromStr for IdMap {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let [c, h, n] = parts.as_slice() else {
            return Err(format!("id mapping {s:?}: want container:host:size"));
        };
        let num = |v: &str| {
            v.parse::<u32>()
                .map_err(|e| format!("id mapping {s:?}: {v:?}: {e}"))
        };
        let m = IdMap {
            container: num(c)?,
            host: num(h)?,
            size: num(n)?,
        };
        m.check()?;
        Ok(m)
    }
}

/// Why a user namespace could not be made or used.
pub type UsernsError = crate::error::SysError;

use crate::error::{io, sys};

/// The pod's user namespace and its mappings, as the agent holds them.
#[derive(Debug)]
pub struct PodUserns {
    pub fd: OwnedFd,
    pub uid: IdMap,
    pub gid: IdMap,
    /// The pod's pid namespace holder (its PID 1, a child of the agent), as the agent's pid
    /// namespace numbers it.
    pub pid_holder: Option<u32>,
}

static POD: OnceLock<PodUserns> = OnceLock::new();
static FAILED: OnceLock<String> = OnceLock::new();

/// Records why the pod's user namespace could not be made (a VM agent carries on, and says
/// so to the first ConfigureSandbox).
pub fn set_failed(why: String) {
    let _ = FAILED.set(why);
}

/// Why the pod's user namespace could not be made, if it could not.
pub fn failed() -> Option<&'static str> {
    FAILED.get().map(String::as_str)
}

/// Records the pod's user namespace (once, when the agent starts).
pub fn set_pod(u: PodUserns) {
    let _ = POD.set(u);
}

/// The pod's user namespace, if the pod has one.
pub fn pod() -> Option<&'static PodUserns> {
    POD.get()
}

/// The pod's pid namespace holder, where the pod has its own user namespace: the process
/// (a child of the agent, numbered as the agent's pid namespace numbers it) whose
/// `/proc/<pid>/ns/*` are the pod's namespaces, all owned by that user namespace.
pub fn pod_holder() -> Option<u32> {
    pod().and_then(|u| u.pid_holder)
}

/// What [`create`] made.
#[derive(Debug)]
pub struct Created {
    /// The user namespace.
    pub user: OwnedFd,
    /// With CLONE_NEWPID: the new pid namespace's PID 1, a process that only holds it.
    pub pid_holder: Option<u32>,
}

/// Makes a user namespace with `uid` and `gid` as its only mappings and returns it open.
/// With `inside` flags, also makes those namespaces (net, uts, ipc, pid) owned by it; the
/// caller joins the net, uts and ipc ones. A pid namespace lives only while its PID 1 does,
/// and only a process of the user namespace can make one it owns: so its PID 1 is a holder
/// process that does nothing else, reparented to the caller (which must be a pid namespace's
/// PID 1 or a subreaper, so that its death takes the holder with it). A helper child
/// unshares; the caller, privileged in the host's user namespace, writes its maps. Must be
/// called while the process is single-threaded.
pub fn create(uid: IdMap, gid: IdMap, inside: CloneFlags) -> Result<Created, UsernsError> {
    let (to_parent_r, to_parent_w) = crate::stdio::pipe().map_err(io("pipe"))?;
    let (to_child_r, to_child_w) = crate::stdio::pipe().map_err(io("pipe"))?;
    // SAFETY: the caller is single-threaded (documented), so the child may run any code;
    // it only unshares, forks the holder, talks over the pipes and exits with _exit.
    match unsafe { fork() }.map_err(sys("fork"))? {
        ForkResult::Child => {
            drop(to_parent_r);
            drop(to_child_w);
            let code = helper(to_child_r, to_parent_w, inside);
            // SAFETY: _exit ends the forked child without running the parent's atexit
            // handlers or destructors.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => {
            drop(to_parent_w);
            drop(to_child_r);
            let mut holder = None;
            let res = drive(
                child,
                uid,
                gid,
                inside,
                to_parent_r,
                to_child_w,
                &mut holder,
            );
            let _ = kill(child, Signal::SIGKILL);
            let _ = waitpid(child, None);
            if let (Err(_), Some(h)) = (&res, holder) {
                let _ = kill(Pid::from_raw(h as i32), Signal::SIGKILL);
            }
            res
        }
    }
}

/// The helper child: unshare the user namespace, wait for its maps, unshare `inside` (and
/// fork the pid namespace's holder), wait to be killed. Each step's result goes to the
/// parent as an errno (0: done), then the holder's pid.
fn helper(from_parent: OwnedFd, to_parent: OwnedFd, inside: CloneFlags) -> i32 {
    let mut rx = std::fs::File::from(from_parent);
    let mut tx = std::fs::File::from(to_parent);
    let send = |tx: &mut std::fs::File, r: nix::Result<()>| {
        let code = r.err().map_or(0, |e| e as i32);
        tx.write_all(&code.to_ne_bytes()).is_ok() && code == 0
    };
    if !send(&mut tx, nix::sched::unshare(CloneFlags::CLONE_NEWUSER)) {
        return 1;
    }
    let mut go = [0u8; 1];
    if rx.read_exact(&mut go).is_err() || go[0] != 1 {
        return 1;
    }
    if !inside.is_empty() && !send(&mut tx, nix::sched::unshare(inside)) {
        return 1;
    }
    if inside.contains(CloneFlags::CLONE_NEWPID) && !fork_holder(&mut tx, HolderId::PodRoot) {
        return 1;
    }
    // Held until the parent has opened what it needs and kills us.
    let _ = rx.read(&mut go);
    0
}

/// Who a pid namespace holder becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HolderId {
    /// Root of the pod's user namespace (an unprivileged id on the host), dumpable: the
    /// containers open its namespaces from inside that user namespace.
    PodRoot,
    /// No user namespace: the host's uid and gid 65535, as Kubernetes' pause image runs;
    /// not dumpable (the agent, privileged, opens its namespace for the containers).
    Nobody,
}

/// In a single-threaded process that has unshared a pid namespace: forks its PID 1, the
/// holder ([`hold`]), and sends the holder's pid on `tx` (a negative errno if it could not
/// be made or could not drop its privileges). Answers whether it was made.
fn fork_holder(tx: &mut std::fs::File, who: HolderId) -> bool {
    let Ok((ok_r, ok_w)) = crate::stdio::pipe() else {
        let _ = tx.write_all(&(-(libc::EMFILE)).to_ne_bytes());
        return false;
    };
    // SAFETY: this process is single-threaded (a fork of a single-threaded caller).
    match unsafe { fork() } {
        Ok(ForkResult::Child) => hold(ok_w, who),
        Ok(ForkResult::Parent { child }) => {
            drop(ok_w);
            // The holder says it has dropped its privileges; one that could not is gone
            // (and its pid namespace with it), which the parent hears as EPERM.
            let mut ok = [0u8; 1];
            let held = std::fs::File::from(ok_r).read_exact(&mut ok).is_ok() && ok[0] == 1;
            let word = if held { child.as_raw() } else { -libc::EPERM };
            tx.write_all(&word.to_ne_bytes()).is_ok() && held
        }
        Err(e) => {
            let _ = tx.write_all(&(-(e as i32)).to_ne_bytes());
            false
        }
    }
}

/// The pid namespace of a flat pod's holder where the pod has no user namespace of its own
/// (see [`create_pid_holder`]), held open by the agent: containers join it through
/// `/proc/<agent>/fd/<n>`, never through the holder's pid, which a dead holder's successor
/// could have.
static PID_HOLDER_NS: OnceLock<OwnedFd> = OnceLock::new();

/// The pod's shared pid namespace (CRI `pid: POD`) where it is not the agent's own: the one
/// [`create_pid_holder`] made, as a path for the agent `agent_pid` (in a pod with its own
/// user namespace, the holder's namespaces are all the pod's: see [`pod_holder`]).
pub fn shared_pid_ns(agent_pid: u32) -> Option<PathBuf> {
    PID_HOLDER_NS
        .get()
        .map(|fd| PathBuf::from(format!("/proc/{agent_pid}/fd/{}", fd.as_raw_fd())))
}

/// A flat pod without its own user namespace: makes the pid namespace the pod's containers
/// share, whose PID 1 is a holder (an empty root, uid 65535, no capability; see [`hold`]),
/// as a pause container is PID 1 of containerd's. The agent itself is PID 1 of the pid
/// namespace above it, and its root is the host's: a container that may ptrace PID 1
/// (`kubectl debug --profile=general` adds SYS_PTRACE) would reach the host's files through
/// `/proc/1/root` were the agent PID 1 of the shared namespace. A helper child unshares the
/// pid namespace and forks the holder, which is then reparented to the caller: it must be
/// PID 1 of its pid namespace (or a subreaper), so that its death takes the holder and every
/// container in the namespace with it. Must be called while the process is single-threaded.
pub fn create_pid_holder() -> Result<u32, UsernsError> {
    let (rx, tx) = crate::stdio::pipe().map_err(io("pipe"))?;
    // SAFETY: the caller is single-threaded (documented), so the child may run any code; it
    // only unshares, forks the holder, writes to the pipe and exits with _exit.
    match unsafe { fork() }.map_err(sys("fork"))? {
        ForkResult::Child => {
            drop(rx);
            let mut tx = std::fs::File::from(tx);
            let r = nix::sched::unshare(CloneFlags::CLONE_NEWPID);
            let code = r.err().map_or(0, |e| e as i32);
            let sent = tx.write_all(&code.to_ne_bytes()).is_ok();
            let made = sent && code == 0 && fork_holder(&mut tx, HolderId::Nobody);
            // SAFETY: _exit ends the forked child without running the parent's atexit
            // handlers or destructors.
            unsafe { libc::_exit(if made { 0 } else { 1 }) }
        }
        ForkResult::Parent { child } => {
            drop(tx);
            let mut rx = std::fs::File::from(rx);
            let r = (|| {
                step(&mut rx, "unshare(CLONE_NEWPID)")?;
                let holder = read_word(&mut rx, "forking the pid namespace's holder")?;
                if holder <= 0 {
                    return Err(sys("forking the pid namespace's holder")(
                        nix::errno::Errno::from_raw(-holder),
                    ));
                }
                let ns = std::fs::File::open(format!("/proc/{holder}/ns/pid"))
                    .map(OwnedFd::from)
                    .map_err(io("opening the holder's pid namespace"));
                if ns.is_err() {
                    let _ = kill(Pid::from_raw(holder), Signal::SIGKILL);
                }
                Ok((holder as u32, ns?))
            })();
            let _ = waitpid(child, None);
            r.map(|(holder, ns)| {
                let _ = PID_HOLDER_NS.set(ns);
                holder
            })
        }
    }
}

/// One native-endian word from a helper: an errno, or a pid.
fn read_word(rx: &mut std::fs::File, what: &str) -> Result<i32, UsernsError> {
    let mut b = [0u8; 4];
    rx.read_exact(&mut b)
        .map_err(io(format!("{what}: the helper exited")))?;
    Ok(i32::from_ne_bytes(b))
}

/// A step a helper reports as an errno (0: done).
fn step(rx: &mut std::fs::File, what: &str) -> Result<(), UsernsError> {
    match read_word(rx, what)? {
        0 => Ok(()),
        e => Err(sys(what.to_string())(nix::errno::Errno::from_raw(e))),
    }
}

/// The pid namespace holder: PID 1 of the pod's pid namespace, reaping what is reparented
/// to it, holding nothing open. It is visible to a container sharing the pod's pid
/// namespace (which may ptrace it with CAP_SYS_PTRACE; in a pod with its own user
/// namespace the containers open its namespaces after joining that namespace, so it must
/// stay dumpable to them), and it was forked in the agent's mount namespace (the host's
/// files): so it moves into a mount namespace of its own whose only mount is an empty
/// read-only tmpfs (pivot_root, the old root detached: neither its root, its mount
/// namespace nor its mountinfo shows a host file), becomes `who` (an unprivileged id on the
/// host) and drops every capability: nothing a container could do through it is more than
/// it can do itself. It says so on `ok`; any step failing ends it, and with it the pod's
/// pid namespace, which the caller then hears.
fn hold(ok: OwnedFd, who: HolderId) -> ! {
    // /dev/null while there is a /dev.
    if let Ok(null) = crate::stdio::dev_null() {
        for fd in 0..3 {
            let _ = nix::unistd::dup2(null.as_raw_fd(), fd);
        }
    }
    retitle(b"vessel-pidns");
    if drop_privileges(who).is_err() {
        // SAFETY: _exit ends this forked child without running anyone's destructors.
        unsafe { libc::_exit(1) }
    }
    let _ = std::fs::File::from(ok).write_all(&[1]);
    close_inherited();
    // SAFETY: setting SIGCHLD's disposition to SIG_IGN (children are reaped by the kernel)
    // and naming the process take no pointers but the static name.
    unsafe {
        libc::signal(libc::SIGCHLD, libc::SIG_IGN);
        libc::prctl(libc::PR_SET_NAME, c"vessel-pidns".as_ptr(), 0, 0, 0);
    }
    loop {
        // SAFETY: pause(2) takes no arguments.
        unsafe { libc::pause() };
    }
}

/// Overwrites this process's command line (what `/proc/<pid>/cmdline` and `ps` show, which
/// was the agent's, naming host paths) with `title`, and empties its environment, in place:
/// the kernel reads them from areas of the process's stack whose bounds `/proc/self/stat`
/// gives.
fn retitle(title: &[u8]) {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return;
    };
    // Fields after the command name (which may hold spaces) start at the state, field 3;
    // arg_start and arg_end are fields 48 and 49.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<usize>().ok());
    // The argument area (fields 48, 49) gets the title; the environment's (50, 51), the
    // agent's, is emptied.
    for (first, text) in [(48, title), (50, &b""[..])] {
        let (Some(start), Some(end)) = (field(first), field(first + 1)) else {
            continue;
        };
        if end <= start || end - start <= text.len() {
            continue;
        }
        // SAFETY: [start, end) is this process's own argument or environment area (strings
        // on its stack, writable, owned by no Rust object: std reads argv only when asked,
        // and this forked child reads neither again); it is overwritten within its bounds,
        // NUL-padded.
        unsafe {
            let area = std::slice::from_raw_parts_mut(start as *mut u8, end - start);
            area.fill(0);
            area[..text.len()].copy_from_slice(text);
        }
    }
}

/// Closes every descriptor above stderr (close_range(2), or one by one from `/proc/self/fd`
/// on kernels before 5.9).
fn close_inherited() {
    // SAFETY: close_range(2) on descriptors this forked child no longer uses.
    let r = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if r == 0 {
        return;
    }
    let fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|fd| *fd > 2)
        .collect();
    for fd in fds {
        // SAFETY: closing a descriptor this process no longer uses (the directory's own,
        // gone by now, fails harmlessly).
        unsafe { libc::close(fd) };
    }
}

/// In the holder (single-threaded, root of its user namespace): a mount namespace whose
/// only mount is an empty tmpfs, then `who` with no capability and no new privileges.
fn drop_privileges(who: HolderId) -> Result<(), nix::Error> {
    use caps::{CapSet, Capability};
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    nix::sched::unshare(CloneFlags::CLONE_NEWNS)?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )?;
    // Over /proc (any directory that is there would do), in its own mount namespace only;
    // then it becomes the root and the old root, stacked on it, is detached with every
    // mount under it (pivot_root takes the old root's lock off).
    mount(
        Some("vessel-pidns"),
        "/proc",
        Some("tmpfs"),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("size=4k,mode=0555"),
    )?;
    nix::unistd::chdir("/proc")?;
    nix::unistd::pivot_root(".", ".")?;
    umount2(".", MntFlags::MNT_DETACH)?;
    nix::unistd::chdir("/")?;
    // The bounding set first: dropping from it takes CAP_SETPCAP, which a change to a
    // non-zero uid takes away.
    let fail = |_| nix::Error::EPERM;
    for c in caps::all() {
        if caps::has_cap(None, CapSet::Bounding, c).unwrap_or(false) {
            caps::drop(None, CapSet::Bounding, c).map_err(fail)?;
        }
    }
    let raw = match who {
        HolderId::PodRoot => 0,
        HolderId::Nobody => 65535,
    };
    let id = nix::unistd::Gid::from_raw(raw);
    nix::unistd::setresgid(id, id, id)?;
    nix::unistd::setgroups(&[])?;
    let id = nix::unistd::Uid::from_raw(raw);
    nix::unistd::setresuid(id, id, id)?;
    let none = std::collections::HashSet::<Capability>::new();
    caps::clear(None, CapSet::Ambient).map_err(fail)?;
    for set in [CapSet::Inheritable, CapSet::Effective, CapSet::Permitted] {
        caps::set(None, set, &none).map_err(fail)?;
    }
    nix::sys::prctl::set_no_new_privs()?;
    if who == HolderId::PodRoot {
        // The change of uid made it non-dumpable; the containers must open its namespaces.
        nix::sys::prctl::set_dumpable(true)?;
    }
    Ok(())
}

fn drive(
    child: Pid,
    uid: IdMap,
    gid: IdMap,
    inside: CloneFlags,
    from_child: OwnedFd,
    to_child: OwnedFd,
    holder_out: &mut Option<u32>,
) -> Result<Created, UsernsError> {
    let mut rx = std::fs::File::from(from_child);
    let mut tx = std::fs::File::from(to_child);
    step(&mut rx, "unshare(CLONE_NEWUSER)")?;
    let proc = PathBuf::from(format!("/proc/{child}"));
    for (file, m) in [("uid_map", uid), ("gid_map", gid)] {
        let line = format!("{} {} {}\n", m.container, m.host, m.size);
        std::fs::write(proc.join(file), line).map_err(io(format!("writing {file} ({m})")))?;
    }
    tx.write_all(&[1]).map_err(io("telling the helper"))?;
    let open = |name: &str| {
        std::fs::File::open(proc.join("ns").join(name))
            .map(OwnedFd::from)
            .map_err(io(format!("opening the helper's {name} namespace")))
    };
    let user = open("user")?;
    let mut created = Created {
        user,
        pid_holder: None,
    };
    if inside.is_empty() {
        return Ok(created);
    }
    step(
        &mut rx,
        &format!("unshare({inside:?}) in the user namespace"),
    )?;
    if inside.contains(CloneFlags::CLONE_NEWPID) {
        let holder = read_word(&mut rx, "forking the pid namespace's holder")?;
        if holder <= 0 {
            return Err(sys("forking the pid namespace's holder")(
                nix::errno::Errno::from_raw(-holder),
            ));
        }
        created.pid_holder = Some(holder as u32);
        *holder_out = created.pid_holder;
    }
    for (flag, name) in [
        (CloneFlags::CLONE_NEWNET, "net"),
        (CloneFlags::CLONE_NEWUTS, "uts"),
        (CloneFlags::CLONE_NEWIPC, "ipc"),
    ] {
        if inside.contains(flag) {
            let ns = open(name)?;
            nix::sched::setns(&ns, flag).map_err(sys(format!("joining the pod's {name}")))?;
        }
    }
    Ok(created)
}

/// Makes the detached mount tree `tree` (from `open_tree(OPEN_TREE_CLONE)`) idmapped
/// through the user namespace `userns`: a file whose owner on disk is `k` shows through the
/// mount as owned by the host id that `userns` maps container id `k` to, so a process in
/// `userns` sees the owners the files have on disk (root's files as its root's).
pub fn idmap_tree(
    tree: BorrowedFd<'_>,
    userns: BorrowedFd<'_>,
    recursive: bool,
) -> std::io::Result<()> {
    let attr = libc::mount_attr {
        attr_set: libc::MOUNT_ATTR_IDMAP,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    crate::mount_tree::setattr_tree(tree, &attr, recursive)
}

/// An idmapped clone of `src` (recursive for `rbind`), detached, ready to attach.
pub fn idmapped_clone(
    src: &Path,
    userns: BorrowedFd<'_>,
    recursive: bool,
) -> std::io::Result<OwnedFd> {
    let tree = crate::mount_tree::clone_tree(src, recursive)?;
    idmap_tree(tree.as_fd(), userns, recursive)?;
    Ok(tree)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_maps() {
        let m: IdMap = "0:1000:100000".parse().unwrap();
        assert_eq!(
            m,
            IdMap {
                container: 0,
                host: 1000,
                size: 100000
            }
        );
        assert_eq!(m.to_string(), "0:1000:100000");
        assert_eq!(m.to_host(0), Some(1000));
        assert_eq!(m.to_host(99_999), Some(100_999));
        assert_eq!(m.to_host(100_000), None);
        assert!("0:1000".parse::<IdMap>().is_err());
        assert!("0:1000:0".parse::<IdMap>().is_err());
        assert!("0:4294967295:2".parse::<IdMap>().is_err());
        assert!("x:1:1".parse::<IdMap>().is_err());
    }
}
