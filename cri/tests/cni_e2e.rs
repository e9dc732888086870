//! CNI end to end: pods attached to a private bridge network by the node's real CNI plugins
//! (Debian's containernetworking-plugins in /usr/lib/cni): pod IPs in PodSandboxStatus and on
//! the container's eth0, pod-to-pod traffic both ways, host to pod, a host port through
//! `portmap`, network counters, and nothing left after RemovePodSandbox, also of a pod whose
//! host process was killed (no veth, no IP held by host-local, no netns pin, no cache entry,
//! no iptables rule). The bridge itself stays until the test deletes it: the `bridge` plugin
//! never removes bridges, which other pods may share.
//!
//! Flat pods by default; `VESSEL_E2E_HANDLER=vm` (the nested VM harness runs it so, in L1)
//! makes the pods VM pods, and adds a flat pod that talks to them both ways.
//! `VESSEL_E2E_VESSELD` and `VESSEL_E2E_CONFIG` as for pods_e2e.
//!
//! Prints `SKIP cni_e2e: <reason>` when not root or the plugins are not installed.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use vessel_cri_api::v1 as cri;
use vessel_critest::client::{self, pod_config, sh_container};
use vessel_critest::daemon::TestCni;

vessel_critest::e2e_harness!(H);

impl H {
    fn pod_config(&self, name: &str) -> cri::PodSandboxConfig {
        pod_config(name, "cni", self.logs.path())
    }
    async fn run_pod(&mut self, cfg: &cri::PodSandboxConfig) -> Result<String, tonic::Status> {
        self.c.run_pod(cfg, &handler()).await
    }
    async fn run_pod_with(
        &mut self,
        cfg: &cri::PodSandboxConfig,
        handler: &str,
    ) -> Result<String, tonic::Status> {
        self.c.run_pod(cfg, handler).await
    }
    async fn pod_status(&mut self, id: &str) -> cri::PodSandboxStatus {
        self.c.pod_status(id).await.expect("PodSandboxStatus")
    }
    async fn run(&mut self, pod: &str, pcfg: &cri::PodSandboxConfig, script: &str) -> String {
        let cfg = sh_container("c", &self.image, script);
        let id = self
            .c
            .create_container(pod, pcfg, cfg)
            .await
            .unwrap_or_else(|e| panic!("CreateContainer: {e}\n{}", self.v.log()));
        self.c
            .start_container(&id)
            .await
            .unwrap_or_else(|e| panic!("StartContainer: {e}\n{}", self.v.log()));
        id
    }
    async fn sh(&mut self, id: &str, script: &str) -> (i32, String) {
        let r = self
            .c
            .exec_sync(id, &["sh", "-c", script], 10)
            .await
            .expect("ExecSync");
        (
            r.exit_code,
            format!(
                "{}{}",
                String::from_utf8_lossy(&r.stdout),
                String::from_utf8_lossy(&r.stderr)
            ),
        )
    }
    async fn remove_pod(&mut self, id: &str) {
        self.c
            .stop_and_remove_pod(id)
            .await
            .expect("StopPodSandbox, RemovePodSandbox");
    }
    async fn network_ready(&mut self) -> cri::RuntimeCondition {
        self.c
            .runtime
            .status(cri::StatusRequest { verbose: false })
            .await
            .expect("Status")
            .into_inner()
            .status
            .unwrap()
            .conditions
            .into_iter()
            .find(|c| c.r#type == "NetworkReady")
            .expect("a NetworkReady condition")
    }
}

/// The handler of this run's pods: `VESSEL_E2E_HANDLER`, or flat.
fn handler() -> String {
    std::env::var("VESSEL_E2E_HANDLER")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "flat".into())
}

async fn harness(extra: &str) -> H {
    let vesseld = std::env::var_os("VESSEL_E2E_VESSELD")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_vesseld")));
    let config = std::env::var("VESSEL_E2E_CONFIG").unwrap_or_default() + extra;
    H::launch(&vesseld, &config).await
}

/// Polls an HTTP GET from inside container `from` to `ip:port` until it answers `want`.
async fn reach(h: &mut H, from: &str, ip: &str, port: u16, want: &str) {
    let start = Instant::now();
    loop {
        let (code, out) = h
            .sh(
                from,
                &format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {ip} {port}"),
            )
            .await;
        if code == 0 && out.contains(want) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{from} cannot reach {ip}:{port}: {code} {out}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A server answering `hi-from-<name>` on `port`.
fn http_server(name: &str, port: u16) -> String {
    format!(
        "mkdir -p /tmp/www && echo hi-from-{name} > /tmp/www/index.html && exec httpd -f -p {port} -h /tmp/www"
    )
}

fn skip_reason() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("needs root (network namespaces, veths, iptables)".into());
    }
    None
}

/// The private CNI network for a test, or None after printing why the test is skipped.
fn test_cni() -> Option<TestCni> {
    if let Some(why) = skip_reason() {
        println!("SKIP cni_e2e: {why}");
        return None;
    }
    match TestCni::new() {
        Ok(c) => Some(c),
        Err(why) => {
            println!("SKIP cni_e2e: {why}");
            None
        }
    }
}

/// Appends `plugin` to the end of the test network's chain.
fn append_plugin(cni: &TestCni, plugin: serde_json::Value) {
    let conf_path = cni.dir.path().join("net.d/10-vessel-test.conflist");
    let mut conf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&conf_path).unwrap()).unwrap();
    conf["plugins"].as_array_mut().unwrap().push(plugin);
    std::fs::write(&conf_path, conf.to_string()).unwrap();
}

/// Interfaces enslaved to a bridge.
/// No pod is left in vesseld's state: no pinned netns, no CNI cache entry, no pod record
/// (nor anything in `extra`, further directories under the daemon's root).
fn assert_no_pod_state(h: &H, extra: &[&str]) {
    for d in ["state/netns", "root/cni", "root/pods"].iter().chain(extra) {
        let p = h.v.dir.path().join(d);
        let e: Vec<_> = std::fs::read_dir(&p)
            .map(|r| r.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(e.is_empty(), "{d} not empty: {e:?}");
    }
}

fn bridge_ports(bridge: &str) -> Vec<String> {
    let out = Command::new("ip")
        .args(["-o", "link", "show", "master", bridge])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    out.lines().map(str::to_string).collect()
}

/// Why host ports cannot work here (portmap needs iptables with the nat table), if so.
fn portmap_unusable() -> Option<String> {
    match Command::new("iptables").args(["-t", "nat", "-S"]).output() {
        Err(e) => Some(format!("iptables cannot run: {e}")),
        Ok(o) if !o.status.success() => Some(format!(
            "iptables -t nat does not work here: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Ok(_) => None,
    }
}

async fn http_get(addr: std::net::SocketAddr) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET / HTTP/1.0\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut buf)).await;
    Ok(String::from_utf8_lossy(&buf).to_string())
}

async fn http_get_retry(addr: std::net::SocketAddr) -> Result<String, String> {
    let start = Instant::now();
    loop {
        match http_get(addr).await {
            Ok(b) if b.contains("200") => return Ok(b),
            r if start.elapsed() > Duration::from_secs(10) => {
                return Err(format!("{r:?}"));
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_get_ips_talk_and_leave_nothing() {
    let Some(cni) = test_cni() else { return };
    let mut h = harness(&cni.config_toml()).await;
    let ready = h.network_ready().await;
    assert!(ready.status, "NetworkReady=false: {ready:?}");
    assert!(ready.message.contains(&cni.network), "{ready:?}");
    let vm = handler() == "vm";

    let host_port = client::free_port().unwrap();
    let mut acfg = h.pod_config("server");
    acfg.port_mappings = vec![client::tcp_host_port(8080, host_port)];
    let a = h.run_pod(&acfg).await.expect("RunPodSandbox server");
    let bcfg = h.pod_config("client");
    let b = h.run_pod(&bcfg).await.expect("RunPodSandbox client");
    // With VM pods, a flat pod on the same network too.
    let ccfg = h.pod_config("flat-peer");
    let c = if vm {
        Some(
            h.run_pod_with(&ccfg, "flat")
                .await
                .expect("RunPodSandbox flat peer"),
        )
    } else {
        None
    };
    let mut pods = vec![a.clone(), b.clone()];
    pods.extend(c.clone());
    let mut ips = Vec::new();
    for p in &pods {
        let ip = h.pod_status(p).await.network.unwrap_or_default().ip;
        assert!(
            ip.starts_with(&format!("{}.", cni.prefix)),
            "pod IP {ip:?} is not in {}.0/24",
            cni.prefix
        );
        ips.push(ip);
    }
    let (a_ip, b_ip) = (ips[0].clone(), ips[1].clone());
    let mut distinct = ips.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), ips.len(), "pod IPs not distinct: {ips:?}");
    let mut got = cni.allocated_ips();
    got.sort();
    assert_eq!(got, distinct, "host-local's allocations");
    assert_eq!(
        bridge_ports(&cni.bridge).len(),
        pods.len(),
        "one veth per pod"
    );

    let sa = h.run(&a, &acfg, &http_server("server", 8080)).await;
    let sb = h.run(&b, &bcfg, &http_server("client", 8081)).await;
    let (code, out) = h.sh(&sa, "ip -4 -o addr show dev eth0").await;
    assert!(
        code == 0 && out.contains(&format!("inet {a_ip}/24")),
        "eth0 of the server: {code} {out}"
    );

    // Pod to pod over the bridge, both ways.
    reach(&mut h, &sb, &a_ip, 8080, "hi-from-server").await;
    reach(&mut h, &sa, &b_ip, 8081, "hi-from-client").await;
    if let Some(c) = &c {
        let c_ip = ips[2].clone();
        let sc = h.run(c, &ccfg, &http_server("flat-peer", 8082)).await;
        reach(&mut h, &sc, &a_ip, 8080, "hi-from-server").await;
        reach(&mut h, &sa, &c_ip, 8082, "hi-from-flat-peer").await;
    }
    // Host to pod IP (the bridge is the pods' gateway).
    let body = http_get_retry(format!("{a_ip}:8080").parse().unwrap())
        .await
        .expect("host reaches the pod IP");
    assert!(body.ends_with("hi-from-server\n"), "{body:?}");

    // The server pod's network counters (PodSandboxStats), from its own namespace: eth0
    // carried the traffic above; loopback is not listed.
    let st =
        h.c.runtime
            .pod_sandbox_stats(cri::PodSandboxStatsRequest {
                pod_sandbox_id: a.clone(),
            })
            .await
            .expect("PodSandboxStats")
            .into_inner()
            .stats
            .unwrap();
    let net = st
        .linux
        .unwrap()
        .network
        .expect("network stats of a pod with its own netns");
    let eth0 = net.default_interface.expect("a default interface");
    assert_eq!(eth0.name, "eth0");
    assert!(
        eth0.rx_bytes.unwrap().value > 0 && eth0.tx_bytes.unwrap().value > 0,
        "{eth0:?}"
    );
    // Neither loopback nor a VM pod's tap (whose frames are eth0's again) is listed.
    let names: Vec<&str> = net.interfaces.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["eth0"], "{:?}", net.interfaces);

    // Host port through portmap.
    match portmap_unusable() {
        Some(why) => println!("SKIP cni_e2e host port: {why}"),
        None => {
            let addr = format!("127.0.0.1:{host_port}").parse().unwrap();
            let body = http_get_retry(addr)
                .await
                .unwrap_or_else(|e| panic!("host port {addr} does not reach the server: {e}"));
            assert!(body.ends_with("hi-from-server\n"), "{body:?}");
        }
    }

    // The server's host process (its agent, or its VM's shim) dies: the pod goes NotReady and
    // its removal still takes everything down.
    let v = h.c.pod_info(&a).await.expect("PodSandboxStatus");
    let pid = i32::try_from(v["pid"].as_u64().unwrap()).unwrap();
    // SAFETY: kill(2) of the host process pid vesseld reported.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    let start = Instant::now();
    while h.pod_status(&a).await.state != cri::PodSandboxState::SandboxNotready as i32 {
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "pod still ready after its host process died"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for p in &pods {
        h.remove_pod(p).await;
    }
    assert!(
        bridge_ports(&cni.bridge).is_empty(),
        "veths left: {:?}",
        bridge_ports(&cni.bridge)
    );
    assert!(
        cni.allocated_ips().is_empty(),
        "IPs not released: {:?}",
        cni.allocated_ips()
    );
    assert_no_pod_state(&h, &["state/vms"]);
    let nat = Command::new("iptables")
        .args(["-t", "nat", "-S"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    assert!(
        !nat.contains(&format!("dport {host_port} ")),
        "host port rule left: {nat}"
    );
}

/// A chain whose last plugin fails: RunPodSandbox fails naming the plugin, and what the
/// earlier plugins did is undone (no veth, no IP, no pin, no record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_add_leaves_nothing() {
    let Some(cni) = test_cni() else { return };
    // Append a tuning plugin that sets a sysctl that does not exist.
    append_plugin(
        &cni,
        serde_json::json!({"type": "tuning", "sysctl": {"net.ipv4.no_such_knob": "1"}}),
    );
    let mut h = harness(&cni.config_toml()).await;
    let cfg = h.pod_config("failing");
    let e = h.run_pod(&cfg).await.expect_err("ADD must fail");
    assert!(
        e.message().contains("tuning"),
        "the error names the plugin: {e}"
    );
    assert!(bridge_ports(&cni.bridge).is_empty(), "veths left");
    assert!(cni.allocated_ips().is_empty(), "IPs left");
    assert_no_pod_state(&h, &[]);
    // The node's network itself is fine: Status says ready.
    assert!(h.network_ready().await.status);
}

/// A pod's `kubernetes.io/ingress-bandwidth` annotation reaches a chain with the bandwidth
/// plugin as `runtimeConfig.bandwidth` (the capability its config declares): the traffic
/// to the pod is shaped on its host-side interface at that rate. A rate that is not a
/// quantity is refused with nothing left; the shaping goes with the pod.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bandwidth_annotations_shape_the_pods_traffic() {
    let Some(cni) = test_cni() else { return };
    if !std::path::Path::new("/usr/lib/cni/bandwidth").exists() {
        println!("SKIP bandwidth_annotations_shape_the_pods_traffic: no bandwidth plugin");
        return;
    }
    append_plugin(
        &cni,
        serde_json::json!({"type": "bandwidth", "capabilities": {"bandwidth": true}}),
    );
    let mut h = harness(&cni.config_toml()).await;
    let tbf = || {
        let out = Command::new("tc")
            .args(["qdisc", "show"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
            .unwrap_or_default();
        out.lines()
            .filter(|l| l.contains("tbf"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let before = tbf();
    let mut cfg = h.pod_config("shaped");
    cfg.annotations
        .insert("kubernetes.io/ingress-bandwidth".into(), "10M".into());
    let pod = h
        .run_pod(&cfg)
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}"));
    let added: Vec<String> = tbf().into_iter().filter(|l| !before.contains(l)).collect();
    assert!(
        added.iter().any(|l| l.contains("rate 10Mbit")),
        "no 10Mbit tbf qdisc for the pod: {added:?}"
    );
    h.remove_pod(&pod).await;
    let left: Vec<String> = tbf().into_iter().filter(|l| !before.contains(l)).collect();
    assert!(left.is_empty(), "shaping left: {left:?}");
    let mut bad = h.pod_config("badly-shaped");
    bad.annotations
        .insert("kubernetes.io/ingress-bandwidth".into(), "lots".into());
    let e = h
        .run_pod(&bad)
        .await
        .expect_err("a bad rate must be refused");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    assert!(e.message().contains("ingress-bandwidth"), "{e}");
    assert!(bridge_ports(&cni.bridge).is_empty(), "veths left");
    assert!(cni.allocated_ips().is_empty(), "IPs left");
}

/// Without a CNI config, NetworkReady is false and says what is missing; pods still run,
/// with loopback only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_config_means_network_not_ready() {
    if let Some(why) = skip_reason() {
        println!("SKIP cni_e2e: {why}");
        return;
    }
    let empty = tempfile::tempdir().unwrap();
    let mut h = harness(&format!(
        "[cni]\nconf_dir = \"{}\"\n",
        empty.path().display()
    ))
    .await;
    let r = h.network_ready().await;
    assert!(!r.status);
    assert_eq!(r.reason, "NetworkPluginNotReady");
    assert!(r.message.contains("no CNI network config"), "{r:?}");
    std::fs::write(
        empty.path().join("10-x.conflist"),
        r#"{"cniVersion":"1.0.0","name":"x","plugins":[{"type":"no-such-plugin"}]}"#,
    )
    .unwrap();
    let r = h.network_ready().await;
    assert!(!r.status && r.message.contains("no-such-plugin"), "{r:?}");
}

/// A CNI pod survives a vesseld crash with its IP; a pod whose agent died while vesseld was
/// down is detached at the next start (its IP released from the cached ADD result).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_ips_and_detaches_dead_pods() {
    let Some(cni) = test_cni() else { return };
    let mut h = harness(&cni.config_toml()).await;
    let kcfg = h.pod_config("keeper");
    let keep = h.run_pod(&kcfg).await.expect("RunPodSandbox keeper");
    let dcfg = h.pod_config("doomed");
    let doomed = h.run_pod(&dcfg).await.expect("RunPodSandbox doomed");
    let keep_ip = h.pod_status(&keep).await.network.unwrap_or_default().ip;
    let doomed_ip = h.pod_status(&doomed).await.network.unwrap_or_default().ip;
    assert_eq!(cni.allocated_ips().len(), 2);
    h.v.kill9();
    // The doomed pod's agent dies while vesseld is down.
    assert!(
        h.v.kill_pod_host_process(&doomed),
        "no live host process for {doomed}"
    );
    h.v.restart().expect("restart vesseld");
    h.c = h.v.client().await;
    assert_eq!(
        h.pod_status(&keep).await.network.unwrap_or_default().ip,
        keep_ip
    );
    assert_eq!(
        cni.allocated_ips(),
        vec![keep_ip.clone()],
        "{doomed_ip} released at restart"
    );
    h.remove_pod(&keep).await;
    h.remove_pod(&doomed).await;
    assert!(cni.allocated_ips().is_empty());
    assert!(bridge_ports(&cni.bridge).is_empty());
}

/// A CNI DEL that fails keeps the pod on the network until one succeeds, as containerd's
/// "failed to destroy network for sandbox": StopPodSandbox and RemovePodSandbox fail (so
/// kubelet asks again) instead of dropping the cache entry, and with it the only record of
/// what the chain holds for the pod (host-local's IP, portmap's rules). The pod stays
/// listed; a later stop, once DEL works again, frees it all, and the removal leaves nothing.
/// Before, both calls succeeded and the chain's allocation leaked for good. The DELs after
/// the first name no namespace (its pin went with the first stop), as containerd's do: a
/// plugin that cannot open a namespace it is named (host-device) failed them for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_del_fails_the_stop_and_is_asked_again() {
    let Some(cni) = test_cni() else { return };
    // A plugin of the chain's own (first, so that bridge's result is the pod's) that holds
    // something from ADD to a DEL that succeeds, and whose DEL fails while `fail-del` is.
    let bin = cni.dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let state = cni.dir.path().join("flaky");
    std::fs::create_dir_all(&state).unwrap();
    let plugin = bin.join("vessel-flaky");
    std::fs::write(
        &plugin,
        format!(
            r#"#!/bin/sh
cat >/dev/null
s={state}
case "$CNI_COMMAND" in
ADD) touch "$s/held-$CNI_CONTAINERID"; echo '{{"cniVersion":"1.0.0"}}' ;;
DEL) if [ -e "$s/fail-del" ]; then
       echo '{{"cniVersion":"1.0.0","code":11,"msg":"flaky DEL refused"}}'; exit 1
     fi
     # As host-device does: a namespace that is named must open (an empty one is skipped).
     if [ -n "$CNI_NETNS" ] && [ ! -e "$CNI_NETNS" ]; then
       echo '{{"cniVersion":"1.0.0","code":11,"msg":"failed to open netns"}}'; exit 1
     fi
     rm -f "$s/held-$CNI_CONTAINERID" ;;
VERSION) echo '{{"cniVersion":"1.0.0","supportedVersions":["0.4.0","1.0.0"]}}' ;;
esac
"#,
            state = state.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&plugin, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let conf_path = cni.dir.path().join("net.d/10-vessel-test.conflist");
    let mut conf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&conf_path).unwrap()).unwrap();
    conf["plugins"]
        .as_array_mut()
        .unwrap()
        .insert(0, serde_json::json!({"type": "vessel-flaky"}));
    std::fs::write(&conf_path, conf.to_string()).unwrap();
    let config = format!(
        "[cni]\nconf_dir = \"{}\"\nbin_dirs = [\"{}\", \"{}\"]\n",
        cni.dir.path().join("net.d").display(),
        cni.bin_dir.display(),
        bin.display()
    );
    let mut h = harness(&config).await;
    let held = |id: &str| state.join(format!("held-{id}")).exists();

    // StopPodSandbox, then RemovePodSandbox.
    let cfg = h.pod_config("flaky-stop");
    let pod = h.run_pod(&cfg).await.expect("RunPodSandbox");
    assert!(held(&pod), "ADD ran the test plugin");
    assert!(!h
        .pod_status(&pod)
        .await
        .network
        .unwrap_or_default()
        .ip
        .is_empty());
    std::fs::write(state.join("fail-del"), "").unwrap();
    let e =
        h.c.runtime
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: pod.clone(),
            })
            .await
            .expect_err("StopPodSandbox with a failing DEL");
    assert!(
        e.message().contains("flaky DEL refused") && e.message().contains(&pod),
        "the error names the pod and the plugin's message: {e}"
    );
    assert!(held(&pod), "the chain's hold is kept");
    assert_eq!(
        h.pod_status(&pod).await.state,
        cri::PodSandboxState::SandboxNotready as i32,
        "the rest of the stop is done"
    );
    let e =
        h.c.runtime
            .remove_pod_sandbox(cri::RemovePodSandboxRequest {
                pod_sandbox_id: pod.clone(),
            })
            .await
            .expect_err("RemovePodSandbox with a failing DEL");
    assert!(e.message().contains("flaky DEL refused"), "{e}");
    h.pod_status(&pod).await;
    std::fs::remove_file(state.join("fail-del")).unwrap();
    h.c.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await
        .unwrap_or_else(|e| panic!("StopPodSandbox again: {e}\n{}", h.v.log()));
    assert!(!held(&pod), "the second stop's DEL ran");
    h.remove_pod(&pod).await;

    // RemovePodSandbox of a ready pod, whose own stop fails; then a restart of vesseld with a
    // DEL that still fails keeps the pod, and the removal after it frees everything.
    let cfg = h.pod_config("flaky-remove");
    let pod = h.run_pod(&cfg).await.expect("RunPodSandbox");
    std::fs::write(state.join("fail-del"), "").unwrap();
    h.c.runtime
        .remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await
        .expect_err("RemovePodSandbox with a failing DEL");
    h.v.restart().expect("restart vesseld");
    h.c = h.v.client().await;
    assert!(held(&pod), "a restart does not drop the attachment");
    std::fs::remove_file(state.join("fail-del")).unwrap();
    h.remove_pod(&pod).await;
    assert!(!held(&pod), "the removal's DEL ran");
    assert!(cni.allocated_ips().is_empty(), "IPs left");
    assert!(bridge_ports(&cni.bridge).is_empty(), "veths left");
    assert_no_pod_state(&h, &[]);
}
