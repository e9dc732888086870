//! vessel-agent: the pod agent and its gRPC API.
//!
//! The same binary runs as PID 1 of a flat pod's namespaces on the host (see [`flat`]) and
//! as PID 1 of a microVM (see [`vm`]). It owns the pod's containers and drives them with
//! youki's `libcontainer` through a re-executed helper (see [`libct`]).
//!
//! # Driving a flat agent (what vesseld needs to know)
//!
//! - Start `vessel-agent flat --socket S --state-dir D --hostname H [--share-host net,pid,ipc]`
//!   with stdout a pipe; read one line `READY <pid>` (then EOF). A non-zero exit means it
//!   failed (error on stderr) and left nothing behind. `<pid>` is the agent on the host: pin
//!   the pod netns by bind-mounting `/proc/<pid>/ns/net`. Connect with
//!   [`client::connect_unix`].
//! - Specs: see [`spec`]: `root.path` is replaced; namespace `path: "agent"` joins the
//!   agent's (= the pod's) namespace; give every container its own `linux.cgroupsPath`
//!   (cgroupfs style, e.g. `/vessel/<pod>/<container>`). The agent removes the container's
//!   own cgroup on delete, not its parents. After an agent crash (SIGKILL) the container
//!   processes die with the pod's pid namespace (not so with `--share-host pid`) and the
//!   overlay mounts vanish with its mount namespace, but the (empty) cgroups and the state
//!   dir remain for vesseld to remove.
//! - Exit codes are kept in memory until DeleteContainer; they survive client disconnects,
//!   not agent restarts.
//!
//! # Driving a VM agent
//!
//! - Guest image: `scripts/build-guest-initrd.sh` (the agent is `/init`), the kernel from
//!   `scripts/build-guest-kernel.sh`; `vessel.log=<filter>` on the kernel command line sets
//!   the agent's console log level (default `warn`).
//! - Connect with [`client::connect_hybrid_vsock`]`(uds, 1024, timeout)` (one attempt;
//!   retry while [`client::ClientError::is_retryable`]) or
//!   [`client::connect_hybrid_vsock_retry`]. Then `Ping` (pid 1), `ConfigureSandbox`,
//!   `WriteFiles` under `/run/vessel/files/`.
//! - `CreateContainer` with `Rootfs.disks` (serials, bottom first) and `log_vsock_port`
//!   (1025): the agent connects to CID 2 at that port, sends `<id>\n`, then CRI lines.
//! - `Shutdown` (or `vessel-stop` on the console) stops every container and powers the guest
//!   off after answering.
//! - `vessel-agent debug-client --hybrid-vsock UDS ping|shutdown|run ...` (hidden) is a
//!   manual client for all of this.

/// The generated agent API (`proto/agent.proto`): `agent_client::AgentClient`,
/// `agent_server::{Agent, AgentServer}` and the messages.
pub mod proto {
    tonic::include_proto!("vessel.agent.v1");
}

pub mod apparmor;
pub mod cgroups;
pub mod client;
pub mod container;
pub mod debug_client;
pub mod devbind;
pub mod disks;
pub mod error;
pub mod files;
pub mod flat;
pub mod forward;
pub mod libct;
pub mod listener;
pub mod logs;
pub mod mount_tree;
pub mod net;
pub mod netlink;
pub mod reaper;
pub mod rootfs;
pub mod rootfs_diff;
pub mod service;
pub mod signals;
pub mod spec;
pub mod stdio;
pub mod userns;
pub mod vm;
pub mod volumes;
pub mod vsock;

/// The agent's version, reported by `Ping`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The agent keeps the pod's /dev/shm (a spec bind from [`spec::POD_SHM`]).
pub const FEATURE_POD_SHM: &str = "pod-shm";

/// A flat pod's shared pid namespace is below the agent's, with a holder as its PID 1
/// ([`userns::create_pid_holder`]), not the agent's own (whose root is the host's).
pub const FEATURE_PID_HOLDER: &str = "pid-holder";

/// ConfigureSandbox sets an interface's MAC and MTU (`GuestInterface.mac`, `.mtu`): a VM pod's
/// eth0 gets them from the agent, not from the virtio-net device.
pub const FEATURE_LINK_ADDR: &str = "link-addr";

/// What this agent answers in `PingResponse.features`.
pub const FEATURES: &[&str] = &[FEATURE_POD_SHM, FEATURE_PID_HOLDER, FEATURE_LINK_ADDR];

/// Nanoseconds since the Unix epoch, now.
pub fn now_nanos() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        // Saturates (in the year 2262) rather than wrapping negative.
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
