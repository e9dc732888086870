//! vessel-vmm: the microVM monitor, on rust-vmm crates (kvm-ioctls, vm-memory, linux-loader,
//! vm-superio, virtio-queue, virtio-vsock).
//!
//! * [`probe`]: is KVM present and fast enough to run guests?

pub mod arch;
pub mod kick;
pub mod probe;
