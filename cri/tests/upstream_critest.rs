//! Upstream `critest` (cri-tools v1.36.0, built offline from `../shared/cri-tools`) against a
//! live vesseld running flat pods on a private bridge CNI network, with critest's images served
//! by stand-ins on 127.0.0.1 and pulled through vessel's registry client (mirrors).
//!
//! The outcome of every spec is judged against `critest/upstream/<mode>.expected`: a spec not
//! listed must pass, a listed one must end as listed (so the list only shrinks).
//!
//! `upstream_critest_flat_websocket` runs critest's streaming specs once more over WebSocket
//! (`critest/upstream/websocket.expected`: none may fail).
//!
//! `upstream_critest_flat` prints `SKIP upstream_critest_flat: <reason>` when not root or
//! without `shared/cri-tools`. `upstream_critest_vm` runs where VM pods do: `vm_pods` runs this
//! binary inside the nested harness's L1 with `VESSEL_E2E_HANDLER=vm` (critest, its stand-in
//! images as an OCI layout pushed to a `docker-registry`, and `vm.expected` staged there;
//! `VESSEL_UPSTREAM_FOCUS` narrows the specs, and then only the focused ones are judged);
//! elsewhere it prints a SKIP line. `upstream_critest_flat_in_l1` runs there too, against flat
//! pods with `VESSEL_E2E_HANDLER=flat` (`l1-flat.expected`): L1's cgroups are v2 and it has
//! AppArmor, which this suite's own host (cgroup v1 hybrid, no AppArmor) does not test.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use vessel_critest::daemon;
use vessel_critest::upstream;

/// The vesseld this test crate was built with.
const VESSELD: &str = env!("CARGO_BIN_EXE_vesseld");

#[test]
fn upstream_critest_flat() {
    let Some(f) = upstream::Fixture::start("upstream_critest_flat", VESSELD.as_ref()) else {
        return;
    };
    let expected = Path::new(env!("CARGO_MANIFEST_DIR")).join("../critest/upstream/flat.expected");
    run("flat", &f, &expected, &[]);
}

/// critest's streaming specs again, with the WebSocket transports client-go offers (exec
/// and attach in `v5.channel.k8s.io`, port-forward as SPDY tunnelled over WebSocket).
#[test]
fn upstream_critest_flat_websocket() {
    let Some(f) = upstream::Fixture::start("upstream_critest_flat_websocket", VESSELD.as_ref())
    else {
        return;
    };
    let expected =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../critest/upstream/websocket.expected");
    let args = [
        "-websocket-exec",
        "-websocket-attach",
        "-websocket-portforward",
        "-ginkgo.focus=Streaming",
    ]
    .map(String::from);
    run("flat", &f, &expected, &args);
}

#[test]
fn upstream_critest_vm() {
    if std::env::var("VESSEL_E2E_HANDLER").as_deref() != Ok("vm") {
        println!(
            "SKIP upstream_critest_vm: runs against VM pods inside vm_pods (VESSEL_E2E_HANDLER=vm)"
        );
        return;
    }
    let vesseld = std::env::var_os("VESSEL_E2E_VESSELD")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(VESSELD));
    let config = std::env::var("VESSEL_E2E_CONFIG").unwrap_or_default();
    let Some(f) = upstream::Fixture::start_with("upstream_critest_vm", &vesseld, &config) else {
        return;
    };
    let expected = std::env::var_os("VESSEL_UPSTREAM_EXPECTED")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../critest/upstream/vm.expected")
        });
    let mut args = vec!["--runtime-handler=vm".to_string()];
    args.extend(focus_arg());
    run("vm", &f, &expected, &args);
}

/// Flat pods inside the nested harness's L1 (cgroup v2, AppArmor), where `vm_pods` runs this
/// binary with `VESSEL_E2E_HANDLER=flat` and `VESSEL_E2E_VESSELD`; a SKIP line elsewhere (the
/// host's flat pods are `upstream_critest_flat`'s).
#[test]
fn upstream_critest_flat_in_l1() {
    let vesseld = std::env::var_os("VESSEL_E2E_VESSELD")
        .filter(|_| std::env::var("VESSEL_E2E_HANDLER").as_deref() == Ok("flat"));
    let Some(vesseld) = vesseld else {
        println!(
            "SKIP upstream_critest_flat_in_l1: runs against flat pods inside vm_pods' L1 (VESSEL_E2E_HANDLER=flat, VESSEL_E2E_VESSELD)"
        );
        return;
    };
    // Flat by config, as upstream_critest_flat's (critest sends no handler, and the default
    // handler is vm, which falls back to flat only where no guest is installed).
    let Some(f) = upstream::Fixture::start("upstream_critest_flat_in_l1", vesseld.as_ref()) else {
        return;
    };
    let expected = std::env::var_os("VESSEL_UPSTREAM_EXPECTED")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../critest/upstream/l1-flat.expected")
        });
    run("flat (L1)", &f, &expected, &focus_arg());
}

/// critest's `-ginkgo.focus` from `VESSEL_UPSTREAM_FOCUS`, where set.
fn focus_arg() -> Vec<String> {
    std::env::var("VESSEL_UPSTREAM_FOCUS")
        .ok()
        .filter(|f| !f.is_empty())
        .map(|f| format!("-ginkgo.focus={f}"))
        .into_iter()
        .collect()
}

/// Runs critest against the fixture's vesseld and judges its report against `expected_path`.
fn run(mode: &str, f: &upstream::Fixture, expected_path: &Path, args: &[String]) {
    let expected = upstream::parse_expected(
        &std::fs::read_to_string(expected_path).expect("the expected-outcomes list"),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", expected_path.display()));
    let (bin, v, cni) = (&f.bin, &f.vesseld, &f.cni);
    let endpoint = f.endpoint();
    let report = v.dir.path().join("critest-report.json");
    let t = Instant::now();
    let out = Command::new(bin.join("critest"))
        .args([
            "--runtime-endpoint",
            &endpoint,
            "--image-endpoint",
            &endpoint,
        ])
        .arg("-ginkgo.no-color")
        .arg(format!("-ginkgo.json-report={}", report.display()))
        // In the nested harness's L1, well inside its watchdog: a spec that hangs is then
        // reported by name (interrupted), not lost with L1.
        .arg(if mode != "flat" {
            "-ginkgo.timeout=20m"
        } else {
            "-ginkgo.timeout=30m"
        })
        .args(args)
        .output()
        .expect("running critest");
    let took = t.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    // critest's own summary: "Ran N of M Specs ...", "FAIL! -- ..." / "SUCCESS! -- ...".
    println!("upstream critest v1.36.0 against {mode} pods, {took:.0?}; its summary:");
    for l in stdout.lines().filter(|l| {
        l.starts_with("Ran ")
            || l.contains("SUCCESS!")
            || l.contains("FAIL!")
            || l.starts_with("  [FAIL]")
    }) {
        println!("  {l}");
    }
    let json = std::fs::read_to_string(&report).unwrap_or_else(|e| {
        panic!(
            "critest wrote no report ({e}); exit {}; output tail:\n{}\nstderr:\n{}",
            out.status,
            stdout.lines().rev().take(60).collect::<Vec<_>>().join("\n"),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let mut specs = upstream::parse_report(&json).expect("critest's JSON report");
    if args.iter().any(|a| a.starts_with("-ginkgo.focus")) {
        // Specs outside the focus are reported as skipped: judge only the focused ones.
        let before = specs.len();
        specs.retain(|s| s.outcome != upstream::Outcome::Skip || expected.contains_key(&s.name));
        println!("focus {args:?}: {} of {before} specs judged", specs.len());
    }
    let verdict = upstream::judge(&specs, &expected);
    println!(
        "upstream critest ({mode} pods): {} passed, {} failed, {} skipped of {} specs; {} listed as expected failures or skips in {}",
        verdict.passed,
        verdict.failed,
        verdict.skipped,
        specs.len(),
        expected.len(),
        expected_path.display()
    );
    for (name, e) in &expected {
        println!("  expected {:?} {name}: {}", e.outcome, e.reason);
    }

    // critest removes what it made; nothing may be left behind in vessel either.
    let leftovers = daemon::mounts_under(v.dir.path());
    let ips = cni.allocated_ips();
    assert!(
        verdict.ok() && leftovers.is_empty() && ips.is_empty(),
        "unexpected outcomes:\n{}\nlisted but not run (renamed?):\n{}\nmounts left: {leftovers:?}\nIPs left: {ips:?}\nvesseld log tail:\n{}",
        verdict.unexpected.join("\n"),
        verdict.unknown.join("\n"),
        v.log().lines().rev().take(40).collect::<Vec<_>>().join("\n"),
    );
}
