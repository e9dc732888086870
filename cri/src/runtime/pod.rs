//! Pod sandboxes: RunPodSandbox, StopPodSandbox, RemovePodSandbox, their status and list.
//! What differs between flat and VM pods is the backend's (`crate::sandbox`).

use super::translate::pod_state;
use super::{
    config_with_metadata, matches_labels, pod_name_key, records, valid_dns_label, Runtime,
};
use crate::errors::{if_found, internal, Result, RuntimeError};
use crate::sandbox::{self, HostShare, Pod};
use crate::state::{self, BackendKind, ContainerState, PodRecord, PodState};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use vessel_agent::proto as ap;
use vessel_cri_api::v1 as cri;

impl Runtime {
    /// CRI RunPodSandbox, run to its end in a task of its own: a caller that gives up
    /// (crictl's 2 s default timeout, a slow CNI chain or VM boot past kubelet's deadline)
    /// leaves either a pod that is listed (kubelet finds it by its labels) or nothing, never
    /// a name reserved by a half-made pod that no call can see or remove.
    pub async fn run_pod_sandbox(
        self: &Arc<Self>,
        config: Option<cri::PodSandboxConfig>,
        handler: &str,
    ) -> Result<String> {
        let (rt, handler) = (self.clone(), handler.to_string());
        tokio::spawn(async move { rt.run_pod_now(config, &handler).await })
            .await
            .map_err(internal("the RunPodSandbox task"))?
    }

    async fn run_pod_now(
        self: &Arc<Self>,
        config: Option<cri::PodSandboxConfig>,
        handler: &str,
    ) -> Result<String> {
        let (config, meta) =
            config_with_metadata("RunPodSandbox", config, |c| c.metadata.as_ref())?;
        if meta.name.is_empty() || meta.namespace.is_empty() || meta.uid.is_empty() {
            return Err(RuntimeError::InvalidArgument(format!(
                "RunPodSandbox: metadata needs name, namespace and uid (got name={:?} namespace={:?} uid={:?})",
                meta.name, meta.namespace, meta.uid
            )));
        }
        // Checked here, before anything is made; the backends take it from the config.
        let userns = crate::userns::of_pod(&config).map_err(|e| {
            RuntimeError::InvalidArgument(format!("RunPodSandbox {:?}: {e}", meta.name))
        })?;
        let backend = sandbox::choose(&config, handler, &self.admission())?;
        if userns.is_some() && backend == BackendKind::Flat && !self.dirs.userns_root_reachable() {
            return Err(RuntimeError::FailedPrecondition(format!(
                "RunPodSandbox {:?}: a flat pod's user namespace needs {} reachable by every \
                 host id (a directory above it is not traversable by others)",
                meta.name,
                self.dirs.userns_root().display()
            )));
        }
        let id = state::new_id();
        let key = pod_name_key(&meta);
        self.reserve(&key, &id, "pod sandbox")?;
        let res = self.create_pod(&id, &key, config, handler, backend).await;
        if res.is_err() {
            self.release(&key, &id);
        }
        res.map(|_| id)
    }

    pub(super) async fn create_pod(
        self: &Arc<Self>,
        id: &str,
        key: &str,
        config: cri::PodSandboxConfig,
        handler: &str,
        kind: BackendKind,
    ) -> Result<()> {
        let meta = config.metadata.clone().unwrap_or_default();
        let linux = config.linux.clone().unwrap_or_default();
        let share = HostShare::of(&config);
        let backend = self.backend_of(kind);
        // A pod on the host's network, or one whose config names no hostname (critest sends
        // none; kubelet always does), gets the node's hostname, as with containerd and CRI-O.
        let hostname = if share.net || config.hostname.is_empty() {
            rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned()
        } else {
            config.hostname.clone()
        };
        if !valid_dns_label(&hostname) || hostname.len() > 64 {
            return Err(RuntimeError::InvalidArgument(format!(
                "pod {:?}: hostname {hostname:?} is not a valid host name",
                meta.name
            )));
        }
        let (cgroup_parent, cgroup_unit) =
            self.opts.cgroups.pod_cgroup(id, &linux.cgroup_parent)?;
        let layout = backend.layout(id, &config, share);
        let rec = PodRecord {
            id: id.to_string(),
            name_key: key.to_string(),
            config: config.clone(),
            runtime_handler: handler.to_string(),
            backend: layout.state,
            state: PodState::Creating,
            created_at: state::now_nanos(),
            agent_pid: 0,
            agent_start_time: 0,
            agent_socket: layout.agent_socket,
            agent_state_dir: self.dirs.pod_run_dir(id).join("agent"),
            netns_path: layout.netns_path,
            hostname: hostname.clone(),
            cgroup_parent,
            cgroup_unit,
            reason: String::new(),
            ips: Vec::new(),
            stopping: false,
            // Once the agent says it keeps one (below).
            shared_shm: false,
            pid_holder: false,
        };
        // The record comes first: a crash from here on leaves something recovery cleans. If
        // it cannot be written (a full disk), nothing of the pod is left either.
        if let Err(e) = sandbox::save(&self.dirs, &rec) {
            let _ = self.dirs.delete_pod(id);
            return Err(e);
        }
        let pod = self.pod_object(rec);
        // Each step's end at debug level, with the time since the record was saved.
        let t = std::time::Instant::now();
        let step = |what: &str| tracing::debug!(pod = %id, step = what, ms = t.elapsed().as_secs_f64() * 1e3, "starting the pod sandbox");
        // The host process goes into the pod's cgroup unit (systemd driver) before any
        // container can start beneath it; a flat pod's agent moves on into a leaf.
        let setup = match backend.start(&pod, &config).await {
            Ok(()) => {
                step("backend-started");
                // The agent may be older than vesseld (a VM image built before, or
                // `runtime.agent_binary`): what it keeps is what it says it keeps.
                let features = agent_features(&pod).await;
                let has = |feature: &str| features.iter().any(|f| f == feature);
                let shm = has(vessel_agent::FEATURE_POD_SHM);
                let holder = has(vessel_agent::FEATURE_PID_HOLDER);
                pod.update(|r| {
                    r.shared_shm = shm;
                    r.pid_holder = holder;
                });
                step("features");
                let adopted = self
                    .opts
                    .cgroups
                    .adopt(&pod.record(), kind == BackendKind::Flat)
                    .await;
                adopted.and_then(|()| sandbox::save(&self.dirs, &pod.record()))
            }
            Err(e) => Err(e),
        };
        match setup {
            Ok(()) => {
                step("adopted-saved");
                self.pods
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id.to_string(), pod.clone());
                self.spawn_pod_watcher(pod);
                self.emit_pod(id, cri::ContainerEventType::ContainerCreatedEvent);
                self.emit_pod(id, cri::ContainerEventType::ContainerStartedEvent);
                tracing::info!(pod = %id, name = %meta.name, namespace = %meta.namespace, backend = %kind, "pod sandbox ready");
                Ok(())
            }
            Err(e) => {
                tracing::warn!(pod = %id, error = %e, "RunPodSandbox failed; cleaning up");
                // A failed DEL keeps its CNI cache entry: vesseld's next start asks again.
                let _ = self.teardown_pod_resources(&pod.record()).await;
                let _ = self.dirs.delete_pod(id);
                Err(e)
            }
        }
    }

    /// Takes down what the pod's backend made (host process, network, netns pin, cgroup, VM
    /// files). Idempotent. The error is a CNI DEL that failed, after all else went: the pod
    /// is still on the network, and the next teardown asks again.
    pub(super) async fn teardown_pod_resources(&self, rec: &PodRecord) -> Result<()> {
        let net = self.backend(rec).teardown(rec).await;
        self.opts.cgroups.release(rec).await;
        net
    }

    /// CRI StopPodSandbox, in a task of its own (as RunPodSandbox): a caller that gives up
    /// does not cut a stop between its steps (CNI DEL done, the agent not yet stopped).
    pub async fn stop_pod_sandbox(self: &Arc<Self>, id: &str) -> Result<()> {
        let (rt, id) = (self.clone(), id.to_string());
        tokio::spawn(async move { rt.stop_pod_now(&id).await })
            .await
            .map_err(internal("the StopPodSandbox task"))?
    }

    async fn stop_pod_now(self: &Arc<Self>, id: &str) -> Result<()> {
        // CRI: stopping what is gone is fine.
        let Some(pod) = if_found(self.pod(id))? else {
            return Ok(());
        };
        let _op = pod.op.lock().await;
        // Removed while this waited for it: done (a save below would bring its record back).
        if !self.still_listed(&pod) {
            return Ok(());
        }
        let mut rec = pod.record();
        // Each step's end at debug level, with the time since the stop began.
        let (t, id) = (std::time::Instant::now(), rec.id.clone());
        let step = |what: &str| tracing::debug!(pod = %id, step = what, ms = t.elapsed().as_secs_f64() * 1e3, "stopping the pod sandbox");
        if rec.state == PodState::Ready {
            // Said on disk first: a restart in the middle finishes the stop (recovery).
            rec = pod.update(|r| r.stopping = true);
            if let Err(e) = sandbox::save(&self.dirs, &rec) {
                tracing::warn!(pod = %rec.id, error = %e, "stopping a pod whose record cannot be updated");
            }
            if let Ok(mut c) = pod.client().await {
                for ctr in self.ctrs_of(&rec.id) {
                    let _cop = ctr.op.lock().await;
                    if ctr.record().state == ContainerState::Running {
                        let _ = self
                            .kill_and_wait(&mut c, &ctr, Duration::from_secs(10))
                            .await;
                    }
                }
                step("containers stopped");
                let _ = tokio::time::timeout(
                    Duration::from_secs(15),
                    c.shutdown(ap::ShutdownRequest {}),
                )
                .await;
                step("agent shut down");
            }
            // Nothing more to ask the agent: our connection goes now, so that the agent's
            // wait for idle connections before it exits does not wait for us.
            pod.set_client(None).await;
            self.backend(&rec).after_shutdown(&rec).await;
            step("host process gone");
        } else {
            pod.set_client(None).await;
        }
        // A failed CNI DEL fails the stop, after the rest of it (as containerd's does): kubelet
        // stops again, and that stop asks DEL again, until the pod's IP is free.
        let net = self.teardown_pod_resources(&rec).await;
        step("resources released");
        let was_ready = rec.state == PodState::Ready;
        // NotReady first: the containers' stopped events carry the pod's state as it is.
        let rec = pod.update(|r| {
            r.state = PodState::NotReady;
            r.stopping = false;
            if r.reason.is_empty() {
                r.reason = "stopped".into();
            }
        });
        self.pod_ended(&rec.id, "pod sandbox stopped");
        // The pod is stopped whether or not its record says so: one that cannot be written (a
        // full disk) still says Ready, and a restart finds its host process gone and marks it
        // NotReady. Failing here would only make kubelet retry a stop that is done.
        if let Err(e) = sandbox::save(&self.dirs, &rec) {
            tracing::warn!(pod = %rec.id, error = %e, "pod stopped, but its record was not updated");
        }
        if was_ready {
            self.emit_pod(&rec.id, cri::ContainerEventType::ContainerStoppedEvent);
        }
        net?;
        tracing::info!(pod = %rec.id, "pod sandbox stopped");
        Ok(())
    }

    /// Whether `pod` is still the listed pod of its id (not removed meanwhile).
    fn still_listed(&self, pod: &Arc<Pod>) -> bool {
        self.pod(&pod.record().id)
            .is_ok_and(|listed| Arc::ptr_eq(&listed, pod))
    }

    /// CRI RemovePodSandbox, in a task of its own (as RunPodSandbox).
    pub async fn remove_pod_sandbox(self: &Arc<Self>, id: &str) -> Result<()> {
        let (rt, id) = (self.clone(), id.to_string());
        tokio::spawn(async move { rt.remove_pod_now(&id).await })
            .await
            .map_err(internal("the RemovePodSandbox task"))?
    }

    async fn remove_pod_now(self: &Arc<Self>, id: &str) -> Result<()> {
        let Some(pod) = if_found(self.pod(id))? else {
            return Ok(());
        };
        if pod.record().state == PodState::Ready {
            self.stop_pod_now(id).await?;
        }
        let _op = pod.op.lock().await;
        if !self.still_listed(&pod) {
            return Ok(());
        }
        let rec = pod.record();
        for ctr in self.ctrs_of(&rec.id) {
            self.forget_container(&ctr).await?;
        }
        // Not removed while still on the network: the record is what asks DEL again.
        self.teardown_pod_resources(&rec).await?;
        let unreadable = rec.name_key.starts_with(crate::state::UNREADABLE_POD_KEY);
        if unreadable {
            // Its containers were kept, unmanaged: they go with it (their processes went with
            // the pod's host process).
            for c in self.dirs.load_containers() {
                if c.pod_id == rec.id {
                    self.discard_snapshots(c.snapshots());
                    let _ = self.dirs.delete_container(&c.id);
                }
            }
        }
        self.dirs
            .delete_pod(&rec.id)
            .map_err(internal("removing pod state"))?;
        if unreadable {
            *self.quarantined.lock().unwrap_or_else(|p| p.into_inner()) = self.dirs.quarantined();
        }
        // Built while the pod is still known (its last status goes with the event).
        let deleted = self.pod_event(&rec.id, cri::ContainerEventType::ContainerDeletedEvent);
        self.pods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&rec.id);
        self.release(&rec.name_key, &rec.id);
        if let Some(ev) = deleted {
            let _ = self.events.send(ev);
        }
        tracing::info!(pod = %rec.id, "pod sandbox removed");
        Ok(())
    }

    /// CRI UpdatePodSandboxResources, kubelet's call after it resized a pod's cgroup in place
    /// (best effort for kubelet: a failure does not stop the resize). The pod's config takes
    /// the new pod-level resources and overhead (those given; verbose PodSandboxStatus shows
    /// them) once the backend agrees: a flat pod's containers are in kubelet's pod cgroup,
    /// already resized; a VM pod's microVM cannot grow past the vCPUs and memory it booted
    /// with (FailedPrecondition, the record unchanged).
    pub async fn update_pod_sandbox_resources(
        &self,
        id: &str,
        overhead: Option<cri::LinuxContainerResources>,
        resources: Option<cri::LinuxContainerResources>,
    ) -> Result<()> {
        let pod = self.pod(id)?;
        let _op = pod.op.lock().await;
        let rec = pod.record();
        let invalid = |e: &dyn std::fmt::Display| {
            RuntimeError::InvalidArgument(format!("UpdatePodSandboxResources {}: {e}", rec.id))
        };
        // Some kubelets subtract a RuntimeClass's CPU overhead from an unlimited (-1) quota:
        // any negative quota here means no limit.
        let resources = resources.map(|mut r| {
            if r.cpu_quota < 0 {
                r.cpu_quota = -1;
            }
            r
        });
        if let Some(r) = &resources {
            crate::spec::check_resources(r).map_err(|e| invalid(&e))?;
        }
        // The overhead (a RuntimeClass's) is no container's: only negative values are wrong.
        if let Some(o) = &overhead {
            for (name, v) in [
                ("cpu_period", o.cpu_period),
                ("cpu_quota", o.cpu_quota),
                ("cpu_shares", o.cpu_shares),
                ("memory_limit_in_bytes", o.memory_limit_in_bytes),
            ] {
                if v < 0 {
                    return Err(invalid(&format!("overhead: {name} {v} is negative")));
                }
            }
        }
        if !rec.is_ready() {
            return Err(RuntimeError::FailedPrecondition(format!(
                "UpdatePodSandboxResources: pod sandbox {} is not ready",
                rec.id
            )));
        }
        let mut config = rec.config.clone();
        let linux = config.linux.get_or_insert_with(Default::default);
        if overhead.is_some() {
            linux.overhead = overhead;
        }
        if resources.is_some() {
            linux.resources = resources;
        }
        self.backend(&rec).resize(&rec, &config)?;
        let old = rec.config;
        let rec = pod.update(|r| r.config = config);
        if let Err(e) = sandbox::save(&self.dirs, &rec) {
            // What the disk says stays what the pod reports.
            pod.update(|r| r.config = old);
            return Err(internal("saving pod record")(e));
        }
        tracing::info!(pod = %rec.id, "pod sandbox resources updated");
        Ok(())
    }

    pub fn pod_sandbox_status(
        &self,
        id: &str,
        verbose: bool,
    ) -> Result<cri::PodSandboxStatusResponse> {
        let rec = self.pod(id)?.record();
        let ns = crate::spec::pod_namespace_options(&rec.config).cloned();
        // A stopped pod has no address: CNI DEL gave it back (maybe to another pod by now),
        // as containerd reports none once the pod's network namespace is gone.
        let ips: &[String] = if rec.state == PodState::Ready {
            &rec.ips
        } else {
            &[]
        };
        let status = cri::PodSandboxStatus {
            id: rec.id.clone(),
            metadata: rec.config.metadata.clone(),
            state: pod_state(&rec),
            created_at: rec.created_at,
            network: Some(cri::PodSandboxNetworkStatus {
                ip: ips.first().cloned().unwrap_or_default(),
                additional_ips: ips
                    .iter()
                    .skip(1)
                    .map(|ip| cri::PodIp { ip: ip.clone() })
                    .collect(),
            }),
            linux: Some(cri::LinuxPodSandboxStatus {
                namespaces: Some(cri::Namespace { options: ns }),
            }),
            labels: rec.config.labels.clone(),
            annotations: rec.config.annotations.clone(),
            runtime_handler: rec.runtime_handler.clone(),
        };
        let mut info = HashMap::new();
        if verbose {
            let backend = self.backend(&rec);
            info.insert(
                "info".into(),
                serde_json::json!({
                    "backend": backend.kind().as_str(),
                    "pid": rec.agent_pid,
                    "netns": rec.netns_path,
                    "agentSocket": rec.agent_socket,
                    "hostname": rec.hostname,
                    "cgroupParent": rec.cgroup_parent,
                    "reason": rec.reason,
                    "ips": ips,
                    "vm": backend.info(&rec),
                    // As kubelet sent it, resources as UpdatePodSandboxResources last set them.
                    "config": rec.config,
                })
                .to_string(),
            );
        }
        // The pod's containers with it, and when both were read: kubelet's evented PLEG takes
        // its containers' statuses from here (it falls back to a ContainerStatus per container
        // where the timestamp is 0).
        let containers_statuses = self
            .ctrs_of(&rec.id)
            .iter()
            .map(|c| c.record())
            .filter(|r| r.state != ContainerState::Creating)
            .map(|r| self.to_status(&r))
            .collect();
        Ok(cri::PodSandboxStatusResponse {
            status: Some(status),
            info,
            containers_statuses,
            timestamp: state::now_nanos(),
        })
    }

    pub fn list_pod_sandbox(&self, filter: Option<cri::PodSandboxFilter>) -> Vec<cri::PodSandbox> {
        let f = filter.unwrap_or_default();
        let mut out: Vec<cri::PodSandbox> = records(&self.pods, Pod::record)
            .filter(|r| r.state != PodState::Creating)
            .filter(|r| f.id.is_empty() || r.id.starts_with(&f.id))
            .filter(|r| {
                f.state.as_ref().is_none_or(|s| {
                    let ready = s.state == cri::PodSandboxState::SandboxReady as i32;
                    ready == r.is_ready()
                })
            })
            .filter(|r| matches_labels(&r.config.labels, &f.label_selector))
            .map(|r| cri::PodSandbox {
                id: r.id.clone(),
                metadata: r.config.metadata.clone(),
                state: pod_state(&r),
                created_at: r.created_at,
                labels: r.config.labels.clone(),
                annotations: r.config.annotations.clone(),
                runtime_handler: r.runtime_handler.clone(),
            })
            .collect();
        out.sort_by_key(|p| p.created_at);
        out
    }
}

/// What the pod's agent says it does beyond the first agents (`PingResponse.features`);
/// none from an agent that cannot be asked.
async fn agent_features(pod: &Pod) -> Vec<String> {
    let Ok(mut c) = pod.client().await else {
        return Vec::new();
    };
    c.ping(vessel_agent::proto::PingRequest {})
        .await
        .map(|r| r.into_inner().features)
        .unwrap_or_default()
}
