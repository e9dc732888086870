//! `vessel-shim`: one host process per microVM.

use anyhow::Result;
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
    /// (0 poweroff, 10 reboot, 11 panic, 12 stopped by SIGTERM/SIGINT, 1 error).
    /// Prints one JSON line on stdout: the outcome and the times (ms since start) of
    /// `vessel-event: NAME` lines the guest printed on its console.
    Run {
        #[arg(long)]
        spec: std::path::PathBuf,
        /// Stop the guest after this many seconds.
        #[arg(long)]
        timeout: Option<f64>,
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

fn run(spec: &std::path::Path, timeout: Option<f64>) -> Result<i32> {
    use std::time::{Duration, Instant};
    let start = Instant::now();
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
    let cfg = vessel_shim::read_spec(spec)?;
    let vm = match vessel_vmm::vm::Vm::new(&cfg) {
        Ok(vm) => vm,
        Err(e) => {
            eprintln!("vessel-shim: {e}");
            println!(
                "{}",
                serde_json::json!({"outcome": "error", "detail": e.to_string()})
            );
            return Ok(1);
        }
    };
    let control = vm.control();
    let built_ms = start.elapsed().as_secs_f64() * 1e3;
    let running = vm.start()?;
    let c2 = control.clone();
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` is a valid, initialised signal set and `sig` a valid out pointer.
            if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
                tracing::info!(sig, "stopping the guest");
                c2.finish(vessel_vmm::vm::Outcome::Stopped);
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
    out["total_ms"] = serde_json::json!(total_ms);
    out["events"] = serde_json::Value::Object(events);
    println!("{out}");
    Ok(vessel_shim::exit_code(&outcome))
}
