//! Kicking a vCPU thread out of `KVM_RUN`: a real-time signal with an empty handler,
//! installed without `SA_RESTART`, makes the ioctl return `EINTR`.

use std::sync::Once;

/// The signal used to kick vCPU threads (`SIGRTMIN`).
pub fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// Installs the (empty) kick handler once per process.
pub fn install_kick_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if let Err(e) = vmm_sys_util::signal::register_signal_handler(kick_signal(), on_kick) {
            tracing::warn!("cannot install the vCPU kick signal handler: {e}");
        }
    });
}

/// Sends the kick signal to a thread.
pub fn kick_thread(thread: libc::pthread_t) {
    // SAFETY: pthread_kill only delivers a signal; the caller passes the id of a thread it
    // started and has not joined, and the handler installed for this signal does nothing.
    unsafe {
        libc::pthread_kill(thread, kick_signal());
    }
}
