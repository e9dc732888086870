//! Upstream `critest` (cri-tools v1.36.0, built offline from `../shared/cri-tools`) against a
//! live vesseld running flat pods on a private bridge CNI network, with critest's images served
//! by stand-ins on 127.0.0.1 and pulled through vessel's registry client (mirrors).
//!
//! The outcome of every spec is judged against `critest/upstream/flat.expected`: a spec not
//! listed must pass, a listed one must end as listed (so the list only shrinks).
//!
//! Prints `SKIP upstream_critest_flat: <reason>` when not root or without `shared/cri-tools`.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::path::Path;
use std::process::Command;
use std::time::Instant;
use vessel_critest::daemon;
use vessel_critest::upstream;

#[test]
fn upstream_critest_flat() {
    let Some(f) = upstream::Fixture::start(
        "upstream_critest_flat",
        Path::new(env!("CARGO_BIN_EXE_vesseld")),
    ) else {
        return;
    };
    let expected_path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../critest/upstream/flat.expected");
    let expected = upstream::parse_expected(
        &std::fs::read_to_string(&expected_path).expect("the expected-outcomes list"),
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
        .arg("-ginkgo.timeout=30m")
        .output()
        .expect("running critest");
    let took = t.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    // critest's own summary: "Ran N of M Specs ...", "FAIL! -- ..." / "SUCCESS! -- ...".
    println!("upstream critest v1.36.0 against flat pods, {took:.0?}; its summary:");
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
    let specs = upstream::parse_report(&json).expect("critest's JSON report");
    let verdict = upstream::judge(&specs, &expected);
    println!(
        "upstream critest (flat pods): {} passed, {} failed, {} skipped of {} specs; {} listed as expected failures or skips in {}",
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
