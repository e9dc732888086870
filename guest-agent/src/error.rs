//! The agent's error type and its mapping to gRPC status codes.

/// An error answered to a gRPC caller; the variant picks the status code.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Unknown container (or exec session).
    #[error("{0}")]
    NotFound(String),
    /// A bad spec or bad arguments.
    #[error("{0}")]
    InvalidArgument(String),
    /// The container is in the wrong state for the request.
    #[error("{0}")]
    FailedPrecondition(String),
    /// Something took too long.
    #[error("{0}")]
    DeadlineExceeded(String),
    /// A container with this id exists already.
    #[error("{0}")]
    AlreadyExists(String),
    /// Anything else, with its cause.
    #[error("{0}")]
    Internal(String),
}

impl AgentError {
    /// `NotFound` naming the container id.
    pub fn no_container(id: &str) -> Self {
        AgentError::NotFound(format!("container {id:?} not found"))
    }

    /// `Internal` with a context and a cause.
    pub fn internal(context: impl std::fmt::Display, cause: impl std::fmt::Display) -> Self {
        AgentError::Internal(format!("{context}: {cause}"))
    }
}

impl From<AgentError> for tonic::Status {
    fn from(e: AgentError) -> Self {
        match e {
            AgentError::NotFound(m) => tonic::Status::not_found(m),
            AgentError::InvalidArgument(m) => tonic::Status::invalid_argument(m),
            AgentError::FailedPrecondition(m) => tonic::Status::failed_precondition(m),
            AgentError::DeadlineExceeded(m) => tonic::Status::deadline_exceeded(m),
            AgentError::AlreadyExists(m) => tonic::Status::already_exists(m),
            AgentError::Internal(m) => tonic::Status::internal(m),
        }
    }
}

/// Checks a container id against the proto's `[A-Za-z0-9_.-]{1,128}` (and refuses `.`/`..`).
pub fn validate_id(id: &str) -> Result<(), AgentError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(AgentError::InvalidArgument(format!(
            "invalid container id {id:?}: want [A-Za-z0-9_.-]{{1,128}}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(validate_id("abc-1.2_3").is_ok());
        assert!(validate_id("").is_err());
        assert!(validate_id("..").is_err());
        assert!(validate_id("a/b").is_err());
        assert!(validate_id(&"a".repeat(129)).is_err());
    }
}

/// A failed system call or I/O step, naming what was being done: start-up code (the flat
/// launcher, the VM init, user namespaces) that runs before there is a request to fail.
#[derive(Debug, thiserror::Error)]
pub enum SysError {
    #[error("{what}: {source}")]
    Sys {
        what: String,
        #[source]
        source: nix::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// A [`SysError::Sys`] maker for `map_err`.
pub fn sys(what: impl Into<String>) -> impl FnOnce(nix::Error) -> SysError {
    let what = what.into();
    move |source| SysError::Sys { what, source }
}

/// A [`SysError::Io`] maker for `map_err`.
pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SysError {
    let what = what.into();
    move |source| SysError::Io { what, source }
}
