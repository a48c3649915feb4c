//! The shared-memory primitives under the registry: segments, shared futex words, the seqlock.

use cuda_ipc::Error;
use cuda_ipc::raw::shm::ShmError;
use cuda_ipc::raw::shm::{self, Segment, SegmentOptions, SeqLock, WaitResult};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "cuda-ipc-test-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn mode_of(name: &str) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(format!("/dev/shm/{name}"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777
}

#[test]
fn created_segment_is_zeroed_private_and_opens_elsewhere() {
    let name = unique("seg");
    let a = Segment::create(&name, 8192, &SegmentOptions::new()).unwrap();
    assert_eq!(a.len(), 8192);
    assert_eq!(a.name(), name);
    assert_eq!(mode_of(&name), 0o600);
    // SAFETY: 8192 bytes are mapped; this process made the segment and nobody else writes it.
    unsafe { a.as_ptr().add(100).write_volatile(7) };
    let b = Segment::open(&name).unwrap();
    assert_eq!(b.len(), 8192);
    // SAFETY: as above; the two mappings share the page.
    assert_eq!(unsafe { b.as_ptr().add(100).read_volatile() }, 7);
    // SAFETY: as above.
    assert_eq!(unsafe { b.as_ptr().add(101).read_volatile() }, 0);
    b.check_owner().unwrap();
    Segment::unlink(&name).unwrap();
}

#[test]
fn group_access_option_gives_mode_0660_whatever_the_umask() {
    let name = unique("grp");
    let _s = Segment::create(&name, 4096, &SegmentOptions::new().group_access(true)).unwrap();
    assert_eq!(mode_of(&name), 0o660);
    Segment::unlink(&name).unwrap();
}

#[test]
fn creating_an_existing_segment_fails_and_leaves_it_alone() {
    let name = unique("dup");
    let _a = Segment::create(&name, 4096, &SegmentOptions::new()).unwrap();
    let e = Segment::create(&name, 4096, &SegmentOptions::new()).unwrap_err();
    assert!(
        matches!(e, Error::Shm(ShmError::AlreadyExists { .. })),
        "{e}"
    );
    assert!(Segment::open(&name).is_ok());
    Segment::unlink(&name).unwrap();
}

#[test]
fn opening_a_missing_segment_fails_with_not_found() {
    let e = Segment::open(&unique("missing")).unwrap_err();
    assert!(matches!(e, Error::Shm(ShmError::NotFound { .. })), "{e}");
}

#[test]
fn zero_size_or_short_segment_is_an_error_not_a_fault() {
    let name = unique("zero");
    let path = format!("/{name}");
    let fd = rustix::shm::open(
        path.as_str(),
        rustix::shm::OFlags::CREATE | rustix::shm::OFlags::EXCL | rustix::shm::OFlags::RDWR,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .unwrap();
    let e = Segment::open(&name).unwrap_err();
    assert!(
        matches!(e, Error::Shm(ShmError::TooSmall { len: 0, .. })),
        "{e}"
    );
    rustix::fs::ftruncate(&fd, 100).unwrap();
    let e = Segment::open_with_min_len(&name, 4096).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Shm(ShmError::TooSmall {
                len: 100,
                min: 4096,
                ..
            })
        ),
        "{e}"
    );
    // Long enough, but its page was never allocated (ftruncate alone): sparse, not mapped.
    let e = Segment::open_with_min_len(&name, 100).unwrap_err();
    assert!(
        matches!(e, Error::Shm(ShmError::Sparse { len: 100, .. })),
        "{e}"
    );
    rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, 100).unwrap();
    assert!(Segment::open_with_min_len(&name, 100).is_ok());
    Segment::unlink(&name).unwrap();
}

#[test]
fn bad_segment_names_are_rejected() {
    for bad in [
        "",
        "/lead",
        "a/b",
        "..",
        ".",
        "sp ace",
        "ü",
        &"x".repeat(201),
    ] {
        let e = Segment::create(bad, 4096, &SegmentOptions::new()).unwrap_err();
        assert!(
            matches!(e, Error::Shm(ShmError::InvalidName { .. })),
            "{bad:?}: {e}"
        );
        let e = Segment::open(bad).unwrap_err();
        assert!(
            matches!(e, Error::Shm(ShmError::InvalidName { .. })),
            "{bad:?}: {e}"
        );
    }
    shm::validate_name(&"x".repeat(200)).unwrap();
    shm::validate_name("a.B_c-9").unwrap();
}

#[test]
fn zero_length_create_is_an_invalid_argument() {
    let e = Segment::create(&unique("zlen"), 0, &SegmentOptions::new()).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

#[test]
fn segment_too_large_for_dev_shm_fails_at_creation_naming_dev_shm() {
    let name = unique("huge");
    // Far beyond any tmpfs here (1 PiB); ftruncate or fallocate refuses it.
    let e = Segment::create(&name, 1 << 50, &SegmentOptions::new()).unwrap_err();
    assert!(e.to_string().contains("/dev/shm"), "{e}");
    // Nothing is left behind.
    assert!(matches!(
        Segment::open(&name).unwrap_err(),
        Error::Shm(ShmError::NotFound { .. })
    ));
}

#[test]
fn segment_owned_by_another_user_is_refused_by_the_owner_check() {
    let name = unique("owner");
    let seg = Segment::create(&name, 4096, &SegmentOptions::new()).unwrap();
    let me = rustix::process::geteuid().as_raw();
    let other = if me == 0 { 4242 } else { me };
    // Only root can give a file away; otherwise this test checks the positive case only.
    let gave =
        rustix::fs::fchown(seg.fd(), Some(rustix::process::Uid::from_raw(other)), None).is_ok();
    let opened = Segment::open(&name).unwrap();
    let r = opened.check_owner();
    if gave && other != me {
        let e = r.unwrap_err();
        assert!(
            matches!(e, Error::Shm(ShmError::WrongOwner { owner: 4242, .. })),
            "{e}"
        );
    } else {
        r.unwrap();
    }
    Segment::unlink(&name).unwrap();
}

#[test]
fn futex_wait_times_out_and_sees_changed_values() {
    let w = AtomicU32::new(5);
    let t = Instant::now();
    assert_eq!(
        shm::futex::wait(&w, 5, Duration::from_millis(20)),
        WaitResult::TimedOut
    );
    assert!(t.elapsed() >= Duration::from_millis(15));
    assert_eq!(
        shm::futex::wait(&w, 4, Duration::from_secs(5)),
        WaitResult::ValueChanged
    );
}

#[test]
fn futex_wake_reaches_a_sleeping_thread() {
    let w = std::sync::Arc::new(AtomicU32::new(0));
    let w2 = w.clone();
    let h = std::thread::spawn(move || {
        let t = Instant::now();
        while w2.load(Ordering::Acquire) == 0 {
            shm::futex::wait(&w2, 0, Duration::from_secs(5));
        }
        t.elapsed()
    });
    std::thread::sleep(Duration::from_millis(20));
    w.store(1, Ordering::Release);
    shm::futex::wake_all(&w);
    assert!(h.join().unwrap() < Duration::from_secs(4));
}

#[test]
fn seqlock_reads_what_was_written_and_stalls_on_an_open_write() {
    let seq = AtomicU64::new(0);
    let words: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(0)).collect();
    let lock = SeqLock::new(&seq, &words);
    let w = lock.try_write().unwrap();
    assert!(lock.try_write().is_none());
    for i in 0..4 {
        w.store(i, 10 + i as u64);
    }
    let mut out = [0u64; 4];
    assert!(matches!(
        lock.read(&mut out, 3),
        Err(ShmError::WriterStalled { retries: 3 })
    ));
    assert_eq!(w.finish(), 2);
    assert_eq!(lock.read(&mut out, 3).unwrap(), 2);
    assert_eq!(out, [10, 11, 12, 13]);
    // A writer that "dies" inside (forgotten guard) leaves the sequence odd; adopting its write
    // keeps it odd until the new payload is stored, then closes it.
    std::mem::forget(lock.try_write().unwrap());
    assert!(lock.read(&mut out, 2).is_err());
    let w = lock.adopt_open_write().unwrap();
    assert_eq!(w.sequence(), 3);
    for i in 0..4 {
        w.store(i, 0);
    }
    assert!(lock.read(&mut out, 2).is_err(), "still odd while adopted");
    assert_eq!(w.finish(), 4);
    assert!(lock.adopt_open_write().is_none());
    assert_eq!(lock.read(&mut out, 2).unwrap(), 4);
    assert_eq!(out, [0; 4]);
}

#[test]
fn seqlock_under_concurrent_writers_and_readers_never_tears() {
    let seq = AtomicU64::new(0);
    let words: Vec<AtomicU64> = (0..8).map(|_| AtomicU64::new(0)).collect();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let (seq, words, stop) = (&seq, &words, &stop);
            s.spawn(move || {
                let lock = SeqLock::new(seq, words);
                let mut v = t << 40;
                while !stop.load(Ordering::Relaxed) {
                    if let Some(w) = lock.try_write() {
                        v += 1;
                        for i in 0..8 {
                            w.store(i, v);
                        }
                    }
                }
            });
        }
        let lock = SeqLock::new(&seq, &words);
        let end = Instant::now() + Duration::from_millis(300);
        let mut ok = 0u64;
        while Instant::now() < end {
            let mut out = [0u64; 8];
            if lock.read(&mut out, 1000).is_ok() {
                assert!(out.iter().all(|x| *x == out[0]), "torn read {out:?}");
                ok += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        assert!(ok > 0);
    });
}

/// A symbolic link in /dev/shm under a segment's name (anyone can make one there) is never
/// followed: opening it as a segment, a registry or a channel fails and says why, and the file it
/// points to is left alone.
#[test]
fn a_symbolic_link_named_like_a_segment_is_never_followed() {
    use cuda_ipc::registry::{Registry, RegistryOptions};
    let target = unique("symlink-target");
    let seg = Segment::create(&target, 4096, &SegmentOptions::new()).unwrap();
    let link = unique("symlink");
    let chan_link = format!("cuda-ipc.ch.{link}");
    for l in [&link, &chan_link] {
        std::os::unix::fs::symlink(format!("/dev/shm/{target}"), format!("/dev/shm/{l}")).unwrap();
    }
    let results = [
        Segment::open(&link).map(|_| ()),
        Registry::open(&link, &RegistryOptions::new()).map(|_| ()),
        cuda_ipc::registry::inspect::inspect(&link).map(|_| ()),
        cuda_ipc::channel::inspect::inspect(&link).map(|_| ()),
    ];
    // Removed before any assertion, so a failure leaves nothing behind.
    for l in [&link, &chan_link] {
        std::fs::remove_file(format!("/dev/shm/{l}")).unwrap();
    }
    let _ = Segment::unlink(&target);
    for r in results {
        let e = r.expect_err("opened through a symbolic link");
        assert!(e.to_string().contains("is a symbolic link"), "{e}");
    }
    // The target was left alone: still the size it was made with.
    assert_eq!(seg.len(), 4096);
}
