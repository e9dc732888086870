//! Container lifecycle events for GetContainerEvents (kubelet's evented PLEG, `crictl
//! events`): created, started, stopped and deleted, each sent once, at the transition, with
//! the pod's status and its containers' statuses as they are after it. The state machine
//! emits them, so both backends have them alike.

use super::Runtime;
use crate::state::ContainerRecord;
use vessel_cri_api::v1 as cri;

/// Events a slow subscriber may fall behind by before its stream ends (it then relists,
/// as kubelet does after a stream error).
pub(super) const EVENT_BACKLOG: usize = 1024;

impl Runtime {
    /// A receiver of the events from now on.
    pub fn subscribe_events(
        &self,
    ) -> tokio::sync::broadcast::Receiver<cri::ContainerEventResponse> {
        self.events.subscribe()
    }

    /// Sends `kind` for container `rec` to every subscriber (nothing is built when there is
    /// none). A stopped event for a container removed meanwhile is not sent: its deleted
    /// event has gone out already.
    pub(super) fn emit(&self, rec: &ContainerRecord, kind: cri::ContainerEventType) {
        if self.events.receiver_count() == 0 {
            return;
        }
        let known = self
            .ctrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(&rec.id);
        if !known && kind != cri::ContainerEventType::ContainerDeletedEvent {
            return;
        }
        let _ = self.events.send(self.event(&rec.id, &rec.pod_id, kind));
    }

    /// Sends `kind` for the pod sandbox itself (its id as the container id, as containerd
    /// does, so that kubelet's evented PLEG sees sandbox changes too).
    pub(super) fn emit_pod(&self, pod_id: &str, kind: cri::ContainerEventType) {
        if let Some(ev) = self.pod_event(pod_id, kind) {
            let _ = self.events.send(ev);
        }
    }

    /// The event for the pod sandbox `pod_id`, if anyone listens.
    pub(super) fn pod_event(
        &self,
        pod_id: &str,
        kind: cri::ContainerEventType,
    ) -> Option<cri::ContainerEventResponse> {
        (self.events.receiver_count() > 0).then(|| self.event(pod_id, pod_id, kind))
    }

    fn event(
        &self,
        id: &str,
        pod_id: &str,
        kind: cri::ContainerEventType,
    ) -> cri::ContainerEventResponse {
        let status = self.pod_sandbox_status(pod_id, false).ok();
        let (pod_sandbox_status, containers_statuses) = status
            .map(|r| (r.status, r.containers_statuses))
            .unwrap_or_default();
        cri::ContainerEventResponse {
            container_id: id.to_string(),
            container_event_type: kind as i32,
            created_at: crate::state::now_nanos(),
            pod_sandbox_status,
            containers_statuses,
        }
    }

    /// Ends every event stream (shutdown): their clients reconnect to the next vesseld.
    pub fn end_event_streams(&self) {
        let _ = self.shutting_down.send(true);
    }

    /// Resolves once event streams are to end.
    pub fn event_streams_end(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.shutting_down.subscribe();
        async move {
            let _ = rx.wait_for(|v| *v).await;
        }
    }
}
