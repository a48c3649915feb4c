//! The registry in one process: records, waits, limits, and every kind of bad segment.

mod common;

use common::{Unlink, unique};
use cuda_ipc::Error;
use cuda_ipc::raw::registry_layout::{self as layout, HEADER_SIZE, PARTICIPANT_SIZE, SLOT_SIZE};
use cuda_ipc::raw::shm::{Segment, SegmentOptions, ShmError};
use cuda_ipc::registry::{Registry, RegistryError, RegistryOptions, inspect};
use std::time::{Duration, Instant};

fn opts() -> RegistryOptions {
    RegistryOptions::new()
        .capacity(8)
        .participants(8)
        .init_timeout(Duration::from_millis(100))
        .lock_timeout(Duration::from_millis(500))
}

fn new_registry(tag: &str) -> (Registry, Unlink) {
    let name = unique(tag);
    let reg = Registry::create(&name, &opts()).unwrap();
    (reg, Unlink(name))
}

/// Writes `v` at byte offset `off` of the segment, as another process would.
fn poke_u64(seg: &Segment, off: usize, v: u64) {
    assert!(off + 8 <= seg.len() && off.is_multiple_of(8));
    // SAFETY: in bounds and aligned (checked above); an atomic store, as the registry's own writes
    // are, so concurrent readers see a whole word.
    let a = unsafe { &*(seg.as_ptr().add(off) as *const std::sync::atomic::AtomicU64) };
    a.store(v, std::sync::atomic::Ordering::SeqCst);
}

fn poke_u32(seg: &Segment, off: usize, v: u32) {
    assert!(off + 4 <= seg.len() && off.is_multiple_of(4));
    // SAFETY: as in `poke_u64`.
    let a = unsafe { &*(seg.as_ptr().add(off) as *const std::sync::atomic::AtomicU32) };
    a.store(v, std::sync::atomic::Ordering::SeqCst);
}

fn slot_off(participants: u32, i: u32) -> usize {
    layout::slots_offset(participants) + i as usize * SLOT_SIZE
}

fn registry_err(e: Error) -> RegistryError {
    match e {
        Error::Registry(r) => r,
        other => panic!("expected a registry error, got {other}"),
    }
}

fn shm_err(e: Error) -> ShmError {
    match e {
        Error::Shm(s) => s,
        other => panic!("expected a shared-memory error, got {other}"),
    }
}

#[test]
fn published_record_reads_back_exactly() {
    let (reg, _u) = new_registry("rt");
    let token: Vec<u8> = (0..=255u8).collect();
    let meta = vec![7u8; 128];
    let seq = reg.publish("frames/left", 42, &token, &meta).unwrap();
    let r = reg.get("frames/left").unwrap().unwrap();
    assert_eq!(r.name, "frames/left");
    assert_eq!(r.kind, 42);
    assert_eq!(r.token, token);
    assert_eq!(r.metadata, meta);
    assert_eq!(r.seq, seq);
    assert_eq!(
        r.owner,
        cuda_ipc::identity::ProcessIdentity::current().unwrap()
    );
    assert!(reg.get("frames/right").unwrap().is_none());
}

#[test]
fn sequence_numbers_of_a_name_only_increase_across_removal() {
    let (reg, _u) = new_registry("seq");
    let a = reg.publish("x", 1, b"a", b"").unwrap();
    let b = reg.publish("x", 1, b"b", b"").unwrap();
    assert!(b > a);
    assert!(reg.remove("x").unwrap());
    assert!(!reg.remove("x").unwrap());
    assert!(reg.get("x").unwrap().is_none());
    let c = reg.publish("x", 1, b"c", b"").unwrap();
    assert!(c > b);
    assert_eq!(reg.get("x").unwrap().unwrap().token, b"c");
}

#[test]
fn a_name_has_one_slot_and_list_shows_every_record() {
    let (reg, _u) = new_registry("list");
    for round in 0..3 {
        for n in ["a", "b", "c"] {
            reg.publish(n, round, n.as_bytes(), b"").unwrap();
        }
    }
    let mut names: Vec<_> = reg.list().unwrap().into_iter().map(|r| r.name).collect();
    names.sort();
    assert_eq!(names, ["a", "b", "c"]);
}

#[test]
fn full_registry_is_an_error_and_removal_makes_room() {
    let (reg, _u) = new_registry("full");
    for i in 0..8 {
        reg.publish(&format!("n{i}"), 0, b"", b"").unwrap();
    }
    let e = registry_err(reg.publish("n8", 0, b"", b"").unwrap_err());
    assert!(matches!(e, RegistryError::Full { capacity: 8, .. }), "{e}");
    // Updating an existing name still works when full.
    reg.publish("n3", 1, b"", b"").unwrap();
    reg.remove("n0").unwrap();
    reg.publish("n8", 0, b"", b"").unwrap();
}

#[test]
fn over_long_or_bad_record_fields_are_rejected() {
    let (reg, _u) = new_registry("long");
    let long = "n".repeat(65);
    let e = registry_err(reg.publish(&long, 0, b"", b"").unwrap_err());
    assert!(
        matches!(
            e,
            RegistryError::TooLarge {
                what: "record name",
                len: 65,
                max: 64
            }
        ),
        "{e}"
    );
    assert!(reg.publish(&"n".repeat(64), 0, b"", b"").is_ok());
    let e = registry_err(reg.publish("t", 0, &[0; 257], b"").unwrap_err());
    assert!(
        matches!(e, RegistryError::TooLarge { what: "token", .. }),
        "{e}"
    );
    let e = registry_err(reg.publish("t", 0, b"", &[0; 129]).unwrap_err());
    assert!(
        matches!(
            e,
            RegistryError::TooLarge {
                what: "metadata",
                ..
            }
        ),
        "{e}"
    );
    assert!(matches!(
        registry_err(reg.get("").unwrap_err()),
        RegistryError::InvalidName { .. }
    ));
    assert!(matches!(
        registry_err(reg.get("a\nb").unwrap_err()),
        RegistryError::InvalidName { .. }
    ));
    assert!(matches!(
        registry_err(reg.get(&long).unwrap_err()),
        RegistryError::TooLarge { .. }
    ));
}

#[test]
fn over_long_or_bad_segment_name_is_rejected() {
    for bad in ["", "/x", "a b", &"r".repeat(201)] {
        let e = shm_err(Registry::create(bad, &opts()).unwrap_err());
        assert!(matches!(e, ShmError::InvalidName { .. }), "{bad:?}: {e}");
        let e = shm_err(Registry::open(bad, &opts()).unwrap_err());
        assert!(matches!(e, ShmError::InvalidName { .. }), "{bad:?}: {e}");
    }
}

#[test]
fn wait_for_returns_at_once_when_newer_and_times_out_otherwise() {
    let (reg, _u) = new_registry("wait");
    let s = reg.publish("w", 0, b"1", b"").unwrap();
    assert_eq!(reg.wait_for("w", 0, Duration::from_secs(1)).unwrap().seq, s);
    let t = Instant::now();
    let e = reg.wait_for("w", s, Duration::from_millis(50)).unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(t.elapsed() >= Duration::from_millis(45));
}

#[test]
fn wait_for_wakes_when_another_thread_publishes() {
    let (reg, _u) = new_registry("wake");
    std::thread::scope(|s| {
        let h = s.spawn(|| reg.wait_for("later", 0, Duration::from_secs(5)).unwrap());
        std::thread::sleep(Duration::from_millis(30));
        let seq = reg.publish("later", 3, b"tok", b"").unwrap();
        assert_eq!(h.join().unwrap().seq, seq);
    });
}

#[test]
fn open_sees_what_create_wrote_and_registers_participants() {
    let (reg, u) = new_registry("open");
    reg.publish("p", 9, b"tok", b"m").unwrap();
    let other = Registry::open(&u.0, &opts()).unwrap();
    assert_eq!(other.get("p").unwrap().unwrap().kind, 9);
    assert_ne!(reg.participant_index(), other.participant_index());
    assert_eq!(reg.participants(), vec![reg.identity()]);
    drop(other);
}

#[test]
fn creating_an_existing_registry_fails_and_open_or_create_opens_it() {
    let (reg, u) = new_registry("exists");
    reg.publish("keep", 1, b"", b"").unwrap();
    let e = shm_err(Registry::create(&u.0, &opts()).unwrap_err());
    assert!(matches!(e, ShmError::AlreadyExists { .. }), "{e}");
    let again = Registry::open_or_create(&u.0, &opts()).unwrap();
    assert!(again.get("keep").unwrap().is_some());
}

#[test]
fn participant_table_full_is_an_error_and_drop_frees_an_entry() {
    let name = unique("parts");
    let _u = Unlink(name.clone());
    let o = opts().participants(2);
    let a = Registry::create(&name, &o).unwrap();
    let b = Registry::open(&name, &o).unwrap();
    let e = registry_err(Registry::open(&name, &o).unwrap_err());
    assert!(
        matches!(e, RegistryError::TooManyParticipants { capacity: 2, .. }),
        "{e}"
    );
    drop(b);
    let _c = Registry::open(&name, &o).unwrap();
    drop(a);
}

#[test]
fn open_of_missing_registry_fails_with_not_found() {
    let e = shm_err(Registry::open(&unique("none"), &opts()).unwrap_err());
    assert!(matches!(e, ShmError::NotFound { .. }), "{e}");
}

fn raw_segment(tag: &str, bytes: &[u8]) -> (String, Unlink) {
    let name = unique(tag);
    let seg = Segment::create(&name, bytes.len().max(1), &SegmentOptions::new()).unwrap();
    for (i, b) in bytes.iter().enumerate() {
        // SAFETY: in bounds; this test made the segment and nobody else writes it yet.
        unsafe { seg.as_ptr().add(i).write_volatile(*b) };
    }
    (name.clone(), Unlink(name))
}

#[test]
fn open_of_foreign_segment_fails_naming_the_magic() {
    let (name, _u) = raw_segment(
        "foreign",
        &b"hello, this is somebody else's data".repeat(20),
    );
    let e = registry_err(Registry::open(&name, &opts()).unwrap_err());
    assert!(matches!(e, RegistryError::ForeignSegment { .. }), "{e}");
    assert!(e.to_string().contains("not a cuda-ipc registry"));
}

fn valid_image(tag: &str) -> (String, Unlink, Vec<u8>) {
    let name = unique(tag);
    let reg = Registry::create(&name, &opts()).unwrap();
    reg.publish("r", 1, b"tok", b"meta").unwrap();
    let seg = reg.segment();
    let mut v = vec![0u8; seg.len()];
    for (i, b) in v.iter_mut().enumerate() {
        // SAFETY: in bounds; no other process has this segment.
        *b = unsafe { seg.as_ptr().add(i).read_volatile() };
    }
    drop(reg);
    Segment::unlink(&name).unwrap();
    (name.clone(), Unlink(name), v)
}

#[test]
fn open_with_wrong_layout_version_fails_naming_both_versions() {
    let (_, _u0, mut img) = valid_image("ver0");
    img[8..12].copy_from_slice(&7u32.to_le_bytes());
    let (name, _u) = raw_segment("ver", &img);
    let e = registry_err(Registry::open(&name, &opts()).unwrap_err());
    assert!(
        matches!(
            e,
            RegistryError::VersionMismatch {
                found: 7,
                supported: layout::LAYOUT_VERSION,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("version 7")
            && e.to_string()
                .contains(&format!("version {}", layout::LAYOUT_VERSION))
    );
}

#[test]
fn open_of_truncated_segment_fails_with_too_small() {
    let (_, _u0, img) = valid_image("trunc0");
    let (name, _u) = raw_segment("trunc", &img[..img.len() - SLOT_SIZE]);
    let e = shm_err(Registry::open(&name, &opts()).unwrap_err());
    assert!(matches!(e, ShmError::TooSmall { .. }), "{e}");
    let (name, _u2) = raw_segment("trunc-hdr", &img[..HEADER_SIZE / 2]);
    let e = shm_err(Registry::open(&name, &opts()).unwrap_err());
    assert!(matches!(e, ShmError::TooSmall { .. }), "{e}");
}

#[test]
fn open_of_zero_size_segment_fails_after_the_bounded_wait() {
    let name = unique("zero");
    let _u = Unlink(name.clone());
    let _fd = rustix::shm::open(
        format!("/{name}").as_str(),
        rustix::shm::OFlags::CREATE | rustix::shm::OFlags::EXCL | rustix::shm::OFlags::RDWR,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .unwrap();
    let t = Instant::now();
    let e = shm_err(Registry::open(&name, &opts()).unwrap_err());
    assert!(matches!(e, ShmError::TooSmall { len: 0, .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2));
}

#[test]
fn open_of_segment_whose_creator_never_finished_fails_with_uninitialised() {
    let (_, _u0, mut img) = valid_image("uninit0");
    img[16..24].fill(0); // no init stamp
    let (name, _u) = raw_segment("uninit", &img);
    let e = registry_err(Registry::open(&name, &opts()).unwrap_err());
    assert!(matches!(e, RegistryError::Uninitialised { .. }), "{e}");
    // The error says how long it waited (the options' 100 ms), not zero.
    let RegistryError::Uninitialised { waited, .. } = &e else {
        unreachable!()
    };
    assert!(*waited >= Duration::from_millis(100), "{waited:?}");
    assert!(e.to_string().contains("after waiting"), "{e}");
    // Inspecting does not wait, and says what the state means.
    let e = registry_err(inspect::inspect(&name).unwrap_err());
    assert!(
        e.to_string()
            .contains("not initialised: its creator has not finished it"),
        "{e}"
    );
}

#[test]
fn open_with_header_fields_that_disagree_fails_with_corrupt() {
    // (offset, value) pairs for u32 header fields: header, slot, participant sizes, counts, maxima.
    for (off, v) in [
        (12, 64u32),
        (32, 512),
        (40, 32),
        (36, 0),
        (44, 1 << 20),
        (48, 65),
        (52, 1),
        (56, 0),
    ] {
        let (_, _u0, mut img) = valid_image("corrupt0");
        img[off..off + 4].copy_from_slice(&v.to_le_bytes());
        let (name, _u) = raw_segment("corrupt", &img);
        let e = Registry::open(&name, &opts()).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Registry(RegistryError::Corrupt { .. })
                    | Error::Shm(ShmError::TooSmall { .. })
            ),
            "offset {off}: {e}"
        );
    }
    let (_, _u0, mut img) = valid_image("stamp0");
    img[16..24].copy_from_slice(&0x1234u64.to_le_bytes());
    let (name, _u) = raw_segment("stamp", &img);
    let e = registry_err(Registry::open(&name, &opts()).unwrap_err());
    assert!(matches!(e, RegistryError::Corrupt { .. }), "{e}");
}

#[test]
fn registry_owned_by_another_user_is_refused() {
    let (reg, u) = new_registry("owner");
    let me = rustix::process::geteuid().as_raw();
    if me != 0 {
        return; // only root can give a segment away; the shm test covers the check itself
    }
    rustix::fs::fchown(
        reg.segment().fd(),
        Some(rustix::process::Uid::from_raw(4242)),
        None,
    )
    .unwrap();
    let e = shm_err(Registry::open(&u.0, &opts()).unwrap_err());
    assert!(matches!(e, ShmError::WrongOwner { owner: 4242, .. }), "{e}");
}

#[test]
fn corrupted_slot_bytes_are_a_clear_error_and_reclaim_frees_them() {
    let (reg, _u) = new_registry("slotcorrupt");
    let seq = reg.publish("r", 1, b"tok", b"").unwrap();
    let slot = reg.get("r").unwrap().unwrap().slot;
    let base = slot_off(8, slot);
    // Token length field (payload word 2, bits 48..64) beyond 256, written as a proper write would be.
    poke_u64(reg.segment(), base + 32, 1 | (1u64 << 32) | (999u64 << 48));
    let e = registry_err(reg.get("r").unwrap_err());
    assert!(matches!(e, RegistryError::Corrupt { .. }), "{e}");
    assert!(e.to_string().contains("token length 999"), "{e}");
    assert!(reg.list().is_err());
    let rep = reg.reclaim_dead().unwrap();
    assert_eq!(rep.half_written, 1);
    assert!(reg.get("r").unwrap().is_none());
    assert!(reg.publish("r", 1, b"tok", b"").unwrap() > seq);
    // An unknown state value is reported the same way.
    let slot = reg.get("r").unwrap().unwrap().slot;
    poke_u32(reg.segment(), slot_off(8, slot) + 16, 77);
    let e = registry_err(reg.get("r").unwrap_err());
    assert!(e.to_string().contains("unknown state 77"), "{e}");
}

/// A token naming a process that cannot exist (pid above any pid_max): "dead".
const DEAD: u64 = (0x7fff_fff0u64 << 32) | 1;

#[test]
fn writer_crashing_between_any_two_stores_leaves_the_registry_usable() {
    // Replays the stores of one publish of record "c" (lock, open write, each payload word, close,
    // unlock) and stops after each of them, as if the writer were killed there; the registry must
    // then never return a torn "c", and the next publish must succeed with a higher sequence.
    let (reg, u) = new_registry("crashpoints");
    let old = reg.publish("c", 1, &[1; 200], &[1; 100]).unwrap();
    let slot = reg.get("c").unwrap().unwrap().slot;
    let base = slot_off(8, slot);
    let seg = Segment::open(&u.0).unwrap();
    let mut last = old;
    // Payload words of a valid record of "c" with other contents, taken from a scratch registry.
    let (scratch, _u2) = new_registry("crashpoints-src");
    scratch.publish("c", 2, &[2; 200], &[2; 100]).unwrap();
    let sslot = scratch.get("c").unwrap().unwrap().slot;
    let sbase = slot_off(8, sslot);
    let new_words: Vec<u64> = (0..layout::PAYLOAD_WORDS)
        .map(|k| {
            // SAFETY: in bounds of the scratch segment; aligned; read with an atomic load.
            let a = unsafe {
                &*(scratch.segment().as_ptr().add(sbase + 16 + 8 * k)
                    as *const std::sync::atomic::AtomicU64)
            };
            a.load(std::sync::atomic::Ordering::SeqCst)
        })
        .collect();
    let read_seq = |off: usize| {
        // SAFETY: in bounds, aligned, atomic load.
        let a = unsafe { &*(seg.as_ptr().add(off) as *const std::sync::atomic::AtomicU64) };
        a.load(std::sync::atomic::Ordering::SeqCst)
    };
    for stop_after in 0..(layout::PAYLOAD_WORDS + 3) {
        let s0 = read_seq(base + 8);
        assert_eq!(s0 % 2, 0);
        poke_u64(&seg, base, DEAD); // writer lock taken by the doomed writer
        if stop_after >= 1 {
            poke_u64(&seg, base + 8, s0 + 1); // write opened
            let n = (stop_after - 1).min(layout::PAYLOAD_WORDS);
            for (k, w) in new_words.iter().enumerate().take(n) {
                poke_u64(&seg, base + 16 + 8 * k, *w);
            }
        }
        if stop_after == layout::PAYLOAD_WORDS + 2 {
            poke_u64(&seg, base + 8, s0 + 2); // write closed, lock never released
        }
        // Whatever readers see is a whole record (old or new contents) or nothing.
        match reg.get("c").unwrap() {
            Some(r) => {
                let fill = r.token[0];
                assert!(
                    r.token.iter().all(|b| *b == fill) && r.metadata.iter().all(|b| *b == fill)
                );
                assert_eq!(u32::from(fill), r.kind);
            }
            None => assert!((1..=layout::PAYLOAD_WORDS + 1).contains(&stop_after)),
        }
        for r in reg.list().unwrap() {
            assert!(r.token.iter().all(|b| *b == r.token[0]));
        }
        let s = reg.publish("c", 1, &[1; 200], &[1; 100]).unwrap();
        assert!(s > last, "sequence went from {last} to {s}");
        last = s;
        let r = reg.get("c").unwrap().unwrap();
        assert_eq!(
            (r.slot, r.kind, r.seq),
            (slot, 1, s),
            "stop after {stop_after}"
        );
    }
}

#[test]
fn stale_locks_and_records_of_dead_processes_are_reclaimed() {
    let (reg, _u) = new_registry("reclaim");
    reg.publish("mine", 1, b"", b"").unwrap();
    reg.publish("theirs", 1, b"", b"").unwrap();
    let slot = reg.get("theirs").unwrap().unwrap().slot;
    // Make "theirs" look published by a dead process: the owner's pid (low half of the first
    // owner identity word, slot byte 48) set to one no process has.
    let base = slot_off(8, slot);
    // SAFETY: in bounds, aligned, atomic load.
    let w =
        unsafe { &*(reg.segment().as_ptr().add(base + 48) as *const std::sync::atomic::AtomicU64) }
            .load(std::sync::atomic::Ordering::SeqCst);
    poke_u64(
        reg.segment(),
        base + 48,
        (w & !0xffff_ffff) | 0x7fff_fff0u64,
    );
    // And a dead holder of the table lock.
    poke_u64(reg.segment(), 72, DEAD);
    let r = reg.get("theirs").unwrap().unwrap();
    assert_eq!(r.owner_liveness(), cuda_ipc::identity::Liveness::Dead);
    let rep = reg.reclaim_dead().unwrap();
    assert_eq!(rep.records, 1);
    assert!(reg.get("theirs").unwrap().is_none());
    assert!(reg.get("mine").unwrap().is_some());
    // The dead table lock does not block creating a new name.
    let t = Instant::now();
    reg.publish("fresh", 1, b"", b"").unwrap();
    assert!(t.elapsed() < Duration::from_secs(1));
}

#[test]
fn dead_participants_entries_are_freed_on_open() {
    let name = unique("deadpart");
    let _u = Unlink(name.clone());
    let o = opts().participants(2);
    let a = Registry::create(&name, &o).unwrap();
    let b = Registry::open(&name, &o).unwrap();
    // Entry of `b` now claims to be a dead process; forget `b` so its drop does not free it.
    let off = layout::PARTICIPANTS_OFFSET + b.participant_index() as usize * PARTICIPANT_SIZE;
    poke_u64(a.segment(), off, DEAD);
    std::mem::forget(b);
    let c = Registry::open(&name, &o).unwrap();
    assert_eq!(c.participants().len(), 1);
    drop((a, c));
}

/// A registry header as a creator killed after its first stores leaves it: creator identity,
/// layout version and magic written, no init stamp.
fn half_made_registry(tag: &str, creator: [u64; 4], version: u32) -> (String, Unlink) {
    let name = unique(tag);
    let seg = Segment::create(&name, layout::total_size(8, 8), &SegmentOptions::new()).unwrap();
    for (k, w) in creator.iter().enumerate() {
        poke_u64(&seg, 96 + 8 * k, *w);
    }
    poke_u32(&seg, 8, version);
    poke_u64(&seg, 0, layout::MAGIC);
    (name.clone(), Unlink(name))
}

/// The identity of no process: a pid above any `pid_max`, this boot, this namespace.
fn dead_identity() -> cuda_ipc::identity::ProcessIdentity {
    cuda_ipc::identity::ProcessIdentity {
        pid: 0x7fff_fff0,
        start_time: 1,
        ..cuda_ipc::identity::ProcessIdentity::current().unwrap()
    }
}

#[test]
fn a_never_initialised_registry_of_a_dead_creator_does_not_block_a_restart() {
    let (name, _u) =
        half_made_registry("stale", dead_identity().to_words(), layout::LAYOUT_VERSION);
    let t = Instant::now();
    let reg = Registry::open_or_create(&name, &opts()).unwrap();
    reg.publish("after-restart", 1, b"", b"").unwrap();
    assert!(t.elapsed() < Duration::from_secs(2));
}

#[test]
fn open_or_create_replaces_nothing_it_cannot_prove_is_its_own_stale_registry() {
    let me = cuda_ipc::identity::ProcessIdentity::current().unwrap();
    let exists = |n: &str| std::fs::symlink_metadata(format!("/dev/shm/{n}")).is_ok();
    // A live creator still at work.
    let (name, _u) = half_made_registry("live-creator", me.to_words(), layout::LAYOUT_VERSION);
    let e = registry_err(Registry::open_or_create(&name, &opts()).unwrap_err());
    assert!(matches!(e, RegistryError::Uninitialised { .. }), "{e}");
    assert!(exists(&name));
    // Another layout version, creator dead: not ours to judge.
    let (name, _u) = half_made_registry("other-version", dead_identity().to_words(), 1);
    let e = registry_err(Registry::open_or_create(&name, &opts()).unwrap_err());
    assert!(
        matches!(e, RegistryError::VersionMismatch { found: 1, .. }),
        "{e}"
    );
    assert!(exists(&name));
    // All zero: a creator killed before its first store looks like one about to make it.
    let name = unique("zero-header");
    let _u = Unlink(name.clone());
    drop(Segment::create(&name, layout::total_size(8, 8), &SegmentOptions::new()).unwrap());
    let e = registry_err(Registry::open_or_create(&name, &opts()).unwrap_err());
    assert!(matches!(e, RegistryError::Uninitialised { .. }), "{e}");
    assert!(exists(&name));
    // An empty file, and a short one of somebody else.
    let name = unique("empty");
    let _u = Unlink(name.clone());
    drop(
        rustix::shm::open(
            format!("/{name}").as_str(),
            rustix::shm::OFlags::CREATE | rustix::shm::OFlags::RDWR,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap(),
    );
    let e = shm_err(Registry::open_or_create(&name, &opts()).unwrap_err());
    assert!(matches!(e, ShmError::TooSmall { len: 0, .. }), "{e}");
    assert!(exists(&name));
    let (name, _u) = raw_segment("short-foreign", b"not a registry at all");
    let e = shm_err(Registry::open_or_create(&name, &opts()).unwrap_err());
    assert!(matches!(e, ShmError::TooSmall { .. }), "{e}");
    assert!(exists(&name));
    // Another user's half-made registry with a dead creator (only root can make one).
    if rustix::process::geteuid().as_raw() == 0 {
        let (name, _u) = half_made_registry(
            "other-user",
            dead_identity().to_words(),
            layout::LAYOUT_VERSION,
        );
        let seg = Segment::open(&name).unwrap();
        rustix::fs::fchown(seg.fd(), Some(rustix::process::Uid::from_raw(4242)), None).unwrap();
        let e = shm_err(Registry::open_or_create(&name, &opts()).unwrap_err());
        assert!(matches!(e, ShmError::WrongOwner { owner: 4242, .. }), "{e}");
        assert!(exists(&name));
    }
}

#[test]
fn open_or_create_reports_a_foreign_segment_instead_of_replacing_it() {
    let (name, _u) = raw_segment("foreign-ooc", &[0xAB; 4096]);
    let e = registry_err(Registry::open_or_create(&name, &opts()).unwrap_err());
    assert!(matches!(e, RegistryError::ForeignSegment { .. }), "{e}");
    assert!(Segment::open(&name).is_ok());
}

#[test]
fn group_access_accepts_a_group_members_segment_and_open_to_all_is_refused() {
    let name = unique("group");
    let _u = Unlink(name.clone());
    let reg = Registry::create(&name, &opts().group_access(true)).unwrap();
    if rustix::process::geteuid().as_raw() == 0 {
        // Another user of our group made it.
        let gid = rustix::process::getegid();
        rustix::fs::fchown(
            reg.segment().fd(),
            Some(rustix::process::Uid::from_raw(4242)),
            Some(gid),
        )
        .unwrap();
        let e = shm_err(Registry::open(&name, &opts()).unwrap_err());
        assert!(matches!(e, ShmError::WrongOwner { .. }), "{e}");
        Registry::open(&name, &opts().group_access(true)).unwrap();
    }
    rustix::fs::fchmod(reg.segment().fd(), rustix::fs::Mode::from_raw_mode(0o666)).unwrap();
    let e = shm_err(Registry::open(&name, &opts().group_access(true)).unwrap_err());
    assert!(
        matches!(e, ShmError::InsecureMode { mode: 0o666, .. }),
        "{e}"
    );
}

#[test]
fn huge_timeouts_are_accepted_without_overflow() {
    let name = unique("hugetimeout");
    let _u = Unlink(name.clone());
    let reg = Registry::create(&name, &opts().lock_timeout(Duration::MAX)).unwrap();
    let s = reg.publish("h", 0, b"", b"").unwrap();
    assert_eq!(reg.wait_for("h", 0, Duration::MAX).unwrap().seq, s);
}

#[test]
fn registry_handles_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Registry>();
    check::<Segment>();
}

/// A live creator's registry whose init stamp was zeroed is corrupt, naming the segment and the
/// stamp and saying the header was overwritten, after the open's wait, for `open` and for
/// `open_or_create`, which keeps it: not "not initialised: its creator has not finished it" (a
/// creator stamps within milliseconds of recording itself, and this one recorded itself long
/// before). The stamp put back, it opens again.
#[test]
fn a_zeroed_stamp_under_a_live_creator_is_corrupt_not_uninitialised() {
    let opts = opts().init_timeout(Duration::from_secs(1));
    let (reg, _u) = new_registry("zeroed-stamp");
    let name = reg.segment().name().to_string();
    poke_u64(reg.segment(), 16, 0);
    for (which, r) in [
        ("open", Registry::open(&name, &opts)),
        ("open_or_create", Registry::open_or_create(&name, &opts)),
    ] {
        let t = Instant::now();
        let e = registry_err(r.map(|_| ()).unwrap_err());
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{which}: {:?}",
            t.elapsed()
        );
        assert!(matches!(e, RegistryError::Corrupt { .. }), "{which}: {e:?}");
        let e = e.to_string();
        assert!(
            e.contains(&format!("/{name} is corrupt: init stamp 0 after waiting"))
                && e.contains("overwritten"),
            "{which}: {e}"
        );
        assert!(!e.contains("not initialised"), "{which}: {e}");
    }
    poke_u64(reg.segment(), 16, layout::INIT_STAMP);
    drop(Registry::open(&name, &opts).unwrap());
    assert!(reg.get("x").unwrap().is_none());
}

/// A real creation stays one: a creator that records itself (stores its magic, which publishes
/// its identity) late in the open's wait, less than 500 ms before its end, and has not stamped by
/// then is `Uninitialised`, not corrupt; one recorded from the start that stamps within the wait
/// is opened.
#[test]
fn a_creator_recording_itself_late_in_the_wait_is_still_uninitialised() {
    let opts = opts().init_timeout(Duration::from_secs(1));
    // This process's creation: its recorded creator runs.
    let (_, _u0, mut img) = valid_image("late0");
    img[16..24].fill(0);
    let magic = img[0..8].to_vec();
    let mut unrecorded = img.clone();
    unrecorded[0..8].fill(0);
    let (name, _u) = raw_segment("late", &unrecorded);
    let recorder = {
        let name = name.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(700));
            let seg = Segment::open(&name).unwrap();
            poke_u64(&seg, 0, u64::from_le_bytes(magic.try_into().unwrap()));
        })
    };
    let e = registry_err(Registry::open(&name, &opts).map(|_| ()).unwrap_err());
    recorder.join().unwrap();
    assert!(matches!(e, RegistryError::Uninitialised { .. }), "{e:?}");
    // Recorded from the start, stamped 700 ms into the wait: opened.
    let (name, _u2) = raw_segment("stamped-late", &img);
    let stamper = {
        let name = name.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(700));
            let seg = Segment::open(&name).unwrap();
            poke_u64(&seg, 16, layout::INIT_STAMP);
        })
    };
    let r = Registry::open(&name, &opts);
    stamper.join().unwrap();
    drop(r.unwrap());
}

/// A registry in use whose header says its creator died before stamping it (the stamp zeroed and
/// the creator words overwritten with a dead process's) is no abandoned creation: participants
/// join and records are published only in a stamped registry. `open_or_create` refuses it as
/// corrupt and keeps it, with a record published and without (a participant's entry claimed),
/// where it used to remove the file under its users and make a new one.
#[test]
fn open_or_create_never_replaces_a_registry_in_use_whose_stamp_and_creator_were_overwritten() {
    let exists = |n: &str| std::fs::symlink_metadata(format!("/dev/shm/{n}")).is_ok();
    for published in [true, false] {
        let (reg, _u) = new_registry(if published { "used-rec" } else { "used-part" });
        let name = reg.segment().name().to_string();
        if published {
            reg.publish("kept", 7, b"tok", b"").unwrap();
        }
        for (k, w) in dead_identity().to_words().iter().enumerate() {
            poke_u64(reg.segment(), 96 + 8 * k, *w);
        }
        poke_u64(reg.segment(), 16, 0);
        let e = registry_err(
            Registry::open_or_create(&name, &opts())
                .map(|_| ())
                .unwrap_err(),
        );
        assert!(
            matches!(e, RegistryError::Corrupt { .. }),
            "{published}: {e:?}"
        );
        let e = e.to_string();
        assert!(
            e.contains("was in use") && e.contains("left as it is"),
            "{e}"
        );
        assert!(
            exists(&name),
            "{published}: the registry in use was removed"
        );
        poke_u64(reg.segment(), 16, layout::INIT_STAMP);
        let again = Registry::open(&name, &opts()).unwrap();
        assert_eq!(again.get("kept").unwrap().is_some(), published);
    }
}
