//! Volumes: host directories as a pod's containers see them. For VM pods these are shared
//! into the guest (virtio-fs), so each spec checks that data crosses both ways, at once, and
//! outlives the pod.

use super::{spec, Ctx, Spec, SpecResult, Stop};
use crate::{check, fail};
use std::path::Path;
use std::time::{Duration, Instant};
use tonic::Code;
use vessel_cri_api::v1 as cri;

pub(super) fn specs() -> Vec<Spec> {
    vec![
        spec!("volume", "a 50 MB write with fsync is on the host while the container runs and after the pod is gone", big_write),
        spec!("volume", "two containers of a pod share a host directory", shared_between_containers),
        spec!("volume", "a host path that is not there is made, a directory, as containerd makes it", missing_source_made),
        spec!("volume", "containers in the pod's IPC namespace share its /dev/shm; one with its own IPC namespace has its own", shared_shm),
        spec!("volume", "programs on a host-path volume run: a script, a static binary, one the container wrote", programs_run_from_a_volume),
        spec!("volume", "a ConfigMap-style symlink swap on the host is seen by the container within 3 s", configmap_swap),
        spec!("volume", "a socket as a host path: bound into a flat pod, InvalidArgument for a VM pod", socket_source),
        spec!("volume", "a write without CAP_FSETID clears a host file's setuid and setgid bits, root's keeps them", write_kills_suid),
    ]
}

fn io(what: &str) -> impl Fn(std::io::Error) -> Stop + '_ {
    move |e| Stop::Fail(format!("{what}: {e}"))
}

fn vol(path: &Path, at: &str) -> cri::Mount {
    cri::Mount {
        container_path: at.into(),
        host_path: path.display().to_string(),
        ..Default::default()
    }
}

/// The sha256 of a host file, as `sha256sum` prints it.
fn sha256_of(path: &Path) -> Result<String, Stop> {
    let out = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .map_err(io("sha256sum"))?;
    let s = String::from_utf8_lossy(&out.stdout);
    Ok(s.split_whitespace().next().unwrap_or_default().to_string())
}

async fn big_write(c: Ctx) -> SpecResult {
    let d = c.dir("big")?;
    let (pod, pcfg) = c.run_pod("big").await?;
    let mut cfg = c.ctr_config("writer", "sleep 100000");
    cfg.mounts = vec![vol(&d, "/mnt/v")];
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    // 50 MiB of a counting pattern (no two 1 MiB blocks alike), fsynced, summed in the
    // container; the host must read the same bytes while the container still runs.
    let script = "i=0; while [ $i -lt 50 ]; do head -c 1048568 /dev/zero | tr '\\0' x; printf '%08d' $i; i=$((i+1)); done | dd of=/mnt/v/big bs=1M conv=fsync 2>/dev/null && sha256sum /mnt/v/big";
    let r = c
        .exec(&id, &["sh", "-c", script], 300)
        .await
        .map_err(|e| Stop::Fail(format!("ExecSync: {:?}: {}", e.code(), e.message())))?;
    let out = String::from_utf8_lossy(&r.stdout);
    check!(
        r.exit_code == 0,
        "writing 50 MiB exited {}: {:?} {:?}",
        r.exit_code,
        out.trim(),
        String::from_utf8_lossy(&r.stderr).trim()
    );
    let in_ctr = out
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    let len = std::fs::metadata(d.join("big"))
        .map_err(io("host file"))?
        .len();
    check!(
        len == 50 << 20,
        "the host sees {len} bytes, want {}",
        50u64 << 20
    );
    let on_host = sha256_of(&d.join("big"))?;
    check!(
        on_host == in_ctr,
        "sha256 on the host {on_host}, in the container {in_ctr}"
    );
    c.c.stop_and_remove_pod(&pod).await?;
    let after = sha256_of(&d.join("big"))?;
    check!(
        after == in_ctr,
        "after the pod is removed the host file's sha256 is {after:?}"
    );
    Ok(())
}

async fn shared_between_containers(c: Ctx) -> SpecResult {
    let d = c.dir("empty")?;
    let (pod, pcfg) = c.run_pod("share").await?;
    let mut ids = Vec::new();
    for name in ["one", "two"] {
        let mut cfg = c.ctr_config(name, "sleep 100000");
        cfg.mounts = vec![vol(&d, "/cache")];
        ids.push(c.run_cfg(&pod, &pcfg, cfg).await?);
    }
    c.sh_ok(&ids[0], "echo from-one > /cache/note").await?;
    let got = c.sh_ok(&ids[1], "cat /cache/note").await?;
    check!(got == "from-one", "the second container reads {got:?}");
    c.sh_ok(&ids[1], "rm /cache/note && mkdir /cache/sub")
        .await?;
    let got = c.sh_ok(&ids[0], "ls -A /cache").await?;
    check!(
        got == "sub",
        "the first container lists {got:?} after the second's changes"
    );
    check!(
        d.join("sub").is_dir() && !d.join("note").exists(),
        "the host directory does not show the containers' changes"
    );
    Ok(())
}

/// kubelet's hostPath volume without a `type` (the default) checks and makes nothing: the
/// runtime makes a missing host path, a directory, as containerd and CRI-O do.
async fn missing_source_made(c: Ctx) -> SpecResult {
    let d = c.dir("made")?;
    let missing = d.join("not/there");
    let (pod, pcfg) = c.run_pod("made").await?;
    let mut cfg = c.ctr_config("one", "sleep 100000");
    cfg.mounts = vec![vol(&missing, "/data")];
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    c.sh_ok(&id, "echo hi > /data/note").await?;
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(&missing).map_err(io("the made host path"))?;
    check!(
        m.is_dir() && m.uid() == 0,
        "the made host path: directory {}, owner {}",
        m.is_dir(),
        m.uid()
    );
    let got = std::fs::read_to_string(missing.join("note")).map_err(io("the note"))?;
    check!(got == "hi\n", "the host reads {got:?}");
    Ok(())
}

/// POSIX shared memory between a pod's containers (a sidecar reading what the app put in
/// /dev/shm), as kubelet's pods have it with containerd and CRI-O: the containers that
/// share the pod's IPC namespace (kubelet's NamespaceOption, ipc POD) share one /dev/shm, a
/// tmpfs, writable by any user; a container with an IPC namespace of its own has its own.
async fn shared_shm(c: Ctx) -> SpecResult {
    let mut pcfg = c.pod_config("shm");
    pcfg.linux
        .get_or_insert_with(Default::default)
        .security_context
        .get_or_insert_with(Default::default)
        .namespace_options = Some(cri::NamespaceOption::default());
    let pod = c.run_pod_with(&pcfg).await?;
    let mut ids = Vec::new();
    for name in ["app", "sidecar"] {
        let mut cfg = c.ctr_config(name, "sleep 100000");
        Ctx::sec(&mut cfg).namespace_options = Some(cri::NamespaceOption::default());
        ids.push(c.run_cfg(&pod, &pcfg, cfg).await?);
    }
    let mut cfg = c.ctr_config("own-ipc", "sleep 100000");
    Ctx::sec(&mut cfg).namespace_options = Some(cri::NamespaceOption {
        ipc: cri::NamespaceMode::Container as i32,
        ..Default::default()
    });
    let own = c.run_cfg(&pod, &pcfg, cfg).await?;
    c.sh_ok(&ids[0], "echo from-app > /dev/shm/segment").await?;
    let got = c.sh_ok(&ids[1], "cat /dev/shm/segment").await?;
    check!(got == "from-app", "the sidecar reads {got:?} from /dev/shm");
    let got = c
        .sh_ok(&ids[1], "stat -f -c %T /dev/shm; stat -c %a /dev/shm")
        .await?;
    check!(got == "tmpfs\n1777", "the pod's /dev/shm: {got:?}");
    let (code, _, _) = c.sh(&own, "test -e /dev/shm/segment").await?;
    check!(
        code != 0,
        "a container with its own IPC namespace sees the pod's /dev/shm"
    );
    let got = c.sh_ok(&own, "stat -f -c %T /dev/shm").await?;
    check!(got == "tmpfs", "its own /dev/shm: {got:?}");
    Ok(())
}

/// What an init container that copies a tool into an emptyDir for the main container does:
/// programs on a volume run (a script and a static binary from the host, one the container
/// copied there).
async fn programs_run_from_a_volume(c: Ctx) -> SpecResult {
    let d = c.dir("bin")?;
    let script = d.join("hello.sh");
    std::fs::write(&script, "#!/bin/sh\necho hello from a volume\n").map_err(io("writing"))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))
        .map_err(io("chmod"))?;
    let (pod, pcfg) = c.run_pod("volbin").await?;
    let mut cfg = c.ctr_config("runner", "sleep 100000");
    cfg.mounts = vec![vol(&d, "/vol")];
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    let got = c.sh_ok(&id, "/vol/hello.sh").await?;
    check!(got == "hello from a volume", "the script printed {got:?}");
    // A container's own command may be on the volume, found through the PATH it sets (an
    // init container's tools in an emptyDir): not in the image, but it runs.
    let mut tool = c.ctr_config("tool", "");
    tool.command = vec!["hello.sh".into()];
    tool.args.clear();
    tool.envs.push(cri::KeyValue {
        key: "PATH".into(),
        value: "/vol:/usr/bin:/bin".into(),
    });
    tool.mounts = vec![vol(&d, "/vol")];
    let tool = c.run_cfg(&pod, &pcfg, tool).await?;
    let st = c.wait_exit(&tool).await?;
    check!(
        st.exit_code == 0,
        "a command from the volume through PATH exited {}: {} {}",
        st.exit_code,
        st.reason,
        st.message
    );
    // busybox is static: a copy of it on the volume is a static ELF binary.
    c.sh_ok(
        &id,
        "cp /bin/busybox /vol/busybox && chmod 755 /vol/busybox",
    )
    .await?;
    let (code, out, err) = c.sh(&id, "/vol/busybox echo static-ok").await?;
    if !(code == 0 && out.trim() == "static-ok") {
        // Is it the exec, or the file? The same bytes copied off the volume.
        let (_, copy, copy_err) = c
            .sh(
                &id,
                "mkdir -p /tmp/copy && cp /vol/busybox /tmp/copy/busybox && /tmp/copy/busybox echo copy-ok",
            )
            .await?;
        fail!(
            "a static binary the container put on the volume: exit {code}, stdout {out:?}, stderr {err:?}; its copy off the volume: {copy:?} {copy_err:?}"
        );
    }
    if let Some(probe) = c.env.vsock_probe.clone() {
        std::fs::copy(&probe, d.join("probe")).map_err(io("copying the probe"))?;
        let (code, _, err) = c.sh(&id, "/vol/probe").await?;
        check!(
            code == 2 && err.contains("usage"),
            "a static binary from the host on the volume: exit {code}, stderr {err:?}"
        );
    }
    Ok(())
}

/// kubelet's atomic writer: the data lives in a timestamped directory, `..data` links to it,
/// each key links through `..data`, and an update renames a new `..data` link over the old.
fn configmap_version(d: &Path, version: &str, value: &str) -> Result<(), Stop> {
    let dir = d.join(format!("..{version}"));
    std::fs::create_dir_all(&dir).map_err(io("mkdir"))?;
    std::fs::write(dir.join("key"), value).map_err(io("write"))?;
    let tmp = d.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(format!("..{version}"), &tmp).map_err(io("symlink"))?;
    std::fs::rename(&tmp, d.join("..data")).map_err(io("rename"))?;
    if std::fs::symlink_metadata(d.join("key")).is_err() {
        std::os::unix::fs::symlink("..data/key", d.join("key")).map_err(io("symlink"))?;
    }
    Ok(())
}

async fn configmap_swap(c: Ctx) -> SpecResult {
    let d = c.dir("cm")?;
    configmap_version(&d, "v1", "one")?;
    let id = c
        .sleeper_with("cm", |cfg| {
            let mut m = vol(&d, "/etc/config");
            m.readonly = true;
            cfg.mounts = vec![m];
        })
        .await?;
    let got = c.sh_ok(&id, "cat /etc/config/key").await?;
    check!(
        got == "one",
        "the container reads {got:?} before the update"
    );
    configmap_version(&d, "v2", "two")?;
    let start = Instant::now();
    let mut got = String::new();
    // The guest caches entries and attributes for 1 s; execs in the nested harness are slow.
    while start.elapsed() < Duration::from_secs(3) {
        got = c.sh_ok(&id, "cat /etc/config/key").await?;
        if got == "two" {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fail!("3 s after the host's swap the container still reads {got:?}")
}

async fn socket_source(c: Ctx) -> SpecResult {
    let d = c.dir("sock")?;
    let path = d.join("s.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&path).map_err(io("bind"))?;
    let (pod, pcfg) = c.run_pod("sock").await?;
    let mut cfg = c.ctr_config("sock", "sleep 100000");
    cfg.mounts = vec![vol(&path, "/run/s.sock")];
    let created = c.c.create_container(&pod, &pcfg, cfg).await;
    match (c.env.vm_pods, created) {
        (false, Ok(id)) => {
            c.start(&id).await?;
            c.sh_ok(&id, "test -S /run/s.sock").await?;
            Ok(())
        }
        (true, Err(e)) if e.code() == Code::InvalidArgument => {
            check!(
                e.message().contains("socket"),
                "the error does not say why: {}",
                e.message()
            );
            Ok(())
        }
        (vm, r) => fail!(
            "CreateContainer with a socket mount (VM pod: {vm}): {:?}",
            r.map_err(|e| (e.code(), e.message().to_string()))
        ),
    }
}

/// What Linux does on a local write (and virtio-fs must do for the guest's writes to host
/// files): a writer without CAP_FSETID loses the file its setuid and setgid bits, a writer
/// with it (a root container's default capabilities) keeps them.
async fn write_kills_suid(c: Ctx) -> SpecResult {
    use std::os::unix::fs::PermissionsExt;
    let d = c.dir("suid")?;
    for f in ["user", "root"] {
        std::fs::write(d.join(f), "x\n").map_err(io("host file"))?;
        std::fs::set_permissions(d.join(f), std::fs::Permissions::from_mode(0o6777))
            .map_err(io("chmod"))?;
    }
    let (pod, pcfg) = c.run_pod("suid").await?;
    let mut cfg = c.ctr_config("user", "sleep 100000");
    cfg.mounts = vec![vol(&d, "/mnt/v")];
    Ctx::sec(&mut cfg).run_as_user = Some(cri::Int64Value { value: 1000 });
    let user = c.run_cfg(&pod, &pcfg, cfg).await?;
    let mut cfg = c.ctr_config("root", "sleep 100000");
    cfg.mounts = vec![vol(&d, "/mnt/v")];
    let root = c.run_cfg(&pod, &pcfg, cfg).await?;
    c.sh_ok(&user, "echo y >> /mnt/v/user").await?;
    c.sh_ok(&root, "echo y >> /mnt/v/root").await?;
    let mode = |f: &str| -> Result<u32, Stop> {
        Ok(std::fs::metadata(d.join(f))
            .map_err(io("host file"))?
            .permissions()
            .mode()
            & 0o7777)
    };
    let (u, r) = (mode("user")?, mode("root")?);
    check!(
        u == 0o777,
        "after uid 1000's write the host file's mode is {u:o}, want 777"
    );
    check!(
        r == 0o6777,
        "after root's write the host file's mode is {r:o}, want 6777"
    );
    let got = std::fs::read_to_string(d.join("user")).map_err(io("host file"))?;
    check!(got == "x\ny\n", "the host file holds {got:?}");
    Ok(())
}
