//! Property tests over the same ground as the `open_segment` fuzz target (fuzz/): a segment of
//! arbitrary bytes, or a valid registry with arbitrary bytes overwritten, is opened and used; every
//! outcome is a value or an error, never a panic or a hang.

mod common;

use common::{Unlink, unique};
use cuda_ipc::raw::shm::{Segment, SegmentOptions};
use cuda_ipc::registry::{Registry, RegistryOptions};
use proptest::prelude::*;
use std::time::{Duration, Instant};

fn opts() -> RegistryOptions {
    RegistryOptions::new()
        .capacity(4)
        .participants(4)
        .init_timeout(Duration::ZERO)
        .lock_timeout(Duration::from_millis(50))
}

fn segment_with(bytes: &[u8]) -> (String, Unlink) {
    let name = unique("prop");
    let seg = Segment::create(&name, bytes.len().max(1), &SegmentOptions::new()).unwrap();
    for (i, b) in bytes.iter().enumerate() {
        // SAFETY: in bounds; this process made the segment and no other process has it.
        unsafe { seg.as_ptr().add(i).write_volatile(*b) };
    }
    (name.clone(), Unlink(name))
}

/// Opens and exercises the registry; all that matters is that it returns, quickly.
fn exercise(name: &str) {
    let t = Instant::now();
    if let Ok(reg) = Registry::open(name, &opts()) {
        let _ = reg.list();
        let _ = reg.get("a");
        let _ = reg.publish("a", 1, b"tok", b"meta");
        let _ = reg.get("a");
        let _ = reg.wait_for("a", 0, Duration::from_millis(1));
        let _ = reg.remove("a");
        let _ = reg.reclaim_dead();
        let _ = reg.participants();
        let _ = reg.list();
    }
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
}

fn valid_image() -> Vec<u8> {
    let name = unique("prop-src");
    let _u = Unlink(name.clone());
    let reg = Registry::create(&name, &opts()).unwrap();
    reg.publish("a", 1, b"tok", b"meta").unwrap();
    reg.publish("b", 2, &[5; 256], &[6; 128]).unwrap();
    let seg = reg.segment();
    (0..seg.len())
        // SAFETY: in bounds; no other process has the segment.
        .map(|i| unsafe { seg.as_ptr().add(i).read_volatile() })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn opening_arbitrary_bytes_never_panics_or_hangs(bytes in proptest::collection::vec(any::<u8>(), 0..3000)) {
        let (name, _u) = segment_with(&bytes);
        exercise(&name);
    }

    #[test]
    fn arbitrary_header_magic_and_version_never_panic(word in any::<u64>(), version in any::<u32>(), at in 0usize..16) {
        let mut img = valid_image();
        img[at * 8..at * 8 + 8].copy_from_slice(&word.to_le_bytes());
        img[8..12].copy_from_slice(&version.to_le_bytes());
        let (name, _u) = segment_with(&img);
        exercise(&name);
    }

    #[test]
    fn overwriting_any_bytes_of_a_valid_registry_never_panics_or_hangs(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..40),
        cut in proptest::option::of(any::<prop::sample::Index>()),
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
        let (name, _u) = segment_with(&img);
        exercise(&name);
    }

    #[test]
    fn overwriting_header_and_participant_bytes_never_panics_or_hangs(
        edits in proptest::collection::vec((0usize..384, any::<u8>()), 1..8),
    ) {
        let mut img = valid_image();
        for (i, b) in edits {
            img[i] = b;
        }
        let (name, _u) = segment_with(&img);
        exercise(&name);
    }
}
