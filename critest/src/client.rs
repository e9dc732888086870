//! CRI clients over a Unix socket, for any CRI runtime (vessel or containerd).

use std::path::{Path, PathBuf};
use tonic::transport::{Channel, Endpoint, Uri};
use vessel_cri_api::v1 as cri;
use vessel_cri_api::v1::image_service_client::ImageServiceClient;
use vessel_cri_api::v1::runtime_service_client::RuntimeServiceClient;

/// Connects a channel to the CRI socket at `path`.
pub async fn connect(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_path_buf();
    Endpoint::try_from("http://[::1]:0")?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
}

/// Both CRI services on one channel.
#[derive(Clone)]
pub struct CriClient {
    pub runtime: RuntimeServiceClient<Channel>,
    pub images: ImageServiceClient<Channel>,
}

impl CriClient {
    pub async fn connect(path: &Path) -> Result<CriClient, tonic::transport::Error> {
        let ch = connect(path).await?;
        Ok(CriClient {
            runtime: RuntimeServiceClient::new(ch.clone()).max_decoding_message_size(16 << 20),
            images: ImageServiceClient::new(ch).max_decoding_message_size(16 << 20),
        })
    }
}

/// The CRI calls the end-to-end tests make again and again (our `pods_e2e`, `cni_e2e` and
/// the critest suite's `Ctx`), as kubelet makes them: one place, errors as the runtime sent
/// them. Each call clones the client (a channel handle), so `&self` is enough.
impl CriClient {
    pub async fn run_pod(&self, cfg: &cri::PodSandboxConfig, handler: &str) -> CriResult<String> {
        let r = self
            .runtime
            .clone()
            .run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(cfg.clone()),
                runtime_handler: handler.into(),
            })
            .await?;
        Ok(r.into_inner().pod_sandbox_id)
    }

    pub async fn create_container(
        &self,
        pod: &str,
        pcfg: &cri::PodSandboxConfig,
        cfg: cri::ContainerConfig,
    ) -> CriResult<String> {
        let r = self
            .runtime
            .clone()
            .create_container(cri::CreateContainerRequest {
                pod_sandbox_id: pod.into(),
                config: Some(cfg),
                sandbox_config: Some(pcfg.clone()),
            })
            .await?;
        Ok(r.into_inner().container_id)
    }

    pub async fn start_container(&self, id: &str) -> CriResult<()> {
        self.runtime
            .clone()
            .start_container(cri::StartContainerRequest {
                container_id: id.into(),
            })
            .await?;
        Ok(())
    }

    pub async fn container_status(&self, id: &str) -> CriResult<cri::ContainerStatus> {
        self.runtime
            .clone()
            .container_status(cri::ContainerStatusRequest {
                container_id: id.into(),
                verbose: false,
            })
            .await?
            .into_inner()
            .status
            .ok_or_else(|| tonic::Status::internal(format!("ContainerStatus of {id}: no status")))
    }

    pub async fn status(&self, verbose: bool) -> CriResult<cri::StatusResponse> {
        Ok(self
            .runtime
            .clone()
            .status(cri::StatusRequest { verbose })
            .await?
            .into_inner())
    }

    pub async fn pod_status(&self, id: &str) -> CriResult<cri::PodSandboxStatus> {
        self.runtime
            .clone()
            .pod_sandbox_status(cri::PodSandboxStatusRequest {
                pod_sandbox_id: id.into(),
                verbose: false,
            })
            .await?
            .into_inner()
            .status
            .ok_or_else(|| tonic::Status::internal(format!("PodSandboxStatus of {id}: no status")))
    }

    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: &[&str],
        timeout: i64,
    ) -> CriResult<cri::ExecSyncResponse> {
        let r = self
            .runtime
            .clone()
            .exec_sync(cri::ExecSyncRequest {
                container_id: id.into(),
                cmd: cmd.iter().map(|s| s.to_string()).collect(),
                timeout,
            })
            .await?;
        Ok(r.into_inner())
    }

    /// The ids of the pods `filter` lists.
    pub async fn list_pod_ids(&self, filter: cri::PodSandboxFilter) -> CriResult<Vec<String>> {
        let r = self
            .runtime
            .clone()
            .list_pod_sandbox(cri::ListPodSandboxRequest {
                filter: Some(filter),
            })
            .await?;
        Ok(r.into_inner().items.into_iter().map(|p| p.id).collect())
    }

    /// The ids of the containers `filter` lists.
    pub async fn list_container_ids(&self, filter: cri::ContainerFilter) -> CriResult<Vec<String>> {
        let r = self
            .runtime
            .clone()
            .list_containers(cri::ListContainersRequest {
                filter: Some(filter),
            })
            .await?;
        Ok(r.into_inner()
            .containers
            .into_iter()
            .map(|c| c.id)
            .collect())
    }

    /// PullImage of `image` with no credentials; the image ref pulled.
    pub async fn pull(&self, image: &str) -> CriResult<String> {
        let r = self
            .images
            .clone()
            .pull_image(cri::PullImageRequest {
                image: Some(cri::ImageSpec {
                    image: image.into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await?;
        Ok(r.into_inner().image_ref)
    }

    /// The `info` object of a pod's verbose PodSandboxStatus (vessel's: backend, pid,
    /// agentSocket, vm, ...).
    pub async fn pod_info(&self, id: &str) -> CriResult<serde_json::Value> {
        let info = self
            .runtime
            .clone()
            .pod_sandbox_status(cri::PodSandboxStatusRequest {
                pod_sandbox_id: id.into(),
                verbose: true,
            })
            .await?
            .into_inner()
            .info;
        info_object(&info)
    }

    /// The `info` object of a container's verbose ContainerStatus (what `crictl inspect`
    /// prints under `info`: sandboxID, pid, config, runtimeSpec, ...).
    pub async fn container_info(&self, id: &str) -> CriResult<serde_json::Value> {
        let info = self
            .runtime
            .clone()
            .container_status(cri::ContainerStatusRequest {
                container_id: id.into(),
                verbose: true,
            })
            .await?
            .into_inner()
            .info;
        info_object(&info)
    }

    /// StopPodSandbox then RemovePodSandbox, as kubelet does.
    pub async fn stop_and_remove_pod(&self, id: &str) -> CriResult<()> {
        let mut rt = self.runtime.clone();
        rt.stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: id.into(),
        })
        .await?;
        rt.remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: id.into(),
        })
        .await?;
        Ok(())
    }
}

/// What a CRI call answers.
pub type CriResult<T> = Result<T, tonic::Status>;

/// A container of `image` running `sh -c script`, logging to `<name>.log` in its pod's log
/// directory.
pub fn sh_container(name: &str, image: &str, script: &str) -> cri::ContainerConfig {
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: image.into(),
            ..Default::default()
        }),
        command: vec!["sh".into(), "-c".into(), script.into()],
        log_path: format!("{name}.log"),
        ..Default::default()
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago, for a test's hostPort.
pub fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A TCP hostPort mapping on every host address, as kubelet sends one.
pub fn tcp_host_port(container_port: i32, host_port: u16) -> cri::PortMapping {
    cri::PortMapping {
        protocol: cri::Protocol::Tcp as i32,
        container_port,
        host_port: i32::from(host_port),
        host_ip: String::new(),
    }
}

/// A pod config named `name` in `namespace`, with its name as hostname, logging in the
/// directory `name` under `logs`.
pub fn pod_config(name: &str, namespace: &str, logs: &Path) -> cri::PodSandboxConfig {
    cri::PodSandboxConfig {
        metadata: pod_metadata(name, namespace),
        hostname: name.into(),
        log_directory: logs.join(name).display().to_string(),
        ..Default::default()
    }
}

/// A pod config's namespace options, made (empty) where it has none.
pub fn pod_namespaces(cfg: &mut cri::PodSandboxConfig) -> &mut cri::NamespaceOption {
    cfg.linux
        .get_or_insert_with(Default::default)
        .security_context
        .get_or_insert_with(Default::default)
        .namespace_options
        .get_or_insert_with(Default::default)
}

/// A pod's metadata with a uid made from its name.
pub fn pod_metadata(name: &str, namespace: &str) -> Option<cri::PodSandboxMetadata> {
    Some(cri::PodSandboxMetadata {
        name: name.into(),
        uid: format!("uid-{name}"),
        namespace: namespace.into(),
        attempt: 0,
    })
}

/// The JSON under `info` in a verbose status reply's info map.
fn info_object(info: &std::collections::HashMap<String, String>) -> CriResult<serde_json::Value> {
    let text = info
        .get("info")
        .ok_or_else(|| tonic::Status::internal("no verbose info"))?;
    serde_json::from_str(text).map_err(|e| tonic::Status::internal(e.to_string()))
}
