//! Container lifecycle, exec sync, logs, stats, multiple containers, OOM, mounts.

use super::{ctr_state, spec, Ctx, Spec, SpecResult, Stop};
use crate::{check, fail, skip};
use std::time::Duration;
use tonic::Code;
use vessel_cri_api::v1 as cri;

pub(super) fn specs() -> Vec<Spec> {
    vec![
        spec!("container", "create, start, stop, remove", lifecycle),
        spec!("container", "a stop right after start reaches an init that traps SIGTERM late", stop_late_trap),
        spec!("container", "StopContainer sends the config's stop_signal, which status reports", stop_signal),
        spec!("container", "exit code and reason of a finished container", exit_codes),
        spec!("container", "a start in a stopped pod fails and leaves the container exited with StartError", start_in_stopped_pod),
        spec!("container", "status carries metadata, image, labels, annotations and log path", status_fields),
        spec!("container", "named by image id as kubelet names it, status shows the user's image name", image_by_id),
        spec!("container", "list filters by id, state, pod and label", list_filters),
        spec!("container", "command, args, env and working dir", command_env),
        spec!("container", "the open-file limit is the runtime's: a flat pod's agent's, a VM pod's 1048576", nofile_limit),
        spec!("container", "a working dir the image lacks is made, read-only root too, and in a volume (as runc makes it)", missing_working_dir),
        spec!("container", "host path mounts, read-write, read-only, nested (inner listed first) and over /dev/shm", host_mounts),
        spec!("container", "UpdateContainerResources changes the memory limit of a running container and of a created one", update_resources),
        spec!("container", "cpuset_cpus (kubelet's CPU manager): a flat container runs on its CPUs; a VM pod's process on its containers' CPUs, and where it started once they are gone", cpuset),
        spec!("exec", "ExecSync returns stdout, stderr and the exit code", exec_sync),
        spec!("exec", "ExecSync past its timeout returns DeadlineExceeded", exec_timeout),
        spec!("exec", "ExecSync in an exited container fails", exec_exited),
        spec!("logs", "stdout and stderr lines in CRI format", logs_format),
        spec!("logs", "a line longer than the buffer is split into P records then F", logs_partial),
        spec!("logs", "a terminal's lines (\\r\\n) are records without the \\r", logs_tty),
        spec!("logs", "ReopenContainerLog after a rename writes to a new file", logs_reopen),
        spec!("logs", "ReopenContainerLog of an exited container fails", logs_reopen_exited),
        spec!("stats", "ContainerStats reports cpu and memory of a running container", stats),
        spec!("stats", "ListContainerStats filters by container and pod", list_stats),
        spec!("stats", "ContainerStats and PodSandboxStats report pressure stall information where the cgroups have it", stats_psi),
        spec!("multi", "two containers of a pod share localhost", shared_localhost),
        spec!("multi", "containers of a pod have their own pid namespace by default", own_pid_ns),
        spec!("oom", "a container over its memory limit is OOMKilled", oom),
        spec!("mount", "private propagation: host mounts made later are not seen", prop_private),
        spec!("mount", "rslave (HostToContainer) propagation: later host mounts are seen", prop_rslave),
        spec!("mount", "rshared (Bidirectional) propagation: container mounts reach the host", prop_bidirectional,
            vm = "a VM pod's mounts live in the guest kernel and cannot appear in the host's mount table"),
    ]
}

/// Containers get no rlimits of their own (containerd sets none): they have the runtime's
/// open-file limit. A VM pod's agent is its guest's init, which the kernel gives 1024 (4096
/// hard); it raises them to 1048576 (`fs.nr_open`), as a host runtime's unit does.
async fn nofile_limit(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("nofile").await?;
    let id = c.run(&pod, &pcfg, "limits", "sleep 100000").await?;
    let got = c.sh_ok(&id, "echo $(ulimit -n) $(ulimit -Hn)").await?;
    let want = if c.env.vm_pods {
        "1048576 1048576".to_string()
    } else {
        // The pod agent's (vesseld's, which started it).
        let pid = c.c.pod_info(&pod).await?["pid"].as_u64().unwrap_or(0);
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits"))
            .map_err(|e| Stop::Fail(format!("the pod agent's limits: {e}")))?;
        let line = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .unwrap_or_default();
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            [.., soft, hard, _unit] => format!("{soft} {hard}"),
            _ => fail!("no open-file limit in the agent's limits: {line:?}"),
        }
    };
    check!(
        got == want,
        "the container's open-file limits are {got:?}, want {want:?}"
    );
    Ok(())
}

async fn lifecycle(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("life").await?;
    let id = c
        .create(&pod, &pcfg, c.ctr_config("sleeper", "sleep 100000"))
        .await?;
    let s = c.status(&id).await?;
    check!(
        s.state == cri::ContainerState::ContainerCreated as i32,
        "{} after create, want CREATED",
        ctr_state(s.state)
    );
    check!(s.created_at > 0, "created_at {}", s.created_at);
    c.start(&id).await?;
    let s = c.status(&id).await?;
    check!(
        s.state == cri::ContainerState::ContainerRunning as i32,
        "{} after start, want RUNNING",
        ctr_state(s.state)
    );
    check!(
        s.started_at >= s.created_at,
        "started_at {} < created_at {}",
        s.started_at,
        s.created_at
    );
    c.stop(&id, 1).await?;
    let mut cl = c.c.clone();
    let s = c.status(&id).await?;
    check!(
        s.state == cri::ContainerState::ContainerExited as i32,
        "{} after stop, want EXITED",
        ctr_state(s.state)
    );
    check!(
        s.finished_at >= s.started_at,
        "finished_at {} < started_at {}",
        s.finished_at,
        s.started_at
    );
    check!(
        s.exit_code == 137 || s.exit_code == 143,
        "exit code {} after stop, want 137 or 143",
        s.exit_code
    );
    cl.runtime
        .remove_container(cri::RemoveContainerRequest {
            container_id: id.clone(),
        })
        .await?;
    match cl
        .runtime
        .container_status(cri::ContainerStatusRequest {
            container_id: id,
            verbose: false,
        })
        .await
    {
        Err(e) if e.code() == Code::NotFound => Ok(()),
        other => fail!("ContainerStatus after remove: {other:?}, want NotFound"),
    }
}

/// The kernel drops SIGTERM to a namespace init without a handler; a stop that comes before
/// the entrypoint installs its handler must still end in the handler, not in the SIGKILL.
async fn stop_late_trap(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("late-trap").await?;
    let cmd = "sleep 1; trap 'exit 7' TERM; while true; do sleep 0.1; done";
    let id = c.create(&pod, &pcfg, c.ctr_config("late", cmd)).await?;
    c.start(&id).await?;
    let began = std::time::Instant::now();
    c.stop(&id, 20).await?;
    let took = began.elapsed();
    let s = c.status(&id).await?;
    check!(
        s.exit_code == 7,
        "exit code {} after {took:?}, want 7 (the trap's): the stop signal was lost",
        s.exit_code
    );
    check!(took < Duration::from_secs(15), "stop took {took:?}");
    Ok(())
}

/// kubelet's `lifecycle.stopSignal` (CRI `stop_signal`): StopContainer sends it instead of the
/// image's (busybox: none, so SIGTERM), and ContainerStatus reports it.
async fn stop_signal(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("stop-signal").await?;
    let mut cfg = c.ctr_config(
        "usr1",
        "trap 'exit 7' USR1; echo ready; while true; do sleep 0.1; done",
    );
    cfg.stop_signal = cri::Signal::Sigusr1 as i32;
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    c.wait_log(&c.log_path(&pcfg, "usr1"), "ready", |l| {
        l.iter().any(|l| l.content == "ready")
    })
    .await?;
    let s = c.status(&id).await?;
    check!(
        s.stop_signal == cri::Signal::Sigusr1 as i32,
        "status stop_signal {:?}, want SIGUSR1",
        cri::Signal::try_from(s.stop_signal)
    );
    c.stop(&id, 30).await?;
    let s = c.status(&id).await?;
    // SIGTERM would go unhandled by this PID 1 and the stop end in SIGKILL (137).
    check!(
        s.exit_code == 7,
        "exit code {}, want 7 (the USR1 trap's)",
        s.exit_code
    );
    // A real-time one (SIGRTMIN+3, 37 as moby numbers it: what systemd-based images stop
    // with) as well: the stop waited for its SIGKILL.
    let mut cfg = c.ctr_config(
        "rt",
        "trap 'exit 8' 37; echo ready; while true; do sleep 0.1; done",
    );
    cfg.stop_signal = cri::Signal::Sigrtminplus3 as i32;
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    c.wait_log(&c.log_path(&pcfg, "rt"), "ready", |l| {
        l.iter().any(|l| l.content == "ready")
    })
    .await?;
    let t = std::time::Instant::now();
    c.stop(&id, 30).await?;
    let s = c.status(&id).await?;
    check!(
        s.exit_code == 8 && t.elapsed() < Duration::from_secs(20),
        "exit code {} after {:?}, want 8 (the SIGRTMIN+3 trap's) at once",
        s.exit_code,
        t.elapsed()
    );
    let plain = c.run(&pod, &pcfg, "plain", "sleep 100000").await?;
    let s = c.status(&plain).await?;
    check!(
        s.stop_signal == cri::Signal::Sigterm as i32,
        "status stop_signal {:?} without one asked for (busybox has none), want SIGTERM",
        cri::Signal::try_from(s.stop_signal)
    );
    Ok(())
}

/// kubelet starts a container it created just before its pod was stopped: the start fails,
/// and the container is Exited (128, StartError) as containerd leaves it, not Created for
/// good.
async fn start_in_stopped_pod(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("startstopped").await?;
    let id = c
        .create(&pod, &pcfg, c.ctr_config("late", "sleep 100000"))
        .await?;
    c.c.clone()
        .runtime
        .stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await?;
    let started =
        c.c.clone()
            .runtime
            .start_container(cri::StartContainerRequest {
                container_id: id.clone(),
            })
            .await;
    check!(
        started.is_err(),
        "StartContainer in a stopped pod: {started:?}"
    );
    let s = c.status(&id).await?;
    check!(
        s.state == cri::ContainerState::ContainerExited as i32
            && s.exit_code == 128
            && s.reason == "StartError",
        "state {}, exit code {}, reason {:?}; want exited, 128, StartError",
        ctr_state(s.state),
        s.exit_code,
        s.reason
    );
    Ok(())
}

async fn exit_codes(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("exit").await?;
    let bad = c.run(&pod, &pcfg, "bad", "exit 3").await?;
    let good = c.run(&pod, &pcfg, "good", "true").await?;
    let s = c.wait_exit(&bad).await?;
    check!(s.exit_code == 3, "exit code {}, want 3", s.exit_code);
    check!(
        s.reason == "Error",
        "reason {:?} for exit 3, want Error",
        s.reason
    );
    check!(s.finished_at > 0, "finished_at {}", s.finished_at);
    let s = c.wait_exit(&good).await?;
    check!(s.exit_code == 0, "exit code {}, want 0", s.exit_code);
    check!(
        s.reason == "Completed",
        "reason {:?} for exit 0, want Completed",
        s.reason
    );
    Ok(())
}

async fn status_fields(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("fields").await?;
    let cfg = c.ctr_config("sleeper", "sleep 100000");
    let id = c.run_cfg(&pod, &pcfg, cfg.clone()).await?;
    let s = c.status(&id).await?;
    check!(s.id == id, "id {}", s.id);
    check!(s.metadata == cfg.metadata, "metadata {:?}", s.metadata);
    check!(
        s.image.as_ref().map(|i| i.image.as_str()) == Some(c.env.images.busybox.as_str())
            || s.image
                .as_ref()
                .is_some_and(|i| i.image.starts_with("sha256:")),
        "image {:?}",
        s.image
    );
    check!(!s.image_ref.is_empty(), "empty image_ref");
    check!(s.labels == cfg.labels, "labels {:?}", s.labels);
    check!(
        s.annotations == cfg.annotations,
        "annotations {:?}",
        s.annotations
    );
    let want = c.log_path(&pcfg, "sleeper");
    check!(
        std::path::Path::new(&s.log_path) == want || s.log_path == "sleeper.log",
        "log_path {:?}, want {want:?}",
        s.log_path
    );
    Ok(())
}

/// kubelet creates containers with `image` set to the id PullImage answered and the pod
/// spec's name in `user_specified_image`; status and lists show that name (kubectl's
/// `image:`), not the id, and keep the id in `image_id`. Without a user's name, an image
/// named by its id is shown by its first tag, as containerd does.
async fn image_by_id(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("by-id").await?;
    c.ensure_image(&c.env.images.busybox).await?;
    let mut cl = c.c.clone();
    let img = cl
        .images
        .image_status(cri::ImageStatusRequest {
            image: Some(cri::ImageSpec {
                image: c.env.images.busybox.clone(),
                ..Default::default()
            }),
            verbose: false,
        })
        .await?
        .into_inner()
        .image
        .ok_or_else(|| Stop::Fail("ImageStatus: no image".into()))?;
    let user = "my-registry.example/team/busybox:pinned";
    let mut cfg = c.ctr_config("kubelet-style", "sleep 100000");
    cfg.image = Some(cri::ImageSpec {
        image: img.id.clone(),
        user_specified_image: user.into(),
        ..Default::default()
    });
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    let s = c.status(&id).await?;
    let shown = s.image.clone().unwrap_or_default();
    check!(shown.image == user, "image {shown:?}, want {user:?}");
    check!(
        shown.user_specified_image == user,
        "user_specified_image {shown:?}"
    );
    check!(
        s.image_id == img.id,
        "image_id {:?}, want {:?}",
        s.image_id,
        img.id
    );
    let listed = cl
        .runtime
        .list_containers(cri::ListContainersRequest {
            filter: Some(cri::ContainerFilter {
                id: id.clone(),
                ..Default::default()
            }),
        })
        .await?
        .into_inner()
        .containers;
    check!(
        listed.len() == 1 && listed[0].image.as_ref() == Some(&shown),
        "listed {listed:?}"
    );
    let mut cfg = c.ctr_config("by-id-only", "sleep 100000");
    cfg.image = Some(cri::ImageSpec {
        image: img.id.clone(),
        ..Default::default()
    });
    let id = c.create(&pod, &pcfg, cfg).await?;
    let s = c.status(&id).await?;
    let shown = s.image.unwrap_or_default().image;
    check!(
        img.repo_tags.first() == Some(&shown),
        "image {shown:?}, want the first of {:?}",
        img.repo_tags
    );
    Ok(())
}

async fn list_ctrs(c: &Ctx, f: cri::ContainerFilter) -> Result<Vec<String>, Stop> {
    let mut cl = c.c.clone();
    let mut v: Vec<String> = cl
        .runtime
        .list_containers(cri::ListContainersRequest { filter: Some(f) })
        .await?
        .into_inner()
        .containers
        .into_iter()
        .map(|x| x.id)
        .collect();
    v.sort();
    Ok(v)
}

async fn list_filters(c: Ctx) -> SpecResult {
    let (p1, c1) = c.run_pod("one").await?;
    let (p2, c2) = c.run_pod("two").await?;
    let mut cfg = c.ctr_config("a", "sleep 100000");
    cfg.labels.insert("which".into(), "a".into());
    let a = c.run_cfg(&p1, &c1, cfg).await?;
    let b = c
        .create(&p1, &c1, c.ctr_config("b", "sleep 100000"))
        .await?;
    let x = c.run(&p2, &c2, "x", "sleep 100000").await?;
    let mine = c.labels();
    let mut all = vec![a.clone(), b.clone(), x.clone()];
    all.sort();
    let got = list_ctrs(
        &c,
        cri::ContainerFilter {
            label_selector: mine.clone(),
            ..Default::default()
        },
    )
    .await?;
    check!(got == all, "by spec label: {got:?}, want {all:?}");
    let got = list_ctrs(
        &c,
        cri::ContainerFilter {
            id: b.clone(),
            ..Default::default()
        },
    )
    .await?;
    check!(got == vec![b.clone()], "by id: {got:?}");
    let mut want = vec![a.clone(), b.clone()];
    want.sort();
    let got = list_ctrs(
        &c,
        cri::ContainerFilter {
            pod_sandbox_id: p1.clone(),
            ..Default::default()
        },
    )
    .await?;
    check!(got == want, "by pod: {got:?}, want {want:?}");
    let got = list_ctrs(
        &c,
        cri::ContainerFilter {
            state: Some(cri::ContainerStateValue {
                state: cri::ContainerState::ContainerCreated as i32,
            }),
            label_selector: mine.clone(),
            ..Default::default()
        },
    )
    .await?;
    check!(got == vec![b.clone()], "CREATED: {got:?}");
    let mut sel = mine;
    sel.insert("which".into(), "a".into());
    let got = list_ctrs(
        &c,
        cri::ContainerFilter {
            label_selector: sel,
            ..Default::default()
        },
    )
    .await?;
    check!(got == vec![a], "by label which=a: {got:?}");
    Ok(())
}

async fn command_env(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("cmd").await?;
    let mut cfg = c.ctr_config("cmd", "");
    cfg.command = vec!["sh".into(), "-c".into()];
    cfg.args = vec!["echo \"$FOO $(pwd) $0\"".into(), "zero".into()];
    cfg.envs = vec![cri::KeyValue {
        key: "FOO".into(),
        value: "bar baz".into(),
    }];
    cfg.working_dir = "/tmp".into();
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    c.wait_exit(&id).await?;
    let lines = c.read_log(&c.log_path(&pcfg, "cmd"))?;
    let got: Vec<&str> = lines.iter().map(|l| l.content.as_str()).collect();
    check!(
        got == vec!["bar baz /tmp zero"],
        "output {got:?}, want [\"bar baz /tmp zero\"]"
    );
    Ok(())
}

/// kubelet passes a pod's `workingDir` as it is (Tekton's /workspace, CI pods' checkout
/// directories): runc makes a missing one, owned by root, before the root goes read-only.
async fn missing_working_dir(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("wd").await?;
    let mut ids = Vec::new();
    for (name, readonly) in [("wd", false), ("wdro", true)] {
        let mut cfg = c.ctr_config(name, "sleep 100000");
        cfg.working_dir = "/workspace/src".into();
        Ctx::sec(&mut cfg).readonly_rootfs = readonly;
        ids.push(c.run_cfg(&pod, &pcfg, cfg).await?);
    }
    for id in &ids {
        let got = c.sh_ok(id, "pwd; stat -c %u:%a /workspace/src").await?;
        check!(
            got == "/workspace/src\n0:755",
            "{id}: pwd and owner:mode {got:?}"
        );
    }
    // Under a volume it is made in the volume, as runc makes it (a CI checkout's
    // `workingDir: /workspace/src/repo` on a volume at /workspace): on the host.
    let vol = c.dir("wdvol")?;
    let mut cfg = c.ctr_config("wdvol", "sleep 100000");
    cfg.working_dir = "/workspace/src/repo".into();
    cfg.mounts = vec![cri::Mount {
        container_path: "/workspace".into(),
        host_path: vol.display().to_string(),
        ..Default::default()
    }];
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    let got = c.sh_ok(&id, "pwd; stat -c %a /workspace/src/repo").await?;
    check!(
        got == "/workspace/src/repo\n755",
        "in a volume: pwd and mode {got:?}"
    );
    check!(
        vol.join("src/repo").is_dir(),
        "the working directory is not in the volume's host directory {}",
        vol.display()
    );
    // A read-only volume is not written: the start fails (as runc's does), nothing made.
    let ro = c.dir("wdro-vol")?;
    let mut cfg = c.ctr_config("wdrovol", "sleep 100000");
    cfg.working_dir = "/workspace/src/repo".into();
    cfg.mounts = vec![cri::Mount {
        container_path: "/workspace".into(),
        host_path: ro.display().to_string(),
        readonly: true,
        ..Default::default()
    }];
    let id = c.create(&pod, &pcfg, cfg).await?;
    let started = c.c.start_container(&id).await;
    check!(
        started.is_err() && !ro.join("src").exists(),
        "a working directory under a read-only volume: start {started:?}, made in it: {}",
        ro.join("src").exists()
    );
    Ok(())
}

async fn host_mounts(c: Ctx) -> SpecResult {
    let rw = c.dir("rw")?;
    let ro = c.dir("ro")?;
    std::fs::write(ro.join("hello"), "from-host").map_err(|e| Stop::Fail(e.to_string()))?;
    // A volume inside another, listed first (kubelet keeps the pod spec's order), and one
    // over the standard /dev/shm.
    let inner = c.dir("inner")?;
    let shm = c.dir("shm")?;
    let io = |e: std::io::Error| Stop::Fail(e.to_string());
    std::fs::create_dir_all(ro.join("inner")).map_err(io)?;
    std::fs::write(inner.join("marker"), "inner").map_err(io)?;
    std::fs::write(shm.join("marker"), "shm").map_err(io)?;
    let id = c
        .sleeper_with("mnt", |cfg| {
            cfg.mounts = vec![
                cri::Mount {
                    container_path: "/mnt/ro/inner".into(),
                    host_path: inner.display().to_string(),
                    ..Default::default()
                },
                cri::Mount {
                    container_path: "/dev/shm".into(),
                    host_path: shm.display().to_string(),
                    ..Default::default()
                },
                cri::Mount {
                    container_path: "/mnt/rw".into(),
                    host_path: rw.display().to_string(),
                    ..Default::default()
                },
                cri::Mount {
                    container_path: "/mnt/ro".into(),
                    host_path: ro.display().to_string(),
                    readonly: true,
                    ..Default::default()
                },
            ];
        })
        .await?;
    c.sh_ok(&id, "echo from-container > /mnt/rw/out").await?;
    let got = std::fs::read_to_string(rw.join("out")).unwrap_or_default();
    check!(
        got == "from-container\n",
        "host sees {got:?} in the rw mount"
    );
    let got = c.sh_ok(&id, "cat /mnt/ro/hello").await?;
    check!(
        got == "from-host",
        "container reads {got:?} from the ro mount"
    );
    let (code, _, _) = c.sh(&id, "echo x > /mnt/ro/new").await?;
    check!(code != 0, "writing to the read-only mount succeeded");
    let got = c
        .sh_ok(&id, "cat /mnt/ro/inner/marker /dev/shm/marker")
        .await?;
    check!(
        got == "innershm",
        "the nested volume and the one over /dev/shm show {got:?}"
    );
    Ok(())
}

/// The limit is in the container's cgroup when it runs; one given to a created container
/// (kubelet resizing a container that has not started yet) is what it starts with.
async fn update_resources(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("upd").await?;
    let running = c.run(&pod, &pcfg, "running", "sleep 100000").await?;
    let created = c
        .create(&pod, &pcfg, c.ctr_config("created", "sleep 100000"))
        .await?;
    for (id, mib) in [(&running, 64u64), (&created, 96)] {
        let mut cl = c.c.clone();
        cl.runtime
            .update_container_resources(cri::UpdateContainerResourcesRequest {
                container_id: id.clone(),
                linux: Some(cri::LinuxContainerResources {
                    memory_limit_in_bytes: (mib << 20) as i64,
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await?;
    }
    c.start(&created).await?;
    // One made with a limit, for the swap default at create.
    let mut cfg = c.ctr_config("limited", "sleep 100000");
    cfg.linux.get_or_insert_with(Default::default).resources = Some(cri::LinuxContainerResources {
        memory_limit_in_bytes: 48 << 20,
        ..Default::default()
    });
    let limited = c.run_cfg(&pod, &pcfg, cfg).await?;
    for (id, mib) in [(&running, 64u64), (&created, 96), (&limited, 48)] {
        let got = c
            .sh_ok(id, "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes")
            .await?;
        check!(
            got == (mib << 20).to_string(),
            "memory limit in the cgroup of {id}: {got:?}, want {}",
            mib << 20
        );
        // `crictl inspect` shows the spec the container runs with, as containerd does
        // (scripts read `info.runtimeSpec.process.args`), its limit as last updated.
        let info = c.c.container_info(id).await?;
        let spec = &info["runtimeSpec"];
        check!(
            spec["process"]["args"][0] == "sh"
                && spec["linux"]["resources"]["memory"]["limit"] == mib << 20
                && info["config"]["metadata"]["name"].is_string(),
            "verbose ContainerStatus of {id}: runtimeSpec process {} resources {}, config metadata {}",
            spec["process"],
            spec["linux"]["resources"],
            info["config"]["metadata"]
        );
        // No swap beyond the limit where the host accounts swap (containerd's default
        // when the request gives no swap limit): v1's memory+swap is the limit, v2's swap
        // is 0. A VM guest has no swap.
        if c.env.vm_pods {
            continue;
        }
        let swap = c
            .sh_ok(id, "f=/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes; if [ -e $f ]; then cat $f; else cat /sys/fs/cgroup/memory.swap.max 2>/dev/null || echo none; fi")
            .await?;
        check!(
            swap == (mib << 20).to_string() || swap == "0" || swap == "none",
            "swap limit in the cgroup of {id}: {swap:?}, want {} (or 0 on cgroup v2)",
            mib << 20
        );
    }
    // An update that sets only some fields (kubelet's CPU manager sends only cpuset_cpus)
    // leaves the others as they were, in the cgroup and in the spec `crictl inspect` shows.
    let mut cl = c.c.clone();
    cl.runtime
        .update_container_resources(cri::UpdateContainerResourcesRequest {
            container_id: limited.clone(),
            linux: Some(cri::LinuxContainerResources {
                cpu_shares: 512,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await?;
    let info = c.c.container_info(&limited).await?;
    // `info.pid` is the host's (`nsenter -t <pid>` recipes), as containerd gives it: the
    // process that is `podPid` in the pod's pid namespace; none for a VM pod's.
    let (pid, pod_pid) = (info["pid"].as_u64(), info["podPid"].as_u64());
    if c.env.vm_pods {
        check!(pid == Some(0), "a VM pod's container has host pid {pid:?}");
    } else {
        let nspid = pid
            .filter(|&p| p > 0)
            .and_then(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("NSpid:"))
                    .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
            })
            .unwrap_or_default();
        check!(
            nspid.first().map(String::as_str) == pid.map(|p| p.to_string()).as_deref()
                && nspid.get(1).map(String::as_str) == pod_pid.map(|p| p.to_string()).as_deref(),
            "info.pid {pid:?}, podPid {pod_pid:?}: the host's NSpid of that pid is {nspid:?}"
        );
    }
    let res = &info["runtimeSpec"]["linux"]["resources"];
    check!(
        res["memory"]["limit"] == 48u64 << 20 && res["cpu"]["shares"] == 512,
        "runtimeSpec resources after a shares-only update: {res}"
    );
    // The cgroup takes the update as it takes the same shares at start: on cgroup v2 the same
    // cpu.weight (an in-place resize must not change a container's weight against others).
    let mut cfg = c.ctr_config("shares", "sleep 100000");
    cfg.linux.get_or_insert_with(Default::default).resources = Some(cri::LinuxContainerResources {
        cpu_shares: 512,
        ..Default::default()
    });
    let started = c.run_cfg(&pod, &pcfg, cfg).await?;
    let weight = "cat /sys/fs/cgroup/cpu.weight 2>/dev/null || cat /sys/fs/cgroup/cpu/cpu.shares";
    let (updated, made) = (
        c.sh_ok(&limited, weight).await?,
        c.sh_ok(&started, weight).await?,
    );
    check!(
        updated == made,
        "CPU weight after updating to 512 shares: {updated:?}; a container started with 512 shares has {made:?}"
    );
    // ... and in ContainerStatus.resources, which kubelet's in-place resize compares.
    let st = c.c.container_status(&limited).await?;
    let r = st.resources.and_then(|r| r.linux).unwrap_or_default();
    check!(
        r.memory_limit_in_bytes == 48 << 20 && r.cpu_shares == 512,
        "ContainerStatus.resources after a shares-only update: {r:?}"
    );
    // A period-only update keeps the quota: cgroup v2 holds both in one file, cpu.max,
    // whose quota such an update lifted.
    for (quota, period) in [(50_000, 100_000), (0, 200_000)] {
        let mut cl = c.c.clone();
        cl.runtime
            .update_container_resources(cri::UpdateContainerResourcesRequest {
                container_id: limited.clone(),
                linux: Some(cri::LinuxContainerResources {
                    cpu_quota: quota,
                    cpu_period: period,
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await?;
    }
    let got = c
        .sh_ok(&limited, "cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo $(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us) $(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)")
        .await?;
    check!(
        got == "50000 200000",
        "CPU quota and period after a period-only update: {got:?}, want 50000 200000"
    );
    let st = c.c.container_status(&limited).await?;
    let r = st.resources.and_then(|r| r.linux).unwrap_or_default();
    check!(
        r.cpu_quota == 50_000 && r.cpu_period == 200_000 && r.cpu_shares == 512,
        "ContainerStatus.resources after a period-only update: {r:?}"
    );
    Ok(())
}

/// The CPUs a process may run on (`Cpus_allowed_list` of a /proc status).
fn cpus_allowed(status: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap_or_default()
        .trim()
        .to_string()
}

async fn cpuset(c: Ctx) -> SpecResult {
    let io = |e: std::io::Error| Stop::Fail(e.to_string());
    // The host's last online CPU (not where anything starts pinned, on a host with two).
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").map_err(io)?;
    let last = online
        .trim()
        .rsplit([',', '-'])
        .next()
        .unwrap_or("0")
        .to_string();
    let (pod, pcfg) = c.run_pod("cpuset").await?;
    let mut cfg = c.ctr_config("pinned", "sleep 100000");
    cfg.linux.get_or_insert_with(Default::default).resources = Some(cri::LinuxContainerResources {
        cpuset_cpus: last.clone(),
        ..Default::default()
    });
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    if !c.env.vm_pods {
        let got = cpus_allowed(&c.sh_ok(&id, "cat /proc/self/status").await?);
        check!(
            got == last,
            "the container runs on CPUs {got:?}, want {last}"
        );
        return Ok(());
    }
    // Every thread of the VM pod's process (its vCPUs among them).
    let pid = c.c.pod_info(&pod).await?["pid"].as_u64().unwrap_or(0);
    check!(pid != 0, "no pid in the pod's verbose status");
    let threads = || -> Result<Vec<String>, Stop> {
        let dir = format!("/proc/{pid}/task");
        Ok(std::fs::read_dir(&dir)
            .map_err(io)?
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path().join("status")).ok())
            .map(|s| cpus_allowed(&s))
            .collect())
    };
    let got = threads()?;
    check!(
        !got.is_empty() && got.iter().all(|t| *t == last),
        "the VM pod's threads run on {got:?}, want {last}"
    );
    let mut cl = c.c.clone();
    cl.runtime
        .stop_container(cri::StopContainerRequest {
            container_id: id.clone(),
            timeout: 0,
        })
        .await?;
    cl.runtime
        .remove_container(cri::RemoveContainerRequest { container_id: id })
        .await?;
    let own = cpus_allowed(&std::fs::read_to_string("/proc/self/status").map_err(io)?);
    let got = threads()?;
    check!(
        got.iter().all(|t| *t == own || *t == online.trim()),
        "once its container is gone the VM pod's threads run on {got:?}, want {own}"
    );
    Ok(())
}

async fn exec_sync(c: Ctx) -> SpecResult {
    let id = c.sleeper_with("exec", |_| {}).await?;
    let r = c
        .exec(&id, &["sh", "-c", "echo out; echo err >&2; exit 3"], 10)
        .await?;
    check!(
        r.stdout == b"out\n",
        "stdout {:?}",
        String::from_utf8_lossy(&r.stdout)
    );
    check!(
        r.stderr == b"err\n",
        "stderr {:?}",
        String::from_utf8_lossy(&r.stderr)
    );
    check!(r.exit_code == 3, "exit code {}", r.exit_code);
    let r = c.exec(&id, &["true"], 0).await?;
    check!(r.exit_code == 0, "true exited {}", r.exit_code);
    Ok(())
}

async fn exec_timeout(c: Ctx) -> SpecResult {
    let id = c.sleeper_with("exect", |_| {}).await?;
    let start = std::time::Instant::now();
    match c.exec(&id, &["sleep", "30"], 1).await {
        Err(e) if e.code() == Code::DeadlineExceeded => {}
        Err(e) => fail!("{:?}: {}, want DeadlineExceeded", e.code(), e.message()),
        Ok(r) => fail!(
            "returned {r:?} after {:?}, want DeadlineExceeded",
            start.elapsed()
        ),
    }
    check!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?} for a 1 s timeout",
        start.elapsed()
    );
    Ok(())
}

async fn exec_exited(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("execx").await?;
    let id = c.run(&pod, &pcfg, "done", "true").await?;
    c.wait_exit(&id).await?;
    // No host pid for what has exited (`nsenter -t` would enter whatever has that pid now).
    let pid = c.c.container_info(&id).await?["pid"].as_u64();
    check!(pid == Some(0), "an exited container's info.pid is {pid:?}");
    match c.exec(&id, &["true"], 5).await {
        Err(_) => Ok(()),
        Ok(r) => fail!("ExecSync in an exited container returned {r:?}"),
    }
}

async fn logs_format(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("logs").await?;
    let id = c
        .run(&pod, &pcfg, "out", "echo hello; echo oops >&2; echo bye")
        .await?;
    c.wait_exit(&id).await?;
    let path = c.log_path(&pcfg, "out");
    let lines = c.wait_log(&path, "three lines", |l| l.len() >= 3).await?;
    let got: Vec<(&str, &str, &str)> = lines
        .iter()
        .map(|l| (l.stream.as_str(), l.tag.as_str(), l.content.as_str()))
        .collect();
    let mut sorted = got.clone();
    sorted.sort();
    let mut want = vec![
        ("stdout", "F", "hello"),
        ("stderr", "F", "oops"),
        ("stdout", "F", "bye"),
    ];
    want.sort();
    check!(sorted == want, "log records {got:?}");
    let out: Vec<_> = got
        .iter()
        .filter(|l| l.0 == "stdout")
        .map(|l| l.2)
        .collect();
    check!(out == vec!["hello", "bye"], "stdout order {out:?}");
    Ok(())
}

/// A container with a terminal writes "\r\n" (the terminal's newline translation): its
/// records, what `kubectl logs` prints, end without the "\r", as containerd's do.
async fn logs_tty(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("logstty").await?;
    let mut cfg = c.ctr_config("term", "echo hello; echo bye");
    cfg.tty = true;
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    c.wait_exit(&id).await?;
    let lines = c
        .wait_log(&c.log_path(&pcfg, "term"), "two lines", |l| l.len() >= 2)
        .await?;
    let got: Vec<(&str, &str, &str)> = lines
        .iter()
        .map(|l| (l.stream.as_str(), l.tag.as_str(), l.content.as_str()))
        .collect();
    check!(
        got == [("stdout", "F", "hello"), ("stdout", "F", "bye")],
        "log records {got:?}"
    );
    Ok(())
}

async fn logs_partial(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("long").await?;
    let id = c
        .run(
            &pod,
            &pcfg,
            "long",
            "head -c 40000 /dev/zero | tr '\\0' a; echo",
        )
        .await?;
    c.wait_exit(&id).await?;
    let lines = c
        .wait_log(&c.log_path(&pcfg, "long"), "the final F record", |l| {
            l.last().is_some_and(|x| x.tag == "F")
        })
        .await?;
    check!(
        lines.len() >= 2,
        "{} record(s) for a 40000-byte line, want P records then F",
        lines.len()
    );
    let tags: Vec<&str> = lines.iter().map(|l| l.tag.as_str()).collect();
    check!(
        lines[..lines.len() - 1].iter().all(|l| l.tag == "P"),
        "tags {tags:?}"
    );
    let total: usize = lines.iter().map(|l| l.content.len()).sum();
    check!(total == 40000, "{total} bytes in the records, want 40000");
    Ok(())
}

async fn logs_reopen(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("reopen").await?;
    let id = c
        .run(
            &pod,
            &pcfg,
            "ticker",
            "while true; do echo tick; sleep 0.1; done",
        )
        .await?;
    let log = c.log_path(&pcfg, "ticker");
    c.wait_log(&log, "first ticks", |l| l.len() >= 2).await?;
    let rotated = log.with_extension("log.1");
    std::fs::rename(&log, &rotated).map_err(|e| Stop::Fail(format!("rename: {e}")))?;
    let mut cl = c.c.clone();
    cl.runtime
        .reopen_container_log(cri::ReopenContainerLogRequest { container_id: id })
        .await?;
    c.wait_log(&log, "ticks in the new file", |l| l.len() >= 2)
        .await?;
    let before = c.read_log(&rotated)?.len();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = c.read_log(&rotated)?.len();
    check!(
        after == before,
        "the renamed file is still written after reopen ({before} -> {after} lines)"
    );
    Ok(())
}

async fn logs_reopen_exited(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("reopenx").await?;
    let id = c.run(&pod, &pcfg, "done", "true").await?;
    c.wait_exit(&id).await?;
    let mut cl = c.c.clone();
    match cl
        .runtime
        .reopen_container_log(cri::ReopenContainerLogRequest { container_id: id })
        .await
    {
        Err(_) => Ok(()),
        Ok(_) => fail!("ReopenContainerLog of an exited container succeeded"),
    }
}

async fn stats(c: Ctx) -> SpecResult {
    let id = c
        .sleeper_with("stats", |cfg| {
            cfg.command = vec![
                "sh".into(),
                "-c".into(),
                "i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; sleep 100000".into(),
            ];
            cfg.linux.get_or_insert_with(Default::default).resources =
                Some(cri::LinuxContainerResources {
                    memory_limit_in_bytes: 64 << 20,
                    ..Default::default()
                });
        })
        .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let Some(st) = c.stats(&id).await? else {
        fail!("no stats")
    };
    check!(
        st.attributes.as_ref().is_some_and(|a| a.id == id),
        "attributes {:?}",
        st.attributes
    );
    let cpu = st.cpu.unwrap_or_default();
    check!(cpu.timestamp > 0, "cpu timestamp {}", cpu.timestamp);
    check!(
        cpu.usage_core_nano_seconds.is_some_and(|v| v.value > 0),
        "cpu usage_core_nano_seconds {:?}",
        cpu.usage_core_nano_seconds
    );
    // A second look a while later has the rate over the time between (kubelet's summary).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let again = c.stats(&id).await?.and_then(|s| s.cpu);
    check!(
        again.as_ref().is_some_and(|c| c.usage_nano_cores.is_some()),
        "no usage_nano_cores at the second ContainerStats: {again:?}"
    );
    let mem = st.memory.unwrap_or_default();
    check!(mem.timestamp > 0, "memory timestamp {}", mem.timestamp);
    check!(
        mem.working_set_bytes.is_some_and(|v| v.value > 0),
        "memory working_set_bytes {:?}",
        mem.working_set_bytes
    );
    // What the container may still use before its limit (kubelet's summary
    // `availableBytes`), as containerd gives it: the limit less the working set.
    let (ws, avail) = (
        mem.working_set_bytes.map(|v| v.value),
        mem.available_bytes.map(|v| v.value),
    );
    check!(
        ws.zip(avail).is_some_and(|(w, a)| w + a == 64 << 20),
        "memory available_bytes {avail:?} with working set {ws:?}, want 64 MiB in all"
    );
    Ok(())
}

/// PSI (cgroup v2's cpu/memory/io.pressure) in ContainerStats, and the pod cgroup's in
/// PodSandboxStats, where the container's kernel (a VM pod's guest's: vessel's has PSI) keeps
/// it and its cgroups are v2, and not otherwise (nothing made up on a cgroup v1 node).
async fn stats_psi(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("psi").await?;
    let id = c.run(&pod, &pcfg, "psi", "sleep 100000").await?;
    // Whether the container's kernel (the host's, or a VM pod's guest's) keeps PSI and its
    // cgroups are v2, asked from inside it.
    let out = c
        .sh_ok(
            &id,
            "if test -e /sys/fs/cgroup/cgroup.controllers && test -r /proc/pressure/cpu; then echo yes; else echo no; fi",
        )
        .await?;
    let expected = out.trim() == "yes";
    let st = c.stats(&id).await?.unwrap_or_default();
    let ctr = [
        st.cpu.and_then(|u| u.psi),
        st.memory.and_then(|u| u.psi),
        st.io.and_then(|u| u.psi),
    ];
    let mut cl = c.c.clone();
    let ps = cl
        .runtime
        .pod_sandbox_stats(cri::PodSandboxStatsRequest {
            pod_sandbox_id: pod.clone(),
        })
        .await?
        .into_inner()
        .stats
        .and_then(|s| s.linux)
        .unwrap_or_default();
    let pod_psi = [
        ps.cpu.and_then(|u| u.psi),
        ps.memory.and_then(|u| u.psi),
        ps.io.and_then(|u| u.psi),
    ];
    for (whose, psi) in [("container", ctr), ("pod", pod_psi)] {
        if !expected {
            check!(
                psi.iter().all(Option::is_none),
                "{whose} PSI on a node without it: cpu, memory, io {psi:?}"
            );
            continue;
        }
        for (what, p) in ["cpu", "memory", "io"].iter().zip(&psi) {
            let Some(some) = p.as_ref().and_then(|p| p.some.as_ref()) else {
                fail!("no {whose} {what} PSI: {p:?}");
            };
            check!(
                [some.avg10, some.avg60, some.avg300]
                    .iter()
                    .all(|a| (0.0..=100.0).contains(a)),
                "{whose} {what} PSI averages out of 0..=100: {some:?}"
            );
        }
    }
    Ok(())
}

async fn list_stats(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("lstats").await?;
    let a = c.run(&pod, &pcfg, "a", "sleep 100000").await?;
    let b = c.run(&pod, &pcfg, "b", "sleep 100000").await?;
    let mut cl = c.c.clone();
    let ids = |r: cri::ListContainerStatsResponse| {
        let mut v: Vec<String> = r
            .stats
            .into_iter()
            .filter_map(|s| s.attributes.map(|a| a.id))
            .collect();
        v.sort();
        v
    };
    let got = ids(cl
        .runtime
        .list_container_stats(cri::ListContainerStatsRequest {
            filter: Some(cri::ContainerStatsFilter {
                id: a.clone(),
                ..Default::default()
            }),
        })
        .await?
        .into_inner());
    check!(got == vec![a.clone()], "by id: {got:?}");
    let got = ids(cl
        .runtime
        .list_container_stats(cri::ListContainerStatsRequest {
            filter: Some(cri::ContainerStatsFilter {
                pod_sandbox_id: pod,
                ..Default::default()
            }),
        })
        .await?
        .into_inner());
    let mut want = vec![a, b];
    want.sort();
    check!(got == want, "by pod: {got:?}, want {want:?}");
    Ok(())
}

async fn shared_localhost(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("net").await?;
    c.run(&pod, &pcfg, "server", "mkdir -p /tmp/www && echo hello-from-server > /tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www").await?;
    let client = c.run(&pod, &pcfg, "client", "sleep 100000").await?;
    let mut last = String::new();
    for _ in 0..50 {
        let (code, out, err) = c.sh(&client, "wget -qO- http://127.0.0.1:8080/").await?;
        if code == 0 {
            check!(out == "hello-from-server\n", "body {out:?}");
            return Ok(());
        }
        last = err;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fail!(
        "wget to the other container on 127.0.0.1:8080 failed: {}",
        last.trim()
    )
}

async fn own_pid_ns(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("pid").await?;
    let a = c.run(&pod, &pcfg, "a", "sleep 100001").await?;
    let b = c.run(&pod, &pcfg, "b", "sleep 100002").await?;
    let pid1 = c.sh_ok(&a, "cat /proc/1/cmdline | tr '\\0' ' '").await?;
    check!(pid1 == "sleep 100001", "pid 1 of container a is {pid1:?}");
    let ps = c.sh_ok(&b, "ps").await?;
    check!(!ps.contains("100001"), "container b sees a's process: {ps}");
    Ok(())
}

/// 16 MiB of memory and no swap beyond it.
fn limit_16m(cfg: &mut cri::ContainerConfig) {
    cfg.linux.get_or_insert_with(Default::default).resources = Some(cri::LinuxContainerResources {
        memory_limit_in_bytes: 16 << 20,
        memory_swap_limit_in_bytes: 16 << 20,
        ..Default::default()
    });
}

async fn oom(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("oom").await?;
    let mut cfg = c.ctr_config("hog", "");
    cfg.command = vec!["tail".into(), "/dev/zero".into()];
    limit_16m(&mut cfg);
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    let s = c.wait_exit(&id).await?;
    check!(
        s.reason == "OOMKilled",
        "reason {:?} (exit code {}), want OOMKilled",
        s.reason,
        s.exit_code
    );
    check!(s.exit_code == 137, "exit code {}, want 137", s.exit_code);
    // A worker killed under a shell that then exits on its own: OOMKilled too, with the
    // shell's exit code, as containerd reports it.
    let mut cfg = c.ctr_config("worker", "tail /dev/zero; exit 3");
    limit_16m(&mut cfg);
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    let s = c.wait_exit(&id).await?;
    check!(
        s.reason == "OOMKilled" && s.exit_code == 3,
        "a shell whose worker was OOM-killed: reason {:?}, exit code {}; want OOMKilled, 3",
        s.reason,
        s.exit_code
    );
    Ok(())
}

// Mount propagation. The host side needs root on the runtime's host: a directory made a
// shared mount point, and a tmpfs mounted below it after the container started.

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

pub(super) fn mount(
    src: &str,
    target: &std::path::Path,
    fstype: &str,
    flags: libc::c_ulong,
) -> Result<(), Stop> {
    let c = |s: &str| std::ffi::CString::new(s).map_err(|e| Stop::Fail(e.to_string()));
    let src = c(src)?;
    let tgt = c(&target.display().to_string())?;
    let fs = c(fstype)?;
    // SAFETY: all pointers are valid NUL-terminated strings that outlive the call; data is null.
    let r = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            fs.as_ptr(),
            flags,
            std::ptr::null(),
        )
    };
    if r != 0 {
        fail!("mount {target:?}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// A host directory that is a shared mount point (bind-mounted onto itself).
fn shared_dir(c: &Ctx, name: &str) -> Result<std::path::PathBuf, Stop> {
    if !is_root() {
        skip!("needs root on the runtime's host to make host mounts");
    }
    let d = c.dir(name)?;
    let s = d.display().to_string();
    mount(&s, &d, "", libc::MS_BIND)?;
    c.track_host_mount(&d);
    mount("", &d, "", libc::MS_SHARED | libc::MS_REC)?;
    Ok(d)
}

async fn propagation(
    c: &Ctx,
    mode: cri::MountPropagation,
    privileged: bool,
) -> Result<(String, std::path::PathBuf), Stop> {
    let d = shared_dir(c, "prop")?;
    let (pod, pcfg) = c.run_pod_privileged("prop", privileged).await?;
    let mut cfg = c.ctr_config("sleeper", "sleep 100000");
    cfg.mounts = vec![cri::Mount {
        container_path: "/mnt/prop".into(),
        host_path: d.display().to_string(),
        propagation: mode as i32,
        ..Default::default()
    }];
    if privileged {
        Ctx::sec(&mut cfg).privileged = true;
    }
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    Ok((id, d))
}

async fn host_mount_later(c: &Ctx, d: &std::path::Path) -> Result<(), Stop> {
    let sub = d.join("sub");
    std::fs::create_dir_all(&sub).map_err(|e| Stop::Fail(e.to_string()))?;
    mount("tmpfs", &sub, "tmpfs", 0)?;
    c.track_host_mount(&sub);
    std::fs::write(sub.join("marker"), "on-tmpfs").map_err(|e| Stop::Fail(e.to_string()))?;
    Ok(())
}

async fn prop_private(c: Ctx) -> SpecResult {
    let (id, d) = propagation(&c, cri::MountPropagation::PropagationPrivate, false).await?;
    host_mount_later(&c, &d).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, out, _) = c
        .sh(&id, "cat /mnt/prop/sub/marker 2>/dev/null; true")
        .await?;
    if !out.trim().is_empty() {
        let (_, info, _) = c
            .sh(
                &id,
                "grep /mnt/prop /proc/1/mountinfo; echo ---; grep /mnt/prop /proc/self/mountinfo",
            )
            .await?;
        fail!("a host mount made after start is visible through a private mount: {info}");
    }
    Ok(())
}

async fn prop_rslave(c: Ctx) -> SpecResult {
    let (id, d) = propagation(&c, cri::MountPropagation::PropagationHostToContainer, false).await?;
    host_mount_later(&c, &d).await?;
    let mut out = String::new();
    for _ in 0..20 {
        out = c
            .sh(&id, "cat /mnt/prop/sub/marker 2>/dev/null; true")
            .await?
            .1;
        if out.trim() == "on-tmpfs" {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fail!(
        "a host mount made after start is not visible through a HostToContainer mount ({:?})",
        out.trim()
    )
}

async fn prop_bidirectional(c: Ctx) -> SpecResult {
    let (id, d) = propagation(&c, cri::MountPropagation::PropagationBidirectional, true).await?;
    c.track_host_mount(&d.join("fromctr"));
    c.sh_ok(&id, "mkdir -p /mnt/prop/fromctr && mount -t tmpfs tmpfs /mnt/prop/fromctr && echo x > /mnt/prop/fromctr/f").await?;
    let want = d.join("fromctr").display().to_string();
    for _ in 0..20 {
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        if info
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(want.as_str()))
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fail!("a mount made in the container under a Bidirectional mount did not reach the host")
}
