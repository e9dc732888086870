//! CRI RuntimeService over [`crate::runtime::Runtime`].

use crate::grpc::{done, list_streams, rpcs};
use crate::runtime::Runtime;
use crate::streaming::ExecTarget;
use std::collections::HashMap;
use std::sync::Arc;
use tonic::{Request, Response, Status};
use vessel_cri_api::v1 as cri;

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
        let c = self.rt.streaming_container(container_id)?;
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

impl RuntimeService {
    fn status_reply(&self, verbose: bool) -> cri::StatusResponse {
        let mut info = HashMap::new();
        if verbose {
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
        cri::StatusResponse {
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
                // A pod with its own user namespace cannot use the host network (refused at
                // RunPodSandbox, see userns::of_pod).
                user_namespaces_host_network: false,
            }),
        }
    }

    fn exec_url(&self, r: cri::ExecRequest) -> Result<cri::ExecResponse, Status> {
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
        Ok(cri::ExecResponse { url })
    }

    fn attach_url(&self, r: cri::AttachRequest) -> Result<cri::AttachResponse, Status> {
        let any = r.stdin || r.stdout || r.stderr;
        let (srv, c) = self.stream_target("Attach", &r.container_id, any)?;
        // The streams are those the request asks for, as kubelet's and containerd's streaming
        // servers expect them: `crictl attach` without `-t` to a container with a terminal
        // opens no resize stream. The output is the container's (all on stdout with a
        // terminal; a request's terminal takes stderr to stdout).
        let url = srv.url(ExecTarget {
            container_id: c.id,
            cmd: None,
            tty: r.tty,
            stdin: r.stdin,
            stdout: r.stdout,
            stderr: r.stderr && !r.tty,
        });
        Ok(cri::AttachResponse { url })
    }

    fn port_forward_url(
        &self,
        r: cri::PortForwardRequest,
    ) -> Result<cri::PortForwardResponse, Status> {
        let srv = self.streaming("PortForward")?;
        let (pod, target) = self.rt.forward_target(&r.pod_sandbox_id)?;
        if let Some(p) = r.port.iter().find(|p| **p <= 0 || **p > 65535) {
            return Err(Status::invalid_argument(format!(
                "PortForward: invalid port {p}"
            )));
        }
        let url = srv.url(crate::streaming::StreamRequest::PortForward {
            pod_id: pod.id,
            target,
            // Checked above: 1..=65535.
            ports: r
                .port
                .iter()
                .filter_map(|p| u16::try_from(*p).ok())
                .collect(),
        });
        Ok(cri::PortForwardResponse { url })
    }
}

fn version() -> cri::VersionResponse {
    cri::VersionResponse {
        version: KUBE_API_VERSION.into(),
        runtime_name: RUNTIME_NAME.into(),
        runtime_version: env!("CARGO_PKG_VERSION").into(),
        runtime_api_version: RUNTIME_API_VERSION.into(),
    }
}

/// The pod CIDR kubelet sends, or "" for none.
fn pod_cidr(r: cri::UpdateRuntimeConfigRequest) -> String {
    r.runtime_config
        .and_then(|c| c.network_config)
        .map(|n| n.pod_cidr)
        .unwrap_or_default()
}

#[tonic::async_trait]
impl cri::runtime_service_server::RuntimeService for RuntimeService {
    // One line per RPC: the runtime call, and the reply made of its result.
    #[rustfmt::skip]
    rpcs! { |s, r|
        version(VersionRequest) -> VersionResponse = Ok(version());
        status(StatusRequest) -> StatusResponse = Ok(s.status_reply(r.verbose));
        run_pod_sandbox(RunPodSandboxRequest) -> RunPodSandboxResponse =
            Ok(cri::RunPodSandboxResponse { pod_sandbox_id: s.rt.run_pod_sandbox(r.config, &r.runtime_handler).await? });
        stop_pod_sandbox(StopPodSandboxRequest) -> StopPodSandboxResponse = done(s.rt.stop_pod_sandbox(&r.pod_sandbox_id).await);
        remove_pod_sandbox(RemovePodSandboxRequest) -> RemovePodSandboxResponse = done(s.rt.remove_pod_sandbox(&r.pod_sandbox_id).await);
        pod_sandbox_status(PodSandboxStatusRequest) -> PodSandboxStatusResponse = Ok(s.rt.pod_sandbox_status(&r.pod_sandbox_id, r.verbose)?);
        list_pod_sandbox(ListPodSandboxRequest) -> ListPodSandboxResponse = Ok(cri::ListPodSandboxResponse { items: s.rt.list_pod_sandbox(r.filter) });
        create_container(CreateContainerRequest) -> CreateContainerResponse =
            Ok(cri::CreateContainerResponse { container_id: s.rt.create_container(&r.pod_sandbox_id, r.config).await? });
        start_container(StartContainerRequest) -> StartContainerResponse = done(s.rt.start_container(&r.container_id).await);
        stop_container(StopContainerRequest) -> StopContainerResponse = done(s.rt.stop_container(&r.container_id, r.timeout).await);
        remove_container(RemoveContainerRequest) -> RemoveContainerResponse = done(s.rt.remove_container(&r.container_id).await);
        list_containers(ListContainersRequest) -> ListContainersResponse = Ok(cri::ListContainersResponse { containers: s.rt.list_containers(r.filter) });
        container_status(ContainerStatusRequest) -> ContainerStatusResponse = Ok(s.rt.container_status(&r.container_id, r.verbose)?);
        update_container_resources(UpdateContainerResourcesRequest) -> UpdateContainerResourcesResponse =
            done(s.rt.update_container_resources(&r.container_id, r.linux).await);
        reopen_container_log(ReopenContainerLogRequest) -> ReopenContainerLogResponse = done(s.rt.reopen_log(&r.container_id).await);
        exec_sync(ExecSyncRequest) -> ExecSyncResponse = Ok(s.rt.exec_sync(&r.container_id, r.cmd, r.timeout).await?);
        exec(ExecRequest) -> ExecResponse = s.exec_url(r);
        attach(AttachRequest) -> AttachResponse = s.attach_url(r);
        port_forward(PortForwardRequest) -> PortForwardResponse = s.port_forward_url(r);
        container_stats(ContainerStatsRequest) -> ContainerStatsResponse =
            Ok(cri::ContainerStatsResponse { stats: Some(s.rt.container_stats(&r.container_id).await?) });
        list_container_stats(ListContainerStatsRequest) -> ListContainerStatsResponse =
            Ok(cri::ListContainerStatsResponse { stats: s.rt.list_container_stats(r.filter).await? });
        pod_sandbox_stats(PodSandboxStatsRequest) -> PodSandboxStatsResponse =
            Ok(cri::PodSandboxStatsResponse { stats: Some(s.rt.pod_sandbox_stats(&r.pod_sandbox_id).await?) });
        list_pod_sandbox_stats(ListPodSandboxStatsRequest) -> ListPodSandboxStatsResponse =
            Ok(cri::ListPodSandboxStatsResponse { stats: s.rt.list_pod_sandbox_stats(r.filter).await? });
        update_runtime_config(UpdateRuntimeConfigRequest) -> UpdateRuntimeConfigResponse = {
            s.rt.set_pod_cidr(&pod_cidr(r));
            Ok(cri::UpdateRuntimeConfigResponse {})
        };
        checkpoint_container(CheckpointContainerRequest) -> CheckpointContainerResponse = done(s.rt.checkpoint_container(&r.container_id, &r.location, r.timeout).await);
        list_metric_descriptors(ListMetricDescriptorsRequest) -> ListMetricDescriptorsResponse =
            Ok(cri::ListMetricDescriptorsResponse { descriptors: crate::runtime::cri_metrics::descriptors() });
        list_pod_sandbox_metrics(ListPodSandboxMetricsRequest) -> ListPodSandboxMetricsResponse =
            Ok(cri::ListPodSandboxMetricsResponse { pod_metrics: s.rt.list_pod_sandbox_metrics().await? });
        runtime_config(RuntimeConfigRequest) -> RuntimeConfigResponse = Ok(cri::RuntimeConfigResponse {
            linux: Some(cri::LinuxRuntimeConfiguration { cgroup_driver: s.rt.cgroup_driver().cri() as i32 }),
        });
        update_pod_sandbox_resources(UpdatePodSandboxResourcesRequest) -> UpdatePodSandboxResourcesResponse =
            done(s.rt.update_pod_sandbox_resources(&r.pod_sandbox_id, r.overhead, r.resources).await);
    }

    // The list calls as streams, each sending what its unary call answers.
    #[rustfmt::skip]
    list_streams! { |s, r|
        stream_pod_sandboxes(StreamPodSandboxesRequest) -> StreamPodSandboxesStream of StreamPodSandboxesResponse { pod_sandboxes } =
            s.rt.list_pod_sandbox(r.filter);
        stream_containers(StreamContainersRequest) -> StreamContainersStream of StreamContainersResponse { containers } =
            s.rt.list_containers(r.filter);
        stream_container_stats(StreamContainerStatsRequest) -> StreamContainerStatsStream of StreamContainerStatsResponse { container_stats } =
            s.rt.list_container_stats(r.filter).await?;
        stream_pod_sandbox_stats(StreamPodSandboxStatsRequest) -> StreamPodSandboxStatsStream of StreamPodSandboxStatsResponse { pod_sandbox_stats } =
            s.rt.list_pod_sandbox_stats(r.filter).await?;
        stream_pod_sandbox_metrics(StreamPodSandboxMetricsRequest) -> StreamPodSandboxMetricsStream of StreamPodSandboxMetricsResponse { pod_sandbox_metrics } =
            s.rt.list_pod_sandbox_metrics().await?;
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
}
