//! `vessel-shim`: one host process per microVM.

use anyhow::{bail, Context, Result};

mod bench;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "vessel-shim", about = "vessel's per-VM host process", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Probe KVM: absent, unusable (e.g. emulating, far below native speed) or usable.
    /// Exit status 0 when usable, 1 when unusable, 2 when absent.
    Probe {
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
        /// The KVM device node.
        #[arg(long, default_value = "/dev/kvm")]
        device: std::path::PathBuf,
    },
    /// Boot a VM from a JSON (or .toml) spec and exit with the guest's outcome
    /// (0 poweroff, 10 reboot, 11 panic, 12 stopped, 1 error). SIGTERM/SIGINT ask the guest to
    /// shut down (`vessel-stop` on its console) and stop it after the spec's stop_timeout_ms;
    /// a second signal stops it at once.
    /// Prints one JSON line on stdout: the outcome and the times (ms since start) of
    /// `vessel-event: NAME` lines the guest printed on its console.
    Run {
        #[arg(long)]
        spec: std::path::PathBuf,
        /// Stop the guest after this many seconds.
        #[arg(long)]
        timeout: Option<f64>,
    },
    /// Connect to a guest vsock port through a VM's hybrid vsock socket (`CONNECT <port>`),
    /// optionally send a message and print what comes back until EOF.
    VsockConnect {
        /// The VM's vsock Unix socket.
        #[arg(long)]
        socket: std::path::PathBuf,
        #[arg(long)]
        port: u32,
        /// Bytes to send after the connection is up; the write side is then shut down.
        #[arg(long)]
        send: Option<String>,
        /// Instead of --send: send this many pattern bytes and check they come back (an echo).
        #[arg(long)]
        echo_bytes: Option<usize>,
        /// Keep retrying a refused connection for this many milliseconds.
        #[arg(long, default_value_t = 0)]
        retry_ms: u64,
    },
    /// Send one request to a shim's control socket and print the answer (exit 1 if it is
    /// `{"ok":false,...}`). With --fd-file, FILE is opened O_WRONLY|O_APPEND|O_CREAT and its
    /// descriptor goes with the request (for `set_log`).
    Ctl {
        #[arg(long)]
        socket: std::path::PathBuf,
        /// The request, e.g. '{"op":"ping"}'.
        request: String,
        #[arg(long)]
        fd_file: Option<std::path::PathBuf>,
    },
    /// Remove what a VM of this spec left behind if its shim died without cleaning up
    /// (SIGKILL): its vsock, log and control sockets, when no live shim answers on them.
    Cleanup {
        #[arg(long)]
        spec: std::path::PathBuf,
    },
    /// Benchmark boot to init, first vsock answer and VMM memory overhead against QEMU
    /// `-M microvm` on the same kernel and initrd (guest test `bench` of the harness).
    Bench {
        #[arg(long)]
        kernel: std::path::PathBuf,
        /// The same kernel as an ELF vmlinux: vessel-shim boots it too, as VM pods do.
        #[arg(long)]
        vmlinux: Option<std::path::PathBuf>,
        #[arg(long)]
        initrd: std::path::PathBuf,
        #[arg(long, default_value_t = 128)]
        mem_mib: u64,
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// qemu-system-x86_64 to compare with.
        #[arg(long)]
        qemu: Option<std::path::PathBuf>,
        #[arg(long, default_value = "/tmp/vessel-bench")]
        work: std::path::PathBuf,
    },
    /// Enter the jail a spec describes (`"jail": true`), as `run` does, without booting:
    /// print as JSON what the VMM there can open and write, its pid, capabilities and
    /// no_new_privs, and the /proc it sees. An operator's check of the confinement.
    JailCheck {
        #[arg(long)]
        spec: std::path::PathBuf,
        /// Paths to open for reading.
        #[arg(long)]
        open: Vec<std::path::PathBuf>,
        /// Paths to open for writing (appending, not creating).
        #[arg(long)]
        write: Vec<std::path::PathBuf>,
        /// Stay this long in the jail after printing (to watch it from outside).
        #[arg(long, default_value_t = 0)]
        hold_ms: u64,
    },
    /// Listen on a Unix socket (a VM's `<uds>_<port>`) for one guest-initiated vsock
    /// connection and echo it back until EOF.
    VsockEcho {
        #[arg(long)]
        path: std::path::PathBuf,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("VESSEL_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Run { spec, timeout } => {
            let code = run(&spec, timeout)?;
            std::process::exit(code);
        }
        Cmd::VsockConnect {
            socket,
            port,
            send,
            echo_bytes,
            retry_ms,
        } => vsock_connect(&socket, port, send.as_deref(), echo_bytes, retry_ms),
        Cmd::VsockEcho { path } => vsock_echo(&path),
        Cmd::JailCheck {
            spec,
            open,
            write,
            hold_ms,
        } => jail_check(&spec, &open, &write, hold_ms),
        Cmd::Ctl {
            socket,
            request,
            fd_file,
        } => ctl(&socket, &request, fd_file.as_deref()),
        Cmd::Bench {
            kernel,
            vmlinux,
            initrd,
            mem_mib,
            runs,
            qemu,
            work,
        } => bench::bench(&bench::BenchArgs {
            kernel,
            vmlinux,
            initrd,
            mem_mib,
            runs,
            qemu,
            work,
        }),
        Cmd::Cleanup { spec } => {
            let cfg = vessel_shim::read_spec(&spec)?;
            for p in vessel_shim::cleanup(&cfg)? {
                println!("removed {}", p.display());
            }
            Ok(())
        }
        Cmd::Probe { json, device } => {
            let r = vessel_vmm::probe::probe_with(&vessel_vmm::probe::ProbeOptions {
                device,
                ..Default::default()
            });
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!("kvm: {}", r.verdict);
                println!("reason: {}", r.reason);
                if let Some(e) = &r.evidence {
                    println!(
                        "evidence: guest {:.3} ns/iter, native {:.3} ns/iter, ratio {:.1}x (threshold {}x), \
                         {} iterations, exit round trip {:.0} ns",
                        e.guest_ns_per_iter,
                        e.native_ns_per_iter,
                        e.ratio,
                        e.threshold_ratio,
                        e.guest_iterations,
                        e.exit_round_trip_ns
                    );
                }
                println!("probe took {:.0} ms", r.probe_ms);
            }
            std::process::exit(match r.verdict {
                vessel_vmm::probe::Verdict::Usable => 0,
                vessel_vmm::probe::Verdict::Unusable => 1,
                vessel_vmm::probe::Verdict::Absent => 2,
            });
        }
    }
}

/// CLOCK_MONOTONIC in nanoseconds (the clock `Instant` reads), comparable across processes.
pub fn monotonic_ns() -> u128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec to a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u128::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u128::try_from(ts.tv_nsec).unwrap_or(0)
}

fn run(spec: &std::path::Path, timeout: Option<f64>) -> Result<i32> {
    use std::time::{Duration, Instant};
    let start = Instant::now();
    // `vessel-shim bench` passes when it spawned us: the exec itself, as a boot phase.
    let exec_ms = std::env::var("VESSEL_BENCH_SPAWN_NS")
        .ok()
        .and_then(|t| t.parse::<u128>().ok())
        .map(|t| monotonic_ns().saturating_sub(t) as f64 / 1e6);
    // At most 4 malloc arenas, before any thread starts. Without a limit, past 8 arenas
    // glibc counts CPUs whenever a thread wants another, opening
    // /sys/devices/system/cpu/online from that thread: a vCPU or device worker, whose
    // seccomp list has no open (the nested suite saw it once, in a 10 MiB port-forward).
    // Fewer arenas also keep the VMM's heap smaller.
    // SAFETY: mallopt changes a malloc parameter; no thread but this one exists yet.
    if unsafe { libc::mallopt(libc::M_ARENA_MAX, 4) } != 1 {
        tracing::warn!("mallopt(M_ARENA_MAX) failed");
    }
    // SIGTERM/SIGINT are taken by a thread with sigwait; block them before any thread starts.
    let signals = [libc::SIGTERM, libc::SIGINT];
    // SAFETY: sigset_t is plain data initialised by sigemptyset before use; the set is only
    // read by pthread_sigmask and sigwait.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in signals {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    };
    let fail = |e: String| -> Result<i32> {
        eprintln!("vessel-shim: {e}");
        println!("{}", serde_json::json!({"outcome": "error", "detail": e}));
        Ok(1)
    };
    let mut cfg = vessel_shim::read_spec(spec)?;
    let jail = cfg
        .shim
        .jail
        .then(|| vessel_shim::jail::Plan::for_spec(&cfg, spec));
    if jail.is_some() {
        // From here on this is the VMM, pid 1 of its own pid namespace; the process vesseld
        // started waits for it outside.
        if let Err(e) = vessel_shim::jail::fork_into_pid_namespace() {
            return fail(e.to_string());
        }
    }
    if let Some(net) = &cfg.shim.pod_net {
        // A queue pair per vCPU (multiqueue virtio-net), up to the device's most.
        let queues = usize::from(cfg.vm.vcpus).clamp(1, vessel_vmm::virtio::net::MAX_QUEUE_PAIRS);
        match vessel_shim::podnet::plug(net, queues) {
            Ok(p) => {
                let mac = p.peer.map(|p| p.mac_string());
                let mtu = p.peer.map(|p| p.mtu);
                tracing::info!(netns = %net.netns.display(), tap = %net.tap, ?mac, ?mtu, queues, deferred = net.deferred, "pod network plugged");
                // The VM takes the tap fds over (spec `tap_fd`, `queue_fds`); it is the first
                // interface.
                let mut fds = p.taps.into_iter().map(std::os::fd::IntoRawFd::into_raw_fd);
                cfg.vm.nets.insert(
                    0,
                    vessel_vmm::vm::NetConfig {
                        tap: None,
                        tap_fd: fds.next(),
                        queue_fds: fds.collect(),
                        mac,
                        mtu,
                    },
                );
            }
            Err(e) => return fail(format!("pod network: {e}")),
        }
    }
    // Taps named in the spec are the host's: opened now, the jail has its own network.
    if jail.is_some() {
        for n in cfg.vm.nets.iter_mut() {
            // (With queue_fds, the VM refuses the net: they go with tap_fd.)
            if let (Some(name), None, true) = (&n.tap, n.tap_fd, n.queue_fds.is_empty()) {
                match vessel_vmm::virtio::net::open_tap(name) {
                    Ok(f) => {
                        n.tap_fd = Some(std::os::fd::IntoRawFd::into_raw_fd(f));
                        n.tap = None;
                    }
                    Err(e) => return fail(e.to_string()),
                }
            }
        }
    }
    // The pod's tap is open (above): nothing else outside the jail is needed.
    if let Some(plan) = &jail {
        if let Err(e) = vessel_shim::jail::confine(plan) {
            return fail(e.to_string());
        }
        tracing::debug!(?plan, "jailed");
    }
    let logs = std::sync::Arc::new(vessel_shim::logs::LogRouter::default());
    // The log listener is bound before the guest boots; these guards remove the sockets when
    // run() returns, however it ends.
    let log_socket = match cfg.log_socket() {
        Some(p) => match vessel_shim::logs::bind_private(&p) {
            Ok(x) => Some(x),
            Err(e) => return fail(format!("log socket: {e}")),
        },
        None => None,
    };
    let control_socket = match &cfg.shim.control_socket {
        Some(p) => match vessel_shim::logs::bind_private(p) {
            Ok(x) => Some(x),
            Err(e) => return fail(format!("control socket: {e}")),
        },
        None => None,
    };
    // Jailed: each vCPU, device worker and file server installs its own seccomp filter as
    // it starts (they start from here on), this thread the control list once the VM is built.
    let filters = if jail.is_some() {
        let console_file = matches!(cfg.vm.console, vessel_vmm::vm::Console::File(_));
        let f = vessel_shim::seccomp::Filters::new(cfg.shim.seccomp, console_file)
            .map(std::sync::Arc::new)
            .and_then(|f| vessel_shim::seccomp::arm(f.clone()).map(|()| f));
        match f {
            Ok(f) => Some(f),
            Err(e) => return fail(e.to_string()),
        }
    } else {
        None
    };
    let before_vm_ms = start.elapsed().as_secs_f64() * 1e3;
    let vm = match vessel_vmm::vm::Vm::new(&cfg.vm) {
        Ok(vm) => vm,
        Err(e) => return fail(e.to_string()),
    };
    // Where the time to the first vCPU entry went: the shim's own set-up (spec, network,
    // jail), each step of building the VM, and the rest (sockets, threads) in `built_ms`.
    // In order, as [name, ms] pairs.
    let mut phases = Vec::new();
    if let Some(ms) = exec_ms {
        phases.push(serde_json::json!(["exec", ms]));
    }
    phases.push(serde_json::json!(["shim", before_vm_ms]));
    for (name, d) in vm.build_phases().steps() {
        phases.push(serde_json::json!([name, d.as_secs_f64() * 1e3]));
    }
    // The virtio-fs servers have confined themselves: this thread, and every thread it
    // starts from now on (control, logs, vCPUs, signals), needs no capability.
    if let Err(e) = vessel_vmm::caps::drop_all() {
        return fail(format!("dropping capabilities: {e}"));
    }
    if let Some(f) = &filters {
        if let Err(e) = vessel_shim::seccomp::install_control(f) {
            return fail(e.to_string());
        }
        tracing::debug!(mode = ?cfg.shim.seccomp, "seccomp filters installed");
    }
    if let Some(p) = &cfg.shim.log_file {
        let (max, every) = (vessel_agent::logs::OWN_LOG_MAX, Duration::from_secs(10));
        if let Err(e) = vessel_agent::logs::bound_stderr(p.clone(), max, every) {
            tracing::warn!(error = %e, "no log rotation");
        }
    }
    let _log_socket = match log_socket {
        Some((l, guard)) => {
            vessel_shim::logs::serve(l, logs.clone(), cfg.shim.log_token.clone())?;
            Some(guard)
        }
        None => None,
    };
    let _control_socket = match control_socket {
        Some((l, guard)) => {
            let server = std::sync::Arc::new(vessel_shim::control::Server {
                disks: std::sync::Arc::new(vessel_shim::control::Slots(vm.disk_slots())),
                logs: logs.clone(),
                run: Some(vm.control()),
            });
            server.serve(l)?;
            Some(guard)
        }
        None => None,
    };
    let control = vm.control();
    let built_ms = start.elapsed().as_secs_f64() * 1e3;
    let running = vm.start()?;
    let handle = running.handle();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            // First SIGTERM/SIGINT: ask the guest to shut down (stop_timeout_ms, then stopped);
            // a second one stops it at once.
            let mut asked = false;
            loop {
                let mut sig: libc::c_int = 0;
                // SAFETY: `set` is a valid, initialised signal set and `sig` a valid out pointer.
                if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
                    return;
                }
                if asked {
                    tracing::info!(sig, "stopping the guest now");
                    handle.stop_now();
                } else {
                    tracing::info!(sig, "asking the guest to shut down");
                    handle.request_stop();
                    asked = true;
                }
            }
        })?;
    let outcome = running.wait(timeout.map(Duration::from_secs_f64));
    let events: serde_json::Map<String, serde_json::Value> = control
        .events()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                serde_json::json!(t.duration_since(start).as_secs_f64() * 1e3),
            )
        })
        .collect();
    let total_ms = start.elapsed().as_secs_f64() * 1e3;
    let mut out = serde_json::to_value(&outcome)?;
    out["built_ms"] = serde_json::json!(built_ms);
    out["build_phases_ms"] = serde_json::Value::Array(phases);
    out["total_ms"] = serde_json::json!(total_ms);
    out["events"] = serde_json::Value::Object(events);
    println!("{out}");
    Ok(vessel_shim::exit_code(&outcome))
}

/// One hybrid-vsock connection attempt: the stream after `OK`, or why not.
fn hybrid_connect(socket: &std::path::Path, port: u32) -> Result<std::os::unix::net::UnixStream> {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket)
        .with_context(|| format!("connecting to {}", socket.display()))?;
    s.write_all(format!("CONNECT {port}\n").as_bytes())?;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match s.read(&mut b)? {
            0 => bail!(
                "the guest refused the connection to vsock port {port} (nothing listening there?)"
            ),
            _ if b[0] == b'\n' => break,
            _ => line.push(b[0]),
        }
        if line.len() > 64 {
            bail!(
                "bad answer from {}: {:?}",
                socket.display(),
                String::from_utf8_lossy(&line)
            );
        }
    }
    let line = String::from_utf8_lossy(&line);
    if !line.starts_with("OK ") {
        bail!("bad answer from {}: {line:?}", socket.display());
    }
    Ok(s)
}

fn vsock_connect(
    socket: &std::path::Path,
    port: u32,
    send: Option<&str>,
    echo_bytes: Option<usize>,
    retry_ms: u64,
) -> Result<()> {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};
    let start = Instant::now();
    let deadline = start + Duration::from_millis(retry_ms);
    let mut s = loop {
        match hybrid_connect(socket, port) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("retrying: {e:#}");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e),
        }
    };
    let connected_ms = start.elapsed().as_secs_f64() * 1e3;
    if let Some(n) = echo_bytes {
        // i % 251 fits a u8.
        #[allow(clippy::cast_possible_truncation)]
        let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        let mut w = s.try_clone()?;
        let writer = std::thread::spawn(move || -> std::io::Result<()> {
            w.write_all(&data)?;
            w.shutdown(std::net::Shutdown::Write)
        });
        let mut back = Vec::with_capacity(n);
        s.read_to_end(&mut back)?;
        writer
            .join()
            .map_err(|_| anyhow::anyhow!("writer panicked"))??;
        let secs = start.elapsed().as_secs_f64() - connected_ms / 1e3;
        // i % 251 fits a u8.
        #[allow(clippy::cast_possible_truncation)]
        let ok = back.len() == n && back.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8);
        if !ok {
            bail!(
                "echo of {n} bytes came back as {} bytes, or different",
                back.len()
            );
        }
        println!(
            "echo ok {n} bytes in {:.1} ms ({:.1} MB/s)",
            secs * 1e3,
            n as f64 / secs / 1e6
        );
        return Ok(());
    }
    if let Some(msg) = send {
        s.write_all(msg.as_bytes())?;
        s.shutdown(std::net::Shutdown::Write)?;
    }
    let mut reply = Vec::new();
    s.read_to_end(&mut reply)?;
    eprintln!(
        "vsock-connect: connected in {connected_ms:.1} ms, reply after {:.1} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    std::io::stdout().write_all(&reply)?;
    println!();
    Ok(())
}

fn ctl(socket: &std::path::Path, request: &str, fd_file: Option<&std::path::Path>) -> Result<()> {
    use std::os::fd::AsFd;
    let req: serde_json::Value =
        serde_json::from_str(request).context("the request is not JSON")?;
    let file = fd_file
        .map(|p| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("opening {}", p.display()))
        })
        .transpose()?;
    let mut c = vessel_shim::control::Client::connect(socket)?;
    let answer = c.request(&req, file.as_ref().map(|f| f.as_fd()))?;
    println!("{answer}");
    if answer.get("ok") != Some(&serde_json::Value::Bool(true)) {
        std::process::exit(1);
    }
    Ok(())
}

fn vsock_echo(path: &std::path::Path) -> Result<()> {
    use std::io::{Read, Write};
    let l = std::os::unix::net::UnixListener::bind(path)
        .with_context(|| format!("binding {}", path.display()))?;
    let (mut s, _) = l.accept()?;
    let _ = std::fs::remove_file(path);
    let mut buf = [0u8; 65536];
    loop {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        s.write_all(&buf[..n])?;
    }
    Ok(())
}

/// On a thread of its own with `role`'s filters (installed as the VMM's threads install
/// them): whether it may open a file for reading, create one, and make a socket.
fn probe_role(
    filters: &std::sync::Arc<vessel_shim::seccomp::Filters>,
    role: vessel_vmm::threads::ThreadRole,
) -> Result<serde_json::Value> {
    let f = filters.clone();
    std::thread::spawn(move || -> Result<serde_json::Value> {
        f.install_for(role)?;
        let outcome = |r: std::io::Result<std::fs::File>| match r {
            Ok(_) => "ok".to_string(),
            Err(e) => e.to_string(),
        };
        let read = outcome(std::fs::File::open("/"));
        let create = outcome(
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open("/jail-check-probe"),
        );
        // SAFETY: socket(2) with integer arguments; a descriptor it returns is closed.
        let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
        let socket = if fd < 0 {
            std::io::Error::last_os_error().to_string()
        } else {
            // SAFETY: `fd` was just returned by socket(2) and is not used again.
            unsafe { libc::close(fd) };
            "ok".to_string()
        };
        Ok(serde_json::json!({"read": read, "create": create, "socket": socket}))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the {role} thread panicked"))?
}

fn jail_check(
    spec: &std::path::Path,
    open: &[std::path::PathBuf],
    write: &[std::path::PathBuf],
    hold_ms: u64,
) -> Result<()> {
    use std::io::Write;
    let cfg = vessel_shim::read_spec(spec)?;
    if !cfg.shim.jail {
        bail!("{}: the spec does not ask for a jail", spec.display());
    }
    let plan = vessel_shim::jail::Plan::for_spec(&cfg, spec);
    vessel_shim::jail::fork_into_pid_namespace()?;
    vessel_shim::jail::confine(&plan)?;
    let console_file = matches!(cfg.vm.console, vessel_vmm::vm::Console::File(_));
    let filters = std::sync::Arc::new(vessel_shim::seccomp::Filters::new(
        cfg.shim.seccomp,
        console_file,
    )?);
    vessel_shim::seccomp::arm(filters.clone())?;
    // As in the VMM: device workers and file servers start before the main thread takes
    // the control list, and have their own list only; vCPUs start after, and stack theirs
    // on it.
    use vessel_vmm::threads::ThreadRole;
    let mut threads = serde_json::Map::new();
    for role in [ThreadRole::Device, ThreadRole::FileServer] {
        threads.insert(role.to_string(), probe_role(&filters, role)?);
    }
    vessel_vmm::caps::drop_all()?;
    vessel_shim::seccomp::install_control(&filters)?;
    let vcpu = ThreadRole::Vcpu;
    threads.insert(vcpu.to_string(), probe_role(&filters, vcpu)?);
    let result = |r: std::io::Result<std::fs::File>| match r {
        Ok(_) => "ok".to_string(),
        Err(e) => e.to_string(),
    };
    let opened: serde_json::Map<String, serde_json::Value> = open
        .iter()
        .map(|p| {
            (
                p.display().to_string(),
                result(std::fs::File::open(p)).into(),
            )
        })
        .collect();
    let written: serde_json::Map<String, serde_json::Value> = write
        .iter()
        .map(|p| {
            let r = std::fs::OpenOptions::new().append(true).open(p);
            (p.display().to_string(), result(r).into())
        })
        .collect();
    let mut procs: Vec<String> = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    procs.sort();
    let namespaces: serde_json::Map<String, serde_json::Value> =
        ["pid", "mnt", "net", "ipc", "uts"]
            .iter()
            .map(|n| {
                let l = std::fs::read_link(format!("/proc/self/ns/{n}"))
                    .map(|l| l.display().to_string())
                    .unwrap_or_else(|e| e.to_string());
                (n.to_string(), l.into())
            })
            .collect();
    let errno = |r: libc::c_int| {
        if r < 0 {
            std::io::Error::last_os_error().to_string()
        } else {
            "ok".to_string()
        }
    };
    let argv = [c"/nonexistent".as_ptr(), std::ptr::null()];
    // SAFETY: a NUL-terminated path and a null-terminated argv/envp; if it ever ran, the
    // program would replace this check, which is what the output would then show.
    let execve = errno(unsafe { libc::execve(argv[0], argv.as_ptr(), argv[1..].as_ptr()) });
    // SAFETY: fork; a child, if one were made, leaves at once without running Rust code.
    let fork = match unsafe { libc::fork() } {
        // SAFETY: _exit in a forked child ends it without running anything of the parent's.
        0 => unsafe { libc::_exit(0) },
        r => errno(r),
    };
    // getpid through the x32 ABI (bit 30 of the number).
    // SAFETY: a system call without arguments, refused or answered.
    let r = unsafe { libc::syscall(0x4000_0000 | libc::SYS_getpid) };
    let x32 = errno(if r < 0 { -1 } else { 0 });
    let seccomp = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Seccomp:").map(|v| v.trim().to_string()))
        })
        .unwrap_or_default();
    // SAFETY: prctl with integer arguments only reads a flag.
    let nnp = unsafe { libc::prctl(libc::PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) };
    let out = serde_json::json!({
        "pid": std::process::id(),
        "host_pid": vessel_shim::host_pid(),
        "capabilities": vessel_vmm::caps::effective()?,
        "no_new_privs": nnp == 1,
        "open": opened,
        "write": written,
        "proc": procs,
        "namespaces": namespaces,
        "seccomp": seccomp,
        "execve": execve,
        "fork": fork,
        "x32": x32,
        "threads": threads,
    });
    println!("{out}");
    std::io::stdout().flush()?;
    std::thread::sleep(std::time::Duration::from_millis(hold_ms));
    Ok(())
}
