//! The container's namespaces: what CRI's NamespaceOption asks for, in the agent's
//! convention (`"agent"`: the pod's), with the pod's user namespace where it has one.

use super::{invalid, ns_mode, pod_namespace_options, ResolvedUser, SpecError, SpecInput};
use crate::userns::PodUserns;
use serde_json::{json, Value};
use vessel_cri_api::v1 as cri;

/// What [`build`] decided.
pub(super) struct Namespaces {
    /// The spec's `linux.namespaces`.
    pub list: Vec<Value>,
    /// The pod's own user namespace, which the container joins.
    pub userns: Option<PodUserns>,
    /// The container's pid namespace mode.
    pub pid: cri::NamespaceMode,
    /// The container's ipc namespace mode.
    pub ipc: cri::NamespaceMode,
    /// Whether the pod is on the host's network (and UTS) namespace.
    pub host_net: bool,
}

pub(super) fn build(
    input: &SpecInput<'_>,
    sc: Option<&cri::LinuxContainerSecurityContext>,
    user: &ResolvedUser,
    privileged: bool,
) -> Result<Namespaces, SpecError> {
    // Without any NamespaceOption a container gets its own pid and ipc namespaces (and
    // always its own uts and mount ones); an explicit option is followed as CRI defines it
    // (POD, the proto default, shares the pod's).
    let unshared = cri::NamespaceOption {
        network: cri::NamespaceMode::Pod as i32,
        pid: cri::NamespaceMode::Container as i32,
        ipc: cri::NamespaceMode::Container as i32,
        ..Default::default()
    };
    let pod_ns = pod_namespace_options(input.pod).cloned();
    let ns = sc
        .and_then(|s| s.namespace_options.clone())
        .or_else(|| pod_ns.clone())
        .unwrap_or_else(|| unshared.clone());
    let pod_ns = pod_ns.unwrap_or(unshared);
    let host_net = ns_mode(pod_ns.network) == cri::NamespaceMode::Node;
    let mut namespaces = vec![json!({"type": "mount"})];
    // The pod's own user namespace, which every container of the pod joins (kubelet sends
    // the pod's options with each container; other ones are refused).
    let userns = crate::userns::of_pod(input.pod).map_err(invalid)?;
    if sc
        .and_then(|s| s.namespace_options.as_ref())
        .is_some_and(|n| n.userns_options.is_some())
    {
        let own = crate::userns::of_options(sc.and_then(|s| s.namespace_options.as_ref()))
            .map_err(invalid)?;
        if own != userns {
            return Err(invalid(
                "the container's user namespace options differ from its pod's".to_string(),
            ));
        }
    }
    if userns.is_some()
        && (ns_mode(ns.pid) == cri::NamespaceMode::Node
            || ns_mode(ns.ipc) == cri::NamespaceMode::Node)
    {
        return Err(invalid(
            "a container of a pod with its own user namespace cannot use the host's pid or ipc namespace".to_string(),
        ));
    }
    if let Some(u) = &userns {
        // Every id the process takes must be mapped, or setting it fails at start.
        let mapped =
            |m: &cri::IdMapping, id: u32| id >= m.container_id && id - m.container_id < m.length;
        let gids = std::iter::once(user.gid).chain(user.additional_gids.iter().copied());
        if !mapped(&u.uid, user.uid) {
            return Err(invalid(format!(
                "user {} is not mapped in the pod's user namespace ({} ids from {})",
                user.uid, u.uid.length, u.uid.container_id
            )));
        }
        if let Some(g) = gids.into_iter().find(|g| !mapped(&u.gid, *g)) {
            return Err(invalid(format!(
                "group {g} is not mapped in the pod's user namespace ({} ids from {})",
                u.gid.length, u.gid.container_id
            )));
        }
        namespaces.push(json!({"type": "user", "path": "agent"}));
    }
    if !host_net {
        namespaces.push(json!({"type": "network", "path": "agent"}));
        namespaces.push(json!({"type": "uts"}));
    }
    match ns_mode(ns.pid) {
        cri::NamespaceMode::Container => namespaces.push(json!({"type": "pid"})),
        cri::NamespaceMode::Pod => {
            // The agent joins a flat pod's containers to the namespace below its own whose
            // PID 1 is a holder with an empty root. An agent from before that (a pod that
            // outlived an upgrade) joins them to its own, whose PID 1 (the agent) has the
            // host's root: a container there that may ptrace it would reach the host's files
            // through /proc/1/root. In a VM pod PID 1 is the guest's agent, inside the pod's
            // own kernel.
            // Whichever way it would get it: added, with ALL, or as an ambient capability.
            let ptrace = super::security::capabilities(sc, false)
                .iter()
                .chain(&super::security::ambient_capabilities(sc))
                .any(|c| c == "CAP_SYS_PTRACE");
            let agent_is_pid1 = !input.vm_guest && userns.is_none() && !input.pid_holder;
            if ptrace && !privileged && agent_is_pid1 {
                return Err(invalid(
                    "a container in this pod's shared pid namespace cannot have CAP_SYS_PTRACE: the pod was started by an earlier vessel, whose agent is the namespace's PID 1 with the host's root (recreate the pod, or give the container its own pid namespace)".to_string(),
                ));
            }
            namespaces.push(json!({"type": "pid", "path": "agent"}))
        }
        cri::NamespaceMode::Node => {}
        cri::NamespaceMode::Target => {
            let pid = input.target_pid.ok_or_else(|| {
                invalid(format!(
                    "pid namespace target {:?} is not a running container of this pod",
                    ns.target_id
                ))
            })?;
            namespaces.push(json!({"type": "pid", "path": format!("/proc/{pid}/ns/pid")}));
        }
    }
    match ns_mode(ns.ipc) {
        cri::NamespaceMode::Container => namespaces.push(json!({"type": "ipc"})),
        cri::NamespaceMode::Node => {}
        _ => namespaces.push(json!({"type": "ipc", "path": "agent"})),
    }
    if input.cgroup_ns && !privileged {
        namespaces.push(json!({"type": "cgroup"}));
    }
    Ok(Namespaces {
        list: namespaces,
        userns,
        pid: ns_mode(ns.pid),
        ipc: ns_mode(ns.ipc),
        host_net,
    })
}
