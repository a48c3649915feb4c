//! Opens a channel control segment holding arbitrary bytes as a consumer does (protocol only, no
//! GPU: `cuda_ipc::raw::channel::testing`), attaches, takes and releases frames, inspects it and
//! detaches: every outcome must be a value or an error, never a panic, a fault or a hang. The first
//! input byte picks the mode: bit 0: raw bytes as the whole segment, or a valid channel with the
//! input's bytes written over it; bit 1: the delivery policy; bit 2: the second half of the input
//! is written into the segment after the attach (as a producer might), as (word high, word low,
//! value) triples.
//!
//! `cargo +nightly fuzz run open_channel -- -max_total_time=60`
#![no_main]

use cuda_ipc::channel::Delivery;
use cuda_ipc::raw::channel::layout;
use cuda_ipc::raw::channel::testing::{self, ControlConsumer, ControlProducer};
use cuda_ipc::raw::shm::{Segment, SegmentOptions};
use cuda_ipc::token::Token;
use libfuzzer_sys::fuzz_target;
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// A channel name no other run uses.
fn channel() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "cuda-ipc-fuzz-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A valid segment: 2 buffers, 2 consumer slots, one consumer holding frame 1, frame 2 published.
fn valid_image() -> &'static [u8] {
    static IMG: OnceLock<Vec<u8>> = OnceLock::new();
    IMG.get_or_init(|| {
        let ch = channel();
        let tokens = [
            testing::token(1).expect("token"),
            testing::token(2).expect("token"),
        ];
        let tx = ControlProducer::create(&ch, 4096, 2, &tokens).expect("create");
        let rx = ControlConsumer::attach(&ch, Delivery::EveryFrame).expect("attach");
        for _ in 0..2 {
            let (i, _) = tx.try_acquire().expect("a free buffer");
            tx.publish(i, b"meta").expect("publish");
        }
        rx.take(None).expect("take").expect("a frame");
        let img = std::fs::read(format!("/dev/shm/{}{ch}", layout::SEGMENT_PREFIX)).expect("read");
        std::mem::forget(rx); // its slot stays taken in the image
        tx.unlink();
        img
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let (edits, pokes) = if mode & 4 != 0 {
        rest.split_at(rest.len() / 2)
    } else {
        (rest, &[][..])
    };
    let img = if mode & 1 == 0 {
        edits.to_vec()
    } else {
        let mut img = valid_image().to_vec();
        for e in edits.chunks_exact(3) {
            let at = (usize::from(e[0]) << 8 | usize::from(e[1])) % img.len();
            img[at] = e[2];
        }
        img
    };
    let delivery = if mode & 2 == 0 {
        Delivery::EveryFrame
    } else {
        Delivery::LatestOnly
    };
    let ch = channel();
    let name = format!("{}{ch}", layout::SEGMENT_PREFIX);
    let Ok(seg) = Segment::create(&name, img.len().max(1), &SegmentOptions::new()) else {
        return;
    };
    for (i, b) in img.iter().enumerate() {
        // SAFETY: in bounds; this process made the segment and no other process has it.
        unsafe { seg.as_ptr().add(i).write_volatile(*b) };
    }
    if let Ok(rx) = ControlConsumer::attach_waiting(&ch, delivery, Duration::ZERO) {
        if let Ok(f) = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/dev/shm/{name}"))
        {
            for p in pokes.chunks_exact(3) {
                let w = usize::from(p[0]) << 8 | usize::from(p[1]);
                if (w + 1) * 8 <= img.len() {
                    let _ = f.write_all_at(&u64::from(p[2]).to_le_bytes(), (w * 8) as u64);
                }
            }
        }
        for _ in 0..3 {
            match rx.try_take() {
                Ok(Some((i, _, meta))) => {
                    assert!(i < rx.buffers() && meta.len() <= layout::META_BYTES);
                    let _ = Token::from_bytes(&rx.buffer_token(i));
                    rx.release(i);
                }
                Ok(None) | Err(_) => break,
            }
        }
        let _ = rx.take(Some(Duration::from_millis(1)));
        let _ = rx.inspect(&ch);
    }
    if testing::inspect_waiting(&ch, Duration::ZERO).is_ok() {
        let _ = cuda_ipc::channel::reclaim::release_dead_consumers(&ch);
    }
    let _ = Segment::unlink(&name);
});
