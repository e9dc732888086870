//! vessel-shim: the per-VM host process. One shim runs one microVM: it reads a spec, boots the
//! guest with `vessel-vmm`, and exits with the guest's outcome.
