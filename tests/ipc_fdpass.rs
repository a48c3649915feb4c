//! File-descriptor passing between processes (`cuda_ipc::ipc::fdpass`), without a GPU: memfds with
//! known content stand in for VMM exports. The exporter and (where fd counts matter) the importer
//! are this test binary re-executed as children, driven line by line over stdin/stdout
//! (`fdpass_support`). Other users, other namespaces and things planted at the socket path:
//! `ipc_fdpass_peers`.

mod common;
mod fdpass_support;

use common::{Peer, role};
use cuda_ipc::Error;
use cuda_ipc::ipc::fdpass::{self, FdPassError, FdTransport};
use fdpass_support::*;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

#[test]
fn a_child_fetches_exported_fds_by_id_and_nothing_leaks() {
    const NAME: &str = "a_child_fetches_exported_fds_by_id_and_nothing_leaks";
    if let Some(r) = role() {
        return child_main(&r);
    }
    let mut ex = Exporter::spawn(NAME, 3, &[]);
    let ex_fds = ex.fds();
    let mut im = Importer::spawn(NAME, &ex.identity, &[]);
    let before = im.fds();
    for i in 0..3 {
        let got = im.fetch("socket", 5000, &ex.ids(&[i]));
        assert_eq!(got.contents(), contents([i]));
    }
    // Several in one round trip, in the order asked for, with repeats.
    let got = im.fetch("socket", 5000, &ex.ids(&[2, 0, 1, 0]));
    assert_eq!(got.contents(), contents([2, 0, 1, 0]));
    let got = im.fetch("pidfd-then-socket", 5000, &ex.ids(&[1, 2]));
    assert_eq!(got.contents(), contents([1, 2]));
    assert_eq!(im.fds(), before, "the importer leaked fds");
    assert_eq!(ex.fds(), ex_fds, "the exporter leaked fds");
    im.finish();
    ex.finish();
}

#[test]
fn fetch_many_passes_more_fds_than_one_message_holds() {
    const NAME: &str = "fetch_many_passes_more_fds_than_one_message_holds";
    if let Some(r) = role() {
        return child_main(&r);
    }
    // 253 fds per SCM_RIGHTS message: 600 take three replies.
    let n = 600;
    let mut ex = Exporter::spawn(NAME, n, &[]);
    let mut im = Importer::spawn(NAME, &ex.identity, &[]);
    let before = im.fds();
    let all: Vec<usize> = (0..n).collect();
    let got = im.fetch("socket", 10_000, &ex.ids(&all));
    assert_eq!(got.contents(), contents(0..n));
    // One id not offered among many: refused, and none of the others stay open.
    ex.withdraw(400);
    let f = im.fetch("socket", 10_000, &ex.ids(&all));
    let (kind, text, _) = f.error();
    assert_eq!(kind, "notoffered", "{text}");
    assert!(
        text.contains(&format!("export {}", ex.exports[400].0)),
        "{text}"
    );
    assert_eq!(im.fds(), before, "the importer leaked fds");
    im.finish();
    ex.finish();
}

#[test]
fn a_withdrawn_id_is_refused_and_nothing_leaks() {
    const NAME: &str = "a_withdrawn_id_is_refused_and_nothing_leaks";
    if let Some(r) = role() {
        return child_main(&r);
    }
    let mut ex = Exporter::spawn(NAME, 3, &[]);
    let mut im = Importer::spawn(NAME, &ex.identity, &[]);
    let before = im.fds();
    assert_eq!(
        im.fetch("socket", 5000, &ex.ids(&[1])).contents(),
        contents([1])
    );

    let ex_fds = ex.fds();
    ex.withdraw(1);
    assert_eq!(
        ex.fds(),
        ex_fds - 1,
        "withdrawing did not close the exporter's copy"
    );

    let id = ex.exports[1].0;
    let f = im.fetch("socket", 5000, &ex.ids(&[1]));
    let (kind, text, _) = f.error();
    assert_eq!(kind, "notoffered", "{text}");
    assert!(text.contains(&format!("export {id}")), "{text}");
    let f = im.fetch("socket", 5000, &ex.ids(&[0, 1, 2]));
    assert_eq!(f.error().0, "notoffered");
    // pidfd_getfd goes by fd number, which the exporter may have reused by now (the documented
    // caveat): it finds the number closed, is not available, or returns another file, but never
    // the withdrawn one (that file is closed).
    for transport in ["pidfd-then-socket", "pidfd-only"] {
        match im.fetch(transport, 5000, &ex.ids(&[1])) {
            Fetched::Ok { contents } => assert_ne!(contents, self::contents([1])),
            f => assert!(matches!(f.error().0, "notoffered" | "unsupported"), "{f:?}"),
        }
    }
    let f = im.fetch("socket", 5000, "999999:3");
    assert_eq!(f.error().0, "notoffered");
    // The others are still served.
    assert_eq!(
        im.fetch("socket", 5000, &ex.ids(&[2, 0])).contents(),
        contents([2, 0])
    );
    assert_eq!(im.fds(), before, "the importer leaked fds");
    im.finish();
    ex.finish();
}

#[test]
fn a_dead_exporter_gives_peer_gone_promptly() {
    const NAME: &str = "a_dead_exporter_gives_peer_gone_promptly";
    if let Some(r) = role() {
        return child_main(&r);
    }
    let mut ex = Exporter::spawn(NAME, 2, &[]);
    let mut im = Importer::spawn(NAME, &ex.identity, &[]);
    let before = im.fds();
    assert_eq!(
        im.fetch("socket", 5000, &ex.ids(&[0])).contents(),
        contents([0])
    );

    // SIGKILL, not reaped yet: a zombie still listed in /proc with its start time.
    ex.peer.child.kill().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let ids = ex.ids(&[0, 1]);
    for transport in ["socket", "pidfd-then-socket", "pidfd-only"] {
        let f = im.fetch(transport, 20_000, &ids);
        let (kind, text, ms) = f.error();
        assert_eq!(kind, "gone", "zombie, {transport}: {text}");
        assert!(ms < 2000, "zombie, {transport}: took {ms} ms");
    }
    // Reaped: the pid is gone (or reused with another start time).
    ex.peer.child.wait().unwrap();
    for transport in ["socket", "pidfd-then-socket", "pidfd-only"] {
        let f = im.fetch(transport, 20_000, &ids);
        let (kind, text, ms) = f.error();
        assert_eq!(kind, "gone", "reaped, {transport}: {text}");
        assert!(ms < 2000, "reaped, {transport}: took {ms} ms");
    }
    assert_eq!(im.fds(), before, "the importer leaked fds");
    im.finish();
    // Killed, it left its socket file: stale, and removable.
    let who = ex.identity;
    let stale = fdpass::stale_socket_files().unwrap();
    let entry = stale
        .iter()
        .find(|f| f.identity == who)
        .unwrap_or_else(|| panic!("{who} not listed as stale: {stale:?}"));
    assert!(fdpass::remove_stale_socket_file(entry).unwrap());
    assert!(!socket_exists(&who));
    // Its liveness file too (younger than gc's 5 s guard: removed by the age-free test helper).
    assert!(cuda_ipc::raw::identity::remove_liveness_file_if_free(&who).unwrap());
}

/// An exporter killed while a forked child of its keeps its listening socket open (never
/// accepting): the connection and the request go through, the reply never comes, and the fetch
/// says the exporter is gone within the reply's liveness look (100 ms), not at its timeout.
#[test]
fn a_listener_that_outlives_its_exporter_gives_peer_gone_promptly() {
    const NAME: &str = "a_listener_that_outlives_its_exporter_gives_peer_gone_promptly";
    if let Some(r) = role() {
        return child_main(&r);
    }
    let mut ex = Exporter::spawn(NAME, 1, &[(FORK_KEEPER, "1")]);
    let keeper: i32 = ex.peer.expect("keeper", ANSWER).trim().parse().unwrap();
    /// Kills the keeper however the test ends.
    struct Keeper(i32);
    impl Drop for Keeper {
        fn drop(&mut self) {
            // SAFETY: the exporter's child, which only sleeps.
            unsafe { libc::kill(self.0, libc::SIGKILL) };
        }
    }
    let keeper = Keeper(keeper);
    let mut im = Importer::spawn(NAME, &ex.identity, &[]);
    let ids = ex.ids(&[0]);
    assert_eq!(im.fetch("socket", 5000, &ids).contents(), contents([0]));
    ex.peer.child.kill().unwrap();
    ex.peer.child.wait().unwrap();
    let f = im.fetch("socket", 20_000, &ids);
    drop(keeper);
    let (kind, text, ms) = f.error();
    assert_eq!(kind, "gone", "{text}");
    assert!(ms < 2000, "took {ms} ms");
    im.finish();
}

#[test]
fn a_process_that_exported_nothing_serves_no_fds() {
    const NAME: &str = "a_process_that_exported_nothing_serves_no_fds";
    if let Some(r) = role() {
        return child_main(&r);
    }
    let ex = Exporter::spawn(NAME, 0, &[]);
    let t = Instant::now();
    let e = fdpass::fetch(
        &ex.identity,
        1,
        3,
        FdTransport::Socket,
        Duration::from_secs(20),
    )
    .unwrap_err();
    assert!(
        matches!(e, Error::FdPass(FdPassError::NotOffered { id: 1, .. })),
        "unexpected error: {e}"
    );
    assert!(e.to_string().contains("serves no fds"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(2));
    ex.finish();
}

#[test]
fn pidfd_getfd_fetches_an_fd_when_the_kernel_allows_it() {
    const NAME: &str = "pidfd_getfd_fetches_an_fd_when_the_kernel_allows_it";
    if let Some(r) = role() {
        return child_main(&r);
    }
    // This process is the exporter's parent, so even yama ptrace_scope 1 allows it.
    let ex = Exporter::spawn(NAME, 2, &[]);
    let (id, raw) = ex.exports[1];
    let t = Duration::from_secs(10);
    match fdpass::pidfd_getfd_available(ex.identity.pid) {
        Ok(()) => {
            let fd = fdpass::fetch(&ex.identity, id, raw, FdTransport::PidfdOnly, t).unwrap();
            assert_eq!(read_content(&fd), expected_content(1));
        }
        Err(reason) => {
            eprintln!("pidfd_getfd is not available here: {reason}");
            let e = fdpass::fetch(&ex.identity, id, raw, FdTransport::PidfdOnly, t).unwrap_err();
            assert!(matches!(e, Error::Unsupported { .. }), "{e}");
            assert!(e.to_string().contains(&reason), "{e} does not say {reason}");
        }
    }
    let fd = fdpass::fetch(&ex.identity, id, raw, FdTransport::PidfdThenSocket, t).unwrap();
    assert_eq!(read_content(&fd), expected_content(1));
    ex.finish();
}

#[test]
fn refused_pidfd_getfd_falls_back_to_the_socket_or_fails_with_the_reason() {
    const NAME: &str = "refused_pidfd_getfd_falls_back_to_the_socket_or_fails_with_the_reason";
    if let Some(r) = role() {
        return child_main(&r);
    }
    // A non-dumpable exporter may be attached (so pidfd_getfd'd) only with CAP_SYS_PTRACE, which
    // the importer drops: the kernel answers EPERM.
    let ex = Exporter::spawn(NAME, 2, &[(NONDUMPABLE, "1")]);
    let mut im = Importer::spawn(NAME, &ex.identity, &[(DROP_PTRACE, "1")]);
    let before = im.fds();
    let reason = im.avail().expect_err("pidfd_getfd should be refused");
    eprintln!("refused as expected: {reason}");
    assert!(
        reason.contains("EPERM") || reason.contains("no pidfd"),
        "{reason}"
    );
    let ids = ex.ids(&[1, 0]);
    assert_eq!(
        im.fetch("pidfd-then-socket", 5000, &ids).contents(),
        contents([1, 0])
    );
    let f = im.fetch("pidfd-only", 5000, &ids);
    let (kind, text, _) = f.error();
    assert_eq!(kind, "unsupported", "{text}");
    assert!(text.contains("FdTransport::Socket"), "no fix in {text}");
    assert!(text.contains(&reason), "{text} does not say {reason}");
    assert_eq!(im.fds(), before, "the importer leaked fds");
    im.finish();
    ex.finish();

    // Without privileges, a process of another user (pid 1 is root's) is refused too.
    if !is_root() {
        let init_uid = std::fs::read_to_string("/proc/1/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Uid:"))
                    .and_then(|l| l.split_whitespace().next()?.parse::<u32>().ok())
            });
        if init_uid.is_some_and(|u| u != rustix::process::geteuid().as_raw()) {
            assert!(fdpass::pidfd_getfd_available(1).is_err());
        }
    }
}

#[test]
fn bad_clients_do_not_break_the_server() {
    const NAME: &str = "bad_clients_do_not_break_the_server";
    if let Some(r) = role() {
        return child_main(&r);
    }
    let mut ex = Exporter::spawn(NAME, 2, &[]);
    let ex_fds = ex.fds();
    let who = ex.identity;
    let (id0, _) = ex.exports[0];

    // Connects and leaves at once.
    drop(raw_client(&who));
    // Garbage, a count that does not match the length, another protocol version: error statuses.
    assert_eq!(raw_exchange(&raw_client(&who), b"hello, server"), Some(2));
    assert_eq!(
        raw_exchange(&raw_client(&who), &raw_request(1, 100, &[id0])),
        Some(2)
    );
    assert_eq!(
        raw_exchange(&raw_client(&who), &raw_request(1, 0, &[])),
        Some(2)
    );
    assert_eq!(
        raw_exchange(&raw_client(&who), &raw_request(77, 1, &[id0])),
        Some(3)
    );
    // A valid request with an fd attached (the server must close it), then gone before the reply.
    {
        let sock = raw_client(&who);
        let extra = memfd("unwanted");
        let fds = [extra.as_fd()];
        let mut space =
            vec![std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = rustix::net::SendAncillaryBuffer::new(&mut space);
        assert!(control.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)));
        let req = raw_request(1, 1, &[id0]);
        rustix::net::sendmsg(
            &sock,
            &[std::io::IoSlice::new(&req)],
            &mut control,
            rustix::net::SendFlags::NOSIGNAL,
        )
        .unwrap();
    }
    // A stalled client that never sends: the next client waits at most the server's 1 s timeout.
    let stalled = raw_client(&who);
    let t = Instant::now();
    let fd = fdpass::fetch(&who, id0, -1, FdTransport::Socket, Duration::from_secs(10)).unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(read_content(&fd), expected_content(0));
    drop(fd);
    drop(stalled);
    // Many requests in a row still work, and the exporter is back to its fds.
    for _ in 0..20 {
        let fds = fdpass::fetch_many(
            &who,
            &ex.exports,
            FdTransport::Socket,
            Duration::from_secs(10),
        )
        .unwrap();
        assert_eq!(fds.len(), 2);
    }
    assert_eq!(ex.fds(), ex_fds, "the exporter leaked fds");
    ex.finish();
}

#[test]
fn a_short_timeout_is_honoured() {
    const NAME: &str = "a_short_timeout_is_honoured";
    if let Some(r) = role() {
        return child_main(&r);
    }
    let ex = Exporter::spawn(NAME, 1, &[]);
    let (id, raw) = ex.exports[0];
    // A stalled client holds the single-threaded server for up to 1 s; a 200 ms fetch times out.
    let stalled = raw_client(&ex.identity);
    std::thread::sleep(Duration::from_millis(50));
    let t = Instant::now();
    let e = fdpass::fetch(
        &ex.identity,
        id,
        raw,
        FdTransport::Socket,
        Duration::from_millis(200),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e}");
    assert!(
        t.elapsed() < Duration::from_millis(900),
        "{:?}",
        t.elapsed()
    );
    drop(stalled);
    ex.finish();
}

// ---------------------------------------------------------------------------------------------
// Namespaces and the socket file

#[test]
fn an_exporter_that_execs_itself_serves_again_under_the_same_name() {
    const NAME: &str = "an_exporter_that_execs_itself_serves_again_under_the_same_name";
    if let Some(r) = role() {
        return child_main(&r);
    }
    let mut peer = Peer::spawn(NAME, "exec-exporter", &[(EXPORTS, "1")]);
    let start_before: u64 = peer.expect("before", ANSWER).parse().unwrap();
    // The new image finds its own socket file from before the exec (nobody listens on it any
    // more), replaces it and serves.
    let ex = Exporter::from_peer(peer, 1);
    assert_eq!(ex.identity.start_time, start_before, "same process");
    let fd = fdpass::fetch(
        &ex.identity,
        ex.exports[0].0,
        -1,
        FdTransport::Socket,
        Duration::from_secs(10),
    )
    .unwrap();
    assert_eq!(read_content(&fd), expected_content(0));
    let id = ex.identity;
    ex.finish();
    assert!(!socket_exists(&id), "a normal exit left the socket file");
}
