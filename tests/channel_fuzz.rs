//! Property tests over the same ground as the `open_channel` fuzz target (fuzz/): a channel control
//! segment of arbitrary bytes, or a valid one with arbitrary bytes overwritten, is opened as a
//! consumer opens it, attached, taken from, released, inspected and detached; every outcome is a
//! value or an error, never a panic or a hang.

mod common;

use common::{Unlink, unique};
use cuda_ipc::channel::Delivery;
use cuda_ipc::raw::channel::layout;
use cuda_ipc::raw::channel::testing::{self, ControlConsumer, ControlProducer};
use cuda_ipc::raw::shm::{Segment, SegmentOptions};
use cuda_ipc::token::Token;
use proptest::prelude::*;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

/// A channel `channel`'s segment holding `bytes`.
fn segment_with(bytes: &[u8]) -> (String, Unlink) {
    let channel = unique("chprop");
    let name = format!("{}{channel}", layout::SEGMENT_PREFIX);
    let seg = Segment::create(&name, bytes.len().max(1), &SegmentOptions::new()).unwrap();
    for (i, b) in bytes.iter().enumerate() {
        // SAFETY: in bounds; this process made the segment and no other process has it.
        unsafe { seg.as_ptr().add(i).write_volatile(*b) };
    }
    (channel, Unlink(name))
}

/// Opens and uses the channel as a consumer and as a tool would; after the attach, `pokes` (word
/// index, value) are written into the segment as a producer (or anything else) might. All that
/// matters is that it returns, quickly. Returns the frames taken.
fn exercise(channel: &str, delivery: Delivery, pokes: &[(usize, u64)]) -> usize {
    let t = Instant::now();
    let mut taken = 0;
    if let Ok(rx) = ControlConsumer::attach_waiting(channel, delivery, Duration::ZERO) {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/dev/shm/{}{channel}", layout::SEGMENT_PREFIX))
            .unwrap();
        let len = f.metadata().unwrap().len() as usize;
        for &(w, v) in pokes {
            if w * 8 + 8 <= len {
                f.write_all_at(&v.to_le_bytes(), (w * 8) as u64).unwrap();
            }
        }
        for _ in 0..3 {
            match rx.try_take() {
                Ok(Some((i, _, meta))) => {
                    assert!(i < rx.buffers() && meta.len() <= layout::META_BYTES);
                    let _ = Token::from_bytes(&rx.buffer_token(i));
                    rx.release(i);
                    taken += 1;
                }
                Ok(None) | Err(_) => break,
            }
        }
        let _ = rx.take(Some(Duration::from_millis(1)));
        let snap = rx.inspect(channel);
        assert!(snap.buffers.len() == rx.buffers());
    }
    if testing::inspect_waiting(channel, Duration::ZERO).is_ok() {
        let _ = cuda_ipc::channel::reclaim::release_dead_consumers(channel);
    }
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    taken
}

/// A valid segment's bytes: 2 buffers, 2 consumer slots, one consumer attached holding frame 1,
/// frame 2 published.
fn valid_image() -> Vec<u8> {
    let channel = unique("chprop-src");
    let _u = Unlink(format!("{}{channel}", layout::SEGMENT_PREFIX));
    let tx = ControlProducer::create(
        &channel,
        4096,
        2,
        &[testing::token(1).unwrap(), testing::token(2).unwrap()],
    )
    .unwrap();
    let rx = ControlConsumer::attach(&channel, Delivery::EveryFrame).unwrap();
    for _ in 0..2 {
        let (i, _) = tx.try_acquire().unwrap();
        tx.publish(i, b"meta").unwrap();
    }
    let (_held, _, _) = rx.take(None).unwrap().unwrap();
    let img = std::fs::read(format!("/dev/shm/{}{channel}", layout::SEGMENT_PREFIX)).unwrap();
    std::mem::forget(rx); // its slot stays taken in the image
    img
}

fn delivery(latest: bool) -> Delivery {
    if latest {
        Delivery::LatestOnly
    } else {
        Delivery::EveryFrame
    }
}

/// Word index of byte `off` of the header, and of byte `off` of buffer slot `i`.
fn header_word(off: usize) -> usize {
    off / 8
}
fn buffer_word(i: usize, off: usize) -> usize {
    (layout::buffer_offset(i) + off) / 8
}

#[test]
fn a_copy_of_a_valid_channel_is_attached_and_frames_poked_into_it_are_taken() {
    // The exercise reaches the protocol: frames 3 and 4 appear in both buffers after the attach.
    for latest in [false, true] {
        let (channel, _u) = segment_with(&valid_image());
        let pokes = [
            (buffer_word(0, layout::buffer::SEQ), 3),
            (buffer_word(1, layout::buffer::SEQ), 4),
            (buffer_word(0, layout::buffer::HOLD_MASK), 0),
            (header_word(layout::header::HEAD), 4),
        ];
        let taken = exercise(&channel, delivery(latest), &pokes);
        assert_eq!(taken, if latest { 1 } else { 2 });
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn opening_arbitrary_bytes_as_a_channel_never_panics_or_hangs(
        bytes in proptest::collection::vec(any::<u8>(), 0..3000),
        latest in any::<bool>(),
    ) {
        let (channel, _u) = segment_with(&bytes);
        exercise(&channel, delivery(latest), &[]);
    }

    #[test]
    fn overwriting_any_bytes_of_a_valid_channel_never_panics_or_hangs(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..40),
        cut in proptest::option::of(any::<prop::sample::Index>()),
        latest in any::<bool>(),
        pokes in proptest::collection::vec((0usize..1600, 0u64..6), 0..4),
    ) {
        let mut img = valid_image();
        for (at, b) in edits {
            let i = at.index(img.len());
            img[i] = b;
        }
        if let Some(c) = cut {
            let keep = c.index(img.len());
            img.truncate(keep);
        }
        let (channel, _u) = segment_with(&img);
        exercise(&channel, delivery(latest), &pokes);
    }

    #[test]
    fn arbitrary_words_in_the_header_and_slots_never_panic_or_hang(
        words in proptest::collection::vec((0usize..(layout::HEADER_SIZE + 2 * layout::BUFFER_SLOT_SIZE + 2 * layout::CONSUMER_SLOT_SIZE) / 8, any::<u64>()), 1..6),
        small in any::<bool>(),
        latest in any::<bool>(),
        pokes in proptest::collection::vec((0usize..1600, any::<u64>()), 0..4),
    ) {
        let mut img = valid_image();
        for (w, v) in words {
            // Small values hit the counts, states, codes and sequence numbers that mean something.
            let v = if small { v % 5 } else { v };
            img[w * 8..w * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        let pokes: Vec<_> = pokes.into_iter().map(|(w, v)| (w, if small { v % 5 } else { v })).collect();
        let (channel, _u) = segment_with(&img);
        exercise(&channel, delivery(latest), &pokes);
    }
}
