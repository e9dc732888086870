//! ListMetricDescriptors and ListPodSandboxMetrics: the pod and container figures kubelet
//! exposes on its `/metrics/cadvisor` endpoint when it takes stats from the runtime
//! (`PodAndContainerStatsFromCRI`), named and labelled as cAdvisor names them, from the same
//! cgroup and network figures as ContainerStats and PodSandboxStats.

use super::Runtime;
use crate::errors::Result;
use vessel_cri_api::v1 as cri;

/// Label keys of the container metrics, in the order their values are given.
const CONTAINER_LABELS: &[&str] = &["container", "id", "image", "name", "namespace", "pod"];
/// Label keys of the pod network metrics.
const NETWORK_LABELS: &[&str] = &["interface", "namespace", "pod"];

struct Desc {
    name: &'static str,
    help: &'static str,
    network: bool,
}

const DESCRIPTORS: &[Desc] = &[
    Desc {
        name: "container_cpu_usage_seconds_total",
        help: "Cumulative cpu time consumed in seconds.",
        network: false,
    },
    Desc {
        name: "container_memory_usage_bytes",
        help: "Current memory usage in bytes, including all memory regardless of when it was accessed.",
        network: false,
    },
    Desc {
        name: "container_memory_working_set_bytes",
        help: "Current working set in bytes.",
        network: false,
    },
    Desc {
        name: "container_memory_rss",
        help: "Size of RSS in bytes.",
        network: false,
    },
    Desc {
        name: "container_start_time_seconds",
        help: "Start time of the container since unix epoch in seconds.",
        network: false,
    },
    Desc {
        name: "container_pressure_cpu_waiting_seconds_total",
        help: "Total time duration tasks in the container have waited due to CPU congestion.",
        network: false,
    },
    Desc {
        name: "container_pressure_cpu_stalled_seconds_total",
        help: "Total time duration no tasks in the container could make progress due to CPU congestion.",
        network: false,
    },
    Desc {
        name: "container_pressure_memory_waiting_seconds_total",
        help: "Total time duration tasks in the container have waited due to memory congestion.",
        network: false,
    },
    Desc {
        name: "container_pressure_memory_stalled_seconds_total",
        help: "Total time duration no tasks in the container could make progress due to memory congestion.",
        network: false,
    },
    Desc {
        name: "container_pressure_io_waiting_seconds_total",
        help: "Total time duration tasks in the container have waited due to IO congestion.",
        network: false,
    },
    Desc {
        name: "container_pressure_io_stalled_seconds_total",
        help: "Total time duration no tasks in the container could make progress due to IO congestion.",
        network: false,
    },
    Desc {
        name: "container_network_receive_bytes_total",
        help: "Cumulative count of bytes received.",
        network: true,
    },
    Desc {
        name: "container_network_transmit_bytes_total",
        help: "Cumulative count of bytes transmitted.",
        network: true,
    },
    Desc {
        name: "container_network_receive_errors_total",
        help: "Cumulative count of errors encountered while receiving.",
        network: true,
    },
    Desc {
        name: "container_network_transmit_errors_total",
        help: "Cumulative count of errors encountered while transmitting.",
        network: true,
    },
];

/// Every metric ListPodSandboxMetrics may give.
pub fn descriptors() -> Vec<cri::MetricDescriptor> {
    DESCRIPTORS
        .iter()
        .map(|d| cri::MetricDescriptor {
            name: d.name.into(),
            help: d.help.into(),
            label_keys: if d.network {
                NETWORK_LABELS
            } else {
                CONTAINER_LABELS
            }
            .iter()
            .map(|s| s.to_string())
            .collect(),
        })
        .collect()
}

fn metric(
    name: &str,
    kind: cri::MetricType,
    labels: &[String],
    value: Option<u64>,
) -> Option<cri::Metric> {
    value.map(|v| cri::Metric {
        name: name.into(),
        // On demand, not cached: kubelet stamps it.
        timestamp: 0,
        metric_type: kind as i32,
        label_values: labels.to_vec(),
        value: Some(cri::UInt64Value { value: v }),
    })
}

impl Runtime {
    /// The metrics of every ready pod and its containers.
    pub async fn list_pod_sandbox_metrics(&self) -> Result<Vec<cri::PodSandboxMetrics>> {
        use cri::MetricType::{Counter, Gauge};
        let mut out = Vec::new();
        for stats in self.list_pod_sandbox_stats(None).await? {
            let Some(attrs) = stats.attributes else {
                continue;
            };
            let meta = attrs.metadata.unwrap_or_default();
            let linux = stats.linux.unwrap_or_default();
            let mut pod_metrics = Vec::new();
            if let Some(net) = &linux.network {
                for i in &net.interfaces {
                    let labels = [i.name.clone(), meta.namespace.clone(), meta.name.clone()];
                    let v = |x: &Option<cri::UInt64Value>| x.as_ref().map(|v| v.value);
                    for (name, value) in [
                        ("container_network_receive_bytes_total", v(&i.rx_bytes)),
                        ("container_network_transmit_bytes_total", v(&i.tx_bytes)),
                        ("container_network_receive_errors_total", v(&i.rx_errors)),
                        ("container_network_transmit_errors_total", v(&i.tx_errors)),
                    ] {
                        pod_metrics.extend(metric(name, Counter, &labels, value));
                    }
                }
            }
            let mut container_metrics = Vec::new();
            for c in &linux.containers {
                let Some(ca) = &c.attributes else { continue };
                let Ok(ctr) = self.ctr(&ca.id) else { continue };
                let rec = ctr.record();
                let labels = [
                    ca.metadata
                        .as_ref()
                        .map(|m| m.name.clone())
                        .unwrap_or_default(),
                    ca.id.clone(),
                    rec.image_name.clone(),
                    ca.id.clone(),
                    meta.namespace.clone(),
                    meta.name.clone(),
                ]
                .to_vec();
                let cpu = c
                    .cpu
                    .as_ref()
                    .and_then(|u| u.usage_core_nano_seconds.as_ref())
                    .map(|v| v.value / 1_000_000_000);
                let mem = |f: fn(&cri::MemoryUsage) -> Option<&cri::UInt64Value>| {
                    c.memory.as_ref().and_then(f).map(|v| v.value)
                };
                let started = u64::try_from(rec.started_at / 1_000_000_000)
                    .ok()
                    .filter(|s| *s > 0);
                let mut ms = Vec::new();
                for (name, kind, value) in [
                    ("container_cpu_usage_seconds_total", Counter, cpu),
                    (
                        "container_memory_usage_bytes",
                        Gauge,
                        mem(|m| m.usage_bytes.as_ref()),
                    ),
                    (
                        "container_memory_working_set_bytes",
                        Gauge,
                        mem(|m| m.working_set_bytes.as_ref()),
                    ),
                    ("container_memory_rss", Gauge, mem(|m| m.rss_bytes.as_ref())),
                    ("container_start_time_seconds", Gauge, started),
                ] {
                    ms.extend(metric(name, kind, &labels, value));
                }
                // PSI totals (ns) in whole seconds: "waiting" is some tasks stalled, "stalled"
                // all of them (cAdvisor's names).
                for (resource, psi) in [
                    ("cpu", c.cpu.as_ref().and_then(|u| u.psi.as_ref())),
                    ("memory", c.memory.as_ref().and_then(|u| u.psi.as_ref())),
                    ("io", c.io.as_ref().and_then(|u| u.psi.as_ref())),
                ] {
                    for (stall, data) in [
                        ("waiting", psi.and_then(|p| p.some.as_ref())),
                        ("stalled", psi.and_then(|p| p.full.as_ref())),
                    ] {
                        let name = format!("container_pressure_{resource}_{stall}_seconds_total");
                        let value = data.map(|d| d.total / 1_000_000_000);
                        ms.extend(metric(&name, Counter, &labels, value));
                    }
                }
                container_metrics.push(cri::ContainerMetrics {
                    container_id: ca.id.clone(),
                    metrics: ms,
                });
            }
            out.push(cri::PodSandboxMetrics {
                pod_sandbox_id: attrs.id,
                metrics: pod_metrics,
                container_metrics,
            });
        }
        Ok(out)
    }
}
