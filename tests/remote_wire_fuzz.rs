//! The `lane_control` fuzz target's ground on stable Rust (fuzz/fuzz_targets/lane_control.rs): its
//! seed corpus (fuzz/seeds/lane_control) replayed, then random and mutated inputs, through the
//! same calls: the handshake's parser (`Msg::decode_handshake`), a session's `Opener::open` on
//! frames off the wire and on bodies sealed right (the parser behind the MAC), `check_geometry`
//! and `FrameNote::decode`. Every outcome is a value or an error, never a panic or a hang.
#![cfg(feature = "remote")]

use cuda_ipc::remote::wire::{End, FrameNote, Msg, Secret, Session, check_geometry};
use proptest::prelude::*;
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn sessions() -> (Session, Session) {
    let secret = Secret::new(b"fuzz".to_vec()).unwrap();
    let (s, r) = ([1; 32], [2; 32]);
    (
        Session::new(&secret, End::Sender, &s, &r),
        Session::new(&secret, End::Receiver, &s, &r),
    )
}

fn round_trips(m: &Msg) {
    assert_eq!(Msg::decode(&m.encode()[4..]).as_ref().ok(), Some(m));
}

/// What the fuzz target does with one input; returns whether a message or note parsed.
fn exercise(data: &[u8]) -> bool {
    let t = Instant::now();
    let Some((&mode, rest)) = data.split_first() else {
        return false;
    };
    let parsed = match mode % 4 {
        0 => match Msg::decode_handshake(rest) {
            Ok(m) => {
                assert!(m.is_handshake());
                round_trips(&m);
                true
            }
            Err(_) => false,
        },
        1 => {
            let (_, mut rx) = sessions();
            let mut c = rest;
            let mut any = false;
            while c.len() >= 4 {
                let n = u32::from_le_bytes(c[..4].try_into().unwrap()) as usize;
                let take = n.min(c.len() - 4);
                any |= rx.opener.open(&c[4..4 + take]).is_ok();
                c = &c[4 + take..];
            }
            any
        }
        2 => {
            let (mut tx, mut rx) = sessions();
            let sealed = tx.sealer.seal_bytes(rest);
            let r = rx.opener.open(&sealed[4..]);
            if let Ok(m) = &r {
                round_trips(m);
                if let Msg::Channel {
                    buffers,
                    buffer_bytes,
                    kind,
                    ..
                } = m
                {
                    let _ = check_geometry(*buffers, *buffer_bytes, *kind);
                }
            }
            assert!(rx.opener.open(&sealed[4..]).is_err(), "a replay is refused");
            r.is_ok()
        }
        _ => {
            let note = FrameNote::decode(&String::from_utf8_lossy(rest));
            if let Ok(n) = &note {
                assert!(n.meta.len() <= cuda_ipc::channel::META_BYTES);
                assert_eq!(FrameNote::decode(&n.encode()).ok().as_ref(), Some(n));
            }
            let mut geometry = false;
            if rest.len() >= 13 {
                let buffers = u32::from_le_bytes(rest[..4].try_into().unwrap());
                let bytes = u64::from_le_bytes(rest[4..12].try_into().unwrap());
                if let Ok(g) = check_geometry(buffers, bytes, rest[12]) {
                    assert!(g.buffers >= 1 && g.buffer_bytes >= 1 && g.kind <= 1);
                    geometry = true;
                }
            }
            note.is_ok() || geometry
        }
    };
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    parsed
}

fn corpus() -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/lane_control");
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[test]
fn the_seed_corpus_replays_and_each_seed_reaches_the_parser_it_was_made_for() {
    let seeds = corpus();
    assert!(seeds.len() >= 15, "{} seeds", seeds.len());
    for (name, data) in &seeds {
        let parsed = exercise(data);
        // The seeds are well-formed messages of their kind, except those made to be refused.
        let refused = name == "wire-frames";
        assert_eq!(parsed, !refused, "seed {name}");
    }
}

#[test]
fn a_session_opens_only_what_it_sealed_itself_in_order() {
    // Every sealed seed, sealed and opened in order by one session; any other order fails.
    let bodies: Vec<Vec<u8>> = corpus()
        .into_iter()
        .filter(|(n, _)| n.starts_with("sealed-"))
        .map(|(_, d)| d[1..].to_vec())
        .collect();
    let (mut tx, mut rx) = sessions();
    let frames: Vec<Vec<u8>> = bodies.iter().map(|b| tx.sealer.seal_bytes(b)).collect();
    assert!(rx.opener.open(&frames[1][4..]).is_err());
    for f in &frames {
        rx.opener.open(&f[4..]).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_in_any_mode_are_values_or_errors(
        mode in 0u8..4,
        rest in proptest::collection::vec(any::<u8>(), 0..600),
    ) {
        let mut data = vec![mode];
        data.extend_from_slice(&rest);
        exercise(&data);
    }

    #[test]
    fn mutated_seeds_are_values_or_errors(
        pick in any::<prop::sample::Index>(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        grow in proptest::collection::vec(any::<u8>(), 0..16),
    ) {
        let seeds = corpus();
        let (_, seed) = &seeds[pick.index(seeds.len())];
        let mut data = seed.clone();
        for (at, b) in &edits {
            let i = at.index(data.len());
            data[i] = *b;
        }
        if cut.index(4) == 0 {
            data.truncate(cut.index(data.len() + 1));
        }
        data.extend_from_slice(&grow);
        exercise(&data);
    }
}
