//! PullImage benchmark: a ~1-2 MB busybox image pulled by a real `vesseld` over its CRI
//! socket from a real `docker-registry` on 127.0.0.1.
//!
//! ```text
//! cargo bench -p vessel-benches --bench image_pull
//! ```
//!
//! For each variant (the busybox layer gzip-compressed, ~1.1 MB, and the same layer as a plain
//! tar, so that its ~2.1 MB cross the wire too): push the image, start from an empty store, one
//! warm-up pull, then [`RUNS`] measured `PullImage` RPCs, each timed by the client from request
//! to response. Between pulls (not timed) the image is removed by ID and the store is checked
//! to be empty (`blobs/sha256`, `layers`, `records`, `tmp` under `<root>/images`), so every
//! measured pull downloads and unpacks everything. vesseld runs as the e2e tests run it
//! ([`Vesseld::start`]: metrics off, log level debug); its log gives the server-side `ms` and
//! per-layer `unpack_ms`, reported alongside. The registry's storage and vesseld's root are
//! temp dirs under `$TMPDIR` (as in the e2e tests): the filesystem matters a lot (fsync and
//! syncfs are nearly free on tmpfs), so the JSON records it; compare runs on the same one.
//!
//! Output: a table on stdout (median, p95, min, mean, max; the containerd 1.6 reference of
//! 105.7 ms for a 3.2 MB image and the ratio to it), and the same as JSON, with machine
//! information, in `benches/results/image_pull-<hostname>-<date>.json`.
//!
//! **Which vesseld.** `VESSELD=/path/to/vesseld` uses that binary as is. Otherwise the bench
//! runs `$CARGO build --release -p vessel-cri --target-dir <T>` (`vessel_benches::release_vesseld`) from the
//! workspace root (a no-op when it is up to date, so the daemon measured is always built from
//! the checked-out sources) and uses `<T>/release/vesseld`. `<T>` is the target directory this
//! bench binary itself was built in (it runs from `<T>/release/deps/`), else
//! `$CARGO_TARGET_DIR`, else `<workspace>/target`.
//!
//! `VESSEL_BENCH_LOG=/path` keeps vesseld's (debug, text) log of the whole run there, for
//! looking into where the time goes (`pull: layer ready ... unpack_ms`, timestamps).
//!
//! Without `--bench` (e.g. `cargo test --benches`) it runs one measured pull per variant as a
//! smoke test and writes no results file.
//!
//! Needs `docker-registry` and `busybox` (busybox-static), as the e2e tests do.

use anyhow::{ensure, Context, Result};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use vessel_benches::{cmd_out, release_vesseld, workspace_root, Stats};
use vessel_cri_api::v1 as cri;
use vessel_critest::client::CriClient;
use vessel_critest::daemon::Vesseld;
use vessel_critest::registry::{Registry, RegistryOptions};
use vessel_images::push::{push_image, PushTarget};
use vessel_images::testimages::{self, BuiltImage, Compression};

/// Measured pulls per variant.
const RUNS: usize = 10;
/// Pulls before measuring (connection set-up, the http:// fallback remembered, page cache).
const WARMUP: usize = 1;
/// containerd 1.6, PullImage of a 3.2 MB image from a loopback registry, median (the issue).
const CONTAINERD_MEDIAN_MS: f64 = 105.7;
const CONTAINERD_IMAGE_MB: f64 = 3.2;
/// The issue's goal for vessel's median.
const TARGET_MS: f64 = 40.0;
/// Store directories that must be empty between pulls.
const STORE_DIRS: [&str; 4] = ["blobs/sha256", "layers", "records", "tmp"];

struct Variant {
    name: &'static str,
    compression: Compression,
    repo: &'static str,
}

const VARIANTS: [Variant; 2] = [
    Variant {
        name: "busybox gzip",
        compression: Compression::Gzip,
        repo: "bench/busybox-gzip",
    },
    Variant {
        name: "busybox tar",
        compression: Compression::None,
        repo: "bench/busybox-tar",
    },
];

struct Outcome {
    name: &'static str,
    compression: &'static str,
    layer_bytes: u64,
    tar_bytes: u64,
    transfer_bytes: u64,
    samples_ms: Vec<f64>,
    server_ms: Vec<f64>,
    unpack_ms: Vec<f64>,
}

fn main() -> Result<()> {
    let bench_mode = std::env::args().any(|a| a == "--bench");
    let runs = if bench_mode { RUNS } else { 1 };
    let vesseld = release_vesseld(&["vessel-cri"])?;
    eprintln!("image_pull: vesseld {}", vesseld.display());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let load_before = loadavg();
    let outcomes = rt.block_on(run_all(&vesseld, runs))?;
    let load_after = loadavg();

    print_table(&outcomes, runs);
    if bench_mode {
        let path = write_json(&outcomes, &vesseld, &load_before, &load_after)?;
        println!("results: {}", path.display());
    }
    Ok(())
}

async fn run_all(vesseld_bin: &Path, runs: usize) -> Result<Vec<Outcome>> {
    let reg = Registry::start(RegistryOptions::default()).context("starting docker-registry")?;
    let images: Vec<BuiltImage> = VARIANTS
        .iter()
        .map(|v| testimages::busybox_image(v.compression))
        .collect();
    for (v, img) in VARIANTS.iter().zip(&images) {
        let t = PushTarget::new(&reg.url(), v.repo);
        push_image(&t, img, Some("v1"))
            .await
            .with_context(|| format!("pushing {}", v.name))?;
    }
    let daemon = Vesseld::start(vesseld_bin, "").context("starting vesseld")?;
    let mut c = daemon.client().await;
    assert_store_empty(&daemon)?;

    let mut out = Vec::new();
    for (v, img) in VARIANTS.iter().zip(&images) {
        let name = format!("{}/{}:v1", reg.host(), v.repo);
        for _ in 0..WARMUP {
            pull_once(&mut c, &daemon, &name, img).await?;
        }
        let mut samples_ms = Vec::with_capacity(runs);
        let mut server_ms = Vec::with_capacity(runs);
        let mut unpack_ms = Vec::with_capacity(runs);
        for _ in 0..runs {
            let (client, server, unpack) = pull_once(&mut c, &daemon, &name, img).await?;
            samples_ms.push(client);
            server_ms.extend(server);
            unpack_ms.extend(unpack);
        }
        let layer_bytes: u64 = img.layers.iter().map(|l| l.size()).sum();
        let tar_bytes: u64 = (0..img.layers.len())
            .map(|i| img.layer_tar(i).len() as u64)
            .sum();
        out.push(Outcome {
            name: v.name,
            compression: match v.compression {
                Compression::None => "none",
                Compression::Gzip => "gzip",
                Compression::Zstd => "zstd",
            },
            layer_bytes,
            tar_bytes,
            transfer_bytes: layer_bytes + img.config.size() + img.manifest.size(),
            samples_ms,
            server_ms,
            unpack_ms,
        });
    }
    if let Some(p) = std::env::var_os("VESSEL_BENCH_LOG") {
        std::fs::write(&p, daemon.log())
            .with_context(|| format!("writing {}", Path::new(&p).display()))?;
    }
    Ok(out)
}

/// One timed PullImage, then (untimed) RemoveImage by ID and the empty-store check. Returns the
/// client-side milliseconds and what vesseld logged for this pull (total `ms`, `unpack_ms`).
async fn pull_once(
    c: &mut CriClient,
    daemon: &Vesseld,
    name: &str,
    img: &BuiltImage,
) -> Result<(f64, Option<f64>, Vec<f64>)> {
    let log_start = daemon.log().len();
    let req = cri::PullImageRequest {
        image: Some(cri::ImageSpec {
            image: name.to_string(),
            ..Default::default()
        }),
        auth: None,
        sandbox_config: None,
    };
    let t = Instant::now();
    let resp = c.images.pull_image(req).await;
    let client_ms = t.elapsed().as_secs_f64() * 1e3;
    let image_ref = resp
        .with_context(|| format!("PullImage {name}; vesseld log:\n{}", daemon.log()))?
        .into_inner()
        .image_ref;
    ensure!(
        image_ref == img.id().to_string(),
        "PullImage {name} returned {image_ref}, expected {}",
        img.id()
    );

    c.images
        .remove_image(cri::RemoveImageRequest {
            image: Some(cri::ImageSpec {
                image: image_ref.clone(),
                ..Default::default()
            }),
        })
        .await
        .with_context(|| format!("RemoveImage {image_ref}"))?;
    let left = c
        .images
        .list_images(cri::ListImagesRequest { filter: None })
        .await
        .context("ListImages")?
        .into_inner()
        .images;
    ensure!(left.is_empty(), "images left after RemoveImage: {left:?}");
    assert_store_empty(daemon)?;

    let log = daemon.log();
    let new = strip_ansi(log.get(log_start..).unwrap_or(""));
    let server = new
        .lines()
        .filter(|l| l.contains("pull: done"))
        .find_map(|l| field_ms(l, "ms"));
    let unpack = new
        .lines()
        .filter(|l| l.contains("pull: layer ready"))
        .filter_map(|l| field_ms(l, "unpack_ms"))
        .collect();
    Ok((client_ms, server, unpack))
}

/// The text log without colour escapes (`ESC [ ... m`).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(ch) = chars.next() {
        if ch == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(ch);
        }
    }
    out
}

/// `key=123` (text log) or `"key":123` (JSON log) in one log line.
fn field_ms(line: &str, key: &str) -> Option<f64> {
    for pat in [format!(" {key}="), format!("\"{key}\":")] {
        if let Some(i) = line.find(&pat) {
            let rest = &line[i + pat.len()..];
            let end = rest
                .find(|ch: char| !ch.is_ascii_digit() && ch != '.')
                .unwrap_or(rest.len());
            if let Ok(v) = rest[..end].parse() {
                return Some(v);
            }
        }
    }
    None
}

fn assert_store_empty(daemon: &Vesseld) -> Result<()> {
    let root = daemon.root_dir().join("images");
    for d in STORE_DIRS {
        let dir = root.join(d);
        let entries: Vec<String> = match std::fs::read_dir(&dir) {
            Ok(rd) => rd
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
        };
        ensure!(
            entries.is_empty(),
            "image store not empty: {} has {entries:?}",
            dir.display()
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Statistics and output

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

fn print_table(outcomes: &[Outcome], runs: usize) {
    println!();
    println!(
        "image_pull: CRI PullImage from a loopback docker-registry, store emptied between pulls; \
         {runs} measured after {WARMUP} warm-up"
    );
    println!(
        "{:<14} {:>10} {:>10} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11} {:>11}",
        "variant",
        "layer MB",
        "tar MB",
        "runs",
        "median",
        "p95",
        "min",
        "mean",
        "max",
        "server med",
        "unpack med"
    );
    for o in outcomes {
        let Some(s) = Stats::of(&o.samples_ms) else {
            continue;
        };
        let med = |v: &[f64]| {
            Stats::of(v).map_or_else(|| "-".to_string(), |s| format!("{:.1} ms", s.median))
        };
        println!(
            "{:<14} {:>10.3} {:>10.3} {:>5} {:>6.1} ms {:>6.1} ms {:>6.1} ms {:>6.1} ms {:>6.1} ms {:>11} {:>11}",
            o.name,
            mb(o.layer_bytes),
            mb(o.tar_bytes),
            s.n,
            s.median,
            s.p95,
            s.min,
            s.mean,
            s.max,
            med(&o.server_ms),
            med(&o.unpack_ms),
        );
    }
    println!(
        "(p95 is nearest-rank, so the maximum for n < 20; server/unpack: medians of vesseld's logged `ms` / `unpack_ms`)"
    );
    println!(
        "reference: containerd 1.6, {CONTAINERD_IMAGE_MB} MB image, median {CONTAINERD_MEDIAN_MS} ms; \
         target: median under {TARGET_MS} ms"
    );
    for o in outcomes {
        if let Some(s) = Stats::of(&o.samples_ms) {
            println!(
                "  {:<14} median {:.1} ms = {:.2}x containerd's ({:.1}x faster); {} the {TARGET_MS} ms target",
                o.name,
                s.median,
                s.median / CONTAINERD_MEDIAN_MS,
                CONTAINERD_MEDIAN_MS / s.median,
                if s.median < TARGET_MS { "meets" } else { "MISSES" },
            );
        }
    }
}

fn write_json(
    outcomes: &[Outcome],
    vesseld: &Path,
    load_before: &str,
    load_after: &str,
) -> Result<PathBuf> {
    let now = chrono::Utc::now();
    let host = hostname();
    let variants: Vec<serde_json::Value> = outcomes
        .iter()
        .map(|o| {
            let s = Stats::of(&o.samples_ms);
            let median = s.as_ref().map(|s| s.median);
            json!({
                "name": o.name,
                "compression": o.compression,
                "layer_bytes": o.layer_bytes,
                "uncompressed_tar_bytes": o.tar_bytes,
                "transfer_bytes": o.transfer_bytes,
                "client_ms": s.as_ref().map(Stats::json),
                "samples_ms": o.samples_ms.iter().map(|v| round2(*v)).collect::<Vec<_>>(),
                "server_ms": Stats::of(&o.server_ms).as_ref().map(Stats::json),
                "unpack_ms": Stats::of(&o.unpack_ms).as_ref().map(Stats::json),
                "ratio_to_containerd": median.map(|m| round2(m / CONTAINERD_MEDIAN_MS)),
                "meets_target": median.map(|m| m < TARGET_MS),
            })
        })
        .collect();
    let workspace = workspace_root();
    let commit = cmd_out(
        Command::new("git")
            .current_dir(&workspace)
            .args(["rev-parse", "HEAD"]),
    );
    // Tracked files that differ from the commit, so a dirty tree says what differs.
    let dirty =
        cmd_out(
            Command::new("git")
                .current_dir(&workspace)
                .args(["diff", "--name-only", "HEAD"]),
        )
        .map(|s| s.lines().map(str::to_string).collect::<Vec<_>>());
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_string());
    let doc = json!({
        "benchmark": "image_pull",
        "date": now.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "method": {
            "runs": RUNS,
            "warmup": WARMUP,
            "timed": "PullImage RPC over the CRI Unix socket, measured by the client",
            "between_runs": "RemoveImage by ID (untimed); blobs/sha256, layers, records, tmp checked empty",
            "registry": "docker-registry on 127.0.0.1, plain HTTP, filesystem storage",
            "vesseld": "vessel_critest::daemon::Vesseld::start: metrics off, log level debug",
        },
        "reference": {
            "runtime": "containerd 1.6",
            "image_mb": CONTAINERD_IMAGE_MB,
            "median_ms": CONTAINERD_MEDIAN_MS,
            "target_median_ms": TARGET_MS,
        },
        "variants": variants,
        "machine": {
            "hostname": host,
            "nproc": std::thread::available_parallelism().map(|n| n.get()).ok(),
            "kernel": cmd_out(Command::new("uname").arg("-srvm")),
            "cpu_model": cpu_model(),
            "mem_total": meminfo_total(),
            "loadavg_before": load_before,
            "loadavg_after": load_after,
            "tmp_filesystem": cmd_out(
                Command::new("df")
                    .args(["--output=fstype,source,target"])
                    .arg(std::env::temp_dir()),
            )
            .and_then(|s| s.lines().last().map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))),
        },
        "software": {
            "rustc": cmd_out(Command::new(rustc).arg("-V")),
            "docker_registry": cmd_out(Command::new(registry_binary()).arg("--version")),
            "vessel_commit": commit,
            "vessel_dirty": dirty.as_ref().map(|d| !d.is_empty()),
            "vessel_modified_files": dirty,
            "vesseld": vesseld.display().to_string(),
        },
    });
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("results");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("image_pull-{host}-{}.json", now.format("%Y-%m-%d")));
    let mut text = serde_json::to_string_pretty(&doc)?;
    text.push('\n');
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

// ---------------------------------------------------------------------------------------------
// The vesseld binary and machine information

fn registry_binary() -> PathBuf {
    std::env::var_os("VESSEL_DOCKER_REGISTRY")
        .map(PathBuf::from)
        .unwrap_or_else(|| "docker-registry".into())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| cmd_out(&mut Command::new("hostname")))
        .unwrap_or_else(|| "unknown".to_string())
        .replace(
            |c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '.'),
            "_",
        )
}

fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

fn meminfo_total() -> Option<String> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    info.lines()
        .find(|l| l.starts_with("MemTotal:"))
        .map(|l| l.trim_start_matches("MemTotal:").trim().to_string())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
