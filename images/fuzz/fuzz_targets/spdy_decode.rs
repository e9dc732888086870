//! A SPDY/3.1 stream from a streaming client (exec, attach, port-forward): decoding must not
//! panic, loop, or return a frame without consuming input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vessel_spdy::Codec;

fuzz_target!(|data: &[u8]| {
    let mut c = Codec::new();
    let mut buf = data.to_vec();
    for _ in 0..10_000 {
        let before = buf.len();
        match c.decode(&mut buf) {
            Ok(Some(_)) => assert!(buf.len() < before, "a frame consumed no input"),
            Ok(None) | Err(_) => return,
        }
    }
    panic!("the decoder loops");
});
