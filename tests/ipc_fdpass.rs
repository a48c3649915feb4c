//! File-descriptor passing between processes (`cuda_ipc::ipc::fdpass`), without a GPU: memfds with
//! known content stand in for VMM exports. The exporter and (where fd counts matter) the importer
//! are this test binary re-executed as children, driven line by line over stdin/stdout.

mod common;

use common::{Peer, parent_lines, role, tell};
use cuda_ipc::Error;
use cuda_ipc::identity::ProcessIdentity;
use cuda_ipc::ipc::fdpass::{self, FdExport, FdPassError, FdTransport};
use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

/// How long a parent waits for a child's answer.
const ANSWER: Duration = Duration::from_secs(30);
/// Exporter child: how many memfds to export.
const EXPORTS: &str = "FDPASS_EXPORTS";
/// Exporter child: make the process non-dumpable (so `pidfd_getfd` needs `CAP_SYS_PTRACE`).
const NONDUMPABLE: &str = "FDPASS_NONDUMPABLE";
/// Exporter child: fork a child that keeps the inherited listener and never serves (it only
/// sleeps until killed), and say its pid (`keeper PID`) after `ready`.
const FORK_KEEPER: &str = "FDPASS_FORK_KEEPER";
/// Importer child: drop `CAP_SYS_PTRACE` first.
const DROP_PTRACE: &str = "FDPASS_DROP_PTRACE";
/// Importer or exporter child: switch to this uid (and gid) first; needs root.
const SETUID: &str = "FDPASS_SETUID";

// ---------------------------------------------------------------------------------------------
// Children

fn child_main(role: &str) {
    match role {
        "exporter" => exporter_main(),
        "importer" => importer_main(),
        "exec-exporter" => exec_exporter_main(),
        other => panic!("unknown role {other}"),
    }
}

/// The content of export number `i` of an exporter child.
fn expected_content(i: usize) -> String {
    format!("export-{i}")
}

/// A memfd holding `content`.
fn memfd(content: &str) -> OwnedFd {
    let fd = rustix::fs::memfd_create("fdpass-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let file = std::fs::File::from(fd);
    file.write_all_at(content.as_bytes(), 0).unwrap();
    file.into()
}

/// The whole content of a memfd, read at offset 0 (the file offset is shared with the exporter).
fn read_content(fd: &OwnedFd) -> String {
    let file = std::fs::File::from(fd.try_clone().unwrap());
    let len = file.metadata().unwrap().len() as usize;
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, 0).unwrap();
    String::from_utf8(buf).unwrap()
}

/// Open fds of this process (entries of /proc/self/fd, less the one reading it).
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count() - 1
}

/// `open_fds` once it has not changed for 50 ms (a server thread may be closing a connection).
fn settled_fds() -> usize {
    let mut last = open_fds();
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(50));
        let now = open_fds();
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex16(s: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    out
}

fn exporter_main() {
    if let Ok(uid) = std::env::var(SETUID) {
        become_user(uid.parse().unwrap());
    }
    if std::env::var(NONDUMPABLE).is_ok() {
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
            .unwrap();
    }
    let n: usize = std::env::var(EXPORTS).unwrap().parse().unwrap();
    let mut exports: BTreeMap<u32, FdExport> = BTreeMap::new();
    let mut list = Vec::new();
    for i in 0..n {
        let e = FdExport::new(memfd(&expected_content(i))).unwrap();
        list.push(format!("{}:{}", e.id(), e.raw_fd()));
        exports.insert(e.id(), e);
    }
    let me = ProcessIdentity::current().unwrap();
    let keeper = if std::env::var(FORK_KEEPER).is_ok() {
        // SAFETY: the child makes only async-signal-safe calls (`pause`) until it is killed,
        // as a child forked from a threaded process must.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            loop {
                // SAFETY: no arguments; async-signal-safe.
                unsafe { libc::pause() };
            }
        }
        assert!(pid > 0, "fork failed");
        Some(pid)
    } else {
        None
    };
    tell(format!(
        "ready {} {} {} {} {}",
        me.pid,
        me.start_time,
        hex(&me.boot_id),
        if list.is_empty() {
            "-".to_string()
        } else {
            list.join(",")
        },
        me.pid_ns
    ));
    if let Some(pid) = keeper {
        tell(format!("keeper {pid}"));
    }
    for line in parent_lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["withdraw", id] => {
                let id: u32 = id.parse().unwrap();
                assert!(exports.remove(&id).is_some(), "no export {id}");
                tell("withdrawn");
            }
            ["export"] => match FdExport::new(memfd("late")) {
                Ok(e) => {
                    tell(format!("exported {}:{}", e.id(), e.raw_fd()));
                    exports.insert(e.id(), e);
                }
                Err(e) => tell(format!("exported err {e}")),
            },
            ["fds"] => tell(format!("fds {}", settled_fds())),
            ["exit"] => break,
            other => panic!("exporter: unknown command {other:?}"),
        }
    }
}

/// Exec-exporter child: set in the image after the `exec`.
const AFTER_EXEC: &str = "FDPASS_AFTER_EXEC";

/// An exporter that serves once, then `exec`s itself (no exit: its socket file stays, and its pid
/// and start time with it), and serves again from the new image ([`exporter_main`]).
fn exec_exporter_main() {
    use std::os::unix::process::CommandExt;
    if std::env::var(AFTER_EXEC).is_ok() {
        return exporter_main();
    }
    let export = FdExport::new(memfd("before the exec")).unwrap();
    let me = ProcessIdentity::current().unwrap();
    assert!(std::fs::symlink_metadata(fdpass::socket_path(&me)).is_ok());
    tell(format!("before {}", me.start_time));
    std::mem::forget(export); // as an exec would: no destructor runs
    let err = std::process::Command::new(std::env::current_exe().unwrap())
        .args(std::env::args_os().skip(1))
        .env(AFTER_EXEC, "1")
        .exec();
    panic!("exec: {err}");
}

/// Removes `CAP_SYS_PTRACE` from this thread's effective and permitted sets (capabilities are per
/// thread; the fetches run on this thread).
fn drop_cap_sys_ptrace() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    const CAP_SYS_PTRACE: u32 = 19;
    let mut header = Header {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: version 3 of capget reads one header and writes two `Data` records; both pointers are
    // valid for the call and the layouts match `struct __user_cap_header_struct` / `_data_struct`.
    let r = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut Header,
            data.as_mut_ptr(),
        )
    };
    assert_eq!(r, 0, "capget: {}", std::io::Error::last_os_error());
    data[0].effective &= !(1 << CAP_SYS_PTRACE);
    data[0].permitted &= !(1 << CAP_SYS_PTRACE);
    // SAFETY: as above; capset only reads both records.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) };
    assert_eq!(r, 0, "capset: {}", std::io::Error::last_os_error());
}

/// Switches the whole process to `uid` (and the same gid), dropping supplementary groups.
fn become_user(uid: u32) {
    // SAFETY: plain system calls without pointers (setgroups with a null list of length 0).
    unsafe {
        assert_eq!(libc::setgroups(0, std::ptr::null()), 0);
        assert_eq!(libc::setgid(uid), 0);
        assert_eq!(libc::setuid(uid), 0);
    }
}

fn parse_transport(s: &str) -> FdTransport {
    match s {
        "socket" => FdTransport::Socket,
        "pidfd-then-socket" => FdTransport::PidfdThenSocket,
        "pidfd-only" => FdTransport::PidfdOnly,
        other => panic!("unknown transport {other}"),
    }
}

fn error_kind(e: &Error) -> &'static str {
    match e {
        Error::FdPass(FdPassError::PeerGone { .. }) => "gone",
        Error::FdPass(FdPassError::NotOffered { .. }) => "notoffered",
        Error::FdPass(FdPassError::Refused { .. }) => "refused",
        Error::FdPass(FdPassError::NotTheExporter { .. }) => "nottheexporter",
        Error::Unsupported { .. } => "unsupported",
        Error::Timeout { .. } => "timeout",
        Error::InvalidArgument(_) => "invalid",
        _ => "other",
    }
}

fn parse_ids(s: &str) -> Vec<(u32, i32)> {
    s.split(',')
        .map(|p| {
            let (id, fd) = p.split_once(':').unwrap();
            (id.parse().unwrap(), fd.parse().unwrap())
        })
        .collect()
}

fn importer_main() {
    if std::env::var(DROP_PTRACE).is_ok() {
        drop_cap_sys_ptrace();
    }
    if let Ok(uid) = std::env::var(SETUID) {
        become_user(uid.parse().unwrap());
    }
    let mut target: Option<ProcessIdentity> = None;
    for line in parent_lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["target", pid, start, boot, ns] => {
                target = Some(ProcessIdentity {
                    pid: pid.parse().unwrap(),
                    start_time: start.parse().unwrap(),
                    boot_id: unhex16(boot),
                    pid_ns: ns.parse().unwrap(),
                });
                tell("ok");
            }
            ["fetch", transport, timeout_ms, ids] => {
                let t = Instant::now();
                let r = fdpass::fetch_many(
                    target.as_ref().unwrap(),
                    &parse_ids(ids),
                    parse_transport(transport),
                    Duration::from_millis(timeout_ms.parse().unwrap()),
                );
                let ms = t.elapsed().as_millis();
                match r {
                    Ok(fds) => {
                        let texts: Vec<String> = fds.iter().map(read_content).collect();
                        tell(format!("ok {ms} {}", texts.join("|")));
                    }
                    Err(e) => tell(format!("err {ms} {} {e}", error_kind(&e))),
                }
            }
            ["avail"] => match fdpass::pidfd_getfd_available(target.as_ref().unwrap().pid) {
                Ok(()) => tell("avail ok"),
                Err(reason) => tell(format!("avail err {reason}")),
            },
            ["fds"] => tell(format!("fds {}", settled_fds())),
            ["exit"] => break,
            other => panic!("importer: unknown command {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Parent-side helpers

/// An exporter child and what it exported: (id, fd number) of export `i` at index `i`.
struct Exporter {
    peer: Peer,
    identity: ProcessIdentity,
    exports: Vec<(u32, i32)>,
}

impl Exporter {
    fn spawn(test: &str, n: usize, env: &[(&str, &str)]) -> Exporter {
        Self::spawn_under(&[], test, n, env)
    }

    /// An exporter child started through `wrapper` (e.g. `unshare --pid ...`; empty: directly).
    fn spawn_under(wrapper: &[&str], test: &str, n: usize, env: &[(&str, &str)]) -> Exporter {
        let n_text = n.to_string();
        let mut all = vec![(EXPORTS, n_text.as_str())];
        all.extend_from_slice(env);
        let peer = Peer::spawn_under(wrapper, test, "exporter", &all);
        Self::from_peer(peer, n)
    }

    /// The exporter whose child `peer` is about to say `ready` with `n` exports.
    fn from_peer(mut peer: Peer, n: usize) -> Exporter {
        let ready = peer.expect("ready", ANSWER);
        let w: Vec<&str> = ready.split_whitespace().collect();
        let identity = ProcessIdentity {
            pid: w[0].parse().unwrap(),
            start_time: w[1].parse().unwrap(),
            boot_id: unhex16(w[2]),
            pid_ns: w[4].parse().unwrap(),
        };
        let exports = if w[3] == "-" {
            Vec::new()
        } else {
            parse_ids(w[3])
        };
        assert_eq!(exports.len(), n);
        Exporter {
            peer,
            identity,
            exports,
        }
    }

    /// "id:fd,id:fd" for the exports with these indices.
    fn ids(&self, which: &[usize]) -> String {
        which
            .iter()
            .map(|&i| format!("{}:{}", self.exports[i].0, self.exports[i].1))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn fds(&mut self) -> usize {
        self.peer.send("fds");
        self.peer.expect("fds", ANSWER).parse().unwrap()
    }

    fn withdraw(&mut self, i: usize) {
        self.peer.send(&format!("withdraw {}", self.exports[i].0));
        self.peer.expect("withdrawn", ANSWER);
    }

    fn finish(mut self) {
        self.peer.send("exit");
        self.peer.finish(ANSWER);
    }
}

/// An importer child aimed at one exporter.
struct Importer {
    peer: Peer,
}

/// A fetch's outcome as the importer child reports it.
#[derive(Debug)]
enum Fetched {
    Ok { contents: Vec<String> },
    Err { ms: u64, kind: String, text: String },
}

impl Fetched {
    fn contents(&self) -> &[String] {
        match self {
            Fetched::Ok { contents, .. } => contents,
            other => panic!("expected a successful fetch, got {other:?}"),
        }
    }

    /// The error's kind and text; panics on success.
    fn error(&self) -> (&str, &str, u64) {
        match self {
            Fetched::Err { kind, text, ms } => (kind, text, *ms),
            other => panic!("expected an error, got {other:?}"),
        }
    }
}

impl Importer {
    fn spawn(test: &str, exporter: &ProcessIdentity, env: &[(&str, &str)]) -> Importer {
        Self::spawn_under(&[], test, exporter, env)
    }

    /// An importer child started through `wrapper` (e.g. `unshare --net`; empty: directly).
    fn spawn_under(
        wrapper: &[&str],
        test: &str,
        exporter: &ProcessIdentity,
        env: &[(&str, &str)],
    ) -> Importer {
        let mut peer = Peer::spawn_under(wrapper, test, "importer", env);
        peer.send(&format!(
            "target {} {} {} {}",
            exporter.pid,
            exporter.start_time,
            hex(&exporter.boot_id),
            exporter.pid_ns
        ));
        peer.expect("ok", ANSWER);
        Importer { peer }
    }

    fn fetch(&mut self, transport: &str, timeout_ms: u64, ids: &str) -> Fetched {
        self.peer
            .send(&format!("fetch {transport} {timeout_ms} {ids}"));
        let line = self.peer.recv(ANSWER);
        let mut w = line.splitn(4, ' ');
        match (w.next(), w.next(), w.next(), w.next()) {
            (Some("ok"), Some(_ms), rest, None) => Fetched::Ok {
                contents: rest.unwrap_or("").split('|').map(str::to_string).collect(),
            },
            (Some("err"), Some(ms), Some(kind), text) => Fetched::Err {
                ms: ms.parse().unwrap(),
                kind: kind.to_string(),
                text: text.unwrap_or("").to_string(),
            },
            _ => panic!("importer answered {line:?}"),
        }
    }

    fn avail(&mut self) -> Result<(), String> {
        self.peer.send("avail");
        let a = self.peer.expect("avail", ANSWER);
        match a.strip_prefix("err ") {
            Some(reason) => Err(reason.to_string()),
            None if a == "ok" => Ok(()),
            None => panic!("importer answered avail {a:?}"),
        }
    }

    fn fds(&mut self) -> usize {
        self.peer.send("fds");
        self.peer.expect("fds", ANSWER).parse().unwrap()
    }

    fn finish(mut self) {
        self.peer.send("exit");
        self.peer.finish(ANSWER);
    }
}

fn contents(range: impl IntoIterator<Item = usize>) -> Vec<String> {
    range.into_iter().map(expected_content).collect()
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

// ---------------------------------------------------------------------------------------------
// Tests

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
    if !is_root() {
        eprintln!("not run: needs root to start an exporter of another user");
        return;
    }
    let ex = Exporter::spawn(NAME, 1, &[(SETUID, "65534")]);
    let ids = parse_ids(&ex.ids(&[0]));
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

/// Holds an open-file-description lock on `path` (the liveness lock's byte 0) while it lives: a
/// liveness file made here, owned by `uid`, as a process of that user would make it.
fn forge_liveness(path: &str, uid: u32) -> std::fs::File {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .unwrap();
    std::os::unix::fs::fchown(&f, Some(uid), Some(uid)).unwrap();
    // SAFETY: `flock` is a plain C struct of integers; all-zero is a valid value.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = libc::F_WRLCK as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_len = 1;
    // SAFETY: a valid open descriptor and a fully initialised `flock`.
    let r = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&f), libc::F_OFD_SETLK, &l) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    f
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
    if !is_root() {
        eprintln!("not run: needs root to start an exporter of another user");
        return;
    }
    let ex = Exporter::spawn(NAME, 1, &[(SETUID, "65534")]);
    let ids = parse_ids(&ex.ids(&[0]));
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
    let live = elsewhere.liveness_path();
    let _ = std::fs::remove_file(&live);
    let before = open_fds();

    // Root's exporter expected, and root's lock says it lives: the socket file is 65534's,
    // refused before connecting.
    let lock = forge_liveness(&live, 0);
    let r = fdpass::fetch_many_from_uid(&elsewhere, 0, &ids, FdTransport::Socket, ANSWER);
    assert!(
        matches!(&r, Err(Error::FdPass(FdPassError::NotTheExporter { reason, .. })) if reason.contains("uid 65534")),
        "{:?}",
        r.map(|v| v.len())
    );
    drop(lock);
    assert_eq!(open_fds(), before, "fds left open");
    std::fs::remove_file(&live).unwrap();

    // 65534 expected, and a lock of 65534's says the exporter lives: served.
    let lock = forge_liveness(&live, 65534);
    let fds =
        fdpass::fetch_many_from_uid(&elsewhere, 65534, &ids, FdTransport::Socket, ANSWER).unwrap();
    assert_eq!(
        fds.iter().map(read_content).collect::<Vec<_>>(),
        contents([0])
    );
    drop(fds);
    drop(lock);
    std::fs::remove_file(&live).unwrap();

    // The only lock is a third user's: it does not say the exporter lives.
    let lock = forge_liveness(&live, 65533);
    let r = fdpass::fetch_many_from_uid(&elsewhere, 65534, &ids, FdTransport::Socket, ANSWER);
    assert!(
        matches!(r, Err(Error::FdPass(FdPassError::PeerGone { .. }))),
        "a lock of another user's said the exporter lives: {:?}",
        r.map(|v| v.len())
    );
    drop(lock);
    std::fs::remove_file(&live).unwrap();
    std::fs::remove_file(&linked).unwrap();
    assert_eq!(open_fds(), before, "fds left open");
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

/// A raw client of the exporter's fd server.
fn raw_client(exporter: &ProcessIdentity) -> OwnedFd {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    let addr = SocketAddrUnix::new(fdpass::socket_path(exporter).as_str()).unwrap();
    rustix::net::connect(&sock, &addr).unwrap();
    rustix::net::sockopt::set_socket_timeout(
        &sock,
        rustix::net::sockopt::Timeout::Recv,
        Some(Duration::from_secs(10)),
    )
    .unwrap();
    sock
}

/// Sends `bytes` on `sock` and returns the request status of the reply (bytes 6..8), or `None`
/// when the server closed the connection without a reply.
fn raw_exchange(sock: &OwnedFd, bytes: &[u8]) -> Option<u16> {
    rustix::net::send(sock, bytes, rustix::net::SendFlags::NOSIGNAL).unwrap();
    let mut buf = [0u8; 4096];
    let (n, _) = rustix::net::recv(sock, &mut buf[..], rustix::net::RecvFlags::empty()).unwrap();
    (n >= 8).then(|| u16::from_le_bytes([buf[6], buf[7]]))
}

/// A request in the wire format (magic `CIFQ`, version, count, ids).
fn raw_request(version: u16, count: u16, ids: &[u32]) -> Vec<u8> {
    let mut v = b"CIFQ".to_vec();
    v.extend_from_slice(&version.to_le_bytes());
    v.extend_from_slice(&count.to_le_bytes());
    for id in ids {
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
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

/// Runs the rest of the command line as pid 1 of a new pid namespace with its own `/proc`; the
/// child is killed when `unshare` is.
const PID_NS: &[&str] = &["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"];
/// Runs the rest of the command line in a new network namespace (only a loopback device, down).
const NET_NS: &[&str] = &["unshare", "--net"];

/// Whether namespaces of this kind can be made here; prints why not.
fn namespaces_work(wrapper: &[&str], test: &str) -> bool {
    match common::unshare_works(&wrapper[1..]) {
        Ok(()) => true,
        Err(reason) => {
            eprintln!("{test}: not run: {reason}");
            false
        }
    }
}

fn socket_exists(id: &ProcessIdentity) -> bool {
    std::fs::symlink_metadata(fdpass::socket_path(id)).is_ok()
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

/// Holds the liveness lock of a made-up process (standing in for one in another namespace), so
/// that its identity reads as alive; the file goes when this drops.
struct FakeAlive {
    path: String,
    _fd: OwnedFd,
}

impl FakeAlive {
    fn new(id: &ProcessIdentity) -> FakeAlive {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let path = id.liveness_path();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .unwrap();
        // SAFETY: `flock` is a plain C struct of integers; all-zero is a valid value.
        let mut l: libc::flock = unsafe { std::mem::zeroed() };
        l.l_type = libc::F_WRLCK as libc::c_short;
        l.l_whence = libc::SEEK_SET as libc::c_short;
        l.l_len = 1;
        // SAFETY: `file` is open; `l` is a valid, initialised `flock` that outlives the call.
        let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &l) };
        assert_eq!(r, 0, "F_OFD_SETLK: {}", std::io::Error::last_os_error());
        assert!(id.is_alive());
        FakeAlive {
            path,
            _fd: file.into(),
        }
    }
}

impl Drop for FakeAlive {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Removes a planted path (file, FIFO, link or empty directory) when dropped.
struct Planted(String);

impl Drop for Planted {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0).or_else(|_| std::fs::remove_dir(&self.0));
    }
}

/// Puts something at a path.
type Plant<'a> = dyn Fn(&str) + 'a;

fn mkfifo(path: &str) {
    let c = std::ffi::CString::new(path).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
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
