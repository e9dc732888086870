//! Mutation fuzzing of the SPDY decoder, short enough for CI: valid frames of every kind
//! (headers compressed as a peer would) are encoded into one stream, then bytes are flipped,
//! inserted, removed and the stream cut, and each mutant is decoded to the end. The decoder
//! must never panic, loop or hand out a frame larger than its limit; it may return errors.
//! `VESSEL_FUZZ_ITERS` sets the number of mutants (default 200000), `VESSEL_FUZZ_SEED` the
//! seed (printed).

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use vessel_images::testrng::{env_u64, Rng};
use vessel_spdy::{Codec, Frame};

/// One of each frame kind, as a peer would send them.
fn seed_stream() -> Vec<u8> {
    let mut peer = Codec::new();
    let headers = vec![
        ("streamtype".to_string(), "stdout".to_string()),
        ("port".to_string(), "8080".to_string()),
        ("requestid".to_string(), "0".to_string()),
    ];
    let frames = [
        Frame::SynStream {
            stream_id: 1,
            associated: 0,
            priority: 0,
            flags: 0,
            headers: headers.clone(),
        },
        Frame::SynReply {
            stream_id: 1,
            flags: 0,
            headers: headers.clone(),
        },
        Frame::Headers {
            stream_id: 1,
            flags: 0,
            headers,
        },
        Frame::Data {
            stream_id: 1,
            flags: 1,
            data: b"hello, pod".to_vec(),
        },
        Frame::RstStream {
            stream_id: 3,
            status: 5,
        },
        Frame::Settings {
            flags: 0,
            payload: vec![0, 0, 0, 1, 0, 0, 0, 7, 0, 0, 0, 9],
        },
        Frame::Ping(7),
        Frame::GoAway {
            last_stream_id: 1,
            status: 0,
        },
        Frame::WindowUpdate {
            stream_id: 1,
            delta: 65536,
        },
    ];
    let mut out = Vec::new();
    for f in &frames {
        peer.encode(f, &mut out);
    }
    out
}

fn mutate(rng: &mut Rng, data: &mut Vec<u8>) {
    for _ in 0..=rng.below(8) {
        let at = rng.below(data.len() + 1);
        match rng.below(6) {
            0 | 1 if at < data.len() => data[at] ^= 1 << rng.below(8),
            2 if at < data.len() => data[at] = [0, 0xff, 0x7f, 0x80][rng.below(4)],
            3 => data.insert(at, (rng.next_u64() & 0xff) as u8),
            4 if at < data.len() => {
                data.remove(at);
            }
            _ => data.truncate(at),
        }
    }
}

#[test]
fn the_decoder_survives_mutated_streams() {
    let iters = env_u64("VESSEL_FUZZ_ITERS", 200_000);
    let seed = env_u64("VESSEL_FUZZ_SEED", 0x5eed_5bd1);
    println!("SPDY decoder fuzz: {iters} mutants, VESSEL_FUZZ_SEED={seed}");
    let mut rng = Rng::new(seed);
    let base = seed_stream();
    // The seed decodes cleanly.
    let mut c = Codec::new();
    let mut buf = base.clone();
    let mut n = 0;
    while let Some(_f) = c.decode(&mut buf).expect("the seed stream decodes") {
        n += 1;
    }
    assert_eq!(n, 9);
    let (mut frames, mut errors) = (0u64, 0u64);
    for _ in 0..iters {
        let mut data = base.clone();
        mutate(&mut rng, &mut data);
        let mut c = Codec::new();
        let mut steps = 0;
        loop {
            let before = data.len();
            match c.decode(&mut data) {
                Ok(Some(_)) => {
                    frames += 1;
                    assert!(
                        data.len() < before,
                        "a frame was decoded without consuming input"
                    );
                }
                Ok(None) => break,
                Err(_) => {
                    errors += 1;
                    break;
                }
            }
            steps += 1;
            assert!(steps < 10_000, "the decoder loops");
        }
    }
    println!("SPDY decoder fuzz: {frames} frames decoded, {errors} errors, no panic");
}
