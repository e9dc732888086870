//! `vessel-shim bench`: boot-time and memory benchmark of vessel-shim against QEMU `-M microvm`,
//! run side by side on the same kernel and initrd (the harness runs it inside L1).
//!
//! The guest's `/init` (harness test `bench`) prints `vessel-event: init`, echoes one vsock
//! connection on port 1234, then powers off after a connection on port 1235. For each run we
//! measure, from spawning the VMM process: the time to the `init` line on the console, the
//! time to the first vsock answer (connect, send, echo back), and, while the guest idles
//! between the two connections, the VMM's RSS and PSS minus those of its guest-memory mapping.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

pub struct BenchArgs {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub mem_mib: u64,
    pub runs: usize,
    pub qemu: Option<PathBuf>,
    pub work: PathBuf,
}

#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    init_ms: f64,
    vsock_ms: f64,
    rss_kib: u64,
    pss_kib: u64,
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

fn run_ours(a: &BenchArgs, i: usize) -> Result<Sample> {
    let sock = a.work.join(format!("bench-{i}.sock"));
    let _ = std::fs::remove_file(&sock);
    let spec = a.work.join(format!("bench-{i}.json"));
    std::fs::write(
        &spec,
        serde_json::to_string(&serde_json::json!({
            "kernel": a.kernel, "initrd": a.initrd, "mem_mib": a.mem_mib, "vcpus": 1,
            "console": "stderr", "cmdline": "vessel.test=bench",
            "vsock": {"guest_cid": 3, "uds_path": sock},
        }))?,
    )?;
    let exe = std::env::current_exe()?;
    let t0 = Instant::now();
    let mut child = Command::new(exe)
        .args(["run", "--spec"])
        .arg(&spec)
        .args(["--timeout", "60"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let init = watch_init(child.stderr.take().expect("piped"), t0);
    let r = measure(&mut child, t0, &init, a.mem_mib, |port, dl, c| {
        vsock_echo_hybrid(&sock, port, dl, c)
    });
    let _ = child.wait();
    r
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
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

fn summary(name: &str, s: &[Sample]) -> [f64; 4] {
    let m = [
        median(s.iter().map(|x| x.init_ms).collect()),
        median(s.iter().map(|x| x.vsock_ms).collect()),
        median(s.iter().map(|x| x.rss_kib as f64).collect()),
        median(s.iter().map(|x| x.pss_kib as f64).collect()),
    ];
    println!(
        "BENCH {name:5} runs={} init_ms={:.1} first_vsock_ms={:.1} vmm_rss_kib={:.0} vmm_pss_kib={:.0} (medians; memory beyond guest RAM)",
        s.len(),
        m[0],
        m[1],
        m[2],
        m[3]
    );
    m
}

pub fn bench(a: &BenchArgs) -> Result<()> {
    std::fs::create_dir_all(&a.work)?;
    let mut ours = Vec::new();
    let mut qemu = Vec::new();
    // Interleave the two so drifts in the host affect both alike.
    for i in 0..a.runs {
        let s = run_ours(a, i).with_context(|| format!("vessel-shim run {i}"))?;
        println!(
            "run {i} vessel: init {:.1} ms, first vsock answer {:.1} ms, rss {} KiB, pss {} KiB",
            s.init_ms, s.vsock_ms, s.rss_kib, s.pss_kib
        );
        ours.push(s);
        if let Some(q) = &a.qemu {
            let s = run_qemu(a, q).with_context(|| format!("qemu run {i}"))?;
            println!(
                "run {i} qemu:   init {:.1} ms, first vsock answer {:.1} ms, rss {} KiB, pss {} KiB",
                s.init_ms, s.vsock_ms, s.rss_kib, s.pss_kib
            );
            qemu.push(s);
        }
    }
    let o = summary("ours", &ours);
    if !qemu.is_empty() {
        let q = summary("qemu", &qemu);
        println!(
            "BENCH ratio ours/qemu: init {:.2} first_vsock {:.2} rss {:.2} pss {:.2}",
            o[0] / q[0],
            o[1] / q[1],
            o[2] / q[2],
            o[3] / q[3]
        );
    }
    Ok(())
}
