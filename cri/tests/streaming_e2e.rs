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
        .exec(vessel_cri_api::v1::ExecRequest {
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
        .exec(vessel_cri_api::v1::ExecRequest {
            container_id: "nope".into(),
            stdout: true,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let e = c
        .runtime
        .attach(vessel_cri_api::v1::AttachRequest {
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
                .port_forward(vessel_cri_api::v1::PortForwardRequest {
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

    // Port-forward in kubelet's channel protocol (as the Python and JavaScript clients speak
    // it), binary and base64, to a server in the pod's network namespace.
    let port = serve_in_netns(&v.state_dir().join("netns").join(&pod), false);
    for (proto, text) in [
        ("v4.channel.k8s.io", false),
        ("v4.base64.channel.k8s.io", true),
    ] {
        let msg = |ch: u8, data: &[u8]| {
            if text {
                use base64::Engine;
                let b = base64::engine::general_purpose::STANDARD.encode(data);
                (0x1, format!("{}{b}", char::from(b'0' + ch)).into_bytes())
            } else {
                (0x2, [&[ch], data].concat())
            }
        };
        let url = format!("http://{addr}{}?port={port}", pf_url().await);
        let (mut s, head) = ws_upgrade(&url, proto).await;
        assert!(
            head.starts_with("HTTP/1.1 101") && head.contains(proto),
            "{proto}: {head}"
        );
        // Each channel opens with the port; the client's data reaches the server and back.
        let p = port.to_le_bytes();
        assert_eq!(read_frame(&mut s).await, msg(0, &p), "{proto}");
        assert_eq!(read_frame(&mut s).await, msg(1, &p), "{proto}");
        let (op, payload) = msg(0, b"hello");
        s.write_all(&client_frame(op, &payload)).await.unwrap();
        assert_eq!(read_frame(&mut s).await, msg(0, b"HELLO"), "{proto}");
        // The server's side closes: the session ends with a normal close.
        assert_eq!(read_frame(&mut s).await, (0x8, vec![0x03, 0xE8]), "{proto}");
    }
    // Without a port, in the query or the request: refused before the upgrade.
    let url = c
        .runtime
        .port_forward(vessel_cri_api::v1::PortForwardRequest {
            pod_sandbox_id: pod.clone(),
            port: vec![],
        })
        .await
        .unwrap()
        .into_inner()
        .url;
    let path = url.split_once("//").unwrap().1.split_once('/').unwrap().1;
    let r = http(
        &addr,
        &ws(
            format!("/{path}"),
            &format!("{key}Sec-WebSocket-Protocol: v4.channel.k8s.io\r\n"),
        ),
    )
    .await;
    assert!(
        r.starts_with("HTTP/1.1 400") && r.contains("\"port\""),
        "{r}"
    );

    c.stop_and_remove_pod(&pod)
        .await
        .expect("stop and remove the pod");

    // crictl's exec, attach and port-forward: crictl_e2e (upstream crictl), also over
    // WebSocket; upstream critest's streaming specs over WebSocket: upstream_critest.
}

/// A TCP server on 127.0.0.1 inside the network namespace `netns`; returns its port. Each
/// connection gets its first 5 bytes back upper-cased, then is closed; or, when `hold`, is
/// held open, unread and unanswered, for as long as the test runs.
fn serve_in_netns(netns: &Path, hold: bool) -> u16 {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    let ns = std::fs::File::open(netns).expect("the pod's netns pin");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // SAFETY: moves only this thread into the namespace; `ns` is an open nsfs file.
        let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        tx.send(l.local_addr().unwrap().port()).unwrap();
        let mut held = Vec::new();
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            if hold {
                held.push(c);
                continue;
            }
            let mut buf = [0u8; 5];
            if c.read_exact(&mut buf).is_ok() {
                let _ = c.write_all(&buf.to_ascii_uppercase());
            }
        }
    });
    rx.recv().unwrap()
}

/// A WebSocket upgrade of a streaming URL in `protocol`: the connection and the answer's head.
async fn ws_upgrade(url: &str, protocol: &str) -> (tokio::net::TcpStream, String) {
    let (addr, path) = url
        .strip_prefix("http://")
        .and_then(|r| r.split_once('/'))
        .expect("a streaming URL");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET /{path} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: {protocol}\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let head = read_head(&mut s).await;
    (s, head)
}

/// An HTTP response head, read byte by byte (what follows is the upgraded connection's).
async fn read_head(s: &mut tokio::net::TcpStream) -> String {
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let b = tokio::time::timeout(Duration::from_secs(10), s.read_u8())
            .await
            .expect("a response head in time")
            .expect("a response head");
        head.push(b);
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// One unmasked server frame (opcode, payload) of under 64 KiB.
async fn read_frame(s: &mut tokio::net::TcpStream) -> (u8, Vec<u8>) {
    tokio::time::timeout(Duration::from_secs(10), async {
        let b0 = s.read_u8().await.unwrap();
        let len = match s.read_u8().await.unwrap() {
            126 => usize::from(s.read_u16().await.unwrap()),
            n => usize::from(n),
        };
        let mut payload = vec![0u8; len];
        s.read_exact(&mut payload).await.unwrap();
        (b0 & 0x0F, payload)
    })
    .await
    .expect("a frame in time")
}

/// A masked, final client frame of under 126 bytes.
fn client_frame(op: u8, payload: &[u8]) -> Vec<u8> {
    let mask = [1u8, 2, 3, 4];
    let mut f = vec![0x80 | op, 0x80 | u8::try_from(payload.len()).unwrap()];
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
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
            .exec(vessel_cri_api::v1::ExecRequest {
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
            .exec_sync(vessel_cri_api::v1::ExecSyncRequest {
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
        self.c
            .stop_and_remove_pod(&self.pod)
            .await
            .expect("stop and remove the pod");
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

/// A channel-protocol port-forward ends when its client leaves, also while the pod's
/// server holds its side open and says nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_forward_ends_with_its_client() {
    let (port, stream_port) = (
        vessel_critest::client::free_port().unwrap(),
        vessel_critest::client::free_port().unwrap(),
    );
    let v = Vesseld::start_with(
        Path::new(env!("CARGO_BIN_EXE_vesseld")),
        &format!(
            "metrics_address = \"127.0.0.1:{port}\"\nstreaming_address = \"127.0.0.1:{stream_port}\"\n"
        ),
        "",
    )
    .expect("vesseld");
    let mut c = v.client().await;
    let logs = tempfile::tempdir().unwrap();
    let pcfg = vessel_critest::client::pod_config("ws-hold", "default", logs.path());
    let pod = c.run_pod(&pcfg, "").await.expect("RunPodSandbox");
    let held = serve_in_netns(&v.state_dir().join("netns").join(&pod), true);
    let url = c
        .runtime
        .port_forward(vessel_cri_api::v1::PortForwardRequest {
            pod_sandbox_id: pod.clone(),
            port: vec![i32::from(held)],
        })
        .await
        .unwrap()
        .into_inner()
        .url;
    let (mut s, head) = ws_upgrade(&url, "v4.channel.k8s.io").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let p = held.to_le_bytes();
    assert_eq!(read_frame(&mut s).await, (0x2, vec![0, p[0], p[1]]));
    assert_eq!(read_frame(&mut s).await, (0x2, vec![1, p[0], p[1]]));
    s.write_all(&client_frame(0x2, b"\x00hi")).await.unwrap();
    // The client says goodbye: the server answers, and the session is over.
    s.write_all(&client_frame(0x8, &[0x03, 0xE8]))
        .await
        .unwrap();
    assert_eq!(read_frame(&mut s).await, (0x8, vec![0x03, 0xE8]));
    let open = || async {
        let body = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let forward = [("kind", "portforward"), ("transport", "websocket")];
        common::Metrics::parse(body).want("vessel_streaming_sessions_open", &forward)
    };
    let t = std::time::Instant::now();
    while open().await != 0.0 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the forward's session outlived its client"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    c.stop_and_remove_pod(&pod)
        .await
        .expect("stop and remove the pod");
}

/// Exec in the base64 channel protocol (browser consoles): text messages, the channel as a
/// digit, the data in base64; the v4 exit status on the error channel; then a close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_base64_exec() {
    use base64::Engine;
    let p = Pod::start("").await;
    let url = p
        .exec_url(&["sh", "-c", "echo out; echo err >&2; exit 3"], false)
        .await;
    let (mut s, head) = ws_upgrade(&url, "v4.base64.channel.k8s.io").await;
    assert!(
        head.starts_with("HTTP/1.1 101") && head.contains("v4.base64.channel.k8s.io"),
        "{head}"
    );
    let mut channels: [Vec<u8>; 4] = Default::default();
    loop {
        match read_frame(&mut s).await {
            (0x8, _) => break,
            (0x1, m) => {
                let ch = usize::from(m[0] - b'0');
                let d = base64::engine::general_purpose::STANDARD
                    .decode(&m[1..])
                    .expect("base64");
                channels[ch].extend(d);
            }
            (op, m) => panic!("opcode {op} {m:?}: text messages only"),
        }
    }
    assert_eq!(channels[1], b"out\n");
    assert_eq!(channels[2], b"err\n");
    let status = String::from_utf8_lossy(&channels[3]);
    assert!(
        status.contains("NonZeroExitCode") && status.contains("\"3\""),
        "{status}"
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
