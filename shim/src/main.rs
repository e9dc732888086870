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
