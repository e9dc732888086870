//! vesseld: vessel's CRI `runtime.v1` server.
//!
//! - [`config`]: the TOML configuration and its documented defaults.
//! - [`server`]: directories, state lock, the CRI socket, metrics.
//! - [`image_service`]: the CRI ImageService over `vessel-images`.
//! - [`runtime_service`]: the CRI RuntimeService.

pub mod cdi;
pub mod cni;
pub mod config;
pub mod doctor;
pub mod errors;
pub mod grpc;
pub mod image_service;
pub mod metrics;
pub mod notify;
pub mod runtime;
pub mod runtime_service;
pub mod sandbox;
pub mod selinux;
pub mod server;
pub mod spec;
pub mod state;
pub mod streaming;
#[cfg(test)]
mod testing;
pub mod userns;
