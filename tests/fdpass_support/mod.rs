//! What the fd-passing tests share (`ipc_fdpass`, `ipc_fdpass_peers`): memfds with known
//! content stand in for VMM exports; the exporter and (where fd counts matter) the importer are
//! the test binary re-executed as children, driven line by line over stdin/stdout.
#![allow(dead_code)]

use crate::common::{Peer, parent_lines, tell};
use cuda_ipc::Error;
use cuda_ipc::identity::ProcessIdentity;
use cuda_ipc::ipc::fdpass::{self, FdExport, FdPassError, FdTransport};
use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

/// How long a parent waits for a child's answer.
pub const ANSWER: Duration = Duration::from_secs(30);
/// Exporter child: how many memfds to export.
pub const EXPORTS: &str = "FDPASS_EXPORTS";
/// Exporter child: make the process non-dumpable (so `pidfd_getfd` needs `CAP_SYS_PTRACE`).
pub const NONDUMPABLE: &str = "FDPASS_NONDUMPABLE";
/// Exporter child: fork a child that keeps the inherited listener and never serves (it only
/// sleeps until killed), and say its pid (`keeper PID`) after `ready`.
pub const FORK_KEEPER: &str = "FDPASS_FORK_KEEPER";
/// Importer child: drop `CAP_SYS_PTRACE` first.
pub const DROP_PTRACE: &str = "FDPASS_DROP_PTRACE";
/// Importer or exporter child: switch to this uid (and gid) first; needs root.
pub const SETUID: &str = "FDPASS_SETUID";

// ---------------------------------------------------------------------------------------------
// Children

pub fn child_main(role: &str) {
    match role {
        "exporter" => exporter_main(),
        "importer" => importer_main(),
        "exec-exporter" => exec_exporter_main(),
        other => panic!("unknown role {other}"),
    }
}

/// The content of export number `i` of an exporter child.
pub fn expected_content(i: usize) -> String {
    format!("export-{i}")
}

/// A memfd holding `content`.
pub fn memfd(content: &str) -> OwnedFd {
    let fd = rustix::fs::memfd_create("fdpass-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let file = std::fs::File::from(fd);
    file.write_all_at(content.as_bytes(), 0).unwrap();
    file.into()
}

/// The whole content of a memfd, read at offset 0 (the file offset is shared with the exporter).
pub fn read_content(fd: &OwnedFd) -> String {
    let file = std::fs::File::from(fd.try_clone().unwrap());
    let len = file.metadata().unwrap().len() as usize;
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, 0).unwrap();
    String::from_utf8(buf).unwrap()
}

/// Open fds of this process (entries of /proc/self/fd, less the one reading it).
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count() - 1
}

/// `open_fds` once it has not changed for 50 ms (a server thread may be closing a connection).
pub fn settled_fds() -> usize {
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

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn unhex16(s: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap();
    }
    out
}

pub fn exporter_main() {
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
pub const AFTER_EXEC: &str = "FDPASS_AFTER_EXEC";

/// An exporter that serves once, then `exec`s itself (no exit: its socket file stays, and its pid
/// and start time with it), and serves again from the new image ([`exporter_main`]).
pub fn exec_exporter_main() {
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
pub fn drop_cap_sys_ptrace() {
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
pub fn become_user(uid: u32) {
    // SAFETY: plain system calls without pointers (setgroups with a null list of length 0).
    unsafe {
        assert_eq!(libc::setgroups(0, std::ptr::null()), 0);
        assert_eq!(libc::setgid(uid), 0);
        assert_eq!(libc::setuid(uid), 0);
    }
}

pub fn parse_transport(s: &str) -> FdTransport {
    match s {
        "socket" => FdTransport::Socket,
        "pidfd-then-socket" => FdTransport::PidfdThenSocket,
        "pidfd-only" => FdTransport::PidfdOnly,
        other => panic!("unknown transport {other}"),
    }
}

pub fn error_kind(e: &Error) -> &'static str {
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

pub fn parse_ids(s: &str) -> Vec<(u32, i32)> {
    s.split(',')
        .map(|p| {
            let (id, fd) = p.split_once(':').unwrap();
            (id.parse().unwrap(), fd.parse().unwrap())
        })
        .collect()
}

pub fn importer_main() {
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
pub struct Exporter {
    pub peer: Peer,
    pub identity: ProcessIdentity,
    pub exports: Vec<(u32, i32)>,
}

impl Exporter {
    pub fn spawn(test: &str, n: usize, env: &[(&str, &str)]) -> Exporter {
        Self::spawn_under(&[], test, n, env)
    }

    /// An exporter child started through `wrapper` (e.g. `unshare --pid ...`; empty: directly).
    pub fn spawn_under(wrapper: &[&str], test: &str, n: usize, env: &[(&str, &str)]) -> Exporter {
        let n_text = n.to_string();
        let mut all = vec![(EXPORTS, n_text.as_str())];
        all.extend_from_slice(env);
        let peer = Peer::spawn_under(wrapper, test, "exporter", &all);
        Self::from_peer(peer, n)
    }

    /// The exporter whose child `peer` is about to say `ready` with `n` exports.
    pub fn from_peer(mut peer: Peer, n: usize) -> Exporter {
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
    pub fn ids(&self, which: &[usize]) -> String {
        which
            .iter()
            .map(|&i| format!("{}:{}", self.exports[i].0, self.exports[i].1))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub fn fds(&mut self) -> usize {
        self.peer.send("fds");
        self.peer.expect("fds", ANSWER).parse().unwrap()
    }

    pub fn withdraw(&mut self, i: usize) {
        self.peer.send(&format!("withdraw {}", self.exports[i].0));
        self.peer.expect("withdrawn", ANSWER);
    }

    pub fn finish(mut self) {
        self.peer.send("exit");
        self.peer.finish(ANSWER);
    }
}

/// An importer child aimed at one exporter.
pub struct Importer {
    pub peer: Peer,
}

/// A fetch's outcome as the importer child reports it.
#[derive(Debug)]
pub enum Fetched {
    Ok { contents: Vec<String> },
    Err { ms: u64, kind: String, text: String },
}

impl Fetched {
    pub fn contents(&self) -> &[String] {
        match self {
            Fetched::Ok { contents, .. } => contents,
            other => panic!("expected a successful fetch, got {other:?}"),
        }
    }

    /// The error's kind and text; panics on success.
    pub fn error(&self) -> (&str, &str, u64) {
        match self {
            Fetched::Err { kind, text, ms } => (kind, text, *ms),
            other => panic!("expected an error, got {other:?}"),
        }
    }
}

impl Importer {
    pub fn spawn(test: &str, exporter: &ProcessIdentity, env: &[(&str, &str)]) -> Importer {
        Self::spawn_under(&[], test, exporter, env)
    }

    /// An importer child started through `wrapper` (e.g. `unshare --net`; empty: directly).
    pub fn spawn_under(
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

    pub fn fetch(&mut self, transport: &str, timeout_ms: u64, ids: &str) -> Fetched {
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

    pub fn avail(&mut self) -> Result<(), String> {
        self.peer.send("avail");
        let a = self.peer.expect("avail", ANSWER);
        match a.strip_prefix("err ") {
            Some(reason) => Err(reason.to_string()),
            None if a == "ok" => Ok(()),
            None => panic!("importer answered avail {a:?}"),
        }
    }

    pub fn fds(&mut self) -> usize {
        self.peer.send("fds");
        self.peer.expect("fds", ANSWER).parse().unwrap()
    }

    pub fn finish(mut self) {
        self.peer.send("exit");
        self.peer.finish(ANSWER);
    }
}

pub fn contents(range: impl IntoIterator<Item = usize>) -> Vec<String> {
    range.into_iter().map(expected_content).collect()
}

pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

// ---------------------------------------------------------------------------------------------
// Tests

/// A raw client of the exporter's fd server.
pub fn raw_client(exporter: &ProcessIdentity) -> OwnedFd {
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
pub fn raw_exchange(sock: &OwnedFd, bytes: &[u8]) -> Option<u16> {
    rustix::net::send(sock, bytes, rustix::net::SendFlags::NOSIGNAL).unwrap();
    let mut buf = [0u8; 4096];
    let (n, _) = rustix::net::recv(sock, &mut buf[..], rustix::net::RecvFlags::empty()).unwrap();
    (n >= 8).then(|| u16::from_le_bytes([buf[6], buf[7]]))
}

/// A request in the wire format (magic `CIFQ`, version, count, ids).
pub fn raw_request(version: u16, count: u16, ids: &[u32]) -> Vec<u8> {
    let mut v = b"CIFQ".to_vec();
    v.extend_from_slice(&version.to_le_bytes());
    v.extend_from_slice(&count.to_le_bytes());
    for id in ids {
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

/// Runs the rest of the command line as pid 1 of a new pid namespace with its own `/proc`; the
/// child is killed when `unshare` is.
pub const PID_NS: &[&str] = &["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"];

/// Runs the rest of the command line in a new network namespace (only a loopback device, down).
pub const NET_NS: &[&str] = &["unshare", "--net"];

/// Whether namespaces of this kind can be made here; prints why not.
pub fn namespaces_work(wrapper: &[&str], test: &str) -> bool {
    match crate::common::unshare_works(&wrapper[1..]) {
        Ok(()) => true,
        Err(reason) => {
            eprintln!("{test}: not run: {reason}");
            false
        }
    }
}

pub fn socket_exists(id: &ProcessIdentity) -> bool {
    std::fs::symlink_metadata(fdpass::socket_path(id)).is_ok()
}

pub fn mkfifo(path: &str) {
    let c = std::ffi::CString::new(path).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
}

/// Holds the liveness lock of a made-up process (standing in for one in another namespace), so
/// that its identity reads as alive; the file goes when this drops.
pub struct FakeAlive {
    path: String,
    _fd: OwnedFd,
}

impl FakeAlive {
    pub fn new(id: &ProcessIdentity) -> FakeAlive {
        let fake = FakeAlive::locked(id);
        assert!(id.is_alive());
        fake
    }

    /// The same lock in a file owned by `uid` (made here, as root), as a process of that user
    /// would hold it; whether it says the process lives is the caller's to check.
    pub fn owned_by(id: &ProcessIdentity, uid: u32) -> FakeAlive {
        let fake = FakeAlive::locked(id);
        std::os::unix::fs::fchown(&fake._fd, Some(uid), Some(uid)).unwrap();
        fake
    }

    fn locked(id: &ProcessIdentity) -> FakeAlive {
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
pub struct Planted(pub String);

impl Drop for Planted {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0).or_else(|_| std::fs::remove_dir(&self.0));
    }
}

/// Puts something at a path.
pub type Plant<'a> = dyn Fn(&str) + 'a;
