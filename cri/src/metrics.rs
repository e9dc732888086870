//! Prometheus metrics with the `prometheus-client` crate: `GET /metrics` on
//! `daemon.metrics_address`, in the OpenMetrics text format (which Prometheus scrapes).
//!
//! One process-wide set ([`get`]), as a client library's default registry: the CRI layer
//! (every RPC, through [`GrpcMetrics`]), image pulls, CNI, VM boots and container exits record
//! into it where they happen. Pod and container counts, images and image store totals are
//! read at each scrape from a source the daemon sets once it runs ([`Metrics::set_source`]).

use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RpcLabels {
    method: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CniLabels {
    op: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KvmLabels {
    verdict: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StreamLabels {
    kind: String,
    transport: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: String,
    backend: String,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

fn rpc_histogram() -> Histogram {
    // 100 us .. ~2.4 s
    Histogram::new(exponential_buckets(0.0001, 2.5, 12))
}

fn cni_histogram() -> Histogram {
    // 1 ms .. ~8 s
    Histogram::new(exponential_buckets(0.001, 2.0, 14))
}

/// A metric of any type, so that one table registers metrics of several types.
#[derive(Debug)]
struct AnyMetric(Box<dyn Metric>);

impl AnyMetric {
    /// A handle on `m` (a clone of a metric records into the same values).
    fn of(m: &(impl Metric + Clone)) -> AnyMetric {
        AnyMetric(Box::new(m.clone()))
    }
}

impl EncodeMetric for AnyMetric {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// (state, backend, count) rows.
pub type StateCounts = Vec<(String, String, i64)>;

/// What a scrape reads from the running daemon.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Pods and containers by state and backend.
    pub pods: StateCounts,
    pub containers: StateCounts,
    pub images: i64,
    pub blobs_committed: u64,
    pub layers_unpacked: u64,
}

type Source = Box<dyn Fn() -> Snapshot + Send + Sync>;

/// An open streaming session (see [`Metrics::stream_session`]).
pub struct StreamSession(Gauge);

impl Drop for StreamSession {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// vessel's metrics.
pub struct Metrics {
    registry: Registry,
    rpcs: Family<RpcLabels, Counter>,
    rpc_seconds: Histograms<MethodLabels>,
    pulls: Family<ResultLabels, Counter>,
    pull_seconds: Histogram,
    pulled_bytes: Counter,
    vm_boot_seconds: Histogram,
    kvm: Family<KvmLabels, Gauge>,
    cni_seconds: Histograms<CniLabels>,
    oom_kills: Counter,
    streams: Family<StreamLabels, Counter>,
    streams_open: Family<StreamLabels, Gauge>,
    stream_bytes: Family<DirectionLabels, Counter>,
    streams_idle_closed: Counter,
    source: Arc<OnceLock<Source>>,
}

static METRICS: OnceLock<Metrics> = OnceLock::new();

/// The process's metrics.
pub fn get() -> &'static Metrics {
    METRICS.get_or_init(Metrics::new)
}

impl Metrics {
    fn new() -> Metrics {
        let mut registry = Registry::default();
        let info = Family::<Vec<(String, String)>, Gauge>::default();
        info.get_or_create(&vec![("version".into(), env!("CARGO_PKG_VERSION").into())])
            .set(1);
        registry.register("vessel_build_info", "vesseld's version", info);
        let started = Gauge::<i64>::default();
        started.set(chrono::Utc::now().timestamp());
        registry.register(
            "vessel_start_time_seconds",
            "Unix time vesseld started",
            started,
        );
        let mut m = Metrics {
            rpcs: Family::default(),
            rpc_seconds: Family::new_with_constructor(rpc_histogram),
            pulls: Family::default(),
            // 10 ms .. ~80 s
            pull_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            pulled_bytes: Counter::default(),
            // 50 ms .. ~25 s
            vm_boot_seconds: Histogram::new(exponential_buckets(0.05, 2.0, 10)),
            kvm: Family::default(),
            cni_seconds: Family::new_with_constructor(cni_histogram),
            oom_kills: Counter::default(),
            streams: Family::default(),
            streams_open: Family::default(),
            stream_bytes: Family::default(),
            streams_idle_closed: Counter::default(),
            source: Arc::new(OnceLock::new()),
            registry,
        };
        #[rustfmt::skip]
        let families = [
            ("vessel_cri_requests", "CRI calls by method and gRPC status code", AnyMetric::of(&m.rpcs)),
            ("vessel_cri_request_duration_seconds", "CRI call latency by method (to the response headers: the whole call for unary ones)", AnyMetric::of(&m.rpc_seconds)),
            ("vessel_image_pulls", "PullImage calls by result", AnyMetric::of(&m.pulls)),
            ("vessel_image_pull_duration_seconds", "PullImage duration", AnyMetric::of(&m.pull_seconds)),
            ("vessel_image_pulled_bytes", "Bytes downloaded from registries", AnyMetric::of(&m.pulled_bytes)),
            ("vessel_vm_boot_duration_seconds", "From starting a VM pod's shim until its guest agent answers", AnyMetric::of(&m.vm_boot_seconds)),
            ("vessel_kvm_usable", "The KVM probe's verdict at start: 1 for the verdict found", AnyMetric::of(&m.kvm)),
            ("vessel_cni_duration_seconds", "CNI ADD and DEL of a pod (its whole plugin chain) by result", AnyMetric::of(&m.cni_seconds)),
            ("vessel_container_oom_kills", "Containers whose init the kernel's OOM killer ended", AnyMetric::of(&m.oom_kills)),
        ];
        let r = &mut m.registry;
        for (name, help, metric) in families {
            r.register(name, help, metric);
        }
        let s = r.sub_registry_with_prefix("vessel_streaming");
        s.register("sessions", "Streaming sessions (exec, attach, portforward) upgraded, by transport (spdy, websocket)", m.streams.clone());
        s.register(
            "sessions_open",
            "Streaming sessions open now",
            m.streams_open.clone(),
        );
        s.register(
            "bytes",
            "Bytes on upgraded streaming connections, in (from clients) and out",
            m.stream_bytes.clone(),
        );
        s.register(
            "idle_closed",
            "Streaming connections closed for being idle past daemon.stream_idle_timeout_secs",
            m.streams_idle_closed.clone(),
        );
        r.register_collector(Box::new(ScrapeCollector {
            source: m.source.clone(),
        }));
        m
    }

    /// Where scrapes read pod and container counts and image store totals (set once).
    pub fn set_source(&self, f: impl Fn() -> Snapshot + Send + Sync + 'static) {
        let _ = self.source.set(Box::new(f));
    }

    pub fn record_rpc(&self, method: &str, code: tonic::Code, took: Duration) {
        self.rpcs
            .get_or_create(&RpcLabels {
                method: method.to_string(),
                code: code_name(code),
            })
            .inc();
        self.rpc_seconds
            .get_or_create(&MethodLabels {
                method: method.to_string(),
            })
            .observe(took.as_secs_f64());
    }

    pub fn record_pull(&self, ok: bool, took: Duration) {
        let result = if ok { "ok" } else { "error" };
        self.pulls
            .get_or_create(&ResultLabels {
                result: result.into(),
            })
            .inc();
        self.pull_seconds.observe(took.as_secs_f64());
    }

    pub fn add_pulled_bytes(&self, n: u64) {
        self.pulled_bytes.inc_by(n);
    }

    pub fn record_vm_boot(&self, took: Duration) {
        self.vm_boot_seconds.observe(took.as_secs_f64());
    }

    /// The KVM probe's verdict (`usable`, `unusable`, `absent`).
    pub fn set_kvm_verdict(&self, verdict: &str) {
        self.kvm.clear();
        self.kvm
            .get_or_create(&KvmLabels {
                verdict: verdict.to_string(),
            })
            .set(1);
    }

    /// One CNI ADD or DEL of a pod's chain.
    pub fn record_cni(&self, op: &str, ok: bool, took: Duration) {
        self.cni_seconds
            .get_or_create(&CniLabels {
                op: op.to_ascii_lowercase(),
                result: if ok { "ok" } else { "error" }.into(),
            })
            .observe(took.as_secs_f64());
    }

    pub fn record_oom_kill(&self) {
        self.oom_kills.inc();
    }

    /// A streaming session upgraded; it counts as open until the guard is dropped.
    pub fn stream_session(&self, kind: &str, transport: &str) -> StreamSession {
        let l = StreamLabels {
            kind: kind.to_string(),
            transport: transport.to_string(),
        };
        self.streams.get_or_create(&l).inc();
        let open = self.streams_open.get_or_create(&l).clone();
        open.inc();
        StreamSession(open)
    }

    /// The counters of bytes that streaming connections read and write.
    pub fn stream_bytes(&self) -> (Counter, Counter) {
        let c = |d: &str| {
            self.stream_bytes
                .get_or_create(&DirectionLabels {
                    direction: d.to_string(),
                })
                .clone()
        };
        (c("in"), c("out"))
    }

    pub fn record_stream_idle_closed(&self) {
        self.streams_idle_closed.inc();
    }

    /// The exposition text (OpenMetrics).
    pub fn render(&self) -> String {
        let mut s = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut s, &self.registry) {
            tracing::warn!(error = %e, "encoding metrics");
        }
        s
    }
}

/// gRPC's canonical name of a status code (`OK`, `NotFound`, ...).
fn code_name(c: tonic::Code) -> String {
    match c {
        tonic::Code::Ok => "OK".into(),
        c => format!("{c:?}"),
    }
}

/// Pod and container counts and image store totals, read at each scrape.
struct ScrapeCollector {
    source: Arc<OnceLock<Source>>,
}

impl std::fmt::Debug for ScrapeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScrapeCollector")
    }
}

impl Collector for ScrapeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(source) = self.source.get() else {
            return Ok(());
        };
        let snap = source();
        for (name, help, rows) in [
            (
                "vessel_pods",
                "Pod sandboxes by state and backend",
                &snap.pods,
            ),
            (
                "vessel_containers",
                "Containers by state and their pod's backend",
                &snap.containers,
            ),
        ] {
            let g = ConstGauge::new(0i64);
            let mut family = encoder.encode_descriptor(name, help, None, g.metric_type())?;
            for (state, backend, n) in rows {
                let labels = StateLabels {
                    state: state.clone(),
                    backend: backend.clone(),
                };
                ConstGauge::new(*n).encode(family.encode_family(&labels)?)?;
            }
        }
        let images = ConstGauge::new(snap.images);
        images.encode(encoder.encode_descriptor(
            "vessel_images",
            "Images in the store",
            None,
            images.metric_type(),
        )?)?;
        for (name, help, v) in [
            (
                "vessel_image_blobs_committed",
                "Blobs verified and stored",
                snap.blobs_committed,
            ),
            (
                "vessel_image_layers_unpacked",
                "Layers unpacked",
                snap.layers_unpacked,
            ),
        ] {
            let c = ConstCounter::new(v);
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        Ok(())
    }
}

/// A tower layer over the CRI routes: counts every call by method and status code and times
/// it. The status is the `grpc-status` of the response headers (where a failed unary call
/// puts it), else OK (a successful call's status is in its trailers).
#[derive(Clone)]
pub struct GrpcMetrics<S> {
    inner: S,
}

impl<S> GrpcMetrics<S> {
    pub fn new(inner: S) -> Self {
        GrpcMetrics { inner }
    }
}

impl<S, B, R> tower::Service<tonic::codegen::http::Request<B>> for GrpcMetrics<S>
where
    S: tower::Service<
        tonic::codegen::http::Request<B>,
        Response = tonic::codegen::http::Response<R>,
    >,
    S::Future: Send + 'static,
    S::Error: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> Self::Future {
        let method = req
            .uri()
            .path()
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_string();
        let t = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await;
            let code = match &res {
                Ok(r) => r
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<i32>().ok())
                    .map(tonic::Code::from_i32)
                    .unwrap_or(tonic::Code::Ok),
                Err(_) => tonic::Code::Unknown,
            };
            let took = t.elapsed();
            tracing::debug!(%method, ?code, took_us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX), "CRI call done");
            get().record_rpc(&method, code, took);
            res
        })
    }
}

/// Serves `GET /metrics` (one request per connection) until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let n = match tokio::time::timeout(Duration::from_secs(5), sock.read(&mut buf)).await {
                Ok(Ok(n)) => n,
                _ => return,
            };
            let req = String::from_utf8_lossy(&buf[..n]);
            let path = req.split_whitespace().nth(1).unwrap_or("");
            let (status, ctype, body) =
                if req.starts_with("GET ") && (path == "/metrics" || path == "/") {
                    // The scrape source reads the image store: off the runtime's threads.
                    let body = tokio::task::spawn_blocking(|| get().render())
                        .await
                        .unwrap_or_default();
                    (
                        "200 OK",
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        body,
                    )
                } else {
                    ("404 Not Found", "text/plain", "not found\n".to_string())
                };
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_every_family() {
        let m = Metrics::new();
        m.record_rpc("RunPodSandbox", tonic::Code::Ok, Duration::from_millis(3));
        m.record_rpc(
            "RunPodSandbox",
            tonic::Code::NotFound,
            Duration::from_millis(1),
        );
        m.record_pull(true, Duration::from_millis(40));
        m.add_pulled_bytes(1234);
        m.record_vm_boot(Duration::from_millis(900));
        m.set_kvm_verdict("unusable");
        m.record_cni("ADD", true, Duration::from_millis(12));
        m.record_oom_kill();
        m.set_source(|| Snapshot {
            pods: vec![("ready".into(), "flat".into(), 2)],
            containers: vec![("running".into(), "flat".into(), 3)],
            images: 4,
            blobs_committed: 5,
            layers_unpacked: 6,
        });
        let text = m.render();
        for want in [
            "vessel_cri_requests_total{method=\"RunPodSandbox\",code=\"OK\"} 1",
            "vessel_cri_requests_total{method=\"RunPodSandbox\",code=\"NotFound\"} 1",
            "vessel_cri_request_duration_seconds_count{method=\"RunPodSandbox\"} 2",
            "vessel_image_pulls_total{result=\"ok\"} 1",
            "vessel_image_pulled_bytes_total 1234",
            "vessel_vm_boot_duration_seconds_count 1",
            "vessel_kvm_usable{verdict=\"unusable\"} 1",
            "vessel_cni_duration_seconds_count{op=\"add\",result=\"ok\"} 1",
            "vessel_container_oom_kills_total 1",
            "vessel_pods{state=\"ready\",backend=\"flat\"} 2",
            "vessel_containers{state=\"running\",backend=\"flat\"} 3",
            "vessel_images 4",
            "vessel_image_blobs_committed_total 5",
            "vessel_image_layers_unpacked_total 6",
            "vessel_build_info{version=",
            "# EOF",
        ] {
            assert!(text.contains(want), "{want:?} missing from:\n{text}");
        }
    }
}
