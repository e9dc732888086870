//! A real systemd, booted as PID 1 of the test's own namespaces, for testing the systemd
//! cgroup driver on a machine whose init is not systemd (CI's).
//!
//! [`SystemdInstance::start`] makes a cgroup of its own in every hierarchy, and in it a new pid,
//! mount and cgroup namespace, where the cgroup filesystems are unmounted and mounted again (so
//! that the namespace's cgroup is their root, as in a container, and no host mount is left
//! beneath to confuse a reader of mountinfo) and `/run` is a fresh tmpfs; then it
//! execs `/lib/systemd/systemd` in container mode with a unit path holding one empty target,
//! so that it starts nothing but itself. systemd serves its D-Bus API on
//! `/run/systemd/private` inside. [`SystemdInstance::wrapper`] is the command prefix that runs
//! a program (vesseld) in those namespaces, where it sees that systemd as its init. Dropping
//! the instance kills the namespace (every process in it) and removes its cgroups.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SYSTEMD: &str = "/lib/systemd/systemd";

/// A running systemd in namespaces of its own. Drop kills it and all it runs.
pub struct SystemdInstance {
    /// The `unshare` process (its child is systemd).
    child: Child,
    /// systemd's pid in the test's pid namespace.
    pid: u32,
    /// The instance's cgroup, the same name in every hierarchy.
    cgroup: String,
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for SystemdInstance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SystemdInstance")
            .field("pid", &self.pid)
            .field("cgroup", &self.cgroup)
            .finish()
    }
}

/// Why no systemd instance can run here, if one cannot (for a test's skip message).
pub fn unavailable() -> Option<String> {
    if !Path::new(SYSTEMD).exists() {
        return Some(format!(
            "{SYSTEMD} is not installed (apt-get install systemd)"
        ));
    }
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("booting systemd in namespaces needs root".into());
    }
    if which("nsenter").is_none() || which("unshare").is_none() {
        return Some("nsenter and unshare (util-linux) are needed".into());
    }
    None
}

fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(bin))
            .find(|c| c.exists())
    })
}

/// `(mount point, mount options)` of every mounted cgroup hierarchy (v1 and v2).
fn hierarchies() -> Vec<(PathBuf, String, bool)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut out = Vec::new();
    for l in info.lines() {
        let parts: Vec<&str> = l.split(' ').collect();
        let Some(sep) = parts.iter().position(|p| *p == "-") else {
            continue;
        };
        let fstype = parts.get(sep + 1).copied().unwrap_or("");
        if fstype != "cgroup" && fstype != "cgroup2" {
            continue;
        }
        let (Some(mp), Some(opts)) = (parts.get(4), parts.get(sep + 3)) else {
            continue;
        };
        // The controllers (or name=) of a v1 hierarchy, from its super options.
        let ctl: Vec<&str> = opts
            .split(',')
            .filter(|o| !["rw", "ro", "relatime", "nosuid", "nodev", "noexec"].contains(o))
            .collect();
        out.push((PathBuf::from(mp), ctl.join(","), fstype == "cgroup2"));
    }
    out
}

impl SystemdInstance {
    /// Boots systemd on the node's cgroup layout (v1, hybrid or v2, as mounted) and waits
    /// (up to 20 s) until its D-Bus socket answers.
    pub fn start() -> std::io::Result<SystemdInstance> {
        Self::start_with(false)
    }

    /// Like [`SystemdInstance::start`]; `unified`: the namespace gets the cgroup v2 hierarchy
    /// alone, at `/sys/fs/cgroup`, as on a pure cgroup v2 host (on a v1 or hybrid host its
    /// controllers stay with v1, so it has none).
    pub fn start_with(unified: bool) -> std::io::Result<SystemdInstance> {
        if let Some(why) = unavailable() {
            return Err(std::io::Error::other(why));
        }
        let dir = tempfile::Builder::new()
            .prefix("vessel-systemd-")
            .tempdir()?;
        let units = dir.path().join("units");
        std::fs::create_dir(&units)?;
        std::fs::write(
            units.join("vessel-test.target"),
            "[Unit]\nDescription=vessel systemd driver test\n",
        )?;
        let cgroup = dir
            .path()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "vessel-systemd".into());
        let hier = hierarchies();
        let mut mounts = String::new();
        let mut dirs = Vec::new();
        for (mp, ctl, v2) in &hier {
            let cg = mp.join(&cgroup);
            std::fs::create_dir_all(&cg)?;
            // A v1 cpuset cgroup takes no process until it has CPUs and memory nodes.
            for f in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(v) = std::fs::read_to_string(mp.join(f)) {
                    std::fs::write(cg.join(f), v.trim())?;
                }
            }
            let m = mp.display();
            if unified {
                if *v2 {
                    mounts.push_str("mount -t cgroup2 cgroup2 /sys/fs/cgroup\n");
                }
                continue;
            }
            dirs.push(m.to_string());
            if *v2 {
                mounts.push_str(&format!("mount -t cgroup2 cgroup2 {m}\n"));
            } else {
                let opts = if ctl.starts_with("name=") {
                    format!("none,{ctl}")
                } else {
                    ctl.clone()
                };
                mounts.push_str(&format!("mount -t cgroup -o {opts} cgroup {m}\n"));
            }
        }
        let procs: Vec<String> = hier
            .iter()
            .map(|(mp, _, _)| mp.join(&cgroup).join("cgroup.procs").display().to_string())
            .collect();
        // Unified: cgroup2 itself at /sys/fs/cgroup; otherwise a tmpfs holding each hierarchy.
        let base = if unified {
            String::new()
        } else {
            format!(
                "mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup\nmkdir -p {}\n",
                dirs.join(" ")
            )
        };
        let inner = format!(
            "set -e\nmount --make-rprivate /\nmount -t proc proc /proc\nmount -t tmpfs tmpfs /run\n\
             mkdir -p /run/systemd/system\numount -R /sys/fs/cgroup\n{base}{mounts}\
             exec env -i container=vessel-test SYSTEMD_UNIT_PATH={units} PATH=/usr/sbin:/usr/bin:/sbin:/bin \
             {SYSTEMD} --unit=vessel-test.target --log-target=console --log-level=info\n",
            units = units.display(),
        );
        let script = format!(
            "set -e\nfor f in {procs}; do echo $$ > $f; done\nexec unshare --pid --mount --cgroup --fork bash -c '{inner}'\n",
            procs = procs.join(" "),
        );
        let log = std::fs::File::create(dir.path().join("systemd.log"))?;
        let child = Command::new("bash")
            .arg("-c")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let mut inst = SystemdInstance {
            child,
            pid: 0,
            cgroup,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = inst.child.try_wait()? {
                return Err(std::io::Error::other(format!(
                    "systemd exited ({s}) before serving: {}",
                    inst.log()
                )));
            }
            if inst.pid == 0 {
                inst.pid = children(inst.child.id())
                    .into_iter()
                    .find(|p| {
                        std::fs::read_link(format!("/proc/{p}/exe"))
                            .is_ok_and(|e| e.ends_with("systemd"))
                    })
                    .unwrap_or(0);
            }
            if inst.pid != 0 {
                let sock = format!("/proc/{}/root/run/systemd/private", inst.pid);
                let state = inst.systemctl(&["is-system-running"]).1;
                let up =
                    ["running", "degraded", "starting", "initializing"].contains(&state.trim());
                if Path::new(&sock).exists() && up {
                    return Ok(inst);
                }
            }
            if Instant::now() > deadline {
                return Err(std::io::Error::other(format!(
                    "systemd did not serve within 20 s: {}",
                    inst.log()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// systemd's pid as the test sees it.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// What systemd printed.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("systemd.log")).unwrap_or_default()
    }

    /// The command prefix that runs a program in the instance's namespaces.
    pub fn wrapper(&self) -> Vec<String> {
        [
            "nsenter",
            "--target",
            &self.pid.to_string(),
            "--mount",
            "--cgroup",
            "--pid",
            "--",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    /// Runs `systemctl ARGS` against the instance; (success, stdout + stderr).
    pub fn systemctl(&self, args: &[&str]) -> (bool, String) {
        self.run("systemctl", args)
    }

    /// Runs `program ARGS` in the instance's namespaces; (success, stdout + stderr).
    pub fn run(&self, program: &str, args: &[&str]) -> (bool, String) {
        let w = self.wrapper();
        match Command::new(&w[0])
            .args(&w[1..])
            .arg(program)
            .args(args)
            .output()
        {
            Ok(o) => {
                let mut s = String::from_utf8_lossy(&o.stdout).into_owned();
                s.push_str(&String::from_utf8_lossy(&o.stderr));
                (o.status.success(), s)
            }
            Err(e) => (false, e.to_string()),
        }
    }

    /// The host's mount point of the cgroup v2 hierarchy (`/sys/fs/cgroup/unified` on a
    /// hybrid host, `/sys/fs/cgroup` on a v2 one).
    pub fn host_unified(&self) -> Option<PathBuf> {
        hierarchies()
            .into_iter()
            .find(|(_, _, v2)| *v2)
            .map(|(mp, _, _)| mp)
    }

    /// The host path of `rel` (a cgroup path as the instance sees it) in the hierarchy
    /// mounted at `mount` (e.g. `/sys/fs/cgroup/memory`).
    pub fn host_cgroup(&self, mount: &Path, rel: &str) -> PathBuf {
        mount.join(&self.cgroup).join(rel.trim_start_matches('/'))
    }
}

/// The children of process `pid`.
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in rd.flatten() {
            if let Ok(c) = std::fs::read_to_string(t.path().join("children")) {
                out.extend(c.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
            }
        }
    }
    out
}

impl Drop for SystemdInstance {
    fn drop(&mut self) {
        if self.pid != 0 {
            // SAFETY: kill(2) of the namespace's init this instance started; its death takes
            // every process of the namespace with it.
            unsafe {
                libc::kill(self.pid as libc::pid_t, libc::SIGKILL);
            }
        }
        // `unshare` reaps systemd and exits; it is killed only if it does not.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while self.child.try_wait().ok().flatten().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // The namespace's processes are gone once its init is reaped; then its cgroups,
        // deepest first.
        std::thread::sleep(Duration::from_millis(100));
        for (mp, _, _) in hierarchies() {
            let top = mp.join(&self.cgroup);
            let mut dirs = Vec::new();
            let mut stack = vec![top];
            while let Some(d) = stack.pop() {
                if let Ok(rd) = std::fs::read_dir(&d) {
                    for e in rd.flatten() {
                        if e.file_type().is_ok_and(|t| t.is_dir()) {
                            stack.push(e.path());
                        }
                    }
                    dirs.push(d);
                }
            }
            dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
            for d in dirs {
                let _ = std::fs::remove_dir(d);
            }
        }
    }
}
