//! Unpack limits through the store: a gzip bomb fails the unpack at the ratio bound, naming
//! it, and leaves nothing behind; crash debris in tmp is removed at start.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::io::Write;
use vessel_images::unpack::{UnpackError, UnpackLimits};
use vessel_images::{Digest, ImageError, ImageStore};

fn tar_with_zeros(len: usize) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_size(len as u64);
    h.set_mtime(0);
    b.append_data(
        &mut h,
        "zeros",
        std::io::Read::take(std::io::repeat(0), len as u64),
    )
    .unwrap();
    b.into_inner().unwrap()
}

#[test]
fn a_gzip_bomb_stops_at_the_ratio_bound() {
    let t = tempfile::tempdir().unwrap();
    let mut store = ImageStore::open(t.path().join("images")).unwrap();
    store.set_unpack_limits(UnpackLimits {
        max_ratio: 100,
        ratio_floor: 1 << 20,
        ..UnpackLimits::default()
    });
    let tar = tar_with_zeros(64 << 20);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    gz.write_all(&tar).unwrap();
    let gz = gz.finish().unwrap();
    assert!(gz.len() < 1 << 20, "{} compressed bytes", gz.len());
    let e = store
        .unpack_layer_from(&gz[..], &Digest::of(&tar), Vec::new(), None)
        .unwrap_err();
    match &e {
        ImageError::Unpack {
            source: UnpackError::Limit { key, .. },
            ..
        } => assert_eq!(*key, "images.max_unpack_ratio"),
        e => panic!("{e}"),
    }
    assert!(e.to_string().contains("max_unpack_ratio"), "{e}");
    assert_eq!(std::fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
    // Within the bounds the same layer unpacks.
    store.set_unpack_limits(UnpackLimits::default());
    store
        .unpack_layer_from(&gz[..], &Digest::of(&tar), Vec::new(), None)
        .unwrap();
}

#[test]
fn crash_debris_in_tmp_is_removed_at_start_even_with_a_live_pid() {
    let t = tempfile::tempdir().unwrap();
    let store = ImageStore::open(t.path().join("images")).unwrap();
    // Named as if pid 1 (always alive) had left it: pid liveness alone would keep it.
    let debris = store.tmp_dir().join("1.layer.abc.tmp");
    std::fs::create_dir_all(debris.join("usr/bin")).unwrap();
    std::fs::write(debris.join("usr/bin/big"), vec![0u8; 4096]).unwrap();
    drop(store);
    let store = ImageStore::open(t.path().join("images")).unwrap();
    store.collect_crash_leftovers().unwrap();
    assert!(!debris.exists());
}
