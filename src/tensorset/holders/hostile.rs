//! Hostile or broken files under a holders segment's name (`cuda-ipc.th.NAME`), without a GPU: a
//! FIFO, a symbolic link, a directory, a sparse file, a segment cut short after a holder mapped
//! it, corrupted header words and slots, a full `/dev/shm` at creation. Every opener (a
//! [`Holder`], a writerless reader's open, the writer's creation, `gc`'s freeing of dead slots)
//! answers with a typed error within a bound, never raises SIGBUS, and never removes what it did
//! not make (`gc`'s removal: `tests/tensorset_holders_hostile.rs`).

use super::*;
use crate::ipc::fdpass::FdExport;
use crate::tensorset::DType;
use crate::tensorset::manifest::{KIND_VMM, Layout, Manifest, TensorSpec};
use crate::token::{Token, TokenKind};
use std::ffi::CString;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::time::{Duration, Instant};

fn unique(tag: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    format!(
        "th-hostile-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

fn path(set: &str) -> String {
    format!("/dev/shm/{HOLDERS_PREFIX}{set}")
}

/// Removes whatever is at the set's holders and manifest paths when dropped (the test's own).
struct Planted(String);
impl Drop for Planted {
    fn drop(&mut self) {
        for p in [
            path(&self.0),
            format!("/dev/shm/{}{}", segment::MANIFEST_PREFIX, self.0),
        ] {
            let _ = std::fs::remove_dir(&p);
            let _ = std::fs::remove_file(&p);
        }
    }
}

/// A VMM manifest of `buffers` × 1 allocations naming holders generation `holders_generation`,
/// whose tokens name a dead writer (this process with another start time); made under `set`.
fn dead_writers_manifest(set: &str, buffers: usize, holders_generation: u64) -> Manifest {
    let mut dead = ProcessIdentity::current().unwrap();
    dead.start_time += 1;
    let layout = Layout::new(&[TensorSpec::new("w", DType::F32, &[16])]).unwrap();
    let tokens = (0..buffers)
        .map(|b| {
            vec![
                Token {
                    kind: TokenKind::VmmMemory,
                    handle: [0; 64],
                    offset: 0,
                    len: 64,
                    device: crate::driver::Uuid([0; 16]),
                    exporter: dead,
                    export_id: 1 + b as u32,
                }
                .to_bytes(),
            ]
        })
        .collect();
    let m = Manifest {
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
    };
    drop(segment::create_manifest(set, &m).unwrap());
    m
}

/// Every opener of set `set`'s holders segment, each bounded: (who, what it said).
fn every_opener(set: &str, m: &Manifest) -> Vec<(&'static str, Result<()>)> {
    let t = Instant::now();
    let out = vec![
        ("open", HoldersSegment::open(set, None).map(|_| ())),
        ("holder", Holder::open(set).map(|_| ())),
        ("writerless", Writerless::whole(set, m, 1).map(|_| ())),
        (
            "create",
            HoldersSegment::create(set, m.buffers, 1, [0; 32], 64).map(|_| ()),
        ),
        (
            "free_dead",
            HoldersSegment::open(set, None).map(|h| drop(h.free_dead())),
        ),
    ];
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "openers took {:?}",
        t.elapsed()
    );
    out
}

fn mkfifo(p: &str) {
    let c = CString::new(p).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {p}");
}

#[test]
fn a_fifo_or_a_directory_under_the_holders_name_is_refused_by_every_opener_and_kept() {
    for (kind, plant) in [
        ("FIFO", mkfifo as fn(&str)),
        ("directory", |p: &str| std::fs::create_dir(p).unwrap()),
    ] {
        let set = unique("plant");
        let _g = Planted(set.clone());
        plant(&path(&set));
        let m = dead_writers_manifest(&set, 1, 7);
        for (who, r) in every_opener(&set, &m) {
            assert!(
                matches!(&r, Err(Error::Shm(ShmError::NotASegment { kind: k, .. })) if *k == kind),
                "{who} on a {kind}: {r:?}"
            );
        }
        let ft = std::fs::symlink_metadata(path(&set)).unwrap().file_type();
        assert!(ft.is_fifo() || ft.is_dir(), "the {kind} was left as it was");
    }
}

#[test]
fn a_symbolic_link_under_the_holders_name_is_never_followed_or_removed() {
    let set = unique("link");
    let _g = Planted(set.clone());
    // A real holders segment elsewhere: the link must not lead anyone to it.
    let target = unique("target");
    let _t = Planted(target.clone());
    let real = HoldersSegment::create(&target, 1, 1, [0; 32], 64).unwrap();
    std::os::unix::fs::symlink(path(&target), path(&set)).unwrap();
    let m = dead_writers_manifest(&set, 1, real.generation());
    for (who, r) in every_opener(&set, &m) {
        let e = r.unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{who}: {e}");
    }
    assert!(
        std::fs::symlink_metadata(path(&set))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(real.servers().is_empty(), "nobody claimed through the link");
}

#[test]
fn a_sparse_file_under_the_holders_name_is_refused_and_replaced_only_once_old() {
    let set = unique("sparse");
    let _g = Planted(set.clone());
    // The size a holders segment of one allocation has, every page a hole (`truncate -s`), with
    // the mode the library gives its segments (made so, not changed after: the age is ctime's).
    let len = (HEADER_PAGE + HOLDER_SLOTS * slot_len(1)).next_multiple_of(HEADER_PAGE) as u64;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path(&set))
        .unwrap();
    f.set_len(len).unwrap();
    drop(f);
    let m = dead_writers_manifest(&set, 1, 7);
    for (who, r) in every_opener(&set, &m) {
        let ok = match who {
            // Young: maybe a writer sizing it right now.
            "create" => matches!(
                r,
                Err(Error::TensorSet(TensorSetError::CreationInProgress(_)))
            ),
            _ => matches!(r, Err(Error::Shm(ShmError::Sparse { len: l, .. })) if l == len),
        };
        assert!(ok, "{who}: {r:?}");
    }
    assert_eq!(std::fs::metadata(path(&set)).unwrap().len(), len);
    // Older than 2 s and ours: a creation abandoned half-way, replaced by a writer's creation.
    std::thread::sleep(Duration::from_millis(2100));
    let h = HoldersSegment::create(&set, 1, 1, [0; 32], 64).unwrap();
    let c = h.claim(HolderRole::Holder, &[1]).unwrap();
    assert_eq!(HoldersSegment::open(&set, None).unwrap().servers().len(), 1);
    h.release(c);
}

fn memfd(content: &str) -> OwnedFd {
    let fd = rustix::fs::memfd_create("th-hostile", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let mut f = std::fs::File::from(fd);
    f.write_all(content.as_bytes()).unwrap();
    f.into()
}

#[test]
fn a_holders_segment_cut_short_under_a_holder_is_never_touched_again() {
    let set = unique("cut");
    let _g = Planted(set.clone());
    let h = HoldersSegment::create(&set, 1, 1, [0; 32], 64).unwrap();
    let m = dead_writers_manifest(&set, 1, h.generation());
    // A live server (this process, a memfd for the allocation), so a Holder can fetch from it.
    let export = FdExport::new(memfd("allocation")).unwrap();
    let served = h.claim(HolderRole::Holder, &[export.id()]).unwrap();
    let holder = Holder::open(&set).unwrap();
    assert_eq!(holder.status(), HolderStatus::Serving);
    let (wl, generation, ..) = {
        h.record_whole(1, 0, &[1; 32]);
        Writerless::whole(&set, &m, 1).unwrap()
    };
    assert_eq!(generation, 1);
    let reading = wl.claim_reading().unwrap();
    // Cut to its header page: the slots now lie past the end of the file.
    rustix::fs::ftruncate(h.segment().fd(), HEADER_PAGE as u64).unwrap();
    let shrunk = |e: &Error| matches!(e, Error::Shm(ShmError::Shrunk { len: 4096, .. }));
    assert_eq!(holder.status(), HolderStatus::Damaged);
    assert!(h.servers().is_empty(), "no slot read");
    assert!(!h.held_by_live() && !h.has_live_writer() && !h.reading_held(0));
    let e = h.claim(HolderRole::Holder, &[1]).unwrap_err();
    assert!(shrunk(&e), "{e:?}");
    let e = wl.set_reading(&reading, Some(0)).unwrap_err();
    assert!(shrunk(&e), "{e:?}");
    let e = h.memory_facts().unwrap_err();
    assert!(shrunk(&e), "{e:?}");
    assert!(matches!(h.last_whole(), Whole::None(w) if w.contains("cut short")));
    h.mark_writing(2, 0);
    h.record_whole(2, 0, &[2; 32]);
    // Cut to nothing: even the header words lie past the end now.
    rustix::fs::ftruncate(h.segment().fd(), 0).unwrap();
    assert_eq!(holder.status(), HolderStatus::Damaged);
    assert!(matches!(h.last_whole(), Whole::None(_)));
    h.mark_writing(3, 0);
    // Letting go touches nothing either (the process lives on to say so).
    drop(holder);
    wl.release(reading);
    h.release(served);
    drop((wl, h));
    // A new opener finds it too small, and leaves it.
    let e = HoldersSegment::open(&set, None).unwrap_err();
    assert!(
        matches!(e, Error::Shm(ShmError::TooSmall { len: 0, .. })),
        "{e:?}"
    );
    assert!(std::fs::metadata(path(&set)).is_ok());
}

#[test]
fn corrupted_header_words_and_slots_are_typed_errors_or_passed_over() {
    let set = unique("corrupt");
    let _g = Planted(set.clone());
    let h = HoldersSegment::create(&set, 2, 1, [0; 32], 64).unwrap();
    let hdr = versioned::header::<segment::HoldersHeader>(h.segment());
    // Another layout version.
    hdr.version().store(9, Ordering::Relaxed);
    let e = HoldersSegment::open(&set, None).unwrap_err();
    assert!(
        matches!(
            e,
            Error::TensorSet(TensorSetError::VersionMismatch { found: 9, .. })
        ),
        "{e:?}"
    );
    hdr.version().store(segment::VERSION, Ordering::Relaxed);
    // A slot area length that does not match the counts.
    let body = hdr.body_len();
    hdr.set_body(body + 8, 2);
    let e = HoldersSegment::open(&set, None).unwrap_err();
    assert!(
        matches!(e, Error::TensorSet(TensorSetError::BadManifest { .. })),
        "{e:?}"
    );
    hdr.set_body(body, 2);
    // A record naming a buffer the set does not have.
    h.record_whole(1, 0, &[1; 32]);
    h.words().rec_buffer.store(7, Ordering::Relaxed);
    assert!(matches!(h.last_whole(), Whole::None(w) if w.contains("buffer")));
    // Slots: an impossible state, an unknown role, a live stranger (pid 1) with export ids it
    // never offered. Readers pass over the first two; a fetch asks the stranger and fails.
    let (s0, _) = h.slot(0);
    s0.state.store(u64::MAX, Ordering::Relaxed);
    let bogus = h.claim(HolderRole::Holder, &[5, 6]).unwrap();
    let (s1, _) = h.slot(bogus.index);
    s1.role.store(99, Ordering::Relaxed);
    let init = ProcessIdentity {
        pid: 1,
        start_time: crate::identity::start_time_of(1).unwrap().unwrap(),
        ..ProcessIdentity::current().unwrap()
    };
    let stranger = h.claim_as(HolderRole::Holder, &[7, 8], init, 0).unwrap();
    assert_eq!(init.liveness_as(0), Liveness::Alive);
    let servers = h.servers();
    assert_eq!(servers.len(), 1, "{servers:?}");
    assert_eq!(servers[0].slot, stranger.index);
    let m = dead_writers_manifest(&set, 2, h.generation());
    let t = Instant::now();
    let e = fetch_all(&set, &m, &h).unwrap_err();
    assert!(
        matches!(e, Error::TensorSet(TensorSetError::NoServer { .. })),
        "{e:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(15), "{:?}", t.elapsed());
    // A claim still finds a good slot; gc frees nothing that is not dead.
    let mine = h.claim(HolderRole::Holder, &[1, 2]).unwrap();
    assert!(mine.index > stranger.index);
    assert!(h.free_dead().iter().all(|s| s.slot != mine.index));
    h.release(mine);
}

/// Set by the parent: the set name a child in a small tmpfs creates.
const FULL: &str = "CUDA_IPC_TEST_FULL_TH";

#[test]
fn creating_a_holders_segment_in_a_full_dev_shm_is_no_space_and_leaves_nothing() {
    if let Ok(set) = std::env::var(FULL) {
        // In a mount namespace with a 64 KiB /dev/shm: the largest holders segment (1024
        // entries a slot, about 270 KB) cannot be made.
        let e = HoldersSegment::create(&set, 1, MAX_HOLDER_ENTRIES, [0; 32], 64).unwrap_err();
        assert!(matches!(e, Error::Shm(ShmError::NoSpace { .. })), "{e:?}");
        assert!(
            std::fs::symlink_metadata(path(&set)).is_err(),
            "left behind"
        );
        // A small one still fits, and opens.
        let h = HoldersSegment::create(&set, 1, 1, [0; 32], 64).unwrap();
        assert!(HoldersSegment::open(&set, None).is_ok());
        h.unlink();
        println!("@@ survived");
        return;
    }
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root for a mount namespace with a small /dev/shm");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let test = "tensorset::holders::hostile::creating_a_holders_segment_in_a_full_dev_shm_is_no_space_and_leaves_nothing";
    let script = format!(
        "mount -t tmpfs -o size=64k tmpfs /dev/shm && exec {} {test} --exact --nocapture --test-threads=1",
        exe.display()
    );
    let out = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .env(FULL, unique("full"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() && !text.contains("running 1 test") {
        println!(
            "skipped: cannot make a mount namespace with a small tmpfs: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    assert!(
        out.status.success() && text.contains("@@ survived"),
        "child: {:?}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn another_users_holders_segment_is_refused_by_every_opener_and_kept() {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root to give a file to another uid");
        return;
    }
    let set = unique("other-user");
    let _g = Planted(set.clone());
    let h = HoldersSegment::create(&set, 1, 1, [0; 32], 64).unwrap();
    let m = dead_writers_manifest(&set, 1, h.generation());
    // As if that user's writer made it (and died: nobody serves).
    let other = 54321;
    rustix::fs::fchown(
        h.segment().fd(),
        Some(rustix::process::Uid::from_raw(other)),
        None,
    )
    .unwrap();
    for (who, r) in every_opener(&set, &m) {
        assert!(
            matches!(&r, Err(Error::Shm(ShmError::WrongOwner { owner, .. })) if *owner == other),
            "{who}: {r:?}"
        );
    }
    assert!(h.servers().is_empty(), "nobody claimed a slot");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(path(&set)).unwrap()),
        other,
        "still there, still theirs"
    );
}
