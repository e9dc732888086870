//! Network namespaces on the host: a pod's netns pinned by bind-mounting its nsfs file under
//! `<run>/netns/<pod-id>` (no pause process keeps it), and code run inside one.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error(transparent)]
    Io(#[from] crate::errors::IoAt),
    #[error("invalid sysctl name {0:?}")]
    BadSysctl(String),
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> NetnsError {
    crate::errors::io_at(op, path)
}

/// Creates the empty file (and its directory) a namespace is bind-mounted on.
fn mount_point(path: &Path) -> Result<(), NetnsError> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(io("create", path))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io("create", path))?;
    Ok(())
}

/// Pins the network namespace of process `pid` at `path` with a bind mount.
pub fn pin(pid: u32, path: &Path) -> Result<(), NetnsError> {
    mount_point(path)?;
    let src = format!("/proc/{pid}/ns/net");
    rustix::mount::mount_bind(src.as_str(), path)
        .map_err(|e| io("bind-mount netns", path)(e.into()))
}

/// Creates a new network namespace pinned at `path` (a VM pod's: no process lives in it;
/// CNI configures it and the VM's tap joins it).
pub fn create(path: &Path) -> Result<(), NetnsError> {
    mount_point(path)?;
    let target = path.to_path_buf();
    let pinned = std::thread::Builder::new()
        .name("vessel-netns-new".into())
        .spawn(move || -> std::io::Result<()> {
            // SAFETY: unshare(2) of the network namespace affects only this thread, which
            // exits right after pinning it.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            rustix::mount::mount_bind("/proc/thread-self/ns/net", &target)
                .map_err(std::io::Error::from)
        })
        .map_err(io("spawn a thread for", path))?
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("netns thread panicked")));
    if let Err(e) = pinned {
        let _ = std::fs::remove_file(path);
        return Err(io("create netns", path)(e));
    }
    Ok(())
}

/// Whether `path` is a pinned network namespace (an nsfs file bind-mounted there), not a
/// pin that is gone (unpinned after a failed DEL, or a reboot emptied `/run`) or never was.
pub fn is_pinned(path: &Path) -> bool {
    const NSFS_MAGIC: u64 = 0x6e73_6673;
    !path.as_os_str().is_empty()
        && rustix::fs::statfs(path).is_ok_and(|s| s.f_type as u64 == NSFS_MAGIC)
}

/// Unmounts and removes a netns pin. Missing (or an empty path: no pin) is fine.
pub fn unpin(path: &Path) -> Result<(), NetnsError> {
    if path.as_os_str().is_empty() {
        return Ok(());
    }
    loop {
        match rustix::mount::unmount(path, rustix::mount::UnmountFlags::DETACH) {
            Ok(()) => continue, // stacked pins: unmount them all
            Err(rustix::io::Errno::INVAL) | Err(rustix::io::Errno::NOENT) => break,
            Err(e) => return Err(io("unmount netns", path)(e.into())),
        }
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io("remove", path)(e)),
    }
}

/// Moves the calling thread into the network namespace pinned at `netns` (an empty path:
/// stays in the host's).
fn enter(netns: &Path) -> std::io::Result<()> {
    if netns.as_os_str().is_empty() {
        return Ok(());
    }
    let ns = std::fs::File::open(netns)?;
    rustix::thread::move_into_link_name_space(
        ns.as_fd(),
        Some(rustix::thread::LinkNameSpaceType::Network),
    )?;
    Ok(())
}

/// [`run_in_netns`] for synchronous callers: blocks until `f` has run.
pub fn run_in_netns_blocking<T, F>(netns: &Path, f: F) -> std::io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> std::io::Result<T> + Send + 'static,
{
    let netns = netns.to_path_buf();
    std::thread::Builder::new()
        .name("vessel-netns".into())
        .spawn(move || enter(&netns).and_then(|()| f()))?
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("netns thread panicked")))
}

/// Runs `f` on a thread of its own that joins the network namespace pinned at `netns` (an
/// empty path: the host's). Sockets `f` creates keep that namespace; the thread exits after
/// `f`, so nothing else ever runs in the pod's namespace by mistake.
pub async fn run_in_netns<T, F>(netns: &Path, f: F) -> std::io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> std::io::Result<T> + Send + 'static,
{
    let netns = netns.to_path_buf();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("vessel-netns".into())
        .spawn(move || {
            let r = enter(&netns).and_then(|()| f());
            let _ = tx.send(r);
        })?;
    rx.await
        .map_err(|_| std::io::Error::other("netns thread died"))?
}

/// Applies the `net.*` sysctls of a pod inside its network namespace (pinned at `netns`):
/// they are per network namespace and belong to the pod, not to a container.
pub async fn apply_net_sysctls(
    netns: &Path,
    sysctls: &HashMap<String, String>,
) -> Result<(), NetnsError> {
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
            return Err(NetnsError::BadSysctl(k.clone()));
        }
    }
    run_in_netns(netns, move || {
        for (k, v) in net {
            let p = PathBuf::from("/proc/sys").join(k.replace('.', "/"));
            std::fs::write(&p, v.as_bytes())
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", p.display())))?;
        }
        Ok(())
    })
    .await
    .map_err(io("write sysctls in", netns))
}

/// Per-interface counters of the network namespace pinned at `netns`, from a thread in it
/// (`/proc/thread-self/net/dev`), loopback left out: (name, rx bytes, rx errors, tx bytes,
/// tx errors). Empty if the namespace is gone.
pub fn interface_counters(netns: &Path) -> Vec<(String, u64, u64, u64, u64)> {
    if netns.as_os_str().is_empty() {
        return Vec::new(); // no namespace of its own: not the host's counters
    }
    run_in_netns_blocking(netns, || {
        std::fs::read_to_string("/proc/thread-self/net/dev")
    })
    .map(|t| parse_net_dev(&t))
    .unwrap_or_default()
}

/// A pod's `NetworkUsage` from its network namespace's counters (eth0 the default
/// interface), leaving out the interfaces named in `hidden` (a VM pod's tap, whose frames
/// are eth0's again). `None` without a namespace of its own, or without an interface to
/// report: kubelet reads the default interface of any `NetworkUsage` it gets, and one
/// without it panics its stats (as a pod whose namespace went in a stop, or that has
/// loopback only, would give).
pub fn network_usage(netns: &Path, hidden: &[&str]) -> Option<vessel_cri_api::v1::NetworkUsage> {
    use vessel_cri_api::v1 as cri;
    if netns.as_os_str().is_empty() {
        return None;
    }
    let u = |v: u64| Some(cri::UInt64Value { value: v });
    let interfaces: Vec<cri::NetworkInterfaceUsage> = interface_counters(netns)
        .into_iter()
        .filter(|(name, ..)| !hidden.contains(&name.as_str()))
        .map(|(name, rxb, rxe, txb, txe)| cri::NetworkInterfaceUsage {
            name,
            rx_bytes: u(rxb),
            rx_errors: u(rxe),
            tx_bytes: u(txb),
            tx_errors: u(txe),
        })
        .collect();
    let default_interface = interfaces
        .iter()
        .find(|i| i.name == "eth0")
        .or(interfaces.first())
        .cloned()?;
    Some(cri::NetworkUsage {
        timestamp: crate::state::now_nanos(),
        default_interface: Some(default_interface),
        interfaces,
    })
}

fn parse_net_dev(text: &str) -> Vec<(String, u64, u64, u64, u64)> {
    text.lines()
        .skip(2)
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let name = name.trim();
            let f: Vec<u64> = rest
                .split_whitespace()
                .map(|x| x.parse().ok())
                .collect::<Option<_>>()?;
            // rx: bytes packets errs drop fifo frame compressed multicast; tx: bytes packets errs ...
            (name != "lo" && f.len() >= 11).then(|| (name.to_string(), f[0], f[2], f[8], f[10]))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_dev_counters() {
        let t = "Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:     100       2    0    0    0     0          0         0      100       2    0    0    0     0       0          0
  eth0:    5000      40    1    0    0     0          0         0     7000      50    3    0    0     0       0          0
";
        assert_eq!(
            parse_net_dev(t),
            vec![("eth0".to_string(), 5000, 1, 7000, 3)]
        );
        assert!(parse_net_dev("garbage").is_empty());
        assert!(interface_counters(Path::new("/nonexistent")).is_empty());
        // This process's own namespace, through its nsfs file.
        let own = interface_counters(Path::new("/proc/self/ns/net"));
        assert!(own.iter().all(|(n, ..)| n != "lo"));
        assert!(network_usage(Path::new(""), &[]).is_none());
        // A namespace gone (a pod being stopped) gives none, not a usage without its
        // default interface.
        assert!(network_usage(Path::new("/nonexistent"), &[]).is_none());
        if let Some(n) = network_usage(Path::new("/proc/self/ns/net"), &[]) {
            let d = n.default_interface.expect("a default interface");
            assert!(n.interfaces.contains(&d));
            let all: Vec<&str> = n.interfaces.iter().map(|i| i.name.as_str()).collect();
            let hidden = network_usage(Path::new("/proc/self/ns/net"), &all);
            assert!(hidden.is_none(), "every interface hidden: {hidden:?}");
        }
    }
}
