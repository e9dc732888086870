//! Connecting to an agent (used by vesseld).

use std::path::{Path, PathBuf};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::proto::agent_client::AgentClient;

/// Why connecting failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connecting to the agent at {path}: {source}")]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
}

/// Connects to an agent listening on the Unix socket `path`.
pub async fn connect_unix(path: impl AsRef<Path>) -> Result<AgentClient<Channel>, ClientError> {
    let path = path.as_ref().to_path_buf();
    let p = path.clone();
    // The URI is not used for Unix sockets, but must parse.
    let channel = Endpoint::from_static("http://vessel-agent")
        // A wedged agent (full listen backlog) must not hang vesseld's callers.
        .connect_timeout(std::time::Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = p.clone();
            async move {
                let s = tokio::net::UnixStream::connect(p).await?;
                Ok::<_, std::io::Error>(TokioIo::new(s))
            }
        }))
        .await
        .map_err(|source| ClientError::Connect { path, source })?;
    Ok(AgentClient::new(channel)
        .max_decoding_message_size(64 * 1024 * 1024)
        .max_encoding_message_size(64 * 1024 * 1024))
}
