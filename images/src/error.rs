//! The image store's error type.

use crate::digest::Digest;
use std::path::PathBuf;

/// Everything that can go wrong in the image store. Each variant names the object and the
/// cause; `vesseld` maps variants to gRPC codes.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(transparent)]
    InvalidReference(#[from] crate::reference::ReferenceError),

    #[error("image {reference:?} not found")]
    NotFound { reference: String },

    #[error("pulling {reference}: {registry} denied access: {message}")]
    Unauthorized {
        reference: String,
        registry: String,
        message: String,
    },

    #[error("pulling {reference}: {registry} answered {status}: {message}")]
    Registry {
        reference: String,
        registry: String,
        status: u16,
        message: String,
    },

    #[error("pulling {reference}: cannot reach {registry}: {message}")]
    Transport {
        reference: String,
        registry: String,
        message: String,
    },

    #[error("{what}: digest mismatch: expected {expected}, got {actual}")]
    DigestMismatch {
        what: String,
        expected: Digest,
        actual: Digest,
    },

    #[error("{what}: size mismatch: expected {expected} bytes, got {actual}")]
    SizeMismatch {
        what: String,
        expected: u64,
        actual: u64,
    },

    #[error("image {reference} has no manifest for platform {platform} (available: {available})")]
    NoMatchingPlatform {
        reference: String,
        platform: String,
        available: String,
    },

    #[error("image {reference}: unsupported media type {media_type:?}")]
    UnsupportedMediaType {
        reference: String,
        media_type: String,
    },

    #[error("image {reference}: {reason}")]
    BadImage { reference: String, reason: String },

    #[error("layer {layer}: {source}")]
    Unpack {
        layer: Digest,
        #[source]
        source: crate::unpack::UnpackError,
    },

    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("import {path}: {reason}")]
    Import { path: PathBuf, reason: String },

    #[error("image ID prefix {prefix:?} is ambiguous: the IDs of {matches} begin with it; give more of the ID")]
    Ambiguous { prefix: String, matches: String },

    #[error("image {reference} is in use by {users}")]
    InUse { reference: String, users: String },
}

impl ImageError {
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| ImageError::Io { op, path, source }
    }
}

pub type Result<T, E = ImageError> = std::result::Result<T, E>;
