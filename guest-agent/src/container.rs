//! The agent's record of one container: its state, exit, stdio and log.

use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cgroups::Cgroup;
use crate::logs::LogFile;
use crate::proto::{ContainerInfo, ContainerState, ExitInfo};
use crate::reaper::ExitStatus;
use crate::rootfs::PreparedOverlay;

/// How long an exit waits for the container's output to drain into the log.
pub const OUTPUT_DRAIN: Duration = Duration::from_secs(2);

/// Lifecycle state.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    Created,
    Running,
    Exited(ExitInfo),
}

#[derive(Debug)]
struct Mutable {
    phase: Phase,
    started_at: i64,
    starting: bool,
}

/// A working directory to make at launch where it is missing, as runc makes it (kubelet
/// passes a pod's `workingDir` as it is; libcontainer fails the start).
#[derive(Debug, Clone)]
pub struct MakeCwd {
    pub cwd: PathBuf,
    /// Who owns what is made: the container's root as the host sees it.
    pub owner: (u32, u32),
    /// Under a volume's bind mount: made in the volume by the launch helper once the
    /// mount's source is staged, not in the root filesystem, where the mount hides it.
    pub in_volume: bool,
}

/// One container.
pub struct Container {
    pub id: String,
    /// `<state-dir>/containers/<id>`.
    pub dir: PathBuf,
    /// The rootfs directory libcontainer uses.
    pub rootfs: PathBuf,
    /// The overlay the agent mounts at `rootfs` when the container starts (and unmounts);
    /// `None` for a rootfs path given as is.
    pub overlay: Option<PreparedOverlay>,
    /// The overlay's upper directory, for writable-layer stats.
    pub upperdir: Option<PathBuf>,
    pub cgroup: Cgroup,
    pub log: Arc<LogFile>,
    /// The init's pid once the container was launched (at its start); 0 before.
    pid: AtomicI32,
    /// The init was reaped: its pid is free for another process, long before the exit is
    /// published (the rest of the cgroup is killed and the output drained first).
    reaped: std::sync::atomic::AtomicBool,
    /// A walk of the writable layer is under way ([`Container::layer_usage`]).
    walking: std::sync::atomic::AtomicBool,
    /// What the last walk of the writable layer found (bytes, inodes).
    last_usage: Mutex<(u64, u64)>,
    pub created_at: i64,
    /// Keeps the container's stdin open (`stdin: true`): the write end of its pipe, or the
    /// pty master.
    pub stdin: Mutex<Option<std::os::fd::OwnedFd>>,
    /// The container asked for a stdin (CRI `stdin`).
    pub want_stdin: bool,
    /// Created with a terminal (`stdin` is then the pty master).
    pub tty: bool,
    /// Close stdin when the first attached client is done with it.
    pub stdin_once: bool,
    state: Mutex<Mutable>,
    exit_tx: watch::Sender<Option<ExitInfo>>,
    /// Whether libcontainer's state and cgroups of this container are gone; held while they
    /// are being deleted (at exit, in the background, or by DeleteContainer).
    pub libct_deleted: tokio::sync::Mutex<bool>,
    /// Held while CRIU dumps the container (CheckpointContainer), until CRIU has ended
    /// however the call ended: its removal waits for it.
    pub dumping: Arc<tokio::sync::Mutex<()>>,
    /// CRIU images to restore the container's processes from at start (a restored
    /// checkpoint), instead of running its command.
    pub restore: Option<PathBuf>,
    /// The working directory to make at launch where it is missing.
    pub make_cwd: Option<MakeCwd>,
}

impl Container {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: String,
        dir: PathBuf,
        rootfs: PathBuf,
        overlay: Option<PreparedOverlay>,
        upperdir: Option<PathBuf>,
        cgroup: Cgroup,
        log: Arc<LogFile>,
        want_stdin: bool,
        tty: bool,
        stdin_once: bool,
        restore: Option<PathBuf>,
        make_cwd: Option<MakeCwd>,
    ) -> Arc<Container> {
        let (exit_tx, _) = watch::channel(None);
        Arc::new(Container {
            id,
            dir,
            rootfs,
            overlay,
            upperdir,
            cgroup,
            log,
            pid: AtomicI32::new(0),
            reaped: std::sync::atomic::AtomicBool::new(false),
            walking: std::sync::atomic::AtomicBool::new(false),
            last_usage: Mutex::new((0, 0)),
            created_at: crate::now_nanos(),
            stdin: Mutex::new(None),
            want_stdin,
            tty,
            stdin_once,
            state: Mutex::new(Mutable {
                phase: Phase::Created,
                started_at: 0,
                starting: false,
            }),
            exit_tx,
            libct_deleted: tokio::sync::Mutex::new(false),
            dumping: Arc::new(tokio::sync::Mutex::new(())),
            restore,
            make_cwd,
        })
    }

    /// The init's pid; 0 until the container was launched.
    pub fn pid(&self) -> i32 {
        self.pid.load(Ordering::Acquire)
    }

    /// The init's pid while it may be signalled: launched, and not yet reaped (a reaped
    /// init's pid may be another process's by now).
    pub fn live_pid(&self) -> Option<i32> {
        let pid = self.pid();
        (pid != 0 && !self.reaped.load(Ordering::Acquire)).then_some(pid)
    }

    /// The writable layer's usage by `walk`, one walk at a time: a call while one is under
    /// way (stats asked again before a big layer's walk ended) answers what the last walk
    /// found, rather than walking the same tree beside it.
    pub fn layer_usage(&self, walk: impl FnOnce() -> (u64, u64)) -> (u64, u64) {
        if self.walking.swap(true, Ordering::AcqRel) {
            return *self.last_usage.lock().unwrap_or_else(|e| e.into_inner());
        }
        let u = walk();
        *self.last_usage.lock().unwrap_or_else(|e| e.into_inner()) = u;
        self.walking.store(false, Ordering::Release);
        u
    }

    /// The reaper collected the init's exit.
    pub fn set_reaped(&self) {
        self.reaped.store(true, Ordering::Release);
    }

    /// Whether libcontainer created the container's processes (its start does that).
    pub fn launched(&self) -> bool {
        self.pid() != 0
    }

    /// Records the launched init and the write end of its stdin.
    pub fn set_launched(&self, pid: i32, stdin: Option<std::os::fd::OwnedFd>) {
        *self.stdin.lock().unwrap_or_else(|e| e.into_inner()) = stdin;
        self.pid.store(pid, Ordering::Release);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Mutable> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn phase(&self) -> Phase {
        self.lock().phase.clone()
    }

    pub fn is_exited(&self) -> bool {
        matches!(self.lock().phase, Phase::Exited(_))
    }

    pub fn is_running(&self) -> bool {
        matches!(self.lock().phase, Phase::Running)
    }

    /// Marks a start in progress; false if the container is not in the created state.
    pub fn begin_start(&self) -> Result<(), Phase> {
        let mut s = self.lock();
        if s.phase != Phase::Created || s.starting {
            return Err(if s.starting {
                Phase::Running
            } else {
                s.phase.clone()
            });
        }
        s.starting = true;
        Ok(())
    }

    /// Ends a start; `ok` moves a still-created container to running. A failed launch leaves
    /// nothing to start again: the container is then exited (code 128, as a runtime reports
    /// a start error).
    pub fn end_start(&self, ok: bool) {
        let mut s = self.lock();
        s.starting = false;
        if ok {
            s.started_at = crate::now_nanos();
            if s.phase == Phase::Created {
                s.phase = Phase::Running;
            }
        } else if !self.launched() && s.phase == Phase::Created {
            let info = ExitInfo {
                exit_code: 128,
                signal: 0,
                oom_killed: false,
                finished_at: crate::now_nanos(),
            };
            s.phase = Phase::Exited(info);
            drop(s);
            self.exit_tx.send_replace(Some(info));
        }
    }

    pub fn info(&self) -> ContainerInfo {
        let s = self.lock();
        let (state, exit) = match &s.phase {
            Phase::Created => (ContainerState::Created, None),
            Phase::Running => (ContainerState::Running, None),
            Phase::Exited(e) => (ContainerState::Exited, Some(*e)),
        };
        ContainerInfo {
            id: self.id.clone(),
            state: state as i32,
            pid: self.pid() as u32,
            created_at: self.created_at,
            started_at: s.started_at,
            exit,
        }
    }

    /// Waits for the exit (at once if it happened).
    pub async fn wait(&self) -> ExitInfo {
        let mut rx = self.exit_tx.subscribe();
        let r = rx.wait_for(|e| e.is_some()).await;
        match r {
            Ok(e) => e.expect("waited for Some"),
            // The sender lives as long as `self`; unreachable in practice.
            Err(_) => ExitInfo::default(),
        }
    }

    /// The exit of the init process: reads the OOM counter first (before anyone can delete
    /// the cgroup) and lets the output drain into the log. [`Container::publish_exit`] then
    /// makes it known.
    pub async fn exit_info(
        &self,
        status: ExitStatus,
        finished_at: i64,
        oom_before: u64,
        pumps: Vec<JoinHandle<()>>,
    ) -> ExitInfo {
        let oom_after = self.cgroup.oom_kill_count().unwrap_or(0);
        // Any OOM kill in the container's cgroup during its life, as containerd reports it
        // (its TaskOOM event): a worker the kernel killed under a shell or supervisor that
        // then exits on its own too.
        let oom_killed = oom_after > oom_before;
        let info = ExitInfo {
            exit_code: status.code,
            signal: status.signal,
            oom_killed,
            finished_at,
        };
        tracing::info!(id = %self.id, ?status, oom_killed, "container exited");
        let _ = tokio::time::timeout(OUTPUT_DRAIN, futures::future::join_all(pumps)).await;
        info
    }

    /// Makes the exit known: state, waiters, stdin closed.
    pub fn publish_exit(&self, info: ExitInfo) {
        {
            let mut s = self.lock();
            s.phase = Phase::Exited(info);
        }
        self.stdin.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.exit_tx.send_replace(Some(info));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stats asked while a walk of the writable layer is under way get the last walk's
    /// figures at once: walks of one layer do not pile up (kubelet asks every 10 s, and a
    /// big layer's walk may take longer).
    #[test]
    fn one_walk_of_a_layer_at_a_time() {
        let c = Container::new(
            "walks".into(),
            "/nonexistent".into(),
            "/nonexistent".into(),
            None,
            None,
            Cgroup::new(std::path::Path::new("vessel-unit-none/walks")),
            LogFile::open("").unwrap(),
            false,
            false,
            false,
            None,
            None,
        );
        assert_eq!(c.layer_usage(|| (1, 1)), (1, 1));
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            let c = &c;
            let walker = s.spawn(move || {
                c.layer_usage(|| {
                    started_tx.send(()).unwrap();
                    go_rx.recv().unwrap();
                    (5, 5)
                })
            });
            started_rx.recv().unwrap();
            assert_eq!(c.layer_usage(|| panic!("a second walk")), (1, 1));
            go_tx.send(()).unwrap();
            assert_eq!(walker.join().unwrap(), (5, 5));
        });
        assert_eq!(c.layer_usage(|| (7, 7)), (7, 7));
    }
}
