//! What registries and users hand vessel's image service: references, digests,
//! WWW-Authenticate challenges, platforms, manifests, indexes and image configs. The first
//! byte picks the parser; none may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vessel_images::oci::{ImageConfig, Index, Manifest, Platform};

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    match which % 7 {
        0 => {
            if let Ok(r) = vessel_images::Reference::parse(&text) {
                // What vessel prints of a reference parses back to the same reference.
                let again = vessel_images::Reference::parse(&r.to_string())
                    .expect("a printed reference parses");
                assert_eq!(again.to_string(), r.to_string());
            }
        }
        1 => {
            let _ = text.parse::<vessel_images::Digest>();
        }
        2 => {
            let _ = vessel_images::challenge::parse_challenges(&text);
        }
        3 => {
            let _ = Platform::parse(&text);
        }
        4 => {
            let _ = serde_json::from_slice::<Manifest>(rest);
        }
        5 => {
            let _ = serde_json::from_slice::<Index>(rest);
        }
        _ => {
            let _ = serde_json::from_slice::<ImageConfig>(rest);
        }
    }
});
