//! The VM sandbox backend: one `vessel-shim` process per pod runs the pod's microVM, whose
//! PID 1 is `vessel-agent`, reached through the shim's hybrid vsock socket. See
//! docs/vm-pods.md for the files, the shim spec and its control protocol.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::flat;
use tonic::transport::Channel;
use vessel_agent::proto::{self as ap, agent_client::AgentClient};

/// The guest port the agent serves its API on.
pub const AGENT_PORT: u32 = 1024;
/// The host port the agent sends container logs to.
pub const LOG_PORT: u32 = 1025;
/// Where `WriteFiles` may write in the guest; the pod's own files are under `pod/`.
pub const GUEST_FILES: &str = "/run/vessel/files";

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("starting the VM shim {binary}: {source}")]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the VM shim exited during boot ({status}): {detail}")]
    ShimExited { status: String, detail: String },
    #[error("the guest agent did not answer within {timeout:?} of the VM's start: {detail}")]
    BootTimeout { timeout: Duration, detail: String },
    #[error("VM shim control {op}: {detail}")]
    Control { op: String, detail: String },
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> VmError {
    let path = path.to_path_buf();
    move |source| VmError::Io { op, path, source }
}

/// What a VM pod is booted with.
pub struct LaunchSpec<'a> {
    pub shim_binary: &'a Path,
    pub kernel: &'a Path,
    pub root: &'a crate::config::GuestRoot,
    pub dir: &'a Path,
    pub vcpus: u8,
    pub mem_mib: u64,
    pub spare_disks: u32,
    pub console_log: bool,
    pub boot_timeout: Duration,
    pub log_level: &'a str,
}

/// Paths of a VM pod's files in its directory.
pub struct VmPaths {
    pub spec: PathBuf,
    pub vsock: PathBuf,
    pub control: PathBuf,
    pub console: PathBuf,
    pub shim_log: PathBuf,
}

impl VmPaths {
    pub fn new(dir: &Path) -> VmPaths {
        VmPaths {
            spec: dir.join("spec.json"),
            vsock: dir.join("v.sock"),
            control: dir.join("ctl.sock"),
            console: dir.join("console.log"),
            shim_log: dir.join("shim.log"),
        }
    }
}

/// A started shim.
#[derive(Debug, Clone)]
pub struct Launched {
    pub pid: u32,
    pub start_time: u64,
}

/// The shim spec for a pod (docs/vm-pods.md).
pub fn shim_spec(spec: &LaunchSpec<'_>) -> serde_json::Value {
    let p = VmPaths::new(spec.dir);
    let (initrd, disks, cmdline) = match spec.root {
        crate::config::GuestRoot::Initrd(i) => (Some(i.clone()), vec![], ""),
        // The root disk is the first virtio-blk device, before the spare slots: /dev/vda.
        crate::config::GuestRoot::Erofs(r) => (
            None,
            vec![serde_json::json!({"path": r, "read_only": true, "serial": "vessel-root"})],
            "root=/dev/vda rootfstype=erofs ro init=/init",
        ),
    };
    serde_json::json!({
        "kernel": spec.kernel,
        "initrd": initrd,
        "disks": disks,
        "cmdline": cmdline,
        "mem_mib": spec.mem_mib,
        "vcpus": spec.vcpus,
        "console": if spec.console_log {
            serde_json::json!({"file": p.console})
        } else {
            serde_json::json!("off")
        },
        "verbose": spec.console_log,
        "stop_timeout_ms": 5000,
        "vsock": {"guest_cid": 3, "uds_path": p.vsock},
        "spare_disks": spec.spare_disks,
        "control_socket": p.control,
        "log_port": LOG_PORT,
    })
}

/// Writes the spec and starts the shim as a session leader that outlives vesseld. Returns
/// once the process runs; [`wait_for_agent`] waits for the guest.
pub fn spawn(spec: &LaunchSpec<'_>) -> Result<Launched, VmError> {
    let p = VmPaths::new(spec.dir);
    std::fs::create_dir_all(spec.dir).map_err(io("create", spec.dir))?;
    for f in [&p.vsock, &p.control] {
        let _ = std::fs::remove_file(f);
    }
    let data = serde_json::to_vec_pretty(&shim_spec(spec)).unwrap_or_default();
    vessel_images::fsutil::atomic_write_fast(&p.spec, &data).map_err(io("write", &p.spec))?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&p.shim_log)
        .map_err(io("open", &p.shim_log))?;
    let log2 = log.try_clone().map_err(io("dup", &p.shim_log))?;
    let mut cmd = std::process::Command::new(spec.shim_binary);
    cmd.arg("run")
        .arg("--spec")
        .arg(&p.spec)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .env("VESSEL_LOG", spec.log_level)
        .env_remove("RUST_LOG");
    // SAFETY: setsid(2) is async-signal-safe and touches no memory of the parent; the shim
    // becomes a session leader so that it outlives vesseld and its process group.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|source| VmError::Spawn {
        binary: spec.shim_binary.to_path_buf(),
        source,
    })?;
    let pid = child.id();
    // The Child is dropped without waiting: vesseld reaps the shim by pid (flat::reap).
    drop(child);
    let start_time = flat::process_start_time(pid).unwrap_or(0);
    Ok(Launched { pid, start_time })
}

/// Connects to the guest agent, retrying while the guest boots, until `timeout` or the shim
/// exits.
pub async fn wait_for_agent(
    dir: &Path,
    shim: &Launched,
    timeout: Duration,
) -> Result<AgentClient<Channel>, VmError> {
    let p = VmPaths::new(dir);
    let start = Instant::now();
    let mut last = String::from("not tried");
    loop {
        flat::reap(shim.pid);
        if !flat::is_alive(shim.pid, shim.start_time) {
            let mut detail = flat::log_tail(&p.shim_log, 6);
            if p.console.exists() {
                detail.push_str(" | console: ");
                detail.push_str(&flat::log_tail(&p.console, 6));
            }
            return Err(VmError::ShimExited {
                status: "exited".into(),
                detail,
            });
        }
        if p.vsock.exists() {
            let left = timeout.saturating_sub(start.elapsed());
            match vessel_agent::client::connect_hybrid_vsock(
                &p.vsock,
                AGENT_PORT,
                left.min(Duration::from_secs(2)),
            )
            .await
            {
                Ok(mut c) => match c.ping(vessel_agent::proto::PingRequest {}).await {
                    Ok(_) => return Ok(c),
                    Err(s) => last = format!("ping: {}", s.message()),
                },
                Err(e) => last = e.to_string(),
            }
        }
        if start.elapsed() >= timeout {
            return Err(VmError::BootTimeout {
                timeout,
                detail: format!("{last}; shim log: {}", flat::log_tail(&p.shim_log, 4)),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Stops a shim: SIGTERM (the guest gets the power button), then SIGKILL after `grace`.
/// Idempotent.
pub async fn stop_shim(pid: u32, start_time: u64, grace: Duration) {
    flat::reap(pid);
    if !flat::is_alive(pid, start_time) {
        return;
    }
    // SAFETY: kill(2) on a pid we verified (by start time) to be our shim.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
    let _ = tokio::time::timeout(grace, flat::wait_exit(pid, start_time)).await;
    flat::kill_agent(pid, start_time);
}

/// One request to a shim's control socket (blocking; call from spawn_blocking): the
/// answer, or the shim's error as a [`VmError::Control`].
pub fn control(
    path: &Path,
    req: &serde_json::Value,
    fd: Option<BorrowedFd<'_>>,
) -> Result<serde_json::Value, VmError> {
    let op = req["op"].as_str().unwrap_or("?").to_string();
    let err = |detail: String| VmError::Control {
        op: op.clone(),
        detail,
    };
    let mut c = vessel_shim::control::Client::connect(path).map_err(|e| err(e.to_string()))?;
    let v = c.request(req, fd).map_err(|e| err(e.to_string()))?;
    if v["ok"].as_bool() != Some(true) {
        return Err(err(v["error"]
            .as_str()
            .unwrap_or("no reason given")
            .to_string()));
    }
    Ok(v)
}

/// Opens (creating) a container's log file for appending and hands it to the shim.
pub fn set_log(control: &Path, id: &str, log_path: &Path) -> Result<(), VmError> {
    let f = vessel_agent::logs::open_log_nofollow(log_path).map_err(io("open", log_path))?;
    self::control(
        control,
        &serde_json::json!({"op": "set_log", "id": id}),
        Some(f.as_fd()),
    )?;
    Ok(())
}

/// The serial id a layer's disk carries: the first 20 hex digits of its diff ID.
pub fn layer_serial(diff_id: &str) -> String {
    let hex = diff_id.rsplit(':').next().unwrap_or(diff_id);
    hex.chars().take(20).collect()
}

/// vCPUs and guest memory for a pod: its resources if it has limits, the defaults if not.
pub fn size_of(
    pod: &k8s_cri::v1::PodSandboxConfig,
    default_vcpus: u8,
    default_mib: u64,
    overhead_mib: u64,
) -> (u8, u64) {
    let host_cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(254) as u8;
    let r = pod.linux.as_ref().and_then(|l| l.resources.as_ref());
    let vcpus = match r {
        Some(r) if r.cpu_quota > 0 && r.cpu_period > 0 => {
            ((r.cpu_quota + r.cpu_period - 1) / r.cpu_period).clamp(1, 254) as u8
        }
        _ => default_vcpus,
    }
    .clamp(1, host_cpus.max(1));
    let mib = match r {
        Some(r) if r.memory_limit_in_bytes > 0 => {
            ((r.memory_limit_in_bytes as u64).div_ceil(1 << 20) + overhead_mib).max(64)
        }
        _ => default_mib,
    };
    (vcpus, mib)
}

/// A CRI mount copied into the guest: where the spec's bind mount now comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopiedMount {
    pub container_path: String,
    pub host_path: String,
    pub guest_path: String,
}

/// Reads the host paths of a container's CRI mounts as `WriteFiles` entries under
/// `<GUEST_FILES>/ctr/<id>/<n>`: regular files, directories and symlinks, with their modes
/// and owners; other file types are skipped. More than `limit` bytes in all is an error.
pub fn copy_in_mounts(
    id: &str,
    mounts: &[k8s_cri::v1::Mount],
    limit: u64,
) -> Result<(Vec<ap::FileEntry>, Vec<CopiedMount>), String> {
    use std::os::unix::fs::MetadataExt;
    let mut entries = Vec::new();
    let mut copied = Vec::new();
    let mut total = 0u64;
    fn walk(
        host: &Path,
        guest: &str,
        top: bool,
        entries: &mut Vec<ap::FileEntry>,
        total: &mut u64,
        limit: u64,
    ) -> Result<(), String> {
        // The mount source itself may be a symlink (kubelet's /etc/hosts is not, but
        // projected volumes use them inside); inside a tree, links are copied as links.
        let md = if top {
            std::fs::metadata(host)
        } else {
            std::fs::symlink_metadata(host)
        }
        .map_err(|e| format!("mount source {}: {e}", host.display()))?;
        let base = |kind| ap::FileEntry {
            path: guest.to_string(),
            mode: md.mode() & 0o7777,
            uid: md.uid(),
            gid: md.gid(),
            kind: Some(kind),
        };
        let ft = md.file_type();
        if ft.is_symlink() {
            let t = std::fs::read_link(host).map_err(|e| format!("{}: {e}", host.display()))?;
            entries.push(base(ap::file_entry::Kind::Symlink(t.display().to_string())));
        } else if ft.is_dir() {
            entries.push(base(ap::file_entry::Kind::Dir(true)));
            let mut names: Vec<_> = std::fs::read_dir(host)
                .map_err(|e| format!("{}: {e}", host.display()))?
                .flatten()
                .map(|e| e.file_name())
                .collect();
            names.sort();
            for n in names {
                let g = format!("{guest}/{}", n.to_string_lossy());
                walk(&host.join(&n), &g, false, entries, total, limit)?;
            }
        } else if ft.is_file() {
            *total += md.len();
            if *total > limit {
                return Err(format!(
                    "mounts copied into a VM pod may hold at most {} MiB (vm.copy_in_limit_mib); {} goes beyond",
                    limit >> 20,
                    host.display()
                ));
            }
            let data = std::fs::read(host).map_err(|e| format!("{}: {e}", host.display()))?;
            entries.push(base(ap::file_entry::Kind::Data(data)));
        } else {
            tracing::debug!(path = %host.display(), "not copied into the VM: not a file, dir or link");
        }
        Ok(())
    }
    for (i, m) in mounts.iter().enumerate() {
        let guest = format!("{GUEST_FILES}/ctr/{id}/{i}");
        walk(
            Path::new(&m.host_path),
            &guest,
            true,
            &mut entries,
            &mut total,
            limit,
        )?;
        copied.push(CopiedMount {
            container_path: m.container_path.clone(),
            host_path: m.host_path.clone(),
            guest_path: guest,
        });
    }
    Ok((entries, copied))
}

/// Points the spec's bind mounts of copied-in host paths at their guest copies.
pub fn rewrite_mount_sources(spec: &mut serde_json::Value, copied: &[CopiedMount]) {
    let Some(mounts) = spec["mounts"].as_array_mut() else {
        return;
    };
    for m in mounts {
        let dest = m["destination"].as_str().unwrap_or_default().to_string();
        let src = m["source"].as_str().unwrap_or_default().to_string();
        if let Some(c) = copied
            .iter()
            .find(|c| c.container_path == dest && c.host_path == src)
        {
            m["source"] = serde_json::json!(c.guest_path);
            // Propagation between host and guest does not exist; keep the guest's private.
            if let Some(opts) = m["options"].as_array_mut() {
                for o in opts.iter_mut() {
                    if matches!(o.as_str(), Some("rslave" | "rshared" | "slave" | "shared")) {
                        *o = serde_json::json!("rprivate");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_cri::v1 as cri;

    #[test]
    fn sizes_follow_the_pod_resources() {
        let mut pod = cri::PodSandboxConfig::default();
        assert_eq!(size_of(&pod, 1, 256, 64), (1, 256));
        pod.linux = Some(cri::LinuxPodSandboxConfig {
            resources: Some(cri::LinuxContainerResources {
                cpu_quota: 150_000,
                cpu_period: 100_000,
                memory_limit_in_bytes: 100 << 20,
                ..Default::default()
            }),
            ..Default::default()
        });
        let host = std::thread::available_parallelism().unwrap().get();
        assert_eq!(size_of(&pod, 1, 256, 64), (2.min(host) as u8, 164));
    }

    #[test]
    fn mounts_are_copied_in_and_rewritten() {
        let d = tempfile::tempdir().unwrap();
        let vol = d.path().join("vol");
        std::fs::create_dir_all(vol.join("sub")).unwrap();
        std::fs::write(vol.join("sub/a"), "hello").unwrap();
        std::os::unix::fs::symlink("sub/a", vol.join("link")).unwrap();
        let file = d.path().join("hosts");
        std::fs::write(&file, "127.0.0.1 x\n").unwrap();
        let mounts = vec![
            cri::Mount {
                container_path: "/data".into(),
                host_path: vol.display().to_string(),
                ..Default::default()
            },
            cri::Mount {
                container_path: "/etc/hosts".into(),
                host_path: file.display().to_string(),
                propagation: cri::MountPropagation::PropagationHostToContainer as i32,
                ..Default::default()
            },
        ];
        let (entries, copied) = copy_in_mounts("c1", &mounts, 1 << 20).unwrap();
        let paths: Vec<&str> = entries.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/run/vessel/files/ctr/c1/0",
                "/run/vessel/files/ctr/c1/0/link",
                "/run/vessel/files/ctr/c1/0/sub",
                "/run/vessel/files/ctr/c1/0/sub/a",
                "/run/vessel/files/ctr/c1/1",
            ]
        );
        assert!(matches!(&entries[1].kind, Some(ap::file_entry::Kind::Symlink(t)) if t == "sub/a"));
        assert!(matches!(&entries[3].kind, Some(ap::file_entry::Kind::Data(b)) if b == b"hello"));
        let mut spec = serde_json::json!({"mounts": [
            {"destination": "/proc", "source": "proc"},
            {"destination": "/etc/hosts", "source": file, "options": ["rbind", "rslave", "ro"]},
        ]});
        rewrite_mount_sources(&mut spec, &copied);
        assert_eq!(spec["mounts"][1]["source"], "/run/vessel/files/ctr/c1/1");
        assert_eq!(spec["mounts"][1]["options"][1], "rprivate");
        assert_eq!(spec["mounts"][0]["source"], "proc");
        let e = copy_in_mounts("c1", &mounts, 3).unwrap_err();
        assert!(e.contains("copy_in_limit_mib"), "{e}");
    }

    #[test]
    fn serials_are_twenty_hex_digits() {
        assert_eq!(
            layer_serial("sha256:0123456789abcdef0123456789abcdef"),
            "0123456789abcdef0123"
        );
    }

    #[test]
    fn spec_has_what_the_shim_needs() {
        let d = tempfile::tempdir().unwrap();
        let s = shim_spec(&LaunchSpec {
            shim_binary: Path::new("/bin/false"),
            kernel: Path::new("/k"),
            root: &crate::config::GuestRoot::Erofs("/r.erofs".into()),
            dir: d.path(),
            vcpus: 2,
            mem_mib: 256,
            spare_disks: 4,
            console_log: false,
            boot_timeout: Duration::from_secs(1),
            log_level: "info",
        });
        assert_eq!(s["spare_disks"], 4);
        assert_eq!(s["log_port"], LOG_PORT);
        assert_eq!(s["console"], "off");
        assert_eq!(s["disks"][0]["serial"], "vessel-root");
        assert!(s["cmdline"].as_str().unwrap().contains("root=/dev/vda"));
        assert!(s["vsock"]["uds_path"]
            .as_str()
            .unwrap()
            .starts_with(d.path().to_str().unwrap()));
    }
}
