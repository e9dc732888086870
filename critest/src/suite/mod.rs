//! The `vessel-critest` conformance suite: specs that drive any CRI runtime (vessel,
//! containerd, ...) over its CRI socket, grouped like the upstream CRI validation suite.
//!
//! [`run`] is the library entry point; the `vessel-critest` binary is a thin CLI around it.
//! Each spec gets a fresh [`Ctx`]; whatever it creates carries the labels
//! `vessel-critest=<run id>` and `vessel-critest-spec=<spec id>`, and the runner removes it
//! after the spec (pass, fail, timeout or panic) and again in a final sweep.

mod container;
mod ctx;
mod image;
mod network;
mod pod;
mod security;
mod streaming;
pub mod testimages;
mod volume;

pub use ctx::Ctx;

use crate::client::CriClient;
use std::collections::HashMap;
use std::future::Future;
use std::io::Write as _;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vessel_cri_api::v1 as cri;

/// The label every object the suite creates carries, valued with the run id.
pub const RUN_LABEL: &str = "vessel-critest";
/// The label that ties an object to one spec.
pub const SPEC_LABEL: &str = "vessel-critest-spec";

/// Why the suite could not run at all (individual spec failures are in the [`Summary`]).
#[derive(Debug, thiserror::Error)]
pub enum SuiteError {
    #[error("connecting to the CRI endpoint {endpoint}: {source}")]
    Connect {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("endpoint {0:?}: only unix:///path endpoints (or a plain path) are supported")]
    Endpoint(String),
    #[error("starting a local docker-registry for the test images: {0}")]
    Registry(#[source] std::io::Error),
    #[error("pushing the test images to {registry}: {source}")]
    Push {
        registry: String,
        #[source]
        source: vessel_images::push::PushError,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("bad --focus pattern: {0}")]
    Focus(#[from] regex::Error),
}

/// What a spec found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "outcome", content = "reason", rename_all = "lowercase")]
pub enum Outcome {
    Pass,
    Fail(String),
    Skip(String),
}

/// A spec's early exit: failed or skipped, with the reason.
#[derive(Debug)]
pub enum Stop {
    Fail(String),
    Skip(String),
}

impl From<tonic::Status> for Stop {
    fn from(s: tonic::Status) -> Stop {
        Stop::Fail(format!("{:?}: {}", s.code(), s.message()))
    }
}

/// What a spec returns.
pub type SpecResult = Result<(), Stop>;

/// Fails the spec with a formatted reason.
#[macro_export]
macro_rules! fail {
    ($($t:tt)*) => { return Err($crate::suite::Stop::Fail(format!($($t)*))) };
}

/// Fails the spec unless the condition holds.
#[macro_export]
macro_rules! check {
    ($cond:expr, $($t:tt)*) => { if !$cond { $crate::fail!($($t)*); } };
}

/// Skips the spec with a formatted reason.
#[macro_export]
macro_rules! skip {
    ($($t:tt)*) => { return Err($crate::suite::Stop::Skip(format!($($t)*))) };
}

type SpecFn = fn(Ctx) -> Pin<Box<dyn Future<Output = SpecResult> + Send>>;

/// One spec of the suite.
#[derive(Clone, Copy)]
pub struct Spec {
    /// `runtime`, `pod`, `container`, ...
    pub group: &'static str,
    /// What it checks, e.g. `run, status, stop, remove`.
    pub name: &'static str,
    /// Set when a VM pod cannot meet the spec by design: the reason.
    pub vm_by_design: Option<&'static str>,
    run: SpecFn,
}

impl Spec {
    /// `[group] name`, as printed and as matched by focus and skip.
    pub fn full_name(&self) -> String {
        format!("[{}] {}", self.group, self.name)
    }
}

macro_rules! spec {
    ($group:literal, $name:literal, $f:path) => {
        $crate::suite::Spec {
            group: $group,
            name: $name,
            vm_by_design: None,
            run: |c| Box::pin($f(c)),
        }
    };
    ($group:literal, $name:literal, $f:path, vm = $why:literal) => {
        $crate::suite::Spec {
            group: $group,
            name: $name,
            vm_by_design: Some($why),
            run: |c| Box::pin($f(c)),
        }
    };
}
pub(crate) use spec;

/// Every spec, in the order they run.
pub fn all_specs() -> Vec<Spec> {
    let mut v = Vec::new();
    v.extend(pod::runtime_specs());
    v.extend(pod::specs());
    v.extend(container::specs());
    v.extend(volume::specs());
    v.extend(image::specs());
    v.extend(network::specs());
    v.extend(security::specs());
    v.extend(streaming::specs());
    v
}

/// How to run the suite.
#[derive(Debug, Clone)]
pub struct Config {
    /// The runtime service socket (`unix:///path.sock` or a path).
    pub endpoint: String,
    /// The image service socket; `None` means [`Config::endpoint`].
    pub image_endpoint: Option<String>,
    /// `HOST:PORT` of a plain-HTTP registry to push the test images to (and pull them
    /// from). `None` starts a local `docker-registry` on 127.0.0.1.
    pub registry: Option<String>,
    /// Push the test images even when `registry` is given (they are deterministic, so
    /// pushing is idempotent).
    pub push_images: bool,
    /// The pods' runtime handler (`""`: the runtime's default).
    pub runtime_handler: String,
    /// The pods are VM pods: specs a VM pod cannot meet by design are skipped and marked.
    pub vm_pods: bool,
    /// Only specs whose `[group] name` matches (a regex; a plain substring works too).
    pub focus: Option<String>,
    /// Leave out specs whose `[group] name` contains any of these.
    pub skip: Vec<String>,
    /// Specs run at once.
    pub parallel: usize,
    /// Each spec's time limit.
    pub spec_timeout: Duration,
    /// Print a line per spec and the closing line on stdout.
    pub print: bool,
    /// A static `vsock-echo` (images/guest/harness/vsock-echo.c) that a spec bind-mounts into
    /// containers to try AF_VSOCK from there; by default, the one on PATH if any.
    pub vsock_probe: Option<PathBuf>,
}

impl Config {
    pub fn new(endpoint: impl Into<String>) -> Config {
        Config {
            endpoint: endpoint.into(),
            image_endpoint: None,
            registry: None,
            push_images: true,
            runtime_handler: String::new(),
            vm_pods: false,
            focus: None,
            skip: Vec::new(),
            parallel: 1,
            spec_timeout: Duration::from_secs(60),
            print: true,
            vsock_probe: std::env::var_os("PATH").and_then(|p| {
                std::env::split_paths(&p)
                    .map(|d| d.join("vsock-echo"))
                    .find(|f| f.is_file())
            }),
        }
    }
}

/// One spec's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SpecReport {
    pub group: String,
    pub name: String,
    #[serde(flatten)]
    pub outcome: Outcome,
    pub millis: u128,
}

impl SpecReport {
    /// The line printed for it.
    pub fn line(&self) -> String {
        match &self.outcome {
            Outcome::Pass => format!("PASS [{}] {} ({} ms)", self.group, self.name, self.millis),
            Outcome::Fail(r) => format!("FAIL [{}] {}: {r}", self.group, self.name),
            Outcome::Skip(r) => format!("SKIP [{}] {}: {r}", self.group, self.name),
        }
    }
}

/// The suite's results.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Summary {
    pub passed: usize,
    pub failed: usize,
    pub skipped: usize,
    pub specs: Vec<SpecReport>,
}

impl Summary {
    /// `N passed, N failed, N skipped`.
    pub fn closing_line(&self) -> String {
        format!(
            "{} passed, {} failed, {} skipped",
            self.passed, self.failed, self.skipped
        )
    }

    /// The reports of the specs that failed.
    pub fn failures(&self) -> Vec<&SpecReport> {
        self.specs
            .iter()
            .filter(|s| matches!(s.outcome, Outcome::Fail(_)))
            .collect()
    }
}

/// Parses `unix:///path.sock` (or a bare path) into the socket path.
pub fn socket_path(endpoint: &str) -> Result<PathBuf, SuiteError> {
    if let Some(p) = endpoint.strip_prefix("unix://") {
        if p.starts_with('/') {
            return Ok(PathBuf::from(p));
        }
    } else if endpoint.starts_with('/') {
        return Ok(PathBuf::from(endpoint));
    }
    Err(SuiteError::Endpoint(endpoint.to_string()))
}

/// The specs `config` selects, in order.
pub fn select(config: &Config) -> Result<Vec<Spec>, SuiteError> {
    let focus = match &config.focus {
        Some(f) => Some(regex::Regex::new(f).or_else(|_| regex::Regex::new(&regex::escape(f)))?),
        None => None,
    };
    Ok(all_specs()
        .into_iter()
        .filter(|s| {
            let n = s.full_name();
            focus.as_ref().is_none_or(|f| f.is_match(&n))
                && !config.skip.iter().any(|k| n.contains(k.as_str()))
        })
        .collect())
}

/// Runs the selected specs against the runtime and returns the results.
pub async fn run(config: Config) -> Result<Summary, SuiteError> {
    let specs = select(&config)?;
    let rt_path = socket_path(&config.endpoint)?;
    let img_path = socket_path(config.image_endpoint.as_deref().unwrap_or(&config.endpoint))?;
    let connect = |p: PathBuf, e: &str| {
        let e = e.to_string();
        async move {
            crate::client::connect(&p)
                .await
                .map_err(|source| SuiteError::Connect {
                    endpoint: e,
                    source,
                })
        }
    };
    let rt_ch = connect(rt_path, &config.endpoint).await?;
    let img_ch = connect(
        img_path,
        config.image_endpoint.as_deref().unwrap_or(&config.endpoint),
    )
    .await?;
    let client = CriClient {
        runtime: vessel_cri_api::v1::runtime_service_client::RuntimeServiceClient::new(rt_ch)
            .max_decoding_message_size(16 << 20),
        images: vessel_cri_api::v1::image_service_client::ImageServiceClient::new(img_ch)
            .max_decoding_message_size(16 << 20),
    };

    // Test images: pushed to the given registry, or to a local one started here.
    let mut _local_registry = None;
    let registry = match &config.registry {
        Some(r) => r.clone(),
        None => {
            let reg = crate::registry::Registry::start(Default::default())
                .map_err(SuiteError::Registry)?;
            let host = reg.host();
            _local_registry = Some(reg);
            host
        }
    };
    let images = if config.registry.is_none() || config.push_images {
        testimages::push_all(&format!("http://{registry}"), &registry)
            .await
            .map_err(|source| SuiteError::Push {
                registry: registry.clone(),
                source,
            })?
    } else {
        testimages::names(&registry)
    };

    let run_id = format!(
        "{:x}{:04x}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        std::process::id() & 0xffff
    );
    let work = tempfile::Builder::new()
        .prefix("vessel-critest-")
        .tempdir()
        .map_err(|source| SuiteError::Io {
            what: "creating the work directory".into(),
            source,
        })?;
    let env = Arc::new(ctx::Env {
        images,
        registry,
        run_id: run_id.clone(),
        runtime_handler: config.runtime_handler.clone(),
        vm_pods: config.vm_pods,
        vsock_probe: config.vsock_probe.clone(),
        work: work.path().to_path_buf(),
    });
    // Images present before the run are left in place; the ones the suite pulled go.
    let preexisting = ctx::present_images(&client, &env.images.all()).await;

    let mut summary = Summary::default();
    let parallel = config.parallel.max(1);
    let mut queue = specs.into_iter().enumerate();
    let mut running = tokio::task::JoinSet::new();
    loop {
        while running.len() < parallel {
            let Some((n, spec)) = queue.next() else { break };
            let c = Ctx::new(client.clone(), env.clone(), format!("{run_id}-{n}"));
            let limit = config.spec_timeout;
            running.spawn(async move { (spec, run_one(spec, c, limit).await) });
        }
        let Some(done) = running.join_next().await else {
            break;
        };
        let (spec, (outcome, took)) = match done {
            Ok(x) => x,
            Err(e) => {
                // run_one catches panics itself; this is a bug in the runner.
                eprintln!("vessel-critest: spec task failed: {e}");
                continue;
            }
        };
        let report = SpecReport {
            group: spec.group.to_string(),
            name: spec.name.to_string(),
            outcome,
            millis: took.as_millis(),
        };
        match report.outcome {
            Outcome::Pass => summary.passed += 1,
            Outcome::Fail(_) => summary.failed += 1,
            Outcome::Skip(_) => summary.skipped += 1,
        }
        if config.print {
            println!("{}", report.line());
            let _ = std::io::stdout().flush();
        }
        summary.specs.push(report);
    }

    // Final sweep: every pod of this run, and the images the run pulled.
    ctx::remove_pods(
        &client,
        HashMap::from([(RUN_LABEL.to_string(), run_id.clone())]),
    )
    .await;
    for img in env.images.all() {
        if !preexisting.contains(&img) {
            ctx::remove_image(&client, &img).await;
        }
    }
    if config.print {
        println!("{}", summary.closing_line());
    }
    Ok(summary)
}

async fn run_one(spec: Spec, c: Ctx, limit: Duration) -> (Outcome, Duration) {
    let start = Instant::now();
    if c.env.vm_pods {
        if let Some(why) = spec.vm_by_design {
            return (
                Outcome::Skip(format!("not met by VM pods by design: {why}")),
                start.elapsed(),
            );
        }
    }
    let fut = (spec.run)(c.clone());
    let handle = tokio::spawn(fut);
    let abort = handle.abort_handle();
    let outcome = match tokio::time::timeout(limit, handle).await {
        Ok(Ok(Ok(()))) => Outcome::Pass,
        Ok(Ok(Err(Stop::Fail(r)))) => Outcome::Fail(r),
        Ok(Ok(Err(Stop::Skip(r)))) => Outcome::Skip(r),
        Ok(Err(e)) => Outcome::Fail(format!("panicked: {e}")),
        Err(_) => {
            abort.abort();
            Outcome::Fail(format!("timed out after {limit:?}"))
        }
    };
    let took = start.elapsed();
    c.cleanup().await;
    (outcome, took)
}

/// The CRI state names, for messages.
pub(crate) fn ctr_state(s: i32) -> &'static str {
    match cri::ContainerState::try_from(s) {
        Ok(cri::ContainerState::ContainerCreated) => "CREATED",
        Ok(cri::ContainerState::ContainerRunning) => "RUNNING",
        Ok(cri::ContainerState::ContainerExited) => "EXITED",
        _ => "UNKNOWN",
    }
}
