//! Test harness: a real `vessel-agent flat` on a temporary socket and state dir, a busybox
//! rootfs, a small OCI spec builder, and leak checks.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tonic::transport::Channel;
use vessel_agent::proto::agent_client::AgentClient;
use vessel_agent::proto::{self, rootfs};

pub type Client = AgentClient<Channel>;

/// A random-ish token for cgroup paths and names.
pub fn token() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{:x}{:x}{}",
        std::process::id(),
        t,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// One agent under test. Dropping it kills the agent and removes everything.
pub struct TestAgent {
    pub tmp: tempfile::TempDir,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    pub lower: PathBuf,
    pub logs: PathBuf,
    pub pid: i32,
    pub hostname: String,
    /// cgroup parent for this test's containers: `/vessel-test-<token>`, a top-level cgroup of
    /// its own (a shared parent removed by one test's cleanup raced another's creation).
    pub cgroup_parent: String,
    pub agent_log: PathBuf,
}

impl TestAgent {
    pub fn start() -> TestAgent {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> TestAgent {
        // Agents are reparented to us when their launcher exits, so we can reap them.
        // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes integer arguments only.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        let tmp = tempfile::Builder::new().prefix("vat").tempdir().unwrap();
        let socket = tmp.path().join("agent.sock");
        let state_dir = tmp.path().join("state");
        let lower = tmp.path().join("lower");
        let logs = tmp.path().join("logs");
        std::fs::create_dir_all(&lower).unwrap();
        let tar = vessel_images::testimages::busybox_rootfs().finish();
        vessel_images::unpack::unpack_layer(
            &tar[..],
            &lower,
            &vessel_images::unpack::UnpackOptions {
                lowers: vec![],
                same_owner: true,
                skip_sync: false,
                ..Default::default()
            },
        )
        .unwrap();
        let hostname = format!("pod-{}", &token()[..8]);
        let agent_log = tmp.path().join("agent.log");
        let log_file = std::fs::File::create(&agent_log).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vessel-agent"));
        cmd.args(["flat", "--socket"])
            .arg(&socket)
            .arg("--state-dir")
            .arg(&state_dir)
            .args(["--hostname", &hostname, "--log-level", "debug"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file);
        let mut child = cmd.spawn().unwrap();
        // The whole of stdout is one READY line: neither the agent nor its containers keep
        // the launcher's stdout pipe open, so this reaches EOF.
        let mut line = String::new();
        let mut rest = String::new();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        out.read_line(&mut line).unwrap();
        std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
        assert!(rest.is_empty(), "{rest:?}");
        let status = child.wait().unwrap();
        let agent_log_text = std::fs::read_to_string(&agent_log).unwrap_or_default();
        assert!(
            status.success(),
            "launcher failed: {status}; log:\n{agent_log_text}"
        );
        let pid: i32 = line
            .strip_prefix("READY ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("bad READY line {line:?}; log:\n{agent_log_text}"));
        assert!(line.ends_with('\n'));
        TestAgent {
            tmp,
            socket,
            state_dir,
            lower,
            logs,
            pid,
            hostname,
            cgroup_parent: format!("/vessel-test-{}", token()),
            agent_log,
        }
    }

    pub async fn client(&self) -> Client {
        vessel_agent::client::connect_unix(&self.socket)
            .await
            .unwrap()
    }

    pub fn cgroups_path(&self, id: &str) -> String {
        format!("{}/{id}", self.cgroup_parent)
    }

    pub fn log_path(&self, id: &str) -> PathBuf {
        self.logs.join(format!("{id}/0.log"))
    }

    /// An overlay rootfs over the busybox lower dir with per-container upper/work dirs.
    pub fn overlay(&self, id: &str) -> proto::Rootfs {
        let d = self.tmp.path().join("rw").join(id);
        std::fs::create_dir_all(d.join("upper")).unwrap();
        std::fs::create_dir_all(d.join("work")).unwrap();
        proto::Rootfs {
            kind: Some(rootfs::Kind::Overlay(proto::OverlayRootfs {
                lowerdirs: vec![self.lower.to_string_lossy().into()],
                upperdir: d.join("upper").to_string_lossy().into(),
                workdir: d.join("work").to_string_lossy().into(),
            })),
        }
    }

    pub fn create_request(&self, id: &str, spec: &SpecBuilder) -> proto::CreateContainerRequest {
        proto::CreateContainerRequest {
            id: id.into(),
            oci_spec: spec.build(&self.cgroups_path(id)),
            rootfs: Some(self.overlay(id)),
            log_path: self.log_path(id).to_string_lossy().into(),
            tty: false,
            stdin: false,
            stdin_once: false,
            log_vsock_port: 0,
            log_vsock_token: String::new(),
            apparmor_policy: Vec::new(),
            restore_dir: String::new(),
        }
    }

    /// Creates and starts a container running `args`.
    /// Creates and starts a container; returns its init's pid (StartContainer answers it).
    pub async fn run(&self, c: &mut Client, id: &str, spec: &SpecBuilder) -> u32 {
        c.create_container(self.create_request(id, spec))
            .await
            .unwrap();
        c.start_container(proto::StartContainerRequest { id: id.into() })
            .await
            .unwrap()
            .into_inner()
            .pid
    }

    pub fn agent_log(&self) -> String {
        std::fs::read_to_string(&self.agent_log).unwrap_or_default()
    }

    /// Whether the agent process is gone (reaping it if it is our zombie).
    pub fn agent_gone(&self) -> bool {
        use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
        match waitpid(
            nix::unistd::Pid::from_raw(self.pid),
            Some(WaitPidFlag::WNOHANG),
        ) {
            Ok(WaitStatus::StillAlive) => false,
            Ok(_) => true,
            Err(_) => !Path::new(&format!("/proc/{}", self.pid)).exists(),
        }
    }

    pub fn wait_agent_gone(&self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        while Instant::now() < end {
            if self.agent_gone() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// Our cgroup directories that exist (every hierarchy).
    pub fn cgroup_dirs(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let rel = self.cgroup_parent.trim_start_matches('/');
        if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
            for e in rd.flatten() {
                let p = e.path().join(rel);
                if p.exists() {
                    out.push(p);
                }
            }
        }
        let p = Path::new("/sys/fs/cgroup").join(rel);
        if p.exists() && !out.contains(&p) {
            out.push(p);
        }
        out
    }

    /// Container cgroups (children of our parent) that exist.
    pub fn container_cgroups(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for d in self.cgroup_dirs() {
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    if e.path().is_dir() {
                        out.push(e.path());
                    }
                }
            }
        }
        out
    }

    /// Mount points under our temp dir, as seen from the host.
    pub fn our_mounts(&self) -> Vec<String> {
        let root = self.tmp.path().to_string_lossy().to_string();
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter_map(|l| l.split_whitespace().nth(4).map(str::to_string))
            .filter(|m| m.starts_with(&root))
            .collect()
    }

    /// Host pids that descend from the agent.
    pub fn descendants(&self) -> Vec<i32> {
        let mut parent_of = std::collections::HashMap::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r.to_string()) else {
                continue;
            };
            let f: Vec<&str> = rest.split_whitespace().collect();
            if f.first() == Some(&"Z") {
                continue;
            }
            if let Some(ppid) = f.get(1).and_then(|p| p.parse::<i32>().ok()) {
                parent_of.insert(pid, ppid);
            }
        }
        let mut out = Vec::new();
        for (&pid, _) in parent_of.iter() {
            let mut cur = pid;
            for _ in 0..64 {
                match parent_of.get(&cur) {
                    Some(&pp) if pp == self.pid => {
                        out.push(pid);
                        break;
                    }
                    Some(&pp) if pp > 1 => cur = pp,
                    _ => break,
                }
            }
        }
        out
    }

    /// Asserts that nothing of ours is left (after the agent is gone).
    pub fn assert_clean(&self) {
        assert!(
            self.our_mounts().is_empty(),
            "mounts left: {:?}",
            self.our_mounts()
        );
        assert!(
            self.container_cgroups().is_empty(),
            "cgroups left: {:?}",
            self.container_cgroups()
        );
    }
}

fn rmdir_tree(p: &Path) {
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            if e.path().is_dir() {
                rmdir_tree(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(p);
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        if !self.agent_gone() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.pid),
                nix::sys::signal::SIGKILL,
            );
            self.wait_agent_gone(Duration::from_secs(10));
        }
        // Container processes die with the agent's pid namespace; give the kernel a moment
        // before removing their cgroups.
        for _ in 0..50 {
            let dirs = self.cgroup_dirs();
            if dirs.is_empty() {
                break;
            }
            for d in &dirs {
                rmdir_tree(d);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A test-only OCI runtime spec builder.
#[derive(Clone)]
pub struct SpecBuilder {
    pub args: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub uid: u32,
    pub gid: u32,
    pub memory_limit: Option<i64>,
    pub oom_score_adj: Option<i32>,
    pub namespaces: Vec<Value>,
}

impl SpecBuilder {
    pub fn new(args: &[&str]) -> SpecBuilder {
        SpecBuilder {
            args: args.iter().map(|s| s.to_string()).collect(),
            env: vec![
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
                "HOME=/root".into(),
            ],
            cwd: "/".into(),
            uid: 0,
            gid: 0,
            memory_limit: None,
            oom_score_adj: None,
            namespaces: vec![
                json!({"type": "pid"}),
                json!({"type": "ipc"}),
                json!({"type": "uts"}),
                json!({"type": "mount"}),
                json!({"type": "network", "path": "agent"}),
            ],
        }
    }

    /// `sh -c script`.
    pub fn sh(script: &str) -> SpecBuilder {
        Self::new(&["sh", "-c", script])
    }

    pub fn env(mut self, kv: &str) -> Self {
        self.env.push(kv.into());
        self
    }

    pub fn cwd(mut self, cwd: &str) -> Self {
        self.cwd = cwd.into();
        self
    }

    pub fn user(mut self, uid: u32, gid: u32) -> Self {
        self.uid = uid;
        self.gid = gid;
        self
    }

    pub fn memory_limit(mut self, bytes: i64) -> Self {
        self.memory_limit = Some(bytes);
        self
    }

    pub fn build(&self, cgroups_path: &str) -> Vec<u8> {
        let caps = vessel_agent::spec::DEFAULT_CAPS;
        let mut resources = json!({
            "devices": [{"allow": false, "access": "rwm"}],
        });
        if let Some(limit) = self.memory_limit {
            resources["memory"] = json!({"limit": limit, "swap": limit});
        }
        let spec = json!({
            "ociVersion": "1.0.2",
            "process": {
                "terminal": false,
                "user": {"uid": self.uid, "gid": self.gid},
                "args": self.args,
                "env": self.env,
                "cwd": self.cwd,
                "capabilities": {
                    "bounding": caps, "effective": caps, "permitted": caps,
                },
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
                "noNewPrivileges": true
            },
            "root": {"path": "rootfs", "readonly": false},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc",
                 "options": ["nosuid", "noexec", "nodev"]},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
                 "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
                {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
                 "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
                {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
                 "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
                {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
                 "options": ["nosuid", "noexec", "nodev"]},
                {"destination": "/sys", "type": "sysfs", "source": "sysfs",
                 "options": ["nosuid", "noexec", "nodev", "ro"]}
            ],
            "linux": {
                "namespaces": self.namespaces,
                "cgroupsPath": cgroups_path,
                "resources": resources,
                "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list"],
                "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger"]
            }
        });
        let mut spec = spec;
        if let Some(adj) = self.oom_score_adj {
            spec["process"]["oomScoreAdj"] = json!(adj);
        }
        serde_json::to_vec(&spec).unwrap()
    }
}

/// One parsed CRI log record.
#[derive(Debug, Clone)]
pub struct LogRecord {
    pub ts: String,
    pub stream: String,
    pub tag: String,
    pub content: String,
}

pub fn read_log(path: &Path) -> Vec<LogRecord> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|l| {
            let mut p = l.splitn(4, ' ');
            LogRecord {
                ts: p.next().unwrap_or("").into(),
                stream: p.next().unwrap_or("").into(),
                tag: p.next().unwrap_or("").into(),
                content: p.next().unwrap_or("").into(),
            }
        })
        .collect()
}

/// Polls `f` until it is true or `timeout` passes.
pub async fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f()
}

/// The agent's ContainerStatus of `id`.
pub async fn container_info(c: &mut Client, id: &str) -> proto::ContainerInfo {
    c.container_status(proto::ContainerStatusRequest { id: id.into() })
        .await
        .unwrap()
        .into_inner()
        .info
        .unwrap()
}

pub async fn wait_exit(c: &mut Client, id: &str) -> proto::ExitInfo {
    tokio::time::timeout(
        Duration::from_secs(60),
        c.wait_container(proto::WaitContainerRequest { id: id.into() }),
    )
    .await
    .expect("WaitContainer timed out")
    .unwrap()
    .into_inner()
    .exit
    .unwrap()
}

/// Skips (returns true) when not root.
pub fn skip_unless_root() -> bool {
    if !is_root() {
        eprintln!("SKIP: these tests need root");
        return true;
    }
    false
}
