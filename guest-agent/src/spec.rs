//! Turning the caller's OCI runtime spec into the bundle libcontainer runs.
//!
//! Conventions (what vesseld must know):
//! - `root.path` is replaced with the container's rootfs (kept `readonly` flag).
//! - `process.terminal` is set from the request's `tty`.
//! - A namespace whose `path` is `"agent"` joins the agent's own namespace of that type
//!   (`/proc/<agent pid>/ns/<type>`, i.e. the pod's, or the host's where the pod shares it);
//!   a namespace without `path` is created; an absent type is inherited from the agent.
//!   In a pod with its own user namespace (`crate::userns`), `"agent"` is the pod's
//!   namespace held by the pod's pid namespace holder, `user` included; a pod without one
//!   refuses `user`. In a flat pod with a pid namespace of its own, `pid` `"agent"` is the
//!   one below the agent's whose PID 1 is a holder ([`crate::userns::create_pid_holder`]).
//! - `linux.cgroupsPath` is a cgroupfs path (`/a/b/c`, taken from each hierarchy's root);
//!   systemd-style `slice:prefix:name` paths are refused (no systemd manager). Absent, it
//!   defaults to `/vessel/<id>`.

use std::path::{Path, PathBuf};

use oci_spec::runtime::{
    Linux, LinuxBuilder, LinuxNamespaceType, LinuxSeccompArgBuilder, LinuxSeccompOperator,
    RootBuilder, Spec,
};

use crate::error::AgentError;

/// Capabilities a container gets by default (containerd's and Docker's set): what vesseld
/// gives a container whose request adds or drops none, and what the agent's tests give theirs.
pub const DEFAULT_CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// The `/proc/<pid>/ns/<name>` name of a namespace type.
pub fn ns_file_name(t: LinuxNamespaceType) -> &'static str {
    match t {
        LinuxNamespaceType::Mount => "mnt",
        LinuxNamespaceType::Cgroup => "cgroup",
        LinuxNamespaceType::Uts => "uts",
        LinuxNamespaceType::Ipc => "ipc",
        LinuxNamespaceType::User => "user",
        LinuxNamespaceType::Pid => "pid",
        LinuxNamespaceType::Network => "net",
        LinuxNamespaceType::Time => "time",
    }
}

/// The cgroups path used for a container when its spec names none.
pub fn default_cgroups_path(id: &str) -> PathBuf {
    PathBuf::from(format!("/vessel/{id}"))
}

/// Parses and rewrites `json` for container `id` with its rootfs at `rootfs`.
pub fn prepare(
    json: &[u8],
    id: &str,
    rootfs: &Path,
    tty: bool,
    agent_pid: u32,
) -> Result<Spec, AgentError> {
    let mut spec: Spec = serde_json::from_slice(json)
        .map_err(|e| AgentError::InvalidArgument(format!("parsing the OCI spec: {e}")))?;

    let readonly = spec.root().as_ref().and_then(|r| r.readonly());
    let mut root = RootBuilder::default().path(rootfs.to_path_buf());
    if let Some(ro) = readonly {
        root = root.readonly(ro);
    }
    spec.set_root(Some(root.build().map_err(|e| {
        AgentError::InvalidArgument(format!("spec root: {e}"))
    })?));

    let process = spec
        .process_mut()
        .as_mut()
        .ok_or_else(|| AgentError::InvalidArgument("the OCI spec has no process".into()))?;
    if process.args().as_ref().is_none_or(|a| a.is_empty()) {
        return Err(AgentError::InvalidArgument(
            "the OCI spec's process has no args".into(),
        ));
    }
    process.set_terminal(Some(tty));
    // libcontainer 0.7 picks the moment it loads the seccomp filter by whether
    // noNewPrivileges is present, not by its value: `false` made it load after dropping
    // CAP_SYS_ADMIN without no_new_privs, which the kernel refuses. Absent means false.
    if process.no_new_privileges() == Some(false) {
        process.set_no_new_privileges(None);
    }
    clamp_capabilities(process)?;

    if spec.linux().is_none() {
        spec.set_linux(Some(LinuxBuilder::default().build().map_err(|e| {
            AgentError::InvalidArgument(format!("spec linux: {e}"))
        })?));
    }
    let linux = spec.linux_mut().as_mut().expect("set above");
    match linux.cgroups_path() {
        None => {
            linux.set_cgroups_path(Some(default_cgroups_path(id)));
        }
        Some(p) if p.to_string_lossy().contains(':') => {
            return Err(AgentError::InvalidArgument(format!(
                "cgroupsPath {p:?}: systemd-style paths are not supported (cgroupfs only)"
            )));
        }
        Some(_) => {}
    }
    if let Some(namespaces) = linux.namespaces_mut().as_mut() {
        for ns in namespaces.iter_mut() {
            if ns.path().as_deref() != Some(Path::new("agent")) {
                continue;
            }
            let p = if let Some(holder) = crate::userns::pod_holder() {
                // A pod with its own user namespace: its namespaces are the holder's (owned
                // by that user namespace, which a container joins first; it could not open
                // the agent's, which stays in the host's).
                PathBuf::from(format!("/proc/{holder}/ns/{}", ns_file_name(ns.typ())))
            } else if ns.typ() == LinuxNamespaceType::User {
                return Err(AgentError::InvalidArgument(
                    "the spec joins the pod's user namespace, but this pod has none".into(),
                ));
            } else if let Some(p) = crate::userns::shared_pid_ns(agent_pid)
                .filter(|_| ns.typ() == LinuxNamespaceType::Pid)
            {
                // A flat pod's shared pid namespace is its holder's, below the agent's.
                p
            } else {
                PathBuf::from(format!("/proc/{agent_pid}/ns/{}", ns_file_name(ns.typ())))
            };
            ns.set_path(Some(p));
        }
    }
    masked_eq_as_runc(linux);
    Ok(spec)
}

/// The source of a spec's bind mount that is the pod's shared /dev/shm (the containers in
/// the pod's IPC namespace share one, as with containerd's sandbox shm), which the agent
/// keeps in its own mount namespace (gone with it: nothing is left on the host).
pub const POD_SHM: &str = "agent:shm";

/// Where the agent keeps the pod's /dev/shm: in its containers' dir, which every id the
/// pod's containers run as can traverse (a pod with its own user namespace too).
pub fn pod_shm_dir(containers_dir: &Path) -> PathBuf {
    containers_dir.join(".pod-shm")
}

/// Points the spec's [`POD_SHM`] binds at the pod's /dev/shm under `containers_dir`,
/// mounting its tmpfs (64 MiB, as containerd's) the first time.
pub fn bind_pod_shm(spec: &mut Spec, containers_dir: &Path) -> Result<(), AgentError> {
    use std::os::unix::fs::MetadataExt;
    let Some(mut mounts) = spec.mounts().clone() else {
        return Ok(());
    };
    if !mounts
        .iter()
        .any(|m| m.source().as_deref() == Some(Path::new(POD_SHM)))
    {
        return Ok(());
    }
    static MOUNTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = MOUNTING.lock().unwrap_or_else(|p| p.into_inner());
    let dir = pod_shm_dir(containers_dir);
    let internal = |what: &str, e: std::io::Error| {
        AgentError::Internal(format!(
            "the pod's /dev/shm at {}: {what}: {e}",
            dir.display()
        ))
    };
    std::fs::create_dir_all(&dir).map_err(|e| internal("mkdir", e))?;
    let here = std::fs::metadata(&dir).map_err(|e| internal("stat", e))?;
    let parent = std::fs::metadata(containers_dir).map_err(|e| internal("stat", e))?;
    if here.dev() == parent.dev() {
        nix::mount::mount(
            Some("shm"),
            &dir,
            Some("tmpfs"),
            nix::mount::MsFlags::MS_NOSUID
                | nix::mount::MsFlags::MS_NODEV
                | nix::mount::MsFlags::MS_NOEXEC,
            Some("mode=1777,size=65536k"),
        )
        .map_err(|e| internal("mounting its tmpfs", e.into()))?;
    }
    for m in mounts.iter_mut() {
        if m.source().as_deref() == Some(Path::new(POD_SHM)) {
            m.set_source(Some(dir.clone()));
        }
    }
    spec.set_mounts(Some(mounts));
    Ok(())
}

/// libcontainer 0.7 reads SCMP_CMP_MASKED_EQ the other way round from runc: it masks with
/// `valueTwo` and compares with `value`, where runc, and every profile written for it (Docker's
/// and containerd's defaults, vessel's RuntimeDefault, a node's Localhost profiles), masks
/// with `value` and compares with `valueTwo`. Swapped here, a profile means what it means
/// under runc (a namespace-flag mask on clone would otherwise refuse every fork).
fn masked_eq_as_runc(linux: &mut Linux) {
    let Some(mut seccomp) = linux.seccomp().clone() else {
        return;
    };
    let Some(mut syscalls) = seccomp.syscalls().clone() else {
        return;
    };
    for sc in &mut syscalls {
        let Some(mut args) = sc.args().clone() else {
            continue;
        };
        for a in &mut args {
            if a.op() == LinuxSeccompOperator::ScmpCmpMaskedEq {
                let (mask, want) = (a.value(), a.value_two().unwrap_or(0));
                if let Ok(swapped) = LinuxSeccompArgBuilder::default()
                    .index(a.index())
                    .value(want)
                    .value_two(mask)
                    .op(a.op())
                    .build()
                {
                    *a = swapped;
                }
            }
        }
        sc.set_args(Some(args));
    }
    seccomp.set_syscalls(Some(syscalls));
    linux.set_seccomp(Some(seccomp));
}

/// Limits every capability set to the agent's own bounding set: asking for a capability the
/// agent does not hold (a host's root may lack some, e.g. CAP_SYS_RESOURCE in some
/// sandboxes) makes capset fail and the container with it. Privileged means "all we have".
fn clamp_capabilities(process: &mut oci_spec::runtime::Process) -> Result<(), AgentError> {
    let Some(mut c) = process.capabilities().clone() else {
        return Ok(());
    };
    let bounding = caps::read(None, caps::CapSet::Bounding)
        .map_err(|e| AgentError::Internal(format!("reading our bounding capability set: {e}")))?;
    let keep = |set: &Option<oci_spec::runtime::Capabilities>| {
        set.as_ref().map(|s| {
            s.iter()
                .copied()
                .filter(|x| {
                    format!("CAP_{x}")
                        .parse::<caps::Capability>()
                        .map_or(true, |k| bounding.contains(&k))
                })
                .collect()
        })
    };
    c.set_bounding(keep(c.bounding()));
    c.set_effective(keep(c.effective()));
    c.set_permitted(keep(c.permitted()));
    c.set_inheritable(keep(c.inheritable()));
    c.set_ambient(keep(c.ambient()));
    process.set_capabilities(Some(c));
    Ok(())
}

/// The cgroups path of a prepared spec.
pub fn cgroups_path(spec: &Spec, id: &str) -> PathBuf {
    spec.linux()
        .as_ref()
        .and_then(|l| l.cgroups_path().clone())
        .unwrap_or_else(|| default_cgroups_path(id))
}

/// Merges an UpdateContainerResources request into an OCI spec's `linux.resources`, as the
/// container's cgroup takes it (`crate::cgroups`): zero and empty fields leave what is there,
/// a negative CPU quota removes the quota, `unified` keys are added to those there. vesseld
/// keeps the spec it shows (`crictl inspect`) current with the same merge.
pub fn merge_resources(
    spec: &mut serde_json::Value,
    r: &crate::proto::LinuxResources,
) -> std::io::Result<()> {
    use serde_json::json;
    if !spec.is_object() || !(spec["linux"].is_object() || spec["linux"].is_null()) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the spec's linux member is not an object",
        ));
    }
    for k in r.unified.keys() {
        if !crate::cgroups::is_controller_file(k) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("bad cgroup file name {k:?}"),
            ));
        }
    }
    let res = &mut spec["linux"]["resources"];
    if !res.is_object() {
        *res = json!({});
    }
    let cpu = &mut res["cpu"];
    if !cpu.is_object() {
        *cpu = json!({});
    }
    if r.cpu_shares > 0 {
        cpu["shares"] = json!(r.cpu_shares);
    }
    if r.cpu_quota > 0 {
        cpu["quota"] = json!(r.cpu_quota);
    } else if r.cpu_quota < 0 {
        if let Some(o) = cpu.as_object_mut() {
            o.remove("quota");
        }
    }
    if r.cpu_period > 0 {
        cpu["period"] = json!(r.cpu_period);
    }
    if !r.cpuset_cpus.is_empty() {
        cpu["cpus"] = json!(r.cpuset_cpus);
    }
    if !r.cpuset_mems.is_empty() {
        cpu["mems"] = json!(r.cpuset_mems);
    }
    if r.memory_limit_in_bytes > 0 {
        let mem = &mut res["memory"];
        if !mem.is_object() {
            *mem = json!({});
        }
        mem["limit"] = json!(r.memory_limit_in_bytes);
        // -1: no limit, as libcontainer takes it (v1's memsw -1, v2's "max").
        if r.memory_swap_limit_in_bytes > 0 || r.memory_swap_limit_in_bytes == -1 {
            mem["swap"] = json!(r.memory_swap_limit_in_bytes);
        }
    }
    if !r.unified.is_empty() {
        let unified = &mut res["unified"];
        if !unified.is_object() {
            *unified = json!({});
        }
        for (k, v) in &r.unified {
            unified[k] = json!(v);
        }
    }
    Ok(())
}

/// cgroup v2's "no swap" for a spec whose swap (v1's memory+swap) equals its memory limit,
/// written as runc writes it (`memory.swap.max` 0): libcontainer 0.7 takes a v2 swap of 0
/// for "not set" and leaves `memory.swap.max` at `max`, so such a container could swap
/// without bound. Given as `unified["memory.swap.max"] = "0"`, unless the spec sets that
/// file itself. Whether the spec changed.
pub fn no_swap_on_v2(spec: &mut serde_json::Value) -> bool {
    let res = &spec["linux"]["resources"];
    let mem = &res["memory"];
    let no_swap = matches!(
        (mem["limit"].as_i64(), mem["swap"].as_i64()),
        (Some(limit), Some(swap)) if limit > 0 && swap == limit
    );
    if !no_swap || !res["unified"]["memory.swap.max"].is_null() {
        return false;
    }
    let res = &mut spec["linux"]["resources"];
    if !res["unified"].is_object() {
        res["unified"] = serde_json::json!({});
    }
    res["unified"]["memory.swap.max"] = serde_json::json!("0");
    true
}

/// Edits a bundle's `config.json` at `path`: rewritten (a temporary file renamed over it)
/// where `edit` says it changed the spec.
pub fn edit_bundle(
    path: &Path,
    edit: impl FnOnce(&mut serde_json::Value) -> std::io::Result<bool>,
) -> std::io::Result<()> {
    let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(path)?)
        .map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))?;
    if !edit(&mut spec)? {
        return Ok(());
    }
    let tmp = path.with_extension("json.tmp");
    std::fs::write(
        &tmp,
        serde_json::to_vec(&spec).map_err(std::io::Error::other)?,
    )?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites() {
        let json = br#"{
            "ociVersion": "1.0.2",
            "root": {"path": "rootfs", "readonly": true},
            "process": {"args": ["sh"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
            "linux": {"namespaces": [{"type": "network", "path": "agent"}, {"type": "pid"}]}
        }"#;
        let spec = prepare(json, "c1", Path::new("/r"), true, 1).unwrap();
        assert_eq!(spec.root().as_ref().unwrap().path(), Path::new("/r"));
        assert_eq!(spec.root().as_ref().unwrap().readonly(), Some(true));
        assert_eq!(spec.process().as_ref().unwrap().terminal(), Some(true));
        let ns = spec.linux().as_ref().unwrap().namespaces().clone().unwrap();
        assert_eq!(ns[0].path().as_deref(), Some(Path::new("/proc/1/ns/net")));
        assert_eq!(ns[1].path(), &None);
        assert_eq!(cgroups_path(&spec, "c1"), PathBuf::from("/vessel/c1"));
        assert!(matches!(
            prepare(b"{", "c1", Path::new("/r"), false, 1),
            Err(AgentError::InvalidArgument(_))
        ));
    }

    #[test]
    fn capabilities_are_limited_to_our_bounding_set() {
        let all: Vec<String> = [
            "CHOWN",
            "KILL",
            "SYS_ADMIN",
            "SYS_RESOURCE",
            "SYS_TIME",
            "BPF",
        ]
        .iter()
        .map(|c| format!("\"CAP_{c}\""))
        .collect();
        let json = format!(
            r#"{{"ociVersion": "1.0.2", "root": {{"path": "rootfs"}},
            "process": {{"args": ["sh"], "cwd": "/", "user": {{"uid": 0, "gid": 0}},
            "capabilities": {{"bounding": [{l}], "effective": [{l}], "permitted": [{l}]}}}}}}"#,
            l = all.join(",")
        );
        let spec = prepare(json.as_bytes(), "c1", Path::new("/r"), false, 1).unwrap();
        let caps = spec
            .process()
            .as_ref()
            .unwrap()
            .capabilities()
            .clone()
            .unwrap();
        let bounding = caps::read(None, caps::CapSet::Bounding).unwrap();
        let held = [
            "CHOWN",
            "KILL",
            "SYS_ADMIN",
            "SYS_RESOURCE",
            "SYS_TIME",
            "BPF",
        ]
        .iter()
        .filter(|c| bounding.contains(&format!("CAP_{c}").parse().unwrap()))
        .count();
        assert_eq!(caps.bounding().as_ref().unwrap().len(), held);
        assert_eq!(caps.effective().as_ref().unwrap().len(), held);
        assert_eq!(caps.permitted().as_ref().unwrap().len(), held);
    }

    #[test]
    fn no_new_privileges_false_is_dropped_true_kept() {
        let spec = |nnp: &str| {
            format!(
                r#"{{"ociVersion": "1.0.2", "root": {{"path": "rootfs"}},
                "process": {{"args": ["sh"], "cwd": "/", "user": {{"uid": 0, "gid": 0}}{nnp}}}}}"#
            )
        };
        let nnp = |j: String| {
            prepare(j.as_bytes(), "c1", Path::new("/r"), false, 1)
                .unwrap()
                .process()
                .as_ref()
                .unwrap()
                .no_new_privileges()
        };
        assert_eq!(nnp(spec(r#", "noNewPrivileges": false"#)), None);
        assert_eq!(nnp(spec(r#", "noNewPrivileges": true"#)), Some(true));
        assert_eq!(nnp(spec("")), None);
    }

    /// A runc-style profile (namespace-flag mask on clone, AF_VSOCK refused, clone3 ENOSYS),
    /// prepared and installed by libcontainer in a child: fork works, namespaces and vsock
    /// do not.
    #[test]
    fn masked_eq_means_what_it_means_under_runc() {
        let json = br#"{
            "ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "process": {"args": ["sh"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
            "linux": {"seccomp": {"defaultAction": "SCMP_ACT_ALLOW",
                "architectures": ["SCMP_ARCH_X86_64"],
                "syscalls": [
                  {"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
                   "args": [{"index": 0, "value": 2114060288, "valueTwo": 0,
                             "op": "SCMP_CMP_MASKED_EQ"}]},
                  {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
                  {"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
                   "args": [{"index": 0, "value": 40, "op": "SCMP_CMP_EQ"}]}]}}
        }"#;
        // Here clone without namespace flags is what is refused (the inverse of a default
        // profile), so that a wrong reading shows as a fork that works.
        let spec = prepare(json, "c1", Path::new("/r"), false, 1).unwrap();
        let filter = spec.linux().as_ref().unwrap().seccomp().clone().unwrap();
        // SAFETY: fork in a test process; the child only installs the filter, makes raw
        // syscalls and _exits; the parent waits for it.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let code = (|| -> i32 {
                // SAFETY: prctl with integer arguments.
                if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
                    return 10;
                }
                if libcontainer::seccomp::initialize_seccomp(&filter).is_err() {
                    return 11;
                }
                let errno = || std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
                // SAFETY: raw clone with SIGCHLD only (a fork); the child _exits at once.
                let r = unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD, 0, 0, 0, 0) };
                if r == 0 {
                    // SAFETY: _exit in the forked grandchild.
                    unsafe { libc::_exit(0) };
                }
                if r > 0 || errno() != libc::EPERM {
                    return 12; // a plain fork must be the refused one under this profile
                }
                // ... and one with a namespace flag is not (a wrong reading of the operands
                // matches every clone or none).
                // SAFETY: as above, with CLONE_NEWUSER.
                let r = unsafe {
                    libc::syscall(
                        libc::SYS_clone,
                        libc::CLONE_NEWUSER | libc::SIGCHLD,
                        0,
                        0,
                        0,
                        0,
                    )
                };
                if r == 0 {
                    // SAFETY: _exit in the forked grandchild.
                    unsafe { libc::_exit(0) };
                }
                if r < 0 {
                    return 16;
                }
                let Ok(r) = libc::pid_t::try_from(r) else {
                    return 17;
                };
                let mut st = 0;
                // SAFETY: reaping the grandchild just made.
                unsafe { libc::waitpid(r, &mut st, 0) };
                // SAFETY: clone3 with a null argument: refused by the filter before use.
                let r = unsafe { libc::syscall(libc::SYS_clone3, 0usize, 0usize) };
                if r != -1 || errno() != libc::ENOSYS {
                    return 13;
                }
                // SAFETY: socket(2) with integer arguments; the descriptor is closed.
                let fd = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM, 0) };
                if fd >= 0 || errno() != libc::EPERM {
                    return 14;
                }
                // SAFETY: as above.
                let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
                if fd < 0 {
                    return 15;
                }
                // SAFETY: closing the descriptor just made.
                unsafe { libc::close(fd) };
                0
            })();
            // SAFETY: _exit in the forked child (no unwinding into the test harness).
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "child status {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "see the return codes above");
    }

    #[test]
    fn no_swap_on_cgroup_v2_is_written_as_runc_writes_it() {
        use serde_json::json;
        let mut spec = json!({"linux": {"resources": {"memory": {"limit": 64, "swap": 64}}}});
        assert!(no_swap_on_v2(&mut spec));
        assert_eq!(
            spec["linux"]["resources"]["unified"],
            json!({"memory.swap.max": "0"})
        );
        // Once only, and never over the spec's own.
        assert!(!no_swap_on_v2(&mut spec));
        let mut own = json!({"linux": {"resources": {
            "memory": {"limit": 64, "swap": 64},
            "unified": {"memory.swap.max": "max", "memory.high": "60"}}}});
        assert!(!no_swap_on_v2(&mut own));
        assert_eq!(
            own["linux"]["resources"]["unified"]["memory.swap.max"],
            "max"
        );
        // Swap beyond the limit, unlimited swap, no limit, no swap asked: left to
        // libcontainer.
        for memory in [
            json!({"limit": 64, "swap": 128}),
            json!({"limit": 64, "swap": -1}),
            json!({"swap": 64}),
            json!({"limit": 64}),
            json!(null),
        ] {
            let mut spec = json!({"linux": {"resources": {"memory": memory}}});
            let before = spec.clone();
            assert!(!no_swap_on_v2(&mut spec), "{memory}");
            assert_eq!(spec, before);
        }
        let mut bare = json!({"process": {}});
        assert!(!no_swap_on_v2(&mut bare));
    }
}
