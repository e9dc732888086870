//! A VM pod's host CPUs: kubelet's CPU manager (static policy) gives each container of a
//! Guaranteed pod its exclusive CPUs, and the others the shared pool, as `cpuset_cpus` at
//! create and UpdateContainerResources. In a VM pod those host CPU numbers mean nothing to
//! the guest (they are not applied there); what runs on the host's CPUs is the pod's VMM
//! process, its vCPU and device threads. So its threads are pinned to the CPUs its
//! containers were given, together; to those vesseld runs on when none was given any.

use std::collections::BTreeSet;
use std::path::Path;

/// The CPUs of a cpuset list (`0-3,8,10-11`); `None` when it is not one.
pub fn parse_cpus(list: &str) -> Option<BTreeSet<usize>> {
    let mut cpus = BTreeSet::new();
    for part in list.trim().split(',').filter(|p| !p.trim().is_empty()) {
        let part = part.trim();
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse().ok()?, b.trim().parse().ok()?),
            None => {
                let n: usize = part.parse().ok()?;
                (n, n)
            }
        };
        if lo > hi || hi >= rustix::thread::CpuSet::MAX_CPU {
            return None;
        }
        cpus.extend(lo..=hi);
    }
    Some(cpus)
}

/// The host's online CPUs.
fn online() -> BTreeSet<usize> {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| parse_cpus(&s))
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| {
            (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
        })
}

/// The CPUs of `online` this process (vesseld) may run on, which its pods' processes
/// started with.
fn own(online: BTreeSet<usize>) -> BTreeSet<usize> {
    match rustix::thread::sched_getaffinity(None) {
        Ok(set) => {
            let own: BTreeSet<usize> = online.iter().copied().filter(|&c| set.is_set(c)).collect();
            if own.is_empty() {
                online
            } else {
                own
            }
        }
        Err(_) => online,
    }
}

/// The CPUs a VM pod's process is to run on, from its containers' cpuset lists: their union,
/// else (none given, or none of them a CPU the host has online) those it started with
/// (vesseld's own).
pub fn wanted<'a>(lists: impl IntoIterator<Item = &'a str>) -> BTreeSet<usize> {
    let online = online();
    let given: BTreeSet<usize> = lists
        .into_iter()
        .filter_map(parse_cpus)
        .flatten()
        .filter(|c| online.contains(c))
        .collect();
    if given.is_empty() {
        own(online)
    } else {
        given
    }
}

/// Pins every thread of process `pid` (checked against its start time) to `cpus`; the
/// number of threads pinned. Threads it makes later inherit the pinning of the thread that
/// makes them.
pub fn pin_process(pid: u32, start_time: u64, cpus: &BTreeSet<usize>) -> std::io::Result<usize> {
    if pid == 0 || !crate::sandbox::process::is_alive(pid, start_time) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("process {pid} is gone"),
        ));
    }
    let mut set = rustix::thread::CpuSet::new();
    for &c in cpus {
        set.set(c);
    }
    let mut pinned = 0;
    for e in std::fs::read_dir(Path::new("/proc").join(pid.to_string()).join("task"))?.flatten() {
        let Some(tid) = e
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<i32>().ok())
            .and_then(rustix::process::Pid::from_raw)
        else {
            continue;
        };
        match rustix::thread::sched_setaffinity(Some(tid), &set) {
            Ok(()) => pinned += 1,
            // A thread that ended meanwhile.
            Err(rustix::io::Errno::SRCH) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(pinned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpuset_lists() {
        let set = |v: &[usize]| v.iter().copied().collect::<BTreeSet<usize>>();
        assert_eq!(parse_cpus("0-2,5, 7-7\n"), Some(set(&[0, 1, 2, 5, 7])));
        assert_eq!(parse_cpus(""), Some(set(&[])));
        assert_eq!(parse_cpus("3-1"), None);
        assert_eq!(parse_cpus("a"), None);
        assert_eq!(parse_cpus("0-99999"), None);
        let own = own(online());
        assert!(!own.is_empty());
        assert_eq!(wanted(["", "junk"]), own, "none given: where vesseld runs");
        let first = *online().iter().next().unwrap();
        let first_list = first.to_string();
        assert_eq!(wanted([first_list.as_str(), ""]), set(&[first]));
        assert_eq!(
            wanted(["99999"]),
            own,
            "none the host has: where vesseld runs"
        );
    }

    /// A process of ours (a child sleeping) is pinned, all its threads, and unpinned.
    #[test]
    fn a_process_is_pinned_and_unpinned() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let start = crate::sandbox::process::process_start_time(pid).unwrap();
        let allowed = || {
            let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
            s.lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .unwrap()
                .trim()
                .to_string()
        };
        let online = online();
        let first = *online.iter().next().unwrap();
        assert_eq!(pin_process(pid, start, &[first].into()).unwrap(), 1);
        assert_eq!(allowed(), first.to_string());
        pin_process(pid, start, &online).unwrap();
        assert_eq!(parse_cpus(&allowed()), Some(online));
        assert!(pin_process(pid, start + 1, &[first].into()).is_err());
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
