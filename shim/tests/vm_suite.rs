//! The VM test suite (images/guest/harness/l1-tests.sh) from `cargo test`.
//!
//! * KVM usable here (real hardware virtualisation): runs `scripts/vm-harness.sh direct`.
//! * Otherwise, with `VESSEL_VM_HARNESS=1`: runs the nested harness (QEMU/TCG L1, ~5 minutes
//!   plus a guest kernel build on first use).
//! * Otherwise prints `SKIP vm_suite: <reason>` with the probe's verdict and measurement.

use std::path::Path;
use std::process::Command;

use vessel_vmm::probe::{probe, Verdict};

#[test]
fn vm_suite() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let p = probe();
    let mode = if p.verdict == Verdict::Usable {
        "direct"
    } else if std::env::var("VESSEL_VM_HARNESS").as_deref() == Ok("1") {
        "test"
    } else {
        println!(
            "SKIP vm_suite: KVM is {} here ({}); set VESSEL_VM_HARNESS=1 to run the suite in the nested QEMU harness",
            p.verdict, p.reason
        );
        return;
    };
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIP vm_suite: needs root (taps, kernel build cache, KVM)");
        return;
    }
    let out = Command::new("bash")
        .arg(root.join("scripts/vm-harness.sh"))
        .arg(mode)
        .output()
        .expect("running scripts/vm-harness.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "VM suite failed");
    assert!(stdout.contains(" passed, 0 failed"), "no summary line");
}
