//! `vesseld doctor`: checks a node the way an operator would before (or after) switching it
//! to vessel, and says what to fix. Each check ends `ok`, `hint` (vessel runs fully; a node
//! setting would make it faster), `warn` (vessel runs, with less: flat pods only, loopback
//! only) or `fail` (vessel cannot run pods as configured).

use crate::config::Config;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Ok,
    Hint,
    Warn,
    Fail,
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Level::Ok => "ok",
            Level::Hint => "hint",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        })
    }
}

/// One check's outcome: what was found, and what to do about it when it is not ok.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: &'static str,
    pub level: Level,
    pub found: String,
    pub fix: String,
}

fn check(name: &'static str, level: Level, found: String, fix: &str) -> Check {
    Check {
        name,
        level,
        found,
        fix: fix.to_string(),
    }
}

/// Runs every check. `kvm_probe` runs the KVM calibration guest (a second or so).
pub fn run(c: &Config, kvm_probe: bool) -> Vec<Check> {
    let mut out = vec![root(), overlayfs(), cgroups(), cgroup_driver(c)];
    out.push(cgroup_migrations(
        &std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default(),
    ));
    out.push(file(
        "pod agent",
        &c.agent_binary(),
        Level::Fail,
        "install vessel-agent (scripts/install.sh) or set runtime.agent_binary",
    ));
    out.push(cni(c));
    if kvm_probe {
        out.push(kvm());
    }
    let vm_files = [
        ("guest kernel", c.vm.kernel.clone()),
        ("guest root", c.guest_root().path().to_path_buf()),
        ("VM shim", c.shim_binary()),
    ];
    for (what, p) in vm_files {
        out.push(file(
            what,
            &p,
            Level::Warn,
            "VM pods need it: scripts/install.sh builds it (or set the [vm] path); flat pods run without",
        ));
    }
    out.extend(registries(c));
    out
}

fn root() -> Check {
    if rustix::process::geteuid().is_root() {
        check("root", Level::Ok, "running as root".into(), "")
    } else {
        check(
            "root",
            Level::Fail,
            "not root".into(),
            "run vesseld as root: it mounts, creates namespaces and cgroups",
        )
    }
}

fn overlayfs() -> Check {
    let fs = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if fs.lines().any(|l| l.trim_end().ends_with("overlay")) {
        check(
            "overlayfs",
            Level::Ok,
            "the kernel has overlayfs".into(),
            "",
        )
    } else {
        check(
            "overlayfs",
            Level::Fail,
            "overlayfs is not in /proc/filesystems".into(),
            "modprobe overlay (and add it to /etc/modules-load.d/)",
        )
    }
}

fn cgroups() -> Check {
    let v2 = crate::spec::host_is_cgroup_v2();
    let want = ["cpu", "memory", "pids"];
    let have: Vec<&str> = if v2 {
        let ctl = std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers").unwrap_or_default();
        want.iter()
            .copied()
            .filter(|w| ctl.split_whitespace().any(|c| c == *w))
            .collect()
    } else {
        want.iter()
            .copied()
            .filter(|w| {
                crate::sandbox::cgroup::cgroup_dirs("").iter().any(|d| {
                    d.file_name()
                        .is_some_and(|n| n.to_string_lossy().split(',').any(|c| c == *w))
                })
            })
            .collect()
    };
    let missing: Vec<&str> = want.iter().copied().filter(|w| !have.contains(w)).collect();
    let mode = if v2 {
        "cgroup v2"
    } else {
        "cgroup v1 (or hybrid)"
    };
    if missing.is_empty() {
        check(
            "cgroups",
            Level::Ok,
            format!("{mode}; controllers {}", want.join(", ")),
            "",
        )
    } else {
        check(
            "cgroups",
            Level::Fail,
            format!("{mode}; missing controllers: {}", missing.join(", ")),
            "enable them (kernel command line cgroup_enable=..., or the controllers of the root cgroup)",
        )
    }
}

/// The configured cgroup driver can work: `systemd` needs systemd as init and its D-Bus
/// socket (vesseld does not start otherwise).
fn cgroup_driver(c: &Config) -> Check {
    use crate::config::CgroupDriver;
    match c.runtime.cgroup_driver {
        CgroupDriver::Cgroupfs => check(
            "cgroup driver",
            Level::Ok,
            "cgroupfs (kubelet's cgroupDriver must be cgroupfs too)".into(),
            "",
        ),
        CgroupDriver::Systemd if !crate::sandbox::systemd::booted() => check(
            "cgroup driver",
            Level::Fail,
            "systemd, but systemd is not the init system here".into(),
            "set runtime.cgroup_driver = \"cgroupfs\" (and kubelet's cgroupDriver: cgroupfs)",
        ),
        CgroupDriver::Systemd => {
            let sock = ["/run/systemd/private", "/run/dbus/system_bus_socket"]
                .into_iter()
                .find(|p| Path::new(p).exists());
            match sock {
                Some(s) => check(
                    "cgroup driver",
                    Level::Ok,
                    format!("systemd, over {s} (kubelet's cgroupDriver must be systemd too)"),
                    "",
                ),
                None => check(
                    "cgroup driver",
                    Level::Fail,
                    "systemd, but neither /run/systemd/private nor the system bus is there".into(),
                    "check that systemd runs as PID 1 and that vesseld runs as root",
                ),
            }
        }
    }
}

/// Whether a cgroup hierarchy is mounted with `favordynmods` (Linux 6.0+), from a mountinfo
/// text. Without it, the first move of a process into a cgroup after a quiet spell waits for
/// an RCU grace period (the kernel's cgroup_threadgroup_rwsem): every container start does
/// one. Measured with critest's benchmark on a 2-vCPU VM (cgroup v1, hybrid): StartContainer
/// 19 ms without, 11 ms with. runc pays the same wait.
fn cgroup_migrations(mountinfo: &str) -> Check {
    let set = mountinfo.lines().any(|l| {
        let Some((_, right)) = l.split_once(" - ") else {
            return false;
        };
        let mut r = right.split_whitespace();
        let fstype = r.next().unwrap_or_default();
        let _source = r.next();
        let opts = r.next().unwrap_or_default();
        (fstype == "cgroup" || fstype == "cgroup2") && opts.split(',').any(|o| o == "favordynmods")
    });
    if set {
        check(
            "cgroup moves",
            Level::Ok,
            "favordynmods: container starts do not wait for an RCU grace period".into(),
            "",
        )
    } else {
        check(
            "cgroup moves",
            Level::Hint,
            "no cgroup mount has favordynmods: each container start waits for an RCU grace period (~8 ms measured)".into(),
            "mount -o remount,favordynmods /sys/fs/cgroup (Linux 6.0+; cgroup v1/hybrid: /sys/fs/cgroup/unified; forks and exits get slightly dearer); until reboot: make it part of how the host mounts cgroups",
        )
    }
}

fn file(name: &'static str, p: &Path, if_missing: Level, fix: &str) -> Check {
    if p.is_file() {
        check(name, Level::Ok, p.display().to_string(), "")
    } else {
        check(name, if_missing, format!("{} is missing", p.display()), fix)
    }
}

fn cni(c: &Config) -> Check {
    use crate::cni::CniError;
    match c.cni().ready() {
        Ok(net) => check(
            "CNI",
            Level::Ok,
            format!(
                "network {:?} from {} (plugins {})",
                net.name,
                net.source.display(),
                net.plugin_types().collect::<Vec<_>>().join(", ")
            ),
            "",
        ),
        Err(e @ CniError::NoConfig(_)) => check(
            "CNI",
            Level::Warn,
            e.to_string(),
            "pods get loopback only: put a network config (*.conflist) in cni.conf_dir and its plugins in cni.bin_dirs",
        ),
        Err(e) => check(
            "CNI",
            Level::Fail,
            e.to_string(),
            "fix the network config or install the plugin it names",
        ),
    }
}

fn kvm() -> Check {
    let p = vessel_vmm::probe::probe();
    let found = format!("KVM {}: {}", p.verdict, p.reason);
    if p.verdict == vessel_vmm::probe::Verdict::Usable {
        check("KVM", Level::Ok, found, "")
    } else {
        check(
            "KVM",
            Level::Warn,
            found,
            "VM pods run flat (runtime.vm_fallback); microVMs need hardware virtualization (vmx/svm) and /dev/kvm",
        )
    }
}

/// Registry settings: the TLS files and auth file they name can be read, and every mirror
/// answers a TCP connection (the registries themselves are checked at pull time).
fn registries(c: &Config) -> Vec<Check> {
    let mut out = Vec::new();
    let pem = |host: &str, what: &str, p: &Path, out: &mut Vec<Check>| {
        let (found, fix) = match std::fs::read_to_string(p) {
            Ok(t) if t.contains("-----BEGIN ") => return,
            Ok(_) => (
                format!("{host}: {what} {} holds no PEM block", p.display()),
                "give a PEM file",
            ),
            Err(e) => (
                format!("{host}: {what} {}: {e}", p.display()),
                "pulls from this registry fail until the file is there",
            ),
        };
        out.push(check("registry TLS", Level::Fail, found, fix));
    };
    for (host, r) in &c.images.registries {
        for (what, p) in tls_files(&r.ca_file, &r.client_cert, &r.client_key) {
            pem(host, what, p, &mut out);
        }
        for m in &r.mirrors {
            for (what, p) in tls_files(&m.ca_file, &m.client_cert, &m.client_key) {
                pem(host, &format!("mirror {} {what}", m.url), p, &mut out);
            }
            let Some(addr) = vessel_images::hosts::mirror_addr(&m.url) else {
                out.push(check(
                    "registry mirror",
                    Level::Fail,
                    format!("{host}: mirror {:?} is not a host[:port] URL", m.url),
                    "write mirrors as https://host[:port][/prefix]",
                ));
                continue;
            };
            let reach = std::net::ToSocketAddrs::to_socket_addrs(&addr.as_str())
                .ok()
                .and_then(|mut a| a.next())
                .map(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(3)));
            let m = &m.url;
            match reach {
                Some(Ok(_)) => out.push(check(
                    "registry mirror",
                    Level::Ok,
                    format!("{host}: {m} answers"),
                    "",
                )),
                Some(Err(e)) => out.push(check(
                    "registry mirror",
                    Level::Warn,
                    format!("{host}: {m}: {e}"),
                    "pulls fall through to the next mirror or the registry itself (unless mirrors_only)",
                )),
                None => out.push(check(
                    "registry mirror",
                    Level::Warn,
                    format!("{host}: {m}: the name does not resolve"),
                    "pulls fall through to the next mirror or the registry itself (unless mirrors_only)",
                )),
            }
        }
    }
    let auth = &c.images.auth_file;
    if !auth.as_os_str().is_empty() {
        let parsed = std::fs::read(auth).map(|b| serde_json::from_slice::<serde_json::Value>(&b));
        match parsed {
            Ok(Ok(v)) if v.get("auths").is_some_and(|a| a.is_object()) => out.push(check(
                "registry auth",
                Level::Ok,
                format!("{} has credentials for {} registries", auth.display(), v["auths"].as_object().map_or(0, |a| a.len())),
                "",
            )),
            Ok(Ok(_)) => out.push(check(
                "registry auth",
                Level::Warn,
                format!("{} has no \"auths\" object", auth.display()),
                "write it as docker's config.json: {\"auths\": {\"host\": {\"auth\": \"base64(user:password)\"}}}",
            )),
            Ok(Err(e)) => out.push(check(
                "registry auth",
                Level::Fail,
                format!("{}: {e}", auth.display()),
                "pulls ignore the file until it is valid JSON",
            )),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => out.push(check(
                "registry auth",
                Level::Warn,
                format!("{} does not exist", auth.display()),
                "pulls use kubelet's credentials only; create the file or set images.auth_file = \"\"",
            )),
            Err(e) => out.push(check(
                "registry auth",
                Level::Fail,
                format!("{}: {e}", auth.display()),
                "make the file readable by root",
            )),
        }
    }
    out
}

/// The TLS files that a registry or mirror section names, by their setting's name.
fn tls_files<'a>(
    ca_file: &'a Option<PathBuf>,
    client_cert: &'a Option<PathBuf>,
    client_key: &'a Option<PathBuf>,
) -> impl Iterator<Item = (&'static str, &'a Path)> {
    [
        ("ca_file", ca_file),
        ("client_cert", client_cert),
        ("client_key", client_key),
    ]
    .into_iter()
    .filter_map(|(what, p)| Some((what, p.as_deref()?)))
}

/// The report as printed, and whether vessel can run pods as configured (no `FAIL`).
pub fn report(checks: &[Check]) -> (String, bool) {
    let mut s = String::new();
    for c in checks {
        s.push_str(&format!(
            "{:<5} {:<16} {}\n",
            c.level.to_string(),
            c.name,
            c.found
        ));
        if c.level != Level::Ok && !c.fix.is_empty() {
            s.push_str(&format!("{:<5} {:<16} -> {}\n", "", "", c.fix));
        }
    }
    let ok = checks.iter().all(|c| c.level != Level::Fail);
    (s, ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn favordynmods_is_found_on_any_cgroup_mount() {
        let plain = "35 24 0:30 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n\
                     36 24 0:31 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n";
        assert_eq!(cgroup_migrations(plain).level, Level::Hint);
        let set =
            "35 24 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate,favordynmods\n";
        assert_eq!(cgroup_migrations(set).level, Level::Ok);
        // Another filesystem's option of that name does not count.
        let other = "40 24 0:40 / /mnt rw - tmpfs tmpfs rw,favordynmods\n";
        assert_eq!(cgroup_migrations(other).level, Level::Hint);
    }

    #[test]
    fn a_node_without_its_files_is_told_what_to_fix() {
        let d = tempfile::tempdir().unwrap();
        let mut c = Config::default();
        c.runtime.agent_binary = d.path().join("no-agent").display().to_string();
        c.vm.kernel = d.path().join("no-kernel");
        c.cni.conf_dir = d.path().join("no-cni");
        let checks = run(&c, false);
        let (text, ok) = report(&checks);
        assert!(!ok, "{text}");
        let agent = checks.iter().find(|c| c.name == "pod agent").unwrap();
        assert_eq!(agent.level, Level::Fail, "{text}");
        assert!(
            text.contains("no-agent is missing") && text.contains("-> install vessel-agent"),
            "{text}"
        );
        let kernel = checks.iter().find(|c| c.name == "guest kernel").unwrap();
        assert_eq!(kernel.level, Level::Warn);
        let cni = checks.iter().find(|c| c.name == "CNI").unwrap();
        assert_eq!(cni.level, Level::Warn, "{text}");
    }

    #[test]
    fn registry_files_are_checked() {
        let d = tempfile::tempdir().unwrap();
        let mut c = Config::default();
        let junk = d.path().join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let auth = d.path().join("auth.json");
        std::fs::write(&auth, r#"{"auths": {"r:5000": {"auth": "dTpw"}}}"#).unwrap();
        c.images.auth_file = auth.clone();
        let mut r = vessel_images::RegistryConfig {
            ca_file: Some(junk),
            ..Default::default()
        };
        r.mirrors
            .push(vessel_images::Mirror(vessel_images::MirrorConfig {
                client_cert: Some(d.path().join("gone.pem")),
                ..vessel_images::MirrorConfig::from("http://127.0.0.1:9")
            }));
        c.images.registries.insert("r:5000".into(), r);
        let checks = registries(&c);
        let (text, _) = report(&checks);
        assert!(text.contains("junk.pem holds no PEM block"), "{text}");
        assert!(
            text.contains("mirror http://127.0.0.1:9 client_cert"),
            "{text}"
        );
        assert!(text.contains("credentials for 1 registries"), "{text}");
        std::fs::write(&auth, "{").unwrap();
        let (text, _) = report(&registries(&c));
        assert!(text.contains("FAIL  registry auth"), "{text}");
    }
}
