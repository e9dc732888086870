//! Bad input to `vessel-shim run`: each fails before the guest runs, with exit status 1, a
//! clear message on stderr and an `{"outcome":"error",...}` line on stdout, and leaves no
//! socket behind. None of this needs a fast KVM; the cases that open /dev/kvm are skipped
//! where there is none.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::path::Path;
use std::process::Command;

fn run(spec: &Path) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vessel-shim"))
        .args(["run", "--spec"])
        .arg(spec)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write_spec(dir: &Path, name: &str, body: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

#[test]
fn missing_kernel() {
    let d = tempfile::tempdir().unwrap();
    let s = write_spec(
        d.path(),
        "s.json",
        r#"{"kernel":"/nonexistent/vmlinux","mem_mib":64,"vcpus":1}"#,
    );
    let (rc, out, err) = run(&s);
    assert_eq!(rc, 1);
    assert!(err.contains("/nonexistent/vmlinux"), "{err}");
    assert!(out.contains(r#""outcome":"error""#), "{out}");
}

#[test]
fn memory_larger_than_the_host() {
    let d = tempfile::tempdir().unwrap();
    let k = write_spec(d.path(), "k", "x");
    let s = write_spec(
        d.path(),
        "s.json",
        &format!(
            r#"{{"kernel":"{}","mem_mib":100000000,"vcpus":1}}"#,
            k.display()
        ),
    );
    let (rc, _, err) = run(&s);
    assert_eq!(rc, 1);
    assert!(err.contains("more than this host has"), "{err}");
}

#[test]
fn misspelt_spec_key() {
    let d = tempfile::tempdir().unwrap();
    let s = write_spec(
        d.path(),
        "s.json",
        r#"{"kernel":"/k","mem_mib":64,"vcpus":1,"vcpu":2}"#,
    );
    let (rc, _, err) = run(&s);
    assert_ne!(rc, 0);
    assert!(err.contains("vcpu"), "{err}");
}

#[test]
fn corrupt_kernel_bad_disk_bad_tap_leave_no_socket() {
    if !Path::new("/dev/kvm").exists() {
        println!("SKIP corrupt_kernel_bad_disk_bad_tap_leave_no_socket: no /dev/kvm");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("v.sock");
    let junk = write_spec(d.path(), "junk", &"\u{1}".repeat(100_000));
    let cases = [
        (
            "corrupt kernel",
            junk.display().to_string(),
            r#""disks":[]"#.to_string(),
            "not an ELF vmlinux or x86 bzImage",
        ),
        (
            "bad disk",
            String::new(),
            r#""disks":[{"path":"/nonexistent/disk.img"}]"#.to_string(),
            "disk image /nonexistent/disk.img",
        ),
        (
            "bad tap",
            String::new(),
            r#""nets":[{"tap":"vessel-none0"}]"#.to_string(),
            "tap vessel-none0: no such interface",
        ),
        (
            "tap fd not its own",
            String::new(),
            r#""nets":[{"tap_fd":1,"queue_fds":[1]}]"#.to_string(),
            "tap fd 1 is not an open descriptor of its own",
        ),
    ];
    // A real kernel for the cases that get past the kernel check: any file in /boot that is one.
    let real = std::fs::read_dir("/boot").ok().and_then(|r| {
        r.flatten()
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().contains("vmlinuz"))
    });
    for (what, kernel, extra, msg) in cases {
        let kernel = if kernel.is_empty() {
            match &real {
                Some(k) => k.display().to_string(),
                None => {
                    println!("SKIP {what}: no kernel in /boot");
                    continue;
                }
            }
        } else {
            kernel
        };
        let s = write_spec(
            d.path(),
            "s.json",
            &format!(
                r#"{{"kernel":"{kernel}","mem_mib":64,"vcpus":1,{extra},"vsock":{{"uds_path":"{}"}}}}"#,
                sock.display()
            ),
        );
        let (rc, out, err) = run(&s);
        assert_eq!(rc, 1, "{what}: {err}");
        assert!(err.contains(msg), "{what}: {err}");
        assert!(out.contains(r#""outcome":"error""#), "{what}: {out}");
        assert!(!sock.exists(), "{what}: the vsock socket was left behind");
    }
}

#[test]
fn vsock_connect_without_a_vm_is_a_clear_error() {
    let d = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_vessel-shim"))
        .args(["vsock-connect", "--socket"])
        .arg(d.path().join("none.sock"))
        .args(["--port", "1024"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("none.sock"), "{err}");
}

#[test]
fn a_failed_start_leaves_no_control_or_log_socket() {
    let d = tempfile::tempdir().unwrap();
    let (ctl, vs) = (d.path().join("control.sock"), d.path().join("v.sock"));
    let s = write_spec(
        d.path(),
        "s.json",
        &format!(
            r#"{{"kernel":"/nonexistent/vmlinux","mem_mib":64,"vcpus":1,"spare_disks":2,
                "control_socket":"{}","log_port":1025,"vsock":{{"uds_path":"{}"}}}}"#,
            ctl.display(),
            vs.display()
        ),
    );
    let (rc, out, err) = run(&s);
    assert_eq!(rc, 1, "{err}");
    assert!(out.contains(r#""outcome":"error""#), "{out}");
    assert!(!ctl.exists() && !vs.exists() && !d.path().join("v.sock_1025").exists());
}
