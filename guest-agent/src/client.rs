//! Connecting to an agent (used by vesseld): a flat pod's Unix socket, or a VM pod's agent
//! through the shim's hybrid vsock socket.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
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
    /// The hybrid vsock socket is missing or nobody accepts on it: the shim is not (yet, or
    /// any more) running. Retry while the VM starts.
    #[error("no shim listening at {path}: {source}")]
    NoShim {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The shim closed the connection without `OK`: nothing listens on that port in the
    /// guest (yet). Retry while the guest boots.
    #[error("the guest refused the connection to vsock port {port} (not listening yet?)")]
    Refused { port: u32 },
    /// The handshake did not finish in time.
    #[error("no answer to CONNECT {port} at {path} within {timeout:?}")]
    Timeout {
        path: PathBuf,
        port: u32,
        timeout: Duration,
    },
    /// The shim answered something other than `OK <n>`.
    #[error("unexpected answer {answer:?} to CONNECT {port}")]
    BadAnswer { port: u32, answer: String },
    /// Any other I/O error during the handshake.
    #[error("hybrid vsock handshake at {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ClientError {
    /// Whether retrying may help (the shim or the guest's listener is not up yet).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ClientError::NoShim { .. } | ClientError::Refused { .. } | ClientError::Timeout { .. }
        )
    }
}

fn with_limits(channel: Channel) -> AgentClient<Channel> {
    AgentClient::new(channel)
        .max_decoding_message_size(64 * 1024 * 1024)
        .max_encoding_message_size(64 * 1024 * 1024)
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
    Ok(with_limits(channel))
}

/// Opens a stream to guest vsock `port` through the hybrid vsock Unix socket `uds`:
/// connects, sends `CONNECT <port>\n` and reads the answer `OK <n>\n` (byte by byte: what
/// follows belongs to the guest), all within `timeout`.
pub async fn hybrid_vsock_stream(
    uds: &Path,
    port: u32,
    timeout: Duration,
) -> Result<UnixStream, ClientError> {
    let path = uds.to_path_buf();
    let handshake = async {
        let mut s = UnixStream::connect(uds).await.map_err(|source| {
            use std::io::ErrorKind::*;
            match source.kind() {
                NotFound | ConnectionRefused => ClientError::NoShim {
                    path: path.clone(),
                    source,
                },
                _ => ClientError::Io {
                    path: path.clone(),
                    source,
                },
            }
        })?;
        let io_err = |source| ClientError::Io {
            path: path.clone(),
            source,
        };
        s.write_all(format!("CONNECT {port}\n").as_bytes())
            .await
            .map_err(io_err)?;
        let mut answer = Vec::new();
        loop {
            let mut b = [0u8; 1];
            match s.read(&mut b).await {
                Ok(0) if answer.is_empty() => return Err(ClientError::Refused { port }),
                Ok(0) => break,
                Ok(_) if b[0] == b'\n' => break,
                Ok(_) => {
                    answer.push(b[0]);
                    if answer.len() > 64 {
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                    return Err(ClientError::Refused { port })
                }
                Err(e) => return Err(io_err(e)),
            }
        }
        let answer = String::from_utf8_lossy(&answer).into_owned();
        match answer.strip_prefix("OK ") {
            Some(n) if n.parse::<u32>().is_ok() => Ok(s),
            _ => Err(ClientError::BadAnswer { port, answer }),
        }
    };
    match tokio::time::timeout(timeout, handshake).await {
        Ok(r) => r,
        Err(_) => Err(ClientError::Timeout {
            path: uds.to_path_buf(),
            port,
            timeout,
        }),
    }
}

/// Connects to a VM pod's agent: guest vsock `port` (1024) through the shim's hybrid vsock
/// socket `uds`. One attempt; on a [`ClientError::is_retryable`] error, call it again while
/// the guest boots. Reconnections of the returned channel do the handshake anew.
pub async fn connect_hybrid_vsock(
    uds: &Path,
    port: u32,
    timeout: Duration,
) -> Result<AgentClient<Channel>, ClientError> {
    let first = hybrid_vsock_stream(uds, port, timeout).await?;
    let first = Arc::new(Mutex::new(Some(first)));
    let path = uds.to_path_buf();
    let p = path.clone();
    let channel = Endpoint::from_static("http://vessel-agent")
        .connect_timeout(timeout)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = p.clone();
            let first = first.lock().unwrap_or_else(|e| e.into_inner()).take();
            async move {
                let s = match first {
                    Some(s) => s,
                    None => hybrid_vsock_stream(&p, port, timeout)
                        .await
                        .map_err(|e| std::io::Error::other(e.to_string()))?,
                };
                Ok::<_, std::io::Error>(TokioIo::new(s))
            }
        }))
        .await
        .map_err(|source| ClientError::Connect { path, source })?;
    Ok(with_limits(channel))
}

/// Calls [`connect_hybrid_vsock`] until it succeeds, a non-retryable error happens or
/// `deadline` passes (then the last error), pausing `pause` between attempts.
pub async fn connect_hybrid_vsock_retry(
    uds: &Path,
    port: u32,
    deadline: Duration,
    pause: Duration,
) -> Result<AgentClient<Channel>, ClientError> {
    let end = tokio::time::Instant::now() + deadline;
    loop {
        let left = end.saturating_duration_since(tokio::time::Instant::now());
        match connect_hybrid_vsock(
            uds,
            port,
            left.clamp(Duration::from_millis(100), Duration::from_secs(5)),
        )
        .await
        {
            Ok(c) => return Ok(c),
            Err(e) if e.is_retryable() && tokio::time::Instant::now() + pause < end => {
                tracing::debug!(error = %e, "agent not reachable yet");
                tokio::time::sleep(pause).await;
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto;
    use tokio::io::AsyncBufReadExt;

    /// A fake shim: answers each `CONNECT <port>` line with `answer` (None: close at once)
    /// and, after an `OK`, serves a real agent service on the same stream.
    async fn fake_shim(uds: &Path, answer: Option<&'static str>) -> tokio::task::JoinHandle<()> {
        let listener = tokio::net::UnixListener::bind(uds).unwrap();
        let dir = uds.parent().unwrap().join("state");
        let libct = crate::libct::Libct {
            exe: PathBuf::from("/proc/self/exe"),
            root: dir.join("libcontainer"),
            reaper: crate::reaper::Reaper::new(),
            log_level: "info".into(),
        };
        let state = crate::service::AgentState::new(dir, libct, "fake".into());
        let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<UnixStream>>(4);
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(proto::agent_server::AgentServer::new(
                    crate::service::AgentService { state },
                ))
                .serve_with_incoming(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .unwrap();
        });
        tokio::spawn(async move {
            loop {
                let (s, _) = listener.accept().await.unwrap();
                let mut r = tokio::io::BufReader::new(s);
                let mut line = String::new();
                r.read_line(&mut line).await.unwrap();
                assert_eq!(line, "CONNECT 1024\n");
                let mut s = r.into_inner();
                match answer {
                    None => drop(s),
                    Some("") => {
                        // Say nothing; keep the connection open.
                        tokio::time::sleep(Duration::from_secs(30)).await;
                    }
                    Some(a) => {
                        s.write_all(a.as_bytes()).await.unwrap();
                        if a.starts_with("OK ") {
                            tx.send(Ok(s)).await.unwrap();
                        }
                    }
                }
            }
        })
    }

    #[tokio::test]
    async fn hybrid_vsock_serves_grpc_after_ok() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("vsock.sock");
        let _shim = fake_shim(&uds, Some("OK 1\n")).await;
        let mut c = connect_hybrid_vsock(&uds, 1024, Duration::from_secs(5))
            .await
            .unwrap();
        let p = c.ping(proto::PingRequest {}).await.unwrap().into_inner();
        assert_eq!(p.version, crate::VERSION);
        // A flat agent refuses the VM-only calls.
        let e = c
            .write_files(proto::WriteFilesRequest { entries: vec![] })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    }

    #[tokio::test]
    async fn hybrid_vsock_errors_are_distinguishable() {
        let dir = tempfile::tempdir().unwrap();
        let t = Duration::from_millis(300);

        let e = connect_hybrid_vsock(&dir.path().join("missing"), 1024, t)
            .await
            .unwrap_err();
        assert!(
            matches!(e, ClientError::NoShim { .. }) && e.is_retryable(),
            "{e}"
        );

        let refused = dir.path().join("refused.sock");
        let _a = fake_shim(&refused, None).await;
        let e = connect_hybrid_vsock(&refused, 1024, t).await.unwrap_err();
        assert!(
            matches!(e, ClientError::Refused { port: 1024 }) && e.is_retryable(),
            "{e}"
        );

        let bad = dir.path().join("bad.sock");
        let _b = fake_shim(&bad, Some("NO way\n")).await;
        let e = connect_hybrid_vsock(&bad, 1024, t).await.unwrap_err();
        assert!(
            matches!(e, ClientError::BadAnswer { .. }) && !e.is_retryable(),
            "{e}"
        );
        assert!(e.to_string().contains("NO way"), "{e}");

        let silent = dir.path().join("silent.sock");
        let _c = fake_shim(&silent, Some("")).await;
        let e = connect_hybrid_vsock(&silent, 1024, t).await.unwrap_err();
        assert!(matches!(e, ClientError::Timeout { .. }), "{e}");

        // Retrying gives up with the last retryable error at the deadline.
        let e = connect_hybrid_vsock_retry(&refused, 1024, t, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(e, ClientError::Refused { .. }), "{e}");
    }
}
