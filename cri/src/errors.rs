//! Mapping of library errors to gRPC status codes, with messages that name the object and
//! the cause.

use tonic::Status;
use vessel_images::ImageError;

/// The gRPC status for an image store error.
pub fn image_status(e: &ImageError) -> Status {
    let msg = bounded(e.to_string());
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

/// The longest error message sent to a client. gRPC carries it in a header (`grpc-message`),
/// and clients refuse header blocks over 16 KiB (RESOURCE_EXHAUSTED instead of the real code):
/// a message that echoes a huge name from the request is cut.
pub const MAX_MESSAGE: usize = 4096;

/// `msg`, cut to [`MAX_MESSAGE`] bytes (on a character boundary) with a note of the cut.
pub fn bounded(mut msg: String) -> String {
    if msg.len() <= MAX_MESSAGE {
        return msg;
    }
    let total = msg.len();
    let mut end = MAX_MESSAGE;
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    msg.truncate(end);
    msg.push_str(&format!("... ({} of {total} bytes cut)", total - end));
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_cut_on_a_char_boundary() {
        assert_eq!(bounded("short".into()), "short");
        let m = bounded(format!("name {:?}", "é".repeat(1 << 20)));
        assert!(m.len() < MAX_MESSAGE + 64, "{}", m.len());
        assert!(m.starts_with("name \"é"));
        assert!(m.ends_with("bytes cut)"), "{}", &m[m.len() - 40..]);
    }
}
