//! vessel-agent: the pod agent and its gRPC API.
//!
//! The same binary runs as PID 1 of a flat pod's namespaces on the host (see [`flat`]) and,
//! later, as PID 1 of a microVM. It owns the pod's containers and drives them with youki's
//! `libcontainer` through a re-executed helper (see [`libct`]).

/// The generated agent API (`proto/agent.proto`): `agent_client::AgentClient`,
/// `agent_server::{Agent, AgentServer}` and the messages.
pub mod proto {
    tonic::include_proto!("vessel.agent.v1");
}

pub mod cgroups;
pub mod client;
pub mod container;
pub mod error;
pub mod flat;
pub mod libct;
pub mod listener;
pub mod logs;
pub mod reaper;
pub mod rootfs;
pub mod service;
pub mod spec;
pub mod stdio;

/// The agent's version, reported by `Ping`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Nanoseconds since the Unix epoch, now.
pub fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}
