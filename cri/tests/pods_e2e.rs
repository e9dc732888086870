//! End to end: pods and containers through a real vesseld and real vessel-agents, with
//! busybox images from a real registry on 127.0.0.1.
//!
//! Flat pods by default. The same suite runs against VM pods inside the nested VM harness
//! (`scripts/vm-harness.sh pods`): `VESSEL_E2E_HANDLER=vm` makes every pod ask for the `vm`
//! handler and `VESSEL_E2E_CONFIG` adds TOML to vesseld's config (the guest kernel/initrd).

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tonic::Code;
use vessel_cri_api::v1 as cri;
use vessel_critest::client::{pod_config, pod_metadata, pod_namespaces, sh_container};
use vessel_critest::daemon::{mounts_under, Vesseld};
use vessel_images::push::{push_image, PushTarget};
use vessel_images::testimages;
use vessel_images::testrng::{env_u64, Rng};

vessel_critest::e2e_harness!(H);

/// The runtime handler every pod of this run asks for ("" = vesseld's default).
fn handler() -> String {
    std::env::var("VESSEL_E2E_HANDLER").unwrap_or_default()
}

/// The vesseld under test: this build's, or `VESSEL_E2E_VESSELD` (the nested VM harness
/// stages the binaries elsewhere).
fn vesseld_binary() -> PathBuf {
    std::env::var_os("VESSEL_E2E_VESSELD")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_vesseld")))
}

/// Whether this run drives VM pods.
fn vm_mode() -> bool {
    handler() == "vm"
}

/// Whether this test does not run in this mode (flat pods, or VM pods with
/// `VESSEL_E2E_HANDLER=vm`); if so, prints `SKIP <test>: <why>` for the summary.
fn skip_unless(vm: bool, test: &str, why: &str) -> bool {
    let skip = vm_mode() != vm;
    if skip {
        println!("SKIP {test}: {why}");
    }
    skip
}

async fn harness() -> H {
    harness_with("").await
}

/// A harness whose vesseld config gets `more` appended (after `VESSEL_E2E_CONFIG`).
async fn harness_with(more: &str) -> H {
    let extra = std::env::var("VESSEL_E2E_CONFIG").unwrap_or_default() + more;
    H::launch(&vesseld_binary(), &extra).await
}

impl H {
    fn pod_config(&self, name: &str) -> cri::PodSandboxConfig {
        cri::PodSandboxConfig {
            labels: HashMap::from([("app".to_string(), name.to_string())]),
            dns_config: Some(cri::DnsConfig {
                servers: vec!["10.96.0.10".into()],
                searches: vec!["e2e.svc.cluster.local".into()],
                options: vec!["ndots:5".into()],
            }),
            ..pod_config(name, "e2e", self.logs.path())
        }
    }
    async fn run_pod(&mut self, name: &str) -> (String, cri::PodSandboxConfig) {
        let cfg = self.pod_config(name);
        let id = self
            .c
            .run_pod(&cfg, &handler())
            .await
            .unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e}\n{}", self.v.log()));
        (id, cfg)
    }
    /// RunPodSandbox of a pod with a user namespace of its own (POD mode) mapped by `map`.
    async fn run_userns_pod(
        &mut self,
        name: &str,
        map: cri::IdMapping,
    ) -> (String, cri::PodSandboxConfig) {
        let cfg = with_userns(self.pod_config(name), cri::NamespaceMode::Pod, vec![map]);
        let id = self
            .c
            .run_pod(&cfg, &handler())
            .await
            .unwrap_or_else(|e| panic!("RunPodSandbox {name}: {e}\n{}", self.v.log()));
        (id, cfg)
    }
    fn ctr_config(&self, name: &str, script: &str) -> cri::ContainerConfig {
        cri::ContainerConfig {
            labels: HashMap::from([("ctr".to_string(), name.to_string())]),
            ..sh_container(name, &self.image, script)
        }
    }
    async fn create(
        &mut self,
        pod: &str,
        pcfg: &cri::PodSandboxConfig,
        cfg: cri::ContainerConfig,
    ) -> Result<String, tonic::Status> {
        self.c.create_container(pod, pcfg, cfg).await
    }
    async fn start(&mut self, id: &str) {
        self.c
            .start_container(id)
            .await
            .unwrap_or_else(|e| panic!("StartContainer: {e}\n{}", self.v.log()));
    }
    async fn run(
        &mut self,
        pod: &str,
        pcfg: &cri::PodSandboxConfig,
        name: &str,
        script: &str,
    ) -> String {
        let cfg = self.ctr_config(name, script);
        let id = self
            .create(pod, pcfg, cfg)
            .await
            .unwrap_or_else(|e| panic!("CreateContainer {name}: {e}"));
        self.start(&id).await;
        id
    }

    /// StopContainer with `timeout` seconds of grace.
    async fn stop(&mut self, id: &str, timeout: i64) {
        self.c
            .runtime
            .stop_container(cri::StopContainerRequest {
                container_id: id.to_string(),
                timeout,
            })
            .await
            .unwrap_or_else(|e| panic!("StopContainer {id}: {e}"));
    }
    /// RemoveContainer of `id`.
    async fn remove(&mut self, id: &str) {
        self.c
            .runtime
            .remove_container(cri::RemoveContainerRequest {
                container_id: id.to_string(),
            })
            .await
            .unwrap_or_else(|e| panic!("RemoveContainer {id}: {e}"));
    }
    /// CheckpointContainer of `id` into the archive `location`.
    async fn checkpoint(
        &mut self,
        id: &str,
        location: &str,
        timeout: i64,
    ) -> Result<(), tonic::Status> {
        self.c
            .runtime
            .checkpoint_container(cri::CheckpointContainerRequest {
                container_id: id.to_string(),
                location: location.to_string(),
                timeout,
            })
            .await
            .map(|_| ())
    }
    async fn status(&mut self, id: &str) -> cri::ContainerStatus {
        self.c.container_status(id).await.expect("ContainerStatus")
    }
    async fn wait_exit(&mut self, id: &str, limit: Duration) -> cri::ContainerStatus {
        let start = Instant::now();
        loop {
            let s = self.status(id).await;
            if s.state == cri::ContainerState::ContainerExited as i32 {
                return s;
            }
            assert!(
                start.elapsed() < limit,
                "container {id} did not exit within {limit:?}: {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn exec(
        &mut self,
        id: &str,
        cmd: &[&str],
        timeout: i64,
    ) -> Result<cri::ExecSyncResponse, tonic::Status> {
        self.c.exec_sync(id, cmd, timeout).await
    }
    /// Creates and starts a container from `cfg`, runs `script` in it with `sh -c` and
    /// returns the container's id and the script's stdout.
    async fn run_and_sh(
        &mut self,
        pod: &str,
        pcfg: &cri::PodSandboxConfig,
        cfg: cri::ContainerConfig,
        script: &str,
    ) -> (String, String) {
        let id = self
            .create(pod, pcfg, cfg)
            .await
            .unwrap_or_else(|e| panic!("CreateContainer: {e}"));
        self.start(&id).await;
        let r = self.exec(&id, &["sh", "-c", script], 10).await.unwrap();
        (id, String::from_utf8_lossy(&r.stdout).to_string())
    }
    async fn pod_state(&mut self, id: &str) -> i32 {
        self.c.pod_status(id).await.expect("PodSandboxStatus").state
    }
    async fn remove_pod(&mut self, id: &str) {
        self.c
            .stop_and_remove_pod(id)
            .await
            .expect("StopPodSandbox, RemovePodSandbox");
    }
    async fn verbose_status(&mut self, id: &str) -> cri::PodSandboxStatusResponse {
        self.c
            .runtime
            .pod_sandbox_status(cri::PodSandboxStatusRequest {
                pod_sandbox_id: id.into(),
                verbose: true,
            })
            .await
            .expect("PodSandboxStatus")
            .into_inner()
    }

    fn log_of(&self, pod: &str, name: &str) -> PathBuf {
        self.logs.path().join(pod).join(format!("{name}.log"))
    }

    /// Nothing of vessel's is left: mounts, netns pins, snapshots, records, agents, cgroups.
    fn assert_clean(&self) {
        let m = mounts_under(self.v.dir.path());
        assert!(m.is_empty(), "mounts left: {m:?}");
        let m: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.contains(self.v.dir.path().to_str().unwrap()))
            .map(str::to_string)
            .collect();
        assert!(m.is_empty(), "mounts left: {m:?}");
        for d in [
            "root/images/snapshots",
            "root/containers",
            "root/pods",
            "state/netns",
            "state/pods",
            "state/vms",
        ] {
            let p = self.v.dir.path().join(d);
            let e: Vec<_> = std::fs::read_dir(&p)
                .map(|r| r.flatten().map(|e| e.file_name()).collect())
                .unwrap_or_default();
            assert!(e.is_empty(), "{d} not empty: {e:?}");
        }
        let sock_prefix = self.v.dir.path().to_string_lossy().to_string();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
                let s = String::from_utf8_lossy(&cmd).replace('\0', " ");
                assert!(
                    !((s.contains("vessel-agent") || s.contains("vessel-shim"))
                        && s.contains(&sock_prefix)),
                    "agent or VM shim left running: {s}"
                );
            }
        }
        for base in vessel_cri::sandbox::cgroup::cgroup_dirs("vessel") {
            if let Ok(rd) = std::fs::read_dir(&base) {
                let ours: Vec<_> = rd
                    .flatten()
                    .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
                    .map(|e| e.file_name().to_string_lossy().to_string())
                    .filter(|n| n.len() == 64)
                    .filter(|n| !n.is_empty() && self.created_pod_ids().contains(n))
                    .collect();
                assert!(
                    ours.is_empty(),
                    "cgroups left under {}: {ours:?}",
                    base.display()
                );
            }
        }
    }

    fn created_pod_ids(&self) -> Vec<String> {
        // Pod ids this daemon ever created appear in its log.
        let log = self.v.log();
        log.split("pod=")
            .skip(1)
            .filter_map(|s| s.get(..64))
            .map(str::to_string)
            .collect()
    }
}

fn cri_log_lines(p: &Path) -> Vec<(String, String, String)> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let mut it = l.splitn(4, ' ');
            let ts = it.next().unwrap().to_string();
            assert!(
                chrono::DateTime::parse_from_rfc3339(&ts).is_ok(),
                "bad timestamp in {l:?}"
            );
            let stream = it.next().unwrap_or("").to_string();
            let tag = it.next().unwrap_or("").to_string();
            let msg = it.next().unwrap_or("").to_string();
            (stream, tag, msg)
        })
        .collect()
}

/// The number a counter container keeps in /tmp/count (0 while there is none).
async fn count_in(c: &vessel_critest::client::CriClient, id: &str) -> u64 {
    let r = c.exec_sync(id, &["cat", "/tmp/count"], 5).await.unwrap();
    String::from_utf8_lossy(&r.stdout)
        .trim()
        .parse::<u64>()
        .unwrap_or(0)
}

/// Waits (up to `limit`) until the counter of container `id` is past `n`.
async fn wait_count_past(h: &H, id: &str, n: u64, limit: Duration, what: &str) {
    let start = Instant::now();
    while count_in(&h.c, id).await <= n {
        assert!(start.elapsed() < limit, "{what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_for<F: FnMut() -> bool>(what: &str, limit: Duration, mut f: F) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_and_container_lifecycle_with_logs() {
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("life").await;
    assert_eq!(
        h.pod_state(&pod).await,
        cri::PodSandboxState::SandboxReady as i32
    );

    let id = h
        .run(
            &pod,
            &pcfg,
            "hello",
            "echo hello; echo oops >&2; printf partial; exit 3",
        )
        .await;
    let s = h.wait_exit(&id, Duration::from_secs(10)).await;
    assert_eq!(s.exit_code, 3);
    assert_eq!(s.reason, "Error");
    assert!(s.started_at > 0 && s.finished_at >= s.started_at && s.created_at > 0);
    assert_eq!(s.image.as_ref().unwrap().image, h.image);
    assert!(s.image_ref.contains("@sha256:"), "{}", s.image_ref);
    assert_eq!(s.log_path, h.log_of("life", "hello").display().to_string());
    let lines = cri_log_lines(&h.log_of("life", "hello"));
    assert!(
        lines.contains(&("stdout".into(), "F".into(), "hello".into())),
        "{lines:?}"
    );
    assert!(
        lines.contains(&("stderr".into(), "F".into(), "oops".into())),
        "{lines:?}"
    );
    assert!(
        lines.contains(&("stdout".into(), "F".into(), "partial".into())),
        "{lines:?}"
    );

    // A clean exit is Completed; the hostname and DNS config are the pod's.
    let id2 = h
        .run(&pod, &pcfg, "ok", "hostname; cat /etc/resolv.conf")
        .await;
    let s = h.wait_exit(&id2, Duration::from_secs(10)).await;
    assert_eq!((s.exit_code, s.reason.as_str()), (0, "Completed"));
    let out: Vec<String> = cri_log_lines(&h.log_of("life", "ok"))
        .into_iter()
        .map(|l| l.2)
        .collect();
    assert_eq!(out[0], "life");
    assert!(
        out.contains(&"nameserver 10.96.0.10".to_string()),
        "{out:?}"
    );
    assert!(
        out.contains(&"search e2e.svc.cluster.local".to_string()),
        "{out:?}"
    );

    // Graceful stop: the process handles SIGTERM.
    let id3 = h
        .run(
            &pod,
            &pcfg,
            "graceful",
            "trap 'echo bye; exit 0' TERM; while true; do sleep 0.1; done",
        )
        .await;
    assert_eq!(
        h.status(&id3).await.state,
        cri::ContainerState::ContainerRunning as i32
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.stop(&id3, 10).await;
    let s = h.status(&id3).await;
    assert_eq!(
        (s.state, s.exit_code),
        (cri::ContainerState::ContainerExited as i32, 0)
    );
    // A process that ignores SIGTERM is killed after the timeout.
    let id4 = h
        .run(
            &pod,
            &pcfg,
            "stubborn",
            "trap '' TERM; while true; do sleep 0.1; done",
        )
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    h.stop(&id4, 1).await;
    assert!(t.elapsed() >= Duration::from_millis(900));
    let s = h.status(&id4).await;
    assert_eq!(s.exit_code, 137, "{s:?}");
    // Idempotence: stop and remove twice, remove unknown.
    for id in [&id, &id2, &id3, &id4] {
        for _ in 0..2 {
            h.stop(id, 0).await;
        }
        for _ in 0..2 {
            h.remove(id).await;
        }
    }
    let e =
        h.c.runtime
            .container_status(cri::ContainerStatusRequest {
                container_id: id.clone(),
                verbose: false,
            })
            .await
            .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    h.remove_pod(&pod).await;
    h.remove_pod(&pod).await;
    let e =
        h.c.runtime
            .pod_sandbox_status(cri::PodSandboxStatusRequest {
                pod_sandbox_id: pod.clone(),
                verbose: false,
            })
            .await
            .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    h.assert_clean();
}

/// GetContainerEvents (kubelet's evented PLEG, `crictl events`): every lifecycle transition
/// of a container arrives once, in order, with the pod's and the containers' statuses as
/// they are after it; a container that exits by itself gets its stopped event too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_events_arrive_once_per_transition() {
    let mut h = harness().await;
    let mut events =
        h.c.runtime
            .clone()
            .get_container_events(cri::GetEventsRequest {})
            .await
            .expect("GetContainerEvents")
            .into_inner();
    let (pod, pcfg) = h.run_pod("events").await;
    let a = h
        .run(&pod, &pcfg, "a", "trap 'exit 0' TERM; sleep 1000 & wait")
        .await;
    let b = h.run(&pod, &pcfg, "b", "exit 3").await;
    h.wait_exit(&b, Duration::from_secs(30)).await;
    h.stop(&a, 10).await;
    // Two removals of `a` at once (kubelet's and its GC's) delete it once, and say so once.
    let rm = |id: &str| {
        let mut c = h.c.runtime.clone();
        let container_id = id.to_string();
        async move {
            c.remove_container(cri::RemoveContainerRequest { container_id })
                .await
        }
    };
    let (r1, r2) = tokio::join!(rm(&a), rm(&a));
    assert!(r1.is_ok() && r2.is_ok(), "{r1:?} {r2:?}");
    h.remove(&b).await;
    use cri::ContainerEventType as T;
    let mut seen: HashMap<String, Vec<i32>> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen
        .values()
        .filter(|v| v.last() == Some(&(T::ContainerDeletedEvent as i32)))
        .count()
        < 2
    {
        let left = deadline.saturating_duration_since(Instant::now());
        let ev = tokio::time::timeout(left, events.message())
            .await
            .unwrap_or_else(|_| panic!("events so far: {seen:?}"))
            .expect("event stream")
            .expect("an event");
        let ps = ev
            .pod_sandbox_status
            .as_ref()
            .expect("pod status in the event");
        assert_eq!(ps.id, pod);
        let me = ev
            .containers_statuses
            .iter()
            .find(|c| c.id == ev.container_id);
        let of_pod = ev.container_id == pod;
        match T::try_from(ev.container_event_type).unwrap() {
            _ if of_pod => {}
            T::ContainerCreatedEvent => assert_eq!(
                me.map(|c| c.state),
                Some(cri::ContainerState::ContainerCreated as i32)
            ),
            T::ContainerStoppedEvent => assert_eq!(
                me.map(|c| c.state),
                Some(cri::ContainerState::ContainerExited as i32)
            ),
            T::ContainerDeletedEvent => assert!(me.is_none(), "{ev:?}"),
            T::ContainerStartedEvent => {}
        }
        seen.entry(ev.container_id.clone())
            .or_default()
            .push(ev.container_event_type);
    }
    let once = vec![
        T::ContainerCreatedEvent as i32,
        T::ContainerStartedEvent as i32,
        T::ContainerStoppedEvent as i32,
        T::ContainerDeletedEvent as i32,
    ];
    assert_eq!(seen.get(&a), Some(&once), "{seen:?}");
    assert_eq!(seen.get(&b), Some(&once), "{seen:?}");
    // The sandbox's own events carry its id (as containerd's do).
    assert_eq!(seen.get(&pod), Some(&once[..2].to_vec()), "{seen:?}");
    assert_eq!(seen.len(), 3, "{seen:?}");
    h.remove_pod(&pod).await;
    let mut pod_events = Vec::new();
    while pod_events.last() != Some(&(T::ContainerDeletedEvent as i32)) {
        let left = deadline.saturating_duration_since(Instant::now());
        let ev = tokio::time::timeout(left, events.message())
            .await
            .unwrap_or_else(|_| panic!("pod events after remove: {pod_events:?}"))
            .expect("event stream")
            .expect("an event");
        assert_eq!(ev.container_id, pod, "{ev:?}");
        if ev.container_event_type == T::ContainerStoppedEvent as i32 {
            assert_eq!(
                ev.pod_sandbox_status.map(|s| s.state),
                Some(cri::PodSandboxState::SandboxNotready as i32)
            );
        }
        pod_events.push(ev.container_event_type);
    }
    assert_eq!(pod_events, once[2..].to_vec());
    h.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_containers_share_localhost() {
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("net").await;
    let server = h
        .run(&pod, &pcfg, "server", "mkdir -p /tmp/www && echo hello-from-server > /tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www")
        .await;
    let client = h.run(&pod, &pcfg, "client", "sleep 1000").await;
    let mut body = String::new();
    for _ in 0..50 {
        let r = h
            .exec(&client, &["wget", "-qO-", "http://127.0.0.1:8080/"], 5)
            .await
            .unwrap();
        if r.exit_code == 0 {
            body = String::from_utf8_lossy(&r.stdout).to_string();
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(body, "hello-from-server\n");
    // Separate pid namespaces: each container's process is its own pid 1.
    let r = h
        .exec(
            &client,
            &["sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '"],
            5,
        )
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(&r.stdout).starts_with("sleep 1000"),
        "{r:?}"
    );
    let r = h
        .exec(
            &server,
            &["sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '"],
            5,
        )
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(&r.stdout).starts_with("httpd"),
        "{r:?}"
    );
    // An explicit POD pid mode shares the pod's pid namespace, whose pid 1 is its holder in
    // a flat pod (not the agent, whose root is the host's), the agent in a VM.
    let mut cfg = h.ctr_config("shared", "sleep 1000");
    cfg.linux = Some(cri::LinuxContainerConfig {
        security_context: Some(cri::LinuxContainerSecurityContext {
            namespace_options: Some(cri::NamespaceOption {
                pid: cri::NamespaceMode::Pod as i32,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    let shared = h.create(&pod, &pcfg, cfg).await.unwrap();
    h.start(&shared).await;
    let r = h
        .exec(
            &shared,
            &["sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '"],
            5,
        )
        .await
        .unwrap();
    // `vessel-pidns` on the host, `/init` in a VM (with ` vm` when it restarted itself from
    // the initramfs).
    let pid1 = if vm_mode() { "/init" } else { "vessel-pidns" };
    assert!(
        String::from_utf8_lossy(&r.stdout).contains(pid1),
        "{}",
        String::from_utf8_lossy(&r.stdout)
    );
    let r = h.exec(&shared, &["ps"], 5).await.unwrap();
    let ps = String::from_utf8_lossy(&r.stdout);
    assert!(ps.contains("sleep 1000"), "{ps}");
    // The httpd container asked for a pid namespace of its own: in a flat pod it is not seen
    // from the shared one (the holder's, beside the containers' own; the agent's, above
    // them all, showed it), as with containerd's pause; a VM pod's is the guest's own.
    assert_eq!(ps.contains("httpd"), vm_mode(), "{ps}");
    h.remove_pod(&pod).await;
    h.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_sync_output_exit_codes_and_timeout() {
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("exec").await;
    let id = h.run(&pod, &pcfg, "sleeper", "sleep 1000").await;
    let r = h
        .exec(&id, &["sh", "-c", "echo out; echo err >&2; exit 3"], 10)
        .await
        .unwrap();
    assert_eq!(r.stdout, b"out\n");
    assert_eq!(r.stderr, b"err\n");
    assert_eq!(r.exit_code, 3);
    let r = h.exec(&id, &["id", "-u"], 10).await.unwrap();
    assert_eq!((r.exit_code, r.stdout.as_slice()), (0, &b"0\n"[..]));
    let t = Instant::now();
    let e = h.exec(&id, &["sleep", "30"], 1).await.unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
    assert!(t.elapsed() < Duration::from_secs(10));
    let e = h.exec(&id, &[], 1).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    // A command that cannot run answers as a shell would: 127 with the reason on stderr
    // (it was INTERNAL with no exit code).
    for cmd in ["/no/such/binary", "no-such-command"] {
        let r = h
            .exec(&id, &[cmd], 5)
            .await
            .expect("ExecSync of a missing command");
        assert_eq!(r.exit_code, 127, "{cmd}: {r:?}");
        assert!(
            String::from_utf8_lossy(&r.stderr).contains(cmd),
            "{cmd}: {:?}",
            String::from_utf8_lossy(&r.stderr)
        );
    }
    // Stats: the running container's, and the pod's (its containers summed).
    let cs =
        h.c.runtime
            .container_stats(cri::ContainerStatsRequest {
                container_id: id.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .stats
            .unwrap();
    assert!(cs.cpu.unwrap().usage_core_nano_seconds.is_some());
    assert!(cs.memory.unwrap().working_set_bytes.unwrap().value > 0);
    let ps =
        h.c.runtime
            .list_pod_sandbox_stats(cri::ListPodSandboxStatsRequest {
                filter: Some(cri::PodSandboxStatsFilter {
                    id: pod.clone(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap()
            .into_inner()
            .stats;
    assert_eq!(ps.len(), 1);
    let linux = ps[0].linux.as_ref().unwrap();
    assert_eq!(linux.containers.len(), 1);
    assert!(
        linux
            .memory
            .as_ref()
            .unwrap()
            .working_set_bytes
            .as_ref()
            .unwrap()
            .value
            > 0
    );
    // UpdateContainerResources reaches the container's cgroup and its status.
    h.c.runtime
        .update_container_resources(cri::UpdateContainerResourcesRequest {
            container_id: id.clone(),
            linux: Some(cri::LinuxContainerResources {
                memory_limit_in_bytes: 96 << 20,
                cpu_shares: 512,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    // On the host for flat pods (a VM pod's cgroups live in its guest; checked from inside).
    if !vm_mode() {
        let rel = format!("vessel/{pod}/{id}");
        let limit = vessel_cri::sandbox::cgroup::cgroup_dirs(&rel)
            .into_iter()
            .find_map(|d| {
                std::fs::read_to_string(d.join("memory.limit_in_bytes"))
                    .or_else(|_| std::fs::read_to_string(d.join("memory.max")))
                    .ok()
            })
            .expect("the container's memory cgroup");
        assert_eq!(limit.trim(), (96u64 << 20).to_string());
    }
    // Inside, the container sees its own limit (cgroup v1 and v2 paths) and cannot raise it.
    let inside = h
        .exec(
            &id,
            &[
                "sh",
                "-c",
                "f=/sys/fs/cgroup/memory/memory.limit_in_bytes; [ -e $f ] || f=/sys/fs/cgroup/memory.max; \
                 cat $f; echo 999999999 > $f && echo WRITABLE; cat $f",
            ],
            5,
        )
        .await
        .unwrap();
    let out = String::from_utf8_lossy(&inside.stdout).to_string();
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        vec!["100663296", "100663296"],
        "container view of its cgroup: {out:?}"
    );
    let s = h.status(&id).await;
    let res = s.resources.unwrap().linux.unwrap();
    assert_eq!(res.memory_limit_in_bytes, 96 << 20);
    // Exec in a container that is not running is refused.
    let done = h.run(&pod, &pcfg, "done", "true").await;
    h.wait_exit(&done, Duration::from_secs(10)).await;
    let e = h.exec(&done, &["true"], 5).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    h.remove_pod(&pod).await;
    h.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_partial_lines_and_reopen() {
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("logs").await;
    // A 20000-byte line: partial records, then the final piece.
    let id = h
        .run(
            &pod,
            &pcfg,
            "long",
            "head -c 20000 /dev/zero | tr '\\0' a; echo",
        )
        .await;
    h.wait_exit(&id, Duration::from_secs(10)).await;
    let lines = cri_log_lines(&h.log_of("logs", "long"));
    assert!(lines.len() >= 2, "{}", lines.len());
    assert!(
        lines[..lines.len() - 1].iter().all(|l| l.1 == "P"),
        "{:?}",
        lines.iter().map(|l| &l.1).collect::<Vec<_>>()
    );
    assert_eq!(lines.last().unwrap().1, "F");
    let total: usize = lines.iter().map(|l| l.2.len()).sum();
    assert_eq!(total, 20000);

    // Reopen: kubelet renames the file, then asks for a reopen.
    let id = h
        .run(
            &pod,
            &pcfg,
            "ticker",
            "while true; do echo tick; sleep 0.1; done",
        )
        .await;
    let log = h.log_of("logs", "ticker");
    wait_for("first ticks", Duration::from_secs(5), || {
        cri_log_lines(&log).len() >= 2
    })
    .await;
    let rotated = log.with_extension("log.1");
    std::fs::rename(&log, &rotated).unwrap();
    h.c.runtime
        .reopen_container_log(cri::ReopenContainerLogRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap();
    wait_for("ticks in the new file", Duration::from_secs(5), || {
        cri_log_lines(&log).len() >= 2
    })
    .await;
    let before = cri_log_lines(&rotated).len();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        cri_log_lines(&rotated).len(),
        before,
        "old file still written after reopen"
    );
    // Reopen of a container that is not running fails clearly.
    h.stop(&id, 0).await;
    let e =
        h.c.runtime
            .reopen_container_log(cri::ReopenContainerLogRequest { container_id: id })
            .await
            .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    h.remove_pod(&pod).await;
    h.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_and_name_conflicts() {
    let mut h = harness().await;
    let (p1, c1) = h.run_pod("alpha").await;
    let (p2, c2) = h.run_pod("beta").await;
    // Same pod metadata again: refused until removed.
    let e =
        h.c.runtime
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(c1.clone()),
                runtime_handler: handler(),
            })
            .await
            .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    let a = h.run(&p1, &c1, "a", "sleep 1000").await;
    let b = h
        .create(&p2, &c2, h.ctr_config("b", "sleep 1000"))
        .await
        .unwrap();
    let e = h
        .create(&p1, &c1, h.ctr_config("a", "sleep 1"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");

    let all =
        h.c.runtime
            .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
            .await
            .unwrap()
            .into_inner()
            .items;
    assert_eq!(all.len(), 2);
    let r =
        h.c.list_pod_ids(cri::PodSandboxFilter {
            id: p1[..12].into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r, vec![p1.clone()]);
    let r =
        h.c.list_pod_ids(cri::PodSandboxFilter {
            label_selector: HashMap::from([("app".to_string(), "beta".to_string())]),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0], p2);

    let r =
        h.c.list_container_ids(cri::ContainerFilter {
            pod_sandbox_id: p2.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r, vec![b.clone()]);
    let running = cri::ContainerStateValue {
        state: cri::ContainerState::ContainerRunning as i32,
    };
    let r =
        h.c.list_container_ids(cri::ContainerFilter {
            state: Some(running),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r, vec![a.clone()]);
    let r =
        h.c.list_container_ids(cri::ContainerFilter {
            label_selector: HashMap::from([("ctr".to_string(), "b".to_string())]),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r.len(), 1);
    let r =
        h.c.list_container_ids(cri::ContainerFilter {
            id: a[..10].into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r.len(), 1);

    // NotReady filter after a stop.
    h.c.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: p1.clone(),
        })
        .await
        .unwrap();
    let nr = cri::PodSandboxStateValue {
        state: cri::PodSandboxState::SandboxNotready as i32,
    };
    let r =
        h.c.list_pod_ids(cri::PodSandboxFilter {
            state: Some(nr),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r, vec![p1.clone()]);
    // The container of a stopped pod has exited.
    assert_eq!(
        h.status(&a).await.state,
        cri::ContainerState::ContainerExited as i32
    );
    // After removal the name is free again.
    h.remove_pod(&p1).await;
    let (p1b, _) = h.run_pod("alpha").await;
    assert_ne!(p1b, p1);
    h.remove_pod(&p1b).await;
    h.remove_pod(&p2).await;
    h.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_recovery_after_kill9() {
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("recover").await;
    let ticker = h
        .run(
            &pod,
            &pcfg,
            "ticker",
            "while true; do echo tick; sleep 0.1; done",
        )
        .await;
    let exited = h.run(&pod, &pcfg, "exited", "exit 7").await;
    h.wait_exit(&exited, Duration::from_secs(10)).await;
    let later = h.run(&pod, &pcfg, "later", "sleep 2; exit 5").await;
    let created = h
        .create(&pod, &pcfg, h.ctr_config("created", "true"))
        .await
        .unwrap();

    h.v.kill9();
    let log = h.log_of("recover", "ticker");
    let n = cri_log_lines(&log).len();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // The pod kept running and logging while vesseld was down.
    assert!(
        cri_log_lines(&log).len() > n + 5,
        "ticker stopped logging while vesseld was down"
    );
    h.v.restart().unwrap();
    h.c = h.v.client().await;

    assert_eq!(
        h.pod_state(&pod).await,
        cri::PodSandboxState::SandboxReady as i32
    );
    assert_eq!(
        h.status(&ticker).await.state,
        cri::ContainerState::ContainerRunning as i32
    );
    let s = h.status(&exited).await;
    assert_eq!(
        (s.state, s.exit_code),
        (cri::ContainerState::ContainerExited as i32, 7)
    );
    let s = h.wait_exit(&later, Duration::from_secs(5)).await;
    assert_eq!(s.exit_code, 5, "exit while vesseld was down: {s:?}");
    assert_eq!(
        h.status(&created).await.state,
        cri::ContainerState::ContainerCreated as i32
    );
    // The restarted daemon can still drive everything.
    let r = h.exec(&ticker, &["echo", "still-here"], 5).await.unwrap();
    assert_eq!(r.stdout, b"still-here\n");
    h.start(&created).await;
    assert_eq!(
        h.wait_exit(&created, Duration::from_secs(5))
            .await
            .exit_code,
        0
    );
    // Names survive too.
    let e = h.run_pod_dup("recover").await;
    assert_eq!(e.code(), Code::AlreadyExists);
    h.remove_pod(&pod).await;
    h.assert_clean();
}

/// A pod whose host process lives but does not answer when vesseld starts again (stopped
/// here; a loaded node or a slow VM guest in life) keeps running: it stays ready and its
/// running container stays running, not reported exited while it runs (kubelet would start
/// another beside it) nor killed with its pod. Once the agent answers, exec works and the
/// container's real exit is what its status says. Before, recovery tore such a pod down.
/// One that refuses at once (its socket removed) can never serve, and is taken down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_pod_agent_is_kept_at_a_restart() {
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("silent").await;
    let ctr = h
        .run(
            &pod,
            &pcfg,
            "sleeper",
            "trap 'exit 3' TERM; sleep 1000 & wait",
        )
        .await;
    let created = h
        .create(&pod, &pcfg, h.ctr_config("created", "exit 4"))
        .await
        .unwrap();
    // A pod whose agent lives but whose socket is gone can never answer: it is taken down.
    let (deaf, dcfg) = h.run_pod("deaf").await;
    let deaf_ctr = h.run(&deaf, &dcfg, "d", "exec sleep 100000").await;
    h.v.kill9();
    let record = |id: &str| -> serde_json::Value {
        let p = h.v.root_dir().join("pods").join(id).join("pod.json");
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    };
    let deaf_rec = record(&deaf);
    let deaf_pid = deaf_rec["agent_pid"].as_u64().unwrap();
    std::fs::remove_file(deaf_rec["agent_socket"].as_str().unwrap()).unwrap();
    let rec = record(&pod);
    let pid = i32::try_from(rec["agent_pid"].as_u64().unwrap()).unwrap();
    // SAFETY: kill(2) of the pod's host process, named by its record, with a valid signal.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let before = h.v.log().matches("state recovered").count();
    let restarted = h.v.restart();
    // The socket listens before recovery is done: the agent answers nothing until then.
    let recovered = wait_until(Duration::from_secs(60), || {
        h.v.log().matches("state recovered").count() > before
    });
    // SAFETY: as above; the process is still the pod's (stopped processes do not exit).
    unsafe {
        libc::kill(pid, libc::SIGCONT);
    }
    restarted.unwrap();
    assert!(recovered, "no recovery in 60 s: {}", h.v.log());
    h.c = h.v.client().await;
    assert_eq!(
        h.pod_state(&pod).await,
        cri::PodSandboxState::SandboxReady as i32,
        "{}",
        h.v.log()
    );
    assert_eq!(
        h.status(&ctr).await.state,
        cri::ContainerState::ContainerRunning as i32
    );
    assert_eq!(
        h.status(&created).await.state,
        cri::ContainerState::ContainerCreated as i32
    );
    assert!(Path::new(&format!("/proc/{pid}")).exists(), "agent killed");
    assert_eq!(
        h.pod_state(&deaf).await,
        cri::PodSandboxState::SandboxNotready as i32
    );
    assert_eq!(
        h.status(&deaf_ctr).await.state,
        cri::ContainerState::ContainerExited as i32
    );
    wait_for(
        "the deaf pod's host process to go",
        Duration::from_secs(30),
        || !Path::new(&format!("/proc/{deaf_pid}")).exists(),
    )
    .await;
    h.remove_pod(&deaf).await;
    let r = h.exec(&ctr, &["echo", "still-here"], 10).await.unwrap();
    assert_eq!(r.stdout, b"still-here\n");
    h.c.runtime
        .stop_container(cri::StopContainerRequest {
            container_id: ctr.clone(),
            timeout: 10,
        })
        .await
        .unwrap();
    let s = h.wait_exit(&ctr, Duration::from_secs(10)).await;
    assert_eq!(s.exit_code, 3, "the container's own exit: {s:?}");
    h.start(&created).await;
    assert_eq!(
        h.wait_exit(&created, Duration::from_secs(10))
            .await
            .exit_code,
        4
    );
    h.remove_pod(&pod).await;
    h.assert_clean();
}

/// A StopPodSandbox that waited for a RemovePodSandbox of the same pod finds it gone and
/// does nothing: it wrote the pod's record back after the removal, and the next vesseld
/// listed again a pod that kubelet had removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_behind_a_removal_does_not_bring_the_pod_back() {
    let mut h = harness().await;
    let mut ids = Vec::new();
    // Each round loses the race about every other time on the old code; a VM pod's boot in
    // the nested harness takes seconds, so fewer rounds there.
    let rounds = if vm_mode() { 6 } else { 16 };
    for i in 0..rounds {
        let (pod, _) = h.run_pod(&format!("stop-behind-remove-{i}")).await;
        let stop = |id: &str| {
            let mut rt = h.c.runtime.clone();
            let id = id.to_string();
            async move {
                rt.stop_pod_sandbox(cri::StopPodSandboxRequest { pod_sandbox_id: id })
                    .await
            }
        };
        stop(&pod).await.unwrap();
        let mut rt = h.c.runtime.clone();
        let remove = rt.remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        });
        let (r, s) = tokio::join!(remove, stop(&pod));
        r.unwrap();
        s.unwrap();
        ids.push(pod);
    }
    for id in &ids {
        assert!(
            !h.v.root_dir().join("pods").join(id).exists(),
            "the record of removed pod {id} is back"
        );
    }
    h.v.restart().unwrap();
    h.c = h.v.client().await;
    let listed =
        h.c.runtime
            .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
            .await
            .unwrap()
            .into_inner()
            .items;
    assert!(listed.is_empty(), "removed pods listed: {listed:?}");
    h.assert_clean();
}

/// ExecSync's output as kubelet can take it: what a command wrote before it exited is
/// answered even while a background process it left holds the output open (it was all
/// dropped), and output beyond what one CRI message holds is cut, not a failed call (each
/// stream was kept to 16 MiB, and the two together could not be sent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_sync_output_is_answered_as_it_can_be() {
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("exec-output").await;
    let c = h.run(&pod, &pcfg, "c", "exec sleep 100000").await;
    let r = h
        .exec(&c, &["sh", "-c", "echo before; sleep 30 & echo after"], 20)
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&r.stdout), "before\nafter\n");
    let r = h
        .exec(
            &c,
            &[
                "sh",
                "-c",
                "head -c 12000000 /dev/zero; head -c 12000000 /dev/zero >&2",
            ],
            60,
        )
        .await
        .unwrap_or_else(|e| panic!("ExecSync of 24 MB: {e}"));
    assert_eq!(r.exit_code, 0);
    let total = r.stdout.len() + r.stderr.len();
    assert!(
        (12_000_000..16 << 20).contains(&total),
        "{} + {} bytes",
        r.stdout.len(),
        r.stderr.len()
    );
    // A call its client gives up on (no timeout of its own: the client's deadline, a
    // restarted kubelet) takes its command with it (it ran on, waited for by nobody).
    let given_up = tokio::time::timeout(
        Duration::from_secs(5),
        h.exec(&c, &["sh", "-c", "echo $$ > /tmp/p; exec sleep 300"], 0),
    )
    .await;
    assert!(given_up.is_err(), "the sleep answered: {given_up:?}");
    let started = Instant::now();
    loop {
        let r = h
            .exec(
                &c,
                &["sh", "-c", "test -s /tmp/p && ! kill -0 $(cat /tmp/p)"],
                10,
            )
            .await
            .unwrap();
        if r.exit_code == 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the given-up command still runs"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    h.remove_pod(&pod).await;
    h.assert_clean();
}

/// A StopPodSandbox that a crash of vesseld interrupted (its record says `stopping`) is
/// finished by the next vesseld: the pod reads not ready at once, its container ends up
/// exited, its host process gone, and RemovePodSandbox leaves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_stop_is_finished_after_a_restart() {
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("halfstop").await;
    let ctr = h.run(&pod, &pcfg, "sleeper", "exec sleep 1000").await;
    let pid = h.c.pod_info(&pod).await.unwrap()["pid"].as_u64().unwrap();
    h.v.kill9();
    // What the record holds once a stop has begun, as a crash right then leaves it.
    let rec_path = h.v.root_dir().join("pods").join(&pod).join("pod.json");
    let mut rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&rec_path).unwrap()).unwrap();
    assert_eq!(rec["state"], "Ready");
    rec["stopping"] = serde_json::json!(true);
    std::fs::write(&rec_path, serde_json::to_vec(&rec).unwrap()).unwrap();
    h.v.restart().unwrap();
    h.c = h.v.client().await;
    assert_eq!(
        h.pod_state(&pod).await,
        cri::PodSandboxState::SandboxNotready as i32,
        "a pod being stopped is not ready"
    );
    let s = h.wait_exit(&ctr, Duration::from_secs(30)).await;
    assert_eq!(s.state, cri::ContainerState::ContainerExited as i32);
    wait_for(
        "the pod's host process to go",
        Duration::from_secs(30),
        || !Path::new(&format!("/proc/{pid}")).exists(),
    )
    .await;
    let start = Instant::now();
    loop {
        let rec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&rec_path).unwrap()).unwrap();
        if rec["state"] == "NotReady" && rec["stopping"] == false {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "record: {rec}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    h.remove_pod(&pod).await;
    h.assert_clean();
}

impl H {
    /// Status's StateRecordsReadable condition.
    async fn records_condition(&mut self) -> cri::RuntimeCondition {
        self.c
            .status(false)
            .await
            .unwrap()
            .status
            .unwrap()
            .conditions
            .into_iter()
            .find(|c| c.r#type == "StateRecordsReadable")
            .expect("StateRecordsReadable condition")
    }

    async fn run_pod_dup(&mut self, name: &str) -> tonic::Status {
        let cfg = self.pod_config(name);
        self.c
            .runtime
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(cfg),
                runtime_handler: handler(),
            })
            .await
            .unwrap_err()
    }
}

/// The pod's host process (a flat pod's agent, a VM pod's shim with its vCPU threads) is
/// charged to the pod's cgroup, where kubelet sizes and accounts the pod: a leaf of the
/// cgroupfs parent kubelet gives. The leaf goes with the pod; the parent is kubelet's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pods_host_process_runs_in_the_pods_cgroup() {
    let mut h = harness().await;
    let base = format!("/vessel-e2e-kubepods-{}", std::process::id());
    let parent = format!("{base}/burstable/pod-e2e");
    let mut cfg = h.pod_config("cgparent");
    cfg.linux.get_or_insert_with(Default::default).cgroup_parent = parent.clone();
    let pod =
        h.c.run_pod(&cfg, &handler())
            .await
            .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", h.v.log()));
    let c = h.run(&pod, &cfg, "c", "sleep 100000").await;
    let pid = h.c.pod_info(&pod).await.unwrap()["pid"].as_u64().unwrap();
    let leaf = format!(
        "{parent}/{}",
        if vm_mode() {
            "vessel-vmm"
        } else {
            "vessel-agent"
        }
    );
    let mut pids = vec![pid];
    if vm_mode() {
        // The shim's jailed VMM (its child, pid 1 of its own pid namespace), with the vCPU
        // threads and guest memory, is charged there too.
        let children =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        let vmm: Vec<u64> = children
            .split_whitespace()
            .map(|c| c.parse().unwrap())
            .collect();
        assert_eq!(vmm.len(), 1, "the shim's children: {children:?}");
        pids.extend(vmm);
    }
    for pid in pids {
        let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        // The v2 line (unified or hybrid) and the v1 memory and cpu hierarchies, where mounted.
        let checked: Vec<&str> = cgroups
            .lines()
            .filter(|l| {
                l.starts_with("0::") || l.contains(":memory:") || l.contains(":cpu,cpuacct:")
            })
            .collect();
        assert!(!checked.is_empty(), "{cgroups}");
        for l in checked {
            assert!(
                l.ends_with(&leaf),
                "pod process {pid} not in {leaf}: {l}\n{cgroups}"
            );
        }
    }
    if !vm_mode() {
        // A flat pod's container gets its cgroup beside the agent's leaf.
        let st = h.status(&c).await;
        assert_eq!(st.state, cri::ContainerState::ContainerRunning as i32);
        let dirs = vessel_cri::sandbox::cgroup::cgroup_dirs(&format!("{parent}/{c}"));
        assert!(dirs.iter().any(|d| d.is_dir()), "no cgroup {parent}/{c}");
    }
    h.remove_pod(&pod).await;
    for d in vessel_cri::sandbox::cgroup::cgroup_dirs(&leaf) {
        assert!(!d.exists(), "{} left after the pod's removal", d.display());
    }
    vessel_cri::sandbox::cgroup::remove_cgroup(&base);
    for d in vessel_cri::sandbox::cgroup::cgroup_dirs(&base) {
        assert!(
            !d.exists(),
            "{} left: the pod left something in it",
            d.display()
        );
    }
    h.assert_clean();
}

/// A flat pod in the node's PID namespace, under a kubelet pod cgroup (cgroupfs): when its
/// agent dies, its containers die too. Nothing else ends them there (no pod PID namespace
/// whose init takes them along, and the pod's cgroup is kubelet's, not removed with the
/// pod), and they are reported exited: kubelet would start the next ones beside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_agents_host_pid_containers_die_with_it() {
    if vm_mode() {
        println!("SKIP a_dead_agents_host_pid_containers_die_with_it: flat pods only (a VM's processes go with it)");
        return;
    }
    let mut h = harness().await;
    let base = format!("/vessel-e2e-kubepods-hostpid-{}", std::process::id());
    // The agent dies while vesseld runs, then while it is down.
    for (n, while_down) in [(0u32, false), (1, true)] {
        let parent = format!("{base}/besteffort/pod-e2e-{n}");
        let mut cfg = h.pod_config(&format!("hostpid-orphans-{n}"));
        cfg.linux.get_or_insert_with(Default::default).cgroup_parent = parent.clone();
        pod_namespaces(&mut cfg).pid = cri::NamespaceMode::Node as i32;
        let pod =
            h.c.run_pod(&cfg, &handler())
                .await
                .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", h.v.log()));
        let secs = 200_000 + 10 * std::process::id() + n;
        let mut ccfg = h.ctr_config("orphan", &format!("exec sleep {secs}"));
        ccfg.linux
            .get_or_insert_with(Default::default)
            .security_context
            .get_or_insert_with(Default::default)
            .namespace_options = Some(cri::NamespaceOption {
            pid: cri::NamespaceMode::Node as i32,
            ..Default::default()
        });
        let c = h.create(&pod, &cfg, ccfg).await.expect("CreateContainer");
        h.start(&c).await;
        let sleepers = || {
            let want = format!("sleep\0{secs}\0");
            std::fs::read_dir("/proc")
                .unwrap()
                .flatten()
                .filter(|e| {
                    std::fs::read(e.path().join("cmdline")).is_ok_and(|b| b == want.as_bytes())
                })
                .count()
        };
        wait_for("the container's sleep", Duration::from_secs(10), || {
            sleepers() == 1
        })
        .await;
        if while_down {
            h.v.kill9();
            assert!(h.v.kill_pod_host_process(&pod));
            h.v.restart().unwrap();
            h.c = h.v.client().await;
        } else {
            assert!(h.v.kill_pod_host_process(&pod));
        }
        wait_not_ready(&h, &pod).await;
        wait_for(
            "the container's processes to go with the agent",
            Duration::from_secs(10),
            || sleepers() == 0,
        )
        .await;
        let st = h.status(&c).await;
        assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
        h.remove_pod(&pod).await;
    }
    vessel_cri::sandbox::cgroup::remove_cgroup(&base);
    for d in vessel_cri::sandbox::cgroup::cgroup_dirs(&base) {
        assert!(!d.exists(), "{} left", d.display());
    }
    h.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_marks_pod_not_ready() {
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("victim").await;
    // With a volume the container has written to: after a kill -9 of the pod's host process
    // (the VM shim, whose file server holds the volume) the data stays on the host and no
    // mount of it is left behind.
    let vol = tempfile::tempdir().unwrap();
    let mut cfg = h.ctr_config(
        "sleeper",
        "echo kept > /data/written && sync && exec sleep 1000",
    );
    cfg.mounts = vec![cri::Mount {
        container_path: "/data".into(),
        host_path: vol.path().display().to_string(),
        ..Default::default()
    }];
    let id = h.create(&pod, &pcfg, cfg).await.expect("CreateContainer");
    h.start(&id).await;
    wait_for(
        "the container's write on the host",
        Duration::from_secs(20),
        || std::fs::read_to_string(vol.path().join("written")).is_ok_and(|s| s == "kept\n"),
    )
    .await;
    let info = h.verbose_status(&pod).await.info;
    let v: serde_json::Value = serde_json::from_str(&info["info"]).unwrap();
    let pid = i32::try_from(v["pid"].as_u64().unwrap()).unwrap();
    // SAFETY: kill(2) of the agent pid vesseld reported.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    let s = h.wait_exit(&id, Duration::from_secs(10)).await;
    assert_ne!(s.exit_code, 0);
    wait_for("pod not ready", Duration::from_secs(5), || true).await;
    let start = Instant::now();
    while h.pod_state(&pod).await != cri::PodSandboxState::SandboxNotready as i32 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "pod still ready after its agent died"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    h.remove_pod(&pod).await;
    h.assert_clean();
    assert_eq!(
        std::fs::read_to_string(vol.path().join("written")).unwrap(),
        "kept\n"
    );
}

/// The freezer dir of cgroup `name` somewhere under `/sys/fs/cgroup/<hierarchy>/vessel`: the
/// v1 freezer's, or the unified hierarchy's.
fn freezer_dir(name: &str) -> Option<(PathBuf, &'static str, &'static str)> {
    let roots = [
        ("/sys/fs/cgroup/freezer/vessel", "freezer.state", "FROZEN"),
        ("/sys/fs/cgroup/vessel", "cgroup.freeze", "1"),
    ];
    for (root, file, frozen) in roots {
        let mut stack = vec![PathBuf::from(root)];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                if !e.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                if e.file_name() == name && e.path().join(file).exists() {
                    return Some((e.path(), file, frozen));
                }
                stack.push(e.path());
            }
        }
    }
    None
}

/// A flat pod whose agent died while one of its containers was frozen (libcontainer freezes
/// a cgroup while it kills it): the container's processes cannot die until thawed, so
/// removing the pod thaws and kills them, and no cgroup or process is left. The agent, PID 1
/// of the pod's pid namespace, cannot finish exiting before they die either: the pod must
/// still become NotReady (vesseld takes an exiting agent as dead; it used to wait for ever,
/// about one run in five, when the freeze had taken before the kill).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_container_of_a_dead_agent_is_thawed_and_removed() {
    if skip_unless(
        false,
        "a_frozen_container_of_a_dead_agent_is_thawed_and_removed",
        "flat pods only (a VM pod's containers are in its guest)",
    ) {
        return;
    }
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("frozen").await;
    let id = h.run(&pod, &pcfg, "c", "exec sleep 1000").await;
    let Some((dir, file, frozen)) = freezer_dir(&id) else {
        println!("SKIP a_frozen_container_of_a_dead_agent_is_thawed_and_removed: no freezer cgroup for the container here");
        h.remove_pod(&pod).await;
        return;
    };
    let procs: Vec<i32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    assert!(!procs.is_empty(), "no process in {}", dir.display());
    std::fs::write(dir.join(file), frozen).unwrap();
    let info = h.verbose_status(&pod).await.info;
    let v: serde_json::Value = serde_json::from_str(&info["info"]).unwrap();
    let agent = i32::try_from(v["pid"].as_u64().unwrap()).unwrap();
    // SAFETY: kill(2) of the agent pid vesseld reported.
    unsafe {
        libc::kill(agent, libc::SIGKILL);
    }
    let start = Instant::now();
    while h.pod_state(&pod).await != cri::PodSandboxState::SandboxNotready as i32 {
        assert!(start.elapsed() < Duration::from_secs(10), "pod still ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    h.remove_pod(&pod).await;
    h.assert_clean();
    assert!(!dir.exists(), "{} left", dir.display());
    for p in procs {
        let state = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
        // A zombie waits for a reaper this test environment may not have; anything else
        // is a process left alive.
        let st = state
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .next();
        assert!(
            state.is_empty() || st == Some("Z"),
            "container process {p} left: {state}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_are_refused_and_leave_nothing() {
    let mut h = harness().await;
    // Pod without metadata; unknown handler.
    let e =
        h.c.runtime
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(cri::PodSandboxConfig::default()),
                runtime_handler: handler(),
            })
            .await
            .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    let e =
        h.c.runtime
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(h.pod_config("bad")),
                runtime_handler: "kata".into(),
            })
            .await
            .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("kata"));
    let (pod, pcfg) = h.run_pod("bad").await;

    // Container without metadata; unknown image; bad mount; missing command.
    let mut cfg = h.ctr_config("x", "true");
    cfg.metadata = None;
    assert_eq!(
        h.create(&pod, &pcfg, cfg).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    let mut cfg = h.ctr_config("x", "true");
    cfg.image = Some(cri::ImageSpec {
        image: "127.0.0.1:1/nope:v1".into(),
        ..Default::default()
    });
    let e = h.create(&pod, &pcfg, cfg).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    assert!(e.message().contains("nope"));
    // A missing host path is made (as containerd makes it), but not below a file.
    let file = tempfile::NamedTempFile::new().unwrap();
    let under_file = file.path().join("not/here").display().to_string();
    let mut cfg = h.ctr_config("x", "true");
    cfg.mounts = vec![cri::Mount {
        container_path: "/data".into(),
        host_path: under_file.clone(),
        ..Default::default()
    }];
    let e = h.create(&pod, &pcfg, cfg).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains(&under_file), "{e}");
    // A command that is nowhere is made (it could come from a volume or a CDI device), and
    // fails to start, as containerd's: a StartError (128) naming it, and nothing left.
    let mut cfg = h.ctr_config("x", "true");
    cfg.command = vec!["no-such-command".into()];
    let missing = h.create(&pod, &pcfg, cfg).await.unwrap();
    let e = h.c.start_container(&missing).await.unwrap_err();
    assert!(e.message().contains("no-such-command"), "{e}");
    let st = h.status(&missing).await;
    assert_eq!(
        (st.state, st.exit_code, st.reason.as_str()),
        (
            cri::ContainerState::ContainerExited as i32,
            128,
            "StartError"
        ),
        "{st:?}"
    );
    assert!(st.message.contains("no-such-command"), "{st:?}");
    h.remove(&missing).await;
    let e = h
        .create("0000000000000000", &pcfg, h.ctr_config("y", "true"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    // Nothing was left by the failures: no containers, no snapshots.
    let r =
        h.c.runtime
            .list_containers(cri::ListContainersRequest { filter: None })
            .await
            .unwrap()
            .into_inner()
            .containers;
    assert!(r.is_empty(), "{r:?}");
    let snaps: Vec<_> = std::fs::read_dir(h.v.root_dir().join("images/snapshots"))
        .unwrap()
        .flatten()
        .collect();
    assert!(snaps.is_empty());
    // The name "x" is still free.
    let ok = h.run(&pod, &pcfg, "x", "true").await;
    h.wait_exit(&ok, Duration::from_secs(10)).await;
    h.remove_pod(&pod).await;
    // Unknown ids: stop/remove are fine, status is NotFound.
    h.c.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: "f".repeat(64),
        })
        .await
        .unwrap();
    h.remove(&"f".repeat(64)).await;
    h.assert_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_handler_falls_back_to_flat_with_the_probe_reason() {
    if skip_unless(
        false,
        "vm_handler_falls_back_to_flat_with_the_probe_reason",
        "this run has usable KVM (VM pods); the fallback is tested where KVM is unusable",
    ) {
        return;
    }
    let mut h = harness().await;
    let st =
        h.c.runtime
            .status(cri::StatusRequest { verbose: true })
            .await
            .unwrap()
            .into_inner();
    let conds = st.status.unwrap().conditions;
    let vm = conds
        .iter()
        .find(|c| c.r#type == "VMBackendReady")
        .expect("a VMBackendReady condition");
    assert!(!vm.status);
    println!("VMBackendReady: {} {}", vm.reason, vm.message);
    let kvm: serde_json::Value = serde_json::from_str(&st.info["config"]).unwrap();
    if kvm["kvm"]["usable"] == false {
        // This machine's nested, emulating KVM: the probe says why, with its number.
        assert_eq!(vm.reason, "KVMUnusable");
        assert!(vm.message.contains("KVM"), "{}", vm.message);
        assert!(h.v.log().contains("microVMs cannot run on this node"));
    }
    // A vm pod runs flat, and the log says so.
    let cfg = h.pod_config("vmpod");
    let id =
        h.c.runtime
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(cfg.clone()),
                runtime_handler: "vm".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .pod_sandbox_id;
    let s = h.verbose_status(&id).await;
    assert_eq!(s.status.unwrap().runtime_handler, "vm");
    assert!(
        s.info["info"].contains("\"backend\":\"flat\""),
        "{}",
        s.info["info"]
    );
    assert!(h
        .v
        .log()
        .contains("runtime handler vm: running the pod flat"));
    let c = h.run(&id, &cfg, "c", "echo in-a-vm-pod").await;
    assert_eq!(h.wait_exit(&c, Duration::from_secs(10)).await.exit_code, 0);
    h.remove_pod(&id).await;
    h.assert_clean();

    // With vm_fallback = "refuse", a vm pod is refused with the reason.
    let v = Vesseld::start(&vesseld_binary(), "[runtime]\nvm_fallback = \"refuse\"\n").unwrap();
    let mut c = v.client().await;
    let e = c
        .runtime
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(h.pod_config("refused")),
            runtime_handler: "vm".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("refuse"), "{e}");
    let pods = c
        .runtime
        .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
        .await
        .unwrap()
        .into_inner()
        .items;
    assert!(pods.is_empty());
}

/// An image whose config lists one layer twice (a legacy builder's repeated empty layer)
/// runs: each layer is a lower directory (or a VM pod's disk) once, at its top-most place
/// (overlayfs refused the repeated directory: every start failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_that_repeats_a_layer_runs() {
    let mut h = harness().await;
    let img = testimages::repeated_layer_image();
    let mut t = PushTarget::new(&h._reg.url(), "library/repeated");
    t.insecure_tls = true;
    push_image(&t, &img, Some("latest")).await.unwrap();
    let name = format!("{}/library/repeated:latest", h._reg.host());
    h.c.pull(&name)
        .await
        .expect("pull an image with a repeated layer");
    let (pod, pcfg) = h.run_pod("repeated").await;
    let mut cfg = h.ctr_config("r", "cat /hello; echo made > /tmp/x && cat /tmp/x");
    cfg.image = Some(cri::ImageSpec {
        image: name,
        ..Default::default()
    });
    let id = h
        .create(&pod, &pcfg, cfg)
        .await
        .expect("CreateContainer from an image with a repeated layer");
    h.start(&id).await;
    let s = h.wait_exit(&id, Duration::from_secs(30)).await;
    assert_eq!(s.exit_code, 0, "{s:?}");
    let log = h.log_of("repeated", "r");
    wait_for("the container's output", Duration::from_secs(10), || {
        let lines: Vec<String> = cri_log_lines(&log).into_iter().map(|l| l.2).collect();
        lines == ["hello", "made"]
    })
    .await;
    h.remove_pod(&pod).await;
    h.assert_clean();
}

/// VM pods: image layers are EROFS disks in the pod's spare slots. A two-layer image with
/// whiteouts and an opaque dir reads right in the guest; with 2 slots, a one-layer image
/// more is refused while the two are in use, and fits once they are released (slot reuse).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_layer_disks_whiteouts_and_slot_reuse() {
    if skip_unless(
        true,
        "vm_layer_disks_whiteouts_and_slot_reuse",
        "VM pods only (VESSEL_E2E_HANDLER=vm; runs in the nested harness)",
    ) {
        return;
    }
    // VESSEL_E2E_CONFIG ends with its [vm] section.
    let mut h = harness_with("\nspare_disks = 2\n").await;
    let wimg = testimages::whiteout_image();
    let mut t = PushTarget::new(&h._reg.url(), "library/whiteout");
    t.insecure_tls = true;
    push_image(&t, &wimg, Some("latest")).await.unwrap();
    let wname = format!("{}/library/whiteout:latest", h._reg.host());
    h.c.pull(&wname).await.expect("pull whiteout image");
    let (pod, pcfg) = h.run_pod("slots").await;
    let mut cfg = h.ctr_config("w", "sleep 1000");
    cfg.image = Some(cri::ImageSpec {
        image: wname,
        ..Default::default()
    });
    let w = h
        .create(&pod, &pcfg, cfg)
        .await
        .expect("two-layer container");
    h.start(&w).await;
    let r = h
        .exec(&w, &["sh", "-c", "ls /data /opaque | tr '\\n' ' '"], 10)
        .await
        .unwrap();
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    assert!(
        out.contains("keep")
            && out.contains("new")
            && !out.contains("gone")
            && !out.contains("old"),
        "whiteouts and opaque dirs in the guest overlay: {out:?}"
    );
    // Both slots hold the whiteout image's layers: busybox's layer has no room.
    let e = h
        .create(&pod, &pcfg, h.ctr_config("b", "echo fits"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("spare_disks"), "{e}");
    // Once the two-layer container is gone, its slots are reused.
    h.remove(&w).await;
    let b = h.run(&pod, &pcfg, "b", "echo fits").await;
    let s = h.wait_exit(&b, Duration::from_secs(30)).await;
    assert_eq!(s.exit_code, 0, "{s:?}");
    let log = h.log_of("slots", "b");
    wait_for(
        "the second container's log line",
        Duration::from_secs(10),
        || cri_log_lines(&log).iter().any(|l| l.2 == "fits"),
    )
    .await;
    h.remove_pod(&pod).await;
    h.assert_clean();
}

/// VM pods: a `vm` pod that asks for the host's network namespace runs flat by policy (the
/// default `vm.host_namespaces = "flat"`), and the log says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_host_network_pod_runs_flat_by_policy() {
    if skip_unless(
        true,
        "vm_host_network_pod_runs_flat_by_policy",
        "VM pods only (VESSEL_E2E_HANDLER=vm; runs in the nested harness)",
    ) {
        return;
    }
    let mut h = harness().await;
    let mut cfg = h.pod_config("hostnet");
    pod_namespaces(&mut cfg).network = cri::NamespaceMode::Node as i32;
    let id =
        h.c.runtime
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(cfg.clone()),
                runtime_handler: "vm".into(),
            })
            .await
            .expect("host-network vm pod")
            .into_inner()
            .pod_sandbox_id;
    let s = h.verbose_status(&id).await;
    assert!(
        s.info["info"].contains("\"backend\":\"flat\""),
        "{}",
        s.info["info"]
    );
    assert!(
        h.v.log().contains("pod runs flat by policy"),
        "{}",
        h.v.log()
    );
    let c = h.run(&id, &cfg, "c", "echo on-the-host-network").await;
    assert_eq!(h.wait_exit(&c, Duration::from_secs(10)).await.exit_code, 0);
    h.remove_pod(&id).await;
    h.assert_clean();
}

/// Flat pods look bind sources up in the host's mount namespace: a host mount made after the
/// pod started reaches an rslave mount, and removing the container leaves the host's own
/// mounts alone (unmounting a staged source that shares the host's peer group would
/// otherwise unmount the host's submounts too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flat_bind_sources_come_from_the_host_and_removal_spares_host_mounts() {
    if skip_unless(
        false,
        "flat_bind_sources_come_from_the_host_and_removal_spares_host_mounts",
        "flat pods only (VM volumes are their own issue)",
    ) {
        return;
    }
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("hostbinds").await;
    let t = tempfile::tempdir().unwrap();
    let mnt = t.path().join("mnt");
    let src = t.path().join("src");
    std::fs::create_dir_all(mnt.join("late")).unwrap();
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("flag"), "x").unwrap();
    let sh = |cmd: String| {
        let ok = std::process::Command::new("sh")
            .args(["-c", &cmd])
            .status()
            .unwrap()
            .success();
        assert!(ok, "{cmd}");
    };
    // Made after RunPodSandbox: the pod's own mount namespace never saw it.
    sh(format!(
        "mount --bind {m} {m} && mount --make-rshared {m}",
        m = mnt.display()
    ));
    let mut cfg = h.ctr_config("c", "sleep 1000");
    cfg.mounts = vec![cri::Mount {
        container_path: "/data".into(),
        host_path: mnt.display().to_string(),
        propagation: cri::MountPropagation::PropagationHostToContainer as i32,
        ..Default::default()
    }];
    let c = h.create(&pod, &pcfg, cfg).await.expect("CreateContainer");
    h.start(&c).await;
    sh(format!(
        "mount --bind {} {}",
        src.display(),
        mnt.join("late").display()
    ));
    let out = h
        .exec(&c, &["ls", "/data/late"], 10)
        .await
        .expect("ExecSync");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "flag");
    h.remove(&c).await;
    let host_mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let late = mnt.join("late").display().to_string();
    let still = host_mounts
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(late.as_str()));
    sh(format!("umount -l {late}; umount -l {}", mnt.display()));
    assert!(still, "removing the container unmounted the host's {late}");
    assert_eq!(std::fs::read_to_string(src.join("flag")).unwrap(), "x");
    h.remove_pod(&pod).await;
    h.assert_clean();
}

/// A record that cannot be read (truncated, garbage) is moved aside, reported in Status, and
/// nothing it describes is deleted: a running container whose record was truncated keeps its
/// snapshot (vesseld used to delete it), and a pod whose record is garbage keeps its dir,
/// its containers' records and their snapshots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_records_are_quarantined_and_their_data_kept() {
    if skip_unless(
        false,
        "corrupt_records_are_quarantined_and_their_data_kept",
        "flat pods (the record handling is the same for VM pods)",
    ) {
        return;
    }
    let mut h = harness().await;
    let (a, acfg) = h.run_pod("qa").await;
    let a1 = h.run(&a, &acfg, "a1", "sleep 1000").await;
    let (b, bcfg) = h.run_pod("qb").await;
    let b1 = h.run(&b, &bcfg, "b1", "sleep 1000").await;
    let sock = h.c.pod_info(&b).await.unwrap()["agentSocket"]
        .as_str()
        .unwrap()
        .to_string();
    h.v.kill9();
    let root = h.v.root_dir();
    let a1_rec = root.join(format!("containers/{a1}.json"));
    let data = std::fs::read(&a1_rec).unwrap();
    std::fs::write(&a1_rec, &data[..data.len() / 2]).unwrap();
    std::fs::write(root.join(format!("pods/{b}/pod.json")), b"\x00garbage{").unwrap();
    h.v.restart().unwrap();
    h.c = h.v.client().await;

    // The first call is answered once recovery is done (the socket is bound before).
    let cond = h.records_condition().await;
    assert!(!cond.status, "{cond:?}");
    assert!(cond.message.starts_with("2 record(s)"), "{cond:?}");
    assert!(
        root.join(format!("containers/{a1}.json.quarantined"))
            .exists(),
        "{:?}\n{}",
        std::fs::read_dir(root.join("containers"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect::<Vec<_>>(),
        h.v.log()
    );
    assert!(root.join(format!("pods/{b}/pod.json.quarantined")).exists());
    for id in [&a1, &b1] {
        assert!(
            root.join(format!("images/snapshots/{id}")).exists(),
            "snapshot of {id} (a1 {a1}, b1 {b1}) was deleted; log:\n{}",
            h.v.log()
        );
    }
    assert!(root.join(format!("containers/{b1}.json")).exists());
    // The readable pod is managed as before; its unreadable container is not listed.
    assert_eq!(
        h.pod_state(&a).await,
        cri::PodSandboxState::SandboxReady as i32
    );
    let listed =
        h.c.runtime
            .list_containers(cri::ListContainersRequest { filter: None })
            .await
            .unwrap()
            .into_inner()
            .containers;
    assert!(
        listed.iter().all(|c| c.id != a1 && c.id != b1),
        "{listed:?}"
    );
    // The pod whose record is unreadable is listed, not ready, under a stand-in name, with
    // its agent still running; RemovePodSandbox stops it and removes it with its containers.
    let pods =
        h.c.runtime
            .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
            .await
            .unwrap()
            .into_inner()
            .items;
    let sb = pods
        .iter()
        .find(|p| p.id == b)
        .expect("the unreadable pod is listed");
    assert_eq!(sb.state, cri::PodSandboxState::SandboxNotready as i32);
    // kubelet's CRI client refuses a sandbox created at 0.
    assert!(sb.created_at > 0, "created at {}", sb.created_at);
    let st = h.c.pod_status(&b).await.unwrap();
    assert!(st.created_at > 0, "status created at {}", st.created_at);
    assert!(sb
        .metadata
        .as_ref()
        .unwrap()
        .name
        .starts_with("unreadable-"));
    assert_eq!(
        sb.labels
            .get("vessel.dev/unreadable-record")
            .map(String::as_str),
        Some("true")
    );
    let b_agent = |sock: &str| {
        std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
            std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(sock))
        })
    };
    assert!(b_agent(&sock), "pod b's agent was stopped at recovery");
    h.remove_pod(&b).await;
    assert!(!b_agent(&sock), "pod b's agent is still running");
    assert!(!root.join(format!("pods/{b}")).exists());
    assert!(!root.join(format!("containers/{b1}.json")).exists());
    assert!(!root.join(format!("images/snapshots/{b1}")).exists());
    let cond = h.records_condition().await;
    assert!(cond.message.starts_with("1 record(s)"), "{cond:?}");
    h.remove_pod(&a).await;
}

type SoakOp =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), tonic::Status>> + Send>>;
/// How a soak operation is made again (a stop or removal, as kubelet retries it).
type SoakRetry = fn(vessel_critest::client::CriClient, String) -> SoakOp;

fn soak_remove_container(c: vessel_critest::client::CriClient, id: String) -> SoakOp {
    let mut rt = c.runtime.clone();
    Box::pin(async move {
        rt.stop_container(cri::StopContainerRequest {
            container_id: id.clone(),
            timeout: 1,
        })
        .await?;
        rt.remove_container(cri::RemoveContainerRequest { container_id: id })
            .await
            .map(|_| ())
    })
}

fn soak_remove_pod(c: vessel_critest::client::CriClient, id: String) -> SoakOp {
    Box::pin(async move { c.stop_and_remove_pod(&id).await })
}

fn soak_stop_pod(c: vessel_critest::client::CriClient, id: String) -> SoakOp {
    let mut rt = c.runtime.clone();
    Box::pin(async move {
        rt.stop_pod_sandbox(cri::StopPodSandboxRequest { pod_sandbox_id: id })
            .await
            .map(|_| ())
    })
}

/// What the soak believes: pods (ready or not) and their containers (running or not).
#[derive(Default, Debug)]
struct Model {
    pods: std::collections::BTreeMap<String, (bool, cri::PodSandboxConfig)>,
    ctrs: std::collections::BTreeMap<String, (String, bool)>,
}

impl Model {
    fn ready_pods(&self) -> Vec<String> {
        self.pods
            .iter()
            .filter(|(_, p)| p.0)
            .map(|(k, _)| k.clone())
            .collect()
    }
    /// Drops what an operation removed.
    fn forget(&mut self, ids: &[String]) {
        for id in ids {
            self.pods.remove(id);
            self.ctrs.remove(id);
        }
    }
    fn running(&self) -> Vec<String> {
        self.ctrs
            .iter()
            .filter(|(_, c)| c.1)
            .map(|(k, _)| k.clone())
            .collect()
    }
}

/// Reads back what vesseld says into the model (after an interrupted operation, whose
/// outcome is unknown), then checks that it says everything else the model holds.
async fn reconcile(h: &mut H, m: &mut Model, lost: &mut Vec<String>) {
    let pods =
        h.c.runtime
            .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
            .await
            .expect("ListPodSandbox")
            .into_inner()
            .items;
    let ctrs =
        h.c.runtime
            .list_containers(cri::ListContainersRequest { filter: None })
            .await
            .expect("ListContainers")
            .into_inner()
            .containers;
    for id in m.pods.keys() {
        if !pods.iter().any(|p| &p.id == id) {
            lost.push(format!("pod {id}"));
        }
    }
    for id in m.ctrs.keys() {
        if !ctrs.iter().any(|c| &c.id == id) {
            lost.push(format!("container {id}"));
        }
    }
    m.pods.retain(|id, _| pods.iter().any(|p| &p.id == id));
    for p in &pods {
        let ready = p.state == cri::PodSandboxState::SandboxReady as i32;
        let cfg = h.pod_config(&p.metadata.as_ref().unwrap().name);
        m.pods.entry(p.id.clone()).or_insert((ready, cfg)).0 = ready;
    }
    m.ctrs.clear();
    for c in &ctrs {
        let running = c.state == cri::ContainerState::ContainerRunning as i32;
        m.ctrs
            .insert(c.id.clone(), (c.pod_sandbox_id.clone(), running));
    }
}

/// Waits (up to 20 s) until pod `id` is NotReady and none of its containers runs: what
/// vesseld makes of a pod whose host process died.
async fn wait_not_ready(h: &H, id: &str) {
    let start = Instant::now();
    loop {
        let st =
            h.c.pod_status(id)
                .await
                .unwrap_or_else(|e| panic!("PodSandboxStatus {id}: {e}\n{}", h.v.log()));
        let ctrs =
            h.c.runtime
                .clone()
                .list_containers(cri::ListContainersRequest {
                    filter: Some(cri::ContainerFilter {
                        pod_sandbox_id: id.into(),
                        ..Default::default()
                    }),
                })
                .await
                .expect("ListContainers")
                .into_inner()
                .containers;
        let running = ctrs
            .iter()
            .filter(|c| c.state == cri::ContainerState::ContainerRunning as i32)
            .count();
        if st.state == cri::PodSandboxState::SandboxNotready as i32 && running == 0 {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "pod {id} is {:?} with {running} running containers 20 s after its host process was killed\n{}",
            st.state,
            h.v.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Crash soak: random lifecycle operations (300 with flat pods; 40 with VM pods, which boot
/// slowly in the nested harness; `VESSEL_SOAK_OPS`), about one in eight with vesseld killed
/// (-9) at a random moment during it and restarted. A ready pod's host process (its agent, or
/// its VM's shim) is killed -9 too: after one in ten of the other operations, and in half the
/// crashes while vesseld is down (some 15% of operations in all).
/// After each restart every pod and container the model holds must still be listed (none
/// lost), a pod whose host process was killed must turn NotReady with its containers exited,
/// and operations retried as kubelet retries them must succeed; at the end everything is
/// removed and nothing is left (mounts, netns, records, processes, cgroups).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_soak_with_kill9_of_vesseld() {
    let default_ops = if vm_mode() { 40 } else { 300 };
    let ops = usize::try_from(env_u64("VESSEL_SOAK_OPS", default_ops)).unwrap_or(300);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let seed = env_u64(
        "VESSEL_SOAK_SEED",
        (now.as_secs() << 20) ^ u64::from(now.subsec_nanos()),
    );
    println!("crash soak: {ops} operations, VESSEL_SOAK_SEED={seed}");
    let mut rng = Rng::new(seed);
    let mut h = harness().await;
    let mut m = Model::default();
    let (mut kills, mut lost, mut n, mut done) = (0, Vec::new(), 0usize, 0usize);
    let mut host_kills = 0;
    while done < ops {
        let op = done;
        n += 1;
        let c = h.c.clone();
        let kind = rng.below(8);
        // What the operation may make disappear, and how it is retried after a crash (stops
        // and removals are, as kubelet retries them).
        let mut gone: Vec<String> = Vec::new();
        let mut again: Option<(SoakRetry, String)> = None;
        let fut: SoakOp = match kind {
            0 | 1 if m.pods.len() < 4 => {
                let cfg = h.pod_config(&format!("soak-{n}"));
                Box::pin(async move { c.run_pod(&cfg, &handler()).await.map(|_| ()) })
            }
            0..=3 => match rng.pick(&m.ready_pods()) {
                Some(pod) => {
                    let (pod, pcfg) = (pod.clone(), m.pods[pod].1.clone());
                    let cfg = h.ctr_config(&format!("c{n}"), "exec sleep 100000");
                    Box::pin(async move {
                        let id = c.create_container(&pod, &pcfg, cfg).await?;
                        c.start_container(&id).await
                    })
                }
                None => continue,
            },
            4 => match rng.pick(&m.running()) {
                Some(id) => {
                    let id = id.clone();
                    Box::pin(async move {
                        let r = c.exec_sync(&id, &["echo", "alive"], 10).await?;
                        assert_eq!(r.stdout, b"alive\n", "exec in {id}");
                        Ok(())
                    })
                }
                None => continue,
            },
            5 => match rng.pick(&m.ctrs.keys().cloned().collect::<Vec<_>>()) {
                Some(id) => {
                    gone.push(id.clone());
                    again = Some((soak_remove_container, id.clone()));
                    soak_remove_container(c, id.clone())
                }
                None => continue,
            },
            6 => match rng.pick(&m.ready_pods()) {
                Some(id) => {
                    again = Some((soak_stop_pod, id.clone()));
                    soak_stop_pod(c, id.clone())
                }
                None => continue,
            },
            _ => match rng.pick(&m.pods.keys().cloned().collect::<Vec<_>>()) {
                Some(id) => {
                    gone.push(id.clone());
                    gone.extend(
                        m.ctrs
                            .iter()
                            .filter(|(_, (p, _))| p == id)
                            .map(|(c, _)| c.clone()),
                    );
                    again = Some((soak_remove_pod, id.clone()));
                    soak_remove_pod(c, id.clone())
                }
                None => continue,
            },
        };
        done += 1;
        let crashed = rng.below(8) == 0;
        if crashed {
            // Crash in the middle: the outcome is unknown until vesseld is back.
            let task = tokio::spawn(fut);
            tokio::time::sleep(Duration::from_millis(rng.below(40) as u64)).await;
            h.v.kill9();
            let _ = task.await;
            kills += 1;
            // Sometimes a pod's host process dies while vesseld is down too.
            // (Not one the interrupted operation was stopping or removing.)
            let doomed = if rng.below(2) == 0 {
                let ready: Vec<String> = m
                    .ready_pods()
                    .into_iter()
                    .filter(|p| !gone.contains(p) && again.as_ref().is_none_or(|(_, a)| a != p))
                    .collect();
                rng.pick(&ready).cloned()
            } else {
                None
            };
            if let Some(pod) = &doomed {
                host_kills += usize::from(h.v.kill_pod_host_process(pod));
            }
            h.v.restart().unwrap();
            h.c = h.v.client().await;
            if let Some(pod) = doomed {
                wait_not_ready(&h, &pod).await;
            }
        } else {
            fut.await
                .unwrap_or_else(|e| panic!("operation {op} (kind {kind}): {e}\n{}", h.v.log()));
        }
        m.forget(&gone);
        reconcile(&mut h, &mut m, &mut lost).await;
        if !crashed && rng.below(10) == 0 {
            if let Some(pod) = rng.pick(&m.ready_pods()).cloned() {
                if h.v.kill_pod_host_process(&pod) {
                    host_kills += 1;
                    wait_not_ready(&h, &pod).await;
                    reconcile(&mut h, &mut m, &mut lost).await;
                }
            }
        }
        assert!(
            lost.is_empty(),
            "lost after operation {op} (kind {kind}, crashed {crashed}): {lost:?}"
        );
        if let Some((retry, id)) = again.filter(|_| crashed) {
            // kubelet retries a stop or removal that failed; it must now succeed.
            retry(h.c.clone(), id)
                .await
                .unwrap_or_else(|e| panic!("retry of operation {op}: {e}\n{}", h.v.log()));
            m.forget(&gone);
            reconcile(&mut h, &mut m, &mut lost).await;
            assert!(
                lost.is_empty(),
                "lost after retrying operation {op}: {lost:?}"
            );
        }
    }
    println!(
        "crash soak: {done} operations run (of {n} drawn), {kills} kill -9 of vesseld, {host_kills} of a pod's host process, {} pods and {} containers at the end, 0 lost",
        m.pods.len(),
        m.ctrs.len()
    );
    for id in m.pods.keys().cloned().collect::<Vec<_>>() {
        h.remove_pod(&id).await;
    }
    h.assert_clean();
}

/// The systemd cgroup driver against a real systemd. CI's init is not systemd, so vesseld
/// first refuses to start with the driver, naming why; then it runs inside the namespaces of
/// a systemd booted as their PID 1 ([`SystemdInstance`]). A pod with kubelet's slice as its
/// cgroup parent gets a delegated scope unit in that slice holding its agent (moved on into a
/// leaf); its container's cgroup is beneath the scope with its memory limit; RuntimeConfig
/// says systemd; a cgroupfs parent is refused; the pod survives a restart of vesseld; a scope
/// without a record is stopped at start; stopping the pod removes its unit and cgroups.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_cgroup_driver_against_a_real_systemd() {
    systemd_driver("systemd_cgroup_driver_against_a_real_systemd", false).await;
}

/// The same with the systemd booted on the cgroup v2 hierarchy alone, as on a pure cgroup v2
/// host (here it has no controllers, which stay with v1, so the memory limit is checked only
/// where the v2 hierarchy has the memory controller).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_cgroup_driver_on_unified_cgroups() {
    systemd_driver("systemd_cgroup_driver_on_unified_cgroups", true).await;
}

async fn systemd_driver(test: &str, unified: bool) {
    if skip_unless(
        false,
        test,
        "the driver is the host's; VM guests have no systemd",
    ) {
        return;
    }
    let systemd = "[runtime]\ncgroup_driver = \"systemd\"\ndefault_handler = \"flat\"\n";
    if !vessel_cri::sandbox::systemd::booted() {
        let e = Vesseld::start(&vesseld_binary(), systemd)
            .err()
            .expect("vesseld must not start with the systemd driver without systemd");
        assert!(
            e.to_string().contains("systemd is not the init system"),
            "{e}"
        );
    }
    if let Some(why) = vessel_critest::systemd::unavailable() {
        println!("SKIP {test}: {why}");
        return;
    }
    let sd = vessel_critest::systemd::SystemdInstance::start_with(unified)
        .expect("systemd in namespaces");
    let (_reg, image) = vessel_critest::daemon::busybox_registry().await.unwrap();
    let mut v = Vesseld::start_wrapped(&vesseld_binary(), sd.wrapper(), "", systemd)
        .unwrap_or_else(|e| panic!("vesseld under systemd: {e}\n{}", sd.log()));
    let c = v.client().await;
    c.pull(&image).await.unwrap();
    let rc = c
        .runtime
        .clone()
        .runtime_config(cri::RuntimeConfigRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        rc.linux.unwrap().cgroup_driver,
        cri::CgroupDriver::Systemd as i32
    );

    let slice = "kubepods-besteffort-pode2e1.slice";
    let pod_cfg = |name: &str, parent: &str| cri::PodSandboxConfig {
        metadata: pod_metadata(name, "systemd"),
        linux: Some(cri::LinuxPodSandboxConfig {
            cgroup_parent: parent.into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let e = c
        .run_pod(&pod_cfg("cgroupfs", "/kubepods/besteffort/pod1"), "")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("systemd"), "{e}");

    let cfg = pod_cfg("scoped", slice);
    let pod = c
        .run_pod(&cfg, "")
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\n{}", v.log()));
    let unit = format!("vessel-pod-{pod}.scope");
    let scope_cg = format!("/kubepods.slice/kubepods-besteffort.slice/{slice}/{unit}");
    let show = |sd: &vessel_critest::systemd::SystemdInstance| {
        sd.systemctl(&[
            "show",
            "-p",
            "LoadState,ActiveState,Slice,Delegate,ControlGroup",
            &unit,
        ])
        .1
    };
    let s = show(&sd);
    for want in [
        "ActiveState=active".to_string(),
        format!("Slice={slice}"),
        "Delegate=yes".to_string(),
        format!("ControlGroup={scope_cg}"),
    ] {
        assert!(s.contains(&want), "{want} not in:\n{s}");
    }

    // The memory limit shows in the v1 memory hierarchy, or in the v2 one if it has the
    // memory controller.
    let v1_memory = Path::new("/sys/fs/cgroup/memory");
    let unified_host = sd.host_unified().expect("a cgroup v2 hierarchy");
    let limit_file = if !unified && v1_memory.join("memory.limit_in_bytes").exists() {
        Some("memory.limit_in_bytes")
    } else if std::fs::read_to_string(sd.host_cgroup(&unified_host, "cgroup.controllers"))
        .unwrap_or_default()
        .split_whitespace()
        .any(|c| c == "memory")
    {
        Some("memory.max")
    } else {
        None
    };
    let mut ccfg = sh_container("limited", &image, "sleep 1000");
    if limit_file.is_some() {
        ccfg.linux = Some(cri::LinuxContainerConfig {
            resources: Some(cri::LinuxContainerResources {
                memory_limit_in_bytes: 64 << 20,
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    let ctr = c.create_container(&pod, &cfg, ccfg).await.unwrap();
    if let Err(e) = c.start_container(&ctr).await {
        let agent_logs: String = walk_files(v.dir.path())
            .into_iter()
            .filter(|p| {
                p.to_string_lossy().contains("agent") && p.extension().is_some_and(|x| x == "log")
            })
            .map(|p| {
                format!(
                    "--- {}\n{}",
                    p.display(),
                    std::fs::read_to_string(&p).unwrap_or_default()
                )
            })
            .collect();
        panic!("StartContainer: {e}\n{agent_logs}");
    }
    match limit_file {
        Some(f) => {
            let h = if f == "memory.max" {
                unified_host.clone()
            } else {
                v1_memory.to_path_buf()
            };
            let p = sd.host_cgroup(&h, &format!("{scope_cg}/{ctr}/{f}"));
            assert_eq!(
                std::fs::read_to_string(&p)
                    .unwrap_or_else(|e| panic!("{}: {e}\n{}", p.display(), v.log()))
                    .trim(),
                (64u64 << 20).to_string()
            );
        }
        None => {
            let p = sd.host_cgroup(&unified_host, &format!("{scope_cg}/{ctr}/cgroup.procs"));
            let procs = std::fs::read_to_string(&p)
                .unwrap_or_else(|e| panic!("{}: {e}\n{}", p.display(), v.log()));
            assert!(!procs.trim().is_empty(), "the container runs in its cgroup");
        }
    }
    let unified = unified_host;
    let agent_leaf = sd.host_cgroup(&unified, &format!("{scope_cg}/vessel-agent/cgroup.procs"));
    let agent = std::fs::read_to_string(&agent_leaf).unwrap();
    assert!(!agent.trim().is_empty(), "the agent is in its leaf");
    let scope_procs = sd.host_cgroup(&unified, &format!("{scope_cg}/cgroup.procs"));
    assert_eq!(std::fs::read_to_string(&scope_procs).unwrap(), "");

    // A restart finds the pod as it was; a scope with no record (a pod whose record is gone)
    // is stopped.
    let w = sd.wrapper();
    let mut orphan = std::process::Command::new(&w[0])
        .args(&w[1..])
        .args([
            "systemd-run",
            "--quiet",
            "--scope",
            "--unit=vessel-pod-0rphan.scope",
            "--slice=vessel.slice",
            "sleep",
            "1000",
        ])
        .spawn()
        .unwrap();
    let orphan_up = || sd.systemctl(&["is-active", "vessel-pod-0rphan.scope"]).1;
    let t = Instant::now();
    while orphan_up().trim() != "active" {
        assert!(t.elapsed() < Duration::from_secs(10), "{}", orphan_up());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    v.restart().unwrap();
    let c = v.client().await;
    assert_eq!(
        c.pod_status(&pod).await.unwrap().state,
        cri::PodSandboxState::SandboxReady as i32
    );
    assert!(show(&sd).contains("ActiveState=active"));
    let t = Instant::now();
    while orphan_up().trim() == "active" {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "orphan scope kept: {}",
            v.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = orphan.wait();

    c.stop_and_remove_pod(&pod).await.unwrap();
    // Stopped (systemd collects an inactive transient unit soon after).
    let s = show(&sd);
    assert!(
        s.contains("LoadState=not-found") || s.contains("ActiveState=inactive"),
        "unit left:\n{s}"
    );
    for h in [v1_memory.to_path_buf(), unified] {
        let d = sd.host_cgroup(&h, &scope_cg);
        assert!(!d.exists(), "{} left", d.display());
    }
    drop(c);
    drop(v);
    drop(sd);
}

fn walk_files(d: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![d.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => out.push(e.path()),
                _ => {}
            }
        }
    }
    out
}

/// The volumes an image declares (Dockerfile `VOLUME`), as containerd makes them: writable
/// under a read-only root filesystem, holding the image's content there (owner and mode
/// too), each container's own; a path the image lacks is made; a CRI mount at the path takes
/// its place; nothing is left. `runtime.ignore_image_defined_volumes` leaves them out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_defined_volumes_are_the_containers_own() {
    // Pushed to the harness's registry and pulled: the image's name.
    async fn pulled(h: &mut H) -> String {
        let mut t = PushTarget::new(&h._reg.url(), "library/declares-volumes");
        t.insecure_tls = true;
        push_image(&t, &testimages::volume_image(), Some("v1"))
            .await
            .unwrap();
        let image = format!("{}/library/declares-volumes:v1", h._reg.host());
        h.c.pull(&image).await.expect("pull the image");
        image
    }
    let mut h = harness().await;
    let image = pulled(&mut h).await;
    let (pod, pcfg) = h.run_pod("imgdefvol").await;
    let host = tempfile::tempdir().unwrap();
    std::fs::write(host.path().join("from-host"), "host\n").unwrap();
    let cfg = |h: &H, image: &str, name: &str| {
        let mut c = h.ctr_config(name, "sleep 1000");
        c.image = Some(cri::ImageSpec {
            image: image.into(),
            ..Default::default()
        });
        c.mounts = vec![cri::Mount {
            container_path: "/covered/".into(),
            host_path: host.path().display().to_string(),
            ..Default::default()
        }];
        c.linux = Some(cri::LinuxContainerConfig {
            security_context: Some(cri::LinuxContainerSecurityContext {
                readonly_rootfs: true,
                ..Default::default()
            }),
            ..Default::default()
        });
        c
    };
    let script = "cat /data/seed; stat -c '%u:%g %a' /data /cache/deep; \
                  echo a > /data/new && echo b > /cache/deep/new && echo written; \
                  ls /covered; touch /elsewhere 2>/dev/null || echo read-only; \
                  stat -f -c %T /dev/shm; test -f /etc/resolv.conf && echo resolv-file";
    let (a, out) = h
        .run_and_sh(&pod, &pcfg, cfg(&h, &image, "a"), script)
        .await;
    assert_eq!(
        out,
        "seeded\n1000:1000 750\n0:0 755\nwritten\nfrom-host\nread-only\ntmpfs\nresolv-file\n",
        "{}",
        h.v.log()
    );
    // A second container's are its own: the image's content, not the first one's writes.
    let (_b, out) = h
        .run_and_sh(&pod, &pcfg, cfg(&h, &image, "b"), "ls /data /cache/deep")
        .await;
    assert_eq!(out, "/cache/deep:\n\n/data:\nseed\n");
    let r = h.exec(&a, &["cat", "/data/new"], 10).await.unwrap();
    assert_eq!(r.stdout, b"a\n");
    assert!(std::fs::read_dir(host.path()).unwrap().count() == 1);
    h.remove_pod(&pod).await;
    // In a pod with its own user namespace the image's owners show as in the image.
    let map = cri::IdMapping {
        container_id: 0,
        host_id: 300_000,
        length: 65536,
    };
    let (upod, upcfg) = h.run_userns_pod("imgdefvol-userns", map).await;
    let mut ucfg = cfg(&h, &image, "u");
    ucfg.mounts.clear();
    if let Some(sc) = ucfg
        .linux
        .as_mut()
        .and_then(|l| l.security_context.as_mut())
    {
        sc.namespace_options = Some(cri::NamespaceOption {
            userns_options: pod_userns(&upcfg),
            ..Default::default()
        });
        sc.run_as_user = Some(cri::Int64Value { value: 1000 });
    }
    let (_u, out) = h
        .run_and_sh(
            &upod,
            &upcfg,
            ucfg,
            "id -u; stat -c '%u:%g' /data/seed; echo c > /data/new && cat /data/new",
        )
        .await;
    assert_eq!(out, "1000\n1000:1000\nc\n", "{}", h.v.log());
    h.remove_pod(&upod).await;
    h.assert_clean();
    drop(h);
    // Turned off (flat: a VM harness's config has its own [runtime]).
    if vm_mode() {
        return;
    }
    let mut h = harness_with("[runtime]\nignore_image_defined_volumes = true\n").await;
    let image = pulled(&mut h).await;
    let (pod, pcfg) = h.run_pod("imgdefvol-off").await;
    let (_c, out) = h
        .run_and_sh(
            &pod,
            &pcfg,
            cfg(&h, &image, "c"),
            "echo a > /data/new 2>/dev/null || echo read-only; ls /cache 2>&1 | grep -c 'No such'",
        )
        .await;
    assert_eq!(out, "read-only\n1\n");
    h.remove_pod(&pod).await;
    h.assert_clean();
}

/// CRI image volumes (kubelet's ImageVolume): a mount that names an image shows that image's
/// content (all its layers, whiteouts applied) read-only at the container path. The image
/// cannot be removed while a container mounts it; removing the container unmounts it. An
/// image that is not on the node is NotFound, and leaves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_volumes_mount_an_image_read_only() {
    let mut h = harness().await;
    let wimg = testimages::whiteout_image();
    let mut t = PushTarget::new(&h._reg.url(), "library/volume");
    t.insecure_tls = true;
    push_image(&t, &wimg, Some("v1")).await.unwrap();
    let vname = format!("{}/library/volume:v1", h._reg.host());
    h.c.pull(&vname).await.expect("pull the volume's image");
    let (pod, pcfg) = h.run_pod("imgvol").await;
    let volume = |image: &str| cri::Mount {
        container_path: "/iv".into(),
        image: Some(cri::ImageSpec {
            image: image.into(),
            ..Default::default()
        }),
        readonly: true,
        ..Default::default()
    };

    let mut cfg = h.ctr_config("missing", "sleep 1000");
    cfg.mounts.push(volume("127.0.0.1:1/never/pulled:v1"));
    let e = h.create(&pod, &pcfg, cfg).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    assert!(e.message().contains("/iv"), "{e}");
    let iv_mounts = |h: &H| {
        mounts_under(h.v.dir.path())
            .into_iter()
            .filter(|m| m.contains("-iv"))
            .collect::<Vec<_>>()
    };
    assert!(iv_mounts(&h).is_empty());

    let mut cfg = h.ctr_config("reader", "sleep 1000");
    cfg.mounts.push(volume(&vname));
    let (id, out) = h
        .run_and_sh(
            &pod,
            &pcfg,
            cfg,
            "cat /iv/data/keep /iv/opaque/new; ls /iv/data; touch /iv/x 2>/dev/null || echo read-only",
        )
        .await;
    assert!(
        out.contains("keep") && out.contains("new") && !out.contains("gone"),
        "{out}"
    );
    assert!(out.contains("read-only"), "{out}");
    assert_eq!(iv_mounts(&h).len(), 1);
    // ContainerStatus names the volume's image by its digest (kubelet's volume mount status).
    let st = h.status(&id).await;
    let iv = st.mounts.iter().find(|m| m.container_path == "/iv");
    let image_ref = iv
        .and_then(|m| m.image.as_ref())
        .map(|i| i.image_ref.as_str());
    assert!(
        image_ref.is_some_and(|r| r.contains("sha256:")),
        "{:?}",
        st.mounts
    );

    // image_sub_path: the container sees that directory of the image, not its root.
    let sub = |path: &str| {
        let mut m = volume(&vname);
        m.container_path = "/sub".into();
        m.image_sub_path = path.into();
        m
    };
    let mut cfg = h.ctr_config("sub", "sleep 1000");
    cfg.mounts.push(sub("data"));
    let (sub_id, out) = h
        .run_and_sh(&pod, &pcfg, cfg, "ls /sub; cat /sub/keep")
        .await;
    assert!(out.contains("keep") && !out.contains("opaque"), "{out}");
    h.remove(&sub_id).await;
    for (bad, why) in [("no/such/dir", "does not exist"), ("../data", "`..`")] {
        let mut cfg = h.ctr_config("badsub", "sleep 1000");
        cfg.mounts.push(sub(bad));
        let e = h.create(&pod, &pcfg, cfg).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad}: {e}");
        assert!(
            e.message().contains(why) && e.message().contains("/sub"),
            "{e}"
        );
    }
    let mut cfg = h.ctr_config("subnoimage", "sleep 1000");
    cfg.mounts.push(cri::Mount {
        container_path: "/sub".into(),
        host_path: h.v.dir.path().display().to_string(),
        image_sub_path: "data".into(),
        ..Default::default()
    });
    let e = h.create(&pod, &pcfg, cfg).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("no image"), "{e}");
    assert_eq!(iv_mounts(&h).len(), 1, "a refused sub path leaves no mount");
    let e =
        h.c.images
            .remove_image(cri::RemoveImageRequest {
                image: Some(cri::ImageSpec {
                    image: vname.clone(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");

    h.remove(&id).await;
    assert!(iv_mounts(&h).is_empty());
    h.c.images
        .remove_image(cri::RemoveImageRequest {
            image: Some(cri::ImageSpec {
                image: vname,
                ..Default::default()
            }),
        })
        .await
        .expect("the image is free once its container is gone");
    h.remove_pod(&pod).await;
    h.assert_clean();
}

/// CDI devices (`cdi_devices`, and the `cdi.k8s.io/` annotation form): resolved from the
/// configured spec directories and applied for flat pods: a device node (with its cgroup
/// rule), environment, a mount and a poststart hook. An unknown device is NotFound and a
/// malformed name InvalidArgument, naming it. VM pods refuse CDI devices with a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdi_devices_are_applied_or_refused() {
    let specs = tempfile::tempdir().unwrap();
    let share = tempfile::tempdir().unwrap();
    std::fs::write(share.path().join("from-cdi"), "cdi mount\n").unwrap();
    let marker = share.path().join("hook-ran");
    std::fs::write(
        specs.path().join("vessel-test.yaml"),
        format!(
            r#"cdiVersion: "0.6.0"
kind: "vessel.test/dev"
containerEdits:
  env: ["VESSEL_CDI_SPEC=1"]
devices:
  - name: "null"
    containerEdits:
      env: ["VESSEL_CDI_DEVICE=null"]
      deviceNodes:
        - path: /dev/vessel-null
          hostPath: /dev/null
      mounts:
        - hostPath: {share}
          containerPath: /cdi-share
          options: ["ro"]
      hooks:
        - hookName: poststart
          path: /bin/sh
          args: ["sh", "-c", "touch {marker}"]
"#,
            share = share.path().display(),
            marker = marker.display()
        ),
    )
    .unwrap();
    let mut h = if vm_mode() {
        harness().await
    } else {
        harness_with(&format!(
            "[runtime]\ncdi_spec_dirs = [\"{}\"]\n",
            specs.path().display()
        ))
        .await
    };
    let (pod, pcfg) = h.run_pod("cdi").await;
    let with = |h: &H, name: &str, dev: &str| {
        let mut cfg = h.ctr_config(name, "sleep 1000");
        cfg.cdi_devices = vec![cri::CdiDevice { name: dev.into() }];
        cfg
    };
    if vm_mode() {
        let e = h
            .create(&pod, &pcfg, with(&h, "c", "vessel.test/dev=null"))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert!(e.message().contains("vessel.test/dev=null"), "{e}");
        h.remove_pod(&pod).await;
        h.assert_clean();
        return;
    }
    let e = h
        .create(&pod, &pcfg, with(&h, "unknown", "vessel.test/dev=none"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    assert!(e.message().contains("vessel.test/dev=none"), "{e}");
    let e = h
        .create(&pod, &pcfg, with(&h, "bad", "no-kind"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");

    let cfg = with(&h, "dev", "vessel.test/dev=null");
    let (_, out) = h
        .run_and_sh(
            &pod,
            &pcfg,
            cfg,
            "test -c /dev/vessel-null && echo node; echo x > /dev/vessel-null && echo writable; echo $VESSEL_CDI_SPEC $VESSEL_CDI_DEVICE; cat /cdi-share/from-cdi",
        )
        .await;
    for want in ["node", "writable", "1 null", "cdi mount"] {
        assert!(out.contains(want), "{want:?} not in {out:?}");
    }
    wait_for("the poststart hook", Duration::from_secs(10), || {
        marker.exists()
    })
    .await;
    h.remove_pod(&pod).await;
    h.assert_clean();
}

/// AppArmor is applied or refused, never ignored. Where the host has no AppArmor (this
/// machine), RuntimeDefault and Unconfined run and a Localhost profile (either field) is
/// InvalidArgument naming it; a malformed deprecated value too. Where it has AppArmor and its
/// parser (L1 of the nested harness, for flat and VM pods alike: a VM pod's guest kernel is
/// given the host's compiled policy), a profile the test loads confines the container and its
/// exec'd processes (writes denied), RuntimeDefault confines with `vessel-default`, and an
/// unloaded profile is InvalidArgument.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(deprecated)]
async fn apparmor_profiles_are_applied_or_refused() {
    let host_has_apparmor = vessel_cri::spec::apparmor::host_profiles().is_some();
    let parser = host_has_apparmor
        && std::process::Command::new("apparmor_parser")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
    if host_has_apparmor && !parser {
        println!("SKIP apparmor_profiles_are_applied_or_refused: AppArmor without apparmor_parser");
        return;
    }
    const DENY_WRITE: &str = "vessel-test-deny-write";
    // Loads (`--replace`) or unloads (`--remove`) the test's profile.
    let deny_write = |action: &str| {
        use std::io::Write as _;
        let mut child = std::process::Command::new("apparmor_parser")
            .arg(action)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("apparmor_parser");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(
                format!(
                    "profile {DENY_WRITE} flags=(attach_disconnected) {{\n  file,\n  capability,\n  signal,\n  deny /** w,\n}}\n"
                )
                .as_bytes(),
            )
            .unwrap();
        assert!(
            child.wait().unwrap().success(),
            "apparmor_parser {action} {DENY_WRITE}"
        );
    };
    if parser {
        deny_write("--replace");
    }
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("apparmor").await;
    let with = |h: &H, name: &str, field: Option<(i32, &str)>, old: &str| {
        let mut cfg = h.ctr_config(name, "sleep 1000");
        cfg.linux = Some(cri::LinuxContainerConfig {
            security_context: Some(cri::LinuxContainerSecurityContext {
                apparmor: field.map(|(t, r)| cri::SecurityProfile {
                    profile_type: t,
                    localhost_ref: r.into(),
                }),
                apparmor_profile: old.into(),
                ..Default::default()
            }),
            ..Default::default()
        });
        cfg
    };
    use cri::security_profile::ProfileType as P;
    let mut refused = vec![
        (
            "local-unloaded",
            Some((P::Localhost as i32, "vessel-test-absent")),
            "",
        ),
        ("local-unloaded-old", None, "localhost/vessel-test-absent"),
        ("bogus", None, "sometimes"),
    ];
    if !parser {
        refused.push(("local", Some((P::Localhost as i32, DENY_WRITE)), ""));
    }
    for (name, field, old) in refused {
        let e = h
            .create(&pod, &pcfg, with(&h, name, field, old))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{name}: {e}");
        if name != "bogus" {
            assert!(e.message().contains("vessel-test-"), "{e}");
        }
    }
    // Each container, and what it sees as its confinement.
    let (deny_old, deny_label) = (
        format!("localhost/{DENY_WRITE}"),
        format!("{DENY_WRITE} (enforce)"),
    );
    let mut fine = vec![
        (
            "unconfined",
            Some((P::Unconfined as i32, "")),
            "",
            "unconfined",
        ),
        (
            "default",
            Some((P::RuntimeDefault as i32, "")),
            "",
            "vessel-default (enforce)",
        ),
        (
            "default-old",
            None,
            "runtime/default",
            "vessel-default (enforce)",
        ),
    ];
    if parser {
        fine.push((
            "local",
            Some((P::Localhost as i32, DENY_WRITE)),
            "",
            &deny_label,
        ));
        fine.push(("local-old", None, &deny_old, &deny_label));
    }
    for (name, field, old, label) in fine {
        let id = h
            .create(&pod, &pcfg, with(&h, name, field, old))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        h.start(&id).await;
        if !parser {
            continue;
        }
        let r = h
            .exec(&id, &["cat", "/proc/self/attr/current"], 10)
            .await
            .unwrap();
        let seen = String::from_utf8_lossy(&r.stdout)
            .trim_end_matches(['\n', '\0'])
            .to_string();
        assert_eq!(seen, label, "{name}: the exec'd process's confinement");
        let w = h.exec(&id, &["touch", "/tmp/written"], 10).await.unwrap();
        assert_eq!(
            w.exit_code != 0,
            name.starts_with("local"),
            "{name}: a write under {label}: {w:?}"
        );
    }
    h.remove_pod(&pod).await;
    h.assert_clean();
    if parser {
        deny_write("--remove");
    }
}

/// Hugepage limits are applied where the hugetlb controller is (a flat pod on a host with
/// it), and a real limit is refused with InvalidArgument where it cannot be honoured (a host
/// without it, a VM guest), never dropped. kubelet's zero limits for every page size of the
/// node (what it sends for every container) run everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hugepage_limits_are_honoured_or_refused() {
    let hugetlb = std::path::Path::new("/sys/fs/cgroup/hugetlb").is_dir()
        || std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
            .is_ok_and(|c| c.split_whitespace().any(|x| x == "hugetlb"));
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("hugepages").await;
    let limits = |h: &H, name: &str, limit: u64| {
        let mut cfg = h.ctr_config(name, "sleep 1000");
        cfg.linux = Some(cri::LinuxContainerConfig {
            resources: Some(cri::LinuxContainerResources {
                hugepage_limits: ["2MB", "1GB"]
                    .iter()
                    .map(|p| cri::HugepageLimit {
                        page_size: p.to_string(),
                        limit: if *p == "2MB" { limit } else { 0 },
                    })
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        });
        cfg
    };
    let zero = h
        .create(&pod, &pcfg, limits(&h, "kubelet-default", 0))
        .await
        .expect("kubelet's zero hugepage limits run everywhere");
    h.start(&zero).await;
    let res = h.create(&pod, &pcfg, limits(&h, "huge", 4 << 20)).await;
    if hugetlb && !vm_mode() {
        let id = res.expect("hugepage limits where hugetlb is");
        h.start(&id).await;
    } else {
        let e = res.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert!(e.message().contains("hugepage"), "{e}");
    }
    h.remove_pod(&pod).await;
    h.assert_clean();
}

fn with_userns(
    mut cfg: cri::PodSandboxConfig,
    mode: cri::NamespaceMode,
    ids: Vec<cri::IdMapping>,
) -> cri::PodSandboxConfig {
    cfg.linux = Some(cri::LinuxPodSandboxConfig {
        security_context: Some(cri::LinuxSandboxSecurityContext {
            namespace_options: Some(cri::NamespaceOption {
                userns_options: Some(cri::UserNamespace {
                    mode: mode as i32,
                    uids: ids.clone(),
                    gids: ids,
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    cfg
}

/// The user namespace a pod config asks for, which kubelet repeats in each container's.
fn pod_userns(pcfg: &cri::PodSandboxConfig) -> Option<cri::UserNamespace> {
    pcfg.linux
        .as_ref()
        .and_then(|l| l.security_context.as_ref())
        .and_then(|s| s.namespace_options.as_ref())
        .and_then(|n| n.userns_options.clone())
}

fn id_map(container_id: u32, host_id: u32, length: u32) -> cri::IdMapping {
    cri::IdMapping {
        container_id,
        host_id,
        length,
    }
}

/// User namespaces (kubelet's `hostUsers: false`), as kubelet asks for them: the pod's one
/// mapping, which each container and each volume's mount carries too. In a flat pod the
/// containers see the mapping, are root over their own rootfs (idmapped image layers, a
/// writable layer of their root's), over the pod's network (ping sockets, binding port 80)
/// and over their volumes, whose files show with their owners on disk (idmapped mounts), and
/// what they write there is root's on the host. A container sharing the pod's pid namespace
/// sees its holder as PID 1. kubelet's `procMount: Unmasked` (empty masked and read-only
/// paths) leaves a container's /proc bare, so that a runtime in it can mount one of its own;
/// kubelet's default lists keep that from it. What CRI leaves undefined or kubelet never sends is refused;
/// NODE is the host's user namespace. Status advertises them for every handler. The same
/// holds in a VM pod (its guest's namespaces; its volumes through its file server's id
/// shift). Nothing is left afterwards, the holder process included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_namespaces_map_the_pod_its_rootfs_and_volumes() {
    let mut h = harness().await;
    let status =
        h.c.runtime
            .status(cri::StatusRequest { verbose: false })
            .await
            .expect("Status")
            .into_inner();
    let advertised = |name: &str| {
        status
            .runtime_handlers
            .iter()
            .find(|r| r.name == name)
            .and_then(|r| r.features)
            .is_some_and(|f| f.user_namespaces)
    };
    assert!(
        advertised("flat") && advertised("vm") && advertised(""),
        "{status:?}"
    );
    let map = id_map(0, 300_000, 65536);
    for (name, mode, ids, why) in [
        (
            "userns-ctr",
            cri::NamespaceMode::Container,
            vec![],
            "CONTAINER",
        ),
        (
            "userns-target",
            cri::NamespaceMode::Target,
            vec![],
            "TARGET",
        ),
        (
            "userns-two",
            cri::NamespaceMode::Pod,
            vec![map, id_map(65536, 400_000, 10)],
            "exactly one",
        ),
        (
            "userns-noroot",
            cri::NamespaceMode::Pod,
            vec![id_map(1, 300_000, 65536)],
            "container id 0",
        ),
        (
            "userns-nodemap",
            cri::NamespaceMode::Node,
            vec![map],
            "NODE takes no",
        ),
    ] {
        let e =
            h.c.run_pod(&with_userns(h.pod_config(name), mode, ids), &handler())
                .await
                .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{name}: {e}");
        assert!(e.message().contains(why), "{name}: {e}");
    }
    let node =
        h.c.run_pod(
            &with_userns(
                h.pod_config("userns-node"),
                cri::NamespaceMode::Node,
                vec![],
            ),
            &handler(),
        )
        .await
        .expect("NODE mode runs");
    h.c.stop_and_remove_pod(&node).await.unwrap();

    let (pod, pcfg) = h.run_userns_pod("userns-pod", map).await;
    let vol = tempfile::tempdir().unwrap();
    std::fs::write(vol.path().join("from-host"), "x").unwrap();
    let ns = |pid: cri::NamespaceMode| {
        Some(cri::LinuxContainerConfig {
            security_context: Some(cri::LinuxContainerSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    pid: pid as i32,
                    userns_options: pod_userns(&pcfg),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        })
    };
    let mut cfg = h.ctr_config("c", "sleep 1000");
    cfg.linux = ns(cri::NamespaceMode::Container);
    cfg.mounts = vec![cri::Mount {
        container_path: "/vol".into(),
        host_path: vol.path().display().to_string(),
        uid_mappings: vec![map],
        gid_mappings: vec![map],
        ..Default::default()
    }];
    let c = match h.create(&pod, &pcfg, cfg).await {
        Ok(c) => c,
        Err(e) => panic!("CreateContainer: {e}\n{}", h.v.log()),
    };
    let agent_log =
        h.v.dir
            .path()
            .join("root/pods")
            .join(&pod)
            .join("agent.log");
    let agent_log = move || std::fs::read_to_string(&agent_log).unwrap_or_default();
    if let Err(e) = h.c.start_container(&c).await {
        panic!("StartContainer: {e}\n{}", agent_log());
    }
    let sh = |script: &str| -> Vec<String> { vec!["sh".into(), "-c".into(), script.into()] };
    let script = "cat /proc/self/uid_map /proc/self/gid_map; id -u; stat -c %u:%g /bin/busybox /; \
                  echo hi > /written && stat -c %u:%g /written; \
                  stat -c %u:%g /vol/from-host; echo y > /vol/from-ctr; \
                  nc -l -p 80 & sleep 0.2; kill %1 && echo bound80; hostname";
    let args = sh(script);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = match h.exec(&c, &args, 20).await {
        Ok(o) => o,
        Err(e) => panic!("ExecSync: {e}\n{}", agent_log()),
    };
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let lines: Vec<String> = text
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    let want = [
        "0 300000 65536",
        "0 300000 65536",
        "0",
        "0:0",
        "0:0",
        "0:0",
        "0:0",
        "bound80",
        "userns-pod",
    ];
    assert_eq!(
        lines,
        want,
        "stdout {text:?} stderr {:?}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A restart of vesseld finds the pod as it was: exec'd processes still join its user
    // namespace.
    h.v.kill9();
    h.v.restart().unwrap();
    h.c = h.v.client().await;
    let out = h
        .exec(&c, &["cat", "/proc/self/uid_map"], 10)
        .await
        .expect("ExecSync after a restart");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .collect::<Vec<_>>(),
        ["0", "300000", "65536"]
    );
    // What the container's root wrote through the idmapped volume is root's on the host.
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(vol.path().join("from-ctr")).unwrap();
    assert_eq!((m.uid(), m.gid()), (0, 0));
    // kubelet sends empty masked and read-only paths for `procMount: Unmasked`, allowed
    // only in such a pod: the container's /proc has nothing over it, so a container runtime
    // in it can mount a /proc of its own (a new user and pid namespace under the pod's).
    let nested = "echo $(grep -c ' /proc/' /proc/self/mountinfo)-over-proc; \
                  unshare -Urpf --mount-proc sh -c 'echo nested-pid-$$' 2>&1";
    let out = h
        .exec(&c, &["sh", "-c", nested], 20)
        .await
        .expect("ExecSync (unmasked)");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0-over-proc\nnested-pid-1",
        "{out:?}"
    );
    // A container in the pod's pid namespace sees the namespace's holder as PID 1. It gets
    // kubelet's lists for `procMount: Default`, which mask /proc and so keep a /proc from
    // being mounted under it.
    let mut cfg = h.ctr_config("p", "sleep 1000");
    cfg.linux = ns(cri::NamespaceMode::Pod);
    if let Some(sc) = cfg.linux.as_mut().and_then(|l| l.security_context.as_mut()) {
        sc.masked_paths = vec!["/proc/kcore".into(), "/proc/keys".into()];
        sc.readonly_paths = vec!["/proc/sys".into()];
    }
    let p = h
        .create(&pod, &pcfg, cfg)
        .await
        .expect("CreateContainer (pid POD)");
    if let Err(e) = h.c.start_container(&p).await {
        panic!("StartContainer (pid POD): {e}\n{}", agent_log());
    }
    let out = h
        .exec(&p, &["cat", "/proc/1/comm"], 10)
        .await
        .expect("ExecSync");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "vessel-pidns");
    let out = h
        .exec(&p, &["sh", "-c", nested], 20)
        .await
        .expect("ExecSync (masked)");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        !text.starts_with("0-over-proc") && !text.contains("nested-pid"),
        "{out:?}"
    );
    // ... which is the pod's root without a capability, and not a way to the host's files
    // (its root is an empty directory of its own).
    let script = "grep -E '^(Uid|CapEff|CapPrm|CapBnd):' /proc/1/status; \
                  echo $(ls -A /proc/1/root/ | wc -l)-entries $(wc -l < /proc/1/mountinfo)-mounts";
    let out = h
        .exec(&p, &["sh", "-c", script], 10)
        .await
        .expect("ExecSync");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let fields: Vec<Vec<&str>> = text
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(fields.len(), 5, "{text}");
    assert_eq!(fields[0], ["Uid:", "0", "0", "0", "0"], "{text}");
    for f in &fields[1..4] {
        assert_eq!(f[1], "0000000000000000", "{text}");
    }
    assert_eq!(fields[4], ["0-entries", "1-mounts"], "{text}");
    // The host's pid namespace is not for a container of such a pod.
    let mut cfg = h.ctr_config("hostpid", "true");
    cfg.linux = ns(cri::NamespaceMode::Node);
    let e = h.create(&pod, &pcfg, cfg).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    // A volume with other mappings than the pod's is refused.
    let mut cfg = h.ctr_config("bad", "true");
    cfg.linux = ns(cri::NamespaceMode::Container);
    cfg.mounts = vec![cri::Mount {
        container_path: "/vol".into(),
        host_path: vol.path().display().to_string(),
        uid_mappings: vec![id_map(0, 500_000, 65536)],
        gid_mappings: vec![map],
        ..Default::default()
    }];
    let e = h.create(&pod, &pcfg, cfg).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    // So is a user the mapping does not cover.
    let mut cfg = h.ctr_config("unmapped", "true");
    cfg.linux = ns(cri::NamespaceMode::Container);
    if let Some(sc) = cfg.linux.as_mut().and_then(|l| l.security_context.as_mut()) {
        sc.run_as_user = Some(cri::Int64Value { value: 70_000 });
    }
    let e = h.create(&pod, &pcfg, cfg).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("not mapped"), "{e}");
    // The pod's pid namespace holder goes with it. (In a VM pod the holder is in the guest,
    // gone with it.)
    let agent = h.c.pod_info(&pod).await.unwrap()["pid"]
        .as_u64()
        .unwrap_or(0);
    let holders = holders_of(agent);
    assert_eq!(vm_mode(), holders.is_empty(), "holders {holders:?}");
    h.remove_pod(&pod).await;
    h.assert_clean();
    let left: Vec<&String> = holders
        .iter()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .is_ok_and(|c| c.trim() == "vessel-pidns")
        })
        .collect();
    assert!(left.is_empty(), "pid namespace holders left: {left:?}");
}

/// ListMetricDescriptors and ListPodSandboxMetrics (kubelet's /metrics/cadvisor from CRI):
/// cAdvisor's names, every metric's label values matching its descriptor's keys, and a
/// running container's CPU, memory and start time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_sandbox_metrics_follow_their_descriptors() {
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("metrics").await;
    let id = h
        .run(
            &pod,
            &pcfg,
            "busy",
            // 4 MB held in the shell's heap: a working set that page cache on the inactive
            // list cannot hide (a VM pod's busybox pages outweigh a bare shell's anon).
            "x=$(yes 0123456789abcdef | head -c 4000000); i=0; \
             while [ $i -lt 20000 ]; do i=$((i+1)); done; sleep 1000",
        )
        .await;
    let descs =
        h.c.runtime
            .list_metric_descriptors(cri::ListMetricDescriptorsRequest {})
            .await
            .unwrap()
            .into_inner()
            .descriptors;
    let keys: HashMap<String, usize> = descs
        .iter()
        .map(|d| (d.name.clone(), d.label_keys.len()))
        .collect();
    assert!(
        keys.contains_key("container_cpu_usage_seconds_total"),
        "{descs:?}"
    );
    // Until the shell holds its 4 MB (it starts on its own time).
    let deadline = Instant::now() + Duration::from_secs(30);
    let (p, c, ws) = loop {
        let metrics =
            h.c.runtime
                .list_pod_sandbox_metrics(cri::ListPodSandboxMetricsRequest {})
                .await
                .unwrap()
                .into_inner()
                .pod_metrics;
        let p = metrics
            .into_iter()
            .find(|m| m.pod_sandbox_id == pod)
            .unwrap_or_else(|| panic!("no metrics for pod {pod}"));
        let c = p
            .container_metrics
            .iter()
            .find(|c| c.container_id == id)
            .expect("the container's metrics")
            .clone();
        let ws = c
            .metrics
            .iter()
            .find(|m| m.name == "container_memory_working_set_bytes")
            .and_then(|m| m.value.as_ref())
            .map_or(0, |v| v.value);
        if ws >= 4_000_000 || Instant::now() > deadline {
            break (p, c, ws);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for m in p.metrics.iter().chain(&c.metrics) {
        assert_eq!(
            keys.get(&m.name),
            Some(&m.label_values.len()),
            "{} has no descriptor or other labels: {m:?}",
            m.name
        );
    }
    let names: Vec<&str> = c.metrics.iter().map(|m| m.name.as_str()).collect();
    for want in [
        "container_cpu_usage_seconds_total",
        "container_memory_working_set_bytes",
        "container_start_time_seconds",
    ] {
        assert!(names.contains(&want), "{want} not in {names:?}");
    }
    assert!(ws >= 4_000_000, "working set {ws}: {:?}", c.metrics);
    assert!(c.metrics[0].label_values.contains(&"busy".to_string()));
    // PSI as cAdvisor's pressure counters: a VM pod's guest has it; this host's cgroup v1 not.
    let pressure = names
        .iter()
        .filter(|n| n.starts_with("container_pressure_"))
        .count();
    let psi_host = Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
        && Path::new("/proc/pressure/cpu").exists();
    let want = if vm_mode() || psi_host { 6 } else { 0 };
    assert_eq!(pressure, want, "{names:?}");
    h.remove_pod(&pod).await;
    h.assert_clean();
}

/// The entries of a tar archive (directories with their trailing slash dropped).
/// Appends a regular file `name` holding `data` (mode 0600) to a tar.
fn tar_add<W: std::io::Write>(b: &mut tar::Builder<W>, name: &str, data: &[u8]) {
    let mut hd = tar::Header::new_gnu();
    hd.set_size(data.len() as u64);
    hd.set_mode(0o600);
    b.append_data(&mut hd, name, data).unwrap();
}

/// Appends a symlink `name` -> `target` to a tar.
fn tar_symlink<W: std::io::Write>(b: &mut tar::Builder<W>, name: &str, target: &Path) {
    let mut hd = tar::Header::new_gnu();
    hd.set_entry_type(tar::EntryType::Symlink);
    hd.set_size(0);
    hd.set_mode(0o777);
    b.append_link(&mut hd, name, target).unwrap();
}

fn tar_names(data: &[u8]) -> Vec<String> {
    let mut names: Vec<String> = tar::Archive::new(data)
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().display().to_string())
        .collect();
    names.sort();
    names
}

/// The pid namespace holders (`vessel-pidns`) whose parent is the process `agent`.
fn holders_of(agent: u64) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim() == "vessel-pidns")
                && std::fs::read_to_string(e.path().join("status")).is_ok_and(|s| {
                    s.lines()
                        .any(|l| l.strip_prefix("PPid:").map(str::trim) == Some(&agent.to_string()))
                })
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

/// One file of a tar archive.
fn tar_file(data: &[u8], name: &str) -> Vec<u8> {
    use std::io::Read;
    for e in tar::Archive::new(data).entries().unwrap() {
        let mut e = e.unwrap();
        if e.path().unwrap().display().to_string() == name {
            let mut v = Vec::new();
            e.read_to_end(&mut v).unwrap();
            return v;
        }
    }
    panic!("no {name} in the archive: {:?}", tar_names(data));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_a_running_container() {
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("ckpt").await;
    let id = h
        .run(
            &pod,
            &pcfg,
            "counter",
            "rm /bin/ls; mkdir -p /data; echo kept > /data/file; i=0; \
             while true; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/count; sleep 0.1; done",
        )
        .await;
    let dir = tempfile::tempdir().unwrap();
    let location = dir.path().join("exports/counter.tar");
    let location = location.to_str().unwrap();
    // What any runtime refuses first.
    let e = h
        .checkpoint("no-such-container", location, 60)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    let e = h.checkpoint(&id, "relative.tar", 60).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    // Nor a location that is not a file the archive may replace (it replaced /dev/null).
    let fifo = dir.path().join("fifo");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let e = h
        .checkpoint(&id, fifo.to_str().unwrap(), 60)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(rustix::fs::stat(&fifo).is_ok_and(|s| s.st_mode & libc::S_IFMT == libc::S_IFIFO));
    if vm_mode() {
        let e = h.checkpoint(&id, location, 60).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.message().contains("CRIU"), "{e}");
        h.remove_pod(&pod).await;
        h.assert_clean();
        return;
    }
    if let Some(why) = vessel_critest::daemon::criu_unusable() {
        println!("SKIP checkpoint_a_running_container (the dump): {why}");
        h.remove_pod(&pod).await;
        h.assert_clean();
        return;
    }
    wait_count_past(
        &h,
        &id,
        2,
        Duration::from_secs(10),
        "the counter does not count",
    )
    .await;

    if let Err(e) = h.checkpoint(&id, location, 60).await {
        panic!("CheckpointContainer: {e}\n{}", h.v.log());
    }
    let data = std::fs::read(location).unwrap();
    let names = tar_names(&data);
    for want in [
        "checkpoint/inventory.img",
        "checkpoint/pstree.img",
        "checkpoint/dump.log",
        "config.dump",
        "spec.dump",
        "rootfs-diff.tar",
        "deleted.files",
    ] {
        assert!(names.iter().any(|n| n == want), "no {want} in {names:?}");
    }
    let config: serde_json::Value =
        serde_json::from_slice(&tar_file(&data, "config.dump")).unwrap();
    assert_eq!(config["id"], id.as_str(), "{config}");
    assert_eq!(config["name"], "counter", "{config}");
    assert_eq!(config["rootfsImageName"], h.image.as_str(), "{config}");
    let spec: serde_json::Value = serde_json::from_slice(&tar_file(&data, "spec.dump")).unwrap();
    assert!(
        spec["process"]["args"].to_string().contains("/tmp/count"),
        "{spec}"
    );
    // Named as containerd's CRI names containers (what checkpointctl shows).
    let a = &spec["annotations"];
    assert_eq!(a["io.kubernetes.cri.container-name"], "counter", "{a}");
    assert_eq!(a["io.kubernetes.cri.sandbox-name"], "ckpt", "{a}");
    assert_eq!(a["io.kubernetes.cri.sandbox-namespace"], "e2e", "{a}");
    assert_eq!(a["io.kubernetes.cri.sandbox-id"], pod.as_str(), "{a}");
    let diff = tar_file(&data, "rootfs-diff.tar");
    let diff_names = tar_names(&diff);
    for want in ["data/file", "tmp/count"] {
        assert!(
            diff_names.iter().any(|n| n == want),
            "no {want} in {diff_names:?}"
        );
    }
    assert_eq!(tar_file(&diff, "data/file"), b"kept\n");
    let deleted: Vec<String> = serde_json::from_slice(&tar_file(&data, "deleted.files")).unwrap();
    assert_eq!(deleted, ["/bin/ls"]);
    // Only the archive in its directory; nothing staged is left in vesseld's root.
    assert_eq!(
        std::fs::read_dir(Path::new(location).parent().unwrap())
            .unwrap()
            .count(),
        1
    );
    let staged = h.v.root_dir().join("checkpoints");
    assert_eq!(
        std::fs::read_dir(&staged).unwrap().count(),
        0,
        "{}",
        staged.display()
    );

    // It runs on.
    let st = h.status(&id).await;
    assert_eq!(st.state, cri::ContainerState::ContainerRunning as i32);
    let before = count_in(&h.c, &id).await;
    let stopped = "the counter stopped after the checkpoint";
    wait_count_past(&h, &id, before, Duration::from_secs(10), stopped).await;

    // A stop its caller gave up on (kubelet's deadline) no longer counts: the container
    // runs on (the shell ignores SIGTERM) and can be checkpointed.
    let gave_up = spawn_stop(&h, &id, 60);
    tokio::time::sleep(Duration::from_millis(500)).await;
    gave_up.abort();
    let after = dir.path().join("after.tar");
    let mut given_up = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        match h.checkpoint(&id, after.to_str().unwrap(), 60).await {
            Ok(()) => break,
            Err(e) => given_up = Some(e),
        }
    }
    assert!(after.exists(), "after a stop given up on: {given_up:?}");
    // Nor one being stopped: StopContainer waits out its grace period (the shell, PID 1 of
    // its pid namespace, ignores SIGTERM), and the checkpoint is refused meanwhile.
    let stopping = spawn_stop(&h, &id, 3);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = dir.path().join("during.tar");
    let e = h
        .checkpoint(&id, during.to_str().unwrap(), 60)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("being stopped"), "{e}");
    assert!(!during.exists());
    stopping.await.unwrap().expect("StopContainer");
    // A stopped container has nothing to dump.
    h.stop(&id, 0).await;
    let again = dir.path().join("again.tar");
    let e = h
        .checkpoint(&id, again.to_str().unwrap(), 60)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(!again.exists());
    h.remove_pod(&pod).await;
    h.assert_clean();
}

/// A StopContainer of `id` with grace period `timeout`, running on its own.
fn spawn_stop(
    h: &H,
    id: &str,
    timeout: i64,
) -> tokio::task::JoinHandle<Result<tonic::Response<cri::StopContainerResponse>, tonic::Status>> {
    let mut rt = h.c.runtime.clone();
    let req = cri::StopContainerRequest {
        container_id: id.to_string(),
        timeout,
    };
    tokio::spawn(async move { rt.stop_container(req).await })
}

/// A checkpoint restored into another pod (CreateContainer whose image is the archive's
/// path, as with CRI-O): the processes go on from where they were (a shell's counter in
/// memory), with the root filesystem changes (a file written, one deleted), in the new
/// pod, with the new container's volume, log and exec; the archive's base image must be
/// here. Then the restored container stops and goes like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_a_checkpoint_into_another_pod() {
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("ckpt-src").await;
    let dir = tempfile::tempdir().unwrap();
    let (vol_a, vol_b) = (dir.path().join("vol-a"), dir.path().join("vol-b"));
    std::fs::create_dir_all(&vol_a).unwrap();
    std::fs::create_dir_all(&vol_b).unwrap();
    let volume = |host: &Path| cri::Mount {
        container_path: "/vol".into(),
        host_path: host.display().to_string(),
        ..Default::default()
    };
    // A file held open while it is renamed back and forth every 10 ms: CRIU records it open
    // under one name, and the root filesystem's changes must be archived before the dumped
    // tasks run on (a diff taken after had the other name, and the restore failed with
    // "Can't open file tmp/held").
    let mut cfg = h.ctr_config(
        "counter",
        "rm /bin/ls; echo kept > /kept; i=0; \
         (exec 3>/tmp/held; while true; do mv /tmp/held /tmp/held2; sleep 0.01; \
         mv /tmp/held2 /tmp/held; sleep 0.01; done) & \
         while true; do i=$((i+1)); echo $i; echo $i > /vol/last; echo $i > /tmp/c.new; \
         mv /tmp/c.new /tmp/count; sleep 0.1; done",
    );
    cfg.mounts.push(volume(&vol_a));
    let archive = dir.path().join("counter.tar");
    let archive_s = archive.display().to_string();
    // The checkpoint is the image; the command is the checkpointed one.
    let restored_cfg = |name: &str, image: &str| cri::ContainerConfig {
        command: Vec::new(),
        mounts: vec![volume(&vol_b)],
        ..sh_container(name, image, "")
    };
    let id = h
        .create(&pod, &pcfg, cfg)
        .await
        .unwrap_or_else(|e| panic!("CreateContainer: {e}"));
    h.start(&id).await;
    // What is refused whatever the pod: no such archive, a file that is not one.
    let e = h
        .create(&pod, &pcfg, restored_cfg("probe", "/no/such/archive.tar"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    let not_one = dir.path().join("not-an-archive.tar");
    std::fs::write(&not_one, b"hello").unwrap();
    let e = h
        .create(
            &pod,
            &pcfg,
            restored_cfg("probe", not_one.to_str().unwrap()),
        )
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    // An archive with its metadata but no CRIU images; a VM pod refuses any.
    let base = h.image.clone();
    // A checkpoint archive's metadata (its base image here), then `more` entries.
    let hollow = |name: &str, more: &dyn Fn(&mut tar::Builder<Vec<u8>>)| {
        let mut b = tar::Builder::new(Vec::new());
        let config = serde_json::json!({"name": "counter", "rootfsImageName": base});
        let spec = serde_json::json!({"process": {"args": ["sleep", "1"]}});
        tar_add(&mut b, "config.dump", config.to_string().as_bytes());
        tar_add(&mut b, "spec.dump", spec.to_string().as_bytes());
        more(&mut b);
        let path = dir.path().join(name);
        std::fs::write(&path, b.into_inner().unwrap()).unwrap();
        path.display().to_string()
    };
    let e = h
        .create(
            &pod,
            &pcfg,
            restored_cfg("probe", &hollow("hollow.tar", &|_| {})),
        )
        .await
        .unwrap_err();
    if vm_mode() {
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    } else {
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert!(e.message().contains("no CRIU images"), "{e}");
        // CRIU images that CRIU cannot read: StartContainer fails with CRIU's reason, and
        // the container (never running) goes with nothing left.
        let bad = hollow("bad.tar", &|b| {
            tar_add(b, "checkpoint/inventory.img", b"not an image")
        });
        let broken = h
            .create(&pod, &pcfg, restored_cfg("probe", &bad))
            .await
            .unwrap_or_else(|e| panic!("CreateContainer from {bad}: {e}"));
        let e = h.c.start_container(&broken).await.unwrap_err();
        assert!(e.message().contains("criu"), "{e}");
        let st = h.status(&broken).await;
        assert_ne!(
            st.state,
            cri::ContainerState::ContainerRunning as i32,
            "{st:?}"
        );
        h.remove(&broken).await;
        // A hostile archive touches nothing of the host's: a symlink among the CRIU images
        // (CRIU would read, or write its log through, a host file) is refused; a diff
        // symlink to a host directory, then a deleted file under it, deletes nothing there.
        let host = tempfile::tempdir().unwrap();
        std::fs::write(host.path().join("victim"), "host's").unwrap();
        let victim = host.path().join("victim");
        let evil = hollow("evil-images.tar", &|b| {
            tar_symlink(b, "checkpoint/inventory.img", &victim)
        });
        let e = h
            .create(&pod, &pcfg, restored_cfg("probe", &evil))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert!(e.message().contains("only regular files"), "{e}");
        let mut diff = tar::Builder::new(Vec::new());
        tar_symlink(&mut diff, "a", host.path());
        let diff = diff.into_inner().unwrap();
        let evil = hollow("evil-diff.tar", &|b| {
            tar_add(b, "rootfs-diff.tar", &diff);
            tar_add(b, "deleted.files", br#"["/a/victim"]"#);
        });
        let e = h
            .create(&pod, &pcfg, restored_cfg("probe", &evil))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert_eq!(
            std::fs::read_to_string(host.path().join("victim")).unwrap(),
            "host's"
        );
    }
    // A checkpoint image is whoever pushed it's: its layer's config.dump a symlink to a host
    // file (one that would parse) is refused, not read.
    let host_json = dir.path().join("host.json");
    std::fs::write(
        &host_json,
        serde_json::json!({"rootfsImageName": h.image}).to_string(),
    )
    .unwrap();
    let mut b = tar::Builder::new(Vec::new());
    tar_symlink(&mut b, "config.dump", &host_json);
    let spec = serde_json::json!({"process": {}}).to_string();
    tar_add(&mut b, "spec.dump", spec.as_bytes());
    let linked = testimages::checkpoint_image(&b.into_inner().unwrap(), "counter");
    let mut t = PushTarget::new(&h._reg.url(), "library/linked-checkpoint");
    t.insecure_tls = true;
    push_image(&t, &linked, Some("v1")).await.unwrap();
    let lname = format!("{}/library/linked-checkpoint:v1", h._reg.host());
    h.c.pull(&lname)
        .await
        .expect("pull the linked checkpoint image");
    let e = h
        .create(&pod, &pcfg, restored_cfg("probe", &lname))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("symlink"), "{e}");
    if vm_mode() || vessel_critest::daemon::criu_unusable().is_some() {
        println!(
            "SKIP restore_a_checkpoint_into_another_pod (the restore): {}",
            vessel_critest::daemon::criu_unusable()
                .unwrap_or_else(|| "VM pods have no CRIU in their guest".into())
        );
        h.remove_pod(&pod).await;
        h.assert_clean();
        return;
    }
    // Long enough that a fresh start could not have counted as far in the same time.
    wait_count_past(
        &h,
        &id,
        29,
        Duration::from_secs(20),
        "the counter does not count",
    )
    .await;
    if let Err(e) = h.checkpoint(&id, &archive_s, 60).await {
        panic!("CheckpointContainer: {e}\n{}", h.v.log());
    }
    // Taken from the first pod, which goes.
    h.remove_pod(&pod).await;
    let at_checkpoint: u64 = std::fs::read_to_string(vol_a.join("last"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();

    // The same archive gzip-compressed.
    let gz = dir.path().join("counter.tar.gz");
    {
        let mut w = flate2::write::GzEncoder::new(
            std::fs::File::create(&gz).unwrap(),
            flate2::Compression::fast(),
        );
        std::io::copy(&mut std::fs::File::open(&archive).unwrap(), &mut w).unwrap();
        w.finish().unwrap();
    }
    let archive_s = gz.display().to_string();
    let (pod2, pcfg2) = h.run_pod("ckpt-dst").await;
    // Without the volume CRIU recorded at /vol there is nothing to restore it onto.
    let mut no_vol = restored_cfg("no-volume", &archive_s);
    no_vol.mounts.clear();
    let e = h.create(&pod2, &pcfg2, no_vol).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("/vol"), "{e}");
    let restored = h
        .create(&pod2, &pcfg2, restored_cfg("counter", &archive_s))
        .await
        .unwrap_or_else(|e| panic!("CreateContainer from {archive_s}: {e}\n{}", h.v.log()));
    let st = h.status(&restored).await;
    assert_eq!(st.state, cri::ContainerState::ContainerCreated as i32);
    assert_eq!(st.image.as_ref().unwrap().image, h.image, "{st:?}");
    let t = Instant::now();
    h.start(&restored).await;
    println!("restore took {:?}", t.elapsed());
    let st = h.status(&restored).await;
    assert_eq!(
        st.state,
        cri::ContainerState::ContainerRunning as i32,
        "{st:?}"
    );
    // The CRIU images (its memory) go once restored; CRIU's log stays.
    let images =
        h.v.root_dir()
            .join("images/snapshots")
            .join(&restored)
            .join("checkpoint");
    wait_for("the restored images to go", Duration::from_secs(10), || {
        std::fs::read_dir(&images).is_ok_and(|d| {
            d.flatten().map(|e| e.file_name()).collect::<Vec<_>>() == ["restore.log"]
        })
    })
    .await;
    // The counter goes on from about where it was, in the new volume.
    let last_b = || {
        std::fs::read_to_string(vol_b.join("last"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    wait_for(
        "the restored counter to write the new volume",
        Duration::from_secs(10),
        || last_b().is_some_and(|n| n > at_checkpoint),
    )
    .await;
    let n = count_in(&h.c, &restored).await;
    assert!(n > at_checkpoint, "{n} <= {at_checkpoint}");
    // The root filesystem as the container left it.
    let r = h.exec(&restored, &["cat", "/kept"], 5).await.unwrap();
    assert_eq!(r.stdout, b"kept\n");
    let r = h
        .exec(&restored, &["sh", "-c", "test -e /bin/ls"], 5)
        .await
        .unwrap();
    assert_ne!(r.exit_code, 0, "/bin/ls came back");
    // Its output goes to the new container's log.
    let log = h.log_of("ckpt-dst", "counter");
    wait_for(
        "the restored container's log",
        Duration::from_secs(10),
        || {
            cri_log_lines(&log)
                .iter()
                .any(|(s, _, m)| s == "stdout" && m.parse::<u64>().is_ok_and(|n| n > at_checkpoint))
        },
    )
    .await;
    let first: u64 = cri_log_lines(&log)
        .first()
        .map(|(_, _, m)| m.parse().unwrap())
        .unwrap();
    assert!(
        first > at_checkpoint / 2,
        "the log starts at {first}: restarted, not restored"
    );

    // The Kubernetes way: the restored container's checkpoint made into a checkpoint image
    // (as buildah makes one), pulled, and named as a pod's image in a third pod.
    let again = dir.path().join("again.tar");
    if let Err(e) = h.checkpoint(&restored, again.to_str().unwrap(), 60).await {
        panic!(
            "CheckpointContainer of a restored container: {e}\n{}",
            h.v.log()
        );
    }
    h.remove_pod(&pod2).await;
    let at_second: u64 = std::fs::read_to_string(vol_b.join("last"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let cimg = testimages::checkpoint_image(&std::fs::read(&again).unwrap(), "counter");
    let mut t = PushTarget::new(&h._reg.url(), "library/counter-checkpoint");
    t.insecure_tls = true;
    push_image(&t, &cimg, Some("v1")).await.unwrap();
    let cname = format!("{}/library/counter-checkpoint:v1", h._reg.host());
    h.c.pull(&cname).await.expect("pull the checkpoint image");
    let (pod3, pcfg3) = h.run_pod("ckpt-img").await;
    let from_image = h
        .create(&pod3, &pcfg3, restored_cfg("counter", &cname))
        .await
        .unwrap_or_else(|e| panic!("CreateContainer from {cname}: {e}\n{}", h.v.log()));
    h.start(&from_image).await;
    let what = format!("the counter restored from an image does not go on from {at_second}");
    wait_count_past(&h, &from_image, at_second, Duration::from_secs(10), &what).await;
    let log = h.log_of("ckpt-img", "counter");
    wait_for(
        "the log of the container restored from an image",
        Duration::from_secs(10),
        || !cri_log_lines(&log).is_empty(),
    )
    .await;
    let first: u64 = cri_log_lines(&log)[0].2.parse().unwrap();
    assert!(first > at_second / 2, "the log starts at {first}");

    h.stop(&from_image, 0).await;
    let st = h.wait_exit(&from_image, Duration::from_secs(10)).await;
    assert_eq!(st.exit_code, 137, "{st:?}");
    h.remove_pod(&pod3).await;
    h.assert_clean();
}

/// A tty container (kubectl run -it) in a pod sharing one pid namespace, with a volume and a
/// listening socket, an interactive shell attached to, and a tty in a user-namespaced pod;
/// then checkpoints of the running ones. A flat pod's container dir is
/// too deep for a console socket path: tty containers failed to start there ("path must be
/// shorter than SUN_LEN") until the socket moved to the agent's short dir.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tty_container_and_checkpoints_in_a_shared_pid_pod() {
    let mut h = harness().await;
    let mut pcfg = h.pod_config("tty-ckpt");
    pcfg.linux = Some(cri::LinuxPodSandboxConfig {
        security_context: Some(cri::LinuxSandboxSecurityContext {
            namespace_options: Some(cri::NamespaceOption {
                pid: cri::NamespaceMode::Pod as i32,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    let pod = h.c.run_pod(&pcfg, &handler()).await.unwrap();
    let vol = tempfile::tempdir().unwrap();
    let vol_mount = vec![cri::Mount {
        container_path: "/vol".into(),
        host_path: vol.path().display().to_string(),
        ..Default::default()
    }];
    let mut cfg = h.ctr_config(
        "tty",
        "tty > /vol/tty; nc -ll -p 8080 -e echo hi & i=0; \
         while true; do i=$((i+1)); tty > /vol/now; echo tick $i; sleep 0.2; done",
    );
    cfg.tty = true;
    cfg.stdin = true;
    cfg.mounts = vol_mount.clone();
    let id = h
        .create(&pod, &pcfg, cfg)
        .await
        .unwrap_or_else(|e| panic!("CreateContainer: {e}"));
    h.start(&id).await;
    let sibling = h.run(&pod, &pcfg, "plain", "sleep 1000").await;
    let tty = vol.path().join("tty");
    wait_for("the tty's name", Duration::from_secs(10), || {
        std::fs::read_to_string(&tty).is_ok_and(|t| t.starts_with("/dev/pts/"))
    })
    .await;
    // kubectl run -it: an interactive shell on a tty, attached to.
    let mut cfg = h.ctr_config("shell", "");
    cfg.command = vec!["sh".into()];
    cfg.tty = true;
    cfg.stdin = true;
    cfg.mounts = vol_mount.clone();
    let shell = h
        .create(&pod, &pcfg, cfg)
        .await
        .unwrap_or_else(|e| panic!("CreateContainer: {e}"));
    h.start(&shell).await;
    let url =
        h.c.runtime
            .attach(cri::AttachRequest {
                container_id: shell.clone(),
                stdin: true,
                tty: true,
                stdout: true,
                stderr: false,
            })
            .await
            .unwrap()
            .into_inner()
            .url;
    let out = vessel_critest::stream_client::exec(
        &url,
        &vessel_critest::stream_client::ExecOptions {
            stdin: Some(b"tty > /vol/attached; exit 3\n".to_vec()),
            stdout: true,
            tty: true,
            resize: Some((100, 30)),
            ..Default::default()
        },
        Duration::from_secs(20),
    )
    .await
    .unwrap_or_else(|e| panic!("attach: {e}\n{}", h.v.log()));
    // The client detached when its stdin ended; the shell runs what it was sent.
    assert_eq!(
        h.wait_exit(&shell, Duration::from_secs(10)).await.exit_code,
        3
    );
    let attached = std::fs::read_to_string(vol.path().join("attached")).unwrap_or_default();
    assert!(attached.starts_with("/dev/pts/"), "{attached:?}, {out:?}");

    // A tty in a pod with its own user namespace (hostUsers: false), whose containers' dirs
    // live elsewhere.
    let map = id_map(0, 300_000, 65536);
    let ucfg = with_userns(
        h.pod_config("tty-userns"),
        cri::NamespaceMode::Pod,
        vec![map],
    );
    let upod = h.c.run_pod(&ucfg, &handler()).await.unwrap();
    let in_userns = Some(cri::LinuxContainerConfig {
        security_context: Some(cri::LinuxContainerSecurityContext {
            namespace_options: Some(cri::NamespaceOption {
                userns_options: pod_userns(&ucfg),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    let mut cfg = h.ctr_config("tty", "tty; sleep 1000");
    cfg.tty = true;
    cfg.linux = in_userns.clone();
    let uctr = h
        .create(&upod, &ucfg, cfg)
        .await
        .unwrap_or_else(|e| panic!("CreateContainer (userns): {e}"));
    h.start(&uctr).await;
    let log = h.log_of("tty-userns", "tty");
    wait_for("the tty's name in the log", Duration::from_secs(10), || {
        cri_log_lines(&log)
            .iter()
            .any(|l| l.2.starts_with("/dev/pts/"))
    })
    .await;
    let checkpoints = match (vm_mode(), vessel_critest::daemon::criu_unusable()) {
        (true, _) => {
            println!("SKIP a_tty_container_and_checkpoints_in_a_shared_pid_pod (checkpoints): VM pods have no CRIU");
            vec![]
        }
        (false, Some(why)) => {
            println!(
                "SKIP a_tty_container_and_checkpoints_in_a_shared_pid_pod (checkpoints): {why}"
            );
            vec![]
        }
        // The user-namespaced container's masked files and devices are bound from outside it.
        (false, None) => vec![id.clone(), sibling.clone(), uctr.clone()],
    };
    let dir = tempfile::tempdir().unwrap();
    for c in &checkpoints {
        let location = dir.path().join(format!("{c}.tar"));
        if let Err(e) = h.checkpoint(c, location.to_str().unwrap(), 0).await {
            panic!("CheckpointContainer {c}: {e}\n{}", h.v.log());
        }
        assert!(std::fs::metadata(&location).unwrap().len() > 0);
        let st = h.status(c).await;
        assert_eq!(
            st.state,
            cri::ContainerState::ContainerRunning as i32,
            "{c}"
        );
    }
    if !checkpoints.is_empty() {
        // Restored in the pod's shared pid namespace, once the original is gone (its pids
        // are the restored ones').
        h.stop(&sibling, 0).await;
        h.remove(&sibling).await;
        // The checkpoint is the image; the command is the checkpointed one.
        let restore_cfg = |name: &str, from: &str| {
            let archive = dir.path().join(format!("{from}.tar"));
            cri::ContainerConfig {
                command: Vec::new(),
                ..sh_container(name, &archive.display().to_string(), "")
            }
        };
        let restored = h
            .create(&pod, &pcfg, restore_cfg("plain-restored", &sibling))
            .await
            .unwrap_or_else(|e| panic!("CreateContainer (restore): {e}"));
        h.start(&restored).await;
        // It sees the pod's other processes (one pid namespace), its own among them.
        let r = h.exec(&restored, &["ps", "-o", "args"], 5).await.unwrap();
        let ps = String::from_utf8_lossy(&r.stdout);
        // (Debian's busybox nc keeps listening with -ll.)
        let running = |cmd: &str| ps.lines().any(|l| l.trim_start().starts_with(cmd));
        assert!(running("sleep 1000") && running("nc -ll"), "{ps}");

        // The tty container, restored once its original (pids, port 8080) is gone, with no
        // tty asked for (the checkpoint's process had one): CRIU makes it a new pty at the
        // old index, whose master the agent gets as at a tty container's start. Its loop
        // goes on from its count, writing to the new tty, whose output is the restored
        // container's log; its listener answers on the pod's network.
        h.stop(&id, 0).await;
        h.remove(&id).await;
        let before = std::fs::read_to_string(&tty).unwrap();
        let mut tcfg = restore_cfg("tty-restored", &id);
        tcfg.mounts = vol_mount;
        let tty_restored = h
            .create(&pod, &pcfg, tcfg)
            .await
            .unwrap_or_else(|e| panic!("CreateContainer (tty restore): {e}"));
        h.start(&tty_restored).await;
        let log = h.log_of("tty-ckpt", "tty-restored");
        let ticks = |log: &Path| -> Vec<u64> {
            cri_log_lines(log)
                .iter()
                .filter_map(|l| l.2.trim().strip_prefix("tick ")?.parse().ok())
                .collect()
        };
        wait_for(
            "ticks in the restored tty's log",
            Duration::from_secs(10),
            || ticks(&log).len() >= 3,
        )
        .await;
        let got = ticks(&log);
        assert!(got[0] > 1, "the count started over: {got:?}");
        assert!(got.windows(2).all(|w| w[1] == w[0] + 1), "{got:?}");
        // Its terminal is the old one's name, in the restored container's devpts.
        std::fs::remove_file(vol.path().join("now")).unwrap();
        let now = vol.path().join("now");
        let mut seen = String::new();
        wait_for("the restored loop's tty", Duration::from_secs(10), || {
            // Rewritten (truncated first) every 0.2 s: what one read saw is kept.
            seen = std::fs::read_to_string(&now).unwrap_or_default();
            seen.ends_with('\n')
        })
        .await;
        assert_eq!(seen, before);
        let r = h
            .exec(&restored, &["sh", "-c", "nc 127.0.0.1 8080 </dev/null"], 5)
            .await
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&r.stdout).trim(), "hi", "{r:?}");
        // And it can be checkpointed again, its new pty's master being the agent's.
        let again = dir.path().join("again.tar");
        if let Err(e) = h
            .checkpoint(&tty_restored, again.to_str().unwrap(), 0)
            .await
        {
            panic!("CheckpointContainer (restored tty): {e}\n{}", h.v.log());
        }
        h.stop(&tty_restored, 0).await;
        h.remove(&tty_restored).await;

        // Not into the user-namespaced pod: CRIU would give the container a user namespace
        // of its own, not the pod's.
        let mut rcfg = restore_cfg("into-userns", &sibling);
        rcfg.linux = in_userns;
        let e = h.create(&upod, &ucfg, rcfg).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.message().contains("user namespace"), "{e}");
    }
    h.remove_pod(&upod).await;
    h.remove_pod(&pod).await;
    h.assert_clean();
}

/// `kubectl debug -it <pod> --target=<ctr> --image=busybox`: an ephemeral container on a tty
/// in its target's pid namespace (TARGET mode) sees the target's processes and, through
/// /proc, its root filesystem; an unknown or stopped target is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debug_container_joins_its_targets_pid_namespace() {
    let mut h = harness().await;
    let (pod, pcfg) = h.run_pod("debug").await;
    let app = h
        .run(
            &pod,
            &pcfg,
            "app",
            "echo secret > /app-file; exec sleep 1000",
        )
        .await;
    let debug_cfg = |h: &H, name: &str, target: &str| {
        let mut cfg = h.ctr_config(name, "");
        cfg.command = vec!["sh".into()];
        cfg.tty = true;
        cfg.stdin = true;
        cfg.stdin_once = true;
        cfg.linux = Some(cri::LinuxContainerConfig {
            security_context: Some(cri::LinuxContainerSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    pid: cri::NamespaceMode::Target as i32,
                    target_id: target.into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        cfg
    };
    let e = h
        .create(&pod, &pcfg, debug_cfg(&h, "dbg-none", "no-such-container"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e}");
    let dbg = h
        .create(&pod, &pcfg, debug_cfg(&h, "debugger-1", &app))
        .await
        .unwrap_or_else(|e| panic!("CreateContainer (debug): {e}"));
    h.start(&dbg).await;
    let r = h
        .exec(
            &dbg,
            &["sh", "-c", "ps -o pid,args; cat /proc/1/root/app-file"],
            10,
        )
        .await
        .unwrap();
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    assert!(out.contains("sleep 1000"), "{out}");
    assert!(out.contains("secret"), "{out}");
    // The target's pid namespace, not the pod's: the target's init is PID 1 in it.
    assert!(
        out.lines()
            .any(|l| l.trim_start().starts_with("1 ") && l.contains("sleep 1000")),
        "{out}"
    );
    h.stop(&app, 0).await;
    let e = h
        .create(&pod, &pcfg, debug_cfg(&h, "debugger-2", &app))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("not a running container"), "{e}");
    h.remove_pod(&pod).await;
    h.assert_clean();
}

/// Polls `f` every 50 ms until it holds (true) or `limit` passes (false).
fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while !f() {
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}
