//! The VM sandbox backend: one `vessel-shim` process per pod runs the pod's microVM, whose
//! PID 1 is `vessel-agent`, reached through the shim's hybrid vsock socket. Image layers
//! reach the guest as EROFS disks in the VM's spare slots ([`VmBackend::attach_layers`]);
//! container logs come back over vsock to the shim, which writes them to the files vesseld
//! hands it (`set_log`); the host paths of CRI mounts are shared with virtio-fs
//! ([`volumes`]). See docs/vm-pods.md.

pub mod pin;
pub mod shim;
pub mod volumes;

pub use shim::{VmError, VmPaths, GUEST_FILES};

use super::{
    netns, network, process, AgentAddr, ContainerRequest, Dump, ForwardTarget, HostShare, Pod,
    PodLayout, PreparedContainer, SandboxBackend, AGENT_PORT, LOG_PORT,
};
use crate::errors::{agent_err, internal, Result, RuntimeError};
use crate::state::{
    BackendKind, BackendState, ContainerRecord, PodRecord, PodState, StateDirs, VmPodState,
};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use vessel_agent::proto as ap;
use vessel_cri_api::v1 as cri;
use vessel_images::ImageStore;
use vessel_shim::control::Request as ControlRequest;
use vessel_shim::podnet::PodNet;

/// The tap the shim makes in a VM pod's namespace, joined to the CNI interface.
const TAP: &str = vessel_shim::podnet::DEFAULT_TAP;

/// The VM backend and what it needs from the node.
pub struct VmBackend {
    pub shim_binary: PathBuf,
    pub cfg: crate::config::VmConfig,
    /// What the guest boots from (initrd or EROFS root disk).
    pub guest_root: crate::config::GuestRoot,
    pub log_level: String,
    pub dirs: StateDirs,
    pub store: Arc<ImageStore>,
    pub cni: crate::cni::Cni,
}

fn vm_of(rec: &PodRecord) -> VmPodState {
    match &rec.backend {
        BackendState::Vm { vm } => vm.clone(),
        BackendState::Flat {} => VmPodState::default(),
    }
}

/// A new log-port secret: 128 random bits, hex. Without randomness (getrandom failing) the
/// pod gets none and its log port is unauthenticated, which is logged.
fn new_log_token() -> String {
    let mut b = [0u8; 16];
    match rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()) {
        Ok(16) => b.iter().map(|x| format!("{x:02x}")).collect(),
        r => {
            tracing::warn!(result = ?r, "no randomness for the log port's secret: the pod's log port takes any guest connection");
            String::new()
        }
    }
}

/// One request to the pod's shim control socket, off the async threads.
async fn control(
    v: &VmPodState,
    req: ControlRequest,
    fd: Option<std::os::fd::OwnedFd>,
) -> std::result::Result<vessel_shim::control::Reply, VmError> {
    use std::os::fd::AsFd;
    let ctl = v.control.clone();
    tokio::task::spawn_blocking(move || shim::control(&ctl, &req, fd.as_ref().map(|f| f.as_fd())))
        .await
        .map_err(|e| VmError::Control {
            op: "spawn".into(),
            detail: e.to_string(),
        })?
}

/// Opens (creating) a container's log file and hands it to the shim.
async fn set_log(v: &VmPodState, id: &str, log_path: &str) -> std::result::Result<(), VmError> {
    let path = Path::new(log_path);
    let f = vessel_agent::logs::open_log_nofollow(path)
        .map_err(crate::errors::io_at::<VmError>("open", path))?;
    control(v, ControlRequest::SetLog { id: id.into() }, Some(f.into()))
        .await
        .map(|_| ())
}

#[tonic::async_trait]
impl SandboxBackend for VmBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Vm
    }

    fn layout(&self, id: &str, config: &cri::PodSandboxConfig, _share: HostShare) -> PodLayout {
        let dir = self.dirs.vm_dir(id);
        let paths = VmPaths::new(&dir);
        let (vcpus, mem_mib) = self.size_of(config);
        PodLayout {
            agent_socket: paths.vsock.clone(),
            // On the host, the namespace CNI configures and the VM's tap joins; inside the
            // guest, the guest's own network stack is the pod's.
            netns_path: self.dirs.netns_dir().join(id),
            state: BackendState::Vm {
                vm: VmPodState {
                    dir,
                    vsock: paths.vsock,
                    control: paths.control,
                    vcpus,
                    mem_mib,
                    slots: vec![String::new(); self.cfg.spare_disks as usize],
                    log_token: new_log_token(),
                },
            },
        }
    }

    fn agent_addr(&self, rec: &PodRecord) -> AgentAddr {
        AgentAddr::HybridVsock {
            uds: rec.agent_socket.clone(),
            port: AGENT_PORT,
        }
    }

    /// Boots the VM: the shim, then the agent in the guest, then the pod's identity and
    /// files in the guest.
    async fn start(&self, pod: &Pod, config: &cri::PodSandboxConfig) -> Result<()> {
        let rec = pod.record();
        let v = vm_of(&rec);
        let fail = |e: VmError| internal(format!("pod {}", rec.id))(e);
        // A VM that did not come up in time is DeadlineExceeded.
        let timed_out = |e: VmError| match e {
            VmError::BootTimeout { .. } | VmError::NoControl { .. } => {
                RuntimeError::DeadlineExceeded(format!("pod {}: {e}", rec.id))
            }
            e => fail(e),
        };
        // Each step's end at debug level, with the time since the start began.
        let (t, id) = (std::time::Instant::now(), rec.id.clone());
        let step = |what: &str| tracing::debug!(pod = %id, step = what, ms = t.elapsed().as_secs_f64() * 1e3, "starting the VM pod");
        super::create_log_directory(&rec, config)?;
        let shared_dir =
            volumes::create_share(&v.dir).map_err(internal(format!("pod {}", rec.id)))?;
        netns::create(&rec.netns_path).map_err(internal(format!("pod {}", rec.id)))?;
        // CNI runs while the guest boots: the shim makes its tap in the pod's netns and boots,
        // and once ADD is done the tap is connected to CNI's interface (below). Without a CNI
        // network the pod has loopback only, and no tap.
        // A CNI configuration that cannot work (a plugin missing) fails the pod here, before a
        // VM boots for nothing: ADD would fail the same way.
        let on_cni = match self.cni.ready() {
            Ok(_) => true,
            Err(crate::cni::CniError::NoConfig(_)) => false,
            Err(e) => return Err(crate::errors::cni_err(e)),
        };
        let pod_net = on_cni.then(|| PodNet {
            netns: rec.netns_path.clone(),
            peer: crate::cni::IFNAME.into(),
            tap: TAP.into(),
            deferred: true,
        });
        let cfg = &self.cfg;
        let userns = crate::userns::of_pod(config).map_err(RuntimeError::InvalidArgument)?;
        let launch = shim::LaunchSpec {
            shim_binary: &self.shim_binary,
            kernel: &cfg.kernel,
            root: &self.guest_root,
            dir: &v.dir,
            vcpus: v.vcpus,
            mem_mib: v.mem_mib,
            spare_disks: cfg.spare_disks,
            console_log: cfg.console_log,
            seccomp: cfg.seccomp,
            boot_timeout: Duration::from_secs(cfg.boot_timeout_secs),
            log_level: &self.log_level,
            pod_net: pod_net.clone(),
            shared_dir: Some(shared_dir),
            log_token: &v.log_token,
            userns: userns.as_ref(),
        };
        let boot_started = std::time::Instant::now();
        let launched = shim::spawn(&launch).map_err(fail)?;
        // Saved at once: a crash from here on finds the shim through the Creating record.
        let rec = pod.update(|r| {
            r.agent_pid = launched.pid;
            r.agent_start_time = launched.start_time;
        });
        super::save(&self.dirs, &rec)?;
        step("shim-spawned");
        network::attach(&self.cni, pod, config).await?;
        step("network");
        let attachment = self.cni.cached(&rec.id);
        if attachment.is_some() && pod_net.is_none() {
            return Err(RuntimeError::Unavailable(format!(
                "pod {}: a CNI network was configured while the pod started, after its VM \
                 was made without a network interface; run it again",
                rec.id
            )));
        }
        // The guest's eth0 takes the CNI interface's MAC and MTU (ConfigureSandbox, below).
        let peer = match (&pod_net, &attachment) {
            (Some(net), Some(_)) => {
                shim::wait_for_control(&v.dir, &launched, launch.boot_timeout)
                    .await
                    .map_err(timed_out)?;
                let net = net.clone();
                let peer = tokio::task::spawn_blocking(move || vessel_shim::podnet::connect(&net))
                    .await
                    .map_err(internal(format!("pod {}: the tap", rec.id)))?
                    .map_err(|e| {
                        RuntimeError::Internal(format!(
                            "pod {}: connecting the VM's tap to the pod network: {e}",
                            rec.id
                        ))
                    })?;
                step("tap-connected");
                Some(peer)
            }
            _ => None,
        };
        let (mut c, features) = shim::wait_for_agent(&v.dir, &launched, launch.boot_timeout)
            .await
            .map_err(timed_out)?;
        if peer.is_some()
            && !features
                .iter()
                .any(|f| f == vessel_agent::FEATURE_LINK_ADDR)
        {
            return Err(RuntimeError::FailedPrecondition(format!(
                "pod {}: the guest agent is older than vesseld: it cannot give the guest's \
                 eth0 the pod network's MAC and MTU (rebuild the guest image with this \
                 vessel-agent)",
                rec.id
            )));
        }
        crate::metrics::get().record_vm_boot(boot_started.elapsed());
        step("agent-connected");
        let (mut interfaces, routes) = attachment
            .map(|a| crate::cni::guest_network(&a.result, crate::cni::IFNAME))
            .unwrap_or_default();
        if let Some(peer) = peer {
            if !interfaces.iter().any(|i| i.name == crate::cni::IFNAME) {
                interfaces.push(ap::GuestInterface {
                    name: crate::cni::IFNAME.into(),
                    ..Default::default()
                });
            }
            for i in interfaces
                .iter_mut()
                .filter(|i| i.name == crate::cni::IFNAME)
            {
                i.mac = peer.mac_string();
                i.mtu = u32::from(peer.mtu);
            }
        }
        c.configure_sandbox(ap::ConfigureSandboxRequest {
            hostname: rec.hostname.clone(),
            sysctls: super::net_sysctls(config),
            interfaces,
            routes,
            shared_fs_tag: volumes::SHARED_TAG.into(),
        })
        .await
        .map_err(|s| agent_err(&format!("pod {}", rec.id), s))?;
        step("sandbox-configured");
        // In a pod with its own user namespace, the pod's files are its root's.
        let (uid, gid) = userns
            .as_ref()
            .map_or((0, 0), |u| (u.uid.host_id, u.gid.host_id));
        let file = |name: &str, data: String| ap::FileEntry {
            path: format!("{GUEST_FILES}/pod/{name}"),
            mode: 0o644,
            uid,
            gid,
            kind: Some(ap::file_entry::Kind::Data(data.into_bytes())),
        };
        c.write_files(ap::WriteFilesRequest {
            entries: vec![
                file("hostname", format!("{}\n", rec.hostname)),
                file("hosts", super::hosts_file(&rec.hostname, false)),
                file(
                    "resolv.conf",
                    super::resolv_conf(config.dns_config.as_ref())?,
                ),
            ],
        })
        .await
        .map_err(|s| agent_err(&format!("pod {}", rec.id), s))?;
        step("files-written");
        pod.set_client(Some(c)).await;
        pod.update(|r| r.state = PodState::Ready);
        Ok(())
    }

    fn host_process(&self) -> &'static str {
        "the VM shim"
    }

    async fn after_shutdown(&self, rec: &PodRecord) {
        // The guest powers off after Shutdown; the shim then exits by itself.
        shim::stop_shim(rec.agent_pid, rec.agent_start_time, Duration::from_secs(5)).await;
    }

    async fn teardown(&self, rec: &PodRecord) -> Result<()> {
        let v = vm_of(rec);
        let spec = VmPaths::new(&v.dir).spec;
        process::kill_pod_process(rec.agent_pid, rec.agent_start_time, "--spec", &spec).await;
        // The tap went with the shim; CNI DEL removes the interface and its tc filters.
        let net = network::release(&self.cni, rec).await;
        let dir = v.dir.clone();
        let _ = tokio::task::spawn_blocking(move || volumes::remove_vm_dir(&dir)).await;
        net
    }

    /// The microVM keeps the vCPUs and memory it booted with (the VMM has no CPU or memory
    /// hotplug): a resize that fits in them is taken (the guest's containers get their new
    /// limits by UpdateContainerResources), one that needs more is refused.
    fn resize(&self, rec: &PodRecord, config: &cri::PodSandboxConfig) -> Result<()> {
        let BackendState::Vm { vm } = &rec.backend else {
            return Ok(());
        };
        let (vcpus, mem_mib) = self.size_of(config);
        if vcpus > vm.vcpus || mem_mib > vm.mem_mib {
            return Err(RuntimeError::FailedPrecondition(format!(
                "UpdatePodSandboxResources: VM pod {} runs {} vCPU(s) and {} MiB; the new resources need {vcpus} and {mem_mib} MiB, and a running microVM cannot grow (recreate the pod to resize it)",
                rec.id, vm.vcpus, vm.mem_mib
            )));
        }
        Ok(())
    }

    fn admit_container(&self, prec: &PodRecord, config: &cri::ContainerConfig) -> Result<()> {
        let cdi = crate::cdi::requested(&config.cdi_devices, &config.annotations);
        if !config.devices.is_empty() || !cdi.is_empty() {
            let name = config.metadata.as_ref().map(|m| m.name.as_str());
            return Err(RuntimeError::InvalidArgument(format!(
                "CreateContainer {:?}: host devices{} cannot be passed into a VM pod (pod {})",
                name.unwrap_or_default(),
                if cdi.is_empty() {
                    String::new()
                } else {
                    format!(" (CDI {})", cdi.join(", "))
                },
                prec.id
            )));
        }
        Ok(())
    }

    fn pod_files_dir(&self, _prec: &PodRecord) -> PathBuf {
        PathBuf::from(format!("{GUEST_FILES}/pod"))
    }

    fn cgroup_ns(&self) -> bool {
        true
    }

    /// Layers as EROFS disks in the pod's slots, the log file handed to the shim, the host
    /// paths of CRI mounts shared into the guest.
    async fn prepare_container(
        &self,
        pod: &Pod,
        req: ContainerRequest<'_>,
    ) -> Result<PreparedContainer> {
        let prec = pod.record();
        let key = req.key;
        let (mounts, cid, dir) = (
            req.config.mounts.clone(),
            req.id.to_string(),
            vm_of(&prec).dir,
        );
        let shared =
            tokio::task::spawn_blocking(move || volumes::share_mounts(&dir, &cid, &mounts))
                .await
                .map_err(internal("sharing volumes"))?
                .map_err(|e| match e {
                    RuntimeError::InvalidArgument(m) => {
                        RuntimeError::InvalidArgument(format!("CreateContainer {key:?}: {m}"))
                    }
                    e => e,
                })?;
        volumes::rewrite_mount_sources(req.spec, &shared);
        let serials = self
            .attach_layers(pod, req.layers, &req.layers_in_use)
            .await?;
        if !req.log_path.is_empty() {
            set_log(&vm_of(&prec), req.id, req.log_path)
                .await
                .map_err(internal(format!("pod {}", prec.id)))?;
        }
        Ok(PreparedContainer {
            rootfs: ap::Rootfs {
                kind: Some(ap::rootfs::Kind::Disks(ap::DiskLayersRootfs { serials })),
            },
            log_path: String::new(),
            log_vsock_port: LOG_PORT,
            log_vsock_token: vm_of(&prec).log_token,
        })
    }

    /// Forgets a container's log fd in the shim and takes its volumes out of the share.
    async fn release_container(&self, pod: &Pod, rec: &ContainerRecord) {
        let prec = pod.record();
        let v = vm_of(&prec);
        let (dir, id) = (v.dir.clone(), rec.id.clone());
        let _ = tokio::task::spawn_blocking(move || volumes::unshare_container(&dir, &id)).await;
        if prec.state != PodState::Ready {
            return;
        }
        let _ = control(&v, ControlRequest::DropLog { id: rec.id.clone() }, None).await;
    }

    async fn reopen_log(&self, pod: &Pod, rec: &ContainerRecord) -> Result<()> {
        if rec.log_path.is_empty() {
            return Ok(());
        }
        set_log(&vm_of(&pod.record()), &rec.id, &rec.log_path)
            .await
            .map_err(internal(format!("ReopenContainerLog {}", rec.id)))
    }

    async fn checkpoint(&self, _: &Pod, rec: &ContainerRecord, _: &Dump) -> Result<Vec<u8>> {
        Err(RuntimeError::FailedPrecondition(format!(
            "CheckpointContainer {}: the container is in a VM pod, whose guest has no CRIU; \
             checkpoints are made of flat pods' containers (runtime handler \"flat\")",
            rec.id
        )))
    }

    fn forward_target(&self, rec: &PodRecord) -> Result<ForwardTarget> {
        Ok(ForwardTarget::Vsock {
            uds: rec.agent_socket.clone(),
            port: vessel_agent::vsock::FORWARD_PORT,
        })
    }

    /// The CNI interface's counters in the pod's namespace on the host: every frame of the
    /// guest crosses it (and the tap, which is not counted twice). None once a stop began:
    /// it takes the tap, eth0 and the namespace away.
    fn network_usage(&self, rec: &PodRecord) -> Option<cri::NetworkUsage> {
        if !rec.is_ready() {
            return None;
        }
        netns::network_usage(&rec.netns_path, &[TAP])
    }

    fn info(&self, rec: &PodRecord) -> serde_json::Value {
        let v = vm_of(rec);
        serde_json::json!({
            "dir": v.dir, "vcpus": v.vcpus, "memoryMiB": v.mem_mib,
            "shimPid": rec.agent_pid, "diskSlots": v.slots,
        })
    }

    async fn sweep_orphans(&self, recorded: &[PodRecord], kept: &HashSet<String>) {
        let dirs: HashSet<PathBuf> = recorded
            .iter()
            .filter_map(|r| match &r.backend {
                BackendState::Vm { vm } => Some(vm.dir.clone()),
                BackendState::Flat {} => None,
            })
            .collect();
        let Ok(rd) = std::fs::read_dir(self.dirs.run.join("vms")) else {
            return;
        };
        for e in rd.flatten() {
            if !dirs.contains(&e.path()) && !super::held(kept, &e.file_name().to_string_lossy()) {
                tracing::info!(dir = %e.path().display(), "removing VM files without a pod");
                process::kill_by_arg("--spec", &VmPaths::new(&e.path()).spec);
                volumes::remove_vm_dir(&e.path());
            }
        }
    }
}

impl VmBackend {
    /// The vCPUs and guest memory a pod with `config` gets (at boot; a resize must fit them).
    fn size_of(&self, config: &cri::PodSandboxConfig) -> (u8, u64) {
        shim::size_of(
            config,
            self.cfg.vcpus,
            self.cfg.memory_mib,
            self.cfg.memory_overhead_mib,
        )
    }

    /// Puts each layer's EROFS image in a disk slot of the pod's VM (reusing the slot of a
    /// layer already there, then empty slots, then slots whose layer no container of the pod
    /// uses any more) and returns their serials, bottom layer first. The caller holds the
    /// pod's op lock.
    async fn attach_layers(
        &self,
        pod: &Pod,
        layers: &[String],
        in_use: &HashSet<String>,
    ) -> Result<Vec<String>> {
        let prec = pod.record();
        let v = vm_of(&prec);
        let mut slots = v.slots.clone();
        let mut plan = Vec::new(); // (slot, diff id) to attach
        for l in layers {
            if slots.iter().any(|s| s == l) {
                continue;
            }
            let free = slots
                .iter()
                .position(|s| s.is_empty())
                .or_else(|| {
                    slots
                        .iter()
                        .position(|s| !in_use.contains(s) && !layers.contains(s))
                })
                .ok_or_else(|| {
                    RuntimeError::FailedPrecondition(format!(
                        "pod {}: no free disk slot for layer {l}: the pod's VM has {} (vm.spare_disks) and its containers use them all",
                        prec.id,
                        slots.len()
                    ))
                })?;
            slots[free] = l.clone();
            plan.push((free, l.clone()));
        }
        for (slot, l) in plan {
            let digest: vessel_images::Digest =
                l.parse().map_err(internal(format!("layer {l}")))?;
            let img = self
                .store
                .erofs_layer(&digest)
                .await
                .map_err(internal(format!("EROFS image of layer {l}")))?;
            // The shim is jailed (it sees its VM directory only): it gets the image open.
            let file = std::fs::File::open(&img).map_err(internal(format!(
                "pod {}: opening the EROFS image {} of layer {l}",
                prec.id,
                img.display()
            )))?;
            let req = ControlRequest::AttachDisk {
                slot,
                path: img,
                read_only: true,
                serial: shim::layer_serial(&l),
            };
            control(&v, req, Some(file.into()))
                .await
                .map_err(internal(format!("pod {}", prec.id)))?;
            let rec = pod.update(|r| {
                if let BackendState::Vm { vm } = &mut r.backend {
                    if let Some(s) = vm.slots.get_mut(slot) {
                        *s = l.clone();
                    }
                }
            });
            super::save(&self.dirs, &rec)?;
            tracing::debug!(pod = %prec.id, slot, layer = %l, "layer disk attached");
        }
        Ok(layers.iter().map(|l| shim::layer_serial(l)).collect())
    }
}
