//! The streaming server against a live vesseld, at the protocol edges that the conformance
//! specs (`vessel-critest`'s `[streaming]` group, run by `critest_e2e`) do not reach: bad
//! tokens, WebSocket upgrades, RPC errors. Exec and port-forward themselves are exercised
//! through flat pods by those specs.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

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
