//! File-descriptor passing (`cuda_ipc::ipc::fdpass`) with other users, across pid and network
//! namespaces, and with things planted at an exporter's socket path, without a GPU; the support
//! (exporter and importer children) is `fdpass_support`, shared with `ipc_fdpass`.

mod common;
mod fdpass_support;

use common::role;
use cuda_ipc::Error;
use cuda_ipc::identity::ProcessIdentity;
use cuda_ipc::ipc::fdpass::{self, FdPassError, FdTransport};
use fdpass_support::*;
use std::time::{Duration, Instant};

#[test]
fn another_user_is_refused_by_the_socket() {
    const NAME: &str = "another_user_is_refused_by_the_socket";
    if let Some(r) = role() {
        return child_main(&r);
    }
    if !is_root() {
        // Switching users needs root; the uid rule itself is unit-tested in
        // src/ipc/fdpass/server.rs.
        eprintln!("not run: needs root to start an importer of another user");
        return;
    }
    let mut ex = Exporter::spawn(NAME, 1, &[]);
    let ex_fds = ex.fds();
    let mut im = Importer::spawn(NAME, &ex.identity, &[(SETUID, "65534")]);
    let before = im.fds();
    for transport in ["socket", "pidfd-then-socket"] {
        let f = im.fetch(transport, 5000, &ex.ids(&[0]));
        let (kind, text, _) = f.error();
        assert_eq!(kind, "refused", "{transport}: {text}");
        assert!(text.contains("own user"), "{text}");
    }
    assert_eq!(im.fds(), before, "the importer leaked fds");
    assert_eq!(ex.fds(), ex_fds, "the exporter leaked fds");
    im.finish();
    ex.finish();
}

/// A dead exporter whose socket path now holds something else (a file anyone may create in the
/// sticky, world-writable `/dev/shm` once the exporter removed its socket) is `PeerGone`, not
/// the refusal of that file: a tensor-set reader falls back to its holders on `PeerGone` only.
#[test]
fn a_dead_exporter_with_a_file_at_its_socket_path_is_peer_gone() {
    if role().is_some() {
        return;
    }
    let me = ProcessIdentity::current().unwrap();
    let mut w = me.to_words();
    w[1] = w[1].wrapping_sub(2);
    let ghost = ProcessIdentity::from_words(w);
    assert_eq!(ghost.liveness(), cuda_ipc::identity::Liveness::Dead);
    let fake = fdpass::socket_path(&ghost);
    std::fs::write(&fake, b"squat").unwrap();
    let r = fdpass::fetch_many(&ghost, &[(1, 3)], FdTransport::Socket, ANSWER);
    std::fs::remove_file(&fake).unwrap();
    assert!(
        matches!(r, Err(Error::FdPass(FdPassError::PeerGone { .. }))),
        "{:?}",
        r.map(|v| v.len())
    );
}

#[test]
fn things_planted_at_the_socket_path_give_a_clear_error_not_a_hang() {
    const NAME: &str = "things_planted_at_the_socket_path_give_a_clear_error_not_a_hang";
    if let Some(r) = role() {
        return child_main(&r);
    }
    // A live process that serves nothing yet (so its socket path is free), and one that serves.
    let mut idle = Exporter::spawn(NAME, 0, &[]);
    let serving = Exporter::spawn(NAME, 1, &[]);
    let path = fdpass::socket_path(&idle.identity);
    let plants: [(&str, &Plant<'_>); 4] = [
        ("a FIFO", &|p| mkfifo(p)),
        ("a regular file", &|p| {
            std::fs::write(p, b"not a socket").unwrap()
        }),
        ("a directory", &|p| std::fs::create_dir(p).unwrap()),
        // A link to a live server's socket: connect() would follow it, lstat does not.
        ("a symbolic link", &|p| {
            std::os::unix::fs::symlink(fdpass::socket_path(&serving.identity), p).unwrap()
        }),
    ];
    for (what, plant) in plants {
        plant(&path);
        let _planted = Planted(path.clone());
        let at = Instant::now();
        let e = fdpass::fetch(
            &idle.identity,
            1,
            3,
            FdTransport::Socket,
            Duration::from_secs(20),
        )
        .unwrap_err();
        println!("{what} at the socket path: {e}");
        assert!(
            matches!(e, Error::FdPass(FdPassError::NotTheExporter { .. })),
            "{what}: {e}"
        );
        let text = e.to_string();
        assert!(
            text.contains(what) && text.contains("not a socket"),
            "{text}"
        );
        assert!(text.contains(&path), "{text}");
        assert!(
            at.elapsed() < Duration::from_secs(2),
            "{what}: {:?}",
            at.elapsed()
        );
        // The exporter does not remove what it did not make: its export fails, naming it.
        idle.peer.send("export");
        let answer = idle.peer.expect("exported", ANSWER);
        assert!(answer.starts_with("err "), "{what}: {answer}");
        assert!(answer.contains(what), "{answer}");
        assert!(
            std::fs::symlink_metadata(&path).is_ok(),
            "{what} was removed by the exporter"
        );
    }
    // With the path free again, the same process serves.
    idle.peer.send("export");
    let answer = idle.peer.expect("exported", ANSWER);
    let (id, _) = parse_ids(&answer)[0];
    let fd = fdpass::fetch(
        &idle.identity,
        id,
        -1,
        FdTransport::Socket,
        Duration::from_secs(10),
    )
    .unwrap();
    assert_eq!(read_content(&fd), "late");
    idle.finish();
    serving.finish();
}

#[test]
fn across_pid_namespaces_a_socket_of_another_user_is_refused() {
    let me = ProcessIdentity::current().unwrap();
    // A process of another pid namespace that is alive (its liveness lock is held here).
    let other = ProcessIdentity {
        pid: 4242,
        start_time: me.start_time.wrapping_add(999_331),
        boot_id: me.boot_id,
        pid_ns: me.pid_ns.wrapping_add(101),
    };
    let _alive = FakeAlive::new(&other);
    let path = fdpass::socket_path(&other);
    let _ = std::fs::remove_file(&path);
    // A listener of the fd server's kind (SOCK_SEQPACKET), as a squatter would make.
    let listener = rustix::net::socket(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        None,
    )
    .unwrap();
    rustix::net::bind(
        &listener,
        &rustix::net::SocketAddrUnix::new(path.as_str()).unwrap(),
    )
    .unwrap();
    rustix::net::listen(&listener, 4).unwrap();
    let _planted = Planted(path.clone());
    let squatter_uid = 65534;
    let c = std::ffi::CString::new(path.as_str()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path; lchown does not follow links.
    let r = unsafe { libc::lchown(c.as_ptr(), squatter_uid, squatter_uid) };
    if r != 0 {
        eprintln!(
            "not run: lchown needs root ({})",
            std::io::Error::last_os_error()
        );
        return;
    }
    let at = Instant::now();
    let e = fdpass::fetch(&other, 1, -1, FdTransport::Socket, Duration::from_secs(20)).unwrap_err();
    println!("a socket of uid {squatter_uid} for an exporter in another pid namespace: {e}");
    assert!(
        matches!(e, Error::FdPass(FdPassError::NotTheExporter { .. })),
        "{e}"
    );
    assert!(e.to_string().contains("owned by uid 65534"), "{e}");
    assert!(at.elapsed() < Duration::from_secs(2));
    if rustix::process::geteuid().is_root() {
        // Root accepts any one uid's socket, so it connected, and refused because the listener
        // (this test, uid 0) is not the file's owner: a squatter.
        assert!(e.to_string().contains("listened on by uid 0"), "{e}");
    } else {
        // Refused before connecting: nobody knocked.
        rustix::io::ioctl_fionbio(&listener, true).unwrap();
        assert!(rustix::net::accept(&listener).is_err());
    }
}

#[test]
fn an_exporter_in_another_pid_namespace_serves_the_parent() {
    const NAME: &str = "an_exporter_in_another_pid_namespace_serves_the_parent";
    if let Some(r) = role() {
        return child_main(&r);
    }
    if !namespaces_work(PID_NS, NAME) {
        return;
    }
    let mut ex = Exporter::spawn_under(PID_NS, NAME, 3, &[]);
    // Pid 1 of its own namespace: its pid means another process here.
    assert_eq!(ex.identity.pid, 1);
    assert_ne!(ex.identity.pid_ns, cuda_ipc::identity::own_pid_ns());
    assert!(!ex.identity.in_own_pid_namespace());
    assert!(ex.identity.is_alive());
    assert!(socket_exists(&ex.identity));
    let ex_fds = ex.fds();
    let t = Duration::from_secs(10);
    let fds = fdpass::fetch_many(&ex.identity, &ex.exports, FdTransport::Socket, t).unwrap();
    let got: Vec<String> = fds.iter().map(read_content).collect();
    assert_eq!(got, contents(0..3));
    drop(fds);
    // pidfd_getfd cannot name a process of another pid namespace: the socket is used instead,
    // or, when only pidfd_getfd is allowed, the reason is given.
    let (id, raw) = ex.exports[1];
    let fd = fdpass::fetch(&ex.identity, id, raw, FdTransport::PidfdThenSocket, t).unwrap();
    assert_eq!(read_content(&fd), expected_content(1));
    drop(fd);
    let e = fdpass::fetch(&ex.identity, id, raw, FdTransport::PidfdOnly, t).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    assert!(e.to_string().contains("pid namespace"), "{e}");
    // Withdrawn ids are refused across namespaces as well.
    ex.withdraw(0);
    let e = fdpass::fetch(&ex.identity, ex.exports[0].0, -1, FdTransport::Socket, t).unwrap_err();
    assert!(
        matches!(e, Error::FdPass(FdPassError::NotOffered { .. })),
        "{e}"
    );
    assert_eq!(ex.fds(), ex_fds - 1, "the exporter leaked fds");
    let id = ex.identity;
    ex.finish();
    assert!(!socket_exists(&id), "a normal exit left the socket file");
}

#[test]
fn an_importer_in_another_pid_namespace_fetches_from_this_one() {
    const NAME: &str = "an_importer_in_another_pid_namespace_fetches_from_this_one";
    if let Some(r) = role() {
        return child_main(&r);
    }
    if !namespaces_work(PID_NS, NAME) {
        return;
    }
    let mut ex = Exporter::spawn(NAME, 3, &[]);
    // In the importer's namespace the exporter is not visible: its SO_PEERCRED pid reads 0.
    let mut im = Importer::spawn_under(PID_NS, NAME, &ex.identity, &[]);
    let before = im.fds();
    assert_eq!(
        im.fetch("socket", 5000, &ex.ids(&[2, 0, 1])).contents(),
        contents([2, 0, 1])
    );
    assert_eq!(
        im.fetch("pidfd-then-socket", 5000, &ex.ids(&[1]))
            .contents(),
        contents([1])
    );
    let f = im.fetch("pidfd-only", 5000, &ex.ids(&[1]));
    let (kind, text, _) = f.error();
    assert_eq!(kind, "unsupported", "{text}");
    assert!(text.contains("pid namespace"), "{text}");
    ex.withdraw(2);
    assert_eq!(
        im.fetch("socket", 5000, &ex.ids(&[2])).error().0,
        "notoffered"
    );
    assert_eq!(im.fds(), before, "the importer leaked fds");
    im.finish();
    ex.finish();
}

#[test]
fn an_importer_in_another_network_namespace_still_fetches() {
    const NAME: &str = "an_importer_in_another_network_namespace_still_fetches";
    if let Some(r) = role() {
        return child_main(&r);
    }
    if !namespaces_work(NET_NS, NAME) {
        return;
    }
    let ex = Exporter::spawn(NAME, 2, &[]);
    let mut im = Importer::spawn_under(NET_NS, NAME, &ex.identity, &[]);
    let before = im.fds();
    for transport in ["socket", "pidfd-then-socket"] {
        assert_eq!(
            im.fetch(transport, 5000, &ex.ids(&[1, 0])).contents(),
            contents([1, 0]),
            "{transport}"
        );
    }
    assert_eq!(im.fds(), before, "the importer leaked fds");
    im.finish();
    // And the other way round: an exporter in its own network namespace serves this one.
    ex.finish();
    let ex = Exporter::spawn_under(NET_NS, NAME, 2, &[]);
    let fd = fdpass::fetch(
        &ex.identity,
        ex.exports[1].0,
        -1,
        FdTransport::Socket,
        Duration::from_secs(10),
    )
    .unwrap();
    assert_eq!(read_content(&fd), expected_content(1));
    ex.finish();
}

#[test]
fn a_killed_exporter_in_another_pid_namespace_gives_peer_gone_and_leaves_a_removable_stale_socket()
{
    const NAME: &str = "a_killed_exporter_in_another_pid_namespace_gives_peer_gone_and_leaves_a_removable_stale_socket";
    if let Some(r) = role() {
        return child_main(&r);
    }
    if !namespaces_work(PID_NS, NAME) {
        return;
    }
    let mut ex = Exporter::spawn_under(PID_NS, NAME, 2, &[]);
    let who = ex.identity;
    let t = Duration::from_secs(20);
    let fd = fdpass::fetch(&who, ex.exports[0].0, -1, FdTransport::Socket, t).unwrap();
    assert_eq!(read_content(&fd), expected_content(0));
    assert!(
        fdpass::stale_socket_files()
            .unwrap()
            .iter()
            .all(|f| f.identity != who),
        "a live exporter's socket is listed as stale"
    );
    // SIGKILL to unshare; --kill-child passes it to the exporter (pid 1 there).
    ex.peer.child.kill().unwrap();
    ex.peer.child.wait().unwrap();
    let at = Instant::now();
    while who.liveness() != cuda_ipc::identity::Liveness::Dead {
        assert!(
            at.elapsed() < Duration::from_secs(10),
            "the exporter lives on"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    for transport in [
        FdTransport::Socket,
        FdTransport::PidfdThenSocket,
        FdTransport::PidfdOnly,
    ] {
        let at = Instant::now();
        let e = fdpass::fetch(&who, ex.exports[1].0, -1, transport, t).unwrap_err();
        assert!(
            matches!(e, Error::FdPass(FdPassError::PeerGone { .. })),
            "{transport:?}: {e}"
        );
        assert!(at.elapsed() < Duration::from_secs(2), "{:?}", at.elapsed());
    }
    // The fd fetched before stays valid.
    assert_eq!(read_content(&fd), expected_content(0));
    // Killed: its socket file is left, listed as stale, and removed by gc's call.
    assert!(socket_exists(&who));
    let stale = fdpass::stale_socket_files().unwrap();
    let entry = stale
        .iter()
        .find(|f| f.identity == who)
        .unwrap_or_else(|| panic!("{} not listed as stale: {stale:?}", who));
    assert_eq!(entry.uid, rustix::process::geteuid().as_raw());
    assert!(fdpass::remove_stale_socket_file(entry).unwrap());
    assert!(!socket_exists(&who));
    assert!(!fdpass::remove_stale_socket_file(entry).unwrap(), "gone");
    // Its liveness file too (younger than gc's 5 s guard: removed by the age-free test helper).
    assert!(cuda_ipc::raw::identity::remove_liveness_file_if_free(&who).unwrap());
}

/// A `SOCK_SEQPACKET` listener bound at `path` with a backlog of `backlog`, closed when dropped
/// (its file is the caller's to remove).
fn seqpacket_listener(path: &str, backlog: i32) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a descriptor made here; `addr` is a zeroed `sockaddr_un` whose
    // path (shorter than `sun_path`, NUL-terminated by the zeroing) is copied in before `bind`.
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let owned = std::os::fd::OwnedFd::from_raw_fd(fd);
        let mut addr: libc::sockaddr_un = std::mem::zeroed();
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        assert!(path.len() < addr.sun_path.len());
        for (d, s) in addr.sun_path.iter_mut().zip(path.bytes()) {
            *d = s as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
        assert_eq!(
            libc::bind(fd, (&raw const addr).cast(), len),
            0,
            "bind {path}: {}",
            std::io::Error::last_os_error()
        );
        assert_eq!(libc::listen(fd, backlog), 0);
        owned
    }
}

/// A connection to the listener at `path`, never accepted (it fills a backlog).
fn waiting_client(path: &str) -> std::os::unix::net::UnixDatagram {
    use std::os::fd::FromRawFd;
    // SAFETY: as in `seqpacket_listener`; the descriptor is owned by the returned value.
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let mut addr: libc::sockaddr_un = std::mem::zeroed();
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in addr.sun_path.iter_mut().zip(path.bytes()) {
            *d = s as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
        assert_eq!(libc::connect(fd, (&raw const addr).cast(), len), 0);
        std::os::unix::net::UnixDatagram::from_raw_fd(fd)
    }
}

#[test]
fn a_listener_of_this_user_with_another_pid_is_refused_and_a_full_one_waited_for_no_longer() {
    const NAME: &str =
        "a_listener_of_this_user_with_another_pid_is_refused_and_a_full_one_waited_for_no_longer";
    if let Some(r) = role() {
        return child_main(&r);
    }
    // A live process that serves nothing (its socket path is free); this process listens there.
    let idle = Exporter::spawn(NAME, 0, &[]);
    let path = fdpass::socket_path(&idle.identity);
    {
        let _listener = seqpacket_listener(&path, 8);
        let _planted = Planted(path.clone());
        let at = Instant::now();
        let e = fdpass::fetch(
            &idle.identity,
            1,
            -1,
            FdTransport::Socket,
            Duration::from_secs(20),
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, Error::FdPass(FdPassError::NotTheExporter { .. })),
            "{text}"
        );
        assert!(
            text.contains(&format!("held by pid {}", std::process::id())),
            "{text}"
        );
        assert!(at.elapsed() < Duration::from_secs(2), "{:?}", at.elapsed());
    }
    {
        // A backlog that is full: the connection without waiting is refused, and the one that
        // waits gives up at the fetch's timeout (the exporter lives, so it is not `PeerGone`).
        let _listener = seqpacket_listener(&path, 0);
        let _planted = Planted(path.clone());
        let _first = waiting_client(&path);
        let at = Instant::now();
        let e = fdpass::fetch(
            &idle.identity,
            1,
            -1,
            FdTransport::Socket,
            Duration::from_millis(600),
        )
        .unwrap_err();
        let waited = at.elapsed();
        assert!(
            matches!(
                e,
                Error::Timeout { .. } | Error::FdPass(FdPassError::NotTheExporter { .. })
            ),
            "{e}"
        );
        assert!(waited < Duration::from_secs(3), "{waited:?}");
    }
    idle.finish();
}

/// A symbolic link at a gone exporter's socket path (same pid, another start time), planted by
/// another user, to a live server of this user with that pid: `connect` follows it, and the
/// listener's pid and uid are the ones the connection taken at once looks for, but the path is
/// not a socket: the fetch refuses it (or finds the exporter gone), never takes that server's fd.
#[test]
fn a_link_to_a_server_with_the_exporters_pid_is_not_taken_for_the_exporter() {
    if role().is_some() {
        return;
    }
    use std::io::Write;
    let me = ProcessIdentity::current().unwrap();
    let mut f = std::fs::File::from(
        rustix::fs::memfd_create("link-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap(),
    );
    f.write_all(b"another process's fd").unwrap();
    let ex = fdpass::FdExport::new(std::os::fd::OwnedFd::from(f)).unwrap();
    let mut w = me.to_words();
    w[1] = w[1].wrapping_sub(2);
    let gone = ProcessIdentity::from_words(w);
    let link = fdpass::socket_path(&gone);
    std::os::unix::fs::symlink(fdpass::socket_path(&me), &link).unwrap();
    let _planted = Planted(link.clone());
    let r = fdpass::fetch(
        &gone,
        ex.id(),
        -1,
        FdTransport::Socket,
        Duration::from_secs(5),
    );
    match r {
        Ok(_) => panic!("an fd was taken through a symbolic link"),
        Err(e) => assert!(
            matches!(
                e,
                Error::FdPass(FdPassError::PeerGone { .. } | FdPassError::NotTheExporter { .. })
            ),
            "{e}"
        ),
    }
}
