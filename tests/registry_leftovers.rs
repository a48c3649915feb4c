//! What a registry creator killed before it finished leaves under the name (an empty file, a sparse
//! one, one whose header was never begun) never blocks the name for good: after the channels'
//! grace (`ABANDONED_AFTER`, 2 s) `open_or_create` replaces it and the library's `gc` rule
//! (`registry::inspect::remove_abandoned`) removes it; a young one and another user's are kept.

mod common;

use common::{Unlink, unique};
use cuda_ipc::Error;
use cuda_ipc::raw::registry_layout as layout;
use cuda_ipc::raw::shm::{Segment, SegmentOptions, ShmError};
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
fn an_empty_or_sparse_registry_leftover_is_replaced_after_the_grace_and_kept_while_young() {
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
        assert!(inspect::abandoned(n).unwrap().is_some(), "{n}");
        let t = Instant::now();
        let reg = Registry::open_or_create(n, &opts()).unwrap();
        reg.publish("after-restart", 1, b"", b"").unwrap();
        // Replaced at once (the opener's bounded wait aside), not after a long wait.
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{n}: {:?}",
            t.elapsed()
        );
        assert_eq!(
            inspect::abandoned(n).unwrap(),
            None,
            "{n}: a finished registry"
        );
    }
}

#[test]
fn gcs_rule_removes_an_old_empty_registry_leftover_and_nothing_else() {
    let (old, finished) = (unique("gc-empty"), unique("gc-finished"));
    let _u = (Unlink(old.clone()), Unlink(finished.clone()));
    empty(&old);
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
    let why = cuda_ipc::registry::remove_abandoned(&old)
        .unwrap()
        .expect("removed");
    assert!(why.contains("abandoned"), "{why}");
    assert!(!exists(&old));
    // Nothing under the name: nothing to do.
    assert_eq!(cuda_ipc::registry::remove_abandoned(&old).unwrap(), None);
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
