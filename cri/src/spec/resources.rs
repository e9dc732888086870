//! Checks of a container's resources and environment before anything is created.

use super::{invalid, SpecError};
use vessel_cri_api::v1 as cri;

/// The smallest memory limit a container may have (Docker's bound): below it the kernel
/// refuses the limit or the container cannot even start its init.
pub const MIN_MEMORY_LIMIT: i64 = 6 << 20;

/// Resources that cannot be honoured are refused, not ignored: negative values, a memory
/// limit too small to start a process, an oom_score_adj out of the kernel's range.
pub fn check_resources(r: &cri::LinuxContainerResources) -> Result<(), SpecError> {
    for (name, v) in [("cpu_shares", r.cpu_shares), ("cpu_period", r.cpu_period)] {
        if v < 0 {
            return Err(invalid(format!("resources: {name} {v} is negative")));
        }
    }
    // -1 is the cgroup's own word for "no limit" (kubelet sends it for unlimited swap).
    for (name, v) in [
        ("cpu_quota", r.cpu_quota),
        ("memory_swap_limit_in_bytes", r.memory_swap_limit_in_bytes),
    ] {
        if v < -1 {
            return Err(invalid(format!("resources: {name} {v} is negative")));
        }
    }
    if r.memory_limit_in_bytes < 0
        || (r.memory_limit_in_bytes > 0 && r.memory_limit_in_bytes < MIN_MEMORY_LIMIT)
    {
        return Err(invalid(format!(
            "resources: memory_limit_in_bytes {} is below the minimum of {MIN_MEMORY_LIMIT} bytes",
            r.memory_limit_in_bytes
        )));
    }
    // Swap is v1's memory+swap: less than the memory limit is no limit the kernel takes
    // (libcontainer refuses it at the start, v1 at the write).
    let (limit, swap) = (r.memory_limit_in_bytes, r.memory_swap_limit_in_bytes);
    if limit > 0 && swap > 0 && swap < limit {
        return Err(invalid(format!(
            "resources: memory_swap_limit_in_bytes {swap} is below memory_limit_in_bytes {limit} (it counts memory and swap together)"
        )));
    }
    // Written by name into the container's cgroup: a file of a controller there, no path.
    if let Some(k) = r
        .unified
        .keys()
        .find(|k| !vessel_agent::cgroups::is_controller_file(k))
    {
        return Err(invalid(format!(
            "resources: unified key {k:?} is not a controller's file of a cgroup (CONTROLLER.FILE, no '/', not cgroup.*)"
        )));
    }
    if !(-1000..=1000).contains(&r.oom_score_adj) {
        return Err(invalid(format!(
            "resources: oom_score_adj {} is outside -1000..=1000",
            r.oom_score_adj
        )));
    }
    Ok(())
}

/// Environment keys must be names an exec can pass on: not empty, no `=`, no NUL or other
/// control characters; values may hold anything but NUL.
pub(super) fn check_envs(envs: &[cri::KeyValue]) -> Result<(), SpecError> {
    for kv in envs {
        if kv.key.is_empty() || kv.key.contains('=') || kv.key.chars().any(|c| c.is_control()) {
            return Err(invalid(format!(
                "environment variable name {:?} is invalid (empty, or holds '=' or a control character)",
                kv.key
            )));
        }
        if kv.value.contains('\0') {
            return Err(invalid(format!(
                "environment variable {:?}: the value holds a NUL byte",
                kv.key
            )));
        }
    }
    Ok(())
}

/// The resources a container has after UpdateContainerResources `new`, as its cgroup takes
/// them (and `vessel_agent::spec::merge_resources` for its spec): zero and empty fields keep
/// their value (kubelet's CPU manager sends only `cpuset_cpus`), `unified` keys add to those
/// there; swap as sent to the agent (`sent_swap`). `oom_score_adj` and huge page limits are not changed by an update and keep theirs.
/// ContainerStatus reports the result, which kubelet's in-place resize compares.
pub fn merge_update(
    old: Option<cri::LinuxContainerResources>,
    new: &cri::LinuxContainerResources,
    sent_swap: i64,
) -> cri::LinuxContainerResources {
    let mut r = old.unwrap_or_default();
    if new.cpu_shares > 0 {
        r.cpu_shares = new.cpu_shares;
    }
    if new.cpu_quota != 0 {
        r.cpu_quota = new.cpu_quota;
    }
    if new.cpu_period > 0 {
        r.cpu_period = new.cpu_period;
    }
    if !new.cpuset_cpus.is_empty() {
        r.cpuset_cpus = new.cpuset_cpus.clone();
    }
    if !new.cpuset_mems.is_empty() {
        r.cpuset_mems = new.cpuset_mems.clone();
    }
    // Swap goes with a memory limit, as the agent applies it: the value sent to it
    // (`default_swap`: the limit where the host accounts swap and none was asked).
    if new.memory_limit_in_bytes > 0 {
        r.memory_limit_in_bytes = new.memory_limit_in_bytes;
        if sent_swap != 0 {
            r.memory_swap_limit_in_bytes = sent_swap;
        }
    }
    for (k, v) in &new.unified {
        r.unified.insert(k.clone(), v.clone());
    }
    r
}
