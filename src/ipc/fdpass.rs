//! Passing file descriptors between processes of one user: an export table served over a Unix
//! socket file in `/dev/shm` (`SCM_RIGHTS`), and `pidfd_getfd` as an optional fast path.
//!
//! Owns: the process-wide table of offered fds ([`FdExport`]), the server thread that hands them to
//! other processes and its socket file, the importer's side ([`fetch`], [`fetch_many`],
//! [`pidfd_getfd_available`]) and the clean-up of dead servers' socket files
//! ([`stale_socket_files`], [`remove_stale_socket_file`]). Must not touch CUDA, shared memory or the
//! registry: the fds are opaque here (VMM and memory-pool exports are POSIX fds from
//! `cuMemExportToShareableHandle`, but any fd works, and the tests use memfds).
//!
//! # How it works
//! - An exporter wraps an fd in an [`FdExport`], which gets an id (1, 2, ..., never reused in the
//!   process) and is entered in the table. The first export starts one detached server thread that
//!   listens (`SOCK_SEQPACKET`) on the socket file [`socket_path`]:
//!   `/dev/shm/cuda-ipc.fd.<pid ns>.<pid>.<start time>`, beside the segments, so every process that
//!   shares `/dev/shm` reaches it, whatever its network or pid namespace (an abstract socket would
//!   exist only in the exporter's network namespace). The file is made mode 0600 right after
//!   `bind` (the server's uid check below stays the guard), and removed by this process at normal
//!   exit (an `atexit` hook; not by a forked child) and when the server stops. A killed exporter
//!   leaves it: [`stale_socket_files`] lists those of dead processes and
//!   [`remove_stale_socket_file`] removes one (for `cuda-ipc gc`). The exporter sends the id (and
//!   the fd number, for `pidfd_getfd`) to the importer inside its own message, e.g. a token.
//! - An importer calls [`fetch`] or [`fetch_many`] with the exporter's [`ProcessIdentity`]. It checks
//!   that the exporter still runs ([`ProcessIdentity::liveness`]: right across pid namespaces;
//!   zombies are dead), looks at the socket path without following it (`lstat`: anything but a
//!   socket is refused at once, so a FIFO, file, directory or symbolic link planted there gives an
//!   error, never a hang), connects, checks who listens (below), sends the ids and receives one
//!   status per id and the fds (`SCM_RIGHTS`, at most 253 per message, `MSG_CMSG_CLOEXEC`).
//! - The server authorises each client with `SO_PEERCRED`: the same effective uid as the exporter's,
//!   or root. Others get a refusal status and no fds (the file's mode 0600 keeps processes of other
//!   users, root aside, from connecting at all). An unknown or withdrawn id gets an error status, never
//!   another fd. Accepted connections have 1 s send and receive timeouts, so a client that stalls or
//!   vanishes delays others by at most that; malformed requests get an error status.
//!
//! # Who listens: the importer's check
//! - Exporter in the importer's pid namespace ([`ProcessIdentity::in_own_pid_namespace`]): the
//!   listener's `SO_PEERCRED` pid must be the exporter's pid.
//! - Exporter in another pid namespace: pids cannot be compared (`SO_PEERCRED` reports the pid as
//!   seen from the importer's namespace, 0 when the listener is not visible there). Instead the
//!   listener's uid must be the importer's effective uid or root, and the socket file must be owned
//!   by that same uid. `/dev/shm` is sticky, so only that uid (or root) can have put or replaced the
//!   file; the owner is checked before connecting and again against the listener's credentials.
//!
//! # Transports
//! [`FdTransport::Socket`] (the default) needs no special rights. `pidfd_getfd(2)` (Linux 5.6+)
//! copies the fd straight out of the exporter's fd table without a round trip to its server thread,
//! but it is subject to the ptrace access rules (same user and `/proc/sys/kernel/yama/ptrace_scope`
//! 0, or ancestor with scope 1, or `CAP_SYS_PTRACE`; a non-dumpable exporter needs
//! `CAP_SYS_PTRACE`), and it works only within one pid namespace (`pidfd_open` takes a pid of the
//! caller's namespace): for an exporter in another one, [`FdTransport::PidfdThenSocket`] uses the
//! socket and [`FdTransport::PidfdOnly`] fails with [`Error::Unsupported`]. **Caveat**:
//! `pidfd_getfd` takes whatever the fd *number* names in the exporter now. Once the export is
//! withdrawn, the number may name another file, and `pidfd_getfd` hands that out: it is only as
//! fresh as the token that carried the number. The socket path checks the id and cannot hand out a
//! withdrawn fd; that is why it is the default.
//!
//! # Who closes what
//! - [`FdExport`] owns the exporter's copy: [`FdExport::new`] takes the fd (and closes it if it
//!   fails); dropping the `FdExport` withdraws the id and closes that copy (if the server thread is
//!   sending it at that moment, right after that send).
//! - [`fetch`] / [`fetch_many`] return `OwnedFd`s the caller owns: a new open file description
//!   reference in the importer, independent of the exporter's copy (the exporter may withdraw or die
//!   afterwards). On an error no fd is left open. `cuMemImportFromShareableHandle` does not take
//!   ownership of a POSIX fd handle, so the importer closes (drops) the `OwnedFd` after the import,
//!   on success and on failure.
//!
//! See `unix(7)` (`SCM_RIGHTS`, `SO_PEERCRED`), `pidfd_open(2)`, `pidfd_getfd(2)`, `ptrace(2)`
//! ("Ptrace access mode checking").

use crate::error::{Error, OsError, Result};
use crate::identity::{Liveness, ProcessIdentity};
use rustix::io::Errno;
use rustix::net::sockopt::{self, Timeout};
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Request magic, `CIFQ` in little-endian byte order.
const REQUEST_MAGIC: u32 = u32::from_le_bytes(*b"CIFQ");
/// Reply magic, `CIFR` in little-endian byte order.
const REPLY_MAGIC: u32 = u32::from_le_bytes(*b"CIFR");
/// Wire protocol version. Both headers start with magic (u32) and version (u16) in every version.
const PROTOCOL_VERSION: u16 = 1;
/// Request header bytes: magic u32, version u16, id count u16.
const REQUEST_HEADER: usize = 8;
/// Reply header bytes: magic u32, version u16, request status u16, entry count u32.
const REPLY_HEADER: usize = 12;
/// Bytes per reply entry: id u32, status u32.
const REPLY_ENTRY: usize = 8;
/// Most ids in one request; [`fetch_many`] splits longer lists into several requests.
const MAX_IDS_PER_REQUEST: usize = 1024;
/// Largest request in bytes.
const MAX_REQUEST_BYTES: usize = REQUEST_HEADER + 4 * MAX_IDS_PER_REQUEST;
/// Most fds the kernel accepts in one `SCM_RIGHTS` message (`SCM_MAX_FD`).
const MAX_FDS_PER_MESSAGE: usize = 253;
/// Largest reply message in bytes.
const MAX_REPLY_BYTES: usize = REPLY_HEADER + REPLY_ENTRY * MAX_FDS_PER_MESSAGE;
/// Send and receive timeout on the server's accepted sockets: one stalled client delays the next by
/// at most this.
const SERVER_IO_TIMEOUT: Duration = Duration::from_secs(1);
/// Pending connections the server's socket queues.
const LISTEN_BACKLOG: i32 = 128;

/// Request status: served; each entry has its own status.
const REQUEST_OK: u16 = 0;
/// Request status: the client's uid is neither the exporter's nor root.
const REQUEST_REFUSED: u16 = 1;
/// Request status: the request could not be parsed.
const REQUEST_MALFORMED: u16 = 2;
/// Request status: the request has another protocol version (the reply carries the server's).
const REQUEST_VERSION: u16 = 3;
/// Entry status: the fd is attached.
const ENTRY_OK: u32 = 0;
/// Entry status: no such export (never made, or withdrawn).
const ENTRY_NOT_OFFERED: u32 = 1;

/// The exports of this process: id → fd. The server thread clones an `Arc` under the lock and sends
/// outside it, so dropping an [`FdExport`] never waits for a slow client.
static TABLE: Mutex<BTreeMap<u32, Arc<OwnedFd>>> = Mutex::new(BTreeMap::new());
/// The pid the server thread was started in, if any (a child made by `fork()` has none).
static SERVER: Mutex<Option<u32>> = Mutex::new(None);
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
/// the process alive at exit, and the file is removed at normal exit. Importers get
/// a copy with [`fetch`] (through that socket, by [`id`](Self::id)) or, where the ptrace rules allow,
/// with `pidfd_getfd` (by [`raw_fd`](Self::raw_fd)).
///
/// Owns the exporter's copy of the fd: dropping the `FdExport` withdraws the id (later requests get
/// [`Error::FdNotOffered`]) and closes the copy. Copies already fetched by importers stay valid.
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
        Ok(FdExport { id, fd })
    }

    /// The export's id: 1 for the first export of the process, then increasing; never reused within
    /// the process. Importers name the export by this id (and the exporter's identity).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The fd's number in this process, for importers that use `pidfd_getfd`
    /// ([`FdTransport::PidfdThenSocket`], [`FdTransport::PidfdOnly`]). Valid while this `FdExport`
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
        // Withdraw first, so no request that arrives from now on is answered with this fd; our
        // `Arc` (and so the fd, unless the server thread is sending it right now) goes with `self`.
        lock(&TABLE).remove(&self.id);
        tracing::debug!(id = self.id, "fd export withdrawn");
    }
}

/// How an importer gets an fd from another process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FdTransport {
    /// Over the exporter's Unix socket with `SCM_RIGHTS`: needs no special rights, checks the id,
    /// cannot return a withdrawn fd. The default.
    #[default]
    Socket,
    /// `pidfd_getfd` when the kernel and the ptrace rules allow it, else the socket (the reason is
    /// logged at debug level). See the module docs for the caveat on fd numbers.
    PidfdThenSocket,
    /// `pidfd_getfd` only; [`Error::Unsupported`] (with the reason and the fix) when it is refused.
    PidfdOnly,
}

/// Directory of the servers' socket files: the POSIX shared-memory directory, which containers that
/// share segments share too (whatever their network namespaces).
const SOCKET_DIR: &str = "/dev/shm";
/// Prefix of a server socket file's name in `/dev/shm`.
pub const SOCKET_PREFIX: &str = "cuda-ipc.fd.";

/// The path of `exporter`'s fd server socket:
/// `/dev/shm/cuda-ipc.fd.<pid ns>.<pid>.<start time>` (decimal numbers: the inode number of its
/// pid namespace, its pid in that namespace, its start time in clock ticks since boot). At most 63
/// bytes, well within the 108 of a Unix socket address.
pub fn socket_path(exporter: &ProcessIdentity) -> String {
    format!("{SOCKET_DIR}/{}", socket_file_name(exporter))
}

/// The file name (in `/dev/shm`) of `exporter`'s fd server socket.
fn socket_file_name(exporter: &ProcessIdentity) -> String {
    exporter.file_name(SOCKET_PREFIX)
}

/// The socket file this process made, for its removal at exit or when the server stops.
struct ServerFile {
    path: CString,
    /// Device and inode of the file as bound: only that file is removed, never one put there since.
    dev: u64,
    ino: u64,
    /// The pid that made it (a forked child inherits this record and must not remove the file).
    owner_pid: i32,
}

/// This process's socket file, if it made one.
static SERVER_FILE: Mutex<Option<ServerFile>> = Mutex::new(None);

/// Starts this process's server thread unless it runs.
fn ensure_server() -> Result<()> {
    let mut started = lock(&SERVER);
    let me = ProcessIdentity::current()?;
    if *started == Some(me.pid) {
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
    let pid = me.pid;
    std::thread::Builder::new()
        .name("cuda-ipc-fd".to_string())
        .spawn(move || serve(listener, our_uid, pid))
        .map_err(|e| {
            remove_own_socket_file();
            OsError::io("pthread_create", "fd server thread", e)
        })?;
    tracing::debug!(socket = %path, "fd server started");
    *started = Some(me.pid);
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
        // SAFETY: getpid has no preconditions.
        owner_pid: unsafe { libc::getpid() },
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

/// What is at `path`, in words, without following a symbolic link.
fn describe_path(path: &str) -> String {
    use rustix::fs::FileType;
    match rustix::fs::lstat(path) {
        Ok(st) => match FileType::from_raw_mode(st.st_mode) {
            FileType::Socket => "a socket",
            FileType::Fifo => "a FIFO",
            FileType::RegularFile => "a regular file",
            FileType::Directory => "a directory",
            FileType::Symlink => "a symbolic link",
            FileType::CharacterDevice => "a character device",
            FileType::BlockDevice => "a block device",
            FileType::Unknown => "a file of unknown type",
        }
        .to_string(),
        Err(Errno::NOENT) => "nothing".to_string(),
        Err(e) => format!("unknown: lstat failed: {e}"),
    }
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
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    if let Some(file) = f.as_ref()
        && file.owner_pid == pid
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
/// then reads as dead, and [`remove_stale_socket_file`] removes it). A forked child that exits finds
/// its parent's record (another pid) and leaves the file.
extern "C" fn remove_socket_file_at_exit() {
    // `try_lock`: never wait at exit for a thread that was stopped holding the lock.
    let Ok(f) = SERVER_FILE.try_lock() else {
        return;
    };
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    if let Some(file) = f.as_ref()
        && file.owner_pid == pid
    {
        remove_file_if_same(&file.path, file.dev, file.ino);
    }
}

/// The server thread: accepts and answers one client at a time, until the listener breaks (then it
/// removes its socket file, and the next export starts a new server).
fn serve(listener: OwnedFd, our_uid: u32, pid: u32) {
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
                if *started == Some(pid) {
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

/// The credentials of a Unix socket's peer (`SO_PEERCRED`): the pid as seen from this process's
/// pid namespace (0 when the peer is not visible in it) and the effective uid.
#[derive(Clone, Copy, Debug)]
struct PeerCred {
    pid: u32,
    uid: u32,
}

/// `getsockopt(SO_PEERCRED)`, through libc: a peer in a pid namespace this process cannot see has
/// pid 0, which a non-zero pid type could not hold.
fn peer_cred(sock: &impl AsFd) -> std::result::Result<PeerCred, Errno> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `sock` is an open descriptor; `cred` and `len` are valid for writes and `len` holds
    // the size of `cred`, which the kernel does not exceed.
    let r = unsafe {
        libc::getsockopt(
            sock.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(Errno::from_io_error(&std::io::Error::last_os_error()).unwrap_or(Errno::IO));
    }
    if len as usize != std::mem::size_of::<libc::ucred>() {
        return Err(Errno::INVAL);
    }
    Ok(PeerCred {
        pid: u32::try_from(cred.pid).unwrap_or(0),
        uid: cred.uid,
    })
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

/// Encodes a request for `ids` (1 ..= [`MAX_IDS_PER_REQUEST`] of them).
fn encode_request(ids: &[u32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(REQUEST_HEADER + 4 * ids.len());
    out.extend_from_slice(&REQUEST_MAGIC.to_le_bytes());
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&(ids.len() as u16).to_le_bytes());
    for id in ids {
        out.extend_from_slice(&id.to_le_bytes());
    }
    out
}

/// Decodes a request into its ids, or the status to reply with when it is malformed.
fn decode_request(bytes: &[u8]) -> std::result::Result<Vec<u32>, u16> {
    let (Some(magic), Some(version), Some(count)) =
        (le_u32(bytes, 0), le_u16(bytes, 4), le_u16(bytes, 6))
    else {
        return Err(REQUEST_MALFORMED);
    };
    if magic != REQUEST_MAGIC {
        return Err(REQUEST_MALFORMED);
    }
    if version != PROTOCOL_VERSION {
        return Err(REQUEST_VERSION);
    }
    let count = usize::from(count);
    if count == 0 || count > MAX_IDS_PER_REQUEST || bytes.len() != REQUEST_HEADER + 4 * count {
        return Err(REQUEST_MALFORMED);
    }
    (0..count)
        .map(|i| le_u32(bytes, REQUEST_HEADER + 4 * i).ok_or(REQUEST_MALFORMED))
        .collect()
}

/// Encodes one reply message.
fn encode_reply(status: u16, entries: &[(u32, u32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(REPLY_HEADER + REPLY_ENTRY * entries.len());
    out.extend_from_slice(&REPLY_MAGIC.to_le_bytes());
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&status.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (id, st) in entries {
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&st.to_le_bytes());
    }
    out
}

/// One decoded reply message.
#[derive(Debug, PartialEq, Eq)]
struct Reply {
    version: u16,
    status: u16,
    entries: Vec<(u32, u32)>,
}

/// Decodes one reply message; `Err` says what is wrong with it.
fn decode_reply(bytes: &[u8]) -> std::result::Result<Reply, String> {
    let (Some(magic), Some(version)) = (le_u32(bytes, 0), le_u16(bytes, 4)) else {
        return Err(format!("a reply of {} bytes is too short", bytes.len()));
    };
    if magic != REPLY_MAGIC {
        return Err(format!("bad reply magic {magic:#010x}"));
    }
    if version != PROTOCOL_VERSION {
        // Only magic and version are fixed across versions.
        return Ok(Reply {
            version,
            status: REQUEST_VERSION,
            entries: Vec::new(),
        });
    }
    let (Some(status), Some(count)) = (le_u16(bytes, 6), le_u32(bytes, 8)) else {
        return Err(format!("a reply of {} bytes is too short", bytes.len()));
    };
    let count = count as usize;
    if count > MAX_FDS_PER_MESSAGE || bytes.len() != REPLY_HEADER + REPLY_ENTRY * count {
        return Err(format!(
            "a reply of {} bytes claims {count} entries",
            bytes.len()
        ));
    }
    let entries = (0..count)
        .map(|i| {
            let at = REPLY_HEADER + REPLY_ENTRY * i;
            le_u32(bytes, at).zip(le_u32(bytes, at + 4))
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| "truncated reply entries".to_string())?;
    Ok(Reply {
        version,
        status,
        entries,
    })
}

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn le_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        b.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}

/// Fetches export `id` (whose fd number in the exporter is `raw_fd`) from `exporter`, waiting at most
/// `timeout` in all.
///
/// The caller owns the returned fd: a reference of its own to the exporter's open file, valid after
/// the exporter withdraws it or exits. `cuMemImportFromShareableHandle` does not take ownership of a
/// POSIX fd handle: drop the fd after the import, whether the import succeeded or not.
///
/// `raw_fd` is used only by the `pidfd_getfd` transports (pass [`FdExport::raw_fd`]); with
/// [`FdTransport::Socket`] any value works.
///
/// # Errors
/// - [`Error::PeerGone`] when the exporter is no longer running ([`ProcessIdentity::liveness`] says
///   dead: killed, exited, a zombie, its pid reused), found before connecting or when the
///   connection breaks.
/// - [`Error::FdNotOffered`] when the exporter runs but does not offer `id`: it was withdrawn or
///   never made, or the process serves no fds at all (it exported none: no socket file, or nobody
///   listens on it). With [`FdTransport::PidfdOnly`], also when `raw_fd` is not open in the
///   exporter.
/// - [`Error::Unsupported`] when the exporter refuses this process (another user, not root), when
///   the two processes speak different protocol versions, when something other than a socket is at
///   the socket path (a FIFO, a file, a directory, a symbolic link), when the listener fails the
///   peer check (see the [module docs](self): another pid in this pid namespace; across pid
///   namespaces, a file or listener of another user), and with [`FdTransport::PidfdOnly`] when
///   `pidfd_getfd` is refused (kernel before 5.6, ptrace rules, seccomp, an exporter in another pid
///   namespace): the reason and the fix are in the error.
/// - [`Error::Timeout`] when the exporter's server does not answer within `timeout`.
/// - [`Error::InvalidArgument`] with [`FdTransport::PidfdOnly`] and a negative `raw_fd`.
/// - [`Error::Os`] for other failed system calls (`lstat`, `socket`, `connect`, `sendmsg`,
///   `recvmsg`, `pidfd_open`, `pidfd_getfd`) and for a malformed reply.
///
/// See `unix(7)` (`SCM_RIGHTS`) and `pidfd_getfd(2)`; example on [`FdExport`].
#[doc(alias = "SCM_RIGHTS")]
#[doc(alias = "pidfd_getfd")]
pub fn fetch(
    exporter: &ProcessIdentity,
    id: u32,
    raw_fd: i32,
    transport: FdTransport,
    timeout: Duration,
) -> Result<OwnedFd> {
    let mut fds = fetch_many(exporter, &[(id, raw_fd)], transport, timeout)?;
    fds.pop().ok_or_else(|| {
        // `fetch_many` returns one fd per id or an error; this is unreachable.
        Error::InvalidArgument(format!("no fd returned for export {id}"))
    })
}

/// Fetches several exports from `exporter` in one round trip: `ids` are (export id, fd number in the
/// exporter) pairs; returns the fds in the same order. Waits at most `timeout` in all.
///
/// All or nothing: on an error, no fd is left open in this process. More than 1024 ids are fetched
/// in several requests. An empty `ids` returns an empty list without contacting the exporter.
///
/// Ownership and errors as [`fetch`]; [`Error::FdNotOffered`] names the first id not offered.
#[doc(alias = "SCM_RIGHTS")]
#[doc(alias = "pidfd_getfd")]
pub fn fetch_many(
    exporter: &ProcessIdentity,
    ids: &[(u32, i32)],
    transport: FdTransport,
    timeout: Duration,
) -> Result<Vec<OwnedFd>> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let deadline = Deadline::new(timeout);
    if exporter_gone(exporter) {
        return Err(Error::PeerGone { pid: exporter.pid });
    }
    match transport {
        FdTransport::Socket => fetch_socket(exporter, ids, &deadline),
        FdTransport::PidfdOnly => fetch_pidfd(exporter, ids).map_err(|f| f.into_error(exporter)),
        FdTransport::PidfdThenSocket => match fetch_pidfd(exporter, ids) {
            Ok(fds) => Ok(fds),
            Err(PidfdFailure::Gone) => Err(Error::PeerGone { pid: exporter.pid }),
            Err(PidfdFailure::Other(e)) => Err(e),
            Err(f) => {
                tracing::debug!(
                    pid = exporter.pid,
                    "pidfd_getfd not used, falling back to the socket: {}",
                    f.describe()
                );
                fetch_socket(exporter, ids, &deadline)
            }
        },
    }
}

/// Whether `pidfd_getfd` can be used on `pid` now: the kernel has it (Linux 5.6+), no seccomp filter
/// blocks it, and the ptrace access rules let this process attach to `pid`.
///
/// Probes with `pidfd_open(pid)` and `pidfd_getfd(pidfd, i32::MAX)`: the kernel checks ptrace access
/// before the fd number, and no process can have fd `i32::MAX` open (`fs.nr_open` is at most
/// 2³⁰), so `EBADF` means "allowed" and no fd is taken.
///
/// # Errors
/// `Err(reason)` in words: no such process, no kernel support, or refused (with the ptrace scope and
/// what would allow it).
pub fn pidfd_getfd_available(pid: u32) -> std::result::Result<(), String> {
    let pidfd = open_pidfd(pid).map_err(|f| f.describe())?;
    let flags = rustix::process::PidfdGetfdFlags::empty();
    match rustix::process::pidfd_getfd(&pidfd, i32::MAX, flags) {
        Err(Errno::BADF) => Ok(()),
        Ok(_fd) => Ok(()), // not possible (see above); the fd is closed here
        Err(e) => Err(pidfd_getfd_failure(pid, e).describe()),
    }
}

/// Why the `pidfd_getfd` path did not deliver.
#[derive(Debug)]
enum PidfdFailure {
    /// The kernel, seccomp or the ptrace rules refuse it: use the socket.
    Unavailable(String),
    /// `raw_fd` is negative or not open in the exporter (withdrawn, or a stale token).
    BadFd { id: u32, raw_fd: i32 },
    /// The exporter exited.
    Gone,
    /// Another error.
    Other(Error),
}

impl PidfdFailure {
    fn describe(&self) -> String {
        match self {
            PidfdFailure::Unavailable(r) => r.clone(),
            PidfdFailure::BadFd { id, raw_fd } => {
                format!("fd {raw_fd} of export {id} is not open in the exporter")
            }
            PidfdFailure::Gone => "the process is gone".to_string(),
            PidfdFailure::Other(e) => e.to_string(),
        }
    }

    fn into_error(self, exporter: &ProcessIdentity) -> Error {
        match self {
            PidfdFailure::Unavailable(reason) => Error::Unsupported {
                what: "pidfd_getfd",
                reason,
                fix: "use FdTransport::Socket (the default, needs no special rights); pidfd_getfd needs \
                      Linux 5.6+, no seccomp filter against it, and ptrace access: the same user with \
                      /proc/sys/kernel/yama/ptrace_scope 0 (or 1 and the importer an ancestor), or \
                      CAP_SYS_PTRACE in the importer",
            },
            PidfdFailure::BadFd { id, raw_fd } if raw_fd < 0 => {
                Error::InvalidArgument(format!("fd number {raw_fd} of export {id} is negative"))
            }
            PidfdFailure::BadFd { id, .. } => Error::FdNotOffered {
                pid: exporter.pid,
                id,
                reason: "its fd number is not open in the exporter (withdrawn)",
            },
            PidfdFailure::Gone => Error::PeerGone { pid: exporter.pid },
            PidfdFailure::Other(e) => e,
        }
    }
}

/// `pidfd_open(pid)`, with its errors sorted.
fn open_pidfd(pid: u32) -> std::result::Result<OwnedFd, PidfdFailure> {
    let Some(p) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return Err(PidfdFailure::Unavailable(format!(
            "{pid} is not a valid pid"
        )));
    };
    match rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => Ok(fd),
        Err(Errno::SRCH) => Err(PidfdFailure::Gone),
        Err(Errno::NOSYS) => Err(PidfdFailure::Unavailable(
            "this kernel has no pidfd_open (Linux 5.3+), or a seccomp filter blocks it".to_string(),
        )),
        Err(Errno::PERM) => Err(PidfdFailure::Unavailable(
            "pidfd_open was refused with EPERM (a seccomp filter?)".to_string(),
        )),
        Err(e) => Err(PidfdFailure::Other(
            OsError::new("pidfd_open", pid.to_string(), e).into(),
        )),
    }
}

/// Sorts a `pidfd_getfd` error other than `EBADF`.
fn pidfd_getfd_failure(pid: u32, e: Errno) -> PidfdFailure {
    match e {
        Errno::SRCH => PidfdFailure::Gone,
        Errno::NOSYS => PidfdFailure::Unavailable(
            "this kernel has no pidfd_getfd (Linux 5.6+), or a seccomp filter blocks it"
                .to_string(),
        ),
        Errno::PERM => {
            let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
                .map(|s| format!("yama ptrace_scope is {}", s.trim()))
                .unwrap_or_else(|_| "no yama ptrace_scope".to_string());
            PidfdFailure::Unavailable(format!(
                "pidfd_getfd on pid {pid} was refused with EPERM by the ptrace access rules ({scope}; \
                 a process of another user, a non-dumpable process, or a seccomp filter refuse it \
                 without CAP_SYS_PTRACE)"
            ))
        }
        e => PidfdFailure::Other(OsError::new("pidfd_getfd", pid.to_string(), e).into()),
    }
}

/// The `pidfd_getfd` transport, for an exporter of this pid namespace only: `pidfd_open`, then the
/// exporter's liveness re-checked (the pidfd names the process that had the pid when it was opened;
/// if that is not the exporter, the exporter is dead by then), then one `pidfd_getfd` per fd
/// number.
fn fetch_pidfd(
    exporter: &ProcessIdentity,
    ids: &[(u32, i32)],
) -> std::result::Result<Vec<OwnedFd>, PidfdFailure> {
    if !exporter.in_own_pid_namespace() {
        return Err(PidfdFailure::Unavailable(format!(
            "the exporter runs in another pid namespace ({exporter}; this process's is {}), and \
             pidfd_getfd works only within one: pid {} names another process here, or none",
            crate::identity::own_pid_ns(),
            exporter.pid
        )));
    }
    if let Some(&(id, raw_fd)) = ids.iter().find(|(_, fd)| *fd < 0) {
        return Err(PidfdFailure::BadFd { id, raw_fd });
    }
    let pidfd = open_pidfd(exporter.pid)?;
    if exporter_gone(exporter) {
        return Err(PidfdFailure::Gone);
    }
    let mut out = Vec::with_capacity(ids.len());
    for &(id, raw_fd) in ids {
        match rustix::process::pidfd_getfd(
            &pidfd,
            raw_fd,
            rustix::process::PidfdGetfdFlags::empty(),
        ) {
            Ok(fd) => out.push(fd),
            // A zombie has no fd table: the kernel reports ESRCH or EBADF.
            Err(_) if exporter_gone(exporter) => return Err(PidfdFailure::Gone),
            Err(Errno::BADF) => return Err(PidfdFailure::BadFd { id, raw_fd }),
            Err(e) => return Err(pidfd_getfd_failure(exporter.pid, e)),
        }
    }
    Ok(out)
}

/// Whether the exporter no longer runs ([`ProcessIdentity::liveness`]: its liveness lock is free, or
/// by `/proc` in this pid namespace; a zombie counts as dead). `Unknown` counts as running.
fn exporter_gone(exporter: &ProcessIdentity) -> bool {
    exporter.liveness() == Liveness::Dead
}

/// The overall time limit of one fetch.
struct Deadline {
    at: Option<Instant>,
    timeout: Duration,
}

impl Deadline {
    fn new(timeout: Duration) -> Self {
        Self {
            at: Instant::now().checked_add(timeout),
            timeout,
        }
    }

    /// Time left, at least 1 µs (a zero socket timeout would mean "forever"), or the timeout error.
    fn remaining(&self, what: &'static str) -> Result<Duration> {
        let Some(at) = self.at else {
            return Ok(Duration::from_secs(u32::MAX as u64)); // `timeout` too large to add
        };
        match at.checked_duration_since(Instant::now()) {
            Some(d) if !d.is_zero() => Ok(d.max(Duration::from_micros(1))),
            _ => Err(Error::Timeout {
                what,
                after: self.timeout,
            }),
        }
    }
}

/// The socket transport for any number of ids, [`MAX_IDS_PER_REQUEST`] per connection.
fn fetch_socket(
    exporter: &ProcessIdentity,
    ids: &[(u32, i32)],
    deadline: &Deadline,
) -> Result<Vec<OwnedFd>> {
    let mut out = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(MAX_IDS_PER_REQUEST) {
        let only_ids: Vec<u32> = chunk.iter().map(|(id, _)| *id).collect();
        out.extend(fetch_socket_once(exporter, &only_ids, deadline)?);
    }
    Ok(out)
}

/// Error for a connection that broke: the exporter is gone, or `otherwise`.
fn gone_or(exporter: &ProcessIdentity, otherwise: Error) -> Error {
    if exporter_gone(exporter) {
        Error::PeerGone { pid: exporter.pid }
    } else {
        otherwise
    }
}

const WAIT_WHAT: &str = "the exporter's fd server";

/// The refusal of a socket of an exporter in another pid namespace whose file owner (`owner`) or
/// listener uid (`listener`, once connected) is not this process's uid or root, or differ.
fn cross_namespace_refusal(
    exporter: &ProcessIdentity,
    path: &str,
    owner: u32,
    listener: Option<u32>,
    euid: u32,
) -> Error {
    let listener = listener.map_or(String::new(), |u| format!(", listened on by uid {u}"));
    Error::Unsupported {
        what: "fd passing",
        reason: format!(
            "the fd socket {path} of {exporter} (another pid namespace, where pids cannot be \
             compared) is owned by uid {owner}{listener}; this process (uid {euid}) accepts it only \
             when file and listener belong to one uid, its own or root's (root accepts any one uid)"
        ),
        fix: "run the exporter and the importer as the same user; if they do, another user's \
              process squats on the exporter's socket path",
    }
}

/// One request over one connection.
fn fetch_socket_once(
    exporter: &ProcessIdentity,
    ids: &[u32],
    deadline: &Deadline,
) -> Result<Vec<OwnedFd>> {
    let path = socket_path(exporter);
    let target = || path.clone();
    let os = |call: &'static str, e: Errno| Error::from(OsError::new(call, target(), e));
    let not_offered = || Error::FdNotOffered {
        pid: exporter.pid,
        id: ids.first().copied().unwrap_or(0),
        reason: "the process serves no fds (it has exported none)",
    };
    let euid = rustix::process::geteuid().as_raw();

    // What is at the path, not following a symbolic link: only a socket is connected to, so a
    // FIFO, a file, a directory or a link planted there is refused at once, never waited on.
    let st = match rustix::fs::lstat(path.as_str()) {
        Ok(st) => st,
        Err(Errno::NOENT) => return Err(gone_or(exporter, not_offered())),
        Err(e) => return Err(gone_or(exporter, os("lstat", e))),
    };
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
        return Err(Error::Unsupported {
            what: "fd passing",
            reason: format!(
                "{path} (the fd socket of {exporter}) is {}, not a socket",
                describe_path(&path)
            ),
            fix: "something other than the exporter's fd server was put at its socket path; \
                  remove it (only the exporter makes that file)",
        });
    }
    let owner = st.st_uid;
    let same_ns = exporter.in_own_pid_namespace();
    // Root accepts any user's socket whose file and listener agree: it is served by every
    // exporter, and while an exporter runs, its socket path cannot be taken from it (a squatter
    // bound first makes the exporter's own `FdExport::new` fail, and the sticky /dev/shm keeps
    // others from replacing its file).
    if !same_ns && owner != euid && owner != 0 && euid != 0 {
        // Across pid namespaces the owner is what tells the exporter's socket from another's.
        return Err(cross_namespace_refusal(exporter, &path, owner, None, euid));
    }

    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| os("socket", e))?;
    let addr = SocketAddrUnix::new(path.as_str()).map_err(|e| os("connect", e))?;

    // Connect, bounded: a Unix-socket connect waits for room in the backlog up to SO_SNDTIMEO.
    loop {
        sockopt::set_socket_timeout(&sock, Timeout::Send, Some(deadline.remaining(WAIT_WHAT)?))
            .map_err(|e| os("setsockopt", e))?;
        match rustix::net::connect(&sock, &addr) {
            Ok(()) => break,
            Err(Errno::INTR) => continue,
            Err(Errno::CONNREFUSED | Errno::NOENT) => return Err(gone_or(exporter, not_offered())),
            Err(Errno::ACCESS | Errno::PERM) => {
                return Err(Error::Unsupported {
                    what: "fd passing",
                    reason: format!(
                        "the fd socket {path} of {exporter} is owned by uid {owner} with mode \
                         {:o}: it serves fds only to its own user and root, and this process runs \
                         as uid {euid}",
                        st.st_mode & 0o7777
                    ),
                    fix: "run the exporter and the importer as the same user",
                });
            }
            Err(Errno::AGAIN) => {
                if exporter_gone(exporter) {
                    return Err(Error::PeerGone { pid: exporter.pid });
                }
                deadline.remaining(WAIT_WHAT)?;
                continue;
            }
            Err(e) => return Err(gone_or(exporter, os("connect", e))),
        }
    }

    // Who listens there? The listener's credentials, taken when it called listen().
    let server = peer_cred(&sock).map_err(|e| os("getsockopt(SO_PEERCRED)", e))?;
    if same_ns {
        if server.pid != exporter.pid {
            return Err(Error::Unsupported {
                what: "fd passing",
                reason: format!(
                    "the socket {path} of pid {} is held by pid {}",
                    exporter.pid, server.pid
                ),
                fix: "another process squats on the exporter's socket path; find it with \
                      `ss -xlp`",
            });
        }
    } else if !(server.uid == euid || server.uid == 0 || euid == 0) || server.uid != owner {
        return Err(cross_namespace_refusal(
            exporter,
            &path,
            owner,
            Some(server.uid),
            euid,
        ));
    }

    let request = encode_request(ids);
    loop {
        sockopt::set_socket_timeout(&sock, Timeout::Send, Some(deadline.remaining(WAIT_WHAT)?))
            .map_err(|e| os("setsockopt", e))?;
        match rustix::net::send(&sock, &request, SendFlags::NOSIGNAL) {
            Ok(n) if n == request.len() => break,
            Ok(_) => return Err(os("send", Errno::MSGSIZE)),
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) => {
                deadline.remaining(WAIT_WHAT)?;
                continue;
            }
            // The server answered without reading (a refusal) and closed: its reply is queued.
            Err(Errno::PIPE | Errno::CONNRESET) => break,
            Err(e) => return Err(gone_or(exporter, os("send", e))),
        }
    }

    let mut out: Vec<OwnedFd> = Vec::with_capacity(ids.len());
    let mut buf = vec![0u8; MAX_REPLY_BYTES + 1];
    let mut space =
        vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_MESSAGE))];
    let mut answered = 0usize;
    let mut reset_seen = false;
    while answered < ids.len() {
        sockopt::set_socket_timeout(&sock, Timeout::Recv, Some(deadline.remaining(WAIT_WHAT)?))
            .map_err(|e| os("setsockopt", e))?;
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            &sock,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        );
        // Take ownership of whatever fds arrived before anything else, so every exit closes them.
        let mut fds: Vec<OwnedFd> = Vec::new();
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = msg {
                fds.extend(rights);
            }
        }
        let msg = match got {
            Ok(m) => m,
            Err(Errno::INTR) => continue,
            Err(Errno::AGAIN) => {
                // SO_RCVTIMEO ran out: the exporter is gone or time is up (unless it was clamped).
                if exporter_gone(exporter) {
                    return Err(Error::PeerGone { pid: exporter.pid });
                }
                deadline.remaining(WAIT_WHAT)?;
                continue;
            }
            // A server that refuses closes without reading our request; the kernel then reports a
            // reset once (and clears it) before the reply it queued.
            Err(Errno::CONNRESET) if !reset_seen => {
                reset_seen = true;
                continue;
            }
            Err(e) => return Err(gone_or(exporter, os("recvmsg", e))),
        };
        if msg.bytes == 0 {
            return Err(gone_or(
                exporter,
                OsError::io(
                    "recvmsg",
                    target(),
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "the exporter closed the connection before answering every id",
                    ),
                )
                .into(),
            ));
        }
        let malformed = |why: String| -> Error {
            OsError::io(
                "recvmsg",
                target(),
                std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("malformed fd-server reply: {why}"),
                ),
            )
            .into()
        };
        if msg
            .flags
            .intersects(ReturnFlags::TRUNC | ReturnFlags::CTRUNC)
        {
            return Err(malformed("truncated message".to_string()));
        }
        let reply = decode_reply(buf.get(..msg.bytes).unwrap_or(&[])).map_err(malformed)?;
        match reply.status {
            REQUEST_OK if reply.version == PROTOCOL_VERSION => {}
            REQUEST_REFUSED => {
                return Err(Error::Unsupported {
                    what: "fd passing",
                    reason: format!(
                        "process {} (uid {}) serves its fds only to its own user and root, and this \
                         process runs as uid {}",
                        exporter.pid, server.uid, euid
                    ),
                    fix: "run the exporter and the importer as the same user",
                });
            }
            REQUEST_VERSION | REQUEST_OK => {
                return Err(Error::Unsupported {
                    what: "fd passing",
                    reason: format!(
                        "the exporter speaks fd-passing protocol version {}, this process {}",
                        reply.version, PROTOCOL_VERSION
                    ),
                    fix: "use the same cuda-ipc version in both processes",
                });
            }
            other => {
                return Err(malformed(format!("the server answered status {other}")));
            }
        }
        let expected = ids.get(answered..answered + reply.entries.len());
        let entry_ids = reply.entries.iter().map(|(id, _)| *id);
        if reply.entries.is_empty() || !expected.is_some_and(|e| e.iter().copied().eq(entry_ids)) {
            return Err(malformed(
                "the entries do not match the ids asked for".to_string(),
            ));
        }
        if let Some((id, _)) = reply.entries.iter().find(|(_, st)| *st != ENTRY_OK) {
            return Err(Error::FdNotOffered {
                pid: exporter.pid,
                id: *id,
                reason: "withdrawn, or never exported",
            });
        }
        if fds.len() != reply.entries.len() {
            return Err(malformed(format!(
                "{} fds attached for {} ids",
                fds.len(),
                reply.entries.len()
            )));
        }
        answered += reply.entries.len();
        out.append(&mut fds);
    }
    Ok(out)
}

/// An fd server's socket file in `/dev/shm` whose process is dead, found by [`stale_socket_files`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StaleSocketFile {
    /// The file's name in `/dev/shm` (`cuda-ipc.fd.<pid ns>.<pid>.<start time>`).
    pub name: String,
    /// The identity of the process that made it (boot id: this boot's).
    pub identity: ProcessIdentity,
    /// Owner uid of the file.
    pub uid: u32,
}

/// The fd server socket files in `/dev/shm` whose processes are dead ([`ProcessIdentity::liveness`]
/// says `Dead`; `Unknown` is left out): left by killed exporters (a normal exit removes the file).
/// Entries that are not sockets, or whose names do not parse, are left out. For `cuda-ipc gc`;
/// nothing is removed here.
///
/// # Errors
/// [`Error::Os`] when `/dev/shm` cannot be listed or the boot id cannot be read.
pub fn stale_socket_files() -> Result<Vec<StaleSocketFile>> {
    let boot = crate::identity::boot_id()?;
    let dir = std::fs::read_dir(SOCKET_DIR).map_err(|e| OsError::io("opendir", SOCKET_DIR, e))?;
    let mut out = Vec::new();
    for ent in dir.flatten() {
        let Some(name) = ent.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let Some(identity) = parse_socket_name(&name, boot) else {
            continue;
        };
        let Ok(st) = rustix::fs::lstat(format!("{SOCKET_DIR}/{name}").as_str()) else {
            continue;
        };
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
            continue;
        }
        if identity.liveness() == Liveness::Dead {
            out.push(StaleSocketFile {
                name,
                identity,
                uid: st.st_uid,
            });
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Removes a stale socket file (see [`stale_socket_files`]) after checking once more that it is a
/// socket of the same owner, named for `file.identity`, and that this process is dead. Returns
/// `false` when it was not removed: gone already, alive (never, for a dead process: a guard against
/// a mistaken entry), or no longer that socket.
///
/// # Errors
/// [`Error::Os`] when `unlink` fails for a reason other than the file being gone (e.g. `EPERM`: a
/// file of another user in the sticky `/dev/shm`, for a caller other than root).
pub fn remove_stale_socket_file(file: &StaleSocketFile) -> Result<bool> {
    if file.name != socket_file_name(&file.identity) {
        return Ok(false);
    }
    let path = format!("{SOCKET_DIR}/{}", file.name);
    let Ok(st) = rustix::fs::lstat(path.as_str()) else {
        return Ok(false);
    };
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket
        || st.st_uid != file.uid
        || file.identity.liveness() != Liveness::Dead
    {
        return Ok(false);
    }
    match rustix::fs::unlink(path.as_str()) {
        Ok(()) => Ok(true),
        Err(Errno::NOENT) => Ok(false),
        Err(e) => Err(OsError::new("unlink", path, e).into()),
    }
}

/// Parses `cuda-ipc.fd.<ns>.<pid>.<start>` into an identity of boot `boot`.
fn parse_socket_name(name: &str, boot: [u8; 16]) -> Option<ProcessIdentity> {
    crate::identity::parse_file_name(SOCKET_PREFIX, name, boot)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    const T: Duration = Duration::from_secs(5);

    fn memfd(content: &str) -> OwnedFd {
        let fd = rustix::fs::memfd_create("fdpass-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let mut f = std::fs::File::from(fd);
        f.write_all(content.as_bytes()).unwrap();
        f.into()
    }

    fn content(fd: OwnedFd) -> String {
        let mut f = std::fs::File::from(fd);
        f.rewind().unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        s
    }

    #[test]
    fn request_round_trips_and_bad_requests_get_a_status() {
        let ids = [1, 7, u32::MAX];
        assert_eq!(decode_request(&encode_request(&ids)), Ok(ids.to_vec()));
        assert_eq!(decode_request(b""), Err(REQUEST_MALFORMED));
        assert_eq!(decode_request(b"garbage!garbage!"), Err(REQUEST_MALFORMED));
        let mut v2 = encode_request(&ids);
        v2[4] = 2;
        assert_eq!(decode_request(&v2), Err(REQUEST_VERSION));
        let mut short = encode_request(&ids);
        short.pop();
        assert_eq!(decode_request(&short), Err(REQUEST_MALFORMED));
        assert_eq!(decode_request(&encode_request(&[])), Err(REQUEST_MALFORMED));
    }

    #[test]
    fn reply_round_trips_and_bad_replies_are_errors() {
        let entries = [(1, ENTRY_OK), (2, ENTRY_NOT_OFFERED)];
        assert_eq!(
            decode_reply(&encode_reply(REQUEST_OK, &entries)),
            Ok(Reply {
                version: PROTOCOL_VERSION,
                status: REQUEST_OK,
                entries: entries.to_vec()
            })
        );
        assert!(decode_reply(b"").is_err());
        assert!(decode_reply(b"CIFQ\x01\x00\x00\x00\x00\x00\x00\x00").is_err());
        let mut long = encode_reply(REQUEST_OK, &entries);
        long.push(0);
        assert!(decode_reply(&long).is_err());
        let mut other_version = encode_reply(REQUEST_OK, &entries);
        other_version[4] = 9;
        assert_eq!(
            decode_reply(&other_version).unwrap().status,
            REQUEST_VERSION
        );
    }

    #[test]
    fn the_wire_bytes_are_pinned() {
        // Protocol version 1, byte for byte: a change here is a protocol change.
        assert_eq!(
            encode_request(&[1, 0x0403_0201]),
            b"CIFQ\x01\x00\x02\x00\x01\x00\x00\x00\x01\x02\x03\x04"
        );
        assert_eq!(
            encode_reply(
                REQUEST_OK,
                &[(7, ENTRY_OK), (0x0102_0304, ENTRY_NOT_OFFERED)]
            ),
            b"CIFR\x01\x00\x00\x00\x02\x00\x00\x00\
              \x07\x00\x00\x00\x00\x00\x00\x00\x04\x03\x02\x01\x01\x00\x00\x00"
        );
        assert_eq!(
            encode_reply(REQUEST_REFUSED, &[]),
            b"CIFR\x01\x00\x01\x00\x00\x00\x00\x00"
        );
        assert_eq!(
            (
                REQUEST_OK,
                REQUEST_REFUSED,
                REQUEST_MALFORMED,
                REQUEST_VERSION
            ),
            (0, 1, 2, 3)
        );
        assert_eq!((ENTRY_OK, ENTRY_NOT_OFFERED), (0, 1));
        assert_eq!((MAX_IDS_PER_REQUEST, MAX_FDS_PER_MESSAGE), (1024, 253));
    }

    proptest::proptest! {
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            let _ = decode_request(&bytes);
            let _ = decode_reply(&bytes);
            let mut req = REQUEST_MAGIC.to_le_bytes().to_vec();
            req.extend_from_slice(&bytes);
            let _ = decode_request(&req);
            let mut rep = REPLY_MAGIC.to_le_bytes().to_vec();
            rep.extend_from_slice(&bytes);
            let _ = decode_reply(&rep);
        }
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
    fn the_socket_path_is_pid_namespace_pid_and_start_time_in_dev_shm() {
        let id = ProcessIdentity {
            pid: 12,
            start_time: 345,
            boot_id: [0; 16],
            pid_ns: 4026531836,
        };
        assert_eq!(socket_path(&id), "/dev/shm/cuda-ipc.fd.4026531836.12.345");
        assert_eq!(
            parse_socket_name("cuda-ipc.fd.4026531836.12.345", [0; 16]),
            Some(id)
        );
        assert_eq!(parse_socket_name("cuda-ipc.fd.1.2", [0; 16]), None);
        assert_eq!(parse_socket_name("cuda-ipc.fd.1.2.3.4", [0; 16]), None);
        assert_eq!(parse_socket_name("cuda-ipc.live.1.2.3", [0; 16]), None);
        let longest = ProcessIdentity {
            pid: u32::MAX,
            start_time: u64::MAX,
            boot_id: [0; 16],
            pid_ns: u32::MAX,
        };
        assert!(socket_path(&longest).len() < 108);
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

    #[test]
    fn a_process_fetches_its_own_exports_over_the_socket_and_with_pidfd() {
        let me = ProcessIdentity::current().unwrap();
        let a = FdExport::new(memfd("alpha")).unwrap();
        let b = FdExport::new(memfd("beta")).unwrap();
        let got = fetch(&me, a.id(), a.raw_fd(), FdTransport::Socket, T).unwrap();
        assert_eq!(content(got), "alpha");
        let both = fetch_many(
            &me,
            &[(b.id(), b.raw_fd()), (a.id(), a.raw_fd())],
            FdTransport::Socket,
            T,
        )
        .unwrap();
        let texts: Vec<String> = both.into_iter().map(content).collect();
        assert_eq!(texts, ["beta", "alpha"]);
        // A process may always pidfd_getfd from itself (same thread group), unless the kernel or
        // a seccomp filter lacks it.
        match pidfd_getfd_available(me.pid) {
            Ok(()) => {
                let got = fetch(&me, b.id(), b.raw_fd(), FdTransport::PidfdOnly, T).unwrap();
                assert_eq!(content(got), "beta");
            }
            Err(reason) => {
                let e = fetch(&me, b.id(), b.raw_fd(), FdTransport::PidfdOnly, T).unwrap_err();
                assert!(matches!(e, Error::Unsupported { .. }), "{e} ({reason})");
            }
        }
        let got = fetch(&me, b.id(), b.raw_fd(), FdTransport::PidfdThenSocket, T).unwrap();
        assert_eq!(content(got), "beta");
    }

    #[test]
    fn withdrawn_and_unknown_ids_are_refused() {
        let me = ProcessIdentity::current().unwrap();
        let keep = FdExport::new(memfd("keep")).unwrap();
        let gone = FdExport::new(memfd("gone")).unwrap();
        let (gone_id, gone_fd) = (gone.id(), gone.raw_fd());
        drop(gone);
        let e = fetch(&me, gone_id, gone_fd, FdTransport::Socket, T).unwrap_err();
        assert!(
            matches!(e, Error::FdNotOffered { id, .. } if id == gone_id),
            "{e}"
        );
        let e = fetch_many(
            &me,
            &[(keep.id(), keep.raw_fd()), (u32::MAX, 0)],
            FdTransport::Socket,
            T,
        )
        .unwrap_err();
        assert!(matches!(e, Error::FdNotOffered { id: u32::MAX, .. }), "{e}");
        let e = fetch(&me, keep.id(), -1, FdTransport::PidfdOnly, T).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        // PidfdThenSocket with a bad fd number still gets the right fd by id.
        let got = fetch(&me, keep.id(), -1, FdTransport::PidfdThenSocket, T).unwrap();
        assert_eq!(content(got), "keep");
    }

    #[test]
    fn a_reused_pid_is_reported_gone_without_connecting() {
        let mut me = ProcessIdentity::current().unwrap();
        me.start_time += 1;
        for t in [
            FdTransport::Socket,
            FdTransport::PidfdThenSocket,
            FdTransport::PidfdOnly,
        ] {
            let e = fetch(&me, 1, 3, t, T).unwrap_err();
            assert!(matches!(e, Error::PeerGone { .. }), "{t:?}: {e}");
        }
    }

    #[test]
    fn an_empty_list_needs_no_exporter() {
        let mut me = ProcessIdentity::current().unwrap();
        me.start_time += 1;
        assert!(
            fetch_many(&me, &[], FdTransport::Socket, T)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn invalid_pids_are_not_available_for_pidfd_getfd() {
        assert!(pidfd_getfd_available(0).is_err());
        assert!(pidfd_getfd_available(u32::MAX).is_err());
    }
}
