//! File-descriptor passing to a root importer from an exporter of another user (needs root:
//! skipped otherwise), where the test counts the fds this process has open: a binary of its own,
//! so that no test of another binary opens fds beside it, and its two tests one at a time
//! ([`COUNTING`]). The support is `fdpass_support`, shared with `ipc_fdpass`.

mod common;
mod fdpass_support;

use common::role;
use cuda_ipc::Error;
use cuda_ipc::identity::ProcessIdentity;
use cuda_ipc::ipc::fdpass::{self, FdPassError, FdTransport};
use fdpass_support::*;
use std::sync::{Mutex, MutexGuard};

/// Held by each test for its whole run: they count this process's open fds.
static COUNTING: Mutex<()> = Mutex::new(());

/// What [`exporter_of_65534`] gives a test: the turn it holds, the exporter and its ids.
type Started = (MutexGuard<'static, ()>, Exporter, Vec<(u32, i32)>);

/// For test `name`, run as root: [`COUNTING`] taken, an exporter child of uid 65534 with one
/// export, and its ids; `None` (the test is not run) without root.
fn exporter_of_65534(name: &str) -> Option<Started> {
    let one_at_a_time = COUNTING.lock().unwrap_or_else(|p| p.into_inner());
    if !is_root() {
        eprintln!("not run: needs root to start an exporter of another user");
        return None;
    }
    let ex = Exporter::spawn(name, 1, &[(SETUID, "65534")]);
    let ids = parse_ids(&ex.ids(&[0]));
    Some((one_at_a_time, ex, ids))
}

/// A dead exporter's identity whose pid a live listener of another user holds (pid reuse,
/// made here with a hard link to a live exporter's socket file under the name of an identity
/// with the same pid and an earlier start time): a root importer takes the listener for the
/// exporter only while the exporter lives, so it gets `PeerGone` and no fd; the live exporter
/// itself is served.
#[test]
fn a_root_importer_takes_another_users_listener_only_for_a_live_exporter() {
    const NAME: &str = "a_root_importer_takes_another_users_listener_only_for_a_live_exporter";
    if let Some(r) = role() {
        return child_main(&r);
    }
    let Some((_one_at_a_time, ex, ids)) = exporter_of_65534(NAME) else {
        return;
    };
    let live = fdpass::fetch_many(&ex.identity, &ids, FdTransport::Socket, ANSWER).unwrap();
    assert_eq!(
        live.iter().map(read_content).collect::<Vec<_>>(),
        contents([0])
    );
    let mut w = ex.identity.to_words();
    w[1] = w[1].wrapping_sub(1);
    let ghost = ProcessIdentity::from_words(w);
    assert_eq!(ghost.liveness(), cuda_ipc::identity::Liveness::Dead);
    let (real, fake) = (
        fdpass::socket_path(&ex.identity),
        fdpass::socket_path(&ghost),
    );
    let _ = std::fs::remove_file(&fake);
    std::fs::hard_link(&real, &fake).unwrap();
    let before = open_fds();
    let r = fdpass::fetch_many(&ghost, &ids, FdTransport::Socket, ANSWER);
    std::fs::remove_file(&fake).unwrap();
    assert!(
        matches!(r, Err(Error::FdPass(FdPassError::PeerGone { .. }))),
        "a dead exporter's fetch was answered by another user's listener: {:?}",
        r.map(|v| v.len())
    );
    assert_eq!(open_fds(), before, "fds left open");
    ex.finish();
}

/// An exporter in another pid namespace, seen by a root importer that knows the exporter's uid
/// (`fetch_many_from_uid`, as a tensor-set reader does): its socket (the live exporter's, of uid
/// 65534, linked here under the name of an identity of another pid namespace) is taken from that
/// uid only, and a liveness lock counts only when that uid (or root) owns it. Expecting root's
/// exporter (a lock of root's says it lives), the importer refuses the socket before connecting;
/// expecting 65534, it is served while a lock of 65534 says the exporter lives, and told
/// `PeerGone` when the lock is a third user's. No fd is left open either way.
#[test]
fn a_root_importer_that_knows_the_exporters_uid_takes_only_that_uids_socket_across_namespaces() {
    const NAME: &str = "a_root_importer_that_knows_the_exporters_uid_takes_only_that_uids_socket_across_namespaces";
    if let Some(r) = role() {
        return child_main(&r);
    }
    let Some((_one_at_a_time, ex, ids)) = exporter_of_65534(NAME) else {
        return;
    };
    // The same pid and start time in a pid namespace that is not this one.
    let mut w = ex.identity.to_words();
    w[0] ^= 0x7 << 32;
    let elsewhere = ProcessIdentity::from_words(w);
    assert!(!elsewhere.in_own_pid_namespace());
    let (real, linked) = (
        fdpass::socket_path(&ex.identity),
        fdpass::socket_path(&elsewhere),
    );
    let _ = std::fs::remove_file(&linked);
    std::fs::hard_link(&real, &linked).unwrap();
    let _ = std::fs::remove_file(elsewhere.liveness_path());
    let before = open_fds();

    // Root's exporter expected, and root's lock says it lives: the socket file is 65534's,
    // refused before connecting.
    let lock = FakeAlive::owned_by(&elsewhere, 0);
    let r = fdpass::fetch_many_from_uid(&elsewhere, 0, &ids, FdTransport::Socket, ANSWER);
    assert!(
        matches!(&r, Err(Error::FdPass(FdPassError::NotTheExporter { reason, .. })) if reason.contains("uid 65534")),
        "{:?}",
        r.map(|v| v.len())
    );
    drop(lock);
    assert_eq!(open_fds(), before, "fds left open");

    // 65534 expected, and a lock of 65534's says the exporter lives: served.
    let lock = FakeAlive::owned_by(&elsewhere, 65534);
    let fds =
        fdpass::fetch_many_from_uid(&elsewhere, 65534, &ids, FdTransport::Socket, ANSWER).unwrap();
    assert_eq!(
        fds.iter().map(read_content).collect::<Vec<_>>(),
        contents([0])
    );
    drop(fds);
    drop(lock);

    // The only lock is a third user's: it does not say the exporter lives.
    let lock = FakeAlive::owned_by(&elsewhere, 65533);
    let r = fdpass::fetch_many_from_uid(&elsewhere, 65534, &ids, FdTransport::Socket, ANSWER);
    assert!(
        matches!(r, Err(Error::FdPass(FdPassError::PeerGone { .. }))),
        "a lock of another user's said the exporter lives: {:?}",
        r.map(|v| v.len())
    );
    drop(lock);
    std::fs::remove_file(&linked).unwrap();
    assert_eq!(open_fds(), before, "fds left open");
    ex.finish();
}
