//! The exporter's side: the table of offered fds, and the server thread that hands them out over
//! this process's socket file.
//!
//! Owns: [`FdExport`] and the process-wide table of offered fds (id → fd), the server thread
//! (started by the first export, detached), its listening socket and the life of its socket file
//! (made mode 0600 right after `bind`, removed at normal exit by an `atexit` hook and when the
//! server stops; a forked child leaves its parent's file alone), and the server's check of each
//! client (`SO_PEERCRED`: the exporter's effective uid, or root). The byte layout is `wire.rs`'s;
//! the socket path and the peer's credentials come from `socket.rs`.
//!
//! Who closes what: the table and each [`FdExport`] share one `Arc<OwnedFd>`, the exporter's copy;
//! the last of them to go closes it (the `FdExport`'s drop, or the server thread right after a
//! send that was under way at that moment). The listener is owned by the server thread and closed
//! when it stops; each accepted connection is closed when its request has been answered.

use super::socket::{describe_path, peer_cred, socket_path};
use super::wire::{
    ENTRY_NOT_OFFERED, ENTRY_OK, MAX_FDS_PER_MESSAGE, MAX_REQUEST_BYTES, REQUEST_OK,
    REQUEST_REFUSED, decode_request, encode_reply,
};
use crate::error::{Error, OsError, Result};
use crate::identity::ForkEpoch;
use crate::identity::ProcessIdentity;
use rustix::io::Errno;
use rustix::net::sockopt::{self, Timeout};
use rustix::net::{
    AddressFamily, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix,
    SocketFlags, SocketType,
};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// Send and receive timeout on the server's accepted sockets: one stalled client delays the next by
/// at most this.
const SERVER_IO_TIMEOUT: Duration = Duration::from_secs(1);
/// Pending connections the server's socket queues.
const LISTEN_BACKLOG: i32 = 128;

/// The exports of this process: id → fd. The server thread clones an `Arc` under the lock and sends
/// outside it, so dropping an [`FdExport`] never waits for a slow client.
static TABLE: Mutex<BTreeMap<u32, Arc<OwnedFd>>> = Mutex::new(BTreeMap::new());
/// The process (by fork) the server thread was started in, if any: a child made by `fork()`
/// has no thread, and starts its own (`identity::fork`; a pid does not tell a child forked into a
/// new pid namespace from its parent).
static SERVER: Mutex<Option<ForkEpoch>> = Mutex::new(None);
/// The next export id. Plain std atomics (not `crate::sync`): this is process-local bookkeeping,
/// not part of a shared-memory protocol that loom models.
static NEXT_ID: AtomicU32 = AtomicU32::new(1);

/// Locks, ignoring poisoning: every critical section here leaves the data consistent.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A file descriptor this process offers to other processes of the same user, by id.
///
/// The first `FdExport` of a process starts a detached server thread on the socket file
/// [`socket_path`] (`/dev/shm/cuda-ipc.fd.<pid ns>.<pid>.<start time>`); the thread never keeps
/// the process alive at exit, and the file is removed at normal exit. Importers get a copy with
/// [`fetch`](super::fetch()) (through that socket, by [`id`](Self::id)) or, where the ptrace rules
/// allow, with `pidfd_getfd` (by [`raw_fd`](Self::raw_fd)).
///
/// Owns the exporter's copy of the fd: dropping the `FdExport` withdraws the id (later requests get
/// [`crate::ipc::fdpass::FdPassError::NotOffered`]) and closes the copy. Copies already fetched by
/// importers stay valid.
///
/// # Examples
/// ```
/// use cuda_ipc::identity::ProcessIdentity;
/// use cuda_ipc::ipc::fdpass::{self, FdExport, FdTransport};
/// use std::time::Duration;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let export = FdExport::new(std::fs::File::open("/dev/null")?.into())?;
/// // The importer gets (exporter identity, id, fd number) in a message; here it is this process.
/// let me = ProcessIdentity::current()?;
/// let timeout = Duration::from_secs(5);
/// let fd = fdpass::fetch(&me, export.id(), export.raw_fd(), FdTransport::Socket, timeout)?;
/// drop(fd); // the importer's own copy: it closes it
/// drop(export); // withdrawn: later fetches of this id fail
/// # Ok(())
/// # }
/// ```
pub struct FdExport {
    /// Never reused within the process.
    id: u32,
    /// Shared with the table; the server thread holds a clone only while sending it.
    fd: Arc<OwnedFd>,
    /// The process (by fork) that offered it: a forked child's copy leaves the table alone (the
    /// parent's server thread, which may have held its lock at the fork, does not run there).
    fork: ForkEpoch,
}

impl FdExport {
    /// Offers `fd` to other processes of the same user (or root); starts the server thread on first
    /// use.
    ///
    /// Takes ownership of `fd`; on an error it is closed.
    ///
    /// # Errors
    /// - [`Error::Os`] when the server's socket cannot be made or bound (`socket`, `bind`, `chmod`,
    ///   `listen`; `bind` fails with `EADDRINUSE` when something that is not a leftover of this
    ///   process is at its socket path), the thread cannot be started, or this process's identity
    ///   cannot be read.
    /// - [`Error::Unsupported`] when the process has used up its 2³²−1 export ids.
    pub fn new(fd: OwnedFd) -> Result<FdExport> {
        ensure_server()?;
        let id = NEXT_ID
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_add(1))
            .map_err(|_| Error::Unsupported {
                what: "fd export",
                reason: "this process has used all 2^32-1 export ids".to_string(),
                fix: "restart the process",
            })?;
        let fd = Arc::new(fd);
        lock(&TABLE).insert(id, Arc::clone(&fd));
        tracing::debug!(id, fd = fd.as_raw_fd(), "fd exported");
        Ok(FdExport {
            id,
            fd,
            fork: ForkEpoch::now(),
        })
    }

    /// The export's id: 1 for the first export of the process, then increasing; never reused within
    /// the process. Importers name the export by this id (and the exporter's identity).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The fd's number in this process, for importers that use `pidfd_getfd`
    /// ([`FdTransport::PidfdThenSocket`](super::FdTransport::PidfdThenSocket),
    /// [`FdTransport::PidfdOnly`](super::FdTransport::PidfdOnly)). Valid while this `FdExport`
    /// lives; afterwards the number may be reused for another file.
    pub fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }
}

impl AsFd for FdExport {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A copy (`fcntl(F_DUPFD_CLOEXEC)`, through `OwnedFd::try_clone`) of the fd this process offers
/// under `id`: what its server would send another process, taken without the socket. `Ok(None)`
/// when no live [`FdExport`] of this process has that id (never made, or withdrawn). The copy is
/// the caller's to close.
///
/// # Errors
/// [`Error::Os`] naming `fcntl(F_DUPFD_CLOEXEC)` when the copy cannot be made (`EMFILE`).
pub(crate) fn own_offered(id: u32) -> Result<Option<OwnedFd>> {
    let Some(fd) = lock(&TABLE).get(&id).cloned() else {
        return Ok(None);
    };
    let copy = fd.try_clone().map_err(|e| {
        Error::from(OsError::io(
            "fcntl(F_DUPFD_CLOEXEC)",
            format!("fd export {id}"),
            e,
        ))
    })?;
    Ok(Some(copy))
}

impl std::fmt::Debug for FdExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdExport")
            .field("id", &self.id)
            .field("fd", &self.fd.as_raw_fd())
            .finish()
    }
}

impl Drop for FdExport {
    fn drop(&mut self) {
        if self.fork.inherited() {
            return;
        }
        // Withdraw first, so no request that arrives from now on is answered with this fd; our
        // `Arc` (and so the fd, unless the server thread is sending it right now) goes with `self`.
        lock(&TABLE).remove(&self.id);
        tracing::debug!(id = self.id, "fd export withdrawn");
    }
}

/// The socket file this process made, for its removal at exit or when the server stops.
struct ServerFile {
    path: CString,
    /// Device and inode of the file as bound: only that file is removed, never one put there since.
    dev: u64,
    ino: u64,
    /// The process (by fork) that made it: a forked child inherits this record and must not
    /// remove the file (`identity::fork`; a pid does not tell them apart across pid namespaces).
    fork: ForkEpoch,
}

/// This process's socket file, if it made one.
static SERVER_FILE: Mutex<Option<ServerFile>> = Mutex::new(None);

/// Starts this process's server thread unless it runs.
fn ensure_server() -> Result<()> {
    let mut started = lock(&SERVER);
    let me = ProcessIdentity::current()?;
    if started.is_some_and(|e| !e.inherited()) {
        return Ok(());
    }
    let path = socket_path(&me);
    let os = |call: &'static str, e: Errno| Error::from(OsError::new(call, path.as_str(), e));
    let listener = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| os("socket", e))?;
    let addr = SocketAddrUnix::new(path.as_str()).map_err(|e| os("bind", e))?;
    match rustix::net::bind(&listener, &addr) {
        Ok(()) => {}
        Err(Errno::ADDRINUSE) if is_own_leftover(&path) => {
            // Made by this very process (same pid and start time) before an `exec`, whose
            // close-on-exec listener is gone: nobody listens there, and the name is ours.
            tracing::debug!(socket = %path, "removing this process's socket from before an exec");
            rustix::fs::unlink(path.as_str()).map_err(|e| os("unlink", e))?;
            rustix::net::bind(&listener, &addr).map_err(|e| os("bind", e))?;
        }
        Err(Errno::ADDRINUSE) => {
            return Err(OsError::io(
                "bind",
                path.as_str(),
                std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!(
                        "something else is at this process's fd socket path ({}); it was not \
                         made by this process and is left alone",
                        describe_path(&path)
                    ),
                ),
            )
            .into());
        }
        Err(e) => return Err(os("bind", e)),
    }
    let file = record_own_file(&path)?;
    register_exit_hook();
    *lock(&SERVER_FILE) = Some(file);
    rustix::net::listen(&listener, LISTEN_BACKLOG).map_err(|e| {
        remove_own_socket_file();
        os("listen", e)
    })?;
    let our_uid = rustix::process::geteuid().as_raw();
    // Detached: the handle is dropped, and Rust does not wait for other threads at exit.
    std::thread::Builder::new()
        .name("cuda-ipc-fd".to_string())
        .spawn(move || serve(listener, our_uid))
        .map_err(|e| {
            remove_own_socket_file();
            OsError::io("pthread_create", "fd server thread", e)
        })?;
    tracing::debug!(socket = %path, "fd server started");
    *started = Some(ForkEpoch::now());
    Ok(())
}

/// Records the device and inode of the socket file just bound at `path` and sets its mode to 0600;
/// fails (removing the file when it is the one bound) when what is there is not a socket of this
/// user or its mode cannot be set.
fn record_own_file(path: &str) -> Result<ServerFile> {
    let c = CString::new(path)
        .map_err(|_| Error::InvalidArgument(format!("socket path {path:?} holds a NUL byte")))?;
    let st = rustix::fs::lstat(path).map_err(|e| OsError::new("lstat", path, e))?;
    let euid = rustix::process::geteuid().as_raw();
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket
        || st.st_uid != euid
    {
        // Replaced at once by another process of this user (or root): leave it alone.
        return Err(OsError::io(
            "bind",
            path,
            std::io::Error::other(format!(
                "the socket file was replaced right after bind ({}, owner uid {})",
                describe_path(path),
                st.st_uid
            )),
        )
        .into());
    }
    let file = ServerFile {
        path: c,
        dev: st.st_dev,
        ino: st.st_ino,
        fork: ForkEpoch::now(),
    };
    // After bind, not before: bind makes the file with the umask's mode. Other users cannot
    // connect to a 0600 socket; the server's uid check stays the guard either way.
    if let Err(e) = rustix::fs::chmod(path, rustix::fs::Mode::from_raw_mode(0o600)) {
        remove_file_if_same(&file.path, file.dev, file.ino);
        return Err(OsError::new("chmod", path, e).into());
    }
    Ok(file)
}

/// Whether the file at this process's socket path is a socket of this user that nobody listens on:
/// a leftover of this process from before an `exec` (the name holds our pid and start time).
fn is_own_leftover(path: &str) -> bool {
    let Ok(st) = rustix::fs::lstat(path) else {
        return false;
    };
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket
        || st.st_uid != rustix::process::geteuid().as_raw()
    {
        return false;
    }
    let Ok(probe) = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    ) else {
        return false;
    };
    let Ok(addr) = SocketAddrUnix::new(path) else {
        return false;
    };
    matches!(rustix::net::connect(&probe, &addr), Err(Errno::CONNREFUSED))
}

/// Unlinks `path` if it is still the file with device `dev` and inode `ino`.
fn remove_file_if_same(path: &CString, dev: u64, ino: u64) {
    if let Ok(st) = rustix::fs::lstat(path.as_c_str())
        && st.st_dev == dev
        && st.st_ino == ino
    {
        let _ = rustix::fs::unlink(path.as_c_str());
    }
}

/// Removes this process's socket file (when this process made it and it is still the one bound).
fn remove_own_socket_file() {
    let mut f = lock(&SERVER_FILE);
    if let Some(file) = f.as_ref()
        && !file.fork.inherited()
    {
        remove_file_if_same(&file.path, file.dev, file.ino);
        *f = None;
    }
}

fn register_exit_hook() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handler is an `extern "C"` function without arguments that does not unwind
        // (it only takes a lock without blocking and makes plain system calls); registering it has
        // no other precondition.
        unsafe { libc::atexit(remove_socket_file_at_exit) };
    });
}

/// At normal exit: remove this process's socket file (a killed process leaves it; its identity
/// then reads as dead, and [`remove_stale_socket_file`](super::remove_stale_socket_file) removes
/// it). A forked child that exits finds its parent's record (made before the fork) and leaves the
/// file.
extern "C" fn remove_socket_file_at_exit() {
    // `try_lock`: never wait at exit for a thread that was stopped holding the lock.
    let Ok(f) = SERVER_FILE.try_lock() else {
        return;
    };
    if let Some(file) = f.as_ref()
        && !file.fork.inherited()
    {
        remove_file_if_same(&file.path, file.dev, file.ino);
    }
}

/// The server thread: accepts and answers one client at a time, until the listener breaks (then it
/// removes its socket file, and the next export starts a new server).
fn serve(listener: OwnedFd, our_uid: u32) {
    loop {
        match rustix::net::accept_with(&listener, SocketFlags::CLOEXEC) {
            Ok(conn) => {
                // `serve_one` does not panic by design; this keeps the server alive if it ever did.
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    serve_one(&conn, our_uid)
                }));
                match r {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::debug!("fd server: client dropped: {e}"),
                    Err(_) => tracing::warn!("fd server: a request handler panicked; serving on"),
                }
            }
            Err(Errno::INTR | Errno::CONNABORTED | Errno::AGAIN) => {}
            Err(e @ (Errno::BADF | Errno::INVAL | Errno::NOTSOCK | Errno::OPNOTSUPP)) => {
                // The listener itself is broken: stop, and let the next export start over.
                tracing::warn!("fd server: accept failed: {e}; the server stops");
                let mut started = lock(&SERVER);
                remove_own_socket_file();
                // This process's record (the thread runs in the process that started it).
                if started.is_some_and(|e| !e.inherited()) {
                    *started = None;
                }
                return;
            }
            Err(e) => {
                // EMFILE, ENFILE, ENOMEM, ...: wait for resources instead of spinning.
                tracing::warn!("fd server: accept failed: {e}; retrying in 100 ms");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Whether a client with effective uid `peer` may fetch the fds of an exporter running as `ours`.
fn peer_allowed(peer: u32, ours: u32) -> bool {
    peer == ours || peer == 0
}

/// Answers one client: checks its uid, reads its request (bounded by [`SERVER_IO_TIMEOUT`]), sends
/// the statuses and fds. Errors mean the client misbehaved or left; the caller only logs them.
fn serve_one(conn: &OwnedFd, our_uid: u32) -> std::result::Result<(), Errno> {
    sockopt::set_socket_timeout(conn, Timeout::Recv, Some(SERVER_IO_TIMEOUT))?;
    sockopt::set_socket_timeout(conn, Timeout::Send, Some(SERVER_IO_TIMEOUT))?;
    let peer = peer_cred(conn)?;
    if !peer_allowed(peer.uid, our_uid) {
        // Refused before reading, so other users cannot hold the server with stalled requests.
        // Closing with the request unread makes the client's next receive fail once with
        // ECONNRESET, then return this reply: the client retries once.
        tracing::debug!(
            pid = peer.pid,
            uid = peer.uid,
            "fd server: refused a client of another user"
        );
        return send_reply(conn, REQUEST_REFUSED, &[], &[]);
    }
    let mut buf = vec![0u8; MAX_REQUEST_BYTES + 1];
    // Plain `recv`: any fds a client attaches are discarded (and closed) by the kernel.
    let (n, _) = loop {
        match rustix::net::recv(conn, &mut buf[..], RecvFlags::empty()) {
            Err(Errno::INTR) => continue,
            r => break r?,
        }
    };
    if n == 0 {
        return Ok(()); // the client left without asking
    }
    let ids = match decode_request(&buf[..n]) {
        Ok(ids) => ids,
        Err(status) => return send_reply(conn, status, &[], &[]),
    };
    let found: Vec<(u32, Option<Arc<OwnedFd>>)> = {
        let table = lock(&TABLE);
        ids.iter().map(|id| (*id, table.get(id).cloned())).collect()
    };
    for chunk in found.chunks(MAX_FDS_PER_MESSAGE) {
        let entries: Vec<(u32, u32)> = chunk
            .iter()
            .map(|(id, fd)| {
                (
                    *id,
                    if fd.is_some() {
                        ENTRY_OK
                    } else {
                        ENTRY_NOT_OFFERED
                    },
                )
            })
            .collect();
        let fds: Vec<BorrowedFd<'_>> = chunk
            .iter()
            .filter_map(|(_, fd)| fd.as_ref().map(|f| f.as_fd()))
            .collect();
        send_reply(conn, REQUEST_OK, &entries, &fds)?;
    }
    Ok(())
}

/// Sends one reply message with `entries` and, attached, `fds` (at most [`MAX_FDS_PER_MESSAGE`]).
fn send_reply(
    conn: &OwnedFd,
    status: u16,
    entries: &[(u32, u32)],
    fds: &[BorrowedFd<'_>],
) -> std::result::Result<(), Errno> {
    let bytes = encode_reply(status, entries);
    let mut space = vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(Errno::NOBUFS); // cannot happen: the buffer is sized for `fds`
    }
    loop {
        // NOSIGNAL: a client that left must not raise SIGPIPE in the exporter.
        match rustix::net::sendmsg(
            conn,
            &[IoSlice::new(&bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e),
            // SOCK_SEQPACKET sends a message whole or not at all.
            Ok(n) if n == bytes.len() => return Ok(()),
            Ok(_) => return Err(Errno::MSGSIZE),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipc::fdpass::socket::{
        StaleSocketFile, remove_stale_socket_file, socket_file_name, stale_socket_files,
    };
    use std::io::Write;

    fn memfd(content: &str) -> OwnedFd {
        let fd = rustix::fs::memfd_create("fdpass-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let mut f = std::fs::File::from(fd);
        f.write_all(content.as_bytes()).unwrap();
        f.into()
    }

    #[test]
    fn only_the_same_user_or_root_is_allowed() {
        assert!(peer_allowed(1000, 1000));
        assert!(peer_allowed(0, 1000));
        assert!(!peer_allowed(1001, 1000));
        assert!(peer_allowed(0, 0));
        assert!(!peer_allowed(1000, 0));
    }

    #[test]
    fn the_server_socket_is_a_0600_file_of_this_user_and_never_stale_while_it_runs() {
        let _e = FdExport::new(memfd("x")).unwrap();
        let me = ProcessIdentity::current().unwrap();
        let st = rustix::fs::lstat(socket_path(&me).as_str()).unwrap();
        assert_eq!(
            rustix::fs::FileType::from_raw_mode(st.st_mode),
            rustix::fs::FileType::Socket
        );
        assert_eq!(st.st_mode & 0o777, 0o600);
        assert_eq!(st.st_uid, rustix::process::geteuid().as_raw());
        let stale = stale_socket_files().unwrap();
        assert!(stale.iter().all(|f| f.identity != me), "{stale:?}");
        // Even asked to, the removal refuses a live process's socket.
        let mine = StaleSocketFile {
            name: socket_file_name(&me),
            identity: me,
            uid: st.st_uid,
        };
        assert!(!remove_stale_socket_file(&mine).unwrap());
        assert!(rustix::fs::lstat(socket_path(&me).as_str()).is_ok());
    }

    #[test]
    fn ids_increase_and_are_never_reused() {
        let a = FdExport::new(memfd("a")).unwrap();
        let a_id = a.id();
        drop(a);
        let b = FdExport::new(memfd("b")).unwrap();
        let c = FdExport::new(memfd("c")).unwrap();
        assert!(a_id >= 1);
        assert!(b.id() > a_id);
        assert!(c.id() > b.id());
    }
}
