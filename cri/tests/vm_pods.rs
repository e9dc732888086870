//! VM pods end to end: vesseld with the `vm` handler, driven by the conformance suite
//! (`vessel-critest --vm`) and by this crate's pods and CNI end-to-end suites (`pods_e2e` and
//! `cni_e2e`, with `VESSEL_E2E_HANDLER=vm`), against microVMs booted by `vessel-shim`. In the
//! nested harness, L1 has a CNI network (bridge, host-local, portmap, loopback; iptables).
//!
//! * KVM usable here (real hardware virtualisation): both suites run directly.
//! * Otherwise they run inside the nested VM harness (QEMU/TCG L1 with nested SVM:
//!   `scripts/vm-harness.sh pods`), where L1's KVM is usable: five L1 runs, two at once,
//!   longest first: cni_e2e then upstream critest, pods_e2e, flat pods (vessel-critest and
//!   upstream critest's specs the CI host cannot test, as the only run of flat pods on
//!   cgroup v2 and with AppArmor: L1 has both, the CI host neither), and vessel-critest
//!   against VM pods in two halves.
//!
//! Runs when the guest kernel is already in the build cache, QEMU is installed (nested case)
//! and we are root; otherwise it prints `SKIP vm_pods: <reason>`. `VESSEL_VM_HARNESS=1`
//! forces a run, `VESSEL_VM_HARNESS=0` skips it. `VESSEL_VM_PODS_FOCUS` narrows the critest
//! specs, `VESSEL_VM_PODS_E2E` the pods_e2e tests (a libtest filter); `VESSEL_SOAK_OPS` and
//! `VESSEL_SOAK_SEED` reach the crash soak in L1.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::path::{Path, PathBuf};
use std::process::Command;

use vessel_vmm::probe::{probe, Verdict};

/// The conformance specs that a VM pod (or a flat pod in L1) fails today, with the reason;
/// anything else must pass.
/// A spec listed here that passes fails the test too, so that the list stays true.
const KNOWN_FAILURES: &[(&str, &str)] = &[];

/// Seconds the nested harness's L1 runs may take in all, watchdogs and retries included:
/// below nextest's limit for this test (`.config/nextest.toml`: 50 minutes), so that the
/// harness, not nextest, stops a stuck L1 and prints its console.
const HARNESS_BUDGET: u64 = 2850;

/// Upstream critest's specs run against flat pods in L1 (cgroup v2, AppArmor), a
/// `-ginkgo.focus` regex: those whose outcome depends on what the CI host lacks, and the
/// one spec `critest/upstream/l1-flat.expected` lists as failing (a listed spec that does not
/// run is an unexpected outcome).
const FLAT_IN_L1_FOCUS: &str =
    "AppArmor|stats|OOM|[Ss]eccomp|sysctls|[Pp]ropagation|[Rr]esources|public image with digest";

/// The newest `<name>-<hash>` test binary next to this one (cargo builds every test binary
/// of the crate before running any).
fn test_binary(name: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let prefix = format!("{name}-");
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            n.starts_with(&prefix) && !n.contains('.')
        })
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
        .map(|e| e.path())
}

/// The most recently modified source file (`.rs`, `.proto`, `Cargo.toml`) under `dir`.
fn newest_source(dir: &Path) -> Option<(PathBuf, std::time::SystemTime)> {
    let mut newest: Option<(PathBuf, std::time::SystemTime)> = None;
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let (path, name) = (e.path(), e.file_name());
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() && name != "target" && name != "tests" && name != "benches" {
                todo.push(path);
            } else if ft.is_file()
                && (path.extension().is_some_and(|x| x == "rs" || x == "proto")
                    || name == "Cargo.toml")
            {
                if let Ok(t) = e.metadata().and_then(|m| m.modified()) {
                    if newest.as_ref().is_none_or(|(_, n)| t > *n) {
                        newest = Some((path, t));
                    }
                }
            }
        }
    }
    newest
}

/// The guest image (`cpio` initrd or `erofs` root) of the agent in `bindir`, built by
/// `scripts/build-guest-initrd.sh` (cached by content).
fn guest_image(root: &Path, bindir: &Path, format: &str) -> PathBuf {
    let o = Command::new("bash")
        .arg(root.join("scripts/build-guest-initrd.sh"))
        .arg(bindir.join("vessel-agent"))
        .env("FORMAT", format)
        .output()
        .expect("scripts/build-guest-initrd.sh");
    let p = PathBuf::from(
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .last()
            .unwrap_or_default()
            .trim(),
    );
    assert!(p.is_file(), "no guest {format} image: {}", p.display());
    p
}

fn vm_config(kernel: &Path, initrd: &Path, rootfs: &Path) -> String {
    format!(
        "[runtime]\nvm_fallback = \"refuse\"\n[vm]\nkernel = \"{}\"\ninitrd = \"{}\"\nrootfs = \"{}\"\nboot_timeout_secs = 60\n",
        kernel.display(),
        initrd.display(),
        rootfs.display()
    )
}

#[test]
fn vm_pods() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let force = std::env::var("VESSEL_VM_HARNESS").ok();
    if force.as_deref() == Some("0") {
        println!("SKIP vm_pods: VESSEL_VM_HARNESS=0");
        return;
    }
    let forced = force.as_deref() == Some("1");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIP vm_pods: needs root (KVM, mounts, the kernel build cache)");
        return;
    }
    let p = probe();
    let direct = p.verdict == Verdict::Usable;
    if !direct
        && Command::new("qemu-system-x86_64")
            .arg("--version")
            .output()
            .is_err()
    {
        println!(
            "SKIP vm_pods: KVM is {} here ({}) and qemu-system-x86_64 is not installed (scripts/deps.sh)",
            p.verdict, p.reason
        );
        return;
    }
    let kdir = Command::new("bash")
        .arg(root.join("scripts/build-guest-kernel.sh"))
        .arg("--print")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|d| !d.is_empty() && Path::new(d).join("vmlinux").exists());
    if kdir.is_none() && !forced {
        println!(
            "SKIP vm_pods: the guest kernel is not built yet (run scripts/build-guest-kernel.sh, or set VESSEL_VM_HARNESS=1)"
        );
        return;
    }
    let bins: Vec<PathBuf> = ["pods_e2e", "cni_e2e", "upstream_critest"]
        .iter()
        .map(|n| {
            test_binary(n).unwrap_or_else(|| {
                panic!("no {n} test binary next to {:?}", std::env::current_exe())
            })
        })
        .collect();
    let e2e = E2e {
        pods: &bins[0],
        cni: &bins[1],
        upstream: &bins[2],
    };
    let bindir = Path::new(env!("CARGO_BIN_EXE_vesseld"))
        .parent()
        .unwrap()
        .to_path_buf();
    // Cargo builds vesseld for this test, not these: one older than its crate's sources
    // would be tested instead of the code.
    for (b, dirs) in [
        ("vessel-agent", &["guest-agent"][..]),
        ("vessel-shim", &["shim", "vmm"][..]),
        ("vessel-critest", &["critest"][..]),
    ] {
        let bin = bindir.join(b);
        assert!(
            bin.is_file(),
            "{b} is not built in {} (cargo build --workspace --bins)",
            bindir.display()
        );
        let built = bin.metadata().and_then(|m| m.modified()).unwrap();
        for d in dirs {
            if let Some((src, _)) = newest_source(&root.join(d)).filter(|(_, t)| *t > built) {
                panic!(
                    "{} is older than {}: run cargo build --workspace --bins",
                    bin.display(),
                    src.display()
                );
            }
        }
    }
    let e2e_filter = std::env::var("VESSEL_VM_PODS_E2E").unwrap_or_default();
    let focus = std::env::var("VESSEL_VM_PODS_FOCUS").unwrap_or_default();
    println!(
        "vm_pods: KVM here is {} ({}); running {}",
        p.verdict,
        p.reason,
        if direct {
            "directly"
        } else {
            "in the nested harness"
        }
    );
    let (stdout, ok) = if direct {
        run_direct(&root, &bindir, &e2e, kdir.as_deref(), &focus, &e2e_filter)
    } else {
        run_nested(&root, &bindir, &e2e, &focus, &e2e_filter)
    };
    check(&stdout, ok);
}

/// Both suites inside L1: critest through l1-pods.sh, pods_e2e as its extra command.
/// The end-to-end test binaries run against VM pods after the conformance suite.
struct E2e<'a> {
    pods: &'a Path,
    cni: &'a Path,
    /// Upstream critest's networking and streaming specs (`upstream_critest_vm`).
    upstream: &'a Path,
}

/// Upstream critest runs whole against VM pods in CI (~6 min in L1);
/// `VESSEL_VM_PODS_UPSTREAM_FOCUS` narrows it (a -ginkgo.focus regex, e.g.
/// `Networking|Streaming`).
fn upstream_focus() -> String {
    std::env::var("VESSEL_VM_PODS_UPSTREAM_FOCUS").unwrap_or_default()
}

/// Upstream critest and its stand-in images' OCI layout, from `../shared/cri-tools` (built
/// and cached as for `upstream_critest_flat`); `None`, with the reason, without them.
fn upstream_tools() -> Result<(PathBuf, PathBuf), String> {
    use vessel_critest::upstream;
    let shared = upstream::shared_dir().ok_or("../shared/cri-tools not found")?;
    let bin = upstream::tools_bin(&shared)?;
    let oci = upstream::images_dir(&shared)?.join("oci");
    if !oci.join("index.json").is_file() {
        return Err(format!("no OCI layout at {}", oci.display()));
    }
    Ok((bin.join("critest"), oci))
}

fn run_nested(
    root: &Path,
    bindir: &Path,
    e2e: &E2e<'_>,
    focus: &str,
    e2e_filter: &str,
) -> (String, bool) {
    let name = |p: &Path| p.file_name().unwrap().to_string_lossy().to_string();
    let (pods_name, cni_name, up_name) = (name(e2e.pods), name(e2e.cni), name(e2e.upstream));
    let config = vm_config(
        Path::new("/vessel/guest/vmlinux"),
        Path::new("/vessel/guest/vessel-initrd.img"),
        Path::new("/vessel/guest/vessel-rootfs.erofs"),
    );
    let mut env = format!(
        "VESSEL_E2E_VESSELD=/vessel/bin/vesseld VESSEL_E2E_HANDLER=vm VESSEL_E2E_CONFIG='{config}'"
    );
    // The crash soak's length and seed, to lengthen or replay it in L1.
    for k in ["VESSEL_SOAK_OPS", "VESSEL_SOAK_SEED"] {
        if let Some(v) = std::env::var(k)
            .ok()
            .filter(|v| v.bytes().all(|b| b.is_ascii_digit()) && !v.is_empty())
        {
            env.push_str(&format!(" {k}={v}"));
        }
    }
    // L1 runs, two at once (one core each: the emulated L1 is single-threaded), each no
    // longer than ~17 minutes here, so that the harness's one retry of an L1 that hung (QEMU's
    // lost wake-up) costs one short run, not the whole suite: vessel-critest against VM pods
    // in two halves, pods_e2e, cni_e2e then upstream critest, and flat pods.
    let suite_extra = format!("{env} /vessel/bin/{pods_name} --test-threads 1 {e2e_filter}");
    let suite_add = e2e.pods.display().to_string();
    let mut other_extra = format!("{env} /vessel/bin/{cni_name} --test-threads 1 {e2e_filter}");
    let mut other_add = e2e.cni.display().to_string();
    let mut add_dirs = String::new();
    // The third L1, after the second (the shorter): flat pods on L1's cgroup v2 and AppArmor,
    // which the host this suite runs on (cgroup v1 hybrid, no AppArmor) tests neither of:
    // vessel-critest, then upstream critest.
    let mut flat_extra = "true".to_string();
    let mut flat_add = String::new();
    match upstream_tools() {
        Ok((critest, oci)) => {
            let listed = root.join("critest/upstream/vm.expected");
            let flat_listed = root.join("critest/upstream/l1-flat.expected");
            other_add.push_str(&format!(
                " {} {} {}",
                e2e.upstream.display(),
                critest.display(),
                listed.display()
            ));
            flat_add = format!(
                "{} {} {}",
                e2e.upstream.display(),
                critest.display(),
                flat_listed.display()
            );
            add_dirs = format!("{}:/vessel/cri-tools/oci", oci.display());
            let tools =
                "VESSEL_CRI_TOOLS_BIN=/vessel/bin VESSEL_CRI_TOOLS_OCI=/vessel/cri-tools/oci";
            let focus = upstream_focus();
            // Flat pods in L1: what the CI host's upstream_critest_flat cannot test (AppArmor,
            // cgroup v2 stats, OOM and resources, seccomp, sysctls, mount propagation); the
            // rest of upstream critest runs against flat pods there, and L1's time goes to VM
            // pods. `VESSEL_VM_PODS_UPSTREAM_FOCUS` narrows both runs alike.
            let flat_focus = if focus.is_empty() {
                FLAT_IN_L1_FOCUS.to_string()
            } else {
                focus.clone()
            };
            other_extra.push_str(&format!(
                " && {env} {tools} VESSEL_UPSTREAM_EXPECTED=/vessel/bin/vm.expected VESSEL_UPSTREAM_FOCUS='{focus}' /vessel/bin/{up_name} --test-threads 1 --nocapture upstream_critest_vm",
            ));
            flat_extra = format!(
                "VESSEL_E2E_VESSELD=/vessel/bin/vesseld VESSEL_E2E_HANDLER=flat {tools} VESSEL_UPSTREAM_EXPECTED=/vessel/bin/l1-flat.expected VESSEL_UPSTREAM_FOCUS='{flat_focus}' /vessel/bin/{up_name} --test-threads 1 --nocapture upstream_critest_flat_in_l1",
            );
        }
        Err(why) => println!("vm_pods: upstream critest not run in L1: {why}"),
    }
    // The guest images the harness runs stage, built (and cached) once, before any.
    for format in ["cpio", "erofs"] {
        guest_image(root, bindir, format);
    }
    let work = std::env::var("VESSEL_HARNESS_WORK").unwrap_or("/var/tmp/vessel-harness".into());
    let harness = |run: &L1Run<'_>, work: &str, timeout: u64| {
        let mut cmd = Command::new("bash");
        cmd.arg(root.join("scripts/vm-harness.sh"))
            .arg("pods")
            .env("VESSEL_HARNESS_WORK", format!("{work}{}", run.dir))
            .env("VESSEL_PODS_BINDIR", bindir)
            .env("VESSEL_PODS_HANDLER", run.handler)
            .env(
                "VESSEL_PODS_SUITE",
                if run.focus.is_some() { "1" } else { "0" },
            )
            .env("VESSEL_PODS_ADD", run.add)
            .env("VESSEL_PODS_ADD_DIRS", run.add_dirs)
            .env("VESSEL_PODS_EXTRA", run.extra)
            // Appended to l1-pods.sh's config, whose last section is [vm].
            .env("VESSEL_PODS_CONFIG", "boot_timeout_secs = 60\n")
            // Below nextest's limit for this test, so that a slow or stuck L1 is stopped by
            // the harness, which then prints L1's console (nextest's kill would lose it).
            .env("VESSEL_HARNESS_TIMEOUT", timeout.to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if let Some(f) = run.focus.as_deref().filter(|f| !f.is_empty()) {
            cmd.env("VESSEL_PODS_FOCUS", f);
        }
        cmd.spawn()
            .expect("running scripts/vm-harness.sh pods")
            .wait_with_output()
    };
    // Each L1 attempt's watchdog (the harness retries an L1 that hung, once), at most what
    // is left of HARNESS_BUDGET, so that the runs stay below nextest's limit for this test.
    let timeout = std::env::var("VESSEL_HARNESS_TIMEOUT")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(1500u64);
    let halves = critest_halves(bindir, focus);
    let mut jobs: Vec<L1Run<'_>> = vec![
        L1Run::new(
            "cni_e2e and upstream critest",
            "-b",
            "vm",
            None,
            &other_add,
            &other_extra,
        )
        .dirs(&add_dirs),
        L1Run::new("pods_e2e", "-d", "vm", None, &suite_add, &suite_extra),
        L1Run::new(
            "flat pods",
            "-c",
            "flat",
            Some(focus.to_string()),
            &flat_add,
            &flat_extra,
        )
        .dirs(&add_dirs),
    ];
    // The longer half first: the queue goes longest first.
    for (i, half) in halves.into_iter().enumerate().rev() {
        let (name, dir) = [("vessel-critest 1", ""), ("vessel-critest 2", "-e")][i];
        jobs.push(L1Run::new(name, dir, "vm", Some(half), "", "true"));
    }
    let queue = std::sync::Mutex::new(std::collections::VecDeque::from(jobs));
    let t0 = std::time::Instant::now();
    // Each run's pipes are read while the others run: a run whose pipe fills while another
    // is waited for would stall.
    let outs: Vec<(String, std::io::Result<std::process::Output>)> = std::thread::scope(|s| {
        let worker = || {
            let mut done = Vec::new();
            loop {
                let Some(job) = queue.lock().unwrap().pop_front() else {
                    return done;
                };
                let left = HARNESS_BUDGET.saturating_sub(t0.elapsed().as_secs());
                let out = harness(&job, &work, left.clamp(300, timeout));
                done.push((job.name.to_string(), out));
            }
        };
        let workers = [s.spawn(worker), s.spawn(worker)];
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a harness thread"))
            .collect()
    });
    let mut stdout = String::new();
    let mut all_ok = true;
    for (n, out) in outs {
        let out = out.expect("waiting for scripts/vm-harness.sh pods");
        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
        stdout.push_str(&format!("vm_pods: L1 run {n}\n"));
        stdout.push_str(&String::from_utf8_lossy(&out.stdout));
        all_ok &= out.status.success();
    }
    (stdout, all_ok)
}

/// One `scripts/vm-harness.sh pods` run: its name, its work directory's suffix, the pods'
/// handler, vessel-critest's focus (None: no vessel-critest; "": every spec), the files and
/// directories staged into L1, and the command run after the suite.
struct L1Run<'a> {
    name: &'a str,
    dir: &'a str,
    handler: &'a str,
    focus: Option<String>,
    add: &'a str,
    add_dirs: &'a str,
    extra: &'a str,
}

impl<'a> L1Run<'a> {
    fn new(
        name: &'a str,
        dir: &'a str,
        handler: &'a str,
        focus: Option<String>,
        add: &'a str,
        extra: &'a str,
    ) -> Self {
        L1Run {
            name,
            dir,
            handler,
            focus,
            add,
            add_dirs: "",
            extra,
        }
    }

    fn dirs(mut self, add_dirs: &'a str) -> Self {
        self.add_dirs = add_dirs;
        self
    }
}

/// vessel-critest's spec groups in the second of the two L1 runs that share its VM pod specs
/// (about half of their time); the first runs every other group.
const SECOND_HALF: &[&str] = &["volume", "network", "security", "streaming"];

/// The `--focus` of each L1 run of vessel-critest against VM pods: the user's focus, in one
/// run, or the suite in two halves by spec group. The halves are checked against the suite's
/// own list, so that a new group is never left out of both.
fn critest_halves(bindir: &Path, focus: &str) -> Vec<String> {
    if !focus.is_empty() {
        return vec![focus.to_string()];
    }
    let groups: std::collections::BTreeSet<String> = critest_list(bindir, None)
        .iter()
        .filter_map(|l| l.strip_prefix('[')?.split_once(']'))
        .map(|(g, _)| g.to_string())
        .collect();
    assert!(
        SECOND_HALF.iter().all(|g| groups.contains(*g)),
        "vessel-critest lists the groups {groups:?}, not all of {SECOND_HALF:?}"
    );
    let first: Vec<&str> = groups
        .iter()
        .map(String::as_str)
        .filter(|g| !SECOND_HALF.contains(g))
        .collect();
    let regex = |gs: &[&str]| format!("^\\[({})\\]", gs.join("|"));
    vec![regex(&first), regex(SECOND_HALF)]
}

/// The VM pod specs `vessel-critest --list` names (those `focus` selects, where given).
fn critest_list(bindir: &Path, focus: Option<&str>) -> Vec<String> {
    let mut c = Command::new(bindir.join("vessel-critest"));
    c.args(["--endpoint", "unix:///nonexistent", "--list", "--vm"]);
    if let Some(f) = focus {
        c.args(["--focus", f]);
    }
    let out = c.output().expect("vessel-critest --list");
    assert!(out.status.success(), "vessel-critest --list failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// On a host with real KVM: vesseld here, critest and pods_e2e against it.
fn run_direct(
    root: &Path,
    bindir: &Path,
    e2e: &E2e<'_>,
    kdir: Option<&str>,
    focus: &str,
    e2e_filter: &str,
) -> (String, bool) {
    let kernel = Path::new(kdir.expect("guest kernel")).join("vmlinux");
    let config = vm_config(
        &kernel,
        &guest_image(root, bindir, "cpio"),
        &guest_image(root, bindir, "erofs"),
    );
    let mut out = String::new();
    let v =
        vessel_critest::daemon::Vesseld::start(Path::new(env!("CARGO_BIN_EXE_vesseld")), &config)
            .expect("vesseld");
    let mut critest = Command::new(bindir.join("vessel-critest"));
    critest
        .arg("--endpoint")
        .arg(format!("unix://{}", v.socket.display()))
        .args(["--runtime-handler", "vm", "--vm"]);
    if !focus.is_empty() {
        critest.args(["--focus", focus]);
    }
    let c = critest.output().expect("vessel-critest");
    out.push_str(&String::from_utf8_lossy(&c.stdout));
    drop(v);
    let mut all_ok = true;
    for bin in [e2e.pods, e2e.cni, e2e.upstream] {
        let mut t = Command::new(bin);
        t.args(["--test-threads", "1"])
            .env("VESSEL_E2E_HANDLER", "vm")
            .env("VESSEL_E2E_CONFIG", &config)
            .env("VESSEL_UPSTREAM_FOCUS", upstream_focus());
        if bin == e2e.upstream {
            t.args(["--nocapture", "upstream_critest_vm"]);
        } else if !e2e_filter.is_empty() {
            t.arg(e2e_filter);
        }
        let t = t.output().expect("an end-to-end test binary");
        out.push_str(&String::from_utf8_lossy(&t.stdout));
        all_ok &= t.status.success();
    }
    out.push_str(&format!(
        "\n{} extra\n",
        if all_ok { "PASS" } else { "FAIL" }
    ));
    (out, true)
}

/// Every critest failure must be a known one (and every known one must still fail), and
/// the pods_e2e run must pass.
fn check(stdout: &str, harness_ok: bool) {
    println!("{stdout}");
    let fails: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("FAIL "))
        .collect();
    let passes: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("PASS "))
        .collect();
    // Each L1 run (five in the nested harness; one directly) ends its extra command with PASS
    // or FAIL: the last such line of each run's output (the harness retries an L1 that hung,
    // and both attempts print) must be PASS.
    let runs: Vec<&str> = stdout.split("vm_pods: L1 run ").collect();
    let runs = if runs.len() > 1 {
        &runs[1..]
    } else {
        &runs[..]
    };
    for run in runs {
        let last = run
            .lines()
            .rev()
            .find(|l| *l == "PASS extra" || *l == "FAIL extra");
        assert!(
            last == Some("PASS extra"),
            "the pods_e2e, cni_e2e and upstream critest suites did not all pass in L1 ({} in run {})",
            last.unwrap_or("no result"),
            run.lines().next().unwrap_or("?")
        );
    }
    let unexpected: Vec<&&str> = fails
        .iter()
        .filter(|f| !f.starts_with("extra"))
        .filter(|f| !KNOWN_FAILURES.iter().any(|(k, _)| f.starts_with(k)))
        .collect();
    assert!(
        unexpected.is_empty(),
        "unexpected failures: {unexpected:#?}"
    );
    let fixed: Vec<&str> = KNOWN_FAILURES
        .iter()
        .map(|(k, _)| *k)
        .filter(|k| passes.iter().any(|p| p.starts_with(k)))
        .collect();
    assert!(
        fixed.is_empty(),
        "known failures now pass; remove them from KNOWN_FAILURES: {fixed:?}"
    );
    let _ = harness_ok; // known failures make the harness exit non-zero; judged above
}

/// The two halves of vessel-critest's VM pod specs (two L1 runs) select every spec once.
#[test]
fn critest_halves_cover_the_suite() {
    let bindir = Path::new(env!("CARGO_BIN_EXE_vesseld")).parent().unwrap();
    if !bindir.join("vessel-critest").is_file() {
        println!("SKIP critest_halves_cover_the_suite: no vessel-critest (cargo build --workspace --bins)");
        return;
    }
    let list = |focus: Option<&str>| critest_list(bindir, focus);
    let halves = critest_halves(bindir, "");
    assert_eq!(halves.len(), 2);
    let (a, b) = (list(Some(&halves[0])), list(Some(&halves[1])));
    assert!(!a.is_empty() && !b.is_empty(), "{halves:?}");
    let mut both: Vec<String> = a.into_iter().chain(b).collect();
    both.sort();
    let mut all = list(None);
    all.sort();
    assert_eq!(both, all, "{halves:?}");
    assert_eq!(critest_halves(bindir, "x"), vec!["x".to_string()]);
}
