//! Stop signals that a container's init would lose.
//!
//! The kernel drops a signal sent from an ancestor namespace to a pid namespace's init unless
//! the init has a handler for it (SIGKILL and SIGSTOP aside). A container whose entrypoint
//! installs its SIGTERM handler a moment after exec (a pause process, a shell script's `trap`)
//! therefore loses a StopContainer that comes right after StartContainer, and only the SIGKILL
//! at the end of the grace period stops it. runc has the same window; the agent closes it: when
//! the init had no handler at the time of sending, it watches the init's caught-signal mask and
//! sends once more as soon as a handler appears.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::container::Container;

/// A signal number as kill(2) takes it: a classic one, or a real-time one (`SIGRTMIN+3`,
/// which systemd-based images stop with), which nix's `Signal` has not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SigNum(i32);

impl SigNum {
    pub const KILL: SigNum = SigNum(libc::SIGKILL);
    pub const STOP: SigNum = SigNum(libc::SIGSTOP);

    /// `n` where it is a signal number of Linux's (1 to 64).
    pub fn new(n: i32) -> Option<SigNum> {
        (1..=64).contains(&n).then_some(SigNum(n))
    }
}

impl From<Signal> for SigNum {
    fn from(s: Signal) -> SigNum {
        SigNum(s as i32)
    }
}

/// kill(2) of `pid` with `sig`.
pub fn kill(pid: i32, sig: impl Into<SigNum>) -> nix::Result<()> {
    // SAFETY: kill(2) takes any pid and signal number and touches no memory of ours.
    let r = unsafe { libc::kill(pid, sig.into().0) };
    nix::errno::Errno::result(r).map(drop)
}

/// How long the agent watches for a handler before giving up (the SIGKILL will come).
const WATCH_FOR: Duration = Duration::from_secs(300);

/// What `/proc/<pid>/status` says about one signal for one process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Disposition {
    /// The process is the init (pid 1) of its innermost pid namespace.
    pub ns_init: bool,
    /// A handler is installed for the signal.
    pub caught: bool,
    /// The signal is ignored.
    pub ignored: bool,
}

impl Disposition {
    /// Parses a `/proc/<pid>/status` text for `sig`; `None` if the fields are missing.
    pub fn parse(status: &str, sig: impl Into<SigNum>) -> Option<Disposition> {
        let bit = 1u64 << (sig.into().0 - 1);
        let mut ns_init = None;
        let mut caught = None;
        let mut ignored = None;
        for line in status.lines() {
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            match key {
                "NSpid" => ns_init = value.split_whitespace().last().map(|p| p == "1"),
                "SigCgt" => caught = u64::from_str_radix(value, 16).ok().map(|m| m & bit != 0),
                "SigIgn" => ignored = u64::from_str_radix(value, 16).ok().map(|m| m & bit != 0),
                _ => {}
            }
        }
        Some(Disposition {
            ns_init: ns_init?,
            caught: caught?,
            ignored: ignored?,
        })
    }

    /// Reads it for a live process; `None` if the process is gone or the file unreadable.
    pub fn read(proc_root: &Path, pid: i32, sig: SigNum) -> Option<Disposition> {
        let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("status")).ok()?;
        Disposition::parse(&text, sig)
    }

    /// Whether the kernel would drop `sig` sent to this process from outside its namespace.
    pub fn drops(self) -> bool {
        self.ns_init && !self.caught && !self.ignored
    }
}

/// Whether `sig` is one a handler can be installed for (the rest always reach an init).
fn catchable(sig: SigNum) -> bool {
    sig != SigNum::KILL && sig != SigNum::STOP
}

/// Sends `sig` to the container's init; if the kernel would have dropped it (no handler yet),
/// a background task sends it again once the init installs one. Errors as `kill(2)`'s.
pub fn send_to_init(c: &Arc<Container>, sig: SigNum) -> nix::Result<()> {
    let Some(pid) = c.live_pid() else {
        return Err(nix::errno::Errno::ESRCH);
    };
    let before = catchable(sig)
        .then(|| Disposition::read(Path::new("/proc"), pid, sig))
        .flatten();
    kill(pid, sig)?;
    if before.is_some_and(Disposition::drops) {
        tracing::debug!(container = %c.id, pid, ?sig, "init has no handler yet; watching for one");
        let c = Arc::clone(c);
        tokio::spawn(async move { resend_when_caught(c, sig).await });
    }
    Ok(())
}

async fn resend_when_caught(c: Arc<Container>, sig: SigNum) {
    let deadline = tokio::time::Instant::now() + WATCH_FOR;
    let mut every = Duration::from_millis(20);
    while tokio::time::Instant::now() < deadline {
        tokio::select! {
            _ = c.wait() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let Some(pid) = c.live_pid() else {
            return;
        };
        let Some(now) = Disposition::read(Path::new("/proc"), pid, sig) else {
            return;
        };
        if now.caught {
            tracing::debug!(container = %c.id, pid, ?sig, "init installed a handler; sending again");
            let _ = kill(pid, sig);
            return;
        }
        if now.ignored {
            return;
        }
        every = (every * 2).min(Duration::from_millis(500));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tpause\nNSpid:\t4242\t1\nSigBlk:\t0000000000000000\n\
        SigIgn:\t0000000000000000\nSigCgt:\t0000000000004002\n";

    #[test]
    fn parses_the_caught_mask_per_signal() {
        // 0x4002: SIGINT (2) and SIGTERM (15).
        let term = Disposition::parse(STATUS, Signal::SIGTERM).unwrap();
        assert!(term.ns_init && term.caught && !term.ignored && !term.drops());
        let hup = Disposition::parse(STATUS, Signal::SIGHUP).unwrap();
        assert!(!hup.caught && hup.drops());
        let usr1 = Disposition::parse(
            &STATUS.replace("SigIgn:\t0000000000000000", "SigIgn:\t0000000000000200"),
            Signal::SIGUSR1,
        )
        .unwrap();
        assert!(usr1.ignored && !usr1.drops());
    }

    #[test]
    fn only_a_namespace_init_drops() {
        let child = STATUS.replace("NSpid:\t4242\t1", "NSpid:\t4243\t7");
        let d = Disposition::parse(&child, Signal::SIGHUP).unwrap();
        assert!(!d.ns_init && !d.drops());
        let host = STATUS.replace("NSpid:\t4242\t1", "NSpid:\t4242");
        assert!(!Disposition::parse(&host, Signal::SIGHUP).unwrap().ns_init);
        assert_eq!(Disposition::parse("Name:\tx\n", Signal::SIGTERM), None);
    }

    #[test]
    fn reads_this_process() {
        let me = i32::try_from(std::process::id()).unwrap();
        assert!(Disposition::read(Path::new("/proc"), me, Signal::SIGTERM.into()).is_some());
        assert!(!catchable(Signal::SIGKILL.into()) && catchable(Signal::SIGTERM.into()));
    }

    /// An init the reaper collected is not signalled: its pid may be another process's
    /// before the container's exit is published (the cgroup's rest is killed first).
    #[test]
    fn a_reaped_init_is_not_signalled() {
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = i32::try_from(other.id()).unwrap();
        let c = Container::new(
            "reaped".into(),
            "/nonexistent".into(),
            "/nonexistent".into(),
            None,
            None,
            crate::cgroups::Cgroup::new(Path::new("vessel-unit-none/reaped")),
            crate::logs::LogFile::open("").unwrap(),
            false,
            false,
            false,
            None,
            None,
        );
        c.set_launched(pid, None);
        c.set_reaped();
        assert_eq!(
            send_to_init(&c, SigNum::KILL),
            Err(nix::errno::Errno::ESRCH)
        );
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            other.try_wait().unwrap().is_none(),
            "the pid's new owner was killed"
        );
        other.kill().unwrap();
        other.wait().unwrap();
    }

    /// Real-time signals (SIGRTMIN+3 = 37, systemd's stop signal) are signals too: the
    /// agent refused them, and the stop waited for its SIGKILL.
    #[test]
    fn real_time_signals() {
        assert_eq!(SigNum::new(0), None);
        assert_eq!(SigNum::new(65), None);
        let rt3 = SigNum::new(37).unwrap();
        assert!(catchable(rt3) && SigNum::new(64).is_some());
        let caught = STATUS.replace("SigCgt:\t0000000000004002", "SigCgt:\t0000001000000000");
        let d = Disposition::parse(&caught, rt3).unwrap();
        assert!(d.caught && !d.drops());
        assert!(!Disposition::parse(STATUS, rt3).unwrap().caught);
        // Sent to a child that waits for it.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        kill(pid, rt3).unwrap();
        let st = child.wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&st), Some(37));
    }
}
