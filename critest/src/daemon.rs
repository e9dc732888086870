//! A real `vesseld` process on a temporary socket, root and state dir.

use crate::client::CriClient;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether `pid` is the process that started at `start_time` (clock ticks after boot,
/// `/proc/<pid>/stat` field 22) and not a zombie.
fn process_lives(pid: i32, start_time: u64) -> bool {
    let Ok(s) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The command name (field 2) may hold spaces and parentheses: fields after its end.
    let mut f = s
        .get(s.rfind(')').map_or(s.len(), |i| i + 2)..)
        .unwrap_or_default()
        .split_whitespace();
    let state = f.next().unwrap_or("Z");
    let started = f.nth(18).and_then(|x| x.parse::<u64>().ok());
    state != "Z" && state != "X" && started == Some(start_time)
}

/// A vesseld under test. Drop kills it and removes its directories (after unmounting
/// anything left below them, which a test should also assert never happens).
pub struct Vesseld {
    pub binary: PathBuf,
    pub dir: tempfile::TempDir,
    pub config_path: PathBuf,
    pub socket: PathBuf,
    child: Option<Child>,
    /// A command prefix vesseld runs under (e.g. `nsenter ... --`); empty: none.
    wrapper: Vec<String>,
}

impl Vesseld {
    /// Writes a config with `extra` TOML appended (e.g. registry settings) and starts vesseld.
    pub fn start(binary: &Path, extra_config: &str) -> std::io::Result<Vesseld> {
        Self::start_with(binary, "", extra_config)
    }

    /// Like [`Vesseld::start`], with `daemon_keys` added to the `[daemon]` table (metrics
    /// are off unless `daemon_keys` sets `metrics_address`).
    pub fn start_with(
        binary: &Path,
        daemon_keys: &str,
        extra_config: &str,
    ) -> std::io::Result<Vesseld> {
        Self::start_wrapped(binary, Vec::new(), daemon_keys, extra_config)
    }

    /// Like [`Vesseld::start_with`], running vesseld under the command prefix `wrapper`
    /// (e.g. [`crate::systemd::SystemdInstance::wrapper`]).
    pub fn start_wrapped(
        binary: &Path,
        wrapper: Vec<String>,
        daemon_keys: &str,
        extra_config: &str,
    ) -> std::io::Result<Vesseld> {
        let dir = tempfile::Builder::new().prefix("vessel-test-").tempdir()?;
        // Traversable, as /run is where vessel's state dir usually lives: a pod with its own
        // user namespace has its containers' roots under the state dir.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o711),
        )?;
        let socket = dir.path().join("vessel.sock");
        let config_path = dir.path().join("config.toml");
        let level = if daemon_keys.contains("log_level") {
            ""
        } else {
            "log_level = \"debug\"\n"
        };
        let metrics = if daemon_keys.contains("metrics_address") {
            ""
        } else {
            "metrics_address = \"\"\n"
        };
        let config = format!(
            "[daemon]\nsocket = \"{sock}\"\nroot_dir = \"{root}\"\nstate_dir = \"{state}\"\n{level}{metrics}{daemon_keys}\n{extra_config}\n",
            sock = socket.display(),
            root = dir.path().join("root").display(),
            state = dir.path().join("state").display(),
        );
        fs::write(&config_path, config)?;
        let mut v = Vesseld {
            binary: binary.to_path_buf(),
            dir,
            config_path,
            socket,
            child: None,
            wrapper,
        };
        v.spawn()?;
        Ok(v)
    }

    pub fn root_dir(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("vesseld.log")
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let mut cmd = match self.wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&self.binary);
                c
            }
            None => Command::new(&self.binary),
        };
        let child = cmd
            .arg("--config")
            .arg(&self.config_path)
            .arg("serve")
            .env(
                "RUST_LOG",
                std::env::var("VESSEL_TEST_RUST_LOG").unwrap_or_else(|_| {
                    "debug,h2=info,hyper=info,tower=info,reqwest=info,rustls=info,hyper_util=info"
                        .into()
                }),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        self.wait_ready(Duration::from_secs(20))
    }

    fn wait_ready(&mut self, timeout: Duration) -> std::io::Result<()> {
        let start = Instant::now();
        loop {
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return Ok(());
            }
            if let Some(c) = self.child.as_mut() {
                if let Some(status) = c.try_wait()? {
                    return Err(std::io::Error::other(format!(
                        "vesseld exited with {status} before serving; log:\n{}",
                        self.log()
                    )));
                }
            }
            if start.elapsed() > timeout {
                return Err(std::io::Error::other(format!(
                    "vesseld did not serve {} within {timeout:?}; log:\n{}",
                    self.socket.display(),
                    self.log()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub async fn client(&self) -> CriClient {
        CriClient::connect(&self.socket)
            .await
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.socket.display()))
    }

    /// Kills (-9) the host process of pod `id` (its agent, or its VM's shim) that the pod's
    /// record names, and waits (10 s at most, else panics) until it is gone; false where the
    /// record names none that lives (no record, or the pod was already stopping).
    pub fn kill_pod_host_process(&self, id: &str) -> bool {
        let record = self.root_dir().join("pods").join(id).join("pod.json");
        let Ok(text) = fs::read_to_string(record) else {
            return false;
        };
        let rec: serde_json::Value = serde_json::from_str(&text).expect("pod record is JSON");
        let pid = rec["agent_pid"]
            .as_u64()
            .and_then(|p| i32::try_from(p).ok());
        let start_time = rec["agent_start_time"].as_u64().unwrap_or(0);
        // Only the process the record names: a pid whose process ended may be another's now.
        let Some(pid) = pid.filter(|p| *p > 0 && process_lives(*p, start_time)) else {
            return false;
        };
        // SAFETY: kill(2) with the pid of the pod's host process (checked by its start time
        // just now) and a valid signal.
        if unsafe { libc::kill(pid, libc::SIGKILL) } != 0 {
            return false;
        }
        let start = Instant::now();
        // Dead, or a zombie until vesseld (its parent, or the reaper) waits for it.
        while process_lives(pid, start_time) {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "pid {pid} lives 10 s after SIGKILL"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    /// SIGKILL, as a crash would.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            if self.signal_wrapped(&c, libc::SIGKILL) {
                // The wrapper reaps vesseld and exits.
                let deadline = Instant::now() + Duration::from_secs(5);
                while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Under a wrapper (`nsenter` forks vesseld into the namespaces), signals vesseld itself:
    /// the wrapper passes no signal on. Whether there was a wrapper.
    fn signal_wrapped(&self, c: &Child, sig: libc::c_int) -> bool {
        if self.wrapper.is_empty() {
            return false;
        }
        let mut kids = Vec::new();
        if let Ok(rd) = fs::read_dir(format!("/proc/{}/task", c.id())) {
            for t in rd.flatten() {
                if let Ok(k) = fs::read_to_string(t.path().join("children")) {
                    kids.extend(k.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
                }
            }
        }
        for k in kids {
            // SAFETY: kill(2) of the wrapper's child, the vesseld this fixture started.
            unsafe {
                libc::kill(k, sig);
            }
        }
        true
    }

    /// SIGTERM and wait for a clean exit; returns the exit status.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        self.signal_wrapped(&c, libc::SIGTERM);
        // SAFETY: kill(2) with a pid we spawned and still own (not yet reaped) and a valid signal.
        unsafe {
            libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
        }
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(s)) = c.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = c.kill();
        c.wait().ok()
    }

    /// Starts the daemon again on the same config and state (after `kill9` or `stop`).
    pub fn restart(&mut self) -> std::io::Result<()> {
        if self.child.is_some() {
            self.kill9();
        }
        self.spawn()
    }

    /// Runs a `vesseld` subcommand with this daemon's config; returns (success, stdout+stderr).
    pub fn run_cli(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new(&self.binary)
            .arg("--config")
            .arg(&self.config_path)
            .args(args)
            .output()
            .expect("running vesseld subcommand");
        let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
        s.push_str(&String::from_utf8_lossy(&out.stderr));
        (out.status.success(), s)
    }
}

/// Kills every pod agent serving under `dir` and removes its pods' cgroups: pods outlive
/// vesseld by design, so a test that failed midway would otherwise leave them running.
pub fn kill_pods_under(dir: &Path) {
    let prefix = dir.to_string_lossy().to_string();
    if let Ok(rd) = fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(cmd) = fs::read(format!("/proc/{pid}/cmdline")) else {
                continue;
            };
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if (cmd.contains("vessel-agent") || cmd.contains("vessel-shim"))
                && cmd.contains(&prefix)
            {
                // SAFETY: kill(2) of a pod agent or VM shim this fixture's daemon started (its
                // command line names our temporary directory).
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
    }
    // Let the kernel tear down the killed pods' pid namespaces before removing cgroups.
    std::thread::sleep(Duration::from_millis(100));
    let pods: Vec<String> = fs::read_dir(dir.join("root/pods"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect()
        })
        .unwrap_or_default();
    if pods.is_empty() {
        return;
    }
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let roots: Vec<PathBuf> = info
        .lines()
        .filter(|l| l.contains(" - cgroup ") || l.contains(" - cgroup2 "))
        .filter_map(|l| l.split(' ').nth(4).map(PathBuf::from))
        .collect();
    for id in pods {
        for r in &roots {
            let top = r.join("vessel").join(&id);
            // Deepest first: rmdir only removes empty cgroups.
            let mut dirs = vec![];
            let mut stack = vec![top];
            while let Some(d) = stack.pop() {
                if let Ok(rd) = fs::read_dir(&d) {
                    for e in rd.flatten() {
                        if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                            stack.push(e.path());
                        }
                    }
                    dirs.push(d);
                }
            }
            dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
            for d in dirs {
                let _ = fs::remove_dir(d);
            }
        }
    }
}

impl Drop for Vesseld {
    fn drop(&mut self) {
        self.kill9();
        // `VESSEL_TEST_KEEP_LOGS=DIR` keeps the daemon's log past the test (e.g. to read a
        // nested harness run's timings): copied to DIR/vesseld-<test dir>.log.
        if let Some(keep) = std::env::var_os("VESSEL_TEST_KEEP_LOGS") {
            let name = self
                .dir
                .path()
                .file_name()
                .unwrap_or_default()
                .to_string_lossy();
            let to = Path::new(&keep).join(format!("vesseld-{name}.log"));
            if let Err(e) = fs::create_dir_all(&keep).and_then(|_| fs::copy(self.log_path(), &to)) {
                eprintln!("VESSEL_TEST_KEEP_LOGS: {}: {e}", to.display());
            }
        }
        kill_pods_under(self.dir.path());
        // Never follow a mount into the host: unmount whatever is left under our dir first.
        let mut mps = mounts_under(self.dir.path());
        mps.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in mps {
            if let Ok(c) = std::ffi::CString::new(m) {
                // SAFETY: umount2 with a valid NUL-terminated path; failure is ignored.
                unsafe {
                    libc::umount2(c.as_ptr(), libc::MNT_DETACH);
                }
            }
        }
    }
}

/// Mount points below `dir` (for leak checks).
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.to_string_lossy().to_string();
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with(&prefix))
        .map(str::to_string)
        .collect()
}

/// A private CNI network for tests: a conflist of `bridge` (a bridge of its own, host-local
/// IPAM over a random 10.88.x.0/24 with its store in a temp dir) + `portmap`, in a conf dir
/// of its own: what a cluster's network config has (the pod's `lo` is the runtime's to bring
/// up: vessel's agent does, containerd runs the `loopback` plugin itself). Drop deletes the
/// bridge.
pub struct TestCni {
    pub dir: tempfile::TempDir,
    pub bridge: String,
    /// e.g. "10.88.17"
    pub prefix: String,
    pub network: String,
    pub bin_dir: PathBuf,
}

impl TestCni {
    /// `None` (with the reason) when the plugins are not installed (`apt-get install
    /// containernetworking-plugins`).
    pub fn new() -> Result<TestCni, String> {
        let bin_dir = PathBuf::from("/usr/lib/cni");
        for p in ["bridge", "host-local", "portmap"] {
            if !bin_dir.join(p).exists() {
                return Err(format!(
                    "CNI plugin {p} not in {} (apt-get install containernetworking-plugins)",
                    bin_dir.display()
                ));
            }
        }
        let mut seed = [0u8; 8];
        let _ = fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut seed));
        let routes = Command::new("ip")
            .args(["-4", "route", "show"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
            .unwrap_or_default();
        let mut third = seed[0];
        for i in 0..=255u8 {
            let t = seed[0].wrapping_add(i);
            if !routes.contains(&format!("10.88.{t}.")) {
                third = t;
                break;
            }
        }
        let hex: String = seed[1..5].iter().map(|b| format!("{b:02x}")).collect();
        let bridge = format!("vtst{hex}");
        let network = format!("vessel-test-{hex}");
        let prefix = format!("10.88.{third}");
        let dir = tempfile::Builder::new()
            .prefix("vessel-cni-")
            .tempdir()
            .map_err(|e| e.to_string())?;
        fs::create_dir_all(dir.path().join("net.d")).map_err(|e| e.to_string())?;
        let conf = format!(
            r#"{{
  "cniVersion": "1.0.0",
  "name": "{network}",
  "plugins": [
    {{
      "type": "bridge",
      "bridge": "{bridge}",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {{
        "type": "host-local",
        "ranges": [[{{ "subnet": "{prefix}.0/24" }}]],
        "routes": [{{ "dst": "0.0.0.0/0" }}],
        "dataDir": "{ipam}"
      }}
    }},
    {{ "type": "portmap", "capabilities": {{ "portMappings": true }} }}
  ]
}}
"#,
            ipam = dir.path().join("ipam").display(),
        );
        fs::write(dir.path().join("net.d/10-vessel-test.conflist"), conf)
            .map_err(|e| e.to_string())?;
        Ok(TestCni {
            dir,
            bridge,
            prefix,
            network,
            bin_dir,
        })
    }

    /// The `[cni]` table for vesseld's config.
    pub fn config_toml(&self) -> String {
        format!(
            "[cni]\nconf_dir = \"{}\"\nbin_dirs = [\"{}\"]\n",
            self.dir.path().join("net.d").display(),
            self.bin_dir.display()
        )
    }

    /// IPs host-local has handed out and not released.
    pub fn allocated_ips(&self) -> Vec<String> {
        fs::read_dir(self.dir.path().join("ipam").join(&self.network))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().to_string())
                    .filter(|n| n.starts_with(&self.prefix))
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for TestCni {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .stderr(Stdio::null())
            .status();
    }
}

/// What the end-to-end suites start from: a local registry holding the busybox test image
/// (gzip) as `library/busybox:latest`, a vesseld (`binary`, config plus `extra_config`) that
/// has pulled it, a client, and the image's name. Keep the registry alive while testing.
pub async fn vesseld_with_busybox(
    binary: &Path,
    extra_config: &str,
) -> (crate::registry::Registry, Vesseld, CriClient, String) {
    let (reg, image) = busybox_registry().await.expect("registry with busybox");
    let v = Vesseld::start(binary, extra_config).expect("vesseld");
    let c = v.client().await;
    c.pull(&image).await.expect("pull busybox");
    (reg, v, c, image)
}

/// A registry on 127.0.0.1 serving the busybox test image as `library/busybox:latest`, and
/// that image's name.
pub async fn busybox_registry() -> anyhow::Result<(crate::registry::Registry, String)> {
    use vessel_images::push::{push_image, PushTarget};
    use vessel_images::testimages::{self, Compression};
    let reg = crate::registry::Registry::start(crate::registry::RegistryOptions::default())?;
    let img = testimages::busybox_image(Compression::Gzip);
    let mut t = PushTarget::new(&reg.url(), "library/busybox");
    t.insecure_tls = true;
    push_image(&t, &img, Some("latest")).await?;
    let image = format!("{}/library/busybox:latest", reg.host());
    Ok((reg, image))
}

/// Why CRIU cannot checkpoint on this machine, if it cannot: none installed, or `criu check`
/// fails on this kernel (`scripts/criu.sh` installs one that works). Looked for where the
/// agent looks: `PATH` and the sbin directories.
pub fn criu_unusable() -> Option<String> {
    let path = format!(
        "{}:/usr/local/sbin:/usr/sbin:/sbin",
        std::env::var("PATH").unwrap_or_default()
    );
    let version = std::process::Command::new("criu")
        .arg("--version")
        .env("PATH", &path)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    let v: Vec<u32> = version
        .lines()
        .find_map(|l| l.strip_prefix("Version: "))
        .unwrap_or_default()
        .split('.')
        .map_while(|p| p.trim().parse().ok())
        .collect();
    if !v.is_empty() && v < vec![4, 2] {
        // `criu check` passes, but inet sockets cannot be dumped on 6.16+ kernels.
        return Some(format!(
            "CRIU {} is older than 4.2; scripts/criu.sh installs 4.2.1",
            version.trim()
        ));
    }
    match std::process::Command::new("criu")
        .arg("check")
        .env("PATH", path)
        .output()
    {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "`criu check` failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("no criu ({e}); scripts/criu.sh installs one")),
    }
}

/// Defines the end-to-end tests' harness type `$name` in the calling test crate: a registry
/// serving the busybox test images, a vesseld, a CRI client to it, the busybox image's name
/// and a directory for pod logs. Each test crate adds its own helper methods to the type
/// (which it can, the type being its own).
#[macro_export]
macro_rules! e2e_harness {
    ($name:ident) => {
        struct $name {
            _reg: $crate::registry::Registry,
            v: $crate::daemon::Vesseld,
            c: $crate::client::CriClient,
            image: String,
            logs: $crate::tempfile::TempDir,
        }

        impl $name {
            /// Starts the registry and `vesseld` (with `extra` TOML in its config).
            async fn launch(vesseld: &std::path::Path, extra: &str) -> $name {
                let (reg, v, c, image) = $crate::daemon::vesseld_with_busybox(vesseld, extra).await;
                $name {
                    _reg: reg,
                    v,
                    c,
                    image,
                    logs: $crate::tempfile::tempdir().expect("a temporary log directory"),
                }
            }
        }
    };
}
