//! The streaming server against a live vesseld, at the protocol edges that the conformance
//! specs (`vessel-critest`'s `[streaming]` group, run by `critest_e2e`) do not reach: bad
//! tokens, WebSocket upgrades, RPC errors. Exec and port-forward themselves are exercised
//! through flat pods by those specs.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

mod common;

use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vessel_critest::daemon::Vesseld;

async fn http(addr: &str, req: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("answer in time")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_server_edges() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let v = Vesseld::start_with(
        Path::new(env!("CARGO_BIN_EXE_vesseld")),
        &format!("streaming_address = \"{addr}\"\n"),
        "",
    )
    .expect("vesseld");
    let mut c = v.client().await;

    // RPC errors: unknown container, empty command, Attach to an unknown container.
    let e = c
        .runtime
        .exec(k8s_cri::v1::ExecRequest {
            container_id: "nope".into(),
            cmd: vec!["true".into()],
            stdout: true,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    let e = c
        .runtime
        .exec(k8s_cri::v1::ExecRequest {
            container_id: "nope".into(),
            stdout: true,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let e = c
        .runtime
        .attach(k8s_cri::v1::AttachRequest {
            container_id: "nope".into(),
            stdout: true,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains("nope"), "{e:?}");

    // The HTTP side: unknown tokens, other paths, garbage.
    let r = http(
        &addr,
        "POST /exec/0123456789abcdef HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n",
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 404"), "{r}");
    assert!(r.contains("unknown, used or expired"), "{r}");
    let r = http(&addr, "GET /nothing HTTP/1.1\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 404"), "{r}");
    let r = http(&addr, "\u{1}\u{2}garbage\r\n\r\n").await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    let r = vessel_critest::stream_client::exec(
        &format!("http://{addr}/exec/feedface"),
        &Default::default(),
        Duration::from_secs(10),
    )
    .await;
    assert!(
        matches!(
            r,
            Err(vessel_critest::stream_client::StreamClientError::Refused(_))
        ),
        "{r:?}"
    );

    // WebSocket upgrades (a pod's port-forward URL for the tokens; each is used once).
    let logs = tempfile::tempdir().unwrap();
    let pod = c
        .run_pod(
            &vessel_critest::client::pod_config("ws-edges", "default", logs.path()),
            "",
        )
        .await
        .expect("RunPodSandbox");
    let pf_url = || {
        let mut rt = c.runtime.clone();
        let pod = pod.clone();
        async move {
            let url = rt
                .port_forward(k8s_cri::v1::PortForwardRequest {
                    pod_sandbox_id: pod,
                    port: vec![80],
                })
                .await
                .expect("PortForward")
                .into_inner()
                .url;
            url.split_once("//")
                .and_then(|(_, r)| r.split_once('/'))
                .map(|(_, p)| format!("/{p}"))
                .unwrap()
        }
    };
    let ws = |path: String, extra: &str| {
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n")
    };
    let r = http(&addr, &ws(pf_url().await, "")).await;
    assert!(
        r.starts_with("HTTP/1.1 400") && r.contains("Sec-WebSocket-Key"),
        "{r}"
    );
    let key = "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n";
    // Another protocol version: 426, naming the one spoken (RFC 6455, 4.4).
    let r = http(
        &addr,
        &ws(pf_url().await, key).replace("Version: 13", "Version: 8"),
    )
    .await;
    assert!(
        r.starts_with("HTTP/1.1 426") && r.contains("Sec-WebSocket-Version: 13\r\n"),
        "{r}"
    );
    // Port-forward's own WebSocket protocol is not spoken; its SPDY tunnel is.
    let r = http(
        &addr,
        &ws(
            pf_url().await,
            &format!("{key}Sec-WebSocket-Protocol: portforward.k8s.io\r\n"),
        ),
    )
    .await;
    assert!(
        r.starts_with("HTTP/1.1 400") && r.contains("SPDY/3.1+portforward.k8s.io"),
        "{r}"
    );
    // A good handshake, then the client's close: the server closes too.
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let req = ws(
        pf_url().await,
        &format!("{key}Sec-WebSocket-Protocol: SPDY/3.1+portforward.k8s.io\r\n"),
    );
    s.write_all(req.as_bytes()).await.unwrap();
    // A masked close frame (code 1000, mask 0).
    s.write_all(&[0x88, 0x82, 0, 0, 0, 0, 0x03, 0xE8])
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("the server closes")
        .unwrap();
    let text = String::from_utf8_lossy(&out);
    assert!(text.starts_with("HTTP/1.1 101"), "{text}");
    // RFC 6455's example key and its accept value.
    assert!(
        text.contains("Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n")
            && text.contains("Sec-WebSocket-Protocol: SPDY/3.1+portforward.k8s.io\r\n"),
        "{text}"
    );
    assert!(
        out.ends_with(&[0x88, 0x02, 0x03, 0xE8]),
        "a close frame last: {out:?}"
    );
    c.runtime
        .stop_pod_sandbox(k8s_cri::v1::StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await
        .unwrap();
    c.runtime
        .remove_pod_sandbox(k8s_cri::v1::RemovePodSandboxRequest {
            pod_sandbox_id: pod,
        })
        .await
        .unwrap();

    // crictl's exec, attach and port-forward: crictl_e2e (upstream crictl), also over
    // WebSocket; upstream critest's streaming specs over WebSocket: upstream_critest.
}

/// vesseld's resident memory, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The highest RSS of `pid` until `done` finishes, sampled every 100 ms, and `done`'s output.
async fn peak_rss_during<T>(pid: u32, done: impl std::future::Future<Output = T>) -> (u64, T) {
    tokio::pin!(done);
    let mut peak = rss_kib(pid);
    loop {
        tokio::select! {
            out = &mut done => return (peak.max(rss_kib(pid)), out),
            () = tokio::time::sleep(Duration::from_millis(100)) => peak = peak.max(rss_kib(pid)),
        }
    }
}

/// Runs the exec at `url` with `opts` while watching vesseld's (`pid`) RSS: the RSS before,
/// its peak meanwhile, and what the exec gave.
async fn exec_watching_rss(
    pid: u32,
    url: &str,
    opts: &vessel_critest::stream_client::ExecOptions,
) -> (u64, u64, vessel_critest::stream_client::ExecOutcome) {
    let before = rss_kib(pid);
    let (peak, r) = peak_rss_during(
        pid,
        vessel_critest::stream_client::exec(url, opts, Duration::from_secs(120)),
    )
    .await;
    (
        before,
        peak,
        r.unwrap_or_else(|e| panic!("exec at {url}: {e}")),
    )
}

/// A vesseld with `daemon_keys`, the busybox image pulled, and a pod with a running
/// container (`sleep`); returns what the test needs to exec into it.
struct Pod {
    _reg: vessel_critest::registry::Registry,
    v: Vesseld,
    c: vessel_critest::client::CriClient,
    _logs: tempfile::TempDir,
    pod: String,
    ctr: String,
}

impl Pod {
    async fn start(daemon_keys: &str) -> Pod {
        let (reg, image) = vessel_critest::daemon::busybox_registry()
            .await
            .expect("registry with busybox");
        let v = Vesseld::start_with(Path::new(env!("CARGO_BIN_EXE_vesseld")), daemon_keys, "")
            .expect("vesseld");
        let c = v.client().await;
        c.pull(&image).await.expect("pull busybox");
        let logs = tempfile::tempdir().unwrap();
        let pcfg = vessel_critest::client::pod_config("flow", "default", logs.path());
        let pod = c.run_pod(&pcfg, "").await.expect("RunPodSandbox");
        let ctr = c
            .create_container(
                &pod,
                &pcfg,
                vessel_critest::client::sh_container("sleeper", &image, "sleep 3600"),
            )
            .await
            .expect("CreateContainer");
        c.start_container(&ctr).await.expect("StartContainer");
        Pod {
            _reg: reg,
            v,
            c,
            _logs: logs,
            pod,
            ctr,
        }
    }

    async fn exec_url(&self, cmd: &[&str], stdin: bool) -> String {
        self.c
            .runtime
            .clone()
            .exec(k8s_cri::v1::ExecRequest {
                container_id: self.ctr.clone(),
                cmd: cmd.iter().map(|s| s.to_string()).collect(),
                stdin,
                stdout: true,
                stderr: true,
                ..Default::default()
            })
            .await
            .expect("Exec")
            .into_inner()
            .url
    }

    /// Whether a process whose command line contains `needle` runs in the container.
    async fn runs(&self, needle: &str) -> bool {
        let r = self
            .c
            .runtime
            .clone()
            .exec_sync(k8s_cri::v1::ExecSyncRequest {
                container_id: self.ctr.clone(),
                cmd: vec!["ps".into(), "-o".into(), "args".into()],
                timeout: 10,
            })
            .await
            .expect("ExecSync ps")
            .into_inner();
        String::from_utf8_lossy(&r.stdout)
            .lines()
            .any(|l| l.contains(needle) && !l.contains("ps -o"))
    }

    async fn remove(self) {
        let mut rt = self.c.runtime.clone();
        rt.stop_pod_sandbox(k8s_cri::v1::StopPodSandboxRequest {
            pod_sandbox_id: self.pod.clone(),
        })
        .await
        .unwrap();
        rt.remove_pod_sandbox(k8s_cri::v1::RemovePodSandboxRequest {
            pod_sandbox_id: self.pod.clone(),
        })
        .await
        .unwrap();
    }
}

/// Streaming is flow-controlled end to end: 256 MiB of exec output to a client that does
/// not read for 5 s, and 128 MiB of stdin to a command that does not read for 4 s, wait in
/// the pod and in the client, not in vesseld's memory; then every byte arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_is_flow_controlled() {
    const LIMIT_KIB: u64 = 48 << 10;
    let p = Pod::start("").await;
    let pid = p.v.pid().expect("vesseld pid");
    let opts = vessel_critest::stream_client::ExecOptions {
        stdout: true,
        stderr: true,
        stall: Duration::from_secs(5),
        ..Default::default()
    };

    // Output: the client reads nothing for 5 s.
    let url = p
        .exec_url(&["head", "-c", "268435456", "/dev/zero"], false)
        .await;
    let (before, peak, r) = exec_watching_rss(pid, &url, &opts).await;
    assert_eq!(r.exit_code(), Some(0), "{r:?}");
    assert_eq!(r.stdout.len(), 256 << 20, "every byte of the output");
    assert!(r.stdout.iter().all(|b| *b == 0));
    println!("streaming_is_flow_controlled: output to a stalled client: vesseld RSS {before} KiB, peak {peak} KiB");
    assert!(
        peak < before + LIMIT_KIB,
        "vesseld queued a stalled client's output: RSS {before} -> {peak} KiB"
    );

    // Input: the command reads nothing for 4 s.
    let url = p.exec_url(&["sh", "-c", "sleep 4; wc -c"], true).await;
    let input = vec![7u8; 128 << 20];
    let opts = vessel_critest::stream_client::ExecOptions {
        stdin: Some(input),
        stdout: true,
        stderr: true,
        ..Default::default()
    };
    let (before, peak, r) = exec_watching_rss(pid, &url, &opts).await;
    assert_eq!(r.exit_code(), Some(0), "{r:?}");
    assert_eq!(r.stdout_str().trim(), "134217728", "{r:?}");
    println!("streaming_is_flow_controlled: input to a command that does not read: vesseld RSS {before} KiB, peak {peak} KiB");
    assert!(
        peak < before + LIMIT_KIB,
        "vesseld queued input the command did not read: RSS {before} -> {peak} KiB"
    );
    p.remove().await;
}

/// `stream_idle_timeout_secs`: an exec on which nothing moves either way is closed after
/// it, and its command is stopped; one that keeps talking is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_idle_connections_are_closed() {
    let port = vessel_critest::client::free_port().unwrap();
    let p = Pod::start(&format!(
        "stream_idle_timeout_secs = 2\nmetrics_address = \"127.0.0.1:{port}\"\n"
    ))
    .await;
    let out = vessel_critest::stream_client::ExecOptions {
        stdout: true,
        stderr: true,
        ..Default::default()
    };
    // Output every second: never idle, runs to its end.
    let url = p
        .exec_url(
            &["sh", "-c", "for i in 1 2 3 4 5; do echo $i; sleep 1; done"],
            false,
        )
        .await;
    let r = vessel_critest::stream_client::exec(&url, &out, Duration::from_secs(30))
        .await
        .expect("exec with output");
    assert_eq!(r.exit_code(), Some(0), "{r:?}");
    assert_eq!(r.stdout_str(), "1\n2\n3\n4\n5\n");

    // Silent: closed after ~2 s without an exit code, and the command is gone.
    let url = p.exec_url(&["sleep", "31"], false).await;
    let t = std::time::Instant::now();
    let r = vessel_critest::stream_client::exec(&url, &out, Duration::from_secs(30))
        .await
        .expect("the server closes the idle connection");
    let took = t.elapsed();
    assert_eq!(r.exit_code(), None, "{r:?}");
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(10),
        "closed after {took:?}"
    );
    let t = std::time::Instant::now();
    while p.runs("sleep 31").await {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the idle exec's command still runs"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // What the metrics say: two exec sessions, none open now, one closed for being idle.
    let m = common::Metrics::parse(
        reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
    );
    let value = |name: &str, labels: &[(&str, &str)]| m.want(name, labels);
    let exec = [("kind", "exec"), ("transport", "spdy")];
    assert_eq!(value("vessel_streaming_sessions_total", &exec), 2.0);
    assert_eq!(value("vessel_streaming_sessions_open", &exec), 0.0);
    assert_eq!(value("vessel_streaming_idle_closed_total", &[]), 1.0);
    assert!(value("vessel_streaming_bytes_total", &[("direction", "in")]) > 0.0);
    assert!(value("vessel_streaming_bytes_total", &[("direction", "out")]) > 0.0);
    println!("streaming_idle_connections_are_closed: a silent exec closed after {took:?}; a talking one ran 5 s");
    p.remove().await;
}
