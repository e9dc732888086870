//! Reaping: as PID 1 (or a child subreaper) the agent waits for every child.
//!
//! A single task answers SIGCHLD with a `waitpid(-1, WNOHANG)` loop. Processes the agent
//! cares about (helpers it spawned, container init processes, which are reparented to the
//! agent when libcontainer's intermediate process exits) are registered with a one-shot
//! channel; everything else is reaped and ignored. Nothing else in the agent may call
//! `wait*`: `std::process::Child::wait` and `tokio::process` are not used.
//!
//! Spawning happens under the table lock ([`Reaper::spawn`]) so that a child cannot be reaped
//! before it is registered. Container init pids are learnt from a helper after the fact, so
//! exits of unregistered pids are kept for a short while ([`UNCLAIMED_TTL`]) and handed to a
//! later [`Reaper::watch`] of the same pid.

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::sync::oneshot;

/// How long the exit of an unregistered pid is remembered.
pub const UNCLAIMED_TTL: Duration = Duration::from_secs(10);

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    /// The exit code, or 128+signal if a signal ended it.
    pub code: i32,
    /// The signal that ended it; 0 if it exited.
    pub signal: u32,
}

impl ExitStatus {
    fn from_wait(ws: WaitStatus) -> Option<(i32, ExitStatus)> {
        match ws {
            WaitStatus::Exited(pid, code) => Some((pid.as_raw(), ExitStatus { code, signal: 0 })),
            WaitStatus::Signaled(pid, sig, _) => Some((
                pid.as_raw(),
                ExitStatus {
                    code: 128 + sig as i32,
                    signal: sig as u32,
                },
            )),
            _ => None,
        }
    }
}

#[derive(Default)]
struct Inner {
    watchers: HashMap<i32, oneshot::Sender<ExitStatus>>,
    unclaimed: HashMap<i32, (ExitStatus, Instant)>,
}

/// The agent's process table.
#[derive(Default)]
pub struct Reaper {
    inner: Mutex<Inner>,
}

impl Reaper {
    pub fn new() -> Arc<Reaper> {
        Arc::new(Reaper::default())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Installs the SIGCHLD handler and starts the reaping task (needs a tokio runtime).
    pub fn start(self: &Arc<Self>) -> std::io::Result<()> {
        use tokio::signal::unix::{signal, SignalKind};
        let mut sigchld = signal(SignalKind::child())?;
        let me = Arc::clone(self);
        tokio::spawn(async move {
            me.reap();
            while sigchld.recv().await.is_some() {
                me.reap();
            }
        });
        // Catch anything that ended between startup and the handler's installation.
        self.reap();
        Ok(())
    }

    /// Reaps every child that has ended; never blocks.
    pub fn reap(&self) {
        let mut inner = self.lock();
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => break,
                Ok(ws) => {
                    let Some((pid, status)) = ExitStatus::from_wait(ws) else {
                        continue;
                    };
                    match inner.watchers.remove(&pid) {
                        Some(tx) => {
                            tracing::debug!(pid, ?status, "reaped");
                            let _ = tx.send(status);
                        }
                        None => {
                            tracing::trace!(pid, ?status, "reaped an unregistered process");
                            inner.unclaimed.insert(pid, (status, Instant::now()));
                        }
                    }
                }
                Err(Errno::EINTR) => continue,
                Err(Errno::ECHILD) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "waitpid");
                    break;
                }
            }
        }
        let now = Instant::now();
        inner
            .unclaimed
            .retain(|_, (_, at)| now.duration_since(*at) < UNCLAIMED_TTL);
    }

    /// Spawns `cmd` and registers its pid before any reaping can happen. The caller may take
    /// the child's pipes but must never `wait` on it (dropping a `Child` does not wait).
    pub fn spawn(
        &self,
        cmd: &mut Command,
    ) -> std::io::Result<(std::process::Child, oneshot::Receiver<ExitStatus>)> {
        let mut inner = self.lock();
        let child = cmd.spawn()?;
        let (tx, rx) = oneshot::channel();
        inner.watchers.insert(child.id() as i32, tx);
        Ok((child, rx))
    }

    /// Registers interest in the exit of `pid` (which must be, or become, our child).
    pub fn watch(&self, pid: i32) -> oneshot::Receiver<ExitStatus> {
        let mut inner = self.lock();
        let (tx, rx) = oneshot::channel();
        match inner.unclaimed.remove(&pid) {
            Some((status, _)) => {
                let _ = tx.send(status);
            }
            None => {
                inner.watchers.insert(pid, tx);
            }
        }
        rx
    }
}
