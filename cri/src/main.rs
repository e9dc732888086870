//! `vesseld`: the vessel CRI daemon and its operator subcommands.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use vessel_cri::config::{Config, LogFormat, DEFAULT_CONFIG};

/// The config read when `--config` is not given, if it exists.
const DEFAULT_CONFIG_PATH: &str = "/etc/vessel/config.toml";

#[derive(Parser)]
#[command(
    name = "vesseld",
    version,
    about = "vessel: a CRI runtime whose pods run in microVMs"
)]
struct Cli {
    /// Configuration file (TOML). Default: /etc/vessel/config.toml if present, else built-in defaults.
    #[arg(long, short = 'c', global = true)]
    config: Option<PathBuf>,
    /// Drop-in directory: its `*.toml` files are merged over the configuration file, in name
    /// order. Default: `config.d` beside the configuration file (/etc/vessel/config.d).
    #[arg(long, global = true)]
    config_dir: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve CRI on the configured socket (the default when no subcommand is given).
    Serve,
    /// Configuration helpers.
    Config {
        #[command(subcommand)]
        cmd: ConfigCmd,
    },
    /// Check this node for what vessel needs (KVM, cgroups, CNI, guest kernel, mirrors) and
    /// say what to fix; exits 1 when pods cannot run as configured.
    Doctor {
        /// Skip the KVM probe (it boots a calibration guest, a second or so).
        #[arg(long)]
        no_kvm_probe: bool,
    },
    /// Image store operations that work without a registry.
    Image {
        #[command(subcommand)]
        cmd: ImageCmd,
    },
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// Print the documented default configuration.
    Default,
    /// Validate the configuration and print it as vesseld will use it.
    Check,
    /// Print the merged configuration (file, then drop-ins) with the files it came from.
    Dump,
}

#[derive(Subcommand)]
enum ImageCmd {
    /// Import an OCI image layout (directory or tarball) or a `docker save` archive
    /// (optionally gzip/zstd-compressed) into the image store, for air-gapped nodes.
    Import {
        /// The archive or layout directory.
        path: PathBuf,
        /// Name the imported image (e.g. registry.local/app:v1), in addition to its own names.
        #[arg(long)]
        tag: Option<String>,
    },
    /// List the images in the store.
    #[command(alias = "ls")]
    List,
}

/// The configuration file (if any) and the drop-in files vesseld reads, in merge order.
fn config_sources(cli: &Cli) -> Result<(Option<PathBuf>, Vec<PathBuf>)> {
    let main = match &cli.config {
        Some(p) => Some(p.clone()),
        None if Path::new(DEFAULT_CONFIG_PATH).exists() => Some(PathBuf::from(DEFAULT_CONFIG_PATH)),
        None => None,
    };
    let dir = cli.config_dir.clone().unwrap_or_else(|| {
        vessel_cri::config::dropin_dir(main.as_deref().unwrap_or(Path::new(DEFAULT_CONFIG_PATH)))
    });
    let dropins = vessel_cri::config::dropins(&dir)?;
    Ok((main, dropins))
}

fn load_config(cli: &Cli) -> Result<Config> {
    let (main, dropins) = config_sources(cli)?;
    Ok(Config::load_layers(main.as_deref(), &dropins)?)
}

/// Sets the log level at run time (SIGHUP); `None` when `RUST_LOG` fixes it.
type SetLogLevel = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

fn log_filter(level: &str) -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::new(format!(
        "{level},h2=warn,hyper=warn,tower=warn,reqwest=warn,rustls=warn"
    ))
}

fn init_logging(c: &Config) -> Option<SetLogLevel> {
    let from_env = tracing_subscriber::EnvFilter::try_from_default_env().ok();
    let fixed = from_env.is_some();
    let filter = from_env.unwrap_or_else(|| log_filter(&c.daemon.log_level));
    // Colours only on a terminal: a log file or the journal gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    use tracing_subscriber::prelude::*;
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let fmt = match c.daemon.log_format {
        LogFormat::Json => fmt.json().boxed(),
        LogFormat::Text => fmt.boxed(),
    };
    tracing_subscriber::registry().with(filter).with(fmt).init();
    let set: SetLogLevel =
        Box::new(move |l| handle.reload(log_filter(l)).map_err(|e| e.to_string()));
    (!fixed).then_some(set)
}

/// The config keys (dotted) whose values differ between `a` and `b`.
fn changed_keys(a: &Config, b: &Config) -> Vec<String> {
    fn flat(prefix: &str, v: &toml::Value, out: &mut std::collections::BTreeMap<String, String>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    flat(&key, v, out);
                }
            }
            v => {
                out.insert(prefix.to_string(), v.to_string());
            }
        }
    }
    let (mut fa, mut fb) = (Default::default(), Default::default());
    flat(
        "",
        &toml::Value::try_from(a).unwrap_or(toml::Value::Boolean(false)),
        &mut fa,
    );
    flat(
        "",
        &toml::Value::try_from(b).unwrap_or(toml::Value::Boolean(false)),
        &mut fb,
    );
    let mut keys: Vec<String> = fa
        .keys()
        .chain(fb.keys())
        .filter(|k| fa.get(*k) != fb.get(*k))
        .cloned()
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// On SIGHUP: reads the configuration again (file and drop-ins) and applies what can change
/// at run time, the log level and the registry settings; says which other changed keys wait
/// for a restart. A configuration that does not load changes nothing.
async fn reload_on_sighup(
    cli: Cli,
    started: Config,
    puller: std::sync::Arc<vessel_images::Puller>,
    set_log_level: Option<SetLogLevel>,
) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hup = match signal(SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGHUP: configuration reload disabled");
            return;
        }
    };
    let mut applied = started.clone();
    while hup.recv().await.is_some() {
        let mut new = match load_config(&cli) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %format!("{e:#}"), "SIGHUP: configuration not reloaded; nothing changed");
                continue;
            }
        };
        if new.daemon.log_level != applied.daemon.log_level {
            match &set_log_level {
                Some(set) => match set(&new.daemon.log_level) {
                    Ok(()) => {
                        tracing::info!(level = %new.daemon.log_level, "SIGHUP: log level set")
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "SIGHUP: cannot set the log level");
                        // Not applied: the next SIGHUP tries again.
                        new.daemon.log_level = applied.daemon.log_level.clone();
                    }
                },
                None => tracing::warn!(
                    "SIGHUP: RUST_LOG sets the log filter; daemon.log_level is not applied"
                ),
            }
        }
        let (pull, was) = (new.pull_config(), applied.pull_config());
        if pull.registries != was.registries {
            puller.set_registries(pull.registries);
            tracing::info!("SIGHUP: registry settings applied to new pulls");
        }
        if pull.auth_file != was.auth_file {
            puller.set_auth_file(pull.auth_file);
            tracing::info!("SIGHUP: the auth file applies to new pulls");
        }
        let restart: Vec<String> = changed_keys(&started, &new)
            .into_iter()
            .filter(|k| {
                k != "daemon.log_level"
                    && k != "images.auth_file"
                    && !k.starts_with("images.registries")
            })
            .collect();
        if !restart.is_empty() {
            tracing::warn!(keys = ?restart, "SIGHUP: these changes take effect at the next restart of vesseld");
        }
        applied = new;
        tracing::info!("SIGHUP: configuration reloaded");
    }
}

/// At most two glibc malloc arenas for the daemon's threads. By default glibc gives threads
/// that allocate at once their own arenas (up to 8 per CPU), and each arena keeps what was
/// freed in it: after a burst of pods vesseld's anonymous memory was 5.4-6.2 MiB, with two
/// arenas 4.7-5.2 MiB (RSS 18.7 -> 17.6 MiB, medians; lifecycle bench, results in
/// benches/results/lifecycle-arenas-before-after-vm-2026-11-27.json). vesseld waits far more
/// than it allocates: latencies stayed within the runs' noise. Child processes keep glibc's
/// defaults.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets a tunable of glibc's allocator; M_ARENA_MAX may be set at
        // any time (arenas that exist stay; no more are made beyond the limit).
        let ok = unsafe { libc::mallopt(libc::M_ARENA_MAX, 2) };
        if ok != 1 {
            tracing::debug!("mallopt(M_ARENA_MAX) refused; glibc's default arenas stay");
        }
    }
}

fn main() -> Result<()> {
    let mut cli = Cli::parse();
    let cmd = cli.cmd.take().unwrap_or(Cmd::Serve);
    match cmd {
        Cmd::Config {
            cmd: ConfigCmd::Default,
        } => {
            print!("{DEFAULT_CONFIG}");
            Ok(())
        }
        Cmd::Config {
            cmd: ConfigCmd::Dump,
        } => {
            let (main, dropins) = config_sources(&cli)?;
            let c = Config::load_layers(main.as_deref(), &dropins)?;
            println!("# vesseld configuration, merged in this order:");
            println!("#   built-in defaults");
            for p in main.iter().chain(dropins.iter()) {
                println!("#   {}", p.display());
            }
            print!("{}", toml::to_string_pretty(&c).context("printing config")?);
            Ok(())
        }
        Cmd::Config {
            cmd: ConfigCmd::Check,
        } => {
            let c = load_config(&cli)?;
            print!("{}", toml::to_string_pretty(&c).context("printing config")?);
            Ok(())
        }
        Cmd::Image { cmd } => {
            let c = load_config(&cli)?;
            init_logging(&c);
            let store = c
                .open_image_store()
                .with_context(|| format!("opening image store {}", c.image_root().display()))?;
            match cmd {
                ImageCmd::Import { path, tag } => {
                    let opts = vessel_images::import::ImportOptions {
                        platform: c.pull_config().platform,
                        tag,
                    };
                    let recs = vessel_images::import::import(&store, &path, &opts)
                        .with_context(|| format!("importing {}", path.display()))?;
                    for r in recs {
                        println!("imported {} {}", r.id, r.repo_tags.join(" "));
                    }
                }
                ImageCmd::List => {
                    println!("{:<20} {:>10}  TAGS", "IMAGE ID", "SIZE");
                    for r in store.list()? {
                        println!(
                            "{:<20} {:>10}  {}",
                            &r.id.hex()[..13],
                            r.size,
                            r.repo_tags.join(" ")
                        );
                    }
                }
            }
            Ok(())
        }
        Cmd::Doctor { no_kvm_probe } => {
            let c = load_config(&cli)?;
            let checks = vessel_cri::doctor::run(&c, !no_kvm_probe);
            let (text, ok) = vessel_cri::doctor::report(&checks);
            print!("{text}");
            if !ok {
                std::process::exit(1);
            }
            Ok(())
        }
        Cmd::Serve => {
            let c = load_config(&cli)?;
            let set_log_level = init_logging(&c);
            limit_malloc_arenas();
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .worker_threads(2)
                .max_blocking_threads(32)
                .thread_name("vesseld")
                .build()
                .context("starting the async runtime")?;
            rt.block_on(async {
                let d = vessel_cri::server::Daemon::open(c.clone()).context("starting vesseld")?;
                tokio::spawn(reload_on_sighup(cli, c, d.puller.clone(), set_log_level));
                d.serve(vessel_cri::server::shutdown_signal())
                    .await
                    .context("vesseld stopped with an error")
            })
        }
    }
}
