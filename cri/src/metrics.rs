//! A small Prometheus endpoint: `GET /metrics` on `daemon.metrics_address`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vessel_images::ImageStore;

#[derive(Default)]
pub struct Metrics {
    pulls_ok: AtomicU64,
    pulls_failed: AtomicU64,
    pull_micros_total: AtomicU64,
    pulled_bytes: AtomicU64,
    started_unix: AtomicU64,
}

impl Metrics {
    pub fn new() -> Arc<Metrics> {
        let m = Metrics::default();
        m.started_unix.store(
            chrono::Utc::now().timestamp().max(0) as u64,
            Ordering::Relaxed,
        );
        Arc::new(m)
    }

    pub fn record_pull(&self, ok: bool, took: Duration) {
        if ok {
            self.pulls_ok.fetch_add(1, Ordering::Relaxed);
        } else {
            self.pulls_failed.fetch_add(1, Ordering::Relaxed);
        }
        self.pull_micros_total.fetch_add(
            u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    pub fn add_pulled_bytes(&self, n: u64) {
        self.pulled_bytes.fetch_add(n, Ordering::Relaxed);
    }

    /// The exposition text.
    pub fn render(&self, store: &ImageStore) -> String {
        let images = store.list().map(|l| l.len()).unwrap_or(0);
        let ok = self.pulls_ok.load(Ordering::Relaxed);
        let failed = self.pulls_failed.load(Ordering::Relaxed);
        let secs = self.pull_micros_total.load(Ordering::Relaxed) as f64 / 1e6;
        format!(
            "# HELP vessel_build_info vesseld version.\n\
             # TYPE vessel_build_info gauge\n\
             vessel_build_info{{version=\"{}\"}} 1\n\
             # HELP vessel_start_time_seconds Unix time vesseld started.\n\
             # TYPE vessel_start_time_seconds gauge\n\
             vessel_start_time_seconds {}\n\
             # HELP vessel_image_pulls_total PullImage calls by result.\n\
             # TYPE vessel_image_pulls_total counter\n\
             vessel_image_pulls_total{{result=\"ok\"}} {ok}\n\
             vessel_image_pulls_total{{result=\"error\"}} {failed}\n\
             # HELP vessel_image_pull_seconds_total Time spent in PullImage.\n\
             # TYPE vessel_image_pull_seconds_total counter\n\
             vessel_image_pull_seconds_total {secs:.6}\n\
             # HELP vessel_image_pulled_bytes_total Bytes downloaded from registries.\n\
             # TYPE vessel_image_pulled_bytes_total counter\n\
             vessel_image_pulled_bytes_total {}\n\
             # HELP vessel_image_blobs_committed_total Blobs verified and stored.\n\
             # TYPE vessel_image_blobs_committed_total counter\n\
             vessel_image_blobs_committed_total {}\n\
             # HELP vessel_image_layers_unpacked_total Layers unpacked.\n\
             # TYPE vessel_image_layers_unpacked_total counter\n\
             vessel_image_layers_unpacked_total {}\n\
             # HELP vessel_images Images in the store.\n\
             # TYPE vessel_images gauge\n\
             vessel_images {images}\n",
            env!("CARGO_PKG_VERSION"),
            self.started_unix.load(Ordering::Relaxed),
            self.pulled_bytes.load(Ordering::Relaxed),
            store.stats.blobs_committed.load(Ordering::Relaxed),
            store.stats.layers_unpacked.load(Ordering::Relaxed),
        )
    }
}

/// Serves `GET /metrics` (HTTP/1.0-style, one request per connection) until the task is dropped.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    store: Arc<ImageStore>,
) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let metrics = metrics.clone();
        let store = store.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let n = match tokio::time::timeout(Duration::from_secs(5), sock.read(&mut buf)).await {
                Ok(Ok(n)) => n,
                _ => return,
            };
            let req = String::from_utf8_lossy(&buf[..n]);
            let path = req.split_whitespace().nth(1).unwrap_or("");
            let (status, body) = if req.starts_with("GET ") && (path == "/metrics" || path == "/") {
                let s = store.clone();
                let body = tokio::task::spawn_blocking(move || metrics.render(&s))
                    .await
                    .unwrap_or_default();
                ("200 OK", body)
            } else {
                ("404 Not Found", "not found\n".to_string())
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        });
    }
}
