//! Mutation fuzzing of the layer unpacker, short enough for CI: a small layer with every
//! entry kind (directories, files, symlinks, a hard link, a whiteout, an opaque directory, a
//! long name) has bytes flipped, inserted and removed and is cut, and each mutant is unpacked
//! into a fresh directory. The unpacker must never panic and never write outside that
//! directory (a sentinel beside it stays untouched); it may refuse the layer.
//! The parsers of registry and user input get the same treatment. `VESSEL_FUZZ_ITERS` sets the
//! number of mutants (default 1500 layers, 200000 per parser), `VESSEL_FUZZ_SEED` the seed.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use vessel_images::testimages::LayerBuilder;
use vessel_images::testrng::{env_u64, Rng};
use vessel_images::unpack::{unpack_layer, UnpackOptions};

fn seed_layer() -> Vec<u8> {
    let mut l = LayerBuilder::new();
    l.dir("etc", 0o755)
        .file("etc/passwd", 0o644, b"root:x:0:0::/root:/bin/sh\n")
        .dir("bin", 0o755)
        .file("bin/tool", 0o755, &[0x7f, b'E', b'L', b'F', 2, 1, 1, 0])
        .symlink("bin/alias", "tool")
        .hardlink("bin/again", "bin/tool")
        .dir("var/lib/app", 0o700)
        .whiteout("var/lib/old")
        .opaque("var/lib/app")
        .file(&format!("deep/{}/name", "x".repeat(120)), 0o600, b"long");
    l.finish()
}

/// Rewrites the checksum of every 512-byte block that looks like a tar header (ustar
/// magic), so that mutants get past the checksum into the unpacker's own checks.
fn fix_checksums(data: &mut [u8]) {
    for block in data.chunks_exact_mut(512) {
        if &block[257..262] != b"ustar" {
            continue;
        }
        block[148..156].fill(b' ');
        let sum: u32 = block.iter().map(|b| u32::from(*b)).sum();
        let field = format!("{sum:06o}\0 ");
        block[148..156].copy_from_slice(field.as_bytes());
    }
}

fn mutate(rng: &mut Rng, data: &mut Vec<u8>) {
    for _ in 0..=rng.below(6) {
        let at = rng.below(data.len() + 1);
        match rng.below(7) {
            0..=2 if at < data.len() => data[at] ^= 1 << rng.below(8),
            // Characters that matter in tar headers and paths.
            3 if at < data.len() => data[at] = b"/.0 7\0x"[rng.below(7)],
            4 => data.insert(at, (rng.next_u64() & 0xff) as u8),
            5 if at < data.len() => {
                data.remove(at);
            }
            _ => data.truncate(at.max(512)),
        }
    }
}

#[test]
fn the_unpacker_survives_mutated_layers_and_stays_inside() {
    let iters = env_u64("VESSEL_FUZZ_ITERS", 1500);
    let seed = env_u64("VESSEL_FUZZ_SEED", 0x7a12_0001);
    println!("layer unpack fuzz: {iters} mutants, VESSEL_FUZZ_SEED={seed}");
    let mut rng = Rng::new(seed);
    let base = seed_layer();
    let t = tempfile::tempdir().unwrap();
    let sentinel = t.path().join("sentinel");
    std::fs::create_dir(&sentinel).unwrap();
    std::fs::write(sentinel.join("keep"), b"untouched").unwrap();
    let opts = UnpackOptions {
        same_owner: rustix::process::geteuid().is_root(),
        skip_sync: true,
        ..Default::default()
    };
    std::fs::create_dir(t.path().join("seed")).unwrap();
    let ok = unpack_layer(&base[..], &t.path().join("seed"), &opts);
    assert!(ok.is_ok(), "the seed layer unpacks: {:?}", ok.err());
    let (mut accepted, mut refused) = (0u64, 0u64);
    for i in 0..iters {
        let mut data = base.clone();
        if rng.below(5) == 0 {
            mutate(&mut rng, &mut data);
        } else {
            // In place, in the headers mostly, checksums kept valid.
            for _ in 0..=rng.below(4) {
                let block = rng.below(data.len() / 512) * 512;
                let at = (block + rng.below(512)).min(data.len() - 1);
                data[at] = match rng.below(3) {
                    0 => data[at] ^ (1 << rng.below(8)),
                    1 => b"/.0 7\0x1"[rng.below(8)],
                    _ => (rng.next_u64() & 0xff) as u8,
                };
            }
            fix_checksums(&mut data);
        }
        let dest = t.path().join(format!("d{i}"));
        std::fs::create_dir(&dest).unwrap();
        match unpack_layer(&data[..], &dest, &opts) {
            Ok(_) => accepted += 1,
            Err(_) => refused += 1,
        }
        let _ = vessel_images::fsutil::remove_any(&dest);
        let mut beside: Vec<_> = std::fs::read_dir(t.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        beside.sort();
        assert_eq!(
            beside,
            ["seed", "sentinel"],
            "mutant {i} wrote beside its directory"
        );
        assert_eq!(std::fs::read(sentinel.join("keep")).unwrap(), b"untouched");
        assert_eq!(std::fs::read_dir(&sentinel).unwrap().count(), 1);
    }
    println!(
        "layer unpack fuzz: {accepted} accepted, {refused} refused, no panic, nothing outside"
    );
}

/// Mutates a text seed (bytes flipped, inserted, removed, cut; kept UTF-8 by lossy decoding).
fn mutate_text(rng: &mut Rng, seed: &str) -> String {
    let mut b = seed.as_bytes().to_vec();
    for _ in 0..=rng.below(5) {
        let at = rng.below(b.len() + 1);
        match rng.below(5) {
            0 if at < b.len() => b[at] ^= 1 << rng.below(7),
            1 if at < b.len() => b[at] = b"/:@.=,\"\\ a9"[rng.below(11)],
            2 => b.insert(at, b"/:@.=,\"\\ a9"[rng.below(11)]),
            3 if at < b.len() => {
                b.remove(at);
            }
            _ => b.truncate(at),
        }
    }
    String::from_utf8_lossy(&b).into_owned()
}

/// The parsers of what registries and users hand vessel: image references, digests,
/// WWW-Authenticate challenges, platforms, manifests and indexes. None may panic.
#[test]
fn the_parsers_survive_mutated_input() {
    let iters = env_u64("VESSEL_FUZZ_ITERS", 200_000);
    let seed = env_u64("VESSEL_FUZZ_SEED", 0x7a12_0002);
    println!("parser fuzz: {iters} mutants per input kind, VESSEL_FUZZ_SEED={seed}");
    let mut rng = Rng::new(seed);
    let hex = "0123456789abcdef".repeat(4);
    let reference = format!("registry.local:5000/library/busybox:1.36@sha256:{hex}");
    let digest = format!("sha256:{hex}");
    let challenge = r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:library/busybox:pull",error="insufficient_scope""#;
    let img =
        vessel_images::testimages::busybox_image(vessel_images::testimages::Compression::Gzip);
    let manifest = String::from_utf8(img.manifest.data.clone()).unwrap();
    let index = String::from_utf8(
        vessel_images::testimages::multiarch_index()
            .top()
            .data
            .clone(),
    )
    .unwrap();
    let mut ok = 0u64;
    for _ in 0..iters {
        ok +=
            u64::from(vessel_images::Reference::parse(&mutate_text(&mut rng, &reference)).is_ok());
        ok += u64::from(
            mutate_text(&mut rng, &digest)
                .parse::<vessel_images::Digest>()
                .is_ok(),
        );
        ok += vessel_images::challenge::parse_challenges(&mutate_text(&mut rng, challenge)).len()
            as u64;
        ok += u64::from(
            vessel_images::oci::Platform::parse(&mutate_text(&mut rng, "linux/arm64/v8")).is_some(),
        );
        ok += u64::from(
            serde_json::from_str::<vessel_images::oci::Manifest>(&mutate_text(&mut rng, &manifest))
                .is_ok(),
        );
        ok += u64::from(
            serde_json::from_str::<vessel_images::oci::Index>(&mutate_text(&mut rng, &index))
                .is_ok(),
        );
    }
    println!("parser fuzz: {ok} accepted, no panic");
}
