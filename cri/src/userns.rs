//! Pod user namespaces as CRI asks for them (`NamespaceOption.userns_options`): what is
//! accepted, and how the pod's mappings reach the agent and the container specs.
//!
//! Mode NODE (or no option) is the host's user namespace. Mode POD is a user namespace of
//! the pod's own, with exactly one uid and one gid mapping that map container root (what
//! kubelet sends for `hostUsers: false`); it is refused with the host's network, pid or ipc
//! namespace, as kubelet does. CONTAINER and TARGET are not defined for user namespaces by
//! kubelet and are refused, as containerd and CRI-O do. Flat pods and VM pods have them
//! (the agent makes the namespace on the host, or in the guest at boot); a VM pod's volumes
//! show their owners through the pod's mapping by its file server, not an idmapped mount.

use vessel_cri_api::v1 as cri;

/// A pod's own user namespace: its one uid and one gid mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodUserns {
    pub uid: cri::IdMapping,
    pub gid: cri::IdMapping,
}

impl PodUserns {
    /// The agent's `--uid-map` / `--gid-map` values (`container:host:size`).
    pub fn flags(&self) -> [String; 2] {
        [flag(&self.uid), flag(&self.gid)]
    }
}

fn flag(m: &cri::IdMapping) -> String {
    format!("{}:{}:{}", m.container_id, m.host_id, m.length)
}

fn mode_name(m: i32) -> String {
    cri::NamespaceMode::try_from(m)
        .map(|m| m.as_str_name().to_string())
        .unwrap_or_else(|_| format!("unknown ({m})"))
}

fn one(what: &str, maps: &[cri::IdMapping]) -> Result<cri::IdMapping, String> {
    let [m] = maps else {
        return Err(format!(
            "{what}: exactly one mapping is supported, got {}",
            maps.len()
        ));
    };
    if m.length == 0 {
        return Err(format!("{what} {}: length 0", flag(m)));
    }
    if m.container_id != 0 {
        return Err(format!(
            "{what} {}: container id 0 (root) is not mapped",
            flag(m)
        ));
    }
    if m.host_id.checked_add(m.length - 1).is_none() {
        return Err(format!("{what} {}: the range overflows 32 bits", flag(m)));
    }
    Ok(*m)
}

/// The user namespace options of `ns`, checked: `None` for the host's.
pub fn of_options(ns: Option<&cri::NamespaceOption>) -> Result<Option<PodUserns>, String> {
    let Some(u) = ns.and_then(|n| n.userns_options.as_ref()) else {
        return Ok(None);
    };
    match cri::NamespaceMode::try_from(u.mode) {
        Ok(cri::NamespaceMode::Node) => {
            if !u.uids.is_empty() || !u.gids.is_empty() {
                return Err("user namespace mode NODE takes no mappings".into());
            }
            Ok(None)
        }
        Ok(cri::NamespaceMode::Pod) => Ok(Some(PodUserns {
            uid: one("uid mappings", &u.uids)?,
            gid: one("gid mappings", &u.gids)?,
        })),
        _ => Err(format!(
            "user namespace mode {} is not supported (only POD and NODE)",
            mode_name(u.mode)
        )),
    }
}

/// The pod's own user namespace, if its config asks for one, checked against the pod's
/// other namespaces.
pub fn of_pod(config: &cri::PodSandboxConfig) -> Result<Option<PodUserns>, String> {
    let ns = crate::spec::pod_namespace_options(config);
    let Some(u) = of_options(ns)? else {
        return Ok(None);
    };
    let ns = ns.cloned().unwrap_or_default();
    for (what, mode) in [("network", ns.network), ("pid", ns.pid), ("ipc", ns.ipc)] {
        if mode == cri::NamespaceMode::Node as i32 {
            return Err(format!(
                "a pod with its own user namespace cannot use the host's {what} namespace"
            ));
        }
    }
    Ok(Some(u))
}

/// Whether a mount's mappings are the pod's (the only idmapped mounts vessel makes).
pub fn mount_matches(pod: &PodUserns, m: &cri::Mount) -> bool {
    m.uid_mappings == [pod.uid] && m.gid_mappings == [pod.gid]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(c: u32, h: u32, n: u32) -> cri::IdMapping {
        cri::IdMapping {
            container_id: c,
            host_id: h,
            length: n,
        }
    }

    fn pod(mode: cri::NamespaceMode, uids: Vec<cri::IdMapping>) -> cri::PodSandboxConfig {
        cri::PodSandboxConfig {
            linux: Some(cri::LinuxPodSandboxConfig {
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        userns_options: Some(cri::UserNamespace {
                            mode: mode as i32,
                            gids: uids.clone(),
                            uids,
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn what_critest_asks() {
        use cri::NamespaceMode::*;
        let u = of_pod(&pod(Pod, vec![map(0, 1000, 100000)]))
            .unwrap()
            .unwrap();
        assert_eq!(u.flags(), ["0:1000:100000", "0:1000:100000"]);
        assert_eq!(of_pod(&pod(Node, vec![])).unwrap(), None);
        assert_eq!(of_pod(&cri::PodSandboxConfig::default()).unwrap(), None);
        let two = vec![map(0, 1000, 100000), map(0, 2000, 100000)];
        assert!(of_pod(&pod(Pod, two)).unwrap_err().contains("exactly one"));
        assert!(of_pod(&pod(Pod, vec![map(1, 1000, 100000)]))
            .unwrap_err()
            .contains("container id 0"));
        assert!(of_pod(&pod(Container, vec![]))
            .unwrap_err()
            .contains("CONTAINER"));
        assert!(of_pod(&pod(Target, vec![])).unwrap_err().contains("TARGET"));
        assert!(of_pod(&pod(Node, vec![map(0, 1, 1)])).is_err());
        assert!(of_pod(&pod(Pod, vec![map(0, u32::MAX, 2)])).is_err());
        let mut host_net = pod(Pod, vec![map(0, 1000, 100000)]);
        let ns = host_net
            .linux
            .as_mut()
            .and_then(|l| l.security_context.as_mut())
            .and_then(|s| s.namespace_options.as_mut())
            .unwrap();
        ns.network = Node as i32;
        assert!(of_pod(&host_net).unwrap_err().contains("network"));
    }
}
