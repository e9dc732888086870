//! vessel-agent: the pod agent and its gRPC API.

/// The generated agent API (`proto/agent.proto`): `agent_client::AgentClient`,
/// `agent_server::{Agent, AgentServer}` and the messages.
pub mod proto {
    tonic::include_proto!("vessel.agent.v1");
}
