//! ContainerStats, PodSandboxStats and their lists: the agent's cgroup numbers per container,
//! summed per pod (flat pods have no pause process, and the agent's own usage is not the
//! workload's).

use super::Runtime;
use crate::errors::{agent_err, Result, RuntimeError};
use crate::state::{self, ContainerState};
use k8s_cri::v1 as cri;
use vessel_agent::proto as ap;

impl Runtime {
    pub async fn container_stats(&self, id: &str) -> Result<cri::ContainerStats> {
        let ctr = self.ctr(id)?;
        let rec = ctr.record();
        let mut stats = cri::ContainerStats {
            attributes: Some(cri::ContainerAttributes {
                id: rec.id.clone(),
                metadata: rec.config.metadata.clone(),
                labels: rec.config.labels.clone(),
                annotations: rec.config.annotations.clone(),
            }),
            ..Default::default()
        };
        if rec.state != ContainerState::Running {
            return Ok(stats);
        }
        let pod = self.pod(&rec.pod_id)?;
        let mut c = pod.client().await?;
        let s = c
            .stats(ap::StatsRequest { id: rec.id.clone() })
            .await
            .map_err(|s| agent_err(&format!("ContainerStats {}", rec.id), s))?
            .into_inner();
        let ts = if s.timestamp != 0 {
            s.timestamp
        } else {
            state::now_nanos()
        };
        let u = |v: u64| Some(cri::UInt64Value { value: v });
        stats.cpu = Some(cri::CpuUsage {
            timestamp: ts,
            usage_core_nano_seconds: u(s.cpu_usage_ns),
            ..Default::default()
        });
        stats.memory = Some(cri::MemoryUsage {
            timestamp: ts,
            working_set_bytes: u(s.memory_working_set_bytes),
            usage_bytes: u(s.memory_usage_bytes),
            rss_bytes: u(s.memory_rss_bytes),
            page_faults: u(s.page_faults),
            major_page_faults: u(s.major_page_faults),
            ..Default::default()
        });
        stats.writable_layer = Some(cri::FilesystemUsage {
            timestamp: ts,
            fs_id: Some(cri::FilesystemIdentifier {
                mountpoint: self.store.root().display().to_string(),
            }),
            used_bytes: u(s.writable_layer_bytes),
            inodes_used: u(s.writable_layer_inodes),
        });
        Ok(stats)
    }

    pub async fn list_container_stats(
        &self,
        filter: Option<cri::ContainerStatsFilter>,
    ) -> Result<Vec<cri::ContainerStats>> {
        let f = filter.unwrap_or_default();
        let ids: Vec<String> = self
            .list_containers(Some(cri::ContainerFilter {
                id: f.id,
                pod_sandbox_id: f.pod_sandbox_id,
                label_selector: f.label_selector,
                state: None,
            }))
            .into_iter()
            .map(|c| c.id)
            .collect();
        let mut out = Vec::new();
        for id in ids {
            match self.container_stats(&id).await {
                Ok(s) => out.push(s),
                Err(RuntimeError::NotFound(_)) => {}
                Err(e) => tracing::debug!(container = %id, error = %e, "stats unavailable"),
            }
        }
        Ok(out)
    }

    /// Pod-level stats: the sum of its running containers' (flat pods have no pause process,
    /// and the agent's own usage is not the workload's).
    pub async fn pod_sandbox_stats(&self, id: &str) -> Result<cri::PodSandboxStats> {
        let pod = self.pod(id)?;
        let rec = pod.record();
        let mut containers = Vec::new();
        for ctr in self.ctrs_of(&rec.id) {
            let cid = ctr.record().id;
            match self.container_stats(&cid).await {
                Ok(s) => containers.push(s),
                Err(RuntimeError::NotFound(_)) => {}
                Err(e) => tracing::debug!(container = %cid, error = %e, "stats unavailable"),
            }
        }
        let ts = state::now_nanos();
        let sum = |f: &dyn Fn(&cri::ContainerStats) -> Option<u64>| -> Option<cri::UInt64Value> {
            let v: Vec<u64> = containers.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| cri::UInt64Value {
                value: v.iter().sum(),
            })
        };
        let cpu = cri::CpuUsage {
            timestamp: ts,
            usage_core_nano_seconds: sum(&|c| {
                c.cpu
                    .as_ref()?
                    .usage_core_nano_seconds
                    .as_ref()
                    .map(|v| v.value)
            }),
            ..Default::default()
        };
        let memory = cri::MemoryUsage {
            timestamp: ts,
            working_set_bytes: sum(&|c| {
                c.memory
                    .as_ref()?
                    .working_set_bytes
                    .as_ref()
                    .map(|v| v.value)
            }),
            usage_bytes: sum(&|c| c.memory.as_ref()?.usage_bytes.as_ref().map(|v| v.value)),
            rss_bytes: sum(&|c| c.memory.as_ref()?.rss_bytes.as_ref().map(|v| v.value)),
            page_faults: sum(&|c| c.memory.as_ref()?.page_faults.as_ref().map(|v| v.value)),
            major_page_faults: sum(&|c| {
                c.memory
                    .as_ref()?
                    .major_page_faults
                    .as_ref()
                    .map(|v| v.value)
            }),
            ..Default::default()
        };
        Ok(cri::PodSandboxStats {
            attributes: Some(cri::PodSandboxAttributes {
                id: rec.id.clone(),
                metadata: rec.config.metadata.clone(),
                labels: rec.config.labels.clone(),
                annotations: rec.config.annotations.clone(),
            }),
            linux: Some(cri::LinuxPodSandboxStats {
                cpu: Some(cpu),
                memory: Some(memory),
                network: self.backend(&rec).network_usage(&rec),
                containers,
                ..Default::default()
            }),
            windows: None,
        })
    }

    pub async fn list_pod_sandbox_stats(
        &self,
        filter: Option<cri::PodSandboxStatsFilter>,
    ) -> Result<Vec<cri::PodSandboxStats>> {
        let f = filter.unwrap_or_default();
        let ids: Vec<String> = self
            .list_pod_sandbox(Some(cri::PodSandboxFilter {
                id: f.id,
                label_selector: f.label_selector,
                state: Some(cri::PodSandboxStateValue {
                    state: cri::PodSandboxState::SandboxReady as i32,
                }),
            }))
            .into_iter()
            .map(|p| p.id)
            .collect();
        let mut out = Vec::new();
        for id in ids {
            match self.pod_sandbox_stats(&id).await {
                Ok(s) => out.push(s),
                Err(RuntimeError::NotFound(_)) => {}
                Err(e) => tracing::debug!(pod = %id, error = %e, "pod stats unavailable"),
            }
        }
        Ok(out)
    }
}
