//! `vessel-agent`: a pod's PID 1. See the library docs.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "vessel-agent", version, about = "vessel's pod agent")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Runs a flat pod: the agent as PID 1 of new namespaces on the host.
    Flat(vessel_agent::flat::FlatArgs),
    /// Runs as a microVM's PID 1 (what `/init` does with no arguments).
    Vm,
    /// Debugging: talks to a VM agent through a shim's hybrid vsock socket.
    #[command(hide = true)]
    DebugClient(vessel_agent::debug_client::DebugArgs),
    /// Internal: one libcontainer operation, run by the agent in a fresh process.
    #[command(hide = true)]
    Libct(vessel_agent::libct::HelperArgs),
}

fn main() -> anyhow::Result<()> {
    // The guest kernel runs `/init` (this binary) with no subcommand as PID 1.
    if vessel_agent::vm::is_implicit() {
        std::process::exit(vessel_agent::vm::main());
    }
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Vm => std::process::exit(vessel_agent::vm::main()),
        Cmd::DebugClient(args) => std::process::exit(vessel_agent::debug_client::main(args)),
        Cmd::Flat(args) => {
            vessel_agent::flat::init_logging(&args.log_level);
            if let Err(e) = vessel_agent::flat::launch(args) {
                eprintln!("vessel-agent: {e}");
                std::process::exit(1);
            }
            Ok(())
        }
        Cmd::Libct(args) => {
            let level = std::env::var("VESSEL_AGENT_LOG").unwrap_or_else(|_| "info".into());
            vessel_agent::flat::init_helper_logging(&level);
            std::process::exit(vessel_agent::libct::helper_main(args));
        }
    }
}
