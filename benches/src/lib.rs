//! Helpers shared by vessel's benchmarks: which binaries to measure, statistics, machine
//! information and result files.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (benches/ is one level down).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The target directory the running bench binary was built in (it runs from
/// `<T>/release/deps/`), else `$CARGO_TARGET_DIR` (relative to the workspace), else
/// `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    let from_exe = std::env::current_exe().ok().and_then(|exe| {
        let deps = exe.parent()?;
        let profile = deps.parent()?;
        (deps.file_name()? == "deps" && profile.file_name()? == "release")
            .then(|| profile.parent().map(Path::to_path_buf))
            .flatten()
    });
    let workspace = workspace_root();
    from_exe
        .or_else(|| std::env::var_os("CARGO_TARGET_DIR").map(|p| workspace.join(p)))
        .unwrap_or_else(|| workspace.join("target"))
}

/// The `vesseld` to measure: `$VESSELD` as is (its `vessel-agent` sibling is used with it),
/// else a release build of `packages` from the checked-out sources into [`target_dir`] (a
/// no-op when up to date), so that what is measured is always what is checked out.
pub fn release_vesseld(packages: &[&str]) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("VESSELD") {
        let p = PathBuf::from(p);
        anyhow::ensure!(p.is_file(), "VESSELD={} is not a file", p.display());
        return Ok(p);
    }
    let target = target_dir();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    eprintln!(
        "building {} (cargo build --release, target dir {})",
        packages.join(", "),
        target.display()
    );
    let mut build = Command::new(&cargo);
    build
        .current_dir(workspace_root())
        .args(["build", "--release"]);
    for p in packages {
        build.args(["-p", p]);
    }
    build.arg("--target-dir").arg(&target);
    // Not the variables cargo set for running this bench: build scripts watch some of them
    // (ring's `rerun-if-env-changed=CARGO_MANIFEST_DIR`), and inheriting them would rebuild
    // ring, rustls, reqwest, vessel-images and vesseld here and again in the next `cargo bench`.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("CARGO_PKG_")
            || k.starts_with("CARGO_MANIFEST_")
            || [
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "CARGO_RUSTC_CURRENT_DIR",
                "OUT_DIR",
            ]
            .contains(&k.as_ref())
        {
            build.env_remove(k.as_ref());
        }
    }
    let status = build
        .status()
        .with_context(|| format!("running {}", Path::new(&cargo).display()))?;
    anyhow::ensure!(
        status.success(),
        "the release build failed ({status}); set VESSELD=/path/to/vesseld to use a prebuilt one"
    );
    let bin = target.join("release/vesseld");
    anyhow::ensure!(bin.is_file(), "{} missing after the build", bin.display());
    Ok(bin)
}

/// Order statistics of a sample, in milliseconds.
#[derive(Debug, Clone, Copy)]
pub struct Stats {
    pub n: usize,
    pub median: f64,
    pub p90: f64,
    pub p95: f64,
    pub min: f64,
    pub max: f64,
    pub mean: f64,
}

impl Stats {
    pub fn of(samples: &[f64]) -> Option<Stats> {
        if samples.is_empty() {
            return None;
        }
        let mut v = samples.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        // Nearest rank: ceil(q n) is at most n, a usize (and clamped anyway).
        #[allow(clippy::cast_possible_truncation)]
        let rank = |q: f64| ((q * n as f64).ceil() as usize).clamp(1, n);
        Some(Stats {
            n,
            median,
            p90: v[rank(0.90) - 1],
            p95: v[rank(0.95) - 1],
            min: v[0],
            max: v[n - 1],
            mean: v.iter().sum::<f64>() / n as f64,
        })
    }

    pub fn json(&self) -> serde_json::Value {
        let r = |x: f64| (x * 100.0).round() / 100.0;
        serde_json::json!({
            "n": self.n, "median_ms": r(self.median), "p90_ms": r(self.p90), "p95_ms": r(self.p95),
            "min_ms": r(self.min), "max_ms": r(self.max), "mean_ms": r(self.mean),
        })
    }
}

/// A command's trimmed stdout, if it ran and succeeded.
pub fn cmd_out(cmd: &mut Command) -> Option<String> {
    let o = cmd.output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// What machine and software a result was measured on.
pub fn machine_info() -> serde_json::Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    });
    serde_json::json!({
        "hostname": cmd_out(&mut Command::new("hostname")),
        "kernel": cmd_out(Command::new("uname").arg("-srv")),
        "cpu_model": cpu,
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "loadavg": std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim(),
        "rustc": cmd_out(Command::new("rustc").arg("--version")),
        "vessel_commit": cmd_out(Command::new("git").current_dir(workspace_root()).args(["rev-parse", "HEAD"])),
    })
}

/// Writes `value` to `benches/results/<name>-<hostname>-<date>.json` and returns the path.
pub fn write_result(name: &str, value: &serde_json::Value) -> Result<PathBuf> {
    let dir = workspace_root().join("benches/results");
    std::fs::create_dir_all(&dir)?;
    let host = cmd_out(&mut Command::new("hostname")).unwrap_or_else(|| "unknown".into());
    let date = chrono::Utc::now().format("%Y-%m-%d");
    let p = dir.join(format!("{name}-{host}-{date}.json"));
    std::fs::write(&p, serde_json::to_string_pretty(value)? + "\n")?;
    Ok(p)
}

/// Proportional set size of a process in KiB (from smaps_rollup).
pub fn pss_kib(pid: u32) -> Option<u64> {
    field_kib(&format!("/proc/{pid}/smaps_rollup"), "Pss:")
}

/// Resident set size of a process in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    field_kib(&format!("/proc/{pid}/status"), "VmRSS:")
}

/// What a process's RSS is made of, from one reading of `/proc/<pid>/status`: anonymous
/// memory (heap, stacks) and file pages (its mapped binary and libraries), KiB, and its
/// thread count.
pub fn rss_parts(pid: u32) -> serde_json::Value {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |k: &str| first_number(&status, k);
    serde_json::json!({"anon_kib": field("RssAnon:"), "file_kib": field("RssFile:"), "threads": field("Threads:")})
}

fn field_kib(path: &str, key: &str) -> Option<u64> {
    first_number(&std::fs::read_to_string(path).ok()?, key)
}

/// The number after `key` on the first line of `text` that starts with it.
fn first_number(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// A VM pod's host memory from its shim's `/proc/<pid>/smaps`: (guest RAM the guest has
/// touched, i.e. the RSS of the guest memory mapping of `guest_mib`; PSS of everything else
/// in the shim: the VMM itself). KiB.
pub fn vm_memory_kib(pid: u32, guest_mib: u64) -> Option<(u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let (mut guest, mut other) = (0u64, 0u64);
    let mut in_guest = false;
    let val = |l: &str| -> u64 {
        l.split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    for l in s.lines() {
        if let Some(v) = l.strip_prefix("Size:") {
            // Guest RAM is one anonymous mapping of exactly its size (below the 32-bit gap).
            in_guest = val(&format!("x {v}")) == guest_mib * 1024;
        } else if l.starts_with("Rss:") && in_guest {
            guest += val(l);
        } else if l.starts_with("Pss:") && !in_guest {
            other += val(l);
        }
    }
    Some((guest, other))
}

/// `--bench` on the command line (cargo bench passes it; `--no-run` builds and a plain run
/// checks the bench once) and the number of runs: `VESSEL_BENCH_RUNS`, else `default`; 1
/// without `--bench`.
pub fn bench_runs(default: usize) -> (bool, usize) {
    let measure = std::env::args().any(|a| a == "--bench");
    let runs = std::env::var("VESSEL_BENCH_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(default);
    (measure, if measure { runs } else { 1 })
}

/// The handlers a side-by-side bench measures: flat, and vm with `VESSEL_BENCH_HANDLER=vm`.
pub fn bench_handlers() -> Vec<String> {
    let mut handlers = vec!["flat".to_string()];
    if std::env::var("VESSEL_BENCH_HANDLER").as_deref() == Ok("vm") {
        handlers.push("vm".into());
    }
    handlers
}

/// The default socket of `scripts/containerd-bench.sh`'s private containerd.
pub const DEFAULT_CONTAINERD: &str = "/run/vessel-bench-containerd/containerd.sock";

/// containerd's socket path from `VESSEL_BENCH_CONTAINERD` (`unix://` optional), else the
/// default of `scripts/containerd-bench.sh` when it exists. `Err` says why there is none.
pub fn containerd_socket() -> Result<PathBuf, String> {
    match std::env::var("VESSEL_BENCH_CONTAINERD") {
        Ok(v) if v == "off" || v == "0" => Err("VESSEL_BENCH_CONTAINERD=off".into()),
        Ok(v) if !v.is_empty() => Ok(PathBuf::from(v.trim_start_matches("unix://"))),
        _ if std::path::Path::new(DEFAULT_CONTAINERD).exists() => {
            Ok(PathBuf::from(DEFAULT_CONTAINERD))
        }
        _ => Err(format!(
            "no VESSEL_BENCH_CONTAINERD and no {DEFAULT_CONTAINERD}; run `sudo scripts/containerd-bench.sh start` first, or scripts/bench-side-by-side.sh"
        )),
    }
}

/// Iteration `i`'s order over `n` sides: alternately first to last and last to first, so
/// that load drift hits every side alike.
pub fn order(i: usize, n: usize) -> Vec<usize> {
    let mut o: Vec<usize> = (0..n).collect();
    if i % 2 == 1 {
        o.reverse();
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_are_read_from_one_text() {
        let status = "Name:\tvesseld\nVmRSS:\t   17644 kB\nRssAnon:\t    4836 kB\nRssFile:\t   12808 kB\nThreads:\t8\n";
        assert_eq!(first_number(status, "RssAnon:"), Some(4836));
        assert_eq!(first_number(status, "RssFile:"), Some(12808));
        assert_eq!(first_number(status, "Threads:"), Some(8));
        assert_eq!(first_number(status, "VmSwap:"), None);
        let me = rss_parts(std::process::id());
        assert!(me["anon_kib"].as_u64().unwrap() > 0, "{me}");
        assert!(me["threads"].as_u64().unwrap() >= 1, "{me}");
    }
}
