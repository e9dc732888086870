//! Pod-level behaviour: shared network, hostname, logs rotation, OOM, stats, reconnects,
//! crashes and shutdown.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

mod common;

use std::time::Duration;

use common::*;
use vessel_agent::proto;

#[tokio::test]
async fn containers_share_the_pod_network_not_pids() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    agent
        .run(
            &mut c,
            "server",
            &SpecBuilder::sh(
                "echo pid=$$; hostname; mkdir -p /www; echo pong > /www/index.html; \
                 exec httpd -f -p 8080 -h /www",
            ),
        )
        .await;
    agent
        .run(
            &mut c,
            "client",
            &SpecBuilder::sh(
                "echo pid=$$; for i in $(seq 1 100); do \
                 wget -q -O - http://127.0.0.1:8080/ && exit 0; sleep 0.1; done; exit 1",
            ),
        )
        .await;
    let exit = wait_exit(&mut c, "client").await;
    let client_log = std::fs::read_to_string(agent.log_path("client")).unwrap();
    assert_eq!(exit.exit_code, 0, "{client_log}");
    assert!(client_log.contains("stdout F pong"), "{client_log}");
    assert!(client_log.contains("stdout F pid=1"), "{client_log}");
    let server_log = std::fs::read_to_string(agent.log_path("server")).unwrap();
    assert!(server_log.contains("stdout F pid=1"), "{server_log}");
    assert!(
        server_log.contains(&format!("stdout F {}", agent.hostname)),
        "{server_log}"
    );
    // The pod network is not the host's: nothing listens on the host's 8080 for us.
    assert!(std::net::TcpStream::connect("127.0.0.1:8080").is_err());
}

#[tokio::test]
async fn reopen_log_after_rotation() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    agent
        .run(
            &mut c,
            "rot",
            &SpecBuilder::sh("echo one; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo two"),
        )
        .await;
    let log = agent.log_path("rot");
    assert!(
        eventually(Duration::from_secs(10), || std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("one"))
        .await
    );
    let rotated = log.with_extension("log.1");
    std::fs::rename(&log, &rotated).unwrap();
    c.reopen_log(proto::ReopenLogRequest { id: "rot".into() })
        .await
        .unwrap();
    c.exec_sync(proto::ExecSyncRequest {
        id: "rot".into(),
        args: vec!["touch".into(), "/tmp/go".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(wait_exit(&mut c, "rot").await.exit_code, 0);
    let new = read_log(&log);
    assert_eq!(new.len(), 1, "{new:?}");
    assert_eq!(new[0].content, "two");
    let old = read_log(&rotated);
    assert_eq!(old.len(), 1);
    assert_eq!(old[0].content, "one");
}

#[tokio::test]
async fn oom_kill_is_reported() {
    if skip_unless_root() {
        return;
    }
    if !vessel_agent::cgroups::memory_controller_available() {
        eprintln!("SKIP: the memory cgroup controller is not available");
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    // The init shell itself holds 64 MiB; the limit is 16 MiB.
    agent
        .run(
            &mut c,
            "hog",
            &SpecBuilder::sh("x=$(head -c 67108864 /dev/zero | tr '\\0' a); echo ${#x}")
                .memory_limit(16 * 1024 * 1024),
        )
        .await;
    let exit = wait_exit(&mut c, "hog").await;
    assert_eq!(exit.signal, 9, "{exit:?}");
    assert!(exit.oom_killed, "{exit:?}");

    // A plain SIGKILL is not an OOM kill.
    agent
        .run(
            &mut c,
            "victim",
            &SpecBuilder::new(&["sleep", "1000"]).memory_limit(16 << 20),
        )
        .await;
    c.signal_container(proto::SignalContainerRequest {
        id: "victim".into(),
        signal: 9,
        all: false,
    })
    .await
    .unwrap();
    let exit = wait_exit(&mut c, "victim").await;
    assert_eq!(exit.signal, 9);
    assert!(!exit.oom_killed);
}

#[tokio::test]
async fn stats_report_usage() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    agent
        .run(
            &mut c,
            "busy",
            &SpecBuilder::sh(
                "head -c 1048576 /dev/zero > /tmp/blob; \
                 i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; sleep 1000",
            ),
        )
        .await;
    let ok = eventually(Duration::from_secs(20), || {
        let d = agent.tmp.path().join("rw/busy/upper/tmp/blob");
        std::fs::metadata(d)
            .map(|m| m.len() == 1 << 20)
            .unwrap_or(false)
    })
    .await;
    assert!(ok);
    let s = c
        .stats(proto::StatsRequest { id: "busy".into() })
        .await
        .unwrap()
        .into_inner();
    assert!(s.timestamp > 0);
    assert!(s.cpu_usage_ns > 0, "{s:?}");
    assert!(s.memory_usage_bytes > 0, "{s:?}");
    assert!(s.memory_working_set_bytes <= s.memory_usage_bytes);
    assert!(s.pids >= 1, "{s:?}");
    assert!(s.writable_layer_bytes >= 1 << 20, "{s:?}");
    assert!(s.writable_layer_inodes >= 2, "{s:?}");
}

#[tokio::test]
async fn exit_codes_survive_client_disconnect() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    {
        let mut c = agent.client().await;
        agent
            .run(
                &mut c,
                "later",
                &SpecBuilder::sh("sleep 1; echo bye; exit 5"),
            )
            .await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut c = agent.client().await;
    let exit = wait_exit(&mut c, "later").await;
    assert_eq!(exit.exit_code, 5);
    assert!(exit.finished_at > 0);
    let recs = read_log(&agent.log_path("later"));
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].content, "bye");
}

#[tokio::test]
async fn kill_9_of_the_agent_leaves_nothing_running_or_mounted() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    agent
        .run(&mut c, "a", &SpecBuilder::new(&["sleep", "1000"]))
        .await;
    agent
        .run(&mut c, "b", &SpecBuilder::sh("sleep 1000 & sleep 1000"))
        .await;
    let mut procs = Vec::new();
    let all_up = eventually(Duration::from_secs(10), || {
        procs = agent.descendants();
        procs.len() >= 3
    })
    .await;
    assert!(all_up, "{procs:?}");
    // Inside the agent's mount namespace the overlays exist; on the host they never did.
    assert!(agent.our_mounts().is_empty(), "{:?}", agent.our_mounts());
    let ns_mounts = std::fs::read_to_string(format!("/proc/{}/mountinfo", agent.pid)).unwrap();
    assert!(ns_mounts.contains(&agent.state_dir.to_string_lossy().to_string()));

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.pid),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    assert!(agent.wait_agent_gone(Duration::from_secs(10)));
    let gone = eventually(Duration::from_secs(10), || {
        procs
            .iter()
            .all(|p| !std::path::Path::new(&format!("/proc/{p}")).exists())
    })
    .await;
    assert!(gone, "container processes survived the agent");
    assert!(agent.our_mounts().is_empty());
}

#[tokio::test]
async fn shutdown_removes_containers_cgroups_and_state() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    agent
        .run(&mut c, "a", &SpecBuilder::new(&["sleep", "1000"]))
        .await;
    agent
        .run(
            &mut c,
            "b",
            &SpecBuilder::sh("trap 'exit 0' TERM; while true; do sleep 0.1; done"),
        )
        .await;
    assert!(!agent.container_cgroups().is_empty());
    let procs = agent.descendants();
    c.shutdown(proto::ShutdownRequest {}).await.unwrap();
    assert!(agent.wait_agent_gone(Duration::from_secs(30)));
    assert!(procs
        .iter()
        .all(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()));
    assert!(
        agent.container_cgroups().is_empty(),
        "{:?}",
        agent.container_cgroups()
    );
    assert!(!agent.state_dir.exists());
    assert!(!agent.socket.exists());
    agent.assert_clean();
}

/// A created, never started container is killed at shutdown, not given the stop grace its
/// pid-namespace init ignores SIGTERM for (StopPodSandbox took 10 s for such a pod).
#[tokio::test]
async fn shutdown_kills_a_created_container_without_the_grace_period() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    c.create_container(
        agent.create_request("never-started", &SpecBuilder::new(&["sleep", "1000"])),
    )
    .await
    .unwrap();
    let procs = agent.descendants();
    let t = std::time::Instant::now();
    c.shutdown(proto::ShutdownRequest {}).await.unwrap();
    let took = t.elapsed();
    assert!(
        took < vessel_agent::service::STOP_GRACE / 2,
        "shutdown took {took:?} (the stop grace is {:?})",
        vessel_agent::service::STOP_GRACE
    );
    assert!(agent.wait_agent_gone(Duration::from_secs(30)));
    assert!(procs
        .iter()
        .all(|p| !std::path::Path::new(&format!("/proc/{p}")).exists()));
    agent.assert_clean();
}

#[tokio::test]
async fn joining_the_agent_pid_namespace() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    let mut spec = SpecBuilder::sh("echo pid=$$; ps -o pid,comm | grep -c . ; sleep 1000");
    spec.namespaces[0] = serde_json::json!({"type": "pid", "path": "agent"});
    agent.run(&mut c, "shared", &spec).await;
    let r = c
        .exec_sync(proto::ExecSyncRequest {
            id: "shared".into(),
            args: vec!["cat".into(), "/proc/1/cmdline".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    // PID 1 of the pod's shared pid namespace is its holder, not the agent (whose root is
    // the host's), and nothing of the host's shows through it.
    assert_eq!(
        String::from_utf8_lossy(&r.stdout).trim_end_matches('\0'),
        "vessel-pidns"
    );
    let r = c
        .exec_sync(proto::ExecSyncRequest {
            id: "shared".into(),
            args: vec!["ls".into(), "-A".into(), "/proc/1/root/".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    // (Refused without CAP_SYS_PTRACE, empty with it.)
    assert!(
        r.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&r.stdout)
    );
    let log = agent.log_path("shared");
    assert!(
        eventually(Duration::from_secs(10), || std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("pid="))
        .await
    );
    assert!(!std::fs::read_to_string(&log).unwrap().contains("pid=1\n"));
    c.delete_container(proto::DeleteContainerRequest {
        id: "shared".into(),
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn sharing_host_namespaces() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start_with(&["--share-host", "net,pid,ipc"]);
    let mut c = agent.client().await;
    let ping = c.ping(proto::PingRequest {}).await.unwrap().into_inner();
    assert_eq!(ping.pid as i32, agent.pid, "host pid namespace");
    let host_name = nix::unistd::gethostname().unwrap();
    assert_eq!(ping.hostname, host_name.to_string_lossy());
    let mut spec = SpecBuilder::sh("hostname; cat /proc/net/dev | grep -c :");
    spec.namespaces.retain(|n| n["type"] != "uts");
    agent.run(&mut c, "h", &spec).await;
    assert_eq!(wait_exit(&mut c, "h").await.exit_code, 0);
    let recs = read_log(&agent.log_path("h"));
    // Host network pods keep the host's hostname.
    assert_eq!(recs[0].content, host_name.to_string_lossy(), "{recs:?}");
    assert_eq!(
        std::fs::read_link(format!("/proc/{}/ns/net", agent.pid)).unwrap(),
        std::fs::read_link("/proc/self/ns/net").unwrap()
    );
    c.shutdown(proto::ShutdownRequest {}).await.unwrap();
    assert!(agent.wait_agent_gone(Duration::from_secs(30)));
    agent.assert_clean();
}

#[tokio::test]
async fn sigterm_shuts_the_agent_down() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    agent
        .run(
            &mut c,
            "t",
            &SpecBuilder::sh("trap 'exit 0' TERM; while true; do sleep 0.1; done"),
        )
        .await;
    assert_ne!(
        std::fs::read_link(format!("/proc/{}/ns/net", agent.pid)).unwrap(),
        std::fs::read_link("/proc/self/ns/net").unwrap(),
        "the pod has its own netns, pinnable at /proc/<READY pid>/ns/net"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.pid),
        nix::sys::signal::SIGTERM,
    )
    .unwrap();
    assert!(agent.wait_agent_gone(Duration::from_secs(20)));
    assert!(!agent.state_dir.exists());
    agent.assert_clean();
}

#[tokio::test]
async fn a_flat_agent_refuses_vm_pod_requests() {
    if skip_unless_root() {
        return;
    }
    let agent = TestAgent::start();
    let mut c = agent.client().await;
    let spec = SpecBuilder::sh("true");
    let mut req = agent.create_request("disks", &spec);
    req.rootfs = Some(proto::Rootfs {
        kind: Some(proto::rootfs::Kind::Disks(proto::DiskLayersRootfs {
            serials: vec!["layer-0".into()],
        })),
    });
    let e = c.create_container(req).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let mut req = agent.create_request("vsocklog", &spec);
    req.log_vsock_port = 1025;
    let e = c.create_container(req).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let e = c
        .configure_sandbox(proto::ConfigureSandboxRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    let containers = c
        .list_containers(proto::ListContainersRequest {})
        .await
        .unwrap()
        .into_inner()
        .containers;
    assert!(containers.is_empty(), "{containers:?}");
}
