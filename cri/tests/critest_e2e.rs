//! The whole vessel-critest conformance suite against a live vesseld (flat pods).

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::path::Path;
use vessel_critest::daemon::{TestCni, Vesseld};
use vessel_critest::suite::{self, Outcome};

/// Specs that fail against vessel today, with why. When a feature lands, its spec starts
/// passing and this test asks for it to be taken off the list.
const KNOWN_FAILURES: &[(&str, &str)] = &[];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn critest_conformance_against_flat_pods() {
    // A private CNI network (bridge + portmap + loopback from /usr/lib/cni), so that the
    // network specs run.
    let cni = TestCni::new().expect("CNI plugins for the network specs");
    let v = Vesseld::start(Path::new(env!("CARGO_BIN_EXE_vesseld")), &cni.config_toml())
        .expect("vesseld");
    let mut cfg = suite::Config::new(format!("unix://{}", v.socket.display()));
    cfg.parallel = 2;
    // One labelled summary below instead of a line per spec, so that the expected failures
    // are not mistaken for this test's result in CI logs.
    cfg.print = false;
    // VESSEL_CRITEST_FOCUS narrows the run when debugging one spec.
    if let Ok(f) = std::env::var("VESSEL_CRITEST_FOCUS") {
        cfg.focus = Some(f);
    }
    // The static vsock probe of the VM harness, for the spec that tries AF_VSOCK from inside
    // a container (skipped, with the reason, where there is no C compiler).
    let probe_dir = tempfile::tempdir().expect("temp dir");
    cfg.vsock_probe = build_vsock_probe(probe_dir.path());
    let summary = suite::run(cfg).await.expect("running the suite");
    let known = |n: &str| KNOWN_FAILURES.iter().any(|(k, _)| *k == n);
    let mut unexpected = Vec::new();
    let mut fixed = Vec::new();
    for s in &summary.specs {
        let name = format!("[{}] {}", s.group, s.name);
        match (&s.outcome, known(&name)) {
            (Outcome::Fail(_), false) => unexpected.push(s.line()),
            (Outcome::Pass, true) => fixed.push(name),
            _ => {}
        }
    }
    println!(
        "vessel-critest against flat pods: {} specs, {} pass, {} skipped, {} expected failures:",
        summary.specs.len(),
        summary.passed,
        summary.skipped,
        KNOWN_FAILURES.len()
    );
    for (name, why) in KNOWN_FAILURES {
        println!("  expected failure {name}: {why}");
    }
    assert!(
        unexpected.is_empty() && fixed.is_empty(),
        "{}\nunexpected failures:\n{}\nnow passing, take off KNOWN_FAILURES:\n{}\nvesseld log tail:\n{}",
        summary.closing_line(),
        unexpected.join("\n"),
        fixed.join("\n"),
        v.log().lines().rev().take(40).collect::<Vec<_>>().join("\n"),
    );
}

/// `gcc -static images/guest/harness/vsock-echo.c` into `dir`; `None` (with the reason
/// printed) where that cannot be done.
fn build_vsock_probe(dir: &Path) -> Option<std::path::PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../images/guest/harness/vsock-echo.c");
    let out = dir.join("vsock-echo");
    match std::process::Command::new("gcc")
        .args(["-static", "-O2", "-o"])
        .arg(&out)
        .arg(&src)
        .output()
    {
        Ok(o) if o.status.success() => Some(out),
        Ok(o) => {
            println!(
                "no vsock probe: gcc -static failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            None
        }
        Err(e) => {
            println!("no vsock probe: gcc: {e}");
            None
        }
    }
}
