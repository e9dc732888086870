//! ExecSync, Exec streams and signals.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

mod common;

use std::time::Duration;

use common::*;
use vessel_agent::proto::{self, exec_input, exec_output};

fn exec_req(id: &str, args: &[&str], timeout_ms: u64) -> proto::ExecSyncRequest {
    proto::ExecSyncRequest {
        id: id.into(),
        args: args.iter().map(|s| s.to_string()).collect(),
        env: vec![],
        cwd: String::new(),
        timeout_ms,
    }
}

#[tokio::test]
async fn exec_sync_stream_and_signal() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    agent
        .run(
            &mut c,
            "sleeper",
            &SpecBuilder::new(&["sleep", "1000"])
                .env("FOO=bar")
                .cwd("/tmp"),
        )
        .await;

    // Output, environment and working directory come from the container.
    let r = c
        .exec_sync(exec_req(
            "sleeper",
            &["sh", "-c", "echo out $FOO $(pwd); echo err >&2"],
            0,
        ))
        .await
        .unwrap_or_else(|e| panic!("{e:?}\nagent log:\n{}", agent.agent_log()))
        .into_inner();
    assert_eq!(String::from_utf8_lossy(&r.stdout), "out bar /tmp\n");
    assert_eq!(String::from_utf8_lossy(&r.stderr), "err\n");
    assert_eq!(r.exit_code, 0);
    assert!(!r.timed_out);

    // env overrides, cwd overrides.
    let mut req = exec_req("sleeper", &["sh", "-c", "echo $FOO $(pwd)"], 0);
    req.env = vec!["FOO=baz".into()];
    req.cwd = "/etc".into();
    let r = c.exec_sync(req).await.unwrap().into_inner();
    assert_eq!(String::from_utf8_lossy(&r.stdout), "baz /etc\n");

    // Exit codes, signals.
    let r = c
        .exec_sync(exec_req("sleeper", &["sh", "-c", "exit 7"], 0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.exit_code, 7);
    let r = c
        .exec_sync(exec_req("sleeper", &["sh", "-c", "kill -9 $$"], 0))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.exit_code, 137);

    // Timeout.
    let t0 = std::time::Instant::now();
    let r = c
        .exec_sync(exec_req("sleeper", &["sleep", "30"], 500))
        .await
        .unwrap()
        .into_inner();
    assert!(r.timed_out);
    assert!(t0.elapsed() < Duration::from_secs(10));

    // Streaming exec: stdin echoed back through cat.
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tx.send(proto::ExecInput {
        msg: Some(exec_input::Msg::Start(proto::ExecStart {
            id: "sleeper".into(),
            args: vec!["cat".into()],
            stdin: true,
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let mut out = c
        .exec(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tx.send(proto::ExecInput {
        msg: Some(exec_input::Msg::Stdin(b"ping\n".to_vec())),
    })
    .await
    .unwrap();
    let mut got = Vec::new();
    while !got.ends_with(b"ping\n") {
        match out.message().await.unwrap().unwrap().msg.unwrap() {
            exec_output::Msg::Stdout(d) => got.extend_from_slice(&d),
            other => panic!("unexpected {other:?}"),
        }
    }
    tx.send(proto::ExecInput {
        msg: Some(exec_input::Msg::CloseStdin(true)),
    })
    .await
    .unwrap();
    let mut code = None;
    while let Some(m) = out.message().await.unwrap() {
        if let Some(exec_output::Msg::ExitCode(c)) = m.msg {
            code = Some(c);
        }
    }
    assert_eq!(code, Some(0));
    drop(tx);

    // Streaming exec with a tty: the initial size, then a resize.
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let script = "tty; \
        for i in $(seq 1 50); do [ \"$(stty size)\" = '33 77' ] && break; sleep 0.05; done; \
        echo size=$(stty size); \
        while [ \"$(stty size)\" != '50 100' ]; do sleep 0.05; done; echo resized";
    tx.send(proto::ExecInput {
        msg: Some(exec_input::Msg::Start(proto::ExecStart {
            id: "sleeper".into(),
            args: vec!["sh".into(), "-c".into(), script.into()],
            tty: true,
            size: Some(proto::WindowSize { rows: 33, cols: 77 }),
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let mut out = c
        .exec(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut text = Vec::new();
    let mut code = None;
    let mut resized = false;
    while let Some(m) = tokio::time::timeout(Duration::from_secs(20), out.message())
        .await
        .expect("tty exec stalled")
        .unwrap()
    {
        match m.msg.unwrap() {
            exec_output::Msg::Stdout(d) => text.extend_from_slice(&d),
            exec_output::Msg::ExitCode(c) => code = Some(c),
            exec_output::Msg::Stderr(_) => panic!("no stderr with a tty"),
        }
        if !resized && String::from_utf8_lossy(&text).contains("size=") {
            resized = true;
            tx.send(proto::ExecInput {
                msg: Some(exec_input::Msg::Resize(proto::WindowSize {
                    rows: 50,
                    cols: 100,
                })),
            })
            .await
            .unwrap();
        }
    }
    let text = String::from_utf8_lossy(&text);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("/dev/pts/"), "{text}");
    assert!(text.contains("size=33 77"), "{text}");
    assert!(text.contains("resized"), "{text}");
    drop(tx);

    // SIGTERM to a container whose init handles it.
    agent
        .run(
            &mut c,
            "trapper",
            &SpecBuilder::sh("trap 'exit 42' TERM; echo ready; while true; do sleep 0.1; done"),
        )
        .await;
    let log = agent.log_path("trapper");
    assert!(
        eventually(Duration::from_secs(10), || std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("ready"))
        .await
    );
    c.signal_container(proto::SignalContainerRequest {
        id: "trapper".into(),
        signal: 15,
        all: false,
    })
    .await
    .unwrap();
    let exit = wait_exit(&mut c, "trapper").await;
    assert_eq!(exit.exit_code, 42);

    // SIGKILL everything in the sleeper.
    c.signal_container(proto::SignalContainerRequest {
        id: "sleeper".into(),
        signal: 9,
        all: true,
    })
    .await
    .unwrap();
    let exit = wait_exit(&mut c, "sleeper").await;
    assert_eq!(
        (exit.exit_code, exit.signal, exit.oom_killed),
        (137, 9, false)
    );

    // Exec in a stopped container.
    let e = c
        .exec_sync(exec_req("sleeper", &["true"], 0))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    let e = c
        .exec_sync(exec_req("nope", &["true"], 0))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);

    // Stats on an exited container still answer (cgroup may be empty).
    c.stats(proto::StatsRequest {
        id: "sleeper".into(),
    })
    .await
    .unwrap();
}
