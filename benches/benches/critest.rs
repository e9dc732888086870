//! Upstream critest's benchmark mode (cri-tools v1.36.0, `critest -benchmark`), vessel side by
//! side with containerd: the CRI's own measurement of every pod, container and image RPC.
//!
//! ```text
//! cargo bench -p vessel-benches --bench critest
//! sudo scripts/bench-side-by-side.sh critest     # starts a private containerd, runs this, stops it
//! ```
//!
//! Each run is one `critest -benchmark` process against one runtime with
//! [`SAMPLES`] samples per group (`containersNumber`, `podsNumber`, `imagesNumber`; one at a
//! time): the container group times CreateContainer (with critest's ImageStatus before it),
//! StartContainer, ContainerStatus, StopContainer, RemoveContainer of a busybox `top`; the pod
//! group RunPodSandbox, PodSandboxStatus, StopPodSandbox, RemovePodSandbox; the image group
//! PullImage, ImageStatus, RemoveImage and ListImages (ginkgo's group order, which decides
//! e.g. whether a pull finds a layer already there, is the same for both runtimes in a run:
//! `-ginkgo.seed` is the run's number). Runs alternate between the runtimes
//! ([`RUNS`] each, the order swapped every run) so that load drift hits both alike; the
//! samples of all runs are pooled. Reported per operation: median and p90 of each, the ratio
//! vessel/containerd of medians (below 1: vessel is faster), and the whole lifecycle (run,
//! create, start, stop, remove a pod with one container: the sum of those medians).
//!
//! Both runtimes get the same images and network: critest's stand-in images (from
//! `shared/cri-tools/images`) pushed into a `docker-registry` on 127.0.0.1 (see
//! [`stage_stand_ins`] for why not `registry.py`), every image host critest names mirrored
//! there (vesseld's `[images.registries]`, containerd's hosts.toml through
//! `scripts/containerd-bench.sh mirror`), and the same CNI chain (bridge + host-local +
//! portmap + loopback, Debian's plugins). vesseld is this tree's release build, run flat
//! (`VESSEL_BENCH_HANDLER=vm` passes critest `-runtime-handler vm` instead).
//!
//! containerd: `VESSEL_BENCH_CONTAINERD` (default: `scripts/containerd-bench.sh`'s socket when
//! it exists; `off` disables). Without one it prints a `SKIP` line and measures vessel alone.
//! `VESSEL_BENCH_RUNS` and `VESSEL_BENCH_SAMPLES` override the counts. Results go to stdout
//! and `benches/results/critest-bench[-side-by-side]-<host>-<date>.json`.

use anyhow::{bail, Context, Result};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use vessel_benches::{
    bench_runs, cmd_out, containerd_socket, machine_info, order, release_vesseld, workspace_root,
    write_result, Stats,
};
use vessel_critest::upstream::{Fixture, IMAGE_HOSTS};

/// critest runs per runtime.
const RUNS: usize = 2;
/// Samples per benchmark group in one critest run.
const SAMPLES: usize = 20;

/// Operations in report order: critest's names, and the aim (vessel/containerd ratio, and an
/// absolute bound in ms where the issue sets one).
const OPS: &[(&str, f64, Option<f64>)] = &[
    ("CreatePod", 0.5, None),
    ("StatusPod", 0.5, None),
    ("StopPod", 0.5, Some(15.0)),
    ("RemovePod", 0.5, None),
    ("CreateContainer", 0.5, Some(5.0)),
    ("StartContainer", 0.5, None),
    ("StatusContainer", 0.5, None),
    ("StopContainer", 0.5, None),
    ("RemoveContainer", 0.5, Some(3.0)),
    ("PullImage", 0.5, None),
    ("StatusImage", 0.5, None),
    ("RemoveImage", 0.5, None),
    ("ListImages", 0.5, None),
];

/// The pod lifecycle: run, create, start, stop, remove (what kubelet does for a pod).
const LIFECYCLE: &[&str] = &[
    "CreatePod",
    "CreateContainer",
    "StartContainer",
    "StopContainer",
    "RemoveContainer",
    "StopPod",
    "RemovePod",
];
const LIFECYCLE_AIM: f64 = 0.2;

struct Side {
    name: &'static str,
    endpoint: String,
    handler: Option<String>,
    version: String,
    samples: BTreeMap<String, Vec<f64>>,
}

impl Side {
    fn stats(&self, op: &str) -> Option<Stats> {
        self.samples.get(op).and_then(|v| Stats::of(v))
    }

    fn lifecycle(&self) -> Option<f64> {
        LIFECYCLE
            .iter()
            .map(|op| self.stats(op).map(|s| s.median))
            .sum()
    }
}

fn main() -> Result<()> {
    let (measure, runs) = bench_runs(RUNS);
    let samples: usize = if measure {
        std::env::var("VESSEL_BENCH_SAMPLES")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(SAMPLES)
    } else {
        2
    };
    let vesseld = release_vesseld(&["vessel-cri", "vessel-agent", "vessel-shim"])?;
    // Info-level logging, as a production daemon runs.
    std::env::set_var("VESSEL_TEST_RUST_LOG", "info");
    stage_stand_ins()?;
    let Some(fx) = Fixture::start("critest bench", &vesseld) else {
        return Ok(());
    };
    let crictl = fx.bin.join("crictl");
    let critest = fx.bin.join("critest");
    let handler = std::env::var("VESSEL_BENCH_HANDLER")
        .ok()
        .filter(|h| !h.is_empty());
    let mut sides = vec![Side {
        name: "vessel",
        endpoint: fx.endpoint(),
        handler: handler.clone(),
        version: runtime_version(&crictl, &fx.endpoint()).context("vessel: crictl version")?,
        samples: BTreeMap::new(),
    }];
    match containerd_socket() {
        Err(why) => println!("containerd: SKIP ({why}); measuring vessel alone"),
        Ok(socket) => {
            let endpoint = format!("unix://{}", socket.display());
            match runtime_version(&crictl, &endpoint) {
                Err(e) => println!(
                    "containerd: SKIP ({endpoint} does not answer crictl version: {e:#}); measuring vessel alone"
                ),
                Ok(version) => {
                    mirror_containerd(&socket, fx.registry.port())?;
                    println!("containerd: {version} on {endpoint}, alternating with vessel");
                    sides.push(Side {
                        name: "containerd",
                        endpoint,
                        handler: None,
                        version,
                        samples: BTreeMap::new(),
                    });
                }
            }
        }
    }

    let work = tempfile::tempdir()?;
    let params = work.path().join("params.yaml");
    std::fs::write(
        &params,
        format!(
            "containersNumber: {samples}\ncontainersNumberParallel: 1\npodsNumber: {samples}\n\
             podsNumberParallel: 1\nimagesNumber: {samples}\nimagesNumberParallel: 1\n"
        ),
    )?;
    let n = sides.len();
    for run in 0..runs {
        for s in order(run, n) {
            let side = &mut sides[s];
            let out = work.path().join(format!("{}-{run}", side.name));
            std::fs::create_dir_all(&out)?;
            let mut cmd = Command::new(&critest);
            cmd.arg(format!("--runtime-endpoint={}", side.endpoint))
                .arg(format!("--image-endpoint={}", side.endpoint))
                .arg("-benchmark")
                .arg(format!("-benchmarking-params-file={}", params.display()))
                .arg(format!("-benchmarking-output-dir={}", out.display()))
                .arg("-ginkgo.no-color")
                // ginkgo shuffles the groups; the same order for both runtimes in a run.
                .arg(format!("-ginkgo.seed={}", run + 1));
            if let Some(h) = &side.handler {
                cmd.arg(format!("-runtime-handler={h}"));
            }
            let started = std::time::Instant::now();
            let o = cmd.output().context("running critest")?;
            if !o.status.success() {
                let text = String::from_utf8_lossy(&o.stdout);
                let tail: Vec<&str> = text.lines().rev().take(60).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                bail!(
                    "{}: critest -benchmark failed ({}):\n{}",
                    side.name,
                    o.status,
                    tail.join("\n")
                );
            }
            let got = read_results(&out)?;
            println!(
                "run {}/{runs} {}: {} operations, {:.1} s",
                run + 1,
                side.name,
                got.len(),
                started.elapsed().as_secs_f64()
            );
            for (op, v) in got {
                side.samples.entry(op).or_default().extend(v);
            }
        }
    }

    let result = report(&sides, runs, samples, &machine_info(), &critest);
    if measure {
        let name = if n == 2 {
            "critest-bench-side-by-side"
        } else {
            "critest-bench"
        };
        let p = write_result(name, &result)?;
        println!("\nresults: {}", p.display());
    }
    Ok(())
}

/// Serves the stand-in images from Debian's `docker-registry` (Go's HTTP server, like every
/// real registry) rather than `registry.py`: Python's http.server sends a blob's headers and
/// body in two segments without TCP_NODELAY, so each blob waits out the client's delayed ACK
/// (~40 ms), which would be most of a PullImage for either runtime. Done by naming the tools
/// and the stand-ins' OCI layout, which `Fixture` then pushes into a docker-registry.
fn stage_stand_ins() -> Result<()> {
    use vessel_critest::upstream::{images_dir, shared_dir, tools_bin};
    if std::env::var_os("VESSEL_CRI_TOOLS_OCI").is_some() {
        return Ok(());
    }
    let Some(shared) = shared_dir() else {
        return Ok(()); // Fixture says SKIP
    };
    let bin = tools_bin(&shared).map_err(anyhow::Error::msg)?;
    let oci = images_dir(&shared).map_err(anyhow::Error::msg)?.join("oci");
    std::env::set_var("VESSEL_CRI_TOOLS_BIN", bin);
    std::env::set_var("VESSEL_CRI_TOOLS_OCI", oci);
    Ok(())
}

/// `RuntimeName RuntimeVersion` as `crictl version` prints them.
fn runtime_version(crictl: &Path, endpoint: &str) -> Result<String> {
    let o = Command::new(crictl)
        .arg(format!("--runtime-endpoint={endpoint}"))
        .arg("version")
        .env("CRICTL_CONFIG", "/dev/null")
        .output()?;
    if !o.status.success() {
        bail!("{}", String::from_utf8_lossy(&o.stderr).trim());
    }
    let text = String::from_utf8_lossy(&o.stdout);
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    Ok(format!(
        "{} {}",
        field("RuntimeName:"),
        field("RuntimeVersion:")
    ))
}

/// Points every image host critest names at the stand-in registry, for containerd: with
/// `scripts/containerd-bench.sh mirror` when it is that script's containerd; otherwise the
/// operator's containerd must be configured so (said, not done).
fn mirror_containerd(socket: &Path, port: u16) -> Result<()> {
    if socket != Path::new(vessel_benches::DEFAULT_CONTAINERD) {
        println!(
            "containerd: not scripts/containerd-bench.sh's; its registry config must mirror {} to http://127.0.0.1:{port}",
            IMAGE_HOSTS.join(", ")
        );
        return Ok(());
    }
    let script = workspace_root().join("scripts/containerd-bench.sh");
    for host in IMAGE_HOSTS {
        let ok = Command::new("bash")
            .arg(&script)
            .args(["mirror", host, &format!("http://127.0.0.1:{port}")])
            .status()?
            .success();
        if !ok {
            bail!("containerd-bench.sh mirror {host} failed");
        }
    }
    Ok(())
}

/// The samples (ms) per operation of one critest run's `-benchmarking-output-dir`.
fn read_results(dir: &Path) -> Result<BTreeMap<String, Vec<f64>>> {
    let mut out: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("critest wrote no results in {}", dir.display());
    }
    for f in files {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&f)?)
            .with_context(|| format!("parsing {}", f.display()))?;
        let names: Vec<String> = v["operationsNames"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n.as_str().map(str::to_string))
            .collect();
        for d in v["datapoints"].as_array().into_iter().flatten() {
            let ns = d["operationsDurationsNs"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            for (name, dur) in names.iter().zip(ns) {
                if let Some(ns) = dur.as_i64() {
                    out.entry(name.clone()).or_default().push(ns as f64 / 1e6);
                }
            }
        }
    }
    Ok(out)
}

fn report(
    sides: &[Side],
    runs: usize,
    samples: usize,
    machine: &serde_json::Value,
    critest: &Path,
) -> serde_json::Value {
    let v = &sides[0];
    let c = sides.get(1);
    println!(
        "\nupstream critest -benchmark: {runs} run(s) x {samples} samples per runtime, one at a time; client-side ms"
    );
    if c.is_some() {
        println!(
            "{:<18} {:>9} {:>8} {:>11} {:>8} {:>7}   aim",
            "operation", "vessel", "p90", "containerd", "p90", "ratio"
        );
    } else {
        println!("{:<18} {:>9} {:>8}", "operation", "vessel", "p90");
    }
    let mut ops = serde_json::Map::new();
    let mut misses = Vec::new();
    for (op, ratio_aim, abs_aim) in OPS {
        let Some(vs) = v.stats(op) else { continue };
        let cs = c.and_then(|c| c.stats(op));
        let ratio = cs.map(|cs| vs.median / cs.median);
        let mut aim = format!("<={ratio_aim}x");
        if let Some(a) = abs_aim {
            aim.push_str(&format!(", <={a} ms"));
        }
        let met = ratio.is_none_or(|r| r <= *ratio_aim) && abs_aim.is_none_or(|a| vs.median <= a);
        if !met {
            misses.push(op.to_string());
        }
        match cs {
            Some(cs) => println!(
                "{op:<18} {:>9.2} {:>8.2} {:>11.2} {:>8.2} {:>7.2}   {aim}{}",
                vs.median,
                vs.p90,
                cs.median,
                cs.p90,
                ratio.unwrap_or_default(),
                if met { "" } else { "  (missed)" }
            ),
            None => println!("{op:<18} {:>9.2} {:>8.2}", vs.median, vs.p90),
        }
        ops.insert(
            op.to_string(),
            json!({
                "vessel": vs.json(),
                "containerd": cs.map(|s| s.json()),
                "ratio": ratio.map(|r| (r * 1000.0).round() / 1000.0),
                "aim": aim,
                "met": met,
            }),
        );
    }
    let lv = v.lifecycle();
    let lc = c.and_then(Side::lifecycle);
    let lratio = lv.zip(lc).map(|(a, b)| a / b);
    if let Some(lv) = lv {
        match (lc, lratio) {
            (Some(lc), Some(r)) => {
                println!(
                    "{:<18} {lv:>9.2} {:>8} {lc:>11.2} {:>8} {r:>7.2}   <={LIFECYCLE_AIM}x{}",
                    "pod lifecycle",
                    "",
                    "",
                    if r <= LIFECYCLE_AIM { "" } else { "  (missed)" }
                );
                if r > LIFECYCLE_AIM {
                    misses.push("pod lifecycle".into());
                }
            }
            _ => println!("{:<18} {lv:>9.2}", "pod lifecycle"),
        }
    }
    println!(
        "(pod lifecycle: the sum of the medians of {})",
        LIFECYCLE.join(", ")
    );
    if c.is_some() {
        if misses.is_empty() {
            println!("every aim met");
        } else {
            println!("aims missed: {}", misses.join(", "));
        }
    }
    let round = |x: f64| (x * 100.0).round() / 100.0;
    json!({
        "benchmark": "upstream critest -benchmark (cri-tools v1.36.0), benches/benches/critest.rs",
        "machine": machine,
        "method": {
            "runs_per_runtime": runs,
            "samples_per_group_per_run": samples,
            "parallel": 1,
            "alternating": true,
            "network": "CNI bridge + host-local + portmap + loopback (Debian's plugins) on both",
            "images": "critest's stand-ins from shared/cri-tools/images, pushed to docker-registry on 127.0.0.1",
            "critest": critest.display().to_string(),
        },
        "software": {
            "vessel": v.version,
            "vessel_handler": v.handler.clone().unwrap_or_else(|| "flat".into()),
            "containerd": c.map(|c| c.version.clone()),
            "runc": cmd_out(Command::new("runc").arg("--version")).and_then(|s| s.lines().next().map(str::to_string)),
        },
        "operations": ops,
        "pod_lifecycle_ms": {
            "vessel": lv.map(round),
            "containerd": lc.map(round),
            "ratio": lratio.map(|r| (r * 1000.0).round() / 1000.0),
            "aim": format!("<={LIFECYCLE_AIM}x"),
            "of": LIFECYCLE,
        },
        "aims_missed": misses,
    })
}
