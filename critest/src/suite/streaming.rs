//! Streaming: Exec, Attach and PortForward hand back a URL of the streaming server. These
//! specs check the URL only; the SPDY/WebSocket streams themselves are not exercised yet.

use super::{spec, Ctx, Spec, SpecResult};
use crate::check;
use k8s_cri::v1 as cri;

pub(super) fn specs() -> Vec<Spec> {
    vec![
        spec!("streaming", "Exec returns a streaming URL", exec),
        spec!("streaming", "Attach returns a streaming URL", attach),
        spec!(
            "streaming",
            "PortForward returns a streaming URL",
            port_forward
        ),
    ]
}

fn check_url(rpc: &str, url: &str) -> SpecResult {
    check!(
        url.starts_with("http://") || url.starts_with("https://"),
        "{rpc} URL {url:?} is not http(s)"
    );
    Ok(())
}

async fn exec(c: Ctx) -> SpecResult {
    let id = c.sleeper_with("sexec", |_| {}).await?;
    let mut cl = c.c.clone();
    let r = cl
        .runtime
        .exec(cri::ExecRequest {
            container_id: id,
            cmd: vec!["echo".into(), "hi".into()],
            stdout: true,
            ..Default::default()
        })
        .await?
        .into_inner();
    check_url("Exec", &r.url)
}

async fn attach(c: Ctx) -> SpecResult {
    let id = c.sleeper_with("sattach", |_| {}).await?;
    let mut cl = c.c.clone();
    let r = cl
        .runtime
        .attach(cri::AttachRequest {
            container_id: id,
            stdout: true,
            ..Default::default()
        })
        .await?
        .into_inner();
    check_url("Attach", &r.url)
}

async fn port_forward(c: Ctx) -> SpecResult {
    let (pod, _) = c.run_pod("spf").await?;
    let mut cl = c.c.clone();
    let r = cl
        .runtime
        .port_forward(cri::PortForwardRequest {
            pod_sandbox_id: pod,
            port: vec![8080],
        })
        .await?
        .into_inner();
    check_url("PortForward", &r.url)
}
