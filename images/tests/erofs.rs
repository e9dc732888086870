//! EROFS layer images: built from an unpacked layer with `mkfs.erofs`, cached, shared, collected.
//!
//! Content is checked with erofs-utils (`fsck.erofs --extract`, `dump.erofs`) and, where this
//! runs as root on a kernel with EROFS, by mounting the image read-only on a loop device.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use vessel_images::erofs::{ErofsCompression, ErofsOptions};
use vessel_images::testimages::LayerBuilder;
use vessel_images::{Digest, ImageStore};

fn have(tool: &str) -> bool {
    Command::new(tool).arg("--help").output().is_ok()
}

/// erofs-utils present, and root (the layer's whiteout device and foreign owners need it).
fn usable() -> bool {
    if !have("mkfs.erofs") || !have("fsck.erofs") || !have("dump.erofs") {
        eprintln!("skipping: erofs-utils (mkfs.erofs, fsck.erofs, dump.erofs) not installed");
        return false;
    }
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipping: needs root (whiteout devices, ownership)");
        return false;
    }
    true
}

/// A file (owned 1000:2000, 0640, mtime 2020), a dir, a symlink, a hard link, a whiteout and an
/// opaque dir, unpacked into a fresh store. Returns the store and the diff ID.
fn store_with_layer(root: &Path) -> (Arc<ImageStore>, Digest) {
    let tar = LayerBuilder::new()
        .mtime(1_577_836_800)
        .dir("etc", 0o755)
        .file_owned("etc/hello", 0o640, 1000, 2000, b"hello erofs\n")
        .dir("usr/share/empty", 0o700)
        .symlink("etc/link", "hello")
        .hardlink("etc/hard", "etc/hello")
        .whiteout("etc/gone")
        .dir("var/opq", 0o755)
        .file("var/opq/kept", 0o644, b"kept\n")
        .opaque("var/opq")
        .finish();
    let diff_id = Digest::of(&tar);
    let store = ImageStore::open(root).unwrap();
    store
        .unpack_layer_from(&tar[..], &diff_id, Vec::new(), None)
        .unwrap();
    (Arc::new(store), diff_id)
}

fn dump(image: &Path, path: &str) -> String {
    let out = Command::new("dump.erofs")
        .arg(format!("--path={path}"))
        .arg(image)
        .output()
        .unwrap();
    assert!(out.status.success(), "dump.erofs {path}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn field<'a>(dump: &'a str, name: &str) -> &'a str {
    let i = dump
        .find(name)
        .unwrap_or_else(|| panic!("{name} in {dump}"))
        + name.len();
    dump[i..].split_whitespace().next().unwrap()
}

fn check_image(image: &Path, work: &Path) {
    // Every file decodes; content, types, owners and modes as in the layer.
    let x = work.join("extract");
    let out = Command::new("fsck.erofs")
        .arg(format!("--extract={}", x.display()))
        .arg(image)
        .output()
        .unwrap();
    assert!(out.status.success(), "fsck.erofs: {out:?}");
    assert_eq!(fs::read(x.join("etc/hello")).unwrap(), b"hello erofs\n");
    let m = fs::metadata(x.join("etc/hello")).unwrap();
    assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (1000, 2000, 0o640));
    assert_eq!(
        fs::metadata(x.join("usr/share/empty"))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777,
        0o700
    );
    assert_eq!(
        fs::read_link(x.join("etc/link")).unwrap(),
        PathBuf::from("hello")
    );
    let wh = fs::symlink_metadata(x.join("etc/gone")).unwrap();
    assert!(
        wh.file_type().is_char_device() && wh.rdev() == 0,
        "whiteout"
    );
    assert_eq!(fs::read(x.join("var/opq/kept")).unwrap(), b"kept\n");
    assert!(!x.join("var/opq/.wh..wh..opq").exists());

    // The hard link is one inode; per-file mtimes are kept; the opaque dir carries its xattr.
    let a = dump(image, "/etc/hello");
    let b = dump(image, "/etc/hard");
    assert_eq!(field(&a, "NID:"), field(&b, "NID:"));
    assert_eq!(field(&a, "Links:"), "2");
    assert!(a.contains("Timestamp: 2020-01-01 00:00:00"), "{a}");
    let o = dump(image, "/var/opq");
    assert_ne!(field(&o, "Xattr size:"), "0", "{o}");

    mount_check(image, work);
}

/// Mounts the image (root, kernel EROFS, loop) and checks what only a mount shows: the
/// `trusted.overlay.opaque` value and the hard link's inode.
fn mount_check(image: &Path, work: &Path) {
    let _ = Command::new("modprobe").args(["-q", "erofs"]).status();
    let fss = fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !fss.lines().any(|l| l.trim_end().ends_with("erofs")) {
        eprintln!("not mounting: no EROFS in this kernel");
        return;
    }
    let mnt = work.join("mnt");
    fs::create_dir_all(&mnt).unwrap();
    let st = Command::new("mount")
        .args(["-t", "erofs", "-o", "loop,ro"])
        .arg(image)
        .arg(&mnt)
        .output()
        .unwrap();
    if !st.status.success() {
        eprintln!("not mounting: {}", String::from_utf8_lossy(&st.stderr));
        return;
    }
    let res = std::panic::catch_unwind(|| {
        let mut v = [0u8; 8];
        let n = rustix::fs::getxattr(mnt.join("var/opq"), "trusted.overlay.opaque", &mut v[..])
            .unwrap();
        assert_eq!(&v[..n], b"y");
        let a = fs::metadata(mnt.join("etc/hello")).unwrap();
        let b = fs::metadata(mnt.join("etc/hard")).unwrap();
        assert_eq!(a.ino(), b.ino());
        assert_eq!(a.mtime(), 1_577_836_800);
        let wh = fs::symlink_metadata(mnt.join("etc/gone")).unwrap();
        assert!(wh.file_type().is_char_device() && wh.rdev() == 0);
        assert_eq!(
            fs::read(mnt.join("etc/hello")).unwrap(),
            b"hello erofs\n".to_vec()
        );
    });
    let _ = Command::new("umount").arg(&mnt).status();
    if let Err(p) = res {
        std::panic::resume_unwind(p);
    }
}

#[tokio::test]
async fn builds_a_faithful_image_once() {
    if !usable() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (store, diff_id) = store_with_layer(&d.path().join("store"));
    let img = store.erofs_layer(&diff_id).await.unwrap();
    assert_eq!(
        img,
        store.root().join(format!("erofs/{}.img", diff_id.hex()))
    );
    let first = fs::metadata(&img).unwrap();
    check_image(&img, d.path());

    // Idempotent: the second call returns the same file without building again.
    let again = store.erofs_layer(&diff_id).await.unwrap();
    assert_eq!(again, img);
    assert_eq!(fs::metadata(&again).unwrap().ino(), first.ino());
    assert_eq!(store.stats.erofs_built.load(Ordering::Relaxed), 1);
    // Nothing left in tmp/.
    assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
}

#[tokio::test]
async fn uncompressed_variant_is_separate_and_faithful() {
    if !usable() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (store, diff_id) = store_with_layer(&d.path().join("store"));
    let opts = ErofsOptions {
        compression: ErofsCompression::None,
        ..ErofsOptions::default()
    };
    let img = store.erofs_layer_with(&diff_id, &opts).await.unwrap();
    assert!(img.ends_with(format!("{}.uncompressed.img", diff_id.hex())));
    check_image(&img, d.path());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_callers_build_once() {
    if !usable() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (store, diff_id) = store_with_layer(&d.path().join("store"));
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let s = store.clone();
            let id = diff_id.clone();
            tokio::spawn(async move { s.erofs_layer(&id).await.unwrap() })
        })
        .collect();
    let mut paths = Vec::new();
    for t in tasks {
        paths.push(t.await.unwrap());
    }
    assert!(paths.iter().all(|p| p == &paths[0]));
    assert_eq!(store.stats.erofs_built.load(Ordering::Relaxed), 1);
    assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
}

#[tokio::test]
async fn gc_removes_the_image_with_its_layer() {
    if !usable() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (store, diff_id) = store_with_layer(&d.path().join("store"));
    let pin = store.pin([diff_id.hex().to_string()]);
    let img = store.erofs_layer(&diff_id).await.unwrap();
    let (used_before, _) = store.usage().unwrap();
    assert!(used_before >= fs::metadata(&img).unwrap().len());
    // Kept while the layer is.
    store.gc().unwrap();
    assert!(img.is_file() && store.has_layer(&diff_id));
    drop(pin);
    store.gc().unwrap();
    assert!(!store.has_layer(&diff_id));
    assert!(!img.exists());
    assert_eq!(fs::read_dir(store.erofs_dir()).unwrap().count(), 0);
    // And the layer is needed to build one.
    let err = store.erofs_layer(&diff_id).await.unwrap_err();
    assert!(err.to_string().contains("not in the store"), "{err}");
}

#[tokio::test]
async fn crash_debris_is_collected_at_open() {
    if !usable() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let root = d.path().join("store");
    let (store, _) = store_with_layer(&root);
    // What a build killed mid-way leaves: a temp image of a dead process in tmp/.
    let debris = store.tmp_dir().join("2147483632.erofs.1.tmp");
    fs::write(&debris, b"half an image").unwrap();
    drop(store);
    let store = ImageStore::open(&root).unwrap();
    assert!(!debris.exists());
    drop(store);
}

#[tokio::test]
async fn mkfs_failure_is_reported_and_leaves_nothing() {
    if !usable() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (store, diff_id) = store_with_layer(&d.path().join("store"));
    let opts = ErofsOptions {
        mkfs: PathBuf::from("false"),
        ..ErofsOptions::default()
    };
    let err = store.erofs_layer_with(&diff_id, &opts).await.unwrap_err();
    assert!(err.to_string().contains("EROFS"), "{err}");
    assert!(!store.erofs_path(&diff_id, &opts).exists());
    assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
    let opts = ErofsOptions {
        mkfs: PathBuf::from("/nonexistent/mkfs.erofs"),
        ..ErofsOptions::default()
    };
    let err = store.erofs_layer_with(&diff_id, &opts).await.unwrap_err();
    assert!(err.to_string().contains("erofs-utils"), "{err}");
}

#[tokio::test]
async fn a_cancelled_build_leaves_nothing() {
    if !usable() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (store, diff_id) = store_with_layer(&d.path().join("store"));
    // A "mkfs.erofs" that writes part of its output and hangs.
    let slow = d.path().join("slow-mkfs");
    fs::write(
        &slow,
        "#!/bin/sh\nfor a; do out=$prev; prev=$a; done\necho partial >\"$out\"\nexec sleep 30\n",
    )
    .unwrap();
    fs::set_permissions(&slow, fs::Permissions::from_mode(0o755)).unwrap();
    let opts = ErofsOptions {
        mkfs: slow,
        ..ErofsOptions::default()
    };
    let r = tokio::time::timeout(
        std::time::Duration::from_millis(500),
        store.erofs_layer_with(&diff_id, &opts),
    )
    .await;
    assert!(r.is_err(), "the build should still be running");
    assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
    assert!(!store.erofs_path(&diff_id, &opts).exists());
    // The next call builds for real.
    let img = store.erofs_layer(&diff_id).await.unwrap();
    assert!(img.is_file());
}

/// Mounts `image` read-only on a loop device at `dir`; false where this kernel or user can't.
fn loop_mount(image: &Path, dir: &Path) -> bool {
    fs::create_dir_all(dir).unwrap();
    Command::new("mount")
        .args(["-t", "erofs", "-o", "loop,ro"])
        .arg(image)
        .arg(dir)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// What the guest does: two layer images, loop-mounted and stacked with overlayfs. The upper
/// layer's whiteout hides a lower file and its opaque directory hides the lower directory's
/// content, so both survived mkfs.erofs in the form overlayfs reads.
#[tokio::test]
async fn overlayfs_honours_whiteouts_and_opaque_dirs_in_images() {
    if !usable() {
        return;
    }
    let _ = Command::new("modprobe").args(["-q", "erofs"]).status();
    let _ = Command::new("modprobe").args(["-q", "overlay"]).status();
    let fss = fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !fss.contains("\terofs") || !fss.contains("\toverlay") {
        eprintln!("skipping: no EROFS or overlayfs in this kernel");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let store = ImageStore::open(d.path().join("store")).unwrap();
    let lower = LayerBuilder::new()
        .dir("etc", 0o755)
        .file("etc/keep", 0o644, b"keep\n")
        .file("etc/gone", 0o644, b"gone\n")
        .dir("var/opq", 0o755)
        .file("var/opq/old", 0o644, b"old\n")
        .finish();
    let upper = LayerBuilder::new()
        .whiteout("etc/gone")
        .opaque("var/opq")
        .file("var/opq/new", 0o644, b"new\n")
        .finish();
    let (lo, up) = (Digest::of(&lower), Digest::of(&upper));
    store
        .unpack_layer_from(&lower[..], &lo, Vec::new(), None)
        .unwrap();
    store
        .unpack_layer_from(&upper[..], &up, vec![store.layer_path(&lo)], None)
        .unwrap();
    let (lo_img, up_img) = (
        store.erofs_layer(&lo).await.unwrap(),
        store.erofs_layer(&up).await.unwrap(),
    );
    let (m1, m2, m) = (d.path().join("m1"), d.path().join("m2"), d.path().join("m"));
    let mut mounted = Unmount(Vec::new());
    if !loop_mount(&lo_img, &m1) {
        eprintln!("skipping: cannot loop-mount EROFS here");
        return;
    }
    mounted.0.push(m1.clone());
    assert!(loop_mount(&up_img, &m2), "mount {}", up_img.display());
    mounted.0.push(m2.clone());
    fs::create_dir_all(&m).unwrap();
    let opts = format!("ro,lowerdir={}:{}", m2.display(), m1.display());
    let o = Command::new("mount")
        .args(["-t", "overlay", "-o", &opts, "overlay"])
        .arg(&m)
        .output()
        .unwrap();
    assert!(o.status.success(), "overlay mount: {o:?}");
    mounted.0.push(m.clone());
    assert_eq!(fs::read(m.join("etc/keep")).unwrap(), b"keep\n");
    assert!(!m.join("etc/gone").exists(), "whiteout ignored");
    assert_eq!(fs::read(m.join("var/opq/new")).unwrap(), b"new\n");
    assert!(!m.join("var/opq/old").exists(), "opaque directory ignored");
    // Sanity: each image alone shows what the stack hides.
    assert!(m1.join("etc/gone").exists() && m1.join("var/opq/old").exists());
}

/// Unmounts its paths, last first, when dropped (also when an assertion fails).
struct Unmount(Vec<PathBuf>);

impl Drop for Unmount {
    fn drop(&mut self) {
        for p in self.0.iter().rev() {
            let _ = Command::new("umount").arg(p).status();
        }
    }
}
