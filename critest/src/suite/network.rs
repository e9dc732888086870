//! Networking: DNS config, hostname, pod IP, host ports, host network.

use super::{spec, Ctx, Spec, SpecResult, Stop};
use crate::{check, fail};
use std::time::Duration;
use vessel_cri_api::v1 as cri;

pub(super) fn specs() -> Vec<Spec> {
    vec![
        spec!("network", "DNS config is written to /etc/resolv.conf", dns),
        spec!(
            "network",
            "the container's hostname is the pod's hostname",
            hostname
        ),
        spec!(
            "network",
            "a pod without a hostname gets the node's hostname",
            node_hostname
        ),
        spec!("network", "PodSandboxStatus reports the pod IP", pod_ip),
        spec!(
            "network",
            "a host port mapping reaches the container",
            host_port
        ),
        spec!(
            "network",
            "a pod with NODE network namespace shares the host's",
            host_network,
            vm = "a VM pod has its own kernel and so its own network stack"
        ),
    ]
}

async fn dns(c: Ctx) -> SpecResult {
    let mut pcfg = c.pod_config("dns");
    pcfg.dns_config = Some(cri::DnsConfig {
        servers: vec!["10.96.0.10".into()],
        searches: vec!["critest.svc.cluster.local".into(), "cluster.local".into()],
        options: vec!["ndots:5".into()],
    });
    let pod = c.run_pod_with(&pcfg).await?;
    let id = c.run(&pod, &pcfg, "dns", "sleep 100000").await?;
    let got = c.sh_ok(&id, "cat /etc/resolv.conf").await?;
    for want in [
        "nameserver 10.96.0.10",
        "search critest.svc.cluster.local cluster.local",
        "options ndots:5",
    ] {
        check!(
            got.lines().any(|l| l.trim() == want),
            "/etc/resolv.conf lacks {want:?}: {got:?}"
        );
    }
    Ok(())
}

async fn hostname(c: Ctx) -> SpecResult {
    let mut pcfg = c.pod_config("hostname");
    pcfg.hostname = "hostname-test".into();
    let pod = c.run_pod_with(&pcfg).await?;
    let id = c.run(&pod, &pcfg, "sleeper", "sleep 100000").await?;
    let got = c.sh_ok(&id, "hostname").await?;
    check!(
        got == "hostname-test",
        "hostname {got:?}, want hostname-test"
    );
    Ok(())
}

/// critest and crictl send no hostname: such a pod gets the node's, as with containerd.
async fn node_hostname(c: Ctx) -> SpecResult {
    let node = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map_err(|e| Stop::Fail(format!("reading the node's hostname: {e}")))?
        .trim()
        .to_string();
    let id = c.sleeper_with("nohostname", |_| {}).await?;
    let got = c.sh_ok(&id, "hostname").await?;
    check!(got == node, "hostname {got:?}, want the node's {node:?}");
    let hosts = c.sh_ok(&id, "cat /etc/hostname").await?;
    check!(hosts == node, "/etc/hostname {hosts:?}, want {node:?}");
    Ok(())
}

async fn pod_ip(c: Ctx) -> SpecResult {
    let (pod, _) = c.run_pod("ip").await?;
    let s = c.pod_status(&pod).await?;
    let ip = s.network.map(|n| n.ip).unwrap_or_default();
    check!(
        !ip.is_empty(),
        "no pod IP in PodSandboxStatus.network (needs CNI)"
    );
    Ok(())
}

async fn host_port(c: Ctx) -> SpecResult {
    let port = crate::client::free_port().map_err(|e| Stop::Fail(e.to_string()))?;
    let mut pcfg = c.pod_config("hostport");
    pcfg.port_mappings = vec![crate::client::tcp_host_port(8080, port)];
    let pod = c.run_pod_with(&pcfg).await?;
    c.run(
        &pod,
        &pcfg,
        "server",
        "mkdir -p /tmp/www && echo hi > /tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www",
    )
    .await?;
    let mut last = String::new();
    for _ in 0..30 {
        match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            Ok(mut s) => {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let _ = s.write_all(b"GET / HTTP/1.0\r\n\r\n").await;
                let mut buf = Vec::new();
                let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut buf)).await;
                let body = String::from_utf8_lossy(&buf);
                check!(
                    body.contains("200") && body.ends_with("hi\n"),
                    "answer {body:?}"
                );
                return Ok(());
            }
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fail!("host port 127.0.0.1:{port} does not reach the container's 8080: {last}")
}

fn host_ns(kind: &str) -> Result<String, Stop> {
    std::fs::read_link(format!("/proc/self/ns/{kind}"))
        .map(|p| p.display().to_string())
        .map_err(|e| Stop::Fail(format!("reading the host's {kind} namespace: {e}")))
}

/// A pod whose sandbox (and container) use NODE for the given namespace kinds.
pub(super) async fn node_ns_pod(
    c: &Ctx,
    name: &str,
    net: bool,
    pid: bool,
    ipc: bool,
) -> Result<String, Stop> {
    let node = cri::NamespaceMode::Node as i32;
    let pod_mode = cri::NamespaceMode::Pod as i32;
    let ns = cri::NamespaceOption {
        network: if net { node } else { pod_mode },
        pid: if pid {
            node
        } else {
            cri::NamespaceMode::Container as i32
        },
        ipc: if ipc { node } else { pod_mode },
        ..Default::default()
    };
    let mut pcfg = c.pod_config(name);
    pcfg.linux
        .get_or_insert_with(Default::default)
        .security_context = Some(cri::LinuxSandboxSecurityContext {
        namespace_options: Some(ns.clone()),
        ..Default::default()
    });
    let pod = c.run_pod_with(&pcfg).await?;
    let mut cfg = c.ctr_config("ns", "sleep 100000");
    Ctx::sec(&mut cfg).namespace_options = Some(ns);
    c.run_cfg(&pod, &pcfg, cfg).await
}

pub(super) async fn same_ns_as_host(c: &Ctx, id: &str, kind: &str) -> SpecResult {
    let host = host_ns(kind)?;
    let got = c
        .sh_ok(id, &format!("readlink /proc/self/ns/{kind}"))
        .await?;
    check!(
        got == host,
        "the container's {kind} namespace is {got}, the host's {host}"
    );
    Ok(())
}

async fn host_network(c: Ctx) -> SpecResult {
    let id = node_ns_pod(&c, "hostnet", true, false, false).await?;
    same_ns_as_host(&c, &id, "net").await
}
