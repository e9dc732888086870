//! The flat sandbox backend: the pod agent runs on the host as PID 1 of the pod's own
//! namespaces (`vessel-agent flat`), a session leader that outlives vesseld. Its network
//! namespace is pinned by bind-mounting `/proc/<pid>/ns/net` under `<run>/netns/`; there is
//! no pause process.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncBufReadExt;

/// How long an agent may take to say READY.
const READY_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug, thiserror::Error)]
pub enum FlatError {
    #[error("starting the pod agent {binary}: {source}")]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the pod agent failed to start: {0}")]
    Agent(String),
    #[error("the pod agent did not report ready within {0:?}")]
    Timeout(Duration),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Namespaces a pod shares with the node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostShare {
    pub net: bool,
    pub pid: bool,
    pub ipc: bool,
}

pub struct LaunchSpec<'a> {
    pub agent_binary: &'a Path,
    pub socket: &'a Path,
    pub state_dir: &'a Path,
    pub hostname: &'a str,
    pub share: HostShare,
    pub log_file: &'a Path,
    pub log_level: &'a str,
}

#[derive(Debug, Clone)]
pub struct Launched {
    pub pid: u32,
    pub start_time: u64,
}

/// Starts a flat pod agent and waits until it serves.
pub async fn launch(spec: &LaunchSpec<'_>) -> Result<Launched, FlatError> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(spec.log_file)
        .map_err(|source| FlatError::Io {
            op: "open",
            path: spec.log_file.to_path_buf(),
            source,
        })?;
    let mut cmd = tokio::process::Command::new(spec.agent_binary);
    cmd.arg("flat")
        .arg("--socket")
        .arg(spec.socket)
        .arg("--state-dir")
        .arg(spec.state_dir)
        .arg("--hostname")
        .arg(spec.hostname)
        .arg("--log-level")
        .arg(spec.log_level);
    let mut shared = Vec::new();
    if spec.share.net {
        shared.push("net");
    }
    if spec.share.pid {
        shared.push("pid");
    }
    if spec.share.ipc {
        shared.push("ipc");
    }
    if !shared.is_empty() {
        cmd.arg("--share-host").arg(shared.join(","));
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .env_remove("RUST_LOG")
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|source| FlatError::Spawn {
        binary: spec.agent_binary.to_path_buf(),
        source,
    })?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| FlatError::Agent("no stdout pipe".into()))?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(READY_TIMEOUT, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(pid) = line.strip_prefix("READY ") {
                return pid.trim().parse::<u32>().ok();
            }
        }
        None
    })
    .await;
    let pid = match ready {
        Ok(Some(pid)) => pid,
        Ok(None) => {
            let status = child.wait().await.ok();
            return Err(FlatError::Agent(format!(
                "launcher exited ({}) without READY; see {}: {}",
                status.map(|s| s.to_string()).unwrap_or_default(),
                spec.log_file.display(),
                log_tail(spec.log_file, 5)
            )));
        }
        Err(_) => {
            let _ = child.kill().await;
            kill_agents_by_socket(spec.socket);
            return Err(FlatError::Timeout(READY_TIMEOUT));
        }
    };
    // The launcher exits once the agent serves; reap it.
    let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
    let start_time = process_start_time(pid).ok_or_else(|| {
        FlatError::Agent(format!(
            "agent pid {pid} vanished right after READY: {}",
            log_tail(spec.log_file, 5)
        ))
    })?;
    Ok(Launched { pid, start_time })
}

/// The last `n` non-empty lines of a file, joined with " | ", for error messages.
pub fn log_tail(p: &Path, n: usize) -> String {
    let s = std::fs::read_to_string(p).unwrap_or_default();
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// Start time (clock ticks after boot) of a process, from /proc/<pid>/stat field 22.
pub fn process_start_time(pid: u32) -> Option<u64> {
    proc_stat(pid).map(|(_, start)| start)
}

/// State letter (field 3) and start time (field 22) from /proc/<pid>/stat.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses: skip past its end.
    let mut f = s.get(s.rfind(')')? + 2..)?.split_whitespace();
    let state = f.next()?.chars().next()?;
    Some((state, f.nth(18)?.parse().ok()?))
}

/// Whether `pid` is still the process that started at `start_time`, and not a zombie (an
/// agent that exited is reparented to init, which on some hosts never reaps it).
pub fn is_alive(pid: u32, start_time: u64) -> bool {
    pid != 0
        && matches!(proc_stat(pid), Some((state, start)) if state != 'Z' && state != 'X' && start == start_time)
}

/// Waits until process `pid` (which started at `start_time`) exits, through a pidfd, which
/// works whether or not the process is our child. Returns at once if it is already gone.
pub async fn wait_exit(pid: u32, start_time: u64) {
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 || !is_alive(pid, start_time) {
        if fd >= 0 {
            // SAFETY: fd is the pidfd just opened and owned by nobody else.
            drop(unsafe {
                <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32)
            });
        }
        return;
    }
    // SAFETY: fd is the pidfd just opened and owned by nobody else.
    let owned = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
    // SAFETY: `owned` is an open pidfd that the AsyncFd owns (and so keeps open, the same
    // description) until it is dropped at the end of this function.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE)
    };
    match registered {
        // A pidfd turns readable when its process exits.
        Ok(afd) => {
            let _ = afd.readable().await;
        }
        Err(_) => {
            while is_alive(pid, start_time) {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// Reaps `pid` if it is our (zombie) child; agents become vesseld's children when their
/// launcher exits, because vesseld is a child subreaper.
pub fn reap(pid: u32) {
    if pid == 0 {
        return;
    }
    let mut status = 0;
    // SAFETY: waitpid(2) with WNOHANG on one pid and a valid status pointer; it only reaps
    // that pid, and only if it is our child.
    unsafe {
        libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG);
    }
}

/// Makes this process a child subreaper: pod agents orphaned by their launcher become our
/// children, so we can reap them; they are reparented to init when vesseld exits.
pub fn become_subreaper() {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) takes no pointers.
    let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if r != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot become a child subreaper");
    }
}

/// SIGKILLs a pod's host process (flat agent or VM shim) if it is still ours, and reaps it.
/// As PID 1 of its pid namespace an agent's death takes every container process of the pod
/// with it; a shim's takes its VM.
pub fn kill_agent(pid: u32, start_time: u64) {
    reap(pid);
    if is_alive(pid, start_time) {
        // SAFETY: kill(2) on a pid we verified (by start time) to be our agent.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        }
        for _ in 0..400 {
            reap(pid);
            if !is_alive(pid, start_time) {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        tracing::warn!(
            pid,
            "pod process (agent or VM shim) did not die within 1 s of SIGKILL"
        );
    }
}

/// Kills any agent process serving `socket` (for cleanup when the pid is unknown).
pub fn kill_agents_by_socket(socket: &Path) {
    kill_by_arg("--socket", socket);
}

/// Kills any process whose command line has `flag value` (a pod agent's `--socket`, a VM
/// shim's `--spec`): cleanup of a pod whose host process's pid was never recorded.
pub fn kill_by_arg(flag: &str, value: &Path) {
    let want = value.as_os_str().as_encoded_bytes();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let serves = args
            .windows(2)
            .any(|w| w[0] == flag.as_bytes() && w[1] == want);
        if serves {
            if let Some(st) = process_start_time(pid) {
                tracing::info!(pid, %flag, value = %value.display(), "killing leftover pod process");
                kill_agent(pid, st);
            }
        }
    }
}

/// Pins the agent's network namespace at `path` with a bind mount.
pub fn pin_netns(pid: u32, path: &Path) -> Result<(), FlatError> {
    let io = |op: &'static str| {
        let path = path.to_path_buf();
        move |source: std::io::Error| FlatError::Io { op, path, source }
    };
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(io("create"))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io("create"))?;
    let src = format!("/proc/{pid}/ns/net");
    rustix::mount::mount_bind(src.as_str(), path).map_err(|e| io("bind-mount netns")(e.into()))
}

/// Unmounts and removes a netns pin. Missing is fine.
pub fn unpin_netns(path: &Path) -> Result<(), FlatError> {
    if path.as_os_str().is_empty() {
        return Ok(());
    }
    loop {
        match rustix::mount::unmount(path, rustix::mount::UnmountFlags::DETACH) {
            Ok(()) => continue, // stacked pins: unmount them all
            Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => break,
            Err(e) => {
                return Err(FlatError::Io {
                    op: "unmount netns",
                    path: path.to_path_buf(),
                    source: e.into(),
                })
            }
        }
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(FlatError::Io {
            op: "remove",
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// cgroupfs directories named `rel` under every mounted hierarchy (v1 controllers and v2).
pub fn cgroup_dirs(rel: &str) -> Vec<PathBuf> {
    let rel = rel.trim_start_matches('/');
    let mut out = Vec::new();
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return out;
    };
    for l in info.lines() {
        let parts: Vec<&str> = l.split(' ').collect();
        let Some(sep) = parts.iter().position(|p| *p == "-") else {
            continue;
        };
        let fstype = parts.get(sep + 1).copied().unwrap_or("");
        if fstype == "cgroup" || fstype == "cgroup2" {
            if let Some(mp) = parts.get(4) {
                out.push(Path::new(mp).join(rel));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Removes the cgroup `rel` (and its empty children, deepest first) from every hierarchy.
pub fn remove_cgroup(rel: &str) {
    for dir in cgroup_dirs(rel) {
        if !dir.exists() {
            continue;
        }
        let mut dirs = vec![];
        let mut stack = vec![dir.clone()];
        while let Some(d) = stack.pop() {
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                        stack.push(e.path());
                    }
                }
            }
            dirs.push(d);
        }
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for d in dirs {
            if let Err(e) = std::fs::remove_dir(&d) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(cgroup = %d.display(), error = %e, "cannot remove cgroup");
                }
            }
        }
    }
}

/// Applies `net.*` sysctls inside the pod's network namespace (pinned at `netns`), from a
/// thread that joins it: they are per network namespace and belong to the pod, not to a
/// container.
pub fn apply_net_sysctls(
    netns: &Path,
    sysctls: &std::collections::HashMap<String, String>,
) -> Result<(), FlatError> {
    let net: Vec<(String, String)> = sysctls
        .iter()
        .filter(|(k, _)| k.starts_with("net."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if net.is_empty() {
        return Ok(());
    }
    for (k, _) in &net {
        let ok = k.split(['.', '/']).all(|p| {
            !p.is_empty()
                && p != ".."
                && p.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
        });
        if !ok {
            return Err(FlatError::Agent(format!("invalid sysctl name {k:?}")));
        }
    }
    let ns = std::fs::File::open(netns).map_err(|source| FlatError::Io {
        op: "open netns",
        path: netns.to_path_buf(),
        source,
    })?;
    let netns = netns.to_path_buf();
    std::thread::spawn(move || -> Result<(), FlatError> {
        use std::os::fd::AsRawFd;
        // SAFETY: setns(2) on this thread only, with a valid open namespace fd; the thread
        // exits right after, so no other code runs in the pod's network namespace.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(FlatError::Io {
                op: "setns",
                path: netns,
                source: std::io::Error::last_os_error(),
            });
        }
        for (k, v) in net {
            let p = PathBuf::from("/proc/sys").join(k.replace('.', "/"));
            std::fs::write(&p, v.as_bytes()).map_err(|source| FlatError::Io {
                op: "write sysctl",
                path: p.clone(),
                source,
            })?;
        }
        Ok(())
    })
    .join()
    .map_err(|_| FlatError::Agent("sysctl thread panicked".into()))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn liveness_is_keyed_on_pid_and_start_time() {
        let me = std::process::id();
        let start = process_start_time(me).expect("our own start time");
        assert!(is_alive(me, start));
        assert!(!is_alive(me, start + 1));
        assert!(!is_alive(0, start));
        assert_eq!(process_start_time(u32::MAX), None);
    }
}
