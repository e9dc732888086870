//! A pod's host process (a flat pod's agent, a VM pod's shim): liveness keyed on pid and
//! start time, waiting for its exit through a pidfd, reaping, killing. Both backends and the
//! runtime's watchers use these; nothing here knows which backend a process belongs to.

use std::path::Path;
use std::time::Duration;

use rustix::process::{Pid, Signal};

/// The last `n` non-empty lines of a file, joined with " | ", for error messages. A link is
/// not followed: a VM pod's directory is writable by its VMM.
pub fn log_tail(p: &Path, n: usize) -> String {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut s = String::new();
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(p)
    {
        if let Some(len) = f.metadata().ok().filter(|m| m.is_file()).map(|m| m.len()) {
            // The last MiB of a large log is enough.
            use std::io::Seek;
            let _ = f.seek(std::io::SeekFrom::Start(len.saturating_sub(1 << 20)));
            let mut data = Vec::new();
            let _ = f.read_to_end(&mut data);
            s = String::from_utf8_lossy(&data).into_owned();
        }
    }
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// Start time (clock ticks after boot) of a process, from /proc/<pid>/stat field 22.
pub fn process_start_time(pid: u32) -> Option<u64> {
    proc_stat(pid).map(|(_, _, start)| start)
}

/// The fields of /proc/<pid>/stat from field 3 (the state) on.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses: skip past its end.
    let rest = s.get(s.rfind(')')? + 2..)?;
    Some(rest.split_whitespace().map(str::to_string).collect())
}

/// The state, the kernel's flags and the start time of `pid` (fields 3, 9 and 22 of its stat).
fn proc_stat(pid: u32) -> Option<(char, u32, u64)> {
    let f = stat_fields(pid)?;
    let state = f.first()?.chars().next()?;
    Some((state, f.get(6)?.parse().ok()?, f.get(19)?.parse().ok()?))
}

/// The kernel's `PF_EXITING`: the process has begun to exit and cannot go back.
const PF_EXITING: u32 = 0x4;

/// The children of a process (a VM pod's shim has one: its jailed VMM): from
/// `/proc/<pid>/task/<tid>/children`, or where the kernel lacks it (CONFIG_PROC_CHILDREN),
/// from every process's parent (field 4 of `/proc/<p>/stat`).
pub fn children(pid: u32) -> Vec<u32> {
    // Each thread lists the children it started.
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for t in tasks.flatten() {
        match std::fs::read_to_string(t.path().join("children")) {
            Ok(s) => out.extend(s.split_whitespace().filter_map(|p| p.parse::<u32>().ok())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && t.path().exists() => {
                return children_by_parent(pid);
            }
            Err(_) => {}
        }
    }
    out
}

fn children_by_parent(pid: u32) -> Vec<u32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            stat_fields(*p)
                .and_then(|f| f.get(1)?.parse::<u32>().ok())
                .is_some_and(|parent| parent == pid)
        })
        .collect()
}

/// Whether `pid` is still the process that started at `start_time`, and neither a zombie (an
/// agent that exited is reparented to init, which on some hosts never reaps it) nor exiting.
/// An agent is PID 1 of its pod's pid namespace, and its exit waits for every process in that
/// namespace to die: for ever, if a container's cgroup is frozen, until the pod's teardown
/// thaws it. Such an agent has closed its files and is dead to us.
pub fn is_alive(pid: u32, start_time: u64) -> bool {
    pid != 0
        && matches!(proc_stat(pid), Some((state, flags, start))
            if state != 'Z' && state != 'X' && flags & PF_EXITING == 0 && start == start_time)
}

fn pid_of(pid: u32) -> Option<Pid> {
    Pid::from_raw(i32::try_from(pid).ok()?)
}

/// Waits until process `pid` (which started at `start_time`) exits, through a pidfd, which
/// works whether or not the process is our child. Returns at once if it is already gone.
pub async fn wait_exit(pid: u32, start_time: u64) {
    let Some(p) = pid_of(pid) else { return };
    let Ok(fd) = rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()) else {
        return;
    };
    if !is_alive(pid, start_time) {
        return;
    }
    // SAFETY: `fd` is an open pidfd that the AsyncFd owns (and so keeps open, the same
    // description) until it is dropped at the end of this function.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
    };
    // A pidfd turns readable when its process exits.
    match registered {
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
    if let Some(p) = pid_of(pid) {
        // Only that pid, only if it is our child, never blocking.
        let _ = rustix::process::waitpid(Some(p), rustix::process::WaitOptions::NOHANG);
    }
}

/// Makes this process a child subreaper: pod agents orphaned by their launcher become our
/// children, so we can reap them; they are reparented to init when vesseld exits.
pub fn become_subreaper() {
    if let Err(e) = rustix::process::set_child_subreaper(Some(rustix::process::getpid())) {
        tracing::warn!(error = %e, "cannot become a child subreaper");
    }
}

/// Sends `sig` to `pid` if it is still the process that started at `start_time` (reaping it
/// first if it is our exited child); returns whether it was.
pub fn signal(pid: u32, start_time: u64, sig: Signal) -> bool {
    reap(pid);
    match pid_of(pid).filter(|_| is_alive(pid, start_time)) {
        Some(p) => {
            let _ = rustix::process::kill_process(p, sig);
            true
        }
        None => false,
    }
}

/// SIGKILLs a pod's host process (flat agent or VM shim) if it is still ours, and reaps it.
/// As PID 1 of its pid namespace an agent's death takes every container process of the pod
/// with it; a shim's takes its VM.
pub fn kill(pid: u32, start_time: u64) {
    if !signal(pid, start_time, Signal::KILL) {
        return;
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

/// [`kill`] without blocking the caller's thread: waits for the exit on a pidfd.
pub async fn kill_async(pid: u32, start_time: u64) {
    if !signal(pid, start_time, Signal::KILL) {
        return;
    }
    if tokio::time::timeout(Duration::from_secs(1), wait_exit(pid, start_time))
        .await
        .is_err()
    {
        tracing::warn!(
            pid,
            "pod process (agent or VM shim) did not die within 1 s of SIGKILL"
        );
    }
    reap(pid);
}

/// Kills a pod's host process (agent or VM shim): by its recorded pid and start time, or,
/// when the pid was never recorded, by the `flag value` on its command line (a scan of /proc,
/// reading every process's command line: not for every pod stop).
pub async fn kill_pod_process(pid: u32, start_time: u64, flag: &str, value: &Path) {
    if pid != 0 {
        kill_async(pid, start_time).await;
    } else {
        kill_by_arg(flag, value);
    }
}

/// Stops a process gently: SIGTERM, then SIGKILL after `grace`. Idempotent.
pub async fn terminate(pid: u32, start_time: u64, grace: Duration) {
    if !signal(pid, start_time, Signal::TERM) {
        return;
    }
    let _ = tokio::time::timeout(grace, wait_exit(pid, start_time)).await;
    kill_async(pid, start_time).await;
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
                kill(pid, st);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_children_are_found_both_ways() {
        let mut c = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let me = std::process::id();
        assert!(children(me).contains(&c.id()));
        assert!(children_by_parent(me).contains(&c.id()));
        c.kill().unwrap();
        c.wait().unwrap();
        assert!(!children(me).contains(&c.id()));
    }

    #[test]
    fn a_log_tail_is_the_last_lines_and_never_through_a_link() {
        let (d, log) = crate::testing::temp_path("shim.log");
        std::fs::write(&log, "a\n\nb\nc\n").unwrap();
        assert_eq!(log_tail(&log, 2), "b | c");
        let secret = d.path().join("secret");
        std::fs::write(&secret, "host only\n").unwrap();
        let link = d.path().join("console.log");
        std::os::unix::fs::symlink(&secret, &link).unwrap();
        assert_eq!(log_tail(&link, 2), "");
        assert_eq!(log_tail(&d.path().join("none"), 2), "");
    }

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
