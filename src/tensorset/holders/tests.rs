//! The holders segment without a GPU: slots claimed and freed, a dead server's slot reused, slot
//! reads under a concurrent claimer, the whole-generation record, hostile segments, the caps, and
//! fds forwarded by a holder (this process's own server, with memfds).

use super::*;
use crate::ipc::fdpass::FdExport;
use crate::tensorset::DType;
use crate::tensorset::manifest::{KIND_VMM, Layout, Manifest, TensorSpec};
use crate::token::{Token, TokenKind};
use std::io::{Read, Seek, Write};
use std::os::fd::OwnedFd;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering as StdOrdering;

fn unique(tag: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    format!(
        "holders-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, StdOrdering::Relaxed)
    )
}

/// Removes the set's holders segment at the end of a test.
struct Cleanup(String);
impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = Segment::unlink(&format!("{HOLDERS_PREFIX}{}", self.0));
    }
}

fn make(set: &str, buffers: usize, allocs: usize) -> (HoldersSegment, Cleanup) {
    let h = HoldersSegment::create(set, buffers, allocs, [7; 32], 4096).unwrap();
    (h, Cleanup(set.to_string()))
}

/// Makes slot `c`'s server look dead: its identity's start time bumped (a reused pid).
fn fake_dead(h: &HoldersSegment, c: &SlotClaim) {
    let (head, _) = h.slot(c.index);
    let w = head.who[1].load(Ordering::Relaxed);
    head.who[1].store(w + 1, Ordering::Relaxed);
}

#[test]
fn slots_are_claimed_listed_and_freed() {
    let set = unique("claim");
    let (h, _c) = make(&set, 2, 3);
    assert_eq!(h.entries(), 6);
    assert!(h.servers().is_empty());
    let w = h.claim(HolderRole::Writer, &[1, 2, 3, 4, 5, 6]).unwrap();
    let r = h.claim(HolderRole::Holder, &[9; 6]).unwrap();
    let s = h.servers();
    assert_eq!(s.len(), 2);
    assert_eq!(s[0].role, HolderRole::Writer);
    assert_eq!(s[0].ids, vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(s[1].role, HolderRole::Holder);
    assert_eq!(s[1].identity, ProcessIdentity::current().unwrap());
    assert!(h.held_by_live(), "a live holder besides the writer");
    let snap = h.snapshot();
    assert!(snap.iter().all(|x| x.liveness == Liveness::Alive));
    h.release(r);
    assert!(!h.held_by_live(), "only the writer serves");
    assert_eq!(h.servers().len(), 1);
    h.release(w);
    assert!(h.servers().is_empty());
    let e = h.claim(HolderRole::Holder, &[1]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // Reopened by name, the manifest's expectations checked.
    let again = HoldersSegment::open(&set, Some((h.generation(), 2, 3))).unwrap();
    assert_eq!(again.entries(), 6);
}

#[test]
fn a_full_table_is_a_typed_error_and_a_dead_servers_slot_is_reused() {
    let set = unique("full");
    let (h, _c) = make(&set, 1, 1);
    let mut claims: Vec<SlotClaim> = (0..HOLDER_SLOTS)
        .map(|i| h.claim(HolderRole::Holder, &[i as u32]).unwrap())
        .collect();
    let e = h.claim(HolderRole::Holder, &[99]).unwrap_err();
    assert!(
        matches!(&e, Error::TensorSet(TensorSetError::NoHolderSlot { slots, .. }) if *slots == HOLDER_SLOTS),
        "{e}"
    );
    let dead = claims.remove(17);
    fake_dead(&h, &dead);
    assert!(
        h.snapshot()
            .iter()
            .any(|s| s.slot == 17 && s.liveness == Liveness::Dead)
    );
    let taken = h.claim(HolderRole::Reader, &[99]).unwrap();
    assert_eq!(taken.index, 17, "the dead server's slot");
    // The dead server's late release (its word is stale) leaves the new owner alone.
    h.release(dead);
    let s17 = h.servers().into_iter().find(|s| s.slot == 17).unwrap();
    assert_eq!((s17.role, s17.ids.clone()), (HolderRole::Reader, vec![99]));
    h.release(taken);
    for c in claims {
        h.release(c);
    }
    assert!(h.servers().is_empty());
}

#[test]
fn slot_reads_are_consistent_under_a_concurrent_claimer() {
    let set = unique("seqlock");
    let (h, _c) = make(&set, 4, 64);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            // Always one slot serving, its ids rewritten on every claim.
            let mut k = 0u32;
            let mut prev = h.claim(HolderRole::Holder, &[k; 256]).unwrap();
            while !stop.load(StdOrdering::Relaxed) {
                k = k.wrapping_add(1);
                let c = h.claim(HolderRole::Holder, &[k; 256]).unwrap();
                h.release(std::mem::replace(&mut prev, c));
            }
            h.release(prev);
        });
        let mut seen = 0;
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_millis(500) {
            for srv in h.servers() {
                let first = srv.ids[0];
                assert!(srv.ids.iter().all(|&x| x == first), "a torn slot read");
                seen += 1;
            }
        }
        stop.store(true, StdOrdering::Relaxed);
        assert!(seen > 0, "no slot was ever read serving");
    });
}

#[test]
fn the_whole_generation_record_follows_writes_and_commits() {
    let set = unique("whole");
    let (h, _c) = make(&set, 1, 1);
    assert!(matches!(h.last_whole(), Whole::None(_)));
    h.mark_writing(1, 0);
    assert!(matches!(h.last_whole(), Whole::None(_)));
    h.record_whole(1, 0, &[1; 32]);
    assert_eq!(
        h.last_whole(),
        Whole::Generation {
            generation: 1,
            buffer: 0,
            content: [1; 32]
        }
    );
    // In place: an update under way leaves nothing whole.
    h.mark_writing(2, 0);
    assert!(matches!(h.last_whole(), Whole::None(w) if w.contains("in place")));
    h.record_whole(2, 0, &[2; 32]);
    assert!(matches!(
        h.last_whole(),
        Whole::Generation { generation: 2, .. }
    ));
    // Buffered: an update of the other buffer leaves the last whole generation alone.
    let set2 = unique("whole2");
    let (b, _c2) = make(&set2, 2, 1);
    b.mark_writing(1, 0);
    b.record_whole(1, 0, &[1; 32]);
    b.mark_writing(2, 1);
    assert!(matches!(
        b.last_whole(),
        Whole::Generation {
            generation: 1,
            buffer: 0,
            ..
        }
    ));
    b.record_whole(2, 1, &[2; 32]);
    b.mark_writing(3, 0);
    assert!(matches!(
        b.last_whole(),
        Whole::Generation {
            generation: 2,
            buffer: 1,
            ..
        }
    ));
}

#[test]
fn the_record_read_under_a_concurrent_writer_is_never_torn() {
    let set = unique("rec");
    let (h, _c) = make(&set, 1, 1);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut g = 1u64;
            while !stop.load(StdOrdering::Relaxed) {
                h.record_whole(g, 0, &[g as u8; 32]);
                g += 1;
            }
        });
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_millis(300) {
            if let Whole::Generation {
                generation,
                content,
                ..
            } = h.last_whole()
            {
                assert_eq!(content, [generation as u8; 32], "a torn record");
            }
        }
        stop.store(true, StdOrdering::Relaxed);
    });
}

#[test]
fn hostile_holders_segments_are_typed_errors() {
    let set = unique("hostile");
    let (h, _c) = make(&set, 2, 2);
    let g = h.generation();
    // Another generation than the manifest names, other counts.
    for expect in [(g ^ 1, 2, 2), (g, 1, 2), (g, 2, 1)] {
        let e = HoldersSegment::open(&set, Some(expect)).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::TensorSet(TensorSetError::BadManifest {
                    fault: ManifestFault::Mismatch { .. },
                    ..
                })
            ),
            "{e}"
        );
    }
    let w = h.words();
    // Counts out of range.
    for (slots, entries) in [(0, 4), (5000, 4), (64, 0), (64, 2000), (64, 3)] {
        w.slots.store(slots, Ordering::Relaxed);
        w.entries.store(entries, Ordering::Relaxed);
        let e = HoldersSegment::open(&set, None).unwrap_err();
        assert!(
            matches!(&e, Error::TensorSet(TensorSetError::BadManifest { .. })),
            "{slots} {entries}: {e}"
        );
    }
    w.slots.store(HOLDER_SLOTS as u32, Ordering::Relaxed);
    w.entries.store(4, Ordering::Relaxed);
    assert!(HoldersSegment::open(&set, None).is_ok());
    // Cut short: the slots run past the file.
    rustix::fs::ftruncate(h.segment().fd(), HEADER_PAGE as u64).unwrap();
    let e = HoldersSegment::open(&set, None).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::TensorSet(TensorSetError::BadManifest {
                fault: ManifestFault::Truncated { .. },
                ..
            })
        ),
        "{e}"
    );
    // A foreign magic.
    let foreign = unique("foreign");
    let _c2 = Cleanup(foreign.clone());
    let seg = Segment::create(
        &format!("{HOLDERS_PREFIX}{foreign}"),
        2 * HEADER_PAGE,
        &crate::shm::SegmentOptions::new(),
    )
    .unwrap();
    // SAFETY: the mapping is 8192 bytes; nothing else maps it yet; written byte-wise.
    unsafe { std::ptr::copy_nonoverlapping(b"NOTOURS!".as_ptr(), seg.as_ptr(), 8) };
    let e = HoldersSegment::open(&foreign, None).unwrap_err();
    assert!(
        matches!(
            &e,
            Error::TensorSet(TensorSetError::BadManifest {
                fault: ManifestFault::Field { .. },
                ..
            })
        ),
        "{e}"
    );
    // None at all.
    let e = HoldersSegment::open(&unique("absent"), None).unwrap_err();
    assert!(matches!(&e, Error::Shm(ShmError::NotFound { .. })), "{e}");
}

#[test]
fn too_many_allocations_are_not_holdable_naming_the_cap() {
    let set = unique("cap");
    let e = HoldersSegment::create(&set, 2, 600, [0; 32], 1).unwrap_err();
    match e {
        Error::TensorSet(TensorSetError::NotHoldable { why, .. }) => {
            assert!(why.contains("1024"), "{why}")
        }
        other => panic!("expected NotHoldable, got {other}"),
    }
    assert!(check_entries(&set, 1, MAX_HOLDER_ENTRIES).is_ok());
}

fn memfd(content: &str) -> OwnedFd {
    let fd = rustix::fs::memfd_create("holders-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let mut f = std::fs::File::from(fd);
    f.write_all(content.as_bytes()).unwrap();
    f.into()
}

fn content(fd: OwnedFd) -> String {
    let mut f = std::fs::File::from(fd);
    f.rewind().unwrap();
    let mut s = String::new();
    f.read_to_string(&mut s).unwrap();
    s
}

/// A VMM manifest of B × 1 allocations whose tokens name `writer` as exporter.
fn manifest(buffers: usize, writer: ProcessIdentity, holders_generation: u64) -> Manifest {
    let layout = Layout::new(&[TensorSpec::new("w", DType::F32, &[16])]).unwrap();
    let tokens = (0..buffers)
        .map(|b| {
            vec![
                Token {
                    kind: TokenKind::VmmMemory,
                    handle: [0; 64],
                    offset: 0,
                    len: 256,
                    device: crate::driver::Uuid([0; 16]),
                    exporter: writer,
                    export_id: 1000 + b as u32,
                }
                .to_bytes(),
            ]
        })
        .collect();
    Manifest {
        kind: KIND_VMM,
        flags: u32::from(buffers > 1),
        buffers,
        layout,
        tokens,
        channel_generation: 1,
        data_generation: 0,
        max_readers: 64,
        holders_generation,
        generation_base: 0,
    }
}

#[test]
fn a_dead_writers_fds_are_fetched_from_a_live_holder() {
    let set = unique("forward");
    let (h, _c) = make(&set, 2, 1);
    let mut dead = ProcessIdentity::current().unwrap();
    dead.start_time += 1;
    let m = manifest(2, dead, h.generation());
    // Nobody serves yet: the error names the writer and says no holder serves.
    let e = holder::fetch_all(&set, &m, &h).unwrap_err();
    match &e {
        Error::TensorSet(TensorSetError::NoServer { tried, .. }) => {
            assert!(tried.contains("the writer"), "{tried}");
            assert!(tried.contains("no live holder"), "{tried}");
        }
        other => panic!("expected NoServer, got {other}"),
    }
    // A dead holder is passed over (and named), a live one serves.
    let gone = h.claim(HolderRole::Holder, &[1, 2]).unwrap();
    fake_dead(&h, &gone);
    let a = FdExport::new(memfd("buffer 0")).unwrap();
    let b = FdExport::new(memfd("buffer 1")).unwrap();
    let live = h.claim(HolderRole::Holder, &[a.id(), b.id()]).unwrap();
    let (fds, from) = holder::fetch_all(&set, &m, &h).unwrap();
    assert_eq!(from, ProcessIdentity::current().unwrap());
    let texts: Vec<String> = fds.into_iter().map(content).collect();
    assert_eq!(texts, ["buffer 0", "buffer 1"]);
    // Withdrawn exports: the holder answers NotOffered, named in the error.
    drop((a, b));
    let e = holder::fetch_all(&set, &m, &h).unwrap_err();
    assert!(e.to_string().contains("holder pid"), "{e}");
    h.release(live);
    h.release(gone);
}

#[test]
fn a_writerless_readers_slot_records_its_buffer_and_serves_nothing() {
    let set = unique("reading");
    let (h, _c) = make(&set, 2, 1);
    let r = h.claim_reading().unwrap();
    let s = h.servers();
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].role, HolderRole::WriterlessReader);
    assert_eq!(s[0].ids, vec![0, 0], "a writerless reader offers no export");
    assert!(!h.held_by_live(), "a writerless reader is no holder");
    assert_eq!(h.live_holders(), 0);
    assert!(!h.reading_held(0) && !h.reading_held(1));
    // No live writer: the hold stands.
    assert!(!h.set_reading(&r, Some(1)).unwrap());
    assert!(h.reading_held(1));
    assert!(!h.reading_held(0));
    assert!(!h.set_reading(&r, None).unwrap());
    assert!(!h.reading_held(1));
    // A dead reader's hold does not count.
    h.set_reading(&r, Some(0)).unwrap();
    fake_dead(&h, &r);
    assert!(!h.reading_held(0), "a dead writerless reader holds nothing");
    h.release(r);
}

#[test]
fn a_hold_stored_after_a_writer_resumed_says_so() {
    let set = unique("resumed");
    let (h, _c) = make(&set, 1, 1);
    let r = h.claim_reading().unwrap();
    let w = h.claim(HolderRole::Writer, &[5]).unwrap();
    assert!(h.has_live_writer());
    assert!(
        h.set_reading(&r, Some(0)).unwrap(),
        "a live writer has a slot: resumed"
    );
    h.release(w);
    h.release(r);
    assert!(!h.has_live_writer());
}

#[test]
fn the_header_keeps_the_memory_facts_a_restarted_writer_checks() {
    let set = unique("facts");
    let h = HoldersSegment::create(&set, 3, 2, [9; 32], 1 << 20).unwrap();
    let _c = Cleanup(set.clone());
    let again = HoldersSegment::open(&set, None).unwrap();
    assert_eq!(
        again.memory_facts().unwrap(),
        resume::MemoryFacts {
            fingerprint: [9; 32],
            bytes_per_buffer: 1 << 20,
            buffers: 3,
            allocations: 2,
        }
    );
    drop(h);
}
