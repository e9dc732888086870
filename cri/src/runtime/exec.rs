//! Processes in running containers: ExecSync, the streaming Exec and Attach, and the
//! checks the streaming RPCs make; ReopenContainerLog.

use super::Runtime;
use crate::errors::{agent_err, Result, RuntimeError};
use crate::sandbox::{ForwardTarget, Pod};
use crate::state::{ContainerRecord, ContainerState, PodRecord, PodState};
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::Channel;
use vessel_agent::proto::{self as ap, agent_client::AgentClient};
use vessel_cri_api::v1 as cri;

/// An interactive exec in progress: input to the agent, and its output.
pub type ExecChannels = (
    tokio::sync::mpsc::Sender<ap::ExecInput>,
    tonic::Streaming<ap::ExecOutput>,
);

impl Runtime {
    pub(super) async fn running(
        &self,
        id: &str,
        what: &str,
    ) -> Result<(ContainerRecord, AgentClient<Channel>)> {
        let (rec, pod) = self.running_in_pod(id, what)?;
        let c = pod.client().await?;
        Ok((rec, c))
    }

    /// A running container's record and its pod, or why `what` cannot act on it.
    fn running_in_pod(&self, id: &str, what: &str) -> Result<(ContainerRecord, Arc<Pod>)> {
        let rec = self.ctr(id)?.record();
        if rec.state != ContainerState::Running {
            return Err(RuntimeError::FailedPrecondition(format!(
                "{what}: container {} is not running ({:?})",
                rec.id, rec.state
            )));
        }
        let pod = self.pod(&rec.pod_id)?;
        Ok((rec, pod))
    }

    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: Vec<String>,
        timeout_secs: i64,
    ) -> Result<cri::ExecSyncResponse> {
        if cmd.is_empty() || cmd[0].is_empty() {
            return Err(RuntimeError::InvalidArgument(
                "ExecSync: empty command".into(),
            ));
        }
        let (rec, mut c) = self.running(id, "ExecSync").await?;
        let call = c.exec_sync(ap::ExecSyncRequest {
            id: rec.id.clone(),
            args: cmd.clone(),
            env: vec![],
            cwd: String::new(),
            timeout_ms: (timeout_secs.max(0) as u64) * 1000,
        });
        // The agent enforces the timeout; ours is a backstop in case it cannot.
        let r = if timeout_secs > 0 {
            tokio::time::timeout(Duration::from_secs(timeout_secs as u64 + 10), call)
                .await
                .map_err(|_| {
                    RuntimeError::DeadlineExceeded(format!(
                        "ExecSync in container {}: command {:?} timed out after {timeout_secs}s",
                        rec.id, cmd
                    ))
                })?
        } else {
            call.await
        }
        .map_err(|s| agent_err(&format!("ExecSync in {}", rec.id), s))?
        .into_inner();
        if r.timed_out {
            return Err(RuntimeError::DeadlineExceeded(format!(
                "ExecSync in container {}: command {:?} timed out after {timeout_secs}s",
                rec.id, cmd
            )));
        }
        Ok(cri::ExecSyncResponse {
            stdout: r.stdout,
            stderr: r.stderr,
            exit_code: r.exit_code,
        })
    }

    pub async fn reopen_log(&self, id: &str) -> Result<()> {
        let (rec, pod) = self.running_in_pod(id, "ReopenContainerLog")?;
        self.backend(&pod.record()).reopen_log(&pod, &rec).await
    }

    /// Where PortForward connects for a ready pod, or why it cannot.
    pub fn forward_target(&self, pod_id: &str) -> Result<(PodRecord, ForwardTarget)> {
        let rec = self.pod(pod_id)?.record();
        if rec.state != PodState::Ready {
            return Err(RuntimeError::FailedPrecondition(format!(
                "PortForward: pod sandbox {} is not ready",
                rec.id
            )));
        }
        let t = self.backend(&rec).forward_target(&rec)?;
        Ok((rec, t))
    }

    /// A container's record, for the streaming RPCs' checks.
    pub fn streaming_container(&self, id: &str) -> Result<ContainerRecord> {
        Ok(self.ctr(id)?.record())
    }

    /// Starts an interactive exec through the pod agent's `Exec` stream (flat and VM pods).
    pub async fn exec_stream(
        &self,
        id: &str,
        cmd: Vec<String>,
        tty: bool,
        stdin: bool,
        size: Option<ap::WindowSize>,
    ) -> Result<ExecChannels> {
        if cmd.is_empty() || cmd[0].is_empty() {
            return Err(RuntimeError::InvalidArgument("Exec: empty command".into()));
        }
        self.agent_session(id, "Exec", false, |rec| {
            ap::exec_input::Msg::Start(ap::ExecStart {
                id: rec.id.clone(),
                args: cmd,
                // A terminal's TERM whatever the container's (one made without a tty has
                // none: `kubectl exec -it` then had no `clear`, `top` or `vi`), as containerd
                // sets it.
                env: if tty {
                    vec!["TERM=xterm".into()]
                } else {
                    vec![]
                },
                cwd: String::new(),
                tty,
                stdin,
                size,
            })
        })
        .await
    }

    /// Attaches to a running container's own stdio through its pod agent (flat or VM alike):
    /// input goes in as for Exec; output is what the container writes from now on, then its
    /// exit code. A container created without stdin takes no input: the client's is dropped,
    /// its output still comes (as containerd does; kubectl attach -i asks for stdin whatever
    /// the container's spec says).
    pub async fn attach_stream(&self, id: &str, stdin: bool) -> Result<ExecChannels> {
        self.agent_session(id, "Attach", true, |rec| {
            ap::exec_input::Msg::Attach(ap::AttachStart {
                id: rec.id.clone(),
                stdin: stdin && rec.config.stdin,
            })
        })
        .await
    }

    /// Opens the agent's Exec (or Attach) stream for a running container, its first message
    /// made by `start`.
    async fn agent_session(
        &self,
        id: &str,
        what: &str,
        attach: bool,
        start: impl FnOnce(&ContainerRecord) -> ap::exec_input::Msg,
    ) -> Result<ExecChannels> {
        let (rec, mut c) = self.running(id, what).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tx.send(ap::ExecInput {
            msg: Some(start(&rec)),
        })
        .await
        .map_err(|_| RuntimeError::Internal(format!("{what}: input channel closed")))?;
        let input = tokio_stream::wrappers::ReceiverStream::new(rx);
        let out = if attach {
            c.attach(input).await
        } else {
            c.exec(input).await
        }
        .map_err(|s| agent_err(&format!("{what} in {}", rec.id), s))?
        .into_inner();
        Ok((tx, out))
    }
}
