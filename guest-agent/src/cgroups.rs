//! Reading a container's cgroup (the one libcontainer created from `linux.cgroupsPath`, with
//! the cgroupfs managers): its processes, OOM-kill counter and resource usage.
//!
//! cgroup v1 (legacy or hybrid: controllers mounted one per directory, found through
//! `/proc/self/mountinfo`) and v2 (unified at `/sys/fs/cgroup`) are both handled. In hybrid
//! mode libcontainer uses the v1 hierarchies only, so that is what we read too.

use crate::proto::Pressure;
use std::path::{Path, PathBuf};

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// How long [`Cgroup::signal_all`] waits for a cgroup to freeze before it signals anyway (a
/// task in uninterruptible sleep, or a vfork parent, can hold a cgroup in FREEZING).
const FREEZE_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// A cgroup's freezer file.
enum Freezer {
    /// v1's `freezer.state`: THAWED, FREEZING or FROZEN.
    V1(PathBuf),
    /// v2's `cgroup.freeze` (0 or 1); `cgroup.events` says when it is done (`frozen 1`).
    V2(PathBuf),
}

impl Freezer {
    /// Whether the cgroup is frozen, or being frozen, at its own request.
    fn frozen(&self) -> bool {
        match self {
            Freezer::V1(f) => std::fs::read_to_string(f).is_ok_and(|s| s.trim() != "THAWED"),
            Freezer::V2(f) => std::fs::read_to_string(f).is_ok_and(|s| s.trim() == "1"),
        }
    }

    /// Asks the cgroup to freeze; true if asked (so it must be thawed).
    fn start_freeze(&self) -> bool {
        let (file, value) = match self {
            Freezer::V1(f) => (f, "FROZEN"),
            Freezer::V2(f) => (f, "1"),
        };
        std::fs::write(file, value).is_ok()
    }

    /// Whether every task of the cgroup is frozen.
    fn settled(&self) -> bool {
        match self {
            Freezer::V1(f) => std::fs::read_to_string(f).is_ok_and(|s| s.trim() == "FROZEN"),
            Freezer::V2(f) => f
                .parent()
                .map(|d| d.join("cgroup.events"))
                .and_then(|e| std::fs::read_to_string(e).ok())
                .is_some_and(|e| e.lines().any(|l| l == "frozen 1")),
        }
    }

    fn thaw(&self) {
        let (file, value) = match self {
            Freezer::V1(f) => (f, "THAWED"),
            Freezer::V2(f) => (f, "0"),
        };
        if let Err(e) = std::fs::write(file, value) {
            tracing::warn!(file = %file.display(), error = %e, "cannot thaw a cgroup");
        }
    }
}

/// A container's cgroup directories.
#[derive(Debug, Clone)]
pub struct Cgroup {
    /// The cgroup path relative to each hierarchy's root.
    rel: PathBuf,
    unified: bool,
}

/// The new `cpu.max` (`"<quota|max> <period>"`) for an update that sends `quota` (0: keep
/// the current one; negative: none) and `period` (0: keep), over the file's `current`
/// content: a half the update does not send is kept, as v1's two files keep theirs (an
/// update of the period alone lifted the quota).
fn cpu_max(current: &str, quota: i64, period: i64) -> String {
    let mut now = current.split_whitespace();
    let (old_quota, old_period) = (now.next(), now.next());
    let quota = match quota {
        q if q > 0 => q.to_string(),
        q if q < 0 => "max".to_string(),
        _ => old_quota.unwrap_or("max").to_string(),
    };
    let period = match period {
        p if p > 0 => p.to_string(),
        _ => old_period.unwrap_or("100000").to_string(),
    };
    format!("{quota} {period}")
}

/// Resource usage read from a cgroup; fields the kernel did not offer are 0.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CgroupStats {
    pub cpu_usage_ns: u64,
    pub memory_usage_bytes: u64,
    pub memory_working_set_bytes: u64,
    pub memory_rss_bytes: u64,
    /// The cgroup's memory limit; 0 where it has none.
    pub memory_limit_bytes: u64,
    pub page_faults: u64,
    pub major_page_faults: u64,
    pub pids: u64,
    /// `cpu.pressure`, `memory.pressure`, `io.pressure` (cgroup v2 with PSI only).
    pub cpu_pressure: Option<Pressure>,
    pub memory_pressure: Option<Pressure>,
    pub io_pressure: Option<Pressure>,
}

/// A cgroup v2 pressure file (`some avg10=0.12 avg60=0.05 avg300=0.01 total=1234` and the
/// same for `full`); `None` where there is none (cgroup v1, a kernel without PSI).
fn read_pressure(path: &Path) -> Option<Pressure> {
    parse_pressure(&std::fs::read_to_string(path).ok()?)
}

fn parse_pressure(text: &str) -> Option<Pressure> {
    use crate::proto::PressureLine;
    let mut p = Pressure::default();
    // A line that does not parse is left out, not the file.
    let line = |fields: std::str::SplitWhitespace| {
        let mut line = PressureLine::default();
        for f in fields {
            let (k, v) = f.split_once('=')?;
            match k {
                "avg10" => line.avg10 = v.parse().ok()?,
                "avg60" => line.avg60 = v.parse().ok()?,
                "avg300" => line.avg300 = v.parse().ok()?,
                "total" => line.total_us = v.parse().ok()?,
                _ => {}
            }
        }
        Some(line)
    };
    for l in text.lines() {
        let mut fields = l.split_whitespace();
        match fields.next() {
            Some("some") => p.some = line(fields),
            Some("full") => p.full = line(fields),
            _ => {}
        }
    }
    p.some.is_some().then_some(p)
}

/// The cgroup v2 `cpu.weight` for a v1 CPU share, as libcontainer converts it when it makes
/// a container's cgroup (and runc 1.3 and crun do): a quadratic in log2(shares) through
/// 2 -> 1, 1024 -> 100 and 262144 -> 10000. A live update must give the weight a start gives:
/// the linear conversion of older runc, used here before, turned kubelet's 102 shares (100m)
/// from weight 17 into 4 at the first in-place resize.
// The float is whole and within 1..=10000 when cast: the cast keeps it.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
pub fn shares_to_weight(shares: u64) -> u64 {
    if shares <= 2 {
        return 1;
    }
    if shares >= 262_144 {
        return 10_000;
    }
    let l = (shares as f64).log2();
    let exponent = (l * l + 125.0 * l) / 612.0 - 7.0 / 34.0;
    10f64.powf(exponent).ceil().clamp(1.0, 10_000.0) as u64
}

/// Whether the node's memory cgroup accounts swap: cgroup v1's memsw files (kernels with
/// `swapaccount=1`, the default), or v2's memory.swap.max in a cgroup below the root (the
/// root has none). Probed until a memory cgroup below the root answers, then kept: a process
/// in the root cgroup of a node with no child cgroup yet has nothing to ask, and caching that
/// "no" would have left every later container free to swap.
pub fn accounts_swap() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if let Some(has) = HAS.get() {
        return *has;
    }
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("0::").map(|p| p.trim().to_string()))
        });
    match probe_swap(Path::new(CGROUP_ROOT), own.as_deref()) {
        Some(has) => *HAS.get_or_init(|| has),
        None => false,
    }
}

/// [`accounts_swap`] below `root`, for a process in the v2 cgroup `own`: `None` while no
/// memory cgroup below the root exists to tell.
fn probe_swap(root: &Path, own: Option<&str>) -> Option<bool> {
    if root.join("memory").is_dir() {
        return Some(root.join("memory/memory.memsw.limit_in_bytes").exists());
    }
    let controllers = std::fs::read_to_string(root.join("cgroup.controllers")).ok()?;
    if !controllers.split_whitespace().any(|c| c == "memory") {
        return Some(false);
    }
    // A cgroup with the memory controller on has memory.current, and memory.swap.max too
    // unless the kernel accounts no swap (`swapaccount=0`, `cgroup.memory=noswap`).
    let answer = |d: &Path| {
        d.join("memory.current")
            .exists()
            .then(|| d.join("memory.swap.max").exists())
    };
    let own = own
        .map(|p| root.join(p.trim_start_matches('/')))
        .filter(|d| d != root);
    own.as_deref().and_then(answer).or_else(|| {
        std::fs::read_dir(root)
            .ok()?
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .find_map(|e| answer(&e.path()))
    })
}

/// Whether `key` of a request's `unified` map names a controller's file in a cgroup:
/// `CONTROLLER.FILE` with no path in it, and not a `cgroup.*` core file (those move, kill
/// and freeze processes and shape the tree: never a resource). It is joined to the
/// container's cgroup directory and written as root.
pub fn is_controller_file(key: &str) -> bool {
    !key.contains(['/', '\0'])
        && key
            .split_once('.')
            .is_some_and(|(c, f)| !c.is_empty() && !f.is_empty() && c != "cgroup")
}

/// Whether `/sys/fs/cgroup` is a cgroup2 mount (unified mode).
pub fn is_unified() -> bool {
    nix::sys::statfs::statfs(CGROUP_ROOT)
        .map(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
        .unwrap_or(false)
}

/// The mount point of the v1 hierarchy holding `controller`.
///
/// The v1 mount table is read once per process: the hierarchies are mounted at boot and do
/// not move under a running agent, while `/proc/self/mountinfo` grows with every pod's
/// overlay mounts, so reading it per call (every start, signal and stats request asks for
/// a dozen controllers) cost a tenth of a busy host's agent CPU.
pub fn v1_mount_point(controller: &str) -> Option<PathBuf> {
    holding(v1_table(), controller)
}

/// The mount points of every v1 hierarchy (none on a v2-only host).
pub fn v1_mount_points() -> impl Iterator<Item = &'static Path> {
    v1_table().iter().map(|(_, mp)| mp.as_path())
}

/// This process's own cgroup in the v1 hierarchy mounted at `point` (from
/// `/proc/self/cgroup`), as a directory under `point`.
pub fn v1_own_dir(point: &Path) -> Option<PathBuf> {
    let (opts, _) = v1_table().iter().find(|(_, mp)| mp == point)?;
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    own_dir_in(&own, opts, point)
}

/// Of a `/proc/<pid>/cgroup` text, the directory of the v1 hierarchy mounted at `point`
/// with mount options `opts` (its controllers, or `name=...`).
fn own_dir_in(own: &str, opts: &[String], point: &Path) -> Option<PathBuf> {
    own.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctrls, path) = (f.next()?, f.next()?, f.next()?);
        let ours = !ctrls.is_empty() && ctrls.split(',').any(|c| opts.iter().any(|o| o == c));
        ours.then(|| point.join(path.trim_start_matches('/')))
    })
}

/// This process's v1 mount table, read once (see [`v1_mount_point`]).
fn v1_table() -> &'static [(Vec<String>, PathBuf)] {
    static MOUNTS: std::sync::OnceLock<Vec<(Vec<String>, PathBuf)>> = std::sync::OnceLock::new();
    MOUNTS.get_or_init(|| {
        std::fs::read_to_string("/proc/self/mountinfo")
            .map(|t| v1_mounts(&t))
            .unwrap_or_default()
    })
}

/// Of a v1 mount table, the mount point of the hierarchy holding `controller`.
fn holding(mounts: &[(Vec<String>, PathBuf)], controller: &str) -> Option<PathBuf> {
    mounts
        .iter()
        .find(|(opts, _)| opts.iter().any(|o| o == controller))
        .map(|(_, mp)| mp.clone())
}

/// The cgroup v1 mounts of a mountinfo text: each one's mount options and mount point, in
/// the table's order.
fn v1_mounts(mountinfo: &str) -> Vec<(Vec<String>, PathBuf)> {
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let mut r = right.split_whitespace();
        if r.next() != Some("cgroup") {
            continue;
        }
        let _source = r.next();
        let (Some(opts), Some(mp)) = (r.next(), left.split_whitespace().nth(4)) else {
            continue;
        };
        out.push((
            opts.split(',').map(str::to_owned).collect(),
            PathBuf::from(mp),
        ));
    }
    out
}

/// Whether the memory controller is usable (for OOM handling and memory limits).
pub fn memory_controller_available() -> bool {
    if is_unified() {
        std::fs::read_to_string(Path::new(CGROUP_ROOT).join("cgroup.controllers"))
            .map(|c| c.split_whitespace().any(|x| x == "memory"))
            .unwrap_or(false)
    } else {
        v1_mount_point("memory").is_some()
    }
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The value of `key` in a flat-keyed file (`key value` lines).
fn read_key(path: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

impl Cgroup {
    /// The cgroup of `cgroups_path` (absolute or relative: both are taken from each
    /// hierarchy's root, as libcontainer's cgroupfs managers do).
    pub fn new(cgroups_path: &Path) -> Cgroup {
        let rel = cgroups_path
            .strip_prefix("/")
            .unwrap_or(cgroups_path)
            .to_path_buf();
        Cgroup {
            rel,
            unified: is_unified(),
        }
    }

    fn v1(&self, controller: &str) -> Option<PathBuf> {
        v1_mount_point(controller).map(|m| m.join(&self.rel))
    }

    fn v2(&self) -> PathBuf {
        Path::new(CGROUP_ROOT).join(&self.rel)
    }

    /// Whether this cgroup is a v2 one (the node's `/sys/fs/cgroup` is cgroup2).
    pub fn is_v2(&self) -> bool {
        self.unified
    }

    /// Every directory of this cgroup (one per v1 hierarchy, or the v2 one) that exists.
    pub fn dirs(&self) -> Vec<PathBuf> {
        if self.unified {
            return [self.v2()].into_iter().filter(|p| p.exists()).collect();
        }
        let mut out = Vec::new();
        for c in [
            "cpu",
            "cpuacct",
            "cpuset",
            "memory",
            "devices",
            "freezer",
            "blkio",
            "pids",
            "hugetlb",
            "perf_event",
            "net_cls",
            "net_prio",
        ] {
            if let Some(p) = self.v1(c) {
                if p.exists() && !out.contains(&p) {
                    out.push(p);
                }
            }
        }
        out
    }

    /// Writes new limits into the cgroup's files (v1 controllers or v2). Zero/empty fields
    /// are left alone; a swap of -1 is no limit. What cannot be written is refused before
    /// anything is, so that a refused update changes nothing.
    pub fn update(&self, r: &crate::proto::LinuxResources) -> std::io::Result<()> {
        let write = |p: PathBuf, v: String| -> std::io::Result<()> {
            std::fs::write(&p, v.as_bytes()).map_err(|e| {
                std::io::Error::new(e.kind(), format!("writing {v:?} to {}: {e}", p.display()))
            })
        };
        if let Some(k) = r.unified.keys().find(|k| !is_controller_file(k)) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("bad cgroup file name {k:?}"),
            ));
        }
        if !self.unified && !r.unified.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "unified (cgroup v2) resources on a cgroup v1 host",
            ));
        }
        if self.unified {
            let d = self.v2();
            if r.cpu_shares > 0 {
                let w = shares_to_weight(r.cpu_shares.unsigned_abs());
                write(d.join("cpu.weight"), w.to_string())?;
            }
            if r.cpu_quota != 0 || r.cpu_period > 0 {
                let f = d.join("cpu.max");
                let now = std::fs::read_to_string(&f).unwrap_or_default();
                write(f, cpu_max(&now, r.cpu_quota, r.cpu_period))?;
            }
            if !r.cpuset_cpus.is_empty() {
                write(d.join("cpuset.cpus"), r.cpuset_cpus.clone())?;
            }
            if !r.cpuset_mems.is_empty() {
                write(d.join("cpuset.mems"), r.cpuset_mems.clone())?;
            }
            if r.memory_limit_in_bytes > 0 {
                write(d.join("memory.max"), r.memory_limit_in_bytes.to_string())?;
                if r.memory_swap_limit_in_bytes > 0 {
                    let swap = (r.memory_swap_limit_in_bytes - r.memory_limit_in_bytes).max(0);
                    write(d.join("memory.swap.max"), swap.to_string())?;
                } else if r.memory_swap_limit_in_bytes == -1 {
                    write(d.join("memory.swap.max"), "max".into())?;
                }
            }
            for (k, v) in &r.unified {
                write(d.join(k), v.clone())?;
            }
            return Ok(());
        }
        let v1 = |c: &str, f: &str| -> std::io::Result<PathBuf> {
            self.v1(c).map(|d| d.join(f)).ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("cgroup v1 controller {c} is not mounted"),
                )
            })
        };
        if r.cpu_shares > 0 {
            write(v1("cpu", "cpu.shares")?, r.cpu_shares.to_string())?;
        }
        // The kernel checks quota/period against the parent's at each write: a shorter
        // period under the old quota can be refused where the new pair fits. Then the quota
        // goes first, as runc's update retries it.
        let (period, quota) = (r.cpu_period > 0, r.cpu_quota != 0);
        if period {
            let p = v1("cpu", "cpu.cfs_period_us")?;
            if let Err(e) = write(p.clone(), r.cpu_period.to_string()) {
                if !quota || e.kind() != std::io::ErrorKind::InvalidInput {
                    return Err(e);
                }
                let q = v1("cpu", "cpu.cfs_quota_us")?;
                let old = std::fs::read_to_string(&q).unwrap_or_default();
                write(q.clone(), r.cpu_quota.to_string())?;
                if write(p, r.cpu_period.to_string()).is_err() {
                    // As it was: a refused update changes nothing.
                    let _ = std::fs::write(&q, old.trim());
                    return Err(e);
                }
            }
        }
        if quota {
            write(v1("cpu", "cpu.cfs_quota_us")?, r.cpu_quota.to_string())?;
        }
        if !r.cpuset_cpus.is_empty() {
            write(v1("cpuset", "cpuset.cpus")?, r.cpuset_cpus.clone())?;
        }
        if !r.cpuset_mems.is_empty() {
            write(v1("cpuset", "cpuset.mems")?, r.cpuset_mems.clone())?;
        }
        if r.memory_limit_in_bytes > 0 {
            let mem = v1("memory", "memory.limit_in_bytes")?;
            let memsw = v1("memory", "memory.memsw.limit_in_bytes")?;
            let limit = r.memory_limit_in_bytes.to_string();
            if r.memory_swap_limit_in_bytes != 0 && memsw.exists() {
                // memsw must stay >= the memory limit: raise first whichever must grow (-1,
                // no limit, always grows).
                let swap = r.memory_swap_limit_in_bytes.to_string();
                if write(memsw.clone(), swap.clone()).is_err() {
                    write(mem, limit)?;
                    write(memsw, swap)?;
                } else {
                    write(mem, limit)?;
                }
            } else {
                write(mem, limit)?;
            }
        }
        Ok(())
    }

    /// The pids in the cgroup (empty if it does not exist).
    pub fn procs(&self) -> Vec<i32> {
        let mut pids: Vec<i32> = Vec::new();
        for dir in self.dirs() {
            if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                // 0: a process outside the reader's pid namespace (never a pid to signal).
                let listed = text.lines().filter_map(|l| l.trim().parse::<i32>().ok());
                for p in listed.filter(|&p| p > 0) {
                    if !pids.contains(&p) {
                        pids.push(p);
                    }
                }
            }
        }
        pids
    }

    /// The cgroup's freezer: v1's `freezer.state`, v2's `cgroup.freeze` (None: no freezer
    /// here, a kernel without one or a cgroup not made yet).
    fn freezer(&self) -> Option<Freezer> {
        if self.unified {
            let f = self.v2().join("cgroup.freeze");
            f.exists().then_some(Freezer::V2(f))
        } else {
            let f = self.v1("freezer")?.join("freezer.state");
            f.exists().then_some(Freezer::V1(f))
        }
    }

    /// Sends `sig` to every process in the cgroup at one instant, as runc signals all of a
    /// container's processes: the cgroup is frozen while the signal goes out, so that no
    /// process forks a child past it (a shell's loop of `cmd &` outran a list-then-signal
    /// pass), then thawed. A cgroup that was frozen before stays so, except for SIGKILL (a
    /// process in a frozen v1 cgroup cannot die). A freeze that does not settle within
    /// [`FREEZE_WAIT`] (a task in uninterruptible sleep) is signalled anyway. Returns how
    /// many processes were signalled.
    pub async fn signal_all(&self, sig: impl Into<crate::signals::SigNum>) -> usize {
        let (freezer, was_frozen, froze) = self.begin_signal();
        if froze {
            let deadline = tokio::time::Instant::now() + FREEZE_WAIT;
            while !freezer.as_ref().is_some_and(Freezer::settled)
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        }
        self.end_signal(sig.into(), freezer, was_frozen, froze)
    }

    /// [`Self::signal_all`] for a thread that may block.
    pub fn signal_all_blocking(&self, sig: impl Into<crate::signals::SigNum>) -> usize {
        let (freezer, was_frozen, froze) = self.begin_signal();
        if froze {
            let deadline = std::time::Instant::now() + FREEZE_WAIT;
            while !freezer.as_ref().is_some_and(Freezer::settled)
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        self.end_signal(sig.into(), freezer, was_frozen, froze)
    }

    /// The freezer, whether it was frozen already, and whether it was asked to freeze now.
    fn begin_signal(&self) -> (Option<Freezer>, bool, bool) {
        let freezer = self.freezer();
        let was_frozen = freezer.as_ref().is_some_and(Freezer::frozen);
        let froze = !was_frozen && freezer.as_ref().is_some_and(Freezer::start_freeze);
        (freezer, was_frozen, froze)
    }

    fn end_signal(
        &self,
        sig: crate::signals::SigNum,
        freezer: Option<Freezer>,
        was_frozen: bool,
        froze: bool,
    ) -> usize {
        let pids = self.procs();
        for &p in &pids {
            let _ = crate::signals::kill(p, sig);
        }
        if let Some(f) = &freezer {
            if froze || (was_frozen && sig == crate::signals::SigNum::KILL) {
                f.thaw();
            }
        }
        pids.len()
    }

    /// SIGKILLs every process in the cgroup (cgroup v2's `cgroup.kill` where the kernel has
    /// it, else [`Self::signal_all`], again while any is left) until none is left or `limit`
    /// has passed; true if none is.
    pub async fn kill_all(&self, limit: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        // cgroup v2: `cgroup.kill` reaches the cgroups below it too (a container that made
        // its own, as systemd or a nested runtime does), whose processes its `cgroup.procs`
        // does not list; done once it is no longer populated.
        if self.unified && std::fs::write(self.v2().join("cgroup.kill"), "1").is_ok() {
            loop {
                let events = std::fs::read_to_string(self.v2().join("cgroup.events"));
                match events {
                    Ok(e) if e.lines().any(|l| l == "populated 1") => {}
                    _ => return true,
                }
                if tokio::time::Instant::now() >= deadline {
                    return false;
                }
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        }
        // Frozen once: a process with SIGKILL pending cannot fork, so what a frozen pass
        // signalled has no children to come; later passes are for stragglers (a freeze that
        // did not settle), without freezing again.
        let mut frozen_pass = true;
        loop {
            let left = self.procs();
            if left.is_empty() {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            if std::mem::take(&mut frozen_pass) {
                self.signal_all(nix::sys::signal::SIGKILL).await;
            } else {
                for p in left {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(p),
                        nix::sys::signal::SIGKILL,
                    );
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// How many processes the kernel's OOM killer killed in this cgroup (None: unknown).
    pub fn oom_kill_count(&self) -> Option<u64> {
        if self.unified {
            read_key(&self.v2().join("memory.events"), "oom_kill")
        } else {
            read_key(&self.v1("memory")?.join("memory.oom_control"), "oom_kill")
        }
    }

    /// The cgroup's CPU, memory and IO pressure (cgroup v2 with PSI only; none on v1, where
    /// a hybrid host's unified hierarchy holds no container's cgroup).
    pub fn pressure(&self) -> (Option<Pressure>, Option<Pressure>, Option<Pressure>) {
        if !self.unified {
            return (None, None, None);
        }
        let d = self.v2();
        (
            read_pressure(&d.join("cpu.pressure")),
            read_pressure(&d.join("memory.pressure")),
            read_pressure(&d.join("io.pressure")),
        )
    }

    /// The cgroup's cumulative counters (CPU ns, page faults, major page faults), which keep
    /// what its removed children used; None where its CPU time cannot be read (no such
    /// cgroup, no CPU accounting). Page faults are 0 without a memory controller.
    pub fn counters(&self) -> Option<[u64; 3]> {
        if self.unified {
            let d = self.v2();
            let cpu = read_key(&d.join("cpu.stat"), "usage_usec")?.saturating_mul(1000);
            let stat = d.join("memory.stat");
            Some([
                cpu,
                read_key(&stat, "pgfault").unwrap_or(0),
                read_key(&stat, "pgmajfault").unwrap_or(0),
            ])
        } else {
            let cpu = read_u64(&self.v1("cpuacct")?.join("cpuacct.usage"))?;
            let stat = self.v1("memory").map(|d| d.join("memory.stat"));
            let key = |k| stat.as_ref().and_then(|s| read_key(s, k)).unwrap_or(0);
            Some([cpu, key("total_pgfault"), key("total_pgmajfault")])
        }
    }

    /// The cgroup's memory limit in bytes; 0 where it has none (`max`, or the page-rounded
    /// near-2^63 of an unlimited v1 cgroup: anything above 2^62, as containerd and cAdvisor
    /// read it) or no memory controller.
    pub fn memory_limit(&self) -> u64 {
        let limit = if self.unified {
            read_u64(&self.v2().join("memory.max"))
        } else {
            self.v1("memory")
                .and_then(|d| read_u64(&d.join("memory.limit_in_bytes")))
        };
        limit.filter(|&l| l <= 1 << 62).unwrap_or(0)
    }

    /// Current resource usage.
    pub fn stats(&self) -> CgroupStats {
        let mut s = CgroupStats::default();
        if self.unified {
            let d = self.v2();
            s.cpu_usage_ns = read_key(&d.join("cpu.stat"), "usage_usec").unwrap_or(0) * 1000;
            s.memory_usage_bytes = read_u64(&d.join("memory.current")).unwrap_or(0);
            let stat = d.join("memory.stat");
            let inactive = read_key(&stat, "inactive_file").unwrap_or(0);
            s.memory_working_set_bytes = s.memory_usage_bytes.saturating_sub(inactive);
            s.memory_rss_bytes = read_key(&stat, "anon").unwrap_or(0);
            s.page_faults = read_key(&stat, "pgfault").unwrap_or(0);
            s.major_page_faults = read_key(&stat, "pgmajfault").unwrap_or(0);
            s.pids = read_u64(&d.join("pids.current")).unwrap_or(0);
            s.memory_limit_bytes = self.memory_limit();
            (s.cpu_pressure, s.memory_pressure, s.io_pressure) = self.pressure();
        } else {
            if let Some(d) = self.v1("cpuacct") {
                s.cpu_usage_ns = read_u64(&d.join("cpuacct.usage")).unwrap_or(0);
            }
            if let Some(d) = self.v1("memory") {
                s.memory_usage_bytes = read_u64(&d.join("memory.usage_in_bytes")).unwrap_or(0);
                let stat = d.join("memory.stat");
                let inactive = read_key(&stat, "total_inactive_file").unwrap_or(0);
                s.memory_working_set_bytes = s.memory_usage_bytes.saturating_sub(inactive);
                s.memory_rss_bytes = read_key(&stat, "total_rss").unwrap_or(0);
                s.page_faults = read_key(&stat, "total_pgfault").unwrap_or(0);
                s.major_page_faults = read_key(&stat, "total_pgmajfault").unwrap_or(0);
                s.memory_limit_bytes = self.memory_limit();
            }
            if let Some(d) = self.v1("pids") {
                s.pids = read_u64(&d.join("pids.current")).unwrap_or(0);
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controller_files() {
        for k in [
            "memory.high",
            "memory.swap.max",
            "cpu.weight",
            "hugetlb.2MB.max",
        ] {
            assert!(is_controller_file(k), "{k}");
        }
        for k in [
            "",
            "memory",
            ".max",
            "memory.",
            "../memory.max",
            "/etc/passwd",
            "x/../../y.z",
            "cgroup.procs",
            "cgroup.kill",
            "cgroup.subtree_control",
            "memory.max\0",
        ] {
            assert!(!is_controller_file(k), "{k:?}");
        }
    }

    /// On a v1 node that accounts swap (this CI host), as root: an update to no swap limit
    /// (-1) with a larger memory limit is taken (memsw first); one with a key that is no
    /// controller's file is refused before anything is written.
    #[test]
    fn v1_update_takes_unlimited_swap_and_refuses_before_writing() {
        let Some(mem) = v1_mount_point("memory") else {
            println!("SKIP: no v1 memory hierarchy");
            return;
        };
        if !mem.join("memory.memsw.limit_in_bytes").exists() || is_unified() {
            println!("SKIP: v1 swap not accounted");
            return;
        }
        struct Gone(PathBuf);
        impl Drop for Gone {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir(&self.0);
            }
        }
        let rel = format!("vessel-unit-swap-{}", std::process::id());
        let dir = mem.join(&rel);
        if let Err(e) = std::fs::create_dir(&dir) {
            println!("SKIP: cannot make {}: {e}", dir.display());
            return;
        }
        let _gone = Gone(dir.clone());
        let read = |f: &str| {
            std::fs::read_to_string(dir.join(f))
                .unwrap()
                .trim()
                .to_string()
        };
        let mib = |n: i64| n << 20;
        std::fs::write(dir.join("memory.limit_in_bytes"), mib(64).to_string()).unwrap();
        std::fs::write(dir.join("memory.memsw.limit_in_bytes"), mib(64).to_string()).unwrap();
        let cg = Cgroup::new(Path::new(&format!("/{rel}")));
        let bad = crate::proto::LinuxResources {
            memory_limit_in_bytes: mib(96),
            unified: [("cgroup.procs".to_string(), "1".to_string())].into(),
            ..Default::default()
        };
        assert!(cg.update(&bad).is_err());
        assert_eq!(
            read("memory.limit_in_bytes"),
            mib(64).to_string(),
            "written"
        );
        cg.update(&crate::proto::LinuxResources {
            memory_limit_in_bytes: mib(128),
            memory_swap_limit_in_bytes: -1,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(read("memory.limit_in_bytes"), mib(128).to_string());
        assert!(
            read("memory.memsw.limit_in_bytes").parse::<u64>().unwrap() > 1 << 60,
            "no swap limit"
        );
    }

    /// On v1, as root: a shorter period whose new quota fits the parent's, where the old
    /// quota over the new period would not, is taken (the quota written first).
    #[test]
    fn v1_update_shortens_the_period_under_a_parents_quota() {
        let Some(cpu) = v1_mount_point("cpu") else {
            println!("SKIP: no v1 cpu hierarchy");
            return;
        };
        if is_unified() || !cpu.join("cpu.cfs_quota_us").exists() {
            println!("SKIP: no v1 CFS quota");
            return;
        }
        struct Gone(Vec<PathBuf>);
        impl Drop for Gone {
            fn drop(&mut self) {
                for d in &self.0 {
                    let _ = std::fs::remove_dir(d);
                }
            }
        }
        let rel = format!("vessel-unit-period-{}", std::process::id());
        let (parent, child) = (cpu.join(&rel), cpu.join(&rel).join("c"));
        if let Err(e) = std::fs::create_dir(&parent) {
            println!("SKIP: cannot make {}: {e}", parent.display());
            return;
        }
        let _gone = Gone(vec![child.clone(), parent.clone()]);
        std::fs::create_dir(&child).unwrap();
        std::fs::write(parent.join("cpu.cfs_quota_us"), "50000").unwrap();
        std::fs::write(child.join("cpu.cfs_quota_us"), "50000").unwrap();
        let cg = Cgroup::new(Path::new(&format!("/{rel}/c")));
        cg.update(&crate::proto::LinuxResources {
            cpu_period: 50_000,
            cpu_quota: 25_000,
            ..Default::default()
        })
        .unwrap();
        let read = |f: &str| std::fs::read_to_string(child.join(f)).unwrap();
        assert_eq!(read("cpu.cfs_period_us").trim(), "50000");
        assert_eq!(read("cpu.cfs_quota_us").trim(), "25000");
    }

    #[test]
    fn swap_accounting_waits_for_a_memory_cgroup_to_tell() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        // No controllers file: not a cgroup root it can read.
        assert_eq!(probe_swap(root, Some("/")), None);
        std::fs::write(root.join("cgroup.controllers"), "cpu io\n").unwrap();
        assert_eq!(
            probe_swap(root, Some("/")),
            Some(false),
            "no memory controller"
        );
        std::fs::write(root.join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        // The root has no memory.swap.max; no child yet: nothing tells.
        assert_eq!(probe_swap(root, Some("/")), None);
        let child = root.join("kubepods");
        std::fs::create_dir(&child).unwrap();
        assert_eq!(
            probe_swap(root, Some("/")),
            None,
            "memory not on below the root"
        );
        std::fs::write(child.join("memory.current"), "0\n").unwrap();
        assert_eq!(probe_swap(root, Some("/")), Some(false), "swapaccount=0");
        std::fs::write(child.join("memory.swap.max"), "max\n").unwrap();
        assert_eq!(probe_swap(root, Some("/")), Some(true));
        // A process's own cgroup answers first.
        let own = root.join("system.slice");
        std::fs::create_dir(&own).unwrap();
        std::fs::write(own.join("memory.current"), "0\n").unwrap();
        assert_eq!(probe_swap(root, Some("/system.slice")), Some(false));
        // cgroup v1: the memsw files.
        let v1 = tempfile::tempdir().unwrap();
        std::fs::create_dir(v1.path().join("memory")).unwrap();
        assert_eq!(probe_swap(v1.path(), None), Some(false));
        std::fs::write(v1.path().join("memory/memory.memsw.limit_in_bytes"), "").unwrap();
        assert_eq!(probe_swap(v1.path(), None), Some(true));
    }

    #[test]
    fn cpu_weights_of_an_update_are_those_of_a_start() {
        // libcontainer's (and runc 1.3's) conversion, worked out apart.
        for (shares, weight) in [
            (1, 1),
            (2, 1),
            (3, 2),
            (10, 4),
            (51, 11),
            (102, 17),
            (256, 35),
            (512, 59),
            (1024, 100),
            (2048, 174),
            (4096, 303),
            (262_143, 10_000),
            (262_144, 10_000),
            (1 << 20, 10_000),
        ] {
            assert_eq!(shares_to_weight(shares), weight, "{shares} shares");
        }
    }

    #[test]
    fn a_cpu_max_update_keeps_the_half_it_does_not_send() {
        // kubelet's in-place resize sends both; a client may send one.
        assert_eq!(cpu_max("50000 100000\n", 0, 200_000), "50000 200000");
        assert_eq!(cpu_max("50000 200000\n", 30_000, 0), "30000 200000");
        assert_eq!(cpu_max("50000 100000\n", -1, 0), "max 100000");
        assert_eq!(cpu_max("max 100000\n", 20_000, 50_000), "20000 50000");
        // No file to read: the kernel's defaults.
        assert_eq!(cpu_max("", 0, 50_000), "max 50000");
        assert_eq!(cpu_max("", 25_000, 0), "25000 100000");
    }

    #[test]
    fn own_cgroup_of_a_hierarchy() {
        let own = "9:name=systemd:/vessel/p/vessel-agent\n4:memory:/vessel/p/c1\n\
                   2:cpu,cpuacct:/vessel/p/c1\n0::/x\n";
        let opts = |o: &str| o.split(',').map(str::to_owned).collect::<Vec<_>>();
        let at = |o: &str, p: &str| own_dir_in(own, &opts(o), Path::new(p));
        assert_eq!(
            at("rw,xattr,name=systemd", "/sys/fs/cgroup/systemd"),
            Some(PathBuf::from(
                "/sys/fs/cgroup/systemd/vessel/p/vessel-agent"
            ))
        );
        assert_eq!(
            at("rw,cpu,cpuacct", "/sys/fs/cgroup/cpu,cpuacct"),
            Some(PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/vessel/p/c1"))
        );
        assert_eq!(at("rw,pids", "/sys/fs/cgroup/pids"), None);
    }

    #[test]
    fn pressure_files() {
        let p = parse_pressure(
            "some avg10=1.50 avg60=0.25 avg300=0.00 total=123456\n\
             full avg10=0.75 avg60=0.00 avg300=0.00 total=654\n",
        )
        .unwrap();
        let some = p.some.unwrap();
        assert_eq!(
            (some.avg10, some.avg60, some.total_us),
            (1.5, 0.25, 123_456)
        );
        assert_eq!(p.full.unwrap().total_us, 654);
        // cpu.pressure of kernels before 5.13 has no full line.
        let p = parse_pressure("some avg10=0.00 avg60=0.00 avg300=0.00 total=7\n").unwrap();
        assert!(p.full.is_none() && p.some.unwrap().total_us == 7);
        assert!(parse_pressure("").is_none());
        assert!(parse_pressure("some avg10=x total=1\n").is_none());
        let p = parse_pressure("some avg10=0.00 total=3\n\nfull avg10=x total=1\n").unwrap();
        assert!(p.full.is_none() && p.some.unwrap().total_us == 3);
    }

    #[test]
    fn keyed_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("memory.events");
        std::fs::write(&p, "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n").unwrap();
        assert_eq!(read_key(&p, "oom_kill"), Some(2));
        assert_eq!(read_key(&p, "oom"), Some(1));
        assert_eq!(read_key(&p, "nope"), None);
    }

    #[test]
    fn v1_mount_table() {
        let info = "\
25 30 0:22 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw,nsdelegate
29 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:13 - cgroup cgroup rw,cpu,cpuacct
31 25 0:28 / /sys/fs/cgroup/memory rw,nosuid shared:15 - cgroup cgroup rw,memory
90 30 0:50 / /run/x rw - overlay overlay rw,lowerdir=/a,upperdir=/b,workdir=/c
";
        let m = v1_mounts(info);
        let find = |c: &str| holding(&m, c);
        assert_eq!(m.len(), 2);
        assert_eq!(find("cpuacct"), Some("/sys/fs/cgroup/cpu,cpuacct".into()));
        assert_eq!(find("memory"), Some("/sys/fs/cgroup/memory".into()));
        assert_eq!(find("pids"), None);
        assert_eq!(find("nsdelegate"), None);
    }

    /// A shell forking children as fast as it can is gone after one `kill_all`, which leaves
    /// its cgroup thawed; a cgroup frozen before stays frozen for a signal other than SIGKILL.
    #[tokio::test]
    async fn signals_reach_a_forking_cgroup_frozen() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: making cgroups needs root");
            return;
        }
        let rel = format!("vessel-test-freeze-{}", std::process::id());
        let cg = Cgroup::new(Path::new(&rel));
        let dirs: Vec<PathBuf> = if cg.unified {
            vec![cg.v2()]
        } else {
            ["freezer", "pids"]
                .iter()
                .filter_map(|c| cg.v1(c))
                .collect()
        };
        /// Whatever the test's end, nothing is left: thawed, killed, removed.
        struct Gone(Vec<PathBuf>);
        impl Drop for Gone {
            fn drop(&mut self) {
                for d in &self.0 {
                    let _ = std::fs::write(d.join("freezer.state"), "THAWED");
                    let _ = std::fs::write(d.join("cgroup.freeze"), "0");
                    let _ = std::fs::write(d.join("cgroup.kill"), "1");
                }
                for _ in 0..100 {
                    for d in &self.0 {
                        let procs = std::fs::read_to_string(d.join("cgroup.procs"));
                        for p in procs.unwrap_or_default().lines() {
                            if let Ok(p) = p.parse::<i32>() {
                                let _ = nix::sys::signal::kill(
                                    nix::unistd::Pid::from_raw(p),
                                    nix::sys::signal::SIGKILL,
                                );
                            }
                        }
                    }
                    if self
                        .0
                        .iter()
                        .all(|d| std::fs::remove_dir(d).is_ok() || !d.exists())
                    {
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            }
        }
        for d in &dirs {
            std::fs::create_dir_all(d).unwrap();
        }
        let _gone = Gone(dirs.clone());
        let Some(freezer) = cg.freezer() else {
            eprintln!("skipped: no cgroup freezer here");
            return;
        };
        let pids_max = dirs.iter().map(|d| d.join("pids.max")).find(|p| p.exists());
        if let Some(m) = &pids_max {
            std::fs::write(m, "300").unwrap();
        }
        // Each shell waits for a line on stdin, sent once it is in the cgroup.
        let spawn = |script: &str| {
            let mut child = std::process::Command::new("sh")
                .args(["-c", &format!("read go; {script}")])
                .stdin(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            for d in &dirs {
                std::fs::write(d.join("cgroup.procs"), child.id().to_string()).unwrap();
            }
            let mut go = child.stdin.take().unwrap();
            std::io::Write::write_all(&mut go, b"go\n").unwrap();
            child
        };

        let mut bomb = spawn("while :; do sleep 60 & done");
        let t0 = std::time::Instant::now();
        while cg.procs().len() < 50 && t0.elapsed() < std::time::Duration::from_secs(10) {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(
            cg.procs().len() >= 50,
            "the shell forked: {:?}",
            cg.procs().len()
        );
        assert!(cg.kill_all(std::time::Duration::from_secs(5)).await);
        assert!(cg.procs().is_empty());
        assert!(!freezer.frozen(), "left frozen");
        let _ = bomb.wait();

        let mut sleeper = spawn("trap '' TERM; exec sleep 60");
        assert!(freezer.start_freeze());
        assert_eq!(cg.signal_all(nix::sys::signal::SIGTERM).await, 1);
        assert!(freezer.frozen(), "a frozen cgroup was thawed for SIGTERM");
        assert_eq!(cg.signal_all_blocking(nix::sys::signal::SIGKILL), 1);
        assert!(!freezer.frozen());
        let st = sleeper.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&st),
            Some(nix::libc::SIGKILL)
        );
    }

    #[test]
    fn relative_paths() {
        let c = Cgroup::new(Path::new("/a/b"));
        assert_eq!(c.rel, PathBuf::from("a/b"));
        let c = Cgroup::new(Path::new("a/b"));
        assert_eq!(c.rel, PathBuf::from("a/b"));
    }
}
