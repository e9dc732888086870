//! Exits and deaths: a watcher per started container (`WaitContainer` on the agent) and one
//! per ready pod (its host process's pidfd), so that listing never asks an agent.

use super::{exit_reason, Ctr, Runtime};
use crate::sandbox::{process, Pod};
use crate::state::{self, ContainerRecord, ContainerState, PodState};
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::Channel;
use vessel_agent::proto::{self as ap, agent_client::AgentClient};
use vessel_cri_api::v1 as cri;

impl Runtime {
    /// Records a container's exit (once).
    pub(super) fn record_exit(&self, ctr: &Ctr, exit: &ap::ExitInfo) -> ContainerRecord {
        let (code, reason) = exit_reason(exit);
        let mut changed = false;
        let rec = ctr.update(|r| {
            if r.state != ContainerState::Exited {
                changed = true;
                r.state = ContainerState::Exited;
                r.exit_code = code;
                r.reason = reason.clone();
                r.finished_at = if exit.finished_at != 0 {
                    exit.finished_at
                } else {
                    state::now_nanos()
                }
                .max(r.started_at);
            }
        });
        // Only a change is written: the exit is reported more than once (the stop's own wait
        // and the container's watcher), and the first report saved it.
        if changed {
            match ctr.persist(&self.dirs) {
                // Removed meanwhile: its deletion was the last word.
                Ok(false) => return rec,
                Ok(true) => {}
                Err(e) => tracing::error!(container = %rec.id, error = %e, "cannot save exit"),
            }
            if exit.oom_killed {
                crate::metrics::get().record_oom_kill();
            }
            self.emit(&rec, cri::ContainerEventType::ContainerStoppedEvent);
        }
        rec
    }

    /// Marks a container that was created or running as exited with an unknown status.
    pub(super) fn mark_lost(&self, ctr: &Ctr, why: &str) {
        let mut changed = false;
        let rec = ctr.update(|r| {
            if matches!(
                r.state,
                ContainerState::Running | ContainerState::Created | ContainerState::Creating
            ) {
                changed = true;
                let was_running = r.state == ContainerState::Running;
                r.state = ContainerState::Exited;
                r.finished_at = state::now_nanos();
                r.exit_code = if was_running { 137 } else { 255 };
                r.reason = "Error".into();
                r.message = why.to_string();
            }
        });
        // Not announced for a container removed meanwhile: its deletion was the last word.
        if changed && !matches!(ctr.persist(&self.dirs), Ok(false)) {
            self.emit(&rec, cri::ContainerEventType::ContainerStoppedEvent);
        }
    }

    /// The pod `pod_id` stopped or died: its started containers are Exited with `why`. One
    /// never started stays Created, as containerd's do (it stops running ones only, and makes
    /// a container's task only at its start, so a dead shim ends none that was not started):
    /// kubelet took an Exited one (255, "Error", started at 0) for a failure.
    pub(super) fn pod_ended(&self, pod_id: &str, why: &str) {
        for ctr in self.ctrs_of(pod_id) {
            if ctr.record().state != ContainerState::Created {
                self.mark_lost(&ctr, why);
            }
        }
    }

    /// Waits for a started container's exit on its pod's agent (`c`, or a connection made
    /// when the watcher needs one), for as long as the agent lives.
    pub(super) fn spawn_watcher(
        self: &Arc<Self>,
        pod: Arc<Pod>,
        ctr: Arc<Ctr>,
        c: Option<AgentClient<Channel>>,
    ) {
        let rt = self.clone();
        tokio::spawn(async move {
            let id = ctr.record().id;
            let mut c = c;
            // Doubled per failed try up to 5 s: an agent that does not answer for long (a
            // stopped or overloaded one) is not asked five times a second per container.
            let mut pause = Duration::from_millis(200);
            loop {
                let waited = match c.as_mut() {
                    Some(c) => {
                        c.wait_container(ap::WaitContainerRequest { id: id.clone() })
                            .await
                    }
                    None => Err(tonic::Status::unavailable("no connection to the pod agent")),
                };
                match waited {
                    Ok(r) => {
                        let exit = r.into_inner().exit.unwrap_or_default();
                        let rec = rt.record_exit(&ctr, &exit);
                        tracing::info!(container = %id, exit_code = rec.exit_code, reason = %rec.reason, "container exited");
                        return;
                    }
                    Err(s) if s.code() == tonic::Code::NotFound => {
                        rt.mark_lost(&ctr, "the pod agent no longer knows this container");
                        return;
                    }
                    Err(s) => {
                        let prec = pod.record();
                        if prec.state != PodState::Ready
                            || ctr.record().state == ContainerState::Exited
                        {
                            return;
                        }
                        if !process::is_alive(prec.agent_pid, prec.agent_start_time) {
                            rt.agent_died(&pod).await;
                            return;
                        }
                        tracing::debug!(container = %id, error = %s, "wait interrupted; retrying");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(5));
                        if let Ok(nc) = pod.client().await {
                            c = Some(nc);
                        }
                    }
                }
            }
        });
    }

    /// Watches a ready pod's host process (flat agent or VM shim): when it exits without a
    /// StopPodSandbox, the pod becomes NotReady and its containers exited, whether or not a
    /// container was running to notice.
    pub(super) fn spawn_pod_watcher(self: &Arc<Self>, pod: Arc<Pod>) {
        let rt = self.clone();
        let rec = pod.record();
        tokio::spawn(async move {
            process::wait_exit(rec.agent_pid, rec.agent_start_time).await;
            process::reap(rec.agent_pid);
            rt.agent_died(&pod).await;
        });
    }

    /// The pod's agent is gone: the pod is NotReady and its containers have exited.
    pub(super) async fn agent_died(&self, pod: &Pod) {
        let _op = pod.op.lock().await;
        let rec = pod.record();
        if rec.state != PodState::Ready || process::is_alive(rec.agent_pid, rec.agent_start_time) {
            return;
        }
        let what = format!("{} exited unexpectedly", self.backend(&rec).host_process());
        tracing::warn!(pod = %rec.id, pid = rec.agent_pid, reason = %what, "pod lost; pod is not ready");
        pod.set_client(None).await;
        // A failed CNI DEL is asked again by kubelet's StopPodSandbox.
        let _ = self.teardown_pod_resources(&rec).await;
        // NotReady first: the containers' stopped events carry the pod's state as it is.
        let rec = pod.update(|r| {
            r.state = PodState::NotReady;
            r.reason = what.clone();
        });
        self.pod_ended(&rec.id, &what);
        self.release_orphans(pod).await;
        let _ = self.dirs.save_pod(&rec);
        self.emit_pod(&rec.id, cri::ContainerEventType::ContainerStoppedEvent);
    }

    /// After a pod's host process died: what its containers hold goes, with any process of
    /// theirs still running. A flat pod's containers in the node's PID namespace outlive
    /// their agent (no pod PID namespace takes them along), and under a kubelet pod cgroup
    /// nothing else removes their cgroups before RemoveContainer: they ran on, reported
    /// exited, beside the ones kubelet started next.
    pub(super) async fn release_orphans(&self, pod: &Pod) {
        let prec = pod.record();
        let backend = self.backend(&prec);
        for ctr in self.ctrs_of(&prec.id) {
            backend.release_container(pod, &ctr.record()).await;
        }
    }
}
