//! Hostile or broken files under a channel's segment name: a FIFO, a directory, a symbolic link, a
//! socket, a sparse file, another user's segment. Every Rust opener (consumer attach, inspection,
//! gc's removal, producer create) answers with a typed error naming what is there, never blocks,
//! never raises SIGBUS (also in a full /dev/shm), and never removes what is not its own.
//! Runs without a GPU; the full-/dev/shm case and the other-user case need root (CI runs as root)
//! and say so when skipped.

mod common;

use cuda_ipc::Error;
use cuda_ipc::channel::{ChannelError, Delivery};
use cuda_ipc::channel::{inspect, reclaim};
use cuda_ipc::raw::channel::testing::{ControlConsumer, ControlProducer};
use cuda_ipc::raw::shm::ShmError;
use cuda_ipc::token::TOKEN_LEN;
use std::ffi::CString;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::process::Command;
use std::time::{Duration, Instant};

fn path(channel: &str) -> String {
    format!("/dev/shm/{}", inspect::segment_name(channel))
}

fn name(tag: &str) -> String {
    format!("hostile-{tag}-{}", std::process::id())
}

/// Removes whatever is at the channel's path when dropped.
struct Planted(String);
impl Drop for Planted {
    fn drop(&mut self) {
        let p = path(&self.0);
        let _ = std::fs::remove_dir(&p);
        let _ = std::fs::remove_file(&p);
    }
}

fn mkfifo(p: &str) {
    let c = CString::new(p).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {p}");
}

fn tokens() -> Vec<[u8; TOKEN_LEN]> {
    vec![[0u8; TOKEN_LEN]; 2]
}

/// Every opener on `channel`, each bounded: (attach, inspect, remove_stale, create) error texts.
fn every_opener(channel: &str) -> [(String, Error); 4] {
    let t = Instant::now();
    let a = ControlConsumer::attach(channel, Delivery::EveryFrame)
        .map(|_| ())
        .unwrap_err();
    let i = inspect::inspect(channel).map(|_| ()).unwrap_err();
    let r = reclaim::remove_stale(channel).map(|_| ()).unwrap_err();
    let c = ControlProducer::create(channel, 4096, 2, &tokens())
        .map(|p| p.unlink())
        .unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "openers took {:?}",
        t.elapsed()
    );
    [
        ("attach".into(), a),
        ("inspect".into(), i),
        ("remove_stale".into(), r),
        ("create".into(), c),
    ]
}

fn assert_not_a_segment(channel: &str, kind: &str) {
    for (who, e) in every_opener(channel) {
        assert!(
            matches!(&e, Error::Shm(ShmError::NotASegment { kind: k, .. }) if *k == kind),
            "{who} on a {kind}: {e:?}"
        );
        assert!(e.to_string().contains(kind), "{who}: {e}");
    }
}

#[test]
fn a_fifo_under_a_channel_name_is_refused_by_every_opener_without_blocking_and_kept() {
    let n = name("fifo");
    let _g = Planted(n.clone());
    mkfifo(&path(&n));
    assert_not_a_segment(&n, "FIFO");
    let meta = std::fs::symlink_metadata(path(&n)).unwrap();
    assert!(meta.file_type().is_fifo(), "the FIFO was left where it was");
}

#[test]
fn a_directory_under_a_channel_name_is_refused_by_every_opener_and_kept() {
    let n = name("dir");
    let _g = Planted(n.clone());
    std::fs::create_dir(path(&n)).unwrap();
    assert_not_a_segment(&n, "directory");
    assert!(std::fs::symlink_metadata(path(&n)).unwrap().is_dir());
}

#[test]
fn a_socket_under_a_channel_name_is_refused_by_every_opener_and_kept() {
    let n = name("sock");
    let _g = Planted(n.clone());
    let _l = std::os::unix::net::UnixListener::bind(path(&n)).unwrap();
    assert_not_a_segment(&n, "socket");
    assert!(
        std::fs::symlink_metadata(path(&n))
            .unwrap()
            .file_type()
            .is_socket()
    );
}

/// A symbolic link is what stands under the name, as a FIFO is: `NotASegment` naming it, never
/// followed. It was an `InvalidArgument` ("invalid argument: ... is a symbolic link"), which read
/// as the caller's mistake.
#[test]
fn a_symbolic_link_under_a_channel_name_is_never_followed_or_removed() {
    let n = name("link");
    let _g = Planted(n.clone());
    let target = format!("/dev/shm/hostile-target-{}", std::process::id());
    std::fs::write(&target, vec![0u8; 65536]).unwrap();
    std::os::unix::fs::symlink(&target, path(&n)).unwrap();
    assert_not_a_segment(&n, "symbolic link");
    for (who, e) in every_opener(&n) {
        assert!(!e.to_string().contains("invalid argument"), "{who}: {e}");
    }
    assert!(
        std::fs::symlink_metadata(path(&n))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(std::fs::read(&target).unwrap(), vec![0u8; 65536]);
    std::fs::remove_file(&target).unwrap();
}

#[test]
fn a_sparse_file_is_reported_as_sparse_and_replaced_only_when_it_is_ours_and_old() {
    let n = name("sparse");
    let _g = Planted(n.clone());
    let f = common::plant(path(&n), &[]);
    f.set_len(1 << 20).unwrap(); // what `truncate -s 1M` makes: no page backed
    drop(f);
    let [(_, a), (_, i), (_, r), (_, c)] = every_opener(&n);
    for (who, e) in [("attach", a), ("inspect", i), ("remove_stale", r)] {
        assert!(
            matches!(e, Error::Shm(ShmError::Sparse { len: 1048576, .. })),
            "{who}: {e:?}"
        );
    }
    // Young: maybe a producer creating it right now. Not replaced.
    assert!(
        matches!(c, Error::Channel(ChannelError::CreationInProgress(_))),
        "{c:?}"
    );
    assert_eq!(std::fs::metadata(path(&n)).unwrap().len(), 1 << 20);
    // Older than 2 s and ours: an abandoned creation, replaced by a new producer.
    std::thread::sleep(Duration::from_millis(2100));
    let p = ControlProducer::create(&n, 4096, 2, &tokens()).unwrap();
    let c = ControlConsumer::attach(&n, Delivery::EveryFrame).unwrap();
    let (i, _) = p.try_acquire().unwrap();
    p.publish(i, b"after").unwrap();
    assert!(c.take(Some(Duration::from_secs(1))).unwrap().is_some());
    drop(c);
    p.unlink();
}

#[test]
fn a_live_producers_channel_and_one_of_another_layout_version_are_never_replaced() {
    let n = name("live");
    let _g = Planted(n.clone());
    let p = ControlProducer::create(&n, 4096, 2, &tokens()).unwrap();
    let e = ControlProducer::create(&n, 4096, 2, &tokens())
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(e, Error::Channel(ChannelError::AlreadyExists { pid, .. }) if pid == std::process::id()),
        "{e:?}"
    );
    assert!(
        inspect::inspect(&n).is_ok(),
        "the live channel is still there"
    );
    // The same segment claiming another layout version (a producer of the build before, whose
    // streams wait on interprocess release events): refused by name and version, and left in place.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path(&n))
        .unwrap();
    std::os::unix::fs::FileExt::write_at(
        &f,
        &(cuda_ipc::raw::channel::layout::VERSION - 1).to_le_bytes(),
        8,
    )
    .unwrap();
    for (who, e) in every_opener(&n) {
        assert!(
            matches!(
                e,
                Error::Channel(ChannelError::VersionMismatch {
                    found,
                    supported,
                    ..
                }) if found == supported - 1 && supported == cuda_ipc::raw::channel::layout::VERSION
            ),
            "{who}: {e:?}"
        );
    }
    assert!(std::fs::metadata(path(&n)).is_ok(), "never unlinked");
    drop(p);
}

/// Whether the test may make a user and a mount namespace (root, with useradd and unshare).
fn root() -> bool {
    rustix::process::geteuid().is_root()
}

#[test]
fn another_users_segment_is_refused_by_name_and_owner_and_never_removed_even_by_root() {
    if !root() {
        println!("skipped: needs root to give a file to another uid");
        return;
    }
    let n = name("other-user");
    let _g = Planted(n.clone());
    // A real channel, then handed to another uid: as if that user's producer made it.
    let p = ControlProducer::create(&n, 4096, 2, &tokens()).unwrap();
    let other = 54321u32;
    rustix::fs::chown(
        path(&n).as_str(),
        Some(rustix::process::Uid::from_raw(other)),
        None,
    )
    .unwrap();
    for (who, e) in every_opener(&n) {
        assert!(
            matches!(e, Error::Shm(ShmError::WrongOwner { owner, .. }) if owner == other),
            "{who}: {e:?}"
        );
    }
    assert_eq!(std::fs::metadata(path(&n)).unwrap().uid(), other);
    drop(p);
}

/// Another user's sparse file under a channel's name with the sizing lock held (a creation in
/// progress, or one faked to keep openers waiting): refused at once by whose it is, by every
/// opener, with or without group access; this user's own waits for the creation, as documented.
#[test]
fn another_users_creation_in_progress_is_refused_at_once_by_owner_not_waited_for() {
    if !root() {
        println!("skipped: needs root to give a file to another uid");
        return;
    }
    use std::os::unix::fs::OpenOptionsExt;
    let n = name("other-sizing");
    let _g = Planted(n.clone());
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path(&n))
        .unwrap();
    f.set_len(1 << 20).unwrap();
    common::hold_sizing_lock(&f);
    let other = 54322u32;
    rustix::fs::fchown(&f, Some(rustix::process::Uid::from_raw(other)), None).unwrap();
    let t = Instant::now();
    for (who, e) in every_opener(&n) {
        assert!(
            matches!(e, Error::Shm(ShmError::WrongOwner { owner, .. }) if owner == other),
            "{who}: {e:?}"
        );
    }
    let grouped = cuda_ipc::channel::Consumer::attach(
        &n,
        &cuda_ipc::channel::ConsumerOptions::new().group_access(true),
    )
    .map(|_| ())
    .unwrap_err();
    assert!(
        matches!(grouped, Error::Shm(ShmError::WrongOwner { owner, .. }) if owner == other),
        "{grouped:?}"
    );
    // Five openers, none waiting for the 2 s an own creation in progress gets.
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(std::fs::metadata(path(&n)).unwrap().uid(), other);
    drop(f);
}

const FULL_ROLE: &str = "CUDA_IPC_TEST_FULL_SHM";

#[test]
fn opening_a_sparse_segment_in_a_full_dev_shm_is_an_error_not_sigbus() {
    if let Ok(n) = std::env::var(FULL_ROLE) {
        // In a mount namespace with a 256 KiB /dev/shm: a 128 KiB sparse segment, and the rest of
        // the tmpfs filled, so its first touch could not get a page.
        let f = common::plant(path(&n), &[]);
        f.set_len(128 << 10).unwrap();
        drop(f);
        let mut filler = std::fs::File::create("/dev/shm/filler").unwrap();
        let _ = std::io::Write::write_all(&mut filler, &vec![1u8; 1 << 20]);
        drop(filler);
        for (who, e) in every_opener(&n) {
            assert!(
                matches!(e, Error::Shm(ShmError::Sparse { .. }))
                    || (who == "create"
                        && matches!(e, Error::Channel(ChannelError::CreationInProgress(_)))),
                "{who}: {e:?}"
            );
        }
        println!("@@ survived");
        return;
    }
    if !root() {
        println!("skipped: needs root for a mount namespace with a small /dev/shm");
        return;
    }
    let Some((out, text)) = in_small_shm(
        "opening_a_sparse_segment_in_a_full_dev_shm_is_an_error_not_sigbus",
        "size=256k",
        (FULL_ROLE, &name("full")),
    ) else {
        return;
    };
    assert!(
        out.status.success() && text.contains("@@ survived"),
        "child: {:?}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs test `test` of this binary again, in a mount namespace whose /dev/shm is a fresh tmpfs
/// mounted with `options` (`size=256k`), with the environment variable `role.0` set to `role.1`:
/// its output and stdout text, or `None` (said) where such a namespace cannot be made.
fn in_small_shm(
    test: &str,
    options: &str,
    role: (&str, &str),
) -> Option<(std::process::Output, String)> {
    let exe = std::env::current_exe().unwrap();
    let script = format!(
        "mount -t tmpfs -o {options} tmpfs /dev/shm && exec {} {test} --exact --nocapture --test-threads=1",
        exe.display()
    );
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .env(role.0, role.1)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() && !text.contains("running 1 test") {
        println!(
            "skipped: cannot make a mount namespace with a small tmpfs: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    Some((out, text))
}

const ORPHAN_ROLE: &str = "CUDA_IPC_TEST_ORPHAN_CHANNEL";

/// Two producers restarting a dead producer's channel at once: one gets the name, the other a
/// typed error, and nobody removes the segment the winner just made (the name is removed only
/// while it stands for the segment judged, under a lock every replacer takes).
#[test]
fn two_producers_restarting_a_dead_channel_at_once_never_remove_each_others_segment() {
    if let Ok(n) = std::env::var(ORPHAN_ROLE) {
        // A producer that dies without closing (no unlink), as a crash would leave it.
        let p = ControlProducer::create(&n, 4096, 2, &tokens()).unwrap();
        std::mem::forget(p);
        std::process::exit(0);
    }
    for round in 0..20 {
        let n = name(&format!("restart-{round}"));
        let _g = Planted(n.clone());
        let st = Command::new(std::env::current_exe().unwrap())
            .args([
                "two_producers_restarting_a_dead_channel_at_once_never_remove_each_others_segment",
                "--exact",
                "--test-threads=1",
            ])
            .env(ORPHAN_ROLE, &n)
            .status()
            .unwrap();
        assert!(st.success());
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let racers: Vec<_> = (0..2)
            .map(|_| {
                let (n, b) = (n.clone(), barrier.clone());
                std::thread::spawn(move || {
                    b.wait();
                    ControlProducer::create(&n, 4096, 2, &tokens())
                })
            })
            .collect();
        let results: Vec<_> = racers.into_iter().map(|t| t.join().unwrap()).collect();
        let winners: Vec<&ControlProducer> =
            results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert_eq!(
            winners.len(),
            1,
            "round {round}: {} producers got the name",
            winners.len()
        );
        for r in &results {
            if let Err(e) = r {
                assert!(
                    matches!(
                        e,
                        Error::Channel(
                            ChannelError::AlreadyExists { .. }
                                | ChannelError::CreationInProgress(_)
                        )
                    ),
                    "round {round}: {e:?}"
                );
            }
        }
        // The name stands for the winner's segment: what it publishes, inspection sees.
        let (i, _) = winners[0].try_acquire().unwrap();
        winners[0].publish(i, b"mine").unwrap();
        assert_eq!(inspect::inspect(&n).unwrap().head, 1, "round {round}");
        winners[0].unlink();
    }
}

const OTHER_VERSION: &str =
    "a_dead_producers_host_pool_is_kept_when_its_channel_has_another_layout_version";

/// gc's host-pool removal judges the pool with its channel: when the control segment has another
/// layout version, the pool is kept with it (another version's segments are never removed), even
/// though the pool's own layout is the same in both versions and its producer is dead.
#[test]
fn a_dead_producers_host_pool_is_kept_when_its_channel_has_another_layout_version() {
    if common::role().as_deref() == Some("host-producer") {
        let n = std::env::var("CUDA_IPC_TEST_CHANNEL").unwrap();
        let opts = cuda_ipc::channel::ChannelOptions::new(4096).buffers(2);
        let tx = cuda_ipc::channel::Producer::create_host(&n, &opts).unwrap();
        std::mem::forget(tx); // exits with both segments left, as a killed producer would
        std::process::exit(0);
    }
    let n = name("othervers");
    let _c = Planted(n.clone());
    let pool = format!("/dev/shm/{}", inspect::pool_segment_name(&n));
    let st = Command::new(std::env::current_exe().unwrap())
        .args([OTHER_VERSION, "--exact", "--nocapture"])
        .env("CUDA_IPC_TEST_ROLE", "host-producer")
        .env("CUDA_IPC_TEST_CHANNEL", &n)
        .status()
        .unwrap();
    assert!(st.success());
    assert!(std::path::Path::new(&pool).exists());
    // The control segment's layout version (bytes 8..12) as another build would have written it.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(path(&n))
            .unwrap();
        f.write_all_at(&2u32.to_le_bytes(), 8).unwrap();
    }
    let listed = inspect::stale_host_pools().unwrap();
    assert!(
        !listed.iter().any(|(c, _)| *c == n),
        "a pool of another version's channel listed as stale: {listed:?}"
    );
    match reclaim::remove_stale_host_pool(&n) {
        Err(Error::Channel(ChannelError::VersionMismatch { .. })) => {}
        other => panic!("expected VersionMismatch, got {other:?}"),
    }
    assert!(std::path::Path::new(&pool).exists(), "the pool was removed");
    // A producer restarting under the name is refused the same way, and removes nothing either.
    let opts = cuda_ipc::channel::ChannelOptions::new(4096).buffers(2);
    match cuda_ipc::channel::Producer::create_host(&n, &opts) {
        Err(Error::Channel(ChannelError::VersionMismatch { .. })) => {}
        other => panic!("expected VersionMismatch from create_host, got {other:?}"),
    }
    assert!(
        std::path::Path::new(&pool).exists(),
        "create_host removed the pool"
    );
    let _ = std::fs::remove_file(&pool);
}

/// A control segment whose size word (`segment_bytes`) disagrees with what its counts need, or
/// whose file is shorter than that, is refused by every opener with a message naming the numbers
/// that differ: the size word recorded and the size the counts need (and the file's size), never
/// two equal numbers.
#[test]
fn a_wrong_size_word_or_a_short_file_is_refused_naming_the_numbers_that_differ() {
    use cuda_ipc::channel::SegmentFault;
    use cuda_ipc::raw::channel::layout;
    use std::os::unix::fs::FileExt;
    let n = name("size-word");
    let _g = Planted(n.clone());
    // Made by this process, which runs: the segment is never taken for a dead producer's.
    drop(ControlProducer::create(&n, 4096, 2, &tokens()).unwrap());
    let need = layout::segment_len(2, 2);
    let len = std::fs::metadata(path(&n)).unwrap().len() as usize;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path(&n))
        .unwrap();
    let recorded = need as u64 + 4096;
    f.write_all_at(
        &recorded.to_le_bytes(),
        layout::header::SEGMENT_BYTES as u64,
    )
    .unwrap();
    for (who, e) in every_opener(&n).into_iter().take(3) {
        let text = e.to_string();
        match e {
            Error::Channel(ChannelError::BadSegment(SegmentFault::SizeWord {
                recorded: r,
                need: nd,
                len: l,
                buffers: 2,
                consumers: 2,
                ..
            })) => assert_eq!((r, nd, l), (recorded, need, len), "{who}"),
            other => panic!("{who}: {other:?}"),
        }
        assert!(
            text.contains(&format!("records a size of {recorded} bytes"))
                && text.contains(&format!("need {need}"))
                && text.contains(&format!("the file holds {len}")),
            "{who}: {text}"
        );
    }
    // The size word put back and the file cut short of what the counts need (a header's worth
    // left): the file's size and the size needed, two different numbers.
    f.write_all_at(
        &(need as u64).to_le_bytes(),
        layout::header::SEGMENT_BYTES as u64,
    )
    .unwrap();
    let short = 4096;
    f.set_len(short as u64).unwrap();
    for (who, e) in every_opener(&n).into_iter().take(3) {
        let text = e.to_string();
        assert!(
            matches!(
                e,
                Error::Channel(ChannelError::BadSegment(SegmentFault::Truncated { len, need: nd, .. }))
                    if len == short && nd == need
            ),
            "{who}: {text}"
        );
        assert!(
            text.contains(&format!("holds {short} bytes"))
                && text.contains(&format!("need {need}")),
            "{who}: {text}"
        );
    }
}

#[test]
fn a_segment_open_to_other_users_is_refused_by_every_opener_and_never_replaced_or_removed() {
    use std::os::unix::fs::PermissionsExt;
    // A live producer's segment made writable by anyone (0666), or readable by anyone (0604):
    // anyone may have written it, so no opener trusts it, and nothing replaces or removes it.
    for mode in [0o666, 0o604, 0o602] {
        let n = name(&format!("mode{mode:o}"));
        let _g = Planted(n.clone());
        let p = ControlProducer::create(&n, 4096, 2, &tokens()).unwrap();
        std::fs::set_permissions(path(&n), std::fs::Permissions::from_mode(mode)).unwrap();
        for (who, e) in every_opener(&n) {
            if who == "create" {
                // The live producer's: refused as taken, or by its mode.
                assert!(
                    matches!(
                        e,
                        Error::Channel(ChannelError::AlreadyExists { .. })
                            | Error::Shm(ShmError::InsecureMode { .. })
                    ),
                    "{who}: {e:?}"
                );
                continue;
            }
            assert!(
                matches!(e, Error::Shm(ShmError::InsecureMode { mode: m, .. }) if m == mode),
                "{mode:o}, {who}: {e:?}"
            );
            assert!(e.to_string().contains("open to other users"), "{who}: {e}");
        }
        drop(p); // unlinks its own segment by inode, whatever its mode
    }
    // Files of zeros, as a creation abandoned half-way leaves, but open to others: the library
    // never makes such a file, so no creator replaces it and no cleaner removes it.
    for mode in [0o666, 0o644] {
        let n = name(&format!("zeros{mode:o}"));
        let _g = Planted(n.clone());
        std::fs::write(path(&n), vec![0u8; 16384]).unwrap();
        std::fs::set_permissions(path(&n), std::fs::Permissions::from_mode(mode)).unwrap();
        std::thread::sleep(Duration::from_millis(2100)); // past any creation's grace
        for (who, e) in every_opener(&n) {
            assert!(
                matches!(e, Error::Shm(ShmError::InsecureMode { mode: m, .. }) if m == mode),
                "{mode:o}, {who}: {e:?}"
            );
        }
        assert_eq!(
            std::fs::metadata(path(&n)).unwrap().len(),
            16384,
            "{mode:o}: kept as it was"
        );
    }
}

#[test]
fn a_buffer_size_near_u64_max_in_a_host_channels_headers_is_a_mismatch_not_a_panic() {
    use cuda_ipc::channel::{
        ChannelOptions, Consumer, ConsumerOptions, Producer, SegmentFault, inspect,
    };
    use cuda_ipc::raw::channel::layout;
    use std::os::unix::fs::FileExt;
    let n = name("huge-bytes");
    let tx = Producer::create_host(&n, &ChannelOptions::new(16)).unwrap();
    // The same size in the control header and in the pool's (`PoolHeader::buffer_bytes`, after
    // magic, version, stamp, buffers and uid: byte 24): they agree, and rounded up to the
    // pool's 4096-byte stride it passes `u64::MAX`.
    let huge = u64::MAX - 10;
    let pool = format!("/dev/shm/{}", inspect::pool_segment_name(&n));
    for (p, at) in [(path(&n), layout::header::BUFFER_BYTES as u64), (pool, 24)] {
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.write_all_at(&huge.to_le_bytes(), at).unwrap();
    }
    match Consumer::attach(&n, &ConsumerOptions::new()) {
        Err(Error::Channel(ChannelError::BadSegment(SegmentFault::PoolMismatch {
            buffer_bytes,
            ..
        }))) => assert_eq!(buffer_bytes, huge),
        other => panic!("{:?}", other.map(|_| ())),
    }
    drop(tx);
}

/// A producer that makes its channel again with another geometry while a consumer attaches: the
/// consumer may read the old control segment and find the new pool (or the other way round). The
/// pool's generation is not the tokens': another incarnation of the channel, said as
/// `Superseded` (attach again), not `BadSegment` (a damaged pool), which a retry loop takes for
/// fatal. Made here without the race: the pool of a second channel of 3 buffers of 32 bytes is put
/// under the first's pool name (2 buffers of 16).
#[test]
fn a_pool_of_another_incarnation_with_another_geometry_is_superseded_not_damaged() {
    use cuda_ipc::channel::{ChannelOptions, Consumer, ConsumerOptions, Producer, inspect};
    let (a, b) = (name("incarnation-a"), name("incarnation-b"));
    let tx = Producer::create_host(&a, &ChannelOptions::new(16).buffers(2)).unwrap();
    let other = Producer::create_host(&b, &ChannelOptions::new(32).buffers(3)).unwrap();
    let pool = |n: &str| format!("/dev/shm/{}", inspect::pool_segment_name(n));
    std::fs::rename(pool(&b), pool(&a)).unwrap();
    match Consumer::attach(&a, &ConsumerOptions::new()) {
        Err(Error::Channel(ChannelError::Superseded(ch))) => assert_eq!(ch, a),
        other => panic!("{:?}", other.map(|_| ())),
    }
    drop(other);
    drop(tx);
    let _ = std::fs::remove_file(pool(&a));
}

const INODES_ROLE: &str = "CUDA_IPC_TEST_NO_INODES";

/// A /dev/shm with one free inode left, the process's first creation: its liveness file (made at
/// the first use of the process's identity) takes the inode and the segment is refused, or the
/// other way round; either way nothing of the failed creation is left behind (a host pool, a
/// channel or tensor-set segment made before the liveness file failed was left as "a creation
/// abandoned" until a `gc`).
#[test]
fn a_failed_first_creation_in_a_dev_shm_out_of_inodes_leaves_no_segment() {
    if let Ok(which) = std::env::var(INODES_ROLE) {
        // The tmpfs's root directory and this file take two of its three inodes.
        std::fs::File::create("/dev/shm/filler").unwrap();
        let n = name("inodes");
        let e = match which.as_str() {
            "channel" => cuda_ipc::channel::Producer::create_host(
                &n,
                &cuda_ipc::channel::ChannelOptions::new(64).buffers(2),
            )
            .map(drop),
            "tensorset" => cuda_ipc::tensorset::TensorSetWriter::create_host(
                &n,
                &[cuda_ipc::tensorset::TensorSpec::new(
                    "w",
                    cuda_ipc::tensorset::DType::U8,
                    &[64],
                )],
                &cuda_ipc::tensorset::TensorSetOptions::new(),
            )
            .map(drop),
            other => panic!("unknown role {other}"),
        };
        assert!(
            e.is_err(),
            "{which}: created in a /dev/shm without room for it"
        );
        let mut left: Vec<String> = std::fs::read_dir("/dev/shm")
            .unwrap()
            .map(|d| d.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|f| f != "filler" && !f.starts_with("cuda-ipc.live."))
            .collect();
        left.sort();
        assert!(left.is_empty(), "{which}: left behind {left:?} ({e:?})");
        println!("@@ clean");
        return;
    }
    if !root() {
        println!("skipped: needs root for a mount namespace with a small /dev/shm");
        return;
    }
    for which in ["channel", "tensorset"] {
        let Some((out, text)) = in_small_shm(
            "a_failed_first_creation_in_a_dev_shm_out_of_inodes_leaves_no_segment",
            "size=1m,nr_inodes=3",
            (INODES_ROLE, which),
        ) else {
            return;
        };
        assert!(
            out.status.success() && text.contains("@@ clean"),
            "{which}: {:?}\n{text}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
