//! Mapping of library errors to gRPC status codes, with messages that name the object and
//! the cause.

use tonic::Status;
use vessel_images::ImageError;

/// The gRPC status for an image store error.
pub fn image_status(e: &ImageError) -> Status {
    let msg = e.to_string();
    match e {
        ImageError::InvalidReference(_) => Status::invalid_argument(msg),
        ImageError::NotFound { .. } => Status::not_found(msg),
        ImageError::Registry { status: 404, .. } => Status::not_found(msg),
        ImageError::Registry { status, .. } if *status == 401 || *status == 403 => {
            Status::permission_denied(msg)
        }
        ImageError::Unauthorized { .. } => Status::permission_denied(msg),
        ImageError::Registry { .. } | ImageError::Transport { .. } => Status::unavailable(msg),
        ImageError::NoMatchingPlatform { .. } => Status::not_found(msg),
        ImageError::InUse { .. } => Status::failed_precondition(msg),
        ImageError::DigestMismatch { .. }
        | ImageError::SizeMismatch { .. }
        | ImageError::UnsupportedMediaType { .. }
        | ImageError::BadImage { .. }
        | ImageError::Unpack { .. }
        | ImageError::Import { .. } => Status::failed_precondition(msg),
        ImageError::Io { .. } => Status::internal(msg),
    }
}

/// The answer to an RPC that this build does not serve yet.
pub fn not_built(rpc: &str) -> Status {
    Status::unimplemented(format!("vessel: {rpc} is not implemented yet"))
}
