//! Records to CRI messages: container and pod status, list entries, states and exit
//! reasons.

use super::{matches_labels, records, Ctr, Runtime};
use crate::errors::{Result, RuntimeError};
use crate::state::{ContainerRecord, ContainerState};
use std::collections::HashMap;
use vessel_cri_api::v1 as cri;

impl Runtime {
    pub(super) fn to_status(&self, r: &ContainerRecord) -> cri::ContainerStatus {
        cri::ContainerStatus {
            id: r.id.clone(),
            metadata: r.config.metadata.clone(),
            state: cri_state(r.state) as i32,
            created_at: r.created_at,
            started_at: r.started_at,
            finished_at: r.finished_at,
            exit_code: r.exit_code,
            image: Some(image_spec(r)),
            image_ref: r.image_ref.clone(),
            reason: r.reason.clone(),
            message: r.message.clone(),
            labels: r.config.labels.clone(),
            annotations: r.config.annotations.clone(),
            mounts: r.config.mounts.clone(),
            log_path: r.log_path.clone(),
            image_id: r.image_id.clone(),
            resources: r
                .config
                .linux
                .as_ref()
                .and_then(|l| l.resources.clone())
                .map(|l| cri::ContainerResources {
                    linux: Some(l),
                    ..Default::default()
                }),
            user: Some(cri::ContainerUser {
                linux: Some(cri::LinuxContainerUser {
                    uid: r.uid as i64,
                    gid: r.gid as i64,
                    supplemental_groups: r.groups.iter().map(|g| *g as i64).collect(),
                }),
            }),
            stop_signal: crate::spec::signal_to_cri(r.stop_signal) as i32,
        }
    }

    pub fn container_status(
        &self,
        id: &str,
        verbose: bool,
    ) -> Result<cri::ContainerStatusResponse> {
        let ctr = self.ctr(id)?;
        let r = ctr.record();
        if r.state == ContainerState::Creating {
            return Err(RuntimeError::NotFound(format!(
                "container {id:?} not found"
            )));
        }
        let mut info = HashMap::new();
        if verbose {
            // `pid` is the host's, as containerd gives it (`nsenter -t <pid>` recipes): a
            // flat container's, found from its pid in the pod agent's namespace (`podPid`);
            // none (0) for a VM pod's, whose processes the host does not run, nor once it
            // exited, as containerd's (the number may be another process's by then).
            let running = r.state == ContainerState::Running;
            let host_pid = match self.pod(&r.pod_id).map(|p| p.record()) {
                Ok(p)
                    if p.backend.kind() == crate::state::BackendKind::Flat
                        && r.pid > 0
                        && running =>
                {
                    host_pid(p.agent_pid, r.pid).unwrap_or(0)
                }
                _ => 0,
            };
            info.insert(
                "info".into(),
                serde_json::json!({
                    "sandboxID": r.pod_id,
                    "pid": host_pid,
                    "podPid": r.pid,
                    "snapshot": r.snapshot,
                    "stopSignal": r.stop_signal,
                    // As containerd shows them: the container's CRI config as kubelet sent
                    // it (resources as last updated) and the OCI spec it runs with.
                    "config": r.config,
                    "runtimeSpec": r.spec,
                })
                .to_string(),
            );
        }
        Ok(cri::ContainerStatusResponse {
            status: Some(self.to_status(&r)),
            info,
        })
    }

    pub fn list_containers(&self, filter: Option<cri::ContainerFilter>) -> Vec<cri::Container> {
        let f = filter.unwrap_or_default();
        let mut out: Vec<(i64, cri::Container)> = records(&self.ctrs, Ctr::record)
            .filter(|r| r.state != ContainerState::Creating)
            .filter(|r| f.id.is_empty() || r.id.starts_with(&f.id))
            .filter(|r| f.pod_sandbox_id.is_empty() || r.pod_id.starts_with(&f.pod_sandbox_id))
            .filter(|r| {
                f.state
                    .as_ref()
                    .is_none_or(|s| s.state == cri_state(r.state) as i32)
            })
            .filter(|r| matches_labels(&r.config.labels, &f.label_selector))
            .map(|r| {
                (
                    r.created_at,
                    cri::Container {
                        id: r.id.clone(),
                        pod_sandbox_id: r.pod_id.clone(),
                        metadata: r.config.metadata.clone(),
                        image: Some(image_spec(&r)),
                        image_ref: r.image_ref.clone(),
                        state: cri_state(r.state) as i32,
                        created_at: r.created_at,
                        labels: r.config.labels.clone(),
                        annotations: r.config.annotations.clone(),
                        image_id: r.image_id.clone(),
                    },
                )
            })
            .collect();
        out.sort_by_key(|(t, _)| *t);
        out.into_iter().map(|(_, c)| c).collect()
    }
}

/// A container's image as status and lists give it: the name it is shown by and the name
/// the user gave (kubelet's `user_specified_image`).
fn image_spec(r: &ContainerRecord) -> cri::ImageSpec {
    cri::ImageSpec {
        image: r.image_name.clone(),
        user_specified_image: r
            .config
            .image
            .as_ref()
            .map(|i| i.user_specified_image.clone())
            .unwrap_or_default(),
        ..Default::default()
    }
}

pub(super) fn cri_state(s: ContainerState) -> cri::ContainerState {
    match s {
        ContainerState::Creating | ContainerState::Created => cri::ContainerState::ContainerCreated,
        ContainerState::Running => cri::ContainerState::ContainerRunning,
        ContainerState::Exited => cri::ContainerState::ContainerExited,
    }
}

/// A pod's CRI state: ready, or not (a pod being created is not listed at all; one being
/// stopped is not ready).
pub(super) fn pod_state(r: &crate::state::PodRecord) -> i32 {
    if r.is_ready() {
        cri::PodSandboxState::SandboxReady as i32
    } else {
        cri::PodSandboxState::SandboxNotready as i32
    }
}

/// The host pid of the process that is `pod_pid` in the pid namespace of the pod agent
/// `agent_pid` (the second entry of its `NSpid`, the agent's namespace being one below the
/// host's), among the agent's descendants; None where there is none.
fn host_pid(agent_pid: u32, pod_pid: u32) -> Option<u32> {
    let field = |pid: &str, name: &str| -> Option<Vec<u32>> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let line = status.lines().find_map(|l| l.strip_prefix(name))?;
        line.split_whitespace().map(|n| n.parse().ok()).collect()
    };
    let descends = |mut pid: u32| {
        for _ in 0..64 {
            if pid == agent_pid {
                return true;
            }
            match field(&pid.to_string(), "PPid:").and_then(|p| p.first().copied()) {
                Some(p) if p > 1 => pid = p,
                _ => return false,
            }
        }
        false
    };
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .find(|&pid| {
            field(&pid.to_string(), "NSpid:").is_some_and(|ns| ns.get(1) == Some(&pod_pid))
                && descends(pid)
        })
}
