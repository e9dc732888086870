//! The KVM probe on the machine running the tests.
//!
//! `VESSEL_EXPECT_KVM=unusable|usable|absent` asserts the verdict (the development machine's
//! emulating KVM must come out unusable; the nested harness expects usable). Without it the
//! test prints the verdict and evidence and checks only that the probe is consistent and fast.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use vessel_vmm::probe::{probe, Verdict};

#[test]
fn probe_this_host() {
    let r = probe();
    println!("probe: {}", serde_json::to_string(&r).unwrap());
    if let Some(e) = &r.evidence {
        println!(
            "probe: verdict={} ratio={:.1}x guest={:.3}ns/iter native={:.3}ns/iter exit_round_trip={:.0}ns in {:.0}ms",
            r.verdict, e.ratio, e.guest_ns_per_iter, e.native_ns_per_iter, e.exit_round_trip_ns, r.probe_ms
        );
        assert_eq!(r.verdict == Verdict::Unusable, e.ratio > e.threshold_ratio);
    } else {
        println!("probe: verdict={} reason={}", r.verdict, r.reason);
        assert_ne!(r.verdict, Verdict::Usable);
    }
    assert!(r.probe_ms < 2000.0, "probe took {} ms", r.probe_ms);
    match std::env::var("VESSEL_EXPECT_KVM").as_deref() {
        Ok("unusable") => assert_eq!(r.verdict, Verdict::Unusable, "{}", r.reason),
        Ok("usable") => assert_eq!(r.verdict, Verdict::Usable, "{}", r.reason),
        Ok("absent") => assert_eq!(r.verdict, Verdict::Absent, "{}", r.reason),
        _ => {}
    }
}
