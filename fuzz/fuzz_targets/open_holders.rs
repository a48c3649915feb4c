//! Opens a VMM tensor set's holders segment (`cuda-ipc.th.NAME`) holding arbitrary bytes, as a
//! holder and the tools do, without a GPU (`cuda_ipc::raw::tensorset::testing`): its slots read
//! and claimed, the set inspected as `cuda-ipc ls` does ([`inspect`]) and scanned as `gc` does
//! ([`cleanup::scan`], [`reclaim`]'s judgements, dead slots freed): every outcome must be a value
//! or an error, never a panic, a fault or a hang. The set's manifest (made with the segment, this
//! process its writer) stays; only the holders segment is replaced.
//!
//! The first input byte picks the mode: bit 0: raw bytes as the whole segment (header page
//! included), or a valid holders segment (two buffers, the writer's slot and a slot of a process
//! that does not run) with the input's (offset high, offset low, value) triples written over it.
//!
//! `cargo +nightly fuzz run open_holders -- -max_len=16384 -max_total_time=60`
#![no_main]

use cuda_ipc::cleanup::{self, Scope};
use cuda_ipc::identity::ProcessIdentity;
use cuda_ipc::raw::tensorset::testing::HeldSetFixture;
use cuda_ipc::tensorset::{HOLDERS_PREFIX, HolderRole, inspect, reclaim};
use libfuzzer_sys::fuzz_target;

mod common;
use common::plant;
use std::sync::OnceLock;

/// Offsets of the init stamp and the writer's pid in the header page.
const STAMP_AT: usize = 12;
const WRITER_PID_AT: usize = 24;
/// A pid no process has (above the kernel's `pid_max` limit of 2^22).
const NO_PROCESS: u32 = (1 << 22) + 7;

/// The set: its name, its holders segment's bytes as made, and the fixture (its manifest and
/// holders segment mapped for the whole run).
struct Set {
    name: String,
    image: Vec<u8>,
    _fixture: HeldSetFixture,
}

fn set() -> &'static Set {
    static SET: OnceLock<Set> = OnceLock::new();
    SET.get_or_init(|| {
        let name = format!("fz-th-{}", std::process::id());
        let f = HeldSetFixture::create(&name, 2).expect("fixture");
        f.claim(HolderRole::Writer).expect("claim");
        let dead = ProcessIdentity {
            pid: NO_PROCESS,
            ..ProcessIdentity::current().expect("identity")
        };
        f.claim_for(HolderRole::Holder, dead, 0).expect("claim_for");
        let image =
            std::fs::read(format!("/dev/shm/{}", f.holders_segment())).expect("read holders");
        Set {
            name,
            image,
            _fixture: f,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let set = set();
    let mut img = if mode & 1 == 0 {
        rest.to_vec()
    } else {
        let mut img = set.image.clone();
        for e in rest.chunks_exact(3) {
            let at = (usize::from(e[0]) << 8 | usize::from(e[1])) % img.len();
            img[at] = e[2];
        }
        img
    };
    // A header without its stamp that records no writer, or one that runs (this process), is a
    // creation under way, which an opener awaits for 2 s: a wait by design, not a hang. Such a
    // header records a writer that does not run instead, whose creation is refused at once.
    if img.len() >= WRITER_PID_AT + 4 && img[STAMP_AT..STAMP_AT + 4] == [0; 4] {
        img[WRITER_PID_AT..WRITER_PID_AT + 4].copy_from_slice(&NO_PROCESS.to_le_bytes());
    }
    let seg = format!("{HOLDERS_PREFIX}{}", set.name);
    if !plant(&seg, &img, false) {
        return;
    }
    if let Ok(h) = HeldSetFixture::open(&set.name) {
        let _ = h.holders();
        let _ = h.generation();
        let dead = ProcessIdentity {
            pid: NO_PROCESS,
            ..ProcessIdentity::current().expect("identity")
        };
        let _ = h.claim_for(HolderRole::Reader, dead, 0);
        let _ = h.claim(HolderRole::Holder);
        let _ = h.holders();
    }
    let _ = reclaim::is_held(&set.name);
    let _ = reclaim::judged_parts(&set.name);
    let _ = reclaim::dead_holders(&set.name);
    if let Ok(s) = inspect::inspect(&set.name) {
        assert_eq!(s.name, set.name);
        let _ = s.live_holders();
    }
    let scope = Scope::only(Vec::new(), Vec::new()).with_tensor_sets(vec![set.name.clone()]);
    let _ = cleanup::scan(&scope);
    let _ = reclaim::release_dead_holders(&set.name);
});
