//! Container lifecycle through a real flat agent: create, start, wait, logs, status.

mod common;

use std::time::Duration;

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
    let info = c
        .container_status(proto::ContainerStatusRequest { id: "three".into() })
        .await
        .unwrap()
        .into_inner()
        .info
        .unwrap();
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
    let _ = Duration::from_secs(0);
}
