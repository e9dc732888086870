//! Container lifecycle events for GetContainerEvents (kubelet's evented PLEG, `crictl
//! events`): created, started, stopped and deleted, each sent once, at the transition, with
//! the pod's status and its containers' statuses as they are after it. The state machine
//! emits them, so both backends have them alike.

use super::Runtime;
use crate::state::{ContainerRecord, ContainerState};
use k8s_cri::v1 as cri;

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

    /// Sends `kind` for `rec` to every subscriber (nothing is built when there is none).
    pub(super) fn emit(&self, rec: &ContainerRecord, kind: cri::ContainerEventType) {
        if self.events.receiver_count() == 0 {
            return;
        }
        let pod_sandbox_status = self
            .pod_sandbox_status(&rec.pod_id, false)
            .ok()
            .and_then(|r| r.status);
        let containers_statuses = self
            .ctrs_of(&rec.pod_id)
            .iter()
            .map(|c| c.record())
            .filter(|r| r.state != ContainerState::Creating)
            .map(|r| self.to_status(&r))
            .collect();
        let _ = self.events.send(cri::ContainerEventResponse {
            container_id: rec.id.clone(),
            container_event_type: kind as i32,
            created_at: crate::state::now_nanos(),
            pod_sandbox_status,
            containers_statuses,
        });
    }
}
