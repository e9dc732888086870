//! Container lifecycle through a real flat agent: create, start, wait, logs, status.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

mod common;

use common::*;
use vessel_agent::proto;

#[tokio::test]
async fn echo_logs_and_exit_codes() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;

    let ping = c.ping(proto::PingRequest {}).await.unwrap().into_inner();
    assert_eq!(ping.pid, 1);
    assert_eq!(ping.hostname, agent.hostname);

    agent
        .run(
            &mut c,
            "echo",
            &SpecBuilder::sh("echo hello; echo oops >&2"),
        )
        .await;
    let exit = wait_exit(&mut c, "echo").await;
    assert_eq!(exit.exit_code, 0, "agent log:\n{}", agent.agent_log());
    assert_eq!(exit.signal, 0);
    assert!(!exit.oom_killed);
    let recs = read_log(&agent.log_path("echo"));
    assert_eq!(recs.len(), 2, "{recs:?}");
    let out = recs.iter().find(|r| r.stream == "stdout").unwrap();
    let err = recs.iter().find(|r| r.stream == "stderr").unwrap();
    assert_eq!((out.tag.as_str(), out.content.as_str()), ("F", "hello"));
    assert_eq!((err.tag.as_str(), err.content.as_str()), ("F", "oops"));
    for r in &recs {
        assert!(r.ts.ends_with('Z') && r.ts.contains('T'), "{r:?}");
        let frac = r.ts.split('.').nth(1).unwrap();
        assert_eq!(frac.len(), 10, "nanosecond timestamp: {r:?}");
    }

    // Exit code 3.
    agent.run(&mut c, "three", &SpecBuilder::sh("exit 3")).await;
    assert_eq!(wait_exit(&mut c, "three").await.exit_code, 3);

    // A 20 KiB line: P records, then F.
    agent
        .run(
            &mut c,
            "long",
            &SpecBuilder::sh("head -c 20480 /dev/zero | tr '\\0' x; echo; printf tail"),
        )
        .await;
    assert_eq!(wait_exit(&mut c, "long").await.exit_code, 0);
    let recs = read_log(&agent.log_path("long"));
    let tags: Vec<&str> = recs.iter().map(|r| r.tag.as_str()).collect();
    assert_eq!(tags, ["P", "F", "F"], "{recs:?}");
    assert_eq!(recs[0].content.len(), 16 * 1024);
    assert_eq!(recs[0].content.len() + recs[1].content.len(), 20480);
    assert_eq!(recs[2].content, "tail");

    // Status and listing.
    let info = container_info(&mut c, "three").await;
    assert_eq!(info.state, proto::ContainerState::Exited as i32);
    assert!(info.created_at > 0 && info.started_at >= info.created_at);
    assert_eq!(info.exit.unwrap().exit_code, 3);
    let list = c
        .list_containers(proto::ListContainersRequest {})
        .await
        .unwrap()
        .into_inner()
        .containers;
    let ids: Vec<&str> = list.iter().map(|i| i.id.as_str()).collect();
    assert_eq!(ids, ["echo", "long", "three"]);

    // Errors.
    let e = c
        .start_container(proto::StartContainerRequest { id: "nope".into() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    assert!(e.message().contains("nope"));
    let e = c
        .start_container(proto::StartContainerRequest { id: "three".into() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    let mut bad = agent.create_request("bad", &SpecBuilder::sh("true"));
    bad.oci_spec = b"{not json".to_vec();
    let e = c.create_container(bad).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);

    for id in ["echo", "three", "long"] {
        c.delete_container(proto::DeleteContainerRequest { id: id.into() })
            .await
            .unwrap();
    }
    c.delete_container(proto::DeleteContainerRequest { id: "echo".into() })
        .await
        .unwrap();
    assert!(
        agent.container_cgroups().is_empty(),
        "{:?}",
        agent.container_cgroups()
    );
    let left: Vec<_> = std::fs::read_dir(agent.state_dir.join("containers"))
        .unwrap()
        .collect();
    assert!(left.is_empty());
}

#[tokio::test]
async fn delete_created_and_running_containers() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    // A created container has no processes yet: the agent makes them when it starts.
    let pid = c
        .create_container(agent.create_request("created", &SpecBuilder::sh("echo never")))
        .await
        .unwrap()
        .into_inner()
        .pid;
    assert_eq!(pid, 0);
    let info = container_info(&mut c, "created").await;
    assert_eq!(info.state, proto::ContainerState::Created as i32);
    assert_eq!(info.pid, 0);
    assert!(agent.container_cgroups().is_empty());
    // Signals to it reach nobody (not the agent's process group) and succeed.
    c.signal_container(proto::SignalContainerRequest {
        id: "created".into(),
        signal: 9,
        all: true,
    })
    .await
    .unwrap();
    // A second create with the same id fails.
    let e = c
        .create_container(agent.create_request("created", &SpecBuilder::sh("true")))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::AlreadyExists);

    agent
        .run(&mut c, "running", &SpecBuilder::new(&["sleep", "1000"]))
        .await;
    // Many concurrent waiters.
    let waiters: Vec<_> = (0..4)
        .map(|_| {
            let mut c = c.clone();
            tokio::spawn(async move { wait_exit(&mut c, "running").await })
        })
        .collect();
    // Only the started container has cgroups.
    assert_eq!(agent.container_cgroups().len(), agent.cgroup_dirs().len());
    for id in ["created", "running"] {
        c.delete_container(proto::DeleteContainerRequest { id: id.into() })
            .await
            .unwrap();
    }
    for w in waiters {
        assert_eq!(w.await.unwrap().signal, 9);
    }
    assert!(agent.container_cgroups().is_empty());
    let log = std::fs::read_to_string(agent.log_path("created")).unwrap_or_default();
    assert!(!log.contains("never"));
    let e = c
        .container_status(proto::ContainerStatusRequest {
            id: "created".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn tty_container_and_path_rootfs() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    let mut req = agent.create_request("tty", &SpecBuilder::sh("tty; echo hi; exit 4"));
    req.tty = true;
    c.create_container(req).await.unwrap();
    c.start_container(proto::StartContainerRequest { id: "tty".into() })
        .await
        .unwrap();
    assert_eq!(wait_exit(&mut c, "tty").await.exit_code, 4);
    let recs = read_log(&agent.log_path("tty"));
    assert!(recs.iter().all(|r| r.stream == "stdout"), "{recs:?}");
    assert!(
        recs.iter().any(|r| r.content.starts_with("/dev/pts/")),
        "{recs:?}"
    );
    assert!(
        recs.iter().any(|r| r.content.trim_end() == "hi"),
        "{recs:?}"
    );

    // A plain directory as rootfs (bind-mounted by libcontainer, not by us).
    let dir = agent.tmp.path().join("plain");
    std::fs::create_dir_all(&dir).unwrap();
    let tar = vessel_images::testimages::busybox_rootfs().finish();
    vessel_images::unpack::unpack_layer(
        &tar[..],
        &dir,
        &vessel_images::unpack::UnpackOptions {
            lowers: vec![],
            same_owner: true,
            skip_sync: false,
            ..Default::default()
        },
    )
    .unwrap();
    let mut req =
        agent.create_request("plain", &SpecBuilder::sh("echo plain > /tmp/x; cat /tmp/x"));
    req.rootfs = Some(proto::Rootfs {
        kind: Some(proto::rootfs::Kind::Path(dir.to_string_lossy().into())),
    });
    c.create_container(req).await.unwrap();
    c.start_container(proto::StartContainerRequest { id: "plain".into() })
        .await
        .unwrap();
    assert_eq!(wait_exit(&mut c, "plain").await.exit_code, 0);
    assert!(dir.join("tmp/x").exists());
    let s = c
        .stats(proto::StatsRequest { id: "plain".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((s.writable_layer_bytes, s.writable_layer_inodes), (0, 0));
}

#[test]
fn launcher_failure_leaves_nothing() {
    if skip_unless_root() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    // A socket path that cannot be created: its parent is a regular file.
    std::fs::write(tmp.path().join("file"), b"").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vessel-agent"))
        .args(["flat", "--hostname", "x", "--socket"])
        .arg(tmp.path().join("file/agent.sock"))
        .arg("--state-dir")
        .arg(&state)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        out.stdout.is_empty(),
        "{:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("agent.sock"), "{err}");
    assert!(!state.exists());
}

#[tokio::test]
async fn oom_score_adj_is_applied_or_clamped() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    let mut spec = SpecBuilder::sh("cat /proc/self/oom_score_adj");
    spec.oom_score_adj = Some(500);
    agent.run(&mut c, "up", &spec).await;
    assert_eq!(wait_exit(&mut c, "up").await.exit_code, 0);
    assert_eq!(read_log(&agent.log_path("up"))[0].content, "500");
    // Lowering needs CAP_SYS_RESOURCE; without it the agent's own value is used.
    spec.oom_score_adj = Some(-500);
    agent.run(&mut c, "down", &spec).await;
    assert_eq!(wait_exit(&mut c, "down").await.exit_code, 0);
    let got = read_log(&agent.log_path("down"))[0].content.clone();
    assert!(got == "-500" || got == "0", "{got}");
}

/// The agent makes a container's processes when it starts it: a start that fails (here the
/// rootfs overlay cannot be mounted: its lower layer is gone) answers an error, leaves the
/// container exited with nothing mounted and no cgroup, and the container is still deletable.
/// A container that exits has its cgroups and rootfs mount released before its exit is
/// reported, so nothing but files is left for its removal.
#[tokio::test]
async fn failed_start_and_exit_release_everything() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;

    let mut req = agent.create_request("nolower", &SpecBuilder::sh("true"));
    if let Some(proto::rootfs::Kind::Overlay(ov)) =
        req.rootfs.as_mut().and_then(|r| r.kind.as_mut())
    {
        ov.lowerdirs = vec![agent
            .state_dir
            .join("no-such-layer")
            .to_string_lossy()
            .into()];
    }
    c.create_container(req).await.unwrap();
    let e = c
        .start_container(proto::StartContainerRequest {
            id: "nolower".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let info = container_info(&mut c, "nolower").await;
    assert_eq!(info.state, proto::ContainerState::Exited as i32);
    assert_eq!(info.exit.unwrap().exit_code, 128);
    agent.assert_clean();
    c.delete_container(proto::DeleteContainerRequest {
        id: "nolower".into(),
    })
    .await
    .unwrap();

    // The agent's own mount namespace holds the rootfs mounts.
    let rootfs_mounted = |id: &str| {
        std::fs::read_to_string(format!("/proc/{}/mountinfo", agent.pid))
            .unwrap()
            .contains(&format!("/containers/{id}/rootfs "))
    };
    c.create_container(agent.create_request("quick", &SpecBuilder::sh("sleep 0.3; exit 3")))
        .await
        .unwrap();
    assert!(!rootfs_mounted("quick"), "mounted at create");
    c.start_container(proto::StartContainerRequest { id: "quick".into() })
        .await
        .unwrap();
    assert!(rootfs_mounted("quick"), "not mounted while it runs");
    assert_eq!(wait_exit(&mut c, "quick").await.exit_code, 3);
    // Released before the exit was published: no cgroup, no rootfs mount, before delete.
    assert!(!rootfs_mounted("quick"), "still mounted after the exit");
    agent.assert_clean();
    c.delete_container(proto::DeleteContainerRequest { id: "quick".into() })
        .await
        .unwrap();
    let left: Vec<_> = std::fs::read_dir(agent.state_dir.join("containers"))
        .unwrap()
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
