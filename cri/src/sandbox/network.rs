//! A pod's CNI attachment: ADD on its pinned network namespace at start, DEL at teardown
//! (stop, death, recovery), with the result cached by `crate::cni` so DEL runs with what ADD
//! did even after a restart.

use super::Pod;
use crate::cni::Cni;
use crate::errors::{cni_err, Result};
use crate::state::PodRecord;
use vessel_cri_api::v1 as cri;

/// Attaches a pod's pinned netns to the node's CNI network and keeps its IPs in the record.
/// Without a CNI config the pod keeps loopback only (NetworkReady says so).
pub async fn attach(cni: &Cni, pod: &Pod, config: &cri::PodSandboxConfig) -> Result<()> {
    let rec = pod.record();
    if let Err(e @ crate::cni::CniError::NoConfig(_)) = cni.load() {
        tracing::warn!(pod = %rec.id, reason = %e, "no CNI network: the pod has loopback only");
        return Ok(());
    }
    let meta = config.metadata.clone().unwrap_or_default();
    let bandwidth = crate::cni::bandwidth(&config.annotations).map_err(|e| {
        crate::errors::RuntimeError::InvalidArgument(format!("pod {}: {e}", rec.id))
    })?;
    let a = cni
        .add(crate::cni::PodNetwork {
            id: rec.id.clone(),
            netns: rec.netns_path.clone(),
            namespace: meta.namespace,
            name: meta.name,
            uid: meta.uid,
            port_mappings: crate::cni::port_mappings(&config.port_mappings),
            bandwidth,
            dns: config.dns_config.as_ref().map(|d| {
                serde_json::json!({
                    "servers": d.servers,
                    "searches": d.searches,
                    "options": d.options,
                })
            }),
            annotations: config
                .annotations
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            cgroup_path: config
                .linux
                .as_ref()
                .map(|l| l.cgroup_parent.clone())
                .unwrap_or_default(),
        })
        .await
        .map_err(cni_err)?;
    let ips = a.ips();
    tracing::info!(pod = %rec.id, network = %a.network.name, ips = ?ips, "pod attached to the CNI network");
    pod.update(|r| r.ips = ips);
    Ok(())
}

/// Runs CNI DEL for what ADD did to a pod, if anything. On failure the cache entry stays,
/// so that the next teardown (StopPodSandbox, RemovePodSandbox, recovery) asks again, and
/// the error says why: what the chain holds for the pod (host-local's IP, portmap's rules)
/// is not freed until a DEL succeeds.
pub async fn detach(cni: &Cni, rec: &PodRecord) -> Result<()> {
    let id = &rec.id;
    let Some(a) = cni.cached(id) else {
        return Ok(());
    };
    match cni.del(&a).await {
        Ok(()) => {
            tracing::info!(pod = %id, network = %a.network.name, "pod detached from the CNI network");
            cni.forget(id);
            Ok(())
        }
        Err(e) => {
            tracing::warn!(pod = %id, error = %e, "CNI DEL failed; the pod's network is still attached");
            Err(crate::errors::RuntimeError::Unavailable(format!(
                "pod sandbox {id}: taking it off network {:?}: {e} (the next StopPodSandbox or RemovePodSandbox tries again)",
                a.network.name
            )))
        }
    }
}

/// Takes a pod off the network: CNI DEL (while the pin still keeps the namespace, and the
/// interface in it, alive), then the pin itself. The pin goes even when DEL failed: no
/// process is left in the namespace, and a DEL retried without it still frees what the
/// chain holds (CNI asks plugins to take a missing namespace as nothing to do there).
pub async fn release(cni: &Cni, rec: &PodRecord) -> Result<()> {
    let r = detach(cni, rec).await;
    if let Err(e) = super::netns::unpin(&rec.netns_path) {
        tracing::warn!(pod = %rec.id, error = %e, "cannot unpin netns");
    }
    r
}
