//! An image layer (a tar stream) from a registry: unpacking it must not panic and must not
//! write outside its directory, whatever the bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vessel_images::unpack::{unpack_layer, UnpackLimits, UnpackOptions};

fuzz_target!(|data: &[u8]| {
    let t = tempfile::tempdir().expect("temp dir");
    let dest = t.path().join("layer");
    std::fs::create_dir(&dest).expect("layer dir");
    let opts = UnpackOptions {
        skip_sync: true,
        limits: UnpackLimits {
            max_bytes: 16 << 20,
            ..Default::default()
        },
        ..Default::default()
    };
    let _ = unpack_layer(data, &dest, &opts);
    let beside: Vec<_> = std::fs::read_dir(t.path())
        .expect("read temp dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(beside, ["layer"], "the unpack wrote beside its directory");
});
