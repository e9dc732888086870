//! Pod network benchmark: TCP throughput pod-to-pod and host-to-pod, and what network set-up
//! adds to RunPodSandbox, for flat pods and (with `VESSEL_BENCH_HANDLER=vm`) VM pods side by
//! side in one `vesseld`, on a private CNI bridge network (Debian's bridge + host-local +
//! portmap + loopback, as the CNI tests use).
//!
//! ```text
//! sudo cargo bench -p vessel-benches --bench network
//! ```
//!
//! - **Throughput**: a server pod serves a [`PAYLOAD_MIB`] MiB file with busybox `httpd`; a
//!   client pod of the same handler downloads it with `wget -O /dev/null` (timed from the
//!   client: the ExecSync, so one exec's overhead is included), and the bench process itself
//!   downloads it from the pod IP (host to pod). MB/s per sample, medians, VM/flat ratios.
//! - **Set-up**: RunPodSandbox with the CNI network against the same daemon build with no CNI
//!   config (loopback only); the difference is what networking costs a pod. For flat pods that
//!   is the CNI chain itself (a netns pin exists either way); for VM pods it also covers the
//!   host netns and the tap with its tc filters. `vm_minus_flat_ms` is the VM pod's cost
//!   beyond CNI.
//!
//! Results go to stdout and `benches/results/network-<host>-<date>.json`, and on a
//! `RESULT-JSON:` line (the nested harness's files do not come back). `VESSELD=/path` measures
//! a given binary; `VESSEL_BENCH_CONFIG` adds TOML to vesseld's config (guest kernel, initrd);
//! `VESSEL_BENCH_RUNS` overrides [`RUNS`]. Prints `SKIP network: <why>` when not root or the
//! CNI plugins are missing.

use anyhow::{Context, Result};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use vessel_benches::{
    bench_handlers, bench_runs, machine_info, release_vesseld, write_result, Stats,
};
use vessel_cri_api::v1 as cri;
use vessel_critest::client::{pod_metadata, sh_container, CriClient};
use vessel_critest::daemon::{busybox_registry, TestCni, Vesseld};

const RUNS: usize = 8;
const PAYLOAD_MIB: u64 = 32;
const PORT: u16 = 8080;

struct Bench {
    c: CriClient,
    image: String,
    logs: tempfile::TempDir,
    n: usize,
}

impl Bench {
    fn pod_config(&mut self, what: &str) -> cri::PodSandboxConfig {
        self.n += 1;
        let name = format!("{what}-{}", self.n);
        cri::PodSandboxConfig {
            metadata: pod_metadata(&name, "netbench"),
            hostname: name.clone(),
            log_directory: self.logs.path().join(&name).display().to_string(),
            ..Default::default()
        }
    }

    /// A pod of `handler` with one container running `script`: (pod, container, pod IP).
    async fn pod(
        &mut self,
        handler: &str,
        what: &str,
        script: &str,
    ) -> Result<(String, String, String)> {
        let cfg = self.pod_config(what);
        let pod = self
            .c
            .run_pod(&cfg, handler)
            .await
            .context("RunPodSandbox")?;
        let ctr = self
            .c
            .create_container(&pod, &cfg, sh_container("c", &self.image, script))
            .await
            .context("CreateContainer")?;
        self.c
            .start_container(&ctr)
            .await
            .context("StartContainer")?;
        let ip = self
            .c
            .pod_status(&pod)
            .await?
            .network
            .unwrap_or_default()
            .ip;
        anyhow::ensure!(!ip.is_empty(), "pod {pod} has no IP");
        Ok((pod, ctr, ip))
    }

    async fn sh(&mut self, ctr: &str, script: &str, timeout: i64) -> Result<String> {
        let r = self
            .c
            .exec_sync(ctr, &["sh", "-c", script], timeout)
            .await?;
        anyhow::ensure!(
            r.exit_code == 0,
            "`{script}` exited {}: {}{}",
            r.exit_code,
            String::from_utf8_lossy(&r.stdout),
            String::from_utf8_lossy(&r.stderr)
        );
        Ok(String::from_utf8_lossy(&r.stdout).into_owned())
    }

    /// RunPodSandbox of `handler`, timed; the pod is removed afterwards (untimed).
    async fn run_pod_once(&mut self, handler: &str) -> Result<f64> {
        let cfg = self.pod_config("setup");
        let t = Instant::now();
        let pod = self
            .c
            .run_pod(&cfg, handler)
            .await
            .context("RunPodSandbox")?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        self.c.stop_and_remove_pod(&pod).await?;
        Ok(ms)
    }
}

/// Downloads `http://addr/big` from the bench process; MB/s.
async fn host_get(addr: &str) -> Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let t = Instant::now();
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(b"GET /big HTTP/1.0\r\n\r\n").await?;
    let mut buf = vec![0u8; 256 << 10];
    let mut total = 0u64;
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    anyhow::ensure!(total >= PAYLOAD_MIB << 20, "short read: {total} bytes");
    Ok(mbps(PAYLOAD_MIB, t.elapsed()))
}

fn mbps(mib: u64, d: Duration) -> f64 {
    (mib as f64 * 1.048_576) / d.as_secs_f64()
}

fn median(v: &[f64]) -> f64 {
    Stats::of(v).map(|s| s.median).unwrap_or(f64::NAN)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Throughput samples for one handler: (pod to pod, host to pod), MB/s.
async fn throughput(b: &mut Bench, handler: &str, runs: usize) -> Result<(Vec<f64>, Vec<f64>)> {
    let serve = format!(
        "mkdir -p /tmp/www && dd if=/dev/zero of=/tmp/www/big bs=1048576 count={PAYLOAD_MIB} 2>/dev/null && exec httpd -f -p {PORT} -h /tmp/www"
    );
    let (spod, _sctr, sip) = b.pod(handler, "server", &serve).await?;
    let (cpod, cctr, _) = b.pod(handler, "client", "exec sleep 100000").await?;
    let url = format!("http://{sip}:{PORT}/big");
    // Until the server is up (the file is written first).
    let start = Instant::now();
    while b
        .sh(&cctr, &format!("wget -q -O /dev/null {url}"), 60)
        .await
        .is_err()
    {
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(60),
            "{url} never answered"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (mut p2p, mut h2p) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let t = Instant::now();
        b.sh(&cctr, &format!("wget -q -O /dev/null {url}"), 120)
            .await?;
        p2p.push(mbps(PAYLOAD_MIB, t.elapsed()));
        h2p.push(host_get(&format!("{sip}:{PORT}")).await?);
    }
    b.c.stop_and_remove_pod(&cpod).await?;
    b.c.stop_and_remove_pod(&spod).await?;
    Ok((p2p, h2p))
}

fn main() -> Result<()> {
    if !rustix::process::geteuid().is_root() {
        println!("SKIP network: needs root (network namespaces, veths, taps)");
        return Ok(());
    }
    let cni = match TestCni::new() {
        Ok(c) => c,
        Err(why) => {
            println!("SKIP network: {why}");
            return Ok(());
        }
    };
    let (measure, runs) = bench_runs(RUNS);
    let handlers = bench_handlers();
    let extra = std::env::var("VESSEL_BENCH_CONFIG").unwrap_or_default();
    let vesseld = release_vesseld(&["vessel-cri", "vessel-agent", "vessel-shim"])?;
    std::env::set_var("VESSEL_TEST_RUST_LOG", "info");
    let machine = machine_info();
    let no_cni = tempfile::tempdir()?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(async {
            let (_reg, image) = busybox_registry().await?;
            let daemon = |cni_toml: String| {
                let config = format!("{}\n{cni_toml}", extra);
                Vesseld::start_with(&vesseld, "log_level = \"info\"", &config)
            };
            let with = daemon(cni.config_toml())?;
            let without = daemon(format!(
                "[cni]\nconf_dir = \"{}\"\nbin_dirs = [\"/usr/lib/cni\"]\n",
                no_cni.path().display()
            ))?;
            let mut bw = Bench { c: with.client().await, image: image.clone(), logs: tempfile::tempdir()?, n: 0 };
            let mut bo = Bench { c: without.client().await, image: image.clone(), logs: tempfile::tempdir()?, n: 0 };
            for b in [&bw, &bo] {
                b.c.pull(&image).await.context("PullImage")?;
            }
            let mut out = BTreeMap::new();
            for h in &handlers {
                // Set-up: alternate the two daemons so drift hits both alike (one untimed
                // warm-up each).
                let (mut net, mut lo) = (Vec::new(), Vec::new());
                for i in 0..=runs {
                    let a = bw.run_pod_once(h).await.with_context(|| format!("{h}: RunPodSandbox with CNI"))?;
                    let b = bo.run_pod_once(h).await.with_context(|| format!("{h}: RunPodSandbox without CNI"))?;
                    if i > 0 {
                        net.push(a);
                        lo.push(b);
                    }
                }
                let (p2p, h2p) = throughput(&mut bw, h, runs).await.with_context(|| format!("{h}: throughput"))?;
                println!(
                    "{h:>4}: pod-to-pod {:.1} MB/s, host-to-pod {:.1} MB/s; RunPodSandbox {:.1} ms with CNI, {:.1} ms without (+{:.1} ms)",
                    median(&p2p), median(&h2p), median(&net), median(&lo), median(&net) - median(&lo)
                );
                out.insert(h.clone(), json!({
                    "pod_to_pod_mbps": {"samples": p2p.iter().map(|x| round2(*x)).collect::<Vec<_>>(), "median": round2(median(&p2p))},
                    "host_to_pod_mbps": {"samples": h2p.iter().map(|x| round2(*x)).collect::<Vec<_>>(), "median": round2(median(&h2p))},
                    "run_pod_sandbox_with_cni": Stats::of(&net).map(|s| s.json()),
                    "run_pod_sandbox_without_cni": Stats::of(&lo).map(|s| s.json()),
                    "network_setup_ms": round2(median(&net) - median(&lo)),
                }));
            }
            let mut result = json!({
                "bench": "network",
                "payload_mib": PAYLOAD_MIB,
                "runs": runs,
                "machine": machine,
                "handlers": out,
            });
            if let (Some(f), Some(v)) = (result["handlers"].get("flat").cloned(), result["handlers"].get("vm").cloned()) {
                let ratio = |k: &str| round2(v[k]["median"].as_f64().unwrap_or(0.0) / f[k]["median"].as_f64().unwrap_or(f64::NAN));
                let beyond = round2(v["network_setup_ms"].as_f64().unwrap_or(0.0) - f["network_setup_ms"].as_f64().unwrap_or(0.0));
                result["vm_over_flat"] = json!({
                    "pod_to_pod": ratio("pod_to_pod_mbps"),
                    "host_to_pod": ratio("host_to_pod_mbps"),
                    "setup_vm_minus_flat_ms": beyond,
                });
                println!(
                    "VM/flat throughput: pod-to-pod {}x, host-to-pod {}x; VM network set-up beyond CNI: {beyond} ms",
                    result["vm_over_flat"]["pod_to_pod"], result["vm_over_flat"]["host_to_pod"]
                );
            }
            if let Ok(note) = std::env::var("VESSEL_BENCH_NOTE") {
                result["note"] = json!(note);
            }
            if measure {
                let p = write_result("network", &result)?;
                println!("\nresults: {}", p.display());
                println!("RESULT-JSON: {}", serde_json::to_string(&result)?);
            }
            drop(with);
            drop(without);
            Ok::<(), anyhow::Error>(())
        })?;
    drop(cni);
    Ok(())
}
