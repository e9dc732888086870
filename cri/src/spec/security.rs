//! Confinement defaults: capabilities, masked and read-only paths, SELinux labels.

use vessel_cri_api::v1 as cri;

/// Capabilities a container gets by default (containerd's and Docker's set).
pub use vessel_agent::spec::DEFAULT_CAPS;

/// Every capability Linux 5.9+ knows, for privileged containers and "ALL".
pub const ALL_CAPS: &[&str] = &[
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

pub(super) const DEFAULT_MASKED: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

pub(super) const DEFAULT_READONLY: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// The ambient capabilities a container asks for (CRI `add_ambient_capabilities`).
pub(super) fn ambient_capabilities(sc: Option<&cri::LinuxContainerSecurityContext>) -> Vec<String> {
    // Added to every set after the drops (the CRI API: an ambient capability "gets added to
    // all sets"): "drop ALL, ambient NET_BIND_SERVICE" is how a non-root container keeps
    // only what it needs.
    let mut out: Vec<String> = Vec::new();
    for a in sc
        .and_then(|s| s.capabilities.as_ref())
        .into_iter()
        .flat_map(|c| c.add_ambient_capabilities.iter())
    {
        let a = norm_cap(a);
        if !out.contains(&a) {
            out.push(a);
        }
    }
    out
}

/// `CAP_X` for `x`, `X` or `CAP_X`.
fn norm_cap(c: &str) -> String {
    let c = c.trim().to_ascii_uppercase();
    if c.starts_with("CAP_") {
        c
    } else {
        format!("CAP_{c}")
    }
}

/// The SELinux labels of a container.
pub struct SelinuxLabel {
    pub process: String,
}

/// The SELinux process label for the container's `selinux_options`, where SELinux is enabled
/// where it runs (`enabled`); parts left empty take container-selinux's defaults. Without
/// SELinux there is nothing to label with, which is logged at debug level, as containerd does.
pub(super) fn selinux_label(
    sc: Option<&cri::LinuxContainerSecurityContext>,
    enabled: bool,
) -> Option<SelinuxLabel> {
    let o = sc.and_then(|s| s.selinux_options.as_ref())?;
    if o.user.is_empty() && o.role.is_empty() && o.r#type.is_empty() && o.level.is_empty() {
        return None;
    }
    if !enabled {
        tracing::debug!(options = ?o, "SELinux is not enabled here: the container's label is not applied");
        return None;
    }
    let or = |v: &str, d: &str| {
        if v.is_empty() {
            d.to_string()
        } else {
            v.to_string()
        }
    };
    Some(SelinuxLabel {
        process: format!(
            "{}:{}:{}:{}",
            or(&o.user, "system_u"),
            or(&o.role, "system_r"),
            or(&o.r#type, "container_t"),
            or(&o.level, "s0")
        ),
    })
}

pub(super) fn capabilities(
    sc: Option<&cri::LinuxContainerSecurityContext>,
    privileged: bool,
) -> Vec<String> {
    if privileged {
        return ALL_CAPS.iter().map(|s| s.to_string()).collect();
    }
    let norm = norm_cap;
    let mut caps: Vec<String> = DEFAULT_CAPS.iter().map(|s| s.to_string()).collect();
    if let Some(c) = sc.and_then(|sc| sc.capabilities.as_ref()) {
        if c.add_capabilities
            .iter()
            .any(|x| x.eq_ignore_ascii_case("ALL"))
        {
            caps = ALL_CAPS.iter().map(|s| s.to_string()).collect();
        } else {
            for a in &c.add_capabilities {
                let a = norm(a);
                if !caps.contains(&a) {
                    caps.push(a);
                }
            }
        }
        if c.drop_capabilities
            .iter()
            .any(|x| x.eq_ignore_ascii_case("ALL"))
        {
            caps.clear();
            // Explicit adds survive "drop ALL", as in containerd.
            for a in &c.add_capabilities {
                if !a.eq_ignore_ascii_case("ALL") {
                    caps.push(norm(a));
                }
            }
        } else {
            let drop: Vec<String> = c.drop_capabilities.iter().map(|d| norm(d)).collect();
            caps.retain(|x| !drop.contains(x));
        }
    }
    caps
}
