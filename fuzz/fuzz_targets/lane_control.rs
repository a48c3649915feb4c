//! The remote lane's control connection as a hostile peer may fill it: every outcome of its
//! parsers must be a value or an error, never a panic, a hang or an allocation the input did not
//! pay for. The first input byte picks the mode (its value modulo 4):
//! 0. the rest is a handshake message from a peer that proved nothing (`Msg::decode_handshake`);
//! 1. the rest is sealed frames as they come off the wire (a `u32` length, then the frame),
//!    opened in turn by one session's `Opener` (their MACs fail unless made for it);
//! 2. the rest is a message body sealed right for the session, then opened (the parser behind
//!    the MAC: what a peer holding the secret can send); a channel geometry is checked;
//! 3. the rest is a frame's NIXL notification (`FrameNote::decode`), and its first 13 bytes a
//!    channel geometry (`check_geometry`).
//!
//! The seed corpus is `fuzz/seeds/lane_control` (committed); `tests/remote_wire_fuzz.rs` replays
//! it (and random and mutated inputs) through the same calls on stable Rust. From the repository
//! root (new inputs go to the first folder, which git ignores; the seeds are read from the second):
//!
//! `cargo +nightly fuzz run lane_control fuzz/corpus/lane_control fuzz/seeds/lane_control --
//! -max_total_time=60`
#![no_main]

use cuda_ipc::remote::wire::{End, FrameNote, Msg, Secret, Session, check_geometry};
use libfuzzer_sys::fuzz_target;

fn sessions() -> (Session, Session) {
    let secret = Secret::new(b"fuzz".to_vec()).expect("a secret");
    let (s, r) = ([1; 32], [2; 32]);
    (
        Session::new(&secret, End::Sender, &s, &r),
        Session::new(&secret, End::Receiver, &s, &r),
    )
}

fn geometry(b: &[u8]) {
    if b.len() >= 13 {
        let buffers = u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
        let bytes = u64::from_le_bytes(b[4..12].try_into().expect("8 bytes"));
        if let Ok(g) = check_geometry(buffers, bytes, b[12]) {
            assert!(g.buffers >= 1 && g.buffer_bytes >= 1 && g.kind <= 1);
        }
    }
}

/// A message that parsed encodes to the same bytes' meaning.
fn round_trips(m: &Msg) {
    assert_eq!(Msg::decode(&m.encode()[4..]).as_ref().ok(), Some(m));
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 4 {
        0 => {
            if let Ok(m) = Msg::decode_handshake(rest) {
                assert!(m.is_handshake());
                round_trips(&m);
            }
        }
        1 => {
            let (_, mut rx) = sessions();
            let mut c = rest;
            while c.len() >= 4 {
                let n = u32::from_le_bytes(c[..4].try_into().expect("4 bytes")) as usize;
                let take = n.min(c.len() - 4);
                let _ = rx.opener.open(&c[4..4 + take]);
                c = &c[4 + take..];
            }
        }
        2 => {
            let (mut tx, mut rx) = sessions();
            let sealed = tx.sealer.seal_bytes(rest);
            if let Ok(m) = rx.opener.open(&sealed[4..]) {
                round_trips(&m);
                if let Msg::Channel {
                    buffers,
                    buffer_bytes,
                    kind,
                    ..
                } = m
                {
                    let _ = check_geometry(buffers, buffer_bytes, kind);
                }
            }
            // The same frame again is a replay.
            assert!(rx.opener.open(&sealed[4..]).is_err());
        }
        _ => {
            if let Ok(n) = FrameNote::decode(&String::from_utf8_lossy(rest)) {
                assert!(n.meta.len() <= cuda_ipc::channel::META_BYTES);
                assert_eq!(FrameNote::decode(&n.encode()).ok(), Some(n));
            }
            geometry(rest);
        }
    }
});
