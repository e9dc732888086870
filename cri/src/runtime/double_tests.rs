//! The pod and container state machine over a backend double: no root, no agent, no VM.
//! The double records what the runtime asks of it and can be told to fail a pod's start.

use super::*;
use crate::sandbox::{
    AgentAddr, ContainerRequest, Dump, ForwardTarget, HostShare, PodLayout, PreparedContainer,
};
use crate::state::{BackendState, ContainerState, PodState};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Default)]
struct Double {
    kind: Option<BackendKind>,
    fail_start: AtomicBool,
    /// Its starts take a while (a slow CNI chain, a VM's boot).
    slow_start: AtomicBool,
    calls: Mutex<Vec<String>>,
}

impl Double {
    fn log(&self, what: &str, id: &str) {
        self.calls.lock().unwrap().push(format!("{what} {id}"));
    }
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

#[tonic::async_trait]
impl SandboxBackend for Double {
    fn kind(&self) -> BackendKind {
        self.kind.unwrap_or(BackendKind::Flat)
    }
    fn layout(&self, id: &str, _c: &cri::PodSandboxConfig, _s: HostShare) -> PodLayout {
        PodLayout {
            state: BackendState::Flat {},
            agent_socket: PathBuf::from(format!("/nonexistent/{id}.sock")),
            netns_path: PathBuf::new(),
        }
    }
    fn agent_addr(&self, rec: &PodRecord) -> AgentAddr {
        AgentAddr::Unix(rec.agent_socket.clone())
    }
    async fn start(&self, pod: &Pod, _c: &cri::PodSandboxConfig) -> Result<()> {
        let id = pod.record().id;
        self.log("start", &id);
        if self.slow_start.load(Ordering::SeqCst) {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        }
        if self.fail_start.load(Ordering::SeqCst) {
            return Err(RuntimeError::Internal(format!(
                "pod {id}: the double fails"
            )));
        }
        // The host process is the test itself: alive for as long as the test runs.
        let me = std::process::id();
        pod.update(|r| {
            r.agent_pid = me;
            r.agent_start_time = crate::sandbox::process::process_start_time(me).unwrap_or(0);
            r.state = PodState::Ready;
            r.ips = vec!["10.0.0.9".into()];
        });
        Ok(())
    }
    fn host_process(&self) -> &'static str {
        "the double"
    }
    async fn after_shutdown(&self, rec: &PodRecord) {
        self.log("after_shutdown", &rec.id);
    }
    async fn teardown(&self, rec: &PodRecord) -> Result<()> {
        self.log("teardown", &rec.id);
        Ok(())
    }
    fn resize(&self, rec: &PodRecord, _c: &cri::PodSandboxConfig) -> Result<()> {
        self.log("resize", &rec.id);
        Ok(())
    }
    fn admit_container(&self, _p: &PodRecord, _c: &cri::ContainerConfig) -> Result<()> {
        Ok(())
    }
    fn pod_files_dir(&self, _p: &PodRecord) -> PathBuf {
        PathBuf::from("/pod")
    }
    fn cgroup_ns(&self) -> bool {
        // A VM's guest always has them; the flat double's host is taken to have none.
        self.kind() == BackendKind::Vm
    }
    async fn prepare_container(
        &self,
        _pod: &Pod,
        _r: ContainerRequest<'_>,
    ) -> Result<PreparedContainer> {
        Err(RuntimeError::Internal(
            "the double has no containers".into(),
        ))
    }
    async fn release_container(&self, _pod: &Pod, rec: &ContainerRecord) {
        self.log("release", &rec.id);
    }
    async fn reopen_log(&self, _pod: &Pod, _rec: &ContainerRecord) -> Result<()> {
        Ok(())
    }
    async fn checkpoint(&self, _: &Pod, rec: &ContainerRecord, dump: &Dump) -> Result<Vec<u8>> {
        self.log("checkpoint", &rec.id);
        std::fs::create_dir_all(&dump.image_dir).unwrap();
        std::fs::write(dump.image_dir.join("inventory.img"), b"fake").unwrap();
        Ok(br#"{"ociVersion":"1.0.2"}"#.to_vec())
    }
    fn forward_target(&self, _rec: &PodRecord) -> Result<ForwardTarget> {
        Ok(ForwardTarget::Netns(PathBuf::new()))
    }
    fn network_usage(&self, _rec: &PodRecord) -> Option<cri::NetworkUsage> {
        None
    }
    fn info(&self, _rec: &PodRecord) -> serde_json::Value {
        serde_json::json!({"double": true})
    }
    async fn sweep_orphans(&self, _r: &[PodRecord], _k: &HashSet<String>) {}
}

struct Fixture {
    _tmp: tempfile::TempDir,
    rt: Arc<Runtime>,
    flat: Arc<Double>,
    vm: Arc<Double>,
}

fn options(root: &Path, default_handler: &str, vm_ready: bool) -> RuntimeOptions {
    RuntimeOptions {
        vm: VmSupport {
            ready: vm_ready,
            kvm_usable: vm_ready,
            reason_code: "Test".into(),
            reason: "a test double".into(),
            fallback: true,
        },
        vm_cfg: crate::config::VmConfig::default(),
        guest_root: crate::config::GuestRoot::Initrd(root.join("initrd")),
        shim_binary: root.join("shim"),
        default_handler: default_handler.into(),
        agent_binary: root.join("agent"),
        log_level: "info".into(),
        root_dir: root.join("root"),
        state_dir: root.join("run"),
        cni: crate::cni::Cni {
            conf_dir: root.join("cni/conf"),
            bin_dirs: vec![root.join("cni/bin")],
            cache_dir: root.join("cni/cache"),
        },
        cgroups: crate::sandbox::cgroup::Driver::Cgroupfs,
        cdi_spec_dirs: Vec::new(),
        criu: true,
        ignore_image_defined_volumes: false,
    }
}

async fn fixture(default_handler: &str, vm_ready: bool) -> Fixture {
    fixture_with(default_handler, vm_ready, |_| {}).await
}

async fn fixture_with(
    default_handler: &str,
    vm_ready: bool,
    change: impl FnOnce(&mut RuntimeOptions),
) -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let mut opts = options(tmp.path(), default_handler, vm_ready);
    change(&mut opts);
    let dirs = StateDirs::new(&opts.root_dir, &opts.state_dir).unwrap();
    let store = Arc::new(ImageStore::open(tmp.path().join("images")).unwrap());
    let flat = Arc::new(Double::default());
    let vm = Arc::new(Double {
        kind: Some(BackendKind::Vm),
        ..Default::default()
    });
    let backends = Backends {
        flat: flat.clone(),
        vm: vm.clone(),
    };
    let rt = Runtime::with_backends(opts, dirs, store, backends)
        .await
        .unwrap();
    Fixture {
        _tmp: tmp,
        rt,
        flat,
        vm,
    }
}

impl Fixture {
    /// RunPodSandbox of the pod [`pod_config`] names `name`, with runtime handler `handler`.
    async fn run(&self, name: &str, handler: &str) -> Result<String> {
        self.rt
            .run_pod_sandbox(Some(pod_config(name)), handler)
            .await
    }
}

fn pod_config(name: &str) -> cri::PodSandboxConfig {
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: name.into(),
            namespace: "ns".into(),
            uid: format!("uid-{name}"),
            attempt: 0,
        }),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_pod_runs_stops_and_is_removed_through_its_backend() {
    let f = fixture("flat", false).await;
    let id = f.run("web", "").await.unwrap();
    let st = f.rt.pod_sandbox_status(&id, true).unwrap();
    let status = st.status.unwrap();
    assert_eq!(status.state, cri::PodSandboxState::SandboxReady as i32);
    assert_eq!(status.network.unwrap().ip, "10.0.0.9");
    assert!(st.info["info"].contains("\"double\":true"), "{:?}", st.info);
    // The record was saved Ready: a restart finds it.
    let saved = f.rt.dirs.load_pods();
    assert_eq!(saved.len(), 1);
    assert_eq!(saved[0].state, PodState::Ready);

    // The same metadata again is refused while the pod exists.
    let e = f.run("web", "").await.unwrap_err();
    assert!(matches!(e, RuntimeError::AlreadyExists(_)), "{e}");

    f.rt.stop_pod_sandbox(&id).await.unwrap();
    let status = f.rt.pod_sandbox_status(&id, false).unwrap().status.unwrap();
    assert_eq!(status.state, cri::PodSandboxState::SandboxNotready as i32);
    // Its address went back to CNI: none is reported.
    assert_eq!(status.network.unwrap().ip, "");
    // No agent answers the double's address: stop still tears the sandbox down.
    f.rt.stop_pod_sandbox(&id).await.unwrap();
    f.rt.remove_pod_sandbox(&id).await.unwrap();
    assert!(matches!(
        f.rt.pod_sandbox_status(&id, false),
        Err(RuntimeError::NotFound(_))
    ));
    assert!(f.rt.dirs.load_pods().is_empty());
    assert_eq!(
        f.flat.calls(),
        [
            format!("start {id}"),
            format!("after_shutdown {id}"),
            format!("teardown {id}"),
            // Stop and remove each take down what is left: idempotent.
            format!("teardown {id}"),
            format!("teardown {id}"),
        ]
    );
    assert!(f.vm.calls().is_empty());
    // Removed: the name is free again.
    f.run("web", "").await.unwrap();
}

#[tokio::test]
async fn a_failed_start_is_torn_down_and_leaves_no_record_or_name() {
    let f = fixture("flat", false).await;
    f.flat.fail_start.store(true, Ordering::SeqCst);
    let e = f.run("bad", "").await.unwrap_err();
    assert!(matches!(e, RuntimeError::Internal(_)), "{e}");
    let calls = f.flat.calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls[0].starts_with("start ") && calls[1].starts_with("teardown "));
    assert!(f.rt.dirs.load_pods().is_empty());
    assert!(f.rt.list_pod_sandbox(None).is_empty());
    f.flat.fail_start.store(false, Ordering::SeqCst);
    f.run("bad", "").await.unwrap();
}

/// A client that gives up on RunPodSandbox (crictl's 2 s timeout, kubelet's deadline) while
/// the backend starts the pod finds the pod listed (kubelet adopts it by its labels), and can
/// remove it and run it again; the name was left reserved by a pod no call could see.
#[tokio::test]
async fn a_run_the_client_gave_up_on_ends_in_a_listed_pod() {
    let f = fixture("flat", false).await;
    f.flat.slow_start.store(true, Ordering::SeqCst);
    let gave_up =
        tokio::time::timeout(std::time::Duration::from_millis(50), f.run("slow", "")).await;
    assert!(gave_up.is_err(), "{gave_up:?}");
    let mut listed = Vec::new();
    for _ in 0..100 {
        listed = f.rt.list_pod_sandbox(None);
        if !listed.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].state, cri::PodSandboxState::SandboxReady as i32);
    let e = f.run("slow", "").await.unwrap_err();
    assert!(matches!(e, RuntimeError::AlreadyExists(_)), "{e}");
    f.rt.remove_pod_sandbox(&listed[0].id).await.unwrap();
    f.run("slow", "").await.unwrap();
}

/// Stopping a pod leaves its containers that never started Created, as containerd does;
/// running ones are Exited.
#[tokio::test]
async fn a_pod_stop_leaves_never_started_containers_created() {
    let f = fixture("flat", false).await;
    let id = f.run("web", "").await.unwrap();
    for (c, state) in [
        ("made", ContainerState::Created),
        ("ran", ContainerState::Running),
    ] {
        let mut rec = ContainerRecord::for_test(c, &id);
        rec.state = state;
        f.rt.ctrs
            .lock()
            .unwrap()
            .insert(c.to_string(), Arc::new(Ctr::new(rec)));
    }
    f.rt.stop_pod_sandbox(&id).await.unwrap();
    let made = f.rt.ctr("made").unwrap().record();
    assert_eq!(made.state, ContainerState::Created);
    assert_eq!(made.finished_at, 0);
    let ran = f.rt.ctr("ran").unwrap().record();
    assert_eq!(ran.state, ContainerState::Exited);
    assert_eq!(ran.exit_code, 137);
}

#[tokio::test]
async fn handlers_pick_the_backend() {
    // KVM ready: the default handler "vm" gives a VM; "flat" gives flat; a host-network
    // pod runs flat by policy.
    let f = fixture("vm", true).await;
    f.run("a", "").await.unwrap();
    f.run("b", "flat").await.unwrap();
    let mut host = pod_config("c");
    vessel_critest::client::pod_namespaces(&mut host).network = cri::NamespaceMode::Node as i32;
    f.rt.run_pod_sandbox(Some(host), "vm").await.unwrap();
    assert_eq!(f.vm.calls().len(), 1, "{:?}", f.vm.calls());
    assert_eq!(f.flat.calls().len(), 2, "{:?}", f.flat.calls());
    let e = f.run("d", "kata").await.unwrap_err();
    assert!(matches!(e, RuntimeError::InvalidArgument(_)), "{e}");

    // No KVM: vm falls back to flat (vm_fallback), and says why in the log.
    let f = fixture("vm", false).await;
    f.run("a", "vm").await.unwrap();
    assert!(f.vm.calls().is_empty());
    assert_eq!(f.flat.calls().len(), 1);
}

#[tokio::test]
async fn container_requests_are_checked_before_the_backend_is_asked() {
    let f = fixture("flat", false).await;
    let id = f.run("p", "").await.unwrap();
    let ctr = |name: &str, image: &str| vessel_critest::client::sh_container(name, image, "true");
    let e =
        f.rt.create_container(&id, Some(ctr("c", "busybox:none")))
            .await
            .unwrap_err();
    assert!(matches!(e, RuntimeError::NotFound(_)), "{e}");
    let e =
        f.rt.create_container(&id, Some(ctr("c", "")))
            .await
            .unwrap_err();
    assert!(matches!(e, RuntimeError::InvalidArgument(_)), "{e}");
    let e =
        f.rt.create_container("nope", Some(ctr("c", "busybox")))
            .await
            .unwrap_err();
    assert!(matches!(e, RuntimeError::NotFound(_)), "{e}");
    f.rt.stop_pod_sandbox(&id).await.unwrap();
    let e =
        f.rt.create_container(&id, Some(ctr("c", "busybox")))
            .await
            .unwrap_err();
    assert!(matches!(e, RuntimeError::FailedPrecondition(_)), "{e}");
    // Nothing was reserved by the refused requests.
    assert!(f
        .rt
        .names
        .lock()
        .unwrap()
        .keys()
        .all(|k| !k.starts_with("c_")));
    assert!(f.rt.list_containers(None).is_empty());
}

/// With CRIU turned off (`runtime.enable_criu_support = false`) neither a checkpoint nor a
/// restore reaches a backend.
#[tokio::test]
async fn checkpoint_and_restore_can_be_turned_off() {
    let f = fixture_with("flat", false, |o| o.criu = false).await;
    let id = f.run("p", "").await.unwrap();
    let c = vessel_critest::client::sh_container("c", "/var/lib/ckpt/c.tar", "true");
    let e = f.rt.create_container(&id, Some(c)).await.unwrap_err();
    assert!(
        matches!(&e, RuntimeError::FailedPrecondition(m) if m.contains("enable_criu_support")),
        "{e}"
    );
    assert!(f.rt.list_containers(None).is_empty());
}

/// A record written late (a watcher's exit, a lost pod's containers) after the container was
/// removed must not bring the record back, nor a stale write land after a newer one.
#[tokio::test]
async fn a_removed_containers_record_is_not_written_back() {
    let f = fixture("flat", false).await;
    let rec = ContainerRecord::for_test("c1", "p1");
    let ctr = Ctr::new(rec);
    assert!(ctr.persist(&f.rt.dirs).unwrap());
    let saved = || f.rt.dirs.load_containers();
    assert_eq!(saved().len(), 1);
    // A change, then a write: the write is of the record as it is now.
    ctr.update(|r| r.pid = 8);
    ctr.persist(&f.rt.dirs).unwrap();
    assert_eq!(saved()[0].pid, 8);
    ctr.delete(&f.rt.dirs).unwrap();
    assert!(saved().is_empty());
    // What the watcher does when it hears of the exit after the removal.
    f.rt.mark_lost(&ctr, "late");
    ctr.update(|r| r.exit_code = 1);
    assert!(
        !ctr.persist(&f.rt.dirs).unwrap(),
        "a write after the removal"
    );
    assert!(saved().is_empty(), "a removed container's record came back");
}
