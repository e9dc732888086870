//! Device models: the legacy PC devices a Linux guest pokes at ([`legacy`]) and virtio.

pub mod legacy;
