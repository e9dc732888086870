//! The shim's jail, entered as `vessel-shim run` enters it (`vessel-shim jail-check`): what
//! a VMM that a guest took over could reach on the host. Needs root (mount, pid and network
//! namespaces); skipped with a reason otherwise.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn mount(args: &[&str]) {
    let st = Command::new("mount").args(args).status().unwrap();
    assert!(st.success(), "mount {args:?}");
}

fn state_of(pid: u32) -> Option<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("State:"))
        .map(|s| s.trim().to_string())
}

#[test]
fn a_jailed_vmm_sees_its_own_directory_and_images_only() {
    if !is_root() {
        eprintln!("SKIP: the jail needs root (mount, pid and network namespaces)");
        return;
    }
    let host = tempfile::tempdir().unwrap();
    let vm = host.path().join("vm");
    let images = host.path().join("images");
    let secret = host.path().join("secret");
    for d in [&vm, &images] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(&secret, "host only").unwrap();
    for f in ["vmlinux", "initrd", "ro.img", "rw.img"] {
        std::fs::write(images.join(f), [0u8; 512]).unwrap();
    }
    std::fs::write(vm.join("console.log"), "").unwrap();
    // The volume share as vesseld makes it: a tmpfs of its own, a shared mount.
    let shared = vm.join("shared");
    std::fs::create_dir_all(&shared).unwrap();
    mount(&[
        "-t",
        "tmpfs",
        "-o",
        "size=1m",
        "test-share",
        shared.to_str().unwrap(),
    ]);
    mount(&["--make-shared", shared.to_str().unwrap()]);
    let p = |x: &Path| x.display().to_string();
    let spec = vm.join("spec.json");
    let body = serde_json::json!({
        "kernel": images.join("vmlinux"), "initrd": images.join("initrd"),
        "mem_mib": 64, "vcpus": 1,
        "disks": [{"path": images.join("ro.img"), "read_only": true},
                  {"path": images.join("rw.img")}],
        "console": "off",
        "vsock": {"uds_path": vm.join("v.sock")},
        "shared_dirs": [{"tag": "vessel", "path": shared}],
        "control_socket": vm.join("ctl.sock"),
        "log_file": vm.join("shim.log"),
        "jail": true,
    });
    std::fs::write(&spec, body.to_string()).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vessel-shim"))
        .arg("jail-check")
        .arg("--spec")
        .arg(&spec)
        .args(["--open", &p(&secret), "--open", "/etc/passwd"])
        .args([
            "--open",
            "/proc/1/root/etc/passwd",
            "--open",
            "/proc/sys/kernel/core_pattern",
        ])
        .args(["--open", &p(&images.join("vmlinux")), "--open", "/dev/kvm"])
        .args([
            "--write",
            &p(&images.join("vmlinux")),
            "--write",
            &p(&images.join("ro.img")),
        ])
        .args(["--write", &p(&images.join("rw.img")), "--write", &p(&spec)])
        .args(["--write", &p(&vm.join("console.log"))])
        .args(["--hold-ms", "30000"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
    let supervisor = child.id();
    let vmm: u32 =
        std::fs::read_to_string(format!("/proc/{supervisor}/task/{supervisor}/children"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();

    // Checked while the jail is alive: a volume mounted into the share now still arrives.
    let vol = tempfile::tempdir().unwrap();
    std::fs::write(vol.path().join("data"), "volume").unwrap();
    let at = shared.join("vol");
    std::fs::create_dir_all(&at).unwrap();
    mount(&["--bind", &p(vol.path()), &p(&at)]);
    let seen = std::fs::read_to_string(format!("/proc/{vmm}/root{}/data", at.display()));
    let root: Vec<String> = std::fs::read_dir(format!("/proc/{vmm}/root"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let _ = Command::new("umount").arg("-R").arg(&shared).status();

    let _ = child.kill(); // the supervisor: PDEATHSIG takes the VMM with it
    let _ = child.wait();
    let deadline = Instant::now() + Duration::from_secs(5);
    while state_of(vmm).is_some_and(|s| !s.starts_with('Z')) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let vmm_state = state_of(vmm);

    assert_eq!(seen.ok().as_deref(), Some("volume"), "{line}");
    let mut root_sorted = root.clone();
    root_sorted.sort();
    let top = host
        .path()
        .components()
        .nth(1)
        .unwrap()
        .as_os_str()
        .to_string_lossy()
        .into_owned();
    assert_eq!(
        root_sorted,
        vec!["dev".to_string(), "proc".into(), top],
        "{line}"
    );
    assert_eq!(v["pid"], 1, "{line}");
    assert_eq!(v["host_pid"], supervisor, "{line}");
    assert_eq!(v["capabilities"], 0, "{line}");
    assert_eq!(v["no_new_privs"], true, "{line}");
    // The seccomp filter (mode 2): running a program or forking is refused (EPERM, where a
    // missing program would otherwise be ENOENT).
    assert_eq!(v["seccomp"], "2", "{line}");
    assert_eq!(
        v["execve"], "Operation not permitted (os error 1)",
        "{line}"
    );
    assert_eq!(v["fork"], "Operation not permitted (os error 1)", "{line}");
    assert_eq!(v["x32"], "Operation not permitted (os error 1)", "{line}");
    // Each thread kind's allow-list: vCPUs and device workers open files for reading only
    // (the seccomp refusal, EPERM, comes before the read-only root's EROFS), file servers
    // make no socket.
    let eperm = "Operation not permitted (os error 1)";
    let erofs_early = "Read-only file system (os error 30)";
    for (role, create, socket) in [
        ("vcpu", eperm, "ok"),
        ("device", eperm, "ok"),
        ("file-server", erofs_early, eperm),
    ] {
        assert_eq!(v["threads"][role]["read"], "ok", "{role}: {line}");
        assert_eq!(v["threads"][role]["create"], create, "{role}: {line}");
        assert_eq!(v["threads"][role]["socket"], socket, "{role}: {line}");
    }
    assert_eq!(
        v["proc"],
        serde_json::json!(["1", "self", "thread-self"]),
        "{line}"
    );
    let enoent = "No such file or directory (os error 2)";
    let erofs = "Read-only file system (os error 30)";
    for (path, want) in [
        (p(&secret), enoent),
        ("/etc/passwd".into(), enoent),
        ("/proc/1/root/etc/passwd".into(), enoent),
        ("/proc/sys/kernel/core_pattern".into(), enoent),
        (p(&images.join("vmlinux")), "ok"),
        ("/dev/kvm".into(), "ok"),
    ] {
        assert_eq!(v["open"][&path], want, "open {path}: {line}");
    }
    for (path, want) in [
        (p(&images.join("vmlinux")), erofs),
        (p(&images.join("ro.img")), erofs),
        (p(&images.join("rw.img")), "ok"),
        (p(&spec), erofs),
        (p(&vm.join("console.log")), "ok"),
    ] {
        assert_eq!(v["write"][&path], want, "write {path}: {line}");
    }
    for ns in ["pid", "mnt", "net", "ipc", "uts"] {
        let ours = std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
        assert_ne!(v["namespaces"][ns], p(&ours), "{ns}: {line}");
    }
    assert!(
        vmm_state.as_deref().is_none_or(|s| s.starts_with('Z')),
        "the VMM outlived its supervisor: {vmm_state:?}"
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains("vessel-jail"), "{mounts}");
}
