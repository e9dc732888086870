//! Volume benchmark: I/O on a host-path volume from inside a pod, flat pods and (with
//! `VESSEL_BENCH_HANDLER=vm`) VM pods side by side in one `vesseld`. A flat pod's volume is a
//! bind mount of the host directory; a VM pod's is the same directory shared into the guest
//! with virtio-fs, so the ratios are what the file-sharing path costs.
//!
//! ```text
//! sudo cargo bench -p vessel-benches --bench volumes
//! ```
//!
//! Per handler, one pod with one container (busybox, sleeping) that mounts a fresh host
//! directory at `/v`; each sample is one ExecSync, timed from the bench, minus the median of
//! an empty exec in the same container (what exec itself costs):
//!
//! - **seq write**: `dd if=/dev/zero of=/v/w bs=1M count=64 conv=fsync` (MB/s).
//! - **seq read**: `dd if=/v/r<n> of=/dev/null bs=1M` of a 64 MiB file the host wrote just
//!   before (a new file each sample, so the guest's page cache is cold; the host's is warm
//!   for both handlers).
//! - **local write**: the same write to the container's own `/tmp` (its rootfs: overlayfs on
//!   the host's disk for a flat pod, on the guest's tmpfs for a VM pod), no fsync: what the
//!   pod's own kernel does with the bytes, without the volume path. Where the VM's local
//!   write is as slow as its volume write, the guest (not the file server) is the limit.
//! - **create**: 500 files with the shell's `echo x >` (no fork per file); files/s.
//! - **stat**: `ls -l` of those 500 files; stats/s.
//! - **memory**: the pod's host process before any volume I/O and after the samples: for a
//!   VM pod the shim's own PSS without guest RAM (what serving the volume added to the VMM)
//!   and the guest RAM touched (the guest's page cache grows with file I/O); for a flat pod
//!   the agent's PSS.
//!
//! Random I/O is not measured: busybox has no tool that does it without a fork per op.
//! Results go to stdout, `benches/results/volumes-<host>-<date>.json` and a `RESULT-JSON:`
//! line. `VESSELD=/path` measures a given binary; `VESSEL_BENCH_CONFIG` adds TOML to vesseld's
//! config; `VESSEL_BENCH_RUNS` overrides [`RUNS`]. Prints `SKIP volumes: <why>` when not root.

use anyhow::{Context, Result};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;
use vessel_benches::{
    bench_handlers, bench_runs, machine_info, pss_kib, release_vesseld, vm_memory_kib,
    write_result, Stats,
};
use vessel_cri_api::v1 as cri;
use vessel_critest::client::{pod_metadata, sh_container, CriClient};
use vessel_critest::daemon::{busybox_registry, Vesseld};

const RUNS: usize = 5;
const FILE_MIB: u64 = 64;
const SMALL_FILES: u32 = 500;

struct Pod {
    c: CriClient,
    ctr: String,
    pod: String,
    /// Seconds an empty exec takes (median), taken off every sample.
    exec_s: f64,
}

impl Pod {
    /// Runs `script`, returns its wall time in seconds minus an exec's own.
    async fn timed(&mut self, script: &str) -> Result<f64> {
        let t = Instant::now();
        let r = self
            .c
            .exec_sync(&self.ctr, &["sh", "-c", script], 300)
            .await?;
        let s = t.elapsed().as_secs_f64();
        anyhow::ensure!(
            r.exit_code == 0,
            "`{script}` exited {}: {}{}",
            r.exit_code,
            String::from_utf8_lossy(&r.stdout),
            String::from_utf8_lossy(&r.stderr)
        );
        Ok((s - self.exec_s).max(1e-6))
    }

    /// The pod's host process (the VM shim, or the flat agent) and the VM's memory (MiB; 0
    /// for a flat pod) from verbose status.
    async fn host_pid(&mut self) -> Result<(u32, u64)> {
        let v = self.c.pod_info(&self.pod).await?;
        let pid = v["pid"].as_u64().context("no pid")?;
        let pid = u32::try_from(pid).with_context(|| format!("pid {pid} out of range"))?;
        Ok((pid, v["vm"]["memoryMiB"].as_u64().unwrap_or(0)))
    }
}

/// (own PSS of the pod's host process without guest RAM, guest RAM touched), KiB.
fn memory_kib(pid: u32, guest_mib: u64) -> (u64, u64) {
    if guest_mib == 0 {
        return (pss_kib(pid).unwrap_or(0), 0);
    }
    vm_memory_kib(pid, guest_mib)
        .map(|(guest, own)| (own, guest))
        .unwrap_or_default()
}

fn median(v: &[f64]) -> f64 {
    Stats::of(v).map(|s| s.median).unwrap_or(f64::NAN)
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn summary(samples: &[f64]) -> serde_json::Value {
    json!({
        "samples": samples.iter().map(|x| round2(*x)).collect::<Vec<_>>(),
        "median": round2(median(samples)),
    })
}

/// A pod of `handler` whose container mounts `dir` at `/v`.
async fn start_pod(
    c: &CriClient,
    image: &str,
    handler: &str,
    dir: &Path,
    logs: &Path,
) -> Result<Pod> {
    let cfg = cri::PodSandboxConfig {
        metadata: pod_metadata(&format!("vol-{handler}"), "volbench"),
        log_directory: logs.join(handler).display().to_string(),
        ..Default::default()
    };
    let pod = c.run_pod(&cfg, handler).await.context("RunPodSandbox")?;
    let mut ccfg = sh_container("c", image, "exec sleep 100000");
    ccfg.mounts = vec![cri::Mount {
        container_path: "/v".into(),
        host_path: dir.display().to_string(),
        ..Default::default()
    }];
    let ctr = c
        .create_container(&pod, &cfg, ccfg)
        .await
        .context("CreateContainer")?;
    c.start_container(&ctr).await.context("StartContainer")?;
    let mut p = Pod {
        c: c.clone(),
        ctr,
        pod,
        exec_s: 0.0,
    };
    let mut empty = Vec::new();
    for _ in 0..5 {
        empty.push(p.timed("true").await?);
    }
    p.exec_s = median(&empty);
    Ok(p)
}

async fn measure(p: &mut Pod, dir: &Path, runs: usize) -> Result<serde_json::Value> {
    let mib = FILE_MIB as f64 * 1.048_576;
    let (mut w, mut r, mut create, mut stat) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut local = Vec::new();
    let chunk = vec![0x5au8; 1 << 20];
    for i in 0..runs {
        let s = p
            .timed(&format!(
                "dd if=/dev/zero of=/v/w bs=1M count={FILE_MIB} conv=fsync 2>/dev/null"
            ))
            .await?;
        w.push(mib / s);
        let s = p
            .timed(&format!(
                "dd if=/dev/zero of=/tmp/w bs=1M count={FILE_MIB} 2>/dev/null; rm -f /tmp/w"
            ))
            .await?;
        local.push(mib / s);
        {
            use std::io::Write;
            let mut f = std::fs::File::create(dir.join(format!("r{i}")))?;
            for _ in 0..FILE_MIB {
                f.write_all(&chunk)?;
            }
        }
        let s = p
            .timed(&format!("dd if=/v/r{i} of=/dev/null bs=1M 2>/dev/null"))
            .await?;
        r.push(mib / s);
        std::fs::remove_file(dir.join(format!("r{i}")))?;
        let s = p
            .timed(&format!(
                "mkdir /v/s{i} && n=0; while [ $n -lt {SMALL_FILES} ]; do echo x > /v/s{i}/$n; n=$((n+1)); done"
            ))
            .await?;
        create.push(f64::from(SMALL_FILES) / s);
        let s = p.timed(&format!("ls -l /v/s{i} >/dev/null")).await?;
        stat.push(f64::from(SMALL_FILES) / s);
    }
    Ok(json!({
        "exec_ms": round2(p.exec_s * 1e3),
        "seq_write_mbps": summary(&w),
        "local_write_mbps": summary(&local),
        "seq_read_mbps": summary(&r),
        "create_per_s": summary(&create),
        "stat_per_s": summary(&stat),
    }))
}

fn main() -> Result<()> {
    if !rustix::process::geteuid().is_root() {
        println!("SKIP volumes: needs root (pods, mounts)");
        return Ok(());
    }
    let (measure_mode, runs) = bench_runs(RUNS);
    let handlers = bench_handlers();
    let extra = std::env::var("VESSEL_BENCH_CONFIG").unwrap_or_default();
    let vesseld = release_vesseld(&["vessel-cri", "vessel-agent", "vessel-shim"])?;
    std::env::set_var("VESSEL_TEST_RUST_LOG", "info");
    let machine = machine_info();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(async {
            let (_reg, image) = busybox_registry().await?;
            let daemon = Vesseld::start_with(&vesseld, "log_level = \"info\"", &extra)?;
            let c = daemon.client().await;
            c.pull(&image).await.context("PullImage")?;
            let work = tempfile::tempdir()?;
            let mut out = BTreeMap::new();
            for h in &handlers {
                let dir = work.path().join(format!("vol-{h}"));
                std::fs::create_dir_all(&dir)?;
                let mut p = start_pod(&c, &image, h, &dir, work.path())
                    .await
                    .with_context(|| format!("{h}: pod"))?;
                let (pid, guest_mib) = p.host_pid().await?;
                let (pss_before, guest_before) = memory_kib(pid, guest_mib);
                let mut m = measure(&mut p, &dir, runs)
                    .await
                    .with_context(|| format!("{h}: volume I/O"))?;
                let (pss_after, guest_after) = memory_kib(pid, guest_mib);
                let added = |a: u64, b: u64| i64::try_from(a).unwrap_or(0) - i64::try_from(b).unwrap_or(0);
                m["host_process_pss_kib"] = json!({"before_io": pss_before, "after_io": pss_after,
                    "added": added(pss_after, pss_before)});
                if guest_mib > 0 {
                    m["guest_ram_touched_kib"] = json!({"before_io": guest_before, "after_io": guest_after,
                        "added": added(guest_after, guest_before)});
                }
                println!(
                    "{h:>4}: seq write {} MB/s (local {}), seq read {} MB/s, create {} files/s, stat {} /s; pod process PSS {} -> {} KiB",
                    m["seq_write_mbps"]["median"], m["local_write_mbps"]["median"], m["seq_read_mbps"]["median"],
                    m["create_per_s"]["median"], m["stat_per_s"]["median"], pss_before, pss_after
                );
                c.stop_and_remove_pod(&p.pod).await?;
                out.insert(h.clone(), m);
            }
            let mut result = json!({
                "bench": "volumes",
                "file_mib": FILE_MIB,
                "small_files": SMALL_FILES,
                "runs": runs,
                "machine": machine,
                "handlers": out,
            });
            if let (Some(f), Some(v)) = (
                result["handlers"].get("flat").cloned(),
                result["handlers"].get("vm").cloned(),
            ) {
                let ratio = |k: &str| {
                    round2(
                        v[k]["median"].as_f64().unwrap_or(0.0)
                            / f[k]["median"].as_f64().unwrap_or(f64::NAN),
                    )
                };
                result["vm_over_flat"] = json!({
                    "seq_write": ratio("seq_write_mbps"),
                    "local_write": ratio("local_write_mbps"),
                    "seq_read": ratio("seq_read_mbps"),
                    "create": ratio("create_per_s"),
                    "stat": ratio("stat_per_s"),
                });
                println!("VM/flat: {}", result["vm_over_flat"]);
            }
            if let Ok(note) = std::env::var("VESSEL_BENCH_NOTE") {
                result["note"] = json!(note);
            }
            if measure_mode {
                let p = write_result("volumes", &result)?;
                println!("\nresults: {}", p.display());
                println!("RESULT-JSON: {}", serde_json::to_string(&result)?);
            }
            drop(daemon);
            Ok::<(), anyhow::Error>(())
        })
}
