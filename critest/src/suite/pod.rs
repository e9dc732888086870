//! Runtime info, pod sandbox lifecycle and status, idempotence.

use super::{spec, Ctx, Spec, SpecResult, Stop};
use crate::{check, fail};
use std::time::Duration;
use tonic::Code;
use vessel_cri_api::v1 as cri;

pub(super) fn runtime_specs() -> Vec<Spec> {
    vec![
        spec!(
            "runtime",
            "Version reports the runtime name and version and API v1",
            version
        ),
        spec!("runtime", "Status reports RuntimeReady=true", runtime_ready),
        spec!("runtime", "Status reports NetworkReady=true", network_ready),
        spec!(
            "runtime",
            "RuntimeConfig reports a cgroup driver",
            runtime_config
        ),
    ]
}

pub(super) fn specs() -> Vec<Spec> {
    vec![
        spec!("pod", "run, status, stop, remove", lifecycle),
        spec!("pod", "list filters by id, state and label", list_filters),
        spec!(
            "pod",
            "a second pod with the same metadata is refused",
            duplicate
        ),
        spec!(
            "pod",
            "removing a pod removes its containers",
            remove_with_containers
        ),
        spec!("pod", "PodSandboxStats reports the pod", pod_stats),
        spec!(
            "pod",
            "PodSandboxStats: the pod's CPU time does not go back when a container ends",
            pod_cpu_keeps_ended_containers
        ),
        spec!(
            "pod",
            "the Stream* calls answer what the List calls do",
            streamed_lists
        ),
        spec!(
            "pod",
            "UpdatePodSandboxResources takes the pod's new resources",
            update_pod_resources
        ),
        spec!(
            "pod",
            "PodSandboxStatus carries its containers' statuses and when it was read",
            status_with_containers
        ),
        spec!(
            "idempotence",
            "StopPodSandbox twice succeeds",
            stop_pod_twice
        ),
        spec!(
            "idempotence",
            "RemovePodSandbox twice (and of an unknown id) succeeds",
            remove_pod_twice
        ),
        spec!(
            "idempotence",
            "StopContainer twice succeeds",
            stop_ctr_twice
        ),
        spec!(
            "idempotence",
            "RemoveContainer twice succeeds",
            remove_ctr_twice
        ),
        spec!(
            "idempotence",
            "StopContainer with timeout 0 during a long graceful stop kills at once",
            stop_ctr_overtaken
        ),
    ]
}

async fn version(c: Ctx) -> SpecResult {
    let mut cl = c.c.clone();
    let v = cl
        .runtime
        .version(cri::VersionRequest {
            version: "v1".into(),
        })
        .await?
        .into_inner();
    check!(!v.runtime_name.is_empty(), "empty runtime_name: {v:?}");
    check!(
        !v.runtime_version.is_empty(),
        "empty runtime_version: {v:?}"
    );
    check!(
        v.runtime_api_version == "v1",
        "runtime_api_version {:?}, want v1",
        v.runtime_api_version
    );
    check!(!v.version.is_empty(), "empty version: {v:?}");
    Ok(())
}

async fn condition(c: &Ctx, kind: &str) -> Result<cri::RuntimeCondition, super::Stop> {
    let mut cl = c.c.clone();
    let s = cl
        .runtime
        .status(cri::StatusRequest { verbose: false })
        .await?
        .into_inner();
    let Some(st) = s.status else {
        fail!("StatusResponse without status")
    };
    match st.conditions.into_iter().find(|x| x.r#type == kind) {
        Some(x) => Ok(x),
        None => fail!("no {kind} condition"),
    }
}

async fn runtime_ready(c: Ctx) -> SpecResult {
    let r = condition(&c, "RuntimeReady").await?;
    check!(r.status, "RuntimeReady=false: {} {}", r.reason, r.message);
    Ok(())
}

async fn network_ready(c: Ctx) -> SpecResult {
    let r = condition(&c, "NetworkReady").await?;
    check!(r.status, "NetworkReady=false: {} {}", r.reason, r.message);
    Ok(())
}

async fn runtime_config(c: Ctx) -> SpecResult {
    let mut cl = c.c.clone();
    let r = cl
        .runtime
        .runtime_config(cri::RuntimeConfigRequest {})
        .await?
        .into_inner();
    check!(r.linux.is_some(), "no linux runtime configuration: {r:?}");
    Ok(())
}

async fn lifecycle(c: Ctx) -> SpecResult {
    let (id, cfg) = c.run_pod("life").await?;
    let s = c.pod_status(&id).await?;
    check!(s.id == id, "status id {} != {id}", s.id);
    check!(
        s.state == cri::PodSandboxState::SandboxReady as i32,
        "state {} after run, want READY",
        s.state
    );
    check!(
        s.metadata == cfg.metadata,
        "metadata {:?} != {:?}",
        s.metadata,
        cfg.metadata
    );
    check!(s.created_at > 0, "created_at {}", s.created_at);
    for (k, v) in &cfg.labels {
        check!(
            s.labels.get(k) == Some(v),
            "label {k} missing: {:?}",
            s.labels
        );
    }
    check!(
        s.annotations == cfg.annotations,
        "annotations {:?}",
        s.annotations
    );
    let mut cl = c.c.clone();
    cl.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: id.clone(),
        })
        .await?;
    let s = c.pod_status(&id).await?;
    check!(
        s.state == cri::PodSandboxState::SandboxNotready as i32,
        "state {} after stop, want NOTREADY",
        s.state
    );
    cl.runtime
        .remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: id.clone(),
        })
        .await?;
    match cl
        .runtime
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: id.clone(),
            verbose: false,
        })
        .await
    {
        Err(e) if e.code() == Code::NotFound => {}
        other => fail!("PodSandboxStatus after remove: {other:?}, want NotFound"),
    }
    let pods = list_pods(
        &c,
        cri::PodSandboxFilter {
            id: id.clone(),
            ..Default::default()
        },
    )
    .await?;
    check!(pods.is_empty(), "removed pod still listed");
    Ok(())
}

async fn list_pods(c: &Ctx, f: cri::PodSandboxFilter) -> Result<Vec<String>, super::Stop> {
    let mut cl = c.c.clone();
    Ok(cl
        .runtime
        .list_pod_sandbox(cri::ListPodSandboxRequest { filter: Some(f) })
        .await?
        .into_inner()
        .items
        .into_iter()
        .map(|p| p.id)
        .collect())
}

async fn list_filters(c: Ctx) -> SpecResult {
    let mut a = c.pod_config("a");
    a.labels.insert("which".into(), "a".into());
    let mut b = c.pod_config("b");
    b.labels.insert("which".into(), "b".into());
    let ida = c.run_pod_with(&a).await?;
    let idb = c.run_pod_with(&b).await?;
    let mut cl = c.c.clone();
    cl.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: idb.clone(),
        })
        .await?;
    let mine = c.labels();
    let all = list_pods(
        &c,
        cri::PodSandboxFilter {
            label_selector: mine.clone(),
            ..Default::default()
        },
    )
    .await?;
    check!(
        all.len() == 2 && all.contains(&ida) && all.contains(&idb),
        "by spec label: {all:?}"
    );
    let by_id = list_pods(
        &c,
        cri::PodSandboxFilter {
            id: ida.clone(),
            ..Default::default()
        },
    )
    .await?;
    check!(by_id == vec![ida.clone()], "by id: {by_id:?}");
    let ready = list_pods(
        &c,
        cri::PodSandboxFilter {
            state: Some(cri::PodSandboxStateValue {
                state: cri::PodSandboxState::SandboxReady as i32,
            }),
            label_selector: mine.clone(),
            ..Default::default()
        },
    )
    .await?;
    check!(ready == vec![ida.clone()], "READY: {ready:?}");
    let notready = list_pods(
        &c,
        cri::PodSandboxFilter {
            state: Some(cri::PodSandboxStateValue {
                state: cri::PodSandboxState::SandboxNotready as i32,
            }),
            label_selector: mine.clone(),
            ..Default::default()
        },
    )
    .await?;
    check!(notready == vec![idb.clone()], "NOTREADY: {notready:?}");
    let mut sel = mine;
    sel.insert("which".into(), "b".into());
    let by_label = list_pods(
        &c,
        cri::PodSandboxFilter {
            label_selector: sel,
            ..Default::default()
        },
    )
    .await?;
    check!(by_label == vec![idb], "by label which=b: {by_label:?}");
    Ok(())
}

async fn duplicate(c: Ctx) -> SpecResult {
    let (_, cfg) = c.run_pod("dup").await?;
    match c.run_pod_with(&cfg).await {
        Err(_) => Ok(()),
        Ok(id) => {
            fail!("a second pod {id} with the same name, namespace, uid and attempt was accepted")
        }
    }
}

async fn remove_with_containers(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("rm").await?;
    let ctr = c.run(&pod, &pcfg, "sleeper", "sleep 100000").await?;
    let mut cl = c.c.clone();
    cl.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await?;
    let s = c.status(&ctr).await?;
    check!(
        s.state == cri::ContainerState::ContainerExited as i32,
        "container {} after StopPodSandbox, want EXITED",
        super::ctr_state(s.state)
    );
    cl.runtime
        .remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: pod,
        })
        .await?;
    match cl
        .runtime
        .container_status(cri::ContainerStatusRequest {
            container_id: ctr,
            verbose: false,
        })
        .await
    {
        Err(e) if e.code() == Code::NotFound => Ok(()),
        other => fail!("ContainerStatus after RemovePodSandbox: {other:?}, want NotFound"),
    }
}

async fn pod_stats(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("stats").await?;
    c.run(&pod, &pcfg, "sleeper", "sleep 100000").await?;
    c.run(&pod, &pcfg, "two", "sleep 100001 & exec sleep 100002")
        .await?;
    let mut cl = c.c.clone();
    // Its containers' processes (kubelet's summary API), as containerd counts them; the
    // shell may not have started its background sleep yet: asked again until then.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let s = cl
            .runtime
            .pod_sandbox_stats(cri::PodSandboxStatsRequest {
                pod_sandbox_id: pod.clone(),
            })
            .await?
            .into_inner();
        let Some(st) = s.stats else { fail!("no stats") };
        check!(
            st.attributes.as_ref().is_some_and(|a| a.id == pod),
            "attributes {:?}",
            st.attributes
        );
        let linux = st.linux.unwrap_or_default();
        check!(
            linux.cpu.is_some() && linux.memory.is_some(),
            "no cpu or memory: {linux:?}"
        );
        let count = linux
            .process
            .and_then(|p| p.process_count.filter(|_| p.timestamp > 0))
            .map(|v| v.value);
        if count == Some(3) {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            fail!("process count {count:?}, want 3");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A pod's CPU time is a counter (crictl statsp takes the difference of two, kubelet exports
/// it as `pod_cpu_usage_seconds_total`): a container that used CPU and ended still counts,
/// as in containerd's pod cgroup (the running containers' sum went back).
async fn pod_cpu_keeps_ended_containers(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("podcpu").await?;
    c.run(&pod, &pcfg, "sleeper", "sleep 100000").await?;
    // Busy for a second of its clock (however fast the node), then idle.
    let burner = c
        .run(
            &pod,
            &pcfg,
            "burner",
            "end=$(($(date +%s) + 2)); while [ $(date +%s) -lt $end ]; do :; done; \
             touch /tmp/done; exec sleep 100000",
        )
        .await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while c.sh(&burner, "test -e /tmp/done").await?.0 != 0 {
        check!(
            std::time::Instant::now() < deadline,
            "the burner did not finish"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let cl = c.c.clone();
    let cpu = || {
        let mut cl = cl.clone();
        let pod = pod.clone();
        async move {
            let st = cl
                .runtime
                .pod_sandbox_stats(cri::PodSandboxStatsRequest {
                    pod_sandbox_id: pod,
                })
                .await?
                .into_inner()
                .stats
                .and_then(|s| s.linux)
                .and_then(|l| l.cpu)
                .and_then(|u| u.usage_core_nano_seconds)
                .map(|v| v.value);
            Ok::<_, Stop>(st)
        }
    };
    let Some(before) = cpu().await? else {
        fail!("no pod CPU time")
    };
    let burned = c
        .stats(&burner)
        .await?
        .and_then(|s| s.cpu)
        .and_then(|u| u.usage_core_nano_seconds)
        .map_or(0, |v| v.value);
    check!(
        before >= burned && burned > 0,
        "pod CPU time {before} ns, the burner's {burned} ns"
    );
    c.stop(&burner, 0).await?;
    let after = cpu().await?;
    check!(
        after.is_some_and(|a| a >= before),
        "the pod's CPU time went from {before} ns to {after:?} when a container ended"
    );
    c.c.clone()
        .runtime
        .remove_container(cri::RemoveContainerRequest {
            container_id: burner,
        })
        .await?;
    let removed = cpu().await?;
    check!(
        removed.is_some_and(|a| a >= before),
        "the pod's CPU time went from {before} ns to {removed:?} when a container was removed"
    );
    Ok(())
}

async fn stop_pod_twice(c: Ctx) -> SpecResult {
    let (pod, _) = c.run_pod("stop2").await?;
    let mut cl = c.c.clone();
    for _ in 0..2 {
        cl.runtime
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: pod.clone(),
            })
            .await?;
    }
    Ok(())
}

async fn remove_pod_twice(c: Ctx) -> SpecResult {
    let (pod, _) = c.run_pod("rm2").await?;
    let mut cl = c.c.clone();
    cl.runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await?;
    for _ in 0..2 {
        cl.runtime
            .remove_pod_sandbox(cri::RemovePodSandboxRequest {
                pod_sandbox_id: pod.clone(),
            })
            .await?;
    }
    cl.runtime
        .remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: format!("{}deadbeef", c.id.replace('-', "")),
        })
        .await?;
    Ok(())
}

/// `crictl stop -t 0` (or `crictl rm -f`) while a stop waits out a long grace period for a
/// container that ignores SIGTERM: it kills the container at once, and the first stop
/// returns then too, as with containerd (it waited out the first stop's grace).
async fn stop_ctr_overtaken(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("cstopfast").await?;
    let id = c
        .run(
            &pod,
            &pcfg,
            "stubborn",
            "trap '' TERM; while :; do sleep 1; done",
        )
        .await?;
    let slow = {
        let (c, id) = (c.clone(), id.clone());
        tokio::spawn(async move { c.stop(&id, 120).await })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t = std::time::Instant::now();
    c.stop(&id, 0).await?;
    let took = t.elapsed();
    check!(
        took < Duration::from_secs(20),
        "StopContainer with timeout 0 took {took:?} (the first stop's grace is 120 s)"
    );
    let st = c.c.container_status(&id).await?;
    check!(
        st.state == cri::ContainerState::ContainerExited as i32 && st.exit_code == 137,
        "after the stop: state {}, exit {}",
        st.state,
        st.exit_code
    );
    match tokio::time::timeout(Duration::from_secs(20), slow).await {
        Ok(Ok(Ok(()))) => Ok(()),
        other => fail!("the first stop did not end with the container: {other:?}"),
    }
}

async fn stop_ctr_twice(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("cstop2").await?;
    let id = c.run(&pod, &pcfg, "sleeper", "sleep 100000").await?;
    for _ in 0..2 {
        c.stop(&id, 1).await?;
    }
    Ok(())
}

async fn remove_ctr_twice(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("crm2").await?;
    let id = c.run(&pod, &pcfg, "sleeper", "sleep 100000").await?;
    c.stop(&id, 1).await?;
    let mut cl = c.c.clone();
    for _ in 0..2 {
        cl.runtime
            .remove_container(cri::RemoveContainerRequest {
                container_id: id.clone(),
            })
            .await?;
    }
    Ok(())
}

/// The ids a `Stream*` call sends, read to the stream's end, sorted.
async fn streamed<R>(
    stream: Result<tonic::Response<tonic::Streaming<R>>, tonic::Status>,
    ids: impl Fn(R) -> Vec<String>,
) -> Result<Vec<String>, super::Stop> {
    // A runtime of an earlier API answers Unimplemented (kubelet then lists the unary way).
    let unimplemented = |e: tonic::Status| {
        if e.code() == Code::Unimplemented {
            super::Stop::Skip(format!("the runtime has no Stream* calls: {}", e.message()))
        } else {
            e.into()
        }
    };
    let mut s = stream.map_err(unimplemented)?.into_inner();
    let mut out = Vec::new();
    while let Some(r) = s.message().await.map_err(unimplemented)? {
        out.extend(ids(r));
    }
    out.sort();
    Ok(out)
}

/// kubelet and crictl 1.36 list through the streaming calls first (the unary ones are their
/// fallback for runtimes without them): each must send what its List call answers.
async fn streamed_lists(c: Ctx) -> SpecResult {
    let (a, pcfg) = c.run_pod("streamed-a").await?;
    let (b, _) = c.run_pod("streamed-b").await?;
    let ctr = c.run(&a, &pcfg, "sleeper", "sleep 100000").await?;
    let mut cl = c.c.clone();
    let mut pods = vec![a.clone(), b];
    pods.sort();
    let mine = cri::PodSandboxFilter {
        label_selector: c.labels(),
        ..Default::default()
    };
    let mut listed = list_pods(&c, mine.clone()).await?;
    listed.sort();
    check!(
        listed == pods,
        "ListPodSandbox answered {listed:?}, want {pods:?}"
    );
    let got = streamed(
        cl.runtime
            .stream_pod_sandboxes(cri::StreamPodSandboxesRequest { filter: Some(mine) })
            .await,
        |r| r.pod_sandboxes.into_iter().map(|p| p.id).collect(),
    )
    .await?;
    check!(
        got == pods,
        "StreamPodSandboxes sent {got:?}, want {pods:?}"
    );
    let got = streamed(
        cl.runtime
            .stream_containers(cri::StreamContainersRequest {
                filter: Some(cri::ContainerFilter {
                    label_selector: c.labels(),
                    ..Default::default()
                }),
            })
            .await,
        |r| r.containers.into_iter().map(|c| c.id).collect(),
    )
    .await?;
    check!(
        got == [ctr.clone()],
        "StreamContainers sent {got:?}, want [{ctr}]"
    );
    let got = streamed(
        cl.runtime
            .stream_container_stats(cri::StreamContainerStatsRequest {
                filter: Some(cri::ContainerStatsFilter {
                    label_selector: c.labels(),
                    ..Default::default()
                }),
            })
            .await,
        |r| {
            r.container_stats
                .into_iter()
                .filter_map(|s| s.attributes.map(|a| a.id))
                .collect()
        },
    )
    .await?;
    check!(
        got == [ctr.clone()],
        "StreamContainerStats sent {got:?}, want [{ctr}]"
    );
    let got = streamed(
        cl.runtime
            .stream_pod_sandbox_stats(cri::StreamPodSandboxStatsRequest {
                filter: Some(cri::PodSandboxStatsFilter {
                    label_selector: c.labels(),
                    ..Default::default()
                }),
            })
            .await,
        |r| {
            r.pod_sandbox_stats
                .into_iter()
                .filter_map(|s| s.attributes.map(|a| a.id))
                .collect()
        },
    )
    .await?;
    check!(
        got == pods,
        "StreamPodSandboxStats sent {got:?}, want {pods:?}"
    );
    let got = streamed(
        cl.runtime
            .stream_pod_sandbox_metrics(cri::StreamPodSandboxMetricsRequest {})
            .await,
        |r| {
            r.pod_sandbox_metrics
                .into_iter()
                .map(|m| m.pod_sandbox_id)
                .collect()
        },
    )
    .await?;
    // Node-wide lists, which other specs may change in between: each id once, this spec's
    // pods and the run's shared image among them.
    let once = |ids: &[String]| ids.windows(2).all(|w| w[0] != w[1]);
    check!(
        once(&got) && pods.iter().all(|p| got.contains(p)),
        "StreamPodSandboxMetrics sent {got:?}, want each of {pods:?} once"
    );
    let got = streamed(
        cl.images
            .stream_images(cri::StreamImagesRequest { filter: None })
            .await,
        |r| r.images.into_iter().map(|i| i.id).collect(),
    )
    .await?;
    let busybox = cl
        .images
        .image_status(cri::ImageStatusRequest {
            image: super::ctx::spec(&c.env.images.busybox),
            verbose: false,
        })
        .await?
        .into_inner()
        .image
        .map(|i| i.id);
    let Some(busybox) = busybox else {
        fail!("ImageStatus has no {}", c.env.images.busybox);
    };
    check!(
        once(&got) && got.contains(&busybox),
        "StreamImages sent {got:?}, want {busybox} among them, each id once"
    );
    Ok(())
}

/// In-place pod resize (kubelet 1.33+): after resizing the pod's cgroup kubelet hands the
/// runtime the pod's new resources. An unknown pod is NotFound, negative values
/// InvalidArgument. Where the runtime shows the pod's config in verbose status (vessel
/// does), it carries them.
async fn update_pod_resources(c: Ctx) -> SpecResult {
    let (pod, _) = c.run_pod("resize").await?;
    let mut cl = c.c.clone();
    let resources = cri::LinuxContainerResources {
        cpu_period: 100_000,
        cpu_quota: 50_000,
        cpu_shares: 512,
        memory_limit_in_bytes: 64 << 20,
        ..Default::default()
    };
    let update =
        |id: &str, resources: cri::LinuxContainerResources| cri::UpdatePodSandboxResourcesRequest {
            pod_sandbox_id: id.into(),
            overhead: None,
            resources: Some(resources),
        };
    let e = cl
        .runtime
        .update_pod_sandbox_resources(update("no-such-pod", resources.clone()))
        .await
        .err();
    check!(
        e.as_ref().map(|e| e.code()) == Some(Code::NotFound),
        "an unknown pod: {e:?}"
    );
    let bad = cri::LinuxContainerResources {
        cpu_shares: -1,
        ..resources.clone()
    };
    let e = cl
        .runtime
        .update_pod_sandbox_resources(update(&pod, bad))
        .await
        .err();
    check!(
        e.as_ref().map(|e| e.code()) == Some(Code::InvalidArgument),
        "negative cpu_shares: {e:?}"
    );
    cl.runtime
        .update_pod_sandbox_resources(update(&pod, resources.clone()))
        .await?;
    let info = c.c.pod_info(&pod).await.ok();
    let shown = |info: &Option<serde_json::Value>| {
        info.as_ref()
            .map(|i| i["config"]["linux"]["resources"].clone())
    };
    if let Some(r) = shown(&info).filter(|r| !r.is_null()) {
        check!(
            r["memory_limit_in_bytes"] == 64 << 20 && r["cpu_quota"] == 50_000,
            "the pod's config after the update: {r}"
        );
    }
    // vessel's VM pods: a running microVM cannot grow; the refusal leaves the pod as it was.
    if info.as_ref().is_some_and(|i| i["backend"] == "vm") {
        let big = cri::LinuxContainerResources {
            memory_limit_in_bytes: 1 << 40,
            ..resources
        };
        let e = cl
            .runtime
            .update_pod_sandbox_resources(update(&pod, big))
            .await
            .err();
        check!(
            e.as_ref().map(|e| e.code()) == Some(Code::FailedPrecondition),
            "a VM pod grown past its VM: {e:?}"
        );
        let after = shown(&c.c.pod_info(&pod).await.ok());
        check!(
            after
                .as_ref()
                .is_some_and(|r| r["memory_limit_in_bytes"] == 64 << 20),
            "the refused resize changed the pod's config: {after:?}"
        );
    }
    Ok(())
}

/// kubelet's evented PLEG reads a pod's containers from its PodSandboxStatus reply when the
/// reply has a timestamp (and asks for each container's status where it has none).
async fn status_with_containers(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("with-ctrs").await?;
    let ctr = c.run(&pod, &pcfg, "sleeper", "sleep 100000").await?;
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or_default();
    let mut cl = c.c.clone();
    let r = cl
        .runtime
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: pod.clone(),
            verbose: false,
        })
        .await?
        .into_inner();
    check!(
        r.timestamp >= before,
        "timestamp {} is before the call ({before})",
        r.timestamp
    );
    let ids: Vec<(&str, i32)> = r
        .containers_statuses
        .iter()
        .map(|s| (s.id.as_str(), s.state))
        .collect();
    check!(
        ids == [(ctr.as_str(), cri::ContainerState::ContainerRunning as i32)],
        "containers_statuses {ids:?}, want [{ctr} running]"
    );
    Ok(())
}
