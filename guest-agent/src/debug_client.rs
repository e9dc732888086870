//! `vessel-agent debug-client` (hidden): a small client of a VM agent through the shim's
//! hybrid vsock socket, for the VM test harness and for poking at a guest by hand.
//!
//! - `ping`: prints `ping ok pid=<n> version=<v> hostname=<h>`.
//! - `run --disk SERIAL... [--hostname H] [--write-file GUESTPATH=TEXT]... [--bind SRC:DST]...
//!   -- ARGS...`: configures the sandbox, writes the files, creates a container from the layer
//!   disks with its logs sent over vsock to `<uds>_<log-port>` (listened on here), starts it,
//!   waits, deletes it; prints `log: <CRI line>` for each log line received and
//!   `exit <code>`.
//! - `shutdown`: asks the guest to stop (it powers off).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;
use tokio::io::AsyncBufReadExt;

use crate::proto;

/// `vessel-agent debug-client` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct DebugArgs {
    /// The shim's hybrid vsock socket.
    #[arg(long)]
    pub hybrid_vsock: PathBuf,
    /// The agent's vsock port.
    #[arg(long, default_value_t = crate::vsock::AGENT_PORT)]
    pub port: u32,
    /// How long to keep trying to reach the agent (the guest boots meanwhile).
    #[arg(long, default_value_t = 60)]
    pub wait_secs: u64,
    #[command(subcommand)]
    pub cmd: DebugCmd,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum DebugCmd {
    Ping,
    Shutdown,
    Run {
        #[arg(long, default_value = "debug")]
        id: String,
        /// Layer disk serials, bottom first.
        #[arg(long = "disk", required = true)]
        disks: Vec<String>,
        #[arg(long, default_value_t = crate::vsock::LOG_PORT)]
        log_port: u32,
        #[arg(long)]
        hostname: Option<String>,
        /// GUESTPATH=TEXT, written with WriteFiles first.
        #[arg(long = "write-file")]
        files: Vec<String>,
        /// SRC:DST read-only bind mounts.
        #[arg(long = "bind")]
        binds: Vec<String>,
        /// Shut the guest down afterwards.
        #[arg(long)]
        shutdown: bool,
        #[arg(last = true, required = true)]
        args: Vec<String>,
    },
}

type Error = Box<dyn std::error::Error + Send + Sync>;

/// Runs the client; returns the process exit code.
pub fn main(args: DebugArgs) -> i32 {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("debug-client: runtime: {e}");
            return 1;
        }
    };
    match rt.block_on(run(args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("debug-client: {e}");
            1
        }
    }
}

fn spec(args: &[String], binds: &[String], id: &str) -> Result<Vec<u8>, Error> {
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc",
               "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts",
               "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
               "options": ["nosuid", "noexec", "nodev", "ro"]}),
    ];
    for b in binds {
        let (src, dst) = b
            .split_once(':')
            .ok_or_else(|| format!("--bind {b:?}: want SRC:DST"))?;
        mounts.push(json!({"destination": dst, "type": "bind", "source": src,
                           "options": ["rbind", "ro"]}));
    }
    let caps = [
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FOWNER",
        "CAP_KILL",
        "CAP_SETUID",
        "CAP_SETGID",
    ];
    let spec = json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "noNewPrivileges": true
        },
        "root": {"path": "rootfs", "readonly": false},
        "mounts": mounts,
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
            "cgroupsPath": format!("/vessel/debug/{id}"),
            "resources": {"devices": [{"allow": false, "access": "rwm"}],
                          "pids": {"limit": 100}},
            "maskedPaths": ["/proc/kcore", "/proc/keys"],
            "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger"]
        }
    });
    Ok(serde_json::to_vec(&spec)?)
}

/// Accepts log connections on `path` and prints their lines until `stop`.
async fn log_listener(path: &Path) -> Result<tokio::task::JoinHandle<()>, Error> {
    let _ = std::fs::remove_file(path);
    let l = tokio::net::UnixListener::bind(path)?;
    Ok(tokio::spawn(async move {
        let mut readers = Vec::new();
        // The agent opens one connection per container: take the first and read it to EOF.
        if let Ok((s, _)) = l.accept().await {
            readers.push(tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::new(s).lines();
                let mut first = true;
                while let Ok(Some(line)) = lines.next_line().await {
                    if first {
                        println!("log-id: {line}");
                        first = false;
                    } else {
                        println!("log: {line}");
                    }
                }
            }));
        }
        for r in readers {
            let _ = r.await;
        }
    }))
}

async fn run(a: DebugArgs) -> Result<i32, Error> {
    let t0 = std::time::Instant::now();
    let mut c = crate::client::connect_hybrid_vsock_retry(
        &a.hybrid_vsock,
        a.port,
        Duration::from_secs(a.wait_secs),
        Duration::from_millis(50),
    )
    .await?;
    let p = c.ping(proto::PingRequest {}).await?.into_inner();
    println!(
        "ping ok pid={} version={} hostname={} after={}ms",
        p.pid,
        p.version,
        p.hostname,
        t0.elapsed().as_millis()
    );
    match a.cmd {
        DebugCmd::Ping => Ok(0),
        DebugCmd::Shutdown => {
            c.shutdown(proto::ShutdownRequest {}).await?;
            println!("shutdown ok");
            Ok(0)
        }
        DebugCmd::Run {
            id,
            disks,
            log_port,
            hostname,
            files,
            binds,
            shutdown,
            args,
        } => {
            if let Some(h) = hostname {
                c.configure_sandbox(proto::ConfigureSandboxRequest {
                    hostname: h,
                    sysctls: [("net.ipv4.ip_forward".to_string(), "1".to_string())].into(),
                    ..Default::default()
                })
                .await?;
                let p = c.ping(proto::PingRequest {}).await?.into_inner();
                println!("configured hostname={}", p.hostname);
            }
            let mut entries = Vec::new();
            for f in &files {
                let (path, text) = f
                    .split_once('=')
                    .ok_or_else(|| format!("--write-file {f:?}: want PATH=TEXT"))?;
                entries.push(proto::FileEntry {
                    path: path.into(),
                    mode: 0o644,
                    uid: 0,
                    gid: 0,
                    kind: Some(proto::file_entry::Kind::Data(text.as_bytes().to_vec())),
                });
            }
            if !entries.is_empty() {
                c.write_files(proto::WriteFilesRequest { entries }).await?;
                println!("files written");
            }
            let mut log_path = a.hybrid_vsock.clone().into_os_string();
            log_path.push(format!("_{log_port}"));
            let logs = log_listener(Path::new(&log_path)).await?;
            c.create_container(proto::CreateContainerRequest {
                id: id.clone(),
                oci_spec: spec(&args, &binds, &id)?,
                rootfs: Some(proto::Rootfs {
                    kind: Some(proto::rootfs::Kind::Disks(proto::DiskLayersRootfs {
                        serials: disks,
                    })),
                }),
                log_vsock_port: log_port,
                ..Default::default()
            })
            .await?;
            let started = c
                .start_container(proto::StartContainerRequest { id: id.clone() })
                .await?
                .into_inner();
            println!("started pid={}", started.pid);
            let exit = c
                .wait_container(proto::WaitContainerRequest { id: id.clone() })
                .await?
                .into_inner()
                .exit
                .unwrap_or_default();
            c.delete_container(proto::DeleteContainerRequest { id: id.clone() })
                .await?;
            let _ = tokio::time::timeout(Duration::from_secs(5), logs).await;
            let _ = std::fs::remove_file(&log_path);
            println!("exit {}", exit.exit_code);
            if shutdown {
                c.shutdown(proto::ShutdownRequest {}).await?;
                println!("shutdown ok");
            }
            Ok(0)
        }
    }
}
