//! `vessel-critest`: the CRI conformance suite against any CRI runtime (vessel, containerd).
//!
//! Prints one line per spec (`PASS`/`FAIL`/`SKIP [group] name ...`) and a closing
//! `N passed, N failed, N skipped` line; exits 1 if any spec failed.

use anyhow::Context as _;
use clap::Parser;
use std::time::Duration;
use vessel_critest::suite;

#[derive(Parser, Debug)]
#[command(
    name = "vessel-critest",
    about = "CRI conformance suite for any CRI runtime"
)]
struct Args {
    /// The runtime service endpoint, `unix:///path.sock`.
    #[arg(long)]
    endpoint: String,
    /// The image service endpoint (default: --endpoint).
    #[arg(long)]
    image_endpoint: Option<String>,
    /// HOST:PORT of a plain-HTTP registry for the test images (pushed there unless
    /// --no-push). Without it a local docker-registry is started on 127.0.0.1.
    #[arg(long)]
    registry: Option<String>,
    /// Do not push the test images to --registry (they are there already).
    #[arg(long)]
    no_push: bool,
    /// Runtime handler for the pods ("" = the runtime's default).
    #[arg(long, default_value = "")]
    runtime_handler: String,
    /// The pods are VM pods: specs a VM pod cannot meet by design are skipped, marked so.
    #[arg(long)]
    vm: bool,
    /// Only specs whose "[group] name" matches (a regex, or a plain substring).
    #[arg(long)]
    focus: Option<String>,
    /// Leave out specs whose "[group] name" contains this (repeatable).
    #[arg(long)]
    skip: Vec<String>,
    /// Specs run at once.
    #[arg(long, default_value_t = 1)]
    parallel: usize,
    /// Each spec's time limit, in seconds.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// List the specs and exit.
    #[arg(long)]
    list: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let mut cfg = suite::Config::new(a.endpoint);
    cfg.image_endpoint = a.image_endpoint;
    cfg.registry = a.registry;
    cfg.push_images = !a.no_push;
    cfg.runtime_handler = a.runtime_handler;
    cfg.vm_pods = a.vm;
    cfg.focus = a.focus;
    cfg.skip = a.skip;
    cfg.parallel = a.parallel;
    cfg.spec_timeout = Duration::from_secs(a.timeout);
    if a.list {
        for s in suite::select(&cfg)? {
            match s.vm_by_design {
                Some(why) => println!("{} (VM pods: {why})", s.full_name()),
                None => println!("{}", s.full_name()),
            }
        }
        return Ok(());
    }
    let summary = suite::run(cfg).await?;
    if let Some(p) = a.json {
        std::fs::write(&p, serde_json::to_vec_pretty(&summary)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if summary.failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
