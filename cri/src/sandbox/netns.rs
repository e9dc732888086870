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

/// Pins the network namespace of process `pid` at `path` with a bind mount.
pub fn pin(pid: u32, path: &Path) -> Result<(), NetnsError> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(io("create", path))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io("create", path))?;
    let src = format!("/proc/{pid}/ns/net");
    rustix::mount::mount_bind(src.as_str(), path)
        .map_err(|e| io("bind-mount netns", path)(e.into()))
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
            let r = (|| {
                if !netns.as_os_str().is_empty() {
                    let ns = std::fs::File::open(&netns)?;
                    rustix::thread::move_into_link_name_space(
                        ns.as_fd(),
                        Some(rustix::thread::LinkNameSpaceType::Network),
                    )?;
                }
                f()
            })();
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

/// Per-interface counters of the network namespace process `pid` is in, from
/// `/proc/<pid>/net/dev`, loopback left out: (name, rx bytes, rx errors, tx bytes, tx errors).
pub fn interface_counters(pid: u32) -> Vec<(String, u64, u64, u64, u64)> {
    std::fs::read_to_string(format!("/proc/{pid}/net/dev"))
        .map(|t| parse_net_dev(&t))
        .unwrap_or_default()
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
        assert!(interface_counters(u32::MAX).is_empty());
    }
}
