//! Security context: users and groups, read-only rootfs, privileged and capabilities,
//! masked and read-only paths, no-new-privs, seccomp, namespaces, sysctls.

use super::network::{node_ns_pod, same_ns_as_host};
use super::{spec, Ctx, Spec, SpecResult, Stop};
use crate::{check, fail};
use std::collections::HashMap;
use vessel_cri_api::v1 as cri;

const CAP_CHOWN: u32 = 0;
const CAP_SYS_ADMIN: u32 = 21;

pub(super) fn specs() -> Vec<Spec> {
    vec![
        spec!("security", "run_as_user, run_as_group and supplemental groups", users),
        spec!("security", "run_as_username resolves in the image's /etc/passwd", username),
        spec!("security", "the image's User applies when the pod sets none", image_user),
        spec!("security", "readonly_rootfs makes / read-only", readonly_rootfs),
        spec!("security", "a default container lacks CAP_SYS_ADMIN", default_caps),
        spec!("security", "privileged: every capability, mount works and the host's devices are there; refused in a pod that is not privileged", privileged),
        spec!("security", "privileged with the host's /dev at /dev (a CSI node plugin's): the host's nodes, live, its own ptys and termination log, the host's /dev untouched; refused in a VM pod", host_dev),
        spec!("security", "dropping CAP_CHOWN makes chown fail", drop_chown),
        spec!("security", "adding CAP_SYS_ADMIN shows in CapEff", add_sys_admin),
        spec!("security", "masked paths read empty", masked_paths),
        spec!("security", "read-only paths cannot be written", readonly_paths),
        spec!("security", "no_new_privs sets NoNewPrivs", no_new_privs),
        spec!("security", "seccomp RuntimeDefault filters, Unconfined does not", seccomp),
        spec!("security", "seccomp RuntimeDefault also filters exec'd processes", seccomp_exec),
        spec!("security", "seccomp RuntimeDefault is an allow-list: no namespaces without CAP_SYS_ADMIN", seccomp_allow_list),
        spec!("security", "no container opens an AF_VSOCK socket under RuntimeDefault, nor in a VM pod at all", seccomp_vsock),
        spec!("security", "pid namespace POD: containers see each other's processes", pid_pod),
        spec!("security", "pid namespace POD with CAP_SYS_PTRACE: PID 1 is a holder with an empty root, uid 65535 and no capability (a flat pod), or its guest's (a VM pod)", pid_pod_ptrace),
        spec!("security", "pid namespace NODE: the host's pid namespace", pid_node,
            vm = "a VM pod's processes run under the guest kernel; the host's pid namespace is out of reach"),
        spec!("security", "ipc namespace is shared by the pod's containers", ipc_pod),
        spec!("security", "ipc namespace NODE: the host's ipc namespace", ipc_node,
            vm = "a VM pod's IPC objects live in the guest kernel"),
        spec!("security", "pod sysctl kernel.shm_rmid_forced (ipc namespace) is applied", sysctl_ipc),
        spec!("security", "pod sysctl net.ipv4.ip_local_port_range (network namespace) is applied", sysctl_net),
    ]
}

async fn status_field(c: &Ctx, id: &str, field: &str) -> Result<String, Stop> {
    let s = c.sh_ok(id, "cat /proc/self/status").await?;
    match s.lines().find_map(|l| l.strip_prefix(&format!("{field}:"))) {
        Some(v) => Ok(v.trim().to_string()),
        None => fail!("no {field} in /proc/self/status"),
    }
}

async fn cap_eff(c: &Ctx, id: &str) -> Result<u64, Stop> {
    let v = status_field(c, id, "CapEff").await?;
    u64::from_str_radix(&v, 16).map_err(|e| Stop::Fail(format!("CapEff {v:?}: {e}")))
}

async fn users(c: Ctx) -> SpecResult {
    let id = c
        .sleeper_with("users", |cfg| {
            let s = Ctx::sec(cfg);
            s.run_as_user = Some(cri::Int64Value { value: 1234 });
            s.run_as_group = Some(cri::Int64Value { value: 5678 });
            s.supplemental_groups = vec![1111, 2222];
        })
        .await?;
    let got = c.sh_ok(&id, "echo $(id -u) $(id -g)").await?;
    check!(got == "1234 5678", "id -u, -g: {got:?}, want 1234 5678");
    let groups = c.sh_ok(&id, "id -G").await?;
    let groups: Vec<&str> = groups.split_whitespace().collect();
    check!(
        groups.contains(&"1111") && groups.contains(&"2222"),
        "id -G {groups:?} lacks 1111 and 2222"
    );
    Ok(())
}

async fn username(c: Ctx) -> SpecResult {
    let id = c
        .sleeper_with("username", |cfg| {
            Ctx::sec(cfg).run_as_username = "vessel".into()
        })
        .await?;
    let got = c.sh_ok(&id, "id -u").await?;
    check!(
        got == "1000",
        "uid {got:?} for run_as_username vessel, want 1000"
    );
    Ok(())
}

async fn image_user(c: Ctx) -> SpecResult {
    let img = c.env.images.user_uid.clone();
    let id = c
        .sleeper_with("imguser", |cfg| cfg.image = super::ctx::spec(&img))
        .await?;
    let got = c.sh_ok(&id, "id -u").await?;
    check!(got == "1000", "uid {got:?} in an image with User 1000");
    Ok(())
}

async fn readonly_rootfs(c: Ctx) -> SpecResult {
    let id = c
        .sleeper_with("rorootfs", |cfg| Ctx::sec(cfg).readonly_rootfs = true)
        .await?;
    let (code, _, _) = c.sh(&id, "touch /newfile").await?;
    check!(code != 0, "touch /newfile succeeded on a read-only rootfs");
    Ok(())
}

async fn default_caps(c: Ctx) -> SpecResult {
    let id = c.sleeper_with("caps", |_| {}).await?;
    let eff = cap_eff(&c, &id).await?;
    check!(
        eff & (1 << CAP_SYS_ADMIN) == 0,
        "CapEff {eff:#x} has CAP_SYS_ADMIN"
    );
    check!(
        eff & (1 << CAP_CHOWN) != 0,
        "CapEff {eff:#x} lacks CAP_CHOWN"
    );
    Ok(())
}

async fn privileged(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod_privileged("priv", true).await?;
    let mut cfg = c.ctr_config("priv", "sleep 100000");
    Ctx::sec(&mut cfg).privileged = true;
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    let eff = cap_eff(&c, &id).await?;
    check!(
        eff & (1 << CAP_SYS_ADMIN) != 0 && eff.count_ones() >= 38,
        "CapEff {eff:#x} of a privileged container"
    );
    c.sh_ok(
        &id,
        "mkdir -p /tmp/m && mount -t tmpfs tmpfs /tmp/m && umount /tmp/m",
    )
    .await?;
    // A flat pod's privileged container sees the host's device nodes (a VM pod's, its
    // guest's): one that only the host has, by its numbers.
    if !c.env.vm_pods {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let host_only = ["/dev/fuse", "/dev/loop-control", "/dev/kvm", "/dev/net/tun"]
            .into_iter()
            .find_map(|p| {
                let m = std::fs::metadata(p).ok()?;
                m.file_type().is_char_device().then(|| (p, m.rdev()))
            });
        if let Some((path, rdev)) = host_only {
            let got = c.sh_ok(&id, &format!("stat -c '%t:%T' {path}")).await?;
            let want = format!("{:x}:{:x}", libc::major(rdev), libc::minor(rdev));
            check!(
                got == want,
                "{path} in the privileged container: {got:?}, want {want}"
            );
        }
    }
    // Not in a pod that is not privileged (kubelet never asks; containerd refuses too).
    let (plain, plain_cfg) = c.run_pod("unpriv").await?;
    let mut cfg = c.ctr_config("priv", "sleep 100000");
    Ctx::sec(&mut cfg).privileged = true;
    let e = c.c.create_container(&plain, &plain_cfg, cfg).await.err();
    check!(
        e.as_ref().map(|e| e.code()) == Some(tonic::Code::InvalidArgument),
        "a privileged container in an unprivileged pod: {e:?}"
    );
    Ok(())
}

/// What CSI node plugins and device operators run: a privileged container with the host's
/// /dev at /dev, and kubelet's termination log below it. It sees the host's nodes, also one
/// made after it started; keeps its own ptys (its console, `exec -t`) and writes its
/// termination log. The host's /dev keeps its entries (but for the termination log's mount
/// point, which runc makes there too), its /dev/ptmx and its mounts. A VM pod's guest has
/// its own devices: refused there (a privileged pod, as this one, runs flat by policy).
async fn host_dev(c: Ctx) -> SpecResult {
    use std::os::unix::fs::FileTypeExt;
    let io = |e: std::io::Error| Stop::Fail(e.to_string());
    let (pod, pcfg) = c.run_pod_privileged("hostdev", true).await?;
    let log = c.dir("hostdev")?.join("termination-log");
    std::fs::write(&log, "").map_err(io)?;
    let mut cfg = c.ctr_config("csi", "sleep 100000");
    Ctx::sec(&mut cfg).privileged = true;
    cfg.tty = true;
    cfg.mounts = vec![
        cri::Mount {
            container_path: "/dev".into(),
            host_path: "/dev".into(),
            propagation: cri::MountPropagation::PropagationHostToContainer as i32,
            ..Default::default()
        },
        cri::Mount {
            container_path: "/dev/termination-log".into(),
            host_path: log.display().to_string(),
            ..Default::default()
        },
    ];
    if c.env.vm_pods {
        // A privileged pod runs flat by policy (that is where CSI node plugins run); a VM
        // pod's containers cannot have the host's /dev.
        c.ensure_image(&c.env.images.busybox).await?;
        let (vm_pod, vm_cfg) = c.run_pod("hostdev-vm").await?;
        let mut plain = cfg.clone();
        Ctx::sec(&mut plain).privileged = false;
        let e = c.c.create_container(&vm_pod, &vm_cfg, plain).await.err();
        check!(
            e.as_ref().map(|e| e.code()) == Some(tonic::Code::InvalidArgument)
                && e.as_ref().is_some_and(|e| e.message().contains("/dev")),
            "the host's /dev in a VM pod: {e:?}"
        );
    }
    let entries = || -> Result<Vec<String>, Stop> {
        let mut v: Vec<String> = std::fs::read_dir("/dev")
            .map_err(io)?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n != "termination-log")
            .collect();
        v.sort();
        Ok(v)
    };
    // The host's mounts at and below /dev: mount point, type, source, options.
    let mounts = || -> Result<Vec<String>, Stop> {
        let mi = std::fs::read_to_string("/proc/self/mountinfo").map_err(io)?;
        Ok(mi
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                let point = *f.get(4)?;
                let tail = l.split(" - ").nth(1)?;
                (point == "/dev" || point.starts_with("/dev/")).then(|| format!("{point} {tail}"))
            })
            .collect())
    };
    let (entries_before, mounts_before) = (entries()?, mounts()?);
    // Its mount point, made in the host's /dev as runc makes it, unless an earlier
    // container made it: removed at the end if this one did.
    let term_log = std::path::Path::new("/dev/termination-log");
    let _made_log = RemoveOnDrop((!term_log.exists()).then_some(term_log));
    // HostToContainer needs the host's /dev shared or a slave, as containerd requires (a
    // systemd host's is shared). Where it is private (this CI's hosts), the container is
    // refused, naming the mount; the spec then makes /dev shared for its own run.
    let _dev_private = if dev_is_private()? {
        let e = c.c.create_container(&pod, &pcfg, cfg.clone()).await.err();
        check!(
            e.as_ref().map(|e| e.code()) == Some(tonic::Code::FailedPrecondition)
                && e.as_ref().is_some_and(|e| e.message().contains("\"/dev\"")),
            "HostToContainer of the host's private /dev: {e:?}"
        );
        super::container::mount("", std::path::Path::new("/dev"), "", libc::MS_SHARED)?;
        Some(PrivateOnDrop("/dev"))
    } else {
        None
    };
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    check!(term_log.is_file(), "no {term_log:?} mount point was made");
    let (entries_after, mounts_after) = (entries()?, mounts()?);
    check!(
        entries_after == entries_before,
        "the host's /dev changed: {entries_before:?} -> {entries_after:?}"
    );
    check!(
        mounts_after == mounts_before,
        "the host's mounts below /dev changed: {mounts_before:?} -> {mounts_after:?}"
    );
    let ptmx = std::fs::symlink_metadata("/dev/ptmx").map_err(io)?;
    check!(
        ptmx.file_type().is_char_device(),
        "the host's /dev/ptmx is no longer a device"
    );
    // A node the host makes now shows in the container (the bind is live).
    let marker = format!("/dev/vessel-critest-{}", c.id);
    std::fs::write(&marker, "").map_err(io)?;
    let seen = c.sh(&id, &format!("test -e {marker}")).await;
    let _ = std::fs::remove_file(&marker);
    let (code, _, _) = seen?;
    check!(
        code == 0,
        "{marker}, made on the host, is not in the container"
    );
    // Its own devpts (the runtime's options, not the host's), its console a pty of it.
    c.sh_ok(
        &id,
        "test -c /dev/null && echo hi > /dev/null && grep -q ' /dev/pts .*ptmxmode=666' /proc/self/mountinfo && test \"$(stat -c %t /dev/console)\" = 88 && echo bye > /dev/termination-log",
    )
    .await?;
    let written = std::fs::read_to_string(&log).map_err(io)?;
    check!(
        written == "bye\n",
        "the termination log on the host has {written:?}"
    );
    let o = crate::stream_client::ExecOptions {
        stdout: true,
        tty: true,
        ..Default::default()
    };
    let r = super::streaming::run(&c, &id, &["sh", "-c", "test -t 1 && echo is-a-tty"], o).await?;
    check!(
        r.stdout_str().contains("is-a-tty\r\n") && r.exit_code() == Some(0),
        "exec -t in the container: {:?}, {:?}",
        r.stdout_str(),
        r.error
    );
    for (readonly, propagation) in [
        (true, cri::MountPropagation::PropagationBidirectional),
        (false, cri::MountPropagation::PropagationHostToContainer),
    ] {
        fake_dev(&c, &pod, &pcfg, readonly, propagation).await?;
    }
    c.c.stop_and_remove_pod(&pod).await?;
    Ok(())
}

/// Removes a file this spec made on the host when the spec ends, whichever way.
struct RemoveOnDrop(Option<&'static std::path::Path>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Whether the host's /dev is a private mount (neither shared nor a slave).
fn dev_is_private() -> Result<bool, Stop> {
    let mi =
        std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| Stop::Fail(e.to_string()))?;
    let dev = mi.lines().rev().find_map(|l| {
        let (head, _) = l.split_once(" - ")?;
        let f: Vec<&str> = head.split(' ').collect();
        (f.get(4) == Some(&"/dev")).then(|| f.get(6..).unwrap_or_default().to_vec())
    });
    Ok(dev.is_some_and(|opt| {
        !opt.iter()
            .any(|o| o.starts_with("shared:") || o.starts_with("master:"))
    }))
}

/// Makes a mount point private again (not recursively) when the spec ends, whichever way.
struct PrivateOnDrop(&'static str);

impl Drop for PrivateOnDrop {
    fn drop(&mut self) {
        let _ = super::container::mount("", std::path::Path::new(self.0), "", libc::MS_PRIVATE);
    }
}

/// [`host_dev`] with a /dev of the test's own: a nosuid tmpfs, a shared mount point
/// (systemd makes the host's /dev one; this host's is private), bound with `propagation`,
/// read-only or not. The container's ptys and termination log stay out of it (nothing
/// mounted on the host below it), it keeps its nosuid (and read-only flag), and the runtime
/// writes nothing in it.
async fn fake_dev(
    c: &Ctx,
    pod: &str,
    pcfg: &cri::PodSandboxConfig,
    readonly: bool,
    propagation: cri::MountPropagation,
) -> SpecResult {
    use super::container::mount;
    let io = |e: std::io::Error| Stop::Fail(e.to_string());
    let d = c.dir(&format!("fakedev-{}", propagation as i32))?;
    mount("tmpfs", &d, "tmpfs", libc::MS_NOSUID)?;
    c.track_host_mount(&d);
    mount("", &d, "", libc::MS_SHARED | libc::MS_REC)?;
    let null = std::ffi::CString::new(d.join("null").as_os_str().as_encoded_bytes())
        .map_err(|e| Stop::Fail(e.to_string()))?;
    // SAFETY: mknod(2) with a valid NUL-terminated path; it writes nothing of ours.
    if unsafe { libc::mknod(null.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) } != 0 {
        fail!("mknod {null:?}: {}", std::io::Error::last_os_error());
    }
    for sub in ["pts", "shm", "mqueue"] {
        std::fs::create_dir(d.join(sub)).map_err(io)?;
    }
    for file in ["ptmx", "termination-log"] {
        std::fs::write(d.join(file), "").map_err(io)?;
    }
    let listing = || -> Result<Vec<String>, Stop> {
        let mut v: Vec<String> = std::fs::read_dir(&d)
            .map_err(io)?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        Ok(v)
    };
    let before = listing()?;
    let below = || -> Result<Vec<String>, Stop> {
        let mi = std::fs::read_to_string("/proc/self/mountinfo").map_err(io)?;
        Ok(mi
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|p| std::path::Path::new(p).starts_with(&d) && std::path::Path::new(p) != d)
            .map(str::to_string)
            .collect())
    };
    let log = c
        .dir(&format!("fakedev-log-{}", propagation as i32))?
        .join("termination-log");
    std::fs::write(&log, "").map_err(io)?;
    let name = format!("fakedev-{}", propagation as i32);
    let mut cfg = c.ctr_config(&name, "sleep 100000");
    Ctx::sec(&mut cfg).privileged = true;
    cfg.mounts = vec![
        cri::Mount {
            container_path: "/dev".into(),
            host_path: d.display().to_string(),
            readonly,
            propagation: propagation as i32,
            ..Default::default()
        },
        cri::Mount {
            container_path: "/dev/termination-log".into(),
            host_path: log.display().to_string(),
            ..Default::default()
        },
    ];
    let id = c.run_cfg(pod, pcfg, cfg).await?;
    let got = below()?;
    check!(got.is_empty(), "mounts on the host below its /dev: {got:?}");
    let flags = if readonly { "ro,nosuid" } else { "rw,nosuid" };
    let write = if readonly { "!" } else { "" };
    c.sh_ok(
        &id,
        &format!("test -c /dev/null && {write} touch /dev/x 2>/dev/null && rm -f /dev/x && awk '$5==\"/dev\"{{o=$6}} END{{print o}}' /proc/self/mountinfo | grep -q '^{flags}' && grep -q ' /dev/pts .*ptmxmode=666' /proc/self/mountinfo && echo bye > /dev/termination-log"),
    )
    .await?;
    check!(
        std::fs::read_to_string(&log).map_err(io)? == "bye\n",
        "the termination log was not written"
    );
    let after = listing()?;
    check!(after == before, "its /dev changed: {before:?} -> {after:?}");
    Ok(())
}

async fn drop_chown(c: Ctx) -> SpecResult {
    let id = c
        .sleeper_with("nochown", |cfg| {
            Ctx::sec(cfg).capabilities = Some(cri::Capability {
                drop_capabilities: vec!["CHOWN".into()],
                ..Default::default()
            });
        })
        .await?;
    let eff = cap_eff(&c, &id).await?;
    check!(
        eff & (1 << CAP_CHOWN) == 0,
        "CapEff {eff:#x} still has CAP_CHOWN"
    );
    let (code, _, _) = c.sh(&id, "touch /tmp/f && chown 1:1 /tmp/f").await?;
    check!(code != 0, "chown succeeded without CAP_CHOWN");
    Ok(())
}

async fn add_sys_admin(c: Ctx) -> SpecResult {
    let id = c
        .sleeper_with("sysadmin", |cfg| {
            Ctx::sec(cfg).capabilities = Some(cri::Capability {
                add_capabilities: vec!["SYS_ADMIN".into()],
                ..Default::default()
            });
        })
        .await?;
    let eff = cap_eff(&c, &id).await?;
    check!(
        eff & (1 << CAP_SYS_ADMIN) != 0,
        "CapEff {eff:#x} lacks CAP_SYS_ADMIN"
    );
    Ok(())
}

async fn masked_paths(c: Ctx) -> SpecResult {
    let id = c
        .sleeper_with("masked", |cfg| {
            Ctx::sec(cfg).masked_paths = vec!["/proc/timer_list".into(), "/etc/group".into()];
        })
        .await?;
    for p in ["/proc/timer_list", "/etc/group"] {
        let (_, out, _) = c.sh(&id, &format!("cat {p} 2>/dev/null | wc -c")).await?;
        check!(out.trim() == "0", "masked {p} reads {} bytes", out.trim());
    }
    Ok(())
}

async fn readonly_paths(c: Ctx) -> SpecResult {
    let id = c
        .sleeper_with("ropaths", |cfg| {
            Ctx::sec(cfg).readonly_paths = vec!["/tmp".into()]
        })
        .await?;
    let (code, _, _) = c.sh(&id, "touch /tmp/x").await?;
    check!(code != 0, "writing under the read-only path /tmp succeeded");
    Ok(())
}

async fn no_new_privs(c: Ctx) -> SpecResult {
    let id = c
        .sleeper_with("nnp", |cfg| Ctx::sec(cfg).no_new_privs = true)
        .await?;
    let v = status_field(&c, &id, "NoNewPrivs").await?;
    check!(v == "1", "NoNewPrivs {v}, want 1");
    Ok(())
}

async fn seccomp(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("seccomp").await?;
    let mut cfg = c.ctr_config("default", "sleep 100000");
    with_seccomp(
        &mut cfg,
        cri::security_profile::ProfileType::RuntimeDefault,
        "",
    );
    let d = c.run_cfg(&pod, &pcfg, cfg).await?;
    let mut cfg = c.ctr_config("unconfined", "sleep 100000");
    with_seccomp(&mut cfg, cri::security_profile::ProfileType::Unconfined, "");
    let u = c.run_cfg(&pod, &pcfg, cfg).await?;
    // The container's own process (pid 1 of its pid namespace).
    let v = pid1_status_field(&c, &d, "Seccomp").await?;
    check!(v == "2", "Seccomp {v} with RuntimeDefault, want 2 (filter)");
    let v = pid1_status_field(&c, &u, "Seccomp").await?;
    check!(v == "0", "Seccomp {v} with Unconfined, want 0");
    Ok(())
}

async fn seccomp_exec(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("seccompx").await?;
    let mut cfg = c.ctr_config("default", "sleep 100000");
    with_seccomp(
        &mut cfg,
        cri::security_profile::ProfileType::RuntimeDefault,
        "",
    );
    let d = c.run_cfg(&pod, &pcfg, cfg).await?;
    let v = status_field(&c, &d, "Seccomp").await?;
    check!(
        v == "2",
        "an exec'd process has Seccomp {v} with RuntimeDefault, want 2 (filter)"
    );
    Ok(())
}

fn with_seccomp(
    cfg: &mut cri::ContainerConfig,
    t: cri::security_profile::ProfileType,
    localhost_ref: &str,
) {
    Ctx::sec(cfg).seccomp = Some(cri::SecurityProfile {
        profile_type: t as i32,
        localhost_ref: localhost_ref.into(),
    });
}

/// A user namespace needs no capability, so only an allow-list profile refuses one to a
/// container without CAP_SYS_ADMIN (containerd's and Docker's default profile do); fork, a
/// clone without namespace flags, must still work.
async fn seccomp_allow_list(c: Ctx) -> SpecResult {
    use cri::security_profile::ProfileType;
    let (pod, pcfg) = c.run_pod("seccompal").await?;
    let mut cfg = c.ctr_config("default", "sleep 100000");
    with_seccomp(&mut cfg, ProfileType::RuntimeDefault, "");
    let d = c.run_cfg(&pod, &pcfg, cfg).await?;
    let mut cfg = c.ctr_config("admin", "sleep 100000");
    with_seccomp(&mut cfg, ProfileType::RuntimeDefault, "");
    Ctx::sec(&mut cfg).capabilities = Some(cri::Capability {
        add_capabilities: vec!["CAP_SYS_ADMIN".into()],
        ..Default::default()
    });
    let a = c.run_cfg(&pod, &pcfg, cfg).await?;
    let u = c.run(&pod, &pcfg, "unconfined", "sleep 100000").await?;

    let forked = c.sh_ok(&d, "(echo forked) | cat; echo $(echo sub)").await?;
    check!(
        forked == "forked\nsub",
        "fork under RuntimeDefault: {forked:?}"
    );
    let (code, _, err) = c.sh(&d, "unshare -U true").await?;
    check!(
        code != 0 && err.contains("not permitted"),
        "unshare -U under RuntimeDefault without CAP_SYS_ADMIN: exit {code}, stderr {err:?}"
    );
    for (id, what) in [
        (&a, "RuntimeDefault with CAP_SYS_ADMIN"),
        (&u, "no profile"),
    ] {
        let (code, _, err) = c.sh(id, "unshare -U true").await?;
        check!(
            code == 0,
            "unshare -U with {what}: exit {code}, stderr {err:?}"
        );
    }
    Ok(())
}

/// Tries `socket(AF_VSOCK)` (then a connect to the host's log port, 1025) from inside a
/// container: RuntimeDefault refuses it everywhere, and in a VM pod a Localhost profile too
/// (vsock reaches the shim's log port on the host). An Unconfined container of a VM pod can
/// open one, but cannot write into another container's log: the shim takes only connections
/// that start with the pod's log token, which only the agent holds.
async fn seccomp_vsock(c: Ctx) -> SpecResult {
    use cri::security_profile::ProfileType;
    let Some(probe) = c.env.vsock_probe.clone() else {
        crate::skip!(
            "no vsock probe (vsock-echo on PATH; the VM harness stages it, critest_e2e builds it)"
        );
    };
    let d = c.dir("vsockp")?;
    let profile = d.join("allow-all.json");
    std::fs::write(&profile, r#"{"defaultAction":"SCMP_ACT_ALLOW"}"#)
        .map_err(|e| Stop::Fail(format!("writing {}: {e}", profile.display())))?;
    let (pod, pcfg) = c.run_pod("vsock").await?;
    let with_probe = |name: &str, script: &str, t: ProfileType, r: &str| {
        let mut cfg = c.ctr_config(name, script);
        with_seccomp(&mut cfg, t, r);
        cfg.mounts.push(cri::Mount {
            container_path: "/vsock-echo".into(),
            host_path: probe.display().to_string(),
            readonly: true,
            ..Default::default()
        });
        cfg
    };
    let mut refused = vec![(
        "runtime-default",
        ProfileType::RuntimeDefault,
        String::new(),
    )];
    if c.env.vm_pods {
        refused.push((
            "localhost",
            ProfileType::Localhost,
            profile.display().to_string(),
        ));
    }
    for (name, t, r) in refused {
        let id = c
            .run_cfg(&pod, &pcfg, with_probe(name, "sleep 100000", t, &r))
            .await?;
        // Run from the container's own filesystem: what is tried here is vsock, not running
        // programs from a volume (a volume spec does that).
        let (code, out, err) = c
            .sh(
                &id,
                "cp /vsock-echo /tmp/ve && timeout 5 /tmp/ve connect 1025 vessel-probe",
            )
            .await?;
        check!(
            code != 0 && err.contains("socket: Operation not permitted"),
            "{name}: socket(AF_VSOCK) was not refused: exit {code}, stdout {out:?}, stderr {err:?}"
        );
    }
    if !c.env.vm_pods {
        return Ok(());
    }
    let victim = c
        .run(&pod, &pcfg, "victim", "echo real; sleep 100000")
        .await?;
    let log = c.log_path(&pcfg, "victim");
    c.wait_log(&log, "the victim's own line", |l| {
        l.iter().any(|x| x.content == "real")
    })
    .await?;
    let forger = c
        .run_cfg(
            &pod,
            &pcfg,
            with_probe("forger", "sleep 100000", ProfileType::Unconfined, ""),
        )
        .await?;
    for header in [victim.clone(), format!("0123456789abcdef {victim}")] {
        let script = format!(
            "printf '%s\\n%s\\n' '{header}' '2026-01-01T00:00:00.000000000Z stdout F forged' | timeout 5 /tmp/ve send 1025; echo sent $?"
        );
        let (_, out, err) = c
            .sh(&forger, &format!("cp /vsock-echo /tmp/ve && {script}"))
            .await?;
        check!(
            out.contains("sent"),
            "the forger did not run: {out:?} {err:?}"
        );
    }
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let lines = c.read_log(&log)?;
    check!(
        !lines.iter().any(|l| l.content.contains("forged")),
        "a line forged over vsock reached the victim's log: {lines:?}"
    );
    Ok(())
}

async fn pid1_status_field(c: &Ctx, id: &str, field: &str) -> Result<String, Stop> {
    let s = c.sh_ok(id, "cat /proc/1/status").await?;
    match s.lines().find_map(|l| l.strip_prefix(&format!("{field}:"))) {
        Some(v) => Ok(v.trim().to_string()),
        None => fail!("no {field} in /proc/1/status"),
    }
}

/// A running pod whose containers share its pid namespace (kubelet's
/// `shareProcessNamespace`), and the namespace options its containers carry.
async fn pid_pod_run(
    c: &Ctx,
    name: &str,
) -> Result<(String, cri::PodSandboxConfig, cri::NamespaceOption), Stop> {
    let ns = cri::NamespaceOption {
        pid: cri::NamespaceMode::Pod as i32,
        ..Default::default()
    };
    let mut pcfg = c.pod_config(name);
    pcfg.linux
        .get_or_insert_with(Default::default)
        .security_context = Some(cri::LinuxSandboxSecurityContext {
        namespace_options: Some(ns.clone()),
        ..Default::default()
    });
    let pod = c.run_pod_with(&pcfg).await?;
    Ok((pod, pcfg, ns))
}

async fn pid_pod(c: Ctx) -> SpecResult {
    let (pod, pcfg, ns) = pid_pod_run(&c, "pidpod").await?;
    let mut a = c.ctr_config("a", "sleep 100001");
    Ctx::sec(&mut a).namespace_options = Some(ns.clone());
    c.run_cfg(&pod, &pcfg, a).await?;
    let mut b = c.ctr_config("b", "sleep 100002");
    Ctx::sec(&mut b).namespace_options = Some(ns.clone());
    let b = c.run_cfg(&pod, &pcfg, b).await?;
    let ps = c.sh_ok(&b, "ps").await?;
    check!(
        ps.contains("sleep 100001"),
        "container b does not see a's process: {ps}"
    );
    // A container's other processes die with its init (it is not its namespace's PID 1, so
    // the kernel would not kill them), as runc's shim kills them all: once the exit is
    // known, none is left.
    let mut d = c.ctr_config("d", "sleep 100003 & sleep 1");
    Ctx::sec(&mut d).namespace_options = Some(ns);
    let d = c.run_cfg(&pod, &pcfg, d).await?;
    c.wait_exit(&d).await?;
    let ps = c.sh_ok(&b, "ps").await?;
    check!(
        !ps.contains("sleep 100003"),
        "an exited container's background process still runs: {ps}"
    );
    Ok(())
}

/// A container that may ptrace PID 1 of its pod's shared pid namespace (`kubectl debug
/// --share-processes --profile=general` adds SYS_PTRACE) reaches nothing of the host's
/// through it: in a flat pod PID 1 is a holder (an empty root, uid 65535, no capability), as
/// containerd's is a pause container; it was the pod agent, whose root is the host's `/`.
async fn pid_pod_ptrace(c: Ctx) -> SpecResult {
    let (pod, pcfg, ns) = pid_pod_run(&c, "pidptrace").await?;
    let mut cfg = c.ctr_config("tracer", "sleep 100000");
    Ctx::sec(&mut cfg).namespace_options = Some(ns);
    Ctx::sec(&mut cfg).capabilities = Some(cri::Capability {
        add_capabilities: vec!["SYS_PTRACE".into()],
        ..Default::default()
    });
    // Unconfined by AppArmor, where the node has it: the default profile lets a container
    // ptrace only its peers (as containerd's does), which would hide what PID 1 shows.
    Ctx::sec(&mut cfg).apparmor = Some(cri::SecurityProfile {
        profile_type: cri::security_profile::ProfileType::Unconfined as i32,
        ..Default::default()
    });
    let id = c.run_cfg(&pod, &pcfg, cfg).await?;
    let seen = c.sh_ok(&id, "ls -A /proc/1/root/").await?;
    let seen: Vec<&str> = seen.lines().collect();
    if c.env.vm_pods {
        let host = std::fs::read_dir("/").map_err(|e| Stop::Fail(e.to_string()))?;
        let mut host: Vec<String> = host
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .collect();
        host.sort();
        let mut seen: Vec<String> = seen.iter().map(|s| s.to_string()).collect();
        seen.sort();
        check!(
            seen != host,
            "a VM pod's PID 1 has the host's root: {seen:?}"
        );
        return Ok(());
    }
    check!(seen.is_empty(), "PID 1's root is not empty: {seen:?}");
    let uid = pid1_status_field(&c, &id, "Uid").await?;
    check!(
        uid.split_whitespace().all(|u| u == "65535"),
        "PID 1 runs as {uid}, not 65535"
    );
    for set in ["CapPrm", "CapEff", "CapBnd"] {
        let v = pid1_status_field(&c, &id, set).await?;
        check!(v == "0000000000000000", "PID 1's {set} is {v}");
    }
    // Its command line names no host path (it was the agent's).
    let cmdline = c.sh_ok(&id, "tr '\\0' ' ' < /proc/1/cmdline").await?;
    check!(
        cmdline.trim() == "vessel-pidns",
        "PID 1's command line: {cmdline:?}"
    );
    // Its mounts: the one empty tmpfs.
    let mounts = c.sh_ok(&id, "cat /proc/1/mountinfo").await?;
    check!(
        mounts.lines().count() == 1 && mounts.contains(" / / ro,"),
        "PID 1's mounts: {mounts}"
    );
    Ok(())
}

async fn pid_node(c: Ctx) -> SpecResult {
    let id = node_ns_pod(&c, "hostpid", false, true, false).await?;
    same_ns_as_host(&c, &id, "pid").await
}

async fn ipc_pod(c: Ctx) -> SpecResult {
    let (pod, pcfg) = c.run_pod("ipc").await?;
    // What kubelet sends for every container: the pod's ipc and network, its own pids.
    let ns = vessel_cri_api::v1::NamespaceOption {
        network: vessel_cri_api::v1::NamespaceMode::Pod as i32,
        pid: vessel_cri_api::v1::NamespaceMode::Container as i32,
        ipc: vessel_cri_api::v1::NamespaceMode::Pod as i32,
        ..Default::default()
    };
    let mut ca = c.ctr_config("a", "sleep 100000");
    Ctx::sec(&mut ca).namespace_options = Some(ns.clone());
    let mut cb = c.ctr_config("b", "sleep 100000");
    Ctx::sec(&mut cb).namespace_options = Some(ns);
    let a = c.run_cfg(&pod, &pcfg, ca).await?;
    let b = c.run_cfg(&pod, &pcfg, cb).await?;
    let na = c.sh_ok(&a, "readlink /proc/self/ns/ipc").await?;
    let nb = c.sh_ok(&b, "readlink /proc/self/ns/ipc").await?;
    check!(
        na == nb,
        "the pod's containers have ipc namespaces {na} and {nb}"
    );
    // A VM pod's namespaces belong to the guest kernel: their inode numbers say nothing
    // about the host's (the initial ones even have the same fixed numbers).
    if !c.env.vm_pods {
        let host = std::fs::read_link("/proc/self/ns/ipc")
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        check!(na != host, "the pod shares the host's ipc namespace");
    }
    Ok(())
}

async fn ipc_node(c: Ctx) -> SpecResult {
    let id = node_ns_pod(&c, "hostipc", false, false, true).await?;
    same_ns_as_host(&c, &id, "ipc").await
}

async fn sysctl_check(c: &Ctx, key: &str, value: &str) -> SpecResult {
    let mut pcfg = c.pod_config("sysctl");
    pcfg.linux.get_or_insert_with(Default::default).sysctls =
        HashMap::from([(key.to_string(), value.to_string())]);
    let pod = c.run_pod_with(&pcfg).await?;
    let id = c.run(&pod, &pcfg, "s", "sleep 100000").await?;
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    let got = c.sh_ok(&id, &format!("cat {path}")).await?;
    let got: Vec<&str> = got.split_whitespace().collect();
    let want: Vec<&str> = value.split_whitespace().collect();
    check!(got == want, "{key} reads {got:?}, want {want:?}");
    Ok(())
}

async fn sysctl_ipc(c: Ctx) -> SpecResult {
    sysctl_check(&c, "kernel.shm_rmid_forced", "1").await
}

async fn sysctl_net(c: Ctx) -> SpecResult {
    sysctl_check(&c, "net.ipv4.ip_local_port_range", "40000 50000").await
}
