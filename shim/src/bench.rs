//! `vessel-shim bench`: boot-time and memory benchmark of vessel-shim against QEMU `-M microvm`,
//! run side by side on the same kernel and initrd (the harness runs it inside L1).
//!
//! The guest's `/init` (harness test `bench`) prints `vessel-event: init`, echoes one vsock
//! connection on port 1234, then powers off after a connection on port 1235. For each run we
//! measure, from spawning the VMM process: the time to the `init` line on the console, the
//! time to the first vsock answer (connect, send, echo back), and, while the guest idles
//! between the two connections, the VMM's RSS and PSS minus those of its guest-memory mapping.
//!
//! For vessel-shim, the boot is also split into phases, from the VMM side: `vmm` (spawn to the
//! first vCPU entry: its `exec`, measured from the spawn time we pass in `VESSEL_BENCH_SPAWN_NS`,
//! then the shim's `built_ms`, whose steps it reports as `build_phases_ms`), `kernel` (first
//! vCPU entry to the guest's `init` line, on the shim's clock) and init to the first vsock
//! answer; `console_lag` is how much later than the shim we read the `init` line. With
//! `--vmlinux`, vessel-shim also boots the uncompressed ELF kernel, as VM pods do (QEMU
//! `-M microvm` boots the bzImage: it cannot direct-boot this ELF).
//! The last line is `BENCH-JSON {...}`: the medians of each variant.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub struct BenchArgs {
    pub kernel: PathBuf,
    /// The same kernel as an ELF vmlinux, for a second vessel-shim variant.
    pub vmlinux: Option<PathBuf>,
    pub initrd: PathBuf,
    pub mem_mib: u64,
    pub runs: usize,
    pub qemu: Option<PathBuf>,
    pub work: PathBuf,
}

#[derive(Debug, Clone, Default)]
struct Sample {
    init_ms: f64,
    vsock_ms: f64,
    rss_kib: u64,
    pss_kib: u64,
    /// Spawn to the first vCPU entry (vessel-shim only; 0 for QEMU).
    vmm_ms: f64,
    /// First vCPU entry to the guest's `init` line, on the shim's clock (vessel-shim only).
    kernel_ms: f64,
    /// The steps of `vmm_ms` (the shim's `build_phases_ms`), in order.
    phases: Vec<(String, f64)>,
    /// How much later than the shim we read the `init` line (vessel-shim only).
    console_lag_ms: f64,
}

/// (total RSS, total PSS) minus the guest-memory mapping(s): mappings of exactly `mem_kib`.
fn overhead(pid: u32, mem_kib: u64) -> Result<(u64, u64)> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).context("reading smaps")?;
    let (mut rss, mut pss) = (0u64, 0u64);
    let mut guest = false;
    for line in smaps.lines() {
        let mut it = line.split_whitespace();
        let (Some(k), Some(v)) = (it.next(), it.next()) else {
            continue;
        };
        let v: u64 = v.parse().unwrap_or(0);
        match k {
            "Size:" => guest = v == mem_kib,
            "Rss:" if !guest => rss += v,
            "Pss:" if !guest => pss += v,
            _ => {}
        }
    }
    Ok((rss, pss))
}

fn vsock_echo_hybrid(sock: &Path, port: u32, deadline: Instant, child: &mut Child) -> Result<()> {
    loop {
        match crate::hybrid_connect(sock, port) {
            Ok(mut s) => {
                s.write_all(b"ping")?;
                s.shutdown(std::net::Shutdown::Write)?;
                let mut r = Vec::new();
                s.read_to_end(&mut r)?;
                if r != b"ping" {
                    bail!("vsock echo returned {r:?}");
                }
                return Ok(());
            }
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("{e:#}");
                if let Some(st) = child.try_wait()? {
                    bail!("the VMM exited ({st}) before answering: {e:#}");
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e),
        }
    }
}

fn vsock_echo_cid(cid: u32, port: u32, deadline: Instant, child: &mut Child) -> Result<()> {
    loop {
        // AF_VSOCK (40) fits `sa_family_t` and sockaddr_vm's 16 bytes fit `socklen_t`.
        #[allow(clippy::cast_possible_truncation)]
        // SAFETY: plain socket/connect/read/write/close calls on an fd this block owns, with
        // a properly initialised sockaddr_vm of the size passed.
        let r = unsafe {
            let fd = libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            if fd < 0 {
                bail!("AF_VSOCK socket: {}", std::io::Error::last_os_error());
            }
            let mut a: libc::sockaddr_vm = std::mem::zeroed();
            a.svm_family = libc::AF_VSOCK as libc::sa_family_t;
            a.svm_cid = cid;
            a.svm_port = port;
            let ok = libc::connect(
                fd,
                &a as *const libc::sockaddr_vm as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_vm>() as u32,
            ) == 0;
            let mut res = Err(anyhow::anyhow!(
                "connect: {}",
                std::io::Error::last_os_error()
            ));
            if ok {
                libc::write(fd, b"ping".as_ptr().cast(), 4);
                libc::shutdown(fd, libc::SHUT_WR);
                let mut buf = [0u8; 16];
                let mut got = 0usize;
                loop {
                    let n = libc::read(fd, buf[got..].as_mut_ptr().cast(), buf.len() - got);
                    if n <= 0 {
                        break;
                    }
                    got += n as usize;
                }
                res = if &buf[..got] == b"ping" {
                    Ok(())
                } else {
                    Err(anyhow::anyhow!("echo returned {:?}", &buf[..got]))
                };
            }
            libc::close(fd);
            res
        };
        match r {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("{e:#}");
                if let Some(st) = child.try_wait()? {
                    bail!("the VMM exited ({st}) before answering: {e:#}");
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Spawns a reader that reports when a console line contains `vessel-event: init`.
fn watch_init(out: impl Read + Send + 'static, t0: Instant) -> mpsc::Receiver<f64> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if line.contains("vessel-event: init") {
                let _ = tx.send(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
    });
    rx
}

fn run_ours(a: &BenchArgs, kernel: &Path, i: usize) -> Result<Sample> {
    let sock = a.work.join(format!("bench-{i}.sock"));
    let _ = std::fs::remove_file(&sock);
    let spec = a.work.join(format!("bench-{i}.json"));
    std::fs::write(
        &spec,
        serde_json::to_string(&serde_json::json!({
            "kernel": kernel, "initrd": a.initrd, "mem_mib": a.mem_mib, "vcpus": 1,
            "console": "stderr", "cmdline": "vessel.test=bench",
            "vsock": {"guest_cid": 3, "uds_path": sock},
        }))?,
    )?;
    let exe = std::env::current_exe()?;
    let t0 = Instant::now();
    let mut child = Command::new(exe)
        .env("VESSEL_BENCH_SPAWN_NS", crate::monotonic_ns().to_string())
        .args(["run", "--spec"])
        .arg(&spec)
        .args(["--timeout", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let init = watch_init(child.stderr.take().expect("piped"), t0);
    let mut out = child.stdout.take().expect("piped");
    let r = measure(&mut child, t0, &init, a.mem_mib, |port, dl, c| {
        vsock_echo_hybrid(&sock, port, dl, c)
    });
    let _ = child.wait();
    let mut s = r?;
    // The shim's report: `built_ms` (its start to the first vCPU entry), the init event on
    // its own clock, and its build phases (`exec` first).
    let mut report = String::new();
    out.read_to_string(&mut report)?;
    let v: serde_json::Value =
        serde_json::from_str(report.trim()).context("the shim's report is not JSON")?;
    let (Some(built), Some(init)) = (v["built_ms"].as_f64(), v["events"]["init"].as_f64()) else {
        bail!("the shim's report has no built_ms or init event: {report}");
    };
    // The shim's exec is in its report (`exec`); what is left of the difference of the two
    // clocks' init times is the console line's way to us through the pipe (`console_lag`):
    // with one CPU, this reader waits for the busy vCPU thread to yield.
    let phases: Vec<(String, f64)> = v["build_phases_ms"]
        .as_array()
        .map(|p| {
            p.iter()
                .filter_map(|pair| Some((pair[0].as_str()?.to_string(), pair[1].as_f64()?)))
                .collect()
        })
        .unwrap_or_default();
    let exec = phases
        .iter()
        .find(|(k, _)| k == "exec")
        .map_or(0.0, |p| p.1);
    s.vmm_ms = exec + built;
    s.kernel_ms = init - built;
    s.phases = phases;
    s.console_lag_ms = s.init_ms - init - exec;
    Ok(s)
}

fn run_qemu(a: &BenchArgs, qemu: &Path) -> Result<Sample> {
    let t0 = Instant::now();
    let mut child = Command::new(qemu)
        .args([
            "-M",
            "microvm,acpi=off,pit=off,pic=off,rtc=off",
            "-enable-kvm",
            "-cpu",
            "host",
        ])
        .args([
            "-m",
            &a.mem_mib.to_string(),
            "-smp",
            "1",
            "-nodefaults",
            "-no-user-config",
        ])
        .args(["-display", "none", "-serial", "stdio", "-no-reboot"])
        .args(["-device", "vhost-vsock-device,guest-cid=3"])
        .arg("-kernel")
        .arg(&a.kernel)
        .arg("-initrd")
        .arg(&a.initrd)
        .args([
            "-append",
            "console=ttyS0 reboot=k panic=1 quiet vessel.test=bench",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {}", qemu.display()))?;
    let init = watch_init(child.stdout.take().expect("piped"), t0);
    let r = measure(&mut child, t0, &init, a.mem_mib, |port, dl, c| {
        vsock_echo_cid(3, port, dl, c)
    });
    // Without ACPI the powered-off guest halts and QEMU stays: end it.
    std::thread::sleep(Duration::from_millis(200));
    let _ = child.kill();
    let _ = child.wait();
    r
}

fn measure(
    child: &mut Child,
    t0: Instant,
    init: &mpsc::Receiver<f64>,
    mem_mib: u64,
    echo: impl Fn(u32, Instant, &mut Child) -> Result<()>,
) -> Result<Sample> {
    let deadline = t0 + Duration::from_secs(60);
    echo(1234, deadline, child).context("first vsock echo")?;
    let vsock_ms = t0.elapsed().as_secs_f64() * 1e3;
    let init_ms = init
        .recv_timeout(Duration::from_secs(5))
        .context("no init line on the console")?;
    std::thread::sleep(Duration::from_millis(100));
    let (rss_kib, pss_kib) = overhead(child.id(), mem_mib << 10)?;
    echo(1235, deadline, child).context("second vsock connection (poweroff)")?;
    Ok(Sample {
        init_ms,
        vsock_ms,
        rss_kib,
        pss_kib,
        ..Sample::default()
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

/// The medians of one variant's samples, printed, and as JSON for the last line.
fn summary(name: &str, s: &[Sample]) -> serde_json::Value {
    let med = |f: fn(&Sample) -> f64| median(s.iter().map(f).collect());
    let (init, vsock, vmm) = (med(|x| x.init_ms), med(|x| x.vsock_ms), med(|x| x.vmm_ms));
    let (rss, pss) = (med(|x| x.rss_kib as f64), med(|x| x.pss_kib as f64));
    // The VMM's steps in the order of the first run, each the median over the runs.
    let steps: Vec<(String, f64)> = s
        .first()
        .map(|f| f.phases.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|k| {
            let m = median(
                s.iter()
                    .filter_map(|x| x.phases.iter().find(|(n, _)| *n == k).map(|p| p.1))
                    .collect(),
            );
            (k, m)
        })
        .collect();
    let phases = if vmm > 0.0 {
        // Medians of each run's split: they need not add up to the totals' medians, and the
        // totals (measured here, as for QEMU) include `console_lag`.
        let kernel = med(|x| x.kernel_ms);
        let user = med(|x| x.vsock_ms - x.init_ms);
        let list: Vec<String> = steps.iter().map(|(k, v)| format!("{k} {v:.1}")).collect();
        let lag = med(|x| x.console_lag_ms);
        format!(
            " (vmm {vmm:.1} [{}] + kernel {kernel:.1}; init to vsock {user:.1}; console lag {lag:.1})",
            list.join(", ")
        )
    } else {
        String::new()
    };
    println!(
        "BENCH {name:9} runs={} init_ms={init:.1}{phases} first_vsock_ms={vsock:.1} vmm_rss_kib={rss:.0} vmm_pss_kib={pss:.0} (medians; memory beyond guest RAM)",
        s.len(),
    );
    serde_json::json!({
        "runs": s.len(), "init_ms": init, "first_vsock_ms": vsock, "vmm_ms": vmm,
        "kernel_ms": (vmm > 0.0).then(|| med(|x| x.kernel_ms)),
        "console_lag_ms": (vmm > 0.0).then(|| med(|x| x.console_lag_ms)),
        // [name, ms] pairs, in the order the VMM takes the steps.
        "vmm_steps_ms": steps,
        "vmm_rss_kib": rss, "vmm_pss_kib": pss,
    })
}

pub fn bench(a: &BenchArgs) -> Result<()> {
    std::fs::create_dir_all(&a.work)?;
    let mut variants: Vec<(&str, Option<&Path>, Vec<Sample>)> =
        vec![("ours", Some(&a.kernel), vec![])];
    if let Some(v) = &a.vmlinux {
        variants.push(("ours-elf", Some(v), vec![]));
    }
    if a.qemu.is_some() {
        variants.push(("qemu", None, vec![]));
    }
    // Interleave the variants so drifts in the host affect all alike.
    for i in 0..a.runs {
        for (name, kernel, samples) in &mut variants {
            let s = match (kernel, &a.qemu) {
                (Some(k), _) => run_ours(a, k, i),
                (None, Some(q)) => run_qemu(a, q),
                (None, None) => continue,
            }
            .with_context(|| format!("{name} run {i}"))?;
            println!(
                "run {i} {name}: init {:.1} ms, first vsock answer {:.1} ms, rss {} KiB, pss {} KiB",
                s.init_ms, s.vsock_ms, s.rss_kib, s.pss_kib
            );
            samples.push(s);
        }
    }
    let mut json = serde_json::Map::new();
    for (name, _, samples) in &variants {
        json.insert(name.to_string(), summary(name, samples));
    }
    if let Some(q) = json.get("qemu") {
        for (name, o) in json.iter().filter(|(n, _)| *n != "qemu") {
            let r = |k: &str| o[k].as_f64().unwrap_or(f64::NAN) / q[k].as_f64().unwrap_or(f64::NAN);
            println!(
                "BENCH ratio {name}/qemu: init {:.2} first_vsock {:.2} rss {:.2} pss {:.2}",
                r("init_ms"),
                r("first_vsock_ms"),
                r("vmm_rss_kib"),
                r("vmm_pss_kib")
            );
        }
    }
    println!("BENCH-JSON {}", serde_json::Value::Object(json));
    Ok(())
}
