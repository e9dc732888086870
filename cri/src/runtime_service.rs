//! CRI RuntimeService over [`crate::runtime::Runtime`].

use crate::errors::not_built;
use crate::runtime::Runtime;
use crate::streaming::ExecTarget;
use k8s_cri::v1 as cri;
use std::collections::HashMap;
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// The CRI API version kubelet negotiates.
pub const KUBE_API_VERSION: &str = "0.1.0";
pub const RUNTIME_NAME: &str = "vessel";
pub const RUNTIME_API_VERSION: &str = "v1";

pub struct RuntimeService {
    rt: Arc<Runtime>,
    root_dir: String,
    streaming: Option<Arc<crate::streaming::StreamingServer>>,
}

impl RuntimeService {
    pub fn new(rt: Arc<Runtime>, root_dir: String) -> Self {
        RuntimeService {
            rt,
            root_dir,
            streaming: None,
        }
    }

    /// Serves Exec and PortForward through `s` (without it they answer Unavailable).
    pub fn with_streaming(mut self, s: Arc<crate::streaming::StreamingServer>) -> Self {
        self.streaming = Some(s);
        self
    }

    fn streaming(&self, rpc: &str) -> Result<&crate::streaming::StreamingServer, Status> {
        self.streaming.as_deref().ok_or_else(|| {
            Status::unavailable(format!("{rpc}: the streaming server is not running"))
        })
    }

    /// What Exec and Attach check alike: a stream asked for, a streaming server, a running
    /// container.
    fn stream_target(
        &self,
        rpc: &str,
        container_id: &str,
        any_stream: bool,
    ) -> Result<
        (
            &crate::streaming::StreamingServer,
            crate::state::ContainerRecord,
        ),
        Status,
    > {
        if !any_stream {
            return Err(Status::invalid_argument(format!(
                "{rpc}: one of stdin, stdout and stderr must be set"
            )));
        }
        let srv = self.streaming(rpc)?;
        let c = self.rt.streaming_container(container_id).map_err(st)?;
        if c.state != crate::state::ContainerState::Running {
            return Err(Status::failed_precondition(format!(
                "{rpc}: container {} is not running ({:?})",
                c.id, c.state
            )));
        }
        Ok((srv, c))
    }

    /// Runtime conditions, from what can be checked now.
    fn conditions(&self) -> Vec<cri::RuntimeCondition> {
        use std::os::unix::fs::PermissionsExt;
        let agent = self.rt.agent_binary();
        let runtime_ready = match std::fs::metadata(agent) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => cri::RuntimeCondition {
                r#type: "RuntimeReady".into(),
                status: true,
                reason: String::new(),
                message: String::new(),
            },
            Ok(_) => cri::RuntimeCondition {
                r#type: "RuntimeReady".into(),
                status: false,
                reason: "AgentNotExecutable".into(),
                message: format!("pod agent {} is not an executable file", agent.display()),
            },
            Err(e) => cri::RuntimeCondition {
                r#type: "RuntimeReady".into(),
                status: false,
                reason: "AgentMissing".into(),
                message: format!("pod agent {}: {e}", agent.display()),
            },
        };
        let vm = self.rt.vm_support();
        let vm_ready = cri::RuntimeCondition {
            r#type: "VMBackendReady".into(),
            status: vm.ready,
            reason: vm.reason_code.clone(),
            message: if vm.ready {
                vm.reason.clone()
            } else {
                format!(
                    "{}; pods with runtime handler vm {}",
                    vm.reason,
                    if vm.fallback {
                        "run flat"
                    } else {
                        "are refused"
                    }
                )
            },
        };
        let quarantined = self.rt.quarantined_records();
        let records = cri::RuntimeCondition {
            r#type: "StateRecordsReadable".into(),
            status: quarantined.is_empty(),
            reason: if quarantined.is_empty() {
                String::new()
            } else {
                "RecordsQuarantined".into()
            },
            message: if quarantined.is_empty() {
                String::new()
            } else {
                format!(
                    "{} record(s) could not be read and were moved aside; their pods and containers are not managed, and their data is kept: {}",
                    quarantined.len(),
                    quarantined
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            },
        };
        vec![
            runtime_ready,
            vm_ready,
            records,
            match self.rt.cni().ready() {
                Ok(net) => cri::RuntimeCondition {
                    r#type: "NetworkReady".into(),
                    status: true,
                    reason: String::new(),
                    message: format!("CNI network {:?} from {}", net.name, net.source.display()),
                },
                Err(e) => cri::RuntimeCondition {
                    r#type: "NetworkReady".into(),
                    status: false,
                    reason: "NetworkPluginNotReady".into(),
                    message: format!(
                        "{e}; pods get a private network namespace with loopback only"
                    ),
                },
            },
        ]
    }
}

fn st(e: crate::runtime::RuntimeError) -> Status {
    e.to_status()
}

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
                    "agentBinary": self.rt.agent_binary(),
                    "sandboxBackends": crate::sandbox::available(self.rt.vm_support()),
                    "kvm": {"usable": self.rt.vm_support().kvm_usable, "reason": self.rt.vm_support().reason},
                    "podCIDR": self.rt.pod_cidr(),
                    // Where pods' state lives (critest looks for idmapped-mount support
                    // on the filesystem holding this directory's parent).
                    "stateDir": std::path::Path::new(&self.root_dir).join("pods"),
                })
                .to_string(),
            );
        }
        Ok(Response::new(cri::StatusResponse {
            status: Some(cri::RuntimeStatus {
                conditions: self.conditions(),
            }),
            info,
            // What kubelet and critest read to decide what they may ask for.
            runtime_handlers: crate::runtime::HANDLERS
                .iter()
                .map(|name| cri::RuntimeHandler {
                    name: name.to_string(),
                    features: Some(cri::RuntimeHandlerFeatures {
                        recursive_read_only_mounts: true,
                        user_namespaces: self.rt.handler_has_userns(name),
                    }),
                })
                .collect(),
            features: Some(cri::RuntimeFeatures {
                supplemental_groups_policy: true,
            }),
        }))
    }

    async fn run_pod_sandbox(
        &self,
        req: Request<cri::RunPodSandboxRequest>,
    ) -> Result<Response<cri::RunPodSandboxResponse>, Status> {
        let r = req.into_inner();
        let id = self
            .rt
            .run_pod_sandbox(r.config, &r.runtime_handler)
            .await
            .map_err(st)?;
        Ok(Response::new(cri::RunPodSandboxResponse {
            pod_sandbox_id: id,
        }))
    }

    async fn stop_pod_sandbox(
        &self,
        req: Request<cri::StopPodSandboxRequest>,
    ) -> Result<Response<cri::StopPodSandboxResponse>, Status> {
        self.rt
            .stop_pod_sandbox(&req.into_inner().pod_sandbox_id)
            .await
            .map_err(st)?;
        Ok(Response::new(cri::StopPodSandboxResponse {}))
    }

    async fn remove_pod_sandbox(
        &self,
        req: Request<cri::RemovePodSandboxRequest>,
    ) -> Result<Response<cri::RemovePodSandboxResponse>, Status> {
        self.rt
            .remove_pod_sandbox(&req.into_inner().pod_sandbox_id)
            .await
            .map_err(st)?;
        Ok(Response::new(cri::RemovePodSandboxResponse {}))
    }

    async fn pod_sandbox_status(
        &self,
        req: Request<cri::PodSandboxStatusRequest>,
    ) -> Result<Response<cri::PodSandboxStatusResponse>, Status> {
        let r = req.into_inner();
        Ok(Response::new(
            self.rt
                .pod_sandbox_status(&r.pod_sandbox_id, r.verbose)
                .map_err(st)?,
        ))
    }

    async fn list_pod_sandbox(
        &self,
        req: Request<cri::ListPodSandboxRequest>,
    ) -> Result<Response<cri::ListPodSandboxResponse>, Status> {
        Ok(Response::new(cri::ListPodSandboxResponse {
            items: self.rt.list_pod_sandbox(req.into_inner().filter),
        }))
    }

    async fn create_container(
        &self,
        req: Request<cri::CreateContainerRequest>,
    ) -> Result<Response<cri::CreateContainerResponse>, Status> {
        let r = req.into_inner();
        let id = self
            .rt
            .create_container(&r.pod_sandbox_id, r.config)
            .await
            .map_err(st)?;
        Ok(Response::new(cri::CreateContainerResponse {
            container_id: id,
        }))
    }

    async fn start_container(
        &self,
        req: Request<cri::StartContainerRequest>,
    ) -> Result<Response<cri::StartContainerResponse>, Status> {
        self.rt
            .start_container(&req.into_inner().container_id)
            .await
            .map_err(st)?;
        Ok(Response::new(cri::StartContainerResponse {}))
    }

    async fn stop_container(
        &self,
        req: Request<cri::StopContainerRequest>,
    ) -> Result<Response<cri::StopContainerResponse>, Status> {
        let r = req.into_inner();
        self.rt
            .stop_container(&r.container_id, r.timeout)
            .await
            .map_err(st)?;
        Ok(Response::new(cri::StopContainerResponse {}))
    }

    async fn remove_container(
        &self,
        req: Request<cri::RemoveContainerRequest>,
    ) -> Result<Response<cri::RemoveContainerResponse>, Status> {
        self.rt
            .remove_container(&req.into_inner().container_id)
            .await
            .map_err(st)?;
        Ok(Response::new(cri::RemoveContainerResponse {}))
    }

    async fn list_containers(
        &self,
        req: Request<cri::ListContainersRequest>,
    ) -> Result<Response<cri::ListContainersResponse>, Status> {
        Ok(Response::new(cri::ListContainersResponse {
            containers: self.rt.list_containers(req.into_inner().filter),
        }))
    }

    async fn container_status(
        &self,
        req: Request<cri::ContainerStatusRequest>,
    ) -> Result<Response<cri::ContainerStatusResponse>, Status> {
        let r = req.into_inner();
        Ok(Response::new(
            self.rt
                .container_status(&r.container_id, r.verbose)
                .map_err(st)?,
        ))
    }

    async fn update_container_resources(
        &self,
        req: Request<cri::UpdateContainerResourcesRequest>,
    ) -> Result<Response<cri::UpdateContainerResourcesResponse>, Status> {
        let r = req.into_inner();
        self.rt
            .update_container_resources(&r.container_id, r.linux)
            .await
            .map_err(st)?;
        Ok(Response::new(cri::UpdateContainerResourcesResponse {}))
    }

    async fn reopen_container_log(
        &self,
        req: Request<cri::ReopenContainerLogRequest>,
    ) -> Result<Response<cri::ReopenContainerLogResponse>, Status> {
        self.rt
            .reopen_log(&req.into_inner().container_id)
            .await
            .map_err(st)?;
        Ok(Response::new(cri::ReopenContainerLogResponse {}))
    }

    async fn exec_sync(
        &self,
        req: Request<cri::ExecSyncRequest>,
    ) -> Result<Response<cri::ExecSyncResponse>, Status> {
        let r = req.into_inner();
        Ok(Response::new(
            self.rt
                .exec_sync(&r.container_id, r.cmd, r.timeout)
                .await
                .map_err(st)?,
        ))
    }

    async fn exec(
        &self,
        req: Request<cri::ExecRequest>,
    ) -> Result<Response<cri::ExecResponse>, Status> {
        let r = req.into_inner();
        if r.cmd.is_empty() || r.cmd[0].is_empty() {
            return Err(Status::invalid_argument("Exec: empty command"));
        }
        let any = r.stdin || r.stdout || r.stderr;
        let (srv, c) = self.stream_target("Exec", &r.container_id, any)?;
        let url = srv.url(ExecTarget {
            container_id: c.id,
            cmd: Some(r.cmd),
            tty: r.tty,
            stdin: r.stdin,
            stdout: r.stdout,
            // With a tty, stderr is the terminal: kubelet and crictl never ask for both.
            stderr: r.stderr && !r.tty,
        });
        Ok(Response::new(cri::ExecResponse { url }))
    }

    async fn attach(
        &self,
        req: Request<cri::AttachRequest>,
    ) -> Result<Response<cri::AttachResponse>, Status> {
        let r = req.into_inner();
        let any = r.stdin || r.stdout || r.stderr;
        let (srv, c) = self.stream_target("Attach", &r.container_id, any)?;
        if r.stdin && !c.config.stdin {
            return Err(Status::invalid_argument(format!(
                "Attach: container {} was not created with stdin",
                c.id
            )));
        }
        // The terminal is the container's, whatever the request says (as containerd does).
        let tty = c.config.tty;
        let url = srv.url(ExecTarget {
            container_id: c.id,
            cmd: None,
            tty,
            stdin: r.stdin,
            stdout: r.stdout,
            stderr: r.stderr && !tty,
        });
        Ok(Response::new(cri::AttachResponse { url }))
    }

    async fn port_forward(
        &self,
        req: Request<cri::PortForwardRequest>,
    ) -> Result<Response<cri::PortForwardResponse>, Status> {
        let r = req.into_inner();
        let srv = self.streaming("PortForward")?;
        let (pod, target) = self.rt.forward_target(&r.pod_sandbox_id).map_err(st)?;
        if let Some(p) = r.port.iter().find(|p| **p <= 0 || **p > 65535) {
            return Err(Status::invalid_argument(format!(
                "PortForward: invalid port {p}"
            )));
        }
        let url = srv.url(crate::streaming::StreamRequest::PortForward {
            pod_id: pod.id,
            target,
        });
        Ok(Response::new(cri::PortForwardResponse { url }))
    }

    async fn container_stats(
        &self,
        req: Request<cri::ContainerStatsRequest>,
    ) -> Result<Response<cri::ContainerStatsResponse>, Status> {
        let s = self
            .rt
            .container_stats(&req.into_inner().container_id)
            .await
            .map_err(st)?;
        Ok(Response::new(cri::ContainerStatsResponse {
            stats: Some(s),
        }))
    }

    async fn list_container_stats(
        &self,
        req: Request<cri::ListContainerStatsRequest>,
    ) -> Result<Response<cri::ListContainerStatsResponse>, Status> {
        let s = self
            .rt
            .list_container_stats(req.into_inner().filter)
            .await
            .map_err(st)?;
        Ok(Response::new(cri::ListContainerStatsResponse { stats: s }))
    }

    async fn pod_sandbox_stats(
        &self,
        req: Request<cri::PodSandboxStatsRequest>,
    ) -> Result<Response<cri::PodSandboxStatsResponse>, Status> {
        let s = self
            .rt
            .pod_sandbox_stats(&req.into_inner().pod_sandbox_id)
            .await
            .map_err(st)?;
        Ok(Response::new(cri::PodSandboxStatsResponse {
            stats: Some(s),
        }))
    }

    async fn list_pod_sandbox_stats(
        &self,
        req: Request<cri::ListPodSandboxStatsRequest>,
    ) -> Result<Response<cri::ListPodSandboxStatsResponse>, Status> {
        let s = self
            .rt
            .list_pod_sandbox_stats(req.into_inner().filter)
            .await
            .map_err(st)?;
        Ok(Response::new(cri::ListPodSandboxStatsResponse { stats: s }))
    }

    async fn update_runtime_config(
        &self,
        req: Request<cri::UpdateRuntimeConfigRequest>,
    ) -> Result<Response<cri::UpdateRuntimeConfigResponse>, Status> {
        let cidr = req
            .into_inner()
            .runtime_config
            .and_then(|c| c.network_config)
            .map(|n| n.pod_cidr)
            .unwrap_or_default();
        self.rt.set_pod_cidr(&cidr);
        Ok(Response::new(cri::UpdateRuntimeConfigResponse {}))
    }

    async fn checkpoint_container(
        &self,
        _req: Request<cri::CheckpointContainerRequest>,
    ) -> Result<Response<cri::CheckpointContainerResponse>, Status> {
        Err(not_built("CheckpointContainer"))
    }

    type GetContainerEventsStream = std::pin::Pin<
        Box<
            dyn futures::Stream<Item = Result<cri::ContainerEventResponse, Status>>
                + Send
                + 'static,
        >,
    >;

    /// Container lifecycle events from now on, until the client goes away. A client too slow
    /// to keep up gets Unavailable and relists (as kubelet's evented PLEG does after any
    /// stream error).
    async fn get_container_events(
        &self,
        _req: Request<cri::GetEventsRequest>,
    ) -> Result<Response<Self::GetContainerEventsStream>, Status> {
        use futures::StreamExt;
        use tokio_stream::wrappers::{errors::BroadcastStreamRecvError, BroadcastStream};
        let end = self.rt.event_streams_end();
        let events = BroadcastStream::new(self.rt.subscribe_events())
            .take_until(end)
            .map(|e| match e {
                Ok(ev) => Ok(ev),
                Err(BroadcastStreamRecvError::Lagged(n)) => Err(Status::unavailable(format!(
                    "GetContainerEvents: the client fell {n} events behind; relist and subscribe again"
                ))),
            })
            // The stream ends after the first error.
            .scan(false, |failed, e| {
                let next = (!*failed).then(|| {
                    *failed = e.is_err();
                    e
                });
                std::future::ready(next)
            });
        Ok(Response::new(Box::pin(events)))
    }

    async fn list_metric_descriptors(
        &self,
        _req: Request<cri::ListMetricDescriptorsRequest>,
    ) -> Result<Response<cri::ListMetricDescriptorsResponse>, Status> {
        Ok(Response::new(cri::ListMetricDescriptorsResponse {
            descriptors: crate::runtime::cri_metrics::descriptors(),
        }))
    }

    async fn list_pod_sandbox_metrics(
        &self,
        _req: Request<cri::ListPodSandboxMetricsRequest>,
    ) -> Result<Response<cri::ListPodSandboxMetricsResponse>, Status> {
        Ok(Response::new(cri::ListPodSandboxMetricsResponse {
            pod_metrics: self.rt.list_pod_sandbox_metrics().await.map_err(st)?,
        }))
    }

    async fn runtime_config(
        &self,
        _req: Request<cri::RuntimeConfigRequest>,
    ) -> Result<Response<cri::RuntimeConfigResponse>, Status> {
        Ok(Response::new(cri::RuntimeConfigResponse {
            linux: Some(cri::LinuxRuntimeConfiguration {
                cgroup_driver: self.rt.cgroup_driver().cri() as i32,
            }),
        }))
    }
}
