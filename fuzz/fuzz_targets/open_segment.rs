//! Opens a registry segment holding arbitrary bytes and reads and writes it: every outcome must be a
//! value or an error, never a panic, a fault or a hang. The first input byte picks the mode: raw
//! bytes as the whole segment, or a valid registry with the input's bytes written over it.
//!
//! `cargo +nightly fuzz run open_segment -- -max_total_time=60`
#![no_main]

use cuda_ipc::registry::{Registry, RegistryOptions};
use cuda_ipc::raw::shm::{Segment, SegmentOptions};
use libfuzzer_sys::fuzz_target;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

fn opts() -> RegistryOptions {
    RegistryOptions::new()
        .capacity(4)
        .participants(4)
        .init_timeout(Duration::ZERO)
        .lock_timeout(Duration::from_millis(20))
}

fn name() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "cuda-ipc-fuzz-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn valid_image() -> Vec<u8> {
    let n = name();
    let reg = Registry::create(&n, &opts()).expect("create");
    reg.publish("a", 1, b"tok", b"meta").expect("publish");
    let seg = reg.segment();
    // SAFETY: in bounds; no other process has this segment.
    let img = (0..seg.len())
        .map(|i| unsafe { seg.as_ptr().add(i).read_volatile() })
        .collect();
    let _ = Segment::unlink(&n);
    img
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let img = if mode & 1 == 0 {
        rest.to_vec()
    } else {
        // Pairs of (offset high, offset low, value) overwrite a valid image.
        let mut img = valid_image();
        for e in rest.chunks_exact(3) {
            let at = (usize::from(e[0]) << 8 | usize::from(e[1])) % img.len();
            img[at] = e[2];
        }
        img
    };
    let n = name();
    let Ok(seg) = Segment::create(&n, img.len().max(1), &SegmentOptions::new()) else {
        return;
    };
    for (i, b) in img.iter().enumerate() {
        // SAFETY: in bounds; this process made the segment and no other process has it.
        unsafe { seg.as_ptr().add(i).write_volatile(*b) };
    }
    if let Ok(reg) = Registry::open(&n, &opts()) {
        let _ = reg.list();
        let _ = reg.get("a");
        let _ = reg.publish("a", 1, b"tok", b"meta");
        let _ = reg.wait_for("a", 0, Duration::from_millis(1));
        let _ = reg.remove("a");
        let _ = reg.reclaim_dead();
        let _ = reg.participants();
    }
    let _ = Segment::unlink(&n);
});
