//! A CRI CreateContainer request (container and pod config, protobuf as kubelet sends them)
//! turned into an OCI runtime spec: refused or built, never a panic; a built spec is JSON
//! with a process to run.
#![no_main]

use vessel_cri_api::v1 as cri;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use std::path::PathBuf;
use std::sync::OnceLock;
use vessel_cri::spec::{build, SpecInput};

/// An image root filesystem with the files the spec reads: /etc/passwd, /etc/group, /bin/sh.
fn image_root() -> &'static PathBuf {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let d = tempfile::tempdir().expect("temp dir").keep();
        std::fs::create_dir_all(d.join("etc")).expect("etc");
        std::fs::create_dir_all(d.join("bin")).expect("bin");
        std::fs::write(
            d.join("etc/passwd"),
            "root:x:0:0::/root:/bin/sh\nvessel:x:1000:1000::/home:/bin/sh\n",
        )
        .expect("passwd");
        std::fs::write(
            d.join("etc/group"),
            "root:x:0:\nvessel:x:1000:\nstaff:x:50:vessel\n",
        )
        .expect("group");
        std::fs::write(d.join("bin/sh"), "").expect("sh");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    // Two protobuf messages: a 2-byte length, the container config, then the pod config.
    if data.len() < 2 {
        return;
    }
    let n = usize::from(u16::from_le_bytes([data[0], data[1]])).min(data.len() - 2);
    let (c, p) = data[2..].split_at(n);
    let Ok(config) = cri::ContainerConfig::decode(c) else {
        return;
    };
    let pod = cri::PodSandboxConfig::decode(p).unwrap_or_default();
    let image = vessel_images::oci::RunConfig {
        cmd: Some(vec!["/bin/sh".into()]),
        ..Default::default()
    };
    let root = image_root();
    let layers = [root.clone()];
    for vm_guest in [false, true] {
        let r = build(&SpecInput {
            pod: &pod,
            config: &config,
            image: &image,
            layer_dirs: &layers,
            hostname: "pod",
            pod_dir: root,
            cgroups_path: "/vessel/pod/ctr".into(),
            target_pid: None,
            cgroup_ns: vm_guest,
            apparmor: None,
            selinux: false,
            hugetlb: !vm_guest,
            swap_accounting: !vm_guest,
            vm_guest,
            shared_shm: !vm_guest,
            pid_holder: data.len() % 3 == 0,
        });
        if let Ok((spec, _user)) = r {
            assert!(spec["process"]["args"]
                .as_array()
                .is_some_and(|a| !a.is_empty()));
            serde_json::to_vec(&spec).expect("the spec serializes");
        }
    }
});
