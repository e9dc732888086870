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

fn init_logging(c: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!(
            "{lvl},h2=warn,hyper=warn,tower=warn,reqwest=warn,rustls=warn",
            lvl = c.daemon.log_level
        ))
    });
    // Colours only on a terminal: a log file or the journal gets plain text.
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match c.daemon.log_format {
        LogFormat::Json => b.json().init(),
        LogFormat::Text => b.init(),
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
        Cmd::Serve => {
            let c = load_config(&cli)?;
            init_logging(&c);
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .worker_threads(2)
                .max_blocking_threads(32)
                .thread_name("vesseld")
                .build()
                .context("starting the async runtime")?;
            rt.block_on(async {
                let d = vessel_cri::server::Daemon::open(c).context("starting vesseld")?;
                d.serve(vessel_cri::server::shutdown_signal())
                    .await
                    .context("vesseld stopped with an error")
            })
        }
    }
}
