//! vessel's image store.
//!
//! - [`reference`]: image references normalised the way kubelet and containerd do.
//! - [`store`]: the content-addressed blob store, image records and unpacked layers.
//! - [`registry`]: pulls over the OCI distribution API (auth, mirrors, platforms);
//!   [`hosts`]: per-registry settings (mirrors, TLS, headers) and the endpoints they give.
//! - [`unpack`]: applying a layer tarball to a directory, safely.
//! - [`erofs`]: read-only EROFS images of unpacked layers, the rootfs disks of VM pods.
//! - [`snapshot`]: container root filesystems as overlayfs mounts over shared layers.
//! - [`import`]: offline import of OCI layouts and docker-archive tarballs.
//! - [`push`] and [`testimages`]: building and pushing the deterministic test images;
//!   [`testrng`]: the seeded generator of the tests that draw random inputs.

pub mod challenge;
pub mod digest;
pub mod erofs;
pub mod error;
pub mod fsutil;
pub mod hosts;
pub mod import;
pub mod oci;
#[cfg(feature = "test-support")]
pub mod push;
pub mod reference;
pub mod registry;
pub mod snapshot;
pub mod store;
#[cfg(feature = "test-support")]
pub mod testimages;
#[cfg(feature = "test-support")]
pub mod testrng;
pub mod unpack;

pub use digest::Digest;
pub use error::ImageError;
pub use hosts::{Mirror, MirrorConfig, RegistryConfig};
pub use reference::Reference;
pub use registry::{Credentials, PullConfig, Puller};
pub use store::{ImageRecord, ImageStore};
