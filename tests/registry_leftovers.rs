//! What stands under a registry's name without the registry magic (an empty file, a sparse one,
//! one whose header was never begun: a creator killed before its first store, or another
//! program's segment, which nothing tells apart, since a registry's name is anyone's) is never
//! removed or replaced: `open_or_create` and the library's `gc` rule
//! (`registry::inspect::abandoned`, `remove_abandoned`) both say `NoMagic`, which tells its owner
//! how to remove it. Only what records a dead creator (the magic, no stamp) is removed. A young
//! one and another user's are kept by both.

mod common;

use common::{Unlink, unique};
use cuda_ipc::Error;
use cuda_ipc::raw::registry_layout as layout;
use cuda_ipc::raw::shm::{Segment, SegmentOptions, ShmError};
use cuda_ipc::registry::RegistryError;
use cuda_ipc::registry::{Registry, RegistryOptions, inspect};
use std::time::{Duration, Instant};

fn opts() -> RegistryOptions {
    RegistryOptions::new()
        .capacity(8)
        .participants(8)
        .init_timeout(Duration::from_millis(100))
}

fn exists(name: &str) -> bool {
    std::fs::symlink_metadata(format!("/dev/shm/{name}")).is_ok()
}

/// A file under `name` as a creator killed before `ftruncate` leaves it: empty.
fn empty(name: &str) {
    drop(
        rustix::shm::open(
            format!("/{name}").as_str(),
            rustix::shm::OFlags::CREATE | rustix::shm::OFlags::EXCL | rustix::shm::OFlags::RDWR,
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap(),
    );
}

/// A file under `name` as a creator killed between `ftruncate` and `fallocate` leaves it: sized,
/// its pages holes.
fn sparse(name: &str) {
    let fd = rustix::shm::open(
        format!("/{name}").as_str(),
        rustix::shm::OFlags::CREATE | rustix::shm::OFlags::EXCL | rustix::shm::OFlags::RDWR,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .unwrap();
    rustix::fs::ftruncate(&fd, layout::total_size(8, 8) as u64).unwrap();
}

/// Waits until files made now are older than the grace (`ABANDONED_AFTER`, 2 s, counted from
/// `st_ctime` in whole seconds).
fn past_the_grace() {
    std::thread::sleep(Duration::from_millis(2200));
}

fn shm_err(e: Error) -> ShmError {
    match e {
        Error::Shm(e) => e,
        e => panic!("not a segment error: {e:?}"),
    }
}

#[test]
fn an_empty_or_sparse_file_under_a_registry_name_is_never_replaced_and_named_for_its_owner_to_remove()
 {
    let (e, s, z) = (
        unique("left-empty"),
        unique("left-sparse"),
        unique("left-zero"),
    );
    let _u = (Unlink(e.clone()), Unlink(s.clone()), Unlink(z.clone()));
    empty(&e);
    sparse(&s);
    // Pages reserved, header never begun (killed before its first store).
    drop(Segment::create(&z, layout::total_size(8, 8), &SegmentOptions::new()).unwrap());
    // Young: a creator may be at work; reported, kept, and not a leftover for gc either.
    let err = shm_err(Registry::open_or_create(&e, &opts()).unwrap_err());
    assert!(matches!(err, ShmError::TooSmall { len: 0, .. }), "{err}");
    let err = shm_err(Registry::open_or_create(&s, &opts()).unwrap_err());
    assert!(matches!(err, ShmError::Sparse { .. }), "{err}");
    assert!(Registry::open_or_create(&z, &opts()).is_err());
    for n in [&e, &s, &z] {
        assert_eq!(inspect::abandoned(n).unwrap(), None, "{n}");
        assert_eq!(
            cuda_ipc::registry::remove_abandoned(n).unwrap(),
            None,
            "{n}"
        );
        assert!(exists(n), "{n}");
    }
    past_the_grace();
    for n in [&e, &s, &z] {
        // Nothing in it records a creator: it may be another program's, so neither a tool that
        // was only given the name nor a creator that asks for the name takes it away.
        let err = registry_err(inspect::abandoned(n).unwrap_err());
        assert!(matches!(err, RegistryError::NoMagic { .. }), "{n}: {err}");
        let t = Instant::now();
        let err = registry_err(Registry::open_or_create(n, &opts()).unwrap_err());
        assert!(matches!(err, RegistryError::NoMagic { .. }), "{n}: {err}");
        assert!(
            err.to_string().contains("remove it if no program uses it"),
            "{err}"
        );
        // Said at once (the opener's bounded wait aside), not after a long wait.
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{n}: {:?}",
            t.elapsed()
        );
        assert!(exists(n), "{n}");
        // Once its owner removed it, the name is a registry's again.
        Registry::unlink(n).unwrap();
        let reg = Registry::open_or_create(n, &opts()).unwrap();
        reg.publish("after-removal", 1, b"", b"").unwrap();
        assert_eq!(
            inspect::abandoned(n).unwrap(),
            None,
            "{n}: a finished registry"
        );
    }
}

/// Plants under `name` what a registry creator killed between its first stores and its stamp
/// leaves: the magic, this layout version, `creator` and this user's uid as its creator, no init
/// stamp, every page written. Offsets: docs/registry-layout.md.
fn unstamped(name: &str, creator: cuda_ipc::identity::ProcessIdentity) {
    let mut b = vec![0u8; layout::total_size(8, 8)];
    let mut put = |at: usize, bytes: &[u8]| b[at..at + bytes.len()].copy_from_slice(bytes);
    put(0, &layout::MAGIC.to_le_bytes());
    put(8, &layout::LAYOUT_VERSION.to_le_bytes());
    put(84, &rustix::process::geteuid().as_raw().to_le_bytes());
    for (i, w) in creator.to_words().iter().enumerate() {
        put(96 + 8 * i, &w.to_le_bytes());
    }
    common::plant(format!("/dev/shm/{name}"), &b);
}

/// A process that ran and is gone (a `true` child, reaped), with a start time no process has.
fn dead_identity() -> cuda_ipc::identity::ProcessIdentity {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    child.wait().unwrap();
    cuda_ipc::identity::ProcessIdentity {
        pid: child.id(),
        start_time: 1,
        ..cuda_ipc::identity::ProcessIdentity::current().unwrap()
    }
}

fn registry_err(e: Error) -> RegistryError {
    match e {
        Error::Registry(e) => e,
        e => panic!("not a registry error: {e:?}"),
    }
}

#[test]
fn gcs_rule_removes_a_dead_creators_unstamped_registry_and_never_a_file_without_the_magic() {
    let [empty_old, sparse_old, zeros_old, data_old, dead, finished] = [
        "gc-empty",
        "gc-sparse",
        "gc-zeros",
        "gc-data",
        "gc-dead",
        "gc-finished",
    ]
    .map(unique);
    let _u = [
        &empty_old,
        &sparse_old,
        &zeros_old,
        &data_old,
        &dead,
        &finished,
    ]
    .map(|n| Unlink(n.clone()));
    empty(&empty_old);
    sparse(&sparse_old);
    common::plant(format!("/dev/shm/{zeros_old}"), &vec![0u8; 1 << 16]);
    // As `multiprocessing.shared_memory` leaves one: sized with `ftruncate` (sparse), its first
    // bytes zero, data further on.
    let f = common::plant(format!("/dev/shm/{data_old}"), b"");
    f.set_len(1 << 20).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"live data of another program", 200_000).unwrap();
    let reg = Registry::create(&finished, &opts()).unwrap();
    past_the_grace();
    // Made after the wait: young.
    let young = unique("gc-young");
    let _y = Unlink(young.clone());
    empty(&young);
    assert_eq!(cuda_ipc::registry::remove_abandoned(&young).unwrap(), None);
    assert!(exists(&young));
    assert_eq!(
        cuda_ipc::registry::remove_abandoned(&finished).unwrap(),
        None
    );
    assert!(exists(&finished));
    drop(reg);
    for (n, what) in [
        (&empty_old, "empty"),
        (&sparse_old, "sparse"),
        (&data_old, "sparse"),
        (&zeros_old, "zero where the magic goes"),
    ] {
        for r in [
            inspect::abandoned(n),
            cuda_ipc::registry::remove_abandoned(n),
        ] {
            let err = registry_err(r.unwrap_err());
            assert!(
                matches!(&err, RegistryError::NoMagic { what: w, .. } if *w == what),
                "{n}: {err}"
            );
            assert!(
                err.to_string().ends_with(&format!(
                    "not a cuda-ipc registry: no magic ({what}); left as it is (remove it if no \
                     program uses it)"
                )),
                "{err}"
            );
        }
        assert!(exists(n), "{n}");
        // `ls` (inspect) says what it is, not "not initialised".
        let err = registry_err(inspect::inspect(n).unwrap_err());
        assert!(matches!(err, RegistryError::NoMagic { .. }), "{n}: {err}");
    }
    // What records a dead creator goes, at any age.
    unstamped(&dead, dead_identity());
    let why = cuda_ipc::registry::remove_abandoned(&dead)
        .unwrap()
        .expect("removed");
    assert!(why.contains("abandoned by its dead creator"), "{why}");
    assert!(!exists(&dead));
    // Nothing under the name: nothing to do.
    assert_eq!(cuda_ipc::registry::remove_abandoned(&dead).unwrap(), None);
}

#[test]
fn another_users_old_empty_registry_leftover_is_never_replaced_or_removed() {
    if !rustix::process::geteuid().is_root() {
        println!("skipped: needs root to give a file to another user");
        return;
    }
    let name = unique("left-theirs");
    let _u = Unlink(name.clone());
    empty(&name);
    let path = format!("/dev/shm/{name}");
    std::os::unix::fs::chown(&path, Some(4242), Some(4242)).unwrap();
    past_the_grace();
    let err = shm_err(Registry::open_or_create(&name, &opts()).unwrap_err());
    assert!(
        matches!(err, ShmError::WrongOwner { owner: 4242, .. }),
        "{err}"
    );
    for r in [
        inspect::abandoned(&name),
        cuda_ipc::registry::remove_abandoned(&name),
    ] {
        let err = shm_err(r.unwrap_err());
        assert!(
            matches!(err, ShmError::WrongOwner { owner: 4242, .. }),
            "{err}"
        );
    }
    assert!(exists(&name));
}
