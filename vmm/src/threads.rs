//! What each VMM thread does to itself as it starts. The VMM's threads have different jobs,
//! and a binary that jails the VMM (the shim) gives each kind its own system-call filter, as
//! Firecracker gives its vCPU, VMM and API threads theirs: it sets one hook
//! ([`set_confine_hook`]) before the VM is built, and every vCPU and device worker calls it
//! with its [`ThreadRole`] once it dropped its capabilities, before it touches anything the
//! guest controls. Without a hook (tests, the benchmark) threads run unconfined.

use std::sync::OnceLock;

/// The kinds of VMM thread, by the work they do for the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ThreadRole {
    /// Runs guest code and emulates the devices' registers and queue notifications.
    Vcpu,
    /// A device's worker (vsock, net): moves data between the guest's queues and host
    /// sockets or a tap.
    Device,
    /// A virtio-fs server: file operations in its share, for the guest.
    FileServer,
}

impl std::fmt::Display for ThreadRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ThreadRole::Vcpu => "vcpu",
            ThreadRole::Device => "device",
            ThreadRole::FileServer => "file-server",
        })
    }
}

/// Confines the calling thread for its role; an error stops the thread before it serves.
pub type ConfineHook = dyn Fn(ThreadRole) -> Result<(), String> + Send + Sync;

static HOOK: OnceLock<Box<ConfineHook>> = OnceLock::new();

/// Sets the process's confinement hook. Once: a second call is refused (`false`).
pub fn set_confine_hook(hook: Box<ConfineHook>) -> bool {
    HOOK.set(hook).is_ok()
}

/// Confines the calling thread for `role`, if a hook was set.
pub(crate) fn confine(role: ThreadRole) -> Result<(), String> {
    match HOOK.get() {
        Some(h) => h(role).map_err(|e| format!("confining this {role} thread: {e}")),
        None => Ok(()),
    }
}
