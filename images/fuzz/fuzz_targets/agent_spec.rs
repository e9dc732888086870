//! The OCI spec vesseld sends the pod agent with CreateContainer, as the agent reads and
//! rewrites it for libcontainer (rootfs, namespaces, capabilities, seccomp operands): refused
//! or prepared, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    if let Ok(spec) = vessel_agent::spec::prepare(data, "ctr", Path::new("/rootfs"), false, 1) {
        assert_eq!(
            spec.root().as_ref().map(|r| r.path().as_path()),
            Some(Path::new("/rootfs"))
        );
    }
});
