//! vessel's CRI test harness, shared by the end-to-end tests, the benchmarks and the
//! `vessel-critest` conformance binary:
//!
//! - [`registry`]: a real Debian `docker-registry` on 127.0.0.1 (plain, htpasswd, TLS, token).
//! - [`daemon`]: a real `vesseld` on a temporary socket and state dir, restartable.
//! - [`client`]: CRI clients over a Unix socket.
//! - [`stream_client`]: a SPDY/3.1 client of the CRI streaming server (exec, port-forward).
//! - [`suite`]: the conformance specs and their runner ([`suite::run`]), for any CRI runtime.
//! - [`upstream`]: upstream cri-tools' `critest` against vessel, judged by an expected list.

pub mod client;
pub mod daemon;
pub mod registry;
pub mod stream_client;
pub mod suite;
pub mod systemd;
pub mod upstream;

/// For the [`e2e_harness`] macro.
pub use tempfile;
