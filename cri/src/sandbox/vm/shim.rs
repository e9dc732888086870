//! A VM pod's shim process: its spec, start, boot wait, stop and control requests. See
//! docs/vm-pods.md for the files, the shim spec and its control protocol.

use std::os::fd::BorrowedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::sandbox::process;
use crate::sandbox::{AGENT_PORT, LOG_PORT};
use tonic::transport::Channel;
use vessel_agent::proto::agent_client::AgentClient;

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
    #[error(transparent)]
    Io(#[from] crate::errors::IoAt),
    #[error("the VM shim exited during boot ({status}): {detail}")]
    ShimExited { status: String, detail: String },
    #[error("the guest agent did not answer within {timeout:?} of the VM's start: {detail}")]
    BootTimeout { timeout: Duration, detail: String },
    #[error(
        "the VM shim did not bind its control socket within {timeout:?} of its start: {detail}"
    )]
    NoControl { timeout: Duration, detail: String },
    #[error("VM shim control {op}: {detail}")]
    Control { op: String, detail: String },
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> VmError {
    crate::errors::io_at(op, path)
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
    /// What the VMM's seccomp filters do with a call outside a thread's list.
    pub seccomp: vessel_shim::seccomp::Mode,
    pub boot_timeout: Duration,
    pub log_level: &'a str,
    /// The pod's network namespace with its CNI interface, if it has one.
    pub pod_net: Option<vessel_shim::podnet::PodNet>,
    /// The pod's share of volumes (virtio-fs), if it has one.
    pub shared_dir: Option<PathBuf>,
    /// The secret of the shim's log port (empty: none).
    pub log_token: &'a str,
    /// The pod's own user namespace, if it has one: made in the guest at boot
    /// (`vessel.userns`), and the share's owners shown through it.
    pub userns: Option<&'a crate::userns::PodUserns>,
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
    /// When it was spawned (boot timing).
    pub at: Instant,
}

/// The shim spec for a pod (docs/vm-pods.md), as the shim's own types.
pub fn shim_spec(spec: &LaunchSpec<'_>) -> vessel_shim::Spec {
    use vessel_vmm::virtio::share_fs::{IdRange, IdShift};
    use vessel_vmm::vm::{Console, DiskConfig, SharedDirConfig, VmConfig, VsockConfig};
    let p = VmPaths::new(spec.dir);
    let (initrd, disks, cmdline) = match spec.root {
        crate::config::GuestRoot::Initrd(i) => (Some(i.clone()), vec![], ""),
        // The root disk is the first virtio-blk device, before the spare slots: /dev/vda.
        crate::config::GuestRoot::Erofs(r) => (
            None,
            vec![DiskConfig {
                path: r.clone(),
                read_only: true,
                serial: "vessel-root".into(),
            }],
            "root=/dev/vda rootfstype=erofs ro init=/init",
        ),
    };
    let mut cmdline = cmdline.to_string();
    if let Some(u) = spec.userns {
        let [uid, gid] = u.flags();
        cmdline = format!("{cmdline} vessel.userns={uid},{gid}")
            .trim()
            .to_string();
    }
    let id_shift = spec.userns.map(|u| {
        let range = |m: &vessel_cri_api::v1::IdMapping| IdRange {
            disk: m.container_id,
            guest: m.host_id,
            size: m.length,
        };
        IdShift {
            uid: range(&u.uid),
            gid: range(&u.gid),
        }
    });
    vessel_shim::Spec {
        vm: VmConfig {
            kernel: spec.kernel.to_path_buf(),
            initrd,
            cmdline,
            mem_mib: spec.mem_mib,
            vcpus: spec.vcpus,
            console: if spec.console_log {
                Console::File(p.console.clone())
            } else {
                Console::Off
            },
            verbose: spec.console_log,
            kvm_device: PathBuf::from("/dev/kvm"),
            stop_timeout_ms: 5000,
            disks,
            spare_disks: spec.spare_disks as usize,
            nets: vec![],
            vsock: Some(VsockConfig {
                guest_cid: 3,
                uds_path: p.vsock.clone(),
            }),
            shared_dirs: spec
                .shared_dir
                .iter()
                .map(|d| SharedDirConfig {
                    tag: super::volumes::SHARED_TAG.into(),
                    path: d.clone(),
                    id_shift,
                })
                .collect(),
        },
        shim: vessel_shim::ShimConfig {
            control_socket: Some(p.control.clone()),
            log_port: Some(LOG_PORT),
            log_token: (!spec.log_token.is_empty()).then(|| spec.log_token.to_string()),
            pod_net: spec.pod_net.clone(),
            log_file: Some(p.shim_log.clone()),
            jail: true,
            seccomp: spec.seccomp,
        },
    }
}

/// Writes the spec and starts the shim as a session leader that outlives vesseld. Returns
/// once the process runs; [`wait_for_agent`] waits for the guest.
pub fn spawn(spec: &LaunchSpec<'_>) -> Result<Launched, VmError> {
    let p = VmPaths::new(spec.dir);
    std::fs::create_dir_all(spec.dir).map_err(io("create", spec.dir))?;
    for f in [&p.vsock, &p.control] {
        let _ = std::fs::remove_file(f);
    }
    let value = shim_spec(spec).to_value().map_err(|e| VmError::Control {
        op: "spec".into(),
        detail: e.to_string(),
    })?;
    let data = serde_json::to_vec_pretty(&value).unwrap_or_default();
    vessel_images::fsutil::atomic_write_fast(&p.spec, &data).map_err(io("write", &p.spec))?;
    // Not through a link: the VM directory is writable by the (jailed) VMM.
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .custom_flags(libc::O_NOFOLLOW)
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
        .env_remove("RUST_LOG")
        // Only vesseld talks to its service manager.
        .env_remove("NOTIFY_SOCKET");
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
    // The Child is dropped without waiting: vesseld reaps the shim by pid (process::reap).
    drop(child);
    let start_time = process::process_start_time(pid).unwrap_or(0);
    Ok(Launched {
        pid,
        start_time,
        at: Instant::now(),
    })
}

/// Connects to the guest agent once it serves, until `timeout` or the shim exits.
///
/// The shim says when the agent serves (its `vessel-event: agent-serving` console line,
/// through [`wait_for_serving`]); only then do we connect. Knocking on the agent's port
/// while the guest boots would cost the guest an interrupt and a reply per knock: on the
/// nested harness's one emulated CPU, 20 ms knocks made a VM pod's boot ~1 s slower. Should
/// the shim not say (it exited, or its control socket failed), we knock every 20 ms.
pub async fn wait_for_agent(
    dir: &Path,
    shim: &Launched,
    timeout: Duration,
) -> Result<(AgentClient<Channel>, Vec<String>), VmError> {
    let p = VmPaths::new(dir);
    let start = Instant::now();
    let mut last = String::from("not tried");
    if let Err(e) = wait_for_serving(&p.control, shim, timeout).await {
        tracing::debug!(dir = %dir.display(), error = %e, "no word from the shim on the agent: polling its port");
        last = format!("shim: {e}");
    }
    loop {
        if shim_gone(shim) {
            let mut detail = process::log_tail(&p.shim_log, 6);
            if p.console.exists() {
                detail.push_str(" | console: ");
                detail.push_str(&process::log_tail(&p.console, 6));
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
                    Ok(r) => return Ok((c, r.into_inner().features)),
                    Err(s) => last = format!("ping: {}", s.message()),
                },
                Err(e) => last = e.to_string(),
            }
        }
        if start.elapsed() >= timeout {
            return Err(VmError::BootTimeout {
                timeout,
                detail: format!("{last}; shim log: {}", process::log_tail(&p.shim_log, 4)),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether the shim has exited (reaped here if it is our child).
fn shim_gone(shim: &Launched) -> bool {
    process::reap(shim.pid);
    !process::is_alive(shim.pid, shim.start_time)
}

/// Waits until the shim has bound its control socket, which it does after it made the pod's
/// tap and before it builds the VM: an error when the shim exits first or `timeout` passes.
pub async fn wait_for_control(
    dir: &Path,
    shim: &Launched,
    timeout: Duration,
) -> Result<(), VmError> {
    let p = VmPaths::new(dir);
    control_socket(&p.control, shim, timeout)
        .await
        .map_err(|e| {
            if shim_gone(shim) {
                VmError::ShimExited {
                    status: "exited".into(),
                    detail: process::log_tail(&p.shim_log, 6),
                }
            } else {
                VmError::NoControl {
                    timeout,
                    detail: format!("{e}; shim log: {}", process::log_tail(&p.shim_log, 4)),
                }
            }
        })
}

async fn control_socket(ctl: &Path, shim: &Launched, timeout: Duration) -> Result<(), String> {
    let start = Instant::now();
    while !ctl.exists() {
        if shim_gone(shim) {
            return Err("the shim exited".into());
        }
        if start.elapsed() >= timeout {
            return Err("no control socket".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// Waits, through the shim's control socket, until the guest agent serves: `Ok` when it
/// does, an error when the shim exits first, cannot be asked, or `timeout` passes.
async fn wait_for_serving(ctl: &Path, shim: &Launched, timeout: Duration) -> Result<(), String> {
    use vessel_shim::control::{Client, Request};
    let start = Instant::now();
    control_socket(ctl, shim, timeout).await?;
    let left = timeout.saturating_sub(start.elapsed());
    let ctl = ctl.to_path_buf();
    let spawned = shim.at;
    tokio::task::spawn_blocking(move || {
        let mut c = Client::connect(&ctl).map_err(|e| e.to_string())?;
        // The shim answers by `left`; a shim that hangs must not hold us much longer.
        c.set_timeout(left + Duration::from_secs(2))
            .map_err(|e| e.to_string())?;
        let req = Request::WaitEvent {
            name: "agent-serving".into(),
            timeout_ms: u64::try_from(left.as_millis()).unwrap_or(u64::MAX),
        };
        match c.call(&req, None) {
            Ok(r) if r.ok => {
                // Where the boot went, from the guest's events (`ms`: since the shim was
                // spawned).
                let at = spawned.elapsed().as_secs_f64() * 1e3;
                for e in r.events.unwrap_or_default() {
                    let ms = at - e.ago_us as f64 / 1e3;
                    tracing::debug!(event = %e.name, ms, "guest boot event");
                }
                Ok(())
            }
            Ok(r) => Err(r.error.unwrap_or_else(|| "refused".into())),
            Err(e) => Err(e.to_string()),
        }
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Stops a shim: SIGTERM (the guest gets the power button), then SIGKILL after `grace`.
/// Idempotent.
pub async fn stop_shim(pid: u32, start_time: u64, grace: Duration) {
    process::terminate(pid, start_time, grace).await
}

/// One request to a shim's control socket (blocking; call from spawn_blocking): the
/// answer, or the shim's error as a [`VmError::Control`].
pub fn control(
    path: &Path,
    req: &vessel_shim::control::Request,
    fd: Option<BorrowedFd<'_>>,
) -> Result<vessel_shim::control::Reply, VmError> {
    let err = |detail: String| VmError::Control {
        op: format!("{req:?}"),
        detail,
    };
    let mut c = vessel_shim::control::Client::connect(path).map_err(|e| err(e.to_string()))?;
    let r = c.call(req, fd).map_err(|e| err(e.to_string()))?;
    if !r.ok {
        return Err(err(r.error.unwrap_or_else(|| "no reason given".into())));
    }
    Ok(r)
}

/// The serial id a layer's disk carries: the first 20 hex digits of its diff ID.
pub fn layer_serial(diff_id: &str) -> String {
    let hex = diff_id.rsplit(':').next().unwrap_or(diff_id);
    hex.chars().take(20).collect()
}

/// vCPUs and guest memory for a pod: its resources if it has limits, the defaults if not.
pub fn size_of(
    pod: &vessel_cri_api::v1::PodSandboxConfig,
    default_vcpus: u8,
    default_mib: u64,
    overhead_mib: u64,
) -> (u8, u64) {
    let host_cpus = std::thread::available_parallelism()
        .map(|n| u8::try_from(n.get().min(254)).unwrap_or(254))
        .unwrap_or(1);
    let r = pod.linux.as_ref().and_then(|l| l.resources.as_ref());
    let vcpus = match r {
        Some(r) if r.cpu_quota > 0 && r.cpu_period > 0 => {
            // Ceiling division without overflow for any quota a request carries.
            let n = r.cpu_quota / r.cpu_period + i64::from(r.cpu_quota % r.cpu_period != 0);
            u8::try_from(n.clamp(1, 254)).unwrap_or(254)
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

#[cfg(test)]
mod tests {
    use super::*;
    use vessel_cri_api::v1 as cri;

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
        assert_eq!(
            size_of(&pod, 1, 256, 64),
            (u8::try_from(2.min(host)).unwrap(), 164)
        );
        // A quota near i64::MAX sizes the VM to the host, without overflow.
        if let Some(r) = pod.linux.as_mut().and_then(|l| l.resources.as_mut()) {
            r.cpu_quota = i64::MAX;
            r.cpu_period = 3;
        }
        assert_eq!(
            size_of(&pod, 1, 256, 64).0,
            u8::try_from(host.min(254)).unwrap()
        );
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
            seccomp: vessel_shim::seccomp::Mode::Enforce,
            boot_timeout: Duration::from_secs(1),
            log_level: "info",
            pod_net: Some(vessel_shim::podnet::PodNet {
                netns: "/run/vessel/netns/p".into(),
                peer: "eth0".into(),
                tap: crate::sandbox::vm::TAP.into(),
                deferred: true,
            }),
            shared_dir: Some(d.path().join("shared")),
            userns: None,
            log_token: "0123abcd",
        })
        .to_value()
        .unwrap();
        assert_eq!(s["pod_net"]["netns"], "/run/vessel/netns/p");
        let back = vessel_shim::Spec::from_value(s.clone()).unwrap();
        let net = back.shim.pod_net.unwrap();
        assert_eq!(net.peer, "eth0");
        assert!(net.deferred);
        assert_eq!(s["spare_disks"], 4);
        assert_eq!(s["shared_dirs"][0]["tag"], "vessel");
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
