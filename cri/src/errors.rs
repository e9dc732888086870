//! Mapping of library errors to gRPC status codes, with messages that name the object and
//! the cause. Every RPC error becomes a `tonic::Status` here and nowhere else.

use tonic::Status;
use vessel_images::ImageError;

/// An I/O failure on a path, with what was being done ("create /var/lib/vessel/pods: ...").
/// The error enums of vesseld's modules wrap it (`#[error(transparent)] Io(#[from] IoAt)`).
#[derive(Debug, thiserror::Error)]
#[error("{op} {path}: {source}")]
pub struct IoAt {
    pub op: &'static str,
    pub path: std::path::PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// `.map_err(io_at("create", &dir))` into any error that wraps [`IoAt`].
pub fn io_at<E: From<IoAt>>(
    op: &'static str,
    path: &std::path::Path,
) -> impl FnOnce(std::io::Error) -> E {
    let path = path.to_path_buf();
    move |source| IoAt { op, path, source }.into()
}

/// Errors of runtime operations (pods, containers, sandboxes); each maps to one gRPC code in
/// [`RuntimeError::to_status`], the one place a runtime error becomes a `tonic::Status`.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
    /// An internal failure of something below the runtime (state files, the image store, a
    /// backend's process or socket), its cause kept as the error's source.
    #[error("{context}: {source}")]
    Caused {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
}

impl RuntimeError {
    pub fn to_status(&self) -> Status {
        let m = bounded(self.to_string());
        match self {
            RuntimeError::InvalidArgument(_) => Status::invalid_argument(m),
            RuntimeError::NotFound(_) => Status::not_found(m),
            RuntimeError::AlreadyExists(_) => Status::already_exists(m),
            RuntimeError::FailedPrecondition(_) => Status::failed_precondition(m),
            RuntimeError::DeadlineExceeded(_) => Status::deadline_exceeded(m),
            RuntimeError::Unavailable(_) => Status::unavailable(m),
            RuntimeError::Internal(_) | RuntimeError::Caused { .. } => Status::internal(m),
        }
    }
}

impl From<RuntimeError> for Status {
    fn from(e: RuntimeError) -> Status {
        e.to_status()
    }
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// A lookup's object, or `None` where it is not there (NotFound): for the calls that are done
/// when their object is gone (CRI's stop and remove).
pub fn if_found<T>(r: Result<T>) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(RuntimeError::NotFound(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// An internal failure with its context, the cause kept as its source:
/// `.map_err(internal("saving pod record"))`.
pub fn internal<E>(context: impl Into<String>) -> impl FnOnce(E) -> RuntimeError
where
    E: std::error::Error + Send + Sync + 'static,
{
    let context = context.into();
    move |e| RuntimeError::Caused {
        context,
        source: Box::new(e),
    }
}

/// A CNI failure as a runtime error.
pub fn cni_err(e: crate::cni::CniError) -> RuntimeError {
    use crate::cni::CniError as E;
    match e {
        E::NoConfig(_) | E::BadConfig { .. } | E::PluginNotFound { .. } => {
            RuntimeError::FailedPrecondition(e.to_string())
        }
        E::Timeout { .. } => RuntimeError::DeadlineExceeded(e.to_string()),
        E::Plugin { .. } | E::Cache { .. } | E::NoAddress { .. } => {
            RuntimeError::Internal(e.to_string())
        }
    }
}

/// An agent answer that failed, as a runtime error with the agent's code.
pub fn agent_err(ctx: &str, s: tonic::Status) -> RuntimeError {
    let m = format!("{ctx}: pod agent: {}", s.message());
    match s.code() {
        tonic::Code::InvalidArgument => RuntimeError::InvalidArgument(m),
        tonic::Code::NotFound => RuntimeError::NotFound(m),
        tonic::Code::AlreadyExists => RuntimeError::AlreadyExists(m),
        tonic::Code::FailedPrecondition => RuntimeError::FailedPrecondition(m),
        tonic::Code::DeadlineExceeded => RuntimeError::DeadlineExceeded(m),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
            RuntimeError::Unavailable(m)
        }
        _ => RuntimeError::Internal(m),
    }
}

/// The gRPC status for an image store error.
pub fn image_status(e: &ImageError) -> Status {
    let msg = bounded(e.to_string());
    match e {
        ImageError::InvalidReference(_) | ImageError::Ambiguous { .. } => {
            Status::invalid_argument(msg)
        }
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
    fn internal_failures_keep_their_cause() {
        let io = std::io::Error::from(std::io::ErrorKind::StorageFull);
        let e: RuntimeError = internal("saving pod record p1")(IoAt {
            op: "write",
            path: "/var/lib/vessel/pods/p1/pod.json".into(),
            source: io,
        });
        assert_eq!(
            e.to_string(),
            "saving pod record p1: write /var/lib/vessel/pods/p1/pod.json: no storage space"
        );
        let cause = std::error::Error::source(&e).expect("a source");
        let io = std::error::Error::source(cause).expect("the I/O error under it");
        assert_eq!(
            io.downcast_ref::<std::io::Error>().map(|e| e.kind()),
            Some(std::io::ErrorKind::StorageFull)
        );
        assert_eq!(e.to_status().code(), tonic::Code::Internal);
    }

    #[test]
    fn long_messages_are_cut_on_a_char_boundary() {
        assert_eq!(bounded("short".into()), "short");
        let m = bounded(format!("name {:?}", "é".repeat(1 << 20)));
        assert!(m.len() < MAX_MESSAGE + 64, "{}", m.len());
        assert!(m.starts_with("name \"é"));
        assert!(m.ends_with("bytes cut)"), "{}", &m[m.len() - 40..]);
    }
}
