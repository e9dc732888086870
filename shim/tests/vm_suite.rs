//! The VM test suite (images/guest/harness/l1-tests.sh) from `cargo test`.
//!
//! * KVM usable here (real hardware virtualisation): `scripts/vm-harness.sh direct`.
//! * Otherwise the nested harness (QEMU/TCG L1 with nested SVM, ~130 s on 2026-11-29): `scripts/vm-harness.sh`.
//!
//! It runs when the guest kernel is already in the build cache (building it takes 5-20 minutes,
//! more than a test may), QEMU is installed and we are root; otherwise it prints
//! `SKIP vm_suite: <reason>`. `VESSEL_VM_HARNESS=1` forces a run (building the kernel if
//! needed), `VESSEL_VM_HARNESS=0` skips it. The shim is the debug build the tests already made.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::path::Path;
use std::process::Command;

use vessel_vmm::probe::{probe, Verdict};

#[test]
fn vm_suite() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let force = std::env::var("VESSEL_VM_HARNESS").ok();
    if force.as_deref() == Some("0") {
        println!("SKIP vm_suite: VESSEL_VM_HARNESS=0");
        return;
    }
    let forced = force.as_deref() == Some("1");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIP vm_suite: needs root (taps, kernel build cache, KVM)");
        return;
    }
    let p = probe();
    let mode = if p.verdict == Verdict::Usable {
        "direct"
    } else {
        "test"
    };
    if mode == "test"
        && Command::new("qemu-system-x86_64")
            .arg("--version")
            .output()
            .is_err()
    {
        println!(
            "SKIP vm_suite: KVM is {} here ({}) and qemu-system-x86_64 is not installed (scripts/deps.sh)",
            p.verdict, p.reason
        );
        return;
    }
    if !forced {
        let cached = Command::new("bash")
            .arg(root.join("scripts/build-guest-kernel.sh"))
            .arg("--print")
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .is_some_and(|d| !d.is_empty() && Path::new(&d).join("bzImage").exists());
        if !cached {
            println!(
                "SKIP vm_suite: the guest kernel is not built yet (run scripts/build-guest-kernel.sh, \
                 or set VESSEL_VM_HARNESS=1)"
            );
            return;
        }
    }
    println!(
        "vm_suite: KVM here is {} ({}); running the suite {mode}",
        p.verdict, p.reason
    );
    let out = Command::new("bash")
        .arg(root.join("scripts/vm-harness.sh"))
        .arg(mode)
        .env("VESSEL_PROFILE", "debug")
        .env(
            "VESSEL_HARNESS_TIMEOUT",
            std::env::var("VESSEL_HARNESS_TIMEOUT").unwrap_or("240".into()),
        )
        .output()
        .expect("running scripts/vm-harness.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "VM suite failed");
    assert!(stdout.contains(" passed, 0 failed"), "no summary line");
}
