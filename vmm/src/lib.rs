//! vessel-vmm: the microVM monitor, on rust-vmm crates (kvm-ioctls, vm-memory, linux-loader,
//! vm-superio, virtio-queue, virtio-vsock).
//!
//! * [`probe`]: is KVM present and fast enough to run guests?
//! * [`vm`]: build a VM from a [`vm::VmConfig`], run it, get its [`vm::Outcome`].

pub mod arch;
pub mod boot;
pub mod caps;
pub mod devices;
pub mod kick;
pub mod mptable;
pub mod probe;
pub mod run_state;
pub mod threads;
pub mod virtio;
pub mod vm;
