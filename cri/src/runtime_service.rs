//! CRI RuntimeService. This build answers `Version` and `Status`; pod and container RPCs
//! answer `Unimplemented` with a message saying so, until the sandbox backends land.

use crate::config::Config;
use crate::errors::not_built;
use k8s_cri::v1 as cri;
use std::collections::HashMap;
use tonic::{Request, Response, Status};

/// The CRI API version kubelet negotiates.
pub const KUBE_API_VERSION: &str = "0.1.0";
pub const RUNTIME_NAME: &str = "vessel";
pub const RUNTIME_API_VERSION: &str = "v1";

pub struct RuntimeService {
    root_dir: String,
}

impl RuntimeService {
    pub fn new(config: &Config) -> Self {
        RuntimeService {
            root_dir: config.daemon.root_dir.display().to_string(),
        }
    }

    /// Runtime conditions. Pods cannot run in this build, and no CNI is wired yet: both
    /// conditions say so rather than pretend.
    fn conditions(&self) -> Vec<cri::RuntimeCondition> {
        vec![
            cri::RuntimeCondition {
                r#type: "RuntimeReady".into(),
                status: false,
                reason: "SandboxBackendMissing".into(),
                message: "vessel: this build serves images only; pod sandboxes (flat and vm) are not implemented yet".into(),
            },
            cri::RuntimeCondition {
                r#type: "NetworkReady".into(),
                status: false,
                reason: "NetworkPluginNotReady".into(),
                message: "vessel: CNI support is not implemented yet".into(),
            },
        ]
    }
}

type EventStream = std::pin::Pin<
    Box<dyn futures::Stream<Item = Result<cri::ContainerEventResponse, Status>> + Send + 'static>,
>;

#[tonic::async_trait]
impl cri::runtime_service_server::RuntimeService for RuntimeService {
    async fn version(
        &self,
        _req: Request<cri::VersionRequest>,
    ) -> Result<Response<cri::VersionResponse>, Status> {
        Ok(Response::new(cri::VersionResponse {
            version: KUBE_API_VERSION.into(),
            runtime_name: RUNTIME_NAME.into(),
            runtime_version: env!("CARGO_PKG_VERSION").into(),
            runtime_api_version: RUNTIME_API_VERSION.into(),
        }))
    }

    async fn status(
        &self,
        req: Request<cri::StatusRequest>,
    ) -> Result<Response<cri::StatusResponse>, Status> {
        let mut info = HashMap::new();
        if req.into_inner().verbose {
            info.insert(
                "config".to_string(),
                serde_json::json!({
                    "runtime": RUNTIME_NAME,
                    "version": env!("CARGO_PKG_VERSION"),
                    "rootDir": self.root_dir,
                    "sandboxBackends": [],
                })
                .to_string(),
            );
        }
        Ok(Response::new(cri::StatusResponse {
            status: Some(cri::RuntimeStatus {
                conditions: self.conditions(),
            }),
            info,
            ..Default::default()
        }))
    }

    async fn run_pod_sandbox(
        &self,
        _req: Request<cri::RunPodSandboxRequest>,
    ) -> Result<Response<cri::RunPodSandboxResponse>, Status> {
        Err(not_built("RunPodSandbox"))
    }

    async fn stop_pod_sandbox(
        &self,
        _req: Request<cri::StopPodSandboxRequest>,
    ) -> Result<Response<cri::StopPodSandboxResponse>, Status> {
        Err(not_built("StopPodSandbox"))
    }

    async fn remove_pod_sandbox(
        &self,
        _req: Request<cri::RemovePodSandboxRequest>,
    ) -> Result<Response<cri::RemovePodSandboxResponse>, Status> {
        Err(not_built("RemovePodSandbox"))
    }

    async fn pod_sandbox_status(
        &self,
        _req: Request<cri::PodSandboxStatusRequest>,
    ) -> Result<Response<cri::PodSandboxStatusResponse>, Status> {
        Err(not_built("PodSandboxStatus"))
    }

    async fn list_pod_sandbox(
        &self,
        _req: Request<cri::ListPodSandboxRequest>,
    ) -> Result<Response<cri::ListPodSandboxResponse>, Status> {
        Err(not_built("ListPodSandbox"))
    }

    async fn create_container(
        &self,
        _req: Request<cri::CreateContainerRequest>,
    ) -> Result<Response<cri::CreateContainerResponse>, Status> {
        Err(not_built("CreateContainer"))
    }

    async fn start_container(
        &self,
        _req: Request<cri::StartContainerRequest>,
    ) -> Result<Response<cri::StartContainerResponse>, Status> {
        Err(not_built("StartContainer"))
    }

    async fn stop_container(
        &self,
        _req: Request<cri::StopContainerRequest>,
    ) -> Result<Response<cri::StopContainerResponse>, Status> {
        Err(not_built("StopContainer"))
    }

    async fn remove_container(
        &self,
        _req: Request<cri::RemoveContainerRequest>,
    ) -> Result<Response<cri::RemoveContainerResponse>, Status> {
        Err(not_built("RemoveContainer"))
    }

    async fn list_containers(
        &self,
        _req: Request<cri::ListContainersRequest>,
    ) -> Result<Response<cri::ListContainersResponse>, Status> {
        Err(not_built("ListContainers"))
    }

    async fn container_status(
        &self,
        _req: Request<cri::ContainerStatusRequest>,
    ) -> Result<Response<cri::ContainerStatusResponse>, Status> {
        Err(not_built("ContainerStatus"))
    }

    async fn update_container_resources(
        &self,
        _req: Request<cri::UpdateContainerResourcesRequest>,
    ) -> Result<Response<cri::UpdateContainerResourcesResponse>, Status> {
        Err(not_built("UpdateContainerResources"))
    }

    async fn reopen_container_log(
        &self,
        _req: Request<cri::ReopenContainerLogRequest>,
    ) -> Result<Response<cri::ReopenContainerLogResponse>, Status> {
        Err(not_built("ReopenContainerLog"))
    }

    async fn exec_sync(
        &self,
        _req: Request<cri::ExecSyncRequest>,
    ) -> Result<Response<cri::ExecSyncResponse>, Status> {
        Err(not_built("ExecSync"))
    }

    async fn exec(
        &self,
        _req: Request<cri::ExecRequest>,
    ) -> Result<Response<cri::ExecResponse>, Status> {
        Err(not_built("Exec"))
    }

    async fn attach(
        &self,
        _req: Request<cri::AttachRequest>,
    ) -> Result<Response<cri::AttachResponse>, Status> {
        Err(not_built("Attach"))
    }

    async fn port_forward(
        &self,
        _req: Request<cri::PortForwardRequest>,
    ) -> Result<Response<cri::PortForwardResponse>, Status> {
        Err(not_built("PortForward"))
    }

    async fn container_stats(
        &self,
        _req: Request<cri::ContainerStatsRequest>,
    ) -> Result<Response<cri::ContainerStatsResponse>, Status> {
        Err(not_built("ContainerStats"))
    }

    async fn list_container_stats(
        &self,
        _req: Request<cri::ListContainerStatsRequest>,
    ) -> Result<Response<cri::ListContainerStatsResponse>, Status> {
        Err(not_built("ListContainerStats"))
    }

    async fn pod_sandbox_stats(
        &self,
        _req: Request<cri::PodSandboxStatsRequest>,
    ) -> Result<Response<cri::PodSandboxStatsResponse>, Status> {
        Err(not_built("PodSandboxStats"))
    }

    async fn list_pod_sandbox_stats(
        &self,
        _req: Request<cri::ListPodSandboxStatsRequest>,
    ) -> Result<Response<cri::ListPodSandboxStatsResponse>, Status> {
        Err(not_built("ListPodSandboxStats"))
    }

    async fn update_runtime_config(
        &self,
        _req: Request<cri::UpdateRuntimeConfigRequest>,
    ) -> Result<Response<cri::UpdateRuntimeConfigResponse>, Status> {
        Err(not_built("UpdateRuntimeConfig"))
    }

    async fn checkpoint_container(
        &self,
        _req: Request<cri::CheckpointContainerRequest>,
    ) -> Result<Response<cri::CheckpointContainerResponse>, Status> {
        Err(not_built("CheckpointContainer"))
    }

    async fn list_metric_descriptors(
        &self,
        _req: Request<cri::ListMetricDescriptorsRequest>,
    ) -> Result<Response<cri::ListMetricDescriptorsResponse>, Status> {
        Err(not_built("ListMetricDescriptors"))
    }

    async fn list_pod_sandbox_metrics(
        &self,
        _req: Request<cri::ListPodSandboxMetricsRequest>,
    ) -> Result<Response<cri::ListPodSandboxMetricsResponse>, Status> {
        Err(not_built("ListPodSandboxMetrics"))
    }

    async fn runtime_config(
        &self,
        _req: Request<cri::RuntimeConfigRequest>,
    ) -> Result<Response<cri::RuntimeConfigResponse>, Status> {
        Err(not_built("RuntimeConfig"))
    }

    type GetContainerEventsStream = EventStream;

    async fn get_container_events(
        &self,
        _req: Request<cri::GetEventsRequest>,
    ) -> Result<Response<Self::GetContainerEventsStream>, Status> {
        Err(not_built("GetContainerEvents"))
    }
}
