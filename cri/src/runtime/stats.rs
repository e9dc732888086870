//! ContainerStats, PodSandboxStats and their lists: the agent's cgroup numbers per container,
//! summed per pod (flat pods have no pause process, and the agent's own usage is not the
//! workload's).

use super::Runtime;
use crate::errors::{agent_err, Result, RuntimeError};
use crate::state::{self, ContainerState};
use vessel_agent::proto as ap;
use vessel_cri_api::v1 as cri;

/// CRI's PSI of a cgroup pressure file the agent read (totals in nanoseconds; the kernel's
/// are microseconds). None where the cgroup has none (cgroup v1, a kernel without PSI).
fn psi(p: Option<&ap::Pressure>) -> Option<cri::PsiStats> {
    let data = |l: &ap::PressureLine| cri::PsiData {
        total: l.total_us.saturating_mul(1000),
        avg10: l.avg10,
        avg60: l.avg60,
        avg300: l.avg300,
    };
    p.map(|p| cri::PsiStats {
        full: p.full.as_ref().map(data),
        some: p.some.as_ref().map(data),
    })
}

/// CRI's IO usage, which is only PSI: none where the cgroup has no IO pressure file.
fn io_usage(timestamp: i64, p: Option<&ap::Pressure>) -> Option<cri::IoUsage> {
    p.map(|p| cri::IoUsage {
        timestamp,
        psi: psi(Some(p)),
    })
}

impl Runtime {
    pub async fn container_stats(&self, id: &str) -> Result<cri::ContainerStats> {
        self.stats_and_pids(id).await.map(|(s, _)| s)
    }

    /// A container's stats, and how many processes it has (a running one's; CRI's container
    /// stats have no place for it, the pod's do).
    async fn stats_and_pids(&self, id: &str) -> Result<(cri::ContainerStats, Option<u64>)> {
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
            return Ok((stats, None));
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
            usage_nano_cores: ctr.nano_cores(ts, s.cpu_usage_ns).and_then(u),
            psi: psi(s.cpu_pressure.as_ref()),
        });
        stats.io = io_usage(ts, s.io_pressure.as_ref());
        stats.memory = Some(cri::MemoryUsage {
            timestamp: ts,
            working_set_bytes: u(s.memory_working_set_bytes),
            usage_bytes: u(s.memory_usage_bytes),
            rss_bytes: u(s.memory_rss_bytes),
            page_faults: u(s.page_faults),
            major_page_faults: u(s.major_page_faults),
            // What it may still use before its limit, as containerd gives it; none
            // without a limit.
            available_bytes: available(s.memory_limit_bytes, s.memory_working_set_bytes),
            psi: psi(s.memory_pressure.as_ref()),
        });
        stats.writable_layer = Some(cri::FilesystemUsage {
            timestamp: ts,
            fs_id: Some(cri::FilesystemIdentifier {
                mountpoint: self.store.root().display().to_string(),
            }),
            used_bytes: u(s.writable_layer_bytes),
            inodes_used: u(s.writable_layer_inodes),
        });
        Ok((stats, Some(s.pids)))
    }

    pub async fn list_container_stats(
        &self,
        filter: Option<cri::ContainerStatsFilter>,
    ) -> Result<Vec<cri::ContainerStats>> {
        let cri::ContainerStatsFilter {
            id,
            pod_sandbox_id,
            label_selector,
        } = filter.unwrap_or_default();
        let ids = self
            .list_containers(Some(cri::ContainerFilter {
                id,
                pod_sandbox_id,
                label_selector,
                state: None,
            }))
            .into_iter()
            .map(|c| c.id);
        let stats = self.containers_stats(ids).await;
        Ok(stats.into_iter().map(|(s, _)| s).collect())
    }

    /// The stats (and process counts) of the containers `ids` that have them (see
    /// [`stats_of`]).
    async fn containers_stats(
        &self,
        ids: impl IntoIterator<Item = String>,
    ) -> Vec<(cri::ContainerStats, Option<u64>)> {
        stats_of(
            ids,
            CONTAINER_STATS_TIMEOUT,
            |id| async move { self.stats_and_pids(&id).await },
            |id, e| tracing::debug!(container = %id, error = %e, "stats unavailable"),
        )
        .await
    }

    /// Pod-level stats: its cgroup's counters (CPU time, page faults), which keep what ended
    /// containers used, so that they never go back (crictl statsp and kubelet's metrics
    /// take a counter that does for a reset); the sum of its running containers' gauges
    /// (memory, processes: flat pods have no pause process, and the agent's own memory is
    /// not the workload's).
    pub async fn pod_sandbox_stats(&self, id: &str) -> Result<cri::PodSandboxStats> {
        let pod = self.pod(id)?;
        let rec = pod.record();
        let ids = self.ctrs_of(&rec.id).into_iter().map(|c| c.record().id);
        // The pod's pressure and counters are its cgroup's (PSI does not add up across
        // containers, and a sum of counters goes back when a container ends), as containerd
        // reads its pod cgroup's: kubelet's pod cgroup on the node for a flat pod (its agent
        // and containers, as a containerd pod's has its pause process), the same path in the
        // guest for a VM pod (its containers), as its containers' figures come from there.
        let pressure = async {
            let mut c = pod.client().await.ok()?;
            let path = rec.cgroup_parent.clone();
            // A flat pod's agent is in a leaf of the pod's cgroup: its CPU time is not the
            // workload's (containerd's pod cgroup holds its pause process only).
            let exclude = match rec.backend.kind() {
                crate::state::BackendKind::Flat => crate::sandbox::cgroup::AGENT_LEAF.to_string(),
                crate::state::BackendKind::Vm => String::new(),
            };
            match c
                .cgroup_pressure(ap::CgroupPressureRequest { path, exclude })
                .await
            {
                Ok(r) => Some(r.into_inner()),
                Err(e) => {
                    // An agent from before the call (a VM image built earlier) has none.
                    tracing::debug!(pod = %rec.id, error = %e, "pod pressure unavailable");
                    None
                }
            }
        };
        let (stats, pressure) = tokio::join!(self.containers_stats(ids), pressure);
        let pressure = pressure.unwrap_or_default();
        let (containers, pids): (Vec<_>, Vec<_>) = stats.into_iter().unzip();
        let ts = state::now_nanos();
        // The pod's processes, as containerd counts its pod cgroup's: its containers' (a
        // flat pod has no pause process; the agent is not the workload).
        let pids: Vec<u64> = pids.into_iter().flatten().collect();
        let process = (!pids.is_empty()).then(|| cri::ProcessUsage {
            timestamp: ts,
            process_count: Some(cri::UInt64Value {
                value: pids.iter().sum(),
            }),
        });
        let sum = |f: &dyn Fn(&cri::ContainerStats) -> Option<&cri::UInt64Value>| {
            let v: Vec<u64> = containers.iter().filter_map(f).map(|v| v.value).collect();
            // Saturating: a VM pod's figures come from its guest.
            (!v.is_empty()).then(|| cri::UInt64Value {
                value: v.iter().fold(0u64, |a, b| a.saturating_add(*b)),
            })
        };
        // Never lower than any the pod gave before (a reading taken between the agent's
        // leaf and the pod's cgroup, a file that could not be read). Once the pod gave
        // counters, a call without them gives none; an agent from before the counters (a VM
        // image built earlier), or a pod whose cgroup is not there yet, gives the running
        // containers' sum.
        let counters = {
            let mut high = pod.counters.lock().unwrap_or_else(|p| p.into_inner());
            match (&pressure.counters, *high) {
                (Some(c), h) => {
                    let now = [c.cpu_usage_ns, c.page_faults, c.major_page_faults];
                    let h = h.unwrap_or_default();
                    let m = [now[0].max(h[0]), now[1].max(h[1]), now[2].max(h[2])];
                    *high = Some(m);
                    Some(Some(m))
                }
                (None, Some(_)) => Some(None),
                (None, None) => None,
            }
        };
        let counter = |i: usize, summed: Option<cri::UInt64Value>| match counters {
            Some(Some(c)) => Some(cri::UInt64Value { value: c[i] }),
            Some(None) => None,
            None => summed,
        };
        let cpu = cri::CpuUsage {
            timestamp: ts,
            usage_core_nano_seconds: counter(
                0,
                sum(&|c| c.cpu.as_ref()?.usage_core_nano_seconds.as_ref()),
            ),
            // Only once every container with a CPU figure has its rate (a new one has none
            // until its second stats): a partial sum would read as the pod's.
            usage_nano_cores: sum(&|c| c.cpu.as_ref()?.usage_nano_cores.as_ref()).filter(|_| {
                containers.iter().all(|c| {
                    c.cpu.as_ref().is_none_or(|u| {
                        u.usage_core_nano_seconds.is_none() || u.usage_nano_cores.is_some()
                    })
                })
            }),
            psi: psi(pressure.cpu.as_ref()),
        };
        let working_set = sum(&|c| c.memory.as_ref()?.working_set_bytes.as_ref());
        let memory = cri::MemoryUsage {
            timestamp: ts,
            // The pod cgroup's limit (kubelet's, from its containers' limits) less what its
            // containers use.
            available_bytes: working_set
                .as_ref()
                .and_then(|w| available(pressure.memory_limit_bytes, w.value)),
            working_set_bytes: working_set,
            usage_bytes: sum(&|c| c.memory.as_ref()?.usage_bytes.as_ref()),
            rss_bytes: sum(&|c| c.memory.as_ref()?.rss_bytes.as_ref()),
            page_faults: counter(1, sum(&|c| c.memory.as_ref()?.page_faults.as_ref())),
            major_page_faults: counter(2, sum(&|c| c.memory.as_ref()?.major_page_faults.as_ref())),
            psi: psi(pressure.memory.as_ref()),
        };
        let io = io_usage(ts, pressure.io.as_ref());
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
                process,
                containers,
                io,
            }),
            windows: None,
        })
    }

    pub async fn list_pod_sandbox_stats(
        &self,
        filter: Option<cri::PodSandboxStatsFilter>,
    ) -> Result<Vec<cri::PodSandboxStats>> {
        let cri::PodSandboxStatsFilter { id, label_selector } = filter.unwrap_or_default();
        let ids = self
            .list_pod_sandbox(Some(cri::PodSandboxFilter {
                id,
                label_selector,
                state: Some(cri::PodSandboxStateValue {
                    state: cri::PodSandboxState::SandboxReady as i32,
                }),
            }))
            .into_iter()
            .map(|p| p.id);
        Ok(stats_of(
            ids,
            POD_STATS_TIMEOUT,
            |id| async move { self.pod_sandbox_stats(&id).await },
            |id, e| tracing::debug!(pod = %id, error = %e, "pod stats unavailable"),
        )
        .await)
    }
}

/// How long a pod's stats may take in a list: an agent that does not answer (stopped, or
/// swamped) leaves its pod out of the list, rather than holding up the node's (kubelet asks
/// every 10 s, with a 2 minute deadline).
const POD_STATS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// How long a container's stats may take in a list, a pod's own included: well within
/// [`POD_STATS_TIMEOUT`], so that one slow container leaves itself out, not its pod.
const CONTAINER_STATS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(4);

/// How many members of a stats list are asked at once.
const STATS_CONCURRENCY: usize = 8;

/// What `stats` gives for each of `ids`, in order. One gone since it was listed (NotFound)
/// is left out, and so is one whose stats fail otherwise or take longer than `limit`, with
/// `unavailable` told why: a list does not fail for one of its members. Up to
/// [`STATS_CONCURRENCY`] are asked at once, a slow one holding up none of the others.
async fn stats_of<T, F>(
    ids: impl IntoIterator<Item = String>,
    limit: std::time::Duration,
    stats: impl Fn(String) -> F,
    unavailable: impl Fn(&str, &RuntimeError),
) -> Vec<T>
where
    F: std::future::Future<Output = Result<T>>,
{
    use futures::StreamExt as _;
    let asked = ids.into_iter().enumerate().map(|(i, id)| {
        let f = stats(id.clone());
        async move {
            let r = tokio::time::timeout(limit, f).await.unwrap_or_else(|_| {
                Err(RuntimeError::DeadlineExceeded(format!(
                    "stats of {id}: no answer in {limit:?}"
                )))
            });
            (i, id, r)
        }
    });
    let mut answers: Vec<(usize, String, Result<T>)> = futures::stream::iter(asked)
        .buffer_unordered(STATS_CONCURRENCY)
        .collect()
        .await;
    answers.sort_by_key(|(i, ..)| *i);
    let mut out = Vec::new();
    for (_, id, r) in answers {
        match r {
            Ok(s) => out.push(s),
            Err(RuntimeError::NotFound(_)) => {}
            Err(e) => unavailable(&id, &e),
        }
    }
    out
}

/// The memory a cgroup with limit `limit` (0: none) may still use while `working_set` of it
/// is in use: none without a limit.
fn available(limit: u64, working_set: u64) -> Option<cri::UInt64Value> {
    (limit > 0).then(|| cri::UInt64Value {
        value: limit.saturating_sub(working_set),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A member that never answers is left out after its bound, the others kept in order.
    #[tokio::test(start_paused = true)]
    async fn a_member_that_does_not_answer_is_left_out() {
        let unavailable = std::sync::Mutex::new(Vec::new());
        // More members than are asked at once, the slow one first: the others are not held
        // up behind it (they answer before its bound).
        let mut ids = vec!["slow".to_string(), "gone".to_string()];
        ids.extend((0..20).map(|i| format!("m{i}")));
        let start = tokio::time::Instant::now();
        let got: Vec<String> = stats_of(
            ids.clone(),
            CONTAINER_STATS_TIMEOUT,
            |id| async move {
                match id.as_str() {
                    "slow" => std::future::pending().await,
                    "gone" => Err(RuntimeError::NotFound(id)),
                    _ => {
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                        Ok(id)
                    }
                }
            },
            |id, e| {
                let late = matches!(e, RuntimeError::DeadlineExceeded(_));
                unavailable.lock().unwrap().push((id.to_string(), late));
            },
        )
        .await;
        assert_eq!(got, ids[2..]);
        assert_eq!(*unavailable.lock().unwrap(), [("slow".to_string(), true)]);
        // 20 one-second members, 8 at a time beside the slow one: 3 rounds, all within the
        // slow one's bound (held up behind it, they took 4 s + 3 s).
        assert!(
            start.elapsed() <= CONTAINER_STATS_TIMEOUT,
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn psi_totals_are_nanoseconds() {
        assert!(psi(None).is_none());
        let line = |total_us| ap::PressureLine {
            avg10: 1.5,
            avg60: 0.5,
            avg300: 0.25,
            total_us,
        };
        let p = psi(Some(&ap::Pressure {
            some: Some(line(7)),
            full: None,
        }))
        .unwrap();
        let some = p.some.unwrap();
        assert_eq!((some.total, some.avg10, some.avg300), (7000, 1.5, 0.25));
        assert!(p.full.is_none());
        assert_eq!(
            psi(Some(&ap::Pressure {
                some: Some(line(u64::MAX)),
                full: Some(line(1)),
            }))
            .unwrap()
            .some
            .unwrap()
            .total,
            u64::MAX
        );
    }
}
