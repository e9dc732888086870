//! Where the agent listens: a Unix socket for flat pods, AF_VSOCK for VM pods.

use std::future::Future;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use tokio_stream::wrappers::UnixListenerStream;

use crate::proto::agent_server::AgentServer;
use crate::service::AgentService;

/// The agent's listening endpoint.
#[derive(Debug)]
pub enum AgentListener {
    /// A Unix socket (mode 0600) at `path`.
    Unix {
        listener: std::os::unix::net::UnixListener,
        path: PathBuf,
    },
    /// An AF_VSOCK socket on `port`, any CID (VM mode).
    Vsock(crate::vsock::VsockListener),
}

impl AgentListener {
    /// Binds a Unix socket at `path` (replacing a stale one), mode 0600. Call it while the
    /// process is single-threaded: it narrows the umask around `bind`.
    pub fn bind_unix(path: &Path) -> std::io::Result<AgentListener> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
        let bound = std::os::unix::net::UnixListener::bind(path);
        nix::sys::stat::umask(old);
        let listener = bound?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        listener.set_nonblocking(true)?;
        Ok(AgentListener::Unix {
            listener,
            path: path.to_path_buf(),
        })
    }

    /// Binds AF_VSOCK `port` on any CID.
    pub fn bind_vsock(port: u32) -> std::io::Result<AgentListener> {
        crate::vsock::VsockListener::bind(port).map(AgentListener::Vsock)
    }

    /// Where a client connects, for logs.
    pub fn describe(&self) -> String {
        match self {
            AgentListener::Unix { path, .. } => format!("unix:{}", path.display()),
            AgentListener::Vsock(l) => format!("vsock:any:{}", l.port),
        }
    }

    /// Removes the socket file.
    pub fn cleanup(path: &Path) {
        let _ = std::fs::remove_file(path);
    }

    /// Serves the agent API for `state` until it is asked to exit (Shutdown, a signal, the
    /// power button): the server shuts down gracefully so that answers in flight go out, and
    /// idle clients get `grace` before the call returns anyway.
    pub async fn serve_until_exit(
        self,
        state: &std::sync::Arc<crate::service::AgentState>,
        grace: std::time::Duration,
    ) -> Result<(), tonic::transport::Error> {
        let mut stop = state.shutdown_signal();
        let mut stop2 = state.shutdown_signal();
        let shutdown = async move {
            let _ = stop.wait_for(|v| *v).await;
        };
        let server = self.serve(
            AgentService {
                state: state.clone(),
            },
            shutdown,
        );
        tokio::select! {
            r = server => r,
            _ = async {
                let _ = stop2.wait_for(|v| *v).await;
                tokio::time::sleep(grace).await;
            } => Ok(()),
        }
    }

    /// Serves `svc` until `shutdown` completes (needs a tokio runtime).
    pub async fn serve(
        self,
        svc: AgentService,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), tonic::transport::Error> {
        let server = tonic::transport::Server::builder().add_service(
            AgentServer::new(svc)
                .max_decoding_message_size(64 * 1024 * 1024)
                .max_encoding_message_size(64 * 1024 * 1024),
        );
        match self {
            AgentListener::Unix { listener, .. } => {
                let listener = tokio::net::UnixListener::from_std(listener)
                    .expect("a non-blocking Unix listener converts inside a runtime");
                server
                    .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
                    .await
            }
            AgentListener::Vsock(l) => {
                let incoming = l
                    .incoming()
                    .expect("registering the vsock listener inside a runtime");
                server
                    .serve_with_incoming_shutdown(incoming, shutdown)
                    .await
            }
        }
    }
}
