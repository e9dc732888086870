//! OCI runtime specs from CRI requests.
//!
//! vesseld turns a CRI `ContainerConfig` (plus the pod's settings and the image's config)
//! into an OCI runtime spec; the pod agent applies it with libcontainer. Namespace paths use
//! the agent's convention: `"agent"` joins the agent's own namespace (the pod's), no path
//! creates a new one, and an absent type inherits the agent's (the host's, for namespaces the
//! pod shares with the node).

pub mod apparmor;
mod devices;
mod mounts;
mod namespaces;
mod resources;
mod seccomp;
mod security;
mod user;

pub(crate) use mounts::clean as clean_path;
use resources::check_envs;
pub use resources::{check_resources, merge_update, MIN_MEMORY_LIMIT};
use security::{capabilities, DEFAULT_MASKED, DEFAULT_READONLY};
pub use security::{ALL_CAPS, DEFAULT_CAPS};
pub use user::{read_image_file, resolve_user};

use namespaces::Namespaces;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use vessel_cri_api::v1 as cri;
use vessel_images::oci::RunConfig;

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("{0}")]
    Invalid(String),
}

fn invalid(s: impl Into<String>) -> SpecError {
    SpecError::Invalid(s.into())
}

/// The user a container process runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedUser {
    pub uid: u32,
    pub gid: u32,
    pub additional_gids: Vec<u32>,
}

/// The process arguments from CRI command/args and the image's Entrypoint/Cmd, as
/// containerd combines them.
pub fn process_args(
    config: &cri::ContainerConfig,
    image: &RunConfig,
) -> Result<Vec<String>, SpecError> {
    let mut command = config.command.clone();
    let mut args = config.args.clone();
    if command.is_empty() {
        command = image.entrypoint.clone().unwrap_or_default();
        // `ENTRYPOINT [""]` clears an inherited entrypoint (Docker's reading): none.
        if command.len() == 1 && command[0].is_empty() {
            command.clear();
        }
        if args.is_empty() {
            args = image.cmd.clone().unwrap_or_default();
        }
    }
    let all: Vec<String> = command.into_iter().chain(args).collect();
    if all.is_empty() || all[0].is_empty() {
        return Err(invalid(
            "no command: the request has no command or args and the image has no Entrypoint or Cmd",
        ));
    }
    Ok(all)
}

/// The environment: the image's, overridden by the request's, plus PATH and HOSTNAME.
pub fn environment(
    config: &cri::ContainerConfig,
    image: &RunConfig,
    hostname: &str,
) -> Vec<String> {
    let mut env: Vec<(String, String)> = Vec::new();
    let mut set = |k: &str, v: &str| {
        if let Some(e) = env.iter_mut().find(|(ek, _)| ek == k) {
            e.1 = v.to_string();
        } else {
            env.push((k.to_string(), v.to_string()));
        }
    };
    set("PATH", DEFAULT_PATH);
    set("HOSTNAME", hostname);
    if config.tty {
        // What a terminal is, for programs on it (`kubectl run -it`), as containerd and
        // CRI-O say; the image's or the request's TERM wins.
        set("TERM", "xterm");
    }
    for e in image.env.clone().unwrap_or_default() {
        let (k, v) = e.split_once('=').unwrap_or((e.as_str(), ""));
        set(k, v);
    }
    for kv in &config.envs {
        set(&kv.key, &kv.value);
    }
    env.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
}

/// Everything a spec needs besides the CRI request.
pub struct SpecInput<'a> {
    pub pod: &'a cri::PodSandboxConfig,
    pub config: &'a cri::ContainerConfig,
    pub image: &'a RunConfig,
    pub layer_dirs: &'a [PathBuf],
    pub hostname: &'a str,
    pub pod_dir: &'a Path,
    pub cgroups_path: String,
    /// The pid (in the agent's namespace) of the TARGET container, for NamespaceMode TARGET.
    pub target_pid: Option<u32>,
    /// Give the container its own cgroup namespace, so that it sees its own cgroup as the
    /// root of /sys/fs/cgroup: on cgroup v2 (a VM's guest, unified hosts), as containerd does.
    pub cgroup_ns: bool,
    /// The AppArmor profiles loaded where the container runs; `None`: no AppArmor there.
    pub apparmor: Option<&'a std::collections::HashSet<String>>,
    /// Whether SELinux is enabled where the container runs.
    pub selinux: bool,
    /// Whether the hugetlb cgroup controller is there where the container runs.
    pub hugetlb: bool,
    /// Whether the memory cgroup accounts swap where the container runs (cgroup v1's
    /// memsw, v2's memory.swap.max): a memory limit then also caps swap unless the request
    /// gives a swap limit (containerd's default).
    pub swap_accounting: bool,
    /// Whether the container runs in a VM pod's guest, where vsock reaches the host.
    pub vm_guest: bool,
    /// The pod's agent keeps one /dev/shm for the containers in the pod's IPC namespace.
    pub shared_shm: bool,
    /// A flat pod's shared pid namespace has a holder as its PID 1, not the agent.
    pub pid_holder: bool,
}

/// Whether this host runs cgroup v2 alone (unified hierarchy at /sys/fs/cgroup).
pub fn host_is_cgroup_v2() -> bool {
    Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
}

fn ns_mode(m: i32) -> cri::NamespaceMode {
    cri::NamespaceMode::try_from(m).unwrap_or(cri::NamespaceMode::Pod)
}

/// The namespace options of a pod's config, where it has them.
pub fn pod_namespace_options(pod: &cri::PodSandboxConfig) -> Option<&cri::NamespaceOption> {
    pod.linux
        .as_ref()
        .and_then(|l| l.security_context.as_ref())
        .and_then(|s| s.namespace_options.as_ref())
}

/// Builds the OCI runtime spec JSON and returns it with the resolved user.
pub fn build(input: &SpecInput<'_>) -> Result<(Value, ResolvedUser), SpecError> {
    let c = input.config;
    let lc = c.linux.as_ref();
    let sc = lc.and_then(|l| l.security_context.as_ref());
    let privileged = sc.map(|s| s.privileged).unwrap_or(false);
    let args = process_args(c, input.image)?;
    check_envs(&c.envs)?;
    let env = environment(c, input.image, input.hostname);
    let cwd = if !c.working_dir.is_empty() {
        c.working_dir.clone()
    } else {
        input
            .image
            .working_dir
            .clone()
            .filter(|w| !w.is_empty())
            .unwrap_or_else(|| "/".into())
    };
    if !cwd.starts_with('/') {
        return Err(invalid(format!("working dir {cwd:?} is not absolute")));
    }
    let user = resolve_user(sc, input.image.user.as_deref(), input.layer_dirs)?;
    // The command is not looked for in the image: it may come from a volume (on a PATH the
    // request sets, or below the working directory) or from a CDI device's mounts
    // (`nvidia-smi`). One that is nowhere fails StartContainer, as with containerd.
    let Namespaces {
        list: namespaces,
        userns,
        pid: pid_mode,
        ipc: ipc_mode,
        host_net,
    } = namespaces::build(input, sc, &user, privileged)?;

    let readonly_root = sc.map(|s| s.readonly_rootfs).unwrap_or(false);
    let mounts = mounts::build(input, sc, userns.as_ref(), (pid_mode, ipc_mode), privileged)?;
    let (devices, dev_rules) = devices::build(c, privileged, input.vm_guest)?;

    // Resources.
    let mut resources = json!({"devices": dev_rules});
    let mut oom_score_adj = None;
    if let Some(r) = lc.and_then(|l| l.resources.as_ref()) {
        check_resources(r)?;
        let mut cpu = serde_json::Map::new();
        if r.cpu_shares > 0 {
            cpu.insert("shares".into(), json!(r.cpu_shares));
        }
        if r.cpu_quota > 0 {
            cpu.insert("quota".into(), json!(r.cpu_quota));
        }
        if r.cpu_period > 0 {
            cpu.insert("period".into(), json!(r.cpu_period));
        }
        // The host's CPU and NUMA node numbers (kubelet's CPU and memory managers) mean
        // nothing in a VM pod's guest, whose vCPUs are numbered from 0: not applied there.
        if !r.cpuset_cpus.is_empty() && !input.vm_guest {
            cpu.insert("cpus".into(), json!(r.cpuset_cpus));
        }
        if !r.cpuset_mems.is_empty() && !input.vm_guest {
            cpu.insert("mems".into(), json!(r.cpuset_mems));
        }
        if !cpu.is_empty() {
            resources["cpu"] = Value::Object(cpu);
        }
        if r.memory_limit_in_bytes > 0 {
            let mut mem = json!({"limit": r.memory_limit_in_bytes});
            let swap = default_swap(r, input.swap_accounting);
            if swap > 0 {
                mem["swap"] = json!(swap);
            }
            resources["memory"] = mem;
        }
        if !r.unified.is_empty() {
            resources["unified"] = json!(r.unified);
        }
        // kubelet sends a limit for every huge page size the node has, 0 where the pod asks
        // for none. Where there is no hugetlb controller nothing can be limited: the zero
        // entries are dropped and a real limit is refused.
        if let Some(h) = r
            .hugepage_limits
            .iter()
            .find(|h| h.limit > 0 && !input.hugetlb)
        {
            return Err(invalid(format!(
                "hugepage limit of {} bytes for {} pages cannot be honoured: there is no hugetlb cgroup controller where the container runs (a VM guest has no huge pages)",
                h.limit, h.page_size
            )));
        }
        if !r.hugepage_limits.is_empty() && input.hugetlb {
            let mut limits = Vec::new();
            for h in &r.hugepage_limits {
                let size = h.page_size.trim();
                let ok = size.len() > 2
                    && size.ends_with('B')
                    && size[..size.len() - 2].bytes().all(|c| c.is_ascii_digit())
                    && matches!(size.as_bytes()[size.len() - 2], b'K' | b'M' | b'G');
                if !ok {
                    return Err(invalid(format!(
                        "hugepage limit: page size {size:?} is not <number>KB, MB or GB"
                    )));
                }
                limits.push(json!({"pageSize": size, "limit": h.limit}));
            }
            resources["hugepageLimits"] = json!(limits);
        }
        // Whatever it is, 0 too (as containerd does): the container is not to inherit the
        // agent's score. The agent clamps a value it is not allowed to set (no
        // CAP_SYS_RESOURCE).
        oom_score_adj = Some(r.oom_score_adj);
    }

    let caps = capabilities(sc, privileged);
    let mut process = json!({
        "terminal": c.tty,
        "user": {"uid": user.uid, "gid": user.gid, "additionalGids": user.additional_gids},
        "args": args,
        "env": env,
        "cwd": cwd,
        "capabilities": {
            "bounding": caps,
            "effective": caps,
            "permitted": caps,
        },
        "noNewPrivileges": sc.map(|s| s.no_new_privs).unwrap_or(false),
    });
    if user.uid != 0 {
        // Like containerd: a non-root user keeps no effective/permitted capabilities unless asked.
        process["capabilities"]["effective"] = json!(Vec::<String>::new());
        process["capabilities"]["permitted"] = json!(Vec::<String>::new());
        if sc
            .and_then(|s| s.capabilities.as_ref())
            .is_some_and(|c| !c.add_capabilities.is_empty())
            || privileged
        {
            process["capabilities"]["effective"] = json!(caps);
            process["capabilities"]["permitted"] = json!(caps);
        }
    }
    // Ambient capabilities go into every set, so that a non-root process keeps them.
    let ambient = security::ambient_capabilities(sc);
    if !ambient.is_empty() && !privileged {
        for set in ["bounding", "effective", "permitted"] {
            let Some(have) = process["capabilities"][set].as_array_mut() else {
                continue;
            };
            for a in &ambient {
                if !have.iter().any(|v| v == a) {
                    have.push(json!(a));
                }
            }
        }
        process["capabilities"]["inheritable"] = json!(ambient);
        process["capabilities"]["ambient"] = json!(ambient);
    }
    if let Some(label) = security::selinux_label(sc, input.selinux) {
        process["selinuxLabel"] = json!(label.process);
    }
    if let Some(adj) = oom_score_adj {
        process["oomScoreAdj"] = json!(adj);
    }

    let own_userns = userns.is_some();
    let masked = protected_paths(
        privileged,
        own_userns,
        sc.map(|s| &s.masked_paths),
        DEFAULT_MASKED,
    );
    let readonly_paths = protected_paths(
        privileged,
        own_userns,
        sc.map(|s| &s.readonly_paths),
        DEFAULT_READONLY,
    );
    // net.* sysctls are the pod network namespace's, set once by vesseld at RunPodSandbox.
    let sysctl: HashMap<String, String> = input
        .pod
        .linux
        .as_ref()
        .map(|l| l.sysctls.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| !k.starts_with("net."))
        .collect();

    let mut linux = json!({
        "namespaces": namespaces,
        "resources": resources,
        "cgroupsPath": input.cgroups_path,
        "devices": devices,
        "maskedPaths": masked,
        "readonlyPaths": readonly_paths,
        "sysctl": sysctl,
    });
    let bounding: Vec<String> = process["capabilities"]["bounding"]
        .as_array()
        .map(|b| {
            b.iter()
                .filter_map(|c| c.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    if let Some(s) = seccomp::profile(sc, privileged, &bounding, input.vm_guest)? {
        linux["seccomp"] = s;
    }
    let wanted = apparmor::wanted(sc)?;
    if let Some(p) = apparmor::profile(&wanted, privileged, input.apparmor)? {
        process["apparmorProfile"] = json!(p);
    }
    // A Bidirectional mount needs the container's root to stay shared (as containerd sets
    // rootfsPropagation "rshared"), or its mounts could never reach the host; otherwise the
    // root is a slave (libcontainer's default), which HostToContainer needs.
    if c.mounts
        .iter()
        .any(|m| m.propagation == cri::MountPropagation::PropagationBidirectional as i32)
    {
        linux["rootfsPropagation"] = json!("shared");
    }
    let spec = json!({
        "ociVersion": "1.0.2",
        "process": process,
        "root": {"path": "rootfs", "readonly": readonly_root},
        "hostname": if host_net { Value::Null } else { json!(input.hostname) },
        "mounts": mounts,
        "linux": linux,
        "annotations": c.annotations,
    });
    Ok((spec, user))
}

/// The masked or read-only paths of a container: none for a privileged one, else those its
/// security context asks for (`asked`). kubelet sends its default lists for
/// `procMount: Default` and empty ones for `procMount: Unmasked`, which the Kubernetes API
/// allows only in a pod with its own user namespace (`hostUsers: false`); containerd and
/// CRI-O apply the lists as sent. So an empty list in such a pod is none (a nested container
/// runtime can mount its own /proc); elsewhere it is a client that sent none (crictl,
/// critest), and the defaults apply.
fn protected_paths(
    privileged: bool,
    own_userns: bool,
    asked: Option<&Vec<String>>,
    default: &[&str],
) -> Vec<String> {
    if privileged {
        return vec![];
    }
    match asked {
        Some(m) if !m.is_empty() => m.clone(),
        _ if own_userns => vec![],
        _ => default.iter().map(|s| s.to_string()).collect(),
    }
}

/// The first and last real-time signal as containers' programs number them: glibc keeps 32
/// and 33 for itself, and Go (kubelet, containerd's signal names) counts from 34 too.
const SIGRTMIN: i32 = 34;
const SIGRTMAX: i32 = 64;

/// The signal number for an image's StopSignal ("SIGQUIT", "QUIT", "3").
pub fn parse_signal(s: &str) -> Option<i32> {
    let s = s.trim();
    if s.is_empty() {
        return None;
    }
    if let Ok(n) = s.parse::<i32>() {
        return (1..=64).contains(&n).then_some(n);
    }
    let name = s.to_ascii_uppercase();
    let name = name.strip_prefix("SIG").unwrap_or(&name);
    let n = match name {
        "HUP" => libc::SIGHUP,
        "INT" => libc::SIGINT,
        "QUIT" => libc::SIGQUIT,
        "KILL" => libc::SIGKILL,
        "USR1" => libc::SIGUSR1,
        "USR2" => libc::SIGUSR2,
        "TERM" => libc::SIGTERM,
        "STOP" => libc::SIGSTOP,
        "CONT" => libc::SIGCONT,
        "WINCH" => libc::SIGWINCH,
        "PWR" => libc::SIGPWR,
        "ALRM" => libc::SIGALRM,
        "ABRT" | "IOT" => libc::SIGABRT,
        "BUS" => libc::SIGBUS,
        "CHLD" | "CLD" => libc::SIGCHLD,
        "FPE" => libc::SIGFPE,
        "ILL" => libc::SIGILL,
        "IO" | "POLL" => libc::SIGIO,
        "PIPE" => libc::SIGPIPE,
        "PROF" => libc::SIGPROF,
        "SEGV" => libc::SIGSEGV,
        "STKFLT" => libc::SIGSTKFLT,
        "SYS" => libc::SIGSYS,
        "TRAP" => libc::SIGTRAP,
        "TSTP" => libc::SIGTSTP,
        "TTIN" => libc::SIGTTIN,
        "TTOU" => libc::SIGTTOU,
        "URG" => libc::SIGURG,
        "VTALRM" => libc::SIGVTALRM,
        "XCPU" => libc::SIGXCPU,
        "XFSZ" => libc::SIGXFSZ,
        "RTMIN" => SIGRTMIN,
        "RTMAX" => SIGRTMAX,
        _ => {
            let n = if let Some(rest) = name.strip_prefix("RTMIN+") {
                SIGRTMIN + i32::from(rest.parse::<u8>().ok()?)
            } else if let Some(rest) = name.strip_prefix("RTMAX-") {
                SIGRTMAX - i32::from(rest.parse::<u8>().ok()?)
            } else {
                return None;
            };
            return (SIGRTMIN..=SIGRTMAX).contains(&n).then_some(n);
        }
    };
    Some(n)
}

/// The signal number of a CRI `Signal` (a container config's `stop_signal`, kubelet's
/// `lifecycle.stopSignal`): `None` for RUNTIME_DEFAULT (the image's, else SIGTERM) and for a
/// value this API does not define.
pub fn cri_signal(value: i32) -> Option<i32> {
    let s = cri::Signal::try_from(value).ok()?;
    if s == cri::Signal::RuntimeDefault {
        return None;
    }
    parse_signal(&s.as_str_name().replace("PLUS", "+").replace("MINUS", "-"))
}

/// The CRI `Signal` of a signal number (ContainerStatus's `stop_signal`): the first name
/// the API gives it (SIGABRT, not SIGIOT); RUNTIME_DEFAULT for a number it has no name for.
pub fn signal_to_cri(n: i32) -> cri::Signal {
    (1..=65)
        .find(|v| cri_signal(*v) == Some(n))
        .and_then(|v| cri::Signal::try_from(v).ok())
        .unwrap_or(cri::Signal::RuntimeDefault)
}

/// The swap limit (cgroup v1's memory+swap) for `r` where the node accounts swap: the
/// request's (-1: no limit), else, where memory is limited, the memory limit, so that a
/// container does not swap beyond its limit, as containerd makes it (kubelet sends none on
/// cgroup v1, nor crictl); 0 for none. Where swap is not accounted (a VM guest has no swap)
/// none, as containerd drops it: there is no file to write it to, and the start would fail.
pub fn default_swap(r: &cri::LinuxContainerResources, swap_accounting: bool) -> i64 {
    if !swap_accounting {
        return 0;
    }
    match (r.memory_swap_limit_in_bytes, r.memory_limit_in_bytes) {
        (0, limit) if limit > 0 => limit,
        (swap, _) => swap,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn layers_with(files: &[(&str, &str)]) -> (tempfile::TempDir, Vec<PathBuf>) {
        let (d, l) = crate::testing::temp_path("l0");
        for (p, content) in files {
            let full = l.join(p);
            fs::create_dir_all(full.parent().unwrap()).unwrap();
            fs::write(&full, content).unwrap();
        }
        (d, vec![l])
    }

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\nvessel:x:1000:1000::/home/vessel:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n";
    const GROUP: &str = "root:x:0:\nstaff:x:50:vessel\nvessel:x:1000:\nnobody:x:65534:\n";

    #[test]
    fn resources_that_cannot_be_honoured_are_refused() {
        let ok = cri::LinuxContainerResources {
            cpu_quota: -1,
            memory_swap_limit_in_bytes: -1,
            memory_limit_in_bytes: 64 << 20,
            oom_score_adj: -998,
            ..Default::default()
        };
        assert!(check_resources(&ok).is_ok());
        assert!(check_resources(&cri::LinuxContainerResources::default()).is_ok());
        for bad in [
            cri::LinuxContainerResources {
                cpu_shares: -2,
                ..Default::default()
            },
            cri::LinuxContainerResources {
                cpu_quota: -5,
                ..Default::default()
            },
            cri::LinuxContainerResources {
                memory_limit_in_bytes: -1,
                ..Default::default()
            },
            cri::LinuxContainerResources {
                memory_limit_in_bytes: 1,
                ..Default::default()
            },
            cri::LinuxContainerResources {
                oom_score_adj: 1001,
                ..Default::default()
            },
            cri::LinuxContainerResources {
                memory_limit_in_bytes: 64 << 20,
                memory_swap_limit_in_bytes: 32 << 20,
                ..Default::default()
            },
            cri::LinuxContainerResources {
                unified: [("../../../etc/x.y".to_string(), "1".to_string())].into(),
                ..Default::default()
            },
            cri::LinuxContainerResources {
                unified: [("cgroup.kill".to_string(), "1".to_string())].into(),
                ..Default::default()
            },
        ] {
            assert!(check_resources(&bad).is_err(), "{bad:?}");
        }
        let envs = |k: &str| {
            vec![cri::KeyValue {
                key: k.into(),
                value: "v".into(),
            }]
        };
        assert!(check_envs(&envs("GOOD_NAME")).is_ok());
        for k in ["", "A=B", "A\nB"] {
            assert!(check_envs(&envs(k)).is_err(), "{k:?}");
        }
    }

    #[test]
    fn updates_merge_into_the_resources_as_the_cgroup_takes_them() {
        let created = cri::LinuxContainerResources {
            cpu_shares: 256,
            cpu_quota: 50_000,
            cpu_period: 100_000,
            memory_limit_in_bytes: 64 << 20,
            oom_score_adj: 900,
            unified: [("memory.high".to_string(), "60M".to_string())].into(),
            ..Default::default()
        };
        // kubelet's CPU manager: the cpuset alone.
        let cpus = cri::LinuxContainerResources {
            cpuset_cpus: "2-3".into(),
            ..Default::default()
        };
        let r = merge_update(Some(created.clone()), &cpus, 0);
        assert_eq!(
            r,
            cri::LinuxContainerResources {
                cpuset_cpus: "2-3".into(),
                ..created.clone()
            }
        );
        // An in-place resize: every value it sends; no CPU limit any more (quota -1).
        let resize = cri::LinuxContainerResources {
            cpu_shares: 512,
            cpu_quota: -1,
            cpu_period: 100_000,
            memory_limit_in_bytes: 128 << 20,
            unified: [("memory.max".to_string(), "max".to_string())].into(),
            ..Default::default()
        };
        let r = merge_update(Some(r), &resize, 0);
        assert_eq!(
            (r.cpu_shares, r.cpu_quota, r.cpu_period),
            (512, -1, 100_000)
        );
        assert_eq!(r.memory_limit_in_bytes, 128 << 20);
        assert_eq!((r.cpuset_cpus.as_str(), r.oom_score_adj), ("2-3", 900));
        assert_eq!(r.unified.len(), 2);
        assert_eq!(merge_update(None, &cpus, 0), cpus);
        // Swap as the agent got it, and only with a memory limit.
        let r = merge_update(Some(created.clone()), &resize, 128 << 20);
        assert_eq!(r.memory_swap_limit_in_bytes, 128 << 20);
        let swap_only = cri::LinuxContainerResources {
            memory_swap_limit_in_bytes: 1 << 30,
            ..Default::default()
        };
        let r = merge_update(Some(created.clone()), &swap_only, 1 << 30);
        assert_eq!(r.memory_swap_limit_in_bytes, 0);
    }

    #[test]
    fn empty_protected_paths_are_none_only_in_a_user_namespace() {
        let asked = vec!["/proc/kcore".to_string()];
        let none = Vec::new();
        let default = ["/proc/acpi", "/proc/keys"];
        for userns in [false, true] {
            assert_eq!(
                protected_paths(false, userns, Some(&asked), &default),
                asked
            );
            assert!(protected_paths(true, userns, Some(&asked), &default).is_empty());
        }
        // kubelet's procMount: Unmasked (hostUsers: false only).
        assert!(protected_paths(false, true, Some(&none), &default).is_empty());
        assert!(protected_paths(false, true, None, &default).is_empty());
        // crictl and critest, which send none, outside a user namespace.
        assert_eq!(
            protected_paths(false, false, Some(&none), &default),
            default
        );
        assert_eq!(protected_paths(false, false, None, &default), default);
    }

    #[test]
    fn users_resolve_like_containerd() {
        let (_d, layers) = layers_with(&[("etc/passwd", PASSWD), ("etc/group", GROUP)]);
        let r = resolve_user(None, Some("vessel"), &layers).unwrap();
        assert_eq!(
            r,
            ResolvedUser {
                uid: 1000,
                gid: 1000,
                additional_gids: vec![50, 1000]
            }
        );
        let r = resolve_user(None, Some("1000:50"), &layers).unwrap();
        assert_eq!((r.uid, r.gid), (1000, 50));
        let r = resolve_user(None, Some("4242"), &layers).unwrap();
        assert_eq!((r.uid, r.gid), (4242, 0));
        let r = resolve_user(None, None, &layers).unwrap();
        assert_eq!((r.uid, r.gid), (0, 0));
        let sc = cri::LinuxContainerSecurityContext {
            run_as_user: Some(cri::Int64Value { value: 65534 }),
            run_as_group: Some(cri::Int64Value { value: 7 }),
            supplemental_groups: vec![8, 9],
            ..Default::default()
        };
        let r = resolve_user(Some(&sc), Some("vessel"), &layers).unwrap();
        assert_eq!(
            r,
            ResolvedUser {
                uid: 65534,
                gid: 7,
                additional_gids: vec![7, 8, 9]
            }
        );
        // Strict: the image's /etc/group adds nothing.
        let strict = cri::LinuxContainerSecurityContext {
            run_as_user: Some(cri::Int64Value { value: 1000 }),
            supplemental_groups: vec![1234],
            supplemental_groups_policy: cri::SupplementalGroupsPolicy::Strict as i32,
            ..Default::default()
        };
        let r = resolve_user(Some(&strict), None, &layers).unwrap();
        assert_eq!((r.gid, r.additional_gids), (1000, vec![1000, 1234]));
        let merge = cri::LinuxContainerSecurityContext {
            supplemental_groups_policy: cri::SupplementalGroupsPolicy::Merge as i32,
            ..strict
        };
        let r = resolve_user(Some(&merge), None, &layers).unwrap();
        assert_eq!(r.additional_gids, vec![50, 1000, 1234]);
        assert!(resolve_user(None, Some("ghost"), &layers).is_err());
        assert!(resolve_user(None, Some("vessel:nogroup"), &layers).is_err());
        // A group without a user is refused (upstream critest's "RunAsGroup without RunAsUser").
        let sc = cri::LinuxContainerSecurityContext {
            run_as_group: Some(cri::Int64Value { value: 7 }),
            ..Default::default()
        };
        let e = resolve_user(Some(&sc), Some("vessel"), &layers).unwrap_err();
        assert!(e.to_string().contains("run_as_group"), "{e}");
    }

    #[test]
    fn args_combine_like_containerd() {
        let img = RunConfig {
            entrypoint: Some(vec!["/ep".into()]),
            cmd: Some(vec!["c1".into()]),
            ..Default::default()
        };
        let cfg = |cmd: &[&str], args: &[&str]| cri::ContainerConfig {
            command: cmd.iter().map(|s| s.to_string()).collect(),
            args: args.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        assert_eq!(process_args(&cfg(&[], &[]), &img).unwrap(), ["/ep", "c1"]);
        assert_eq!(process_args(&cfg(&[], &["a"]), &img).unwrap(), ["/ep", "a"]);
        assert_eq!(process_args(&cfg(&["x"], &[]), &img).unwrap(), ["x"]);
        assert_eq!(
            process_args(&cfg(&["x"], &["y"]), &img).unwrap(),
            ["x", "y"]
        );
        assert!(process_args(&cfg(&[], &[]), &RunConfig::default()).is_err());
        // `ENTRYPOINT [""]` is none: the Cmd (or the request's args) runs.
        let cleared = RunConfig {
            entrypoint: Some(vec![String::new()]),
            cmd: Some(vec!["/bin/sh".into(), "-c".into(), "true".into()]),
            ..Default::default()
        };
        assert_eq!(
            process_args(&cfg(&[], &[]), &cleared).unwrap(),
            ["/bin/sh", "-c", "true"]
        );
        assert_eq!(process_args(&cfg(&[], &["a"]), &cleared).unwrap(), ["a"]);
    }

    #[test]
    fn env_overrides() {
        let img = RunConfig {
            env: Some(vec!["PATH=/bin".into(), "A=1".into()]),
            ..Default::default()
        };
        let cfg = cri::ContainerConfig {
            envs: vec![cri::KeyValue {
                key: "A".into(),
                value: "2".into(),
            }],
            ..Default::default()
        };
        let e = environment(&cfg, &img, "h");
        assert_eq!(e, ["PATH=/bin", "HOSTNAME=h", "A=2"]);
        // A terminal says what it is, unless the image or the request does.
        let tty = cri::ContainerConfig { tty: true, ..cfg };
        let e = environment(&tty, &img, "h");
        assert_eq!(e, ["PATH=/bin", "HOSTNAME=h", "TERM=xterm", "A=2"]);
        let img = RunConfig {
            env: Some(vec!["TERM=vt100".into()]),
            ..Default::default()
        };
        assert!(environment(&tty, &img, "h").contains(&"TERM=vt100".to_string()));
    }

    /// A spec for `cfg` (a shell command) in a plain image, flat or in a VM guest.
    fn simple_spec(cfg: &cri::ContainerConfig, vm_guest: bool) -> serde_json::Value {
        try_simple_spec(cfg, vm_guest).unwrap()
    }

    fn try_simple_spec(
        cfg: &cri::ContainerConfig,
        vm_guest: bool,
    ) -> std::result::Result<serde_json::Value, SpecError> {
        try_spec_in(cfg, vm_guest, true)
    }

    /// [`try_simple_spec`] in a pod whose agent has a pid namespace holder or not.
    fn try_spec_in(
        cfg: &cri::ContainerConfig,
        vm_guest: bool,
        pid_holder: bool,
    ) -> std::result::Result<serde_json::Value, SpecError> {
        let (d, layers) = layers_with(&[
            ("etc/passwd", PASSWD),
            ("etc/group", GROUP),
            ("bin/sh", "x"),
        ]);
        build(&SpecInput {
            pod: &cri::PodSandboxConfig::default(),
            config: cfg,
            image: &RunConfig::default(),
            layer_dirs: &layers,
            hostname: "h",
            pod_dir: d.path(),
            cgroups_path: "/vessel/p/c".into(),
            target_pid: None,
            cgroup_ns: false,
            apparmor: None,
            selinux: false,
            hugetlb: false,
            swap_accounting: !vm_guest,
            vm_guest,
            shared_shm: true,
            pid_holder,
        })
        .map(|(spec, _)| spec)
    }

    /// A pod from before pid namespace holders (its agent is PID 1 of the shared pid
    /// namespace, with the host's root) refuses a container there that may ptrace; one with
    /// a holder, or a VM pod, takes it.
    #[test]
    fn ptrace_in_the_shared_pid_namespace_of_an_old_pod_is_refused() {
        let cfg = cri::ContainerConfig {
            command: vec!["sh".into()],
            linux: Some(cri::LinuxContainerConfig {
                security_context: Some(cri::LinuxContainerSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        pid: cri::NamespaceMode::Pod as i32,
                        ..Default::default()
                    }),
                    capabilities: Some(cri::Capability {
                        add_capabilities: vec!["SYS_PTRACE".into()],
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let e = try_spec_in(&cfg, false, false).unwrap_err();
        assert!(e.to_string().contains("CAP_SYS_PTRACE"), "{e}");
        for (vm, holder) in [(false, true), (true, false)] {
            let spec = try_spec_in(&cfg, vm, holder).unwrap();
            let ns = spec["linux"]["namespaces"].as_array().unwrap();
            assert!(ns.contains(&serde_json::json!({"type": "pid", "path": "agent"})));
        }
        // Nor as an ambient capability, nor with ALL.
        for caps in [
            cri::Capability {
                add_ambient_capabilities: vec!["sys_ptrace".into()],
                ..Default::default()
            },
            cri::Capability {
                add_capabilities: vec!["all".into()],
                ..Default::default()
            },
        ] {
            let mut cfg = cfg.clone();
            let sc = cfg
                .linux
                .as_mut()
                .unwrap()
                .security_context
                .as_mut()
                .unwrap();
            sc.capabilities = Some(caps);
            let e = try_spec_in(&cfg, false, false).unwrap_err();
            assert!(e.to_string().contains("CAP_SYS_PTRACE"), "{e}");
        }
    }

    /// An ambient capability is added to every set after the drops, as the CRI API has it:
    /// "drop ALL, ambient NET_BIND_SERVICE" keeps that one capability.
    #[test]
    fn ambient_capabilities_survive_the_drops() {
        let cfg = cri::ContainerConfig {
            command: vec!["sh".into()],
            linux: Some(cri::LinuxContainerConfig {
                security_context: Some(cri::LinuxContainerSecurityContext {
                    capabilities: Some(cri::Capability {
                        add_ambient_capabilities: vec!["net_bind_service".into()],
                        drop_capabilities: vec!["ALL".into()],
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let caps = simple_spec(&cfg, false)["process"]["capabilities"].clone();
        for set in [
            "bounding",
            "effective",
            "permitted",
            "inheritable",
            "ambient",
        ] {
            assert_eq!(
                caps[set],
                serde_json::json!(["CAP_NET_BIND_SERVICE"]),
                "{set}: {caps}"
            );
        }
    }

    /// The host's cpusets (kubelet's CPU manager) are applied in a flat pod, not in a VM
    /// pod's guest, whose CPUs are its own.
    #[test]
    fn host_cpusets_stay_out_of_vm_guests() {
        let cfg = cri::ContainerConfig {
            command: vec!["sh".into()],
            linux: Some(cri::LinuxContainerConfig {
                resources: Some(cri::LinuxContainerResources {
                    cpuset_cpus: "6-7".into(),
                    cpuset_mems: "1".into(),
                    cpu_shares: 512,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let flat = simple_spec(&cfg, false);
        assert_eq!(flat["linux"]["resources"]["cpu"]["cpus"], "6-7");
        assert_eq!(flat["linux"]["resources"]["cpu"]["mems"], "1");
        let vm = simple_spec(&cfg, true);
        assert!(
            vm["linux"]["resources"]["cpu"].get("cpus").is_none(),
            "{vm}"
        );
        assert!(
            vm["linux"]["resources"]["cpu"].get("mems").is_none(),
            "{vm}"
        );
        assert_eq!(vm["linux"]["resources"]["cpu"]["shares"], 512);
    }

    /// /dev/shm: the pod's (kept by its agent) in the pod's IPC namespace, in a VM guest for
    /// the host's too; the host's for a flat container in the host's; its own tmpfs with its
    /// own IPC namespace.
    #[test]
    fn dev_shm_follows_the_ipc_namespace() {
        let shm_of = |ipc: Option<cri::NamespaceMode>, vm: bool| -> serde_json::Value {
            let cfg = cri::ContainerConfig {
                command: vec!["sh".into()],
                linux: Some(cri::LinuxContainerConfig {
                    security_context: ipc.map(|ipc| cri::LinuxContainerSecurityContext {
                        namespace_options: Some(cri::NamespaceOption {
                            ipc: ipc as i32,
                            ..Default::default()
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let spec = simple_spec(&cfg, vm);
            let shm = spec["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["destination"] == "/dev/shm")
                .cloned()
                .collect::<Vec<_>>();
            assert_eq!(shm.len(), 1, "{shm:?}");
            shm[0].clone()
        };
        let pod = shm_of(Some(cri::NamespaceMode::Pod), false);
        assert_eq!(pod["source"], vessel_agent::spec::POD_SHM);
        assert_eq!(pod["type"], "bind");
        let vm_node = shm_of(Some(cri::NamespaceMode::Node), true);
        assert_eq!(vm_node["source"], vessel_agent::spec::POD_SHM);
        if std::path::Path::new("/dev/shm").is_dir() {
            assert_eq!(
                shm_of(Some(cri::NamespaceMode::Node), false)["source"],
                "/dev/shm"
            );
        }
        for own in [
            shm_of(Some(cri::NamespaceMode::Container), false),
            shm_of(None, true),
        ] {
            assert_eq!(own["type"], "tmpfs", "{own}");
        }
    }

    /// The request's mounts go parents first (stable), replace the standard mount at their
    /// path (not /dev's: see below); oom_score_adj 0 is written.
    #[test]
    fn mounts_are_ordered_and_replace_the_standard_ones() {
        let src = tempfile::tempdir().unwrap();
        let src = src.path().display().to_string();
        let mount = |path: &str| cri::Mount {
            container_path: path.into(),
            host_path: src.clone(),
            ..Default::default()
        };
        let build_with = |paths: &[&str]| {
            let cfg = cri::ContainerConfig {
                command: vec!["sh".into()],
                mounts: paths.iter().map(|p| mount(p)).collect(),
                linux: Some(cri::LinuxContainerConfig {
                    resources: Some(cri::LinuxContainerResources::default()),
                    ..Default::default()
                }),
                ..Default::default()
            };
            simple_spec(&cfg, false)
        };
        let dests = |spec: &serde_json::Value| -> Vec<String> {
            spec["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["destination"].as_str().unwrap().to_string())
                .collect()
        };
        let spec = build_with(&["/a/b/c", "/x", "/a/b", "/dev/shm/", "/a", "/y"]);
        let got = dests(&spec);
        let tail: Vec<&str> = got[got.len() - 6..].iter().map(String::as_str).collect();
        assert_eq!(tail, ["/x", "/a", "/y", "/a/b", "/dev/shm/", "/a/b/c"]);
        assert_eq!(got.iter().filter(|d| d.starts_with("/dev/shm")).count(), 1);
        assert_eq!(spec["process"]["oomScoreAdj"], 0);
        // At /dev: the standard tmpfs and those below it stay, for the runtime's nodes (the
        // agent puts the request's over them once the container is made), then the
        // request's. Refused in a VM pod, whose guest has its own devices.
        let cfg = cri::ContainerConfig {
            command: vec!["sh".into()],
            mounts: vec![mount("/dev/")],
            ..Default::default()
        };
        let spec = simple_spec(&cfg, false);
        let got = dests(&spec);
        let devs: Vec<(&str, &str)> = spec["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| {
                m["destination"]
                    .as_str()
                    .is_some_and(|d| d.starts_with("/dev"))
            })
            .map(|m| {
                (
                    m["destination"].as_str().unwrap(),
                    m["type"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            devs,
            [
                ("/dev", "tmpfs"),
                ("/dev/pts", "devpts"),
                ("/dev/shm", "tmpfs"),
                ("/dev/mqueue", "mqueue"),
                ("/dev/", "bind")
            ],
            "{got:?}"
        );
        let e = try_simple_spec(&cfg, true).unwrap_err();
        assert!(e.to_string().contains("VM pod"), "{e}");
        // Spelt with `..`, it is /dev all the same.
        let cfg = cri::ContainerConfig {
            mounts: vec![mount("/x/../dev")],
            ..cfg
        };
        let e = try_simple_spec(&cfg, true).unwrap_err();
        assert!(e.to_string().contains("VM pod"), "{e}");
    }

    /// A memory limit caps swap too where swap is accounted, unless the request says.
    #[test]
    fn swap_defaults_to_the_memory_limit() {
        let r = |limit: i64, swap: i64| cri::LinuxContainerResources {
            memory_limit_in_bytes: limit,
            memory_swap_limit_in_bytes: swap,
            ..Default::default()
        };
        assert_eq!(default_swap(&r(64, 0), true), 64);
        assert_eq!(default_swap(&r(64, 0), false), 0);
        assert_eq!(default_swap(&r(64, 128), true), 128);
        assert_eq!(default_swap(&r(64, 128), false), 0, "nowhere to write it");
        assert_eq!(default_swap(&r(64, -1), true), -1, "unlimited");
        assert_eq!(default_swap(&r(64, -1), false), 0);
        assert_eq!(default_swap(&r(0, 0), true), 0);
        let cfg = cri::ContainerConfig {
            command: vec!["sh".into()],
            linux: Some(cri::LinuxContainerConfig {
                resources: Some(r(64 << 20, 0)),
                ..Default::default()
            }),
            ..Default::default()
        };
        let spec = simple_spec(&cfg, false);
        assert_eq!(spec["linux"]["resources"]["memory"]["swap"], 64 << 20);
    }

    #[test]
    fn caps_add_drop() {
        let sc = cri::LinuxContainerSecurityContext {
            capabilities: Some(cri::Capability {
                add_capabilities: vec!["SYS_ADMIN".into()],
                drop_capabilities: vec!["CAP_KILL".into(), "net_raw".into()],
                ..Default::default()
            }),
            ..Default::default()
        };
        let c = capabilities(Some(&sc), false);
        assert!(c.contains(&"CAP_SYS_ADMIN".to_string()));
        assert!(!c.contains(&"CAP_KILL".to_string()));
        assert!(!c.contains(&"CAP_NET_RAW".to_string()));
        let sc = cri::LinuxContainerSecurityContext {
            capabilities: Some(cri::Capability {
                add_capabilities: vec!["NET_ADMIN".into()],
                drop_capabilities: vec!["ALL".into()],
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(capabilities(Some(&sc), false), ["CAP_NET_ADMIN"]);
        assert_eq!(capabilities(None, true).len(), ALL_CAPS.len());
    }

    #[test]
    #[allow(deprecated)]
    fn deprecated_seccomp_path_is_read() {
        let sc = |p: &str| cri::LinuxContainerSecurityContext {
            seccomp_profile_path: p.into(),
            ..Default::default()
        };
        let f = |p: &str| seccomp::profile(Some(&sc(p)), false, &[], false);
        assert!(f("runtime/default").unwrap().is_some());
        assert!(f("docker/default").unwrap().is_some());
        assert!(f("unconfined").unwrap().is_none());
        assert!(f("").unwrap().is_none());
        let e = f("localhost//no/such/profile.json").unwrap_err();
        assert!(e.to_string().contains("/no/such/profile.json"), "{e}");
        let e = f("sometimes").unwrap_err().to_string();
        assert!(e.contains("localhost/<path>") && !e.contains('\n'), "{e}");
    }

    #[test]
    fn signals_parse() {
        assert_eq!(parse_signal("SIGQUIT"), Some(libc::SIGQUIT));
        assert_eq!(parse_signal("term"), Some(libc::SIGTERM));
        assert_eq!(parse_signal("9"), Some(9));
        assert_eq!(parse_signal("SIGRTMIN+3"), Some(37));
        assert_eq!(parse_signal("bogus"), None);
        assert_eq!(parse_signal(""), None);
        assert_eq!(parse_signal("SIGRTMIN+99"), None);
        assert_eq!(parse_signal("SIGRTMIN+2147483647"), None);
        assert_eq!(parse_signal("RTMAX--2147483648"), None);
        assert_eq!(parse_signal("RTMAX-4"), Some(60));
    }

    #[test]
    fn every_cri_signal_has_its_own_number_and_comes_back() {
        assert_eq!(cri_signal(cri::Signal::RuntimeDefault as i32), None);
        assert_eq!(cri_signal(9999), None);
        assert_eq!(cri_signal(cri::Signal::Sigquit as i32), Some(libc::SIGQUIT));
        assert_eq!(cri_signal(cri::Signal::Sigrtmin as i32), Some(34));
        assert_eq!(cri_signal(cri::Signal::Sigrtminplus15 as i32), Some(49));
        assert_eq!(cri_signal(cri::Signal::Sigrtmaxminus14 as i32), Some(50));
        assert_eq!(cri_signal(cri::Signal::Sigrtmax as i32), Some(64));
        // Names the API gives one number to (SIGIOT, SIGCLD, SIGPOLL) come back as the first;
        // every other name has a number of its own.
        let aliases = [
            cri::Signal::Sigiot,
            cri::Signal::Sigcld,
            cri::Signal::Sigpoll,
        ];
        let mut seen = std::collections::HashSet::new();
        for v in 1..=65 {
            let n = cri_signal(v).unwrap_or_else(|| panic!("CRI signal {v} has no number"));
            if aliases.iter().any(|a| *a as i32 == v) {
                assert!(seen.contains(&n), "{v}");
                continue;
            }
            assert!(seen.insert(n), "CRI signal {v}: number {n} twice");
            assert_eq!(signal_to_cri(n) as i32, v);
        }
        assert_eq!(seen.len(), 62);
        assert_eq!(signal_to_cri(libc::SIGTERM), cri::Signal::Sigterm);
        assert_eq!(signal_to_cri(libc::SIGIO), cri::Signal::Sigio);
        assert_eq!(signal_to_cri(0), cri::Signal::RuntimeDefault);
    }

    #[test]
    fn spec_is_valid_oci() {
        let (d, layers) = layers_with(&[
            ("etc/passwd", PASSWD),
            ("etc/group", GROUP),
            ("bin/sh", "x"),
        ]);
        let pod = cri::PodSandboxConfig::default();
        let cfg = cri::ContainerConfig {
            command: vec!["sh".into()],
            linux: Some(cri::LinuxContainerConfig {
                resources: Some(cri::LinuxContainerResources {
                    memory_limit_in_bytes: 64 << 20,
                    cpu_shares: 512,
                    oom_score_adj: -999,
                    hugepage_limits: vec![cri::HugepageLimit {
                        page_size: "2MB".into(),
                        limit: 4 << 20,
                    }],
                    ..Default::default()
                }),
                security_context: Some(cri::LinuxContainerSecurityContext {
                    seccomp: Some(cri::SecurityProfile {
                        profile_type: cri::security_profile::ProfileType::RuntimeDefault as i32,
                        ..Default::default()
                    }),
                    apparmor: Some(cri::SecurityProfile {
                        profile_type: cri::security_profile::ProfileType::Localhost as i32,
                        localhost_ref: "vessel-test".into(),
                    }),
                    capabilities: Some(cri::Capability {
                        add_ambient_capabilities: vec!["NET_ADMIN".into()],
                        ..Default::default()
                    }),
                    selinux_options: Some(cri::SeLinuxOption {
                        level: "s0:c1,c2".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
            }),
            ..Default::default()
        };
        let (spec, user) = build(&SpecInput {
            pod: &pod,
            config: &cfg,
            image: &RunConfig {
                user: Some("vessel".into()),
                ..Default::default()
            },
            layer_dirs: &layers,
            hostname: "h",
            pod_dir: d.path(),
            cgroups_path: "/vessel/p/c".into(),
            target_pid: None,
            cgroup_ns: false,
            apparmor: Some(&["vessel-test".to_string()].into()),
            selinux: true,
            hugetlb: true,
            swap_accounting: true,
            vm_guest: false,
            shared_shm: true,
            pid_holder: true,
        })
        .unwrap();
        assert_eq!(user.uid, 1000);
        assert_eq!(spec["process"]["apparmorProfile"], "vessel-test");
        assert_eq!(
            spec["process"]["selinuxLabel"],
            "system_u:system_r:container_t:s0:c1,c2"
        );
        let caps = &spec["process"]["capabilities"];
        assert_eq!(caps["ambient"], json!(["CAP_NET_ADMIN"]));
        for set in ["bounding", "effective", "permitted", "inheritable"] {
            assert!(
                caps[set]
                    .as_array()
                    .unwrap()
                    .contains(&json!("CAP_NET_ADMIN")),
                "{set}: {caps}"
            );
        }
        assert_eq!(
            spec["linux"]["resources"]["hugepageLimits"],
            json!([{"pageSize": "2MB", "limit": 4 << 20}])
        );
        // Passed as asked; the agent clamps what it may not set (tested in guest-agent).
        assert_eq!(spec["process"]["oomScoreAdj"], -999);
        let parsed: oci_spec::runtime::Spec = serde_json::from_value(spec.clone()).unwrap();
        // Every key we wrote is one oci-spec knows: nothing is silently dropped.
        let back = serde_json::to_value(&parsed).unwrap();
        fn keys(v: &Value, prefix: &str, out: &mut Vec<String>) {
            if let Value::Object(m) = v {
                for (k, v) in m {
                    if prefix == ".annotations" || prefix == ".linux.sysctl" {
                        continue;
                    }
                    let p = format!("{prefix}.{k}");
                    out.push(p.clone());
                    keys(v, &p, out);
                }
            }
        }
        let (mut a, mut b) = (vec![], vec![]);
        keys(&spec, "", &mut a);
        keys(&back, "", &mut b);
        let missing: Vec<_> = a.iter().filter(|k| !b.contains(k)).collect();
        // `hostname: null` and empty lists may be omitted on the way back; names may not.
        let missing: Vec<_> = missing
            .into_iter()
            .filter(|k| !matches!(k.as_str(), ".linux.devices" | ".linux.sysctl"))
            .collect();
        assert!(
            missing.is_empty(),
            "keys oci-spec does not know: {missing:?}"
        );
        let (_, _) = (d, layers);
    }
}
